//! Ops whose output shape depends on the data (nonzero, masked_select). StableHLO needs
//! static shapes, so these synchronize: the input is read back, the result computed on the
//! host and uploaded. They are listed in the README as synchronizing ops. `equal` returns
//! a Python bool, so it synchronizes too: it compares on the device and reads back one bool.
//! torchvision's `nms` suppresses on the device and reads back the surviving indices.

use std::sync::Arc;

use crate::copy::copy;
use crate::exec::{dispatch, Loc, Outcome, Param, RArg, Ret, TensorRef};
use crate::host::Scalar;
use crate::layout::View;
use crate::storage::Storage;
use crate::{Error, Result, Runtime};
use lowering::shape::{broadcast_shapes, contiguous_strides, shape_str};
use stablehlo::DType;

type HostOp = fn(&Runtime, &[Param]) -> Result<Vec<Ret>>;

/// Ops handled here instead of by a lowering rule.
pub fn find(op: &str, params: &[Param]) -> Option<HostOp> {
    match op {
        "aten::nonzero" => Some(nonzero),
        "aten::masked_select" => Some(masked_select),
        "aten::equal" => Some(equal),
        "torchvision::nms" if nms_native(params) => Some(nms),
        "aten::_assert_async" => Some(assert_async),
        "aten::_unique" | "aten::_unique2" => Some(unique_sorted),
        "aten::repeat_interleave" => Some(repeat_interleave),
        "aten::bincount" => Some(bincount),
        "aten::unique_consecutive" if int_param(params, "dim").is_none() => {
            Some(unique_consecutive)
        }
        "aten::unique_consecutive" | "aten::unique_dim_consecutive" => Some(unique_dim_consecutive),
        "aten::unique_dim" => Some(unique_dim_sorted),
        _ => None,
    }
}

fn tensor<'a>(params: &'a [Param], name: &str) -> Result<&'a TensorRef> {
    params
        .iter()
        .find(|p| p.name == name)
        .and_then(|p| match &p.arg {
            RArg::Tensor(t) => Some(t),
            _ => None,
        })
        .ok_or_else(|| Error::runtime(format!("missing tensor argument {name}")))
}

/// The view's elements, contiguous, in `dtype`, on the host.
fn host_bytes(rt: &Runtime, t: &TensorRef, sizes: &[i64], dtype: DType) -> Result<Vec<u8>> {
    let n: i64 = sizes.iter().product();
    let mut bytes = vec![0u8; (n.max(1) as usize) * dtype.size()];
    let dst = TensorRef {
        loc: Loc::Host(bytes.as_mut_ptr()),
        dtype: Some(dtype),
        view: View {
            sizes: sizes.to_vec(),
            strides: contiguous_strides(sizes),
            offset: 0,
        },
        nbytes: bytes.len() as i64,
        wrapped: false,
        device: 0,
    };
    if n > 0 {
        copy(rt, t, &dst)?;
    }
    bytes.truncate(n as usize * dtype.size());
    Ok(bytes)
}

fn new_tensor(
    rt: &Runtime,
    bytes: &[u8],
    dtype: DType,
    sizes: Vec<i64>,
    device: usize,
) -> Result<Ret> {
    let n: i64 = sizes.iter().product();
    let buf = rt.upload(bytes, dtype, &[n], device)?;
    let s = Storage::with_buffer(Arc::new(buf), dtype, device);
    Ok(Ret::Tensor {
        handle: s.into_handle(),
        dtype,
        sizes,
        device,
    })
}

/// The coordinates of the nonzero bytes of a contiguous `mask` of `sizes`, one column per
/// dim, in row-major order.
fn coords(mask: &[u8], sizes: &[i64]) -> Vec<Vec<i64>> {
    let strides = contiguous_strides(sizes);
    let mut cols = vec![Vec::new(); sizes.len()];
    for (i, _) in mask.iter().enumerate().filter(|(_, m)| **m != 0) {
        for (d, st) in strides.iter().enumerate() {
            cols[d].push((i as i64 / st) % sizes[d].max(1));
        }
    }
    cols
}

fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// i64 elements from their bytes.
fn ints_of(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks(8)
        .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect()
}

/// An integer tensor's elements, read back as i64.
fn host_ints(rt: &Runtime, t: &TensorRef) -> Result<Vec<i64>> {
    Ok(ints_of(&host_bytes(rt, t, &t.view.sizes, DType::I64)?))
}

/// An optional int argument.
fn int_param(params: &[Param], name: &str) -> Option<i64> {
    params.iter().find_map(|p| match (&p.arg, p.name == name) {
        (RArg::Int(n), true) => Some(*n),
        _ => None,
    })
}

fn nonzero(rt: &Runtime, params: &[Param]) -> Result<Vec<Ret>> {
    let t = tensor(params, "self")?;
    let sizes = t.view.sizes.clone();
    // Read as bool: "element != 0" with PyTorch's semantics for -0.0 and NaN.
    let mask = host_bytes(rt, t, &sizes, DType::Bool)?;
    let cols = coords(&mask, &sizes);
    let count = cols
        .first()
        .map_or(mask.iter().filter(|m| **m != 0).count(), Vec::len);
    let out: Vec<i64> = (0..count)
        .flat_map(|i| cols.iter().map(move |c| c[i]))
        .collect();
    Ok(vec![new_tensor(
        rt,
        &i64_bytes(&out),
        DType::I64,
        vec![count as i64, sizes.len() as i64],
        t.device,
    )?])
}

/// A shape rule's error (PyTorch's type and message) as the runtime's.
fn lower_err(e: lowering::LowerError) -> Error {
    match e {
        lowering::LowerError::User(k, msg) => Error::new(k, msg),
        lowering::LowerError::Declined(w) => Error::runtime(w),
    }
}

fn masked_select(rt: &Runtime, params: &[Param]) -> Result<Vec<Ret>> {
    let t = tensor(params, "self")?;
    let m = tensor(params, "mask")?;
    let dtype = t
        .dtype
        .ok_or_else(|| Error::runtime("masked_select: unsupported dtype"))?;
    let shape = broadcast_shapes(&t.view.sizes, &m.view.sizes).map_err(lower_err)?;
    let values = host_bytes(rt, &expand(t, &shape), &shape, dtype)?;
    let mask = host_bytes(rt, &expand(m, &shape), &shape, DType::Bool)?;
    let k = dtype.size();
    let mut out = Vec::new();
    for (i, b) in mask.iter().enumerate() {
        if *b != 0 {
            out.extend_from_slice(&values[i * k..(i + 1) * k]);
        }
    }
    let n = (out.len() / k) as i64;
    let device = if matches!(t.loc, Loc::Device(_)) {
        t.device
    } else {
        m.device
    };
    Ok(vec![new_tensor(rt, &out, dtype, vec![n], device)?])
}

/// `repeat_interleave(repeats)`: index `i` repeated `repeats[i]` times, in repeats' dtype
/// (`x.repeat_interleave(r, dim)` is this, then `index_select`).
fn repeat_interleave(rt: &Runtime, params: &[Param]) -> Result<Vec<Ret>> {
    let r = tensor(params, "repeats")?;
    let dtype = r
        .dtype
        .ok_or_else(|| Error::runtime("repeat_interleave: unsupported dtype"))?;
    if r.view.sizes.len() != 1 {
        return Err(Error::runtime(
            "repeat_interleave only accept 1D vector as repeat",
        ));
    }
    if !matches!(dtype, DType::I32 | DType::I64) {
        return Err(Error::new(
            crate::ErrorKind::NotImplemented,
            format!(
                "\"repeat_interleave\" not implemented for '{}'",
                lowering::promote::torch_name(dtype)
            ),
        ));
    }
    let counts = host_ints(rt, r)?;
    if counts.iter().any(|c| *c < 0) {
        return Err(Error::runtime("repeats can not be negative"));
    }
    let total: i64 = counts.iter().sum();
    if int_param(params, "output_size").is_some_and(|n| n != total) {
        return Err(Error::runtime(
            "allocated size does not match required size",
        ));
    }
    let mut out = Vec::with_capacity(total as usize * dtype.size());
    for (i, c) in counts.iter().enumerate() {
        for _ in 0..*c {
            match dtype {
                DType::I32 => out.extend_from_slice(&(i as i32).to_le_bytes()),
                _ => out.extend_from_slice(&(i as i64).to_le_bytes()),
            }
        }
    }
    Ok(vec![new_tensor(rt, &out, dtype, vec![total], r.device)?])
}

/// `bincount`: counts (int64), or sums of `weights` per value, accumulated in input order in
/// the result dtype as on the CPU (float32 weights sum in float32, others in float64).
fn bincount(rt: &Runtime, params: &[Param]) -> Result<Vec<Ret>> {
    let t = tensor(params, "self")?;
    let dtype = t
        .dtype
        .ok_or_else(|| Error::runtime("bincount: unsupported dtype"))?;
    if dtype.is_float() || dtype == DType::Bool {
        return Err(Error::new(
            crate::ErrorKind::NotImplemented,
            format!(
                "\"bincount\" not implemented for '{}'",
                lowering::promote::torch_name(dtype)
            ),
        ));
    }
    let minlength = int_param(params, "minlength").unwrap_or(0);
    if minlength < 0 {
        return Err(Error::runtime("minlength should be >= 0"));
    }
    let n = t.view.sizes.iter().product::<i64>();
    if t.view.sizes.len() == 1 && n == 0 {
        return Ok(vec![new_tensor(
            rt,
            &vec![0u8; minlength as usize * 8],
            DType::I64,
            vec![minlength],
            t.device,
        )?]);
    }
    let values = if t.view.sizes.len() == 1 {
        host_ints(rt, t)?
    } else {
        Vec::new()
    };
    if t.view.sizes.len() != 1 || values.iter().any(|v| *v < 0) {
        return Err(Error::runtime(
            "bincount only supports 1-d non-negative integral inputs.",
        ));
    }
    let len = (values.iter().max().map_or(0, |m| m + 1)).max(minlength);
    let weights = params.iter().find_map(|p| match (p.name.as_str(), &p.arg) {
        ("weights", RArg::Tensor(w)) => Some(w),
        _ => None,
    });
    let Some(w) = weights else {
        let mut counts = vec![0i64; len as usize];
        for v in &values {
            counts[*v as usize] += 1;
        }
        return Ok(vec![new_tensor(
            rt,
            &i64_bytes(&counts),
            DType::I64,
            vec![len],
            t.device,
        )?]);
    };
    if w.view.sizes != [n] {
        return Err(Error::runtime(
            "weights should be 1-d and have the same length as input",
        ));
    }
    let wdt = w
        .dtype
        .ok_or_else(|| Error::runtime("bincount: unsupported weights dtype"))?;
    let wb = host_bytes(rt, w, &w.view.sizes, wdt)?;
    let ws: Vec<f64> = wb
        .chunks(wdt.size())
        .map(|b| match crate::host::scalar(b, wdt) {
            crate::host::Scalar::Float(f) => f,
            crate::host::Scalar::Int(i) => i as f64,
            crate::host::Scalar::Complex(re, _) => re,
        })
        .collect();
    let out: Vec<u8> = if wdt == DType::F32 {
        let mut acc = vec![0f32; len as usize];
        for (v, x) in values.iter().zip(&ws) {
            acc[*v as usize] += *x as f32;
        }
        acc.iter().flat_map(|a| a.to_le_bytes()).collect()
    } else {
        let mut acc = vec![0f64; len as usize];
        for (v, x) in values.iter().zip(&ws) {
            acc[*v as usize] += *x;
        }
        acc.iter().flat_map(|a| a.to_le_bytes()).collect()
    };
    let odt = if wdt == DType::F32 {
        DType::F32
    } else {
        DType::F64
    };
    Ok(vec![new_tensor(rt, &out, odt, vec![len], t.device)?])
}

fn flag(params: &[Param], name: &str) -> bool {
    params
        .iter()
        .any(|p| p.name == name && matches!(p.arg, RArg::Bool(true)))
}

/// unique's sort order: NaNs last (equal among themselves), numbers by value.
fn host_order(a: &Scalar, b: &Scalar) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    match (a, b) {
        (Scalar::Float(x), Scalar::Float(y)) => match (x.is_nan(), y.is_nan()) {
            (true, true) => Ordering::Equal,
            (true, false) => Ordering::Greater,
            (false, true) => Ordering::Less,
            _ => x.partial_cmp(y).unwrap_or(Ordering::Equal),
        },
        (Scalar::Int(x), Scalar::Int(y)) => x.cmp(y),
        _ => Ordering::Equal,
    }
}

/// unique's grouping: `==`, so every NaN is a value of its own.
fn host_same(a: &Scalar, b: &Scalar) -> bool {
    match (a, b) {
        (Scalar::Float(x), Scalar::Float(y)) => x == y,
        (Scalar::Int(x), Scalar::Int(y)) => x == y,
        _ => false,
    }
}

/// The runs of equal neighbours in `order`: (each run's first index, each index's run,
/// each run's length).
fn groups(
    order: &[usize],
    same: impl Fn(usize, usize) -> bool,
) -> (Vec<usize>, Vec<i64>, Vec<i64>) {
    let mut firsts = Vec::new();
    let mut inverse = vec![0i64; order.len()];
    let mut counts: Vec<i64> = Vec::new();
    for (pos, i) in order.iter().enumerate() {
        if pos == 0 || !same(order[pos - 1], *i) {
            firsts.push(*i);
            counts.push(0);
        }
        *counts.last_mut().expect("a group was started") += 1;
        inverse[*i] = counts.len() as i64 - 1;
    }
    (firsts, inverse, counts)
}

/// `torch.unique`: sorted whatever `sorted` says (as on the CPU), NaNs last and each its own
/// value, -0.0 and 0.0 one value (the first in a stable sort).
fn unique_sorted(rt: &Runtime, params: &[Param]) -> Result<Vec<Ret>> {
    unique(rt, params, true)
}

/// `unique_consecutive` over the flattened tensor.
fn unique_consecutive(rt: &Runtime, params: &[Param]) -> Result<Vec<Ret>> {
    unique(rt, params, false)
}

/// Values, inverse indices (self's shape, empty unless asked) and counts (empty unless
/// asked; `_unique` returns no counts), computed on the host.
fn unique(rt: &Runtime, params: &[Param], sort: bool) -> Result<Vec<Ret>> {
    let t = tensor(params, "self")?;
    let dtype = t
        .dtype
        .ok_or_else(|| Error::runtime("unique: unsupported dtype"))?;
    let sizes = t.view.sizes.clone();
    let bytes = host_bytes(rt, t, &sizes, dtype)?;
    let k = dtype.size();
    let vals: Vec<Scalar> = bytes
        .chunks(k)
        .map(|b| crate::host::scalar(b, dtype))
        .collect();
    let mut order: Vec<usize> = (0..vals.len()).collect();
    if sort {
        order.sort_by(|a, b| host_order(&vals[*a], &vals[*b]));
    }
    let (firsts, inverse, counts) = groups(&order, |a, b| host_same(&vals[a], &vals[b]));
    let out: Vec<u8> = firsts
        .iter()
        .flat_map(|i| bytes[i * k..(i + 1) * k].iter().copied())
        .collect();
    let n = counts.len() as i64;
    let mut rets = vec![new_tensor(rt, &out, dtype, vec![n], t.device)?];
    rets.push(if flag(params, "return_inverse") {
        new_tensor(rt, &i64_bytes(&inverse), DType::I64, sizes, t.device)?
    } else {
        new_tensor(rt, &[], DType::I64, vec![0], t.device)?
    });
    if params.iter().any(|p| p.name == "return_counts") {
        rets.push(if flag(params, "return_counts") {
            new_tensor(rt, &i64_bytes(&counts), DType::I64, vec![n], t.device)?
        } else {
            new_tensor(rt, &[], DType::I64, vec![0], t.device)?
        });
    }
    Ok(rets)
}

/// `unique(dim=)`: the distinct slices along `dim`, sorted (whatever `sorted` says, as on
/// the CPU).
fn unique_dim_sorted(rt: &Runtime, params: &[Param]) -> Result<Vec<Ret>> {
    unique_dim(rt, params, true)
}

/// `unique_consecutive(dim=)`: runs of equal adjacent slices along `dim` become one.
fn unique_dim_consecutive(rt: &Runtime, params: &[Param]) -> Result<Vec<Ret>> {
    unique_dim(rt, params, false)
}

/// Slices along `dim` compared whole, computed on the host: (values, inverse indices over
/// the dim, counts), inverse and counts always filled as the CPU kernel does. Sorting is
/// lexicographic with NaNs last; equal means every element `==`, so a slice holding a NaN
/// is its own group.
fn unique_dim(rt: &Runtime, params: &[Param], sort: bool) -> Result<Vec<Ret>> {
    let t = tensor(params, "self")?;
    let dtype = t
        .dtype
        .ok_or_else(|| Error::runtime("unique: unsupported dtype"))?;
    let sizes = t.view.sizes.clone();
    let r = sizes.len() as i64;
    let d = int_param(params, "dim").unwrap_or(0);
    if r == 0 {
        return Err(Error::new(
            crate::ErrorKind::Index,
            format!("Dimension specified as {d} but tensor has no dimensions"),
        ));
    }
    let dim = lowering::shape::wrap_dim(d, r as usize).map_err(lower_err)?;
    let empty_dims = sizes.iter().filter(|s| **s == 0).count();
    if empty_dims > 1 {
        return Err(Error::runtime(
            "Number of zero sized dimensions is more than one, so unique cannot be applied ",
        ));
    }
    if empty_dims == 1 && sizes[dim] != 0 {
        return Err(Error::runtime(
            "There are 0 sized dimensions, and they aren't selected, so unique cannot be applied",
        ));
    }
    let k = dtype.size();
    let bytes = host_bytes(rt, t, &sizes, dtype)?;
    let n = sizes[dim] as usize;
    let inner: usize = sizes[dim + 1..].iter().product::<i64>() as usize;
    let outer: usize = sizes[..dim].iter().product::<i64>() as usize;
    // Slice i's elements (row-major over the other dims) as scalars and raw bytes.
    let elem = |i: usize, j: usize| (j / inner) * n * inner + i * inner + j % inner;
    let per = outer * inner;
    let vals: Vec<Vec<Scalar>> = (0..n)
        .map(|i| {
            (0..per)
                .map(|j| {
                    let e = elem(i, j);
                    crate::host::scalar(&bytes[e * k..(e + 1) * k], dtype)
                })
                .collect()
        })
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    if sort {
        order.sort_by(|a, b| {
            vals[*a]
                .iter()
                .zip(&vals[*b])
                .map(|(x, y)| host_order(x, y))
                .find(|o| o.is_ne())
                .unwrap_or(std::cmp::Ordering::Equal)
        });
    }
    let (firsts, inverse, counts) = groups(&order, |a, b| {
        vals[a].iter().zip(&vals[b]).all(|(x, y)| host_same(x, y))
    });
    let u = firsts.len();
    let mut osizes = sizes.clone();
    osizes[dim] = u as i64;
    let mut out = vec![0u8; u * per * k];
    for (g, i) in firsts.iter().enumerate() {
        for j in 0..per {
            let (src, dst) = (elem(*i, j), (j / inner) * u * inner + g * inner + j % inner);
            out[dst * k..(dst + 1) * k].copy_from_slice(&bytes[src * k..(src + 1) * k]);
        }
    }
    Ok(vec![
        new_tensor(rt, &out, dtype, osizes, t.device)?,
        new_tensor(
            rt,
            &i64_bytes(&inverse),
            DType::I64,
            vec![n as i64],
            t.device,
        )?,
        new_tensor(
            rt,
            &i64_bytes(&counts),
            DType::I64,
            vec![u as i64],
            t.device,
        )?,
    ])
}

/// The ops whose `indices` may hold boolean masks.
fn mask_indexed(op: &str) -> bool {
    matches!(
        op,
        "aten::index"
            | "aten::index_put"
            | "aten::index_put_"
            | "aten::_index_put_impl"
            | "aten::_index_put_impl_"
    )
}

/// Index tensors made for one call, kept alive until it returns.
pub type Made = Vec<Arc<Storage>>;

/// `params` with each boolean (or uint8) mask in `indices` replaced by the long index
/// tensors of its nonzero elements, one per mask dim, as PyTorch does before indexing.
/// The mask is read back: like `nonzero`, this synchronizes. None when no mask is given.
pub fn expand_masks(
    rt: &Runtime,
    op: &str,
    params: &[Param],
) -> Result<Option<(Vec<Param>, Made)>> {
    if !mask_indexed(op) {
        return Ok(None);
    }
    let Some(pos) = params.iter().position(|p| p.name == "indices") else {
        return Ok(None);
    };
    let RArg::List(list) = &params[pos].arg else {
        return Ok(None);
    };
    // A 0-d mask (`x[True]`) adds a dim instead: left to the fallback.
    let is_mask = |a: &RArg| {
        matches!(a, RArg::Tensor(t) if matches!(t.dtype, Some(DType::Bool | DType::U8))
            && !t.view.sizes.is_empty())
    };
    if !list.iter().any(is_mask) {
        return Ok(None);
    }
    let me = tensor(params, "self")?;
    let shape = &me.view.sizes;
    let mut made = Made::new();
    let mut out = Vec::new();
    for a in list {
        let RArg::Tensor(m) = a else {
            out.push(a.clone());
            continue;
        };
        if !is_mask(a) {
            out.push(a.clone());
            continue;
        }
        let dim = out.len();
        for (j, d) in m.view.sizes.iter().enumerate() {
            if shape.get(dim + j) != Some(d) {
                return Err(Error::new(
                    crate::ErrorKind::Index,
                    format!(
                        "The shape of the mask {} at index {j} does not match the shape of the indexed tensor {} at index {}",
                        shape_str(&m.view.sizes),
                        shape_str(shape),
                        dim + j
                    ),
                ));
            }
        }
        let sizes = m.view.sizes.clone();
        let mask = match m.loc {
            // SAFETY: PyTorch keeps the CPU mask alive during the call and its view is inside
            // its storage; bool and uint8 elements are one byte.
            Loc::Host(p) => unsafe { crate::host::read(p, &m.view, 1) },
            Loc::Device(_) => host_bytes(rt, m, &sizes, DType::Bool)?,
        };
        for col in coords(&mask, &sizes) {
            let n = col.len() as i64;
            let buf = rt.upload(&i64_bytes(&col), DType::I64, &[n], me.device)?;
            let st = Arc::new(Storage::with_buffer(Arc::new(buf), DType::I64, me.device));
            out.push(RArg::Tensor(TensorRef {
                loc: Loc::Device(Arc::as_ptr(&st)),
                dtype: Some(DType::I64),
                view: View {
                    sizes: vec![n],
                    strides: vec![1],
                    offset: 0,
                },
                nbytes: n * 8,
                wrapped: false,
                device: me.device,
            }));
            made.push(st);
        }
    }
    let mut expanded = params.to_vec();
    expanded[pos].arg = RArg::List(out);
    Ok(Some((expanded, made)))
}

/// The tensor viewed with broadcast strides (stride 0 on expanded dims).
fn expand(t: &TensorRef, shape: &[i64]) -> TensorRef {
    let off = shape.len() - t.view.sizes.len();
    let mut strides = vec![0; shape.len()];
    for (i, (s, st)) in t.view.sizes.iter().zip(&t.view.strides).enumerate() {
        strides[off + i] = if *s == shape[off + i] { *st } else { 0 };
    }
    let mut e = t.clone();
    e.view = View {
        sizes: shape.to_vec(),
        strides,
        offset: t.view.offset,
    };
    e
}

/// Runs the rule `op` on the device and reads its one result back as `dtype`, contiguous.
fn device_result(rt: &Runtime, op: &str, params: &[Param], dtype: DType) -> Result<Vec<u8>> {
    let rets = match dispatch(rt, op, "", params)? {
        Outcome::Done(r) => r,
        Outcome::Declined(w) => return Err(Error::runtime(format!("{op}: {w}"))),
        Outcome::Resize(_) => return Err(Error::runtime(format!("{op}: unexpected resize"))),
    };
    let Some(Ret::Tensor {
        handle,
        sizes,
        device,
        dtype: got,
    }) = rets.into_iter().next()
    else {
        return Err(Error::runtime(format!("{op} returned no tensor")));
    };
    // SAFETY: dispatch returns a fresh handle whose reference we now own.
    let storage = unsafe { Storage::from_handle(handle) };
    let t = TensorRef {
        loc: Loc::Device(Arc::as_ptr(&storage)),
        dtype: Some(got),
        view: View {
            strides: contiguous_strides(&sizes),
            sizes: sizes.clone(),
            offset: 0,
        },
        nbytes: sizes.iter().product::<i64>() * got.size() as i64,
        wrapped: false,
        device,
    };
    host_bytes(rt, &t, &sizes, dtype)
}

/// `torch.equal`: the lowering `torch_pjrt::equal` gives a 0-d bool on the device.
fn equal(rt: &Runtime, params: &[Param]) -> Result<Vec<Ret>> {
    let b = device_result(rt, "torch_pjrt::equal", params, DType::Bool)?;
    Ok(vec![Ret::Bool(b.first().is_some_and(|v| *v != 0))])
}

/// The dtypes the `nms` rule takes (the lowering decides); others go to torchvision's CPU
/// kernel and its error.
fn nms_native(params: &[Param]) -> bool {
    let dt = |n| tensor(params, n).ok().and_then(|t| t.dtype);
    matches!((dt("dets"), dt("scores")), (Some(d), Some(s)) if lowering::rules::detection::nms_takes(d, s))
}

/// `torchvision::nms`: the rule `torch_pjrt::nms_keep` ranks and suppresses on the device;
/// the kept indices (their count is the data's) are read back and uploaded, in order.
fn nms(rt: &Runtime, params: &[Param]) -> Result<Vec<Ret>> {
    let device = tensor(params, "dets")?.device;
    let ranked = device_result(rt, "torch_pjrt::nms_keep", params, DType::I64)?;
    let kept: Vec<i64> = ints_of(&ranked).into_iter().filter(|i| *i >= 0).collect();
    let count = kept.len() as i64;
    Ok(vec![new_tensor(
        rt,
        &i64_bytes(&kept),
        DType::I64,
        vec![count],
        device,
    )?])
}

/// `_assert_async(self[, assert_msg])`: raises unless the one element is nonzero. CUDA
/// checks in a kernel and reports at a later synchronization; here the element is read
/// back at once, so the error comes from the call that asserts.
fn assert_async(rt: &Runtime, params: &[Param]) -> Result<Vec<Ret>> {
    let t = tensor(params, "self")?;
    let n: i64 = t.view.sizes.iter().product();
    if n != 1 {
        let what = if n == 0 {
            "no values"
        } else {
            "more than one value"
        };
        return Err(Error::runtime(format!(
            "Boolean value of Tensor with {what} is ambiguous"
        )));
    }
    if host_bytes(rt, t, &t.view.sizes, DType::Bool)?[0] != 0 {
        return Ok(vec![]);
    }
    let msg = params
        .iter()
        .find_map(|p| match (&p.arg, p.name == "assert_msg") {
            (RArg::Str(s), true) => Some(s.as_str()),
            _ => None,
        });
    Err(Error::runtime(match msg {
        None => "Expected Tensor with single nonzero value, but got zero",
        Some("") => "Assertion is failed",
        Some(m) => m,
    }))
}
