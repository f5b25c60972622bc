//! Triangular matrices and the dense linear algebra XLA has natively: tril/triu, Cholesky
//! factors, solves and inverses, triangular solves.

use crate::promote::torch_name;
use crate::shape::{broadcast_shapes, numel};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};
use stablehlo::{CmpDir, ReduceKind};

use super::{input, is_half, need_float, need_matrix, need_square};

fn tril_triu(c: &mut Ctx, lower: bool) -> LResult<Vec<Out>> {
    let t = input(c)?;
    if t.shape.len() < 2 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{}: input tensor must have at least 2 dimensions",
                if lower { "tril" } else { "triu" }
            ),
        );
    }
    let k = c.args.int_or("diagonal", 0);
    let b = &mut *c.b;
    let mask = super::tri_mask(b, &t.shape, lower, k);
    let z = b.splat(t.value, 0.0);
    Ok(vec![Out::T(b.select(mask, t.value, z))])
}

/// The LAPACK-backed ops' dtype check: floating point, and no half types (the CPU has no
/// half kernels for them).
fn check_float(op: &str, d: DType) -> LResult<()> {
    need_float(op, d)?;
    if is_half(d) {
        return decline("LAPACK ops reject half types");
    }
    Ok(())
}

fn cholesky_ex(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = input(c)?;
    need_square("linalg.cholesky", "A", &a.shape)?;
    check_float("linalg.cholesky", a.dtype)?;
    if c.args.bool_or("check_errors", false) {
        return decline("check_errors reads the info on the host");
    }
    let upper = c.args.bool_or("upper", false);
    let b = &mut *c.b;
    let shape = a.shape.clone();
    let r = shape.len();
    let n = shape[r - 1];
    let batch = &shape[..r - 2];
    if n == 0 {
        let info = b.full(DType::I32, batch, 0.0);
        return Ok(vec![Out::T(a.value), Out::T(info)]);
    }
    let l = b.cholesky(a.value, !upper);
    let keep = super::tri_mask(b, &shape, !upper, 0);
    let z = b.splat(l, 0.0);
    let l = b.select(keep, l, z);
    // info: 1 + the first column whose pivot is not positive (NaN included), else 0.
    let on_diag = super::tri_mask(b, &shape, true, 0);
    let on_upper = super::tri_mask(b, &shape, false, 0);
    let on_diag = b.and(on_diag, on_upper);
    let d = b.select(on_diag, l, z);
    let d = b.reduce(d, &[r as i64 - 1], ReduceKind::Sum);
    let dz = b.splat(d, 0.0);
    let ok = b.compare(d, dz, CmpDir::Gt);
    let dshape = b.shape(d);
    let pos = b.iota(DType::I32, &dshape, r - 2);
    let one = b.full(DType::I32, &dshape, 1.0);
    let pos = b.add(pos, one);
    let none = b.full(DType::I32, &dshape, (n + 1) as f64);
    let bad = b.select(ok, none, pos);
    let first = b.reduce(bad, &[r as i64 - 2], ReduceKind::Min);
    let past = b.splat(first, (n + 1) as f64);
    let zero = b.splat(first, 0.0);
    let found = b.compare(first, past, CmpDir::Lt);
    let info = b.select(found, first, zero);
    Ok(vec![Out::T(l), Out::T(info)])
}

/// `a` [..., n, n] and `rhs` [..., p, q] broadcast to a common batch.
fn batch_pair(b: &mut Builder, a: &TensorArg, rhs: &TensorArg) -> LResult<(Value, Value)> {
    let (ra, rb) = (a.shape.len(), rhs.shape.len());
    let batch = broadcast_shapes(&a.shape[..ra - 2], &rhs.shape[..rb - 2])?;
    let mut sa = batch.clone();
    sa.extend_from_slice(&a.shape[ra - 2..]);
    let mut sb = batch;
    sb.extend_from_slice(&rhs.shape[rb - 2..]);
    Ok((b.broadcast_to(a.value, &sa), b.broadcast_to(rhs.value, &sb)))
}

fn solve(
    b: &mut Builder,
    a: Value,
    rhs: Value,
    left: bool,
    lower: bool,
    unit: bool,
    transpose: bool,
) -> Value {
    if numel(&b.shape(rhs)) == 0 || numel(&b.shape(a)) == 0 {
        let s = b.shape(rhs);
        return b.full(b.dtype(rhs), &s, 0.0);
    }
    b.triangular_solve(a, rhs, left, lower, unit, transpose)
}

fn triangular_solve(c: &mut Ctx) -> LResult<Vec<Out>> {
    let rhs = input(c)?;
    let a = c.args.tensor("A")?.clone();
    for (t, n) in [(&rhs, "b"), (&a, "A")] {
        if t.shape.len() < 2 {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "torch.triangular_solve: Expected {n} to have at least 2 dimensions, but it has {} dimensions instead",
                    t.shape.len()
                ),
            );
        }
    }
    if rhs.dtype != a.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected b and A to have the same dtype, but found b of type {} and A of type {} instead.",
                torch_name(rhs.dtype),
                torch_name(a.dtype)
            ),
        );
    }
    let (ra, rb) = (a.shape.len(), rhs.shape.len());
    let (an, am) = (a.shape[ra - 2], a.shape[ra - 1]);
    if an != am || am != rhs.shape[rb - 2] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Incompatible matrix sizes for triangular_solve: each A matrix is {an} by {am} but each b matrix is {} by {}",
                rhs.shape[rb - 2],
                rhs.shape[rb - 1]
            ),
        );
    }
    if !a.dtype.is_float() && !a.dtype.is_complex() {
        return super::not_implemented("triangular_solve_cpu", a.dtype);
    }
    if is_half(a.dtype) {
        return decline("LAPACK ops reject half types");
    }
    let upper = c.args.bool_or("upper", true);
    let trans = c.args.bool_or("transpose", false);
    let unit = c.args.bool_or("unitriangular", false);
    let b = &mut *c.b;
    let (av, bv) = batch_pair(b, &a, &rhs)?;
    let x = solve(b, av, bv, true, !upper, unit, trans);
    Ok(vec![Out::T(x), Out::T(av)])
}

fn solve_triangular(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = input(c)?;
    let rhs = c.args.tensor("B")?.clone();
    const OP: &str = "linalg.solve_triangular";
    need_matrix(OP, "A", &a.shape)?;
    need_matrix(OP, "B", &rhs.shape)?;
    need_square(OP, "A", &a.shape)?;
    let left = c.args.bool_or("left", true);
    let (ra, rb) = (a.shape.len(), rhs.shape.len());
    let n = a.shape[ra - 1];
    let fits = if left {
        rhs.shape[rb - 2] == n
    } else {
        rhs.shape[rb - 1] == n
    };
    if !fits {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{OP}: Incompatible shapes of A and B for the equation {} ({n}x{n} and {}x{})",
                if left { "AX = B" } else { "XA = B" },
                rhs.shape[rb - 2],
                rhs.shape[rb - 1]
            ),
        );
    }
    check_float(OP, a.dtype)?;
    if rhs.dtype != a.dtype {
        return decline("solve_triangular with mixed dtypes");
    }
    let upper = c.args.bool_or("upper", false);
    let unit = c.args.bool_or("unitriangular", false);
    let b = &mut *c.b;
    let (av, bv) = batch_pair(b, &a, &rhs)?;
    Ok(vec![Out::T(solve(b, av, bv, left, !upper, unit, false))])
}

/// Solves (L L^T) X = B from the factor (U^T U with `upper`).
fn cholesky_solve_values(b: &mut Builder, f: Value, rhs: Value, upper: bool) -> Value {
    let y = solve(b, f, rhs, true, !upper, false, upper);
    solve(b, f, y, true, !upper, false, !upper)
}

fn cholesky_solve_helper(c: &mut Ctx) -> LResult<Vec<Out>> {
    let rhs = input(c)?;
    let f = c.args.tensor("A")?.clone();
    let bad = !f.dtype.is_float() || is_half(f.dtype) || f.dtype != rhs.dtype;
    if bad || f.shape.len() < 2 || rhs.shape.len() < 2 {
        return decline("cholesky_solve needs float matrices of one dtype");
    }
    let upper = c.args.bool_or("upper", false);
    let b = &mut *c.b;
    let (fv, bv) = batch_pair(b, &f, &rhs)?;
    Ok(vec![Out::T(cholesky_solve_values(b, fv, bv, upper))])
}

fn cholesky_inverse(c: &mut Ctx) -> LResult<Vec<Out>> {
    let f = input(c)?;
    need_square("cholesky_inverse", "A", &f.shape)?;
    if !f.dtype.is_float() {
        return super::not_implemented("cholesky_inverse_out_cpu", f.dtype);
    }
    if is_half(f.dtype) {
        return decline("LAPACK ops reject half types");
    }
    let upper = c.args.bool_or("upper", false);
    let b = &mut *c.b;
    let r = f.shape.len();
    let row = b.iota(DType::I64, &f.shape, r - 2);
    let col = b.iota(DType::I64, &f.shape, r - 1);
    let eye = b.compare(row, col, CmpDir::Eq);
    let eye = b.convert(eye, f.dtype);
    Ok(vec![Out::T(cholesky_solve_values(b, f.value, eye, upper))])
}

pub const SERVES_SIZES: &[&str] = &["aten::tril", "aten::triu"];

/// The ops of this family whose first result PyTorch lays out column-major (see
/// `super::column_major_result`).
pub const COLUMN_MAJOR_RESULTS: &[&str] = &["aten::linalg_solve_triangular"];

pub const RULES: &[(&str, Rule)] = &[
    ("aten::tril", |c| tril_triu(c, true)),
    ("aten::triu", |c| tril_triu(c, false)),
    ("aten::linalg_cholesky_ex", cholesky_ex),
    ("aten::triangular_solve", triangular_solve),
    ("aten::linalg_solve_triangular", solve_triangular),
    ("aten::_cholesky_solve_helper", cholesky_solve_helper),
    ("aten::cholesky_inverse", cholesky_inverse),
];
