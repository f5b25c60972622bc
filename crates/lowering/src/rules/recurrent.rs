//! The fused recurrent cells PyTorch calls on accelerators (`nn.LSTM`, `nn.GRU`,
//! `nn.LSTMCell`, `nn.GRUCell` on a non-CPU device) and their backward ops. The forward
//! saves the activated gates in a workspace for the backward; both are ours, so its layout
//! is ours too. Reduced-precision floats compute in f32 and round once.

use super::{opmath, sigmoid, sigmoid_grad as dsigmoid, tanh_grad as dtanh};
use crate::{user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value};
use stablehlo::ReduceKind;

/// A [B, k*H] value as its k chunks of [B, H].
fn chunks(b: &mut Builder, v: Value, k: i64) -> Vec<Value> {
    let h = b.shape(v)[1] / k;
    (0..k)
        .map(|i| b.slice_dim(v, 1, i * h, (i + 1) * h, 1))
        .collect()
}

/// The checked gate inputs in opmath: (input_gates + input_bias, hidden_gates + hidden_bias,
/// the state), kept apart because GRU's candidate gate uses them apart; and the input dtype.
fn gate_inputs(
    c: &mut Ctx,
    op: &str,
    state: &str,
    k: i64,
) -> LResult<(Value, Value, Value, DType)> {
    let ig = c.args.tensor("input_gates")?.clone();
    let hg = c.args.tensor("hidden_gates")?.clone();
    let hx = c.args.tensor(state)?.clone();
    let bad = |t: &TensorArg, want: &[i64]| t.shape != want;
    if ig.shape.len() != 2 || ig.shape[1] % k != 0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{op}(): input_gates must be 2-D with a multiple of {k} columns, got {:?}",
                ig.shape
            ),
        );
    }
    let (batch, h) = (ig.shape[0], ig.shape[1] / k);
    if bad(&hg, &ig.shape) || bad(&hx, &[batch, h]) {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{op}(): expected hidden_gates {:?} and {state} [{batch}, {h}], got {:?} and {:?}",
                ig.shape, hg.shape, hx.shape
            ),
        );
    }
    for t in [&hg, &hx] {
        if t.dtype != ig.dtype {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "{op}(): expected all tensors of one dtype, got {:?} and {:?}",
                    ig.dtype, t.dtype
                ),
            );
        }
    }
    let biases = [
        c.args.opt_tensor("input_bias").cloned(),
        c.args.opt_tensor("hidden_bias").cloned(),
    ];
    let cd = opmath(ig.dtype);
    let b = &mut *c.b;
    let mut gates = [b.convert(ig.value, cd), b.convert(hg.value, cd)];
    for (g, bias) in gates.iter_mut().zip(biases) {
        if let Some(bias) = bias {
            if bias.shape != [k * h] {
                return user_err(
                    ErrorKind::Runtime,
                    format!(
                        "{op}(): expected a bias of [{}], got {:?}",
                        k * h,
                        bias.shape
                    ),
                );
            }
            let v = b.convert(bias.value, cd);
            let v = b.broadcast_in_dim(v, &[batch, k * h], &[1]);
            *g = b.add(*g, v);
        }
    }
    let state = b.convert(hx.value, cd);
    Ok((gates[0], gates[1], state, ig.dtype))
}

fn lstm_cell(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (ig, hg, cx, dt) = gate_inputs(c, "_thnn_fused_lstm_cell", "cx", 4)?;
    let b = &mut *c.b;
    let g = b.add(ig, hg);
    let g = chunks(b, g, 4);
    let (i, f, cand, o) = (
        sigmoid(b, g[0]),
        sigmoid(b, g[1]),
        b.tanh(g[2]),
        sigmoid(b, g[3]),
    );
    let keep = b.mul(f, cx);
    let new = b.mul(i, cand);
    let cy = b.add(keep, new);
    let t = b.tanh(cy);
    let hy = b.mul(o, t);
    let ws = b.concatenate(&[i, f, cand, o], 1);
    Ok([hy, cy, ws].map(|v| Out::T(b.convert(v, dt))).into())
}

/// (grad_gates, grad_cx, grad_bias) from the gradients of hy and cy (either may be absent).
fn lstm_cell_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let cx = c.args.tensor("cx")?.clone();
    let cy = c.args.tensor("cy")?.clone();
    let ws = c.args.tensor("workspace")?.clone();
    let grads = [
        c.args.opt_tensor("grad_hy").cloned(),
        c.args.opt_tensor("grad_cy").cloned(),
    ];
    let has_bias = c.args.bool_or("has_bias", false);
    let dt = cx.dtype;
    let cd = opmath(dt);
    let b = &mut *c.b;
    let [cx, cy, ws] = [cx.value, cy.value, ws.value].map(|v| b.convert(v, cd));
    let [ghy, gcy] = grads.map(|g| match g {
        Some(g) => b.convert(g.value, cd),
        None => b.splat(cx, 0.0),
    });
    let g = chunks(b, ws, 4);
    let (i, f, cand, o) = (g[0], g[1], g[2], g[3]);
    let t = b.tanh(cy);
    let g_o = b.mul(ghy, t);
    // dL/dcy through hy = o * tanh(cy), plus the direct gradient.
    let dt_cy = dtanh(b, t);
    let through = b.mul(ghy, o);
    let through = b.mul(through, dt_cy);
    let gc = b.add(gcy, through);
    let g_i = b.mul(gc, cand);
    let g_f = b.mul(gc, cx);
    let g_cand = b.mul(gc, i);
    let grad_cx = b.mul(gc, f);
    let pre = [
        (g_i, dsigmoid(b, i)),
        (g_f, dsigmoid(b, f)),
        (g_cand, dtanh(b, cand)),
        (g_o, dsigmoid(b, o)),
    ];
    let pre: Vec<Value> = pre.into_iter().map(|(g, d)| b.mul(g, d)).collect();
    let grad_gates = b.concatenate(&pre, 1);
    let grad_bias = has_bias.then(|| b.reduce(grad_gates, &[0], ReduceKind::Sum));
    let mut outs = vec![
        Out::T(b.convert(grad_gates, dt)),
        Out::T(b.convert(grad_cx, dt)),
    ];
    outs.push(grad_bias.map_or(Out::None, |v| Out::T(b.convert(v, dt))));
    Ok(outs)
}

fn gru_cell(c: &mut Ctx) -> LResult<Vec<Out>> {
    let (ig, hg, hx, dt) = gate_inputs(c, "_thnn_fused_gru_cell", "hx", 3)?;
    let b = &mut *c.b;
    let (gi, gh) = (chunks(b, ig, 3), chunks(b, hg, 3));
    let r = b.add(gi[0], gh[0]);
    let r = sigmoid(b, r);
    let z = b.add(gi[1], gh[1]);
    let z = sigmoid(b, z);
    let rn = b.mul(r, gh[2]);
    let n = b.add(gi[2], rn);
    let n = b.tanh(n);
    // hy = n + z * (hx - n)
    let d = b.sub(hx, n);
    let zd = b.mul(z, d);
    let hy = b.add(n, zd);
    let ws = b.concatenate(&[r, z, n, hx, gh[2]], 1);
    Ok([hy, ws].map(|v| Out::T(b.convert(v, dt))).into())
}

/// (grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias).
fn gru_cell_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let ghy = c.args.tensor("grad_hy")?.clone();
    let ws = c.args.tensor("workspace")?.clone();
    let has_bias = c.args.bool_or("has_bias", false);
    let dt = ghy.dtype;
    let cd = opmath(dt);
    let b = &mut *c.b;
    let [gh, ws] = [ghy.value, ws.value].map(|v| b.convert(v, cd));
    let w = chunks(b, ws, 5);
    let (r, z, n, hx, hn) = (w[0], w[1], w[2], w[3], w[4]);
    let grad_hx = b.mul(gh, z);
    let d = b.sub(hx, n);
    let g_z = b.mul(gh, d);
    let one = b.splat(z, 1.0);
    let omz = b.sub(one, z);
    let g_n = b.mul(gh, omz);
    let dn = dtanh(b, n);
    let d_n = b.mul(g_n, dn);
    let dz = dsigmoid(b, z);
    let d_z = b.mul(g_z, dz);
    let g_r = b.mul(d_n, hn);
    let dr = dsigmoid(b, r);
    let d_r = b.mul(g_r, dr);
    let d_hn = b.mul(d_n, r);
    let gi = b.concatenate(&[d_r, d_z, d_n], 1);
    let gh = b.concatenate(&[d_r, d_z, d_hn], 1);
    let mut outs: Vec<Out> = [gi, gh, grad_hx].map(|v| Out::T(b.convert(v, dt))).into();
    for g in [gi, gh] {
        outs.push(if has_bias {
            let s = b.reduce(g, &[0], ReduceKind::Sum);
            Out::T(b.convert(s, dt))
        } else {
            Out::None
        });
    }
    Ok(outs)
}

pub const RULES: &[(&str, Rule)] = &[
    ("aten::_thnn_fused_lstm_cell", lstm_cell),
    (
        "aten::_thnn_fused_lstm_cell_backward_impl",
        lstm_cell_backward,
    ),
    ("aten::_thnn_fused_gru_cell", gru_cell),
    ("aten::_thnn_fused_gru_cell_backward", gru_cell_backward),
];
