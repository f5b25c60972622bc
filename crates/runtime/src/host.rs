//! Strided copies between host memory and contiguous byte vectors.

use crate::layout::View;

/// Calls `f(element offset)` for every element of `view`, in row-major order.
fn for_each_offset(view: &View, mut f: impl FnMut(i64)) {
    let n = view.numel();
    if n == 0 {
        return;
    }
    let rank = view.sizes.len();
    let mut idx = vec![0i64; rank];
    let mut off = view.offset;
    for _ in 0..n {
        f(off);
        for d in (0..rank).rev() {
            idx[d] += 1;
            off += view.strides[d];
            if idx[d] < view.sizes[d] {
                break;
            }
            off -= view.strides[d] * view.sizes[d];
            idx[d] = 0;
        }
    }
}

/// Reads a strided host view into contiguous bytes.
///
/// # Safety
/// `base` must point at a live allocation covering every element of `view`.
pub unsafe fn read(base: *const u8, view: &View, itemsize: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(view.numel() as usize * itemsize);
    if view.is_contiguous() {
        // SAFETY: the caller guarantees the range is inside the allocation.
        let s = unsafe {
            std::slice::from_raw_parts(
                base.add(view.offset as usize * itemsize),
                view.numel() as usize * itemsize,
            )
        };
        out.extend_from_slice(s);
        return out;
    }
    for_each_offset(view, |off| {
        // SAFETY: every offset of the view is inside the allocation (caller's contract).
        let s = unsafe { std::slice::from_raw_parts(base.add(off as usize * itemsize), itemsize) };
        out.extend_from_slice(s);
    });
    out
}

/// Writes contiguous bytes into a strided host view.
///
/// # Safety
/// `base` must point at a live, writable allocation covering every element of `view`.
pub unsafe fn write(base: *mut u8, view: &View, itemsize: usize, data: &[u8]) {
    let mut i = 0usize;
    for_each_offset(view, |off| {
        // SAFETY: in bounds by the caller's contract; `data` holds numel * itemsize bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr().add(i),
                base.add(off as usize * itemsize),
                itemsize,
            );
        }
        i += itemsize;
    });
}

/// True if any element of a contiguous float buffer is NaN or infinite.
pub fn has_nan_or_inf(bytes: &[u8], dtype: stablehlo::DType) -> bool {
    use stablehlo::DType;
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .any(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()),
        DType::F64 => bytes.chunks_exact(8).any(|c| {
            !f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]).is_finite()
        }),
        // Exponent all ones: 5 bits for half, 8 for bfloat16.
        DType::F16 => bytes
            .chunks_exact(2)
            .any(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7C00 == 0x7C00),
        DType::BF16 => bytes
            .chunks_exact(2)
            .any(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7F80 == 0x7F80),
        _ => false,
    }
}

/// One element read from little-endian bytes.
pub enum Scalar {
    Int(i64),
    Float(f64),
    Complex(f64, f64),
}

pub fn scalar(b: &[u8], dtype: stablehlo::DType) -> Scalar {
    use stablehlo::DType;
    if dtype.is_complex() {
        let p = dtype.real_part();
        let (re, im) = match (scalar(b, p), scalar(&b[p.size()..], p)) {
            (Scalar::Float(re), Scalar::Float(im)) => (re, im),
            _ => unreachable!("complex parts are floats"),
        };
        return Scalar::Complex(re, im);
    }
    let mut a = [0u8; 8];
    a[..dtype.size()].copy_from_slice(&b[..dtype.size()]);
    match dtype {
        DType::Bool | DType::U8 => Scalar::Int(a[0] as i64),
        DType::I8 => Scalar::Int(a[0] as i8 as i64),
        DType::I16 => Scalar::Int(i16::from_le_bytes([a[0], a[1]]) as i64),
        DType::I32 => Scalar::Int(i32::from_le_bytes([a[0], a[1], a[2], a[3]]) as i64),
        DType::U32 => Scalar::Int(u32::from_le_bytes([a[0], a[1], a[2], a[3]]) as i64),
        DType::I64 | DType::U64 => Scalar::Int(i64::from_le_bytes(a)),
        DType::F16 => Scalar::Float(half_to_f64(u16::from_le_bytes([a[0], a[1]]))),
        DType::BF16 => {
            Scalar::Float(f32::from_bits((u16::from_le_bytes([a[0], a[1]]) as u32) << 16) as f64)
        }
        DType::F32 => Scalar::Float(f32::from_le_bytes([a[0], a[1], a[2], a[3]]) as f64),
        DType::F64 => Scalar::Float(f64::from_le_bytes(a)),
        DType::C64 | DType::C128 => unreachable!("handled above"),
    }
}

pub fn half_to_f64(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let frac = (h & 0x3ff) as f64;
    sign * match exp {
        0 => frac * 2f64.powi(-24),
        31 => {
            if frac == 0.0 {
                f64::INFINITY
            } else {
                f64::NAN
            }
        }
        e => (1.0 + frac / 1024.0) * 2f64.powi(e - 15),
    }
}
