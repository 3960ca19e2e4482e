//! Per-unit compute cost, measured on this machine: for cutting a model whose units cost unlike
//! their parameter counts. An embedding holds many parameters and costs a gather; a tied head
//! holds none of its own and costs the model's largest matmul; a block's attention grows with
//! the sequence while its parameters do not.

use crate::PipeError;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor};
use kiln_comm::{ProcessGroup, ReduceOp};
use kiln_model::{Carry, Staged};
use std::time::Instant;

/// Microseconds each unit's forward and backward take together on `tokens` (a micro-batch of
/// token ids), as a pipeline stage runs them: the unit's input a leaf whose gradient is
/// computed, the last unit's output fed to `loss` (the loss's forward and backward are the
/// last stage's too). The best of `repeats` passes through the whole model, then the largest
/// over the ranks of `group`, so that every rank cuts the model alike (pass the job's world
/// group). Feed the result to [`Split::Costs`](crate::Split).
///
/// Backward is timed, not assumed twice the forward: the two differ by unit (an embedding's
/// backward is a scatter into a large table; a head's, two matmuls as large as its forward).
///
/// Every rank of `group` must call it; the model must hold all of its parameters and not be
/// sharded yet (call it before [`Pipeline::new`](crate::Pipeline::new)).
///
/// # Errors
/// A backend that cannot synchronise its device, or a failed all-reduce.
pub fn measure_costs<AB: AutodiffBackend, M: Staged<AB>>(
    model: &M,
    tokens: Tensor<AB, 2, Int>,
    loss: impl Fn(Tensor<AB, 3>) -> Tensor<AB, 1>,
    group: &dyn ProcessGroup,
    repeats: usize,
) -> Result<Vec<u64>, PipeError> {
    let device = tokens.device();
    let units = model.units().len();
    let sync =
        || AB::sync(&device).map_err(|e| PipeError::Config(format!("measuring unit costs: {e:?}")));
    let mut best = vec![f64::MAX; units];
    for _ in 0..repeats.max(1) {
        let mut carry = Carry::Tokens(tokens.clone());
        for (u, best) in best.iter_mut().enumerate() {
            sync()?;
            let start = Instant::now();
            let out = model.forward_units(u..u + 1, carry).hidden();
            // The gradient a stage receives for its output is dense: a sum's is all ones.
            let root = match u + 1 == units {
                true => loss(out.clone()),
                false => out.clone().sum(),
            };
            drop(root.backward());
            sync()?;
            *best = best.min(start.elapsed().as_secs_f64());
            carry = Carry::Hidden(out.detach().require_grad());
        }
    }
    let mut micros: Vec<f32> = best.iter().map(|s| (s * 1e6) as f32).collect();
    group
        .all_reduce((&mut micros[..]).into(), ReduceOp::Max)
        .map_err(|e| PipeError::Comm {
            stage: group.rank(),
            what: "agreeing on the measured unit costs".into(),
            source: Box::new(e),
        })?;
    // At least 1 µs each, so that no unit is free to move.
    Ok(micros.iter().map(|&m| (m.round() as u64).max(1)).collect())
}
