//! Vectorised `exp` and `sigmoid` for Burn's CPU backend (Flex).
//!
//! Flex 0.21 computes both as a scalar loop over libm's `expf` on one thread: a quarter of a
//! step of the default GPT-2 recipe went there (softmax, GELU through a sigmoid, the loss's
//! log-softmax), more than its matrix products. Here both are computed in f64 and rounded once
//! to f32: `x = n ln2 + r`, `|r| <= ln2 / 2`, `exp(r)` by its Taylor polynomial to `r^9`
//! (relative error below 2e-12), times `2^n` built in the exponent bits; branch-free, so the
//! compiler vectorises it (4 f64 lanes with AVX2 and FMA where the CPU has them, chosen at run
//! time), on Rayon's threads for large tensors. Measured alone it is faster than the f32
//! Cephes polynomial it replaces.
//!
//! Accuracy: within 0.5001 ulp of the correctly rounded `exp` and sigmoid on `[-87.3, 88.7]`
//! (tested against `f64`), as PyTorch's Sleef u10 kernels are within 1 ulp: the earlier 2-ulp
//! kernel had grown the GPT-2 fixture's worst final-weight error against PyTorch from 1.3e-6 to
//! 9.0e-6. `exp(x)` is 0 below, infinite above, NaN for NaN. Other backends and dtypes keep
//! their own kernels.

use burn_backend::{Backend, DType, TensorMetadata, try_read_sync};
use std::any::TypeId;

type Prim<B> = <B as burn_backend::BackendTypes>::FloatTensorPrimitive;

/// `exp` of an inner tensor.
pub(crate) fn exp<B: Backend>(t: Prim<B>) -> Prim<B> {
    if on_flex_f32::<B>(&t) {
        return map::<B>(t, exp_slice);
    }
    half_map::<B>(t, exp_slice).unwrap_or_else(B::float_exp)
}

/// `sigmoid` of an inner tensor: `1 / (1 + exp(-x))`.
pub(crate) fn sigmoid<B: Backend>(t: Prim<B>) -> Prim<B> {
    if on_flex_f32::<B>(&t) {
        return map::<B>(t, sigmoid_slice);
    }
    half_map::<B>(t, sigmoid_slice).unwrap_or_else(B::sigmoid)
}

/// The Flex tensor behind an inner tensor, when the backend is Flex.
fn flex<B: Backend>(t: &Prim<B>) -> Option<&burn_flex::FlexTensor> {
    if TypeId::of::<B>() != TypeId::of::<burn_flex::Flex>() {
        return None;
    }
    (t as &dyn std::any::Any).downcast_ref()
}

/// bf16 and f16, as the half-precision paths convert them: generic code, so that the
/// conversions inline and vectorise (through a function pointer, one call per value, they
/// were a fifth of a bf16 step's time).
trait Half: burn_backend::Element + bytemuck::Pod + Default + Send + Sync {
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Half for half::bf16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

impl Half for half::f16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

/// Values per piece a half-precision op widens at a time: the f32 buffers stay small (4 MiB).
const PIECE: usize = 1 << 20;

/// `f` (an f32 kernel) over a bf16 or f16 Flex tensor: a piece at a time widened to f32, the
/// kernel applied, rounded back into the result (Flex 0.21 runs half-precision `exp` and
/// `sigmoid` as a scalar loop through libm). The values are the f32 kernel's, rounded once.
/// Hands the tensor back unless it is a half-precision Flex tensor.
fn half_map<B: Backend>(t: Prim<B>, f: fn(&mut [f32])) -> Result<Prim<B>, Prim<B>> {
    use half::{bf16, f16};
    fn run<H: Half>(xs: &[H], shape: &[usize], f: fn(&mut [f32])) -> burn_backend::TensorData {
        data(xs, shape, |x, o| {
            let mut wide: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
            f(&mut wide);
            o.iter_mut()
                .zip(&wide)
                .for_each(|(o, w)| *o = H::from_f32(*w));
        })
    }
    let Some(x) = flex::<B>(&t) else {
        return Err(t);
    };
    let x = contiguous(x);
    let shape = x.layout().shape();
    let data = match x.dtype() {
        DType::BF16 => x.as_slice::<bf16>().map(|xs| run(xs, shape, f)),
        DType::F16 => x.as_slice::<f16>().map(|xs| run(xs, shape, f)),
        _ => None,
    };
    let Some(data) = data else {
        return Err(t);
    };
    Ok(B::float_from_data(data, &B::float_device(&t)))
}

/// The tensor itself when its values are contiguous, else a contiguous copy.
fn contiguous(t: &burn_flex::FlexTensor) -> std::borrow::Cow<'_, burn_flex::FlexTensor> {
    match t.layout().contiguous_offsets() {
        Some(_) => std::borrow::Cow::Borrowed(t),
        None => std::borrow::Cow::Owned(t.to_contiguous()),
    }
}

/// A binary op of two bf16 (or two f16) Flex tensors of different shapes (one broadcasts):
/// Flex 0.21 walks such operands element by element through a strided iterator, about 20
/// times slower than its f32 kernel (attention's mask, softmax's max and sum, their
/// gradients). Here the output is formed in pieces along its first dimension: each piece's
/// operands widened to f32, `f` run by Flex's f32 kernel, the result rounded back to the half
/// type: the same values (the f32 op of the widened operands, rounded once, is what Flex's half
/// kernel computes). Any other case runs `f` on the operands as they are.
pub(crate) fn half_broadcast<B: Backend>(
    a: Prim<B>,
    b: Prim<B>,
    f: &dyn Fn(Prim<B>, Prim<B>) -> Prim<B>,
) -> Prim<B> {
    use burn_backend::FloatDType;
    let dtype = a.dtype();
    // The cheap checks first: an f32 op or another backend's pays no shape.
    if flex::<B>(&a).is_none() || !matches!(dtype, DType::BF16 | DType::F16) || b.dtype() != dtype {
        return f(a, b);
    }
    let (sa, sb) = (a.shape(), b.shape());
    let broadcasts = sa != sb
        && sa.num_dims() == sb.num_dims()
        && sa.num_dims() > 0
        && (0..sa.num_dims()).all(|d| sa[d] == sb[d] || sa[d] == 1 || sb[d] == 1);
    if !broadcasts {
        return f(a, b);
    }
    let rows = sa[0].max(sb[0]);
    let per_row = (1..sa.num_dims())
        .map(|d| sa[d].max(sb[d]))
        .product::<usize>()
        .max(1);
    let step = (PIECE / per_row).max(1);
    let half: FloatDType = dtype.into();
    let piece = |t: &Prim<B>, start: usize, end: usize| {
        let t = match t.shape()[0] {
            1 => t.clone(),
            _ if start == 0 && end == rows => t.clone(),
            _ => B::float_slice(
                t.clone(),
                &[burn_std::Slice::new(start as isize, Some(end as isize), 1)],
            ),
        };
        cast::<B>(t, FloatDType::F32)
    };
    let parts: Vec<Prim<B>> = (0..rows)
        .step_by(step)
        .map(|start| {
            let end = (start + step).min(rows);
            cast::<B>(f(piece(&a, start, end), piece(&b, start, end)), half)
        })
        .collect();
    match parts.len() {
        1 => parts.into_iter().next().expect("one part"),
        _ => B::float_cat(parts, 0),
    }
}

/// A float tensor of zeros. On Flex, allocated zeroed in its element type: Flex 0.21 allocates
/// a zeroed byte vector and copies it into an aligned buffer (a transient of the tensor's
/// size, twice the tensor at the moment it is made). Any other case is the backend's.
pub(crate) fn zeros<B: Backend>(
    shape: burn_std::Shape,
    device: &burn_backend::tensor::Device<B>,
    dtype: burn_backend::FloatDType,
) -> Prim<B> {
    fn made<E: bytemuck::Pod + Default + Clone + Send + Sync>(
        shape: burn_std::Shape,
        dtype: DType,
    ) -> burn_flex::FlexTensor {
        let values = vec![E::default(); shape.num_elements()];
        let layout = burn_flex::Layout::contiguous(shape);
        burn_flex::FlexTensor::new(burn_std::Bytes::from_elems(values), layout, dtype)
    }
    if TypeId::of::<B>() != TypeId::of::<burn_flex::Flex>() {
        return B::float_zeros(shape, device, dtype);
    }
    let t = match DType::from(dtype) {
        DType::F32 => made::<f32>(shape, DType::F32),
        DType::F64 => made::<f64>(shape, DType::F64),
        DType::BF16 => made::<half::bf16>(shape, DType::BF16),
        DType::F16 => made::<half::f16>(shape, DType::F16),
        _ => return B::float_zeros(shape, device, dtype),
    };
    into_prim::<B>(t).expect("B is Flex")
}

/// `slice_assign` of a float tensor: on Flex, written in place when the tensor is unique,
/// contiguous, of the value's dtype and the slices are plain ranges. Flex 0.21 copies the whole
/// tensor on every `slice_assign` (it holds a second handle to it while asking for its storage),
/// a transient of the tensor's size each time: a fused loss writing its gradient a block of
/// rows at a time, or autodiff's gradient of a slice. Any other case is the backend's.
pub(crate) fn slice_assign<B: Backend>(
    t: Prim<B>,
    slices: &[burn_std::Slice],
    value: Prim<B>,
) -> Prim<B> {
    if flex::<B>(&t).is_none() || flex::<B>(&value).is_none() {
        return B::float_slice_assign(t, slices, value);
    }
    let mut x = (Box::new(t) as Box<dyn std::any::Any>)
        .downcast::<burn_flex::FlexTensor>()
        .expect("Flex's float tensor");
    let written = {
        let v = flex::<B>(&value).expect("checked above");
        written_in_place(&mut x, slices, v)
    };
    let t = into_prim::<B>(*x).expect("B is Flex");
    match written {
        true => t,
        false => B::float_slice_assign(t, slices, value),
    }
}

/// Writes `v` into the region of `x` that `slices` select, if `x` can be written in place (see
/// [`slice_assign`]); whether it was.
fn written_in_place(
    x: &mut burn_flex::FlexTensor,
    slices: &[burn_std::Slice],
    v: &burn_flex::FlexTensor,
) -> bool {
    let shape = x.layout().shape().to_vec();
    let whole = !shape.is_empty()
        && x.is_contiguous()
        && x.layout().start_offset() == 0
        && x.bytes().len() == x.layout().num_elements() * x.dtype().size();
    if !whole || !x.is_unique() || x.dtype() != v.dtype() || slices.len() > shape.len() {
        return false;
    }
    let mut ranges = Vec::with_capacity(shape.len());
    for (d, &size) in shape.iter().enumerate() {
        match slices.get(d) {
            Some(s) if s.step() != 1 => return false,
            Some(s) => ranges.push(s.to_range(size)),
            None => ranges.push(0..size),
        }
    }
    let region: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
    if v.layout().shape().to_vec() != region {
        return false;
    }
    if region.contains(&0) {
        // Nothing to write.
        return true;
    }
    let v = contiguous(v);
    fn write<E: burn_backend::Element + bytemuck::Pod>(
        x: &mut burn_flex::FlexTensor,
        v: &burn_flex::FlexTensor,
        shape: &[usize],
        ranges: &[std::ops::Range<usize>],
    ) -> bool {
        let (Some(dst), Some(src)) = (x.try_storage_mut::<E>(), v.as_slice::<E>()) else {
            return false;
        };
        let nd = shape.len();
        let span = ranges[nd - 1].len();
        // Row-major strides of `x`, and the index of each span's first value (an odometer
        // over the region's leading dimensions).
        let mut strides = vec![1usize; nd];
        for d in (0..nd - 1).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        let mut index: Vec<usize> = ranges.iter().map(|r| r.start).collect();
        for chunk in src.chunks_exact(span) {
            let at: usize = index.iter().zip(&strides).map(|(i, s)| i * s).sum();
            dst[at..at + span].copy_from_slice(chunk);
            for d in (0..nd - 1).rev() {
                index[d] += 1;
                if index[d] < ranges[d].end {
                    break;
                }
                index[d] = ranges[d].start;
            }
        }
        true
    }
    match x.dtype() {
        DType::F32 => write::<f32>(x, &v, &shape, &ranges),
        DType::BF16 => write::<half::bf16>(x, &v, &shape, &ranges),
        DType::F16 => write::<half::f16>(x, &v, &shape, &ranges),
        _ => false,
    }
}

fn on_flex_f32<B: Backend>(t: &Prim<B>) -> bool {
    TypeId::of::<B>() == TypeId::of::<burn_flex::Flex>() && t.dtype() == DType::F32
}

/// Applies `f` to the tensor's values: on Flex, reading a unique contiguous tensor and writing
/// it back move its buffer without copying; a shared one (an input autodiff saved: `exp` keeps
/// its input for backward) is mapped into one fresh f32 buffer ([`data`]). (Flex's `into_data`
/// copies a shared buffer twice, as bytes and again to align them: a transient of twice the
/// tensor's size, at the loss's `exp` the forward's peak.)
fn map<B: Backend>(t: Prim<B>, f: fn(&mut [f32])) -> Prim<B> {
    let device = B::float_device(&t);
    if let Some(x) = flex::<B>(&t).filter(|x| !x.is_unique())
        && let Some(xs) = x.as_slice::<f32>()
    {
        let mapped = data(xs, x.layout().shape(), |x, o: &mut [f32]| {
            o.copy_from_slice(x);
            f(o)
        });
        return B::float_from_data(mapped, &device);
    }
    let mut data = try_read_sync(B::float_into_data(t))
        .expect("Flex reads synchronously")
        .expect("reading a Flex tensor");
    let values = data
        .as_mut_slice::<f32>()
        .expect("an f32 tensor's data is f32");
    // Chunks of 16K values: large enough to amortise a task, small enough to spread a
    // softmax's scores over the threads.
    const CHUNK: usize = 1 << 14;
    if values.len() > 2 * CHUNK {
        use rayon::prelude::*;
        values.par_chunks_mut(CHUNK).for_each(f);
    } else {
        f(values);
    }
    B::float_from_data(data, &device)
}

/// `$slice(xs)` maps every value through `$f`: a copy of the loop compiled for AVX2 and FMA
/// (`$avx2`) when the CPU has them, the portable one (`$any`) otherwise.
macro_rules! elementwise {
    ($slice:ident, $avx2:ident, $any:ident, $f:expr) => {
        fn $slice(xs: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has the features the function is compiled for.
                unsafe { $avx2(xs) };
                return;
            }
            $any(xs)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $avx2(xs: &mut [f32]) {
            for x in xs {
                *x = $f(*x);
            }
        }

        fn $any(xs: &mut [f32]) {
            for x in xs {
                *x = $f(*x);
            }
        }
    };
}

elementwise!(exp_slice, exp_avx2, exp_any, exp_f32);
elementwise!(sigmoid_slice, sigmoid_avx2, sigmoid_any, sigmoid_f32);

/// `ln(f32::MAX)`: above, `exp` is infinite.
const MAX_X: f32 = 88.722_84;
/// `ln` of the smallest normal f32: below, `exp` is 0 (subnormal results are flushed).
const MIN_X: f32 = -87.336_55;

/// `exp` rounded once to f32 (see the module docs).
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    let v = exp_wide(x) as f32;
    let v = if x < MIN_X { 0.0 } else { v };
    let v = if x > MAX_X { f32::INFINITY } else { v };
    if x.is_nan() { x } else { v }
}

/// `1 / (1 + exp(-x))` in f64, rounded once to f32.
#[inline(always)]
fn sigmoid_f32(x: f32) -> f32 {
    let s = (1.0 / (1.0 + exp_wide(-x))) as f32;
    let s = if -x > MAX_X { 0.0 } else { s };
    let s = if -x < MIN_X { 1.0 } else { s };
    if x.is_nan() { x } else { s }
}

/// `exp(x)` in f64 for `x` clamped to `[MIN_X, MAX_X]`: `2^n exp(r)`.
#[inline(always)]
fn exp_wide(x: f32) -> f64 {
    const LOG2E: f64 = std::f64::consts::LOG2_E;
    const LN2: f64 = std::f64::consts::LN_2;
    // Adding and subtracting 1.5 * 2^52 rounds to the nearest integer (|v| < 2^51).
    const ROUND: f64 = 6_755_399_441_055_744.0;
    let xc = f64::from(x.clamp(MIN_X, MAX_X));
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = xc - n * LN2;
    let mut p = 1.0 / 362_880.0;
    p = p * r + 1.0 / 40_320.0;
    p = p * r + 1.0 / 5_040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    p * f64::from_bits(((n as i64 + 1023) as u64) << 52)
}

/// `t` cast to `dtype`. Flex 0.21 casts through an f64 copy of the whole tensor (8 bytes per
/// element beside the result) and one scalar loop: under mixed precision, where every
/// compute-bound op narrows its inputs and every meeting of a half and an f32 operand widens
/// one, that copy was the peak of a bf16 step's backward and much of its time. On Flex,
/// between f32 and bf16/f16, the values are converted directly (on Rayon's threads for large
/// tensors) into the result, no intermediate. Widening and f16 give Flex's values; f32 to bf16
/// rounds to nearest, ties to even, as PyTorch does, where Flex's `bf16::from_f64` rounds some
/// values just above a tie down (9248.003 to 9216 instead of 9280). Other backends and dtypes
/// keep the backend's cast.
pub(crate) fn cast<B: Backend>(t: Prim<B>, dtype: burn_backend::FloatDType) -> Prim<B> {
    use half::{bf16, f16};
    let to = DType::from(dtype);
    let flex = match flex::<B>(&t) {
        Some(flex) if t.dtype() != to => contiguous(flex),
        _ => return B::float_cast(t, dtype),
    };
    let shape = flex.layout().shape();
    let data = match (flex.dtype(), to) {
        (DType::F32, DType::BF16) => flex
            .as_slice::<f32>()
            .map(|v| data(v, shape, narrow::<bf16>)),
        (DType::F32, DType::F16) => flex
            .as_slice::<f32>()
            .map(|v| data(v, shape, narrow::<f16>)),
        (DType::BF16, DType::F32) => flex
            .as_slice::<bf16>()
            .map(|v| data(v, shape, widen::<bf16>)),
        (DType::F16, DType::F32) => flex.as_slice::<f16>().map(|v| data(v, shape, widen::<f16>)),
        _ => None,
    };
    match data {
        Some(data) => B::float_from_data(data, &B::float_device(&t)),
        // Another pair of dtypes.
        None => B::float_cast(t, dtype),
    }
}

/// A tensor of `shape` whose values `convert` writes from `xs` ([`converted`]).
fn data<S: Copy + Sync, T: burn_backend::Element + Default + Send>(
    xs: &[S],
    shape: &[usize],
    convert: impl Fn(&[S], &mut [T]) + Sync,
) -> burn_backend::TensorData {
    burn_backend::TensorData::new(converted(xs, convert), shape.to_vec())
}

/// The values `convert` writes from `xs`, a chunk at a time ([`convert_into`]).
fn converted<S: Copy + Sync, T: Default + Clone + Send>(
    xs: &[S],
    convert: impl Fn(&[S], &mut [T]) + Sync,
) -> Vec<T> {
    let mut out = vec![T::default(); xs.len()];
    convert_into(xs, &mut out, convert);
    out
}

/// Has `convert` write `out` from `xs` (of the same length), a chunk at a time (on Rayon's
/// threads for large slices).
fn convert_into<S: Copy + Sync, T: Send>(
    xs: &[S],
    out: &mut [T],
    convert: impl Fn(&[S], &mut [T]) + Sync,
) {
    const CHUNK: usize = 1 << 15;
    if xs.len() > 2 * CHUNK {
        use rayon::prelude::*;
        out.par_chunks_mut(CHUNK)
            .zip(xs.par_chunks(CHUNK))
            .for_each(|(o, x)| convert(x, o));
    } else {
        convert(xs, out);
    }
}

/// Rounds f32 values to the half type `H`.
fn narrow<H: Half>(x: &[f32], o: &mut [H]) {
    o.iter_mut().zip(x).for_each(|(o, x)| *o = H::from_f32(*x));
}

/// Widens values of the half type `H` to f32.
fn widen<H: Half>(x: &[H], o: &mut [f32]) {
    o.iter_mut().zip(x).for_each(|(o, x)| *o = x.to_f32());
}

/// A Flex tensor as the inner tensor of `B`, when `B` is Flex.
fn into_prim<B: Backend>(t: burn_flex::FlexTensor) -> Option<Prim<B>> {
    (Box::new(t) as Box<dyn std::any::Any>)
        .downcast::<Prim<B>>()
        .ok()
        .map(|t| *t)
}

/// Whether kiln widens a bf16 Flex tensor's storage in its own layout: when the storage holds at
/// most four times its values (a small view of a large buffer is left to Flex).
fn widened_whole(t: &burn_flex::FlexTensor) -> bool {
    t.storage::<half::bf16>().len() <= 4 * t.layout().num_elements()
}

/// Rayon's threads for a product of `m n k` multiply-adds of at least 4M, else one thread.
fn parallelism(mnk: usize) -> gemm::Parallelism {
    if mnk >= 1 << 22 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    }
}

/// `dst [m, n] = lhs [m, k] rhs` in f32, `dst` and `lhs` row-major and contiguous, `rhs`
/// read through its strides (`rhs_rs` between rows, `rhs_cs` between columns).
///
/// # Safety
/// `dst` holds `m n` values, `lhs` `m k`, and `rhs` every `i rhs_rs + j rhs_cs` for `i < k`,
/// `j < n`.
unsafe fn gemm_f32(
    dst: &mut [f32],
    lhs: &[f32],
    rhs: &[f32],
    [m, k, n]: [usize; 3],
    [rhs_rs, rhs_cs]: [usize; 2],
    parallelism: gemm::Parallelism,
) {
    // SAFETY: the caller's bounds, as `gemm` reads and writes them.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            0f32,
            1f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `matmul` of two bf16 Flex tensors.
///
/// Flex 0.21 first copies each operand into a contiguous bf16 tensor, element by element
/// through a strided iterator (the transposed operands of every backward product), then
/// widens both to f32 on one thread, multiplies in f32 and rounds the result on one thread: a
/// tenth of a bf16 step's time went to those copies. Here each operand's storage is widened
/// to f32 in its own layout (strides and offset kept, on Rayon's threads), Flex's f32 product
/// reads the strided operands as they are, and the result is rounded once: the same values
/// (the f32 product of the widened operands, rounded). Any other case is the backend's.
pub(crate) fn matmul<B: Backend>(a: Prim<B>, b: Prim<B>) -> Prim<B> {
    let bf16_on_flex = |t: &Prim<B>| flex::<B>(t).is_some() && t.dtype() == DType::BF16;
    if !(bf16_on_flex(&a) && bf16_on_flex(&b)) {
        return B::float_matmul(a, b);
    }
    let fast = flex::<B>(&a)
        .zip(flex::<B>(&b))
        .and_then(|(a, b)| by_rows(a, b).or_else(|| dot(a, b)));
    if let Some(data) = fast {
        return B::float_from_data(data, &B::float_device(&a));
    }
    match (widened_in_place::<B>(&a), widened_in_place::<B>(&b)) {
        (Some(wa), Some(wb)) => cast::<B>(B::float_matmul(wa, wb), burn_backend::FloatDType::BF16),
        _ => B::float_matmul(a, b),
    }
}

/// The product of a bf16 row `[1, k]` and a bf16 column `[k, 1]` of many values (a fused
/// loss's `logits · grad`), accumulated in f32 a block at a time (on Rayon's threads), without
/// widening either operand whole (two f32 transients twice their size). The f32 sum of the
/// same products, in another order than Flex's (not bit for bit its value). `None` otherwise.
fn dot(a: &burn_flex::FlexTensor, b: &burn_flex::FlexTensor) -> Option<burn_backend::TensorData> {
    use half::bf16;
    use rayon::prelude::*;
    const BLOCK: usize = 1 << 15;
    let (1, k, _, a_cs) = a.layout().as_2d_strides()? else {
        return None;
    };
    let (kb, 1, b_rs, _) = b.layout().as_2d_strides()? else {
        return None;
    };
    if k != kb || k < 2 * BLOCK || a_cs < 1 || b_rs < 1 {
        return None;
    }
    let (a_cs, b_rs) = (a_cs as usize, b_rs as usize);
    let a_values = &a.storage::<bf16>()[a.layout().start_offset()..];
    let b_values = &b.storage::<bf16>()[b.layout().start_offset()..];
    if a_values.len() <= (k - 1) * a_cs || b_values.len() <= (k - 1) * b_rs {
        return None;
    }
    // The blocks' sums added in order (Rayon's `sum` adds in whatever order its threads
    // finish: the same product must give the same value every time, as rematerialisation's
    // recomputation and the ranks' replicas assume).
    let partial: Vec<f32> = (0..k.div_ceil(BLOCK))
        .into_par_iter()
        .map(|block| {
            (block * BLOCK..((block + 1) * BLOCK).min(k))
                .map(|j| a_values[j * a_cs].to_f32() * b_values[j * b_rs].to_f32())
                .sum::<f32>()
        })
        .collect();
    let sum: f32 = partial.iter().sum();
    Some(burn_backend::TensorData::new(
        vec![bf16::from_f32(sum)],
        vec![1, 1],
    ))
}

/// The product of two 2-d bf16 Flex tensors whose f32 product would be large, formed a block of
/// rows at a time: the rows of `a` widened to f32, multiplied by `b` widened in its own layout,
/// and the block rounded into the bf16 result. Whole, the f32 product is a transient twice the
/// result's size (a language model's logits: the forward's peak); here it is one block of about
/// 64k values (at least 64 rows). Each value is the f32 sum over `k` of the same products,
/// rounded once; gemm may split `k` differently for a short last block than for the whole
/// product, so a value can differ from Flex's in its last bits (the test's shapes give Flex's
/// bit for bit). The same shapes always give the same values. `None` for other operands:
/// batched, small, negative strides, a small view of a large buffer, or a layout reaching past
/// its storage.
fn by_rows(
    a: &burn_flex::FlexTensor,
    b: &burn_flex::FlexTensor,
) -> Option<burn_backend::TensorData> {
    use half::bf16;
    const BLOCK: usize = 1 << 16;
    let (m, k, a_rs, a_cs) = a.layout().as_2d_strides()?;
    let (kb, n, b_rs, b_cs) = b.layout().as_2d_strides()?;
    let storage_ok =
        |t: &burn_flex::FlexTensor| t.layout().has_positive_strides() && widened_whole(t);
    if k != kb || m * n < 2 * BLOCK || k == 0 || !storage_ok(a) || !storage_ok(b) {
        return None;
    }
    let (a_rs, a_cs, b_rs, b_cs) = (a_rs as usize, a_cs as usize, b_rs as usize, b_cs as usize);
    let a_values = a.storage::<bf16>().get(a.layout().start_offset()..)?;
    let b_values = b.storage::<bf16>().get(b.layout().start_offset()..)?;
    // Every index read below lies within the storage (the gemm call reads `b` unchecked).
    let last = |rows: usize, rs: usize, cols: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    if last(m, a_rs, k, a_cs) >= a_values.len() || last(k, b_rs, n, b_cs) >= b_values.len() {
        return None;
    }
    let b_wide = converted(b_values, widen::<bf16>);
    let rows = (BLOCK / n).max(64).min(m);
    let mut out = vec![bf16::default(); m * n];
    let mut block = vec![0f32; rows * k];
    let mut acc = vec![0f32; rows * n];
    for r0 in (0..m).step_by(rows) {
        let r = rows.min(m - r0);
        for (i, dst) in block.chunks_exact_mut(k).take(r).enumerate() {
            let row = (r0 + i) * a_rs;
            for (j, d) in dst.iter_mut().enumerate() {
                *d = a_values[row + j * a_cs].to_f32();
            }
        }
        // SAFETY: `acc` holds `r n` values and `block` `r k`; `b_wide` holds `b`'s values from
        // its start offset in `b`'s layout, whose last index read was checked above.
        unsafe {
            gemm_f32(
                &mut acc[..r * n],
                &block[..r * k],
                &b_wide,
                [r, k, n],
                [b_rs, b_cs],
                parallelism(rows * n * k),
            )
        };
        convert_into(
            &acc[..r * n],
            &mut out[r0 * n..(r0 + r) * n],
            narrow::<bf16>,
        );
    }
    Some(burn_backend::TensorData::new(out, vec![m, n]))
}

/// A bf16 Flex tensor widened to f32 in its own layout, when its storage holds at most four
/// times its values: attention's query, key and value are views of one fused projection
/// (three times their values), whose vectorised widening still costs less than Flex's copy of
/// the view element by element; a view of a small part of a large buffer is left to Flex.
fn widened_in_place<B: Backend>(t: &Prim<B>) -> Option<Prim<B>> {
    let x = flex::<B>(t).filter(|x| widened_whole(x))?;
    let wide = converted(x.storage::<half::bf16>(), widen::<half::bf16>);
    into_prim::<B>(burn_flex::FlexTensor::new(
        burn_std::Bytes::from_elems(wide),
        x.layout().clone(),
        DType::F32,
    ))
}

/// `linear(x, w, bias)` in a half-precision compute dtype on Flex, without a half-precision
/// copy of the weight.
///
/// Flex multiplies half-precision matrices by converting both whole operands to f32, so the
/// policy's rounding of an f32 weight (a copy) followed by Flex's widening (another) made the
/// largest layer's weight three times over during forward: for a 12-layer GPT-2 of 768
/// dimensions, 20 MiB of the forward's peak. Here the weight is rounded to the compute dtype
/// panel by panel (128 output columns at a time, into one f32 buffer) and each panel is
/// multiplied in f32 against the rounded input: the same products of rounded operands,
/// accumulated in f32, with the bias added before the single rounding of the result.
///
/// The arguments are handed back unless the backend is Flex, `dtype` is bf16 or f16, the
/// weight is a contiguous f32 `[in, out]` matrix and the input and bias are f32 or in `dtype`.
#[allow(clippy::type_complexity)]
pub(crate) fn linear_half<B: Backend>(
    x: Prim<B>,
    w: Prim<B>,
    bias: Option<Prim<B>>,
    dtype: DType,
) -> Result<Prim<B>, (Prim<B>, Prim<B>, Option<Prim<B>>)> {
    let operand = |t: &Prim<B>| [DType::F32, dtype].contains(&t.dtype());
    let w_shape = w.shape();
    let k = if w_shape.num_dims() == 2 {
        w_shape[0]
    } else {
        0
    };
    let fits = matches!(dtype, DType::BF16 | DType::F16)
        && w.dtype() == DType::F32
        && w_shape.num_dims() == 2
        && x.shape().num_dims() > 0
        && x.shape()[x.shape().num_dims() - 1] == k
        && operand(&x)
        && bias.as_ref().is_none_or(operand);
    let weight = flex::<B>(&w)
        .filter(|_| fits)
        .and_then(|w| w.as_slice::<f32>());
    let (Some(weight), Some(xf)) = (weight, flex::<B>(&x)) else {
        return Err((x, w, bias));
    };
    let bias = bias.as_ref().and_then(flex::<B>);
    let data = match dtype {
        DType::BF16 => half_linear::<half::bf16>(xf, weight, bias, k),
        _ => half_linear::<half::f16>(xf, weight, bias, k),
    };
    Ok(B::float_from_data(data, &B::float_device(&x)))
}

/// [`linear_half`] in the half type `H`: the input and bias rounded to `H` (exact if already
/// in it) as f32, the product by [`panels`].
fn half_linear<H: Half>(
    x: &burn_flex::FlexTensor,
    weight: &[f32],
    bias: Option<&burn_flex::FlexTensor>,
    k: usize,
) -> burn_backend::TensorData {
    let n = weight.len() / k.max(1);
    let xs = values_f32::<H>(x);
    let bias = bias.map(values_f32::<H>);
    let m = xs.len() / k.max(1);
    let out = panels::<H>(&xs, weight, bias.as_deref(), [m, k, n]);
    let mut shape = x.layout().shape().to_vec();
    *shape.last_mut().expect("x has dimensions") = n;
    burn_backend::TensorData::new(out, shape)
}

/// `round(xs) round(weight) + round(bias)` for `xs` `[m, k]` and `weight` `[k, n]`, a panel of
/// 128 output columns at a time: the panel's weight is rounded into an f32 buffer, multiplied
/// in f32, and its columns of the result rounded once into the output (the only buffers are
/// a panel's: `k x 128` and `m x 128` f32).
fn panels<H: Half>(
    xs: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    [m, k, n]: [usize; 3],
) -> Vec<H> {
    let round = |v: f32| H::from_f32(v).to_f32();
    const PANEL: usize = 128;
    let width = PANEL.min(n);
    let mut out = vec![H::default(); m * n];
    let mut panel = vec![0f32; k * width];
    let mut acc = vec![0f32; m * width];
    let parallelism = parallelism(m * n * k);
    for c0 in (0..n).step_by(PANEL) {
        let nc = PANEL.min(n - c0);
        for (row, dst) in weight.chunks_exact(n).zip(panel.chunks_exact_mut(nc)) {
            for (d, v) in dst.iter_mut().zip(&row[c0..c0 + nc]) {
                *d = round(*v);
            }
        }
        // SAFETY: `xs` is `[m, k]`, `panel` `[k, nc]` and `acc` `[m, nc]`, all row-major,
        // alive and at least that long.
        unsafe { gemm_f32(&mut acc, xs, &panel, [m, k, nc], [nc, 1], parallelism) };
        for (dst, src) in out.chunks_exact_mut(n).zip(acc.chunks_exact(nc)) {
            let dst = &mut dst[c0..c0 + nc];
            match bias {
                Some(b) => {
                    for ((d, s), b) in dst.iter_mut().zip(src).zip(&b[c0..c0 + nc]) {
                        *d = H::from_f32(s + b);
                    }
                }
                None => {
                    for (d, s) in dst.iter_mut().zip(src) {
                        *d = H::from_f32(*s);
                    }
                }
            }
        }
    }
    out
}

/// A Flex tensor's values as f32: an f32 tensor's each rounded to `H`, a tensor in
/// the half type `H` exactly (read in place when contiguous: a saved activation is shared,
/// and reading it out would copy it).
fn values_f32<H: Half>(t: &burn_flex::FlexTensor) -> Vec<f32> {
    let round = |v: f32| H::from_f32(v).to_f32();
    let t = contiguous(t);
    match t.as_slice::<f32>() {
        Some(v) => v.iter().map(|v| round(*v)).collect(),
        None => t
            .as_slice::<H>()
            .expect("an f32 tensor or one in the compute dtype")
            .iter()
            .map(|v| v.to_f32())
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_backend::ops::FloatTensorOps;
    use burn_backend::{FloatDType, TensorData};
    use burn_flex::Flex;

    /// A Flex tensor's shape and values.
    fn values(t: Prim<Flex>) -> (burn_backend::Shape, Vec<f64>) {
        let d = try_read_sync(Flex::float_into_data(t)).unwrap().unwrap();
        (d.shape.clone(), d.convert::<f64>().to_vec::<f64>().unwrap())
    }

    /// A Flex tensor of `shape` in `dtype`, of varied values `scale` apart.
    fn tensor(shape: Vec<usize>, scale: f32, dtype: FloatDType) -> Prim<Flex> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * scale)
            .collect();
        Flex::float_cast(
            Flex::float_from_data(TensorData::new(v, shape), &Default::default()),
            dtype,
        )
    }

    /// The half-precision paths give Flex's own half-precision values: a broadcasting binary
    /// op bit for bit (in one piece, and in pieces joined along the first dimension), `exp`
    /// and `sigmoid` within one step of the half type (kiln's f32 kernels against libm's).
    #[test]
    fn half_paths_give_flex_values() {
        use burn_backend::ops::ActivationOps;
        let sub = |x, y| Flex::float_sub(x, y);
        for dtype in [FloatDType::BF16, FloatDType::F16] {
            for (a, b) in [
                (vec![4, 3, 5], vec![4, 1, 5]),
                (vec![4, 3, 5], vec![1, 3, 1]),
                (vec![1, 3, 5], vec![4, 3, 1]),
                // Pieces: 3 rows of 2^19 values, two rows a piece.
                (vec![3, 1 << 19], vec![3, 1]),
            ] {
                let x = tensor(a.clone(), 0.037, dtype);
                let y = tensor(b.clone(), 0.061, dtype);
                let got = values(half_broadcast::<Flex>(x.clone(), y.clone(), &sub));
                assert_eq!(
                    got,
                    values(Flex::float_sub(x, y)),
                    "{dtype:?} {a:?} - {b:?}"
                );
            }
            let x = tensor(vec![50, 100], 0.05, dtype);
            let step = match dtype {
                FloatDType::BF16 => 2f64.powi(-7),
                _ => 2f64.powi(-10),
            };
            for (name, got, want) in [
                ("exp", exp::<Flex>(x.clone()), Flex::float_exp(x.clone())),
                (
                    "sigmoid",
                    sigmoid::<Flex>(x.clone()),
                    Flex::sigmoid(x.clone()),
                ),
            ] {
                let ((gs, got), (ws, want)) = (values(got), values(want));
                assert_eq!(gs, ws);
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= step * w.abs(),
                        "{name} {dtype:?}: {g} vs {w}"
                    );
                }
            }
        }
    }

    /// kiln's bf16 product gives Flex's values bit for bit, widening in place every operand
    /// but a small view of a large buffer.
    #[test]
    fn bf16_matmul_is_flex_matmul() {
        let tensor = |shape, scale| tensor(shape, scale, FloatDType::BF16);
        let t = |x| Flex::float_swap_dims(x, 0, 1);
        // Contiguous, transposed (a backward product's operands), batched, a view of a small
        // part of a large buffer (left to Flex).
        let cases = [
            (tensor(vec![33, 70], 0.013), tensor(vec![70, 45], 0.029)),
            (t(tensor(vec![70, 33], 0.013)), tensor(vec![70, 45], 0.029)),
            (tensor(vec![33, 70], 0.013), t(tensor(vec![45, 70], 0.029))),
            (
                tensor(vec![3, 33, 70], 0.013),
                Flex::float_swap_dims(tensor(vec![3, 45, 70], 0.029), 1, 2),
            ),
            (
                Flex::float_slice(
                    tensor(vec![400, 70], 0.013),
                    &[burn_std::Slice::new(5, Some(38), 1)],
                ),
                tensor(vec![70, 45], 0.029),
            ),
            // The middle third of a fused projection's columns (widened in its layout).
            (
                Flex::float_slice(
                    tensor(vec![33, 210], 0.013),
                    &[
                        burn_std::Slice::new(0, None, 1),
                        burn_std::Slice::new(70, Some(140), 1),
                    ],
                ),
                tensor(vec![70, 45], 0.029),
            ),
        ];
        for (i, (a, b)) in cases.into_iter().enumerate() {
            // Every operand but the small view of a large buffer takes kiln's path.
            let in_place = [&a, &b].map(|t| widened_in_place::<Flex>(t).is_some());
            assert_eq!(in_place, [i != 4, true], "case {i}");
            let got = values(matmul::<Flex>(a.clone(), b.clone()));
            let want = values(Flex::float_matmul(a, b));
            assert_eq!(got, want, "case {i}");
        }
        // Products large enough to be formed a block of rows at a time (the last block
        // short), contiguous and transposed.
        let large = [
            (tensor(vec![333, 70], 0.013), tensor(vec![70, 500], 0.029)),
            (
                t(tensor(vec![70, 333], 0.013)),
                t(tensor(vec![500, 70], 0.029)),
            ),
        ];
        for (i, (a, b)) in large.into_iter().enumerate() {
            assert!(by_rows(flex::<Flex>(&a).unwrap(), flex::<Flex>(&b).unwrap()).is_some());
            let got = values(matmul::<Flex>(a.clone(), b.clone()));
            let want = values(Flex::float_matmul(a, b));
            assert_eq!(got, want, "large case {i}");
        }
        // A long row by a long column: the f32 sum (in another order) rounded once.
        let a = tensor(vec![1, 70_001], 0.013);
        let b = t(tensor(vec![1, 70_001], 0.029));
        assert!(dot(flex::<Flex>(&a).unwrap(), flex::<Flex>(&b).unwrap()).is_some());
        let want: f64 = values(a.clone())
            .1
            .iter()
            .zip(values(b.clone()).1)
            .map(|(x, y)| x * y)
            .sum();
        let got = values(matmul::<Flex>(a, b)).1[0];
        assert!((got - want).abs() <= want.abs() / 128.0, "{got} vs {want}");
    }

    /// `zeros` gives Flex's zeros in every float dtype.
    #[test]
    fn zeros_are_flex_zeros() {
        for dtype in [
            FloatDType::F64,
            FloatDType::F32,
            FloatDType::BF16,
            FloatDType::F16,
        ] {
            let got = zeros::<Flex>(vec![3, 4].into(), &Default::default(), dtype);
            assert_eq!(got.dtype(), DType::from(dtype));
            let want = Flex::float_zeros(vec![3, 4].into(), &Default::default(), dtype);
            assert_eq!(values(got), values(want), "{dtype:?}");
        }
    }

    /// `slice_assign` gives Flex's values, writing a unique tensor in place (its buffer kept)
    /// and leaving a shared one to Flex (the other holder sees no change).
    #[test]
    fn slice_assign_is_flex_slice_assign() {
        use burn_std::Slice;
        // Offsets in every dimension (a negative start in the last).
        for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
            let slices = [
                Slice::new(1, Some(3), 1),
                Slice::new(2, Some(5), 1),
                Slice::new(-4, None, 1),
            ];
            let value = || tensor(vec![2, 3, 4], 0.5, dtype);
            let want = values(Flex::float_slice_assign(
                tensor(vec![3, 5, 7], 0.25, dtype),
                &slices,
                value(),
            ));
            let unique = tensor(vec![3, 5, 7], 0.25, dtype);
            let before = flex::<Flex>(&unique).unwrap().bytes().as_ptr();
            let got = slice_assign::<Flex>(unique, &slices, value());
            assert_eq!(
                flex::<Flex>(&got).unwrap().bytes().as_ptr(),
                before,
                "{dtype:?}"
            );
            assert_eq!(values(got), want, "{dtype:?}");
            let shared = tensor(vec![3, 5, 7], 0.25, dtype);
            let other = shared.clone();
            assert_eq!(values(slice_assign::<Flex>(shared, &slices, value())), want);
            assert_eq!(values(other), values(tensor(vec![3, 5, 7], 0.25, dtype)));
        }
    }

    /// The direct cast rounds f32 to bf16 to nearest, ties to even (as PyTorch does; Flex's
    /// own cast, through `bf16::from_f64`, rounds some values above a tie down: 9248.003 to
    /// 9216), gives Flex's values for f16, and widens exactly: specials, ties, subnormals
    /// and a sweep of bit patterns.
    #[test]
    fn cast_is_flex_cast() {
        let mut xs = vec![
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-45,
            65504.0,
            65520.0,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            3.0e38,
        ];
        let mut bits = 0x1234_5677u32;
        while xs.len() < 200_000 {
            bits = bits.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            xs.push(f32::from_bits(bits));
        }
        let n = xs.len();
        let device = Default::default();
        let same = |a: Prim<Flex>, b: Prim<Flex>| {
            let (a, b) = (Flex::float_into_data(a), Flex::float_into_data(b));
            let (a, b) = (
                try_read_sync(a).unwrap().unwrap(),
                try_read_sync(b).unwrap().unwrap(),
            );
            assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape));
            let (a, b) = (a.convert::<f64>(), b.convert::<f64>());
            let (a, b) = (a.as_slice::<f64>().unwrap(), b.as_slice::<f64>().unwrap());
            let differ: Vec<_> = (0..n)
                .filter(|&i| a[i].to_bits() != b[i].to_bits() && !(a[i].is_nan() && b[i].is_nan()))
                .map(|i| (xs[i], a[i], b[i]))
                .take(5)
                .collect();
            assert!(differ.is_empty(), "(x, direct, Flex) differ: {differ:?}");
        };
        let x = || Flex::float_from_data(TensorData::new(xs.clone(), vec![n]), &device);
        // bf16: round to nearest, ties to even, on the f32's bits (PyTorch's rounding).
        let rne: Vec<half::bf16> = xs
            .iter()
            .map(|x| {
                let b = x.to_bits();
                half::bf16::from_bits(match x.is_nan() {
                    true => 0x7fc0,
                    false => ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16,
                })
            })
            .collect();
        let want = Flex::float_from_data(TensorData::new(rne, vec![n]), &device);
        same(cast::<Flex>(x(), FloatDType::BF16), want);
        same(
            cast::<Flex>(x(), FloatDType::F16),
            Flex::float_cast(x(), FloatDType::F16),
        );
        for half in [FloatDType::BF16, FloatDType::F16] {
            let narrow = cast::<Flex>(x(), half);
            let wide = cast::<Flex>(narrow.clone(), FloatDType::F32);
            same(wide, Flex::float_cast(narrow, FloatDType::F32));
        }
    }

    fn ulps(got: f32, want: f64) -> f64 {
        let ulp = (want.abs() as f32).max(f32::MIN_POSITIVE);
        let ulp = f32::from_bits(ulp.to_bits() + 1) - ulp;
        (got as f64 - want).abs() / ulp as f64
    }

    #[test]
    fn exp_and_sigmoid_are_within_one_ulp_over_the_normal_range() {
        // Up to 88.7: at ln(f32::MAX) itself the product rounds to infinity.
        let top = 88.7_f32;
        let mut xs: Vec<f32> = (0..2_000_001)
            .map(|i| MIN_X + (top - MIN_X) * i as f32 / 2_000_000.0)
            .collect();
        xs.extend([0.0, -0.0, 1.0, -1.0, 1e-8, -1e-8, 0.5, 20.0, -20.0]);
        let want: Vec<f64> = xs.iter().map(|&x| (x as f64).exp()).collect();
        let worst = |got: &[f32]| {
            got.iter()
                .zip(&want)
                .map(|(&g, &w)| ulps(g, w))
                .fold(0.0, f64::max)
        };
        // The dispatched loop (AVX2 and FMA here when the CPU has them) and the portable one.
        let mut fast = xs.clone();
        exp_slice(&mut fast);
        let mut portable = xs.clone();
        exp_any(&mut portable);
        for (name, got) in [("dispatched", &fast), ("portable", &portable)] {
            let w = worst(got);
            assert!(w <= 0.51, "{name}: worst error {w} ulp");
        }
        assert_eq!(fast[2_000_001], 1.0);
        let sigmoid_want: Vec<f64> = xs
            .iter()
            .map(|&x| 1.0 / (1.0 + (-(x as f64)).exp()))
            .collect();
        let mut sig = xs.clone();
        sigmoid_slice(&mut sig);
        let w = sig
            .iter()
            .zip(&sigmoid_want)
            .map(|(&g, &w)| ulps(g, w))
            .fold(0.0, f64::max);
        assert!(w <= 0.51, "sigmoid: worst error {w} ulp");
    }

    /// `exp` of a tensor another holder shares (autodiff keeps `exp`'s input) gives the values
    /// of a unique one's (mapped in its own buffer), leaves the shared buffer as it was, and
    /// shares no buffer with it.
    #[test]
    fn exp_of_a_shared_tensor() {
        let input = || tensor(vec![4, 1 << 14], 0.01, FloatDType::F32);
        let unique = input();
        assert!(unique.is_unique());
        let (_, want) = values(exp::<Flex>(unique));
        let x = input();
        let kept = x.clone();
        assert!(!x.is_unique());
        let y = exp::<Flex>(x);
        assert!(y.is_unique() && kept.is_unique(), "a buffer of its own");
        assert_eq!(values(y).1, want);
        assert_eq!(values(kept).1, values(input()).1);
    }

    #[test]
    fn exp_and_sigmoid_edges() {
        let mut xs = [
            f32::NEG_INFINITY,
            -1000.0,
            -88.0,
            89.0,
            f32::INFINITY,
            f32::NAN,
        ];
        exp_slice(&mut xs);
        assert_eq!(xs[..5], [0.0, 0.0, 0.0, f32::INFINITY, f32::INFINITY]);
        assert!(xs[5].is_nan());
        let mut s = [f32::NEG_INFINITY, -200.0, 0.0, 3.0, 200.0, f32::INFINITY];
        sigmoid_slice(&mut s);
        assert_eq!(s[..3], [0.0, 0.0, 0.5]);
        assert!((s[3] as f64 - 1.0 / (1.0 + (-3.0f64).exp())).abs() < 1e-7);
        assert_eq!(s[4..], [1.0, 1.0]);
    }

    /// kiln's half-precision `linear` on Flex: the product of the rounded input and weight plus
    /// the rounded bias, accumulated in f32 and rounded once (within one bf16 step of the same
    /// sum in f64), and the whole-operand path's result within one step too.
    #[test]
    fn half_linear_is_the_rounded_product_rounded_once() {
        use burn_backend::ops::ModuleOps;
        let device = Default::default();
        let (m, k, n) = (5, 70, 300);
        let value = |i: usize, s: f32| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * s;
        let x: Vec<f32> = (0..m * k).map(|i| value(i, 1.3)).collect();
        let w: Vec<f32> = (0..k * n).map(|i| value(i + 17, 0.2)).collect();
        let b: Vec<f32> = (0..n).map(|i| value(i + 5, 0.5)).collect();
        let prim = |v: &[f32], shape: Vec<usize>| {
            Flex::float_from_data(TensorData::new(v.to_vec(), shape), &device)
        };
        let got = linear_half::<Flex>(
            prim(&x, vec![m, k]),
            prim(&w, vec![k, n]),
            Some(prim(&b, vec![n])),
            DType::BF16,
        )
        .expect("Flex, an f32 weight");
        assert_eq!(got.dtype(), DType::BF16);
        let got: Vec<f32> = try_read_sync(Flex::float_into_data(got))
            .unwrap()
            .unwrap()
            .convert::<f32>()
            .to_vec()
            .unwrap();
        let r = |v: f32| half::bf16::from_f32(v).to_f32() as f64;
        let bf16_step = |v: f64| (v.abs().max(1e-30) * 2f64.powi(-7)).max(1e-38);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|l| r(x[i * k + l]) * r(w[l * n + j]))
                    .sum::<f64>()
                    + r(b[j]);
                let e = (got[i * n + j] as f64 - want).abs();
                assert!(
                    e <= bf16_step(want),
                    "[{i}, {j}]: {} vs {want}",
                    got[i * n + j]
                );
            }
        }
        // Flex's own path on the rounded operands (bias added after the product's rounding).
        let narrow = |t| Flex::float_cast(t, burn_std::FloatDType::BF16);
        let whole = Flex::linear(
            narrow(prim(&x, vec![m, k])),
            narrow(prim(&w, vec![k, n])),
            Some(narrow(prim(&b, vec![n]))),
        );
        let whole: Vec<f32> = try_read_sync(Flex::float_into_data(whole))
            .unwrap()
            .unwrap()
            .convert::<f32>()
            .to_vec()
            .unwrap();
        // Flex's path rounds the product before adding the bias: within a step of the product
        // and one of the sum.
        for (i, (g, w)) in got.iter().zip(&whole).enumerate() {
            let product = (*w - b[i % n]).abs() as f64;
            let tolerance = bf16_step(product) + bf16_step(*w as f64);
            assert!(((g - w).abs() as f64) <= tolerance, "{g} vs {w}");
        }
        // Not Flex's case: handed back.
        assert!(
            linear_half::<Flex>(prim(&x, vec![m, k]), prim(&w, vec![k, n]), None, DType::F32)
                .is_err()
        );
    }
}
