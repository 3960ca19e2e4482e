//! Per-unit compute cost, measured on this machine: for cutting a model whose units cost unlike
//! their parameter counts. An embedding holds many parameters and costs a gather; a tied head
//! holds none of its own and costs the model's largest matmul; a block's attention grows with
//! the sequence while its parameters do not.

use crate::PipeError;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use kiln_comm::{ProcessGroup, ReduceOp};
use kiln_hf::{Carry, Staged};
use std::time::Instant;

/// Microseconds each unit's forward takes on `tokens` (a micro-batch of token ids, with the
/// backend's autodiff recording if it has one, as in training): the best of `repeats` passes
/// through the whole model, then the largest over the ranks of `group`, so that every rank cuts
/// the model alike (pass the job's world group). Backward is not timed: it costs about twice a
/// unit's forward for every unit alike. Feed the result to [`Split::Costs`](crate::Split).
///
/// Every rank of `group` must call it; the model must hold all of its parameters (call it
/// before [`Pipeline::new`](crate::Pipeline::new)).
///
/// # Errors
/// A backend that cannot synchronise its device, or a failed all-reduce.
pub fn measure_costs<B: Backend, M: Staged<B>>(
    model: &M,
    tokens: Tensor<B, 2, Int>,
    group: &dyn ProcessGroup,
    repeats: usize,
) -> Result<Vec<u64>, PipeError> {
    let device = tokens.device();
    let units = model.units().len();
    let sync =
        || B::sync(&device).map_err(|e| PipeError::Config(format!("measuring unit costs: {e:?}")));
    let mut best = vec![f64::MAX; units];
    for _ in 0..repeats.max(1) {
        let mut carry = Carry::Tokens(tokens.clone());
        for (u, best) in best.iter_mut().enumerate() {
            sync()?;
            let start = Instant::now();
            carry = model.forward_units(u..u + 1, carry);
            sync()?;
            *best = best.min(start.elapsed().as_secs_f64());
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
