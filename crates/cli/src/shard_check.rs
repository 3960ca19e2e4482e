//! `kiln shard-check`: trains a small MLP under a strategy on this job's ranks and checks it
//! against single-device training of the same global batch (every rank also computes the
//! reference). Run it under `kiln launch` (ranks are processes over TCP, or GPUs over NCCL),
//! or alone with `--ranks N` (ranks are threads).

use anyhow::{Result, bail};
use kiln_comm::{DeviceSharing, GroupOptions, LocalGroup, ProcessGroup};
use kiln_shard::Strategy;
use kiln_shard::check::{Errors, Mlp, Options, train, with_values};
use std::sync::Arc;

/// Arguments of `kiln shard-check`.
#[derive(Debug, Clone, clap::Args)]
pub struct ShardCheckArgs {
    /// ddp, zero1, zero2, zero3 (fsdp) or hybrid:S.
    #[arg(long, default_value = "zero3")]
    strategy: String,
    /// AdamW steps.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Ranks as threads of this process, when not started by a launcher.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Process group when launched: tcp, nccl (GPUs; needs --features nccl) or mpi (under
    /// mpirun or srun; needs --features mpi).
    #[arg(long, default_value = "tcp")]
    backend: String,
    /// Inner backend: cpu (Flex), or cuda (needs --features cuda).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Largest relative error accepted (losses, and all parameters as one vector).
    #[arg(long, default_value_t = 1e-5)]
    tolerance: f64,
    /// How each rank initialises the model: `fixed` (the same deterministic weights everywhere)
    /// or `burn` (Burn's random initialisers, seeded by the rank so that ranks differ: `shard`
    /// must make them rank 0's, and the reference starts from rank 0's weights).
    #[arg(long, default_value = "fixed", value_parser = ["fixed", "burn"])]
    init: String,
    /// Mixed precision of the steps: f32, bf16 or f16 (the single-device reference runs alike;
    /// bf16 and f16 round partial sums, so give a looser --tolerance).
    #[arg(long, default_value = "f32")]
    precision: String,
}

fn run_rank<B: burn::tensor::backend::Backend>(
    group: Arc<dyn ProcessGroup>,
    strategy: Strategy,
    opts: Options,
    device: &B::Device,
    burn_init: bool,
) -> Result<Errors> {
    if burn_init {
        // Threads of one process share Burn's generator; processes seed it by rank.
        <B as burn::tensor::backend::Backend>::seed(device, 1 + group.rank() as u64);
        let run = train::<B, _>(Mlp::random(device), Some(group), strategy, opts, device)?;
        let reference = with_values(Mlp::random(device), &run.initial);
        let reference = train::<B, _>(reference, None, strategy, opts, device)?;
        return Ok(Errors::of(&run, &reference));
    }
    let reference = train::<B, _>(Mlp::new(device), None, strategy, opts, device)?;
    let run = train::<B, _>(Mlp::new(device), Some(group), strategy, opts, device)?;
    Ok(Errors::of(&run, &reference))
}

/// How far one device's single-device run may be from the CPU's. Different kernels (CubeCL's
/// matmul tiling and reduction order against Flex's) differ by float rounding, which Adam's
/// normalisation amplifies on parameters whose gradients are near zero: on an H200, 1.4e-4 on
/// the parameters and 1.5e-5 on the losses after the check's steps. The sharded runs are
/// compared with the single-device run of the same device, at `--tolerance`.
#[cfg(feature = "cuda")]
const CUDA_VS_CPU_TOLERANCE: f64 = 1e-3;

fn on_device(
    group: Arc<dyn ProcessGroup>,
    args: &ShardCheckArgs,
    strategy: Strategy,
    opts: Options,
    slot: (usize, usize, DeviceSharing),
) -> Result<Errors> {
    match args.device.as_str() {
        "cpu" => run_rank::<burn::backend::Flex>(
            group,
            strategy,
            opts,
            &Default::default(),
            args.init == "burn",
        ),
        #[cfg(feature = "cuda")]
        "cuda" => {
            let (local_rank, local_world_size, sharing) = slot;
            let ordinal = kiln_comm::choose_cuda_device(local_rank, local_world_size, sharing)?;
            let device = burn::backend::cuda::CudaDevice::new(ordinal);
            // The GPU's single-device run against the CPU's, before the sharded comparison.
            let gpu = train::<kiln::Cuda, _>(Mlp::new(&device), None, strategy, opts, &device)?;
            let cpu_device = Default::default();
            let cpu = train::<burn::backend::Flex, _>(
                Mlp::new(&cpu_device),
                None,
                strategy,
                opts,
                &cpu_device,
            )?;
            let e = Errors::of(&gpu, &cpu);
            println!(
                "rank {}: single-device cuda vs cpu: loss error {:.3e}, parameter error {:.3e}",
                group.rank(),
                e.loss,
                e.params
            );
            if e.worst() > CUDA_VS_CPU_TOLERANCE {
                bail!("cuda and cpu disagree beyond {CUDA_VS_CPU_TOLERANCE:e}: {e:?}");
            }
            run_rank::<kiln::Cuda>(group, strategy, opts, &device, args.init == "burn")
        }
        other => {
            let _ = slot;
            bail!("device '{other}' is not built in (cpu; cuda needs `--features cuda`)")
        }
    }
}

pub fn shard_check(args: &ShardCheckArgs) -> Result<bool> {
    let strategy: Strategy = args.strategy.parse()?;
    let precision = kiln_shard::Precision::from_name(&args.precision).ok_or_else(|| {
        anyhow::anyhow!(
            "--precision must be f32, bf16 or f16, got '{}'",
            args.precision
        )
    })?;
    let opts = Options {
        steps: args.steps,
        precision,
        ..Options::default()
    };
    let report = |rank: usize, world: usize, e: &Errors| {
        let ok = e.worst() <= args.tolerance;
        println!(
            "rank {rank} of {world}: {strategy}, {} steps: loss error {:.3e}, parameter error {:.3e} \
             (largest single tensor {:.3e}) vs single-device: {}",
            opts.steps,
            e.loss,
            e.params,
            e.tensor,
            if ok { "ok" } else { "FAIL" }
        );
        ok
    };
    if kiln_comm::LaunchEnv::launched() {
        let env = kiln_comm::LaunchEnv::from_env()?;
        let group = kiln_comm::join(&args.backend, &env, GroupOptions::default())?;
        let (rank, world) = (group.rank(), group.world_size());
        // (local rank, ranks on the node, sharing): NCCL allows one rank per GPU.
        let slot = (
            env.local_rank,
            env.local_world_size,
            DeviceSharing::for_backend(group.backend()),
        );
        let errors = on_device(group, args, strategy, opts, slot)?;
        return Ok(report(rank, world, &errors));
    }
    let results = kiln::shard::threads::spawn_ranks(args.ranks, |g: LocalGroup| {
        let (rank, world) = (g.rank(), g.world_size());
        // Threads exchange through host memory: on fewer GPUs than ranks they share.
        let slot = (rank, world, DeviceSharing::RoundRobin);
        on_device(Arc::new(g), args, strategy, opts, slot).map(|e| (rank, world, e))
    })
    .map_err(anyhow::Error::msg)?;
    let mut all_ok = true;
    for r in results {
        let (rank, world, e) = r?;
        all_ok &= report(rank, world, &e);
    }
    Ok(all_ok)
}
