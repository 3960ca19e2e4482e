//! [`MpiGroup`] (feature `mpi`): the ranks of an MPI job (`mpirun`, `srun`), with collectives
//! through the system's MPI library (Open MPI, MPICH, a vendor's), which uses the cluster's
//! fabric (InfiniBand, shared memory within a node) where kiln's TCP transport uses sockets.
//!
//! How it keeps [`ProcessGroup`]'s promises on top of MPI:
//! - **No hang.** Every operation is MPI's non-blocking form (`MPI_Iallreduce`, ...), polled
//!   with `MPI_Test` until done or until the group's timeout, which is then
//!   [`CommError::Timeout`]. MPI cannot cancel a collective, so the buffers it was given are
//!   kiln's own staging buffers, and an abandoned operation's buffers are leaked rather than
//!   freed: a late write lands in memory nobody else uses. A process that abandoned an
//!   operation does not call `MPI_Finalize` (it could wait forever for the lost peer); it exits,
//!   and the MPI launcher ends the job. Staging costs a copy in and out of the caller's
//!   buffers: nothing measurable up to a few MiB, about a quarter of the bandwidth at 64 MiB
//!   over shared memory on a 2-core machine (the README's figures).
//! - **Mismatches named.** Before each collective the ranks all-gather a descriptor (kind,
//!   sequence number, element type, length), as `NcclGroup` does: a rank
//!   that called something else is [`CommError::Mismatch`] on every rank, not undefined
//!   behaviour inside MPI.
//! - **Sends do not wait for the receiver**, as on the local and TCP groups: `send` copies the
//!   message, posts `MPI_Isend` and returns; the request completes in the background of later
//!   calls. Point-to-point messages carry their element type in the tag, and `recv` matches
//!   with `MPI_Improbe` first, so a length or type that differs from the sender's is an error
//!   naming both.
//! - **Every element type.** `f32` and `i64` reduce with MPI's built-in operations; `f16` and
//!   `bf16`, which MPI 3 lacks, travel as 16-bit words and reduce with user operations that
//!   combine them as the other groups do. `Avg` is a sum divided once, as on the TCP group.
//!
//! `MPI_Init` happens when the first group is made and `MPI_Finalize` when the last one is
//! dropped: a process can hold MPI groups only once.

use crate::dtype::{BufMut, BufRef, DType, Element, ReduceOp};
use crate::env::LaunchEnv;
use crate::error::{CommError, OpContext, OpKind, Result};
use crate::group::{GroupOptions, ProcessGroup};
use crate::hash::Fnv1a;
use crate::lock;
use crate::shard::shard_range;
use crate::stats::{CommStats, Counters};
use half::{bf16, f16};
use mpi::ffi;
use std::collections::HashMap;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The tag of the split handshake (on the collective communicator, where nothing else uses
/// point-to-point messages).
const SPLIT_TAG: c_int = 7;
/// Point-to-point messages are tagged `P2P_TAG + dtype code`.
const P2P_TAG: c_int = 100;

/// The process's MPI library: initialised by the first group, finalised after the last.
struct Runtime {
    /// `None` when something else initialised MPI (and will finalise it).
    universe: Mutex<Option<mpi::environment::Universe>>,
    /// Held around every MPI call when the library is not fully thread-safe
    /// (`MPI_THREAD_SERIALIZED`).
    serial: Option<Mutex<()>>,
    /// User reductions of the 16-bit float types: `[f16, bf16] x [sum, max, min]`.
    half_ops: [[ffi::MPI_Op; 3]; 2],
    /// An operation was abandoned at a timeout: MPI may still touch its buffers, and
    /// `MPI_Finalize` could wait forever for the lost peer.
    abandoned: AtomicBool,
}

// SAFETY: the raw handles are plain values that MPI allows any thread to use (the library
// runs at MPI_THREAD_MULTIPLE, or every call holds `serial`).
unsafe impl Send for Runtime {}
unsafe impl Sync for Runtime {}

static RUNTIME: Mutex<Weak<Runtime>> = Mutex::new(Weak::new());

/// `inout[i] = in[i] op inout[i]` for a 16-bit float type; MPI calls it with buffers of its
/// own, which need not be aligned.
unsafe extern "C" fn combine_half<T: Element, const OP: u8>(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _datatype: *mut ffi::MPI_Datatype,
) {
    let op = match OP {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Max,
        _ => ReduceOp::Min,
    };
    // SAFETY: MPI passes `*len` elements of the type the op was used with (16-bit words).
    unsafe {
        for i in 0..(*len).max(0) as usize {
            let a = std::ptr::read_unaligned((invec as *const T).add(i));
            let out = (inoutvec as *mut T).add(i);
            let b = std::ptr::read_unaligned(out);
            std::ptr::write_unaligned(out, T::combine(b, a, op));
        }
    }
}

fn mpi_error(code: c_int) -> String {
    let mut text = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING (256 in Open MPI and MPICH) bytes and more.
    let r = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr() as *mut _, &mut len) };
    if r != 0 || len <= 0 {
        return format!("MPI error {code}");
    }
    text.truncate(len as usize);
    format!("{} (MPI error {code})", String::from_utf8_lossy(&text))
}

impl Runtime {
    fn get() -> Result<Arc<Runtime>> {
        let mut slot = lock(&RUNTIME);
        if let Some(rt) = slot.upgrade() {
            return Ok(rt);
        }
        let mut finalized: c_int = 0;
        // SAFETY: MPI_Finalized may be called at any time.
        unsafe { ffi::MPI_Finalized(&mut finalized) };
        if finalized != 0 {
            return Err(CommError::Setup(
                "MPI was finalised when this process dropped its last MPI group, and an MPI \
                 library cannot start twice in one process: keep a group alive for the whole job"
                    .into(),
            ));
        }
        let (universe, level) =
            match mpi::initialize_with_threading(mpi::environment::Threading::Multiple) {
                Some((universe, level)) => (Some(universe), level),
                None => (None, mpi::environment::threading_support()),
            };
        use mpi::environment::Threading;
        let serial = match level {
            Threading::Multiple => None,
            Threading::Serialized => Some(Mutex::new(())),
            other => {
                return Err(CommError::Setup(format!(
                    "this MPI library offers only {other:?} threading; kiln calls MPI from \
                     several threads and needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE \
                     (Open MPI and MPICH builds usually offer MULTIPLE)"
                )));
            }
        };
        // SAFETY: a placeholder handle (all zeros: a null pointer in Open MPI, 0 in MPICH), each
        // overwritten by MPI_Op_create below.
        let mut half_ops: [[ffi::MPI_Op; 3]; 2] = unsafe { std::mem::zeroed() };
        let functions: [[ffi::MPI_User_function; 3]; 2] = [
            [
                Some(combine_half::<f16, 0>),
                Some(combine_half::<f16, 1>),
                Some(combine_half::<f16, 2>),
            ],
            [
                Some(combine_half::<bf16, 0>),
                Some(combine_half::<bf16, 1>),
                Some(combine_half::<bf16, 2>),
            ],
        ];
        for (ops, fns) in half_ops.iter_mut().zip(functions) {
            for (op, f) in ops.iter_mut().zip(fns) {
                // SAFETY: a valid out-pointer and a function of MPI's user-function type.
                let r = unsafe { ffi::MPI_Op_create(f, 1, op) };
                if r != 0 {
                    return Err(CommError::Mpi(format!("MPI_Op_create: {}", mpi_error(r))));
                }
            }
        }
        let rt = Arc::new(Runtime {
            universe: Mutex::new(universe),
            serial,
            half_ops,
            abandoned: AtomicBool::new(false),
        });
        *slot = Arc::downgrade(&rt);
        if lock(&rt.universe).is_some() {
            // A panic usually ends the process: do not finalise then (see `failing`).
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                failing();
                previous(info)
            }));
            // Groups can outlive `main` (a model's sharding state keeps its group, and
            // `std::process::exit` runs no destructors), yet a process that started MPI must
            // finalise it or the launcher calls the job failed.
            // SAFETY: registering a plain function.
            unsafe { libc::atexit(finalize_at_exit) };
        }
        Ok(rt)
    }

    /// Runs one MPI call (under the serialising lock where the library needs one).
    fn call(&self, f: impl FnOnce() -> c_int) -> c_int {
        let _guard = self.serial.as_ref().map(lock);
        f()
    }

    fn op(&self, dtype: DType, op: ReduceOp) -> ffi::MPI_Op {
        let which = match op {
            ReduceOp::Sum | ReduceOp::Avg => 0,
            ReduceOp::Max => 1,
            ReduceOp::Min => 2,
        };
        // SAFETY: reading MPI's predefined handles after MPI_Init.
        unsafe {
            match (dtype, which) {
                (DType::F16, w) => self.half_ops[0][w],
                (DType::BF16, w) => self.half_ops[1][w],
                (_, 0) => ffi::RSMPI_SUM,
                (_, 1) => ffi::RSMPI_MAX,
                _ => ffi::RSMPI_MIN,
            }
        }
    }
}

impl Runtime {
    /// Finalises MPI, unless an operation was abandoned or the process is failing: then
    /// finalising could wait forever for a lost peer, and exiting without it makes the MPI
    /// launcher end the whole job at once.
    fn finish(&self) {
        let Some(universe) = lock(&self.universe).take() else {
            return; // someone else's MPI, or finalised already
        };
        if self.abandoned.load(Ordering::SeqCst) || FAILING.load(Ordering::SeqCst) {
            std::mem::forget(universe);
            return;
        }
        for mut op in self.half_ops.into_iter().flatten() {
            // SAFETY: ops this runtime created; no operation is in flight at finalisation.
            unsafe { ffi::MPI_Op_free(&mut op) };
        }
        drop(universe);
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Set by [`failing`].
static FAILING: AtomicBool = AtomicBool::new(false);

/// Tells kiln that this process is about to exit with an error: it will not call
/// `MPI_Finalize` (which waits for the other ranks), so the MPI launcher ends the job at once.
/// `kiln`'s commands call it before a non-zero exit, and a panic calls it. A program that
/// exits with an error otherwise (`std::process::exit(1)`) should call it first, or its peers
/// wait for it until their timeout.
pub fn failing() {
    FAILING.store(true, Ordering::SeqCst);
}

extern "C" fn finalize_at_exit() {
    let rt = lock(&RUNTIME).upgrade();
    if let Some(rt) = rt {
        rt.finish();
    }
}

fn datatype(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading MPI's predefined handles after MPI_Init.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::I64 => ffi::RSMPI_INT64_T,
        }
    }
}

/// A communicator this group owns.
struct Comm(ffi::MPI_Comm);

/// Buffers handed to MPI, recycled between operations.
#[derive(Default)]
struct Pool(Mutex<Vec<Vec<u64>>>);

impl Pool {
    /// A buffer of at least `bytes` bytes.
    fn take(&self, bytes: usize) -> Vec<u64> {
        let words = bytes.div_ceil(8).max(1);
        let mut free = lock(&self.0);
        match free.iter().position(|b| b.len() >= words) {
            Some(i) => free.swap_remove(i),
            None => {
                free.pop();
                vec![0u64; words]
            }
        }
    }

    fn give(&self, buf: Vec<u64>) {
        let mut free = lock(&self.0);
        if free.len() < 4 {
            free.push(buf);
        }
    }
}

fn bytes_mut(buf: &mut [u64], len: usize) -> &mut [u8] {
    &mut bytemuck::cast_slice_mut(buf)[..len]
}

fn bytes(buf: &[u64], len: usize) -> &[u8] {
    &bytemuck::cast_slice(buf)[..len]
}

/// Why a wait ended without completing.
enum Unfinished {
    TimedOut { pending: Vec<usize> },
    Failed(String),
}

#[derive(Default)]
struct CollState {
    seq: u64,
    splits: HashMap<Vec<usize>, u64>,
}

#[derive(Default)]
struct P2pState {
    /// Sends handed to MPI that may not have completed, with the copies they read.
    pending: Vec<(ffi::MPI_Request, Vec<u64>)>,
    seq: u64,
}

/// Ranks of an MPI job as a [`ProcessGroup`]: see the [module docs](self).
pub struct MpiGroup {
    /// Collectives, and the split handshake.
    coll: Comm,
    /// Point-to-point messages, apart so that they never match the handshake's.
    p2p: Comm,
    rank: usize,
    world_size: usize,
    /// Ranks of the members in `MPI_COMM_WORLD`, in group order.
    members: Vec<usize>,
    name: String,
    timeout: Duration,
    coll_state: Mutex<CollState>,
    p2p_state: Mutex<P2pState>,
    poisoned: Mutex<Option<String>>,
    pool: Pool,
    counters: Counters,
    // Last: the communicators are freed before the runtime may finalise MPI.
    runtime: Arc<Runtime>,
}

// SAFETY: see `Runtime`; the group's mutable state is behind mutexes.
unsafe impl Send for MpiGroup {}
unsafe impl Sync for MpiGroup {}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl MpiGroup {
    /// Joins the MPI job this process belongs to (`MPI_COMM_WORLD`); started by `mpirun` or
    /// `srun`, or alone as a one-rank job.
    ///
    /// # Errors
    /// MPI that cannot start or lacks thread support, or that was finalised already.
    pub fn world(options: GroupOptions) -> Result<MpiGroup> {
        let runtime = Runtime::get()?;
        // SAFETY: reading a predefined handle after MPI_Init.
        let world = unsafe { ffi::RSMPI_COMM_WORLD };
        let coll = dup(&runtime, world)?;
        let p2p = dup(&runtime, coll.0)?;
        let (rank, size) = rank_and_size(&runtime, coll.0)?;
        Ok(MpiGroup {
            coll,
            p2p,
            rank,
            world_size: size,
            members: (0..size).collect(),
            name: options.name,
            timeout: options.timeout,
            coll_state: Mutex::default(),
            p2p_state: Mutex::default(),
            poisoned: Mutex::new(None),
            pool: Pool::default(),
            counters: Counters::default(),
            runtime,
        })
    }

    /// [`world`](Self::world), checked against the launcher's variables: a job whose
    /// variables say one layout while MPI sees another (typically `kiln launch` or torchrun
    /// starting processes that MPI then sees as separate one-rank jobs) is an error.
    ///
    /// # Errors
    /// As [`world`](Self::world); [`CommError::Config`] when the layouts differ.
    pub fn from_launch_env(env: &LaunchEnv, options: GroupOptions) -> Result<MpiGroup> {
        let group = Self::world(options)?;
        if (group.rank, group.world_size) != (env.rank, env.world_size) {
            return Err(CommError::Config(format!(
                "MPI sees rank {} of {} but the launcher's variables ({:?}) say rank {} of {}: \
                 the mpi backend needs the job started by MPI's own launcher (mpirun, mpiexec \
                 or srun with MPI support); `kiln launch` and torchrun start jobs for the tcp \
                 and nccl backends",
                group.rank, group.world_size, env.source, env.rank, env.world_size
            )));
        }
        Ok(group)
    }

    /// Joins the job of the environment ([`from_launch_env`](Self::from_launch_env) with the
    /// default options), or the MPI world when no launcher variables are set.
    ///
    /// # Errors
    /// As [`from_launch_env`](Self::from_launch_env).
    pub fn from_env() -> Result<MpiGroup> {
        if LaunchEnv::launched() {
            Self::from_launch_env(&LaunchEnv::from_env()?, GroupOptions::default())
        } else {
            Self::world(GroupOptions::default())
        }
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

    fn check(&self, ctx: &OpContext, what: &str, r: c_int) -> Result<()> {
        if r == 0 {
            Ok(())
        } else {
            Err(CommError::Mpi(format!("{ctx}: {what}: {}", mpi_error(r))))
        }
    }

    /// `len` as MPI's `int` count.
    fn count(&self, kind: OpKind, len: usize) -> Result<c_int> {
        c_int::try_from(len).map_err(|_| {
            self.invalid(
                kind,
                format!(
                    "{len} elements: MPI counts are C ints (at most {}); split the buffer",
                    c_int::MAX
                ),
            )
        })
    }

    fn poisoned(&self) -> Result<()> {
        match &*lock(&self.poisoned) {
            Some(first) => Err(CommError::Poisoned {
                group: self.name.clone(),
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    fn poison(&self, err: &CommError) {
        lock(&self.poisoned).get_or_insert_with(|| err.to_string());
    }

    /// Polls `reqs` until all complete, or until `deadline`. On a timeout the buffers in
    /// `hold` are leaked (MPI may still write them) and the runtime will not finalise.
    fn wait(
        &self,
        reqs: &mut [ffi::MPI_Request],
        deadline: Instant,
        hold: Vec<Vec<u64>>,
    ) -> std::result::Result<Vec<Vec<u64>>, Unfinished> {
        // SAFETY: reading a predefined handle after MPI_Init.
        let null = unsafe { ffi::RSMPI_REQUEST_NULL };
        let started = Instant::now();
        loop {
            let mut all_done = true;
            for req in reqs.iter_mut() {
                if *req == null {
                    continue;
                }
                let mut done: c_int = 0;
                let r = self.runtime.call(|| {
                    // SAFETY: a live request; MPI sets it to MPI_REQUEST_NULL when complete.
                    unsafe { ffi::MPI_Test(req, &mut done, ffi::RSMPI_STATUS_IGNORE) }
                });
                if r != 0 {
                    self.abandon(hold);
                    return Err(Unfinished::Failed(mpi_error(r)));
                }
                all_done &= done != 0;
            }
            if all_done {
                return Ok(hold);
            }
            if Instant::now() >= deadline {
                let pending = reqs
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| **r != null)
                    .map(|(i, _)| i)
                    .collect();
                self.abandon(hold);
                return Err(Unfinished::TimedOut { pending });
            }
            pause(started);
        }
    }

    fn abandon(&self, hold: Vec<Vec<u64>>) {
        self.runtime.abandoned.store(true, Ordering::SeqCst);
        std::mem::forget(hold);
    }

    fn unfinished(&self, ctx: &OpContext, what: &str, u: Unfinished) -> CommError {
        match u {
            Unfinished::TimedOut { .. } => CommError::Timeout {
                op: ctx.clone(),
                peer: usize::MAX,
                timeout: self.timeout,
            },
            Unfinished::Failed(why) => CommError::Mpi(format!("{ctx}: {what}: {why}")),
        }
    }

    /// Completes sends that MPI has finished with, recycling their copies.
    fn reap_sends(&self) -> Result<()> {
        let mut p2p = lock(&self.p2p_state);
        let mut err = None;
        p2p.pending.retain_mut(|(req, buf)| {
            let mut done: c_int = 0;
            // SAFETY: a live send request.
            let r = self
                .runtime
                .call(|| unsafe { ffi::MPI_Test(req, &mut done, ffi::RSMPI_STATUS_IGNORE) });
            if r != 0 {
                err.get_or_insert(r);
                return true;
            }
            if done != 0 {
                self.pool.give(std::mem::take(buf));
            }
            done == 0
        });
        match err {
            Some(r) => Err(CommError::Mpi(format!(
                "a send on group '{}': {}",
                self.name,
                mpi_error(r)
            ))),
            None => Ok(()),
        }
    }

    /// Runs one collective: the descriptor check, then `f`, within the timeout. Poisons the
    /// group on failure.
    fn collective<R>(
        &self,
        kind: OpKind,
        dtype: DType,
        len: usize,
        extra: i64,
        f: impl FnOnce(&OpContext, Instant) -> Result<R>,
    ) -> Result<R> {
        self.poisoned()?;
        let mut state = lock(&self.coll_state);
        let seq = state.seq;
        state.seq += 1;
        self.counters.call(kind);
        let ctx = self.ctx(kind, seq);
        let deadline = Instant::now() + self.timeout;
        let result = (|| {
            self.reap_sends()?;
            if self.world_size > 1 {
                self.check_descriptors(&ctx, deadline, dtype, len, extra)?;
            }
            f(&ctx, deadline)
        })();
        drop(state);
        result.inspect_err(|e| self.poison(e))
    }

    fn check_descriptors(
        &self,
        ctx: &OpContext,
        deadline: Instant,
        dtype: DType,
        len: usize,
        extra: i64,
    ) -> Result<()> {
        let desc = [
            ctx.kind.code() as i64,
            ctx.seq as i64,
            dtype.code() as i64 * 1_000_003 + extra,
            len as i64,
        ];
        let mut send = self.pool.take(32);
        send[..4].copy_from_slice(bytemuck::cast_slice(&desc));
        let mut all = self.pool.take(32 * self.world_size);
        let mut req = null_request();
        // SAFETY: 4 i64 in `send`, 4 per rank in `all`; both held until the request completes
        // (or leaked with it).
        let r = self.runtime.call(|| unsafe {
            ffi::MPI_Iallgather(
                send.as_ptr() as *const c_void,
                4,
                ffi::RSMPI_INT64_T,
                all.as_mut_ptr() as *mut c_void,
                4,
                ffi::RSMPI_INT64_T,
                self.coll.0,
                &mut req,
            )
        });
        self.check(ctx, "MPI_Iallgather (descriptor)", r)?;
        let mut bufs = self
            .wait(std::slice::from_mut(&mut req), deadline, vec![send, all])
            .map_err(|u| self.unfinished(ctx, "MPI_Iallgather (descriptor)", u))?;
        let all = bufs.pop().expect("two buffers");
        self.pool.give(bufs.pop().expect("two buffers"));
        let theirs: Vec<i64> = bytemuck::cast_slice(&all[..4 * self.world_size]).to_vec();
        self.pool.give(all);
        for (peer, d) in theirs.chunks(4).enumerate() {
            if d != desc {
                return Err(CommError::Mismatch {
                    op: ctx.clone(),
                    peer,
                    expected: format!("{} #{} ({dtype}, {len} elements)", ctx.kind, ctx.seq),
                    found: format!(
                        "{} #{} ({} elements)",
                        OpKind::from_code(d[0] as u8).map_or("?", |k| k.name()),
                        d[1],
                        d[3]
                    ),
                });
            }
        }
        Ok(())
    }

    /// Starts one non-blocking call on buffers of `hold` and waits for it.
    fn start_and_wait(
        &self,
        ctx: &OpContext,
        deadline: Instant,
        what: &str,
        hold: Vec<Vec<u64>>,
        start: impl FnOnce(&mut [Vec<u64>], *mut ffi::MPI_Request) -> c_int,
    ) -> Result<Vec<Vec<u64>>> {
        let mut hold = hold;
        let mut req = null_request();
        let r = self.runtime.call(|| start(&mut hold, &mut req));
        if r != 0 {
            // Not started: nothing refers to the buffers.
            return Err(CommError::Mpi(format!("{ctx}: {what}: {}", mpi_error(r))));
        }
        self.wait(std::slice::from_mut(&mut req), deadline, hold)
            .map_err(|u| self.unfinished(ctx, what, u))
    }

    fn recycle(&self, bufs: Vec<Vec<u64>>) {
        for b in bufs {
            self.pool.give(b);
        }
    }

    fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let len = buf.len() / dtype.size();
        let count = self.count(OpKind::AllReduce, len)?;
        self.collective(
            OpKind::AllReduce,
            dtype,
            len,
            op.code() as i64,
            |ctx, deadline| {
                if len == 0 || self.world_size == 1 {
                    return Ok(());
                }
                let mut send = self.pool.take(buf.len());
                bytes_mut(&mut send, buf.len()).copy_from_slice(buf);
                let recv = self.pool.take(buf.len());
                let mpi_op = self.runtime.op(dtype, op);
                let bufs = self.start_and_wait(
                    ctx,
                    deadline,
                    "MPI_Iallreduce",
                    vec![send, recv],
                    |b, req| {
                        let (s, r) = b.split_at_mut(1);
                        // SAFETY: `count` elements of `dtype` in both buffers, held until done.
                        unsafe {
                            ffi::MPI_Iallreduce(
                                s[0].as_ptr() as *const c_void,
                                r[0].as_mut_ptr() as *mut c_void,
                                count,
                                datatype(dtype),
                                mpi_op,
                                self.coll.0,
                                req,
                            )
                        }
                    },
                )?;
                buf.copy_from_slice(bytes(&bufs[1], buf.len()));
                self.recycle(bufs);
                let bytes_moved = 2 * self.ring_share(buf.len());
                self.counters.sent(OpKind::AllReduce, bytes_moved);
                self.counters.received(OpKind::AllReduce, bytes_moved);
                Ok(())
            },
        )?;
        if op == ReduceOp::Avg {
            divide(buf, dtype, self.world_size);
        }
        Ok(())
    }

    fn ring_share(&self, bytes: usize) -> usize {
        bytes * (self.world_size - 1) / self.world_size
    }

    /// Element counts and displacements of the shards of `total` elements.
    fn shards(&self, kind: OpKind, total: usize) -> Result<(Vec<c_int>, Vec<c_int>)> {
        self.count(kind, total)?;
        let ranges: Vec<_> = (0..self.world_size)
            .map(|r| shard_range(total, self.world_size, r))
            .collect();
        Ok((
            ranges.iter().map(|r| r.len() as c_int).collect(),
            ranges.iter().map(|r| r.start as c_int).collect(),
        ))
    }

    fn all_gather_bytes(&self, input: &[u8], output: &mut [u8], dtype: DType) -> Result<()> {
        let size = dtype.size();
        let total = output.len() / size;
        let mine = shard_range(total, self.world_size, self.rank);
        if input.len() / size != mine.len() {
            return Err(self.invalid(
                OpKind::AllGather,
                format!(
                    "all_gather: this rank's shard of {total} elements is {}, got {}",
                    mine.len(),
                    input.len() / size
                ),
            ));
        }
        let (counts, displs) = self.shards(OpKind::AllGather, total)?;
        self.collective(OpKind::AllGather, dtype, total, 0, |ctx, deadline| {
            if total == 0 {
                return Ok(());
            }
            let mut send = self.pool.take(input.len());
            bytes_mut(&mut send, input.len()).copy_from_slice(input);
            let recv = self.pool.take(output.len());
            let bufs = self.start_and_wait(
                ctx,
                deadline,
                "MPI_Iallgatherv",
                vec![send, recv],
                |b, req| {
                    let (s, r) = b.split_at_mut(1);
                    // SAFETY: this rank's shard in `send`, the whole buffer in `recv`; MPI reads
                    // the count arrays until the operation completes, and they outlive it.
                    unsafe {
                        ffi::MPI_Iallgatherv(
                            s[0].as_ptr() as *const c_void,
                            counts[self.rank],
                            datatype(dtype),
                            r[0].as_mut_ptr() as *mut c_void,
                            counts.as_ptr(),
                            displs.as_ptr(),
                            datatype(dtype),
                            self.coll.0,
                            req,
                        )
                    }
                },
            )?;
            output.copy_from_slice(bytes(&bufs[1], output.len()));
            self.recycle(bufs);
            let moved = self.ring_share(output.len());
            self.counters.sent(OpKind::AllGather, moved);
            self.counters.received(OpKind::AllGather, moved);
            Ok(())
        })
    }

    fn reduce_scatter_bytes(
        &self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let size = dtype.size();
        let total = input.len() / size;
        let mine = shard_range(total, self.world_size, self.rank);
        if output.len() / size != mine.len() {
            return Err(self.invalid(
                OpKind::ReduceScatter,
                format!(
                    "reduce_scatter: this rank's shard of {total} elements is {}, got {}",
                    mine.len(),
                    output.len() / size
                ),
            ));
        }
        let (counts, _) = self.shards(OpKind::ReduceScatter, total)?;
        self.collective(
            OpKind::ReduceScatter,
            dtype,
            total,
            op.code() as i64,
            |ctx, deadline| {
                if total == 0 {
                    return Ok(());
                }
                let mut send = self.pool.take(input.len());
                bytes_mut(&mut send, input.len()).copy_from_slice(input);
                let recv = self.pool.take(output.len());
                let mpi_op = self.runtime.op(dtype, op);
                let bufs = self.start_and_wait(
                    ctx,
                    deadline,
                    "MPI_Ireduce_scatter",
                    vec![send, recv],
                    |b, req| {
                        let (s, r) = b.split_at_mut(1);
                        // SAFETY: the whole buffer in `send`, this rank's shard in `recv`.
                        unsafe {
                            ffi::MPI_Ireduce_scatter(
                                s[0].as_ptr() as *const c_void,
                                r[0].as_mut_ptr() as *mut c_void,
                                counts.as_ptr(),
                                datatype(dtype),
                                mpi_op,
                                self.coll.0,
                                req,
                            )
                        }
                    },
                )?;
                output.copy_from_slice(bytes(&bufs[1], output.len()));
                self.recycle(bufs);
                let moved = self.ring_share(input.len());
                self.counters.sent(OpKind::ReduceScatter, moved);
                self.counters.received(OpKind::ReduceScatter, moved);
                Ok(())
            },
        )?;
        if op == ReduceOp::Avg {
            divide(output, dtype, self.world_size);
        }
        Ok(())
    }

    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> Result<()> {
        if root >= self.world_size {
            return Err(self.invalid(
                OpKind::Broadcast,
                format!(
                    "broadcast: root {root} is not in this {}-rank group",
                    self.world_size
                ),
            ));
        }
        let len = buf.len() / dtype.size();
        let count = self.count(OpKind::Broadcast, len)?;
        self.collective(
            OpKind::Broadcast,
            dtype,
            len,
            root as i64,
            |ctx, deadline| {
                if len == 0 || self.world_size == 1 {
                    return Ok(());
                }
                let mut stage = self.pool.take(buf.len());
                if self.rank == root {
                    bytes_mut(&mut stage, buf.len()).copy_from_slice(buf);
                }
                let bufs =
                    self.start_and_wait(ctx, deadline, "MPI_Ibcast", vec![stage], |b, req| {
                        // SAFETY: `count` elements of `dtype`, held until done.
                        unsafe {
                            ffi::MPI_Ibcast(
                                b[0].as_mut_ptr() as *mut c_void,
                                count,
                                datatype(dtype),
                                root as c_int,
                                self.coll.0,
                                req,
                            )
                        }
                    })?;
                if self.rank != root {
                    buf.copy_from_slice(bytes(&bufs[0], buf.len()));
                }
                self.recycle(bufs);
                let moved = self.ring_share(buf.len());
                self.counters.sent(OpKind::Broadcast, moved);
                self.counters.received(OpKind::Broadcast, moved);
                Ok(())
            },
        )
    }

    fn peer(&self, what: &str, peer: usize) -> Result<c_int> {
        if peer >= self.world_size {
            return Err(self.invalid(
                OpKind::SendRecv,
                format!(
                    "{what}: rank {peer} is not in this {}-rank group",
                    self.world_size
                ),
            ));
        }
        Ok(peer as c_int)
    }

    /// The number of this point-to-point call, for errors.
    fn p2p_ctx(&self) -> OpContext {
        let mut p2p = lock(&self.p2p_state);
        p2p.seq += 1;
        self.counters.call(OpKind::SendRecv);
        self.ctx(OpKind::SendRecv, p2p.seq - 1)
    }

    fn send_bytes(&self, buf: &[u8], dtype: DType, dst: usize) -> Result<()> {
        self.poisoned()?;
        let dst = self.peer("send", dst)?;
        let count = self.count(OpKind::SendRecv, buf.len() / dtype.size())?;
        let ctx = self.p2p_ctx();
        self.reap_sends()?;
        let mut copy = self.pool.take(buf.len());
        bytes_mut(&mut copy, buf.len()).copy_from_slice(buf);
        let mut req = null_request();
        // SAFETY: `count` elements in `copy`, which stays in the pending list until MPI has
        // finished with it.
        let r = self.runtime.call(|| unsafe {
            ffi::MPI_Isend(
                copy.as_ptr() as *const c_void,
                count,
                datatype(dtype),
                dst,
                P2P_TAG + dtype.code() as c_int,
                self.p2p.0,
                &mut req,
            )
        });
        if let Err(e) = self.check(&ctx, "MPI_Isend", r) {
            self.poison(&e);
            return Err(e);
        }
        lock(&self.p2p_state).pending.push((req, copy));
        self.counters.sent(OpKind::SendRecv, buf.len());
        Ok(())
    }

    fn recv_bytes(&self, buf: &mut [u8], dtype: DType, src: usize) -> Result<()> {
        self.poisoned()?;
        let src_c = self.peer("recv", src)?;
        let count = self.count(OpKind::SendRecv, buf.len() / dtype.size())?;
        let ctx = self.p2p_ctx();
        let deadline = Instant::now() + self.timeout;
        let result = (|| {
            self.reap_sends()?;
            // Match the next message from `src` first, to check its type and length.
            let mut message: ffi::MPI_Message = unsafe { ffi::RSMPI_MESSAGE_NULL };
            // SAFETY: zeroed is a valid MPI_Status (plain integers).
            let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            let started = Instant::now();
            loop {
                let mut found: c_int = 0;
                // SAFETY: valid out-pointers; MPI_ANY_TAG on the group's own p2p communicator.
                let r = self.runtime.call(|| unsafe {
                    ffi::MPI_Improbe(
                        src_c,
                        ffi::RSMPI_ANY_TAG,
                        self.p2p.0,
                        &mut found,
                        &mut message,
                        &mut status,
                    )
                });
                self.check(&ctx, "MPI_Improbe", r)?;
                if found != 0 {
                    break;
                }
                if Instant::now() >= deadline {
                    return Err(CommError::Timeout {
                        op: ctx.clone(),
                        peer: src,
                        timeout: self.timeout,
                    });
                }
                // Progress for this rank's own pending sends happens here too.
                pause(started);
            }
            let sent_type = DType::from_code((status.MPI_TAG - P2P_TAG) as u8);
            let mut sent: c_int = 0;
            // SAFETY: the status of the matched message.
            let r = unsafe { ffi::MPI_Get_count(&status, datatype(dtype), &mut sent) };
            self.check(&ctx, "MPI_Get_count", r)?;
            // A matched message must be received, even one that is then refused.
            let mut sent_bytes: c_int = 0;
            // SAFETY: the status of the matched message.
            let r = unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut sent_bytes) };
            self.check(&ctx, "MPI_Get_count", r)?;
            let problem = match sent_type {
                Some(t) if t != dtype => Some(format!(
                    "send of {} {t}",
                    sent_bytes.max(0) as usize / t.size()
                )),
                None => Some(format!("a message tagged {}", status.MPI_TAG)),
                _ if sent != count => Some(format!("send of {sent} {dtype}")),
                _ => None,
            };
            let mut stage = self.pool.take(buf.len());
            let mut req = null_request();
            let (recv_count, recv_type) = match problem {
                Some(_) => {
                    stage = vec![0u64; (sent_bytes.max(0) as usize).div_ceil(8).max(1)];
                    (sent_bytes, unsafe { ffi::RSMPI_UINT8_T })
                }
                None => (count, datatype(dtype)),
            };
            // SAFETY: `stage` holds the whole matched message.
            let r = self.runtime.call(|| unsafe {
                ffi::MPI_Imrecv(
                    stage.as_mut_ptr() as *mut c_void,
                    recv_count,
                    recv_type,
                    &mut message,
                    &mut req,
                )
            });
            self.check(&ctx, "MPI_Imrecv", r)?;
            let stage = self
                .wait(std::slice::from_mut(&mut req), deadline, vec![stage])
                .map_err(|u| match u {
                    Unfinished::TimedOut { .. } => CommError::Timeout {
                        op: ctx.clone(),
                        peer: src,
                        timeout: self.timeout,
                    },
                    Unfinished::Failed(why) => CommError::Mpi(format!("{ctx}: MPI_Imrecv: {why}")),
                })?;
            if let Some(what) = problem {
                return Err(CommError::Mismatch {
                    op: ctx.clone(),
                    peer: src,
                    expected: format!("recv of {count} {dtype}"),
                    found: what,
                });
            }
            buf.copy_from_slice(bytes(&stage[0], buf.len()));
            self.recycle(stage);
            self.counters.received(OpKind::SendRecv, buf.len());
            Ok(())
        })();
        result.inspect_err(|e| self.poison(e))
    }
}

/// Between two polls of a wait that began at `started`. MPI progresses only inside its calls
/// (its own blocking calls spin), so the first millisecond spins, for small messages' latency;
/// after that a rank waiting on a peer sleeps 50 µs between polls rather than take a core from
/// the ranks that compute beside it (a pipeline stage waits while the other computes).
fn pause(started: Instant) {
    if started.elapsed() < Duration::from_millis(1) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading a predefined handle after MPI_Init.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

fn dup(runtime: &Runtime, comm: ffi::MPI_Comm) -> Result<Comm> {
    // SAFETY: a null handle, overwritten by MPI_Comm_dup.
    let mut new: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
    // SAFETY: a valid communicator and out-pointer.
    let r = runtime.call(|| unsafe { ffi::MPI_Comm_dup(comm, &mut new) });
    if r != 0 {
        return Err(CommError::Mpi(format!("MPI_Comm_dup: {}", mpi_error(r))));
    }
    // Errors come back as codes (made into kiln errors), not MPI's default abort.
    // SAFETY: a communicator this process owns.
    let r = runtime.call(|| unsafe { ffi::MPI_Comm_set_errhandler(new, ffi::RSMPI_ERRORS_RETURN) });
    if r != 0 {
        return Err(CommError::Mpi(format!(
            "MPI_Comm_set_errhandler: {}",
            mpi_error(r)
        )));
    }
    Ok(Comm(new))
}

fn rank_and_size(runtime: &Runtime, comm: ffi::MPI_Comm) -> Result<(usize, usize)> {
    let (mut rank, mut size): (c_int, c_int) = (0, 0);
    // SAFETY: a valid communicator and out-pointers.
    let r = runtime.call(|| unsafe {
        ffi::MPI_Comm_rank(comm, &mut rank) | ffi::MPI_Comm_size(comm, &mut size)
    });
    if r != 0 {
        return Err(CommError::Mpi(format!(
            "MPI_Comm_rank/size: {}",
            mpi_error(r)
        )));
    }
    Ok((rank as usize, size as usize))
}

/// Divides a summed buffer by `n` in its own type (the `Avg` of the other groups).
fn divide(buf: &mut [u8], dtype: DType, n: usize) {
    fn each<T: Element>(buf: &mut [u8], n: usize) {
        let mut v: Vec<T> = bytemuck::pod_collect_to_vec(buf);
        for x in &mut v {
            *x = x.div(n);
        }
        buf.copy_from_slice(bytemuck::cast_slice(&v));
    }
    match dtype {
        DType::F32 => each::<f32>(buf, n),
        DType::F16 => each::<f16>(buf, n),
        DType::BF16 => each::<bf16>(buf, n),
        DType::I64 => each::<i64>(buf, n),
    }
}

impl Drop for MpiGroup {
    fn drop(&mut self) {
        // Sends still in flight must finish before their copies and the communicator go.
        let pending = std::mem::take(&mut lock(&self.p2p_state).pending);
        if !pending.is_empty() {
            let (mut reqs, bufs): (Vec<_>, Vec<_>) = pending.into_iter().unzip();
            let deadline = Instant::now() + self.timeout;
            if self.wait(&mut reqs, deadline, bufs).is_err() {
                eprintln!(
                    "kiln: group '{}' (rank {} of {}): {} send(s) were never received",
                    self.name,
                    self.rank,
                    self.world_size,
                    reqs.len()
                );
            }
        }
        if self.runtime.abandoned.load(Ordering::SeqCst) {
            return;
        }
        for comm in [&mut self.p2p, &mut self.coll] {
            // SAFETY: communicators this group created; no operation on them is pending.
            self.runtime
                .call(|| unsafe { ffi::MPI_Comm_free(&mut comm.0) });
        }
    }
}

macro_rules! bytes_of {
    ($buf:expr) => {
        match $buf {
            BufMut::F32(b) => (bytemuck::cast_slice_mut::<_, u8>(b), DType::F32),
            BufMut::F16(b) => (bytemuck::cast_slice_mut::<_, u8>(b), DType::F16),
            BufMut::BF16(b) => (bytemuck::cast_slice_mut::<_, u8>(b), DType::BF16),
            BufMut::I64(b) => (bytemuck::cast_slice_mut::<_, u8>(b), DType::I64),
            BufMut::Shape { .. } => return Err(crate::error::shape_buffer("mpi", "mpi")),
        }
    };
}

impl ProcessGroup for MpiGroup {
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
        "mpi"
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let (b, dtype) = bytes_of!(buf);
        self.all_reduce_bytes(b, dtype, op)
    }
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        if input.is_shape() {
            return Err(crate::error::shape_buffer("mpi", &self.name));
        }
        let (o, dtype) = bytes_of!(output);
        if input.dtype() != dtype {
            return Err(CommError::DTypeMismatch {
                op: self.ctx(OpKind::AllGather, 0),
                a: input.dtype(),
                b: dtype,
            });
        }
        self.all_gather_bytes(input.as_bytes(), o, dtype)
    }
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        if input.is_shape() {
            return Err(crate::error::shape_buffer("mpi", &self.name));
        }
        let (o, dtype) = bytes_of!(output);
        if input.dtype() != dtype {
            return Err(CommError::DTypeMismatch {
                op: self.ctx(OpKind::ReduceScatter, 0),
                a: input.dtype(),
                b: dtype,
            });
        }
        self.reduce_scatter_bytes(input.as_bytes(), o, dtype, op)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let (b, dtype) = bytes_of!(buf);
        self.broadcast_bytes(b, dtype, root)
    }
    fn send(&self, buf: BufRef<'_>, dst: usize) -> Result<()> {
        if buf.is_shape() {
            return Err(crate::error::shape_buffer("mpi", &self.name));
        }
        self.send_bytes(buf.as_bytes(), buf.dtype(), dst)
    }
    fn recv(&self, buf: BufMut<'_>, src: usize) -> Result<()> {
        let (b, dtype) = bytes_of!(buf);
        self.recv_bytes(b, dtype, src)
    }
    // `send_recv` is the default: sends return before they are received.
    fn barrier(&self) -> Result<()> {
        // The descriptor all-gather alone is a barrier.
        self.collective(OpKind::Barrier, DType::I64, 0, 0, |_, _| Ok(()))
    }
    fn split(&self, ranks: &[usize], name: &str) -> Result<Arc<dyn ProcessGroup>> {
        self.poisoned()?;
        let Some(me) = ranks.iter().position(|&r| r == self.rank) else {
            return Err(self.invalid(
                OpKind::Barrier,
                format!("split: this rank ({}) is not in {ranks:?}", self.rank),
            ));
        };
        if let Some(&bad) = ranks.iter().find(|&&r| r >= self.world_size) {
            return Err(self.invalid(
                OpKind::Barrier,
                format!(
                    "split: rank {bad} is not in this {}-rank group",
                    self.world_size
                ),
            ));
        }
        let mut seen = ranks.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != ranks.len() {
            return Err(self.invalid(
                OpKind::Barrier,
                format!("split: {ranks:?} names a rank twice"),
            ));
        }
        let globals: Vec<usize> = ranks.iter().map(|&r| self.members[r]).collect();
        let id = {
            let mut state = lock(&self.coll_state);
            let count = state.splits.entry(globals.clone()).or_insert(0);
            *count += 1;
            let mut h = Fnv1a::new();
            for &g in &globals {
                h.write_u64(g as u64);
            }
            h.write_u64(*count);
            h.finish() as i64
        };
        let ctx = self.ctx(OpKind::Barrier, 0);
        let deadline = Instant::now() + self.timeout;
        let result = (|| {
            // MPI_Comm_create_group waits, without a timeout, for every member: a handshake
            // with a timeout first, so that a member that never comes is an error naming it.
            let others: Vec<usize> = ranks.iter().copied().filter(|&r| r != self.rank).collect();
            let mut send = self.pool.take(8);
            send[0] = id as u64;
            let mut recv = vec![0u64; others.len().max(1)];
            let mut reqs = Vec::with_capacity(2 * others.len());
            for (i, &peer) in others.iter().enumerate() {
                let (mut s, mut r) = (null_request(), null_request());
                // SAFETY: one i64 each way, buffers held until the requests complete.
                let code = self.runtime.call(|| unsafe {
                    ffi::MPI_Isend(
                        send.as_ptr() as *const c_void,
                        1,
                        ffi::RSMPI_INT64_T,
                        peer as c_int,
                        SPLIT_TAG,
                        self.coll.0,
                        &mut s,
                    ) | ffi::MPI_Irecv(
                        recv.as_mut_ptr().add(i) as *mut c_void,
                        1,
                        ffi::RSMPI_INT64_T,
                        peer as c_int,
                        SPLIT_TAG,
                        self.coll.0,
                        &mut r,
                    )
                });
                self.check(&ctx, "split handshake", code)?;
                reqs.push(r);
                reqs.push(s);
            }
            let bufs = self
                .wait(&mut reqs, deadline, vec![send, recv])
                .map_err(|u| match u {
                    Unfinished::TimedOut { pending } => CommError::Timeout {
                        op: ctx.clone(),
                        peer: others[pending[0] / 2],
                        timeout: self.timeout,
                    },
                    Unfinished::Failed(why) => {
                        CommError::Mpi(format!("{ctx}: split handshake: {why}"))
                    }
                })?;
            for (i, &peer) in others.iter().enumerate() {
                if bufs[1][i] != id as u64 {
                    return Err(CommError::Mismatch {
                        op: ctx.clone(),
                        peer,
                        expected: format!("split into {ranks:?}"),
                        found: "a split into other ranks, or in another order".into(),
                    });
                }
            }
            self.pool
                .give(bufs.into_iter().next().expect("send buffer"));
            let new = self.create_group(ranks, id, &ctx)?;
            let p2p = dup(&self.runtime, new.0)?;
            Ok(Arc::new(MpiGroup {
                coll: new,
                p2p,
                rank: me,
                world_size: ranks.len(),
                members: globals,
                name: name.to_string(),
                timeout: self.timeout,
                coll_state: Mutex::default(),
                p2p_state: Mutex::default(),
                poisoned: Mutex::new(None),
                pool: Pool::default(),
                counters: Counters::default(),
                runtime: self.runtime.clone(),
            }) as Arc<dyn ProcessGroup>)
        })();
        result.inspect_err(|e| self.poison(e))
    }
    fn stats(&self) -> CommStats {
        self.counters.snapshot()
    }
}

impl MpiGroup {
    /// The communicator of `ranks` (this group's indices, in the new group's order), created
    /// by the members only.
    fn create_group(&self, ranks: &[usize], id: i64, ctx: &OpContext) -> Result<Comm> {
        let ranks_c: Vec<c_int> = ranks.iter().map(|&r| r as c_int).collect();
        // SAFETY: null handles overwritten by the calls below.
        let (mut parent, mut sub): (ffi::MPI_Group, ffi::MPI_Group) =
            unsafe { (ffi::RSMPI_GROUP_NULL, ffi::RSMPI_GROUP_NULL) };
        let mut comm: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // Tags of concurrent creations must differ; the split id tells them apart.
        let tag = (id.rem_euclid(30_000)) as c_int;
        // SAFETY: valid handles and out-pointers; the groups are freed once the communicator
        // exists.
        let r = self.runtime.call(|| unsafe {
            let mut r = ffi::MPI_Comm_group(self.coll.0, &mut parent);
            if r == 0 {
                r = ffi::MPI_Group_incl(parent, ranks_c.len() as c_int, ranks_c.as_ptr(), &mut sub);
            }
            if r == 0 {
                r = ffi::MPI_Comm_create_group(self.coll.0, sub, tag, &mut comm);
            }
            for g in [&mut parent, &mut sub] {
                if *g != ffi::RSMPI_GROUP_NULL {
                    ffi::MPI_Group_free(g);
                }
            }
            r
        });
        self.check(ctx, "MPI_Comm_create_group", r)?;
        // SAFETY: a communicator this process owns.
        let r = self
            .runtime
            .call(|| unsafe { ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN) });
        self.check(ctx, "MPI_Comm_set_errhandler", r)?;
        Ok(Comm(comm))
    }
}
