//! `kiln verify-hf DIR`: run a Hugging Face model directory's computations as PyTorch did and compare
//! every quantity with its `reference.safetensors` (see `models/hf` and `kiln_zoo::verify_dir`).

use anyhow::{Result, bail};
use burn::backend::{Autodiff, Flex};
use kiln_hf::verify::Tolerances;
use std::path::PathBuf;

/// The backend verification runs on.
type Backend = Autodiff<Flex>;

#[derive(Debug, clap::Args)]
pub struct VerifyHfArgs {
    /// A model directory: config.json, model.safetensors, reference.safetensors.
    pub dir: PathBuf,
    /// The parallelism strategy to verify under (only `single` for now).
    #[arg(long, default_value = "single")]
    pub strategy: String,
    /// The number of ranks (only 1 for now).
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
}

/// Prints one line per check and a summary; returns the exit code: 0 when every quantity is within
/// tolerance, 1 otherwise.
pub fn verify_hf(args: &VerifyHfArgs) -> Result<i32> {
    if args.strategy != "single" || args.ranks != 1 {
        bail!(
            "--strategy {} --ranks {}: only single-device verification (--strategy single \
             --ranks 1) is implemented; sharded verification arrives with the decorator",
            args.strategy,
            args.ranks
        );
    }
    let tolerances = Tolerances::default();
    let report = kiln_zoo::verify_dir::<Backend>(&args.dir, &tolerances, &Default::default())?;
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
