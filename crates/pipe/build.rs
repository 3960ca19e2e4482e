//! Whether burn-autodiff is built with the fix of tracel-ai/burn#5194 (kiln's workspace builds
//! `vendor/burn-autodiff`, which says so through its build metadata). Without it, the clean-up
//! that ends every backward waits for any other thread's backward in progress, and stages that
//! are threads of one process can deadlock under ZeRO-3 (`Pipeline::step` refuses that case).
fn main() {
    println!("cargo::rustc-check-cfg=cfg(burn_autodiff_skips_busy_graphs)");
    println!("cargo::rerun-if-env-changed=DEP_KILN_BURN_AUTODIFF_5194_SKIPS_BUSY_GRAPHS");
    if std::env::var_os("DEP_KILN_BURN_AUTODIFF_5194_SKIPS_BUSY_GRAPHS").is_some() {
        println!("cargo::rustc-cfg=burn_autodiff_skips_busy_graphs");
    }
}
