//! ZeRO-3 parameter prefetch: all-gathers issued ahead of use, in the order of the previous
//! step (FSDP2 records its modules' order on the first iteration; replaying the last step's
//! order instead also forgets one-off gathers, such as reading the weights before training).
//!
//! Every use of a sharded parameter gathers it (forward, and backward where autodiff saved
//! the shard). A model's gathers come in the same order every step, and on every rank (SPMD),
//! so from the second step on each gather can start the next ones on the model's communication
//! queue and the compute thread finds them done, or nearly, when it gets there. Every rank
//! takes the same decisions from the same sequence, so the queues of all ranks carry the same
//! collectives in the same order, as they must.
//!
//! Staleness: a prefetch reads the shard registered for a parameter when its parameters were
//! last marked (`shard`, or the optimizer step through `apply_marks`); an optimizer step
//! starts by forgetting the registered shards and dropping what is in flight, so nothing
//! gathered before a step is used after it. A parameter replaced otherwise (a plain Burn
//! optimizer, a user's mapper) carries the plain gather, so its gathers never use a prefetched
//! result.
//!
//! How a shard finds its model's queue: a parameter's shard carries [`Tagged`] ops (the
//! parameter's id and value version, and the model, weakly), which the core calls to gather it.

use crate::core::dtype::{narrow, narrowed_dtype};
use crate::core::host::{Host, read_host};
use crate::core::scope::{MemKind, on_queue, waiting, with_kind};
use crate::core::tensor::{Prim, ShardOps, ShardTensor, Sharded, ViewOp};
use crate::features::zero::{all_gather_host, gather_dtype, view, whole_from_host};
use burn_backend::distributed::DistributedParamId;
use burn_backend::{Backend, TensorMetadata};
use burn_std::FloatDType;
use kiln_comm::{CommQueue, Work};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// A model's prefetching: its communication queue, the budget of bytes in flight, the state.
pub(crate) struct Prefetcher<B: Backend> {
    queue: Arc<CommQueue>,
    budget: usize,
    state: Mutex<Prefetch<B>>,
}

impl<B: Backend> Prefetcher<B> {
    /// Prefetching on `queue`, up to `budget` bytes of whole parameters in flight.
    pub fn new(queue: Arc<CommQueue>, budget: usize) -> Arc<Self> {
        Arc::new(Prefetcher {
            queue,
            budget,
            state: Mutex::default(),
        })
    }

    /// The state.
    pub fn lock(&self) -> MutexGuard<'_, Prefetch<B>> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The ops a parameter's shard carries in a model with a communication queue: its gathers go
/// through the queue, served by the all-gathers prefetched in the previous step's order.
pub(crate) struct Tagged<B: Backend> {
    /// How any other shard of its layout is gathered.
    base: Arc<dyn ShardOps<B>>,
    prefetcher: Weak<Prefetcher<B>>,
    /// The parameter's gradient-sync id.
    id: DistributedParamId,
    /// The model's optimizer steps when the value was registered: a prefetch serves only the
    /// version it was gathered from, so a copy of the model kept from before a step (an EMA, a
    /// snapshot) never receives newer values.
    version: u64,
}

impl<B: Backend> std::fmt::Debug for Tagged<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tagged")
            .field("id", &self.id)
            .field("version", &self.version)
            .finish()
    }
}

impl<B: Backend> ShardOps<B> for Tagged<B> {
    fn gather(&self, s: &Sharded<B>) -> Prim<B> {
        match self.prefetcher.upgrade() {
            Some(p) => {
                let work = gather(&p, self.id, self.version, s);
                whole_from_host(s, waiting(|| work.wait()))
            }
            None => self.base.gather(s),
        }
    }

    fn view(&self, s: Sharded<B>, op: ViewOp) -> ShardTensor<B> {
        view(s, op)
    }

    fn derived(&self) -> Arc<dyn ShardOps<B>> {
        self.base.derived()
    }
}

/// A model's prefetch state.
pub(crate) struct Prefetch<B: Backend> {
    /// The current shard of each tagged parameter.
    shards: HashMap<DistributedParamId, Sharded<B>>,
    /// The gathers of the previous step, in order (a parameter used twice appears twice).
    order: Vec<DistributedParamId>,
    /// The gathers of this step so far.
    recording: Vec<DistributedParamId>,
    /// Where in `order` the last gather was.
    pos: Option<usize>,
    /// `order[..issued]` has been issued (or passed).
    issued: usize,
    in_flight: VecDeque<Gather>,
    /// Optimizer steps so far: the version of the registered shards.
    version: u64,
    /// Gathers of tagged parameters, and how many found their all-gather already issued.
    pub stats: PrefetchStats,
}

/// How many parameter gathers a model made through its communication queue, and how many of
/// them had been prefetched (see [`prefetch_stats`](crate::account::prefetch_stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Gathers of parameters (forward and backward).
    pub gathers: u64,
    /// Of those, served by an all-gather issued ahead.
    pub prefetched: u64,
}

struct Gather {
    id: DistributedParamId,
    /// The dtype the shard was sent in (the compute dtype of the policy that issued it).
    dtype: FloatDType,
    bytes: usize,
    work: Work<Host>,
}

impl<B: Backend> Default for Prefetch<B> {
    fn default() -> Self {
        Prefetch {
            shards: HashMap::new(),
            order: Vec::new(),
            recording: Vec::new(),
            pos: None,
            issued: 0,
            in_flight: VecDeque::new(),
            version: 0,
            stats: PrefetchStats::default(),
        }
    }
}

impl<B: Backend> Prefetch<B> {
    /// The parameters are about to change (an optimizer step): forget their shards and what
    /// was gathered from them; this step's gathers are the next step's order.
    pub fn invalidate(&mut self) {
        self.version += 1;
        self.shards.clear();
        self.in_flight.clear();
        self.pos = None;
        self.issued = 0;
        if !self.recording.is_empty() {
            self.order = std::mem::take(&mut self.recording);
        }
    }

    /// Where `id` is gathered in `order`: the next occurrence after the last gather, else the
    /// first (a new step, or an evaluation pass that used only part of the order).
    fn locate(&self, id: DistributedParamId) -> Option<usize> {
        let from = self.pos.map_or(0, |p| p + 1);
        self.order[from..]
            .iter()
            .position(|&o| o == id)
            .map(|i| from + i)
            .or_else(|| self.order.iter().position(|&o| o == id))
    }
}

/// `t` as the current value of parameter `mark` of the model `prefetcher` serves: a shard is
/// tagged with the parameter and its version and registered for prefetching; anything else is
/// unchanged.
pub(crate) fn track<B: Backend>(
    prefetcher: &Arc<Prefetcher<B>>,
    mark: DistributedParamId,
    t: ShardTensor<B>,
) -> ShardTensor<B> {
    match t {
        ShardTensor::Sharded(mut s) => {
            let mut p = prefetcher.lock();
            s.ops = Arc::new(Tagged {
                base: s.ops.derived(),
                prefetcher: Arc::downgrade(prefetcher),
                id: mark,
                version: p.version,
            });
            p.shards.insert(mark, s.clone());
            ShardTensor::Sharded(s)
        }
        t => t,
    }
}

/// The all-gather of parameter `id`'s shard `s` (value `version`) on the model's queue: the
/// prefetch in flight for it, or issued now; the next parameters are prefetched.
fn gather<B: Backend>(
    prefetcher: &Prefetcher<B>,
    id: DistributedParamId,
    version: u64,
    s: &Sharded<B>,
) -> Work<Host> {
    let queue = &prefetcher.queue;
    let mut p = prefetcher.lock();
    if version != p.version {
        // A value from before the last step (a copy kept aside): gathered on its own, and
        // not part of the order.
        drop(p);
        return submit(queue, s, gather_dtype());
    }
    next(&mut p, queue, id, s, prefetcher.budget)
}

/// The all-gather of the current value of `id` (prefetched, or issued now), recording the
/// gather and issuing the next ones.
fn next<B: Backend>(
    p: &mut Prefetch<B>,
    queue: &CommQueue,
    id: DistributedParamId,
    s: &Sharded<B>,
    budget: usize,
) -> Work<Host> {
    {
        let dtype = gather_dtype();
        let ahead = take_in_flight(p, id, dtype);
        p.stats.gathers += 1;
        p.stats.prefetched += u64::from(ahead.is_some());
        let work = ahead.unwrap_or_else(|| submit(queue, s, dtype));
        // Bounded, for a model that is only ever evaluated (no step ends the recording).
        if p.recording.len() < MAX_ORDER {
            p.recording.push(id);
        }
        let before = p.pos;
        p.pos = p.locate(id);
        match (before, p.pos) {
            // Back to an earlier place (the next micro-batch, an evaluation pass): what is in
            // flight belongs to the rest of the last pass.
            (Some(b), Some(pos)) if pos <= b => {
                p.in_flight.clear();
                p.issued = pos + 1;
            }
            (_, Some(pos)) => p.issued = p.issued.max(pos + 1),
            (_, None) => {}
        }
        if p.pos.is_some() {
            issue_next(p, queue, budget, dtype);
        }
        work
    }
}

/// The prefetch of `id` if it is in flight; earlier prefetches that were not used (the order
/// changed, e.g. an evaluation pass) are dropped: they still run, identically on every rank.
fn take_in_flight<B: Backend>(
    p: &mut Prefetch<B>,
    id: DistributedParamId,
    dtype: FloatDType,
) -> Option<Work<Host>> {
    // A prefetch sent in another dtype (issued under another precision policy) is not used.
    let at = p
        .in_flight
        .iter()
        .position(|g| g.id == id && g.dtype == dtype)?;
    p.in_flight.drain(..at);
    p.in_flight.pop_front().map(|g| g.work)
}

/// After an optimizer step: the first gathers of the next step are issued at once, from the
/// new shards (registered by then).
pub(crate) fn prime<B: Backend>(prefetcher: &Prefetcher<B>) {
    let mut p = prefetcher.lock();
    p.pos = None;
    p.issued = 0;
    issue_next(&mut p, &prefetcher.queue, prefetcher.budget, gather_dtype());
}

/// The longest order recorded.
const MAX_ORDER: usize = 1 << 20;

/// Issues the gathers that follow in the order, up to `budget` bytes in flight.
fn issue_next<B: Backend>(
    p: &mut Prefetch<B>,
    queue: &CommQueue,
    budget: usize,
    dtype: FloatDType,
) {
    if budget == 0 {
        return;
    }
    let mut bytes: usize = p.in_flight.iter().map(|g| g.bytes).sum();
    while p.issued < p.order.len() && (p.in_flight.is_empty() || bytes < budget) {
        let id = p.order[p.issued];
        let Some(shard) = p.shards.get(&id) else {
            // Not registered (yet): stop here rather than skip, so the order stays simple.
            return;
        };
        let size = shard.numel() * narrowed_dtype(shard.shard.dtype(), dtype).size();
        let work = submit(queue, shard, dtype);
        p.in_flight.push_back(Gather {
            id,
            dtype,
            bytes: size,
            work,
        });
        bytes += size;
        p.issued += 1;
    }
}

/// Hands the all-gather of `s` to the queue. The shard is read here (on the compute thread,
/// which owns the inner backend's tensors); the whole buffer is made on the queue's thread,
/// counted for this rank as a gathered parameter.
fn submit<B: Backend>(queue: &CommQueue, s: &Sharded<B>, dtype: FloatDType) -> Work<Host> {
    let host = with_kind(MemKind::Comm, || {
        read_host::<B>(narrow::<B>(s.shard.clone(), dtype))
    });
    let numel = s.numel();
    on_queue(queue, "all-gather (prefetch)", move |g| {
        all_gather_host(g, &host, numel)
    })
}
