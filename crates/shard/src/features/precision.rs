//! Mixed precision as a policy of the decorator, for any model: the model's parameters,
//! gradients and optimizer state stay f32 (the masters), and under [`autocast`]
//!
//! - the compute-bound ops (matmul, linear, convolutions, attention) read their f32 inputs
//!   rounded to the compute dtype, run in it and leave their results in it, as
//!   `torch.autocast`'s lower-precision list: the ops after them (attention's softmax, an
//!   activation function, the next matmul) run in the compute dtype, and what autodiff saves
//!   for backward is in it (half of f32's bytes for bf16 and f16); an f32 activation entering
//!   such an op (a norm's output) is cast in the autodiff graph first, so the op saves the
//!   cast (kiln's burn-autodiff asks through its autocast hook, `ops::register_autocast`);
//! - operands of different dtypes meet in the wider, as PyTorch promotes: a compute-dtype
//!   branch added to an f32 residual stream gives f32, so the residual stream and the norms
//!   reading it stay f32; the inner backend's reductions accumulate in f32 (Flex's do);
//! - a weight gradient is accumulated and kept in f32 (its inputs are in the compute dtype),
//!   and every parameter's gradient is handed on in the parameter's dtype, so reduction,
//!   accumulation and the optimizer's state stay f32;
//! - a sharded parameter is all-gathered in the compute dtype (half the bytes of f32 for bf16
//!   and f16), as FSDP2's `param_dtype`;
//! - gradients are reduced in [`Precision::reduce`] (FSDP2's `reduce_dtype`).
//!
//! kiln's models take the loss in f32 (`kiln_model::causal_lm_loss` widens the logits,
//! autocast's f32 list) and add their attention mask in the scores' dtype. A model's own f32
//! constants meet its compute-dtype activations in f32, as they would under PyTorch.
//!
//! With f16, gradients can overflow: [`LossScale`] is the dynamic loss scale a step applies
//! (PyTorch's `GradScaler`: the loss multiplied by the scale before backward, the gradients
//! divided by it after; a step whose gradients are not finite on any rank is skipped by every
//! rank, and the scale halved; after `growth_interval` good steps it doubles).

use crate::core::error::ShardError;
use crate::core::host::read;
use crate::core::scope::{self, Set};
use burn_backend::Backend;
use burn_std::FloatDType;

pub use crate::core::dtype::{Precision, dtype_name};

/// Runs `f` with `policy` in force on this thread (nested calls restore the outer policy).
pub fn autocast<R>(policy: Precision, f: impl FnOnce() -> R) -> R {
    scope::with(Set::Precision(policy), f)
}

/// The policy in force on this thread.
pub fn active() -> Precision {
    scope::precision()
}

/// Checks that backend `B` can run `policy` on `device`: a small matmul in the compute dtype,
/// cast from and back to f32, and a reduction-dtype round trip.
///
/// # Errors
/// What failed, naming the backend and the dtype.
pub fn probe<B: Backend>(policy: Precision, device: &B::Device) -> Result<(), ShardError> {
    // A backend of shapes alone (`kiln plan`) has no values to check.
    if !policy.is_mixed() || crate::core::scope::shapes_only() {
        return Ok(());
    }
    let run = |dtype: FloatDType| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let ones = B::float_ones([2, 3].into(), device, FloatDType::F32);
            let low = B::float_cast(ones, dtype);
            let product = B::float_matmul(low.clone(), B::float_swap_dims(low, 0, 1));
            let back = B::float_cast(product, FloatDType::F32);
            read::<B>(back).to_vec::<f32>().ok()
        }))
    };
    for dtype in [policy.compute, policy.reduce] {
        let got = run(dtype).map_err(|e| {
            let why = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            ShardError::Precision(format!(
                "the backend {} cannot compute in {}: {why}",
                B::name(device),
                dtype_name(dtype)
            ))
        })?;
        if got.as_deref() != Some(&[3.0f32; 4][..]) {
            return Err(ShardError::Precision(format!(
                "the backend {} computes wrongly in {}: a 2x3 matmul of ones gave {got:?}",
                B::name(device),
                dtype_name(dtype)
            )));
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
        use super::{active, autocast};
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
