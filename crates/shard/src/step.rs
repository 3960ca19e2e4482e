//! One training step, the one every kiln training loop takes (`kiln train`, the parity
//! harness, the examples, the benchmarks): micro-batches forward and backward, gradients
//! reduced as the model's strategy says (during backward, or once under [`no_sync`]),
//! global-norm clipping, the optimizer step. Strategies that change how a step runs
//! (accumulation, deferred reduction, clipping, and later precision and rematerialisation)
//! are options here, not loops of their own.
//!
//! Works for sharded models (any strategy, any world size) and for unsharded models of the
//! same backend alike: for the latter, reduction and re-marking do nothing.
//!
//! [`no_sync`]: crate::no_sync

use crate::core::backend::Shard;
use crate::core::error::ShardError;
use crate::core::ops::register_autocast;
use crate::core::scope::{self, AnyArc, MemKind, Set, with_kind};
use crate::features::account::{MemoryProbe, StepMemory, grad_bytes, param_bytes};
use crate::features::lowrank::masks_seeded;
use crate::features::precision::{LossScale, Precision, autocast};
use crate::features::remat::{Pool, RematStats, recorder};
use crate::strategy::optim::{clip_coefficient, grad_norm, scale_grads, widen_grads};
use crate::strategy::shard::{backward, no_sync, reduce_gradients, remark, with_batch_statistics};
use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};
use burn_backend::Backend;
use kiln_comm::{BufMut, ProcessGroup, ReduceOp};

/// How a step runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepConfig {
    /// Micro-batches per step (gradient accumulation; at least 1). The loss of each should be
    /// its mean divided by `accumulate`, so that the step sees the batch's mean.
    pub accumulate: usize,
    /// Accumulate under [`no_sync`](crate::no_sync) and reduce once per step (1/accumulate of
    /// the gradient traffic; whole unreduced gradients meanwhile).
    pub no_sync: bool,
    /// Clip the global gradient norm to this (over all ranks and shards).
    pub clip: Option<f64>,
    /// Rematerialise activations to keep them under this many bytes per rank (see
    /// [`remat`](crate::remat)): forward's whole-tensor ops are recorded, values are given up
    /// under the budget and recomputed when backward reads them. `None`: keep everything.
    pub remat_budget: Option<usize>,
    /// The mixed-precision policy of the step's forward and backward (see
    /// [`precision`](crate::precision)): compute-bound ops and parameter gathers in
    /// `precision.compute`, gradient reduction in `precision.reduce`; parameters and optimizer
    /// state stay f32.
    pub precision: Precision,
    /// Dynamic loss scaling (f16): the loss is multiplied by the scale before backward and the
    /// gradients divided by it; a step whose gradients are not finite is skipped on every rank
    /// and the scale halved. The scale after the step is in [`StepStats::loss_scale`]: pass it
    /// to the next step.
    pub loss_scale: Option<LossScale>,
    /// Seeds the LoRA dropout masks drawn in this step on this thread
    /// ([`crate::lowrank::masks_seeded`]): derived from the run's seed, the step and the
    /// rank, so a resumed run draws what the uninterrupted one did. `None`: the backend's
    /// generator.
    pub dropout_seed: Option<u64>,
}

impl Default for StepConfig {
    fn default() -> Self {
        StepConfig {
            accumulate: 1,
            no_sync: false,
            clip: None,
            remat_budget: None,
            precision: Precision::F32,
            loss_scale: None,
            dropout_seed: None,
        }
    }
}

/// What a step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// This rank's loss: the sum of its micro-batches' losses (the values `loss` returned).
    pub loss: f64,
    /// The global gradient norm before clipping, when clipping.
    pub grad_norm: Option<f64>,
    /// This rank's memory in the step, when the global allocator counts it
    /// ([`RankAlloc`](crate::account::RankAlloc)) and the thread has a rank.
    pub memory: Option<StepMemory>,
    /// What rematerialisation did, under [`StepConfig::remat_budget`].
    pub remat: Option<RematStats>,
    /// The loss scale for the next step, under [`StepConfig::loss_scale`].
    pub loss_scale: Option<LossScale>,
    /// Whether the optimizer step was skipped (gradients not finite under a loss scale; the
    /// model is returned unchanged).
    pub skipped: bool,
}

/// Takes one optimizer step of `model` at learning rate `lr`: `loss(&model, i)` is the loss
/// of micro-batch `i` (forward), differentiated and accumulated; the gradients are reduced
/// over the ranks (the hook does it during backward unless `no_sync`), clipped, and the
/// optimizer steps (use [`ShardedOptimizer`](crate::ShardedOptimizer) for sharded models).
///
/// # Errors
/// A failed collective of the step's own (the global gradient norm); a collective inside an
/// op (a parameter's gather, a gradient's reduction) panics naming the rank and the op, as
/// Burn's op signatures cannot return errors.
///
/// # Panics
/// If `config.accumulate` is 0.
pub fn step<B, AB, M, O>(
    model: M,
    optim: &mut O,
    lr: f64,
    config: &StepConfig,
    loss: impl FnMut(&M, usize) -> Tensor<AB, 1>,
) -> Result<(M, StepStats), ShardError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
    O: Optimizer<M, AB>,
{
    assert!(
        config.accumulate > 0,
        "kiln: a step needs at least one micro-batch"
    );
    let mut loss = loss;
    step_with(model, optim, lr, config, None, |model, passes| {
        let mut total = 0.0;
        let grads = if config.accumulate == 1 && !config.no_sync {
            let l = passes.forward(|| loss(model, 0));
            total += l.clone().into_scalar().elem::<f64>();
            let l = passes.scaled(l);
            with_kind(MemKind::Backward, || {
                GradientsParams::from_grads(l.backward(), model)
            })
        } else {
            let mut acc = GradientsAccumulator::<M>::new();
            for i in 0..config.accumulate {
                let l = passes.forward(|| loss(model, i));
                total += l.clone().into_scalar().elem::<f64>();
                let l = passes.scaled(l);
                let grads = with_kind(MemKind::Backward, || {
                    if config.no_sync {
                        no_sync(model, || backward(l, model))
                    } else {
                        backward(l, model)
                    }
                });
                acc.accumulate(model, grads);
            }
            let grads = acc.grads();
            if config.no_sync {
                reduce_gradients(model, grads)
            } else {
                grads
            }
        };
        Ok((total, grads))
    })
}

/// What a step's gradient producer (the micro-batch loop of [`step`], or a pipeline schedule)
/// wraps its passes in, so that every way of producing gradients gets the step's memory
/// accounting, rematerialisation and loss scaling alike.
pub struct Passes<'a> {
    /// The remat pool's recorder (for the step's backend), under a budget.
    recorder: Option<AnyArc>,
    scale: Option<f64>,
    _step: std::marker::PhantomData<&'a ()>,
}

impl std::fmt::Debug for Passes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Passes")
            .field("remat", &self.recorder.is_some())
            .field("scale", &self.scale)
            .finish()
    }
}

impl Passes<'_> {
    /// Runs a forward pass: its tensors counted as activations, recorded for remat under a
    /// budget.
    pub fn forward<R>(&self, f: impl FnOnce() -> R) -> R {
        with_kind(MemKind::Activations, || match &self.recorder {
            Some(r) => scope::with(Set::Recorder(Some(r.clone())), f),
            None => f(),
        })
    }

    /// The loss to differentiate: scaled under a loss scale (a power of two, so unscaling the
    /// gradients is exact).
    pub fn scaled<AB: Backend>(&self, loss: Tensor<AB, 1>) -> Tensor<AB, 1> {
        match self.scale {
            Some(s) => loss.mul_scalar(s),
            None => loss,
        }
    }
}

/// [`step`] with the gradients made by `grads(&model, passes)`, which returns this rank's loss
/// and the reduced gradients of its parameters: norm, clipping, loss scaling and the optimizer
/// step are the same for every producer. When `across` is given (a pipeline's stage group), the
/// model's parameters are split over its ranks, so the global gradient norm sums their parts.
///
/// # Errors
/// The producer's error; a failed collective of the step's own (the global gradient norm),
/// as `E`.
pub fn step_with<B, AB, M, O, E>(
    model: M,
    optim: &mut O,
    lr: f64,
    config: &StepConfig,
    across: Option<&dyn ProcessGroup>,
    grads: impl FnOnce(&M, &Passes<'_>) -> Result<(f64, GradientsParams), E>,
) -> Result<(M, StepStats), E>
where
    E: From<ShardError>,
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
    O: Optimizer<M, AB>,
{
    // Forward, backward and the optimizer step under the precision policy (the optimizer's
    // elementwise updates are not compute-bound ops, so they stay f32).
    register_autocast::<B>();
    crate::features::account::step_mark(true);
    let done = autocast(config.precision, move || {
        let probe = MemoryProbe::start();
        let pool = config.remat_budget.map(Pool::new);
        let scale = config.loss_scale.map(|s| s.scale);
        let passes = Passes {
            recorder: pool.as_ref().map(recorder::<B>),
            scale,
            _step: std::marker::PhantomData,
        };
        // Under SyncBatchNorm, forward and backward compute batch statistics over the group.
        let produce = || match config.dropout_seed {
            Some(seed) => masks_seeded(seed, || grads(&model, &passes)),
            None => grads(&model, &passes),
        };
        let (total, grads) = with_batch_statistics::<B, AB, M, _>(&model, 1.0, produce)?;
        // Sequence parallelism's gathered input kept for reuse is not needed past backward.
        crate::features::tp::release_kept();
        let grads = match config.precision.is_mixed() {
            true => widen_grads::<AB, M>(&model, grads),
            false => grads,
        };
        // One global norm serves clipping and the overflow check; every rank sees the same norm
        // (the sharded parts are all-reduced, the whole gradients are equal), so every rank takes
        // the same decision.
        let norm = match config.clip.is_some() || scale.is_some() {
            true => Some(global_norm::<B, AB, M>(&model, &grads, across)?),
            false => None,
        };
        let unscale = scale.map_or(1.0, |s| 1.0 / s);
        let grad_norm = norm.map(|n| n * unscale);
        if let (Some(s), Some(n)) = (config.loss_scale, norm)
            && !n.is_finite()
        {
            // Backward consumed the parameters' gradient-sync marks; the optimizer step would have
            // set them again.
            remark::<B, AB, M>(&model);
            return Ok((
                model,
                StepStats {
                    loss: total,
                    grad_norm,
                    memory: None,
                    remat: pool.map(|p| p.stats()),
                    loss_scale: Some(s.update(false)),
                    skipped: true,
                },
            ));
        }
        let clip = match (config.clip, grad_norm) {
            (Some(max), Some(n)) => clip_coefficient(max, n),
            _ => 1.0,
        };
        let factor = unscale * clip;
        let grads = if factor != 1.0 {
            scale_grads::<AB, M>(&model, grads, factor)
        } else {
            grads
        };
        let grads_held = probe
            .as_ref()
            .map_or(0, |_| grad_bytes::<B, AB, M>(&model, &grads));
        let model = optim.step(lr, model, grads);
        let memory = probe.map(|p| p.finish(param_bytes::<B, AB, M>(&model), grads_held));
        Ok((
            model,
            StepStats {
                loss: total,
                grad_norm,
                memory,
                remat: pool.map(|p| p.stats()),
                loss_scale: config.loss_scale.map(|s| s.update(true)),
                skipped: false,
            },
        ))
    });
    crate::features::account::step_mark(false);
    done
}

/// The global gradient norm: over every rank and shard of the model, and over the stages
/// `across` (a pipeline's stage group: its parameters are split over them).
fn global_norm<B, AB, M>(
    model: &M,
    grads: &GradientsParams,
    across: Option<&dyn ProcessGroup>,
) -> Result<f64, ShardError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    let norm = grad_norm::<B, AB, M>(model, grads)?;
    Ok(match across {
        Some(group) => {
            let mut squares = [(norm * norm) as f32];
            scope::waiting(|| group.all_reduce(BufMut::F32(&mut squares), ReduceOp::Sum))?;
            f64::from(squares[0]).sqrt()
        }
        None => norm,
    })
}
