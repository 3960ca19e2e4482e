//! One rank's stage of a pipeline: its parameters, and its part of each training step.

use crate::mailbox::{Mailbox, Tag};
use crate::{Action, PipeError, Placement, Schedule, ScheduleKind, Split};
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Shape, Tensor, TensorData};
use kiln_comm::{BufMut, ProcessGroup};
use kiln_model::{Carry, Staged};
use kiln_shard::account::{MemKind, with_kind};
use kiln_shard::pieces::{piece, update_params, visit_params};
use kiln_shard::{Shard, StepConfig, StepStats, no_sync, reduce_gradients, remark, step_with};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The shape of a pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineConfig {
    /// Stages (p): the ranks of the stage group.
    pub stages: usize,
    /// Micro-batches per step (m): the global batch is cut into this many.
    pub microbatches: usize,
    /// The schedule.
    pub schedule: ScheduleKind,
    /// How the units are cut into chunks.
    pub split: Split,
}

/// What one stage did in a step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PipeStats {
    /// Time waiting for a neighbour's activation or gradient.
    pub waiting: Duration,
    /// The schedule's whole time on this stage (from its first pass to its last).
    pub wall: Duration,
    /// Bytes sent to other stages.
    pub sent: usize,
    /// Each pass this stage ran, in order, with its compute time (replayed by
    /// [`Schedule::simulate_with`], the bubble that stages of these costs leave in theory).
    pub passes: Vec<(Action, Duration)>,
}

impl PipeStats {
    /// Time in forward and backward passes.
    pub fn compute(&self) -> Duration {
        self.passes.iter().map(|(_, d)| *d).sum()
    }

    /// This stage's idle share of the schedule: `1 - compute / wall`.
    pub fn bubble(&self) -> f64 {
        1.0 - self.compute().as_secs_f64() / self.wall.as_secs_f64().max(f64::MIN_POSITIVE)
    }
}

/// Whether pipeline stages that are threads of one process may hold parameters gathered in
/// backward (ZeRO-3, hybrid on the data-parallel axis): true when burn-autodiff is built with
/// the fix of tracel-ai/burn#5194, as kiln's workspace builds it (`vendor/burn-autodiff`,
/// detected at build time). Burn 0.21.0 as published ends every backward with a clean-up that
/// waits for every graph of the process, and a graph is held through its whole backward: a
/// stage's clean-up then waits for another stage whose backward is in an all-gather, which can
/// wait on the first stage's next send, a cycle. Without the fix [`Pipeline::step`] refuses that
/// case, naming it; ranks as processes (`kiln launch`) have graphs of their own either way.
pub const SHARDED_STAGE_THREADS: bool = cfg!(burn_autodiff_skips_busy_graphs);

/// The refusal of [`SHARDED_STAGE_THREADS`]: `sharded` is a parameter gathered in backward, if
/// any, of a pipeline whose stages are threads of one process.
fn sharded_threads(sharded: Option<String>, allowed: bool) -> Result<(), PipeError> {
    match sharded {
        Some(path) if !allowed => Err(PipeError::Config(format!(
            "parameter {path} is sharded (ZeRO-3 or hybrid) and the stages are threads of one \
             process: this build's burn-autodiff (the published 0.21.0, without the fix of \
             tracel-ai/burn#5194) lets a stage's backward all-gathers deadlock with another \
             stage's sends. Run the ranks as processes (kiln launch, TCP groups), use DDP or \
             ZeRO-1/2 on the data-parallel axis, or build with kiln's vendor/burn-autodiff \
             ([patch.crates-io], see its KILN-PATCH.md)"
        ))),
        _ => Ok(()),
    }
}

/// A parameter read on several stages.
#[derive(Debug, Clone)]
struct SharedParam {
    path: String,
    /// The stages holding it, ascending; the first owns it (sums gradients, sends values).
    stages: Vec<usize>,
}

/// This rank's stage of a pipeline: the placement, the schedule and the stage group.
#[derive(Debug)]
pub struct Pipeline {
    schedule: Schedule,
    placement: Placement,
    group: Arc<dyn ProcessGroup>,
    shared: Vec<SharedParam>,
    /// Benchmark mode: a stage's forward and backward of one micro-batch take this long more.
    delay: Option<(Duration, Duration)>,
}

impl Pipeline {
    /// Cuts `model` for the stage `group.rank()` of `group` (the stage group: one rank per
    /// stage, ranks in stage order) and returns the stage's model: every parameter that none of
    /// its units reads becomes an empty placeholder. Call it before sharding the model over its
    /// data-parallel group, on every rank, with the same model.
    ///
    /// # Errors
    /// A group that is not `config.stages` ranks; more chunks than the model has units; bad
    /// split points; a parameter no unit reads; a schedule that does not fit (interleaved with
    /// micro-batches not a multiple of the stages).
    pub fn new<B: Backend, M: Staged<B>>(
        model: M,
        group: Arc<dyn ProcessGroup>,
        config: &PipelineConfig,
    ) -> Result<(Pipeline, M), PipeError> {
        if group.world_size() != config.stages {
            return Err(PipeError::Config(format!(
                "the stage group {:?} has {} ranks but the pipeline {} stages",
                group.name(),
                group.world_size(),
                config.stages
            )));
        }
        let units = model.units();
        let params = param_sizes(&model);
        let mut sizes = vec![0usize; units.len()];
        for (path, numel) in &params {
            let users: Vec<usize> = (0..units.len()).filter(|&u| units[u].uses(path)).collect();
            if users.is_empty() {
                return Err(PipeError::Config(format!(
                    "parameter {path} is read by no unit of the model, so no stage would hold it"
                )));
            }
            for u in users {
                sizes[u] += numel;
            }
        }
        let placement = Placement::new(
            units.into_iter().zip(sizes).collect(),
            config.stages,
            config.schedule.chunks(),
            &config.split,
        )?;
        let schedule = Schedule::new(config.schedule, config.stages, config.microbatches)?;
        let shared = params
            .iter()
            .map(|(path, _)| SharedParam {
                path: path.clone(),
                stages: placement.stages_using(path),
            })
            .filter(|s| s.stages.len() > 1)
            .collect();
        let stage = group.rank();
        let keep = |path: &str| placement.stages_using(path).contains(&stage);
        let model = model.map(&mut Drop {
            path: Vec::new(),
            keep: &keep,
        });
        Ok((
            Pipeline {
                schedule,
                placement,
                group,
                shared,
                delay: None,
            },
            model,
        ))
    }

    /// Benchmark mode: every forward of one micro-batch through a stage takes `forward` more,
    /// every backward `backward` more (divided among the stage's chunks), counted as compute.
    /// With a model whose own compute is negligible, the schedule itself is measured: its
    /// bubble on more stages than the machine has cores.
    pub fn with_delay(mut self, forward: Duration, backward: Duration) -> Self {
        self.delay = Some((forward, backward));
        self
    }

    /// This rank's stage.
    pub fn stage(&self) -> usize {
        self.group.rank()
    }

    /// The stage group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// Which units run where.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Whether this stage holds the parameter at `path` as a copy of another stage's (a tied
    /// weight whose first stage is another): snapshots take it from its first stage.
    pub fn holds_copy(&self, path: &str) -> bool {
        let stage = self.stage();
        self.shared
            .iter()
            .any(|s| s.path == path && s.stages[0] != stage && s.stages.contains(&stage))
    }

    /// The stage that computes the loss (the last chunk's).
    pub fn last_stage(&self) -> usize {
        self.schedule.stage_of(self.schedule.chunks() - 1)
    }

    /// One training step of this stage: runs the schedule over the micro-batches, then kiln's
    /// step ([`step_with`]): gradients reduced over the model's data-parallel group, the global
    /// norm over every stage, clipping, loss scaling, the optimizer. `input(mb)` gives
    /// micro-batch `mb`'s token ids (called on stage 0 only); `loss(logits, mb)` its loss, as in
    /// [`kiln_shard::step`] divided by the number of micro-batches (called on the last stage
    /// only). Every stage returns the step's loss (the last stage's, shared).
    ///
    /// `config.accumulate` is ignored (the micro-batches are the pipeline's); gradients are
    /// always reduced once per step, after the schedule.
    ///
    /// # Errors
    /// A send or receive between stages failed (a lost or late peer: the error names the
    /// stage and what it waited for), or a collective of the step did; ZeRO-3 stages as threads
    /// of one process without burn-autodiff's fix.
    pub fn step<B, AB, M, O>(
        &self,
        model: M,
        optim: &mut O,
        lr: f64,
        config: &StepConfig,
        input: impl Fn(usize) -> Tensor<AB, 2, Int>,
        loss: impl Fn(Tensor<AB, 3>, usize) -> Tensor<AB, 1>,
    ) -> Result<(M, StepStats, PipeStats), PipeError>
    where
        B: Backend,
        AB: AutodiffBackend<InnerBackend = Shard<B>>,
        M: AutodiffModule<AB> + Staged<AB>,
        O: Optimizer<M, AB>,
    {
        self.check_threads::<B, AB, M>(&model)?;
        let mut stats = PipeStats::default();
        let (model, step) = step_with(
            model,
            optim,
            lr,
            config,
            Some(&*self.group),
            |model, passes| {
                let (total, grads, s) = self.backprop::<B, AB, M>(model, passes, &input, &loss)?;
                stats = s;
                Ok::<_, PipeError>((total, grads))
            },
        )?;
        let model = self.copy_shared_values::<B, AB, M>(model)?;
        Ok((model, step, stats))
    }

    /// Refuses parameters gathered in backward (ZeRO-3, hybrid) when the stages are threads of
    /// one process and burn-autodiff lacks the fix of tracel-ai/burn#5194 (see
    /// [`SHARDED_STAGE_THREADS`]).
    fn check_threads<B, AB, M>(&self, model: &M) -> Result<(), PipeError>
    where
        B: Backend,
        AB: AutodiffBackend<InnerBackend = Shard<B>>,
        M: AutodiffModule<AB>,
    {
        // Backends whose ranks are threads of this process.
        let threads = matches!(self.group.backend(), "local" | "rendezvous");
        if !threads || self.group.world_size() == 1 || SHARDED_STAGE_THREADS {
            return Ok(());
        }
        let mut sharded = None;
        visit_params::<B, AB, M>(model, |path, _, t| {
            if matches!(t, kiln_shard::ShardTensor::Sharded(_)) && sharded.is_none() {
                sharded = Some(path.to_string());
            }
        });
        sharded_threads(sharded, SHARDED_STAGE_THREADS)
    }

    /// The summed loss of `microbatches` micro-batches, forward only (validation): each stage
    /// runs its chunks of micro-batch 0, then of micro-batch 1, and so on (a stage's inputs come
    /// from earlier chunks only, and sends do not wait, so this order cannot deadlock). Works on
    /// any backend, the training one or its inner (`model.valid()`). `input` is called on
    /// stage 0, `loss` on the last stage; every stage returns the sum.
    ///
    /// # Errors
    /// A send or receive between stages failed.
    pub fn evaluate<B: Backend, M: Staged<B>>(
        &self,
        model: &M,
        microbatches: usize,
        input: impl Fn(usize) -> Tensor<B, 2, Int>,
        loss: impl Fn(Tensor<B, 3>, usize) -> Tensor<B, 1>,
    ) -> Result<f64, PipeError> {
        let stage = self.stage();
        let mut mail = Mailbox::new(&*self.group);
        let mut total = 0.0;
        for mb in 0..microbatches {
            if let Some(out) = self.forward_only(model, mb, || input(mb), &mut mail)? {
                total += loss(out, mb).into_scalar().elem::<f64>();
            }
        }
        let mut bits = [total.to_bits() as i64];
        self.group
            .broadcast(BufMut::I64(&mut bits), self.last_stage())
            .map_err(|source| PipeError::Comm {
                stage,
                what: "sharing the evaluation's loss".into(),
                source: Box::new(source),
            })?;
        Ok(f64::from_bits(bits[0] as u64))
    }

    /// The logits `[vocab]` of the token after `tokens` (one sequence), through the stages,
    /// on every stage (for sampling: every stage then draws the same token). `vocab` is the
    /// model's vocabulary (a stage may hold none of the layers that know it).
    ///
    /// # Errors
    /// A send or receive between stages failed.
    pub fn last_logits<B: Backend, M: Staged<B>>(
        &self,
        model: &M,
        tokens: &[i64],
        vocab: usize,
    ) -> Result<Vec<f32>, PipeError> {
        let stage = self.stage();
        let len = tokens.len();
        let mut mail = Mailbox::new(&*self.group);
        let input = || {
            let data = TensorData::new(tokens.to_vec(), [1, len]);
            Tensor::from_data(data, &device_of(model))
        };
        let mut logits = match self.forward_only(model, 0, input, &mut mail)? {
            Some(out) => values_of(out.slice([0..1, len - 1..len, 0..vocab])).1,
            None => vec![0f32; vocab],
        };
        self.group
            .broadcast(BufMut::F32(&mut logits), self.last_stage())
            .map_err(|source| PipeError::Comm {
                stage,
                what: "sharing the next token's logits".into(),
                source: Box::new(source),
            })?;
        Ok(logits)
    }

    /// The schedule's passes: the step's loss (on every stage) and this stage's gradients,
    /// reduced over the data-parallel group.
    fn backprop<B, AB, M>(
        &self,
        model: &M,
        passes: &kiln_shard::Passes<'_>,
        input: &dyn Fn(usize) -> Tensor<AB, 2, Int>,
        loss: &dyn Fn(Tensor<AB, 3>, usize) -> Tensor<AB, 1>,
    ) -> Result<(f64, GradientsParams, PipeStats), PipeError>
    where
        B: Backend,
        AB: AutodiffBackend<InnerBackend = Shard<B>>,
        M: AutodiffModule<AB> + Staged<AB>,
    {
        /// What a forward keeps for its backward.
        enum Kept<AB: AutodiffBackend> {
            /// The chunk's output, differentiated against the next stage's gradient.
            Output(Tensor<AB, 3>),
            /// The loss (last chunk), scaled.
            Loss(Tensor<AB, 1>),
        }
        let stage = self.stage();
        let device = device_of(model);
        let last = self.schedule.chunks() - 1;
        let mut mail = Mailbox::new(&*self.group);
        /// Per (micro-batch, chunk) in flight: the received input (whose gradient goes back)
        /// and what backward starts from.
        type Alive<AB, M> = HashMap<(usize, usize), (Option<Tensor<AB, 3>>, Kept<AB>, M)>;
        let mut alive: Alive<AB, M> = HashMap::new();
        let mut acc = GradientsAccumulator::<M>::new();
        let mut stats = PipeStats::default();
        let mut total = 0.0;
        let start = Instant::now();
        for action in self.schedule.actions(stage) {
            match *action {
                Action::Forward { mb, chunk } => {
                    let (x, carry) = if chunk == 0 {
                        (None, Carry::Tokens(input(mb)))
                    } else {
                        let x = self
                            .receive::<AB>(&mut mail, Tag::Activation { mb, chunk }, &device)?
                            .require_grad();
                        (Some(x.clone()), Carry::Hidden(x))
                    };
                    let t = Instant::now();
                    self.sleep(|d| d.0);
                    let units = self.placement.chunk(chunk);
                    // Each micro-batch's forward reads the parameters through leaves of its own,
                    // so that the graphs alive at once share no node: Burn 0.21 merges graphs
                    // that share nodes, and its graph registry can lose a merged graph once a
                    // node it was keyed by is freed by another micro-batch's backward ("Node
                    // should have a step registered"). Gradients are keyed by parameter id,
                    // so they land on the model's parameters all the same.
                    let own = model.clone().map(&mut OwnLeaves);
                    let out = passes.forward(|| own.forward_units(units, carry).hidden());
                    let kept = if chunk == last {
                        let l = passes.forward(|| loss(out, mb));
                        total += l.clone().into_scalar().elem::<f64>();
                        stats.passes.push((*action, t.elapsed()));
                        Kept::Loss(passes.scaled(l))
                    } else {
                        stats.passes.push((*action, t.elapsed()));
                        let next = Tag::Activation {
                            mb,
                            chunk: chunk + 1,
                        };
                        self.send(&mut mail, next, out.clone())?;
                        Kept::Output(out)
                    };
                    alive.insert((mb, chunk), (x, kept, own));
                }
                Action::Backward { mb, chunk } => {
                    let (x, kept, own) = alive
                        .remove(&(mb, chunk))
                        .expect("a checked schedule runs a forward before its backward");
                    let root = match kept {
                        Kept::Loss(l) => l,
                        Kept::Output(y) => {
                            let g = self
                                .receive::<AB>(&mut mail, Tag::Gradient { mb, chunk }, &device)?
                                .cast(y.dtype());
                            // d(sum(y · g))/dθ = gᵀ ∂y/∂θ: backward from y with gradient g.
                            (y * g).sum()
                        }
                    };
                    let t = Instant::now();
                    self.sleep(|d| d.1);
                    let grads = with_kind(MemKind::Backward, || {
                        no_sync::<B, AB, M, _>(model, || root.backward())
                    });
                    // The input's gradient goes back before this stage files its parameters'
                    // gradients: under 1F1B the previous stage is (or soon will be) waiting for
                    // it, and every such hand-over is on the schedule's critical path.
                    // Sending is not compute (a forward's send is outside its compute time too).
                    let mut sending = Duration::ZERO;
                    if let Some(x) = x {
                        let dx = x.grad(&grads).expect("a chunk's input reaches its output");
                        let back = Tag::Gradient {
                            mb,
                            chunk: chunk - 1,
                        };
                        let sent = Instant::now();
                        self.send(&mut mail, back, Tensor::<AB, 3>::from_inner(dx))?;
                        sending = sent.elapsed();
                    }
                    acc.accumulate(model, GradientsParams::from_grads(grads, &own));
                    remark::<B, AB, M>(model);
                    stats
                        .passes
                        .push((*action, t.elapsed().saturating_sub(sending)));
                }
            }
        }
        stats.wall = start.elapsed();
        let mut grads = acc.grads();
        self.sum_shared_grads::<B, AB, M>(model, &mut grads, &mut mail)?;
        stats.waiting = mail.waited;
        stats.sent = mail.sent;
        let grads = reduce_gradients(model, grads);
        // Every stage reports the step's loss: the last stage's, exactly (f64 bits).
        let mut bits = [total.to_bits() as i64];
        kiln_shard::account::waiting(|| {
            self.group
                .broadcast(BufMut::I64(&mut bits), self.last_stage())
        })
        .map_err(|source| PipeError::Comm {
            stage,
            what: "sharing the step's loss".into(),
            source: Box::new(source),
        })?;
        Ok((f64::from_bits(bits[0] as u64), grads, stats))
    }

    /// This stage's chunks of micro-batch `mb`, forward only, in chunk order (a chunk's input
    /// comes from an earlier chunk, and sends do not wait, so this order cannot deadlock):
    /// the last chunk's output when this stage runs it. `input` gives the token ids (stage 0).
    fn forward_only<B: Backend, M: Staged<B>>(
        &self,
        model: &M,
        mb: usize,
        input: impl FnOnce() -> Tensor<B, 2, Int>,
        mail: &mut Mailbox<'_>,
    ) -> Result<Option<Tensor<B, 3>>, PipeError> {
        let device = device_of(model);
        let last = self.schedule.chunks() - 1;
        let mut input = Some(input);
        for chunk in (self.stage()..=last).step_by(self.schedule.stages()) {
            let carry = match chunk {
                0 => Carry::Tokens(input.take().expect("chunk 0 runs once")()),
                _ => Carry::Hidden(self.receive(mail, Tag::Activation { mb, chunk }, &device)?),
            };
            let out = model
                .forward_units(self.placement.chunk(chunk), carry)
                .hidden();
            if chunk == last {
                return Ok(Some(out));
            }
            self.send(
                mail,
                Tag::Activation {
                    mb,
                    chunk: chunk + 1,
                },
                out,
            )?;
        }
        Ok(None)
    }

    /// The tensor `tag` from the stage that sends it (an activation from the previous chunk's
    /// stage, a gradient from the next chunk's).
    fn receive<B: Backend>(
        &self,
        mail: &mut Mailbox<'_>,
        tag: Tag,
        device: &B::Device,
    ) -> Result<Tensor<B, 3>, PipeError> {
        let from = match tag {
            Tag::Activation { chunk, .. } => self.schedule.stage_of(chunk - 1),
            Tag::Gradient { chunk, .. } => self.schedule.stage_of(chunk + 1),
            _ => unreachable!("shared parameters travel through their own path"),
        };
        let (dims, values) = mail.take(tag, from)?;
        Ok(Tensor::from_data(TensorData::new(values, dims), device))
    }

    /// Sends `t` as `tag` to the stage of the tag's chunk.
    fn send<B: Backend>(
        &self,
        mail: &mut Mailbox<'_>,
        tag: Tag,
        t: Tensor<B, 3>,
    ) -> Result<(), PipeError> {
        let to = match tag {
            Tag::Activation { chunk, .. } | Tag::Gradient { chunk, .. } => {
                self.schedule.stage_of(chunk)
            }
            _ => unreachable!("shared parameters travel through their own path"),
        };
        let (dims, values) = values_of(t);
        mail.send(tag, to, &dims, &values)
    }

    /// The benchmark delay of one pass (`which` picks forward or backward), if any.
    fn sleep(&self, which: impl Fn((Duration, Duration)) -> Duration) {
        if let Some(d) = self.delay {
            std::thread::sleep(which(d) / self.schedule.chunks_per_stage() as u32);
        }
    }

    /// Sums the gradients of shared parameters on their first stage (before reduction, so the
    /// data-parallel reduction sees the whole gradient); the other stages drop theirs (their
    /// copies take the first's values after the step, so they need no optimizer state).
    fn sum_shared_grads<B, AB, M>(
        &self,
        model: &M,
        grads: &mut GradientsParams,
        mail: &mut Mailbox<'_>,
    ) -> Result<(), PipeError>
    where
        B: Backend,
        AB: AutodiffBackend<InnerBackend = Shard<B>>,
        M: AutodiffModule<AB>,
    {
        if self.shared.is_empty() {
            return Ok(());
        }
        struct Sum<'a, 'm, B: Backend> {
            pipe: &'a Pipeline,
            grads: &'a mut GradientsParams,
            mail: &'a mut Mailbox<'m>,
            path: Vec<String>,
            error: Option<PipeError>,
            _b: std::marker::PhantomData<B>,
        }
        impl<B, AB> ModuleVisitor<AB> for Sum<'_, '_, B>
        where
            B: Backend,
            AB: AutodiffBackend<InnerBackend = Shard<B>>,
        {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                if self.error.is_some() {
                    return;
                }
                let path = self.path.join(".");
                let stage = self.pipe.stage();
                let Some(index) = self.pipe.shared.iter().position(|s| s.path == path) else {
                    return;
                };
                let stages = &self.pipe.shared[index].stages;
                // A frozen parameter (a LoRA base's tied embedding) has no gradient to sum.
                if !stages.contains(&stage) || !param.val().is_require_grad() {
                    return;
                }
                let shape = param.val().shape();
                let grad = self.grads.remove::<Shard<B>, D>(param.id);
                let device = param.val().inner().device();
                let mut values = match grad {
                    Some(g) => g
                        .into_data()
                        .convert::<f32>()
                        .into_vec::<f32>()
                        .expect("f32"),
                    None => vec![0.0; shape.num_elements()],
                };
                let tag = Tag::SharedGrad { index };
                let result = if stage == stages[0] {
                    stages[1..].iter().try_for_each(|&from| {
                        let (_, theirs) = self.mail.take(tag, from)?;
                        for (v, t) in values.iter_mut().zip(theirs) {
                            *v += t;
                        }
                        Ok(())
                    })
                } else {
                    self.mail.send(tag, stages[0], &shape.dims::<D>(), &values)
                };
                match result {
                    Err(e) => self.error = Some(e),
                    Ok(()) if stage == stages[0] => {
                        let g = Tensor::<Shard<B>, D>::from_data(
                            TensorData::new(values, shape),
                            &device,
                        );
                        self.grads.register(param.id, g);
                    }
                    Ok(()) => {}
                }
            }
        }
        let mut sum = Sum::<B> {
            pipe: self,
            grads,
            mail,
            path: Vec::new(),
            error: None,
            _b: std::marker::PhantomData,
        };
        model.visit(&mut sum);
        sum.error.map_or(Ok(()), Err)
    }

    /// Copies each shared parameter's values from its first stage to the others (each rank the
    /// range it holds: the stages' data-parallel groups have the same size).
    fn copy_shared_values<B, AB, M>(&self, model: M) -> Result<M, PipeError>
    where
        B: Backend,
        AB: AutodiffBackend<InnerBackend = Shard<B>>,
        M: AutodiffModule<AB>,
    {
        if self.shared.is_empty() {
            return Ok(model);
        }
        let stage = self.stage();
        let mut mail = Mailbox::new(&*self.group);
        let mut error = None;
        // A frozen parameter (a LoRA base's tied embedding) has the same values everywhere.
        let trainable = kiln_shard::pieces::trainable_paths::<AB, M>(&model);
        let index_of = |path: &str| {
            self.shared.iter().position(|s| {
                s.path == path && s.stages.contains(&stage) && trainable.contains(path)
            })
        };
        let mut owned = Vec::new();
        visit_params::<B, AB, M>(&model, |path, _, t| {
            if let Some(index) = index_of(path)
                && self.shared[index].stages[0] == stage
            {
                owned.push((index, piece(t).values));
            }
        });
        for (index, values) in owned {
            for &to in &self.shared[index].stages[1..] {
                let tag = Tag::SharedValue { index };
                mail.send(tag, to, &[values.len()], &values)?;
            }
        }
        let model = update_params::<B, AB, M>(model, |path, _| {
            let index = index_of(path)?;
            let from = self.shared[index].stages[0];
            if from == stage || error.is_some() {
                return None;
            }
            match mail.take(Tag::SharedValue { index }, from) {
                Ok((_, values)) => Some(values),
                Err(e) => {
                    error = Some(e);
                    None
                }
            }
        });
        error.map_or(Ok(model), Err)
    }
}

/// The device a model's parameters are on.
fn device_of<B: Backend, M: Module<B>>(model: &M) -> B::Device {
    model
        .devices()
        .into_iter()
        .next()
        .expect("a model with parameters")
}

/// A float tensor's dims and values as f32.
fn values_of<B: Backend>(t: Tensor<B, 3>) -> (Vec<usize>, Vec<f32>) {
    let dims = t.dims().to_vec();
    let values = t
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("converted to f32");
    (dims, values)
}

/// Every parameter's path and element count, in module order (lazy parameters are not
/// initialised: their shape is known).
fn param_sizes<B: Backend, M: Module<B>>(model: &M) -> Vec<(String, usize)> {
    struct Sizes {
        path: Vec<String>,
        out: Vec<(String, usize)>,
    }
    impl<B: Backend> ModuleVisitor<B> for Sizes {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.out
                .push((self.path.join("."), param.shape().num_elements()));
        }
        // Integer parameters (QLoRA's 4-bit codes, two to a byte) are placed like float ones
        // and count by their elements.
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<B, D, Int>>) {
            self.out
                .push((self.path.join("."), param.shape().num_elements()));
        }
    }
    let mut sizes = Sizes {
        path: Vec::new(),
        out: Vec::new(),
    };
    model.visit(&mut sizes);
    sizes.out
}

/// The same parameters as new autodiff leaves (no copy of their values).
struct OwnLeaves;

impl<B: AutodiffBackend> ModuleMapper<B> for OwnLeaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, t, mapper) = param.consume();
        let t = if t.is_require_grad() {
            t.detach().require_grad()
        } else {
            t
        };
        Param::from_mapped_value(id, t, mapper)
    }
}

/// Replaces the parameters this stage does not hold by empty placeholders.
struct Drop<'a> {
    path: Vec<String>,
    keep: &'a dyn Fn(&str) -> bool,
}

impl<B: Backend> ModuleMapper<B> for Drop<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if (self.keep)(&self.path.join(".")) {
            return param;
        }
        let device = param.lazy_device();
        let (id, _, mapper) = param.consume();
        let empty = Tensor::<B, D>::zeros(Shape::new([0; D]), &device);
        Param::from_mapped_value(id, empty, mapper)
    }
    fn map_int<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Int>>,
    ) -> Param<Tensor<B, D, Int>> {
        if (self.keep)(&self.path.join(".")) {
            return param;
        }
        let device = param.lazy_device();
        let (id, _, mapper) = param.consume();
        let empty = Tensor::<B, D, Int>::zeros(Shape::new([0; D]), &device);
        Param::from_mapped_value(id, empty, mapper)
    }
}

#[cfg(test)]
mod tests {
    use super::{SHARDED_STAGE_THREADS, sharded_threads};

    #[test]
    // The constant is the build's: this checks that the build script saw kiln's burn-autodiff.
    #[allow(clippy::assertions_on_constants)]
    fn sharded_stage_threads_are_refused_only_without_the_fix() {
        let path = || Some("h.0.attn.c_attn.weight".to_string());
        let err = sharded_threads(path(), false).unwrap_err().to_string();
        assert!(
            err.contains("parameter h.0.attn.c_attn.weight is sharded"),
            "{err}"
        );
        assert!(err.contains("tracel-ai/burn#5194"), "{err}");
        assert!(sharded_threads(path(), true).is_ok());
        assert!(sharded_threads(None, false).is_ok());
        // kiln's workspace builds vendor/burn-autodiff, which carries the fix.
        assert!(
            SHARDED_STAGE_THREADS,
            "burn-autodiff's build metadata was not seen"
        );
    }
}
