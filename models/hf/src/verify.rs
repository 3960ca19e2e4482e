//! Parity with PyTorch: run what `make_fixtures.py` ran and compare every quantity.
//!
//! The optimizer is Burn's `AdamW`, checked against `torch.optim.AdamW` (burn-optim 0.21.0,
//! `optim/adamw.rs`): `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g²`, bias corrections `1 - b^t`,
//! `eps` added to `sqrt(v / (1-b2^t))` outside the square root, and the decoupled decay
//! `p * (1 - lr wd)` applied to the pre-step weights before subtracting `lr * update`; the same
//! algebra as PyTorch's `denom = sqrt(v)/sqrt(1-b2^t) + eps; p -= lr/(1-b1^t) * m/denom`. Burn holds
//! `beta`, `eps` and `wd` as `f32` where PyTorch keeps Python floats: a relative difference of at
//! most ~1e-7 in those scalars, far below the tolerances. So no AdamW of kiln's own is needed.

use crate::{HfError, HfGrads, HfNaming, Reference, hf_grads, hf_tensors};
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use kiln_model::{CausalLm, causal_lm_loss};
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

/// Relative tolerances per quantity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerances {
    /// `||logits - ref|| / ||ref||`.
    pub logits: f64,
    /// `|loss - ref| / |ref|` of the initial loss.
    pub loss_init: f64,
    /// Per parameter, on the gradient's L2 norm.
    pub grad_norm: f64,
    /// Per optimizer step, on the loss before the step.
    pub train_loss: f64,
    /// Per parameter, `||w - ref|| / ||ref||` after the last step.
    pub final_weight: f64,
}

impl Default for Tolerances {
    /// float32 on both sides: logits 1e-4, initial loss 1e-5, gradient norms 1e-4, train losses 1e-4,
    /// final weights 1e-4.
    fn default() -> Self {
        Self {
            logits: 1e-4,
            loss_init: 1e-5,
            grad_norm: 1e-4,
            train_loss: 1e-4,
            final_weight: 1e-4,
        }
    }
}

/// The kind of a compared quantity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Quantity {
    /// The forward logits.
    Logits,
    /// The loss of the initial weights.
    LossInit,
    /// A parameter's gradient norm.
    GradNorm,
    /// A loss during training.
    TrainLoss,
    /// A parameter after training.
    FinalWeight,
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Logits => "logits",
            Self::LossInit => "loss_init",
            Self::GradNorm => "grad_norm",
            Self::TrainLoss => "train_loss",
            Self::FinalWeight => "final_weight",
        })
    }
}

/// One comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    /// Its kind.
    pub quantity: Quantity,
    /// Its name, e.g. `grad_norm.model.norm.weight` or `train_loss[3]`.
    pub name: String,
    /// The relative error (infinite when the model lacks the quantity).
    pub rel_err: f64,
    /// The tolerance it must not exceed.
    pub tolerance: f64,
}

impl Check {
    /// Within tolerance (a NaN error is not).
    pub fn ok(&self) -> bool {
        self.rel_err <= self.tolerance
    }
}

/// Every comparison of a verification.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyReport {
    /// In order: logits, loss_init, gradient norms, train losses, final weights.
    pub checks: Vec<Check>,
}

impl VerifyReport {
    /// All checks within tolerance.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(Check::ok)
    }

    /// The largest relative error of each kind of quantity among the gated checks (finite
    /// tolerance; NaN counts as largest).
    pub fn worst(&self) -> BTreeMap<Quantity, &Check> {
        let mut worst: BTreeMap<Quantity, &Check> = BTreeMap::new();
        for check in self.checks.iter().filter(|c| c.tolerance.is_finite()) {
            let entry = worst.entry(check.quantity).or_insert(check);
            if check.rel_err.is_nan() || check.rel_err > entry.rel_err {
                *entry = check;
            }
        }
        worst
    }
}

/// `||a - b|| / ||b||` in f64 (`||a - b||` when `b` is all zeros).
///
/// # Panics
/// If the lengths differ.
pub fn relative_error(actual: &[f32], expected: &[f32]) -> f64 {
    assert_eq!(
        actual.len(),
        expected.len(),
        "relative_error: lengths differ"
    );
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&a, &b) in actual.iter().zip(expected) {
        diff += (f64::from(a) - f64::from(b)).powi(2);
        norm += f64::from(b).powi(2);
    }
    if norm > 0.0 {
        (diff / norm).sqrt()
    } else {
        diff.sqrt()
    }
}

fn scalar_error(actual: f64, expected: f32) -> f64 {
    let expected = f64::from(expected);
    if expected != 0.0 {
        (actual - expected).abs() / expected.abs()
    } else {
        actual.abs()
    }
}

fn to_f32(data: TensorData) -> Vec<f32> {
    data.convert::<f32>()
        .to_vec::<f32>()
        .expect("converted to f32")
}

fn loss_value<B: AutodiffBackend>(loss: &Tensor<B, 1>) -> f64 {
    f64::from(to_f32(loss.clone().into_data())[0])
}

/// How the checked training runs across devices. [`SingleDevice`] runs it as written; kiln's
/// sharding strategies implement this (`kiln_zoo::parallel`), so that `kiln verify-hf --strategy
/// zero3 --ranks 4` checks the same numbers through sharded training without this crate
/// depending on the decorator.
pub trait Parallel<B: AutodiffBackend> {
    /// Puts a model under the strategy (every rank calls it). Called on the model before its
    /// weights are loaded, so that a sharding strategy shards each tensor as it is read.
    ///
    /// # Errors
    /// [`HfError::Parallel`] when the strategy cannot be set up.
    fn prepare<M: AutodiffModule<B>>(&self, model: M) -> Result<M, HfError>;
    /// Called after the parameters were replaced (loading) and after each backward pass,
    /// before the gradients are used: a strategy re-marks its parameters here.
    fn refresh<M: AutodiffModule<B>>(&self, model: &M);
}

/// Plain single-device training.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleDevice;

impl<B: AutodiffBackend> Parallel<B> for SingleDevice {
    fn prepare<M: AutodiffModule<B>>(&self, model: M) -> Result<M, HfError> {
        Ok(model)
    }
    fn refresh<M: AutodiffModule<B>>(&self, _model: &M) {}
}

/// [`verify_model_with`] on a single device (the model as loaded).
///
/// # Errors
/// As [`verify_model_with`].
pub fn verify_model<B, M>(
    model: M,
    reference: &Reference,
    tolerances: &Tolerances,
    device: &B::Device,
) -> Result<VerifyReport, HfError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + CausalLm<B> + HfNaming,
{
    verify_model_with(model, reference, tolerances, device, &SingleDevice)
}

/// Runs on `model` what PyTorch ran for `reference` and compares: the logits and loss of the initial
/// weights, each parameter's gradient norm, the loss before each of `reference.optimizer.steps`
/// AdamW steps on the same batch, and every parameter after them. Parts of tensors the loss does not
/// depend on ([`HfNaming::zero_gradient_parts`]) are left out of the final-weight comparison (their
/// trained values are rounding noise, reported with an infinite tolerance) and checked instead to
/// carry a negligible share of their tensor's initial gradient.
///
/// Training runs through `parallel` (whose `prepare` the caller applied before loading `model`);
/// under a data-parallel strategy every rank trains on the
/// whole reference batch (it is too small to split), so the averaged gradients are the
/// single-device ones and the same PyTorch numbers apply.
///
/// # Errors
/// [`HfError::ShapeMismatch`] when the model's logits and the reference's differ in shape;
/// [`HfError::Parallel`] from `parallel`.
pub fn verify_model_with<B, M, P>(
    model: M,
    reference: &Reference,
    tolerances: &Tolerances,
    device: &B::Device,
    parallel: &P,
) -> Result<VerifyReport, HfError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + CausalLm<B> + HfNaming,
    P: Parallel<B>,
{
    parallel.refresh(&model);
    let mut checks = Vec::new();
    let input_ids = Tensor::<B, 2, Int>::from_data(reference.input_ids.clone(), device);
    let labels = Tensor::<B, 2, Int>::from_data(reference.labels.clone(), device);

    // Forward, loss and gradients of the initial weights.
    let logits = model.forward(input_ids.clone());
    if logits.dims().as_slice() != reference.logits.shape.as_slice() {
        return Err(HfError::ShapeMismatch {
            name: "logits".into(),
            path: reference.path.clone(),
            expected: logits.dims().to_vec(),
            found: reference.logits.shape.to_vec(),
        });
    }
    checks.push(Check {
        quantity: Quantity::Logits,
        name: "logits".into(),
        rel_err: relative_error(
            &to_f32(logits.clone().into_data()),
            &to_f32(reference.logits.clone()),
        ),
        tolerance: tolerances.logits,
    });
    let loss = causal_lm_loss(logits, labels.clone());
    checks.push(Check {
        quantity: Quantity::LossInit,
        name: "loss_init".into(),
        rel_err: scalar_error(loss_value(&loss), reference.loss_init),
        tolerance: tolerances.loss_init,
    });
    let grads = loss.backward();
    parallel.refresh(&model);
    let parts = model.zero_gradient_parts();
    let wanted: Vec<String> = parts.iter().map(|(name, _)| name.clone()).collect();
    let HfGrads { norms, whole } = hf_grads(&model, &grads, &wanted);
    let norms: BTreeMap<String, f64> = norms
        .into_iter()
        .map(|(name, norm)| (name, norm.unwrap_or(0.0)))
        .collect();
    let whole: BTreeMap<String, Vec<f32>> = whole
        .into_iter()
        .map(|(name, data)| (name, to_f32(data)))
        .collect();
    for (name, &expected) in &reference.grad_norms {
        checks.push(Check {
            quantity: Quantity::GradNorm,
            name: format!("grad_norm.{name}"),
            rel_err: norms
                .get(name)
                .map_or(f64::INFINITY, |&n| scalar_error(n, expected)),
            tolerance: tolerances.grad_norm,
        });
    }
    for (name, range) in &parts {
        // The share of the gradient on a part the loss does not depend on: rounding noise only.
        let share = whole.get(name).map_or(0.0, |g| {
            let zeros = vec![0.0; g.len()];
            relative_error(&g[range.clone()], &zeros[range.clone()]) / relative_error(g, &zeros)
        });
        checks.push(Check {
            quantity: Quantity::GradNorm,
            name: format!("grad_norm.{name}[{range:?}] share (exactly 0 in exact arithmetic)"),
            rel_err: share,
            tolerance: tolerances.grad_norm,
        });
    }
    checks.extend(unreferenced(
        Quantity::GradNorm,
        "grad_norm",
        norms.keys(),
        &reference.grad_norms,
        tolerances.grad_norm,
    ));
    drop(grads);

    // Training on the same batch.
    let settings = &reference.optimizer;
    let mut optimizer = AdamWConfig::new()
        .with_beta_1(settings.beta1 as f32)
        .with_beta_2(settings.beta2 as f32)
        .with_epsilon(settings.eps as f32)
        .with_weight_decay(settings.weight_decay as f32)
        .init::<B, M>();
    let mut model = model;
    for step in 0..settings.steps {
        let loss = causal_lm_loss(model.forward(input_ids.clone()), labels.clone());
        checks.push(Check {
            quantity: Quantity::TrainLoss,
            name: format!("train_loss[{step}]"),
            rel_err: scalar_error(loss_value(&loss), reference.train_losses[step]),
            tolerance: tolerances.train_loss,
        });
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        parallel.refresh(&model);
        model = optimizer.step(settings.lr, model, grads);
    }

    let weights: BTreeMap<String, TensorData> = hf_tensors(&model).into_iter().collect();
    for (name, expected) in &reference.final_weights {
        let noise: Vec<Range<usize>> = parts
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, r)| r.clone())
            .collect();
        let actual = weights.get(name).filter(|w| w.shape == expected.shape);
        let (actual, expected) = match actual {
            Some(w) => (to_f32(w.clone()), to_f32(expected.clone())),
            None => {
                checks.push(Check {
                    quantity: Quantity::FinalWeight,
                    name: format!("final.{name}"),
                    rel_err: f64::INFINITY,
                    tolerance: tolerances.final_weight,
                });
                continue;
            }
        };
        let keep = |i: &usize| !noise.iter().any(|r| r.contains(i));
        let pick = |v: &[f32]| -> Vec<f32> { (0..v.len()).filter(keep).map(|i| v[i]).collect() };
        let suffix = if noise.is_empty() {
            String::new()
        } else {
            format!(" without {noise:?}")
        };
        checks.push(Check {
            quantity: Quantity::FinalWeight,
            name: format!("final.{name}{suffix}"),
            rel_err: relative_error(&pick(&actual), &pick(&expected)),
            tolerance: tolerances.final_weight,
        });
        for range in noise {
            checks.push(Check {
                quantity: Quantity::FinalWeight,
                name: format!("final.{name}[{range:?}] (rounding noise, not gated)"),
                rel_err: relative_error(&actual[range.clone()], &expected[range.clone()]),
                tolerance: f64::INFINITY,
            });
        }
    }
    checks.extend(unreferenced(
        Quantity::FinalWeight,
        "final",
        weights.keys(),
        &reference.final_weights,
        tolerances.final_weight,
    ));
    Ok(VerifyReport { checks })
}

/// A failing check for each model parameter the reference has no number for.
fn unreferenced<'a, V>(
    quantity: Quantity,
    prefix: &str,
    model_names: impl Iterator<Item = &'a String>,
    reference: &BTreeMap<String, V>,
    tolerance: f64,
) -> Vec<Check> {
    model_names
        .filter(|name| !reference.contains_key(*name))
        .map(|name| Check {
            quantity,
            name: format!("{prefix}.{name} (a model parameter absent from the reference)"),
            rel_err: f64::INFINITY,
            tolerance,
        })
        .collect()
}
