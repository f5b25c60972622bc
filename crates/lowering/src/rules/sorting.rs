//! Sorting and selection (sort, topk, kthvalue, median, mode), scans with indices
//! (cummax/cummin, logcumsumexp), searchsorted/bucketize, vector norms and distances, and the
//! dense linear algebra XLA has natively (cholesky, triangular_solve) with its neighbours.
//!
//! Sorts are stable with NaN as the largest value, as PyTorch orders them; ties therefore
//! resolve to the lowest index. Where PyTorch's CPU kernels select with unstable partial
//! sorts (topk, kthvalue) the values match but tied indices may differ.

use stablehlo::{CmpDir, ReduceKind};

use super::decomp::{need_float, need_square as check_square};
use super::reduce::{reduce_keep, scan};
use crate::args::Scalar;
use crate::promote::{promote_types, result_type, torch_name, Operand};
use crate::shape::{broadcast_shapes, numel, reduce_dims, reduced_shape, wrap_dim};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};

/// Ops whose composite kernels stand in the way; the glue must route all their overloads
/// here (`rules::claimed`). cummax/cummin otherwise split into CPU-only helpers
/// (`_cummax_helper`), and `mode.values` rejects devices other than CPU/CUDA/XPU.
pub const CLAIMED: &[&str] = &["aten::cummax", "aten::cummin", "aten::mode"];

fn input(c: &Ctx) -> LResult<TensorArg> {
    Ok(c.args.tensor("self")?.clone())
}

fn is_nan(b: &mut Builder, x: Value) -> Value {
    b.compare(x, x, CmpDir::Ne)
}

fn pow(b: &mut Builder, x: Value, p: f64) -> Value {
    let k = b.splat(x, p);
    b.binary("stablehlo.power", x, k)
}

fn scale(b: &mut Builder, x: Value, k: f64) -> Value {
    let k = b.splat(x, k);
    b.mul(x, k)
}

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

// ---------------------------------------------------------------------------
// sort, topk, kthvalue, median, mode
// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------
// Scans: cummax/cummin with indices, logcumsumexp
// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------
// searchsorted, bucketize
// ---------------------------------------------------------------------------

/// For each value, how many boundaries precede it: `b < v` (left) or `b <= v` (right),
/// written as `!(b >= v)` / `!(b > v)` so a NaN value lands past every boundary. On
/// sorted, NaN-free boundaries this is the binary search's answer.
/// `seq` is [..., n] (or [n], shared); `vals` has `seq`'s leading dims.
fn count_before(b: &mut Builder, seq: Value, vals: Value, right: bool, out: DType) -> Value {
    let ss = b.shape(seq);
    let vs = b.shape(vals);
    let n = ss[ss.len() - 1];
    let mut full = vs.clone();
    full.push(n);
    let r = vs.len();
    let sb = if ss.len() == 1 {
        b.broadcast_in_dim(seq, &full, &[r as i64])
    } else {
        let dims: Vec<i64> = (0..r as i64 - 1).chain([r as i64]).collect();
        b.broadcast_in_dim(seq, &full, &dims)
    };
    let all: Vec<i64> = (0..r as i64).collect();
    let vb = b.broadcast_in_dim(vals, &full, &all);
    let dir = if right { CmpDir::Gt } else { CmpDir::Ge };
    let at_or_after = b.compare(sb, vb, dir);
    let before = b.not(at_or_after);
    let ones = b.convert(before, out);
    b.reduce(ones, &[r as i64], ReduceKind::Sum)
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

// ---------------------------------------------------------------------------
// Norms
// ---------------------------------------------------------------------------

/// `ord`-norm of `x` over `dims` (keepdim shape), in `x`'s dtype.
pub(crate) fn norm_keep(b: &mut Builder, x: Value, dims: &[i64], ord: f64) -> Value {
    let a = b.abs(x);
    if ord == f64::INFINITY {
        reduce_keep(b, a, dims, ReduceKind::Max, true)
    } else if ord == f64::NEG_INFINITY {
        reduce_keep(b, a, dims, ReduceKind::Min, true)
    } else if ord == 0.0 {
        let z = b.splat(x, 0.0);
        let nz = b.compare(x, z, CmpDir::Ne);
        let nz = b.convert(nz, b.dtype(x));
        reduce_keep(b, nz, dims, ReduceKind::Sum, true)
    } else if ord == 1.0 {
        reduce_keep(b, a, dims, ReduceKind::Sum, true)
    } else if ord == 2.0 {
        let sq = b.mul(x, x);
        let s = reduce_keep(b, sq, dims, ReduceKind::Sum, true);
        b.sqrt(s)
    } else {
        let p = pow(b, a, ord);
        let s = reduce_keep(b, p, dims, ReduceKind::Sum, true);
        pow(b, s, 1.0 / ord)
    }
}

/// Half types, which PyTorch's CPU distance, histogram and LAPACK kernels reject (the
/// fallback reports that).
fn is_half(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16)
}

/// The dtype norms accumulate in: float32 for half types.
fn acc_float(d: DType) -> DType {
    match d {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

fn scalar_str(s: Scalar) -> String {
    match s {
        Scalar::Int(i) => i.to_string(),
        Scalar::Float(f) => format!("{f}"),
        Scalar::Bool(b) => (b as i64).to_string(),
        Scalar::Complex(re, im) => format!("({re}+{im}j)"),
    }
}

/// linalg_vector_norm and the `norm` overloads (`p` may be None: 2).
fn vector_norm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    // norm's own message only for its overloads without a dtype.
    let linalg = c.op == "aten::linalg_vector_norm" || c.args.has("dtype");
    if !t.dtype.is_float() {
        let msg = if linalg {
            format!(
                "linalg.vector_norm: Expected a floating point or complex tensor as input. Got {}",
                torch_name(t.dtype)
            )
        } else {
            format!(
                "norm(): input dtype should be either floating point or complex. Got {} instead.",
                torch_name(t.dtype)
            )
        };
        return user_err(ErrorKind::NotImplemented, msg);
    }
    let dtype = c.args.opt_dtype("dtype");
    if let Some(d) = dtype {
        if !d.is_float() {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "linalg.vector_norm: dtype should be floating point or complex, but got {}",
                    torch_name(d)
                ),
            );
        }
    }
    if let (Some(d), false) = (dtype, c.op == "aten::linalg_vector_norm") {
        if promote_types(t.dtype, d) != d {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "linalg.vector_norm: the dtype of the input ({}) should be convertible without narrowing to the specified dtype ({})",
                    torch_name(t.dtype),
                    torch_name(d)
                ),
            );
        }
    }
    let ord = c
        .args
        .opt_scalar("ord")
        .or(c.args.opt_scalar("p"))
        .unwrap_or(Scalar::Int(2));
    let p = ord.as_f64();
    let given = c.args.opt_ints("dim");
    let dims = reduce_dims(given.as_deref(), t.shape.len())?;
    let keep = c.args.bool_or("keepdim", false);
    if numel(&t.shape) == 0 && (p < 0.0 || p == f64::INFINITY) {
        match given.as_deref() {
            Some(d) if !d.is_empty() => {
                for d in &dims {
                    if t.shape[*d as usize] == 0 {
                        return user_err(
                            ErrorKind::Runtime,
                            format!(
                                "linalg.vector_norm cannot compute the {} norm on the dimension {d}because this dimension is empty and the operation does not have an identity",
                                scalar_str(ord)
                            ),
                        );
                    }
                }
            }
            _ => {
                return user_err(
                    ErrorKind::Runtime,
                    format!(
                        "linalg.vector_norm cannot compute the {} norm on an empty tensor because the operation does not have an identity",
                        scalar_str(ord)
                    ),
                )
            }
        }
    }
    let out_dt = dtype.unwrap_or(t.dtype);
    let b = &mut *c.b;
    let x = b.convert(t.value, acc_float(out_dt));
    let r = norm_keep(b, x, &dims, p);
    let r = b.reshape(r, &reduced_shape(&t.shape, &dims, keep));
    Ok(vec![Out::T(b.convert(r, out_dt))])
}

fn renorm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let p = c.args.scalar("p")?;
    let maxnorm = c.args.scalar("maxnorm")?;
    if p.as_f64() <= 0.0 {
        return user_err(
            ErrorKind::Runtime,
            "renorm: non-positive-norm not supported",
        );
    }
    if maxnorm.as_f64() < 0.0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "renorm: expected maxnorm to be >= 0 but got {}",
                scalar_str(maxnorm)
            ),
        );
    }
    if t.shape.len() < 2 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "renorm: input needs at least 2 dimensions, got {} dimensions",
                t.shape.len()
            ),
        );
    }
    if !t.dtype.is_float() {
        return user_err(
            ErrorKind::NotImplemented,
            format!(
                "linalg.vector_norm: Expected a floating point or complex tensor as input. Got {}",
                torch_name(t.dtype)
            ),
        );
    }
    let dim = wrap_dim(c.args.int("dim")?, t.shape.len())? as i64;
    let others: Vec<i64> = (0..t.shape.len() as i64).filter(|d| *d != dim).collect();
    let b = &mut *c.b;
    let x = b.convert(t.value, acc_float(t.dtype));
    let norm = norm_keep(b, x, &others, p.as_f64());
    // Slices whose norm exceeds maxnorm are scaled to maxnorm / (norm + 1e-7).
    let mx = b.splat(norm, maxnorm.as_f64());
    let eps = b.splat(norm, 1e-7);
    let den = b.add(norm, eps);
    let f = b.div(mx, den);
    let one = b.splat(norm, 1.0);
    let over = b.compare(norm, mx, CmpDir::Gt);
    let f = b.select(over, f, one);
    let f = b.convert(f, t.dtype);
    let f = b.broadcast_to(f, &t.shape);
    Ok(vec![Out::T(b.mul(t.value, f))])
}

// ---------------------------------------------------------------------------
// Distances: cdist, pdist and their backward
// ---------------------------------------------------------------------------

/// `p`-distances between the rows of `x` [..., r1, m] and `y` [..., r2, m] (same batch),
/// computed per pair as PyTorch's direct kernel does: [..., r1, r2].
fn pair_dist(b: &mut Builder, x: Value, y: Value, p: f64) -> Value {
    let (xs, ys) = (b.shape(x), b.shape(y));
    let nb = xs.len() - 2;
    let (r1, r2, m) = (xs[nb], ys[nb], xs[nb + 1]);
    let mut full: Vec<i64> = xs[..nb].to_vec();
    full.extend([r1, r2, m]);
    let bd: Vec<i64> = (0..nb as i64).collect();
    let xd: Vec<i64> = bd
        .iter()
        .copied()
        .chain([nb as i64, nb as i64 + 2])
        .collect();
    let yd: Vec<i64> = bd
        .iter()
        .copied()
        .chain([nb as i64 + 1, nb as i64 + 2])
        .collect();
    let xb = b.broadcast_in_dim(x, &full, &xd);
    let yb = b.broadcast_in_dim(y, &full, &yd);
    let d = b.sub(xb, yb);
    let d = b.abs(d);
    let last = [nb as i64 + 2];
    if p == 0.0 {
        let cl = b.unary("stablehlo.ceil", d);
        let one = b.splat(cl, 1.0);
        let t = b.min(cl, one);
        b.reduce(t, &last, ReduceKind::Sum)
    } else if p == 1.0 {
        b.reduce(d, &last, ReduceKind::Sum)
    } else if p == 2.0 {
        let sq = b.mul(d, d);
        let s = b.reduce(sq, &last, ReduceKind::Sum);
        b.sqrt(s)
    } else if p.is_infinite() {
        // The kernel's running max starts at 0.
        let z = b.constant(b.dtype(d), 0.0);
        b.reduce_with(&[d], &[z], &last, |b, a| vec![b.max(a[0], a[1])])[0]
    } else {
        let t = pow(b, d, p);
        let s = b.reduce(t, &last, ReduceKind::Sum);
        pow(b, s, 1.0 / p)
    }
}

/// Euclidean distances through one matrix product, as PyTorch's `_euclidean_dist` computes
/// them for large inputs.
fn euclid_mm(b: &mut Builder, x: Value, y: Value) -> Value {
    let nb = b.rank(x) - 2;
    let last = nb + 1;
    let sq = b.mul(x, x);
    let xn = reduce_keep(b, sq, &[last as i64], ReduceKind::Sum, true);
    let sq = b.mul(y, y);
    let yn = reduce_keep(b, sq, &[last as i64], ReduceKind::Sum, true);
    let xp = b.splat(xn, 1.0);
    let yp = b.splat(yn, 1.0);
    let xm = scale(b, x, -2.0);
    let xa = b.concatenate(&[xm, xn, xp], last);
    let ya = b.concatenate(&[y, yp, yn], last);
    let bd: Vec<i64> = (0..nb as i64).collect();
    let dt = b.dtype(x);
    let r = b.dot_general(xa, ya, (&bd, &bd), (&[last as i64], &[last as i64]), dt);
    let z = b.splat(r, 0.0);
    let r = b.max(r, z);
    b.sqrt(r)
}

struct CdistArgs {
    x1: TensorArg,
    x2: TensorArg,
    batch: Vec<i64>,
    r1: i64,
    r2: i64,
    m: i64,
}

fn cdist_args(c: &Ctx) -> LResult<CdistArgs> {
    let x1 = c.args.tensor("x1")?.clone();
    let x2 = c.args.tensor("x2")?.clone();
    for (t, n) in [(&x1, "X1"), (&x2, "X2")] {
        if t.shape.len() < 2 {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "cdist only supports at least 2D tensors, {n} got: {}D",
                    t.shape.len()
                ),
            );
        }
    }
    let (l1, l2) = (x1.shape.len(), x2.shape.len());
    if x1.shape[l1 - 1] != x2.shape[l2 - 1] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "X1 and X2 must have the same number of columns. X1: {} X2: {}",
                x1.shape[l1 - 1],
                x2.shape[l2 - 1]
            ),
        );
    }
    for (t, n) in [(&x1, "X1"), (&x2, "X2")] {
        if !t.dtype.is_float() {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "cdist only supports floating-point dtypes, {n} got: {}",
                    torch_name(t.dtype)
                ),
            );
        }
    }
    if x1.dtype != x2.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "expected scalar type {} but found {}",
                torch_name(x1.dtype),
                torch_name(x2.dtype)
            ),
        );
    }
    if is_half(x1.dtype) {
        return decline("cdist of half tensors");
    }
    let batch = broadcast_shapes(&x1.shape[..l1 - 2], &x2.shape[..l2 - 2])?;
    Ok(CdistArgs {
        r1: x1.shape[l1 - 2],
        r2: x2.shape[l2 - 2],
        m: x1.shape[l1 - 1],
        x1,
        x2,
        batch,
    })
}

fn cdist_forward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = cdist_args(c)?;
    let p = c.args.float("p")?;
    if p < 0.0 {
        return user_err(
            ErrorKind::Runtime,
            "cdist only supports non-negative p values",
        );
    }
    let mode = c.args.opt_int("compute_mode").unwrap_or(0);
    if !(0..=2).contains(&mode) {
        return user_err(
            ErrorKind::Runtime,
            format!("possible modes: 0, 1, 2, but was: {mode}"),
        );
    }
    let mut out = a.batch.clone();
    out.extend([a.r1, a.r2]);
    let b = &mut *c.b;
    if numel(&out) == 0 || a.m == 0 {
        return Ok(vec![Out::T(b.full(a.x1.dtype, &out, 0.0))]);
    }
    let mut s1 = a.batch.clone();
    s1.extend([a.r1, a.m]);
    let mut s2 = a.batch.clone();
    s2.extend([a.r2, a.m]);
    let x = b.broadcast_to(a.x1.value, &s1);
    let y = b.broadcast_to(a.x2.value, &s2);
    let mm = p == 2.0 && (mode == 1 || (mode == 0 && (a.r1 > 25 || a.r2 > 25)));
    let r = if mm {
        euclid_mm(b, x, y)
    } else {
        pair_dist(b, x, y, p)
    };
    Ok(vec![Out::T(r)])
}

/// d dist(x, y) / dx for each pair and column, scaled by `g` (all [..., m]-broadcast), as
/// PyTorch's distance backward kernels define it (0 where the distance is 0).
fn dist_grad(b: &mut Builder, diff: Value, g: Value, dist: Value, p: f64) -> Value {
    let zero = b.splat(diff, 0.0);
    let sign = b.unary("stablehlo.sign", diff);
    let ad = b.abs(diff);
    let dist0 = b.compare(dist, zero, CmpDir::Eq);
    if p == 0.0 {
        zero
    } else if p == 1.0 {
        b.mul(g, sign)
    } else if p < 2.0 {
        let t = pow(b, ad, p - 1.0);
        let t = b.mul(sign, t);
        let t = b.mul(t, g);
        let dp = pow(b, dist, p - 1.0);
        let t = b.div(t, dp);
        let t = b.select(dist0, zero, t);
        if p < 1.0 {
            let d0 = b.compare(diff, zero, CmpDir::Eq);
            b.select(d0, zero, t)
        } else {
            t
        }
    } else if p == 2.0 {
        let t = b.mul(g, diff);
        let t = b.div(t, dist);
        b.select(dist0, zero, t)
    } else if p.is_infinite() {
        // 1 where |diff| is the distance, else 0.
        let t = b.sub(ad, dist);
        let t = b.abs(t);
        let t = b.unary("stablehlo.ceil", t);
        let one = b.splat(t, 1.0);
        let t = b.min(one, t);
        let t = b.sub(one, t);
        let gs = b.mul(g, sign);
        b.mul(gs, t)
    } else {
        let t = pow(b, ad, p - 2.0);
        let t = b.mul(diff, t);
        let t = b.mul(t, g);
        let dp = pow(b, dist, p - 1.0);
        let t = b.div(t, dp);
        b.select(dist0, zero, t)
    }
}

fn cdist_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = cdist_args(c)?;
    let p = c.args.float("p")?;
    let g = c.args.tensor("grad_output")?.clone();
    let dist = c.args.tensor("cdist")?.clone();
    let b = &mut *c.b;
    if a.r1 == 0 || a.r2 == 0 || a.m == 0 || numel(&a.batch) == 0 {
        return Ok(vec![Out::T(b.full(a.x1.dtype, &a.x1.shape, 0.0))]);
    }
    let nb = a.batch.len() as i64;
    let mut full = a.batch.clone();
    full.extend([a.r1, a.r2, a.m]);
    let mut s1 = a.batch.clone();
    s1.extend([a.r1, a.m]);
    let mut s2 = a.batch.clone();
    s2.extend([a.r2, a.m]);
    let mut s12 = a.batch.clone();
    s12.extend([a.r1, a.r2]);
    let bd: Vec<i64> = (0..nb).collect();
    let x = b.broadcast_to(a.x1.value, &s1);
    let y = b.broadcast_to(a.x2.value, &s2);
    let xd: Vec<i64> = bd.iter().copied().chain([nb, nb + 2]).collect();
    let yd: Vec<i64> = bd.iter().copied().chain([nb + 1, nb + 2]).collect();
    let pd: Vec<i64> = bd.iter().copied().chain([nb, nb + 1]).collect();
    let xb = b.broadcast_in_dim(x, &full, &xd);
    let yb = b.broadcast_in_dim(y, &full, &yd);
    let diff = b.sub(xb, yb);
    let gv = b.convert(g.value, a.x1.dtype);
    let gv = b.broadcast_to(gv, &s12);
    let gb = b.broadcast_in_dim(gv, &full, &pd);
    let dv = b.broadcast_to(dist.value, &s12);
    let db = b.broadcast_in_dim(dv, &full, &pd);
    let t = dist_grad(b, diff, gb, db, p);
    Ok(vec![Out::T(b.reduce(t, &[nb + 1], ReduceKind::Sum))])
}

/// Offsets of each row's pairs (i, j > i) in pdist's condensed order.
fn pdist_row_start(n: i64, i: i64) -> i64 {
    i * (2 * n - i - 1) / 2
}

fn pdist_forward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let p = c.args.float("p")?;
    if t.shape.len() != 2 {
        return user_err(
            ErrorKind::Runtime,
            format!("pdist only supports 2D tensors, got: {}D", t.shape.len()),
        );
    }
    if !t.dtype.is_float() {
        return user_err(
            ErrorKind::Runtime,
            "pdist only supports floating-point dtypes",
        );
    }
    if p < 0.0 {
        return user_err(
            ErrorKind::Runtime,
            "pdist only supports non-negative p values",
        );
    }
    if is_half(t.dtype) {
        return decline("pdist of half tensors");
    }
    let (n, m) = (t.shape[0], t.shape[1]);
    let k = if n <= 1 { 0 } else { n * (n - 1) / 2 };
    let b = &mut *c.b;
    if k == 0 || m == 0 {
        return Ok(vec![Out::T(b.full(t.dtype, &[k], 0.0))]);
    }
    let d = pair_dist(b, t.value, t.value, p);
    // The upper triangle, row by row.
    let rows: Vec<Value> = (0..n - 1)
        .map(|i| {
            let r = b.slice(d, &[i, i + 1], &[i + 1, n], &[1, 1]);
            b.reshape(r, &[n - 1 - i])
        })
        .collect();
    Ok(vec![Out::T(b.concatenate(&rows, 0))])
}

/// A condensed pdist vector [n(n-1)/2] as the symmetric [n, n] matrix (0 diagonal).
fn pdist_square(b: &mut Builder, v: Value, n: i64) -> Value {
    let z = b.constant(b.dtype(v), 0.0);
    let rows: Vec<Value> = (0..n)
        .map(|i| {
            let s = pdist_row_start(n, i);
            let r = b.slice(v, &[s], &[s + n - 1 - i], &[1]);
            let r = b.pad(r, z, &[i + 1], &[0], &[0]);
            b.reshape(r, &[1, n])
        })
        .collect();
    let up = b.concatenate(&rows, 0);
    let lo = b.transpose(up, &[1, 0]);
    b.add(up, lo)
}

fn pdist_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let p = c.args.float("p")?;
    let g = c.args.tensor("grad_output")?.clone();
    let dist = c.args.tensor("pdist")?.clone();
    if t.shape.len() != 2 {
        return decline("pdist backward of a non-matrix");
    }
    let (n, m) = (t.shape[0], t.shape[1]);
    let b = &mut *c.b;
    if n <= 1 || m == 0 || p == 0.0 {
        return Ok(vec![Out::T(b.full(t.dtype, &t.shape, 0.0))]);
    }
    let gv = b.convert(g.value, t.dtype);
    let gsq = pdist_square(b, gv, n);
    let dsq = pdist_square(b, dist.value, n);
    let full = [n, n, m];
    let xi = b.broadcast_in_dim(t.value, &full, &[0, 2]);
    let xj = b.broadcast_in_dim(t.value, &full, &[1, 2]);
    let diff = b.sub(xi, xj);
    let gb = b.broadcast_in_dim(gsq, &full, &[0, 1]);
    let db = b.broadcast_in_dim(dsq, &full, &[0, 1]);
    // Each pair's term is odd in the difference, so row i collects +f(x_i - x_j) for all j.
    let r = dist_grad(b, diff, gb, db, p);
    Ok(vec![Out::T(b.reduce(r, &[1], ReduceKind::Sum))])
}

// ---------------------------------------------------------------------------
// Triangular matrices, cholesky, triangular solves
// ---------------------------------------------------------------------------

/// Where `col - row <= k` (lower) or `>= k` (upper) over the last two dims of `shape`.
fn tri_mask(b: &mut Builder, shape: &[i64], lower: bool, k: i64) -> Value {
    let r = shape.len();
    let row = b.iota(DType::I64, shape, r - 2);
    let col = b.iota(DType::I64, shape, r - 1);
    let d = b.sub(col, row);
    let kk = b.full(DType::I64, shape, k as f64);
    b.compare(d, kk, if lower { CmpDir::Le } else { CmpDir::Ge })
}

fn tril_triu(c: &mut Ctx, lower: bool) -> LResult<Vec<Out>> {
    let t = input(c)?;
    if t.shape.len() < 2 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{}: input tensor must have at least 2 dimensions",
                if lower { "tril" } else { "triu" }
            ),
        );
    }
    let k = c.args.int_or("diagonal", 0);
    let b = &mut *c.b;
    let mask = tri_mask(b, &t.shape, lower, k);
    let z = b.splat(t.value, 0.0);
    Ok(vec![Out::T(b.select(mask, t.value, z))])
}

/// The LAPACK-backed ops' dtype check: floating point, and no half types (the CPU has no
/// half kernels for them).
fn check_float(op: &str, d: DType) -> LResult<()> {
    need_float(op, d)?;
    if is_half(d) {
        return decline("LAPACK ops reject half types");
    }
    Ok(())
}

fn cholesky_ex(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = input(c)?;
    check_square("linalg.cholesky", "A", &a.shape)?;
    check_float("linalg.cholesky", a.dtype)?;
    if c.args.bool_or("check_errors", false) {
        return decline("check_errors reads the info on the host");
    }
    let upper = c.args.bool_or("upper", false);
    let b = &mut *c.b;
    let shape = a.shape.clone();
    let r = shape.len();
    let n = shape[r - 1];
    let batch = &shape[..r - 2];
    if n == 0 {
        let info = b.full(DType::I32, batch, 0.0);
        return Ok(vec![Out::T(a.value), Out::T(info)]);
    }
    let l = b.cholesky(a.value, !upper);
    let keep = tri_mask(b, &shape, !upper, 0);
    let z = b.splat(l, 0.0);
    let l = b.select(keep, l, z);
    // info: 1 + the first column whose pivot is not positive (NaN included), else 0.
    let on_diag = tri_mask(b, &shape, true, 0);
    let on_upper = tri_mask(b, &shape, false, 0);
    let on_diag = b.and(on_diag, on_upper);
    let d = b.select(on_diag, l, z);
    let d = b.reduce(d, &[r as i64 - 1], ReduceKind::Sum);
    let dz = b.splat(d, 0.0);
    let ok = b.compare(d, dz, CmpDir::Gt);
    let dshape = b.shape(d);
    let pos = b.iota(DType::I32, &dshape, r - 2);
    let one = b.full(DType::I32, &dshape, 1.0);
    let pos = b.add(pos, one);
    let none = b.full(DType::I32, &dshape, (n + 1) as f64);
    let bad = b.select(ok, none, pos);
    let first = b.reduce(bad, &[r as i64 - 2], ReduceKind::Min);
    let past = b.splat(first, (n + 1) as f64);
    let zero = b.splat(first, 0.0);
    let found = b.compare(first, past, CmpDir::Lt);
    let info = b.select(found, first, zero);
    Ok(vec![Out::T(l), Out::T(info)])
}

/// `a` [..., n, n] and `rhs` [..., p, q] broadcast to a common batch.
fn batch_pair(b: &mut Builder, a: &TensorArg, rhs: &TensorArg) -> LResult<(Value, Value)> {
    let (ra, rb) = (a.shape.len(), rhs.shape.len());
    let batch = broadcast_shapes(&a.shape[..ra - 2], &rhs.shape[..rb - 2])?;
    let mut sa = batch.clone();
    sa.extend_from_slice(&a.shape[ra - 2..]);
    let mut sb = batch;
    sb.extend_from_slice(&rhs.shape[rb - 2..]);
    Ok((b.broadcast_to(a.value, &sa), b.broadcast_to(rhs.value, &sb)))
}

fn solve(
    b: &mut Builder,
    a: Value,
    rhs: Value,
    left: bool,
    lower: bool,
    unit: bool,
    transpose: bool,
) -> Value {
    if numel(&b.shape(rhs)) == 0 || numel(&b.shape(a)) == 0 {
        let s = b.shape(rhs);
        return b.full(b.dtype(rhs), &s, 0.0);
    }
    b.triangular_solve(a, rhs, left, lower, unit, transpose)
}

fn triangular_solve(c: &mut Ctx) -> LResult<Vec<Out>> {
    let rhs = input(c)?;
    let a = c.args.tensor("A")?.clone();
    for (t, n) in [(&rhs, "b"), (&a, "A")] {
        if t.shape.len() < 2 {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "torch.triangular_solve: Expected {n} to have at least 2 dimensions, but it has {} dimensions instead",
                    t.shape.len()
                ),
            );
        }
    }
    if rhs.dtype != a.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected b and A to have the same dtype, but found b of type {} and A of type {} instead.",
                torch_name(rhs.dtype),
                torch_name(a.dtype)
            ),
        );
    }
    let (ra, rb) = (a.shape.len(), rhs.shape.len());
    let (an, am) = (a.shape[ra - 2], a.shape[ra - 1]);
    if an != am || am != rhs.shape[rb - 2] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Incompatible matrix sizes for triangular_solve: each A matrix is {an} by {am} but each b matrix is {} by {}",
                rhs.shape[rb - 2],
                rhs.shape[rb - 1]
            ),
        );
    }
    if !a.dtype.is_float() && !a.dtype.is_complex() {
        return user_err(
            ErrorKind::NotImplemented,
            format!(
                "\"triangular_solve_cpu\" not implemented for '{}'",
                torch_name(a.dtype)
            ),
        );
    }
    if is_half(a.dtype) {
        return decline("LAPACK ops reject half types");
    }
    let upper = c.args.bool_or("upper", true);
    let trans = c.args.bool_or("transpose", false);
    let unit = c.args.bool_or("unitriangular", false);
    let b = &mut *c.b;
    let (av, bv) = batch_pair(b, &a, &rhs)?;
    let x = solve(b, av, bv, true, !upper, unit, trans);
    Ok(vec![Out::T(x), Out::T(av)])
}

fn solve_triangular(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = input(c)?;
    let rhs = c.args.tensor("B")?.clone();
    const OP: &str = "linalg.solve_triangular";
    if a.shape.len() < 2 {
        return user_err(
            ErrorKind::Runtime,
            format!("{OP}: The input tensor A must have at least 2 dimensions."),
        );
    }
    if rhs.shape.len() < 2 {
        return user_err(
            ErrorKind::Runtime,
            format!("{OP}: The input tensor B must have at least 2 dimensions."),
        );
    }
    check_square(OP, "A", &a.shape)?;
    let left = c.args.bool_or("left", true);
    let (ra, rb) = (a.shape.len(), rhs.shape.len());
    let n = a.shape[ra - 1];
    let fits = if left {
        rhs.shape[rb - 2] == n
    } else {
        rhs.shape[rb - 1] == n
    };
    if !fits {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{OP}: Incompatible shapes of A and B for the equation {} ({n}x{n} and {}x{})",
                if left { "AX = B" } else { "XA = B" },
                rhs.shape[rb - 2],
                rhs.shape[rb - 1]
            ),
        );
    }
    check_float(OP, a.dtype)?;
    if rhs.dtype != a.dtype {
        return decline("solve_triangular with mixed dtypes");
    }
    let upper = c.args.bool_or("upper", false);
    let unit = c.args.bool_or("unitriangular", false);
    let b = &mut *c.b;
    let (av, bv) = batch_pair(b, &a, &rhs)?;
    Ok(vec![Out::T(solve(b, av, bv, left, !upper, unit, false))])
}

/// Solves (L L^T) X = B from the factor (U^T U with `upper`).
fn cholesky_solve_values(b: &mut Builder, f: Value, rhs: Value, upper: bool) -> Value {
    let y = solve(b, f, rhs, true, !upper, false, upper);
    solve(b, f, y, true, !upper, false, !upper)
}

fn cholesky_solve_helper(c: &mut Ctx) -> LResult<Vec<Out>> {
    let rhs = input(c)?;
    let f = c.args.tensor("A")?.clone();
    let bad = !f.dtype.is_float() || is_half(f.dtype) || f.dtype != rhs.dtype;
    if bad || f.shape.len() < 2 || rhs.shape.len() < 2 {
        return decline("cholesky_solve needs float matrices of one dtype");
    }
    let upper = c.args.bool_or("upper", false);
    let b = &mut *c.b;
    let (fv, bv) = batch_pair(b, &f, &rhs)?;
    Ok(vec![Out::T(cholesky_solve_values(b, fv, bv, upper))])
}

fn cholesky_inverse(c: &mut Ctx) -> LResult<Vec<Out>> {
    let f = input(c)?;
    check_square("cholesky_inverse", "A", &f.shape)?;
    if !f.dtype.is_float() {
        return user_err(
            ErrorKind::NotImplemented,
            format!(
                "\"cholesky_inverse_out_cpu\" not implemented for '{}'",
                torch_name(f.dtype)
            ),
        );
    }
    if is_half(f.dtype) {
        return decline("LAPACK ops reject half types");
    }
    let upper = c.args.bool_or("upper", false);
    let b = &mut *c.b;
    let r = f.shape.len();
    let row = b.iota(DType::I64, &f.shape, r - 2);
    let col = b.iota(DType::I64, &f.shape, r - 1);
    let eye = b.compare(row, col, CmpDir::Eq);
    let eye = b.convert(eye, f.dtype);
    Ok(vec![Out::T(cholesky_solve_values(b, f.value, eye, upper))])
}

// ---------------------------------------------------------------------------
// Small reductions and products
// ---------------------------------------------------------------------------

fn trace(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    if t.shape.len() != 2 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "trace: expected a matrix, but got tensor with dim {}",
                t.shape.len()
            ),
        );
    }
    if t.dtype == DType::Bool {
        return user_err(
            ErrorKind::NotImplemented,
            "\"trace\" not implemented for 'Bool'",
        );
    }
    let dt = if t.dtype.is_float() || t.dtype.is_complex() {
        t.dtype
    } else {
        DType::I64
    };
    let b = &mut *c.b;
    let x = b.convert(t.value, acc_float(dt));
    let row = b.iota(DType::I64, &t.shape, 0);
    let col = b.iota(DType::I64, &t.shape, 1);
    let diag = b.compare(row, col, CmpDir::Eq);
    let z = b.splat(x, 0.0);
    let d = b.select(diag, x, z);
    let r = b.reduce(d, &[0, 1], ReduceKind::Sum);
    Ok(vec![Out::T(b.convert(r, dt))])
}

fn linalg_cross(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = input(c)?;
    let y = c.args.tensor("other")?.clone();
    if x.shape.len() != y.shape.len() {
        return user_err(
            ErrorKind::Runtime,
            "linalg.cross: inputs must have the same number of dimensions.",
        );
    }
    let d = c.args.int_or("dim", -1);
    let dim = wrap_dim(d, x.shape.len())?;
    if x.shape.is_empty() || x.shape[dim] != 3 || y.shape[dim] != 3 {
        let (a, bb) = (
            x.shape.get(dim).copied().unwrap_or(1),
            y.shape.get(dim).copied().unwrap_or(1),
        );
        return user_err(
            ErrorKind::Runtime,
            format!("linalg.cross: inputs dimension {d} must have length 3. Got {a} and {bb}"),
        );
    }
    if x.dtype != y.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "expected scalar type {} but found {}",
                torch_name(x.dtype),
                torch_name(y.dtype)
            ),
        );
    }
    if x.dtype == DType::Bool {
        return decline("cross of bool tensors");
    }
    let shape = broadcast_shapes(&x.shape, &y.shape)?;
    let b = &mut *c.b;
    let xv = b.broadcast_to(x.value, &shape);
    let yv = b.broadcast_to(y.value, &shape);
    let xs: Vec<Value> = (0..3).map(|i| b.slice_dim(xv, dim, i, i + 1, 1)).collect();
    let ys: Vec<Value> = (0..3).map(|i| b.slice_dim(yv, dim, i, i + 1, 1)).collect();
    let comp = |b: &mut Builder, i: usize, j: usize| {
        let p = b.mul(xs[i], ys[j]);
        let q = b.mul(xs[j], ys[i]);
        b.sub(p, q)
    };
    let r0 = comp(b, 1, 2);
    let r1 = comp(b, 2, 0);
    let r2 = comp(b, 0, 1);
    Ok(vec![Out::T(b.concatenate(&[r0, r1, r2], dim))])
}

fn vdot(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = input(c)?;
    let y = c.args.tensor("other")?.clone();
    super::linalg::dot_checks(&x, &y)?;
    if x.dtype == DType::Bool {
        return decline("vdot of bool tensors");
    }
    let b = &mut *c.b;
    Ok(vec![Out::T(b.dot_general(
        x.value,
        y.value,
        (&[], &[]),
        (&[0], &[0]),
        x.dtype,
    ))])
}

/// histc's counts in `dt`: `pos` [n] is each value's bin (the top edge's value lands in the
/// last bin); values outside `[lo, hi]` are not counted.
fn count_bins(
    b: &mut Builder,
    x: Value,
    (lo_b, hi_b): (Value, Value),
    pos: Value,
    bins: i64,
    dt: DType,
) -> Value {
    let n = b.shape(x)[0];
    let last = b.full(DType::I64, &[n], (bins - 1) as f64);
    let pos = b.min(pos, last);
    let below = b.compare(x, lo_b, CmpDir::Lt);
    let above = b.compare(hi_b, x, CmpDir::Lt);
    let out = b.or(below, above);
    let none = b.full(DType::I64, &[n], -1.0);
    let pos = b.select(out, none, pos);
    let pb = b.broadcast_in_dim(pos, &[n, bins], &[0]);
    let ids = b.iota(DType::I64, &[n, bins], 1);
    let hit = b.compare(pb, ids, CmpDir::Eq);
    let hit = b.convert(hit, dt);
    b.reduce(hit, &[0], ReduceKind::Sum)
}

fn histc(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let bins = c.args.int_or("bins", 100);
    if t.dtype.is_int() {
        return histc_int(c, &t, bins);
    }
    if !t.dtype.is_float() {
        return user_err(
            ErrorKind::NotImplemented,
            format!(
                "\"histogram_cpu\" not implemented for '{}'",
                torch_name(t.dtype)
            ),
        );
    }
    if bins <= 0 {
        return user_err(
            ErrorKind::Runtime,
            format!("torch.histogram(): bins must be > 0, but got {bins} for dimension 0"),
        );
    }
    let lo = c.args.opt_scalar("min").map(|s| s.as_f64()).unwrap_or(0.0);
    let hi = c.args.opt_scalar("max").map(|s| s.as_f64()).unwrap_or(0.0);
    let n = numel(&t.shape);
    let dt = t.dtype;
    let b = &mut *c.b;
    let x = b.reshape(t.value, &[n]);
    // Edges: the given range, else the data's range; an empty range widens by 1 each way.
    let (lo_v, hi_v) = if lo == hi && n > 0 {
        let mn = b.reduce(x, &[0], ReduceKind::Min);
        let mx = b.reduce(x, &[0], ReduceKind::Max);
        let same = b.compare(mn, mx, CmpDir::Eq);
        let one = b.splat(mn, 1.0);
        let mn1 = b.sub(mn, one);
        let mx1 = b.add(mx, one);
        (b.select(same, mn1, mn), b.select(same, mx1, mx))
    } else {
        let (l, h) = if lo == hi {
            (lo - 1.0, hi + 1.0)
        } else {
            (lo, hi)
        };
        if !(l.is_finite() && h.is_finite()) {
            return user_err(
                ErrorKind::Runtime,
                format!("torch.histc: range of [{l}, {h}] is not finite"),
            );
        }
        if l >= h {
            return user_err(
                ErrorKind::Runtime,
                "torch.histc: max must be larger than min",
            );
        }
        (b.constant(dt, l), b.constant(dt, h))
    };
    if n == 0 {
        return Ok(vec![Out::T(b.full(dt, &[bins], 0.0))]);
    }
    let lo_b = b.broadcast_in_dim(lo_v, &[n], &[]);
    let hi_b = b.broadcast_in_dim(hi_v, &[n], &[]);
    // bin = trunc((x - lo) * bins / (hi - lo)), the top edge in the last bin.
    let num = b.sub(x, lo_b);
    let num = scale(b, num, bins as f64);
    let width = b.sub(hi_b, lo_b);
    let pos = b.div(num, width);
    let pos = b.convert(pos, DType::I64);
    Ok(vec![Out::T(count_bins(b, x, (lo_b, hi_b), pos, bins, dt))])
}

/// Integer histc with CUDA's semantics (the CPU has no integer kernel; mixture-of-experts
/// routers count expert ids with it): bounds in the input's type, bin
/// `(x - min) * bins / (max - min)` in 64-bit integer arithmetic, values outside
/// `[min, max]` not counted, counts in the input's type.
fn histc_int(c: &mut Ctx, t: &TensorArg, bins: i64) -> LResult<Vec<Out>> {
    if bins <= 0 {
        return user_err(ErrorKind::Runtime, "torch.histc: bins must be > 0");
    }
    // Scalar bounds convert to the input's type the way C++ casts: truncation, then
    // wrapping to the type's width.
    let dt = t.dtype;
    let bound = |s: Option<Scalar>| wrap_int(s.map(|s| s.as_f64()).unwrap_or(0.0) as i64, dt);
    let (lo, hi) = (
        bound(c.args.opt_scalar("min")),
        bound(c.args.opt_scalar("max")),
    );
    let n = numel(&t.shape);
    let b = &mut *c.b;
    if n == 0 {
        return Ok(vec![Out::T(b.full(dt, &[bins], 0.0))]);
    }
    let x = b.reshape(t.value, &[n]);
    let x = b.convert(x, DType::I64);
    let (lo_v, hi_v) = if lo == hi {
        let mn = b.reduce(x, &[0], ReduceKind::Min);
        let mx = b.reduce(x, &[0], ReduceKind::Max);
        (mn, mx)
    } else {
        (
            b.constant(DType::I64, lo as f64),
            b.constant(DType::I64, hi as f64),
        )
    };
    // An empty range widens by one each way.
    let same = b.compare(lo_v, hi_v, CmpDir::Eq);
    let one = b.constant(DType::I64, 1.0);
    let lo_w = b.sub(lo_v, one);
    let hi_w = b.add(hi_v, one);
    let lo_v = b.select(same, lo_w, lo_v);
    let hi_v = b.select(same, hi_w, hi_v);
    let lo_b = b.broadcast_in_dim(lo_v, &[n], &[]);
    let hi_b = b.broadcast_in_dim(hi_v, &[n], &[]);
    let num = b.sub(x, lo_b);
    let k = b.full(DType::I64, &[n], bins as f64);
    let num = b.mul(num, k);
    let width = b.sub(hi_b, lo_b);
    let pos = b.div(num, width);
    Ok(vec![Out::T(count_bins(b, x, (lo_b, hi_b), pos, bins, dt))])
}

/// `v` as C++ converts an int64 to integer type `dt` (two's-complement wrapping).
fn wrap_int(v: i64, dt: DType) -> i64 {
    match dt {
        DType::U8 => v as u8 as i64,
        DType::I8 => v as i8 as i64,
        DType::I16 => v as i16 as i64,
        DType::I32 => v as i32 as i64,
        DType::U32 => v as u32 as i64,
        _ => v,
    }
}

/// histogramdd's input [..., N] as [M, N] rows, and N.
fn histdd_rows(c: &Ctx, t: &TensorArg, with_count: bool) -> LResult<(i64, i64)> {
    let r = t.shape.len();
    if r < 2 {
        let got = if with_count {
            format!(", but got {r}")
        } else {
            String::new()
        };
        return user_err(
            ErrorKind::Runtime,
            format!("torch.histogramdd: input tensor should have at least 2 dimensions{got}"),
        );
    }
    if !matches!(t.dtype, DType::F32 | DType::F64) {
        // The CPU raises its own "not implemented" (half types count in their own dtype).
        return decline(format!("histogramdd of {}", torch_name(t.dtype)));
    }
    if let Some(w) = c.args.opt_tensor("weight") {
        let want = &t.shape[..r - 1];
        let ok_shape = w.shape[..] == *want || (w.shape.is_empty() && want == [1]);
        if w.dtype != t.dtype || !ok_shape {
            return decline("histogramdd: weight of another dtype or shape");
        }
    }
    Ok((numel(&t.shape[..r - 1]), t.shape[r - 1]))
}

/// The equal-width bin edges of histogramdd's every dim: `range`, else each column's data
/// range (0..1 when there are no rows), widened by 0.5 each way when empty. A column with an
/// infinity or NaN raises at the next synchronization, as the CPU raises at once.
fn histdd_linear_edges(c: &mut Ctx, x: Value, m: i64, bins: &[i64]) -> LResult<Vec<Value>> {
    let n = bins.len() as i64;
    if bins.iter().any(|b| *b < 1) {
        // bins <= 0: the CPU's linspace or bin check words it.
        return decline("histogramdd: bins per dim");
    }
    let dt = c.b.dtype(x);
    let range = if c.args.has("range") {
        Some(c.args.floats("range")?)
    } else {
        None
    };
    let mut edges = Vec::new();
    if let Some(r) = &range {
        if r.len() as i64 != 2 * n {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "torch.histogramdd: for a {n}-dimensional histogram range should have {} elements, but got {}",
                    2 * n,
                    r.len()
                ),
            );
        }
        for d in 0..n as usize {
            let (mut l, mut h) = (r[2 * d], r[2 * d + 1]);
            if !(l.is_finite() && h.is_finite()) {
                return user_err(
                    ErrorKind::Runtime,
                    format!(
                        "torch.histogramdd: dimension {d}'s range [{}, {}] is not finite",
                        super::random::fmt_num(l),
                        super::random::fmt_num(h)
                    ),
                );
            }
            if l > h {
                return user_err(
                    ErrorKind::Runtime,
                    format!(
                        "torch.histogramdd: min should not exceed max, but got min {} max {} for dimension {d}",
                        super::random::fmt_num(l),
                        super::random::fmt_num(h)
                    ),
                );
            }
            if l == h {
                l -= 0.5;
                h += 0.5;
            }
            let (lo, hi) = (c.b.constant(dt, l), c.b.constant(dt, h));
            edges.push(linspace_values(c.b, lo, hi, bins[d] + 1));
        }
        return Ok(edges);
    }
    if m == 0 {
        for bn in bins {
            let (lo, hi) = (c.b.constant(dt, 0.0), c.b.constant(dt, 1.0));
            edges.push(linspace_values(c.b, lo, hi, bn + 1));
        }
        return Ok(edges);
    }
    let b = &mut *c.b;
    let mn = b.reduce(x, &[0], ReduceKind::Min);
    let mx = b.reduce(x, &[0], ReduceKind::Max);
    // The first dim whose data range is not finite, else n.
    // v - v is 0 for a finite v, NaN for an infinity or NaN.
    let fin = |b: &mut Builder, v: Value| {
        let z = b.sub(v, v);
        b.compare(z, z, CmpDir::Eq)
    };
    let (f0, f1) = (fin(b, mn), fin(b, mx));
    let finite = b.and(f0, f1);
    let ids = b.iota(DType::I64, &[n], 0);
    let none = b.full(DType::I64, &[n], n as f64);
    let bad = b.select(finite, none, ids);
    let first = b.reduce(bad, &[0], ReduceKind::Min);
    for (d, bn) in bins.iter().enumerate() {
        let lo = b.slice(mn, &[d as i64], &[d as i64 + 1], &[1]);
        let lo = b.reshape(lo, &[]);
        let hi = b.slice(mx, &[d as i64], &[d as i64 + 1], &[1]);
        let hi = b.reshape(hi, &[]);
        let same = b.compare(lo, hi, CmpDir::Eq);
        let half = b.splat(lo, 0.5);
        let lo1 = b.sub(lo, half);
        let hi1 = b.add(hi, half);
        let lo = b.select(same, lo1, lo);
        let hi = b.select(same, hi1, hi);
        edges.push(linspace_values(b, lo, hi, bn + 1));
    }
    c.check_range(
        first,
        n,
        n + 1,
        ErrorKind::Runtime,
        "torch.histogramdd: dimension {index}'s range is not finite (the input holds an infinity or a NaN)".into(),
    );
    Ok(edges)
}

/// histogramdd's counts (or weights) over rows `x` [M, N] and each dim's increasing
/// `edges`: a row lands in the last edge not above each coordinate, the last edge closing
/// the last bin; a row with a coordinate outside its edges (or NaN) is skipped. Summed in
/// the input dtype's opmath (exact counts); `density` divides by the total and each bin's
/// volume.
fn histdd_count(c: &mut Ctx, x: Value, m: i64, edges: &[Value], dt: DType) -> Value {
    let weight = c.args.opt_tensor("weight").map(|w| w.value);
    let density = c.args.bool_or("density", false);
    let b = &mut *c.b;
    let nbs: Vec<i64> = edges.iter().map(|e| b.shape(*e)[0] - 1).collect();
    let total: i64 = nbs.iter().product();
    if total == 0 || m == 0 {
        // No rows: a density is 0 / 0 in every bin, as the CPU computes it.
        let v = if density && total > 0 { f64::NAN } else { 0.0 };
        return b.full(dt, &nbs, v);
    }
    let mut flat = b.full(DType::I64, &[m], 0.0);
    let mut inside = b.full(DType::Bool, &[m], 1.0);
    let mut stride = total;
    for (d, (e, nb)) in edges.iter().zip(&nbs).enumerate() {
        stride /= nb;
        let col = b.slice(x, &[0, d as i64], &[m, d as i64 + 1], &[1, 1]);
        let col = b.reshape(col, &[m]);
        let after = count_before(b, *e, col, true, DType::I64);
        let one = b.full(DType::I64, &[m], 1.0);
        let pos = b.sub(after, one);
        let last = b.full(DType::I64, &[m], (nb - 1) as f64);
        let pos = b.min(pos, last);
        let e0 = b.slice(*e, &[0], &[1], &[1]);
        let e0 = b.broadcast_in_dim(e0, &[m], &[0]);
        let e1 = b.slice(*e, &[*nb], &[nb + 1], &[1]);
        let e1 = b.broadcast_in_dim(e1, &[m], &[0]);
        let ge = b.compare(col, e0, CmpDir::Ge);
        let le = b.compare(col, e1, CmpDir::Le);
        inside = b.and(inside, ge);
        inside = b.and(inside, le);
        let st = b.full(DType::I64, &[m], stride as f64);
        let p = b.mul(pos, st);
        flat = b.add(flat, p);
    }
    let w = match weight {
        Some(w) => b.reshape(w, &[m]),
        None => b.full(dt, &[m], 1.0),
    };
    let zero = b.splat(w, 0.0);
    let w = b.select(inside, w, zero);
    let z = b.splat(flat, 0.0);
    let flat = b.select(inside, flat, z);
    let idx = b.reshape(flat, &[m, 1]);
    let hist = b.full(dt, &[total], 0.0);
    let hist = b.scatter(hist, idx, w, &[], &[0], &[0], 1, |b, a, u| b.add(a, u));
    let mut hist = b.reshape(hist, &nbs);
    if density {
        let all: Vec<i64> = (0..nbs.len() as i64).collect();
        let sum = b.reduce(hist, &all, ReduceKind::Sum);
        let sum = b.broadcast_in_dim(sum, &nbs, &[]);
        hist = b.div(hist, sum);
        for (d, (e, nb)) in edges.iter().zip(&nbs).enumerate() {
            let hi = b.slice(*e, &[1], &[nb + 1], &[1]);
            let lo = b.slice(*e, &[0], &[*nb], &[1]);
            let width = b.sub(hi, lo);
            let width = b.broadcast_in_dim(width, &nbs, &[d as i64]);
            hist = b.div(hist, width);
        }
    }
    hist
}

/// histogramdd's bin counts, one per dim.
fn histdd_bins(c: &Ctx, n: i64) -> LResult<Vec<i64>> {
    let bins = c.args.ints("bins")?;
    if bins.len() as i64 != n {
        return decline("histogramdd: bins per dim");
    }
    Ok(bins)
}

/// `_histogramdd_bin_edges`: each dim's equal-width edges.
fn histogramdd_bin_edges(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let (m, n) = histdd_rows(c, &t, false)?;
    let bins = histdd_bins(c, n)?;
    let x = c.b.reshape(t.value, &[m, n]);
    Ok(vec![Out::List(histdd_linear_edges(c, x, m, &bins)?)])
}

/// `_histogramdd_from_bin_cts`: the histogram over equal-width bins.
fn histogramdd_from_bin_cts(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let (m, n) = histdd_rows(c, &t, false)?;
    let bins = histdd_bins(c, n)?;
    let x = c.b.reshape(t.value, &[m, n]);
    let edges = histdd_linear_edges(c, x, m, &bins)?;
    Ok(vec![Out::T(histdd_count(c, x, m, &edges, t.dtype))])
}

/// `_histogramdd_from_bin_tensors`: the histogram over given edges.
fn histogramdd_from_bin_tensors(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let (m, n) = histdd_rows(c, &t, true)?;
    let bins: Vec<TensorArg> = c.args.tensors("bins")?.into_iter().cloned().collect();
    if bins.len() as i64 != n {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "torch.histogramdd: expected {n} sequences of bin edges for a {n}-dimensional histogram but got {}",
                bins.len()
            ),
        );
    }
    for (d, e) in bins.iter().enumerate() {
        if e.dtype != t.dtype {
            return decline("histogramdd: bin edges of another dtype");
        }
        if e.shape.len() != 1 {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "torch.histogramdd: bins tensor should have one dimension, but got {} dimensions in the bins tensor for dimension {d}",
                    e.shape.len()
                ),
            );
        }
        if e.shape[0] == 0 {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "torch.histogramdd: bins tensor should have at least 1 element, but got 0 elements in the bins tensor for dimension {d}"
                ),
            );
        }
    }
    let x = c.b.reshape(t.value, &[m, n]);
    let edges: Vec<Value> = bins.iter().map(|e| e.value).collect();
    Ok(vec![Out::T(histdd_count(c, x, m, &edges, t.dtype))])
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

/// `steps` points from `lo` to `hi` (0-d values of one float dtype), computed as PyTorch's
/// CPU linspace does: in that dtype, from the start for the first half, from the end for
/// the rest.
fn linspace_values(b: &mut Builder, lo: Value, hi: Value, steps: i64) -> Value {
    let dt = b.dtype(lo);
    let d = b.sub(hi, lo);
    let den = b.constant(dt, (steps - 1).max(1) as f64);
    let step = b.div(d, den);
    let step = b.broadcast_in_dim(step, &[steps], &[]);
    let i = b.iota(dt, &[steps], 0);
    let lo_b = b.broadcast_in_dim(lo, &[steps], &[]);
    let hi_b = b.broadcast_in_dim(hi, &[steps], &[]);
    let up = b.mul(step, i);
    let up = b.add(lo_b, up);
    let rest = b.full(dt, &[steps], (steps - 1) as f64);
    let rest = b.sub(rest, i);
    let down = b.mul(step, rest);
    let down = b.sub(hi_b, down);
    let idx = b.iota(DType::I64, &[steps], 0);
    let half = b.full(DType::I64, &[steps], (steps / 2) as f64);
    let first = b.compare(idx, half, CmpDir::Lt);
    b.select(first, up, down)
}

/// torch.histogram: histogramdd of one dim (its edges and counts), the data flattened.
/// Edges are given, or `bins` equal bins over `range` (default: the data's range).
fn histogram(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    if !t.dtype.is_float() {
        return user_err(
            ErrorKind::NotImplemented,
            format!(
                "\"histogramdd\" not implemented for '{}'",
                torch_name(t.dtype)
            ),
        );
    }
    if is_half(t.dtype) {
        return decline("histogram of half tensors");
    }
    if let Some(w) = c.args.opt_tensor("weight") {
        if w.shape != t.shape || w.dtype != t.dtype {
            return decline("histogram weight of another shape or dtype");
        }
    }
    let n = numel(&t.shape);
    let x = c.b.reshape(t.value, &[n, 1]);
    let edges = match c.args.opt_tensor("bins").cloned() {
        Some(bt) => {
            if bt.dtype != t.dtype || bt.shape.len() != 1 || bt.shape[0] < 1 {
                return decline("histogram bins of another dtype or shape");
            }
            bt.value
        }
        None => {
            let bins = c.args.int_or("bins", 100);
            if bins <= 0 {
                return user_err(
                    ErrorKind::Runtime,
                    format!("torch.histogram(): bins must be > 0, but got {bins} for dimension 0"),
                );
            }
            histdd_linear_edges(c, x, n, &[bins])?[0]
        }
    };
    let hist = histdd_count(c, x, n, &[edges], t.dtype);
    Ok(vec![Out::T(hist), Out::T(edges)])
}

fn count_nonzero(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dims = reduce_dims(c.args.opt_ints("dim").as_deref(), t.shape.len())?;
    let b = &mut *c.b;
    let z = b.splat(t.value, 0.0);
    let nz = b.compare(t.value, z, CmpDir::Ne);
    let nz = b.convert(nz, DType::I64);
    Ok(vec![Out::T(b.reduce(nz, &dims, ReduceKind::Sum))])
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

fn aminmax(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    c.require_out_dtype_cpp(t.dtype)?;
    let keep = c.args.bool_or("keepdim", false);
    let dims = match c.args.opt_int("dim") {
        Some(d) => {
            let d = wrap_dim(d, t.shape.len())?;
            if !t.shape.is_empty() && t.shape[d] == 0 {
                return user_err(
                    ErrorKind::Index,
                    format!("aminmax: Expected reduction dim {d} to have non-zero size."),
                );
            }
            if t.shape.is_empty() {
                vec![]
            } else {
                vec![d as i64]
            }
        }
        None => {
            if numel(&t.shape) == 0 {
                return user_err(
                    ErrorKind::Runtime,
                    "aminmax(): cannot compute aminmax over an empty dimension as the operation has no identity.",
                );
            }
            (0..t.shape.len() as i64).collect()
        }
    };
    let b = &mut *c.b;
    let mn = reduce_keep(b, t.value, &dims, ReduceKind::Min, keep);
    let mx = reduce_keep(b, t.value, &dims, ReduceKind::Max, keep);
    Ok(vec![Out::T(mn), Out::T(mx)])
}

fn nansum(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dims = reduce_dims(c.args.opt_ints("dim").as_deref(), t.shape.len())?;
    let keep = c.args.bool_or("keepdim", false);
    let dt = c.args.opt_dtype("dtype").unwrap_or(if t.dtype.is_float() {
        t.dtype
    } else {
        DType::I64
    });
    let b = &mut *c.b;
    let x = b.convert(t.value, dt);
    let x = if dt.is_float() {
        let nan = is_nan(b, x);
        let z = b.splat(x, 0.0);
        b.select(nan, z, x)
    } else {
        x
    };
    Ok(vec![Out::T(reduce_keep(
        b,
        x,
        &dims,
        ReduceKind::Sum,
        keep,
    ))])
}

/// The ops of this family whose programs may serve a range of sizes (see
/// `super::serves_sizes`).
pub const SERVES_SIZES: &[&str] = &["aten::linalg_vector_norm", "aten::tril", "aten::triu"];

/// The ops of this family whose first result PyTorch lays out column-major (see
/// `super::column_major_result`).
pub const COLUMN_MAJOR_RESULTS: &[&str] = &["aten::linalg_solve_triangular"];

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
    ("aten::linalg_vector_norm", vector_norm),
    ("aten::norm", vector_norm),
    ("aten::renorm", renorm),
    ("aten::_cdist_forward", cdist_forward),
    ("aten::_cdist_backward", cdist_backward),
    ("aten::_pdist_forward", pdist_forward),
    ("aten::_pdist_backward", pdist_backward),
    ("aten::tril", |c| tril_triu(c, true)),
    ("aten::triu", |c| tril_triu(c, false)),
    ("aten::linalg_cholesky_ex", cholesky_ex),
    ("aten::triangular_solve", triangular_solve),
    ("aten::linalg_solve_triangular", solve_triangular),
    ("aten::_cholesky_solve_helper", cholesky_solve_helper),
    ("aten::cholesky_inverse", cholesky_inverse),
    ("aten::trace", trace),
    ("aten::linalg_cross", linalg_cross),
    ("aten::vdot", vdot),
    ("aten::histc", histc),
    ("aten::histogram", histogram),
    ("aten::_histogramdd_bin_edges", histogramdd_bin_edges),
    ("aten::_histogramdd_from_bin_cts", histogramdd_from_bin_cts),
    (
        "aten::_histogramdd_from_bin_tensors",
        histogramdd_from_bin_tensors,
    ),
    ("aten::isin", isin),
    ("aten::count_nonzero", count_nonzero),
    ("aten::aminmax", aminmax),
    ("aten::nansum", nansum),
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

    #[test]
    fn vector_norm_rejects_integers() {
        let mut b = Builder::new();
        let x = tensor(&mut b, DType::I64, &[3]);
        let args = Args {
            items: vec![("self".into(), x)],
        };
        let mut c = Ctx::new(&mut b, "aten::linalg_vector_norm", "", &args);
        match vector_norm(&mut c) {
            Err(LowerError::User(ErrorKind::NotImplemented, m)) => assert_eq!(
                m,
                "linalg.vector_norm: Expected a floating point or complex tensor as input. Got Long"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn cdist_backward_shape() {
        let mut b = Builder::new();
        let items = vec![
            ("grad_output", tensor(&mut b, DType::F32, &[3, 5])),
            ("x1", tensor(&mut b, DType::F32, &[3, 4])),
            ("x2", tensor(&mut b, DType::F32, &[5, 4])),
            ("p", Arg::Float(2.0)),
            ("cdist", tensor(&mut b, DType::F32, &[3, 5])),
        ];
        assert_eq!(ok(shapes(cdist_backward, items, &mut b)), vec![vec![3, 4]]);
    }
}
