//! Snapshots in one process (ranks as threads): an interrupted run resumes bit for bit, a
//! snapshot reshards across world sizes and strategies, and an export is the trained model.

use burn::backend::Flex;
use burn::prelude::ElementConversion;
use burn::tensor::{Int, Tensor, TensorData};
use common::{recipe, run};
use kiln_hf::Pretrained;
use kiln_model::causal_lm_loss;
use kiln_train::data::Corpus;
use std::path::Path;

mod common;

#[test]
fn an_interrupted_run_resumes_bit_for_bit() {
    // Three ranks make every shard uneven (and need a batch they divide).
    for (strategy, ranks, batch) in [("ddp", 2, 4), ("zero3", 2, 4), ("zero1", 3, 6)] {
        let dir = tempfile::tempdir().unwrap();
        let b = format!("train.batch_size={batch}");
        let whole = run(
            &recipe(&dir.path().join("a"), strategy, &[&b]),
            ranks,
            false,
            None,
        );
        let r = recipe(&dir.path().join("b"), strategy, &[&b]);
        let first = run(&r, ranks, false, Some(3));
        let rest = run(&r, ranks, true, None);
        assert_eq!(first.last_step, 3);
        assert_eq!(rest.first_step, 3);
        let joined: Vec<f64> = first.losses.iter().chain(&rest.losses).copied().collect();
        assert_eq!(joined, whole.losses, "{strategy} x{ranks}");
        assert_eq!(rest.val_loss, whole.val_loss, "{strategy} x{ranks}");
        assert!(whole.losses[5] < whole.losses[0], "{:?}", whole.losses);
    }
}

#[test]
fn a_snapshot_reshards_across_world_sizes_and_strategies() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    // The reference: ZeRO-3 on 4 ranks throughout.
    let whole = run(
        &recipe(&dir.path().join("ref"), "zero3", &[]),
        4,
        false,
        None,
    );
    // ZeRO-3 x4 to step 3, ZeRO-2 x2 to step 4, one rank (DDP) to step 5, hybrid 2x2 to the end.
    run(&recipe(&out, "zero3", &[]), 4, false, Some(3));
    let at2 = run(&recipe(&out, "zero2", &[]), 2, true, Some(4));
    let at1 = run(&recipe(&out, "ddp", &[]), 1, true, Some(5));
    let hybrid = run(&recipe(&out, "hybrid:2", &[]), 4, true, None);
    let resharded = [at2.losses[0], at1.losses[0], hybrid.losses[0]];
    for (got, want) in resharded.iter().zip(&whole.losses[3..]) {
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "resharded losses {resharded:?} vs {:?}",
            &whole.losses[3..]
        );
    }
    let (v, w) = (hybrid.val_loss.unwrap(), whole.val_loss.unwrap());
    assert!((v - w).abs() <= 1e-5 * w, "{v} vs {w}");
}

#[test]
fn an_export_is_the_trained_model_on_plain_burn() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    for (kind, strategy) in [("gpt2", "zero3"), ("llama", "zero2")] {
        let r = recipe(&out, strategy, &[&format!("model.kind={kind:?}")]);
        let summary = run(&r, 2, false, None);
        let hf = dir.path().join(format!("hf-{kind}"));
        kiln_train::export(&out, &hf).unwrap();
        // The exported directory, loaded by the model crate on plain Flex (no kiln), gives the
        // validation loss the run reported.
        let corpus = Corpus::from_recipe(
            &r.data,
            r.train.seed,
            r.train.seq_len,
            &kiln_hf::Tokenizer::Bytes,
        )
        .unwrap();
        let batches = kiln_train::validation_batches(&corpus, &r.train, 0, 1);
        let device = Default::default();
        let loss_of = |logits: Tensor<Flex, 3>, b: &kiln_train::data::Batch| -> f64 {
            let y = Tensor::<Flex, 2, Int>::from_data(
                TensorData::new(b.targets.clone(), [b.rows, b.seq_len]),
                &device,
            );
            causal_lm_loss(logits, y).into_scalar().elem()
        };
        let mut total = 0.0;
        for b in &batches {
            let x = Tensor::<Flex, 2, Int>::from_data(
                TensorData::new(b.inputs.clone(), [b.rows, b.seq_len]),
                &device,
            );
            let logits = match kind {
                "gpt2" => kiln_model::CausalLm::forward(
                    &kiln_gpt2::Gpt2::<Flex>::from_pretrained(&hf, &device).unwrap(),
                    x,
                ),
                _ => kiln_model::CausalLm::forward(
                    &kiln_llama::Llama::<Flex>::from_pretrained(&hf, &device).unwrap(),
                    x,
                ),
            };
            total += loss_of(logits, b);
        }
        let exported = total / batches.len() as f64;
        let reported = summary.val_loss.unwrap();
        assert!(
            (exported - reported).abs() <= 1e-5 * reported,
            "{kind}: exported model's loss {exported} vs the run's {reported}"
        );

        // `--dtype bf16`: every weight is the f32 export's rounded to bf16, and the config says so.
        let hf16 = dir.path().join(format!("hf-{kind}-bf16"));
        kiln_train::export_as(&out, &hf16, burn::tensor::FloatDType::BF16).unwrap();
        let open =
            |d: &Path| kiln_hf::SafetensorsFile::open(d.join("model.safetensors"), "w").unwrap();
        let (full, half) = (open(&hf), open(&hf16));
        assert_eq!(full.names(), half.names());
        for name in full.names() {
            let want: Vec<f32> = full
                .float(&name, None)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
                .into_iter()
                .map(|x| burn::tensor::bf16::from_f32(x).to_f32())
                .collect();
            let got = half.float(&name, None).unwrap().to_vec::<f32>().unwrap();
            assert_eq!(got, want, "{kind}: {name} in bf16");
        }
        let size = |d: &Path| {
            std::fs::metadata(d.join("model.safetensors"))
                .unwrap()
                .len()
        };
        assert!(
            size(&hf16) * 2 < size(&hf) + 4096,
            "bf16 weights take half the bytes"
        );
        let config = std::fs::read_to_string(hf16.join("config.json")).unwrap();
        assert!(config.contains("\"torch_dtype\": \"bfloat16\""), "{config}");
    }
}

#[test]
fn a_hugging_face_checkpoint_is_the_starting_point() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/hf/tests/fixtures");
    for (kind, strategy) in [("gpt2", "zero3"), ("llama", "ddp")] {
        let dir = tempfile::tempdir().unwrap();
        let from = fixtures.join(format!("tiny-{kind}"));
        let r = recipe(
            dir.path(),
            strategy,
            &[&format!("model.from={:?}", from.display().to_string())],
        );
        let summary = run(&r, 2, false, Some(1));
        // Step 1's loss is the checkpoint's own loss on step 1's batch, computed on plain Flex.
        let corpus = Corpus::from_recipe(
            &r.data,
            r.train.seed,
            r.train.seq_len,
            &kiln_hf::Tokenizer::Bytes,
        )
        .unwrap();
        let mut rng = kiln_train::data::SplitMix64(kiln_train::data::mix(r.train.seed));
        let b = kiln_train::data::batch(&corpus.train, &mut rng, 4, 16, 0, 1);
        let device = Default::default();
        let x = Tensor::<Flex, 2, Int>::from_data(TensorData::new(b.inputs, [4, 16]), &device);
        let y = Tensor::<Flex, 2, Int>::from_data(TensorData::new(b.targets, [4, 16]), &device);
        let logits = match kind {
            "gpt2" => kiln_model::CausalLm::forward(
                &kiln_gpt2::Gpt2::<Flex>::from_pretrained(&from, &device).unwrap(),
                x,
            ),
            _ => kiln_model::CausalLm::forward(
                &kiln_llama::Llama::<Flex>::from_pretrained(&from, &device).unwrap(),
                x,
            ),
        };
        let want: f64 = causal_lm_loss(logits, y).into_scalar().elem();
        let got = summary.losses[0];
        assert!((got - want).abs() <= 1e-5 * want, "{kind}: {got} vs {want}");
    }
}

#[test]
fn every_strategy_trains_like_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let one = run(&recipe(&dir.path().join("one"), "ddp", &[]), 1, false, None);
    for (strategy, ranks) in [
        ("ddp", 4),
        ("zero1", 2),
        ("zero2", 4),
        ("zero3", 4),
        ("hybrid:2", 4),
    ] {
        let r = recipe(&dir.path().join(strategy), strategy, &[]);
        let n = run(&r, ranks, false, None);
        for (step, (a, b)) in n.losses.iter().zip(&one.losses).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * b,
                "{strategy} x{ranks}, step {}: {a} vs {b} on one rank",
                step + 1
            );
        }
        let (a, b) = (n.val_loss.unwrap(), one.val_loss.unwrap());
        assert!((a - b).abs() <= 1e-5 * b, "{strategy} x{ranks}: {a} vs {b}");
    }
}
