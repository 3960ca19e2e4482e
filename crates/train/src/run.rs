//! The training loop of one rank.
//!
//! Why not burn-train's `Learner`: its loop, checkpointers and metrics assume each process
//! trains and saves a whole model. Under kiln every rank must reach every collective in the same
//! order (a ZeRO-3 forward gathers parameters; the loss is averaged over ranks; a snapshot is
//! written by all ranks with a barrier), the optimizer is kiln's `ShardedOptimizer`, and a
//! snapshot must hold per-rank pieces that reshard, which burn-train's `FileCheckpointer` (one
//! record file per component) cannot express. The user-facing parts are kept: a progress display
//! with loss, learning rate, throughput and ETA, a metrics log (JSONL rather than burn-train's
//! per-metric files), periodic validation, snapshots with resume, and a final summary; rank 0
//! hands them to a [`Report`] as events.

use crate::Recipe;
use crate::data::{Corpus, SplitMix64, batch, mix};
use crate::error::{IoContext, Result, TrainError, fail};
use crate::metrics::Metrics;
use crate::model::ModelSpec;
use crate::plan::{Adapters, Full, Plan};
use crate::recipe::Remat;
use crate::report::{Event, Log, Report, Resumed, RunInfo, Silent, StepStats};
use crate::snapshot::{self, Meta, Part, Snapshot};
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, Optimizer};
use burn::prelude::ElementConversion;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData, TensorMetadata};
use hashbrown::HashMap;
use kiln_comm::{ProcessGroup, ReduceOp, shard_range};
use kiln_hf::{
    CausalLm, GenerateConfig, Pretrained, Sampling, Tokenizer, causal_lm_loss, generate,
    generate_with,
};
use kiln_lora::Lora;
use kiln_shard::LossScale;
use kiln_shard::account::{MemKind, StepMemory};
use kiln_shard::optimizer_state_group;
use kiln_shard::pieces::{self, held_range};
use kiln_shard::{Shard, ShardConfig, ShardTensor, ShardedOptimizer};
use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Autodiff over kiln's sharding decorator over `B`, with activation checkpointing `C`
/// (`train.remat`: none, or Burn's op-level `BalancedCheckpointing`).
pub type Train<B, C = NoCheckpointing> = Autodiff<Shard<B>, C>;

/// How a run starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// Continue from the newest snapshot of the run directory.
    pub resume: bool,
    /// Start afresh even if the run directory holds snapshots (they are deleted).
    pub overwrite: bool,
    /// Stop after this step, with a snapshot (a job that must fit a time slot: the next job
    /// resumes). The schedule stays that of `train.steps`.
    pub stop_after: Option<usize>,
}

/// What a rank's run did.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The step the run started from (0, or the resumed snapshot's).
    pub first_step: usize,
    /// The step it ended at.
    pub last_step: usize,
    /// The global training loss of every step run, in order.
    pub losses: Vec<f64>,
    /// The final validation loss.
    pub val_loss: Option<f64>,
    /// Tokens per second over the steps run.
    pub tokens_per_s: f64,
    /// The fraction of this rank's step time spent blocked on collectives (exposed
    /// communication; 0 on one rank).
    pub comm_wait: f64,
    /// The generated sample (prompt included).
    pub sample: Option<String>,
    /// Fine-tuning: the validation loss before the first step (the base's).
    pub val_loss_before: Option<f64>,
    /// Fine-tuning: the base's sample, from the same prompt and seed.
    pub sample_before: Option<String>,
    /// What the run wrote besides snapshots (adapters, a merged model), and where.
    pub outputs: Vec<(String, PathBuf)>,
    /// The newest snapshot written.
    pub snapshot: Option<PathBuf>,
    /// Every rank's memory in its step with the highest heap peak, in rank order (empty when
    /// the global allocator does not count per rank; the `kiln` binary's does).
    pub memory: Vec<RankMemory>,
    /// Steps skipped for gradients that were not finite (f16 loss scaling).
    pub skipped_steps: usize,
    /// The loss scale at the end (f16 only).
    pub loss_scale: Option<f64>,
    /// A pipelined run's bubble, from its second step on (stage group of data-parallel rank
    /// 0 as reported; every stage group computes its own).
    pub bubble: Option<kiln_pipe::Bubble>,
}

/// One rank's memory in its most demanding step, beside its optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankMemory {
    /// The step's measurement ([`kiln_shard::step`]).
    pub step: StepMemory,
    /// Bytes of the rank's optimizer state (its moments; shards count their local part).
    pub optimizer: usize,
}

impl RankMemory {
    const FIELDS: usize = 6 + 5;

    fn to_row(self) -> [i64; Self::FIELDS] {
        let s = self.step;
        let mut row = [0i64; Self::FIELDS];
        let head = [
            s.rank,
            s.params,
            s.grads,
            self.optimizer,
            s.held_before,
            s.peak,
        ];
        for (slot, v) in row
            .iter_mut()
            .zip(head.into_iter().chain(s.peak_above_start))
        {
            *slot = v as i64;
        }
        row
    }

    fn from_row(row: &[i64]) -> RankMemory {
        let u = |i: usize| row[i] as usize;
        RankMemory {
            step: StepMemory {
                rank: u(0),
                params: u(1),
                grads: u(2),
                held_before: u(4),
                peak: u(5),
                peak_above_start: std::array::from_fn(|k| u(6 + k)),
            },
            optimizer: u(3),
        }
    }
}

/// Every rank's [`RankMemory`], on every rank (a collective): `mine` is this rank's.
fn gather_memory(group: &dyn ProcessGroup, mine: Option<RankMemory>) -> Result<Vec<RankMemory>> {
    let counted = i64::from(mine.is_some());
    let mut all_counted = [counted];
    group.all_reduce((&mut all_counted[..]).into(), ReduceOp::Min)?;
    let Some(mine) = mine.filter(|_| all_counted[0] == 1) else {
        return Ok(Vec::new());
    };
    let row = mine.to_row();
    let mut table = vec![0i64; RankMemory::FIELDS * group.world_size()];
    group.all_gather((&row[..]).into(), (&mut table[..]).into())?;
    Ok(table
        .chunks(RankMemory::FIELDS)
        .map(RankMemory::from_row)
        .collect())
}

const TENSOR_PREFIX: &str = "model/";
const M1_PREFIX: &str = "adamw.m1/";
const M2_PREFIX: &str = "adamw.m2/";

/// Trains the recipe's model as one rank of `group` (every rank calls it). `launched`: the
/// world size comes from a launcher (checked against `parallel.world_size`). Rank 0 reports
/// through `tracing` ([`Log`]).
///
/// # Errors
/// Bad settings for this world size, a missing data file, a snapshot that does not fit, a
/// failed collective or write.
pub fn train_rank<B: Backend>(
    recipe: &Recipe,
    group: Arc<dyn ProcessGroup>,
    launched: bool,
    options: RunOptions,
    device: &B::Device,
) -> Result<Summary> {
    train_rank_with::<B>(
        recipe,
        group,
        launched,
        options,
        device,
        &mut Log::default(),
    )
}

/// [`train_rank`], with rank 0's events going to `report` (other ranks never call it).
///
/// # Errors
/// As [`train_rank`].
pub fn train_rank_with<B: Backend>(
    recipe: &Recipe,
    group: Arc<dyn ProcessGroup>,
    launched: bool,
    options: RunOptions,
    device: &B::Device,
    report: &mut dyn Report,
) -> Result<Summary> {
    recipe.check_world(group.world_size(), launched)?;
    let tokenizer = recipe.tokenizer()?;
    let spec = ModelSpec::from_recipe(&recipe.model, &tokenizer)?;
    if recipe.train.seq_len > spec.max_positions() {
        fail!(
            Model,
            "train.seq_len ({}) exceeds the model's {} positions",
            recipe.train.seq_len,
            spec.max_positions()
        );
    }
    let job = Job {
        recipe,
        spec,
        tokenizer: &tokenizer,
        group,
        options,
        device,
        report,
    };
    match recipe.remat()? {
        Remat::Off | Remat::Budget(_) => by_model::<B, NoCheckpointing>(job),
        Remat::Balanced => by_model::<B, BalancedCheckpointing>(job),
    }
}

/// What a rank's run is given, the same whatever the model and the plan: passed down whole
/// from [`train_rank_with`] through the model and plan choices to [`run`].
struct Job<'a, B: Backend> {
    recipe: &'a Recipe,
    spec: ModelSpec,
    tokenizer: &'a Tokenizer,
    group: Arc<dyn ProcessGroup>,
    options: RunOptions,
    device: &'a B::Device,
    report: &'a mut dyn Report,
}

fn by_model<B: Backend, C: CheckpointStrategy>(job: Job<'_, B>) -> Result<Summary> {
    match job.spec.clone() {
        ModelSpec::Gpt2(config) => by_plan::<B, C, kiln_gpt2::Gpt2<Train<B, C>>>(job, config),
        ModelSpec::Llama(config) => by_plan::<B, C, kiln_llama::Llama<Train<B, C>>>(job, config),
    }
}

/// The model `M` trained whole, or LoRA adapters on it when the recipe has `[lora]`.
fn by_plan<B, C, M>(job: Job<'_, B>, config: M::Config) -> Result<Summary>
where
    B: Backend,
    C: CheckpointStrategy,
    M: Pretrained<Train<B, C>>
        + CausalLm<Train<B, C>>
        + AutodiffModule<Train<B, C>>
        + kiln_hf::Staged<Train<B, C>>
        + burn::module::ModuleDisplay,
    M::InnerModule: CausalLm<Shard<B>> + kiln_hf::Staged<Shard<B>>,
    Lora<Train<B, C>, M>: AutodiffModule<Train<B, C>>,
    <Lora<Train<B, C>, M> as AutodiffModule<Train<B, C>>>::InnerModule:
        CausalLm<Shard<B>> + kiln_hf::Staged<Shard<B>>,
{
    let _model = PhantomData;
    match job.recipe.lora.clone() {
        None => run::<B, C, _>(job, Full::<M, _> { config, _model }),
        Some(lora) => {
            let plan = Adapters::<M, _> {
                config,
                lora,
                _model,
            };
            run::<B, C, _>(job, plan)
        }
    }
}

fn memory_json(m: &RankMemory) -> serde_json::Value {
    let mut v = serde_json::json!({
        "rank": m.step.rank,
        "params": m.step.params,
        "grads": m.step.grads,
        "optimizer": m.optimizer,
        "held_before": m.step.held_before,
        "peak": m.step.peak,
    });
    for kind in MemKind::ALL {
        v[format!("peak_{}", kind.name())] = m.step.peak_of(kind).into();
    }
    v
}

/// The learning rate of step `step` (1-based): linear warmup, then cosine decay to
/// `lr * min_lr_ratio` at the last step.
pub fn lr_at(t: &crate::TrainRecipe, step: usize) -> f64 {
    if step <= t.warmup_steps {
        return t.lr * step as f64 / t.warmup_steps as f64;
    }
    let span = t.steps.saturating_sub(t.warmup_steps).max(1) as f64;
    let progress = ((step - t.warmup_steps) as f64 / span).min(1.0);
    let min = t.lr * t.min_lr_ratio;
    min + (t.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

fn all_mean(group: &dyn ProcessGroup, value: f64) -> Result<f64> {
    let mut buf = [value as f32];
    group.all_reduce((&mut buf[..]).into(), ReduceOp::Avg)?;
    Ok(f64::from(buf[0]))
}

fn run<B, C, P>(job: Job<'_, B>, plan: P) -> Result<Summary>
where
    B: Backend,
    C: CheckpointStrategy,
    P: Plan<B, C>,
    <P::Model as AutodiffModule<Train<B, C>>>::InnerModule: CausalLm<Shard<B>>,
{
    let Job {
        recipe,
        spec,
        tokenizer,
        group,
        options,
        device,
        report,
    } = job;
    let (rank, world) = (group.rank(), group.world_size());
    let pp = recipe.parallel.pp;
    // A pipeline's world is pp stages x data-parallel ranks (DeviceMesh, stages outermost):
    // the strategy shards the model, and the batch is split, over the data-parallel group.
    let (dp_group, pp_group) = if pp > 1 {
        let shape = kiln_comm::MeshShape {
            pp,
            dp_shard: world / pp,
            ..Default::default()
        };
        let groups = kiln_comm::DeviceMesh::new(world, shape)?.groups(group.as_ref())?;
        (groups.dp.clone(), Some(groups.pp.clone()))
    } else {
        (group.clone(), None)
    };
    let (dp_rank, dp_world) = (dp_group.rank(), dp_group.world_size());
    let mut silent = Silent;
    let report: &mut dyn Report = if rank == 0 { report } else { &mut silent };
    let t = &recipe.train;
    let strategy = recipe.strategy()?;
    if pp > 1
        && !kiln_pipe::SHARDED_STAGE_THREADS
        && group.backend() == "local"
        && matches!(
            strategy,
            kiln_shard::Strategy::Zero3 | kiln_shard::Strategy::Hybrid { .. }
        )
    {
        fail!(
            Recipe,
            "parallel.strategy {strategy} with parallel.pp {pp} needs ranks as processes (kiln \
             launch) in this build: its burn-autodiff (without the fix of tracel-ai/burn#5194) \
             can deadlock a stage's backward all-gathers against another stage's sends when \
             stages are threads of one process. Use ddp, zero1 or zero2, or kiln launch"
        );
    }
    let out = &recipe.output.dir;
    let snapshots = out.join("snapshots");

    // The run directory: made (or cleared) by rank 0 while the others wait.
    let existing = snapshot::latest(&snapshots)?;
    if rank == 0 {
        std::fs::create_dir_all(&snapshots)
            .io(|| format!("cannot create {}", snapshots.display()))?;
        if existing.is_some() && !options.resume && options.overwrite {
            std::fs::remove_dir_all(&snapshots)
                .and_then(|()| std::fs::create_dir_all(&snapshots))
                .io(|| format!("cannot clear {}", snapshots.display()))?;
        }
        std::fs::write(out.join("recipe.toml"), recipe.to_toml())
            .io(|| format!("cannot write {}", out.join("recipe.toml").display()))?;
    }
    // Every rank writes snapshots there: a directory some rank does not see is named now.
    crate::shared_dir::check_shared(out, group.as_ref())?;
    if let Some(newest) = &existing
        && !options.resume
        && !options.overwrite
    {
        fail!(
            Snapshot,
            "{} already holds snapshots (newest: {}): pass --resume to continue that run, \
             --overwrite to start afresh, or another output directory",
            snapshots.display(),
            newest.display()
        );
    }
    let resume_from = if options.resume {
        let dir = existing.ok_or_else(|| {
            TrainError::Snapshot(format!(
                "--resume: there is no complete snapshot in {}",
                snapshots.display()
            ))
        })?;
        let snap = Snapshot::open(&dir)?;
        let meta = &snap.manifest.meta;
        if meta.model_kind != spec.kind() || meta.model_config != spec.config_json() {
            fail!(
                Snapshot,
                "the snapshot {} is of a different model: it holds a {} with config {}, the \
                 recipe asks for a {} with config {}",
                dir.display(),
                meta.model_kind,
                meta.model_config,
                spec.kind(),
                spec.config_json()
            );
        }
        Some(snap)
    } else {
        None
    };
    group.barrier()?;

    let corpus = Corpus::from_recipe(&recipe.data, t.seed, t.seq_len, tokenizer)?;
    let model = plan.create(recipe, device)?;
    // Counted whole, before a pipeline stage drops the other stages' parameters.
    let (params, trains) = (plan.params(&model), plan.describe(&model));
    let (pipe, model) = match &pp_group {
        Some(stages) => {
            let config = kiln_pipe::PipelineConfig {
                stages: pp,
                microbatches: recipe.parallel.microbatches,
                schedule: recipe.schedule()?,
                split: recipe.split(),
            };
            let rows = t.batch_size / dp_world / recipe.parallel.microbatches.max(1);
            let (pipe, model) = crate::plan::pipeline::<B, C, _>(
                model,
                stages.clone(),
                &config,
                group.as_ref(),
                [rows.max(1), t.seq_len],
            )?;
            (Some(pipe), model)
        }
        None => (None, model),
    };
    let bucket_bytes = match recipe.parallel.bucket_kib {
        // A quarter of the f32 parameter bytes.
        0 => model.num_params().clamp(256 << 10, 25 << 20),
        kib => kib << 10,
    };
    let shard_config = ShardConfig::new(strategy)
        .with_overlap(recipe.parallel.overlap)
        .with_bucket_bytes(bucket_bytes);
    let model: P::Model = kiln_shard::shard(model, dp_group.clone(), shard_config)?;
    // Memory is counted per world rank (sharding counted it by the data-parallel group's rank,
    // which pipeline stages share).
    kiln_shard::account::attribute_to_rank(rank);
    let optim_config = AdamWConfig::new()
        .with_beta_1(t.beta1 as f32)
        .with_beta_2(t.beta2 as f32)
        .with_weight_decay(t.weight_decay as f32);
    let mut optim = ShardedOptimizer::<_, B>::new(optim_config.init::<Train<B, C>, P::Model>());
    let precision = recipe.precision()?;
    if let Err(e) = kiln_shard::precision::probe::<B>(precision, device) {
        fail!(Recipe, "train.precision = \"{}\": {e}", precision.name());
    }
    let mut loss_scale = precision.needs_loss_scale().then_some(LossScale {
        scale: t.loss_scale,
        good_steps: 0,
        growth_interval: t.loss_scale_growth_interval,
    });
    let (mut model, first_step, mut rng, mut optimizer_time) = match &resume_from {
        Some(snap) => {
            if let (Some(s), Some((scale, good))) = (&mut loss_scale, snap.manifest.meta.loss_scale)
            {
                s.scale = scale;
                s.good_steps = good;
            }
            let model = plan.start(model, recipe, true)?;
            let model = load_params::<B, C, P::Model>(model, snap)?;
            let meta = &snap.manifest.meta;
            let record =
                load_optimizer::<B, C, P::Model>(&model, snap, meta.optimizer_time, device)?;
            optim = optim.load_record(record);
            (
                model,
                meta.step,
                SplitMix64(meta.data_rng),
                meta.optimizer_time,
            )
        }
        None => (
            plan.start(model, recipe, false)?,
            0,
            SplitMix64(mix(t.seed)),
            0,
        ),
    };

    let mut metrics = Metrics::new(rank == 0, first_step, &out.join("metrics.jsonl"))?;
    let tokens_per_step = t.batch_size * t.seq_len;
    let last_step = options.stop_after.map_or(t.steps, |s| s.min(t.steps));
    report.report(Event::Started(&RunInfo {
        model_kind: spec.kind().into(),
        params,
        trains,
        pipeline: pipe.as_ref().map(|pipe| {
            format!(
                "pipeline: {pp} stages x {dp_world} data-parallel ranks, {} micro-batches per \
                 step, {}; {}",
                recipe.parallel.microbatches,
                recipe.parallel.schedule,
                pipe.placement().to_string().trim_end().replace('\n', "; ")
            )
        }),
        strategy: strategy.to_string(),
        remat: t.remat.clone(),
        precision: precision.name().into(),
        world_size: world,
        tokens_per_step,
        data: match (tokenizer, &recipe.model.from) {
            (Tokenizer::Bytes, Some(dir)) if recipe.data.tokenizer == "auto" => format!(
                "{}; tokens are bytes: {} has no {}",
                corpus.description,
                dir.display(),
                kiln_hf::TOKENIZER_FILE
            ),
            _ => corpus.description.clone(),
        },
        unigram_entropy: corpus.unigram_entropy,
        floor: corpus.floor,
        resumed: resume_from.as_ref().map(|s| Resumed {
            dir: s.dir().to_path_buf(),
            world_size: s.manifest.meta.world_size,
            strategy: s.manifest.meta.strategy.clone(),
        }),
        out: out.clone(),
        first_step,
        last_step,
        total_steps: t.steps,
        progress_lines: recipe.output.progress_lines,
    }));

    let mut losses = Vec::new();
    // Steps skipped for non-finite gradients under f16 loss scaling.
    let mut skipped_steps = 0usize;
    let mut val_loss = None;
    let mut last_snapshot = None;
    let mut evaluated_at = None;
    drop(resume_from);
    let step_config = kiln_shard::StepConfig {
        clip: (t.grad_clip > 0.0).then_some(t.grad_clip),
        remat_budget: match recipe.remat()? {
            Remat::Budget(bytes) => Some(bytes),
            _ => None,
        },
        precision,
        ..Default::default()
    };
    // The validation loss: through the pipeline's stages, or each rank's whole model.
    let validate = |model: &P::Model| -> Result<Option<f64>> {
        match &pipe {
            None => evaluate::<B, C, P::Model>(model, &corpus, recipe, group.as_ref(), device),
            Some(pipe) if t.eval_batches > 0 => {
                let batches: Vec<_> = validation_batches(&corpus, t, dp_rank, dp_world)
                    .iter()
                    .map(|b| tensors::<Shard<B>>(b, device))
                    .collect();
                let total = kiln_shard::autocast(precision, || {
                    crate::plan::pipe_evaluate::<B, C, _>(pipe, model, &batches)
                })?;
                Ok(Some(all_mean(
                    group.as_ref(),
                    total / t.eval_batches as f64,
                )?))
            }
            Some(_) => Ok(None),
        }
    };
    // A sample of the model's text: through the pipeline's stages, or each rank's whole model.
    let vocab = spec.vocab_size();
    let sample = |model: &P::Model| {
        let logits = |window: &[i64]| {
            let pipe = pipe.as_ref().expect("pipelined");
            crate::plan::pipe_last_logits::<B, C, _>(pipe, model, window, vocab)
                .unwrap_or_else(|e| panic!("kiln: sampling through the pipeline: {e}"))
        };
        let pipelined: Option<&NextLogits> = pipe.is_some().then_some(&logits);
        sample_text(model, &corpus, tokenizer, t, precision, device, pipelined)
    };
    // Exposed communication: how long this rank's thread waits on collectives during steps.
    let (mut step_time, mut wait_time) = (Duration::ZERO, Duration::ZERO);
    // This rank's most demanding step, by heap peak.
    let mut worst: Option<StepMemory> = None;
    // Fine-tuning: the base's validation loss and sample, to compare with the end's.
    let (mut val_loss_before, mut sample_before) = (None, None);
    if first_step == 0 && recipe.lora.is_some() {
        val_loss_before = validate(&model)?;
        if let Some(v) = val_loss_before {
            metrics.record(serde_json::json!({"step": 0, "val_loss": v}))?;
            report.report(Event::Validated { step: 0, loss: v });
        }
        if t.sample_chars > 0 {
            sample_before = Some(sample(&model));
        }
    }
    let mut tally = kiln_pipe::Tally::default();
    for step in first_step + 1..=last_step {
        let step_start = Instant::now();
        let wait_start = kiln_shard::account::comm_wait(group.rank());
        let lr = lr_at(t, step);
        let b = batch(
            &corpus.train,
            &mut rng,
            t.batch_size,
            t.seq_len,
            dp_rank,
            dp_world,
        );
        let (x, y) = tensors::<Train<B, C>>(&b, device);
        let config = kiln_shard::StepConfig {
            loss_scale,
            // LoRA dropout's masks: from the seed, the step and the rank only.
            dropout_seed: Some(mix(t.seed
                ^ mix(step as u64)
                ^ ((group.rank() as u64) << 40))),
            ..step_config
        };
        let (stepped, stats) = match &pipe {
            Some(pipe) => {
                let (stepped, stats, stage) =
                    crate::plan::pipe_step(pipe, model, &mut optim, lr, &config, &x, &y);
                // The run's first step allocates what the others reuse: not tallied.
                if step > first_step + 1 {
                    tally.add(&stage);
                }
                (stepped, stats)
            }
            None => kiln_shard::step(model, &mut optim, lr, &config, |m, _| {
                causal_lm_loss(m.forward(x.clone()), y.clone())
            }),
        };
        model = stepped;
        loss_scale = stats.loss_scale;
        if stats.skipped {
            skipped_steps += 1;
        } else {
            optimizer_time += 1;
        }
        if let Some(m) = stats.memory
            && worst.is_none_or(|w| m.peak > w.peak)
        {
            worst = Some(m);
        }
        let grad_norm = stats.grad_norm;
        let loss = all_mean(group.as_ref(), stats.loss)?;
        let waited = kiln_shard::account::comm_wait(group.rank()).saturating_sub(wait_start);
        step_time += step_start.elapsed();
        wait_time += waited;
        if !loss.is_finite() && !stats.skipped {
            fail!(
                Diverged,
                "the loss is {loss} at step {step}: lower train.lr or raise train.grad_clip"
            );
        }
        losses.push(loss);
        let (tokens_per_s, elapsed_s) = (
            metrics.tokens_per_s(step, tokens_per_step),
            metrics.elapsed(),
        );
        metrics.record(serde_json::json!({
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "elapsed_s": elapsed_s,
            "comm_wait_s": waited.as_secs_f64(),
            "mem_peak_bytes": stats.memory.map(|m| m.peak),
            "mem_activation_bytes": stats.memory.map(|m| m.peak_of(MemKind::Activations)),
            "remat_recomputations": stats.remat.map(|r| r.recomputations),
            "remat_recompute_s": stats.remat.map(|r| r.recompute.as_secs_f64()),
            "remat_policy_s": stats.remat.map(|r| r.policy.as_secs_f64()),
            "loss_scale": config.loss_scale.map(|s| s.scale),
            "skipped": stats.skipped,
        }))?;
        report.report(Event::Step(&StepStats {
            step,
            loss,
            lr,
            tokens_per_s,
            elapsed_s,
            eta_s: elapsed_s / (step - first_step) as f64 * (t.steps - step) as f64,
        }));

        if t.eval_every > 0 && step.is_multiple_of(t.eval_every) || step == last_step {
            val_loss = validate(&model)?;
            evaluated_at = Some(step);
            if let Some(v) = val_loss {
                metrics.record(serde_json::json!({"step": step, "val_loss": v}))?;
                report.report(Event::Validated { step, loss: v });
            }
        }
        let every = recipe.output.snapshot_every;
        if every > 0 && step.is_multiple_of(every) || step == last_step {
            let meta = Meta {
                step,
                model_kind: spec.kind().into(),
                model_config: spec.config_json(),
                strategy: strategy.to_string(),
                world_size: world,
                data_rng: rng.0,
                optimizer_time,
                loss_scale: loss_scale.map(|s| (s.scale, s.good_steps)),
                recipe: recipe.to_toml(),
            };
            let dir = save::<B, C, P::Model>(
                &model,
                &optim,
                &meta,
                group.as_ref(),
                dp_group.as_ref(),
                pipe.as_ref(),
                recipe,
            )?;
            report.report(Event::Saved { step, dir: &dir });
            last_snapshot = Some(dir);
        }
    }
    if evaluated_at != Some(last_step) {
        val_loss = validate(&model)?;
    }

    let sample = (t.sample_chars > 0 && last_step == t.steps).then(|| sample(&model));
    let outputs = if last_step == t.steps {
        plan.finish(&model, recipe, rank, pipe.as_ref())?
    } else {
        Vec::new()
    };

    // The optimizer's state is measured once, at the end (its size is fixed after step 1).
    let mine = worst.map(|step| RankMemory {
        step,
        optimizer: kiln_shard::account::record_bytes::<Train<B, C>, _>(optim.to_record()),
    });
    let memory = gather_memory(group.as_ref(), mine)?;
    if !memory.is_empty() {
        let rows: Vec<serde_json::Value> = memory.iter().map(memory_json).collect();
        metrics.record(serde_json::json!({ "memory": rows }))?;
    }

    // The pipeline's bubble: a collective over each stage group.
    let bubble = match &pipe {
        Some(pipe) if tally.steps() > 0 => Some(pipe.bubble(&tally)?),
        _ => None,
    };
    if let Some(b) = &bubble {
        let stages: Vec<serde_json::Value> = b
            .stages
            .iter()
            .map(|s| serde_json::json!({ "compute_s": s.compute, "waiting_s": s.waiting, "schedule_s": s.wall }))
            .collect();
        metrics.record(serde_json::json!({ "pipeline": {
            "steps": b.steps,
            "bubble": b.measured,
            "textbook": b.textbook,
            "replayed": b.replayed,
            "stages": stages,
        }}))?;
    }

    let steps_run = last_step.saturating_sub(first_step);
    let tokens_per_s = metrics.tokens_per_s(first_step + steps_run, tokens_per_step);
    let summary = Summary {
        first_step,
        last_step: last_step.max(first_step),
        val_loss,
        tokens_per_s,
        comm_wait: wait_time.as_secs_f64() / step_time.as_secs_f64().max(1e-9),
        sample,
        val_loss_before: val_loss_before.take(),
        sample_before: sample_before.take(),
        outputs,
        snapshot: last_snapshot,
        losses,
        memory,
        skipped_steps,
        loss_scale: loss_scale.map(|s| s.scale),
        bubble,
    };
    report.report(Event::Finished {
        summary: &summary,
        elapsed_s: metrics.elapsed(),
    });
    Ok(summary)
}

/// The logits of the token after a window of token ids (a pipeline's, through its stages).
type NextLogits<'a> = dyn Fn(&[i64]) -> Vec<f32> + 'a;

/// A continuation of the validation text's start, sampled at temperature 0.8 (every rank
/// generates: a ZeRO-3 forward gathers parameters; rank 0 prints).
fn sample_text<B, C, M>(
    model: &M,
    corpus: &Corpus,
    tokenizer: &Tokenizer,
    t: &crate::TrainRecipe,
    precision: kiln_shard::Precision,
    device: &B::Device,
    pipelined: Option<&NextLogits>,
) -> String
where
    B: Backend,
    C: CheckpointStrategy,
    M: AutodiffModule<Train<B, C>>,
    M::InnerModule: CausalLm<Shard<B>>,
{
    // About 24 characters of prompt, whatever the tokenizer.
    let n = match tokenizer {
        Tokenizer::Bytes => 24,
        _ => 8,
    };
    let prompt: Vec<u32> = corpus.validation[..corpus.validation.len().min(n)].to_vec();
    let config = GenerateConfig {
        max_new_tokens: t.sample_chars,
        sampling: Sampling::Temperature {
            temperature: 0.8,
            seed: t.seed,
        },
        stop_token: None,
    };
    let new = kiln_shard::autocast(precision, || {
        let inner = model.valid();
        match pipelined {
            // Through the stages: every stage gets the logits and draws the same token.
            Some(logits) => generate_with(&prompt, &config, inner.max_seq_len(), logits),
            None => generate(&inner, &prompt, &config, device),
        }
    });
    format!("{}|{}", tokenizer.decode(&prompt), tokenizer.decode(&new))
}

fn tensors<AB: Backend>(
    b: &crate::data::Batch,
    device: &AB::Device,
) -> (Tensor<AB, 2, Int>, Tensor<AB, 2, Int>) {
    let shape = [b.rows, b.seq_len];
    (
        Tensor::from_data(TensorData::new(b.inputs.clone(), shape), device),
        Tensor::from_data(TensorData::new(b.targets.clone(), shape), device),
    )
}

/// This rank's rows of the validation batches: `eval_batches` draws from a stream of their own,
/// the same at every evaluation and every world size.
pub fn validation_batches(
    corpus: &Corpus,
    t: &crate::TrainRecipe,
    rank: usize,
    world: usize,
) -> Vec<crate::data::Batch> {
    let mut rng = SplitMix64(mix(t.seed ^ 0x7661_6c69_6461_7465));
    (0..t.eval_batches)
        .map(|_| {
            batch(
                &corpus.validation,
                &mut rng,
                t.batch_size,
                t.seq_len,
                rank,
                world,
            )
        })
        .collect()
}

/// The mean validation loss over `eval_batches` fixed batches (the same every time and at
/// every world size), or `None` when there are none.
fn evaluate<B, C, M>(
    model: &M,
    corpus: &Corpus,
    recipe: &Recipe,
    group: &dyn ProcessGroup,
    device: &B::Device,
) -> Result<Option<f64>>
where
    B: Backend,
    C: CheckpointStrategy,
    M: AutodiffModule<Train<B, C>>,
    M::InnerModule: CausalLm<Shard<B>>,
{
    let t = &recipe.train;
    if t.eval_batches == 0 {
        return Ok(None);
    }
    let inner = model.valid();
    let mut total = 0.0;
    for b in validation_batches(corpus, t, group.rank(), group.world_size()) {
        let (x, y) = tensors::<Shard<B>>(&b, device);
        // Evaluated in the precision the model trains in (as under torch.autocast).
        let loss: f64 = kiln_shard::autocast(recipe.precision()?, || {
            causal_lm_loss(inner.forward(x), y).into_scalar().elem()
        });
        total += loss;
    }
    Ok(Some(all_mean(group, total / t.eval_batches as f64)?))
}

/// The part of `t` this rank writes: its range split among the ranks holding the same values.
fn part_of<B: Backend>(name: String, t: &ShardTensor<B>, world: usize, rank: usize) -> Part {
    let (copies, copy) = match t {
        ShardTensor::Sharded(s) => {
            // Sharding groups are consecutive ranks (DeviceMesh: dp_shard inside dp_replicate).
            let size = s.group.world_size();
            (world / size, rank / size)
        }
        _ => (world, rank),
    };
    let piece = pieces::piece(t);
    let held = piece.range.clone();
    let mine = snapshot::share(held.clone(), copies, copy);
    Part {
        name,
        shape: t.shape().as_slice().to_vec(),
        start: mine.start,
        values: piece.values[mine.start - held.start..mine.end - held.start].to_vec(),
    }
}

/// Writes a snapshot: every rank its part of what it holds. `dp` is the group of ranks that
/// hold the same parameters (the world, or a pipeline stage's data-parallel ranks); a stage
/// writes neither the placeholders of other stages' parameters nor its copies of shared ones.
#[allow(clippy::too_many_arguments)]
fn save<B, C, M>(
    model: &M,
    optim: &ShardedOptimizer<OptimizerAdaptor<AdamW, M, Train<B, C>>, B>,
    meta: &Meta,
    group: &dyn ProcessGroup,
    dp: &dyn ProcessGroup,
    pipe: Option<&kiln_pipe::Pipeline>,
    recipe: &Recipe,
) -> Result<PathBuf>
where
    B: Backend,
    C: CheckpointStrategy,
    M: AutodiffModule<Train<B, C>>,
{
    let (world, rank) = (dp.world_size(), dp.rank());
    let mut parts = Vec::new();
    // Frozen parameters (a LoRA base) never change: the snapshot holds what trains.
    let trainable = pieces::trainable_paths::<Train<B, C>, M>(model);
    let other_stage = |path: &str, t: &ShardTensor<B>| {
        t.shape().num_elements() == 0 || pipe.is_some_and(|p| p.holds_copy(path))
    };
    pieces::visit_params::<B, Train<B, C>, M>(model, |path, _, t| {
        if trainable.contains(path) && !other_stage(path, t) {
            parts.push(part_of(format!("{TENSOR_PREFIX}{path}"), t, world, rank));
        }
    });
    let mut record = optim.to_record();
    let mut moments = OptimizerState::<B, C> {
        path: Vec::new(),
        record: &mut record,
        out: Vec::new(),
    };
    model.visit(&mut moments);
    for (path, m1, m2) in moments.out {
        if other_stage(&path, &m1) {
            continue;
        }
        parts.push(part_of(format!("{M1_PREFIX}{path}"), &m1, world, rank));
        parts.push(part_of(format!("{M2_PREFIX}{path}"), &m2, world, rank));
    }
    snapshot::save(
        &recipe.output.dir.join("snapshots"),
        meta,
        parts,
        group,
        recipe.output.keep,
    )
}

type Record<B, C> = HashMap<ParamId, AdaptorRecord<AdamW, Train<B, C>>>;

/// Collects each trained parameter's AdamW moments, with its module path.
struct OptimizerState<'a, B: Backend, C: CheckpointStrategy> {
    path: Vec<String>,
    record: &'a mut HashMap<ParamId, AdaptorRecord<AdamW, Train<B, C>>>,
    out: Vec<(String, ShardTensor<B>, ShardTensor<B>)>,
}

impl<B: Backend, C: CheckpointStrategy> ModuleVisitor<Train<B, C>> for OptimizerState<'_, B, C> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train<B, C>, D>>) {
        if let Some(r) = self.record.remove(&param.id) {
            let state: AdamWState<Shard<B>, D> = r.into_state();
            self.out.push((
                self.path.join("."),
                pieces::primitive(state.momentum.moment_1),
                pieces::primitive(state.momentum.moment_2),
            ));
        }
    }
}

pub(crate) fn load_params<B, C, M>(model: M, snap: &Snapshot) -> Result<M>
where
    B: Backend,
    C: CheckpointStrategy,
    M: AutodiffModule<Train<B, C>>,
{
    let mut error = None;
    let trainable = pieces::trainable_paths::<Train<B, C>, M>(&model);
    let model = pieces::map_params::<B, Train<B, C>, M>(model, |path, t| {
        if !trainable.contains(path) || t.shape().num_elements() == 0 {
            // Frozen: loaded from the base, as at the start. Empty: another pipeline stage's.
            return pieces::piece(t).values.to_vec();
        }
        let range = held_range(t);
        let shape = t.shape().as_slice().to_vec();
        match snap.read(&format!("{TENSOR_PREFIX}{path}"), &shape, range.clone()) {
            Ok(v) => v,
            Err(e) => {
                error.get_or_insert(e);
                vec![0.0; range.len()]
            }
        }
    });
    match error {
        Some(e) => Err(e),
        None => Ok(model),
    }
}

/// AdamW's record for `model`'s parameters from the snapshot, laid out as this run's strategy
/// keeps optimizer state (whole, or sharded over the optimizer's group).
fn load_optimizer<B, C, M>(
    model: &M,
    snap: &Snapshot,
    time: usize,
    device: &B::Device,
) -> Result<Record<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    M: AutodiffModule<Train<B, C>>,
{
    struct Load<'a, B: Backend, C: CheckpointStrategy> {
        path: Vec<String>,
        snap: &'a Snapshot,
        time: usize,
        group: Option<Arc<dyn ProcessGroup>>,
        device: &'a B::Device,
        record: HashMap<ParamId, AdaptorRecord<AdamW, Train<B, C>>>,
        error: Option<TrainError>,
    }
    impl<B: Backend, C: CheckpointStrategy> Load<'_, B, C> {
        fn moment<const D: usize>(
            &self,
            name: String,
            shape: &[usize],
        ) -> Result<Tensor<Shard<B>, D>> {
            let numel = shape.iter().product();
            let range = match &self.group {
                Some(g) => shard_range(numel, g.world_size(), g.rank()),
                None => 0..numel,
            };
            let values = self.snap.read(&name, shape, range)?;
            Ok(pieces::tensor(pieces::from_values::<B>(
                shape.to_vec().into(),
                values,
                self.group.as_ref(),
                self.device,
                DType::F32,
            )))
        }
    }
    impl<B: Backend, C: CheckpointStrategy> ModuleVisitor<Train<B, C>> for Load<'_, B, C> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train<B, C>, D>>) {
            let path = self.path.join(".");
            let m1 = format!("{M1_PREFIX}{path}");
            if self.error.is_some() || !self.snap.manifest.tensors.contains_key(&m1) {
                return; // Not trained yet (or frozen): no state.
            }
            let shape = param.val().dims().to_vec();
            if shape.iter().product::<usize>() == 0 {
                return; // Another pipeline stage's parameter.
            }
            let moments = self
                .moment::<D>(m1, &shape)
                .and_then(|a| Ok((a, self.moment::<D>(format!("{M2_PREFIX}{path}"), &shape)?)));
            match moments {
                Ok((m1, m2)) => {
                    let state = AdamWState::new(AdaptiveMomentumState::new(self.time, m1, m2));
                    self.record
                        .insert(param.id, AdaptorRecord::from_state(state));
                }
                Err(e) => self.error = Some(e),
            }
        }
    }
    let mut load = Load::<B, C> {
        path: Vec::new(),
        snap,
        time,
        group: optimizer_state_group(model),
        device,
        record: HashMap::new(),
        error: None,
    };
    model.visit(&mut load);
    match load.error {
        Some(e) => Err(e),
        None => Ok(load.record),
    }
}
