//! Losses, forward and backward: NLL, MSE, L1, smooth L1/Huber, binary cross-entropy (and
//! the reduction they share), multi-margin and multilabel-margin losses, CTC loss.
//!
//! NLL's CPU kernel also checks target *values* (in range); that check runs on the device
//! (`Ctx::check_index_into`).

use stablehlo::{CmpDir, ReduceKind};

use super::nn_common::*;
use super::{opmath, take_flat, take_rows};
use crate::promote::torch_name;
use crate::shape::{numel, shape_str};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};

// ---------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------

fn tensor(c: &Ctx, name: &str) -> LResult<TensorArg> {
    Ok(c.args.tensor(name)?.clone())
}

/// The `data_ptr<T>()` check of CPU kernels.
fn expect_dtype(t: &TensorArg, want: DType) -> LResult<()> {
    if t.dtype != want {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "expected scalar type {} but found {}",
                torch_name(want),
                torch_name(t.dtype)
            ),
        );
    }
    Ok(())
}

/// Float32/float64 only, as the margin-loss kernels are instantiated.
fn float_kernel(x: &TensorArg, kernel: &str) -> LResult<()> {
    match x.dtype {
        DType::F32 | DType::F64 => Ok(()),
        d => super::not_implemented(kernel, d),
    }
}

/// A 0-d or one-element tensor as a scalar value.
fn scalar_of(b: &mut Builder, v: Value) -> Value {
    b.reshape(v, &[])
}

// ---------------------------------------------------------------------------------------
// multi_margin_loss
// ---------------------------------------------------------------------------------------

/// Scales the [n, d] input gradient `gi` of a margin loss by its output gradient `g`:
/// per frame (reduction none) or one scalar; mean divides by n (loss_grad), every loss by d.
fn scale_by_grad(
    b: &mut Builder,
    g: &TensorArg,
    x: &TensorArg,
    r: i64,
    per_frame: bool,
    gi: Value,
) -> Value {
    let (n, d) = {
        let s = b.shape(gi);
        (s[0], s[1])
    };
    let gv = b.convert(g.value, x.dtype);
    let gv = if per_frame {
        b.reshape(gv, &[n])
    } else {
        scalar_of(b, gv)
    };
    let gf = loss_grad(b, gv, &[n], if per_frame { 0 } else { r });
    let dd = b.splat(gf, d as f64);
    let gf = b.div(gf, dd);
    let gfb = b.broadcast_in_dim(gf, &[n, d], &[0]);
    let gi = b.mul(gi, gfb);
    b.reshape(gi, &x.shape)
}

struct Margin {
    x: TensorArg,
    t: TensorArg,
    w: Option<TensorArg>,
    p: f64,
    margin: f64,
    r: i64,
    nframe: i64,
    dim: i64,
}

/// (nframe, dim) of a margin-loss input after PyTorch's rank check.
fn margin_frames(x: &TensorArg) -> LResult<(i64, i64)> {
    match x.shape.as_slice() {
        [] => Ok((1, 1)),
        [d] if *d != 0 => Ok((1, *d)),
        [n, d] if *d != 0 => Ok((*n, *d)),
        s => user_err(
            ErrorKind::Runtime,
            format!(
                "Expected non-empty vector or matrix with optional 0-dim batch size, but got: {}",
                shape_str(s)
            ),
        ),
    }
}

fn margin_args(c: &Ctx) -> LResult<Margin> {
    let x = tensor(c, "self")?;
    let t = tensor(c, "target")?;
    let w = c.args.opt_tensor("weight").cloned();
    let p = c.args.scalar("p")?.as_f64();
    let margin = c.args.scalar("margin")?.as_f64();
    let r = reduction(c)?;
    if p != 1.0 && p != 2.0 {
        return user_err(ErrorKind::Runtime, "only p == 1 and p == 2 supported");
    }
    let (nframe, dim) = margin_frames(&x)?;
    if t.shape.len() > 1 || numel(&t.shape) != nframe {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "multi_margin_loss: target tensor should be 1-D with size equal to the number of input samples (batch size). Expected target size [{nframe}], but got {}. Input has shape {}.",
                shape_str(&t.shape),
                shape_str(&x.shape)
            ),
        );
    }
    if let Some(w) = &w {
        if w.shape.len() > 1 || numel(&w.shape) != dim {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "inconsistent weight size, expected {dim} but got {}",
                    shape_str(&w.shape)
                ),
            );
        }
    }
    if nframe == 0 && r != 0 {
        // The CPU returns an uninitialized scalar here.
        return decline("multi_margin_loss: reduced loss over an empty batch");
    }
    float_kernel(&x, "multi_margin_loss_cpu_kernel")?;
    expect_dtype(&t, DType::I64)?;
    if let Some(w) = &w {
        expect_dtype(w, x.dtype)?;
    }
    Ok(Margin {
        x,
        t,
        w,
        p,
        margin,
        r,
        nframe,
        dim,
    })
}

/// Per (frame, class): the hinge `margin - x[y] + x[i]` where it is positive and i != y
/// (else 0), the class one-hot of the target, and the target's weight per frame.
fn margin_terms(b: &mut Builder, m: &Margin) -> (Value, Value, Value) {
    let (n, d) = (m.nframe, m.dim);
    let x = b.reshape(m.x.value, &[n, d]);
    let t = b.reshape(m.t.value, &[n]);
    let tb = b.broadcast_in_dim(t, &[n, d], &[0]);
    let cls = b.iota(DType::I64, &[n, d], 1);
    let onehot = b.compare(tb, cls, CmpDir::Eq);
    let picked = mask(b, onehot, x);
    let xt = b.reduce(picked, &[1], ReduceKind::Sum);
    let xtb = b.broadcast_in_dim(xt, &[n, d], &[0]);
    let k = b.full(m.x.dtype, &[n, d], m.margin);
    let z = b.sub(k, xtb);
    let z = b.add(z, x);
    let zero = b.splat(z, 0.0);
    let pos = b.compare(z, zero, CmpDir::Gt);
    let other = b.not(onehot);
    let active = b.and(pos, other);
    let z = b.select(active, z, zero);
    let wt = match &m.w {
        Some(w) => {
            let wv = b.reshape(w.value, &[d]);
            let wb = b.broadcast_in_dim(wv, &[n, d], &[1]);
            let sel = mask(b, onehot, wb);
            b.reduce(sel, &[1], ReduceKind::Sum)
        }
        None => b.full(m.x.dtype, &[n], 1.0),
    };
    (z, onehot, wt)
}

fn multi_margin_loss(c: &mut Ctx) -> LResult<Vec<Out>> {
    let m = margin_args(c)?;
    let b = &mut *c.b;
    let (n, d) = (m.nframe, m.dim);
    if n == 0 {
        return Ok(vec![Out::T(b.full(m.x.dtype, &[0], 0.0))]);
    }
    let (z, _, wt) = margin_terms(b, &m);
    let h = if m.p == 2.0 { b.mul(z, z) } else { z };
    let s = b.reduce(h, &[1], ReduceKind::Sum);
    let s = b.mul(s, wt);
    let dd = b.splat(s, d as f64);
    let per = b.div(s, dd);
    let l = if m.r == 0 {
        b.reshape(per, &m.t.shape)
    } else {
        reduce_loss(b, per, m.r)
    };
    Ok(vec![Out::T(l)])
}

fn multi_margin_loss_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let m = margin_args(c)?;
    let g = tensor(c, "grad_output")?;
    let b = &mut *c.b;
    let (n, d) = (m.nframe, m.dim);
    if n == 0 {
        return Ok(vec![Out::T(b.full(m.x.dtype, &m.x.shape, 0.0))]);
    }
    let per_frame = m.r == 0 && !g.shape.is_empty();
    if (per_frame && numel(&g.shape) != n) || (!per_frame && numel(&g.shape) != 1) {
        return decline("multi_margin_loss_backward: grad_output shape");
    }
    let (z, onehot, wt) = margin_terms(b, &m);
    // d loss / d x[i] = w[y] * (1 or 2z) / dim for active i; x[y] gets minus their sum.
    let zero = b.splat(z, 0.0);
    let active = b.compare(z, zero, CmpDir::Gt);
    let h = if m.p == 2.0 {
        let two = b.splat(z, 2.0);
        b.mul(two, z)
    } else {
        let one = b.splat(z, 1.0);
        b.select(active, one, zero)
    };
    let wb = b.broadcast_in_dim(wt, &[n, d], &[0]);
    let h = b.mul(h, wb);
    let tot = b.reduce(h, &[1], ReduceKind::Sum);
    let totb = b.broadcast_in_dim(tot, &[n, d], &[0]);
    let neg = b.neg(totb);
    let gi = b.select(onehot, neg, h);
    Ok(vec![Out::T(scale_by_grad(b, &g, &m.x, m.r, per_frame, gi))])
}

// ---------------------------------------------------------------------------------------
// multilabel_margin_loss
// ---------------------------------------------------------------------------------------

struct Multilabel {
    x: TensorArg,
    t: TensorArg,
    r: i64,
    nframe: i64,
    dim: i64,
}

fn multilabel_args(c: &Ctx) -> LResult<Multilabel> {
    let x = tensor(c, "self")?;
    let t = tensor(c, "target")?;
    let r = reduction(c)?;
    let (nframe, dim) = margin_frames(&x)?;
    let ok = if x.shape.len() <= 1 {
        t.shape.len() <= 1 && numel(&t.shape) == dim
    } else {
        t.shape == x.shape
    };
    if !ok {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "inconsistent target size: {} for input of size: {}",
                shape_str(&t.shape),
                shape_str(&x.shape)
            ),
        );
    }
    if nframe == 0 && r != 0 {
        // The CPU returns an uninitialized scalar here.
        return decline("multilabel_margin_loss: reduced loss over an empty batch");
    }
    float_kernel(&x, "multilabel_margin_loss_forward_out_frame")?;
    expect_dtype(&t, DType::I64)?;
    Ok(Multilabel {
        x,
        t,
        r,
        nframe,
        dim,
    })
}

/// [n, k, c] masks: `hit[n, k, c]` = target k of frame n is class c and comes before the
/// first negative target; `valid[n, k]` = target k comes before the first negative one.
fn multilabel_targets(b: &mut Builder, m: &Multilabel) -> (Value, Value) {
    let (n, d) = (m.nframe, m.dim);
    let t = b.reshape(m.t.value, &[n, d]);
    let z = b.splat(t, 0.0);
    let nonneg = b.compare(t, z, CmpDir::Ge);
    let valid = super::reduce::scan(b, nonneg, 1, ReduceKind::And);
    let tb = b.broadcast_in_dim(t, &[n, d, d], &[0, 1]);
    let cls = b.iota(DType::I64, &[n, d, d], 2);
    let eq = b.compare(tb, cls, CmpDir::Eq);
    let vb = b.broadcast_in_dim(valid, &[n, d, d], &[0, 1]);
    (b.and(eq, vb), valid)
}

/// The active hinges `1 - x[t_k] + x[c]` (k a valid target, c not a target), else 0.
fn multilabel_hinges(
    b: &mut Builder,
    m: &Multilabel,
    hit: Value,
    valid: Value,
    is_t: Value,
) -> Value {
    let (n, d) = (m.nframe, m.dim);
    let x = b.reshape(m.x.value, &[n, d]);
    let xb = b.broadcast_in_dim(x, &[n, d, d], &[0, 2]);
    let picked = mask(b, hit, xb);
    let xt = b.reduce(picked, &[2], ReduceKind::Sum);
    let xtb = b.broadcast_in_dim(xt, &[n, d, d], &[0, 1]);
    let one = b.splat(xb, 1.0);
    let z = b.sub(one, xtb);
    let z = b.add(z, xb);
    let zero = b.splat(z, 0.0);
    let pos = b.compare(z, zero, CmpDir::Gt);
    let not_t = b.not(is_t);
    let ntb = b.broadcast_in_dim(not_t, &[n, d, d], &[0, 2]);
    let vb = b.broadcast_in_dim(valid, &[n, d, d], &[0, 1]);
    let act = b.and(pos, ntb);
    let act = b.and(act, vb);
    b.select(act, z, zero)
}

fn multilabel_margin_loss_forward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let m = multilabel_args(c)?;
    let b = &mut *c.b;
    let (n, d) = (m.nframe, m.dim);
    let out_shape: Vec<i64> = if m.x.shape.len() == 2 {
        vec![n]
    } else {
        vec![]
    };
    if n == 0 {
        return Ok(vec![
            Out::T(b.full(m.x.dtype, &[0], 0.0)),
            Out::T(b.full(m.x.dtype, &m.t.shape, 0.0)),
        ]);
    }
    let (hit, valid) = multilabel_targets(b, &m);
    let is_t = b.reduce(hit, &[1], ReduceKind::Or);
    let z = multilabel_hinges(b, &m, hit, valid, is_t);
    let s = b.reduce(z, &[1, 2], ReduceKind::Sum);
    let dd = b.splat(s, d as f64);
    let per = b.div(s, dd);
    let l = if m.r == 0 {
        b.reshape(per, &out_shape)
    } else {
        reduce_loss(b, per, m.r)
    };
    let is_t = b.convert(is_t, m.x.dtype);
    Ok(vec![Out::T(l), Out::T(b.reshape(is_t, &m.t.shape))])
}

fn multilabel_margin_loss_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let m = multilabel_args(c)?;
    let g = tensor(c, "grad_output")?;
    let it = tensor(c, "is_target")?;
    let b = &mut *c.b;
    let (n, d) = (m.nframe, m.dim);
    if n == 0 {
        return Ok(vec![Out::T(b.full(m.x.dtype, &m.x.shape, 0.0))]);
    }
    let per_frame = m.r == 0 && !g.shape.is_empty();
    if numel(&it.shape) != n * d
        || (per_frame && numel(&g.shape) != n)
        || (!per_frame && numel(&g.shape) != 1)
    {
        return decline("multilabel_margin_loss_backward: argument shapes");
    }
    let (hit, valid) = multilabel_targets(b, &m);
    let is_t = b.reshape(it.value, &[n, d]);
    let is_t = b.convert(is_t, DType::Bool);
    let z = multilabel_hinges(b, &m, hit, valid, is_t);
    let zero = b.splat(z, 0.0);
    let act = b.compare(z, zero, CmpDir::Gt);
    let one = b.splat(z, 1.0);
    let a = b.select(act, one, zero);
    // Each active hinge adds to x[c] and subtracts from x[t_k].
    let plus = b.reduce(a, &[1], ReduceKind::Sum);
    let per_k = b.reduce(a, &[2], ReduceKind::Sum);
    let pkb = b.broadcast_in_dim(per_k, &[n, d, d], &[0, 1]);
    let minus = mask(b, hit, pkb);
    let minus = b.reduce(minus, &[1], ReduceKind::Sum);
    let gi = b.sub(plus, minus);
    Ok(vec![Out::T(scale_by_grad(b, &g, &m.x, m.r, per_frame, gi))])
}

// ---------------------------------------------------------------------------------------
// CTC loss
// ---------------------------------------------------------------------------------------

/// `_ctc_loss` arguments with the lengths known at lowering time (the `int[]` overloads;
/// PyTorch's `ctc_loss` moves tensor lengths to the host before it calls them).
struct Ctc {
    lp: TensorArg,
    tg: TensorArg,
    il: Vec<i64>,
    tl: Vec<i64>,
    blank: i64,
    zero_inf: bool,
    /// Time steps, batch, classes and extended target length (2 * max target + 1).
    t: i64,
    n: i64,
    cls: i64,
    sp: i64,
}

fn ctc_args(c: &Ctx) -> LResult<Ctc> {
    let lp = tensor(c, "log_probs")?;
    let tg = tensor(c, "targets")?;
    let (Ok(il), Ok(tl)) = (c.args.ints("input_lengths"), c.args.ints("target_lengths")) else {
        return decline("_ctc_loss with tensor lengths");
    };
    let blank = c.args.int_or("blank", 0);
    let zero_inf = c.args.bool_or("zero_infinity", false);
    float_kernel(&lp, "ctc_loss_cpu")?;
    if numel(&lp.shape) == 0 {
        return user_err(ErrorKind::Runtime, "log_probs tensor must not be empty");
    }
    if !matches!(tg.dtype, DType::I64 | DType::I32) {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected tensor for argument #2 'targets' to have scalar type Int; but got {} instead (while checking arguments for ctc_loss_allocate_outputs)",
                tensor_type_name(tg.dtype)
            ),
        );
    }
    if lp.shape.len() != 3 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected 3-dimensional tensor, but got {}-dimensional tensor for argument #1 'log_probs' (while checking arguments for ctc_loss_allocate_outputs)",
                lp.shape.len()
            ),
        );
    }
    if !(1..=2).contains(&tg.shape.len()) {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected 1 to 2 dimensions, but got {}-dimensional tensor for argument #2 'targets' (while checking arguments for ctc_loss_allocate_outputs)",
                tg.shape.len()
            ),
        );
    }
    let (t, n, cls) = (lp.shape[0], lp.shape[1], lp.shape[2]);
    if blank < 0 || blank >= cls {
        return user_err(ErrorKind::Runtime, "blank must be in label range");
    }
    if il.len() as i64 != n {
        return user_err(
            ErrorKind::Runtime,
            "input_lengths must be of size batch_size",
        );
    }
    if tl.len() as i64 != n {
        return user_err(
            ErrorKind::Runtime,
            "target_lengths must be of size batch_size",
        );
    }
    let size_err = |dim: usize, want: i64| {
        user_err::<()>(
            ErrorKind::Runtime,
            format!(
                "Expected tensor to have size {want} at dimension {dim}, but got size {} for argument #2 'targets' (while checking arguments for ctc_loss_allocate_outputs)",
                tg.shape[dim]
            ),
        )
    };
    for v in &tl {
        if *v < 0 {
            return user_err(
                ErrorKind::Runtime,
                format!("Expected target_lengths to have value at least 0, but got value {v} (while checking arguments for ctc_loss_allocate_outputs)"),
            );
        }
    }
    let max_tl = tl.iter().copied().max().unwrap_or(0);
    if tg.shape.len() == 1 {
        let total: i64 = tl.iter().sum();
        if tg.shape[0] != total {
            size_err(0, total)?;
        }
    } else {
        if tg.shape[0] != n {
            size_err(0, n)?;
        }
        if tg.shape[1] < max_tl {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "Expected tensor to have size at least {max_tl} at dimension 1, but got size {} for argument #2 'targets' (while checking arguments for ctc_loss_allocate_outputs)",
                    tg.shape[1]
                ),
            );
        }
    }
    for v in &il {
        if *v < 0 {
            return user_err(
                ErrorKind::Runtime,
                format!("Expected input_lengths to have value at least 0, but got value {v} (while checking arguments for ctc_loss_allocate_outputs)"),
            );
        }
        if *v > t {
            return user_err(
                ErrorKind::Runtime,
                format!("Expected input_lengths to have value at most {t}, but got value {v} (while checking arguments for ctc_loss_allocate_outputs)"),
            );
        }
    }
    Ok(Ctc {
        lp,
        tg,
        il,
        tl,
        blank,
        zero_inf,
        t,
        n,
        cls,
        sp: 2 * max_tl + 1,
    })
}

/// Per-batch constants `vals[n]` broadcast along dim 0 of `shape`.
fn per_batch(b: &mut Builder, vals: &[i64], shape: &[i64]) -> Value {
    let v = b.constant_vec_i64(vals);
    b.broadcast_in_dim(v, shape, &[0])
}

/// log(exp(a) + exp(b) + exp(c)), 0-safe when all are -inf (the CPU kernel's form).
fn log_sum_exp(b: &mut Builder, xs: &[Value]) -> Value {
    let mut m = xs[0];
    for x in &xs[1..] {
        m = b.max(m, *x);
    }
    let ninf = b.splat(m, f64::NEG_INFINITY);
    let is_inf = b.compare(m, ninf, CmpDir::Eq);
    let z = b.splat(m, 0.0);
    let m = b.select(is_inf, z, m);
    let mut s = z;
    for x in xs {
        let d = b.sub(*x, m);
        let e = b.exp(d);
        s = b.add(s, e);
    }
    let l = b.log(s);
    b.add(l, m)
}

/// `x` [n, s] moved `k` places along s (right for k > 0), -inf filling the gap.
fn shift(b: &mut Builder, x: Value, k: i64) -> Value {
    let sh = b.shape(x);
    let (n, sp) = (sh[0], sh[1]);
    if k.abs() >= sp {
        return b.full(b.dtype(x), &sh, f64::NEG_INFINITY);
    }
    let fill = b.full(b.dtype(x), &[n, k.abs()], f64::NEG_INFINITY);
    if k > 0 {
        let keep = b.slice_dim(x, 1, 0, sp - k, 1);
        b.concatenate(&[fill, keep], 1)
    } else {
        let keep = b.slice_dim(x, 1, -k, sp, 1);
        b.concatenate(&[keep, fill], 1)
    }
}

/// Per-step constants of the CTC recursions.
struct CtcPlan {
    /// [n, s'] blank-interleaved targets.
    ext: Value,
    /// [n * s'] flat indices of each (n, ext[n, s]) in a [n, c] step of log_probs.
    eidx: Value,
    /// [n, s']: s < 2 * target_length + 1.
    valid: Value,
    /// [n, s']: the skip transition from s - 2 is allowed.
    skip: Value,
}

fn ctc_plan(b: &mut Builder, k: &Ctc) -> CtcPlan {
    let (n, sp, cls) = (k.n, k.sp, k.cls);
    let shape = [n, sp];
    // Flat index into targets of label (s - 1) / 2 of each batch entry (0 where unused).
    let mut offs = Vec::with_capacity(k.n as usize);
    let mut pos = 0;
    for v in &k.tl {
        offs.push(pos);
        pos += v;
    }
    let mut idx = Vec::with_capacity((n * sp) as usize);
    for (bi, tl) in k.tl.iter().enumerate() {
        for s in 0..sp {
            let j = s / 2;
            let i = if s % 2 == 1 && j < *tl {
                if k.tg.shape.len() == 1 {
                    offs[bi] + j
                } else {
                    bi as i64 * k.tg.shape[1] + j
                }
            } else {
                0
            };
            idx.push(i);
        }
    }
    let blank = b.full(DType::I64, &shape, k.blank as f64);
    let ext = if numel(&k.tg.shape) == 0 {
        blank
    } else {
        let iv = b.constant_vec_i64(&idx);
        let iv = b.reshape(iv, &shape);
        let lab = take_flat(b, k.tg.value, iv);
        let lab = b.convert(lab, DType::I64);
        let s = b.iota(DType::I64, &shape, 1);
        let two = b.splat(s, 2.0);
        let r = b.binary("stablehlo.remainder", s, two);
        let one = b.splat(r, 1.0);
        let odd = b.compare(r, one, CmpDir::Eq);
        b.select(odd, lab, blank)
    };
    let row = b.iota(DType::I64, &shape, 0);
    let cv = b.splat(row, cls as f64);
    let base = b.mul(row, cv);
    let eidx = b.add(base, ext);
    let eidx = b.reshape(eidx, &[n * sp]);
    let s = b.iota(DType::I64, &shape, 1);
    let lim: Vec<i64> = k.tl.iter().map(|v| 2 * v + 1).collect();
    let limb = per_batch(b, &lim, &shape);
    let valid = b.compare(s, limb, CmpDir::Lt);
    let skip = if sp > 2 {
        let prev = b.slice_dim(ext, 1, 0, sp - 2, 1);
        let cur = b.slice_dim(ext, 1, 2, sp, 1);
        let ne = b.compare(cur, prev, CmpDir::Ne);
        let no = b.full(DType::Bool, &[n, 2], 0.0);
        b.concatenate(&[no, ne], 1)
    } else {
        b.full(DType::Bool, &shape, 0.0)
    };
    CtcPlan {
        ext,
        eidx,
        valid,
        skip,
    }
}

/// log_probs[t] at each (n, ext[n, s]): [n, s'].
fn ctc_emit(b: &mut Builder, k: &Ctc, p: &CtcPlan, t: Value) -> Value {
    let z = b.constant_i64(DType::I64, 0);
    let step = b.dynamic_slice(k.lp.value, &[t, z, z], &[1, k.n, k.cls]);
    let flat = b.reshape(step, &[k.n * k.cls]);
    let e = take_rows(b, flat, p.eidx);
    b.reshape(e, &[k.n, k.sp])
}

/// The forward recursion: (alpha at each sequence's last step [n, s'], log_alpha [n, t, s']).
fn ctc_alpha(b: &mut Builder, k: &Ctc, p: &CtcPlan) -> (Value, Value) {
    let dt = k.lp.dtype;
    let (t_len, n, sp) = (k.t, k.n, k.sp);
    let shape = [n, sp];
    let ninf = b.full(dt, &shape, f64::NEG_INFINITY);
    let la0 = b.full(dt, &[n, t_len, sp], f64::NEG_INFINITY);
    if t_len == 0 {
        return (ninf, la0);
    }
    let z = b.constant_i64(DType::I64, 0);
    let e0 = ctc_emit(b, k, p, z);
    let s = b.iota(DType::I64, &shape, 1);
    let one = b.splat(s, 1.0);
    let first = b.compare(s, one, CmpDir::Le);
    let first = b.and(first, p.valid);
    let a0 = b.select(first, e0, ninf);
    let a03 = b.reshape(a0, &[n, 1, sp]);
    let la = b.dynamic_update_slice(la0, a03, &[z, z, z]);
    let ilb = per_batch(b, &k.il, &shape);
    let one = b.constant_i64(DType::I64, 1);
    let out = b.while_loop(
        &[one, a0, la],
        |b, v| {
            let lim = b.constant_i64(DType::I64, t_len);
            b.compare(v[0], lim, CmpDir::Lt)
        },
        |b, v| {
            let (t, prev, la) = (v[0], v[1], v[2]);
            let e = ctc_emit(b, k, p, t);
            let ni = b.splat(prev, f64::NEG_INFINITY);
            let a2 = shift(b, prev, 1);
            let a3 = shift(b, prev, 2);
            let a3 = b.select(p.skip, a3, ni);
            let r = log_sum_exp(b, &[prev, a2, a3]);
            let r = b.add(r, e);
            let r = b.select(p.valid, r, ni);
            let tb = b.broadcast_in_dim(t, &[n, sp], &[]);
            let active = b.compare(tb, ilb, CmpDir::Lt);
            let next = b.select(active, r, prev);
            let row = b.select(active, r, ni);
            let row = b.reshape(row, &[n, 1, sp]);
            let z = b.constant_i64(DType::I64, 0);
            let la = b.dynamic_update_slice(la, row, &[z, t, z]);
            let one = b.constant_i64(DType::I64, 1);
            vec![b.add(t, one), next, la]
        },
    );
    (out[1], out[2])
}

fn ctc_loss(c: &mut Ctx) -> LResult<Vec<Out>> {
    let k = ctc_args(c)?;
    let b = &mut *c.b;
    let (n, sp) = (k.n, k.sp);
    let p = ctc_plan(b, &k);
    let (alpha, la) = ctc_alpha(b, &k, &p);
    // -log(exp(alpha[2 tl]) + exp(alpha[2 tl - 1])); an empty input scores 0 for an empty
    // target and -inf otherwise, as on the CPU.
    let last: Vec<i64> = (0..n).map(|i| i * sp + 2 * k.tl[i as usize]).collect();
    let prev: Vec<i64> = (0..n)
        .map(|i| i * sp + (2 * k.tl[i as usize] - 1).max(0))
        .collect();
    let li = b.constant_vec_i64(&last);
    let pi = b.constant_vec_i64(&prev);
    let l1 = take_flat(b, alpha, li);
    let l2 = take_flat(b, alpha, pi);
    let has_t: Vec<i64> = k.tl.iter().map(|v| (*v > 0) as i64).collect();
    let ht = b.constant_vec_i64(&has_t);
    let zi = b.splat(ht, 0.0);
    let ht = b.compare(ht, zi, CmpDir::Ne);
    let ni = b.splat(l2, f64::NEG_INFINITY);
    let l2 = b.select(ht, l2, ni);
    let ll = log_sum_exp(b, &[l1, l2]);
    let nll = b.neg(ll);
    let empty: Vec<i64> = k.il.iter().map(|v| (*v == 0) as i64).collect();
    let em = b.constant_vec_i64(&empty);
    let em = b.compare(em, zi, CmpDir::Ne);
    let inf = b.splat(nll, f64::INFINITY);
    let nz = b.splat(nll, -0.0);
    let e = b.select(ht, inf, nz);
    let nll = b.select(em, e, nll);
    Ok(vec![Out::T(nll), Out::T(la)])
}

fn ctc_loss_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let k = ctc_args(c)?;
    let g = tensor(c, "grad")?;
    let nll = tensor(c, "neg_log_likelihood")?;
    let la = tensor(c, "log_alpha")?;
    let (t_len, n, sp, cls) = (k.t, k.n, k.sp, k.cls);
    if g.shape != [n] || nll.shape != [n] || la.shape != [n, t_len, sp] {
        return decline("_ctc_loss_backward: argument shapes");
    }
    let b = &mut *c.b;
    let dt = k.lp.dtype;
    if t_len == 0 || n == 0 || cls == 0 {
        return Ok(vec![Out::T(b.full(dt, &k.lp.shape, 0.0))]);
    }
    let p = ctc_plan(b, &k);
    let shape = [n, sp];
    let ilb = per_batch(b, &k.il, &shape);
    let one_i = b.splat(ilb, 1.0);
    let last_t = b.sub(ilb, one_i);
    let lim: Vec<i64> = k.tl.iter().map(|v| 2 * v).collect();
    let end = per_batch(b, &lim, &shape);
    let s = b.iota(DType::I64, &shape, 1);
    let at_end = b.compare(s, end, CmpDir::Eq);
    let one = b.splat(end, 1.0);
    let end1 = b.sub(end, one);
    let before_end = b.compare(s, end1, CmpDir::Eq);
    let s0 = b.splat(s, 0.0);
    let pos = b.compare(s, s0, CmpDir::Gt);
    let before_end = b.and(before_end, pos);
    let start = b.or(at_end, before_end);
    // Skip transitions seen from s: s + 2 -> s.
    let skip_from = if sp > 2 {
        let tail = b.slice_dim(p.skip, 1, 2, sp, 1);
        let no = b.full(DType::Bool, &[n, 2], 0.0);
        b.concatenate(&[tail, no], 1)
    } else {
        b.full(DType::Bool, &shape, 0.0)
    };
    // The backward recursion, from each sequence's last step down to 0.
    let beta0 = b.full(dt, &shape, f64::NEG_INFINITY);
    let betas0 = b.full(dt, &[n, t_len, sp], f64::NEG_INFINITY);
    let t0 = b.constant_i64(DType::I64, t_len - 1);
    let out = b.while_loop(
        &[t0, beta0, betas0],
        |b, v| {
            let z = b.constant_i64(DType::I64, 0);
            b.compare(v[0], z, CmpDir::Ge)
        },
        |b, v| {
            let (t, prev, betas) = (v[0], v[1], v[2]);
            let e = ctc_emit(b, &k, &p, t);
            let ni = b.splat(prev, f64::NEG_INFINITY);
            let b2 = shift(b, prev, -1);
            let b3 = shift(b, prev, -2);
            let b3 = b.select(skip_from, b3, ni);
            let r = log_sum_exp(b, &[prev, b2, b3]);
            let r = b.add(r, e);
            let tb = b.broadcast_in_dim(t, &shape, &[]);
            let is_last = b.compare(tb, last_t, CmpDir::Eq);
            let inside = b.compare(tb, last_t, CmpDir::Lt);
            let init = b.select(start, e, ni);
            let r = b.select(inside, r, ni);
            let beta = b.select(is_last, init, r);
            let beta = b.select(p.valid, beta, ni);
            let row = b.reshape(beta, &[n, 1, sp]);
            let z = b.constant_i64(DType::I64, 0);
            let betas = b.dynamic_update_slice(betas, row, &[z, t, z]);
            let one = b.constant_i64(DType::I64, 1);
            vec![b.sub(t, one), beta, betas]
        },
    );
    let betas = out[2];
    // alpha + beta where both are defined (t < input length, s <= 2 * target length).
    let big = [n, t_len, sp];
    let tt = b.iota(DType::I64, &big, 1);
    let ilt = per_batch(b, &k.il, &big);
    let live_t = b.compare(tt, ilt, CmpDir::Lt);
    let vb = b.broadcast_in_dim(p.valid, &big, &[0, 2]);
    let ok = b.and(live_t, vb);
    let lav = b.convert(la.value, dt);
    let ni3 = b.full(dt, &big, f64::NEG_INFINITY);
    let lav = b.select(ok, lav, ni3);
    let ab = b.add(lav, betas);
    // At the last step the CPU kernel sets the last label's entry instead of adding to it
    // (assuming it differs from the blank), so a blank label there drops the blank's term.
    let prev_end: Vec<i64> = (0..n)
        .map(|i| i * sp + (2 * k.tl[i as usize] - 1).max(0))
        .collect();
    let pe = b.constant_vec_i64(&prev_end);
    let last_lab = take_flat(b, p.ext, pe);
    let lab_b = b.broadcast_in_dim(last_lab, &shape, &[0]);
    let bl = b.splat(lab_b, k.blank as f64);
    let lab_blank = b.compare(lab_b, bl, CmpDir::Eq);
    let has_lab = b.compare(end, s0, CmpDir::Gt);
    let quirk = b.and(at_end, lab_blank);
    let quirk = b.and(quirk, has_lab);
    let qb = b.broadcast_in_dim(quirk, &big, &[0, 2]);
    let ltb = b.broadcast_in_dim(last_t, &big, &[0, 2]);
    let at_last = b.compare(tt, ltb, CmpDir::Eq);
    let drop = b.and(qb, at_last);
    let ab = b.select(drop, ni3, ab);
    // Per class, log-add alpha + beta over s in descending order, one s at a time, as
    // the CPU kernel does (the rounding of this sum decides the gradient's last digits).
    let cbig = [n, t_len, cls];
    let lc0 = b.full(dt, &cbig, f64::NEG_INFINITY);
    let ci = b.iota(DType::I64, &cbig, 2);
    let endn: Vec<i64> = k.tl.iter().map(|v| 2 * v).collect();
    let endn = b.constant_vec_i64(&endn);
    let s_top = b.constant_i64(DType::I64, sp - 1);
    let acc = b.while_loop(
        &[s_top, lc0],
        |b, v| {
            let z = b.constant_i64(DType::I64, 0);
            b.compare(v[0], z, CmpDir::Ge)
        },
        |b, v| {
            let (si, cur) = (v[0], v[1]);
            let z = b.constant_i64(DType::I64, 0);
            let col = b.dynamic_slice(ab, &[z, z, si], &[n, t_len, 1]);
            let col = b.reshape(col, &[n, t_len]);
            let lab = b.dynamic_slice(p.ext, &[z, si], &[n, 1]);
            let lab = b.reshape(lab, &[n]);
            let sv = b.broadcast_in_dim(si, &[n], &[]);
            let in_s = b.compare(sv, endn, CmpDir::Le);
            let labb = b.broadcast_in_dim(lab, &cbig, &[0]);
            let hit = b.compare(ci, labb, CmpDir::Eq);
            let inb = b.broadcast_in_dim(in_s, &cbig, &[0]);
            let hit = b.and(hit, inb);
            let vv = b.broadcast_in_dim(col, &cbig, &[0, 1]);
            let m = b.max(cur, vv);
            let d1 = b.sub(cur, m);
            let d2 = b.sub(vv, m);
            let e1 = b.exp(d1);
            let e2 = b.exp(d2);
            let sum = b.add(e1, e2);
            let l = b.log(sum);
            let l = b.add(l, m);
            let ni = b.splat(cur, f64::NEG_INFINITY);
            let empty = b.compare(cur, ni, CmpDir::Eq);
            let new = b.select(empty, vv, l);
            let next = b.select(hit, new, cur);
            let one = b.constant_i64(DType::I64, 1);
            vec![b.sub(si, one), next]
        },
    );
    let lcab = acc[1];
    // grad = (exp(lp) - exp(lcab + nll - lp)) * grad_out, zero past each input length.
    let lpt = b.transpose(k.lp.value, &[1, 0, 2]);
    let nv = b.convert(nll.value, dt);
    let nb = b.broadcast_in_dim(nv, &cbig, &[0]);
    let q = b.add(lcab, nb);
    let q = b.sub(q, lpt);
    let q = b.exp(q);
    let elp = b.exp(lpt);
    let gr = b.sub(elp, q);
    let gv = b.convert(g.value, dt);
    let gb = b.broadcast_in_dim(gv, &cbig, &[0]);
    let gr = b.mul(gr, gb);
    let tc = b.iota(DType::I64, &cbig, 1);
    let ilc = per_batch(b, &k.il, &cbig);
    let mut live = b.compare(tc, ilc, CmpDir::Lt);
    if k.zero_inf {
        let inf = b.splat(nb, f64::INFINITY);
        let fin = b.compare(nb, inf, CmpDir::Ne);
        live = b.and(live, fin);
    }
    let gr = mask(b, live, gr);
    Ok(vec![Out::T(b.transpose(gr, &[1, 0, 2]))])
}

// ---------------------------------------------------------------------------------------
// Pointwise losses, NLL, binary cross-entropy and their shared reduction
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

pub(super) fn nll_loss(c: &mut Ctx, two_d: bool) -> LResult<Vec<Out>> {
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
    // Against the real class count: a padded program (shape buckets) sees its bound.
    c.check_index_into(
        checked,
        x.value,
        cd,
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

/// NLL (forward and backward) serves a range of sizes (shape buckets): the batch of a
/// language model's loss grows with the sequence length.
pub const SERVES_SIZES: &[&str] = &["aten::nll_loss_forward", "aten::nll_loss_backward"];

pub const RULES: &[(&str, Rule)] = &[
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
    ("aten::multi_margin_loss", multi_margin_loss),
    (
        "aten::multi_margin_loss_backward",
        multi_margin_loss_backward,
    ),
    (
        "aten::multilabel_margin_loss_forward",
        multilabel_margin_loss_forward,
    ),
    (
        "aten::multilabel_margin_loss_backward",
        multilabel_margin_loss_backward,
    ),
    ("aten::_ctc_loss", ctc_loss),
    ("aten::_ctc_loss_backward", ctc_loss_backward),
];
