//! Normalization rules: batch norm (training and inference, with running stats), layer
//! norm, RMS norm, group norm, weight norm, forward and backward. Reduced-precision inputs
//! compute in f32.

use super::nn_common::*;
use super::opmath;
use crate::shape::{numel, reduced_shape, shape_str};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};
use stablehlo::ReduceKind;

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

/// `_native_batch_norm_legit`: its schema marks the running stats as written, so in
/// evaluation mode they are written back unchanged.
fn batch_norm_legit(c: &mut Ctx) -> LResult<Vec<Out>> {
    let outs = batch_norm(c)?;
    for name in ["running_mean", "running_var"] {
        if let Some(t) = c.args.opt_tensor(name) {
            if !c.writes.iter().any(|(n, _)| n == name) {
                let v = t.value;
                c.write_arg(name, v);
            }
        }
    }
    Ok(outs)
}

/// `_batch_norm_with_update`: training-mode batch norm updating the running stats, plus
/// an empty uint8 `reserve` (what the CPU kernel returns).
fn batch_norm_with_update(c: &mut Ctx) -> LResult<Vec<Out>> {
    let mut args = c.args.clone();
    args.items.retain(|(n, _)| n != "training");
    args.items.push(("training".into(), crate::Arg::Bool(true)));
    let mut sub = Ctx::new(&mut *c.b, c.op, c.overload, &args);
    let mut outs = batch_norm(&mut sub)?;
    let writes = std::mem::take(&mut sub.writes);
    for (name, v) in writes {
        c.write_arg(&name, v);
    }
    outs.push(Out::T(c.b.full(DType::U8, &[0], 0.0)));
    Ok(outs)
}

/// The first normalized dim, with PyTorch's checks of `normalized_shape`, weight and bias.
/// `normalized_shape`; in a padded program (shape buckets) the input's trailing dims,
/// padded like it (the call was checked at its exact shapes before).
fn normalized_shape(c: &Ctx, x: &TensorArg) -> LResult<Vec<i64>> {
    let ns = c.args.ints("normalized_shape")?;
    let r = x.shape.len();
    Ok(if c.b.padded() && !ns.is_empty() && ns.len() <= r {
        x.shape[r - ns.len()..].to_vec()
    } else {
        ns
    })
}

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

/// `(x - mean) * rstd` over `dims` (biased variance, two passes), with the kept-dims mean
/// and rstd: the statistics layer and group norm share.
fn normalize(b: &mut Builder, x: Value, dims: &[i64], eps: f64) -> (Value, Value, Value) {
    let shape = b.shape(x);
    let s = super::reduce::sum_keep(b, x, dims);
    let nn = b.count(x, dims, s);
    let mean = b.div(s, nn);
    let mb = b.broadcast_to(mean, &shape);
    let d = b.sub(x, mb);
    let d2 = b.mul(d, d);
    let ss = super::reduce::sum_keep(b, d2, dims);
    let var = b.div(ss, nn);
    let rstd = recip_sqrt(b, var, eps);
    let rb = b.broadcast_to(rstd, &shape);
    (b.mul(d, rb), mean, rstd)
}

/// RMS norm's input, normalized dims, weight and the opmath type (weight and input of one
/// dtype: rms_norm runs its composite otherwise).
fn rms_norm_args(c: &Ctx, op: &str) -> LResult<(TensorArg, Vec<i64>, Option<TensorArg>, DType)> {
    let x = tensor(c, "input")?;
    let ns = normalized_shape(c, &x)?;
    let w = c.args.opt_tensor("weight").cloned();
    float_input(&x, op)?;
    if w.as_ref().is_some_and(|w| w.dtype != x.dtype) {
        return decline(format!("{op}: weight of another dtype"));
    }
    let axis = layer_norm_axis(&x, &ns, w.as_ref(), None)?;
    let dims = (axis as i64..x.shape.len() as i64).collect();
    let cd = opmath(x.dtype);
    Ok((x, dims, w, cd))
}

/// `_fused_rms_norm`, what rms_norm calls: `x * rsqrt(mean(x^2) + eps) [* weight]` over the
/// normalized dims in opmath, rounded once, and the rstd (opmath, reduced dims kept), as
/// PyTorch's composite computes them; eps defaults to the opmath type's epsilon.
fn rms_norm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (x, dims, w, cd) = rms_norm_args(c, "rms_norm")?;
    let eps = c.args.opt_float("eps").unwrap_or(match cd {
        DType::F64 => f64::EPSILON,
        _ => f32::EPSILON as f64,
    });
    let b = &mut *c.b;
    let xv = b.convert(x.value, cd);
    let x2 = b.mul(xv, xv);
    let s = super::reduce::sum_keep(b, x2, &dims);
    let nn = b.count(xv, &dims, s);
    let ms = b.div(s, nn);
    let e = b.splat(ms, eps);
    let ms = b.add(ms, e);
    let rstd = b.rsqrt(ms);
    let rb = b.broadcast_to(rstd, &x.shape);
    let mut y = b.mul(xv, rb);
    if let Some(w) = &w {
        let wv = b.convert(w.value, cd);
        let wb = b.broadcast_to(wv, &x.shape);
        y = b.mul(y, wb);
    }
    Ok(vec![Out::T(b.convert(y, x.dtype)), Out::T(rstd)])
}

/// `g` times the affine weight broadcast to `shape` (a norm's backward through its
/// weight), or `g` when the norm has none.
fn times_weight(
    b: &mut Builder,
    g: Value,
    w: Option<&TensorArg>,
    cd: DType,
    shape: &[i64],
) -> Value {
    match w {
        Some(w) => {
            let wv = b.convert(w.value, cd);
            let wb = b.broadcast_to(wv, shape);
            b.mul(g, wb)
        }
        None => g,
    }
}

/// `_fused_rms_norm_backward`: with `xhat = x * rstd` and `gw = grad * weight`,
/// `dx = rstd * (gw - xhat * mean(gw * xhat))` over the normalized dims and
/// `dweight = sum(grad * xhat)` over the others, in opmath.
fn rms_norm_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (x, dims, w, cd) = rms_norm_args(c, "rms_norm_backward")?;
    let gy = tensor(c, "grad_out")?;
    let rstd = tensor(c, "rstd")?;
    let mask = c.args.bools("output_mask")?;
    let kept = reduced_shape(&x.shape, &dims, true);
    if gy.shape != x.shape || mask.len() != 2 || numel(&rstd.shape) != numel(&kept) {
        return decline("rms_norm_backward: unsupported shapes");
    }
    let batch_dims: Vec<i64> = (0..dims[0]).collect();
    let b = &mut *c.b;
    let xv = b.convert(x.value, cd);
    let g = b.convert(gy.value, cd);
    let rv = b.convert(rstd.value, cd);
    let rv = b.reshape(rv, &kept);
    let rb = b.broadcast_to(rv, &x.shape);
    let xhat = b.mul(xv, rb);
    let dx = if mask[0] {
        let gw = times_weight(b, g, w.as_ref(), cd, &x.shape);
        let gx = b.mul(gw, xhat);
        let s = super::reduce::sum_keep(b, gx, &dims);
        let nn = b.count(xv, &dims, s);
        let m = b.div(s, nn);
        let m = b.broadcast_to(m, &x.shape);
        let p = b.mul(xhat, m);
        let t = b.sub(gw, p);
        let dx = b.mul(t, rb);
        Out::T(b.convert(dx, x.dtype))
    } else {
        Out::None
    };
    let dw = match (&w, mask[1]) {
        (Some(w), true) => {
            let gx = b.mul(g, xhat);
            let dw = b.reduce(gx, &batch_dims, ReduceKind::Sum);
            Out::T(b.convert(dw, w.dtype))
        }
        _ => Out::None,
    };
    Ok(vec![dx, dw])
}

/// Group norm's (N, C, HxW, group) arguments.
fn group_sizes(c: &Ctx) -> LResult<(i64, i64, i64, i64)> {
    let a = &c.args;
    Ok((a.int("N")?, a.int("C")?, a.int("HxW")?, a.int("group")?))
}

/// native_group_norm: statistics per (sample, group) over the group's channels and
/// positions, computed in f32 for half types and rounded once (as the CPU kernel does).
fn group_norm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "input")?;
    let w = c.args.opt_tensor("weight").cloned();
    let bias = c.args.opt_tensor("bias").cloned();
    let (n, ch, hxw, g) = group_sizes(c)?;
    let eps = c.args.float("eps")?;
    float_input(&x, "group_norm")?;
    let per_channel = |p: &Option<TensorArg>| p.as_ref().is_none_or(|p| p.shape == [ch]);
    let ok = g > 0
        && ch % g == 0
        && n * ch * hxw > 0
        && x.shape.len() >= 2
        && x.shape[0] == n
        && x.shape[1] == ch
        && numel(&x.shape) == n * ch * hxw
        && per_channel(&w)
        && per_channel(&bias);
    if !ok {
        // The CPU kernel words these errors (and handles empty inputs).
        return decline("group_norm: unsupported shapes");
    }
    let st = stat_dtype(x.dtype, &[w.as_ref(), bias.as_ref()]);
    let cd = opmath(x.dtype);
    let b = &mut *c.b;
    let xv = b.convert(x.value, cd);
    let xv = b.reshape(xv, &[n, g, (ch / g) * hxw]);
    let (y, mean, rstd) = normalize(b, xv, &[2], eps);
    let mut y = b.reshape(y, &[n, ch, hxw]);
    for (p, add) in [(&w, false), (&bias, true)] {
        if let Some(p) = p {
            let pv = b.convert(p.value, cd);
            let pb = b.broadcast_in_dim(pv, &[n, ch, hxw], &[1]);
            y = if add { b.add(y, pb) } else { b.mul(y, pb) };
        }
    }
    let y = b.reshape(y, &x.shape);
    let stat = |b: &mut Builder, v: Value| {
        let v = b.reshape(v, &[n, g]);
        b.convert(v, st)
    };
    let (mean, rstd) = (stat(b, mean), stat(b, rstd));
    Ok(vec![
        Out::T(b.convert(y, x.dtype)),
        Out::T(mean),
        Out::T(rstd),
    ])
}

fn layer_norm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "input")?;
    let ns = normalized_shape(c, &x)?;
    let w = c.args.opt_tensor("weight").cloned();
    let bias = c.args.opt_tensor("bias").cloned();
    let eps = c.args.float("eps")?;
    float_input(&x, "layer_norm")?;
    let axis = layer_norm_axis(&x, &ns, w.as_ref(), bias.as_ref())?;
    let st = stat_dtype(x.dtype, &[w.as_ref(), bias.as_ref()]);
    let cd = opmath(x.dtype);
    let dims: Vec<i64> = (axis as i64..x.shape.len() as i64).collect();
    let b = &mut *c.b;
    let xv = b.convert(x.value, cd);
    let (mut y, mean, rstd) = normalize(b, xv, &dims, eps);
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
    let ns = normalized_shape(c, &x)?;
    let mean = tensor(c, "mean")?;
    let rstd = tensor(c, "rstd")?;
    let w = c.args.opt_tensor("weight").cloned();
    let bias = c.args.opt_tensor("bias").cloned();
    let mask = c.args.bools("output_mask")?;
    float_input(&x, "layer_norm_backward")?;
    let axis = layer_norm_axis(&x, &ns, w.as_ref(), bias.as_ref())?;
    if gy.shape != x.shape || mask.len() != 3 {
        return decline("layer_norm_backward: unsupported shapes");
    }
    let r = x.shape.len() as i64;
    let norm_dims: Vec<i64> = (axis as i64..r).collect();
    let batch_dims: Vec<i64> = (0..axis as i64).collect();
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
        let gw = times_weight(b, g, w.as_ref(), cd, &x.shape);
        // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) over the normalized dims.
        let s1 = super::reduce::sum_keep(b, gw, &norm_dims);
        let gx = b.mul(gw, xhat);
        let s2 = super::reduce::sum_keep(b, gx, &norm_dims);
        let nn = b.count(xv, &norm_dims, s1);
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
    let (n, ch, hxw, g) = group_sizes(c)?;
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

/// The dims `_weight_norm_interface` reduces over (all but `dim`, which must be the first or
/// the last, as the CPU and CUDA kernels require), and `dim` itself.
fn weight_norm_dims(c: &Ctx, v: &TensorArg, g: &TensorArg) -> LResult<(Vec<i64>, i64)> {
    let r = v.shape.len() as i64;
    let dim = c.args.int_or("dim", 0);
    let dim = if dim < 0 { dim + r } else { dim };
    if r == 0 || !(dim == 0 || dim == r - 1) {
        return decline("_weight_norm_interface: dim other than the first or last");
    }
    let mut want = vec![1; r as usize];
    want[dim as usize] = v.shape[dim as usize];
    if g.shape != want || g.dtype != v.dtype {
        return decline("_weight_norm_interface: g of another shape or dtype");
    }
    Ok(((0..r).filter(|d| *d != dim).collect(), dim))
}

fn weight_norm_interface(c: &mut Ctx) -> LResult<Vec<Out>> {
    let v = tensor(c, "v")?;
    let g = tensor(c, "g")?;
    let (dims, dim) = weight_norm_dims(c, &v, &g)?;
    let norm_dt = if g.dtype == DType::BF16 {
        DType::F32
    } else {
        g.dtype
    };
    let cd = opmath(v.dtype);
    let b = &mut *c.b;
    let vv = b.convert(v.value, cd);
    let sq = b.mul(vv, vv);
    let ss = b.reduce(sq, &dims, ReduceKind::Sum);
    let norm = b.sqrt(ss);
    let norm_b = b.broadcast_in_dim(norm, &v.shape, &[dim]);
    let gv = b.convert(g.value, cd);
    let gv = b.reshape(gv, &[v.shape[dim as usize]]);
    let gb = b.broadcast_in_dim(gv, &v.shape, &[dim]);
    let w = b.mul(vv, gb);
    let w = b.div(w, norm_b);
    let norm = b.reshape(norm, &g.shape);
    Ok(vec![
        Out::T(b.convert(w, v.dtype)),
        Out::T(b.convert(norm, norm_dt)),
    ])
}

/// grad_v = g / |v| * (grad_w - v * <grad_w, v> / |v|^2), grad_g = <grad_w, v> / |v|.
fn weight_norm_interface_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let gw = tensor(c, "grad_w")?;
    let v = tensor(c, "saved_v")?;
    let g = tensor(c, "saved_g")?;
    let n = tensor(c, "saved_norms")?;
    let (dims, dim) = weight_norm_dims(c, &v, &g)?;
    let cd = opmath(v.dtype);
    let d = v.shape[dim as usize];
    let b = &mut *c.b;
    let [gwv, vv, gv, nv] = [gw.value, v.value, g.value, n.value].map(|x| b.convert(x, cd));
    let [gv, nv] = [gv, nv].map(|x| b.reshape(x, &[d]));
    let prod = b.mul(gwv, vv);
    let dot = b.reduce(prod, &dims, ReduceKind::Sum);
    let grad_g = b.div(dot, nv);
    let scale = b.div(gv, nv);
    let n2 = b.mul(nv, nv);
    let coef = b.div(dot, n2);
    let [coef, scale] = [coef, scale].map(|x| b.broadcast_in_dim(x, &v.shape, &[dim]));
    let proj = b.mul(vv, coef);
    let diff = b.sub(gwv, proj);
    let grad_v = b.mul(diff, scale);
    let grad_g = b.reshape(grad_g, &g.shape);
    Ok(vec![
        Out::T(b.convert(grad_v, v.dtype)),
        Out::T(b.convert(grad_g, g.dtype)),
    ])
}

/// The ops of this family whose programs may serve a range of sizes (see
/// `super::serves_sizes`): their means divide by `Builder::count`, the real sizes.
pub const SERVES_SIZES: &[&str] = &[
    "aten::native_layer_norm",
    "aten::native_layer_norm_backward",
    "aten::_fused_rms_norm",
    "aten::_fused_rms_norm_backward",
];

pub const RULES: &[(&str, Rule)] = &[
    ("aten::native_batch_norm", batch_norm),
    ("aten::_native_batch_norm_legit", batch_norm_legit),
    ("aten::_batch_norm_with_update", batch_norm_with_update),
    ("aten::_native_batch_norm_legit_no_training", batch_norm),
    ("aten::native_batch_norm_backward", batch_norm_backward),
    ("aten::batch_norm_backward", batch_norm_backward),
    ("aten::native_layer_norm", layer_norm),
    ("aten::native_layer_norm_backward", layer_norm_backward),
    ("aten::_fused_rms_norm", rms_norm),
    ("aten::_fused_rms_norm_backward", rms_norm_backward),
    ("aten::native_group_norm", group_norm),
    ("aten::native_group_norm_backward", group_norm_backward),
    ("aten::_weight_norm_interface", weight_norm_interface),
    (
        "aten::_weight_norm_interface_backward",
        weight_norm_interface_backward,
    ),
];
