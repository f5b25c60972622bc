//! Special functions and the rest of the pointwise family: inverse trigonometric and
//! hyperbolic functions, the gamma family, modified Bessel functions, erfcx/ndtr family,
//! logit/xlogy, float bit tricks (signbit, copysign, nextafter), integer shifts and
//! gcd/lcm.

use super::{
    add_k, cmp_k, common, float_max, is_nan, map, map_only, opnd, promote, same, scale, select_k,
};
use crate::promote::{can_cast, to_float, torch_name};
use crate::{user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, Value};
use stablehlo::{CmpDir, ReduceKind};

type Un = fn(&mut Builder, Value) -> Value;

fn is_float(d: DType) -> bool {
    d.is_float()
}

fn is_int(d: DType) -> bool {
    d.is_int()
}

/// The input of a unary op: `self`, or `x` in some special_* schemas.
fn input_name(c: &Ctx) -> &'static str {
    if c.args.has("x") {
        "x"
    } else {
        "self"
    }
}

/// A unary function of floats (ints and bools promote to float32), evaluated in float32
/// for half-precision inputs as PyTorch's kernels do.
fn float1(c: &mut Ctx, f: Un) -> LResult<Vec<Out>> {
    map(c, &[input_name(c)], to_float, |b, v| wide(b, v[0], f))
}

/// The multivariate log-gamma `sum_i lgamma(x - i/2) + p(p-1)/4 log(pi)`, its terms added
/// from i = p-1 down to 0 as PyTorch's composite does (`mvlgamma_`/`out=` reach us whole).
fn mvlgamma(c: &mut Ctx) -> LResult<Vec<Out>> {
    let p = c.args.int("p")?;
    if p < 1 {
        return user_err(ErrorKind::Runtime, "p has to be greater than or equal to 1");
    }
    map(c, &[input_name(c)], to_float, |b, v| {
        wide(b, v[0], |b, x| {
            let mut acc: Option<Value> = None;
            for i in (0..p).rev() {
                let k = b.splat(x, -(i as f64) / 2.0);
                let t = b.add(x, k);
                let t = lgamma(b, t);
                acc = Some(match acc {
                    Some(a) => b.add(a, t),
                    None => t,
                });
            }
            let acc = acc.expect("p >= 1");
            let k = b.splat(acc, (p * (p - 1)) as f64 / 4.0 * std::f64::consts::PI.ln());
            b.add(acc, k)
        })
    })
}

/// Like `map` to float, for the special_* kernels PyTorch has in float32 and float64
/// only: half-precision operands raise its "not implemented" error.
fn map_special(
    c: &mut Ctx,
    names: &[&str],
    f: impl FnOnce(&mut Builder, &[Value]) -> Value,
) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, names, to_float)?;
    if matches!(dt, DType::F16 | DType::BF16) {
        let kernel = format!("{}_cpu", c.op.trim_start_matches("aten::special_"));
        return super::not_implemented(&kernel, dt);
    }
    Ok(vec![Out::T(f(c.b, &v))])
}

/// A unary special_* function (see `map_special`).
fn special1(c: &mut Ctx, f: impl FnOnce(&mut Builder, Value) -> Value) -> LResult<Vec<Out>> {
    map_special(c, &[input_name(c)], |b, v| f(b, v[0]))
}

fn wide(b: &mut Builder, x: Value, f: impl FnOnce(&mut Builder, Value) -> Value) -> Value {
    let dt = b.dtype(x);
    if matches!(dt, DType::F16 | DType::BF16) {
        let w = b.convert(x, DType::F32);
        let r = f(b, w);
        b.convert(r, dt)
    } else {
        f(b, x)
    }
}

/// `wide` for binary functions.
fn wide2(
    b: &mut Builder,
    x: Value,
    y: Value,
    f: impl FnOnce(&mut Builder, Value, Value) -> Value,
) -> Value {
    let dt = b.dtype(x);
    if matches!(dt, DType::F16 | DType::BF16) {
        let xw = b.convert(x, DType::F32);
        let yw = b.convert(y, DType::F32);
        let r = f(b, xw, yw);
        b.convert(r, dt)
    } else {
        f(b, x, y)
    }
}

// ---------------------------------------------------------------------------
// Small building blocks
// ---------------------------------------------------------------------------

/// `sum(coeffs[i] * z^i)` by Horner's rule.
fn horner(b: &mut Builder, z: Value, coeffs: &[f64]) -> Value {
    let mut acc = b.splat(z, coeffs[coeffs.len() - 1]);
    for c in coeffs.iter().rev().skip(1) {
        acc = b.mul(acc, z);
        acc = add_k(b, acc, *c);
    }
    acc
}

// Error-free transformations for float32 (Dekker, Knuth), so a series that cancels or
// whose argument is rounded can be summed as if in twice the precision.

/// (hi, lo) with hi the top 12 significand bits of `a` and hi + lo == a exactly.
fn split_f32(b: &mut Builder, a: Value) -> (Value, Value) {
    let bits = b.bitcast_convert(a, DType::I32);
    let mask = b.splat(bits, -4096.0);
    let hb = b.and(bits, mask);
    let hi = b.bitcast_convert(hb, DType::F32);
    let lo = b.sub(a, hi);
    (hi, lo)
}

/// (p, e) with p = fl(a b) and p + e == a b exactly (barring underflow).
fn two_prod(b: &mut Builder, x: Value, y: Value) -> (Value, Value) {
    let p = b.mul(x, y);
    let (xh, xl) = split_f32(b, x);
    let (yh, yl) = split_f32(b, y);
    let hh = b.mul(xh, yh);
    let e = b.sub(hh, p);
    let hl = b.mul(xh, yl);
    let e = b.add(e, hl);
    let lh = b.mul(xl, yh);
    let e = b.add(e, lh);
    let ll = b.mul(xl, yl);
    (p, b.add(e, ll))
}

/// (s, e) with s = fl(a + c) and s + e == a + c exactly.
fn two_sum(b: &mut Builder, a: Value, c: Value) -> (Value, Value) {
    let s = b.add(a, c);
    let bb = b.sub(s, a);
    let sb = b.sub(s, bb);
    let ea = b.sub(a, sb);
    let eb = b.sub(c, bb);
    (s, b.add(ea, eb))
}

/// x^2 / 4 as an unevaluated sum hi + lo (exact up to underflow) for float32 `x`.
fn quarter_square(b: &mut Builder, x: Value) -> (Value, Value) {
    if b.dtype(x) != DType::F32 {
        let y = b.mul(x, x);
        let y = scale(b, y, 0.25);
        let z = b.splat(y, 0.0);
        return (y, z);
    }
    let (p, e) = two_prod(b, x, x);
    (scale(b, p, 0.25), scale(b, e, 0.25))
}

/// `sum(coeffs[i] * z^i)` at z = zh + zl, by compensated Horner for float32 (coefficients
/// kept to twice the precision too), else by plain Horner.
fn horner_exact(b: &mut Builder, zh: Value, zl: Value, coeffs: &[f64]) -> Value {
    if b.dtype(zh) != DType::F32 {
        let z = b.add(zh, zl);
        return horner(b, z, coeffs);
    }
    let n = coeffs.len();
    let mut s = b.splat(zh, coeffs[n - 1] as f32 as f64);
    let mut r = b.splat(zh, coeffs[n - 1] - coeffs[n - 1] as f32 as f64);
    for c in coeffs.iter().rev().skip(1) {
        let hi = *c as f32 as f64;
        let lo = *c - hi;
        let (p, pe) = two_prod(b, s, zh);
        let ch = b.splat(zh, hi);
        let (s2, se) = two_sum(b, p, ch);
        // r <- r z + (pe + se + s zl + lo)
        let e = b.add(pe, se);
        let szl = b.mul(s, zl);
        let e = b.add(e, szl);
        let e = add_k(b, e, lo);
        let rz = b.mul(r, zh);
        r = b.add(rz, e);
        s = s2;
    }
    b.add(s, r)
}

/// The sign bit of a float (true for -0.0 and negative NaNs too).
fn signbit_float(b: &mut Builder, x: Value) -> Value {
    let it = match b.dtype(x) {
        DType::F16 | DType::BF16 => DType::I16,
        DType::F32 => DType::I32,
        _ => DType::I64,
    };
    let bits = b.bitcast_convert(x, it);
    cmp_k(b, bits, 0.0, CmpDir::Lt)
}

fn signbit(b: &mut Builder, x: Value) -> Value {
    let dt = b.dtype(x);
    if dt.is_float() {
        signbit_float(b, x)
    } else if dt.is_signed_int() {
        cmp_k(b, x, 0.0, CmpDir::Lt)
    } else {
        b.full(DType::Bool, &b.shape(x), 0.0)
    }
}

/// A float constant of `like`'s type, rounded as a C++ cast to that type would round it
/// (values beyond the type's range become infinities).
fn float_full(b: &mut Builder, like: Value, v: f64) -> Value {
    let dt = b.dtype(like);
    match dt {
        DType::F64 => b.splat(like, v),
        DType::F32 => b.splat(like, v as f32 as f64),
        _ => {
            let shape = b.shape(like);
            let w = b.full(DType::F32, &shape, v as f32 as f64);
            b.convert(w, dt)
        }
    }
}

// ---------------------------------------------------------------------------
// Gamma family
// ---------------------------------------------------------------------------

/// chlo.lgamma, exactly 0 at 1 and 2 (where its approximation is a few 1e-7 off).
fn lgamma(b: &mut Builder, x: Value) -> Value {
    let r = b.unary("chlo.lgamma", x);
    let one = cmp_k(b, x, 1.0, CmpDir::Eq);
    let two = cmp_k(b, x, 2.0, CmpDir::Eq);
    let z = b.or(one, two);
    select_k(b, z, 0.0, r)
}

/// digamma with PyTorch's poles: -inf at +0, +inf at -0 (chlo gives NaN there).
fn digamma(b: &mut Builder, x: Value) -> Value {
    let r = b.unary("chlo.digamma", x);
    let zero = cmp_k(b, x, 0.0, CmpDir::Eq);
    let neg = signbit_float(b, x);
    let pinf = b.splat(x, f64::INFINITY);
    let ninf = b.splat(x, f64::NEG_INFINITY);
    let pole = b.select(neg, pinf, ninf);
    b.select(zero, pole, r)
}

/// trigamma = polygamma(1, x), by reflection below 1/2, recurrence and the asymptotic series.
fn trigamma(b: &mut Builder, x: Value) -> Value {
    // psi1(x) = pi^2 / sin^2(pi x) - psi1(1 - x) for x < 1/2.
    let refl = cmp_k(b, x, 0.5, CmpDir::Lt);
    let one = b.splat(x, 1.0);
    let omx = b.sub(one, x);
    let y = b.select(refl, omx, x);
    // psi1(y) = sum_{i<6} 1/(y+i)^2 + psi1(y+6)
    let mut acc = b.splat(x, 0.0);
    for i in 0..6 {
        let t = add_k(b, y, i as f64);
        let t2 = b.mul(t, t);
        let r = b.div(one, t2);
        acc = b.add(acc, r);
    }
    // psi1(z) ~ 1/z + 1/(2z^2) + 1/(6z^3) - 1/(30z^5) + 1/(42z^7) - 1/(30z^9)
    let z = add_k(b, y, 6.0);
    let iz = b.div(one, z);
    let iz2 = b.mul(iz, iz);
    let tail = horner(b, iz2, &[1.0 / 6.0, -1.0 / 30.0, 1.0 / 42.0, -1.0 / 30.0]);
    let tail = b.mul(tail, iz2);
    let h = scale(b, iz, 0.5);
    let tail = b.add(tail, h);
    let tail = b.add(tail, one);
    let tail = b.mul(tail, iz);
    let t = b.add(acc, tail);
    let px = scale(b, x, std::f64::consts::PI);
    let sn = b.unary("stablehlo.sine", px);
    let s2 = b.mul(sn, sn);
    let pi2 = b.splat(x, std::f64::consts::PI * std::f64::consts::PI);
    let r = b.div(pi2, s2);
    let r = b.sub(r, t);
    b.select(refl, r, t)
}

/// Whether any element of a bool tensor is set (a 0-d i1).
fn any(b: &mut Builder, p: Value) -> Value {
    let n = b.ty(p).numel();
    let flat = b.reshape(p, &[n]);
    b.reduce(flat, &[0], ReduceKind::Or)
}

/// B_2k / (2k)! for k = 1..=12 (Euler-Maclaurin coefficients).
const EM_COEFFS: [f64; 12] = [
    1.0 / 12.0,
    -1.0 / 720.0,
    1.0 / 30240.0,
    -1.0 / 1209600.0,
    1.0 / 47900160.0,
    -691.0 / 1_307_674_368_000.0,
    1.0 / 74_724_249_600.0,
    -3617.0 / 10_670_622_842_880_000.0,
    43867.0 / 5_109_094_217_170_944_000.0,
    -174611.0 / 802_857_662_698_291_200_000.0,
    77683.0 / 14_101_100_039_391_805_440_000.0,
    -236364091.0 / 1_693_824_136_731_743_669_452_800_000.0,
];

/// Hurwitz zeta(x, q) = sum_k (q + k)^-x, with PyTorch's domain: +inf at x == 1 and at
/// poles q = 0, -1, -2, ...; NaN for x < 1, and for q < 0 with a non-integer x.
fn zeta(b: &mut Builder, x: Value, q: Value) -> Value {
    // Direct terms until the shifted q passes 9 (at least 9 of them), then the
    // Euler-Maclaurin tail at w = q + n.
    let nx = b.neg(x);
    let s0 = b.binary("stablehlo.power", q, nx);
    let i0 = b.constant(DType::I32, 0.0);
    // Poles (q = 0, -1, ..., -inf) are answered below; their lanes must not loop (a huge
    // negative q would never pass 9).
    let fq = b.floor(q);
    let qint = b.compare(q, fq, CmpDir::Eq);
    let qle = cmp_k(b, q, 0.0, CmpDir::Le);
    let pole = b.and(qle, qint);
    let looping = b.not(pole);
    let out = b.while_loop(
        &[i0, q, s0],
        |b, st| {
            let nine = b.constant(DType::I32, 9.0);
            let few = b.compare(st[0], nine, CmpDir::Lt);
            let low = cmp_k(b, st[1], 9.0, CmpDir::Le);
            let low = b.and(low, looping);
            let low = any(b, low);
            b.or(few, low)
        },
        |b, st| {
            let one = b.constant(DType::I32, 1.0);
            let i = b.add(st[0], one);
            let nine = b.constant(DType::I32, 9.0);
            let few = b.compare(st[0], nine, CmpDir::Lt);
            let few = b.broadcast_in_dim(few, &b.shape(st[1]), &[]);
            let low = cmp_k(b, st[1], 9.0, CmpDir::Le);
            let low = b.and(low, looping);
            let go = b.or(few, low);
            let a1 = add_k(b, st[1], 1.0);
            let a = b.select(go, a1, st[1]);
            let t = b.binary("stablehlo.power", a1, nx);
            let s1 = b.add(st[2], t);
            let s = b.select(go, s1, st[2]);
            vec![i, a, s]
        },
    );
    let (w, mut s) = (out[1], out[2]);
    let bw = b.binary("stablehlo.power", w, nx);
    let xm1 = add_k(b, x, -1.0);
    let t = b.mul(bw, w);
    let t = b.div(t, xm1);
    s = b.add(s, t);
    let h = scale(b, bw, 0.5);
    s = b.sub(s, h);
    // sum_j B_2j/(2j)! * x (x+1) ... (x+2j-2) * w^(-x-2j+1)
    let one = b.splat(w, 1.0);
    let iw = b.div(one, w);
    // T_j = x (x+1) ... (x+2j-2) w^(-x-2j+1), built one factor at a time so that an
    // underflowed w^-x stays 0 rather than meeting an overflowed product.
    let mut tj = b.mul(bw, iw);
    tj = b.mul(tj, x);
    for (j, cj) in EM_COEFFS.iter().enumerate() {
        if j > 0 {
            let k1 = add_k(b, x, (2 * j - 1) as f64);
            let k1 = b.mul(k1, iw);
            let k2 = add_k(b, x, (2 * j) as f64);
            let k2 = b.mul(k2, iw);
            tj = b.mul(tj, k1);
            tj = b.mul(tj, k2);
        }
        let t = scale(b, tj, *cj);
        s = b.add(s, t);
    }
    // Domain, in PyTorch's order of checks.
    let fx = b.floor(x);
    let xfrac = b.compare(x, fx, CmpDir::Ne);
    let qneg = cmp_k(b, q, 0.0, CmpDir::Lt);
    let dom = b.and(qneg, xfrac);
    s = select_k(b, dom, f64::NAN, s);
    s = select_k(b, pole, f64::INFINITY, s);
    let xlt = cmp_k(b, x, 1.0, CmpDir::Lt);
    s = select_k(b, xlt, f64::NAN, s);
    let x1 = cmp_k(b, x, 1.0, CmpDir::Eq);
    select_k(b, x1, f64::INFINITY, s)
}

fn polygamma(c: &mut Ctx) -> LResult<Vec<Out>> {
    let n = c.args.int("n")?;
    if n < 0 {
        return user_err(
            ErrorKind::Runtime,
            "polygamma(n, x) does not support negative n.",
        );
    }
    map(c, &["self"], to_float, |b, v| {
        wide(b, v[0], |b, x| match n {
            0 => digamma(b, x),
            1 => trigamma(b, x),
            _ => {
                // (-1)^(n+1) n! zeta(n+1, x)
                let fact: f64 = (1..=n).map(|k| k as f64).product();
                let s = b.splat(x, (n + 1) as f64);
                let z = zeta(b, s, x);
                scale(b, z, if n % 2 == 1 { fact } else { -fact })
            }
        })
    })
}

// ---------------------------------------------------------------------------
// Modified Bessel functions of the first kind (orders 0 and 1)
// ---------------------------------------------------------------------------

/// Below this |x| the power series of I_nu is used, above it the asymptotic expansion.
const BESSEL_I_SPLIT: f64 = 12.0;
/// The same for J_nu and Y_nu (whose series cancel, and whose Hankel expansions are
/// accurate sooner with few terms).
const BESSEL_JY_SPLIT: f64 = 8.0;

/// Coefficients c_k = w(k) (+-1)^k / (k! (k+nu)!) of a Bessel power series in x^2/4.
fn bessel_series(nu: u32, n: u32, alternating: bool, w: impl Fn(u32) -> f64) -> Vec<f64> {
    let mut t: f64 = (1..=nu).map(|k| 1.0 / k as f64).product();
    let mut out = Vec::new();
    for k in 0..n {
        if k > 0 {
            t /= (k * (k + nu)) as f64;
            if alternating {
                t = -t;
            }
        }
        out.push(t * w(k));
    }
    out
}

/// a_k(nu) = prod_{j<=k} (4 nu^2 - (2j-1)^2) / (k! 8^k), the coefficients of the large-x
/// expansions of Bessel functions (Hankel's for J and Y, and those of I and K).
fn hankel_coeffs(nu: u32, n: usize) -> Vec<f64> {
    let mu = (4 * nu * nu) as f64;
    let mut a = vec![1.0];
    for k in 1..n {
        let odd = (2 * k - 1) as f64;
        a.push(a[k - 1] * (mu - odd * odd) / (8.0 * k as f64));
    }
    a
}

/// psi(m) (digamma) at a positive integer m.
fn psi_int(m: u32) -> f64 {
    const EULER: f64 = 0.577_215_664_901_532_9;
    (1..m).map(|j| 1.0 / j as f64).sum::<f64>() - EULER
}

/// I_nu(x) for nu in {0, 1}; with `scaled`, exp(-|x|) * I_nu(x).
fn bessel_i(b: &mut Builder, x: Value, nu: u32, scaled: bool) -> Value {
    let ax = b.abs(x);
    // Power series in y = x^2/4: sum y^k / (k! (k+nu)!), times (|x|/2)^nu.
    let series = bessel_series(nu, 28, false, |_| 1.0);
    let (yh, yl) = quarter_square(b, ax);
    let mut small = horner_exact(b, yh, yl, &series);
    if nu == 1 {
        let h = scale(b, ax, 0.5);
        small = b.mul(small, h);
    }
    // Asymptotic expansion: exp(-x) I_nu(x) ~ sum a_k / x^k / sqrt(2 pi x).
    let asym: Vec<f64> = hankel_coeffs(nu, 12)
        .iter()
        .enumerate()
        .map(|(k, a)| if k.is_multiple_of(2) { *a } else { -a })
        .collect();
    let big = b.splat(ax, BESSEL_I_SPLIT);
    let axl = b.max(ax, big); // NaN stays NaN
    let one = b.splat(ax, 1.0);
    let z = b.div(one, axl);
    let s = horner(b, z, &asym);
    let r = scale(b, axl, 2.0 * std::f64::consts::PI);
    let r = b.rsqrt(r);
    let large_e = b.mul(s, r);
    let use_small = cmp_k(b, ax, BESSEL_I_SPLIT, CmpDir::Le);
    let out = if scaled {
        let nax = b.neg(ax);
        let e = b.exp(nax);
        let small_e = b.mul(small, e);
        b.select(use_small, small_e, large_e)
    } else {
        // exp(|x|/2) twice: I_nu stays finite a little beyond where exp(|x|) overflows.
        let h = scale(b, axl, 0.5);
        let e = b.exp(h);
        let l = b.mul(large_e, e);
        // At |x| = inf this is 0 * inf = NaN, as PyTorch's kernels give.
        let l = b.mul(l, e);
        b.select(use_small, small, l)
    };
    if nu == 1 {
        // I_1 is odd.
        let neg = cmp_k(b, x, 0.0, CmpDir::Lt);
        let n = b.neg(out);
        b.select(neg, n, out)
    } else {
        out
    }
}

/// J_nu and Y_nu (nu in {0, 1}) for x > 0 by Hankel's expansion (x large):
/// sqrt(2/(pi x)) (P cos(chi) - Q sin(chi)) and sqrt(2/(pi x)) (P sin(chi) + Q cos(chi)).
fn hankel_jy(b: &mut Builder, x: Value, nu: u32) -> (Value, Value) {
    // Six terms each: near the split more would only add the divergent tail.
    let a = hankel_coeffs(nu, 12);
    let sgn = |k: usize| if k.is_multiple_of(2) { 1.0 } else { -1.0 };
    let pc: Vec<f64> = (0..6).map(|k| sgn(k) * a[2 * k]).collect();
    let qc: Vec<f64> = (0..6).map(|k| sgn(k) * a[2 * k + 1]).collect();
    let one = b.splat(x, 1.0);
    let z = b.div(one, x);
    let z2 = b.mul(z, z);
    let p = horner(b, z2, &pc);
    let q = horner(b, z2, &qc);
    let q = b.mul(q, z);
    let shift = (nu as f64 / 2.0 + 0.25) * std::f64::consts::PI;
    let chi = add_k(b, x, -shift);
    let c = b.unary("stablehlo.cosine", chi);
    let s = b.unary("stablehlo.sine", chi);
    let r = b.div(one, x);
    let r = scale(b, r, 2.0 / std::f64::consts::PI);
    let r = b.sqrt(r);
    let pc_ = b.mul(p, c);
    let qs = b.mul(q, s);
    let j = b.sub(pc_, qs);
    let ps = b.mul(p, s);
    let qc_ = b.mul(q, c);
    let y = b.add(ps, qc_);
    (b.mul(r, j), b.mul(r, y))
}

/// Bessel function of the first kind J_nu, nu in {0, 1}.
fn bessel_j(b: &mut Builder, x: Value, nu: u32) -> Value {
    let ax = b.abs(x);
    let (yh, yl) = quarter_square(b, ax);
    let c = bessel_series(nu, 24, true, |_| 1.0);
    let mut small = horner_exact(b, yh, yl, &c);
    if nu == 1 {
        let h = scale(b, ax, 0.5);
        small = b.mul(small, h);
    }
    let big = b.splat(ax, BESSEL_JY_SPLIT);
    let axl = b.max(ax, big);
    let (large, _) = hankel_jy(b, axl, nu);
    let use_small = cmp_k(b, ax, BESSEL_JY_SPLIT, CmpDir::Le);
    let r = b.select(use_small, small, large);
    // PyTorch gives NaN at infinities.
    let inf = cmp_k(b, ax, f64::INFINITY, CmpDir::Eq);
    let r = select_k(b, inf, f64::NAN, r);
    if nu == 1 {
        // J_1 is odd.
        let neg = cmp_k(b, x, 0.0, CmpDir::Lt);
        let n = b.neg(r);
        b.select(neg, n, r)
    } else {
        r
    }
}

/// Bessel function of the second kind Y_nu, nu in {0, 1}: -inf at 0, NaN for x < 0.
fn bessel_y(b: &mut Builder, x: Value, nu: u32) -> Value {
    // Small x: (2/pi) ln(x/2) J_nu(x) - (1/pi) (x/2)^nu sum_k (psi(k+1) + psi(nu+k+1))
    // (-x^2/4)^k / (k! (nu+k)!), and -2/(pi x) more for nu = 1.
    let big = b.splat(x, BESSEL_JY_SPLIT);
    let xs = b.min(x, big);
    let (yh, yl) = quarter_square(b, xs);
    let c = bessel_series(nu, 24, true, |k| psi_int(k + 1) + psi_int(nu + k + 1));
    let mut sum = horner_exact(b, yh, yl, &c);
    let h = scale(b, xs, 0.5);
    if nu == 1 {
        sum = b.mul(sum, h);
    }
    let j = bessel_j(b, xs, nu);
    let l = b.log(h);
    let lj = b.mul(l, j);
    let lj = scale(b, lj, 2.0 / std::f64::consts::PI);
    let sum = scale(b, sum, 1.0 / std::f64::consts::PI);
    let mut small = b.sub(lj, sum);
    if nu == 1 {
        let one = b.splat(x, 1.0);
        let inv = b.div(one, xs);
        let inv = scale(b, inv, 2.0 / std::f64::consts::PI);
        small = b.sub(small, inv);
    }
    let xl = b.max(x, big);
    let (_, large) = hankel_jy(b, xl, nu);
    let use_small = cmp_k(b, x, BESSEL_JY_SPLIT, CmpDir::Le);
    let r = b.select(use_small, small, large);
    let zero = cmp_k(b, x, 0.0, CmpDir::Eq);
    let r = select_k(b, zero, f64::NEG_INFINITY, r);
    let neg = cmp_k(b, x, 0.0, CmpDir::Lt);
    let r = select_k(b, neg, f64::NAN, r);
    let inf = cmp_k(b, x, f64::INFINITY, CmpDir::Eq);
    select_k(b, inf, f64::NAN, r)
}

/// Below this x the modified Bessel functions K use their power series.
const BESSEL_K_SPLIT: f64 = 2.0;

/// Modified Bessel function of the second kind K_nu, nu in {0, 1}; with `scaled`,
/// exp(x) K_nu(x). +inf at 0, NaN for x < 0.
fn bessel_k(b: &mut Builder, x: Value, nu: u32, scaled: bool) -> Value {
    // Small x: (-1)^(nu+1) ln(x/2) I_nu(x) + (-1)^nu (1/2) (x/2)^nu sum_k (psi(k+1) +
    // psi(nu+k+1)) (x^2/4)^k / (k! (nu+k)!), and 1/x more for nu = 1.
    let split = b.splat(x, BESSEL_K_SPLIT);
    let xs = b.min(x, split);
    let y = b.mul(xs, xs);
    let y = scale(b, y, 0.25);
    let c = bessel_series(nu, 16, false, |k| psi_int(k + 1) + psi_int(nu + k + 1));
    let mut sum = horner(b, y, &c);
    let h = scale(b, xs, 0.5);
    if nu == 1 {
        sum = b.mul(sum, h);
    }
    let sum = scale(b, sum, if nu == 0 { 0.5 } else { -0.5 });
    let i = bessel_i(b, xs, nu, false);
    let l = b.log(h);
    let li = b.mul(l, i);
    let mut small = if nu == 0 {
        b.sub(sum, li)
    } else {
        b.add(sum, li)
    };
    if nu == 1 {
        let one = b.splat(x, 1.0);
        let inv = b.div(one, xs);
        small = b.add(small, inv);
    }
    if scaled {
        let e = b.exp(xs);
        small = b.mul(small, e);
    }
    // Large x: exp(x) K_nu(x) = int_0^inf exp(-x (cosh t - 1)) cosh(nu t) dt by the
    // trapezoidal rule (exponentially accurate here), with steps scaled as 1/sqrt(x).
    let xl = b.max(x, split);
    let r = b.rsqrt(xl);
    let h = scale(b, r, 0.5);
    let mut acc = b.splat(x, 0.5); // the t = 0 node, half weight
    for j in 1..=16 {
        let t = scale(b, h, j as f64 * 0.5);
        let sh = b.unary("chlo.sinh", t);
        let cm1 = b.mul(sh, sh);
        let cm1 = scale(b, cm1, 2.0); // cosh(jh) - 1
        let e = b.mul(xl, cm1);
        let e = b.neg(e);
        let mut v = b.exp(e);
        if nu == 1 {
            let ch = add_k(b, cm1, 1.0);
            v = b.mul(v, ch);
        }
        acc = b.add(acc, v);
    }
    let mut large = b.mul(acc, h);
    if !scaled {
        let nx = b.neg(xl);
        let e = b.exp(nx);
        large = b.mul(large, e);
    }
    let use_small = cmp_k(b, x, BESSEL_K_SPLIT, CmpDir::Lt);
    let r = b.select(use_small, small, large);
    let zero = cmp_k(b, x, 0.0, CmpDir::Eq);
    let r = select_k(b, zero, f64::INFINITY, r);
    let neg = cmp_k(b, x, 0.0, CmpDir::Lt);
    let r = select_k(b, neg, f64::NAN, r);
    let inf = cmp_k(b, x, f64::INFINITY, CmpDir::Eq);
    select_k(b, inf, 0.0, r)
}

/// Airy function Ai: Maclaurin series for |x| <= 4, asymptotic expansions beyond.
fn airy_ai(b: &mut Builder, x: Value) -> Value {
    const SPLIT: f64 = 4.0;
    const AI0: f64 = 0.355_028_053_887_817_2; // Ai(0)
    const DAI0: f64 = 0.258_819_403_792_806_8; // -Ai'(0)
                                               // Ai(x) = Ai(0) f(x) + Ai'(0) g(x), f = sum x^3k / ((2*3)(5*6)...), g = x sum x^3k / ((3*4)(6*7)...)
    let (mut fc, mut gc) = (vec![1.0], vec![1.0]);
    for k in 1..=16 {
        let k3 = (3 * k) as f64;
        let pf: f64 = fc[k - 1];
        let pg: f64 = gc[k - 1];
        fc.push(pf / ((k3 - 1.0) * k3));
        gc.push(pg / (k3 * (k3 + 1.0)));
    }
    let lim = b.splat(x, SPLIT);
    let nlim = b.splat(x, -SPLIT);
    let xs = b.clamp(nlim, x, lim);
    let x3 = b.mul(xs, xs);
    let x3 = b.mul(x3, xs);
    let f = horner(b, x3, &fc);
    let g = horner(b, x3, &gc);
    let g = b.mul(g, xs);
    let f = scale(b, f, AI0);
    let g = scale(b, g, DAI0);
    let small = b.sub(f, g);
    // u_k of the asymptotic expansions in zeta = (2/3) |x|^(3/2).
    let mut u = vec![1.0];
    for k in 1..=12usize {
        let kf = k as f64;
        let num = (6.0 * kf - 5.0) * (6.0 * kf - 3.0) * (6.0 * kf - 1.0);
        u.push(u[k - 1] * num / ((2.0 * kf - 1.0) * 216.0 * kf));
    }
    let ax = b.abs(x);
    let axl = b.max(ax, lim);
    let sq = b.sqrt(axl);
    let zeta = b.mul(axl, sq);
    let zeta = scale(b, zeta, 2.0 / 3.0);
    let one = b.splat(x, 1.0);
    let iz = b.div(one, zeta);
    let q4 = b.sqrt(sq); // |x|^(1/4)
    let norm = scale(b, q4, std::f64::consts::PI.sqrt());
    let norm = b.div(one, norm);
    // x > 0: exp(-zeta) / (2 sqrt(pi) x^(1/4)) sum (-1)^k u_k / zeta^k
    let alt: Vec<f64> = u
        .iter()
        .enumerate()
        .map(|(k, v)| if k.is_multiple_of(2) { *v } else { -v })
        .collect();
    let s = horner(b, iz, &alt);
    let nz = b.neg(zeta);
    let e = b.exp(nz);
    let pos = b.mul(s, e);
    let pos = b.mul(pos, norm);
    let pos = scale(b, pos, 0.5);
    // x < 0: (sin(zeta + pi/4) P - cos(zeta + pi/4) Q) / (sqrt(pi) |x|^(1/4)), with
    // P = sum (-1)^k u_2k / zeta^2k and Q = sum (-1)^k u_2k+1 / zeta^(2k+1).
    let sgn = |k: usize| if k.is_multiple_of(2) { 1.0 } else { -1.0 };
    let pc: Vec<f64> = (0..6).map(|k| sgn(k) * u[2 * k]).collect();
    let qc: Vec<f64> = (0..6).map(|k| sgn(k) * u[2 * k + 1]).collect();
    let iz2 = b.mul(iz, iz);
    let p = horner(b, iz2, &pc);
    let q = horner(b, iz2, &qc);
    let q = b.mul(q, iz);
    let th = add_k(b, zeta, std::f64::consts::FRAC_PI_4);
    let sn = b.unary("stablehlo.sine", th);
    let cs = b.unary("stablehlo.cosine", th);
    let ps = b.mul(p, sn);
    let qc_ = b.mul(q, cs);
    let neg = b.sub(ps, qc_);
    let neg = b.mul(neg, norm);
    let hi = cmp_k(b, x, SPLIT, CmpDir::Gt);
    let lo = cmp_k(b, x, -SPLIT, CmpDir::Lt);
    let r = b.select(hi, pos, small);
    let r = b.select(lo, neg, r);
    // PyTorch gives NaN at infinities.
    let inf = cmp_k(b, ax, f64::INFINITY, CmpDir::Eq);
    select_k(b, inf, f64::NAN, r)
}

/// Spherical Bessel function j0 = sin(x)/x.
fn spherical_j0(b: &mut Builder, x: Value) -> Value {
    let s = b.unary("stablehlo.sine", x);
    let r = b.div(s, x);
    let zero = cmp_k(b, x, 0.0, CmpDir::Eq);
    let r = select_k(b, zero, 1.0, r);
    let ax = b.abs(x);
    let inf = cmp_k(b, ax, f64::INFINITY, CmpDir::Eq);
    select_k(b, inf, 0.0, r)
}

// ---------------------------------------------------------------------------
// Orthogonal polynomials of degree n (a tensor, truncated to an integer)
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Poly {
    /// Chebyshev of the first..fourth kinds (T, U, V, W), `shifted` to [0, 1].
    Cheb(u8, bool),
    /// Physicists' Hermite H.
    H,
    /// Probabilists' Hermite He.
    He,
    /// Laguerre L.
    L,
    /// Legendre P.
    P,
}

/// trunc(x) for floats.
fn trunc_f(b: &mut Builder, x: Value) -> Value {
    let neg = cmp_k(b, x, 0.0, CmpDir::Lt);
    let c = b.unary("stablehlo.ceil", x);
    let f = b.floor(x);
    b.select(neg, c, f)
}

/// The three-term recurrence of `kind`: r_m from q = r_(m-1), p = r_(m-2).
fn poly_step(b: &mut Builder, kind: Poly, x: Value, m: Value, p: Value, q: Value) -> Value {
    let k = add_k(b, m, -1.0);
    match kind {
        Poly::Cheb(..) => {
            let xx = b.add(x, x);
            let t = b.mul(xx, q);
            b.sub(t, p)
        }
        Poly::H => {
            let xx = b.add(x, x);
            let t = b.mul(xx, q);
            let kk = b.add(k, k);
            let kp = b.mul(kk, p);
            b.sub(t, kp)
        }
        Poly::He => {
            let t = b.mul(x, q);
            let kp = b.mul(k, p);
            b.sub(t, kp)
        }
        Poly::L => {
            // (((k + k) + (1 - x)) q - k p) / (k + 1)
            let kk = b.add(k, k);
            let one = b.splat(x, 1.0);
            let omx = b.sub(one, x);
            let a = b.add(kk, omx);
            let t = b.mul(a, q);
            let kp = b.mul(k, p);
            let t = b.sub(t, kp);
            b.div(t, m)
        }
        Poly::P => {
            // ((k + k + 1) x q - k p) / (k + 1)
            let kk = b.add(k, k);
            let a = add_k(b, kk, 1.0);
            let a = b.mul(a, x);
            let t = b.mul(a, q);
            let kp = b.mul(k, p);
            let t = b.sub(t, kp);
            b.div(t, m)
        }
    }
}

/// Chebyshev values where the recurrence is not used: at y = +-1, and for large n inside
/// (-1, 1) the trigonometric forms. Returns (value at |y| == 1, closed form).
fn cheb_special(b: &mut Builder, kind: u8, y: Value, n: Value) -> (Value, Value) {
    let one = b.splat(y, 1.0);
    let pos = cmp_k(b, y, 0.0, CmpDir::Gt);
    let half = scale(b, n, 0.5);
    let fl = b.floor(half);
    let even = b.compare(half, fl, CmpDir::Eq);
    let n1 = add_k(b, n, 1.0);
    let nn = b.add(n, n);
    let n21 = add_k(b, nn, 1.0);
    let alt = |b: &mut Builder, v: Value| {
        let nv = b.neg(v);
        b.select(even, v, nv)
    };
    let th = b.unary("chlo.acos", y);
    let (edge, closed) = match kind {
        0 => {
            let e = alt(b, one);
            let e = b.select(pos, one, e);
            let a = b.mul(n, th);
            (e, b.unary("stablehlo.cosine", a))
        }
        1 => {
            let e = alt(b, n1);
            let e = b.select(pos, n1, e);
            let s = b.unary("stablehlo.sine", th);
            let a = b.mul(n1, th);
            let sa = b.unary("stablehlo.sine", a);
            let main = b.div(sa, s);
            let ca = b.unary("stablehlo.cosine", a);
            let other = b.mul(n1, ca);
            let other = b.div(other, y);
            let s0 = cmp_k(b, s, 0.0, CmpDir::Ne);
            (e, b.select(s0, main, other))
        }
        2 => {
            let e = alt(b, n21);
            let e = b.select(pos, one, e);
            let h = scale(b, th, 0.5);
            let sh = b.unary("stablehlo.sine", h);
            let ch = b.unary("stablehlo.cosine", h);
            let nh = add_k(b, n, 0.5);
            let a = b.mul(nh, th);
            let ca = b.unary("stablehlo.cosine", a);
            let main = b.div(ca, ch);
            let ok = cmp_k(b, sh, 1.0, CmpDir::Ne);
            let other = alt(b, n21);
            (e, b.select(ok, main, other))
        }
        _ => {
            let e = alt(b, one);
            let e = b.select(pos, n21, e);
            let h = scale(b, th, 0.5);
            let sh = b.unary("stablehlo.sine", h);
            let ch = b.unary("stablehlo.cosine", h);
            let nh = add_k(b, n, 0.5);
            let a = b.mul(nh, th);
            let sa = b.unary("stablehlo.sine", a);
            let main = b.div(sa, sh);
            let ok = cmp_k(b, ch, 1.0, CmpDir::Ne);
            (e, b.select(ok, main, e))
        }
    };
    (edge, closed)
}

fn poly(c: &mut Ctx, kind: Poly) -> LResult<Vec<Out>> {
    map_special(c, &["x", "n"], |b, v| poly_values(b, kind, v[0], v[1]))
}

fn poly_values(b: &mut Builder, kind: Poly, x: Value, n: Value) -> Value {
    // n as PyTorch's int64 cast of it; NaN, infinities and values beyond int64 act as a
    // negative degree (what the cast gives on x86).
    let n = trunc_f(b, n);
    let an = b.abs(n);
    let ok = cmp_k(b, an, 9.2e18, CmpDir::Lt); // false for NaN
    let m1 = b.splat(n, -1.0);
    let n = b.select(ok, n, m1);
    let n_int = b.convert(n, DType::I64);
    let y = match kind {
        Poly::Cheb(_, true) => {
            let xx = b.add(x, x);
            add_k(b, xx, -1.0)
        }
        _ => x,
    };
    let one = b.splat(x, 1.0);
    let q0 = match kind {
        Poly::Cheb(0, _) | Poly::He | Poly::P => y,
        Poly::Cheb(1, _) | Poly::H => b.add(y, y),
        Poly::Cheb(2, _) => {
            let yy = b.add(y, y);
            add_k(b, yy, -1.0)
        }
        Poly::Cheb(_, _) => {
            let yy = b.add(y, y);
            add_k(b, yy, 1.0)
        }
        Poly::L => b.sub(one, x),
    };
    // Lanes the closed forms answer do not take part in the recurrence.
    let ay = b.abs(y);
    let inside = cmp_k(b, ay, 1.0, CmpDir::Lt);
    let closed_lane = match kind {
        Poly::Cheb(k, shifted) => {
            let thr = match (k, shifted) {
                (3, true) => 4.0,
                (_, true) | (0, false) => 6.0,
                _ => 8.0,
            };
            let big = cmp_k(b, n, thr, CmpDir::Gt);
            Some(b.and(big, inside))
        }
        _ => None,
    };
    let mut rec = cmp_k(b, n, 2.0, CmpDir::Ge);
    if let Some(cl) = closed_lane {
        let ncl = b.not(cl);
        rec = b.and(rec, ncl);
    }
    // Lanes with a fixed answer (y = +-1, Laguerre at 0) skip the loop too: their
    // recurrence never overflows to stop early.
    let edge = match kind {
        Poly::Cheb(..) | Poly::P => Some(cmp_k(b, ay, 1.0, CmpDir::Eq)),
        Poly::L => Some(cmp_k(b, x, 0.0, CmpDir::Eq)),
        _ => None,
    };
    if let Some(e) = edge {
        let ne = b.not(e);
        rec = b.and(rec, ne);
    }
    if kind == Poly::H || kind == Poly::He {
        let ok = cmp_k(b, n, 128.0, CmpDir::Le);
        rec = b.and(rec, ok);
    }
    // m = 2, 3, ... (an int64 count, exact for any degree): lanes step while m <= n and
    // q is not NaN.
    let m0 = b.constant(DType::I64, 2.0);
    let active = |b: &mut Builder, m: Value, q: Value| {
        let mv = b.broadcast_in_dim(m, &b.shape(q), &[]);
        let le = b.compare(mv, n_int, CmpDir::Le);
        let ok = b.compare(q, q, CmpDir::Eq);
        let a = b.and(le, ok);
        b.and(a, rec)
    };
    let out = b.while_loop(
        &[m0, one, q0],
        |b, s| {
            let a = active(b, s[0], s[2]);
            any(b, a)
        },
        |b, s| {
            let (m, p, q) = (s[0], s[1], s[2]);
            let a = active(b, m, q);
            let mf = b.convert(m, b.dtype(q));
            let mv = b.broadcast_in_dim(mf, &b.shape(q), &[]);
            let r = poly_step(b, kind, y, mv, p, q);
            let np = b.select(a, q, p);
            let nq = b.select(a, r, q);
            let m1 = b.constant(b.dtype(m), 1.0);
            vec![b.add(m, m1), np, nq]
        },
    );
    let mut r = out[2];
    // n == 1 and n == 0 (and lanes that skipped the loop keep q0).
    let is0 = cmp_k(b, n, 0.0, CmpDir::Eq);
    r = b.select(is0, one, r);
    if kind == Poly::H || kind == Poly::He {
        let big = cmp_k(b, n, 128.0, CmpDir::Gt);
        r = select_k(b, big, f64::NAN, r);
    }
    match kind {
        Poly::Cheb(k, _) => {
            let (edge, closed) = cheb_special(b, k, y, n);
            if let Some(cl) = closed_lane {
                r = b.select(cl, closed, r);
            }
            let at1 = cmp_k(b, ay, 1.0, CmpDir::Eq);
            r = b.select(at1, edge, r);
        }
        Poly::L => {
            let x0 = cmp_k(b, x, 0.0, CmpDir::Eq);
            r = select_k(b, x0, 1.0, r);
        }
        Poly::P => {
            let at1 = cmp_k(b, ay, 1.0, CmpDir::Eq);
            let pos = cmp_k(b, y, 0.0, CmpDir::Gt);
            let half = scale(b, n, 0.5);
            let fl = b.floor(half);
            let even = b.compare(half, fl, CmpDir::Eq);
            let plus = b.or(pos, even);
            let m1 = b.splat(x, -1.0);
            let e = b.select(plus, one, m1);
            r = b.select(at1, e, r);
        }
        _ => {}
    }
    let neg = cmp_k(b, n, 0.0, CmpDir::Lt);
    select_k(b, neg, 0.0, r)
}

// ---------------------------------------------------------------------------
// erfcx, normal distribution
// ---------------------------------------------------------------------------

const FRAC_1_SQRT_PI: f64 = 0.564_189_583_547_756_3;

/// erfcx(x) for x >= 1: Laplace's continued fraction 1/sqrt(pi) / (x + (1/2)/(x + 1/(x + ...))).
fn erfcx_cf(b: &mut Builder, x: Value) -> Value {
    let mut t = x;
    for k in (1..=60).rev() {
        let q = b.splat(x, k as f64 / 2.0);
        let q = b.div(q, t);
        t = b.add(x, q);
    }
    let k = b.splat(x, FRAC_1_SQRT_PI);
    b.div(k, t)
}

/// erf(x) for |x| <= 1 by its Taylor series (chlo.erf is a few ulp off).
fn erf_taylor(b: &mut Builder, x: Value) -> Value {
    let mut coeffs = Vec::new();
    let mut f = 1.0;
    for n in 0..14u32 {
        if n > 0 {
            f *= n as f64;
        }
        let sign = if n.is_multiple_of(2) { 1.0 } else { -1.0 };
        coeffs.push(sign * 2.0 * FRAC_1_SQRT_PI / (f * (2 * n + 1) as f64));
    }
    let x2 = b.mul(x, x);
    let p = horner(b, x2, &coeffs);
    b.mul(x, p)
}

/// erfcx(x) = exp(x^2) erfc(x), for x >= 0 (and NaN).
fn erfcx_pos(b: &mut Builder, ax: Value) -> Value {
    // x < 1: the Taylor series sum (-x)^n / Gamma(n/2 + 1).
    let mut series = Vec::new();
    let (mut even, mut odd) = (1.0, 2.0 * FRAC_1_SQRT_PI); // 1/Gamma(1), 1/Gamma(3/2)
    for n in 0..30u32 {
        if n.is_multiple_of(2) {
            series.push(even);
            even /= (n / 2 + 1) as f64;
        } else {
            series.push(-odd);
            odd /= (n / 2) as f64 + 1.5;
        }
    }
    let one = b.splat(ax, 1.0);
    let axs = b.min(ax, one);
    let small = horner(b, axs, &series);
    let axl = b.max(ax, one); // NaN stays NaN
    let large = erfcx_cf(b, axl);
    let use_small = cmp_k(b, ax, 1.0, CmpDir::Lt);
    b.select(use_small, small, large)
}

fn erfcx(b: &mut Builder, x: Value) -> Value {
    let ax = b.abs(x);
    let pos = erfcx_pos(b, ax);
    // erfcx(-x) = 2 exp(x^2) - erfcx(x)
    let x2 = b.mul(x, x);
    let e = b.exp(x2);
    let e2 = scale(b, e, 2.0);
    let negv = b.sub(e2, pos);
    let nonneg = cmp_k(b, x, 0.0, CmpDir::Ge);
    let nan = is_nan(b, x);
    let keep = b.or(nonneg, nan);
    b.select(keep, pos, negv)
}

/// chlo.erf_inv polished by a Newton step whose residual erf(y) - x is computed
/// accurately (a Taylor series near 0, erfc through erfcx in the tails).
fn erfinv(b: &mut Builder, x: Value) -> Value {
    let y0 = b.unary("chlo.erf_inv", x);
    let ax = b.abs(x);
    let ay = b.abs(y0);
    let one = b.splat(ax, 1.0);
    let ays = b.min(ay, one);
    let e = erf_taylor(b, ays);
    let central = b.sub(e, ax);
    // erf(y) - x = (1 - x) - exp(-y^2) erfcx(y), 1 - x exact for x >= 1/2.
    let y2 = b.mul(ay, ay);
    let ny2 = b.neg(y2);
    let g = b.exp(ny2);
    let ayl = b.max(ay, one);
    let cx = erfcx_cf(b, ayl);
    let ec = b.mul(g, cx);
    let omx = b.sub(one, ax);
    let tail = b.sub(omx, ec);
    let small = cmp_k(b, ay, 1.0, CmpDir::Lt);
    let d = b.select(small, central, tail);
    let slope = scale(b, g, 2.0 * FRAC_1_SQRT_PI);
    let step = b.div(d, slope);
    let ay1 = b.sub(ay, step);
    let y1 = copysign(b, ay1, x);
    // +-1 (infinite y), beyond (NaN) and NaN keep chlo's answer.
    let inside = cmp_k(b, ax, 1.0, CmpDir::Lt);
    b.select(inside, y1, y0)
}

fn log_ndtr(b: &mut Builder, x: Value) -> Value {
    let t = scale(b, x, std::f64::consts::FRAC_1_SQRT_2);
    // Far left tail: log(erfcx(-t) / 2) - t^2.
    let nt = b.neg(t);
    let ex = erfcx(b, nt);
    let ex = scale(b, ex, 0.5);
    let l = b.log(ex);
    let t2 = b.mul(t, t);
    let tail = b.sub(l, t2);
    // Elsewhere: log1p(-erfc(t) / 2).
    let ec = b.unary("chlo.erfc", t);
    let ec = scale(b, ec, -0.5);
    let body = b.unary("stablehlo.log_plus_one", ec);
    let left = cmp_k(b, x, -1.0, CmpDir::Lt);
    b.select(left, tail, body)
}

fn ndtri(b: &mut Builder, p: Value) -> Value {
    let y = scale(b, p, 2.0);
    let y = add_k(b, y, -1.0);
    let e = b.unary("chlo.erf_inv", y);
    scale(b, e, std::f64::consts::SQRT_2)
}

// ---------------------------------------------------------------------------
// Elementary functions
// ---------------------------------------------------------------------------

fn sinc(b: &mut Builder, x: Value) -> Value {
    let px = scale(b, x, std::f64::consts::PI);
    let s = b.unary("stablehlo.sine", px);
    let q = b.div(s, px);
    let zero = cmp_k(b, x, 0.0, CmpDir::Eq);
    select_k(b, zero, 1.0, q)
}

fn entr(b: &mut Builder, x: Value) -> Value {
    let l = b.log(x);
    let xl = b.mul(x, l);
    let r = b.neg(xl);
    let zero = cmp_k(b, x, 0.0, CmpDir::Eq);
    let r = select_k(b, zero, 0.0, r);
    let neg = cmp_k(b, x, 0.0, CmpDir::Lt);
    select_k(b, neg, f64::NEG_INFINITY, r)
}

/// `x * log_fn(y)`, 0 where x == 0 unless y is NaN.
fn xlog(b: &mut Builder, x: Value, y: Value, log_fn: &str) -> Value {
    let l = b.unary(log_fn, y);
    let p = b.mul(x, l);
    let zero = cmp_k(b, x, 0.0, CmpDir::Eq);
    let p = select_k(b, zero, 0.0, p);
    let nan = is_nan(b, y);
    select_k(b, nan, f64::NAN, p)
}

fn hypot(b: &mut Builder, x: Value, y: Value) -> Value {
    let ax = b.abs(x);
    let ay = b.abs(y);
    let m = b.max(ax, ay);
    let n = b.min(ax, ay);
    let q = b.div(n, m);
    let q2 = b.mul(q, q);
    let s = add_k(b, q2, 1.0);
    let s = b.sqrt(s);
    let r = b.mul(m, s);
    let zero = cmp_k(b, m, 0.0, CmpDir::Eq);
    let r = select_k(b, zero, 0.0, r);
    // An infinite side wins over a NaN one.
    let xi = cmp_k(b, ax, f64::INFINITY, CmpDir::Eq);
    let yi = cmp_k(b, ay, f64::INFINITY, CmpDir::Eq);
    let inf = b.or(xi, yi);
    select_k(b, inf, f64::INFINITY, r)
}

/// log(b^x + b^y) in base e (`base2` false) or 2.
fn logaddexp(b: &mut Builder, x: Value, y: Value, base2: bool) -> Value {
    let m = b.max(x, y);
    let d = b.sub(x, y);
    let d = b.abs(d);
    let nd = b.neg(d);
    let r = if base2 {
        let e = scale(b, nd, std::f64::consts::LN_2);
        let e = b.exp(e);
        let l = b.unary("stablehlo.log_plus_one", e);
        let l = scale(b, l, std::f64::consts::LOG2_E);
        b.add(m, l)
    } else {
        let e = b.exp(nd);
        let l = b.unary("stablehlo.log_plus_one", e);
        b.add(m, l)
    };
    // Equal infinities: the difference is NaN, the answer is the infinity itself.
    let ax = b.abs(x);
    let inf = cmp_k(b, ax, f64::INFINITY, CmpDir::Eq);
    let eq = b.compare(x, y, CmpDir::Eq);
    let both = b.and(inf, eq);
    b.select(both, x, r)
}

fn copysign(b: &mut Builder, x: Value, y: Value) -> Value {
    let a = b.abs(x);
    let n = b.neg(a);
    let s = signbit_float(b, y);
    b.select(s, n, a)
}

/// fmax/fmin: like maximum/minimum, but a NaN loses to a number.
fn fminmax(b: &mut Builder, x: Value, y: Value, max: bool) -> Value {
    let r = if max { b.max(x, y) } else { b.min(x, y) };
    if !b.dtype(x).is_float() {
        return r;
    }
    let xn = is_nan(b, x);
    let yn = is_nan(b, y);
    let r = b.select(yn, x, r);
    b.select(xn, y, r)
}

fn nan_to_num(c: &mut Ctx) -> LResult<Vec<Out>> {
    let nan = c.args.opt_float("nan").unwrap_or(0.0);
    let posinf = c.args.opt_float("posinf");
    let neginf = c.args.opt_float("neginf");
    map(c, &["self"], same, |b, v| {
        let x = v[0];
        let dt = b.dtype(x);
        if !dt.is_float() {
            return x;
        }
        let hi = float_full(b, x, posinf.unwrap_or(float_max(dt)));
        let lo = float_full(b, x, neginf.unwrap_or(-float_max(dt)));
        let nv = float_full(b, x, nan);
        let pi = cmp_k(b, x, f64::INFINITY, CmpDir::Eq);
        let ni = cmp_k(b, x, f64::NEG_INFINITY, CmpDir::Eq);
        let n = is_nan(b, x);
        let r = b.select(pi, hi, x);
        let r = b.select(ni, lo, r);
        b.select(n, nv, r)
    })
}

fn is_inf_dir(c: &mut Ctx, v: f64) -> LResult<Vec<Out>> {
    let (x, dt, _) = promote(c, &["self"], same)?;
    let x = x[0];
    let r = if dt.is_float() {
        cmp_k(c.b, x, v, CmpDir::Eq)
    } else {
        c.b.full(DType::Bool, &c.b.shape(x), 0.0)
    };
    Ok(vec![Out::T(r)])
}

fn heaviside(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = c.args.tensor("self")?.dtype;
    let v = c.args.tensor("values")?.dtype;
    if a != v {
        return user_err(
            ErrorKind::Runtime,
            "heaviside is not yet implemented for tensors with different dtypes.",
        );
    }
    map(c, &["self", "values"], same, |b, v| {
        let (x, val) = (v[0], v[1]);
        if b.dtype(x) == DType::Bool {
            // x > 0 is x itself; x == 0 takes the value.
            return b.or(x, val);
        }
        let pos = cmp_k(b, x, 0.0, CmpDir::Gt);
        let step = b.convert(pos, b.dtype(x));
        let zero = cmp_k(b, x, 0.0, CmpDir::Eq);
        b.select(zero, val, step)
    })
}

// ---------------------------------------------------------------------------
// logit
// ---------------------------------------------------------------------------

fn logit(c: &mut Ctx) -> LResult<Vec<Out>> {
    let eps = c.args.opt_float("eps").filter(|e| *e >= 0.0);
    map(c, &["self"], to_float, |b, v| {
        wide(b, v[0], |b, x| logit_values(b, x, eps))
    })
}

fn logit_values(b: &mut Builder, x: Value, eps: Option<f64>) -> Value {
    let mut x = x;
    if let Some(e) = eps {
        // x < lo ? lo : (x > hi ? hi : x), which also covers eps > 0.5 (lo > hi).
        let hi = cmp_k(b, x, 1.0 - e, CmpDir::Gt);
        let lo = cmp_k(b, x, e, CmpDir::Lt);
        x = select_k(b, hi, 1.0 - e, x);
        x = select_k(b, lo, e, x);
    }
    let one = b.splat(x, 1.0);
    let d = b.sub(one, x);
    let q = b.div(x, d);
    b.log(q)
}

fn logit_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let eps = c.args.opt_float("eps").filter(|e| *e >= 0.0);
    map_only(
        c,
        &["grad_output", "self"],
        "logit_backward_cpu",
        is_float,
        |b, v| {
            let (g, x) = (v[0], v[1]);
            let one = b.splat(x, 1.0);
            let d = b.sub(one, x);
            let den = b.mul(x, d);
            let r = b.div(g, den);
            match eps {
                Some(e) => {
                    let lo = cmp_k(b, x, e, CmpDir::Lt);
                    let hi = cmp_k(b, x, 1.0 - e, CmpDir::Gt);
                    let out = b.or(lo, hi);
                    select_k(b, out, 0.0, r)
                }
                None => {
                    let lo = cmp_k(b, x, 0.0, CmpDir::Lt);
                    let hi = cmp_k(b, x, 1.0, CmpDir::Gt);
                    let out = b.or(lo, hi);
                    select_k(b, out, f64::NAN, r)
                }
            }
        },
    )
}

// ---------------------------------------------------------------------------
// Integer ops: shifts, gcd, lcm
// ---------------------------------------------------------------------------

fn shift(c: &mut Ctx, left: bool) -> LResult<Vec<Out>> {
    if c.op.starts_with("aten::__i") {
        // `a <<= b` casts the result into a first.
        let (dt, _) = common(&[opnd(c, "self")?, opnd(c, "other")?])?;
        let self_dt = c.args.tensor("self")?.dtype;
        if !can_cast(dt, self_dt) {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "result type {} can't be cast to the desired output type {}",
                    torch_name(dt),
                    torch_name(self_dt)
                ),
            );
        }
    }
    let kernel = if left { "lshift_cpu" } else { "rshift_cpu" };
    map_only(c, &["self", "other"], kernel, is_int, |b, v| {
        // Counts outside [0, bits) act as huge unsigned counts in StableHLO: 0 for left
        // shifts, the sign fill for right shifts, as in PyTorch.
        let name = if left {
            "stablehlo.shift_left"
        } else if b.dtype(v[0]).is_signed_int() {
            "stablehlo.shift_right_arithmetic"
        } else {
            "stablehlo.shift_right_logical"
        };
        b.binary(name, v[0], v[1])
    })
}

/// |x| for any number type (stablehlo.abs takes no unsigned integers).
fn abs_any(b: &mut Builder, x: Value) -> Value {
    if matches!(
        b.dtype(x),
        DType::U8 | DType::U32 | DType::U64 | DType::Bool
    ) {
        x
    } else {
        b.abs(x)
    }
}

/// Euclid's algorithm on |x|, |y|, element-wise, looping until every lane is done.
fn gcd_values(b: &mut Builder, x: Value, y: Value) -> Value {
    let a0 = abs_any(b, x);
    let b0 = abs_any(b, y);
    let out = b.while_loop(
        &[a0, b0],
        |b, s| {
            let nz = cmp_k(b, s[0], 0.0, CmpDir::Ne);
            any(b, nz)
        },
        |b, s| {
            let (a, r) = (s[0], s[1]);
            let z = cmp_k(b, a, 0.0, CmpDir::Eq);
            let safe = select_k(b, z, 1.0, a);
            let m = b.binary("stablehlo.remainder", r, safe);
            let na = select_k(b, z, 0.0, m);
            let nb = b.select(z, r, a);
            vec![na, nb]
        },
    );
    out[1]
}

fn gcd(c: &mut Ctx) -> LResult<Vec<Out>> {
    map_only(c, &["self", "other"], "gcd_cpu", is_int, |b, v| {
        gcd_values(b, v[0], v[1])
    })
}

fn lcm(c: &mut Ctx) -> LResult<Vec<Out>> {
    map_only(c, &["self", "other"], "lcm_cpu", is_int, |b, v| {
        let g = gcd_values(b, v[0], v[1]);
        let z = cmp_k(b, g, 0.0, CmpDir::Eq);
        let safe = select_k(b, z, 1.0, g);
        let q = b.div(v[0], safe);
        let p = b.mul(q, v[1]);
        let p = abs_any(b, p);
        select_k(b, z, 0.0, p)
    })
}

/// An integer constant of `like`'s type and shape (exact for 64-bit values).
fn int_full(b: &mut Builder, like: Value, v: i64) -> Value {
    let k = b.constant_i64(b.dtype(like), v);
    b.broadcast_in_dim(k, &b.shape(like), &[])
}

/// frexp: x = mantissa * 2^exponent with |mantissa| in [0.5, 1), from the bits of x
/// with integer ops only (float arithmetic may flush subnormals); zeros, infinities and
/// NaN give (x, 0).
fn frexp(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = c.t("self")?;
    let b = &mut *c.b;
    let dt = b.dtype(x);
    // (int type, width, fraction bits, exponent mask, bias of a [0.5, 1) mantissa)
    let (it, w, m, emask, bias): (DType, i64, i64, i64, i64) = match dt {
        DType::F16 => (DType::I16, 16, 10, 0x1f, 14),
        DType::BF16 => (DType::I16, 16, 7, 0xff, 126),
        DType::F32 => (DType::I32, 32, 23, 0xff, 126),
        DType::F64 => (DType::I64, 64, 52, 0x7ff, 1022),
        _ => {
            return user_err(
                ErrorKind::Runtime,
                "torch.frexp() only supports floating-point dtypes",
            )
        }
    };
    let bits = b.bitcast_convert(x, it);
    let k = |b: &mut Builder, v: i64| int_full(b, bits, v);
    let fmask = (1i64 << m) - 1;
    let sh = k(b, m);
    let e = b.binary("stablehlo.shift_right_logical", bits, sh);
    let em = k(b, emask);
    let e = b.and(e, em);
    let fm = k(b, fmask);
    let frac = b.and(bits, fm);
    let smask = k(b, i64::MIN >> (64 - w)); // the sign bit alone
    let sign = b.and(bits, smask);
    let base = k(b, bias << m);
    let head = b.or(sign, base);
    // Normal numbers: swap the exponent for the bias.
    let bv = k(b, bias);
    let ex_n = b.sub(e, bv);
    let mb_n = b.or(head, frac);
    // Subnormals: normalise the fraction by its leading zeros.
    let lz = b.unary("stablehlo.count_leading_zeros", frac);
    let top = k(b, w - 1);
    let p = b.sub(top, lz); // index of the top set bit
    let off = k(b, bias + m - 1);
    let ex_s = b.sub(p, off);
    let mv = k(b, m);
    let shl = b.sub(mv, p);
    let nf = b.binary("stablehlo.shift_left", frac, shl);
    let nf = b.and(nf, fm);
    let mb_s = b.or(head, nf);
    let e0 = cmp_k(b, e, 0.0, CmpDir::Eq);
    let ex = b.select(e0, ex_s, ex_n);
    let mb = b.select(e0, mb_s, mb_n);
    // Zeros, infinities and NaN keep x and a zero exponent.
    let f0 = cmp_k(b, frac, 0.0, CmpDir::Eq);
    let zero = b.and(e0, f0);
    let top_e = b.compare(e, em, CmpDir::Eq);
    let special = b.or(zero, top_e);
    let mb = b.select(special, bits, mb);
    let z = k(b, 0);
    let ex = b.select(special, z, ex);
    let mant = b.bitcast_convert(mb, dt);
    let ex = b.convert(ex, DType::I32);
    Ok(vec![Out::T(mant), Out::T(ex)])
}

/// angle of a real number: pi for negatives, 0 otherwise, NaN for NaN.
fn angle(b: &mut Builder, x: Value) -> Value {
    let neg = cmp_k(b, x, 0.0, CmpDir::Lt);
    let z = b.splat(x, 0.0);
    let r = select_k(b, neg, std::f64::consts::PI, z);
    let nan = is_nan(b, x);
    b.select(nan, x, r)
}

/// The regularized incomplete gamma functions P(a, x) (`upper` false) and Q(a, x): the
/// power series of P below x = a + 1, Legendre's continued fraction of Q (modified Lentz)
/// above, each lane iterating until its own term stops mattering.
fn igamma(b: &mut Builder, a: Value, x: Value, upper: bool) -> Value {
    const EPS: f64 = 1.2e-7;
    const TINY: f64 = 1e-30;
    const MAX_ITERS: f64 = 10000.0;
    // Domain and special values (PyTorch's order of checks).
    let nan_in = {
        let an = is_nan(b, a);
        let xn = is_nan(b, x);
        b.or(an, xn)
    };
    let neg = {
        let an = cmp_k(b, a, 0.0, CmpDir::Lt);
        let xn = cmp_k(b, x, 0.0, CmpDir::Lt);
        b.or(an, xn)
    };
    let a0 = cmp_k(b, a, 0.0, CmpDir::Eq);
    let x0 = cmp_k(b, x, 0.0, CmpDir::Eq);
    let ainf = cmp_k(b, a, f64::INFINITY, CmpDir::Eq);
    let xinf = cmp_k(b, x, f64::INFINITY, CmpDir::Eq);
    let special = {
        let t = b.or(nan_in, neg);
        let t = b.or(t, a0);
        let t = b.or(t, x0);
        let t = b.or(t, ainf);
        b.or(t, xinf)
    };
    // Safe operands for the lanes that iterate.
    let one = b.splat(a, 1.0);
    let a_ = b.select(special, one, a);
    let x_ = b.select(special, one, x);
    let ap1 = add_k(b, a_, 1.0);
    let series = b.compare(x_, ap1, CmpDir::Lt);
    // Series state: term, sum (P = pref * sum, sum starting at 1/a).
    let t0 = b.div(one, a_);
    // Lentz state for 1/(x+1-a- 1(1-a)/(x+3-a- 2(2-a)/...)): bb, C, D, h.
    let xma = b.sub(x_, a_);
    let b0 = add_k(b, xma, 1.0);
    let c0 = b.splat(a, 1.0 / TINY);
    let d0 = b.div(one, b0);
    let done0 = special;
    let i0 = b.constant(b.dtype(a), 0.0);
    let out = b.while_loop(
        &[i0, t0, t0, b0, c0, d0, d0, done0],
        |b, s| {
            let nd = b.not(s[7]);
            let go = any(b, nd);
            let lim = b.constant(b.dtype(s[0]), MAX_ITERS);
            let more = b.compare(s[0], lim, CmpDir::Lt);
            b.and(go, more)
        },
        |b, s| {
            let (i, term, sum, bb, c, d, h, done) =
                (s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]);
            let i1 = {
                let k = b.constant(b.dtype(i), 1.0);
                b.add(i, k)
            };
            let n = b.broadcast_in_dim(i1, &b.shape(term), &[]);
            // Series: term *= x / (a + n).
            let an = b.add(a_, n);
            let r = b.div(x_, an);
            let term1 = b.mul(term, r);
            let sum1 = b.add(sum, term1);
            let at = b.abs(term1);
            let asum = b.abs(sum1);
            let lim = scale(b, asum, EPS);
            let s_done = b.compare(at, lim, CmpDir::Lt);
            // Continued fraction: an = -n (n - a), bb += 2.
            let nma = b.sub(n, a_);
            let cn = b.mul(n, nma);
            let cn = b.neg(cn);
            let bb1 = add_k(b, bb, 2.0);
            let tiny = b.splat(bb, TINY);
            let d1 = b.mul(cn, d);
            let d1 = b.add(d1, bb1);
            let ad = b.abs(d1);
            let small = b.compare(ad, tiny, CmpDir::Lt);
            let d1 = b.select(small, tiny, d1);
            let q = b.div(cn, c);
            let c1 = b.add(bb1, q);
            let ac = b.abs(c1);
            let small = b.compare(ac, tiny, CmpDir::Lt);
            let c1 = b.select(small, tiny, c1);
            let one = b.splat(bb, 1.0);
            let d1 = b.div(one, d1);
            let del = b.mul(d1, c1);
            let h1 = b.mul(h, del);
            let dm1 = add_k(b, del, -1.0);
            let dm1 = b.abs(dm1);
            let c_done = cmp_k(b, dm1, EPS, CmpDir::Le);
            let fin = b.select(series, s_done, c_done);
            // Finished lanes keep their state.
            let keep = |b: &mut Builder, new: Value, old: Value| b.select(done, old, new);
            let term = keep(b, term1, term);
            let sum = keep(b, sum1, sum);
            let bb = keep(b, bb1, bb);
            let c = keep(b, c1, c);
            let d = keep(b, d1, d);
            let h = keep(b, h1, h);
            let done = b.or(done, fin);
            vec![i1, term, sum, bb, c, d, h, done]
        },
    );
    let (sum, h) = (out[2], out[6]);
    // pref = x^a e^-x / Gamma(a): directly for small a; for larger a through
    // a (log1p(t) - t) - stirlerr(a) + log(a / 2pi) / 2, t = (x - a) / a, which keeps
    // the cancelling a log x, x and lgamma(a) apart.
    let lx = b.log(x_);
    let alx = b.mul(a_, lx);
    let lg = b.unary("chlo.lgamma", a_);
    let direct = b.sub(alx, x_);
    let direct = b.sub(direct, lg);
    let amin = b.splat(a, 10.0);
    let al = b.max(a_, amin);
    let t = b.div(xma, al);
    let l1 = b.unary("stablehlo.log_plus_one", t);
    let l1 = b.sub(l1, t);
    let main = b.mul(al, l1);
    let ia = b.div(one, al);
    let ia2 = b.mul(ia, ia);
    let st = horner(
        b,
        ia2,
        &[1.0 / 12.0, -1.0 / 360.0, 1.0 / 1260.0, -1.0 / 1680.0],
    );
    let st = b.mul(st, ia);
    let main = b.sub(main, st);
    let la = scale(b, al, 1.0 / (2.0 * std::f64::consts::PI));
    let la = b.log(la);
    let la = scale(b, la, 0.5);
    let main = b.add(main, la);
    let big = cmp_k(b, a_, 10.0, CmpDir::Ge);
    let lp = b.select(big, main, direct);
    let pref = b.exp(lp);
    let p_series = b.mul(pref, sum);
    let q_cf = b.mul(pref, h);
    let (val, other) = if upper {
        (q_cf, p_series)
    } else {
        (p_series, q_cf)
    };
    let comp = b.sub(one, other);
    let direct_side = if upper { b.not(series) } else { series };
    let r = b.select(direct_side, val, comp);
    // Rounding can take 1 - P or 1 - Q a hair outside [0, 1].
    let z = b.splat(r, 0.0);
    let r = b.max(r, z);
    let r = b.min(r, one);
    // Special values.
    let (at_a0, at_x0, at_ainf, at_xinf) = if upper {
        (0.0, 1.0, 1.0, 0.0)
    } else {
        (1.0, 0.0, 0.0, 1.0)
    };
    let r = select_k(b, xinf, at_xinf, r);
    let r = select_k(b, ainf, at_ainf, r);
    let both = b.and(ainf, xinf);
    let r = select_k(b, both, f64::NAN, r);
    let r = select_k(b, x0, at_x0, r);
    let xpos = cmp_k(b, x, 0.0, CmpDir::Gt);
    let a0x = b.and(a0, xpos);
    let a0n = {
        let nx = b.not(xpos);
        b.and(a0, nx)
    };
    let r = select_k(b, a0x, at_a0, r);
    let r = select_k(b, a0n, f64::NAN, r);
    let bad = b.or(nan_in, neg);
    select_k(b, bad, f64::NAN, r)
}

/// The ops of this family whose programs may serve a range of sizes (see
/// `super::serves_sizes`).
pub const SERVES_SIZES: &[&str] = &["aten::isneginf"];

pub const RULES: &[(&str, Rule)] = &[
    ("aten::igamma", |c| {
        map_only(c, &["self", "other"], "igamma_cpu", is_float, |b, v| {
            wide2(b, v[0], v[1], |b, a, x| igamma(b, a, x, false))
        })
    }),
    ("aten::igammac", |c| {
        map_only(c, &["self", "other"], "igammac_cpu", is_float, |b, v| {
            wide2(b, v[0], v[1], |b, a, x| igamma(b, a, x, true))
        })
    }),
    ("aten::frexp", frexp),
    ("aten::angle", |c| float1(c, angle)),
    // Inverse trigonometric and hyperbolic functions.
    ("aten::asin", |c| float1(c, |b, x| b.unary("chlo.asin", x))),
    ("aten::acos", |c| float1(c, |b, x| b.unary("chlo.acos", x))),
    ("aten::atan", |c| float1(c, |b, x| b.unary("chlo.atan", x))),
    ("aten::sinh", |c| float1(c, |b, x| b.unary("chlo.sinh", x))),
    ("aten::cosh", |c| float1(c, |b, x| b.unary("chlo.cosh", x))),
    ("aten::asinh", |c| {
        float1(c, |b, x| b.unary("chlo.asinh", x))
    }),
    ("aten::acosh", |c| {
        float1(c, |b, x| b.unary("chlo.acosh", x))
    }),
    ("aten::atanh", |c| {
        float1(c, |b, x| b.unary("chlo.atanh", x))
    }),
    // Error function family and the normal distribution.
    ("aten::erfc", |c| float1(c, |b, x| b.unary("chlo.erfc", x))),
    ("aten::erfinv", |c| float1(c, erfinv)),
    ("aten::special_erfcx", |c| special1(c, erfcx)),
    ("aten::special_ndtri", |c| special1(c, ndtri)),
    ("aten::special_log_ndtr", |c| special1(c, log_ndtr)),
    // Gamma family.
    ("aten::lgamma", |c| float1(c, lgamma)),
    ("aten::mvlgamma", mvlgamma),
    ("aten::digamma", |c| float1(c, digamma)),
    ("aten::polygamma", polygamma),
    ("aten::special_zeta", |c| {
        map_special(c, &["self", "other"], |b, v| zeta(b, v[0], v[1]))
    }),
    // Modified Bessel functions.
    ("aten::i0", |c| float1(c, |b, x| bessel_i(b, x, 0, false))),
    ("aten::special_i0e", |c| {
        float1(c, |b, x| bessel_i(b, x, 0, true))
    }),
    ("aten::special_i1", |c| {
        float1(c, |b, x| bessel_i(b, x, 1, false))
    }),
    ("aten::special_i1e", |c| {
        float1(c, |b, x| bessel_i(b, x, 1, true))
    }),
    ("aten::special_modified_bessel_i0", |c| {
        special1(c, |b, x| bessel_i(b, x, 0, false))
    }),
    ("aten::special_modified_bessel_i1", |c| {
        special1(c, |b, x| bessel_i(b, x, 1, false))
    }),
    ("aten::special_bessel_j0", |c| {
        special1(c, |b, x| bessel_j(b, x, 0))
    }),
    ("aten::special_bessel_j1", |c| {
        special1(c, |b, x| bessel_j(b, x, 1))
    }),
    ("aten::special_bessel_y0", |c| {
        special1(c, |b, x| bessel_y(b, x, 0))
    }),
    ("aten::special_bessel_y1", |c| {
        special1(c, |b, x| bessel_y(b, x, 1))
    }),
    ("aten::special_modified_bessel_k0", |c| {
        special1(c, |b, x| bessel_k(b, x, 0, false))
    }),
    ("aten::special_modified_bessel_k1", |c| {
        special1(c, |b, x| bessel_k(b, x, 1, false))
    }),
    ("aten::special_scaled_modified_bessel_k0", |c| {
        special1(c, |b, x| bessel_k(b, x, 0, true))
    }),
    ("aten::special_scaled_modified_bessel_k1", |c| {
        special1(c, |b, x| bessel_k(b, x, 1, true))
    }),
    ("aten::special_airy_ai", |c| special1(c, airy_ai)),
    ("aten::special_spherical_bessel_j0", |c| {
        special1(c, spherical_j0)
    }),
    // Orthogonal polynomials.
    ("aten::special_chebyshev_polynomial_t", |c| {
        poly(c, Poly::Cheb(0, false))
    }),
    ("aten::special_chebyshev_polynomial_u", |c| {
        poly(c, Poly::Cheb(1, false))
    }),
    ("aten::special_chebyshev_polynomial_v", |c| {
        poly(c, Poly::Cheb(2, false))
    }),
    ("aten::special_chebyshev_polynomial_w", |c| {
        poly(c, Poly::Cheb(3, false))
    }),
    ("aten::special_shifted_chebyshev_polynomial_t", |c| {
        poly(c, Poly::Cheb(0, true))
    }),
    ("aten::special_shifted_chebyshev_polynomial_u", |c| {
        poly(c, Poly::Cheb(1, true))
    }),
    ("aten::special_shifted_chebyshev_polynomial_v", |c| {
        poly(c, Poly::Cheb(2, true))
    }),
    ("aten::special_shifted_chebyshev_polynomial_w", |c| {
        poly(c, Poly::Cheb(3, true))
    }),
    ("aten::special_hermite_polynomial_h", |c| poly(c, Poly::H)),
    ("aten::special_hermite_polynomial_he", |c| poly(c, Poly::He)),
    ("aten::special_laguerre_polynomial_l", |c| poly(c, Poly::L)),
    ("aten::special_legendre_polynomial_p", |c| poly(c, Poly::P)),
    // Elementary functions.
    ("aten::sinc", |c| float1(c, sinc)),
    ("aten::special_entr", |c| float1(c, entr)),
    ("aten::logit", logit),
    ("aten::logit_backward", logit_backward),
    ("aten::xlogy", |c| {
        map(c, &["self", "other"], to_float, |b, v| {
            wide2(b, v[0], v[1], |b, x, y| xlog(b, x, y, "stablehlo.log"))
        })
    }),
    ("aten::special_xlog1py", |c| {
        map(c, &["self", "other"], to_float, |b, v| {
            wide2(b, v[0], v[1], |b, x, y| {
                xlog(b, x, y, "stablehlo.log_plus_one")
            })
        })
    }),
    ("aten::hypot", |c| {
        map_only(c, &["self", "other"], "hypot_cpu", is_float, |b, v| {
            wide2(b, v[0], v[1], hypot)
        })
    }),
    ("aten::logaddexp", |c| {
        map_only(c, &["self", "other"], "logaddexp_cpu", is_float, |b, v| {
            wide2(b, v[0], v[1], |b, x, y| logaddexp(b, x, y, false))
        })
    }),
    ("aten::logaddexp2", |c| {
        map_only(c, &["self", "other"], "logaddexp2_cpu", is_float, |b, v| {
            wide2(b, v[0], v[1], |b, x, y| logaddexp(b, x, y, true))
        })
    }),
    ("aten::frac", |c| {
        map_only(c, &["self"], "frac_cpu", is_float, |b, v| {
            // fmod(x, 1) = x - trunc(x), NaN for infinities as in PyTorch.
            let one = b.splat(v[0], 1.0);
            b.binary("stablehlo.remainder", v[0], one)
        })
    }),
    // Float bit tricks and classification.
    ("aten::copysign", |c| {
        map(c, &["self", "other"], to_float, |b, v| {
            copysign(b, v[0], v[1])
        })
    }),
    ("aten::nextafter", |c| {
        map_only(c, &["self", "other"], "nextafter_cpu", is_float, |b, v| {
            b.binary("chlo.next_after", v[0], v[1])
        })
    }),
    ("aten::signbit", |c| {
        map(c, &["self"], same, |b, v| signbit(b, v[0]))
    }),
    ("aten::isposinf", |c| is_inf_dir(c, f64::INFINITY)),
    ("aten::isneginf", |c| is_inf_dir(c, f64::NEG_INFINITY)),
    ("aten::nan_to_num", nan_to_num),
    ("aten::fmax", |c| {
        map(c, &["self", "other"], same, |b, v| {
            fminmax(b, v[0], v[1], true)
        })
    }),
    ("aten::fmin", |c| {
        map(c, &["self", "other"], same, |b, v| {
            fminmax(b, v[0], v[1], false)
        })
    }),
    ("aten::heaviside", heaviside),
    // Integer ops.
    ("aten::bitwise_left_shift", |c| shift(c, true)),
    ("aten::bitwise_right_shift", |c| shift(c, false)),
    ("aten::__lshift__", |c| shift(c, true)),
    ("aten::__rshift__", |c| shift(c, false)),
    // `a <<= b`: in-place ops of their own name (the runtime writes into self).
    ("aten::__ilshift__", |c| shift(c, true)),
    ("aten::__irshift__", |c| shift(c, false)),
    ("aten::gcd", gcd),
    ("aten::lcm", lcm),
    // Activations.
];
