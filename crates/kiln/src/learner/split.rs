//! Batches in, outputs out: each rank takes its rows of the program's batch ([`Split`]), and
//! rank 0 puts the ranks' outputs back together for the metrics ([`Gather`]).
//!
//! A Rust program's batch is a struct kiln cannot look inside, so its type says how it splits:
//! one `impl Split` of a few lines (every tensor field cut by rows), the only line of a
//! program's data code that changes. burn-train's own outputs (`ClassificationOutput`,
//! `MultiLabelClassificationOutput`, `RegressionOutput`, `SequenceOutput`) implement [`Gather`]
//! here; a program's own output type implements it with [`gather_rows`] and [`mean_over`].

use super::error::LearnerError;
use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, DType, Tensor, TensorData};
use burn::train::{
    ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput, SequenceOutput,
};
use kiln_comm::{BufMut, BufRef, ProcessGroup, shard_range};
use std::ops::Range;

/// This rank's part of a batch of `rows` examples: contiguous rows, the first `rows % world`
/// ranks one more than the others (`torch.tensor_split`'s rule), in rank order, so that the
/// ranks' parts put end to end are the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// This rank.
    pub rank: usize,
    /// The data-parallel ranks.
    pub world: usize,
    /// The batch's examples (all ranks').
    pub rows: usize,
}

impl Share {
    /// The rows this rank takes.
    pub fn range(&self) -> Range<usize> {
        shard_range(self.rows, self.world, self.rank)
    }

    /// How many rows this rank takes.
    pub fn len(&self) -> usize {
        self.range().len()
    }

    /// Whether this rank takes no row (a batch smaller than the world).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether every rank takes as many rows as the others.
    pub fn is_even(&self) -> bool {
        self.rows.is_multiple_of(self.world)
    }

    /// This rank's rows of `tensor` (its first dimension).
    ///
    /// # Panics
    /// If `tensor`'s first dimension is not the batch's `rows`: a batch whose fields disagree
    /// on its size cannot be split by rows.
    pub fn rows_of<B: Backend, const D: usize, K: BasicOps<B>>(
        &self,
        tensor: &Tensor<B, D, K>,
    ) -> Tensor<B, D, K> {
        let dims = tensor.dims();
        assert!(
            dims[0] == self.rows,
            "kiln::learner: a batch field of shape {dims:?} does not have the batch's {} rows \
             first; split it by hand in the batch's `impl Split`",
            self.rows
        );
        let r = self.range();
        tensor.clone().narrow(0, r.start, r.len())
    }
}

/// A batch that ranks split by rows: each rank trains (or validates) on its [`Share`], so the
/// ranks together see the batch the program asked for on one device.
///
/// ```
/// use burn::prelude::*;
/// use kiln::learner::{Share, Split};
///
/// #[derive(Clone, Debug)]
/// struct MnistBatch<B: Backend> {
///     images: Tensor<B, 3>,
///     targets: Tensor<B, 1, Int>,
/// }
///
/// impl<B: Backend> Split for MnistBatch<B> {
///     fn rows(&self) -> usize {
///         self.targets.dims()[0]
///     }
///     fn split(&self, share: &Share) -> Self {
///         MnistBatch { images: share.rows_of(&self.images), targets: share.rows_of(&self.targets) }
///     }
/// }
/// ```
pub trait Split: Sized {
    /// The batch's examples.
    fn rows(&self) -> usize;
    /// This rank's rows ([`Share::rows_of`] on each field).
    fn split(&self, share: &Share) -> Self;
}

impl<B: Backend, const D: usize, K: BasicOps<B>> Split for Tensor<B, D, K> {
    fn rows(&self) -> usize {
        self.dims()[0]
    }
    fn split(&self, share: &Share) -> Self {
        share.rows_of(self)
    }
}

impl<A: Split, Z: Split> Split for (A, Z) {
    fn rows(&self) -> usize {
        self.0.rows()
    }
    fn split(&self, share: &Share) -> Self {
        (self.0.split(share), self.1.split(share))
    }
}

/// A step's output that rank 0 puts back together from the ranks' parts, so that the metrics
/// see the batch's output as one device would have made it. A collective: every rank calls it.
pub trait Gather: Sized {
    /// The ranks' outputs put together on rank 0 (`None` on the others).
    ///
    /// # Errors
    /// A failed collective.
    fn gather(self, share: &Share, group: &dyn ProcessGroup) -> Result<Option<Self>, LearnerError>;
}

/// The ranks' `tensor`s end to end along the first dimension, on rank 0 (`None` elsewhere). Every
/// rank's tensor has the same dimensions after the first. A collective.
///
/// # Errors
/// A failed collective; ranks whose tensors differ after the first dimension.
pub fn gather_rows<B: Backend, const D: usize, K: BasicOps<B>>(
    tensor: Tensor<B, D, K>,
    group: &dyn ProcessGroup,
) -> Result<Option<Tensor<B, D, K>>, LearnerError> {
    let world = group.world_size();
    if world == 1 {
        return Ok(Some(tensor));
    }
    let device = tensor.device();
    let dims = tensor.dims();
    let data = tensor.into_data();
    let dtype = data.dtype;
    // Sizes first (they differ by a row at most), then the values padded to the largest.
    let mut sizes = vec![0i64; world];
    group.all_gather(BufRef::I64(&[dims[0] as i64]), BufMut::I64(&mut sizes))?;
    let inner: usize = dims[1..].iter().product();
    let most = sizes.iter().copied().max().unwrap_or(0) as usize * inner;
    let rows: usize = sizes.iter().map(|&s| s as usize).sum();
    let mut shape = dims;
    shape[0] = rows;
    let pieces = |len: usize| sizes.iter().map(move |&s| s as usize * len);
    let data = if is_float(dtype) {
        let mut mine = data
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| LearnerError::Data(format!("{e:?}")))?;
        mine.resize(most, 0.0);
        let mut all = vec![0f32; most * world];
        group.all_gather(BufRef::F32(&mine), BufMut::F32(&mut all))?;
        if group.rank() != 0 {
            return Ok(None);
        }
        let values = unpad(&all, most, pieces(inner));
        TensorData::new(values, shape).convert_dtype(dtype)
    } else {
        let mut mine: Vec<i64> = match dtype {
            DType::Bool(_) => data.iter::<bool>().map(i64::from).collect(),
            _ => data
                .convert::<i64>()
                .into_vec::<i64>()
                .map_err(|e| LearnerError::Data(format!("{e:?}")))?,
        };
        mine.resize(most, 0);
        let mut all = vec![0i64; most * world];
        group.all_gather(BufRef::I64(&mine), BufMut::I64(&mut all))?;
        if group.rank() != 0 {
            return Ok(None);
        }
        let values = unpad(&all, most, pieces(inner));
        match dtype {
            DType::Bool(_) => TensorData::new(
                values.into_iter().map(|v| v != 0).collect::<Vec<_>>(),
                shape,
            ),
            _ => TensorData::new(values, shape).convert_dtype(dtype),
        }
    };
    Ok(Some(Tensor::from_data(data, &device)))
}

fn is_float(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F64 | DType::F32 | DType::Flex32 | DType::F16 | DType::BF16
    )
}

/// The first `lens[r]` values of each rank's `stride`-long slot, end to end.
fn unpad<T: Copy>(all: &[T], stride: usize, lens: impl Iterator<Item = usize>) -> Vec<T> {
    lens.enumerate()
        .flat_map(|(r, len)| all[r * stride..r * stride + len].iter().copied())
        .collect()
}

/// The batch's mean of a per-rank mean (a loss): the ranks' values weighted by their rows, on
/// rank 0 (`None` elsewhere). A collective.
///
/// # Errors
/// A failed collective.
pub fn mean_over<B: Backend>(
    value: Tensor<B, 1>,
    share: &Share,
    group: &dyn ProcessGroup,
) -> Result<Option<Tensor<B, 1>>, LearnerError> {
    if group.world_size() == 1 {
        return Ok(Some(value));
    }
    let device = value.device();
    let dtype = value.dtype();
    let mine: Vec<f32> = value
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| LearnerError::Data(format!("{e:?}")))?;
    let n = mine.len();
    let weight = share.len() as f64 / share.rows as f64;
    let mut sum: Vec<f32> = mine
        .iter()
        .map(|&v| (f64::from(v) * weight) as f32)
        .collect();
    group.all_reduce(BufMut::F32(&mut sum), kiln_comm::ReduceOp::Sum)?;
    if group.rank() != 0 {
        return Ok(None);
    }
    let data = TensorData::new(sum, [n]).convert_dtype(dtype);
    Ok(Some(Tensor::from_data(data, &device)))
}

fn all3<A, B, C>(a: Option<A>, b: Option<B>, c: Option<C>) -> Option<(A, B, C)> {
    Some((a?, b?, c?))
}

/// burn-train's outputs of `{ loss, output, targets }`: the batch's mean loss, the rows put
/// back together.
macro_rules! gather_loss_output_targets {
    ($($output:ident),*) => {$(
        impl<B: Backend> Gather for $output<B> {
            fn gather(
                self,
                share: &Share,
                group: &dyn ProcessGroup,
            ) -> Result<Option<Self>, LearnerError> {
                let loss = mean_over(self.loss, share, group)?;
                let output = gather_rows(self.output, group)?;
                let targets = gather_rows(self.targets, group)?;
                Ok(all3(loss, output, targets)
                    .map(|(loss, output, targets)| $output { loss, output, targets }))
            }
        }
    )*};
}

gather_loss_output_targets!(
    ClassificationOutput,
    MultiLabelClassificationOutput,
    RegressionOutput
);

impl<B: Backend> Gather for SequenceOutput<B> {
    fn gather(self, share: &Share, group: &dyn ProcessGroup) -> Result<Option<Self>, LearnerError> {
        let loss = mean_over(self.loss, share, group)?;
        let logits = gather_rows(self.logits, group)?;
        // Every rank has predictions or none (the same step on the same kind of batch).
        let predictions = match self.predictions {
            Some(p) => gather_rows(p, group)?.map(Some),
            None => Some(None),
        };
        let targets = gather_rows(self.targets, group)?;
        Ok(
            all3(loss, logits, targets).and_then(|(loss, logits, targets)| {
                Some(SequenceOutput {
                    loss,
                    logits,
                    predictions: predictions?,
                    targets,
                })
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_batch_in_rank_order() {
        for rows in 1..12 {
            for world in 1..5 {
                let mut next = 0;
                for rank in 0..world {
                    let s = Share { rank, world, rows };
                    assert_eq!(s.range().start, next);
                    next = s.range().end;
                    assert!(s.len() >= rows / world && s.len() <= rows / world + 1);
                }
                assert_eq!(next, rows);
            }
        }
    }
}
