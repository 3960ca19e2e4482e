//! The Learner's state around kiln's step and for its checkpoints.
//!
//! burn-train 0.21's `Learner` keeps its optimizer and scheduler private: it steps its own
//! optimizer on its own model (`optimizer_step`), loads records (`load_model`, `load_optim`) and
//! lets its checkpointer read them. So kiln drives it through those doors:
//!
//! - the step: [`LearnerOptim`] is an optimizer whose step loads the (sharded) model into the
//!   Learner and runs the Learner's own optimizer step, so kiln's [`ShardedOptimizer`] wraps the
//!   program's optimizer (slicing ZeRO-1/2's replicated parameters around it);
//! - the optimizer's state: [`optimizer_record`] reads it through a `LearningCheckpointer` of
//!   kiln's own that keeps the records in memory (the one reader burn-train has);
//! - checkpoints: [`StateRecord::gather_whole`] gathers each parameter's sharded state, in the
//!   model's parameter order (the same on every rank, as collectives need), into the whole
//!   record one device would hold.
//!
//! [`ShardedOptimizer`]: kiln_shard::ShardedOptimizer

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::record::AdaptorRecord;
use burn::optim::{
    GradientsParams, LearningRate, MultiGradientsParams, Optimizer, SimpleOptimizer,
};
use burn::record::{FullPrecisionSettings, Record};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpointer, CheckpointerError, CheckpointingAction, CheckpointingStrategy,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearningCheckpointer, LearningComponentsTypes};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

type Model<LC> = <LC as LearningComponentsTypes>::TrainingModel;
type Backend<LC> = <LC as LearningComponentsTypes>::Backend;
/// The record of a Learner's optimizer.
pub type OptimRecord<LC> =
    <<LC as LearningComponentsTypes>::Optimizer as Optimizer<Model<LC>, Backend<LC>>>::Record;

/// The program's optimizer, stepped through its Learner (see the module docs). Cloning shares
/// the Learner.
pub struct LearnerOptim<LC: LearningComponentsTypes>(pub Arc<Mutex<Learner<LC>>>);

impl<LC: LearningComponentsTypes> Clone for LearnerOptim<LC> {
    fn clone(&self) -> Self {
        LearnerOptim(self.0.clone())
    }
}

impl<LC: LearningComponentsTypes> std::fmt::Debug for LearnerOptim<LC> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LearnerOptim")
    }
}

impl<LC: LearningComponentsTypes> LearnerOptim<LC> {
    /// The Learner, locked.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Learner<LC>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<LC> Optimizer<Model<LC>, Backend<LC>> for LearnerOptim<LC>
where
    LC: LearningComponentsTypes,
    Learner<LC>: Send,
{
    type Record = ();

    /// The Learner's own step at the Learner's learning rate (its scheduler's; `lr`, the same
    /// value, is not needed).
    fn step(&mut self, _lr: LearningRate, module: Model<LC>, grads: GradientsParams) -> Model<LC> {
        let mut learner = self.lock();
        learner.load_model(module.into_record());
        learner.optimizer_step(grads);
        learner.model()
    }

    fn step_multi(
        &mut self,
        _lr: LearningRate,
        module: Model<LC>,
        grads: MultiGradientsParams,
    ) -> Model<LC> {
        let mut learner = self.lock();
        learner.load_model(module.into_record());
        learner.optimizer_step_multi(grads);
        learner.model()
    }

    fn to_record(&self) -> Self::Record {}

    fn load_record(self, _record: Self::Record) -> Self {
        self
    }
}

/// A checkpointer that keeps the last record saved, for [`optimizer_record`].
struct Keep<R>(Arc<(Mutex<Option<R>>, Condvar)>);

impl<R> Clone for Keep<R> {
    fn clone(&self) -> Self {
        Keep(self.0.clone())
    }
}

impl<R> Keep<R> {
    fn new() -> Self {
        Keep(Arc::new((Mutex::new(None), Condvar::new())))
    }

    /// Waits for the record (the checkpointer's thread saves it after `checkpoint` returns).
    fn take(&self) -> R {
        let (slot, ready) = &*self.0;
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(r) = slot.take() {
                return r;
            }
            slot = ready.wait(slot).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl<R, B> Checkpointer<R, B> for Keep<R>
where
    R: Record<B> + Send,
    B: burn::tensor::backend::Backend,
{
    fn save(&self, _epoch: usize, record: R) -> Result<(), CheckpointerError> {
        let (slot, ready) = &*self.0;
        *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(record);
        ready.notify_all();
        Ok(())
    }

    fn delete(&self, _epoch: usize) -> Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(&self, _epoch: usize, _device: &B::Device) -> Result<R, CheckpointerError> {
        Err(CheckpointerError::Unknown(
            "kiln's in-memory checkpointer does not restore".into(),
        ))
    }
}

/// Every epoch's checkpoint is saved (the in-memory one of [`optimizer_record`]).
struct SaveAlways;

impl CheckpointingStrategy for SaveAlways {
    fn checkpointing(&mut self, _: usize, _: &EventStoreClient) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

/// The Learner's optimizer record, read through a checkpointer of kiln's own that keeps it in
/// memory (burn-train 0.21 has no other way to read it). Local: no collective.
pub fn optimizer_record<LC>(learner: &Learner<LC>, store: &EventStoreClient) -> OptimRecord<LC>
where
    LC: LearningComponentsTypes,
    OptimRecord<LC>: Send,
{
    let model = Keep::new();
    let optim = Keep::<OptimRecord<LC>>::new();
    let scheduler = Keep::new();
    let mut checkpointer = LearningCheckpointer::<LC>::new(
        AsyncCheckpointer::new(model.clone()),
        AsyncCheckpointer::new(optim.clone()),
        AsyncCheckpointer::new(scheduler.clone()),
        Box::new(SaveAlways),
    );
    checkpointer.checkpoint(learner, 0, store);
    let record = optim.take();
    drop(model.take());
    drop(scheduler.take());
    record
}

/// An optimizer record kiln can gather whole: Burn's `OptimizerAdaptor`s' (every optimizer a
/// Burn config's `init()` makes: SGD, Adam, AdamW, AdaGrad, RMSProp, ...).
pub trait StateRecord<AB: AutodiffBackend>: Record<AB> + Sized {
    /// The whole state one device would hold, from this rank's (sharded) state: each
    /// parameter's state gathered in `order` (the model's parameter order, the same on every
    /// rank), so that every rank reaches the same collectives. A collective: every rank calls
    /// it; rank 0 gets the record (`None` elsewhere).
    fn gather_whole(self, order: &[ParamId], rank: usize, device: &AB::Device) -> Option<Self>;
}

impl<O, AB> StateRecord<AB> for hashbrown::HashMap<ParamId, AdaptorRecord<O, AB>>
where
    AB: AutodiffBackend,
    O: SimpleOptimizer<AB::InnerBackend>,
{
    fn gather_whole(mut self, order: &[ParamId], rank: usize, device: &AB::Device) -> Option<Self> {
        let mut whole = hashbrown::HashMap::new();
        for id in order {
            if let Some(state) = self.remove(id) {
                // Reading a sharded tensor's values all-gathers it: the item is whole.
                let item = state.into_item::<FullPrecisionSettings>();
                if rank == 0 {
                    whole.insert(*id, AdaptorRecord::from_item(item, device));
                }
            }
        }
        (rank == 0).then_some(whole)
    }
}

/// The model's trainable parameters' ids, in module order.
pub fn param_order<AB: AutodiffBackend, M: AutodiffModule<AB>>(model: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    model.visit(&mut ids);
    ids.0
}
