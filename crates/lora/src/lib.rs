//! LoRA adapters (Hu et al. 2021) for any Burn module, without changing its type or code.
//!
//! ```text
//! let model = lora(model, &LoraConfig { r: 8, alpha: 16.0, targets: vec!["q_proj".into()], ..Default::default() },
//!                  <Llama<B> as HfNaming>::hf_tensor, &device)?;
//! let logits = model.merged().forward(ids);   // W + (alpha/r)·(B A)ᵀ on each target
//! model.save_peft(dir, "my-base")?;            // PEFT's adapter_config.json + adapter_model.safetensors
//! ```
//!
//! - [`lora`] finds the targets by parameter path ([`config::matches`]: PEFT's names,
//!   globs, `all-linear`), freezes the base (no gradients, so no optimizer state) and adds an
//!   [`Adapter`] per target: `A` `[r, in]` Kaiming-uniform, `B` `[out, r]` zero.
//! - [`Lora`] is itself a Burn module whose only trainable parameters are the adapters: Burn's
//!   optimizers, kiln's sharding (`kiln_shard::shard`: the frozen base sharded under ZeRO-3, the
//!   adapters replicated or sharded like any parameter) and `kiln_shard::step` take it as it is.
//! - [`load_peft`] / [`Lora::save_peft`]: PEFT's files; [`Lora::merge`] / [`Lora::unmerge`].
//! - QLoRA ([`LoraConfig::qlora`], [`Lora::quantize_base`], [`Lora::load_base`]): the base's
//!   linear weights in NF4 with double quantisation ([`quant`]), dequantised on use.
//!
//! # The key decision: LoRA weights the model's `Linear`s compute with as PEFT does
//! PEFT replaces each targeted `nn.Linear` with a layer computing `base(x) + s B A drop(x)`;
//! kiln cannot replace a layer of a model whose code it does not own. Instead the forward runs
//! on the base module with each targeted weight replaced by a LoRA weight
//! ([`Lora::merged`], `kiln_shard::lowrank::LowRankOps::lora_weight`) standing for
//! `W + s Aᵀ Bᵀ`, unformed. Burn's `Linear` calls the backend's `linear` op, which kiln's
//! decorator implements: on a LoRA weight it computes `x W + s (drop(x) Aᵀ) Bᵀ` forward, and
//! backward gives `A` and `B` their gradients by thin products of `x` and `dy` (the weight's
//! `[in, out]` gradient is never formed; the frozen `W` gets none). Dropout (PEFT's
//! `lora_dropout`) is on the adapter's input only. A target used other than through `Linear`
//! sees `W + s Aᵀ Bᵀ` formed, exact without dropout and an error with it.
#![warn(missing_docs)]

pub mod config;
mod error;
mod model;
mod peft;
pub mod quant;
pub mod verify;

pub use config::{ALL_LINEAR, LoraConfig};
pub use error::LoraError;
pub use model::{Adapter, Lora, Naming, Target, burn_names, find_targets, lora};
pub use peft::{ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_peft, peft_key};
pub use verify::{Check, verify_lora};

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig, Relu};
    use burn::tensor::{Distribution, Tensor, TensorData};
    use kiln::{Flex, Train};

    type B = Train<Flex>;

    /// A burn-nn model kiln does not know.
    #[derive(Module, Debug)]
    struct Mlp<B: burn::tensor::backend::Backend> {
        up: Linear<B>,
        down: Linear<B>,
        act: Relu,
    }

    impl<B: burn::tensor::backend::Backend> Mlp<B> {
        fn new(device: &B::Device) -> Self {
            // `no_grad` initialises Burn's lazy parameters: clones of an uninitialised
            // parameter would each draw their own values.
            Mlp {
                up: LinearConfig::new(6, 10).init(device),
                down: LinearConfig::new(10, 3).init(device),
                act: Relu,
            }
            .no_grad()
        }
        fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
            self.down.forward(self.act.forward(self.up.forward(x)))
        }
    }

    fn config(targets: &[&str]) -> LoraConfig {
        LoraConfig {
            r: 2,
            alpha: 6.0,
            targets: targets.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    /// Flex's random numbers come from one process-wide generator: tests that draw hold this,
    /// so that the dropout test's re-seeded draws are not interleaved with another test's.
    fn rng() -> std::sync::MutexGuard<'static, ()> {
        static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
        RNG.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn max_diff<const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> f32 {
        (a - b).abs().max().into_scalar()
    }

    #[test]
    fn forward_is_base_plus_scaled_low_rank_and_only_adapters_learn() {
        let _rng = rng();
        let device = Default::default();
        let base = Mlp::<B>::new(&device);
        let mut model = lora(base.clone(), &config(&["up"]), burn_names, &device).unwrap();
        assert_eq!(model.targets.len(), 1);
        assert_eq!(model.trainable_params(), 2 * 6 + 10 * 2);
        // B starts at zero: the model starts as its base.
        let x = Tensor::<B, 2>::random([4, 6], Distribution::Normal(0.0, 1.0), &device);
        assert_eq!(
            max_diff(model.merged().forward(x.clone()), base.forward(x.clone())),
            0.0
        );
        // With B drawn too, the forward is PEFT's base(x) + s (x Aᵀ) Bᵀ.
        model.adapters[0].b = burn::module::Param::from_tensor(Tensor::random(
            [10, 2],
            Distribution::Normal(0.0, 1.0),
            &device,
        ));
        let (a, b) = (model.adapters[0].a.val(), model.adapters[0].b.val());
        let up = base.up.forward(x.clone())
            + x.clone()
                .matmul(a.clone().transpose())
                .matmul(b.clone().transpose())
                .mul_scalar(3.0);
        let want = base.down.forward(burn::tensor::activation::relu(up));
        let got = model.merged().forward(x.clone());
        assert!(max_diff(got.clone(), want) < 1e-5);
        // Gradients reach the adapters only.
        let grads = got.sum().backward();
        assert!(model.adapters[0].a.val().grad(&grads).is_some());
        assert!(model.adapters[0].b.val().grad(&grads).is_some());
        assert!(model.base.up.weight.val().grad(&grads).is_none());
        assert!(model.base.down.weight.val().grad(&grads).is_none());
        // Merge, then unmerge.
        let merged = model.merge();
        assert!(max_diff(merged.forward(x.clone()), model.merged().forward(x.clone())) < 1e-5);
        let back = model.unmerge(merged);
        assert!(max_diff(back.up.weight.val(), base.up.weight.val()) < 1e-6);
    }

    /// PEFT's `lora_dropout`: `base(x) + s B A drop(x)`, one mask per target, on the adapter's
    /// input only; gradients of the adapters and of the input as autodiff gives them for that
    /// formula written out with the same masks.
    #[test]
    fn dropout_is_on_the_adapter_input_with_exact_gradients() {
        let _rng = rng();
        use burn::module::AutodiffModule;
        use burn::tensor::backend::Backend as _;
        let device = Default::default();
        let base = Mlp::<B>::new(&device);
        let config = LoraConfig {
            dropout: 0.5,
            ..config(&["up", "down"])
        };
        let mut model = lora(base.clone(), &config, burn_names, &device).unwrap();
        for (adapter, out) in model.adapters.iter_mut().zip([10, 3]) {
            adapter.b = burn::module::Param::from_tensor(Tensor::random(
                [out, 2],
                Distribution::Normal(0.0, 1.0),
                &device,
            ));
        }
        let x = Tensor::<B, 2>::random([5, 6], Distribution::Normal(0.0, 1.0), &device);
        let weights = Tensor::<B, 2>::random([5, 3], Distribution::Normal(0.0, 1.0), &device);

        B::seed(&device, 11);
        let x_got = x.clone().require_grad();
        let got = model.merged().forward(x_got.clone());
        let grads = (got.clone() * weights.clone()).sum().backward();

        // The same draws, in the order the forward made them: `up`'s input, then `down`'s.
        B::seed(&device, 11);
        let mask = |shape: [usize; 2]| {
            Tensor::<B, 2>::random(shape, Distribution::Bernoulli(0.5), &device).mul_scalar(2.0)
        };
        let (mask_up, mask_down) = (mask([5, 6]), mask([5, 10]));
        assert!(mask_up.clone().equal_elem(0.0).any().into_scalar());
        let factor = |i: usize| {
            let a: &Adapter<B> = &model.adapters[i];
            (
                a.a.val().detach().require_grad(),
                a.b.val().detach().require_grad(),
            )
        };
        let ((a_up, b_up), (a_down, b_down)) = (factor(0), factor(1));
        let x_want = x.clone().require_grad();
        let low = |x: Tensor<B, 2>, a: &Tensor<B, 2>, b: &Tensor<B, 2>| {
            x.matmul(a.clone().transpose())
                .matmul(b.clone().transpose())
                .mul_scalar(3.0)
        };
        let h = burn::tensor::activation::relu(
            base.up.forward(x_want.clone()) + low(x_want.clone() * mask_up, &a_up, &b_up),
        );
        let want = base.down.forward(h.clone()) + low(h * mask_down, &a_down, &b_down);
        let want_grads = (want.clone() * weights).sum().backward();

        assert!(max_diff(got.clone(), want.clone()) < 1e-5);
        let grad =
            |t: &Tensor<B, 2>, g: &<B as burn::tensor::backend::AutodiffBackend>::Gradients| {
                Tensor::<B, 2>::from_inner(t.grad(g).expect("a gradient"))
            };
        for (got_t, want_t) in [
            (&model.adapters[0].a.val(), &a_up),
            (&model.adapters[0].b.val(), &b_up),
            (&model.adapters[1].a.val(), &a_down),
            (&model.adapters[1].b.val(), &b_down),
            (&x_got, &x_want),
        ] {
            let (g, w) = (grad(got_t, &grads), grad(want_t, &want_grads));
            let scale = w.clone().abs().max().into_scalar();
            assert!(scale > 1e-3);
            // Relative: the products are summed in another order.
            let d = max_diff(g, w) / scale;
            assert!(d < 1e-6, "{d}");
        }
        // Without dropout the output would differ: the masks were applied.
        let plain = lora(
            base.clone(),
            &LoraConfig {
                dropout: 0.0,
                ..config.clone()
            },
            burn_names,
            &device,
        )
        .unwrap();
        let plain = Lora {
            adapters: model.adapters.clone(),
            ..plain
        };
        assert!(max_diff(plain.merged().forward(x.clone()), got) > 1e-3);
        // Evaluation (no autodiff) has no dropout.
        let eval = model.valid().merged().forward(x.clone().inner());
        let plain = plain.merged().forward(x).inner();
        assert!((eval - plain).abs().max().into_scalar() < 1e-5);
    }

    /// A LoRA target with dropout used twice in one forward has two inputs and one mask slot:
    /// named, never trained on a wrong gradient.
    #[test]
    #[should_panic(expected = "used by two Linear calls in one forward")]
    fn dropout_on_a_layer_called_twice_is_refused() {
        let _rng = rng();
        let device = Default::default();
        let base = Mlp::<B>::new(&device);
        let config = LoraConfig {
            dropout: 0.1,
            ..config(&["up"])
        };
        let model = lora(base, &config, burn_names, &device).unwrap();
        let merged = model.merged();
        let x = Tensor::<B, 2>::random([2, 6], Distribution::Normal(0.0, 1.0), &device);
        let _ = merged.up.forward(x.clone()) + merged.up.forward(x);
    }

    #[test]
    fn bad_targets_are_named() {
        let _rng = rng();
        let device = Default::default();
        let base = Mlp::<B>::new(&device);
        let err = lora(base.clone(), &config(&["q_proj"]), burn_names, &device).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("'q_proj' matches no weight"), "{msg}");
        assert!(msg.contains("up") && msg.contains("down"), "{msg}");
        let err = lora(
            base.clone(),
            &LoraConfig {
                r: 4,
                ..config(&["down"])
            },
            burn_names,
            &device,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("r = 4 does not fit 'down' (weight [10, 3])"),
            "{err}"
        );
        let err = lora(
            base.clone(),
            &LoraConfig {
                dropout: 1.0,
                ..config(&["up"])
            },
            burn_names,
            &device,
        )
        .unwrap_err();
        assert!(err.to_string().contains("dropout 1"), "{err}");
        // Freezing keeps a lazy base lazy (it is loaded later, e.g. after sharding).
        let lazy = Mlp::<B> {
            up: LinearConfig::new(6, 10).init(&device),
            down: LinearConfig::new(10, 3).init(&device),
            act: Relu,
        };
        let frozen = lora(lazy, &config(&["up"]), burn_names, &device).unwrap();
        assert!(!frozen.base.up.weight.is_initialized());
        assert!(!frozen.base.up.weight.val().is_require_grad());
        // all-linear takes both layers.
        let all = lora(base, &config(&[ALL_LINEAR]), burn_names, &device).unwrap();
        let modules: Vec<_> = all.targets.iter().map(|t| t.module.as_str()).collect();
        assert_eq!(modules, ["up", "down"]);
    }

    #[test]
    fn peft_files_round_trip() {
        let _rng = rng();
        let device = Default::default();
        let dir = std::env::temp_dir().join(format!("kiln-lora-rt-{}", std::process::id()));
        let mut model = lora(
            Mlp::<B>::new(&device),
            &config(&["up"]),
            burn_names,
            &device,
        )
        .unwrap();
        model.adapters[0].b = burn::module::Param::from_tensor(Tensor::from_data(
            TensorData::new((0..20).map(|i| i as f32 / 7.0).collect(), [10, 2]),
            &device,
        ));
        model.save_peft(&dir, "mlp").unwrap();
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(ADAPTER_CONFIG)).unwrap())
                .unwrap();
        assert_eq!(written["target_modules"], serde_json::json!(["up"]));
        assert_eq!(written["r"], 2);
        let loaded = load_peft(model.base.clone(), &dir, burn_names, &device).unwrap();
        assert_eq!(loaded.targets, model.targets);
        assert_eq!(loaded.scaling(), 3.0);
        for (x, y) in loaded.adapters.iter().zip(&model.adapters) {
            assert_eq!(x.a.val().into_data(), y.a.val().into_data());
            assert_eq!(x.b.val().into_data(), y.b.val().into_data());
        }
        // Another base: the shapes are named.
        let other = lora(
            Mlp::<B>::new(&device),
            &LoraConfig {
                r: 3,
                ..config(&["up"])
            },
            burn_names,
            &device,
        )
        .unwrap();
        other.save_peft(&dir, "mlp").unwrap();
        std::fs::write(
            dir.join(ADAPTER_CONFIG),
            r#"{"peft_type": "LORA", "r": 2, "lora_alpha": 4}"#,
        )
        .unwrap();
        let err = load_peft(model.base.clone(), &dir, burn_names, &device).unwrap_err();
        assert!(err.to_string().contains("is [3, 6]"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn qlora_runs_on_the_dequantised_base_and_trains_the_adapters() {
        let _rng = rng();
        use crate::quant::{Nf4Matrix, Nf4Weight};
        use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
        let device = Default::default();
        // 100 x 30 weights: 47 blocks, the last one partial.
        let base = Mlp::<B> {
            up: LinearConfig::new(30, 100).init(&device),
            down: LinearConfig::new(100, 3).init(&device),
            act: Relu,
        }
        .no_grad();
        let config = LoraConfig {
            qlora: true,
            ..config(&["up"])
        };
        let mut model = lora(base.clone(), &config, burn_names, &device).unwrap();
        assert!(model.config.qlora);
        // Both linear weights (not only the target) left the base for their 4-bit form, which
        // is the host reference's.
        assert_eq!(model.quantized_paths, ["up.weight", "down.weight"]);
        assert_eq!(model.base.up.weight.val().dims(), [0, 0]);
        assert_eq!(model.base.down.weight.val().dims(), [0, 0]);
        let w = base.up.weight.val();
        let host = Nf4Matrix::quantize(
            &w.clone().transpose().into_data().into_vec::<f32>().unwrap(),
            100,
            30,
        );
        let deq = model.quantized[0].dequantize();
        assert_eq!(deq.dims(), [30, 100]);
        let want =
            Tensor::<B, 2>::from_data(TensorData::new(host.dequantize(), [100, 30]), &device);
        assert_eq!(max_diff(deq.clone(), want.transpose()), 0.0);
        // NF4's error: at most half its widest gap (-1 to -0.696) of a block's scale, not zero.
        let err = max_diff(deq.clone(), w.clone());
        let range: f32 = w.clone().abs().max().into_scalar();
        assert!(err > 0.0 && err < 0.155 * range, "{err} of {range}");
        assert_eq!(model.base_params(), base.num_params());
        // Base bytes: f32 for the biases, about 0.13 of f32 for the weights.
        let (up_bytes, down_bytes) = (model.quantized[0].bytes(), model.quantized[1].bytes());
        assert!(up_bytes * 6 < 3000 * 4, "{up_bytes}");
        assert_eq!(model.base_bytes(), (100 + 3) * 4 + up_bytes + down_bytes);
        // The forward is the base's on the dequantised weights (B is zero).
        let x = Tensor::<B, 2>::random([5, 30], Distribution::Normal(0.0, 1.0), &device);
        let mut on_deq = base.clone();
        on_deq.up.weight = burn::module::Param::from_tensor(deq.clone());
        on_deq.down.weight = burn::module::Param::from_tensor(model.quantized[1].dequantize());
        let y0 = on_deq.forward(x.clone());
        assert_eq!(max_diff(model.merged().forward(x.clone()), y0.clone()), 0.0);
        // Adapters learn the difference to a target; only they get gradients.
        let target = base.forward(x.clone());
        let mut optim = AdamWConfig::new().init();
        let loss0: f32 = (y0 - target.clone()).powf_scalar(2.0).mean().into_scalar();
        let mut loss = loss0;
        for _ in 0..30 {
            let l = (model.merged().forward(x.clone()) - target.clone())
                .powf_scalar(2.0)
                .mean();
            loss = l.clone().into_scalar();
            let grads = l.backward();
            assert!(model.base.down.weight.val().grad(&grads).is_none());
            let grads = GradientsParams::from_grads(grads, &model);
            model = optim.step(1e-2, model, grads);
        }
        assert!(loss < 0.5 * loss0, "{loss0} -> {loss}");
        // Merging gives the dequantised weight plus the update; the codes did not move.
        assert_eq!(
            model.quantized[0].codes.val().into_data(),
            Nf4Weight::<B>::quantize(w).codes.val().into_data()
        );
        let merged = model.merge();
        let d = model.adapters[0].delta(model.scaling());
        assert!(max_diff(merged.up.weight.val(), deq + d) < 1e-6);
        // Quantising again is a no-op.
        let again = model.quantize_base();
        assert_eq!(again.quantized.len(), 2);
    }
}
