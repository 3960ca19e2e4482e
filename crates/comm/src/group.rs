//! The [`ProcessGroup`] trait and the collective algorithms shared by the local and TCP groups.
//!
//! The algorithms are bandwidth-optimal rings (Patarasuk & Yuan 2009, as in Horovod, Gloo and
//! NCCL's ring): all-reduce is a reduce-scatter followed by an all-gather, each of `N-1` steps
//! moving `1/N` of the buffer, so every rank sends `2 (N-1)/N` of the buffer in all.
//! Results are bitwise identical on every rank (each chunk is reduced on one rank, then copied).

use crate::dtype::{BufMut, BufRef, DType, Element, ReduceOp, bytes_as, reduce_into};
use crate::error::{CommError, OpContext, OpKind, Result};
use crate::hash::Fnv1a;
use crate::shard::shard_range;
use crate::stats::{CommStats, Counters};
use crate::transport::{Header, Lane, Payload, RecvError, Transport};
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A group of ranks that communicate: the one communication interface of kiln.
///
/// Every collective must be called by every rank of the group, in the same order, with
/// matching arguments (same element type and length; the same `op` and `root`). A rank that
/// waits longer than the group's [`timeout`](ProcessGroup::timeout) gets
/// [`CommError::Timeout`]; a peer that is gone gives [`CommError::PeerLost`]; a peer that
/// called something else gives [`CommError::Mismatch`]. After any such error the group is
/// unusable ([`CommError::Poisoned`]), as an NCCL communicator is after an abort.
///
/// Buffers split over the group ([`all_gather`](ProcessGroup::all_gather),
/// [`reduce_scatter`](ProcessGroup::reduce_scatter)) use [`shard_range`]: any length works,
/// shards differ by at most one element.
pub trait ProcessGroup: AsAny + Send + Sync + fmt::Debug {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// The number of ranks in the group.
    fn world_size(&self) -> usize;
    /// The group's name, used in errors ("world", "dp_shard", ...).
    fn name(&self) -> &str;
    /// The implementation: "local", "tcp" or "nccl".
    fn backend(&self) -> &'static str;
    /// How long a rank waits for a peer before failing.
    fn timeout(&self) -> Duration;

    /// Combines `buf` across the group, in place, on every rank.
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Concatenates every rank's shard: `input` is this rank's shard of `output`
    /// (`shard_range(output.len(), world_size, rank)`), `output` receives the whole buffer.
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()>;
    /// Combines `input` (the whole buffer, on every rank) and leaves this rank's shard of the
    /// result in `output` (`shard_range(input.len(), world_size, rank)`).
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()>;
    /// Copies `buf` from rank `root` to every rank.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()>;
    /// Sends `buf` to rank `dst`, which must call [`recv`](ProcessGroup::recv) with the same length.
    /// Returns once the data is handed to the transport (it may not have arrived yet), on every
    /// kiln group (NCCL's sends wait for the receiver: `NcclGroup` queues them in an
    /// [`Outbox`](crate::Outbox)), so a rank may send before it receives whatever its peer does,
    /// also while another of its threads waits in [`recv`](ProcessGroup::recv) on this group.
    fn send(&self, buf: BufRef<'_>, dst: usize) -> Result<()>;
    /// Receives into `buf` what rank `src` sent; messages between two ranks arrive in order.
    fn recv(&self, buf: BufMut<'_>, src: usize) -> Result<()>;
    /// Sends `send` to `dst` and receives into `recv` what `src` sends, as one call that
    /// cannot deadlock whatever the peers' order: a ring (`dst = rank + 1`, `src = rank - 1`)
    /// or a pairwise exchange. `dst == src == rank` copies. The default suits transports whose
    /// `send` returns before the data is received.
    fn send_recv(&self, send: BufRef<'_>, dst: usize, recv: BufMut<'_>, src: usize) -> Result<()> {
        self.send(send, dst)?;
        self.recv(recv, src)
    }
    /// Returns once every rank of the group has called it.
    fn barrier(&self) -> Result<()>;

    /// A sub-group of the ranks `ranks` (indices in this group, ascending order not required;
    /// this rank must be one of them). Every member must call it, in the same order relative
    /// to its other `split` calls; non-members need not. The new group's ranks follow the
    /// order of `ranks`.
    fn split(&self, ranks: &[usize], name: &str) -> Result<Arc<dyn ProcessGroup>>;

    /// Bytes sent and received by this rank on this group, per collective kind.
    fn stats(&self) -> CommStats;

    /// Whether the group belongs to a simulated job (`kiln plan`): some of its ranks exist only
    /// as numbers, and they write no files.
    fn is_simulated(&self) -> bool {
        false
    }
}

/// Gives a `dyn ProcessGroup` its concrete type back (`group.downcast_ref::<NcclGroup>()`),
/// e.g. to reach `NcclGroup`'s device-memory methods. Implemented for every `'static` type, so
/// a group does not write it.
pub trait AsAny: std::any::Any {
    /// `self` as `Any`.
    fn as_any(&self) -> &dyn std::any::Any;
}

impl<T: std::any::Any> AsAny for T {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl dyn ProcessGroup {
    /// The group as its implementation `G`, if it is one (`group.downcast_ref::<NcclGroup>()`).
    pub fn downcast_ref<G: ProcessGroup>(&self) -> Option<&G> {
        // Through the trait object's vtable: the concrete group, not the reference.
        AsAny::as_any(self).downcast_ref::<G>()
    }
}

/// Options of a group.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// How long a rank waits for a peer before failing (default: 5 minutes, or the
    /// `KILN_COMM_TIMEOUT` environment variable, in seconds).
    pub timeout: Duration,
    /// The group's name in errors.
    pub name: String,
}

/// The default collective timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

impl Default for GroupOptions {
    fn default() -> Self {
        let timeout = std::env::var("KILN_COMM_TIMEOUT")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(DEFAULT_TIMEOUT);
        GroupOptions {
            timeout,
            name: "world".to_string(),
        }
    }
}

impl GroupOptions {
    /// The defaults with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
    /// The defaults with another name.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
}

/// The state shared by the transport-backed groups ([`LocalGroup`](crate::LocalGroup),
/// [`TcpGroup`](crate::TcpGroup)): membership, sequence numbers, counters.
#[derive(Debug)]
pub(crate) struct GroupCore {
    transport: Arc<dyn Transport>,
    id: u64,
    name: String,
    /// Global ranks of the members, in group order.
    members: Vec<usize>,
    rank: usize,
    timeout: Duration,
    state: Mutex<CoreState>,
    /// Held by a point-to-point receive while it waits (instead of `state`), so that receives
    /// take their messages in the order they took their sequence numbers, while this rank's
    /// sends and collectives on other threads go on.
    receiving: Mutex<()>,
    counters: Counters,
}

#[derive(Debug, Default)]
struct CoreState {
    seq: u64,
    p2p_sent: HashMap<usize, u64>,
    p2p_received: HashMap<usize, u64>,
    splits: HashMap<Vec<usize>, u64>,
    poisoned: Option<String>,
}

/// A group id that every member derives alike without communicating: FNV-1a of the parts'
/// little-endian bytes.
fn group_id(parts: &[u64]) -> u64 {
    let mut h = Fnv1a::new();
    for &p in parts {
        h.write_u64(p);
    }
    h.finish()
}

impl GroupCore {
    /// The group of all ranks of `transport`.
    pub fn world(transport: Arc<dyn Transport>, options: GroupOptions) -> Self {
        let members = (0..transport.world_size()).collect();
        let rank = transport.rank();
        GroupCore {
            id: group_id(&[0x0077_6f72_6c64]),
            name: options.name,
            members,
            rank,
            timeout: options.timeout,
            transport,
            state: Mutex::default(),
            receiving: Mutex::default(),
            counters: Counters::default(),
        }
    }

    fn ctx(&self, kind: OpKind, seq: u64) -> OpContext {
        OpContext {
            kind,
            seq,
            group: self.name.clone(),
            rank: self.rank,
            world_size: self.members.len(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, CoreState> {
        // A panic while holding the lock leaves consistent state (plain counters).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The state, locked, unless an earlier failure poisoned the group.
    fn usable(&self) -> Result<MutexGuard<'_, CoreState>> {
        let state = self.lock();
        match &state.poisoned {
            Some(first) => Err(CommError::Poisoned {
                group: self.name.clone(),
                first: first.clone(),
            }),
            None => Ok(state),
        }
    }

    /// Starts a collective: checks the group is usable and takes the next sequence number.
    /// The state lock is held for the whole collective, so concurrent callers on one rank
    /// serialise instead of interleaving their messages.
    fn begin(&self, kind: OpKind, dtype: DType, total: usize, op: u8, root: u32) -> Result<Op<'_>> {
        let mut state = self.usable()?;
        let seq = state.seq;
        state.seq += 1;
        self.counters.call(kind);
        Ok(Op {
            core: self,
            _state: state,
            header: Header {
                group: self.id,
                lane: Lane::Collective,
                kind,
                dtype,
                op,
                root,
                seq,
                total: total as u64,
                step: 0,
                payload_len: 0,
            },
            deadline: Instant::now() + self.timeout,
        })
    }

    fn invalid(&self, kind: OpKind, message: String) -> CommError {
        let seq = self.lock().seq;
        CommError::InvalidArgument {
            op: self.ctx(kind, seq),
            message,
        }
    }

    fn check_peer(&self, kind: OpKind, peer: usize, what: &str) -> Result<()> {
        if peer >= self.members.len() {
            return Err(self.invalid(
                kind,
                format!(
                    "{what} {peer} is out of range for a group of {} ranks",
                    self.members.len()
                ),
            ));
        }
        Ok(())
    }

    /// Poisons the group with the first error, so later calls fail fast.
    fn fail(&self, state: &mut CoreState, err: CommError) -> CommError {
        if state.poisoned.is_none() {
            let text = err.to_string();
            self.transport.note_failure(&text);
            state.poisoned = Some(text);
        }
        err
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world_size(&self) -> usize {
        self.members.len()
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    pub fn backend(&self) -> &'static str {
        self.transport.kind()
    }
    pub fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }

    pub fn split(&self, ranks: &[usize], name: &str) -> Result<GroupCore> {
        let kind = OpKind::Barrier;
        let mut seen = vec![false; self.members.len()];
        for &r in ranks {
            self.check_peer(kind, r, "split: rank")?;
            if std::mem::replace(&mut seen[r], true) {
                return Err(self.invalid(kind, format!("split: rank {r} listed twice")));
            }
        }
        let Some(me) = ranks.iter().position(|&r| r == self.rank) else {
            return Err(self.invalid(
                kind,
                format!(
                    "split: this rank ({}) is not in the new group {ranks:?}",
                    self.rank
                ),
            ));
        };
        let globals: Vec<usize> = ranks.iter().map(|&r| self.members[r]).collect();
        let count = {
            let mut state = self.lock();
            let c = state.splits.entry(globals.clone()).or_insert(0);
            *c += 1;
            *c
        };
        let mut parts = vec![self.id, count];
        parts.extend(globals.iter().map(|&g| g as u64));
        Ok(GroupCore {
            transport: self.transport.clone(),
            id: group_id(&parts),
            name: name.to_string(),
            members: globals,
            rank: me,
            timeout: self.timeout,
            state: Mutex::default(),
            receiving: Mutex::default(),
            counters: Counters::default(),
        })
    }

    // ----- collectives -----

    pub fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        if buf.is_shape() {
            return Err(crate::error::shape_buffer("local/tcp", &self.name));
        }
        match buf {
            BufMut::F32(b) => self.all_reduce_t(b, op),
            BufMut::F16(b) => self.all_reduce_t(b, op),
            BufMut::BF16(b) => self.all_reduce_t(b, op),
            BufMut::I64(b) => self.all_reduce_t(b, op),
            BufMut::Shape { .. } => unreachable!("refused above"),
        }
    }

    fn all_reduce_t<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let mut o = self.begin(OpKind::AllReduce, T::DTYPE, buf.len(), op.code(), 0)?;
        let result = match self.world_size() {
            1 => Ok(()),
            n if std::mem::size_of_val(buf) <= DIRECT_BYTES => {
                all_reduce_direct(&mut o, n, self.rank, buf, op)
            }
            n => all_reduce_ring(&mut o, n, self.rank, buf, op),
        };
        o.finish(result)
    }

    pub fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        if input.is_shape() || output.is_shape() {
            return Err(crate::error::shape_buffer("local/tcp", &self.name));
        }
        match (input, output) {
            (BufRef::F32(i), BufMut::F32(o)) => self.all_gather_t(i, o),
            (BufRef::F16(i), BufMut::F16(o)) => self.all_gather_t(i, o),
            (BufRef::BF16(i), BufMut::BF16(o)) => self.all_gather_t(i, o),
            (BufRef::I64(i), BufMut::I64(o)) => self.all_gather_t(i, o),
            (i, o) => Err(self.dtype_mismatch(OpKind::AllGather, i.dtype(), o.dtype())),
        }
    }

    fn dtype_mismatch(&self, kind: OpKind, a: DType, b: DType) -> CommError {
        let seq = self.lock().seq;
        CommError::DTypeMismatch {
            op: self.ctx(kind, seq),
            a,
            b,
        }
    }

    fn all_gather_t<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let (n, r) = (self.world_size(), self.rank);
        let len = output.len();
        let chunk = |i: usize| shard_range(len, n, i % n);
        if input.len() != chunk(r).len() {
            return Err(self.invalid(
                OpKind::AllGather,
                format!(
                    "input has {} elements but rank {r}'s shard of a {len}-element output is {}",
                    input.len(),
                    chunk(r).len()
                ),
            ));
        }
        let mut o = self.begin(OpKind::AllGather, T::DTYPE, len, 0, 0)?;
        output[chunk(r)].copy_from_slice(input);
        let result = ring_all_gather(&mut o, n, r, output, 0, 0);
        o.finish(result)
    }

    pub fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        if input.is_shape() || output.is_shape() {
            return Err(crate::error::shape_buffer("local/tcp", &self.name));
        }
        match (input, output) {
            (BufRef::F32(i), BufMut::F32(o)) => self.reduce_scatter_t(i, o, op),
            (BufRef::F16(i), BufMut::F16(o)) => self.reduce_scatter_t(i, o, op),
            (BufRef::BF16(i), BufMut::BF16(o)) => self.reduce_scatter_t(i, o, op),
            (BufRef::I64(i), BufMut::I64(o)) => self.reduce_scatter_t(i, o, op),
            (i, o) => Err(self.dtype_mismatch(OpKind::ReduceScatter, i.dtype(), o.dtype())),
        }
    }

    fn reduce_scatter_t<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.world_size(), self.rank);
        let len = input.len();
        let chunk = |i: usize| shard_range(len, n, i % n);
        if output.len() != chunk(r).len() {
            return Err(self.invalid(
                OpKind::ReduceScatter,
                format!(
                    "output has {} elements but rank {r}'s shard of a {len}-element input is {}",
                    output.len(),
                    chunk(r).len()
                ),
            ));
        }
        let mut o = self.begin(OpKind::ReduceScatter, T::DTYPE, len, op.code(), 0)?;
        let result = if n == 1 {
            output.copy_from_slice(input);
            Ok(())
        } else {
            ring_reduce_scatter(&mut o, n, r, input, output, op)
        };
        o.finish(result)
    }

    pub fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.check_peer(OpKind::Broadcast, root, "root")?;
        if buf.is_shape() {
            return Err(crate::error::shape_buffer("local/tcp", &self.name));
        }
        match buf {
            BufMut::F32(b) => self.broadcast_t(b, root),
            BufMut::F16(b) => self.broadcast_t(b, root),
            BufMut::BF16(b) => self.broadcast_t(b, root),
            BufMut::I64(b) => self.broadcast_t(b, root),
            BufMut::Shape { .. } => unreachable!("refused above"),
        }
    }

    fn broadcast_t<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let mut o = self.begin(OpKind::Broadcast, T::DTYPE, buf.len(), 0, root as u32)?;
        let (n, r) = (self.world_size(), self.rank);
        let len = buf.len();
        let chunk = |i: usize| shard_range(len, n, i % n);
        let result = (|| {
            if n == 1 {
                return Ok(());
            }
            if std::mem::size_of_val(buf) <= DIRECT_BYTES {
                // Small: latency matters more than the root's bandwidth.
                if r == root {
                    for peer in (0..n).filter(|&p| p != root) {
                        o.send(peer, 0, buf)?;
                    }
                } else {
                    recv_into(&mut o, root, 0, buf, |dst, data| dst.copy_from_slice(data))?;
                }
                return Ok(());
            }
            // Large: scatter from the root, then a ring all-gather (van de Geijn), so no
            // rank sends more than 2 (N-1)/N of the buffer.
            if r == root {
                for peer in (0..n).filter(|&p| p != root) {
                    send_pieces(&mut o, peer, 0, &buf[chunk(peer)])?;
                }
            } else {
                recv_into(&mut o, root, 0, &mut buf[chunk(r)], |dst, data| {
                    dst.copy_from_slice(data)
                })?;
            }
            ring_all_gather(&mut o, n, r, buf, 0, 1)
        })();
        o.finish(result)
    }

    pub fn barrier(&self) -> Result<()> {
        // Dissemination barrier (Hensgen, Finkel & Manber 1988): ceil(log2 N) rounds.
        let mut o = self.begin(OpKind::Barrier, DType::I64, 0, 0, 0)?;
        let (n, r) = (self.world_size(), self.rank);
        let result = (|| {
            let mut dist = 1;
            let mut step = 0;
            while dist < n {
                o.send((r + dist) % n, step, &[] as &[i64])?;
                o.recv((r + n - dist) % n, step)?;
                dist *= 2;
                step += 1;
            }
            Ok(())
        })();
        o.finish(result)
    }

    pub fn send(&self, buf: BufRef<'_>, dst: usize) -> Result<()> {
        self.check_peer(OpKind::SendRecv, dst, "destination")?;
        if buf.is_shape() {
            return Err(crate::error::shape_buffer("local/tcp", &self.name));
        }

        let mut state = self.usable()?;
        let seq = next_seq(&mut state.p2p_sent, dst);
        self.counters.call(OpKind::SendRecv);
        let bytes = buf.as_bytes();
        let header = Header {
            group: self.id,
            lane: Lane::P2p,
            kind: OpKind::SendRecv,
            dtype: buf.dtype(),
            op: 0,
            root: self.rank as u32,
            seq,
            total: buf.len() as u64,
            step: 0,
            payload_len: bytes.len() as u64,
        };
        match self.transport.send(self.members[dst], header, bytes) {
            Ok(()) => {
                self.counters.sent(OpKind::SendRecv, bytes.len());
                Ok(())
            }
            Err(reason) => {
                let err = CommError::PeerLost {
                    op: self.ctx(OpKind::SendRecv, seq),
                    peer: dst,
                    reason,
                };
                Err(self.fail(&mut state, err))
            }
        }
    }

    pub fn recv(&self, mut buf: BufMut<'_>, src: usize) -> Result<()> {
        self.check_peer(OpKind::SendRecv, src, "source")?;
        if buf.is_shape() {
            return Err(crate::error::shape_buffer("local/tcp", &self.name));
        }

        let _in_order = self.receiving.lock().unwrap_or_else(|e| e.into_inner());
        let seq = next_seq(&mut self.usable()?.p2p_received, src);
        // The wait holds no state lock: `send` promises to return before its message is
        // received, also while another thread of this rank waits for a message here.
        let ctx = self.ctx(OpKind::SendRecv, seq);
        let deadline = Instant::now() + self.timeout;
        let msg =
            match self
                .transport
                .mailbox()
                .recv(self.id, self.members[src], Lane::P2p, deadline)
            {
                Ok(msg) => msg,
                Err(e) => {
                    let err = recv_error(ctx, src, self.timeout, e);
                    return Err(self.fail(&mut self.lock(), err));
                }
            };
        let h = msg.header;
        if h.dtype != buf.dtype() || h.total != buf.len() as u64 {
            let err = CommError::Mismatch {
                op: ctx,
                peer: src,
                expected: format!("recv({}, {} elements)", buf.dtype(), buf.len()),
                found: format!("send({}, {} elements)", h.dtype, h.total),
            };
            return Err(self.fail(&mut self.lock(), err));
        }
        buf.as_bytes_mut().copy_from_slice(&msg.payload);
        self.counters.received(OpKind::SendRecv, msg.payload.len());
        Ok(())
    }
}

/// The sequence number of the next point-to-point message with `peer`, counted in `counts`.
fn next_seq(counts: &mut HashMap<usize, u64>, peer: usize) -> u64 {
    let count = counts.entry(peer).or_insert(0);
    *count += 1;
    *count - 1
}

fn recv_error(op: OpContext, peer: usize, timeout: Duration, e: RecvError) -> CommError {
    match e {
        RecvError::Timeout => CommError::Timeout { op, peer, timeout },
        RecvError::Closed(reason) => CommError::PeerLost { op, peer, reason },
    }
}

/// Collectives of at most this many bytes take the latency-bound path: every rank sends to
/// every other directly, one message per peer, instead of a ring's 2 (N-1) steps.
const DIRECT_BYTES: usize = 64 << 10;

/// A ring step's chunk travels in pieces of at least this size, so the receiver reduces
/// piece k while piece k+1 is on the wire (and in cache), instead of waiting for the whole
/// chunk.
const PIECE_BYTES: usize = 128 << 10;
/// The largest piece size [`piece_bytes`] picks.
const MAX_PIECE_BYTES: usize = 1 << 20;

fn piece_elems<T>(world: usize) -> usize {
    (piece_bytes(world) / std::mem::size_of::<T>()).max(1)
}

/// The piece size for a group of `world` ranks: [`PIECE_BYTES`] times (world/2)^2, at most
/// [`MAX_PIECE_BYTES`]. Each piece costs a wake-up per hop, and larger groups on one machine
/// put more threads on each core (every rank runs a receiver). Measured on 2 cores over
/// loopback: 128 KiB pieces best at N = 2, 512 KiB at N = 4. `KILN_COMM_PIECE_KIB` overrides
/// it, for tuning; ranks need not agree on it, since a receiver takes pieces of any size.
fn piece_bytes(world: usize) -> usize {
    static OVERRIDE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced = *OVERRIDE.get_or_init(|| {
        std::env::var("KILN_COMM_PIECE_KIB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&k| k > 0)
            .map(|k| k << 10)
    });
    let half = (world / 2).max(1);
    forced.unwrap_or_else(|| (PIECE_BYTES * half * half).min(MAX_PIECE_BYTES))
}

/// Small all-reduce: every rank sends its buffer to every other and reduces all N buffers
/// itself, in rank order 0..N, so every rank computes the same bits.
fn all_reduce_direct<T: Element>(
    o: &mut Op<'_>,
    n: usize,
    r: usize,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    for peer in (0..n).filter(|&p| p != r) {
        o.send(peer, 0, buf)?;
    }
    let mut theirs = Vec::with_capacity(n);
    for peer in 0..n {
        theirs.push(if peer == r {
            None
        } else {
            Some(o.recv_piece::<T>(peer, 0, buf.len(), true)?)
        });
    }
    let own = buf.to_vec();
    for (q, payload) in theirs.iter().enumerate() {
        let part = match payload {
            Some(p) => bytes_as::<T>(p),
            None => std::borrow::Cow::Borrowed(&own[..]),
        };
        if q == 0 {
            buf.copy_from_slice(&part);
        } else {
            reduce_into(buf, &part, op);
        }
    }
    if op == ReduceOp::Avg {
        buf.iter_mut().for_each(|x| *x = x.div(n));
    }
    Ok(())
}

/// Ring all-reduce: a reduce-scatter (after step s, chunk r-s-1 holds s+2 contributions and
/// rank r ends with chunk r+1 complete), then an all-gather of the complete chunks.
fn all_reduce_ring<T: Element>(
    o: &mut Op<'_>,
    n: usize,
    r: usize,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    ring_pass(o, n, r, buf, 0, 0, |s, dst, data| {
        reduce_into(dst, data, op);
        // The chunk is complete: average it before it travels on.
        if s == n - 2 && op == ReduceOp::Avg {
            dst.iter_mut().for_each(|x| *x = x.div(n));
        }
    })?;
    ring_all_gather(o, n, r, buf, 1, n)
}

/// The ring all-gather of chunks already complete on their owners, rank `(r + owner_shift)`'s
/// chunk being complete on rank r; ring steps are numbered from `first_step`.
fn ring_all_gather<T: Element>(
    o: &mut Op<'_>,
    n: usize,
    r: usize,
    buf: &mut [T],
    owner_shift: usize,
    first_step: usize,
) -> Result<()> {
    ring_pass(o, n, r, buf, owner_shift, first_step, |_, dst, data| {
        dst.copy_from_slice(data)
    })
}

/// N-1 ring steps over the chunks of `buf`: at step s rank r sends chunk `r + shift - s` to
/// its right and receives chunk `r + shift - s - 1` from its left, handing each received
/// piece to `land(s, destination, data)`.
fn ring_pass<T: Element>(
    o: &mut Op<'_>,
    n: usize,
    r: usize,
    buf: &mut [T],
    shift: usize,
    first_step: usize,
    mut land: impl FnMut(usize, &mut [T], &[T]),
) -> Result<()> {
    let len = buf.len();
    let chunk = |i: usize| shard_range(len, n, i % n);
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        let send = chunk(r + shift + n - s);
        let recv = chunk(r + shift + 2 * n - s - 1);
        ring_step(
            o,
            first_step + s,
            (right, left),
            buf,
            Src::Out(send),
            recv,
            |dst, _, data| land(s, dst, data),
        )?;
    }
    Ok(())
}

/// The all-reduce's first phase shifted by one chunk, so that rank r ends with chunk r. Two
/// chunk-sized accumulators alternate (one travelling, one being reduced into); the last step
/// reduces straight into `output`, and the input is never copied whole.
fn ring_reduce_scatter<T: Element>(
    o: &mut Op<'_>,
    n: usize,
    r: usize,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let len = input.len();
    let chunk = |i: usize| shard_range(len, n, i % n);
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    let cap = chunk(0).len();
    let (mut acc, mut next) = (Vec::new(), Vec::new());
    for s in 0..n - 1 {
        let last = s == n - 2;
        let recv = chunk(r + 2 * n - s - 2);
        let own = &input[recv.clone()];
        let land = |dst: &mut [T], off: usize, data: &[T]| {
            for (i, (d, &x)) in dst.iter_mut().zip(data).enumerate() {
                *d = T::combine(own[off + i], x, op);
            }
            if last && op == ReduceOp::Avg {
                dst.iter_mut().for_each(|x| *x = x.div(n));
            }
        };
        let src = if s == 0 {
            Src::Other(&input[chunk(r + n - 1)])
        } else {
            Src::Other(&acc[..])
        };
        if last {
            ring_step(o, s, (right, left), output, src, 0..recv.len(), land)?;
        } else {
            next.resize(cap, T::zeroed());
            ring_step(o, s, (right, left), &mut next, src, 0..recv.len(), land)?;
            next.truncate(recv.len());
            std::mem::swap(&mut acc, &mut next);
        }
    }
    Ok(())
}

/// Where a ring step's outgoing chunk lives: in the buffer being received into (a range
/// disjoint from the one received), or elsewhere.
enum Src<'s, T> {
    Out(Range<usize>),
    Other(&'s [T]),
}

/// One pipelined ring step: sends the chunk `src` to `right` and receives `out[recv]` from
/// `left`, both in pieces of [`PIECE_BYTES`]. Each received piece goes to
/// `land(destination, offset in the chunk, data)` as soon as it arrives; sending stays one
/// piece ahead of receiving, so the neighbours always have a piece on the wire while this rank
/// reduces. Sends never wait for the receiver (the transport queues), so no ordering of the
/// ring can deadlock.
fn ring_step<T: Element>(
    o: &mut Op<'_>,
    step: usize,
    (right, left): (usize, usize),
    out: &mut [T],
    src: Src<'_, T>,
    recv: Range<usize>,
    mut land: impl FnMut(&mut [T], usize, &[T]),
) -> Result<()> {
    let mut outgoing = Outgoing::new(src, (right, step), o.core.world_size());
    // Two pieces ahead before the first receive, then one per piece received.
    outgoing.send_next(o, out)?;
    outgoing.send_next(o, out)?;
    recv_pieces::<T>(o, left, step, recv.len(), |o, got, data| {
        let at = recv.start + got;
        land(&mut out[at..at + data.len()], got, data);
        outgoing.send_next(o, out)?;
        Ok(())
    })?;
    while outgoing.send_next(o, out)? {}
    Ok(())
}

/// A chunk being sent piece by piece.
struct Outgoing<'s, T> {
    src: Src<'s, T>,
    pieces: Pieces,
    peer: usize,
    step: usize,
}

impl<'s, T: Element> Outgoing<'s, T> {
    fn new(src: Src<'s, T>, (peer, step): (usize, usize), world: usize) -> Self {
        let len = match &src {
            Src::Out(range) => range.len(),
            Src::Other(s) => s.len(),
        };
        Outgoing {
            src,
            pieces: Pieces::new(len, piece_elems::<T>(world)),
            peer,
            step,
        }
    }

    /// Sends the next piece, if any is left; false once the chunk is all sent.
    fn send_next(&mut self, o: &mut Op<'_>, out: &[T]) -> Result<bool> {
        let Some(p) = self.pieces.next() else {
            return Ok(false);
        };
        let data = match &self.src {
            Src::Out(range) => &out[range.start + p.start..range.start + p.end],
            Src::Other(s) => &s[p],
        };
        o.send(self.peer, self.step, data)?;
        Ok(true)
    }
}

/// Sends `data` to `peer` in pieces.
fn send_pieces<T: Element>(o: &mut Op<'_>, peer: usize, step: usize, data: &[T]) -> Result<()> {
    for p in Pieces::new(data.len(), piece_elems::<T>(o.core.world_size())) {
        o.send(peer, step, &data[p])?;
    }
    Ok(())
}

/// Receives `out.len()` elements from `peer`, in whatever pieces it sent them, handing each
/// piece to `land(destination, data)`.
fn recv_into<T: Element>(
    o: &mut Op<'_>,
    peer: usize,
    step: usize,
    out: &mut [T],
    mut land: impl FnMut(&mut [T], &[T]),
) -> Result<()> {
    recv_pieces::<T>(o, peer, step, out.len(), |_, got, data| {
        land(&mut out[got..got + data.len()], data);
        Ok(())
    })
}

/// Receives `total` elements from `peer`, in whatever pieces it sent them, handing each piece
/// to `each(op, offset, data)` as it arrives.
fn recv_pieces<'a, T: Element>(
    o: &mut Op<'a>,
    peer: usize,
    step: usize,
    total: usize,
    mut each: impl FnMut(&mut Op<'a>, usize, &[T]) -> Result<()>,
) -> Result<()> {
    let mut got = 0;
    loop {
        let payload = o.recv_piece::<T>(peer, step, total - got, false)?;
        let data = bytes_as::<T>(&payload);
        each(o, got, &data)?;
        got += data.len();
        if got >= total {
            return Ok(());
        }
    }
}

/// The piece ranges of a chunk of `len` elements: at least one piece (an empty chunk still
/// sends one empty message, so the receiver's header checks run).
struct Pieces {
    len: usize,
    piece: usize,
    at: usize,
    started: bool,
}

impl Pieces {
    fn new(len: usize, piece: usize) -> Self {
        Pieces {
            len,
            piece,
            at: 0,
            started: false,
        }
    }
}

impl Iterator for Pieces {
    type Item = Range<usize>;
    fn next(&mut self) -> Option<Range<usize>> {
        if self.started && self.at >= self.len {
            return None;
        }
        self.started = true;
        let end = (self.at + self.piece).min(self.len);
        let p = self.at..end;
        self.at = end;
        Some(p)
    }
}

fn describe(h: &Header) -> String {
    let mut s = format!("{} #{} ({}, {} elements", h.kind, h.seq, h.dtype, h.total);
    match h.kind {
        OpKind::AllReduce | OpKind::ReduceScatter => {
            let op = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min]
                .into_iter()
                .find(|o| o.code() == h.op)
                .map_or("?".to_string(), |o| o.to_string());
            s += &format!(", op {op}");
        }
        OpKind::Broadcast => s += &format!(", root {}", h.root),
        _ => {}
    }
    s + ")"
}

/// One collective in progress on this rank.
struct Op<'a> {
    core: &'a GroupCore,
    _state: MutexGuard<'a, CoreState>,
    header: Header,
    deadline: Instant,
}

impl Op<'_> {
    fn ctx(&self) -> OpContext {
        self.core.ctx(self.header.kind, self.header.seq)
    }

    fn send<T: Element>(&mut self, peer: usize, step: usize, data: &[T]) -> Result<()> {
        let payload = bytemuck::cast_slice::<T, u8>(data);
        let header = Header {
            step: step as u32,
            payload_len: payload.len() as u64,
            ..self.header
        };
        self.core
            .transport
            .send(self.core.members[peer], header, payload)
            .map_err(|reason| CommError::PeerLost {
                op: self.ctx(),
                peer,
                reason,
            })?;
        self.core.counters.sent(self.header.kind, payload.len());
        Ok(())
    }

    fn recv(&mut self, peer: usize, step: usize) -> Result<Payload> {
        let msg = self
            .core
            .transport
            .mailbox()
            .recv(
                self.header.group,
                self.core.members[peer],
                Lane::Collective,
                self.deadline,
            )
            .map_err(|e| recv_error(self.ctx(), peer, self.core.timeout, e))?;
        let h = msg.header;
        let expected = Header {
            step: step as u32,
            payload_len: h.payload_len,
            ..self.header
        };
        if h != expected {
            return Err(CommError::Mismatch {
                op: self.ctx(),
                peer,
                expected: describe(&self.header),
                found: describe(&h),
            });
        }
        self.core.counters.received(h.kind, msg.payload.len());
        Ok(msg.payload)
    }

    /// Receives one piece of at most `room` elements of `T` (exactly `room` if `whole`), or an
    /// empty piece when `room` is 0. A piece that does not fit means the peer's algorithm
    /// disagrees with this rank's: a mismatch, never a panic on a short copy.
    fn recv_piece<T: Element>(
        &mut self,
        peer: usize,
        step: usize,
        room: usize,
        whole: bool,
    ) -> Result<Payload> {
        let payload = self.recv(peer, step)?;
        let size = std::mem::size_of::<T>();
        let elems = payload.len() / size;
        let fits = payload.len() % size == 0
            && elems <= room
            && (elems > 0 || room == 0)
            && (!whole || elems == room);
        if !fits {
            return Err(CommError::Mismatch {
                op: self.ctx(),
                peer,
                expected: format!("step {step} of {}", describe(&self.header)),
                found: format!(
                    "a piece of {} bytes where {room} elements of {} fit",
                    payload.len(),
                    T::DTYPE
                ),
            });
        }
        Ok(payload)
    }

    /// Ends the collective, poisoning the group if it failed.
    fn finish(mut self, result: Result<()>) -> Result<()> {
        result.map_err(|err| self.core.fail(&mut self._state, err))
    }
}

/// Implements [`ProcessGroup`] for a newtype over [`GroupCore`].
macro_rules! delegate_process_group {
    ($ty:ty) => {
        impl $crate::ProcessGroup for $ty {
            fn rank(&self) -> usize {
                self.core.rank()
            }
            fn world_size(&self) -> usize {
                self.core.world_size()
            }
            fn name(&self) -> &str {
                self.core.name()
            }
            fn backend(&self) -> &'static str {
                self.core.backend()
            }
            fn timeout(&self) -> std::time::Duration {
                self.core.timeout()
            }
            fn all_reduce(
                &self,
                buf: $crate::BufMut<'_>,
                op: $crate::ReduceOp,
            ) -> $crate::Result<()> {
                self.core.all_reduce(buf, op)
            }
            fn all_gather(
                &self,
                input: $crate::BufRef<'_>,
                output: $crate::BufMut<'_>,
            ) -> $crate::Result<()> {
                self.core.all_gather(input, output)
            }
            fn reduce_scatter(
                &self,
                input: $crate::BufRef<'_>,
                output: $crate::BufMut<'_>,
                op: $crate::ReduceOp,
            ) -> $crate::Result<()> {
                self.core.reduce_scatter(input, output, op)
            }
            fn broadcast(&self, buf: $crate::BufMut<'_>, root: usize) -> $crate::Result<()> {
                self.core.broadcast(buf, root)
            }
            fn send(&self, buf: $crate::BufRef<'_>, dst: usize) -> $crate::Result<()> {
                self.core.send(buf, dst)
            }
            fn recv(&self, buf: $crate::BufMut<'_>, src: usize) -> $crate::Result<()> {
                self.core.recv(buf, src)
            }
            fn barrier(&self) -> $crate::Result<()> {
                self.core.barrier()
            }
            fn split(
                &self,
                ranks: &[usize],
                name: &str,
            ) -> $crate::Result<std::sync::Arc<dyn $crate::ProcessGroup>> {
                Ok(std::sync::Arc::new(Self::from_core(
                    self.core.split(ranks, name)?,
                    self,
                )))
            }
            fn stats(&self) -> $crate::CommStats {
                self.core.stats()
            }
        }
    };
}
pub(crate) use delegate_process_group;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LocalGroup, ProcessGroup, spawn_ranks};

    /// Several pieces per chunk, and chunks whose lengths differ by one element.
    fn long_len<T>(n: usize) -> usize {
        n * 2 * piece_elems::<T>(n) + 7
    }

    fn value(rank: usize, i: usize) -> i64 {
        ((i * 7919 + rank * 104_729) % 1000) as i64 - 500
    }

    #[test]
    fn pipelined_collectives_agree_with_a_plain_reference() {
        for n in [2usize, 3, 4] {
            let len = long_len::<i64>(n);
            let expected: Vec<i64> = (0..len)
                .map(|i| (0..n).map(|r| value(r, i)).sum())
                .collect();
            spawn_ranks(n, |g: LocalGroup| {
                let r = g.rank();
                let mine: Vec<i64> = (0..len).map(|i| value(r, i)).collect();
                let mut v = mine.clone();
                g.all_reduce((&mut v[..]).into(), ReduceOp::Sum).unwrap();
                assert_eq!(v, expected, "all_reduce, N={n}");

                let range = shard_range(len, n, r);
                let mut shard = vec![0i64; range.len()];
                g.reduce_scatter((&mine[..]).into(), (&mut shard[..]).into(), ReduceOp::Sum)
                    .unwrap();
                assert_eq!(shard, expected[range], "reduce_scatter, N={n}");

                let mut whole = vec![0i64; len];
                g.all_gather((&shard[..]).into(), (&mut whole[..]).into())
                    .unwrap();
                assert_eq!(whole, expected, "all_gather, N={n}");

                let mut b = if r == n - 1 {
                    mine.clone()
                } else {
                    vec![0; len]
                };
                g.broadcast((&mut b[..]).into(), n - 1).unwrap();
                let root: Vec<i64> = (0..len).map(|i| value(n - 1, i)).collect();
                assert_eq!(b, root, "broadcast, N={n}");
            });
        }
    }

    #[test]
    fn pipelined_float_results_are_bitwise_identical_on_every_rank() {
        let n = 3;
        let len = long_len::<half::bf16>(n);
        let results = spawn_ranks(n, |g: LocalGroup| {
            let mut v: Vec<half::bf16> = (0..len)
                .map(|i| half::bf16::from_f32(((i * 31 + g.rank() * 17) as f32).sin()))
                .collect();
            g.all_reduce((&mut v[..]).into(), ReduceOp::Avg).unwrap();
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        });
        assert!(results.windows(2).all(|w| w[0] == w[1]));
    }

    #[test]
    fn direct_all_reduce_sums_in_rank_order_on_every_rank() {
        let results = spawn_ranks(4, |g: LocalGroup| {
            let mut v: Vec<f32> = (0..100)
                .map(|i| ((i * 13 + g.rank() * 5) as f32).cos() * 1e7)
                .collect();
            g.all_reduce((&mut v[..]).into(), ReduceOp::Sum).unwrap();
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        });
        let expected: Vec<u32> = (0..100)
            .map(|i| {
                (0..4)
                    .map(|r| ((i * 13 + r * 5) as f32).cos() * 1e7)
                    .reduce(|a, b| a + b)
                    .unwrap()
                    .to_bits()
            })
            .collect();
        assert!(results.iter().all(|r| *r == expected));
    }
}
