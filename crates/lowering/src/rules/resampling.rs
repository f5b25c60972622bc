//! Resampling: upsampling (nearest, linear, bilinear, bicubic, trilinear, antialiased)
//! and grid sampling, forward and backward. Where a CPU kernel computes in the narrow type
//! (interpolation weights, grid sampling), the rule rounds the same way.

use super::nn_common::*;
use super::opmath;
use crate::promote::torch_name;
use crate::shape::{numel, shape_str};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};
use stablehlo::{CmpDir, ReduceKind};

/// The interpolation of an upsample op.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Interp {
    Nearest,
    NearestExact,
    Linear,
    Cubic,
    LinearAa,
    CubicAa,
}

/// `v` rounded to the nearest value of `d` (f16/bf16; others unchanged), ties to even.
pub(super) fn round_to(v: f64, d: DType) -> f64 {
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
pub(super) fn interp_matrix(
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

pub const RULES: &[(&str, Rule)] = &[
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
];
