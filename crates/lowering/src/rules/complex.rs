//! Complex numbers: the rules an op with a complex64/complex128 operand may run, and the
//! FFTs.
//!
//! Rules elsewhere were written for real dtypes (ordered comparisons, `is_float` branches
//! that treat every other dtype as an integer), so a call with a complex tensor or number
//! runs only a rule this module vouches for: its own (`RULES`), or a rule of another family
//! listed in `SHARED`, each checked against the CPU by the complex64 OpInfo tests. Any other
//! op declines and falls back to the CPU.

use super::{opmath, promote, same};
use crate::args::{Arg, Args, TensorArg};
use crate::promote::to_float;
use crate::{user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, Value};

/// The real rule of `op` run with tensor argument `name` replaced by `value` (a part or
/// the magnitude of a complex operand).
fn real_rule_with(c: &mut Ctx, op: &str, name: &str, value: Value) -> LResult<Vec<Out>> {
    let args = replaced(c, name, value);
    real_rule_args(c, op, &args)
}

/// The call's arguments with tensor argument `name` replaced by `value`.
fn replaced(c: &Ctx, name: &str, value: Value) -> Args {
    let mut args = c.args.clone();
    for (n, a) in args.items.iter_mut() {
        if n == name {
            *a = Arg::Tensor(TensorArg {
                value,
                dtype: c.b.dtype(value),
                shape: c.b.shape(value),
                wrapped_number: false,
            });
        }
    }
    args
}

/// The real rule of `op` run on `args`; the RNG it draws from is the call's.
fn real_rule_args(c: &mut Ctx, op: &str, args: &Args) -> LResult<Vec<Out>> {
    let Some(rule) = super::lookup(op) else {
        return user_err(ErrorKind::NotImplemented, format!("no rule for {op}"));
    };
    let mut sub = Ctx::new(c.b, c.op, c.overload, args);
    sub.out_dtypes = c.out_dtypes.clone();
    sub.rng_state = c.rng_state;
    sub.rng_consumed = c.rng_consumed;
    let outs = rule(&mut sub)?;
    if !sub.writes.is_empty() || !sub.checks.is_empty() {
        return user_err(
            ErrorKind::NotImplemented,
            format!("{op}: complex form not modelled"),
        );
    }
    let (state, consumed) = (sub.rng_state, sub.rng_consumed);
    c.rng_state = state;
    c.rng_consumed = consumed;
    Ok(outs)
}

/// `normal_`/`uniform_` of a complex tensor: its (real, imag) pairs drawn as a real tensor,
/// as PyTorch does through view_as_real (a normal's std split evenly between the parts).
fn random_parts(c: &mut Ctx, op: &str) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let part = t.dtype.real_part();
    let mut pairs = t.shape.clone();
    pairs.push(2);
    let z = c.b.full(part, &pairs, 0.0);
    let mut args = replaced(c, "self", z);
    if op == "aten::normal" {
        for (n, a) in args.items.iter_mut() {
            if let (true, Arg::Float(s)) = (n == "std", &a) {
                *a = Arg::Float(s / std::f64::consts::SQRT_2);
            }
        }
    }
    let r = real_rule_args(c, op, &args)?;
    let v = tensor_out(&r[0])?;
    Ok(vec![Out::T(c.b.pairs_to_complex(v))])
}

fn tensor_out(o: &Out) -> LResult<Value> {
    match o {
        Out::T(v) => Ok(*v),
        _ => user_err(ErrorKind::NotImplemented, "expected a tensor result"),
    }
}

/// Norms of a complex tensor: the real norm of its magnitude (a complex `dtype=` is the
/// dtype the input is converted to first).
fn of_magnitude(c: &mut Ctx, op: &str) -> LResult<Vec<Out>> {
    let mut x = c.args.tensor("self")?.value;
    let mut args = c.args.clone();
    for (n, a) in args.items.iter_mut() {
        if let (true, Arg::ScalarType(d)) = (n == "dtype", &a) {
            if d.is_complex() {
                x = c.b.convert(x, *d);
                *a = Arg::ScalarType(d.real_part());
            }
        }
    }
    let m = c.b.abs(x);
    let mut sub = Ctx::new(c.b, c.op, c.overload, &args);
    sub.out_dtypes = c.out_dtypes.clone();
    real_rule_with(&mut sub, op, "self", m)
}

/// Applies the real rule of `op` to the real and imaginary parts: complex(op(re), op(im)).
fn by_parts(c: &mut Ctx, op: &str) -> LResult<Vec<Out>> {
    let x = c.args.tensor("self")?.value;
    let (re, im) = (c.b.real(x), c.b.imag(x));
    let r = real_rule_with(c, op, "self", re)?;
    let i = real_rule_with(c, op, "self", im)?;
    let v = c.b.complex(tensor_out(&r[0])?, tensor_out(&i[0])?);
    Ok(vec![Out::T(v)])
}

/// var(x) = var(re x) + var(im x) (PyTorch's definition, E|x - E x|^2); std its root;
/// the `_mean` forms return the complex mean too.
fn var_std(c: &mut Ctx, std: bool, with_mean: bool) -> LResult<Vec<Out>> {
    let x = c.args.tensor("self")?.value;
    let op = if with_mean {
        "aten::var_mean"
    } else {
        "aten::var"
    };
    let (re, im) = (c.b.real(x), c.b.imag(x));
    let r = real_rule_with(c, op, "self", re)?;
    let i = real_rule_with(c, op, "self", im)?;
    let mut v = c.b.add(tensor_out(&r[0])?, tensor_out(&i[0])?);
    if std {
        v = c.b.sqrt(v);
    }
    let mut outs = vec![Out::T(v)];
    if with_mean {
        let m = c.b.complex(tensor_out(&r[1])?, tensor_out(&i[1])?);
        outs.push(Out::T(m));
    }
    Ok(outs)
}

/// Rules of other families that are right for complex operands as they are: data
/// movement, and arithmetic StableHLO defines on complex numbers.
pub const SHARED: &[&str] = &[
    // data movement
    "aten::clone",
    "torch_pjrt::copy",
    "torch_pjrt::equal",
    "torch_pjrt::jax_call",
    "aten::cat",
    "aten::flip",
    "aten::roll",
    "aten::index_select",
    "aten::gather",
    "aten::take",
    "aten::index",
    "aten::_unsafe_index",
    "aten::index_put",
    "aten::_index_put_impl",
    "aten::_unsafe_index_put",
    "aten::masked_fill",
    "aten::masked_scatter",
    "aten::where",
    "aten::constant_pad_nd",
    "aten::repeat",
    "aten::tril",
    "aten::triu",
    "aten::diagonal_scatter",
    "aten::select_scatter",
    "aten::slice_scatter",
    "aten::fill",
    "aten::zero",
    "aten::scatter",
    "aten::index_fill",
    "aten::index_copy",
    "aten::put",
    "aten::narrow_copy",
    "aten::select_backward",
    "aten::slice_backward",
    "aten::diagonal_backward",
    "aten::unfold_backward",
    "aten::eye",
    // arithmetic
    "aten::add",
    "aten::sub",
    "aten::rsub",
    "aten::mul",
    "aten::neg",
    "aten::div",
    "aten::eq",
    "aten::ne",
    "aten::addcmul",
    "aten::addcdiv",
    "aten::lerp",
    "aten::exp",
    "aten::log",
    "aten::sqrt",
    "aten::rsqrt",
    "aten::sin",
    "aten::cos",
    "aten::tan",
    "aten::tanh",
    "aten::sigmoid",
    "aten::pow",
    "aten::reciprocal",
    "aten::log1p",
    "aten::expm1",
    "aten::log2",
    "aten::log10",
    "aten::exp2",
    // reductions and products
    "aten::sum",
    "aten::mean",
    "aten::prod",
    "aten::cumsum",
    "aten::cumprod",
    "aten::mm",
    "aten::bmm",
    "aten::addmm",
    "aten::addmv",
    "aten::mv",
    "aten::baddbmm",
    "aten::addbmm",
    "aten::addr",
    "aten::dot",
    "aten::logical_not",
    "aten::logical_and",
    "aten::logical_or",
    "aten::logical_xor",
    "aten::all",
    "aten::any",
    "aten::count_nonzero",
    "aten::trace",
    "aten::scatter_add",
    "aten::index_add",
    "aten::channel_shuffle",
    "aten::nonzero_static",
    "aten::im2col",
    "aten::linalg_cross",
    // functions StableHLO/CHLO define on complex numbers
    "aten::asin",
    "aten::acos",
    "aten::atan",
    "aten::sinh",
    "aten::cosh",
    "aten::asinh",
    "aten::acosh",
    "aten::atanh",
    "aten::sinc",
    "aten::silu",
    "aten::sigmoid_backward",
    "aten::tanh_backward",
    "aten::col2im",
    "aten::_logcumsumexp",
    "aten::linspace",
    "aten::logspace",
    // LU and triangular solves
    "aten::linalg_lu_factor_ex",
    "aten::linalg_lu",
    "aten::lu_unpack",
    "aten::linalg_lu_solve",
    "aten::linalg_inv_ex",
    "aten::_linalg_det",
    "aten::_linalg_slogdet",
    "aten::_linalg_solve_ex",
    "aten::linalg_solve_triangular",
    "aten::triangular_solve",
];

#[cfg(test)]
mod tests {
    #[test]
    fn shared_rules_exist() {
        let missing: Vec<&&str> = super::SHARED
            .iter()
            .filter(|op| super::super::lookup(op).is_none())
            .collect();
        assert!(missing.is_empty(), "listed without a rule: {missing:?}");
    }
}

pub const RULES: &[(&str, Rule)] = &[
    ("aten::abs", abs),
    ("aten::angle", angle),
    ("aten::sgn", sgn),
    ("aten::conj_physical", conj_physical),
    ("aten::_conj_physical", conj_physical),
    ("aten::isnan", |c| parts_test(c, Part::Nan)),
    ("aten::isinf", |c| parts_test(c, Part::Inf)),
    ("aten::isfinite", |c| parts_test(c, Part::Finite)),
    ("aten::polar", polar),
    ("aten::complex", complex),
    ("aten::vdot", vdot),
    ("aten::logaddexp", logaddexp),
    ("aten::normal", |c| random_parts(c, "aten::normal")),
    ("aten::uniform", |c| random_parts(c, "aten::uniform")),
    ("aten::var", |c| var_std(c, false, false)),
    ("aten::std", |c| var_std(c, true, false)),
    ("aten::var_mean", |c| var_std(c, false, true)),
    ("aten::std_mean", |c| var_std(c, true, true)),
    ("aten::linalg_vector_norm", |c| {
        of_magnitude(c, "aten::linalg_vector_norm")
    }),
    ("aten::norm", |c| of_magnitude(c, "aten::norm")),
    ("aten::nan_to_num", |c| by_parts(c, "aten::nan_to_num")),
    ("aten::_fft_c2c", fft_c2c),
    ("aten::_fft_r2c", fft_r2c),
    ("aten::_fft_c2r", fft_c2r),
];

/// |x| (a real tensor for complex x).
fn abs(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, _, _) = promote(c, &["self"], same)?;
    Ok(vec![Out::T(c.b.abs(v[0]))])
}

/// The argument of a complex number (0 or pi for reals, as PyTorch's angle).
fn angle(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["self"], to_float)?;
    let x = v[0];
    if !dt.is_complex() {
        return user_err(
            ErrorKind::NotImplemented,
            "angle: real input reached the complex rule",
        );
    }
    let re = c.b.real(x);
    let im = c.b.imag(x);
    Ok(vec![Out::T(c.b.binary("stablehlo.atan2", im, re))])
}

/// x / |x|, and 0 where x is 0.
fn sgn(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["self"], same)?;
    let x = v[0];
    if !dt.is_complex() {
        return user_err(
            ErrorKind::NotImplemented,
            "sgn: real input reached the complex rule",
        );
    }
    let m = c.b.abs(x);
    let zero = c.b.splat(m, 0.0);
    let is_zero = c.b.compare(m, zero, stablehlo::CmpDir::Eq);
    let mc = c.b.convert(m, dt);
    let q = c.b.div(x, mc);
    let z = c.b.splat(x, 0.0);
    Ok(vec![Out::T(c.b.select(is_zero, z, q))])
}

/// conj(x) = re - i*im; a real tensor is its own conjugate.
fn conj_physical(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, _, _) = promote(c, &["self"], same)?;
    Ok(vec![Out::T(c.b.conj(v[0]))])
}

enum Part {
    Nan,
    Inf,
    Finite,
}

/// isnan/isinf (either part) and isfinite (both parts) of a complex tensor.
fn parts_test(c: &mut Ctx, test: Part) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["self"], same)?;
    if !dt.is_complex() {
        return user_err(
            ErrorKind::NotImplemented,
            "real input reached the complex rule",
        );
    }
    let parts = [c.b.real(v[0]), c.b.imag(v[0])];
    let [a, b] = parts.map(|p| match test {
        Part::Nan => c.b.compare(p, p, stablehlo::CmpDir::Ne),
        Part::Inf => {
            let m = c.b.abs(p);
            let inf = c.b.splat(m, f64::INFINITY);
            c.b.compare(m, inf, stablehlo::CmpDir::Eq)
        }
        Part::Finite => c.b.is_finite(p),
    });
    let r = match test {
        Part::Finite => c.b.and(a, b),
        _ => c.b.or(a, b),
    };
    Ok(vec![Out::T(r)])
}

/// abs * (cos(angle) + i sin(angle)).
fn polar(c: &mut Ctx) -> LResult<Vec<Out>> {
    check_parts_dtype(c, ["abs", "angle"])?;
    let (v, _, _) = promote(c, &["abs", "angle"], same)?;
    let cs = c.b.unary("stablehlo.cosine", v[1]);
    let sn = c.b.unary("stablehlo.sine", v[1]);
    let re = c.b.mul(v[0], cs);
    let im = c.b.mul(v[0], sn);
    Ok(vec![Out::T(c.b.complex(re, im))])
}

/// real + i*imag.
fn complex(c: &mut Ctx) -> LResult<Vec<Out>> {
    check_parts_dtype(c, ["real", "imag"])?;
    let (v, dt, _) = promote(c, &["real", "imag"], same)?;
    if !matches!(dt, DType::F32 | DType::F64) {
        // PyTorch's half parts give complex32, which has no lowering.
        return user_err(
            ErrorKind::NotImplemented,
            "complex: float16 parts make a complex32 tensor, which the tpu device does not support",
        );
    }
    Ok(vec![Out::T(c.b.complex(v[0], v[1]))])
}

/// PyTorch's checks on the parts of `complex`/`polar` (and on an out= tensor).
fn check_parts_dtype(c: &Ctx, names: [&str; 2]) -> LResult<()> {
    let [a, b] = names.map(|n| c.args.tensor(n).map(|t| t.dtype));
    let (a, b) = (a?, b?);
    if a != b {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected object of scalar type {} but got scalar type {} for second argument",
                crate::promote::torch_name(a),
                crate::promote::torch_name(b)
            ),
        );
    }
    if !a.is_float() {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected both inputs to be Half, Float or Double tensors but got {} and {}",
                crate::promote::torch_name(a),
                crate::promote::torch_name(b)
            ),
        );
    }
    if let Some(&o) = c.out_dtypes.first() {
        if o != a.complex_of() {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "Expected object of scalar type {} but got scalar type {} for argument 'out'",
                    crate::promote::torch_name(a.complex_of()),
                    crate::promote::torch_name(o)
                ),
            );
        }
    }
    Ok(())
}

/// log(exp(a) + exp(b)) = hi + log1p(exp(lo - hi)), hi the operand with the larger real
/// part (as PyTorch's complex kernel).
fn logaddexp(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, _, _) = promote(c, &["self", "other"], to_float)?;
    let (a, b) = (v[0], v[1]);
    let (ra, rb) = (c.b.real(a), c.b.real(b));
    let a_hi = c.b.compare(ra, rb, stablehlo::CmpDir::Ge);
    let hi = c.b.select(a_hi, a, b);
    let lo = c.b.select(a_hi, b, a);
    let d = c.b.sub(lo, hi);
    let e = c.b.unary("stablehlo.exponential", d);
    let l = c.b.unary("stablehlo.log_plus_one", e);
    Ok(vec![Out::T(c.b.add(hi, l))])
}

/// sum(conj(self) * other).
fn vdot(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, &["self", "other"], same)?;
    let a = c.b.conj(v[0]);
    Ok(vec![Out::T(c.b.dot_general(
        a,
        v[1],
        (&[], &[]),
        (&[0], &[0]),
        dt,
    ))])
}

// ---------------------------------------------------------------------------
// FFTs: ATen's three primitives (`torch.fft.*`, `stft` and their backward decompose to
// them), on `stablehlo.fft`, which transforms the trailing one to three dimensions.
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum FftKind {
    Fft,
    Ifft,
    Rfft,
    Irfft,
}

impl FftKind {
    fn name(self) -> &'static str {
        match self {
            FftKind::Fft => "FFT",
            FftKind::Ifft => "IFFT",
            FftKind::Rfft => "RFFT",
            FftKind::Irfft => "IRFFT",
        }
    }
}

/// The FFT of the trailing `lengths.len()` (1..=3) dimensions of `x`.
fn fft_trailing(b: &mut Builder, x: Value, kind: FftKind, lengths: &[i64]) -> Value {
    let ty = b.ty(x).clone();
    let mut shape = ty.shape.clone();
    let last = shape.len() - 1;
    let dtype = match kind {
        FftKind::Fft | FftKind::Ifft => ty.dtype,
        FftKind::Rfft => {
            shape[last] = lengths[lengths.len() - 1] / 2 + 1;
            ty.dtype.complex_of()
        }
        FftKind::Irfft => {
            shape[last] = lengths[lengths.len() - 1];
            ty.dtype.real_part()
        }
    };
    let lens: Vec<String> = lengths.iter().map(|l| l.to_string()).collect();
    let attrs = format!(
        "fft_type = #stablehlo<fft_type {}>, fft_length = array<i64: {}>",
        kind.name(),
        lens.join(", ")
    );
    b.op(
        "stablehlo.fft",
        &[x],
        &attrs,
        crate::TensorType::new(dtype, &shape),
    )
}

/// `f(x)` over `dims` of `x` moved last (in their order), then moved back.
fn over_dims(
    b: &mut Builder,
    x: Value,
    dims: &[usize],
    f: impl FnOnce(&mut Builder, Value) -> Value,
) -> Value {
    let rank = b.shape(x).len();
    let mut perm: Vec<i64> = (0..rank)
        .filter(|d| !dims.contains(d))
        .map(|d| d as i64)
        .collect();
    perm.extend(dims.iter().map(|&d| d as i64));
    let moved = b.transpose(x, &perm);
    let y = f(b, moved);
    let mut inv = vec![0i64; rank];
    for (i, &p) in perm.iter().enumerate() {
        inv[p as usize] = i as i64;
    }
    b.transpose(y, &inv)
}

/// Complex FFTs over the trailing `n` dims, three at a time (XLA's limit).
fn c2c_trailing(b: &mut Builder, mut x: Value, n: usize, forward: bool) -> Value {
    let kind = if forward { FftKind::Fft } else { FftKind::Ifft };
    let shape = b.shape(x);
    let rank = shape.len();
    let mut done = 0;
    while done < n {
        let k = (n - done).min(3);
        // Bring dims [rank-done-k, rank-done) to the end, transform, put them back.
        let lo = rank - done - k;
        let dims: Vec<usize> = (lo..lo + k).collect();
        let lens: Vec<i64> = dims.iter().map(|&d| shape[d]).collect();
        x = if done == 0 {
            fft_trailing(b, x, kind, &lens)
        } else {
            over_dims(b, x, &dims, |b, v| fft_trailing(b, v, kind, &lens))
        };
        done += k;
    }
    x
}

/// The dims of a transform, normalized and checked.
fn fft_dims(c: &Ctx, rank: usize) -> LResult<Vec<usize>> {
    let dims = c.args.ints("dim")?;
    let mut out = Vec::with_capacity(dims.len());
    for d in dims {
        out.push(crate::shape::wrap_dim(d, rank)?);
    }
    Ok(out)
}

/// The factor turning XLA's transform into PyTorch's: forward transforms are
/// unnormalized in XLA, inverse ones divide by n; `normalization` is ATen's mode
/// (0: none, 1: 1/sqrt(n), 2: 1/n).
fn fft_scale(
    b: &mut Builder,
    x: Value,
    normalization: i64,
    forward: bool,
    n: i64,
) -> LResult<Value> {
    let n = n as f64;
    let xla = if forward { 1.0 } else { 1.0 / n };
    let want = match normalization {
        0 => 1.0,
        1 => 1.0 / n.sqrt(),
        2 => 1.0 / n,
        m => {
            return user_err(
                ErrorKind::Runtime,
                format!("unknown FFT normalization mode {m}"),
            );
        }
    };
    let f = want / xla;
    if f == 1.0 {
        return Ok(x);
    }
    let k = b.splat(x, f);
    Ok(b.mul(x, k))
}

fn complex_input(c: &Ctx, op: &str) -> LResult<TensorArg> {
    let x = c.args.tensor("self")?.clone();
    if !x.dtype.is_complex() {
        return user_err(
            ErrorKind::Runtime,
            format!("{op} expects a complex input tensor"),
        );
    }
    Ok(x)
}

fn fft_c2c(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = complex_input(c, "_fft_c2c")?;
    let dims = fft_dims(c, x.shape.len())?;
    let norm = c.args.int("normalization")?;
    let forward = c.args.bool_or("forward", true);
    let n: i64 = dims.iter().map(|&d| x.shape[d]).product();
    if dims.is_empty() || n == 0 {
        return Ok(vec![Out::T(x.value)]);
    }
    let k = dims.len();
    let y = over_dims(c.b, x.value, &dims, |b, v| c2c_trailing(b, v, k, forward));
    Ok(vec![Out::T(fft_scale(c.b, y, norm, forward, n)?)])
}

fn fft_r2c(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = c.args.tensor("self")?.clone();
    if !x.dtype.is_float() {
        return user_err(ErrorKind::Runtime, "_fft_r2c expects a real input tensor");
    }
    let dims = fft_dims(c, x.shape.len())?;
    let norm = c.args.int("normalization")?;
    let onesided = c.args.bool_or("onesided", true);
    let n: i64 = dims.iter().map(|&d| x.shape[d]).product();
    let dt = opmath(x.dtype);
    let v = c.b.convert(x.value, dt);
    if dims.is_empty() {
        return Ok(vec![Out::T(c.b.convert(v, dt.complex_of()))]);
    }
    let k = dims.len();
    let last = x.shape[dims[k - 1]];
    let y = over_dims(c.b, v, &dims, |b, v| {
        if !onesided {
            let z = b.convert(v, dt.complex_of());
            return c2c_trailing(b, z, k, true);
        }
        let r = fft_trailing(b, v, FftKind::Rfft, &[last]);
        if k == 1 {
            return r;
        }
        // The other dims: complex FFTs over the k-1 dims before the last.
        let rank = b.shape(r).len();
        let rest: Vec<usize> = (rank - k..rank - 1).collect();
        over_dims(b, r, &rest, |b, w| c2c_trailing(b, w, k - 1, true))
    });
    Ok(vec![Out::T(fft_scale(c.b, y, norm, true, n)?)])
}

fn fft_c2r(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = complex_input(c, "_fft_c2r")?;
    let dims = fft_dims(c, x.shape.len())?;
    let norm = c.args.int("normalization")?;
    let last_size = c.args.int("last_dim_size")?;
    if dims.is_empty() || last_size <= 0 {
        return user_err(
            ErrorKind::Runtime,
            "Invalid number of data points (0) specified",
        );
    }
    let k = dims.len();
    let half = last_size / 2 + 1;
    let n: i64 = dims[..k - 1].iter().map(|&d| x.shape[d]).product::<i64>() * last_size;
    let have = x.shape[dims[k - 1]];
    let y = over_dims(c.b, x.value, &dims, |b, v| {
        let mut v = v;
        if k > 1 {
            let rank = b.shape(v).len();
            let rest: Vec<usize> = (rank - k..rank - 1).collect();
            v = over_dims(b, v, &rest, |b, w| c2c_trailing(b, w, k - 1, false));
        }
        // IRFFT reads exactly n/2+1 values of the last dim: trim, or pad with zeros.
        let shape = b.shape(v);
        let last = shape.len() - 1;
        if have > half {
            let mut limit = shape.clone();
            limit[last] = half;
            v = b.slice(v, &vec![0; shape.len()], &limit, &vec![1; shape.len()]);
        } else if have < half {
            let mut hi = vec![0; shape.len()];
            hi[last] = half - have;
            let z = b.constant(b.dtype(v), 0.0);
            v = b.pad(v, z, &vec![0; shape.len()], &hi, &vec![0; shape.len()]);
        }
        fft_trailing(b, v, FftKind::Irfft, &[last_size])
    });
    // The k-1 inverse complex FFTs divided by their sizes already, as the IRFFT by its own:
    // one scale for all.
    Ok(vec![Out::T(fft_scale(c.b, y, norm, false, n)?)])
}
