//! `Shapes`: a Burn backend whose tensors are a shape and a dtype, no data.
//!
//! It is Burn's router ([`BackendRouter`]) over a runner of kiln's: the router's front end
//! builds each op's intermediate representation with burn-ir's builders, which compute every
//! output's shape and dtype (the same code Burn's fusion and remote backends use), and hands it
//! to [`ShapesClient::register_op`], which runs nothing. Instead it
//! - counts the memory the op's outputs would take, as a [`Counted`] for the rank and memory
//!   kind of the thread that asked (so kiln's per-rank counters fill exactly as in a real step),
//!   kept while any tensor holds it: views (reshape, permute, swap, expand, slice) share their
//!   input's memory, and an elementwise op (or a `slice_assign`) whose input is consumed and of
//!   the output's size writes in place, as Burn's CPU backend does (kiln's, for `slice_assign`);
//! - counts the op's work for the rank: floating-point operations (matmul, linear and its
//!   gradients, convolutions: 2 per multiply-add; everything else one per output element) and
//!   bytes read and written, by the dtype it computes in.
//!
//! Reading a tensor gives zeros of its shape and dtype (so host-side code, collectives on host
//! buffers and checks run unchanged; their values mean nothing).

use burn_backend::backend::{DeviceId, DeviceOps, ExecutionError};
use burn_backend::{DType, DTypeUsage, DTypeUsageSet, Shape, TensorData};
use burn_ir::{
    BaseOperationIr, FloatOperationIr, ModuleOperationIr, NumericOperationIr, OperationIr,
    TensorId, TensorIr, TensorStatus,
};
use burn_router::{BackendRouter, MultiBackendBridge, RouterTensor, RunnerChannel, RunnerClient};
use burn_std::future::DynFut;
use kiln_shard::account::{Counted, MemKind, current_rank};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// The shape-only backend: `Autodiff<Shard<Shapes>>` runs kiln's real step on shapes.
pub type Shapes = BackendRouter<ShapesChannel>;

/// The one device of [`Shapes`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShapesDevice;

impl burn_std::device::Device for ShapesDevice {
    fn from_id(_: DeviceId) -> Self {
        ShapesDevice
    }
    fn to_id(&self) -> DeviceId {
        DeviceId::new(0, 0)
    }
}

impl DeviceOps for ShapesDevice {}

/// The router channel of [`Shapes`]: one [`ShapesClient`], nothing to bridge.
#[derive(Debug, Clone, Copy, Default)]
pub struct ShapesChannel;

/// No other backend to move tensors to.
#[derive(Debug)]
pub struct NoBridge;

impl MultiBackendBridge for NoBridge {
    type TensorHandle = ();
    type Device = ShapesDevice;

    fn change_backend_float(_: (), _: Shape, _: &ShapesDevice) {}
    fn change_backend_int(_: (), _: Shape, _: &ShapesDevice) {}
    fn change_backend_bool(_: (), _: Shape, _: &ShapesDevice) {}
}

impl RunnerChannel for ShapesChannel {
    type Device = ShapesDevice;
    type Bridge = NoBridge;
    type Client = ShapesClient;
    type FloatElem = f32;
    type IntElem = i64;
    type BoolElem = bool;

    fn name(_: &ShapesDevice) -> String {
        "shapes".into()
    }

    fn init_client(_: &ShapesDevice) -> ShapesClient {
        ShapesClient::default()
    }

    fn get_tensor_handle(_: &TensorIr, _: &ShapesClient) {}

    fn register_tensor(
        client: &ShapesClient,
        _: (),
        shape: Shape,
        dtype: DType,
    ) -> RouterTensor<ShapesClient> {
        client.new_tensor(shape, dtype)
    }
}

/// The work of ops, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Work {
    /// Floating-point operations of contractions (matmul, linear, convolutions) computing in
    /// f32 or wider.
    pub flops_f32: f64,
    /// Floating-point operations of contractions computing in a 16-bit dtype (bf16, f16).
    pub flops_half: f64,
    /// Contraction FLOPs by the depth of their contracted dimension (K): below 64, below
    /// 256, below 1024, and more (shallow products run far below a device's peak).
    pub flops_by_depth: [f64; 4],
    /// Operations of everything else (one per output element).
    pub elementwise: f64,
    /// Bytes the ops other than contractions read and wrote, in f32 or wider (views move
    /// none).
    pub bytes: f64,
    /// `bytes` by how many each op moved (inputs and outputs): below 1 MiB, below 8 MiB,
    /// below 32 MiB, and more (a CPU serves an op's working set from its caches up to their
    /// sizes, several times faster than from memory).
    pub bytes_by_size: [f64; 4],
    /// Bytes the ops other than contractions read and wrote, of ops writing a 16-bit dtype.
    pub bytes_half: f64,
    /// Bytes the contractions read and wrote (their operands and results).
    pub contraction_bytes: f64,
    /// Ops run.
    pub ops: u64,
    /// Ops that were contractions.
    pub contractions: u64,
}

impl Work {
    fn add(&mut self, o: &Work) {
        self.flops_f32 += o.flops_f32;
        self.flops_half += o.flops_half;
        for (a, b) in self.flops_by_depth.iter_mut().zip(o.flops_by_depth) {
            *a += b;
        }
        self.elementwise += o.elementwise;
        self.bytes += o.bytes;
        for (a, b) in self.bytes_by_size.iter_mut().zip(o.bytes_by_size) {
            *a += b;
        }
        self.contraction_bytes += o.contraction_bytes;
        self.bytes_half += o.bytes_half;
        self.ops += o.ops;
        self.contractions += o.contractions;
    }

    fn sub(&mut self, o: &Work) {
        self.flops_f32 -= o.flops_f32;
        self.flops_half -= o.flops_half;
        for (a, b) in self.flops_by_depth.iter_mut().zip(o.flops_by_depth) {
            *a -= b;
        }
        self.elementwise -= o.elementwise;
        self.bytes -= o.bytes;
        for (a, b) in self.bytes_by_size.iter_mut().zip(o.bytes_by_size) {
            *a -= b;
        }
        self.contraction_bytes -= o.contraction_bytes;
        self.bytes_half -= o.bytes_half;
        self.ops -= o.ops;
        self.contractions -= o.contractions;
    }

    /// The work between `earlier` and `self`.
    pub fn since(&self, earlier: &Work) -> Work {
        let mut w = *self;
        w.sub(earlier);
        w
    }

    /// All contraction FLOPs.
    pub fn flops(&self) -> f64 {
        self.flops_f32 + self.flops_half
    }
}

/// The part of a step an op belongs to, from the memory kind its thread counts as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Outside the forward and backward passes (the optimizer step, data).
    Other = 0,
    /// The forward pass.
    Forward = 1,
    /// The backward pass.
    Backward = 2,
}

/// A rank's work so far, by [`Phase`].
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Phases {
    /// Indexed by [`Phase`].
    pub by_phase: [Work; 3],
    /// The phase of the last op inside a pass (parameter gathers and reductions take it).
    #[serde(skip)]
    last_pass: Option<usize>,
}

impl Phases {
    /// All phases.
    pub fn total(&self) -> Work {
        let mut w = Work::default();
        self.by_phase.iter().for_each(|p| w.add(p));
        w
    }

    /// Work of `phase`.
    pub fn of(&self, phase: Phase) -> Work {
        self.by_phase[phase as usize]
    }

    /// The work between `earlier` and `self`, by phase.
    pub fn since(&self, earlier: &Phases) -> Phases {
        let mut out = *self;
        for (o, e) in out.by_phase.iter_mut().zip(&earlier.by_phase) {
            o.sub(e);
        }
        out
    }
}

/// Work counted per rank (by the thread's rank; `usize::MAX` for threads of no rank).
static WORK: Mutex<Vec<(usize, Phases)>> = Mutex::new(Vec::new());

/// The work counted for `rank` since the last [`reset_work`], by phase.
pub fn phases_of(rank: usize) -> Phases {
    lock(&WORK)
        .iter()
        .find(|(r, _)| *r == rank)
        .map(|(_, w)| *w)
        .unwrap_or_default()
}

/// The work counted for `rank` since the last [`reset_work`].
pub fn work_of(rank: usize) -> Work {
    phases_of(rank).total()
}

/// Forgets the work counted for `rank`.
pub fn reset_work(rank: usize) {
    lock(&WORK).retain(|(r, _)| *r != rank);
}

fn count_work(w: &Work) {
    let rank = current_rank().unwrap_or(usize::MAX);
    let kind = kiln_shard::account::current_kind();
    let mut all = lock(&WORK);
    let mine = match all.iter().position(|(r, _)| *r == rank) {
        Some(i) => &mut all[i].1,
        None => {
            all.push((rank, Phases::default()));
            &mut all.last_mut().expect("pushed").1
        }
    };
    let phase = match kind {
        MemKind::Activations => Some(Phase::Forward as usize),
        MemKind::Backward => Some(Phase::Backward as usize),
        MemKind::Other => None,
        _ => mine.last_pass,
    };
    if kind == MemKind::Activations || kind == MemKind::Backward {
        mine.last_pass = phase;
    }
    mine.by_phase[phase.unwrap_or(Phase::Other as usize)].add(w);
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The runner of [`Shapes`]: tensors are ids mapped to the memory they stand for.
#[derive(Debug, Clone, Default)]
pub struct ShapesClient {
    state: Arc<State>,
}

#[derive(Debug, Default)]
struct State {
    next: AtomicU64,
    tensors: Mutex<HashMap<TensorId, Arc<Counted>>>,
}

/// The bucket of [`Work::bytes_by_size`] of an op moving `bytes`.
pub fn size_bucket(bytes: f64) -> usize {
    const MIB: f64 = (1 << 20) as f64;
    match bytes {
        b if b < MIB => 0,
        b if b < 8.0 * MIB => 1,
        b if b < 32.0 * MIB => 2,
        _ => 3,
    }
}

fn bytes_of(shape: &Shape, dtype: DType) -> usize {
    shape.num_elements() * dtype.size()
}

impl ShapesClient {
    fn new_tensor(&self, shape: Shape, dtype: DType) -> RouterTensor<ShapesClient> {
        let id = self.create_empty_handle();
        let memory = Arc::new(Counted::new(bytes_of(&shape, dtype)));
        lock(&self.state.tensors).insert(id, memory);
        RouterTensor::new(id, shape, dtype, self.clone())
    }
}

/// Whether an op's output is a view of its (first) input: no memory of its own.
fn is_view(op: &OperationIr) -> bool {
    let base = match op {
        OperationIr::BaseFloat(b) | OperationIr::BaseInt(b) | OperationIr::BaseBool(b) => b,
        _ => return false,
    };
    matches!(
        base,
        BaseOperationIr::Reshape(_)
            | BaseOperationIr::SwapDims(_)
            | BaseOperationIr::Permute(_)
            | BaseOperationIr::Expand(_)
            | BaseOperationIr::Slice(_)
    )
}

/// Whether an op is elementwise (its output may overwrite a consumed input of its size), or a
/// float `slice_assign` (kiln writes it in place on Flex, as Burn's GPU backends do).
fn writes_in_place(op: &OperationIr) -> bool {
    match op {
        OperationIr::BaseFloat(BaseOperationIr::SliceAssign(_)) => true,
        OperationIr::NumericFloat(_, n) | OperationIr::NumericInt(_, n) => matches!(
            n,
            NumericOperationIr::Add(_)
                | NumericOperationIr::AddScalar(_)
                | NumericOperationIr::Sub(_)
                | NumericOperationIr::SubScalar(_)
                | NumericOperationIr::Mul(_)
                | NumericOperationIr::MulScalar(_)
                | NumericOperationIr::Div(_)
                | NumericOperationIr::DivScalar(_)
                | NumericOperationIr::Abs(_)
                | NumericOperationIr::Clamp(_)
        ),
        OperationIr::Float(_, f) => matches!(
            f,
            FloatOperationIr::Exp(_)
                | FloatOperationIr::Log(_)
                | FloatOperationIr::Log1p(_)
                | FloatOperationIr::Erf(_)
                | FloatOperationIr::Sqrt(_)
                | FloatOperationIr::Tanh(_)
                | FloatOperationIr::Recip(_)
                | FloatOperationIr::PowfScalar(_)
                | FloatOperationIr::Cos(_)
                | FloatOperationIr::Sin(_)
        ),
        _ => false,
    }
}

fn dims(t: &TensorIr) -> &[usize] {
    t.shape.as_slice()
}

fn last(t: &TensorIr) -> f64 {
    dims(t).last().copied().unwrap_or(1) as f64
}

fn numel(t: &TensorIr) -> f64 {
    t.shape.num_elements() as f64
}

/// Multiply-adds x 2 of a contraction, the dtype it computes in and its contracted
/// dimension; `None` for other ops.
fn contraction(op: &OperationIr) -> Option<(f64, DType, f64)> {
    use ModuleOperationIr as M;
    let (flops, dtype) = match op {
        OperationIr::Float(dtype, FloatOperationIr::Matmul(m)) => {
            (2.0 * numel(&m.out) * last(&m.lhs), *dtype)
        }
        OperationIr::Module(M::LinearWeightBackward(l)) => {
            // Contracted over the tokens.
            let k = numel(&l.x) / last(&l.x);
            return Some((2.0 * numel(&l.x) * last(&l.output_grad), l.out.dtype, k));
        }
        OperationIr::Module(m) => match m {
            // weight [in, out]
            M::Linear(l) => (2.0 * numel(&l.out) * last(&l.x), l.out.dtype),
            M::LinearXBackward(l) => (2.0 * numel(&l.out) * last(&l.output_grad), l.out.dtype),
            M::LinearWeightBackward(l) => (2.0 * numel(&l.x) * last(&l.output_grad), l.out.dtype),
            M::Conv1d(c) => (conv(&c.out, &c.weight), c.out.dtype),
            M::Conv2d(c) => (conv(&c.out, &c.weight), c.out.dtype),
            M::Conv3d(c) => (conv(&c.out, &c.weight), c.out.dtype),
            M::ConvTranspose1d(c) => (conv(&c.x, &c.weight), c.out.dtype),
            M::ConvTranspose2d(c) => (conv(&c.x, &c.weight), c.out.dtype),
            M::ConvTranspose3d(c) => (conv(&c.x, &c.weight), c.out.dtype),
            M::Conv1dXBackward(c) => (conv(&c.output_grad, &c.weight), c.out.dtype),
            M::Conv2dXBackward(c) => (conv(&c.output_grad, &c.weight), c.out.dtype),
            M::Conv3dXBackward(c) => (conv(&c.output_grad, &c.weight), c.out.dtype),
            M::Conv1dWeightBackward(c) => (conv(&c.output_grad, &c.weight), c.out.dtype),
            M::Conv2dWeightBackward(c) => (conv(&c.output_grad, &c.weight), c.out.dtype),
            M::Conv3dWeightBackward(c) => (conv(&c.output_grad, &c.weight), c.out.dtype),
            _ => return None,
        },
        _ => return None,
    };
    // The contracted dimension: flops / (2 x output elements).
    let out = op.outputs().map(numel).sum::<f64>().max(1.0);
    Some((flops, dtype, flops / (2.0 * out)))
}

/// 2 x output elements x (input channels per group x kernel elements): the weight is
/// [out channels, in channels / groups, kernel...].
fn conv(out: &TensorIr, weight: &TensorIr) -> f64 {
    let w = dims(weight);
    let per_output = w.iter().skip(1).product::<usize>() as f64;
    2.0 * numel(out) * per_output
}

impl RunnerClient for ShapesClient {
    type Device = ShapesDevice;

    fn register_op(&self, op: OperationIr) {
        if let OperationIr::Drop(t) = &op {
            lock(&self.state.tensors).remove(&t.id);
            return;
        }
        let view = is_view(&op);
        let mut work = Work {
            ops: 1,
            ..Work::default()
        };
        let moved = || {
            op.inputs()
                .chain(op.outputs())
                .map(|t| bytes_of(&t.shape, t.dtype) as f64)
                .sum::<f64>()
        };
        match contraction(&op) {
            Some((flops, dtype, depth)) => {
                work.contractions = 1;
                let bucket = match depth {
                    d if d < 64.0 => 0,
                    d if d < 256.0 => 1,
                    d if d < 1024.0 => 2,
                    _ => 3,
                };
                work.flops_by_depth[bucket] = flops;
                work.contraction_bytes = moved();
                match dtype.size() <= 2 {
                    true => work.flops_half = flops,
                    false => work.flops_f32 = flops,
                }
            }
            None if view => {}
            None => {
                work.elementwise = op.outputs().map(numel).sum();
                match op
                    .outputs()
                    .any(|t| t.dtype.size() == 2 && t.dtype.is_float())
                {
                    true => work.bytes_half = moved(),
                    false => {
                        let bytes = moved();
                        work.bytes = bytes;
                        work.bytes_by_size[size_bucket(bytes)] = bytes;
                    }
                }
            }
        }
        count_work(&work);

        let mut tensors = lock(&self.state.tensors);
        let inputs: Vec<&TensorIr> = op.inputs().collect();
        let in_place = writes_in_place(&op);
        // Memory of consumed inputs: freed after the op, or taken over by its output.
        let mut consumed: Vec<(TensorId, Option<Arc<Counted>>)> = inputs
            .iter()
            .filter(|t| t.status == TensorStatus::ReadWrite)
            .map(|t| (t.id, tensors.remove(&t.id)))
            .collect();
        for out in op.outputs() {
            let size = bytes_of(&out.shape, out.dtype);
            let shared = if view {
                let first = inputs[0].id;
                consumed
                    .iter()
                    .find(|(id, _)| *id == first)
                    .and_then(|(_, m)| m.clone())
                    .or_else(|| tensors.get(&first).cloned())
            } else if in_place {
                // In place only where no other tensor shares the memory (a view of it, or the
                // tensor it is a view of, still alive), as Flex writes in place only into
                // storage nobody else holds.
                consumed
                    .iter_mut()
                    .find(|(_, m)| {
                        m.as_ref()
                            .is_some_and(|m| m.bytes() == size && Arc::strong_count(m) == 1)
                    })
                    .and_then(|(_, m)| m.take())
            } else {
                None
            };
            let memory = shared.unwrap_or_else(|| Arc::new(Counted::new(size)));
            tensors.insert(out.id, memory);
        }
        drop(tensors);
        drop(consumed);
    }

    fn read_tensor_async(&self, tensor: TensorIr) -> DynFut<Result<TensorData, ExecutionError>> {
        if tensor.status == TensorStatus::ReadWrite {
            lock(&self.state.tensors).remove(&tensor.id);
        }
        let data = zeros(&tensor.shape, tensor.dtype);
        Box::pin(async move { Ok(data) })
    }

    fn sync(&self) -> Result<(), ExecutionError> {
        Ok(())
    }

    fn create_empty_handle(&self) -> TensorId {
        TensorId::new(self.state.next.fetch_add(1, Relaxed))
    }

    fn register_tensor_data(&self, data: TensorData) -> RouterTensor<Self> {
        let (shape, dtype) = (data.shape.clone(), data.dtype);
        drop(data);
        self.new_tensor(shape, dtype)
    }

    fn device(&self) -> ShapesDevice {
        ShapesDevice
    }

    fn seed(&self, _seed: u64) {}

    fn dtype_usage(&self, dtype: DType) -> DTypeUsageSet {
        match dtype {
            DType::QFloat(_) => DTypeUsage::Storage.into(),
            _ => DTypeUsage::general(),
        }
    }
}

/// Zeros of `shape` and `dtype`, allocated zeroed in the element type (`vec![0; n]` is a
/// `calloc`: pages nobody writes cost no memory where the allocator maps them fresh).
fn zeros(shape: &Shape, dtype: DType) -> TensorData {
    use half::{bf16, f16};
    let n = shape.num_elements();
    let s = shape.clone();
    match dtype {
        DType::F64 => TensorData::new(vec![0f64; n], s),
        DType::F32 | DType::Flex32 => TensorData::new(vec![0f32; n], s),
        DType::F16 => TensorData::new(bytemuck::cast_vec::<u16, f16>(vec![0u16; n]), s),
        DType::BF16 => TensorData::new(bytemuck::cast_vec::<u16, bf16>(vec![0u16; n]), s),
        DType::I64 => TensorData::new(vec![0i64; n], s),
        DType::I32 => TensorData::new(vec![0i32; n], s),
        DType::I16 => TensorData::new(vec![0i16; n], s),
        DType::I8 => TensorData::new(vec![0i8; n], s),
        DType::U64 => TensorData::new(vec![0u64; n], s),
        DType::U32 => TensorData::new(vec![0u32; n], s),
        DType::U16 => TensorData::new(vec![0u16; n], s),
        DType::U8 => TensorData::new(vec![0u8; n], s),
        DType::Bool(_) => TensorData::new(vec![false; n], s),
        _ => TensorData::from_bytes_vec(vec![0u8; bytes_of(shape, dtype)], s, dtype),
    }
}
