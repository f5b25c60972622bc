//! Matrix products.

use crate::args::Scalar;
use crate::promote::torch_name;
use crate::shape::{broadcast_shapes, shape_str, wrap_dim};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};
use stablehlo::{CmpDir, ReduceKind};

use super::{common, mat, Opnd};
use super::{input, opmath};

/// `beta * self + alpha * prod`, skipping the terms PyTorch skips (beta == 0 ignores self,
/// even NaN in it).
fn axpby(c: &mut Ctx, prod: Value) -> LResult<Value> {
    let one = Scalar::Float(1.0);
    let beta = c.args.opt_scalar("beta").unwrap_or(one);
    let alpha = c.args.opt_scalar("alpha").unwrap_or(one);
    let is = super::scalar_is;
    let b = &mut *c.b;
    let shape = b.shape(prod);
    let dt = b.dtype(prod);
    let p = if !is(alpha, 1.0) {
        let k = super::full_scalar(b, dt, &shape, alpha);
        b.mul(prod, k)
    } else {
        prod
    };
    if is(beta, 0.0) {
        return Ok(p);
    }
    let s = c.args.tensor("self")?.clone();
    let sv = mat(b, &Opnd::T(s), dt, &shape);
    let sv = if !is(beta, 1.0) {
        let k = super::full_scalar(b, dt, &shape, beta);
        b.mul(sv, k)
    } else {
        sv
    };
    Ok(b.add(sv, p))
}

fn check_mm(a: &[i64], bshape: &[i64]) -> LResult<()> {
    if a.len() != 2 || bshape.len() != 2 {
        return user_err(ErrorKind::Runtime, "self must be a matrix");
    }
    if a[1] != bshape[0] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "mat1 and mat2 shapes cannot be multiplied ({}x{} and {}x{})",
                a[0], a[1], bshape[0], bshape[1]
            ),
        );
    }
    Ok(())
}

/// Two operands promoted to their common dtype.
fn pair(c: &mut Ctx, x: &str, y: &str) -> LResult<(Value, Value, crate::DType)> {
    let a = c.args.tensor(x)?.clone();
    let bb = c.args.tensor(y)?.clone();
    if a.dtype != bb.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "expected m1 and m2 to have the same dtype, but got: {} != {}",
                crate::promote::torch_name(a.dtype).to_lowercase(),
                crate::promote::torch_name(bb.dtype).to_lowercase()
            ),
        );
    }
    Ok((a.value, bb.value, a.dtype))
}

fn mm_values(b: &mut Builder, x: Value, y: Value) -> Value {
    let dt = b.dtype(x);
    b.dot_general(x, y, (&[], &[]), (&[1], &[0]), dt)
}

fn bmm_values(b: &mut Builder, x: Value, y: Value) -> Value {
    let dt = b.dtype(x);
    b.dot_general(x, y, (&[0], &[0]), (&[2], &[1]), dt)
}

fn mm(c: &mut Ctx, mats: (&str, &str)) -> LResult<Vec<Out>> {
    let (x, y, dt) = pair(c, mats.0, mats.1)?;
    check_mm(&c.b.shape(x), &c.b.shape(y))?;
    // Half types multiply and add self in f32, rounding once (as the CPU's gemm does).
    let x = c.b.convert(x, opmath(dt));
    let y = c.b.convert(y, opmath(dt));
    let p = mm_values(c.b, x, y);
    let r = if c.args.has("self") && mats.0 != "self" {
        axpby(c, p)?
    } else {
        p
    };
    Ok(vec![Out::T(c.b.convert(r, dt))])
}

fn bmm(c: &mut Ctx, mats: (&str, &str)) -> LResult<Vec<Out>> {
    let (x, y, dt) = pair(c, mats.0, mats.1)?;
    let (sx, sy) = (c.b.shape(x), c.b.shape(y));
    if sx.len() != 3 || sy.len() != 3 {
        return user_err(ErrorKind::Runtime, "batch1 must be a 3D tensor");
    }
    if sx[0] != sy[0] || sx[2] != sy[1] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected size for first two dimensions of batch2 tensor to be: [{}, {}] but got: [{}, {}].",
                sx[0], sx[2], sy[0], sy[1]
            ),
        );
    }
    // In f32 for half types, rounding once (as in mm).
    let x = c.b.convert(x, opmath(dt));
    let y = c.b.convert(y, opmath(dt));
    let p = bmm_values(c.b, x, y);
    let r = if c.args.has("self") && mats.0 != "self" {
        axpby(c, p)?
    } else {
        p
    };
    Ok(vec![Out::T(c.b.convert(r, dt))])
}

/// PyTorch's argument checks of `dot` and `vdot`, in its order.
pub(super) fn dot_checks(x: &TensorArg, y: &TensorArg) -> LResult<()> {
    if x.shape.len() != 1 || y.shape.len() != 1 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "1D tensors expected, but got {}D and {}D tensors",
                x.shape.len(),
                y.shape.len()
            ),
        );
    }
    if x.dtype != y.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "dot : expected both vectors to have same dtype, but found {} and {}",
                crate::promote::torch_name(x.dtype),
                crate::promote::torch_name(y.dtype)
            ),
        );
    }
    if x.shape != y.shape {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "inconsistent tensor size, expected tensor [{}] and src [{}] to have the same number of elements, but got {} and {} elements respectively",
                x.shape[0], y.shape[0], x.shape[0], y.shape[0]
            ),
        );
    }
    Ok(())
}

fn dot(c: &mut Ctx) -> LResult<Vec<Out>> {
    dot_checks(c.args.tensor("self")?, c.args.tensor("tensor")?)?;
    let (x, y, dt) = pair(c, "self", "tensor")?;
    Ok(vec![Out::T(c.b.dot_general(
        x,
        y,
        (&[], &[]),
        (&[0], &[0]),
        dt,
    ))])
}

fn mv(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (x, y, dt) = pair(c, if c.args.has("mat") { "mat" } else { "self" }, "vec")?;
    let (sx, sy) = (c.b.shape(x), c.b.shape(y));
    if sx.len() != 2 || sy.len() != 1 || sx[1] != sy[0] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "size mismatch, got input ({}), mat ({}), vec ({})",
                sx[0],
                shape_str(&sx),
                sy[0]
            ),
        );
    }
    let p = c.b.dot_general(x, y, (&[], &[]), (&[1], &[0]), dt);
    let r = if c.args.has("mat") { axpby(c, p)? } else { p };
    Ok(vec![Out::T(r)])
}

/// Outer product (`outer`/`ger`), a broadcasted multiply.
fn outer(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = c.args.tensor("self")?.clone();
    let v = c.args.tensor("vec2")?.clone();
    let (dt, _) = common(&[Opnd::T(a.clone()), Opnd::T(v.clone())])?;
    let shape = [a.shape[0], v.shape[0]];
    let b = &mut *c.b;
    let x = b.convert(a.value, dt);
    let y = b.convert(v.value, dt);
    let x = b.broadcast_in_dim(x, &shape, &[0]);
    let y = b.broadcast_in_dim(y, &shape, &[1]);
    Ok(vec![Out::T(b.mul(x, y))])
}

/// `beta * self + (alpha * vec1) outer vec2`, each step in the result dtype (the CPU kernel
/// rounds half types after every op); bool results are `(beta && self) || (alpha && vec1
/// && vec2)`.
fn addr(c: &mut Ctx) -> LResult<Vec<Out>> {
    let s = c.args.tensor("self")?.clone();
    let v1 = c.args.tensor("vec1")?.clone();
    let v2 = c.args.tensor("vec2")?.clone();
    for (name, v) in [("vec1", &v1), ("vec2", &v2)] {
        if v.shape.len() != 1 {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "addr: Expected 1-D argument {name}, but got {}-D",
                    v.shape.len()
                ),
            );
        }
    }
    let out = [v1.shape[0], v2.shape[0]];
    if c.op.ends_with('_') {
        // In place, self is the result: PyTorch checks its shape instead of expanding it.
        if s.shape.len() != 2 {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "2D tensor expected, got {}D tensor for input",
                    s.shape.len()
                ),
            );
        }
        if s.shape != out {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "size mismatch, input: {}, v1: {}, v2: {}",
                    shape_str(&s.shape),
                    shape_str(&v1.shape),
                    shape_str(&v2.shape)
                ),
            );
        }
    } else {
        super::views::expand_check(&s.shape, &out)?;
    }
    // Promoted like self + vec1 * vec2, without broadcasting the vectors together.
    let dt = crate::promote::result_type(&[&s, &v1, &v2].map(|t| Opnd::T(t.clone()).promo()));
    let coef = |n: &str| c.args.opt_scalar(n).unwrap_or(Scalar::Int(1));
    let (beta, alpha) = (coef("beta"), coef("alpha"));
    for (name, k) in [("beta", beta), ("alpha", alpha)] {
        if !dt.is_float() && matches!(k, Scalar::Float(_)) {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "For integral input tensors, argument {name} must not be a floating point number."
                ),
            );
        }
        if dt != DType::Bool && matches!(k, Scalar::Bool(_)) {
            return user_err(
                ErrorKind::Runtime,
                format!("Boolean {name} only supported for Boolean results."),
            );
        }
    }
    let (beta_s, alpha_s) = (beta, alpha);
    let (beta, alpha) = (beta.as_f64(), alpha.as_f64());
    let b = &mut *c.b;
    let x = b.convert(v1.value, dt);
    let y = b.convert(v2.value, dt);
    let r = if dt == DType::Bool {
        let x = b.broadcast_in_dim(x, &out, &[0]);
        let y = b.broadcast_in_dim(y, &out, &[1]);
        let p = if alpha != 0.0 {
            b.and(x, y)
        } else {
            b.splat(x, 0.0)
        };
        if beta != 0.0 {
            let sv = mat(b, &Opnd::T(s), dt, &out);
            b.or(sv, p)
        } else {
            p
        }
    } else {
        let x = if !super::scalar_is(alpha_s, 1.0) {
            let k = super::full_scalar(b, dt, &[v1.shape[0]], alpha_s);
            b.mul(k, x)
        } else {
            x
        };
        let x = b.broadcast_in_dim(x, &out, &[0]);
        let y = b.broadcast_in_dim(y, &out, &[1]);
        let p = b.mul(x, y);
        // beta == 0 ignores self, even NaN in it.
        if !super::scalar_is(beta_s, 0.0) {
            let mut sv = mat(b, &Opnd::T(s), dt, &out);
            if !super::scalar_is(beta_s, 1.0) {
                let k = super::full_scalar(b, dt, &out, beta_s);
                sv = b.mul(k, sv);
            }
            b.add(sv, p)
        } else {
            p
        }
    };
    Ok(vec![Out::T(r)])
}

fn addbmm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let s = c.args.tensor("self")?.clone();
    let b1 = c.args.tensor("batch1")?.clone();
    let b2 = c.args.tensor("batch2")?.clone();
    for (t, n) in [(&b1, "batch1"), (&b2, "batch2")] {
        if t.shape.len() != 3 {
            return user_err(ErrorKind::Runtime, format!("{n} must be a 3D tensor"));
        }
    }
    if b1.shape[0] != b2.shape[0] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "batch1 and batch2 must have same number of batches, got {} and {}",
                b1.shape[0], b2.shape[0]
            ),
        );
    }
    if b1.shape[2] != b2.shape[1] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Incompatible matrix sizes for bmm ({}x{} and {}x{})",
                b1.shape[1], b1.shape[2], b2.shape[1], b2.shape[2]
            ),
        );
    }
    if s.dtype != b1.dtype || b1.dtype != b2.dtype || s.dtype == DType::Bool {
        return decline("addbmm with mixed dtypes");
    }
    let out = [b1.shape[1], b2.shape[2]];
    if c.op.ends_with('_') && s.shape != out {
        // PyTorch resizes self here; the in-place write cannot.
        return decline("addbmm_ on a self of another shape");
    }
    super::views::expand_check(&s.shape, &out)?;
    let p =
        c.b.dot_general(b1.value, b2.value, (&[], &[]), (&[0, 2], &[0, 1]), s.dtype);
    Ok(vec![Out::T(axpby(c, p)?)])
}

/// `linalg_matrix_exp` by scaling and squaring: A / 2^s (s from A's 1-norm, per matrix) goes
/// through a degree-18 Taylor polynomial, then the result is squared s times in a loop.
fn matrix_exp(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    super::need_square("linalg.matrix_exp", "A", &t.shape)?;
    let r = t.shape.len();
    let n = t.shape[r - 1];
    if !t.dtype.is_float() {
        return user_err(
            ErrorKind::NotImplemented,
            format!(
                "linalg.matrix_exp: Expected a floating point or complex tensor as input. Got {}",
                crate::promote::torch_name(t.dtype)
            ),
        );
    }
    if crate::shape::numel(&t.shape) == 0 {
        return Ok(vec![Out::T(t.value)]);
    }
    let dt = t.dtype;
    let cd = opmath(dt);
    if n == 1 {
        // 1 x 1 matrices take the scalar exp, as the CPU kernel does.
        let x = c.b.convert(t.value, cd);
        let e = c.b.exp(x);
        return Ok(vec![Out::T(c.b.convert(e, dt))]);
    }
    // The 1-norm below which the polynomial is exact to the dtype (PyTorch's degree-18
    // bounds for float and double).
    let theta = if cd == crate::DType::F64 {
        1.090863719290036
    } else {
        3.010066362817634
    };
    let b = &mut *c.b;
    let batch: Vec<i64> = t.shape[..r - 2].to_vec();
    let nb = batch.len();
    let bdims: Vec<i64> = (0..nb as i64).collect();
    let a = b.convert(t.value, cd);
    let mm = |b: &mut Builder, x: Value, y: Value| {
        b.dot_general(x, y, (&bdims, &bdims), (&[nb as i64 + 1], &[nb as i64]), cd)
    };
    // s = clamp(ceil(log2(norm / theta)), 0, 64); NaN norms use 0.
    let abs = b.abs(a);
    let cols = b.reduce(abs, &[nb as i64], stablehlo::ReduceKind::Sum);
    let norm = b.reduce(cols, &[nb as i64], stablehlo::ReduceKind::Max);
    let th = b.splat(norm, theta);
    let ratio = b.div(norm, th);
    let lg = b.log(ratio);
    let ln2 = b.splat(lg, std::f64::consts::LN_2);
    let l2 = b.div(lg, ln2);
    let s = b.unary("stablehlo.ceil", l2);
    let zero = b.splat(s, 0.0);
    let cap = b.splat(s, 64.0);
    let s = b.clamp(zero, s, cap);
    let nan = b.compare(s, s, stablehlo::CmpDir::Ne);
    let s = b.select(nan, zero, s);
    let two = b.splat(s, 2.0);
    let p2 = b.binary("stablehlo.power", two, s);
    let p2 = b.broadcast_in_dim(p2, &t.shape, &bdims);
    let a = b.div(a, p2);
    // Horner: I + A/1 (I + A/2 (I + ... (I + A/18))).
    let ri = b.iota(crate::DType::I64, &t.shape, nb);
    let ci = b.iota(crate::DType::I64, &t.shape, nb + 1);
    let diag = b.compare(ri, ci, stablehlo::CmpDir::Eq);
    let eye = b.convert(diag, cd);
    let mut p = eye;
    for k in (1..=18).rev() {
        let ap = mm(b, a, p);
        let kv = b.splat(ap, k as f64);
        let ap = b.div(ap, kv);
        p = b.add(eye, ap);
    }
    let si = b.convert(s, crate::DType::I32);
    let steps = b.reduce(si, &bdims, stablehlo::ReduceKind::Max);
    let i0 = b.constant(crate::DType::I32, 0.0);
    let shape = t.shape.clone();
    let out = b.while_loop(
        &[i0, p],
        |b, v| b.compare(v[0], steps, stablehlo::CmpDir::Lt),
        |b, v| {
            let (i, x) = (v[0], v[1]);
            let sq = mm(b, x, x);
            let ib = b.broadcast_in_dim(i, &batch, &[]);
            let more = b.compare(ib, si, stablehlo::CmpDir::Lt);
            let more = b.broadcast_in_dim(more, &shape, &bdims);
            let x = b.select(more, sq, x);
            let one = b.constant(crate::DType::I32, 1.0);
            vec![b.add(i, one), x]
        },
    );
    Ok(vec![Out::T(b.convert(out[1], dt))])
}

/// Largest `[groups, rows, cols]` product `_grouped_mm` builds (f32 elements, 64 MiB): it
/// computes every group's product and keeps each row's own, `groups` times the work of the
/// exact product; beyond this the composite kernel (one matmul per group) is cheaper.
const GROUPED_MM_MAX_ELEMS: i64 = 1 << 24;

/// `[G, len]` booleans: index `i` of a `len`-long dimension belongs to group `g` when
/// `offs[g-1] <= i < offs[g]` (`offs[-1]` = 0), the ranges the CPU kernel slices. Where
/// ranges overlap (offsets not ascending) the later group wins, as its write does there.
fn grouped_members(b: &mut Builder, offs: Value, len: i64) -> Value {
    let g = b.shape(offs)[0];
    let offs = b.convert(offs, DType::I64);
    let zero = b.constant(DType::I64, 0.0);
    let zero = b.reshape(zero, &[1]);
    let prev = b.slice_dim(offs, 0, 0, g - 1, 1);
    let starts = b.concatenate(&[zero, prev], 0);
    let i = b.iota(DType::I64, &[g, len], 1);
    let st = b.broadcast_in_dim(starts, &[g, len], &[0]);
    let en = b.broadcast_in_dim(offs, &[g, len], &[0]);
    let ge = b.compare(i, st, stablehlo::CmpDir::Ge);
    let lt = b.compare(i, en, stablehlo::CmpDir::Lt);
    let member = b.and(ge, lt);
    let gi = b.iota(DType::I64, &[g, len], 0);
    let none = b.constant(DType::I64, -1.0);
    let none = b.broadcast_in_dim(none, &[g, len], &[]);
    let owner = b.select(member, gi, none);
    let last = b.reduce(owner, &[0], stablehlo::ReduceKind::Max);
    let last = b.broadcast_in_dim(last, &[g, len], &[1]);
    b.compare(gi, last, stablehlo::CmpDir::Eq)
}

/// Keeps each column's own group of `[G, .., L]` products (`members`: `[G, L]`, on dims
/// `(0, last)`) and sums the groups away: one kept value plus zeros, exact.
fn keep_own_group(b: &mut Builder, prod: Value, members: Value) -> Value {
    let shape = b.shape(prod);
    let last = shape.len() as i64 - 1;
    let m = b.broadcast_in_dim(members, &shape, &[0, last]);
    let zero = b.splat(prod, 0.0);
    let kept = b.select(m, prod, zero);
    b.reduce(kept, &[0], stablehlo::ReduceKind::Sum)
}

/// `torch._grouped_mm` (mixture-of-experts layers): 2d x 3d (rows grouped by `offs`),
/// 3d x 2d (columns), 2d x 2d (the contraction: one product per group) and 3d x 3d (bmm).
/// Every group's product is computed and masked: no host read of the offsets.
fn grouped_mm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = c.args.tensor("self")?.clone();
    let m2 = c.args.tensor("mat2")?.clone();
    let offs = c.args.opt_tensor("offs").cloned();
    for (name, t) in [("mat_a", &a), ("mat_b", &m2)] {
        if !matches!(t.dtype, DType::BF16 | DType::F32 | DType::F16) {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "Expected {name} to be Float32, BFloat16 or Float16 matrix, got {}",
                    crate::promote::torch_name(t.dtype)
                ),
            );
        }
    }
    if a.dtype != m2.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected mat_a and mat_b to have the same dtype, got {} and {}",
                crate::promote::torch_name(a.dtype),
                crate::promote::torch_name(m2.dtype)
            ),
        );
    }
    let (ra, rb) = (a.shape.len(), m2.shape.len());
    if !(2..=3).contains(&ra) {
        return user_err(ErrorKind::Runtime, "mat_a has to be 2 or 3d");
    }
    if !(2..=3).contains(&rb) {
        return user_err(ErrorKind::Runtime, "mat_b has to be 2 or 3d");
    }
    if (ra == 3 || rb == 3) && a.shape[ra - 1] != m2.shape[rb - 2] {
        return user_err(
            ErrorKind::Runtime,
            "contraction dimension of mat_a and mat_b must match",
        );
    }
    if offs.is_some() != (ra == 2 || rb == 2) {
        return user_err(
            ErrorKind::Runtime,
            "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d",
        );
    }
    if let Some(o) = &offs {
        if o.shape.len() != 1 {
            return user_err(ErrorKind::Runtime, "offs has to be 1D");
        }
        if o.dtype != DType::I32 {
            return user_err(ErrorKind::Runtime, "Offsets have to be int32");
        }
    }
    if c.args.opt_tensor("bias").is_some() {
        return user_err(ErrorKind::Runtime, "Bias not supported yet");
    }
    if c.args.opt_dtype("out_dtype").is_some_and(|d| d != a.dtype) {
        return user_err(
            ErrorKind::Runtime,
            "Grouped gemm output dtype must match `mat_a` dtype",
        );
    }
    let groups = offs.as_ref().map_or(a.shape[0], |o| o.shape[0]);
    let batch_ok = match (ra, rb) {
        (2, 3) => m2.shape[0] == groups,
        (3, 2) => a.shape[0] == groups,
        (3, 3) => a.shape[0] == m2.shape[0],
        _ => true,
    };
    if !batch_ok {
        let msg = if ra == 3 && rb == 3 {
            "batched dimension has to match"
        } else {
            "matrix batch sizes have to match"
        };
        return user_err(ErrorKind::Runtime, msg);
    }
    let out_elems = match (ra, rb) {
        (2, 3) => groups * a.shape[0] * m2.shape[2],
        (3, 2) => groups * a.shape[1] * m2.shape[1],
        (2, 2) => groups * a.shape[0] * a.shape[1].max(m2.shape[1]),
        _ => 0,
    };
    if out_elems > GROUPED_MM_MAX_ELEMS {
        return decline("grouped matmul too large for the masked product");
    }
    let dt = a.dtype;
    let b = &mut *c.b;
    let x = b.convert(a.value, opmath(dt));
    let y = b.convert(m2.value, opmath(dt));
    let r = match (ra, rb) {
        (3, 3) => bmm_values(b, x, y),
        (2, 3) => {
            // [M,K] x [G,K,N] -> [M,G,N] -> [G,N,M]: each row keeps its group's product.
            let p = b.dot_general(x, y, (&[], &[]), (&[1], &[1]), opmath(dt));
            let p = b.transpose(p, &[1, 2, 0]);
            let own = grouped_members(b, offs.as_ref().unwrap().value, a.shape[0]);
            let r = keep_own_group(b, p, own);
            b.transpose(r, &[1, 0])
        }
        (3, 2) => {
            // [G,M,K] x [K,N] -> [G,M,N]: each column keeps its group's product.
            let p = b.dot_general(x, y, (&[], &[]), (&[2], &[0]), opmath(dt));
            let own = grouped_members(b, offs.as_ref().unwrap().value, m2.shape[1]);
            keep_own_group(b, p, own)
        }
        _ => {
            // [M,K] x [K,N] -> [G,M,N]: group g contracts over its own range of K only.
            let (m, k) = (a.shape[0], a.shape[1]);
            let own = grouped_members(b, offs.as_ref().unwrap().value, k);
            let shape = [groups, m, k];
            let keep = b.broadcast_in_dim(own, &shape, &[0, 2]);
            let xg = b.broadcast_in_dim(x, &shape, &[1, 2]);
            let zero = b.splat(xg, 0.0);
            let xg = b.select(keep, xg, zero);
            b.dot_general(xg, y, (&[], &[]), (&[2], &[0]), opmath(dt))
        }
    };
    Ok(vec![Out::T(b.convert(r, dt))])
}

/// The ops of this family whose programs may serve a range of sizes (see
/// `super::serves_sizes`).
fn trace(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    if t.shape.len() != 2 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "trace: expected a matrix, but got tensor with dim {}",
                t.shape.len()
            ),
        );
    }
    if t.dtype == DType::Bool {
        return user_err(
            ErrorKind::NotImplemented,
            "\"trace\" not implemented for 'Bool'",
        );
    }
    let dt = if t.dtype.is_float() || t.dtype.is_complex() {
        t.dtype
    } else {
        DType::I64
    };
    let b = &mut *c.b;
    let x = b.convert(t.value, opmath(dt));
    let row = b.iota(DType::I64, &t.shape, 0);
    let col = b.iota(DType::I64, &t.shape, 1);
    let diag = b.compare(row, col, CmpDir::Eq);
    let z = b.splat(x, 0.0);
    let d = b.select(diag, x, z);
    let r = b.reduce(d, &[0, 1], ReduceKind::Sum);
    Ok(vec![Out::T(b.convert(r, dt))])
}

fn linalg_cross(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = input(c)?;
    let y = c.args.tensor("other")?.clone();
    if x.shape.len() != y.shape.len() {
        return user_err(
            ErrorKind::Runtime,
            "linalg.cross: inputs must have the same number of dimensions.",
        );
    }
    let d = c.args.int_or("dim", -1);
    let dim = wrap_dim(d, x.shape.len())?;
    if x.shape.is_empty() || x.shape[dim] != 3 || y.shape[dim] != 3 {
        let (a, bb) = (
            x.shape.get(dim).copied().unwrap_or(1),
            y.shape.get(dim).copied().unwrap_or(1),
        );
        return user_err(
            ErrorKind::Runtime,
            format!("linalg.cross: inputs dimension {d} must have length 3. Got {a} and {bb}"),
        );
    }
    if x.dtype != y.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "expected scalar type {} but found {}",
                torch_name(x.dtype),
                torch_name(y.dtype)
            ),
        );
    }
    if x.dtype == DType::Bool {
        return decline("cross of bool tensors");
    }
    let shape = broadcast_shapes(&x.shape, &y.shape)?;
    let b = &mut *c.b;
    let xv = b.broadcast_to(x.value, &shape);
    let yv = b.broadcast_to(y.value, &shape);
    let xs: Vec<Value> = (0..3).map(|i| b.slice_dim(xv, dim, i, i + 1, 1)).collect();
    let ys: Vec<Value> = (0..3).map(|i| b.slice_dim(yv, dim, i, i + 1, 1)).collect();
    let comp = |b: &mut Builder, i: usize, j: usize| {
        let p = b.mul(xs[i], ys[j]);
        let q = b.mul(xs[j], ys[i]);
        b.sub(p, q)
    };
    let r0 = comp(b, 1, 2);
    let r1 = comp(b, 2, 0);
    let r2 = comp(b, 0, 1);
    Ok(vec![Out::T(b.concatenate(&[r0, r1, r2], dim))])
}

fn vdot(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = input(c)?;
    let y = c.args.tensor("other")?.clone();
    super::linalg::dot_checks(&x, &y)?;
    if x.dtype == DType::Bool {
        return decline("vdot of bool tensors");
    }
    let b = &mut *c.b;
    Ok(vec![Out::T(b.dot_general(
        x.value,
        y.value,
        (&[], &[]),
        (&[0], &[0]),
        x.dtype,
    ))])
}

pub const SERVES_SIZES: &[&str] = &["aten::mm", "aten::bmm", "aten::addmm"];

pub const RULES: &[(&str, Rule)] = &[
    ("aten::mm", |c| mm(c, ("self", "mat2"))),
    ("aten::addmm", |c| mm(c, ("mat1", "mat2"))),
    ("aten::bmm", |c| bmm(c, ("self", "mat2"))),
    ("aten::baddbmm", |c| bmm(c, ("batch1", "batch2"))),
    ("aten::dot", dot),
    ("aten::mv", mv),
    ("aten::addmv", mv),
    ("aten::outer", outer),
    ("aten::addr", addr),
    ("aten::addbmm", addbmm),
    ("aten::linalg_matrix_exp", matrix_exp),
    ("aten::_grouped_mm", grouped_mm),
    ("aten::trace", trace),
    ("aten::linalg_cross", linalg_cross),
    ("aten::vdot", vdot),
];
