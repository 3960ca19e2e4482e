//! kiln's LoRA against PEFT on the fixtures `lora-tiny-gpt2` and `lora-tiny-llama` (made by
//! `models/hf/tests/fixtures/make_lora_fixtures.py`): the forward of base + adapters, the loss,
//! each adapter's gradient norm, 8 AdamW steps, the final adapters and the merged model; on one
//! device and under ZeRO-3 over 2 ranks; and adapters kiln writes named and shaped as PEFT's.

use burn::module::AutodiffModule;
use kiln::{Flex, Train};
use kiln_comm::{LocalGroup, ProcessGroup, spawn_ranks};
use kiln_gpt2::Gpt2;
use kiln_hf::{HfNaming, Pretrained, SafetensorsFile};
use kiln_llama::Llama;
use kiln_lora::{ADAPTER_WEIGHTS, Check, Lora, load_peft, verify_lora};
use kiln_model::CausalLm;
use kiln_shard::{ShardConfig, Strategy};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

type B = Train<Flex>;

/// One test at a time: the sharded runs use thread ranks and the tests share Flex.
static SERIAL: Mutex<()> = Mutex::new(());

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/hf/tests/fixtures")
        .join(name)
}

fn with_adapters<M: Pretrained<B>>(name: &str) -> Lora<B, M> {
    let dir = fixture(name);
    let device = Default::default();
    let base = M::from_pretrained(dir.join("base"), &device).expect("fixture base");
    load_peft(base, &dir.join("adapter_init"), M::hf_tensor, &device).expect("fixture adapter")
}

fn assert_all_pass(label: &str, checks: &[Check]) {
    for c in checks {
        println!("{label}: {c}");
    }
    let failed: Vec<_> = checks.iter().filter(|c| !c.passed()).collect();
    assert!(failed.is_empty(), "{label}: {failed:#?}");
}

fn single<M>(name: &str)
where
    M: Pretrained<B> + CausalLm<B> + AutodiffModule<B> + HfNaming,
    Lora<B, M>: AutodiffModule<B>,
{
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = with_adapters::<M>(name);
    let checks = verify_lora::<Flex, B, M>(model, &fixture(name), &Default::default()).unwrap();
    assert_all_pass(name, &checks);
}

fn zero3_x2<M>(name: &str)
where
    M: Pretrained<B> + CausalLm<B> + AutodiffModule<B> + HfNaming + 'static,
    Lora<B, M>: AutodiffModule<B>,
{
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let results = spawn_ranks(2, |group: LocalGroup| {
        let group: Arc<dyn ProcessGroup> = Arc::new(group);
        let model = with_adapters::<M>(name);
        let whole = kiln_shard::account::param_bytes::<Flex, B, _>(&model);
        let model = kiln_shard::shard(model, group, ShardConfig::new(Strategy::Zero3)).unwrap();
        // The frozen base is sharded too: each rank holds half of every parameter.
        let held = kiln_shard::account::param_bytes::<Flex, B, _>(&model);
        assert!(
            held > 0 && held * 2 <= whole + 64,
            "rank holds {held} of {whole} bytes"
        );
        println!("{name} zero3: this rank holds {held} of {whole} parameter bytes");
        verify_lora::<Flex, B, M>(model, &fixture(name), &Default::default()).unwrap()
    });
    for (rank, checks) in results.into_iter().enumerate() {
        assert_all_pass(&format!("{name} zero3 rank {rank}"), &checks);
    }
}

#[test]
fn gpt2_matches_peft() {
    single::<Gpt2<B>>("lora-tiny-gpt2");
}

#[test]
fn llama_matches_peft() {
    single::<Llama<B>>("lora-tiny-llama");
}

#[test]
fn gpt2_matches_peft_under_zero3_x2() {
    zero3_x2::<Gpt2<B>>("lora-tiny-gpt2");
}

#[test]
fn llama_matches_peft_under_zero3_x2() {
    zero3_x2::<Llama<B>>("lora-tiny-llama");
}

/// The files kiln writes carry PEFT's keys, shapes and config for the same adapters: the key set
/// and shapes of `adapter_final/` (written by PEFT), and a config PEFT's `LoraConfig` reads.
#[test]
fn saved_adapters_are_named_as_peft_names_them() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for name in ["lora-tiny-gpt2", "lora-tiny-llama"] {
        let dir = fixture(name);
        let out = std::env::temp_dir().join(format!("kiln-lora-{name}-{}", std::process::id()));
        let peft =
            SafetensorsFile::open(dir.join("adapter_final").join(ADAPTER_WEIGHTS), "peft").unwrap();
        if name.contains("gpt2") {
            with_adapters::<Gpt2<B>>(name)
                .save_peft(&out, name)
                .unwrap();
        } else {
            with_adapters::<Llama<B>>(name)
                .save_peft(&out, name)
                .unwrap();
        }
        let ours = SafetensorsFile::open(out.join(ADAPTER_WEIGHTS), "kiln").unwrap();
        let (mut a, mut b) = (ours.names(), peft.names());
        a.sort();
        b.sort();
        assert_eq!(a, b, "{name}: tensor names");
        for key in &a {
            assert_eq!(ours.shape(key), peft.shape(key), "{name}: {key}");
        }
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join(kiln_lora::ADAPTER_CONFIG)).unwrap(),
        )
        .unwrap();
        let theirs: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_final").join(kiln_lora::ADAPTER_CONFIG))
                .unwrap(),
        )
        .unwrap();
        for key in ["peft_type", "r", "fan_in_fan_out", "bias", "use_rslora"] {
            assert_eq!(config[key], theirs[key], "{name}: {key}");
        }
        assert_eq!(config["lora_alpha"].as_f64(), theirs["lora_alpha"].as_f64());
        let sorted = |v: &serde_json::Value| {
            let mut s: Vec<String> = serde_json::from_value(v.clone()).unwrap();
            s.sort();
            s
        };
        assert_eq!(
            sorted(&config["target_modules"]),
            sorted(&theirs["target_modules"]),
            "{name}: target_modules"
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
}
