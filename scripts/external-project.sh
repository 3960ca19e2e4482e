#!/usr/bin/env bash
# A fresh project outside kiln's workspace, made from exactly the README's `Cargo.toml` snippet
# (between its `snippet: project` markers) and kiln's Cargo.lock, trains a model under ZeRO-3 on
# 2 ranks and with plain Burn (`Autodiff<Flex>`) side by side, and checks they agree. CI runs it.
#
#     bash scripts/external-project.sh
#
# The project shares kiln's target directory (CARGO_TARGET_DIR, default <checkout>/target), so
# what the workspace already built is reused where the features match.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kiln-external.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/project/src"
snippet=$(awk '/<!-- snippet: project/{on=1; next} /<!-- end snippet -->/{on=0} on' "$root/README.md" |
  sed -e '/^```/d')
if [ -z "$snippet" ]; then
  echo "external-project: no snippet between the README's markers" >&2
  exit 1
fi
# The snippet's `../kiln` is the checkout, written as its absolute path: the same crates as the
# workspace's, so their compiled artifacts are reused where the features match.
{
  printf '[package]\nname = "kiln-user"\nversion = "0.1.0"\nedition = "2024"\npublish = false\n\n'
  printf '%s\n' "$snippet" | sed "s#\"\.\./kiln/#\"$root/#g"
} > "$tmp/project/Cargo.toml"
cp "$root/Cargo.lock" "$tmp/project/Cargo.lock"
cat > "$tmp/project/src/main.rs" <<'RS'
//! A user's program: a burn-nn model trained with plain Burn and with kiln (ZeRO-3, 2 ranks).
use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use kiln::shard::{ShardedOptimizer, StepConfig, Strategy, step};
use kiln::{Mesh, NoStages, ParallelPlan, Train, Whole, parallelize};

fn model<AB: AutodiffBackend>() -> Linear<AB> {
    let device = Default::default();
    let mut l = LinearConfig::new(4, 2).init(&device);
    let w: Vec<f32> = (0..8).map(|i| i as f32 / 10.0 - 0.3).collect();
    l.weight = burn::module::Param::from_tensor(Tensor::from_data(TensorData::new(w, [4, 2]), &device));
    l.bias = Some(burn::module::Param::from_tensor(Tensor::from_data(TensorData::new(vec![0.1f32, -0.2], [2]), &device)));
    l
}

fn batch<AB: AutodiffBackend>(rows: std::ops::Range<usize>) -> (Tensor<AB, 2>, Tensor<AB, 2>) {
    let device = Default::default();
    let n = rows.len();
    let x: Vec<f32> = rows.clone().flat_map(|r| (0..4).map(move |j| ((r * 4 + j) % 5) as f32 / 5.0)).collect();
    let y: Vec<f32> = rows.flat_map(|r| (0..2).map(move |j| ((r + j) % 3) as f32)).collect();
    (Tensor::from_data(TensorData::new(x, [n, 4]), &device), Tensor::from_data(TensorData::new(y, [n, 2]), &device))
}

fn loss<AB: AutodiffBackend>(m: &Linear<AB>, x: Tensor<AB, 2>, y: Tensor<AB, 2>) -> Tensor<AB, 1> {
    (m.forward(x) - y).powi_scalar(2).mean()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Plain Burn, unchanged, in the same build as kiln.
    let mut plain = model::<Autodiff<Flex>>();
    let mut optim = SgdConfig::new().init::<Autodiff<Flex>, Linear<Autodiff<Flex>>>();
    for _ in 0..3 {
        let (x, y) = batch::<Autodiff<Flex>>(0..8);
        let grads = GradientsParams::from_grads(loss(&plain, x, y).backward(), &plain);
        plain = optim.step(1e-1, plain, grads);
    }
    let plain = plain.valid().weight.val().into_data().to_vec::<f32>()?;

    // kiln: ZeRO-3 over 2 ranks as threads, each taking half of the batch.
    let plan = ParallelPlan::new(Strategy::Zero3);
    let ranks = kiln::spawn_ranks(2, |group| {
        let rank = kiln::comm::ProcessGroup::rank(&group);
        let device = Default::default();
        let mesh = Mesh::new(std::sync::Arc::new(group), &plan).expect("a mesh");
        let m = parallelize(model::<Train<Flex>>(), &Whole, &NoStages, &plan, &mesh, &device).expect("parallelized").model;
        let mut optim = ShardedOptimizer::<_, Flex>::new(SgdConfig::new().init());
        let mut m = m;
        for _ in 0..3 {
            let (x, y) = batch::<Train<Flex>>(rank * 4..rank * 4 + 4);
            m = step(m, &mut optim, 1e-1, &StepConfig::default(), |m, _| loss(m, x.clone(), y.clone())).expect("a step").0;
        }
        let m = kiln::shard::gather_model(m);
        m.weight.val().into_data().to_vec::<f32>().expect("f32")
    })?;
    // The same global batch, averaged over 2 ranks instead of at once (SGD: the updates are the
    // gradients, equal up to rounding).
    let worst = plain
        .iter()
        .zip(&ranks[0])
        .map(|(a, b)| (a - b).abs() / a.abs().max(1e-2))
        .fold(0f32, f32::max);
    println!("plain Burn vs kiln ZeRO-3 x2 after 3 steps: largest relative difference {worst:.2e}");
    assert_eq!(ranks[0], ranks[1], "ranks disagree");
    assert!(worst <= 1e-5, "plain Burn and kiln differ by {worst} (relative)");
    Ok(())
}
RS
cd "$tmp/project"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
cargo run --quiet
