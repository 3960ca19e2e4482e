//! Loading and saving Hugging Face checkpoints, and the errors for bad ones.

use burn::tensor::TensorData;
use kiln_hf::{CausalLm, GenerateConfig, HfError, SafetensorsFile, Sampling, WEIGHTS_FILE};
use kiln_llama::{Llama as Model, LlamaConfig as Config};
use std::path::{Path, PathBuf};

/// The backend under test.
type TB = burn::backend::Flex;

const FIXTURE: &str = "tiny-llama";
/// A tensor of the fixture to remove or reshape.
const VICTIM: &str = "model.layers.1.mlp.up_proj.weight";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../hf/tests/fixtures")
        .join(FIXTURE)
}

fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-{FIXTURE}-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn load(dir: &Path) -> Result<Model<TB>, HfError> {
    Model::<TB>::from_pretrained(dir, &Default::default())
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
fn edited_dir(test: &str, edit: impl FnOnce(&mut Vec<(String, TensorData)>)) -> PathBuf {
    let dir = temp_dir(test);
    std::fs::copy(fixture().join("config.json"), dir.join("config.json")).expect("copy config");
    let mut tensors = read_all(&fixture().join(WEIGHTS_FILE));
    edit(&mut tensors);
    kiln_hf::write_tensors(dir.join(WEIGHTS_FILE), &tensors).expect("write weights");
    dir
}

#[test]
fn round_trip_is_identical_and_in_hf_names_and_shapes() {
    let model = load(&fixture()).expect("fixture loads");
    let dir = temp_dir("round-trip");
    model
        .save_pretrained(&Config::from_dir(fixture()).expect("config"), &dir)
        .expect("save");
    let original = SafetensorsFile::open(fixture().join(WEIGHTS_FILE), "original").expect("open");
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
    let reloaded = load(&dir).expect("saved dir loads");
    assert_eq!(
        kiln_hf::hf_tensors(&reloaded),
        kiln_hf::hf_tensors(&model),
        "reloaded parameters"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn missing_tensor_is_named_with_its_shape() {
    let dir = edited_dir("missing", |t| t.retain(|(name, _)| name != VICTIM));
    let err = load(&dir).expect_err("a tensor is missing");
    let msg = err.to_string();
    assert!(matches!(err, HfError::MissingTensor { .. }), "{err:?}");
    assert!(msg.contains(VICTIM) && msg.contains("[128, 64]"), "{msg}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn misshaped_tensor_is_named_with_both_shapes() {
    let dir = edited_dir("misshaped", |t| {
        let entry = t
            .iter_mut()
            .find(|(name, _)| name == VICTIM)
            .expect("victim");
        entry.1 = TensorData::new(vec![0.0f32; 128 * 63], [128, 63]);
    });
    let err = load(&dir).expect_err("a tensor is mis-shaped");
    let msg = err.to_string();
    assert!(matches!(err, HfError::ShapeMismatch { .. }), "{err:?}");
    assert!(
        msg.contains(VICTIM) && msg.contains("[128, 63]") && msg.contains("[128, 64]"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn missing_config_is_a_clear_error() {
    let dir = temp_dir("no-config");
    std::fs::copy(fixture().join(WEIGHTS_FILE), dir.join(WEIGHTS_FILE)).expect("copy weights");
    let err = load(&dir).expect_err("no config.json");
    assert!(matches!(err, HfError::MissingFile { .. }), "{err:?}");
    assert!(err.to_string().contains("config.json is missing"), "{err}");
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn generation_is_deterministic_and_seeded() {
    let model = load(&fixture()).expect("fixture loads");
    let device = Default::default();
    let prompt = kiln_hf::ByteTokenizer.encode("kiln");
    let run = |sampling| {
        let config = GenerateConfig {
            max_new_tokens: 6,
            sampling,
            stop_token: None,
        };
        kiln_hf::generate::<TB, _>(&model, &prompt, &config, &device)
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

#[test]
fn tied_head_round_trips_without_lm_head() {
    let mut config = Config::from_dir(fixture()).expect("config");
    config.tie_word_embeddings = true;
    config.num_key_value_heads = Some(1);
    let device = Default::default();
    let model = config.init::<TB>(&device);
    assert!(model.lm_head.is_none());
    let dir = temp_dir("tied");
    model.save_pretrained(&config, &dir).expect("save");
    let saved = SafetensorsFile::open(dir.join(WEIGHTS_FILE), "saved").expect("open");
    assert!(!saved.names().contains(&"lm_head.weight".to_string()));
    assert_eq!(
        saved.shape("model.layers.0.self_attn.k_proj.weight"),
        Some(vec![16, 64])
    );
    let reloaded = load(&dir).expect("reload");
    assert_eq!(kiln_hf::hf_tensors(&reloaded), kiln_hf::hf_tensors(&model));
    let ids = burn::tensor::Tensor::<TB, 2, burn::tensor::Int>::from_data(
        TensorData::new(vec![1i64, 2, 3], [1, 3]),
        &device,
    );
    let logits = reloaded
        .forward(ids)
        .into_data()
        .to_vec::<f32>()
        .expect("f32");
    assert_eq!(logits.len(), 3 * 256);
    assert!(logits.iter().all(|v| v.is_finite()));
    std::fs::remove_dir_all(&dir).expect("clean up");
}
