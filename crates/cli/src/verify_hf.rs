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
}

/// Prints one line per check and a summary; returns the exit code: 0 when every quantity is within
/// tolerance, 1 otherwise.
pub fn verify_hf(args: &VerifyHfArgs) -> Result<i32> {
    let tolerances = Tolerances::default();
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
        let reports = kiln::shard::threads::spawn_ranks(args.ranks, |g: LocalGroup| {
            let group: Arc<dyn ProcessGroup> = Arc::new(g);
            let parallel = Sharding::<Flex>::new(group, strategy)?;
            kiln_zoo::verify_dir_with::<Backend, _>(
                &args.dir,
                &tolerances,
                &Default::default(),
                &parallel,
            )
        })
        .map_err(anyhow::Error::msg)?;
        // Every rank computed every quantity; report the worst rank's value of each.
        merge(reports.into_iter().collect::<Result<Vec<_>, _>>()?)
    };
    println!(
        "{}: {} on {} rank(s)",
        args.dir.display(),
        args.strategy,
        args.ranks
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
