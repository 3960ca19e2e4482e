//! Collectives on GPU memory (feature `cuda`): when the inner backend's float tensors are
//! burn-cuda's (`CubeTensor<CudaRuntime>`, the primitive of `CubeBackend<CudaRuntime, ..>`,
//! which is `burn::backend::Cuda` in kiln's builds: Burn's `fusion` is off) and the group is an
//! [`NcclGroup`], NCCL reads and writes the tensors' device memory directly. The host path
//! (tensor to `Vec`, `Vec` to device buffer, NCCL, and back) makes four PCIe copies per
//! collective; this makes none.
//!
//! kiln-shard is generic over the backend, so these functions take any `B` and find out at run
//! time (`Any` downcasts of the primitive and of the group); `None` means "not CUDA and NCCL,
//! or not a case handled here: use the host path". Every rank of a collective must get the
//! same answer, which holds when they all run the same backend, dtype and lengths (the host
//! path on an NCCL group issues the same NCCL descriptor checks, so a mix still agrees).
//!
//! Ordering with Burn's stream: Burn's queued work is synchronised (`B::sync`) before NCCL
//! reads, and the NCCL calls return once complete on the device, so Burn's later kernels see
//! the results. Simple and correct; no overlap of communication with compute.

use burn_backend::{Backend, DType as BurnDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;
use kiln_comm::{CommError, DType, NcclGroup, ProcessGroup, ReduceOp, Result};
use std::any::Any;

type CudaTensor = CubeTensor<CudaRuntime>;

/// The group as NCCL and the tensor as a contiguous CUDA float tensor, or `None`.
fn cuda_parts<'a, B: Backend>(
    group: &'a dyn ProcessGroup,
    tensor: &'a B::FloatTensorPrimitive,
) -> Option<(&'a NcclGroup, &'a CudaTensor, DType, usize)> {
    let nccl = group.downcast_ref::<NcclGroup>()?;
    let t = (tensor as &dyn Any).downcast_ref::<CudaTensor>()?;
    let dtype = match t.dtype {
        BurnDType::F32 => DType::F32,
        BurnDType::F16 => DType::F16,
        BurnDType::BF16 => DType::BF16,
        _ => return None,
    };
    // NCCL needs one dense run of elements; zero-length buffers are the host path's (it
    // checks them against the peers without touching the GPU).
    let len = t.meta.shape().num_elements();
    if !t.is_contiguous() || t.qparams.is_some() || len == 0 {
        return None;
    }
    Some((nccl, t, dtype, len))
}

/// Allocates a contiguous `out_len`-element tensor like `t`, synchronises Burn's device, then
/// runs `f(nccl, input pointer, output pointer, dtype)`.
fn with_output<B: Backend>(
    nccl: &NcclGroup,
    t: &CudaTensor,
    dtype: DType,
    out_shape: Shape,
    f: impl FnOnce(u64, u64) -> Result<()>,
) -> Result<B::FloatTensorPrimitive> {
    if t.device.index != nccl.device_ordinal() {
        return Err(CommError::Nccl(format!(
            "a tensor on GPU {} passed to group '{}' on GPU {}: choose Burn's device with \
             kiln_comm::choose_cuda_device, as the group does",
            t.device.index,
            nccl.name(),
            nccl.device_ordinal()
        )));
    }
    let out_len = out_shape.num_elements();
    let handle = t.client.empty(out_len * dtype.size());
    // Burn's kernels (the input's producer, the allocation) run on Burn's stream; NCCL runs
    // on the group's: wait for Burn's before NCCL reads or writes.
    sync_burn(t.client.sync())?;
    let input = t
        .client
        .get_resource(t.handle.clone())
        .map_err(|e| CommError::Nccl(format!("the input tensor's device memory: {e:?}")))?;
    let output = t
        .client
        .get_resource(handle.clone())
        .map_err(|e| CommError::Nccl(format!("the output tensor's device memory: {e:?}")))?;
    // `input` and `output` keep both allocations alive until NCCL is done (`f` returns once
    // the work is complete on the device).
    f(input.resource().ptr, output.resource().ptr)?;
    drop((input, output));
    let out = CudaTensor::new_contiguous(
        t.client.clone(),
        t.device.clone(),
        out_shape,
        handle,
        t.dtype,
    );
    Ok(*(Box::new(out) as Box<dyn Any>)
        .downcast::<B::FloatTensorPrimitive>()
        .expect("the primitive is CubeTensor<CudaRuntime>, as checked"))
}

/// Waits for Burn's queued CUDA work (what `B::sync` does for burn-cuda).
fn sync_burn<E: std::fmt::Debug>(
    fut: impl std::future::Future<Output = std::result::Result<(), E>>,
) -> Result<()> {
    burn_std::future::block_on(fut)
        .map_err(|e| CommError::Nccl(format!("synchronising Burn's CUDA device: {e:?}")))
}

/// All-reduces `tensor` over `group` on the GPU: a new tensor of the same shape with the
/// combined values. `None`: not CUDA + NCCL (or empty, non-contiguous, not f32/f16/bf16):
/// use the host path.
///
/// # Errors
/// As [`ProcessGroup::all_reduce`]; a tensor on another GPU than the group's.
pub fn all_reduce<B: Backend>(
    group: &dyn ProcessGroup,
    tensor: &B::FloatTensorPrimitive,
    op: ReduceOp,
) -> Option<Result<B::FloatTensorPrimitive>> {
    let (nccl, t, dtype, len) = cuda_parts::<B>(group, tensor)?;
    let shape = t.meta.shape().clone();
    Some(with_output::<B>(nccl, t, dtype, shape, |input, output| {
        // SAFETY: `len` contiguous elements of `dtype` at `input` and `output` on the group's
        // GPU, alive and synchronised with Burn's stream (see `with_output`).
        unsafe { nccl.all_reduce_raw(input, output, len, dtype, op) }
    }))
}

/// All-gathers equal shards: every rank passes its shard (any shape, `n` elements), and gets a
/// 1-D tensor of `n * world_size` elements, rank 0's shard first. Pad unequal shards first
/// (kiln's rank-major padded layout).
///
/// # Errors
/// As [`ProcessGroup::all_gather`]; a tensor on another GPU than the group's.
pub fn all_gather<B: Backend>(
    group: &dyn ProcessGroup,
    shard: &B::FloatTensorPrimitive,
) -> Option<Result<B::FloatTensorPrimitive>> {
    let (nccl, t, dtype, len) = cuda_parts::<B>(group, shard)?;
    let shape = Shape::new([len * group.world_size()]);
    Some(with_output::<B>(nccl, t, dtype, shape, |input, output| {
        // SAFETY: as in `all_reduce`; the output holds `len * world_size` elements.
        unsafe { nccl.all_gather_raw(input, output, len, dtype) }
    }))
}

/// Reduce-scatters `whole` (any shape, `n * world_size` elements, the same on every rank's
/// call): a 1-D tensor of this rank's `n` combined elements (rank `r` gets elements
/// `r*n..(r+1)*n` of the flattened tensor). `None` also when `world_size` does not divide the
/// length (pad first).
///
/// # Errors
/// As [`ProcessGroup::reduce_scatter`]; a tensor on another GPU than the group's.
pub fn reduce_scatter<B: Backend>(
    group: &dyn ProcessGroup,
    whole: &B::FloatTensorPrimitive,
    op: ReduceOp,
) -> Option<Result<B::FloatTensorPrimitive>> {
    let (nccl, t, dtype, len) = cuda_parts::<B>(group, whole)?;
    let world = group.world_size();
    if len % world != 0 {
        return None;
    }
    let shard = len / world;
    Some(with_output::<B>(
        nccl,
        t,
        dtype,
        Shape::new([shard]),
        |input, output| {
            // SAFETY: as in `all_reduce`; the output holds `len / world_size` elements.
            unsafe { nccl.reduce_scatter_raw(input, output, shard, dtype, op) }
        },
    ))
}

/// Broadcasts `tensor` from rank `root`: a new tensor of the same shape holding root's values
/// (every rank passes a tensor of that shape; only root's values are read).
///
/// # Errors
/// As [`ProcessGroup::broadcast`]; a tensor on another GPU than the group's.
pub fn broadcast<B: Backend>(
    group: &dyn ProcessGroup,
    tensor: &B::FloatTensorPrimitive,
    root: usize,
) -> Option<Result<B::FloatTensorPrimitive>> {
    let (nccl, t, dtype, len) = cuda_parts::<B>(group, tensor)?;
    let shape = t.meta.shape().clone();
    Some(with_output::<B>(nccl, t, dtype, shape, |input, output| {
        // SAFETY: as in `all_reduce`.
        unsafe { nccl.broadcast_raw(input, output, len, dtype, root) }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::{Tensor, TensorPrimitive};
    use kiln_comm::{LocalGroup, spawn_ranks};

    #[test]
    fn other_backends_and_groups_take_the_host_path() {
        let got = spawn_ranks(2, |g: LocalGroup| {
            let t = Tensor::<Flex, 1>::from_floats([1.0, 2.0], &Default::default());
            let TensorPrimitive::Float(p) = t.into_primitive() else {
                unreachable!("a float tensor")
            };
            (
                all_reduce::<Flex>(&g, &p, ReduceOp::Sum).is_none(),
                all_gather::<Flex>(&g, &p).is_none(),
                reduce_scatter::<Flex>(&g, &p, ReduceOp::Sum).is_none(),
                broadcast::<Flex>(&g, &p, 0).is_none(),
            )
        });
        assert_eq!(got, [(true, true, true, true); 2]);
    }

    fn float<B: Backend>(t: Tensor<B, 1>) -> B::FloatTensorPrimitive {
        match t.into_primitive() {
            TensorPrimitive::Float(p) => p,
            TensorPrimitive::QFloat(_) => unreachable!("not quantized"),
        }
    }

    fn values<B: Backend>(p: B::FloatTensorPrimitive) -> Vec<f32> {
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(p))
            .into_data()
            .to_vec::<f32>()
            .expect("f32")
    }

    /// A one-rank NCCL group on GPU 0 and burn-cuda tensors: every device collective returns
    /// the right tensor and leaves its input alone (pointers, offsets, stream order).
    #[test]
    #[ignore = "needs an NVIDIA GPU, the CUDA toolkit and NCCL: scripts/gpu-check.sh runs it"]
    fn device_collectives_on_one_gpu() {
        type B = burn::backend::Cuda;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port()
            .to_string();
        let env = kiln_comm::LaunchEnv::from_vars(|k| {
            Some(match k {
                "RANK" | "LOCAL_RANK" => "0".to_string(),
                "WORLD_SIZE" | "LOCAL_WORLD_SIZE" => "1".to_string(),
                "MASTER_ADDR" => "127.0.0.1".to_string(),
                "MASTER_PORT" => port.clone(),
                _ => return None,
            })
        })
        .expect("launch variables");
        let group = NcclGroup::from_launch_env(&env, kiln_comm::GroupOptions::default())
            .expect("a one-rank NCCL group");
        let device = burn::backend::cuda::CudaDevice::new(group.device_ordinal());
        // A slice of a larger tensor: its memory starts at an offset in the buffer.
        let base = Tensor::<B, 1>::from_floats([9.0, 1.0, 2.0, 3.0, 4.0, 5.0], &device);
        let t = base.clone().slice(1..5);
        let want = vec![1.0, 2.0, 3.0, 4.0];
        let p = float(t.clone());
        let g: &dyn ProcessGroup = &group;
        let run = |r: Option<Result<_>>| values::<B>(r.expect("the device path").unwrap());
        assert_eq!(run(all_reduce::<B>(g, &p, ReduceOp::Sum)), want);
        assert_eq!(run(all_reduce::<B>(g, &p, ReduceOp::Avg)), want);
        assert_eq!(run(all_gather::<B>(g, &p)), want);
        assert_eq!(run(reduce_scatter::<B>(g, &p, ReduceOp::Max)), want);
        assert_eq!(run(broadcast::<B>(g, &p, 0)), want);
        assert_eq!(values::<B>(p), want, "the input is unchanged");
        assert_eq!(
            base.into_data().to_vec::<f32>().unwrap(),
            [9.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        );
    }
}
