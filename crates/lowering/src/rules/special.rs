//! Special functions and the rest of the pointwise family: inverse trigonometric and
//! hyperbolic functions, the gamma family, modified Bessel functions, erfcx/ndtr family,
//! logit/xlogy, float bit tricks (signbit, copysign, nextafter), integer shifts and
//! gcd/lcm, shrinkage activations, glu and prelu (with their backward ops).

use super::{promote, same};
use crate::promote::{to_float, torch_name};
use crate::shape::wrap_dim;
use crate::{user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, Value};
use stablehlo::{CmpDir, ReduceKind};

type Un = fn(&mut Builder, Value) -> Value;

/// `f(values)` over the named operands, promoted together and mapped by `compute`.
fn map(
    c: &mut Ctx,
    names: &[&str],
    compute: fn(DType) -> DType,
    f: impl FnOnce(&mut Builder, &[Value]) -> Value,
) -> LResult<Vec<Out>> {
    let (v, _, _) = promote(c, names, compute)?;
    Ok(vec![Out::T(f(c.b, &v))])
}

/// PyTorch's error for a kernel without an implementation for `dt`.
fn unsupported<T>(kernel: &str, dt: DType) -> LResult<T> {
    user_err(
        ErrorKind::NotImplemented,
        format!("\"{kernel}\" not implemented for '{}'", torch_name(dt)),
    )
}

/// Like `map`, for kernels PyTorch only has for `ok` dtypes (floating, or integral).
fn map_only(
    c: &mut Ctx,
    names: &[&str],
    kernel: &str,
    ok: fn(DType) -> bool,
    f: impl FnOnce(&mut Builder, &[Value]) -> Value,
) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, names, same)?;
    if !ok(dt) {
        return unsupported(kernel, dt);
    }
    Ok(vec![Out::T(f(c.b, &v))])
}

fn is_float(d: DType) -> bool {
    d.is_float()
}

fn is_int(d: DType) -> bool {
    d.is_int()
}

/// A unary function of floats (ints and bools promote to float32).
fn float1(c: &mut Ctx, f: Un) -> LResult<Vec<Out>> {
    map(c, &["self"], to_float, |b, v| f(b, v[0]))
}

/// A unary function evaluated in float32 for half-precision inputs (as PyTorch's kernels).
fn float1_wide(c: &mut Ctx, f: Un) -> LResult<Vec<Out>> {
    map(c, &["self"], to_float, |b, v| wide(b, v[0], f))
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

// ---------------------------------------------------------------------------
// Small building blocks
// ---------------------------------------------------------------------------

fn isnan(b: &mut Builder, x: Value) -> Value {
    b.compare(x, x, CmpDir::Ne)
}

fn cmp_k(b: &mut Builder, x: Value, k: f64, dir: CmpDir) -> Value {
    let kv = b.splat(x, k);
    b.compare(x, kv, dir)
}

/// `p ? k : x` for a constant `k`.
fn select_k(b: &mut Builder, p: Value, k: f64, x: Value) -> Value {
    let kv = b.splat(x, k);
    b.select(p, kv, x)
}

fn add_k(b: &mut Builder, x: Value, k: f64) -> Value {
    let kv = b.splat(x, k);
    b.add(x, kv)
}

fn mul_k(b: &mut Builder, x: Value, k: f64) -> Value {
    let kv = b.splat(x, k);
    b.mul(x, kv)
}

/// `sum(coeffs[i] * z^i)` by Horner's rule.
fn horner(b: &mut Builder, z: Value, coeffs: &[f64]) -> Value {
    let mut acc = b.splat(z, coeffs[coeffs.len() - 1]);
    for c in coeffs.iter().rev().skip(1) {
        acc = b.mul(acc, z);
        acc = add_k(b, acc, *c);
    }
    acc
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

/// The largest finite value of a float dtype.
fn float_max(d: DType) -> f64 {
    match d {
        DType::F16 => 65504.0,
        DType::BF16 => 3.389_531_389_251_535_5e38,
        DType::F32 => f32::MAX as f64,
        _ => f64::MAX,
    }
}

// ---------------------------------------------------------------------------
// Gamma family
// ---------------------------------------------------------------------------

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

fn polygamma(c: &mut Ctx) -> LResult<Vec<Out>> {
    let n = c.args.int("n")?;
    if n < 0 {
        return user_err(
            ErrorKind::Runtime,
            "polygamma(n, x) does not support negative n.",
        );
    }
    map(c, &["self"], to_float, |b, v| {
        wide(b, v[0], |b, x| {
            if n == 0 {
                digamma(b, x)
            } else {
                let nv = b.splat(x, n as f64);
                b.binary("chlo.polygamma", nv, x)
            }
        })
    })
}

// ---------------------------------------------------------------------------
// Modified Bessel functions of the first kind (orders 0 and 1)
// ---------------------------------------------------------------------------

/// Below this |x| the power series is used, above it the asymptotic expansion.
const BESSEL_SPLIT: f64 = 8.0;

/// I_nu(x) for nu in {0, 1}; with `scaled`, exp(-|x|) * I_nu(x).
fn bessel_i(b: &mut Builder, x: Value, nu: u32, scaled: bool) -> Value {
    let ax = b.abs(x);
    // Power series in y = x^2/4: sum y^k / (k! (k+nu)!), times (|x|/2)^nu.
    let mut series = Vec::new();
    let mut t = 1.0;
    for k in 0..20u32 {
        if k > 0 {
            t /= (k * (k + nu)) as f64;
        }
        series.push(t);
    }
    let y = b.mul(ax, ax);
    let y = mul_k(b, y, 0.25);
    let mut small = horner(b, y, &series);
    if nu == 1 {
        let h = mul_k(b, ax, 0.5);
        small = b.mul(small, h);
    }
    // Asymptotic expansion: exp(-x) I_nu(x) ~ sum a_k / x^k / sqrt(2 pi x).
    let mu = (4 * nu * nu) as f64;
    let mut asym = vec![1.0];
    for k in 1..12u32 {
        let prev = asym[k as usize - 1];
        let odd = (2 * k - 1) as f64;
        asym.push(-prev * (mu - odd * odd) / (8.0 * k as f64));
    }
    let big = b.splat(ax, BESSEL_SPLIT);
    let axl = b.max(ax, big); // NaN stays NaN
    let one = b.splat(ax, 1.0);
    let z = b.div(one, axl);
    let s = horner(b, z, &asym);
    let r = mul_k(b, axl, 2.0 * std::f64::consts::PI);
    let r = b.rsqrt(r);
    let large_e = b.mul(s, r);
    let use_small = cmp_k(b, ax, BESSEL_SPLIT, CmpDir::Le);
    let out = if scaled {
        let nax = b.neg(ax);
        let e = b.exp(nax);
        let small_e = b.mul(small, e);
        b.select(use_small, small_e, large_e)
    } else {
        // exp(|x|/2) twice: I_nu stays finite a little beyond where exp(|x|) overflows.
        let h = mul_k(b, axl, 0.5);
        let e = b.exp(h);
        let l = b.mul(large_e, e);
        let l = b.mul(l, e);
        let inf = cmp_k(b, axl, f64::INFINITY, CmpDir::Eq);
        let l = select_k(b, inf, f64::INFINITY, l);
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

// ---------------------------------------------------------------------------
// erfcx, normal distribution
// ---------------------------------------------------------------------------

const FRAC_1_SQRT_PI: f64 = 0.564_189_583_547_756_3;
/// Above this, erfcx uses its asymptotic expansion (exp(x^2) erfc(x) loses range there).
const ERFCX_SPLIT: f64 = 5.0;

/// erfcx(x) = exp(x^2) erfc(x), for x >= 0 (and NaN).
fn erfcx_pos(b: &mut Builder, ax: Value) -> Value {
    let x2 = b.mul(ax, ax);
    let ex = b.exp(x2);
    let ec = b.unary("chlo.erfc", ax);
    let small = b.mul(ex, ec);
    // 1/(x sqrt(pi)) * sum (-1)^k (2k-1)!! / (2x^2)^k
    let mut coeffs = vec![1.0];
    for k in 1..12 {
        let prev: f64 = coeffs[k - 1];
        coeffs.push(-prev * (2 * k - 1) as f64);
    }
    let split = b.splat(ax, ERFCX_SPLIT);
    let axl = b.max(ax, split);
    let w = b.mul(axl, axl);
    let w = mul_k(b, w, 2.0);
    let one = b.splat(ax, 1.0);
    let w = b.div(one, w);
    let s = horner(b, w, &coeffs);
    let k = mul_k(b, axl, 1.0 / FRAC_1_SQRT_PI);
    let large = b.div(s, k);
    let use_small = cmp_k(b, ax, ERFCX_SPLIT, CmpDir::Lt);
    b.select(use_small, small, large)
}

fn erfcx(b: &mut Builder, x: Value) -> Value {
    let ax = b.abs(x);
    let pos = erfcx_pos(b, ax);
    // erfcx(-x) = 2 exp(x^2) - erfcx(x)
    let x2 = b.mul(x, x);
    let e = b.exp(x2);
    let e2 = mul_k(b, e, 2.0);
    let negv = b.sub(e2, pos);
    let nonneg = cmp_k(b, x, 0.0, CmpDir::Ge);
    let nan = isnan(b, x);
    let keep = b.or(nonneg, nan);
    b.select(keep, pos, negv)
}

fn log_ndtr(b: &mut Builder, x: Value) -> Value {
    let t = mul_k(b, x, std::f64::consts::FRAC_1_SQRT_2);
    // Far left tail: log(erfcx(-t) / 2) - t^2.
    let nt = b.neg(t);
    let ex = erfcx(b, nt);
    let ex = mul_k(b, ex, 0.5);
    let l = b.log(ex);
    let t2 = b.mul(t, t);
    let tail = b.sub(l, t2);
    // Elsewhere: log1p(-erfc(t) / 2).
    let ec = b.unary("chlo.erfc", t);
    let ec = mul_k(b, ec, -0.5);
    let body = b.unary("stablehlo.log_plus_one", ec);
    let left = cmp_k(b, x, -1.0, CmpDir::Lt);
    b.select(left, tail, body)
}

fn ndtri(b: &mut Builder, p: Value) -> Value {
    let y = mul_k(b, p, 2.0);
    let y = add_k(b, y, -1.0);
    let e = b.unary("chlo.erf_inv", y);
    mul_k(b, e, std::f64::consts::SQRT_2)
}

// ---------------------------------------------------------------------------
// Elementary functions
// ---------------------------------------------------------------------------

fn sinc(b: &mut Builder, x: Value) -> Value {
    let px = mul_k(b, x, std::f64::consts::PI);
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
    let nan = isnan(b, y);
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
        let e = mul_k(b, nd, std::f64::consts::LN_2);
        let e = b.exp(e);
        let l = b.unary("stablehlo.log_plus_one", e);
        let l = mul_k(b, l, std::f64::consts::LOG2_E);
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
    let xn = isnan(b, x);
    let yn = isnan(b, y);
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
        let n = isnan(b, x);
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
        let mut x = v[0];
        if let Some(e) = eps {
            let lo = b.splat(x, e);
            let hi = b.splat(x, 1.0 - e);
            // clamp, keeping NaN (min/max would too, but clamp states the intent).
            x = b.clamp(lo, x, hi);
        }
        let one = b.splat(x, 1.0);
        let d = b.sub(one, x);
        let q = b.div(x, d);
        b.log(q)
    })
}

fn logit_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let eps = c.args.opt_float("eps").filter(|e| *e >= 0.0);
    map(c, &["grad_output", "self"], to_float, |b, v| {
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
    })
}

// ---------------------------------------------------------------------------
// Integer ops: shifts, gcd, lcm
// ---------------------------------------------------------------------------

fn shift(c: &mut Ctx, left: bool) -> LResult<Vec<Out>> {
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

/// Euclid's algorithm on |x|, |y|, element-wise, looping until every lane is done.
fn gcd_values(b: &mut Builder, x: Value, y: Value) -> Value {
    let a0 = b.abs(x);
    let b0 = b.abs(y);
    let out = b.while_loop(
        &[a0, b0],
        |b, s| {
            let nz = cmp_k(b, s[0], 0.0, CmpDir::Ne);
            let rank = b.rank(nz) as i64;
            b.reduce(nz, &(0..rank).collect::<Vec<_>>(), ReduceKind::Or)
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
        let p = b.abs(p);
        select_k(b, z, 0.0, p)
    })
}

// ---------------------------------------------------------------------------
// Activations
// ---------------------------------------------------------------------------

/// C++ stream formatting of a double (6 significant digits), for error messages.
fn cpp_num(v: f64) -> String {
    if v == v.trunc() && v.abs() < 1e6 {
        return format!("{}", v as i64);
    }
    let e = v.abs().log10().floor() as i32;
    if (-5..6).contains(&e) {
        let s = format!("{:.*}", (5 - e).max(0) as usize, v);
        let s = s.trim_end_matches('0').trim_end_matches('.');
        s.to_string()
    } else {
        let m = v / 10f64.powi(e);
        let s = format!("{m:.5}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        format!("{s}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs())
    }
}

fn softshrink(c: &mut Ctx) -> LResult<Vec<Out>> {
    let l = c.args.opt_scalar("lambd").map_or(0.5, |s| s.as_f64());
    let dt = c.args.tensor("self")?.dtype;
    if l < 0.0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "lambda must be in range [0, {}] for input dtype {}, but found {}",
                cpp_num(float_max(dt)),
                torch_name(dt),
                cpp_num(l)
            ),
        );
    }
    map(c, &["self"], same, |b, v| {
        let x = v[0];
        let hi = cmp_k(b, x, l, CmpDir::Gt);
        let lo = cmp_k(b, x, -l, CmpDir::Lt);
        let xm = add_k(b, x, -l);
        let xp = add_k(b, x, l);
        let z = mul_k(b, x, 0.0); // NaN stays NaN, signs of zero as PyTorch
        let r = b.select(lo, xp, z);
        b.select(hi, xm, r)
    })
}

fn hardshrink(c: &mut Ctx) -> LResult<Vec<Out>> {
    let l = c.args.opt_scalar("lambd").map_or(0.5, |s| s.as_f64());
    map(c, &["self"], same, |b, v| {
        let inside = inside(b, v[0], l);
        select_k(b, inside, 0.0, v[0])
    })
}

/// -l <= x <= l (false for NaN).
fn inside(b: &mut Builder, x: Value, l: f64) -> Value {
    let ge = cmp_k(b, x, -l, CmpDir::Ge);
    let le = cmp_k(b, x, l, CmpDir::Le);
    b.and(ge, le)
}

/// softshrink_backward / hardshrink_backward: the gradient passes outside [-l, l].
fn shrink_backward(c: &mut Ctx, grad: &'static str) -> LResult<Vec<Out>> {
    let l = c.args.scalar("lambd")?.as_f64();
    map(c, &[grad, "self"], same, |b, v| {
        let inside = inside(b, v[1], l);
        select_k(b, inside, 0.0, v[0])
    })
}

/// The two halves of `x` along `dim` (glu's split), with PyTorch's checks.
fn glu_halves(b: &mut Builder, x: Value, dim: i64) -> LResult<(Value, Value, usize)> {
    let shape = b.shape(x);
    if shape.is_empty() {
        return user_err(
            ErrorKind::Runtime,
            "glu does not support scalars because halving size must be even",
        );
    }
    let d = wrap_dim(dim, shape.len())?;
    if shape[d] % 2 != 0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Halving dimension must be even, but dimension {d} is size {}",
                shape[d]
            ),
        );
    }
    let h = shape[d] / 2;
    let a = b.slice_dim(x, d, 0, h, 1);
    let s = b.slice_dim(x, d, h, shape[d], 1);
    Ok((a, s, d))
}

fn glu(c: &mut Ctx) -> LResult<Vec<Out>> {
    let dim = c.args.int_or("dim", -1);
    let x = c.t("self")?;
    let (a, s, _) = glu_halves(c.b, x, dim)?;
    let sg = c.b.unary("stablehlo.logistic", s);
    Ok(vec![Out::T(c.b.mul(a, sg))])
}

fn glu_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let dim = c.args.int("dim")?;
    let g = c.t("grad_output")?;
    let x = c.t("self")?;
    let b = &mut *c.b;
    let (a, s, d) = glu_halves(b, x, dim)?;
    let sg = b.unary("stablehlo.logistic", s);
    let ga = b.mul(g, sg);
    let one = b.splat(sg, 1.0);
    let oms = b.sub(one, sg);
    let ds = b.mul(sg, oms);
    let ds = b.mul(ds, a);
    let gs = b.mul(g, ds);
    Ok(vec![Out::T(b.concatenate(&[ga, gs], d))])
}

fn prelu(c: &mut Ctx) -> LResult<Vec<Out>> {
    map(c, &["self", "weight"], same, |b, v| {
        let (x, w) = (v[0], v[1]);
        let pos = cmp_k(b, x, 0.0, CmpDir::Gt);
        let wx = b.mul(w, x);
        b.select(pos, x, wx)
    })
}

fn prelu_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, _, _) = promote(c, &["grad_output", "self", "weight"], same)?;
    let b = &mut *c.b;
    let (g, x, w) = (v[0], v[1], v[2]);
    let pos = cmp_k(b, x, 0.0, CmpDir::Gt);
    let wg = b.mul(w, g);
    let gx = b.select(pos, g, wg);
    let xg = b.mul(x, g);
    let zero = b.splat(xg, 0.0);
    let gw = b.select(pos, zero, xg);
    Ok(vec![Out::T(gx), Out::T(gw)])
}

pub const RULES: &[(&str, Rule)] = &[
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
    ("aten::erfinv", |c| {
        float1(c, |b, x| b.unary("chlo.erf_inv", x))
    }),
    ("aten::special_erfcx", |c| float1_wide(c, erfcx)),
    ("aten::special_ndtri", |c| float1_wide(c, ndtri)),
    ("aten::special_log_ndtr", |c| float1_wide(c, log_ndtr)),
    // Gamma family.
    ("aten::lgamma", |c| {
        float1(c, |b, x| b.unary("chlo.lgamma", x))
    }),
    ("aten::digamma", |c| float1_wide(c, digamma)),
    ("aten::polygamma", polygamma),
    ("aten::special_zeta", |c| {
        map(c, &["self", "other"], to_float, |b, v| {
            b.binary("chlo.zeta", v[0], v[1])
        })
    }),
    // Modified Bessel functions.
    ("aten::i0", |c| {
        float1_wide(c, |b, x| bessel_i(b, x, 0, false))
    }),
    ("aten::special_i0e", |c| {
        float1_wide(c, |b, x| bessel_i(b, x, 0, true))
    }),
    ("aten::special_i1", |c| {
        float1_wide(c, |b, x| bessel_i(b, x, 1, false))
    }),
    ("aten::special_i1e", |c| {
        float1_wide(c, |b, x| bessel_i(b, x, 1, true))
    }),
    ("aten::special_modified_bessel_i0", |c| {
        float1_wide(c, |b, x| bessel_i(b, x, 0, false))
    }),
    ("aten::special_modified_bessel_i1", |c| {
        float1_wide(c, |b, x| bessel_i(b, x, 1, false))
    }),
    // Elementary functions.
    ("aten::sinc", |c| float1(c, sinc)),
    ("aten::special_entr", |c| float1(c, entr)),
    ("aten::logit", logit),
    ("aten::logit_backward", logit_backward),
    ("aten::xlogy", |c| {
        map(c, &["self", "other"], to_float, |b, v| {
            xlog(b, v[0], v[1], "stablehlo.log")
        })
    }),
    ("aten::special_xlog1py", |c| {
        map(c, &["self", "other"], to_float, |b, v| {
            xlog(b, v[0], v[1], "stablehlo.log_plus_one")
        })
    }),
    ("aten::hypot", |c| {
        map_only(c, &["self", "other"], "hypot_cpu", is_float, |b, v| {
            hypot(b, v[0], v[1])
        })
    }),
    ("aten::logaddexp", |c| {
        map_only(c, &["self", "other"], "logaddexp_cpu", is_float, |b, v| {
            logaddexp(b, v[0], v[1], false)
        })
    }),
    ("aten::logaddexp2", |c| {
        map_only(c, &["self", "other"], "logaddexp2_cpu", is_float, |b, v| {
            logaddexp(b, v[0], v[1], true)
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
    ("aten::gcd", gcd),
    ("aten::lcm", lcm),
    // Activations.
    ("aten::softshrink", softshrink),
    ("aten::softshrink_backward", |c| {
        shrink_backward(c, "grad_output")
    }),
    ("aten::hardshrink", hardshrink),
    ("aten::hardshrink_backward", |c| {
        shrink_backward(c, "grad_out")
    }),
    ("aten::glu", glu),
    ("aten::glu_backward", glu_backward),
    ("aten::_prelu_kernel", prelu),
    ("aten::_prelu_kernel_backward", prelu_backward),
];
