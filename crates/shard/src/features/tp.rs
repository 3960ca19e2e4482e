//! Tensor parallelism: a tensor split along one dimension over the tensor-parallel group
//! ([`Placed`]), and the rules by which ops keep it split (DTensor's placements, on kiln's
//! tensors, under a model never written for it).
//!
//! A [`Placed`] tensor holds this rank's part of a logical tensor split along `dim`: the
//! dimension is `blocks` blocks, each cut in `t` equal chunks, and rank `r` holds chunk `r` of
//! every block (`blocks = 1` is the plain split; GPT-2's fused `c_attn` is three blocks, q, k
//! and v, so that each rank holds whole heads of each). Replicated tensors are plain `Local`
//! tensors. A partial sum never escapes an op: the ops that make one (a row-parallel `linear`,
//! a column-parallel `linear`'s input gradient, a matmul contracting the split dimension)
//! all-reduce it at once, which is where Megatron's `g` (forward) and `f` (backward) put their
//! all-reduces — 2 forward and 2 backward per transformer block.
//!
//! Rules: elementwise ops and ops along another dimension run on the part; binary ops with a
//! replicated operand slice it to the part (no communication; a dimension of size 1
//! broadcasts); layout ops follow the split (a reshape that keeps it whole per chunk, a
//! permutation, a slice of whole blocks); `matmul` keeps a batch split or a row/column split,
//! and contracts a split inner dimension with one all-reduce; `linear` and its gradients follow
//! Megatron's column and row split. An op without a rule forms the whole tensor (an all-gather):
//! always correct, counted per op name in [`stats`], so a missing rule is visible.

use crate::core::dtype::promote2;
use crate::core::host::{collective_failed, read_host, slice_local, write_host};
use crate::core::ops::custom::{float_is_require_grad, linear_prims, weight_grad_prims};
use crate::core::ops::policy::binary;
use crate::core::ops::policy::current_op;
use crate::core::ops::{local, unary};
use crate::core::scope::{self, MemKind, waiting, with_kind};
use crate::core::tensor::{
    Binary, Deferred, Elementwise, LinearArgs, Part, Prim, ShardTensor, ViewOp, same_group,
};
use burn_backend::{Backend, DType, TensorMetadata};
use burn_std::{Shape, Slice};
use kiln_comm::{ProcessGroup, ReduceOp};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

/// How a tensor is split over the tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// The dimension split.
    pub dim: usize,
    /// Blocks of the dimension, each cut in one chunk per rank (1: a plain split).
    pub blocks: usize,
}

/// This rank's part of a tensor split over the tensor-parallel group.
#[derive(Debug, Clone)]
pub struct Placed<B: Backend> {
    /// This rank's part: whole (`Local`), or itself sharded over the data-parallel group
    /// (`Sharded`: a parameter under ZeRO-3, gathered on use).
    store: ShardTensor<B>,
    shape: Shape,
    split: Split,
    group: Arc<dyn ProcessGroup>,
    /// A weight under sequence parallelism: a row-parallel layer's output is reduce-scattered
    /// along the sequence instead of all-reduced, a column-parallel layer's input gradient
    /// likewise (Megatron's sequence parallelism).
    sequence: bool,
}

/// Tensor-parallel communication of this thread (the rank computing) since the last
/// [`reset_stats`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TpStats {
    /// All-reduces of partial sums (row-parallel outputs, column-parallel input gradients,
    /// contractions of a split dimension).
    pub all_reduces: usize,
    /// Bytes this rank contributed to them.
    pub all_reduce_bytes: usize,
    /// Split tensors formed whole (all-gathered) by ops without a rule, by op name.
    pub gathers: BTreeMap<&'static str, usize>,
    /// Bytes this rank received for them.
    pub gather_bytes: usize,
    /// Sequence parallelism's all-gathers (a column-parallel layer's input, a row-parallel
    /// layer's output gradient, and the input again for a weight's gradient).
    pub all_gathers: usize,
    /// Bytes this rank received for them.
    pub all_gather_bytes: usize,
    /// Sequence parallelism's reduce-scatters (a row-parallel layer's output, a
    /// column-parallel layer's input gradient).
    pub reduce_scatters: usize,
    /// Bytes this rank contributed to them.
    pub reduce_scatter_bytes: usize,
}

impl TpStats {
    /// Split tensors formed whole, all ops together.
    pub fn total_gathers(&self) -> usize {
        self.gathers.values().sum()
    }
}

thread_local! {
    static STATS: RefCell<TpStats> = RefCell::new(TpStats::default());
}

thread_local! {
    /// One gathered part kept for its next use (see `Placed::gathered_input`): the part (held,
    /// so that its identity cannot be reused) and the whole tensor.
    static KEPT: RefCell<Option<Box<dyn std::any::Any>>> = const { RefCell::new(None) };
}

/// The kept whole tensor of `p`, if `p` is the part kept.
fn take_kept<B: Backend>(p: &Arc<Placed<B>>) -> Option<Prim<B>> {
    KEPT.with(|k| {
        let k = k.borrow();
        let (kept, whole) = k.as_ref()?.downcast_ref::<(Arc<Placed<B>>, Prim<B>)>()?;
        Arc::ptr_eq(kept, p).then(|| whole.clone())
    })
}

/// Drops the whole tensor kept for reuse (kiln's step does at its end).
pub fn release_kept() {
    KEPT.with(|k| *k.borrow_mut() = None);
}

/// This thread's tensor-parallel communication since the last [`reset_stats`].
pub fn stats() -> TpStats {
    STATS.with(|s| s.borrow().clone())
}

/// Starts counting anew (and drops the whole tensor kept for reuse).
pub fn reset_stats() {
    release_kept();
    STATS.with(|s| *s.borrow_mut() = TpStats::default());
}

/// The part of `size` rank `rank` of `t` holds in each block: `None` unless it divides.
pub fn chunk(size: usize, split: Split, t: usize) -> Option<usize> {
    (split.blocks > 0 && t > 0 && size.is_multiple_of(split.blocks * t) && size > 0)
        .then(|| size / (split.blocks * t))
}

impl<B: Backend> Placed<B> {
    /// A split tensor from this rank's part.
    pub fn from_part(local: Prim<B>, split: Split, group: Arc<dyn ProcessGroup>) -> Self {
        Self::from_store(ShardTensor::Local(local), split, group)
    }

    /// A split tensor from this rank's part as held: whole, or sharded over another group
    /// (ZeRO-3 over the data-parallel ranks).
    pub fn from_store(store: ShardTensor<B>, split: Split, group: Arc<dyn ProcessGroup>) -> Self {
        let mut dims = store.shape().as_slice().to_vec();
        dims[split.dim] *= group.world_size();
        Placed {
            store,
            shape: Shape::from(dims),
            split,
            group,
            sequence: false,
        }
    }

    /// This rank's part, whole (gathered over the data-parallel group when it is sharded
    /// there: a parameter under ZeRO-3, on use).
    fn value_part(&self) -> Prim<B> {
        local(self.store.clone())
    }

    /// The part as held, with a layout op or new values applied to the shard when it is
    /// sharded (an optimizer's elementwise update).
    fn same_store(&self, store: ShardTensor<B>, sequence: bool) -> ShardTensor<B> {
        let p = Placed::from_store(store, self.split, self.group.clone());
        ShardTensor::Deferred(Arc::new(p.with_sequence(sequence)))
    }

    /// A weight whose layer runs sequence-parallel (see the field).
    pub fn with_sequence(mut self, sequence: bool) -> Self {
        self.sequence = sequence;
        self
    }

    /// This rank's part of the whole tensor `whole` (no communication).
    ///
    /// # Panics
    /// If the dimension does not divide into `blocks x t` chunks (plans check this first).
    pub fn from_whole(whole: Prim<B>, split: Split, group: Arc<dyn ProcessGroup>) -> Self {
        let local = part::<B>(whole, split, group.as_ref());
        Self::from_part(local, split, group)
    }

    /// A part split by `split` over this tensor's group (an op's result split otherwise).
    fn wrap(&self, local: Prim<B>, split: Split) -> ShardTensor<B> {
        let p = Placed::from_part(local, split, self.group.clone());
        ShardTensor::Deferred(Arc::new(p))
    }

    /// The dimension sequence parallelism splits in a layer's input or output of `dims`
    /// (the tokens: `[batch, seq, features]`'s seq, `[rows, features]`'s rows), when this
    /// weight's layer runs sequence-parallel and the tokens divide over the group.
    fn sequence_dim(&self, dims: &[usize]) -> Option<usize> {
        let d = dims.len().checked_sub(2)?;
        (self.sequence && dims[d].is_multiple_of(self.group.world_size())).then_some(d)
    }

    /// `x` whole if it is a part split along another dimension than its last (sequence
    /// parallelism's all-gather), `Err(x)` if it is some other deferred value. With `keep`,
    /// the whole tensor is kept until another is (one at a time, per thread) for the next calls
    /// with the same part: q, k and v reading one input gather it once, and a row-parallel
    /// layer's output gradient serves its input gradient, then its weight gradient.
    fn gathered_input(&self, x: ShardTensor<B>, keep: bool) -> Result<Prim<B>, ShardTensor<B>> {
        match replicated::<B>(x) {
            ShardTensor::Local(x) => Ok(x),
            x => match x.deferred::<Placed<B>>() {
                Some(p)
                    if p.split.dim + 1 != p.shape.num_dims()
                        && same_group(&p.group, &self.group) =>
                {
                    if let Some(whole) = take_kept::<B>(&p) {
                        return Ok(whole);
                    }
                    let whole = all_gather::<B>(&p, Why::Sequence);
                    if keep {
                        KEPT.with(|k| *k.borrow_mut() = Some(Box::new((p, whole.clone()))));
                    }
                    Ok(whole)
                }
                _ => Err(x),
            },
        }
    }

    /// A new part split as this one (a weight's new values stay a weight's: the sequence
    /// parallelism of its layer is kept).
    fn same(&self, local: Prim<B>) -> ShardTensor<B> {
        self.same_with(local, self.sequence)
    }

    fn same_with(&self, local: Prim<B>, sequence: bool) -> ShardTensor<B> {
        self.same_store(ShardTensor::Local(local), sequence)
    }

    /// The part of `other` matching this tensor's split, when `other` is a replicated tensor
    /// of the same rank broadcasting against this one (size 1 along the split dimension: used
    /// whole) or a part of a tensor split the same way.
    fn matching(&self, other: ShardTensor<B>) -> Result<Prim<B>, ShardTensor<B>> {
        let d = self.split.dim;
        match replicated::<B>(other) {
            ShardTensor::Local(o) => {
                let os = o.shape();
                if os.num_dims() != self.shape.num_dims() {
                    return Err(ShardTensor::Local(o));
                }
                if os[d] == 1 {
                    Ok(o)
                } else if os[d] == self.shape[d] {
                    Ok(part::<B>(o, self.split, self.group.as_ref()))
                } else {
                    Err(ShardTensor::Local(o))
                }
            }
            other => match other.deferred::<Placed<B>>() {
                Some(p)
                    if p.split == self.split
                        && same_group(&p.group, &self.group)
                        && p.shape.num_dims() == self.shape.num_dims()
                        && p.shape[d] == self.shape[d] =>
                {
                    Ok(p.value_part())
                }
                _ => Err(other),
            },
        }
    }

    /// [`matching`](Self::matching) as held: a split tensor's part as it holds it (whole or
    /// sharded over the data-parallel group).
    fn matching_store(&self, other: ShardTensor<B>) -> Result<ShardTensor<B>, ShardTensor<B>> {
        match other.deferred::<Placed<B>>() {
            Some(p)
                if p.split == self.split
                    && same_group(&p.group, &self.group)
                    && p.shape.num_dims() == self.shape.num_dims()
                    && p.shape[self.split.dim] == self.shape[self.split.dim] =>
            {
                Ok(p.store.clone())
            }
            _ => self.matching(other).map(ShardTensor::Local),
        }
    }

    /// The sum over the group of this rank's partial `t`: one all-reduce.
    fn reduce(&self, t: Prim<B>) -> Prim<B> {
        all_reduce::<B>(t, self.group.as_ref())
    }
}

/// `t` as a replicated tensor when it is another feature's deferred value standing for a whole
/// one (an activation under kiln's rematerialisation, formed or recomputed here, as any op
/// would); split parts, pending sums and shards unchanged.
fn replicated<B: Backend>(t: ShardTensor<B>) -> ShardTensor<B> {
    match &t {
        ShardTensor::Deferred(d)
            if !d.is_sharded() && d.part().is_none() && t.deferred::<Partial<B>>().is_none() =>
        {
            ShardTensor::Local(t.into_whole())
        }
        _ => t,
    }
}

/// Rank `group.rank()`'s part of the whole `t` split by `split` (no communication).
///
/// # Panics
/// If the dimension does not divide into `blocks x` the group's size.
pub fn part_of<B: Backend>(t: Prim<B>, split: Split, group: &dyn ProcessGroup) -> Prim<B> {
    part::<B>(t, split, group)
}

/// Rank `group.rank()`'s part of the whole `t`.
fn part<B: Backend>(t: Prim<B>, split: Split, group: &dyn ProcessGroup) -> Prim<B> {
    let (n, rank) = (group.world_size(), group.rank());
    let dims = t.shape().as_slice().to_vec();
    let d = split.dim;
    let c = chunk(dims[d], split, n).unwrap_or_else(|| {
        panic!(
            "kiln: tensor parallelism: dimension {d} of a tensor of shape {dims:?} does not split \
             into {} block(s) x {n} ranks",
            split.blocks
        )
    });
    if split.blocks == 1 {
        let mut s: Vec<Slice> = dims.iter().map(|&m| Slice::from(0..m)).collect();
        s[d] = Slice::from(rank * c..(rank + 1) * c);
        return B::float_slice(t, &s);
    }
    let (blocked, slices, out) = part_plan(&dims, split, c, n, rank);
    let t = B::float_slice(B::float_reshape(t, blocked), &slices);
    B::float_reshape(t, out)
}

/// How a rank's part is cut from a tensor of `dims` split in blocks: `[.., k * n * c, ..]`
/// viewed as `[.., k, n, c, ..]`, the slice taking `rank` along `n`, and the part's shape
/// `[.., k * c, ..]`.
fn part_plan(
    dims: &[usize],
    split: Split,
    c: usize,
    n: usize,
    rank: usize,
) -> (Shape, Vec<Slice>, Shape) {
    let d = split.dim;
    let mut blocked = dims[..d].to_vec();
    blocked.extend([split.blocks, n, c]);
    blocked.extend(&dims[d + 1..]);
    let mut slices: Vec<Slice> = blocked.iter().map(|&m| Slice::from(0..m)).collect();
    slices[d + 1] = Slice::from(rank..rank + 1);
    let mut out = dims.to_vec();
    out[d] = split.blocks * c;
    (Shape::from(blocked), slices, Shape::from(out))
}

/// Why a split tensor is formed whole.
#[derive(Debug, Clone, Copy)]
enum Why {
    /// An op without a rule (counted by its name).
    NoRule,
    /// Sequence parallelism's all-gather.
    Sequence,
}

/// Indices into a dimension split in plain chunks, as this rank's: the local index (clamped
/// into its chunk) and, as floats of `dtype`, 1 where the index is this rank's and 0 elsewhere.
fn own_indices<B: Backend>(
    indices: <B as burn_backend::BackendTypes>::IntTensorPrimitive,
    chunk: usize,
    rank: usize,
    dtype: DType,
) -> (
    <B as burn_backend::BackendTypes>::IntTensorPrimitive,
    Prim<B>,
) {
    let (start, end) = ((rank * chunk) as f64, ((rank + 1) * chunk) as f64);
    let local = B::int_sub_scalar(indices.clone(), ((rank * chunk) as i64).into());
    let local = B::int_clamp(local, 0i64.into(), (chunk as i64 - 1).into());
    // For integers: 1 where start <= i < end, from clamps alone.
    let f = B::int_into_float(indices, dtype.into());
    let above = B::float_clamp(
        B::float_add_scalar(f.clone(), (1.0 - start).into()),
        0f64.into(),
        1f64.into(),
    );
    let below = B::float_clamp(
        B::float_mul_scalar(B::float_sub_scalar(f, end.into()), (-1f64).into()),
        0f64.into(),
        1f64.into(),
    );
    (local, B::float_mul(above, below))
}

/// Rank `group.rank()`'s part of the whole integer tensor `t` (indices), as [`part`].
fn part_int<B: Backend>(
    t: <B as burn_backend::BackendTypes>::IntTensorPrimitive,
    split: Split,
    group: &dyn ProcessGroup,
) -> <B as burn_backend::BackendTypes>::IntTensorPrimitive {
    let (n, rank) = (group.world_size(), group.rank());
    let dims = t.shape().as_slice().to_vec();
    let c = dims[split.dim] / (split.blocks * n);
    let (blocked, slices, out) = part_plan(&dims, split, c, n, rank);
    B::int_reshape(B::int_slice(B::int_reshape(t, blocked), &slices), out)
}

/// The whole tensor from every rank's part: one all-gather.
fn all_gather<B: Backend>(p: &Placed<B>, why: Why) -> Prim<B> {
    let group = p.group.as_ref();
    let n = group.world_size();
    let dims = p.store.shape().as_slice().to_vec();
    let d = p.split.dim;
    let (k, c) = (p.split.blocks, dims[d] / p.split.blocks);
    let rest: Vec<usize> = (0..dims.len()).filter(|&i| i != d).collect();
    // The split dimension first, as [k, c, rest..], contiguous, so each rank's part is one run.
    let mut axes = vec![d];
    axes.extend(&rest);
    let front = B::float_permute(p.value_part(), &axes);
    let rest_dims: Vec<usize> = rest.iter().map(|&i| dims[i]).collect();
    let numel = p.store.shape().num_elements();
    let device = p.store.device();
    let dtype = p.store.dtype();
    let host = with_kind(MemKind::Comm, || {
        read_host::<B>(B::float_reshape(front, Shape::from(vec![numel])))
    });
    let mut full = with_kind(MemKind::Comm, || host.zeros(numel * n));
    waiting(|| group.all_gather(host.buf(), full.buf_mut()))
        .unwrap_or_else(|e| collective_failed("all-gather", &p.shape, group, e));
    if std::env::var("KILN_TP_DEBUG").is_ok() {
        eprintln!(
            "tp gather at {} of {:?} split {:?}\n{}",
            current_op(),
            p.shape,
            p.split,
            std::backtrace::Backtrace::force_capture()
        );
    }
    STATS.with(|s| {
        let mut s = s.borrow_mut();
        let bytes = numel * (n - 1) * dtype.size();
        match why {
            Why::NoRule => {
                *s.gathers.entry(current_op()).or_default() += 1;
                s.gather_bytes += bytes;
            }
            Why::Sequence => {
                s.all_gathers += 1;
                s.all_gather_bytes += bytes;
            }
        }
    });
    // [n, k, c, rest..] -> [k, n, c, rest..] -> [k n c, rest..] -> the original order.
    let mut gathered = vec![n, k, c];
    gathered.extend(&rest_dims);
    let whole = write_host::<B>(full, Shape::from(gathered), &device, dtype);
    let whole = B::float_swap_dims(whole, 0, 1);
    let mut merged = vec![n * k * c];
    merged.extend(&rest_dims);
    let whole = B::float_reshape(whole, Shape::from(merged));
    // Back: the split dimension from the front to `d`.
    let mut back: Vec<usize> = (1..dims.len()).collect();
    back.insert(d, 0);
    B::float_permute(whole, &back)
}

/// This rank's part, split along `dim` (one chunk per rank), of the sum of every rank's `t`
/// over `group`: one reduce-scatter.
fn reduce_scatter<B: Backend>(t: Prim<B>, dim: usize, group: &dyn ProcessGroup) -> Prim<B> {
    let n = group.world_size();
    let dims = t.shape().as_slice().to_vec();
    let device = B::float_device(&t);
    let dtype = t.dtype();
    // The dimension first, so that each rank's chunk is one run of the flat buffer.
    let mut axes = vec![dim];
    axes.extend((0..dims.len()).filter(|&i| i != dim));
    let front = B::float_permute(t, &axes);
    let numel = dims.iter().product::<usize>();
    let host = with_kind(MemKind::Comm, || {
        read_host::<B>(B::float_reshape(front, Shape::from(vec![numel])))
    });
    let mut mine = with_kind(MemKind::Comm, || host.zeros(numel / n));
    waiting(|| group.reduce_scatter(host.buf(), mine.buf_mut(), ReduceOp::Sum)).unwrap_or_else(
        |e| collective_failed("reduce-scatter", &Shape::from(dims.clone()), group, e),
    );
    STATS.with(|s| {
        let mut s = s.borrow_mut();
        s.reduce_scatters += 1;
        s.reduce_scatter_bytes += numel * dtype.size();
    });
    let mut part: Vec<usize> = axes.iter().map(|&a| dims[a]).collect();
    part[0] /= n;
    let t = write_host::<B>(mine, Shape::from(part), &device, dtype);
    let mut back: Vec<usize> = (1..dims.len()).collect();
    back.insert(dim, 0);
    B::float_permute(t, &back)
}

/// The sum of every rank's `t` over `group`.
fn all_reduce<B: Backend>(t: Prim<B>, group: &dyn ProcessGroup) -> Prim<B> {
    all_reduce_op::<B>(t, group, ReduceOp::Sum)
}

/// `op` over every rank's `t` (a sum, or the maximum of a vocabulary-split row).
fn all_reduce_op<B: Backend>(t: Prim<B>, group: &dyn ProcessGroup, op: ReduceOp) -> Prim<B> {
    let shape = t.shape();
    let device = B::float_device(&t);
    let dtype = t.dtype();
    let mut host = with_kind(MemKind::Comm, || read_host::<B>(t));
    waiting(|| group.all_reduce(host.buf_mut(), op))
        .unwrap_or_else(|e| collective_failed("all-reduce", &shape, group, e));
    STATS.with(|s| {
        let mut s = s.borrow_mut();
        s.all_reduces += 1;
        s.all_reduce_bytes += shape.num_elements() * dtype.size();
    });
    write_host::<B>(host, shape, &device, dtype)
}

/// The split a reshape of `old` into `new` gives a tensor split by `split` over `n` ranks, if
/// every rank's chunk stays a run of whole indices of one new dimension.
fn reshaped(old: &[usize], new: &[usize], split: Split, n: usize) -> Option<Split> {
    let d = split.dim;
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        let (i0, j0) = (i, j);
        let (mut pi, mut pj) = (1usize, 1usize);
        if i < old.len() {
            pi *= old[i];
            i += 1;
        }
        if j < new.len() {
            pj *= new[j];
            j += 1;
        }
        while pi != pj {
            if pi < pj {
                pi *= *old.get(i)?;
                i += 1;
            } else {
                pj *= *new.get(j)?;
                j += 1;
            }
        }
        if !(i0..i).contains(&d) {
            continue;
        }
        // Within the group's flattened index space the split is `K` blocks of `n` chunks of `C`
        // elements (the group's dimensions before the split one multiply the blocks); it lands
        // on the new dimension `e` whose outer dimensions divide the blocks and whose inner
        // ones divide a chunk.
        let blocks = split.blocks * old[i0..d].iter().product::<usize>();
        let c = chunk(old[d], split, n)? * old[d + 1..i].iter().product::<usize>();
        return (j0..j).filter(|&e| new[e] != 1).find_map(|e| {
            let outer: usize = new[j0..e].iter().product();
            let inner: usize = new[e + 1..j].iter().product();
            let fits = blocks.is_multiple_of(outer)
                && c.is_multiple_of(inner)
                && new[e] == blocks / outer * n * (c / inner);
            fits.then_some(Split {
                dim: e,
                blocks: blocks / outer,
            })
        });
    }
    None
}

impl<B: Backend> Placed<B> {
    fn view(&self, op: &ViewOp) -> Option<ShardTensor<B>> {
        let d = self.split.dim;
        let n = self.group.world_size();
        let dims = self.shape.as_slice();
        let local_dims = self.store.shape().as_slice().to_vec();
        match op {
            ViewOp::SwapDims(a, b) => {
                let dim = if d == *a {
                    *b
                } else if d == *b {
                    *a
                } else {
                    d
                };
                let t = B::float_swap_dims(self.value_part(), *a, *b);
                Some(self.wrap(t, Split { dim, ..self.split }))
            }
            ViewOp::Permute(axes) => {
                let dim = axes.iter().position(|&a| a == d)?;
                let t = B::float_permute(self.value_part(), axes);
                Some(self.wrap(t, Split { dim, ..self.split }))
            }
            ViewOp::Reshape(shape) => {
                let split = reshaped(dims, shape.as_slice(), self.split, n)?;
                let mut local = shape.as_slice().to_vec();
                local[split.dim] /= n;
                let t = B::float_reshape(self.value_part(), Shape::from(local));
                Some(self.wrap(t, split))
            }
            ViewOp::Expand(shape) => {
                let off = shape.num_dims().checked_sub(dims.len())?;
                if shape[d + off] != dims[d] {
                    return None;
                }
                let mut local = shape.as_slice().to_vec();
                local[d + off] = local_dims[d];
                let t = B::float_expand(self.value_part(), Shape::from(local));
                Some(self.wrap(
                    t,
                    Split {
                        dim: d + off,
                        ..self.split
                    },
                ))
            }
            ViewOp::Slice(slices) => {
                let mut local: Vec<Slice> = (0..dims.len())
                    .map(|i| slices.get(i).cloned().unwrap_or(Slice::from(0..dims[i])))
                    .collect();
                let s = &local[d];
                let range = s.to_range(dims[d]);
                let mut split = self.split;
                if s.step() != 1 {
                    return None;
                }
                if range == (0..dims[d]) {
                    local[d] = Slice::from(0..local_dims[d]);
                } else {
                    // Whole blocks only.
                    let block = dims[d] / self.split.blocks;
                    if !range.start.is_multiple_of(block)
                        || !range.end.is_multiple_of(block)
                        || range.is_empty()
                    {
                        return None;
                    }
                    let c = local_dims[d] / self.split.blocks;
                    let (b0, b1) = (range.start / block, range.end / block);
                    local[d] = Slice::from(b0 * c..b1 * c);
                    split.blocks = b1 - b0;
                }
                let t = B::float_slice(self.value_part(), &local);
                Some(self.wrap(t, split))
            }
        }
    }
}

fn policy() -> crate::core::dtype::Precision {
    scope::precision()
}

impl<B: Backend> Deferred<B> for Placed<B> {
    fn shape(&self) -> Shape {
        self.shape.clone()
    }
    fn dtype(&self) -> DType {
        self.store.dtype()
    }
    fn device(&self) -> B::Device {
        self.store.device()
    }
    fn value(&self) -> Prim<B> {
        all_gather(self, Why::NoRule)
    }
    fn held_bytes(&self) -> usize {
        self.store.local_bytes()
    }
    fn is_require_grad(&self) -> bool {
        float_is_require_grad::<B>(&self.store)
    }
    fn elementwise(&self, f: &Elementwise<B>) -> Option<ShardTensor<B>> {
        Some(match &self.store {
            ShardTensor::Local(t) => self.same(f(t.clone())),
            // A part sharded over the data-parallel group: shard by shard.
            store => {
                let f = f.clone();
                self.same_store(unary(store.clone(), move |t| f(t)), self.sequence)
            }
        })
    }
    fn sum(&self) -> Option<ShardTensor<B>> {
        // Each rank's sum of its part: a pending sum (one scalar all-reduced when read).
        Some(Partial::wrap(
            B::float_sum(self.value_part()),
            self.group.clone(),
        ))
    }
    fn part(&self) -> Option<Part<B>> {
        let (split, group, sequence) = (self.split, self.group.clone(), self.sequence);
        let g = group.clone();
        // A part sharded over the data-parallel group is sharded again when made from a whole
        // tensor (weights read from a snapshot), as it was.
        let sharded = match &self.store {
            ShardTensor::Sharded(s) => Some((s.group.clone(), s.ops.derived())),
            _ => None,
        };
        Some(Part {
            local: self.store.clone(),
            group: self.group.clone(),
            rewrap: Arc::new(move |store| {
                let p = Placed::from_store(store, split, group.clone());
                ShardTensor::Deferred(Arc::new(p.with_sequence(sequence)))
            }),
            of_whole: Arc::new(move |whole| {
                let part = part::<B>(whole, split, g.as_ref());
                let store = match &sharded {
                    Some((dp, ops)) => {
                        ShardTensor::Sharded(slice_local::<B>(part, dp, ops.clone()))
                    }
                    None => ShardTensor::Local(part),
                };
                let p = Placed::from_store(store, split, g.clone());
                ShardTensor::Deferred(Arc::new(p.with_sequence(sequence)))
            }),
        })
    }
    fn layout(&self, op: &ViewOp) -> Option<ShardTensor<B>> {
        self.view(op)
    }
    fn along(&self, dim: usize, f: &Elementwise<B>) -> Option<ShardTensor<B>> {
        if dim != self.split.dim {
            return Some(self.same(f(self.value_part())));
        }
        // Along the split dimension: a sum's terms are every rank's (a pending sum); a maximum
        // or minimum is every rank's, reduced (a vocabulary-split row's, for its softmax).
        let op = match current_op() {
            "float_sum_dim" => None,
            "float_max_dim" => Some(ReduceOp::Max),
            "float_min_dim" => Some(ReduceOp::Min),
            _ => return None,
        };
        let local = f(self.value_part());
        Some(match op {
            None => Partial::wrap(local, self.group.clone()),
            Some(op) => ShardTensor::Local(all_reduce_op::<B>(local, self.group.as_ref(), op)),
        })
    }
    fn binary(
        self: Arc<Self>,
        other: ShardTensor<B>,
        self_lhs: bool,
        f: &Binary<B>,
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        // An optimizer's update of a weight keeps the weight's sequence parallelism, whichever
        // operand carries it.
        let sequence = self.sequence || other.deferred::<Placed<B>>().is_some_and(|p| p.sequence);
        let other_sharded = other
            .deferred::<Placed<B>>()
            .is_some_and(|p| matches!(p.store, ShardTensor::Sharded(_)));
        if matches!(self.store, ShardTensor::Sharded(_)) || other_sharded {
            // Parts sharded over the data-parallel group (ZeRO-3 parameters and their
            // gradients, an optimizer's update): the core's shard-by-shard rules on the parts.
            let o = self.matching_store(other)?;
            let f = f.clone();
            let y = match self_lhs {
                true => binary(self.store.clone(), o, move |a, b| f(a, b)),
                false => binary(o, self.store.clone(), move |a, b| f(a, b)),
            };
            return Ok(self.same_store(y, sequence));
        }
        let o = self.matching(other)?;
        let y = if self_lhs {
            f(self.value_part(), o)
        } else {
            f(o, self.value_part())
        };
        Ok(self.same_with(y, sequence))
    }
    fn matmul(
        self: Arc<Self>,
        other: ShardTensor<B>,
        self_lhs: bool,
        f: &Binary<B>,
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        let other = replicated::<B>(other);
        let r = self.shape.num_dims();
        let d = self.split.dim;
        let run = |a: Prim<B>, b: Prim<B>| if self_lhs { f(a, b) } else { f(b, a) };
        if d + 2 < r {
            // A batch dimension: the other operand matches it (or broadcasts).
            let o = self.matching(other)?;
            return Ok(self.same(run(self.value_part(), o)));
        }
        let other_placed = other.deferred::<Placed<B>>();
        let rows = d + 2 == r;
        match (self_lhs, rows, other) {
            // lhs split by rows or rhs split by columns, the other operand replicated.
            (true, true, ShardTensor::Local(o)) | (false, false, ShardTensor::Local(o)) => {
                Ok(self.same(run(self.value_part(), o)))
            }
            // The contracted dimension split (alike on both sides): a partial sum, all-reduced.
            (true, false, other) | (false, true, other) => {
                let od = if self_lhs { r - 2 } else { r - 1 };
                let blocks = self.split.blocks;
                let o = match (&other, other_placed) {
                    (_, Some(p))
                        if p.split.dim == od
                            && p.split.blocks == blocks
                            && same_group(&p.group, &self.group) =>
                    {
                        p.value_part()
                    }
                    (ShardTensor::Local(o), None) => {
                        part::<B>(o.clone(), Split { dim: od, blocks }, self.group.as_ref())
                    }
                    _ => return Err(other),
                };
                Ok(ShardTensor::Local(self.reduce(run(self.value_part(), o))))
            }
            (_, _, other) => Err(other),
        }
    }
    fn linear(self: Arc<Self>, x: ShardTensor<B>, bias: Option<ShardTensor<B>>) -> LinearArgs<B> {
        if self.shape.num_dims() != 2 {
            return Err((x, bias));
        }
        let x = replicated::<B>(x);
        let last = x.shape().num_dims() - 1;
        if self.split.dim == 1 {
            // Column parallel: x replicated (gathered along the sequence under sequence
            // parallelism), the output split along its last dimension.
            let xl = match self.gathered_input(x, true) {
                Ok(x) => x,
                Err(x) => return Err((x, bias)),
            };
            let b = match bias {
                None => None,
                Some(ShardTensor::Local(b)) => Some(part::<B>(
                    b,
                    Split {
                        dim: 0,
                        blocks: self.split.blocks,
                    },
                    self.group.as_ref(),
                )),
                Some(b) => match b.deferred::<Placed<B>>() {
                    Some(p) if p.split.blocks == self.split.blocks => Some(p.value_part()),
                    _ => return Err((ShardTensor::Local(xl), Some(b))),
                },
            };
            let mut inputs = vec![xl, self.value_part()];
            inputs.extend(b);
            let y = linear_prims::<B>(policy(), inputs);
            return Ok(self.wrap(
                y,
                Split {
                    dim: last,
                    blocks: self.split.blocks,
                },
            ));
        }
        // Row parallel: x split along its last dimension (or sliced to this rank's part), a
        // partial output all-reduced, then the bias.
        let row = Split {
            dim: last,
            blocks: 1,
        };
        if self.split.blocks != 1 {
            return Err((x, bias));
        }
        let xl = match x {
            ShardTensor::Local(x) => part::<B>(x, row, self.group.as_ref()),
            x => match x.deferred::<Placed<B>>() {
                Some(p) if p.split == row && same_group(&p.group, &self.group) => p.value_part(),
                _ => return Err((x, bias)),
            },
        };
        let b = match bias {
            None => None,
            Some(ShardTensor::Local(b)) => Some(b),
            Some(b) => Some(b.into_whole()),
        };
        let y = linear_prims::<B>(policy(), vec![xl, self.value_part()]);
        let add_bias = |y: Prim<B>| match b {
            Some(b) => {
                let (y, b) = promote2::<B>(y, b);
                // Backends' ops take operands of one rank: the bias as [1, .., 1, out].
                let rank = y.shape().num_dims();
                let mut dims = vec![1; rank.saturating_sub(1)];
                dims.extend(b.shape().as_slice());
                let b = B::float_reshape(b, Shape::from(dims));
                B::float_add(y, b)
            }
            None => y,
        };
        // Under sequence parallelism the partial sums are reduce-scattered along the tokens.
        let dims = y.shape().as_slice().to_vec();
        Ok(match self.sequence_dim(&dims) {
            Some(sd) => {
                let y = reduce_scatter::<B>(y, sd, self.group.as_ref());
                self.wrap(add_bias(y), Split { dim: sd, blocks: 1 })
            }
            None => ShardTensor::Local(add_bias(self.reduce(y))),
        })
    }
    fn linear_x_backward(
        self: Arc<Self>,
        dy: ShardTensor<B>,
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        if self.shape.num_dims() != 2 {
            return Err(dy);
        }
        let dy = replicated::<B>(dy);
        let last = dy.shape().num_dims() - 1;
        let out = Split {
            dim: last,
            blocks: self.split.blocks,
        };
        if self.split.dim == 1 {
            // Column parallel: dx = dy_part w_partᵀ, a partial sum (Megatron's `f` backward).
            let dl = match dy {
                ShardTensor::Local(dy) => part::<B>(dy, out, self.group.as_ref()),
                dy => match dy.deferred::<Placed<B>>() {
                    Some(p) if p.split == out && same_group(&p.group, &self.group) => {
                        p.value_part()
                    }
                    _ => return Err(dy),
                },
            };
            let (w, dl) = promote2::<B>(self.value_part(), dl);
            let dx = B::linear_x_backward(w, dl);
            // A pending sum, reduce-scattered along the tokens under sequence parallelism (the
            // input was gathered along them).
            let dims = dx.shape().as_slice().to_vec();
            let scatter = self.sequence_dim(&dims);
            return Ok(Partial::wrap_scattered(dx, self.group.clone(), scatter));
        }
        // Row parallel: dy replicated (gathered along the sequence under sequence
        // parallelism), dx split like x.
        let dl = self.gathered_input(dy, true)?;
        let (w, dl) = promote2::<B>(self.value_part(), dl);
        Ok(self.wrap(
            B::linear_x_backward(w, dl),
            Split {
                dim: last,
                blocks: 1,
            },
        ))
    }
    fn slice_assign(
        self: Arc<Self>,
        target: ShardTensor<B>,
        slices: &[Slice],
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        // Writing a split part into a tensor (the backward of slicing whole blocks, GPT-2's
        // q, k, v out of the fused projection): the target is split in blocks of the part's
        // block size, and the part lands in its own blocks.
        let target = replicated::<B>(target);
        let d = self.split.dim;
        let dims = target.shape().as_slice().to_vec();
        if dims.len() != self.shape.num_dims() {
            return Err(target);
        }
        let mut local: Vec<Slice> = (0..dims.len())
            .map(|i| slices.get(i).cloned().unwrap_or(Slice::from(0..dims[i])))
            .collect();
        let range = local[d].to_range(dims[d]);
        let kv = self.split.blocks;
        let n = self.group.world_size();
        if local[d].step() != 1 || range.is_empty() || !range.len().is_multiple_of(kv) {
            return Err(target);
        }
        let block = range.len() / kv;
        if !dims[d].is_multiple_of(block) || !range.start.is_multiple_of(block) {
            return Err(target);
        }
        let split = Split {
            dim: d,
            blocks: dims[d] / block,
        };
        let Some(c) = chunk(dims[d], split, n) else {
            return Err(target);
        };
        let t = match target {
            ShardTensor::Local(t) => part::<B>(t, split, self.group.as_ref()),
            target => match target.deferred::<Placed<B>>() {
                Some(p) if p.split == split && same_group(&p.group, &self.group) => p.value_part(),
                _ => return Err(target),
            },
        };
        let b0 = range.start / block;
        local[d] = Slice::from(b0 * c..(b0 + kv) * c);
        let (t, v) = promote2::<B>(t, self.value_part());
        Ok(self.wrap(B::float_slice_assign(t, &local, v), split))
    }
    fn weight_grad(
        self: Arc<Self>,
        other: ShardTensor<B>,
        self_is_x: bool,
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        let last = self.shape.num_dims() - 1;
        if self.split.dim != last {
            // `x` and `dy` split alike along their tokens (a layer applied to a sequence
            // part): the gradient is the sum of every rank's.
            return match other.deferred::<Placed<B>>() {
                Some(p) if p.split == self.split && same_group(&p.group, &self.group) => {
                    let (x, dy) = match self_is_x {
                        true => (self.value_part(), p.value_part()),
                        false => (p.value_part(), self.value_part()),
                    };
                    Ok(Partial::wrap(
                        weight_grad_prims::<B>(vec![x, dy]),
                        self.group.clone(),
                    ))
                }
                _ => Err(other),
            };
        }
        // The other operand whole (gathered along the sequence under sequence parallelism).
        let o = self.gathered_input(other, true)?;
        if self_is_x {
            // Row parallel: x split by its last dimension, the gradient by rows of w.
            let g = weight_grad_prims::<B>(vec![self.value_part(), o]);
            Ok(self.wrap(
                g,
                Split {
                    dim: 0,
                    ..self.split
                },
            ))
        } else {
            // Column parallel: dy split by its last dimension, the gradient by columns of w.
            let g = weight_grad_prims::<B>(vec![o, self.value_part()]);
            Ok(self.wrap(
                g,
                Split {
                    dim: 1,
                    ..self.split
                },
            ))
        }
    }
    fn bias_grad(&self) -> Option<ShardTensor<B>> {
        let last = self.shape.num_dims() - 1;
        let g = B::linear_bias_backward(self.value_part());
        Some(match self.split.dim == last {
            true => self.wrap(
                g,
                Split {
                    dim: 0,
                    ..self.split
                },
            ),
            // Split along the tokens: every rank's sum is a term of the bias gradient.
            false => Partial::wrap(g, self.group.clone()),
        })
    }
    fn cat(&self, tensors: &[ShardTensor<B>], dim: usize) -> Option<ShardTensor<B>> {
        // Along another dimension than the split one: the parts joined (a replicated operand
        // cut to this rank's part).
        if dim == self.split.dim {
            return None;
        }
        let parts = tensors
            .iter()
            .map(|t| self.matching(t.clone()).ok())
            .collect::<Option<Vec<_>>>()?;
        // A replicated operand broadcasting along the split dimension is not a part.
        let size = self.store.shape()[self.split.dim];
        if parts.iter().any(|p| p.shape()[self.split.dim] != size) {
            return None;
        }
        Some(self.same_with(B::float_cat(parts, dim), false))
    }
    fn embed(
        &self,
        indices: &<B as burn_backend::BackendTypes>::IntTensorPrimitive,
    ) -> Option<ShardTensor<B>> {
        // A vocabulary-parallel table (rows split): this rank's rows looked up, the others'
        // zero, a pending sum (Megatron's VocabParallelEmbedding).
        if self.shape.num_dims() != 2 || self.split != (Split { dim: 0, blocks: 1 }) {
            return None;
        }
        let chunk = self.store.shape()[0];
        let (local, mask) = own_indices::<B>(
            indices.clone(),
            chunk,
            self.group.rank(),
            self.store.dtype(),
        );
        let rows = B::embedding(self.value_part(), local);
        let mut dims = mask.shape().as_slice().to_vec();
        dims.push(1);
        let mask = B::float_reshape(mask, Shape::from(dims));
        Some(Partial::wrap(B::float_mul(rows, mask), self.group.clone()))
    }
    fn embed_grad(
        &self,
        dy: &ShardTensor<B>,
        indices: &<B as burn_backend::BackendTypes>::IntTensorPrimitive,
    ) -> Option<ShardTensor<B>> {
        if self.shape.num_dims() != 2 || self.split != (Split { dim: 0, blocks: 1 }) {
            return None;
        }
        let chunk = self.store.shape()[0];
        let dy = dy.clone().into_whole();
        let (local, mask) = own_indices::<B>(indices.clone(), chunk, self.group.rank(), dy.dtype());
        let mut dims = mask.shape().as_slice().to_vec();
        dims.push(1);
        let dy = B::float_mul(dy, B::float_reshape(mask, Shape::from(dims)));
        let g = B::embedding_backward(self.value_part(), dy, local);
        Some(self.same_with(g, false))
    }
    fn take(
        &self,
        dim: usize,
        indices: &<B as burn_backend::BackendTypes>::IntTensorPrimitive,
    ) -> Option<ShardTensor<B>> {
        if indices.shape().num_dims() != self.shape.num_dims() {
            return None;
        }
        if dim == self.split.dim {
            // Gathering along the split dimension (the labels' log-probabilities of a
            // vocabulary-split head: loss parallel): this rank's hits, the others zero, a
            // pending sum.
            if self.split.blocks != 1
                || indices
                    .shape()
                    .as_slice()
                    .iter()
                    .enumerate()
                    .any(|(i, &n)| i != dim && n != self.shape[i])
            {
                return None;
            }
            let chunk = self.store.shape()[dim];
            let (local, mask) = own_indices::<B>(
                indices.clone(),
                chunk,
                self.group.rank(),
                self.store.dtype(),
            );
            let picked = B::float_gather(dim, self.value_part(), local);
            return Some(Partial::wrap(
                B::float_mul(picked, mask),
                self.group.clone(),
            ));
        }
        let idx = indices.shape();
        if idx[self.split.dim] != self.shape[self.split.dim] {
            return None;
        }
        let idx = part_int::<B>(indices.clone(), self.split, self.group.as_ref());
        Some(self.same(B::float_gather(dim, self.value_part(), idx)))
    }
}

/// A pending sum over the tensor-parallel group: this rank's term. Made by a column-parallel
/// `linear`'s input gradient, so that the gradients of layers reading one input (q, k and v)
/// are summed locally by autodiff and reduced once, when first read (Megatron's `f`): by an
/// all-reduce, or under sequence parallelism by a reduce-scatter along the tokens, the ops
/// reading it then applying to the part.
#[derive(Debug)]
pub struct Partial<B: Backend> {
    local: Prim<B>,
    group: Arc<dyn ProcessGroup>,
    /// Under sequence parallelism: the dimension the sum is reduce-scattered along.
    scatter: Option<usize>,
    sum: OnceLock<Prim<B>>,
    part: OnceLock<Arc<Placed<B>>>,
}

impl<B: Backend> Partial<B> {
    /// The pending sum of every rank's `local`.
    pub fn wrap(local: Prim<B>, group: Arc<dyn ProcessGroup>) -> ShardTensor<B> {
        Self::wrap_scattered(local, group, None)
    }

    /// The pending sum of every rank's `local`, reduced as a part along `scatter` if given.
    pub fn wrap_scattered(
        local: Prim<B>,
        group: Arc<dyn ProcessGroup>,
        scatter: Option<usize>,
    ) -> ShardTensor<B> {
        ShardTensor::Deferred(Arc::new(Partial {
            local,
            group,
            scatter,
            sum: OnceLock::new(),
            part: OnceLock::new(),
        }))
    }

    fn reduced(&self) -> bool {
        self.sum.get().is_some() || self.part.get().is_some()
    }

    /// This rank's part of the sum along the scatter dimension (one reduce-scatter, once).
    fn placed(&self) -> Option<Arc<Placed<B>>> {
        let dim = self.scatter?;
        Some(
            self.part
                .get_or_init(|| {
                    let part = reduce_scatter::<B>(self.local.clone(), dim, self.group.as_ref());
                    Arc::new(Placed::from_part(
                        part,
                        Split { dim, blocks: 1 },
                        self.group.clone(),
                    ))
                })
                .clone(),
        )
    }
}

impl<B: Backend> Deferred<B> for Partial<B> {
    fn shape(&self) -> Shape {
        self.local.shape()
    }
    fn dtype(&self) -> DType {
        self.local.dtype()
    }
    fn device(&self) -> B::Device {
        B::float_device(&self.local)
    }
    fn value(&self) -> Prim<B> {
        // Summed once, however many ops read it (every rank reads it in the same order). Layout
        // ops read it too: a view of a pending sum would be summed again where it is read.
        if let Some(p) = self.placed() {
            return p.value();
        }
        self.sum
            .get_or_init(|| all_reduce::<B>(self.local.clone(), self.group.as_ref()))
            .clone()
    }
    fn held_bytes(&self) -> usize {
        self.local.shape().num_elements() * self.local.dtype().size()
    }
    fn elementwise(&self, f: &Elementwise<B>) -> Option<ShardTensor<B>> {
        self.placed()?.elementwise(f)
    }
    fn layout(&self, op: &ViewOp) -> Option<ShardTensor<B>> {
        self.placed()?.layout(op)
    }
    fn along(&self, dim: usize, f: &Elementwise<B>) -> Option<ShardTensor<B>> {
        self.placed()?.along(dim, f)
    }
    fn sum(&self) -> Option<ShardTensor<B>> {
        self.placed()?.sum()
    }
    fn take(
        &self,
        dim: usize,
        indices: &<B as burn_backend::BackendTypes>::IntTensorPrimitive,
    ) -> Option<ShardTensor<B>> {
        self.placed()?.take(dim, indices)
    }
    fn matmul(
        self: Arc<Self>,
        other: ShardTensor<B>,
        self_lhs: bool,
        f: &Binary<B>,
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        match self.placed() {
            Some(p) => p.matmul(other, self_lhs, f),
            None => Err(other),
        }
    }
    fn weight_grad(
        self: Arc<Self>,
        other: ShardTensor<B>,
        self_is_x: bool,
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        match self.placed() {
            Some(p) => p.weight_grad(other, self_is_x),
            None => Err(other),
        }
    }
    fn bias_grad(&self) -> Option<ShardTensor<B>> {
        self.placed()?.bias_grad()
    }
    fn binary(
        self: Arc<Self>,
        other: ShardTensor<B>,
        self_lhs: bool,
        f: &Binary<B>,
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        // A sum or difference of pending sums, or of one and a replicated tensor, is one
        // (autodiff accumulating the gradients of an input read by several layers, and by the
        // residual connection).
        let linear = matches!(current_op(), "float_add" | "float_sub") && !self.reduced();
        let o = match replicated::<B>(other) {
            // A replicated term joins the sum once: rank 0 adds it, the others add zeros.
            ShardTensor::Local(o) if linear && self.group.rank() == 0 => Some(o),
            ShardTensor::Local(o) if linear => {
                let zeros = B::float_zeros(o.shape(), &B::float_device(&o), o.dtype().into());
                drop(o);
                Some(zeros)
            }
            other => match other.deferred::<Partial<B>>() {
                Some(o)
                    if linear
                        && !o.reduced()
                        && o.scatter == self.scatter
                        && same_group(&o.group, &self.group) =>
                {
                    Some(o.local.clone())
                }
                // Any other op on a sum to be scattered: on this rank's part of it.
                _ => {
                    return match self.placed() {
                        Some(p) => p.binary(other, self_lhs, f),
                        None => Err(other),
                    };
                }
            },
        };
        let (a, o) = (self.local.clone(), o.expect("an operand"));
        let y = if self_lhs { f(a, o) } else { f(o, a) };
        Ok(Partial::wrap_scattered(y, self.group.clone(), self.scatter))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type F = burn::backend::Flex;
    type S = crate::core::backend::Shard<F>;

    /// Ops on parts split over 2 ranks equal the ops on the whole tensor, with no tensor
    /// formed whole: cat along another dimension, a slice of whole blocks, a reshape merging
    /// the split dimension, a sum along it (a pending sum).
    #[test]
    fn parts_follow_the_ops() {
        use burn_backend::Distribution;
        use burn_backend::ops::FloatTensorOps;
        let device = Default::default();
        let whole = <F as FloatTensorOps<F>>::float_random(
            Shape::new([2, 3, 12]),
            Distribution::Default,
            &device,
            burn_std::FloatDType::F32,
        );
        let data = crate::core::host::read::<F>(whole.clone());
        let read = |t: ShardTensor<F>| crate::core::host::read::<F>(t.into_whole());
        let results = kiln_comm::spawn_ranks(2, |g: kiln_comm::LocalGroup| {
            reset_stats();
            let group: Arc<dyn ProcessGroup> = Arc::new(g);
            let whole = crate::core::host::write::<F>(data.clone(), &device, DType::F32);
            let split = Split { dim: 2, blocks: 3 };
            let p = || {
                ShardTensor::Deferred(Arc::new(Placed::<F>::from_whole(
                    whole.clone(),
                    split,
                    group.clone(),
                )))
            };
            let cat = S::float_cat(vec![p(), ShardTensor::Local(whole.clone())], 1);
            let block = S::float_slice(
                p(),
                &[Slice::from(0..2), Slice::from(0..3), Slice::from(4..8)],
            );
            let merged = S::float_reshape(p(), Shape::new([6, 12]));
            let formed = stats().total_gathers();
            (read(cat), read(block), read(merged), formed)
        });
        let w = |t| crate::core::host::read::<F>(t);
        let cat = w(<F as FloatTensorOps<F>>::float_cat(
            vec![whole.clone(), whole.clone()],
            1,
        ));
        let block = w(<F as FloatTensorOps<F>>::float_slice(
            whole.clone(),
            &[Slice::from(0..2), Slice::from(0..3), Slice::from(4..8)],
        ));
        let merged = w(<F as FloatTensorOps<F>>::float_reshape(
            whole.clone(),
            Shape::new([6, 12]),
        ));
        for (c, b, m, formed) in results {
            assert_eq!(formed, 0, "no part formed whole by the ops");
            c.assert_eq(&cat, true);
            b.assert_eq(&block, true);
            m.assert_eq(&merged, true);
        }
    }

    #[test]
    fn reshapes_keep_whole_chunks() {
        let s = |dim, blocks| Split { dim, blocks };
        // [B, T, 3d] -> [B, T, 3h, hd] with q, k, v as three blocks (d = 8, h = 4).
        assert_eq!(
            reshaped(&[2, 3, 24], &[2, 3, 12, 2], s(2, 3), 2),
            Some(s(2, 3))
        );
        // Heads merged back: [B, T, h, hd] -> [B, T, d].
        assert_eq!(
            reshaped(&[2, 3, 4, 2], &[2, 3, 8], s(2, 1), 2),
            Some(s(2, 1))
        );
        // A head split across ranks cannot be expressed: 4 heads over 8 ranks.
        assert_eq!(reshaped(&[2, 3, 8], &[2, 3, 4, 2], s(2, 1), 8), None);
        // The batch merged with the sequence: the split (last) dimension untouched.
        assert_eq!(reshaped(&[2, 3, 8], &[6, 8], s(2, 1), 2), Some(s(1, 1)));
        // The split dimension merged as the inner one: the outer one counts blocks.
        assert_eq!(reshaped(&[2, 8], &[16], s(1, 1), 2), Some(s(0, 2)));
        // Heads merged with the batch and split out again (the attention mask's add).
        assert_eq!(
            reshaped(&[3, 4, 5, 5], &[12, 25], s(1, 1), 2),
            Some(s(0, 3))
        );
        assert_eq!(
            reshaped(&[12, 25], &[3, 4, 5, 5], s(0, 3), 2),
            Some(s(1, 1))
        );
        // A chunk that is not a run of whole indices of any new dimension.
        assert_eq!(reshaped(&[8], &[2, 4], s(0, 1), 4), None);
        assert_eq!(reshaped(&[6], &[2, 3], s(0, 1), 2), Some(s(0, 1)));
        // Size-1 dimensions around it.
        assert_eq!(reshaped(&[1, 8, 1], &[8], s(1, 1), 2), Some(s(0, 1)));
    }
}
