//! Attention: the CPU flash-attention entry points of scaled_dot_product_attention,
//! forward and backward.

use super::nn_common::*;
use super::opmath;
use crate::promote::torch_name;
use crate::shape::numel;
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};
use stablehlo::{CmpDir, ReduceKind};

const SDPA: &str = "scaled_dot_product_attention_flash_attention";

/// Attention arguments: [B, H, L, E] query, [B, H / rep, S, E] key and value.
struct Sdpa {
    q: TensorArg,
    k: TensorArg,
    v: TensorArg,
    mask: Option<TensorArg>,
    causal: bool,
    scale: f64,
    rep: i64,
}

fn sdpa_args(c: &Ctx) -> LResult<Sdpa> {
    let q = tensor(c, "query")?;
    let k = tensor(c, "key")?;
    let v = tensor(c, "value")?;
    let mask = c.args.opt_tensor("attn_mask").cloned();
    let err = |m: String| user_err(ErrorKind::Runtime, format!("{SDPA}: {m}"));
    if !q.dtype.is_float() {
        return err(format!(
            "Expected data type in FP32, FP64, BF16, FP16, but got {} instead.",
            torch_name(q.dtype)
        ));
    }
    if [&q, &k, &v].iter().any(|t| t.shape.len() != 4) {
        return err("Accept only 4 dims inputs shape of {B, H, T, K}".into());
    }
    if c.args.float("dropout_p").unwrap_or(0.0) > 0.0 {
        return err("Currently do not support dropout > 0".into());
    }
    if k.shape[3] != q.shape[3] || v.shape[3] != q.shape[3] {
        return err("Q/K/V should have the same head size".into());
    }
    if let Some(m) = &mask {
        if m.dtype != q.dtype {
            return err("Attention mask is the same data type as query".into());
        }
        if m.shape.len() != 2 && m.shape.len() != 4 {
            return err("Attention mask dim in {2, 4}".into());
        }
        let full = [q.shape[0], q.shape[1], q.shape[2], k.shape[2]];
        let off = 4 - m.shape.len();
        if m.shape
            .iter()
            .enumerate()
            .any(|(i, d)| *d != 1 && *d != full[off + i])
        {
            return decline("attention mask does not broadcast");
        }
    }
    for t in [&k, &v] {
        if t.dtype != q.dtype {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "expected scalar type {} but found {}",
                    torch_name(q.dtype),
                    torch_name(t.dtype)
                ),
            );
        }
    }
    let (qs, ks, vs) = (&q.shape, &k.shape, &v.shape);
    if ks[0] != qs[0]
        || vs[0] != qs[0]
        || ks[1] != vs[1]
        || ks[2] != vs[2]
        || ks[1] == 0
        || qs[1] % ks[1] != 0
        || [qs, ks].iter().any(|s| numel(s) == 0)
    {
        // The CPU kernel reads out of bounds for mismatched batch or head counts.
        return decline("attention: batch, head or length mismatch, or empty input");
    }
    let scale = c
        .args
        .opt_float("scale")
        .unwrap_or(1.0 / (qs[3] as f64).sqrt());
    Ok(Sdpa {
        rep: qs[1] / ks[1],
        causal: c.args.bool_or("is_causal", false),
        q,
        k,
        v,
        mask,
        scale,
    })
}

/// Key/value heads repeated for the query heads they serve (h -> h / rep).
fn sdpa_heads(b: &mut Builder, x: Value, rep: i64) -> Value {
    if rep == 1 {
        return x;
    }
    let s = b.shape(x);
    let big = [s[0], s[1], rep, s[2], s[3]];
    let x = b.broadcast_in_dim(x, &big, &[0, 1, 3, 4]);
    b.reshape(x, &[s[0], s[1] * rep, s[2], s[3]])
}

/// Gradients of repeated heads summed back onto their key/value head.
fn sdpa_unheads(b: &mut Builder, g: Value, rep: i64) -> Value {
    if rep == 1 {
        return g;
    }
    let s = b.shape(g);
    let g = b.reshape(g, &[s[0], s[1] / rep, rep, s[2], s[3]]);
    b.reduce(g, &[2], ReduceKind::Sum)
}

/// Rounds to the input dtype and back, where the CPU kernel feeds a half-precision gemm.
fn sdpa_round(b: &mut Builder, x: Value, dt: DType) -> Value {
    if opmath(dt) == dt {
        return x;
    }
    let r = b.convert(x, dt);
    b.convert(r, opmath(dt))
}

/// (scaled, masked scores [B, H, L, S], query, expanded key, expanded value), in opmath.
fn sdpa_scores(b: &mut Builder, a: &Sdpa) -> (Value, Value, Value, Value) {
    let cd = opmath(a.q.dtype);
    let q = b.convert(a.q.value, cd);
    let k = b.convert(a.k.value, cd);
    let v = b.convert(a.v.value, cd);
    let k = sdpa_heads(b, k, a.rep);
    let v = sdpa_heads(b, v, a.rep);
    let s = b.dot_general(q, k, (&[0, 1], &[0, 1]), (&[3], &[3]), cd);
    let sc = b.splat(s, a.scale);
    let mut s = b.mul(s, sc);
    let shape = b.shape(s);
    if let Some(m) = &a.mask {
        let mv = b.convert(m.value, cd);
        let mv = b.broadcast_to(mv, &shape);
        s = b.add(s, mv);
    }
    if a.causal {
        let i = b.iota(DType::I64, &shape, 2);
        let j = b.iota(DType::I64, &shape, 3);
        let keep = b.compare(i, j, CmpDir::Ge);
        let ninf = b.splat(s, f64::NEG_INFINITY);
        s = b.select(keep, s, ninf);
    }
    (s, q, k, v)
}

/// `_scaled_dot_product_flash_attention_for_cpu`: (output, logsumexp). Rows masked out
/// entirely give zeros and a logsumexp of 0, as the CPU kernel returns.
fn sdpa_flash(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = sdpa_args(c)?;
    let b = &mut *c.b;
    let dt = a.q.dtype;
    let (s, _, _, v) = sdpa_scores(b, &a);
    let shape = b.shape(s);
    let m = b.reduce(s, &[3], ReduceKind::Max);
    let ninf = b.splat(m, f64::NEG_INFINITY);
    let empty = b.compare(m, ninf, CmpDir::Eq);
    let z = b.splat(m, 0.0);
    let m = b.select(empty, z, m);
    let mb = b.broadcast_in_dim(m, &shape, &[0, 1, 2]);
    let d = b.sub(s, mb);
    let p = b.exp(d);
    let l = b.reduce(p, &[3], ReduceKind::Sum);
    let pr = sdpa_round(b, p, dt);
    let o = b.dot_general(pr, v, (&[0, 1], &[0, 1]), (&[3], &[2]), opmath(dt));
    let oshape = b.shape(o);
    let one = b.splat(l, 1.0);
    let lsafe = b.select(empty, one, l);
    let lb = b.broadcast_in_dim(lsafe, &oshape, &[0, 1, 2]);
    let o = b.div(o, lb);
    let eb = b.broadcast_in_dim(empty, &oshape, &[0, 1, 2]);
    let zo = b.splat(o, 0.0);
    let o = b.select(eb, zo, o);
    let ll = b.log(lsafe);
    let lse = b.add(m, ll);
    let lse = b.select(empty, z, lse);
    Ok(vec![Out::T(b.convert(o, dt)), Out::T(lse)])
}

/// `_scaled_dot_product_flash_attention_for_cpu_backward`: (grad_query, grad_key,
/// grad_value) from the probabilities rebuilt with the saved logsumexp.
fn sdpa_flash_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = sdpa_args(c)?;
    let go = tensor(c, "grad_out")?;
    let out = tensor(c, "out")?;
    let lse = tensor(c, "logsumexp")?;
    let b = &mut *c.b;
    let dt = a.q.dtype;
    let cd = opmath(dt);
    let (s, q, k, v) = sdpa_scores(b, &a);
    let shape = b.shape(s);
    let (bq, hq, lq) = (shape[0], shape[1], shape[2]);
    if go.shape != a.q.shape || out.shape != a.q.shape || lse.shape != [bq, hq, lq] {
        return decline("attention backward: grad_out, out or logsumexp shape");
    }
    let lv = b.convert(lse.value, cd);
    let lb = b.broadcast_in_dim(lv, &shape, &[0, 1, 2]);
    let d = b.sub(s, lb);
    let p = b.exp(d);
    let pr = sdpa_round(b, p, dt);
    let g = b.convert(go.value, cd);
    let o = b.convert(out.value, cd);
    let dv = b.dot_general(pr, g, (&[0, 1], &[0, 1]), (&[2], &[2]), cd);
    let dp = b.dot_general(g, v, (&[0, 1], &[0, 1]), (&[3], &[3]), cd);
    let go_o = b.mul(g, o);
    let dsum = b.reduce(go_o, &[3], ReduceKind::Sum);
    let db = b.broadcast_in_dim(dsum, &shape, &[0, 1, 2]);
    let ds = b.sub(dp, db);
    let ds = b.mul(p, ds);
    let dsr = sdpa_round(b, ds, dt);
    let dq = b.dot_general(dsr, k, (&[0, 1], &[0, 1]), (&[3], &[2]), cd);
    let dk = b.dot_general(dsr, q, (&[0, 1], &[0, 1]), (&[2], &[2]), cd);
    let sc = b.splat(dq, a.scale);
    let dq = b.mul(dq, sc);
    let sk = b.splat(dk, a.scale);
    let dk = b.mul(dk, sk);
    let dk = sdpa_unheads(b, dk, a.rep);
    let dv = sdpa_unheads(b, dv, a.rep);
    Ok(vec![
        Out::T(b.convert(dq, dt)),
        Out::T(b.convert(dk, dt)),
        Out::T(b.convert(dv, dt)),
    ])
}

pub const RULES: &[(&str, Rule)] = &[
    (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        sdpa_flash,
    ),
    (
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        sdpa_flash_backward,
    ),
];
