//! Making the ranks' models equal when they are sharded: shapes checked, weights broadcast from
//! rank 0 (or scattered as shards), or fingerprints compared when the caller vouches for them.

use super::buffers::Where;
use super::config::buckets;
use super::params::{Path, replace_primitive};
use crate::core::backend::Shard;
use crate::core::error::ShardError;
use crate::core::host::{Host, read, read_host, slice_local, write_host};
use crate::core::ops::local;
use crate::core::tensor::{ShardTensor, Sharded};
use crate::features::zero::flat;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId, ParamMapper};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, DType, Int, Tensor, TensorData};
use burn_backend::TensorMetadata;
use kiln_comm::hash::Fnv1a;
use kiln_comm::{ProcessGroup, ReduceOp, shard_range};
use std::sync::Arc;

/// Every rank must hold the same parameters (count and shapes, in order): compared through a
/// fingerprint all-reduced with max and min.
pub(crate) fn check_shapes<AB: AutodiffBackend, M: Module<AB>>(
    module: &M,
    group: &dyn ProcessGroup,
) -> Result<(), ShardError> {
    struct Fingerprint {
        count: i64,
        hash: Fnv1a,
    }
    impl<AB: Backend> ModuleVisitor<AB> for Fingerprint {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            self.count += 1;
            // `lazy_shape` does not run a lazy initialiser (that happens sharded, later).
            for d in param.lazy_shape().dims::<D>() {
                self.hash.write_u64(d as u64);
            }
            self.hash.write_u64(u64::MAX);
        }
    }
    let mut fp = Fingerprint {
        count: 0,
        hash: Fnv1a::new(),
    };
    module.visit(&mut fp);
    let hash = fp.hash.finish();
    let mine = [fp.count, hash as i64];
    let mut max = mine;
    let mut min = mine;
    group.all_reduce((&mut max[..]).into(), ReduceOp::Max)?;
    group.all_reduce((&mut min[..]).into(), ReduceOp::Min)?;
    if max != min {
        return Err(ShardError::Inconsistent(format!(
            "rank {} has {} parameters (shape fingerprint {hash:016x}), but across the group \
             '{}' the parameter count ranges over {}..={} and the fingerprints differ: every \
             rank must build the same model",
            group.rank(),
            fp.count,
            group.name(),
            min[0],
            max[0]
        )));
    }
    Ok(())
}

/// A random number drawn by rank 0 and sent to all: seeds what ranks must draw alike (the
/// shards of lazily initialised parameters), different in every job.
pub(crate) fn job_seed(group: &dyn ProcessGroup) -> Result<u64, ShardError> {
    use rand::Rng;
    let mut seed = [rand::rng().next_u64() as i64];
    group.broadcast((&mut seed[..]).into(), 0)?;
    Ok(seed[0] as u64)
}

/// Under [`InitSync::Verify`](crate::InitSync::Verify): every initialised float parameter's
/// values are hashed, the hashes all-gathered, and the first parameter (in module order) whose
/// hash differs from rank 0's is named.
pub(crate) fn verify_equal<B, AB, M>(module: &M, group: &dyn ProcessGroup) -> Result<(), ShardError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    struct Hashes<B> {
        path: Path,
        paths: Vec<String>,
        hashes: Vec<i64>,
        _b: std::marker::PhantomData<B>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Hashes<B> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            self.paths.push(self.path.join());
            // A lazy parameter is created sharded with a seed every rank shares (see `shard`):
            // nothing to compare.
            if !p.is_initialized() {
                return self.hashes.push(0);
            }
            let t = local::<B>(p.val().inner().into_primitive().tensor());
            let data = read::<B>(t).convert::<f32>();
            let mut h = Fnv1a::new();
            h.write(data.as_bytes());
            self.hashes.push(h.finish() as i64);
        }
    }
    let mut v = Hashes::<B> {
        path: Path::default(),
        paths: Vec::new(),
        hashes: Vec::new(),
        _b: std::marker::PhantomData,
    };
    module.visit(&mut v);
    let n = v.hashes.len();
    let world = group.world_size();
    let mut all = vec![0i64; n * world];
    group.all_gather((&v.hashes[..]).into(), (&mut all[..]).into())?;
    for (i, path) in v.paths.iter().enumerate() {
        if let Some(r) = (1..world).find(|&r| all[r * n + i] != all[i]) {
            return Err(ShardError::Inconsistent(format!(
                "parameter '{path}' (#{i}) differs between rank 0 and rank {r} although the \
                 ranks were said to start from equal weights (InitSync::Verify): load the same \
                 weights on every rank, or let `shard` copy rank 0's (InitSync::FromRank0)"
            )));
        }
    }
    Ok(())
}

/// Under ZeRO-3 and hybrid with [`InitSync::FromRank0`](crate::InitSync::FromRank0): rank 0
/// sends each rank only the shard it will hold of every parameter it has initialised; the other
/// ranks never hold those tensors whole unless they built them so themselves.
pub(crate) struct Scatter {
    /// The whole data-parallel group.
    group: Arc<dyn ProcessGroup>,
    /// Ranks per sharding group (consecutive ranks, as `DeviceMesh` makes them).
    shard_size: usize,
    /// Whether rank 0 holds each float parameter initialised, in module order.
    rank0_init: Vec<bool>,
    index: usize,
    error: Option<String>,
}

type Consumed<T> = (ParamId, T, ParamMapper<T>);

impl Scatter {
    pub fn new<AB: AutodiffBackend, M: Module<AB>>(
        module: &M,
        group: Arc<dyn ProcessGroup>,
        shard_size: usize,
    ) -> Result<Self, ShardError> {
        struct Flags(Vec<i64>);
        impl<AB: Backend> ModuleVisitor<AB> for Flags {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
                self.0.push(p.is_initialized().into());
            }
        }
        let mut flags = Flags(Vec::new());
        module.visit(&mut flags);
        group.broadcast((&mut flags.0[..]).into(), 0)?;
        Ok(Scatter {
            group,
            shard_size,
            rank0_init: flags.0.into_iter().map(|f| f != 0).collect(),
            index: 0,
            error: None,
        })
    }

    /// Passes over a float that is not sharded (a buffer), in module order on every rank.
    pub fn skip(&mut self) {
        self.index += 1;
    }

    /// One parameter, in module order on every rank: this rank's shard of rank 0's values.
    pub fn param<B, AB, const D: usize>(
        &mut self,
        param: Param<Tensor<AB, D>>,
        path: &str,
        lazy: bool,
        shard_group: &Arc<dyn ProcessGroup>,
        create_sharded: impl FnOnce(Param<Tensor<AB, D>>) -> Consumed<Tensor<AB, D>>,
    ) -> Consumed<Tensor<AB, D>>
    where
        B: Backend,
        AB: AutodiffBackend<InnerBackend = Shard<B>>,
    {
        let i = self.index;
        self.index += 1;
        let (world, rank) = (self.group.world_size(), self.group.rank());
        if !self.rank0_init[i] {
            // Rank 0 builds it lazily: every rank creates its shard from the shared seed.
            if !lazy && self.error.is_none() {
                self.error = Some(format!(
                    "parameter '{path}' is initialised on rank {rank} but not on rank 0, whose \
                     weights every rank takes (InitSync::FromRank0): initialise it on rank 0 too"
                ));
            }
            return if lazy {
                create_sharded(param)
            } else {
                param.consume()
            };
        }
        let fail = |e: kiln_comm::CommError| -> ! {
            panic!(
                "kiln: rank {rank} could not receive its shard of parameter '{path}' from rank 0: {e}"
            )
        };
        if rank == 0 {
            let (id, tensor, mapper) = param.consume();
            let whole = local::<B>(tensor.clone().inner().into_primitive().tensor());
            let numel = whole.shape().num_elements();
            let host = read_host::<B>(whole);
            for peer in 1..world {
                let range = shard_range(numel, self.shard_size, peer % self.shard_size);
                let part = host.slice(range.start, range.end);
                self.group
                    .send(part.buf(), peer)
                    .unwrap_or_else(|e| fail(e));
            }
            return (id, tensor, mapper);
        }
        // The other ranks: a shard of the right layout (cheap for a lazy parameter; a whole
        // tensor this rank built is dropped), then rank 0's values in it.
        let (id, tensor, mapper) = if lazy {
            create_sharded(param)
        } else {
            param.consume()
        };
        let tensor = replace_primitive::<B, AB, D>(tensor, |t| {
            let s = match t {
                ShardTensor::Sharded(s) => s,
                t => slice_local::<B>(local(t), shard_group, flat()),
            };
            let device = B::float_device(&s.shard);
            let dtype = s.shard.dtype();
            let mut host = read_host::<B>(s.shard.clone());
            self.group
                .recv(host.buf_mut(), 0)
                .unwrap_or_else(|e| fail(e));
            let len = host.len();
            ShardTensor::Sharded(Sharded {
                shard: write_host::<B>(host, [len], &device, dtype),
                shape: s.shape,
                group: s.group,
                ops: flat(),
            })
        });
        (id, tensor, mapper)
    }

    /// Every rank learns whether any rank found its model at odds with rank 0's.
    pub fn finish(self) -> Result<(), ShardError> {
        let mut flag = [i64::from(self.error.is_some())];
        self.group
            .all_reduce((&mut flag[..]).into(), ReduceOp::Max)?;
        match self.error {
            Some(e) => Err(ShardError::Inconsistent(e)),
            None if flag[0] != 0 => Err(ShardError::Inconsistent(
                "another rank's model is initialised where rank 0's is not (see that rank's \
                 error)"
                    .into(),
            )),
            None => Ok(()),
        }
    }
}

/// Makes every rank's whole parameters (when `floats`), its float buffers (see
/// `strategy::buffers`, with `buffers` as further paths) and int and bool buffers rank 0's, one
/// bucket of about `bucket_bytes` at a time (a bucket is read, broadcast and written back before
/// the next, so no rank holds more than one bucket of copies).
pub(crate) fn broadcast_from_rank0<B, AB, M>(
    mut module: M,
    group: &dyn ProcessGroup,
    bucket_bytes: usize,
    floats: bool,
    buffers: &[String],
) -> Result<M, ShardError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    // The plan: every tensor's index, kind and size, in module order (the same on every rank).
    // A bucket holds one kind: floats travel in their own dtype, ints and bools as i64.
    #[derive(Default)]
    struct Plan<'a> {
        tensors: Vec<(usize, Kind, usize)>,
        floats: bool,
        /// Buffers are sent even when `floats` is off (ZeRO-3 keeps them whole).
        buffers: &'a [String],
        place: Where,
        at: usize,
    }
    #[derive(Clone, Copy, PartialEq)]
    enum Kind {
        Float(DType),
        Int,
    }
    impl Plan<'_> {
        fn push(&mut self, kind: Kind, numel: usize) {
            let buffer = matches!(kind, Kind::Float(_)) && self.place.is_buffer(self.buffers);
            if self.floats || buffer || kind == Kind::Int {
                let size = match kind {
                    Kind::Float(dtype) => numel * dtype.size(),
                    Kind::Int => numel * 8,
                };
                self.tensors.push((self.at, kind, size));
            }
            self.at += 1;
        }
    }
    impl<AB: Backend> ModuleVisitor<AB> for Plan<'_> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.place.enter(name, container);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.place.exit();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            // `shard` has initialised every parameter it leaves replicated.
            let t = p.val();
            self.push(Kind::Float(t.dtype()), t.shape().num_elements());
        }
        fn visit_int<const D: usize>(&mut self, p: &Param<Tensor<AB, D, Int>>) {
            self.push(Kind::Int, p.val().shape().num_elements());
        }
        fn visit_bool<const D: usize>(&mut self, p: &Param<Tensor<AB, D, Bool>>) {
            self.push(Kind::Int, p.val().shape().num_elements());
        }
    }
    let mut plan = Plan {
        tensors: Vec::new(),
        floats,
        buffers,
        place: Where::default(),
        at: 0,
    };
    module.visit(&mut plan);
    let sizes: Vec<(Kind, usize)> = plan.tensors.iter().map(|&(_, k, n)| (k, n)).collect();
    let buckets = buckets(&sizes, bucket_bytes).into_iter().map(|run| {
        plan.tensors[run]
            .iter()
            .map(|&(i, _, _)| i)
            .collect::<Vec<_>>()
    });
    for bucket in buckets {
        module = broadcast_bucket::<B, AB, M>(module, group, &bucket)?;
    }
    Ok(module)
}

/// One bucket: read the tensors at `indices` (module order), broadcast their concatenation from
/// rank 0, write them back.
fn broadcast_bucket<B, AB, M>(
    module: M,
    group: &dyn ProcessGroup,
    indices: &[usize],
) -> Result<M, ShardError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: Module<AB>,
{
    struct Read<'a, B> {
        indices: &'a [usize],
        at: usize,
        floats: Vec<Host>,
        ints: Vec<i64>,
        _b: std::marker::PhantomData<B>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleVisitor<AB> for Read<'_, B> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<AB, D>>) {
            if self.indices.contains(&self.at) {
                let t = local::<B>(p.val().inner().into_primitive().tensor());
                self.floats.push(read_host::<B>(t));
            }
            self.at += 1;
        }
        fn visit_int<const D: usize>(&mut self, p: &Param<Tensor<AB, D, Int>>) {
            if self.indices.contains(&self.at) {
                let data = p.val().into_data().convert::<i64>();
                self.ints.extend(data.iter::<i64>());
            }
            self.at += 1;
        }
        fn visit_bool<const D: usize>(&mut self, p: &Param<Tensor<AB, D, Bool>>) {
            if self.indices.contains(&self.at) {
                let data = p.val().into_data();
                self.ints.extend(data.iter::<bool>().map(i64::from));
            }
            self.at += 1;
        }
    }
    let mut r = Read::<B> {
        indices,
        at: 0,
        floats: Vec::new(),
        ints: Vec::new(),
        _b: std::marker::PhantomData,
    };
    module.visit(&mut r);
    let mut floats = match r.floats.split_first() {
        Some((first, rest)) => {
            let mut all = first.clone();
            for h in rest {
                all.extend(h.clone());
            }
            Some(all)
        }
        None => None,
    };
    if let Some(f) = &mut floats {
        group.broadcast(f.buf_mut(), 0)?;
    }
    let mut ints = r.ints;
    if !ints.is_empty() {
        group.broadcast((&mut ints[..]).into(), 0)?;
    }

    struct Write<'a, B> {
        indices: &'a [usize],
        at: usize,
        floats: Option<Host>,
        float_at: usize,
        ints: Vec<i64>,
        int_at: usize,
        _b: std::marker::PhantomData<B>,
    }
    impl<B: Backend, AB: AutodiffBackend<InnerBackend = Shard<B>>> ModuleMapper<AB> for Write<'_, B> {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
            if !self.selected() {
                return p;
            }
            let (id, tensor, mapper) = p.consume();
            let floats = self.floats.as_ref().expect("a float bucket");
            let start = &mut self.float_at;
            let tensor = replace_primitive::<B, AB, D>(tensor, |t| {
                let t = local(t);
                let (shape, dtype, device) = (t.shape(), t.dtype(), B::float_device(&t));
                let n = shape.num_elements();
                let part = floats.slice(*start, *start + n);
                *start += n;
                ShardTensor::Local(write_host::<B>(part, shape, &device, dtype))
            });
            Param::from_mapped_value(id, tensor, mapper)
        }
        fn map_int<const D: usize>(
            &mut self,
            p: Param<Tensor<AB, D, Int>>,
        ) -> Param<Tensor<AB, D, Int>> {
            if !self.selected() {
                return p;
            }
            let (id, tensor, mapper) = p.consume();
            let shape = tensor.shape();
            let values = self.ints(shape.num_elements()).to_vec();
            // In the buffer's own dtype: a u8 code tensor (QLoRA's base) stays one byte a value.
            let options = (&tensor.device(), tensor.dtype());
            let t = Tensor::from_data(TensorData::new(values, shape), options);
            Param::from_mapped_value(id, t, mapper)
        }
        fn map_bool<const D: usize>(
            &mut self,
            p: Param<Tensor<AB, D, Bool>>,
        ) -> Param<Tensor<AB, D, Bool>> {
            if !self.selected() {
                return p;
            }
            let (id, tensor, mapper) = p.consume();
            let shape = tensor.shape();
            let values: Vec<bool> = self
                .ints(shape.num_elements())
                .iter()
                .map(|&v| v != 0)
                .collect();
            let t = Tensor::from_data(TensorData::new(values, shape), &tensor.device());
            Param::from_mapped_value(id, t, mapper)
        }
    }
    impl<B> Write<'_, B> {
        /// Whether the next tensor (module order) is in the bucket.
        fn selected(&mut self) -> bool {
            let selected = self.indices.contains(&self.at);
            self.at += 1;
            selected
        }
        /// The next `n` received ints.
        fn ints(&mut self, n: usize) -> &[i64] {
            self.int_at += n;
            &self.ints[self.int_at - n..self.int_at]
        }
    }
    Ok(module.map(&mut Write::<B> {
        indices,
        at: 0,
        floats,
        float_at: 0,
        ints,
        int_at: 0,
        _b: std::marker::PhantomData,
    }))
}
