//! Pooling rules: max/avg pooling (1d/2d/3d, adaptive, fractional), max unpooling, with
//! their backward ops.

use super::nn_common::*;
use super::{opmath, take_flat};
use crate::promote::torch_name;
use crate::shape::{numel, shape_str};
use crate::{
    decline, user_err, Builder, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg, Value,
};
use stablehlo::{CmpDir, ReduceKind};

/// Pooling parameters of the last `k.len()` dims.
struct Pool {
    k: Vec<i64>,
    s: Vec<i64>,
    p: Vec<i64>,
    d: Vec<i64>,
    out: Vec<i64>,
}

/// PyTorch's pooling output size, with its checks.
pub(super) fn pool_out(inp: i64, k: i64, p: i64, s: i64, d: i64, ceil: bool) -> LResult<i64> {
    if s == 0 {
        return user_err(ErrorKind::Runtime, "stride should not be zero");
    }
    if p < 0 {
        return user_err(
            ErrorKind::Runtime,
            format!("pad must be non-negative, but got pad: {p}"),
        );
    }
    if p > ((k - 1) * d + 1) / 2 {
        return user_err(
            ErrorKind::Runtime,
            format!("pad should be at most half of effective kernel size, but got pad={p}, kernel_size={k} and dilation={d}"),
        );
    }
    let mut o = div_floor(
        inp + 2 * p - d * (k - 1) - 1 + if ceil { s - 1 } else { 0 },
        s,
    ) + 1;
    if ceil && (o - 1) * s >= inp + p {
        o -= 1;
    }
    Ok(o)
}

/// A pooling parameter given as one int or one per pooled dim (`None` otherwise).
fn per_dim(v: &[i64], n: usize) -> Option<Vec<i64>> {
    match v.len() {
        1 => Some(vec![v[0]; n]),
        l if l == n => Some(v.to_vec()),
        _ => None,
    }
}

/// PyTorch's listing of a per-dim parameter, "kT: 1 kH: 2 kW: 3" (T, H, W name the last
/// dims).
fn dim_list(prefix: &str, v: &[i64]) -> String {
    let names = ["T", "H", "W"];
    let names = &names[3 - v.len().min(3)..];
    let items: Vec<String> = v
        .iter()
        .zip(names)
        .map(|(x, l)| format!("{prefix}{l}: {x}"))
        .collect();
    items.join(" ")
}

/// Fails like PyTorch when a dim of `shape` from `from` on is empty.
fn check_nonempty(fname: &str, shape: &[i64], from: usize) -> LResult<()> {
    match (from..shape.len()).find(|i| shape[*i] == 0) {
        Some(i) => user_err(
            ErrorKind::Runtime,
            format!(
                "{fname}(): Expected input to have non-zero size for non-batch dimensions, but input has sizes {} with dimension {i} being empty",
                shape_str(shape)
            ),
        ),
        None => Ok(()),
    }
}

/// Reads and checks max_pool{2,3}d / avg_pool{2,3}d parameters for input `x` with `n`
/// pooled dims, in PyTorch's order and words.
fn pool_args(c: &Ctx, name: &str, x: &TensorArg, with_dilation: bool, n: usize) -> LResult<Pool> {
    let err = |m: String| user_err::<Pool>(ErrorKind::Runtime, m);
    let count = if n == 2 { "two" } else { "three" };
    // avg_pool3d words its argument errors without "either".
    let either = if name == "avg_pool3d" { "" } else { "either " };
    let Some(k) = per_dim(&c.args.ints("kernel_size")?, n) else {
        return err(format!(
            "{name}: kernel_size must {either}be a single int, or a tuple of {count} ints"
        ));
    };
    let sv = c.args.ints("stride").unwrap_or_default();
    let s = if sv.is_empty() {
        Some(k.clone())
    } else {
        per_dim(&sv, n)
    };
    let Some(s) = s else {
        return err(format!(
            "{name}: stride must {either}be omitted, a single int, or a tuple of {count} ints"
        ));
    };
    let Some(p) = per_dim(&c.args.ints("padding")?, n) else {
        return err(format!(
            "{name}: padding must {either}be a single int, or a tuple of {count} ints"
        ));
    };
    let d = if with_dilation {
        per_dim(&c.args.ints("dilation")?, n)
    } else {
        Some(vec![1; n])
    };
    let Some(d) = d else {
        return err(format!(
            "{name}: dilation must be either a single int, or a tuple of {count} ints"
        ));
    };
    if c.args.opt_int("divisor_override") == Some(0) {
        return err("divisor must be not zero".into());
    }
    let r = x.shape.len();
    if r != n + 1 && r != n + 2 {
        if with_dilation || n == 3 {
            return err(format!(
                "non-empty {}D or {}D (batch mode) tensor expected for input",
                n + 1,
                n + 2
            ));
        }
        return decline(format!("{name}: input of rank {r}"));
    }
    // avg_pool3d checks for empty dims before the padding, max_pool3d after.
    let nonempty = |name| check_nonempty(name, &x.shape, r - n - 1);
    if n == 3 && !with_dilation {
        nonempty("avg_pool3d")?;
    }
    let ceil = c.args.bool_or("ceil_mode", false);
    let sp = &x.shape[r - n..];
    let out = (0..n)
        .map(|i| pool_out(sp[i], k[i], p[i], s[i], d[i], ceil))
        .collect::<LResult<Vec<i64>>>()?;
    if n == 3 && with_dilation {
        nonempty("max_pool3d_with_indices_out_cpu_template")?;
    }
    if k.iter().any(|v| *v <= 0) {
        return err(format!(
            "kernel size should be greater than zero, but got {}",
            dim_list("k", &k)
        ));
    }
    if s.iter().any(|v| *v <= 0) {
        return err(format!(
            "stride should be greater than zero, but got {}",
            dim_list("d", &s)
        ));
    }
    if d.iter().any(|v| *v <= 0) {
        return err(format!(
            "dilation should be greater than zero, but got {}",
            dim_list("dilation", &d)
        ));
    }
    if n == 2 && x.shape[r - 3..].contains(&0) {
        return decline(format!("{name}: empty non-batch dims"));
    }
    if n == 3 && !with_dilation && (0..n).any(|i| sp[i] < k[i]) {
        return err(format!(
            "input image ({}) smaller than kernel size ({})",
            dim_list("", sp),
            dim_list("k", &k)
        ));
    }
    if (0..n).any(|i| k[i] / 2 < p[i]) {
        return err(if n == 2 {
            format!(
                "pad should be smaller than or equal to half of kernel size, but got padW = {}, padH = {}, kW = {}, kH = {}",
                p[1], p[0], k[1], k[0]
            )
        } else {
            format!(
                "pad should be smaller than or equal to half of kernel size, but got kT: {} kW: {} kH: {} padT: {} padW: {} padH: {}",
                k[0], k[2], k[1], p[0], p[2], p[1]
            )
        });
    }
    if out.iter().any(|o| *o < 1) {
        let ch = x.shape[r - n - 1];
        let join = |v: &[i64]| {
            let s: Vec<String> = v.iter().map(|x| x.to_string()).collect();
            s.join("x")
        };
        return err(format!(
            "Given input size: ({ch}x{}). Calculated output size: ({ch}x{}). Output size is too small",
            join(sp),
            join(&out)
        ));
    }
    Ok(Pool { k, s, p, d, out })
}

/// Window, stride, dilation and padding over all dims of a rank-`r` input (the leading
/// dims untouched); the high padding covers ceil_mode's partial last window.
#[allow(clippy::type_complexity)]
fn pool_window(pl: &Pool, shape: &[i64]) -> (Vec<i64>, Vec<i64>, Vec<i64>, Vec<(i64, i64)>) {
    let r = shape.len();
    let n = pl.k.len();
    let mut win = vec![1; r];
    let mut st = vec![1; r];
    let mut dil = vec![1; r];
    let mut pad = vec![(0, 0); r];
    for i in 0..n {
        let j = r - n + i;
        win[j] = pl.k[i];
        st[j] = pl.s[i];
        dil[j] = pl.d[i];
        let need = (pl.out[i] - 1) * pl.s[i] + (pl.k[i] - 1) * pl.d[i] + 1;
        let extra = (need - (shape[j] + 2 * pl.p[i])).max(0);
        pad[j] = (pl.p[i], pl.p[i] + extra);
    }
    (win, st, dil, pad)
}

/// The flat index of every element within its trailing `n`-dim volume, shaped `shape`.
fn flat_index(b: &mut Builder, shape: &[i64], n: usize) -> Value {
    let r = shape.len();
    let sp = &shape[r - n..];
    let mut idx = b.iota(DType::I64, sp, n - 1);
    let mut stride = sp[n - 1];
    for j in (0..n - 1).rev() {
        let io = b.iota(DType::I64, sp, j);
        let k = b.splat(io, stride as f64);
        let t = b.mul(io, k);
        idx = b.add(idx, t);
        stride *= sp[j];
    }
    let dims: Vec<i64> = (r - n..r).map(|d| d as i64).collect();
    b.broadcast_in_dim(idx, shape, &dims)
}

/// Of two (value, index) pairs, the one a max pooling keeps: the larger value, the first
/// index on ties; NaN wins, and among NaNs the last one, as PyTorch's scan does.
fn argmax_pick(b: &mut Builder, a: &[Value]) -> Vec<Value> {
    let (av, ai, bv, bi) = (a[0], a[1], a[2], a[3]);
    let a_nan = b.compare(av, av, CmpDir::Ne);
    let b_nan = b.compare(bv, bv, CmpDir::Ne);
    let a_first = b.compare(ai, bi, CmpDir::Lt);
    let a_last = b.not(a_first);
    let both = b.and(a_nan, b_nan);
    let both = b.and(both, a_last);
    let b_num = b.not(b_nan);
    let only_a = b.and(a_nan, b_num);
    let gt = b.compare(av, bv, CmpDir::Gt);
    let eq = b.compare(av, bv, CmpDir::Eq);
    let tie = b.and(eq, a_first);
    let pick = b.or(both, only_a);
    let pick = b.or(pick, gt);
    let pick = b.or(pick, tie);
    vec![b.select(pick, av, bv), b.select(pick, ai, bi)]
}

/// max_pool{2,3}d_with_indices: the max of each window and its flat index in the pooled
/// volume.
fn max_pool(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let name = if n == 2 { "max_pool2d" } else { "max_pool3d" };
    let pl = pool_args(c, name, &x, true, n)?;
    if x.dtype == DType::Bool {
        return decline(format!("{name}: bool input"));
    }
    let want = with_spatial(&x.shape, &pl.out);
    let b = &mut *c.b;
    if numel(&x.shape) == 0 {
        return Ok(empty_outs(b, &[x.dtype, DType::I64], &want));
    }
    let idx = flat_index(b, &x.shape, n);
    let (win, st, dil, pad) = pool_window(&pl, &x.shape);
    let vinit = b.constant(x.dtype, ReduceKind::Max.init(x.dtype));
    let iinit = b.constant_i64(DType::I64, i64::MAX);
    let res = b.reduce_window_with(
        &[x.value, idx],
        &[vinit, iinit],
        &win,
        &st,
        &dil,
        &pad,
        argmax_pick,
    );
    if b.shape(res[0]) != want {
        return decline(format!("{name}: window arithmetic mismatch"));
    }
    Ok(vec![Out::T(res[0]), Out::T(res[1])])
}

/// The input gradient of a max-style pooling: each `gy` element added into the element of
/// its plane that `ind` (a flat index in the last `n` dims of `x`) names.
fn index_grad(b: &mut Builder, gy: &TensorArg, ind: &TensorArg, x: &TensorArg, n: usize) -> Value {
    let r = x.shape.len();
    let planes = numel(&x.shape[..r - n]);
    let vol = numel(&x.shape[r - n..]);
    let l = numel(&gy.shape[r - n..]);
    let m = planes * l;
    let cd = opmath(x.dtype);
    let zero = b.full(cd, &[planes, vol], 0.0);
    let idx = b.convert(ind.value, DType::I64);
    let idx = b.reshape(idx, &[m, 1]);
    let plane = b.iota(DType::I64, &[planes, l], 0);
    let plane = b.reshape(plane, &[m, 1]);
    let both = b.concatenate(&[plane, idx], 1);
    let g = b.convert(gy.value, cd);
    let g = b.reshape(g, &[m]);
    let gi = b.scatter(zero, both, g, &[], &[0, 1], &[0, 1], 1, |b, a, u| {
        b.add(a, u)
    });
    let gi = b.reshape(gi, &x.shape);
    b.convert(gi, x.dtype)
}

/// max_pool{2,3}d_with_indices_backward.
fn max_pool_backward(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let ind = tensor(c, "indices")?;
    let name = if n == 2 { "max_pool2d" } else { "max_pool3d" };
    let pl = pool_args(c, name, &x, true, n)?;
    float_input(&x, "max_pool_backward")?;
    let want = with_spatial(&x.shape, &pl.out);
    if gy.shape != want || ind.shape != want {
        return decline("max_pool_backward: grad_output/indices shape");
    }
    if numel(&x.shape) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &x.shape));
    }
    Ok(vec![Out::T(index_grad(c.b, &gy, &ind, &x, n))])
}

/// fractional_max_pool{2,3}d's checks, in PyTorch's order and words; returns the output
/// shape.
fn fractional_args(
    x: &TensorArg,
    u: &TensorArg,
    k: &[i64],
    out: &[i64],
    n: usize,
) -> LResult<Vec<i64>> {
    let err = |m: String| user_err::<Vec<i64>>(ErrorKind::Runtime, m);
    // The 3-d kernel's messages name its out= template.
    let (name, fname) = if n == 2 {
        ("fractional_max_pool2d()", "fractional_max_pool2d()")
    } else {
        ("fractional_max_pool3d()", "fractional_max_pool3d_out()")
    };
    if k.len() != n || out.len() != n || out.iter().any(|o| *o < 0) {
        return decline(format!("{name}: kernel_size/output_size"));
    }
    if k.iter().any(|v| *v <= 0) {
        let ks: Vec<String> = k.iter().map(|v| v.to_string()).collect();
        return err(format!(
            "{name}: kernel size should be greater than zero, but got {}",
            ks.join("x")
        ));
    }
    let r = x.shape.len();
    if r != n + 1 && r != n + 2 {
        return err(format!(
            "{fname}: Expected {}D or {}D tensor, but got: {}",
            n + 1,
            n + 2,
            shape_str(&x.shape)
        ));
    }
    if let Some(d) = (r - n - 1..r).find(|d| x.shape[*d] == 0) {
        return err(format!(
            "{fname}: Expected input to have non-zero size for non-batch dimensions, but got{} with dimension {d} being empty.",
            shape_str(&x.shape)
        ));
    }
    let sp = &x.shape[r - n..];
    // 2-d allows a last window ending at the edge, 3-d does not; 3-d checks W before H.
    let order: &[(usize, &str)] = if n == 2 {
        &[(0, "height"), (1, "width")]
    } else {
        &[(0, "time"), (2, "width"), (1, "height")]
    };
    for (i, what) in order {
        let end = out[*i] + k[*i] - 1;
        if (n == 2 && end > sp[*i]) || (n == 3 && end >= sp[*i]) {
            return err(format!(
                "{fname}: pool {what} {} too large relative to input {what} {}",
                k[*i], sp[*i]
            ));
        }
    }
    let batch = if r == n + 2 { x.shape[0] } else { 1 };
    let planes = x.shape[r - n - 1];
    if u.dtype != x.dtype {
        return err("Expect _random_samples to have the same dtype as input".into());
    }
    if u.shape.len() != 3 {
        return err(format!(
            "Expect _random_samples to have 3 dimensions, got {}",
            u.shape.len()
        ));
    }
    if u.shape[0] < batch {
        return err("Expect _random_samples.size(0) no less then input batch size.".into());
    }
    if u.shape[1] != planes {
        return err("Expect _random_samples.size(1) equals to input channel size.".into());
    }
    if u.shape[2] != n as i64 {
        return err(format!(
            "Expect _random_samples.size(2) equals to {n}; got {}.",
            u.shape[2]
        ));
    }
    Ok(with_spatial(&x.shape, out))
}

/// The first input index of each of a plane's `out` windows along one dim, from the
/// plane's sample `u` (shape [planes]): PyTorch's pseudo-random interval sequence,
/// computed in the input's dtype as its CPU kernel does. An i64 value of [planes, out].
fn fractional_starts(b: &mut Builder, u: Value, inp: i64, k: i64, out: i64) -> Value {
    let dt = b.dtype(u);
    let planes = b.shape(u)[0];
    let last = b.full(DType::I64, &[planes, 1], (inp - k) as f64);
    if out == 1 {
        return last;
    }
    // alpha = (inp - k) / (out - 1) in the dtype: f32 division rounded once for halves.
    let alpha = if dt == DType::F64 {
        b.constant(dt, (inp - k) as f64 / (out - 1) as f64)
    } else {
        let a = b.constant(DType::F32, ((inp - k) as f32 / (out - 1) as f32) as f64);
        b.convert(a, dt)
    };
    let shape = [planes, out - 1];
    let i = b.iota(dt, &shape, 1);
    let ub = b.broadcast_in_dim(u, &shape, &[0]);
    let a = b.broadcast_to(alpha, &shape);
    let t = b.add(i, ub);
    let t = b.mul(t, a);
    let t = b.convert(t, DType::I64);
    let a0 = b.broadcast_to(alpha, &[planes]);
    let t0 = b.mul(u, a0);
    let t0 = b.convert(t0, DType::I64);
    let t0 = b.broadcast_in_dim(t0, &shape, &[0]);
    let seq = b.sub(t, t0);
    b.concatenate(&[seq, last], 1)
}

/// fractional_max_pool{2,3}d: the max over windows of `kernel_size` whose starts follow a
/// per-plane pseudo-random sequence drawn from `random_samples`, and its flat index in the
/// plane. Windows are scanned in order; a larger value or a NaN replaces the max.
fn fractional_max_pool(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let u = tensor(c, "random_samples")?;
    let k = c.args.ints("kernel_size")?;
    let out = c.args.ints("output_size")?;
    let want = fractional_args(&x, &u, &k, &out, n)?;
    float_input(&x, "fractional_max_pool")?;
    if numel(&want) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype, DType::I64], &want));
    }
    let r = x.shape.len();
    let sp = x.shape[r - n..].to_vec();
    let planes = numel(&x.shape[..r - n]);
    let vol = numel(&sp);
    // The samples of the planes present: [planes, n].
    let batch = planes / x.shape[r - n - 1];
    let us = c.b.slice_dim(u.value, 0, 0, batch, 1);
    let us = c.b.reshape(us, &[planes, n as i64]);
    // Sample column per pooled dim: 2-d draws W from column 0 and H from 1; 3-d T, H, W.
    let cols: Vec<i64> = if n == 2 { vec![1, 0] } else { vec![0, 1, 2] };
    let mut starts = Vec::new();
    for j in 0..n {
        let col = c.b.slice_dim(us, 1, cols[j], cols[j] + 1, 1);
        let col = c.b.reshape(col, &[planes]);
        let st = fractional_starts(c.b, col, sp[j], k[j], out[j]);
        // Samples in [0, 1) keep every window inside; huge ones (where `i + u` rounds)
        // may not, and XLA would clamp the gather silently.
        c.check_range(
            st,
            0,
            sp[j] - k[j] + 1,
            ErrorKind::Runtime,
            format!("fractional_max_pool{n}d(): random_samples place a window at {{index}}, outside the input (samples must lie in [0, 1))"),
        );
        starts.push(st);
    }
    let b = &mut *c.b;
    let mut oshape = vec![planes];
    oshape.extend_from_slice(&out);
    // Flat index of each window's first element: sum of start * stride over the dims.
    let mut base = b.full(DType::I64, &oshape, 0.0);
    let mut stride = vol;
    for (j, st) in starts.into_iter().enumerate() {
        stride /= sp[j];
        let s = b.full(DType::I64, &[planes, out[j]], stride as f64);
        let st = b.mul(st, s);
        let st = b.broadcast_in_dim(st, &oshape, &[0, 1 + j as i64]);
        base = b.add(base, st);
    }
    let plane = b.iota(DType::I64, &oshape, 0);
    let pv = b.full(DType::I64, &oshape, vol as f64);
    let plane = b.mul(plane, pv);
    let mut best: Option<(Value, Value)> = None;
    for off in 0..numel(&k) {
        // Offset of this kernel element within the window, T/H outer, W inner.
        let (mut rem, mut delta, mut st) = (off, 0, vol);
        let mut kst = numel(&k);
        for j in 0..n {
            st /= sp[j];
            kst /= k[j];
            delta += (rem / kst) * st;
            rem %= kst;
        }
        let d = b.full(DType::I64, &oshape, delta as f64);
        let idx = b.add(base, d);
        let lin = b.add(plane, idx);
        let v = take_flat(b, x.value, lin);
        best = Some(match best {
            None => (v, idx),
            Some((mv, mi)) => {
                let gt = b.compare(v, mv, CmpDir::Gt);
                let nan = b.compare(v, v, CmpDir::Ne);
                let take = b.or(gt, nan);
                (b.select(take, v, mv), b.select(take, idx, mi))
            }
        });
    }
    let (mv, mi) = best.expect("kernel sizes are positive");
    Ok(vec![
        Out::T(b.reshape(mv, &want)),
        Out::T(b.reshape(mi, &want)),
    ])
}

/// fractional_max_pool{2,3}d_backward: each gradient added at the index its window chose.
fn fractional_max_pool_backward(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let ind = tensor(c, "indices")?;
    let out = c.args.ints("output_size")?;
    let r = x.shape.len();
    if out.len() != n || (r != n + 1 && r != n + 2) {
        return decline("fractional_max_pool_backward: arguments");
    }
    float_input(&x, "fractional_max_pool_backward")?;
    let want = with_spatial(&x.shape, &out);
    // Mismatches get the CPU kernel's own errors from the fallback.
    if gy.shape != want || ind.shape != want || gy.dtype != x.dtype || ind.dtype != DType::I64 {
        return decline("fractional_max_pool_backward: grad_output/indices shape or dtype");
    }
    if numel(&x.shape) == 0 || numel(&want) == 0 {
        return Ok(vec![Out::T(c.b.full(x.dtype, &x.shape, 0.0))]);
    }
    let vol = numel(&x.shape[r - n..]);
    c.check_range(
        ind.value,
        0,
        vol,
        ErrorKind::Runtime,
        format!("fractional_max_pool{n}d_backward(): index {{index}} is out of bounds for a pooled plane of {vol} elements"),
    );
    Ok(vec![Out::T(index_grad(c.b, &gy, &ind, &x, n))])
}

/// Divisors of avg pooling along one dim: the window length clipped to the padded input
/// (count_include_pad) or to the input.
pub(super) fn avg_counts(
    inp: i64,
    k: i64,
    s: i64,
    p: i64,
    out: i64,
    include_pad: bool,
) -> Vec<f64> {
    (0..out)
        .map(|o| {
            let start = o * s - p;
            let end = (start + k).min(inp + p);
            if include_pad {
                (end - start) as f64
            } else {
                (end.min(inp) - start.max(0)) as f64
            }
        })
        .collect()
}

/// The outer product of per-dim constants as a value of `shape` (they span its last dims).
fn outer_const(b: &mut Builder, per_dim: &[Vec<f64>], shape: &[i64], dt: DType) -> Value {
    let mut all = vec![1.0];
    for v in per_dim {
        all = all
            .iter()
            .flat_map(|a| v.iter().map(move |x| a * x))
            .collect();
    }
    let v = const_vec(b, dt, &all);
    let dims: Vec<i64> = per_dim.iter().map(|v| v.len() as i64).collect();
    let v = b.reshape(v, &dims);
    let (r, n) = (shape.len(), per_dim.len());
    let bd: Vec<i64> = (r - n..r).map(|d| d as i64).collect();
    b.broadcast_in_dim(v, shape, &bd)
}

/// The divisor of each avg pooling output, as a value of `shape` (outputs in the last dims).
fn avg_divisor(c: &mut Ctx, x: &TensorArg, pl: &Pool, shape: &[i64], dt: DType) -> Value {
    if let Some(d) = c.args.opt_int("divisor_override") {
        return c.b.full(dt, shape, d as f64);
    }
    let inc = c.args.bool_or("count_include_pad", true);
    let (r, n) = (x.shape.len(), pl.k.len());
    let counts: Vec<Vec<f64>> = (0..n)
        .map(|i| {
            let inp = x.shape[r - n + i];
            avg_counts(inp, pl.k[i], pl.s[i], pl.p[i], pl.out[i], inc)
        })
        .collect();
    outer_const(c.b, &counts, shape, dt)
}

/// Whether avg_pool{2,3}d (`grad`: its backward) has a CPU kernel for `d`.
fn avg_dtype_ok(d: DType, n: usize, grad: bool) -> bool {
    match (n, grad) {
        (2, false) => d != DType::Bool,
        (2, true) => d.is_float(),
        (_, false) => matches!(d, DType::F32 | DType::F64 | DType::I64),
        _ => matches!(d, DType::F32 | DType::F64),
    }
}

/// avg_pool{2,3}d.
fn avg_pool(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let name = if n == 2 { "avg_pool2d" } else { "avg_pool3d" };
    let pl = pool_args(c, name, &x, false, n)?;
    if !avg_dtype_ok(x.dtype, n, false) {
        return decline(format!("{name}: {} input", torch_name(x.dtype)));
    }
    if numel(&x.shape) == 0 {
        let want = with_spatial(&x.shape, &pl.out);
        return Ok(empty_outs(c.b, &[x.dtype], &want));
    }
    // Integers average in int64 with truncating division, as PyTorch's CPU kernel does.
    let cd = if x.dtype.is_float() {
        opmath(x.dtype)
    } else {
        DType::I64
    };
    let (win, st, _, pad) = pool_window(&pl, &x.shape);
    let xv = c.b.convert(x.value, cd);
    let zero = c.b.constant(cd, 0.0);
    let s =
        c.b.reduce_window(xv, zero, ReduceKind::Sum, &win, &st, &pad);
    let shape = c.b.shape(s);
    let div = avg_divisor(c, &x, &pl, &shape, cd);
    let y = c.b.div(s, div);
    Ok(vec![Out::T(c.b.convert(y, x.dtype))])
}

/// avg_pool{2,3}d_backward.
fn avg_pool_backward(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let name = if n == 2 { "avg_pool2d" } else { "avg_pool3d" };
    let pl = pool_args(c, name, &x, false, n)?;
    if !avg_dtype_ok(x.dtype, n, true) {
        return decline(format!("{name}_backward: {} input", torch_name(x.dtype)));
    }
    let r = x.shape.len();
    let want = with_spatial(&x.shape, &pl.out);
    if gy.shape != want {
        return decline(format!("{name}_backward: grad_output shape"));
    }
    if numel(&x.shape) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &x.shape));
    }
    let cd = opmath(x.dtype);
    let g = c.b.convert(gy.value, cd);
    let div = avg_divisor(c, &x, &pl, &want, cd);
    let b = &mut *c.b;
    let g = b.div(g, div);
    // Each input element collects the outputs whose window covers it: spread the outputs
    // stride apart, pad, and sum windows of the kernel size.
    let mut lo = vec![0; r];
    let mut hi = vec![0; r];
    let mut interior = vec![0; r];
    let mut win = vec![1; r];
    for i in 0..n {
        let j = r - n + i;
        lo[j] = pl.k[i] - 1 - pl.p[i];
        hi[j] = x.shape[j] + pl.p[i] - 1 - (pl.out[i] - 1) * pl.s[i];
        interior[j] = pl.s[i] - 1;
        win[j] = pl.k[i];
    }
    let zero = b.constant(cd, 0.0);
    let padded = b.pad(g, zero, &lo, &hi, &interior);
    let gi = b.reduce_window(
        padded,
        zero,
        ReduceKind::Sum,
        &win,
        &vec![1; r],
        &vec![(0, 0); r],
    );
    if b.shape(gi) != x.shape {
        return decline(format!("{name}_backward: window arithmetic mismatch"));
    }
    Ok(vec![Out::T(b.convert(gi, x.dtype))])
}

/// Adaptive pooling windows: [floor(o * in / out), ceil((o + 1) * in / out)).
pub(super) fn adaptive_windows(inp: i64, out: i64) -> Vec<(i64, i64)> {
    (0..out)
        .map(|o| ((o * inp) / out, ((o + 1) * inp + out - 1) / out))
        .collect()
}

/// The 0/1 membership matrix [out][in] of adaptive windows, and each window's length.
fn adaptive_matrix(inp: i64, out: i64) -> (Vec<Vec<f64>>, Vec<f64>) {
    let wins = adaptive_windows(inp, out);
    let m = wins
        .iter()
        .map(|(s, e)| {
            (0..inp)
                .map(|i| if i >= *s && i < *e { 1.0 } else { 0.0 })
                .collect()
        })
        .collect();
    (m, wins.iter().map(|(s, e)| (e - s) as f64).collect())
}

/// Checks an adaptive pooling input and `output_size` (`n` pooled dims) as PyTorch does.
fn check_adaptive(x: &TensorArg, os: &[i64], n: usize, max: bool) -> LResult<()> {
    let name = format!("adaptive_{}_pool{n}d", if max { "max" } else { "avg" });
    if os.len() != n {
        return user_err(
            ErrorKind::Runtime,
            if max {
                format!("{name}(): internal error: output_size.size() must be {n}")
            } else {
                format!("{name}: output_size must be {n}")
            },
        );
    }
    let r = x.shape.len();
    if r != n + 1 && r != n + 2 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "{name}(): Expected {}D or {}D tensor, but got{} {}",
                n + 1,
                n + 2,
                if max { ":" } else { "" },
                shape_str(&x.shape)
            ),
        );
    }
    // adaptive_avg_pool2d allows empty leading dims; the others only an empty first dim.
    let from = if max || n == 3 { 1 } else { r - n };
    check_nonempty(&name, &x.shape, from)?;
    if os.iter().any(|v| *v < 0) {
        return decline(format!("{name}: negative output size"));
    }
    float_input(x, &name)
}

/// _adaptive_avg_pool{2,3}d.
fn adaptive_avg_pool(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let os = c.args.ints("output_size")?;
    check_adaptive(&x, &os, n, false)?;
    let r = x.shape.len();
    let want = with_spatial(&x.shape, &os);
    if numel(&want) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &want));
    }
    let mats: Vec<_> = (0..n)
        .map(|i| adaptive_matrix(x.shape[r - n + i], os[i]))
        .collect();
    let cd = opmath(x.dtype);
    let b = &mut *c.b;
    let mut t = b.convert(x.value, cd);
    for (i, (m, _)) in mats.iter().enumerate() {
        t = mix(b, t, r - n + i, m);
    }
    let counts: Vec<Vec<f64>> = mats.into_iter().map(|(_, c)| c).collect();
    let div = outer_const(b, &counts, &want, cd);
    let y = b.div(t, div);
    Ok(vec![Out::T(b.convert(y, x.dtype))])
}

/// _adaptive_avg_pool{2,3}d_backward.
fn adaptive_avg_pool_backward(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let r = x.shape.len();
    if gy.shape.len() != r || r < n || gy.shape[..r - n] != x.shape[..r - n] {
        return decline("adaptive_avg_pool_backward: grad_output shape");
    }
    let os = gy.shape[r - n..].to_vec();
    check_adaptive(&x, &os, n, false)?;
    if numel(&x.shape) == 0 || numel(&os) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &x.shape));
    }
    let mats: Vec<_> = (0..n)
        .map(|i| adaptive_matrix(x.shape[r - n + i], os[i]))
        .collect();
    let cd = opmath(x.dtype);
    let b = &mut *c.b;
    let counts: Vec<Vec<f64>> = mats.iter().map(|(_, c)| c.clone()).collect();
    let div = outer_const(b, &counts, &gy.shape, cd);
    let g = b.convert(gy.value, cd);
    let mut t = b.div(g, div);
    for (i, (m, _)) in mats.iter().enumerate() {
        let inp = x.shape[r - n + i] as usize;
        t = mix(b, t, r - n + i, &transpose_matrix(m, inp));
    }
    Ok(vec![Out::T(b.convert(t, x.dtype))])
}

/// adaptive_max_pool{2,3}d: one dim at a time, each output the max of its window and the
/// flat index of that element (ties and NaNs as `argmax_pick`, which composes across dims).
fn adaptive_max_pool(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let os = c.args.ints("output_size")?;
    check_adaptive(&x, &os, n, true)?;
    let r = x.shape.len();
    let want = with_spatial(&x.shape, &os);
    let b = &mut *c.b;
    if numel(&want) == 0 {
        return Ok(empty_outs(b, &[x.dtype, DType::I64], &want));
    }
    let mut v = x.value;
    let mut idx = flat_index(b, &x.shape, n);
    for (i, o) in os.iter().enumerate() {
        let dim = r - n + i;
        let wins = adaptive_windows(x.shape[dim], *o);
        let k = wins.iter().map(|(s, e)| e - s).max().unwrap_or(1);
        // Shorter windows repeat their last element, which cannot change the pick.
        let ids: Vec<i64> = wins
            .iter()
            .flat_map(|(s, e)| (0..k).map(move |j| (s + j).min(e - 1)))
            .collect();
        let vg = take_rows(b, v, dim, &ids, k as usize);
        let ig = take_rows(b, idx, dim, &ids, k as usize);
        let vinit = b.constant(x.dtype, ReduceKind::Max.init(x.dtype));
        let iinit = b.constant_i64(DType::I64, i64::MAX);
        let res = b.reduce_with(&[vg, ig], &[vinit, iinit], &[dim as i64 + 1], argmax_pick);
        (v, idx) = (res[0], res[1]);
    }
    Ok(vec![Out::T(v), Out::T(idx)])
}

/// adaptive_max_pool{2,3}d_backward.
fn adaptive_max_pool_backward(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let gy = tensor(c, "grad_output")?;
    let x = tensor(c, "self")?;
    let ind = tensor(c, "indices")?;
    let r = x.shape.len();
    if gy.shape.len() != r
        || r < n
        || ind.shape != gy.shape
        || ind.dtype != DType::I64
        || gy.shape[..r - n] != x.shape[..r - n]
    {
        return decline("adaptive_max_pool_backward: grad_output/indices");
    }
    check_adaptive(&x, &gy.shape[r - n..], n, true)?;
    if numel(&x.shape) == 0 || numel(&gy.shape) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &x.shape));
    }
    Ok(vec![Out::T(index_grad(c.b, &gy, &ind, &x, n))])
}

/// max_unpool{2,3}d: `self` written at the flat `indices` of a zero output; where indices
/// repeat, the last element wins, as in PyTorch's loop. Indices outside the output raise
/// through a data check.
fn max_unpool(c: &mut Ctx, n: usize) -> LResult<Vec<Out>> {
    let x = tensor(c, "self")?;
    let ind = tensor(c, "indices")?;
    let os = c.args.ints("output_size")?;
    let err = |m: String| user_err::<Vec<Out>>(ErrorKind::Runtime, m);
    if ind.dtype != DType::I64 {
        return err(format!(
            "elements in indices should be type int64 but got: {}",
            torch_name(ind.dtype)
        ));
    }
    let r = x.shape.len();
    let rank_msg = format!(
        "Input to max_unpooling{n}d should be a {}d or {}d Tensor, but got a tensor with {r} dimensions.",
        n + 1,
        n + 2
    );
    if n == 2 {
        if os.len() != 2 {
            return err(format!("There should be exactly two elements (height, width) in output_size, but got {} elements.", os.len()));
        }
        if r != 3 && r != 4 {
            return err(rank_msg);
        }
    } else {
        if r != 4 && r != 5 {
            return err(rank_msg);
        }
        if os.len() != 3 {
            return err(format!("There should be exactly three elements (depth, height, width) in output_size, but got {} elements.", os.len()));
        }
        for what in ["stride", "padding"] {
            let l = c.args.ints(what)?.len();
            if l != 3 {
                return err(format!("There should be exactly three elements (depth, height, width) in {what}, but got: {l} elements."));
            }
        }
    }
    if x.shape != ind.shape {
        return err(format!(
            "Expected shape of indices to be same as that of the input tensor ({}) but got indices tensor with shape: {}",
            shape_str(&x.shape),
            shape_str(&ind.shape)
        ));
    }
    check_nonempty(&format!("max_unpooling{n}d_forward_out_cpu"), &x.shape, 1)?;
    if n == 3 {
        let st = c.args.ints("stride")?;
        if st.iter().any(|v| *v <= 0) {
            return err(format!(
                "strides should be greater than zero, but got stride: {}",
                shape_str(&st)
            ));
        }
    }
    if os.iter().any(|v| *v < 0) {
        if n == 2 {
            return err(format!("max_unpooling2d(): output_size must contain non-negative spatial dimensions, but got output_size={}", shape_str(&os)));
        }
        return decline("max_unpool3d: negative output size");
    }
    float_input(&x, "max_unpool")?;
    let lead = &x.shape[..r - n];
    let want: Vec<i64> = lead.iter().chain(&os).copied().collect();
    if numel(&want) == 0 || numel(&x.shape) == 0 {
        return Ok(empty_outs(c.b, &[x.dtype], &want));
    }
    let planes = numel(lead);
    let (l, vol) = (numel(&x.shape[r - n..]), numel(&os));
    let m = planes * l;
    // 1-d unpooling reaches here as 2-d with a width of 1, and the CPU's message says so.
    let sizes: Vec<String> = os.iter().map(|v| v.to_string()).collect();
    c.check_range(
        ind.value,
        0,
        vol,
        ErrorKind::Runtime,
        format!(
            "Found an invalid max index: {{index}} (output volumes are of size {})",
            sizes.join("x")
        ),
    );
    let b = &mut *c.b;
    // The position of the winning input element per output slot (-1: none), then its value.
    let pos = b.iota(DType::I64, &[planes, l], 1);
    let pos = b.reshape(pos, &[m]);
    let plane = b.iota(DType::I64, &[planes, l], 0);
    let plane = b.reshape(plane, &[m, 1]);
    let idx = b.reshape(ind.value, &[m, 1]);
    let both = b.concatenate(&[plane, idx], 1);
    let none = b.full(DType::I64, &[planes, vol], -1.0);
    let win = b.scatter(none, both, pos, &[], &[0, 1], &[0, 1], 1, |b, a, u| {
        b.max(a, u)
    });
    let zero_i = b.splat(win, 0.0);
    let hit = b.compare(win, zero_i, CmpDir::Ge);
    let safe = b.max(win, zero_i);
    let base = b.iota(DType::I64, &[planes, vol], 0);
    let lk = b.splat(base, l as f64);
    let base = b.mul(base, lk);
    let flat = b.add(base, safe);
    let flat = b.reshape(flat, &[planes * vol, 1]);
    let xf = b.reshape(x.value, &[m]);
    let got = b.gather(xf, flat, &[], &[0], &[0], 1, &[1]);
    let got = b.reshape(got, &[planes, vol]);
    let zero = b.full(x.dtype, &[planes, vol], 0.0);
    let y = b.select(hit, got, zero);
    Ok(vec![Out::T(b.reshape(y, &want))])
}

pub const RULES: &[(&str, Rule)] = &[
    ("aten::max_pool2d_with_indices", |c| max_pool(c, 2)),
    ("aten::max_pool3d_with_indices", |c| max_pool(c, 3)),
    ("aten::max_pool2d_with_indices_backward", |c| {
        max_pool_backward(c, 2)
    }),
    ("aten::max_pool3d_with_indices_backward", |c| {
        max_pool_backward(c, 3)
    }),
    ("aten::fractional_max_pool2d", |c| fractional_max_pool(c, 2)),
    ("aten::fractional_max_pool3d", |c| fractional_max_pool(c, 3)),
    ("aten::fractional_max_pool2d_backward", |c| {
        fractional_max_pool_backward(c, 2)
    }),
    ("aten::fractional_max_pool3d_backward", |c| {
        fractional_max_pool_backward(c, 3)
    }),
    ("aten::avg_pool2d", |c| avg_pool(c, 2)),
    ("aten::avg_pool3d", |c| avg_pool(c, 3)),
    ("aten::avg_pool2d_backward", |c| avg_pool_backward(c, 2)),
    ("aten::avg_pool3d_backward", |c| avg_pool_backward(c, 3)),
    ("aten::_adaptive_avg_pool2d", |c| adaptive_avg_pool(c, 2)),
    ("aten::_adaptive_avg_pool3d", |c| adaptive_avg_pool(c, 3)),
    ("aten::_adaptive_avg_pool2d_backward", |c| {
        adaptive_avg_pool_backward(c, 2)
    }),
    ("aten::_adaptive_avg_pool3d_backward", |c| {
        adaptive_avg_pool_backward(c, 3)
    }),
    ("aten::adaptive_max_pool2d", |c| adaptive_max_pool(c, 2)),
    ("aten::adaptive_max_pool3d", |c| adaptive_max_pool(c, 3)),
    ("aten::adaptive_max_pool2d_backward", |c| {
        adaptive_max_pool_backward(c, 2)
    }),
    ("aten::adaptive_max_pool3d_backward", |c| {
        adaptive_max_pool_backward(c, 3)
    }),
    ("aten::max_unpool2d", |c| max_unpool(c, 2)),
    ("aten::max_unpool3d", |c| max_unpool(c, 3)),
];
