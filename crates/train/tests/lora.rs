//! LoRA fine-tuning through the run (`kiln finetune`'s job): resume equals uninterrupted with
//! snapshots holding adapters only, ZeRO-3 over 2 ranks equals 1 rank, the files written
//! (PEFT adapters, merged model) equal the trained adapters, and bad input named.

mod common;

use burn::backend::Flex;
use kiln::Train;
use kiln_gpt2::Gpt2;
use kiln_hf::{HfNaming, Pretrained};
use kiln_model::CausalLm;
use kiln_train::snapshot::Snapshot;
use kiln_train::{Recipe, RunOptions, Summary, train_threads};
use std::path::{Path, PathBuf};

fn base(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/hf/tests/fixtures")
        .join(name)
}

/// The tiny recipe fine-tuning `base` with rank-2 adapters on `targets`.
fn finetune(out: &Path, base_name: &str, strategy: &str, targets: &str, extra: &[&str]) -> Recipe {
    let from = format!("model.from={:?}", base(base_name).display().to_string());
    let targets = format!("lora.targets={targets}");
    let mut o = vec![
        from.as_str(),
        "lora.r=2",
        "lora.alpha=4.0",
        targets.as_str(),
        "train.lr=1e-2",
    ];
    o.extend(extra);
    common::recipe(out, strategy, &o)
}

fn error_of(r: &Recipe) -> String {
    let options = RunOptions {
        overwrite: true,
        ..Default::default()
    };
    common::chain(train_threads::<Flex>(r, 1, options).unwrap_err())
}

/// Two runs' training and validation losses agree within 1e-5 (relative).
fn assert_same_run(one: &Summary, two: &Summary) {
    for (x, y) in one.losses.iter().zip(&two.losses) {
        assert!(
            (x - y).abs() <= 1e-5 * x.abs(),
            "{:?} vs {:?}",
            one.losses,
            two.losses
        );
    }
    let (v1, v2) = (one.val_loss.unwrap(), two.val_loss.unwrap());
    assert!((v1 - v2).abs() <= 1e-5 * v1, "{v1} vs {v2}");
}

/// Every tensor of a Hugging Face directory's weights, by name.
fn weights(dir: &Path) -> Vec<(String, burn::tensor::TensorData)> {
    let file = kiln_hf::SafetensorsFile::open(dir.join(kiln_hf::WEIGHTS_FILE), "w").unwrap();
    let mut names = file.names();
    names.sort();
    names
        .into_iter()
        .map(|n| (n.clone(), file.float(&n, None).unwrap()))
        .collect()
}

#[test]
fn finetune_resumes_exactly_and_snapshots_hold_adapters_only() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    // With PEFT's dropout on the adapters' input: its masks depend on the seed, the step and
    // the rank only, so the resumed run draws what the whole one drew.
    let dropout = ["lora.dropout=0.2"];
    let whole = common::run(
        &finetune(&a, "tiny-gpt2", "ddp", r#"["c_attn"]"#, &dropout),
        1,
        false,
        None,
    );
    let r = finetune(&b, "tiny-gpt2", "ddp", r#"["c_attn"]"#, &dropout);
    let first = common::run(&r, 1, false, Some(3));
    let snap = Snapshot::open(first.snapshot.as_ref().unwrap()).unwrap();
    let names: Vec<&String> = snap.manifest.tensors.keys().collect();
    // 2 layers x (A, B) x (value, two moments).
    assert_eq!(names.len(), 12, "{names:?}");
    assert!(names.iter().all(|n| n.contains("adapters.")), "{names:?}");
    let rest = common::run(&r, 1, true, None);
    let resumed: Vec<f64> = first.losses.iter().chain(&rest.losses).copied().collect();
    assert_eq!(resumed, whole.losses);
    assert_eq!(rest.val_loss, whole.val_loss);
    // The base's validation loss came first, and training moved it.
    let before = whole.val_loss_before.unwrap();
    assert!(whole.val_loss.unwrap() < before, "{whole:?}");
    // The dropout was applied: without it the same run trains otherwise (the first step's
    // loss is the base's either way, B being zero).
    let plain = common::run(
        &finetune(
            &tmp.path().join("c"),
            "tiny-gpt2",
            "ddp",
            r#"["c_attn"]"#,
            &[],
        ),
        1,
        false,
        None,
    );
    assert_eq!(plain.losses[0], whole.losses[0]);
    assert_ne!(plain.losses[2..], whole.losses[2..]);
}

#[test]
fn finetune_under_zero3_x2_equals_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let targets = r#"["q_proj", "v_proj"]"#;
    let one = common::run(
        &finetune(&tmp.path().join("1"), "tiny-llama", "ddp", targets, &[]),
        1,
        false,
        None,
    );
    let two = common::run(
        &finetune(&tmp.path().join("2"), "tiny-llama", "zero3", targets, &[]),
        2,
        false,
        None,
    );
    assert_same_run(&one, &two);
}

/// QLoRA through the run: the base's linear weights 4-bit and dequantised on use, ZeRO-3 over 2
/// ranks equal to 1 rank, losses close to LoRA's on the f32 base but not equal (the base is
/// quantised), and `kiln export` of the snapshot equal to `--merge-into` bitwise.
#[test]
fn qlora_finetune_follows_lora_shards_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let targets = r#"["q_proj", "v_proj"]"#;
    let dir = |n: &str| tmp.path().join(n);
    let lora = common::run(
        &finetune(&dir("lora"), "tiny-llama", "ddp", targets, &[]),
        1,
        false,
        None,
    );
    let merge = format!("lora.merge_into={:?}", dir("merged").display().to_string());
    let one = common::run(
        &finetune(
            &dir("1"),
            "tiny-llama",
            "ddp",
            targets,
            &["lora.qlora=true", &merge],
        ),
        1,
        false,
        None,
    );
    let two = common::run(
        &finetune(
            &dir("2"),
            "tiny-llama",
            "zero3",
            targets,
            &["lora.qlora=true"],
        ),
        2,
        false,
        None,
    );
    assert_same_run(&one, &two);
    // Resuming quantises the base again, alike: the losses are those of the whole run.
    let r = finetune(
        &dir("3"),
        "tiny-llama",
        "ddp",
        targets,
        &["lora.qlora=true"],
    );
    let first = common::run(&r, 1, false, Some(3));
    let rest = common::run(&r, 1, true, None);
    let resumed: Vec<f64> = first.losses.iter().chain(&rest.losses).copied().collect();
    assert_eq!(resumed, one.losses);
    assert_ne!(one.losses[0], lora.losses[0], "the base was not quantised");
    for (q, l) in one.losses.iter().zip(&lora.losses) {
        assert!(
            (q - l).abs() <= 0.02 * l,
            "QLoRA {:?} vs LoRA {:?}",
            one.losses,
            lora.losses
        );
    }
    let exported = dir("exported");
    kiln_train::export(one.snapshot.as_ref().unwrap(), &exported).unwrap();
    assert_eq!(weights(&exported), weights(&dir("merged")));
}

/// The adapter directory loads onto the base (as PEFT would) and gives the merged model's
/// logits; the merged directory is a complete Hugging Face model.
#[test]
fn written_adapters_and_merged_model_agree() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, merged_dir) = (tmp.path().join("run"), tmp.path().join("merged"));
    let merge = format!("lora.merge_into={:?}", merged_dir.display().to_string());
    let summary = common::run(
        &finetune(&out, "tiny-gpt2", "ddp", r#"["all-linear"]"#, &[&merge]),
        1,
        false,
        None,
    );
    let adapter_dir = out.join("adapter");
    let outputs: Vec<&PathBuf> = summary.outputs.iter().map(|(_, p)| p).collect();
    assert_eq!(outputs, [&adapter_dir, &merged_dir]);
    type B = Train<Flex>;
    let device = Default::default();
    let base_model = Gpt2::<B>::from_pretrained(base("tiny-gpt2"), &device).unwrap();
    let adapters =
        kiln_lora::load_peft(base_model, &adapter_dir, Gpt2::<B>::hf_tensor, &device).unwrap();
    // all-linear: c_attn, attn.c_proj, c_fc, mlp.c_proj of both layers (no lm_head: tied).
    assert_eq!(adapters.targets.len(), 8);
    let trained: f32 = adapters.adapters[0].b.val().abs().sum().into_scalar();
    assert!(trained > 0.0, "B is still zero: nothing trained");
    let merged = Gpt2::<B>::from_pretrained(&merged_dir, &device).unwrap();
    let ids = burn::tensor::Tensor::<B, 2, burn::tensor::Int>::from_data(
        [[1, 50, 99, 200, 7, 7, 13, 64]],
        &device,
    );
    let diff: f32 = (merged.forward(ids.clone()) - adapters.forward(ids))
        .abs()
        .max()
        .into_scalar();
    assert!(diff < 1e-5, "merged vs adapters: {diff}");
    // `kiln export` of the fine-tuning snapshot writes the same merged model.
    let exported = tmp.path().join("exported");
    kiln_train::export(summary.snapshot.as_ref().unwrap(), &exported).unwrap();
    assert_eq!(weights(&exported), weights(&merged_dir));
}

#[test]
fn bad_lora_settings_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let msg = error_of(&finetune(&out, "tiny-gpt2", "ddp", r#"["q_proj"]"#, &[]));
    assert!(msg.contains("'q_proj' matches no weight"), "{msg}");
    assert!(msg.contains("transformer.h.0.attn.c_attn"), "{msg}");
    let msg = error_of(&finetune(
        &out,
        "tiny-gpt2",
        "ddp",
        r#"["c_attn"]"#,
        &["lora.r=65"],
    ));
    assert!(msg.contains("r = 65 does not fit"), "{msg}");
    let msg = error_of(&finetune(
        &out,
        "tiny-gpt2",
        "ddp",
        r#"["c_attn"]"#,
        &["lora.dropout=1.0"],
    ));
    assert!(msg.contains("dropout 1: it must be a probability"), "{msg}");
    // An adapter trained on GPT-2, given to Llama.
    common::run(
        &finetune(&out, "tiny-gpt2", "ddp", r#"["c_attn"]"#, &[]),
        1,
        false,
        None,
    );
    let adapter = format!(
        "lora.adapter={:?}",
        out.join("adapter").display().to_string()
    );
    let other = tmp.path().join("other");
    let msg = error_of(&finetune(
        &other,
        "tiny-llama",
        "ddp",
        r#"["q_proj"]"#,
        &[&adapter],
    ));
    assert!(msg.contains("which this model lacks"), "{msg}");
    assert!(msg.contains("transformer.h.0.attn.c_attn"), "{msg}");
    // No base.
    let err = Recipe::load(
        None,
        &[
            "lora.r=2".into(),
            "lora.alpha=4.0".into(),
            "lora.targets=[\"c_attn\"]".into(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("set model.from"), "{err}");
}

/// Adapters compose with the memory policies: kiln's remat budget gives the same losses as no
/// remat (exact), bf16 compute reaches f32's validation loss within 2%.
#[test]
fn finetune_composes_with_remat_and_precision() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, extra: &[&str]| {
        common::run(
            &finetune(
                &tmp.path().join(name),
                "tiny-gpt2",
                "ddp",
                r#"["c_attn"]"#,
                extra,
            ),
            1,
            false,
            None,
        )
    };
    let off = run("off", &[]);
    let remat = run("remat", &[r#"train.remat="budget=64KiB""#]);
    assert_eq!(remat.losses, off.losses);
    let bf16 = run("bf16", &[r#"train.precision="bf16""#]);
    let (a, b) = (off.val_loss.unwrap(), bf16.val_loss.unwrap());
    assert!((a - b).abs() <= 0.02 * a, "f32 {a} vs bf16 {b}");
    assert_ne!(bf16.losses, off.losses, "bf16 computed in f32?");
    // With dropout: a recomputed adapter product reuses its forward's mask, so a remat budget
    // changes nothing here either.
    let d = "lora.dropout=0.3";
    let d_off = run("d-off", &[d]);
    let d_remat = run("d-remat", &[d, r#"train.remat="budget=64KiB""#]);
    assert_eq!(d_remat.losses, d_off.losses);
    assert_ne!(d_off.losses, off.losses);
    // QLoRA too: exact under a remat budget, within 2% in bf16.
    let q = "lora.qlora=true";
    let q_off = run("q-off", &[q]);
    let q_remat = run("q-remat", &[q, r#"train.remat="budget=64KiB""#]);
    assert_eq!(q_remat.losses, q_off.losses);
    let q_bf16 = run("q-bf16", &[q, r#"train.precision="bf16""#]);
    let (a, b) = (q_off.val_loss.unwrap(), q_bf16.val_loss.unwrap());
    assert!((a - b).abs() <= 0.02 * a, "f32 {a} vs bf16 {b}");
}
