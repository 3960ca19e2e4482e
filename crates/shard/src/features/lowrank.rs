//! LoRA's weights as PEFT computes them, reached through a model's own `Linear`s.
//!
//! [`LowRankOps::lora_weight`] gives a model, in place of a frozen weight `W` `[in, out]`, a
//! tensor standing for `W + s Aᵀ Bᵀ` (`A` `[r, in]`, `B` `[out, r]`: PEFT's `lora_A`,
//! `lora_B`) that is never formed when the model uses it through `Linear` (Burn's
//! `module::linear`, which every `burn-nn` `Linear` calls):
//!
//! - forward, `linear(x, ·)` is `x W + s (drop(x) Aᵀ) Bᵀ`: PEFT's `base(x) + s B A drop(x)`,
//!   dropout (`lora_dropout`) on the adapter's input only, one mask per target and forward;
//! - backward, `linear_x_backward` is `dy Wᵀ + s drop'((dy B) A)`, and the weight's gradient
//!   (`linear_weight_backward`) is deferred (the core's [`WeightGrad`]): the op that made
//!   the weight turns `x` and `dy` into `A`'s and `B`'s gradients by thin products
//!   (`s (dy B)ᵀ drop(x)`, `s dyᵀ (drop(x) Aᵀ)`), so the `[in, out]` gradient of a frozen weight
//!   is never computed either.
//!
//! Any other use of the weight (a `matmul`, a transpose, reading it) sees `W + s Aᵀ Bᵀ`
//! formed on demand, and its gradient arrives whole; that is exact without dropout and an
//! error with it (dropout belongs to the adapter's input in one `Linear`, which such a use
//! does not have).
//!
//! Autodiff's side is a custom op ([`Backward`]) whose parents are `A` and `B` only: the frozen
//! base weight receives no gradient.

use crate::core::backend::Shard;
use crate::core::dtype::widen;
use crate::core::ops::{local, record_compute};
use crate::core::scope::{self, Set};
use crate::core::tensor::{DeferWeightGrads, Deferred, LinearArgs, ShardTensor, WeightGrad};
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Distribution, TensorMetadata};
use burn_std::Shape;
use kiln_comm::hash::SplitMix64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

type Prim<B> = <B as burn_backend::BackendTypes>::FloatTensorPrimitive;

/// Backends that can stand a LoRA weight in for a frozen one: kiln's decorator, with and
/// without autodiff.
pub trait LowRankOps: Backend {
    /// A tensor standing for `w + scaling · aᵀ bᵀ` (`w` `[in, out]`, `a` `[r, in]`,
    /// `b` `[out, r]`), used by `Linear` without being formed (see the module docs), with
    /// inverted dropout of probability `dropout` on the adapter's input while the adapters
    /// are being trained.
    fn lora_weight(
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scaling: f64,
        dropout: f64,
    ) -> FloatTensor<Self>;
}

/// `w + scaling · aᵀ bᵀ`, not formed.
pub struct LowRank<B: Backend> {
    w: ShardTensor<B>,
    a: ShardTensor<B>,
    b: ShardTensor<B>,
    scaling: f64,
    /// The dropout probability; 0 outside training.
    dropout: f64,
    /// Whether a `linear` used the weight.
    used: std::sync::atomic::AtomicBool,
    /// The dropout mask of the one `linear` that used the weight (values 0 or 1/(1-p)), kept
    /// for backward.
    mask: Mutex<Option<Prim<B>>>,
    /// While LoRA weights are alive, `linear_weight_backward` defers, for their ops to find
    /// (with none, full fine-tuning is unchanged).
    _defer: DeferWeightGrads,
}

impl<B: Backend> std::fmt::Debug for LowRank<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LowRank")
            .field("shape", &self.w.shape())
            .field("r", &self.a.shape()[0])
            .field("scaling", &self.scaling)
            .field("dropout", &self.dropout)
            .finish()
    }
}

impl<B: Backend> LowRank<B> {
    fn new(
        w: ShardTensor<B>,
        a: ShardTensor<B>,
        b: ShardTensor<B>,
        scaling: f64,
        dropout: f64,
    ) -> Arc<Self> {
        let (ws, as_, bs) = (w.shape(), a.shape(), b.shape());
        assert!(
            ws.num_dims() == 2
                && as_.num_dims() == 2
                && bs.num_dims() == 2
                && as_[1] == ws[0]
                && bs[0] == ws[1]
                && as_[0] == bs[1],
            "kiln: a LoRA weight [in, out] = {:?} needs A [r, in] and B [out, r]; got A {:?}, B {:?}",
            ws.as_slice(),
            as_.as_slice(),
            bs.as_slice()
        );
        assert!(
            (0.0..1.0).contains(&dropout),
            "kiln: LoRA dropout {dropout} is not a probability in [0, 1)"
        );
        Arc::new(LowRank {
            w,
            a,
            b,
            scaling,
            dropout,
            used: std::sync::atomic::AtomicBool::new(false),
            mask: Mutex::new(None),
            _defer: DeferWeightGrads::new(),
        })
    }

    /// The logical shape, `[in, out]`.
    pub fn shape(&self) -> Shape {
        self.w.shape()
    }

    /// The dtype of the base weight.
    pub fn dtype(&self) -> burn_backend::DType {
        self.w.dtype()
    }

    /// `w + s aᵀ bᵀ`, formed (for any use other than `linear`).
    pub fn formed(&self) -> Prim<B> {
        let w = local(self.w.clone());
        let dtype = w.dtype();
        let a = widen::<B>(local(self.a.clone()), dtype);
        let b = widen::<B>(local(self.b.clone()), dtype);
        let delta = B::float_matmul(B::float_swap_dims(a, 0, 1), B::float_swap_dims(b, 0, 1));
        B::float_add(w, B::float_mul_scalar(delta, (self.scaling as f32).into()))
    }

    /// Marks the weight used by a `linear`: a second use under dropout is refused (one mask
    /// slot per target).
    fn claim(&self) {
        let used = self.used.swap(true, Relaxed);
        assert!(
            !used || self.dropout == 0.0,
            "kiln: a LoRA target with dropout {} was used by two Linear calls in one forward (a \
             shared or repeated layer); PEFT's dropout is one mask per layer call, which kiln \
             keeps one of per target: use lora dropout 0 for this model",
            self.dropout
        );
    }

    /// `x`'s dropout mask for this weight's `linear`: drawn when the op first runs, the same
    /// when a memory budget has it run again.
    fn mask_for(&self, x: &Prim<B>) -> Option<Prim<B>> {
        if self.dropout == 0.0 {
            return None;
        }
        let mut slot = self.mask.lock().expect("LoRA mask");
        if let Some(mask) = slot.as_ref() {
            return Some(mask.clone());
        }
        let keep = 1.0 - self.dropout;
        let device = B::float_device(x);
        let draw = match next_mask_seed() {
            Some(seed) => {
                let values = bernoulli(seed, x.shape().num_elements(), keep);
                let data = burn_backend::TensorData::new(values, x.shape());
                widen::<B>(B::float_from_data(data, &device), x.dtype())
            }
            None => B::float_random(
                x.shape(),
                Distribution::Bernoulli(keep),
                &device,
                x.dtype().into(),
            ),
        };
        let mask = B::float_mul_scalar(draw, ((1.0 / keep) as f32).into());
        *slot = Some(mask.clone());
        Some(mask)
    }

    /// The mask the forward drew, if any.
    fn mask(&self) -> Option<Prim<B>> {
        self.mask.lock().expect("LoRA mask").clone()
    }
}

/// Runs `f` with this thread's LoRA dropout masks drawn from kiln's own generator, the `i`-th
/// mask from `(seed, i)`: a step seeded from the run's seed, the step and the rank draws the
/// same masks however the run got there (resumed or not) and whatever other threads draw.
/// Outside, masks come from the backend's generator (Burn's `Backend::seed`).
pub fn masks_seeded<R>(seed: u64, f: impl FnOnce() -> R) -> R {
    scope::with(Set::Draws(Some((seed, 0))), f)
}

fn next_mask_seed() -> Option<u64> {
    let (seed, i) = scope::next_draw()?;
    // The i-th mask of this (seed, step, rank): a seed of its own.
    let draw = |z: u64| SplitMix64(z).next_u64();
    Some(draw(seed ^ draw(i.wrapping_add(0x6c6f_7261))))
}

/// `n` draws of 1 (probability `keep`) or 0 from `seed`.
fn bernoulli(seed: u64, n: usize, keep: f64) -> Vec<f32> {
    let threshold = (keep * (1u64 << 53) as f64) as u64;
    let mut rng = SplitMix64(seed);
    (0..n)
        .map(|_| {
            if rng.next_u64() >> 11 < threshold {
                1.0
            } else {
                0.0
            }
        })
        .collect()
}

/// `t` times the dropout mask (as `t`'s dtype and shape: the input's, or its rows flattened),
/// or `t` without one.
fn dropped<B: Backend>(t: Prim<B>, mask: Option<Prim<B>>) -> Prim<B> {
    match mask {
        Some(m) => {
            let m = B::float_reshape(widen::<B>(m, t.dtype()), t.shape());
            B::float_mul(t, m)
        }
        None => t,
    }
}

/// The adapters' factors `A` `[r, in]` and `B` `[out, r]`, whole, as `dtype`.
fn factors<B: Backend>(w: &LowRank<B>, dtype: burn_backend::DType) -> (Prim<B>, Prim<B>) {
    (
        widen::<B>(local(w.a.clone()), dtype),
        widen::<B>(local(w.b.clone()), dtype),
    )
}

/// `linear(x, w, bias)` of a LoRA weight: `x W + bias + s (drop(x) Aᵀ) Bᵀ`.
fn linear<B: Backend>(
    x: ShardTensor<B>,
    w: Arc<LowRank<B>>,
    bias: Option<ShardTensor<B>>,
) -> ShardTensor<B> {
    w.claim();
    let mut inputs = vec![x];
    let has_bias = bias.is_some();
    inputs.extend(bias);
    record_compute(inputs, move |t| {
        let mut t = t.into_iter();
        let x = t.next().expect("input");
        let bias = has_bias.then(|| t.next().expect("bias"));
        let dtype = x.dtype();
        let mask = w.mask_for(&x);
        let base = widen::<B>(local(w.w.clone()), dtype);
        let (a, b) = factors(&w, dtype);
        let dropped = dropped::<B>(x.clone(), mask);
        let y = B::linear(x, base, bias);
        let low = B::linear(
            B::linear(dropped, B::float_swap_dims(a, 0, 1), None),
            B::float_swap_dims(b, 0, 1),
            None,
        );
        B::float_add(y, B::float_mul_scalar(low, (w.scaling as f32).into()))
    })
}

/// `linear_x_backward` of a LoRA weight: `dy Wᵀ + s drop'((dy B) A)`.
fn linear_x_backward<B: Backend>(w: Arc<LowRank<B>>, dy: ShardTensor<B>) -> ShardTensor<B> {
    let dy = local(dy);
    let dtype = dy.dtype();
    let base = widen::<B>(local(w.w.clone()), dtype);
    let (a, b) = factors(&w, dtype);
    let dx = B::linear_x_backward(base, dy.clone());
    // (dy B) A: `linear` with B [out, r] and A [r, in] as its `[in, out]` weights.
    let low = B::linear(B::linear(dy, b, None), a, None);
    let low = dropped::<B>(low, w.mask());
    ShardTensor::Local(B::float_add(
        dx,
        B::float_mul_scalar(low, (w.scaling as f32).into()),
    ))
}

impl<B: Backend> Deferred<B> for LowRank<B> {
    fn shape(&self) -> Shape {
        self.w.shape()
    }
    fn dtype(&self) -> burn_backend::DType {
        self.w.dtype()
    }
    fn device(&self) -> B::Device {
        self.w.device()
    }
    fn value(&self) -> Prim<B> {
        self.formed()
    }
    #[allow(clippy::result_large_err)]
    fn linear(self: Arc<Self>, x: ShardTensor<B>, bias: Option<ShardTensor<B>>) -> LinearArgs<B> {
        Ok(linear::<B>(x, self, bias))
    }
    fn linear_x_backward(
        self: Arc<Self>,
        dy: ShardTensor<B>,
    ) -> Result<ShardTensor<B>, ShardTensor<B>> {
        Ok(linear_x_backward::<B>(self, dy))
    }
}

/// `x` and `dy` of a deferred weight gradient as `[tokens, in]` and `[tokens, out]`.
fn flat<B: Backend>(g: &WeightGrad<B>, dtype: burn_backend::DType) -> (Prim<B>, Prim<B>) {
    let [fan_in, fan_out] = g.shape().dims();
    let x = widen::<B>(local(g.x.clone()), dtype);
    let dy = widen::<B>(local(g.dy.clone()), dtype);
    let tokens = x.shape().num_elements() / fan_in;
    (
        B::float_reshape(x, Shape::new([tokens, fan_in])),
        B::float_reshape(dy, Shape::new([tokens, fan_out])),
    )
}

/// `A`'s and `B`'s gradients from the weight's: thin products of `x` and `dy` when deferred,
/// the dense formulas otherwise.
fn adapter_grads<B: Backend>(w: &LowRank<B>, grad: ShardTensor<B>) -> (Prim<B>, Prim<B>) {
    let dtype = w.a.dtype();
    let (a, b) = factors(w, dtype);
    let s = (w.scaling as f32).into();
    match grad.deferred::<WeightGrad<B>>() {
        Some(g) => {
            let (x, dy) = flat(&g, dtype);
            let x = dropped::<B>(x, w.mask());
            // dA = s (dy B)ᵀ drop(x)   [r, in];   dB = s dyᵀ (drop(x) Aᵀ)   [out, r].
            let dy_b = B::float_matmul(dy.clone(), b);
            let da = B::float_matmul(B::float_swap_dims(dy_b, 0, 1), x.clone());
            let x_a = B::float_matmul(x, B::float_swap_dims(a, 0, 1));
            let db = B::float_matmul(B::float_swap_dims(dy, 0, 1), x_a);
            (B::float_mul_scalar(da, s), B::float_mul_scalar(db, s))
        }
        None => {
            let whole = grad;
            assert!(
                w.dropout == 0.0,
                "kiln: a LoRA target with dropout {} was used by an op other than one Linear \
                 (its weight was read as a matrix), where the adapter's input is not known: \
                 use lora dropout 0 for this model",
                w.dropout
            );
            // G = dL/dW [in, out]: dA = s Bᵀ Gᵀ, dB = s Gᵀ Aᵀ.
            let g = widen::<B>(local(whole), dtype);
            let gt = B::float_swap_dims(g, 0, 1);
            let da = B::float_matmul(B::float_swap_dims(b, 0, 1), gt.clone());
            let db = B::float_matmul(gt, B::float_swap_dims(a, 0, 1));
            (B::float_mul_scalar(da, s), B::float_mul_scalar(db, s))
        }
    }
}

impl<B: Backend> LowRankOps for Shard<B> {
    fn lora_weight(
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scaling: f64,
        _dropout: f64,
    ) -> FloatTensor<Self> {
        // Without autodiff nothing trains: no dropout.
        ShardTensor::Deferred(LowRank::new(w, a, b, scaling, 0.0))
    }
}

/// Autodiff's op for [`LowRankOps::lora_weight`]: parents `A` and `B`.
#[derive(Debug)]
struct LoraWeight;

impl<B: Backend> Backward<Shard<B>, 2> for LoraWeight {
    type State = Arc<LowRank<B>>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_a, node_b] = ops.parents;
        let grad = grads.consume::<Shard<B>>(&ops.node);
        let (da, db) = adapter_grads(&ops.state, grad);
        if let Some(node) = node_a {
            grads.register::<Shard<B>>(node.id, ShardTensor::Local(da));
        }
        if let Some(node) = node_b {
            grads.register::<Shard<B>>(node.id, ShardTensor::Local(db));
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> LowRankOps for Autodiff<Shard<B>, C> {
    fn lora_weight(
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scaling: f64,
        dropout: f64,
    ) -> FloatTensor<Self> {
        assert!(
            !w.is_tracked(),
            "kiln: a LoRA target's base weight must be frozen (it requires a gradient)"
        );
        match LoraWeight
            .prepare::<C>([a.node.clone(), b.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let weight = LowRank::new(w.primitive, a.primitive, b.primitive, scaling, dropout);
                prep.finish(weight.clone(), ShardTensor::Deferred(weight))
            }
            OpsKind::UnTracked(prep) => prep.finish(ShardTensor::Deferred(LowRank::new(
                w.primitive,
                a.primitive,
                b.primitive,
                scaling,
                0.0,
            ))),
        }
    }
}
