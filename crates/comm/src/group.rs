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
use crate::transport::{Header, Lane, Message, RecvError, Transport};
use std::collections::HashMap;
use std::fmt;
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
pub trait ProcessGroup: Send + Sync + fmt::Debug {
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
    /// Returns once the data is handed to the transport (it may not have arrived yet).
    fn send(&self, buf: BufRef<'_>, dst: usize) -> Result<()>;
    /// Receives into `buf` what rank `src` sent; messages between two ranks arrive in order.
    fn recv(&self, buf: BufMut<'_>, src: usize) -> Result<()>;
    /// Returns once every rank of the group has called it.
    fn barrier(&self) -> Result<()>;

    /// A sub-group of the ranks `ranks` (indices in this group, ascending order not required;
    /// this rank must be one of them). Every member must call it, in the same order relative
    /// to its other `split` calls; non-members need not. The new group's ranks follow the
    /// order of `ranks`.
    fn split(&self, ranks: &[usize], name: &str) -> Result<Arc<dyn ProcessGroup>>;

    /// Bytes sent and received by this rank on this group, per collective kind.
    fn stats(&self) -> CommStats;
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

    /// Starts a collective: checks the group is usable and takes the next sequence number.
    /// The state lock is held for the whole collective, so concurrent callers on one rank
    /// serialise instead of interleaving their messages.
    fn begin(&self, kind: OpKind, dtype: DType, total: usize, op: u8, root: u32) -> Result<Op<'_>> {
        let mut state = self.lock();
        if let Some(first) = &state.poisoned {
            return Err(CommError::Poisoned {
                group: self.name.clone(),
                first: first.clone(),
            });
        }
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
            counters: Counters::default(),
        })
    }

    // ----- collectives -----

    pub fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        match buf {
            BufMut::F32(b) => self.all_reduce_t(b, op),
            BufMut::F16(b) => self.all_reduce_t(b, op),
            BufMut::BF16(b) => self.all_reduce_t(b, op),
            BufMut::I64(b) => self.all_reduce_t(b, op),
        }
    }

    fn all_reduce_t<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let mut o = self.begin(OpKind::AllReduce, T::DTYPE, buf.len(), op.code(), 0)?;
        let (n, r) = (self.world_size(), self.rank);
        let len = buf.len();
        let chunk = |i: usize| shard_range(len, n, i % n);
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let result = (|| {
            if n == 1 {
                return Ok(());
            }
            // Reduce-scatter: after step s, chunk (r-s-1) holds s+2 contributions.
            for s in 0..n - 1 {
                o.send(right, s, &buf[chunk(r + n - s)])?;
                let data = o.recv(left, s)?;
                reduce_into(
                    &mut buf[chunk(r + 2 * n - s - 1)],
                    &bytes_as::<T>(&data),
                    op,
                );
            }
            // Rank r now holds the complete chunk r+1.
            if op == ReduceOp::Avg {
                buf[chunk(r + 1)].iter_mut().for_each(|x| *x = x.div(n));
            }
            // All-gather the complete chunks around the ring.
            for s in 0..n - 1 {
                o.send(right, n + s, &buf[chunk(r + 1 + n - s)])?;
                let data = o.recv(left, n + s)?;
                buf[chunk(r + n - s)].copy_from_slice(&bytes_as::<T>(&data));
            }
            Ok(())
        })();
        o.finish(result)
    }

    pub fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
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
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let result = (|| {
            for s in 0..n.saturating_sub(1) {
                o.send(right, s, &output[chunk(r + n - s)])?;
                let data = o.recv(left, s)?;
                output[chunk(r + 2 * n - s - 1)].copy_from_slice(&bytes_as::<T>(&data));
            }
            Ok(())
        })();
        o.finish(result)
    }

    pub fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
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
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let result = (|| {
            if n == 1 {
                output.copy_from_slice(input);
                return Ok(());
            }
            // The all-reduce's first phase shifted by one chunk, so that rank r ends with chunk r.
            // Only the chunks in flight are copied, never the whole input.
            let mut acc: Vec<T> = input[chunk(r + n - 1)].to_vec();
            for s in 0..n - 1 {
                o.send(right, s, &acc)?;
                let data = o.recv(left, s)?;
                let c = chunk(r + 2 * n - s - 2);
                acc.clear();
                acc.extend_from_slice(&input[c]);
                reduce_into(&mut acc, &bytes_as::<T>(&data), op);
            }
            if op == ReduceOp::Avg {
                acc.iter_mut().for_each(|x| *x = x.div(n));
            }
            output.copy_from_slice(&acc);
            Ok(())
        })();
        o.finish(result)
    }

    pub fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.check_peer(OpKind::Broadcast, root, "root")?;
        match buf {
            BufMut::F32(b) => self.broadcast_t(b, root),
            BufMut::F16(b) => self.broadcast_t(b, root),
            BufMut::BF16(b) => self.broadcast_t(b, root),
            BufMut::I64(b) => self.broadcast_t(b, root),
        }
    }

    fn broadcast_t<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        const DIRECT_BYTES: usize = 64 << 10;
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
                    let data = o.recv(root, 0)?;
                    buf.copy_from_slice(&bytes_as::<T>(&data));
                }
                return Ok(());
            }
            // Large: scatter from the root, then a ring all-gather (van de Geijn), so no
            // rank sends more than 2 (N-1)/N of the buffer.
            if r == root {
                for peer in (0..n).filter(|&p| p != root) {
                    o.send(peer, 0, &buf[chunk(peer)])?;
                }
            } else {
                let data = o.recv(root, 0)?;
                buf[chunk(r)].copy_from_slice(&bytes_as::<T>(&data));
            }
            let (right, left) = ((r + 1) % n, (r + n - 1) % n);
            for s in 0..n - 1 {
                o.send(right, 1 + s, &buf[chunk(r + n - s)])?;
                let data = o.recv(left, 1 + s)?;
                buf[chunk(r + 2 * n - s - 1)].copy_from_slice(&bytes_as::<T>(&data));
            }
            Ok(())
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
        let mut state = self.lock();
        if let Some(first) = &state.poisoned {
            return Err(CommError::Poisoned {
                group: self.name.clone(),
                first: first.clone(),
            });
        }
        let seq = *state.p2p_sent.entry(dst).or_insert(0);
        state.p2p_sent.insert(dst, seq + 1);
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
        let msg = Message {
            header,
            payload: bytes.to_vec(),
        };
        match self.transport.send(self.members[dst], msg) {
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
        let mut state = self.lock();
        if let Some(first) = &state.poisoned {
            return Err(CommError::Poisoned {
                group: self.name.clone(),
                first: first.clone(),
            });
        }
        let seq = *state.p2p_received.entry(src).or_insert(0);
        state.p2p_received.insert(src, seq + 1);
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
                    return Err(self.fail(&mut state, err));
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
            return Err(self.fail(&mut state, err));
        }
        buf.as_bytes_mut().copy_from_slice(&msg.payload);
        self.counters.received(OpKind::SendRecv, msg.payload.len());
        Ok(())
    }
}

fn recv_error(op: OpContext, peer: usize, timeout: Duration, e: RecvError) -> CommError {
    match e {
        RecvError::Timeout => CommError::Timeout { op, peer, timeout },
        RecvError::Closed(reason) => CommError::PeerLost { op, peer, reason },
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
        let payload = bytemuck::cast_slice::<T, u8>(data).to_vec();
        let bytes = payload.len();
        let header = Header {
            step: step as u32,
            payload_len: bytes as u64,
            ..self.header
        };
        self.core
            .transport
            .send(self.core.members[peer], Message { header, payload })
            .map_err(|reason| CommError::PeerLost {
                op: self.ctx(),
                peer,
                reason,
            })?;
        self.core.counters.sent(self.header.kind, bytes);
        Ok(())
    }

    fn recv(&mut self, peer: usize, step: usize) -> Result<Vec<u8>> {
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
