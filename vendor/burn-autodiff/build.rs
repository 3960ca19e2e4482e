// Added for kiln (see KILN-PATCH.md): tells the crates that depend on this one directly that
// this build carries the fix of tracel-ai/burn#5194 (`DEP_KILN_BURN_AUTODIFF_5194_SKIPS_BUSY_GRAPHS`).
// And that its gradient-sync hooks are looked up at run time (`distributed::register_distributed`):
// `DEP_KILN_BURN_AUTODIFF_5194_DISTRIBUTED_HOOKS`.
fn main() {
    println!("cargo::metadata=skips_busy_graphs=1");
    println!("cargo::metadata=distributed_hooks=1");
}
