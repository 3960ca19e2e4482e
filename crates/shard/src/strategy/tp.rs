//! Tensor-parallel plans: which `Linear` layers are split how, chosen by module path (globs, as
//! LoRA targets), applied to any Burn module without changing its code.
//!
//! Megatron's split: the first matrix of a pair by columns (its output features: each rank
//! computes some heads, some of the MLP's hidden units), the second by rows (its input
//! features), so a transformer block costs one all-reduce after each pair in forward and one
//! before each in backward. The placements then follow the ops (`features::tp`).

use super::buffers::matches_path;
use super::params::replace_primitive;
use crate::core::backend::Shard;
use crate::core::error::ShardError;
use crate::core::host::slice_local;
use crate::core::ops::local;
use crate::core::tensor::ShardTensor;
use crate::features::tp::{Placed, Split, chunk, part_of};
use burn::module::{AutodiffModule, ModuleMapper, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use kiln_comm::ProcessGroup;
use std::sync::Arc;

/// How a `Linear` layer is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Style {
    /// By output features (the weight's columns, and the bias), in `blocks` equal blocks each
    /// cut across the ranks (3 for a fused q/k/v projection: each rank keeps whole heads of
    /// each).
    Colwise {
        /// Blocks of the output features.
        blocks: usize,
    },
    /// By input features (the weight's rows); the bias is added once, after the all-reduce.
    Rowwise,
    /// An `Embedding`'s table by rows (the vocabulary: Megatron's vocabulary-parallel
    /// embedding); a head tied to it is then split by the vocabulary too, and the loss over it
    /// runs on the split logits (loss parallel).
    Vocab,
}

impl std::fmt::Display for Style {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Style::Colwise { blocks: 1 } => write!(f, "colwise"),
            Style::Colwise { blocks } => write!(f, "colwise/{blocks}"),
            Style::Rowwise => write!(f, "rowwise"),
            Style::Vocab => write!(f, "vocab"),
        }
    }
}

impl std::str::FromStr for Style {
    type Err = ShardError;
    fn from_str(s: &str) -> Result<Self, ShardError> {
        let bad = || {
            ShardError::Config(format!(
                "tensor-parallel style {s:?}: expected colwise, colwise/<blocks>, rowwise or \
                 vocab"
            ))
        };
        match s {
            "colwise" => Ok(Style::Colwise { blocks: 1 }),
            "rowwise" => Ok(Style::Rowwise),
            "vocab" => Ok(Style::Vocab),
            _ => {
                let blocks = s.strip_prefix("colwise/").ok_or_else(bad)?;
                match blocks.parse::<usize>() {
                    Ok(blocks) if blocks > 0 => Ok(Style::Colwise { blocks }),
                    _ => Err(bad()),
                }
            }
        }
    }
}

/// Which layers are split how: `(pattern, style)` pairs over module paths, the first match
/// winning. A pattern without a dot matches the last component (`c_fc`); with one, the whole
/// path, `*` matching any run of characters (`h.*.attn.c_attn`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TpPlan {
    /// The rules, in order.
    pub rules: Vec<(String, Style)>,
    /// Megatron's sequence parallelism: between the split layers (norms, residuals, dropout)
    /// activations are split along the tokens over the group, a row-parallel layer's output is
    /// reduce-scattered along them and a column-parallel layer's input all-gathered (the
    /// backward likewise), instead of all-reduced.
    pub sequence_parallel: bool,
}

impl TpPlan {
    /// Megatron's split of kiln's GPT-2: the fused `c_attn` by columns in three blocks (q, k,
    /// v: each rank holds whole heads of each), `c_fc` by columns, both `c_proj` by rows.
    pub fn gpt2() -> Self {
        Self::from_pairs(&[
            ("c_attn", Style::Colwise { blocks: 3 }),
            ("c_fc", Style::Colwise { blocks: 1 }),
            ("c_proj", Style::Rowwise),
        ])
    }

    /// Megatron's split of kiln's Llama: q/k/v/gate/up by columns, o/down by rows.
    pub fn llama() -> Self {
        let col = Style::Colwise { blocks: 1 };
        Self::from_pairs(&[
            ("q_proj", col),
            ("k_proj", col),
            ("v_proj", col),
            ("gate_proj", col),
            ("up_proj", col),
            ("o_proj", Style::Rowwise),
            ("down_proj", Style::Rowwise),
        ])
    }

    /// A plan from `(pattern, style)` pairs.
    pub fn from_pairs(pairs: &[(&str, Style)]) -> Self {
        TpPlan {
            rules: pairs.iter().map(|(p, s)| (p.to_string(), *s)).collect(),
            sequence_parallel: false,
        }
    }

    /// A plan from `pattern=style` items separated by commas
    /// (`c_attn=colwise/3,c_fc=colwise,c_proj=rowwise`).
    ///
    /// # Errors
    /// An item without `=`, or an unknown style.
    pub fn parse(s: &str) -> Result<Self, ShardError> {
        let rules = s
            .split(',')
            .map(str::trim)
            .filter(|i| !i.is_empty())
            .map(|item| {
                let (p, style) = item.split_once('=').ok_or_else(|| {
                    ShardError::Config(format!(
                        "tensor-parallel plan item {item:?}: expected <module pattern>=<style>"
                    ))
                })?;
                Ok((p.trim().to_string(), style.trim().parse()?))
            })
            .collect::<Result<_, ShardError>>()?;
        Ok(TpPlan {
            rules,
            sequence_parallel: false,
        })
    }

    /// The plan with sequence parallelism on or off.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    fn style(&self, module_path: &str) -> Option<(usize, Style)> {
        self.rules
            .iter()
            .enumerate()
            .find(|(_, (p, _))| matches_path(p, module_path))
            .map(|(i, (_, s))| (i, *s))
    }
}

/// What a plan split: `(parameter path, shape, split dimension, blocks)`, in model order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TpReport {
    /// The parameters split.
    pub split: Vec<(String, Vec<usize>, usize, usize)>,
    /// Elements of the split parameters (whole), and of the others (replicated).
    pub split_elements: usize,
    /// Elements of the parameters every rank holds whole.
    pub replicated_elements: usize,
}

impl std::fmt::Display for TpReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let by_dim = |d: usize| self.split.iter().filter(|s| s.2 == d).count();
        write!(
            f,
            "{} parameters split ({} by columns, {} by rows), {} of {} elements",
            self.split.len(),
            by_dim(1) + self.split.iter().filter(|s| s.1.len() == 1).count(),
            by_dim(0) - self.split.iter().filter(|s| s.1.len() == 1).count(),
            self.split_elements,
            self.split_elements + self.replicated_elements
        )
    }
}

/// Splits `model`'s layers over `group` as `plan` says (this rank's part of each split weight
/// and bias; the rest stays whole and replicated). The model must be equal on every rank of
/// the group (same seed or weights loaded), as for data parallelism.
///
/// # Errors
/// A plan pattern matching no `Linear` layer, a layer whose split dimension does not divide
/// into blocks x the group's size, a matched parameter that is not a `Linear`'s.
pub fn tensor_parallel<B, AB, M>(
    model: M,
    plan: &TpPlan,
    group: Arc<dyn ProcessGroup>,
) -> Result<(M, TpReport), ShardError>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
    M: AutodiffModule<AB>,
{
    let mut mapper = Splitter {
        plan,
        group,
        stack: Vec::new(),
        used: vec![false; plan.rules.len()],
        report: TpReport::default(),
        error: None,
    };
    let model = model.map(&mut mapper);
    if let Some(e) = mapper.error {
        return Err(e);
    }
    // The group's ranks compute one model: their random draws (dropout masks) must agree.
    crate::core::scope::draw_over(Some(mapper.group.clone()));
    if let Some(i) = mapper.used.iter().position(|u| !u) {
        return Err(ShardError::Config(format!(
            "tensor-parallel plan pattern {:?} matches no layer of the model",
            plan.rules[i].0
        )));
    }
    Ok((model, mapper.report))
}

struct Splitter<'a> {
    plan: &'a TpPlan,
    group: Arc<dyn ProcessGroup>,
    stack: Vec<(String, String)>,
    used: Vec<bool>,
    report: TpReport,
    error: Option<ShardError>,
}

impl<B, AB> ModuleMapper<AB> for Splitter<'_>
where
    B: Backend,
    AB: AutodiffBackend<InnerBackend = Shard<B>>,
{
    fn enter_module(&mut self, name: &str, container: &str) {
        self.stack.push((name.to_string(), container.to_string()));
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.stack.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let names: Vec<&str> = self.stack.iter().map(|(n, _)| n.as_str()).collect();
        let path = names.join(".");
        let (module, field) = match names.split_last() {
            Some((field, module)) => (module.join("."), *field),
            None => (String::new(), ""),
        };
        // Burn enters a parameter's field with the type of the struct that holds it.
        let container = self.stack.last().map(|(_, c)| c.as_str()).unwrap_or("");
        let dims = param.lazy_shape().to_vec();
        let n = self.group.world_size();
        let Some((rule, style)) = self.plan.style(&module) else {
            self.report.replicated_elements += dims.iter().product::<usize>();
            return param;
        };
        self.used[rule] = true;
        let fits = match style {
            Style::Vocab => container == "Struct:Embedding" && field == "weight",
            _ => container == "Struct:Linear" && matches!(field, "weight" | "bias"),
        };
        if !fits {
            self.error.get_or_insert(ShardError::Config(format!(
                "tensor-parallel plan pattern {:?} ({style}) matches {path} (in {container}): \
                 {} can be split so",
                self.plan.rules[rule].0,
                match style {
                    Style::Vocab => "only an Embedding's table",
                    _ => "only Linear layers",
                }
            )));
            return param;
        }
        let split = match (style, field) {
            (Style::Colwise { blocks }, "weight") => Some(Split { dim: 1, blocks }),
            (Style::Colwise { blocks }, _) => Some(Split { dim: 0, blocks }),
            (Style::Rowwise, "weight") => Some(Split { dim: 0, blocks: 1 }),
            (Style::Rowwise, _) => None,
            (Style::Vocab, _) => Some(Split { dim: 0, blocks: 1 }),
        };
        let Some(split) = split else {
            self.report.replicated_elements += dims.iter().product::<usize>();
            return param;
        };
        if dims.contains(&0) {
            // Another pipeline stage's parameter (an empty placeholder here).
            return param;
        }
        if chunk(dims[split.dim], split, n).is_none() {
            self.error.get_or_insert(ShardError::Config(format!(
                "tensor parallelism over {n} ranks: {path} of shape {dims:?} ({style}) does not \
                 split: dimension {} ({}) is not a multiple of {} block(s) x {n}",
                split.dim, dims[split.dim], split.blocks
            )));
            return param;
        }
        self.report.split_elements += dims.iter().product::<usize>();
        self.report
            .split
            .push((path.clone(), dims, split.dim, split.blocks));
        let group = self.group.clone();
        let sequence = self.plan.sequence_parallel;
        let place = move |t: Tensor<AB, D>| {
            replace_primitive::<B, AB, D>(t, |t: ShardTensor<B>| {
                // A parameter sharded over the data-parallel group (ZeRO-3) keeps its part
                // sharded there: 2-D, each rank holding a shard of its tensor-parallel part.
                let sharded = match &t {
                    ShardTensor::Sharded(s) => Some((s.group.clone(), s.ops.derived())),
                    _ => None,
                };
                let part = part_of::<B>(local(t), split, group.as_ref());
                let store = match sharded {
                    Some((dp, ops)) => ShardTensor::Sharded(slice_local::<B>(part, &dp, ops)),
                    None => ShardTensor::Local(part),
                };
                let p = Placed::from_store(store, split, group.clone());
                ShardTensor::Deferred(Arc::new(p.with_sequence(sequence)))
            })
        };
        let (id, tensor, mapper) = param.consume();
        // Weights loaded later go through the mapper the parameter had (a strategy's), then
        // are split.
        let before = mapper.clone();
        let load = place.clone();
        Param::from_mapped_value(id, place(tensor), mapper)
            .load_mapper(move |t| load(before.on_load(t)))
    }
}
