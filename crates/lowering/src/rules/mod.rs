//! The rule table. Each family module exports `RULES: &[(name, Rule)]`; names are ATen
//! op names without overload. `.out` and in-place variants reuse the functional rule (the
//! runtime writes the result where it belongs), so one entry serves all three.

use std::collections::HashMap;
use std::sync::OnceLock;

use crate::args::Scalar;
use crate::promote::{result_type, torch_name, Operand};
use crate::shape::broadcast_all;
use crate::{user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value};
use stablehlo::{CmpDir, ReduceKind};

pub mod activations;
pub mod amp;
pub mod attention;
pub mod bags;
pub mod collectives;
pub mod complex;
pub mod convolution;
pub mod custom;
pub mod decomp;
pub mod detection;
pub mod foreach;
pub mod histogram;
pub mod index;
pub mod linalg;
pub mod losses;
pub mod nn_common;
#[cfg(test)]
mod nn_tests;
pub mod normalization;
pub mod norms;
pub mod padding;
pub mod pointwise;
pub mod pooling;
pub mod random;
pub mod recurrent;
pub mod reduce;
pub mod resampling;
pub mod sorting;
pub mod special;
pub mod triangular;
pub mod views;

fn families() -> Vec<&'static [(&'static str, Rule)]> {
    vec![
        pointwise::RULES,
        reduce::RULES,
        linalg::RULES,
        views::RULES,
        index::RULES,
        normalization::RULES,
        convolution::RULES,
        attention::RULES,
        pooling::RULES,
        padding::RULES,
        activations::RULES,
        resampling::RULES,
        random::RULES,
        recurrent::RULES,
        foreach::RULES,
        special::RULES,
        sorting::RULES,
        norms::RULES,
        triangular::RULES,
        histogram::RULES,
        decomp::RULES,
        losses::RULES,
        bags::RULES,
        collectives::RULES,
        amp::RULES,
        custom::RULES,
        detection::RULES,
    ]
}

fn table() -> &'static HashMap<&'static str, Rule> {
    static TABLE: OnceLock<HashMap<&'static str, Rule>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut m = HashMap::new();
        for fam in families() {
            for (name, rule) in fam.iter() {
                let prev = m.insert(*name, *rule);
                assert!(prev.is_none(), "two lowering rules for {name}");
            }
        }
        m
    })
}

pub fn lookup(op: &str) -> Option<Rule> {
    table().get(op).copied()
}

fn complex_table() -> &'static HashMap<&'static str, Rule> {
    static TABLE: OnceLock<HashMap<&'static str, Rule>> = OnceLock::new();
    TABLE.get_or_init(|| complex::RULES.iter().copied().collect())
}

/// The rule for a call; `complex` when a tensor or number of the call is complex. Such a
/// call runs only a rule the complex family vouches for (see `complex`). Real calls use
/// the main table, then the complex family (ops like `polar` that make complex results).
pub fn lookup_for(op: &str, complex: bool) -> Option<Rule> {
    if complex {
        complex_table()
            .get(op)
            .copied()
            .or_else(|| complex::SHARED.contains(&op).then(|| lookup(op)).flatten())
    } else {
        lookup(op).or_else(|| complex_table().get(op).copied())
    }
}

/// Ops whose composite kernels would split them before they reach the backend, although a
/// rule (with its backward) covers them whole: the glue routes all their overloads here.
pub fn claimed() -> Vec<&'static str> {
    let explicit = [
        "aten::native_layer_norm",
        "aten::native_group_norm",
        "aten::_fused_rms_norm",
        "aten::_fused_rms_norm_backward",
        "aten::_native_batch_norm_legit_no_training",
        "aten::narrow_copy",
        "aten::addr",
        // Its composite kernel reads the offsets on the host and slices.
        "aten::_grouped_mm",
        // PyTorch's defaults raise: they are backends' entries of scaled_dot_product_attention.
        "aten::_scaled_dot_product_fused_attention_overrideable",
        "aten::_scaled_dot_product_fused_attention_overrideable_backward",
    ];
    let mut v: Vec<&str> = explicit
        .into_iter()
        .filter(|n| table().contains_key(n))
        .collect();
    v.extend(
        names()
            .into_iter()
            .filter(|n| n.starts_with("aten::_foreach_")),
    );
    v
}

/// Ops whose out= tensor may not share memory with an input at all (PyTorch's
/// `assert_no_overlap`); the others accept an out= that is exactly an input, as in-place
/// updates do.
pub fn out_excludes_inputs(op: &str) -> bool {
    matches!(
        op,
        "aten::take"
            | "aten::index_select"
            | "aten::masked_select"
            | "aten::cat"
            | "aten::kthvalue"
            | "aten::gather"
    )
}

/// Ops whose out= results may not share memory with each other: the ValueError message.
pub fn outs_exclude_each_other(op: &str) -> Option<&'static str> {
    match op {
        "aten::aminmax" => Some("aminmax(): the `min` and `max` out= tensors must not overlap."),
        _ => None,
    }
}

fn sized_families() -> [&'static [&'static str]; 11] {
    [
        losses::SERVES_SIZES,
        attention::SERVES_SIZES,
        pointwise::SERVES_SIZES,
        normalization::SERVES_SIZES,
        special::SERVES_SIZES,
        index::SERVES_SIZES,
        linalg::SERVES_SIZES,
        reduce::SERVES_SIZES,
        norms::SERVES_SIZES,
        triangular::SERVES_SIZES,
        views::SERVES_SIZES,
    ]
}

/// Ops whose programs may serve a range of sizes (the runtime's `buckets`): their rules
/// stay exact when XLA pads a dimension (no size used as a number, no op the dynamic
/// padder cannot follow), checked against the CPU at several sizes of one bucket in
/// tests/test_dynamic.py. Each family lists its own (`SERVES_SIZES`, next to its rules);
/// others (sort, cumsum, roll, fills of a fresh tensor, `nll_loss` whose target check
/// compares with a class count that duck sizing may pad, ...) compile per shape. A rule
/// that divides by a size takes it from `Builder::count` (the real one in a padded program).
/// In-place and out= forms follow the op.
pub fn serves_sizes(op: &str) -> bool {
    static SET: OnceLock<std::collections::HashSet<&'static str>> = OnceLock::new();
    SET.get_or_init(|| sized_families().concat().into_iter().collect())
        .contains(op.trim_end_matches('_'))
}

/// Arguments of `op` its rule never reads (see each family's `UNREAD_ARGS`): program keys
/// leave them out.
pub fn unread_args(op: &str) -> &'static [&'static str] {
    attention::UNREAD_ARGS
        .iter()
        .find(|(o, _)| *o == op)
        .map_or(&[], |(_, a)| a)
}

/// Results PyTorch lays out column-major in their last two dims (LAPACK's layout), by
/// output position: under torch.compile, AOTAutograd plans views on the meta kernels'
/// strides, so a row-major result would make a later `view` fail. Each family lists its
/// own (`COLUMN_MAJOR_RESULTS`); only the first result is.
pub fn column_major_result(op: &str, k: usize) -> bool {
    k == 0
        && [
            triangular::COLUMN_MAJOR_RESULTS,
            decomp::COLUMN_MAJOR_RESULTS,
        ]
        .iter()
        .any(|family| family.contains(&op))
}

/// Ops that take non-scalar CPU tensors next to tpu ones: copies between the devices and
/// `torch.equal` (our own ops, dispatched by the runtime) and the indices of advanced
/// indexing, as on CUDA. Other ops, custom kernels' `torch_pjrt::jax_call` included, accept
/// a CPU tensor only as a 0-dim scalar.
pub fn takes_cpu_tensors(op: &str) -> bool {
    matches!(op, "torch_pjrt::copy" | "torch_pjrt::equal")
        || matches!(
            op.trim_end_matches('_'),
            "aten::index"
                | "aten::_unsafe_index"
                | "aten::index_put"
                | "aten::_index_put_impl"
                | "aten::_unsafe_index_put"
        )
}

/// Every op name with a rule (for coverage reports).
pub fn names() -> Vec<&'static str> {
    let mut v: Vec<&str> = table().keys().copied().collect();
    v.extend(complex_table().keys().filter(|k| !table().contains_key(*k)));
    v.sort();
    v
}

/// A pointwise operand: a tensor or a Python number.
#[derive(Clone, Debug)]
pub enum Opnd {
    T(TensorArg),
    S(Scalar),
}

impl Opnd {
    fn promo(&self) -> Operand {
        match self {
            Opnd::T(t) if t.wrapped_number => Operand::Number(match t.dtype {
                DType::Bool => Scalar::Bool(true),
                d if d.is_complex() => Scalar::Complex(0.0, 0.0),
                d if d.is_float() => Scalar::Float(0.0),
                _ => Scalar::Int(0),
            }),
            Opnd::T(t) if t.shape.is_empty() => Operand::ZeroDim(t.dtype),
            Opnd::T(t) => Operand::Dim(t.dtype),
            Opnd::S(s) => Operand::Number(*s),
        }
    }
    fn shape(&self) -> &[i64] {
        match self {
            Opnd::T(t) => &t.shape,
            Opnd::S(_) => &[],
        }
    }
}

/// The argument `name` as an operand (tensor, or number).
pub fn opnd(c: &Ctx, name: &str) -> LResult<Opnd> {
    if let Some(t) = c.args.opt_tensor(name) {
        return Ok(Opnd::T(t.clone()));
    }
    Ok(Opnd::S(c.args.scalar(name)?))
}

/// Common dtype and broadcast shape of operands.
pub fn common(ops: &[Opnd]) -> LResult<(DType, Vec<i64>)> {
    let dtype = result_type(&ops.iter().map(|o| o.promo()).collect::<Vec<_>>());
    let shapes: Vec<&[i64]> = ops.iter().map(|o| o.shape()).collect();
    Ok((dtype, broadcast_all(&shapes)?))
}

/// The operand as a value of `dtype` broadcast to `shape`.
pub fn mat(b: &mut Builder, o: &Opnd, dtype: DType, shape: &[i64]) -> Value {
    match o {
        Opnd::T(t) => {
            let v = b.convert(t.value, dtype);
            b.broadcast_to(v, shape)
        }
        Opnd::S(s) => full_scalar(b, dtype, shape, *s),
    }
}

/// Whether the number `s` equals the real `v` (a complex one with no imaginary part).
pub fn scalar_is(s: Scalar, v: f64) -> bool {
    match s {
        Scalar::Complex(re, im) => re == v && im == 0.0,
        s => s.as_f64() == v,
    }
}

/// A tensor of `shape` and `dtype` filled with the number `s` (complex numbers keep
/// their imaginary part when `dtype` is complex).
pub fn full_scalar(b: &mut Builder, dtype: DType, shape: &[i64], s: Scalar) -> Value {
    match s {
        Scalar::Complex(re, im) if dtype.is_complex() => {
            let c = b.constant_complex(dtype, re, im);
            b.broadcast_in_dim(c, shape, &[])
        }
        s => b.full(dtype, shape, s.as_f64()),
    }
}

/// Promotes and broadcasts operands: returns (values, result dtype, shape). `compute`
/// maps the promoted dtype to the dtype the math runs in (e.g. ints to float for `div`).
pub fn promote(
    c: &mut Ctx,
    names: &[&str],
    compute: fn(DType) -> DType,
) -> LResult<(Vec<Value>, DType, Vec<i64>)> {
    let ops: Vec<Opnd> = names.iter().map(|n| opnd(c, n)).collect::<LResult<_>>()?;
    let (dt, shape) = common(&ops)?;
    let dt = compute(dt);
    let vals = ops.iter().map(|o| mat(c.b, o, dt, &shape)).collect();
    Ok((vals, dt, shape))
}

pub fn same(d: DType) -> DType {
    d
}

/// A number argument as a value shaped like `like`: a Python float the runtime passes as a
/// program input (a wrapped 0-d tensor, so new values do not recompile), or a constant.
/// None when the argument is absent.
pub fn scalar_value(c: &mut Ctx, name: &str, like: Value) -> LResult<Option<(Value, Scalar)>> {
    let ty = c.b.ty(like).clone();
    if let Some(t) = c.args.opt_tensor(name) {
        let t = t.clone();
        let v = c.b.convert(t.value, ty.dtype);
        let kind = if t.dtype.is_float() {
            Scalar::Float(f64::NAN)
        } else {
            Scalar::Int(0)
        };
        return Ok(Some((c.b.broadcast_to(v, &ty.shape), kind)));
    }
    match c.args.opt_scalar(name) {
        Some(s) => Ok(Some((full_scalar(c.b, ty.dtype, &ty.shape, s), s))),
        None => Ok(None),
    }
}

/// The logistic function (pointwise `sigmoid`, the gates of recurrent cells).
pub fn sigmoid(b: &mut Builder, x: Value) -> Value {
    b.unary("stablehlo.logistic", x)
}

/// sigmoid's derivative from its output `y`: `y * (1 - y)`.
pub fn sigmoid_grad(b: &mut Builder, y: Value) -> Value {
    let one = b.splat(y, 1.0);
    let t = b.sub(one, y);
    b.mul(y, t)
}

/// tanh's derivative from its output `y`: `1 - y * y`.
pub fn tanh_grad(b: &mut Builder, y: Value) -> Value {
    let one = b.splat(y, 1.0);
    let y2 = b.mul(y, y);
    b.sub(one, y2)
}

/// The dtype a kernel accumulates in (PyTorch's opmath type: f32 for f16/bf16).
pub fn opmath(d: DType) -> DType {
    match d {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

/// A number as C++ streams print a double (`%g`), for PyTorch's messages.
pub fn fmt_num(v: f64) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if v == 0.0 {
        return if v.is_sign_negative() {
            "-0".into()
        } else {
            "0".into()
        };
    }
    let sci = format!("{v:.5e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let trim = |s: &str| -> String {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s.to_string()
        }
    };
    if !(-4..6).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{}e{}{:02}", trim(mant), sign, exp.abs())
    } else {
        let decimals = (5 - exp).max(0) as usize;
        trim(&format!("{v:.decimals$}"))
    }
}

/// Where `col - row <= k` (lower) or `>= k` (upper) over the last two dims of `shape`.
pub fn tri_mask(b: &mut Builder, shape: &[i64], lower: bool, k: i64) -> Value {
    let r = shape.len();
    let row = b.iota(DType::I64, shape, r - 2);
    let col = b.iota(DType::I64, shape, r - 1);
    let d = b.sub(col, row);
    let kk = b.full(DType::I64, shape, k as f64);
    b.compare(d, kk, if lower { CmpDir::Le } else { CmpDir::Ge })
}

/// The CPU kernels' symmetric ramp of `n` f64 points: the first half steps up from `s`, the
/// second half down from `e` (one point gives `s`). `s`, `e`, `step`: 0-d values of one
/// dtype; linspace and histogram's equal bins compute their points this way.
pub fn ramp(b: &mut Builder, s: Value, e: Value, step: Value, n: i64) -> Value {
    let dt = b.dtype(s);
    let step = b.broadcast_in_dim(step, &[n], &[]);
    let index = b.iota(DType::F64, &[n], 0);
    let i = b.convert(index, dt);
    let sb = b.broadcast_in_dim(s, &[n], &[]);
    let eb = b.broadcast_in_dim(e, &[n], &[]);
    let lo = b.mul(i, step);
    let lo = b.add(sb, lo);
    let last = b.full(dt, &[n], (n - 1) as f64);
    let r = b.sub(last, i);
    let hi = b.mul(r, step);
    let hi = b.sub(eb, hi);
    let half = b.full(DType::F64, &[n], (n / 2).max(1) as f64);
    let first = b.compare(index, half, stablehlo::CmpDir::Lt);
    b.select(first, lo, hi)
}

/// PyTorch's error for a kernel `kernel` with no instance for `d`
/// (`"histogram_cpu" not implemented for 'Int'`).
pub fn not_implemented<T>(kernel: &str, d: DType) -> LResult<T> {
    crate::user_err(
        crate::ErrorKind::NotImplemented,
        format!("\"{kernel}\" not implemented for '{}'", torch_name(d)),
    )
}

/// The `self` tensor.
pub fn input(c: &Ctx) -> LResult<TensorArg> {
    Ok(c.args.tensor("self")?.clone())
}

/// Where `x` is NaN.
pub fn is_nan(b: &mut Builder, x: Value) -> Value {
    b.compare(x, x, CmpDir::Ne)
}

/// `x * k`, `k` in `x`'s dtype.
pub fn scale(b: &mut Builder, x: Value, k: f64) -> Value {
    let k = b.splat(x, k);
    b.mul(x, k)
}

/// Half types, which PyTorch's CPU distance, histogram and LAPACK kernels reject (the
/// fallback reports that).
pub fn is_half(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16)
}

/// For each value, how many boundaries precede it: `b < v` (left) or `b <= v` (right),
/// written as `!(b >= v)` / `!(b > v)` so a NaN value lands past every boundary. On
/// sorted, NaN-free boundaries this is the binary search's answer.
/// `seq` is [..., n] (or [n], shared); `vals` has `seq`'s leading dims.
pub fn count_before(b: &mut Builder, seq: Value, vals: Value, right: bool, out: DType) -> Value {
    let ss = b.shape(seq);
    let vs = b.shape(vals);
    let n = ss[ss.len() - 1];
    let mut full = vs.clone();
    full.push(n);
    let r = vs.len();
    let sb = if ss.len() == 1 {
        b.broadcast_in_dim(seq, &full, &[r as i64])
    } else {
        let dims: Vec<i64> = (0..r as i64 - 1).chain([r as i64]).collect();
        b.broadcast_in_dim(seq, &full, &dims)
    };
    let all: Vec<i64> = (0..r as i64).collect();
    let vb = b.broadcast_in_dim(vals, &full, &all);
    let dir = if right { CmpDir::Gt } else { CmpDir::Ge };
    let at_or_after = b.compare(sb, vb, dir);
    let before = b.not(at_or_after);
    let ones = b.convert(before, out);
    b.reduce(ones, &[r as i64], ReduceKind::Sum)
}

/// Rows `idx[i]` of `table` ([N] indices into dim 0): shape [N, table.shape[1..]].
pub fn take_rows(b: &mut Builder, table: Value, idx: Value) -> Value {
    let ts = b.shape(table);
    let n = b.shape(idx)[0];
    let idx = b.convert(idx, DType::I64);
    let idx = b.reshape(idx, &[n, 1]);
    let mut sizes = ts.clone();
    sizes[0] = 1;
    let offs: Vec<i64> = (1..ts.len() as i64).collect();
    b.gather(table, idx, &offs, &[0], &[0], 1, &sizes)
}

/// Combines rows `upd[i]` into `base[idx[i]]`; rows with an index outside `base` are dropped.
pub fn scatter_rows(
    b: &mut Builder,
    base: Value,
    idx: Value,
    upd: Value,
    kind: ReduceKind,
) -> Value {
    let n = b.shape(idx)[0];
    let idx = b.convert(idx, DType::I64);
    let idx = b.reshape(idx, &[n, 1]);
    let win: Vec<i64> = (1..b.rank(upd) as i64).collect();
    b.scatter(base, idx, upd, &win, &[0], &[0], 1, |b, cur, new| {
        b.combine(kind, cur, new)
    })
}

/// Elements `flat[idx]` of `x` flattened, shaped like `idx`.
pub fn take_flat(b: &mut Builder, x: Value, idx: Value) -> Value {
    let n = crate::shape::numel(&b.shape(x));
    let shape = b.shape(idx);
    let flat = b.reshape(x, &[n]);
    let i = b.reshape(idx, &[crate::shape::numel(&shape)]);
    let r = take_rows(b, flat, i);
    b.reshape(r, &shape)
}

/// A scalar constant of `like`'s dtype and shape.
pub fn splat(b: &mut Builder, like: Value, v: f64) -> Value {
    b.splat(like, v)
}

/// `f(values)` over the named operands, promoted together and mapped by `compute`.
pub fn map(
    c: &mut Ctx,
    names: &[&str],
    compute: fn(DType) -> DType,
    f: impl FnOnce(&mut Builder, &[Value]) -> Value,
) -> LResult<Vec<Out>> {
    let (v, _, _) = promote(c, names, compute)?;
    Ok(vec![Out::T(f(c.b, &v))])
}

/// Like `map`, for kernels PyTorch only has for `ok` dtypes (floating, or integral).
pub fn map_only(
    c: &mut Ctx,
    names: &[&str],
    kernel: &str,
    ok: fn(DType) -> bool,
    f: impl FnOnce(&mut Builder, &[Value]) -> Value,
) -> LResult<Vec<Out>> {
    let (v, dt, _) = promote(c, names, same)?;
    if !ok(dt) {
        return not_implemented(kernel, dt);
    }
    Ok(vec![Out::T(f(c.b, &v))])
}

/// `x <dir> k` for a constant `k`.
pub fn cmp_k(b: &mut Builder, x: Value, k: f64, dir: CmpDir) -> Value {
    let kv = b.splat(x, k);
    b.compare(x, kv, dir)
}

/// `p ? k : x` for a constant `k`.
pub fn select_k(b: &mut Builder, p: Value, k: f64, x: Value) -> Value {
    let kv = b.splat(x, k);
    b.select(p, kv, x)
}

/// `x + k` for a constant `k`.
pub fn add_k(b: &mut Builder, x: Value, k: f64) -> Value {
    let kv = b.splat(x, k);
    b.add(x, kv)
}

/// The largest finite value of a float dtype.
pub fn float_max(d: DType) -> f64 {
    match d {
        DType::F16 => 65504.0,
        DType::BF16 => 3.389_531_389_251_535_5e38,
        DType::F32 => f32::MAX as f64,
        _ => f64::MAX,
    }
}

/// Linear-algebra argument checks with PyTorch's messages: `what` of `op` has at least 2
/// dimensions.
pub fn need_matrix(op: &str, what: &str, shape: &[i64]) -> LResult<()> {
    if shape.len() < 2 {
        return user_err(
            ErrorKind::Runtime,
            format!("{op}: The input tensor {what} must have at least 2 dimensions."),
        );
    }
    Ok(())
}

/// Checks a batch of square matrices for `op` ("linalg.cholesky", ...), named `what`.
pub fn need_square(op: &str, what: &str, shape: &[i64]) -> LResult<()> {
    need_matrix(op, what, shape)?;
    let (m, n) = (shape[shape.len() - 2], shape[shape.len() - 1]);
    if m != n {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{op}: {what} must be batches of square matrices, but they are {m} by {n} matrices"
            ),
        );
    }
    Ok(())
}

/// The linalg frontends' dtype check (half types are left to `need_kernel`/`no_half`).
pub fn need_float(op: &str, d: DType) -> LResult<()> {
    if !d.is_float() && !d.is_complex() {
        return user_err(
            ErrorKind::NotImplemented,
            format!(
                "{op}: Expected a floating point or complex tensor as input. Got {}",
                torch_name(d)
            ),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_like_cpp() {
        assert_eq!(fmt_num(1.0), "1");
        assert_eq!(fmt_num(-1.0), "-1");
        assert_eq!(fmt_num(0.1), "0.1");
        assert_eq!(fmt_num(1e-5), "1e-05");
        assert_eq!(fmt_num(60000.0), "60000");
        assert_eq!(fmt_num(1234567.0), "1.23457e+06");
        assert_eq!(fmt_num(0.25), "0.25");
        assert_eq!(fmt_num(1.5), "1.5");
    }

    #[test]
    fn every_op_that_serves_sizes_has_a_rule() {
        for fam in sized_families() {
            for op in fam {
                assert!(lookup(op).is_some(), "{op} serves sizes but has no rule");
                assert!(serves_sizes(op) && serves_sizes(&format!("{op}_")));
            }
        }
        assert!(!serves_sizes("aten::cumsum") && !serves_sizes("aten::sort"));
    }

    #[test]
    fn every_column_major_result_has_its_family_rule() {
        for (fam, rules) in [
            (triangular::COLUMN_MAJOR_RESULTS, triangular::RULES),
            (decomp::COLUMN_MAJOR_RESULTS, decomp::RULES),
        ] {
            for op in fam {
                assert!(
                    rules.iter().any(|(n, _)| n == op),
                    "{op} has no rule in its family"
                );
                assert!(column_major_result(op, 0) && !column_major_result(op, 1));
            }
        }
        assert!(!column_major_result("aten::mm", 0));
    }
}
