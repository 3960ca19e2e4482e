//! `kiln verify-hf DIR`: run a Hugging Face model directory's computations as PyTorch did and compare
//! every quantity with its `reference.safetensors` (see `models/hf` and `kiln_zoo::verify_dir`).

use anyhow::{Result, bail};
use kiln::{Flex, Train};
use kiln_comm::{LocalGroup, ProcessGroup};
use kiln_hf::verify::{Tolerances, VerifyReport};
use kiln_shard::Strategy;
use kiln_zoo::parallel::Sharding;
use std::path::PathBuf;
use std::sync::Arc;

/// The backend verification runs on.
type Backend = Train<Flex>;

#[derive(Debug, clap::Args)]
pub struct VerifyHfArgs {
    /// A model directory: config.json, model.safetensors, reference.safetensors.
    pub dir: PathBuf,
    /// `single`, or a sharding strategy: ddp, zero3 (fsdp), hybrid:S.
    #[arg(long, default_value = "single")]
    pub strategy: String,
    /// Ranks (threads of this process) for a sharding strategy.
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Tensor-parallel ranks among them (Megatron's split of the model's layers, the model's
    /// own plan): ranks = data-parallel ranks x tp.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// With --tp: Megatron's sequence parallelism.
    #[arg(long)]
    pub sequence_parallel: bool,
}

/// Prints one line per check and a summary; returns the exit code: 0 when every quantity is within
/// tolerance, 1 otherwise.
pub fn verify_hf(args: &VerifyHfArgs) -> Result<i32> {
    let tolerances = Tolerances::default();
    let mut tp_line = None;
    let report = if args.strategy == "single" {
        if args.ranks != 1 {
            bail!(
                "--strategy single runs on one rank, not {}; name a sharding strategy",
                args.ranks
            );
        }
        kiln_zoo::verify_dir::<Backend>(&args.dir, &tolerances, &Default::default())?
    } else {
        let strategy: Strategy = args.strategy.parse()?;
        if args.ranks == 0 {
            bail!("--ranks must be at least 1");
        }
        if args.tp == 0 || !args.ranks.is_multiple_of(args.tp) {
            bail!(
                "--tp ({}) must divide --ranks ({}): the ranks are data-parallel ranks x tp",
                args.tp,
                args.ranks
            );
        }
        let tp_plan = match args.tp {
            1 => None,
            tp => {
                let config = kiln_zoo::ModelConfig::from_dir(&args.dir)?;
                if let Err(e) = config.check_tp(tp) {
                    bail!("--tp {tp}: {e}");
                }
                Some(
                    kiln::shard::TpPlan::parse(config.tp_plan())?
                        .with_sequence_parallel(args.sequence_parallel),
                )
            }
        };
        let reports = kiln::shard::threads::spawn_ranks(args.ranks, |g: LocalGroup| {
            let world: Arc<dyn ProcessGroup> = Arc::new(g);
            let mut plan = kiln::ParallelPlan::new(strategy);
            plan.tp = args.tp;
            let mesh = kiln::Mesh::new(world, &plan)
                .map_err(|e| kiln_hf::HfError::Parallel(e.to_string()))?;
            let mut parallel = Sharding::<Flex>::new(mesh.dp.clone(), strategy)?;
            if let (Some(tp), Some(tp_plan)) = (&mesh.tp, &tp_plan) {
                parallel = parallel.with_tp(tp.clone(), tp_plan.clone());
            }
            kiln::shard::tp::reset_stats();
            let report = kiln_zoo::verify_dir_with::<Backend, _>(
                &args.dir,
                &tolerances,
                &Default::default(),
                &parallel,
            );
            report.map(|r| (r, kiln::shard::tp::stats()))
        })
        .map_err(anyhow::Error::msg)?;
        let reports = reports.into_iter().collect::<Result<Vec<_>, _>>()?;
        if args.tp > 1 {
            let s = &reports[0].1;
            tp_line = Some(format!(
                "tensor parallel (rank 0, the whole verification): {} all-reduces of partial \
                 sums ({} bytes), {} all-gathers and {} reduce-scatters of sequence \
                 parallelism; split tensors formed whole by op: {:?} (reading weights and \
                 gradients to compare them is float_into_data)",
                s.all_reduces, s.all_reduce_bytes, s.all_gathers, s.reduce_scatters, s.gathers
            ));
        }
        // Every rank computed every quantity; report the worst rank's value of each.
        merge(reports.into_iter().map(|(r, _)| r).collect())
    };
    if let Some(line) = &tp_line {
        println!("{line}");
    }
    println!(
        "{}: {} on {} rank(s){}",
        args.dir.display(),
        args.strategy,
        args.ranks,
        match args.tp {
            1 => String::new(),
            tp => format!(
                " ({} data-parallel x tp {tp}{})",
                args.ranks / tp,
                if args.sequence_parallel {
                    ", sequence parallel"
                } else {
                    ""
                }
            ),
        }
    );
    let width = report
        .checks
        .iter()
        .map(|c| c.name.len())
        .max()
        .unwrap_or(0);
    println!(
        "{:width$}  {:>10}  {:>9}  result",
        "quantity", "rel_err", "tolerance"
    );
    for check in &report.checks {
        println!(
            "{:width$}  {:>10.3e}  {:>9.0e}  {}",
            check.name,
            check.rel_err,
            check.tolerance,
            if check.ok() { "ok" } else { "FAIL" }
        );
    }
    println!();
    for (quantity, check) in report.worst() {
        println!(
            "worst {quantity}: {:.3e} ({}), tolerance {:.0e}",
            check.rel_err, check.name, check.tolerance
        );
    }
    let failed = report.checks.iter().filter(|c| !c.ok()).count();
    if failed == 0 {
        println!(
            "{}: all {} checks within tolerance",
            args.dir.display(),
            report.checks.len()
        );
        Ok(0)
    } else {
        println!(
            "{}: {failed} of {} checks FAILED",
            args.dir.display(),
            report.checks.len()
        );
        Ok(1)
    }
}

/// The largest error of each check over the ranks.
fn merge(mut reports: Vec<VerifyReport>) -> VerifyReport {
    let mut first = reports.remove(0);
    for other in reports {
        for (mine, theirs) in first.checks.iter_mut().zip(other.checks) {
            debug_assert_eq!(mine.name, theirs.name);
            // NaN (a failed quantity) wins, like any larger error.
            if theirs.rel_err.is_nan() || theirs.rel_err > mine.rel_err {
                mine.rel_err = theirs.rel_err;
            }
        }
    }
    first
}
