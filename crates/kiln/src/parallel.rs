//! [`parallelize`]: a model made this rank's part of a parallel job, in one documented order.
//!
//! Every entry point (`kiln train`, `kiln finetune`, the examples, the benchmarks) calls it, so
//! the order in which kiln's strategies compose is code, not folklore (torchtitan's
//! `parallelize_llama` is the model):
//!
//! 1. **adapters** ([`Adapt`]): LoRA adapters on the frozen base, or the model whole. First,
//!    because every later step must see the adapters (a stage holds its units' adapters; the
//!    adapters are sharded like any parameter);
//! 2. **pipeline cut** ([`Stages`]): this rank keeps its stage's units; the other stages'
//!    parameters become placeholders. Before sharding, so a stage shards only what it holds;
//! 3. **tensor parallelism** ([`TpPlan`]): Megatron's column/row split of the layers a plan
//!    names by module path, over the mesh's `tp` axis (the fastest: one node). Applied after
//!    sharding has registered the parameters (whole, or sharded under ZeRO-3: the part is then
//!    sharded again), so that the data-parallel strategy reduces each rank's part of a split
//!    gradient over the data-parallel group, whatever the strategy;
//! 4. **rematerialisation** ([`Remat`]): Burn's op-level checkpointing is autodiff's type
//!    parameter (`Train<B, BalancedCheckpointing>`, checked here against the plan); kiln's
//!    budget goes into the step's configuration;
//! 5. **precision** ([`Precision`]): the inner backend is probed for the compute dtype; the
//!    policy (and f16's loss scale) goes into the step's configuration;
//! 6. **sharding** ([`Strategy`]): `shard` over the mesh's data-parallel groups; weights are
//!    loaded after this (each tensor sharded as it arrives under ZeRO-3).
//!
//! What comes back is the model, the pipeline (if any) and the [`StepConfig`] every step runs
//! with.

use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::module::{AutodiffModule, Module};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use kiln_comm::{CommError, DeviceMesh, MeshAxis, MeshShape, ProcessGroup};
use kiln_model::{CausalLm, Staged, causal_lm_loss};
use kiln_pipe::{PipeError, Pipeline, PipelineConfig, Split};
use kiln_shard::{
    LossScale, Precision, ShardConfig, ShardError, ShardGroups, StepConfig, Strategy, TpPlan,
    TpReport, Train, account, tensor_parallel,
};
use std::any::TypeId;
use std::sync::Arc;

/// Why a model could not be parallelized.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ParallelError {
    /// A plan that does not fit the mesh, the model or this build, with the numbers.
    #[error("{0}")]
    Plan(String),
    /// Sharding failed.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// The pipeline could not be cut.
    #[error(transparent)]
    Pipe(#[from] PipeError),
    /// The adapters could not be made.
    #[error(transparent)]
    Lora(#[from] kiln_lora::LoraError),
    /// A collective failed (building the mesh's groups).
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// How activations are kept for backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Remat {
    /// Every activation autodiff needs is kept from forward to backward.
    #[default]
    Off,
    /// Burn's `BalancedCheckpointing`: memory-bound ops (elementwise, activations, layout) are
    /// recomputed from their kept inputs in backward; compute-bound ops' outputs are kept.
    Balanced,
    /// kiln's budgeted rematerialisation ([`kiln_shard::remat`]): recorded activations are held
    /// to this many bytes per rank, the rest recomputed on use.
    Budget(usize),
}

impl Remat {
    /// The accepted forms, for error messages.
    pub const FORMS: &'static str = "\"off\", \"balanced\" or \"budget=SIZE\" (e.g. budget=64MiB)";
}

impl std::fmt::Display for Remat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Remat::Off => f.write_str("off"),
            Remat::Balanced => f.write_str("balanced"),
            Remat::Budget(bytes) => write!(f, "budget={bytes}"),
        }
    }
}

impl std::str::FromStr for Remat {
    type Err = ParallelError;
    fn from_str(s: &str) -> Result<Remat, ParallelError> {
        match s.trim() {
            "off" => Ok(Remat::Off),
            "balanced" => Ok(Remat::Balanced),
            other => match other.strip_prefix("budget=").map(parse_size) {
                Some(Some(bytes)) => Ok(Remat::Budget(bytes)),
                _ => Err(ParallelError::Plan(format!(
                    "remat must be {}, got {other:?}",
                    Remat::FORMS
                ))),
            },
        }
    }
}

/// A size in bytes: `1048576`, `512KiB`, `64MiB`, `2GiB` (also `K`, `M`, `G`, `KB`, `MB`,
/// `GB`, all powers of 1024).
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: f64 = number.parse().ok()?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    (number >= 0.0).then_some((number * scale) as usize)
}

/// What [`parallelize`] applies.
#[derive(Debug, Clone)]
pub struct ParallelPlan {
    /// How the data-parallel ranks share parameters, gradients and optimizer state; the
    /// bucket size (`None`: a quarter of the model's parameter bytes, between 256 KiB and
    /// 25 MiB), overlap and prefetch.
    pub shard: ShardConfig,
    /// Gradient buckets of this many bytes, or `None` for the model-sized default.
    pub bucket_bytes: Option<usize>,
    /// Pipeline stages (`stages` > 1), cut by the model's [`Staged`] units.
    pub pipeline: Option<PipelineConfig>,
    /// Rematerialisation.
    pub remat: Remat,
    /// Mixed precision.
    pub precision: Precision,
    /// f16's dynamic loss scale (`None`: no scaling).
    pub loss_scale: Option<LossScale>,
    /// Global gradient-norm clipping.
    pub clip: Option<f64>,
    /// Tensor-parallel ranks (1: none): the mesh's fastest axis.
    pub tp: usize,
    /// Which layers tensor parallelism splits how (with `tp > 1`).
    pub tp_plan: TpPlan,
}

impl ParallelPlan {
    /// `strategy` alone: no pipeline, no remat, f32, no clipping.
    pub fn new(strategy: Strategy) -> Self {
        ParallelPlan {
            shard: ShardConfig::new(strategy),
            bucket_bytes: None,
            pipeline: None,
            remat: Remat::Off,
            precision: Precision::F32,
            loss_scale: None,
            clip: None,
            tp: 1,
            tp_plan: TpPlan::default(),
        }
    }

    /// The mesh's shape for a world of `world` ranks: `pp` stages outermost, the data-parallel
    /// ranks within (`dp_shard` consecutive ranks per sharding group under hybrid).
    ///
    /// # Errors
    /// Degrees that do not divide the world.
    pub fn mesh_shape(&self, world: usize) -> Result<MeshShape, ParallelError> {
        let pp = self.pipeline.as_ref().map_or(1, |p| p.stages);
        let tp = self.tp;
        if pp == 0 || tp == 0 || !world.is_multiple_of(pp * tp) {
            return Err(ParallelError::Plan(format!(
                "pp ({pp}) x tp ({tp}) must divide the world size ({world}): the world is pp \
                 stages x data-parallel ranks x tp ranks"
            )));
        }
        let dp = world / pp / tp;
        let dp_shard = match self.shard.strategy {
            Strategy::Hybrid { shard_size } => {
                if shard_size == 0 || !dp.is_multiple_of(shard_size) {
                    return Err(ParallelError::Plan(format!(
                        "hybrid:{shard_size} needs data-parallel ranks divisible by \
                         {shard_size}, got {dp}"
                    )));
                }
                shard_size
            }
            _ => dp,
        };
        Ok(MeshShape {
            pp,
            dp_replicate: dp / dp_shard,
            dp_shard,
            tp,
        })
    }
}

/// The job's ranks as one mesh (`pp x dp_replicate x dp_shard x tp`, stages outermost), with
/// the groups the plan uses, each split from the world once: the stage group and the
/// data-parallel group with a pipeline, the sharding and replicate groups under hybrid
/// sharding (a group spanning the world is the world itself).
#[derive(Debug)]
pub struct Mesh {
    /// Every rank of the job.
    pub world: Arc<dyn ProcessGroup>,
    /// The grid.
    pub shape: MeshShape,
    /// The ranks holding the same stage (the world without a pipeline).
    pub dp: Arc<dyn ProcessGroup>,
    /// This rank's pipeline stage group, with a pipeline.
    pub pp: Option<Arc<dyn ProcessGroup>>,
    /// Under hybrid sharding: the sharding group and the replicate group.
    pub hybrid: Option<(Arc<dyn ProcessGroup>, Arc<dyn ProcessGroup>)>,
    /// This rank's tensor-parallel group, with `tp > 1`.
    pub tp: Option<Arc<dyn ProcessGroup>>,
    /// The ranks of this rank's pipeline stage (data-parallel x tensor-parallel): the ranks
    /// that hold the stage's parameters between them (the world without a pipeline).
    pub stage: Arc<dyn ProcessGroup>,
}

impl Mesh {
    /// `world` laid out as `plan` asks (a collective: every rank calls it).
    ///
    /// # Errors
    /// Degrees that do not divide the world; a failed collective.
    pub fn new(world: Arc<dyn ProcessGroup>, plan: &ParallelPlan) -> Result<Mesh, ParallelError> {
        let shape = plan.mesh_shape(world.world_size())?;
        let mesh = DeviceMesh::new(world.world_size(), shape)?;
        let rank = world.rank();
        let split = |axis: MeshAxis| world.split(&mesh.axis_ranks(rank, axis), axis.name());
        let pp = (shape.pp > 1).then(|| split(MeshAxis::Pp)).transpose()?;
        let hybrid = match plan.shard.strategy {
            Strategy::Hybrid { .. } => {
                let replicate = split(MeshAxis::DpReplicate)?;
                Some((split(MeshAxis::DpShard)?, replicate))
            }
            _ => None,
        };
        let dp = match shape.pp * shape.tp {
            1 => world.clone(),
            _ => split(MeshAxis::Dp)?,
        };
        let tp = (shape.tp > 1).then(|| split(MeshAxis::Tp)).transpose()?;
        let stage = match (shape.tp, shape.pp) {
            (1, _) => dp.clone(),
            (_, 1) => world.clone(),
            _ => {
                // Stages are the outermost axis: a stage's ranks are consecutive.
                let size = world.world_size() / shape.pp;
                let first = rank / size * size;
                world.split(&(first..first + size).collect::<Vec<_>>(), "stage")?
            }
        };
        Ok(Mesh {
            world,
            shape,
            dp,
            pp,
            hybrid,
            tp,
            stage,
        })
    }

    /// The groups sharding uses.
    pub fn shard_groups(&self) -> ShardGroups {
        match &self.hybrid {
            Some((shard, replicate)) => ShardGroups {
                dp: self.dp.clone(),
                shard: shard.clone(),
                replicate: Some(replicate.clone()),
            },
            None => ShardGroups {
                dp: self.dp.clone(),
                shard: self.dp.clone(),
                replicate: None,
            },
        }
    }
}

/// Step 1: what trains. [`Whole`] trains the model as it is; `kiln-train`'s LoRA plan returns
/// the base with adapters.
pub trait Adapt<B: Backend, C: CheckpointStrategy, M> {
    /// The model that trains.
    type Model: AutodiffModule<Train<B, C>>;
    /// Makes it from the base.
    ///
    /// # Errors
    /// Adapters that do not fit the base.
    fn adapt(&self, base: M, device: &B::Device) -> Result<Self::Model, ParallelError>;
    /// The adapted model's parameters, frozen ones included (counted before the pipeline cut).
    fn params(&self, model: &Self::Model) -> usize {
        model.num_params()
    }
    /// A line saying what trains, when only part of the model does.
    fn describe(&self, _model: &Self::Model) -> Option<String> {
        None
    }
}

/// The whole model trains (no adapters).
#[derive(Debug, Clone, Copy, Default)]
pub struct Whole;

impl<B: Backend, C: CheckpointStrategy, M: AutodiffModule<Train<B, C>>> Adapt<B, C, M> for Whole {
    type Model = M;
    fn adapt(&self, base: M, _: &B::Device) -> Result<M, ParallelError> {
        Ok(base)
    }
}

/// Step 2: how a model is cut into pipeline stages.
pub trait Stages<B: Backend, C: CheckpointStrategy, M> {
    /// This rank's stage of `model` over the stage group `stages` (`world`: every rank, which
    /// agrees on measured unit costs).
    ///
    /// # Errors
    /// A model or a split that does not fit the stages.
    fn cut(
        &self,
        model: M,
        config: &PipelineConfig,
        stages: Arc<dyn ProcessGroup>,
        world: &dyn ProcessGroup,
        device: &B::Device,
    ) -> Result<(Pipeline, M), ParallelError>;
}

/// A model that is not cut into stages: a plan with a pipeline is refused.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoStages;

impl<B: Backend, C: CheckpointStrategy, M> Stages<B, C, M> for NoStages {
    fn cut(
        &self,
        _: M,
        config: &PipelineConfig,
        _: Arc<dyn ProcessGroup>,
        _: &dyn ProcessGroup,
        _: &B::Device,
    ) -> Result<(Pipeline, M), ParallelError> {
        Err(ParallelError::Plan(format!(
            "a pipeline of {} stages needs a model that lists its units (kiln_model::Staged); \
             this one is run whole",
            config.stages
        )))
    }
}

/// A causal language model cut at its [`Staged`] units; `Split::Measured` times each unit on
/// micro-batches of `microbatch` (rows, sequence) token ids.
#[derive(Debug, Clone, Copy)]
pub struct LmStages {
    /// Rows and sequence length of one micro-batch.
    pub microbatch: [usize; 2],
}

impl<B, C, M> Stages<B, C, M> for LmStages
where
    B: Backend,
    C: CheckpointStrategy,
    M: Staged<Train<B, C>> + CausalLm<Train<B, C>>,
{
    fn cut(
        &self,
        model: M,
        config: &PipelineConfig,
        stages: Arc<dyn ProcessGroup>,
        world: &dyn ProcessGroup,
        device: &B::Device,
    ) -> Result<(Pipeline, M), ParallelError> {
        let mut config = config.clone();
        if config.split == Split::Measured {
            // Token values do not change the cost of any unit: zeros will do.
            let tokens = Tensor::<Train<B, C>, 2, Int>::zeros(self.microbatch, device);
            let loss = |logits| causal_lm_loss(logits, tokens.clone());
            config.split = Split::Costs(kiln_pipe::measure_costs(
                &model,
                tokens.clone(),
                loss,
                world,
                3,
            )?);
        }
        Ok(Pipeline::new(model, stages, &config)?)
    }
}

/// What [`parallelize`] made: this rank's model, its pipeline, and how its steps run.
#[derive(Debug)]
pub struct Parallel<M> {
    /// The model, adapted, cut and sharded (weights not loaded yet unless the base had them).
    pub model: M,
    /// The pipeline, when the plan has one.
    pub pipeline: Option<Pipeline>,
    /// The step configuration: remat budget, precision, loss scale, clipping.
    pub step: StepConfig,
    /// The whole model's parameters ([`Adapt::params`], before the cut).
    pub params: usize,
    /// What trains ([`Adapt::describe`]).
    pub trains: Option<String>,
    /// What tensor parallelism split, with `tp > 1`.
    pub tp: Option<TpReport>,
}

/// Makes `base` this rank's part of the job that `plan` describes over `mesh`, in the order of
/// the module docs: adapters, pipeline cut, (tensor parallelism), remat, precision, sharding.
/// Every rank calls it (it communicates).
///
/// # Errors
/// A plan that does not fit (named, with the numbers); adapters or a pipeline that do not fit
/// the model; a backend that cannot run the precision; a failed collective.
pub fn parallelize<B, C, M, A, S>(
    base: M,
    adapters: &A,
    stages: &S,
    plan: &ParallelPlan,
    mesh: &Mesh,
    device: &B::Device,
) -> Result<Parallel<A::Model>, ParallelError>
where
    B: Backend,
    C: CheckpointStrategy,
    A: Adapt<B, C, M>,
    S: Stages<B, C, A::Model>,
{
    // 1. Adapters.
    let model = adapters.adapt(base, device)?;
    let (params, trains) = (adapters.params(&model), adapters.describe(&model));
    // 2. The pipeline cut.
    let (pipeline, model) = match &plan.pipeline {
        Some(config) if config.stages > 1 => {
            check_stage_threads(plan.shard.strategy, mesh)?;
            let group = mesh.pp.clone().ok_or_else(|| {
                ParallelError::Plan("a pipeline on a mesh without a pp axis".into())
            })?;
            let (pipe, model) = stages.cut(model, config, group, mesh.world.as_ref(), device)?;
            (Some(pipe), model)
        }
        _ => (None, model),
    };
    // 3. Tensor parallelism: checked here, applied after sharding registered the parameters.
    if mesh.shape.tp > 1 && plan.tp_plan.rules.is_empty() {
        return Err(ParallelError::Plan(format!(
            "tensor parallelism (tp = {}) needs a plan: which layers to split how",
            mesh.shape.tp
        )));
    }
    // 4. Rematerialisation.
    let balanced = TypeId::of::<C>() == TypeId::of::<BalancedCheckpointing>();
    if balanced != (plan.remat == Remat::Balanced) {
        return Err(ParallelError::Plan(format!(
            "remat {} needs the training backend Train<B, {}>",
            plan.remat,
            if balanced {
                "NoCheckpointing> (this one checkpoints: Train<B, BalancedCheckpointing"
            } else {
                "BalancedCheckpointing"
            }
        )));
    }
    let remat_budget = match plan.remat {
        Remat::Budget(bytes) => Some(bytes),
        _ => None,
    };
    // 5. Precision.
    kiln_shard::precision::probe::<B>(plan.precision, device)?;
    let step = StepConfig {
        clip: plan.clip,
        remat_budget,
        precision: plan.precision,
        loss_scale: plan.loss_scale,
        ..Default::default()
    };
    // 6. Sharding, over this stage's data-parallel ranks.
    let bucket_bytes = plan
        .bucket_bytes
        .unwrap_or_else(|| model.num_params().clamp(256 << 10, 25 << 20));
    let config = plan.shard.clone().with_bucket_bytes(bucket_bytes);
    let model = kiln_shard::shard_over(model, mesh.shard_groups(), config)?;
    // 3 (continued). Tensor parallelism over the tp group.
    let (model, tp) = match &mesh.tp {
        Some(group) => {
            let (model, report) = tensor_parallel(model, &plan.tp_plan, group.clone())?;
            (model, Some(report))
        }
        None => (model, None),
    };
    // Memory is counted per world rank (sharding counted it by the data-parallel group's rank,
    // which pipeline stages share).
    account::attribute_to_rank(mesh.world.rank());
    Ok(Parallel {
        model,
        pipeline,
        step,
        params,
        trains,
        tp,
    })
}

/// ZeRO-3 and hybrid with pipeline stages as threads of one process need burn-autodiff's fix
/// of tracel-ai/burn#5194 (kiln's vendored copy has it).
fn check_stage_threads(strategy: Strategy, mesh: &Mesh) -> Result<(), ParallelError> {
    if !kiln_pipe::SHARDED_STAGE_THREADS
        && mesh.world.backend() == "local"
        && strategy.shards_params()
    {
        return Err(ParallelError::Plan(format!(
            "strategy {strategy} with {} pipeline stages needs ranks as processes (kiln launch) \
             in this build: its burn-autodiff (without the fix of tracel-ai/burn#5194) can \
             deadlock a stage's backward all-gathers against another stage's sends when stages \
             are threads of one process. Use ddp, zero1 or zero2, or kiln launch",
            mesh.shape.pp
        )));
    }
    Ok(())
}
