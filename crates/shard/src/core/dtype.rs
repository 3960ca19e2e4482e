//! Dtypes a step computes and communicates in: the precision policy the scope carries, and the
//! casts the ops apply under it (the policy's user-facing side, loss scaling and the backend
//! probe, is the `precision` feature).

use burn_backend::{Backend, DType, TensorMetadata};
use burn_std::FloatDType;

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

    /// f16 compute and parameter gathers, f32 gradient reduction (use a loss scale).
    pub const F16: Precision = Precision {
        compute: FloatDType::F16,
        reduce: FloatDType::F32,
    };

    /// The names [`Precision::from_name`] accepts.
    pub const NAMES: &'static str = "f32, bf16 or f16";

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
        super::ops::fast::cast::<B>(t, dtype.into())
    }
}

/// A compute-bound op under `policy` (`torch.autocast`'s lower-precision list): f32 inputs
/// rounded to the compute dtype, the op run there, and the result left in it, so that the ops
/// after it, and what autodiff saves for backward, are in the compute dtype too.
pub(crate) fn lowered<B: Backend>(
    policy: Precision,
    inputs: Vec<B::FloatTensorPrimitive>,
    op: &dyn Fn(Vec<B::FloatTensorPrimitive>) -> B::FloatTensorPrimitive,
) -> B::FloatTensorPrimitive {
    if policy.compute == FloatDType::F32 {
        return op(inputs);
    }
    let inputs = inputs
        .into_iter()
        .map(|t| narrow::<B>(t, policy.compute))
        .collect();
    op(inputs)
}

/// The dtype two float operands meet in: the wider (PyTorch's type promotion: f32 over f16
/// and bf16, f64 over all; f16 with bf16 in f32).
pub(crate) fn promoted(a: DType, b: DType) -> DType {
    fn rank(d: DType) -> u8 {
        match d {
            DType::F64 => 3,
            DType::F32 | DType::Flex32 => 2,
            _ => 1,
        }
    }
    match (a, b) {
        _ if a == b => a,
        _ if rank(a) == rank(b) => DType::F32,
        _ if rank(a) > rank(b) => a,
        _ => b,
    }
}

/// Float operands cast to the dtype they meet in (see [`promoted`]) when they differ: a
/// compute-dtype activation meets an f32 one (a residual connection, a mask) in f32.
pub(crate) fn promote<B: Backend>(
    inputs: Vec<B::FloatTensorPrimitive>,
) -> Vec<B::FloatTensorPrimitive> {
    let Some(first) = inputs.first().map(|t| t.dtype()) else {
        return inputs;
    };
    if inputs.iter().all(|t| t.dtype() == first) {
        return inputs;
    }
    let to = inputs.iter().fold(first, |d, t| promoted(d, t.dtype()));
    inputs.into_iter().map(|t| widen::<B>(t, to)).collect()
}

/// Two float operands cast to the dtype they meet in.
pub(crate) fn promote2<B: Backend>(
    a: B::FloatTensorPrimitive,
    b: B::FloatTensorPrimitive,
) -> (B::FloatTensorPrimitive, B::FloatTensorPrimitive) {
    if a.dtype() == b.dtype() {
        return (a, b);
    }
    let to = promoted(a.dtype(), b.dtype());
    (widen::<B>(a, to), widen::<B>(b, to))
}
