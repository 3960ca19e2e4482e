//! kiln vs PyTorch on the fixtures, through the code `kiln verify-hf` runs.

use kiln_hf::HfError;
use kiln_hf::verify::{Quantity, Tolerances, VerifyReport};
use kiln_tests::fixture;

// kiln turns on Burn's `distributed` feature, so the training backend is `Autodiff<Kiln<Flex>>`
// (only forwarding here); `reference/` checks the same against plain `Autodiff<Flex>`.
type TB = kiln::Train<kiln::Flex>;

fn verify(name: &str) -> VerifyReport {
    kiln_zoo::verify_dir::<TB>(fixture(name), &Tolerances::default(), &Default::default())
        .unwrap_or_else(|e| panic!("verify {name}: {e}"))
}

/// `params` checkpoint tensors, `noise_parts` of them with a part the loss does not depend on
/// (`HfNaming::zero_gradient_parts`): one more gradient check and one ungated final value each.
fn assert_parity(name: &str, params: usize, noise_parts: usize, steps: usize) {
    let report = verify(name);
    for (quantity, check) in report.worst() {
        println!(
            "{name}: worst {quantity}: {} = {:.3e}",
            check.name, check.rel_err
        );
    }
    let count = |q: Quantity| report.checks.iter().filter(|c| c.quantity == q).count();
    assert_eq!(count(Quantity::Logits), 1);
    assert_eq!(count(Quantity::LossInit), 1);
    assert_eq!(
        count(Quantity::GradNorm),
        params + noise_parts,
        "one gradient norm per parameter, one share per zero-gradient part"
    );
    assert_eq!(count(Quantity::TrainLoss), steps, "one loss per AdamW step");
    let gated_finals = report
        .checks
        .iter()
        .filter(|c| c.quantity == Quantity::FinalWeight && c.tolerance.is_finite())
        .count();
    assert_eq!(gated_finals, params, "every final parameter is gated");
    assert_eq!(count(Quantity::FinalWeight), params + noise_parts);
    let tol = Tolerances::default();
    assert_eq!(
        (
            tol.logits,
            tol.loss_init,
            tol.grad_norm,
            tol.train_loss,
            tol.final_weight
        ),
        (1e-4, 1e-5, 1e-4, 1e-4, 1e-4)
    );
    let failures: Vec<_> = report.checks.iter().filter(|c| !c.ok()).collect();
    assert!(
        failures.is_empty(),
        "{name}: out of tolerance: {failures:#?}"
    );
}

#[test]
fn gpt2_matches_pytorch() {
    // 2 blocks x 12 tensors + wte, wpe, ln_f.{weight,bias}; the tied head has no tensor of its own.
    // Each block's key bias (the middle third of c_attn.bias) is a zero-gradient part.
    assert_parity("tiny-gpt2", 28, 2, 10);
}

#[test]
fn llama_matches_pytorch() {
    // 2 layers x 9 tensors + embed_tokens, norm, lm_head (untied).
    assert_parity("tiny-llama", 21, 0, 10);
}

#[test]
fn unknown_model_type_is_named() {
    let dir = std::env::temp_dir().join(format!("kiln-zoo-bert-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("config.json"), r#"{"model_type": "bert"}"#).expect("write config");
    let err = kiln_zoo::verify_dir::<TB>(&dir, &Tolerances::default(), &Default::default())
        .expect_err("bert is not implemented");
    assert!(matches!(err, HfError::UnsupportedModel { .. }), "{err:?}");
    assert!(err.to_string().contains("'bert'"), "{err}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn missing_config_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("kiln-zoo-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let err = kiln_zoo::verify_dir::<TB>(&dir, &Tolerances::default(), &Default::default())
        .expect_err("no config.json");
    assert!(matches!(err, HfError::MissingFile { .. }), "{err:?}");
    assert!(err.to_string().contains("config.json is missing"), "{err}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}
