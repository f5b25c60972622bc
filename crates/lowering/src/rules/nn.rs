//! nn rules: normalization, losses, convolution, pooling, dropout, padding, upsampling and
//! the activations of torch.nn, forward and backward.
//!
//! Reduced-precision floats (f16/bf16) compute in f32 and round once at the end, as
//! PyTorch's CPU kernels do with their opmath type.

use super::promote;
use crate::promote::torch_name;
use crate::shape::{numel, reduced_shape, shape_str};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, TensorType,
    Value,
};
use stablehlo::{CmpDir, ReduceKind};

// ---------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------

/// The dtype a kernel accumulates in.
fn opmath(d: DType) -> DType {
    match d {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

fn tensor(c: &Ctx, name: &str) -> LResult<TensorArg> {
    Ok(c.args.tensor(name)?.clone())
}

fn float_input(t: &TensorArg, op: &str) -> LResult<()> {
    if !t.dtype.is_float() {
        // The CPU fallback raises PyTorch's own "not implemented for 'Long'" error.
        return decline(format!("{op}: {} input", torch_name(t.dtype)));
    }
    Ok(())
}

/// Sum over every dim except `keep` (a 1-d result).
fn sum_but(b: &mut Builder, x: Value, keep: usize) -> Value {
    let dims: Vec<i64> = (0..b.rank(x) as i64)
        .filter(|d| *d != keep as i64)
        .collect();
    b.reduce(x, &dims, ReduceKind::Sum)
}

/// A 1-d per-channel value broadcast along dim 1 of `shape`.
fn per_channel(b: &mut Builder, v: Value, shape: &[i64]) -> Value {
    b.broadcast_in_dim(v, shape, &[1])
}

fn recip_sqrt(b: &mut Builder, v: Value, eps: f64) -> Value {
    let e = b.splat(v, eps);
    let s = b.add(v, e);
    let s = b.sqrt(s);
    let one = b.splat(s, 1.0);
    b.div(one, s)
}

/// A 1-d constant with arbitrary values.
fn const_vec(b: &mut Builder, dtype: DType, vals: &[f64]) -> Value {
    let ty = TensorType::new(dtype, &[vals.len() as i64]);
    let items: Vec<String> = vals.iter().map(|v| dtype.literal(*v)).collect();
    let attr = format!("value = dense<[{}]> : {}", items.join(", "), ty.mlir());
    b.op("stablehlo.constant", &[], &attr, ty)
}

/// Expands a spatial parameter list given as one value or one per spatial dim.
fn expand(v: Vec<i64>, n: usize, what: &str) -> LResult<Vec<i64>> {
    match v.len() {
        l if l == n => Ok(v),
        1 => Ok(vec![v[0]; n]),
        _ => decline(format!(
            "{what} has {} entries for {n} spatial dims",
            v.len()
        )),
    }
}

/// `result[.., o, ..] = sum_i m[o][i] * x[.., i, ..]` along `dim`. Zero weights are skipped
/// (selected away), so an inf or NaN outside a window does not leak into it.
fn mix(b: &mut Builder, x: Value, dim: usize, m: &[Vec<f64>]) -> Value {
    let xs = b.shape(x);
    let (out, inn) = (m.len() as i64, xs[dim]);
    let dt = b.dtype(x);
    let flat: Vec<f64> = m.iter().flatten().copied().collect();
    if out == 0 || inn == 0 {
        let mut shape = xs.clone();
        shape[dim] = out;
        return b.full(dt, &shape, 0.0);
    }
    let mc = const_vec(b, dt, &flat);
    let mc = b.reshape(mc, &[out, inn]);
    let mut big = xs.clone();
    big.insert(dim, out);
    let xdims: Vec<i64> = (0..xs.len())
        .map(|i| if i < dim { i as i64 } else { i as i64 + 1 })
        .collect();
    let xb = b.broadcast_in_dim(x, &big, &xdims);
    let mb = b.broadcast_in_dim(mc, &big, &[dim as i64, dim as i64 + 1]);
    let z = b.splat(mb, 0.0);
    let nz = b.compare(mb, z, CmpDir::Ne);
    let p = b.mul(xb, mb);
    let p = b.select(nz, p, z);
    b.reduce(p, &[dim as i64 + 1], ReduceKind::Sum)
}

// ---------------------------------------------------------------------------------------
// Batch norm
// ---------------------------------------------------------------------------------------

/// The dtype of saved statistics: f32 when reduced-precision input meets f32 parameters
/// (PyTorch's mixed-type batch norm), else the input's.
fn stat_dtype(x: DType, params: &[Option<&TensorArg>]) -> DType {
    if matches!(x, DType::F16 | DType::BF16)
        && params.iter().flatten().any(|p| p.dtype == DType::F32)
    {
        DType::F32
    } else {
        x
    }
}

/// native_batch_norm, _native_batch_norm_legit(.no_stats), _native_batch_norm_legit_no_training.
fn batch_norm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "input")?;
    let w = c.args.opt_tensor("weight").cloned();
    let bias = c.args.opt_tensor("bias").cloned();
    let rm = c.args.opt_tensor("running_mean").cloned();
    let rv = c.args.opt_tensor("running_var").cloned();
    let training = c.args.has("training") && c.args.bool_or("training", false);
    let momentum = c.args.float("momentum")?;
    let eps = c.args.float("eps")?;
    float_input(&x, "batch_norm")?;
    if x.shape.len() < 2 || numel(&x.shape) == 0 {
        return decline("batch_norm: input with fewer than 2 dims or no elements");
    }
    let ch = x.shape[1];
    for p in [&w, &bias, &rm, &rv].into_iter().flatten() {
        if p.shape != [ch] || !p.dtype.is_float() {
            return decline("batch_norm: parameter shape differs from the channel count");
        }
    }
    if !training {
        if rm.is_none() {
            return user_err(
                ErrorKind::Value,
                "running_mean must be defined in evaluation mode",
            );
        }
        if rv.is_none() {
            return user_err(
                ErrorKind::Value,
                "running_var must be defined in evaluation mode",
            );
        }
    }
    let st = stat_dtype(
        x.dtype,
        &[w.as_ref(), bias.as_ref(), rm.as_ref(), rv.as_ref()],
    );
    let cd = opmath(x.dtype);
    let n = numel(&x.shape) / ch;
    let b = &mut *c.b;
    let xv = b.convert(x.value, cd);
    let mut updates = Vec::new();
    let (mean, invstd) = if training {
        let s = sum_but(b, xv, 1);
        let nn = b.splat(s, n as f64);
        let mean = b.div(s, nn);
        let mb = per_channel(b, mean, &x.shape);
        let d = b.sub(xv, mb);
        let d2 = b.mul(d, d);
        let ss = sum_but(b, d2, 1);
        let var = b.div(ss, nn);
        let invstd = recip_sqrt(b, var, eps);
        // Running stats: momentum * batch stat + (1 - momentum) * running, unbiased var.
        for (name, stat, p) in [("running_mean", mean, &rm), ("running_var", ss, &rv)] {
            if let Some(p) = p {
                let stat = if name == "running_var" {
                    let n1 = b.splat(ss, (n - 1) as f64);
                    b.div(stat, n1)
                } else {
                    stat
                };
                let m = b.splat(stat, momentum);
                let t = b.mul(m, stat);
                let old = b.convert(p.value, cd);
                let m1 = b.splat(old, 1.0 - momentum);
                let o = b.mul(m1, old);
                updates.push((name, b.add(t, o)));
            }
        }
        (mean, invstd)
    } else {
        let (rm, rv) = (rm.as_ref().expect("checked"), rv.as_ref().expect("checked"));
        let mean = b.convert(rm.value, cd);
        let var = b.convert(rv.value, cd);
        (mean, recip_sqrt(b, var, eps))
    };
    // y = x * alpha + beta with alpha = invstd * w, beta = b - mean * alpha.
    let alpha = match &w {
        Some(w) => {
            let wv = b.convert(w.value, cd);
            b.mul(invstd, wv)
        }
        None => invstd,
    };
    let ma = b.mul(mean, alpha);
    let beta = match &bias {
        Some(bb) => {
            let bv = b.convert(bb.value, cd);
            b.sub(bv, ma)
        }
        None => b.neg(ma),
    };
    let ab = per_channel(b, alpha, &x.shape);
    let bb = per_channel(b, beta, &x.shape);
    let y = b.mul(xv, ab);
    let y = b.add(y, bb);
    let y = b.convert(y, x.dtype);
    let (sm, si) = if training {
        (b.convert(mean, st), b.convert(invstd, st))
    } else {
        (b.full(st, &[0], 0.0), b.full(st, &[0], 0.0))
    };
    for (name, v) in updates {
        c.write_arg(name, v);
    }
    Ok(vec![Out::T(y), Out::T(sm), Out::T(si)])
}

/// native_batch_norm_backward and batch_norm_backward (whose `save_var` holds invstd).
fn batch_norm_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_out")?;
    let x = tensor(c, "input")?;
    let w = c.args.opt_tensor("weight").cloned();
    let rm = c.args.opt_tensor("running_mean").cloned();
    let rv = c.args.opt_tensor("running_var").cloned();
    let sm = c.args.opt_tensor("save_mean").cloned();
    let si = c
        .args
        .opt_tensor("save_invstd")
        .or_else(|| c.args.opt_tensor("save_var"))
        .cloned();
    let train = if c.args.has("train") {
        c.args.bool_or("train", true)
    } else {
        c.args.bool_or("update", true)
    };
    let eps = c.args.float("eps")?;
    let mask = c.args.bools("output_mask")?;
    float_input(&x, "batch_norm_backward")?;
    if x.shape.len() < 2 || numel(&x.shape) == 0 || gy.shape != x.shape || mask.len() != 3 {
        return decline("batch_norm_backward: unsupported shapes");
    }
    let ch = x.shape[1];
    let (mean_t, var_t) = if train { (sm, si) } else { (rm, rv) };
    let (Some(mean_t), Some(var_t)) = (mean_t, var_t) else {
        return decline("batch_norm_backward: statistics missing");
    };
    for p in [Some(&mean_t), Some(&var_t), w.as_ref()]
        .into_iter()
        .flatten()
    {
        if p.shape != [ch] {
            return decline("batch_norm_backward: parameter shape differs from the channel count");
        }
    }
    let st = stat_dtype(x.dtype, &[w.as_ref(), Some(&mean_t)]);
    let cd = opmath(x.dtype);
    let n = numel(&x.shape) / ch;
    let b = &mut *c.b;
    let xv = b.convert(x.value, cd);
    let g = b.convert(gy.value, cd);
    let mean = b.convert(mean_t.value, cd);
    let invstd = if train {
        b.convert(var_t.value, cd)
    } else {
        let v = b.convert(var_t.value, cd);
        recip_sqrt(b, v, eps)
    };
    let mb = per_channel(b, mean, &x.shape);
    let xmu = b.sub(xv, mb);
    let sum_dy = sum_but(b, g, 1);
    let gx = b.mul(g, xmu);
    let dot = sum_but(b, gx, 1);
    let wv = w.as_ref().map(|w| b.convert(w.value, cd));
    let mut outs = Vec::new();
    if mask[0] {
        let scale = match wv {
            Some(wv) => b.mul(invstd, wv),
            None => invstd,
        };
        let sb = per_channel(b, scale, &x.shape);
        let dx = if train {
            // dx = (dy - mean(dy) - xmu * invstd^2 * mean(dy * xmu)) * invstd * w
            let nn = b.splat(sum_dy, n as f64);
            let mdy = b.div(sum_dy, nn);
            let i2 = b.mul(invstd, invstd);
            let k = b.div(dot, nn);
            let k = b.mul(k, i2);
            let kb = per_channel(b, k, &x.shape);
            let proj = b.mul(xmu, kb);
            let mdyb = per_channel(b, mdy, &x.shape);
            let t = b.sub(g, mdyb);
            let t = b.sub(t, proj);
            b.mul(t, sb)
        } else {
            b.mul(g, sb)
        };
        outs.push(Out::T(b.convert(dx, x.dtype)));
    } else {
        outs.push(Out::None);
    }
    let pdt = w.as_ref().map(|w| w.dtype).unwrap_or(st);
    if mask[1] {
        let gw = b.mul(dot, invstd);
        outs.push(Out::T(b.convert(gw, pdt)));
    } else {
        outs.push(Out::None);
    }
    if mask[2] {
        outs.push(Out::T(b.convert(sum_dy, pdt)));
    } else {
        outs.push(Out::None);
    }
    Ok(outs)
}

// ---------------------------------------------------------------------------------------
// Layer norm
// ---------------------------------------------------------------------------------------

/// The first normalized dim, with PyTorch's checks of `normalized_shape`, weight and bias.
fn layer_norm_axis(
    x: &TensorArg,
    ns: &[i64],
    w: Option<&TensorArg>,
    bias: Option<&TensorArg>,
) -> LResult<usize> {
    if ns.is_empty() {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected normalized_shape to be at least 1-dimensional, i.e., containing at least one element, but got normalized_shape = {}",
                shape_str(ns)
            ),
        );
    }
    for (p, what) in [(w, "weight"), (bias, "bias")] {
        if let Some(p) = p {
            if p.shape != ns {
                return user_err(
                    ErrorKind::Runtime,
                    format!(
                        "Expected {what} to be of same shape as normalized_shape, but got {what} of shape {} and normalized_shape = {}",
                        shape_str(&p.shape),
                        shape_str(ns)
                    ),
                );
            }
        }
    }
    let r = x.shape.len();
    if r < ns.len() || x.shape[r - ns.len()..] != *ns {
        let mut expect = String::from("[*");
        for d in ns {
            expect.push_str(&format!(", {d}"));
        }
        expect.push(']');
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Given normalized_shape={}, expected input with shape {expect}, but got input of size{}",
                shape_str(ns),
                shape_str(&x.shape)
            ),
        );
    }
    Ok(r - ns.len())
}

fn layer_norm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "input")?;
    let ns = c.args.ints("normalized_shape")?;
    let w = c.args.opt_tensor("weight").cloned();
    let bias = c.args.opt_tensor("bias").cloned();
    let eps = c.args.float("eps")?;
    float_input(&x, "layer_norm")?;
    let axis = layer_norm_axis(&x, &ns, w.as_ref(), bias.as_ref())?;
    let st = stat_dtype(x.dtype, &[w.as_ref(), bias.as_ref()]);
    let cd = opmath(x.dtype);
    let dims: Vec<i64> = (axis as i64..x.shape.len() as i64).collect();
    let n = numel(&ns);
    let b = &mut *c.b;
    let xv = b.convert(x.value, cd);
    let s = super::reduce::sum_keep(b, xv, &dims);
    let nn = b.splat(s, n as f64);
    let mean = b.div(s, nn);
    let mb = b.broadcast_to(mean, &x.shape);
    let d = b.sub(xv, mb);
    let d2 = b.mul(d, d);
    let ss = super::reduce::sum_keep(b, d2, &dims);
    let var = b.div(ss, nn);
    let rstd = recip_sqrt(b, var, eps);
    let rb = b.broadcast_to(rstd, &x.shape);
    let mut y = b.mul(d, rb);
    if let Some(w) = &w {
        let wv = b.convert(w.value, cd);
        let wb = b.broadcast_to(wv, &x.shape);
        y = b.mul(y, wb);
    }
    if let Some(bb) = &bias {
        let bv = b.convert(bb.value, cd);
        let bb = b.broadcast_to(bv, &x.shape);
        y = b.add(y, bb);
    }
    let y = b.convert(y, x.dtype);
    let mean = b.convert(mean, st);
    let rstd = b.convert(rstd, st);
    Ok(vec![Out::T(y), Out::T(mean), Out::T(rstd)])
}

fn layer_norm_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_out")?;
    let x = tensor(c, "input")?;
    let ns = c.args.ints("normalized_shape")?;
    let mean = tensor(c, "mean")?;
    let rstd = tensor(c, "rstd")?;
    let w = c.args.opt_tensor("weight").cloned();
    let bias = c.args.opt_tensor("bias").cloned();
    let mask = c.args.bools("output_mask")?;
    float_input(&x, "layer_norm_backward")?;
    let axis = layer_norm_axis(&x, &ns, w.as_ref(), bias.as_ref())?;
    if gy.shape != x.shape || mask.len() != 3 || numel(&x.shape) == 0 {
        return decline("layer_norm_backward: unsupported shapes");
    }
    let r = x.shape.len() as i64;
    let norm_dims: Vec<i64> = (axis as i64..r).collect();
    let batch_dims: Vec<i64> = (0..axis as i64).collect();
    let n = numel(&ns);
    let cd = opmath(x.dtype);
    let b = &mut *c.b;
    let xv = b.convert(x.value, cd);
    let g = b.convert(gy.value, cd);
    let mv = b.convert(mean.value, cd);
    let mv = b.reshape(mv, &reduced_shape(&x.shape, &norm_dims, true));
    let mb = b.broadcast_to(mv, &x.shape);
    let rv = b.convert(rstd.value, cd);
    let rv = b.reshape(rv, &reduced_shape(&x.shape, &norm_dims, true));
    let rb = b.broadcast_to(rv, &x.shape);
    let xmu = b.sub(xv, mb);
    let xhat = b.mul(xmu, rb);
    let mut outs = Vec::new();
    if mask[0] {
        let gw = match &w {
            Some(w) => {
                let wv = b.convert(w.value, cd);
                let wb = b.broadcast_to(wv, &x.shape);
                b.mul(g, wb)
            }
            None => g,
        };
        // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) over the normalized dims.
        let s1 = super::reduce::sum_keep(b, gw, &norm_dims);
        let gx = b.mul(gw, xhat);
        let s2 = super::reduce::sum_keep(b, gx, &norm_dims);
        let nn = b.splat(s1, n as f64);
        let m1 = b.div(s1, nn);
        let m2 = b.div(s2, nn);
        let m1 = b.broadcast_to(m1, &x.shape);
        let m2 = b.broadcast_to(m2, &x.shape);
        let p = b.mul(xhat, m2);
        let t = b.sub(gw, m1);
        let t = b.sub(t, p);
        let dx = b.mul(t, rb);
        outs.push(Out::T(b.convert(dx, x.dtype)));
    } else {
        outs.push(Out::None);
    }
    match (&w, mask[1]) {
        (Some(w), true) => {
            let gx = b.mul(g, xhat);
            let dw = b.reduce(gx, &batch_dims, ReduceKind::Sum);
            outs.push(Out::T(b.convert(dw, w.dtype)));
        }
        _ => outs.push(Out::None),
    }
    match (&bias, mask[2]) {
        (Some(bb), true) => {
            let db = b.reduce(g, &batch_dims, ReduceKind::Sum);
            outs.push(Out::T(b.convert(db, bb.dtype)));
        }
        _ => outs.push(Out::None),
    }
    Ok(outs)
}

/// native_group_norm_backward: layer-norm-style gradients within each (sample, group).
fn group_norm_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_out")?;
    let x = tensor(c, "input")?;
    let mean = tensor(c, "mean")?;
    let rstd = tensor(c, "rstd")?;
    let w = c.args.opt_tensor("weight").cloned();
    let (n, ch, hxw, g) = (
        c.args.int("N")?,
        c.args.int("C")?,
        c.args.int("HxW")?,
        c.args.int("group")?,
    );
    let mask = c.args.bools("output_mask")?;
    float_input(&x, "group_norm_backward")?;
    let ok = g > 0
        && ch % g == 0
        && n * ch * hxw > 0
        && numel(&x.shape) == n * ch * hxw
        && gy.shape == x.shape
        && numel(&mean.shape) == n * g
        && numel(&rstd.shape) == n * g
        && w.as_ref().map(|w| numel(&w.shape) == ch).unwrap_or(true)
        && mask.len() == 3;
    if !ok {
        return decline("group_norm_backward: unsupported shapes");
    }
    let cg = ch / g;
    let shape = [n, g, cg, hxw];
    let cd = opmath(x.dtype);
    let b = &mut *c.b;
    let xv = b.convert(x.value, cd);
    let xv = b.reshape(xv, &shape);
    let gv = b.convert(gy.value, cd);
    let gv = b.reshape(gv, &shape);
    let stat = |b: &mut Builder, v: Value| {
        let v = b.convert(v, cd);
        let v = b.reshape(v, &[n, g]);
        b.broadcast_in_dim(v, &shape, &[0, 1])
    };
    let mb = stat(b, mean.value);
    let rb = stat(b, rstd.value);
    let xmu = b.sub(xv, mb);
    let xhat = b.mul(xmu, rb);
    let wb = w.as_ref().map(|w| {
        let wv = b.convert(w.value, cd);
        let wv = b.reshape(wv, &[g, cg]);
        b.broadcast_in_dim(wv, &shape, &[1, 2])
    });
    let mut outs = Vec::new();
    if mask[0] {
        let gw = match wb {
            Some(wb) => b.mul(gv, wb),
            None => gv,
        };
        let dims = [2, 3];
        let s1 = super::reduce::sum_keep(b, gw, &dims);
        let gx = b.mul(gw, xhat);
        let s2 = super::reduce::sum_keep(b, gx, &dims);
        let k = b.splat(s1, (cg * hxw) as f64);
        let m1 = b.div(s1, k);
        let m2 = b.div(s2, k);
        let m1 = b.broadcast_to(m1, &shape);
        let m2 = b.broadcast_to(m2, &shape);
        let p = b.mul(xhat, m2);
        let t = b.sub(gw, m1);
        let t = b.sub(t, p);
        let dx = b.mul(t, rb);
        let dx = b.reshape(dx, &x.shape);
        outs.push(Out::T(b.convert(dx, x.dtype)));
    } else {
        outs.push(Out::None);
    }
    let pdt = w.as_ref().map(|w| w.dtype).unwrap_or(x.dtype);
    if mask[1] {
        let gx = b.mul(gv, xhat);
        let dw = b.reduce(gx, &[0, 3], ReduceKind::Sum);
        let dw = b.reshape(dw, &[ch]);
        outs.push(Out::T(b.convert(dw, pdt)));
    } else {
        outs.push(Out::None);
    }
    if mask[2] {
        let db = b.reduce(gv, &[0, 3], ReduceKind::Sum);
        let db = b.reshape(db, &[ch]);
        outs.push(Out::T(b.convert(db, pdt)));
    } else {
        outs.push(Out::None);
    }
    Ok(outs)
}

// ---------------------------------------------------------------------------------------
// Losses
// ---------------------------------------------------------------------------------------

/// The `reduction` argument: 0 none, 1 mean, 2 sum.
fn reduction(c: &Ctx) -> LResult<i64> {
    let r = c.args.int_or("reduction", 1);
    if !(0..=2).contains(&r) {
        return decline(format!("unknown reduction {r}"));
    }
    Ok(r)
}

fn reduce_loss(b: &mut Builder, x: Value, r: i64) -> Value {
    if r == 0 {
        return x;
    }
    let shape = b.shape(x);
    let dims: Vec<i64> = (0..shape.len() as i64).collect();
    let s = b.reduce(x, &dims, ReduceKind::Sum);
    if r == 1 {
        let n = b.splat(s, numel(&shape) as f64);
        b.div(s, n)
    } else {
        s
    }
}

/// `grad_output` broadcast over the loss elements (already divided by their count for mean).
fn loss_grad(b: &mut Builder, g: Value, shape: &[i64], r: i64) -> Value {
    let g = b.broadcast_to(g, shape);
    if r == 1 {
        let n = b.splat(g, numel(shape) as f64);
        b.div(g, n)
    } else {
        g
    }
}

/// `self` and `target` promoted and broadcast; float only.
fn pair(c: &mut Ctx, names: &[&str]) -> LResult<(Vec<Value>, DType, Vec<i64>)> {
    let (v, dt, shape) = promote(c, names, super::same)?;
    if !dt.is_float() {
        return decline(format!("{}: non-float operands", c.op));
    }
    let cd = opmath(dt);
    let v = v.into_iter().map(|x| c.b.convert(x, cd)).collect();
    Ok((v, dt, shape))
}

fn mse_loss(c: &mut Ctx) -> LResult<Vec<Out>> {
    let r = reduction(c)?;
    let (v, dt, _) = pair(c, &["self", "target"])?;
    let b = &mut *c.b;
    let d = b.sub(v[0], v[1]);
    let d2 = b.mul(d, d);
    let l = reduce_loss(b, d2, r);
    Ok(vec![Out::T(b.convert(l, dt))])
}

fn mse_loss_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let r = reduction(c)?;
    let (v, dt, shape) = pair(c, &["grad_output", "self", "target"])?;
    let b = &mut *c.b;
    let d = b.sub(v[1], v[2]);
    let two = b.splat(d, 2.0);
    let d = b.mul(two, d);
    let g = loss_grad(b, v[0], &shape, r);
    let gi = b.mul(d, g);
    Ok(vec![Out::T(b.convert(gi, dt))])
}

/// smooth_l1_loss (`beta`) and huber_loss (`delta`), forward.
fn smooth_l1(c: &mut Ctx, huber: bool) -> LResult<Vec<Out>> {
    let r = reduction(c)?;
    let k = c.args.float(if huber { "delta" } else { "beta" })?;
    if huber && k <= 0.0 {
        return user_err(
            ErrorKind::Runtime,
            "huber_loss does not support non-positive values for delta.",
        );
    }
    if !huber && k < 0.0 {
        return user_err(
            ErrorKind::Runtime,
            "smooth_l1_loss does not support negative values for beta.",
        );
    }
    let (v, dt, _) = pair(c, &["self", "target"])?;
    let b = &mut *c.b;
    let d = b.sub(v[0], v[1]);
    let a = b.abs(d);
    let l = if !huber && k == 0.0 {
        a
    } else {
        let kv = b.splat(a, k);
        let half = b.splat(a, 0.5);
        let small = b.compare(a, kv, CmpDir::Lt);
        let sq = b.mul(d, d);
        let sq = b.mul(half, sq);
        let hk = b.splat(a, 0.5 * k);
        let lin = b.sub(a, hk);
        if huber {
            let lin = b.mul(kv, lin);
            b.select(small, sq, lin)
        } else {
            let sq = b.div(sq, kv);
            b.select(small, sq, lin)
        }
    };
    let l = reduce_loss(b, l, r);
    Ok(vec![Out::T(b.convert(l, dt))])
}

fn smooth_l1_backward(c: &mut Ctx, huber: bool) -> LResult<Vec<Out>> {
    let r = reduction(c)?;
    let k = c.args.float(if huber { "delta" } else { "beta" })?;
    let (v, dt, shape) = pair(c, &["grad_output", "self", "target"])?;
    let b = &mut *c.b;
    let d = b.sub(v[1], v[2]);
    let g = loss_grad(b, v[0], &shape, r);
    let kv = b.splat(d, k);
    let nk = b.splat(d, -k);
    let lo = b.compare(d, nk, CmpDir::Lt);
    let hi = b.compare(d, kv, CmpDir::Gt);
    // Outside the quadratic zone the slope is -1/+1 (times delta for huber).
    let (neg, pos, mid) = if huber {
        let gk = b.mul(g, kv);
        let ngk = b.neg(gk);
        let mid = b.mul(d, g);
        (ngk, gk, mid)
    } else {
        let ng = b.neg(g);
        let dg = b.mul(d, g);
        let mid = b.div(dg, kv);
        (ng, g, mid)
    };
    let t = b.select(hi, pos, mid);
    let gi = b.select(lo, neg, t);
    Ok(vec![Out::T(b.convert(gi, dt))])
}

fn binary_cross_entropy(c: &mut Ctx) -> LResult<Vec<Out>> {
    let r = reduction(c)?;
    let names: &[&str] = if c.args.has("weight") {
        &["self", "target", "weight"]
    } else {
        &["self", "target"]
    };
    let xs = c.args.tensor("self")?.shape.clone();
    let (v, dt, shape) = pair(c, names)?;
    if shape != xs {
        return decline("binary_cross_entropy: operands broadcast beyond self");
    }
    let b = &mut *c.b;
    let (x, t) = (v[0], v[1]);
    // (t - 1) * max(log1p(-x), -100) - t * max(log(x), -100)
    let lo = b.splat(x, -100.0);
    let nx = b.neg(x);
    let l1 = b.unary("stablehlo.log_plus_one", nx);
    let l1 = b.max(l1, lo);
    let l0 = b.log(x);
    let l0 = b.max(l0, lo);
    let one = b.splat(x, 1.0);
    let tm1 = b.sub(t, one);
    let a = b.mul(tm1, l1);
    let bb = b.mul(t, l0);
    let mut l = b.sub(a, bb);
    if v.len() == 3 {
        l = b.mul(l, v[2]);
    }
    let l = reduce_loss(b, l, r);
    Ok(vec![Out::T(b.convert(l, dt))])
}

fn binary_cross_entropy_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let r = reduction(c)?;
    let names: &[&str] = if c.args.has("weight") {
        &["grad_output", "self", "target", "weight"]
    } else {
        &["grad_output", "self", "target"]
    };
    let (v, dt, shape) = pair(c, names)?;
    let b = &mut *c.b;
    let (x, t) = (v[1], v[2]);
    // g * (x - t) / max((1 - x) * x, 1e-12) * w
    let g = loss_grad(b, v[0], &shape, r);
    let one = b.splat(x, 1.0);
    let omx = b.sub(one, x);
    let den = b.mul(omx, x);
    let eps = b.splat(x, 1e-12);
    let den = b.max(den, eps);
    let num = b.sub(x, t);
    let q = b.div(num, den);
    let mut gi = b.mul(g, q);
    if v.len() == 4 {
        gi = b.mul(gi, v[3]);
    }
    Ok(vec![Out::T(b.convert(gi, dt))])
}

fn binary_cross_entropy_with_logits(c: &mut Ctx) -> LResult<Vec<Out>> {
    let r = reduction(c)?;
    let mut names = vec!["self", "target"];
    let has_w = c.args.has("weight");
    let has_pw = c.args.has("pos_weight");
    if has_w {
        names.push("weight");
    }
    if has_pw {
        names.push("pos_weight");
    }
    let (v, dt, _) = pair(c, &names)?;
    let b = &mut *c.b;
    let (x, t) = (v[0], v[1]);
    // log_sigmoid(x) = min(x, 0) - log1p(exp(-|x|))
    let zero = b.splat(x, 0.0);
    let one = b.splat(x, 1.0);
    let mn = b.min(x, zero);
    let ax = b.abs(x);
    let nax = b.neg(ax);
    let e = b.exp(nax);
    let lp = b.unary("stablehlo.log_plus_one", e);
    let mut ls = b.sub(mn, lp);
    if has_pw {
        let pw = v[if has_w { 3 } else { 2 }];
        let pm1 = b.sub(pw, one);
        let lw = b.mul(pm1, t);
        let lw = b.add(lw, one);
        ls = b.mul(ls, lw);
    }
    let omt = b.sub(one, t);
    let l = b.mul(omt, x);
    let mut l = b.sub(l, ls);
    if has_w {
        l = b.mul(l, v[2]);
    }
    let l = reduce_loss(b, l, r);
    Ok(vec![Out::T(b.convert(l, dt))])
}

/// The class-dim one-hot of `target` over `shape` (class dim `cd`), and target != ignore_index.
fn nll_masks(
    b: &mut Builder,
    t: &TensorArg,
    shape: &[i64],
    cd: usize,
    ignore: i64,
) -> (Value, Value) {
    let ti = b.convert(t.value, DType::I64);
    let cls = b.iota(DType::I64, shape, cd);
    let tdims: Vec<i64> = (0..shape.len() as i64)
        .filter(|d| *d != cd as i64)
        .collect();
    let tb = b.broadcast_in_dim(ti, shape, &tdims);
    let onehot = b.compare(cls, tb, CmpDir::Eq);
    let ii = b.splat(ti, ignore as f64);
    let valid = b.compare(ti, ii, CmpDir::Ne);
    (onehot, valid)
}

/// Checks nll_loss / nll_loss2d arguments; returns the class dim.
fn nll_check(
    c: &Ctx,
    x: &TensorArg,
    t: &TensorArg,
    w: Option<&TensorArg>,
    two_d: bool,
) -> LResult<usize> {
    if !matches!(t.dtype, DType::I64 | DType::U8) {
        return decline("nll_loss: target dtype is not Long or Byte");
    }
    float_input(x, c.op)?;
    let cd = if two_d {
        if t.shape.len() != 3 {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "only batches of spatial targets supported (3D tensors) but got targets of dimension: {}",
                    t.shape.len()
                ),
            );
        }
        if x.shape.len() != 4 {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "only batches of spatial inputs supported (4D tensors), but got input of dimension: {}",
                    x.shape.len()
                ),
            );
        }
        if x.shape[0] != t.shape[0] || x.shape[2] != t.shape[1] || x.shape[3] != t.shape[2] {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "size mismatch (got input: {} , target: {}",
                    shape_str(&x.shape),
                    shape_str(&t.shape)
                ),
            );
        }
        if let Some(w) = w {
            if numel(&w.shape) != x.shape[1] {
                return user_err(
                    ErrorKind::Runtime,
                    "weight tensor should be defined either for all or no classes",
                );
            }
        }
        1
    } else {
        if x.shape.is_empty() || x.shape.len() > 2 {
            return user_err(ErrorKind::Runtime, "input tensor should be 1D or 2D");
        }
        if t.shape.len() > 1 {
            return user_err(
                ErrorKind::Runtime,
                "0D or 1D target tensor expected, multi-target not supported",
            );
        }
        if x.shape.len() == 1 {
            if t.shape.len() == 1 && t.shape[0] != 1 {
                return user_err(
                    ErrorKind::Value,
                    format!(
                        "For 1D input, 1D target must have size 1, but got target size: {}",
                        t.shape[0]
                    ),
                );
            }
        } else if t.shape.first() != Some(&x.shape[0]) {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "size mismatch (got input: {}, target: {})",
                    shape_str(&x.shape),
                    shape_str(&t.shape)
                ),
            );
        }
        let classes = *x.shape.last().expect("rank checked");
        if let Some(w) = w {
            if w.shape.len() != 1 || w.shape[0] != classes {
                return user_err(
                    ErrorKind::Runtime,
                    format!(
                        "weight tensor should be defined either for all {classes} classes or no classes but got weight tensor of shape: {}",
                        shape_str(&w.shape)
                    ),
                );
            }
        }
        x.shape.len() - 1
    };
    Ok(cd)
}

/// The weight of each target (w[target], or 1), zero where the target is ignored.
fn nll_target_weight(
    b: &mut Builder,
    w: Option<&TensorArg>,
    x: &TensorArg,
    cd: usize,
    onehot: Value,
    valid: Value,
) -> Value {
    let cdt = opmath(x.dtype);
    let tshape = b.shape(valid);
    let wt = match w {
        Some(w) => {
            let wv = b.convert(w.value, cdt);
            let wv = b.reshape(wv, &[x.shape[cd]]);
            let wb = b.broadcast_in_dim(wv, &x.shape, &[cd as i64]);
            let z = b.splat(wb, 0.0);
            let s = b.select(onehot, wb, z);
            b.reduce(s, &[cd as i64], ReduceKind::Sum)
        }
        None => b.full(cdt, &tshape, 1.0),
    };
    let z = b.splat(wt, 0.0);
    b.select(valid, wt, z)
}

fn nll_loss(c: &mut Ctx, two_d: bool) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let mut t = tensor(c, "target")?;
    let w = c.args.opt_tensor("weight").cloned();
    let r = reduction(c)?;
    let ignore = c.args.int("ignore_index")?;
    let cd = nll_check(c, &x, &t, w.as_ref(), two_d)?;
    let b = &mut *c.b;
    if x.shape.len() == 1 {
        t.value = b.reshape(t.value, &[]);
        t.shape = vec![];
    }
    let cdt = opmath(x.dtype);
    let (onehot, valid) = nll_masks(b, &t, &x.shape, cd, ignore);
    let wt = nll_target_weight(b, w.as_ref(), &x, cd, onehot, valid);
    let xv = b.convert(x.value, cdt);
    let z = b.splat(xv, 0.0);
    let sel = b.select(onehot, xv, z);
    let picked = b.reduce(sel, &[cd as i64], ReduceKind::Sum);
    let l = b.mul(picked, wt);
    let l = b.neg(l);
    let zt = b.splat(l, 0.0);
    let l = b.select(valid, l, zt);
    // Unreduced 2-d losses report total_weight 0; a 1-d input always sums its weight.
    let (out, tw) = if r == 0 && x.shape.len() > 1 {
        (l, b.constant(cdt, 0.0))
    } else if r == 0 {
        (l, wt)
    } else {
        let dims: Vec<i64> = (0..t.shape.len() as i64).collect();
        let s = b.reduce(l, &dims, ReduceKind::Sum);
        let tw = b.reduce(wt, &dims, ReduceKind::Sum);
        (if r == 1 { b.div(s, tw) } else { s }, tw)
    };
    Ok(vec![
        Out::T(b.convert(out, x.dtype)),
        Out::T(b.convert(tw, x.dtype)),
    ])
}

fn nll_loss_backward(c: &mut Ctx, two_d: bool) -> LResult<Vec<Out>> {
    let g = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let mut t = tensor(c, "target")?;
    let w = c.args.opt_tensor("weight").cloned();
    let r = reduction(c)?;
    let ignore = c.args.int("ignore_index")?;
    let tw = tensor(c, "total_weight")?;
    let cd = nll_check(c, &x, &t, w.as_ref(), two_d)?;
    let b = &mut *c.b;
    if x.shape.len() == 1 {
        t.value = b.reshape(t.value, &[]);
        t.shape = vec![];
    }
    let cdt = opmath(x.dtype);
    let (onehot, valid) = nll_masks(b, &t, &x.shape, cd, ignore);
    let wt = nll_target_weight(b, w.as_ref(), &x, cd, onehot, valid);
    let gv = b.convert(g.value, cdt);
    if (r == 0 && g.shape != t.shape) || (r != 0 && numel(&g.shape) != 1) {
        return decline("nll_loss_backward: grad_output shape");
    }
    let gv = if r == 0 { gv } else { b.reshape(gv, &[]) };
    let gv = b.broadcast_to(gv, &t.shape);
    let mut coef = b.mul(gv, wt);
    coef = b.neg(coef);
    if r == 1 {
        let twv = b.convert(tw.value, cdt);
        let twv = b.reshape(twv, &[]);
        let twv = b.broadcast_to(twv, &t.shape);
        coef = b.div(coef, twv);
    }
    let tdims: Vec<i64> = (0..x.shape.len() as i64)
        .filter(|d| *d != cd as i64)
        .collect();
    let cb = b.broadcast_in_dim(coef, &x.shape, &tdims);
    let vb = b.broadcast_in_dim(valid, &x.shape, &tdims);
    let m = b.and(onehot, vb);
    let z = b.splat(cb, 0.0);
    let gi = b.select(m, cb, z);
    Ok(vec![Out::T(b.convert(gi, x.dtype))])
}

// ---------------------------------------------------------------------------------------
// Convolution
// ---------------------------------------------------------------------------------------

struct Conv {
    stride: Vec<i64>,
    pad: Vec<i64>,
    dil: Vec<i64>,
    groups: i64,
    transposed: bool,
    out_pad: Vec<i64>,
}

/// Convolution parameters. PyTorch validates shapes before it calls the backend op, so
/// anything unusual here is declined rather than reported.
fn conv_args(c: &Ctx, x: &TensorArg, w: &TensorArg) -> LResult<Conv> {
    float_input(x, "convolution")?;
    let r = x.shape.len();
    if w.dtype != x.dtype
        || r < 3
        || w.shape.len() != r
        || numel(&x.shape) == 0
        || numel(&w.shape) == 0
    {
        return decline("convolution: unsupported input/weight");
    }
    let n = r - 2;
    let p = Conv {
        stride: expand(c.args.ints("stride")?, n, "stride")?,
        pad: expand(c.args.ints("padding")?, n, "padding")?,
        dil: expand(c.args.ints("dilation")?, n, "dilation")?,
        groups: c.args.int("groups")?,
        transposed: c.args.bool_or("transposed", false),
        out_pad: expand(
            c.args.ints("output_padding").unwrap_or_else(|_| vec![0]),
            n,
            "output_padding",
        )?,
    };
    let g = p.groups;
    let ok_params = g > 0
        && p.stride.iter().all(|v| *v > 0)
        && p.dil.iter().all(|v| *v > 0)
        && p.pad.iter().all(|v| *v >= 0)
        && p.out_pad.iter().all(|v| *v >= 0);
    let ok_channels = if p.transposed {
        x.shape[1] == w.shape[0] && w.shape[0] % g == 0
    } else {
        x.shape[1] == w.shape[1] * g && w.shape[0] % g == 0
    };
    if !ok_params || !ok_channels {
        return decline("convolution: unsupported parameters");
    }
    Ok(p)
}

fn conv_fwd(b: &mut Builder, x: Value, w: Value, p: &Conv) -> Value {
    let n = p.stride.len();
    let pad: Vec<(i64, i64)> = p.pad.iter().map(|v| (*v, *v)).collect();
    b.convolution(x, w, &p.stride, &pad, &vec![1; n], &p.dil, p.groups, 1)
}

/// The gradient of `conv_fwd` with respect to its input of spatial size `in_sp` (also the
/// transposed convolution): a stride-1 convolution of the stride-dilated `gy` with the
/// flipped kernel whose in/out features are swapped within each group.
fn conv_input_grad(b: &mut Builder, gy: Value, w: Value, p: &Conv, in_sp: &[i64]) -> Value {
    let ws = b.shape(w);
    let gys = b.shape(gy);
    let n = ws.len() - 2;
    let g = p.groups;
    let (o, cg) = (ws[0], ws[1]);
    let og = o / g;
    let k = ws[2..].to_vec();
    let mut s5 = vec![g, og, cg];
    s5.extend_from_slice(&k);
    let r = b.reshape(w, &s5);
    let mut perm = vec![0, 2, 1];
    perm.extend(3..3 + n as i64);
    let r = b.transpose(r, &perm);
    let mut s4 = vec![g * cg, og];
    s4.extend_from_slice(&k);
    let r = b.reshape(r, &s4);
    let sp: Vec<i64> = (2..2 + n as i64).collect();
    let r = b.reverse(r, &sp);
    let pad: Vec<(i64, i64)> = (0..n)
        .map(|i| {
            let kd = (k[i] - 1) * p.dil[i];
            (
                kd - p.pad[i],
                in_sp[i] - 1 + p.pad[i] - (gys[2 + i] - 1) * p.stride[i],
            )
        })
        .collect();
    b.convolution(gy, r, &vec![1; n], &pad, &p.stride, &p.dil, g, 1)
}

/// The gradient of `conv_fwd` with respect to its kernel of spatial size `k`: channels act
/// as the batch, the batch as the contracted feature, one batch group per conv group.
fn conv_weight_grad(b: &mut Builder, x: Value, gy: Value, p: &Conv, k: &[i64]) -> Value {
    let xs = b.shape(x);
    let gys = b.shape(gy);
    let n = xs.len() - 2;
    let mut perm = vec![1, 0];
    perm.extend(2..2 + n as i64);
    let lhs = b.transpose(x, &perm);
    let rhs = b.transpose(gy, &perm);
    let pad: Vec<(i64, i64)> = (0..n)
        .map(|i| {
            let hi =
                (k[i] - 1) * p.dil[i] + (gys[2 + i] - 1) * p.stride[i] + 1 - xs[2 + i] - p.pad[i];
            (p.pad[i], hi)
        })
        .collect();
    let r = b.convolution(lhs, rhs, &p.dil, &pad, &vec![1; n], &p.stride, 1, p.groups);
    b.transpose(r, &perm)
}

/// convolution / convolution_overrideable.
fn convolution(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "input")?;
    let w = tensor(c, "weight")?;
    let bias = c.args.opt_tensor("bias").cloned();
    let p = conv_args(c, &x, &w)?;
    let n = x.shape.len() - 2;
    let b = &mut *c.b;
    let y = if p.transposed {
        let out_sp: Vec<i64> = (0..n)
            .map(|i| {
                (x.shape[2 + i] - 1) * p.stride[i] - 2 * p.pad[i]
                    + p.dil[i] * (w.shape[2 + i] - 1)
                    + p.out_pad[i]
                    + 1
            })
            .collect();
        conv_input_grad(b, x.value, w.value, &p, &out_sp)
    } else {
        conv_fwd(b, x.value, w.value, &p)
    };
    let y = match bias {
        Some(bias) => {
            let bv = b.convert(bias.value, x.dtype);
            let shape = b.shape(y);
            let bb = per_channel(b, bv, &shape);
            b.add(y, bb)
        }
        None => y,
    };
    Ok(vec![Out::T(y)])
}

/// convolution_backward / convolution_backward_overrideable.
fn convolution_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "input")?;
    let w = tensor(c, "weight")?;
    let mask = c.args.bools("output_mask")?;
    let p = conv_args(c, &x, &w)?;
    if gy.dtype != x.dtype
        || gy.shape.len() != x.shape.len()
        || numel(&gy.shape) == 0
        || mask.len() != 3
    {
        return decline("convolution_backward: unsupported grad_output");
    }
    let k = w.shape[2..].to_vec();
    let b = &mut *c.b;
    let mut outs = Vec::new();
    if mask[0] {
        let gi = if p.transposed {
            conv_fwd(b, gy.value, w.value, &p)
        } else {
            conv_input_grad(b, gy.value, w.value, &p, &x.shape[2..])
        };
        if b.shape(gi) != x.shape {
            return decline("convolution_backward: input gradient shape");
        }
        outs.push(Out::T(gi));
    } else {
        outs.push(Out::None);
    }
    // PyTorch's CPU kernels return the weight gradient whenever the bias gradient is asked.
    if mask[1] || mask[2] {
        let gw = if p.transposed {
            conv_weight_grad(b, gy.value, x.value, &p, &k)
        } else {
            conv_weight_grad(b, x.value, gy.value, &p, &k)
        };
        if b.shape(gw) != w.shape {
            return decline("convolution_backward: weight gradient shape");
        }
        outs.push(Out::T(gw));
    } else {
        outs.push(Out::None);
    }
    if mask[2] {
        let cd = opmath(gy.dtype);
        let g = b.convert(gy.value, cd);
        let s = sum_but(b, g, 1);
        outs.push(Out::T(b.convert(s, gy.dtype)));
    } else {
        outs.push(Out::None);
    }
    Ok(outs)
}

// ---------------------------------------------------------------------------------------
// Pooling
// ---------------------------------------------------------------------------------------

struct Pool {
    k: [i64; 2],
    s: [i64; 2],
    p: [i64; 2],
    d: [i64; 2],
    out: [i64; 2],
}

/// Floor division for any signs.
fn div_floor(a: i64, b: i64) -> i64 {
    let q = a / b;
    if a % b != 0 && ((a < 0) != (b < 0)) {
        q - 1
    } else {
        q
    }
}

/// PyTorch's pooling output size, with its checks.
fn pool_out(inp: i64, k: i64, p: i64, s: i64, d: i64, ceil: bool) -> LResult<i64> {
    if s == 0 {
        return user_err(ErrorKind::Runtime, "stride should not be zero");
    }
    if p < 0 {
        return user_err(
            ErrorKind::Runtime,
            format!("pad must be non-negative, but got pad: {p}"),
        );
    }
    if p > ((k - 1) * d + 1) / 2 {
        return user_err(
            ErrorKind::Runtime,
            format!("pad should be at most half of effective kernel size, but got pad={p}, kernel_size={k} and dilation={d}"),
        );
    }
    let mut o = div_floor(
        inp + 2 * p - d * (k - 1) - 1 + if ceil { s - 1 } else { 0 },
        s,
    ) + 1;
    if ceil && (o - 1) * s >= inp + p {
        o -= 1;
    }
    Ok(o)
}

/// The two ints of a pooling parameter given as one or two ints (`None` when empty).
fn pair_of(v: &[i64]) -> Option<[i64; 2]> {
    match v.len() {
        1 => Some([v[0], v[0]]),
        2 => Some([v[0], v[1]]),
        _ => None,
    }
}

/// Reads and checks max_pool2d / avg_pool2d parameters for input `x`.
fn pool_args(c: &Ctx, name: &str, x: &TensorArg, with_dilation: bool) -> LResult<Pool> {
    let Some(k) = pair_of(&c.args.ints("kernel_size")?) else {
        return user_err(
            ErrorKind::Runtime,
            format!("{name}: kernel_size must either be a single int, or a tuple of two ints"),
        );
    };
    let sv = c.args.ints("stride").unwrap_or_default();
    let s = if sv.is_empty() {
        k
    } else {
        match pair_of(&sv) {
            Some(s) => s,
            None => {
                return user_err(
                    ErrorKind::Runtime,
                    format!(
                    "{name}: stride must either be omitted, a single int, or a tuple of two ints"
                ),
                )
            }
        }
    };
    let Some(p) = pair_of(&c.args.ints("padding")?) else {
        return user_err(
            ErrorKind::Runtime,
            format!("{name}: padding must either be a single int, or a tuple of two ints"),
        );
    };
    let d = if with_dilation {
        match pair_of(&c.args.ints("dilation")?) {
            Some(d) => d,
            None => {
                return user_err(
                    ErrorKind::Runtime,
                    format!("{name}: dilation must be either a single int, or a tuple of two ints"),
                )
            }
        }
    } else {
        [1, 1]
    };
    if c.args.opt_int("divisor_override") == Some(0) {
        return user_err(ErrorKind::Runtime, "divisor must be not zero");
    }
    let r = x.shape.len();
    if r != 3 && r != 4 {
        if with_dilation {
            return user_err(
                ErrorKind::Runtime,
                "non-empty 3D or 4D (batch mode) tensor expected for input",
            );
        }
        return decline(format!("{name}: input of rank {r}"));
    }
    let ceil = c.args.bool_or("ceil_mode", false);
    let (h, w) = (x.shape[r - 2], x.shape[r - 1]);
    let oh = pool_out(h, k[0], p[0], s[0], d[0], ceil)?;
    let ow = pool_out(w, k[1], p[1], s[1], d[1], ceil)?;
    if k[0] <= 0 || k[1] <= 0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "kernel size should be greater than zero, but got kH: {} kW: {}",
                k[0], k[1]
            ),
        );
    }
    if s[0] <= 0 || s[1] <= 0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "stride should be greater than zero, but got dH: {} dW: {}",
                s[0], s[1]
            ),
        );
    }
    if d[0] <= 0 || d[1] <= 0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "dilation should be greater than zero, but got dilationH: {} dilationW: {}",
                d[0], d[1]
            ),
        );
    }
    if x.shape[r - 3..].contains(&0) {
        return decline(format!("{name}: empty non-batch dims"));
    }
    if k[1] / 2 < p[1] || k[0] / 2 < p[0] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "pad should be smaller than or equal to half of kernel size, but got padW = {}, padH = {}, kW = {}, kH = {}",
                p[1], p[0], k[1], k[0]
            ),
        );
    }
    if oh < 1 || ow < 1 {
        let ch = x.shape[r - 3];
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Given input size: ({ch}x{h}x{w}). Calculated output size: ({ch}x{oh}x{ow}). Output size is too small"
            ),
        );
    }
    Ok(Pool {
        k,
        s,
        p,
        d,
        out: [oh, ow],
    })
}

/// Window, stride, dilation and padding over all dims of a rank-`r` input (the leading
/// dims untouched); the high padding covers ceil_mode's partial last window.
#[allow(clippy::type_complexity)]
fn pool_window(pl: &Pool, shape: &[i64]) -> (Vec<i64>, Vec<i64>, Vec<i64>, Vec<(i64, i64)>) {
    let r = shape.len();
    let mut win = vec![1; r];
    let mut st = vec![1; r];
    let mut dil = vec![1; r];
    let mut pad = vec![(0, 0); r];
    for i in 0..2 {
        let j = r - 2 + i;
        win[j] = pl.k[i];
        st[j] = pl.s[i];
        dil[j] = pl.d[i];
        let need = (pl.out[i] - 1) * pl.s[i] + (pl.k[i] - 1) * pl.d[i] + 1;
        let extra = (need - (shape[j] + 2 * pl.p[i])).max(0);
        pad[j] = (pl.p[i], pl.p[i] + extra);
    }
    (win, st, dil, pad)
}

/// max_pool2d_with_indices: the max of each window and its flat index in the (h, w) plane.
/// Ties keep the first index; NaN wins, and among NaNs the last one, as PyTorch's scan does.
fn max_pool2d(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let pl = pool_args(c, "max_pool2d", &x, true)?;
    if x.dtype == DType::Bool {
        return decline("max_pool2d: bool input");
    }
    let r = x.shape.len();
    let (h, w) = (x.shape[r - 2], x.shape[r - 1]);
    let b = &mut *c.b;
    let ih = b.iota(DType::I64, &[h, w], 0);
    let iw = b.iota(DType::I64, &[h, w], 1);
    let wk = b.splat(ih, w as f64);
    let idx = b.mul(ih, wk);
    let idx = b.add(idx, iw);
    let idx = b.broadcast_in_dim(idx, &x.shape, &[r as i64 - 2, r as i64 - 1]);
    let (win, st, dil, pad) = pool_window(&pl, &x.shape);
    let vinit = b.constant(x.dtype, stablehlo::ReduceKind::Max.init(x.dtype));
    let iinit = b.constant_i64(DType::I64, i64::MAX);
    let res = b.reduce_window_with(
        &[x.value, idx],
        &[vinit, iinit],
        &win,
        &st,
        &dil,
        &pad,
        |b, a| {
            let (av, ai, bv, bi) = (a[0], a[1], a[2], a[3]);
            let a_nan = b.compare(av, av, CmpDir::Ne);
            let b_nan = b.compare(bv, bv, CmpDir::Ne);
            let a_first = b.compare(ai, bi, CmpDir::Lt);
            let a_last = b.not(a_first);
            let both = b.and(a_nan, b_nan);
            let both = b.and(both, a_last);
            let b_num = b.not(b_nan);
            let only_a = b.and(a_nan, b_num);
            let gt = b.compare(av, bv, CmpDir::Gt);
            let eq = b.compare(av, bv, CmpDir::Eq);
            let tie = b.and(eq, a_first);
            let pick = b.or(both, only_a);
            let pick = b.or(pick, gt);
            let pick = b.or(pick, tie);
            vec![b.select(pick, av, bv), b.select(pick, ai, bi)]
        },
    );
    let mut want = x.shape.clone();
    want[r - 2] = pl.out[0];
    want[r - 1] = pl.out[1];
    if b.shape(res[0]) != want {
        return decline("max_pool2d: window arithmetic mismatch");
    }
    Ok(vec![Out::T(res[0]), Out::T(res[1])])
}

/// Adds `updates[m]` into `operand` at `indices[m, :]` (one full index per update).
fn scatter_add(b: &mut Builder, operand: Value, indices: Value, updates: Value) -> Value {
    let dt = b.dtype(operand);
    let st = TensorType::scalar(dt);
    let region = b.region(&[st.clone(), st], |b, a| vec![b.add(a[0], a[1])]);
    let dims: Vec<i64> = (0..b.rank(operand) as i64).collect();
    let l = stablehlo::i64_list(&dims);
    let attrs = format!(
        "scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [], inserted_window_dims = {l}, scatter_dims_to_operand_dims = {l}, index_vector_dim = 1>, indices_are_sorted = false, unique_indices = false"
    );
    let ty = b.ty(operand).clone();
    b.op_regions(
        "stablehlo.scatter",
        &[operand, indices, updates],
        &[region],
        &attrs,
        &[ty],
    )[0]
}

fn max_pool2d_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let ind = tensor(c, "indices")?;
    let pl = pool_args(c, "max_pool2d", &x, true)?;
    float_input(&x, "max_pool2d_backward")?;
    let r = x.shape.len();
    let mut want = x.shape.clone();
    want[r - 2] = pl.out[0];
    want[r - 1] = pl.out[1];
    if gy.shape != want || ind.shape != want {
        return decline("max_pool2d_backward: grad_output/indices shape");
    }
    let planes: i64 = x.shape[..r - 2].iter().product();
    let hw = x.shape[r - 2] * x.shape[r - 1];
    let l = pl.out[0] * pl.out[1];
    let m = planes * l;
    let cd = opmath(x.dtype);
    let b = &mut *c.b;
    let zero = b.full(cd, &[planes, hw], 0.0);
    let idx = b.convert(ind.value, DType::I64);
    let idx = b.reshape(idx, &[m, 1]);
    let plane = b.iota(DType::I64, &[planes, l], 0);
    let plane = b.reshape(plane, &[m, 1]);
    let both = b.concatenate(&[plane, idx], 1);
    let g = b.convert(gy.value, cd);
    let g = b.reshape(g, &[m]);
    let gi = scatter_add(b, zero, both, g);
    let gi = b.reshape(gi, &x.shape);
    Ok(vec![Out::T(b.convert(gi, x.dtype))])
}

/// Divisors of avg_pool2d along one dim: the window length clipped to the padded input
/// (count_include_pad) or to the input.
fn avg_counts(inp: i64, k: i64, s: i64, p: i64, out: i64, include_pad: bool) -> Vec<f64> {
    (0..out)
        .map(|o| {
            let start = o * s - p;
            let end = (start + k).min(inp + p);
            if include_pad {
                (end - start) as f64
            } else {
                (end.min(inp) - start.max(0)) as f64
            }
        })
        .collect()
}

/// The divisor of each avg_pool2d output, as a value of `shape` (outputs in the last 2 dims).
fn avg_divisor(c: &mut Ctx, x: &TensorArg, pl: &Pool, shape: &[i64], dt: DType) -> Value {
    let r = shape.len();
    if let Some(d) = c.args.opt_int("divisor_override") {
        return c.b.full(dt, shape, d as f64);
    }
    let inc = c.args.bool_or("count_include_pad", true);
    let ch = avg_counts(x.shape[r - 2], pl.k[0], pl.s[0], pl.p[0], pl.out[0], inc);
    let cw = avg_counts(x.shape[r - 1], pl.k[1], pl.s[1], pl.p[1], pl.out[1], inc);
    let all: Vec<f64> = ch
        .iter()
        .flat_map(|a| cw.iter().map(move |b| a * b))
        .collect();
    let v = const_vec(c.b, dt, &all);
    let v = c.b.reshape(v, &[pl.out[0], pl.out[1]]);
    c.b.broadcast_in_dim(v, shape, &[r as i64 - 2, r as i64 - 1])
}

fn avg_pool2d(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let pl = pool_args(c, "avg_pool2d", &x, false)?;
    if x.dtype == DType::Bool {
        return decline("avg_pool2d: bool input");
    }
    // Integers average in int64 with truncating division, as PyTorch's CPU kernel does.
    let cd = if x.dtype.is_float() {
        opmath(x.dtype)
    } else {
        DType::I64
    };
    let (win, st, _, pad) = pool_window(&pl, &x.shape);
    let xv = c.b.convert(x.value, cd);
    let zero = c.b.constant(cd, 0.0);
    let s =
        c.b.reduce_window(xv, zero, ReduceKind::Sum, &win, &st, &pad);
    let shape = c.b.shape(s);
    let div = avg_divisor(c, &x, &pl, &shape, cd);
    let y = c.b.div(s, div);
    Ok(vec![Out::T(c.b.convert(y, x.dtype))])
}

fn avg_pool2d_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let pl = pool_args(c, "avg_pool2d", &x, false)?;
    float_input(&x, "avg_pool2d_backward")?;
    let r = x.shape.len();
    let mut want = x.shape.clone();
    want[r - 2] = pl.out[0];
    want[r - 1] = pl.out[1];
    if gy.shape != want {
        return decline("avg_pool2d_backward: grad_output shape");
    }
    let cd = opmath(x.dtype);
    let g = c.b.convert(gy.value, cd);
    let div = avg_divisor(c, &x, &pl, &want, cd);
    let b = &mut *c.b;
    let g = b.div(g, div);
    // Each input element collects the outputs whose window covers it: spread the outputs
    // stride apart, pad, and sum windows of the kernel size.
    let mut lo = vec![0; r];
    let mut hi = vec![0; r];
    let mut interior = vec![0; r];
    let mut win = vec![1; r];
    for i in 0..2 {
        let j = r - 2 + i;
        lo[j] = pl.k[i] - 1 - pl.p[i];
        hi[j] = x.shape[j] + pl.p[i] - 1 - (pl.out[i] - 1) * pl.s[i];
        interior[j] = pl.s[i] - 1;
        win[j] = pl.k[i];
    }
    let zero = b.constant(cd, 0.0);
    let padded = b.pad(g, zero, &lo, &hi, &interior);
    let gi = b.reduce_window(
        padded,
        zero,
        ReduceKind::Sum,
        &win,
        &vec![1; r],
        &vec![(0, 0); r],
    );
    if b.shape(gi) != x.shape {
        return decline("avg_pool2d_backward: window arithmetic mismatch");
    }
    Ok(vec![Out::T(b.convert(gi, x.dtype))])
}

/// Adaptive pooling windows: [floor(o * in / out), ceil((o + 1) * in / out)).
fn adaptive_windows(inp: i64, out: i64) -> Vec<(i64, i64)> {
    (0..out)
        .map(|o| ((o * inp) / out, ((o + 1) * inp + out - 1) / out))
        .collect()
}

/// The 0/1 membership matrix [out][in] of adaptive windows, and each window's length.
fn adaptive_matrix(inp: i64, out: i64) -> (Vec<Vec<f64>>, Vec<f64>) {
    let wins = adaptive_windows(inp, out);
    let m = wins
        .iter()
        .map(|(s, e)| {
            (0..inp)
                .map(|i| if i >= *s && i < *e { 1.0 } else { 0.0 })
                .collect()
        })
        .collect();
    (m, wins.iter().map(|(s, e)| (e - s) as f64).collect())
}

fn transpose_matrix(m: &[Vec<f64>], cols: usize) -> Vec<Vec<f64>> {
    (0..cols)
        .map(|j| m.iter().map(|row| row[j]).collect())
        .collect()
}

fn adaptive_divisor(b: &mut Builder, ch: &[f64], cw: &[f64], shape: &[i64], dt: DType) -> Value {
    let all: Vec<f64> = ch
        .iter()
        .flat_map(|a| cw.iter().map(move |b| a * b))
        .collect();
    let v = const_vec(b, dt, &all);
    let v = b.reshape(v, &[ch.len() as i64, cw.len() as i64]);
    let r = shape.len() as i64;
    b.broadcast_in_dim(v, shape, &[r - 2, r - 1])
}

fn check_adaptive(x: &TensorArg, os: &[i64]) -> LResult<()> {
    if os.len() != 2 {
        return user_err(
            ErrorKind::Runtime,
            "adaptive_avg_pool2d: output_size must be 2",
        );
    }
    let r = x.shape.len();
    if r != 3 && r != 4 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "adaptive_avg_pool2d(): Expected 3D or 4D tensor, but got {}",
                shape_str(&x.shape)
            ),
        );
    }
    if x.shape[r - 3..].contains(&0) || os.iter().any(|v| *v < 0) || numel(&x.shape) == 0 {
        return decline("adaptive_avg_pool2d: empty input or negative output size");
    }
    float_input(x, "adaptive_avg_pool2d")
}

fn adaptive_avg_pool2d(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let os = c.args.ints("output_size")?;
    check_adaptive(&x, &os)?;
    let r = x.shape.len();
    let (mh, ch) = adaptive_matrix(x.shape[r - 2], os[0]);
    let (mw, cw) = adaptive_matrix(x.shape[r - 1], os[1]);
    let cd = opmath(x.dtype);
    let b = &mut *c.b;
    let xv = b.convert(x.value, cd);
    let t = mix(b, xv, r - 2, &mh);
    let t = mix(b, t, r - 1, &mw);
    let shape = b.shape(t);
    let div = adaptive_divisor(b, &ch, &cw, &shape, cd);
    let y = b.div(t, div);
    Ok(vec![Out::T(b.convert(y, x.dtype))])
}

fn adaptive_avg_pool2d_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let r = x.shape.len();
    if gy.shape.len() != r || r < 2 || gy.shape[..r - 2] != x.shape[..r - 2] {
        return decline("adaptive_avg_pool2d_backward: grad_output shape");
    }
    let os = [gy.shape[r - 2], gy.shape[r - 1]];
    check_adaptive(&x, &os)?;
    let (h, w) = (x.shape[r - 2], x.shape[r - 1]);
    let (mh, ch) = adaptive_matrix(h, os[0]);
    let (mw, cw) = adaptive_matrix(w, os[1]);
    let cd = opmath(x.dtype);
    let b = &mut *c.b;
    let g = b.convert(gy.value, cd);
    let div = adaptive_divisor(b, &ch, &cw, &gy.shape, cd);
    let g = b.div(g, div);
    let t = mix(b, g, r - 2, &transpose_matrix(&mh, h as usize));
    let t = mix(b, t, r - 1, &transpose_matrix(&mw, w as usize));
    Ok(vec![Out::T(b.convert(t, x.dtype))])
}

// ---------------------------------------------------------------------------------------
// Padding
// ---------------------------------------------------------------------------------------

fn constant_pad_nd(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let pad = c.args.ints("pad")?;
    let value = c
        .args
        .opt_scalar("value")
        .map(|s| s.as_f64())
        .unwrap_or(0.0);
    if pad.len() % 2 != 0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Length of pad must be even but instead it equals {}",
                pad.len()
            ),
        );
    }
    let r = x.shape.len();
    if pad.len() / 2 > r {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Length of pad should be no more than twice the number of dimensions of the input. Pad length is {}while the input has {}dimensions.",
                pad.len(),
                r
            ),
        );
    }
    let mut lo = vec![0; r];
    let mut hi = vec![0; r];
    for i in 0..pad.len() / 2 {
        let d = r - 1 - i;
        lo[d] = pad[2 * i];
        hi[d] = pad[2 * i + 1];
        if x.shape[d] + lo[d] + hi[d] < 0 {
            return decline("constant_pad_nd: negative output size");
        }
    }
    let b = &mut *c.b;
    let v = b.constant(x.dtype, value);
    Ok(vec![Out::T(b.pad(x.value, v, &lo, &hi, &vec![0; r]))])
}

/// reflection_pad{1,2,3}d / replication_pad{1,2,3}d: the `padding` pairs (last dim first)
/// resolved per dim, with PyTorch's argument checks.
fn edge_pads(c: &Ctx, x_shape: &[i64], k: usize) -> LResult<Vec<(usize, i64, i64)>> {
    let pad = c.args.ints("padding")?;
    if pad.len() != 2 * k {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "padding size is expected to be {}, but got: {}",
                2 * k,
                pad.len()
            ),
        );
    }
    let r = x_shape.len();
    let lead_ok = r == k + 1 || r == k + 2;
    if !lead_ok || x_shape[r.saturating_sub(k + 1)..].contains(&0) {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected {}D or {}D (batch mode) tensor with possibly 0 batch size and other non-zero dimensions for input, but got: {}",
                k + 1,
                k + 2,
                shape_str(x_shape)
            ),
        );
    }
    Ok((0..k)
        .map(|i| (r - 1 - i, pad[2 * i], pad[2 * i + 1]))
        .collect())
}

/// Pads `x` along `dim` by (l, r) (negative crops) with reflected or replicated edges.
fn edge_pad_dim(b: &mut Builder, x: Value, dim: usize, l: i64, r: i64, reflect: bool) -> Value {
    let n = b.shape(x)[dim];
    let (nl, nr) = (l.max(0), r.max(0));
    let mut parts = Vec::new();
    let edge = |b: &mut Builder, at: i64, count: i64| {
        let e = b.slice_dim(x, dim, at, at + 1, 1);
        let mut shape = b.shape(e);
        shape[dim] = count;
        b.broadcast_to(e, &shape)
    };
    if nl > 0 {
        parts.push(if reflect {
            let s = b.slice_dim(x, dim, 1, nl + 1, 1);
            b.reverse(s, &[dim as i64])
        } else {
            edge(b, 0, nl)
        });
    }
    parts.push(b.slice_dim(x, dim, (-l).max(0), n - (-r).max(0), 1));
    if nr > 0 {
        parts.push(if reflect {
            let s = b.slice_dim(x, dim, n - 1 - nr, n - 1, 1);
            b.reverse(s, &[dim as i64])
        } else {
            edge(b, n - 1, nr)
        });
    }
    b.concatenate(&parts, dim)
}

/// The transpose of `edge_pad_dim`: folds the padded gradient `g` back onto `n` elements.
fn edge_pad_dim_backward(
    b: &mut Builder,
    g: Value,
    dim: usize,
    n: i64,
    l: i64,
    r: i64,
    reflect: bool,
) -> Value {
    let gs = b.shape(g);
    let rank = gs.len();
    let (nl, nr) = (l.max(0), r.max(0));
    let mid_start = (-l).max(0);
    let mid_len = n - mid_start - (-r).max(0);
    let zero = b.constant(b.dtype(g), 0.0);
    let place = |b: &mut Builder, v: Value, at: i64| {
        let len = b.shape(v)[dim];
        let mut lo = vec![0; rank];
        let mut hi = vec![0; rank];
        lo[dim] = at;
        hi[dim] = n - at - len;
        b.pad(v, zero, &lo, &hi, &vec![0; rank])
    };
    let mid = b.slice_dim(g, dim, nl, nl + mid_len, 1);
    let mut acc = place(b, mid, mid_start);
    for (count, start, at_reflect, at_edge) in
        [(nl, 0, 1, 0), (nr, nl + mid_len, n - 1 - nr, n - 1)]
    {
        if count == 0 {
            continue;
        }
        let part = b.slice_dim(g, dim, start, start + count, 1);
        let v = if reflect {
            let rv = b.reverse(part, &[dim as i64]);
            place(b, rv, at_reflect)
        } else {
            let sm = super::reduce::sum_keep(b, part, &[dim as i64]);
            place(b, sm, at_edge)
        };
        acc = b.add(acc, v);
    }
    acc
}

fn edge_pad(c: &mut Ctx, k: usize, reflect: bool) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let pads = edge_pads(c, &x.shape, k)?;
    for (d, l, r) in &pads {
        let n = x.shape[*d];
        let bad = if reflect { *l >= n || *r >= n } else { false };
        if bad || n + l + r < 1 || -l >= n || -r >= n {
            return decline("edge pad: padding too large for the input");
        }
    }
    if x.dtype == DType::Bool {
        return decline("edge pad: bool input");
    }
    if x.shape.contains(&0) {
        let mut shape = x.shape.clone();
        for (d, l, r) in &pads {
            shape[*d] += l + r;
        }
        return Ok(vec![Out::T(c.b.full(x.dtype, &shape, 0.0))]);
    }
    let mut v = x.value;
    for (d, l, r) in pads {
        v = edge_pad_dim(c.b, v, d, l, r, reflect);
    }
    Ok(vec![Out::T(v)])
}

fn edge_pad_backward(c: &mut Ctx, k: usize, reflect: bool) -> LResult<Vec<Out>> {
    let g = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let pads = edge_pads(c, &x.shape, k)?;
    float_input(&g, "pad_backward")?;
    let mut want = x.shape.clone();
    for (d, l, r) in &pads {
        let n = x.shape[*d];
        let bad = if reflect { *l >= n || *r >= n } else { false };
        if bad || n + l + r < 1 || -l >= n || -r >= n {
            return decline("edge pad backward: padding too large for the input");
        }
        want[*d] = n + l + r;
    }
    if g.shape != want || x.shape.contains(&0) {
        return decline("edge pad backward: grad_output shape");
    }
    let cd = opmath(g.dtype);
    let mut v = c.b.convert(g.value, cd);
    for (d, l, r) in pads {
        v = edge_pad_dim_backward(c.b, v, d, x.shape[d], l, r, reflect);
    }
    Ok(vec![Out::T(c.b.convert(v, g.dtype))])
}

// ---------------------------------------------------------------------------------------
// Activations
// ---------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------
// Upsampling
// ---------------------------------------------------------------------------------------

/// PyTorch's scale of an upsampling dim: 1 / the given scale factor, or in / out (in f32).
fn up_scale(inp: i64, out: i64, scale: Option<f64>) -> f32 {
    match scale {
        Some(s) if s > 0.0 => (1.0 / s) as f32,
        _ => inp as f32 / out as f32,
    }
}

/// The [out][in] selection matrix of nearest upsampling.
fn nearest_matrix(inp: i64, out: i64, scale: Option<f64>) -> Vec<Vec<f64>> {
    let sc = up_scale(inp, out, scale);
    (0..out)
        .map(|o| {
            let src = if out == inp {
                o
            } else if out == 2 * inp {
                o >> 1
            } else {
                ((o as f32 * sc).floor() as i64).min(inp - 1)
            };
            (0..inp).map(|i| if i == src { 1.0 } else { 0.0 }).collect()
        })
        .collect()
}

/// The [out][in] interpolation matrix of linear upsampling, with PyTorch's source index.
fn linear_matrix(inp: i64, out: i64, align_corners: bool, scale: Option<f64>) -> Vec<Vec<f64>> {
    let sc: f32 = if align_corners {
        if out > 1 {
            (inp - 1) as f32 / (out - 1) as f32
        } else {
            0.0
        }
    } else {
        up_scale(inp, out, scale)
    };
    (0..out)
        .map(|o| {
            let real = if align_corners {
                sc * o as f32
            } else {
                (sc * (o as f32 + 0.5) - 0.5).max(0.0)
            };
            let i0 = (real.floor() as i64).min(inp - 1);
            let l1 = (real - i0 as f32).clamp(0.0, 1.0);
            let i1 = i0 + if i0 < inp - 1 { 1 } else { 0 };
            let mut row = vec![0.0; inp as usize];
            row[i0 as usize] += (1.0 - l1) as f64;
            row[i1 as usize] += l1 as f64;
            row
        })
        .collect()
}

/// (output size, scale h, scale w) of an upsample call, from either overload.
fn up_args(c: &Ctx, x: &TensorArg) -> LResult<([i64; 2], [Option<f64>; 2])> {
    let r = x.shape.len();
    if r != 4 || x.shape[2..].contains(&0) {
        return decline("upsample2d: input is not 4-d or is empty");
    }
    let os = c.args.opt_ints("output_size");
    let sf = match c.args.get("scale_factors") {
        Some(crate::Arg::List(_)) => Some(c.args.floats("scale_factors")?),
        _ => None,
    };
    match (os, sf) {
        (Some(os), _) if os.len() == 2 => {
            let s = match c.args.get("scale_factors") {
                Some(crate::Arg::List(_)) => {
                    return decline("upsample2d: both output_size and scale_factors");
                }
                _ => [c.args.opt_float("scales_h"), c.args.opt_float("scales_w")],
            };
            Ok(([os[0], os[1]], s))
        }
        (None, Some(sf)) if sf.len() == 2 => {
            let o = [
                (x.shape[2] as f64 * sf[0]) as i64,
                (x.shape[3] as f64 * sf[1]) as i64,
            ];
            Ok((o, [Some(sf[0]), Some(sf[1])]))
        }
        _ => decline("upsample2d: unsupported size arguments"),
    }
}

fn upsample2d(c: &mut Ctx, bilinear: bool) -> LResult<Vec<Out>> {
    let x = c
        .args
        .opt_tensor("self")
        .or_else(|| c.args.opt_tensor("input"))
        .cloned();
    let Some(x) = x else {
        return decline("upsample2d: no input");
    };
    float_input(&x, "upsample2d")?;
    let (os, sc) = up_args(c, &x)?;
    if os.iter().any(|v| *v <= 0) {
        return decline("upsample2d: non-positive output size");
    }
    let align = c.args.bool_or("align_corners", false);
    let (mh, mw) = if bilinear {
        (
            linear_matrix(x.shape[2], os[0], align, sc[0]),
            linear_matrix(x.shape[3], os[1], align, sc[1]),
        )
    } else {
        (
            nearest_matrix(x.shape[2], os[0], sc[0]),
            nearest_matrix(x.shape[3], os[1], sc[1]),
        )
    };
    let cd = opmath(x.dtype);
    let b = &mut *c.b;
    let xv = b.convert(x.value, cd);
    let t = mix(b, xv, 2, &mh);
    let t = mix(b, t, 3, &mw);
    Ok(vec![Out::T(b.convert(t, x.dtype))])
}

fn upsample2d_backward(c: &mut Ctx, bilinear: bool) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    float_input(&gy, "upsample2d_backward")?;
    let os = c.args.ints("output_size")?;
    let is = c.args.ints("input_size")?;
    if os.len() != 2
        || is.len() != 4
        || gy.shape.len() != 4
        || gy.shape[2..] != os[..]
        || gy.shape[..2] != is[..2]
    {
        return decline("upsample2d_backward: sizes");
    }
    if is.contains(&0) || os.contains(&0) {
        return decline("upsample2d_backward: empty");
    }
    let sc = [c.args.opt_float("scales_h"), c.args.opt_float("scales_w")];
    let align = c.args.bool_or("align_corners", false);
    let (mh, mw) = if bilinear {
        (
            linear_matrix(is[2], os[0], align, sc[0]),
            linear_matrix(is[3], os[1], align, sc[1]),
        )
    } else {
        (
            nearest_matrix(is[2], os[0], sc[0]),
            nearest_matrix(is[3], os[1], sc[1]),
        )
    };
    let cd = opmath(gy.dtype);
    let b = &mut *c.b;
    let g = b.convert(gy.value, cd);
    let t = mix(b, g, 2, &transpose_matrix(&mh, is[2] as usize));
    let t = mix(b, t, 3, &transpose_matrix(&mw, is[3] as usize));
    Ok(vec![Out::T(b.convert(t, gy.dtype))])
}

// ---------------------------------------------------------------------------------------
// Dropout
// ---------------------------------------------------------------------------------------

/// native_dropout: in training, keep each element with probability 1 - p and scale the kept
/// ones by 1 / (1 - p); otherwise return the input and an all-true mask.
fn native_dropout(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "input")?;
    let p = c.args.float("p")?;
    let train = match c.args.get("train") {
        Some(crate::Arg::Bool(t)) => *t,
        _ => true,
    };
    if !train || numel(&x.shape) == 0 {
        let ones = c.b.full(DType::Bool, &x.shape, 1.0);
        return Ok(vec![Out::T(x.value), Out::T(ones)]);
    }
    float_input(&x, "native_dropout")?;
    if !(0.0..=1.0).contains(&p) {
        // The CPU fallback raises bernoulli_'s message with PyTorch's number formatting.
        return decline("native_dropout: p outside [0, 1]");
    }
    let keep = 1.0 - p;
    let scale = if keep == 0.0 { 0.0 } else { 1.0 / keep };
    let cd = opmath(x.dtype);
    let u = super::random::uniform(c, &x.shape, cd);
    let b = &mut *c.b;
    let k = b.splat(u, keep);
    let mask = b.compare(u, k, CmpDir::Lt);
    let xv = b.convert(x.value, cd);
    let m = b.convert(mask, cd);
    let y = b.mul(xv, m);
    let s = b.splat(y, scale);
    let y = b.mul(y, s);
    Ok(vec![Out::T(b.convert(y, x.dtype)), Out::T(mask)])
}

fn native_dropout_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let g = tensor(c, "grad_output")?;
    let m = tensor(c, "mask")?;
    let scale = c.args.float("scale")?;
    float_input(&g, "native_dropout_backward")?;
    if m.shape != g.shape {
        return decline("native_dropout_backward: mask shape");
    }
    let b = &mut *c.b;
    let cd = opmath(g.dtype);
    let gv = b.convert(g.value, cd);
    let mv = b.convert(m.value, cd);
    let t = b.mul(gv, mv);
    let k = b.splat(t, scale);
    let r = b.mul(t, k);
    Ok(vec![Out::T(b.convert(r, g.dtype))])
}

pub const RULES: &[(&str, Rule)] = &[
    ("aten::native_batch_norm", batch_norm),
    ("aten::_native_batch_norm_legit", batch_norm),
    ("aten::_native_batch_norm_legit_no_training", batch_norm),
    ("aten::native_batch_norm_backward", batch_norm_backward),
    ("aten::batch_norm_backward", batch_norm_backward),
    ("aten::native_layer_norm", layer_norm),
    ("aten::native_layer_norm_backward", layer_norm_backward),
    ("aten::native_group_norm_backward", group_norm_backward),
    ("aten::nll_loss_forward", |c| nll_loss(c, false)),
    ("aten::nll_loss_backward", |c| nll_loss_backward(c, false)),
    ("aten::nll_loss2d_forward", |c| nll_loss(c, true)),
    ("aten::nll_loss2d_backward", |c| nll_loss_backward(c, true)),
    ("aten::mse_loss", mse_loss),
    ("aten::mse_loss_backward", mse_loss_backward),
    ("aten::smooth_l1_loss", |c| smooth_l1(c, false)),
    ("aten::smooth_l1_loss_backward", |c| {
        smooth_l1_backward(c, false)
    }),
    ("aten::huber_loss", |c| smooth_l1(c, true)),
    ("aten::huber_loss_backward", |c| smooth_l1_backward(c, true)),
    ("aten::binary_cross_entropy", binary_cross_entropy),
    (
        "aten::binary_cross_entropy_backward",
        binary_cross_entropy_backward,
    ),
    (
        "aten::binary_cross_entropy_with_logits",
        binary_cross_entropy_with_logits,
    ),
    ("aten::convolution", convolution),
    ("aten::convolution_overrideable", convolution),
    ("aten::convolution_backward", convolution_backward),
    (
        "aten::convolution_backward_overrideable",
        convolution_backward,
    ),
    ("aten::max_pool2d_with_indices", max_pool2d),
    (
        "aten::max_pool2d_with_indices_backward",
        max_pool2d_backward,
    ),
    ("aten::avg_pool2d", avg_pool2d),
    ("aten::avg_pool2d_backward", avg_pool2d_backward),
    ("aten::_adaptive_avg_pool2d", adaptive_avg_pool2d),
    (
        "aten::_adaptive_avg_pool2d_backward",
        adaptive_avg_pool2d_backward,
    ),
    ("aten::constant_pad_nd", constant_pad_nd),
    ("aten::reflection_pad1d", |c| edge_pad(c, 1, true)),
    ("aten::reflection_pad2d", |c| edge_pad(c, 2, true)),
    ("aten::reflection_pad3d", |c| edge_pad(c, 3, true)),
    ("aten::reflection_pad1d_backward", |c| {
        edge_pad_backward(c, 1, true)
    }),
    ("aten::reflection_pad2d_backward", |c| {
        edge_pad_backward(c, 2, true)
    }),
    ("aten::reflection_pad3d_backward", |c| {
        edge_pad_backward(c, 3, true)
    }),
    ("aten::replication_pad1d", |c| edge_pad(c, 1, false)),
    ("aten::replication_pad2d", |c| edge_pad(c, 2, false)),
    ("aten::replication_pad3d", |c| edge_pad(c, 3, false)),
    ("aten::replication_pad1d_backward", |c| {
        edge_pad_backward(c, 1, false)
    }),
    ("aten::replication_pad2d_backward", |c| {
        edge_pad_backward(c, 2, false)
    }),
    ("aten::replication_pad3d_backward", |c| {
        edge_pad_backward(c, 3, false)
    }),
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
    ("aten::upsample_nearest2d", |c| upsample2d(c, false)),
    ("aten::upsample_nearest2d_backward", |c| {
        upsample2d_backward(c, false)
    }),
    ("aten::upsample_bilinear2d", |c| upsample2d(c, true)),
    ("aten::upsample_bilinear2d_backward", |c| {
        upsample2d_backward(c, true)
    }),
    ("aten::native_dropout", native_dropout),
    ("aten::native_dropout_backward", native_dropout_backward),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Arg, Args};

    fn t(b: &mut Builder, dtype: DType, shape: &[i64]) -> Arg {
        let value = b.param(TensorType::new(dtype, shape));
        Arg::Tensor(TensorArg {
            value,
            dtype,
            shape: shape.to_vec(),
            wrapped_number: false,
        })
    }

    fn ints(v: &[i64]) -> Arg {
        Arg::List(v.iter().map(|i| Arg::Int(*i)).collect())
    }

    fn shapes(b: &Builder, outs: &[Out]) -> Vec<Option<Vec<i64>>> {
        outs.iter()
            .map(|o| match o {
                Out::T(v) => Some(b.shape(*v)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn pooling_output_sizes() {
        assert_eq!(pool_out(5, 3, 1, 2, 1, false).unwrap(), 3);
        assert_eq!(pool_out(6, 3, 0, 2, 1, false).unwrap(), 2);
        assert_eq!(pool_out(6, 3, 0, 2, 1, true).unwrap(), 3);
        // ceil_mode drops a last window that would start in the right padding.
        assert_eq!(pool_out(5, 2, 1, 2, 1, true).unwrap(), 3);
        assert!(pool_out(5, 3, 2, 1, 1, false).is_err());
        assert_eq!(adaptive_windows(5, 3), vec![(0, 2), (1, 4), (3, 5)]);
        assert_eq!(avg_counts(5, 3, 2, 1, 3, true), vec![3.0, 3.0, 3.0]);
        assert_eq!(avg_counts(5, 3, 2, 1, 3, false), vec![2.0, 3.0, 2.0]);
    }

    #[test]
    fn interpolation_rows_sum_to_one() {
        for ac in [false, true] {
            for row in linear_matrix(5, 9, ac, None) {
                assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-6);
            }
        }
        let m = nearest_matrix(3, 7, None);
        let src: Vec<usize> = m
            .iter()
            .map(|r| r.iter().position(|v| *v == 1.0).unwrap())
            .collect();
        assert_eq!(src, vec![0, 0, 0, 1, 1, 2, 2]);
    }

    #[test]
    fn grouped_strided_conv_backward_shapes() {
        let mut b = Builder::new();
        let items = vec![
            ("grad_output", t(&mut b, DType::F32, &[2, 6, 5, 5])),
            ("input", t(&mut b, DType::F32, &[2, 4, 9, 9])),
            ("weight", t(&mut b, DType::F32, &[6, 2, 3, 3])),
            ("stride", ints(&[2, 2])),
            ("padding", ints(&[1, 1])),
            ("dilation", ints(&[2, 2])),
            ("transposed", Arg::Bool(false)),
            ("output_padding", ints(&[0, 0])),
            ("groups", Arg::Int(2)),
            (
                "output_mask",
                Arg::List(vec![Arg::Bool(true), Arg::Bool(true), Arg::Bool(false)]),
            ),
        ];
        let args = Args {
            items: items.into_iter().map(|(n, a)| (n.to_string(), a)).collect(),
        };
        let mut c = Ctx::new(&mut b, "aten::convolution_backward", "", &args);
        let outs = convolution_backward(&mut c).unwrap();
        assert_eq!(
            shapes(&b, &outs),
            vec![Some(vec![2, 4, 9, 9]), Some(vec![6, 2, 3, 3]), None]
        );
        let text = b.finish(&[]);
        assert!(text.contains("batch_group_count = 2"), "{text}");
    }

    #[test]
    fn nll_loss_reports_size_mismatch() {
        let mut b = Builder::new();
        let items = vec![
            ("self", t(&mut b, DType::F32, &[3, 5])),
            ("target", t(&mut b, DType::I64, &[2])),
            ("weight", Arg::None),
            ("reduction", Arg::Int(1)),
            ("ignore_index", Arg::Int(-100)),
        ];
        let args = Args {
            items: items.into_iter().map(|(n, a)| (n.to_string(), a)).collect(),
        };
        let mut c = Ctx::new(&mut b, "aten::nll_loss_forward", "", &args);
        match nll_loss(&mut c, false) {
            Err(crate::LowerError::User(ErrorKind::Runtime, m)) => {
                assert_eq!(m, "size mismatch (got input: [3, 5], target: [2])")
            }
            _ => panic!("expected an error"),
        }
    }
}
