//! Reductions, scans and softmax.

use super::{input, is_nan, opmath};
use crate::promote::torch_name;
use crate::shape::{numel, reduce_dims, reduced_shape, wrap_dim};
use crate::{user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value};
use stablehlo::{CmpDir, ReduceKind};

/// The dims argument of a reduction (`dim` as int, int[] or None) resolved on `t`.
fn dims_of(c: &Ctx, t: &TensorArg) -> LResult<Vec<i64>> {
    let d = c.args.opt_ints("dim");
    reduce_dims(d.as_deref(), t.shape.len())
}

/// Reduces `x` over `dims` and reshapes to the keepdim shape if asked.
pub fn reduce_keep(
    b: &mut Builder,
    x: Value,
    dims: &[i64],
    kind: ReduceKind,
    keepdim: bool,
) -> Value {
    let shape = b.shape(x);
    let r = b.reduce(x, dims, kind);
    b.reshape(r, &reduced_shape(&shape, dims, keepdim))
}

/// `sum(x, dims)` reshaped for broadcasting back over `x` (keepdim form).
pub fn sum_keep(b: &mut Builder, x: Value, dims: &[i64]) -> Value {
    reduce_keep(b, x, dims, ReduceKind::Sum, true)
}

/// Broadcasts a keepdim-shaped value back to `shape`.
pub fn expand_back(b: &mut Builder, x: Value, shape: &[i64]) -> Value {
    b.broadcast_to(x, shape)
}

/// The accumulation dtype of sum/prod/cumsum: the `dtype` argument, or int64 for integers.
fn acc_dtype(c: &Ctx, t: &TensorArg) -> DType {
    c.args
        .opt_dtype("dtype")
        .unwrap_or(if t.dtype.is_float() || t.dtype.is_complex() {
            t.dtype
        } else {
            DType::I64
        })
}

fn sum_like(c: &mut Ctx, kind: ReduceKind) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dims = if c.args.has("dim") {
        dims_of(c, &t)?
    } else {
        (0..t.shape.len() as i64).collect()
    };
    let keep = c.args.bool_or("keepdim", false);
    let dt = acc_dtype(c, &t);
    // Half sums accumulate in f32 and round once, like the CPU kernel; prod rounds per step.
    let cd = if kind == ReduceKind::Sum {
        opmath(dt)
    } else {
        dt
    };
    let x = c.b.convert(t.value, cd);
    let r = reduce_keep(c.b, x, &dims, kind, keep);
    Ok(vec![Out::T(c.b.convert(r, dt))])
}

fn mean(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dt = c.args.opt_dtype("dtype").unwrap_or(t.dtype);
    if !dt.is_float() && !dt.is_complex() {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "mean(): could not infer output dtype. Input dtype must be either a floating point or complex dtype. Got: {}",
                torch_name(dt)
            ),
        );
    }
    let dims = if c.args.has("dim") {
        dims_of(c, &t)?
    } else {
        (0..t.shape.len() as i64).collect()
    };
    let keep = c.args.bool_or("keepdim", false);
    let x = c.b.convert(t.value, opmath(dt));
    let s = reduce_keep(c.b, x, &dims, ReduceKind::Sum, keep);
    let k = c.b.count(x, &dims, s);
    let m = c.b.div(s, k);
    Ok(vec![Out::T(c.b.convert(m, dt))])
}

fn amax_amin(c: &mut Ctx, kind: ReduceKind) -> LResult<Vec<Out>> {
    let t = input(c)?;
    c.require_out_dtype(t.dtype, |o| {
        format!(
            "Expected the dtype for input and out to match, but got {} for input's dtype and {} for out's dtype.",
            torch_name(t.dtype),
            torch_name(o)
        )
    })?;
    let dims = dims_of(c, &t)?;
    check_nonempty(c, &t, &dims)?;
    let keep = c.args.bool_or("keepdim", false);
    Ok(vec![Out::T(reduce_keep(c.b, t.value, &dims, kind, keep))])
}

fn check_nonempty(c: &Ctx, t: &TensorArg, dims: &[i64]) -> LResult<()> {
    let empty = if t.shape.is_empty() {
        false
    } else {
        dims.iter().any(|d| t.shape[*d as usize] == 0)
    };
    if empty {
        let name = c.op.trim_start_matches("aten::");
        return user_err(
            ErrorKind::Index,
            format!(
                "{name}(): Expected reduction dim {} to have non-zero size.",
                dims.iter()
                    .find(|d| t.shape[**d as usize] == 0)
                    .copied()
                    .unwrap_or(0)
            ),
        );
    }
    Ok(())
}

/// (values, indices) of the max or min along one dim; ties pick the first index and
/// NaN counts as the extreme, as in PyTorch.
fn arg_reduce(b: &mut Builder, x: Value, dim: usize, is_max: bool) -> (Value, Value) {
    let shape = b.shape(x);
    let dt = b.dtype(x);
    let idx = b.iota(DType::I64, &shape, dim);
    let init_v = b.constant(
        dt,
        if is_max {
            stablehlo_lowest(dt)
        } else {
            stablehlo_highest(dt)
        },
    );
    let init_i = b.constant_i64(DType::I64, 0);
    let r = b.reduce_with(&[x, idx], &[init_v, init_i], &[dim as i64], |b, a| {
        // a = [acc_v, acc_i, x_v, x_i]
        let (av, ai, bv, bi) = (a[0], a[1], a[2], a[3]);
        let dir = if is_max { CmpDir::Gt } else { CmpDir::Lt };
        let better = b.compare(av, bv, dir);
        let eq = b.compare(av, bv, CmpDir::Eq);
        let a_nan = b.compare(av, av, CmpDir::Ne);
        let b_nan = b.compare(bv, bv, CmpDir::Ne);
        let b_not_nan = b.not(b_nan);
        let t1 = b.and(a_nan, b_not_nan);
        let t2 = b.and(b_not_nan, better);
        let both_nan = b.and(a_nan, b_nan);
        let tie = b.or(eq, both_nan);
        let lower = b.compare(ai, bi, CmpDir::Lt);
        let t3 = b.and(tie, lower);
        let pick = b.or(t1, t2);
        let pick = b.or(pick, t3);
        let v = b.select(pick, av, bv);
        let i = b.select(pick, ai, bi);
        vec![v, i]
    });
    (r[0], r[1])
}

fn stablehlo_lowest(d: DType) -> f64 {
    stablehlo::ReduceKind::Max.init(d)
}
fn stablehlo_highest(d: DType) -> f64 {
    stablehlo::ReduceKind::Min.init(d)
}

/// max/min: full reduction (`max(self)`) or along a dim with indices (`max.dim`).
fn max_min(c: &mut Ctx, is_max: bool) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let kind = if is_max {
        ReduceKind::Max
    } else {
        ReduceKind::Min
    };
    if c.args.has("other") {
        // max.other is maximum.
        let o = c.args.tensor("other")?.clone();
        let (dt, shape) = super::common(&[super::Opnd::T(t.clone()), super::Opnd::T(o.clone())])?;
        let x = super::mat(c.b, &super::Opnd::T(t), dt, &shape);
        let y = super::mat(c.b, &super::Opnd::T(o), dt, &shape);
        let r = if is_max { c.b.max(x, y) } else { c.b.min(x, y) };
        return Ok(vec![Out::T(r)]);
    }
    if !c.args.has("dim") {
        if t.shape.iter().product::<i64>() == 0 {
            let name = if is_max { "max" } else { "min" };
            return user_err(
                ErrorKind::Runtime,
                format!("{name}(): Expected reduction dim to be specified for input.numel() == 0. Specify the reduction dim with the 'dim' argument."),
            );
        }
        let dims: Vec<i64> = (0..t.shape.len() as i64).collect();
        return Ok(vec![Out::T(reduce_keep(c.b, t.value, &dims, kind, false))]);
    }
    let dim = wrap_dim(c.args.int("dim")?, t.shape.len())?;
    let keep = c.args.bool_or("keepdim", false);
    check_nonempty(c, &t, &[dim as i64])?;
    let x = c.b.reshape(t.value, &nonscalar(&t.shape));
    let (v, i) = arg_reduce(c.b, x, dim, is_max);
    let out_shape = reduced_shape(&t.shape, &[dim as i64], keep);
    let v = c.b.reshape(v, &out_shape);
    let i = c.b.reshape(i, &out_shape);
    Ok(vec![Out::T(v), Out::T(i)])
}

fn nonscalar(s: &[i64]) -> Vec<i64> {
    if s.is_empty() {
        vec![1]
    } else {
        s.to_vec()
    }
}

fn argmax_argmin(c: &mut Ctx, is_max: bool) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let keep = c.args.bool_or("keepdim", false);
    let (x, dim, out_shape) = match c.args.opt_int("dim") {
        Some(d) => {
            let dim = wrap_dim(d, t.shape.len())?;
            check_nonempty(c, &t, &[dim as i64])?;
            let x = c.b.reshape(t.value, &nonscalar(&t.shape));
            (x, dim, reduced_shape(&t.shape, &[dim as i64], keep))
        }
        None => {
            if t.shape.iter().product::<i64>() == 0 {
                let name = if is_max { "argmax" } else { "argmin" };
                return user_err(
                    ErrorKind::Runtime,
                    format!(
                        "{name}(): Expected reduction dim to be specified for input.numel() == 0."
                    ),
                );
            }
            let n = t.shape.iter().product::<i64>();
            let x = c.b.reshape(t.value, &[n]);
            let out = if keep { vec![1; t.shape.len()] } else { vec![] };
            (x, 0, out)
        }
    };
    let (_, i) = arg_reduce(c.b, x, dim, is_max);
    Ok(vec![Out::T(c.b.reshape(i, &out_shape))])
}

/// var/std with `correction` (or legacy `unbiased`); `var_mean`/`std_mean` return both.
fn var_std(c: &mut Ctx, take_sqrt: bool, with_mean: bool) -> LResult<Vec<Out>> {
    let t = input(c)?;
    if !t.dtype.is_float() {
        return user_err(
            ErrorKind::Runtime,
            "std and var only support floating point and complex dtypes",
        );
    }
    let dims = dims_of(c, &t)?;
    let keep = c.args.bool_or("keepdim", false);
    let correction = match c.args.opt_scalar("correction") {
        Some(s) => s.as_f64(),
        None => {
            if c.args.bool_or("unbiased", true) {
                1.0
            } else {
                0.0
            }
        }
    };
    let b = &mut *c.b;
    let x = b.convert(t.value, opmath(t.dtype));
    let s = sum_keep(b, x, &dims);
    let nk = b.count(x, &dims, s);
    let m = b.div(s, nk);
    let mb = expand_back(b, m, &t.shape);
    let d = b.sub(x, mb);
    let d2 = b.mul(d, d);
    let ss = reduce_keep(b, d2, &dims, ReduceKind::Sum, keep);
    let den = if b.padded() {
        let n = b.count(x, &dims, ss);
        let corr = b.splat(ss, correction);
        let den = b.sub(n, corr);
        let zero = b.splat(ss, 0.0);
        b.max(den, zero)
    } else {
        let n: i64 = dims.iter().map(|d| t.shape[*d as usize]).product();
        b.splat(ss, (n as f64 - correction).max(0.0))
    };
    let v = b.div(ss, den);
    let v = if take_sqrt { b.sqrt(v) } else { v };
    let mut outs = vec![Out::T(b.convert(v, t.dtype))];
    if with_mean {
        let m = b.reshape(m, &reduced_shape(&t.shape, &dims, keep));
        outs.push(Out::T(b.convert(m, t.dtype)));
    }
    Ok(outs)
}

fn logsumexp(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dims = dims_of(c, &t)?;
    let keep = c.args.bool_or("keepdim", false);
    let b = &mut *c.b;
    let x = b.convert(t.value, crate::promote::to_float(t.dtype));
    let m = reduce_keep(b, x, &dims, ReduceKind::Max, true);
    // An all -inf slice keeps max -inf; subtracting it would give NaN.
    let inf = b.splat(m, f64::INFINITY);
    let am = b.abs(m);
    let fin = b.compare(am, inf, CmpDir::Ne);
    let zero = b.splat(m, 0.0);
    let m = b.select(fin, m, zero);
    let mb = expand_back(b, m, &t.shape);
    let d = b.sub(x, mb);
    let e = b.exp(d);
    let s = sum_keep(b, e, &dims);
    let l = b.log(s);
    let r = b.add(l, m);
    Ok(vec![Out::T(
        b.reshape(r, &reduced_shape(&t.shape, &dims, keep)),
    )])
}

fn all_any(c: &mut Ctx, kind: ReduceKind) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dims = if c.args.has("dim") {
        dims_of(c, &t)?
    } else {
        (0..t.shape.len() as i64).collect()
    };
    let keep = c.args.bool_or("keepdim", false);
    let x = c.b.convert(t.value, DType::Bool);
    let r = reduce_keep(c.b, x, &dims, kind, keep);
    // uint8 inputs keep uint8 results, as in PyTorch.
    let r = if t.dtype == DType::U8 {
        c.b.convert(r, DType::U8)
    } else {
        r
    };
    Ok(vec![Out::T(r)])
}

/// Inclusive scan along `dim` with a builtin combiner (reduce_window over a prefix).
pub fn scan(b: &mut Builder, x: Value, dim: usize, kind: ReduceKind) -> Value {
    let shape = b.shape(x);
    if shape.is_empty() {
        return x;
    }
    let n = shape[dim];
    let dt = b.dtype(x);
    let init = b.constant(dt, kind.init(dt));
    let mut window = vec![1; shape.len()];
    window[dim] = n.max(1);
    let strides = vec![1; shape.len()];
    let mut pad = vec![(0, 0); shape.len()];
    pad[dim] = ((n - 1).max(0), 0);
    b.reduce_window(x, init, kind, &window, &strides, &pad)
}

fn cumulative(c: &mut Ctx, kind: ReduceKind) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dim = wrap_dim(c.args.int("dim")?, t.shape.len())?;
    let dt = acc_dtype(c, &t);
    // Half types accumulate in f32, rounding each output once (the CPU's acc_type).
    let x = c.b.convert(t.value, opmath(dt));
    let r = scan(c.b, x, dim, kind);
    Ok(vec![Out::T(c.b.convert(r, dt))])
}

/// Softmax along `dim`, computed in f32 for half inputs; the result stays f32 when
/// `half_to_float`, else rounds once to the input dtype.
fn softmax(c: &mut Ctx, log: bool) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dim = wrap_dim(c.args.int("dim")?, t.shape.len())? as i64;
    let out_dt = if c.args.bool_or("half_to_float", false) {
        DType::F32
    } else {
        t.dtype
    };
    let b = &mut *c.b;
    let x = b.convert(t.value, opmath(t.dtype));
    if t.shape.is_empty() {
        let r = if log {
            b.splat(x, 0.0)
        } else {
            b.splat(x, 1.0)
        };
        return Ok(vec![Out::T(b.convert(r, out_dt))]);
    }
    let m = reduce_keep(b, x, &[dim], ReduceKind::Max, true);
    let mb = expand_back(b, m, &t.shape);
    let d = b.sub(x, mb);
    let e = b.exp(d);
    let s = sum_keep(b, e, &[dim]);
    let sb = expand_back(b, s, &t.shape);
    let r = if log {
        let l = b.log(sb);
        b.sub(d, l)
    } else {
        b.div(e, sb)
    };
    Ok(vec![Out::T(b.convert(r, out_dt))])
}

fn softmax_backward(c: &mut Ctx, log: bool) -> LResult<Vec<Out>> {
    let g = c.args.tensor("grad_output")?.clone();
    let y = c.args.tensor("output")?.clone();
    let dim = wrap_dim(c.args.int("dim")?, y.shape.len())? as i64;
    let in_dt = c.args.opt_dtype("input_dtype").unwrap_or(g.dtype);
    let b = &mut *c.b;
    // In f32 for half types, rounding once at the end.
    let cd = opmath(y.dtype);
    let gy = b.convert(g.value, cd);
    let yv = b.convert(y.value, cd);
    let r = if y.shape.is_empty() {
        b.splat(gy, 0.0)
    } else if log {
        let s = sum_keep(b, gy, &[dim]);
        let sb = expand_back(b, s, &y.shape);
        let e = b.exp(yv);
        let t = b.mul(e, sb);
        b.sub(gy, t)
    } else {
        let p = b.mul(gy, yv);
        let s = sum_keep(b, p, &[dim]);
        let sb = expand_back(b, s, &y.shape);
        let d = b.sub(gy, sb);
        b.mul(yv, d)
    };
    Ok(vec![Out::T(b.convert(r, in_dt))])
}

/// The ops of this family whose programs may serve a range of sizes (see
/// `super::serves_sizes`).
fn count_nonzero(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dims = reduce_dims(c.args.opt_ints("dim").as_deref(), t.shape.len())?;
    let b = &mut *c.b;
    let z = b.splat(t.value, 0.0);
    let nz = b.compare(t.value, z, CmpDir::Ne);
    let nz = b.convert(nz, DType::I64);
    Ok(vec![Out::T(b.reduce(nz, &dims, ReduceKind::Sum))])
}

fn aminmax(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    c.require_out_dtype_cpp(t.dtype)?;
    let keep = c.args.bool_or("keepdim", false);
    let dims = match c.args.opt_int("dim") {
        Some(d) => {
            let d = wrap_dim(d, t.shape.len())?;
            if !t.shape.is_empty() && t.shape[d] == 0 {
                return user_err(
                    ErrorKind::Index,
                    format!("aminmax: Expected reduction dim {d} to have non-zero size."),
                );
            }
            if t.shape.is_empty() {
                vec![]
            } else {
                vec![d as i64]
            }
        }
        None => {
            if numel(&t.shape) == 0 {
                return user_err(
                    ErrorKind::Runtime,
                    "aminmax(): cannot compute aminmax over an empty dimension as the operation has no identity.",
                );
            }
            (0..t.shape.len() as i64).collect()
        }
    };
    let b = &mut *c.b;
    let mn = reduce_keep(b, t.value, &dims, ReduceKind::Min, keep);
    let mx = reduce_keep(b, t.value, &dims, ReduceKind::Max, keep);
    Ok(vec![Out::T(mn), Out::T(mx)])
}

fn nansum(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let dims = reduce_dims(c.args.opt_ints("dim").as_deref(), t.shape.len())?;
    let keep = c.args.bool_or("keepdim", false);
    let dt = c.args.opt_dtype("dtype").unwrap_or(if t.dtype.is_float() {
        t.dtype
    } else {
        DType::I64
    });
    let b = &mut *c.b;
    let x = b.convert(t.value, dt);
    let x = if dt.is_float() {
        let nan = is_nan(b, x);
        let z = b.splat(x, 0.0);
        b.select(nan, z, x)
    } else {
        x
    };
    Ok(vec![Out::T(reduce_keep(
        b,
        x,
        &dims,
        ReduceKind::Sum,
        keep,
    ))])
}

pub const SERVES_SIZES: &[&str] = &[
    "aten::_softmax",
    "aten::_log_softmax",
    "aten::_softmax_backward_data",
    "aten::_log_softmax_backward_data",
    "aten::sum",
    "aten::mean",
    "aten::var",
    "aten::std",
    "aten::var_mean",
    "aten::std_mean",
    "aten::amax",
    "aten::amin",
    "aten::argmax",
    "aten::argmin",
    "aten::max",
    "aten::min",
    "aten::prod",
    "aten::all",
    "aten::any",
    "aten::logsumexp",
];

pub const RULES: &[(&str, Rule)] = &[
    ("aten::sum", |c| sum_like(c, ReduceKind::Sum)),
    ("aten::prod", |c| sum_like(c, ReduceKind::Prod)),
    ("aten::mean", mean),
    ("aten::amax", |c| amax_amin(c, ReduceKind::Max)),
    ("aten::amin", |c| amax_amin(c, ReduceKind::Min)),
    ("aten::max", |c| max_min(c, true)),
    ("aten::min", |c| max_min(c, false)),
    ("aten::argmax", |c| argmax_argmin(c, true)),
    ("aten::argmin", |c| argmax_argmin(c, false)),
    ("aten::var", |c| var_std(c, false, false)),
    ("aten::std", |c| var_std(c, true, false)),
    ("aten::var_mean", |c| var_std(c, false, true)),
    ("aten::std_mean", |c| var_std(c, true, true)),
    ("aten::logsumexp", logsumexp),
    ("aten::all", |c| all_any(c, ReduceKind::And)),
    ("aten::any", |c| all_any(c, ReduceKind::Or)),
    ("aten::cumsum", |c| cumulative(c, ReduceKind::Sum)),
    ("aten::cumprod", |c| cumulative(c, ReduceKind::Prod)),
    ("aten::_softmax", |c| softmax(c, false)),
    ("aten::_log_softmax", |c| softmax(c, true)),
    ("aten::_softmax_backward_data", |c| {
        softmax_backward(c, false)
    }),
    ("aten::_log_softmax_backward_data", |c| {
        softmax_backward(c, true)
    }),
    ("aten::count_nonzero", count_nonzero),
    ("aten::aminmax", aminmax),
    ("aten::nansum", nansum),
];
