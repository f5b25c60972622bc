//! Vector norms (linalg_vector_norm, norm, renorm) and distances (cdist, pdist and their
//! backward).

use super::reduce::reduce_keep;
use crate::args::Scalar;
use crate::promote::{promote_types, torch_name};
use crate::shape::{broadcast_shapes, numel, reduce_dims, reduced_shape, wrap_dim};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};
use stablehlo::{CmpDir, ReduceKind};

use super::{input, is_half, scale};

fn pow(b: &mut Builder, x: Value, p: f64) -> Value {
    let k = b.splat(x, p);
    b.binary("stablehlo.power", x, k)
}

/// linalg.vector_norm's dtype check (renorm and `_foreach_norm` raise it too).
pub(super) fn vector_norm_input(d: DType) -> LResult<()> {
    if !d.is_float() {
        return user_err(
            ErrorKind::NotImplemented,
            format!(
                "linalg.vector_norm: Expected a floating point or complex tensor as input. Got {}",
                torch_name(d)
            ),
        );
    }
    Ok(())
}

/// `ord`-norm of `x` over `dims` (keepdim shape), in `x`'s dtype.
pub(crate) fn norm_keep(b: &mut Builder, x: Value, dims: &[i64], ord: f64) -> Value {
    let a = b.abs(x);
    if ord == f64::INFINITY {
        reduce_keep(b, a, dims, ReduceKind::Max, true)
    } else if ord == f64::NEG_INFINITY {
        reduce_keep(b, a, dims, ReduceKind::Min, true)
    } else if ord == 0.0 {
        let z = b.splat(x, 0.0);
        let nz = b.compare(x, z, CmpDir::Ne);
        let nz = b.convert(nz, b.dtype(x));
        reduce_keep(b, nz, dims, ReduceKind::Sum, true)
    } else if ord == 1.0 {
        reduce_keep(b, a, dims, ReduceKind::Sum, true)
    } else if ord == 2.0 {
        let sq = b.mul(x, x);
        let s = reduce_keep(b, sq, dims, ReduceKind::Sum, true);
        b.sqrt(s)
    } else {
        let p = pow(b, a, ord);
        let s = reduce_keep(b, p, dims, ReduceKind::Sum, true);
        pow(b, s, 1.0 / ord)
    }
}

/// The dtype norms accumulate in: float32 for half types.
fn opmath(d: DType) -> DType {
    match d {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

fn scalar_str(s: Scalar) -> String {
    match s {
        Scalar::Int(i) => i.to_string(),
        Scalar::Float(f) => format!("{f}"),
        Scalar::Bool(b) => (b as i64).to_string(),
        Scalar::Complex(re, im) => format!("({re}+{im}j)"),
    }
}

/// linalg_vector_norm and the `norm` overloads (`p` may be None: 2).
fn vector_norm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    // norm's own message only for its overloads without a dtype.
    let linalg = c.op == "aten::linalg_vector_norm" || c.args.has("dtype");
    if !t.dtype.is_float() {
        let msg = if linalg {
            format!(
                "linalg.vector_norm: Expected a floating point or complex tensor as input. Got {}",
                torch_name(t.dtype)
            )
        } else {
            format!(
                "norm(): input dtype should be either floating point or complex. Got {} instead.",
                torch_name(t.dtype)
            )
        };
        return user_err(ErrorKind::NotImplemented, msg);
    }
    let dtype = c.args.opt_dtype("dtype");
    if let Some(d) = dtype {
        if !d.is_float() {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "linalg.vector_norm: dtype should be floating point or complex, but got {}",
                    torch_name(d)
                ),
            );
        }
    }
    if let (Some(d), false) = (dtype, c.op == "aten::linalg_vector_norm") {
        if promote_types(t.dtype, d) != d {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "linalg.vector_norm: the dtype of the input ({}) should be convertible without narrowing to the specified dtype ({})",
                    torch_name(t.dtype),
                    torch_name(d)
                ),
            );
        }
    }
    let ord = c
        .args
        .opt_scalar("ord")
        .or(c.args.opt_scalar("p"))
        .unwrap_or(Scalar::Int(2));
    let p = ord.as_f64();
    let given = c.args.opt_ints("dim");
    let dims = reduce_dims(given.as_deref(), t.shape.len())?;
    let keep = c.args.bool_or("keepdim", false);
    if numel(&t.shape) == 0 && (p < 0.0 || p == f64::INFINITY) {
        match given.as_deref() {
            Some(d) if !d.is_empty() => {
                for d in &dims {
                    if t.shape[*d as usize] == 0 {
                        return user_err(
                            ErrorKind::Runtime,
                            format!(
                                "linalg.vector_norm cannot compute the {} norm on the dimension {d}because this dimension is empty and the operation does not have an identity",
                                scalar_str(ord)
                            ),
                        );
                    }
                }
            }
            _ => {
                return user_err(
                    ErrorKind::Runtime,
                    format!(
                        "linalg.vector_norm cannot compute the {} norm on an empty tensor because the operation does not have an identity",
                        scalar_str(ord)
                    ),
                )
            }
        }
    }
    let out_dt = dtype.unwrap_or(t.dtype);
    let b = &mut *c.b;
    let x = b.convert(t.value, opmath(out_dt));
    let r = norm_keep(b, x, &dims, p);
    let r = b.reshape(r, &reduced_shape(&t.shape, &dims, keep));
    Ok(vec![Out::T(b.convert(r, out_dt))])
}

fn renorm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let p = c.args.scalar("p")?;
    let maxnorm = c.args.scalar("maxnorm")?;
    if p.as_f64() <= 0.0 {
        return user_err(
            ErrorKind::Runtime,
            "renorm: non-positive-norm not supported",
        );
    }
    if maxnorm.as_f64() < 0.0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "renorm: expected maxnorm to be >= 0 but got {}",
                scalar_str(maxnorm)
            ),
        );
    }
    if t.shape.len() < 2 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "renorm: input needs at least 2 dimensions, got {} dimensions",
                t.shape.len()
            ),
        );
    }
    vector_norm_input(t.dtype)?;
    let dim = wrap_dim(c.args.int("dim")?, t.shape.len())? as i64;
    let others: Vec<i64> = (0..t.shape.len() as i64).filter(|d| *d != dim).collect();
    let b = &mut *c.b;
    let x = b.convert(t.value, opmath(t.dtype));
    let norm = norm_keep(b, x, &others, p.as_f64());
    // Slices whose norm exceeds maxnorm are scaled to maxnorm / (norm + 1e-7).
    let mx = b.splat(norm, maxnorm.as_f64());
    let eps = b.splat(norm, 1e-7);
    let den = b.add(norm, eps);
    let f = b.div(mx, den);
    let one = b.splat(norm, 1.0);
    let over = b.compare(norm, mx, CmpDir::Gt);
    let f = b.select(over, f, one);
    let f = b.convert(f, t.dtype);
    let f = b.broadcast_to(f, &t.shape);
    Ok(vec![Out::T(b.mul(t.value, f))])
}

/// `p`-distances between the rows of `x` [..., r1, m] and `y` [..., r2, m] (same batch),
/// computed per pair as PyTorch's direct kernel does: [..., r1, r2].
fn pair_dist(b: &mut Builder, x: Value, y: Value, p: f64) -> Value {
    let (xs, ys) = (b.shape(x), b.shape(y));
    let nb = xs.len() - 2;
    let (r1, r2, m) = (xs[nb], ys[nb], xs[nb + 1]);
    let mut full: Vec<i64> = xs[..nb].to_vec();
    full.extend([r1, r2, m]);
    let bd: Vec<i64> = (0..nb as i64).collect();
    let xd: Vec<i64> = bd
        .iter()
        .copied()
        .chain([nb as i64, nb as i64 + 2])
        .collect();
    let yd: Vec<i64> = bd
        .iter()
        .copied()
        .chain([nb as i64 + 1, nb as i64 + 2])
        .collect();
    let xb = b.broadcast_in_dim(x, &full, &xd);
    let yb = b.broadcast_in_dim(y, &full, &yd);
    let d = b.sub(xb, yb);
    let d = b.abs(d);
    let last = [nb as i64 + 2];
    if p == 0.0 {
        let cl = b.unary("stablehlo.ceil", d);
        let one = b.splat(cl, 1.0);
        let t = b.min(cl, one);
        b.reduce(t, &last, ReduceKind::Sum)
    } else if p == 1.0 {
        b.reduce(d, &last, ReduceKind::Sum)
    } else if p == 2.0 {
        let sq = b.mul(d, d);
        let s = b.reduce(sq, &last, ReduceKind::Sum);
        b.sqrt(s)
    } else if p.is_infinite() {
        // The kernel's running max starts at 0.
        let z = b.constant(b.dtype(d), 0.0);
        b.reduce_with(&[d], &[z], &last, |b, a| vec![b.max(a[0], a[1])])[0]
    } else {
        let t = pow(b, d, p);
        let s = b.reduce(t, &last, ReduceKind::Sum);
        pow(b, s, 1.0 / p)
    }
}

/// Euclidean distances through one matrix product, as PyTorch's `_euclidean_dist` computes
/// them for large inputs.
fn euclid_mm(b: &mut Builder, x: Value, y: Value) -> Value {
    let nb = b.rank(x) - 2;
    let last = nb + 1;
    let sq = b.mul(x, x);
    let xn = reduce_keep(b, sq, &[last as i64], ReduceKind::Sum, true);
    let sq = b.mul(y, y);
    let yn = reduce_keep(b, sq, &[last as i64], ReduceKind::Sum, true);
    let xp = b.splat(xn, 1.0);
    let yp = b.splat(yn, 1.0);
    let xm = scale(b, x, -2.0);
    let xa = b.concatenate(&[xm, xn, xp], last);
    let ya = b.concatenate(&[y, yp, yn], last);
    let bd: Vec<i64> = (0..nb as i64).collect();
    let dt = b.dtype(x);
    let r = b.dot_general(xa, ya, (&bd, &bd), (&[last as i64], &[last as i64]), dt);
    let z = b.splat(r, 0.0);
    let r = b.max(r, z);
    b.sqrt(r)
}

struct CdistArgs {
    x1: TensorArg,
    x2: TensorArg,
    batch: Vec<i64>,
    r1: i64,
    r2: i64,
    m: i64,
}

fn cdist_args(c: &Ctx) -> LResult<CdistArgs> {
    let x1 = c.args.tensor("x1")?.clone();
    let x2 = c.args.tensor("x2")?.clone();
    for (t, n) in [(&x1, "X1"), (&x2, "X2")] {
        if t.shape.len() < 2 {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "cdist only supports at least 2D tensors, {n} got: {}D",
                    t.shape.len()
                ),
            );
        }
    }
    let (l1, l2) = (x1.shape.len(), x2.shape.len());
    if x1.shape[l1 - 1] != x2.shape[l2 - 1] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "X1 and X2 must have the same number of columns. X1: {} X2: {}",
                x1.shape[l1 - 1],
                x2.shape[l2 - 1]
            ),
        );
    }
    for (t, n) in [(&x1, "X1"), (&x2, "X2")] {
        if !t.dtype.is_float() {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "cdist only supports floating-point dtypes, {n} got: {}",
                    torch_name(t.dtype)
                ),
            );
        }
    }
    if x1.dtype != x2.dtype {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "expected scalar type {} but found {}",
                torch_name(x1.dtype),
                torch_name(x2.dtype)
            ),
        );
    }
    if is_half(x1.dtype) {
        return decline("cdist of half tensors");
    }
    let batch = broadcast_shapes(&x1.shape[..l1 - 2], &x2.shape[..l2 - 2])?;
    Ok(CdistArgs {
        r1: x1.shape[l1 - 2],
        r2: x2.shape[l2 - 2],
        m: x1.shape[l1 - 1],
        x1,
        x2,
        batch,
    })
}

fn cdist_forward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = cdist_args(c)?;
    let p = c.args.float("p")?;
    if p < 0.0 {
        return user_err(
            ErrorKind::Runtime,
            "cdist only supports non-negative p values",
        );
    }
    let mode = c.args.opt_int("compute_mode").unwrap_or(0);
    if !(0..=2).contains(&mode) {
        return user_err(
            ErrorKind::Runtime,
            format!("possible modes: 0, 1, 2, but was: {mode}"),
        );
    }
    let mut out = a.batch.clone();
    out.extend([a.r1, a.r2]);
    let b = &mut *c.b;
    if numel(&out) == 0 || a.m == 0 {
        return Ok(vec![Out::T(b.full(a.x1.dtype, &out, 0.0))]);
    }
    let mut s1 = a.batch.clone();
    s1.extend([a.r1, a.m]);
    let mut s2 = a.batch.clone();
    s2.extend([a.r2, a.m]);
    let x = b.broadcast_to(a.x1.value, &s1);
    let y = b.broadcast_to(a.x2.value, &s2);
    let mm = p == 2.0 && (mode == 1 || (mode == 0 && (a.r1 > 25 || a.r2 > 25)));
    let r = if mm {
        euclid_mm(b, x, y)
    } else {
        pair_dist(b, x, y, p)
    };
    Ok(vec![Out::T(r)])
}

/// d dist(x, y) / dx for each pair and column, scaled by `g` (all [..., m]-broadcast), as
/// PyTorch's distance backward kernels define it (0 where the distance is 0).
fn dist_grad(b: &mut Builder, diff: Value, g: Value, dist: Value, p: f64) -> Value {
    let zero = b.splat(diff, 0.0);
    let sign = b.unary("stablehlo.sign", diff);
    let ad = b.abs(diff);
    let dist0 = b.compare(dist, zero, CmpDir::Eq);
    if p == 0.0 {
        zero
    } else if p == 1.0 {
        b.mul(g, sign)
    } else if p < 2.0 {
        let t = pow(b, ad, p - 1.0);
        let t = b.mul(sign, t);
        let t = b.mul(t, g);
        let dp = pow(b, dist, p - 1.0);
        let t = b.div(t, dp);
        let t = b.select(dist0, zero, t);
        if p < 1.0 {
            let d0 = b.compare(diff, zero, CmpDir::Eq);
            b.select(d0, zero, t)
        } else {
            t
        }
    } else if p == 2.0 {
        let t = b.mul(g, diff);
        let t = b.div(t, dist);
        b.select(dist0, zero, t)
    } else if p.is_infinite() {
        // 1 where |diff| is the distance, else 0.
        let t = b.sub(ad, dist);
        let t = b.abs(t);
        let t = b.unary("stablehlo.ceil", t);
        let one = b.splat(t, 1.0);
        let t = b.min(one, t);
        let t = b.sub(one, t);
        let gs = b.mul(g, sign);
        b.mul(gs, t)
    } else {
        let t = pow(b, ad, p - 2.0);
        let t = b.mul(diff, t);
        let t = b.mul(t, g);
        let dp = pow(b, dist, p - 1.0);
        let t = b.div(t, dp);
        b.select(dist0, zero, t)
    }
}

fn cdist_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = cdist_args(c)?;
    let p = c.args.float("p")?;
    let g = c.args.tensor("grad_output")?.clone();
    let dist = c.args.tensor("cdist")?.clone();
    let b = &mut *c.b;
    if a.r1 == 0 || a.r2 == 0 || a.m == 0 || numel(&a.batch) == 0 {
        return Ok(vec![Out::T(b.full(a.x1.dtype, &a.x1.shape, 0.0))]);
    }
    let nb = a.batch.len() as i64;
    let mut full = a.batch.clone();
    full.extend([a.r1, a.r2, a.m]);
    let mut s1 = a.batch.clone();
    s1.extend([a.r1, a.m]);
    let mut s2 = a.batch.clone();
    s2.extend([a.r2, a.m]);
    let mut s12 = a.batch.clone();
    s12.extend([a.r1, a.r2]);
    let bd: Vec<i64> = (0..nb).collect();
    let x = b.broadcast_to(a.x1.value, &s1);
    let y = b.broadcast_to(a.x2.value, &s2);
    let xd: Vec<i64> = bd.iter().copied().chain([nb, nb + 2]).collect();
    let yd: Vec<i64> = bd.iter().copied().chain([nb + 1, nb + 2]).collect();
    let pd: Vec<i64> = bd.iter().copied().chain([nb, nb + 1]).collect();
    let xb = b.broadcast_in_dim(x, &full, &xd);
    let yb = b.broadcast_in_dim(y, &full, &yd);
    let diff = b.sub(xb, yb);
    let gv = b.convert(g.value, a.x1.dtype);
    let gv = b.broadcast_to(gv, &s12);
    let gb = b.broadcast_in_dim(gv, &full, &pd);
    let dv = b.broadcast_to(dist.value, &s12);
    let db = b.broadcast_in_dim(dv, &full, &pd);
    let t = dist_grad(b, diff, gb, db, p);
    Ok(vec![Out::T(b.reduce(t, &[nb + 1], ReduceKind::Sum))])
}

/// Offsets of each row's pairs (i, j > i) in pdist's condensed order.
fn pdist_row_start(n: i64, i: i64) -> i64 {
    i * (2 * n - i - 1) / 2
}

fn pdist_forward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let p = c.args.float("p")?;
    if t.shape.len() != 2 {
        return user_err(
            ErrorKind::Runtime,
            format!("pdist only supports 2D tensors, got: {}D", t.shape.len()),
        );
    }
    if !t.dtype.is_float() {
        return user_err(
            ErrorKind::Runtime,
            "pdist only supports floating-point dtypes",
        );
    }
    if p < 0.0 {
        return user_err(
            ErrorKind::Runtime,
            "pdist only supports non-negative p values",
        );
    }
    if is_half(t.dtype) {
        return decline("pdist of half tensors");
    }
    let (n, m) = (t.shape[0], t.shape[1]);
    let k = if n <= 1 { 0 } else { n * (n - 1) / 2 };
    let b = &mut *c.b;
    if k == 0 || m == 0 {
        return Ok(vec![Out::T(b.full(t.dtype, &[k], 0.0))]);
    }
    let d = pair_dist(b, t.value, t.value, p);
    // The upper triangle, row by row.
    let rows: Vec<Value> = (0..n - 1)
        .map(|i| {
            let r = b.slice(d, &[i, i + 1], &[i + 1, n], &[1, 1]);
            b.reshape(r, &[n - 1 - i])
        })
        .collect();
    Ok(vec![Out::T(b.concatenate(&rows, 0))])
}

/// A condensed pdist vector [n(n-1)/2] as the symmetric [n, n] matrix (0 diagonal).
fn pdist_square(b: &mut Builder, v: Value, n: i64) -> Value {
    let z = b.constant(b.dtype(v), 0.0);
    let rows: Vec<Value> = (0..n)
        .map(|i| {
            let s = pdist_row_start(n, i);
            let r = b.slice(v, &[s], &[s + n - 1 - i], &[1]);
            let r = b.pad(r, z, &[i + 1], &[0], &[0]);
            b.reshape(r, &[1, n])
        })
        .collect();
    let up = b.concatenate(&rows, 0);
    let lo = b.transpose(up, &[1, 0]);
    b.add(up, lo)
}

fn pdist_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let p = c.args.float("p")?;
    let g = c.args.tensor("grad_output")?.clone();
    let dist = c.args.tensor("pdist")?.clone();
    if t.shape.len() != 2 {
        return decline("pdist backward of a non-matrix");
    }
    let (n, m) = (t.shape[0], t.shape[1]);
    let b = &mut *c.b;
    if n <= 1 || m == 0 || p == 0.0 {
        return Ok(vec![Out::T(b.full(t.dtype, &t.shape, 0.0))]);
    }
    let gv = b.convert(g.value, t.dtype);
    let gsq = pdist_square(b, gv, n);
    let dsq = pdist_square(b, dist.value, n);
    let full = [n, n, m];
    let xi = b.broadcast_in_dim(t.value, &full, &[0, 2]);
    let xj = b.broadcast_in_dim(t.value, &full, &[1, 2]);
    let diff = b.sub(xi, xj);
    let gb = b.broadcast_in_dim(gsq, &full, &[0, 1]);
    let db = b.broadcast_in_dim(dsq, &full, &[0, 1]);
    // Each pair's term is odd in the difference, so row i collects +f(x_i - x_j) for all j.
    let r = dist_grad(b, diff, gb, db, p);
    Ok(vec![Out::T(b.reduce(r, &[1], ReduceKind::Sum))])
}

pub const SERVES_SIZES: &[&str] = &["aten::linalg_vector_norm"];

pub const RULES: &[(&str, Rule)] = &[
    ("aten::linalg_vector_norm", vector_norm),
    ("aten::norm", vector_norm),
    ("aten::renorm", renorm),
    ("aten::_cdist_forward", cdist_forward),
    ("aten::_cdist_backward", cdist_backward),
    ("aten::_pdist_forward", pdist_forward),
    ("aten::_pdist_backward", pdist_backward),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Arg, Args, LowerError};

    use crate::args::param_arg as tensor;

    #[test]
    fn vector_norm_rejects_integers() {
        let mut b = Builder::new();
        let x = tensor(&mut b, DType::I64, &[3]);
        let args = Args {
            items: vec![("self".into(), x)],
        };
        let mut c = Ctx::new(&mut b, "aten::linalg_vector_norm", "", &args);
        match vector_norm(&mut c) {
            Err(LowerError::User(ErrorKind::NotImplemented, m)) => assert_eq!(
                m,
                "linalg.vector_norm: Expected a floating point or complex tensor as input. Got Long"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn cdist_backward_shape() {
        let mut b = Builder::new();
        let items = vec![
            ("grad_output", tensor(&mut b, DType::F32, &[3, 5])),
            ("x1", tensor(&mut b, DType::F32, &[3, 4])),
            ("x2", tensor(&mut b, DType::F32, &[5, 4])),
            ("p", Arg::Float(2.0)),
            ("cdist", tensor(&mut b, DType::F32, &[3, 5])),
        ];
        let args = Args {
            items: items.into_iter().map(|(n, a)| (n.to_string(), a)).collect(),
        };
        let mut c = Ctx::new(&mut b, "aten::_cdist_backward", "", &args);
        let outs = cdist_backward(&mut c).expect("lowers");
        let [Out::T(v)] = outs.as_slice() else {
            panic!("one tensor result")
        };
        assert_eq!(c.b.shape(*v), vec![3, 4]);
    }
}
