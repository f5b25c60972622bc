//! Matrix products.

use crate::shape::shape_str;
use crate::{user_err, Builder, Ctx, ErrorKind, LResult, Out, Rule, Value};

use super::{common, mat, Opnd};

/// `beta * self + alpha * prod`, skipping the terms PyTorch skips (beta == 0 ignores self,
/// even NaN in it).
fn axpby(c: &mut Ctx, prod: Value) -> LResult<Value> {
    let beta = c.args.opt_scalar("beta").map(|s| s.as_f64()).unwrap_or(1.0);
    let alpha = c
        .args
        .opt_scalar("alpha")
        .map(|s| s.as_f64())
        .unwrap_or(1.0);
    let b = &mut *c.b;
    let shape = b.shape(prod);
    let dt = b.dtype(prod);
    let p = if alpha != 1.0 {
        let k = b.splat(prod, alpha);
        b.mul(prod, k)
    } else {
        prod
    };
    if beta == 0.0 {
        return Ok(p);
    }
    let s = c.args.tensor("self")?.clone();
    let sv = mat(b, &Opnd::T(s), dt, &shape);
    let sv = if beta != 1.0 {
        let k = b.splat(sv, beta);
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
    let (x, y, _) = pair(c, mats.0, mats.1)?;
    check_mm(&c.b.shape(x), &c.b.shape(y))?;
    let p = mm_values(c.b, x, y);
    let r = if c.args.has("self") && mats.0 != "self" {
        axpby(c, p)?
    } else {
        p
    };
    Ok(vec![Out::T(r)])
}

fn bmm(c: &mut Ctx, mats: (&str, &str)) -> LResult<Vec<Out>> {
    let (x, y, _) = pair(c, mats.0, mats.1)?;
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
    let p = bmm_values(c.b, x, y);
    let r = if c.args.has("self") && mats.0 != "self" {
        axpby(c, p)?
    } else {
        p
    };
    Ok(vec![Out::T(r)])
}

fn dot(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (x, y, dt) = pair(c, "self", "tensor")?;
    let (sx, sy) = (c.b.shape(x), c.b.shape(y));
    if sx.len() != 1 || sy.len() != 1 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "1D tensors expected, but got {}D and {}D tensors",
                sx.len(),
                sy.len()
            ),
        );
    }
    if sx != sy {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "inconsistent tensor size, expected tensor [{}] and src [{}] to have the same number of elements, but got {} and {} elements respectively",
                sx[0], sy[0], sx[0], sy[0]
            ),
        );
    }
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

pub const RULES: &[(&str, Rule)] = &[
    ("aten::mm", |c| mm(c, ("self", "mat2"))),
    ("aten::addmm", |c| mm(c, ("mat1", "mat2"))),
    ("aten::bmm", |c| bmm(c, ("self", "mat2"))),
    ("aten::baddbmm", |c| bmm(c, ("batch1", "batch2"))),
    ("aten::dot", dot),
    ("aten::mv", mv),
    ("aten::addmv", mv),
    ("aten::outer", outer),
];
