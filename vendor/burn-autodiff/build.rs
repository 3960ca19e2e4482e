// Added for kiln (see KILN-PATCH.md): tells the crates that depend on this one directly that
// this build carries the fix of tracel-ai/burn#5194 (`DEP_KILN_BURN_AUTODIFF_5194_SKIPS_BUSY_GRAPHS`).
fn main() {
    println!("cargo::metadata=skips_busy_graphs=1");
}
