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
    if !on_flex_f32::<B>(&t) {
        return B::float_exp(t);
    }
    map::<B>(t, exp_slice)
}

/// `sigmoid` of an inner tensor: `1 / (1 + exp(-x))`.
pub(crate) fn sigmoid<B: Backend>(t: Prim<B>) -> Prim<B> {
    if !on_flex_f32::<B>(&t) {
        return B::sigmoid(t);
    }
    map::<B>(t, sigmoid_slice)
}

fn on_flex_f32<B: Backend>(t: &Prim<B>) -> bool {
    TypeId::of::<B>() == TypeId::of::<burn_flex::Flex>() && t.dtype() == DType::F32
}

/// Applies `f` to the tensor's values in place: on Flex, reading a unique contiguous tensor
/// and writing it back move its buffer without copying (otherwise it is copied once, as
/// Flex's own kernel would).
fn map<B: Backend>(t: Prim<B>, f: fn(&mut [f32])) -> Prim<B> {
    let device = B::float_device(&t);
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
