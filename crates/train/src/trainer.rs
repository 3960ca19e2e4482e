//! The training job of one rank: [`train_rank`] picks the model and what trains, and a
//! [`Trainer`] runs it.
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
use crate::eval::{NextLogits, all_mean, evaluate, sample_text, tensors, validation_batches};
use crate::memory;
use crate::metrics::Metrics;
use crate::pipelined::{pipe_evaluate, pipe_last_logits, pipe_step};
use crate::recipe::TokenizerSource;
use crate::report::{Event, Log, Progress, Report, Resumed, RunInfo};
use crate::snapshot::{self, Meta, Snapshot};
use crate::state::{SaveTo, load_optimizer, load_params, save};
use crate::summary::{RankMemory, RunOptions, Summary, gather_memory, memory_json};
use crate::trained::{Adapters, Full, Trained};
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, Optimizer};
use burn::tensor::backend::Backend;
use kiln::{Adapt, LmStages, Mesh, Parallel, ParallelPlan, Remat, parallelize};
use kiln_comm::ProcessGroup;
use kiln_hf::{Pretrained, Tokenizer};
use kiln_lora::Lora;
use kiln_model::{CausalLm, Staged, causal_lm_loss};
use kiln_pipe::{Pipeline, PipelineConfig, Tally};
use kiln_shard::account::{MemKind, StepMemory};
use kiln_shard::{
    LossScale, Shard, ShardConfig, ShardedOptimizer, StepConfig, StepStats, TpPlan, Train,
};
use kiln_zoo::{ModelConfig, with_model_type};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    let report = &mut Log::default();
    train_rank_with::<B>(recipe, group, launched, options, device, report)
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
    let model = recipe.model_config(&tokenizer)?;
    let job = Job {
        recipe,
        model,
        tokenizer: &tokenizer,
        group,
        options,
        device,
        report,
    };
    // Burn's op-level checkpointing is autodiff's type parameter.
    match recipe.train.remat {
        Remat::Balanced => by_model::<B, BalancedCheckpointing>(job),
        _ => by_model::<B, NoCheckpointing>(job),
    }
}

/// What a rank's run is given, the same whatever the model and what trains.
struct Job<'a, B: Backend> {
    recipe: &'a Recipe,
    model: ModelConfig,
    tokenizer: &'a Tokenizer,
    group: Arc<dyn ProcessGroup>,
    options: RunOptions,
    device: &'a B::Device,
    report: &'a mut dyn Report,
}

fn by_model<B: Backend, C: CheckpointStrategy>(job: Job<'_, B>) -> Result<Summary> {
    let config = job.model.clone();
    with_model_type!(config, M, c => by_trained::<B, C, M<Train<B, C>>>(job, c))
}

/// The model `M` trained whole, or LoRA adapters on it when the recipe has `[lora]`.
fn by_trained<B, C, M>(job: Job<'_, B>, config: M::Config) -> Result<Summary>
where
    B: Backend,
    C: CheckpointStrategy,
    M: Pretrained<Train<B, C>>
        + CausalLm<Train<B, C>>
        + AutodiffModule<Train<B, C>>
        + Staged<Train<B, C>>
        + burn::module::ModuleDisplay,
    M::InnerModule: CausalLm<Shard<B>> + Staged<Shard<B>>,
    Lora<Train<B, C>, M>: AutodiffModule<Train<B, C>>,
    <Lora<Train<B, C>, M> as AutodiffModule<Train<B, C>>>::InnerModule:
        CausalLm<Shard<B>> + Staged<Shard<B>>,
{
    let _model = PhantomData;
    match job.recipe.lora.clone() {
        None => Trainer::new(job, Full::<M, _> { config, _model })?.run(),
        Some(lora) => {
            let seed = job.recipe.train.seed;
            let trained = Adapters::<M, _> {
                config,
                lora,
                seed,
                _model,
            };
            Trainer::new(job, trained)?.run()
        }
    }
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

/// The plan `parallelize` applies for a recipe.
pub fn parallel_plan(recipe: &Recipe) -> ParallelPlan {
    let (t, p) = (&recipe.train, &recipe.parallel);
    ParallelPlan {
        shard: ShardConfig::new(p.strategy).with_overlap(p.overlap),
        bucket_bytes: (p.bucket_kib > 0).then_some(p.bucket_kib << 10),
        pipeline: (p.pp > 1).then(|| PipelineConfig {
            stages: p.pp,
            microbatches: p.microbatches,
            schedule: p.schedule,
            split: p.split.clone(),
        }),
        remat: t.remat,
        precision: t.precision,
        loss_scale: t.precision.needs_loss_scale().then_some(LossScale {
            scale: t.loss_scale,
            good_steps: 0,
            growth_interval: t.loss_scale_growth_interval,
        }),
        clip: (t.grad_clip > 0.0).then_some(t.grad_clip),
        tp: p.tp,
        tp_plan: TpPlan::default(),
    }
}

/// The tensor-parallel plan of a recipe for a model: `parallel.tp_plan`, or the model's own;
/// the model's sizes checked against `parallel.tp` (heads, KV heads, hidden sizes).
///
/// # Errors
/// A plan that does not parse; sizes that `tp` does not divide.
pub fn tp_plan(recipe: &Recipe, config: &ModelConfig) -> Result<TpPlan> {
    let p = &recipe.parallel;
    if p.tp <= 1 {
        return Ok(TpPlan::default());
    }
    if let Err(e) = config.check_tp(p.tp) {
        fail!(World, "parallel.tp = {}: {e}", p.tp);
    }
    let text = match p.tp_plan.trim() {
        "" => config.tp_plan(),
        plan => plan,
    };
    Ok(TpPlan::parse(text)
        .map_err(|e| TrainError::Recipe(format!("parallel.tp_plan: {e}")))?
        .with_sequence_parallel(p.sequence_parallel))
}

/// The model a run trains.
type ModelOf<B, C, P> = <P as Trained<B, C>>::Model;

type Optim<B, C, M> = ShardedOptimizer<OptimizerAdaptor<AdamW, M, Train<B, C>>, B>;

/// One rank's run: set up by [`Trainer::new`], driven by [`Trainer::run`].
pub(crate) struct Trainer<'a, B: Backend, C: CheckpointStrategy, P: Trained<B, C>> {
    /// [`RunOptions::steps_only`].
    steps_only: bool,
    recipe: &'a Recipe,
    config: ModelConfig,
    tokenizer: &'a Tokenizer,
    device: &'a B::Device,
    /// Rank 0's report (the other ranks report nothing).
    report: Option<&'a mut dyn Report>,
    mesh: Mesh,
    trained: P,
    corpus: Corpus,
    model: Option<ModelOf<B, C, P>>,
    optim: Optim<B, C, ModelOf<B, C, P>>,
    pipe: Option<Pipeline>,
    step_config: StepConfig,
    /// The batch stream (its state goes into snapshots).
    rng: SplitMix64,
    /// AdamW's step count (skipped steps excluded).
    optimizer_time: usize,
    first_step: usize,
    last_step: usize,
    metrics: Metrics,
    /// What the run did so far.
    done: Done,
    /// With memory snapshots on several machines: where this rank's copy goes.
    memory_peers: Option<memory::Peers>,
}

/// What a run accumulates, step by step.
#[derive(Default)]
struct Done {
    losses: Vec<f64>,
    skipped_steps: usize,
    val_loss: Option<f64>,
    evaluated_at: Option<usize>,
    last_snapshot: Option<PathBuf>,
    /// Time in steps, and of it blocked on collectives.
    step_time: Duration,
    wait_time: Duration,
    /// This rank's most demanding step, by heap peak.
    worst: Option<StepMemory>,
    val_loss_before: Option<f64>,
    sample_before: Option<String>,
    tally: Tally,
    /// Tensor parallelism's communication in the last step.
    tensor_parallel: Option<kiln_shard::tp::TpStats>,
}

impl<'a, B, C, P> Trainer<'a, B, C, P>
where
    B: Backend,
    C: CheckpointStrategy,
    P: Trained<B, C> + Adapt<B, C, P::Base, Model = <P as Trained<B, C>>::Model>,
    LmStages: kiln::Stages<B, C, <P as Trained<B, C>>::Model>,
{
    /// The run directory checked, the model built, parallelized and loaded (from the snapshot
    /// when resuming), the optimizer made.
    fn new(job: Job<'a, B>, trained: P) -> Result<Self> {
        let Job {
            recipe,
            model: config,
            tokenizer,
            group,
            options,
            device,
            report,
        } = job;
        let mut plan = parallel_plan(recipe);
        plan.tp_plan = tp_plan(recipe, &config)?;
        let mesh = Mesh::new(group.clone(), &plan)?;
        let (resume_from, memory_peers) = prepare_dir(recipe, &config, group.as_ref(), options)?;
        let t = &recipe.train;
        let corpus = Corpus::from_recipe(&recipe.data, t.seed, t.seq_len, tokenizer)?;
        let rows = t.batch_size / mesh.dp.world_size() / recipe.parallel.microbatches.max(1);
        let stages = LmStages {
            microbatch: [rows.max(1), t.seq_len],
        };
        let base = trained.base(device);
        let Parallel {
            model,
            pipeline: pipe,
            step: step_config,
            params,
            trains,
            tp,
        } = parallelize(base, &trained, &stages, &plan, &mesh, device)?;
        let optim_config = AdamWConfig::new()
            .with_beta_1(t.beta1 as f32)
            .with_beta_2(t.beta2 as f32)
            .with_weight_decay(t.weight_decay as f32);
        let mut optim = ShardedOptimizer::new(optim_config.init::<Train<B, C>, ModelOf<B, C, P>>());
        let mut step_config = step_config;
        let (model, first_step, rng, optimizer_time) = match &resume_from {
            Some(snap) => {
                let meta = &snap.manifest.meta;
                if let (Some(s), Some((scale, good))) =
                    (&mut step_config.loss_scale, meta.loss_scale)
                {
                    s.scale = scale;
                    s.good_steps = good;
                }
                let model = trained.start(model, recipe, true)?;
                let model = load_params::<B, C, ModelOf<B, C, P>>(model, snap)?;
                let record = load_optimizer::<B, C, ModelOf<B, C, P>>(
                    &model,
                    snap,
                    meta.optimizer_time,
                    device,
                )?;
                optim = optim.load_record(record);
                let rng = SplitMix64(meta.data_rng);
                (model, meta.step, rng, meta.optimizer_time)
            }
            // Planning on shapes reads no weights: a base's are initialised instead.
            None if options.steps_only && recipe.model.from.is_some() => {
                (model, 0, SplitMix64(mix(t.seed)), 0)
            }
            None => {
                let model = trained.start(model, recipe, false)?;
                (model, 0, SplitMix64(mix(t.seed)), 0)
            }
        };
        let rank = group.rank();
        let out = &recipe.output.dir;
        let metrics = Metrics::new(rank == 0, first_step, &out.join("metrics.jsonl"))?;
        let last_step = options.stop_after.map_or(t.steps, |s| s.min(t.steps));
        let mut trainer = Trainer {
            steps_only: options.steps_only,
            recipe,
            config,
            tokenizer,
            device,
            report: (rank == 0).then_some(report),
            mesh,
            trained,
            corpus,
            model: Some(model),
            optim,
            pipe,
            step_config,
            rng,
            optimizer_time,
            first_step,
            last_step,
            metrics,
            done: Done::default(),
            memory_peers,
        };
        let mut info = trainer.info(params, trains, resume_from.as_ref());
        info.tensor_parallel = tp.map(|r| {
            format!(
                "tensor parallel{}: {} ranks per layer ({} x {} x {} = pp x dp x tp); {r}; {}",
                match recipe.parallel.sequence_parallel {
                    true => " with sequence parallelism",
                    false => "",
                },
                recipe.parallel.tp,
                recipe.parallel.pp,
                trainer.mesh.dp.world_size(),
                recipe.parallel.tp,
                r.split
                    .iter()
                    .map(|(path, dims, dim, blocks)| {
                        let how = if *dim + 1 == dims.len() && dims.len() > 1 {
                            "cols"
                        } else if dims.len() == 1 {
                            "out"
                        } else {
                            "rows"
                        };
                        match blocks {
                            1 => format!("{path} {dims:?} by {how}"),
                            k => format!("{path} {dims:?} by {how} in {k} blocks"),
                        }
                    })
                    .take(6)
                    .collect::<Vec<_>>()
                    .join(", ")
                    + if r.split.len() > 6 { ", ..." } else { "" }
            )
        });
        trainer.report(Event::Started(&info));
        Ok(trainer)
    }

    /// The run: the base's validation (fine-tuning), the steps with their validations and
    /// snapshots, and the end.
    fn run(mut self) -> Result<Summary> {
        let t = &self.recipe.train;
        if self.first_step == 0 && self.recipe.lora.is_some() && !self.steps_only {
            self.done.val_loss_before = self.validate(0)?;
            if t.sample_chars > 0 {
                self.done.sample_before = Some(self.sample()?);
            }
        }
        for step in self.first_step + 1..=self.last_step {
            self.step(step)?;
            if self.steps_only {
                continue;
            }
            if t.eval_every > 0 && step.is_multiple_of(t.eval_every) || step == self.last_step {
                self.done.val_loss = self.validate(step)?;
                self.done.evaluated_at = Some(step);
            }
            let output = &self.recipe.output;
            let (every, in_memory) = (output.snapshot_every, output.memory_snapshot_every);
            if every > 0 && step.is_multiple_of(every) || step == self.last_step {
                self.snapshot(step, false)?;
            } else if in_memory > 0 && step.is_multiple_of(in_memory) {
                self.snapshot(step, true)?;
            }
        }
        self.finish()
    }

    /// Hands `event` to rank 0's report.
    fn report(&mut self, event: Event<'_>) {
        if let Some(report) = self.report.as_mut() {
            report.report(event);
        }
    }

    fn model(&self) -> &ModelOf<B, C, P> {
        self.model.as_ref().expect("the model between steps")
    }

    /// One training step: this rank's rows of the global batch, kiln's step (or the
    /// pipeline's), the global loss recorded and reported.
    fn step(&mut self, step: usize) -> Result<()> {
        let (t, group) = (&self.recipe.train, self.mesh.world.clone());
        let (dp_rank, dp_world) = (self.mesh.dp.rank(), self.mesh.dp.world_size());
        let step_start = Instant::now();
        let wait_start = kiln_shard::account::comm_wait(group.rank());
        let lr = lr_at(t, step);
        let b = batch(
            &self.corpus.train,
            &mut self.rng,
            t.batch_size,
            t.seq_len,
            dp_rank,
            dp_world,
        );
        let (x, y) = tensors::<Train<B, C>>(&b, self.device);
        let config = StepConfig {
            // LoRA dropout's masks: from the seed, the step and the rank only (equal across a
            // tensor-parallel group, the mesh's fastest axis: its ranks compute one model).
            dropout_seed: Some(mix(t.seed
                ^ mix(step as u64)
                ^ (((group.rank() / self.recipe.parallel.tp.max(1)) as u64) << 40))),
            ..self.step_config
        };
        let model = self.model.take().expect("the model between steps");
        kiln_shard::tp::reset_stats();
        let (model, stats) = match &self.pipe {
            Some(pipe) => {
                let (model, stats, stage) =
                    pipe_step(pipe, model, &mut self.optim, lr, &config, &x, &y)?;
                // The run's first step allocates what the others reuse: not tallied.
                if step > self.first_step + 1 {
                    self.done.tally.add(&stage);
                }
                (model, stats)
            }
            None => kiln_shard::step(model, &mut self.optim, lr, &config, |m, _| {
                causal_lm_loss(m.forward(x.clone()), y.clone())
            })?,
        };
        self.model = Some(model);
        if self.recipe.parallel.tp > 1 {
            self.done.tensor_parallel = Some(kiln_shard::tp::stats());
        }
        self.step_config.loss_scale = stats.loss_scale;
        match stats.skipped {
            true => self.done.skipped_steps += 1,
            false => self.optimizer_time += 1,
        }
        if let Some(m) = stats.memory
            && self.done.worst.is_none_or(|w| m.peak > w.peak)
        {
            self.done.worst = Some(m);
        }
        let loss = all_mean(group.as_ref(), stats.loss)?;
        let waited = kiln_shard::account::comm_wait(group.rank()).saturating_sub(wait_start);
        self.done.step_time += step_start.elapsed();
        self.done.wait_time += waited;
        if !loss.is_finite() && !stats.skipped {
            return Err(TrainError::Diverged { step, loss });
        }
        self.done.losses.push(loss);
        // `kiln launch`'s progress signal, from every rank: the steps it counts across restarts
        // and names a hang with.
        kiln_comm::progress::step(step);
        self.record_step(step, lr, loss, waited, &config, &stats)
    }

    /// A step's line in `metrics.jsonl` and its progress event.
    fn record_step(
        &mut self,
        step: usize,
        lr: f64,
        loss: f64,
        waited: Duration,
        config: &StepConfig,
        stats: &StepStats,
    ) -> Result<()> {
        let t = &self.recipe.train;
        let tokens_per_step = t.batch_size * t.seq_len;
        let tokens_per_s = self.metrics.tokens_per_s(step, tokens_per_step);
        let elapsed_s = self.metrics.elapsed();
        self.metrics.record(serde_json::json!({
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": stats.grad_norm,
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
            "tp_all_reduces": self.done.tensor_parallel.as_ref().map(|t| t.all_reduces),
            "tp_all_reduce_bytes": self.done.tensor_parallel.as_ref().map(|t| t.all_reduce_bytes),
            "tp_formed_whole": self.done.tensor_parallel.as_ref().map(|t| t.total_gathers()),
        }))?;
        self.report(Event::Step(&Progress {
            step,
            loss,
            lr,
            tokens_per_s,
            elapsed_s,
            eta_s: elapsed_s / (step - self.first_step) as f64 * (t.steps - step) as f64,
        }));
        Ok(())
    }

    /// The validation loss after `step`: through the pipeline's stages, or each rank's whole
    /// model; recorded and reported.
    fn validate(&mut self, step: usize) -> Result<Option<f64>> {
        let t = &self.recipe.train;
        let (group, dp) = (&self.mesh.world, &self.mesh.dp);
        let model = self.model();
        let loss = match &self.pipe {
            None => evaluate::<B, C, ModelOf<B, C, P>>(
                model,
                &self.corpus,
                self.recipe,
                group.as_ref(),
                dp.as_ref(),
                self.device,
            )?,
            Some(pipe) if t.eval_batches > 0 => {
                let batches: Vec<_> =
                    validation_batches(&self.corpus, t, dp.rank(), dp.world_size())
                        .iter()
                        .map(|b| tensors::<Shard<B>>(b, self.device))
                        .collect();
                let total = kiln_shard::autocast(t.precision, || {
                    pipe_evaluate::<B, C, _>(pipe, model, &batches)
                })?;
                Some(all_mean(group.as_ref(), total / t.eval_batches as f64)?)
            }
            Some(_) => None,
        };
        if let Some(v) = loss {
            self.metrics
                .record(serde_json::json!({"step": step, "val_loss": v}))?;
            self.report(Event::Validated { step, loss: v });
        }
        Ok(loss)
    }

    /// A sample of the model's text: through the pipeline's stages, or each rank's whole model.
    fn sample(&self) -> Result<String> {
        let vocab = self.config.vocab_size();
        let model = self.model();
        let failed = std::cell::RefCell::new(None);
        let logits = |window: &[i64]| match &self.pipe {
            Some(pipe) => {
                pipe_last_logits::<B, C, _>(pipe, model, window, vocab).unwrap_or_else(|e| {
                    // Every stage fails alike; the sample stops with the error.
                    failed.borrow_mut().get_or_insert(e);
                    vec![0.0; vocab]
                })
            }
            None => Vec::new(),
        };
        let pipelined: Option<&NextLogits> = self.pipe.is_some().then_some(&logits);
        let t = &self.recipe.train;
        let text = sample_text(
            model,
            &self.corpus,
            self.tokenizer,
            t,
            t.precision,
            self.device,
            pipelined,
        );
        match failed.into_inner() {
            Some(e) => Err(e),
            None => Ok(text),
        }
    }

    /// A snapshot of `step`: every rank writes its part of what it holds, to the run's
    /// `snapshots/` or (`in_memory`) to this machine's memory, where only the newest stays.
    fn snapshot(&mut self, step: usize, in_memory: bool) -> Result<()> {
        let recipe = self.recipe;
        let root = match in_memory {
            true => memory::root(&recipe.output.dir),
            false => recipe.output.dir.join("snapshots"),
        };
        let to = match (in_memory, self.memory_peers) {
            (true, Some(peers)) => SaveTo::WithPeer { root: &root, peers },
            (true, None) => SaveTo::Here {
                root: &root,
                keep: 1,
            },
            (false, _) => SaveTo::Here {
                root: &root,
                keep: recipe.output.keep,
            },
        };
        let meta = Meta {
            step,
            model_kind: self.config.kind().name().into(),
            model_config: self.config.to_json(),
            strategy: recipe.parallel.strategy.to_string(),
            world_size: self.mesh.world.world_size(),
            data_rng: self.rng.0,
            optimizer_time: self.optimizer_time,
            loss_scale: self.step_config.loss_scale.map(|s| (s.scale, s.good_steps)),
            recipe: recipe.to_toml(),
        };
        let dir = save::<B, C, ModelOf<B, C, P>>(
            self.model(),
            &self.optim,
            &meta,
            self.mesh.world.as_ref(),
            self.mesh.stage.as_ref(),
            self.mesh.shape.tp,
            self.pipe.as_ref(),
            to,
        )?;
        if !in_memory {
            self.report(Event::Saved { step, dir: &dir });
            self.done.last_snapshot = Some(dir);
        }
        Ok(())
    }

    /// The end: the last validation and sample, what the run leaves, every rank's memory, the
    /// pipeline's bubble, the summary.
    fn finish(mut self) -> Result<Summary> {
        let t = &self.recipe.train;
        let (first_step, last_step) = (self.first_step, self.last_step);
        // The last snapshot complete (written asynchronously where the caller chose so) before the
        // summary names it.
        snapshot::flush()?;
        // A finished run's memory snapshots are older than its last disk snapshot: the memory
        // goes back (once every rank's writes are done).
        if self.recipe.output.memory_snapshot_every > 0 && last_step == t.steps {
            self.mesh.world.barrier()?;
            if machine_leader(self.mesh.world.as_ref()) {
                let memory = memory::root(&self.recipe.output.dir);
                std::fs::remove_dir_all(&memory)
                    .io(|| format!("cannot remove {}", memory.display()))?;
            }
        }
        if self.done.evaluated_at != Some(last_step) && !self.steps_only {
            self.done.val_loss = self.validate_quietly()?;
        }
        let sample = match t.sample_chars > 0 && last_step == t.steps && !self.steps_only {
            true => Some(self.sample()?),
            false => None,
        };
        let rank = self.mesh.world.rank();
        let outputs = match last_step == t.steps && !self.steps_only {
            true => self
                .trained
                .finish(self.model(), self.recipe, rank, self.pipe.as_ref())?,
            false => Vec::new(),
        };
        let memory = self.memory()?;
        let bubble = self.bubble()?;
        let tokens_per_step = t.batch_size * t.seq_len;
        let steps_run = last_step.saturating_sub(first_step);
        let done = std::mem::take(&mut self.done);
        let summary = Summary {
            first_step,
            last_step: last_step.max(first_step),
            val_loss: done.val_loss,
            tokens_per_s: self
                .metrics
                .tokens_per_s(first_step + steps_run, tokens_per_step),
            comm_wait: done.wait_time.as_secs_f64() / done.step_time.as_secs_f64().max(1e-9),
            sample,
            val_loss_before: done.val_loss_before,
            sample_before: done.sample_before,
            outputs,
            snapshot: done.last_snapshot,
            losses: done.losses,
            memory,
            skipped_steps: done.skipped_steps,
            loss_scale: self.step_config.loss_scale.map(|s| s.scale),
            bubble,
            tensor_parallel: done.tensor_parallel,
        };
        self.report(Event::Finished {
            summary: &summary,
            elapsed_s: self.metrics.elapsed(),
        });
        Ok(summary)
    }

    /// The validation loss without recording it (the end of a run whose last step was not
    /// validated: `stop_after` between evaluations).
    fn validate_quietly(&mut self) -> Result<Option<f64>> {
        let t = &self.recipe.train;
        let (group, dp) = (&self.mesh.world, &self.mesh.dp);
        let model = self.model();
        Ok(match &self.pipe {
            None => evaluate::<B, C, ModelOf<B, C, P>>(
                model,
                &self.corpus,
                self.recipe,
                group.as_ref(),
                dp.as_ref(),
                self.device,
            )?,
            Some(pipe) if t.eval_batches > 0 => {
                let batches: Vec<_> =
                    validation_batches(&self.corpus, t, dp.rank(), dp.world_size())
                        .iter()
                        .map(|b| tensors::<Shard<B>>(b, self.device))
                        .collect();
                let total = kiln_shard::autocast(t.precision, || {
                    pipe_evaluate::<B, C, _>(pipe, model, &batches)
                })?;
                Some(all_mean(group.as_ref(), total / t.eval_batches as f64)?)
            }
            Some(_) => None,
        })
    }

    /// Every rank's memory in its most demanding step (a collective), recorded.
    fn memory(&mut self) -> Result<Vec<RankMemory>> {
        // The optimizer's state is measured once, at the end (its size is fixed after step 1).
        let mine = self.done.worst.map(|step| RankMemory {
            step,
            optimizer: kiln_shard::account::record_bytes::<Train<B, C>, _>(self.optim.to_record()),
        });
        let memory = gather_memory(self.mesh.world.as_ref(), mine)?;
        if !memory.is_empty() {
            let rows: Vec<serde_json::Value> = memory.iter().map(memory_json).collect();
            self.metrics.record(serde_json::json!({ "memory": rows }))?;
        }
        Ok(memory)
    }

    /// The pipeline's bubble (a collective over each stage group), recorded.
    fn bubble(&mut self) -> Result<Option<kiln_pipe::Bubble>> {
        let bubble = match &self.pipe {
            Some(pipe) if self.done.tally.steps() > 0 => Some(pipe.bubble(&self.done.tally)?),
            _ => None,
        };
        if let Some(b) = &bubble {
            let stages: Vec<serde_json::Value> = b
                .stages
                .iter()
                .map(|s| serde_json::json!({ "compute_s": s.compute, "waiting_s": s.waiting, "schedule_s": s.wall }))
                .collect();
            self.metrics.record(serde_json::json!({ "pipeline": {
                "steps": b.steps,
                "bubble": b.measured,
                "textbook": b.textbook,
                "replayed": b.replayed,
                "stages": stages,
            }}))?;
        }
        Ok(bubble)
    }

    /// What the start line says.
    fn info(&self, params: usize, trains: Option<String>, resumed: Option<&Snapshot>) -> RunInfo {
        let (recipe, t) = (self.recipe, &self.recipe.train);
        let p = &recipe.parallel;
        let corpus = &self.corpus;
        RunInfo {
            model_kind: self.config.kind().name().into(),
            params,
            trains,
            tensor_parallel: None,
            pipeline: self.pipe.as_ref().map(|pipe| {
                format!(
                    "pipeline: {} stages x {} data-parallel ranks, {} micro-batches per step, \
                     {}; {}",
                    p.pp,
                    self.mesh.dp.world_size(),
                    p.microbatches,
                    p.schedule,
                    pipe.placement().to_string().trim_end().replace('\n', "; ")
                )
            }),
            strategy: p.strategy.to_string(),
            remat: crate::recipe::remat_text(&t.remat),
            precision: t.precision.name().into(),
            world_size: self.mesh.world.world_size(),
            tokens_per_step: t.batch_size * t.seq_len,
            data: match (self.tokenizer, &recipe.model.from) {
                (Tokenizer::Bytes, Some(dir)) if recipe.data.tokenizer == TokenizerSource::Auto => {
                    format!(
                        "{}; tokens are bytes: {} has no {}",
                        corpus.description,
                        dir.display(),
                        kiln_hf::TOKENIZER_FILE
                    )
                }
                _ => corpus.description.clone(),
            },
            unigram_entropy: corpus.unigram_entropy,
            floor: corpus.floor,
            resumed: resumed.map(|s| Resumed {
                dir: s.dir().to_path_buf(),
                world_size: s.manifest.meta.world_size,
                strategy: s.manifest.meta.strategy.clone(),
            }),
            out: recipe.output.dir.clone(),
            first_step: self.first_step,
            last_step: self.last_step,
            total_steps: t.steps,
            progress_lines: recipe.output.progress_lines,
        }
    }
}

/// The run directory: made (or cleared) by rank 0 while the others wait, checked visible to
/// every rank; the snapshot to resume, when resuming (of the same model): the newest of the
/// disk's and (with `output.memory_snapshot_every`) the memory's.
fn prepare_dir(
    recipe: &Recipe,
    config: &ModelConfig,
    group: &dyn ProcessGroup,
    options: RunOptions,
) -> Result<(Option<Snapshot>, Option<memory::Peers>)> {
    let out = &recipe.output.dir;
    let snapshots = out.join("snapshots");
    let fresh = options.overwrite && !options.resume;
    if group.rank() == 0 {
        std::fs::create_dir_all(&snapshots)
            .io(|| format!("cannot create {}", snapshots.display()))?;
        if fresh {
            std::fs::remove_dir_all(&snapshots)
                .and_then(|()| std::fs::create_dir_all(&snapshots))
                .io(|| format!("cannot clear {}", snapshots.display()))?;
        }
        std::fs::write(out.join("recipe.toml"), recipe.to_toml())
            .io(|| format!("cannot write {}", out.join("recipe.toml").display()))?;
    }
    // Every rank writes snapshots there: a directory some rank does not see is named now.
    crate::shared_dir::check_shared(out, group)?;
    let memory = memory::root(out);
    let peers = match recipe.output.memory_snapshot_every > 0 {
        true => memory_setup(&memory, group, fresh)?,
        false => None,
    };
    // A start after a failure first makes the newest memory snapshot that machines hold
    // between them (written while the ranks were on several) a disk snapshot; the job may be
    // on one machine now.
    if recipe.output.memory_snapshot_every > 0
        && (options.resume || options.restart)
        && let Some(step) = memory::promote(&memory, &snapshots, group, recipe.output.keep)?
    {
        tracing::info!("the memory snapshot of step {step}, held by the machines, is now on disk");
    }
    // On several machines only the disk's count (each machine's memory may hold snapshots of
    // its own from a time the job ran on it alone: the ranks would disagree).
    let existing = match peers {
        Some(_) => snapshot::latest(&snapshots)?,
        None => memory::newest_snapshot(recipe)?,
    };
    // A restart continues from the newest snapshot if there is one.
    let options = RunOptions {
        resume: options.resume || options.restart && existing.is_some(),
        ..options
    };
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
    let resume_from = match options.resume {
        true => {
            let dir = existing.ok_or_else(|| {
                TrainError::Snapshot(format!(
                    "--resume: there is no complete snapshot in {}",
                    snapshots.display()
                ))
            })?;
            let snap = Snapshot::open(&dir)?;
            let meta = &snap.manifest.meta;
            let (kind, json) = (config.kind().name(), config.to_json());
            if meta.model_kind != kind || meta.model_config != json {
                fail!(
                    Snapshot,
                    "the snapshot {} is of a different model: it holds a {} with config {}, the \
                     recipe asks for a {kind} with config {json}",
                    dir.display(),
                    meta.model_kind,
                    meta.model_config,
                );
            }
            Some(snap)
        }
        false => None,
    };
    group.barrier()?;
    Ok((resume_from, peers))
}

/// Memory snapshots' directory made (and cleared on a fresh start, each machine its own):
/// `None` when every rank sees it (one machine), else this rank's peers on the machines
/// beside (`memory::save_with_peer`).
fn memory_setup(
    memory: &Path,
    group: &dyn ProcessGroup,
    fresh: bool,
) -> Result<Option<memory::Peers>> {
    if fresh && machine_leader(group) && memory.exists() {
        std::fs::remove_dir_all(memory).io(|| format!("cannot clear {}", memory.display()))?;
    }
    group.barrier()?;
    std::fs::create_dir_all(memory).io(|| format!("cannot create {}", memory.display()))?;
    if crate::shared_dir::is_shared(memory, group)? {
        return Ok(None);
    }
    let (world, local) = (group.world_size(), local_world_size());
    if local == 0 || !world.is_multiple_of(local) || world / local < 2 {
        fail!(
            Snapshot,
            "output.memory_snapshot_every with ranks on several machines needs as many ranks \
             on each (LOCAL_WORLD_SIZE, as kiln launch sets it, is {local}; {world} ranks)"
        );
    }
    Ok(Some(memory::peers(group.rank(), world, local)))
}

/// Ranks on this machine (`LOCAL_WORLD_SIZE`, which `kiln launch` sets; 0 when unknown).
fn local_world_size() -> usize {
    std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Whether this rank acts for its machine (`LOCAL_RANK` 0; rank 0 without a launcher).
fn machine_leader(group: &dyn ProcessGroup) -> bool {
    match std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        Some(local) => local == 0,
        None => group.rank() == 0,
    }
}
