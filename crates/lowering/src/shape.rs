//! Shape logic shared by all rules, with PyTorch's error messages.

use crate::{user_err, ErrorKind, LResult};

/// NumPy broadcasting of two shapes.
pub fn broadcast_shapes(a: &[i64], b: &[i64]) -> LResult<Vec<i64>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return user_err(
                ErrorKind::Runtime,
                format!(
                    "The size of tensor a ({da}) must match the size of tensor b ({db}) at non-singleton dimension {i}"
                ),
            );
        };
    }
    Ok(out)
}

pub fn broadcast_all(shapes: &[&[i64]]) -> LResult<Vec<i64>> {
    let mut out: Vec<i64> = Vec::new();
    for s in shapes {
        out = broadcast_shapes(&out, s)?;
    }
    Ok(out)
}

/// Wraps a possibly negative dim into `[0, rank)`; rank 0 accepts -1 and 0.
pub fn wrap_dim(dim: i64, rank: usize) -> LResult<usize> {
    let r = (rank as i64).max(1);
    if dim < -r || dim >= r {
        return user_err(
            ErrorKind::Index,
            format!(
                "Dimension out of range (expected to be in range of [{}, {}], but got {})",
                -r,
                r - 1,
                dim
            ),
        );
    }
    Ok((if dim < 0 { dim + r } else { dim }) as usize)
}

/// The dims a reduction runs over: all of them when `dims` is empty or absent.
pub fn reduce_dims(dims: Option<&[i64]>, rank: usize) -> LResult<Vec<i64>> {
    match dims {
        None | Some([]) => Ok((0..rank as i64).collect()),
        Some(d) => {
            let mut out = Vec::new();
            for x in d {
                let w = wrap_dim(*x, rank)? as i64;
                if out.contains(&w) {
                    return user_err(
                        ErrorKind::Runtime,
                        format!("dim {w} appears multiple times in the list of dims"),
                    );
                }
                if rank > 0 {
                    out.push(w);
                }
            }
            out.sort();
            Ok(out)
        }
    }
}

/// Shape after reducing `dims`, keeping them as size 1 if `keepdim`.
pub fn reduced_shape(shape: &[i64], dims: &[i64], keepdim: bool) -> Vec<i64> {
    let mut out = Vec::new();
    for (i, d) in shape.iter().enumerate() {
        if dims.contains(&(i as i64)) {
            if keepdim {
                out.push(1);
            }
        } else {
            out.push(*d);
        }
    }
    out
}

pub fn numel(shape: &[i64]) -> i64 {
    shape.iter().product()
}

/// Contiguous strides of a shape (in elements).
pub fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1].max(1);
    }
    s
}

pub fn shape_str(s: &[i64]) -> String {
    let v: Vec<String> = s.iter().map(|x| x.to_string()).collect();
    format!("[{}]", v.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting() {
        assert_eq!(broadcast_shapes(&[3, 1], &[4]).unwrap(), vec![3, 4]);
        assert_eq!(broadcast_shapes(&[], &[2, 2]).unwrap(), vec![2, 2]);
        assert!(broadcast_shapes(&[3], &[4]).is_err());
    }

    #[test]
    fn dims() {
        assert_eq!(wrap_dim(-1, 3).unwrap(), 2);
        assert!(wrap_dim(3, 3).is_err());
        assert_eq!(reduce_dims(Some(&[-1, 0]), 3).unwrap(), vec![0, 2]);
        assert_eq!(reduced_shape(&[2, 3, 4], &[1], true), vec![2, 1, 4]);
    }
}
