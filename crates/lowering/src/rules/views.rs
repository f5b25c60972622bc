//! Ops that rearrange data into a new tensor: cat, flip, roll, repeat, clone.

use crate::shape::{shape_str, wrap_dim};
use crate::{decline, user_err, Ctx, DType, ErrorKind, LResult, Out, Rule};

fn cat(c: &mut Ctx) -> LResult<Vec<Out>> {
    let ts: Vec<_> = c.args.tensors("tensors")?.into_iter().cloned().collect();
    if ts.is_empty() {
        return user_err(
            ErrorKind::Runtime,
            "torch.cat(): expected a non-empty list of Tensors",
        );
    }
    // Legacy behaviour: 1-d empty tensors are skipped.
    let parts: Vec<_> = ts
        .iter()
        .filter(|t| !(t.shape.len() == 1 && t.shape[0] == 0))
        .collect();
    let dt = ts
        .iter()
        .map(|t| t.dtype)
        .reduce(crate::promote::promote_types)
        .unwrap_or(DType::F32);
    if parts.is_empty() {
        return Ok(vec![Out::T(c.b.full(dt, &[0], 0.0))]);
    }
    let rank = parts[0].shape.len();
    if rank == 0 {
        return user_err(
            ErrorKind::Runtime,
            "zero-dimensional tensor (at position 0) cannot be concatenated",
        );
    }
    let dim = wrap_dim(c.args.int_or("dim", 0), rank)?;
    for (i, t) in parts.iter().enumerate() {
        if t.shape.len() != rank {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "Tensors must have same number of dimensions: got {} and {}",
                    rank,
                    t.shape.len()
                ),
            );
        }
        for d in 0..rank {
            if d != dim && t.shape[d] != parts[0].shape[d] {
                return user_err(
                    ErrorKind::Runtime,
                    format!(
                        "Sizes of tensors must match except in dimension {}. Expected size {} but got size {} for tensor number {} in the list.",
                        dim, parts[0].shape[d], t.shape[d], i
                    ),
                );
            }
        }
    }
    let vals: Vec<_> = parts.iter().map(|t| c.b.convert(t.value, dt)).collect();
    Ok(vec![Out::T(c.b.concatenate(&vals, dim))])
}

fn flip(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let dims = c.args.ints("dims")?;
    let mut ds = Vec::new();
    for d in dims {
        let w = wrap_dim(d, t.shape.len())? as i64;
        if ds.contains(&w) {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "dims has duplicates, original flip dims size={}, but unique flip dims size={}",
                    ds.len() + 1,
                    ds.len()
                ),
            );
        }
        ds.push(w);
    }
    if t.shape.is_empty() || ds.is_empty() {
        return Ok(vec![Out::T(t.value)]);
    }
    let ty = c.b.ty(t.value).clone();
    let attrs = format!("dimensions = {}", stablehlo::i64_array(&ds));
    Ok(vec![Out::T(c.b.op(
        "stablehlo.reverse",
        &[t.value],
        &attrs,
        ty,
    ))])
}

fn roll(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let shifts = c.args.ints("shifts")?;
    let dims = c.args.ints("dims").unwrap_or_default();
    if shifts.is_empty() {
        return user_err(ErrorKind::Runtime, "`shifts` required");
    }
    if dims.is_empty() && shifts.len() != 1 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "shifts and dimensions must align. shifts: {}, dims:0",
                shifts.len()
            ),
        );
    }
    if t.shape.is_empty() {
        if let Some(d) = dims.first() {
            return user_err(
                ErrorKind::Index,
                format!("Dimension specified as {d} but tensor has no dimensions"),
            );
        }
    }
    let b = &mut *c.b;
    if dims.is_empty() {
        // Roll the flattened tensor.
        let n: i64 = t.shape.iter().product();
        let flat = b.reshape(t.value, &[n]);
        let r = roll_dim(b, flat, 0, shifts[0], n);
        return Ok(vec![Out::T(b.reshape(r, &t.shape))]);
    }
    if shifts.len() != dims.len() {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "shifts and dimensions must align. shifts: {}, dims:{}",
                shifts.len(),
                dims.len()
            ),
        );
    }
    let mut x = t.value;
    for (s, d) in shifts.iter().zip(dims.iter()) {
        let d = wrap_dim(*d, t.shape.len())?;
        x = roll_dim(b, x, d, *s, t.shape[d]);
    }
    Ok(vec![Out::T(x)])
}

fn roll_dim(
    b: &mut stablehlo::Builder,
    x: stablehlo::Value,
    d: usize,
    shift: i64,
    n: i64,
) -> stablehlo::Value {
    if n == 0 {
        return x;
    }
    let s = shift.rem_euclid(n);
    if s == 0 {
        return x;
    }
    let tail = b.slice_dim(x, d, n - s, n, 1);
    let head = b.slice_dim(x, d, 0, n - s, 1);
    b.concatenate(&[tail, head], d)
}

fn repeat(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let reps = c.args.ints("repeats")?;
    if reps.len() < t.shape.len() {
        return user_err(
            ErrorKind::Runtime,
            "Number of dimensions of repeat dims can not be smaller than number of dimensions of tensor",
        );
    }
    let b = &mut *c.b;
    let pad = reps.len() - t.shape.len();
    let mut src = vec![1; pad];
    src.extend_from_slice(&t.shape);
    // Broadcast to [r0, s0, r1, s1, ...] then merge pairs.
    let mut big = Vec::new();
    let mut dims = Vec::new();
    for (i, (r, s)) in reps.iter().zip(src.iter()).enumerate() {
        big.push(*r);
        big.push(*s);
        dims.push((2 * i + 1) as i64);
    }
    let x = b.reshape(t.value, &src);
    let x = b.broadcast_in_dim(x, &big, &dims);
    let out: Vec<i64> = reps.iter().zip(src.iter()).map(|(r, s)| r * s).collect();
    let _ = shape_str(&out);
    Ok(vec![Out::T(b.reshape(x, &out))])
}

fn clone(c: &mut Ctx) -> LResult<Vec<Out>> {
    Ok(vec![Out::T(c.t("self")?)])
}

/// `narrow_copy`: a slice along `dim`, with the checks and words of the CPU kernel (which
/// differ from `narrow`'s: an out-of-range non-negative dim and a negative length).
fn narrow_copy(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let (dim, start, len) = (
        c.args.int("dim")?,
        c.args.int("start")?,
        c.args.int("length")?,
    );
    let r = t.shape.len();
    if r == 0 {
        return user_err(
            ErrorKind::Runtime,
            "narrow() cannot be applied to a 0-dim tensor.",
        );
    }
    if dim >= r as i64 {
        return user_err(ErrorKind::Runtime, "Expected dim < static_cast<int64_t>(self_sizes.size()) to be true, but got false.  (Could this error message be improved?  If so, please report an enhancement request to PyTorch.)");
    }
    let d = wrap_dim(dim, r)?;
    let n = t.shape[d];
    if start < -n || start > n {
        return user_err(
            ErrorKind::Index,
            format!(
                "start out of range (expected to be in range of [{}, {n}], but got {start})",
                -n
            ),
        );
    }
    let start = if start < 0 { start + n } else { start };
    if len < 0 || start > n - len {
        return user_err(
            ErrorKind::Runtime,
            format!("start ({start}) + length ({len}) exceeds dimension size ({n})."),
        );
    }
    Ok(vec![Out::T(c.b.slice_dim(
        t.value,
        d,
        start,
        start + len,
        1,
    ))])
}

/// `dst.copy_(src)` as a value: src converted to dst's dtype and expanded to its size.
fn copy(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let dt = c.args.opt_dtype("dtype").unwrap_or(t.dtype);
    let size = c.args.ints("size")?;
    expand_check(&t.shape, &size)?;
    let v = c.b.convert(t.value, dt);
    Ok(vec![Out::T(c.b.broadcast_to(v, &size))])
}

/// PyTorch's `expand` check, with its message.
pub fn expand_check(from: &[i64], to: &[i64]) -> LResult<()> {
    let bad = from.len() > to.len()
        || from
            .iter()
            .rev()
            .zip(to.iter().rev())
            .any(|(f, t)| *f != *t && *f != 1);
    if bad {
        let i = from
            .iter()
            .rev()
            .zip(to.iter().rev())
            .position(|(f, t)| *f != *t && *f != 1)
            .unwrap_or(0);
        let d = to.len().saturating_sub(1 + i);
        return user_err(
            ErrorKind::Runtime,
            format!(
                "The expanded size of the tensor ({}) must match the existing size ({}) at non-singleton dimension {}.  Target sizes: {}.  Tensor sizes: {}",
                to.get(d).copied().unwrap_or(0),
                from.get(from.len().saturating_sub(1 + i)).copied().unwrap_or(0),
                d,
                shape_str(to),
                shape_str(from)
            ),
        );
    }
    Ok(())
}

/// The dtype a factory computes in: the out= tensor's, else `dtype`, else PyTorch's default.
fn factory_dtype(c: &Ctx, default: DType) -> DType {
    c.out_dtypes
        .first()
        .copied()
        .or(c.args.opt_dtype("dtype"))
        .unwrap_or(default)
}

fn arange(c: &mut Ctx) -> LResult<Vec<Out>> {
    let start = c
        .args
        .opt_scalar("start")
        .unwrap_or(crate::args::Scalar::Int(0));
    let end = c.args.scalar("end")?;
    let step = c
        .args
        .opt_scalar("step")
        .unwrap_or(crate::args::Scalar::Int(1));
    let is_int = |s: crate::args::Scalar| !matches!(s, crate::args::Scalar::Float(_));
    let default = if is_int(start) && is_int(end) && is_int(step) {
        DType::I64
    } else {
        DType::F32
    };
    let dt = factory_dtype(c, default);
    let (s, e, st) = (start.as_f64(), end.as_f64(), step.as_f64());
    if st == 0.0 {
        return user_err(ErrorKind::Runtime, "step must be nonzero");
    }
    if !s.is_finite() || !e.is_finite() {
        return user_err(ErrorKind::Runtime, format!("unsupported range: {s} -> {e}"));
    }
    if (st > 0.0 && e < s) || (st < 0.0 && e > s) {
        return user_err(
            ErrorKind::Runtime,
            "upper bound and larger bound inconsistent with step sign",
        );
    }
    let n = ((e - s) / st).ceil().max(0.0) as i64;
    let b = &mut *c.b;
    let v = if dt.is_float() {
        let i = b.iota(DType::F64, &[n], 0);
        let k = b.full(DType::F64, &[n], st);
        let t = b.mul(i, k);
        let o = b.full(DType::F64, &[n], s);
        let t = b.add(o, t);
        b.convert(t, dt)
    } else {
        let i = b.iota(DType::I64, &[n], 0);
        let k = b.full(DType::I64, &[n], st);
        let t = b.mul(i, k);
        let o = b.full(DType::I64, &[n], s);
        let t = b.add(o, t);
        b.convert(t, dt)
    };
    Ok(vec![Out::T(v)])
}

/// `_efficientzerotensor` (autograd's zero gradients, e.g. sgn's on real inputs): a plain
/// zero tensor, as the device has no ZeroTensor layout.
fn efficient_zeros(c: &mut Ctx) -> LResult<Vec<Out>> {
    let size = c.args.ints("size")?;
    if let Some(d) = size.iter().find(|d| **d < 0) {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Trying to create tensor with negative dimension {d}: {}",
                shape_str(&size)
            ),
        );
    }
    let dt = factory_dtype(c, DType::F32);
    Ok(vec![Out::T(c.b.full(dt, &size, 0.0))])
}

/// `steps`, else PyTorch's error for a negative count.
fn steps(c: &Ctx) -> LResult<i64> {
    let n = c.args.int("steps")?;
    if n < 0 {
        return user_err(ErrorKind::Runtime, "number of steps must be non-negative");
    }
    Ok(n)
}

/// A bound of linspace/logspace (a Python number or a 0-d tensor) as a scalar of `dt`.
fn bound(
    b: &mut stablehlo::Builder,
    a: &crate::Args,
    name: &str,
    dt: DType,
) -> LResult<stablehlo::Value> {
    match a.opt_tensor(name) {
        Some(t) => {
            let v = b.convert(t.value, dt);
            Ok(b.reshape(v, &[]))
        }
        None => Ok(super::full_scalar(b, dt, &[], a.scalar(name)?)),
    }
}

fn linspace(c: &mut Ctx) -> LResult<Vec<Out>> {
    let n = steps(c)?;
    let dt = factory_dtype(c, DType::F32);
    // The ramp in double precision (complex128 for complex results).
    let wide = if dt.is_complex() {
        DType::C128
    } else {
        DType::F64
    };
    let b = &mut *c.b;
    let s = bound(b, c.args, "start", wide)?;
    let e = bound(b, c.args, "end", wide)?;
    let d = b.sub(e, s);
    let den = b.constant(wide, (n - 1).max(1) as f64);
    let step = b.div(d, den);
    let v = super::ramp(b, s, e, step, n);
    Ok(vec![Out::T(b.convert(v, dt))])
}

/// `logspace`: `base ** x` over the ramp, as the CPU computes it: the bounds rounded to the
/// result dtype (their difference too), the ramp and the power in f64.
fn logspace(c: &mut Ctx) -> LResult<Vec<Out>> {
    let n = steps(c)?;
    let dt = factory_dtype(c, DType::F32);
    let base = c.args.opt_float("base").unwrap_or(10.0);
    let b = &mut *c.b;
    let s = bound(b, c.args, "start", dt)?;
    let e = bound(b, c.args, "end", dt)?;
    let wide = if dt.is_complex() {
        DType::C128
    } else {
        DType::F64
    };
    let d = b.sub(e, s);
    let d = b.convert(d, wide);
    let den = b.constant(wide, (n - 1).max(1) as f64);
    let step = b.div(d, den);
    let s = b.convert(s, wide);
    let e = b.convert(e, wide);
    let x = super::ramp(b, s, e, step, n);
    let k = b.splat(x, base);
    let v = b.binary("stablehlo.power", k, x);
    Ok(vec![Out::T(b.convert(v, dt))])
}

/// `tril_indices`/`triu_indices`: the (row, col) pairs on one side of diagonal `offset` of a
/// row x col matrix, row-major; made at lowering time (they depend on the arguments only).
fn tri_indices(c: &mut Ctx, lower: bool) -> LResult<Vec<Out>> {
    let name = if lower {
        "tril_indices"
    } else {
        "triu_indices"
    };
    let row = c.args.int("row")?;
    let col = c.args.int("col")?;
    let offset = c.args.int_or("offset", 0);
    for (what, v) in [("row", row), ("col", col)] {
        if v < 0 {
            return user_err(
                ErrorKind::Runtime,
                format!("{what} must be non-negative, got{v}"),
            );
        }
    }
    let dt = factory_dtype(c, DType::I64);
    if !matches!(dt, DType::I32 | DType::I64) {
        return super::not_implemented(name, dt);
    }
    let (mut rows, mut cols) = (Vec::new(), Vec::new());
    for r in 0..row {
        // The columns of row r on the wanted side of the diagonal k - r = offset.
        let ks = if lower {
            0..r.saturating_add(offset).saturating_add(1).clamp(0, col)
        } else {
            r.saturating_add(offset).clamp(0, col)..col
        };
        if rows.len() as i64 + ks.end - ks.start > 1 << 20 {
            return decline(format!("{name} of more than 2^20 pairs"));
        }
        for k in ks {
            rows.push(r);
            cols.push(k);
        }
    }
    let n = rows.len() as i64;
    rows.extend(cols);
    let b = &mut *c.b;
    let v = b.constant_vec_i64(&rows);
    let v = b.reshape(v, &[2, n]);
    Ok(vec![Out::T(b.convert(v, dt))])
}

/// `eye(n, m)`: ones on the main diagonal of an n x m matrix.
fn eye(c: &mut Ctx) -> LResult<Vec<Out>> {
    let n = c.args.int("n")?;
    let m = c.args.opt_int("m").unwrap_or(n);
    for (name, v) in [("n", n), ("m", m)] {
        if v < 0 {
            return user_err(
                ErrorKind::Runtime,
                format!("{name} must be greater or equal to 0, got {v}"),
            );
        }
    }
    let dt = factory_dtype(c, DType::F32);
    let b = &mut *c.b;
    let r = b.iota(DType::I64, &[n, m], 0);
    let k = b.iota(DType::I64, &[n, m], 1);
    let d = b.compare(r, k, stablehlo::CmpDir::Eq);
    Ok(vec![Out::T(b.convert(d, dt))])
}

/// `channel_shuffle`: channels [g, c / g] regrouped as [c / g, g].
fn channel_shuffle(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    let g = c.args.int("groups")?;
    if t.shape.len() <= 2 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "channel_shuffle expects input with > 2 dims, but got input with sizes {}",
                shape_str(&t.shape)
            ),
        );
    }
    if g <= 0 {
        return user_err(
            ErrorKind::Runtime,
            format!("Number of groups to divide channels in must be positive. Value of groups:{g}"),
        );
    }
    let ch = t.shape[1];
    if ch % g != 0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Number of channels must be divisible by groups. Got {ch} channels and {g} groups."
            ),
        );
    }
    let mut split = vec![t.shape[0], g, ch / g];
    split.extend_from_slice(&t.shape[2..]);
    let mut perm: Vec<i64> = vec![0, 2, 1];
    perm.extend(3..split.len() as i64);
    let b = &mut *c.b;
    let x = b.reshape(t.value, &split);
    let x = b.transpose(x, &perm);
    Ok(vec![Out::T(b.reshape(x, &t.shape))])
}

/// The ops of this family whose programs may serve a range of sizes (see
/// `super::serves_sizes`).
pub const SERVES_SIZES: &[&str] = &["aten::cat", "aten::flip", "torch_pjrt::copy"];

pub const RULES: &[(&str, Rule)] = &[
    ("aten::cat", cat),
    ("aten::flip", flip),
    ("aten::roll", roll),
    ("aten::repeat", repeat),
    ("aten::clone", clone),
    ("aten::narrow_copy", narrow_copy),
    ("torch_pjrt::copy", copy),
    ("aten::arange", arange),
    ("aten::linspace", linspace),
    ("aten::logspace", logspace),
    ("aten::_efficientzerotensor", efficient_zeros),
    ("aten::tril_indices", |c| tri_indices(c, true)),
    ("aten::triu_indices", |c| tri_indices(c, false)),
    ("aten::eye", eye),
    ("aten::channel_shuffle", channel_shuffle),
];
