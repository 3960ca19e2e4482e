//! `kiln verify-lora DIR`: LoRA fine-tuning against PEFT's numbers in a directory of the
//! `lora-tiny-*` fixtures' layout (`base/`, `adapter_init/`, `adapter_final/`, `merged/`,
//! `reference.safetensors`; see `kiln_lora::verify`).

use anyhow::{Result, bail};
use burn::module::AutodiffModule;
use kiln::{Flex, Train};
use kiln_comm::{LocalGroup, ProcessGroup};
use kiln_hf::Pretrained;
use kiln_lora::{Check, Lora};
use kiln_model::CausalLm;
use kiln_shard::{ShardConfig, Strategy, TpPlan};
use std::path::{Path, PathBuf};
use std::sync::Arc;

type B = Train<Flex>;

#[derive(Debug, clap::Args)]
pub struct VerifyLoraArgs {
    /// A LoRA fixture directory (base/, adapter_init/, adapter_final/, merged/,
    /// reference.safetensors).
    pub dir: PathBuf,
    /// `single`, or a sharding strategy: ddp, zero1, zero2, zero3 (fsdp), hybrid:S.
    #[arg(long, default_value = "single")]
    pub strategy: String,
    /// Ranks (threads of this process) for a sharding strategy.
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Tensor-parallel ranks among them (the base model's Megatron plan; with --strategy
    /// ddp): ranks = data-parallel ranks x tp.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// With --tp: Megatron's sequence parallelism.
    #[arg(long)]
    pub sequence_parallel: bool,
}

fn checks<M>(
    dir: &Path,
    strategy: Option<Strategy>,
    ranks: usize,
    tp: Option<(usize, TpPlan)>,
) -> Result<Vec<Check>>
where
    M: Pretrained<B> + CausalLm<B> + AutodiffModule<B>,
    Lora<B, M>: AutodiffModule<B>,
{
    let load = || -> Result<Lora<B, M>> {
        let device = Default::default();
        let base = M::from_pretrained(dir.join("base"), &device)?;
        Ok(kiln_lora::load_peft(
            base,
            &dir.join("adapter_init"),
            M::hf_tensor,
            &device,
        )?)
    };
    let Some(strategy) = strategy else {
        return Ok(kiln_lora::verify_lora::<Flex, B, M>(
            load()?,
            dir,
            &Default::default(),
        )?);
    };
    let per_rank = kiln_shard::threads::spawn_ranks(ranks, |g: LocalGroup| -> Result<Vec<Check>> {
        let world: Arc<dyn ProcessGroup> = Arc::new(g);
        let mut plan = kiln::ParallelPlan::new(strategy);
        plan.tp = tp.as_ref().map_or(1, |(n, _)| *n);
        let mesh = kiln::Mesh::new(world, &plan)?;
        let model = kiln_shard::shard(load()?, mesh.dp.clone(), ShardConfig::new(strategy))?;
        let model = match (&mesh.tp, &tp) {
            (Some(group), Some((_, tp_plan))) => {
                kiln_shard::tensor_parallel(model, tp_plan, group.clone())?.0
            }
            _ => model,
        };
        kiln_shard::tp::reset_stats();
        let checks = kiln_lora::verify_lora::<Flex, B, M>(model, dir, &Default::default())?;
        if mesh.world.rank() == 0 && mesh.tp.is_some() {
            let s = kiln_shard::tp::stats();
            println!(
                "tensor parallel (rank 0, the whole verification): {} all-reduces of partial \
                 sums; split tensors formed whole by op: {:?}",
                s.all_reduces, s.gathers
            );
        }
        Ok(checks)
    })
    .map_err(anyhow::Error::msg)?;
    // Every rank computed every quantity: keep each quantity's worst rank.
    let mut worst: Vec<Check> = Vec::new();
    for checks in per_rank {
        for c in checks? {
            match worst.iter_mut().find(|w| w.quantity == c.quantity) {
                Some(w) if c.error > w.error => *w = c,
                Some(_) => {}
                None => worst.push(c),
            }
        }
    }
    Ok(worst)
}

/// Prints one line per quantity; returns 0 when all are within tolerance, 1 otherwise.
pub fn verify_lora(args: &VerifyLoraArgs) -> Result<i32> {
    let strategy = match args.strategy.as_str() {
        "single" if args.ranks != 1 => bail!(
            "--strategy single runs on one rank, not {}; name a sharding strategy",
            args.ranks
        ),
        "single" => None,
        s => Some(s.parse::<Strategy>()?),
    };
    if args.ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    let kind = kiln_hf::model_type(args.dir.join("base"))?;
    let tp = match args.tp {
        0 => bail!("--tp must be at least 1"),
        1 => None,
        tp if strategy.is_none() || !args.ranks.is_multiple_of(tp) => {
            bail!(
                "--tp {tp} needs a strategy and --ranks a multiple of it (ranks = data-parallel \
                 ranks x tp)"
            )
        }
        tp => {
            let config = kiln_zoo::ModelConfig::from_dir(args.dir.join("base"))?;
            if let Err(e) = config.check_tp(tp) {
                bail!("--tp {tp}: {e}");
            }
            Some((
                tp,
                TpPlan::parse(config.tp_plan())?.with_sequence_parallel(args.sequence_parallel),
            ))
        }
    };
    let checks = match kind.as_str() {
        "gpt2" => checks::<kiln_gpt2::Gpt2<B>>(&args.dir, strategy, args.ranks, tp)?,
        "llama" => checks::<kiln_llama::Llama<B>>(&args.dir, strategy, args.ranks, tp)?,
        other => bail!("base/config.json has model_type '{other}'; kiln has gpt2 and llama"),
    };
    println!(
        "{}: LoRA vs PEFT, {} on {} rank(s){}",
        args.dir.display(),
        args.strategy,
        args.ranks,
        match args.tp {
            1 => String::new(),
            tp => format!(" ({} data-parallel x tp {tp})", args.ranks / tp),
        }
    );
    for c in &checks {
        println!("  {c}");
    }
    let failed = checks.iter().filter(|c| !c.passed()).count();
    if failed == 0 {
        println!("all {} quantities within tolerance", checks.len());
        Ok(0)
    } else {
        println!("{failed} of {} quantities out of tolerance", checks.len());
        Ok(1)
    }
}
