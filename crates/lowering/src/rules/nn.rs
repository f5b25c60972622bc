//! nn rules: normalization, losses, convolution, pooling, sliding windows (im2col),
//! dropout, padding, upsampling, grid sampling and the activations of torch.nn, forward
//! and backward.
//!
//! Reduced-precision floats (f16/bf16) compute in f32 and round once at the end, as
//! PyTorch's CPU kernels do with their opmath type; where a CPU kernel computes in the
//! narrow type itself (upsampling weights, grid sampling), the rule rounds the same way.

use super::{opmath, promote, take_flat};
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

/// The nonzero entries of each row of `m` ([out][in]) as (k, indices, weights), `k` per
/// row; short rows are padded with index 0 and weight 0.
fn sparse_rows(m: &[Vec<f64>]) -> (usize, Vec<i64>, Vec<f64>) {
    let k = m
        .iter()
        .map(|row| row.iter().filter(|w| **w != 0.0).count())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut idx = Vec::with_capacity(m.len() * k);
    let mut wts = Vec::with_capacity(m.len() * k);
    for row in m {
        let before = idx.len();
        for (i, w) in row.iter().enumerate().filter(|(_, w)| **w != 0.0) {
            idx.push(i as i64);
            wts.push(*w);
        }
        for _ in idx.len() - before..k {
            idx.push(0);
            wts.push(0.0);
        }
    }
    (k, idx, wts)
}

/// `x` gathered along `dim` at `idx`, read as rows of `k` indices: `dim` becomes the two
/// dims (rows, k).
fn take_rows(b: &mut Builder, x: Value, dim: usize, idx: &[i64], k: usize) -> Value {
    let xs = b.shape(x);
    let m = idx.len() as i64;
    let iv = b.constant_vec_i64(idx);
    let iv = b.reshape(iv, &[m, 1]);
    let offset: Vec<i64> = (0..xs.len() as i64).filter(|d| *d != dim as i64).collect();
    let mut sizes = xs.clone();
    sizes[dim] = 1;
    let g = b.gather(x, iv, &offset, &[dim as i64], &[dim as i64], 1, &sizes);
    let mut shape = xs;
    shape[dim] = m / k as i64;
    shape.insert(dim + 1, k as i64);
    b.reshape(g, &shape)
}

/// The adjoint of `take_rows`: sums `g`, whose dims `dim`, `dim + 1` are (rows, k), into
/// `n` slots along `dim` at `idx`.
fn put_rows(b: &mut Builder, g: Value, dim: usize, idx: &[i64], n: i64) -> Value {
    let mut gs = b.shape(g);
    let m = idx.len() as i64;
    gs.remove(dim + 1);
    gs[dim] = m;
    let g = b.reshape(g, &gs);
    let iv = b.constant_vec_i64(idx);
    let iv = b.reshape(iv, &[m, 1]);
    let mut shape = gs.clone();
    shape[dim] = n;
    let zero = b.full(b.dtype(g), &shape, 0.0);
    let win: Vec<i64> = (0..gs.len() as i64).filter(|d| *d != dim as i64).collect();
    let d = [dim as i64];
    b.scatter(zero, iv, g, &win, &d, &d, 1, |b, a, u| b.add(a, u))
}

/// `result[.., o, ..] = sum_i m[o][i] * x[.., i, ..]` along `dim`, gathering only each
/// row's nonzero entries. Zero weights are skipped (selected away), so an inf or NaN
/// outside a window does not leak into it.
fn mix(b: &mut Builder, x: Value, dim: usize, m: &[Vec<f64>]) -> Value {
    let xs = b.shape(x);
    let out = m.len() as i64;
    let dt = b.dtype(x);
    if out == 0 || numel(&xs) == 0 {
        let mut shape = xs.clone();
        shape[dim] = out;
        return b.full(dt, &shape, 0.0);
    }
    let (k, idx, wts) = sparse_rows(m);
    let g = take_rows(b, x, dim, &idx, k);
    let gs = b.shape(g);
    let w = const_vec(b, dt, &wts);
    let w = b.reshape(w, &[out, k as i64]);
    let wb = b.broadcast_in_dim(w, &gs, &[dim as i64, dim as i64 + 1]);
    let z = b.splat(wb, 0.0);
    let nz = b.compare(wb, z, CmpDir::Ne);
    let p = b.mul(g, wb);
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

/// `(x - mean) * rstd` over `dims` (biased variance, two passes), with the kept-dims mean
/// and rstd: the statistics layer and group norm share.
fn normalize(b: &mut Builder, x: Value, dims: &[i64], eps: f64) -> (Value, Value, Value) {
    let shape = b.shape(x);
    let n: i64 = dims.iter().map(|d| shape[*d as usize]).product();
    let s = super::reduce::sum_keep(b, x, dims);
    let nn = b.splat(s, n as f64);
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
    let ns = c.args.ints("normalized_shape")?;
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
    let ns = c.args.ints("normalized_shape")?;
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

// ---------------------------------------------------------------------------------------
// Losses
// ---------------------------------------------------------------------------------------

/// The `reduction` argument: 0 none, 1 mean, 2 sum.
pub(crate) fn reduction(c: &Ctx) -> LResult<i64> {
    let r = c.args.int_or("reduction", 1);
    if !(0..=2).contains(&r) {
        return decline(format!("unknown reduction {r}"));
    }
    Ok(r)
}

pub(crate) fn reduce_loss(b: &mut Builder, x: Value, r: i64) -> Value {
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
pub(crate) fn loss_grad(b: &mut Builder, g: Value, shape: &[i64], r: i64) -> Value {
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
    // Targets outside [0, classes) other than ignore_index raise, as on the CPU.
    let ti = b.convert(t.value, DType::I64);
    let ii = b.splat(ti, ignore as f64);
    let ignored = b.compare(ti, ii, CmpDir::Eq);
    let zero = b.splat(ti, 0.0);
    let checked = b.select(ignored, zero, ti);
    let classes = x.shape[cd];
    c.check_range(
        checked,
        0,
        classes,
        ErrorKind::Index,
        "Target {index} is out of bounds.".into(),
    );
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
    // The CPU convolves int64 too (exactly, wrapping on overflow, as XLA's s64 does).
    if x.dtype != DType::I64 {
        float_input(x, "convolution")?;
    }
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
    // Half types convolve and add the bias in f32, rounding once.
    let cd = opmath(x.dtype);
    let (xv, wv) = (b.convert(x.value, cd), b.convert(w.value, cd));
    let y = if p.transposed {
        let out_sp: Vec<i64> = (0..n)
            .map(|i| {
                (x.shape[2 + i] - 1) * p.stride[i] - 2 * p.pad[i]
                    + p.dil[i] * (w.shape[2 + i] - 1)
                    + p.out_pad[i]
                    + 1
            })
            .collect();
        conv_input_grad(b, xv, wv, &p, &out_sp)
    } else {
        conv_fwd(b, xv, wv, &p)
    };
    let y = match bias {
        Some(bias) => {
            let bv = b.convert(bias.value, cd);
            let shape = b.shape(y);
            let bb = per_channel(b, bv, &shape);
            b.add(y, bb)
        }
        None => y,
    };
    Ok(vec![Out::T(b.convert(y, x.dtype))])
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
        // With output padding, a transposed convolution's gradient can have windows past
        // the input's end; no input element receives them.
        let gs = b.shape(gi);
        let gi = if p.transposed
            && gs.len() == x.shape.len()
            && gs.iter().zip(&x.shape).all(|(g, s)| g >= s)
        {
            let r = x.shape.len();
            b.slice(gi, &vec![0; r], &x.shape, &vec![1; r])
        } else {
            gi
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
// Attention (the CPU flash-attention entry points)
// ---------------------------------------------------------------------------------------

const SDPA: &str = "scaled_dot_product_attention_flash_attention";

/// Attention arguments: [B, H, L, E] query, [B, H / rep, S, E] key and value.
struct Sdpa {
    q: TensorArg,
    k: TensorArg,
    v: TensorArg,
    mask: Option<TensorArg>,
    causal: bool,
    scale: f64,
    rep: i64,
}

fn sdpa_args(c: &Ctx) -> LResult<Sdpa> {
    let q = tensor(c, "query")?;
    let k = tensor(c, "key")?;
    let v = tensor(c, "value")?;
    let mask = c.args.opt_tensor("attn_mask").cloned();
    let err = |m: String| user_err(ErrorKind::Runtime, format!("{SDPA}: {m}"));
    if !q.dtype.is_float() {
        return err(format!(
            "Expected data type in FP32, FP64, BF16, FP16, but got {} instead.",
            torch_name(q.dtype)
        ));
    }
    if [&q, &k, &v].iter().any(|t| t.shape.len() != 4) {
        return err("Accept only 4 dims inputs shape of {B, H, T, K}".into());
    }
    if c.args.float("dropout_p").unwrap_or(0.0) > 0.0 {
        return err("Currently do not support dropout > 0".into());
    }
    if k.shape[3] != q.shape[3] || v.shape[3] != q.shape[3] {
        return err("Q/K/V should have the same head size".into());
    }
    if let Some(m) = &mask {
        if m.dtype != q.dtype {
            return err("Attention mask is the same data type as query".into());
        }
        if m.shape.len() != 2 && m.shape.len() != 4 {
            return err("Attention mask dim in {2, 4}".into());
        }
        let full = [q.shape[0], q.shape[1], q.shape[2], k.shape[2]];
        let off = 4 - m.shape.len();
        if m.shape
            .iter()
            .enumerate()
            .any(|(i, d)| *d != 1 && *d != full[off + i])
        {
            return decline("attention mask does not broadcast");
        }
    }
    for t in [&k, &v] {
        if t.dtype != q.dtype {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "expected scalar type {} but found {}",
                    torch_name(q.dtype),
                    torch_name(t.dtype)
                ),
            );
        }
    }
    let (qs, ks, vs) = (&q.shape, &k.shape, &v.shape);
    if ks[0] != qs[0]
        || vs[0] != qs[0]
        || ks[1] != vs[1]
        || ks[2] != vs[2]
        || ks[1] == 0
        || qs[1] % ks[1] != 0
        || [qs, ks].iter().any(|s| numel(s) == 0)
    {
        // The CPU kernel reads out of bounds for mismatched batch or head counts.
        return decline("attention: batch, head or length mismatch, or empty input");
    }
    let scale = c
        .args
        .opt_float("scale")
        .unwrap_or(1.0 / (qs[3] as f64).sqrt());
    Ok(Sdpa {
        rep: qs[1] / ks[1],
        causal: c.args.bool_or("is_causal", false),
        q,
        k,
        v,
        mask,
        scale,
    })
}

/// Key/value heads repeated for the query heads they serve (h -> h / rep).
fn sdpa_heads(b: &mut Builder, x: Value, rep: i64) -> Value {
    if rep == 1 {
        return x;
    }
    let s = b.shape(x);
    let big = [s[0], s[1], rep, s[2], s[3]];
    let x = b.broadcast_in_dim(x, &big, &[0, 1, 3, 4]);
    b.reshape(x, &[s[0], s[1] * rep, s[2], s[3]])
}

/// Gradients of repeated heads summed back onto their key/value head.
fn sdpa_unheads(b: &mut Builder, g: Value, rep: i64) -> Value {
    if rep == 1 {
        return g;
    }
    let s = b.shape(g);
    let g = b.reshape(g, &[s[0], s[1] / rep, rep, s[2], s[3]]);
    b.reduce(g, &[2], ReduceKind::Sum)
}

/// Rounds to the input dtype and back, where the CPU kernel feeds a half-precision gemm.
fn sdpa_round(b: &mut Builder, x: Value, dt: DType) -> Value {
    if opmath(dt) == dt {
        return x;
    }
    let r = b.convert(x, dt);
    b.convert(r, opmath(dt))
}

/// (scaled, masked scores [B, H, L, S], query, expanded key, expanded value), in opmath.
fn sdpa_scores(b: &mut Builder, a: &Sdpa) -> (Value, Value, Value, Value) {
    let cd = opmath(a.q.dtype);
    let q = b.convert(a.q.value, cd);
    let k = b.convert(a.k.value, cd);
    let v = b.convert(a.v.value, cd);
    let k = sdpa_heads(b, k, a.rep);
    let v = sdpa_heads(b, v, a.rep);
    let s = b.dot_general(q, k, (&[0, 1], &[0, 1]), (&[3], &[3]), cd);
    let sc = b.splat(s, a.scale);
    let mut s = b.mul(s, sc);
    let shape = b.shape(s);
    if let Some(m) = &a.mask {
        let mv = b.convert(m.value, cd);
        let mv = b.broadcast_to(mv, &shape);
        s = b.add(s, mv);
    }
    if a.causal {
        let i = b.iota(DType::I64, &shape, 2);
        let j = b.iota(DType::I64, &shape, 3);
        let keep = b.compare(i, j, CmpDir::Ge);
        let ninf = b.splat(s, f64::NEG_INFINITY);
        s = b.select(keep, s, ninf);
    }
    (s, q, k, v)
}

/// `_scaled_dot_product_flash_attention_for_cpu`: (output, logsumexp). Rows masked out
/// entirely give zeros and a logsumexp of 0, as the CPU kernel returns.
fn sdpa_flash(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = sdpa_args(c)?;
    let b = &mut *c.b;
    let dt = a.q.dtype;
    let (s, _, _, v) = sdpa_scores(b, &a);
    let shape = b.shape(s);
    let m = b.reduce(s, &[3], ReduceKind::Max);
    let ninf = b.splat(m, f64::NEG_INFINITY);
    let empty = b.compare(m, ninf, CmpDir::Eq);
    let z = b.splat(m, 0.0);
    let m = b.select(empty, z, m);
    let mb = b.broadcast_in_dim(m, &shape, &[0, 1, 2]);
    let d = b.sub(s, mb);
    let p = b.exp(d);
    let l = b.reduce(p, &[3], ReduceKind::Sum);
    let pr = sdpa_round(b, p, dt);
    let o = b.dot_general(pr, v, (&[0, 1], &[0, 1]), (&[3], &[2]), opmath(dt));
    let oshape = b.shape(o);
    let one = b.splat(l, 1.0);
    let lsafe = b.select(empty, one, l);
    let lb = b.broadcast_in_dim(lsafe, &oshape, &[0, 1, 2]);
    let o = b.div(o, lb);
    let eb = b.broadcast_in_dim(empty, &oshape, &[0, 1, 2]);
    let zo = b.splat(o, 0.0);
    let o = b.select(eb, zo, o);
    let ll = b.log(lsafe);
    let lse = b.add(m, ll);
    let lse = b.select(empty, z, lse);
    Ok(vec![Out::T(b.convert(o, dt)), Out::T(lse)])
}

/// `_scaled_dot_product_flash_attention_for_cpu_backward`: (grad_query, grad_key,
/// grad_value) from the probabilities rebuilt with the saved logsumexp.
fn sdpa_flash_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = sdpa_args(c)?;
    let go = tensor(c, "grad_out")?;
    let out = tensor(c, "out")?;
    let lse = tensor(c, "logsumexp")?;
    let b = &mut *c.b;
    let dt = a.q.dtype;
    let cd = opmath(dt);
    let (s, q, k, v) = sdpa_scores(b, &a);
    let shape = b.shape(s);
    let (bq, hq, lq) = (shape[0], shape[1], shape[2]);
    if go.shape != a.q.shape || out.shape != a.q.shape || lse.shape != [bq, hq, lq] {
        return decline("attention backward: grad_out, out or logsumexp shape");
    }
    let lv = b.convert(lse.value, cd);
    let lb = b.broadcast_in_dim(lv, &shape, &[0, 1, 2]);
    let d = b.sub(s, lb);
    let p = b.exp(d);
    let pr = sdpa_round(b, p, dt);
    let g = b.convert(go.value, cd);
    let o = b.convert(out.value, cd);
    let dv = b.dot_general(pr, g, (&[0, 1], &[0, 1]), (&[2], &[2]), cd);
    let dp = b.dot_general(g, v, (&[0, 1], &[0, 1]), (&[3], &[3]), cd);
    let go_o = b.mul(g, o);
    let dsum = b.reduce(go_o, &[3], ReduceKind::Sum);
    let db = b.broadcast_in_dim(dsum, &shape, &[0, 1, 2]);
    let ds = b.sub(dp, db);
    let ds = b.mul(p, ds);
    let dsr = sdpa_round(b, ds, dt);
    let dq = b.dot_general(dsr, k, (&[0, 1], &[0, 1]), (&[3], &[2]), cd);
    let dk = b.dot_general(dsr, q, (&[0, 1], &[0, 1]), (&[2], &[2]), cd);
    let sc = b.splat(dq, a.scale);
    let dq = b.mul(dq, sc);
    let sk = b.splat(dk, a.scale);
    let dk = b.mul(dk, sk);
    let dk = sdpa_unheads(b, dk, a.rep);
    let dv = sdpa_unheads(b, dv, a.rep);
    Ok(vec![
        Out::T(b.convert(dq, dt)),
        Out::T(b.convert(dk, dt)),
        Out::T(b.convert(dv, dt)),
    ])
}

// ---------------------------------------------------------------------------------------
// Pooling
// ---------------------------------------------------------------------------------------

/// Pooling parameters of the last `k.len()` dims.
struct Pool {
    k: Vec<i64>,
    s: Vec<i64>,
    p: Vec<i64>,
    d: Vec<i64>,
    out: Vec<i64>,
}

/// `shape` with its last `sp.len()` dims replaced by `sp`.
fn with_spatial(shape: &[i64], sp: &[i64]) -> Vec<i64> {
    let mut s = shape.to_vec();
    let r = s.len();
    s[r - sp.len()..].copy_from_slice(sp);
    s
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

/// A pooling parameter given as one int or one per pooled dim (`None` otherwise).
fn per_dim(v: &[i64], n: usize) -> Option<Vec<i64>> {
    match v.len() {
        1 => Some(vec![v[0]; n]),
        l if l == n => Some(v.to_vec()),
        _ => None,
    }
}

/// PyTorch's listing of a per-dim parameter, "kT: 1 kH: 2 kW: 3" (T, H, W name the last
/// dims).
fn dim_list(prefix: &str, v: &[i64]) -> String {
    let names = ["T", "H", "W"];
    let names = &names[3 - v.len().min(3)..];
    let items: Vec<String> = v
        .iter()
        .zip(names)
        .map(|(x, l)| format!("{prefix}{l}: {x}"))
        .collect();
    items.join(" ")
}

/// Fails like PyTorch when a dim of `shape` from `from` on is empty.
fn check_nonempty(fname: &str, shape: &[i64], from: usize) -> LResult<()> {
    match (from..shape.len()).find(|i| shape[*i] == 0) {
        Some(i) => user_err(
            ErrorKind::Runtime,
            format!(
                "{fname}(): Expected input to have non-zero size for non-batch dimensions, but input has sizes {} with dimension {i} being empty",
                shape_str(shape)
            ),
        ),
        None => Ok(()),
    }
}

/// Reads and checks max_pool{2,3}d / avg_pool{2,3}d parameters for input `x` with `n`
/// pooled dims, in PyTorch's order and words.
fn pool_args(c: &Ctx, name: &str, x: &TensorArg, with_dilation: bool, n: usize) -> LResult<Pool> {
    let err = |m: String| user_err::<Pool>(ErrorKind::Runtime, m);
    let count = if n == 2 { "two" } else { "three" };
    // avg_pool3d words its argument errors without "either".
    let either = if name == "avg_pool3d" { "" } else { "either " };
    let Some(k) = per_dim(&c.args.ints("kernel_size")?, n) else {
        return err(format!(
            "{name}: kernel_size must {either}be a single int, or a tuple of {count} ints"
        ));
    };
    let sv = c.args.ints("stride").unwrap_or_default();
    let s = if sv.is_empty() {
        Some(k.clone())
    } else {
        per_dim(&sv, n)
    };
    let Some(s) = s else {
        return err(format!(
            "{name}: stride must {either}be omitted, a single int, or a tuple of {count} ints"
        ));
    };
    let Some(p) = per_dim(&c.args.ints("padding")?, n) else {
        return err(format!(
            "{name}: padding must {either}be a single int, or a tuple of {count} ints"
        ));
    };
    let d = if with_dilation {
        per_dim(&c.args.ints("dilation")?, n)
    } else {
        Some(vec![1; n])
    };
    let Some(d) = d else {
        return err(format!(
            "{name}: dilation must be either a single int, or a tuple of {count} ints"
        ));
    };
    if c.args.opt_int("divisor_override") == Some(0) {
        return err("divisor must be not zero".into());
    }
    let r = x.shape.len();
    if r != n + 1 && r != n + 2 {
        if with_dilation || n == 3 {
            return err(format!(
                "non-empty {}D or {}D (batch mode) tensor expected for input",
                n + 1,
                n + 2
            ));
        }
        return decline(format!("{name}: input of rank {r}"));
    }
    // avg_pool3d checks for empty dims before the padding, max_pool3d after.
    let nonempty = |name| check_nonempty(name, &x.shape, r - n - 1);
    if n == 3 && !with_dilation {
        nonempty("avg_pool3d")?;
    }
    let ceil = c.args.bool_or("ceil_mode", false);
    let sp = &x.shape[r - n..];
    let out = (0..n)
        .map(|i| pool_out(sp[i], k[i], p[i], s[i], d[i], ceil))
        .collect::<LResult<Vec<i64>>>()?;
    if n == 3 && with_dilation {
        nonempty("max_pool3d_with_indices_out_cpu_template")?;
    }
    if k.iter().any(|v| *v <= 0) {
        return err(format!(
            "kernel size should be greater than zero, but got {}",
            dim_list("k", &k)
        ));
    }
    if s.iter().any(|v| *v <= 0) {
        return err(format!(
            "stride should be greater than zero, but got {}",
            dim_list("d", &s)
        ));
    }
    if d.iter().any(|v| *v <= 0) {
        return err(format!(
            "dilation should be greater than zero, but got {}",
            dim_list("dilation", &d)
        ));
    }
    if n == 2 && x.shape[r - 3..].contains(&0) {
        return decline(format!("{name}: empty non-batch dims"));
    }
    if n == 3 && !with_dilation && (0..n).any(|i| sp[i] < k[i]) {
        return err(format!(
            "input image ({}) smaller than kernel size ({})",
            dim_list("", sp),
            dim_list("k", &k)
        ));
    }
    if (0..n).any(|i| k[i] / 2 < p[i]) {
        return err(if n == 2 {
            format!(
                "pad should be smaller than or equal to half of kernel size, but got padW = {}, padH = {}, kW = {}, kH = {}",
                p[1], p[0], k[1], k[0]
            )
        } else {
            format!(
                "pad should be smaller than or equal to half of kernel size, but got kT: {} kW: {} kH: {} padT: {} padW: {} padH: {}",
                k[0], k[2], k[1], p[0], p[2], p[1]
            )
        });
    }
    if out.iter().any(|o| *o < 1) {
        let ch = x.shape[r - n - 1];
        let join = |v: &[i64]| {
            let s: Vec<String> = v.iter().map(|x| x.to_string()).collect();
            s.join("x")
        };
        return err(format!(
            "Given input size: ({ch}x{}). Calculated output size: ({ch}x{}). Output size is too small",
            join(sp),
            join(&out)
        ));
    }
    Ok(Pool { k, s, p, d, out })
}

/// Window, stride, dilation and padding over all dims of a rank-`r` input (the leading
/// dims untouched); the high padding covers ceil_mode's partial last window.
#[allow(clippy::type_complexity)]
fn pool_window(pl: &Pool, shape: &[i64]) -> (Vec<i64>, Vec<i64>, Vec<i64>, Vec<(i64, i64)>) {
    let r = shape.len();
    let n = pl.k.len();
    let mut win = vec![1; r];
    let mut st = vec![1; r];
    let mut dil = vec![1; r];
    let mut pad = vec![(0, 0); r];
    for i in 0..n {
        let j = r - n + i;
        win[j] = pl.k[i];
        st[j] = pl.s[i];
        dil[j] = pl.d[i];
        let need = (pl.out[i] - 1) * pl.s[i] + (pl.k[i] - 1) * pl.d[i] + 1;
        let extra = (need - (shape[j] + 2 * pl.p[i])).max(0);
        pad[j] = (pl.p[i], pl.p[i] + extra);
    }
    (win, st, dil, pad)
}

/// The flat index of every element within its trailing `n`-dim volume, shaped `shape`.
fn flat_index(b: &mut Builder, shape: &[i64], n: usize) -> Value {
    let r = shape.len();
    let sp = &shape[r - n..];
    let mut idx = b.iota(DType::I64, sp, n - 1);
    let mut stride = sp[n - 1];
    for j in (0..n - 1).rev() {
        let io = b.iota(DType::I64, sp, j);
        let k = b.splat(io, stride as f64);
        let t = b.mul(io, k);
        idx = b.add(idx, t);
        stride *= sp[j];
    }
    let dims: Vec<i64> = (r - n..r).map(|d| d as i64).collect();
    b.broadcast_in_dim(idx, shape, &dims)
}

/// Of two (value, index) pairs, the one a max pooling keeps: the larger value, the first
/// index on ties; NaN wins, and among NaNs the last one, as PyTorch's scan does.
fn argmax_pick(b: &mut Builder, a: &[Value]) -> Vec<Value> {
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
}

/// Zeros of `shape` as the outputs of an op whose result has no elements.
fn empty_outs(b: &mut Builder, dtypes: &[DType], shape: &[i64]) -> Vec<Out> {
    dtypes
        .iter()
        .map(|d| Out::T(b.full(*d, shape, 0.0)))
        .collect()
}

/// max_pool{2,3}d_with_indices: the max of each window and its flat index in the pooled
/// volume.
fn max_pool(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let name = if n == 2 { "max_pool2d" } else { "max_pool3d" };
    let pl = pool_args(c, name, &x, true, n)?;
    if x.dtype == DType::Bool {
        return decline(format!("{name}: bool input"));
    }
    let want = with_spatial(&x.shape, &pl.out);
    let b = &mut *c.b;
    if numel(&x.shape) == 0 {
        return Ok(empty_outs(b, &[x.dtype, DType::I64], &want));
    }
    let idx = flat_index(b, &x.shape, n);
    let (win, st, dil, pad) = pool_window(&pl, &x.shape);
    let vinit = b.constant(x.dtype, ReduceKind::Max.init(x.dtype));
    let iinit = b.constant_i64(DType::I64, i64::MAX);
    let res = b.reduce_window_with(
        &[x.value, idx],
        &[vinit, iinit],
        &win,
        &st,
        &dil,
        &pad,
        argmax_pick,
    );
    if b.shape(res[0]) != want {
        return decline(format!("{name}: window arithmetic mismatch"));
    }
    Ok(vec![Out::T(res[0]), Out::T(res[1])])
}

/// The input gradient of a max-style pooling: each `gy` element added into the element of
/// its plane that `ind` (a flat index in the last `n` dims of `x`) names.
fn index_grad(b: &mut Builder, gy: &TensorArg, ind: &TensorArg, x: &TensorArg, n: usize) -> Value {
    let r = x.shape.len();
    let planes = numel(&x.shape[..r - n]);
    let vol = numel(&x.shape[r - n..]);
    let l = numel(&gy.shape[r - n..]);
    let m = planes * l;
    let cd = opmath(x.dtype);
    let zero = b.full(cd, &[planes, vol], 0.0);
    let idx = b.convert(ind.value, DType::I64);
    let idx = b.reshape(idx, &[m, 1]);
    let plane = b.iota(DType::I64, &[planes, l], 0);
    let plane = b.reshape(plane, &[m, 1]);
    let both = b.concatenate(&[plane, idx], 1);
    let g = b.convert(gy.value, cd);
    let g = b.reshape(g, &[m]);
    let gi = b.scatter(zero, both, g, &[], &[0, 1], &[0, 1], 1, |b, a, u| {
        b.add(a, u)
    });
    let gi = b.reshape(gi, &x.shape);
    b.convert(gi, x.dtype)
}

/// max_pool{2,3}d_with_indices_backward.
fn max_pool_backward(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let ind = tensor(c, "indices")?;
    let name = if n == 2 { "max_pool2d" } else { "max_pool3d" };
    let pl = pool_args(c, name, &x, true, n)?;
    float_input(&x, "max_pool_backward")?;
    let want = with_spatial(&x.shape, &pl.out);
    if gy.shape != want || ind.shape != want {
        return decline("max_pool_backward: grad_output/indices shape");
    }
    if numel(&x.shape) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &x.shape));
    }
    Ok(vec![Out::T(index_grad(c.b, &gy, &ind, &x, n))])
}

/// fractional_max_pool{2,3}d's checks, in PyTorch's order and words; returns the output
/// shape.
fn fractional_args(
    x: &TensorArg,
    u: &TensorArg,
    k: &[i64],
    out: &[i64],
    n: usize,
) -> LResult<Vec<i64>> {
    let err = |m: String| user_err::<Vec<i64>>(ErrorKind::Runtime, m);
    // The 3-d kernel's messages name its out= template.
    let (name, fname) = if n == 2 {
        ("fractional_max_pool2d()", "fractional_max_pool2d()")
    } else {
        ("fractional_max_pool3d()", "fractional_max_pool3d_out()")
    };
    if k.len() != n || out.len() != n || out.iter().any(|o| *o < 0) {
        return decline(format!("{name}: kernel_size/output_size"));
    }
    if k.iter().any(|v| *v <= 0) {
        let ks: Vec<String> = k.iter().map(|v| v.to_string()).collect();
        return err(format!(
            "{name}: kernel size should be greater than zero, but got {}",
            ks.join("x")
        ));
    }
    let r = x.shape.len();
    if r != n + 1 && r != n + 2 {
        return err(format!(
            "{fname}: Expected {}D or {}D tensor, but got: {}",
            n + 1,
            n + 2,
            shape_str(&x.shape)
        ));
    }
    if let Some(d) = (r - n - 1..r).find(|d| x.shape[*d] == 0) {
        return err(format!(
            "{fname}: Expected input to have non-zero size for non-batch dimensions, but got{} with dimension {d} being empty.",
            shape_str(&x.shape)
        ));
    }
    let sp = &x.shape[r - n..];
    // 2-d allows a last window ending at the edge, 3-d does not; 3-d checks W before H.
    let order: &[(usize, &str)] = if n == 2 {
        &[(0, "height"), (1, "width")]
    } else {
        &[(0, "time"), (2, "width"), (1, "height")]
    };
    for (i, what) in order {
        let end = out[*i] + k[*i] - 1;
        if (n == 2 && end > sp[*i]) || (n == 3 && end >= sp[*i]) {
            return err(format!(
                "{fname}: pool {what} {} too large relative to input {what} {}",
                k[*i], sp[*i]
            ));
        }
    }
    let batch = if r == n + 2 { x.shape[0] } else { 1 };
    let planes = x.shape[r - n - 1];
    if u.dtype != x.dtype {
        return err("Expect _random_samples to have the same dtype as input".into());
    }
    if u.shape.len() != 3 {
        return err(format!(
            "Expect _random_samples to have 3 dimensions, got {}",
            u.shape.len()
        ));
    }
    if u.shape[0] < batch {
        return err("Expect _random_samples.size(0) no less then input batch size.".into());
    }
    if u.shape[1] != planes {
        return err("Expect _random_samples.size(1) equals to input channel size.".into());
    }
    if u.shape[2] != n as i64 {
        return err(format!(
            "Expect _random_samples.size(2) equals to {n}; got {}.",
            u.shape[2]
        ));
    }
    Ok(with_spatial(&x.shape, out))
}

/// The first input index of each of a plane's `out` windows along one dim, from the
/// plane's sample `u` (shape [planes]): PyTorch's pseudo-random interval sequence,
/// computed in the input's dtype as its CPU kernel does. An i64 value of [planes, out].
fn fractional_starts(b: &mut Builder, u: Value, inp: i64, k: i64, out: i64) -> Value {
    let dt = b.dtype(u);
    let planes = b.shape(u)[0];
    let last = b.full(DType::I64, &[planes, 1], (inp - k) as f64);
    if out == 1 {
        return last;
    }
    // alpha = (inp - k) / (out - 1) in the dtype: f32 division rounded once for halves.
    let alpha = if dt == DType::F64 {
        b.constant(dt, (inp - k) as f64 / (out - 1) as f64)
    } else {
        let a = b.constant(DType::F32, ((inp - k) as f32 / (out - 1) as f32) as f64);
        b.convert(a, dt)
    };
    let shape = [planes, out - 1];
    let i = b.iota(dt, &shape, 1);
    let ub = b.broadcast_in_dim(u, &shape, &[0]);
    let a = b.broadcast_to(alpha, &shape);
    let t = b.add(i, ub);
    let t = b.mul(t, a);
    let t = b.convert(t, DType::I64);
    let a0 = b.broadcast_to(alpha, &[planes]);
    let t0 = b.mul(u, a0);
    let t0 = b.convert(t0, DType::I64);
    let t0 = b.broadcast_in_dim(t0, &shape, &[0]);
    let seq = b.sub(t, t0);
    b.concatenate(&[seq, last], 1)
}

/// fractional_max_pool{2,3}d: the max over windows of `kernel_size` whose starts follow a
/// per-plane pseudo-random sequence drawn from `random_samples`, and its flat index in the
/// plane. Windows are scanned in order; a larger value or a NaN replaces the max.
fn fractional_max_pool(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let u = tensor(c, "random_samples")?;
    let k = c.args.ints("kernel_size")?;
    let out = c.args.ints("output_size")?;
    let want = fractional_args(&x, &u, &k, &out, n)?;
    float_input(&x, "fractional_max_pool")?;
    if numel(&want) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype, DType::I64], &want));
    }
    let r = x.shape.len();
    let sp = x.shape[r - n..].to_vec();
    let planes = numel(&x.shape[..r - n]);
    let vol = numel(&sp);
    // The samples of the planes present: [planes, n].
    let batch = planes / x.shape[r - n - 1];
    let us = c.b.slice_dim(u.value, 0, 0, batch, 1);
    let us = c.b.reshape(us, &[planes, n as i64]);
    // Sample column per pooled dim: 2-d draws W from column 0 and H from 1; 3-d T, H, W.
    let cols: Vec<i64> = if n == 2 { vec![1, 0] } else { vec![0, 1, 2] };
    let mut starts = Vec::new();
    for j in 0..n {
        let col = c.b.slice_dim(us, 1, cols[j], cols[j] + 1, 1);
        let col = c.b.reshape(col, &[planes]);
        let st = fractional_starts(c.b, col, sp[j], k[j], out[j]);
        // Samples in [0, 1) keep every window inside; huge ones (where `i + u` rounds)
        // may not, and XLA would clamp the gather silently.
        c.check_range(
            st,
            0,
            sp[j] - k[j] + 1,
            ErrorKind::Runtime,
            format!("fractional_max_pool{n}d(): random_samples place a window at {{index}}, outside the input (samples must lie in [0, 1))"),
        );
        starts.push(st);
    }
    let b = &mut *c.b;
    let mut oshape = vec![planes];
    oshape.extend_from_slice(&out);
    // Flat index of each window's first element: sum of start * stride over the dims.
    let mut base = b.full(DType::I64, &oshape, 0.0);
    let mut stride = vol;
    for (j, st) in starts.into_iter().enumerate() {
        stride /= sp[j];
        let s = b.full(DType::I64, &[planes, out[j]], stride as f64);
        let st = b.mul(st, s);
        let st = b.broadcast_in_dim(st, &oshape, &[0, 1 + j as i64]);
        base = b.add(base, st);
    }
    let plane = b.iota(DType::I64, &oshape, 0);
    let pv = b.full(DType::I64, &oshape, vol as f64);
    let plane = b.mul(plane, pv);
    let mut best: Option<(Value, Value)> = None;
    for off in 0..numel(&k) {
        // Offset of this kernel element within the window, T/H outer, W inner.
        let (mut rem, mut delta, mut st) = (off, 0, vol);
        let mut kst = numel(&k);
        for j in 0..n {
            st /= sp[j];
            kst /= k[j];
            delta += (rem / kst) * st;
            rem %= kst;
        }
        let d = b.full(DType::I64, &oshape, delta as f64);
        let idx = b.add(base, d);
        let lin = b.add(plane, idx);
        let v = take_flat(b, x.value, lin);
        best = Some(match best {
            None => (v, idx),
            Some((mv, mi)) => {
                let gt = b.compare(v, mv, CmpDir::Gt);
                let nan = b.compare(v, v, CmpDir::Ne);
                let take = b.or(gt, nan);
                (b.select(take, v, mv), b.select(take, idx, mi))
            }
        });
    }
    let (mv, mi) = best.expect("kernel sizes are positive");
    Ok(vec![
        Out::T(b.reshape(mv, &want)),
        Out::T(b.reshape(mi, &want)),
    ])
}

/// fractional_max_pool{2,3}d_backward: each gradient added at the index its window chose.
fn fractional_max_pool_backward(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let ind = tensor(c, "indices")?;
    let out = c.args.ints("output_size")?;
    let r = x.shape.len();
    if out.len() != n || (r != n + 1 && r != n + 2) {
        return decline("fractional_max_pool_backward: arguments");
    }
    float_input(&x, "fractional_max_pool_backward")?;
    let want = with_spatial(&x.shape, &out);
    // Mismatches get the CPU kernel's own errors from the fallback.
    if gy.shape != want || ind.shape != want || gy.dtype != x.dtype || ind.dtype != DType::I64 {
        return decline("fractional_max_pool_backward: grad_output/indices shape or dtype");
    }
    if numel(&x.shape) == 0 || numel(&want) == 0 {
        return Ok(vec![Out::T(c.b.full(x.dtype, &x.shape, 0.0))]);
    }
    let vol = numel(&x.shape[r - n..]);
    c.check_range(
        ind.value,
        0,
        vol,
        ErrorKind::Runtime,
        format!("fractional_max_pool{n}d_backward(): index {{index}} is out of bounds for a pooled plane of {vol} elements"),
    );
    Ok(vec![Out::T(index_grad(c.b, &gy, &ind, &x, n))])
}

/// Divisors of avg pooling along one dim: the window length clipped to the padded input
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

/// The outer product of per-dim constants as a value of `shape` (they span its last dims).
fn outer_const(b: &mut Builder, per_dim: &[Vec<f64>], shape: &[i64], dt: DType) -> Value {
    let mut all = vec![1.0];
    for v in per_dim {
        all = all
            .iter()
            .flat_map(|a| v.iter().map(move |x| a * x))
            .collect();
    }
    let v = const_vec(b, dt, &all);
    let dims: Vec<i64> = per_dim.iter().map(|v| v.len() as i64).collect();
    let v = b.reshape(v, &dims);
    let (r, n) = (shape.len(), per_dim.len());
    let bd: Vec<i64> = (r - n..r).map(|d| d as i64).collect();
    b.broadcast_in_dim(v, shape, &bd)
}

/// The divisor of each avg pooling output, as a value of `shape` (outputs in the last dims).
fn avg_divisor(c: &mut Ctx, x: &TensorArg, pl: &Pool, shape: &[i64], dt: DType) -> Value {
    if let Some(d) = c.args.opt_int("divisor_override") {
        return c.b.full(dt, shape, d as f64);
    }
    let inc = c.args.bool_or("count_include_pad", true);
    let (r, n) = (x.shape.len(), pl.k.len());
    let counts: Vec<Vec<f64>> = (0..n)
        .map(|i| {
            let inp = x.shape[r - n + i];
            avg_counts(inp, pl.k[i], pl.s[i], pl.p[i], pl.out[i], inc)
        })
        .collect();
    outer_const(c.b, &counts, shape, dt)
}

/// Whether avg_pool{2,3}d (`grad`: its backward) has a CPU kernel for `d`.
fn avg_dtype_ok(d: DType, n: usize, grad: bool) -> bool {
    match (n, grad) {
        (2, false) => d != DType::Bool,
        (2, true) => d.is_float(),
        (_, false) => matches!(d, DType::F32 | DType::F64 | DType::I64),
        _ => matches!(d, DType::F32 | DType::F64),
    }
}

/// avg_pool{2,3}d.
fn avg_pool(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let name = if n == 2 { "avg_pool2d" } else { "avg_pool3d" };
    let pl = pool_args(c, name, &x, false, n)?;
    if !avg_dtype_ok(x.dtype, n, false) {
        return decline(format!("{name}: {} input", torch_name(x.dtype)));
    }
    if numel(&x.shape) == 0 {
        let want = with_spatial(&x.shape, &pl.out);
        return Ok(empty_outs(c.b, &[x.dtype], &want));
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

/// avg_pool{2,3}d_backward.
fn avg_pool_backward(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let name = if n == 2 { "avg_pool2d" } else { "avg_pool3d" };
    let pl = pool_args(c, name, &x, false, n)?;
    if !avg_dtype_ok(x.dtype, n, true) {
        return decline(format!("{name}_backward: {} input", torch_name(x.dtype)));
    }
    let r = x.shape.len();
    let want = with_spatial(&x.shape, &pl.out);
    if gy.shape != want {
        return decline(format!("{name}_backward: grad_output shape"));
    }
    if numel(&x.shape) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &x.shape));
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
    for i in 0..n {
        let j = r - n + i;
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
        return decline(format!("{name}_backward: window arithmetic mismatch"));
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

/// Checks an adaptive pooling input and `output_size` (`n` pooled dims) as PyTorch does.
fn check_adaptive(x: &TensorArg, os: &[i64], n: usize, max: bool) -> LResult<()> {
    let name = format!("adaptive_{}_pool{n}d", if max { "max" } else { "avg" });
    if os.len() != n {
        return user_err(
            ErrorKind::Runtime,
            if max {
                format!("{name}(): internal error: output_size.size() must be {n}")
            } else {
                format!("{name}: output_size must be {n}")
            },
        );
    }
    let r = x.shape.len();
    if r != n + 1 && r != n + 2 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{name}(): Expected {}D or {}D tensor, but got{} {}",
                n + 1,
                n + 2,
                if max { ":" } else { "" },
                shape_str(&x.shape)
            ),
        );
    }
    // adaptive_avg_pool2d allows empty leading dims; the others only an empty first dim.
    let from = if max || n == 3 { 1 } else { r - n };
    check_nonempty(&name, &x.shape, from)?;
    if os.iter().any(|v| *v < 0) {
        return decline(format!("{name}: negative output size"));
    }
    float_input(x, &name)
}

/// _adaptive_avg_pool{2,3}d.
fn adaptive_avg_pool(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let os = c.args.ints("output_size")?;
    check_adaptive(&x, &os, n, false)?;
    let r = x.shape.len();
    let want = with_spatial(&x.shape, &os);
    if numel(&want) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &want));
    }
    let mats: Vec<_> = (0..n)
        .map(|i| adaptive_matrix(x.shape[r - n + i], os[i]))
        .collect();
    let cd = opmath(x.dtype);
    let b = &mut *c.b;
    let mut t = b.convert(x.value, cd);
    for (i, (m, _)) in mats.iter().enumerate() {
        t = mix(b, t, r - n + i, m);
    }
    let counts: Vec<Vec<f64>> = mats.into_iter().map(|(_, c)| c).collect();
    let div = outer_const(b, &counts, &want, cd);
    let y = b.div(t, div);
    Ok(vec![Out::T(b.convert(y, x.dtype))])
}

/// _adaptive_avg_pool{2,3}d_backward.
fn adaptive_avg_pool_backward(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let r = x.shape.len();
    if gy.shape.len() != r || r < n || gy.shape[..r - n] != x.shape[..r - n] {
        return decline("adaptive_avg_pool_backward: grad_output shape");
    }
    let os = gy.shape[r - n..].to_vec();
    check_adaptive(&x, &os, n, false)?;
    if numel(&x.shape) == 0 || numel(&os) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &x.shape));
    }
    let mats: Vec<_> = (0..n)
        .map(|i| adaptive_matrix(x.shape[r - n + i], os[i]))
        .collect();
    let cd = opmath(x.dtype);
    let b = &mut *c.b;
    let counts: Vec<Vec<f64>> = mats.iter().map(|(_, c)| c.clone()).collect();
    let div = outer_const(b, &counts, &gy.shape, cd);
    let g = b.convert(gy.value, cd);
    let mut t = b.div(g, div);
    for (i, (m, _)) in mats.iter().enumerate() {
        let inp = x.shape[r - n + i] as usize;
        t = mix(b, t, r - n + i, &transpose_matrix(m, inp));
    }
    Ok(vec![Out::T(b.convert(t, x.dtype))])
}

/// adaptive_max_pool{2,3}d: one dim at a time, each output the max of its window and the
/// flat index of that element (ties and NaNs as `argmax_pick`, which composes across dims).
fn adaptive_max_pool(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let os = c.args.ints("output_size")?;
    check_adaptive(&x, &os, n, true)?;
    let r = x.shape.len();
    let want = with_spatial(&x.shape, &os);
    let b = &mut *c.b;
    if numel(&want) == 0 {
        return Ok(empty_outs(b, &[x.dtype, DType::I64], &want));
    }
    let mut v = x.value;
    let mut idx = flat_index(b, &x.shape, n);
    for (i, o) in os.iter().enumerate() {
        let dim = r - n + i;
        let wins = adaptive_windows(x.shape[dim], *o);
        let k = wins.iter().map(|(s, e)| e - s).max().unwrap_or(1);
        // Shorter windows repeat their last element, which cannot change the pick.
        let ids: Vec<i64> = wins
            .iter()
            .flat_map(|(s, e)| (0..k).map(move |j| (s + j).min(e - 1)))
            .collect();
        let vg = take_rows(b, v, dim, &ids, k as usize);
        let ig = take_rows(b, idx, dim, &ids, k as usize);
        let vinit = b.constant(x.dtype, ReduceKind::Max.init(x.dtype));
        let iinit = b.constant_i64(DType::I64, i64::MAX);
        let res = b.reduce_with(&[vg, ig], &[vinit, iinit], &[dim as i64 + 1], argmax_pick);
        (v, idx) = (res[0], res[1]);
    }
    Ok(vec![Out::T(v), Out::T(idx)])
}

/// adaptive_max_pool{2,3}d_backward.
fn adaptive_max_pool_backward(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let ind = tensor(c, "indices")?;
    let r = x.shape.len();
    if gy.shape.len() != r
        || r < n
        || ind.shape != gy.shape
        || ind.dtype != DType::I64
        || gy.shape[..r - n] != x.shape[..r - n]
    {
        return decline("adaptive_max_pool_backward: grad_output/indices");
    }
    check_adaptive(&x, &gy.shape[r - n..], n, true)?;
    if numel(&x.shape) == 0 || numel(&gy.shape) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &x.shape));
    }
    Ok(vec![Out::T(index_grad(c.b, &gy, &ind, &x, n))])
}

/// max_unpool{2,3}d: `self` written at the flat `indices` of a zero output; where indices
/// repeat, the last element wins, as in PyTorch's loop. Indices outside the output raise
/// through a data check.
fn max_unpool(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let ind = tensor(c, "indices")?;
    let os = c.args.ints("output_size")?;
    let err = |m: String| user_err::<Vec<Out>>(ErrorKind::Runtime, m);
    if ind.dtype != DType::I64 {
        return err(format!(
            "elements in indices should be type int64 but got: {}",
            torch_name(ind.dtype)
        ));
    }
    let r = x.shape.len();
    let rank_msg = format!(
        "Input to max_unpooling{n}d should be a {}d or {}d Tensor, but got a tensor with {r} dimensions.",
        n + 1,
        n + 2
    );
    if n == 2 {
        if os.len() != 2 {
            return err(format!("There should be exactly two elements (height, width) in output_size, but got {} elements.", os.len()));
        }
        if r != 3 && r != 4 {
            return err(rank_msg);
        }
    } else {
        if r != 4 && r != 5 {
            return err(rank_msg);
        }
        if os.len() != 3 {
            return err(format!("There should be exactly three elements (depth, height, width) in output_size, but got {} elements.", os.len()));
        }
        for what in ["stride", "padding"] {
            let l = c.args.ints(what)?.len();
            if l != 3 {
                return err(format!("There should be exactly three elements (depth, height, width) in {what}, but got: {l} elements."));
            }
        }
    }
    if x.shape != ind.shape {
        return err(format!(
            "Expected shape of indices to be same as that of the input tensor ({}) but got indices tensor with shape: {}",
            shape_str(&x.shape),
            shape_str(&ind.shape)
        ));
    }
    check_nonempty(&format!("max_unpooling{n}d_forward_out_cpu"), &x.shape, 1)?;
    if n == 3 {
        let st = c.args.ints("stride")?;
        if st.iter().any(|v| *v <= 0) {
            return err(format!(
                "strides should be greater than zero, but got stride: {}",
                shape_str(&st)
            ));
        }
    }
    if os.iter().any(|v| *v < 0) {
        if n == 2 {
            return err(format!("max_unpooling2d(): output_size must contain non-negative spatial dimensions, but got output_size={}", shape_str(&os)));
        }
        return decline("max_unpool3d: negative output size");
    }
    float_input(&x, "max_unpool")?;
    let lead = &x.shape[..r - n];
    let want: Vec<i64> = lead.iter().chain(&os).copied().collect();
    if numel(&want) == 0 || numel(&x.shape) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &want));
    }
    let planes = numel(lead);
    let (l, vol) = (numel(&x.shape[r - n..]), numel(&os));
    let m = planes * l;
    // 1-d unpooling reaches here as 2-d with a width of 1, and the CPU's message says so.
    let sizes: Vec<String> = os.iter().map(|v| v.to_string()).collect();
    c.check_range(
        ind.value,
        0,
        vol,
        ErrorKind::Runtime,
        format!(
            "Found an invalid max index: {{index}} (output volumes are of size {})",
            sizes.join("x")
        ),
    );
    let b = &mut *c.b;
    // The position of the winning input element per output slot (-1: none), then its value.
    let pos = b.iota(DType::I64, &[planes, l], 1);
    let pos = b.reshape(pos, &[m]);
    let plane = b.iota(DType::I64, &[planes, l], 0);
    let plane = b.reshape(plane, &[m, 1]);
    let idx = b.reshape(ind.value, &[m, 1]);
    let both = b.concatenate(&[plane, idx], 1);
    let none = b.full(DType::I64, &[planes, vol], -1.0);
    let win = b.scatter(none, both, pos, &[], &[0, 1], &[0, 1], 1, |b, a, u| {
        b.max(a, u)
    });
    let zero_i = b.splat(win, 0.0);
    let hit = b.compare(win, zero_i, CmpDir::Ge);
    let safe = b.max(win, zero_i);
    let base = b.iota(DType::I64, &[planes, vol], 0);
    let lk = b.splat(base, l as f64);
    let base = b.mul(base, lk);
    let flat = b.add(base, safe);
    let flat = b.reshape(flat, &[planes * vol, 1]);
    let xf = b.reshape(x.value, &[m]);
    let got = b.gather(xf, flat, &[], &[0], &[0], 1, &[1]);
    let got = b.reshape(got, &[planes, vol]);
    let zero = b.full(x.dtype, &[planes, vol], 0.0);
    let y = b.select(hit, got, zero);
    Ok(vec![Out::T(b.reshape(y, &want))])
}

// ---------------------------------------------------------------------------------------
// Sliding windows: im2col, col2im, unfold_backward
// ---------------------------------------------------------------------------------------

/// The positions `o * stride + j * dil` of `out` windows of `k` taps, window-major.
fn window_taps(out: i64, k: i64, stride: i64, dil: i64) -> Vec<i64> {
    (0..out)
        .flat_map(|o| (0..k).map(move |j| o * stride + j * dil))
        .collect()
}

/// im2col / col2im parameters: [kernel, dilation, padding, stride], two each.
fn window_args(c: &Ctx, extra: &[&str]) -> LResult<Vec<[i64; 2]>> {
    let mut out = Vec::new();
    for name in extra
        .iter()
        .chain(&["kernel_size", "dilation", "padding", "stride"])
    {
        let v = c.args.ints(name)?;
        if v.len() != 2 {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "It is expected {name} equals to 2, but got size {}",
                    v.len()
                ),
            );
        }
        out.push([v[0], v[1]]);
    }
    Ok(out)
}

/// PyTorch's checks of im2col/col2im's kernel, dilation, padding and stride (in `order`).
fn check_window(
    k: [i64; 2],
    d: [i64; 2],
    p: [i64; 2],
    s: [i64; 2],
    order: &[usize],
) -> LResult<()> {
    for i in order {
        let (ok, what, v, word) = match i {
            0 => (
                k[0] > 0 && k[1] > 0,
                "kernel",
                k,
                "kernel size should be greater than zero",
            ),
            1 => (
                d[0] > 0 && d[1] > 0,
                "dilation",
                d,
                "dilation should be greater than zero",
            ),
            2 => (
                p[0] >= 0 && p[1] >= 0,
                "pad",
                p,
                "padding should be non-negative",
            ),
            _ => (
                s[0] > 0 && s[1] > 0,
                "stride",
                s,
                "stride should be greater than zero",
            ),
        };
        if !ok {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "{word}, but got {what}_height: {} {what}_width: {}",
                    v[0], v[1]
                ),
            );
        }
    }
    Ok(())
}

/// im2col (nn.functional.unfold): [N, C, H, W] -> [N, C * kh * kw, L], two gathers of the
/// zero-padded input.
fn im2col(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let a = window_args(c, &[])?;
    let (k, d, p, s) = (a[0], a[1], a[2], a[3]);
    check_window(k, d, p, s, &[0, 1, 2, 3])?;
    let r = x.shape.len();
    if r != 3 && r != 4 {
        return decline("im2col: input rank");
    }
    if x.shape[r - 3..].contains(&0) {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected 3D or 4D (batch mode) tensor with possibly 0 batch size and other non-zero dimensions for input, but got: {}",
                shape_str(&x.shape)
            ),
        );
    }
    let (h, w) = (x.shape[r - 2], x.shape[r - 1]);
    let o: Vec<i64> = (0..2)
        .map(|i| (x.shape[r - 2 + i] + 2 * p[i] - (d[i] * (k[i] - 1) + 1)) / s[i] + 1)
        .collect();
    if o[0] < 1 || o[1] < 1 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Given input with spatial size ({h}, {w}), kernel_size=({}, {}), dilation=({}, {}), padding=({}, {}), calculated shape of the array of sliding blocks as ({}, {}), but its components must be at least one.",
                k[0], k[1], d[0], d[1], p[0], p[1], o[0], o[1]
            ),
        );
    }
    if !x.dtype.is_float() && x.dtype != DType::Bool {
        return decline(format!("im2col: {} input", torch_name(x.dtype)));
    }
    let lead = &x.shape[..r - 3];
    let ch = x.shape[r - 3];
    let mut want: Vec<i64> = lead.to_vec();
    want.extend([ch * k[0] * k[1], o[0] * o[1]]);
    let b = &mut *c.b;
    if numel(&x.shape) == 0 {
        return Ok(empty_outs(b, &[x.dtype], &want));
    }
    let zero = b.constant(x.dtype, 0.0);
    let mut lo = vec![0; r];
    lo[r - 2] = p[0];
    lo[r - 1] = p[1];
    let t = b.pad(x.value, zero, &lo, &lo, &vec![0; r]);
    // [.., C, Hp, Wp] -> [.., C, oh, kh, Wp] -> [.., C, oh, kh, ow, kw]
    let t = take_rows(
        b,
        t,
        r - 2,
        &window_taps(o[0], k[0], s[0], d[0]),
        k[0] as usize,
    );
    let t = take_rows(b, t, r, &window_taps(o[1], k[1], s[1], d[1]), k[1] as usize);
    let l = lead.len() as i64;
    let mut perm: Vec<i64> = (0..l).collect();
    perm.extend([l, l + 2, l + 4, l + 1, l + 3]);
    let t = b.transpose(t, &perm);
    Ok(vec![Out::T(b.reshape(t, &want))])
}

/// col2im (nn.functional.fold): the adjoint of im2col, summing overlapping windows.
fn col2im(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let a = window_args(c, &["output_size"])?;
    let (os, k, d, p, s) = (a[0], a[1], a[2], a[3], a[4]);
    check_window(k, d, p, s, &[0, 3, 1, 2])?;
    let r = x.shape.len();
    let ok = (r == 2 && x.shape[0] != 0 && x.shape[1] != 0)
        || (r == 3 && x.shape[1] != 0 && x.shape[2] != 0);
    if !ok {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected 2D or 3D (batch mode) tensor for input with possibly 0 batch size and non-zero dimensions for input, but got: {}",
                shape_str(&x.shape)
            ),
        );
    }
    let cd = r - 2;
    let kk = k[0] * k[1];
    if x.shape[cd] % kk != 0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected size of input's dimension {cd} to be divisible by the product of kernel_size, but got input.size({cd})={} and kernel_size=({}, {}).",
                x.shape[cd], k[0], k[1]
            ),
        );
    }
    let o: Vec<i64> = (0..2)
        .map(|i| div_floor(os[i] + 2 * p[i] - d[i] * (k[i] - 1) - 1, s[i]) + 1)
        .collect();
    let prefix = format!(
        "Given output_size=({}, {}), kernel_size=({}, {}), dilation=({}, {}), padding=({}, {}), stride=({}, {})",
        os[0], os[1], k[0], k[1], d[0], d[1], p[0], p[1], s[0], s[1]
    );
    if x.shape[cd + 1] != o[0] * o[1] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{prefix}, expected size of input's dimension {} to match the calculated number of sliding blocks {} * {} = {}, but got input.size({})={}.",
                cd + 1, o[0], o[1], o[0] * o[1], cd + 1, x.shape[cd + 1]
            ),
        );
    }
    if o[0] < 1 || o[1] < 1 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{prefix}, calculated shape of the array of sliding blocks as ({}, {}), which is too small (non-positive)",
                o[0], o[1]
            ),
        );
    }
    if !x.dtype.is_float() {
        return decline(format!("col2im: {} input", torch_name(x.dtype)));
    }
    let lead = &x.shape[..cd];
    let ch = x.shape[cd] / kk;
    let mut want: Vec<i64> = lead.to_vec();
    want.extend([ch, os[0], os[1]]);
    let b = &mut *c.b;
    if numel(&x.shape) == 0 {
        return Ok(empty_outs(b, &[x.dtype], &want));
    }
    let dt = opmath(x.dtype);
    let t = b.convert(x.value, dt);
    let mut split: Vec<i64> = lead.to_vec();
    split.extend([ch, k[0], k[1], o[0], o[1]]);
    let t = b.reshape(t, &split);
    // [.., C, kh, kw, oh, ow] -> [.., C, oh, kh, ow, kw] -> [.., C, Hp, ow, kw] -> [.., C, Hp, Wp]
    let l = cd as i64;
    let mut perm: Vec<i64> = (0..l).collect();
    perm.extend([l, l + 3, l + 1, l + 4, l + 2]);
    let t = b.transpose(t, &perm);
    let (hp, wp) = (os[0] + 2 * p[0], os[1] + 2 * p[1]);
    let t = put_rows(b, t, cd + 1, &window_taps(o[0], k[0], s[0], d[0]), hp);
    let t = put_rows(b, t, cd + 2, &window_taps(o[1], k[1], s[1], d[1]), wp);
    let t = b.slice_dim(t, cd + 1, p[0], p[0] + os[0], 1);
    let t = b.slice_dim(t, cd + 2, p[1], p[1] + os[1], 1);
    Ok(vec![Out::T(b.convert(t, x.dtype))])
}

/// unfold_backward: the gradient of Tensor.unfold, windows summed back onto `dim`.
fn unfold_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let g = tensor(c, "grad_in")?;
    let sizes = c.args.ints("input_sizes")?;
    let (size, step) = (c.args.int("size")?, c.args.int("step")?);
    let r = sizes.len();
    if g.dtype == DType::Bool || step <= 0 || size < 0 {
        return decline("unfold_backward: bool or bad window");
    }
    if r == 0 {
        // A 0-d input unfolds to [size], size at most 1.
        if g.shape != [size] || size > 1 {
            return decline("unfold_backward: 0-d input");
        }
        let dt = opmath(g.dtype);
        let t = c.b.convert(g.value, dt);
        let t = c.b.reduce(t, &[0], ReduceKind::Sum);
        return Ok(vec![Out::T(c.b.convert(t, g.dtype))]);
    }
    let d = crate::shape::wrap_dim(c.args.int("dim")?, r)?;
    let n = sizes[d];
    if size > n {
        return decline("unfold_backward: window longer than the dim");
    }
    let nw = (n - size) / step + 1;
    let mut want = sizes.clone();
    want[d] = nw;
    want.push(size);
    if g.shape != want {
        return decline("unfold_backward: grad_in shape");
    }
    let b = &mut *c.b;
    if numel(&want) == 0 {
        return Ok(empty_outs(b, &[g.dtype], &sizes));
    }
    let dt = opmath(g.dtype);
    let t = b.convert(g.value, dt);
    // Bring the window axis next to `dim`: [.., nw, size, ..].
    let mut perm: Vec<i64> = (0..r as i64).collect();
    perm.insert(d + 1, r as i64);
    let t = b.transpose(t, &perm);
    let t = put_rows(b, t, d, &window_taps(nw, size, step, 1), n);
    Ok(vec![Out::T(b.convert(t, g.dtype))])
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

/// The runs of a replication pad of `n` elements by (l, r) (negative crops): output j
/// copies x[clamp(j - l, 0, n - 1)], i.e. `left` copies of x[0], x[lo..hi], `right` copies
/// of x[n - 1].
fn replicate_runs(n: i64, l: i64, r: i64) -> (i64, i64, i64, i64) {
    let out = n + l + r;
    let left = l.clamp(0, out);
    let lo = (-l).clamp(0, n);
    let hi = (out - l).min(n).max(lo);
    (left, lo, hi, out - left - (hi - lo))
}

/// Pads `x` along `dim` by (l, r) (negative crops) with reflected or replicated edges.
fn edge_pad_dim(b: &mut Builder, x: Value, dim: usize, l: i64, r: i64, reflect: bool) -> Value {
    let n = b.shape(x)[dim];
    let edge = |b: &mut Builder, at: i64, count: i64| {
        let e = b.slice_dim(x, dim, at, at + 1, 1);
        let mut shape = b.shape(e);
        shape[dim] = count;
        b.broadcast_to(e, &shape)
    };
    let mut parts = Vec::new();
    if !reflect {
        let (left, lo, hi, right) = replicate_runs(n, l, r);
        if left > 0 {
            parts.push(edge(b, 0, left));
        }
        if hi > lo {
            parts.push(b.slice_dim(x, dim, lo, hi, 1));
        }
        if right > 0 {
            parts.push(edge(b, n - 1, right));
        }
        return b.concatenate(&parts, dim);
    }
    let (nl, nr) = (l.max(0), r.max(0));
    if nl > 0 {
        let s = b.slice_dim(x, dim, 1, nl + 1, 1);
        parts.push(b.reverse(s, &[dim as i64]));
    }
    parts.push(b.slice_dim(x, dim, (-l).max(0), n - (-r).max(0), 1));
    if nr > 0 {
        let s = b.slice_dim(x, dim, n - 1 - nr, n - 1, 1);
        parts.push(b.reverse(s, &[dim as i64]));
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
    let rank = b.rank(g);
    let zero = b.constant(b.dtype(g), 0.0);
    // `v` (a run along `dim`) placed at `at` in `n` zeros.
    let place = |b: &mut Builder, v: Value, at: i64| {
        let len = b.shape(v)[dim];
        let mut lo = vec![0; rank];
        let mut hi = vec![0; rank];
        lo[dim] = at;
        hi[dim] = n - at - len;
        b.pad(v, zero, &lo, &hi, &vec![0; rank])
    };
    // (output start, length, input position, reversed/summed) of each run.
    let mut runs = Vec::new();
    if reflect {
        let (nl, nr) = (l.max(0), r.max(0));
        let mid_start = (-l).max(0);
        let mid_len = n - mid_start - (-r).max(0);
        runs.push((nl, mid_len, mid_start, false));
        runs.push((0, nl, 1, true));
        runs.push((nl + mid_len, nr, n - 1 - nr, true));
    } else {
        let (left, lo, hi, right) = replicate_runs(n, l, r);
        runs.push((left, hi - lo, lo, false));
        runs.push((0, left, 0, true));
        runs.push((left + hi - lo, right, n - 1, true));
    }
    let mut acc: Option<Value> = None;
    for (start, len, at, fold) in runs {
        if len <= 0 {
            continue;
        }
        let part = b.slice_dim(g, dim, start, start + len, 1);
        let part = match (fold, reflect) {
            (false, _) => part,
            (true, true) => b.reverse(part, &[dim as i64]),
            (true, false) => super::reduce::sum_keep(b, part, &[dim as i64]),
        };
        let v = place(b, part, at);
        acc = Some(match acc {
            Some(a) => b.add(a, v),
            None => v,
        });
    }
    acc.unwrap_or_else(|| {
        let mut shape = b.shape(g);
        shape[dim] = n;
        b.full(b.dtype(g), &shape, 0.0)
    })
}

/// Whether `edge_pad_dim` handles padding `n` elements by (l, r); the CPU fallback reports
/// the others.
fn edge_pad_ok(n: i64, l: i64, r: i64, reflect: bool) -> bool {
    let fits = if reflect {
        l < n && r < n && -l < n && -r < n
    } else {
        true
    };
    fits && n + l + r >= 1
}

fn edge_pad(c: &mut Ctx, k: usize, reflect: bool) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let pads = edge_pads(c, &x.shape, k)?;
    for (d, l, r) in &pads {
        if !edge_pad_ok(x.shape[*d], *l, *r, reflect) {
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
        return Ok(empty_outs(c.b, &[x.dtype], &shape));
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
        if !edge_pad_ok(n, *l, *r, reflect) {
            return decline("edge pad backward: padding too large for the input");
        }
        want[*d] = n + l + r;
    }
    if g.shape != want {
        return decline("edge pad backward: grad_output shape");
    }
    if x.shape.contains(&0) {
        return Ok(empty_outs(c.b, &[g.dtype], &x.shape));
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

/// The interpolation of an upsample op.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Interp {
    Nearest,
    NearestExact,
    Linear,
    Cubic,
    LinearAa,
    CubicAa,
}

/// `v` rounded to the nearest value of `d` (f16/bf16; others unchanged), ties to even.
fn round_to(v: f64, d: DType) -> f64 {
    let (mant, min_exp) = match d {
        DType::BF16 => (7, -126),
        DType::F16 => (10, -14),
        _ => return v,
    };
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let e = (v.abs().log2().floor() as i32).max(min_exp);
    let ulp = 2f64.powi(e - mant);
    (v / ulp).round_ties_even() * ulp
}

/// PyTorch's scale of an upsampling dim: 1 / the given scale factor, or in / out (in f32).
fn up_scale(inp: i64, out: i64, scale: Option<f64>) -> f32 {
    match scale {
        Some(s) if s > 0.0 => (1.0 / s) as f32,
        _ => inp as f32 / out as f32,
    }
}

/// Keys' cubic convolution kernel (parameter `a`) at `0 <= x < 2`, each operation rounded
/// by `q`.
fn keys(x: f64, a: f64, q: &dyn Fn(f64) -> f64) -> f64 {
    if x < 1.0 {
        q(q(q(q(q((a + 2.0) * x) - (a + 3.0)) * x) * x) + 1.0)
    } else {
        q(q(q(q(q(q(a * x) - 5.0 * a) * x) + 8.0 * a) * x) - 4.0 * a)
    }
}

/// The weights of the 4 bicubic taps around a point `t` past the second.
fn cubic_coeffs(t: f64, a: f64, q: &dyn Fn(f64) -> f64) -> [f64; 4] {
    let u = q(1.0 - t);
    [
        keys(q(t + 1.0), a, q),
        keys(t, a, q),
        keys(u, a, q),
        keys(q(u + 1.0), a, q),
    ]
}

/// The anti-aliasing filter of `kind` at distance `x`: triangle or PIL's bicubic (a = -0.5).
fn aa_filter(kind: Interp, x: f64, q: &dyn Fn(f64) -> f64) -> f64 {
    let x = x.abs();
    match kind {
        Interp::LinearAa if x < 1.0 => q(1.0 - x),
        Interp::CubicAa if x < 2.0 => keys(x, -0.5, q),
        _ => 0.0,
    }
}

/// The [out][in] weights of one upsampled dim as PyTorch's CPU kernels compute them: in
/// f32 unless `wd` (the dtype weights are stored in) is f64, weights rounded to `wd`.
/// `shortcut`: the kernel's copy shortcut applies (nearest: sizes equal or doubled;
/// anti-aliased: sizes equal; linear always copies equal sizes).
fn interp_matrix(
    kind: Interp,
    inp: i64,
    out: i64,
    align: bool,
    scale: Option<f64>,
    shortcut: bool,
    wd: DType,
) -> Vec<Vec<f64>> {
    let wide = wd == DType::F64;
    // Rounds an intermediate to the kernel's opmath type.
    let q = |v: f64| if wide { v } else { v as f32 as f64 };
    let store = |v: f64| round_to(q(v), wd);
    // area_pixel_compute_scale and area_pixel_compute_source_index.
    let sc = match (align, out > 1) {
        (true, true) => q((inp - 1) as f64 / (out - 1) as f64),
        (true, false) => 0.0,
        _ => match scale {
            Some(s) if s > 0.0 => q(1.0 / s),
            _ => q(inp as f64 / out as f64),
        },
    };
    let source = |o: i64, cubic: bool| {
        if align {
            return q(sc * o as f64);
        }
        let s = q(sc * (o as f64 + 0.5) - 0.5);
        if !cubic && s < 0.0 {
            0.0
        } else {
            s
        }
    };
    let copy = match kind {
        Interp::Linear => true,
        Interp::Nearest | Interp::LinearAa | Interp::CubicAa => shortcut,
        _ => false,
    };
    let last = inp - 1;
    let mut m = vec![vec![0.0; inp as usize]; out as usize];
    for o in 0..out {
        let row = &mut m[o as usize];
        if copy && out == inp {
            row[o as usize] = 1.0;
            continue;
        }
        match kind {
            Interp::Nearest | Interp::NearestExact => {
                // Nearest kernels use an f32 scale whatever the dtype.
                let sc = up_scale(inp, out, scale);
                let src = if kind == Interp::NearestExact {
                    (((o as f64 + 0.5) * sc as f64) as f32).floor() as i64
                } else if shortcut && out == 2 * inp {
                    o >> 1
                } else {
                    (o as f32 * sc).floor() as i64
                };
                row[src.min(last) as usize] = 1.0;
            }
            Interp::Linear => {
                let real = source(o, false);
                let i0 = (real.floor() as i64).min(last);
                let l1 = store(q(real - i0 as f64).clamp(0.0, 1.0));
                let i1 = i0 + i64::from(i0 < last);
                row[i0 as usize] += store(1.0 - l1);
                row[i1 as usize] += l1;
            }
            Interp::Cubic => {
                let real = source(o, true);
                let i0 = (real.floor() as i64).min(last);
                let t = q(real - i0 as f64).clamp(0.0, 1.0);
                for (j, w) in cubic_coeffs(t, -0.75, &q).iter().enumerate() {
                    row[(i0 - 1 + j as i64).clamp(0, last) as usize] += store(*w);
                }
            }
            Interp::LinearAa | Interp::CubicAa => {
                let taps = if kind == Interp::LinearAa { 1.0 } else { 2.0 };
                let (support, inv) = if sc >= 1.0 {
                    (q(taps * sc), q(1.0 / sc))
                } else {
                    (taps, 1.0)
                };
                let center = q(sc * (o as f64 + 0.5));
                let lo = (q(center - support) + 0.5).max(0.0) as i64;
                let hi = ((q(center + support) + 0.5) as i64).min(inp);
                let ws: Vec<f64> = (lo..hi)
                    .map(|i| aa_filter(kind, q((q(i as f64 - center) + 0.5) * inv), &q))
                    .collect();
                let total = ws.iter().fold(0.0, |acc, w| q(acc + w));
                for (i, w) in (lo..hi).zip(ws) {
                    row[i as usize] = if total != 0.0 { store(w / total) } else { w };
                }
            }
        }
    }
    m
}

/// The scale argument names of an upsample op over `n` dims.
fn scale_names(n: usize) -> &'static [&'static str] {
    match n {
        1 => &["scales"],
        2 => &["scales_h", "scales_w"],
        _ => &["scales_d", "scales_h", "scales_w"],
    }
}

/// (output size, scales) of an upsample call with `n` spatial dims, from either
/// overload, with PyTorch's checks.
fn up_args(c: &Ctx, x: &TensorArg, n: usize) -> LResult<(Vec<i64>, Vec<Option<f64>>)> {
    let r = x.shape.len();
    let sf = match c.args.get("scale_factors") {
        Some(crate::Arg::List(_)) => Some(c.args.floats("scale_factors")?),
        _ => None,
    };
    let (os, sc) = match (c.args.opt_ints("output_size"), sf) {
        (Some(os), None) => {
            let sc = scale_names(n).iter().map(|s| c.args.opt_float(s));
            (os, sc.collect())
        }
        (None, Some(sf)) if sf.len() == n && r == n + 2 => {
            let os = (0..n).map(|i| (x.shape[2 + i] as f64 * sf[i]) as i64);
            (os.collect(), sf.iter().map(|s| Some(*s)).collect())
        }
        _ => return decline("upsample: unsupported size arguments"),
    };
    let err = |m: String| user_err(ErrorKind::Runtime, m);
    if os.len() != n {
        return err(format!(
            "It is expected output_size equals to {n}, but got size {}",
            os.len()
        ));
    }
    if r != n + 2 {
        return err(format!(
            "It is expected input_size equals to {}, but got size {r}",
            n + 2
        ));
    }
    let sp = &x.shape[2..];
    if sp.iter().chain(&os).any(|v| *v <= 0) {
        let names = &["D", "H", "W"][3 - n..];
        let list = |v: &[i64]| {
            let items: Vec<String> = names
                .iter()
                .zip(v)
                .map(|(l, x)| format!("{l}: {x}"))
                .collect();
            items.join(", ")
        };
        let and = if n == 1 { " and" } else { "" };
        return err(format!(
            "Input and output sizes should be greater than 0, but got input ({}){and} output ({})",
            list(sp),
            list(&os)
        ));
    }
    if numel(&x.shape[1..]) == 0 {
        return err(format!(
            "Non-empty {}D data tensor expected but got a tensor with sizes {}",
            n + 2,
            shape_str(&x.shape)
        ));
    }
    Ok((os, sc))
}

/// Whether PyTorch's CPU upsampling of `kind` handles `d`.
fn up_dtype_ok(kind: Interp, d: DType, grad: bool) -> bool {
    match kind {
        Interp::Nearest | Interp::NearestExact if !grad => d.is_float() || d == DType::U8,
        Interp::LinearAa | Interp::CubicAa => matches!(d, DType::F32 | DType::F64),
        _ => d.is_float(),
    }
}

/// upsample_{nearest,linear,bicubic,...}{1,2,3}d: one interpolation matrix per spatial dim.
fn upsample(c: &mut Ctx, n: usize, kind: Interp) -> LResult<Vec<Out>> {
    let x = c
        .args
        .opt_tensor("self")
        .or_else(|| c.args.opt_tensor("input"))
        .cloned();
    let Some(x) = x else {
        return decline("upsample: no input");
    };
    if !up_dtype_ok(kind, x.dtype, false) {
        return decline(format!("upsample: {} input", torch_name(x.dtype)));
    }
    let (os, sc) = up_args(c, &x, n)?;
    let align = c.args.bool_or("align_corners", false);
    let want = with_spatial(&x.shape, &os);
    if numel(&want) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &want));
    }
    // The 2-d nearest kernel keeps PyTorch's old copy shortcuts; the 1-d and 3-d ones do not.
    let shortcut = kind != Interp::Nearest || n == 2;
    let cd = opmath(x.dtype);
    // The weights are stored in the input dtype, except by the 2-d bilinear kernel.
    let wd = if kind == Interp::Linear && n == 2 {
        cd
    } else {
        x.dtype
    };
    let b = &mut *c.b;
    let mut t = b.convert(x.value, cd);
    for i in 0..n {
        let m = interp_matrix(kind, x.shape[2 + i], os[i], align, sc[i], shortcut, wd);
        t = mix(b, t, 2 + i, &m);
    }
    Ok(vec![Out::T(b.convert(t, x.dtype))])
}

/// The backward of `upsample`: the transposed matrices of PyTorch's backward kernels.
fn upsample_backward(c: &mut Ctx, n: usize, kind: Interp) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    if !up_dtype_ok(kind, gy.dtype, true) {
        return decline(format!("upsample backward: {} input", torch_name(gy.dtype)));
    }
    let os = c.args.ints("output_size")?;
    let is = c.args.ints("input_size")?;
    if os.len() != n
        || is.len() != n + 2
        || gy.shape.len() != n + 2
        || gy.shape[2..] != os[..]
        || gy.shape[..2] != is[..2]
        || is[2..].iter().chain(&os).any(|v| *v <= 0)
    {
        // The CPU fallback reports these with PyTorch's messages.
        return decline("upsample backward: sizes");
    }
    if numel(&is) == 0 {
        return Ok(empty_outs(c.b, &[gy.dtype], &is));
    }
    // PyTorch's bicubic backward copies when no size changes.
    if kind == Interp::Cubic && is[2..] == os[..] {
        return Ok(vec![Out::T(gy.value)]);
    }
    let sc: Vec<Option<f64>> = scale_names(n).iter().map(|s| c.args.opt_float(s)).collect();
    let align = c.args.bool_or("align_corners", false);
    // The backward kernels keep their weights in the opmath type; only nearest shortcuts.
    let (cd, shortcut) = (opmath(gy.dtype), kind == Interp::Nearest);
    let b = &mut *c.b;
    let mut t = b.convert(gy.value, cd);
    for i in 0..n {
        let m = interp_matrix(kind, is[2 + i], os[i], align, sc[i], shortcut, cd);
        t = mix(b, t, 2 + i, &transpose_matrix(&m, is[2 + i] as usize));
    }
    Ok(vec![Out::T(b.convert(t, gy.dtype))])
}

// ---------------------------------------------------------------------------------------
// Grid sampling
// ---------------------------------------------------------------------------------------

/// f32 arithmetic rounded to `.0` (f16/bf16) after every operation, as PyTorch's CPU
/// kernels compute in those dtypes. The rounding uses integer ops, which XLA cannot drop
/// as excess precision the way it drops a convert pair.
#[derive(Clone, Copy)]
struct Narrow(DType);

impl Narrow {
    fn r(self, b: &mut Builder, x: Value) -> Value {
        let drop = match self.0 {
            DType::BF16 => 16,
            DType::F16 => 13,
            _ => return x,
        };
        // Round the f32 mantissa to the narrow one, ties to even.
        let bits = b.bitcast_convert(x, DType::I32);
        let sh = b.splat(bits, drop as f64);
        let lsb = b.binary("stablehlo.shift_right_logical", bits, sh);
        let one = b.splat(bits, 1.0);
        let lsb = b.and(lsb, one);
        let half = b.splat(bits, ((1i64 << (drop - 1)) - 1) as f64);
        let t = b.add(bits, half);
        let t = b.add(t, lsb);
        let mask = b.splat(bits, (-1i64 << drop) as f64);
        let t = b.and(t, mask);
        let normal = b.bitcast_convert(t, DType::F32);
        if self.0 == DType::BF16 {
            return normal;
        }
        // f16 subnormals are multiples of 2^-24.
        let s = b.splat(x, 2f64.powi(24));
        let y = b.mul(x, s);
        let y = b.unary("stablehlo.round_nearest_even", y);
        let inv = b.splat(x, 2f64.powi(-24));
        let sub = b.mul(y, inv);
        let ax = b.abs(x);
        let lim = b.splat(x, 2f64.powi(-14));
        let small = b.compare(ax, lim, CmpDir::Lt);
        b.select(small, sub, normal)
    }
    fn add(self, b: &mut Builder, x: Value, y: Value) -> Value {
        let v = b.add(x, y);
        self.r(b, v)
    }
    fn sub(self, b: &mut Builder, x: Value, y: Value) -> Value {
        let v = b.sub(x, y);
        self.r(b, v)
    }
    fn mul(self, b: &mut Builder, x: Value, y: Value) -> Value {
        let v = b.mul(x, y);
        self.r(b, v)
    }
    fn div(self, b: &mut Builder, x: Value, y: Value) -> Value {
        let v = b.div(x, y);
        self.r(b, v)
    }
    /// A constant like `like`, rounded to the narrow dtype.
    fn c(self, b: &mut Builder, like: Value, v: f64) -> Value {
        b.splat(like, round_to(v, self.0))
    }
}

/// One sampling tap along one input dim, per output point: the index (clamped into the
/// input), its weight, whether it lies inside the input, and d weight / d coordinate.
struct Tap {
    idx: Value,
    w: Value,
    ok: Value,
    dw: Value,
}

/// grid_sampler_{2,3}d arguments: (input, grid, interpolation, padding mode, align_corners).
fn grid_args(c: &Ctx, n: usize) -> LResult<(TensorArg, TensorArg, i64, i64, bool)> {
    let x = tensor(c, "input")?;
    let g = tensor(c, "grid")?;
    let mode = c.args.int("interpolation_mode")?;
    let pad = c.args.int("padding_mode")?;
    let align = c.args.bool_or("align_corners", false);
    let r = n + 2;
    let max_mode = if n == 2 { 2 } else { 1 };
    let ok = x.dtype.is_float()
        && g.dtype == x.dtype
        && x.shape.len() == r
        && g.shape.len() == r
        && g.shape[0] == x.shape[0]
        && g.shape[r - 1] == n as i64
        && !x.shape[1..].contains(&0)
        && (0..=max_mode).contains(&mode)
        && (0..=2).contains(&pad);
    if !ok {
        // The CPU fallback reports bad arguments in PyTorch's words.
        return decline("grid_sampler: unsupported arguments");
    }
    Ok((x, g, mode, pad, align))
}

/// Reflection and clipping of source coordinates `x` into an input dim of `size`
/// (padding modes 1 border, 2 reflection; 0 keeps them), with the factor they apply to
/// d x.
fn grid_pad(
    b: &mut Builder,
    nr: Narrow,
    x: Value,
    size: i64,
    pad: i64,
    align: bool,
) -> (Value, Value) {
    let mut x = x;
    let mut mult = b.splat(x, 1.0);
    if pad == 0 {
        return (x, mult);
    }
    if pad == 2 {
        let (lo, span) = if align {
            (0.0, 2.0 * (size - 1) as f64)
        } else {
            (-0.5, 2.0 * size as f64)
        };
        if span == 0.0 {
            let z = b.splat(x, 0.0);
            return (z, z);
        }
        // Fold |x - lo| into [0, span) and reflect the upper half.
        let lov = b.splat(x, lo);
        let t = nr.sub(b, x, lov);
        let z = b.splat(x, 0.0);
        let neg = b.compare(t, z, CmpDir::Lt);
        let a = b.abs(t);
        let sp = nr.c(b, x, span);
        let q = nr.div(b, a, sp);
        let q = b.floor(q);
        let q = nr.mul(b, q, sp);
        let extra = nr.sub(b, a, q);
        let refl = nr.sub(b, sp, extra);
        let more = b.compare(extra, refl, CmpDir::Gt);
        let folded = b.select(more, refl, extra);
        x = nr.add(b, folded, lov);
        let flip = b.binary("stablehlo.xor", more, neg);
        let m1 = b.splat(x, -1.0);
        mult = b.select(flip, m1, mult);
    }
    let z = b.splat(x, 0.0);
    let hi = b.splat(x, (size - 1) as f64);
    let above = b.compare(x, z, CmpDir::Gt);
    let below = b.compare(x, hi, CmpDir::Lt);
    let inside = b.and(above, below);
    x = b.clamp(z, x, hi);
    mult = b.select(inside, mult, z);
    (x, mult)
}

/// The taps of one input dim of `size` for normalized grid values `g` ([N, P]) and
/// d coordinate / d g. `scalar` follows PyTorch's scalar (3-d) kernel's arithmetic rather
/// than its vectorized 2-d one.
#[allow(clippy::too_many_arguments)]
fn grid_taps(
    b: &mut Builder,
    nr: Narrow,
    g: Value,
    size: i64,
    mode: i64,
    pad: i64,
    align: bool,
    scalar: bool,
) -> (Vec<Tap>, Value) {
    // Unnormalize: -1 and 1 are the corner pixels' centers (align_corners) or edges.
    let scale = if align {
        (size - 1) as f64 / 2.0
    } else {
        size as f64 / 2.0
    };
    let one = b.splat(g, 1.0);
    let t = nr.add(b, g, one);
    let x = match (scalar, align) {
        // ((g + 1) / 2) * (size - 1) and ((g + 1) * size - 1) / 2
        (true, true) => {
            let two = b.splat(g, 2.0);
            let h = nr.div(b, t, two);
            let m = nr.c(b, g, (size - 1) as f64);
            nr.mul(b, h, m)
        }
        (true, false) => {
            let m = nr.c(b, g, size as f64);
            let u = nr.mul(b, t, m);
            let u = nr.sub(b, u, one);
            let two = b.splat(g, 2.0);
            nr.div(b, u, two)
        }
        // (g + 1) * scale (- 0.5)
        (false, _) => {
            let s = nr.c(b, g, scale);
            let u = nr.mul(b, t, s);
            if align {
                u
            } else {
                let h = b.splat(g, 0.5);
                nr.sub(b, u, h)
            }
        }
    };
    // Bicubic pads each tap instead of the coordinate.
    let (x, m) = if mode == 2 {
        (x, b.splat(x, 1.0))
    } else {
        grid_pad(b, nr, x, size, pad, align)
    };
    let s = b.splat(x, scale);
    let mult = b.mul(m, s);
    // Non-finite coordinates sample nothing, as PyTorch's int conversion guard does.
    let big = b.splat(x, 1e9);
    let ax = b.abs(x);
    let finite = b.compare(ax, big, CmpDir::Lt);
    let far = b.splat(x, -100.0);
    let x = b.select(finite, x, far);
    let zero = b.splat(x, 0.0);
    let tap = |b: &mut Builder, pos: Value, w: Value, dw: Value| {
        let i = b.convert(pos, DType::I64);
        let lo = b.splat(i, 0.0);
        let hi = b.splat(i, (size - 1) as f64);
        let ge = b.compare(i, lo, CmpDir::Ge);
        let le = b.compare(i, hi, CmpDir::Le);
        let ok = b.and(ge, le);
        let idx = b.clamp(lo, i, hi);
        Tap { idx, w, ok, dw }
    };
    let taps = match mode {
        // Nearest: round half to even.
        1 => {
            let r = b.unary("stablehlo.round_nearest_even", x);
            let w = b.splat(x, 1.0);
            vec![tap(b, r, w, zero)]
        }
        0 => {
            let f = b.floor(x);
            let w1 = nr.sub(b, x, f);
            let f1 = b.add(f, one);
            let w0 = if scalar {
                nr.sub(b, f1, x)
            } else {
                nr.sub(b, one, w1)
            };
            let m1 = b.splat(x, -1.0);
            vec![tap(b, f, w0, m1), tap(b, f1, w1, one)]
        }
        _ => {
            let f = b.floor(x);
            let t = nr.sub(b, x, f);
            let mut out = Vec::new();
            for k in 0..4 {
                let (w, dw) = cubic_tap_weight(b, nr, t, k);
                let off = b.splat(f, k as f64 - 1.0);
                let p = b.add(f, off);
                let (p, _) = grid_pad(b, nr, p, size, pad, align);
                out.push(tap(b, p, w, dw));
            }
            out
        }
    };
    (taps, mult)
}

/// The bicubic weight (A = -0.75) of tap `k` (at offset k - 1 from the floor) for a point
/// `t` past the floor, and its derivative in `t`.
fn cubic_tap_weight(b: &mut Builder, nr: Narrow, t: Value, k: usize) -> (Value, Value) {
    let a = -0.75;
    // The distance to the tap, as PyTorch forms it.
    let x = match k {
        0 => {
            let one = b.splat(t, 1.0);
            nr.add(b, t, one)
        }
        1 => t,
        _ => {
            let d = b.splat(t, k as f64 - 1.0);
            nr.sub(b, d, t)
        }
    };
    // Horner forms of Keys' kernel (near for |x| < 1: taps 1, 2) and its derivative.
    let poly = |b: &mut Builder, cs: &[f64]| {
        let mut acc = b.splat(x, cs[0]);
        for c in &cs[1..] {
            acc = nr.mul(b, acc, x);
            let cv = b.splat(x, *c);
            acc = nr.add(b, acc, cv);
        }
        acc
    };
    let (w, dw) = if k == 1 || k == 2 {
        (
            poly(b, &[a + 2.0, -(a + 3.0), 0.0, 1.0]),
            poly(b, &[3.0 * (a + 2.0), -2.0 * (a + 3.0), 0.0]),
        )
    } else {
        (
            poly(b, &[a, -5.0 * a, 8.0 * a, -4.0 * a]),
            poly(b, &[3.0 * a, -10.0 * a, 8.0 * a]),
        )
    };
    // d x / d t is -1 for the taps past the point.
    let dw = if k >= 2 { b.neg(dw) } else { dw };
    (w, dw)
}

/// One tap combination (a tap per input dim): the [N, P, 2] (batch, flat index) gather
/// indices, the weight product (zero outside the input), validity, and the taps.
struct Combo<'a> {
    idx: Value,
    w: Value,
    ok: Value,
    taps: Vec<&'a Tap>,
}

fn grid_combos<'a>(
    b: &mut Builder,
    nr: Narrow,
    dims: &'a [(Vec<Tap>, Value)],
    sizes: &[i64],
    np: [i64; 2],
) -> Vec<Combo<'a>> {
    let mut combos: Vec<Vec<&Tap>> = vec![vec![]];
    for (taps, _) in dims {
        combos = combos
            .into_iter()
            .flat_map(|c| {
                taps.iter().map(move |t| {
                    let mut c = c.clone();
                    c.push(t);
                    c
                })
            })
            .collect();
    }
    let batch = b.iota(DType::I64, &np, 0);
    let batch = b.reshape(batch, &[np[0], np[1], 1]);
    combos
        .into_iter()
        .map(|taps| {
            let mut flat = taps[0].idx;
            let mut ok = taps[0].ok;
            for (t, size) in taps[1..].iter().zip(&sizes[1..]) {
                let s = b.splat(flat, *size as f64);
                flat = b.mul(flat, s);
                flat = b.add(flat, t.idx);
                ok = b.and(ok, t.ok);
            }
            // PyTorch multiplies the weights from the width dim up.
            let mut w = taps[taps.len() - 1].w;
            for t in taps[..taps.len() - 1].iter().rev() {
                w = nr.mul(b, w, t.w);
            }
            let flat = b.reshape(flat, &[np[0], np[1], 1]);
            let idx = b.concatenate(&[batch, flat], 2);
            let z = b.splat(w, 0.0);
            let w = b.select(ok, w, z);
            Combo { idx, w, ok, taps }
        })
        .collect()
}

/// grid_sampler_{2,3}d's shared setup: the input as [N, S, C] (opmath), the taps of each
/// input dim, [N, P] (P output points) and the output shape.
struct GridSetup {
    x: TensorArg,
    g: TensorArg,
    xv: Value,
    dims: Vec<(Vec<Tap>, Value)>,
    np: [i64; 2],
    out: Vec<i64>,
    mode: i64,
    nr: Narrow,
}

fn grid_setup(c: &mut Ctx, n: usize) -> LResult<GridSetup> {
    let (x, g, mode, pad, align) = grid_args(c, n)?;
    let cd = opmath(x.dtype);
    let nr = Narrow(x.dtype);
    let (nb, ch) = (x.shape[0], x.shape[1]);
    let sizes = &x.shape[2..];
    let pts = numel(&g.shape[1..n + 1]);
    let b = &mut *c.b;
    let xv = b.convert(x.value, cd);
    let xv = b.reshape(xv, &[nb, ch, numel(sizes)]);
    let xv = b.transpose(xv, &[0, 2, 1]);
    let gv = b.convert(g.value, cd);
    let gv = b.reshape(gv, &[nb, pts, n as i64]);
    let dims = (0..n)
        .map(|i| {
            // Grid component 0 addresses the last (width) dim.
            let comp = (n - 1 - i) as i64;
            let gi = b.slice_dim(gv, 2, comp, comp + 1, 1);
            let gi = b.reshape(gi, &[nb, pts]);
            grid_taps(b, nr, gi, sizes[i], mode, pad, align, n == 3)
        })
        .collect();
    let mut out = vec![nb, ch];
    out.extend_from_slice(&g.shape[1..n + 1]);
    Ok(GridSetup {
        x,
        g,
        xv,
        dims,
        np: [nb, pts],
        out,
        mode,
        nr,
    })
}

/// grid_sampler_2d / grid_sampler_3d: bilinear, nearest or bicubic samples of the input at
/// the grid's points, zero / border / reflection padding, summed in PyTorch's order.
fn grid_sampler(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let gs = grid_setup(c, n)?;
    let b = &mut *c.b;
    if numel(&gs.out) == 0 {
        return Ok(empty_outs(b, &[gs.x.dtype], &gs.out));
    }
    let (np, nr) = (gs.np, gs.nr);
    let full = [np[0], np[1], gs.x.shape[1]];
    // Terms of the sum: gathered values times their (per point) factor.
    let term = |b: &mut Builder, cb: &Combo, w: Value| {
        let v = b.gather(gs.xv, cb.idx, &[2], &[0, 1], &[0, 1], 2, &[1, 1, full[2]]);
        let wb = b.broadcast_in_dim(w, &full, &[0, 1]);
        let p = nr.mul(b, v, wb);
        let okb = b.broadcast_in_dim(cb.ok, &full, &[0, 1]);
        let z = b.splat(p, 0.0);
        b.select(okb, p, z)
    };
    let combos = grid_combos(b, nr, &gs.dims, &gs.x.shape[2..], np);
    let mut acc: Option<Value> = None;
    if gs.mode == 2 {
        // Bicubic interpolates each row along the width, then the rows.
        for row in combos.chunks(4) {
            let mut r: Option<Value> = None;
            for cb in row {
                let t = term(b, cb, cb.taps[1].w);
                r = Some(r.map_or(t, |a| nr.add(b, a, t)));
            }
            let r = r.expect("4 taps");
            let wy = b.broadcast_in_dim(row[0].taps[0].w, &full, &[0, 1]);
            let t = nr.mul(b, wy, r);
            acc = Some(acc.map_or(t, |a| nr.add(b, a, t)));
        }
    } else {
        for cb in &combos {
            let t = term(b, cb, cb.w);
            acc = Some(acc.map_or(t, |a| nr.add(b, a, t)));
        }
    }
    let y = acc.expect("at least one tap");
    let y = b.transpose(y, &[0, 2, 1]);
    let y = b.reshape(y, &gs.out);
    Ok(vec![Out::T(b.convert(y, gs.x.dtype))])
}

/// grid_sampler_{2,3}d_backward: the input gradient scatters grad_output through the
/// sampling weights; the grid gradient differentiates the weights.
fn grid_sampler_backward(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let mask = c.args.bools("output_mask")?;
    let gs = grid_setup(c, n)?;
    let (x, g) = (&gs.x, &gs.g);
    if gy.shape != gs.out || gy.dtype != x.dtype || mask.len() != 2 {
        return decline("grid_sampler_backward: grad_output shape");
    }
    let b = &mut *c.b;
    let mut outs = Vec::new();
    if numel(&gs.out) == 0 {
        outs.push(Out::T(b.full(x.dtype, &x.shape, 0.0)));
        outs.push(Out::T(b.full(g.dtype, &g.shape, 0.0)));
        return Ok(outs);
    }
    let (np, ch) = (gs.np, x.shape[1]);
    let cd = b.dtype(gs.xv);
    let full = [np[0], np[1], ch];
    let gv = b.convert(gy.value, cd);
    let gv = b.reshape(gv, &[np[0], ch, np[1]]);
    let gv = b.transpose(gv, &[0, 2, 1]);
    let s = numel(&x.shape[2..]);
    let mut gin = b.full(cd, &[np[0], s, ch], 0.0);
    let mut ggrid: Vec<Value> = (0..n).map(|_| b.full(cd, &np, 0.0)).collect();
    for cb in grid_combos(b, gs.nr, &gs.dims, &x.shape[2..], np) {
        let okb = b.broadcast_in_dim(cb.ok, &full, &[0, 1]);
        let z = b.full(cd, &full, 0.0);
        if mask[0] {
            let wb = b.broadcast_in_dim(cb.w, &full, &[0, 1]);
            let u = b.mul(gv, wb);
            let u = b.select(okb, u, z);
            gin = b.scatter(gin, cb.idx, u, &[2], &[0, 1], &[0, 1], 2, |b, a, u| {
                b.add(a, u)
            });
        }
        if mask[1] {
            // sum_c grad * value, times each dim's weight derivative and the others' weights.
            let v = b.gather(gs.xv, cb.idx, &[2], &[0, 1], &[0, 1], 2, &[1, 1, ch]);
            let gvv = b.mul(gv, v);
            let gvv = b.select(okb, gvv, z);
            let gvv = b.reduce(gvv, &[2], ReduceKind::Sum);
            for (i, acc) in ggrid.iter_mut().enumerate() {
                let mut d = cb.taps[i].dw;
                for (j, t) in cb.taps.iter().enumerate() {
                    if j != i {
                        d = b.mul(d, t.w);
                    }
                }
                let term = b.mul(gvv, d);
                *acc = b.add(*acc, term);
            }
        }
    }
    if mask[0] {
        let gi = b.transpose(gin, &[0, 2, 1]);
        let gi = b.reshape(gi, &x.shape);
        outs.push(Out::T(b.convert(gi, x.dtype)));
    } else {
        outs.push(Out::None);
    }
    if mask[1] {
        // Grid component k addresses input dim n - 1 - k.
        let comps: Vec<Value> = (0..n)
            .map(|k| {
                let i = n - 1 - k;
                let t = b.mul(ggrid[i], gs.dims[i].1);
                b.reshape(t, &[np[0], np[1], 1])
            })
            .collect();
        let gg = b.concatenate(&comps, 2);
        let gg = b.reshape(gg, &g.shape);
        outs.push(Out::T(b.convert(gg, g.dtype)));
    } else {
        outs.push(Out::None);
    }
    Ok(outs)
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
    if m.shape != g.shape {
        return decline("native_dropout_backward: mask shape");
    }
    let b = &mut *c.b;
    if !g.dtype.is_float() {
        // PyTorch's `grad * mask * scale`: the product in grad's dtype, then times the
        // Python float, which makes the result float32.
        let mv = b.convert(m.value, g.dtype);
        let t = if g.dtype == DType::Bool {
            b.and(g.value, mv)
        } else {
            b.mul(g.value, mv)
        };
        let t = b.convert(t, DType::F32);
        let k = b.splat(t, scale);
        return Ok(vec![Out::T(b.mul(t, k))]);
    }
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
    ("aten::_native_batch_norm_legit", batch_norm_legit),
    ("aten::_batch_norm_with_update", batch_norm_with_update),
    ("aten::_native_batch_norm_legit_no_training", batch_norm),
    ("aten::native_batch_norm_backward", batch_norm_backward),
    ("aten::batch_norm_backward", batch_norm_backward),
    ("aten::native_layer_norm", layer_norm),
    ("aten::native_layer_norm_backward", layer_norm_backward),
    ("aten::native_group_norm", group_norm),
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
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        sdpa_flash,
    ),
    (
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        sdpa_flash_backward,
    ),
    (
        "aten::convolution_backward_overrideable",
        convolution_backward,
    ),
    ("aten::max_pool2d_with_indices", |c| max_pool(c, 2)),
    ("aten::max_pool3d_with_indices", |c| max_pool(c, 3)),
    ("aten::max_pool2d_with_indices_backward", |c| {
        max_pool_backward(c, 2)
    }),
    ("aten::max_pool3d_with_indices_backward", |c| {
        max_pool_backward(c, 3)
    }),
    ("aten::fractional_max_pool2d", |c| fractional_max_pool(c, 2)),
    ("aten::fractional_max_pool3d", |c| fractional_max_pool(c, 3)),
    ("aten::fractional_max_pool2d_backward", |c| {
        fractional_max_pool_backward(c, 2)
    }),
    ("aten::fractional_max_pool3d_backward", |c| {
        fractional_max_pool_backward(c, 3)
    }),
    ("aten::avg_pool2d", |c| avg_pool(c, 2)),
    ("aten::avg_pool3d", |c| avg_pool(c, 3)),
    ("aten::avg_pool2d_backward", |c| avg_pool_backward(c, 2)),
    ("aten::avg_pool3d_backward", |c| avg_pool_backward(c, 3)),
    ("aten::_adaptive_avg_pool2d", |c| adaptive_avg_pool(c, 2)),
    ("aten::_adaptive_avg_pool3d", |c| adaptive_avg_pool(c, 3)),
    ("aten::_adaptive_avg_pool2d_backward", |c| {
        adaptive_avg_pool_backward(c, 2)
    }),
    ("aten::_adaptive_avg_pool3d_backward", |c| {
        adaptive_avg_pool_backward(c, 3)
    }),
    ("aten::adaptive_max_pool2d", |c| adaptive_max_pool(c, 2)),
    ("aten::adaptive_max_pool3d", |c| adaptive_max_pool(c, 3)),
    ("aten::adaptive_max_pool2d_backward", |c| {
        adaptive_max_pool_backward(c, 2)
    }),
    ("aten::adaptive_max_pool3d_backward", |c| {
        adaptive_max_pool_backward(c, 3)
    }),
    ("aten::max_unpool2d", |c| max_unpool(c, 2)),
    ("aten::max_unpool3d", |c| max_unpool(c, 3)),
    ("aten::im2col", im2col),
    ("aten::col2im", col2im),
    ("aten::unfold_backward", unfold_backward),
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
    ("aten::upsample_nearest1d", |c| {
        upsample(c, 1, Interp::Nearest)
    }),
    ("aten::upsample_nearest1d_backward", |c| {
        upsample_backward(c, 1, Interp::Nearest)
    }),
    ("aten::upsample_nearest2d", |c| {
        upsample(c, 2, Interp::Nearest)
    }),
    ("aten::upsample_nearest2d_backward", |c| {
        upsample_backward(c, 2, Interp::Nearest)
    }),
    ("aten::upsample_nearest3d", |c| {
        upsample(c, 3, Interp::Nearest)
    }),
    ("aten::upsample_nearest3d_backward", |c| {
        upsample_backward(c, 3, Interp::Nearest)
    }),
    ("aten::_upsample_nearest_exact1d", |c| {
        upsample(c, 1, Interp::NearestExact)
    }),
    ("aten::_upsample_nearest_exact1d_backward", |c| {
        upsample_backward(c, 1, Interp::NearestExact)
    }),
    ("aten::_upsample_nearest_exact2d", |c| {
        upsample(c, 2, Interp::NearestExact)
    }),
    ("aten::_upsample_nearest_exact2d_backward", |c| {
        upsample_backward(c, 2, Interp::NearestExact)
    }),
    ("aten::_upsample_nearest_exact3d", |c| {
        upsample(c, 3, Interp::NearestExact)
    }),
    ("aten::_upsample_nearest_exact3d_backward", |c| {
        upsample_backward(c, 3, Interp::NearestExact)
    }),
    ("aten::upsample_linear1d", |c| {
        upsample(c, 1, Interp::Linear)
    }),
    ("aten::upsample_linear1d_backward", |c| {
        upsample_backward(c, 1, Interp::Linear)
    }),
    ("aten::upsample_bilinear2d", |c| {
        upsample(c, 2, Interp::Linear)
    }),
    ("aten::upsample_bilinear2d_backward", |c| {
        upsample_backward(c, 2, Interp::Linear)
    }),
    ("aten::upsample_trilinear3d", |c| {
        upsample(c, 3, Interp::Linear)
    }),
    ("aten::upsample_trilinear3d_backward", |c| {
        upsample_backward(c, 3, Interp::Linear)
    }),
    ("aten::upsample_bicubic2d", |c| {
        upsample(c, 2, Interp::Cubic)
    }),
    ("aten::upsample_bicubic2d_backward", |c| {
        upsample_backward(c, 2, Interp::Cubic)
    }),
    ("aten::_upsample_bilinear2d_aa", |c| {
        upsample(c, 2, Interp::LinearAa)
    }),
    ("aten::_upsample_bilinear2d_aa_backward", |c| {
        upsample_backward(c, 2, Interp::LinearAa)
    }),
    ("aten::_upsample_bicubic2d_aa", |c| {
        upsample(c, 2, Interp::CubicAa)
    }),
    ("aten::_upsample_bicubic2d_aa_backward", |c| {
        upsample_backward(c, 2, Interp::CubicAa)
    }),
    ("aten::grid_sampler_2d", |c| grid_sampler(c, 2)),
    ("aten::grid_sampler_3d", |c| grid_sampler(c, 3)),
    ("aten::grid_sampler_2d_backward", |c| {
        grid_sampler_backward(c, 2)
    }),
    ("aten::grid_sampler_3d_backward", |c| {
        grid_sampler_backward(c, 3)
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
        let kinds = [
            Interp::Linear,
            Interp::Cubic,
            Interp::LinearAa,
            Interp::CubicAa,
        ];
        for ac in [false, true] {
            for kind in kinds {
                for (i, o) in [(5, 9), (9, 4)] {
                    for row in interp_matrix(kind, i, o, ac, None, true, DType::F32) {
                        assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-6);
                    }
                }
            }
        }
        let m = interp_matrix(Interp::Nearest, 3, 7, false, None, false, DType::F32);
        let src: Vec<usize> = m
            .iter()
            .map(|r| r.iter().position(|v| *v == 1.0).unwrap())
            .collect();
        assert_eq!(src, vec![0, 0, 0, 1, 1, 2, 2]);
    }

    #[test]
    fn window_helpers() {
        // Replication with crops: output j copies x[clamp(j - l, 0, n - 1)].
        assert_eq!(replicate_runs(4, -4, 5), (0, 4, 4, 5));
        assert_eq!(replicate_runs(5, 5, -4), (5, 0, 1, 0));
        assert_eq!(replicate_runs(5, 2, -1), (2, 0, 4, 0));
        assert_eq!(window_taps(2, 3, 2, 1), vec![0, 1, 2, 2, 3, 4]);
        let (k, idx, w) = sparse_rows(&[vec![0.0, 0.5, 0.5], vec![1.0, 0.0, 0.0]]);
        assert_eq!((k, idx, w), (2, vec![1, 2, 0, 0], vec![0.5, 0.5, 1.0, 0.0]));
        // bf16 keeps 8 significant bits, f16 11; ties go to even.
        assert_eq!(round_to(1.0 / 3.0, DType::BF16), 0.333984375);
        assert_eq!(round_to(1.0 + 2f64.powi(-11), DType::F16), 1.0);
        assert_eq!(
            round_to(1.0 + 3.0 * 2f64.powi(-11), DType::F16),
            1.0 + 2f64.powi(-9)
        );
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
