//! Parity with PEFT: run what `make_lora_fixtures.py` ran on a directory of that layout
//! (`base/`, `adapter_init/`, `adapter_final/`, `merged/`, `reference.safetensors`) and
//! compare every quantity.
//!
//! Training goes through `kiln_shard::step`, the step every kiln loop takes, so a sharded
//! `Lora` (any strategy, any world size, every rank on the reference batch) is checked the same
//! way as one on a single device.

use crate::error::LoraError;
use crate::model::Lora;
use crate::peft::peft_key;
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use kiln_hf::verify::relative_error;
use kiln_hf::{HfNaming, SafetensorsFile};
use kiln_model::{CausalLm, causal_lm_loss};
use kiln_shard::{Shard, ShardedOptimizer, StepConfig};
use std::fmt;
use std::path::Path;

/// The reference numbers' file in a LoRA fixture directory.
pub const REFERENCE: &str = "reference.safetensors";

/// One compared quantity: the worst relative error over its tensors or steps.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    /// What was compared (`logits`, `grad_norm`, `final adapters`, ...).
    pub quantity: &'static str,
    /// The tensor or step with the largest error.
    pub worst: String,
    /// Its error: `||kiln - ref|| / ||ref||` (for scalars, `|kiln - ref| / |ref|`).
    pub error: f64,
    /// The bound it is held to.
    pub tolerance: f64,
}

impl Check {
    /// Whether the error is within the tolerance.
    pub fn passed(&self) -> bool {
        self.error <= self.tolerance
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<16} {:>10.3e}  (tolerance {:.0e}, worst: {}){}",
            self.quantity,
            self.error,
            self.tolerance,
            self.worst,
            if self.passed() { "" } else { "  FAILED" }
        )
    }
}

fn floats(d: TensorData) -> Vec<f32> {
    d.convert::<f32>().to_vec::<f32>().expect("f32 data")
}

/// The worst of `(name, error)` pairs as a check.
fn worst(
    quantity: &'static str,
    tolerance: f64,
    errors: impl IntoIterator<Item = (String, f64)>,
) -> Check {
    let (worst, error) = errors
        .into_iter()
        .fold((String::from("-"), 0.0), |(wn, we), (n, e)| {
            if e > we || e.is_nan() {
                (n, e)
            } else {
                (wn, we)
            }
        });
    Check {
        quantity,
        worst,
        error,
        tolerance,
    }
}

/// Checks `model` (the fixture's base with `adapter_init/` loaded, sharded or not) against the
/// reference numbers in `dir`: logits and loss of base + initial adapters, each adapter
/// tensor's gradient norm, the losses of the AdamW steps, the final loss and adapters, and the
/// merged model's weights against `merged/model.safetensors`. Every rank of a sharded model
/// must call it.
///
/// # Errors
/// A missing or malformed reference file.
///
/// # Panics
/// If a collective fails.
pub fn verify_lora<B, AB, M>(
    model: Lora<AB, M>,
    dir: &Path,
    device: &AB::Device,
) -> Result<Vec<Check>, LoraError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>> + kiln_shard::lowrank::LowRankOps,
    M: CausalLm<AB> + AutodiffModule<AB> + HfNaming,
    Lora<AB, M>: AutodiffModule<AB>,
{
    let reference = SafetensorsFile::open(dir.join(REFERENCE), "the LoRA reference numbers")?;
    let number = |key: &str| reference.metadata_number::<f64>(key);
    let ids = Tensor::<AB, 2, Int>::from_data(reference.int("input_ids")?, device);
    let labels = Tensor::<AB, 2, Int>::from_data(reference.int("labels")?, device);
    let mut checks = Vec::new();

    // Forward and backward of base + the initial adapters.
    let logits = model.merged().forward(ids.clone());
    let want = floats(reference.float("logits", Some(&logits.dims()))?);
    let got = floats(logits.clone().into_data());
    checks.push(worst(
        "logits",
        1e-4,
        [("logits".into(), relative_error(&got, &want))],
    ));
    let loss = causal_lm_loss(logits, labels.clone());
    let loss_init: f32 = loss.clone().into_scalar().elem();
    let scalar = |key: &str, got: f32| -> Result<(String, f64), LoraError> {
        let want = reference.scalar(key)?;
        Ok((
            key.to_string(),
            f64::from((got - want).abs()) / f64::from(want.abs()),
        ))
    };
    checks.push(worst("loss_init", 1e-5, [scalar("loss_init", loss_init)?]));
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let mut norms = Vec::new();
    for (t, a) in model.targets.iter().zip(&model.adapters) {
        for (which, p) in [('A', &a.a), ('B', &a.b)] {
            let key = peft_key(&t.module, which);
            // A shard's sum of squares is all-reduced by the decorator: the whole tensor's norm.
            let g = grads
                .get::<AB::InnerBackend, 2>(p.id)
                .expect("every adapter has a gradient");
            let norm: f32 = g.square().sum().into_scalar().elem();
            norms.push(scalar(&format!("grad_norm.{key}"), norm.sqrt())?);
        }
    }
    checks.push(worst("grad_norm", 1e-4, norms));
    // Backward consumed the adapters' gradient-sync marks; the step needs them again.
    kiln_shard::remark(&model);

    // The AdamW steps, on the same batch.
    let steps = number("steps")? as usize;
    let optim = AdamWConfig::new()
        .with_beta_1(number("beta1")? as f32)
        .with_beta_2(number("beta2")? as f32)
        .with_epsilon(number("eps")? as f32)
        .with_weight_decay(number("weight_decay")? as f32)
        .init::<AB, Lora<AB, M>>();
    let mut optim = ShardedOptimizer::<_, B>::new(optim);
    let lr = number("lr")?;
    let want_losses = floats(reference.float("train_losses", Some(&[steps]))?);
    let mut model = model;
    let mut losses = Vec::new();
    for (i, want) in want_losses.iter().enumerate() {
        let (stepped, stats) = kiln_shard::step(model, &mut optim, lr, &StepConfig::default(), {
            let (ids, labels) = (ids.clone(), labels.clone());
            move |m: &Lora<AB, M>, _| {
                causal_lm_loss(m.merged().forward(ids.clone()), labels.clone())
            }
        })?;
        model = stepped;
        losses.push((
            format!("step {}", i + 1),
            (stats.loss - f64::from(*want)).abs() / f64::from(want.abs()),
        ));
    }
    checks.push(worst("train_losses", 1e-4, losses));
    let loss_final: f32 = causal_lm_loss(model.merged().forward(ids.clone()), labels.clone())
        .into_scalar()
        .elem();
    checks.push(worst(
        "loss_final",
        1e-4,
        [scalar("loss_final", loss_final)?],
    ));
    let mut finals = Vec::new();
    for (key, data) in model.adapter_tensors() {
        let want = floats(reference.float(&format!("final.{key}"), Some(&data.shape))?);
        finals.push((key, relative_error(&floats(data), &want)));
    }
    checks.push(worst("final adapters", 1e-4, finals));

    // The merged model: weights as PEFT's merge_and_unload wrote them, and its loss.
    let merged = model.merge();
    let file = SafetensorsFile::open(dir.join("merged").join(kiln_hf::WEIGHTS_FILE), "merged")?;
    let mut weights = Vec::new();
    for (name, data) in kiln_hf::hf_tensors(&merged) {
        let want = floats(file.float(&name, Some(&data.shape))?);
        weights.push((name, relative_error(&floats(data), &want)));
    }
    checks.push(worst("merged weights", 1e-4, weights));
    let merged_loss: f32 = causal_lm_loss(merged.forward(ids), labels)
        .into_scalar()
        .elem();
    checks.push(worst(
        "merged loss",
        1e-4,
        [scalar("loss_final", merged_loss)?],
    ));
    Ok(checks)
}
