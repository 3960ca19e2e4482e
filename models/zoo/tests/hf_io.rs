//! Loading and saving Hugging Face checkpoints, and the errors for bad ones: one generic suite,
//! run for every model of the zoo (through `kiln_hf::Pretrained`).

use burn::tensor::TensorData;
use kiln_gpt2::Gpt2;
use kiln_hf::{HfError, Pretrained, SafetensorsFile, WEIGHTS_FILE};
use kiln_llama::Llama;
use kiln_model::{CausalLm, GenerateConfig, Sampling};
use std::path::{Path, PathBuf};

/// The backend under test.
type TB = burn::backend::Flex;

/// A model of the suite: its fixture, and a tensor to remove or reshape with its HF shape.
trait Case: Pretrained<TB> + CausalLm<TB> + std::fmt::Debug {
    const FIXTURE: &'static str;
    const VICTIM: &'static str;
    const VICTIM_SHAPE: [usize; 2];
}

impl Case for Gpt2<TB> {
    const FIXTURE: &'static str = "tiny-gpt2";
    const VICTIM: &'static str = "transformer.h.1.mlp.c_fc.weight";
    const VICTIM_SHAPE: [usize; 2] = [64, 256];
}

impl Case for Llama<TB> {
    const FIXTURE: &'static str = "tiny-llama";
    const VICTIM: &'static str = "model.layers.1.mlp.up_proj.weight";
    const VICTIM_SHAPE: [usize; 2] = [128, 64];
}

fn fixture<M: Case>() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../hf/tests/fixtures")
        .join(M::FIXTURE)
}

fn temp_dir<M: Case>(test: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("kiln-{}-{test}-{}", M::FIXTURE, std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn load<M: Case>(dir: &Path) -> Result<M, HfError> {
    M::from_pretrained(dir, &Default::default())
}

fn read_all(path: &Path) -> Vec<(String, TensorData)> {
    let file = SafetensorsFile::open(path, "weights").expect("readable");
    file.names()
        .into_iter()
        .map(|name| {
            let data = file.float(&name, None).expect("float tensor");
            (name, data)
        })
        .collect()
}

/// A model dir whose weights are the fixture's with `edit` applied.
fn edited_dir<M: Case>(test: &str, edit: impl FnOnce(&mut Vec<(String, TensorData)>)) -> PathBuf {
    let dir = temp_dir::<M>(test);
    std::fs::copy(fixture::<M>().join("config.json"), dir.join("config.json"))
        .expect("copy config");
    let mut tensors = read_all(&fixture::<M>().join(WEIGHTS_FILE));
    edit(&mut tensors);
    kiln_hf::write_tensors(dir.join(WEIGHTS_FILE), &tensors).expect("write weights");
    dir
}

fn round_trip_is_identical_and_in_hf_names_and_shapes<M: Case>() {
    let model: M = load(&fixture::<M>()).expect("fixture loads");
    let dir = temp_dir::<M>("round-trip");
    model
        .save_pretrained(&M::read_config(&fixture::<M>()).expect("config"), &dir)
        .expect("save");
    let original =
        SafetensorsFile::open(fixture::<M>().join(WEIGHTS_FILE), "original").expect("open");
    let saved = SafetensorsFile::open(dir.join(WEIGHTS_FILE), "saved").expect("open");
    assert_eq!(saved.names(), original.names(), "tensor names");
    for name in original.names() {
        assert_eq!(saved.shape(&name), original.shape(&name), "shape of {name}");
        assert_eq!(
            saved
                .float(&name, None)
                .expect("saved")
                .to_vec::<f32>()
                .expect("f32"),
            original
                .float(&name, None)
                .expect("original")
                .to_vec::<f32>()
                .expect("f32"),
            "values of {name}"
        );
    }
    let reloaded: M = load(&dir).expect("saved dir loads");
    assert_eq!(
        kiln_hf::hf_tensors(&reloaded),
        kiln_hf::hf_tensors(&model),
        "reloaded parameters"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

fn missing_tensor_is_named_with_its_shape<M: Case>() {
    let dir = edited_dir::<M>("missing", |t| t.retain(|(name, _)| name != M::VICTIM));
    let err = load::<M>(&dir).expect_err("a tensor is missing");
    let msg = err.to_string();
    assert!(matches!(err, HfError::MissingTensor { .. }), "{err:?}");
    let shape = format!("{:?}", M::VICTIM_SHAPE);
    assert!(msg.contains(M::VICTIM) && msg.contains(&shape), "{msg}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}

fn misshaped_tensor_is_named_with_both_shapes<M: Case>() {
    let [rows, cols] = M::VICTIM_SHAPE;
    let dir = edited_dir::<M>("misshaped", |t| {
        let entry = t
            .iter_mut()
            .find(|(name, _)| name == M::VICTIM)
            .expect("victim");
        entry.1 = TensorData::new(vec![0.0f32; rows * (cols - 1)], [rows, cols - 1]);
    });
    let err = load::<M>(&dir).expect_err("a tensor is mis-shaped");
    let msg = err.to_string();
    assert!(matches!(err, HfError::ShapeMismatch { .. }), "{err:?}");
    let (found, expected) = (
        format!("{:?}", [rows, cols - 1]),
        format!("{:?}", M::VICTIM_SHAPE),
    );
    assert!(
        msg.contains(M::VICTIM) && msg.contains(&found) && msg.contains(&expected),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

fn missing_config_is_a_clear_error<M: Case>() {
    let dir = temp_dir::<M>("no-config");
    std::fs::copy(fixture::<M>().join(WEIGHTS_FILE), dir.join(WEIGHTS_FILE)).expect("copy weights");
    let err = load::<M>(&dir).expect_err("no config.json");
    assert!(matches!(err, HfError::MissingFile { .. }), "{err:?}");
    assert!(err.to_string().contains("config.json is missing"), "{err}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}

fn generation_is_deterministic_and_seeded<M: Case>() {
    let model: M = load(&fixture::<M>()).expect("fixture loads");
    let device = Default::default();
    let prompt = kiln_hf::ByteTokenizer.encode("kiln");
    let run = |sampling| {
        let config = GenerateConfig {
            max_new_tokens: 6,
            sampling,
            stop_token: None,
        };
        kiln_model::generate::<TB, _>(&model, &prompt, &config, &device)
    };
    let greedy = run(Sampling::Greedy);
    assert_eq!(greedy.len(), 6);
    assert!(greedy.iter().all(|&t| (t as usize) < model.vocab_size()));
    assert_eq!(greedy, run(Sampling::Greedy));
    let hot = |seed| Sampling::Temperature {
        temperature: 1.0,
        seed,
    };
    assert_eq!(run(hot(1)), run(hot(1)), "same seed, same tokens");
    assert_ne!(run(hot(1)), run(hot(2)), "another seed, other tokens");
}

/// One `#[test]` per (model, check).
macro_rules! suite {
    ($($model:ident: $ty:ty),*) => {$(
        mod $model {
            use super::*;
            #[test]
            fn round_trip_is_identical_and_in_hf_names_and_shapes() {
                super::round_trip_is_identical_and_in_hf_names_and_shapes::<$ty>();
            }
            #[test]
            fn missing_tensor_is_named_with_its_shape() {
                super::missing_tensor_is_named_with_its_shape::<$ty>();
            }
            #[test]
            fn misshaped_tensor_is_named_with_both_shapes() {
                super::misshaped_tensor_is_named_with_both_shapes::<$ty>();
            }
            #[test]
            fn missing_config_is_a_clear_error() {
                super::missing_config_is_a_clear_error::<$ty>();
            }
            #[test]
            fn generation_is_deterministic_and_seeded() {
                super::generation_is_deterministic_and_seeded::<$ty>();
            }
        }
    )*};
}

suite!(gpt2: Gpt2<TB>, llama: Llama<TB>);
