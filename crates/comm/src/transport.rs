//! Message transport under the collectives: framed messages, per-peer mailboxes, and the
//! `Transport` trait that the local (threads) and TCP (processes) groups implement.
//!
//! Every message carries the header of the operation that sent it, so a receiver detects a
//! peer that called a different collective (or the same one with other arguments) instead of
//! mixing their data. Mailboxes are filled by the transport as messages arrive (a reader thread
//! per TCP connection), so a send never waits for the receiver: ring algorithms can send and
//! then receive without the classic TCP buffer deadlock.

use crate::dtype::DType;
use crate::error::OpKind;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// Collective traffic and point-to-point traffic queue separately, so a `send` issued before a
/// collective does not block that collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Lane {
    Collective = 0,
    P2p = 1,
    /// A rank's last word before it leaves: the payload is the reason, as UTF-8.
    Goodbye = 2,
}

/// What a message belongs to. Fixed-size on the wire (`Header::WIRE` bytes, little endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub group: u64,
    pub lane: Lane,
    pub kind: OpKind,
    pub dtype: DType,
    /// Reduce op code, or 0.
    pub op: u8,
    /// Root of a broadcast, or 0.
    pub root: u32,
    pub seq: u64,
    /// Elements of the whole collective (the logical buffer), for mismatch detection.
    pub total: u64,
    /// Algorithm step.
    pub step: u32,
    pub payload_len: u64,
}

impl Header {
    pub const WIRE: usize = 48;
    const MAGIC: u16 = 0x4b4c; // "KL"

    pub fn encode(&self) -> [u8; Self::WIRE] {
        let mut b = [0u8; Self::WIRE];
        b[0..2].copy_from_slice(&Self::MAGIC.to_le_bytes());
        b[2] = self.lane as u8;
        b[3] = self.kind.code();
        b[4] = self.dtype.code();
        b[5] = self.op;
        b[8..16].copy_from_slice(&self.group.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.total.to_le_bytes());
        b[32..36].copy_from_slice(&self.root.to_le_bytes());
        b[36..40].copy_from_slice(&self.step.to_le_bytes());
        b[40..48].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::WIRE]) -> Result<Self, String> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        if u16::from_le_bytes([b[0], b[1]]) != Self::MAGIC {
            return Err("corrupt message header (bad magic): is a non-kiln peer connected?".into());
        }
        Ok(Header {
            lane: match b[2] {
                0 => Lane::Collective,
                1 => Lane::P2p,
                2 => Lane::Goodbye,
                other => return Err(format!("corrupt message header: lane {other}")),
            },
            kind: OpKind::from_code(b[3]).ok_or("corrupt message header: kind")?,
            dtype: DType::from_code(b[4]).ok_or("corrupt message header: dtype")?,
            op: b[5],
            group: u64_at(8),
            seq: u64_at(16),
            total: u64_at(24),
            root: u32_at(32),
            step: u32_at(36),
            payload_len: u64_at(40),
        })
    }
}

/// A header and its payload bytes.
#[derive(Debug)]
pub(crate) struct Message {
    pub header: Header,
    pub payload: Payload,
}

/// Received bytes in a buffer borrowed from a [`BufPool`]; dropping the payload returns the
/// buffer, so a collective's thousands of pieces reuse a handful of allocations instead of
/// faulting in fresh pages for each.
#[derive(Debug)]
pub(crate) struct Payload {
    /// Always fully initialised; only the first `len` bytes are the payload.
    buf: Vec<u8>,
    len: usize,
    pool: Option<Arc<BufPool>>,
}

impl Payload {
    /// A payload that owns `bytes` outright (no pool).
    #[cfg(test)]
    pub fn owned(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Payload {
            buf: bytes,
            len,
            pool: None,
        }
    }

    /// The payload's bytes, to be filled by a reader.
    pub fn as_mut(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

impl std::ops::Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.put(std::mem::take(&mut self.buf));
        }
    }
}

/// Reusable receive buffers. Buffers keep their full length (zeroed once, when allocated), so
/// reusing one costs no memset.
#[derive(Debug, Default)]
pub(crate) struct BufPool {
    free: Mutex<Vec<Vec<u8>>>,
}

impl BufPool {
    /// Buffers above this size are not kept: large one-off messages (p2p, unpipelined sends)
    /// would pin memory. Collectives' pieces are well below it.
    const MAX_KEPT_BYTES: usize = 1 << 20;
    /// A collective has a few pieces in flight per peer; at most 16 MiB stays pooled.
    const MAX_KEPT: usize = 16;

    /// A payload of `len` bytes (contents unspecified).
    pub fn take(self: &Arc<Self>, len: usize) -> Payload {
        let reused = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            free.iter()
                .position(|b| b.len() >= len)
                .map(|i| free.swap_remove(i))
        };
        let buf = reused.unwrap_or_else(|| vec![0u8; len]);
        Payload {
            buf,
            len,
            pool: (len <= Self::MAX_KEPT_BYTES).then(|| self.clone()),
        }
    }

    /// A payload holding a copy of `bytes`.
    pub fn copy_of(self: &Arc<Self>, bytes: &[u8]) -> Payload {
        let mut p = self.take(bytes.len());
        p.as_mut().copy_from_slice(bytes);
        p
    }

    fn put(&self, buf: Vec<u8>) {
        if buf.len() > Self::MAX_KEPT_BYTES {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < Self::MAX_KEPT {
            free.push(buf);
        }
    }
}

/// Why a receive failed.
#[derive(Debug)]
pub(crate) enum RecvError {
    Timeout,
    Closed(String),
}

#[derive(Debug, Default)]
struct MailboxState {
    queues: HashMap<(u64, usize, Lane), VecDeque<Message>>,
    /// Peers (global ranks) whose connection or thread is gone, with the reason.
    closed: HashMap<usize, String>,
}

/// Messages that arrived for one rank, queued per (group, source rank, lane).
#[derive(Debug, Default)]
pub(crate) struct Mailbox {
    state: Mutex<MailboxState>,
    arrived: Condvar,
    /// Buffers that messages for this rank arrive in.
    pool: Arc<BufPool>,
}

impl Mailbox {
    /// The buffers that messages for this rank are received into.
    pub fn pool(&self) -> &Arc<BufPool> {
        &self.pool
    }

    pub fn push(&self, src: usize, msg: Message) {
        let mut state = crate::lock(&self.state);
        let key = (msg.header.group, src, msg.header.lane);
        state.queues.entry(key).or_default().push_back(msg);
        drop(state);
        self.arrived.notify_all();
    }

    /// Marks `src` as gone: once its queued messages are consumed, receives from it fail.
    pub fn close(&self, src: usize, reason: String) {
        let mut state = crate::lock(&self.state);
        state.closed.entry(src).or_insert(reason);
        drop(state);
        self.arrived.notify_all();
    }

    /// Takes the next message of `(group, src, lane)`, waiting until `deadline`.
    pub fn recv(
        &self,
        group: u64,
        src: usize,
        lane: Lane,
        deadline: Instant,
    ) -> Result<Message, RecvError> {
        let mut state = crate::lock(&self.state);
        // Set while this thread blocks: the launcher's heartbeat tells a rank that waits on
        // its peers from one that is stuck (crate::progress).
        let mut waiting = None;
        loop {
            if let Some(msg) = state
                .queues
                .get_mut(&(group, src, lane))
                .and_then(VecDeque::pop_front)
            {
                crate::progress::message();
                return Ok(msg);
            }
            if let Some(reason) = state.closed.get(&src) {
                return Err(RecvError::Closed(reason.clone()));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RecvError::Timeout);
            }
            waiting.get_or_insert_with(crate::progress::waiting);
            state = self
                .arrived
                .wait_timeout(state, deadline - now)
                .expect("mailbox lock")
                .0;
        }
    }
}

/// Moves messages between the ranks of a world. Ranks here are global (world) ranks.
pub(crate) trait Transport: Send + Sync + std::fmt::Debug + 'static {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// "local" or "tcp".
    fn kind(&self) -> &'static str;
    /// Delivers `payload` under `header` (whose `payload_len` must be `payload.len()`) to
    /// `dst`'s mailbox; never waits for `dst` to receive it. The bytes are copied (or
    /// written to the socket) before it returns, so the caller may reuse them at once.
    fn send(&self, dst: usize, header: Header, payload: &[u8]) -> Result<(), String>;
    fn mailbox(&self) -> &Mailbox;
    /// Records why this rank's group failed, so that peers learn the cause when this rank
    /// goes away (rather than only that it went away).
    fn note_failure(&self, reason: &str);
}

/// The first failure recorded on a transport.
#[derive(Debug, Default)]
pub(crate) struct FailureNote(Mutex<Option<String>>);

impl FailureNote {
    pub fn set(&self, reason: &str) {
        let mut note = self.0.lock().unwrap_or_else(|e| e.into_inner());
        note.get_or_insert_with(|| reason.to_string());
    }
    /// Why this rank is leaving, as its peers will read it.
    pub fn leaving(&self, rank: usize) -> String {
        if std::thread::panicking() {
            return format!("rank {rank}'s thread panicked");
        }
        match &*self.0.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(reason) => format!("rank {rank} failed: {reason}"),
            None => format!("rank {rank} dropped its process group"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn header() -> Header {
        Header {
            group: 0xdead_beef,
            lane: Lane::P2p,
            kind: OpKind::ReduceScatter,
            dtype: DType::BF16,
            op: 2,
            root: 3,
            seq: 99,
            total: 1 << 40,
            step: 5,
            payload_len: 12,
        }
    }

    #[test]
    fn header_round_trips() {
        let h = header();
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[0] = 0;
        assert!(Header::decode(&bad).is_err());
    }

    #[test]
    fn closed_peer_fails_only_after_its_queue_drains() {
        let mb = Mailbox::default();
        mb.push(
            1,
            Message {
                header: Header {
                    lane: Lane::Collective,
                    ..header()
                },
                payload: Payload::owned(vec![1]),
            },
        );
        mb.close(1, "gone".into());
        let deadline = Instant::now() + Duration::from_secs(1);
        assert!(mb.recv(0xdead_beef, 1, Lane::Collective, deadline).is_ok());
        assert!(matches!(
            mb.recv(0xdead_beef, 1, Lane::Collective, deadline),
            Err(RecvError::Closed(_))
        ));
    }

    #[test]
    fn payloads_return_their_buffers_to_the_pool() {
        let pool = Arc::new(BufPool::default());
        let first = pool.copy_of(&[7u8; 100]);
        let addr = first.as_ptr();
        drop(first);
        // A smaller payload reuses the buffer, without clearing it first.
        let again = pool.take(10);
        assert_eq!(again.as_ptr(), addr);
        assert_eq!(again.len(), 10);
        assert_eq!(&again[..], &[7u8; 10]);
    }

    #[test]
    fn recv_times_out() {
        let mb = Mailbox::default();
        let deadline = Instant::now() + Duration::from_millis(20);
        assert!(matches!(
            mb.recv(1, 0, Lane::P2p, deadline),
            Err(RecvError::Timeout)
        ));
    }
}
