//! Sorting and selection (sort, topk, kthvalue, median, mode, nonzero_static), scans with
//! indices (cummax/cummin, logcumsumexp) and searches (searchsorted, bucketize, isin).
//!
//! Sorts are stable with NaN as the largest value, as PyTorch orders them; ties therefore
//! resolve to the lowest index. Where PyTorch's CPU kernels select with unstable partial
//! sorts (topk, kthvalue) the values match but tied indices may differ.

use super::reduce::{reduce_keep, scan};
use crate::args::Scalar;
use crate::promote::{result_type, Operand};
use crate::shape::{numel, reduced_shape, wrap_dim};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};
use stablehlo::{CmpDir, ReduceKind};

use super::{count_before, input, is_nan};

/// Ops whose composite kernels stand in the way; the glue must route all their overloads
/// here (`rules::claimed`). cummax/cummin otherwise split into CPU-only helpers
/// (`_cummax_helper`), and `mode.values` rejects devices other than CPU/CUDA/XPU.
pub const CLAIMED: &[&str] = &["aten::cummax", "aten::cummin", "aten::mode"];

/// 0-d tensors act as one-element vectors along dim 0.
fn at_least_1d(b: &mut Builder, x: Value) -> Value {
    if b.rank(x) == 0 {
        b.reshape(x, &[1])
    } else {
        x
    }
}

fn keep_shape(shape: &[i64], dim: usize) -> Vec<i64> {
    let mut s = shape.to_vec();
    s[dim] = 1;
    s
}

/// Whether `l` orders strictly before `r`, NaN being the largest value.
fn before(b: &mut Builder, l: Value, r: Value, descending: bool) -> Value {
    let dir = if descending { CmpDir::Gt } else { CmpDir::Lt };
    let cmp = b.compare(l, r, dir);
    if !b.dtype(l).is_float() {
        return cmp;
    }
    let (ln, rn) = (is_nan(b, l), is_nan(b, r));
    // Ascending: a number precedes NaN; descending: NaN precedes a number.
    let (nan, num) = if descending { (ln, rn) } else { (rn, ln) };
    let not_nan = b.not(num);
    let nan_case = b.and(nan, not_nan);
    b.or(cmp, nan_case)
}

/// Stable sort of `x` (rank >= 1) along `dim` with the original positions (int64).
fn sort_indexed(b: &mut Builder, x: Value, dim: usize, descending: bool) -> (Value, Value) {
    let shape = b.shape(x);
    let idx = b.iota(DType::I64, &shape, dim);
    let r = b.sort(&[x, idx], dim, true, |b, a| {
        before(b, a[0], a[1], descending)
    });
    (r[0], r[1])
}

/// The elements of `x` at per-slice positions `pos` (int64, `x`'s shape with `dim` of
/// size 1) along `dim`, in that keepdim shape.
fn pick(b: &mut Builder, x: Value, pos: Value, dim: usize) -> Value {
    let shape = b.shape(x);
    let iota = b.iota(DType::I64, &shape, dim);
    let p = b.broadcast_to(pos, &shape);
    let hit = b.compare(iota, p, CmpDir::Eq);
    let no = b.constant(DType::Bool, 0.0);
    let zero = b.constant(b.dtype(x), 0.0);
    let r = b.reduce_with(&[hit, x], &[no, zero], &[dim as i64], |b, a| {
        // a = [acc_hit, acc_x, hit, x]; exactly one position hits, in any order.
        let h = b.or(a[0], a[2]);
        let v = b.select(a[2], a[3], a[1]);
        vec![h, v]
    });
    b.reshape(r[1], &keep_shape(&shape, dim))
}

/// PyTorch's check on a reduced dim; `name` as its message spells the op.
fn check_nonempty_dim(name: &str, shape: &[i64], dim: usize) -> LResult<()> {
    if !shape.is_empty() && shape[dim] == 0 {
        return user_err(
            ErrorKind::Index,
            format!("{name}(): Expected reduction dim {dim} to have non-zero size."),
        );
    }
    Ok(())
}

fn sort(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dim = wrap_dim(c.args.int_or("dim", -1), t.shape.len())?;
    let desc = c.args.bool_or("descending", false);
    if t.shape.is_empty() {
        let i = c.b.constant_i64(DType::I64, 0);
        return Ok(vec![Out::T(t.value), Out::T(i)]);
    }
    let (v, i) = sort_indexed(c.b, t.value, dim, desc);
    Ok(vec![Out::T(v), Out::T(i)])
}

fn topk(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let k = c.args.int("k")?;
    let dim = wrap_dim(c.args.int_or("dim", -1), t.shape.len())?;
    let largest = c.args.bool_or("largest", true);
    let n = t.shape.get(dim).copied().unwrap_or(1);
    if k < 0 || k > n {
        return user_err(ErrorKind::Runtime, "selected index k out of range");
    }
    if t.shape.is_empty() {
        let i = c.b.constant_i64(DType::I64, 0);
        return Ok(vec![Out::T(t.value), Out::T(i)]);
    }
    let b = &mut *c.b;
    let (v, i) = sort_indexed(b, t.value, dim, largest);
    let v = b.slice_dim(v, dim, 0, k, 1);
    let i = b.slice_dim(i, dim, 0, k, 1);
    Ok(vec![Out::T(v), Out::T(i)])
}

fn kthvalue(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let k = c.args.int("k")?;
    let dim = wrap_dim(c.args.int_or("dim", -1), t.shape.len())?;
    let keep = c.args.bool_or("keepdim", false);
    let n = t.shape.get(dim).copied().unwrap_or(1);
    if k < 1 || k > n {
        return user_err(
            ErrorKind::Runtime,
            format!("kthvalue(): selected number k out of range for dimension {dim}"),
        );
    }
    let b = &mut *c.b;
    let x = at_least_1d(b, t.value);
    let (v, i) = sort_indexed(b, x, dim, false);
    let out = reduced_shape(&t.shape, &[dim as i64], keep);
    let v = b.slice_dim(v, dim, k - 1, k, 1);
    let i = b.slice_dim(i, dim, k - 1, k, 1);
    Ok(vec![Out::T(b.reshape(v, &out)), Out::T(b.reshape(i, &out))])
}

/// The lower median of `x` (rank >= 1) along `dim` and its index, in keepdim shape. NaN
/// propagates (with the index of the first NaN) unless `ignore_nan`, which takes the
/// median of the other values.
fn median_along(b: &mut Builder, x: Value, dim: usize, ignore_nan: bool) -> (Value, Value) {
    let shape = b.shape(x);
    let n = shape[dim];
    let (sv, si) = sort_indexed(b, x, dim, false);
    let m = (n - 1) / 2;
    if !b.dtype(x).is_float() || !ignore_nan {
        let mv = b.slice_dim(sv, dim, m, m + 1, 1);
        let mi = b.slice_dim(si, dim, m, m + 1, 1);
        if !b.dtype(x).is_float() {
            return (mv, mi);
        }
        let nan = is_nan(b, x);
        let any = reduce_keep(b, nan, &[dim as i64], ReduceKind::Or, true);
        let iota = b.iota(DType::I64, &shape, dim);
        let past = b.full(DType::I64, &shape, n as f64);
        let at = b.select(nan, iota, past);
        let first = reduce_keep(b, at, &[dim as i64], ReduceKind::Min, true);
        let nanv = b.splat(mv, f64::NAN);
        return (b.select(any, nanv, mv), b.select(any, first, mi));
    }
    // NaN sorts last: the median of the valid values sits at (count - 1) / 2 (0 if none).
    let nan = is_nan(b, x);
    let valid = b.not(nan);
    let valid = b.convert(valid, DType::I64);
    let cnt = reduce_keep(b, valid, &[dim as i64], ReduceKind::Sum, true);
    let one = b.splat(cnt, 1.0);
    let two = b.splat(cnt, 2.0);
    let pos = b.sub(cnt, one);
    let pos = b.div(pos, two);
    (pick(b, sv, pos, dim), pick(b, si, pos, dim))
}

fn median(c: &mut Ctx, ignore_nan: bool) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let Some(d) = c.args.opt_int("dim") else {
        let n = numel(&t.shape);
        if n == 0 {
            if !t.dtype.is_float() {
                return decline("median of an empty integer tensor");
            }
            return Ok(vec![Out::T(c.b.constant(t.dtype, f64::NAN))]);
        }
        let b = &mut *c.b;
        let x = b.reshape(t.value, &[n]);
        let (v, _) = median_along(b, x, 0, ignore_nan);
        return Ok(vec![Out::T(b.reshape(v, &[]))]);
    };
    let dim = wrap_dim(d, t.shape.len())?;
    let keep = c.args.bool_or("keepdim", false);
    check_nonempty_dim("median", &t.shape, dim)?;
    let b = &mut *c.b;
    let x = at_least_1d(b, t.value);
    let (v, i) = median_along(b, x, dim, ignore_nan);
    let out = reduced_shape(&t.shape, &[dim as i64], keep);
    Ok(vec![Out::T(b.reshape(v, &out)), Out::T(b.reshape(i, &out))])
}

/// The most frequent value along `dim` (the smallest among equally frequent ones) and the
/// last index where it occurs, in keepdim shape.
fn mode_along(b: &mut Builder, x: Value, dim: usize) -> (Value, Value) {
    let shape = b.shape(x);
    let n = shape[dim];
    let (sv, si) = sort_indexed(b, x, dim, false);
    let pos = b.iota(DType::I64, &shape, dim);
    // Runs of equal values in the sorted slice: where each starts and ends.
    let (starts, ends) = if n > 1 {
        let hi = b.slice_dim(sv, dim, 1, n, 1);
        let lo = b.slice_dim(sv, dim, 0, n - 1, 1);
        let ne = b.compare(hi, lo, CmpDir::Ne);
        let edge = b.full(DType::Bool, &keep_shape(&shape, dim), 1.0);
        (
            b.concatenate(&[edge, ne], dim),
            b.concatenate(&[ne, edge], dim),
        )
    } else {
        let all = b.full(DType::Bool, &shape, 1.0);
        (all, all)
    };
    let zero = b.full(DType::I64, &shape, 0.0);
    let start_pos = b.select(starts, pos, zero);
    let run_start = scan(b, start_pos, dim, ReduceKind::Max);
    let one = b.full(DType::I64, &shape, 1.0);
    let len = b.sub(pos, run_start);
    let len = b.add(len, one);
    let none = b.full(DType::I64, &shape, -1.0);
    let key = b.select(ends, len, none);
    let init_k = b.constant_i64(DType::I64, -1);
    let init_p = b.constant_i64(DType::I64, i64::MAX);
    let best = b.reduce_with(&[key, pos], &[init_k, init_p], &[dim as i64], |b, a| {
        // Longest run; among equally long ones the first (smallest value).
        let (ak, ap, bk, bp) = (a[0], a[1], a[2], a[3]);
        let longer = b.compare(ak, bk, CmpDir::Gt);
        let same = b.compare(ak, bk, CmpDir::Eq);
        let earlier = b.compare(ap, bp, CmpDir::Lt);
        let tie = b.and(same, earlier);
        let take_a = b.or(longer, tie);
        vec![b.select(take_a, ak, bk), b.select(take_a, ap, bp)]
    });
    let best = b.reshape(best[1], &keep_shape(&shape, dim));
    (pick(b, sv, best, dim), pick(b, si, best, dim))
}

fn mode(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dim = wrap_dim(c.args.int_or("dim", -1), t.shape.len())?;
    let keep = c.args.bool_or("keepdim", false);
    check_nonempty_dim("mode", &t.shape, dim)?;
    let b = &mut *c.b;
    let x = at_least_1d(b, t.value);
    let (v, i) = mode_along(b, x, dim);
    let out = reduced_shape(&t.shape, &[dim as i64], keep);
    Ok(vec![Out::T(b.reshape(v, &out)), Out::T(b.reshape(i, &out))])
}

/// An inclusive scan along `dim` of `xs` with a custom associative, commutative combiner
/// (a reduce_window over each prefix).
fn scan_with(
    b: &mut Builder,
    xs: &[Value],
    inits: &[Value],
    dim: usize,
    body: impl FnOnce(&mut Builder, &[Value]) -> Vec<Value>,
) -> Vec<Value> {
    let shape = b.shape(xs[0]);
    let n = shape[dim];
    let mut window = vec![1; shape.len()];
    window[dim] = n.max(1);
    let ones = vec![1; shape.len()];
    let mut pad = vec![(0, 0); shape.len()];
    pad[dim] = ((n - 1).max(0), 0);
    b.reduce_window_with(xs, inits, &window, &ones, &ones, &pad, body)
}

/// Running max/min with the index where it was reached: a NaN beats every number, and ties
/// (equal values, or NaN after NaN) take the later index, as PyTorch's CPU kernel does.
fn cum_extreme(b: &mut Builder, x: Value, dim: usize, is_max: bool) -> (Value, Value) {
    let shape = b.shape(x);
    let dt = b.dtype(x);
    let idx = b.iota(DType::I64, &shape, dim);
    let kind = if is_max {
        ReduceKind::Max
    } else {
        ReduceKind::Min
    };
    let init_v = b.constant(dt, kind.init(dt));
    let init_i = b.constant_i64(DType::I64, -1);
    let r = scan_with(b, &[x, idx], &[init_v, init_i], dim, |b, a| {
        let (av, ai, bv, bi) = (a[0], a[1], a[2], a[3]);
        let dir = if is_max { CmpDir::Gt } else { CmpDir::Lt };
        let better = b.compare(bv, av, dir);
        let eq = b.compare(bv, av, CmpDir::Eq);
        let later = b.compare(bi, ai, CmpDir::Gt);
        let tie = b.and(eq, later);
        let mut win = b.or(better, tie);
        if dt.is_float() {
            let (an, bn) = (is_nan(b, av), is_nan(b, bv));
            let a_num = b.not(an);
            let b_num = b.not(bn);
            let nan_over_num = b.and(bn, a_num);
            let both_nan = b.and(an, bn);
            let nan_after_nan = b.and(both_nan, later);
            let both_num = b.and(a_num, b_num);
            let num_win = b.and(both_num, win);
            let w = b.or(nan_over_num, nan_after_nan);
            win = b.or(w, num_win);
        }
        vec![b.select(win, bv, av), b.select(win, bi, ai)]
    });
    (r[0], r[1])
}

fn cummaxmin(c: &mut Ctx, is_max: bool) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dim = wrap_dim(c.args.int("dim")?, t.shape.len())?;
    if t.shape.is_empty() {
        let i = c.b.constant_i64(DType::I64, 0);
        return Ok(vec![Out::T(t.value), Out::T(i)]);
    }
    let (v, i) = cum_extreme(c.b, t.value, dim, is_max);
    Ok(vec![Out::T(v), Out::T(i)])
}

/// `_cummax_helper` / `_cummin_helper`, which cummax/cummin call for non-empty tensors
/// after resizing `values` and `indices` to self's shape: the results go into those two.
fn cum_helper(c: &mut Ctx, is_max: bool) -> LResult<Vec<Out>> {
    let outs = cummaxmin(c, is_max)?;
    for (name, o) in ["values", "indices"].iter().zip(outs) {
        if let Out::T(v) = o {
            c.write_arg(name, v);
        }
    }
    Ok(vec![])
}

/// log(exp(x) + exp(y)) without overflow; equal infinities give themselves.
fn log_add_exp(b: &mut Builder, x: Value, y: Value) -> Value {
    let hi = b.max(x, y);
    let lo = b.min(x, y);
    let d = b.sub(lo, hi);
    let e = b.exp(d);
    let l = b.unary("stablehlo.log_plus_one", e);
    let r = b.add(l, hi);
    let same = b.compare(lo, hi, CmpDir::Eq);
    let a = b.abs(hi);
    let inf = b.splat(hi, f64::INFINITY);
    let is_inf = b.compare(a, inf, CmpDir::Eq);
    let both_inf = b.and(same, is_inf);
    b.select(both_inf, hi, r)
}

fn logcumsumexp(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dim = wrap_dim(c.args.int("dim")?, t.shape.len())?;
    if !t.dtype.is_float() {
        return decline("logcumsumexp of a non-float tensor");
    }
    if t.shape.is_empty() {
        return Ok(vec![Out::T(t.value)]);
    }
    let b = &mut *c.b;
    let init = b.constant(t.dtype, f64::NEG_INFINITY);
    let r = scan_with(b, &[t.value], &[init], dim, |b, a| {
        vec![log_add_exp(b, a[0], a[1])]
    });
    Ok(vec![Out::T(r[0])])
}

/// The values operand (tensor or Python number) promoted with the boundaries' dtype.
fn search_operands(c: &mut Ctx, seq: &TensorArg, vname: &str) -> LResult<(Value, Value)> {
    let (vop, vval) = match c.args.opt_tensor(vname) {
        Some(t) => {
            let op = if t.wrapped_number {
                Operand::Number(if t.dtype.is_float() {
                    Scalar::Float(0.0)
                } else {
                    Scalar::Int(0)
                })
            } else if t.shape.is_empty() {
                Operand::ZeroDim(t.dtype)
            } else {
                Operand::Dim(t.dtype)
            };
            (op, Some(t.value))
        }
        None => (Operand::Number(c.args.scalar(vname)?), None),
    };
    let sop = if seq.shape.is_empty() {
        Operand::ZeroDim(seq.dtype)
    } else {
        Operand::Dim(seq.dtype)
    };
    let dt = result_type(&[sop, vop]);
    let b = &mut *c.b;
    let s = b.convert(seq.value, dt);
    let v = match vval {
        Some(v) => b.convert(v, dt),
        None => b.constant(dt, c.args.scalar(vname)?.as_f64()),
    };
    Ok((s, v))
}

fn searchsorted(c: &mut Ctx) -> LResult<Vec<Out>> {
    let seq = c.args.tensor("sorted_sequence")?.clone();
    let mut right = c.args.bool_or("right", false);
    if let Some(side) = c.args.opt_str("side") {
        if side != "left" && side != "right" {
            return user_err(
                ErrorKind::Runtime,
                format!("torch.searchsorted(): side can only be 'left' or 'right' but got {side}"),
            );
        }
        if side == "left" && right {
            return user_err(
                ErrorKind::Runtime,
                "torch.searchsorted(): side and right can't be set to opposites, got side of left while right was True",
            );
        }
        right = side == "right";
    }
    let out = if c.args.bool_or("out_int32", false) {
        DType::I32
    } else {
        DType::I64
    };
    let scalar_self = c.args.opt_tensor("self").is_none();
    if scalar_self && seq.shape.len() != 1 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "torch.searchsorted(): input value can be a scalar only when boundaries tensor dimension is 1, but we got boundaries tensor dim({}) and input value's dim(0) numel(1)",
                seq.shape.len()
            ),
        );
    }
    let vshape = c
        .args
        .opt_tensor("self")
        .map(|t| t.shape.clone())
        .unwrap_or_default();
    let n = seq.shape.len();
    let lead_ok = n == 1 || (vshape.len() == n && seq.shape[..n - 1] == vshape[..n - 1]);
    if n == 0 || !lead_ok {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "torch.searchsorted(): boundaries tensor should be 1 dimension or the first N-1 dimensions of boundaries tensor and input value tensor must match, but we got boundaries tensor {} and input value tensor {}",
                crate::shape::shape_str(&seq.shape),
                crate::shape::shape_str(&vshape)
            ),
        );
    }
    // A valid sorter only permutes the boundaries; counting does not depend on order.
    let (s, v) = search_operands(c, &seq, "self")?;
    Ok(vec![Out::T(count_before(c.b, s, v, right, out))])
}

fn bucketize(c: &mut Ctx) -> LResult<Vec<Out>> {
    let bd = c.args.tensor("boundaries")?.clone();
    if bd.shape.len() != 1 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "boundaries tensor must be 1 dimension, but got dim({})",
                bd.shape.len()
            ),
        );
    }
    let right = c.args.bool_or("right", false);
    let out = if c.args.bool_or("out_int32", false) {
        DType::I32
    } else {
        DType::I64
    };
    let (s, v) = search_operands(c, &bd, "self")?;
    Ok(vec![Out::T(count_before(c.b, s, v, right, out))])
}

/// An operand of `isin`: a tensor or a Python number, as a promotion operand.
fn isin_operand(c: &Ctx, names: [&str; 2]) -> LResult<(Operand, Option<TensorArg>, Scalar)> {
    for n in names {
        if let Some(t) = c.args.opt_tensor(n) {
            let op = if t.shape.is_empty() {
                Operand::ZeroDim(t.dtype)
            } else {
                Operand::Dim(t.dtype)
            };
            return Ok((op, Some(t.clone()), Scalar::Int(0)));
        }
        if let Some(s) = c.args.opt_scalar(n) {
            return Ok((Operand::Number(s), None, s));
        }
    }
    decline("isin without operands")
}

fn isin(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (eo, et, es) = isin_operand(c, ["elements", "element"])?;
    let (to, tt, ts) = isin_operand(c, ["test_elements", "test_element"])?;
    for t in [&et, &tt].into_iter().flatten() {
        if t.dtype == DType::Bool {
            return user_err(
                ErrorKind::NotImplemented,
                "Unsupported input type encountered for isin(): Bool",
            );
        }
    }
    let invert = c.args.bool_or("invert", false);
    let dt = result_type(&[eo, to]);
    let b = &mut *c.b;
    let e = match &et {
        Some(t) => b.convert(t.value, dt),
        None => b.constant(dt, es.as_f64()),
    };
    let t = match &tt {
        Some(t) => {
            let v = b.convert(t.value, dt);
            b.reshape(v, &[numel(&t.shape)])
        }
        None => b.constant(dt, ts.as_f64()),
    };
    let t = at_least_1d(b, t);
    let eshape = b.shape(e);
    let m = b.shape(t)[0];
    let r = eshape.len();
    let mut full = eshape.clone();
    full.push(m);
    let all: Vec<i64> = (0..r as i64).collect();
    let eb = b.broadcast_in_dim(e, &full, &all);
    let tb = b.broadcast_in_dim(t, &full, &[r as i64]);
    let eq = b.compare(eb, tb, CmpDir::Eq);
    let found = b.reduce(eq, &[r as i64], ReduceKind::Or);
    Ok(vec![Out::T(if invert { b.not(found) } else { found })])
}

/// `nonzero_static`: the first `size` nonzero coordinates in row-major order, rows past
/// the nonzero count set to `fill_value`. The size is fixed, so nothing synchronizes.
fn nonzero_static(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let size = c.args.int("size")?;
    let fill = c.args.int_or("fill_value", -1) as f64;
    if size < 0 {
        return user_err(
            ErrorKind::Runtime,
            "nonzero_static: 'size' must be an non-negative integer",
        );
    }
    let r = t.shape.len();
    let n = numel(&t.shape);
    let b = &mut *c.b;
    if r == 0 || n == 0 || size == 0 {
        return Ok(vec![Out::T(b.full(DType::I64, &[size, r as i64], fill))]);
    }
    // A stable sort of "is zero" brings the nonzero flat indices to the front, in order.
    let flat = b.reshape(t.value, &[n]);
    let z = b.splat(flat, 0.0);
    let nz = b.compare(flat, z, CmpDir::Ne);
    let cnt = b.convert(nz, DType::I64);
    let count = b.reduce(cnt, &[0], ReduceKind::Sum);
    let one = b.splat(cnt, 1.0);
    let key = b.sub(one, cnt);
    let idx = b.iota(DType::I64, &[n], 0);
    let sorted = b.sort(&[key, idx], 0, true, |b, a| {
        b.compare(a[0], a[1], CmpDir::Lt)
    });
    let k = size.min(n);
    let first = b.slice_dim(sorted[1], 0, 0, k, 1);
    let mut cols = Vec::with_capacity(r);
    let mut stride = n;
    for d in &t.shape {
        stride /= d;
        let sv = b.splat(first, stride as f64);
        let q = b.div(first, sv);
        let dv = b.splat(q, *d as f64);
        let q = b.binary("stablehlo.remainder", q, dv);
        cols.push(b.reshape(q, &[k, 1]));
    }
    let coords = b.concatenate(&cols, 1);
    let row = b.iota(DType::I64, &[k, r as i64], 0);
    let cb = b.broadcast_in_dim(count, &[k, r as i64], &[]);
    let valid = b.compare(row, cb, CmpDir::Lt);
    let fv = b.splat(coords, fill);
    let out = b.select(valid, coords, fv);
    let out = if size > k {
        let pad = b.full(DType::I64, &[size - k, r as i64], fill);
        b.concatenate(&[out, pad], 0)
    } else {
        out
    };
    Ok(vec![Out::T(out)])
}

pub const RULES: &[(&str, Rule)] = &[
    ("aten::sort", sort),
    ("aten::topk", topk),
    ("aten::kthvalue", kthvalue),
    ("aten::median", |c| median(c, false)),
    ("aten::nanmedian", |c| median(c, true)),
    ("aten::mode", mode),
    ("aten::cummax", |c| cummaxmin(c, true)),
    ("aten::cummin", |c| cummaxmin(c, false)),
    ("aten::_cummax_helper", |c| cum_helper(c, true)),
    ("aten::_cummin_helper", |c| cum_helper(c, false)),
    ("aten::nonzero_static", nonzero_static),
    ("aten::_logcumsumexp", logcumsumexp),
    ("aten::searchsorted", searchsorted),
    ("aten::bucketize", bucketize),
    ("aten::isin", isin),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Arg, Args, LowerError};

    use crate::args::param_arg as tensor;

    /// Runs `rule` and returns the shapes of its tensor results.
    fn shapes(rule: Rule, items: Vec<(&str, Arg)>, b: &mut Builder) -> LResult<Vec<Vec<i64>>> {
        let args = Args {
            items: items.into_iter().map(|(n, a)| (n.to_string(), a)).collect(),
        };
        let mut c = Ctx::new(b, "aten::test", "", &args);
        let outs = rule(&mut c)?;
        Ok(outs
            .iter()
            .filter_map(|o| match o {
                Out::T(v) => Some(c.b.shape(*v)),
                _ => None,
            })
            .collect())
    }

    fn ok(r: LResult<Vec<Vec<i64>>>) -> Vec<Vec<i64>> {
        match r {
            Ok(s) => s,
            Err(LowerError::Declined(w)) | Err(LowerError::User(_, w)) => panic!("{w}"),
        }
    }

    fn user_error(r: LResult<Vec<Vec<i64>>>) -> (ErrorKind, String) {
        match r {
            Err(LowerError::User(k, m)) => (k, m),
            other => panic!("expected a user error, got {other:?}"),
        }
    }

    #[test]
    fn claimed_ops_have_rules() {
        for n in CLAIMED {
            assert!(RULES.iter().any(|(r, _)| r == n), "{n}");
        }
    }

    #[test]
    fn sort_and_selection_shapes() {
        let mut b = Builder::new();
        let x = tensor(&mut b, DType::F32, &[4, 6]);
        let s = ok(shapes(
            sort,
            vec![("self", x.clone()), ("dim", Arg::Int(0))],
            &mut b,
        ));
        assert_eq!(s, vec![vec![4, 6], vec![4, 6]]);
        let s = ok(shapes(
            topk,
            vec![("self", x.clone()), ("k", Arg::Int(2))],
            &mut b,
        ));
        assert_eq!(s, vec![vec![4, 2], vec![4, 2]]);
        let s = ok(shapes(
            kthvalue,
            vec![
                ("self", x.clone()),
                ("k", Arg::Int(3)),
                ("dim", Arg::Int(0)),
                ("keepdim", Arg::Bool(true)),
            ],
            &mut b,
        ));
        assert_eq!(s, vec![vec![1, 6], vec![1, 6]]);
        let s = ok(shapes(
            |c| median(c, true),
            vec![("self", x.clone())],
            &mut b,
        ));
        assert_eq!(s, vec![Vec::<i64>::new()]);
        let s = ok(shapes(mode, vec![("self", x.clone())], &mut b));
        assert_eq!(s, vec![vec![4], vec![4]]);
        let (k, m) = user_error(shapes(topk, vec![("self", x), ("k", Arg::Int(7))], &mut b));
        assert_eq!(k, ErrorKind::Runtime);
        assert_eq!(m, "selected index k out of range");
    }

    #[test]
    fn searchsorted_checks_leading_dims() {
        let mut b = Builder::new();
        let seq = tensor(&mut b, DType::F32, &[2, 5]);
        let v = tensor(&mut b, DType::I64, &[2, 3]);
        let s = ok(shapes(
            searchsorted,
            vec![("sorted_sequence", seq.clone()), ("self", v)],
            &mut b,
        ));
        assert_eq!(s, vec![vec![2, 3]]);
        let v = tensor(&mut b, DType::F32, &[3, 3]);
        let (_, m) = user_error(shapes(
            searchsorted,
            vec![("sorted_sequence", seq), ("self", v)],
            &mut b,
        ));
        assert!(
            m.contains("boundaries tensor [2, 5] and input value tensor [3, 3]"),
            "{m}"
        );
    }
}
