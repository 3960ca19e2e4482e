//! Runs on a Hugging Face tokenizer: a fresh model gets the tokenizer's vocabulary, `kiln export`
//! ships the tokenizer.json, fine-tuning from that directory picks it up, and a tokenizer larger
//! than a base's vocabulary is named.

mod common;

use burn::backend::Flex;
use kiln_hf::{TOKENIZER_FILE, Tokenizer};
use kiln_train::{RunOptions, train_threads};
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/hf/tests/fixtures")
}

#[test]
fn bpe_tokens_train_export_and_finetune() {
    let tmp = tempfile::tempdir().unwrap();
    let bpe = fixtures().join("tokenizer-bpe512").join(TOKENIZER_FILE);
    let tokenizer = format!("data.tokenizer={:?}", bpe.display().to_string());
    let pre = common::recipe(&tmp.path().join("pre"), "ddp", &[&tokenizer]);
    // A fresh model's vocabulary is the tokenizer's.
    let spec = pre.model_config(&pre.tokenizer().unwrap()).unwrap();
    assert_eq!(spec.vocab_size(), 512);
    let summary = common::run(&pre, 1, false, None);
    let base = tmp.path().join("base");
    kiln_train::export(summary.snapshot.as_ref().unwrap(), &base).unwrap();
    assert!(
        base.join(TOKENIZER_FILE).is_file(),
        "export ships the tokenizer"
    );

    // Fine-tuning the exported base: `auto` finds its tokenizer.json.
    let from = format!("model.from={:?}", base.display().to_string());
    let ft = common::recipe(
        &tmp.path().join("ft"),
        "ddp",
        &[
            &from,
            "lora.r=2",
            "lora.alpha=4.0",
            r#"lora.targets=["c_attn"]"#,
            "train.sample_chars=6",
        ],
    );
    let tok = ft.tokenizer().unwrap();
    assert!(matches!(tok, Tokenizer::Hf(..)), "{}", tok.describe());
    let summary = common::run(&ft, 1, false, None);
    let sample = summary.sample.unwrap();
    // The prompt and the continuation are text decoded by the BPE, not byte ids.
    assert!(sample.contains('|') && sample.len() > 8, "{sample:?}");
}

#[test]
fn a_tokenizer_larger_than_the_base_vocabulary_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let bpe = fixtures().join("tokenizer-bpe512").join(TOKENIZER_FILE);
    let r = common::recipe(
        &tmp.path().join("run"),
        "ddp",
        &[
            &format!("data.tokenizer={:?}", bpe.display().to_string()),
            &format!(
                "model.from={:?}",
                fixtures().join("tiny-gpt2").display().to_string()
            ),
        ],
    );
    let options = RunOptions {
        overwrite: true,
        ..Default::default()
    };
    let err = common::chain(train_threads::<Flex>(&r, 1, options).unwrap_err());
    assert!(
        err.contains("vocabulary has 256 tokens") && err.contains("needs at least 512"),
        "{err}"
    );
    let r = common::recipe(
        &tmp.path().join("run"),
        "ddp",
        &["data.tokenizer=\"/nonexistent/tokenizer.json\""],
    );
    let err = common::chain(train_threads::<Flex>(&r, 1, options).unwrap_err());
    assert!(err.contains("/nonexistent/tokenizer.json"), "{err}");
}
