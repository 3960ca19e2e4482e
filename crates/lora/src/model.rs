//! [`Lora`]: a Burn module with adapters on some of its weights, its base frozen.

use crate::config::{LoraConfig, matches};
use crate::error::LoraError;
use crate::quant::{Nf4Matrix, Nf4Weight};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use kiln_hf::{HfTensorName, SafetensorsFile};
use kiln_shard::lowrank::LowRankOps;
use std::collections::HashMap;

/// How a model's parameters are named in files and target patterns: Hugging Face names for
/// kiln's HF models (`<Llama<B> as HfNaming>::hf_tensor`), Burn's own paths ([`burn_names`])
/// for any other module.
pub type Naming = fn(&str) -> HfTensorName;

/// Burn's parameter paths as they are (`layers.0.linear.weight`).
pub fn burn_names(path: &str) -> HfTensorName {
    HfTensorName {
        name: path.to_string(),
        transposed: false,
    }
}

/// One adapted weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The Burn path of the weight (`model.layers.0.self_attn.q_proj.weight`).
    pub path: String,
    /// The module path in the model's naming, without `.weight` (PEFT's module key).
    pub module: String,
    /// The weight's first dimension: the input features of a Burn `Linear` (`[in, out]`).
    pub fan_in: usize,
    /// The weight's second dimension.
    pub fan_out: usize,
    /// Whether the file layout is the transpose of Burn's (`nn.Linear`'s `[out, in]`); false for
    /// GPT-2's Conv1D, PEFT's `fan_in_fan_out`.
    pub transposed: bool,
}

/// The low-rank update of one weight: `A` `[r, in]`, `B` `[out, r]` (PEFT's `lora_A.weight` and
/// `lora_B.weight`, in PEFT's orientation whatever the base's layout).
#[derive(Module, Debug)]
pub struct Adapter<B: Backend> {
    /// `lora_A`.
    pub a: Param<Tensor<B, 2>>,
    /// `lora_B`.
    pub b: Param<Tensor<B, 2>>,
}

impl<B: Backend> Adapter<B> {
    /// `scaling · Aᵀ Bᵀ`: the update in Burn's `[in, out]` layout (`(B A)ᵀ`), for a weight `x W`.
    pub fn delta(&self, scaling: f64) -> Tensor<B, 2> {
        self.a
            .val()
            .transpose()
            .matmul(self.b.val().transpose())
            .mul_scalar(scaling)
    }
}

/// `base` with low-rank adapters on its [`targets`](Lora::targets).
///
/// Only the adapters are trainable (the base is frozen: no gradients, no optimizer state), so a
/// `Lora` goes to [`kiln_shard::step`]-style training and any Burn optimizer unchanged. Its
/// forward is the base's forward on [`merged`](Lora::merged) weights `W + s Aᵀ Bᵀ`: built in
/// the autodiff graph each forward, which reaches any model without changing its code, and
/// equals PEFT's `base(x) + s B A x` up to float rounding.
///
/// [`kiln_shard::step`]: https://docs.rs/kiln-shard
#[derive(Module, Debug)]
pub struct Lora<B: Backend, M: Module<B>> {
    /// The frozen model.
    pub base: M,
    /// One adapter per target, in target order.
    pub adapters: Vec<Adapter<B>>,
    /// QLoRA: the base's 4-bit weights (empty otherwise); the base's own parameter at each
    /// of `quantized_paths` is an empty placeholder.
    pub quantized: Vec<Nf4Weight<B>>,
    /// The Burn paths of `quantized`.
    #[module(skip)]
    pub quantized_paths: Vec<String>,
    /// The adapted weights.
    #[module(skip)]
    pub targets: Vec<Target>,
    /// How the adapters were made.
    #[module(skip)]
    pub config: LoraConfig,
    /// How the base names its parameters.
    #[module(skip)]
    pub naming: Naming,
}

/// A float parameter of a module as the target search sees it.
#[derive(Debug, Clone)]
pub(crate) struct Candidate {
    pub path: String,
    pub name: HfTensorName,
    pub container: String,
    pub dims: Vec<usize>,
}

impl Candidate {
    /// Only weights are targets: a bias or a norm's gain has no low-rank update.
    pub fn is_weight(&self) -> bool {
        self.name.name.ends_with(".weight") || self.name.name == "weight"
    }

    /// The module path in the model's naming: the name without `.weight`.
    pub fn module(&self) -> &str {
        self.name
            .name
            .strip_suffix(".weight")
            .unwrap_or(&self.name.name)
    }
}

/// Every float parameter of `module`, with its path, name and innermost container type.
pub(crate) fn candidates<B: Backend, M: Module<B>>(module: &M, naming: Naming) -> Vec<Candidate> {
    struct Find {
        stack: Vec<(String, String)>,
        naming: Naming,
        found: Vec<Candidate>,
    }
    impl<B: Backend> ModuleVisitor<B> for Find {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.stack.push((name.to_string(), container.to_string()));
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let path = self
                .stack
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(".");
            // Burn enters a parameter's field with the type of the struct that holds it.
            let container = self
                .stack
                .last()
                .map(|(_, c)| c.clone())
                .unwrap_or_default();
            self.found.push(Candidate {
                name: (self.naming)(&path),
                path,
                container,
                dims: param.lazy_shape().to_vec(),
            });
        }
    }
    let mut find = Find {
        stack: Vec::new(),
        naming,
        found: Vec::new(),
    };
    module.visit(&mut find);
    find.found
}

/// The weights of `module` that `config.targets` select.
///
/// # Errors
/// A pattern matching nothing (with some module paths that exist), a selected parameter that is
/// not a matrix, `r` above a target's smaller dimension.
pub fn find_targets<B: Backend, M: Module<B>>(
    module: &M,
    config: &LoraConfig,
    naming: Naming,
) -> Result<Vec<Target>, LoraError> {
    let all = candidates::<B, M>(module, naming);
    let mut chosen = vec![false; all.len()];
    for pattern in &config.targets {
        let mut any = false;
        for (c, chosen) in all.iter().zip(&mut chosen) {
            if c.is_weight() && matches(pattern, c.module(), &c.container) {
                *chosen = true;
                any = true;
            }
        }
        if !any {
            let modules: Vec<&str> = all
                .iter()
                .filter(|c| c.is_weight())
                .map(Candidate::module)
                .collect();
            return Err(LoraError::NoMatch {
                pattern: pattern.clone(),
                examples: modules.iter().take(12).map(|s| s.to_string()).collect(),
            });
        }
    }
    let mut targets = Vec::new();
    for (c, _) in all.into_iter().zip(chosen).filter(|(_, chosen)| *chosen) {
        let &[fan_in, fan_out] = c.dims.as_slice() else {
            return Err(LoraError::NotMatrix {
                module: c.module().to_string(),
                dims: c.dims.clone(),
            });
        };
        if config.r == 0 || config.r > fan_in.min(fan_out) {
            return Err(LoraError::Rank {
                r: config.r,
                module: c.module().to_string(),
                dims: c.dims.clone(),
            });
        }
        targets.push(Target {
            module: c.module().to_string(),
            path: c.path,
            fan_in,
            fan_out,
            transposed: c.name.transposed,
        });
    }
    Ok(targets)
}

/// Puts adapters on the weights of `base` that `config` selects, and freezes the base.
///
/// `A` is drawn as PEFT draws it (Kaiming-uniform with `a = sqrt(5)`: uniform in
/// `±1/sqrt(in)`), seeded by `config.seed` and the target's path so every rank draws the same;
/// `B` is zero, so the model starts equal to its base.
///
/// # Errors
/// As [`find_targets`]; a dropout outside `[0, 1)`.
pub fn lora<B: Backend, M: Module<B>>(
    base: M,
    config: &LoraConfig,
    naming: Naming,
    device: &B::Device,
) -> Result<Lora<B, M>, LoraError> {
    if !(0.0..1.0).contains(&config.dropout) {
        return Err(LoraError::Dropout(config.dropout));
    }
    let targets = find_targets::<B, M>(&base, config, naming)?;
    let adapters = targets
        .iter()
        .map(|t| {
            let seed = config.seed ^ kiln_comm::hash::fnv1a(t.path.as_bytes());
            // The same stream on every rank.
            let mut rng = kiln_comm::hash::SplitMix64(seed);
            let bound = 1.0 / (t.fan_in as f32).sqrt();
            let a: Vec<f32> = (0..config.r * t.fan_in)
                .map(|_| (2.0 * rng.next_f32() - 1.0) * bound)
                .collect();
            Adapter {
                a: Param::from_tensor(Tensor::from_data(
                    TensorData::new(a, [config.r, t.fan_in]),
                    device,
                )),
                b: Param::from_tensor(Tensor::zeros([t.fan_out, config.r], device)),
            }
        })
        .collect();
    let model = Lora {
        base: base.map(&mut Freeze),
        adapters,
        quantized: Vec::new(),
        quantized_paths: Vec::new(),
        targets,
        config: config.clone(),
        naming,
    };
    Ok(if config.qlora {
        model.quantize_base()
    } else {
        model
    })
}

/// Turns gradients off, keeping a lazily initialised parameter lazy (Burn's `no_grad` would
/// initialise it): a base can be frozen, then sharded, then loaded tensor by tensor, and is
/// never whole on a rank.
struct Freeze;

impl<B: Backend> ModuleMapper<B> for Freeze {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        param.set_require_grad(false)
    }
}

/// Takes weights out of the base, leaving empty placeholders (QLoRA).
struct Take<B: Backend> {
    stack: Vec<String>,
    paths: std::collections::HashSet<String>,
    taken: Vec<(String, Tensor<B, 2>)>,
}

impl<B: Backend> ModuleMapper<B> for Take<B> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.stack.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.stack.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let path = self.stack.join(".");
        if !self.paths.contains(&path) {
            return param;
        }
        let device = param.lazy_device();
        let (id, w, mapper): (ParamId, _, _) = param.consume();
        // Rank 2 (checked by the caller): the casts only restate D = 2.
        self.taken
            .push((path, Tensor::from_primitive(w.into_primitive())));
        let empty =
            Tensor::<B, D>::from_primitive(Tensor::<B, 2>::zeros([0, 0], &device).into_primitive());
        Param::from_mapped_value(id, empty, mapper)
    }
}

/// The transpose of the row-major `[rows, cols]` `values`.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// Replaces the weights at some paths by `f(weight, delta)`, and QLoRA placeholders by their
/// weights (`weights`) first.
struct Apply<B: Backend, T, F> {
    stack: Vec<String>,
    deltas: HashMap<String, T>,
    weights: HashMap<String, Tensor<B, 2>>,
    f: F,
}

impl<B: Backend, T, F: FnMut(Tensor<B, 2>, T) -> Tensor<B, 2>> ModuleMapper<B> for Apply<B, T, F> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.stack.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.stack.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let path = self.stack.join(".");
        let (delta, weight) = (self.deltas.remove(&path), self.weights.remove(&path));
        if delta.is_none() && weight.is_none() {
            return param;
        }
        let (id, w, mapper): (ParamId, _, _) = param.consume();
        // Targets and quantised weights are rank 2: the casts only restate D = 2.
        let w = weight.unwrap_or_else(|| Tensor::<B, 2>::from_primitive(w.into_primitive()));
        let Some(delta) = delta else {
            let w = Tensor::<B, D>::from_primitive(w.into_primitive());
            return Param::from_mapped_value(id, w, mapper);
        };
        let out = Tensor::<B, D>::from_primitive((self.f)(w, delta).into_primitive());
        Param::from_mapped_value(id, out, mapper)
    }
}

impl<B: Backend, M: Module<B>> Lora<B, M> {
    /// The scale of the adapters' product.
    pub fn scaling(&self) -> f64 {
        self.config.scaling()
    }

    /// Maps each target weight `w` of `base` to `f(w, delta)`. When `dequantized`, the base's
    /// QLoRA placeholders are replaced by their dequantised weights first (targets or not).
    fn apply(
        &self,
        base: M,
        detach: bool,
        dequantized: bool,
        f: impl FnMut(Tensor<B, 2>, Tensor<B, 2>) -> Tensor<B, 2>,
    ) -> M {
        let s = self.scaling();
        let deltas = self
            .targets
            .iter()
            .zip(&self.adapters)
            .map(|(t, a)| {
                let d = a.delta(s);
                (t.path.clone(), if detach { d.detach() } else { d })
            })
            .collect();
        self.map_targets(base, |_| dequantized, deltas, f)
    }

    /// Maps each target weight `w` of `base` to `f(w, deltas[path])`, the QLoRA placeholders
    /// at the paths `dequantized` accepts replaced by their dequantised weights first.
    fn map_targets<T>(
        &self,
        base: M,
        dequantized: impl Fn(&str) -> bool,
        deltas: HashMap<String, T>,
        f: impl FnMut(Tensor<B, 2>, T) -> Tensor<B, 2>,
    ) -> M {
        let weights = self
            .quantized_paths
            .iter()
            .zip(&self.quantized)
            // Another pipeline stage's weight is an empty placeholder here.
            .filter(|(p, q)| dequantized(p) && !q.is_placeholder())
            .map(|(p, q)| (p.clone(), q.dequantize()))
            .collect();
        base.map(&mut Apply {
            stack: Vec::new(),
            deltas,
            weights,
            f,
        })
    }

    /// The base with the adapters merged in for good (`W += s (B A)ᵀ`), detached from the
    /// adapters: what deployment loads. Under QLoRA, every weight is the dequantised one: the
    /// model that was trained and evaluated.
    pub fn merge(&self) -> M {
        self.apply(self.base.clone(), true, true, |w, d| w + d)
    }

    /// The base back from a merged model (`W -= s (B A)ᵀ`), up to float rounding.
    pub fn unmerge(&self, merged: M) -> M {
        self.apply(merged, true, false, |w, d| w - d)
    }

    /// The number of adapter parameters (the trainable ones).
    pub fn trainable_params(&self) -> usize {
        self.adapters.iter().map(Module::num_params).sum()
    }

    /// The number of base parameters (frozen), quantised ones included.
    pub fn base_params(&self) -> usize {
        let quantized: usize = self.quantized.iter().map(|q| q.dims[0] * q.dims[1]).sum();
        self.base.num_params() + quantized
    }

    /// The bytes the frozen base takes: its float parameters, and under QLoRA the 4-bit
    /// weights' codes and scales.
    pub fn base_bytes(&self) -> usize {
        let float = self.base.num_params() * std::mem::size_of::<B::FloatElem>();
        float + self.quantized.iter().map(Nf4Weight::bytes).sum::<usize>()
    }

    /// QLoRA (Dettmers et al. 2023): stores the base's linear weights in NF4 with double
    /// quantisation ([`crate::quant`]), as bitsandbytes' `load_in_4bit` does: every `Linear`
    /// weight except `lm_head` (PEFT's `all-linear`), and every target. Embeddings, norms,
    /// biases and the output layer stay in float. Each such parameter of the base becomes an
    /// empty placeholder, so its float weight is freed; the forward dequantises it on use.
    ///
    /// A weight not initialised yet is initialised first (as the base's module would be), one
    /// at a time; [`load_base`](Lora::load_base) quantises the weights of a file instead.
    /// Idempotent.
    pub fn quantize_base(self) -> Self {
        if !self.quantized.is_empty() {
            return self;
        }
        let targets: std::collections::HashSet<&str> =
            self.targets.iter().map(|t| t.path.as_str()).collect();
        let paths: std::collections::HashSet<String> = candidates::<B, M>(&self.base, self.naming)
            .into_iter()
            .filter(|c| {
                targets.contains(c.path.as_str())
                    || (c.is_weight()
                        && c.dims.len() == 2
                        && matches(crate::ALL_LINEAR, c.module(), &c.container))
            })
            .map(|c| c.path)
            .collect();
        let mut take = Take {
            stack: Vec::new(),
            paths,
            taken: Vec::new(),
        };
        let base = self.base.map(&mut take);
        let (quantized_paths, quantized) = take
            .taken
            .into_iter()
            .map(|(path, w)| (path, Nf4Weight::quantize(w)))
            .unzip();
        Lora {
            base,
            quantized,
            quantized_paths,
            config: LoraConfig {
                qlora: true,
                ..self.config
            },
            ..self
        }
    }

    /// Loads the frozen base from a Hugging Face weights file in the model's naming: every
    /// parameter, except that under QLoRA each 4-bit weight is read, quantised and kept only in
    /// NF4. Under ZeRO-3 each float tensor is sharded as it arrives.
    ///
    /// # Errors
    /// A tensor missing from the file or of another shape (both shapes named).
    pub fn load_base(self, file: &SafetensorsFile) -> Result<Self, LoraError> {
        let skip: std::collections::HashSet<&str> =
            self.quantized_paths.iter().map(String::as_str).collect();
        let base =
            kiln_hf::load_weights_named(self.base, file, self.naming, |path| !skip.contains(path))?;
        let mut quantized = Vec::with_capacity(self.quantized.len());
        for (path, q) in self.quantized_paths.iter().zip(&self.quantized) {
            // Another pipeline stage's weight: nothing of the file goes here.
            if q.is_placeholder() {
                quantized.push(q.clone());
                continue;
            }
            let name = (self.naming)(path);
            let [fan_in, fan_out] = q.dims;
            // Quantised in nn.Linear's [out, in]: the file's layout, or its transpose for a
            // Conv1D ([in, out], `transposed` false).
            let file_dims = if name.transposed {
                [fan_out, fan_in]
            } else {
                [fan_in, fan_out]
            };
            let values = file
                .float(&name.name, Some(&file_dims))?
                .into_vec::<f32>()
                .expect("float() returns f32 data");
            let values = if name.transposed {
                values
            } else {
                transpose(&values, fan_in, fan_out)
            };
            let device = q.codes.val().device();
            quantized.push(Nf4Weight::upload(
                &Nf4Matrix::quantize(&values, fan_out, fan_in),
                &device,
            ));
        }
        Ok(Lora {
            base,
            quantized,
            ..self
        })
    }

    /// The base's float parameters as candidates, for naming checks.
    pub(crate) fn candidates(&self) -> Vec<Candidate> {
        candidates::<B, M>(&self.base, self.naming)
    }
}

impl<B: LowRankOps, M: Module<B>> Lora<B, M> {
    /// The base with a LoRA weight standing for `W + s Aᵀ Bᵀ` in place of each target,
    /// differentiable in the adapters: the model to run forward. Its `Linear`s compute PEFT's
    /// `x W + s (drop(x) Aᵀ) Bᵀ`, with the config's dropout while the adapters train, and
    /// their backward gives the adapters their gradients without forming the weight's
    /// (`kiln_shard::lowrank`). Cheap: untouched parameters are shared, and under QLoRA each
    /// 4-bit weight is dequantised.
    pub fn merged(&self) -> M {
        self.merged_where(|_| true)
    }

    /// [`merged`](Lora::merged) at the paths `keep` accepts only (targets and QLoRA weights);
    /// the rest of the base as it is: a pipeline stage's units read only their own weights.
    fn merged_where(&self, keep: impl Fn(&str) -> bool) -> M {
        let (s, p) = (self.scaling(), self.config.dropout);
        let factors = self
            .targets
            .iter()
            .zip(&self.adapters)
            .filter(|(t, _)| keep(&t.path))
            .map(|(t, a)| (t.path.clone(), (a.a.val(), a.b.val())))
            .collect();
        self.map_targets(self.base.clone(), keep, factors, |w, (a, b)| {
            let weight = B::lora_weight(
                w.into_primitive().tensor(),
                a.into_primitive().tensor(),
                b.into_primitive().tensor(),
                s,
                p,
            );
            Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(weight))
        })
    }
}

/// A language model with adapters is a language model: its forward runs on the LoRA weights.
impl<B: LowRankOps, M: Module<B> + kiln_model::CausalLm<B>> kiln_model::CausalLm<B> for Lora<B, M> {
    fn forward(&self, input_ids: Tensor<B, 2, burn::tensor::Int>) -> Tensor<B, 3> {
        self.merged().forward(input_ids)
    }
    fn vocab_size(&self) -> usize {
        self.base.vocab_size()
    }
    fn max_seq_len(&self) -> Option<usize> {
        self.base.max_seq_len()
    }
}

/// A model with adapters runs in its base's units (for pipeline stages): each unit reads the
/// base's parameters under `base.`, the adapters of the targets among them (`adapters.i`) and
/// their QLoRA weights (`quantized.j`), and runs on its own weights merged with their adapters.
impl<B, M> kiln_model::Staged<B> for Lora<B, M>
where
    B: LowRankOps,
    M: Module<B> + burn::module::ModuleDisplay + kiln_model::Staged<B>,
{
    fn units(&self) -> Vec<kiln_model::Unit> {
        self.base
            .units()
            .into_iter()
            .map(|u| {
                let base = u.params.iter().map(|p| format!("base.{p}"));
                let adapters = (self.targets.iter().enumerate())
                    .filter(|(_, t)| u.uses(&t.path))
                    .map(|(i, _)| format!("adapters.{i}"));
                let quantized = (self.quantized_paths.iter().enumerate())
                    .filter(|(_, path)| u.uses(path))
                    .map(|(j, _)| format!("quantized.{j}"));
                let params = base.chain(adapters).chain(quantized).collect();
                kiln_model::Unit {
                    name: u.name.clone(),
                    params,
                }
            })
            .collect()
    }

    fn forward_units(
        &self,
        units: std::ops::Range<usize>,
        x: kiln_model::Carry<B>,
    ) -> kiln_model::Carry<B> {
        let all = self.base.units();
        let ran = &all[units.clone()];
        self.merged_where(|path| ran.iter().any(|u| u.uses(path)))
            .forward_units(units, x)
    }
}
