//! torchvision's detection ops: `roi_align` (and its backward) and the suppression step of
//! `nms`. They reach the backend as any op does (the `tpu` fallback sees `torchvision::*`);
//! with these rules Faster/Mask R-CNN, RetinaNet, FCOS and SSD run without the CPU.
//!
//! The arithmetic follows torchvision's CPU kernels step by step (same operation order,
//! in the input's dtype), so results agree to the last bits up to summation order.

use crate::rules::{scatter_rows, take_rows};
use crate::shape::numel;
use crate::{decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Value};
use stablehlo::{CmpDir, ReduceKind};

/// The dtypes torchvision's CPU kernels are instantiated for; others fall back to them
/// (which raise the CPU's error).
fn kernel_dtype(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F64 | DType::F16)
}

/// Whether `nms` runs here: boxes and scores of one dtype its CPU kernel takes (float32,
/// float64). The runtime asks this before it takes the op from the fallback.
pub fn nms_takes(dets: DType, scores: DType) -> bool {
    matches!(dets, DType::F32 | DType::F64) && scores == dets
}

/// Column `i` of `r` [K, n] as [K].
fn column(b: &mut Builder, r: Value, i: i64) -> Value {
    let k = b.shape(r)[0];
    let col = b.slice_dim(r, 1, i, i + 1, 1);
    b.reshape(col, &[k])
}

/// The geometry shared by `roi_align` and its backward.
struct Rois {
    k: i64,
    /// Pooled bins and samples per bin along y and x.
    ph: i64,
    pw: i64,
    grid: i64,
    /// Image of each roi, [K] i64.
    image: Value,
    /// Start and bin size along y and x, [K] each.
    start: [Value; 2],
    bin: [Value; 2],
}

fn rois_geometry(c: &mut Ctx, rois: Value, ph: i64, pw: i64) -> LResult<Rois> {
    let scale = c.args.float("spatial_scale")?;
    let aligned = c.args.bool_or("aligned", false);
    let grid = c.args.int("sampling_ratio")?;
    let b = &mut *c.b;
    let k = b.shape(rois)[0];
    let col0 = column(b, rois, 0);
    let image = b.convert(col0, DType::I64);
    let off = if aligned { 0.5 } else { 0.0 };
    let mut ends = Vec::new();
    for i in 1..5 {
        let v = column(b, rois, i);
        let s = b.splat(v, scale);
        let v = b.mul(v, s);
        let o = b.splat(v, off);
        ends.push(b.sub(v, o));
    }
    // rois hold (x1, y1, x2, y2): index 0 of start/bin is y, 1 is x.
    let (sx, sy, ex, ey) = (ends[0], ends[1], ends[2], ends[3]);
    let mut bin = [sy, sx];
    for (i, (s, e, n)) in [(sy, ey, ph), (sx, ex, pw)].into_iter().enumerate() {
        let mut len = b.sub(e, s);
        if !aligned {
            // Misaligned boxes are at least one pixel wide (torchvision's legacy rule).
            let one = b.splat(len, 1.0);
            len = b.max(len, one);
        }
        let nv = b.splat(len, n as f64);
        bin[i] = b.div(len, nv);
    }
    Ok(Rois {
        k,
        ph,
        pw,
        grid,
        image,
        start: [sy, sx],
        bin,
    })
}

/// Bilinear taps along one axis of `size` pixels for every sample [K, P, G]: (low, high)
/// i64, their weights (1 - frac, frac) and whether the sample lies within a pixel of
/// the map (torchvision zeroes the others).
struct Taps {
    low: Value,
    high: Value,
    w_low: Value,
    w_high: Value,
    inside: Value,
}

fn taps(b: &mut Builder, start: Value, bin: Value, p: i64, g: i64, size: i64) -> Taps {
    let k = b.shape(start)[0];
    let dt = b.dtype(start);
    let shape = [k, p, g];
    let start = b.broadcast_in_dim(start, &shape, &[0]);
    let bin = b.broadcast_in_dim(bin, &shape, &[0]);
    let pi = b.iota(dt, &shape, 1);
    let gi = b.iota(dt, &shape, 2);
    // start + p * bin + (g + 0.5) * bin / grid, in the CPU kernel's order.
    let pb = b.mul(pi, bin);
    let base = b.add(start, pb);
    let half = b.splat(gi, 0.5);
    let gh = b.add(gi, half);
    let gb = b.mul(gh, bin);
    let gn = b.splat(gb, g as f64);
    let frac = b.div(gb, gn);
    let v = b.add(base, frac);
    let lo_lim = b.splat(v, -1.0);
    let hi_lim = b.splat(v, size as f64);
    let below = b.compare(v, lo_lim, CmpDir::Lt);
    let above = b.compare(v, hi_lim, CmpDir::Gt);
    let out = b.or(below, above);
    let inside = b.not(out);
    let zero = b.splat(v, 0.0);
    let neg = b.compare(v, zero, CmpDir::Le);
    let v = b.select(neg, zero, v);
    let low = b.convert(v, DType::I64);
    let last = b.full(DType::I64, &shape, (size - 1) as f64);
    let at_end = b.compare(low, last, CmpDir::Ge);
    let one = b.splat(low, 1.0);
    let next = b.add(low, one);
    let high = b.select(at_end, last, next);
    let low = b.select(at_end, last, low);
    let lowf = b.convert(low, dt);
    let v = b.select(at_end, lowf, v);
    let w_high = b.sub(v, lowf);
    let onef = b.splat(w_high, 1.0);
    let w_low = b.sub(onef, w_high);
    Taps {
        low,
        high,
        w_low,
        w_high,
        inside,
    }
}

/// The four corners of every sample [K, P, Gy, Q, Gx], flattened: (row in the
/// [N*H*W, C] table, weight) each, weights zero outside the map.
fn corners(b: &mut Builder, r: &Rois, h: i64, w: i64) -> Vec<(Value, Value)> {
    let y = taps(b, r.start[0], r.bin[0], r.ph, r.grid, h);
    let x = taps(b, r.start[1], r.bin[1], r.pw, r.grid, w);
    let shape = [r.k, r.ph, r.grid, r.pw, r.grid];
    let m = numel(&shape);
    let ys = |b: &mut Builder, v: Value| b.broadcast_in_dim(v, &shape, &[0, 1, 2]);
    let xs = |b: &mut Builder, v: Value| b.broadcast_in_dim(v, &shape, &[0, 3, 4]);
    let iy = ys(b, y.inside);
    let ix = xs(b, x.inside);
    let inside = b.and(iy, ix);
    let img = b.broadcast_in_dim(r.image, &shape, &[0]);
    let hw = b.splat(img, (h * w) as f64);
    let base = b.mul(img, hw);
    let wv = b.splat(base, w as f64);
    let mut out = Vec::with_capacity(4);
    for (yi, wy) in [(y.low, y.w_low), (y.high, y.w_high)] {
        for (xi, wx) in [(x.low, x.w_low), (x.high, x.w_high)] {
            let yi = ys(b, yi);
            let xi = xs(b, xi);
            let row = b.mul(yi, wv);
            let pos = b.add(base, row);
            let pos = b.add(pos, xi);
            let wy = ys(b, wy);
            let wx = xs(b, wx);
            let wt = b.mul(wy, wx);
            let z = b.splat(wt, 0.0);
            let wt = b.select(inside, wt, z);
            let pos = b.reshape(pos, &[m]);
            let wt = b.reshape(wt, &[m, 1]);
            out.push((pos, wt));
        }
    }
    out
}

/// The checks of torchvision's kernels on `x` (input, or the backward's grad: rank 4) and `rois`.
fn check_rois(rois: &crate::TensorArg, x: &crate::TensorArg) -> LResult<()> {
    if !kernel_dtype(x.dtype) || rois.dtype != x.dtype || x.shape.len() != 4 {
        return decline("roi_align: dtype or rank torchvision's CPU kernel checks");
    }
    if rois.shape.len() != 2 || rois.shape[1] != 5 {
        return user_err(ErrorKind::Runtime, "rois must have shape as Tensor[K, 5]");
    }
    Ok(())
}

/// Samples per bin: a positive `sampling_ratio`. With 0 each roi picks its own grid
/// from its size (data-dependent shapes): that case runs on the CPU.
fn fixed_grid(c: &Ctx) -> LResult<()> {
    if c.args.int("sampling_ratio")? <= 0 {
        return decline("roi_align with an adaptive sampling grid (sampling_ratio <= 0)");
    }
    Ok(())
}

/// `torchvision::roi_align`: [K, C, ph, pw], each bin the mean of grid x grid bilinear
/// samples of the roi's image.
fn roi_align(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = c.args.tensor("input")?.clone();
    let rois = c.args.tensor("rois")?.clone();
    check_rois(&rois, &x)?;
    fixed_grid(c)?;
    let (ph, pw) = (c.args.int("pooled_height")?, c.args.int("pooled_width")?);
    let (n, ch, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let k = rois.shape[0];
    if k == 0 || numel(&x.shape) == 0 {
        return Ok(vec![Out::T(c.b.full(x.dtype, &[k, ch, ph, pw], 0.0))]);
    }
    let r = rois_geometry(c, rois.value, ph, pw)?;
    let b = &mut *c.b;
    let t = b.transpose(x.value, &[0, 2, 3, 1]);
    let table = b.reshape(t, &[n * h * w, ch]);
    let mut acc: Option<Value> = None;
    for (pos, wt) in corners(b, &r, h, w) {
        let v = take_rows(b, table, pos);
        let wt = b.broadcast_in_dim(wt, &b.shape(v), &[0, 1]);
        let term = b.mul(wt, v);
        acc = Some(match acc {
            Some(a) => b.add(a, term),
            None => term,
        });
    }
    let acc = acc.expect("four corners");
    let g = r.grid;
    let acc = b.reshape(acc, &[k, ph, g, pw, g, ch]);
    let sum = b.reduce(acc, &[2, 4], ReduceKind::Sum);
    let cnt = b.splat(sum, (g * g).max(1) as f64);
    let mean = b.div(sum, cnt);
    Ok(vec![Out::T(b.transpose(mean, &[0, 3, 1, 2]))])
}

/// `torchvision::_roi_align_backward`: each sample's share of its bin's gradient
/// (weight / count) added to its four corners of the input's gradient.
fn roi_align_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let g = c.args.tensor("grad")?.clone();
    let rois = c.args.tensor("rois")?.clone();
    check_rois(&rois, &g)?;
    fixed_grid(c)?;
    let (ph, pw) = (c.args.int("pooled_height")?, c.args.int("pooled_width")?);
    let n = c.args.int("batch_size")?;
    let ch = c.args.int("channels")?;
    let h = c.args.int("height")?;
    let w = c.args.int("width")?;
    let k = rois.shape[0];
    if k == 0 || n * ch * h * w == 0 {
        return Ok(vec![Out::T(c.b.full(g.dtype, &[n, ch, h, w], 0.0))]);
    }
    let r = rois_geometry(c, rois.value, ph, pw)?;
    let b = &mut *c.b;
    let grid = r.grid;
    let shape = [k, ph, grid, pw, grid, ch];
    // The bin's gradient at each of its samples, [M, C].
    let gt = b.transpose(g.value, &[0, 2, 3, 1]);
    let gs = b.broadcast_in_dim(gt, &shape, &[0, 1, 3, 5]);
    let m = numel(&shape[..5]);
    let gs = b.reshape(gs, &[m, ch]);
    let cnt = b.splat(gs, (grid * grid).max(1) as f64);
    let mut out = b.full(g.dtype, &[n * h * w, ch], 0.0);
    for (pos, wt) in corners(b, &r, h, w) {
        let wt = b.broadcast_in_dim(wt, &[m, ch], &[0, 1]);
        let share = b.mul(gs, wt);
        let share = b.div(share, cnt);
        out = scatter_rows(b, out, pos, share, ReduceKind::Sum);
    }
    let out = b.reshape(out, &[n, h, w, ch]);
    Ok(vec![Out::T(b.transpose(out, &[0, 3, 1, 2]))])
}

/// `torch_pjrt::nms_keep(dets, scores, iou_threshold)`: the boxes' indices by
/// decreasing score (a stable sort), -1 where a higher-scored kept box overlaps the box by
/// more than the threshold. `torchvision::nms` (a data-dependent size, so it synchronizes)
/// reads this back and keeps the others, in order.
fn nms_keep(c: &mut Ctx) -> LResult<Vec<Out>> {
    let d = c.args.tensor("dets")?.clone();
    let s = c.args.tensor("scores")?.clone();
    let thr = c.args.float("iou_threshold")?;
    if d.shape.len() != 2 {
        return user_err(
            ErrorKind::Runtime,
            format!("boxes should be a 2d tensor, got {}D", d.shape.len()),
        );
    }
    if d.shape[1] != 4 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "boxes should have 4 elements in dimension 1, got {}",
                d.shape[1]
            ),
        );
    }
    if s.shape.len() != 1 {
        return user_err(
            ErrorKind::Runtime,
            format!("scores should be a 1d tensor, got {}D", s.shape.len()),
        );
    }
    if d.shape[0] != s.shape[0] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "boxes and scores should have same number of elements in dimension 0, got {} and {}",
                d.shape[0], s.shape[0]
            ),
        );
    }
    if !nms_takes(d.dtype, s.dtype) {
        return decline("nms: dtypes torchvision's CPU kernel checks");
    }
    let n = d.shape[0];
    let b = &mut *c.b;
    if n == 0 {
        return Ok(vec![Out::T(b.full(DType::I64, &[0], 0.0))]);
    }
    let idx = b.iota(DType::I64, &[n], 0);
    let sorted = b.sort(&[s.value, idx], 0, true, |b, a| {
        b.compare(a[0], a[1], CmpDir::Gt)
    });
    let order = sorted[1];
    let boxes = take_rows(b, d.value, order);
    let x1 = column(b, boxes, 0);
    let y1 = column(b, boxes, 1);
    let x2 = column(b, boxes, 2);
    let y2 = column(b, boxes, 3);
    let bw = b.sub(x2, x1);
    let bh = b.sub(y2, y1);
    let area = b.mul(bw, bh);
    // IoU of every (kept candidate i, later box j) pair, in sorted order: [N, N].
    let rows = |b: &mut Builder, v: Value| b.broadcast_in_dim(v, &[n, n], &[0]);
    let cols = |b: &mut Builder, v: Value| b.broadcast_in_dim(v, &[n, n], &[1]);
    let side = |b: &mut Builder, lo: Value, hi: Value| {
        let (li, lj) = (rows(b, lo), cols(b, lo));
        let (hi_, hj) = (rows(b, hi), cols(b, hi));
        let a = b.max(li, lj);
        let z = b.min(hi_, hj);
        let len = b.sub(z, a);
        let zero = b.splat(len, 0.0);
        b.max(len, zero)
    };
    let iw = side(b, x1, x2);
    let ih = side(b, y1, y2);
    let inter = b.mul(iw, ih);
    let ai = rows(b, area);
    let aj = cols(b, area);
    let union = b.add(ai, aj);
    let union = b.sub(union, inter);
    let iou = b.div(inter, union);
    // The threshold is a double, the overlap the boxes' dtype: compare as doubles.
    let iou = b.convert(iou, DType::F64);
    let t = b.splat(iou, thr);
    let over = b.compare(iou, t, CmpDir::Gt);
    let ri = b.iota(DType::I64, &[n, n], 0);
    let cj = b.iota(DType::I64, &[n, n], 1);
    let later = b.compare(cj, ri, CmpDir::Gt);
    let over = b.and(over, later);
    // Box i, if not suppressed by then, suppresses the later boxes it overlaps.
    let i0 = b.constant(DType::I64, 0.0);
    let none = b.full(DType::Bool, &[n], 0.0);
    let out = b.while_loop(
        &[i0, none],
        |b, v| {
            let lim = b.constant(DType::I64, n as f64);
            b.compare(v[0], lim, CmpDir::Lt)
        },
        |b, v| {
            let (i, sup) = (v[0], v[1]);
            let zero = b.constant(DType::I64, 0.0);
            let row = b.dynamic_slice(over, &[i, zero], &[1, n]);
            let row = b.reshape(row, &[n]);
            let me = b.dynamic_slice(sup, &[i], &[1]);
            let me = b.reshape(me, &[]);
            let kept = b.not(me);
            let kept = b.broadcast_in_dim(kept, &[n], &[]);
            let hit = b.and(row, kept);
            let sup = b.or(sup, hit);
            let one = b.constant(DType::I64, 1.0);
            vec![b.add(i, one), sup]
        },
    );
    let gone = b.full(DType::I64, &[n], -1.0);
    Ok(vec![Out::T(b.select(out[1], gone, order))])
}

pub const RULES: &[(&str, crate::Rule)] = &[
    ("torchvision::roi_align", roi_align),
    ("torchvision::_roi_align_backward", roi_align_backward),
    ("torch_pjrt::nms_keep", nms_keep),
];
