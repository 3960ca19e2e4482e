//! `SimGroup`: a process group of any size in which only some ranks run.
//!
//! A plan runs one rank of each distinct role (every data-parallel and tensor-parallel rank of
//! a stage does the same work, so one rank per pipeline stage). Those ranks run as threads
//! joined by a [`LocalGroup`](kiln_comm::LocalGroup); every other rank of the job exists only
//! as a number. Collectives cost nothing and are logged (kind, payload bytes, the group's size
//! and whether it crosses nodes, and whether the rank's compute thread waited for it); small
//! buffers (control values: counts, norms, shapes, headers) get the values the simulated ranks
//! would see, each absent rank standing in for the simulated rank of its role, so the job's
//! own checks and control flow run as in a real step. Large payloads (tensors) move no bytes:
//! their values mean nothing on shapes.

use crate::shapes::{Phases, Work};
use kiln_comm::{BufMut, BufRef, CommStats, ProcessGroup, ReduceOp, Result, shard_range};
use kiln_shard::account::current_rank;
use std::cell::Cell;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Buffers of at most this many elements carry values; larger ones only count.
const SMALL: usize = 1 << 16;

/// A collective kind, as the time model prices it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Kind {
    /// All-reduce (ring: 2 (n-1)/n of the buffer each way).
    AllReduce,
    /// All-gather (the output's (n-1)/n received).
    AllGather,
    /// Reduce-scatter (the input's (n-1)/n sent).
    ReduceScatter,
    /// Broadcast.
    Broadcast,
    /// A point-to-point send (pipelines).
    Send,
}

/// One collective as the rank issued it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Collective {
    /// Which.
    pub kind: Kind,
    /// The payload's bytes: the whole buffer (all-reduce, broadcast, send; the gathered output;
    /// the scattered input).
    pub bytes: usize,
    /// Ranks in the group.
    pub ranks: usize,
    /// Whether the group spans more than one node.
    pub inter_node: bool,
    /// Whether the rank's compute thread issued it (it waits); otherwise a communication thread
    /// did, overlapping compute.
    pub blocking: bool,
}

/// What happened on a simulated rank.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub enum What {
    /// A training step began ([`kiln_shard::step_with`]).
    StepBegin,
    /// A training step ended.
    StepEnd,
    /// A collective was issued.
    Comm(Collective),
}

/// An event of a simulated rank, with the work its ops had done when it happened.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Event {
    /// What.
    pub what: What,
    /// The rank's work so far ([`crate::shapes::work_of`]).
    pub at: Work,
    /// The same by phase.
    pub phases: Phases,
}

static EVENTS: Mutex<Vec<(usize, Vec<Event>)>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Records `what` for the rank this thread works for.
pub fn record(what: What) {
    let Some(rank) = current_rank() else {
        return;
    };
    let phases = crate::shapes::phases_of(rank);
    let e = Event {
        what,
        at: phases.total(),
        phases,
    };
    let mut all = lock(&EVENTS);
    match all.iter_mut().find(|(r, _)| *r == rank) {
        Some((_, v)) => v.push(e),
        None => all.push((rank, vec![e])),
    }
}

/// The events of `rank`, taken (the log is emptied for it).
pub fn take_events(rank: usize) -> Vec<Event> {
    let mut all = lock(&EVENTS);
    match all.iter().position(|(r, _)| *r == rank) {
        Some(i) => all.remove(i).1,
        None => Vec::new(),
    }
}

thread_local! {
    static COMPUTE: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as a simulated rank's compute thread (collectives it issues block it).
pub fn mark_compute_thread() {
    COMPUTE.with(|c| c.set(true));
}

/// The layout of the simulated job: who runs, who stands for whom, where nodes end.
#[derive(Debug)]
pub struct Sim {
    /// The ranks that run (global ranks, ascending).
    pub simulated: Vec<usize>,
    /// For every global rank, the simulated rank of its role.
    pub role: Vec<usize>,
    /// Ranks per node.
    pub per_node: usize,
    /// The group implementation the job would run on (`local` for ranks as threads, `nccl`
    /// on GPUs): what the simulated groups report, so that kiln takes the same paths (on
    /// `local` and `tcp`, overlapped reductions and ZeRO-3 prefetch on communication
    /// threads; on NCCL, blocking collectives).
    pub backend: &'static str,
}

/// A group of the simulated job (see the module's docs).
#[derive(Debug)]
pub struct SimGroup {
    sim: Arc<Sim>,
    /// The group's members, as global ranks.
    members: Vec<usize>,
    /// This rank's index in `members`.
    me: usize,
    name: String,
    /// The simulated members among `members`, joined (when there are several).
    inner: Option<Arc<dyn ProcessGroup>>,
    /// `members`' indices of the simulated members, in `inner`'s order.
    simulated: Vec<usize>,
}

impl SimGroup {
    /// The world of `sim` as seen by simulated rank `rank`, over `local`: a group of the
    /// simulated ranks in `sim.simulated`'s order.
    pub fn world(sim: Arc<Sim>, rank: usize, local: Arc<dyn ProcessGroup>) -> SimGroup {
        let n = sim.role.len();
        let simulated = sim.simulated.clone();
        SimGroup {
            members: (0..n).collect(),
            me: rank,
            name: "world".into(),
            inner: (simulated.len() > 1).then_some(local),
            simulated,
            sim,
        }
    }

    fn inter_node(&self) -> bool {
        let node = |r: usize| r / self.sim.per_node.max(1);
        let first = node(self.members[0]);
        self.members.iter().any(|&r| node(r) != first)
    }

    fn log(&self, kind: Kind, bytes: usize) {
        if self.members.len() <= 1 && kind != Kind::Send {
            return;
        }
        record(What::Comm(Collective {
            kind,
            bytes,
            ranks: self.members.len(),
            inter_node: self.inter_node(),
            blocking: COMPUTE.with(Cell::get),
        }));
    }

    /// The index in `inner` of the simulated rank standing for member `m`.
    fn stand_in(&self, m: usize) -> Option<usize> {
        let who = self.sim.role[self.members[m]];
        self.simulated.iter().position(|&i| self.members[i] == who)
    }
}

impl ProcessGroup for SimGroup {
    fn rank(&self) -> usize {
        self.me
    }
    fn world_size(&self) -> usize {
        self.members.len()
    }
    fn name(&self) -> &str {
        &self.name
    }
    fn backend(&self) -> &'static str {
        self.sim.backend
    }
    fn is_simulated(&self) -> bool {
        true
    }
    fn timeout(&self) -> Duration {
        Duration::from_secs(300)
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.log(Kind::AllReduce, buf.byte_len());
        if buf.len() > SMALL || buf.is_shape() {
            return Ok(());
        }
        if let Some(inner) = &self.inner {
            return inner.all_reduce(buf, op);
        }
        // Every rank alike: a sum is n times this rank's value.
        if op == ReduceOp::Sum {
            let n = self.members.len();
            match buf {
                BufMut::F32(v) => v.iter_mut().for_each(|x| *x *= n as f32),
                BufMut::I64(v) => v.iter_mut().for_each(|x| *x *= n as i64),
                _ => {}
            }
        }
        Ok(())
    }

    fn all_gather(&self, input: BufRef<'_>, mut output: BufMut<'_>) -> Result<()> {
        self.log(Kind::AllGather, output.byte_len());
        let n = self.members.len();
        let total = output.len();
        if total > SMALL || input.is_shape() || output.is_shape() {
            return Ok(());
        }
        let size = input.dtype().size();
        // Every simulated member's input, padded to the longest shard (in i64 words).
        let longest = shard_range(total, n, 0).len();
        let words = (longest * size).div_ceil(8);
        let mut mine = vec![0i64; words];
        bytemuck::cast_slice_mut::<i64, u8>(&mut mine)[..input.as_bytes().len()]
            .copy_from_slice(input.as_bytes());
        let all = match &self.inner {
            Some(inner) => {
                let mut all = vec![0i64; words * inner.world_size()];
                inner.all_gather(BufRef::I64(&mine), BufMut::I64(&mut all))?;
                all
            }
            None => mine,
        };
        let all: &[u8] = bytemuck::cast_slice(&all);
        let out = output.as_bytes_mut();
        for m in 0..n {
            let range = shard_range(total, n, m);
            let from = self.stand_in(m).unwrap_or(0) * words * 8;
            out[range.start * size..range.end * size]
                .copy_from_slice(&all[from..from + range.len() * size]);
        }
        Ok(())
    }

    fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        mut output: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        self.log(Kind::ReduceScatter, input.byte_len());
        if input.len() > SMALL || input.is_shape() || output.is_shape() {
            return Ok(());
        }
        let size = input.dtype().size();
        let range = shard_range(input.len(), self.members.len(), self.me);
        output
            .as_bytes_mut()
            .copy_from_slice(&input.as_bytes()[range.start * size..range.end * size]);
        let _ = op;
        Ok(())
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.log(Kind::Broadcast, buf.byte_len());
        if buf.len() > SMALL || buf.is_shape() {
            return Ok(());
        }
        match (&self.inner, self.stand_in(root)) {
            (Some(inner), Some(r)) => inner.broadcast(buf, r),
            _ => Ok(()),
        }
    }

    fn send(&self, buf: BufRef<'_>, dst: usize) -> Result<()> {
        self.log(Kind::Send, buf.byte_len());
        if buf.len() > SMALL || buf.is_shape() {
            return Ok(());
        }
        match (&self.inner, self.simulated.iter().position(|&i| i == dst)) {
            (Some(inner), Some(d)) => inner.send(buf, d),
            _ => Ok(()),
        }
    }

    fn recv(&self, buf: BufMut<'_>, src: usize) -> Result<()> {
        if buf.len() > SMALL || buf.is_shape() {
            return Ok(());
        }
        match (&self.inner, self.simulated.iter().position(|&i| i == src)) {
            (Some(inner), Some(s)) => inner.recv(buf, s),
            _ => Ok(()),
        }
    }

    fn barrier(&self) -> Result<()> {
        match &self.inner {
            Some(inner) => inner.barrier(),
            None => Ok(()),
        }
    }

    fn split(&self, ranks: &[usize], name: &str) -> Result<Arc<dyn ProcessGroup>> {
        let members: Vec<usize> = ranks.iter().map(|&r| self.members[r]).collect();
        let me = ranks
            .iter()
            .position(|&r| r == self.me)
            .expect("a member splits");
        let simulated: Vec<usize> = (0..members.len())
            .filter(|&i| self.sim.simulated.contains(&members[i]))
            .collect();
        let inner = match (&self.inner, simulated.len() > 1) {
            (Some(inner), true) => {
                // The simulated members' indices in this group's inner group.
                let at: Vec<usize> = simulated
                    .iter()
                    .map(|&i| {
                        self.simulated
                            .iter()
                            .position(|&j| self.members[j] == members[i])
                            .expect("a simulated member of the parent")
                    })
                    .collect();
                Some(inner.split(&at, name)?)
            }
            _ => None,
        };
        Ok(Arc::new(SimGroup {
            sim: self.sim.clone(),
            members,
            me,
            name: name.into(),
            inner,
            simulated,
        }))
    }

    fn stats(&self) -> CommStats {
        CommStats::default()
    }
}
