//! Strided views over a flat storage, expressed as StableHLO.
//!
//! A storage is one flat device buffer; a tensor is (sizes, strides, offset) over it, as in
//! PyTorch. Reading a view becomes slice/reshape/transpose/broadcast when the strides nest
//! (contiguous, permuted, stepped, expanded views: nearly all of them) and a gather
//! otherwise. Writing a view is a full replacement, a dynamic_update_slice of a contiguous
//! range, or a scatter.

use stablehlo::{Builder, DType, TensorType, Value};

/// Where a tensor lives inside its storage.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct View {
    pub sizes: Vec<i64>,
    pub strides: Vec<i64>,
    pub offset: i64,
}

impl View {
    pub fn numel(&self) -> i64 {
        self.sizes.iter().product()
    }

    pub fn is_contiguous(&self) -> bool {
        let mut expect = 1;
        for i in (0..self.sizes.len()).rev() {
            if self.sizes[i] != 1 && self.strides[i] != expect {
                return false;
            }
            expect *= self.sizes[i];
        }
        true
    }

    /// True if the view is exactly the whole storage of `n` elements, in order.
    pub fn is_whole(&self, n: i64) -> bool {
        self.offset == 0 && self.numel() == n && self.is_contiguous()
    }
}

/// Reads `view` out of `flat` (a 1-d value of the storage's elements).
/// A flat storage value read as `to` elements, on the device: a bitcast between types of
/// one size, or a complex type as the (real, imag) pairs of its part type and back
/// (`view_as_real`/`view_as_complex`). None for other pairs.
pub fn retype_flat(b: &mut Builder, v: Value, to: DType) -> Option<Value> {
    let from = b.dtype(v);
    let n = b.shape(v)[0];
    if from == to {
        return Some(v);
    }
    if from.size() == to.size() && !from.is_complex() && !to.is_complex() {
        return Some(b.bitcast_convert(v, to));
    }
    if from.is_complex() && to == from.real_part() {
        let pairs = b.complex_to_pairs(v);
        return Some(b.reshape(pairs, &[2 * n]));
    }
    if to.is_complex() && from == to.real_part() && n % 2 == 0 {
        let pairs = b.reshape(v, &[n / 2, 2]);
        return Some(b.pairs_to_complex(pairs));
    }
    None
}

pub fn read(b: &mut Builder, flat: Value, view: &View) -> Value {
    let n = b.shape(flat)[0];
    let dtype = b.dtype(flat);
    if view.numel() == 0 {
        return b.full(dtype, &view.sizes, 0.0);
    }
    if view.is_contiguous() {
        let x = if view.is_whole(n) {
            flat
        } else {
            b.slice(flat, &[view.offset], &[view.offset + view.numel()], &[1])
        };
        return b.reshape(x, &view.sizes);
    }
    nested_read(b, flat, view).unwrap_or_else(|| gather_read(b, flat, view))
}

/// Slice/reshape/transpose/broadcast form of a view whose strides nest.
fn nested_read(b: &mut Builder, flat: Value, view: &View) -> Option<Value> {
    let n = b.shape(flat)[0];
    // Dims that address memory: size > 1 and stride > 0.
    let mut real: Vec<usize> = (0..view.sizes.len())
        .filter(|&i| view.sizes[i] > 1 && view.strides[i] > 0)
        .collect();
    if view
        .sizes
        .iter()
        .zip(&view.strides)
        .any(|(s, st)| *s > 1 && *st < 0)
    {
        return None;
    }
    real.sort_by(|a, c| view.strides[*c].cmp(&view.strides[*a]));
    for w in real.windows(2) {
        let (outer, inner) = (w[0], w[1]);
        let (so, si) = (view.strides[outer], view.strides[inner]);
        if so % si != 0 || so < si * view.sizes[inner] {
            return None;
        }
    }
    // Base block: [size_0, s0/s1, ..., s_{k-1}/s_k, s_k] starting at offset.
    let mut base = Vec::new();
    let mut take = Vec::new();
    for (j, &d) in real.iter().enumerate() {
        let extent = if j == 0 {
            view.sizes[d]
        } else {
            view.strides[real[j - 1]] / view.strides[d]
        };
        base.push(extent);
        take.push(view.sizes[d]);
    }
    let inner = real.last().map(|&d| view.strides[d]).unwrap_or(1);
    base.push(inner);
    take.push(1);
    let span: i64 = base.iter().product();
    let end = view.offset + span;
    let mut x = b.slice(flat, &[view.offset], &[end.min(n)], &[1]);
    if end > n {
        let z = b.constant(b.dtype(flat), 0.0);
        x = b.pad(x, z, &[0], &[end - n], &[0]);
    }
    let x = b.reshape(x, &base);
    let zeros = vec![0; base.len()];
    let ones = vec![1; base.len()];
    let x = b.slice(x, &zeros, &take, &ones);
    let sorted_sizes: Vec<i64> = real.iter().map(|&d| view.sizes[d]).collect();
    let x = b.reshape(x, &sorted_sizes);
    // Back to the original order of the real dims.
    let mut order: Vec<usize> = real.clone();
    order.sort();
    let perm: Vec<i64> = order
        .iter()
        .map(|d| real.iter().position(|r| r == d).unwrap() as i64)
        .collect();
    let x = b.transpose(x, &perm);
    // Re-insert size-1 dims and broadcast stride-0 dims.
    let dims: Vec<i64> = order.iter().map(|d| *d as i64).collect();
    Some(b.broadcast_in_dim(x, &view.sizes, &dims))
}

/// Linear element indices of a view, as an [numel, 1] i64 value.
fn linear_indices(b: &mut Builder, view: &View) -> Value {
    let mut acc = b.full(DType::I64, &view.sizes, view.offset as f64);
    for (d, st) in view.strides.iter().enumerate() {
        if view.sizes[d] > 1 && *st != 0 {
            let io = b.iota(DType::I64, &view.sizes, d);
            let k = b.full(DType::I64, &view.sizes, *st as f64);
            let t = b.mul(io, k);
            acc = b.add(acc, t);
        }
    }
    b.reshape(acc, &[view.numel(), 1])
}

/// `flat[idx]` for an i64 index array `idx` of shape `sizes`.
fn gather_flat(b: &mut Builder, flat: Value, idx: Value, sizes: &[i64]) -> Value {
    let n: i64 = sizes.iter().product();
    let idx = b.reshape(idx, &[n, 1]);
    let dtype = b.dtype(flat);
    let attrs = "dimension_numbers = #stablehlo.gather<collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = array<i64: 1>, indices_are_sorted = false";
    let g = b.op(
        "stablehlo.gather",
        &[flat, idx],
        attrs,
        TensorType::new(dtype, &[n]),
    );
    b.reshape(g, sizes)
}

fn gather_read(b: &mut Builder, flat: Value, view: &View) -> Value {
    let idx = linear_indices(b, view);
    gather_flat(b, flat, idx, &view.sizes)
}

/// Returns `flat` with `view` overwritten by `value` (already of the view's shape and the
/// storage's dtype).
pub fn write(b: &mut Builder, flat: Value, view: &View, value: Value) -> Value {
    let n = b.shape(flat)[0];
    if view.numel() == 0 {
        return flat;
    }
    let v = b.reshape(value, &[view.numel()]);
    if view.is_whole(n) {
        return v;
    }
    if view.is_contiguous() {
        let off = b.constant_i64(DType::I64, view.offset);
        return b.dynamic_update_slice(flat, v, &[off]);
    }
    let idx = linear_indices(b, view);
    let dtype = b.dtype(flat);
    let st = TensorType::scalar(dtype);
    let region = b.region(&[st.clone(), st], |_, a| vec![a[1]]);
    let attrs = "scatter_dimension_numbers = #stablehlo.scatter<inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, indices_are_sorted = false, unique_indices = false";
    let ty = b.ty(flat).clone();
    b.op_regions(
        "stablehlo.scatter",
        &[flat, idx, v],
        &[region],
        attrs,
        &[ty],
    )[0]
}

/// A view from its parts (tests).
#[cfg(test)]
pub(crate) fn view(sizes: &[i64], strides: &[i64], offset: i64) -> View {
    View {
        sizes: sizes.to_vec(),
        strides: strides.to_vec(),
        offset,
    }
}
