//! Mixed precision as a policy of the decorator, for any model: the model's parameters,
//! gradients and optimizer state stay f32 (the masters), and under [`autocast`]
//!
//! - the compute-bound ops (matmul, linear, convolutions, attention) read their f32 inputs
//!   rounded to the compute dtype and run in it, as `torch.autocast`'s lower-precision list;
//!   their results are widened back to f32, so every other op (softmax, norms, reductions, the
//!   loss: autocast's f32 list and everything else) runs in f32 and the model sees f32 tensors
//!   throughout, in forward and backward alike;
//! - a sharded parameter is all-gathered in the compute dtype (half the bytes of f32 for bf16
//!   and f16), as FSDP2's `param_dtype`;
//! - gradients are reduced in [`Precision::reduce`] (FSDP2's `reduce_dtype`).
//!
//! What it does not do: keep activations in the compute dtype. Burn's autodiff saves the
//! tensors the model's ops return, and these are f32 here, so a step's activation memory is
//! that of f32 training (rematerialisation is the decorator's tool for that memory).
//!
//! With f16, gradients can overflow: [`LossScale`] is the dynamic loss scale a step applies
//! (PyTorch's `GradScaler`: the loss multiplied by the scale before backward, the gradients
//! divided by it after; a step whose gradients are not finite on any rank is skipped by every
//! rank, and the scale halved; after `growth_interval` good steps it doubles).

use burn_backend::{Backend, DType, TensorMetadata};
use burn_std::FloatDType;
use std::cell::Cell;

/// The dtypes a step computes and communicates in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    /// The dtype of compute-bound ops and of parameter all-gathers.
    pub compute: FloatDType,
    /// The dtype gradients are reduced in.
    pub reduce: FloatDType,
}

impl Default for Precision {
    fn default() -> Self {
        Precision::F32
    }
}

impl Precision {
    /// Everything in f32.
    pub const F32: Precision = Precision {
        compute: FloatDType::F32,
        reduce: FloatDType::F32,
    };

    /// bf16 compute and parameter gathers, f32 gradient reduction.
    pub const BF16: Precision = Precision {
        compute: FloatDType::BF16,
        reduce: FloatDType::F32,
    };

    /// f16 compute and parameter gathers, f32 gradient reduction (use a [`LossScale`]).
    pub const F16: Precision = Precision {
        compute: FloatDType::F16,
        reduce: FloatDType::F32,
    };

    /// The policy named `f32`, `bf16` or `f16`.
    pub fn from_name(name: &str) -> Option<Precision> {
        match name {
            "f32" | "fp32" | "float32" => Some(Precision::F32),
            "bf16" | "bfloat16" => Some(Precision::BF16),
            "f16" | "fp16" | "float16" => Some(Precision::F16),
            _ => None,
        }
    }

    /// The compute dtype's name (`f32`, `bf16`, `f16`).
    pub fn name(&self) -> &'static str {
        dtype_name(self.compute)
    }

    /// Whether anything runs below f32.
    pub fn is_mixed(&self) -> bool {
        self.compute != FloatDType::F32 || self.reduce != FloatDType::F32
    }

    /// Whether the compute dtype needs loss scaling (f16's narrow exponent range).
    pub fn needs_loss_scale(&self) -> bool {
        self.compute == FloatDType::F16 || self.reduce == FloatDType::F16
    }
}

/// A float dtype's short name.
pub fn dtype_name(d: FloatDType) -> &'static str {
    match d {
        FloatDType::F64 => "f64",
        FloatDType::F32 => "f32",
        FloatDType::Flex32 => "flex32",
        FloatDType::F16 => "f16",
        FloatDType::BF16 => "bf16",
    }
}

thread_local! {
    /// The policy of the step running on this thread (a rank).
    static ACTIVE: Cell<Precision> = const { Cell::new(Precision::F32) };
}

/// Runs `f` with `policy` active on this thread (nested calls restore the outer policy).
pub fn autocast<R>(policy: Precision, f: impl FnOnce() -> R) -> R {
    crate::state::scoped(&ACTIVE, policy, f)
}

/// The policy active on this thread.
pub fn active() -> Precision {
    ACTIVE.with(Cell::get)
}

/// The dtype parameters are all-gathered in under the active policy.
pub(crate) fn gather_dtype() -> FloatDType {
    active().compute
}

/// The dtype a tensor of `dtype` has when narrowed to `to` (only f32 is narrowed: other dtypes
/// are the model's own choice).
pub(crate) fn narrowed_dtype(dtype: DType, to: FloatDType) -> DType {
    if dtype == DType::F32 && to != FloatDType::F32 {
        to.into()
    } else {
        dtype
    }
}

/// `t` in `dtype` when it is f32 and `dtype` is narrower (other dtypes are the model's own
/// choice and left alone).
pub(crate) fn narrow<B: Backend>(
    t: B::FloatTensorPrimitive,
    dtype: FloatDType,
) -> B::FloatTensorPrimitive {
    let to = narrowed_dtype(t.dtype(), dtype);
    widen::<B>(t, to)
}

/// `t` cast to `dtype` when it is not already of it.
pub(crate) fn widen<B: Backend>(
    t: B::FloatTensorPrimitive,
    dtype: DType,
) -> B::FloatTensorPrimitive {
    if t.dtype() == dtype {
        t
    } else {
        B::float_cast(t, dtype.into())
    }
}

/// A compute-bound op under `policy`: f32 inputs rounded to the compute dtype, the op run
/// there, the result widened back to f32.
pub(crate) fn lowered<B: Backend>(
    policy: Precision,
    inputs: Vec<B::FloatTensorPrimitive>,
    op: &dyn Fn(Vec<B::FloatTensorPrimitive>) -> B::FloatTensorPrimitive,
) -> B::FloatTensorPrimitive {
    if policy.compute == FloatDType::F32 || inputs.iter().any(|t| t.dtype() != DType::F32) {
        return op(inputs);
    }
    let inputs = inputs
        .into_iter()
        .map(|t| narrow::<B>(t, policy.compute))
        .collect();
    widen::<B>(op(inputs), DType::F32)
}

/// Checks that backend `B` can run `policy` on `device`: a small matmul in the compute dtype,
/// cast from and back to f32, and a reduction-dtype round trip.
///
/// # Errors
/// What failed, naming the backend and the dtype.
pub fn probe<B: Backend>(policy: Precision, device: &B::Device) -> Result<(), String> {
    if !policy.is_mixed() {
        return Ok(());
    }
    let run = |dtype: FloatDType| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let ones = B::float_ones([2, 3].into(), device, FloatDType::F32);
            let low = B::float_cast(ones, dtype);
            let product = B::float_matmul(low.clone(), B::float_swap_dims(low, 0, 1));
            let back = B::float_cast(product, FloatDType::F32);
            crate::ops::policy::read::<B>(back).to_vec::<f32>().ok()
        }))
    };
    for dtype in [policy.compute, policy.reduce] {
        let got = run(dtype).map_err(|e| {
            let why = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            format!(
                "the backend {} cannot compute in {}: {why}",
                B::name(device),
                dtype_name(dtype)
            )
        })?;
        if got.as_deref() != Some(&[3.0f32; 4][..]) {
            return Err(format!(
                "the backend {} computes wrongly in {}: a 2x3 matmul of ones gave {got:?}",
                B::name(device),
                dtype_name(dtype)
            ));
        }
    }
    Ok(())
}

/// The dynamic loss scale of f16 training (PyTorch `GradScaler`'s defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScale {
    /// The factor the loss is multiplied by before backward.
    pub scale: f64,
    /// Steps since the scale last changed without an overflow.
    pub good_steps: u32,
    /// Good steps after which the scale doubles.
    pub growth_interval: u32,
}

impl Default for LossScale {
    fn default() -> Self {
        LossScale {
            scale: 65536.0,
            good_steps: 0,
            growth_interval: 2000,
        }
    }
}

impl LossScale {
    /// The scale after a step whose gradients were finite (`true`) or not.
    pub fn update(self, finite: bool) -> LossScale {
        if !finite {
            return LossScale {
                scale: (self.scale / 2.0).max(f64::MIN_POSITIVE),
                good_steps: 0,
                ..self
            };
        }
        let good = self.good_steps + 1;
        if good >= self.growth_interval {
            LossScale {
                scale: self.scale * 2.0,
                good_steps: 0,
                ..self
            }
        } else {
            LossScale {
                good_steps: good,
                ..self
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_nesting() {
        assert_eq!(Precision::from_name("bf16"), Some(Precision::BF16));
        assert_eq!(Precision::from_name("fp16"), Some(Precision::F16));
        assert_eq!(Precision::from_name("half"), None);
        assert_eq!(active(), Precision::F32);
        autocast(Precision::BF16, || {
            assert_eq!(active(), Precision::BF16);
            autocast(Precision::F16, || assert_eq!(active(), Precision::F16));
            assert_eq!(active(), Precision::BF16);
        });
        assert_eq!(active(), Precision::F32);
    }

    #[test]
    fn the_scale_halves_on_overflow_and_doubles_after_good_steps() {
        let s = LossScale {
            growth_interval: 2,
            ..LossScale::default()
        };
        let s = s.update(false);
        assert_eq!((s.scale, s.good_steps), (32768.0, 0));
        let s = s.update(true);
        assert_eq!((s.scale, s.good_steps), (32768.0, 1));
        let s = s.update(true);
        assert_eq!((s.scale, s.good_steps), (65536.0, 0));
    }
}
