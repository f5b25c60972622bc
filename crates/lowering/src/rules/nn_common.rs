//! Helpers the torch.nn rule families share (normalization, pooling, convolution,
//! resampling, ...): argument checks, per-channel broadcasting, small constant matrices
//! applied along a dimension.

use super::{opmath, promote};
use crate::promote::torch_name;
use crate::shape::numel;
use crate::{decline, Builder, Ctx, DType, LResult, Out, TensorArg, TensorType, Value};
use stablehlo::{CmpDir, ReduceKind};

pub(super) fn tensor(c: &Ctx, name: &str) -> LResult<TensorArg> {
    Ok(c.args.tensor(name)?.clone())
}

pub(super) fn float_input(t: &TensorArg, op: &str) -> LResult<()> {
    if !t.dtype.is_float() {
        // The CPU fallback raises PyTorch's own "not implemented for 'Long'" error.
        return decline(format!("{op}: {} input", torch_name(t.dtype)));
    }
    Ok(())
}

/// Sum over every dim except `keep` (a 1-d result).
pub(super) fn sum_but(b: &mut Builder, x: Value, keep: usize) -> Value {
    let dims: Vec<i64> = (0..b.rank(x) as i64)
        .filter(|d| *d != keep as i64)
        .collect();
    b.reduce(x, &dims, ReduceKind::Sum)
}

/// A 1-d per-channel value broadcast along dim 1 of `shape`.
pub(super) fn per_channel(b: &mut Builder, v: Value, shape: &[i64]) -> Value {
    b.broadcast_in_dim(v, shape, &[1])
}

pub(super) fn recip_sqrt(b: &mut Builder, v: Value, eps: f64) -> Value {
    let e = b.splat(v, eps);
    let s = b.add(v, e);
    let s = b.sqrt(s);
    let one = b.splat(s, 1.0);
    b.div(one, s)
}

/// A 1-d constant with arbitrary values.
pub(super) fn const_vec(b: &mut Builder, dtype: DType, vals: &[f64]) -> Value {
    let ty = TensorType::new(dtype, &[vals.len() as i64]);
    let items: Vec<String> = vals.iter().map(|v| dtype.literal(*v)).collect();
    let attr = format!("value = dense<[{}]> : {}", items.join(", "), ty.mlir());
    b.op("stablehlo.constant", &[], &attr, ty)
}

/// Expands a spatial parameter list given as one value or one per spatial dim.
pub(super) fn expand(v: Vec<i64>, n: usize, what: &str) -> LResult<Vec<i64>> {
    match v.len() {
        l if l == n => Ok(v),
        1 => Ok(vec![v[0]; n]),
        _ => decline(format!(
            "{what} has {} entries for {n} spatial dims",
            v.len()
        )),
    }
}

/// The nonzero entries of each row of `m` ([out][in]) as (k, indices, weights), `k` per
/// row; short rows are padded with index 0 and weight 0.
pub(super) fn sparse_rows(m: &[Vec<f64>]) -> (usize, Vec<i64>, Vec<f64>) {
    let k = m
        .iter()
        .map(|row| row.iter().filter(|w| **w != 0.0).count())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut idx = Vec::with_capacity(m.len() * k);
    let mut wts = Vec::with_capacity(m.len() * k);
    for row in m {
        let before = idx.len();
        for (i, w) in row.iter().enumerate().filter(|(_, w)| **w != 0.0) {
            idx.push(i as i64);
            wts.push(*w);
        }
        for _ in idx.len() - before..k {
            idx.push(0);
            wts.push(0.0);
        }
    }
    (k, idx, wts)
}

/// `x` gathered along `dim` at `idx`, read as rows of `k` indices: `dim` becomes the two
/// dims (rows, k).
pub(super) fn take_rows(b: &mut Builder, x: Value, dim: usize, idx: &[i64], k: usize) -> Value {
    let xs = b.shape(x);
    let m = idx.len() as i64;
    let iv = b.constant_vec_i64(idx);
    let iv = b.reshape(iv, &[m, 1]);
    let offset: Vec<i64> = (0..xs.len() as i64).filter(|d| *d != dim as i64).collect();
    let mut sizes = xs.clone();
    sizes[dim] = 1;
    let g = b.gather(x, iv, &offset, &[dim as i64], &[dim as i64], 1, &sizes);
    let mut shape = xs;
    shape[dim] = m / k as i64;
    shape.insert(dim + 1, k as i64);
    b.reshape(g, &shape)
}

/// The adjoint of `take_rows`: sums `g`, whose dims `dim`, `dim + 1` are (rows, k), into
/// `n` slots along `dim` at `idx`.
pub(super) fn put_rows(b: &mut Builder, g: Value, dim: usize, idx: &[i64], n: i64) -> Value {
    let mut gs = b.shape(g);
    let m = idx.len() as i64;
    gs.remove(dim + 1);
    gs[dim] = m;
    let g = b.reshape(g, &gs);
    let iv = b.constant_vec_i64(idx);
    let iv = b.reshape(iv, &[m, 1]);
    let mut shape = gs.clone();
    shape[dim] = n;
    let zero = b.full(b.dtype(g), &shape, 0.0);
    let win: Vec<i64> = (0..gs.len() as i64).filter(|d| *d != dim as i64).collect();
    let d = [dim as i64];
    b.scatter(zero, iv, g, &win, &d, &d, 1, |b, a, u| b.add(a, u))
}

/// `result[.., o, ..] = sum_i m[o][i] * x[.., i, ..]` along `dim`, gathering only each
/// row's nonzero entries. Zero weights are skipped (selected away), so an inf or NaN
/// outside a window does not leak into it.
pub(super) fn mix(b: &mut Builder, x: Value, dim: usize, m: &[Vec<f64>]) -> Value {
    let xs = b.shape(x);
    let out = m.len() as i64;
    let dt = b.dtype(x);
    if out == 0 || numel(&xs) == 0 {
        let mut shape = xs.clone();
        shape[dim] = out;
        return b.full(dt, &shape, 0.0);
    }
    let (k, idx, wts) = sparse_rows(m);
    let g = take_rows(b, x, dim, &idx, k);
    let gs = b.shape(g);
    let w = const_vec(b, dt, &wts);
    let w = b.reshape(w, &[out, k as i64]);
    let wb = b.broadcast_in_dim(w, &gs, &[dim as i64, dim as i64 + 1]);
    let z = b.splat(wb, 0.0);
    let nz = b.compare(wb, z, CmpDir::Ne);
    let p = b.mul(g, wb);
    let p = b.select(nz, p, z);
    b.reduce(p, &[dim as i64 + 1], ReduceKind::Sum)
}

/// Zeros of `shape` as the outputs of an op whose result has no elements.
pub(super) fn empty_outs(b: &mut Builder, dtypes: &[DType], shape: &[i64]) -> Vec<Out> {
    dtypes
        .iter()
        .map(|d| Out::T(b.full(*d, shape, 0.0)))
        .collect()
}

/// `shape` with its last `sp.len()` dims replaced by `sp`.
pub(super) fn with_spatial(shape: &[i64], sp: &[i64]) -> Vec<i64> {
    let mut s = shape.to_vec();
    let r = s.len();
    s[r - sp.len()..].copy_from_slice(sp);
    s
}

pub(super) fn transpose_matrix(m: &[Vec<f64>], cols: usize) -> Vec<Vec<f64>> {
    (0..cols)
        .map(|j| m.iter().map(|row| row[j]).collect())
        .collect()
}

/// Floor division for any signs.
pub(super) fn div_floor(a: i64, b: i64) -> i64 {
    let q = a / b;
    if a % b != 0 && ((a < 0) != (b < 0)) {
        q - 1
    } else {
        q
    }
}

/// `self` and `target` promoted and broadcast; float only.
pub(super) fn pair(c: &mut Ctx, names: &[&str]) -> LResult<(Vec<Value>, DType, Vec<i64>)> {
    let (v, dt, shape) = promote(c, names, super::same)?;
    if !dt.is_float() {
        return decline(format!("{}: non-float operands", c.op));
    }
    let cd = opmath(dt);
    let v = v.into_iter().map(|x| c.b.convert(x, cd)).collect();
    Ok((v, dt, shape))
}
/// The group of each of `n` positions, given the (sorted) start of every group but the
/// first: `#{s : starts[s] <= i}`. `starts` may be empty.
pub(super) fn group_of(b: &mut Builder, starts: Value, n: i64) -> Value {
    let k = b.shape(starts)[0];
    if k == 0 {
        return b.full(DType::I64, &[n], 0.0);
    }
    let s = b.convert(starts, DType::I64);
    let sb = b.broadcast_in_dim(s, &[k, n], &[0]);
    let pos = b.iota(DType::I64, &[k, n], 1);
    let le = b.compare(sb, pos, CmpDir::Le);
    let ones = b.convert(le, DType::I64);
    b.reduce(ones, &[0], ReduceKind::Sum)
}

/// `x` with zeros where `keep` is false.
pub(super) fn mask(b: &mut Builder, keep: Value, x: Value) -> Value {
    let z = b.splat(x, 0.0);
    b.select(keep, x, z)
}

/// PyTorch's legacy type name in messages (`torch.LongTensor`).
pub(super) fn tensor_type_name(d: DType) -> String {
    format!("torch.{}Tensor", torch_name(d))
}
