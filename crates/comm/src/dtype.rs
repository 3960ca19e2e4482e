//! Element types a collective can carry, and the reduction kernels over them.
//!
//! Collectives are type-erased at the trait boundary ([`BufRef`], [`BufMut`]) so that
//! [`ProcessGroup`](crate::ProcessGroup) stays object safe; the algorithms are generic over
//! [`Element`] and dispatch once per call.

use half::{bf16, f16};
use std::fmt;

/// The element type of a communication buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// IEEE-754 single precision.
    F32,
    /// IEEE-754 half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 64-bit integer.
    I64,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
            DType::I64 => 3,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::BF16,
            3 => DType::I64,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
        })
    }
}

/// How an all-reduce or reduce-scatter combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
    /// Elementwise mean over the group (integer division for `i64`).
    Avg,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
}

impl ReduceOp {
    pub(crate) fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
    }
}

/// An element type the collectives carry: `f32`, `f16`, `bf16` or `i64`.
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Wraps a slice in the type-erased buffer.
    fn buf(slice: &[Self]) -> BufRef<'_>;
    /// Wraps a mutable slice in the type-erased buffer.
    fn buf_mut(slice: &mut [Self]) -> BufMut<'_>;
    /// `a op b`; `Avg` accumulates like `Sum` (the division happens once, in [`Element::div`]).
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self;
    /// Divides by the group size, for `Avg`.
    fn div(self, n: usize) -> Self;
    /// Converts from `f64`, for tests and benchmarks.
    fn from_f64(v: f64) -> Self;
}

fn combine_f32(a: f32, b: f32, op: ReduceOp) -> f32 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Max => a.max(b),
        ReduceOp::Min => a.min(b),
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn buf(slice: &[Self]) -> BufRef<'_> {
        BufRef::F32(slice)
    }
    fn buf_mut(slice: &mut [Self]) -> BufMut<'_> {
        BufMut::F32(slice)
    }
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
        combine_f32(a, b, op)
    }
    fn div(self, n: usize) -> Self {
        self / n as f32
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

// Half types combine in f32 and round once per combination, as NCCL does for its
// half-precision reductions.
macro_rules! half_element {
    ($t:ty, $variant:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            fn buf(slice: &[Self]) -> BufRef<'_> {
                BufRef::$variant(slice)
            }
            fn buf_mut(slice: &mut [Self]) -> BufMut<'_> {
                BufMut::$variant(slice)
            }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                <$t>::from_f32(combine_f32(a.to_f32(), b.to_f32(), op))
            }
            fn div(self, n: usize) -> Self {
                <$t>::from_f32(self.to_f32() / n as f32)
            }
            fn from_f64(v: f64) -> Self {
                <$t>::from_f64(v)
            }
        }
    };
}
half_element!(f16, F16);
half_element!(bf16, BF16);

impl Element for i64 {
    const DTYPE: DType = DType::I64;
    fn buf(slice: &[Self]) -> BufRef<'_> {
        BufRef::I64(slice)
    }
    fn buf_mut(slice: &mut [Self]) -> BufMut<'_> {
        BufMut::I64(slice)
    }
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::Min => a.min(b),
        }
    }
    fn div(self, n: usize) -> Self {
        self / n as i64
    }
    fn from_f64(v: f64) -> Self {
        v as i64
    }
}

/// A read-only communication buffer of one of the supported element types.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum BufRef<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
    /// bf16 elements.
    BF16(&'a [bf16]),
    /// i64 elements.
    I64(&'a [i64]),
    /// A buffer of `len` elements of `dtype` that exist only as a size: what a job simulated
    /// on shapes (`kiln plan`) hands a simulated group, which counts it. Real groups refuse
    /// it.
    Shape {
        /// The element type.
        dtype: DType,
        /// Number of elements.
        len: usize,
    },
}

/// A writable communication buffer of one of the supported element types.
#[derive(Debug)]
#[non_exhaustive]
pub enum BufMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// f16 elements.
    F16(&'a mut [f16]),
    /// bf16 elements.
    BF16(&'a mut [bf16]),
    /// i64 elements.
    I64(&'a mut [i64]),
    /// A buffer that exists only as a size (see [`BufRef::Shape`]).
    Shape {
        /// The element type.
        dtype: DType,
        /// Number of elements.
        len: usize,
    },
}

impl BufRef<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            BufRef::F32(_) => DType::F32,
            BufRef::F16(_) => DType::F16,
            BufRef::BF16(_) => DType::BF16,
            BufRef::I64(_) => DType::I64,
            BufRef::Shape { dtype, .. } => *dtype,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            BufRef::F32(s) => s.len(),
            BufRef::F16(s) => s.len(),
            BufRef::BF16(s) => s.len(),
            BufRef::I64(s) => s.len(),
            BufRef::Shape { len, .. } => *len,
        }
    }
    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The raw bytes (none for a [`BufRef::Shape`]).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            BufRef::F32(s) => bytemuck::cast_slice(s),
            BufRef::F16(s) => bytemuck::cast_slice(s),
            BufRef::BF16(s) => bytemuck::cast_slice(s),
            BufRef::I64(s) => bytemuck::cast_slice(s),
            BufRef::Shape { .. } => &[],
        }
    }
    /// Whether the buffer exists only as a size ([`BufRef::Shape`]).
    pub fn is_shape(&self) -> bool {
        matches!(self, BufRef::Shape { .. })
    }
    /// Bytes of the payload (the size of a [`BufRef::Shape`]).
    pub fn byte_len(&self) -> usize {
        self.len() * self.dtype().size()
    }
}

impl BufMut<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            BufMut::F32(_) => DType::F32,
            BufMut::F16(_) => DType::F16,
            BufMut::BF16(_) => DType::BF16,
            BufMut::I64(_) => DType::I64,
            BufMut::Shape { dtype, .. } => *dtype,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            BufMut::F32(s) => s.len(),
            BufMut::F16(s) => s.len(),
            BufMut::BF16(s) => s.len(),
            BufMut::I64(s) => s.len(),
            BufMut::Shape { len, .. } => *len,
        }
    }
    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The raw bytes, writable (none for a [`BufMut::Shape`]).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            BufMut::F32(s) => bytemuck::cast_slice_mut(s),
            BufMut::F16(s) => bytemuck::cast_slice_mut(s),
            BufMut::BF16(s) => bytemuck::cast_slice_mut(s),
            BufMut::I64(s) => bytemuck::cast_slice_mut(s),
            BufMut::Shape { .. } => &mut [],
        }
    }
    /// Whether the buffer exists only as a size ([`BufMut::Shape`]).
    pub fn is_shape(&self) -> bool {
        matches!(self, BufMut::Shape { .. })
    }
    /// Bytes of the payload (the size of a [`BufMut::Shape`]).
    pub fn byte_len(&self) -> usize {
        self.len() * self.dtype().size()
    }
}

/// An owned communication buffer: a copy of a [`BufRef`] that outlives the call that made it
/// (a send queued by an [`Outbox`](crate::Outbox)).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum OwnedBuf {
    /// f32 elements.
    F32(Vec<f32>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// i64 elements.
    I64(Vec<i64>),
}

impl OwnedBuf {
    /// The elements as a send's input.
    pub fn buf(&self) -> BufRef<'_> {
        match self {
            OwnedBuf::F32(v) => BufRef::F32(v),
            OwnedBuf::F16(v) => BufRef::F16(v),
            OwnedBuf::BF16(v) => BufRef::BF16(v),
            OwnedBuf::I64(v) => BufRef::I64(v),
        }
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.buf().dtype()
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.buf().len()
    }
    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies the elements into `out`; `false` (and `out` untouched) if the element type or
    /// the length differs.
    pub fn copy_to(&self, out: &mut BufMut<'_>) -> bool {
        match (self, out) {
            (OwnedBuf::F32(v), BufMut::F32(o)) if v.len() == o.len() => o.copy_from_slice(v),
            (OwnedBuf::F16(v), BufMut::F16(o)) if v.len() == o.len() => o.copy_from_slice(v),
            (OwnedBuf::BF16(v), BufMut::BF16(o)) if v.len() == o.len() => o.copy_from_slice(v),
            (OwnedBuf::I64(v), BufMut::I64(o)) if v.len() == o.len() => o.copy_from_slice(v),
            _ => return false,
        }
        true
    }
}

impl BufRef<'_> {
    /// A copy of the elements.
    pub fn to_owned_buf(&self) -> OwnedBuf {
        match *self {
            BufRef::F32(s) => OwnedBuf::F32(s.to_vec()),
            BufRef::F16(s) => OwnedBuf::F16(s.to_vec()),
            BufRef::BF16(s) => OwnedBuf::BF16(s.to_vec()),
            BufRef::I64(s) => OwnedBuf::I64(s.to_vec()),
            BufRef::Shape { .. } => panic!(
                "kiln: a shape-only buffer has no elements to copy (real groups refuse them)"
            ),
        }
    }
}

/// Views received bytes as elements, copying only if the allocation is misaligned.
pub(crate) fn bytes_as<T: Element>(bytes: &[u8]) -> std::borrow::Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(s) => std::borrow::Cow::Borrowed(s),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

/// `acc[i] = acc[i] op other[i]`.
pub(crate) fn reduce_into<T: Element>(acc: &mut [T], other: &[T], op: ReduceOp) {
    debug_assert_eq!(acc.len(), other.len());
    for (a, b) in acc.iter_mut().zip(other) {
        *a = T::combine(*a, *b, op);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_types_combine_in_f32() {
        let a = bf16::from_f32(1.0);
        let b = bf16::from_f32(2.0);
        assert_eq!(bf16::combine(a, b, ReduceOp::Sum).to_f32(), 3.0);
        assert_eq!(f16::combine(f16::ONE, f16::ZERO, ReduceOp::Min), f16::ZERO);
        assert_eq!(f16::from_f32(6.0).div(3).to_f32(), 2.0);
    }

    #[test]
    fn integer_avg_truncates() {
        assert_eq!(7i64.div(2), 3);
        assert_eq!(i64::combine(-3, 5, ReduceOp::Max), 5);
    }

    #[test]
    fn dtype_codes_round_trip() {
        for d in [DType::F32, DType::F16, DType::BF16, DType::I64] {
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!(DType::from_code(9), None);
    }
}
