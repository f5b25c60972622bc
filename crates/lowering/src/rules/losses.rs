//! Losses and loss-like bag ops, forward and backward: NLL, MSE, L1, smooth L1/Huber,
//! binary cross-entropy (and the reduction they share), multi-margin and multilabel-margin
//! losses, CTC loss, embedding bags and segment reductions.
//!
//! Their CPU kernels also check index *values* (targets in range, offsets starting at 0,
//! lengths summing to the data size); those checks need the data on the host, so here
//! out-of-range indices select nothing instead of raising.

use stablehlo::{CmpDir, ReduceKind};

use super::nn_common::*;
use super::{opmath, scatter_rows, take_flat, take_rows};
use crate::promote::{promote_types, torch_name};
use crate::shape::{numel, shape_str, wrap_dim};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};

// ---------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------

fn tensor(c: &Ctx, name: &str) -> LResult<TensorArg> {
    Ok(c.args.tensor(name)?.clone())
}

/// PyTorch's error for a kernel without an instance for `d`.
fn not_implemented<T>(kernel: &str, d: DType) -> LResult<T> {
    user_err(
        ErrorKind::NotImplemented,
        format!("\"{kernel}\" not implemented for '{}'", torch_name(d)),
    )
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
        d => not_implemented(kernel, d),
    }
}

/// The group of each of `n` positions, given the (sorted) start of every group but the
/// first: `#{s : starts[s] <= i}`. `starts` may be empty.
fn group_of(b: &mut Builder, starts: Value, n: i64) -> Value {
    let k = b.shape(starts)[0];
    if k == 0 {
        return b.full(DType::I64, &[n], 0.0);
    }
    let s = b.convert(starts, DType::I64);
    let sb = b.broadcast_in_dim(s, &[k, n], &[0]);
    let pos = b.iota(DType::I64, &[k, n], 1);
    let le = b.compare(sb, pos, CmpDir::Le);
    let ones = b.convert(le, DType::I64);
    b.reduce(ones, &[0], ReduceKind::Sum)
}

/// `x` with zeros where `keep` is false.
fn mask(b: &mut Builder, keep: Value, x: Value) -> Value {
    let z = b.splat(x, 0.0);
    b.select(keep, x, z)
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
// Embedding bags
// ---------------------------------------------------------------------------------------

const MODE_SUM: i64 = 0;
const MODE_MEAN: i64 = 1;
const MODE_MAX: i64 = 2;

fn tensor_type_name(d: DType) -> String {
    format!("torch.{}Tensor", torch_name(d))
}

fn check_index_dtype(t: &TensorArg, name: &str) -> LResult<()> {
    if !matches!(t.dtype, DType::I64 | DType::I32) {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected tensor for argument #1 '{name}' to have one of the following scalar types: Long, Int; but got {} instead (while checking arguments for embedding_bag)",
                tensor_type_name(t.dtype)
            ),
        );
    }
    Ok(())
}

/// `idx[i] != padding_idx` (all true without a padding index).
fn not_padding(b: &mut Builder, idx: Value, padding_idx: i64) -> Value {
    let n = b.shape(idx)[0];
    if padding_idx < 0 {
        return b.full(DType::Bool, &[n], 1.0);
    }
    let i = b.convert(idx, DType::I64);
    let p = b.splat(i, padding_idx as f64);
    b.compare(i, p, CmpDir::Ne)
}

/// The bag of each index: `offset2bag` when it has one entry per index, else recomputed
/// from `offsets` as the CPU backward does.
fn bags_of(
    b: &mut Builder,
    offset2bag: &TensorArg,
    offsets: Option<&TensorArg>,
    n: i64,
) -> LResult<Value> {
    if offset2bag.shape == [n] {
        return Ok(b.convert(offset2bag.value, DType::I64));
    }
    match offsets {
        Some(o) if o.shape.len() == 1 => {
            let m = o.shape[0];
            let rest = b.slice_dim(o.value, 0, 1.min(m), m, 1);
            Ok(group_of(b, rest, n))
        }
        _ => decline("embedding_bag backward: offset2bag does not cover the indices"),
    }
}

/// The CPU's checks of the offsets (`m` of them, into `n` indices) and of the indices (into
/// `rows` weights), in its order; XLA would clamp the bad values instead.
fn embedding_bag_checks(c: &mut Ctx, offs: Value, idx: Value, m: i64, n: i64, rows: i64) {
    if m > 0 {
        let first = c.b.slice_dim(offs, 0, 0, 1, 1);
        c.check_range(first, 0, 1, ErrorKind::Runtime, "offsets[0] has to be 0, i.e., the first sequence in the mini-batch has to start from position 0. However, got {index}".into());
        let last = c.b.slice_dim(offs, 0, m - 1, m, 1);
        c.check_range(last, i64::MIN + 1, n + 1, ErrorKind::Runtime, format!("offsets[-1] can not be greater than input's length {n} but got offsets[-1] of {{index}}"));
    }
    if m > 1 {
        let next = c.b.slice_dim(offs, 0, 1, m, 1);
        let prev = c.b.slice_dim(offs, 0, 0, m - 1, 1);
        let step = c.b.sub(next, prev);
        c.check_range(step, 0, i64::MAX, ErrorKind::Runtime, "Expected i < index_size to be true, but got false.  (Could this error message be improved?  If so, please report an enhancement request to PyTorch.)".into());
    }
    if n > 0 {
        c.check_range(
            idx,
            0,
            rows,
            ErrorKind::Runtime,
            "embedding_bag: Expected idx >= 0 && idx < num_embeddings but found idx to be {index}"
                .into(),
        );
    }
}

/// _embedding_bag / _embedding_bag_forward_only.
fn embedding_bag(c: &mut Ctx) -> LResult<Vec<Out>> {
    let w = tensor(c, "weight")?;
    let idx = tensor(c, "indices")?;
    let offs = tensor(c, "offsets")?;
    let mode = c.args.int("mode")?;
    let psw = c.args.opt_tensor("per_sample_weights").cloned();
    let ilo = c.args.bool_or("include_last_offset", false);
    let padding_idx = c.args.int_or("padding_idx", -1);
    check_index_dtype(&idx, "indices")?;
    if !matches!(offs.dtype, DType::I64 | DType::I32) || idx.shape.len() != 1 {
        return decline("embedding_bag: offsets dtype or 2-d indices");
    }
    if !w.dtype.is_float() {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected tensor for argument #1 'weight' to have one of the following scalar types: Half, BFloat16, Float, Double; but got {} instead (while checking arguments for embedding_bag)",
                tensor_type_name(w.dtype)
            ),
        );
    }
    if let Some(p) = &psw {
        if mode != MODE_SUM {
            return user_err(
                ErrorKind::Runtime,
                "embedding_bag: per_sample_weights only supported with mode='sum'",
            );
        }
        if p.dtype != w.dtype {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "Expected tensor for argument #1 'weight' to have the same type as tensor for argument #1 'per_sample_weights'; but type {} does not equal {} (while checking arguments for embedding_bag)",
                    tensor_type_name(w.dtype),
                    tensor_type_name(p.dtype)
                ),
            );
        }
        if p.shape != idx.shape {
            return decline("embedding_bag: per_sample_weights shape");
        }
    }
    if !(MODE_SUM..=MODE_MAX).contains(&mode) {
        return user_err(ErrorKind::Runtime, "`mode` must be sum, mean, or max.");
    }
    if offs.shape.len() != 1 || w.shape.len() != 2 {
        return decline("embedding_bag: offsets or weight rank");
    }
    let m = offs.shape[0];
    if ilo && m < 1 {
        return user_err(
            ErrorKind::Runtime,
            "include_last_offset: number of offset should be at least 1",
        );
    }
    let (n, d) = (idx.shape[0], w.shape[1]);
    embedding_bag_checks(c, offs.value, idx.value, m, n, w.shape[0]);
    let nb = if ilo { m - 1 } else { m };
    let it = promote_types(idx.dtype, offs.dtype);
    let cd = opmath(w.dtype);
    let b = &mut *c.b;
    // The CPU fills offset2bag only when a later step needs it, and sizes bag_size of the
    // forward-only sum by the offsets.
    let o2b_needed = mode != MODE_SUM || padding_idx >= 0;
    let stat_len = if mode == MODE_SUM && c.op == "aten::_embedding_bag_forward_only" {
        m
    } else {
        nb
    };
    // The last bag always runs to the end of the indices (a trailing offset is ignored).
    let rest = b.slice_dim(offs.value, 0, nb.min(1), nb, 1);
    let bag = group_of(b, rest, n);
    let keep = not_padding(b, idx.value, padding_idx);
    if n == 0 || nb == 0 {
        let out = b.full(w.dtype, &[nb, d], 0.0);
        let o2b = b.full(it, &[if o2b_needed { n } else { 0 }], 0.0);
        let bag_size = b.full(it, &[stat_len], 0.0);
        let mi = if mode == MODE_MAX {
            b.full(it, &[nb, d], 0.0)
        } else {
            bag_size
        };
        return Ok(vec![Out::T(out), Out::T(o2b), Out::T(bag_size), Out::T(mi)]);
    }
    let rows = take_rows(b, w.value, idx.value);
    let rows = b.convert(rows, cd);
    let keep2 = b.broadcast_in_dim(keep, &[n, d], &[0]);
    let ones = b.convert(keep, cd);
    let zero_b = b.full(cd, &[nb], 0.0);
    let count = scatter_rows(b, zero_b, bag, ones, ReduceKind::Sum);
    let has = b.compare(count, zero_b, CmpDir::Gt);
    let has2 = b.broadcast_in_dim(has, &[nb, d], &[0]);
    let (out, max_idx) = if mode == MODE_MAX {
        let lo = b.splat(rows, f64::NEG_INFINITY);
        let r = b.select(keep2, rows, lo);
        let init = b.full(cd, &[nb, d], f64::NEG_INFINITY);
        let mx = scatter_rows(b, init, bag, r, ReduceKind::Max);
        let out = mask(b, has2, mx);
        // The first index reaching the maximum, as the CPU's strict `>` keeps it.
        let at = take_rows(b, mx, bag);
        let eq = b.compare(rows, at, CmpDir::Eq);
        let cand = b.and(eq, keep2);
        let pos = b.iota(DType::I64, &[n, d], 0);
        let none = b.splat(pos, n as f64);
        let pos = b.select(cand, pos, none);
        let init = b.full(DType::I64, &[nb, d], n as f64);
        let first = scatter_rows(b, init, bag, pos, ReduceKind::Min);
        let found = b.compare(first, init, CmpDir::Lt);
        let flat = b.reshape(first, &[nb * d]);
        let top = b.splat(flat, (n - 1).max(0) as f64);
        let zf = b.splat(flat, 0.0);
        let flat = b.clamp(zf, flat, top);
        let widx = b.convert(idx.value, DType::I64);
        let picked = take_rows(b, widx, flat);
        let picked = b.reshape(picked, &[nb, d]);
        let mi = mask(b, found, picked);
        (out, Some(mi))
    } else {
        let r = match &psw {
            Some(p) => {
                let pv = b.convert(p.value, cd);
                let pb = b.broadcast_in_dim(pv, &[n, d], &[0]);
                b.mul(rows, pb)
            }
            None => rows,
        };
        let r = mask(b, keep2, r);
        let init = b.full(cd, &[nb, d], 0.0);
        let s = scatter_rows(b, init, bag, r, ReduceKind::Sum);
        let out = if mode == MODE_MEAN {
            let one = b.splat(count, 1.0);
            let cnt = b.max(count, one);
            let cb = b.broadcast_in_dim(cnt, &[nb, d], &[0]);
            b.div(s, cb)
        } else {
            s
        };
        (out, None)
    };
    let out = b.convert(out, w.dtype);
    let o2b = if o2b_needed {
        b.convert(bag, it)
    } else {
        b.full(it, &[0], 0.0)
    };
    let bag_size = if mode == MODE_SUM {
        b.full(it, &[stat_len], 0.0)
    } else {
        b.convert(count, it)
    };
    let max_idx = match max_idx {
        Some(mi) => b.convert(mi, it),
        None => bag_size,
    };
    Ok(vec![
        Out::T(out),
        Out::T(o2b),
        Out::T(bag_size),
        Out::T(max_idx),
    ])
}

/// _embedding_bag_backward (dense) / _embedding_bag_dense_backward.
fn embedding_bag_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let g = tensor(c, "grad")?;
    let idx = tensor(c, "indices")?;
    let offs = c.args.opt_tensor("offsets").cloned();
    let o2b = tensor(c, "offset2bag")?;
    let bag_size = tensor(c, "bag_size")?;
    let max_idx = tensor(c, "maximum_indices")?;
    let nw = c.args.int("num_weights")?;
    let freq = c.args.bool_or("scale_grad_by_freq", false);
    let mode = c.args.int("mode")?;
    let psw = c.args.opt_tensor("per_sample_weights").cloned();
    let padding_idx = c.args.int_or("padding_idx", -1);
    if c.args.bool_or("sparse", false) {
        return decline("embedding_bag backward: sparse gradient");
    }
    if idx.shape.len() != 1
        || g.shape.len() != 2
        || !g.dtype.is_float()
        || !(MODE_SUM..=MODE_MAX).contains(&mode)
        || nw < 0
    {
        return decline("embedding_bag backward: unsupported arguments");
    }
    let (n, nb, d) = (idx.shape[0], g.shape[0], g.shape[1]);
    let cd = opmath(g.dtype);
    let b = &mut *c.b;
    let gv = b.convert(g.value, cd);
    let zero_w = b.full(cd, &[nw, d], 0.0);
    let gw = if mode == MODE_MAX {
        if max_idx.shape != [nb, d] || bag_size.shape != [nb] {
            return decline("embedding_bag backward: maximum_indices shape");
        }
        // Each (bag, column) sends its gradient to the row that held the maximum.
        let bs = b.convert(bag_size.value, DType::I64);
        let z = b.splat(bs, 0.0);
        let has = b.compare(bs, z, CmpDir::Gt);
        let has2 = b.broadcast_in_dim(has, &[nb, d], &[0]);
        let gm = mask(b, has2, gv);
        let mi = b.convert(max_idx.value, DType::I64);
        let mi = b.reshape(mi, &[nb, d, 1]);
        let col = b.iota(DType::I64, &[nb, d, 1], 1);
        let coords = b.concatenate(&[mi, col], 2);
        b.scatter(zero_w, coords, gm, &[], &[0, 1], &[0, 1], 2, |b, x, y| {
            b.add(x, y)
        })
    } else {
        let bag = bags_of(b, &o2b, offs.as_ref(), n)?;
        let keep = not_padding(b, idx.value, padding_idx);
        let nbv = b.splat(bag, nb as f64);
        let inb = b.compare(bag, nbv, CmpDir::Lt);
        let keep = b.and(keep, inb);
        let rows = take_rows(b, gv, bag);
        let mut scale = b.full(cd, &[n], 1.0);
        if let Some(p) = &psw {
            if p.shape != [n] {
                return decline("embedding_bag backward: per_sample_weights shape");
            }
            let pv = b.convert(p.value, cd);
            scale = b.mul(scale, pv);
        }
        if mode == MODE_MEAN {
            if bag_size.shape != [nb] {
                return decline("embedding_bag backward: bag_size shape");
            }
            let bs = b.convert(bag_size.value, cd);
            let per = take_rows(b, bs, bag);
            scale = b.div(scale, per);
        }
        if freq {
            let ones = b.full(cd, &[n], 1.0);
            let zc = b.full(cd, &[nw], 0.0);
            let counts = scatter_rows(b, zc, idx.value, ones, ReduceKind::Sum);
            let per = take_rows(b, counts, idx.value);
            scale = b.div(scale, per);
        }
        let scale = mask(b, keep, scale);
        let sb = b.broadcast_in_dim(scale, &[n, d], &[0]);
        let contrib = b.mul(rows, sb);
        scatter_rows(b, zero_w, idx.value, contrib, ReduceKind::Sum)
    };
    Ok(vec![Out::T(b.convert(gw, g.dtype))])
}

fn embedding_bag_per_sample_weights_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let g = tensor(c, "grad")?;
    let w = tensor(c, "weight")?;
    let idx = tensor(c, "indices")?;
    let offs = tensor(c, "offsets")?;
    let o2b = tensor(c, "offset2bag")?;
    let mode = c.args.int("mode")?;
    let padding_idx = c.args.int_or("padding_idx", -1);
    if mode != MODE_SUM {
        return user_err(
            ErrorKind::Runtime,
            "embedding_bag_backward: per_sample_weights only supported for mode='sum'",
        );
    }
    if idx.shape.len() != 1 || g.shape.len() != 2 || w.shape.len() != 2 || !g.dtype.is_float() {
        return decline("embedding_bag per_sample_weights backward: unsupported arguments");
    }
    let (n, nb) = (idx.shape[0], g.shape[0]);
    let cd = opmath(g.dtype);
    let b = &mut *c.b;
    let bag = bags_of(b, &o2b, Some(&offs), n)?;
    let keep = not_padding(b, idx.value, padding_idx);
    let nbv = b.splat(bag, nb as f64);
    let inb = b.compare(bag, nbv, CmpDir::Lt);
    let keep = b.and(keep, inb);
    let gv = b.convert(g.value, cd);
    let grows = take_rows(b, gv, bag);
    let wrows = take_rows(b, w.value, idx.value);
    let wrows = b.convert(wrows, cd);
    let p = b.mul(grows, wrows);
    let s = b.reduce(p, &[1], ReduceKind::Sum);
    let s = mask(b, keep, s);
    Ok(vec![Out::T(b.convert(s, g.dtype))])
}

// ---------------------------------------------------------------------------------------
// segment_reduce
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum SegOp {
    Sum,
    Prod,
    Mean,
    Max,
    Min,
}

/// Segments along `axis` of `data`: for each position its segment (`nseg` where it lies in
/// none), the segment lengths, and the coordinates (leading dims, segment) that scatter
/// and gather use.
struct Segments {
    op: SegOp,
    axis: usize,
    len: i64,
    nseg: i64,
    out_shape: Vec<i64>,
    /// [lead..., len, axis + 1]
    coords: Value,
    /// [lead..., len]: whether the position lies in a segment.
    inside: Value,
    /// [lead..., nseg]: element count of each segment.
    counts: Value,
}

fn seg_op(s: &str) -> LResult<SegOp> {
    Ok(match s {
        "sum" => SegOp::Sum,
        "prod" => SegOp::Prod,
        "mean" => SegOp::Mean,
        "max" | "amax" => SegOp::Max,
        "min" | "amin" => SegOp::Min,
        _ => {
            return user_err(
                ErrorKind::Runtime,
                format!("reduce argument must be either sum, prod, mean, amax or amin, got {s}"),
            )
        }
    })
}

fn segments(c: &mut Ctx, data: &TensorArg) -> LResult<Segments> {
    let op = seg_op(c.args.str_or("reduce", ""))?;
    let axis = wrap_dim(c.args.int_or("axis", 0), data.shape.len())?;
    if c.args.opt_tensor("indices").is_some() {
        return user_err(
            ErrorKind::Runtime,
            "segment_reduce(): indices based reduction is not supported yet.",
        );
    }
    let lengths = c.args.opt_tensor("lengths").cloned();
    let offsets = c.args.opt_tensor("offsets").cloned();
    let (seg, is_len) = match (lengths, offsets) {
        (Some(l), _) => (l, true),
        (None, Some(o)) => (o, false),
        (None, None) => {
            return user_err(
                ErrorKind::Runtime,
                "segment_reduce(): Either lengths or offsets must be defined.",
            )
        }
    };
    let what = if is_len { "lengths" } else { "offsets" };
    if !matches!(seg.dtype, DType::I64 | DType::I32) {
        let kernel = format!("_segment_reduce_{what}_cpu_kernel1");
        return not_implemented(&kernel, seg.dtype);
    }
    if !data.dtype.is_float() {
        return not_implemented("_segment_reduce_cpu", data.dtype);
    }
    if data.shape.is_empty() || seg.shape.is_empty() || data.shape.len() < seg.shape.len() {
        return decline("segment_reduce: ranks of data and lengths");
    }
    if axis != seg.shape.len() - 1 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "segment_reduce(): Expected axis to be the last dimension of {what} but got {axis}."
            ),
        );
    }
    let lead = data.shape[..axis].to_vec();
    if seg.shape[..axis] != lead[..] {
        // The CPU kernel reads past the lengths here.
        return user_err(
            ErrorKind::Runtime,
            format!(
                "segment_reduce(): {what} of shape {} do not match data of shape {} along the leading dims",
                shape_str(&seg.shape),
                shape_str(&data.shape)
            ),
        );
    }
    let len = data.shape[axis];
    let k = seg.shape[axis];
    let nseg = if is_len { k } else { (k - 1).max(0) };
    let mut out_shape = data.shape.clone();
    out_shape[axis] = nseg;
    let b = &mut *c.b;
    let sv = b.convert(seg.value, DType::I64);
    let ax = axis as i64;
    let (starts, ends) = if is_len {
        let ends = super::reduce::scan(b, sv, axis, ReduceKind::Sum);
        (b.sub(ends, sv), ends)
    } else {
        let s = b.slice_dim(sv, axis, 0, nseg, 1);
        let e = b.slice_dim(sv, axis, 1.min(k), k, 1);
        (s, e)
    };
    let counts = b.sub(ends, starts);
    let mut big = lead.clone();
    big.push(nseg);
    big.push(len);
    let lead_dims: Vec<i64> = (0..ax + 1).collect();
    let eb = b.broadcast_in_dim(ends, &big, &lead_dims);
    let pos = b.iota(DType::I64, &big, axis + 1);
    let le = b.compare(eb, pos, CmpDir::Le);
    let le = b.convert(le, DType::I64);
    let mut pshape = lead.clone();
    pshape.push(len);
    let segid = if nseg == 0 {
        b.full(DType::I64, &pshape, 0.0)
    } else {
        b.reduce(le, &[ax], ReduceKind::Sum)
    };
    let inside = if nseg == 0 {
        b.full(DType::Bool, &pshape, 0.0)
    } else {
        let first = b.slice_dim(starts, axis, 0, 1, 1);
        let last = b.slice_dim(ends, axis, nseg - 1, nseg, 1);
        let fb = b.broadcast_in_dim(first, &pshape, &lead_dims);
        let lb = b.broadcast_in_dim(last, &pshape, &lead_dims);
        let p = b.iota(DType::I64, &pshape, axis);
        let a = b.compare(p, fb, CmpDir::Ge);
        let z = b.compare(p, lb, CmpDir::Lt);
        b.and(a, z)
    };
    let out_of_range = b.splat(segid, nseg as f64);
    let segid = b.select(inside, segid, out_of_range);
    let mut cshape = pshape.clone();
    cshape.push(1);
    let mut parts = Vec::new();
    for i in 0..axis {
        parts.push(b.iota(DType::I64, &cshape, i));
    }
    parts.push(b.reshape(segid, &cshape));
    let coords = b.concatenate(&parts, axis + 1);
    Ok(Segments {
        op,
        axis,
        len,
        nseg,
        out_shape,
        coords,
        inside,
        counts,
    })
}

impl Segments {
    /// Combines `x` (data-shaped) into a tensor of the output shape starting from `init`.
    fn scatter(&self, b: &mut Builder, init: Value, x: Value, kind: ReduceKind) -> Value {
        let a = self.axis as i64;
        let r = b.rank(x) as i64;
        let win: Vec<i64> = (a + 1..r).collect();
        let ins: Vec<i64> = (0..a + 1).collect();
        b.scatter(
            init,
            self.coords,
            x,
            &win,
            &ins,
            &ins,
            a + 1,
            |b, cur, new| b.combine(kind, cur, new),
        )
    }

    /// The entry of output-shaped `y` of each data position (clamped where it has none).
    fn gather(&self, b: &mut Builder, y: Value) -> Value {
        let a = self.axis as i64;
        let ys = b.shape(y);
        let r = ys.len() as i64;
        let offs: Vec<i64> = (a + 1..r).collect();
        let coll: Vec<i64> = (0..a + 1).collect();
        let mut sizes = vec![1; self.axis + 1];
        sizes.extend_from_slice(&ys[self.axis + 1..]);
        b.gather(y, self.coords, &offs, &coll, &coll, a + 1, &sizes)
    }

    /// A [lead..., len] or [lead..., nseg] value broadcast over the trailing dims of `shape`.
    fn spread(&self, b: &mut Builder, v: Value, shape: &[i64]) -> Value {
        let dims: Vec<i64> = (0..self.axis as i64 + 1).collect();
        b.broadcast_in_dim(v, shape, &dims)
    }
}

fn seg_init(op: SegOp, dt: DType, initial: Option<f64>) -> f64 {
    match (op, initial) {
        (SegOp::Mean, _) => 0.0,
        (_, Some(v)) => v,
        (SegOp::Sum, None) => 0.0,
        (SegOp::Prod, None) => 1.0,
        (SegOp::Max, None) => ReduceKind::Max.init(dt),
        (SegOp::Min, None) => ReduceKind::Min.init(dt),
    }
}

fn segment_reduce(c: &mut Ctx) -> LResult<Vec<Out>> {
    let data = tensor(c, "data")?;
    let initial = c.args.opt_scalar("initial").map(|s| s.as_f64());
    let s = segments(c, &data)?;
    let b = &mut *c.b;
    let dt = data.dtype;
    let init = b.full(dt, &s.out_shape, seg_init(s.op, dt, initial));
    if numel(&s.out_shape) == 0 {
        return Ok(vec![Out::T(init)]);
    }
    let kind = match s.op {
        SegOp::Sum | SegOp::Mean => ReduceKind::Sum,
        SegOp::Prod => ReduceKind::Prod,
        SegOp::Max => ReduceKind::Max,
        SegOp::Min => ReduceKind::Min,
    };
    let r = if s.len == 0 {
        init
    } else {
        s.scatter(b, init, data.value, kind)
    };
    let r = if s.op == SegOp::Mean {
        // (sum + initial) / count; an empty segment is `initial`, or NaN without one.
        let cnt = b.convert(s.counts, dt);
        let cnt = s.spread(b, cnt, &s.out_shape);
        let r = match initial {
            Some(v) => {
                let k = b.splat(r, v);
                b.add(r, k)
            }
            None => r,
        };
        let q = b.div(r, cnt);
        match initial {
            Some(v) => {
                let z = b.splat(cnt, 0.0);
                let empty = b.compare(cnt, z, CmpDir::Eq);
                let k = b.splat(q, v);
                b.select(empty, k, q)
            }
            None => q,
        }
    } else {
        r
    };
    Ok(vec![Out::T(r)])
}

fn segment_reduce_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let g = tensor(c, "grad")?;
    let out = tensor(c, "output")?;
    let data = tensor(c, "data")?;
    let initial = c.args.opt_scalar("initial").map(|s| s.as_f64());
    let s = segments(c, &data)?;
    if g.shape != s.out_shape || out.shape != s.out_shape {
        return decline("_segment_reduce_backward: grad/output shape");
    }
    let b = &mut *c.b;
    let dt = data.dtype;
    let shape = data.shape.clone();
    if numel(&shape) == 0 || s.nseg == 0 {
        return Ok(vec![Out::T(b.full(dt, &shape, 0.0))]);
    }
    let gv = b.convert(g.value, dt);
    let gs = s.gather(b, gv);
    let inside = s.spread(b, s.inside, &shape);
    let gs = mask(b, inside, gs);
    let x = data.value;
    let r = match s.op {
        SegOp::Sum => gs,
        SegOp::Mean => {
            let cnt = b.convert(s.counts, dt);
            let cnt = s.spread(b, cnt, &s.out_shape);
            let cs = s.gather(b, cnt);
            b.div(gs, cs)
        }
        SegOp::Max | SegOp::Min => {
            // Ties (and NaNs) share the gradient: the CPU kernel divides it by their count
            // only when it is positive.
            let ov = b.convert(out.value, dt);
            let os = s.gather(b, ov);
            let eq = b.compare(x, os, CmpDir::Eq);
            let nan = b.compare(x, x, CmpDir::Ne);
            let hit = b.or(eq, nan);
            let hit = b.and(hit, inside);
            let one = b.splat(x, 1.0);
            let zero = b.splat(x, 0.0);
            let h = b.select(hit, one, zero);
            let z0 = b.full(dt, &s.out_shape, 0.0);
            let cnt = s.scatter(b, z0, h, ReduceKind::Sum);
            let cs = s.gather(b, cnt);
            let pos = b.compare(gs, zero, CmpDir::Gt);
            let split = b.div(gs, cs);
            let v = b.select(pos, split, gs);
            b.select(hit, v, zero)
        }
        SegOp::Prod => {
            // x != 0: g * out / x. A segment's only zero gets g * (product of the others);
            // with two or more zeros every gradient is 0.
            let zero = b.splat(x, 0.0);
            let one = b.splat(x, 1.0);
            let is0 = b.compare(x, zero, CmpDir::Eq);
            let z = b.select(is0, one, zero);
            let z0 = b.full(dt, &s.out_shape, 0.0);
            let zc = s.scatter(b, z0, z, ReduceKind::Sum);
            let nzx = b.select(is0, one, x);
            let p0 = b.full(dt, &s.out_shape, initial.unwrap_or(1.0));
            let nzp = s.scatter(b, p0, nzx, ReduceKind::Prod);
            let zcs = s.gather(b, zc);
            let nzps = s.gather(b, nzp);
            let ov = b.convert(out.value, dt);
            let os = s.gather(b, ov);
            let q = b.div(os, x);
            let nonzero = b.mul(gs, q);
            let only = b.compare(zcs, one, CmpDir::Eq);
            let gz = b.mul(gs, nzps);
            let gz = b.select(only, gz, zero);
            b.select(is0, gz, nonzero)
        }
    };
    let r = mask(b, inside, r);
    Ok(vec![Out::T(r)])
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
    ("aten::_embedding_bag", embedding_bag),
    ("aten::_embedding_bag_forward_only", embedding_bag),
    ("aten::_embedding_bag_backward", embedding_bag_backward),
    (
        "aten::_embedding_bag_dense_backward",
        embedding_bag_backward,
    ),
    (
        "aten::_embedding_bag_per_sample_weights_backward",
        embedding_bag_per_sample_weights_backward,
    ),
    ("aten::segment_reduce", segment_reduce),
    ("aten::_ctc_loss", ctc_loss),
    ("aten::_ctc_loss_backward", ctc_loss_backward),
    ("aten::_segment_reduce_backward", segment_reduce_backward),
];
