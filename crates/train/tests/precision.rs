//! `train.precision`: the default recipe trained in bf16 and in f16 (with its loss scale)
//! reaches the validation loss of f32 within 2%, and a snapshot keeps f32 parameters and the
//! loss scale.

use burn::backend::Flex;
use kiln_train::{Recipe, RunOptions, train_threads};

mod common;

fn run(out: &std::path::Path, precision: &str) -> kiln_train::Summary {
    let recipe = Recipe::load(
        None,
        &[
            format!("train.precision={precision:?}"),
            "train.sample_chars=0".into(),
            "output.snapshot_every=0".into(),
            format!("output.dir={:?}", out.display().to_string()),
        ],
    )
    .unwrap();
    train_threads::<Flex>(&recipe, 1, RunOptions::default()).unwrap()
}

#[test]
fn bf16_and_f16_train_the_default_recipe_within_2_percent_of_f32() {
    let dir = tempfile::tempdir().unwrap();
    let f32s = run(&dir.path().join("f32"), "f32");
    let v32 = f32s.val_loss.expect("validated");
    assert_eq!(f32s.loss_scale, None, "f32 has no loss scale");
    for precision in ["bf16", "f16"] {
        let s = run(&dir.path().join(precision), precision);
        let v = s.val_loss.expect("validated");
        let moved = s
            .losses
            .iter()
            .zip(&f32s.losses)
            .map(|(a, b)| (a - b).abs() / b)
            .fold(0.0, f64::max);
        println!(
            "{precision}: validation loss {v:.6} vs f32 {v32:.6} ({:+.3}%), training losses up \
             to {moved:.2e} from f32's, loss scale {:?}, {} step(s) skipped",
            100.0 * (v - v32) / v32,
            s.loss_scale,
            s.skipped_steps
        );
        assert!(
            (v - v32).abs() / v32 <= 0.02,
            "{precision}: {v} vs f32 {v32}"
        );
        assert_ne!(s.losses, f32s.losses, "{precision} trained exactly as f32");
        assert_eq!(s.loss_scale.is_some(), precision == "f16");
        // The snapshot's parameters are f32 (the masters) and f16's scale is kept for a resume.
        let snap = s.snapshot.expect("a final snapshot");
        let mut files = 0;
        for entry in std::fs::read_dir(&snap).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "safetensors") {
                let bytes = std::fs::read(&path).unwrap();
                let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
                let header = std::str::from_utf8(&bytes[8..8 + len]).unwrap();
                assert!(
                    header.contains("\"F32\"") && !header.contains("F16"),
                    "{header}"
                );
                files += 1;
            }
        }
        assert!(files > 0, "no tensors in {}", snap.display());
        let manifest = std::fs::read_to_string(snap.join("manifest.json")).unwrap();
        assert_eq!(
            manifest.contains("\"loss_scale\": ["),
            precision == "f16",
            "{manifest}"
        );
    }
}

/// f16's loss scale is part of the training state: a run stopped after a snapshot and resumed
/// continues the scale and its count of good steps (here doubling every 2 steps), with the
/// same losses as a run that was never stopped.
#[test]
fn an_f16_run_resumes_its_loss_scale() {
    let dir = tempfile::tempdir().unwrap();
    let f16 = [
        "train.precision=\"f16\"",
        "train.loss_scale=1024.0",
        "train.loss_scale_growth_interval=2",
        "output.snapshot_every=3",
    ];
    let recipe = |out: &str| common::recipe(&dir.path().join(out), "ddp", &f16);
    let go =
        |r: &Recipe, resume: bool, stop_after: Option<usize>| common::run(r, 2, resume, stop_after);
    let whole = go(&recipe("whole"), false, None);
    let r = recipe("cut");
    let first = go(&r, false, Some(3));
    let rest = go(&r, true, None);
    assert_eq!(whole.skipped_steps, 0);
    // 1024 doubled after steps 2, 4 and 6.
    assert_eq!(whole.loss_scale, Some(8192.0));
    assert_eq!(first.loss_scale, Some(2048.0));
    assert_eq!(
        rest.loss_scale, whole.loss_scale,
        "the resumed run lost its loss scale"
    );
    assert_eq!([first.losses, rest.losses].concat(), whole.losses);
}
