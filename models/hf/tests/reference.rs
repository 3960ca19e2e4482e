//! The fixture reader: optimizer settings come from the metadata, never assumed.

use kiln_hf::{HfError, REFERENCE_FILE, Reference, SafetensorsFile};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

#[test]
fn reads_settings_and_numbers() {
    let r = Reference::read(fixture("tiny-llama").join(REFERENCE_FILE)).expect("reads");
    let o = r.optimizer;
    assert_eq!(
        (o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.steps),
        (1e-3, 0.9, 0.95, 1e-8, 0.1, 10)
    );
    assert_eq!(r.input_ids.shape.to_vec(), vec![2, 16]);
    assert_eq!(r.logits.shape.to_vec(), vec![2, 16, 256]);
    assert_eq!(r.train_losses.len(), 10);
    assert_eq!(
        r.train_losses[0], r.loss_init,
        "the first step's loss is the initial loss"
    );
    assert_eq!(r.grad_norms.len(), 21);
    assert_eq!(r.final_weights.len(), 21);
}

#[test]
fn missing_setting_is_an_error() {
    // A copy of the tensors, written without the optimizer metadata.
    let source =
        SafetensorsFile::open(fixture("tiny-gpt2").join(REFERENCE_FILE), "ref").expect("open");
    let tensors: Vec<_> = source
        .names()
        .into_iter()
        .filter(|n| !n.ends_with("_ids") && n != "labels")
        .map(|n| {
            let data = source.float(&n, None).expect("float");
            (n, data)
        })
        .collect();
    let path = std::env::temp_dir().join(format!(
        "kiln-ref-no-meta-{}.safetensors",
        std::process::id()
    ));
    kiln_hf::write_tensors(&path, &tensors).expect("write");
    let err = Reference::read(&path).expect_err("no lr in the metadata");
    assert!(
        matches!(err, HfError::Metadata { ref key, .. } if key == "lr"),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("'lr'") && err.to_string().contains("missing"),
        "{err}"
    );
    std::fs::remove_file(&path).expect("clean up");
}
