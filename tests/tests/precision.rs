//! Mixed precision through the decorator: kiln's autocast against PyTorch's on the fixtures,
//! the policy's rule (compute-bound ops in the compute dtype, the rest in f32), ZeRO-3's
//! parameter all-gathers in the compute dtype (half the bytes of f32), and f16 loss scaling's
//! skip taken by every rank alike.

use burn::optim::AdamWConfig;
use burn::tensor::{Int, Tensor, TensorData};
use kiln::{Flex, Train};
use kiln_comm::{LocalGroup, OpKind, ProcessGroup, spawn_ranks};
use kiln_gpt2::Gpt2;
use kiln_hf::{Pretrained, SafetensorsFile};
use kiln_llama::Llama;
use kiln_model::{CausalLm, causal_lm_loss};
use kiln_shard::{LossScale, Precision, ShardConfig, ShardedOptimizer, StepConfig, Strategy};
use std::sync::{Arc, Mutex};

type B = Train<Flex>;

/// One test at a time: the ZeRO-3 tests read group counters and the tests share Flex.
static SERIAL: Mutex<()> = Mutex::new(());

/// `||a - b|| / ||b||` (the fixtures' relative error).
fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        d += f64::from(x - y).powi(2);
        n += f64::from(*y).powi(2);
    }
    (d / n).sqrt()
}

/// The logits as f32 (under autocast they come out of the head's matmul in the compute dtype).
fn values(t: Tensor<B, 3>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("logits")
}

/// (f32, bf16, f16) logits of kiln, and PyTorch autocast's bf16 and f16 logits.
fn logits_of<M: CausalLm<B> + Pretrained<B>>(name: &str) -> [Vec<f32>; 5] {
    let dir = kiln_tests::fixture(name);
    let device = Default::default();
    let model = M::from_pretrained(&dir, &device).expect("fixture model");
    let reference = SafetensorsFile::open(dir.join("reference.safetensors"), "reference").unwrap();
    let torch = SafetensorsFile::open(dir.join("autocast.safetensors"), "autocast").unwrap();
    let ids = Tensor::<B, 2, Int>::from_data(reference.int("input_ids").unwrap(), &device);
    let run = |p: Precision| kiln_shard::autocast(p, || values(model.forward(ids.clone())));
    let torch_logits = |key: &str| {
        torch
            .float(key, None)
            .unwrap()
            .convert::<f32>()
            .to_vec::<f32>()
            .unwrap()
    };
    [
        run(Precision::F32),
        run(Precision::BF16),
        run(Precision::F16),
        torch_logits("logits_bf16"),
        torch_logits("logits_f16"),
    ]
}

fn assert_autocast_parity(name: &str, [f32s, bf16, f16, torch_bf16, torch_f16]: [Vec<f32>; 5]) {
    let (e_bf16, e_f16) = (rel(&bf16, &torch_bf16), rel(&f16, &torch_f16));
    let (moved_bf16, moved_f16) = (rel(&bf16, &f32s), rel(&f16, &f32s));
    println!(
        "{name}: kiln vs PyTorch autocast: bf16 {e_bf16:.2e}, f16 {e_f16:.2e}; \
         kiln's own f32 -> bf16 {moved_bf16:.2e}, -> f16 {moved_f16:.2e}"
    );
    assert!(
        e_bf16 <= 2e-2,
        "{name}: bf16 logits {e_bf16:.2e} from PyTorch's"
    );
    assert!(
        e_f16 <= 2e-3,
        "{name}: f16 logits {e_f16:.2e} from PyTorch's"
    );
    // The policy is on (bf16's 8-bit mantissa moves the logits) and f16 rounds less than bf16.
    assert!(moved_bf16 > 1e-4, "{name}: bf16 changed nothing");
    assert!(
        moved_f16 < moved_bf16,
        "{name}: f16 should round less than bf16"
    );
}

#[test]
fn gpt2_autocast_matches_pytorch() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    assert_autocast_parity("tiny-gpt2", logits_of::<Gpt2<B>>("tiny-gpt2"));
}

#[test]
fn llama_autocast_matches_pytorch() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    assert_autocast_parity("tiny-llama", logits_of::<Llama<B>>("tiny-llama"));
}

/// A matmul under bf16 is the matmul of the bf16-rounded inputs, its result left in bf16; an
/// elementwise op on f32 operands is untouched, a bf16 and an f32 operand meet in f32; outside
/// the scope nothing changes.
#[test]
fn only_compute_bound_ops_are_lowered() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    type K = kiln::Kiln<Flex>;
    let device = Default::default();
    let a = Tensor::<K, 2>::from_floats([[1.001f32, 2.003], [3.007, -0.4999]], &device);
    let b = Tensor::<K, 2>::from_floats([[0.3337f32, 1.0], [-2.0009, 0.1234]], &device);
    let round = |t: &Tensor<K, 2>| {
        let data = t.clone().into_data().to_vec::<f32>().unwrap();
        let rounded: Vec<f32> = data
            .iter()
            .map(|x| burn::tensor::bf16::from_f32(*x).to_f32())
            .collect();
        Tensor::<K, 2>::from_data(TensorData::new(rounded, [2, 2]), &device)
    };
    let want = round(&a)
        .matmul(round(&b))
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let exact = a
        .clone()
        .matmul(b.clone())
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let (product, got, sum, mixed) = kiln_shard::autocast(Precision::BF16, || {
        let product = a.clone().matmul(b.clone());
        (
            product.dtype(),
            product
                .clone()
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .unwrap(),
            (a.clone() + b.clone()).into_data().to_vec::<f32>().unwrap(),
            // A compute-dtype activation meets an f32 one in f32 (PyTorch's promotion).
            (product + a.clone()).dtype(),
        )
    });
    // The product stays in the compute dtype (what autodiff saves is bf16 too).
    assert_eq!(product, burn::tensor::DType::BF16);
    assert_eq!(mixed, burn::tensor::DType::F32);
    // The product accumulates in the inner backend's bf16 matmul: within bf16's rounding of
    // the f32 product of the rounded inputs, and different from the exact product.
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= w.abs() * 8e-3, "{got:?} vs {want:?}");
    }
    assert_ne!(got, exact, "the matmul was not lowered");
    assert_eq!(
        sum,
        (a.clone() + b.clone()).into_data().to_vec::<f32>().unwrap(),
        "an elementwise op was lowered"
    );
    assert_eq!(
        a.matmul(b).into_data().to_vec::<f32>().unwrap(),
        exact,
        "outside autocast"
    );
}

/// A tiny Llama trained 4 steps under ZeRO-3 on `world` ranks with `precision`: (losses of
/// rank 0, parameter all-gather bytes sent by rank 0, final parameters).
fn zero3_llama(world: usize, precision: Precision) -> (Vec<f64>, u64, Vec<Vec<f32>>) {
    let dir = kiln_tests::fixture("tiny-llama");
    let results = spawn_ranks(world, |g: LocalGroup| {
        let device = Default::default();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let model: Llama<B> = Llama::from_pretrained(&dir, &device).unwrap();
        let model = kiln_shard::shard(
            model,
            group.clone(),
            // Gathers on the group itself (no communication queue), so its counters see them.
            ShardConfig::new(Strategy::Zero3).with_overlap(false),
        )
        .unwrap();
        let mut optim = ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<B, Llama<B>>());
        let reference =
            SafetensorsFile::open(dir.join("reference.safetensors"), "reference").unwrap();
        let ids = reference.int("input_ids").unwrap();
        let labels = reference.int("labels").unwrap();
        let rows = 2 / world;
        let rank = group.rank();
        let take = |d: &TensorData| {
            let all = d.clone().convert::<i64>().to_vec::<i64>().unwrap();
            let width = all.len() / 2;
            TensorData::new(
                all[rank * rows * width..(rank + 1) * rows * width].to_vec(),
                [rows, width],
            )
        };
        let x = Tensor::<B, 2, Int>::from_data(take(&ids), &device);
        let y = Tensor::<B, 2, Int>::from_data(take(&labels), &device);
        let config = StepConfig {
            precision,
            ..Default::default()
        };
        let before = group.stats();
        let mut model = model;
        let mut losses = Vec::new();
        for _ in 0..4 {
            let (m, stats) = kiln_shard::step(model, &mut optim, 1e-2, &config, |m, _| {
                causal_lm_loss(m.forward(x.clone()), y.clone())
            })
            .expect("a step");
            model = m;
            losses.push(stats.loss);
        }
        let gathered = group
            .stats()
            .since(&before)
            .get(OpKind::AllGather)
            .bytes_sent;
        (
            losses,
            gathered,
            kiln_shard::check::params::<Flex, _>(&model),
        )
    });
    results.into_iter().next().expect("rank 0")
}

#[test]
fn zero3_gathers_parameters_in_bf16_half_the_bytes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (f32_losses, f32_bytes, _) = zero3_llama(2, Precision::F32);
    let (bf16_losses, bf16_bytes, bf16_params) = zero3_llama(2, Precision::BF16);
    let (one_losses, _, one_params) = zero3_llama(1, Precision::BF16);
    println!(
        "all-gather bytes sent by rank 0 over 4 steps: f32 {f32_bytes}, bf16 {bf16_bytes}; \
         losses f32 {f32_losses:?}, bf16 {bf16_losses:?}, bf16 one rank {one_losses:?}"
    );
    assert!(f32_bytes > 0);
    assert_eq!(
        bf16_bytes * 2,
        f32_bytes,
        "bf16 gathers send half the bytes"
    );
    // Training still works in bf16, close to f32.
    for (b, f) in bf16_losses.iter().zip(&f32_losses) {
        assert!((b - f).abs() / f <= 1e-2, "bf16 {b} vs f32 {f}");
    }
    assert!(
        bf16_losses[3] < bf16_losses[0],
        "bf16 training lowers the loss"
    );
    // Two ranks against one (ZeRO-3 at world size 1 rounds its parameters alike): the kiln
    // parity bound, though bf16 partial sums are rounded in another order (measured 6.6e-9).
    let flat = |p: &[Vec<f32>]| p.concat();
    let e = rel(&flat(&bf16_params), &flat(&one_params));
    println!("bf16 ZeRO-3 x2 vs x1: parameters {e:.2e}");
    assert!(e <= 1e-5, "bf16 x2 vs x1: {e:.2e}");
}

/// f16 with a loss scale too large for f16: the first steps overflow, and every rank skips
/// them (parameters untouched), halving the scale each time, until the gradients fit; then
/// training goes on and lowers the loss.
#[test]
fn f16_overflow_is_skipped_on_every_rank_and_recovers() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = kiln_tests::fixture("tiny-llama");
    let results = spawn_ranks(2, |g: LocalGroup| {
        let device = Default::default();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let model: Llama<B> = Llama::from_pretrained(&dir, &device).unwrap();
        let model =
            kiln_shard::shard(model, group.clone(), ShardConfig::new(Strategy::Zero3)).unwrap();
        let initial = kiln_shard::check::params::<Flex, _>(&model);
        let mut optim = ShardedOptimizer::<_, Flex>::new(AdamWConfig::new().init::<B, Llama<B>>());
        let reference =
            SafetensorsFile::open(dir.join("reference.safetensors"), "reference").unwrap();
        let x = Tensor::<B, 2, Int>::from_data(reference.int("input_ids").unwrap(), &device);
        let y = Tensor::<B, 2, Int>::from_data(reference.int("labels").unwrap(), &device);
        // Each rank takes one row: the overflow decision must still be the same on both.
        let rank = group.rank();
        let (x, y) = (x.narrow(0, rank, 1), y.narrow(0, rank, 1));
        let mut scale = Some(LossScale {
            scale: 2f64.powi(40),
            ..LossScale::default()
        });
        let mut log = Vec::new();
        let mut model = model;
        // Until the first step that is not skipped, the parameters must stay the initial ones.
        let mut trained = false;
        for _ in 0..40 {
            let config = StepConfig {
                precision: Precision::F16,
                loss_scale: scale,
                clip: Some(1.0),
                ..Default::default()
            };
            let (m, stats) = kiln_shard::step(model, &mut optim, 1e-2, &config, |m, _| {
                causal_lm_loss(m.forward(x.clone()), y.clone())
            })
            .expect("a step");
            model = m;
            trained |= !stats.skipped;
            if !trained {
                assert_eq!(
                    kiln_shard::check::params::<Flex, _>(&model),
                    initial,
                    "a skipped step changed the parameters"
                );
            }
            log.push((stats.skipped, stats.loss, config.loss_scale.unwrap().scale));
            scale = stats.loss_scale;
        }
        log
    });
    assert_eq!(results[0].len(), results[1].len());
    let skips: Vec<Vec<bool>> = results
        .iter()
        .map(|l| l.iter().map(|s| s.0).collect())
        .collect();
    assert_eq!(
        skips[0], skips[1],
        "the ranks disagree on which steps to skip"
    );
    let log = &results[0];
    let skipped = log.iter().take_while(|s| s.0).count();
    println!(
        "f16 from scale 2^40: {skipped} steps skipped, then scale {}; skips {:?}",
        log[skipped].2, skips[0]
    );
    assert!(skipped >= 1, "a 2^40 loss scale should overflow f16");
    for (i, s) in log.iter().take(skipped).enumerate() {
        assert_eq!(
            s.2,
            2f64.powi(40 - i as i32),
            "the scale halves on each overflow"
        );
    }
    let trained: Vec<f64> = log.iter().filter(|s| !s.0).map(|s| s.1).collect();
    assert!(trained.len() >= 10, "training resumed: {log:?}");
    assert!(
        trained.last() < trained.first(),
        "f16 training lowers the loss after recovering: {trained:?}"
    );
}
