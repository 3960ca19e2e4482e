//! A tensor as one rank holds it, for snapshots that reshard.
//!
//! Every float tensor of a sharded model (parameter or optimizer state) is, on a rank, either
//! whole or the elements `shard_range(numel, group size, group rank)` of its row-major flattened
//! form. A [`Piece`] is that range and those values. Written per rank with the tensor's logical
//! shape, pieces describe the tensor independently of the world size and the strategy; a run
//! with another layout reads, per tensor, the range *it* holds from whichever pieces cover it.
//! This is PyTorch DCP's idea (save shards with their offsets, reshard at load) in one dimension,
//! which suffices because kiln shards every tensor flat.

use crate::core::backend::Shard;
use crate::core::host::{read, write};
use crate::core::ops::local;
use crate::core::tensor::{ShardTensor, Sharded};
use crate::features::zero::flat;
use crate::strategy::params::replace_primitive;
use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use burn_backend::TensorMetadata;
use burn_std::Shape;
use kiln_comm::{ProcessGroup, shard_range};
use std::ops::Range;
use std::sync::Arc;

/// This rank's part of a float tensor: elements `range` of the flattened logical tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// Which elements of the flattened tensor.
    pub range: Range<usize>,
    /// Their values (as f32: lossless for f32, f16 and bf16 parameters).
    pub values: Vec<f32>,
}

/// The element range this rank holds of `t`: everything, or its shard. (A tensor-parallel
/// part counts as the whole tensor: its piece is gathered over the tp group.)
///
/// # Panics
/// On a view of a shard (`ShardTensor::View`): parameters and optimizer state are never views.
pub fn held_range<B: Backend>(t: &ShardTensor<B>) -> Range<usize> {
    match t {
        ShardTensor::Sharded(s) => shard_range(s.numel(), s.group.world_size(), s.group.rank()),
        d if d.is_sharded() => panic!("kiln: a snapshot piece of a view (not a parameter)"),
        // A LoRA weight or a deferred gradient is read whole (formed).
        t => 0..t.shape().num_elements(),
    }
}

/// This rank's piece of `t` (no communication).
pub fn piece<B: Backend>(t: &ShardTensor<B>) -> Piece {
    let range = held_range(t);
    let inner = match t {
        ShardTensor::Sharded(s) => s.shard.clone(),
        t => local(t.clone()),
    };
    let values = read::<B>(inner)
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("converted to f32");
    Piece { range, values }
}

/// A tensor of logical `shape` laid out over `group` (whole when `None`), from this rank's
/// values: the whole tensor, or exactly the range the group gives this rank.
///
/// # Panics
/// If `values` is not as long as that range.
pub fn from_values<B: Backend>(
    shape: Shape,
    values: Vec<f32>,
    group: Option<&Arc<dyn ProcessGroup>>,
    device: &B::Device,
    dtype: DType,
) -> ShardTensor<B> {
    let numel = shape.num_elements();
    match group {
        None => {
            assert_eq!(values.len(), numel, "kiln: values for a whole tensor");
            ShardTensor::Local(write::<B>(TensorData::new(values, shape), device, dtype))
        }
        Some(group) => {
            let range = shard_range(numel, group.world_size(), group.rank());
            assert_eq!(values.len(), range.len(), "kiln: values for a shard");
            let len = values.len();
            ShardTensor::Sharded(Sharded {
                shard: write::<B>(TensorData::new(values, [len]), device, dtype),
                shape,
                group: group.clone(),
                ops: flat(),
            })
        }
    }
}

/// `like`'s layout (whole, or sharded over the same group) with other values for the range
/// this rank holds.
pub fn like<B: Backend>(like: &ShardTensor<B>, values: Vec<f32>) -> ShardTensor<B> {
    // A tensor-parallel part is saved and read whole (any tp degree reads any other's): this
    // rank keeps its part of the values.
    if let Some(part) = like.part() {
        let (device, dtype) = (like.device(), like.dtype());
        let whole = write::<B>(TensorData::new(values, like.shape()), &device, dtype);
        return (part.of_whole)(whole);
    }
    let (device, dtype, group) = match like {
        ShardTensor::Sharded(s) => (B::float_device(&s.shard), s.shard.dtype(), Some(&s.group)),
        d if d.is_sharded() => panic!("kiln: new values for a view (not a parameter)"),
        t => (t.device(), t.dtype(), None),
    };
    from_values::<B>(like.shape(), values, group, &device, dtype)
}

/// The inner primitive of a tensor on the decorator.
pub fn primitive<B: Backend, const D: usize>(t: Tensor<Shard<B>, D>) -> ShardTensor<B> {
    t.into_primitive().tensor()
}

/// A tensor on the decorator from its primitive.
pub fn tensor<B: Backend, const D: usize>(t: ShardTensor<B>) -> Tensor<Shard<B>, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

#[derive(Debug, Default)]
struct Path(Vec<String>);

impl Path {
    fn join(&self) -> String {
        self.0.join(".")
    }
}

/// The module paths of the float parameters that train (`require_grad`): a LoRA base's are
/// frozen.
pub fn trainable_paths<AB: AutodiffBackend, M: AutodiffModule<AB>>(
    module: &M,
) -> std::collections::HashSet<String> {
    struct Find {
        path: Path,
        found: std::collections::HashSet<String>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Find {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            if param.val().is_require_grad() {
                self.found.insert(self.path.join());
            }
        }
    }
    let mut find = Find {
        path: Path::default(),
        found: Default::default(),
    };
    module.visit(&mut find);
    find.found
}

/// Calls `f(path, id, tensor)` for every float parameter, in the module's order, with its
/// module path (`blocks.0.attn.weight`).
pub fn visit_params<B, AB, M>(module: &M, f: impl FnMut(&str, ParamId, &ShardTensor<B>))
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    struct Visit<F, B> {
        path: Path,
        f: F,
        _b: std::marker::PhantomData<B>,
    }
    impl<B, AB, F> ModuleVisitor<AB> for Visit<F, B>
    where
        B: Backend,
        AB: AutodiffBackend<InnerBackend = Shard<B>>,
        F: FnMut(&str, ParamId, &ShardTensor<B>),
    {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let t = primitive(param.val().inner());
            (self.f)(&self.path.join(), param.id, &t);
        }
    }
    module.visit(&mut Visit {
        path: Path::default(),
        f,
        _b: std::marker::PhantomData::<B>,
    });
}

/// Replaces every float parameter's values with `f(path, tensor)` (the values of the range this
/// rank holds, see [`held_range`]), keeping its layout, `require_grad` and gradient-sync mark.
pub fn map_params<B, AB, M>(module: M, mut f: impl FnMut(&str, &ShardTensor<B>) -> Vec<f32>) -> M
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    update_params::<B, AB, M>(module, |path, t| Some(f(path, t)))
}

/// [`map_params`] for the parameters where `f` returns new values; the others are kept as
/// they are (not copied).
pub fn update_params<B, AB, M>(
    module: M,
    f: impl FnMut(&str, &ShardTensor<B>) -> Option<Vec<f32>>,
) -> M
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    struct Map<F, B> {
        path: Path,
        f: F,
        _b: std::marker::PhantomData<B>,
    }
    impl<B, AB, F> ModuleMapper<AB> for Map<F, B>
    where
        B: Backend,
        AB: AutodiffBackend<InnerBackend = Shard<B>>,
        F: FnMut(&str, &ShardTensor<B>) -> Option<Vec<f32>>,
    {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.0.pop();
        }
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<AB, D>>,
        ) -> Param<Tensor<AB, D>> {
            let path = self.path.join();
            let values = (self.f)(&path, &primitive(param.val().inner()));
            let Some(values) = values else {
                return param;
            };
            let (id, tensor, mapper) = param.consume();
            let tensor = replace_primitive::<B, AB, D>(tensor, |t| like(&t, values));
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    module.map(&mut Map {
        path: Path::default(),
        f,
        _b: std::marker::PhantomData::<B>,
    })
}
