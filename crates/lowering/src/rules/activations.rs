//! Activations of torch.nn and their backward ops (gelu, silu, softplus, elu, hardtanh,
//! ..., shrinkage, glu, prelu, rrelu). Reduced-precision floats compute in f32 and round once.

use super::nn_common::*;
use super::{
    add_k, cmp_k, float_max, fmt_num, map, map_only, not_implemented, opmath, promote, same, scale,
    select_k,
};
use crate::promote::torch_name;
use crate::shape::wrap_dim;
use crate::{decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, Value};
use stablehlo::CmpDir;

/// `self` (and `grad_output` first when `grad`) in the compute dtype, plus the result dtype.
fn act_inputs(c: &mut Ctx, grad: bool) -> LResult<(Vec<Value>, DType)> {
    let names: &[&str] = if grad {
        &["grad_output", "self"]
    } else {
        &["self"]
    };
    let (v, dt, _) = pair(c, names)?;
    Ok((v, dt))
}

fn scalar_arg(c: &Ctx, name: &str) -> LResult<f64> {
    Ok(c.args.scalar(name)?.as_f64())
}

fn hardtanh(c: &mut Ctx) -> LResult<Vec<Out>> {
    let lo = scalar_arg(c, "min_val")?;
    let hi = scalar_arg(c, "max_val")?;
    let x = tensor(c, "self")?;
    if x.dtype == DType::Bool {
        return decline("hardtanh: bool input");
    }
    let b = &mut *c.b;
    let cd = opmath(x.dtype);
    let xv = b.convert(x.value, cd);
    let l = b.splat(xv, lo);
    let h = b.splat(xv, hi);
    let y = b.max(xv, l);
    let y = b.min(y, h);
    Ok(vec![Out::T(b.convert(y, x.dtype))])
}

fn hardtanh_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let lo = scalar_arg(c, "min_val")?;
    let hi = scalar_arg(c, "max_val")?;
    let (v, dt) = act_inputs(c, true)?;
    let b = &mut *c.b;
    let (g, x) = (v[0], v[1]);
    let l = b.splat(x, lo);
    let h = b.splat(x, hi);
    let below = b.compare(x, l, CmpDir::Le);
    let above = b.compare(x, h, CmpDir::Ge);
    let out = b.or(below, above);
    let z = b.splat(g, 0.0);
    let r = b.select(out, z, g);
    Ok(vec![Out::T(b.convert(r, dt))])
}

fn leaky_relu(c: &mut Ctx) -> LResult<Vec<Out>> {
    let slope = scalar_arg(c, "negative_slope")?;
    let (v, dt) = act_inputs(c, false)?;
    let b = &mut *c.b;
    let x = v[0];
    let z = b.splat(x, 0.0);
    let pos = b.compare(x, z, CmpDir::Gt);
    let k = b.splat(x, slope);
    let n = b.mul(x, k);
    let y = b.select(pos, x, n);
    Ok(vec![Out::T(b.convert(y, dt))])
}

fn leaky_relu_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let slope = scalar_arg(c, "negative_slope")?;
    if c.args.bool_or("self_is_result", false) && slope < 0.0 {
        return user_err(
            ErrorKind::Runtime,
            "In-place leakyReLu backward calculation is triggered with a negative slope which is not supported. This is caused by calling in-place forward function with a negative slope, please call out-of-place version instead. File an issue at https://github.com/pytorch/pytorch if you do require supporting in-place leakRelu backward calculation with negative slope",
        );
    }
    let (v, dt) = act_inputs(c, true)?;
    let b = &mut *c.b;
    let (g, x) = (v[0], v[1]);
    let z = b.splat(x, 0.0);
    let pos = b.compare(x, z, CmpDir::Gt);
    let k = b.splat(g, slope);
    let n = b.mul(g, k);
    let r = b.select(pos, g, n);
    Ok(vec![Out::T(b.convert(r, dt))])
}

fn elu(c: &mut Ctx) -> LResult<Vec<Out>> {
    let alpha = scalar_arg(c, "alpha")?;
    let scale = scalar_arg(c, "scale")?;
    let iscale = scalar_arg(c, "input_scale")?;
    let (v, dt) = act_inputs(c, false)?;
    let b = &mut *c.b;
    let x = v[0];
    // x <= 0 ? expm1(x * input_scale) * alpha * scale : x * scale
    let z = b.splat(x, 0.0);
    let neg = b.compare(x, z, CmpDir::Le);
    let is = b.splat(x, iscale);
    let t = b.mul(x, is);
    let t = b.unary("stablehlo.exponential_minus_one", t);
    let nc = b.splat(x, alpha * scale);
    let n = b.mul(t, nc);
    let sc = b.splat(x, scale);
    let p = b.mul(x, sc);
    let y = b.select(neg, n, p);
    Ok(vec![Out::T(b.convert(y, dt))])
}

fn elu_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let alpha = scalar_arg(c, "alpha")?;
    let scale = scalar_arg(c, "scale")?;
    let iscale = scalar_arg(c, "input_scale")?;
    let is_result = c.args.bool_or("is_result", false);
    if is_result && alpha < 0.0 {
        return user_err(
            ErrorKind::Runtime,
            "In-place elu backward calculation is triggered with a negative slope which is not supported. This is caused by calling in-place forward function with a negative slope, please call out-of-place version instead.",
        );
    }
    let (v, dt, _) = pair(c, &["grad_output", "self_or_result"])?;
    let b = &mut *c.b;
    let (g, x) = (v[0], v[1]);
    let z = b.splat(x, 0.0);
    let neg = b.compare(x, z, CmpDir::Le);
    let is = b.splat(x, iscale);
    let nc = b.splat(x, alpha * scale);
    let dn = if is_result {
        // y + alpha * scale = alpha * scale * exp(x * input_scale)
        let t = b.add(x, nc);
        b.mul(is, t)
    } else {
        let t = b.mul(x, is);
        let e = b.exp(t);
        let t = b.mul(e, nc);
        b.mul(is, t)
    };
    let n = b.mul(g, dn);
    let sc = b.splat(g, scale);
    let p = b.mul(g, sc);
    let r = b.select(neg, n, p);
    Ok(vec![Out::T(b.convert(r, dt))])
}

fn softplus(c: &mut Ctx) -> LResult<Vec<Out>> {
    let beta = scalar_arg(c, "beta")?;
    let th = scalar_arg(c, "threshold")?;
    let (v, dt) = act_inputs(c, false)?;
    let b = &mut *c.b;
    let x = v[0];
    let bk = b.splat(x, beta);
    let xb = b.mul(x, bk);
    let tk = b.splat(x, th);
    let lin = b.compare(xb, tk, CmpDir::Gt);
    let e = b.exp(xb);
    let l = b.unary("stablehlo.log_plus_one", e);
    let l = b.div(l, bk);
    let y = b.select(lin, x, l);
    Ok(vec![Out::T(b.convert(y, dt))])
}

fn softplus_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let beta = scalar_arg(c, "beta")?;
    let th = scalar_arg(c, "threshold")?;
    let (v, dt) = act_inputs(c, true)?;
    let b = &mut *c.b;
    let (g, x) = (v[0], v[1]);
    let bk = b.splat(x, beta);
    let xb = b.mul(x, bk);
    let tk = b.splat(x, th);
    let lin = b.compare(xb, tk, CmpDir::Gt);
    let z = b.exp(xb);
    let one = b.splat(z, 1.0);
    let z1 = b.add(z, one);
    let gz = b.mul(g, z);
    let s = b.div(gz, z1);
    let r = b.select(lin, g, s);
    Ok(vec![Out::T(b.convert(r, dt))])
}

/// min(max(x + 3, 0), 6) / 6
fn hardsigmoid_of(b: &mut Builder, x: Value) -> Value {
    let three = b.splat(x, 3.0);
    let zero = b.splat(x, 0.0);
    let six = b.splat(x, 6.0);
    let t = b.add(x, three);
    let t = b.max(t, zero);
    let t = b.min(t, six);
    b.div(t, six)
}

fn hardsigmoid(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt) = act_inputs(c, false)?;
    let y = hardsigmoid_of(c.b, v[0]);
    Ok(vec![Out::T(c.b.convert(y, dt))])
}

fn hardsigmoid_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt) = act_inputs(c, true)?;
    let b = &mut *c.b;
    let (g, x) = (v[0], v[1]);
    let lo = b.splat(x, -3.0);
    let hi = b.splat(x, 3.0);
    let a = b.compare(x, lo, CmpDir::Gt);
    let bb = b.compare(x, hi, CmpDir::Lt);
    let inside = b.and(a, bb);
    let six = b.splat(g, 6.0);
    let d = b.div(g, six);
    let z = b.splat(g, 0.0);
    let r = b.select(inside, d, z);
    Ok(vec![Out::T(b.convert(r, dt))])
}

fn hardswish(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt) = act_inputs(c, false)?;
    let b = &mut *c.b;
    let x = v[0];
    let three = b.splat(x, 3.0);
    let zero = b.splat(x, 0.0);
    let six = b.splat(x, 6.0);
    let t = b.add(x, three);
    let t = b.max(t, zero);
    let t = b.min(t, six);
    let t = b.mul(x, t);
    let y = b.div(t, six);
    Ok(vec![Out::T(b.convert(y, dt))])
}

fn hardswish_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt) = act_inputs(c, true)?;
    let b = &mut *c.b;
    let (g, x) = (v[0], v[1]);
    // x <= -3 ? 0 : x < 3 ? g * (x / 3 + 0.5) : g
    let lo = b.splat(x, -3.0);
    let hi = b.splat(x, 3.0);
    let below = b.compare(x, lo, CmpDir::Le);
    let mid = b.compare(x, hi, CmpDir::Lt);
    let t = b.div(x, hi);
    let half = b.splat(x, 0.5);
    let t = b.add(t, half);
    let gm = b.mul(g, t);
    let z = b.splat(g, 0.0);
    let r = b.select(mid, gm, g);
    let r = b.select(below, z, r);
    Ok(vec![Out::T(b.convert(r, dt))])
}

/// log_sigmoid_forward: (min(x, 0) - log1p(z), z) with z = exp(-|x|), as PyTorch's CPU kernel.
fn log_sigmoid_forward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt) = act_inputs(c, false)?;
    let b = &mut *c.b;
    let x = v[0];
    let zero = b.splat(x, 0.0);
    let mn = b.min(x, zero);
    let ax = b.abs(x);
    let nax = b.neg(ax);
    let z = b.exp(nax);
    let lp = b.unary("stablehlo.log_plus_one", z);
    let y = b.sub(mn, lp);
    Ok(vec![Out::T(b.convert(y, dt)), Out::T(b.convert(z, dt))])
}

/// log_sigmoid_backward from the saved buffer z: g * (x < 0 ? 1 - z / (1 + z) : z / (1 + z)).
fn log_sigmoid_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt, _) = pair(c, &["grad_output", "self", "buffer"])?;
    let b = &mut *c.b;
    let (g, x, z) = (v[0], v[1], v[2]);
    let zero = b.splat(x, 0.0);
    let one = b.splat(x, 1.0);
    let neg = b.compare(x, zero, CmpDir::Lt);
    let z1 = b.add(one, z);
    let q = b.div(z, z1);
    let neg_d = b.sub(one, q);
    let d = b.select(neg, neg_d, q);
    let r = b.mul(g, d);
    Ok(vec![Out::T(b.convert(r, dt))])
}

/// mish: x * tanh(log1p(exp(x))).
fn mish(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt) = act_inputs(c, false)?;
    let b = &mut *c.b;
    let x = v[0];
    let e = b.exp(x);
    let sp = b.unary("stablehlo.log_plus_one", e);
    let t = b.tanh(sp);
    let y = b.mul(x, t);
    Ok(vec![Out::T(b.convert(y, dt))])
}

/// mish_backward: g * (tsp + x * sigmoid(x) * (1 - tsp^2)), tsp = tanh(softplus(x)).
fn mish_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt) = act_inputs(c, true)?;
    let b = &mut *c.b;
    let (g, x) = (v[0], v[1]);
    let e = b.exp(x);
    let sp = b.unary("stablehlo.log_plus_one", e);
    let t = b.tanh(sp);
    let sg = b.unary("stablehlo.logistic", x);
    let one = b.splat(x, 1.0);
    let t2 = b.mul(t, t);
    let d = b.sub(one, t2);
    let d = b.mul(sg, d);
    let d = b.mul(x, d);
    let d = b.add(t, d);
    let r = b.mul(g, d);
    Ok(vec![Out::T(b.convert(r, dt))])
}

fn softshrink(c: &mut Ctx) -> LResult<Vec<Out>> {
    let l = c.args.opt_scalar("lambd").map_or(0.5, |s| s.as_f64());
    let dt = c.args.tensor("self")?.dtype;
    if l < 0.0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "lambda must be in range [0, {}] for input dtype {}, but found {}",
                fmt_num(float_max(dt)),
                torch_name(dt),
                fmt_num(l)
            ),
        );
    }
    map(c, &["self"], same, |b, v| {
        let x = v[0];
        let hi = cmp_k(b, x, l, CmpDir::Gt);
        let lo = cmp_k(b, x, -l, CmpDir::Lt);
        let xm = add_k(b, x, -l);
        let xp = add_k(b, x, l);
        let z = scale(b, x, 0.0); // NaN stays NaN, signs of zero as PyTorch
        let r = b.select(lo, xp, z);
        b.select(hi, xm, r)
    })
}

fn hardshrink(c: &mut Ctx) -> LResult<Vec<Out>> {
    let l = c.args.opt_scalar("lambd").map_or(0.5, |s| s.as_f64());
    map_only(c, &["self"], "hardshrink_cpu", DType::is_float, |b, v| {
        let inside = inside(b, v[0], l);
        select_k(b, inside, 0.0, v[0])
    })
}

/// -l <= x <= l (false for NaN).
fn inside(b: &mut Builder, x: Value, l: f64) -> Value {
    let ge = cmp_k(b, x, -l, CmpDir::Ge);
    let le = cmp_k(b, x, l, CmpDir::Le);
    b.and(ge, le)
}

/// softshrink_backward / hardshrink_backward: the gradient passes outside [-l, l].
fn shrink_backward(c: &mut Ctx, grad: &'static str) -> LResult<Vec<Out>> {
    let l = c.args.scalar("lambd")?.as_f64();
    map_only(
        c,
        &[grad, "self"],
        "shrink_backward_cpu",
        DType::is_float,
        |b, v| {
            let inside = inside(b, v[1], l);
            select_k(b, inside, 0.0, v[0])
        },
    )
}

/// The two halves of `x` along `dim` (glu's split), with PyTorch's checks.
fn glu_halves(b: &mut Builder, x: Value, dim: i64) -> LResult<(Value, Value, usize)> {
    let shape = b.shape(x);
    if shape.is_empty() {
        return user_err(
            ErrorKind::Runtime,
            "glu does not support scalars because halving size must be even",
        );
    }
    let d = wrap_dim(dim, shape.len())?;
    if shape[d] % 2 != 0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Halving dimension must be even, but dimension {d} is size {}",
                shape[d]
            ),
        );
    }
    let h = shape[d] / 2;
    let a = b.slice_dim(x, d, 0, h, 1);
    let s = b.slice_dim(x, d, h, shape[d], 1);
    Ok((a, s, d))
}

fn glu(c: &mut Ctx) -> LResult<Vec<Out>> {
    let dim = c.args.int_or("dim", -1);
    let x = c.t("self")?;
    let dt = c.b.dtype(x);
    if !dt.is_float() {
        return not_implemented("glu_cpu", dt);
    }
    let (a, s, _) = glu_halves(c.b, x, dim)?;
    let sg = c.b.unary("stablehlo.logistic", s);
    Ok(vec![Out::T(c.b.mul(a, sg))])
}

fn glu_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let dim = c.args.int("dim")?;
    let g = c.t("grad_output")?;
    let x = c.t("self")?;
    let b = &mut *c.b;
    let dt = b.dtype(x);
    if !dt.is_float() {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "result type Float can't be cast to the desired output type {}",
                torch_name(dt)
            ),
        );
    }
    let (a, s, d) = glu_halves(b, x, dim)?;
    let gdt = b.dtype(g);
    if gdt != dt {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Found dtype {} but expected {}",
                torch_name(gdt),
                torch_name(dt)
            ),
        );
    }
    if b.shape(g) != b.shape(a) {
        return crate::decline("glu_backward: grad_output is not half of self");
    }
    let sg = b.unary("stablehlo.logistic", s);
    let ga = b.mul(g, sg);
    let one = b.splat(sg, 1.0);
    let oms = b.sub(one, sg);
    let ds = b.mul(sg, oms);
    let ds = b.mul(ds, a);
    let gs = b.mul(g, ds);
    Ok(vec![Out::T(b.concatenate(&[ga, gs], d))])
}

fn prelu(c: &mut Ctx) -> LResult<Vec<Out>> {
    map_only(
        c,
        &["self", "weight"],
        "prelu_cpu",
        DType::is_float,
        |b, v| {
            let (x, w) = (v[0], v[1]);
            let pos = cmp_k(b, x, 0.0, CmpDir::Gt);
            let wx = b.mul(w, x);
            b.select(pos, x, wx)
        },
    )
}

fn prelu_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["grad_output", "self", "weight"], same)?;
    if !dt.is_float() {
        return not_implemented("prelu_backward_cpu", dt);
    }
    let b = &mut *c.b;
    let (g, x, w) = (v[0], v[1], v[2]);
    let pos = cmp_k(b, x, 0.0, CmpDir::Gt);
    let wg = b.mul(w, g);
    let gx = b.select(pos, g, wg);
    let xg = b.mul(x, g);
    let zero = b.splat(xg, 0.0);
    let gw = b.select(pos, zero, xg);
    Ok(vec![Out::T(gx), Out::T(gw)])
}

/// rrelu_with_noise's result and the noise it leaves. Evaluation: leaky_relu with the mean
/// slope, the noise as it was. Training: each element <= 0 is scaled by a slope drawn
/// uniformly from [lower, upper) (computed in f32, or f64), which the noise records; the
/// noise is 1 elsewhere. The slopes come from the tpu generator, so they differ from the
/// CPU's draws as every random op's do.
fn rrelu(c: &mut Ctx) -> LResult<(Value, Value)> {
    let lower = c.args.opt_scalar("lower").map_or(0.125, |s| s.as_f64());
    let upper = c.args.opt_scalar("upper").map_or(1.0 / 3.0, |s| s.as_f64());
    let x = c.t("self")?;
    let noise = c.t("noise")?;
    let dt = c.b.dtype(x);
    if !dt.is_float() {
        return not_implemented("leaky_relu_cpu", dt);
    }
    if !c.args.bool_or("training", false) {
        let b = &mut *c.b;
        let pos = cmp_k(b, x, 0.0, CmpDir::Gt);
        let sx = scale(b, x, (lower + upper) / 2.0);
        return Ok((b.select(pos, x, sx), noise));
    }
    let shape = c.b.shape(x);
    if c.b.shape(noise) != shape {
        // The CPU kernel resizes the noise first.
        return crate::decline("rrelu_with_noise: noise of another shape");
    }
    let cdt = if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let u = super::random::uniform(c, &shape, cdt);
    let b = &mut *c.b;
    let r = scale(b, u, upper - lower);
    let lo = b.splat(r, lower);
    let r = b.add(r, lo);
    let xc = b.convert(x, cdt);
    let neg = cmp_k(b, xc, 0.0, CmpDir::Le);
    let scaled = b.mul(xc, r);
    let out = b.select(neg, scaled, xc);
    let one = b.splat(r, 1.0);
    let nz = b.select(neg, r, one);
    let ndt = b.dtype(noise);
    Ok((b.convert(out, dt), b.convert(nz, ndt)))
}

/// rrelu_with_noise(_): the noise argument is written.
fn rrelu_with_noise(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (out, noise) = rrelu(c)?;
    c.write_arg("noise", noise);
    Ok(vec![Out::T(out)])
}

/// rrelu_with_noise_functional: the new noise is a second result.
fn rrelu_with_noise_functional(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (out, noise) = rrelu(c)?;
    Ok(vec![Out::T(out), Out::T(noise)])
}

pub const RULES: &[(&str, Rule)] = &[
    ("aten::hardtanh", hardtanh),
    ("aten::hardtanh_backward", hardtanh_backward),
    ("aten::leaky_relu", leaky_relu),
    ("aten::leaky_relu_backward", leaky_relu_backward),
    ("aten::elu", elu),
    ("aten::elu_backward", elu_backward),
    ("aten::softplus", softplus),
    ("aten::softplus_backward", softplus_backward),
    ("aten::hardsigmoid", hardsigmoid),
    ("aten::hardsigmoid_backward", hardsigmoid_backward),
    ("aten::hardswish", hardswish),
    ("aten::hardswish_backward", hardswish_backward),
    ("aten::log_sigmoid_forward", log_sigmoid_forward),
    ("aten::mish", mish),
    ("aten::mish_backward", mish_backward),
    ("aten::log_sigmoid_backward", log_sigmoid_backward),
    ("aten::softshrink", softshrink),
    ("aten::softshrink_backward", |c| {
        shrink_backward(c, "grad_output")
    }),
    ("aten::hardshrink", hardshrink),
    ("aten::hardshrink_backward", |c| {
        shrink_backward(c, "grad_out")
    }),
    ("aten::glu", glu),
    ("aten::glu_backward", glu_backward),
    ("aten::_prelu_kernel", prelu),
    ("aten::rrelu_with_noise", rrelu_with_noise),
    (
        "aten::rrelu_with_noise_functional",
        rrelu_with_noise_functional,
    ),
    ("aten::_prelu_kernel_backward", prelu_backward),
];
