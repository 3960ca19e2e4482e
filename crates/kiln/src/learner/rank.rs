//! One rank's training: burn-train's epoch loop (train, validate, checkpoint, stop early), with
//! each batch split among the ranks, the model parallelized, kiln's step around the Learner's
//! optimizer, and the events and checkpoints on rank 0.

use super::error::LearnerError;
use super::split::{Gather, Share, Split};
use super::state::{LearnerOptim, OptimRecord, StateRecord, optimizer_record, param_order};
use crate::{Mesh, NoStages, ParallelPlan, Whole, parallelize};
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::module::{AutodiffModule, Module};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::Backend;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, LearnerEvent,
    LearningCheckpointer, LearningComponentsTypes, SupervisedTrainingEventProcessor, TrainStep,
    TrainingItem,
};
use kiln_comm::{BufMut, ProcessGroup, ReduceOp};
use kiln_shard::account::{param_bytes, record_bytes};
use kiln_shard::{
    ShardError, ShardedOptimizer, StepConfig, Train, autocast, gather_model, no_sync,
    reduce_gradients, release, remark, scale_grads, step_with, with_batch_statistics,
};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex};

pub(crate) type Model<LC> = <LC as LearningComponentsTypes>::TrainingModel;
pub(crate) type TrainInput<LC> = <Model<LC> as TrainStep>::Input;
pub(crate) type ValidInput<LC> =
    <<LC as LearningComponentsTypes>::InferenceModel as InferenceStep>::Input;

/// What a rank held after training, as kiln measured it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankFigures {
    /// The rank.
    pub rank: usize,
    /// Bytes of the model's parameters this rank held (its shards under ZeRO-3).
    pub param_bytes: usize,
    /// Bytes of the optimizer's state this rank held (its shards under ZeRO-1/2/3), serialised.
    pub optim_bytes: usize,
    /// Optimizer steps taken.
    pub steps: usize,
}

/// What rank 0 holds besides its model: the program's dashboard and loggers (the event
/// processor), its checkpointer and its early stopping.
pub(crate) struct Lead<LC: LearningComponentsTypes> {
    pub processor: SupervisedTrainingEventProcessor<LC>,
    pub checkpointer: Option<LearningCheckpointer<LC>>,
    pub early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
}

/// One batch's share for this rank: (its rows, the loader's progress, the batch's rows).
type Msg<I> = Option<(I, Progress, usize)>;

/// Where a rank's batches come from.
pub(crate) enum Feed<X: Backend, I> {
    /// The rank reads the program's loader itself and keeps its rows (ranks as processes, each
    /// with the loader the same program built: the same batches in the same order).
    Own(Arc<dyn DataLoader<X, I>>),
    /// Rank 0 of ranks as threads: reads the loader and sends every other rank its rows.
    Lead(Arc<dyn DataLoader<X, I>>, Vec<SyncSender<Msg<I>>>),
    /// The other ranks as threads: their rows, from rank 0.
    Follow(Receiver<Msg<I>>),
}

struct Epoch<'a, I> {
    iter: Option<Box<dyn DataLoaderIterator<I> + 'a>>,
    /// This rank's place among the ranks that take different rows, and their number.
    rank: usize,
    world: usize,
    /// Ranks per data-parallel rank (tensor parallelism, the mesh's fastest axis): world rank
    /// `w` takes the rows of data-parallel rank `w / tp`.
    tp: usize,
}

impl<X: Backend, I: Split + Send> Feed<X, I> {
    fn epoch(&self, rank: usize, world: usize, tp: usize) -> Epoch<'_, I> {
        let iter = match self {
            Feed::Own(l) | Feed::Lead(l, _) => Some(l.iter()),
            Feed::Follow(_) => None,
        };
        Epoch {
            iter,
            rank,
            world,
            tp,
        }
    }

    /// Reads `epochs` epochs of the loader without training on them, so that a resumed run
    /// draws what the uninterrupted run drew: the loader's shuffles, and the draws of a dataset
    /// with a generator of its own (burn's `SamplerDataset` draws as it is read). The cost is
    /// the skipped epochs' data loading (no step runs); Burn's loaders have no state to restore.
    fn skip(&self, epochs: usize) {
        if let Feed::Own(l) | Feed::Lead(l, _) = self {
            for _ in 0..epochs {
                for _ in l.iter() {}
            }
        }
    }

    /// This rank's next share, or `None` at the epoch's end.
    fn next(&self, epoch: &mut Epoch<'_, I>) -> Result<Option<(I, Progress, Share)>, LearnerError> {
        let (rank, world, tp) = (epoch.rank, epoch.world, epoch.tp);
        let share = |rows| Share { rank, world, rows };
        let mine = |item: I, rows: usize| {
            // One rank keeps the batch untouched: the numbers of one device, exactly.
            let part = if world == 1 {
                item
            } else {
                item.split(&share(rows))
            };
            (part, rows)
        };
        match self {
            Feed::Own(_) => {
                let it = epoch.iter.as_mut().expect("a reading rank iterates");
                let Some(item) = it.next() else {
                    return Ok(None);
                };
                let progress = it.progress();
                let rows = item.rows();
                check_share(&share(rows))?;
                let (part, rows) = mine(item, rows);
                Ok(Some((part, progress, share(rows))))
            }
            Feed::Lead(_, followers) => {
                let it = epoch.iter.as_mut().expect("a reading rank iterates");
                let Some(item) = it.next() else {
                    for f in followers {
                        let _ = f.send(None);
                    }
                    return Ok(None);
                };
                let progress = it.progress();
                let rows = item.rows();
                // Refused before any rank splits it (the others then stop with rank 0).
                check_share(&share(rows))?;
                for (i, f) in followers.iter().enumerate() {
                    let theirs = item.split(&Share {
                        rank: (i + 1) / tp,
                        world,
                        rows,
                    });
                    f.send(Some((theirs, progress.clone(), rows)))
                        .map_err(|_| {
                            LearnerError::Disagree(format!("rank {} stopped taking batches", i + 1))
                        })?;
                }
                let (part, rows) = mine(item, rows);
                Ok(Some((part, progress, share(rows))))
            }
            Feed::Follow(rx) => match rx.recv() {
                Ok(Some((part, progress, rows))) => Ok(Some((part, progress, share(rows)))),
                Ok(None) => Ok(None),
                Err(_) => Err(LearnerError::Disagree(
                    "rank 0 stopped sending batches".into(),
                )),
            },
        }
    }
}

/// One rank's job.
pub(crate) struct RankJob<B: Backend, C: CheckpointStrategy, LC: LearningComponentsTypes> {
    pub learner: burn::train::Learner<LC>,
    pub train: Feed<Train<B, C>, TrainInput<LC>>,
    pub valid: Feed<kiln_shard::Shard<B>, ValidInput<LC>>,
    pub lead: Option<Lead<LC>>,
    pub store: Arc<EventStoreClient>,
    pub interrupter: Interrupter,
    pub checkpointing: bool,
    pub num_epochs: usize,
    pub starting_epoch: usize,
    pub accumulation: Option<usize>,
    pub plan: ParallelPlan,
    pub figures: Arc<Mutex<Vec<RankFigures>>>,
}

/// What the ranks agree on before each batch: stop (the interrupter, on any rank), whether
/// there is a batch, and its size (equal on every rank, else their loaders differ).
struct Agreed {
    stop: bool,
    more: bool,
}

fn agree(
    group: &dyn ProcessGroup,
    stop: bool,
    rows: Option<usize>,
    what: &str,
) -> Result<Agreed, LearnerError> {
    let r = rows.map_or(-1, |r| r as i64);
    let mut v = [i64::from(stop), r, -r];
    group.all_reduce(BufMut::I64(&mut v), ReduceOp::Max)?;
    if v[1] != -v[2] {
        let most = (v[1] >= 0).then_some(v[1] as usize);
        let least = (-v[2] >= 0).then_some((-v[2]) as usize);
        return Err(LearnerError::Disagree(format!(
            "{what}: one rank has {}, another has {} (ranks as processes must build the same \
             loaders: the same data, batch size and shuffle seed, and at most one worker, whose \
             order is the dataset's)",
            describe(most),
            describe(least),
        )));
    }
    Ok(Agreed {
        stop: v[0] != 0,
        more: rows.is_some(),
    })
}

fn describe(rows: Option<usize>) -> String {
    match rows {
        Some(n) => format!("a batch of {n} items"),
        None => "no batch left".into(),
    }
}

/// Whether training goes on after an epoch's batches.
#[derive(Debug, PartialEq, Eq)]
enum Epochs {
    Continue,
    /// A rank's interrupter stopped it (every rank stops).
    Interrupted,
}

/// A rank's training in progress: what the parts of the epoch loop share.
pub(crate) struct Training<B: Backend, C: CheckpointStrategy, LC: LearningComponentsTypes> {
    group: Arc<dyn ProcessGroup>,
    /// The ranks that take different rows (the data-parallel group: under tensor parallelism
    /// a tp group's ranks compute the same rows together); `rank` and `world` are in it.
    data: Arc<dyn ProcessGroup>,
    rank: usize,
    world: usize,
    device: B::Device,
    /// The parallelized model (its shards under ZeRO-3); taken only by the optimizer's step.
    model: Option<Model<LC>>,
    optim: LearnerOptim<LC>,
    config: StepConfig,
    /// Rank 0's event processor, checkpointer and early stopping.
    lead: Option<Lead<LC>>,
    store: Arc<EventStoreClient>,
    interrupter: Interrupter,
    accumulation: Option<usize>,
    /// Optimizer steps taken.
    steps: usize,
    _checkpointing: std::marker::PhantomData<C>,
}

/// Gradients accumulated over batches (`accumulation`).
struct Accumulated<LC: LearningComponentsTypes> {
    grads: GradientsAccumulator<Model<LC>>,
    batches: usize,
}

impl<B, C, LC> Training<B, C, LC>
where
    B: Backend,
    C: CheckpointStrategy,
    LC: LearningComponentsTypes<Backend = Train<B, C>>,
    TrainInput<LC>: Split + Send,
    <Model<LC> as TrainStep>::Output: Gather,
    ValidInput<LC>: Split + Send,
    <LC::InferenceModel as InferenceStep>::Output: Gather,
    OptimRecord<LC>: StateRecord<Train<B, C>> + Send,
    burn::train::Learner<LC>: Send,
{
    /// Trains `job` on this rank of `group`; returns the whole model (every rank) and rank 0's
    /// lead back.
    pub fn run(
        job: RankJob<B, C, LC>,
        group: Arc<dyn ProcessGroup>,
    ) -> Result<(Model<LC>, Option<Lead<LC>>), LearnerError> {
        let RankJob {
            learner,
            train,
            valid,
            lead,
            store,
            interrupter,
            checkpointing,
            num_epochs,
            starting_epoch,
            accumulation,
            plan,
            figures,
        } = job;
        let device: B::Device = Default::default();
        let mesh = Mesh::new(group.clone(), &plan)?;
        let parallel = parallelize::<B, C, Model<LC>, Whole, NoStages>(
            learner.model(),
            &Whole,
            &NoStages,
            &plan,
            &mesh,
            &device,
        )?;
        let optim = LearnerOptim(Arc::new(Mutex::new(learner)));
        // The Learner holds the sharded model from here (not a whole copy).
        optim
            .lock()
            .load_model(parallel.model.clone().into_record());
        let mut t = Training::<B, C, LC> {
            rank: mesh.dp.rank(),
            world: mesh.dp.world_size(),
            data: mesh.dp.clone(),
            group,
            device,
            model: Some(parallel.model),
            optim,
            config: parallel.step,
            lead,
            store,
            interrupter,
            accumulation,
            steps: 0,
            _checkpointing: std::marker::PhantomData,
        };
        train.skip(starting_epoch.saturating_sub(1));
        valid.skip(starting_epoch.saturating_sub(1));
        for epoch in starting_epoch..=num_epochs {
            let global = Progress::new(epoch, num_epochs);
            if t.train_epoch(&train, epoch, &global)? == Epochs::Interrupted {
                break;
            }
            t.validate(&valid, epoch, &global)?;
            if checkpointing {
                t.checkpoint(epoch);
            }
            if t.stop_early(epoch)? {
                break;
            }
        }
        t.finish(&figures)
    }

    fn model(&self) -> &Model<LC> {
        self.model.as_ref().expect("the model between steps")
    }

    /// An epoch's training batches; whether a rank was interrupted.
    fn train_epoch(
        &mut self,
        train: &Feed<Train<B, C>, TrainInput<LC>>,
        epoch: usize,
        global: &Progress,
    ) -> Result<Epochs, LearnerError> {
        let tp = self.group.world_size() / self.world;
        let mut feed = train.epoch(self.rank, self.world, tp);
        let mut iteration = 0;
        let mut accumulated = Accumulated::<LC> {
            grads: GradientsAccumulator::new(),
            batches: 0,
        };
        let mut interrupted = false;
        loop {
            let next = train.next(&mut feed)?;
            let agreed = agree(
                self.group.as_ref(),
                self.interrupter.should_stop(),
                next.as_ref().map(|n| n.2.rows),
                "training batches",
            )?;
            if agreed.stop {
                interrupted = true;
                break;
            }
            let Some((item, progress, share)) = next.filter(|_| agreed.more) else {
                break;
            };
            iteration += 1;
            self.optim.lock().lr_step();
            let out = self.batch(item, &share, &mut accumulated)?;
            let lr = self.optim.lock().lr_current();
            let item = out.gather(&share, self.data.as_ref())?;
            if let (Some(lead), Some(item)) = (self.lead.as_mut(), item) {
                let item =
                    TrainingItem::new(item, progress, global.clone(), Some(iteration), Some(lr));
                lead.processor
                    .process_train(LearnerEvent::ProcessedItem(item));
            }
        }
        if let Some(lead) = self.lead.as_mut() {
            lead.processor.process_train(LearnerEvent::EndEpoch(epoch));
        }
        if !interrupted {
            return Ok(Epochs::Continue);
        }
        if !self.interrupter.should_stop() {
            self.interrupter.stop(Some("another rank was interrupted"));
        }
        Ok(Epochs::Interrupted)
    }

    /// One batch: forward and backward of this rank's rows (the program's `TrainStep`),
    /// gradients reduced over the ranks as the strategy says, the optimizer's step when the
    /// accumulation is complete; the step's output.
    fn batch(
        &mut self,
        item: TrainInput<LC>,
        share: &Share,
        accumulated: &mut Accumulated<LC>,
    ) -> Result<<Model<LC> as TrainStep>::Output, LearnerError> {
        let model = self.model();
        let even = share.is_even();
        let deferred = self.accumulation.is_some() || !even;
        // Ranks with a row more weigh more: the batch's mean, as one device.
        let weight = match even {
            true => 1.0,
            false => (share.len() * self.world) as f64 / share.rows as f64,
        };
        // The program's step, with BatchNorm's statistics over the ranks under
        // BufferPolicy::Sync.
        let precision = self.config.precision;
        let train_step = |item| {
            with_batch_statistics::<B, Train<B, C>, _, _>(model, weight, || {
                autocast(precision, || TrainStep::step(model, item))
            })
        };
        let out = if deferred {
            let out = no_sync(model, || train_step(item));
            remark::<B, Train<B, C>, _>(model);
            out
        } else {
            train_step(item)
        };
        let grads = if even {
            out.grads
        } else {
            scale_grads::<Train<B, C>, _>(model, out.grads, weight)
        };
        let ready = match self.accumulation {
            Some(k) => {
                accumulated.grads.accumulate(model, grads);
                accumulated.batches += 1;
                (accumulated.batches >= k).then(|| {
                    accumulated.batches = 0;
                    reduce_gradients::<B, Train<B, C>, _>(model, accumulated.grads.grads())
                })
            }
            None if deferred => Some(reduce_gradients::<B, Train<B, C>, _>(model, grads)),
            None => Some(grads),
        };
        if let Some(grads) = ready {
            let model = self.model.take().expect("the model between steps");
            self.model = Some(optimizer_step(model, &self.optim, &self.config, grads)?);
            self.steps += 1;
        }
        Ok(out.item)
    }

    /// An epoch's validation, on every rank (reading a sharded parameter is a collective).
    fn validate(
        &mut self,
        valid: &Feed<kiln_shard::Shard<B>, ValidInput<LC>>,
        epoch: usize,
        global: &Progress,
    ) -> Result<(), LearnerError> {
        let g = self.group.as_ref();
        let model_valid = self.model().valid();
        let tp = self.group.world_size() / self.world;
        let mut feed = valid.epoch(self.rank, self.world, tp);
        let mut iteration = 0;
        loop {
            let next = valid.next(&mut feed)?;
            let agreed = agree(
                g,
                self.interrupter.should_stop(),
                next.as_ref().map(|n| n.2.rows),
                "validation batches",
            )?;
            let Some((item, progress, share)) = next.filter(|_| agreed.more && !agreed.stop) else {
                break;
            };
            iteration += 1;
            let out = autocast(self.config.precision, || {
                InferenceStep::step(&model_valid, item)
            });
            let gathered = out.gather(&share, self.data.as_ref())?;
            if let (Some(lead), Some(out)) = (self.lead.as_mut(), gathered) {
                let item = TrainingItem::new(out, progress, global.clone(), Some(iteration), None);
                lead.processor
                    .process_valid(LearnerEvent::ProcessedItem(item));
            }
        }
        if let Some(lead) = self.lead.as_mut() {
            lead.processor.process_valid(LearnerEvent::EndEpoch(epoch));
        }
        Ok(())
    }

    /// Every rank gathers its part, rank 0 writes through the program's checkpointer (its
    /// recorder, directory and strategy).
    fn checkpoint(&mut self, epoch: usize) {
        let whole = gather_model::<B, Train<B, C>, _>(self.model().clone());
        let record = optimizer_record(&self.optim.lock(), &self.store);
        let state =
            record.gather_whole(&param_order(self.model()), self.group.rank(), &self.device);
        if let (Some(lead), Some(state)) = (self.lead.as_mut(), state)
            && let Some(checkpointer) = lead.checkpointer.as_mut()
        {
            let mut learner = self.optim.lock().clone();
            learner.load_model(whole.into_record());
            learner.load_optim(state);
            checkpointer.checkpoint(&learner, epoch, &self.store);
        }
    }

    /// Early stopping: rank 0 decides from its metrics, every rank follows.
    fn stop_early(&mut self, epoch: usize) -> Result<bool, LearnerError> {
        let stop = self
            .lead
            .as_mut()
            .and_then(|l| l.early_stopping.as_mut())
            .is_some_and(|s| s.should_stop(epoch, &self.store));
        let mut flag = [i64::from(stop)];
        self.group
            .all_reduce(BufMut::I64(&mut flag), ReduceOp::Max)?;
        Ok(flag[0] != 0)
    }

    /// What the rank held (for `figures`), and the model whole on every rank, free of the
    /// groups (they end with the job): the program's code after `fit` uses it as one
    /// device's.
    fn finish(
        self,
        figures: &Mutex<Vec<RankFigures>>,
    ) -> Result<(Model<LC>, Option<Lead<LC>>), LearnerError> {
        let record = optimizer_record(&self.optim.lock(), &self.store);
        figures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(RankFigures {
                rank: self.group.rank(),
                param_bytes: param_bytes::<B, Train<B, C>, _>(self.model()),
                optim_bytes: record_bytes::<Train<B, C>, _>(record),
                steps: self.steps,
            });
        let model = self.model.expect("the model between steps");
        let whole = gather_model::<B, Train<B, C>, _>(model);
        release::<B, Train<B, C>, _>(&whole);
        Ok((Model::<LC>::from_inner(whole.valid()), self.lead))
    }
}

/// A batch too small for the world: a rank would train on no row.
fn check_share(share: &Share) -> Result<(), LearnerError> {
    if share.rows < share.world {
        return Err(LearnerError::Unsupported(format!(
            "a batch of {} items cannot be split over {} ranks (each needs at least one): use a \
             batch size of at least {} (or drop the last, smaller batch)",
            share.rows, share.world, share.world
        )));
    }
    Ok(())
}

/// kiln's step around the Learner's optimizer: ZeRO-1/2's slicing, global-norm clipping, the
/// precision policy, re-marking for the next backward, buffers made equal.
fn optimizer_step<B, C, LC>(
    model: Model<LC>,
    optim: &LearnerOptim<LC>,
    config: &StepConfig,
    grads: GradientsParams,
) -> Result<Model<LC>, LearnerError>
where
    B: Backend,
    C: CheckpointStrategy,
    LC: LearningComponentsTypes<Backend = Train<B, C>>,
    burn::train::Learner<LC>: Send,
{
    let lr = optim.lock().lr_current();
    let mut sharded = ShardedOptimizer::<_, B>::new(optim.clone());
    let (model, _) = step_with(model, &mut sharded, lr, config, None, |_, _| {
        Ok::<_, ShardError>((0.0, grads))
    })?;
    Ok(model)
}
