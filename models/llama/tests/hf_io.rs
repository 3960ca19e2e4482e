//! Llama-specific checkpoint handling (the suite shared by every model is in kiln-zoo's tests).

use burn::tensor::TensorData;
use kiln_hf::{HfError, Pretrained, SafetensorsFile, WEIGHTS_FILE};
use kiln_llama::{Llama as Model, LlamaConfig as Config};
use std::path::{Path, PathBuf};

/// The backend under test.
type TB = burn::backend::Flex;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../hf/tests/fixtures/tiny-llama")
}

fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-tiny-llama-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn load(dir: &Path) -> Result<Model<TB>, HfError> {
    Model::<TB>::from_pretrained(dir, &Default::default())
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
