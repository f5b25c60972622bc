//! PyTorch's type promotion: `promote_types` and `result_type` over tensors, 0-d tensors
//! and Python numbers.

use crate::args::Scalar;
use crate::DType;

fn category(d: DType) -> u8 {
    if d == DType::Bool {
        0
    } else if d.is_complex() {
        3
    } else if d.is_float() {
        2
    } else {
        1
    }
}

/// `torch.promote_types` for the dtypes we support.
pub fn promote_types(a: DType, b: DType) -> DType {
    use DType::*;
    if a == b {
        return a;
    }
    let (ca, cb) = (category(a), category(b));
    if a.is_complex() || b.is_complex() {
        // The complex type wide enough for both (complex64 + float64 is complex128).
        let wide = |d: DType| matches!(d, DType::F64 | DType::C128);
        return if wide(a) || wide(b) {
            DType::C128
        } else {
            DType::C64
        };
    }
    if ca != cb {
        return if ca > cb { a } else { b };
    }
    match (a, b) {
        (F16, BF16) | (BF16, F16) => F32,
        _ if a.is_float() => {
            if a.size() >= b.size() {
                a
            } else {
                b
            }
        }
        (U8, I8) | (I8, U8) => I16,
        (U8, x) | (x, U8) => x,
        _ => {
            if a.size() >= b.size() {
                a
            } else {
                b
            }
        }
    }
}

/// One operand of a promotion: a dimensioned tensor, a 0-d tensor, or a Python number.
#[derive(Clone, Copy, Debug)]
pub enum Operand {
    Dim(DType),
    ZeroDim(DType),
    Number(Scalar),
}

/// `torch.result_type` over operands.
pub fn result_type(ops: &[Operand]) -> DType {
    let mut dim: Option<DType> = None;
    let mut zero: Option<DType> = None;
    let mut num: Option<DType> = None;
    let fold = |acc: &mut Option<DType>, d: DType| {
        *acc = Some(match *acc {
            None => d,
            Some(x) => promote_types(x, d),
        })
    };
    for op in ops {
        match op {
            Operand::Dim(d) => fold(&mut dim, *d),
            Operand::ZeroDim(d) => fold(&mut zero, *d),
            Operand::Number(s) => fold(&mut num, s.dtype()),
        }
    }
    combine(combine(dim, zero), num).unwrap_or(DType::F32)
}

/// A lower-priority group only matters when its category is higher.
fn combine(higher: Option<DType>, lower: Option<DType>) -> Option<DType> {
    match (higher, lower) {
        (None, l) => l,
        (h, None) => h,
        (Some(h), Some(l)) => {
            if category(l) == 3 && category(h) == 2 {
                // A complex number with float tensors keeps their precision.
                Some(h.complex_of())
            } else if category(l) > category(h) {
                // A float number with integer tensors gives the default float dtype,
                // an int number with bool tensors gives int64.
                Some(l)
            } else {
                Some(h)
            }
        }
    }
}

/// The dtype of an op that always computes in floating point (exp, sqrt, div, mean, ...).
pub fn to_float(d: DType) -> DType {
    if d.is_float() || d.is_complex() {
        d
    } else {
        DType::F32
    }
}

/// `torch.can_cast(from, to)`: no demotion across categories.
pub fn can_cast(from: DType, to: DType) -> bool {
    category(from) <= category(to)
}

/// PyTorch's name of a dtype, for error messages.
pub fn torch_name(d: DType) -> &'static str {
    match d {
        DType::Bool => "Bool",
        DType::U8 => "Byte",
        DType::I8 => "Char",
        DType::I16 => "Short",
        DType::I32 => "Int",
        DType::I64 => "Long",
        DType::U32 => "UInt32",
        DType::U64 => "UInt64",
        DType::F16 => "Half",
        DType::BF16 => "BFloat16",
        DType::F32 => "Float",
        DType::F64 => "Double",
        DType::C64 => "ComplexFloat",
        DType::C128 => "ComplexDouble",
    }
}

/// The C++ element type name PyTorch prints in some messages ("expected scalar type ...").
pub fn cpp_name(d: DType) -> &'static str {
    match d {
        DType::Bool => "bool",
        DType::U8 => "unsigned char",
        DType::I8 => "signed char",
        DType::I16 => "short int",
        DType::I32 => "int",
        DType::I64 => "long int",
        DType::U32 => "unsigned int",
        DType::U64 => "long unsigned int",
        DType::F16 => "c10::Half",
        DType::BF16 => "c10::BFloat16",
        DType::F32 => "float",
        DType::F64 => "double",
        DType::C64 => "c10::complex<float>",
        DType::C128 => "c10::complex<double>",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use DType::*;

    #[test]
    fn promotion_table() {
        assert_eq!(promote_types(U8, I8), I16);
        assert_eq!(promote_types(F16, BF16), F32);
        assert_eq!(promote_types(I64, F16), F16);
        assert_eq!(promote_types(Bool, I32), I32);
        assert_eq!(promote_types(I32, I64), I64);
        assert_eq!(promote_types(C64, F64), C128);
        assert_eq!(promote_types(I64, C64), C64);
        assert_eq!(promote_types(F16, C64), C64);
    }

    #[test]
    fn result_type_with_numbers() {
        // int tensor + 2.5 -> float32; float16 tensor + 2.5 -> float16
        assert_eq!(
            result_type(&[Operand::Dim(I32), Operand::Number(Scalar::Float(2.5))]),
            F32
        );
        assert_eq!(
            result_type(&[Operand::Dim(F16), Operand::Number(Scalar::Float(2.5))]),
            F16
        );
        // int8 tensor + int64 0-d tensor -> int8
        assert_eq!(result_type(&[Operand::Dim(I8), Operand::ZeroDim(I64)]), I8);
        // int8 tensor + float64 0-d tensor -> float32? no: zero-dim float wins category -> F64
        assert_eq!(result_type(&[Operand::Dim(I8), Operand::ZeroDim(F64)]), F64);
        // bool tensor + 1 -> int64
        assert_eq!(
            result_type(&[Operand::Dim(Bool), Operand::Number(Scalar::Int(1))]),
            I64
        );
    }
}
