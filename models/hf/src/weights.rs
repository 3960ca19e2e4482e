//! Hugging Face weights for any Burn module: load, save, and per-parameter views in HF names.
//!
//! The safetensors crate is used directly rather than `burn-store`'s `SafetensorsStore`: one naming
//! table per model ([`HfNaming`]) then serves loading, saving, gradient norms and the final-weight
//! comparison of parity checks (burn-store's key remapper covers loading and saving only), the layout
//! is chosen per tensor name (GPT-2's Conv1D `[in, out]` is Burn's own layout, Llama's `nn.Linear`
//! `[out, in]` is transposed, whereas burn-store's adapters transpose by Burn container type), and
//! errors speak in Hugging Face names and shapes.

use crate::{HfError, SafetensorsFile};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

/// Where a Burn parameter lives in a Hugging Face checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HfTensorName {
    /// The tensor name in the checkpoint, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Whether the checkpoint stores the transpose of the Burn parameter (a PyTorch `nn.Linear`
    /// weight is `[out, in]`, Burn's `Linear` is `[in, out]`). Only rank-2 parameters are transposed.
    pub transposed: bool,
}

/// A model whose parameters map one-to-one to Hugging Face tensors.
pub trait HfNaming {
    /// The checkpoint tensor for the Burn parameter at `burn_path` (field names joined by `.`, Vec
    /// indices as numbers, e.g. `model.layers.0.input_layernorm.gamma`).
    fn hf_tensor(burn_path: &str) -> HfTensorName;

    /// Parts of checkpoint tensors (element ranges of the flattened tensor, in the checkpoint's
    /// layout) on which the loss does not depend in exact arithmetic, such as an attention key bias:
    /// it adds `q·b` to every score of a softmax row, which softmax ignores. Their gradient is
    /// rounding noise, which Adam normalises into real updates (`|g| ~ 1e-9` against `eps = 1e-8`
    /// gives steps of ~`0.1 lr`), so their trained values are noise no implementation can reproduce.
    /// Parity checks therefore compare the rest of those tensors, and check that the gradient on
    /// these parts is negligible instead. None by default.
    fn zero_gradient_parts(&self) -> Vec<(String, std::ops::Range<usize>)> {
        Vec::new()
    }
}

/// Tracks the Burn module path through `enter_module`/`exit_module`.
#[derive(Debug, Default)]
struct PathStack(Vec<String>);

impl PathStack {
    fn enter(&mut self, name: &str) {
        self.0.push(name.to_string());
    }
    fn exit(&mut self) {
        self.0.pop();
    }
    fn path(&self) -> String {
        self.0.join(".")
    }
}

fn hf_shape(burn_shape: &[usize], transposed: bool, name: &str) -> Vec<usize> {
    if transposed {
        assert_eq!(
            burn_shape.len(),
            2,
            "naming bug: '{name}' is marked transposed but its Burn shape {burn_shape:?} is not rank 2"
        );
        vec![burn_shape[1], burn_shape[0]]
    } else {
        burn_shape.to_vec()
    }
}

struct Loader<'a, K> {
    file: &'a SafetensorsFile,
    naming: fn(&str) -> HfTensorName,
    keep: K,
    path: PathStack,
    error: Option<HfError>,
}

impl<B: Backend, K: FnMut(&str) -> bool> ModuleMapper<B> for Loader<'_, K> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.enter(name);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let path = self.path.path();
        // An empty parameter is a placeholder (another pipeline stage's, a QLoRA weight kept
        // elsewhere): nothing of the file goes there.
        if self.error.is_some() || !(self.keep)(&path) || param.lazy_shape().num_elements() == 0 {
            return param;
        }
        let hf = (self.naming)(&path);
        let expected = hf_shape(&param.lazy_shape().to_vec(), hf.transposed, &hf.name);
        match self.file.float(&hf.name, Some(&expected)) {
            Ok(data) => {
                let device = param.lazy_device();
                let mut tensor = Tensor::<B, D>::from_data(data, &device);
                if hf.transposed {
                    tensor = tensor.transpose();
                }
                let id = param.id;
                param.transform_for_load(tensor, id)
            }
            Err(e) => {
                self.error = Some(e);
                param
            }
        }
    }
}

/// Replaces every parameter of `model` by the tensor of `file` its [`HfNaming`] names, converted to
/// Burn's layout and placed on the parameter's device. Tensors of the file the model does not use
/// (e.g. a tied `lm_head.weight` or old attention-mask buffers) are ignored, as transformers does.
///
/// # Errors
/// The first [`HfError::MissingTensor`] or [`HfError::ShapeMismatch`] (in the file's names and
/// layout, both shapes given), or [`HfError::Dtype`].
pub fn load_weights<B: Backend, M: Module<B> + HfNaming>(
    model: M,
    file: &SafetensorsFile,
) -> Result<M, HfError> {
    load_weights_named(model, file, M::hf_tensor, |_| true)
}

/// [`load_weights`] with the naming given (a module that is not itself [`HfNaming`], such as
/// one wrapping an HF model), for the parameters whose Burn path `keep` accepts; the others are
/// left as they are.
///
/// # Errors
/// As [`load_weights`].
pub fn load_weights_named<B: Backend, M: Module<B>>(
    model: M,
    file: &SafetensorsFile,
    naming: fn(&str) -> HfTensorName,
    keep: impl FnMut(&str) -> bool,
) -> Result<M, HfError> {
    let mut loader = Loader {
        file,
        naming,
        keep,
        path: PathStack::default(),
        error: None,
    };
    let model = model.map(&mut loader);
    match loader.error {
        Some(e) => Err(e),
        None => Ok(model),
    }
}

struct Collector<M> {
    path: PathStack,
    tensors: Vec<(String, TensorData)>,
    _model: std::marker::PhantomData<M>,
}

impl<B: Backend, M: HfNaming> ModuleVisitor<B> for Collector<M> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.enter(name);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let hf = M::hf_tensor(&self.path.path());
        let mut tensor = param.val();
        if hf.transposed {
            hf_shape(&tensor.dims(), true, &hf.name);
            tensor = tensor.transpose();
        }
        let data = tensor.into_data().convert::<f32>();
        self.tensors.push((hf.name, data));
    }
}

/// Every parameter of `model` as `f32` data in the checkpoint's names and layout, in module order.
pub fn hf_tensors<B: Backend, M: Module<B> + HfNaming>(model: &M) -> Vec<(String, TensorData)> {
    let mut collector = Collector::<M> {
        path: PathStack::default(),
        tensors: Vec::new(),
        _model: std::marker::PhantomData,
    };
    model.visit(&mut collector);
    collector.tensors
}

/// A tensor's bytes in the file's dtype.
struct DataView<'a>(&'a TensorData, safetensors::Dtype);

impl safetensors::View for DataView<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.1
    }
    fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(self.0.as_bytes())
    }
    fn data_len(&self) -> usize {
        self.0.as_bytes().len()
    }
}

/// Writes every parameter of `model` to `path` as float32 safetensors in the checkpoint's names and
/// shapes (with `__metadata__ = {"format": "pt"}`, as transformers writes), so that
/// `transformers`' `from_pretrained` loads it.
///
/// # Errors
/// [`HfError::Io`] when the file cannot be written.
pub fn save_weights<B: Backend, M: Module<B> + HfNaming>(
    model: &M,
    path: impl AsRef<Path>,
) -> Result<(), HfError> {
    write_tensors(path, &hf_tensors(model))
}

/// [`save_weights`] with every tensor rounded to `dtype` (f32, bf16 or f16; f64 is written as
/// f32).
///
/// # Errors
/// [`HfError::Io`] when the file cannot be written.
pub fn save_weights_as<B: Backend, M: Module<B> + HfNaming>(
    model: &M,
    path: impl AsRef<Path>,
    dtype: FloatDType,
) -> Result<(), HfError> {
    write_tensors_as(path, &hf_tensors(model), dtype)
}

/// The name transformers gives a dtype in `config.json` (`torch_dtype`).
pub fn torch_dtype_name(dtype: FloatDType) -> &'static str {
    match dtype {
        FloatDType::BF16 => "bfloat16",
        FloatDType::F16 => "float16",
        _ => "float32",
    }
}

/// Writes `tensors` (converted to float32) to `path` as safetensors with
/// `__metadata__ = {"format": "pt"}`.
///
/// # Errors
/// [`HfError::Io`] when the file cannot be written.
pub fn write_tensors(
    path: impl AsRef<Path>,
    tensors: &[(String, TensorData)],
) -> Result<(), HfError> {
    write_tensors_as(path, tensors, FloatDType::F32)
}

/// [`write_tensors`] in `dtype` (f32, bf16 or f16; f64 is written as f32).
///
/// # Errors
/// [`HfError::Io`] when the file cannot be written.
pub fn write_tensors_as(
    path: impl AsRef<Path>,
    tensors: &[(String, TensorData)],
    dtype: FloatDType,
) -> Result<(), HfError> {
    let path = path.as_ref();
    let (want, file_dtype) = match dtype {
        FloatDType::BF16 => (DType::BF16, safetensors::Dtype::BF16),
        FloatDType::F16 => (DType::F16, safetensors::Dtype::F16),
        _ => (DType::F32, safetensors::Dtype::F32),
    };
    let tensors: Vec<(&str, Cow<'_, TensorData>)> = tensors
        .iter()
        .map(|(name, data)| {
            let data = if data.dtype == want {
                Cow::Borrowed(data)
            } else {
                Cow::Owned(convert(data.clone(), want))
            };
            (name.as_str(), data)
        })
        .collect();
    let views = tensors
        .iter()
        .map(|(name, data)| (*name, DataView(data, file_dtype)));
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(source) => HfError::Io {
            op: "write",
            path: path.to_path_buf(),
            source,
        },
        other => HfError::Safetensors {
            path: path.to_path_buf(),
            reason: other.to_string(),
        },
    })
}

struct GradNorms<'a, B: AutodiffBackend, M> {
    grads: &'a B::Gradients,
    path: PathStack,
    norms: Vec<(String, Option<f64>)>,
    /// Whose gradients to return whole, in the checkpoint layout.
    wanted: &'a [String],
    whole: Vec<(String, TensorData)>,
    _model: std::marker::PhantomData<M>,
}

impl<B: AutodiffBackend, M: HfNaming> ModuleVisitor<B> for GradNorms<'_, B, M> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.enter(name);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let hf = M::hf_tensor(&self.path.path());
        let grad = param.val().grad(self.grads);
        if let Some(g) = &grad
            && self.wanted.contains(&hf.name)
        {
            let g = if hf.transposed {
                g.clone().transpose()
            } else {
                g.clone()
            };
            self.whole
                .push((hf.name.clone(), g.into_data().convert::<f32>()));
        }
        let norm = grad.map(|g| {
            let sum_sq: f64 = g.square().sum().into_scalar().elem_into();
            sum_sq.sqrt()
        });
        self.norms.push((hf.name, norm));
    }
}

/// The L2 norm of each parameter's gradient in `grads`, by checkpoint name, in module order; `None`
/// for a parameter the loss does not depend on. (The norm is layout-independent.)
pub fn hf_grad_norms<B: AutodiffBackend, M: Module<B> + HfNaming>(
    model: &M,
    grads: &B::Gradients,
) -> Vec<(String, Option<f64>)> {
    hf_grads(model, grads, &[]).norms
}

/// Gradients of a model's parameters, by checkpoint name.
#[derive(Debug, Clone)]
pub struct HfGrads {
    /// Each parameter's gradient L2 norm, in module order; `None` when the loss does not use it.
    pub norms: Vec<(String, Option<f64>)>,
    /// The whole gradients (`f32`, checkpoint layout) of the parameters asked for.
    pub whole: Vec<(String, TensorData)>,
}

/// As [`hf_grad_norms`], and also the whole gradients of the parameters named in `wanted` that
/// have one.
pub fn hf_grads<B: AutodiffBackend, M: Module<B> + HfNaming>(
    model: &M,
    grads: &B::Gradients,
    wanted: &[String],
) -> HfGrads {
    let mut visitor = GradNorms::<B, M> {
        grads,
        path: PathStack::default(),
        norms: Vec::new(),
        wanted,
        whole: Vec::new(),
        _model: std::marker::PhantomData,
    };
    model.visit(&mut visitor);
    HfGrads {
        norms: visitor.norms,
        whole: visitor.whole,
    }
}

/// `f32`/`f64` scalar conversion without naming Burn's element traits at every call.
trait ElemInto {
    fn elem_into(self) -> f64;
}

impl<E: burn::tensor::ElementConversion> ElemInto for E {
    fn elem_into(self) -> f64 {
        self.elem::<f64>()
    }
}

/// `data` as `dtype` (f32, bf16 or f16), rounding to nearest.
fn convert(data: TensorData, dtype: DType) -> TensorData {
    match dtype {
        DType::BF16 => data.convert::<half::bf16>(),
        DType::F16 => data.convert::<half::f16>(),
        _ => data.convert::<f32>(),
    }
}
