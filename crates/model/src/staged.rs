//! A model as a sequence of units, so that a pipeline can cut it into stages.
//!
//! Pipeline parallelism runs a model's units on different ranks: rank 0 the first few, rank 1
//! the next, and so on, each handing its output to the next. kiln's sharding needs nothing from
//! a model; a pipeline needs one thing, the order in which the model's parts run and which
//! parameters each uses. That is [`Staged`]: a list of [`Unit`]s and a forward that runs any
//! contiguous range of them. The model's own `forward` should be `forward_units` over all units,
//! so that the pipelined and the whole model compute the same thing by construction.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use std::ops::Range;

/// What flows between units: token ids into the first, hidden states `[batch, seq, d]` between
/// units, logits `[batch, seq, vocab]` out of the last.
#[derive(Debug, Clone)]
pub enum Carry<B: Backend> {
    /// Token ids `[batch, seq]`.
    Tokens(Tensor<B, 2, Int>),
    /// A float activation (hidden states, or the last unit's logits).
    Hidden(Tensor<B, 3>),
}

impl<B: Backend> Carry<B> {
    /// The hidden states.
    ///
    /// # Panics
    /// If this is token ids: a unit past the first received the model's input.
    pub fn hidden(self) -> Tensor<B, 3> {
        match self {
            Carry::Hidden(x) => x,
            Carry::Tokens(_) => panic!("a unit past the first was given token ids"),
        }
    }

    /// The token ids.
    ///
    /// # Panics
    /// If this is a float activation: the first unit was given hidden states.
    pub fn tokens(self) -> Tensor<B, 2, Int> {
        match self {
            Carry::Tokens(t) => t,
            Carry::Hidden(_) => panic!("the first unit was given hidden states, not token ids"),
        }
    }
}

/// One unit of a [`Staged`] model: a name for reports and the parameters it uses, as Burn
/// module paths or their prefixes (`transformer.h.3` covers every parameter of block 3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// The unit's name in placement reports.
    pub name: String,
    /// The module paths (or prefixes at a `.`) of the parameters the unit reads. A parameter
    /// read by two units (a head tied to the embedding) is listed by both.
    pub params: Vec<String>,
}

impl Unit {
    /// A unit named `name` reading the parameters under `params`.
    pub fn new(name: impl Into<String>, params: &[&str]) -> Unit {
        Unit {
            name: name.into(),
            params: params.iter().map(|p| p.to_string()).collect(),
        }
    }

    /// Whether the parameter at `path` is one this unit reads.
    pub fn uses(&self, path: &str) -> bool {
        self.params.iter().any(|p| {
            path == p
                || path
                    .strip_prefix(p.as_str())
                    .is_some_and(|rest| rest.starts_with('.'))
        })
    }
}

/// A model that runs as a sequence of [`Unit`]s: token ids in, logits out. kiln's GPT-2 and
/// Llama implement it (embedding, one unit per block, final norm and head); any Burn model whose
/// forward is such a chain can.
///
/// What a model may not do: pass anything but one `[batch, seq, d]` tensor from a unit to the
/// next (the causal mask, rotary tables and positions are rebuilt by each unit from the shape),
/// or read, in one unit, a parameter not listed in that unit.
pub trait Staged<B: Backend>: Module<B> {
    /// The units in forward order.
    fn units(&self) -> Vec<Unit>;

    /// Runs the units `units` (a range of [`units`](Staged::units)) on `x`: token ids when the
    /// range starts at 0, else the previous unit's output.
    fn forward_units(&self, units: Range<usize>, x: Carry<B>) -> Carry<B>;
}

#[cfg(test)]
mod tests {
    use super::Unit;

    #[test]
    fn a_unit_uses_the_parameters_under_its_prefixes_only() {
        let u = Unit::new("h.1", &["transformer.h.1", "lm_head.weight"]);
        assert!(u.uses("transformer.h.1.attn.c_attn.weight"));
        assert!(u.uses("lm_head.weight"));
        assert!(!u.uses("transformer.h.10.attn.c_attn.weight"));
        assert!(!u.uses("transformer.h.1x"));
        assert!(!u.uses("transformer.h"));
    }
}
