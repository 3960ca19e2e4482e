//! Adapters in Hugging Face PEFT's directory layout: `adapter_config.json` and
//! `adapter_model.safetensors` with keys `base_model.model.<module>.lora_A.weight` `[r, in]` and
//! `...lora_B.weight` `[out, r]`, as `PeftModel.save_pretrained` writes them and
//! `PeftModel.from_pretrained` reads them.

use crate::config::{LoraConfig, matches};
use crate::error::LoraError;
use crate::model::{Adapter, Lora, Naming, lora};
use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use kiln_hf::SafetensorsFile;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The adapter config's file name.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter weights' file name.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

const PREFIX: &str = "base_model.model.";

/// The file key of `module`'s `A` (`which = 'A'`) or `B` matrix.
pub fn peft_key(module: &str, which: char) -> String {
    format!("{PREFIX}{module}.lora_{which}.weight")
}

impl<B: Backend, M: Module<B>> Lora<B, M> {
    /// Every adapter tensor under its PEFT key, A then B per target. Reads the values: under
    /// sharding every rank must call it.
    pub fn adapter_tensors(&self) -> Vec<(String, TensorData)> {
        self.targets
            .iter()
            .zip(&self.adapters)
            .flat_map(|(t, a)| {
                [
                    (peft_key(&t.module, 'A'), a.a.val().into_data()),
                    (peft_key(&t.module, 'B'), a.b.val().into_data()),
                ]
            })
            .collect()
    }

    /// PEFT's `target_modules` for these targets: the distinct last components when they select
    /// exactly the adapted modules under PEFT's suffix rule, else a regular expression of the
    /// exact paths (PEFT full-matches a string against each module path).
    pub fn target_modules(&self) -> Value {
        let adapted: BTreeSet<&str> = self.targets.iter().map(|t| t.module.as_str()).collect();
        let names: BTreeSet<&str> = adapted
            .iter()
            .map(|m| m.rsplit('.').next().unwrap_or(m))
            .collect();
        let candidates = self.candidates();
        let exact = candidates.iter().filter(|c| c.is_weight()).all(|c| {
            let selected = names.iter().any(|n| matches(n, c.module(), ""));
            selected == adapted.contains(c.module())
        });
        if exact {
            json!(names)
        } else {
            let alternatives: Vec<String> = adapted.iter().map(|m| m.replace('.', r"\.")).collect();
            json!(format!("(?:{})", alternatives.join("|")))
        }
    }

    /// Writes `dir/adapter_config.json` and `dir/adapter_model.safetensors` (f32), creating
    /// `dir`; `base_model` is recorded as `base_model_name_or_path`. Reads the adapters: under
    /// sharding every rank must call it (rank 0's files are the ones to keep).
    ///
    /// # Errors
    /// When a file cannot be written.
    pub fn save_peft(&self, dir: &Path, base_model: &str) -> Result<(), LoraError> {
        self.write_peft(dir, base_model, &self.adapter_tensors())
    }

    /// [`save_peft`](Self::save_peft) with the tensors already read
    /// ([`adapter_tensors`](Self::adapter_tensors)): under sharding every rank reads, one writes.
    ///
    /// # Errors
    /// When a file cannot be written.
    pub fn write_peft(
        &self,
        dir: &Path,
        base_model: &str,
        tensors: &[(String, TensorData)],
    ) -> Result<(), LoraError> {
        std::fs::create_dir_all(dir).map_err(|source| LoraError::Io {
            op: "create",
            path: dir.to_path_buf(),
            source,
        })?;
        // GPT-2's Conv1D stores [in, out] like Burn; PEFT then merges (B A)ᵀ.
        let fan_in_fan_out = self.targets.iter().all(|t| !t.transposed);
        let config = json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.config.r,
            "lora_alpha": self.config.alpha,
            "lora_dropout": self.config.dropout,
            "use_rslora": self.config.rslora,
            "use_dora": false,
            "fan_in_fan_out": fan_in_fan_out,
            "bias": "none",
            "target_modules": self.target_modules(),
            "modules_to_save": null,
            "init_lora_weights": true,
            "inference_mode": true,
            "revision": null,
        });
        let path = dir.join(ADAPTER_CONFIG);
        let text = serde_json::to_string_pretty(&config).expect("a JSON value serialises");
        std::fs::write(&path, text + "\n").map_err(|source| LoraError::Io {
            op: "write",
            path,
            source,
        })?;
        kiln_hf::write_tensors(dir.join(ADAPTER_WEIGHTS), tensors)?;
        Ok(())
    }
}

/// The settings of a PEFT adapter directory that kiln needs, checked.
fn read_config(dir: &Path) -> Result<LoraConfig, LoraError> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|source| LoraError::Io {
        op: "read",
        path: path.clone(),
        source,
    })?;
    let v: Value = serde_json::from_str(&text).map_err(|e| LoraError::Mismatch {
        path: path.clone(),
        what: format!("not valid JSON: {e}"),
    })?;
    let field = |k: &str| v.get(k).filter(|x| !x.is_null());
    let unsupported = |what: String| LoraError::Unsupported {
        path: path.clone(),
        what,
    };
    match field("peft_type").and_then(Value::as_str) {
        Some("LORA") | None => {}
        Some(other) => return Err(unsupported(format!("peft_type {other}"))),
    }
    if field("use_dora").and_then(Value::as_bool) == Some(true) {
        return Err(unsupported("use_dora (DoRA)".into()));
    }
    match field("bias").and_then(Value::as_str) {
        Some("none") | None => {}
        Some(other) => return Err(unsupported(format!("bias = \"{other}\" (trained biases)"))),
    }
    if field("modules_to_save").is_some_and(|m| m.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(unsupported(
            "modules_to_save (fully trained modules)".into(),
        ));
    }
    if field("rank_pattern").is_some_and(|m| m.as_object().is_none_or(|o| !o.is_empty()))
        || field("alpha_pattern").is_some_and(|m| m.as_object().is_none_or(|o| !o.is_empty()))
    {
        return Err(unsupported(
            "rank_pattern / alpha_pattern (per-module ranks)".into(),
        ));
    }
    let r = field("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| LoraError::Mismatch {
            path: path.clone(),
            what: "no integer 'r'".into(),
        })? as usize;
    let alpha = field("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or_else(|| LoraError::Mismatch {
            path: path.clone(),
            what: "no number 'lora_alpha'".into(),
        })?;
    let dropout = field("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
    if !(0.0..1.0).contains(&dropout) {
        return Err(LoraError::Mismatch {
            path: path.clone(),
            what: format!("lora_dropout {dropout} is not a probability in [0, 1)"),
        });
    }
    Ok(LoraConfig {
        r,
        alpha,
        // Applied if the adapter is trained further, as PEFT would.
        dropout,
        targets: Vec::new(),
        rslora: field("use_rslora").and_then(Value::as_bool) == Some(true),
        seed: 0,
        qlora: false,
    })
}

/// Loads a PEFT adapter directory onto `base`: the adapted modules are those the weights file
/// names (the config's `target_modules` is what made them), each checked against the base.
///
/// # Errors
/// A missing or unreadable file, a setting kiln does not implement (DoRA, trained biases,
/// `modules_to_save`, per-module ranks), a key naming a module the base lacks or a tensor whose
/// shape does not fit the base's weight (an adapter for another base: both shapes named).
pub fn load_peft<B: Backend, M: Module<B>>(
    base: M,
    dir: &Path,
    naming: Naming,
    device: &B::Device,
) -> Result<Lora<B, M>, LoraError> {
    let mut config = read_config(dir)?;
    let file = SafetensorsFile::open(dir.join(ADAPTER_WEIGHTS), "the adapter's weights")?;
    let mismatch = |what: String| LoraError::Mismatch {
        path: file.path().to_path_buf(),
        what,
    };
    // module -> (A key, B key)
    let mut modules: BTreeMap<String, [Option<String>; 2]> = BTreeMap::new();
    for key in file.names() {
        let parsed = key.strip_prefix(PREFIX).and_then(|k| {
            k.strip_suffix(".lora_A.weight")
                .map(|m| (m, 0))
                .or_else(|| k.strip_suffix(".lora_B.weight").map(|m| (m, 1)))
        });
        let Some((module, which)) = parsed else {
            return Err(mismatch(format!(
                "'{key}' is not a LoRA tensor (expected {PREFIX}<module>.lora_A.weight or \
                 .lora_B.weight)"
            )));
        };
        modules.entry(module.to_string()).or_default()[which] = Some(key.clone());
    }
    if modules.is_empty() {
        return Err(mismatch("holds no adapter tensors".into()));
    }
    let known: BTreeSet<String> = crate::model::candidates::<B, M>(&base, naming)
        .iter()
        .filter(|c| c.is_weight())
        .map(|c| c.module().to_string())
        .collect();
    for (module, keys) in &modules {
        if !known.contains(module) {
            return Err(mismatch(format!(
                "adapts '{module}', which this model lacks: an adapter for another base? The \
                 model's modules include {}",
                known.iter().take(8).cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        if let Some(i) = keys.iter().position(Option::is_none) {
            return Err(mismatch(format!(
                "'{module}' has no lora_{} tensor",
                ['A', 'B'][i]
            )));
        }
    }
    config.targets = modules.keys().cloned().collect();
    let fresh = lora(base, &config, naming, device)?;
    let mut adapters = Vec::with_capacity(fresh.targets.len());
    for t in &fresh.targets {
        let [Some(a_key), Some(b_key)] = &modules[&t.module] else {
            unreachable!("both keys were checked above");
        };
        let read = |key: &str, want: [usize; 2]| -> Result<Tensor<B, 2>, LoraError> {
            let shape = file.shape(key).unwrap_or_default();
            if shape != want {
                return Err(mismatch(format!(
                    "'{key}' is {shape:?}; the base's '{}' weight is [in {}, out {}], so with r = {} \
                     it must be {want:?}: an adapter for another base?",
                    t.module, t.fan_in, t.fan_out, config.r
                )));
            }
            Ok(Tensor::from_data(file.float(key, Some(&want))?, device))
        };
        adapters.push(Adapter {
            a: Param::from_tensor(read(a_key, [config.r, t.fan_in])?),
            b: Param::from_tensor(read(b_key, [t.fan_out, config.r])?),
        });
    }
    Ok(Lora { adapters, ..fresh })
}
