//! Asynchronous collectives: a [`CommQueue`] runs submitted collectives on its own thread, in
//! submission order, and each submission returns a [`Work`] handle to wait on.
//!
//! This is how kiln hides communication behind computation (PyTorch's `async_op=True` and
//! DDP's bucket reduction during backward; FSDP's prefetching all-gathers): the compute thread
//! hands a collective to the queue and goes on; it blocks only when it needs the result.
//!
//! A queue owns a sub-group of all the ranks of the group it is made from (`<name>/async`), so
//! its collectives can never interleave with blocking collectives that the compute thread
//! still issues on the parent group: each communicator sees its own calls in one order. The
//! usual rule holds per queue: every rank submits the same collectives in the same order.
//!
//! Failures stay named and bounded: each collective keeps its group's timeout and peer checks,
//! and the first failure poisons the sub-group (later submissions fail fast with
//! [`CommError::Poisoned`]); a job that panics gives its [`Work`] a [`CommError::Queue`]
//! error, as does waiting on a queue whose thread is gone.

use crate::error::{CommError, Result};
use crate::group::ProcessGroup;
use std::fmt;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce(&dyn ProcessGroup) + Send>;

/// A communication thread with its own sub-group: collectives submitted to it run in order,
/// overlapping whatever the submitting thread does meanwhile.
pub struct CommQueue {
    group: Arc<dyn ProcessGroup>,
    /// `None` only while dropping.
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for CommQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommQueue")
            .field("group", &self.group.name())
            .field("rank", &self.group.rank())
            .field("world_size", &self.group.world_size())
            .finish()
    }
}

impl CommQueue {
    /// A queue over a new sub-group of all of `group`'s ranks. Like
    /// [`ProcessGroup::split`], every rank must call it, in the same order relative to its
    /// other splits of `group`.
    pub fn new(group: &dyn ProcessGroup) -> Result<CommQueue> {
        let all: Vec<usize> = (0..group.world_size()).collect();
        let group = group.split(&all, &format!("{}/async", group.name()))?;
        let (tx, rx) = channel::<Job>();
        let worker = group.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kiln-comm {} r{}", group.name(), group.rank()))
            .spawn(move || {
                for job in rx {
                    job(worker.as_ref());
                }
            })
            .map_err(|e| CommError::Queue {
                group: group.name().to_string(),
                message: format!("cannot start the communication thread: {e}"),
            })?;
        Ok(CommQueue {
            group,
            jobs: Some(tx),
            thread: Some(thread),
        })
    }

    /// The sub-group the queue's collectives run on.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// Runs `f` on the queue's thread after every earlier submission, with the queue's group;
    /// its result (or error) comes back through the returned handle. `what` names the job in
    /// errors.
    pub fn submit<T, F>(&self, what: &'static str, f: F) -> Work<T>
    where
        T: Send + 'static,
        F: FnOnce(&dyn ProcessGroup) -> Result<T> + Send + 'static,
    {
        let (tx, rx) = channel();
        let job: Job = Box::new(move |g| {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(g)))
                .unwrap_or_else(|panic| {
                    let message = panic
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| panic.downcast_ref::<&str>().copied())
                        .unwrap_or("(no message)");
                    Err(CommError::Queue {
                        group: g.name().to_string(),
                        message: format!("{what} panicked: {message}"),
                    })
                });
            // The handle may have been dropped: nobody wants the result.
            let _ = tx.send(out);
        });
        // If the thread is gone the job (and its sender) is dropped here, and waiting on the
        // handle reports it.
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
        Work {
            rx,
            what,
            group: self.group.name().to_string(),
            ready: None,
        }
    }
}

impl Drop for CommQueue {
    fn drop(&mut self) {
        // Closing the channel lets the thread finish what was submitted, then end.
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The handle of a submitted collective. Dropping it discards the result; the collective
/// still runs (every rank's queue must see the same sequence).
#[derive(Debug)]
pub struct Work<T> {
    rx: Receiver<Result<T>>,
    what: &'static str,
    group: String,
    /// The result, once [`is_ready`](Work::is_ready) has seen it.
    ready: Option<Result<T>>,
}

impl<T> Work<T> {
    /// Blocks until the collective has run and returns its result.
    pub fn wait(mut self) -> Result<T> {
        match self.ready.take() {
            Some(out) => out,
            None => self.rx.recv().unwrap_or_else(|_| Err(self.lost())),
        }
    }

    /// Whether the result is there (waiting would not block).
    pub fn is_ready(&mut self) -> bool {
        if self.ready.is_none() {
            self.ready = match self.rx.try_recv() {
                Ok(out) => Some(out),
                Err(TryRecvError::Empty) => return false,
                Err(TryRecvError::Disconnected) => Some(Err(self.lost())),
            };
        }
        true
    }

    fn lost(&self) -> CommError {
        CommError::Queue {
            group: self.group.clone(),
            message: format!(
                "{}: the communication thread is gone (the queue was dropped or its thread \
                 ended) before the collective ran",
                self.what
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GroupOptions, LocalGroup, ReduceOp, shard_range, spawn_ranks_with};
    use std::time::Duration;

    fn queue(g: &LocalGroup) -> CommQueue {
        CommQueue::new(g).unwrap()
    }

    #[test]
    fn results_come_back_in_submission_order_while_the_parent_group_is_used() {
        let out = spawn_ranks_with(3, GroupOptions::default(), |g: LocalGroup| {
            let q = queue(&g);
            let works: Vec<_> = (0..20)
                .map(|i| {
                    let v = vec![(g.rank() * 100 + i) as f32; 1000 + i];
                    q.submit("all-reduce", move |g| {
                        let mut v = v;
                        g.all_reduce((&mut v[..]).into(), ReduceOp::Sum)?;
                        Ok(v)
                    })
                })
                .collect();
            // Blocking collectives on the parent group meanwhile do not interfere.
            let mut x = vec![1.0f32; 7];
            g.all_reduce((&mut x[..]).into(), ReduceOp::Sum).unwrap();
            assert_eq!(x, vec![3.0; 7]);
            works
                .into_iter()
                .map(|w| w.wait().unwrap())
                .collect::<Vec<_>>()
        });
        for rank_out in out {
            for (i, v) in rank_out.iter().enumerate() {
                assert_eq!(v.len(), 1000 + i);
                assert!(v.iter().all(|&x| x == (300 + 3 * i) as f32), "job {i}");
            }
        }
    }

    #[test]
    fn dropped_handles_still_run_so_ranks_stay_in_step() {
        let out = spawn_ranks_with(2, GroupOptions::default(), |g: LocalGroup| {
            let q = queue(&g);
            let rank = g.rank();
            if rank == 0 {
                drop(q.submit("all-gather", |g| {
                    let mut out = vec![0.0f32; 4];
                    g.all_gather((&[1.0f32, 2.0][..]).into(), (&mut out[..]).into())?;
                    Ok(out)
                }));
            } else {
                let w = q.submit("all-gather", |g| {
                    let mut out = vec![0.0f32; 4];
                    g.all_gather((&[3.0f32, 4.0][..]).into(), (&mut out[..]).into())?;
                    Ok(out)
                });
                assert_eq!(w.wait().unwrap(), [1.0, 2.0, 3.0, 4.0]);
            }
            q.submit("reduce-scatter", move |g| {
                let input = [1.0f32; 5];
                let mut out = vec![0.0f32; shard_range(5, 2, rank).len()];
                g.reduce_scatter((&input[..]).into(), (&mut out[..]).into(), ReduceOp::Sum)?;
                Ok(out)
            })
            .wait()
            .unwrap()
        });
        assert_eq!(out, [vec![2.0; 3], vec![2.0; 2]]);
    }

    #[test]
    fn a_mismatch_is_named_and_poisons_later_submissions() {
        let errors = spawn_ranks_with(
            2,
            GroupOptions::default().with_timeout(Duration::from_secs(5)),
            |g: LocalGroup| {
                let q = queue(&g);
                let first = if g.rank() == 0 {
                    q.submit("all-reduce", |g| {
                        let mut v = [1.0f32; 8];
                        g.all_reduce((&mut v[..]).into(), ReduceOp::Sum)
                    })
                } else {
                    q.submit("broadcast", |g| {
                        let mut v = [1.0f32; 8];
                        g.broadcast((&mut v[..]).into(), 0)
                    })
                };
                let second = q.submit("barrier", |g| g.barrier());
                (
                    first.wait().unwrap_err().to_string(),
                    second.wait().unwrap_err().to_string(),
                )
            },
        );
        for (first, second) in errors {
            assert!(first.contains("mismatched collective"), "{first}");
            assert!(first.contains("world/async"), "{first}");
            assert!(
                second.contains("unusable after an earlier failure"),
                "{second}"
            );
        }
    }

    #[test]
    fn a_peer_that_never_submits_times_out() {
        let out = spawn_ranks_with(
            2,
            GroupOptions::default().with_timeout(Duration::from_millis(300)),
            |g: LocalGroup| {
                let q = queue(&g);
                if g.rank() == 0 {
                    let w = q.submit("all-reduce", |g| {
                        let mut v = [1.0f32; 8];
                        g.all_reduce((&mut v[..]).into(), ReduceOp::Sum)
                    });
                    Some(w.wait().unwrap_err().to_string())
                } else {
                    // Keep the group alive past the peer's timeout without submitting.
                    std::thread::sleep(Duration::from_millis(600));
                    None
                }
            },
        );
        let err = out[0].as_ref().unwrap();
        assert!(err.contains("timed out"), "{err}");
        assert!(err.contains("all_reduce"), "{err}");
    }

    #[test]
    fn a_panicking_job_is_an_error_and_the_queue_goes_on() {
        let g = LocalGroup::new_world(1, GroupOptions::default()).remove(0);
        let q = queue(&g);
        let w = q.submit("bad job", |_| -> Result<()> { panic!("boom") });
        let err = w.wait().unwrap_err().to_string();
        assert!(err.contains("bad job panicked: boom"), "{err}");
        let mut ok = q.submit("fine", |g| Ok(g.world_size()));
        while !ok.is_ready() {
            std::thread::yield_now();
        }
        assert_eq!(ok.wait().unwrap(), 1);
    }
}
