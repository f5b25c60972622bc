//! Indexing: index_select, gather, take, scatter (+ add/reduce), advanced indexing
//! (`index`, `index_put`), masked_fill/masked_scatter, embedding (+ dense backward),
//! index_add/copy/fill/reduce, put, and slice/select/diagonal scatter (+ the backward ops of
//! those views).
//!
//! Index values are range-checked on the device (`Ctx::check_range`): XLA's gather clamps
//! start indices into range and its scatter drops out-of-range updates, where PyTorch
//! raises. The runtime reads the check after the op (Debug), in the worker (Strict: the
//! next synchronization raises), after the flush (DeferAndFuse) or at the next host read
//! (compiled graphs), and raises PyTorch's error type and message. Every check that needs
//! only shapes and dtypes raises at dispatch. Errors that depend on index values in other
//! ways (a non-empty index into an empty dimension) decline, so the CPU fallback raises
//! them; so do boolean mask indices (data-dependent result shape).
//!
//! All index arithmetic is in i64. Ops with duplicate indices and no combiner (scatter,
//! index_put without accumulate, index_copy, put) keep one of the writes, as PyTorch does
//! not specify which either. Additive scatters of f16/bf16 accumulate in f32.

use crate::promote::{cpp_name, torch_name};
use stablehlo::{Builder, CmpDir, ReduceKind, Value};

use crate::args::Scalar;
use crate::rules::reduce::scan;
use crate::rules::{opnd, Opnd};
use crate::shape::{broadcast_all, broadcast_shapes, numel, shape_str, wrap_dim};
use crate::{decline, user_err, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg};

use ErrorKind::{Index as IndexErr, Runtime};

// ---------------------------------------------------------------------------------------
// Shared helpers

/// How a scatter merges an update into the current element.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Comb {
    Replace,
    Red(ReduceKind),
}

fn combine(b: &mut Builder, how: Comb, cur: Value, upd: Value) -> Value {
    match how {
        Comb::Replace => upd,
        Comb::Red(k) => {
            let dt = b.dtype(cur);
            let name = match (k, dt) {
                (ReduceKind::Max, DType::Bool) => "stablehlo.or",
                (ReduceKind::Min, DType::Bool) => "stablehlo.and",
                _ => k.op_name(dt),
            };
            let r = b.binary(name, cur, upd);
            if dt.is_float() && matches!(k, ReduceKind::Max | ReduceKind::Min) {
                // NaN wins, as in PyTorch (XLA's CPU max/min may drop it).
                let cn = b.compare(cur, cur, CmpDir::Ne);
                let un = b.compare(upd, upd, CmpDir::Ne);
                let r = b.select(un, upd, r);
                return b.select(cn, cur, r);
            }
            r
        }
    }
}

/// CPU kernels do not exist for these; the fallback raises PyTorch's own error.
fn supported(d: DType) -> LResult<()> {
    if matches!(d, DType::U32 | DType::U64) {
        return decline(format!("indexing ops on {}", torch_name(d)));
    }
    Ok(())
}

fn is_index_dtype(d: DType) -> bool {
    matches!(d, DType::I32 | DType::I64)
}

/// A shape as PyTorch's scatter/gather checks see it: 0-d counts as `[1]`.
fn nonempty(shape: &[i64]) -> Vec<i64> {
    if shape.is_empty() {
        vec![1]
    } else {
        shape.to_vec()
    }
}

fn zeros(b: &mut Builder, dt: DType, shape: &[i64]) -> Value {
    b.full(dt, shape, 0.0)
}

/// `i < 0 ? i + size : i` (Python-style negative indices).
fn wrap_neg(b: &mut Builder, i: Value, size: i64) -> Value {
    let z = b.splat(i, 0.0);
    let neg = b.compare(i, z, CmpDir::Lt);
    let n = b.splat(i, size as f64);
    let w = b.add(i, n);
    b.select(neg, w, i)
}

/// PyTorch's message for an index outside `[0, size)` (or `[-size, size)`) of `dim`.
fn out_of_bounds(dim: usize, size: i64) -> String {
    format!("index {{index}} is out of bounds for dimension {dim} with size {size}")
}

/// Full coordinates `[S..., rank]` of the elements an index tensor `idx` (shape S, i64)
/// addresses along `dim`: `idx` in column `dim`, the element's own position elsewhere.
fn dim_coords(b: &mut Builder, idx: Value, dim: usize) -> Value {
    let shape = b.shape(idx);
    let r = shape.len();
    let mut col_shape = shape.clone();
    col_shape.push(1);
    let cols: Vec<Value> = (0..r)
        .map(|d| {
            let v = if d == dim {
                idx
            } else {
                b.iota(DType::I64, &shape, d)
            };
            b.reshape(v, &col_shape)
        })
        .collect();
    b.concatenate(&cols, r)
}

/// Elements of `x` at full coordinates `[S..., rank(x)]`; the result has shape S.
fn point_gather(b: &mut Builder, x: Value, coords: Value) -> Value {
    let r = b.rank(x);
    let ivd = b.rank(coords) as i64 - 1;
    let all: Vec<i64> = (0..r as i64).collect();
    b.gather(x, coords, &[], &all, &all, ivd, &vec![1; r])
}

/// Scatters `upd` (shape S) into `x` at full coordinates `[S..., rank(x)]`.
fn point_scatter(b: &mut Builder, x: Value, coords: Value, upd: Value, how: Comb) -> Value {
    let r = b.rank(x);
    let ivd = b.rank(coords) as i64 - 1;
    let all: Vec<i64> = (0..r as i64).collect();
    b.scatter(x, coords, upd, &[], &all, &all, ivd, move |b, c, u| {
        combine(b, how, c, u)
    })
}

/// Scatters slices of `upd` (x's shape with `n` at `dim`) into `x` at `idx[k]` along `dim`
/// (`idx`: `[n]` i64).
fn dim_scatter(b: &mut Builder, x: Value, dim: usize, idx: Value, upd: Value, how: Comb) -> Value {
    let r = b.rank(x);
    let n = b.shape(idx)[0];
    let i = b.reshape(idx, &[n, 1]);
    let win: Vec<i64> = (0..r as i64).filter(|d| *d != dim as i64).collect();
    let d = [dim as i64];
    b.scatter(x, i, upd, &win, &d, &d, 1, move |b, c, u| {
        combine(b, how, c, u)
    })
}

/// `a / b` rounding down (integer division in C truncates; `b` is positive here).
fn floor_div_pos(b: &mut Builder, a: Value, d: Value) -> Value {
    let q = b.div(a, d);
    let r = b.binary("stablehlo.remainder", a, d);
    let z = b.splat(r, 0.0);
    let neg = b.compare(r, z, CmpDir::Lt);
    let one = b.splat(q, 1.0);
    let q1 = b.sub(q, one);
    b.select(neg, q1, q)
}

/// Runs an additive scatter `f(x, upd)` in f32 for half-precision operands: one rounding
/// at the end instead of one per update (PyTorch's CPU kernels round per update, so the
/// last bits can differ from them either way).
fn widened(
    b: &mut Builder,
    x: Value,
    upd: Value,
    additive: bool,
    f: impl FnOnce(&mut Builder, Value, Value) -> Value,
) -> Value {
    let dt = b.dtype(x);
    if !additive || !matches!(dt, DType::F16 | DType::BF16) {
        return f(b, x, upd);
    }
    let (xw, uw) = (b.convert(x, DType::F32), b.convert(upd, DType::F32));
    let r = f(b, xw, uw);
    b.convert(r, dt)
}

/// A scatter-style reduction, as `scatter_reduce`/`index_reduce` compute it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Comb(Comb),
    Mean,
}

/// Applies `mode` with `scatter(operand, updates, comb)` (which knows where updates go).
/// Without `include_self`, elements that receive an update start from the identity.
fn reduce_into(
    b: &mut Builder,
    x: Value,
    upd: Value,
    mode: Mode,
    include_self: bool,
    scatter: &dyn Fn(&mut Builder, Value, Value, Comb) -> Value,
) -> Value {
    let additive = matches!(mode, Mode::Mean | Mode::Comb(Comb::Red(ReduceKind::Sum)));
    if additive && matches!(b.dtype(x), DType::F16 | DType::BF16) {
        return widened(b, x, upd, true, |b, x, u| {
            reduce_into(b, x, u, mode, include_self, scatter)
        });
    }
    let ty = b.ty(x).clone();
    let dt = ty.dtype;
    let base = if include_self {
        x
    } else {
        let ident = match mode {
            Mode::Comb(Comb::Red(k)) => k.init(dt),
            _ => 0.0,
        };
        if mode == Mode::Comb(Comb::Replace) {
            x
        } else {
            let none = b.full(DType::Bool, &ty.shape, 0.0);
            let hit = b.full(DType::Bool, &b.shape(upd), 1.0);
            let touched = scatter(b, none, hit, Comb::Replace);
            let id = b.full(dt, &ty.shape, ident);
            b.select(touched, id, x)
        }
    };
    match mode {
        Mode::Comb(how) => scatter(b, base, upd, how),
        Mode::Mean => {
            let sum = scatter(b, base, upd, Comb::Red(ReduceKind::Sum));
            let start = b.full(dt, &ty.shape, if include_self { 1.0 } else { 0.0 });
            let ones = b.full(dt, &b.shape(upd), 1.0);
            let count = scatter(b, start, ones, Comb::Red(ReduceKind::Sum));
            let zero = b.splat(count, 0.0);
            let empty = b.compare(count, zero, CmpDir::Eq);
            let one = b.splat(count, 1.0);
            let count = b.select(empty, one, count);
            if dt.is_float() {
                b.div(sum, count)
            } else {
                floor_div_pos(b, sum, count)
            }
        }
    }
}

/// PyTorch refuses to fill with a number the dtype cannot hold.
fn check_fill_value(dt: DType, s: Scalar) -> LResult<()> {
    let (name, lo, hi): (&str, f64, f64) = match dt {
        DType::U8 => ("uint8_t", 0.0, 255.0),
        DType::I8 => ("int8_t", -128.0, 127.0),
        DType::I16 => ("int16_t", -32768.0, 32767.0),
        DType::I32 => ("int", -2147483648.0, 2147483647.0),
        DType::I64 => ("int64_t", -9.223372036854776e18, 9.223372036854776e18),
        DType::F16 => ("c10::Half", -65504.0, 65504.0),
        DType::BF16 => (
            "c10::BFloat16",
            -3.3895313892515355e38,
            3.3895313892515355e38,
        ),
        DType::F32 => ("float", -3.4028234663852886e38, 3.4028234663852886e38),
        _ => return Ok(()),
    };
    let bad = match s {
        Scalar::Bool(_) => false,
        Scalar::Int(i) if dt == DType::U8 => !(-255..=255).contains(&i),
        Scalar::Int(_) if dt == DType::I64 => false,
        Scalar::Int(i) => (i as f64) < lo || (i as f64) > hi,
        // Floats into integers: truncation must fit (and negative never fits unsigned).
        Scalar::Float(f) if dt.is_int() => {
            f.is_nan() || f < lo || f >= hi + 1.0 || (dt == DType::U8 && f < 0.0)
        }
        Scalar::Float(f) => f.is_finite() && (f < lo || f > hi),
        // A real type cannot hold an imaginary part (c10's checked_convert).
        Scalar::Complex(re, im) => im != 0.0 || re.is_finite() && (re < lo || re > hi),
    };
    if bad {
        return user_err(
            Runtime,
            format!("value cannot be converted to type {name} without overflow"),
        );
    }
    Ok(())
}

/// A number as the `dt` element it converts to: negative ints wrap around for uint8
/// (MLIR rejects negative unsigned literals).
fn scalar_as(dt: DType, s: Scalar) -> f64 {
    match (dt, s) {
        (DType::U8, Scalar::Int(i)) => i.rem_euclid(256) as f64,
        _ => s.as_f64(),
    }
}

/// A fill value (Scalar, or 0-d tensor) as a 0-d value of `dt`; `op` names the op in the
/// 0-d error message.
fn fill_value(c: &mut Ctx, name: &str, dt: DType, op: &str) -> LResult<Value> {
    match opnd(c, name)? {
        Opnd::T(v) if v.dtype.is_complex() && !dt.is_complex() => {
            // Whether the imaginary part is 0 (else PyTorch's overflow error) is data.
            crate::decline(format!("{op}: a complex value into a real tensor"))
        }
        Opnd::T(v) => {
            if !v.shape.is_empty() {
                return user_err(
                    Runtime,
                    format!(
                        "{op} only supports a 0-dimensional value tensor, but got tensor with {} dimension(s).",
                        v.shape.len()
                    ),
                );
            }
            Ok(c.b.convert(v.value, dt))
        }
        Opnd::S(s) => {
            check_fill_value(dt, s)?;
            if dt.is_complex() {
                return Ok(super::full_scalar(c.b, dt, &[], s));
            }
            Ok(c.b.constant(dt, scalar_as(dt, s)))
        }
    }
}

fn expandable(from: &[i64], to: &[i64]) -> bool {
    from.len() <= to.len()
        && from
            .iter()
            .rev()
            .zip(to.iter().rev())
            .all(|(f, t)| f == t || *f == 1)
}

// ---------------------------------------------------------------------------------------
// index_select, gather, take, embedding

fn index_select(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let index = c.args.tensor("index")?.clone();
    let dim = wrap_dim(c.args.int("dim")?, t.shape.len())?;
    if index.shape.len() > 1 {
        return user_err(IndexErr, "index_select(): Index is supposed to be a vector");
    }
    if !is_index_dtype(index.dtype) {
        return user_err(
            Runtime,
            "index_select(): Expected dtype int32 or int64 for index",
        );
    }
    supported(t.dtype)?;
    let n = numel(&index.shape);
    if t.shape.is_empty() {
        if n != 1 {
            return user_err(
                Runtime,
                format!("index_select(): Index to scalar can have only 1 value, got {n} value(s)"),
            );
        }
        return Ok(vec![Out::T(t.value)]);
    }
    if t.shape[dim] == 0 && n > 0 {
        return user_err(
            Runtime,
            "index_select(): self indexing axis dim should be positive",
        );
    }
    c.check_index_into(
        index.value,
        t.value,
        dim,
        IndexErr,
        "index out of range in self".into(),
    );
    let b = &mut *c.b;
    let idx = b.convert(index.value, DType::I64);
    Ok(vec![Out::T(select_rows(b, t.value, dim, idx))])
}

/// `x.index_select(dim, idx)` for a 1-d (or 0-d) i64 `idx`, no checks.
fn select_rows(b: &mut Builder, x: Value, dim: usize, idx: Value) -> Value {
    let mut shape = b.shape(x);
    let n = numel(&b.shape(idx));
    shape[dim] = n;
    if numel(&shape) == 0 {
        return zeros(b, b.dtype(x), &shape);
    }
    let i = b.reshape(idx, &[n, 1]);
    let offset: Vec<i64> = (0..shape.len() as i64)
        .filter(|d| *d != dim as i64)
        .collect();
    let mut sizes = b.shape(x);
    sizes[dim] = 1;
    let d = [dim as i64];
    b.gather(x, i, &offset, &d, &d, 1, &sizes)
}

fn gather(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    c.require_out_dtype_cpp(t.dtype)?;
    let index = c.args.tensor("index")?.clone();
    let dim = wrap_dim(c.args.int("dim")?, t.shape.len())?;
    let n = numel(&index.shape);
    if n == 0 {
        return Ok(vec![Out::T(zeros(c.b, t.dtype, &index.shape))]);
    }
    if !is_index_dtype(index.dtype) {
        return user_err(Runtime, "gather(): Expected dtype int32/int64 for index");
    }
    let (ts, is) = (nonempty(&t.shape), nonempty(&index.shape));
    if ts.len() != is.len() {
        return user_err(
            Runtime,
            "Index tensor must have the same number of dimensions as input tensor",
        );
    }
    if let Some(d) = (0..ts.len()).find(|d| *d != dim && is[*d] > ts[*d]) {
        return user_err(
            Runtime,
            format!(
                "Size does not match at dimension {d} expected index {} to be no larger than self {} apart from dimension {dim}",
                shape_str(&index.shape),
                shape_str(&t.shape)
            ),
        );
    }
    if ts[dim] == 0 {
        return decline("gather from an empty dimension (PyTorch raises an index error)");
    }
    supported(t.dtype)?;
    c.check_range(
        index.value,
        0,
        ts[dim],
        Runtime,
        out_of_bounds(dim, ts[dim]),
    );
    let b = &mut *c.b;
    let x = b.reshape(t.value, &ts);
    let i = b.convert(index.value, DType::I64);
    let i = b.reshape(i, &is);
    let co = dim_coords(b, i, dim);
    let g = point_gather(b, x, co);
    Ok(vec![Out::T(b.reshape(g, &index.shape))])
}

fn take(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let index = c.args.tensor("index")?.clone();
    if index.dtype != DType::I64 {
        return user_err(
            Runtime,
            format!(
                "take(): Expected a long tensor for index, but got {}",
                torch_name(index.dtype)
            ),
        );
    }
    let (n, m) = (numel(&t.shape), numel(&index.shape));
    if n == 0 && m != 0 {
        return user_err(IndexErr, "take(): tried to take from an empty tensor");
    }
    supported(t.dtype)?;
    if m == 0 {
        return Ok(vec![Out::T(zeros(c.b, t.dtype, &index.shape))]);
    }
    let msg = format!("out of range: tried to access index {{index}} on a tensor of {n} elements.");
    c.check_range(index.value, -n, n, IndexErr, msg);
    let b = &mut *c.b;
    let flat = b.reshape(t.value, &[n]);
    let i = wrap_neg(b, index.value, n);
    let mut cs = index.shape.clone();
    cs.push(1);
    let co = b.reshape(i, &cs);
    Ok(vec![Out::T(point_gather(b, flat, co))])
}

fn check_embedding_indices(idx: &TensorArg, arg: &str, op: &str) -> LResult<()> {
    if !is_index_dtype(idx.dtype) {
        return user_err(
            Runtime,
            format!(
                "Expected tensor for argument {arg} 'indices' to have one of the following scalar types: Long, Int; but got torch.{}Tensor instead (while checking arguments for {op})",
                torch_name(idx.dtype)
            ),
        );
    }
    Ok(())
}

fn embedding(c: &mut Ctx) -> LResult<Vec<Out>> {
    let w = c.args.tensor("weight")?.clone();
    let idx = c.args.tensor("indices")?.clone();
    if w.shape.len() != 2 {
        return user_err(Runtime, "'weight' must be 2-D");
    }
    check_embedding_indices(&idx, "#1", "embedding")?;
    supported(w.dtype)?;
    c.check_index_into(
        idx.value,
        w.value,
        0,
        IndexErr,
        "index out of range in self".into(),
    );
    let b = &mut *c.b;
    let i = b.convert(idx.value, DType::I64);
    let i = b.reshape(i, &[numel(&idx.shape)]);
    let rows = select_rows(b, w.value, 0, i);
    let mut shape = idx.shape.clone();
    shape.push(w.shape[1]);
    Ok(vec![Out::T(b.reshape(rows, &shape))])
}

fn embedding_dense_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let g = c.args.tensor("grad_output")?.clone();
    let idx = c.args.tensor("indices")?.clone();
    let nw = c.args.int("num_weights")?;
    let pad = c.args.int("padding_idx")?;
    let scale = c.args.bool_or("scale_grad_by_freq", false);
    check_embedding_indices(&idx, "#2", "embedding_backward")?;
    supported(g.dtype)?;
    let Some(&d) = g.shape.last() else {
        return decline("embedding_dense_backward of a 0-d gradient");
    };
    let n = numel(&idx.shape);
    if numel(&g.shape) != n * d {
        return user_err(
            Runtime,
            format!(
                "shape '[{n}, {d}]' is invalid for input of size {}",
                numel(&g.shape)
            ),
        );
    }
    let b = &mut *c.b;
    if n == 0 || d == 0 || nw == 0 {
        return Ok(vec![Out::T(zeros(b, g.dtype, &[nw, d]))]);
    }
    // Half-precision gradients accumulate in f32 (as CUDA does; the CPU kernel rounds
    // after every add, so low-precision results differ from it in the last bits).
    let acc = if matches!(g.dtype, DType::F16 | DType::BF16) {
        DType::F32
    } else {
        g.dtype
    };
    let g2 = b.reshape(g.value, &[n, d]);
    let mut g2 = b.convert(g2, acc);
    let i = b.convert(idx.value, DType::I64);
    let i = b.reshape(i, &[n]);
    let i2 = b.reshape(i, &[n, 1]);
    if scale {
        // Each row's gradient is divided by how often its index occurs.
        let counts = zeros(b, DType::I64, &[nw]);
        let ones = b.full(DType::I64, &[n], 1.0);
        let counts = point_scatter(b, counts, i2, ones, Comb::Red(ReduceKind::Sum));
        let freq = point_gather(b, counts, i2);
        let freq = b.convert(freq, acc);
        let freq = b.broadcast_in_dim(freq, &[n, d], &[0]);
        g2 = b.div(g2, freq);
    }
    let p = b.full(DType::I64, &[n], pad as f64);
    let keep = b.compare(i, p, CmpDir::Ne);
    let keep = b.broadcast_in_dim(keep, &[n, d], &[0]);
    let z = b.splat(g2, 0.0);
    let g2 = b.select(keep, g2, z);
    let out = zeros(b, acc, &[nw, d]);
    let out = dim_scatter(b, out, 0, i, g2, Comb::Red(ReduceKind::Sum));
    Ok(vec![Out::T(b.convert(out, g.dtype))])
}

/// `embedding_renorm_`: rows of `self` named by `indices` whose `norm_type`-norm exceeds
/// `max_norm` are scaled to `max_norm` (each row once, however often it is named).
fn embedding_renorm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let w = c.args.tensor("self")?.clone();
    let idx = c.args.tensor("indices")?.clone();
    let max_norm = c.args.float("max_norm")?;
    let p = c.args.float("norm_type")?;
    if w.shape.len() != 2 {
        return user_err(
            Runtime,
            format!(
                "Expected 2-dimensional tensor, but got {}-dimensional tensor for argument #1 'self' (while checking arguments for embedding_renorm_)",
                w.shape.len()
            ),
        );
    }
    check_embedding_indices(&idx, "#2", "embedding_renorm_")?;
    if !w.dtype.is_float() {
        return decline("embedding_renorm_ of a non-float weight (PyTorch raises in norm)");
    }
    let (rows, n) = (w.shape[0], numel(&idx.shape));
    if n == 0 || numel(&w.shape) == 0 {
        return Ok(vec![Out::T(w.value)]);
    }
    let b = &mut *c.b;
    // Half weights: the norm is rounded to the weight dtype (as PyTorch's norm returns it),
    // the scaling runs in f32.
    let acc = if matches!(w.dtype, DType::F16 | DType::BF16) {
        DType::F32
    } else {
        w.dtype
    };
    let x = b.convert(w.value, acc);
    let a = b.abs(x);
    let norm = if p == f64::INFINITY {
        b.reduce(a, &[1], ReduceKind::Max)
    } else if p == f64::NEG_INFINITY {
        b.reduce(a, &[1], ReduceKind::Min)
    } else if p == 0.0 {
        let z = b.splat(a, 0.0);
        let nz = b.compare(a, z, CmpDir::Ne);
        let nz = b.convert(nz, acc);
        b.reduce(nz, &[1], ReduceKind::Sum)
    } else if p == 1.0 {
        b.reduce(a, &[1], ReduceKind::Sum)
    } else if p == 2.0 {
        let sq = b.mul(x, x);
        let s = b.reduce(sq, &[1], ReduceKind::Sum);
        b.sqrt(s)
    } else {
        let e = b.splat(a, p);
        let pw = b.binary("stablehlo.power", a, e);
        let s = b.reduce(pw, &[1], ReduceKind::Sum);
        let inv = b.splat(s, 1.0 / p);
        b.binary("stablehlo.power", s, inv)
    };
    let norm = b.convert(norm, w.dtype);
    let norm = b.convert(norm, acc);
    let mx = b.splat(norm, max_norm);
    let big = b.compare(norm, mx, CmpDir::Gt);
    let eps = b.splat(norm, 1e-7);
    let den = b.add(norm, eps);
    let scale = b.div(mx, den);
    // Rows named by the indices.
    let none = b.full(DType::Bool, &[rows], 0.0);
    let hit = b.full(DType::Bool, &[n], 1.0);
    let i = b.convert(idx.value, DType::I64);
    let co = b.reshape(i, &[n, 1]);
    let named = point_scatter(b, none, co, hit, Comb::Replace);
    let on = b.and(named, big);
    let one = b.splat(scale, 1.0);
    let scale = b.select(on, scale, one);
    let scale = b.broadcast_in_dim(scale, &w.shape, &[0]);
    let y = b.mul(x, scale);
    Ok(vec![Out::T(b.convert(y, w.dtype))])
}

// ---------------------------------------------------------------------------------------
// scatter, scatter_add, scatter_reduce

/// What a scatter writes: a tensor (its leading part) or a number.
enum Src {
    T(TensorArg),
    S(Scalar),
}

fn scatter_impl(c: &mut Ctx, src: Src, reduce: Option<&str>, new_names: bool) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let index = c.args.tensor("index")?.clone();
    let dim = wrap_dim(c.args.int("dim")?, t.shape.len())?;
    let include_self = c.args.bool_or("include_self", true);
    let n = numel(&index.shape);
    if n > 0 && !is_index_dtype(index.dtype) {
        return user_err(Runtime, "scatter(): Expected dtype int32/int64 for index");
    }
    if let Src::T(s) = &src {
        if s.dtype != t.dtype {
            return user_err(
                Runtime,
                "scatter(): Expected self.dtype to be equal to src.dtype",
            );
        }
    }
    let (ts, is) = (nonempty(&t.shape), nonempty(&index.shape));
    if n > 0 {
        if ts.len() != is.len() {
            return user_err(
                Runtime,
                "Index tensor must have the same number of dimensions as self tensor",
            );
        }
        let mut wrong = (0..ts.len()).any(|d| d != dim && is[d] > ts[d]);
        if let Src::T(s) = &src {
            if !wrong {
                for (d, id) in is.iter().enumerate() {
                    let size = if s.shape.is_empty() {
                        1
                    } else {
                        s.shape[wrap_dim(d as i64, s.shape.len())?]
                    };
                    if *id > size {
                        wrong = true;
                        break;
                    }
                }
            }
            if nonempty(&s.shape).len() != is.len() {
                return user_err(
                    Runtime,
                    "Index tensor must have the same number of dimensions as src tensor",
                );
            }
        }
        if wrong {
            let tail = match &src {
                Src::T(s) => format!(" and to be no larger size than src {}", shape_str(&s.shape)),
                Src::S(_) => String::new(),
            };
            return user_err(
                Runtime,
                format!(
                    "Expected index {} to be no larger than self {} apart from dimension {dim}{tail}",
                    shape_str(&index.shape),
                    shape_str(&t.shape)
                ),
            );
        }
    }
    let mode = match (reduce, new_names) {
        (None, _) => Mode::Comb(Comb::Replace),
        (Some("add"), false) | (Some("sum"), true) => Mode::Comb(Comb::Red(ReduceKind::Sum)),
        (Some("multiply"), false) | (Some("prod"), true) => Mode::Comb(Comb::Red(ReduceKind::Prod)),
        (Some("mean"), true) => Mode::Mean,
        (Some("amax"), true) => Mode::Comb(Comb::Red(ReduceKind::Max)),
        (Some("amin"), true) => Mode::Comb(Comb::Red(ReduceKind::Min)),
        (Some(_), false) => {
            return user_err(Runtime, "reduce argument must be either add or multiply.")
        }
        (Some(r), true) => {
            return user_err(
                Runtime,
                format!("reduce argument must be either sum, prod, mean, amax or amin, got {r}"),
            )
        }
    };
    if n == 0 {
        return Ok(vec![Out::T(t.value)]);
    }
    supported(t.dtype)?;
    if mode == Mode::Mean && t.dtype == DType::Bool {
        return decline("scatter_reduce mean of bool (not implemented by PyTorch)");
    }
    c.check_range(
        index.value,
        0,
        ts[dim],
        Runtime,
        out_of_bounds(dim, ts[dim]),
    );
    let b = &mut *c.b;
    let upd = match src {
        Src::T(s) => {
            let v = b.reshape(s.value, &nonempty(&s.shape));
            b.slice(v, &vec![0; is.len()], &is, &vec![1; is.len()])
        }
        Src::S(s) => {
            check_fill_value(t.dtype, s)?;
            b.full(t.dtype, &is, scalar_as(t.dtype, s))
        }
    };
    let x = b.reshape(t.value, &ts);
    let i = b.convert(index.value, DType::I64);
    let i = b.reshape(i, &is);
    let co = dim_coords(b, i, dim);
    let r = reduce_into(b, x, upd, mode, include_self, &|b, x, u, how| {
        point_scatter(b, x, co, u, how)
    });
    Ok(vec![Out::T(b.reshape(r, &t.shape))])
}

fn scatter(c: &mut Ctx) -> LResult<Vec<Out>> {
    let src = match c.args.opt_tensor("src") {
        Some(s) => Src::T(s.clone()),
        None => Src::S(c.args.scalar("value")?),
    };
    let reduce = c.args.opt_str("reduce").map(str::to_string);
    scatter_impl(c, src, reduce.as_deref(), false)
}

fn scatter_add(c: &mut Ctx) -> LResult<Vec<Out>> {
    let src = Src::T(c.args.tensor("src")?.clone());
    scatter_impl(c, src, Some("add"), false)
}

fn scatter_reduce(c: &mut Ctx) -> LResult<Vec<Out>> {
    let src = Src::T(c.args.tensor("src")?.clone());
    let reduce = c.args.str_or("reduce", "").to_string();
    scatter_impl(c, src, Some(&reduce), true)
}

// ---------------------------------------------------------------------------------------
// Advanced indexing: index, index_put

/// Advanced indexing of `self` by a list of optional index tensors, as a gather/scatter.
struct Adv {
    /// Indexed dims of self, increasing (= the columns of `idx`).
    dims: Vec<i64>,
    /// Coordinates `[B..., k]` (i64, negative indices wrapped).
    idx: Value,
    /// Rank of the broadcast index shape B.
    nb: usize,
    /// Positions of self's other dims in the result.
    offset: Vec<i64>,
    out_shape: Vec<i64>,
}

/// Where the result of `self[indices]` takes its dims from. Non-adjacent indexed dims put
/// the broadcast index dims first, adjacent ones put them in place (NumPy's rule).
fn advanced(c: &mut Ctx, t: &TensorArg, indices: &[Option<TensorArg>]) -> LResult<Adv> {
    let rank = t.shape.len();
    if indices.len() > rank {
        return user_err(
            IndexErr,
            format!(
                "too many indices for tensor of dimension {rank} (got {})",
                indices.len()
            ),
        );
    }
    let given: Vec<(usize, &TensorArg)> = indices
        .iter()
        .enumerate()
        .filter_map(|(p, i)| i.as_ref().map(|i| (p, i)))
        .collect();
    if given.is_empty() {
        return decline("indexing without index tensors");
    }
    for (_, i) in &given {
        match i.dtype {
            DType::Bool | DType::U8 => return decline("boolean mask index (data-dependent shape)"),
            DType::I32 | DType::I64 => {}
            _ => {
                return user_err(
                    IndexErr,
                    "tensors used as indices must be long, int, byte or bool tensors",
                )
            }
        }
    }
    let shapes: Vec<&[i64]> = given.iter().map(|(_, i)| i.shape.as_slice()).collect();
    let Ok(bshape) = broadcast_all(&shapes) else {
        let s: Vec<String> = shapes.iter().map(|s| shape_str(s)).collect();
        return user_err(
            IndexErr,
            format!(
                "shape mismatch: indexing tensors could not be broadcast together with shapes {}",
                s.join(", ")
            ),
        );
    };
    if given.iter().any(|(p, _)| t.shape[*p] == 0) && numel(&bshape) != 0 {
        return user_err(IndexErr, "index is out of bounds for dimension with size 0");
    }
    let nb = bshape.len();
    // PyTorch numbers the dimension among the index tensors given.
    for (k, (p, i)) in given.iter().enumerate() {
        let size = t.shape[*p];
        c.check_range(i.value, -size, size, IndexErr, out_of_bounds(k, size));
    }
    let b = &mut *c.b;
    let mut col_shape = bshape.clone();
    col_shape.push(1);
    let cols: Vec<Value> = given
        .iter()
        .map(|(p, i)| {
            let v = b.convert(i.value, DType::I64);
            let v = b.broadcast_to(v, &bshape);
            let v = wrap_neg(b, v, t.shape[*p]);
            b.reshape(v, &col_shape)
        })
        .collect();
    let idx = b.concatenate(&cols, nb);
    let dims: Vec<i64> = given.iter().map(|(p, _)| *p as i64).collect();
    let (first, last) = (given[0].0, given[given.len() - 1].0);
    let adjacent = last - first + 1 == given.len();
    let k = given.len();
    let mut offset = Vec::new();
    let mut out_shape = Vec::new();
    if !adjacent {
        out_shape.extend_from_slice(&bshape);
    }
    for d in 0..rank {
        if adjacent && d == first {
            out_shape.extend_from_slice(&bshape);
        }
        if dims.contains(&(d as i64)) {
            continue;
        }
        offset.push(match (adjacent, d < first) {
            (true, true) => d as i64,
            (true, false) => (d + nb - k) as i64,
            (false, _) => out_shape.len() as i64,
        });
        out_shape.push(t.shape[d]);
    }
    Ok(Adv {
        dims,
        idx,
        nb,
        offset,
        out_shape,
    })
}

fn opt_indices(c: &Ctx) -> LResult<Vec<Option<TensorArg>>> {
    Ok(c.args
        .opt_tensors("indices")?
        .into_iter()
        .map(|i| i.cloned())
        .collect())
}

fn index(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let indices = opt_indices(c)?;
    if indices.is_empty() {
        return user_err(IndexErr, "at least one index must be provided");
    }
    let a = advanced(c, &t, &indices)?;
    supported(t.dtype)?;
    let b = &mut *c.b;
    if numel(&a.out_shape) == 0 {
        return Ok(vec![Out::T(zeros(b, t.dtype, &a.out_shape))]);
    }
    let mut sizes = t.shape.clone();
    for d in &a.dims {
        sizes[*d as usize] = 1;
    }
    Ok(vec![Out::T(b.gather(
        t.value,
        a.idx,
        &a.offset,
        &a.dims,
        &a.dims,
        a.nb as i64,
        &sizes,
    ))])
}

fn index_put(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let indices = opt_indices(c)?;
    let values = c.args.tensor("values")?.clone();
    let accumulate = c.args.bool_or("accumulate", false);
    let given: Vec<(usize, &TensorArg)> = indices
        .iter()
        .enumerate()
        .filter_map(|(p, i)| i.as_ref().map(|i| (p, i)))
        .collect();
    if let [(p, m)] = given.as_slice() {
        if m.dtype == DType::Bool && indices.len() <= t.shape.len() {
            return mask_put(c, &t, *p, m, &values, accumulate);
        }
    }
    let a = advanced(c, &t, &indices)?;
    if !expandable(&values.shape, &a.out_shape) {
        return user_err(
            Runtime,
            format!(
                "shape mismatch: value tensor of shape {} cannot be broadcast to indexing result of shape {}",
                shape_str(&values.shape),
                shape_str(&a.out_shape)
            ),
        );
    }
    if values.dtype != t.dtype {
        return user_err(
            Runtime,
            format!(
                "Index put requires the source and destination dtypes match, got {} for the destination and {} for the source.",
                torch_name(t.dtype),
                torch_name(values.dtype)
            ),
        );
    }
    supported(t.dtype)?;
    if numel(&a.out_shape) == 0 {
        return Ok(vec![Out::T(t.value)]);
    }
    let b = &mut *c.b;
    let upd = b.broadcast_to(values.value, &a.out_shape);
    let how = if accumulate {
        Comb::Red(ReduceKind::Sum)
    } else {
        Comb::Replace
    };
    let r = widened(b, t.value, upd, accumulate, |b, x, u| {
        b.scatter(
            x,
            a.idx,
            u,
            &a.offset,
            &a.dims,
            &a.dims,
            a.nb as i64,
            move |b, c, v| combine(b, how, c, v),
        )
    });
    Ok(vec![Out::T(r)])
}

/// `self[..., mask, ...] = values` (or `+=`) for one boolean mask at list position `p`:
/// the result keeps self's shape, so it is a select. Values with a dimension for the
/// masked elements are taken in order (k-th true element gets row k); whether their count
/// matches the mask's is not checked (PyTorch checks it at run time).
fn mask_put(
    c: &mut Ctx,
    t: &TensorArg,
    p: usize,
    mask: &TensorArg,
    values: &TensorArg,
    accumulate: bool,
) -> LResult<Vec<Out>> {
    let rank = t.shape.len();
    let m = mask.shape.len();
    if m == 0 {
        return decline("index_put with a 0-d mask");
    }
    for j in 0..m {
        let d = wrap_dim((p + j) as i64, rank)?;
        if mask.shape[j] != t.shape[d] {
            return user_err(
                IndexErr,
                format!(
                    "The shape of the mask {} at index {j} does not match the shape of the indexed tensor {} at index {d}",
                    shape_str(&mask.shape),
                    shape_str(&t.shape)
                ),
            );
        }
    }
    let (pre, post) = (&t.shape[..p], &t.shape[p + m..]);
    let (vs, np) = (&values.shape, post.len());
    // The values dim facing the masked elements (if values reach that far).
    let k = vs.len().checked_sub(np + 1);
    let fits = match k {
        None => expandable(vs, post),
        Some(k) => expandable(&vs[..k], pre) && expandable(&vs[k + 1..], post),
    };
    if !fits {
        return decline("index_put: values do not broadcast (the error names the mask count)");
    }
    if values.dtype != t.dtype {
        return user_err(
            Runtime,
            format!(
                "Index put requires the source and destination dtypes match, got {} for the destination and {} for the source.",
                torch_name(t.dtype),
                torch_name(values.dtype)
            ),
        );
    }
    supported(t.dtype)?;
    if numel(&t.shape) == 0 {
        return Ok(vec![Out::T(t.value)]);
    }
    let b = &mut *c.b;
    let v = match k {
        Some(k) if vs[k] != 1 => {
            // Row `pos` of the values for each element: masked elements before it.
            let mut full = pre.to_vec();
            full.push(vs[k]);
            full.extend_from_slice(post);
            let vb = b.broadcast_to(values.value, &full);
            let (pn, qn, mn) = (numel(pre), numel(post), numel(&mask.shape));
            let vb = b.reshape(vb, &[pn, vs[k], qn]);
            let flat = b.reshape(mask.value, &[mn]);
            let ones = b.convert(flat, DType::I64);
            let incl = scan(b, ones, 0, ReduceKind::Sum);
            let pos = b.sub(incl, ones);
            let lo = b.splat(pos, 0.0);
            let hi = b.splat(pos, (vs[k] - 1) as f64);
            let pos = b.clamp(lo, pos, hi);
            let g = select_rows(b, vb, 1, pos);
            b.reshape(g, &t.shape)
        }
        Some(k) => {
            // A size-1 dim facing the masked elements broadcasts over all of them.
            let mut sh = vs[..k].to_vec();
            sh.extend(std::iter::repeat_n(1, m));
            sh.extend_from_slice(&vs[k + 1..]);
            let v = b.reshape(values.value, &sh);
            b.broadcast_to(v, &t.shape)
        }
        None => b.broadcast_to(values.value, &t.shape),
    };
    let mut ms = vec![1; p];
    ms.extend_from_slice(&mask.shape);
    ms.extend(std::iter::repeat_n(1, np));
    let mk = b.reshape(mask.value, &ms);
    let mk = b.broadcast_to(mk, &t.shape);
    let r = if accumulate {
        let z = b.splat(v, 0.0);
        let add = b.select(mk, v, z);
        combine(b, Comb::Red(ReduceKind::Sum), t.value, add)
    } else {
        b.select(mk, v, t.value)
    };
    Ok(vec![Out::T(r)])
}

// ---------------------------------------------------------------------------------------
// masked_fill, masked_scatter

fn check_bool_mask(mask: &TensorArg, op: &str) -> LResult<()> {
    if mask.dtype != DType::Bool {
        return user_err(
            Runtime,
            format!(
                "{op} only supports boolean masks, but got mask with dtype {}",
                // PyTorch's two kernels print the dtype differently.
                if op.starts_with("masked_scatter") {
                    torch_name(mask.dtype)
                } else {
                    cpp_name(mask.dtype)
                }
            ),
        );
    }
    Ok(())
}

fn masked_fill(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let mask = c.args.tensor("mask")?.clone();
    check_bool_mask(&mask, "masked_fill_")?;
    supported(t.dtype)?;
    let shape = broadcast_shapes(&mask.shape, &t.shape)?;
    let v = fill_value(c, "value", t.dtype, "masked_fill_")?;
    let b = &mut *c.b;
    let x = b.broadcast_to(t.value, &shape);
    let m = b.broadcast_to(mask.value, &shape);
    let v = b.broadcast_to(v, &shape);
    Ok(vec![Out::T(b.select(m, v, x))])
}

/// `self` with its masked elements replaced, in order, by the leading elements of `source`.
/// A source shorter than the mask's count is not detected (PyTorch raises at run time).
fn masked_scatter(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let mask = c.args.tensor("mask")?.clone();
    let src = c.args.tensor("source")?.clone();
    check_bool_mask(&mask, "masked_scatter_")?;
    if src.dtype != t.dtype {
        return user_err(
            Runtime,
            format!(
                "masked_scatter: expected self and source to have same dtypes but got{} and {}",
                torch_name(t.dtype),
                torch_name(src.dtype)
            ),
        );
    }
    supported(t.dtype)?;
    let shape = broadcast_shapes(&mask.shape, &t.shape)?;
    let (n, m) = (numel(&shape), numel(&src.shape));
    let b = &mut *c.b;
    let x = b.broadcast_to(t.value, &shape);
    if n == 0 || m == 0 {
        return Ok(vec![Out::T(x)]);
    }
    let mk = b.broadcast_to(mask.value, &shape);
    let flat = b.reshape(mk, &[n]);
    // Position of each element in the source: the number of masked elements before it.
    let ones = b.convert(flat, DType::I64);
    let incl = scan(b, ones, 0, ReduceKind::Sum);
    let pos = b.sub(incl, ones);
    let hi = b.splat(pos, (m - 1) as f64);
    let lo = b.splat(pos, 0.0);
    let pos = b.clamp(lo, pos, hi);
    let s = b.reshape(src.value, &[m]);
    let co = b.reshape(pos, &[n, 1]);
    let g = point_gather(b, s, co);
    let g = b.reshape(g, &shape);
    Ok(vec![Out::T(b.select(mk, g, x))])
}

// ---------------------------------------------------------------------------------------
// index_add, index_copy, index_fill, index_reduce, put

/// The checks index_add and index_reduce share (PyTorch's `index_func_meta_impl`).
fn index_func_checks(
    func: &str,
    t: &TensorArg,
    dim: usize,
    index: &TensorArg,
    src: &TensorArg,
) -> LResult<()> {
    if index.shape.len() > 1 {
        return user_err(
            IndexErr,
            format!(
                "{func}_(): Index is supposed to be a vector, but got dim: {} with type: {} and size: {}",
                index.shape.len(),
                torch_name(index.dtype),
                shape_str(&index.shape)
            ),
        );
    }
    if !is_index_dtype(index.dtype) {
        return user_err(
            Runtime,
            format!(
                "{func}_(): Expected dtype int32/int64 for index but got: {}",
                torch_name(index.dtype)
            ),
        );
    }
    if t.dtype != src.dtype {
        return user_err(
            Runtime,
            format!(
                "{func}_(): self ({}) and source ({}) must have the same scalar type",
                torch_name(t.dtype),
                torch_name(src.dtype)
            ),
        );
    }
    if dim != 0 && dim >= src.shape.len() {
        return user_err(
            Runtime,
            format!(
                "{func}_(): Indexing dim {dim} is out of bounds of the source tensor with dim {}",
                src.shape.len()
            ),
        );
    }
    let n = numel(&index.shape);
    let src_n = if src.shape.is_empty() {
        1
    } else {
        src.shape[dim]
    };
    if n != src_n {
        return user_err(
            Runtime,
            format!(
                "{func}_(): Number of indices ({n}) should be equal to source.size(dim): ({src_n}), for dim: {dim}"
            ),
        );
    }
    let same = t.shape.len() == src.shape.len()
        && t.shape
            .iter()
            .zip(&src.shape)
            .enumerate()
            .all(|(d, (a, s))| d == dim || a == s);
    if !same {
        return user_err(
            Runtime,
            format!(
                "source tensor shape must match self tensor shape, excluding the specified dimension. Got self.shape = {} source.shape = {}",
                shape_str(&t.shape),
                shape_str(&src.shape)
            ),
        );
    }
    Ok(())
}

/// Reads (self, dim, index, source) of index_add/copy/reduce.
fn index_func_args(c: &mut Ctx) -> LResult<(TensorArg, usize, TensorArg, TensorArg)> {
    let t = c.args.tensor("self")?.clone();
    let dim = wrap_dim(c.args.int("dim")?, t.shape.len())?;
    let index = c.args.tensor("index")?.clone();
    let src = c.args.tensor("source")?.clone();
    Ok((t, dim, index, src))
}

/// Self and source as at least 1-d values, the index as a 1-d i64 value.
fn index_operands(
    b: &mut Builder,
    t: &TensorArg,
    index: &TensorArg,
    src: &TensorArg,
) -> (Value, Value, Value) {
    let x = b.reshape(t.value, &nonempty(&t.shape));
    let n = numel(&index.shape);
    let i = b.convert(index.value, DType::I64);
    let i = b.reshape(i, &[n]);
    let s = b.reshape(src.value, &nonempty(&src.shape));
    (x, i, s)
}

fn index_add(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (t, dim, index, src) = index_func_args(c)?;
    index_func_checks("index_add", &t, dim, &index, &src)?;
    supported(t.dtype)?;
    let alpha = c.args.opt_scalar("alpha").unwrap_or(Scalar::Int(1));
    if numel(&index.shape) == 0 || numel(&t.shape) == 0 {
        return Ok(vec![Out::T(t.value)]);
    }
    let size = nonempty(&t.shape)[dim];
    c.check_range(index.value, 0, size, Runtime, out_of_bounds(dim, size));
    let b = &mut *c.b;
    let (x, i, s) = index_operands(b, &t, &index, &src);
    let r = widened(b, x, s, true, |b, x, mut s| {
        if alpha.as_f64() != 1.0 {
            let dt = b.dtype(s);
            let a = b.full(dt, &b.shape(s), scalar_as(dt, alpha));
            s = b.mul(s, a);
        }
        dim_scatter(b, x, dim, i, s, Comb::Red(ReduceKind::Sum))
    });
    Ok(vec![Out::T(b.reshape(r, &t.shape))])
}

fn index_reduce(c: &mut Ctx) -> LResult<Vec<Out>> {
    let reduce = c.args.str_or("reduce", "").to_string();
    let mode = match reduce.as_str() {
        "prod" => Mode::Comb(Comb::Red(ReduceKind::Prod)),
        "mean" => Mode::Mean,
        "amax" => Mode::Comb(Comb::Red(ReduceKind::Max)),
        "amin" => Mode::Comb(Comb::Red(ReduceKind::Min)),
        r => {
            return user_err(
                Runtime,
                format!("index_reduce(): Expected reduce to be one of prod, mean, amax or amin but got {r}."),
            )
        }
    };
    let (t, dim, index, src) = index_func_args(c)?;
    index_func_checks("index_reduce", &t, dim, &index, &src)?;
    supported(t.dtype)?;
    if t.dtype == DType::Bool {
        return decline("index_reduce of bool (not implemented by PyTorch)");
    }
    let include_self = c.args.bool_or("include_self", true);
    if numel(&index.shape) == 0 || numel(&t.shape) == 0 {
        return Ok(vec![Out::T(t.value)]);
    }
    let size = nonempty(&t.shape)[dim];
    c.check_range(
        index.value,
        0,
        size,
        IndexErr,
        "index out of range in self".into(),
    );
    let b = &mut *c.b;
    let (x, i, s) = index_operands(b, &t, &index, &src);
    let r = reduce_into(b, x, s, mode, include_self, &|b, x, u, how| {
        dim_scatter(b, x, dim, i, u, how)
    });
    Ok(vec![Out::T(b.reshape(r, &t.shape))])
}

fn index_copy(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (t, dim, index, src) = index_func_args(c)?;
    if index.shape.len() > 1 {
        return user_err(
            IndexErr,
            format!(
                "index_copy_(): Index should have dimension 1 or 0 (got {})",
                index.shape.len()
            ),
        );
    }
    let n = numel(&index.shape);
    let (sr, tr) = (src.shape.len(), t.shape.len());
    if sr == 0 && n != 1 {
        return user_err(
            IndexErr,
            format!(
                "index_copy_(): When source is scalar, index should have one element (got {n})"
            ),
        );
    }
    if sr != tr && sr != 0 && tr != 0 {
        return user_err(
            IndexErr,
            format!(
                "index_copy_(): When source and destination are not scalars, their dimensionality must match. Source dimensionality ({sr}), destination dimensionality ({tr})"
            ),
        );
    }
    if index.dtype != DType::I64 {
        return user_err(
            Runtime,
            format!(
                "index_copy_(): Expected a long tensor for index, but got {}",
                torch_name(index.dtype)
            ),
        );
    }
    if t.dtype != src.dtype {
        return user_err(
            Runtime,
            format!(
                "index_copy_(): self and source expected to have the same dtype, but got (self) {} and (source) {}",
                torch_name(t.dtype),
                torch_name(src.dtype)
            ),
        );
    }
    let sliced = |s: &[i64]| -> Vec<i64> {
        s.iter()
            .enumerate()
            .filter(|(d, _)| *d != dim)
            .map(|(_, x)| *x)
            .collect()
    };
    let (ts, ss) = (sliced(&t.shape), sliced(&src.shape));
    if ts != ss {
        let j = |v: &[i64]| {
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        };
        return user_err(
            Runtime,
            format!(
                "index_copy_(): Source/destination tensor must have same slice shapes. Destination slice shape: {} at dimension {dim} and source slice shape: {} at dimension 0.",
                j(&ts),
                j(&ss)
            ),
        );
    }
    if sr != 0 && n != src.shape[dim] {
        return user_err(
            IndexErr,
            format!(
                "index_copy_(): Number of indices ({n}) should be equal to source.size(dim) ({})",
                src.shape[dim]
            ),
        );
    }
    supported(t.dtype)?;
    if n == 0 || numel(&t.shape) == 0 {
        return Ok(vec![Out::T(t.value)]);
    }
    let size = nonempty(&t.shape)[dim];
    let msg = format!("index_copy_(): {}", out_of_bounds(dim, size));
    c.check_range(index.value, 0, size, IndexErr, msg);
    let b = &mut *c.b;
    let (x, i, s) = index_operands(b, &t, &index, &src);
    // A 0-d source into a 1-d self is one slice of size 1.
    let s = b.reshape(s, &{
        let mut us = nonempty(&t.shape);
        us[dim] = n;
        us
    });
    let r = dim_scatter(b, x, dim, i, s, Comb::Replace);
    Ok(vec![Out::T(b.reshape(r, &t.shape))])
}

fn index_fill(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let dim = wrap_dim(c.args.int("dim")?, t.shape.len())?;
    let index = c.args.tensor("index")?.clone();
    if let Some(v) = c.args.opt_tensor("value") {
        if !v.shape.is_empty() {
            return user_err(
                Runtime,
                format!(
                    "index_fill_ only supports a 0-dimensional value tensor, but got tensor with {} dimension(s).",
                    v.shape.len()
                ),
            );
        }
    }
    if index.dtype != DType::I64 {
        return user_err(IndexErr, "index_fill_(): Expected dtype int64 for index.");
    }
    if index.shape.len() > 1 {
        return user_err(Runtime, "Index has to be a vector/scalar");
    }
    supported(t.dtype)?;
    let v = fill_value(c, "value", t.dtype, "index_fill_")?;
    let n = numel(&index.shape);
    if n == 0 || numel(&t.shape) == 0 {
        return Ok(vec![Out::T(t.value)]);
    }
    let ts = nonempty(&t.shape);
    let size = ts[dim];
    c.check_range(index.value, -size, size, IndexErr, out_of_bounds(dim, size));
    let b = &mut *c.b;
    // Mark the filled positions along `dim`, then select.
    let i = b.reshape(index.value, &[n]);
    let i = wrap_neg(b, i, size);
    let none = b.full(DType::Bool, &[size], 0.0);
    let hit = b.full(DType::Bool, &[n], 1.0);
    let co = b.reshape(i, &[n, 1]);
    let marks = point_scatter(b, none, co, hit, Comb::Replace);
    let marks = b.broadcast_in_dim(marks, &ts, &[dim as i64]);
    let x = b.reshape(t.value, &ts);
    let v = b.broadcast_in_dim(v, &ts, &[]);
    let r = b.select(marks, v, x);
    Ok(vec![Out::T(b.reshape(r, &t.shape))])
}

fn put(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let index = c.args.tensor("index")?.clone();
    let src = c.args.tensor("source")?.clone();
    let accumulate = c.args.bool_or("accumulate", false);
    if index.dtype != DType::I64 {
        return user_err(
            Runtime,
            format!(
                "put_(): Expected a long tensor for index, but got {}",
                torch_name(index.dtype)
            ),
        );
    }
    if t.dtype != src.dtype {
        return user_err(
            Runtime,
            format!(
                "put_(): self and source expected to have the same dtype, but got self.dtype = {} and source.dtype = {}",
                torch_name(t.dtype),
                torch_name(src.dtype)
            ),
        );
    }
    let (n, m, tn) = (numel(&index.shape), numel(&src.shape), numel(&t.shape));
    if n != m {
        return user_err(
            IndexErr,
            format!(
                "put_(): Expected source and index to have the same number of elements, but got source.numel() = {m}, index.numel() = {n}"
            ),
        );
    }
    if tn == 0 && n != 0 {
        return user_err(
            IndexErr,
            "put_(): Tried to put elements into an empty tensor",
        );
    }
    supported(t.dtype)?;
    if n == 0 {
        return Ok(vec![Out::T(t.value)]);
    }
    let msg =
        format!("out of range: tried to access index {{index}} on a tensor of {tn} elements.");
    c.check_range(index.value, -tn, tn, IndexErr, msg);
    let b = &mut *c.b;
    let flat = b.reshape(t.value, &[tn]);
    let i = b.reshape(index.value, &[n]);
    let i = wrap_neg(b, i, tn);
    let co = b.reshape(i, &[n, 1]);
    let s = b.reshape(src.value, &[n]);
    let how = if accumulate {
        Comb::Red(ReduceKind::Sum)
    } else {
        Comb::Replace
    };
    let r = widened(b, flat, s, accumulate, |b, x, u| {
        point_scatter(b, x, co, u, how)
    });
    Ok(vec![Out::T(b.reshape(r, &t.shape))])
}

// ---------------------------------------------------------------------------------------
// slice/select/diagonal scatter and the backward ops of slicing views. (PyTorch registers
// composite kernels for these; they reach the rules only where the runtime claims them.)

/// `base` with `src` (base's shape, `n` at `dim`) written at `start, start + step, ...`.
fn place_slice(
    b: &mut Builder,
    base: Value,
    dim: usize,
    start: i64,
    n: i64,
    step: i64,
    src: Value,
) -> Value {
    if n == 0 {
        return base;
    }
    let shape = b.shape(base);
    if step == 1 {
        let starts: Vec<Value> = (0..shape.len())
            .map(|d| b.constant_i64(DType::I64, if d == dim { start } else { 0 }))
            .collect();
        return b.dynamic_update_slice(base, src, &starts);
    }
    // Spread src out with interior padding and pick it where a mask (padded alike) is set.
    let r = shape.len();
    let (mut lo, mut hi, mut inner) = (vec![0; r], vec![0; r], vec![0; r]);
    lo[dim] = start;
    hi[dim] = shape[dim] - (start + (n - 1) * step + 1);
    inner[dim] = step - 1;
    let zero = b.constant(b.dtype(src), 0.0);
    let spread = b.pad(src, zero, &lo, &hi, &inner);
    let ones = b.full(DType::Bool, &[n], 1.0);
    let f = b.constant(DType::Bool, 0.0);
    let mask = b.pad(ones, f, &[start], &[hi[dim]], &[step - 1]);
    let mask = b.broadcast_in_dim(mask, &shape, &[dim as i64]);
    b.select(mask, spread, base)
}

/// PyTorch's slice bounds: negative values wrap, then clamp into `[0, size]`.
fn slice_bounds(start: Option<i64>, end: Option<i64>, step: i64, size: i64) -> LResult<(i64, i64)> {
    if step <= 0 {
        return user_err(Runtime, "slice step must be positive");
    }
    let wrap = |v: i64| if v < 0 { v + size } else { v };
    let s = wrap(start.unwrap_or(0)).clamp(0, size);
    let e = wrap(end.unwrap_or(size)).clamp(s, size);
    Ok((s, (e - s + step - 1) / step))
}

fn check_slice_src(src: &[i64], slice: &[i64]) -> LResult<()> {
    if src != slice {
        return user_err(
            Runtime,
            format!(
                "expected src to have a size equal to the slice of self. src size = {}, slice size = {}",
                shape_str(src),
                shape_str(slice)
            ),
        );
    }
    Ok(())
}

fn slice_scatter(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let src = c.args.tensor("src")?.clone();
    if t.shape.is_empty() {
        return user_err(IndexErr, "slice() cannot be applied to a 0-dim tensor.");
    }
    let dim = wrap_dim(c.args.int_or("dim", 0), t.shape.len())?;
    let step = c.args.int_or("step", 1);
    let (start, n) = slice_bounds(
        c.args.opt_int("start"),
        c.args.opt_int("end"),
        step,
        t.shape[dim],
    )?;
    let mut sl = t.shape.clone();
    sl[dim] = n;
    check_slice_src(&src.shape, &sl)?;
    let b = &mut *c.b;
    let v = b.convert(src.value, t.dtype);
    Ok(vec![Out::T(place_slice(
        b, t.value, dim, start, n, step, v,
    ))])
}

fn slice_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let g = c.args.tensor("grad_output")?.clone();
    let sizes = c.args.ints("input_sizes")?;
    if sizes.is_empty() {
        return user_err(IndexErr, "slice() cannot be applied to a 0-dim tensor.");
    }
    let dim = wrap_dim(c.args.int("dim")?, sizes.len())?;
    let step = c.args.int("step")?;
    let (start, n) = slice_bounds(
        Some(c.args.int("start")?),
        Some(c.args.int("end")?),
        step,
        sizes[dim],
    )?;
    let mut sl = sizes.clone();
    sl[dim] = n;
    if !expandable(&g.shape, &sl) {
        return decline("slice_backward: gradient does not broadcast to the slice");
    }
    let b = &mut *c.b;
    let base = zeros(b, g.dtype, &sizes);
    let v = b.broadcast_to(g.value, &sl);
    Ok(vec![Out::T(place_slice(b, base, dim, start, n, step, v))])
}

/// The wrapped `index` of `select(dim, index)` on `shape`, with PyTorch's errors.
fn select_index(shape: &[i64], dim: i64, index: i64) -> LResult<(usize, i64)> {
    if shape.is_empty() {
        return user_err(IndexErr, "select() cannot be applied to a 0-dim tensor.");
    }
    let d = wrap_dim(dim, shape.len())?;
    let size = shape[d];
    if index < -size || index >= size {
        return user_err(
            IndexErr,
            format!(
                "select(): index {index} out of range for tensor of size {} at dimension {dim}",
                shape_str(shape)
            ),
        );
    }
    Ok((d, if index < 0 { index + size } else { index }))
}

fn select_into(b: &mut Builder, base: Value, dim: usize, index: i64, src: Value) -> Value {
    let mut sl = b.shape(base);
    sl[dim] = 1;
    let v = b.reshape(src, &sl);
    place_slice(b, base, dim, index, 1, 1, v)
}

fn select_scatter(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let src = c.args.tensor("src")?.clone();
    let (dim, index) = select_index(&t.shape, c.args.int("dim")?, c.args.int("index")?)?;
    let sl: Vec<i64> = t
        .shape
        .iter()
        .enumerate()
        .filter(|(d, _)| *d != dim)
        .map(|(_, s)| *s)
        .collect();
    check_slice_src(&src.shape, &sl)?;
    let b = &mut *c.b;
    let v = b.convert(src.value, t.dtype);
    Ok(vec![Out::T(select_into(b, t.value, dim, index, v))])
}

fn select_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let g = c.args.tensor("grad_output")?.clone();
    let sizes = c.args.ints("input_sizes")?;
    let (dim, index) = select_index(&sizes, c.args.int("dim")?, c.args.int("index")?)?;
    let sl: Vec<i64> = sizes
        .iter()
        .enumerate()
        .filter(|(d, _)| *d != dim)
        .map(|(_, s)| *s)
        .collect();
    if !expandable(&g.shape, &sl) {
        return decline("select_backward: gradient does not broadcast to the slice");
    }
    let b = &mut *c.b;
    let base = zeros(b, g.dtype, &sizes);
    let v = b.broadcast_to(g.value, &sl);
    Ok(vec![Out::T(select_into(b, base, dim, index, v))])
}

/// The dims and length of `diagonal(offset, dim1, dim2)` on `shape`.
fn diag_dims(shape: &[i64], offset: i64, d1: i64, d2: i64) -> LResult<(usize, usize, i64)> {
    let (a, z) = (wrap_dim(d1, shape.len())?, wrap_dim(d2, shape.len())?);
    if a == z {
        return user_err(
            Runtime,
            format!("diagonal dimensions cannot be identical {d1}, {d2}"),
        );
    }
    let len = if offset >= 0 {
        shape[a].min(shape[z] - offset)
    } else {
        (shape[a] + offset).min(shape[z])
    };
    Ok((a, z, len.max(0)))
}

/// `base` with its (offset, d1, d2) diagonal replaced by `src` (base's shape without d1 and
/// d2, then the diagonal's length `len`).
fn place_diag(
    b: &mut Builder,
    base: Value,
    offset: i64,
    d1: usize,
    d2: usize,
    len: i64,
    src: Value,
) -> Value {
    if len == 0 {
        return base;
    }
    let shape = b.shape(base);
    let r = shape.len();
    // Bring d1, d2 last: [rest..., s1, s2].
    let mut perm: Vec<i64> = (0..r as i64)
        .filter(|d| *d != d1 as i64 && *d != d2 as i64)
        .collect();
    perm.extend([d1 as i64, d2 as i64]);
    let x = b.transpose(base, &perm);
    let ts = b.shape(x);
    let i = b.iota(DType::I64, &ts, r - 2);
    let j = b.iota(DType::I64, &ts, r - 1);
    let off = b.splat(i, offset as f64);
    let io = b.add(i, off);
    let on_diag = b.compare(io, j, CmpDir::Eq);
    // Element (i, j) of the diagonal is src[..., min(i, j)] (clamped off the diagonal).
    let k = b.min(i, j);
    let hi = b.splat(k, (len - 1) as f64);
    let k = b.min(k, hi);
    let mut col = ts.clone();
    col.push(1);
    let mut cols: Vec<Value> = (0..r - 2)
        .map(|d| {
            let v = b.iota(DType::I64, &ts, d);
            b.reshape(v, &col)
        })
        .collect();
    cols.push(b.reshape(k, &col));
    let co = b.concatenate(&cols, r);
    let vals = point_gather(b, src, co);
    let y = b.select(on_diag, vals, x);
    let mut inv = vec![0i64; r];
    for (p, d) in perm.iter().enumerate() {
        inv[*d as usize] = p as i64;
    }
    b.transpose(y, &inv)
}

fn diag_src_shape(shape: &[i64], d1: usize, d2: usize, len: i64) -> Vec<i64> {
    let mut s: Vec<i64> = shape
        .iter()
        .enumerate()
        .filter(|(d, _)| *d != d1 && *d != d2)
        .map(|(_, x)| *x)
        .collect();
    s.push(len);
    s
}

fn diagonal_scatter(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let src = c.args.tensor("src")?.clone();
    let offset = c.args.int_or("offset", 0);
    let (d1, d2, len) = diag_dims(
        &t.shape,
        offset,
        c.args.int_or("dim1", 0),
        c.args.int_or("dim2", 1),
    )?;
    check_slice_src(&src.shape, &diag_src_shape(&t.shape, d1, d2, len))?;
    let b = &mut *c.b;
    let v = b.convert(src.value, t.dtype);
    Ok(vec![Out::T(place_diag(b, t.value, offset, d1, d2, len, v))])
}

fn diagonal_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let g = c.args.tensor("grad_output")?.clone();
    let sizes = c.args.ints("input_sizes")?;
    let offset = c.args.int("offset")?;
    let (d1, d2, len) = diag_dims(&sizes, offset, c.args.int("dim1")?, c.args.int("dim2")?)?;
    let ds = diag_src_shape(&sizes, d1, d2, len);
    if !expandable(&g.shape, &ds) {
        return decline("diagonal_backward: gradient does not broadcast to the diagonal");
    }
    let b = &mut *c.b;
    let base = zeros(b, g.dtype, &sizes);
    let v = b.broadcast_to(g.value, &ds);
    Ok(vec![Out::T(place_diag(b, base, offset, d1, d2, len, v))])
}

/// The ops of this family whose programs may serve a range of sizes (see
/// `super::serves_sizes`).
pub const SERVES_SIZES: &[&str] = &[
    "aten::masked_fill",
    "aten::index_select",
    "aten::embedding",
    "aten::embedding_dense_backward",
];

pub const RULES: &[(&str, Rule)] = &[
    ("aten::index_select", index_select),
    ("aten::gather", gather),
    ("aten::take", take),
    ("aten::embedding", embedding),
    ("aten::embedding_dense_backward", embedding_dense_backward),
    ("aten::embedding_renorm", embedding_renorm),
    ("aten::scatter", scatter),
    ("aten::scatter_add", scatter_add),
    ("aten::scatter_reduce", scatter_reduce),
    ("aten::index", index),
    ("aten::_unsafe_index", index),
    ("aten::index_put", index_put),
    ("aten::_index_put_impl", index_put),
    ("aten::_unsafe_index_put", index_put),
    ("aten::masked_fill", masked_fill),
    ("aten::masked_scatter", masked_scatter),
    ("aten::index_add", index_add),
    ("aten::index_reduce", index_reduce),
    ("aten::index_copy", index_copy),
    ("aten::index_fill", index_fill),
    ("aten::put", put),
    ("aten::slice_scatter", slice_scatter),
    ("aten::slice_backward", slice_backward),
    ("aten::select_scatter", select_scatter),
    ("aten::select_backward", select_backward),
    ("aten::diagonal_scatter", diagonal_scatter),
    ("aten::diagonal_backward", diagonal_backward),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Arg, Args, LowerError};

    use crate::args::param_arg as tensor;

    fn run(rule: Rule, items: Vec<(&str, Arg)>, b: &mut Builder) -> LResult<Vec<i64>> {
        let args = Args {
            items: items.into_iter().map(|(n, a)| (n.to_string(), a)).collect(),
        };
        let mut c = Ctx::new(b, "aten::test", "", &args);
        match rule(&mut c)?.first() {
            Some(Out::T(v)) => Ok(c.b.shape(*v)),
            _ => panic!("no tensor result"),
        }
    }

    fn index_shape(self_shape: &[i64], idx: &[Option<&[i64]>]) -> LResult<Vec<i64>> {
        let mut b = Builder::new();
        let s = tensor(&mut b, DType::F32, self_shape);
        let list = idx
            .iter()
            .map(|i| match i {
                Some(sh) => tensor(&mut b, DType::I64, sh),
                None => Arg::None,
            })
            .collect();
        run(
            index,
            vec![("self", s), ("indices", Arg::List(list))],
            &mut b,
        )
    }

    #[test]
    fn advanced_index_shapes() {
        // x[i] / x[:, i] / x[i, :, j] (non-adjacent: index dims first) / x[:, i, j].
        assert_eq!(
            index_shape(&[4, 5, 6], &[Some(&[2, 3])]).unwrap(),
            vec![2, 3, 5, 6]
        );
        assert_eq!(
            index_shape(&[4, 5, 6], &[None, Some(&[2, 3])]).unwrap(),
            vec![4, 2, 3, 6]
        );
        assert_eq!(
            index_shape(&[4, 5, 6], &[Some(&[3]), None, Some(&[2, 1])]).unwrap(),
            vec![2, 3, 5]
        );
        assert_eq!(
            index_shape(&[4, 5, 6, 7], &[None, Some(&[3]), Some(&[3])]).unwrap(),
            vec![4, 3, 7]
        );
        assert_eq!(index_shape(&[4, 5], &[Some(&[])]).unwrap(), vec![5]);
        let e = index_shape(&[4], &[Some(&[2]), Some(&[2])]);
        assert!(matches!(e, Err(LowerError::User(ErrorKind::Index, _))));
        let e = index_shape(&[4, 4], &[Some(&[2]), Some(&[3])]);
        assert!(matches!(e, Err(LowerError::User(ErrorKind::Index, m)) if m.contains("[2], [3]")));
    }

    #[test]
    fn fill_value_overflow() {
        assert!(check_fill_value(DType::U8, Scalar::Int(-255)).is_ok());
        assert!(check_fill_value(DType::U8, Scalar::Int(256)).is_err());
        assert!(check_fill_value(DType::I8, Scalar::Float(127.5)).is_ok());
        assert!(check_fill_value(DType::I8, Scalar::Float(-128.5)).is_err());
        assert!(check_fill_value(DType::F16, Scalar::Float(f64::INFINITY)).is_ok());
        assert!(check_fill_value(DType::F16, Scalar::Float(65520.0)).is_err());
    }
}
