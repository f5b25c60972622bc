//! Counting values into bins: histc (integer inputs with CUDA's semantics), histogram and
//! histogramdd.

use crate::args::Scalar;
use crate::promote::torch_name;
use crate::shape::numel;
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};
use stablehlo::{CmpDir, ReduceKind};

use super::{count_before, input, is_half, scale};

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
        return super::not_implemented("histogram_cpu", t.dtype);
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
                        super::fmt_num(l),
                        super::fmt_num(h)
                    ),
                );
            }
            if l > h {
                return user_err(
                    ErrorKind::Runtime,
                    format!(
                        "torch.histogramdd: min should not exceed max, but got min {} max {} for dimension {d}",
                        super::fmt_num(l),
                        super::fmt_num(h)
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

/// `steps` (at least 2) points from `lo` to `hi` (0-d values of one float dtype), as
/// PyTorch's CPU linspace computes them in that dtype.
fn linspace_values(b: &mut Builder, lo: Value, hi: Value, steps: i64) -> Value {
    let d = b.sub(hi, lo);
    let den = b.constant(b.dtype(lo), (steps - 1) as f64);
    let step = b.div(d, den);
    super::ramp(b, lo, hi, step, steps)
}

/// torch.histogram: histogramdd of one dim (its edges and counts), the data flattened.
/// Edges are given, or `bins` equal bins over `range` (default: the data's range).
fn histogram(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    if !t.dtype.is_float() {
        return super::not_implemented("histogramdd", t.dtype);
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

pub const RULES: &[(&str, Rule)] = &[
    ("aten::histc", histc),
    ("aten::histogram", histogram),
    ("aten::_histogramdd_bin_edges", histogramdd_bin_edges),
    ("aten::_histogramdd_from_bin_cts", histogramdd_from_bin_cts),
    (
        "aten::_histogramdd_from_bin_tensors",
        histogramdd_from_bin_tensors,
    ),
];
