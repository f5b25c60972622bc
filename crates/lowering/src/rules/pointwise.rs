//! Pointwise rules: arithmetic, math functions, comparisons, activations and their backward.

use super::opmath;
use super::{
    common, mat, opnd, promote, same, scalar_value, sigmoid, sigmoid_grad, tanh_grad, Opnd,
};
use crate::promote::to_float;
use crate::{user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, Value};
use stablehlo::CmpDir;

type Un = fn(&mut Builder, Value) -> Value;

/// `f(self)` computed in floating point (ints promote to float32; half types compute in
/// f32 and round once, as PyTorch's CPU kernels do).
fn unary_float(c: &mut Ctx, f: Un) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["self"], to_float)?;
    let x = c.b.convert(v[0], opmath(dt));
    let r = f(c.b, x);
    Ok(vec![Out::T(c.b.convert(r, dt))])
}

/// `f(self)` in self's own dtype.
fn unary_same(c: &mut Ctx, f: Un) -> LResult<Vec<Out>> {
    let (v, _, _) = promote(c, &["self"], same)?;
    Ok(vec![Out::T(f(c.b, v[0]))])
}

/// `f(self, other)` in the promoted dtype, mapped by `compute`.
fn binary(
    c: &mut Ctx,
    compute: fn(DType) -> DType,
    f: fn(&mut Builder, Value, Value) -> Value,
) -> LResult<Vec<Out>> {
    let (v, _, _) = promote(c, &["self", "other"], compute)?;
    Ok(vec![Out::T(f(c.b, v[0], v[1]))])
}

fn cmp(c: &mut Ctx, dir: CmpDir) -> LResult<Vec<Out>> {
    let (v, _, _) = promote(c, &["self", "other"], same)?;
    Ok(vec![Out::T(c.b.compare(v[0], v[1], dir))])
}

/// `other * alpha` when an alpha is given.
fn scaled_other(c: &mut Ctx, v: Value) -> LResult<Value> {
    if matches!(c.args.opt_scalar("alpha"), Some(a) if a.as_f64() == 1.0) {
        return Ok(v);
    }
    match scalar_value(c, "alpha", v)? {
        Some((k, kind)) => {
            if !c.b.dtype(v).is_float() && matches!(kind, crate::args::Scalar::Float(_)) {
                return user_err(
                    ErrorKind::Runtime,
                    "For integral input tensors, argument alpha must not be a floating point number.",
                );
            }
            Ok(c.b.mul(v, k))
        }
        None => Ok(v),
    }
}

fn add(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["self", "other"], same)?;
    let o = scaled_other(c, v[1])?;
    let r = if dt == DType::Bool {
        c.b.or(v[0], o)
    } else {
        c.b.add(v[0], o)
    };
    Ok(vec![Out::T(r)])
}

fn sub(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["self", "other"], same)?;
    if dt == DType::Bool {
        return user_err(
            ErrorKind::Runtime,
            "Subtraction, the `-` operator, with two bool tensors is not supported. Use the `^` or `logical_xor()` operator instead.",
        );
    }
    let o = scaled_other(c, v[1])?;
    Ok(vec![Out::T(c.b.sub(v[0], o))])
}

fn rsub(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, _, _) = promote(c, &["self", "other"], same)?;
    let s = scaled_other(c, v[0])?;
    Ok(vec![Out::T(c.b.sub(v[1], s))])
}

fn mul(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["self", "other"], same)?;
    let r = if dt == DType::Bool {
        c.b.and(v[0], v[1])
    } else {
        c.b.mul(v[0], v[1])
    };
    Ok(vec![Out::T(r)])
}

/// Integer division rounding toward negative infinity.
fn int_floor_div(b: &mut Builder, x: Value, y: Value) -> Value {
    let q = b.div(x, y);
    let r = b.binary("stablehlo.remainder", x, y);
    let zero = b.splat(x, 0.0);
    let one = b.splat(x, 1.0);
    let r_nz = b.compare(r, zero, CmpDir::Ne);
    let xr = b.compare(r, zero, CmpDir::Lt);
    let yn = b.compare(y, zero, CmpDir::Lt);
    let diff = b.compare(xr, yn, CmpDir::Ne);
    let adj = b.and(r_nz, diff);
    let qm = b.sub(q, one);
    b.select(adj, qm, q)
}

fn div(c: &mut Ctx) -> LResult<Vec<Out>> {
    let mode = c.args.opt_str("rounding_mode").map(str::to_string);
    match mode.as_deref() {
        None => binary(c, to_float, |b, x, y| b.div(x, y)),
        Some("trunc") => {
            let (v, dt, _) = promote(c, &["self", "other"], same)?;
            let r = if dt.is_float() {
                let q = c.b.div(v[0], v[1]);
                trunc(c.b, q)
            } else {
                c.b.div(v[0], v[1])
            };
            Ok(vec![Out::T(r)])
        }
        Some("floor") => {
            let (v, dt, _) = promote(c, &["self", "other"], same)?;
            let r = if dt.is_float() {
                // The CPU's div_floor: Python's `//` from fmod (1.0 // 0.1 is 9, not
                // floor(1.0 / 0.1) = 10); half types in f32 (trunc mode truncates the
                // rounded quotient instead).
                let x = c.b.convert(v[0], opmath(dt));
                let y = c.b.convert(v[1], opmath(dt));
                let q = float_floor_div(c.b, x, y);
                c.b.convert(q, dt)
            } else {
                int_floor_div(c.b, v[0], v[1])
            };
            Ok(vec![Out::T(r)])
        }
        Some(m) => user_err(
            ErrorKind::Value,
            format!(
                "div expected rounding_mode to be one of None, 'trunc', or 'floor' but found '{m}'"
            ),
        ),
    }
}

fn trunc(b: &mut Builder, x: Value) -> Value {
    if !b.dtype(x).is_float() {
        return x;
    }
    let a = b.abs(x);
    let f = b.floor(a);
    let s = b.unary("stablehlo.sign", x);
    b.mul(s, f)
}

fn remainder(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["self", "other"], same)?;
    let (x, y) = (v[0], v[1]);
    let r = if dt.is_float() {
        // Python's modulo: the result has the divisor's sign.
        let r = c.b.binary("stablehlo.remainder", x, y);
        let zero = c.b.splat(r, 0.0);
        let nz = c.b.compare(r, zero, CmpDir::Ne);
        let rn = c.b.compare(r, zero, CmpDir::Lt);
        let yn = c.b.compare(y, zero, CmpDir::Lt);
        let diff = c.b.compare(rn, yn, CmpDir::Ne);
        let adj = c.b.and(nz, diff);
        let ry = c.b.add(r, y);
        c.b.select(adj, ry, r)
    } else {
        let q = int_floor_div(c.b, x, y);
        let qy = c.b.mul(q, y);
        c.b.sub(x, qy)
    };
    Ok(vec![Out::T(r)])
}

fn pow(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["self", "exponent"], same)?;
    if dt == DType::Bool {
        let r = c.b.or(v[0], v[0]);
        let ne = c.b.not(v[1]);
        return Ok(vec![Out::T(c.b.or(r, ne))]);
    }
    let p = c.b.binary("stablehlo.power", v[0], v[1]);
    if !dt.is_signed_int() {
        return Ok(vec![Out::T(p)]);
    }
    // A negative integer exponent: PyTorch gives 1 for base 1, ±1 by parity for base -1
    // and 0 otherwise; XLA:CPU's emitters disagree with each other there, so say it.
    let b = &mut *c.b;
    let (x, e) = (v[0], v[1]);
    let zero = b.splat(e, 0.0);
    let one = b.splat(x, 1.0);
    let minus_one = b.splat(x, -1.0);
    let two = b.splat(e, 2.0);
    let odd = b.binary("stablehlo.remainder", e, two);
    let odd = b.compare(odd, zero, CmpDir::Ne);
    let sign = b.select(odd, minus_one, one);
    let zero_x = b.splat(x, 0.0);
    let is_minus_one = b.compare(x, minus_one, CmpDir::Eq);
    let neg = b.select(is_minus_one, sign, zero_x);
    let is_one = b.compare(x, one, CmpDir::Eq);
    let neg = b.select(is_one, one, neg);
    let negative = b.compare(e, zero, CmpDir::Lt);
    Ok(vec![Out::T(b.select(negative, neg, p))])
}

fn erf(b: &mut Builder, x: Value) -> Value {
    b.unary("chlo.erf", x)
}

fn relu(b: &mut Builder, x: Value) -> Value {
    let z = b.splat(x, 0.0);
    b.max(x, z)
}

const SQRT1_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
const GELU_K: f64 = 0.797_884_560_802_865_4; // sqrt(2/pi)
const GELU_C: f64 = 0.044715;

fn gelu(c: &mut Ctx) -> LResult<Vec<Out>> {
    let approx = c.args.str_or("approximate", "none").to_string();
    let (v, dt, _) = promote(c, &["self"], to_float)?;
    let b = &mut *c.b;
    // In f32 for half types, rounding once.
    let x = b.convert(v[0], opmath(dt));
    let half = b.splat(x, 0.5);
    let one = b.splat(x, 1.0);
    let inner = if approx == "tanh" {
        let x3 = b.mul(x, x);
        let x3 = b.mul(x3, x);
        let cc = b.splat(x, GELU_C);
        let t = b.mul(cc, x3);
        let t = b.add(x, t);
        let k = b.splat(x, GELU_K);
        let t = b.mul(k, t);
        b.tanh(t)
    } else if approx == "none" {
        let k = b.splat(x, SQRT1_2);
        let t = b.mul(x, k);
        erf(b, t)
    } else {
        return user_err(
            ErrorKind::Runtime,
            "approximate argument must be either none or tanh.",
        );
    };
    let t = b.add(one, inner);
    let t = b.mul(x, t);
    let r = b.mul(half, t);
    Ok(vec![Out::T(b.convert(r, dt))])
}

fn gelu_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let approx = c.args.str_or("approximate", "none").to_string();
    let (v, dt, _) = promote(c, &["grad_output", "self"], to_float)?;
    let b = &mut *c.b;
    // In f32 for half types, rounding once.
    let g = b.convert(v[0], opmath(dt));
    let x = b.convert(v[1], opmath(dt));
    let half = b.splat(x, 0.5);
    let one = b.splat(x, 1.0);
    let d = if approx == "tanh" {
        let x2 = b.mul(x, x);
        let x3 = b.mul(x2, x);
        let cc = b.splat(x, GELU_C);
        let t = b.mul(cc, x3);
        let t = b.add(x, t);
        let k = b.splat(x, GELU_K);
        let inner = b.mul(k, t);
        let th = b.tanh(inner);
        let left = b.add(one, th);
        let left = b.mul(half, left);
        let th2 = b.mul(th, th);
        let sech2 = b.sub(one, th2);
        let c3 = b.splat(x, 3.0 * GELU_C);
        let dinner = b.mul(c3, x2);
        let dinner = b.add(one, dinner);
        let dinner = b.mul(k, dinner);
        let right = b.mul(sech2, dinner);
        let right = b.mul(x, right);
        let right = b.mul(half, right);
        b.add(left, right)
    } else {
        let k = b.splat(x, SQRT1_2);
        let t = b.mul(x, k);
        let e = erf(b, t);
        let cdf = b.add(one, e);
        let cdf = b.mul(half, cdf);
        let x2 = b.mul(x, x);
        let mh = b.splat(x, -0.5);
        let ex = b.mul(mh, x2);
        let pdf = b.exp(ex);
        let norm = b.splat(x, 0.398_942_280_401_432_7); // 1/sqrt(2*pi)
        let pdf = b.mul(pdf, norm);
        let xp = b.mul(x, pdf);
        b.add(cdf, xp)
    };
    let r = b.mul(g, d);
    Ok(vec![Out::T(b.convert(r, dt))])
}

fn silu(b: &mut Builder, x: Value) -> Value {
    let s = sigmoid(b, x);
    b.mul(x, s)
}

fn silu_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, _, _) = promote(c, &["grad_output", "self"], to_float)?;
    let b = &mut *c.b;
    let (g, x) = (v[0], v[1]);
    let s = sigmoid(b, x);
    let one = b.splat(x, 1.0);
    let oms = b.sub(one, s);
    let t = b.mul(x, oms);
    let t = b.add(one, t);
    let t = b.mul(s, t);
    Ok(vec![Out::T(b.mul(g, t))])
}

/// `grad * f(output)` for backward ops written in terms of the forward output.
fn out_backward(c: &mut Ctx, f: Un) -> LResult<Vec<Out>> {
    let (v, _, _) = promote(c, &["grad_output", "output"], same)?;
    let d = f(c.b, v[1]);
    // Complex gradients take the conjugate derivative (PyTorch's convention).
    let d = c.b.conj(d);
    Ok(vec![Out::T(c.b.mul(v[0], d))])
}

fn threshold_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let th = c.args.scalar("threshold")?.as_f64();
    let (v, _, _) = promote(c, &["grad_output", "self"], same)?;
    let t = c.b.splat(v[1], th);
    let le = c.b.compare(v[1], t, CmpDir::Le);
    let z = c.b.splat(v[0], 0.0);
    Ok(vec![Out::T(c.b.select(le, z, v[0]))])
}

fn threshold(c: &mut Ctx) -> LResult<Vec<Out>> {
    let th = c.args.scalar("threshold")?.as_f64();
    let val = c.args.scalar("value")?.as_f64();
    let (v, _, _) = promote(c, &["self"], same)?;
    let t = c.b.splat(v[0], th);
    let le = c.b.compare(v[0], t, CmpDir::Le);
    let r = c.b.splat(v[0], val);
    Ok(vec![Out::T(c.b.select(le, r, v[0]))])
}

/// clamp / clamp_min / clamp_max, with Scalar or Tensor bounds.
fn clamp(c: &mut Ctx) -> LResult<Vec<Out>> {
    let mut names = vec!["self"];
    let has_min = c.args.has("min");
    let has_max = c.args.has("max");
    if !has_min && !has_max {
        return user_err(
            ErrorKind::Runtime,
            "torch.clamp: At least one of 'min' or 'max' must not be None",
        );
    }
    if has_min {
        names.push("min");
    }
    if has_max {
        names.push("max");
    }
    let (v, _, _) = promote(c, &names, same)?;
    let mut r = v[0];
    let mut i = 1;
    if has_min {
        r = c.b.max(r, v[i]);
        i += 1;
    }
    if has_max {
        r = c.b.min(r, v[i]);
    }
    // max/min propagate NaN of the bound too; PyTorch keeps NaN only from self.
    Ok(vec![Out::T(r)])
}

fn where_(c: &mut Ctx) -> LResult<Vec<Out>> {
    let cond = opnd(c, "condition")?;
    let a = opnd(c, "self")?;
    let o = opnd(c, "other")?;
    let (dt, _) = common(&[a.clone(), o.clone()])?;
    let (_, shape) = common(&[cond.clone(), a.clone(), o.clone()])?;
    let p = mat(c.b, &cond, DType::Bool, &shape);
    let x = mat(c.b, &a, dt, &shape);
    let y = mat(c.b, &o, dt, &shape);
    Ok(vec![Out::T(c.b.select(p, x, y))])
}

fn logical(c: &mut Ctx, f: fn(&mut Builder, Value, Value) -> Value) -> LResult<Vec<Out>> {
    let a = opnd(c, "self")?;
    let o = opnd(c, "other")?;
    let (_, shape) = common(&[a.clone(), o.clone()])?;
    let x = mat(c.b, &a, DType::Bool, &shape);
    let y = mat(c.b, &o, DType::Bool, &shape);
    Ok(vec![Out::T(f(c.b, x, y))])
}

fn fill(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let v = match opnd(c, "value")? {
        Opnd::T(v) => {
            if !v.shape.is_empty() {
                return user_err(
                    ErrorKind::Runtime,
                    format!(
                        "fill_ only supports 0-dimension value tensor but got tensor with {} dimensions.",
                        v.shape.len()
                    ),
                );
            }
            let x = c.b.convert(v.value, t.dtype);
            c.b.broadcast_to(x, &t.shape)
        }
        Opnd::S(s) => super::full_scalar(c.b, t.dtype, &t.shape, s),
    };
    Ok(vec![Out::T(v)])
}

fn zero(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    Ok(vec![Out::T(c.b.full(t.dtype, &t.shape, 0.0))])
}

fn lerp(c: &mut Ctx) -> LResult<Vec<Out>> {
    // In f32 for half types (a number weight too), rounding once.
    let ops: Vec<Opnd> = ["self", "end", "weight"]
        .iter()
        .map(|n| opnd(c, n))
        .collect::<LResult<_>>()?;
    let (dt, shape) = common(&ops)?;
    let b = &mut *c.b;
    let v: Vec<Value> = ops.iter().map(|o| mat(b, o, opmath(dt), &shape)).collect();
    let (s, e, w) = (v[0], v[1], v[2]);
    // Two forms, as PyTorch, for accuracy near both ends.
    let d = b.sub(e, s);
    let wd = b.mul(w, d);
    let lo = b.add(s, wd);
    let one = b.splat(w, 1.0);
    let omw = b.sub(one, w);
    let t = b.mul(d, omw);
    let hi = b.sub(e, t);
    let aw = b.abs(w);
    let half = b.splat(aw, 0.5);
    let small = b.compare(aw, half, CmpDir::Lt);
    let r = b.select(small, lo, hi);
    Ok(vec![Out::T(b.convert(r, dt))])
}

fn addc(c: &mut Ctx, divide: bool) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["self", "tensor1", "tensor2"], same)?;
    // In f32 for half types (value too), rounding once.
    let v: Vec<Value> = v.iter().map(|x| c.b.convert(*x, opmath(dt))).collect();
    let t = if divide {
        c.b.div(v[1], v[2])
    } else {
        c.b.mul(v[1], v[2])
    };
    let t = match scalar_value(c, "value", t)? {
        Some((k, s)) if s.as_f64() != 1.0 => c.b.mul(k, t),
        _ => t,
    };
    let r = c.b.add(v[0], t);
    Ok(vec![Out::T(c.b.convert(r, dt))])
}

fn round(c: &mut Ctx) -> LResult<Vec<Out>> {
    let decimals = c.args.int_or("decimals", 0);
    let (v, dt, _) = promote(c, &["self"], same)?;
    if !dt.is_float() {
        return Ok(vec![Out::T(v[0])]);
    }
    let b = &mut *c.b;
    if decimals == 0 {
        return Ok(vec![Out::T(b.unary("stablehlo.round_nearest_even", v[0]))]);
    }
    let k = b.splat(v[0], 10f64.powi(decimals as i32));
    let t = b.mul(v[0], k);
    let t = b.unary("stablehlo.round_nearest_even", t);
    Ok(vec![Out::T(b.div(t, k))])
}

/// floor/ceil: identity on integers.
fn float_only(b: &mut Builder, x: Value, name: &str) -> Value {
    if b.dtype(x).is_float() {
        b.unary(name, x)
    } else {
        x
    }
}

fn sign(b: &mut Builder, x: Value) -> Value {
    match b.dtype(x) {
        DType::Bool => x,
        DType::U8 => {
            let z = b.splat(x, 0.0);
            let nz = b.compare(x, z, CmpDir::Ne);
            b.convert(nz, DType::U8)
        }
        _ => b.unary("stablehlo.sign", x),
    }
}

fn isnan(b: &mut Builder, x: Value) -> Value {
    if !b.dtype(x).is_float() {
        return b.full(DType::Bool, &b.shape(x), 0.0);
    }
    b.compare(x, x, CmpDir::Ne)
}

fn isfinite(b: &mut Builder, x: Value) -> Value {
    if !b.dtype(x).is_float() {
        return b.full(DType::Bool, &b.shape(x), 1.0);
    }
    b.is_finite(x)
}

fn isinf(b: &mut Builder, x: Value) -> Value {
    if !b.dtype(x).is_float() {
        return b.full(DType::Bool, &b.shape(x), 0.0);
    }
    let a = b.abs(x);
    let inf = b.splat(a, f64::INFINITY);
    b.compare(a, inf, CmpDir::Eq)
}

/// Python's floor division of floats: `(a - fmod(a, b)) / b`, one lower when the remainder
/// and `b` differ in sign, then floored (rounding up a fraction above one half); a zero
/// quotient keeps the sign of `a / b`, and `b == 0` gives IEEE `a / b`.
fn float_floor_div(b: &mut Builder, x: Value, y: Value) -> Value {
    let zero = b.splat(x, 0.0);
    let one = b.splat(x, 1.0);
    let half = b.splat(x, 0.5);
    let m = b.binary("stablehlo.remainder", x, y);
    let xm = b.sub(x, m);
    let d = b.div(xm, y);
    let m_nz = b.compare(m, zero, CmpDir::Ne);
    let m_neg = b.compare(m, zero, CmpDir::Lt);
    let y_neg = b.compare(y, zero, CmpDir::Lt);
    let differ = b.compare(m_neg, y_neg, CmpDir::Ne);
    let adj = b.and(m_nz, differ);
    let d1 = b.sub(d, one);
    let d = b.select(adj, d1, d);
    let f = b.floor(d);
    let frac = b.sub(d, f);
    let up = b.compare(frac, half, CmpDir::Gt);
    let f1 = b.add(f, one);
    let f = b.select(up, f1, f);
    let q = b.div(x, y);
    let signed_zero = b.mul(q, zero);
    let d_nz = b.compare(d, zero, CmpDir::Ne);
    let r = b.select(d_nz, f, signed_zero);
    let y_zero = b.compare(y, zero, CmpDir::Eq);
    b.select(y_zero, q, r)
}

/// `floor_divide`: Python's `//` (half types in f32, rounded once).
fn floor_divide(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["self", "other"], same)?;
    let r = match dt {
        DType::Bool => {
            return user_err(
                ErrorKind::NotImplemented,
                "\"div_floor_cpu\" not implemented for 'Bool'",
            )
        }
        d if d.is_float() => {
            let x = c.b.convert(v[0], opmath(d));
            let y = c.b.convert(v[1], opmath(d));
            let q = float_floor_div(c.b, x, y);
            c.b.convert(q, d)
        }
        _ => int_floor_div(c.b, v[0], v[1]),
    };
    Ok(vec![Out::T(r)])
}

/// `equal` as a 0-d bool: same shape and every element equal after type promotion. The
/// runtime reads it back (`aten::equal` returns a Python bool; see runtime/datadep.rs).
fn equal(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = c.args.tensor("self")?.clone();
    let o = c.args.tensor("other")?.clone();
    if a.shape != o.shape {
        return Ok(vec![Out::T(c.b.constant(DType::Bool, 0.0))]);
    }
    let dt = crate::promote::promote_types(a.dtype, o.dtype);
    let x = c.b.convert(a.value, dt);
    let y = c.b.convert(o.value, dt);
    let eq = c.b.compare(x, y, CmpDir::Eq);
    let dims: Vec<i64> = (0..a.shape.len() as i64).collect();
    let all = c.b.reduce(eq, &dims, stablehlo::ReduceKind::And);
    Ok(vec![Out::T(all)])
}

/// The ops of this family whose programs may serve a range of sizes (see
/// `super::serves_sizes`).
pub const SERVES_SIZES: &[&str] = &[
    "aten::add",
    "aten::sub",
    "aten::rsub",
    "aten::mul",
    "aten::div",
    "aten::neg",
    "aten::abs",
    "aten::pow",
    "aten::rsqrt",
    "aten::sqrt",
    "aten::exp",
    "aten::log",
    "aten::tanh",
    "aten::sigmoid",
    "aten::silu",
    "aten::gelu",
    "aten::relu",
    "aten::cos",
    "aten::sin",
    "aten::where",
    "aten::isinf",
    "aten::isnan",
    "aten::eq",
    "aten::ne",
    "aten::lt",
    "aten::le",
    "aten::gt",
    "aten::ge",
    "aten::logical_not",
    "aten::logical_and",
    "aten::logical_or",
    "aten::bitwise_not",
    "aten::clamp",
    "aten::minimum",
    "aten::maximum",
    "aten::gelu_backward",
    "aten::silu_backward",
    "aten::sigmoid_backward",
    "aten::tanh_backward",
    "aten::threshold_backward",
];

pub const RULES: &[(&str, Rule)] = &[
    ("aten::add", add),
    ("aten::sub", sub),
    ("aten::rsub", rsub),
    ("aten::mul", mul),
    ("aten::div", div),
    ("aten::remainder", remainder),
    ("aten::floor_divide", floor_divide),
    ("aten::equal", equal),
    ("torch_pjrt::equal", equal),
    ("aten::fmod", |c| {
        binary(c, same, |b, x, y| b.binary("stablehlo.remainder", x, y))
    }),
    ("aten::pow", pow),
    ("aten::maximum", |c| binary(c, same, |b, x, y| b.max(x, y))),
    ("aten::minimum", |c| binary(c, same, |b, x, y| b.min(x, y))),
    ("aten::atan2", |c| {
        binary(c, to_float, |b, x, y| b.binary("stablehlo.atan2", x, y))
    }),
    ("aten::eq", |c| cmp(c, CmpDir::Eq)),
    ("aten::ne", |c| cmp(c, CmpDir::Ne)),
    ("aten::lt", |c| cmp(c, CmpDir::Lt)),
    ("aten::le", |c| cmp(c, CmpDir::Le)),
    ("aten::gt", |c| cmp(c, CmpDir::Gt)),
    ("aten::ge", |c| cmp(c, CmpDir::Ge)),
    ("aten::logical_and", |c| logical(c, |b, x, y| b.and(x, y))),
    ("aten::logical_or", |c| logical(c, |b, x, y| b.or(x, y))),
    ("aten::logical_xor", |c| {
        logical(c, |b, x, y| b.binary("stablehlo.xor", x, y))
    }),
    ("aten::logical_not", |c| {
        let x = c.t("self")?;
        let p = c.b.convert(x, DType::Bool);
        Ok(vec![Out::T(c.b.not(p))])
    }),
    ("aten::bitwise_and", |c| {
        binary(c, same, |b, x, y| b.and(x, y))
    }),
    ("aten::bitwise_or", |c| {
        binary(c, same, |b, x, y| b.or(x, y))
    }),
    ("aten::bitwise_xor", |c| {
        binary(c, same, |b, x, y| b.binary("stablehlo.xor", x, y))
    }),
    ("aten::bitwise_not", |c| unary_same(c, |b, x| b.not(x))),
    ("aten::neg", |c| unary_same(c, |b, x| b.neg(x))),
    ("aten::abs", |c| {
        unary_same(c, |b, x| {
            if b.dtype(x) == DType::Bool {
                x
            } else {
                b.abs(x)
            }
        })
    }),
    ("aten::sign", |c| unary_same(c, sign)),
    ("aten::sgn", |c| unary_same(c, sign)),
    ("aten::exp", |c| unary_float(c, |b, x| b.exp(x))),
    ("aten::exp2", |c| {
        unary_float(c, |b, x| {
            let two = b.splat(x, 2.0);
            b.binary("stablehlo.power", two, x)
        })
    }),
    ("aten::expm1", |c| {
        unary_float(c, |b, x| b.unary("stablehlo.exponential_minus_one", x))
    }),
    ("aten::log", |c| unary_float(c, |b, x| b.log(x))),
    ("aten::log1p", |c| {
        unary_float(c, |b, x| b.unary("stablehlo.log_plus_one", x))
    }),
    ("aten::log2", |c| {
        unary_float(c, |b, x| {
            let l = b.log(x);
            let k = b.splat(x, std::f64::consts::LOG2_E);
            b.mul(l, k)
        })
    }),
    ("aten::log10", |c| {
        unary_float(c, |b, x| {
            let l = b.log(x);
            let k = b.splat(x, std::f64::consts::LOG10_E);
            b.mul(l, k)
        })
    }),
    ("aten::sqrt", |c| unary_float(c, |b, x| b.sqrt(x))),
    ("aten::rsqrt", |c| unary_float(c, |b, x| b.rsqrt(x))),
    ("aten::reciprocal", |c| {
        unary_float(c, |b, x| {
            let one = b.splat(x, 1.0);
            b.div(one, x)
        })
    }),
    ("aten::sin", |c| {
        unary_float(c, |b, x| b.unary("stablehlo.sine", x))
    }),
    ("aten::cos", |c| {
        unary_float(c, |b, x| b.unary("stablehlo.cosine", x))
    }),
    ("aten::tan", |c| {
        unary_float(c, |b, x| b.unary("stablehlo.tan", x))
    }),
    ("aten::tanh", |c| unary_float(c, |b, x| b.tanh(x))),
    ("aten::sigmoid", |c| unary_float(c, sigmoid)),
    ("aten::erf", |c| unary_float(c, erf)),
    ("aten::relu", |c| unary_same(c, relu)),
    ("aten::silu", |c| unary_float(c, silu)),
    ("aten::gelu", gelu),
    ("aten::gelu_backward", gelu_backward),
    ("aten::silu_backward", silu_backward),
    ("aten::sigmoid_backward", |c| out_backward(c, sigmoid_grad)),
    ("aten::tanh_backward", |c| out_backward(c, tanh_grad)),
    ("aten::threshold", threshold),
    ("aten::threshold_backward", threshold_backward),
    ("aten::clamp", clamp),
    ("aten::clamp_min", clamp),
    ("aten::clamp_max", clamp),
    ("aten::where", where_),
    ("aten::fill", fill),
    ("aten::fill_", fill),
    ("aten::zero", zero),
    ("aten::zero_", zero),
    ("aten::lerp", lerp),
    ("aten::addcmul", |c| addc(c, false)),
    ("aten::addcdiv", |c| addc(c, true)),
    ("aten::floor", |c| {
        unary_same(c, |b, x| float_only(b, x, "stablehlo.floor"))
    }),
    ("aten::ceil", |c| {
        unary_same(c, |b, x| float_only(b, x, "stablehlo.ceil"))
    }),
    ("aten::trunc", |c| unary_same(c, trunc)),
    ("aten::round", round),
    ("aten::isnan", |c| unary_same(c, isnan)),
    ("aten::isinf", |c| unary_same(c, isinf)),
    ("aten::isfinite", |c| unary_same(c, isfinite)),
];
