//! kiln inside burn-train: a program that trains through a `Learner` trains data-parallel and
//! sharded (DDP, ZeRO-1/2/3, hybrid) by changing its backend type and its training strategy.
//!
//! [`KilnStrategy`] is a burn-train `SupervisedLearningStrategy`, given to the program's
//! `SupervisedTraining` as `TrainingStrategy::Custom(Arc::new(...))`. It runs burn-train's epoch
//! loop on every rank, with:
//!
//! - **ranks** as threads of this process ([`KilnStrategy::threads`]) or as processes under
//!   `kiln launch`, torchrun, SLURM or `mpirun` ([`KilnStrategy::launched`]);
//! - **the model** made each rank's part by [`kiln::parallelize`](crate::parallelize) with the
//!   strategy, precision and clipping of a [`ParallelPlan`]; kiln's
//!   [`ShardedOptimizer`](kiln_shard::ShardedOptimizer) wraps the program's own optimizer;
//! - **data**: every rank takes its rows ([`Split`]) of each batch of the program's loaders,
//!   so the ranks together train on the batch the program asked for on one device (gradients
//!   are averaged weighted by rows, so an uneven last batch is one device's too);
//! - **metrics**: the ranks' outputs are put together on rank 0 ([`Gather`]), whose event
//!   processor (the dashboard, the loggers) alone sees events, with the batch's figures; early
//!   stopping is decided on rank 0 and the interrupter on any rank, and every rank follows;
//! - **checkpoints** through the program's checkpointer: every rank gathers its part, rank 0
//!   writes whole records with the program's recorder (see below); resuming
//!   (`SupervisedTraining::checkpoint(epoch)`) works at any world size and strategy;
//! - **the model returned** whole, on every rank: the program's code after `fit` runs as on one
//!   device.
//!
//! Whole records, not kiln's per-rank snapshot pieces: burn-train's checkpointer takes a whole
//! `Learner` and writes it with the program's recorder and checkpointing strategy (which epochs
//! to keep), and its `checkpoint(epoch)` option reads the same files back. Writing those files
//! keeps every one of the program's checkpoint options working, and the files are burn-train's:
//! plain burn-train resumes from kiln's checkpoints and kiln from plain burn-train's. The cost:
//! at each checkpoint the parameters and optimizer state are gathered whole (on every rank, as
//! an all-gather does), and a checkpoint is as large as one device's. Resharding needs nothing:
//! a resumed run shards the whole model as it starts, and the whole optimizer state meets its
//! parameters' shards in the first step, which slices it (elementwise, no communication).
//!
//! What is refused, by name: pipeline stages (a Learner's `TrainStep` runs the whole model's
//! forward and backward in one call, which a pipeline schedule must split), f16 loss scaling
//! and kiln's remat budget (both need the loss before `TrainStep` calls backward; bf16 and
//! Burn's `BalancedCheckpointing` work), a batch smaller than the world.
//!
//! ```
//! use burn::data::dataloader::DataLoaderBuilder;
//! use burn::data::dataloader::batcher::Batcher;
//! use burn::data::dataset::InMemDataset;
//! use burn::nn::{Linear, LinearConfig, loss::MseLoss, loss::Reduction};
//! use burn::optim::AdamConfig;
//! use burn::prelude::*;
//! use burn::tensor::backend::AutodiffBackend;
//! use burn::train::{
//!     InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep,
//!     TrainingStrategy,
//! };
//! use kiln::learner::{KilnStrategy, Share, Split};
//! use kiln::shard::Strategy;
//! use kiln::{Flex, ParallelPlan, Train};
//! use std::sync::Arc;
//!
//! #[derive(Module, Debug)]
//! struct Model<B: Backend> {
//!     linear: Linear<B>,
//! }
//!
//! #[derive(Clone, Debug)]
//! struct Batch<B: Backend> {
//!     x: Tensor<B, 2>,
//!     y: Tensor<B, 2>,
//! }
//!
//! // The one addition to a program's data code: how its batch splits by rows.
//! impl<B: Backend> Split for Batch<B> {
//!     fn rows(&self) -> usize {
//!         self.x.dims()[0]
//!     }
//!     fn split(&self, share: &Share) -> Self {
//!         Batch { x: share.rows_of(&self.x), y: share.rows_of(&self.y) }
//!     }
//! }
//!
//! impl<B: Backend> Model<B> {
//!     fn forward(&self, batch: Batch<B>) -> RegressionOutput<B> {
//!         let output = self.linear.forward(batch.x);
//!         let loss = MseLoss::new().forward(output.clone(), batch.y.clone(), Reduction::Mean);
//!         RegressionOutput { loss, output, targets: batch.y }
//!     }
//! }
//!
//! impl<B: AutodiffBackend> TrainStep for Model<B> {
//!     type Input = Batch<B>;
//!     type Output = RegressionOutput<B>;
//!     fn step(&self, batch: Batch<B>) -> TrainOutput<RegressionOutput<B>> {
//!         let item = self.forward(batch);
//!         TrainOutput::new(self, item.loss.backward(), item)
//!     }
//! }
//!
//! impl<B: Backend> InferenceStep for Model<B> {
//!     type Input = Batch<B>;
//!     type Output = RegressionOutput<B>;
//!     fn step(&self, batch: Batch<B>) -> RegressionOutput<B> {
//!         self.forward(batch)
//!     }
//! }
//!
//! #[derive(Clone)]
//! struct Rows;
//! impl<B: Backend> Batcher<B, [f32; 3], Batch<B>> for Rows {
//!     fn batch(&self, items: Vec<[f32; 3]>, device: &B::Device) -> Batch<B> {
//!         let n = items.len();
//!         let x: Vec<f32> = items.iter().flat_map(|i| [i[0], i[1]]).collect();
//!         let y: Vec<f32> = items.iter().map(|i| i[2]).collect();
//!         Batch {
//!             x: Tensor::from_data(TensorData::new(x, [n, 2]), device),
//!             y: Tensor::from_data(TensorData::new(y, [n, 1]), device),
//!         }
//!     }
//! }
//!
//! type B = Train<Flex>; // was: Autodiff<Flex>
//! let items: Vec<[f32; 3]> = (0..16).map(|i| [i as f32 / 16.0, 1.0, 2.0 * i as f32 / 16.0]).collect();
//! let loader = |items: Vec<[f32; 3]>| {
//!     DataLoaderBuilder::<B, _, _>::new(Rows).batch_size(4).build(InMemDataset::new(items))
//! };
//! // Validation runs on the inner backend, as in plain burn-train (was: Flex).
//! let valid = DataLoaderBuilder::<kiln::Kiln<Flex>, _, _>::new(Rows)
//!     .batch_size(4)
//!     .build(InMemDataset::new(items.clone()));
//! let dir = std::env::temp_dir().join(format!("kiln-learner-doc-{}", std::process::id()));
//! let training = SupervisedTraining::new(&dir, loader(items), valid.clone())
//!     .num_epochs(2)
//!     .with_application_logger(None)
//!     // The strategy: 2 ranks as threads under ZeRO-3.
//!     .with_training_strategy(TrainingStrategy::Custom(Arc::new(
//!         KilnStrategy::<Flex>::threads(2, ParallelPlan::new(Strategy::Zero3))?,
//!     )));
//! let model = Model::<B> { linear: LinearConfig::new(2, 1).init(&Default::default()) };
//! let result = training.launch(Learner::new(model, AdamConfig::new().init(), 1e-2));
//! assert_eq!(result.model.linear.weight.dims(), [2, 1]); // whole again
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod rank;
mod split;
mod state;

pub use error::LearnerError;
pub use rank::RankFigures;
pub use split::{Gather, Share, Split, gather_rows, mean_over};
pub use state::{LearnerOptim, OptimRecord, StateRecord, optimizer_record};

use crate::{ParallelPlan, Remat};
use burn::backend::autodiff::checkpoint::strategy::{CheckpointStrategy, NoCheckpointing};
use burn::module::{AutodiffModule, Module};
use burn::tensor::backend::Backend;
use burn::train::{
    EventProcessorTraining, InferenceStep, Learner, LearnerEvent, LearningComponentsTypes,
    LearningResult, SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader,
    TrainStep, TrainingComponents, ValidLoader,
};
use kiln_comm::{GroupOptions, LaunchEnv, ProcessGroup};
use kiln_shard::Train;
use rank::{Feed, Lead, Model, RankJob, TrainInput, Training, ValidInput};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};

/// Where the ranks run.
enum Ranks {
    /// Threads of this process.
    Threads(usize),
    /// This process is one rank of a group (the others are processes too).
    Group(Arc<dyn ProcessGroup>),
}

/// kiln as burn-train's training strategy (see the [module docs](self)): for a `Learner` whose
/// backend is [`Train<B, C>`](crate::Train), `TrainingStrategy::Custom(Arc::new(strategy))`.
pub struct KilnStrategy<B: Backend, C: CheckpointStrategy = NoCheckpointing> {
    ranks: Ranks,
    plan: ParallelPlan,
    figures: Arc<Mutex<Vec<RankFigures>>>,
    _backend: PhantomData<fn() -> (B, C)>,
}

impl<B: Backend, C: CheckpointStrategy> std::fmt::Debug for KilnStrategy<B, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KilnStrategy")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("plan", &self.plan)
            .finish()
    }
}

impl<B: Backend, C: CheckpointStrategy> KilnStrategy<B, C> {
    /// `ranks` ranks as threads of this process, each on a share of the process's cores.
    ///
    /// # Errors
    /// No rank; a plan that does not fit `ranks` or that kiln refuses here (see the module docs).
    pub fn threads(ranks: usize, plan: ParallelPlan) -> Result<Self, LearnerError> {
        if ranks == 0 {
            return Err(LearnerError::Unsupported(
                "a job needs at least one rank (threads(0))".into(),
            ));
        }
        Self::new(Ranks::Threads(ranks), plan)
    }

    /// This process as one rank of a job started by `kiln launch`, torchrun, SLURM's `srun` or
    /// Open MPI's `mpirun` (its environment says which rank), joined over `backend` (`"tcp"`;
    /// `"nccl"` and `"mpi"` with kiln-comm's features). Every process runs the same program, so
    /// builds the same loaders; the events, logs and checkpoints are rank 0's.
    ///
    /// # Errors
    /// No launcher's environment; a group that cannot be joined; a plan that does not fit.
    pub fn launched(backend: &str, plan: ParallelPlan) -> Result<Self, LearnerError> {
        let env = LaunchEnv::from_env()?;
        let group = kiln_comm::join(backend, &env, GroupOptions::default())?;
        Self::over(group, plan)
    }

    /// This process as one rank of `group`.
    ///
    /// # Errors
    /// A plan that does not fit the group, or that kiln refuses here.
    pub fn over(group: Arc<dyn ProcessGroup>, plan: ParallelPlan) -> Result<Self, LearnerError> {
        Self::new(Ranks::Group(group), plan)
    }

    /// Under a launcher ([`KilnStrategy::launched`] over TCP) when its environment is set, else
    /// `threads` ranks as threads: one program for both.
    ///
    /// # Errors
    /// As [`KilnStrategy::launched`] and [`KilnStrategy::threads`].
    pub fn launched_or_threads(threads: usize, plan: ParallelPlan) -> Result<Self, LearnerError> {
        if LaunchEnv::launched() {
            Self::launched("tcp", plan)
        } else {
            Self::threads(threads, plan)
        }
    }

    fn new(ranks: Ranks, plan: ParallelPlan) -> Result<Self, LearnerError> {
        let s = KilnStrategy {
            ranks,
            plan,
            figures: Arc::default(),
            _backend: PhantomData,
        };
        s.plan.mesh_shape(s.world_size())?;
        if let Some(p) = s.plan.pipeline.as_ref().filter(|p| p.stages > 1) {
            return Err(LearnerError::Unsupported(format!(
                "pipeline stages ({}): a Learner's TrainStep runs the whole model's forward and \
                 backward in one call, which a pipeline schedule must split into stages and \
                 micro-batches; train a pipeline with kiln's own loop (kiln::pipe, `kiln train \
                 --pp`)",
                p.stages
            )));
        }
        if s.plan.loss_scale.is_some() {
            return Err(LearnerError::Unsupported(
                "f16 loss scaling: a Learner's TrainStep calls backward itself, so kiln cannot \
                 scale the loss before it; bf16 (Precision::Bf16) needs no loss scale"
                    .into(),
            ));
        }
        if let Remat::Budget(bytes) = s.plan.remat {
            return Err(LearnerError::Unsupported(format!(
                "remat budget ({bytes} bytes): kiln's budget records forward's ops and gives them \
                 up for backward, but a Learner's TrainStep runs both in one call; use \
                 Remat::Balanced (Burn's op-level checkpointing, Train<B, BalancedCheckpointing>)"
            )));
        }
        Ok(s)
    }

    /// This process's rank (0 for ranks as threads: this process runs rank 0's events).
    pub fn rank(&self) -> usize {
        match &self.ranks {
            Ranks::Threads(_) => 0,
            Ranks::Group(g) => g.rank(),
        }
    }

    /// The job's ranks.
    pub fn world_size(&self) -> usize {
        match &self.ranks {
            Ranks::Threads(n) => *n,
            Ranks::Group(g) => g.world_size(),
        }
    }

    /// What each rank of this process held at the end of its last `fit` (ranks as threads:
    /// every rank; as processes: this one), in rank order.
    pub fn figures(&self) -> Vec<RankFigures> {
        let mut f = self
            .figures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        f.sort_by_key(|f| f.rank);
        f
    }
}

impl<B, C, LC> SupervisedLearningStrategy<LC> for KilnStrategy<B, C>
where
    B: Backend,
    C: CheckpointStrategy,
    LC: LearningComponentsTypes<Backend = Train<B, C>> + 'static,
    TrainInput<LC>: Split + Send,
    <Model<LC> as TrainStep>::Output: Gather,
    ValidInput<LC>: Split + Send,
    <LC::InferenceModel as InferenceStep>::Output: Gather,
    OptimRecord<LC>: StateRecord<Train<B, C>> + Send,
    Learner<LC>: Send,
    LC::InferenceModel: 'static,
{
    /// burn-train's `train` with the events of rank 0 only (ranks as processes all run it).
    fn train(
        &self,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        mut components: TrainingComponents<LC>,
    ) -> LearningResult<LC::InferenceModel> {
        let lead = self.rank() == 0;
        let starting_epoch = match components.checkpoint {
            Some(epoch) => {
                if let Some(checkpointer) = &mut components.checkpointer {
                    learner = checkpointer.load_checkpoint(learner, &Default::default(), epoch);
                }
                epoch + 1
            }
            None => 1,
        };
        let summary_config = components.summary.clone();
        if lead {
            components
                .event_processor
                .process_train(LearnerEvent::Start);
        }
        let (model, mut processor) = self.fit(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        );
        if lead {
            // (burn-train names the model in its summary through a method of its own.)
            let summary = summary_config.and_then(|summary| summary.init().ok());
            processor.process_train(LearnerEvent::End(summary));
        }
        LearningResult {
            model: model.valid(),
            renderer: processor.renderer(),
        }
    }

    /// # Panics
    /// burn-train's `fit` has no error to return: a failed collective, ranks whose loaders
    /// disagree, a batch smaller than the world or a model kiln cannot shard stop the job on
    /// every rank with a message naming it (never a hang: collectives time out).
    fn fit(
        &self,
        components: TrainingComponents<LC>,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (Model<LC>, SupervisedTrainingEventProcessor<LC>) {
        let device: B::Device = Default::default();
        // As burn-train's single-device strategy does (it draws the loaders' shuffles).
        let train = dataloader_train.to_device(&device);
        let valid = dataloader_valid.to_device(&device);
        let TrainingComponents {
            num_epochs,
            checkpointer,
            grad_accumulation,
            interrupter,
            early_stopping,
            event_processor,
            event_store,
            ..
        } = components;
        let checkpointing = checkpointer.is_some();
        let job = |learner, train, valid, lead| RankJob::<B, C, LC> {
            learner,
            train,
            valid,
            lead,
            store: event_store.clone(),
            interrupter: interrupter.clone(),
            checkpointing,
            num_epochs,
            starting_epoch,
            accumulation: grad_accumulation,
            plan: self.plan.clone(),
            figures: self.figures.clone(),
        };
        let failed = |e: LearnerError| -> ! { panic!("{e}") };
        match &self.ranks {
            Ranks::Group(group) => {
                let (lead, processor) = match group.rank() {
                    0 => (
                        Some(Lead {
                            processor: event_processor,
                            checkpointer,
                            early_stopping,
                        }),
                        None,
                    ),
                    _ => (None, Some(event_processor)),
                };
                let (model, lead) = Training::run(
                    job(learner, Feed::Own(train), Feed::Own(valid), lead),
                    group.clone(),
                )
                .unwrap_or_else(|e| failed(e));
                let processor = lead
                    .map(|l| l.processor)
                    .or(processor)
                    .expect("rank 0 hands its processor back, the others kept theirs");
                (model, processor)
            }
            Ranks::Threads(n) => {
                let n = *n;
                // Each rank its own copy of the model (ranks as threads must not share autodiff
                // tensors), its own Learner (optimizer and scheduler state).
                let copies = crate::copies(&learner.model(), n);
                let mut train_tx = Vec::new();
                let mut valid_tx = Vec::new();
                let mut feeds = Vec::new();
                for _ in 1..n {
                    let (t, tr) = std::sync::mpsc::sync_channel(2);
                    let (v, vr) = std::sync::mpsc::sync_channel(2);
                    train_tx.push(t);
                    valid_tx.push(v);
                    feeds.push((Feed::Follow(tr), Feed::Follow(vr)));
                }
                let mut lead = Some(Lead {
                    processor: event_processor,
                    checkpointer,
                    early_stopping,
                });
                let mut firsts = Some((Feed::Lead(train, train_tx), Feed::Lead(valid, valid_tx)));
                let mut feeds = feeds.into_iter();
                let jobs: Vec<_> = (0..n)
                    .map(|rank| {
                        let mut mine = learner.clone();
                        mine.load_model(copies.take(rank).into_record());
                        let (t, v) = match rank {
                            0 => firsts.take().expect("rank 0's feeds"),
                            _ => feeds.next().expect("a feed per rank"),
                        };
                        Mutex::new(Some(job(mine, t, v, lead.take())))
                    })
                    .collect();
                drop(learner);
                let results = crate::spawn_ranks(n, |group| {
                    let rank = group.rank();
                    let job = jobs[rank]
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .take()
                        .expect("one job per rank");
                    Training::run(job, Arc::new(group))
                })
                .unwrap_or_else(|e| failed(e.into()));
                let mut first = None;
                let mut errors = Vec::new();
                for (rank, r) in results.into_iter().enumerate() {
                    match r {
                        Ok((model, lead)) if rank == 0 => first = Some((model, lead)),
                        Ok(_) => {}
                        Err(e) => errors.push(format!("rank {rank}: {e}")),
                    }
                }
                match (first, errors.is_empty()) {
                    (Some((model, Some(lead))), true) => (model, lead.processor),
                    _ => panic!("kiln::learner: {}", errors.join("; ")),
                }
            }
        }
    }
}
