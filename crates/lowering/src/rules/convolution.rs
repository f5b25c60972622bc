//! Convolution rules (1d/2d/3d, transposed, grouped, forward and backward) and the sliding
//! windows of torch.nn.functional.unfold/fold (im2col, col2im, unfold_backward).

use super::nn_common::*;
use super::opmath;
use crate::promote::torch_name;
use crate::shape::{numel, shape_str};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};
use stablehlo::ReduceKind;

struct Conv {
    stride: Vec<i64>,
    pad: Vec<i64>,
    dil: Vec<i64>,
    groups: i64,
    transposed: bool,
    out_pad: Vec<i64>,
}

/// Convolution parameters. PyTorch validates shapes before it calls the backend op, so
/// anything unusual here is declined rather than reported.
fn conv_args(c: &Ctx, x: &TensorArg, w: &TensorArg) -> LResult<Conv> {
    // The CPU convolves int64 too (exactly, wrapping on overflow, as XLA's s64 does).
    if x.dtype != DType::I64 {
        float_input(x, "convolution")?;
    }
    let r = x.shape.len();
    if w.dtype != x.dtype
        || r < 3
        || w.shape.len() != r
        || numel(&x.shape) == 0
        || numel(&w.shape) == 0
    {
        return decline("convolution: unsupported input/weight");
    }
    let n = r - 2;
    let p = Conv {
        stride: expand(c.args.ints("stride")?, n, "stride")?,
        pad: expand(c.args.ints("padding")?, n, "padding")?,
        dil: expand(c.args.ints("dilation")?, n, "dilation")?,
        groups: c.args.int("groups")?,
        transposed: c.args.bool_or("transposed", false),
        out_pad: expand(
            c.args.ints("output_padding").unwrap_or_else(|_| vec![0]),
            n,
            "output_padding",
        )?,
    };
    let g = p.groups;
    let ok_params = g > 0
        && p.stride.iter().all(|v| *v > 0)
        && p.dil.iter().all(|v| *v > 0)
        && p.pad.iter().all(|v| *v >= 0)
        && p.out_pad.iter().all(|v| *v >= 0);
    let ok_channels = if p.transposed {
        x.shape[1] == w.shape[0] && w.shape[0] % g == 0
    } else {
        x.shape[1] == w.shape[1] * g && w.shape[0] % g == 0
    };
    if !ok_params || !ok_channels {
        return decline("convolution: unsupported parameters");
    }
    Ok(p)
}

fn conv_fwd(b: &mut Builder, x: Value, w: Value, p: &Conv) -> Value {
    let n = p.stride.len();
    let pad: Vec<(i64, i64)> = p.pad.iter().map(|v| (*v, *v)).collect();
    b.convolution(x, w, &p.stride, &pad, &vec![1; n], &p.dil, p.groups, 1)
}

/// The gradient of `conv_fwd` with respect to its input of spatial size `in_sp` (also the
/// transposed convolution): a stride-1 convolution of the stride-dilated `gy` with the
/// flipped kernel whose in/out features are swapped within each group.
fn conv_input_grad(b: &mut Builder, gy: Value, w: Value, p: &Conv, in_sp: &[i64]) -> Value {
    let ws = b.shape(w);
    let gys = b.shape(gy);
    let n = ws.len() - 2;
    let g = p.groups;
    let (o, cg) = (ws[0], ws[1]);
    let og = o / g;
    let k = ws[2..].to_vec();
    let mut s5 = vec![g, og, cg];
    s5.extend_from_slice(&k);
    let r = b.reshape(w, &s5);
    let mut perm = vec![0, 2, 1];
    perm.extend(3..3 + n as i64);
    let r = b.transpose(r, &perm);
    let mut s4 = vec![g * cg, og];
    s4.extend_from_slice(&k);
    let r = b.reshape(r, &s4);
    let sp: Vec<i64> = (2..2 + n as i64).collect();
    let r = b.reverse(r, &sp);
    let pad: Vec<(i64, i64)> = (0..n)
        .map(|i| {
            let kd = (k[i] - 1) * p.dil[i];
            (
                kd - p.pad[i],
                in_sp[i] - 1 + p.pad[i] - (gys[2 + i] - 1) * p.stride[i],
            )
        })
        .collect();
    b.convolution(gy, r, &vec![1; n], &pad, &p.stride, &p.dil, g, 1)
}

/// The gradient of `conv_fwd` with respect to its kernel of spatial size `k`: channels act
/// as the batch, the batch as the contracted feature, one batch group per conv group.
fn conv_weight_grad(b: &mut Builder, x: Value, gy: Value, p: &Conv, k: &[i64]) -> Value {
    let xs = b.shape(x);
    let gys = b.shape(gy);
    let n = xs.len() - 2;
    let mut perm = vec![1, 0];
    perm.extend(2..2 + n as i64);
    let lhs = b.transpose(x, &perm);
    let rhs = b.transpose(gy, &perm);
    let pad: Vec<(i64, i64)> = (0..n)
        .map(|i| {
            let hi =
                (k[i] - 1) * p.dil[i] + (gys[2 + i] - 1) * p.stride[i] + 1 - xs[2 + i] - p.pad[i];
            (p.pad[i], hi)
        })
        .collect();
    let r = b.convolution(lhs, rhs, &p.dil, &pad, &vec![1; n], &p.stride, 1, p.groups);
    b.transpose(r, &perm)
}

/// convolution / convolution_overrideable.
fn convolution(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "input")?;
    let w = tensor(c, "weight")?;
    let bias = c.args.opt_tensor("bias").cloned();
    let p = conv_args(c, &x, &w)?;
    let n = x.shape.len() - 2;
    let b = &mut *c.b;
    // Half types convolve and add the bias in f32, rounding once.
    let cd = opmath(x.dtype);
    let (xv, wv) = (b.convert(x.value, cd), b.convert(w.value, cd));
    let y = if p.transposed {
        let out_sp: Vec<i64> = (0..n)
            .map(|i| {
                (x.shape[2 + i] - 1) * p.stride[i] - 2 * p.pad[i]
                    + p.dil[i] * (w.shape[2 + i] - 1)
                    + p.out_pad[i]
                    + 1
            })
            .collect();
        conv_input_grad(b, xv, wv, &p, &out_sp)
    } else {
        conv_fwd(b, xv, wv, &p)
    };
    let y = match bias {
        Some(bias) => {
            let bv = b.convert(bias.value, cd);
            let shape = b.shape(y);
            let bb = per_channel(b, bv, &shape);
            b.add(y, bb)
        }
        None => y,
    };
    Ok(vec![Out::T(b.convert(y, x.dtype))])
}

/// convolution_backward / convolution_backward_overrideable.
pub(super) fn convolution_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "input")?;
    let w = tensor(c, "weight")?;
    let mask = c.args.bools("output_mask")?;
    let p = conv_args(c, &x, &w)?;
    if gy.dtype != x.dtype
        || gy.shape.len() != x.shape.len()
        || numel(&gy.shape) == 0
        || mask.len() != 3
    {
        return decline("convolution_backward: unsupported grad_output");
    }
    let k = w.shape[2..].to_vec();
    let b = &mut *c.b;
    let mut outs = Vec::new();
    if mask[0] {
        let gi = if p.transposed {
            conv_fwd(b, gy.value, w.value, &p)
        } else {
            conv_input_grad(b, gy.value, w.value, &p, &x.shape[2..])
        };
        // With output padding, a transposed convolution's gradient can have windows past
        // the input's end; no input element receives them.
        let gs = b.shape(gi);
        let gi = if p.transposed
            && gs.len() == x.shape.len()
            && gs.iter().zip(&x.shape).all(|(g, s)| g >= s)
        {
            let r = x.shape.len();
            b.slice(gi, &vec![0; r], &x.shape, &vec![1; r])
        } else {
            gi
        };
        if b.shape(gi) != x.shape {
            return decline("convolution_backward: input gradient shape");
        }
        outs.push(Out::T(gi));
    } else {
        outs.push(Out::None);
    }
    // PyTorch's CPU kernels return the weight gradient whenever the bias gradient is asked.
    if mask[1] || mask[2] {
        let gw = if p.transposed {
            conv_weight_grad(b, gy.value, x.value, &p, &k)
        } else {
            conv_weight_grad(b, x.value, gy.value, &p, &k)
        };
        if b.shape(gw) != w.shape {
            return decline("convolution_backward: weight gradient shape");
        }
        outs.push(Out::T(gw));
    } else {
        outs.push(Out::None);
    }
    if mask[2] {
        let cd = opmath(gy.dtype);
        let g = b.convert(gy.value, cd);
        let s = sum_but(b, g, 1);
        outs.push(Out::T(b.convert(s, gy.dtype)));
    } else {
        outs.push(Out::None);
    }
    Ok(outs)
}

/// The positions `o * stride + j * dil` of `out` windows of `k` taps, window-major.
pub(super) fn window_taps(out: i64, k: i64, stride: i64, dil: i64) -> Vec<i64> {
    (0..out)
        .flat_map(|o| (0..k).map(move |j| o * stride + j * dil))
        .collect()
}

/// im2col / col2im parameters: [kernel, dilation, padding, stride], two each.
fn window_args(c: &Ctx, extra: &[&str]) -> LResult<Vec<[i64; 2]>> {
    let mut out = Vec::new();
    for name in extra
        .iter()
        .chain(&["kernel_size", "dilation", "padding", "stride"])
    {
        let v = c.args.ints(name)?;
        if v.len() != 2 {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "It is expected {name} equals to 2, but got size {}",
                    v.len()
                ),
            );
        }
        out.push([v[0], v[1]]);
    }
    Ok(out)
}

/// PyTorch's checks of im2col/col2im's kernel, dilation, padding and stride (in `order`).
fn check_window(
    k: [i64; 2],
    d: [i64; 2],
    p: [i64; 2],
    s: [i64; 2],
    order: &[usize],
) -> LResult<()> {
    for i in order {
        let (ok, what, v, word) = match i {
            0 => (
                k[0] > 0 && k[1] > 0,
                "kernel",
                k,
                "kernel size should be greater than zero",
            ),
            1 => (
                d[0] > 0 && d[1] > 0,
                "dilation",
                d,
                "dilation should be greater than zero",
            ),
            2 => (
                p[0] >= 0 && p[1] >= 0,
                "pad",
                p,
                "padding should be non-negative",
            ),
            _ => (
                s[0] > 0 && s[1] > 0,
                "stride",
                s,
                "stride should be greater than zero",
            ),
        };
        if !ok {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "{word}, but got {what}_height: {} {what}_width: {}",
                    v[0], v[1]
                ),
            );
        }
    }
    Ok(())
}

/// im2col (nn.functional.unfold): [N, C, H, W] -> [N, C * kh * kw, L], two gathers of the
/// zero-padded input.
fn im2col(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let a = window_args(c, &[])?;
    let (k, d, p, s) = (a[0], a[1], a[2], a[3]);
    check_window(k, d, p, s, &[0, 1, 2, 3])?;
    let r = x.shape.len();
    if r != 3 && r != 4 {
        return decline("im2col: input rank");
    }
    if x.shape[r - 3..].contains(&0) {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected 3D or 4D (batch mode) tensor with possibly 0 batch size and other non-zero dimensions for input, but got: {}",
                shape_str(&x.shape)
            ),
        );
    }
    let (h, w) = (x.shape[r - 2], x.shape[r - 1]);
    let o: Vec<i64> = (0..2)
        .map(|i| (x.shape[r - 2 + i] + 2 * p[i] - (d[i] * (k[i] - 1) + 1)) / s[i] + 1)
        .collect();
    if o[0] < 1 || o[1] < 1 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Given input with spatial size ({h}, {w}), kernel_size=({}, {}), dilation=({}, {}), padding=({}, {}), calculated shape of the array of sliding blocks as ({}, {}), but its components must be at least one.",
                k[0], k[1], d[0], d[1], p[0], p[1], o[0], o[1]
            ),
        );
    }
    if !x.dtype.is_float() && !x.dtype.is_complex() && x.dtype != DType::Bool {
        return decline(format!("im2col: {} input", torch_name(x.dtype)));
    }
    let lead = &x.shape[..r - 3];
    let ch = x.shape[r - 3];
    let mut want: Vec<i64> = lead.to_vec();
    want.extend([ch * k[0] * k[1], o[0] * o[1]]);
    let b = &mut *c.b;
    if numel(&x.shape) == 0 {
        return Ok(empty_outs(b, &[x.dtype], &want));
    }
    let zero = b.constant(x.dtype, 0.0);
    let mut lo = vec![0; r];
    lo[r - 2] = p[0];
    lo[r - 1] = p[1];
    let t = b.pad(x.value, zero, &lo, &lo, &vec![0; r]);
    // [.., C, Hp, Wp] -> [.., C, oh, kh, Wp] -> [.., C, oh, kh, ow, kw]
    let t = take_rows(
        b,
        t,
        r - 2,
        &window_taps(o[0], k[0], s[0], d[0]),
        k[0] as usize,
    );
    let t = take_rows(b, t, r, &window_taps(o[1], k[1], s[1], d[1]), k[1] as usize);
    let l = lead.len() as i64;
    let mut perm: Vec<i64> = (0..l).collect();
    perm.extend([l, l + 2, l + 4, l + 1, l + 3]);
    let t = b.transpose(t, &perm);
    Ok(vec![Out::T(b.reshape(t, &want))])
}

/// col2im (nn.functional.fold): the adjoint of im2col, summing overlapping windows.
fn col2im(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let a = window_args(c, &["output_size"])?;
    let (os, k, d, p, s) = (a[0], a[1], a[2], a[3], a[4]);
    check_window(k, d, p, s, &[0, 3, 1, 2])?;
    let r = x.shape.len();
    let ok = (r == 2 && x.shape[0] != 0 && x.shape[1] != 0)
        || (r == 3 && x.shape[1] != 0 && x.shape[2] != 0);
    if !ok {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected 2D or 3D (batch mode) tensor for input with possibly 0 batch size and non-zero dimensions for input, but got: {}",
                shape_str(&x.shape)
            ),
        );
    }
    let cd = r - 2;
    let kk = k[0] * k[1];
    if x.shape[cd] % kk != 0 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected size of input's dimension {cd} to be divisible by the product of kernel_size, but got input.size({cd})={} and kernel_size=({}, {}).",
                x.shape[cd], k[0], k[1]
            ),
        );
    }
    let o: Vec<i64> = (0..2)
        .map(|i| div_floor(os[i] + 2 * p[i] - d[i] * (k[i] - 1) - 1, s[i]) + 1)
        .collect();
    let prefix = format!(
        "Given output_size=({}, {}), kernel_size=({}, {}), dilation=({}, {}), padding=({}, {}), stride=({}, {})",
        os[0], os[1], k[0], k[1], d[0], d[1], p[0], p[1], s[0], s[1]
    );
    if x.shape[cd + 1] != o[0] * o[1] {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{prefix}, expected size of input's dimension {} to match the calculated number of sliding blocks {} * {} = {}, but got input.size({})={}.",
                cd + 1, o[0], o[1], o[0] * o[1], cd + 1, x.shape[cd + 1]
            ),
        );
    }
    if o[0] < 1 || o[1] < 1 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{prefix}, calculated shape of the array of sliding blocks as ({}, {}), which is too small (non-positive)",
                o[0], o[1]
            ),
        );
    }
    if !x.dtype.is_float() && !x.dtype.is_complex() {
        return decline(format!("col2im: {} input", torch_name(x.dtype)));
    }
    let lead = &x.shape[..cd];
    let ch = x.shape[cd] / kk;
    let mut want: Vec<i64> = lead.to_vec();
    want.extend([ch, os[0], os[1]]);
    let b = &mut *c.b;
    if numel(&x.shape) == 0 {
        return Ok(empty_outs(b, &[x.dtype], &want));
    }
    let dt = opmath(x.dtype);
    let t = b.convert(x.value, dt);
    let mut split: Vec<i64> = lead.to_vec();
    split.extend([ch, k[0], k[1], o[0], o[1]]);
    let t = b.reshape(t, &split);
    // [.., C, kh, kw, oh, ow] -> [.., C, oh, kh, ow, kw] -> [.., C, Hp, ow, kw] -> [.., C, Hp, Wp]
    let l = cd as i64;
    let mut perm: Vec<i64> = (0..l).collect();
    perm.extend([l, l + 3, l + 1, l + 4, l + 2]);
    let t = b.transpose(t, &perm);
    let (hp, wp) = (os[0] + 2 * p[0], os[1] + 2 * p[1]);
    let t = put_rows(b, t, cd + 1, &window_taps(o[0], k[0], s[0], d[0]), hp);
    let t = put_rows(b, t, cd + 2, &window_taps(o[1], k[1], s[1], d[1]), wp);
    let t = b.slice_dim(t, cd + 1, p[0], p[0] + os[0], 1);
    let t = b.slice_dim(t, cd + 2, p[1], p[1] + os[1], 1);
    Ok(vec![Out::T(b.convert(t, x.dtype))])
}

/// unfold_backward: the gradient of Tensor.unfold, windows summed back onto `dim`.
fn unfold_backward(c: &mut Ctx) -> LResult<Vec<Out>> {
    let g = tensor(c, "grad_in")?;
    let sizes = c.args.ints("input_sizes")?;
    let (size, step) = (c.args.int("size")?, c.args.int("step")?);
    let r = sizes.len();
    if g.dtype == DType::Bool || step <= 0 || size < 0 {
        return decline("unfold_backward: bool or bad window");
    }
    if r == 0 {
        // A 0-d input unfolds to [size], size at most 1.
        if g.shape != [size] || size > 1 {
            return decline("unfold_backward: 0-d input");
        }
        let dt = opmath(g.dtype);
        let t = c.b.convert(g.value, dt);
        let t = c.b.reduce(t, &[0], ReduceKind::Sum);
        return Ok(vec![Out::T(c.b.convert(t, g.dtype))]);
    }
    let d = crate::shape::wrap_dim(c.args.int("dim")?, r)?;
    let n = sizes[d];
    if size > n {
        return decline("unfold_backward: window longer than the dim");
    }
    let nw = (n - size) / step + 1;
    let mut want = sizes.clone();
    want[d] = nw;
    want.push(size);
    if g.shape != want {
        return decline("unfold_backward: grad_in shape");
    }
    let b = &mut *c.b;
    if numel(&want) == 0 {
        return Ok(empty_outs(b, &[g.dtype], &sizes));
    }
    let dt = opmath(g.dtype);
    let t = b.convert(g.value, dt);
    // Bring the window axis next to `dim`: [.., nw, size, ..].
    let mut perm: Vec<i64> = (0..r as i64).collect();
    perm.insert(d + 1, r as i64);
    let t = b.transpose(t, &perm);
    let t = put_rows(b, t, d, &window_taps(nw, size, step, 1), n);
    Ok(vec![Out::T(b.convert(t, g.dtype))])
}

pub const RULES: &[(&str, Rule)] = &[
    ("aten::convolution", convolution),
    ("aten::convolution_overrideable", convolution),
    ("aten::convolution_backward", convolution_backward),
    (
        "aten::convolution_backward_overrideable",
        convolution_backward,
    ),
    ("aten::im2col", im2col),
    ("aten::col2im", col2im),
    ("aten::unfold_backward", unfold_backward),
];
