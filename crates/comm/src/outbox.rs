//! [`Outbox`]: point-to-point sends that return before the receiver takes them, over links
//! whose own sends wait for it.
//!
//! kiln's groups promise that [`ProcessGroup::send`](crate::ProcessGroup::send) returns once
//! the message is handed over (TCP and threads buffer it, MPI posts an `Isend`), and code
//! relies on it: a pipeline stage sends an activation to the next stage and then waits for a
//! gradient from it, while that stage is sending the gradient. NCCL's `ncclSend` completes only
//! when the peer posts the matching `ncclRecv`, so the same code over bare NCCL deadlocks
//! (the stage's send waits for a receive the peer posts only after its own send). An `Outbox`
//! keeps the promise over such links: one thread per destination opens the link to it and
//! performs its blocking sends, in the order they were made; `send` copies the message, queues
//! it and returns. PyTorch's `ProcessGroupNCCL` gets the same effect from a communicator and
//! stream per pair of ranks and asynchronous work handles.
//!
//! The price: one host copy of each message, one thread per destination in use. A send that
//! fails is reported by the next call on the outbox (as an asynchronous error is by the next
//! collective in NCCL); [`Outbox::flush`] waits for every queued send, and dropping the outbox
//! does so too (bounded by the timeout), so that a rank's last messages are delivered before
//! its process ends.

use crate::dtype::{BufRef, OwnedBuf};
use crate::error::{CommError, OpContext, OpKind, Result};
use crate::lock;
use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One direction of a connection to a peer, whose `send` returns once the peer has received.
pub trait Link: Send {
    /// Sends `msg`, returning once the peer has received it (or failing).
    fn send(&mut self, msg: &OwnedBuf) -> Result<()>;
}

/// Opens the link to a destination rank (called on that destination's thread, at its first
/// message: opening may itself wait for the peer).
pub type OpenLink = dyn Fn(usize) -> Result<Box<dyn Link>> + Send + Sync;

/// Queued sends over links whose own sends wait for the receiver (NCCL's): one thread per
/// destination opens the link at its first message and sends in the order of `send`, which
/// copies the message and returns. A failed send is reported by the next call; dropping the
/// outbox delivers what is queued, within the timeout.
pub struct Outbox {
    /// The group's point-to-point context, for errors.
    ctx: OpContext,
    timeout: Duration,
    open: Arc<OpenLink>,
    lanes: Mutex<HashMap<usize, Lane>>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("group", &self.ctx.group)
            .field("rank", &self.ctx.rank)
            .field("queued", &lock(&self.shared.progress).queued)
            .finish_non_exhaustive()
    }
}

struct Lane {
    queue: mpsc::Sender<OwnedBuf>,
    thread: JoinHandle<()>,
}

#[derive(Default)]
struct Shared {
    progress: Mutex<Progress>,
    changed: Condvar,
}

#[derive(Default)]
struct Progress {
    /// Messages queued and not yet sent (or dropped after a failure).
    queued: usize,
    /// The first failed send: its error (handed to the first caller to see it) and its text
    /// (for every later one).
    failure: Option<(Option<CommError>, String)>,
}

impl Outbox {
    /// An outbox for rank `rank` of the `world_size`-rank group `group`; `open(dst)` opens the
    /// link to `dst`. `timeout` bounds [`Outbox::flush`] and the wait when it is dropped (each
    /// link's sends should have their own).
    pub fn new(
        group: &str,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        open: Arc<OpenLink>,
    ) -> Outbox {
        Outbox {
            ctx: OpContext {
                kind: OpKind::SendRecv,
                seq: 0,
                group: group.to_string(),
                rank,
                world_size,
            },
            timeout,
            open,
            lanes: Mutex::new(HashMap::new()),
            shared: Arc::default(),
        }
    }

    /// Queues a copy of `buf` for `dst` and returns; messages to one destination are sent in
    /// the order they were queued.
    ///
    /// # Errors
    /// An earlier queued send failed (its error, then [`CommError::Poisoned`]), or the
    /// destination's thread could not be started.
    pub fn send(&self, buf: BufRef<'_>, dst: usize) -> Result<()> {
        self.check()?;
        let msg = buf.to_owned_buf();
        let mut lanes = lock(&self.lanes);
        let lane = match lanes.entry(dst) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.start(dst)?),
        };
        lock(&self.shared.progress).queued += 1;
        if lane.queue.send(msg).is_err() {
            // The thread only ends when its queue is closed, which happens in drop: unreachable
            // while `self` is borrowed, but never a silent loss.
            self.shared.finished_one();
            return Err(CommError::PeerLost {
                op: self.ctx.clone(),
                peer: dst,
                reason: "the thread sending to this rank has ended".into(),
            });
        }
        Ok(())
    }

    fn start(&self, dst: usize) -> Result<Lane> {
        let (queue, messages) = mpsc::channel::<OwnedBuf>();
        let (open, shared) = (self.open.clone(), self.shared.clone());
        let thread = std::thread::Builder::new()
            .name(format!("kiln-send-{}-{dst}", self.ctx.rank))
            .spawn(move || {
                let mut link: Option<Box<dyn Link>> = None;
                for msg in messages {
                    if !shared.failed() {
                        let sent = match &mut link {
                            Some(l) => l.send(&msg),
                            None => open(dst).and_then(|l| link.insert(l).send(&msg)),
                        };
                        if let Err(e) = sent {
                            shared.fail(e);
                        }
                    }
                    shared.finished_one();
                }
            })
            .map_err(|e| CommError::Io {
                context: format!("starting the thread that sends to rank {dst}"),
                source: e,
            })?;
        Ok(Lane { queue, thread })
    }

    /// The error of a queued send that failed, if any: the error itself the first time, then
    /// [`CommError::Poisoned`] naming it.
    ///
    /// # Errors
    /// That failure.
    pub fn check(&self) -> Result<()> {
        let mut progress = lock(&self.shared.progress);
        match &mut progress.failure {
            None => Ok(()),
            Some((error, text)) => Err(error.take().unwrap_or_else(|| CommError::Poisoned {
                group: self.ctx.group.clone(),
                first: text.clone(),
            })),
        }
    }

    /// Waits until every queued message has been received by its peer.
    ///
    /// # Errors
    /// A send failed, or the messages were not all received within the timeout.
    pub fn flush(&self) -> Result<()> {
        self.wait(Instant::now() + self.timeout)?;
        self.check()
    }

    /// Waits until nothing is queued or a send failed; an error past `deadline`.
    fn wait(&self, deadline: Instant) -> Result<()> {
        let mut progress = lock(&self.shared.progress);
        while progress.queued > 0 && progress.failure.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    op: self.ctx.clone(),
                    peer: usize::MAX,
                    timeout: self.timeout,
                });
            }
            progress = self
                .shared
                .changed
                .wait_timeout(progress, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    /// Messages queued and not yet received.
    pub fn queued(&self) -> usize {
        lock(&self.shared.progress).queued
    }
}

impl Shared {
    fn failed(&self) -> bool {
        lock(&self.progress).failure.is_some()
    }

    fn fail(&self, e: CommError) {
        let mut progress = lock(&self.progress);
        if progress.failure.is_none() {
            let text = e.to_string();
            progress.failure = Some((Some(e), text));
        }
        self.changed.notify_all();
    }

    fn finished_one(&self) {
        lock(&self.progress).queued -= 1;
        self.changed.notify_all();
    }
}

impl Drop for Outbox {
    /// Delivers what is queued (within the timeout), then closes the queues: a rank's last
    /// messages must not die with its process. Threads still blocked past the timeout (a peer
    /// that never receives) are left to end with the process rather than hang it.
    fn drop(&mut self) {
        let _ = self.wait(Instant::now() + self.timeout);
        let lanes = std::mem::take(&mut *lock(&self.lanes));
        for (_, lane) in lanes {
            drop(lane.queue);
            if lane.thread.is_finished() || lock(&self.shared.progress).queued == 0 {
                let _ = lane.thread.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

    /// A link over a rendezvous channel: `send` returns only once the peer has taken the
    /// message, as NCCL's does.
    struct Rendezvous(SyncSender<OwnedBuf>);

    impl Link for Rendezvous {
        fn send(&mut self, msg: &OwnedBuf) -> Result<()> {
            self.0.send(msg.clone()).map_err(|_| CommError::PeerLost {
                op: OpContext {
                    kind: OpKind::SendRecv,
                    seq: 0,
                    group: "test".into(),
                    rank: 0,
                    world_size: 2,
                },
                peer: 1,
                reason: "receiver gone".into(),
            })
        }
    }

    /// Two ranks, each with a rendezvous channel to the other.
    fn pair() -> [(Arc<OpenLink>, Receiver<OwnedBuf>); 2] {
        let (to1, from0) = sync_channel::<OwnedBuf>(0);
        let (to0, from1) = sync_channel::<OwnedBuf>(0);
        let opener = |tx: SyncSender<OwnedBuf>| -> Arc<OpenLink> {
            let tx = Mutex::new(Some(tx));
            Arc::new(move |_dst| {
                let tx = lock(&tx).take().expect("each link is opened once");
                Ok(Box::new(Rendezvous(tx)) as Box<dyn Link>)
            })
        };
        [(opener(to1), from1), (opener(to0), from0)]
    }

    #[test]
    fn both_ranks_send_first_then_receive() {
        // Bare rendezvous sends deadlock here: each rank's send waits for the other's receive.
        // Through outboxes both sends return, and each rank then receives the other's message.
        let got = std::thread::scope(|s| {
            let handles: Vec<_> = pair()
                .into_iter()
                .enumerate()
                .map(|(rank, (open, inbox))| {
                    s.spawn(move || {
                        let out = Outbox::new("test", rank, 2, Duration::from_secs(10), open);
                        let mine = vec![rank as f32; 3];
                        out.send((&mine).into(), 1 - rank).unwrap();
                        let theirs = inbox.recv_timeout(Duration::from_secs(10)).unwrap();
                        out.flush().unwrap();
                        theirs
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        assert_eq!(
            got,
            [OwnedBuf::F32(vec![1.0; 3]), OwnedBuf::F32(vec![0.0; 3])]
        );
    }

    #[test]
    fn messages_to_one_destination_keep_their_order() {
        let [(open, _), (_, inbox)] = pair();
        let out = Outbox::new("test", 0, 2, Duration::from_secs(10), open);
        for i in 0..50i64 {
            out.send((&vec![i; i as usize]).into(), 1).unwrap();
        }
        for i in 0..50i64 {
            let m = inbox.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!(m, OwnedBuf::I64(vec![i; i as usize]));
        }
        out.flush().unwrap();
        assert_eq!(out.queued(), 0);
    }

    #[test]
    fn a_flush_nobody_receives_times_out_and_names_the_group() {
        let [(open, _), (_, _unread)] = pair();
        let out = Outbox::new("stages", 0, 2, Duration::from_millis(200), open);
        out.send((&[1.0f32][..]).into(), 1).unwrap();
        let e = out.flush().unwrap_err();
        assert!(matches!(e, CommError::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("stages"), "{e}");
        // Dropping waits the timeout again, then leaves the blocked thread behind.
    }

    #[test]
    fn a_failed_send_is_reported_by_the_next_call_then_poisons() {
        let [(open, _), (_, inbox)] = pair();
        drop(inbox);
        let out = Outbox::new("stages", 0, 2, Duration::from_secs(10), open);
        out.send((&[1.0f32][..]).into(), 1).unwrap();
        let e = out.flush().unwrap_err();
        assert!(matches!(e, CommError::PeerLost { .. }), "{e}");
        let e = out.send((&[2.0f32][..]).into(), 1).unwrap_err();
        assert!(
            matches!(&e, CommError::Poisoned { first, .. } if first.contains("receiver gone")),
            "{e}"
        );
    }

    #[test]
    fn a_link_that_cannot_open_is_an_error_not_a_hang() {
        let open: Arc<OpenLink> = Arc::new(|dst| {
            Err(CommError::Setup(format!(
                "no route to rank {dst} (test opener)"
            )))
        });
        let out = Outbox::new("stages", 0, 2, Duration::from_secs(10), open);
        out.send((&[1.0f32][..]).into(), 1).unwrap();
        let e = out.flush().unwrap_err();
        assert!(e.to_string().contains("no route to rank 1"), "{e}");
    }
}
