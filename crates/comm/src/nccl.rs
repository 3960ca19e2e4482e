//! [`NcclGroup`] (feature `nccl`): GPUs through NCCL, via cudarc's raw bindings.
//!
//! cudarc loads `libcuda` and `libnccl` at run time, so this compiles on machines without
//! CUDA; [`NcclGroup::check_libraries`] turns their absence into an error instead of cudarc's
//! panic. cudarc looks for `libnccl.so` (and `libnccl.so.<CUDA major>`), not the
//! `libnccl.so.2` that NCCL packages install: where only the latter exists the error says so
//! and gives the symlink to make, and `kiln launch` makes it itself (see `kiln-cli`).
//!
//! The communicator's unique id is exchanged through the rendezvous store. Three interfaces:
//! - raw device pointers (`*_raw`, unsafe): device memory owned by someone else (Burn's CUDA
//!   tensors; see `kiln-shard`'s `device` module), no host copies;
//! - device buffers ([`CudaSlice`]): `*_device` methods;
//! - host buffers: [`ProcessGroup`], staged through device memory (for conformance checks,
//!   metrics and small tensors).
//!
//! All run on the group's stream and return once the work is complete on the device.
//!
//! What NCCL's documented semantics require, and where it is handled:
//! - a rank that never joins must not hang the others: the communicator is created
//!   non-blocking (`ncclCommInitRankConfig`, `blocking = 0`) and polled with
//!   `ncclCommGetAsyncError` until ready or the group's timeout, then aborted
//!   ([`RawComm::init`]); every later call is polled the same way, and device completion is
//!   polled through an event, so a dead peer is a [`CommError::Timeout`] and an aborted
//!   communicator, never a hang;
//! - point-to-point calls block until the peer posts the matching call, but kiln's groups
//!   promise sends that return before it (pipelines rely on it): a host `send` is queued in an
//!   [`Outbox`] whose thread for that destination sends it on a two-rank communicator and
//!   stream of its own ([`LinkOpener`]), and `recv` reads the link in the other direction, so
//!   a send waiting for its receiver holds up nothing else. Device-pointer exchanges
//!   ([`NcclGroup::send_recv_raw`]) post both calls inside one `ncclGroupStart/End`
//!   ([`exchange_plan`]); a message to this rank is a local copy;
//! - zero-length buffers would become `cuMemAlloc(0)` (an error): zero-length collectives are
//!   checked like any other (arguments, descriptors) and enqueue nothing ([`launch_plan`]);
//! - NCCL hangs on mismatched collectives; so before each collective the ranks all-gather a
//!   4-integer descriptor (kind, sequence number, dtype and op, length) and compare, turning a
//!   mismatch into [`CommError::Mismatch`].
//!
//! After any failure the communicator is aborted (`ncclCommAbort`) and the group is poisoned.

use crate::device::{DeviceSharing, choose_cuda_device};
use crate::dtype::{BufMut, BufRef, DType, Element, OwnedBuf, ReduceOp};
use crate::env::LaunchEnv;
use crate::error::{CommError, OpContext, OpKind, Result};
use crate::group::{GroupOptions, ProcessGroup};
use crate::lock;
use crate::outbox::{Link, Outbox};
use crate::shard::shard_range;
use crate::stats::{CommStats, Counters};
use crate::store::{StoreClient, StoreServer};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use cudarc::nccl::sys as ns;
use half::{bf16, f16};
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The oldest NCCL with everything used here (`ncclCommInitRankConfig`, non-blocking
/// communicators, `ncclGetLastError`): 2.14. cudarc panics on a missing symbol, so older
/// libraries are refused up front.
const MIN_NCCL_VERSION: c_int = 21400;

/// A raw NCCL communicator, aborted on drop or by [`RawComm::abort`], once.
///
/// `ncclCommAbort`, not `ncclCommFinalize` + `ncclCommDestroy`: finalising waits for peers and
/// would hang on a dead one; abort frees the resources without waiting.
struct RawComm(ns::ncclComm_t, AtomicBool);

// SAFETY: NCCL allows a communicator to be used from any thread as long as calls are
// serialised; every use goes through `NcclGroup::state`'s mutex.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Why polling a communicator stopped.
#[derive(Debug)]
enum NotReady {
    TimedOut,
    Failed(String),
}

/// NCCL's text for a status and, with a communicator, its last error message.
fn describe(r: ns::ncclResult_t, comm: Option<ns::ncclComm_t>) -> String {
    // SAFETY: both return pointers to static or communicator-owned NUL-terminated strings.
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let base = text(unsafe { ns::ncclGetErrorString(r) });
    let last = comm.map_or(String::new(), |c| text(unsafe { ns::ncclGetLastError(c) }));
    if last.is_empty() {
        format!("{r:?} ({base})")
    } else {
        format!("{r:?} ({base}): {last}")
    }
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`. NCCL reads `size` and copies at most the
/// fields it knows, so a library older than these bindings (2.30) accepts the struct.
fn nonblocking_config() -> ns::ncclConfig_t {
    const UNDEF: c_int = c_int::MIN;
    ns::ncclConfig_t {
        size: std::mem::size_of::<ns::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 23000,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

impl RawComm {
    fn new(comm: ns::ncclComm_t) -> Self {
        RawComm(comm, AtomicBool::new(false))
    }

    /// Aborts the communicator (the first call only): its operations stuck on a lost peer end,
    /// so that the stream can be waited for again (freeing a buffer may wait for it). Nothing
    /// may be asked of the communicator after this, not even its last error.
    fn abort(&self) {
        if !self.1.swap(true, Ordering::SeqCst) {
            // SAFETY: the handle came from a successful (possibly still in-progress) init and
            // is aborted once; abort is valid in any state. Its status is of no use here.
            let _ = unsafe { ns::ncclCommAbort(self.0) };
        }
    }

    /// Creates rank `rank` of a `world`-rank communicator, non-blocking, and waits until it is
    /// ready or `deadline` passes (then it is aborted: the caller gets an error, not a hang).
    fn init(id: ns::ncclUniqueId, rank: usize, world: usize, deadline: Instant) -> Result<Self> {
        let mut config = nonblocking_config();
        let mut comm: ns::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are valid for the call; NCCL copies the config.
        let r = unsafe {
            ns::ncclCommInitRankConfig(&mut comm, world as c_int, id, rank as c_int, &mut config)
        };
        if comm.is_null() {
            return Err(CommError::Nccl(format!(
                "ncclCommInitRankConfig: {}",
                describe(r, None)
            )));
        }
        let comm = RawComm::new(comm);
        match r {
            ns::ncclResult_t::ncclSuccess | ns::ncclResult_t::ncclInProgress => {}
            e => {
                return Err(CommError::Nccl(format!(
                    "ncclCommInitRankConfig: {}",
                    describe(e, Some(comm.0))
                )));
            }
        }
        comm.ready(deadline).map_err(|e| match e {
            NotReady::TimedOut => CommError::Nccl(format!(
                "ncclCommInitRankConfig (rank {rank} of {world}): not every rank joined before \
                 the group's timeout; the communicator was aborted (is a rank missing or \
                 stuck? the timeout is KILN_COMM_TIMEOUT)"
            )),
            NotReady::Failed(why) => CommError::Nccl(format!(
                "ncclCommInitRankConfig (rank {rank} of {world}): {why} (two ranks on one GPU \
                 is an invalid usage: see kiln_comm::cuda_ordinal)"
            )),
        })?;
        Ok(comm)
    }

    /// The communicator's state as `ncclCommGetAsyncError` reports it: `Ok(true)` when its
    /// pending operation (init, or an enqueue that answered `ncclInProgress`) is done,
    /// `Ok(false)` while it is in progress, the error once NCCL has reported one.
    fn state(&self) -> std::result::Result<bool, String> {
        let mut state = ns::ncclResult_t::ncclInProgress;
        // SAFETY: a live communicator and a valid out-pointer.
        let r = unsafe { ns::ncclCommGetAsyncError(self.0, &mut state) };
        if r != ns::ncclResult_t::ncclSuccess {
            return Err(describe(r, Some(self.0)));
        }
        match state {
            ns::ncclResult_t::ncclSuccess => Ok(true),
            ns::ncclResult_t::ncclInProgress => Ok(false),
            e => Err(describe(e, Some(self.0))),
        }
    }

    /// Polls [`RawComm::state`] until the pending operation is done, fails, or `deadline`
    /// passes.
    fn ready(&self, deadline: Instant) -> std::result::Result<(), NotReady> {
        let mut pause = Duration::from_micros(5);
        while !self.state().map_err(NotReady::Failed)? {
            if Instant::now() >= deadline {
                return Err(NotReady::TimedOut);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        Ok(())
    }
}

/// What one collective enqueues on a group of `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Launch {
    /// Whether the ranks first compare descriptors (needs a peer; point-to-point calls carry
    /// their length in a header instead).
    pub check_descriptors: bool,
    /// Whether data moves: never for zero elements, which NCCL would be handed as
    /// zero-byte device buffers (`cuMemAlloc(0)` fails).
    pub data: bool,
}

/// The plan of a collective of `len` elements: zero-length ones are still checked against the
/// peers (so a rank calling something else is caught) but enqueue no data.
pub(crate) fn launch_plan(kind: OpKind, len: usize, world: usize) -> Launch {
    Launch {
        check_descriptors: world > 1 && kind != OpKind::SendRecv,
        data: len > 0,
    }
}

/// One point-to-point call inside an `ncclGroupStart/End`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum P2pOp {
    Send(usize),
    Recv(usize),
}

/// How [`NcclGroup::send_recv`] moves its messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Exchange {
    /// This rank sends to itself: a copy, no NCCL call (NCCL's send to self needs the matching
    /// receive in the same group; a copy is simpler and cheaper).
    LocalCopy,
    /// Headers (length, dtype) both ways in one group, then `data` in a second group (empty
    /// when both lengths are zero). Within a group NCCL posts the calls together, so the order
    /// in which ranks list sends and receives cannot deadlock.
    Grouped {
        headers: [P2pOp; 2],
        data: Vec<P2pOp>,
    },
}

/// Plans rank `rank`'s exchange: send `send_len` elements to `dst`, receive `recv_len` from
/// `src`.
///
/// # Errors
/// A peer outside the group, or a message to this rank not received by it in the same call.
pub(crate) fn exchange_plan(
    rank: usize,
    world: usize,
    dst: usize,
    src: usize,
    send_len: usize,
    recv_len: usize,
) -> std::result::Result<Exchange, String> {
    if dst >= world || src >= world {
        return Err(format!(
            "send_recv: peers dst={dst}, src={src} must be ranks of this {world}-rank group"
        ));
    }
    match (dst == rank, src == rank) {
        (true, true) if send_len == recv_len => Ok(Exchange::LocalCopy),
        (true, true) => Err(format!(
            "send_recv to this rank: sending {send_len} elements but receiving {recv_len}"
        )),
        (true, false) | (false, true) => Err(format!(
            "send_recv: a message to this rank ({rank}) must be received from this rank in the \
             same call (dst={dst}, src={src})"
        )),
        (false, false) => {
            let mut data = Vec::new();
            if send_len > 0 {
                data.push(P2pOp::Send(dst));
            }
            if recv_len > 0 {
                data.push(P2pOp::Recv(src));
            }
            Ok(Exchange::Grouped {
                headers: [P2pOp::Send(dst), P2pOp::Recv(src)],
                data,
            })
        }
    }
}

fn nccl_dtype(dtype: DType) -> ns::ncclDataType_t {
    match dtype {
        DType::F32 => ns::ncclDataType_t::ncclFloat32,
        DType::F16 => ns::ncclDataType_t::ncclFloat16,
        DType::BF16 => ns::ncclDataType_t::ncclBfloat16,
        DType::I64 => ns::ncclDataType_t::ncclInt64,
    }
}

fn nccl_op(op: ReduceOp) -> ns::ncclRedOp_t {
    match op {
        ReduceOp::Sum => ns::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ns::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => ns::ncclRedOp_t::ncclMax,
        ReduceOp::Min => ns::ncclRedOp_t::ncclMin,
    }
}

/// A message this rank sent to itself with [`ProcessGroup::send`], until it receives it.
struct SelfMessage(Box<dyn Any + Send>);

struct State {
    comm: Option<RawComm>,
    seq: u64,
    p2p_seq: u64,
    splits: HashMap<Vec<usize>, u64>,
    to_self: VecDeque<SelfMessage>,
    poisoned: Option<String>,
}

impl State {
    fn new(comm: RawComm) -> Self {
        State {
            comm: Some(comm),
            seq: 0,
            p2p_seq: 0,
            splits: Default::default(),
            to_self: VecDeque::new(),
            poisoned: None,
        }
    }
}

/// One rank's handle on a group of GPUs communicating through NCCL.
pub struct NcclGroup {
    /// Host point-to-point sends to other ranks, each destination's on its own communicator
    /// (see [`LinkOpener`]); `None` in those two-rank link groups themselves. Dropped
    /// first: its drop delivers what is queued, which may need the store below.
    outbox: Option<Outbox>,
    /// The links that bring host messages from other ranks, by source rank.
    inbound: Mutex<HashMap<usize, Arc<NcclGroup>>>,
    /// What this group's links are opened from (its key, GPU, store).
    links: LinkOpener,
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
            .field("device", &self.stream.context().ordinal())
            .finish_non_exhaustive()
    }
}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Nccl(format!("{what}: {e:?}"))
}

/// The communicator and stream of one collective in progress, with its deadline.
struct Live<'a> {
    comm: &'a RawComm,
    stream: &'a Arc<CudaStream>,
    ctx: &'a OpContext,
    timeout: Duration,
    deadline: Instant,
}

impl Live<'_> {
    fn comm(&self) -> ns::ncclComm_t {
        self.comm.0
    }

    fn stream(&self) -> ns::cudaStream_t {
        self.stream.cu_stream() as ns::cudaStream_t
    }

    fn timeout_err(&self) -> CommError {
        CommError::Timeout {
            op: self.ctx.clone(),
            peer: usize::MAX,
            timeout: self.timeout,
        }
    }

    /// `err`, after aborting the communicator: the caller is about to drop device buffers,
    /// and on a GPU without memory pools cudarc frees them by synchronising the stream, which
    /// an operation stuck on a lost peer would block forever. The group is poisoned after any
    /// error anyway ([`NcclGroup::run`]).
    fn fail(&self, err: CommError) -> CommError {
        self.comm.abort();
        err
    }

    /// Checks an NCCL call's status. A non-blocking communicator may answer `ncclInProgress`;
    /// it must then be polled ready before the next call.
    fn check(&self, what: &str, r: ns::ncclResult_t) -> Result<()> {
        match r {
            ns::ncclResult_t::ncclSuccess => Ok(()),
            ns::ncclResult_t::ncclInProgress => self.comm.ready(self.deadline).map_err(|e| {
                self.fail(match e {
                    NotReady::TimedOut => self.timeout_err(),
                    NotReady::Failed(why) => {
                        CommError::Nccl(format!("{}: {what}: {why}", self.ctx))
                    }
                })
            }),
            e => Err(CommError::Nccl(format!(
                "{}: {what}: {}",
                self.ctx,
                describe(e, Some(self.comm.0))
            ))),
        }
    }

    /// Runs `ops` between `ncclGroupStart` and `ncclGroupEnd`; the group is always closed,
    /// so a failing call cannot leave this thread inside a group.
    fn grouped(&self, what: &str, ops: &[(P2pOp, CUdeviceptr, usize)], dtype: DType) -> Result<()> {
        // SAFETY: group calls only change this thread's NCCL group depth.
        let r = unsafe { ns::ncclGroupStart() };
        self.check("ncclGroupStart", r)?;
        let mut first_err = None;
        for &(op, ptr, len) in ops {
            // SAFETY: the caller guarantees `ptr` holds `len` elements of `dtype` on this GPU.
            let r = unsafe {
                match op {
                    P2pOp::Send(peer) => ns::ncclSend(
                        ptr as *const c_void,
                        len,
                        nccl_dtype(dtype),
                        peer as c_int,
                        self.comm(),
                        self.stream(),
                    ),
                    P2pOp::Recv(peer) => ns::ncclRecv(
                        ptr as *mut c_void,
                        len,
                        nccl_dtype(dtype),
                        peer as c_int,
                        self.comm(),
                        self.stream(),
                    ),
                }
            };
            if first_err.is_none()
                && !matches!(
                    r,
                    ns::ncclResult_t::ncclSuccess | ns::ncclResult_t::ncclInProgress
                )
            {
                first_err = Some(r);
            }
        }
        // SAFETY: closes the group opened above.
        let end = unsafe { ns::ncclGroupEnd() };
        if let Some(e) = first_err {
            return self.check(what, e);
        }
        self.check(what, end)
    }

    /// Checks the result of enqueueing `what`, then waits until the device has run it.
    fn enqueued(&self, what: &str, r: ns::ncclResult_t) -> Result<()> {
        self.check(what, r)?;
        self.complete()
    }

    /// Waits for the stream's work, polling so that a dead peer is an error, not a hang: the
    /// communicator's asynchronous error as soon as NCCL reports one (a peer whose
    /// connection dropped: `ncclRemoteError`), as PyTorch's NCCL watchdog does; else a timeout
    /// (NCCL does not notice every death, e.g. a peer on the same node gone mid-transfer).
    fn complete(&self) -> Result<()> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| nccl_err("cuEventRecord", e))?;
        let mut pause = Duration::from_micros(5);
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) if Instant::now() >= self.deadline => {
                    return Err(self.fail(self.timeout_err()));
                }
                Ok(false) => {
                    if let Err(why) = self.comm.state() {
                        return Err(self.fail(CommError::Nccl(format!("{}: {why}", self.ctx))));
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_micros(200));
                }
                Err(e) => return Err(self.fail(nccl_err(&self.ctx.to_string(), e))),
            }
        }
    }
}

impl NcclGroup {
    /// Checks that the CUDA driver and NCCL libraries can be loaded, and that NCCL is new
    /// enough (2.14).
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
        if !unsafe { ns::is_culib_present() } {
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
        let mut version: c_int = 0;
        // SAFETY: a valid out-pointer.
        let r = unsafe { ns::ncclGetVersion(&mut version) };
        if r != ns::ncclResult_t::ncclSuccess || version < MIN_NCCL_VERSION {
            return Err(CommError::Nccl(format!(
                "NCCL {version} is too old: kiln needs 2.14 or newer (non-blocking \
                 communicators, so that a missing rank is a timeout, not a hang)"
            )));
        }
        Ok(())
    }

    /// Joins the job described by the environment, on the GPU [`choose_cuda_device`] picks.
    ///
    /// # Errors
    /// Missing libraries or GPU, bad launch variables, rendezvous failures.
    pub fn from_env() -> Result<NcclGroup> {
        Self::from_launch_env(&LaunchEnv::from_env()?, GroupOptions::default())
    }

    /// Joins the job described by `env`, one GPU per rank (see [`choose_cuda_device`]; Burn's
    /// device for this rank must be chosen the same way, so that both are on one GPU).
    ///
    /// # Errors
    /// As [`NcclGroup::from_env`]; a rank that does not join within `options.timeout` makes
    /// the others fail (the communicator is aborted), not hang.
    pub fn from_launch_env(env: &LaunchEnv, options: GroupOptions) -> Result<NcclGroup> {
        Self::check_libraries()?;
        let ordinal = choose_cuda_device(
            env.local_rank,
            env.local_world_size,
            DeviceSharing::Exclusive,
        )?;
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            nccl_err(
                &format!("opening GPU {ordinal} (local rank {})", env.local_rank),
                e,
            )
        })?;
        let stream = ctx
            .new_stream()
            .map_err(|e| nccl_err("creating a stream", e))?;
        let (server, store) = env.rendezvous(options.timeout)?;
        let members: Vec<usize> = (0..env.world_size).collect();
        let key = format!("kiln/nccl/{}/id", options.name);
        let comm = Self::init_comm(
            &store,
            &key,
            &stream,
            env.rank,
            env.world_size,
            options.timeout,
        )?;
        Ok(NcclGroup::assemble(
            comm,
            stream,
            env.rank,
            members,
            options.name,
            options.timeout,
            store,
            server,
            key,
            true,
        ))
    }

    /// A handle around a new communicator; `linked`: whether its host sends go through an
    /// [`Outbox`] of per-destination links.
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        comm: RawComm,
        stream: Arc<CudaStream>,
        rank: usize,
        members: Vec<usize>,
        name: String,
        timeout: Duration,
        store: Arc<StoreClient>,
        server: Option<Arc<StoreServer>>,
        key: String,
        linked: bool,
    ) -> NcclGroup {
        let world_size = members.len();
        let links = LinkOpener {
            key,
            context: stream.context().clone(),
            members: members.clone(),
            name: name.clone(),
            timeout,
            store: store.clone(),
            server: server.clone(),
        };
        let outbox = linked.then(|| {
            let opener = links.clone();
            Outbox::new(
                &name,
                rank,
                world_size,
                timeout,
                Arc::new(move |dst| {
                    let link = opener.open(rank, dst, rank)?;
                    Ok(Box::new(SendLink(link)) as Box<dyn Link>)
                }),
            )
        });
        NcclGroup {
            outbox,
            inbound: Mutex::default(),
            links,
            state: Mutex::new(State::new(comm)),
            stream,
            rank,
            world_size,
            members,
            name,
            timeout,
            counters: Counters::default(),
            store,
            _server: server,
        }
    }

    fn init_comm(
        store: &StoreClient,
        key: &str,
        stream: &Arc<CudaStream>,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<RawComm> {
        let deadline = Instant::now() + timeout;
        let id = if rank == 0 {
            let mut id = std::mem::MaybeUninit::<ns::ncclUniqueId>::uninit();
            // SAFETY: a valid out-pointer, initialised on success.
            let r = unsafe { ns::ncclGetUniqueId(id.as_mut_ptr()) };
            if r != ns::ncclResult_t::ncclSuccess {
                return Err(CommError::Nccl(format!(
                    "ncclGetUniqueId: {}",
                    describe(r, None)
                )));
            }
            // SAFETY: initialised by the successful call.
            let id = unsafe { id.assume_init() };
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            store.set(key, &bytes)?;
            id
        } else {
            let bytes = store.get(key)?;
            if bytes.len() != 128 {
                return Err(CommError::Nccl(format!(
                    "the NCCL unique id under '{key}' has {} bytes, not 128",
                    bytes.len()
                )));
            }
            ns::ncclUniqueId {
                internal: std::array::from_fn(|i| bytes[i] as _),
            }
        };
        // NCCL creates the communicator on the calling thread's current device.
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| nccl_err("binding the GPU to this thread", e))?;
        RawComm::init(id, rank, world_size, deadline)
    }

    /// The CUDA stream the group's collectives run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The ordinal of this rank's GPU (among the devices this process sees).
    pub fn device_ordinal(&self) -> usize {
        self.stream.context().ordinal()
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

    fn invalid(&self, kind: OpKind, message: String) -> CommError {
        CommError::InvalidArgument {
            op: self.ctx(kind, 0),
            message,
        }
    }

    /// Runs one operation: descriptor check (collectives), then `f` (which enqueues and
    /// waits), all within the timeout. Collectives take the group's sequence number;
    /// point-to-point calls involve two ranks, not the group, and are numbered apart so that
    /// they cannot put the ranks' collective numbers out of step. Poisons the group and
    /// aborts the communicator on failure.
    fn run<R>(
        &self,
        kind: OpKind,
        dtype: DType,
        len: usize,
        extra: i64,
        f: impl FnOnce(&Live<'_>, Launch) -> Result<R>,
    ) -> Result<R> {
        let mut state = lock(&self.state);
        if let Some(first) = &state.poisoned {
            return Err(CommError::Poisoned {
                group: self.name.clone(),
                first: first.clone(),
            });
        }
        let seq = if kind == OpKind::SendRecv {
            state.p2p_seq += 1;
            state.p2p_seq - 1
        } else {
            state.seq += 1;
            state.seq - 1
        };
        self.counters.call(kind);
        let ctx = self.ctx(kind, seq);
        let plan = launch_plan(kind, len, self.world_size);
        let result = (|| {
            self.stream
                .context()
                .bind_to_thread()
                .map_err(|e| nccl_err("binding the GPU to this thread", e))?;
            let live = Live {
                comm: state.comm.as_ref().expect("present while not poisoned"),
                stream: &self.stream,
                ctx: &ctx,
                timeout: self.timeout,
                deadline: Instant::now() + self.timeout,
            };
            if plan.check_descriptors {
                self.check_descriptors(&live, kind, seq, dtype, len, extra)?;
            }
            f(&live, plan)
        })();
        result.inspect_err(|err| {
            // Aborting unblocks device work stuck on a dead peer and frees the communicator;
            // the group is unusable from here on anyway.
            drop(state.comm.take());
            state.poisoned.get_or_insert_with(|| err.to_string());
        })
    }

    fn check_descriptors(
        &self,
        live: &Live<'_>,
        kind: OpKind,
        seq: u64,
        dtype: DType,
        len: usize,
        extra: i64,
    ) -> Result<()> {
        let desc = [
            kind.code() as i64,
            seq as i64,
            dtype.code() as i64 * 1_000_003 + extra,
            len as i64,
        ];
        let d = self
            .stream
            .clone_htod(&desc)
            .map_err(|e| nccl_err("copy", e))?;
        // SAFETY: fully written by the all-gather before it is read.
        let all = unsafe { self.stream.alloc::<i64>(4 * self.world_size) }
            .map_err(|e| nccl_err("alloc", e))?;
        // SAFETY: both buffers are live device allocations of the right sizes on this GPU.
        let r = unsafe {
            ns::ncclAllGather(
                self.ptr(&d) as *const c_void,
                self.ptr(&all) as *mut c_void,
                4,
                ns::ncclDataType_t::ncclInt64,
                live.comm(),
                live.stream(),
            )
        };
        live.enqueued("ncclAllGather (descriptor)", r)?;
        let all = self
            .stream
            .clone_dtoh(&all)
            .map_err(|e| nccl_err("copy", e))?;
        for (peer, theirs) in all.chunks(4).enumerate() {
            if theirs != desc {
                return Err(CommError::Mismatch {
                    op: live.ctx.clone(),
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
        Ok(())
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> CUdeviceptr {
        // The slice is used on this stream only; its event bookkeeping has nothing to order.
        s.device_ptr(&self.stream).0
    }

    /// All-reduces `len` elements of `dtype` at `input` into `output` (the same pointer for in
    /// place), on this group's GPU.
    ///
    /// # Safety
    /// `input` and `output` must each point to `len` elements of `dtype` in device memory of this group's GPU
    /// ([`NcclGroup::device_ordinal`]), valid until this returns, and the work that wrote them
    /// must be complete (synchronise the producer, e.g. `B::sync(device)`, first): NCCL runs
    /// on this group's [`stream`](NcclGroup::stream), unordered with other streams. The result
    /// is complete on the device when this returns.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce`].
    pub unsafe fn all_reduce_raw(
        &self,
        input: CUdeviceptr,
        output: CUdeviceptr,
        len: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.run(
            OpKind::AllReduce,
            dtype,
            len,
            op.code() as i64,
            |live, plan| {
                if plan.data {
                    // SAFETY: the caller's contract.
                    let r = unsafe {
                        ns::ncclAllReduce(
                            input as *const c_void,
                            output as *mut c_void,
                            len,
                            nccl_dtype(dtype),
                            nccl_op(op),
                            live.comm(),
                            live.stream(),
                        )
                    };
                    live.enqueued("ncclAllReduce", r)?;
                }
                Ok(())
            },
        )?;
        self.count(OpKind::AllReduce, 2 * self.ring_share(len * dtype.size()));
        Ok(())
    }

    /// All-gathers equal shards: `shard_len` elements at `input` from every rank, into
    /// `shard_len * world_size` elements at `output`, in rank order. Pad unequal shards.
    ///
    /// # Safety
    /// As [`NcclGroup::all_reduce_raw`], for both buffers; they must not overlap unless
    /// `input` is this rank's slot of `output` (NCCL's in-place all-gather).
    ///
    /// # Errors
    /// As [`ProcessGroup::all_gather`].
    pub unsafe fn all_gather_raw(
        &self,
        input: CUdeviceptr,
        output: CUdeviceptr,
        shard_len: usize,
        dtype: DType,
    ) -> Result<()> {
        let total = shard_len * self.world_size;
        self.run(OpKind::AllGather, dtype, total, 0, |live, plan| {
            if plan.data {
                // SAFETY: the caller's contract.
                let r = unsafe {
                    ns::ncclAllGather(
                        input as *const c_void,
                        output as *mut c_void,
                        shard_len,
                        nccl_dtype(dtype),
                        live.comm(),
                        live.stream(),
                    )
                };
                live.enqueued("ncclAllGather", r)?;
            }
            Ok(())
        })?;
        self.count(OpKind::AllGather, self.ring_share(total * dtype.size()));
        Ok(())
    }

    /// Reduce-scatters `shard_len * world_size` elements at `input` (on every rank) into
    /// this rank's `shard_len` elements at `output` (rank `r` gets the `r`-th slice).
    ///
    /// # Safety
    /// As [`NcclGroup::all_gather_raw`].
    ///
    /// # Errors
    /// As [`ProcessGroup::reduce_scatter`].
    pub unsafe fn reduce_scatter_raw(
        &self,
        input: CUdeviceptr,
        output: CUdeviceptr,
        shard_len: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let total = shard_len * self.world_size;
        self.run(
            OpKind::ReduceScatter,
            dtype,
            total,
            op.code() as i64,
            |live, plan| {
                if plan.data {
                    // SAFETY: the caller's contract.
                    let r = unsafe {
                        ns::ncclReduceScatter(
                            input as *const c_void,
                            output as *mut c_void,
                            shard_len,
                            nccl_dtype(dtype),
                            nccl_op(op),
                            live.comm(),
                            live.stream(),
                        )
                    };
                    live.enqueued("ncclReduceScatter", r)?;
                }
                Ok(())
            },
        )?;
        self.count(OpKind::ReduceScatter, self.ring_share(total * dtype.size()));
        Ok(())
    }

    /// Broadcasts `len` elements from rank `root`: root's `input` into every rank's `output`
    /// (the same pointer for in place; `input` is read on root only).
    ///
    /// # Safety
    /// As [`NcclGroup::all_reduce_raw`].
    ///
    /// # Errors
    /// As [`ProcessGroup::broadcast`]; a `root` outside the group.
    pub unsafe fn broadcast_raw(
        &self,
        input: CUdeviceptr,
        output: CUdeviceptr,
        len: usize,
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        if root >= self.world_size {
            return Err(self.invalid(
                OpKind::Broadcast,
                format!(
                    "root {root} is not a rank of this {}-rank group",
                    self.world_size
                ),
            ));
        }
        self.run(OpKind::Broadcast, dtype, len, root as i64, |live, plan| {
            if plan.data {
                // SAFETY: the caller's contract.
                let r = unsafe {
                    ns::ncclBroadcast(
                        input as *const c_void,
                        output as *mut c_void,
                        len,
                        nccl_dtype(dtype),
                        root as c_int,
                        live.comm(),
                        live.stream(),
                    )
                };
                live.enqueued("ncclBroadcast", r)?;
            }
            Ok(())
        })?;
        self.count(OpKind::Broadcast, self.ring_share(len * dtype.size()));
        Ok(())
    }

    /// Sends `send_len` elements at `send` to `dst` and receives `recv_len` elements from
    /// `src` into `recv`, both posted in one NCCL group (so that rings and pairwise exchanges
    /// cannot deadlock). The lengths travel in a header first: a receiver expecting another
    /// length gets [`CommError::Mismatch`] instead of NCCL's undefined behaviour. `dst ==
    /// src == rank` is a device-to-device copy.
    ///
    /// # Safety
    /// As [`NcclGroup::all_gather_raw`].
    ///
    /// # Errors
    /// As [`ProcessGroup::send_recv`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn send_recv_raw(
        &self,
        send: CUdeviceptr,
        send_len: usize,
        dst: usize,
        recv: CUdeviceptr,
        recv_len: usize,
        src: usize,
        dtype: DType,
    ) -> Result<()> {
        let plan = exchange_plan(self.rank, self.world_size, dst, src, send_len, recv_len)
            .map_err(|m| self.invalid(OpKind::SendRecv, m))?;
        match plan {
            Exchange::LocalCopy => {
                if send_len > 0 && send != recv {
                    self.stream
                        .context()
                        .bind_to_thread()
                        .map_err(|e| nccl_err("binding the GPU to this thread", e))?;
                    // SAFETY: the caller's contract; the copy is on this group's stream and
                    // waited for below.
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(
                            recv,
                            send,
                            send_len * dtype.size(),
                            self.stream.cu_stream(),
                        )
                    }
                    .map_err(|e| nccl_err("cuMemcpyDtoDAsync", e))?;
                    self.stream.synchronize().map_err(|e| nccl_err("sync", e))?;
                }
                Ok(())
            }
            Exchange::Grouped { headers, data } => {
                let head = self
                    .stream
                    .clone_htod(&[send_len as i64, dtype.code() as i64])
                    .map_err(|e| nccl_err("copy", e))?;
                let incoming = self
                    .stream
                    .clone_htod(&[0i64; 2])
                    .map_err(|e| nccl_err("copy", e))?;
                let (head_ptr, in_ptr) = (self.ptr(&head), self.ptr(&incoming));
                let stream = self.stream.clone();
                self.run(OpKind::SendRecv, dtype, send_len, dst as i64, |live, _| {
                    let ops: Vec<_> = headers
                        .iter()
                        .map(|&op| match op {
                            P2pOp::Send(_) => (op, head_ptr, 2),
                            P2pOp::Recv(_) => (op, in_ptr, 2),
                        })
                        .collect();
                    live.grouped("ncclSend/ncclRecv (header)", &ops, DType::I64)?;
                    live.complete()?;
                    let h = stream
                        .clone_dtoh(&incoming)
                        .map_err(|e| nccl_err("copy", e))?;
                    if h[0] != recv_len as i64 || h[1] != dtype.code() as i64 {
                        return Err(CommError::Mismatch {
                            op: live.ctx.clone(),
                            peer: src,
                            expected: format!("recv({dtype}, {recv_len} elements)"),
                            found: format!(
                                "send({}, {} elements)",
                                u8::try_from(h[1])
                                    .ok()
                                    .and_then(DType::from_code)
                                    .map_or("?".to_string(), |d| d.to_string()),
                                h[0]
                            ),
                        });
                    }
                    if !data.is_empty() {
                        let ops: Vec<_> = data
                            .iter()
                            .map(|&op| match op {
                                P2pOp::Send(_) => (op, send, send_len),
                                P2pOp::Recv(_) => (op, recv, recv_len),
                            })
                            .collect();
                        live.grouped("ncclSend/ncclRecv", &ops, dtype)?;
                        live.complete()?;
                    }
                    Ok(())
                })?;
                self.counters
                    .sent(OpKind::SendRecv, send_len * dtype.size());
                self.counters
                    .received(OpKind::SendRecv, recv_len * dtype.size());
                Ok(())
            }
        }
    }

    /// All-reduces a device buffer in place.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce`].
    pub fn all_reduce_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_device(buf)?;
        let p = self.ptr(buf);
        // SAFETY: a live allocation of `buf.len()` elements on this GPU; work on it from other
        // streams is ordered by `device_ptr`'s events.
        unsafe { self.all_reduce_raw(p, p, buf.len(), T::DTYPE, op) }
    }

    /// All-gathers equal device shards: `output.len() == input.len() * world_size`.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_gather`].
    pub fn all_gather_device<T: Element + DeviceRepr>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
    ) -> Result<()> {
        self.check_equal(OpKind::AllGather, input.len(), output.len())?;
        self.check_device(input)?;
        self.check_device(output)?;
        // SAFETY: as in `all_reduce_device`.
        unsafe { self.all_gather_raw(self.ptr(input), self.ptr(output), input.len(), T::DTYPE) }
    }

    /// Reduce-scatters into equal device shards: `input.len() == output.len() * world_size`.
    ///
    /// # Errors
    /// As [`ProcessGroup::reduce_scatter`].
    pub fn reduce_scatter_device<T: Element + DeviceRepr>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_equal(OpKind::ReduceScatter, output.len(), input.len())?;
        self.check_device(input)?;
        self.check_device(output)?;
        // SAFETY: as in `all_reduce_device`.
        unsafe {
            self.reduce_scatter_raw(
                self.ptr(input),
                self.ptr(output),
                output.len(),
                T::DTYPE,
                op,
            )
        }
    }

    /// Broadcasts a device buffer from `root`.
    ///
    /// # Errors
    /// As [`ProcessGroup::broadcast`].
    pub fn broadcast_device<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<()> {
        self.check_device(buf)?;
        let p = self.ptr(buf);
        // SAFETY: as in `all_reduce_device`.
        unsafe { self.broadcast_raw(p, p, buf.len(), T::DTYPE, root) }
    }

    fn check_device<T>(&self, s: &CudaSlice<T>) -> Result<()> {
        let (mine, theirs) = (self.device_ordinal(), s.context().ordinal());
        if mine != theirs {
            return Err(CommError::Nccl(format!(
                "a buffer on GPU {theirs} passed to group '{}' on GPU {mine}",
                self.name
            )));
        }
        Ok(())
    }

    fn check_equal(&self, kind: OpKind, shard: usize, whole: usize) -> Result<()> {
        if shard * self.world_size != whole {
            return Err(self.invalid(
                kind,
                format!(
                    "device shards must be equal: {shard} x {} ranks != {whole}; pad the buffer \
                     (the host-buffer methods do this for you)",
                    self.world_size
                ),
            ));
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

    /// A device copy of `host` (`None` for an empty slice: no zero-byte allocation).
    fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<Option<CudaSlice<T>>> {
        if host.is_empty() {
            return Ok(None);
        }
        self.stream
            .clone_htod(host)
            .map(Some)
            .map_err(|e| nccl_err("copy to the GPU", e))
    }

    /// An uninitialised device buffer for NCCL to fill (`None` when empty).
    fn scratch<T: DeviceRepr>(&self, len: usize) -> Result<Option<CudaSlice<T>>> {
        if len == 0 {
            return Ok(None);
        }
        // SAFETY: every caller has NCCL overwrite the whole buffer before reading it.
        unsafe { self.stream.alloc::<T>(len) }
            .map(Some)
            .map_err(|e| nccl_err("cuMemAlloc", e))
    }

    fn raw<T>(&self, s: &Option<CudaSlice<T>>) -> CUdeviceptr {
        s.as_ref().map_or(0, |s| self.ptr(s))
    }

    fn download<T: DeviceRepr + Default + Clone>(
        &self,
        d: &Option<CudaSlice<T>>,
        len: usize,
    ) -> Result<Vec<T>> {
        match d {
            Some(d) => self
                .stream
                .clone_dtoh(d)
                .map_err(|e| nccl_err("copy from the GPU", e)),
            None => Ok(vec![T::default(); len]),
        }
    }

    fn host_all_reduce<T: Element + DeviceRepr + Default>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let d = self.upload(buf)?;
        let p = self.raw(&d);
        // SAFETY: `d` holds `buf.len()` elements on this GPU (or nothing, for zero).
        unsafe { self.all_reduce_raw(p, p, buf.len(), T::DTYPE, op)? };
        if !buf.is_empty() {
            buf.copy_from_slice(&self.download(&d, buf.len())?);
        }
        Ok(())
    }

    fn host_all_gather<T: Element + DeviceRepr + Default>(
        &self,
        input: &[T],
        output: &mut [T],
    ) -> Result<()> {
        let (n, r, len) = (self.world_size, self.rank, output.len());
        let mine = shard_range(len, n, r);
        if input.len() != mine.len() {
            return Err(self.invalid(
                OpKind::AllGather,
                format!(
                    "input has {} elements but rank {r}'s shard of a {len}-element output is {}",
                    input.len(),
                    mine.len()
                ),
            ));
        }
        let chunk = len.div_ceil(n);
        let mut padded = input.to_vec();
        padded.resize(chunk, T::from_f64(0.0));
        let d_in = self.upload(&padded)?;
        let d_out = self.scratch::<T>(chunk * n)?;
        // SAFETY: `chunk` and `chunk * n` elements on this GPU (or nothing, for zero).
        unsafe { self.all_gather_raw(self.raw(&d_in), self.raw(&d_out), chunk, T::DTYPE)? };
        let all = self.download(&d_out, chunk * n)?;
        for p in 0..n {
            let range = shard_range(len, n, p);
            output[range.clone()].copy_from_slice(&all[p * chunk..p * chunk + range.len()]);
        }
        Ok(())
    }

    fn host_reduce_scatter<T: Element + DeviceRepr + Default>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r, len) = (self.world_size, self.rank, input.len());
        let mine = shard_range(len, n, r);
        if output.len() != mine.len() {
            return Err(self.invalid(
                OpKind::ReduceScatter,
                format!(
                    "output has {} elements but rank {r}'s shard of a {len}-element input is {}",
                    output.len(),
                    mine.len()
                ),
            ));
        }
        let chunk = len.div_ceil(n);
        let mut padded = vec![T::from_f64(0.0); chunk * n];
        for p in 0..n {
            let range = shard_range(len, n, p);
            padded[p * chunk..p * chunk + range.len()].copy_from_slice(&input[range]);
        }
        let d_in = self.upload(&padded)?;
        let d_out = self.scratch::<T>(chunk)?;
        // SAFETY: `chunk * n` and `chunk` elements on this GPU (or nothing, for zero).
        unsafe { self.reduce_scatter_raw(self.raw(&d_in), self.raw(&d_out), chunk, T::DTYPE, op)? };
        let got = self.download(&d_out, chunk)?;
        output.copy_from_slice(&got[..mine.len()]);
        Ok(())
    }

    fn host_broadcast<T: Element + DeviceRepr + Default>(
        &self,
        buf: &mut [T],
        root: usize,
    ) -> Result<()> {
        let d = self.upload(buf)?;
        let p = self.raw(&d);
        // SAFETY: `buf.len()` elements on this GPU (or nothing, for zero).
        unsafe { self.broadcast_raw(p, p, buf.len(), T::DTYPE, root)? };
        if !buf.is_empty() {
            buf.copy_from_slice(&self.download(&d, buf.len())?);
        }
        Ok(())
    }

    fn host_send_recv<T: Element + DeviceRepr + Default>(
        &self,
        send: &[T],
        dst: usize,
        recv: &mut [T],
        src: usize,
    ) -> Result<()> {
        let plan = exchange_plan(self.rank, self.world_size, dst, src, send.len(), recv.len())
            .map_err(|m| self.invalid(OpKind::SendRecv, m))?;
        if plan == Exchange::LocalCopy {
            recv.copy_from_slice(send);
            return Ok(());
        }
        if self.outbox.is_some() {
            // Host messages travel on the links, so that a `send` on one rank may be matched by
            // the receiving half of a `send_recv` on another; the send is queued, so this order
            // cannot deadlock.
            self.host_send(send, dst)?;
            return self.host_recv(recv, src);
        }
        let d_send = self.upload(send)?;
        let d_recv = self.scratch::<T>(recv.len())?;
        // SAFETY: `send.len()` and `recv.len()` elements on this GPU (or nothing, for zero).
        unsafe {
            self.send_recv_raw(
                self.raw(&d_send),
                send.len(),
                dst,
                self.raw(&d_recv),
                recv.len(),
                src,
                T::DTYPE,
            )?
        };
        if !recv.is_empty() {
            recv.copy_from_slice(&self.download(&d_recv, recv.len())?);
        }
        Ok(())
    }

    /// A lone send. NCCL's point-to-point calls are rendezvous (a send completes when the peer
    /// receives), but kiln's groups promise sends that return before: so a message to another
    /// rank is queued in the [`Outbox`], whose thread for that destination sends it on a
    /// communicator of its own. A message to this rank is queued for the matching
    /// [`ProcessGroup::recv`].
    fn host_send<T: Element + DeviceRepr + Default>(&self, buf: &[T], dst: usize) -> Result<()> {
        if dst == self.rank && dst < self.world_size {
            let mut state = lock(&self.state);
            state.to_self.push_back(SelfMessage(Box::new(buf.to_vec())));
            return Ok(());
        }
        if dst >= self.world_size {
            return Err(self.invalid(
                OpKind::SendRecv,
                format!(
                    "send: rank {dst} is not in this {}-rank group",
                    self.world_size
                ),
            ));
        }
        match &self.outbox {
            Some(outbox) => {
                self.usable()?;
                self.counters.call(OpKind::SendRecv);
                outbox
                    .send(T::buf(buf), dst)
                    .inspect_err(|e| self.poison(e))?;
                self.counters
                    .sent(OpKind::SendRecv, std::mem::size_of_val(buf));
                Ok(())
            }
            None => self.p2p_one(Some((buf, dst)), None::<(&mut [T], usize)>),
        }
    }

    /// Makes the group unusable after a failure outside [`NcclGroup::run`] (a link's), as
    /// `run` does after its own: the communicator is aborted.
    fn poison(&self, err: &CommError) {
        let mut state = lock(&self.state);
        drop(state.comm.take());
        state.poisoned.get_or_insert_with(|| err.to_string());
    }

    /// An error if the group was poisoned by an earlier failure.
    fn usable(&self) -> Result<()> {
        let state = lock(&self.state);
        match &state.poisoned {
            Some(first) => Err(CommError::Poisoned {
                group: self.name.clone(),
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    /// The link that brings messages from `src` (opened at the first message: it waits for
    /// `src`'s sending thread to open its end).
    fn inbound(&self, src: usize) -> Result<Arc<NcclGroup>> {
        let mut links = lock(&self.inbound);
        if let Some(link) = links.get(&src) {
            return Ok(link.clone());
        }
        let link = Arc::new(self.links.open(src, self.rank, self.rank)?);
        links.insert(src, link.clone());
        Ok(link)
    }

    fn host_recv<T: Element + DeviceRepr + Default>(
        &self,
        buf: &mut [T],
        src: usize,
    ) -> Result<()> {
        if src == self.rank && src < self.world_size {
            let message = {
                let mut state = lock(&self.state);
                state.to_self.pop_front()
            };
            let Some(SelfMessage(message)) = message else {
                return Err(self.invalid(
                    OpKind::SendRecv,
                    "recv from this rank, which has sent nothing to itself".into(),
                ));
            };
            return match message.downcast::<Vec<T>>() {
                Ok(v) if v.len() == buf.len() => {
                    buf.copy_from_slice(&v);
                    Ok(())
                }
                Ok(v) => Err(self.invalid(
                    OpKind::SendRecv,
                    format!(
                        "recv of {} elements from this rank, which sent itself {}",
                        buf.len(),
                        v.len()
                    ),
                )),
                Err(_) => Err(self.invalid(
                    OpKind::SendRecv,
                    format!(
                        "recv of {} from this rank, which sent another type",
                        T::DTYPE
                    ),
                )),
            };
        }
        if src >= self.world_size {
            return Err(self.invalid(
                OpKind::SendRecv,
                format!(
                    "recv: rank {src} is not in this {}-rank group",
                    self.world_size
                ),
            ));
        }
        let Some(outbox) = &self.outbox else {
            return self.p2p_one(None::<(&[T], usize)>, Some((buf, src)));
        };
        self.usable()?;
        self.counters.call(OpKind::SendRecv);
        // A failed queued send is reported here too: the peer may be waiting on it.
        outbox
            .check()
            .and_then(|()| self.inbound(src))
            .and_then(|link| link.p2p_one(None::<(&[T], usize)>, Some((&mut *buf, 0))))
            .inspect_err(|e| self.poison(e))?;
        self.counters
            .received(OpKind::SendRecv, std::mem::size_of_val(buf));
        Ok(())
    }

    /// One direction of a point-to-point message, header then data, each in its own group.
    fn p2p_one<T: Element + DeviceRepr + Default>(
        &self,
        send: Option<(&[T], usize)>,
        recv: Option<(&mut [T], usize)>,
    ) -> Result<()> {
        let peer = send
            .as_ref()
            .map_or_else(|| recv.as_ref().unwrap().1, |s| s.1);
        let (send_len, recv_len) = (
            send.as_ref().map_or(0, |s| s.0.len()),
            recv.as_ref().map_or(0, |r| r.0.len()),
        );
        let head = self
            .stream
            .clone_htod(&[send_len as i64, T::DTYPE.code() as i64])
            .map_err(|e| nccl_err("copy", e))?;
        let d_send = self.upload(send.as_ref().map_or(&[][..], |s| s.0))?;
        let d_recv = self.scratch::<T>(recv_len)?;
        let (head_ptr, send_ptr, recv_ptr) =
            (self.ptr(&head), self.raw(&d_send), self.raw(&d_recv));
        let stream = self.stream.clone();
        let is_send = send.is_some();
        self.run(
            OpKind::SendRecv,
            T::DTYPE,
            send_len,
            peer as i64,
            |live, _| {
                let op = if is_send {
                    P2pOp::Send(peer)
                } else {
                    P2pOp::Recv(peer)
                };
                live.grouped(
                    "ncclSend/ncclRecv (header)",
                    &[(op, head_ptr, 2)],
                    DType::I64,
                )?;
                live.complete()?;
                if !is_send {
                    let h = stream.clone_dtoh(&head).map_err(|e| nccl_err("copy", e))?;
                    if h[0] != recv_len as i64 || h[1] != T::DTYPE.code() as i64 {
                        return Err(CommError::Mismatch {
                            op: live.ctx.clone(),
                            peer,
                            expected: format!("recv({}, {recv_len} elements)", T::DTYPE),
                            found: format!("send({} elements)", h[0]),
                        });
                    }
                }
                let (ptr, len) = if is_send {
                    (send_ptr, send_len)
                } else {
                    (recv_ptr, recv_len)
                };
                if len > 0 {
                    live.grouped("ncclSend/ncclRecv", &[(op, ptr, len)], T::DTYPE)?;
                    live.complete()?;
                }
                Ok(())
            },
        )?;
        if let Some((buf, _)) = recv {
            if !buf.is_empty() {
                buf.copy_from_slice(&self.download(&d_recv, recv_len)?);
            }
            self.counters
                .received(OpKind::SendRecv, std::mem::size_of_val(buf));
        } else {
            self.counters
                .sent(OpKind::SendRecv, send_len * T::DTYPE.size());
        }
        Ok(())
    }
}

/// What a group's links are made from: each is a two-rank communicator (sender rank 0,
/// receiver rank 1) on a stream of its own, created under a key derived from the group's.
///
/// One communicator per direction and pair, as PyTorch's `ProcessGroupNCCL` makes one per
/// pair: a link carries sends one way only, so a send waiting for its receiver never holds up
/// a receive on the same rank (which a shared communicator or stream would queue behind it),
/// and neither waits for the group's collectives.
#[derive(Clone)]
struct LinkOpener {
    key: String,
    context: Arc<CudaContext>,
    members: Vec<usize>,
    name: String,
    timeout: Duration,
    store: Arc<StoreClient>,
    server: Option<Arc<StoreServer>>,
}

impl LinkOpener {
    /// The link from group rank `from` to group rank `to`, opened by `me` (one of them).
    fn open(&self, from: usize, to: usize, me: usize) -> Result<NcclGroup> {
        let stream = self
            .context
            .new_stream()
            .map_err(|e| nccl_err("creating a stream", e))?;
        let key = format!("{}/link/{from}->{to}", self.key);
        let rank = usize::from(me == to);
        // A connection of its own: a store client waits for a key holding its connection, and
        // the two ends of links in opposite directions may be opened at once on one rank (a
        // receive on the caller's thread, a send on the outbox's).
        let store = Arc::new(StoreClient::connect_with_token(
            self.store.addr(),
            self.timeout,
            self.store.token(),
        )?);
        let comm = NcclGroup::init_comm(&store, &key, &stream, rank, 2, self.timeout)?;
        Ok(NcclGroup::assemble(
            comm,
            stream,
            rank,
            vec![self.members[from], self.members[to]],
            format!("{} {from}->{to}", self.name),
            self.timeout,
            store,
            self.server.clone(),
            key,
            false,
        ))
    }
}

/// The sending end of a link, driven by the [`Outbox`]'s thread for its destination.
struct SendLink(NcclGroup);

impl Link for SendLink {
    fn send(&mut self, msg: &OwnedBuf) -> Result<()> {
        match msg {
            OwnedBuf::F32(v) => self
                .0
                .p2p_one(Some((&v[..], 1)), None::<(&mut [f32], usize)>),
            OwnedBuf::F16(v) => self
                .0
                .p2p_one(Some((&v[..], 1)), None::<(&mut [f16], usize)>),
            OwnedBuf::BF16(v) => self
                .0
                .p2p_one(Some((&v[..], 1)), None::<(&mut [bf16], usize)>),
            OwnedBuf::I64(v) => self
                .0
                .p2p_one(Some((&v[..], 1)), None::<(&mut [i64], usize)>),
        }
    }
}

macro_rules! dispatch {
    ($buf:expr, |$b:ident| $body:expr) => {
        match $buf {
            BufMut::F32($b) => $body,
            BufMut::F16($b) => $body,
            BufMut::BF16($b) => $body,
            BufMut::I64($b) => $body,
            BufMut::Shape { .. } => Err(crate::error::shape_buffer("nccl", "nccl")),
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
            BufRef::Shape { .. } => Err(crate::error::shape_buffer("nccl", &self.name)),
        }
    }
    fn recv(&self, buf: BufMut<'_>, src: usize) -> Result<()> {
        dispatch!(buf, |b| self.host_recv(b, src))
    }
    fn send_recv(&self, send: BufRef<'_>, dst: usize, recv: BufMut<'_>, src: usize) -> Result<()> {
        match (send, recv) {
            (BufRef::F32(s), BufMut::F32(r)) => self.host_send_recv(s, dst, r, src),
            (BufRef::F16(s), BufMut::F16(r)) => self.host_send_recv(s, dst, r, src),
            (BufRef::BF16(s), BufMut::BF16(r)) => self.host_send_recv(s, dst, r, src),
            (BufRef::I64(s), BufMut::I64(r)) => self.host_send_recv(s, dst, r, src),
            (s, r) => Err(CommError::DTypeMismatch {
                op: self.ctx(OpKind::SendRecv, 0),
                a: s.dtype(),
                b: r.dtype(),
            }),
        }
    }
    fn barrier(&self) -> Result<()> {
        let mut v = [0i64];
        self.host_all_reduce(&mut v, ReduceOp::Sum)
    }
    fn split(&self, ranks: &[usize], name: &str) -> Result<Arc<dyn ProcessGroup>> {
        let Some(me) = ranks.iter().position(|&r| r == self.rank) else {
            return Err(self.invalid(
                OpKind::Barrier,
                format!("split: this rank ({}) is not in {ranks:?}", self.rank),
            ));
        };
        let globals: Vec<usize> = ranks.iter().map(|&r| self.members[r]).collect();
        let count = {
            let mut state = lock(&self.state);
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
        let comm = Self::init_comm(
            &self.store,
            &key,
            &self.stream,
            me,
            ranks.len(),
            self.timeout,
        )?;
        Ok(Arc::new(NcclGroup::assemble(
            comm,
            self.stream.clone(),
            me,
            globals,
            name.to_string(),
            self.timeout,
            self.store.clone(),
            self._server.clone(),
            key,
            true,
        )))
    }
    fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_length_collectives_are_checked_but_move_nothing() {
        for kind in [
            OpKind::AllReduce,
            OpKind::AllGather,
            OpKind::ReduceScatter,
            OpKind::Broadcast,
        ] {
            assert_eq!(
                launch_plan(kind, 0, 4),
                Launch {
                    check_descriptors: true,
                    data: false
                },
                "{kind}"
            );
            assert!(launch_plan(kind, 1, 4).data);
            // Alone, there is nobody to compare with.
            assert!(!launch_plan(kind, 5, 1).check_descriptors);
        }
        // Point-to-point lengths travel in headers, not group descriptors.
        assert!(!launch_plan(OpKind::SendRecv, 5, 4).check_descriptors);
    }

    #[test]
    fn a_ring_exchange_posts_send_and_recv_in_one_group() {
        // The comm-check ring: every rank sends right and receives from the left. Both calls
        // are in one group on every rank, so no rank waits on a send before posting its recv.
        let n = 4;
        for r in 0..n {
            let (dst, src) = ((r + 1) % n, (r + n - 1) % n);
            assert_eq!(
                exchange_plan(r, n, dst, src, 10, 10).unwrap(),
                Exchange::Grouped {
                    headers: [P2pOp::Send(dst), P2pOp::Recv(src)],
                    data: vec![P2pOp::Send(dst), P2pOp::Recv(src)],
                }
            );
        }
        // Two ranks exchanging with each other: the same plan.
        assert_eq!(
            exchange_plan(0, 2, 1, 1, 3, 3).unwrap(),
            Exchange::Grouped {
                headers: [P2pOp::Send(1), P2pOp::Recv(1)],
                data: vec![P2pOp::Send(1), P2pOp::Recv(1)],
            }
        );
    }

    #[test]
    fn a_message_to_this_rank_is_a_local_copy() {
        // World size 1: the ring sends to itself.
        assert_eq!(
            exchange_plan(0, 1, 0, 0, 7, 7).unwrap(),
            Exchange::LocalCopy
        );
        assert_eq!(
            exchange_plan(2, 4, 2, 2, 0, 0).unwrap(),
            Exchange::LocalCopy
        );
        assert!(exchange_plan(0, 1, 0, 0, 7, 6).is_err());
        // Half an exchange with oneself cannot be matched by any other rank.
        let e = exchange_plan(1, 4, 1, 0, 3, 3).unwrap_err();
        assert!(e.contains("must be received from this rank"), "{e}");
        assert!(exchange_plan(1, 4, 2, 1, 3, 3).is_err());
    }

    #[test]
    fn zero_length_exchanges_send_headers_only() {
        assert_eq!(
            exchange_plan(0, 2, 1, 1, 0, 0).unwrap(),
            Exchange::Grouped {
                headers: [P2pOp::Send(1), P2pOp::Recv(1)],
                data: vec![],
            }
        );
        assert_eq!(
            exchange_plan(0, 3, 1, 2, 0, 4).unwrap(),
            Exchange::Grouped {
                headers: [P2pOp::Send(1), P2pOp::Recv(2)],
                data: vec![P2pOp::Recv(2)],
            }
        );
    }

    #[test]
    fn exchange_peers_must_be_in_the_group() {
        let e = exchange_plan(0, 2, 2, 1, 1, 1).unwrap_err();
        assert!(e.contains("dst=2"), "{e}");
    }

    #[test]
    fn the_config_is_nccl_s_initializer_made_non_blocking() {
        let c = nonblocking_config();
        assert_eq!(c.size, std::mem::size_of::<ns::ncclConfig_t>());
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.blocking, 0);
        // Unset fields keep NCCL's defaults (NCCL_CONFIG_UNDEF_INT), not 0.
        assert_eq!(c.minCTAs, c_int::MIN);
        assert_eq!(c.splitShare, c_int::MIN);
    }

    #[test]
    fn every_dtype_has_its_nccl_type() {
        assert_eq!(nccl_dtype(DType::BF16), ns::ncclDataType_t::ncclBfloat16);
        assert_eq!(nccl_dtype(DType::I64), ns::ncclDataType_t::ncclInt64);
        assert_eq!(nccl_op(ReduceOp::Avg), ns::ncclRedOp_t::ncclAvg);
    }
}
