//! Typed op helpers: each computes its result type and emits one generic op.

use std::fmt::Write;

use crate::{i64_array, i64_list, Builder, DType, TensorType, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpDir {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

/// The combiner of a `reduce`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceKind {
    Sum,
    Prod,
    Max,
    Min,
    And,
    Or,
    /// Bitwise exclusive or (integers; collectives' BXOR).
    Xor,
}

impl ReduceKind {
    pub fn op_name(self, dtype: DType) -> &'static str {
        match (self, dtype) {
            (ReduceKind::Sum, DType::Bool) | (ReduceKind::Or, _) => "stablehlo.or",
            (ReduceKind::Prod, DType::Bool) | (ReduceKind::And, _) => "stablehlo.and",
            (ReduceKind::Sum, _) => "stablehlo.add",
            (ReduceKind::Prod, _) => "stablehlo.multiply",
            (ReduceKind::Max, _) => "stablehlo.maximum",
            (ReduceKind::Min, _) => "stablehlo.minimum",
            (ReduceKind::Xor, _) => "stablehlo.xor",
        }
    }
    /// The identity element of the combiner.
    pub fn init(self, dtype: DType) -> f64 {
        match self {
            ReduceKind::Sum | ReduceKind::Or | ReduceKind::Xor => 0.0,
            ReduceKind::Prod | ReduceKind::And => 1.0,
            ReduceKind::Max => lowest(dtype),
            ReduceKind::Min => highest(dtype),
        }
    }
}

pub fn lowest(d: DType) -> f64 {
    match d {
        DType::Bool | DType::U8 => 0.0,
        DType::I8 => i8::MIN as f64,
        DType::I16 => i16::MIN as f64,
        DType::I32 => i32::MIN as f64,
        DType::I64 => i64::MIN as f64,
        DType::U32 | DType::U64 => 0.0,
        _ => f64::NEG_INFINITY,
    }
}

pub fn highest(d: DType) -> f64 {
    match d {
        DType::Bool => 1.0,
        DType::U8 => 255.0,
        DType::I8 => i8::MAX as f64,
        DType::I16 => i16::MAX as f64,
        DType::I32 => i32::MAX as f64,
        DType::I64 => i64::MAX as f64,
        DType::U32 => u32::MAX as f64,
        DType::U64 => u64::MAX as f64,
        _ => f64::INFINITY,
    }
}

impl Builder {
    /// A 0-d constant.
    pub fn constant(&mut self, dtype: DType, v: f64) -> Value {
        // Integer literals saturate like `as` casts (i64::MAX survives the trip through f64).
        let lit = dtype.literal(v);
        let ty = TensorType::scalar(dtype);
        let attr = format!("value = dense<{}> : {}", lit, ty.mlir());
        self.op("stablehlo.constant", &[], &attr, ty)
    }

    /// A 0-d complex constant `re + i*im`.
    pub fn constant_complex(&mut self, dtype: DType, re: f64, im: f64) -> Value {
        let ty = TensorType::scalar(dtype);
        let attr = format!(
            "value = dense<{}> : {}",
            dtype.complex_literal(re, im),
            ty.mlir()
        );
        self.op("stablehlo.constant", &[], &attr, ty)
    }

    pub fn constant_i64(&mut self, dtype: DType, v: i64) -> Value {
        let ty = TensorType::scalar(dtype);
        let attr = format!("value = dense<{}> : {}", dtype.int_literal(v), ty.mlir());
        self.op("stablehlo.constant", &[], &attr, ty)
    }

    /// A 1-d i64 constant.
    pub fn constant_vec_i64(&mut self, v: &[i64]) -> Value {
        let ty = TensorType::new(DType::I64, &[v.len() as i64]);
        let attr = format!("value = dense<{}> : {}", i64_list(v), ty.mlir());
        self.op("stablehlo.constant", &[], &attr, ty)
    }

    /// A tensor of `shape` filled with `v`.
    pub fn full(&mut self, dtype: DType, shape: &[i64], v: f64) -> Value {
        let c = self.constant(dtype, v);
        self.broadcast_in_dim(c, shape, &[])
    }

    pub fn unary(&mut self, name: &str, x: Value) -> Value {
        let ty = self.ty(x).clone();
        self.op(name, &[x], "", ty)
    }

    /// An elementwise op over operands of one type.
    pub fn binary(&mut self, name: &str, a: Value, b: Value) -> Value {
        let ty = self.ty(a).clone();
        assert_eq!(&ty, self.ty(b), "{name}: operand types differ");
        self.op(name, &[a, b], "", ty)
    }

    pub fn add(&mut self, a: Value, b: Value) -> Value {
        self.binary("stablehlo.add", a, b)
    }
    pub fn sub(&mut self, a: Value, b: Value) -> Value {
        self.binary("stablehlo.subtract", a, b)
    }
    pub fn mul(&mut self, a: Value, b: Value) -> Value {
        self.binary("stablehlo.multiply", a, b)
    }
    pub fn div(&mut self, a: Value, b: Value) -> Value {
        self.binary("stablehlo.divide", a, b)
    }
    /// C's remainder (the sign of `a`).
    pub fn rem(&mut self, a: Value, b: Value) -> Value {
        self.binary("stablehlo.remainder", a, b)
    }
    /// Maximum that propagates NaN (XLA:CPU's maximum does not), as PyTorch's does.
    pub fn max(&mut self, a: Value, b: Value) -> Value {
        self.combine(ReduceKind::Max, a, b)
    }
    /// Minimum that propagates NaN, as PyTorch's does.
    pub fn min(&mut self, a: Value, b: Value) -> Value {
        self.combine(ReduceKind::Min, a, b)
    }

    /// Applies a reduction combiner; float max/min return NaN if either side is NaN.
    pub fn combine(&mut self, kind: ReduceKind, a: Value, b: Value) -> Value {
        let dtype = self.dtype(a);
        let r = self.binary(kind.op_name(dtype), a, b);
        if !(dtype.is_float() && matches!(kind, ReduceKind::Max | ReduceKind::Min)) {
            return r;
        }
        let a_nan = self.compare(a, a, CmpDir::Ne);
        let r = self.select(a_nan, a, r);
        let b_nan = self.compare(b, b, CmpDir::Ne);
        self.select(b_nan, b, r)
    }
    pub fn and(&mut self, a: Value, b: Value) -> Value {
        self.binary("stablehlo.and", a, b)
    }
    pub fn or(&mut self, a: Value, b: Value) -> Value {
        self.binary("stablehlo.or", a, b)
    }
    pub fn neg(&mut self, a: Value) -> Value {
        self.unary("stablehlo.negate", a)
    }
    pub fn not(&mut self, a: Value) -> Value {
        self.unary("stablehlo.not", a)
    }
    pub fn exp(&mut self, a: Value) -> Value {
        self.unary("stablehlo.exponential", a)
    }
    pub fn log(&mut self, a: Value) -> Value {
        self.unary("stablehlo.log", a)
    }
    pub fn sqrt(&mut self, a: Value) -> Value {
        self.unary("stablehlo.sqrt", a)
    }
    pub fn rsqrt(&mut self, a: Value) -> Value {
        self.unary("stablehlo.rsqrt", a)
    }
    pub fn tanh(&mut self, a: Value) -> Value {
        self.unary("stablehlo.tanh", a)
    }
    /// |a|; the magnitude (a real tensor) for complex `a`.
    pub fn abs(&mut self, a: Value) -> Value {
        let ty = self.ty(a).clone();
        let ty = ty.with_dtype(ty.dtype.real_part());
        self.op("stablehlo.abs", &[a], "", ty)
    }
    pub fn floor(&mut self, a: Value) -> Value {
        self.unary("stablehlo.floor", a)
    }

    /// `x` whose dim `dim` has the real size `n` (an `i32` scalar) within its type's: XLA's
    /// dynamic padder keeps every later op exact on the real part (reductions and
    /// contractions mask the rest). `count` and `convert` know the real size.
    pub fn set_dimension_size(&mut self, x: Value, dim: usize, n: Value) -> Value {
        let ty = self.ty(x).clone();
        let mut sizes = self
            .real_sizes
            .get(&x)
            .cloned()
            .unwrap_or_else(|| vec![None; ty.shape.len()]);
        sizes[dim] = Some(n);
        let v = self.op(
            "stablehlo.set_dimension_size",
            &[x, n],
            &format!("dimension = {dim} : i64"),
            ty,
        );
        self.real_sizes.insert(v, sizes);
        v
    }

    /// `x`, whose dims `sizes` hold the real sizes given (`i32` scalars), as a plain static
    /// array of its padded shape: a program's result then leaves as an ordinary buffer
    /// (padding past the real part of each dim) instead of one carrying XLA's size
    /// metadata. The dims are marked dynamic in a bounded type, then set to their bound,
    /// which XLA takes as static again (with a static operand type it keeps them dynamic).
    pub fn forget_dynamic_sizes(&mut self, x: Value, sizes: &[(usize, Value)]) -> Value {
        let ty = self.ty(x).clone();
        let bounded = |dynamic: &[bool]| {
            let (mut dims, mut bounds) = (String::new(), Vec::new());
            for (d, n) in ty.shape.iter().enumerate() {
                let _ = write!(
                    dims,
                    "{}x",
                    if dynamic[d] {
                        "?".into()
                    } else {
                        n.to_string()
                    }
                );
                bounds.push(if dynamic[d] {
                    n.to_string()
                } else {
                    "?".into()
                });
            }
            format!(
                "tensor<{dims}{}, #stablehlo.bounds<{}>>",
                ty.dtype.mlir(),
                bounds.join(", ")
            )
        };
        let mut dynamic = vec![false; ty.shape.len()];
        let mut cur = x;
        let mut cur_ty = ty.mlir();
        let steps: Vec<(usize, Option<Value>)> = sizes
            .iter()
            .map(|(d, n)| (*d, Some(*n)))
            .chain(sizes.iter().map(|(d, _)| (*d, None)))
            .collect();
        for (d, n) in steps {
            let size = match n {
                Some(n) => {
                    dynamic[d] = true;
                    n
                }
                None => {
                    dynamic[d] = false;
                    self.constant_i64(DType::I32, ty.shape[d])
                }
            };
            let out_ty = if dynamic.iter().any(|x| *x) {
                bounded(&dynamic)
            } else {
                ty.mlir()
            };
            let v = self.fresh(ty.clone());
            let line = format!(
                "{} = \"stablehlo.set_dimension_size\"({}, {}) {{dimension = {d} : i64}} : ({cur_ty}, tensor<i32>) -> {out_ty}",
                Self::name(v),
                Self::name(cur),
                Self::name(size)
            );
            self.line(&line);
            cur = v;
            cur_ty = out_ty;
        }
        cur
    }

    /// Whether dim `dim` of `x` has a real size below its type's (a padded input's dim,
    /// `set_dimension_size`, followed through `convert`).
    pub fn is_dynamic(&self, x: Value, dim: usize) -> bool {
        self.real_sizes
            .get(&x)
            .is_some_and(|r| r.get(dim).is_some_and(Option::is_some))
    }

    /// The number of elements of `x` over `dims`, as a value shaped like `like` (its dtype
    /// and shape): the real sizes of a padded input (`set_dimension_size`, followed through
    /// `convert`), the type's otherwise. MLIR folds `get_dimension_size` of a static type
    /// to its bound, so the sizes come from the parameters that set them.
    pub fn count(&mut self, x: Value, dims: &[i64], like: Value) -> Value {
        let shape = self.shape(x);
        let real = self.real_sizes.get(&x).cloned().unwrap_or_default();
        let mut fixed = 1i64;
        let mut dynamic = Vec::new();
        for d in dims {
            match real.get(*d as usize) {
                Some(Some(s)) => dynamic.push(*s),
                _ => fixed *= shape[*d as usize],
            }
        }
        if dynamic.is_empty() {
            return self.splat(like, fixed as f64);
        }
        let mut n = self.constant(DType::I64, fixed as f64);
        for s in dynamic {
            let s = self.convert(s, DType::I64);
            n = self.mul(n, s);
        }
        let ty = self.ty(like).clone();
        let n = self.convert(n, ty.dtype);
        self.broadcast_to(n, &ty.shape)
    }

    /// A scalar constant broadcast to `like`'s type.
    pub fn splat(&mut self, like: Value, v: f64) -> Value {
        let ty = self.ty(like).clone();
        self.full(ty.dtype, &ty.shape, v)
    }

    pub fn compare(&mut self, a: Value, b: Value, dir: CmpDir) -> Value {
        let ty = self.ty(a).clone();
        assert_eq!(&ty, self.ty(b), "compare: operand types differ");
        let d = match dir {
            CmpDir::Eq => "EQ",
            CmpDir::Ne => "NE",
            CmpDir::Lt => "LT",
            CmpDir::Le => "LE",
            CmpDir::Gt => "GT",
            CmpDir::Ge => "GE",
        };
        let kind = if ty.dtype.is_float() || ty.dtype.is_complex() {
            "FLOAT"
        } else if ty.dtype.is_signed_int() {
            "SIGNED"
        } else {
            "UNSIGNED"
        };
        let attrs = format!(
            "comparison_direction = #stablehlo<comparison_direction {d}>, compare_type = #stablehlo<comparison_type {kind}>"
        );
        self.op(
            "stablehlo.compare",
            &[a, b],
            &attrs,
            ty.with_dtype(DType::Bool),
        )
    }

    /// Whether each element of a floating-point `x` is neither infinite nor NaN.
    pub fn is_finite(&mut self, x: Value) -> Value {
        let ty = self.ty(x).with_dtype(DType::Bool);
        self.op("stablehlo.is_finite", &[x], "", ty)
    }

    pub fn select(&mut self, pred: Value, on_true: Value, on_false: Value) -> Value {
        let ty = self.ty(on_true).clone();
        self.op("stablehlo.select", &[pred, on_true, on_false], "", ty)
    }

    pub fn convert(&mut self, x: Value, dtype: DType) -> Value {
        if self.dtype(x) == dtype {
            return x;
        }
        if dtype == DType::Bool {
            // Conversion to bool is `x != 0`, as in PyTorch.
            let z = self.splat(x, 0.0);
            return self.compare(x, z, CmpDir::Ne);
        }
        let from = self.dtype(x);
        if from.is_complex() && !dtype.is_complex() {
            // PyTorch keeps the real part (and warns, in Python).
            let r = self.real(x);
            return self.convert(r, dtype);
        }
        if dtype.is_complex() && !from.is_complex() && from != dtype.real_part() {
            let r = self.convert(x, dtype.real_part());
            return self.convert(r, dtype);
        }
        let ty = self.ty(x).with_dtype(dtype);
        let v = self.op("stablehlo.convert", &[x], "", ty);
        if let Some(sizes) = self.real_sizes.get(&x).cloned() {
            self.real_sizes.insert(v, sizes);
        }
        v
    }

    /// The real part of a complex `x` (a float `x` is its own).
    pub fn real(&mut self, x: Value) -> Value {
        let d = self.dtype(x);
        if !d.is_complex() {
            return x;
        }
        let ty = self.ty(x).with_dtype(d.real_part());
        self.op("stablehlo.real", &[x], "", ty)
    }

    /// The complex conjugate of `x` (a real `x` is its own).
    pub fn conj(&mut self, x: Value) -> Value {
        if !self.dtype(x).is_complex() {
            return x;
        }
        let re = self.real(x);
        let im = self.imag(x);
        let nim = self.unary("stablehlo.negate", im);
        self.complex(re, nim)
    }

    /// A complex `x` as (real, imag) pairs along a new last dim of size 2.
    pub fn complex_to_pairs(&mut self, x: Value) -> Value {
        let mut shape = self.shape(x);
        shape.push(1);
        let re = self.real(x);
        let im = self.imag(x);
        let re = self.reshape(re, &shape);
        let im = self.reshape(im, &shape);
        self.concatenate(&[re, im], shape.len() - 1)
    }

    /// The complex numbers of (real, imag) pairs along `x`'s last dim (of size 2).
    pub fn pairs_to_complex(&mut self, x: Value) -> Value {
        let shape = self.shape(x);
        let r = shape.len() - 1;
        let mut limit = shape.clone();
        limit[r] = 1;
        let re = self.slice(x, &vec![0; r + 1], &limit, &vec![1; r + 1]);
        let mut start = vec![0; r + 1];
        start[r] = 1;
        let im = self.slice(x, &start, &shape, &vec![1; r + 1]);
        let re = self.reshape(re, &shape[..r]);
        let im = self.reshape(im, &shape[..r]);
        self.complex(re, im)
    }

    /// The imaginary part of a complex `x`.
    pub fn imag(&mut self, x: Value) -> Value {
        let d = self.dtype(x);
        let ty = self.ty(x).with_dtype(d.real_part());
        self.op("stablehlo.imag", &[x], "", ty)
    }

    /// The complex number `re + i*im` from two float tensors of one type.
    pub fn complex(&mut self, re: Value, im: Value) -> Value {
        let d = self.dtype(re);
        let ty = self.ty(re).with_dtype(d.complex_of());
        self.op("stablehlo.complex", &[re, im], "", ty)
    }

    pub fn bitcast_convert(&mut self, x: Value, dtype: DType) -> Value {
        let ty = self.ty(x).with_dtype(dtype);
        self.op("stablehlo.bitcast_convert", &[x], "", ty)
    }

    pub fn reshape(&mut self, x: Value, shape: &[i64]) -> Value {
        if self.shape(x) == shape {
            return x;
        }
        let ty = TensorType::new(self.dtype(x), shape);
        assert_eq!(
            ty.numel(),
            self.ty(x).numel(),
            "reshape: element count differs"
        );
        self.op("stablehlo.reshape", &[x], "", ty)
    }

    /// `dims[i]` is the result dimension that operand dimension `i` maps to.
    pub fn broadcast_in_dim(&mut self, x: Value, shape: &[i64], dims: &[i64]) -> Value {
        if self.shape(x) == shape && dims.iter().enumerate().all(|(i, d)| *d == i as i64) {
            return x;
        }
        let ty = TensorType::new(self.dtype(x), shape);
        let attrs = format!("broadcast_dimensions = {}", i64_array(dims));
        self.op("stablehlo.broadcast_in_dim", &[x], &attrs, ty)
    }

    /// NumPy-style broadcast of `x` to `shape` (trailing dimensions aligned).
    pub fn broadcast_to(&mut self, x: Value, shape: &[i64]) -> Value {
        let xs = self.shape(x);
        assert!(xs.len() <= shape.len(), "broadcast_to: rank too large");
        let off = shape.len() - xs.len();
        // Drop size-1 dims that must stretch, so broadcast_in_dim sees exact sizes.
        let mut keep_shape = Vec::new();
        let mut dims = Vec::new();
        for (i, d) in xs.iter().enumerate() {
            if *d == shape[off + i] {
                keep_shape.push(*d);
                dims.push((off + i) as i64);
            } else {
                assert_eq!(*d, 1, "broadcast_to: incompatible dimension");
            }
        }
        let x = self.reshape(x, &keep_shape);
        self.broadcast_in_dim(x, shape, &dims)
    }

    pub fn transpose(&mut self, x: Value, perm: &[i64]) -> Value {
        if perm.iter().enumerate().all(|(i, p)| *p == i as i64) {
            return x;
        }
        let xs = self.shape(x);
        let shape: Vec<i64> = perm.iter().map(|p| xs[*p as usize]).collect();
        let ty = TensorType::new(self.dtype(x), &shape);
        let attrs = format!("permutation = {}", i64_array(perm));
        self.op("stablehlo.transpose", &[x], &attrs, ty)
    }

    pub fn slice(&mut self, x: Value, start: &[i64], limit: &[i64], strides: &[i64]) -> Value {
        let shape: Vec<i64> = (0..start.len())
            .map(|i| {
                let n = limit[i] - start[i];
                if n <= 0 {
                    0
                } else {
                    (n + strides[i] - 1) / strides[i]
                }
            })
            .collect();
        if shape == self.shape(x) {
            return x;
        }
        let ty = TensorType::new(self.dtype(x), &shape);
        let attrs = format!(
            "start_indices = {}, limit_indices = {}, strides = {}",
            i64_array(start),
            i64_array(limit),
            i64_array(strides)
        );
        self.op("stablehlo.slice", &[x], &attrs, ty)
    }

    /// Slice of one dimension: `[start, limit)` with `step`.
    pub fn slice_dim(&mut self, x: Value, dim: usize, start: i64, limit: i64, step: i64) -> Value {
        let shape = self.shape(x);
        let mut st = vec![0; shape.len()];
        let mut li = shape.clone();
        let mut sp = vec![1; shape.len()];
        st[dim] = start;
        li[dim] = limit;
        sp[dim] = step;
        self.slice(x, &st, &li, &sp)
    }

    pub fn dynamic_slice(&mut self, x: Value, starts: &[Value], sizes: &[i64]) -> Value {
        let ty = TensorType::new(self.dtype(x), sizes);
        let mut ops = vec![x];
        ops.extend_from_slice(starts);
        let attrs = format!("slice_sizes = {}", i64_array(sizes));
        self.op("stablehlo.dynamic_slice", &ops, &attrs, ty)
    }

    pub fn dynamic_update_slice(&mut self, x: Value, update: Value, starts: &[Value]) -> Value {
        let ty = self.ty(x).clone();
        let mut ops = vec![x, update];
        ops.extend_from_slice(starts);
        self.op("stablehlo.dynamic_update_slice", &ops, "", ty)
    }

    pub fn concatenate(&mut self, xs: &[Value], dim: usize) -> Value {
        if xs.len() == 1 {
            return xs[0];
        }
        let mut shape = self.shape(xs[0]);
        shape[dim] = xs.iter().map(|v| self.shape(*v)[dim]).sum();
        let ty = TensorType::new(self.dtype(xs[0]), &shape);
        let attrs = format!("dimension = {dim} : i64");
        self.op("stablehlo.concatenate", xs, &attrs, ty)
    }

    pub fn iota(&mut self, dtype: DType, shape: &[i64], dim: usize) -> Value {
        let ty = TensorType::new(dtype, shape);
        let attrs = format!("iota_dimension = {dim} : i64");
        self.op("stablehlo.iota", &[], &attrs, ty)
    }

    pub fn pad(
        &mut self,
        x: Value,
        value: Value,
        low: &[i64],
        high: &[i64],
        interior: &[i64],
    ) -> Value {
        let xs = self.shape(x);
        let shape: Vec<i64> = (0..xs.len())
            .map(|i| low[i] + high[i] + xs[i] + (xs[i] - 1).max(0) * interior[i])
            .collect();
        let ty = TensorType::new(self.dtype(x), &shape);
        let attrs = format!(
            "edge_padding_low = {}, edge_padding_high = {}, interior_padding = {}",
            i64_array(low),
            i64_array(high),
            i64_array(interior)
        );
        self.op("stablehlo.pad", &[x, value], &attrs, ty)
    }

    pub fn clamp(&mut self, lo: Value, x: Value, hi: Value) -> Value {
        let ty = self.ty(x).clone();
        self.op("stablehlo.clamp", &[lo, x, hi], "", ty)
    }

    /// `dot_general` with explicit batch and contracting dimensions; the result is
    /// batch dims, then lhs free dims, then rhs free dims.
    pub fn dot_general(
        &mut self,
        a: Value,
        b: Value,
        batch: (&[i64], &[i64]),
        contract: (&[i64], &[i64]),
        out: DType,
    ) -> Value {
        let (sa, sb) = (self.shape(a), self.shape(b));
        let mut shape: Vec<i64> = batch.0.iter().map(|d| sa[*d as usize]).collect();
        for (i, d) in sa.iter().enumerate() {
            let i = i as i64;
            if !batch.0.contains(&i) && !contract.0.contains(&i) {
                shape.push(*d);
            }
        }
        for (i, d) in sb.iter().enumerate() {
            let i = i as i64;
            if !batch.1.contains(&i) && !contract.1.contains(&i) {
                shape.push(*d);
            }
        }
        let attrs = format!(
            "dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = {}, rhs_batching_dimensions = {}, lhs_contracting_dimensions = {}, rhs_contracting_dimensions = {}>",
            i64_list(batch.0),
            i64_list(batch.1),
            i64_list(contract.0),
            i64_list(contract.1)
        );
        self.op(
            "stablehlo.dot_general",
            &[a, b],
            &attrs,
            TensorType::new(out, &shape),
        )
    }

    /// Reduces `x` over `dims` with a builtin combiner.
    pub fn reduce(&mut self, x: Value, dims: &[i64], kind: ReduceKind) -> Value {
        let dtype = self.dtype(x);
        if self.padded
            && dims.len() > 1
            && matches!(kind, ReduceKind::Sum | ReduceKind::Prod)
            && dtype.is_float()
        {
            let mut order = dims.to_vec();
            order.sort_unstable();
            // The last dim first: the lower ones keep their positions.
            return order
                .iter()
                .rev()
                .fold(x, |v, d| self.reduce(v, &[*d], kind));
        }
        let init = self.constant(dtype, kind.init(dtype));
        self.reduce_with(&[x], &[init], dims, |b, args| {
            vec![b.combine(kind, args[0], args[1])]
        })[0]
    }

    /// A general variadic `reduce`: `body` gets (acc..., x...) scalars and returns the new accs.
    pub fn reduce_with(
        &mut self,
        xs: &[Value],
        inits: &[Value],
        dims: &[i64],
        body: impl FnOnce(&mut Builder, &[Value]) -> Vec<Value>,
    ) -> Vec<Value> {
        let in_shape = self.shape(xs[0]);
        let out_shape: Vec<i64> = in_shape
            .iter()
            .enumerate()
            .filter(|(i, _)| !dims.contains(&(*i as i64)))
            .map(|(_, d)| *d)
            .collect();
        let scalar_tys: Vec<TensorType> = inits
            .iter()
            .map(|v| TensorType::scalar(self.dtype(*v)))
            .collect();
        let mut arg_tys = scalar_tys.clone();
        arg_tys.extend(scalar_tys.iter().cloned());
        let region = self.region(&arg_tys, body);
        let results: Vec<TensorType> = inits
            .iter()
            .map(|v| TensorType::new(self.dtype(*v), &out_shape))
            .collect();
        let mut ops = xs.to_vec();
        ops.extend_from_slice(inits);
        let attrs = format!("dimensions = {}", i64_array(dims));
        self.op_regions("stablehlo.reduce", &ops, &[region], &attrs, &results)
    }

    /// `reduce_window` with a builtin combiner. `padding` is (low, high) per dim.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_window(
        &mut self,
        x: Value,
        init: Value,
        kind: ReduceKind,
        window: &[i64],
        strides: &[i64],
        padding: &[(i64, i64)],
    ) -> Value {
        let xs = self.shape(x);
        let dtype = self.dtype(x);
        let shape: Vec<i64> = (0..xs.len())
            .map(|i| (xs[i] + padding[i].0 + padding[i].1 - window[i]) / strides[i] + 1)
            .collect();
        let st = TensorType::scalar(dtype);
        let region = self.region(&[st.clone(), st], |b, a| vec![b.combine(kind, a[0], a[1])]);
        let attrs = format!(
            "window_dimensions = {}, window_strides = {}, padding = {}",
            i64_array(window),
            i64_array(strides),
            padding_attr(padding)
        );
        self.op_regions(
            "stablehlo.reduce_window",
            &[x, init],
            &[region],
            &attrs,
            &[TensorType::new(dtype, &shape)],
        )[0]
    }

    /// Random bits from a counter-based generator: returns (new_state, bits).
    pub fn rng_bits(&mut self, state: Value, shape: &[i64], dtype: DType) -> (Value, Value) {
        let st = self.ty(state).clone();
        let r = self.op_regions(
            "stablehlo.rng_bit_generator",
            &[state],
            &[],
            "rng_algorithm = #stablehlo<rng_algorithm THREE_FRY>",
            &[st, TensorType::new(dtype, shape)],
        );
        (r[0], r[1])
    }
}

/// `dense<[[lo, hi], ...]> : tensor<Nx2xi64>`
pub fn padding_attr(p: &[(i64, i64)]) -> String {
    let rows: Vec<String> = p.iter().map(|(l, h)| format!("[{l}, {h}]")).collect();
    if p.is_empty() {
        return "dense<> : tensor<0x2xi64>".to_string();
    }
    format!("dense<[{}]> : tensor<{}x2xi64>", rows.join(", "), p.len())
}

/// Convolution and windowed helpers used by the nn rules.
impl Builder {
    /// `convolution` with `lhs` and the result laid out as [batch, feature, spatial...] and
    /// `rhs` as [out_feature, in_feature, spatial...]. `padding` is (low, high) per spatial
    /// dim and may be negative. Float operands use HIGHEST precision so results match a
    /// float32 reference (no TF32 or bf16 passes).
    #[allow(clippy::too_many_arguments)]
    pub fn convolution(
        &mut self,
        lhs: Value,
        rhs: Value,
        strides: &[i64],
        padding: &[(i64, i64)],
        lhs_dilation: &[i64],
        rhs_dilation: &[i64],
        feature_groups: i64,
        batch_groups: i64,
    ) -> Value {
        let (ls, rs) = (self.shape(lhs), self.shape(rhs));
        let n = ls.len() - 2;
        let mut shape = vec![ls[0] / batch_groups, rs[0]];
        for i in 0..n {
            let input = (ls[i + 2] - 1).max(0) * lhs_dilation[i] + 1 + padding[i].0 + padding[i].1;
            let window = (rs[i + 2] - 1) * rhs_dilation[i] + 1;
            shape.push(if input < window {
                0
            } else {
                (input - window) / strides[i] + 1
            });
        }
        let sp: Vec<String> = (0..n).map(|i| i.to_string()).collect();
        let sp = sp.join(", ");
        let sep = if n == 0 { "" } else { ", " };
        let dtype = self.dtype(lhs);
        let precision = if dtype.is_float() {
            ", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]"
        } else {
            ""
        };
        let attrs = format!(
            "window_strides = {}, padding = {}, lhs_dilation = {}, rhs_dilation = {}, \
             dimension_numbers = #stablehlo.conv<[b, f{sep}{sp}]x[o, i{sep}{sp}]->[b, f{sep}{sp}]>, \
             feature_group_count = {feature_groups} : i64, batch_group_count = {batch_groups} : i64{precision}",
            i64_array(strides),
            padding_attr(padding),
            i64_array(lhs_dilation),
            i64_array(rhs_dilation),
        );
        self.op(
            "stablehlo.convolution",
            &[lhs, rhs],
            &attrs,
            TensorType::new(dtype, &shape),
        )
    }

    /// Reverses `x` along `dims`.
    pub fn reverse(&mut self, x: Value, dims: &[i64]) -> Value {
        if dims.is_empty() {
            return x;
        }
        let ty = self.ty(x).clone();
        let attrs = format!("dimensions = {}", i64_array(dims));
        self.op("stablehlo.reverse", &[x], &attrs, ty)
    }

    /// A variadic `reduce_window` with window dilation: `body` gets (acc..., x...) scalars
    /// and returns the new accs. `padding` is (low, high) per dim, filled with `inits`.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_window_with(
        &mut self,
        xs: &[Value],
        inits: &[Value],
        window: &[i64],
        strides: &[i64],
        window_dilation: &[i64],
        padding: &[(i64, i64)],
        body: impl FnOnce(&mut Builder, &[Value]) -> Vec<Value>,
    ) -> Vec<Value> {
        let shp = self.shape(xs[0]);
        let shape: Vec<i64> = (0..shp.len())
            .map(|i| {
                let input = shp[i] + padding[i].0 + padding[i].1;
                let w = (window[i] - 1) * window_dilation[i] + 1;
                if input < w {
                    0
                } else {
                    (input - w) / strides[i] + 1
                }
            })
            .collect();
        let scalar_tys: Vec<TensorType> = inits
            .iter()
            .map(|v| TensorType::scalar(self.dtype(*v)))
            .collect();
        let mut arg_tys = scalar_tys.clone();
        arg_tys.extend(scalar_tys.iter().cloned());
        let region = self.region(&arg_tys, body);
        let results: Vec<TensorType> = inits
            .iter()
            .map(|v| TensorType::new(self.dtype(*v), &shape))
            .collect();
        let mut ops = xs.to_vec();
        ops.extend_from_slice(inits);
        let attrs = format!(
            "window_dimensions = {}, window_strides = {}, window_dilations = {}, padding = {}",
            i64_array(window),
            i64_array(strides),
            i64_array(window_dilation),
            padding_attr(padding)
        );
        self.op_regions("stablehlo.reduce_window", &ops, &[region], &attrs, &results)
    }
}

/// `name = [..]` fields of a dimension-numbers attribute; empty lists are left out.
fn dim_fields(fields: &[(&str, &[i64])], index_vector_dim: i64) -> String {
    let mut parts: Vec<String> = fields
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(n, v)| format!("{n} = {}", i64_list(v)))
        .collect();
    parts.push(format!("index_vector_dim = {index_vector_dim}"));
    parts.join(", ")
}

impl Builder {
    /// `gather` (argument names as in the StableHLO spec): the result has the batch dims of
    /// `idx` (all but `index_vector_dim`) and the uncollapsed slice dims at `offset_dims`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather(
        &mut self,
        x: Value,
        idx: Value,
        offset_dims: &[i64],
        collapsed_slice_dims: &[i64],
        start_index_map: &[i64],
        index_vector_dim: i64,
        slice_sizes: &[i64],
    ) -> Value {
        let is = self.shape(idx);
        let ivd = index_vector_dim as usize;
        let mut batch = is
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != ivd)
            .map(|(_, d)| *d);
        let mut offs = slice_sizes
            .iter()
            .enumerate()
            .filter(|(i, _)| !collapsed_slice_dims.contains(&(*i as i64)))
            .map(|(_, d)| *d);
        let rank =
            is.len() - usize::from(ivd < is.len()) + slice_sizes.len() - collapsed_slice_dims.len();
        let shape: Vec<i64> = (0..rank as i64)
            .map(|p| {
                let d = if offset_dims.contains(&p) {
                    offs.next()
                } else {
                    batch.next()
                };
                d.expect("gather: dimension numbers do not match the operand shapes")
            })
            .collect();
        let attrs = format!(
            "dimension_numbers = #stablehlo.gather<{}>, slice_sizes = {}, indices_are_sorted = false",
            dim_fields(
                &[
                    ("offset_dims", offset_dims),
                    ("collapsed_slice_dims", collapsed_slice_dims),
                    ("start_index_map", start_index_map),
                ],
                index_vector_dim
            ),
            i64_array(slice_sizes)
        );
        self.op(
            "stablehlo.gather",
            &[x, idx],
            &attrs,
            TensorType::new(self.dtype(x), &shape),
        )
    }

    /// `scatter` of `upd` into `x` at `idx` (argument names as in the StableHLO spec);
    /// `combine(current, update)` gives the new element (return the update to overwrite).
    #[allow(clippy::too_many_arguments)]
    pub fn scatter(
        &mut self,
        x: Value,
        idx: Value,
        upd: Value,
        update_window_dims: &[i64],
        inserted_window_dims: &[i64],
        scatter_dims_to_operand_dims: &[i64],
        index_vector_dim: i64,
        combine: impl FnOnce(&mut Builder, Value, Value) -> Value,
    ) -> Value {
        let dims = ScatterDims {
            update_window_dims,
            inserted_window_dims,
            scatter_dims_to_operand_dims,
            index_vector_dim,
            unique: false,
        };
        self.scatter_with(x, idx, upd, &dims, combine)
    }

    /// `scatter` with its dimension numbers and `unique_indices` given together.
    pub fn scatter_with(
        &mut self,
        x: Value,
        idx: Value,
        upd: Value,
        dims: &ScatterDims,
        combine: impl FnOnce(&mut Builder, Value, Value) -> Value,
    ) -> Value {
        let ScatterDims {
            update_window_dims,
            inserted_window_dims,
            scatter_dims_to_operand_dims,
            index_vector_dim,
            unique,
        } = *dims;
        let ty = self.ty(x).clone();
        let st = TensorType::scalar(ty.dtype);
        let region = self.region(&[st.clone(), st], |b, a| vec![combine(b, a[0], a[1])]);
        let attrs = format!(
            "scatter_dimension_numbers = #stablehlo.scatter<{}>, indices_are_sorted = false, unique_indices = {unique}",
            dim_fields(
                &[
                    ("update_window_dims", update_window_dims),
                    ("inserted_window_dims", inserted_window_dims),
                    ("scatter_dims_to_operand_dims", scatter_dims_to_operand_dims),
                ],
                index_vector_dim
            )
        );
        self.op_regions(
            "stablehlo.scatter",
            &[x, idx, upd],
            &[region],
            &attrs,
            &[ty],
        )[0]
    }
}

/// A `scatter`'s dimension numbers, and whether no two updates go to one element (lets
/// a backend write them in parallel).
#[derive(Clone, Copy, Debug)]
pub struct ScatterDims<'a> {
    pub update_window_dims: &'a [i64],
    pub inserted_window_dims: &'a [i64],
    pub scatter_dims_to_operand_dims: &'a [i64],
    pub index_vector_dim: i64,
    pub unique: bool,
}

/// Sorting and dense linear algebra.
impl Builder {
    /// `sort` of `xs` (same shape) along `dim`; `less` gets (lhs0, rhs0, lhs1, rhs1, ...)
    /// scalars and returns whether lhs orders before rhs.
    pub fn sort(
        &mut self,
        xs: &[Value],
        dim: usize,
        stable: bool,
        less: impl FnOnce(&mut Builder, &[Value]) -> Value,
    ) -> Vec<Value> {
        let mut arg_tys = Vec::new();
        for x in xs {
            let st = TensorType::scalar(self.dtype(*x));
            arg_tys.push(st.clone());
            arg_tys.push(st);
        }
        let region = self.region(&arg_tys, |b, a| vec![less(b, a)]);
        let results: Vec<TensorType> = xs.iter().map(|x| self.ty(*x).clone()).collect();
        let attrs = format!("dimension = {dim} : i64, is_stable = {stable}");
        self.op_regions("stablehlo.sort", xs, &[region], &attrs, &results)
    }

    /// Cholesky factor of batched matrices `[..., n, n]`; the other triangle is undefined.
    pub fn cholesky(&mut self, a: Value, lower: bool) -> Value {
        let ty = self.ty(a).clone();
        self.op("stablehlo.cholesky", &[a], &format!("lower = {lower}"), ty)
    }

    /// Solves `op(a) x = b` (`left_side`) or `x op(a) = b` for triangular batched `a`.
    pub fn triangular_solve(
        &mut self,
        a: Value,
        b: Value,
        left_side: bool,
        lower: bool,
        unit_diagonal: bool,
        transpose: bool,
    ) -> Value {
        let ty = self.ty(b).clone();
        let t = if transpose {
            "TRANSPOSE"
        } else {
            "NO_TRANSPOSE"
        };
        let attrs = format!(
            "left_side = {left_side}, lower = {lower}, unit_diagonal = {unit_diagonal}, transpose_a = #stablehlo<transpose {t}>"
        );
        self.op("stablehlo.triangular_solve", &[a, b], &attrs, ty)
    }
}

impl Builder {
    /// A `stablehlo.while` loop carrying `init`: `cond` maps the carried values to a 0-d
    /// i1 (loop while true), `body` maps them to their next values (same types).
    pub fn while_loop(
        &mut self,
        init: &[Value],
        cond: impl FnOnce(&mut Builder, &[Value]) -> Value,
        body: impl FnOnce(&mut Builder, &[Value]) -> Vec<Value>,
    ) -> Vec<Value> {
        let tys: Vec<TensorType> = init.iter().map(|v| self.ty(*v).clone()).collect();
        let c = self.region(&tys, |b, a| vec![cond(b, a)]);
        let r = self.region(&tys, body);
        self.op_regions("stablehlo.while", init, &[c, r], "", &tys)
    }
}

impl Builder {
    /// A `custom_call` of `target` with a string `backend_config` (API version 1), for the
    /// calls XLA's compiler expands itself ("Qr", "Eigh",
    /// "ProductOfElementaryHouseholderReflectors").
    pub fn custom_call(
        &mut self,
        target: &str,
        operands: &[Value],
        backend_config: &str,
        results: &[TensorType],
    ) -> Vec<Value> {
        let attrs = format!(
            "call_target_name = \"{target}\", backend_config = \"{backend_config}\", api_version = 1 : i32"
        );
        self.op_regions("stablehlo.custom_call", operands, &[], &attrs, results)
    }
}

#[cfg(test)]
mod tests {
    use crate::{Builder, DType, ReduceKind, TensorType};

    /// A mean's divisor: the type's size, or in a padded program the real size set on the
    /// input (followed through a convert), never the bucket's.
    #[test]
    fn count_is_the_real_size_of_a_padded_dim() {
        let mut b = Builder::new();
        let x = b.param(TensorType::new(DType::F32, &[16, 8]));
        let s = b.reduce(x, &[0, 1], ReduceKind::Sum);
        let n = b.count(x, &[0, 1], s);
        assert!(!b.finish(&[n]).contains("multiply"));

        let mut b = Builder::new();
        b.set_padded(true);
        let x = b.param(TensorType::new(DType::F16, &[16, 8]));
        let real = b.param(TensorType::scalar(DType::I32));
        let x = b.set_dimension_size(x, 0, real);
        let x = b.convert(x, DType::F32);
        let s = b.reduce(x, &[0, 1], ReduceKind::Sum);
        let n = b.count(x, &[0, 1], s);
        let text = b.finish(&[n]);
        // 8 (static) times the real size of dim 0, converted from the i32 parameter.
        assert!(text.contains("stablehlo.multiply"), "{text}");
        assert!(text.contains("\"stablehlo.convert\"(%v1)"), "{text}");
    }
}
