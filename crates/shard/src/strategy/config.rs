//! The strategies and how `shard` sets one up.

use crate::core::error::ShardError;
use std::ops::Range;

/// How parameters, gradients and optimizer state are spread over the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Strategy {
    /// Everything replicated; gradients all-reduced (PyTorch DDP).
    Ddp,
    /// Optimizer state sharded. Whole gradients live until backward ends, then are
    /// reduce-scattered at once; parameters are all-gathered after the step.
    Zero1,
    /// Optimizer state and gradients sharded: gradients are reduce-scattered bucket by bucket
    /// during backward, so whole-model gradients never coexist.
    Zero2,
    /// Parameters too: FSDP full shard. Parameters are gathered on use and dropped after.
    Zero3,
    /// ZeRO-3 within groups of `shard_size` consecutive ranks, replicated across the groups
    /// (FSDP's HYBRID_SHARD): shards are reduce-scattered in the group, then all-reduced across.
    Hybrid {
        /// Ranks per sharding group; must divide the world size.
        shard_size: usize,
    },
}

impl Strategy {
    /// Parameters live as shards between steps.
    pub fn shards_params(self) -> bool {
        matches!(self, Strategy::Zero3 | Strategy::Hybrid { .. })
    }
    /// Gradients are reduce-scattered (each rank keeps the shard it owns), not all-reduced.
    pub fn shards_grads(self) -> bool {
        !matches!(self, Strategy::Ddp)
    }
    /// Gradients are reduced bucket by bucket as backward produces them (all but ZeRO-1, which
    /// reduces them all when backward ends).
    pub fn reduces_during_backward(self) -> bool {
        !matches!(self, Strategy::Zero1)
    }
    /// The optimizer updates only this rank's slice.
    pub fn shards_optimizer(self) -> bool {
        !matches!(self, Strategy::Ddp)
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Strategy::Ddp => f.write_str("ddp"),
            Strategy::Zero1 => f.write_str("zero1"),
            Strategy::Zero2 => f.write_str("zero2"),
            Strategy::Zero3 => f.write_str("zero3"),
            Strategy::Hybrid { shard_size } => write!(f, "hybrid(shard {shard_size})"),
        }
    }
}

impl std::str::FromStr for Strategy {
    type Err = ShardError;
    /// `ddp`, `zero1`, `zero2`, `zero3` (or `fsdp`), `hybrid:S`.
    fn from_str(s: &str) -> Result<Self, ShardError> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "ddp" => Strategy::Ddp,
            "zero1" => Strategy::Zero1,
            "zero2" => Strategy::Zero2,
            "zero3" | "fsdp" => Strategy::Zero3,
            other => match other.strip_prefix("hybrid:").map(str::parse) {
                Some(Ok(shard_size)) => Strategy::Hybrid { shard_size },
                _ => {
                    return Err(ShardError::Config(format!(
                        "unknown strategy '{s}': expected ddp, zero1, zero2, zero3 or hybrid:S"
                    )));
                }
            },
        })
    }
}

/// How [`shard`](crate::shard()) makes every rank start from the same weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum InitSync {
    /// Every rank's parameters and buffers become rank 0's (PyTorch DDP's broadcast when it
    /// wraps a model, FSDP's `sync_module_states`): one bucketed broadcast for replicated
    /// parameters; under ZeRO-3 and hybrid, rank 0 sends each rank only its shard, so no other
    /// rank ever holds a whole tensor it did not build itself (the other ranks may build the
    /// model lazily, e.g. with Burn's lazy initialisers, and never materialise it).
    #[default]
    FromRank0,
    /// The caller guarantees equal weights (every rank loaded one checkpoint, or a seeded
    /// initialisation such as `kiln train`'s): nothing is sent but a fingerprint per parameter,
    /// all-gathered, and a parameter that differs is an error naming it and the rank.
    Verify,
}

/// How a model's buffers (BatchNorm's running statistics; see `strategy::buffers`) are made
/// equal across the data-parallel ranks after every optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BufferPolicy {
    /// Every rank takes rank 0's (PyTorch DDP's `broadcast_buffers=True`).
    #[default]
    Broadcast,
    /// Every rank takes the ranks' mean: for running means, the statistic of the whole batch.
    Mean,
    /// Each rank keeps its own (they differ across ranks).
    Local,
    /// SyncBatchNorm: `BatchNorm`'s batch statistics are computed over every data-parallel
    /// rank's rows in each training forward (and their gradients combined in backward), so the
    /// normalisation, the running statistics and the whole model are one device's on the whole
    /// batch. Costs two small all-reduces per statistic in forward and one in backward. Other
    /// buffers (the model's own `RunningState`s) are taken from rank 0 after each step.
    Sync,
}

/// What [`shard`](crate::shard()) sets up.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    /// The strategy.
    pub strategy: Strategy,
    /// Gradients are reduced in buckets of about this many bytes (PyTorch DDP's default is
    /// 25 MiB): fewer, larger collectives than one per parameter. The same size buckets the
    /// other bulk collectives (initial broadcast, ZeRO-1/2's parameter all-gather).
    pub bucket_bytes: usize,
    /// How the ranks' initial weights are made equal.
    pub init: InitSync,
    /// Communication runs on a thread of its own, overlapping computation: gradient buckets
    /// are reduced while backward goes on, and ZeRO-3 / hybrid prefetch parameters (on
    /// CPU process groups; NCCL groups keep blocking collectives). Off: every collective
    /// blocks the compute thread where it is issued (the results are the same).
    pub overlap: bool,
    /// ZeRO-3 / hybrid (with `overlap`): all-gathers of the parameters used next are issued
    /// ahead, in the order of the previous step (FSDP2's forward and backward prefetch),
    /// up to this many bytes of whole parameters in flight (at least one parameter; 0: no
    /// prefetch).
    pub prefetch_bytes: usize,
    /// How buffers are made equal across ranks after every optimizer step.
    pub buffers: BufferPolicy,
    /// Module paths of further buffers (globs; a pattern without a dot matches a path's last
    /// component): a model's own `RunningState`s. Burn's `BatchNorm` statistics are always
    /// buffers.
    pub buffer_paths: Vec<String>,
}

impl ShardConfig {
    /// `strategy` with the default bucket size, weights synchronised from rank 0.
    pub fn new(strategy: Strategy) -> Self {
        ShardConfig {
            strategy,
            bucket_bytes: 25 << 20,
            init: InitSync::FromRank0,
            overlap: true,
            prefetch_bytes: 32 << 20,
            buffers: BufferPolicy::Broadcast,
            buffer_paths: Vec::new(),
        }
    }
    /// Another bucket size.
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes.max(1);
        self
    }
    /// Another way of making initial weights equal.
    pub fn with_init(mut self, init: InitSync) -> Self {
        self.init = init;
        self
    }
    /// Communication overlapped with computation, or not (see [`ShardConfig::overlap`]).
    pub fn with_overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }
    /// Another buffer policy (see [`ShardConfig::buffers`]).
    pub fn with_buffers(mut self, policy: BufferPolicy) -> Self {
        self.buffers = policy;
        self
    }
    /// Further buffer paths (see [`ShardConfig::buffer_paths`]).
    pub fn with_buffer_paths(mut self, patterns: &[&str]) -> Self {
        self.buffer_paths = patterns.iter().map(|p| p.to_string()).collect();
        self
    }
    /// Another prefetch budget (see [`ShardConfig::prefetch_bytes`]).
    pub fn with_prefetch_bytes(mut self, bytes: usize) -> Self {
        self.prefetch_bytes = bytes;
        self
    }
}

/// Consecutive runs of `items` (a key and a size in bytes each, in the order every rank shares)
/// that one collective carries: a run ends once it holds `limit` bytes or where the key changes
/// (collectives carry one element type). Every run holds at least one item.
pub(crate) fn buckets<K: PartialEq>(items: &[(K, usize)], limit: usize) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    let mut bytes = 0;
    for (i, (key, size)) in items.iter().enumerate() {
        match runs.last_mut() {
            Some(run) if bytes < limit && items[run.start].0 == *key => run.end = i + 1,
            _ => {
                runs.push(i..i + 1);
                bytes = 0;
            }
        }
        bytes += size;
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::buckets;

    #[test]
    fn buckets_end_at_the_limit_and_where_the_key_changes() {
        let items = [('f', 4), ('f', 4), ('f', 4), ('i', 1), ('f', 20), ('f', 1)];
        assert_eq!(buckets(&items, 8), vec![0..2, 2..3, 3..4, 4..5, 5..6]);
        assert_eq!(buckets(&items, 100), vec![0..3, 3..4, 4..6]);
        assert!(buckets::<char>(&[], 8).is_empty());
    }
}
