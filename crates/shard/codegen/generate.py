"""Generate kiln-shard's forwarding of Burn 0.21.0's backend ops traits.

    python3 crates/shard/codegen/generate.py crates/shard/src/core/ops && cargo fmt

Every method of FloatTensorOps, IntTensorOps, BoolTensorOps, ModuleOps, ActivationOps and
QTensorOps (defaulted ones included, so the inner backend's fused kernels are kept) becomes a
forward to the inner backend `B`. What happens to float tensors is decided per method by the
policy tables below, one file per trait (`core/ops/float.rs`, ...); the hand-written exceptions
live in `core/ops/custom.rs`.
The test `forwarding_covers_every_trait_method` checks the result against the trait sources.
"""
import re
import parse

# Elementwise on one float tensor (plus non-tensor arguments): shard-local.
UNARY = set("""
float_neg float_recip float_exp float_log float_log1p float_sqrt float_abs float_cos float_sin
float_tan float_cosh float_sinh float_tanh float_acos float_acosh float_asin float_asinh
float_atan float_atanh float_round float_floor float_ceil float_trunc float_erf float_sign
float_add_scalar float_sub_scalar float_mul_scalar float_div_scalar float_remainder_scalar
float_powi_scalar float_powi_scalar_impl float_powf_scalar float_powf_scalar_impl
float_clamp_min float_clamp_max float_clamp float_cast float_to_device float_detach
float_set_require_grad
leaky_relu relu gelu sigmoid hard_sigmoid log_sigmoid
""".split())

# Elementwise on two float tensors of one shape: shard-local when both are laid out alike.
BINARY = set("""
float_add float_sub float_mul float_div float_remainder float_powf float_atan2
relu_backward gelu_backward sigmoid_backward log_sigmoid_backward
""".split())

# Ops along one dimension (`dim`): every other index is independent, so a tensor split along
# another dimension (tensor parallelism) applies them to its part.
ALONG = set("""
float_sum_dim float_prod_dim float_cumsum float_cumprod float_cummin float_cummax
float_max_dim float_min_dim softmax log_softmax
""".split())

# Hand-written in ops/custom.rs (same name, same arguments).
CUSTOM = set("""
float_from_data float_random float_zeros float_ones float_full float_empty float_into_data
float_device float_is_require_grad float_sum float_mean float_max float_min embedding_backward
max_pool1d_with_indices max_pool1d_with_indices_backward max_pool2d_with_indices
max_pool2d_with_indices_backward deform_conv2d_backward quantize
float_reshape float_swap_dims float_transpose float_permute float_slice float_expand
linear linear_x_backward linear_weight_backward linear_bias_backward float_exp sigmoid float_mean_dim
float_matmul float_slice_assign float_gather embedding float_cat
""".split())

# Contractions: their recomputation costs output elements x the contracted dimension (for
# rematerialisation's eviction policy).
COMPUTE_BOUND = set("""
float_matmul linear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d
deform_conv2d attention
""".split())

FLOAT = "FloatTensor<B>"


def self_ty(t):
    t = t.replace("crate::tensor::", "burn_backend::tensor::")
    return re.sub(r"<B>", "<Self>", t).replace("Device<B>", "Device<Self>")


def conv_arg(name, ty):
    """Expression passing argument `name` of type `ty` to the inner backend."""
    if ty == FLOAT:
        return f"local({name})"
    if ty == "&" + FLOAT:
        return f"&local({name}.clone())"
    if ty == f"Option<{FLOAT}>":
        return f"{name}.map(local)"
    if ty == "TensorPrimitive<B>":
        return f"local_primitive({name})"
    if ty == f"Vec<{FLOAT}>":
        return f"{name}.into_iter().map(local).collect()"
    if "FloatTensor" in ty:
        raise SystemExit(f"no conversion for argument type {ty}")
    return name


def conv_ret(expr, ret):
    if ret == FLOAT:
        return f"ShardTensor::Local({expr})"
    if ret == f"({FLOAT}, {FLOAT})":
        return f"{{ let (a, b) = {expr}; (ShardTensor::Local(a), ShardTensor::Local(b)) }}"
    if ret == f"({FLOAT}, IntTensor<B>)":
        return f"{{ let (a, b) = {expr}; (ShardTensor::Local(a), b) }}"
    if ret == "TensorPrimitive<B>":
        return f"local_wrap_primitive({expr})"
    if "FloatTensor" in ret or "TensorPrimitive" in ret:
        raise SystemExit(f"no conversion for return type {ret}")
    return expr


def recorded(m):
    """A whole-tensor op returning one float tensor, as a `remat::record` call: its float inputs
    travel as a vector, its other arguments are captured (owned copies of borrowed ones) so the
    op can run again; `None` when an argument type is not handled (the op's result is then
    kept, never recomputed)."""
    pushes, before, inside, single = [], [], [], True
    for n, t, _ in m["args"]:
        if t == FLOAT:
            pushes.append(f"inputs.push({n});")
            inside.append("t.next().expect(\"input\")")
        elif t == f"Option<{FLOAT}>":
            single = False
            before.append(f"let has_{n} = {n}.is_some();")
            pushes.append(f"inputs.extend({n});")
            inside.append(f"has_{n}.then(|| t.next().expect(\"input\"))")
        elif t == f"Vec<{FLOAT}>":
            single = False
            before.append(f"let n_{n} = {n}.len();")
            pushes.append(f"inputs.extend({n});")
            inside.append(f"t.by_ref().take(n_{n}).collect()")
        elif "FloatTensor" in t or "TensorPrimitive" in t:
            return None
        elif t.startswith("&"):
            before.append(f"let {n} = {n}.to_owned();")
            inside.append(f"&{n}")
        else:
            inside.append(f"{n}.clone()")
    if not pushes:
        return None
    if single:
        names = [p[len("inputs.push("):-2] for p in pushes]
        inputs = f"vec![{', '.join(names)}]"
    else:
        before.append("let mut inputs = Vec::new();")
        before.extend(pushes)
        inputs = "inputs"
    call = f"B::{m['name']}({', '.join(inside)})"
    pre = " ".join(before)
    fn = "record_compute" if m["name"] in COMPUTE_BOUND else "record"
    return f"{pre} {fn}({inputs}, move |t| {{ let mut t = t.into_iter(); {call} }})".strip()


def signature(m):
    args = ", ".join(f"{'mut ' if mut else ''}{n}: {self_ty(t)}" for n, t, mut in m["args"])
    ret = f" -> {self_ty(m['ret'])}" if m["ret"] else ""
    where = f" {self_ty(m['where'])}" if m["where"] else ""
    kw = "async fn" if m["is_async"] else "fn"
    return f"fn {m['name']}{m['generics']}({args}){ret}{where}".replace("fn ", kw + " ", 1)


def body(m):
    name, args, ret = m["name"], m["args"], m["ret"]
    names = [n for n, _, _ in args]
    if name in CUSTOM:
        return f"custom::{name}::<B>({', '.join(names)})"
    if name in UNARY:
        assert args[0][1] == FLOAT and ret == FLOAT, name
        owned = "".join(f"let {n} = {n}.to_owned(); " for n, t, _ in args[1:] if t.startswith("&"))
        rest = "".join(f", &{n}" if t.startswith("&") else f", {n}" for n, t, _ in args[1:])
        return f"{owned}unary({names[0]}, move |t| B::{name}(t{rest}))"
    if name in ALONG:
        assert args[0][1] == FLOAT and args[1][0] == "dim" and ret == FLOAT and len(args) == 2, name
        return f"along({names[0]}, dim, move |t| B::{name}(t, dim))"
    if name in BINARY:
        assert args[0][1] == FLOAT and args[1][1] == FLOAT and ret == FLOAT, name
        rest = "".join(f", {n}" for n in names[2:])
        return f"binary({names[0]}, {names[1]}, move |a, b| B::{name}(a, b{rest}))"
    call = f"B::{name}({', '.join(conv_arg(n, t) for n, t, _ in args)})"
    if m["is_async"] or ret.startswith("impl Future"):
        return call
    if ret == FLOAT and not m["generics"]:
        r = recorded(m)
        if r is not None:
            return r
    return conv_ret(call, ret)


def takes_float(m):
    """Whether a float tensor is among the method's arguments."""
    return (not m["is_async"]) and any(
        "FloatTensor" in t or "TensorPrimitive" in t for _, t, _ in m["args"])


# The file each trait's forwarding is written to (one file per Burn ops trait).
FILES = {
    "FloatTensorOps": "float.rs",
    "IntTensorOps": "int.rs",
    "BoolTensorOps": "bool.rs",
    "ModuleOps": "module.rs",
    "ActivationOps": "activation.rs",
    "QTensorOps": "qtensor.rs",
}

HEADER = [
    "// @generated by crates/shard/codegen/generate.py from burn-backend 0.21.0's ops traits.",
    "// Do not edit: change the policy tables in the generator and run it again.",
    "",
    "#![allow(clippy::too_many_arguments, clippy::clone_on_copy, unused_mut, unused_imports)]",
    "",
    "use super::custom;",
    "use super::policy::{along, binary, local, local_primitive, local_wrap_primitive, op_name, record, record_compute, unary};",
    "use crate::core::backend::Shard;",
    "use crate::core::tensor::ShardTensor;",
    "use burn_backend::ops::*;",
    "use burn_backend::quantization::{QuantScheme, QuantizationParametersPrimitive};",
    "use burn_backend::tensor::{BoolTensor, Device, FloatTensor, IntTensor, QuantizedTensor};",
    "use burn_backend::{Backend, Distribution, ExecutionError, Scalar, TensorData, TensorPrimitive};",
    "use std::ops::Range;",
    "use burn_std::{BoolDType, FloatDType, IntDType, Shape, Slice};",
    "",
]


def main():
    import os
    import sys
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "crates/shard/src/core/ops"
    for trait, path in parse.TRAITS:
        if trait == "TransactionOps":
            continue  # hand-written in ops/custom.rs
        out = list(HEADER)
        out.append(f"impl<B: Backend> {trait}<Self> for Shard<B> {{")
        for m in parse.methods(trait, path):
            out.append(f"    {signature(m)} {{")
            if takes_float(m):
                # Named for reports of values formed by ops without a rule (see `op_name`).
                out.append(f"        op_name(\"{m['name']}\");")
            out.append(f"        {body(m)}")
            out.append("    }")
        out.append("}")
        out.append("")
        with open(os.path.join(out_dir, FILES[trait]), "w") as f:
            f.write("\n".join(out))


if __name__ == "__main__":
    main()
