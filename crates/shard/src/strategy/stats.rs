//! What a sharded model's strategy did: its traffic and its prefetches.

use super::prefetch::PrefetchStats;
use super::shard::Marks;
use crate::core::backend::Shard;
use burn::module::Module;
use burn::tensor::backend::{AutodiffBackend, Backend};
use kiln_comm::CommStats;

/// This rank's traffic so far on the groups `module`'s sharding uses, or `None` if it is not
/// sharded: without hybrid sharding, the group passed to [`shard`] (so it includes the
/// caller's own collectives on that group); under hybrid sharding, the shard and replicate
/// sub-groups made from it, whose counters the parent group does not see; with
/// [`ShardConfig::overlap`](crate::ShardConfig::overlap), the communication queue's sub-group
/// too. Take the difference of two readings ([`CommStats::since`]) for one step's traffic.
///
/// [`shard`]: crate::shard()
pub fn comm_stats<B, AB, M>(module: &M) -> Option<CommStats>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    let models = Marks::<B>::of::<AB, M>(module).models();
    let m = models.first()?;
    let mut shard = m.shard_group.stats();
    if let Some(queue) = &m.queue {
        shard = shard.plus(&queue.group().stats());
    }
    Some(match &m.replicate_group {
        Some(r) => shard.plus(&r.stats()),
        None => shard,
    })
}

/// How many parameter gathers `module`'s sharded model made through its communication queue,
/// and how many an all-gather issued ahead served (ZeRO-3 / hybrid with
/// [`ShardConfig::overlap`](crate::ShardConfig::overlap)); `None` if it is not sharded.
pub fn prefetch_stats<B, AB, M>(module: &M) -> Option<PrefetchStats>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    let models = Marks::<B>::of::<AB, M>(module).models();
    let m = models.first()?;
    Some(
        m.prefetch
            .as_ref()
            .map(|p| p.lock().stats)
            .unwrap_or_default(),
    )
}
