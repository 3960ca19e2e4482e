//! [`NcclGroup`] (feature `nccl`): GPUs through NCCL, via cudarc's bindings.
//!
//! cudarc loads `libcuda` and `libnccl` at run time, so this compiles on machines without
//! CUDA; [`NcclGroup::check_libraries`] turns their absence into an error instead of cudarc's
//! panic. cudarc looks for `libnccl.so` (and `libnccl.so.<CUDA major>`), not the
//! `libnccl.so.2` that NCCL packages install: where only the latter exists the error says so
//! and gives the symlink to make, and `kiln launch` makes it itself (see `kiln-cli`).
//!
//! The communicator's unique id is exchanged through the rendezvous store. Two interfaces:
//! - device buffers ([`CudaSlice`]): `*_device` methods, on the group's stream;
//! - host buffers: [`ProcessGroup`], staged through device memory (for conformance checks,
//!   metrics and small tensors).
//!
//! NCCL hangs on mismatched collectives; so before each collective the ranks all-gather a
//! 4-integer descriptor (kind, sequence number, dtype, length) and compare, turning a mismatch
//! into [`CommError::Mismatch`]. Completion is polled against the group's timeout; on timeout
//! the communicator is aborted (`ncclCommAbort`) and the group is poisoned.

use crate::dtype::{BufMut, BufRef, DType, Element, ReduceOp};
use crate::env::LaunchEnv;
use crate::error::{CommError, OpContext, OpKind, Result};
use crate::group::{GroupOptions, ProcessGroup};
use crate::shard::shard_range;
use crate::stats::{CommStats, Counters};
use crate::store::{StoreClient, StoreServer};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr};
use cudarc::nccl::safe::{Comm, Id, NcclType};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An NCCL communicator; NCCL allows use from any thread as long as calls are serialised,
/// which the group's mutex guarantees.
struct SendComm(Comm);
// SAFETY: see above: every use of the communicator goes through `NcclGroup::state`'s mutex.
unsafe impl Send for SendComm {}

struct State {
    comm: Option<SendComm>,
    seq: u64,
    splits: std::collections::HashMap<Vec<usize>, u64>,
    poisoned: Option<String>,
}

/// One rank's handle on a group of GPUs communicating through NCCL.
pub struct NcclGroup {
    state: Mutex<State>,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    /// Global ranks of the members (for sub-group keys).
    members: Vec<usize>,
    name: String,
    timeout: Duration,
    counters: Counters,
    store: Arc<StoreClient>,
    _server: Option<Arc<StoreServer>>,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Nccl(format!("{what}: {e:?}"))
}

impl NcclGroup {
    /// Checks that the CUDA driver and NCCL libraries can be loaded.
    ///
    /// # Errors
    /// [`CommError::Nccl`] saying which library is missing and what to do.
    pub fn check_libraries() -> Result<()> {
        // SAFETY: these only try to dlopen the candidate names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CommError::Nccl(
                "the CUDA driver library (libcuda.so) was not found: this needs a machine with an \
                 NVIDIA GPU and its driver"
                    .into(),
            ));
        }
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            // SAFETY: loading NCCL runs no initialisers with preconditions.
            let versioned = unsafe { libloading::Library::new("libnccl.so.2") }.is_ok();
            return Err(CommError::Nccl(if versioned {
                "libnccl.so.2 is installed but cudarc loads NCCL by the name libnccl.so: create \
                 the link (`ln -s $(dirname $(ldconfig -p | grep -m1 libnccl.so.2 | awk '{print \
                 $NF}'))/libnccl.so.2 DIR/libnccl.so`) and add DIR to LD_LIBRARY_PATH, or start \
                 the job with `kiln launch`, which does this for its ranks"
                    .into()
            } else {
                "NCCL (libnccl.so) was not found: install it (Debian/Ubuntu: libnccl2; pip: \
                 nvidia-nccl-cu12) and put its directory on LD_LIBRARY_PATH"
                    .into()
            }));
        }
        Ok(())
    }

    /// Joins the job described by the environment, on GPU `LOCAL_RANK`.
    ///
    /// # Errors
    /// Missing libraries or GPU, bad launch variables, rendezvous failures.
    pub fn from_env() -> Result<NcclGroup> {
        Self::from_launch_env(&LaunchEnv::from_env()?, GroupOptions::default())
    }

    /// Joins the job described by `env`, on GPU `env.local_rank`.
    ///
    /// # Errors
    /// As [`NcclGroup::from_env`].
    pub fn from_launch_env(env: &LaunchEnv, options: GroupOptions) -> Result<NcclGroup> {
        Self::check_libraries()?;
        let ctx = CudaContext::new(env.local_rank)
            .map_err(|e| nccl_err(&format!("opening GPU {} (LOCAL_RANK)", env.local_rank), e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| nccl_err("creating a stream", e))?;
        let server = if env.rank == 0 {
            let bind: SocketAddr = (IpAddr::from([0, 0, 0, 0]), env.master_port).into();
            Some(Arc::new(StoreServer::bind(bind)?))
        } else {
            None
        };
        let store = Arc::new(StoreClient::connect(&env.store_addr(), options.timeout)?);
        let members: Vec<usize> = (0..env.world_size).collect();
        let key = format!("kiln/nccl/{}/id", options.name);
        let comm = Self::init_comm(&store, &key, &stream, env.rank, env.world_size)?;
        Ok(NcclGroup {
            state: Mutex::new(State {
                comm: Some(SendComm(comm)),
                seq: 0,
                splits: Default::default(),
                poisoned: None,
            }),
            stream,
            rank: env.rank,
            world_size: env.world_size,
            members,
            name: options.name,
            timeout: options.timeout,
            counters: Counters::default(),
            store,
            _server: server,
        })
    }

    fn init_comm(
        store: &StoreClient,
        key: &str,
        stream: &Arc<CudaStream>,
        rank: usize,
        world_size: usize,
    ) -> Result<Comm> {
        let id = if rank == 0 {
            let id = Id::new().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            store.set(key, &bytes)?;
            id
        } else {
            let bytes = store.get(key)?;
            let internal: [std::ffi::c_char; 128] = std::array::from_fn(|i| bytes[i] as _);
            Id::uninit(internal)
        };
        Comm::from_rank(stream.clone(), rank, world_size, id)
            .map_err(|e| nccl_err("ncclCommInitRank", e))
    }

    /// The CUDA stream the group's collectives run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn ctx(&self, kind: OpKind, seq: u64) -> OpContext {
        OpContext {
            kind,
            seq,
            group: self.name.clone(),
            rank: self.rank,
            world_size: self.world_size,
        }
    }

    /// Runs one collective: descriptor check, the enqueue `f`, then completion within the
    /// timeout. Poisons the group on failure.
    fn run<R>(
        &self,
        kind: OpKind,
        dtype: DType,
        len: usize,
        extra: i64,
        f: impl FnOnce(&Comm) -> Result<R>,
    ) -> Result<R> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(first) = &state.poisoned {
            return Err(CommError::Poisoned {
                group: self.name.clone(),
                first: first.clone(),
            });
        }
        let seq = state.seq;
        state.seq += 1;
        self.counters.call(kind);
        let ctx = self.ctx(kind, seq);
        let result = (|| {
            let comm = &state.comm.as_ref().expect("present while not poisoned").0;
            let desc = [
                kind.code() as i64,
                seq as i64,
                dtype.code() as i64 * 1_000_003 + extra,
                len as i64,
            ];
            // Point-to-point calls involve two ranks, not the group: their length travels with
            // the message instead (see `host_send`).
            if self.world_size > 1 && kind != OpKind::SendRecv {
                let d = self
                    .stream
                    .clone_htod(&desc)
                    .map_err(|e| nccl_err("copy", e))?;
                let mut all = self
                    .stream
                    .clone_htod(&vec![0i64; 4 * self.world_size])
                    .map_err(|e| nccl_err("alloc", e))?;
                comm.all_gather(&d, &mut all)
                    .map_err(|e| nccl_err("ncclAllGather (descriptor)", e))?;
                self.wait(&ctx)?;
                let all = self
                    .stream
                    .clone_dtoh(&all)
                    .map_err(|e| nccl_err("copy", e))?;
                for (peer, theirs) in all.chunks(4).enumerate() {
                    if theirs != desc {
                        return Err(CommError::Mismatch {
                            op: ctx.clone(),
                            peer,
                            expected: format!("{kind} #{seq} ({dtype}, {len} elements)"),
                            found: format!(
                                "{} #{} ({} elements)",
                                OpKind::from_code(theirs[0] as u8).map_or("?", |k| k.name()),
                                theirs[1],
                                theirs[3]
                            ),
                        });
                    }
                }
            }
            let r = f(comm)?;
            self.wait(&ctx)?;
            Ok(r)
        })();
        result.map_err(|err| {
            if matches!(err, CommError::Timeout { .. }) {
                // Aborting unblocks the device work stuck on a dead peer.
                drop(state.comm.take());
            }
            state.poisoned.get_or_insert_with(|| err.to_string());
            err
        })
    }

    /// Waits for the stream's work, polling so that a dead peer is a timeout, not a hang.
    fn wait(&self, ctx: &OpContext) -> Result<()> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| nccl_err("cuEventRecord", e))?;
        let deadline = Instant::now() + self.timeout;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) if Instant::now() >= deadline => {
                    return Err(CommError::Timeout {
                        op: ctx.clone(),
                        peer: usize::MAX,
                        timeout: self.timeout,
                    });
                }
                Ok(false) => std::thread::sleep(Duration::from_micros(50)),
                Err(e) => return Err(nccl_err(&ctx.to_string(), e)),
            }
        }
    }

    /// All-reduces a device buffer in place.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce`].
    pub fn all_reduce_device<T: NcclType + Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let len = buf.len();
        let bytes = len * std::mem::size_of::<T>();
        self.run(OpKind::AllReduce, T::DTYPE, len, op.code() as i64, |comm| {
            comm.all_reduce_in_place(buf, &nccl_op(op))
                .map_err(|e| nccl_err("ncclAllReduce", e))?;
            Ok(())
        })?;
        self.count(OpKind::AllReduce, 2 * self.ring_share(bytes));
        Ok(())
    }

    /// All-gathers equal device shards: `output.len() == input.len() * world_size`.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_gather`].
    pub fn all_gather_device<T: NcclType + Element + DeviceRepr>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
    ) -> Result<()> {
        self.check_equal(OpKind::AllGather, input.len(), output.len())?;
        let bytes = output.len() * std::mem::size_of::<T>();
        self.run(OpKind::AllGather, T::DTYPE, output.len(), 0, |comm| {
            comm.all_gather(input, output)
                .map_err(|e| nccl_err("ncclAllGather", e))?;
            Ok(())
        })?;
        self.count(OpKind::AllGather, self.ring_share(bytes));
        Ok(())
    }

    /// Reduce-scatters into equal device shards: `input.len() == output.len() * world_size`.
    ///
    /// # Errors
    /// As [`ProcessGroup::reduce_scatter`].
    pub fn reduce_scatter_device<T: NcclType + Element + DeviceRepr>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_equal(OpKind::ReduceScatter, output.len(), input.len())?;
        let bytes = input.len() * std::mem::size_of::<T>();
        self.run(
            OpKind::ReduceScatter,
            T::DTYPE,
            input.len(),
            op.code() as i64,
            |comm| {
                comm.reduce_scatter(input, output, &nccl_op(op))
                    .map_err(|e| nccl_err("ncclReduceScatter", e))?;
                Ok(())
            },
        )?;
        self.count(OpKind::ReduceScatter, self.ring_share(bytes));
        Ok(())
    }

    /// Broadcasts a device buffer from `root`.
    ///
    /// # Errors
    /// As [`ProcessGroup::broadcast`].
    pub fn broadcast_device<T: NcclType + Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<()> {
        let len = buf.len();
        self.run(OpKind::Broadcast, T::DTYPE, len, root as i64, |comm| {
            comm.broadcast_in_place(buf, root as i32)
                .map_err(|e| nccl_err("ncclBroadcast", e))?;
            Ok(())
        })?;
        self.count(
            OpKind::Broadcast,
            self.ring_share(len * std::mem::size_of::<T>()),
        );
        Ok(())
    }

    fn check_equal(&self, kind: OpKind, shard: usize, whole: usize) -> Result<()> {
        if shard * self.world_size != whole {
            return Err(CommError::InvalidArgument {
                op: self.ctx(kind, 0),
                message: format!(
                    "device shards must be equal: {shard} x {} ranks != {whole}; pad the buffer \
                     (the host-buffer methods do this for you)",
                    self.world_size
                ),
            });
        }
        Ok(())
    }

    /// NCCL's ring moves (N-1)/N of a buffer per rank and phase; NCCL does not report bytes,
    /// so the counters record that nominal volume.
    fn ring_share(&self, bytes: usize) -> usize {
        bytes * (self.world_size - 1) / self.world_size
    }

    fn count(&self, kind: OpKind, bytes: usize) {
        self.counters.sent(kind, bytes);
        self.counters.received(kind, bytes);
    }

    fn host_all_reduce<T: NcclType + Element + DeviceRepr>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let mut d = self
            .stream
            .clone_htod(buf)
            .map_err(|e| nccl_err("copy", e))?;
        self.all_reduce_device(&mut d, op)?;
        self.stream
            .memcpy_dtoh(&d, buf)
            .map_err(|e| nccl_err("copy", e))?;
        self.stream.synchronize().map_err(|e| nccl_err("sync", e))
    }

    fn host_all_gather<T: NcclType + Element + DeviceRepr>(
        &self,
        input: &[T],
        output: &mut [T],
    ) -> Result<()> {
        let (n, r, len) = (self.world_size, self.rank, output.len());
        let mine = shard_range(len, n, r);
        if input.len() != mine.len() {
            return Err(CommError::InvalidArgument {
                op: self.ctx(OpKind::AllGather, 0),
                message: format!(
                    "input has {} elements but rank {r}'s shard of a {len}-element output is {}",
                    input.len(),
                    mine.len()
                ),
            });
        }
        let chunk = len.div_ceil(n);
        let mut padded = input.to_vec();
        padded.resize(chunk, T::from_f64(0.0));
        let d_in = self
            .stream
            .clone_htod(&padded)
            .map_err(|e| nccl_err("copy", e))?;
        let mut d_out = self
            .stream
            .clone_htod(&vec![T::from_f64(0.0); chunk * n])
            .map_err(|e| nccl_err("alloc", e))?;
        self.all_gather_device(&d_in, &mut d_out)?;
        let all = self
            .stream
            .clone_dtoh(&d_out)
            .map_err(|e| nccl_err("copy", e))?;
        for p in 0..n {
            let range = shard_range(len, n, p);
            output[range.clone()].copy_from_slice(&all[p * chunk..p * chunk + range.len()]);
        }
        Ok(())
    }

    fn host_reduce_scatter<T: NcclType + Element + DeviceRepr>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r, len) = (self.world_size, self.rank, input.len());
        let mine = shard_range(len, n, r);
        if output.len() != mine.len() {
            return Err(CommError::InvalidArgument {
                op: self.ctx(OpKind::ReduceScatter, 0),
                message: format!(
                    "output has {} elements but rank {r}'s shard of a {len}-element input is {}",
                    output.len(),
                    mine.len()
                ),
            });
        }
        let chunk = len.div_ceil(n);
        let mut padded = vec![T::from_f64(0.0); chunk * n];
        for p in 0..n {
            let range = shard_range(len, n, p);
            padded[p * chunk..p * chunk + range.len()].copy_from_slice(&input[range]);
        }
        let d_in = self
            .stream
            .clone_htod(&padded)
            .map_err(|e| nccl_err("copy", e))?;
        let mut d_out = self
            .stream
            .clone_htod(&vec![T::from_f64(0.0); chunk])
            .map_err(|e| nccl_err("alloc", e))?;
        self.reduce_scatter_device(&d_in, &mut d_out, op)?;
        let got = self
            .stream
            .clone_dtoh(&d_out)
            .map_err(|e| nccl_err("copy", e))?;
        output.copy_from_slice(&got[..mine.len()]);
        Ok(())
    }

    fn host_broadcast<T: NcclType + Element + DeviceRepr>(
        &self,
        buf: &mut [T],
        root: usize,
    ) -> Result<()> {
        let mut d = self
            .stream
            .clone_htod(buf)
            .map_err(|e| nccl_err("copy", e))?;
        self.broadcast_device(&mut d, root)?;
        self.stream
            .memcpy_dtoh(&d, buf)
            .map_err(|e| nccl_err("copy", e))?;
        self.stream.synchronize().map_err(|e| nccl_err("sync", e))
    }

    fn host_send<T: NcclType + Element + DeviceRepr>(&self, buf: &[T], dst: usize) -> Result<()> {
        // The length travels first, so the receiver checks it instead of NCCL hanging.
        let head = self
            .stream
            .clone_htod(&[buf.len() as i64, T::DTYPE.code() as i64])
            .map_err(|e| nccl_err("copy", e))?;
        let d = self
            .stream
            .clone_htod(buf)
            .map_err(|e| nccl_err("copy", e))?;
        self.run(OpKind::SendRecv, T::DTYPE, buf.len(), dst as i64, |comm| {
            comm.send(&head, dst as i32)
                .map_err(|e| nccl_err("ncclSend", e))?;
            comm.send(&d, dst as i32)
                .map_err(|e| nccl_err("ncclSend", e))
        })?;
        self.count(OpKind::SendRecv, std::mem::size_of_val(buf));
        Ok(())
    }

    fn host_recv<T: NcclType + Element + DeviceRepr>(
        &self,
        buf: &mut [T],
        src: usize,
    ) -> Result<()> {
        let mut head = self
            .stream
            .clone_htod(&[0i64; 2])
            .map_err(|e| nccl_err("copy", e))?;
        let mut d = self
            .stream
            .clone_htod(buf)
            .map_err(|e| nccl_err("copy", e))?;
        let len = buf.len();
        let stream = self.stream.clone();
        let ctx = self.ctx(OpKind::SendRecv, 0);
        self.run(OpKind::SendRecv, T::DTYPE, len, src as i64, |comm| {
            comm.recv(&mut head, src as i32)
                .map_err(|e| nccl_err("ncclRecv", e))?;
            self.wait(&ctx)?;
            let h = stream.clone_dtoh(&head).map_err(|e| nccl_err("copy", e))?;
            if h[0] as usize != len || h[1] != T::DTYPE.code() as i64 {
                return Err(CommError::Mismatch {
                    op: ctx.clone(),
                    peer: src,
                    expected: format!("recv({}, {len} elements)", T::DTYPE),
                    found: format!("send({} elements)", h[0]),
                });
            }
            comm.recv(&mut d, src as i32)
                .map_err(|e| nccl_err("ncclRecv", e))?;
            Ok(())
        })?;
        self.stream
            .memcpy_dtoh(&d, buf)
            .map_err(|e| nccl_err("copy", e))?;
        self.stream.synchronize().map_err(|e| nccl_err("sync", e))?;
        self.count(OpKind::SendRecv, std::mem::size_of_val(buf));
        Ok(())
    }
}

fn nccl_op(op: ReduceOp) -> cudarc::nccl::safe::ReduceOp {
    use cudarc::nccl::safe::ReduceOp as N;
    match op {
        ReduceOp::Sum => N::Sum,
        ReduceOp::Avg => N::Avg,
        ReduceOp::Max => N::Max,
        ReduceOp::Min => N::Min,
    }
}

macro_rules! dispatch {
    ($buf:expr, |$b:ident| $body:expr) => {
        match $buf {
            BufMut::F32($b) => $body,
            BufMut::F16($b) => $body,
            BufMut::BF16($b) => $body,
            BufMut::I64($b) => $body,
        }
    };
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn name(&self) -> &str {
        &self.name
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        dispatch!(buf, |b| self.host_all_reduce(b, op))
    }
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        match (input, output) {
            (BufRef::F32(i), BufMut::F32(o)) => self.host_all_gather(i, o),
            (BufRef::F16(i), BufMut::F16(o)) => self.host_all_gather(i, o),
            (BufRef::BF16(i), BufMut::BF16(o)) => self.host_all_gather(i, o),
            (BufRef::I64(i), BufMut::I64(o)) => self.host_all_gather(i, o),
            (i, o) => Err(CommError::DTypeMismatch {
                op: self.ctx(OpKind::AllGather, 0),
                a: i.dtype(),
                b: o.dtype(),
            }),
        }
    }
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        match (input, output) {
            (BufRef::F32(i), BufMut::F32(o)) => self.host_reduce_scatter(i, o, op),
            (BufRef::F16(i), BufMut::F16(o)) => self.host_reduce_scatter(i, o, op),
            (BufRef::BF16(i), BufMut::BF16(o)) => self.host_reduce_scatter(i, o, op),
            (BufRef::I64(i), BufMut::I64(o)) => self.host_reduce_scatter(i, o, op),
            (i, o) => Err(CommError::DTypeMismatch {
                op: self.ctx(OpKind::ReduceScatter, 0),
                a: i.dtype(),
                b: o.dtype(),
            }),
        }
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        dispatch!(buf, |b| self.host_broadcast(b, root))
    }
    fn send(&self, buf: BufRef<'_>, dst: usize) -> Result<()> {
        match buf {
            BufRef::F32(b) => self.host_send(b, dst),
            BufRef::F16(b) => self.host_send(b, dst),
            BufRef::BF16(b) => self.host_send(b, dst),
            BufRef::I64(b) => self.host_send(b, dst),
        }
    }
    fn recv(&self, buf: BufMut<'_>, src: usize) -> Result<()> {
        dispatch!(buf, |b| self.host_recv(b, src))
    }
    fn barrier(&self) -> Result<()> {
        let mut v = [0i64];
        self.host_all_reduce(&mut v, ReduceOp::Sum)
    }
    fn split(&self, ranks: &[usize], name: &str) -> Result<Arc<dyn ProcessGroup>> {
        let Some(me) = ranks.iter().position(|&r| r == self.rank) else {
            return Err(CommError::InvalidArgument {
                op: self.ctx(OpKind::Barrier, 0),
                message: format!("split: this rank ({}) is not in {ranks:?}", self.rank),
            });
        };
        let globals: Vec<usize> = ranks.iter().map(|&r| self.members[r]).collect();
        let count = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let c = state.splits.entry(globals.clone()).or_insert(0);
            *c += 1;
            *c
        };
        let key = format!(
            "kiln/nccl/{}/split/{}/{count}/{}",
            self.name,
            globals
                .iter()
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(","),
            name
        );
        let comm = Self::init_comm(&self.store, &key, &self.stream, me, ranks.len())?;
        Ok(Arc::new(NcclGroup {
            state: Mutex::new(State {
                comm: Some(SendComm(comm)),
                seq: 0,
                splits: Default::default(),
                poisoned: None,
            }),
            stream: self.stream.clone(),
            rank: me,
            world_size: ranks.len(),
            members: globals,
            name: name.to_string(),
            timeout: self.timeout,
            counters: Counters::default(),
            store: self.store.clone(),
            _server: self._server.clone(),
        }))
    }
    fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }
}
