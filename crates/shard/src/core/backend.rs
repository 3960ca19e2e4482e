//! The decorator type and its `Backend` impl.

use super::tensor::ShardTensor;
use burn_backend::{Backend, BackendTypes, DType, DTypeUsageSet, ExecutionError, TensorData};
use std::marker::PhantomData;

/// kiln's sharding decorator over an inner backend `B` (Flex on CPU, CUDA on GPUs).
///
/// Int, bool and quantized tensors and the device are `B`'s; float tensors are
/// [`ShardTensor`]s, whole or sharded. Under `Autodiff`, `Shard` receives every parameter's
/// final gradient during backward (`DistributedBackend::submit_gradient_sync`) and reduces it
/// as the strategy says; see [`shard`](crate::shard()).
#[derive(Clone, Copy, Default, Debug)]
pub struct Shard<B> {
    _inner: PhantomData<B>,
}

impl<B: Backend> BackendTypes for Shard<B> {
    type Device = B::Device;
    type FloatTensorPrimitive = ShardTensor<B>;
    type FloatElem = B::FloatElem;
    type IntTensorPrimitive = B::IntTensorPrimitive;
    type IntElem = B::IntElem;
    type BoolTensorPrimitive = B::BoolTensorPrimitive;
    type BoolElem = B::BoolElem;
    type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
}

impl<B: Backend> Backend for Shard<B> {
    fn ad_enabled(device: &Self::Device) -> bool {
        B::ad_enabled(device)
    }

    fn memory_persistent_allocations<
        Output: Send,
        Input: Send,
        Func: Fn(Input) -> Output + Send,
    >(
        device: &Self::Device,
        input: Input,
        func: Func,
    ) -> Output {
        B::memory_persistent_allocations(device, input, func)
    }

    fn memory_cleanup(device: &Self::Device) {
        B::memory_cleanup(device)
    }

    fn name(device: &Self::Device) -> String {
        format!("kiln<{}>", B::name(device))
    }

    fn seed(device: &Self::Device, seed: u64) {
        B::seed(device, seed)
    }

    fn sync(device: &Self::Device) -> Result<(), ExecutionError> {
        B::sync(device)
    }

    fn staging<'a, Iter>(data: Iter, device: &Self::Device)
    where
        Iter: Iterator<Item = &'a mut TensorData>,
    {
        B::staging(data, device)
    }

    fn supports_dtype(device: &Self::Device, dtype: DType) -> bool {
        B::supports_dtype(device, dtype)
    }

    fn dtype_usage(device: &Self::Device, dtype: DType) -> DTypeUsageSet {
        B::dtype_usage(device, dtype)
    }

    fn device_count(type_id: u16) -> usize {
        B::device_count(type_id)
    }
}
