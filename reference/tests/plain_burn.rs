//! The fixtures' PyTorch numbers on plain `Autodiff<Flex>`: the same checks as `kiln verify-hf`,
//! without kiln's decorator and without Burn's `distributed` feature.

use burn::backend::{Autodiff, Flex};
use kiln_hf::verify::Tolerances;
use std::path::PathBuf;

fn check(name: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/hf/tests/fixtures")
        .join(name);
    let report =
        kiln_zoo::verify_dir::<Autodiff<Flex>>(&dir, &Tolerances::default(), &Default::default())
            .expect("the fixture loads");
    for c in &report.checks {
        assert!(
            c.ok(),
            "{name}: {} = {:.3e} > {:.0e}",
            c.name,
            c.rel_err,
            c.tolerance
        );
    }
    for (quantity, c) in report.worst() {
        println!("{name} worst {quantity}: {:.3e} ({})", c.rel_err, c.name);
    }
}

#[test]
fn gpt2_matches_pytorch_on_plain_burn() {
    check("tiny-gpt2");
}

#[test]
fn llama_matches_pytorch_on_plain_burn() {
    check("tiny-llama");
}
