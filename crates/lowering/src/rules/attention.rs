//! Attention: scaled_dot_product_attention's fused entry for backends (the choice of it,
//! forward and backward), the CPU flash-attention entry points, forward and backward, and
//! nn.MultiheadAttention's inference fast path.

use super::nn_common::*;
use super::opmath;
use crate::promote::torch_name;
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
    scale: Scale,
    rep: i64,
}

/// The scores' scale: given (or 1/sqrt of a known head size), or 1/sqrt of the real head
/// size of a padded program.
#[derive(Clone, Copy)]
enum Scale {
    Given(f64),
    RealHeadSize,
}

/// `x * scale`.
fn scaled(b: &mut Builder, x: Value, a: &Sdpa) -> Value {
    let sc = match a.scale {
        Scale::Given(s) => b.splat(x, s),
        Scale::RealHeadSize => {
            let n = b.count(a.q.value, &[3], x);
            b.rsqrt(n)
        }
    };
    b.mul(x, sc)
}

/// Whether a mask of `m` dims broadcasts to the [B, H, L, S] scores.
fn mask_broadcasts(m: &[i64], scores: [i64; 4]) -> bool {
    m.len() <= 4
        && m.iter()
            .zip(&scores[4 - m.len()..])
            .all(|(d, s)| *d == 1 || d == s)
}

/// Whether batch, head and length counts of [B, H, L, E] operands fit attention (`rep`
/// query heads per key/value head), nothing empty.
/// A negative size is a symbolic one (torch.compile's dynamic shapes, see `sdpa_fused_ok`).
fn heads_fit(qs: &[i64], ks: &[i64], vs: &[i64]) -> bool {
    let grouped = if qs[1] < 0 || ks[1] < 0 {
        qs[1] == ks[1]
    } else {
        ks[1] != 0 && qs[1] % ks[1] == 0
    };
    ks[0] == qs[0]
        && vs[0] == qs[0]
        && ks[1] == vs[1]
        && ks[2] == vs[2]
        && grouped
        && [qs, ks].iter().all(|s| !s.contains(&0))
}

/// Whether `scaled_dot_product_attention` runs its fused entry
/// (`_scaled_dot_product_fused_attention_overrideable`, one op with its own backward) for
/// these operands, rather than its math decomposition (nine ops): float32 or half 4-d
/// operands of one dtype and head size, matching batch and head counts (grouped heads only
/// under `enable_gqa`), no dropout, and a mask that is boolean or of the query's dtype and
/// broadcasts to the scores. Anything else keeps PyTorch's math path and its errors. Under
/// torch.compile's dynamic shapes a symbolic size is a negative id, equal ids equal sizes.
pub fn sdpa_fused_ok(
    q: (DType, &[i64]),
    k: (DType, &[i64]),
    v: (DType, &[i64]),
    mask: Option<(DType, &[i64])>,
    dropout: f64,
    enable_gqa: bool,
) -> bool {
    let (dt, qs, ks, vs) = (q.0, q.1, k.1, v.1);
    if !matches!(dt, DType::F32 | DType::BF16 | DType::F16) || k.0 != dt || v.0 != dt {
        return false;
    }
    if [qs, ks, vs].iter().any(|s| s.len() != 4) || dropout != 0.0 {
        return false;
    }
    if ks[3] != qs[3] || vs[3] != qs[3] || !heads_fit(qs, ks, vs) {
        return false;
    }
    if ks[1] != qs[1] && !enable_gqa {
        return false;
    }
    match mask {
        None => true,
        Some((mdt, ms)) => {
            (mdt == DType::Bool || mdt == dt) && mask_broadcasts(ms, [qs[0], qs[1], qs[2], ks[2]])
        }
    }
}

/// The attention arguments, the mask under `mask_name`; `fused` is the backends' entry,
/// whose mask may have any rank that broadcasts (the CPU flash kernel takes 2 or 4).
fn sdpa_args(c: &Ctx, mask_name: &str, fused: bool) -> LResult<Sdpa> {
    let q = tensor(c, "query")?;
    let k = tensor(c, "key")?;
    let v = tensor(c, "value")?;
    let mask = c.args.opt_tensor(mask_name).cloned();
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
        if !fused && m.shape.len() != 2 && m.shape.len() != 4 {
            return err("Attention mask dim in {2, 4}".into());
        }
        let full = [q.shape[0], q.shape[1], q.shape[2], k.shape[2]];
        if !mask_broadcasts(&m.shape, full) {
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
    if !heads_fit(qs, ks, vs) {
        // The CPU kernel reads out of bounds for mismatched batch or head counts.
        return decline("attention: batch, head or length mismatch, or empty input");
    }
    let scale = match c.args.opt_float("scale") {
        Some(s) => Scale::Given(s),
        // A padded head size (shape buckets) is not the real one.
        None if c.b.is_dynamic(q.value, 3) => Scale::RealHeadSize,
        None => Scale::Given(1.0 / (qs[3] as f64).sqrt()),
    };
    if qs[1] != ks[1] && (c.b.is_dynamic(q.value, 1) || c.b.is_dynamic(k.value, 1)) {
        // Grouped heads regroup the head dims: padded, the groups would be the bucket's.
        return decline("attention: grouped heads padded");
    }
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
    let mut s = scaled(b, s, a);
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

/// `exp(s - max)` over the last dim of [B, H, L, S] scores, the row max (0 for a row that
/// is all -inf, so it gives zeros, not NaN) and which rows are all -inf.
fn shifted_exp(b: &mut Builder, s: Value) -> (Value, Value, Value) {
    let shape = b.shape(s);
    let m = b.reduce(s, &[3], ReduceKind::Max);
    let ninf = b.splat(m, f64::NEG_INFINITY);
    let empty = b.compare(m, ninf, CmpDir::Eq);
    let z = b.splat(m, 0.0);
    let m = b.select(empty, z, m);
    let mb = b.broadcast_in_dim(m, &shape, &[0, 1, 2]);
    let d = b.sub(s, mb);
    (b.exp(d), m, empty)
}

/// Attention's output and logsumexp (opmath). Rows masked out entirely give zeros and a
/// logsumexp of 0, as the CPU kernel returns.
fn sdpa_forward(b: &mut Builder, a: &Sdpa) -> (Value, Value) {
    let dt = a.q.dtype;
    let (s, _, _, v) = sdpa_scores(b, a);
    let (p, m, empty) = shifted_exp(b, s);
    let z = b.splat(m, 0.0);
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
    (o, b.select(empty, z, lse))
}

/// `_scaled_dot_product_flash_attention_for_cpu`: (output, logsumexp).
fn sdpa_flash(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = sdpa_args(c, "attn_mask", false)?;
    let b = &mut *c.b;
    let (o, lse) = sdpa_forward(b, &a);
    Ok(vec![Out::T(b.convert(o, a.q.dtype)), Out::T(lse)])
}

/// A 0-d int64 zero: the fused entry's random-state outputs (no dropout).
fn no_philox(b: &mut Builder) -> Out {
    Out::T(b.constant(DType::I64, 0.0))
}

/// `_scaled_dot_product_fused_attention_overrideable`: (output, logsumexp (float32),
/// cum_seq_q, cum_seq_k (undefined: no nested tensors), max_q, max_k, philox seed and
/// offset (zeros: no dropout), debug mask (undefined)), as PyTorch's meta function says.
fn sdpa_fused(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = sdpa_args(c, "attn_bias", true)?;
    if c.args.bool_or("return_debug_mask", false) {
        return decline("attention: debug mask");
    }
    let b = &mut *c.b;
    let (o, lse) = sdpa_forward(b, &a);
    let (lq, lk) = (a.q.shape[2], a.k.shape[2]);
    Ok(vec![
        Out::T(b.convert(o, a.q.dtype)),
        Out::T(b.convert(lse, DType::F32)),
        Out::None,
        Out::None,
        Out::Int(lq),
        Out::Int(lk),
        no_philox(b),
        no_philox(b),
        Out::None,
    ])
}

/// Attention's gradients (query, key, value, and the score gradient before scaling, which
/// is the additive mask's) from the probabilities rebuilt with the saved logsumexp.
fn sdpa_grads(c: &mut Ctx, a: &Sdpa) -> LResult<[Value; 4]> {
    let go = tensor(c, "grad_out")?;
    let out = tensor(c, "out")?;
    let lse = tensor(c, "logsumexp")?;
    let b = &mut *c.b;
    let dt = a.q.dtype;
    let cd = opmath(dt);
    let (s, q, k, v) = sdpa_scores(b, a);
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
    let dq = scaled(b, dq, a);
    let dk = scaled(b, dk, a);
    let dk = sdpa_unheads(b, dk, a.rep);
    let dv = sdpa_unheads(b, dv, a.rep);
    Ok([dq, dk, dv, ds])
}

/// `_scaled_dot_product_flash_attention_for_cpu_backward`: (grad_query, grad_key,
/// grad_value).
fn sdpa_flash_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = sdpa_args(c, "attn_mask", false)?;
    let [dq, dk, dv, _] = sdpa_grads(c, &a)?;
    let (b, dt) = (&mut *c.b, a.q.dtype);
    Ok([dq, dk, dv]
        .map(|g| Out::T(b.convert(g, dt)))
        .into_iter()
        .collect())
}

/// `_scaled_dot_product_fused_attention_overrideable_backward`: (grad_query, grad_key,
/// grad_value, grad_attn_bias); the bias's gradient is the score gradient summed over the
/// dims the bias broadcast along, when `grad_input_mask` asks for it.
fn sdpa_fused_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let a = sdpa_args(c, "attn_bias", true)?;
    let want = c.args.bools("grad_input_mask")?;
    let [dq, dk, dv, ds] = sdpa_grads(c, &a)?;
    let (b, dt) = (&mut *c.b, a.q.dtype);
    let mut outs: Vec<Out> = [dq, dk, dv]
        .into_iter()
        .zip(&want)
        .map(|(g, w)| {
            if *w {
                Out::T(b.convert(g, dt))
            } else {
                Out::None
            }
        })
        .collect();
    outs.push(match &a.mask {
        Some(m) if want.get(3) == Some(&true) => {
            let off = 4 - m.shape.len();
            let dims: Vec<i64> = (0..4)
                .filter(|d| *d < off || m.shape[d - off] == 1)
                .map(|d| d as i64)
                .collect();
            let g = b.reduce(ds, &dims, ReduceKind::Sum);
            let g = b.reshape(g, &m.shape);
            Out::T(b.convert(g, m.dtype))
        }
        _ => Out::None,
    });
    Ok(outs)
}

/// `x @ w[rows]^T + bias[rows]`: one of the packed projections of `[3E, E]` / `[3E]`.
fn packed_linear(b: &mut Builder, x: Value, w: Value, bias: Value, rows: (i64, i64)) -> Value {
    let xs = b.shape(x);
    let w = b.slice_dim(w, 0, rows.0, rows.1, 1);
    let y = b.dot_general(x, w, (&[], &[]), (&[2], &[1]), b.dtype(x));
    let bias = b.slice_dim(bias, 0, rows.0, rows.1, 1);
    let bias = b.broadcast_in_dim(bias, &[xs[0], xs[1], rows.1 - rows.0], &[2]);
    b.add(y, bias)
}

/// `_native_multi_head_attention`: nn.MultiheadAttention's inference fast path, which
/// PyTorch takes on tpu as on CUDA. Packed input projection, scores scaled by
/// 1/sqrt(head dim), the merged mask (boolean, True masked out, a fully masked row giving
/// zeros; or additive float; mask_type 1 is a [B, S] key padding mask, else it broadcasts to
/// [B, H, L, S]), output projection, and the attention weights (averaged over heads) when
/// asked.
fn native_mha(c: &mut Ctx) -> LResult<Vec<Out>> {
    const OP: &str = "_native_multi_head_attention";
    let q = tensor(c, "query")?;
    let k = tensor(c, "key")?;
    let v = tensor(c, "value")?;
    let e = c.args.int("embed_dim")?;
    let h = c.args.int("num_head")?;
    let [w, wb, pw, pb] =
        ["qkv_weight", "qkv_bias", "proj_weight", "proj_bias"].map(|n| c.args.tensor(n).cloned());
    let (w, wb, pw, pb) = (w?, wb?, pw?, pb?);
    let mask = c.args.opt_tensor("mask").cloned();
    let need_weights = c.args.bool_or("need_weights", true);
    let average = c.args.bool_or("average_attn_weights", true);
    let mask_type = c.args.opt_int("mask_type");
    for (name, t) in [("query", &q), ("key", &k), ("value", &v)] {
        if t.shape.len() != 3 {
            return user_err(
                ErrorKind::Runtime,
                format!("expected 3-D `{name}`, got {}-D tensor", t.shape.len()),
            );
        }
    }
    if q.shape[2] != e {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "passed-in embed_dim {e} didn't match last dim of query {}",
                q.shape[2]
            ),
        );
    }
    let (bsz, l, s) = (q.shape[0], q.shape[1], k.shape[1]);
    if !q.dtype.is_float()
        || h <= 0
        || e % h != 0
        || k.shape != [bsz, s, e]
        || v.shape != k.shape
        || l != s
        || w.shape != [3 * e, e]
        || wb.shape != [3 * e]
        || pw.shape != [e, e]
        || pb.shape != [e]
        || [&k, &v, &w, &wb, &pw, &pb]
            .iter()
            .any(|t| t.dtype != q.dtype)
    {
        return decline(format!(
            "{OP}: shapes or dtypes the CPU kernel would refuse"
        ));
    }
    let full = [bsz, h, l, s];
    let mask_dims: Option<Vec<i64>> = match (&mask, mask_type) {
        (None, _) => None,
        (Some(m), Some(1)) if m.shape == [bsz, s] => Some(vec![0, 3]),
        (Some(m), _) if m.shape.len() <= 4 => {
            let off = 4 - m.shape.len();
            let fits = m
                .shape
                .iter()
                .enumerate()
                .all(|(i, d)| *d == 1 || *d == full[off + i]);
            if !fits {
                return decline(format!("{OP}: a mask that does not broadcast"));
            }
            Some((off as i64..4).collect())
        }
        _ => return decline(format!("{OP}: mask of rank > 4")),
    };
    let dt = q.dtype;
    let cd = opmath(dt);
    let d = e / h;
    let b = &mut *c.b;
    let [qv, kv, vv, w, wb, pw, pb] = [
        q.value, k.value, v.value, w.value, wb.value, pw.value, pb.value,
    ]
    .map(|x| b.convert(x, cd));
    let heads = |b: &mut Builder, x: Value| {
        let x = b.reshape(x, &[bsz, l, h, d]);
        b.transpose(x, &[0, 2, 1, 3])
    };
    let qp = packed_linear(b, qv, w, wb, (0, e));
    let kp = packed_linear(b, kv, w, wb, (e, 2 * e));
    let vp = packed_linear(b, vv, w, wb, (2 * e, 3 * e));
    let qh = heads(b, qp);
    let sc = b.splat(qh, 1.0 / (d as f64).sqrt());
    let qh = b.mul(qh, sc);
    let kh = heads(b, kp);
    let vh = heads(b, vp);
    let scores = b.dot_general(qh, kh, (&[0, 1], &[0, 1]), (&[3], &[3]), cd);
    let (scores, masked) = match (&mask, &mask_dims) {
        (Some(m), Some(dims)) => {
            let shape: Vec<i64> = dims.iter().map(|d| full[*d as usize]).collect();
            let mv = b.reshape(m.value, &shape);
            let mv = b.broadcast_in_dim(mv, &full, dims);
            if m.dtype == DType::Bool {
                let ninf = b.splat(scores, f64::NEG_INFINITY);
                (b.select(mv, ninf, scores), Some(mv))
            } else {
                // nn.MultiheadAttention merges its masks into an additive float mask; a
                // row it masks entirely is NaN (0 / 0), as on the CPU.
                let mv = b.convert(mv, cd);
                (b.add(scores, mv), None)
            }
        }
        _ => (scores, None),
    };
    let (ex, _, _) = shifted_exp(b, scores);
    let sum = b.reduce(ex, &[3], ReduceKind::Sum);
    let sumb = b.broadcast_in_dim(sum, &full, &[0, 1, 2]);
    let mut p = b.div(ex, sumb);
    if let Some(mv) = masked {
        // A fully masked row: 0 / 0 above; the CPU's masked softmax gives zeros.
        let zp = b.splat(p, 0.0);
        p = b.select(mv, zp, p);
    }
    let ctx = b.dot_general(p, vh, (&[0, 1], &[0, 1]), (&[3], &[2]), cd);
    let ctx = b.transpose(ctx, &[0, 2, 1, 3]);
    let ctx = b.reshape(ctx, &[bsz, l, e]);
    let proj = packed_linear(b, ctx, pw, pb, (0, e));
    let weights = if !need_weights {
        Out::None
    } else if average {
        let sum = b.reduce(p, &[1], ReduceKind::Sum);
        let nh = b.splat(sum, h as f64);
        let avg = b.div(sum, nh);
        Out::T(b.convert(avg, dt))
    } else {
        Out::T(b.convert(p, dt))
    };
    Ok(vec![Out::T(b.convert(proj, dt)), weights])
}

pub const RULES: &[(&str, Rule)] = &[
    ("aten::_native_multi_head_attention", native_mha),
    (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        sdpa_flash,
    ),
    (
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        sdpa_flash_backward,
    ),
    (
        "aten::_scaled_dot_product_fused_attention_overrideable",
        sdpa_fused,
    ),
    (
        "aten::_scaled_dot_product_fused_attention_overrideable_backward",
        sdpa_fused_backward,
    ),
];

/// Arguments the rules never read, left out of program keys: the fused backward's max
/// lengths are sizes (a new one per length would be a new program) it takes from its
/// tensors instead.
pub const UNREAD_ARGS: &[(&str, &[&str])] = &[(
    "aten::_scaled_dot_product_fused_attention_overrideable_backward",
    &["max_q", "max_k"],
)];

/// The ops of this family whose programs may serve a range of sizes (see
/// `super::serves_sizes`): the scores' reductions and contractions are masked by XLA's
/// padder, the default scale takes the real head size, grouped heads decline when padded.
pub const SERVES_SIZES: &[&str] = &[
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "aten::_scaled_dot_product_fused_attention_overrideable_backward",
];
