//! The zoo's models verified under kiln's sharding strategies: a [`Parallel`] for
//! `kiln_zoo::verify_dir_with`, used by `kiln verify-hf --strategy S --ranks N` and the tests.

use burn::module::AutodiffModule;
use burn::tensor::backend::{AutodiffBackend, Backend};
use kiln_comm::ProcessGroup;
use kiln_hf::HfError;
use kiln_hf::verify::Parallel;
use kiln_shard::{Shard, ShardConfig, Strategy, TpPlan, tensor_parallel};
use std::marker::PhantomData;
use std::sync::Arc;

/// One rank's strategy for a verification run.
#[derive(Debug, Clone)]
pub struct Sharding<B> {
    group: Arc<dyn ProcessGroup>,
    strategy: Strategy,
    tp: Option<(Arc<dyn ProcessGroup>, TpPlan)>,
    _inner: PhantomData<fn() -> B>,
}

impl<B> Sharding<B> {
    /// `strategy` over `group`. The checked training uses Burn's stock AdamW, which under ZeRO-1
    /// and ZeRO-2 would leave the parameters sliced after the step (`ShardedOptimizer` gathers
    /// them); those two are therefore refused here and checked by `kiln shard-check`.
    ///
    /// # Errors
    /// [`HfError::Parallel`] for ZeRO-1 and ZeRO-2.
    pub fn new(group: Arc<dyn ProcessGroup>, strategy: Strategy) -> Result<Self, HfError> {
        if matches!(strategy, Strategy::Zero1 | Strategy::Zero2) {
            return Err(HfError::Parallel(format!(
                "verification runs ddp, zero3 and hybrid; {strategy} differs from them only in \
                 the optimizer step, which `kiln shard-check --strategy {strategy}` checks"
            )));
        }
        Ok(Sharding {
            group,
            strategy,
            tp: None,
            _inner: PhantomData,
        })
    }

    /// Tensor parallelism over `tp` as `plan` says, applied after the strategy (over `group`,
    /// the data-parallel ranks) registered the parameters.
    ///
    pub fn with_tp(mut self, tp: Arc<dyn ProcessGroup>, plan: TpPlan) -> Self {
        self.tp = Some((tp, plan));
        self
    }
}

impl<B, AB> Parallel<AB> for Sharding<B>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
{
    fn prepare<M: AutodiffModule<AB>>(&self, model: M) -> Result<M, HfError> {
        let err = |e: kiln_shard::ShardError| HfError::Parallel(e.to_string());
        let model = kiln_shard::shard(model, self.group.clone(), ShardConfig::new(self.strategy))
            .map_err(err)?;
        match &self.tp {
            Some((group, plan)) => Ok(tensor_parallel(model, plan, group.clone()).map_err(err)?.0),
            None => Ok(model),
        }
    }

    fn refresh<M: AutodiffModule<AB>>(&self, model: &M) {
        kiln_shard::remark(model);
    }
}
