//! Bag reductions over data-dependent groups: embedding bags (sum, mean, max; per-sample
//! weights; padding index) with their backward ops, and `segment_reduce` (lengths or
//! offsets) with its backward.
//!
//! Their CPU kernels also check index *values* (offsets starting at 0, lengths summing to the
//! data size); those checks run on the device (`Ctx::check_range` and friends).

use super::nn_common::*;
use super::{opmath, scatter_rows, take_rows};
use crate::promote::promote_types;
use crate::shape::{numel, shape_str, wrap_dim};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};
use stablehlo::{CmpDir, ReduceKind};

const MODE_SUM: i64 = 0;

const MODE_MEAN: i64 = 1;

const MODE_MAX: i64 = 2;

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
        return super::not_implemented(&kernel, seg.dtype);
    }
    if !data.dtype.is_float() {
        return super::not_implemented("_segment_reduce_cpu", data.dtype);
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

pub const RULES: &[(&str, Rule)] = &[
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
    ("aten::_segment_reduce_backward", segment_reduce_backward),
];
