//! `kiln finetune` and `kiln verify-lora` as a user runs them: a short QLoRA fine-tune under
//! `kiln launch` (two processes, ZeRO-3) writing PEFT adapters and a merged model, resumed;
//! LoRA and QLoRA fine-tunes over pipeline stages equal to one rank's; PEFT's numbers on the fixtures; bad input
//! named.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{KILN, launch, run_ok};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/hf/tests/fixtures")
        .join(name)
}

fn kiln(args: &[String]) -> (bool, String) {
    let out = Command::new(KILN).args(args).output().expect("kiln runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

fn finetune_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "finetune",
        "--base",
        &fixture("tiny-llama").display().to_string(),
        "--out",
        &out.display().to_string(),
        "--steps",
        "4",
        "--set",
        "train.seq_len=16",
        "--set",
        "train.batch_size=4",
        "--set",
        "train.warmup_steps=1",
        "--set",
        "train.eval_batches=1",
        "--set",
        "train.sample_chars=8",
        "--set",
        "data.synthetic_chars=20000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

#[test]
fn finetune_under_launch_writes_peft_adapters_and_a_merged_model() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, merged) = (tmp.path().join("run"), tmp.path().join("merged"));
    let text = run_ok(launch(
        2,
        finetune_args(
            &out,
            &[
                "--lora-r",
                "2",
                "--strategy",
                "zero3",
                "--qlora",
                "--merge-into",
                &merged.display().to_string(),
            ],
        ),
    ));
    for line in [
        "kiln finetune: llama",
        "LoRA r=2 alpha=4 on 8 weights",
        // tiny-llama: q,k,v,o, gate, up, down in each of 2 layers (lm_head stays f32).
        "QLoRA: 14 linear weights in NF4, the base takes ",
        "step 0: validation loss",
        "validation loss ",
        "(before) -> ",
        "adapters (PEFT): ",
        "merged model: ",
        "sample before (prompt|generated):",
        "tokens are bytes: ",
        "has no tokenizer.json",
    ] {
        assert!(text.contains(line), "no '{line}' in:\n{text}");
    }
    assert!(out.join("adapter/adapter_config.json").is_file());
    assert!(out.join("adapter/adapter_model.safetensors").is_file());
    assert!(merged.join("config.json").is_file());
    assert!(merged.join("model.safetensors").is_file());
    // Resuming a finished run has nothing left to do, and says so.
    let (ok, text) = kiln(&finetune_args(&out, &["--lora-r", "2", "--resume"]));
    assert!(ok, "{text}");
    assert!(text.contains("no steps to run"), "{text}");
}

/// The largest difference between two safetensors files' tensors (same names and shapes).
fn max_difference(a: &Path, b: &Path) -> f32 {
    let (a, b) = (
        kiln_hf::SafetensorsFile::open(a, "kiln's output").unwrap(),
        kiln_hf::SafetensorsFile::open(b, "kiln's output").unwrap(),
    );
    let mut names = a.names();
    names.sort();
    let mut theirs = b.names();
    theirs.sort();
    assert_eq!(names, theirs);
    let mut worst = 0f32;
    for name in names {
        let (x, y) = (a.float(&name, None).unwrap(), b.float(&name, None).unwrap());
        assert_eq!(x.shape, y.shape, "{name}");
        let (x, y) = (x.into_vec::<f32>().unwrap(), y.into_vec::<f32>().unwrap());
        for (p, q) in x.iter().zip(&y) {
            worst = worst.max((p - q).abs());
        }
    }
    worst
}

/// LoRA over pipeline stages: GPT-2 (its frozen embedding tied to the head, so on both stages)
/// fine-tuned as pp 2 x dp 2 under ZeRO-3 (ranks as threads), and QLoRA on Llama as pp 2 (each
/// stage holds its units' 4-bit weights), write the adapters and merged model one rank
/// writes, after the same losses.
#[test]
fn a_pipelined_finetune_equals_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let path = |name: &str| tmp.path().join(name);
    let pp_zero3 = [
        "--ranks",
        "4",
        "--pp",
        "2",
        "--microbatches",
        "2",
        "--strategy",
        "zero3",
    ];
    let pp = ["--ranks", "2", "--pp", "2", "--microbatches", "2"];
    for (base, what, adapters, pipelined, trainable) in [
        (
            "tiny-gpt2",
            "lora",
            &[][..],
            &pp_zero3[..],
            "1.5k trainable parameters (1.27% of the base's 120.6k)",
        ),
        (
            "tiny-llama",
            "qlora",
            &["--qlora"][..],
            &pp[..],
            "QLoRA: 14 linear weights in NF4",
        ),
    ] {
        let base = fixture(base).display().to_string();
        let run = |name: &str, extra: &[&str]| {
            let merged = path(&format!("{name}-merged")).display().to_string();
            let mut args = finetune_args(&path(name), &["--lora-r", "2", "--merge-into", &merged]);
            let at = args.iter().position(|a| a == "--base").unwrap();
            args[at + 1] = base.clone();
            args.extend(adapters.iter().chain(extra).map(|s| s.to_string()));
            let (ok, text) = kiln(&args);
            assert!(ok, "{text}");
            text
        };
        let (one, pp) = (format!("{what}-one"), format!("{what}-pp"));
        let one_text = run(&one, &[]);
        let pp_text = run(&pp, pipelined);
        for needle in ["pipeline: 2 stages x ", "pipeline bubble: ", trainable] {
            assert!(pp_text.contains(needle), "no '{needle}' in:\n{pp_text}");
        }
        let losses = |text: &str| -> Vec<String> {
            text.lines()
                .filter(|l| l.contains("validation loss") || l.contains("training loss"))
                .map(String::from)
                .collect()
        };
        assert_eq!(losses(&pp_text), losses(&one_text), "{what}: {pp_text}");
        let adapter = |run: &str| path(run).join("adapter/adapter_model.safetensors");
        let merged = |run: &str| path(&format!("{run}-merged")).join("model.safetensors");
        for (file, of) in [
            ("adapters", &adapter as &dyn Fn(&str) -> _),
            ("merged model", &merged),
        ] {
            let worst = max_difference(&of(&one), &of(&pp));
            assert!(worst < 1e-6, "{what}: the {file} differ by {worst}");
        }
    }
}

#[test]
fn bad_finetune_input_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let (ok, text) = kiln(&["finetune".into(), "--steps".into(), "2".into()]);
    assert!(
        !ok && text.contains("needs a pretrained base: --base DIR"),
        "{text}"
    );
    let (ok, text) = kiln(&finetune_args(&out, &["--targets", "c_attn"]));
    assert!(!ok && text.contains("'c_attn' matches no weight"), "{text}");
    assert!(text.contains("model.layers.0.self_attn.q_proj"), "{text}");
    let (ok, text) = kiln(&finetune_args(&out, &["--lora-r", "1000"]));
    assert!(!ok && text.contains("r = 1000 does not fit"), "{text}");
    let missing = tmp.path().join("nowhere");
    let (ok, text) = kiln(&finetune_args(
        &out,
        &["--adapter", &missing.display().to_string()],
    ));
    assert!(!ok && text.contains("nowhere"), "{text}");
    // A recipe with [lora] is fine-tuning's.
    let from = format!(
        "model.from={:?}",
        fixture("tiny-llama").display().to_string()
    );
    let mut args = vec!["train".to_string()];
    for set in [
        from.as_str(),
        "lora.r=2",
        "lora.alpha=4.0",
        r#"lora.targets=["q_proj"]"#,
    ] {
        args.extend(["--set".to_string(), set.to_string()]);
    }
    let (ok, text) = kiln(&args);
    assert!(
        !ok && text.contains("fine-tune with `kiln finetune`"),
        "{text}"
    );
}

#[test]
fn verify_lora_matches_peft_on_the_fixtures() {
    for (name, strategy, ranks) in [
        ("lora-tiny-gpt2", "single", "1"),
        ("lora-tiny-llama", "zero2", "2"),
    ] {
        let (ok, text) = kiln(&[
            "verify-lora".into(),
            fixture(name).display().to_string(),
            "--strategy".into(),
            strategy.into(),
            "--ranks".into(),
            ranks.into(),
        ]);
        assert!(ok, "{text}");
        assert!(text.contains("all 8 quantities within tolerance"), "{text}");
    }
}
