//! Padding rules: constant, reflection, replication and circular padding, with backward.

use super::nn_common::*;
use super::opmath;
use crate::shape::shape_str;
use crate::{decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, Value};

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
pub(super) fn replicate_runs(n: i64, l: i64, r: i64) -> (i64, i64, i64, i64) {
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

pub const RULES: &[(&str, Rule)] = &[
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
];
