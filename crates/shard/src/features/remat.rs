//! Rematerialisation under a memory budget, without model changes (Dynamic Tensor
//! Rematerialization, Kirisame et al., ICLR 2021, simplified).
//!
//! Inside a recording scope (a step's forward under [`StepConfig::remat_budget`]), every float
//! op the decorator runs on whole tensors returns a [`Handle`] (a deferred value) on a [`Cell`]
//! that holds the value *and how to compute it again*: the inner backend's op, its non-tensor
//! arguments, and its inputs (other cells, or tensors kept as they are: inputs, parameters and
//! their shards, random draws). Autodiff keeps these handles for backward like any tensor.
//!
//! - A cell whose last handle is dropped (an intermediate that only its children's recipes
//!   still name) gives up its value at once.
//! - While the cells' values exceed the budget, the resident cell with the lowest
//!   `cost / (bytes x staleness)` gives up its value (cost: the element operations of its op,
//!   plus its evicted inputs', which a recomputation would pay too; staleness: ops since it
//!   was last read).
//! - Reading a cell without a value (backward, mostly) recomputes it from its inputs,
//!   recursively; a sharded parameter among them is gathered again.
//!
//! Exact by construction: a recomputation runs the same inner op on the same input values, and
//! random draws are never recorded (they are kept). Every decision is deterministic (op
//! counts, element counts, bytes: no clocks, no allocator readings), so ranks that run the same
//! shapes evict and recompute alike; this matters under ZeRO-3, where recomputing an op on a
//! sharded parameter gathers it, a collective every rank must join.
//!
//! What the budget bounds is the bytes of recorded values. Beyond it a step holds what is never
//! recorded (inputs, parameters, random draws, results of ops that return several tensors),
//! the inputs and output of the op running, and autodiff's own bookkeeping.
//!
//! [`StepConfig::remat_budget`]: crate::StepConfig::remat_budget

use crate::core::ops::{Cost, InnerOp, Recorder, local};
use crate::core::scope::{self, AnyArc, MemKind, Set, with_kind};
use crate::core::tensor::{Deferred, ShardTensor};
use burn_backend::{Backend, BackendTypes, DType, TensorMetadata};
use burn_std::Shape;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

type Prim<B> = <B as BackendTypes>::FloatTensorPrimitive;
type Op<B> = InnerOp<B>;

/// One recorded tensor: its value while resident, and its recipe.
pub(crate) struct Cell<B: Backend> {
    value: Mutex<Option<Prim<B>>>,
    parents: Vec<Parent<B>>,
    op: Op<B>,
    shape: Shape,
    dtype: DType,
    bytes: usize,
    /// What a recomputation costs, in element operations (deterministic, so that every rank
    /// makes the same decisions: a recomputation that gathers a sharded parameter is a
    /// collective).
    cost: u64,
    last_use: AtomicU64,
    /// Whether the value was computed again (rather than kept from forward).
    recomputed: std::sync::atomic::AtomicBool,
    pool: Arc<Pool>,
}

/// An input of a recorded op.
enum Parent<B: Backend> {
    /// Another recorded tensor (recomputed if evicted).
    Cell(Arc<Cell<B>>),
    /// A tensor kept as it is: an input, a parameter or its shard, a random draw.
    Kept(ShardTensor<B>),
}

/// What a recorded tensor is to the ops: a deferred value on a [`Cell`]. Shared by every
/// clone of the tensor; when the last goes, only children's recipes name the cell, and its
/// value is given up.
pub struct Handle<B: Backend> {
    cell: Arc<Cell<B>>,
}

impl<B: Backend> Drop for Handle<B> {
    fn drop(&mut self) {
        // Nothing but children's recipes names the value any more: keep only the recipe.
        self.cell.evict();
    }
}

impl<B: Backend> std::fmt::Debug for Handle<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remat")
            .field("shape", &self.cell.shape)
            .field("resident", &self.cell.resident())
            .finish()
    }
}

impl<B: Backend> Handle<B> {
    fn touch(cell: &Arc<Cell<B>>) -> Prim<B> {
        cell.last_use.store(cell.pool.tick(), Relaxed);
        cell.value()
    }

    /// The logical shape.
    pub fn shape(&self) -> Shape {
        self.cell.shape.clone()
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.cell.dtype
    }
    /// The value, recomputed if it was evicted.
    pub fn value(&self) -> Prim<B> {
        // Only reads through handles count as uses: ancestors recomputed on the way keep their
        // old staleness, so they are the first to go again rather than crowding out values
        // that backward will read.
        Handle::touch(&self.cell)
    }
}

impl<B: Backend> Deferred<B> for Handle<B> {
    fn shape(&self) -> Shape {
        self.cell.shape.clone()
    }
    fn dtype(&self) -> DType {
        self.cell.dtype
    }
    /// Reads the value.
    fn device(&self) -> B::Device {
        B::float_device(&Handle::value(self))
    }
    fn value(&self) -> Prim<B> {
        Handle::value(self)
    }
    fn held_bytes(&self) -> usize {
        self.cell.shape.num_elements() * self.cell.dtype.size()
    }
    fn is_require_grad(&self) -> bool {
        B::float_is_require_grad(&Handle::value(self))
    }
}

impl<B: Backend> Cell<B> {
    fn resident(&self) -> bool {
        self.value.lock().expect("remat cell").is_some()
    }

    fn evict(&self) -> bool {
        let dropped = self.value.lock().expect("remat cell").take();
        if dropped.is_some() {
            self.pool.resident.fetch_sub(self.bytes, Relaxed);
            self.pool.evictions.fetch_add(1, Relaxed);
            true
        } else {
            false
        }
    }

    fn value(self: &Arc<Self>) -> Prim<B> {
        if let Some(v) = self.value.lock().expect("remat cell").clone() {
            return v;
        }
        let start = Instant::now();
        let outer = self.pool.depth.fetch_add(1, Relaxed) == 0;
        let inputs = self.parents.iter().map(Parent::value).collect();
        let v = with_kind(MemKind::Activations, || (self.op)(inputs));
        self.pool.depth.fetch_sub(1, Relaxed);
        if outer {
            self.pool
                .recompute_ns
                .fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
        }
        self.pool.recomputations.fetch_add(1, Relaxed);
        // Resident again, under the budget like any value: siblings that need it soon find it
        // (an intermediate that only recipes name is not given up at once here, else every
        // read of a child would recompute the whole chain again).
        *self.value.lock().expect("remat cell") = Some(v.clone());
        self.recomputed.store(true, Relaxed);
        self.pool.resident.fetch_add(self.bytes, Relaxed);
        self.pool
            .enforce(Some(Arc::as_ptr(self) as *const ()), true);
        v
    }
}

/// Chain costs already computed in one eviction pass.
type Memo = std::collections::HashMap<*const (), u64>;

impl<B: Backend> Cell<B> {
    /// The cost of recomputing this cell's evicted ancestors (each counted once per path;
    /// memoised per eviction pass).
    fn evicted_ancestors(&self, memo: &mut Memo) -> u64 {
        let mut total = 0;
        for p in &self.parents {
            if let Parent::Cell(c) = p
                && !c.resident()
            {
                let key = Arc::as_ptr(c) as *const ();
                let chain = match memo.get(&key) {
                    Some(&v) => v,
                    None => {
                        let v = c.cost + c.evicted_ancestors(memo);
                        memo.insert(key, v);
                        v
                    }
                };
                total += chain;
            }
        }
        total
    }
}

impl<B: Backend> Parent<B> {
    fn value(&self) -> Prim<B> {
        match self {
            Parent::Cell(c) => c.value(),
            Parent::Kept(t) => local(t.clone()),
        }
    }
}

/// What the eviction policy needs of a cell, whatever its backend.
trait Evictable: Send + Sync {
    fn resident(&self) -> bool;
    fn evict(&self) -> bool;
    /// `cost / (bytes x staleness)`: the lowest is evicted first.
    fn score(&self, now: u64, memo: &mut Memo) -> f64;
    fn id(&self) -> *const ();
    fn recomputed(&self) -> bool;
}

impl<B: Backend> Evictable for Cell<B> {
    fn resident(&self) -> bool {
        Cell::resident(self)
    }
    fn evict(&self) -> bool {
        Cell::evict(self)
    }
    fn score(&self, now: u64, memo: &mut Memo) -> f64 {
        // A recomputation also recomputes every evicted ancestor up to resident ones (DTR's
        // evicted neighbourhood, ancestors' side): without it, a cheap op deep in a chain of
        // evicted values (a residual stream) looks cheap to evict and costs a whole chain.
        let cost = (self.cost + self.evicted_ancestors(memo) + 1) as f64;
        // Staleness counts linearly, as in DTR. While forward computed every intermediate
        // twice (fixed), damped forms measured better; since then, on 24 layers at a budget of
        // 1/3 of the activations (scripts/bench-remat.sh, one sitting), the time recomputing
        // per step is 0.70 s linear, 0.88 s sqrt, 1.06 s 1 + ln (the step 1.15x, 1.36x and
        // 1.41x of no remat).
        let staleness = (now.saturating_sub(self.last_use.load(Relaxed)) + 1) as f64;
        cost / (self.bytes.max(1) as f64 * staleness)
    }
    fn id(&self) -> *const () {
        self as *const Self as *const ()
    }
    fn recomputed(&self) -> bool {
        self.recomputed.load(Relaxed)
    }
}

/// The cells of one rank's step and its budget.
pub struct Pool {
    budget: usize,
    cells: Mutex<Vec<Weak<dyn Evictable>>>,
    clock: AtomicU64,
    resident: AtomicUsize,
    evictions: AtomicUsize,
    recomputations: AtomicUsize,
    recompute_ns: AtomicU64,
    /// Recomputations in progress on this pool's thread (nested ones are timed by the outer).
    depth: AtomicUsize,
    policy_ns: AtomicU64,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("budget", &self.budget)
            .field("resident", &self.resident.load(Relaxed))
            .field("stats", &self.stats())
            .finish()
    }
}

/// What rematerialisation did in a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RematStats {
    /// Values given up (to the budget, or because nothing but recipes named them).
    pub evictions: usize,
    /// Values computed again.
    pub recomputations: usize,
    /// Time spent computing them again.
    pub recompute: std::time::Duration,
    /// Time spent choosing what to give up.
    pub policy: std::time::Duration,
}

impl Pool {
    /// A pool holding recorded activations to `budget` bytes.
    pub fn new(budget: usize) -> Arc<Pool> {
        Arc::new(Pool {
            budget,
            cells: Mutex::new(Vec::new()),
            clock: AtomicU64::new(0),
            resident: AtomicUsize::new(0),
            evictions: AtomicUsize::new(0),
            recomputations: AtomicUsize::new(0),
            recompute_ns: AtomicU64::new(0),
            depth: AtomicUsize::new(0),
            policy_ns: AtomicU64::new(0),
        })
    }

    /// What the pool did so far.
    pub fn stats(&self) -> RematStats {
        RematStats {
            evictions: self.evictions.load(Relaxed),
            recomputations: self.recomputations.load(Relaxed),
            recompute: std::time::Duration::from_nanos(self.recompute_ns.load(Relaxed)),
            policy: std::time::Duration::from_nanos(self.policy_ns.load(Relaxed)),
        }
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Relaxed) + 1
    }

    /// The bytes held against the budget: the cells' values.
    fn held(&self) -> usize {
        self.resident.load(Relaxed)
    }

    fn register(&self, cell: Weak<dyn Evictable>) {
        self.cells.lock().expect("remat pool").push(cell);
    }

    /// Evicts until the budget holds or nothing is left to evict (`keep`: the cell being
    /// produced or read right now). `recomputed_only` (during backward's recomputations):
    /// only values computed again may go, never what forward kept. Forward keeps what
    /// backward will read last; evicting it for a value read now starts a cascade in which
    /// every layer's backward recomputes the layers before it.
    fn enforce(&self, keep: Option<*const ()>, recomputed_only: bool) {
        if self.held() <= self.budget {
            return;
        }
        let start = Instant::now();
        let _timed = Timed(&self.policy_ns, start);
        let now = self.clock.load(Relaxed);
        let mut cells = self.cells.lock().expect("remat pool");
        cells.retain(|c| c.strong_count() > 0);
        let mut live: Vec<Arc<dyn Evictable>> = cells.iter().filter_map(Weak::upgrade).collect();
        drop(cells);
        live.retain(|c| {
            Some(c.id()) != keep && (!recomputed_only || c.recomputed()) && c.resident()
        });
        // Cheapest first (DTR's greedy rule); scores computed once.
        let mut memo = Memo::new();
        let mut scored: Vec<(f64, Arc<dyn Evictable>)> = live
            .into_iter()
            .map(|c| (c.score(now, &mut memo), c))
            .collect();
        scored.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (_, c) in scored {
            if self.held() <= self.budget {
                break;
            }
            c.evict();
        }
    }
}

/// Runs `f` with this thread's whole-tensor float ops on backend `B` recorded into `pool`.
pub fn recording<B: Backend, R>(pool: &Arc<Pool>, f: impl FnOnce() -> R) -> R {
    scope::with(Set::Recorder(Some(recorder::<B>(pool))), f)
}

/// `pool` as the scope's recorder for backend `B` (what [`recording`] installs).
pub fn recorder<B: Backend>(pool: &Arc<Pool>) -> AnyArc {
    let r: Arc<dyn Recorder<B>> = Arc::new(Records(pool.clone()));
    Arc::new(r)
}

/// Runs `f` with this thread's ops not recorded (their results are plain tensors, kept as
/// they are, like inputs and parameters): for values cheaper to hold than to track, such as
/// weights dequantised from a 4-bit base, whose chains of lookups and layout ops would
/// otherwise fill the pool with cells for one weight each.
pub fn not_recording<R>(f: impl FnOnce() -> R) -> R {
    scope::with(Set::Recorder(None), f)
}

/// A pool as the core's [`Recorder`].
struct Records(Arc<Pool>);

impl<B: Backend> Recorder<B> for Records {
    fn record(&self, cost: Cost, inputs: Vec<ShardTensor<B>>, op: InnerOp<B>) -> ShardTensor<B> {
        record_as(&self.0, cost, inputs, op)
    }
}

/// Runs `op` on `inputs` and records the result as a cell of `pool`.
fn record_as<B: Backend>(
    pool: &Arc<Pool>,
    kind: Cost,
    inputs: Vec<ShardTensor<B>>,
    op: Op<B>,
) -> ShardTensor<B> {
    let mut parents = Vec::with_capacity(inputs.len());
    let mut values: Vec<Prim<B>> = Vec::with_capacity(inputs.len());
    for t in inputs {
        match t.deferred::<Handle<B>>() {
            Some(h) => {
                parents.push(Parent::Cell(h.cell.clone()));
                // Read before the handle goes (a read through a handle: it counts as a use):
                // when it is the last one, dropping it gives the cell's value up (only the new
                // cell's recipe names it now), and the op gets the one reference left, which
                // Flex may then reuse in place. Dropping it first would throw the value away
                // and compute it again at once.
                values.push(h.value());
                drop((h, t));
            }
            None => {
                let kept = Parent::Kept(t);
                values.push(kept.value());
                parents.push(kept);
            }
        }
    }
    let read: usize = values.iter().map(|v| v.shape().num_elements()).sum();
    let contracted = values
        .first()
        .and_then(|v| v.shape().as_slice().last().copied())
        .unwrap_or(1);
    let v = op(values);
    let (shape, dtype) = (v.shape(), v.dtype());
    let bytes = shape.num_elements() * dtype.size();
    let cost = match kind {
        Cost::Memory => read + shape.num_elements(),
        Cost::Compute => shape.num_elements() * contracted.max(1),
    } as u64;
    let cell = Arc::new(Cell {
        value: Mutex::new(Some(v)),
        parents,
        op,
        shape,
        dtype,
        bytes,
        cost,
        last_use: AtomicU64::new(pool.tick()),
        recomputed: std::sync::atomic::AtomicBool::new(false),
        pool: pool.clone(),
    });
    pool.resident.fetch_add(bytes, Relaxed);
    let weak: Weak<dyn Evictable> = Arc::downgrade(&(cell.clone() as Arc<dyn Evictable>));
    pool.register(weak);
    pool.enforce(Some(Arc::as_ptr(&cell) as *const ()), false);
    ShardTensor::Deferred(Arc::new(Handle { cell }))
}

/// Adds the time since `.1` to `.0` when dropped.
struct Timed<'a>(&'a AtomicU64, Instant);

impl Drop for Timed<'_> {
    fn drop(&mut self) {
        self.0
            .fetch_add(self.1.elapsed().as_nanos() as u64, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Tensor, TensorData};

    type K = crate::Shard<burn::backend::Flex>;
    type F = burn::backend::Flex;

    /// A chain of ops that each consume the last handle on their input (no autodiff keeps
    /// anything): under a budget nothing exceeds, nothing is computed twice and every
    /// intermediate is given up as soon as its child exists.
    #[test]
    fn intermediates_named_only_by_recipes_are_not_computed_again() {
        let pool = Pool::new(usize::MAX);
        let device = Default::default();
        let x = Tensor::<K, 2>::from_data(TensorData::new(vec![0.5f32; 64], [8, 8]), &device);
        let (y, held, stats) = recording::<F, _>(&pool, || {
            let y = ((x + 1.0) * 2.0).exp().sum_dim(1).sqrt();
            (y, pool.held(), pool.stats())
        });
        assert_eq!(stats.recomputations, 0, "{stats:?}");
        // Only the last op's value (8 f32) is resident; the four before it were given up.
        assert_eq!(held, 8 * 4);
        assert_eq!(stats.evictions, 4, "{stats:?}");
        let expected = (((0.5f32 + 1.0) * 2.0).exp() * 8.0).sqrt();
        for v in y.into_data().to_vec::<f32>().unwrap() {
            assert!((v - expected).abs() <= 1e-6 * expected, "{v} vs {expected}");
        }
    }
}
