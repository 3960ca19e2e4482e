//! Plain Burn beside kiln in one build: `Autodiff<Flex>` (no kiln decorator) still trains,
//! although kiln turns on Burn's `distributed` feature (kiln's burn-autodiff looks gradient-sync
//! hooks up at run time instead of requiring them of every backend), and it computes what
//! kiln's stack computes on one device, bit for bit, for a model without `exp` or `sigmoid`
//! (kiln computes those two with vectorised kernels of its own, rounded once from f64).

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    a: Linear<B>,
    b: Linear<B>,
    act: Relu,
}

fn mlp<B: Backend>() -> Mlp<B> {
    let device = Default::default();
    let fill = |shape: [usize; 2], salt: usize| {
        let v: Vec<f32> = (0..shape[0] * shape[1])
            .map(|i| ((((i * 7919 + salt * 104_729) % 1000) as f32 / 500.0) - 1.0) * 0.3)
            .collect();
        Tensor::<B, 2>::from_data(TensorData::new(v, shape), &device)
    };
    let mut a = LinearConfig::new(4, 8).init(&device);
    let mut b = LinearConfig::new(8, 2).init(&device);
    a.weight = burn::module::Param::from_tensor(fill([4, 8], 1));
    a.bias = Some(burn::module::Param::from_tensor(
        fill([1, 8], 2).reshape([8]),
    ));
    b.weight = burn::module::Param::from_tensor(fill([8, 2], 3));
    b.bias = Some(burn::module::Param::from_tensor(
        fill([1, 2], 4).reshape([2]),
    ));
    Mlp { a, b, act: Relu }
}

/// Five AdamW steps of `Mlp` on `AB`: the losses.
fn train<AB: AutodiffBackend>() -> Vec<f32>
where
    Mlp<AB>: AutodiffModule<AB>,
{
    let device = Default::default();
    let mut model = mlp::<AB>();
    let mut optim = AdamWConfig::new().init::<AB, Mlp<AB>>();
    let x: Vec<f32> = (0..24).map(|i| (i % 7) as f32 / 3.0 - 1.0).collect();
    let y: Vec<f32> = (0..12).map(|i| (i % 3) as f32 / 2.0).collect();
    let x = Tensor::<AB, 2>::from_data(TensorData::new(x, [6, 4]), &device);
    let y = Tensor::<AB, 2>::from_data(TensorData::new(y, [6, 2]), &device);
    let mut losses = Vec::new();
    for _ in 0..5 {
        let out = model
            .b
            .forward(model.act.forward(model.a.forward(x.clone())));
        let loss = (out - y.clone()).powi_scalar(2).mean();
        losses.push(loss.clone().into_scalar().elem::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    losses
}

#[test]
fn plain_autodiff_flex_trains_beside_kiln_and_equals_kiln_on_one_device() {
    let plain = train::<Autodiff<Flex>>();
    let kiln = train::<kiln::Train<Flex>>();
    assert!(plain[4] < plain[0], "plain Burn did not learn: {plain:?}");
    assert_eq!(plain, kiln, "plain Burn {plain:?} vs kiln {kiln:?}");
}
