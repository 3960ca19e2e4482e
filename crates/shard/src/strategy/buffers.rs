//! Buffers: floats a model updates in its forward pass instead of training them (Burn's
//! `BatchNorm` running mean and variance, kept in a `RunningState`). Each rank updates them
//! from its own rows, so without care they drift apart across ranks: evaluation and the saved
//! model would depend on which rank saves.
//!
//! - Buffers are never sharded (ZeRO-3 and hybrid keep them whole on every rank, as FSDP
//!   keeps module buffers).
//! - After every optimizer step ([`ShardedOptimizer`](crate::ShardedOptimizer)), the ranks'
//!   buffers are made equal by the model's [`BufferPolicy`]: rank 0's (PyTorch DDP's
//!   `broadcast_buffers`, the default), or the ranks' mean; `Local` leaves each rank its own.
//!   `Sync` (SyncBatchNorm) computes `BatchNorm`'s batch statistics over all the ranks' rows
//!   during the forward pass (`core::ops::batch`), so every rank's are the whole batch's.
//!   Doing it after the step (rather than before the next forward, as DDP does) means the
//!   ranks agree at every point between steps: validation, snapshots, `gather_model`, exports.
//! - A model stepped by a plain Burn optimizer calls [`sync_buffers`] itself.
//!
//! Which floats are buffers: every `running_mean` and `running_var` of Burn's `BatchNorm`
//! (found by their container's type, so a parameter of that name elsewhere is not one), and
//! the module paths matching [`ShardConfig::buffers`](crate::ShardConfig) (globs: `*` matches
//! any run of characters; a pattern without a dot matches a path's last component), for a
//! model's own `RunningState`s.

use super::config::BufferPolicy;
use super::params::replace_primitive;
use crate::core::backend::Shard;
use crate::core::error::ShardError;
use crate::core::host::{Host, read_host, write_host};
use crate::core::ops::local;
use crate::core::scope::waiting;
use crate::core::tensor::ShardTensor;
use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_backend::TensorMetadata;
use kiln_comm::{ProcessGroup, ReduceOp};
use std::collections::BTreeSet;

/// Where a visitor is in a module: the path and each level's container type, to tell buffers
/// from parameters.
#[derive(Debug, Default, Clone)]
pub(crate) struct Where {
    names: Vec<String>,
    containers: Vec<String>,
}

impl Where {
    pub fn enter(&mut self, name: &str, container: &str) {
        self.names.push(name.to_string());
        self.containers.push(container.to_string());
    }

    pub fn exit(&mut self) {
        self.names.pop();
        self.containers.pop();
    }

    /// The module path (`blocks.0.norm.running_mean`).
    pub fn path(&self) -> String {
        self.names.join(".")
    }

    /// Whether the float here is a buffer (see the module docs).
    pub fn is_buffer(&self, patterns: &[String]) -> bool {
        let burn_norm = matches!(
            (self.names.last(), self.containers.last()),
            (Some(n), Some(c)) if c == "Struct:BatchNorm" && (n == "running_mean" || n == "running_var")
        );
        burn_norm || {
            let path = self.path();
            patterns.iter().any(|p| matches_path(p, &path))
        }
    }
}

/// `pattern` against a module path: globs with `*`; a pattern without a dot matches the last
/// component.
pub(crate) fn matches_path(pattern: &str, path: &str) -> bool {
    let subject = match pattern.contains('.') {
        true => path,
        false => path.rsplit('.').next().unwrap_or(path),
    };
    glob(pattern.as_bytes(), subject.as_bytes())
}

fn glob(p: &[u8], s: &[u8]) -> bool {
    match (p.split_first(), s.split_first()) {
        (None, None) => true,
        (Some((b'*', rest)), _) => glob(rest, s) || (!s.is_empty() && glob(p, &s[1..])),
        (Some((c, rest)), Some((d, tail))) if c == d => glob(rest, tail),
        _ => false,
    }
}

/// The module paths of `module`'s buffers (with `patterns` as
/// [`ShardConfig::buffers`](crate::ShardConfig)).
pub fn buffer_paths<AB: Backend, M: burn::module::Module<AB>>(
    module: &M,
    patterns: &[String],
) -> BTreeSet<String> {
    struct Find<'a> {
        at: Where,
        patterns: &'a [String],
        found: BTreeSet<String>,
    }
    impl<AB: Backend> ModuleVisitor<AB> for Find<'_> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.at.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.at.exit();
        }
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<AB, D>>) {
            if self.at.is_buffer(self.patterns) {
                self.found.insert(self.at.path());
            }
        }
    }
    let mut find = Find {
        at: Where::default(),
        patterns,
        found: BTreeSet::new(),
    };
    module.visit(&mut find);
    find.found
}

/// Makes the buffers of `module` equal on every rank of `group` as `policy` says (a
/// collective: every rank calls it, with the same model). `patterns`: further buffer paths
/// (see the module docs). Returns the module with the new values.
///
/// # Errors
/// A failed collective.
pub fn sync_buffers<B, AB, M>(
    module: M,
    group: &dyn ProcessGroup,
    policy: BufferPolicy,
    patterns: &[String],
) -> Result<M, ShardError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    if policy == BufferPolicy::Local
        || group.world_size() == 1
        || buffer_paths::<AB, M>(&module, patterns).is_empty()
    {
        return Ok(module);
    }
    // `RunningState` keeps the forward's updates aside until read: `valid()` folds them in.
    let _ = module.valid();
    struct Read<'a, B> {
        at: Where,
        patterns: &'a [String],
        values: Vec<Host>,
        _b: std::marker::PhantomData<B>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Read<'_, B> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.at.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.at.exit();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            if self.at.is_buffer(self.patterns) {
                let t = local::<B>(p.val().inner().into_primitive().tensor());
                self.values.push(read_host::<B>(t));
            }
        }
    }
    let mut r = Read::<B> {
        at: Where::default(),
        patterns,
        values: Vec::new(),
        _b: std::marker::PhantomData,
    };
    module.visit(&mut r);
    let Some((first, rest)) = r.values.split_first() else {
        return Ok(module);
    };
    // One collective for all of them (buffers are small; they share the first one's dtype,
    // else they go one by one).
    let same_dtype = rest
        .iter()
        .all(|h| std::mem::discriminant(h) == std::mem::discriminant(first));
    let mut synced: Vec<Host> = Vec::with_capacity(r.values.len());
    if same_dtype {
        let mut all = first.clone();
        for h in rest {
            all.extend(h.clone());
        }
        collective(group, &mut all, policy)?;
        let mut at = 0;
        for h in &r.values {
            synced.push(all.slice(at, at + h.len()));
            at += h.len();
        }
    } else {
        for h in &r.values {
            let mut h = h.clone();
            collective(group, &mut h, policy)?;
            synced.push(h);
        }
    }
    struct Write<'a, B> {
        at: Where,
        patterns: &'a [String],
        values: std::vec::IntoIter<Host>,
        _b: std::marker::PhantomData<B>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleMapper<AB> for Write<'_, B> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.at.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.at.exit();
        }
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
            if !self.at.is_buffer(self.patterns) {
                return p;
            }
            let values = self.values.next().expect("one value per buffer read");
            let (id, tensor, mapper) = p.consume();
            let tensor = replace_primitive::<B, AB, D>(tensor, |t| {
                let t = local::<B>(t);
                let (shape, dtype, device) = (t.shape(), t.dtype(), B::float_device(&t));
                ShardTensor::Local(write_host::<B>(values, shape, &device, dtype))
            });
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    Ok(module.map(&mut Write::<B> {
        at: Where::default(),
        patterns,
        values: synced.into_iter(),
        _b: std::marker::PhantomData,
    }))
}

fn collective(
    group: &dyn ProcessGroup,
    values: &mut Host,
    policy: BufferPolicy,
) -> Result<(), ShardError> {
    waiting(|| match policy {
        // Under Sync the statistics are already equal (computed from the same group sums);
        // rank 0's make them bitwise so and cover a model's own buffers.
        BufferPolicy::Broadcast | BufferPolicy::Sync => group.broadcast(values.buf_mut(), 0),
        BufferPolicy::Mean => group.all_reduce(values.buf_mut(), ReduceOp::Avg),
        BufferPolicy::Local => Ok(()),
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_paths_and_last_components() {
        assert!(matches_path("ema", "blocks.0.ema"));
        assert!(matches_path("*.ema", "blocks.0.ema"));
        assert!(matches_path("blocks.*.ema", "blocks.12.ema"));
        assert!(!matches_path("ema", "blocks.0.ema_decay"));
        assert!(!matches_path("blocks.*.ema", "head.ema"));
        let mut at = Where::default();
        at.enter("norm", "Struct:Net");
        at.enter("running_mean", "Struct:BatchNorm");
        assert!(at.is_buffer(&[]));
        at.exit();
        at.enter("running_mean", "Struct:MyNorm");
        assert!(!at.is_buffer(&[]));
        assert!(at.is_buffer(&["norm.running_*".into()]));
    }
}
