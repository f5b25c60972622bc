//! Random sampling, and dropout.
//!
//! Bits come from XLA's counter-based ThreeFry (`stablehlo.rng_bit_generator`) keyed by the
//! generator's seed; the counter starts at the generator's offset. Each draw inside one op
//! takes the next counter range (`c.rng_consumed` counts the words handed out), and the
//! runtime advances the generator's offset by that count after the op, so draws never
//! reuse a counter and `manual_seed` replays them exactly. ThreeFry uses at most one
//! counter per returned word (u32 or u64), so counting words is a safe upper bound.

use super::nn_common::{float_input, tensor};
use super::{float_max, opmath};
use crate::args::Arg;
use crate::promote::cpp_name;
use crate::promote::torch_name;
use crate::shape::broadcast_shapes;
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorType, Value,
};
use stablehlo::{CmpDir, ReduceKind};

fn numel(shape: &[i64]) -> i64 {
    shape.iter().product()
}

/// `shape` random words of `dtype` (U32 or U64) from counters no other draw of this op uses.
fn bits(c: &mut Ctx, shape: &[i64], dtype: DType) -> Value {
    let n = numel(shape);
    if n == 0 {
        return c.b.full(dtype, shape, 0.0);
    }
    let state = c.rng();
    let start = c.rng_consumed;
    c.rng_consumed += n as u64;
    let skip = c.b.constant_vec_i64(&[0, start as i64]);
    // i64 addition wraps like the u64 counter it stands for.
    let s = c.b.add(state, skip);
    let s = c.b.bitcast_convert(s, DType::U64);
    c.b.rng_bits(s, shape, dtype).1
}

fn shift_right(b: &mut Builder, x: Value, n: u32) -> Value {
    let k = b.splat(x, n as f64);
    b.binary("stablehlo.shift_right_logical", x, k)
}

/// Uniform samples in [0, 1) of `dtype`, using as many random bits as the dtype resolves.
/// Half types are sampled in float32 and truncated (never rounded up to 1.0).
pub fn uniform(c: &mut Ctx, shape: &[i64], dtype: DType) -> Value {
    if dtype == DType::F64 {
        let w = bits(c, shape, DType::U64);
        let w = shift_right(c.b, w, 11);
        let f = c.b.convert(w, DType::F64);
        let k = c.b.splat(f, 2f64.powi(-53));
        return c.b.mul(f, k);
    }
    let w = bits(c, shape, DType::U32);
    let w = shift_right(c.b, w, 8);
    let f = c.b.convert(w, DType::F32);
    let k = c.b.splat(f, 2f64.powi(-24));
    let u = c.b.mul(f, k);
    let drop = match dtype {
        DType::BF16 => 16,
        DType::F16 => 13,
        _ => 0,
    };
    let u = if drop > 0 {
        let ib = c.b.bitcast_convert(u, DType::U32);
        let mask = c.b.splat(ib, (u32::MAX << drop) as f64);
        let ib = c.b.and(ib, mask);
        c.b.bitcast_convert(ib, DType::F32)
    } else {
        u
    };
    c.b.convert(u, dtype)
}

/// The dtype transforms of uniform samples run in: float32, or float64 for float64.
fn compute_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Uniform samples in (0, 1] of the compute dtype (safe to take the log of).
fn uniform_open0(c: &mut Ctx, shape: &[i64], dtype: DType) -> Value {
    let cdt = compute_dtype(dtype);
    let u = uniform(c, shape, cdt);
    let one = c.b.splat(u, 1.0);
    c.b.sub(one, u)
}

/// Standard normal samples of `dtype` (Box-Muller; both outputs of each pair are used).
pub fn normal(c: &mut Ctx, shape: &[i64], dtype: DType) -> Value {
    let n = numel(shape);
    if n == 0 {
        return c.b.full(dtype, shape, 0.0);
    }
    let cdt = compute_dtype(dtype);
    let m = (n + 1) / 2;
    let u1 = uniform_open0(c, &[m], cdt);
    let u2 = uniform(c, &[m], cdt);
    let b = &mut *c.b;
    let l = b.log(u1);
    let k = b.splat(l, -2.0);
    let r = b.mul(l, k);
    let r = b.sqrt(r);
    let tau = b.splat(u2, std::f64::consts::TAU);
    let th = b.mul(u2, tau);
    let cs = b.unary("stablehlo.cosine", th);
    let sn = b.unary("stablehlo.sine", th);
    let z0 = b.mul(r, cs);
    let z1 = b.mul(r, sn);
    let z = b.concatenate(&[z0, z1], 0);
    let z = b.slice(z, &[0], &[n], &[1]);
    let z = b.reshape(z, shape);
    b.convert(z, dtype)
}

/// Binary digits of a float type's significand (`numeric_limits::digits`).
fn digits(d: DType) -> u32 {
    match d {
        DType::F16 => 11,
        DType::BF16 => 8,
        DType::F32 => 24,
        _ => 53,
    }
}

/// Range of an integer (or bool) type.
fn int_bounds(d: DType) -> (i64, i64) {
    match d {
        DType::Bool => (0, 1),
        DType::U8 => (0, 255),
        DType::I8 => (i8::MIN as i64, i8::MAX as i64),
        DType::I16 => (i16::MIN as i64, i16::MAX as i64),
        DType::I32 => (i32::MIN as i64, i32::MAX as i64),
        DType::U32 => (0, u32::MAX as i64),
        _ => (i64::MIN, i64::MAX),
    }
}

fn self_arg(c: &Ctx) -> LResult<crate::TensorArg> {
    Ok(c.args.tensor("self")?.clone())
}

fn require_float(dt: DType, kernel: &str) -> LResult<()> {
    if dt.is_float() {
        Ok(())
    } else {
        super::not_implemented(kernel, dt)
    }
}

/// `uniform_(from, to)`: `from + (to - from) * U[0, 1)`.
fn uniform_rule(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = self_arg(c)?;
    require_float(t.dtype, "check_uniform_bounds")?;
    let from = c.args.opt_float("from").unwrap_or(0.0);
    let to = c.args.opt_float("to").unwrap_or(1.0);
    let max = float_max(t.dtype);
    let name = cpp_name(t.dtype);
    if !(from >= -max && from <= max) {
        return user_err(
            ErrorKind::Runtime,
            format!("from is out of bounds for {name}"),
        );
    }
    if !(to >= -max && to <= max) {
        return user_err(
            ErrorKind::Runtime,
            format!("to is out of bounds for {name}"),
        );
    }
    if from > to {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "uniform_ expects to return a [from, to) range, but found from={} > to={}",
                super::fmt_num(from),
                super::fmt_num(to)
            ),
        );
    }
    if to - from > max {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "uniform_ expects to-from <= std::numeric_limits<{}>::max(), but found to={} and from={} which result in to-from to exceed the limit",
                torch_name(t.dtype),
                super::fmt_num(to),
                super::fmt_num(from)
            ),
        );
    }
    let u = uniform(c, &t.shape, t.dtype);
    if from == 0.0 && to == 1.0 {
        return Ok(vec![Out::T(u)]);
    }
    let cdt = compute_dtype(t.dtype);
    let u = c.b.convert(u, cdt);
    let k = c.b.splat(u, to - from);
    let lo = c.b.splat(u, from);
    let x = c.b.mul(u, k);
    let x = c.b.add(x, lo);
    Ok(vec![Out::T(c.b.convert(x, t.dtype))])
}

/// A `mean`/`std` operand of `normal`: a tensor or a number.
enum Param {
    T(crate::TensorArg),
    F(f64),
}

fn normal_param(c: &Ctx, name: &str, default: f64) -> Param {
    match c.args.get(name) {
        Some(Arg::Tensor(t)) => Param::T(t.clone()),
        _ => Param::F(c.args.opt_float(name).unwrap_or(default)),
    }
}

fn check_std(std: f64) -> LResult<()> {
    if std >= 0.0 {
        Ok(())
    } else {
        user_err(
            ErrorKind::Runtime,
            format!(
                "normal expects std >= 0.0, but found std {}",
                super::fmt_num(std)
            ),
        )
    }
}

/// Every overload of `normal`/`normal_`: `mean + std * N(0, 1)` with tensor or number
/// mean/std; the overloads with `self` sample `self`'s shape and dtype.
fn normal_rule(c: &mut Ctx) -> LResult<Vec<Out>> {
    let mean = normal_param(c, "mean", 0.0);
    let std = normal_param(c, "std", 1.0);
    if let Param::F(s) = std {
        check_std(s)?;
    }
    let (shape, dtype) = if let Some(t) = c.args.opt_tensor("self") {
        (t.shape.clone(), t.dtype)
    } else if c.args.has("size") {
        let size = c.args.ints("size")?;
        (size, c.args.opt_dtype("dtype").unwrap_or(DType::F32))
    } else {
        match (&mean, &std) {
            (Param::T(m), Param::T(s)) => (broadcast_shapes(&m.shape, &s.shape)?, m.dtype),
            (Param::T(m), Param::F(_)) => (m.shape.clone(), m.dtype),
            (Param::F(_), Param::T(s)) => (s.shape.clone(), s.dtype),
            (Param::F(_), Param::F(_)) => return decline("normal without a shape"),
        }
    };
    require_float(dtype, "normal_kernel_cpu")?;
    let z = normal(c, &shape, dtype);
    let cdt = compute_dtype(dtype);
    let z = c.b.convert(z, cdt);
    let operand = |c: &mut Ctx, p: &Param| -> Value {
        match p {
            Param::T(t) => {
                let v = c.b.convert(t.value, cdt);
                c.b.broadcast_to(v, &shape)
            }
            Param::F(f) => c.b.full(cdt, &shape, *f),
        }
    };
    let s = operand(c, &std);
    let m = operand(c, &mean);
    let x = c.b.mul(z, s);
    let x = c.b.add(x, m);
    Ok(vec![Out::T(c.b.convert(x, dtype))])
}

/// `bernoulli(self)` (p = self), `bernoulli(self, p)` and `bernoulli_(self, p)`: 1 where
/// U[0, 1) < p, in self's dtype and shape.
fn bernoulli(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = self_arg(c)?;
    let p = match c.args.get("p") {
        Some(Arg::Tensor(p)) => Param::T(p.clone()),
        Some(Arg::Float(_)) | Some(Arg::Int(_)) | Some(Arg::Bool(_)) => {
            Param::F(c.args.float("p")?)
        }
        _ => Param::T(t.clone()),
    };
    if let Param::F(p) = p {
        if !(0.0..=1.0).contains(&p) {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "bernoulli_ expects p to be in [0, 1], but got p={}",
                    super::fmt_num(p)
                ),
            );
        }
    }
    let cdt = match &p {
        Param::T(p) if p.dtype == DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let pv = match &p {
        Param::T(p) => {
            let s = broadcast_shapes(&t.shape, &p.shape)?;
            if s != t.shape {
                return decline("bernoulli: p does not broadcast to self");
            }
            let v = c.b.convert(p.value, cdt);
            c.b.broadcast_to(v, &t.shape)
        }
        Param::F(p) => c.b.full(cdt, &t.shape, *p),
    };
    let u = uniform(c, &t.shape, cdt);
    let hit = c.b.compare(u, pv, CmpDir::Lt);
    Ok(vec![Out::T(c.b.convert(hit, t.dtype))])
}

/// `random_`, `random_(to)`, `random_(from, to)`: integers uniform over a range, with
/// PyTorch's default ranges per dtype.
fn random(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = self_arg(c)?;
    let dt = t.dtype;
    if matches!(dt, DType::U32 | DType::U64) {
        return decline("random_ on unsigned 32/64-bit tensors");
    }
    let float = dt.is_float();
    let exact = if float { 1i64 << digits(dt) } else { 0 };
    let from = c.args.opt_int("from");
    let to = c.args.opt_int("to");
    let name = cpp_name(dt);
    let in_range = |from: i64, to_inc: i64| -> LResult<()> {
        let (lo, hi) = if float {
            let m = float_max(dt);
            (-m, m)
        } else {
            let (a, b) = int_bounds(dt);
            (a as f64, b as f64)
        };
        if (from as f64) < lo || (from as f64) > hi {
            return user_err(
                ErrorKind::Runtime,
                format!("from is out of bounds for {name}"),
            );
        }
        if (to_inc as f64) < lo || (to_inc as f64) > hi {
            return user_err(
                ErrorKind::Runtime,
                format!("to - 1 is out of bounds for {name}"),
            );
        }
        Ok(())
    };
    // (lowest value, number of values); 0 values means all 2^64.
    let (lo, range): (i64, u64) = match (from, to) {
        (f, Some(to)) => {
            let from = f.unwrap_or(0);
            if from >= to {
                return user_err(
                    ErrorKind::Runtime,
                    format!("random_ expects 'from' to be less than 'to', but got from={from} >= to={to}"),
                );
            }
            in_range(from, to - 1)?;
            if float && (from.unsigned_abs() > exact as u64 || to.unsigned_abs() > exact as u64) {
                // PyTorch rounds the bounds to the dtype and warns: leave that to it.
                return decline("random_ bounds beyond the float's exact integers");
            }
            (from, (to as i128 - from as i128) as u64)
        }
        (Some(from), None) if from != i64::MIN => {
            let to_inc = if float {
                if from.unsigned_abs() > exact as u64 {
                    return decline("random_ bounds beyond the float's exact integers");
                }
                if from >= exact {
                    return user_err(
                        ErrorKind::Runtime,
                        format!(
                            "random_ expects 'from' casted to dtype to be less than or equal to 'to_inc' casted to dtype, but got from={from} > to_inc={exact}"
                        ),
                    );
                }
                exact
            } else {
                int_bounds(dt).1
            };
            in_range(from, to_inc)?;
            (from, (to_inc as i128 - from as i128 + 1) as u64)
        }
        (Some(_), None) => {
            if dt != DType::I64 {
                return decline("random_ over the full 64-bit range for a non-int64 tensor");
            }
            (i64::MIN, 0)
        }
        (None, None) => {
            if float {
                (0, exact as u64 + 1)
            } else {
                let (_, hi) = int_bounds(dt);
                (0, hi as u64 + 1)
            }
        }
    };
    if numel(&t.shape) == 0 {
        return Ok(vec![Out::T(t.value)]);
    }
    let r = if range == 0 {
        let w = bits(c, &t.shape, DType::U64);
        c.b.bitcast_convert(w, DType::I64)
    } else if range <= u32::MAX as u64 {
        let w = bits(c, &t.shape, DType::U32);
        let k = c.b.splat(w, range as f64);
        let r = c.b.binary("stablehlo.remainder", w, k);
        c.b.convert(r, DType::I64)
    } else {
        let w = bits(c, &t.shape, DType::U64);
        let k = c.b.op(
            "stablehlo.constant",
            &[],
            &format!("value = dense<{range}> : tensor<ui64>"),
            TensorType::scalar(DType::U64),
        );
        let k = c.b.broadcast_in_dim(k, &t.shape, &[]);
        let r = c.b.binary("stablehlo.remainder", w, k);
        c.b.bitcast_convert(r, DType::I64)
    };
    let r = if lo != 0 {
        let base = c.b.constant_i64(DType::I64, lo);
        let base = c.b.broadcast_in_dim(base, &t.shape, &[]);
        c.b.add(r, base)
    } else {
        r
    };
    Ok(vec![Out::T(c.b.convert(r, dt))])
}

/// Message of the continuous distributions on integer tensors.
fn continuous_err(what: &str, dtype: &str) -> LResult<Vec<Out>> {
    user_err(
        ErrorKind::Runtime,
        format!("{what} distribution is a continuous probability distribution. dtype must be a floating point but you specified {dtype}"),
    )
}

/// `exponential_(lambd)`: `-log(U(0, 1]) / lambd`.
fn exponential(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = self_arg(c)?;
    let lambd = c.args.opt_float("lambd").unwrap_or(1.0);
    if lambd.is_nan() || lambd <= 0.0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "exponential_ expects lambda > 0.0, but found lambda={}",
                super::fmt_num(lambd)
            ),
        );
    }
    if !t.dtype.is_float() {
        return continuous_err("Exponential", torch_name(t.dtype));
    }
    let u = uniform_open0(c, &t.shape, t.dtype);
    let l = c.b.log(u);
    let k = c.b.splat(l, -1.0 / lambd);
    let x = c.b.mul(l, k);
    Ok(vec![Out::T(c.b.convert(x, t.dtype))])
}

/// `log_normal_(mean, std)`: `exp(mean + std * N(0, 1))`.
fn log_normal(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = self_arg(c)?;
    let mean = c.args.opt_float("mean").unwrap_or(1.0);
    let std = c.args.opt_float("std").unwrap_or(2.0);
    if std.is_nan() || std <= 0.0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "log_normal_ expects std > 0.0, but found std={}",
                super::fmt_num(std)
            ),
        );
    }
    if !t.dtype.is_float() {
        return decline("log_normal_ on an integer tensor");
    }
    let cdt = compute_dtype(t.dtype);
    let z = normal(c, &t.shape, cdt);
    let s = c.b.splat(z, std);
    let m = c.b.splat(z, mean);
    let x = c.b.mul(z, s);
    let x = c.b.add(x, m);
    let x = c.b.exp(x);
    Ok(vec![Out::T(c.b.convert(x, t.dtype))])
}

/// `geometric_(p)`: trials up to the first success, `ceil(log(U) / log(1 - p))`, at least 1.
fn geometric(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = self_arg(c)?;
    let p = c.args.float("p")?;
    if !(p > 0.0 && p < 1.0) {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "geometric_ expects p to be in (0, 1), but got p={}",
                super::fmt_num(p)
            ),
        );
    }
    if matches!(t.dtype, DType::U32 | DType::U64) {
        return decline("geometric_ on unsigned 32/64-bit tensors");
    }
    let u = uniform_open0(c, &t.shape, t.dtype);
    let l = c.b.log(u);
    let k = c.b.splat(l, 1.0 / (-p).ln_1p());
    let x = c.b.mul(l, k);
    let x = c.b.unary("stablehlo.ceil", x);
    let one = c.b.splat(x, 1.0);
    let x = c.b.max(x, one);
    Ok(vec![Out::T(c.b.convert(x, t.dtype))])
}

/// `cauchy_(median, sigma)`: `median + sigma * tan(pi * (U - 1/2))`.
fn cauchy(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = self_arg(c)?;
    let median = c.args.opt_float("median").unwrap_or(0.0);
    let sigma = c.args.opt_float("sigma").unwrap_or(1.0);
    if sigma.is_nan() || sigma <= 0.0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "cauchy_ expects sigma > 0.0, but found sigma={}",
                super::fmt_num(sigma)
            ),
        );
    }
    if !t.dtype.is_float() {
        return continuous_err("Cauchy", cpp_name(t.dtype));
    }
    let cdt = compute_dtype(t.dtype);
    let u = uniform(c, &t.shape, cdt);
    let b = &mut *c.b;
    let half = b.splat(u, 0.5);
    let a = b.sub(u, half);
    let pi = b.splat(a, std::f64::consts::PI);
    let a = b.mul(a, pi);
    let s = b.unary("stablehlo.sine", a);
    let co = b.unary("stablehlo.cosine", a);
    let x = b.div(s, co);
    let k = b.splat(x, sigma);
    let m = b.splat(x, median);
    let x = b.mul(x, k);
    let x = b.add(x, m);
    Ok(vec![Out::T(b.convert(x, t.dtype))])
}

/// Sorts `payload` along `dim` by `keys` ascending (stable); returns the sorted payload.
fn sort_by(b: &mut Builder, keys: Value, payload: Value, dim: usize) -> Value {
    let kt = TensorType::scalar(b.dtype(keys));
    let pt = TensorType::scalar(b.dtype(payload));
    let region = b.region(&[kt.clone(), kt, pt.clone(), pt], |b, a| {
        vec![b.compare(a[0], a[1], CmpDir::Lt)]
    });
    let tys = [b.ty(keys).clone(), b.ty(payload).clone()];
    let attrs = format!("dimension = {dim} : i64, is_stable = true");
    b.op_regions("stablehlo.sort", &[keys, payload], &[region], &attrs, &tys)[1]
}

/// `randperm(n)`: indices sorted by random 64-bit keys.
fn randperm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let n = c.args.int("n")?;
    let dt = c.args.opt_dtype("dtype").unwrap_or(DType::I64);
    if n < 0 {
        return decline("randperm with a negative n");
    }
    match dt {
        DType::Bool => {
            return user_err(
                ErrorKind::NotImplemented,
                "\"randperm\" not implemented for 'Bool'",
            );
        }
        DType::F16 if n > 2049 => {
            return user_err(
                ErrorKind::Runtime,
                "n cannot be greater than 2049 for Half type.",
            );
        }
        DType::F32 if n > (1 << 24) + 1 => {
            return user_err(
                ErrorKind::Runtime,
                "n cannot be greater than 2^24+1 for Float type.",
            );
        }
        d if !d.is_float() && n > 0 && n - 1 > int_bounds(d).1 => {
            return decline("randperm: n does not fit the dtype");
        }
        _ => {}
    }
    let keys = bits(c, &[n], DType::U64);
    let idx = c.b.iota(DType::I64, &[n], 0);
    let perm = if n > 1 {
        sort_by(c.b, keys, idx, 0)
    } else {
        idx
    };
    Ok(vec![Out::T(c.b.convert(perm, dt))])
}

/// `multinomial(probs, k, replacement)`: each draw picks the category with the smallest
/// `Exp(1) / p` (an exponential race, so weights need no normalising). Without
/// replacement the first `k` of one race are taken; with replacement each draw runs
/// its own race.
fn multinomial(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = self_arg(c)?;
    let k = c.args.int("num_samples")?;
    let replacement = c.args.bool_or("replacement", false);
    c.require_out_dtype(DType::I64, |o| {
        format!(
            "multinomial expects Long tensor out, got: {}",
            torch_name(o)
        )
    })?;
    let rank = t.shape.len();
    if !(rank == 1 || rank == 2) {
        return user_err(ErrorKind::Runtime, "prob_dist must be 1 or 2 dim");
    }
    if !t.dtype.is_float() {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "multinomial only supports floating-point dtypes for input, got: {}",
                torch_name(t.dtype)
            ),
        );
    }
    if k <= 0 {
        return user_err(ErrorKind::Runtime, "cannot sample n_sample <= 0 samples");
    }
    let n = t.shape[rank - 1];
    if !replacement && k > n {
        return user_err(
            ErrorKind::Runtime,
            "cannot sample n_sample > prob_dist.size(-1) samples without replacement",
        );
    }
    if n > 1 << 24 {
        return user_err(
            ErrorKind::Runtime,
            "number of categories cannot exceed 2^24",
        );
    }
    let rows = if rank == 2 { t.shape[0] } else { 1 };
    if rows == 0 || n == 0 {
        return decline("multinomial on an empty distribution");
    }
    let cdt = compute_dtype(t.dtype);
    let p = c.b.convert(t.value, cdt);
    let p = c.b.reshape(p, &[rows, n]);
    let draws = if replacement { k } else { 1 };
    let shape = [rows, draws, n];
    let p = c.b.broadcast_in_dim(p, &shape, &[0, 2]);
    let u = uniform_open0(c, &shape, cdt);
    let e = c.b.log(u);
    let e = c.b.neg(e);
    let race = c.b.div(e, p);
    let zero = c.b.splat(p, 0.0);
    let pos = c.b.compare(p, zero, CmpDir::Gt);
    let inf = c.b.splat(p, f64::INFINITY);
    let race = c.b.select(pos, race, inf);
    let idx = c.b.iota(DType::I64, &shape, 2);
    let out = if replacement || k == 1 {
        // Index of each race's minimum (the first one on ties).
        let m = c.b.reduce(race, &[2], ReduceKind::Min);
        let m = c.b.broadcast_in_dim(m, &shape, &[0, 1]);
        let at_min = c.b.compare(race, m, CmpDir::Eq);
        let big = c.b.splat(idx, n as f64);
        let cand = c.b.select(at_min, idx, big);
        c.b.reduce(cand, &[2], ReduceKind::Min)
    } else {
        let race = c.b.reshape(race, &[rows, n]);
        let idx = c.b.reshape(idx, &[rows, n]);
        let sorted = sort_by(c.b, race, idx, 1);
        c.b.slice(sorted, &[0, 0], &[rows, k], &[1, 1])
    };
    let out_shape: Vec<i64> = if rank == 2 { vec![rows, k] } else { vec![k] };
    Ok(vec![Out::T(c.b.reshape(out, &out_shape))])
}

// ---------------------------------------------------------------------------------------
// Dropout
// ---------------------------------------------------------------------------------------

/// native_dropout: in training, keep each element with probability 1 - p and scale the kept
/// ones by 1 / (1 - p); otherwise return the input and an all-true mask.
fn native_dropout(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "input")?;
    let p = c.args.float("p")?;
    let train = match c.args.get("train") {
        Some(crate::Arg::Bool(t)) => *t,
        _ => true,
    };
    if !train || numel(&x.shape) == 0 {
        let ones = c.b.full(DType::Bool, &x.shape, 1.0);
        return Ok(vec![Out::T(x.value), Out::T(ones)]);
    }
    float_input(&x, "native_dropout")?;
    if !(0.0..=1.0).contains(&p) {
        // The CPU fallback raises bernoulli_'s message with PyTorch's number formatting.
        return decline("native_dropout: p outside [0, 1]");
    }
    let keep = 1.0 - p;
    let scale = if keep == 0.0 { 0.0 } else { 1.0 / keep };
    let cd = opmath(x.dtype);
    let u = super::random::uniform(c, &x.shape, cd);
    let b = &mut *c.b;
    let k = b.splat(u, keep);
    let mask = b.compare(u, k, CmpDir::Lt);
    let xv = b.convert(x.value, cd);
    let m = b.convert(mask, cd);
    let y = b.mul(xv, m);
    let s = b.splat(y, scale);
    let y = b.mul(y, s);
    Ok(vec![Out::T(b.convert(y, x.dtype)), Out::T(mask)])
}

fn native_dropout_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let g = tensor(c, "grad_output")?;
    let m = tensor(c, "mask")?;
    let scale = c.args.float("scale")?;
    if m.shape != g.shape {
        return decline("native_dropout_backward: mask shape");
    }
    let b = &mut *c.b;
    if !g.dtype.is_float() {
        // PyTorch's `grad * mask * scale`: the product in grad's dtype, then times the
        // Python float, which makes the result float32.
        let mv = b.convert(m.value, g.dtype);
        let t = if g.dtype == DType::Bool {
            b.and(g.value, mv)
        } else {
            b.mul(g.value, mv)
        };
        let t = b.convert(t, DType::F32);
        let k = b.splat(t, scale);
        return Ok(vec![Out::T(b.mul(t, k))]);
    }
    let cd = opmath(g.dtype);
    let gv = b.convert(g.value, cd);
    let mv = b.convert(m.value, cd);
    let t = b.mul(gv, mv);
    let k = b.splat(t, scale);
    let r = b.mul(t, k);
    Ok(vec![Out::T(b.convert(r, g.dtype))])
}

pub const RULES: &[(&str, Rule)] = &[
    ("aten::native_dropout", native_dropout),
    ("aten::native_dropout_backward", native_dropout_backward),
    ("aten::uniform", uniform_rule),
    ("aten::normal", normal_rule),
    ("aten::normal_functional", normal_rule),
    ("aten::bernoulli", bernoulli),
    ("aten::random", random),
    ("aten::exponential", exponential),
    ("aten::log_normal", log_normal),
    ("aten::geometric", geometric),
    ("aten::cauchy", cauchy),
    ("aten::randperm", randperm),
    ("aten::multinomial", multinomial),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Args, TensorArg};

    fn tensor_args(b: &mut Builder, dtype: DType, shape: &[i64], extra: Vec<(&str, Arg)>) -> Args {
        let v = b.param(TensorType::new(dtype, shape));
        let mut items = vec![(
            "self".to_string(),
            Arg::Tensor(TensorArg {
                value: v,
                dtype,
                shape: shape.to_vec(),
                wrapped_number: false,
            }),
        )];
        items.extend(extra.into_iter().map(|(n, a)| (n.to_string(), a)));
        Args { items }
    }

    #[test]
    fn draws_use_disjoint_counters() {
        let mut b = Builder::new();
        let args = tensor_args(&mut b, DType::F32, &[3, 5], vec![]);
        let mut c = Ctx::new(&mut b, "aten::normal_", "", &args);
        let out = normal_rule(&mut c).unwrap();
        // Box-Muller on 15 values: two draws of 8.
        assert_eq!(c.rng_consumed, 16);
        let v = match out[0] {
            Out::T(v) => v,
            _ => panic!("tensor result"),
        };
        assert_eq!(b.shape(v), vec![3, 5]);
        let text = b.finish(&[v]);
        assert!(text.contains("dense<[0, 8]>"), "{text}");
    }

    #[test]
    fn random_checks_bounds() {
        let mut b = Builder::new();
        let args = tensor_args(
            &mut b,
            DType::I8,
            &[4],
            vec![("from", Arg::Int(0)), ("to", Arg::Int(300))],
        );
        let mut c = Ctx::new(&mut b, "aten::random_", "from", &args);
        match random(&mut c) {
            Err(crate::LowerError::User(_, m)) => {
                assert_eq!(m, "to - 1 is out of bounds for signed char")
            }
            _ => panic!("expected an error"),
        }
    }
}
