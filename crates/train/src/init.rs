//! Initial weights that depend only on the seed and each parameter's name: the same model on
//! one rank or many, under any strategy, with nothing but this rank's shard ever computed.
//!
//! Burn's initialisers draw from a backend-wide generator, whose stream depends on how many
//! tensors were created before (and, with ranks as threads, on their interleaving). Here every
//! element is a hash of (seed, parameter path, element index), so a ZeRO-3 rank computes exactly
//! the range it holds. The scheme is GPT-2's: normal(0, 0.02) for matrices and embeddings,
//! zeros for biases, ones for normalisation gains.

use crate::data::mix;
use kiln_comm::hash::fnv1a;
use kiln_shard::pieces::held_range;
use kiln_shard::{Shard, ShardTensor};
use std::f64::consts::TAU;

/// Standard deviation of matrices and embeddings.
const STD: f64 = 0.02;

/// The values of elements `range` of parameter `path`, of rank `dims`.
pub fn values(seed: u64, path: &str, dims: usize, range: std::ops::Range<usize>) -> Vec<f32> {
    let name = path.rsplit('.').next().unwrap_or(path);
    if dims == 1 {
        let v = if matches!(name, "bias" | "beta") {
            0.0
        } else {
            1.0
        };
        return vec![v; range.len()];
    }
    let key = mix(seed ^ fnv1a(path.as_bytes()));
    range
        .map(|i| {
            // Box-Muller on two uniform draws hashed from the element index.
            let h1 = mix(key.wrapping_add(2 * i as u64));
            let h2 = mix(key.wrapping_add(2 * i as u64 + 1));
            let u1 = ((h1 >> 11) as f64 + 1.0) / (1u64 << 53) as f64; // (0, 1]
            let u2 = (h2 >> 11) as f64 / (1u64 << 53) as f64;
            (STD * (-2.0 * u1.ln()).sqrt() * (TAU * u2).cos()) as f32
        })
        .collect()
}

/// Replaces every parameter of `model` by its seeded initial value (this rank's range only).
pub fn init<B, AB, M>(model: M, seed: u64) -> M
where
    B: burn::tensor::backend::Backend,
    AB: burn::tensor::backend::AutodiffBackend<InnerBackend = Shard<B>>,
    M: burn::module::AutodiffModule<AB>,
{
    kiln_shard::pieces::map_params::<B, AB, M>(model, |path, t: &ShardTensor<B>| {
        use burn::tensor::TensorMetadata;
        values(seed, path, t.shape().num_dims(), held_range(t))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_a_slice_of_the_whole_and_the_scale_is_right() {
        let whole = values(5, "blocks.0.attn.c_attn.weight", 2, 0..10_000);
        assert_eq!(
            values(5, "blocks.0.attn.c_attn.weight", 2, 3000..3500),
            whole[3000..3500]
        );
        assert_ne!(
            values(6, "blocks.0.attn.c_attn.weight", 2, 0..10),
            whole[..10]
        );
        let mean = whole.iter().map(|&v| v as f64).sum::<f64>() / whole.len() as f64;
        let var = whole
            .iter()
            .map(|&v| (v as f64 - mean).powi(2))
            .sum::<f64>()
            / whole.len() as f64;
        assert!(
            mean.abs() < 1e-3 && (var.sqrt() - STD).abs() < 1e-3,
            "{mean} {var}"
        );
        assert_eq!(values(5, "ln_f.gamma", 1, 0..3), vec![1.0; 3]);
        assert_eq!(values(5, "ln_f.beta", 1, 0..3), vec![0.0; 3]);
        assert_eq!(values(5, "mlp.c_fc.bias", 1, 0..3), vec![0.0; 3]);
    }
}
