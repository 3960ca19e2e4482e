//! Which CUDA device a rank runs on.
//!
//! `LOCAL_RANK` alone is the wrong answer in two common cases: SLURM (`--gpus-per-task`,
//! `--gpu-bind`) gives each task its own `CUDA_VISIBLE_DEVICES`, so a task sees one device whose
//! ordinal is 0 whatever its local rank; and ranks run as threads of one process
//! (`kiln train --ranks 2 --device cuda`) on a machine with fewer GPUs than ranks would ask for
//! a GPU that does not exist. [`cuda_ordinal`] decides from the local rank, the number of
//! devices this process sees and `CUDA_VISIBLE_DEVICES`, as a pure function (tested without a
//! GPU); [`choose_cuda_device`] (feature `cuda`) reads the environment and the driver.
//! Every place kiln opens a CUDA device (NCCL groups, the CLI's Burn devices) goes through it,
//! so that a rank's NCCL communicator and its Burn tensors are on the same GPU.

use crate::error::{CommError, Result};

/// Whether ranks of one node may share a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSharing {
    /// One GPU per rank: required by NCCL, which rejects two ranks of one communicator on one
    /// GPU. Fewer visible devices than local ranks is an error, unless the launcher bound
    /// devices per process (`CUDA_VISIBLE_DEVICES` set), in which case the rank takes the first
    /// device it sees.
    Exclusive,
    /// Ranks take devices round-robin (`local_rank % visible`): for ranks that communicate
    /// through host memory (threads over a `LocalGroup`, processes over TCP), where two ranks
    /// on one GPU are merely slower.
    RoundRobin,
}

impl DeviceSharing {
    /// How ranks of a group implementation ([`ProcessGroup::backend`](crate::ProcessGroup))
    /// may share GPUs: exclusively for NCCL, round-robin for the host-memory groups.
    pub fn for_backend(backend: &str) -> DeviceSharing {
        if backend == "nccl" {
            DeviceSharing::Exclusive
        } else {
            DeviceSharing::RoundRobin
        }
    }
}

/// The ordinal (among the devices this process sees) of the GPU for local rank `local_rank`
/// of `local_world_size`, given `visible` devices and the value of `CUDA_VISIBLE_DEVICES`.
///
/// - as many devices as local ranks, or more: device `local_rank`;
/// - fewer, `CUDA_VISIBLE_DEVICES` set: the launcher gave this process its own devices
///   (SLURM's per-task binding): device 0 under [`DeviceSharing::Exclusive`];
/// - fewer, [`DeviceSharing::RoundRobin`]: device `local_rank % visible`;
/// - fewer, exclusive, no binding: an error saying how many ranks fit.
///
/// # Errors
/// [`CommError::Config`] when no device is visible, or when exclusive ranks outnumber devices.
pub fn cuda_ordinal(
    local_rank: usize,
    local_world_size: usize,
    visible: usize,
    cuda_visible_devices: Option<&str>,
    sharing: DeviceSharing,
) -> Result<usize> {
    let local_world_size = local_world_size.max(local_rank + 1);
    let bound = cuda_visible_devices.is_some_and(|v| !v.trim().is_empty());
    if visible == 0 {
        return Err(CommError::Config(match cuda_visible_devices {
            Some(v) => format!(
                "no CUDA device is visible to local rank {local_rank} \
                 (CUDA_VISIBLE_DEVICES={v:?} lists none that exist)"
            ),
            None => format!(
                "no CUDA device is visible to local rank {local_rank}: this needs an NVIDIA GPU \
                 and its driver"
            ),
        }));
    }
    if local_world_size <= visible {
        return Ok(local_rank);
    }
    match sharing {
        DeviceSharing::RoundRobin => Ok(local_rank % visible),
        DeviceSharing::Exclusive if bound => Ok(0),
        DeviceSharing::Exclusive => Err(CommError::Config(format!(
            "local rank {local_rank} of {local_world_size} ranks on this node, but only {visible} \
             CUDA device(s) visible: NCCL needs one GPU per rank (two ranks of one communicator \
             cannot share a GPU). Start at most {visible} rank(s) per node (`kiln launch \
             --nproc-per-node {visible}`), give each task its own GPU (SLURM `--gpus-per-task=1`), \
             or use the tcp backend or ranks as threads, which may share a GPU"
        ))),
    }
}

/// The number of CUDA devices this process sees (after `CUDA_VISIBLE_DEVICES`).
///
/// # Errors
/// [`CommError::Config`] when the CUDA driver cannot be loaded or initialised.
#[cfg(feature = "cuda")]
pub fn visible_cuda_devices() -> Result<usize> {
    // SAFETY: this only tries to dlopen the driver's candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CommError::Config(
            "the CUDA driver library (libcuda.so) was not found: this needs a machine with an \
             NVIDIA GPU and its driver"
                .into(),
        ));
    }
    cudarc::driver::CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| CommError::Config(format!("counting CUDA devices (cuDeviceGetCount): {e}")))
}

/// [`cuda_ordinal`] for this process: its environment's `CUDA_VISIBLE_DEVICES` and the
/// driver's device count.
///
/// # Errors
/// As [`cuda_ordinal`] and [`visible_cuda_devices`].
#[cfg(feature = "cuda")]
pub fn choose_cuda_device(
    local_rank: usize,
    local_world_size: usize,
    sharing: DeviceSharing,
) -> Result<usize> {
    let listed = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    cuda_ordinal(
        local_rank,
        local_world_size,
        visible_cuda_devices()?,
        listed.as_deref(),
        sharing,
    )
}

#[cfg(test)]
mod tests {
    use super::DeviceSharing::{Exclusive, RoundRobin};
    use super::*;

    #[test]
    fn one_gpu_per_local_rank_by_local_rank() {
        for r in 0..4 {
            assert_eq!(cuda_ordinal(r, 4, 4, None, Exclusive).unwrap(), r);
            assert_eq!(
                cuda_ordinal(r, 4, 8, Some("0,1,2,3,4,5,6,7"), Exclusive).unwrap(),
                r
            );
            assert_eq!(cuda_ordinal(r, 4, 4, None, RoundRobin).unwrap(), r);
        }
    }

    #[test]
    fn slurm_per_task_binding_uses_the_one_visible_device() {
        // srun --gpus-per-task=1: task 3 sees only its own GPU, as device 0.
        assert_eq!(cuda_ordinal(3, 4, 1, Some("3"), Exclusive).unwrap(), 0);
        assert_eq!(
            cuda_ordinal(1, 4, 1, Some("GPU-5e0c1f"), Exclusive).unwrap(),
            0
        );
        // Two GPUs per task: the first of its own.
        assert_eq!(cuda_ordinal(1, 2, 1, Some("2,3"), Exclusive).unwrap(), 0);
    }

    #[test]
    fn exclusive_ranks_beyond_the_devices_are_an_error_naming_the_fit() {
        // `kiln launch --nproc-per-node 2` on a one-GPU machine, over NCCL.
        let e = cuda_ordinal(1, 2, 1, None, Exclusive)
            .unwrap_err()
            .to_string();
        assert!(e.contains("only 1 CUDA device(s) visible"), "{e}");
        assert!(e.contains("--nproc-per-node 1"), "{e}");
        assert!(e.contains("cannot share a GPU"), "{e}");
        // Rank 0 fails too: a job that cannot run should not half-start.
        assert!(cuda_ordinal(0, 2, 1, None, Exclusive).is_err());
    }

    #[test]
    fn ranks_over_host_memory_share_gpus_round_robin() {
        // `kiln train --ranks 2 --device cuda` on one GPU: both on device 0, not GPU 1.
        assert_eq!(cuda_ordinal(0, 2, 1, None, RoundRobin).unwrap(), 0);
        assert_eq!(cuda_ordinal(1, 2, 1, None, RoundRobin).unwrap(), 0);
        let got: Vec<usize> = (0..5)
            .map(|r| cuda_ordinal(r, 5, 2, None, RoundRobin).unwrap())
            .collect();
        assert_eq!(got, [0, 1, 0, 1, 0]);
    }

    #[test]
    fn no_visible_device_is_an_error_naming_cuda_visible_devices() {
        let e = cuda_ordinal(0, 1, 0, Some(""), RoundRobin)
            .unwrap_err()
            .to_string();
        assert!(e.contains("CUDA_VISIBLE_DEVICES=\"\""), "{e}");
        let e = cuda_ordinal(0, 1, 0, None, Exclusive)
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs an NVIDIA GPU"), "{e}");
    }

    #[test]
    fn an_empty_cuda_visible_devices_is_not_a_binding() {
        assert!(cuda_ordinal(1, 2, 1, Some(" "), Exclusive).is_err());
    }
}
