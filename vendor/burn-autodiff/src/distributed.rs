use std::any::{Any, TypeId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{OnceLock, RwLock};

use crate::collections::HashMap;
use burn_backend::{
    Backend,
    distributed::{DistributedBackend, DistributedParams, TensorRef},
    tensor::TensorContainer,
};

use crate::{NodeId, grads::GradID};

// Added for kiln (see KILN-PATCH.md): the gradient-sync hooks of a backend are looked up at
// run time, so that with the `distributed` feature on, `Autodiff<B>` is an `AutodiffBackend`
// for every backend (plain `Autodiff<Flex>` keeps training in a build that contains kiln), and
// a backend that syncs gradients registers its hooks with [`register_distributed`].

/// A backend's gradient-sync hooks (its `DistributedBackend` methods).
pub struct Hooks<B: Backend> {
    /// `DistributedBackend::register_sync_parameters`.
    pub register_sync_parameters: fn(&B::Device, Vec<DistributedParams>),
    /// `DistributedBackend::submit_gradient_sync`.
    pub submit_gradient_sync: fn(TensorRef<B>, DistributedParams),
    /// `DistributedBackend::submit_sync_collective`.
    pub submit_sync_collective: fn(&B::Device),
}

impl<B: Backend> Clone for Hooks<B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Hooks<B> {}

fn registry() -> &'static RwLock<HashMap<TypeId, Box<dyn Any + Send + Sync>>> {
    static REGISTRY: OnceLock<RwLock<HashMap<TypeId, Box<dyn Any + Send + Sync>>>> =
        OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Registers `B`'s gradient-sync hooks: the parameters of an `Autodiff<B>` model marked
/// distributed (`Tensor::set_distributed`) have their final gradients handed to `B` during
/// backward. Idempotent.
pub fn register_distributed<B: DistributedBackend>() {
    let hooks = Hooks::<B> {
        register_sync_parameters: B::register_sync_parameters,
        submit_gradient_sync: B::submit_gradient_sync,
        submit_sync_collective: B::submit_sync_collective,
    };
    registry()
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(TypeId::of::<Hooks<B>>(), Box::new(hooks));
}

/// The hooks of type `H` registered (keyed by `H`'s type, which names its backend).
fn registered<H: Copy + 'static>() -> Option<H> {
    registry()
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&TypeId::of::<H>())
        .and_then(|h| h.downcast_ref::<H>())
        .copied()
}

/// `B`'s hooks, if registered.
pub fn hooks<B: Backend>() -> Option<Hooks<B>> {
    registered::<Hooks<B>>()
}

/// A backend's batch-statistics hooks (added for kiln, see KILN-PATCH.md): a `mean_dim` whose
/// forward the backend computed over a data-parallel group (SyncBatchNorm's statistics) has its
/// incoming gradient combined over that group in backward.
pub struct BatchMean<B: Backend> {
    /// Called right after `B::float_mean_dim`: `Some(factor)` if the backend averaged over its
    /// group (and clears that mark), `None` for an ordinary mean.
    pub take: fn() -> Option<f64>,
    /// The gradient arriving at such a mean, summed over the group and multiplied by `factor`
    /// (a collective: every rank of the group calls it, in the same order).
    pub grad: fn(B::FloatTensorPrimitive, f64) -> B::FloatTensorPrimitive,
}

impl<B: Backend> Clone for BatchMean<B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for BatchMean<B> {}

/// Whether any backend registered batch-statistics hooks: every other backend's `mean_dim`
/// skips the registry.
static BATCH_MEAN: AtomicBool = AtomicBool::new(false);

/// Registers `B`'s batch-statistics hooks. Idempotent.
pub fn register_batch_mean<B: Backend>(hooks: BatchMean<B>) {
    registry()
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(TypeId::of::<BatchMean<B>>(), Box::new(hooks));
    BATCH_MEAN.store(true, Ordering::Release);
}

/// Whether the `mean_dim` `B` just computed was over a group: the factor for its backward.
pub fn take_synced_mean<B: Backend>() -> Option<f64> {
    if !BATCH_MEAN.load(Ordering::Acquire) {
        return None;
    }
    (registered::<BatchMean<B>>()?.take)()
}

/// The backward of a synced mean's incoming gradient (see [`BatchMean::grad`]).
///
/// # Panics
/// If `B` registered no batch-statistics hooks (it marked the mean synced, so it has).
pub fn synced_mean_grad<B: Backend>(
    grad: B::FloatTensorPrimitive,
    factor: f64,
) -> B::FloatTensorPrimitive {
    let hooks = registered::<BatchMean<B>>()
        .expect("a synced mean's backend registered its batch-statistics hooks");
    (hooks.grad)(grad, factor)
}

/// `B`'s hooks, for a graph with parameters marked distributed.
///
/// # Panics
/// If none were registered: the gradients would silently not be synced.
pub fn required_hooks<B: Backend>() -> Hooks<B> {
    hooks::<B>().unwrap_or_else(|| {
        panic!(
            "burn-autodiff (kiln's build): parameters of an Autodiff<{}> model are marked \
             distributed, but that backend registered no gradient-sync hooks; call \
             burn_autodiff::register_distributed::<B>() once for a DistributedBackend \
             (kiln's decorator registers its own)",
            core::any::type_name::<B>()
        )
    })
}

/// Trait for registering distributed gradients.
pub trait DistributedRegistration {
    /// Performs distributed registration operations on the tensor with the corresponding [`NodeId`].
    fn on_register(&mut self, node_id: &NodeId, container: &mut TensorContainer<GradID>);
}

/// Submits sync operations on gradient registrations.
#[derive(new)]
pub struct DistributedGradientRegistration<B: Backend> {
    n_required_map: HashMap<NodeId, usize>,
    sharded_parameters_map: HashMap<NodeId, DistributedParams>,
    hooks: Hooks<B>,
}

impl<B: Backend> DistributedRegistration for DistributedGradientRegistration<B> {
    fn on_register(&mut self, id: &NodeId, container: &mut TensorContainer<GradID>) {
        if let Some(sharded_params) = self.sharded_parameters_map.get(id) {
            let n_required = self.n_required_map.get_mut(id).unwrap();
            *n_required -= 1;

            if *n_required == 0 {
                let tensor_ref = container.get_mut_ref::<B>(&id.value).unwrap();
                let tensor_ref = TensorRef(tensor_ref.get_mut_ref());
                (self.hooks.submit_gradient_sync)(tensor_ref, sharded_params.clone());
            }
        }
    }
}

/// A backend's autocast hook (added for kiln, see KILN-PATCH.md): the dtype the activation
/// operand of a compute-bound op (`linear`'s and a convolution's input, a matmul's left-hand
/// side) is cast to *in the graph* before the op, or `None` to leave it. The op then saves the
/// cast tensor for its backward, as the cast that `torch.autocast` records does: a backend
/// that computes these ops in a lower precision keeps what they save in it too.
pub struct Autocast<B: Backend> {
    /// The dtype for `t`, or `None`.
    pub input_dtype: fn(&B::FloatTensorPrimitive) -> Option<burn_std::FloatDType>,
}

impl<B: Backend> Clone for Autocast<B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Autocast<B> {}

/// Whether any backend registered an autocast hook: every other backend's compute-bound ops
/// skip the registry.
static AUTOCAST: AtomicBool = AtomicBool::new(false);

/// Registers `B`'s autocast hook. Idempotent (a registered hook is kept: a step may call
/// this each time without taking the registry's write lock).
pub fn register_autocast<B: Backend>(hook: Autocast<B>) {
    if registered::<Autocast<B>>().is_some() {
        return;
    }
    registry()
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(TypeId::of::<Autocast<B>>(), Box::new(hook));
    AUTOCAST.store(true, Ordering::Release);
}

/// The dtype `B` wants a compute-bound op's activation operand `t` cast to, if any.
pub fn autocast_dtype<B: Backend>(t: &B::FloatTensorPrimitive) -> Option<burn_std::FloatDType> {
    if !AUTOCAST.load(Ordering::Acquire) {
        return None;
    }
    (registered::<Autocast<B>>()?.input_dtype)(t)
}
