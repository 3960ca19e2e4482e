//! A rank's heartbeat: what `kiln launch` reads to tell a hung rank from its waiting peers.
//!
//! Three counters per process, each a relaxed atomic (nothing on a step's path costs more than
//! an uncontended `fetch_add`):
//! - the last training step the rank completed ([`step`], one call per step);
//! - messages received from peers (counted by the mailbox every TCP and local group receives
//!   through): progress inside a step, so a long step is not a hang;
//! - since when the rank has been waiting on a peer (set while a receive blocks).
//!
//! When `KILN_HEARTBEAT_FILE` is set (`kiln launch` sets one per rank), [`start_from_env`]
//! starts a thread that rewrites that file every `KILN_HEARTBEAT_MS` (default 200) with the
//! counters and the time. The launcher reads it: a file that stops changing is a process that
//! stopped running (SIGSTOP, a frozen machine); counters that stop while the process runs are a
//! rank stuck, and the one that is not waiting on a peer while its peers wait on it is the one
//! to name. The file is one fixed-width line, rewritten in place (a reader never sees it
//! empty):
//!
//! ```text
//! kiln-heartbeat 1 pid=4242 beat_ms=1718000000123 step=57 first_step=41 first_step_ms=1718000000001 messages=9123 waiting_ms=0
//! ```

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The variable naming this rank's heartbeat file.
pub const HEARTBEAT_FILE: &str = "KILN_HEARTBEAT_FILE";
/// The variable setting how often the file is rewritten, in milliseconds.
pub const HEARTBEAT_MS: &str = "KILN_HEARTBEAT_MS";
/// The width of the file's one line (padded with spaces).
const LINE: usize = 160;

static STEP: AtomicU64 = AtomicU64::new(0);
/// The first step this process completed, and when (a restart's resumed step + 1).
static FIRST_STEP: AtomicU64 = AtomicU64::new(0);
static FIRST_STEP_MS: AtomicU64 = AtomicU64::new(0);
static MESSAGES: AtomicU64 = AtomicU64::new(0);
/// Threads of this process blocked in a receive, and since when the first of them waits
/// (milliseconds since the epoch; 0: none).
static WAITERS: AtomicU64 = AtomicU64::new(0);
static WAITING_SINCE: AtomicU64 = AtomicU64::new(0);
static STARTED: OnceLock<Option<PathBuf>> = OnceLock::new();
/// The heartbeat file, once started: each step is written at once (one `pwrite`, a few
/// microseconds), so the launcher knows the exact step a rank reached when it died.
static FILE: OnceLock<std::fs::File> = OnceLock::new();

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Records that this rank completed training step `step` (the launcher's progress signal and
/// how it counts the steps a restart recomputes). Cheap: one atomic store.
pub fn step(step: usize) {
    if FIRST_STEP.load(Ordering::Relaxed) == 0 && step > 0 {
        FIRST_STEP_MS.store(now_ms(), Ordering::Relaxed);
        FIRST_STEP.store(step as u64, Ordering::Release);
    }
    STEP.store(step as u64, Ordering::Relaxed);
    if let Some(f) = FILE.get() {
        let _ = f.write_all_at(Beat::now().to_line().as_bytes(), 0);
    }
}

/// A message arrived from a peer.
pub(crate) fn message() {
    MESSAGES.fetch_add(1, Ordering::Relaxed);
}

/// Marks this thread as waiting on a peer until the guard drops.
pub(crate) fn waiting() -> Waiting {
    if WAITERS.fetch_add(1, Ordering::AcqRel) == 0 {
        WAITING_SINCE.store(now_ms(), Ordering::Release);
    }
    Waiting(())
}

/// See [`waiting`].
#[derive(Debug)]
pub(crate) struct Waiting(());

impl Drop for Waiting {
    fn drop(&mut self) {
        if WAITERS.fetch_sub(1, Ordering::AcqRel) == 1 {
            WAITING_SINCE.store(0, Ordering::Release);
        }
    }
}

/// The counters now, as the heartbeat file's line says them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    /// The writing process.
    pub pid: u32,
    /// When the line was written (milliseconds since the epoch).
    pub beat_ms: u64,
    /// The last training step completed (0: none yet, or the program does not report steps).
    pub step: u64,
    /// The first step this process completed (0: none yet): a resumed run's snapshot step + 1.
    pub first_step: u64,
    /// When it completed it (milliseconds since the epoch).
    pub first_step_ms: u64,
    /// Messages received from peers so far.
    pub messages: u64,
    /// Since when the process waits on a peer (milliseconds since the epoch; 0: not waiting).
    pub waiting_ms: u64,
}

impl Beat {
    /// This process's counters now.
    pub fn now() -> Beat {
        Beat {
            pid: std::process::id(),
            beat_ms: now_ms(),
            step: STEP.load(Ordering::Relaxed),
            first_step: FIRST_STEP.load(Ordering::Acquire),
            first_step_ms: FIRST_STEP_MS.load(Ordering::Relaxed),
            messages: MESSAGES.load(Ordering::Relaxed),
            waiting_ms: WAITING_SINCE.load(Ordering::Acquire),
        }
    }

    /// The file's line.
    pub fn to_line(&self) -> String {
        let mut s = format!(
            "kiln-heartbeat 1 pid={} beat_ms={} step={} first_step={} first_step_ms={} \
             messages={} waiting_ms={}",
            self.pid,
            self.beat_ms,
            self.step,
            self.first_step,
            self.first_step_ms,
            self.messages,
            self.waiting_ms
        );
        while s.len() < LINE - 1 {
            s.push(' ');
        }
        s.push('\n');
        s
    }

    /// Reads a line written by [`to_line`](Self::to_line); `None` if it is not one (a torn or
    /// foreign file).
    pub fn parse(line: &str) -> Option<Beat> {
        let mut words = line.split_whitespace();
        if words.next()? != "kiln-heartbeat" || words.next()? != "1" {
            return None;
        }
        let mut field = |name: &str| -> Option<u64> {
            words
                .next()?
                .strip_prefix(name)?
                .strip_prefix('=')?
                .parse()
                .ok()
        };
        Some(Beat {
            pid: u32::try_from(field("pid")?).ok()?,
            beat_ms: field("beat_ms")?,
            step: field("step")?,
            first_step: field("first_step")?,
            first_step_ms: field("first_step_ms")?,
            messages: field("messages")?,
            waiting_ms: field("waiting_ms")?,
        })
    }

    /// Reads the heartbeat file at `path`; `None` while it does not exist or is not one.
    pub fn read(path: &Path) -> Option<Beat> {
        Self::parse(&std::fs::read_to_string(path).ok()?)
    }
}

/// Starts the heartbeat thread if `KILN_HEARTBEAT_FILE` is set (once per process; later calls
/// do nothing). Returns the file, if any.
///
/// A file that cannot be written is said on stderr once and the job goes on without a
/// heartbeat (the launcher then cannot tell a hang, but training is unaffected).
pub fn start_from_env() -> Option<&'static Path> {
    STARTED
        .get_or_init(|| {
            let path = PathBuf::from(std::env::var_os(HEARTBEAT_FILE)?);
            let every = std::env::var(HEARTBEAT_MS)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|ms| *ms > 0)
                .unwrap_or(200);
            let file = match std::fs::OpenOptions::new()
                .create(true)
                .truncate(true)
                .write(true)
                .open(&path)
            {
                Ok(f) => f,
                Err(e) => {
                    eprintln!(
                        "kiln: cannot write the heartbeat file {} ({e}); the launcher will not \
                         see this rank's progress",
                        path.display()
                    );
                    return None;
                }
            };
            let _ = (&file).write_all(Beat::now().to_line().as_bytes());
            if let Ok(f) = file.try_clone() {
                let _ = FILE.set(f);
            }
            std::thread::Builder::new()
                .name("kiln-heartbeat".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(Duration::from_millis(every));
                        // One write of a fixed-width line at offset 0: the file never shrinks.
                        if file
                            .write_all_at(Beat::now().to_line().as_bytes(), 0)
                            .is_err()
                        {
                            return;
                        }
                    }
                })
                .ok()?;
            Some(path)
        })
        .as_deref()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beat_round_trips_through_its_line_and_foreign_lines_are_none() {
        let b = Beat {
            pid: 7,
            beat_ms: 1_700_000_000_000,
            step: 12,
            first_step: 3,
            first_step_ms: 1_700_000_000_001,
            messages: 345,
            waiting_ms: 0,
        };
        let line = b.to_line();
        assert_eq!(line.len(), LINE);
        assert_eq!(Beat::parse(&line), Some(b));
        assert_eq!(Beat::parse("hello"), None);
        assert_eq!(Beat::parse("kiln-heartbeat 2 pid=1"), None);
        assert_eq!(Beat::parse("kiln-heartbeat 1 pid=1 beat_ms=x"), None);
    }

    #[test]
    fn waiting_is_marked_while_a_guard_lives() {
        let g = waiting();
        assert_ne!(Beat::now().waiting_ms, 0);
        let h = waiting();
        drop(g);
        assert_ne!(Beat::now().waiting_ms, 0, "one thread still waits");
        drop(h);
        // Not asserted 0 now: other tests of this process may be waiting in a receive.
    }
}
