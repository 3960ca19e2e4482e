// Whether the burn-autodiff in this build is kiln's copy (vendor/burn-autodiff, KILN-PATCH.md),
// which looks a backend's gradient-sync hooks up at run time: then `shard` registers the
// decorator's (`cfg(burn_autodiff_hooks)`); the published crate calls them statically instead.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(burn_autodiff_hooks)");
    println!("cargo::rerun-if-env-changed=DEP_KILN_BURN_AUTODIFF_5194_DISTRIBUTED_HOOKS");
    if std::env::var_os("DEP_KILN_BURN_AUTODIFF_5194_DISTRIBUTED_HOOKS").is_some() {
        println!("cargo::rustc-cfg=burn_autodiff_hooks");
    }
}
