//! A model's and its optimizer's state as snapshot pieces: what every rank writes of what it
//! holds, and what it reads back for the layout it runs (another world size or strategy).

use crate::error::{Result, TrainError};
use crate::snapshot::{self, Meta, Part, Snapshot};
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamW, AdamWState, AdaptiveMomentumState, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, TensorMetadata};
use hashbrown::HashMap;
use kiln_comm::{ProcessGroup, shard_range};
use kiln_shard::pieces::{self, held_range};
use kiln_shard::{Shard, ShardTensor, ShardedOptimizer, Train, optimizer_state_group};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const TENSOR_PREFIX: &str = "model/";
const M1_PREFIX: &str = "adamw.m1/";
const M2_PREFIX: &str = "adamw.m2/";

/// The part of `t` this rank writes: its range split among the ranks holding the same values.
fn part_of<B: Backend>(
    name: String,
    t: &ShardTensor<B>,
    world: usize,
    rank: usize,
    tp: usize,
) -> Part {
    let (copies, copy) = match t {
        ShardTensor::Sharded(s) => {
            // The mesh is dp_replicate x dp_shard x tp, tp fastest: a sharding group's ranks
            // are `tp` apart, and the ranks holding one shard are those of other replicas and
            // other tp ranks.
            let size = s.group.world_size();
            (world / size, rank / (tp * size) * tp + rank % tp)
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
/// `to`: where (the run's `snapshots/`, or its memory snapshots).
#[allow(clippy::too_many_arguments)]
pub(crate) fn save<B, C, M>(
    model: &M,
    optim: &ShardedOptimizer<OptimizerAdaptor<AdamW, M, Train<B, C>>, B>,
    meta: &Meta,
    group: &dyn ProcessGroup,
    dp: &dyn ProcessGroup,
    tp: usize,
    pipe: Option<&kiln_pipe::Pipeline>,
    to: SaveTo<'_>,
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
    // Buffers (BatchNorm's statistics) are part of the model's state too; equal on every rank.
    let buffers = kiln_shard::buffer_paths::<Train<B, C>, M>(model, &[]);
    let other_stage = |path: &str, t: &ShardTensor<B>| {
        t.shape().num_elements() == 0 || pipe.is_some_and(|p| p.holds_copy(path))
    };
    pieces::visit_params::<B, Train<B, C>, M>(model, |path, _, t| {
        let saved = trainable.contains(path) || buffers.contains(path);
        if saved && !other_stage(path, t) {
            parts.push(part_of(
                format!("{TENSOR_PREFIX}{path}"),
                t,
                world,
                rank,
                tp,
            ));
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
        parts.push(part_of(format!("{M1_PREFIX}{path}"), &m1, world, rank, tp));
        parts.push(part_of(format!("{M2_PREFIX}{path}"), &m2, world, rank, tp));
    }
    match to {
        SaveTo::Here { root, keep } => snapshot::save(root, meta, parts, group, keep),
        SaveTo::WithPeer { root, peers } => {
            crate::memory::save_with_peer(root, meta, parts, group, peers)
        }
    }
}

/// Where [`save`] writes.
pub(crate) enum SaveTo<'a> {
    /// A snapshot every rank sees (`root`), of which the newest `keep` stay.
    Here { root: &'a Path, keep: usize },
    /// This machine's memory snapshots, with a copy on the next machine (ranks on several).
    WithPeer {
        root: &'a Path,
        peers: crate::memory::Peers,
    },
}

pub(crate) type Record<B, C> = HashMap<ParamId, AdaptorRecord<AdamW, Train<B, C>>>;

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
    let buffers = kiln_shard::buffer_paths::<Train<B, C>, M>(&model, &[]);
    let model = pieces::map_params::<B, Train<B, C>, M>(model, |path, t| {
        let saved = trainable.contains(path) || buffers.contains(path);
        if !saved || t.shape().num_elements() == 0 {
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
pub(crate) fn load_optimizer<B, C, M>(
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
            param: &ShardTensor<B>,
        ) -> Result<Tensor<Shard<B>, D>> {
            let numel = shape.iter().product();
            // A tensor-parallel parameter's moments are laid out as its part (whole, or
            // sharded over the data-parallel group), from the whole tensor saved.
            if let Some(part) = param.part() {
                let values = self.snap.read(&name, shape, 0..numel)?;
                let whole = TensorData::new(values, shape.to_vec());
                let whole = B::float_from_data(whole, self.device);
                return Ok(pieces::tensor((part.of_whole)(whole)));
            }
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
            let p = pieces::primitive(param.val().inner());
            let moments = self.moment::<D>(m1, &shape, &p).and_then(|a| {
                Ok((
                    a,
                    self.moment::<D>(format!("{M2_PREFIX}{path}"), &shape, &p)?,
                ))
            });
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
