//! Matrix decompositions. LU with partial pivoting is a `while` loop over columns in
//! LAPACK's getf2 order (so pivots match the CPU's), and solve, inverse, det and slogdet
//! build on it. QR, Householder products and the symmetric eigendecomposition are custom
//! calls XLA's compiler expands itself ("Qr", "ProductOfElementaryHouseholderReflectors",
//! "Eigh"). SVD is one-sided Jacobi (Hestenes) with a round-robin pair ordering, U then
//! comes from a QR of the orthogonalized columns (which also completes it).
//!
//! Checks that need the data (pivots out of range in lu_unpack/lu_solve, `check_errors`)
//! are not made: the first makes garbage instead of an error, the second declines.

use stablehlo::{CmpDir, ReduceKind};

use super::{is_half, need_float, need_matrix, need_square};
use crate::promote::torch_name;
use crate::shape::{broadcast_shapes, numel, shape_str};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, TensorType,
    Value,
};

// ---------------------------------------------------------------------------
// Argument checks (PyTorch's messages)
// ---------------------------------------------------------------------------

fn tensor(c: &Ctx, name: &str) -> LResult<TensorArg> {
    Ok(c.args.tensor(name)?.clone())
}

/// The dtype dispatch of the CPU kernel `kernel` (float32/float64 and complex only).
fn need_kernel(kernel: &str, d: DType) -> LResult<()> {
    if !(d.is_float() || d.is_complex()) || is_half(d) {
        return super::not_implemented(kernel, d);
    }
    Ok(())
}

fn no_half(op: &str, d: DType) -> LResult<()> {
    if is_half(d) {
        return user_err(
            ErrorKind::NotImplemented,
            format!(
                "{op}: Low precision dtypes not supported. Got {}",
                torch_name(d)
            ),
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Shape and index helpers
// ---------------------------------------------------------------------------

/// (batch dims, rows, cols) of a batched matrix shape.
fn split(shape: &[i64]) -> (Vec<i64>, i64, i64) {
    let r = shape.len();
    (shape[..r - 2].to_vec(), shape[r - 2], shape[r - 1])
}

fn cat(a: &[i64], b: &[i64]) -> Vec<i64> {
    let mut v = a.to_vec();
    v.extend_from_slice(b);
    v
}

fn upto(n: usize) -> Vec<i64> {
    (0..n as i64).collect()
}

fn i32c(b: &mut Builder, v: i64) -> Value {
    b.constant(DType::I32, v as f64)
}

/// `x` [batch..., v] broadcast to `shape` [batch..., p, q], its last dim on `dim`.
fn along(b: &mut Builder, x: Value, shape: &[i64], dim: usize) -> Value {
    let mut dims = upto(b.rank(x) - 1);
    dims.push(dim as i64);
    b.broadcast_in_dim(x, shape, &dims)
}

/// `x` [batch...] broadcast over the trailing dims of `shape`.
fn per_batch(b: &mut Builder, x: Value, shape: &[i64]) -> Value {
    let dims = upto(b.rank(x));
    b.broadcast_in_dim(x, shape, &dims)
}

/// Swaps the last two dims.
fn mt(b: &mut Builder, x: Value) -> Value {
    let r = b.rank(x);
    let mut p = upto(r);
    p.swap(r - 2, r - 1);
    b.transpose(x, &p)
}

/// Identity matrices [batch..., m, n] of `dtype`.
fn eye(b: &mut Builder, dtype: DType, batch: &[i64], m: i64, n: i64) -> Value {
    let s = cat(batch, &[m, n]);
    let r = s.len();
    let i = b.iota(DType::I32, &s, r - 2);
    let j = b.iota(DType::I32, &s, r - 1);
    let e = b.compare(i, j, CmpDir::Eq);
    b.convert(e, dtype)
}

/// `x` with the elements outside the band zeroed (tril with `lower`, else triu).
fn tri(b: &mut Builder, x: Value, lower: bool, k: i64) -> Value {
    let s = b.shape(x);
    let keep = super::tri_mask(b, &s, lower, k);
    let z = b.splat(x, 0.0);
    b.select(keep, x, z)
}

/// The main diagonal [batch..., min(m, n)].
fn diagonal(b: &mut Builder, x: Value) -> Value {
    let s = b.shape(x);
    let (batch, m, n) = split(&s);
    let k = m.min(n);
    let r = s.len();
    let sq = b.slice_dim(x, r - 2, 0, k, 1);
    let sq = b.slice_dim(sq, r - 1, 0, k, 1);
    let e = eye(b, DType::Bool, &batch, k, k);
    let z = b.splat(sq, 0.0);
    let d = b.select(e, sq, z);
    b.reduce(d, &[r as i64 - 1], ReduceKind::Sum)
}

/// `x` with entry `j` (0-d i32) of dim `dim` taken out (that dim dropped).
fn take(b: &mut Builder, x: Value, dim: usize, j: Value) -> Value {
    let shape = b.shape(x);
    let z = i32c(b, 0);
    let mut starts = vec![z; shape.len()];
    starts[dim] = j;
    let mut sizes = shape.clone();
    sizes[dim] = 1;
    let s = b.dynamic_slice(x, &starts, &sizes);
    let mut out = shape;
    out.remove(dim);
    b.reshape(s, &out)
}

/// Swaps, in every batch, entry `j` (0-d i32) with entry `p` ([batch] i32) along `dim`, the
/// first dim after the batch dims.
fn swap(b: &mut Builder, x: Value, dim: usize, j: Value, p: Value) -> Value {
    let shape = b.shape(x);
    let idx = b.iota(DType::I32, &shape, dim);
    let jb = b.broadcast_in_dim(j, &shape, &[]);
    let pb = per_batch(b, p, &shape);
    let at_j = b.compare(idx, jb, CmpDir::Eq);
    let at_p = b.compare(idx, pb, CmpDir::Eq);
    let row_j = take(b, x, dim, j);
    let z = b.splat(x, 0.0);
    let only_p = b.select(at_p, x, z);
    let row_p = b.reduce(only_p, &[dim as i64], ReduceKind::Sum);
    let rest: Vec<i64> = (0..shape.len() as i64)
        .filter(|d| *d != dim as i64)
        .collect();
    let row_j = b.broadcast_in_dim(row_j, &shape, &rest);
    let row_p = b.broadcast_in_dim(row_p, &shape, &rest);
    let x = b.select(at_p, row_j, x);
    b.select(at_j, row_p, x)
}

/// Rows of `x` [batch..., m, q] picked per batch by `idx` [batch..., m] (i32):
/// out[.., i, :] = x[.., idx[i], :].
fn gather_rows(b: &mut Builder, x: Value, idx: Value) -> Value {
    let shape = b.shape(x);
    let (batch, m, q) = split(&shape);
    let nbt = numel(&batch);
    if nbt * m * q == 0 {
        return x;
    }
    let flat = b.reshape(x, &[nbt * m, q]);
    let idx = b.reshape(idx, &[nbt, m]);
    let base = b.iota(DType::I32, &[nbt, m], 0);
    let mm = b.full(DType::I32, &[nbt, m], m as f64);
    let base = b.mul(base, mm);
    let idx = b.add(idx, base);
    let idx = b.reshape(idx, &[nbt * m, 1]);
    let g = b.gather(flat, idx, &[1], &[0], &[0], 1, &[1, q]);
    b.reshape(g, &shape)
}

/// Columns of `x` [batch..., p, m] picked per batch by `idx` [batch..., m].
fn gather_cols(b: &mut Builder, x: Value, idx: Value) -> Value {
    let t = mt(b, x);
    let g = gather_rows(b, t, idx);
    mt(b, g)
}

/// The inverse of permutations `perm` [batch..., m] (i32).
fn inverse_perm(b: &mut Builder, perm: Value) -> Value {
    let shape = b.shape(perm);
    let dim = shape.len() - 1;
    let idx = b.iota(DType::I32, &shape, dim);
    let r = b.sort(&[perm, idx], dim, false, |b, a| {
        b.compare(a[0], a[1], CmpDir::Lt)
    });
    r[1]
}

// ---------------------------------------------------------------------------
// LU
// ---------------------------------------------------------------------------

/// LU with partial pivoting of `a` [batch..., m, n]: (LU packed as LAPACK packs it,
/// pivots [batch..., min(m, n)] i32 1-based, info [batch...] i32, perm [batch..., m] i32)
/// where row i of P^T A is row perm[i] of A.
fn lu_factor(b: &mut Builder, a: Value) -> (Value, Value, Value, Value) {
    let shape = b.shape(a);
    let (batch, m, n) = split(&shape);
    let nb = batch.len();
    let k = m.min(n);
    let perm = b.iota(DType::I32, &cat(&batch, &[m]), nb);
    let piv = b.iota(DType::I32, &cat(&batch, &[k]), nb);
    let one = b.splat(piv, 1.0);
    let piv = b.add(piv, one);
    let info = b.full(DType::I32, &batch, 0.0);
    if k == 0 || numel(&batch) == 0 {
        return (a, piv, info, perm);
    }
    let j = i32c(b, 0);
    let out = b.while_loop(
        &[j, a, piv, info, perm],
        |b, v| {
            let lim = i32c(b, k);
            b.compare(v[0], lim, CmpDir::Lt)
        },
        lu_step,
    );
    (out[1], out[2], out[3], out[4])
}

/// |x| as LAPACK's i?amax ranks pivots: |re| + |im| for complex numbers.
fn pivot_magnitude(b: &mut Builder, x: Value) -> Value {
    if !b.dtype(x).is_complex() {
        return b.abs(x);
    }
    let re = b.real(x);
    let im = b.imag(x);
    let (re, im) = (b.abs(re), b.abs(im));
    b.add(re, im)
}

/// One column of `lu_factor`: carried (j, a, pivots, info, perm).
fn lu_step(b: &mut Builder, v: &[Value]) -> Vec<Value> {
    let (j, a, piv, info, perm) = (v[0], v[1], v[2], v[3], v[4]);
    let shape = b.shape(a);
    let (batch, m, _) = split(&shape);
    let nb = batch.len();
    let vshape = cat(&batch, &[m]);
    // Pivot as LAPACK's idamax picks it: the first row at or below j with the largest
    // |a[., j]|, where NaN never wins unless it is a[j, j] itself.
    let col = take(b, a, nb + 1, j);
    let rows = b.iota(DType::I32, &vshape, nb);
    let jv = b.broadcast_in_dim(j, &vshape, &[]);
    let cand = b.compare(rows, jv, CmpDir::Ge);
    let mag = pivot_magnitude(b, col);
    let num = b.compare(mag, mag, CmpDir::Eq);
    let nan_rank = b.splat(mag, -1.0);
    let mag = b.select(num, mag, nan_rank);
    let above = b.splat(mag, -2.0);
    let mag = b.select(cand, mag, above);
    let best = b.reduce(mag, &[nb as i64], ReduceKind::Max);
    let best = per_batch(b, best, &vshape);
    let is_best = b.compare(mag, best, CmpDir::Eq);
    let past = b.full(DType::I32, &vshape, m as f64);
    let at = b.select(is_best, rows, past);
    let p = b.reduce(at, &[nb as i64], ReduceKind::Min);
    let djj = take(b, col, nb, j);
    let djj_nan = b.compare(djj, djj, CmpDir::Ne);
    let jb = b.broadcast_in_dim(j, &batch, &[]);
    let p = b.select(djj_nan, jb, p);
    let a = swap(b, a, nb, j, p);
    let perm = swap(b, perm, nb, j, p);
    // pivots[j] = p + 1
    let pshape = b.shape(piv);
    let kidx = b.iota(DType::I32, &pshape, nb);
    let jk = b.broadcast_in_dim(j, &pshape, &[]);
    let here = b.compare(kidx, jk, CmpDir::Eq);
    let one = b.splat(p, 1.0);
    let p1 = b.add(p, one);
    let p1 = per_batch(b, p1, &pshape);
    let piv = b.select(here, p1, piv);
    // Eliminate below the pivot. A zero pivot leaves its column unscaled (as getf2 does)
    // and sets info to j + 1 if it is the first.
    let row = take(b, a, nb, j);
    let col = take(b, a, nb + 1, j);
    let d = take(b, row, nb, j);
    let dz0 = b.splat(d, 0.0);
    let dz = b.compare(d, dz0, CmpDir::Eq);
    let iz = b.splat(info, 0.0);
    let unset = b.compare(info, iz, CmpDir::Eq);
    let first = b.and(unset, dz);
    let one = i32c(b, 1);
    let j1 = b.add(j, one);
    let j1b = b.broadcast_in_dim(j1, &batch, &[]);
    let info = b.select(first, j1b, info);
    let dv = per_batch(b, d, &vshape);
    let l = b.div(col, dv);
    let dzv = per_batch(b, dz, &vshape);
    let l = b.select(dzv, col, l);
    let below = b.compare(rows, jv, CmpDir::Gt);
    let l = b.select(below, l, col);
    let lm = along(b, l, &shape, nb);
    let um = along(b, row, &shape, nb + 1);
    let ri = b.iota(DType::I32, &shape, nb);
    let ci = b.iota(DType::I32, &shape, nb + 1);
    let jm = b.broadcast_in_dim(j, &shape, &[]);
    let below = b.compare(ri, jm, CmpDir::Gt);
    let right = b.compare(ci, jm, CmpDir::Gt);
    let at_col = b.compare(ci, jm, CmpDir::Eq);
    let prod = b.mul(lm, um);
    let upd = b.sub(a, prod);
    let trail = b.and(below, right);
    let a = b.select(trail, upd, a);
    let a = b.select(at_col, lm, a);
    vec![j1, a, piv, info, perm]
}

/// The LU factors det and slogdet return: the CPU factors A^T when a real A is contiguous (saving
/// a copy for LAPACK), A itself otherwise, and their backward expects the same choice.
fn det_lu(c: &mut Ctx, a: Value) -> (Value, Value, Value, Value) {
    // The CPU takes A.mH() for that, which is A^T only for real A: complex A stays.
    let transposed = c.is_contiguous("A") && !c.b.dtype(a).is_complex();
    let b = &mut *c.b;
    let x = if transposed { mt(b, a) } else { a };
    lu_factor(b, x)
}

/// The row permutation [batch..., m] LAPACK's `pivots` [batch..., k] describe (swaps of
/// row j with row pivots[j] - 1, in order).
fn perm_from_pivots(b: &mut Builder, piv: Value, m: i64) -> Value {
    let pshape = b.shape(piv);
    let nb = pshape.len() - 1;
    let k = pshape[nb];
    let batch = &pshape[..nb];
    let perm = b.iota(DType::I32, &cat(batch, &[m]), nb);
    if k == 0 || m == 0 || numel(batch) == 0 {
        return perm;
    }
    let j = i32c(b, 0);
    let out = b.while_loop(
        &[j, piv, perm],
        |b, v| {
            let lim = i32c(b, k);
            b.compare(v[0], lim, CmpDir::Lt)
        },
        |b, v| {
            let (j, piv, perm) = (v[0], v[1], v[2]);
            let p = take(b, piv, nb, j);
            let one = b.splat(p, 1.0);
            let p = b.sub(p, one);
            let perm = swap(b, perm, nb, j, p);
            let one = i32c(b, 1);
            vec![b.add(j, one), piv, perm]
        },
    );
    out[2]
}

/// Permutation matrices P [batch..., m, m] of `dtype` with A = P L U: P[perm[i], i] = 1.
fn perm_matrix(b: &mut Builder, perm: Value, dtype: DType) -> Value {
    let ps = b.shape(perm);
    let m = ps[ps.len() - 1];
    let shape = cat(&ps, &[m]);
    let r = shape.len();
    let pb = along(b, perm, &shape, r - 1);
    let rows = b.iota(DType::I32, &shape, r - 2);
    let e = b.compare(pb, rows, CmpDir::Eq);
    b.convert(e, dtype)
}

/// L [.., m, k] (unit diagonal) and U [.., k, n] out of packed factors.
fn unpack_lu(b: &mut Builder, lu: Value) -> (Value, Value) {
    let shape = b.shape(lu);
    let (batch, m, n) = split(&shape);
    let k = m.min(n);
    let r = shape.len();
    let left = b.slice_dim(lu, r - 1, 0, k, 1);
    let l = tri(b, left, true, -1);
    let e = eye(b, DType::Bool, &batch, m, k);
    let one = b.splat(l, 1.0);
    let l = b.select(e, one, l);
    let top = b.slice_dim(lu, r - 2, 0, k, 1);
    let u = tri(b, top, false, 0);
    (l, u)
}

/// Solves op(A) X = B for triangular A; `adjoint` transposes A and conjugates it.
fn trsm(b: &mut Builder, a: Value, rhs: Value, lower: bool, unit: bool, adjoint: bool) -> Value {
    let a = if adjoint { b.conj(a) } else { a };
    b.triangular_solve(a, rhs, true, lower, unit, adjoint)
}

/// X with A X = B (or A^T X = B with `adjoint`), A = P L U given by its packed factors
/// `lu` and `perm`, all with B's batch dims.
fn lu_solve_left(b: &mut Builder, lu: Value, perm: Value, rhs: Value, adjoint: bool) -> Value {
    if numel(&b.shape(rhs)) == 0 {
        return rhs;
    }
    if !adjoint {
        let y = gather_rows(b, rhs, perm);
        let y = trsm(b, lu, y, true, true, false);
        trsm(b, lu, y, false, false, false)
    } else {
        let z = trsm(b, lu, rhs, false, false, true);
        let w = trsm(b, lu, z, true, true, true);
        let inv = inverse_perm(b, perm);
        gather_rows(b, w, inv)
    }
}

/// Solves op(A) X = B (`left`) or X op(A) = B; `lu`/`perm` are broadcast to B's batch.
fn lu_solve_values(
    b: &mut Builder,
    lu: Value,
    perm: Value,
    rhs: Value,
    left: bool,
    adjoint: bool,
) -> Value {
    let rs = b.shape(rhs);
    let (batch, _, _) = split(&rs);
    let ls = b.shape(lu);
    let n = ls[ls.len() - 1];
    let lu = b.broadcast_to(lu, &cat(&batch, &[n, n]));
    let perm = b.broadcast_to(perm, &cat(&batch, &[n]));
    if left {
        return lu_solve_left(b, lu, perm, rhs, adjoint);
    }
    // X A = B  <=>  A^H X^H = B^H (conjugates are no-ops for real dtypes)
    let rt = mt(b, rhs);
    let rt = b.conj(rt);
    let x = lu_solve_left(b, lu, perm, rt, !adjoint);
    let x = b.conj(x);
    mt(b, x)
}

/// +-1 [batch...] of `dtype`: the sign of the permutation `pivots` describe.
fn perm_sign(b: &mut Builder, piv: Value, dtype: DType) -> Value {
    let shape = b.shape(piv);
    let dim = shape.len() - 1;
    let idx = b.iota(DType::I32, &shape, dim);
    let one = b.splat(idx, 1.0);
    let idx = b.add(idx, one);
    let moved = b.compare(piv, idx, CmpDir::Ne);
    let moved = b.convert(moved, DType::I32);
    let count = b.reduce(moved, &[dim as i64], ReduceKind::Sum);
    let two = b.splat(count, 2.0);
    let odd = b.binary("stablehlo.remainder", count, two);
    let odd = b.convert(odd, dtype);
    let m2 = b.splat(odd, -2.0);
    let odd = b.mul(odd, m2);
    let one = b.splat(odd, 1.0);
    b.add(one, odd)
}

/// The checks `lu_factor` and `lu` share: a batch of matrices, a CPU kernel for the dtype,
/// partial pivoting.
fn lu_input(c: &mut Ctx, op: &str) -> LResult<TensorArg> {
    let a = tensor(c, "A")?;
    if a.shape.len() < 2 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{op}: Expected tensor with 2 or more dimensions. Got size: {} instead",
                shape_str(&a.shape)
            ),
        );
    }
    need_kernel("lu_cpu", a.dtype)?;
    if !c.args.bool_or("pivot", true) {
        return user_err(
            ErrorKind::Runtime,
            "linalg.lu_factor: LU without pivoting is not implemented on the CPU",
        );
    }
    Ok(a)
}

fn lu_factor_ex(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = lu_input(c, "torch.lu_factor")?;
    if c.args.bool_or("check_errors", false) {
        return decline("check_errors reads the info on the host");
    }
    let (lu, piv, info, _) = lu_factor(c.b, a.value);
    Ok(vec![Out::T(lu), Out::T(piv), Out::T(info)])
}

fn linalg_lu(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = lu_input(c, "linalg.lu")?;
    let b = &mut *c.b;
    let (lu, _, _, perm) = lu_factor(b, a.value);
    let p = perm_matrix(b, perm, a.dtype);
    let (l, u) = unpack_lu(b, lu);
    Ok(vec![Out::T(p), Out::T(l), Out::T(u)])
}

fn lu_unpack(c: &mut Ctx) -> LResult<Vec<Out>> {
    let lu = tensor(c, "LU_data")?;
    let piv = tensor(c, "LU_pivots")?;
    let data = c.args.bool_or("unpack_data", true);
    let pivots = c.args.bool_or("unpack_pivots", true);
    if lu.shape.len() < 2 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "torch.lu_unpack: Expected tensor with 2 or more dimensions. Got size: {} instead",
                shape_str(&lu.shape)
            ),
        );
    }
    if pivots && piv.dtype != DType::I32 {
        return user_err(
            ErrorKind::Runtime,
            "torch.lu_unpack: LU_pivots is expected to be a contiguous tensor of torch.int32 dtype.\nNote: this function is intended to be used with the output produced by torch.linalg.lu_factor",
        );
    }
    let (batch, m, n) = split(&lu.shape);
    let b = &mut *c.b;
    let empty = b.full(lu.dtype, &[0], 0.0);
    let p = if pivots {
        let want = cat(&batch, &[m.min(n)]);
        if piv.shape != want {
            return user_err(
                ErrorKind::Value,
                format!(
                    "Expected LU_pivots to have shape {} but got {} instead.",
                    shape_str(&want),
                    shape_str(&piv.shape)
                ),
            );
        }
        let perm = perm_from_pivots(b, piv.value, m);
        perm_matrix(b, perm, lu.dtype)
    } else {
        empty
    };
    let (l, u) = if data {
        unpack_lu(b, lu.value)
    } else {
        (empty, empty)
    };
    Ok(vec![Out::T(p), Out::T(l), Out::T(u)])
}

fn lu_solve(c: &mut Ctx) -> LResult<Vec<Out>> {
    let lu = tensor(c, "LU")?;
    let piv = tensor(c, "pivots")?;
    let rhs = tensor(c, "B")?;
    let left = c.args.bool_or("left", true);
    let adjoint = c.args.bool_or("adjoint", false);
    const OP: &str = "linalg.lu_solve";
    need_float("torch.linalg.lu_solve", lu.dtype)?;
    if lu.dtype != rhs.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{OP}: Expected LU and B to have the same dtype, but found LU of type {} and B of type {} instead",
                torch_name(lu.dtype),
                torch_name(rhs.dtype)
            ),
        );
    }
    if piv.dtype != DType::I32 {
        return user_err(
            ErrorKind::Runtime,
            format!("{OP}: pivots should be a Tensor of scalar type torch.int32"),
        );
    }
    need_square("torch.linalg.lu_solve", "A", &lu.shape)?;
    need_matrix(OP, "B", &rhs.shape)?;
    let n = lu.shape[lu.shape.len() - 1];
    let (_, bm, bn) = split(&rhs.shape);
    if (left && bm != n) || (!left && bn != n) {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{OP}: Incompatible shapes of A and B for the equation {} ({n}x{n} and {bm}x{bn})",
                if left { "AX = B" } else { "XA = B" }
            ),
        );
    }
    if piv.shape.last() != Some(&n) {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{OP}: Number of pivots per batch should be same as the dimension of the matrix"
            ),
        );
    }
    if piv.shape[..] != lu.shape[..lu.shape.len() - 1] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{OP}: Expected LU.shape[:-1] and pivots.shape to be the same, but got pivots with shape {} instead",
                shape_str(&piv.shape)
            ),
        );
    }
    let (lb, _, _) = split(&lu.shape);
    let (bb, _, _) = split(&rhs.shape);
    let batch = broadcast_shapes(&bb, &lb)?;
    need_kernel("linalg.lu_solve_cpu", lu.dtype)?;
    let b = &mut *c.b;
    let perm = perm_from_pivots(b, piv.value, n);
    let rv = b.broadcast_to(rhs.value, &cat(&batch, &[bm, bn]));
    let x = lu_solve_values(b, lu.value, perm, rv, left, adjoint);
    Ok(vec![Out::T(x)])
}

fn inv_ex(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "A")?;
    need_square("linalg.inv", "A", &a.shape)?;
    need_float("linalg.inv", a.dtype)?;
    no_half("linalg.inv", a.dtype)?;
    if c.args.bool_or("check_errors", false) {
        return decline("check_errors reads the info on the host");
    }
    let b = &mut *c.b;
    let (lu, _, info, perm) = lu_factor(b, a.value);
    let (batch, n, _) = split(&a.shape);
    let e = eye(b, a.dtype, &batch, n, n);
    let x = lu_solve_left(b, lu, perm, e, false);
    Ok(vec![Out::T(x), Out::T(info)])
}

fn det(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "A")?;
    need_square("linalg.det", "A", &a.shape)?;
    need_float("linalg.det", a.dtype)?;
    need_kernel("lu_cpu", a.dtype)?;
    let (lu, piv, _, _) = det_lu(c, a.value);
    let b = &mut *c.b;
    let d = diagonal(b, lu);
    let r = b.rank(d);
    let p = b.reduce(d, &[r as i64 - 1], ReduceKind::Prod);
    let s = perm_sign(b, piv, a.dtype);
    Ok(vec![Out::T(b.mul(p, s)), Out::T(lu), Out::T(piv)])
}

fn slogdet(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "A")?;
    need_square("linalg.slogdet", "A", &a.shape)?;
    need_float("linalg.slogdet", a.dtype)?;
    no_half("linalg.slogdet", a.dtype)?;
    let (lu, piv, _, _) = det_lu(c, a.value);
    let b = &mut *c.b;
    let d = diagonal(b, lu);
    let last = b.rank(d) as i64 - 1;
    let sg = if a.dtype.is_complex() {
        // The unit phase d / |d| (PyTorch's sgn).
        let m = b.abs(d);
        let m = b.convert(m, a.dtype);
        b.div(d, m)
    } else {
        // sign(NaN) is 0 in PyTorch: (0 < d) - (d < 0).
        let z = b.splat(d, 0.0);
        let pos = b.compare(d, z, CmpDir::Gt);
        let neg = b.compare(d, z, CmpDir::Lt);
        let pos = b.convert(pos, a.dtype);
        let neg = b.convert(neg, a.dtype);
        b.sub(pos, neg)
    };
    let sg = b.reduce(sg, &[last], ReduceKind::Prod);
    let ps = perm_sign(b, piv, a.dtype);
    let sign = b.mul(sg, ps);
    let ad = b.abs(d);
    let lg = b.log(ad);
    let logabs = b.reduce(lg, &[last], ReduceKind::Sum);
    Ok(vec![Out::T(sign), Out::T(logabs), Out::T(lu), Out::T(piv)])
}

fn solve_ex(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "A")?;
    let rhs = tensor(c, "B")?;
    let left = c.args.bool_or("left", true);
    const OP: &str = "linalg.solve";
    need_matrix(OP, "A", &a.shape)?;
    need_float(OP, a.dtype)?;
    if a.dtype != rhs.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{OP}: Expected A and B to have the same dtype, but found A of type {} and B of type {} instead",
                torch_name(a.dtype),
                torch_name(rhs.dtype)
            ),
        );
    }
    // NumPy's rule: B is a (batch of) vector(s) if it is 1-D or A.shape[:-1].
    let ra = a.shape.len();
    let vector =
        rhs.shape.len() == 1 || (rhs.shape.len() + 1 == ra && rhs.shape[..] == a.shape[..ra - 1]);
    let bshape = if vector {
        cat(&rhs.shape, &[1])
    } else {
        rhs.shape.clone()
    };
    need_square(OP, "A", &a.shape)?;
    need_matrix(OP, "B", &bshape)?;
    let n = a.shape[ra - 1];
    let (bb, bm, bn) = split(&bshape);
    if (left && bm != n) || (!left && bn != n) {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{OP}: Incompatible shapes of A and B for the equation {} ({n}x{n} and {bm}x{bn})",
                if left { "AX = B" } else { "XA = B" }
            ),
        );
    }
    let (ab, _, _) = split(&a.shape);
    let batch = broadcast_shapes(&bb, &ab)?;
    if vector && !left {
        return user_err(
            ErrorKind::Runtime,
            format!("{OP}: Vector broadcasting of the left hand side is not supported for left=False. In this case linalg.solve is equivalent to B / A.squeeze(-1)"),
        );
    }
    need_kernel("lu_cpu", a.dtype)?;
    if c.args.bool_or("check_errors", false) {
        return decline("check_errors reads the info on the host");
    }
    let b = &mut *c.b;
    let (lu, piv, info, perm) = lu_factor(b, a.value);
    let rv = b.reshape(rhs.value, &bshape);
    let full = cat(&batch, &[bm, bn]);
    let rv = b.broadcast_to(rv, &full);
    let x = lu_solve_values(b, lu, perm, rv, left, false);
    let x = if vector {
        b.reshape(x, &cat(&batch, &[bm]))
    } else {
        x
    };
    Ok(vec![Out::T(x), Out::T(lu), Out::T(piv), Out::T(info)])
}

// ---------------------------------------------------------------------------
// QR and Householder products (XLA's QrExpander)
// ---------------------------------------------------------------------------

/// Householder QR packed as LAPACK's geqrf packs it: (R on and above the diagonal with the
/// reflectors below it, tau [batch..., min(m, n)]).
fn geqrf_values(b: &mut Builder, a: Value) -> (Value, Value) {
    let shape = b.shape(a);
    let dt = b.dtype(a);
    let (batch, m, n) = split(&shape);
    let tshape = cat(&batch, &[m.min(n)]);
    if numel(&shape) == 0 {
        return (a, b.full(dt, &tshape, 0.0));
    }
    let r = b.custom_call(
        "Qr",
        &[a],
        "",
        &[TensorType::new(dt, &shape), TensorType::new(dt, &tshape)],
    );
    (r[0], r[1])
}

/// Q = H_1 ... H_p [batch..., m, n] from the reflectors below the diagonal of `a`
/// [batch..., m, n] (m >= n) and `tau` [batch..., p] (p <= n), as LAPACK's orgqr.
fn householder_values(b: &mut Builder, a: Value, tau: Value) -> Value {
    let shape = b.shape(a);
    let dt = b.dtype(a);
    let (batch, m, n) = split(&shape);
    let ts = b.shape(tau);
    if ts[ts.len() - 1] == 0 || numel(&shape) == 0 {
        return eye(b, dt, &batch, m, n);
    }
    b.custom_call(
        "ProductOfElementaryHouseholderReflectors",
        &[a, tau],
        "",
        &[TensorType::new(dt, &shape)],
    )[0]
}

/// Q [batch..., m, m] of a geqrf factorization of an [m, n] matrix (m > n: the reflectors
/// padded with zero columns).
fn complete_q(b: &mut Builder, qa: Value, tau: Value) -> Value {
    let shape = b.shape(qa);
    let (_, m, n) = split(&shape);
    let r = shape.len();
    let sq = if m > n {
        let z = b.constant(b.dtype(qa), 0.0);
        let mut hi = vec![0; r];
        hi[r - 1] = m - n;
        b.pad(qa, z, &vec![0; r], &hi, &vec![0; r])
    } else {
        b.slice_dim(qa, r - 1, 0, m, 1)
    };
    householder_values(b, sq, tau)
}

fn qr(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "A")?;
    need_matrix("linalg.qr", "A", &a.shape)?;
    need_float("linalg.qr", a.dtype)?;
    let mode = c.args.str_or("mode", "reduced").to_string();
    if !matches!(mode.as_str(), "reduced" | "complete" | "r") {
        return user_err(
            ErrorKind::Runtime,
            format!("qr received unrecognized mode '{mode}' but expected one of 'reduced' (default), 'r', or 'complete'"),
        );
    }
    need_kernel("geqrf_cpu", a.dtype)?;
    let (_, m, n) = split(&a.shape);
    let k = m.min(n);
    let complete = mode == "complete";
    let b = &mut *c.b;
    let r = a.shape.len();
    let (qa, tau) = geqrf_values(b, a.value);
    let rows = if complete { m } else { k };
    let top = b.slice_dim(qa, r - 2, 0, rows, 1);
    let rr = tri(b, top, false, 0);
    let q = match mode.as_str() {
        "r" => b.full(a.dtype, &[0], 0.0),
        "complete" => complete_q(b, qa, tau),
        _ => {
            let left = b.slice_dim(qa, r - 1, 0, k, 1);
            householder_values(b, left, tau)
        }
    };
    Ok(vec![Out::T(q), Out::T(rr)])
}

fn geqrf(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "self")?;
    if a.shape.len() < 2 {
        return user_err(
            ErrorKind::Runtime,
            "torch.geqrf: input must have at least 2 dimensions.",
        );
    }
    need_kernel("geqrf_cpu", a.dtype)?;
    let (qa, tau) = geqrf_values(c.b, a.value);
    Ok(vec![Out::T(qa), Out::T(tau)])
}

fn householder_product(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "input")?;
    let tau = tensor(c, "tau")?;
    const OP: &str = "torch.linalg.householder_product";
    if a.shape.len() < 2 {
        return user_err(
            ErrorKind::Runtime,
            format!("{OP}: input must have at least 2 dimensions."),
        );
    }
    let (batch, m, n) = split(&a.shape);
    if m < n {
        return user_err(
            ErrorKind::Runtime,
            format!("{OP}: input.shape[-2] must be greater than or equal to input.shape[-1]"),
        );
    }
    let Some(&p) = tau.shape.last() else {
        return user_err(
            ErrorKind::Index,
            "Dimension specified as -1 but tensor has no dimensions",
        );
    };
    if n < p {
        return user_err(
            ErrorKind::Runtime,
            format!("{OP}: input.shape[-1] must be greater than or equal to tau.shape[-1]"),
        );
    }
    if tau.shape.len() + 1 != a.shape.len() {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{OP}: Expected tau to have one dimension less than input, but got tau.ndim equal to {} and input.ndim is equal to {}",
                tau.shape.len(),
                a.shape.len()
            ),
        );
    }
    if tau.shape[..tau.shape.len() - 1] != batch[..] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{OP}: Expected batch dimensions of tau to be equal to input.shape[:-2], but got {}",
                shape_str(&tau.shape[..tau.shape.len() - 1])
            ),
        );
    }
    if tau.dtype != a.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{OP}: tau dtype {} does not match input dtype {}",
                torch_name(tau.dtype),
                torch_name(a.dtype)
            ),
        );
    }
    need_kernel("orgqr_cpu", a.dtype)?;
    Ok(vec![Out::T(householder_values(c.b, a.value, tau.value))])
}

// ---------------------------------------------------------------------------
// Symmetric eigendecomposition (XLA's EighExpander: Jacobi)
// ---------------------------------------------------------------------------

/// Eigenpairs (ascending) of the symmetric matrices in the `lower` (or upper) triangle of
/// `a` [batch..., n, n], n >= 1: one-sided Jacobi on A + sigma I, positive semidefinite
/// for sigma = the inf-norm, so its singular vectors are eigenvectors of A; eigenvalues
/// are the Rayleigh quotients. For float64, where XLA's Eigh stops rotating at float32's
/// epsilon (eigenvectors good to about 1e-8 only).
fn eigh_jacobi(b: &mut Builder, a: Value, lower: bool) -> (Value, Value) {
    let shape = b.shape(a);
    let dt = b.dtype(a);
    let (batch, n, _) = split(&shape);
    let r = shape.len();
    let nb = batch.len();
    let t = tri(b, a, lower, 0);
    let strict = tri(b, a, lower, if lower { -1 } else { 1 });
    let st = mt(b, strict);
    let sym = b.add(t, st);
    let (x, scale) = unit_scale(b, sym);
    let ax = b.abs(x);
    let rows = b.reduce(ax, &[r as i64 - 1], ReduceKind::Sum);
    let sigma = b.reduce(rows, &[nb as i64], ReduceKind::Max);
    let sigma = per_batch(b, sigma, &shape);
    let e = eye(b, dt, &batch, n, n);
    let shift = b.mul(e, sigma);
    let c = b.add(x, shift);
    let (_, v) = jacobi(b, c);
    let xv = b.dot_general(
        x,
        v,
        (&upto(nb), &upto(nb)),
        (&[r as i64 - 1], &[nb as i64]),
        dt,
    );
    let q = b.mul(v, xv);
    let w = b.reduce(q, &[nb as i64], ReduceKind::Sum);
    let wshape = b.shape(w);
    let idx = b.iota(DType::I32, &wshape, nb);
    let sorted = b.sort(&[w, idx], nb, true, |b, a| {
        b.compare(a[0], a[1], CmpDir::Lt)
    });
    let sc = per_batch(b, scale, &wshape);
    let w = b.mul(sorted[0], sc);
    (w, gather_cols(b, v, sorted[1]))
}

/// Eigenvalues (ascending) and eigenvectors of the symmetric matrices in the `lower` (or
/// upper) triangle of `a` [batch..., n, n], no empty dims: XLA's Eigh, Jacobi for float64.
fn eigh_values(b: &mut Builder, a: Value, lower: bool) -> (Value, Value) {
    let dt = b.dtype(a);
    if dt == DType::F64 {
        return eigh_jacobi(b, a, lower);
    }
    let shape = b.shape(a);
    let (batch, n, _) = split(&shape);
    let r = b.custom_call(
        "Eigh",
        &[a],
        // lower, sort, max sweeps, tol (off-diagonal / Frobenius norm)
        &format!("{},1,100,1e-7", i32::from(lower)),
        &[
            TensorType::new(dt, &shape),
            TensorType::new(dt, &cat(&batch, &[n])),
        ],
    );
    (r[1], r[0])
}

/// Batched matrix product of [batch..., m, k] and [batch..., k, n].
fn matmul(b: &mut Builder, x: Value, y: Value) -> Value {
    let r = b.rank(x);
    let nb = r - 2;
    let dt = b.dtype(x);
    b.dot_general(
        x,
        y,
        (&upto(nb), &upto(nb)),
        (&[r as i64 - 1], &[nb as i64]),
        dt,
    )
}

/// linalg.matrix_sqrth: Q sqrt(L) Q^T from the eigendecomposition of the lower triangle;
/// negative eigenvalues (A not positive semidefinite) count as zero, as on the CPU.
fn matrix_sqrth(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "self")?;
    let op = "linalg.matrix_sqrth";
    need_square(op, "A", &a.shape)?;
    need_float(op, a.dtype)?;
    no_half(op, a.dtype)?;
    let b = &mut *c.b;
    if numel(&a.shape) == 0 {
        return Ok(vec![Out::T(b.full(a.dtype, &a.shape, 0.0))]);
    }
    let (w, v) = eigh_values(b, a.value, true);
    let zero = b.splat(w, 0.0);
    let w = b.max(w, zero);
    let s = b.sqrt(w);
    let r = a.shape.len();
    let s = along(b, s, &a.shape, r - 1);
    let vs = b.mul(v, s);
    let vt = mt(b, v);
    Ok(vec![Out::T(matmul(b, vs, vt))])
}

fn eigh(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "A")?;
    need_square("linalg.eigh", "A", &a.shape)?;
    let uplo = c.args.str_or("UPLO", "L").to_string();
    let lower = match uplo.as_str() {
        "L" | "l" => true,
        "U" | "u" => false,
        _ => {
            return user_err(
                ErrorKind::Runtime,
                format!("Expected UPLO argument to be 'L' or 'U', but got {uplo}"),
            )
        }
    };
    need_kernel("linalg_eigh_cpu", a.dtype)?;
    let want_v = c.args.bool_or("compute_v", true);
    let (batch, n, _) = split(&a.shape);
    let b = &mut *c.b;
    let (w, v) = if numel(&a.shape) == 0 {
        (b.full(a.dtype, &cat(&batch, &[n]), 0.0), a.value)
    } else {
        eigh_values(b, a.value, lower)
    };
    let v = if want_v {
        v
    } else {
        b.full(a.dtype, &[0], 0.0)
    };
    Ok(vec![Out::T(w), Out::T(v)])
}

// ---------------------------------------------------------------------------
// SVD: one-sided Jacobi
// ---------------------------------------------------------------------------

const JACOBI_MAX_SWEEPS: i64 = 60;

fn eps(dt: DType) -> f64 {
    if dt == DType::F64 {
        f64::EPSILON
    } else {
        f32::EPSILON as f64
    }
}

/// One round of rotations on the column pairs (top[i], bot[i]) of X [batch..., m, h] and
/// V, then the round-robin move to the next pairing. Carried: (round, top, bot, vtop,
/// vbot, off) where `off` [batch...] is the largest |cos| between paired columns seen.
fn jacobi_round(b: &mut Builder, v: &[Value], tol: f64) -> Vec<Value> {
    let (round, top, bot, vt, vb, off) = (v[0], v[1], v[2], v[3], v[4], v[5]);
    let xs = b.shape(top);
    let vs = b.shape(vt);
    let r = xs.len();
    let h = xs[r - 1];
    let sum = |b: &mut Builder, x: Value, y: Value| {
        let p = b.mul(x, y);
        b.reduce(p, &[r as i64 - 2], ReduceKind::Sum)
    };
    let alpha = sum(b, top, top);
    let beta = sum(b, bot, bot);
    let gamma = sum(b, top, bot);
    let sa = b.sqrt(alpha);
    let sb = b.sqrt(beta);
    let norm = b.mul(sa, sb);
    let zero = b.splat(norm, 0.0);
    let pos = b.compare(norm, zero, CmpDir::Gt);
    let ag = b.abs(gamma);
    let ratio = b.div(ag, norm);
    let ratio = b.select(pos, ratio, zero);
    let worst = b.reduce(ratio, &[r as i64 - 2], ReduceKind::Max);
    let off = b.max(off, worst);
    let tolv = b.splat(ratio, tol);
    let rot = b.compare(ratio, tolv, CmpDir::Gt);
    // tan of the angle that makes the pair orthogonal: the root of t^2 + 2 zeta t - 1
    // of smaller magnitude.
    let diff = b.sub(beta, alpha);
    let g2 = b.add(gamma, gamma);
    let zeta = b.div(diff, g2);
    let one = b.splat(zeta, 1.0);
    let mone = b.splat(zeta, -1.0);
    let nonneg = b.compare(zeta, zero, CmpDir::Ge);
    let sgn = b.select(nonneg, one, mone);
    let az = b.abs(zeta);
    let z2 = b.mul(zeta, zeta);
    let z2 = b.add(z2, one);
    let hyp = b.sqrt(z2);
    let den = b.add(az, hyp);
    let t = b.div(sgn, den);
    let t2 = b.mul(t, t);
    let t2 = b.add(t2, one);
    let cs = b.rsqrt(t2);
    let sn = b.mul(cs, t);
    let cs = b.select(rot, cs, one);
    let sn = b.select(rot, sn, zero);
    let turn = |b: &mut Builder, x: Value, y: Value, shape: &[i64]| {
        let c = along(b, cs, shape, r - 1);
        let s = along(b, sn, shape, r - 1);
        let cx = b.mul(c, x);
        let sy = b.mul(s, y);
        let sx = b.mul(s, x);
        let cy = b.mul(c, y);
        (b.sub(cx, sy), b.add(sx, cy))
    };
    let (top, bot) = turn(b, top, bot, &xs);
    let (vt, vb) = turn(b, vt, vb, &vs);
    // Circle method: top[0] stays, every other column moves one place around the ring
    // top[1..] -> bot[..] reversed, so n - 1 rounds pair every two columns once.
    let mv = |b: &mut Builder, t: Value, u: Value| {
        if h == 1 {
            return (t, u);
        }
        let t0 = b.slice_dim(t, r - 1, 0, 1, 1);
        let u0 = b.slice_dim(u, r - 1, 0, 1, 1);
        let mut parts = vec![t0, u0];
        if h > 2 {
            parts.push(b.slice_dim(t, r - 1, 1, h - 1, 1));
        }
        let nt = b.concatenate(&parts, r - 1);
        let urest = b.slice_dim(u, r - 1, 1, h, 1);
        let tl = b.slice_dim(t, r - 1, h - 1, h, 1);
        let nu = b.concatenate(&[urest, tl], r - 1);
        (nt, nu)
    };
    let (top, bot) = mv(b, top, bot);
    let (vt, vb) = mv(b, vt, vb);
    let one = i32c(b, 1);
    vec![b.add(round, one), top, bot, vt, vb, off]
}

/// `a` [batch...] scaled per batch to max |a| = 1 over its last two dims: (scaled, scale),
/// so that sums of squares neither overflow nor underflow.
fn unit_scale(b: &mut Builder, a: Value) -> (Value, Value) {
    let shape = b.shape(a);
    let nb = shape.len() - 2;
    let mag = b.abs(a);
    let scale = b.reduce(mag, &[nb as i64, nb as i64 + 1], ReduceKind::Max);
    let zero = b.splat(scale, 0.0);
    let one = b.splat(scale, 1.0);
    let is0 = b.compare(scale, zero, CmpDir::Eq);
    let scale = b.select(is0, one, scale);
    let sm = per_batch(b, scale, &shape);
    (b.div(a, sm), scale)
}

/// One-sided Jacobi: rotates the columns of `x` [batch..., m, n] (no empty dims) until
/// they are orthogonal. Returns (X V, V), V [batch..., n, n] orthogonal.
fn jacobi(b: &mut Builder, x: Value) -> (Value, Value) {
    let shape = b.shape(x);
    let dt = b.dtype(x);
    let (batch, m, n) = split(&shape);
    let r = shape.len();
    let nb = batch.len();
    // An odd column count gets a zero column: it never rotates.
    let n2 = n + n % 2;
    let h = n2 / 2;
    let x = if n2 > n {
        let z = b.constant(dt, 0.0);
        let mut hi = vec![0; r];
        hi[r - 1] = 1;
        b.pad(x, z, &vec![0; r], &hi, &vec![0; r])
    } else {
        x
    };
    let v = eye(b, dt, &batch, n2, n2);
    let top = b.slice_dim(x, r - 1, 0, h, 1);
    let bot = b.slice_dim(x, r - 1, h, n2, 1);
    let vt = b.slice_dim(v, r - 1, 0, h, 1);
    let vb = b.slice_dim(v, r - 1, h, n2, 1);
    let tol = eps(dt) * (m as f64).sqrt();
    let off = b.full(dt, &batch, f64::INFINITY);
    let sweep = i32c(b, 0);
    // Whole sweeps (n2 - 1 rounds) bring every column back to its starting place.
    let out = b.while_loop(
        &[sweep, top, bot, vt, vb, off],
        |b, v| {
            let lim = i32c(b, JACOBI_MAX_SWEEPS);
            let more = b.compare(v[0], lim, CmpDir::Lt);
            let worst = b.reduce(v[5], &upto(nb), ReduceKind::Max);
            let tolc = b.constant(dt, tol);
            let bad = b.compare(worst, tolc, CmpDir::Gt);
            b.and(more, bad)
        },
        |b, v| {
            let off = b.splat(v[5], 0.0);
            let round = i32c(b, 0);
            let inner = b.while_loop(
                &[round, v[1], v[2], v[3], v[4], off],
                |b, w| {
                    let lim = i32c(b, n2 - 1);
                    b.compare(w[0], lim, CmpDir::Lt)
                },
                |b, w| jacobi_round(b, w, tol),
            );
            let one = i32c(b, 1);
            let s = b.add(v[0], one);
            vec![s, inner[1], inner[2], inner[3], inner[4], inner[5]]
        },
    );
    let x = b.concatenate(&[out[1], out[2]], r - 1);
    let x = b.slice_dim(x, r - 1, 0, n, 1);
    let v = b.concatenate(&[out[3], out[4]], r - 1);
    let v = b.slice_dim(v, r - 2, 0, n, 1);
    let v = b.slice_dim(v, r - 1, 0, n, 1);
    (x, v)
}

/// (U, S, V) of `a` [batch..., m, n] with m >= n >= 1, no empty dims; U is [m, m] with
/// `full`, else [m, n]; None for U and V without `uv`.
fn svd_tall(
    b: &mut Builder,
    a: Value,
    full: bool,
    uv: bool,
) -> (Option<Value>, Value, Option<Value>) {
    let shape = b.shape(a);
    let dt = b.dtype(a);
    let r = shape.len();
    let nb = r - 2;
    let n = shape[r - 1];
    let (x, scale) = unit_scale(b, a);
    let (x, v) = jacobi(b, x);
    let sq = b.mul(x, x);
    let norms = b.reduce(sq, &[r as i64 - 2], ReduceKind::Sum);
    let norms = b.sqrt(norms);
    // Descending singular values, as LAPACK returns them.
    let sshape = b.shape(norms);
    let idx = b.iota(DType::I32, &sshape, nb);
    let sorted = b.sort(&[norms, idx], nb, true, |b, a| {
        b.compare(a[0], a[1], CmpDir::Gt)
    });
    let sc = per_batch(b, scale, &sshape);
    let s = b.mul(sorted[0], sc);
    if !uv {
        return (None, s, None);
    }
    let order = sorted[1];
    let x = gather_cols(b, x, order);
    let v = gather_cols(b, v, order);
    // X = U S has orthogonal columns: its QR has R diagonal up to rounding and Q = U up to
    // the signs of R's diagonal; Q also completes U where S is zero or `full` asks.
    let (qa, tau) = geqrf_values(b, x);
    let q = if full {
        complete_q(b, qa, tau)
    } else {
        householder_values(b, qa, tau)
    };
    let d = diagonal(b, qa);
    let dz = b.splat(d, 0.0);
    let neg = b.compare(d, dz, CmpDir::Lt);
    let p1 = b.splat(d, 1.0);
    let m1 = b.splat(d, -1.0);
    let sg = b.select(neg, m1, p1);
    let qs = b.shape(q);
    let cols = qs[r - 1];
    let sg = if cols > n {
        let one = b.constant(dt, 1.0);
        let mut hi = vec![0; nb + 1];
        hi[nb] = cols - n;
        b.pad(sg, one, &vec![0; nb + 1], &hi, &vec![0; nb + 1])
    } else {
        sg
    };
    let sgm = along(b, sg, &qs, r - 1);
    let u = b.mul(q, sgm);
    (Some(u), s, Some(v))
}

fn svd(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "A")?;
    need_matrix("linalg.svd", "A", &a.shape)?;
    need_float("linalg.svd", a.dtype)?;
    if c.args.opt_str("driver").is_some() {
        return user_err(
            ErrorKind::Runtime,
            "torch.linalg.svd: keyword argument `driver=` is only supported on CUDA inputs with cuSOLVER backend.",
        );
    }
    need_kernel("linalg_svd_cpu", a.dtype)?;
    let full = c.args.bool_or("full_matrices", false);
    let uv = c.args.bool_or("compute_uv", true);
    let (batch, m, n) = split(&a.shape);
    let k = m.min(n);
    let b = &mut *c.b;
    let empty = b.full(a.dtype, &[0], 0.0);
    let (ucols, vrows) = if full { (m, n) } else { (k, k) };
    if numel(&a.shape) == 0 {
        let s = b.full(a.dtype, &cat(&batch, &[k]), 0.0);
        if !uv {
            return Ok(vec![Out::T(empty), Out::T(s), Out::T(empty)]);
        }
        let u = eye(b, a.dtype, &batch, m, ucols);
        let vh = eye(b, a.dtype, &batch, vrows, n);
        return Ok(vec![Out::T(u), Out::T(s), Out::T(vh)]);
    }
    let (u, s, vh) = if m >= n {
        let (u, s, v) = svd_tall(b, a.value, full, uv);
        (u, s, v.map(|v| mt(b, v)))
    } else {
        // A^T = U' S V'^T, so A = V' S U'^T.
        let at = mt(b, a.value);
        let (u, s, v) = svd_tall(b, at, full, uv);
        (v, s, u.map(|u| mt(b, u)))
    };
    Ok(vec![
        Out::T(u.unwrap_or(empty)),
        Out::T(s),
        Out::T(vh.unwrap_or(empty)),
    ])
}

/// ormqr: `other` multiplied by Q (or Q^T), on the left or the right, where Q [m, m] is the
/// product of the Householder reflectors geqrf left in `self` and `input2` (tau).
fn ormqr(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "self")?;
    let tau = tensor(c, "input2")?;
    let o = tensor(c, "input3")?;
    let left = c.args.bool_or("left", true);
    let transpose = c.args.bool_or("transpose", false);
    let err = |m: String| user_err::<Vec<Out>>(ErrorKind::Runtime, format!("torch.ormqr: {m}"));
    let (ar, or) = (a.shape.len(), o.shape.len());
    if ar < 2 {
        return err("input must have at least 2 dimensions.".into());
    }
    if or < 2 {
        return err("other must have at least 2 dimensions.".into());
    }
    let (side, name) = if left { (or - 2, -2) } else { (or - 1, -1) };
    if o.shape[side] != a.shape[ar - 2] {
        return err(format!(
            "other.shape[{name}] must be equal to input.shape[-2]"
        ));
    }
    let Some(k) = tau.shape.last() else {
        // The CPU raises IndexError from tau.size(-1).
        return decline("ormqr: 0-d tau");
    };
    if *k != o.shape[side].min(a.shape[ar - 1]) {
        return err(format!(
            "tau.shape[-1] must be equal to min(other.shape[{name}], input.shape[-1])"
        ));
    }
    if tau.shape.len() != ar - 1 {
        return err(format!(
            "Expected tau to have one dimension less than input, but got tau.ndim equal to {} and input.ndim is equal to {ar}",
            tau.shape.len()
        ));
    }
    if or != ar {
        return err(format!(
            "Expected other to have the same number of dimensions as input, but got other.ndim equal to {or} and input.ndim is equal to {ar}"
        ));
    }
    let batch = &a.shape[..ar - 2];
    for (what, s) in [("tau", &tau.shape[..ar - 2]), ("other", &o.shape[..ar - 2])] {
        if s != batch {
            return err(format!(
                "Expected batch dimensions of {what} to be equal to input.shape[:-2], but got {}",
                shape_str(s)
            ));
        }
    }
    for (what, d) in [("tau", tau.dtype), ("other", o.dtype)] {
        if d != a.dtype {
            return err(format!(
                "Expected input and {what} to have the same dtype, but input has dtype{} and {what} has dtype {}",
                torch_name(a.dtype),
                torch_name(d)
            ));
        }
    }
    need_kernel("ormqr_cpu", a.dtype)?;
    let b = &mut *c.b;
    if numel(&o.shape) == 0 || a.shape[ar - 2] == 0 {
        return Ok(vec![Out::T(o.value)]);
    }
    let q = complete_q(b, a.value, tau.value);
    let q = if transpose { mt(b, q) } else { q };
    let r = if left {
        matmul(b, q, o.value)
    } else {
        matmul(b, o.value, q)
    };
    Ok(vec![Out::T(r)])
}

/// linalg.lstsq: the minimum-norm least-squares solution every driver returns for full-rank
/// inputs (and gelsy/gelss/gelsd for any): through the QR as LAPACK's gels and gelsy do
/// (gelsy: where the rank is full), else through the SVD, singular values at most `rcond`
/// times the largest counting as zero (default: epsilon * max(m, n)). Outputs follow the
/// driver: rank for gelsy/gelss/gelsd, singular values for gelss/gelsd, residuals for
/// m > n except with gelsy.
fn lstsq(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "self")?;
    let bt = tensor(c, "b")?;
    let op = "torch.linalg.lstsq";
    let err = |m: String| user_err::<Vec<Out>>(ErrorKind::Runtime, format!("{op}: {m}"));
    let ar = a.shape.len();
    if ar < 2 {
        return err("input must have at least 2 dimensions.".into());
    }
    if bt.shape.is_empty() {
        return err("other must have at least 1 dimension.".into());
    }
    let rank_b = bt.shape.len();
    if rank_b > ar || ar - rank_b > 1 {
        return err(
            "input.dim() must be greater or equal to other.dim() and (input.dim() - other.dim()) <= 1"
                .into(),
        );
    }
    if a.dtype != bt.dtype {
        return err(format!(
            "Expected input and other to have the same dtype, but got input's dtype {} and other's dtype {}",
            torch_name(a.dtype),
            torch_name(bt.dtype)
        ));
    }
    let vector = bt.shape[..] == a.shape[..ar - 1];
    if rank_b == ar - 1 && !vector {
        // The CPU then broadcasts the rhs in its own way (or fails): its fallback decides.
        return decline("lstsq: a rhs of one dim less that is not input.shape[:-1]");
    }
    let bshape = if vector {
        cat(&bt.shape, &[1])
    } else {
        bt.shape.clone()
    };
    let br = bshape.len();
    if bshape[br - 2] != a.shape[ar - 2] {
        return err("input.size(-2) should match other.size(-2)".into());
    }
    if !matches!(a.dtype, DType::F32 | DType::F64) {
        return user_err(
            ErrorKind::Runtime,
            "This function doesn't handle types other than float and double",
        );
    }
    let driver = c.args.opt_str("driver").unwrap_or("gelsy").to_string();
    if !["gels", "gelsy", "gelsd", "gelss"].contains(&driver.as_str()) {
        return err("parameter `driver` should be one of (gels, gelsy, gelsd, gelss)".into());
    }
    let (abatch, m, n) = split(&a.shape);
    let k = bshape[br - 1];
    let Ok(batch) = broadcast_shapes(&abatch, &bshape[..br - 2]) else {
        return decline("lstsq: batch dims do not broadcast");
    };
    let with_rank = driver != "gels";
    let with_sv = driver == "gelss" || driver == "gelsd";
    let with_res = driver != "gelsy" && m > n;
    if with_sv && with_res && n > 0 {
        // Residuals exist only where every matrix has full rank: a data-dependent shape.
        return decline("lstsq: gelss/gelsd residuals depend on the computed rank");
    }
    let eps_max = eps(a.dtype) * m.max(n) as f64;
    let rcond = c
        .args
        .opt_float("rcond")
        .filter(|r| *r >= 0.0)
        .unwrap_or(eps_max);
    if driver == "gelsy" && rcond > eps_max {
        // gelsy truncates through its pivoted QR, not the singular values: the solutions
        // differ once rcond cuts more than the numerically zero directions.
        return decline("lstsq: gelsy with an rcond above the default");
    }
    let dt = a.dtype;
    let b = &mut *c.b;
    let av = b.broadcast_to(a.value, &cat(&batch, &[m, n]));
    let bv = b.reshape(bt.value, &bshape);
    let bv = b.broadcast_to(bv, &cat(&batch, &[m, k]));
    let p = m.min(n);
    let empty_input = numel(&batch) == 0 || m == 0 || n == 0;
    let (x, rank, sv, qr_res) = if empty_input {
        (
            b.full(dt, &cat(&batch, &[n, k]), 0.0),
            b.full(DType::I64, &batch, 0.0),
            b.full(dt, &cat(&batch, &[p]), 0.0),
            None,
        )
    } else if driver == "gels" {
        let (x, res) = lstsq_qr(b, av, bv);
        (x, b.full(DType::I64, &[0], 0.0), b.full(dt, &[0], 0.0), res)
    } else {
        let (xs, rank, s) = lstsq_svd(b, av, bv, rcond);
        let x = if driver == "gelsy" {
            // LAPACK's gelsy solves through a (pivoted) QR: so does a full-rank matrix
            // here, which tracks the CPU more closely than the SVD.
            let (xq, _) = lstsq_qr(b, av, bv);
            let full = b.splat(rank, p as f64);
            let full = b.compare(rank, full, CmpDir::Eq);
            let full = per_batch(b, full, &cat(&batch, &[n, k]));
            b.select(full, xq, xs)
        } else {
            xs
        };
        (x, rank, s, None)
    };
    let empty = b.full(dt, &[0], 0.0);
    let res = match (with_res, qr_res) {
        (false, _) => empty,
        // The CPU does not call LAPACK for an empty matrix: zeros.
        (true, _) if empty_input => b.full(dt, &cat(&batch, &[k]), 0.0),
        (true, Some(r)) => r,
        (true, None) => {
            let ax = matmul(b, av, x);
            let d = b.sub(ax, bv);
            let d2 = b.mul(d, d);
            b.reduce(d2, &[batch.len() as i64], ReduceKind::Sum)
        }
    };
    let x = if vector {
        b.reshape(x, &cat(&batch, &[n]))
    } else {
        x
    };
    let rank = if with_rank {
        rank
    } else {
        b.full(DType::I64, &[0], 0.0)
    };
    let sv = if with_sv { sv } else { empty };
    Ok(vec![Out::T(x), Out::T(res), Out::T(rank), Out::T(sv)])
}

/// Least squares through A's QR, as LAPACK's gels (A of full rank, no empty dims): for
/// m >= n, X = R^-1 (Q^T B)[:n] and the residuals are the squared norms of (Q^T B)[n:]
/// (None when m == n); for m < n the minimum-norm X = Q R^-T B from the QR of A^T.
fn lstsq_qr(b: &mut Builder, a: Value, rhs: Value) -> (Value, Option<Value>) {
    let shape = b.shape(a);
    let (_, m, n) = split(&shape);
    let r = shape.len();
    if m >= n {
        let (qa, tau) = geqrf_values(b, a);
        let q = complete_q(b, qa, tau);
        let qt = mt(b, q);
        let qtb = matmul(b, qt, rhs);
        let top = b.slice_dim(qtb, r - 2, 0, n, 1);
        let rr = b.slice_dim(qa, r - 2, 0, n, 1);
        let x = trsm(b, rr, top, false, false, false);
        let res = (m > n).then(|| {
            let bot = b.slice_dim(qtb, r - 2, n, m, 1);
            let sq = b.mul(bot, bot);
            b.reduce(sq, &[r as i64 - 2], ReduceKind::Sum)
        });
        (x, res)
    } else {
        let at = mt(b, a);
        let (qa, tau) = geqrf_values(b, at);
        let rr = b.slice_dim(qa, r - 2, 0, m, 1);
        let z = trsm(b, rr, rhs, false, false, true);
        let q = householder_values(b, qa, tau);
        (matmul(b, q, z), None)
    }
}

/// Least squares through A's SVD (no empty dims): X = R S+ L^T B for A = L S R^T, singular
/// values at most `rcond` times the largest counting as zero; also the rank (i64
/// [batch...]) and the singular values.
fn lstsq_svd(b: &mut Builder, a: Value, rhs: Value, rcond: f64) -> (Value, Value, Value) {
    let shape = b.shape(a);
    let (batch, m, n) = split(&shape);
    let k = b.shape(rhs)[shape.len() - 1];
    let p = m.min(n);
    let (l, s, r) = if m >= n {
        let (Some(u), s, Some(v)) = svd_tall(b, a, false, true) else {
            unreachable!("svd_tall returns U and V when asked")
        };
        (u, s, v)
    } else {
        let at = mt(b, a);
        let (Some(u), s, Some(v)) = svd_tall(b, at, false, true) else {
            unreachable!("svd_tall returns U and V when asked")
        };
        (v, s, u)
    };
    let nb = batch.len();
    let smax = b.reduce(s, &[nb as i64], ReduceKind::Max);
    let sshape = b.shape(s);
    let smax = per_batch(b, smax, &sshape);
    let cut = b.splat(smax, rcond);
    let cut = b.mul(smax, cut);
    let keep = b.compare(s, cut, CmpDir::Gt);
    let one = b.splat(s, 1.0);
    let inv = b.div(one, s);
    let zero = b.splat(s, 0.0);
    let inv = b.select(keep, inv, zero);
    let rank = b.convert(keep, DType::I64);
    let rank = b.reduce(rank, &[nb as i64], ReduceKind::Sum);
    let lt = mt(b, l);
    let ltb = matmul(b, lt, rhs);
    let inv = along(b, inv, &cat(&batch, &[p, k]), nb);
    let y = b.mul(ltb, inv);
    (matmul(b, r, y), rank, s)
}

// ---------------------------------------------------------------------------
// LDL^T with Bunch-Kaufman pivoting (LAPACK's sytf2/sytrs, lower)
// ---------------------------------------------------------------------------

/// Matrices larger than this are left to the CPU: the factorization and the solve are
/// unrolled, one step per column, and compile time grows fast with n (2.4 s at 16, 6 s at
/// 32, 19 s at 64 on XLA:CPU).
const LDL_MAX_N: i64 = 16;

/// x[..., i, j] for static i, j: [batch...].
fn at(b: &mut Builder, x: Value, i: i64, j: i64) -> Value {
    let s = b.shape(x);
    let r = s.len();
    let mut lo = vec![0; r];
    let mut hi = s.clone();
    (lo[r - 2], hi[r - 2], lo[r - 1], hi[r - 1]) = (i, i + 1, j, j + 1);
    let v = b.slice(x, &lo, &hi, &vec![1; r]);
    b.reshape(v, &s[..r - 2])
}

/// x[..., rows, j] for a static column j and row range: [batch..., rows].
fn col_part(b: &mut Builder, x: Value, j: i64, from: i64, to: i64) -> Value {
    let s = b.shape(x);
    let r = s.len();
    let mut lo = vec![0; r];
    let mut hi = s.clone();
    (lo[r - 2], hi[r - 2], lo[r - 1], hi[r - 1]) = (from, to, j, j + 1);
    let v = b.slice(x, &lo, &hi, &vec![1; r]);
    let mut o = s[..r - 2].to_vec();
    o.push(to - from);
    b.reshape(v, &o)
}

/// The trailing block x[..., r0:, c0:] for static r0, c0.
fn block(b: &mut Builder, x: Value, r0: i64, c0: i64) -> Value {
    let r = b.rank(x);
    let y = b.slice_dim(x, r - 2, r0, b.shape(x)[r - 2], 1);
    b.slice_dim(y, r - 1, c0, b.shape(x)[r - 1], 1)
}

/// `x` with the block at rows r0.., columns c0.. (static) replaced by `v`.
fn put(b: &mut Builder, x: Value, v: Value, r0: i64, c0: i64) -> Value {
    let r = b.rank(x);
    let z = i32c(b, 0);
    let mut starts = vec![z; r];
    starts[r - 2] = i32c(b, r0);
    starts[r - 1] = i32c(b, c0);
    b.dynamic_update_slice(x, v, &starts)
}

/// The lower triangle of `x` mirrored into the upper one.
fn sym_from_lower(b: &mut Builder, x: Value) -> Value {
    let lo = tri(b, x, true, 0);
    let strict = tri(b, x, true, -1);
    let up = mt(b, strict);
    b.add(lo, up)
}

/// Per batch, the element of `v` [batch..., n] at index `i` ([batch...] i32).
fn pick(b: &mut Builder, v: Value, i: Value) -> Value {
    let s = b.shape(v);
    let r = s.len();
    let ids = b.iota(DType::I32, &s, r - 1);
    let ib = per_batch(b, i, &s);
    let hit = b.compare(ids, ib, CmpDir::Eq);
    let z = b.splat(v, 0.0);
    let only = b.select(hit, v, z);
    b.reduce(only, &[r as i64 - 1], ReduceKind::Sum)
}

/// The factorization of the symmetric matrices in `a`'s lower triangle, n in 1..=16, no
/// empty batch: (LD with the strict upper triangle zero, 1-based pivots [batch..., n] i32,
/// negative for 2x2 blocks, info [batch...] i32), as LAPACK's sytf2 computes them.
fn ldl_values(b: &mut Builder, a: Value) -> (Value, Value, Value) {
    let shape = b.shape(a);
    let (batch, n, _) = split(&shape);
    let r = shape.len();
    let alpha = (1.0 + 17f64.sqrt()) / 8.0;
    let mut x = sym_from_lower(b, a);
    let vshape = cat(&batch, &[n]);
    let vids = b.iota(DType::I32, &vshape, r - 2);
    let rows = b.iota(DType::I32, &shape, r - 2);
    let cols = b.iota(DType::I32, &shape, r - 1);
    let mut piv = b.full(DType::I32, &vshape, 0.0);
    let mut info = b.full(DType::I32, &batch, 0.0);
    let mut skip = b.full(DType::Bool, &batch, 0.0);
    let fb = |b: &mut Builder, flag: Value, s: &[i64]| per_batch(b, flag, s);
    for k in 0..n {
        let akk = at(b, x, k, k);
        let absakk = b.abs(akk);
        let zero_s = b.splat(absakk, 0.0);
        let kc = b.full(DType::I32, &batch, k as f64);
        let (colmax, imax) = if k + 1 < n {
            let c = col_part(b, x, k, k + 1, n);
            let c = b.abs(c);
            let m = b.reduce(c, &[r as i64 - 2], ReduceKind::Max);
            let cs = b.shape(c);
            let mb = per_batch(b, m, &cs);
            let is_m = b.compare(c, mb, CmpDir::Eq);
            let ids = b.iota(DType::I32, &cs, r - 2);
            let big = b.full(DType::I32, &cs, n as f64);
            let cand = b.select(is_m, ids, big);
            let rel = b.reduce(cand, &[r as i64 - 2], ReduceKind::Min);
            let off = b.full(DType::I32, &batch, (k + 1) as f64);
            (m, b.add(rel, off))
        } else {
            (zero_s, kc)
        };
        // Row imax of the trailing matrix, off its diagonal.
        let ib = per_batch(b, imax, &shape);
        let at_row = b.compare(rows, ib, CmpDir::Eq);
        let z = b.splat(x, 0.0);
        let rowm = b.select(at_row, x, z);
        let row = b.reduce(rowm, &[r as i64 - 2], ReduceKind::Sum);
        let diag_imax = pick(b, row, imax);
        let kb = b.full(DType::I32, &vshape, k as f64);
        let in_trail = b.compare(vids, kb, CmpDir::Ge);
        let ivb = per_batch(b, imax, &vshape);
        let not_diag = b.compare(vids, ivb, CmpDir::Ne);
        let keep = b.and(in_trail, not_diag);
        let ar = b.abs(row);
        let zr = b.splat(ar, 0.0);
        let ar = b.select(keep, ar, zr);
        let rowmax = b.reduce(ar, &[r as i64 - 2], ReduceKind::Max);
        let al = b.splat(colmax, alpha);
        let ac = b.mul(al, colmax);
        let c0 = b.compare(absakk, ac, CmpDir::Ge);
        let ratio = b.div(colmax, rowmax);
        let acr = b.mul(ac, ratio);
        let c1 = b.compare(absakk, acr, CmpDir::Ge);
        let adi = b.abs(diag_imax);
        let arow = b.mul(al, rowmax);
        let c2 = b.compare(adi, arow, CmpDir::Ge);
        let big = b.max(absakk, colmax);
        let is_zero = b.compare(big, zero_s, CmpDir::Eq);
        let nan = b.compare(absakk, absakk, CmpDir::Ne);
        let zero = b.or(is_zero, nan);
        let keep_k = b.or(c0, c1);
        let one_step = b.or(keep_k, c2);
        let two = b.not(one_step);
        let nz = b.not(zero);
        let two = b.and(two, nz);
        let kp = b.select(keep_k, kc, imax);
        let kp = b.select(zero, kc, kp);
        let one_i = b.full(DType::I32, &batch, 1.0);
        let zi = b.full(DType::I32, &batch, 0.0);
        let step = b.select(two, one_i, zi);
        let kk = b.add(kc, step);
        // Swap kk and kp in the trailing matrix.
        let kkb = per_batch(b, kk, &vshape);
        let kpb = per_batch(b, kp, &vshape);
        let is_kk = b.compare(vids, kkb, CmpDir::Eq);
        let is_kp = b.compare(vids, kpb, CmpDir::Eq);
        let perm = b.select(is_kp, kkb, vids);
        let perm = b.select(is_kk, kpb, perm);
        let sw = gather_rows(b, x, perm);
        let sw = gather_cols(b, sw, perm);
        let kf = b.full(DType::I32, &shape, k as f64);
        let ri = b.compare(rows, kf, CmpDir::Ge);
        let ci = b.compare(cols, kf, CmpDir::Ge);
        let trail = b.and(ri, ci);
        let sw = b.select(trail, sw, x);
        // 1x1 pivot: A22 -= x (x / akk)^T, then the column scaled by 1 / akk.
        let a1 = if k + 1 < n {
            let m = n - k - 1;
            let akk = at(b, sw, k, k);
            let one = b.splat(akk, 1.0);
            let d11 = b.div(one, akk);
            let xc = col_part(b, sw, k, k + 1, n);
            let cs = b.shape(xc);
            let d = per_batch(b, d11, &cs);
            let nd = b.neg(d);
            let t = b.mul(nd, xc);
            let sq = cat(&batch, &[m, m]);
            let xi = along(b, xc, &sq, r - 2);
            let tj = along(b, t, &sq, r - 1);
            let upd = b.mul(xi, tj);
            let t22 = block(b, sw, k + 1, k + 1);
            let t22 = b.add(t22, upd);
            let y = put(b, sw, t22, k + 1, k + 1);
            // The column below the pivot, scaled by 1 / akk.
            let l = b.mul(xc, d);
            let l = b.reshape(l, &cat(&batch, &[m, 1]));
            put(b, y, l, k + 1, k)
        } else {
            sw
        };
        // 2x2 pivot on (k, k+1).
        let a2 = if k + 2 < n {
            let m = n - k - 2;
            let d21 = at(b, sw, k + 1, k);
            let d11 = at(b, sw, k + 1, k + 1);
            let d11 = b.div(d11, d21);
            let d22 = at(b, sw, k, k);
            let d22 = b.div(d22, d21);
            let one = b.splat(d21, 1.0);
            let den = b.mul(d11, d22);
            let den = b.sub(den, one);
            let t = b.div(one, den);
            let d21 = b.div(t, d21);
            let ac = col_part(b, sw, k, k + 2, n);
            let bc = col_part(b, sw, k + 1, k + 2, n);
            let cs = b.shape(ac);
            let d11b = per_batch(b, d11, &cs);
            let d22b = per_batch(b, d22, &cs);
            let d21b = per_batch(b, d21, &cs);
            let wk = b.mul(d11b, ac);
            let wk = b.sub(wk, bc);
            let wk = b.mul(d21b, wk);
            let wk1 = b.mul(d22b, bc);
            let wk1 = b.sub(wk1, ac);
            let wk1 = b.mul(d21b, wk1);
            let sq = cat(&batch, &[m, m]);
            let ai = along(b, ac, &sq, r - 2);
            let wj = along(b, wk, &sq, r - 1);
            let u1 = b.mul(ai, wj);
            let bi = along(b, bc, &sq, r - 2);
            let w1j = along(b, wk1, &sq, r - 1);
            let u2 = b.mul(bi, w1j);
            let t22 = block(b, sw, k + 2, k + 2);
            let t22 = b.sub(t22, u1);
            let t22 = b.sub(t22, u2);
            let y = put(b, sw, t22, k + 2, k + 2);
            let wk = b.reshape(wk, &cat(&batch, &[m, 1]));
            let wk1 = b.reshape(wk1, &cat(&batch, &[m, 1]));
            let y = put(b, y, wk, k + 2, k);
            put(b, y, wk1, k + 2, k + 1)
        } else {
            sw
        };
        let twob = fb(b, two, &shape);
        let next = b.select(twob, a2, a1);
        let zb = fb(b, zero, &shape);
        let next = b.select(zb, x, next);
        let next = sym_from_lower(b, next);
        let act = b.not(skip);
        let actb = fb(b, act, &shape);
        x = b.select(actb, next, x);
        // Pivots: kp + 1, or -(kp + 1) on both rows of a 2x2 block; k + 1 for a zero column.
        let p1 = b.add(kp, one_i);
        let pn = b.neg(p1);
        let pk = b.select(two, pn, p1);
        let pkb = per_batch(b, pk, &vshape);
        let here = b.compare(vids, kb, CmpDir::Eq);
        let actv = fb(b, act, &vshape);
        let set = b.and(here, actv);
        piv = b.select(set, pkb, piv);
        if k + 1 < n {
            let k1 = b.full(DType::I32, &vshape, (k + 1) as f64);
            let next_row = b.compare(vids, k1, CmpDir::Eq);
            let two_v = fb(b, two, &vshape);
            let set2 = b.and(next_row, actv);
            let set2 = b.and(set2, two_v);
            piv = b.select(set2, pkb, piv);
        }
        let no_info = b.compare(info, zi, CmpDir::Eq);
        let first = b.and(no_info, zero);
        let first = b.and(first, act);
        let k1 = b.full(DType::I32, &batch, (k + 1) as f64);
        info = b.select(first, k1, info);
        skip = b.and(act, two);
    }
    (tri(b, x, true, 0), piv, info)
}

/// linalg_ldl_factor_ex (real matrices: `hermitian` changes nothing).
fn ldl_factor_ex(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "self")?;
    let op = "torch.linalg.ldl_factor_ex";
    need_square(op, "A", &a.shape)?;
    need_float(op, a.dtype)?;
    need_kernel("ldl_factor_kernel_cpu", a.dtype)?;
    if c.args.bool_or("check_errors", false) {
        return decline("ldl_factor_ex: check_errors");
    }
    let (batch, n, _) = split(&a.shape);
    if n > LDL_MAX_N {
        return decline(format!(
            "ldl_factor_ex: {n} x {n} matrices (unrolled up to {LDL_MAX_N})"
        ));
    }
    let b = &mut *c.b;
    if numel(&a.shape) == 0 {
        return Ok(vec![
            Out::T(a.value),
            Out::T(b.full(DType::I32, &cat(&batch, &[n]), 0.0)),
            Out::T(b.full(DType::I32, &batch, 0.0)),
        ]);
    }
    let (ld, piv, info) = ldl_values(b, a.value);
    Ok(vec![Out::T(ld), Out::T(piv), Out::T(info)])
}

/// Swaps, per batch, rows `i` (static) and `p` ([batch...] i32) of `x` [batch..., n, k].
fn swap_rows(b: &mut Builder, x: Value, i: i64, p: Value) -> Value {
    let r = b.rank(x);
    let iv = i32c(b, i);
    swap(b, x, r - 2, iv, p)
}

/// Row `i` (static) of `x` [batch..., n, k]: [batch..., 1, k].
fn row_of(b: &mut Builder, x: Value, i: i64) -> Value {
    let r = b.rank(x);
    b.slice_dim(x, r - 2, i, i + 1, 1)
}

/// linalg_ldl_solve: A X = B from the factorization `LD`/`pivots`, as LAPACK's sytrs.
fn ldl_solve(c: &mut Ctx) -> LResult<Vec<Out>> {
    let ld = tensor(c, "LD")?;
    let pv = tensor(c, "pivots")?;
    let bt = tensor(c, "B")?;
    let op = "torch.linalg.ldl_solve";
    need_square(op, "A", &ld.shape)?;
    let lr = ld.shape.len();
    if pv.shape[..] != ld.shape[..lr - 1] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{op}: Expected LD.shape[:-1] and pivots.shape to be the same, but got pivots with shape {} instead",
                shape_str(&pv.shape)
            ),
        );
    }
    if bt.shape.len() < 2 || !pv.dtype.is_int() {
        // The CPU raises IndexError from B.size(-2) / its own pivots check.
        return decline("ldl_solve: B of rank < 2 or non-integer pivots");
    }
    if bt.dtype != ld.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected b and A to have the same dtype, but found b of type {} and A of type {} instead.",
                torch_name(bt.dtype),
                torch_name(ld.dtype)
            ),
        );
    }
    let n = ld.shape[lr - 1];
    let br = bt.shape.len();
    if bt.shape[br - 2] != n {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Incompatible matrix sizes for {op}: each A matrix is {n} by {n} but each b matrix is {} by {}",
                bt.shape[br - 2],
                bt.shape[br - 1]
            ),
        );
    }
    need_kernel("ldl_solve_cpu", ld.dtype)?;
    if n > LDL_MAX_N {
        return decline(format!(
            "ldl_solve: {n} x {n} matrices (unrolled up to {LDL_MAX_N})"
        ));
    }
    let Ok(batch) = broadcast_shapes(&ld.shape[..lr - 2], &bt.shape[..br - 2]) else {
        return decline("ldl_solve: batch dims do not broadcast");
    };
    let k = bt.shape[br - 1];
    let b = &mut *c.b;
    let xshape = cat(&batch, &[n, k]);
    if numel(&xshape) == 0 {
        return Ok(vec![Out::T(b.full(ld.dtype, &xshape, 0.0))]);
    }
    let a = b.broadcast_to(ld.value, &cat(&batch, &[n, n]));
    let p = b.convert(pv.value, DType::I32);
    let p = b.broadcast_to(p, &cat(&batch, &[n]));
    let mut x = b.broadcast_to(bt.value, &xshape);
    let r = xshape.len();
    let zi = b.full(DType::I32, &batch, 0.0);
    let one_i = b.full(DType::I32, &batch, 1.0);
    let rowb = |b: &mut Builder, v: Value| {
        let s = cat(&batch, &[1, k]);
        per_batch(b, v, &s)
    };
    // L D Y = B, forward.
    let mut skip = b.full(DType::Bool, &batch, 0.0);
    for kk in 0..n {
        let pk = b.slice_dim(p, r - 2, kk, kk + 1, 1);
        let pk = b.reshape(pk, &batch);
        let one = b.compare(pk, zi, CmpDir::Gt);
        // 1x1
        let kp1 = b.sub(pk, one_i);
        let y1 = swap_rows(b, x, kk, kp1);
        let y1 = {
            let bk = row_of(b, y1, kk);
            let mut y = y1;
            if kk + 1 < n {
                let l = col_part(b, a, kk, kk + 1, n);
                let rest = b.slice_dim(y, r - 2, kk + 1, n, 1);
                let ls = cat(&batch, &[n - kk - 1, k]);
                let lb = along(b, l, &ls, r - 2);
                let bkb = b.broadcast_in_dim(bk, &ls, &upto(r));
                let prod = b.mul(lb, bkb);
                let rest = b.sub(rest, prod);
                y = put(b, y, rest, kk + 1, 0);
            }
            let akk = at(b, a, kk, kk);
            let o = b.splat(akk, 1.0);
            let inv = b.div(o, akk);
            let inv = rowb(b, inv);
            let bk = row_of(b, y, kk);
            let bk = b.mul(bk, inv);
            put(b, y, bk, kk, 0)
        };
        // 2x2 on (kk, kk + 1)
        let y2 = if kk + 1 < n {
            let neg = b.neg(pk);
            let kp2 = b.sub(neg, one_i);
            let mut y = swap_rows(b, x, kk + 1, kp2);
            if kk + 2 < n {
                let ls = cat(&batch, &[n - kk - 2, k]);
                for j in [kk, kk + 1] {
                    let l = col_part(b, a, j, kk + 2, n);
                    let lb = along(b, l, &ls, r - 2);
                    let bj = row_of(b, y, j);
                    let bjb = b.broadcast_in_dim(bj, &ls, &upto(r));
                    let prod = b.mul(lb, bjb);
                    let rest = b.slice_dim(y, r - 2, kk + 2, n, 1);
                    let rest = b.sub(rest, prod);
                    y = put(b, y, rest, kk + 2, 0);
                }
            }
            let akm1k = at(b, a, kk + 1, kk);
            let akm1 = at(b, a, kk, kk);
            let akm1 = b.div(akm1, akm1k);
            let ak = at(b, a, kk + 1, kk + 1);
            let ak = b.div(ak, akm1k);
            let o = b.splat(ak, 1.0);
            let den = b.mul(akm1, ak);
            let den = b.sub(den, o);
            let (akm1k, akm1, ak, den) = (rowb(b, akm1k), rowb(b, akm1), rowb(b, ak), rowb(b, den));
            let bkm1 = row_of(b, y, kk);
            let bkm1 = b.div(bkm1, akm1k);
            let bk = row_of(b, y, kk + 1);
            let bk = b.div(bk, akm1k);
            let t0 = b.mul(ak, bkm1);
            let t0 = b.sub(t0, bk);
            let t0 = b.div(t0, den);
            let t1 = b.mul(akm1, bk);
            let t1 = b.sub(t1, bkm1);
            let t1 = b.div(t1, den);
            let y = put(b, y, t0, kk, 0);
            put(b, y, t1, kk + 1, 0)
        } else {
            y1
        };
        let oneb = per_batch(b, one, &xshape);
        let next = b.select(oneb, y1, y2);
        let act = b.not(skip);
        let actb = per_batch(b, act, &xshape);
        x = b.select(actb, next, x);
        let two = b.not(one);
        skip = b.and(act, two);
    }
    // L^T X = Y, backward.
    let mut skip = b.full(DType::Bool, &batch, 0.0);
    for kk in (0..n).rev() {
        let pk = b.slice_dim(p, r - 2, kk, kk + 1, 1);
        let pk = b.reshape(pk, &batch);
        let one = b.compare(pk, zi, CmpDir::Gt);
        let mut y = x;
        let mut y2 = x;
        if kk + 1 < n {
            let rest = b.slice_dim(x, r - 2, kk + 1, n, 1);
            let ls = cat(&batch, &[n - kk - 1, k]);
            let upd = |b: &mut Builder, col: i64, target: Value| {
                let l = col_part(b, a, col, kk + 1, n);
                let lb = along(b, l, &ls, r - 2);
                let prod = b.mul(lb, rest);
                let dot = b.reduce(prod, &[r as i64 - 2], ReduceKind::Sum);
                let dot = b.reshape(dot, &cat(&batch, &[1, k]));
                b.sub(target, dot)
            };
            let bk = row_of(b, x, kk);
            let bk = upd(b, kk, bk);
            y = put(b, x, bk, kk, 0);
            y2 = y;
            if kk >= 1 {
                let bkm1 = row_of(b, x, kk - 1);
                let bkm1 = upd(b, kk - 1, bkm1);
                y2 = put(b, y2, bkm1, kk - 1, 0);
            }
        }
        let kp1 = b.sub(pk, one_i);
        let y = swap_rows(b, y, kk, kp1);
        let neg = b.neg(pk);
        let kp2 = b.sub(neg, one_i);
        let y2 = swap_rows(b, y2, kk, kp2);
        let oneb = per_batch(b, one, &xshape);
        let next = b.select(oneb, y, y2);
        let act = b.not(skip);
        let actb = per_batch(b, act, &xshape);
        x = b.select(actb, next, x);
        let two = b.not(one);
        skip = b.and(act, two);
    }
    Ok(vec![Out::T(x)])
}

/// linalg.polar: A = U H with U = W V^T and H = V S V^T from A's thin SVD W S V^T.
fn polar(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = tensor(c, "A")?;
    let op = "linalg.polar";
    need_matrix(op, "A", &a.shape)?;
    let (batch, m, n) = split(&a.shape);
    if m < n {
        return user_err(
            ErrorKind::Runtime,
            format!("{op}: input must have at least as many rows as columns, but got {m} by {n} matrices"),
        );
    }
    need_float(op, a.dtype)?;
    need_kernel("linalg_svd_cpu", a.dtype)?;
    let b = &mut *c.b;
    if numel(&a.shape) == 0 {
        let u = b.full(a.dtype, &a.shape, 0.0);
        let h = b.full(a.dtype, &cat(&batch, &[n, n]), 0.0);
        return Ok(vec![Out::T(u), Out::T(h)]);
    }
    let (Some(w), s, Some(v)) = svd_tall(b, a.value, false, true) else {
        unreachable!("svd_tall returns U and V when asked")
    };
    let vt = mt(b, v);
    let u = matmul(b, w, vt);
    let r = a.shape.len();
    let s = along(b, s, &cat(&batch, &[n, n]), r - 1);
    let vs = b.mul(v, s);
    Ok(vec![Out::T(u), Out::T(matmul(b, vs, vt))])
}

/// The ops of this family whose first result PyTorch lays out column-major (see
/// `super::column_major_result`).
pub const COLUMN_MAJOR_RESULTS: &[&str] = &[
    "aten::geqrf",
    "aten::ormqr",
    "aten::linalg_householder_product",
    "aten::linalg_lstsq",
];

pub const RULES: &[(&str, Rule)] = &[
    ("aten::linalg_lu_factor_ex", lu_factor_ex),
    ("aten::linalg_lu", linalg_lu),
    ("aten::lu_unpack", lu_unpack),
    ("aten::linalg_lu_solve", lu_solve),
    ("aten::linalg_inv_ex", inv_ex),
    ("aten::_linalg_det", det),
    ("aten::_linalg_slogdet", slogdet),
    ("aten::_linalg_solve_ex", solve_ex),
    ("aten::linalg_qr", qr),
    ("aten::geqrf", geqrf),
    ("aten::linalg_householder_product", householder_product),
    ("aten::_linalg_eigh", eigh),
    ("aten::_linalg_svd", svd),
    ("aten::linalg_matrix_sqrth", matrix_sqrth),
    ("aten::linalg_polar", polar),
    ("aten::ormqr", ormqr),
    ("aten::linalg_lstsq", lstsq),
    ("aten::linalg_ldl_factor_ex", ldl_factor_ex),
    ("aten::linalg_ldl_solve", ldl_solve),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Arg, Args, LowerError};

    use crate::args::param_arg as tensor;

    /// Runs `rule`: the shapes of its results and the printed module.
    fn run(
        rule: Rule,
        items: Vec<(&str, Arg)>,
        b: &mut Builder,
    ) -> LResult<(Vec<Vec<i64>>, String)> {
        let args = Args {
            items: items.into_iter().map(|(n, a)| (n.to_string(), a)).collect(),
        };
        let mut c = Ctx::new(b, "aten::test", "", &args);
        let outs = rule(&mut c)?;
        let vals: Vec<Value> = outs
            .iter()
            .filter_map(|o| match o {
                Out::T(v) => Some(*v),
                _ => None,
            })
            .collect();
        let shapes = vals.iter().map(|v| c.b.shape(*v)).collect();
        Ok((shapes, c.b.finish(&vals)))
    }

    fn ok(r: LResult<(Vec<Vec<i64>>, String)>) -> Vec<Vec<i64>> {
        match r {
            Ok((s, _)) => s,
            Err(LowerError::Declined(w)) | Err(LowerError::User(_, w)) => panic!("{w}"),
        }
    }

    fn user_error(r: LResult<(Vec<Vec<i64>>, String)>) -> (ErrorKind, String) {
        match r {
            Err(LowerError::User(k, m)) => (k, m),
            other => panic!("expected a user error, got {:?}", other.map(|x| x.0)),
        }
    }

    /// A fresh builder with tensor arguments of the given dtypes and shapes.
    fn with(specs: &[(&'static str, DType, &[i64])]) -> (Builder, Vec<(&'static str, Arg)>) {
        let mut b = Builder::new();
        let items = specs
            .iter()
            .map(|(n, d, s)| (*n, tensor(&mut b, *d, s)))
            .collect();
        (b, items)
    }

    #[test]
    fn lu_family_shapes() {
        let (mut b, items) = with(&[("A", DType::F32, &[2, 3, 5])]);
        let (s, m) = run(lu_factor_ex, items, &mut b).unwrap();
        assert_eq!(s, vec![vec![2, 3, 5], vec![2, 3], vec![2]]);
        assert!(m.contains("stablehlo.while"));
        let (mut b, items) = with(&[("A", DType::F64, &[5, 3])]);
        assert_eq!(
            ok(run(linalg_lu, items, &mut b)),
            vec![vec![5, 5], vec![5, 3], vec![3, 3]]
        );
        let (mut b, items) = with(&[
            ("LU_data", DType::F32, &[3, 5]),
            ("LU_pivots", DType::I32, &[3]),
        ]);
        assert_eq!(
            ok(run(lu_unpack, items, &mut b)),
            vec![vec![3, 3], vec![3, 3], vec![3, 5]]
        );
        let (mut b, mut items) = with(&[
            ("LU_data", DType::F32, &[4, 4]),
            ("LU_pivots", DType::I64, &[4]),
        ]);
        items.push(("unpack_pivots", Arg::Bool(false)));
        assert_eq!(
            ok(run(lu_unpack, items, &mut b)),
            vec![vec![0], vec![4, 4], vec![4, 4]]
        );
        // Empty matrices skip the loop.
        let (mut b, items) = with(&[("A", DType::F32, &[0, 0])]);
        let (s, m) = run(det, items, &mut b).unwrap();
        assert_eq!(s, vec![vec![], vec![0, 0], vec![0]]);
        assert!(!m.contains("stablehlo.while"));
    }

    #[test]
    fn solve_shapes_follow_numpy_vector_rule() {
        // B of shape A.shape[:-1] is a batch of vectors.
        let (mut b, items) = with(&[("A", DType::F32, &[2, 3, 3]), ("B", DType::F32, &[2, 3])]);
        assert_eq!(
            ok(run(solve_ex, items, &mut b)),
            vec![vec![2, 3], vec![2, 3, 3], vec![2, 3], vec![2]]
        );
        // Batches broadcast; LU keeps A's.
        let (mut b, items) = with(&[
            ("A", DType::F64, &[2, 1, 3, 3]),
            ("B", DType::F64, &[4, 3, 2]),
        ]);
        assert_eq!(
            ok(run(solve_ex, items, &mut b)),
            vec![
                vec![2, 4, 3, 2],
                vec![2, 1, 3, 3],
                vec![2, 1, 3],
                vec![2, 1]
            ]
        );
        let (mut b, items) = with(&[("A", DType::F32, &[3, 3]), ("B", DType::F32, &[4])]);
        let (k, m) = user_error(run(solve_ex, items, &mut b));
        assert_eq!(k, ErrorKind::Runtime);
        assert_eq!(
            m,
            "linalg.solve: Incompatible shapes of A and B for the equation AX = B (3x3 and 4x1)"
        );
        let (mut b, mut items) = with(&[("A", DType::F32, &[3, 3]), ("B", DType::F32, &[3])]);
        items.push(("check_errors", Arg::Bool(true)));
        assert!(matches!(
            run(solve_ex, items, &mut b),
            Err(LowerError::Declined(_))
        ));
    }

    #[test]
    fn lu_solve_checks_like_the_meta_function() {
        let (mut b, items) = with(&[
            ("LU", DType::F32, &[2, 3, 3]),
            ("pivots", DType::I32, &[2, 3]),
            ("B", DType::F32, &[4, 1, 3, 2]),
        ]);
        assert_eq!(ok(run(lu_solve, items, &mut b)), vec![vec![4, 2, 3, 2]]);
        let (mut b, items) = with(&[
            ("LU", DType::F32, &[3, 3]),
            ("pivots", DType::I64, &[3]),
            ("B", DType::F32, &[3, 2]),
        ]);
        let (_, m) = user_error(run(lu_solve, items, &mut b));
        assert_eq!(
            m,
            "linalg.lu_solve: pivots should be a Tensor of scalar type torch.int32"
        );
        let (mut b, mut items) = with(&[
            ("LU", DType::F32, &[3, 3]),
            ("pivots", DType::I32, &[3]),
            ("B", DType::F32, &[3, 2]),
        ]);
        items.push(("left", Arg::Bool(false)));
        let (_, m) = user_error(run(lu_solve, items, &mut b));
        assert_eq!(
            m,
            "linalg.lu_solve: Incompatible shapes of A and B for the equation XA = B (3x3 and 3x2)"
        );
    }

    #[test]
    fn dtype_errors_match_the_cpu_kernels() {
        let (mut b, items) = with(&[("A", DType::I64, &[3, 3])]);
        assert_eq!(
            user_error(run(lu_factor_ex, items, &mut b)),
            (
                ErrorKind::NotImplemented,
                "\"lu_cpu\" not implemented for 'Long'".to_string()
            )
        );
        let (mut b, items) = with(&[("A", DType::F16, &[3, 3])]);
        assert_eq!(
            user_error(run(inv_ex, items, &mut b)).1,
            "linalg.inv: Low precision dtypes not supported. Got Half"
        );
        let (mut b, items) = with(&[("A", DType::BF16, &[3, 3])]);
        assert_eq!(
            user_error(run(det, items, &mut b)).1,
            "\"lu_cpu\" not implemented for 'BFloat16'"
        );
        let (mut b, items) = with(&[("A", DType::F32, &[3, 4])]);
        assert_eq!(
            user_error(run(slogdet, items, &mut b)).1,
            "linalg.slogdet: A must be batches of square matrices, but they are 3 by 4 matrices"
        );
        let (mut b, items) = with(&[("A", DType::F32, &[3])]);
        assert_eq!(
            user_error(run(lu_factor_ex, items, &mut b)).1,
            "torch.lu_factor: Expected tensor with 2 or more dimensions. Got size: [3] instead"
        );
    }

    #[test]
    fn qr_modes() {
        for (shape, mode, q, r) in [
            (vec![5, 3], "reduced", vec![5, 3], vec![3, 3]),
            (vec![5, 3], "complete", vec![5, 5], vec![5, 3]),
            (vec![5, 3], "r", vec![0], vec![3, 3]),
            (vec![3, 5], "complete", vec![3, 3], vec![3, 5]),
            (vec![2, 3, 0], "complete", vec![2, 3, 3], vec![2, 3, 0]),
        ] {
            let mut b = Builder::new();
            let a = tensor(&mut b, DType::F32, &shape);
            let (s, m) = run(qr, vec![("A", a), ("mode", Arg::Str(mode.into()))], &mut b).unwrap();
            assert_eq!(s, vec![q, r], "{shape:?} {mode}");
            assert_eq!(m.contains("\"Qr\""), !shape.contains(&0));
        }
        let mut b = Builder::new();
        let a = tensor(&mut b, DType::F32, &[3, 3]);
        let (_, m) = user_error(run(
            qr,
            vec![("A", a), ("mode", Arg::Str("foo".into()))],
            &mut b,
        ));
        assert_eq!(
            m,
            "qr received unrecognized mode 'foo' but expected one of 'reduced' (default), 'r', or 'complete'"
        );
    }

    #[test]
    fn householder_product_checks() {
        let (mut b, items) = with(&[
            ("input", DType::F32, &[2, 5, 3]),
            ("tau", DType::F32, &[2, 2]),
        ]);
        assert_eq!(
            ok(run(householder_product, items, &mut b)),
            vec![vec![2, 5, 3]]
        );
        let (mut b, items) = with(&[
            ("input", DType::F32, &[2, 5, 3]),
            ("tau", DType::F32, &[3, 2]),
        ]);
        assert_eq!(
            user_error(run(householder_product, items, &mut b)).1,
            "torch.linalg.householder_product: Expected batch dimensions of tau to be equal to input.shape[:-2], but got [3]"
        );
        let (mut b, items) = with(&[("input", DType::F32, &[5, 3]), ("tau", DType::F32, &[])]);
        assert_eq!(
            user_error(run(householder_product, items, &mut b)).0,
            ErrorKind::Index
        );
    }

    #[test]
    fn eigh_uses_xla_for_float32_and_jacobi_for_float64() {
        let (mut b, items) = with(&[("A", DType::F32, &[2, 4, 4])]);
        let (s, m) = run(eigh, items, &mut b).unwrap();
        assert_eq!(s, vec![vec![2, 4], vec![2, 4, 4]]);
        assert!(m.contains("\"Eigh\""));
        let (mut b, mut items) = with(&[("A", DType::F64, &[4, 4])]);
        items.push(("compute_v", Arg::Bool(false)));
        let (s, m) = run(eigh, items, &mut b).unwrap();
        assert_eq!(s, vec![vec![4], vec![0]]);
        assert!(!m.contains("\"Eigh\"") && m.contains("stablehlo.while"));
        let (mut b, mut items) = with(&[("A", DType::F32, &[3, 3])]);
        items.push(("UPLO", Arg::Str("X".into())));
        assert_eq!(
            user_error(run(eigh, items, &mut b)).1,
            "Expected UPLO argument to be 'L' or 'U', but got X"
        );
    }

    #[test]
    fn svd_shapes() {
        for (shape, full, uv, want) in [
            (
                vec![2, 3, 5],
                true,
                true,
                vec![vec![2, 3, 3], vec![2, 3], vec![2, 5, 5]],
            ),
            (
                vec![2, 3, 5],
                false,
                true,
                vec![vec![2, 3, 3], vec![2, 3], vec![2, 3, 5]],
            ),
            (
                vec![6, 4],
                true,
                true,
                vec![vec![6, 6], vec![4], vec![4, 4]],
            ),
            (vec![7, 3], false, false, vec![vec![0], vec![3], vec![0]]),
            (
                vec![0, 5],
                true,
                true,
                vec![vec![0, 0], vec![0], vec![5, 5]],
            ),
        ] {
            let mut b = Builder::new();
            let a = tensor(&mut b, DType::F32, &shape);
            let items = vec![
                ("A", a),
                ("full_matrices", Arg::Bool(full)),
                ("compute_uv", Arg::Bool(uv)),
            ];
            let (s, _) = run(svd, items, &mut b).unwrap();
            assert_eq!(s, want, "{shape:?} full={full} uv={uv}");
        }
        let mut b = Builder::new();
        let a = tensor(&mut b, DType::F32, &[3, 3]);
        let (_, m) = user_error(run(
            svd,
            vec![("A", a), ("driver", Arg::Str("gesvd".into()))],
            &mut b,
        ));
        assert!(m.contains("`driver=` is only supported on CUDA"), "{m}");
    }
}
