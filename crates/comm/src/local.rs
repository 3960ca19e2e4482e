//! [`LocalGroup`]: N ranks as threads of one process.
//!
//! Messages move between per-rank mailboxes in memory, through the same ring algorithms and
//! counters as [`TcpGroup`](crate::TcpGroup), so in-process tests exercise the real protocol
//! (sequence numbers, mismatch detection, timeouts) and the counters report what a
//! multi-process run would send.

use crate::group::{GroupCore, GroupOptions, delegate_process_group};
use crate::transport::{FailureNote, Header, Mailbox, Message, Transport};
use std::sync::Arc;

#[derive(Debug)]
struct LocalWorld {
    mailboxes: Vec<Mailbox>,
}

#[derive(Debug)]
struct LocalTransport {
    rank: usize,
    world: Arc<LocalWorld>,
    failure: FailureNote,
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world.mailboxes.len()
    }
    fn kind(&self) -> &'static str {
        "local"
    }
    fn send(&self, dst: usize, header: Header, payload: &[u8]) -> Result<(), String> {
        // One copy, into a buffer of the receiver's pool, which the receiver reduces from and
        // then hands back: in the pipelined ring a piece is still in cache when it is read.
        let mailbox = &self.world.mailboxes[dst];
        let payload = mailbox.pool().copy_of(payload);
        mailbox.push(self.rank, Message { header, payload });
        Ok(())
    }
    fn mailbox(&self) -> &Mailbox {
        &self.world.mailboxes[self.rank]
    }
    fn note_failure(&self, reason: &str) {
        self.failure.set(reason);
    }
}

impl Drop for LocalTransport {
    // The rank's last group handle is gone (its thread returned or unwound): peers still
    // waiting for it fail at once instead of timing out.
    fn drop(&mut self) {
        let reason = self.failure.leaving(self.rank);
        for (peer, mailbox) in self.world.mailboxes.iter().enumerate() {
            if peer != self.rank {
                mailbox.close(self.rank, reason.clone());
            }
        }
    }
}

/// One rank's handle on a group of threads in this process.
///
/// ```
/// use kiln_comm::{LocalGroup, ProcessGroup, ReduceOp};
/// let sums = kiln_comm::spawn_ranks(3, |group: LocalGroup| {
///     let mut v = vec![group.rank() as f32 + 1.0; 5];
///     group.all_reduce((&mut v[..]).into(), ReduceOp::Sum).unwrap();
///     v[0]
/// });
/// assert_eq!(sums, [6.0, 6.0, 6.0]);
/// ```
#[derive(Debug)]
pub struct LocalGroup {
    core: GroupCore,
}

impl LocalGroup {
    /// Handles for every rank of a new `world_size`-rank group; give one to each thread.
    ///
    /// # Panics
    /// If `world_size` is zero.
    pub fn new_world(world_size: usize, options: GroupOptions) -> Vec<LocalGroup> {
        assert!(world_size > 0, "a process group needs at least one rank");
        let world = Arc::new(LocalWorld {
            mailboxes: (0..world_size).map(|_| Mailbox::default()).collect(),
        });
        (0..world_size)
            .map(|rank| LocalGroup {
                core: GroupCore::world(
                    Arc::new(LocalTransport {
                        rank,
                        world: world.clone(),
                        failure: FailureNote::default(),
                    }),
                    options.clone(),
                ),
            })
            .collect()
    }

    fn from_core(core: GroupCore, _parent: &Self) -> Self {
        LocalGroup { core }
    }
}

delegate_process_group!(LocalGroup);

/// Runs `f` on `world_size` threads, one per rank, each with its [`LocalGroup`], and returns
/// their results in rank order.
///
/// Ranks that train with burn-autodiff must not share autodiff tensors (one model loaded from
/// one in-memory record into every rank, say): burn-autodiff 0.21 would put them in one graph
/// whose locks it takes in opposite orders on different threads, and deadlock.
///
/// # Panics
/// If a rank panics: after every thread has ended, with the rank and its message. (A rank
/// that panics drops its group, so the others fail fast instead of waiting for it.)
pub fn spawn_ranks<R, F>(world_size: usize, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(LocalGroup) -> R + Sync,
{
    spawn_ranks_with(world_size, GroupOptions::default(), f)
}

/// [`spawn_ranks`] with explicit group options (e.g. a short timeout in tests).
pub fn spawn_ranks_with<R, F>(world_size: usize, options: GroupOptions, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(LocalGroup) -> R + Sync,
{
    run_ranks(LocalGroup::new_world(world_size, options), f)
}

/// Runs `f` on one thread per group handle (rank `i` gets `groups[i]`: any group type, e.g. a
/// [`RendezvousGroup`](crate::RendezvousGroup) world) and returns the results in rank order.
///
/// # Panics
/// As [`spawn_ranks`].
pub fn run_ranks<G, R, F>(groups: Vec<G>, f: F) -> Vec<R>
where
    G: Send,
    R: Send,
    F: Fn(G) -> R + Sync,
{
    let world_size = groups.len();
    let f = &f;
    let outcomes: Vec<std::thread::Result<R>> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                std::thread::Builder::new()
                    .name(format!("kiln-rank-{rank}"))
                    .spawn_scoped(scope, move || f(group))
                    .expect("spawning a rank thread")
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    let mut results = Vec::with_capacity(world_size);
    let mut failures = Vec::new();
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Ok(r) => results.push(r),
            Err(payload) => {
                let msg = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "(non-string panic)".into());
                failures.push(format!("rank {rank} panicked: {msg}"));
            }
        }
    }
    if !failures.is_empty() {
        panic!("{}", failures.join("\n"));
    }
    results
}
