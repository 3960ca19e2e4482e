//! [`RendezvousGroup`]: ranks as threads whose point-to-point sends wait for the receiver, as
//! NCCL's do: for testing, on machines without GPUs, code that must also run over NCCL.
//!
//! Collectives go through a [`LocalGroup`]; `send` and `recv` go through a zero-capacity
//! channel per ordered pair of ranks, so a send returns only once the peer has taken the
//! message. With [`Sends::Queued`] the sends go through an [`Outbox`], as
//! `NcclGroup`'s do; with [`Sends::Rendezvous`] they are bare, as NCCL's own
//! are, and code that relies on sends not waiting deadlocks (here: times out, named).

use crate::dtype::{BufMut, BufRef, OwnedBuf, ReduceOp};
use crate::error::{CommError, OpContext, OpKind, Result};
use crate::group::{GroupOptions, ProcessGroup};
use crate::local::LocalGroup;
use crate::lock;
use crate::outbox::{Link, Outbox};
use crate::stats::CommStats;
use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a [`RendezvousGroup`]'s sends behave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sends {
    /// `send` returns once the peer has received: bare NCCL.
    Rendezvous,
    /// `send` queues the message in an [`Outbox`] and returns: kiln's `NcclGroup`.
    Queued,
}

/// A message to oneself never waits (kiln's NCCL group queues those too).
const SELF_CAPACITY: usize = 1024;

/// One zero-capacity channel per ordered pair of a group's ranks.
struct Channels {
    /// `to[src][dst]`.
    to: Vec<Vec<SyncSender<OwnedBuf>>>,
    /// `from[dst][src]`.
    from: Vec<Vec<Mutex<Receiver<OwnedBuf>>>>,
}

impl Channels {
    fn new(n: usize) -> Channels {
        let mut from: Vec<Vec<Option<Mutex<Receiver<OwnedBuf>>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        let to = (0..n)
            .map(|src| {
                (0..n)
                    .map(|dst| {
                        let (tx, rx) = sync_channel(if src == dst { SELF_CAPACITY } else { 0 });
                        from[dst][src] = Some(Mutex::new(rx));
                        tx
                    })
                    .collect()
            })
            .collect();
        let from = from
            .into_iter()
            .map(|row| row.into_iter().map(Option::unwrap).collect())
            .collect();
        Channels { to, from }
    }
}

/// The channels of every group and sub-group of one world, by key.
#[derive(Default)]
struct Registry(Mutex<HashMap<String, Arc<Channels>>>);

/// One rank's handle on threads of this process whose point-to-point sends wait for the
/// receiver, as NCCL's do ([`Sends::Rendezvous`]), or are queued in an [`Outbox`] as
/// `NcclGroup`'s are ([`Sends::Queued`]); collectives go through a [`LocalGroup`].
pub struct RendezvousGroup {
    /// The collectives, and this rank's place (rank, world size, name, timeout).
    collectives: Arc<dyn ProcessGroup>,
    key: String,
    registry: Arc<Registry>,
    channels: Arc<Channels>,
    /// `Some` for [`Sends::Queued`].
    outbox: Option<Outbox>,
    splits: Mutex<HashMap<Vec<usize>, u64>>,
    poisoned: Mutex<Option<String>>,
}

impl std::fmt::Debug for RendezvousGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RendezvousGroup")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("sends", &self.sends())
            .finish_non_exhaustive()
    }
}

impl RendezvousGroup {
    /// Handles for every rank of a new `world_size`-rank group; give one to each thread.
    ///
    /// # Panics
    /// If `world_size` is zero.
    pub fn new_world(world_size: usize, options: GroupOptions, sends: Sends) -> Vec<Self> {
        let registry = Arc::new(Registry::default());
        let key = "world".to_string();
        let channels = Arc::new(Channels::new(world_size));
        lock(&registry.0).insert(key.clone(), channels.clone());
        LocalGroup::new_world(world_size, options)
            .into_iter()
            .map(|local| {
                Self::member(
                    Arc::new(local),
                    key.clone(),
                    registry.clone(),
                    channels.clone(),
                    sends,
                )
            })
            .collect()
    }

    fn member(
        collectives: Arc<dyn ProcessGroup>,
        key: String,
        registry: Arc<Registry>,
        channels: Arc<Channels>,
        sends: Sends,
    ) -> Self {
        let (rank, world_size) = (collectives.rank(), collectives.world_size());
        let outbox = (sends == Sends::Queued).then(|| {
            let (channels, timeout) = (channels.clone(), collectives.timeout());
            let ctx = context(&*collectives);
            Outbox::new(
                collectives.name(),
                rank,
                world_size,
                timeout,
                Arc::new(move |dst| {
                    Ok(Box::new(ChannelLink {
                        to: channels.to[rank][dst].clone(),
                        ctx: ctx.clone(),
                        peer: dst,
                        timeout,
                    }) as Box<dyn Link>)
                }),
            )
        });
        RendezvousGroup {
            collectives,
            key,
            registry,
            channels,
            outbox,
            splits: Mutex::default(),
            poisoned: Mutex::default(),
        }
    }

    fn sends(&self) -> Sends {
        match self.outbox {
            Some(_) => Sends::Queued,
            None => Sends::Rendezvous,
        }
    }

    fn ctx(&self) -> OpContext {
        context(&*self.collectives)
    }

    /// Runs a point-to-point call, poisoning the group on failure.
    fn p2p(&self, f: impl FnOnce() -> Result<()>) -> Result<()> {
        if let Some(first) = lock(&self.poisoned).clone() {
            return Err(CommError::Poisoned {
                group: self.name().to_string(),
                first,
            });
        }
        f().inspect_err(|e| {
            lock(&self.poisoned).get_or_insert_with(|| e.to_string());
        })
    }

    fn peer(&self, peer: usize) -> Result<()> {
        if peer < self.world_size() {
            return Ok(());
        }
        Err(CommError::InvalidArgument {
            op: self.ctx(),
            message: format!(
                "rank {peer} is not in this {}-rank group",
                self.world_size()
            ),
        })
    }
}

fn context(g: &dyn ProcessGroup) -> OpContext {
    OpContext {
        kind: OpKind::SendRecv,
        seq: 0,
        group: g.name().to_string(),
        rank: g.rank(),
        world_size: g.world_size(),
    }
}

/// A blocking send on a rendezvous channel, polled so that it can time out.
fn send_now(
    to: &SyncSender<OwnedBuf>,
    mut msg: OwnedBuf,
    ctx: &OpContext,
    peer: usize,
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(20);
    loop {
        match to.try_send(msg) {
            Ok(()) => return Ok(()),
            Err(TrySendError::Full(m)) if Instant::now() < deadline => {
                msg = m;
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
            Err(TrySendError::Full(_)) => {
                return Err(CommError::Timeout {
                    op: ctx.clone(),
                    peer,
                    timeout,
                });
            }
            Err(TrySendError::Disconnected(_)) => {
                return Err(CommError::PeerLost {
                    op: ctx.clone(),
                    peer,
                    reason: "its receiving end is gone".into(),
                });
            }
        }
    }
}

struct ChannelLink {
    to: SyncSender<OwnedBuf>,
    ctx: OpContext,
    peer: usize,
    timeout: Duration,
}

impl Link for ChannelLink {
    fn send(&mut self, msg: &OwnedBuf) -> Result<()> {
        send_now(&self.to, msg.clone(), &self.ctx, self.peer, self.timeout)
    }
}

impl ProcessGroup for RendezvousGroup {
    fn rank(&self) -> usize {
        self.collectives.rank()
    }
    fn world_size(&self) -> usize {
        self.collectives.world_size()
    }
    fn name(&self) -> &str {
        self.collectives.name()
    }
    fn backend(&self) -> &'static str {
        "rendezvous"
    }
    fn timeout(&self) -> Duration {
        self.collectives.timeout()
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.collectives.all_reduce(buf, op)
    }
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        self.collectives.all_gather(input, output)
    }
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.collectives.reduce_scatter(input, output, op)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.collectives.broadcast(buf, root)
    }
    fn send(&self, buf: BufRef<'_>, dst: usize) -> Result<()> {
        self.p2p(|| {
            self.peer(dst)?;
            match &self.outbox {
                Some(outbox) if dst != self.rank() => outbox.send(buf, dst),
                _ => send_now(
                    &self.channels.to[self.rank()][dst],
                    buf.to_owned_buf(),
                    &self.ctx(),
                    dst,
                    self.timeout(),
                ),
            }
        })
    }
    fn recv(&self, mut buf: BufMut<'_>, src: usize) -> Result<()> {
        self.p2p(|| {
            self.peer(src)?;
            if let Some(outbox) = &self.outbox {
                outbox.check()?;
            }
            let from = lock(&self.channels.from[self.rank()][src]);
            let msg = from.recv_timeout(self.timeout()).map_err(|e| match e {
                RecvTimeoutError::Timeout => CommError::Timeout {
                    op: self.ctx(),
                    peer: src,
                    timeout: self.timeout(),
                },
                RecvTimeoutError::Disconnected => CommError::PeerLost {
                    op: self.ctx(),
                    peer: src,
                    reason: "its sending end is gone".into(),
                },
            })?;
            if msg.copy_to(&mut buf) {
                return Ok(());
            }
            Err(CommError::Mismatch {
                op: self.ctx(),
                peer: src,
                expected: format!("recv({}, {} elements)", buf.dtype(), buf.len()),
                found: format!("send({}, {} elements)", msg.dtype(), msg.len()),
            })
        })
    }
    fn barrier(&self) -> Result<()> {
        self.collectives.barrier()
    }
    fn split(&self, ranks: &[usize], name: &str) -> Result<Arc<dyn ProcessGroup>> {
        let collectives = self.collectives.split(ranks, name)?;
        let count = {
            let mut splits = lock(&self.splits);
            let c = splits.entry(ranks.to_vec()).or_insert(0);
            *c += 1;
            *c
        };
        let key = format!("{}/{ranks:?}/{count}", self.key);
        let channels = lock(&self.registry.0)
            .entry(key.clone())
            .or_insert_with(|| Arc::new(Channels::new(ranks.len())))
            .clone();
        Ok(Arc::new(Self::member(
            collectives,
            key,
            self.registry.clone(),
            channels,
            self.sends(),
        )))
    }
    fn stats(&self) -> CommStats {
        self.collectives.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run_ranks;

    fn world(n: usize, sends: Sends) -> Vec<RendezvousGroup> {
        let options = GroupOptions {
            timeout: Duration::from_millis(500),
            ..Default::default()
        };
        RendezvousGroup::new_world(n, options, sends)
    }

    /// Both ranks send to each other first, then receive.
    fn exchange(groups: Vec<RendezvousGroup>) -> Vec<Result<f32>> {
        run_ranks(groups, |g| {
            let peer = 1 - g.rank();
            g.send((&[g.rank() as f32][..]).into(), peer)?;
            let mut got = [0f32];
            g.recv((&mut got[..]).into(), peer)?;
            Ok(got[0])
        })
    }

    #[test]
    fn bare_rendezvous_sends_deadlock_and_say_so() {
        for r in exchange(world(2, Sends::Rendezvous)) {
            let e = r.unwrap_err();
            assert!(matches!(e, CommError::Timeout { .. }), "{e}");
        }
    }

    #[test]
    fn queued_sends_do_not_wait() {
        let got: Vec<f32> = exchange(world(2, Sends::Queued))
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(got, [1.0, 0.0]);
    }

    #[test]
    fn sub_groups_have_their_own_channels_and_collectives_work() {
        let out = run_ranks(world(4, Sends::Queued), |g| {
            let r = g.rank();
            let pair: Vec<usize> = if r < 2 { vec![0, 1] } else { vec![2, 3] };
            let sub = g.split(&pair, "pair").unwrap();
            let peer = 1 - sub.rank();
            sub.send((&[r as i64][..]).into(), peer).unwrap();
            let mut got = [0i64];
            sub.recv((&mut got[..]).into(), peer).unwrap();
            let mut sum = [got[0] as f32];
            g.all_reduce((&mut sum[..]).into(), ReduceOp::Sum).unwrap();
            (got[0], sum[0])
        });
        assert_eq!(out, [(1, 6.0), (0, 6.0), (3, 6.0), (2, 6.0)]);
    }

    /// kiln's conformance check (every collective and dtype, rings of sends) over sends that
    /// wait for the receiver: it passes through the outbox, and bare it fails at its first ring.
    #[test]
    fn the_conformance_check_needs_queued_sends() {
        let run = |sends| run_ranks(world(3, sends), |g| crate::selftest::run(&g));
        for r in run(Sends::Queued) {
            assert!(r.as_ref().unwrap().checks > 0, "{r:?}");
        }
        let bare = run(Sends::Rendezvous);
        assert!(
            bare.iter()
                .any(|r| r.as_ref().is_err_and(|e| e.0.contains("timed out"))),
            "{bare:?}"
        );
    }

    #[test]
    fn a_wrong_length_is_named() {
        let results = run_ranks(world(2, Sends::Queued), |g| {
            if g.rank() == 0 {
                g.send((&[1.0f32, 2.0][..]).into(), 1)
                    .and_then(|_| g.barrier())
            } else {
                let mut one = [0f32];
                let r = g.recv((&mut one[..]).into(), 0);
                g.barrier().unwrap();
                r
            }
        });
        let e = results[1].as_ref().unwrap_err().to_string();
        assert!(
            e.contains("recv(f32, 1 elements)") && e.contains("2 elements"),
            "{e}"
        );
    }
}
