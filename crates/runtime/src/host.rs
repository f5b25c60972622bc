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

/// `for_each_offset` by runs: the view's innermost dim, when its elements are adjacent
/// (stride 1), is one call of `f(first offset, length)` instead of one per element (staging
/// a bucketed program's input lays out megabytes this way).
fn for_each_run(view: &View, mut f: impl FnMut(i64, usize)) {
    // Trailing size-1 dims address nothing.
    let rank = view
        .sizes
        .iter()
        .rposition(|n| *n != 1)
        .map_or(0, |d| d + 1);
    if rank == 0 || view.strides[rank - 1] != 1 {
        return for_each_offset(view, |off| f(off, 1));
    }
    let len = view.sizes[rank - 1];
    let outer = View {
        sizes: view.sizes[..rank - 1].to_vec(),
        strides: view.strides[..rank - 1].to_vec(),
        offset: view.offset,
    };
    if len > 0 {
        for_each_offset(&outer, |off| f(off, len as usize));
    }
}

/// The byte range (start, length) of a contiguous view; None for any other view.
fn contiguous_range(view: &View, itemsize: usize) -> Option<(usize, usize)> {
    view.is_contiguous().then(|| {
        (
            view.offset as usize * itemsize,
            view.numel() as usize * itemsize,
        )
    })
}

/// A contiguous host view's bytes in place (None for any other view): what a synchronous
/// download can hand PJRT without a staging copy.
///
/// # Safety
/// `base` must point at a live allocation covering every element of `view`, which nothing
/// else reads or writes while the slice is used.
pub unsafe fn contiguous<'a>(base: *mut u8, view: &View, itemsize: usize) -> Option<&'a mut [u8]> {
    let (start, len) = contiguous_range(view, itemsize)?;
    // SAFETY: the caller guarantees the range is inside the allocation and unshared.
    Some(unsafe { std::slice::from_raw_parts_mut(base.add(start), len) })
}

/// `contiguous` for a view that is only read (an upload's source).
///
/// # Safety
/// `base` must point at a live allocation covering every element of `view`, which nothing
/// writes while the slice is used.
pub unsafe fn contiguous_ref<'a>(
    base: *const u8,
    view: &View,
    itemsize: usize,
) -> Option<&'a [u8]> {
    let (start, len) = contiguous_range(view, itemsize)?;
    // SAFETY: the caller guarantees the range is inside the allocation and not written.
    Some(unsafe { std::slice::from_raw_parts(base.add(start), len) })
}

/// Reads a strided host view into contiguous bytes.
///
/// # Safety
/// `base` must point at a live allocation covering every element of `view`.
pub unsafe fn read(base: *const u8, view: &View, itemsize: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(view.numel() as usize * itemsize);
    // SAFETY: the caller guarantees the view is inside the allocation.
    if let Some(s) = unsafe { contiguous_ref(base, view, itemsize) } {
        out.extend_from_slice(s);
        return out;
    }
    for_each_run(view, |off, len| {
        // SAFETY: every element of the view is inside the allocation (caller's contract),
        // and a run is `len` consecutive elements of the view.
        let s = unsafe {
            std::slice::from_raw_parts(base.add(off as usize * itemsize), len * itemsize)
        };
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
    for_each_run(view, |off, len| {
        let bytes = len * itemsize;
        // SAFETY: in bounds by the caller's contract (a run is `len` consecutive elements
        // of the view); `data` holds numel * itemsize bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr().add(i),
                base.add(off as usize * itemsize),
                bytes,
            );
        }
        i += bytes;
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

#[cfg(test)]
mod tests {
    use super::*;

    use crate::layout::view;

    /// Reads and writes by runs agree with one element at a time.
    #[test]
    fn runs_match_elements() {
        let base: Vec<u8> = (0..=255u8).collect();
        let views = [
            view(&[3, 4], &[8, 1], 2),
            view(&[4, 3], &[1, 8], 1),
            view(&[2, 3, 1], &[12, 2, 5], 0),
            view(&[2, 1, 5], &[10, 7, 1], 3),
            view(&[], &[], 9),
            view(&[0, 4], &[4, 1], 0),
            view(&[5], &[1], 100),
        ];
        for v in &views {
            let mut want = Vec::new();
            for_each_offset(v, |off| {
                want.extend_from_slice(&base[off as usize * 2..][..2])
            });
            // SAFETY: every view lies inside `base` (128 two-byte elements).
            let got = unsafe { read(base.as_ptr(), v, 2) };
            assert_eq!(got, want, "{v:?}");
            let mut out = vec![0u8; 256];
            // SAFETY: as above, for `out`.
            unsafe { write(out.as_mut_ptr(), v, 2, &want) };
            for_each_offset(v, |off| {
                let o = off as usize * 2;
                assert_eq!(out[o..o + 2], base[o..o + 2], "{v:?}");
            });
        }
    }
}
