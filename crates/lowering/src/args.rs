//! Op arguments by schema name, with typed getters that report PyTorch-style errors.

use crate::{decline, DType, LResult, Value};

#[derive(Clone, Debug)]
pub struct TensorArg {
    pub value: Value,
    pub dtype: DType,
    pub shape: Vec<i64>,
    /// A Python number wrapped into a 0-d tensor: it promotes like a scalar.
    pub wrapped_number: bool,
}

#[derive(Clone, Debug)]
pub enum Arg {
    None,
    Tensor(TensorArg),
    Int(i64),
    Float(f64),
    /// A complex number (real, imaginary).
    Complex(f64, f64),
    Bool(bool),
    Str(String),
    ScalarType(DType),
    List(Vec<Arg>),
    /// An argument the rules do not model (layout, device, memory format, ...).
    Other,
}

/// A number argument with the Python kind it had (for type promotion).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    Int(i64),
    Float(f64),
    Bool(bool),
    /// A Python complex (real, imaginary).
    Complex(f64, f64),
}

impl Scalar {
    pub fn as_f64(self) -> f64 {
        match self {
            Scalar::Int(i) => i as f64,
            Scalar::Float(f) => f,
            Scalar::Bool(b) => b as i64 as f64,
            // Only rules registered for complex see complex numbers (see rules::complex).
            Scalar::Complex(re, _) => re,
        }
    }
    /// The dtype a wrapped Python number of this kind has.
    pub fn dtype(self) -> DType {
        match self {
            Scalar::Int(_) => DType::I64,
            Scalar::Float(_) => DType::F32,
            Scalar::Bool(_) => DType::Bool,
            Scalar::Complex(..) => DType::C64,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Args {
    pub items: Vec<(String, Arg)>,
}

impl Args {
    pub fn get(&self, name: &str) -> Option<&Arg> {
        self.items.iter().find(|(n, _)| n == name).map(|(_, a)| a)
    }

    pub fn has(&self, name: &str) -> bool {
        !matches!(self.get(name), None | Some(Arg::None))
    }

    pub fn tensor(&self, name: &str) -> LResult<&TensorArg> {
        match self.get(name) {
            Some(Arg::Tensor(t)) => Ok(t),
            _ => decline(format!("argument '{name}' is not a tensor")),
        }
    }

    pub fn opt_tensor(&self, name: &str) -> Option<&TensorArg> {
        match self.get(name) {
            Some(Arg::Tensor(t)) => Some(t),
            _ => None,
        }
    }

    pub fn tensors(&self, name: &str) -> LResult<Vec<&TensorArg>> {
        match self.get(name) {
            Some(Arg::List(items)) => items
                .iter()
                .map(|a| match a {
                    Arg::Tensor(t) => Ok(t),
                    _ => decline(format!("argument '{name}' holds a non-tensor")),
                })
                .collect(),
            _ => decline(format!("argument '{name}' is not a tensor list")),
        }
    }

    /// A list of optional tensors (`Tensor?[]`, as `index` takes).
    pub fn opt_tensors(&self, name: &str) -> LResult<Vec<Option<&TensorArg>>> {
        match self.get(name) {
            Some(Arg::List(items)) => Ok(items
                .iter()
                .map(|a| match a {
                    Arg::Tensor(t) => Some(t),
                    _ => None,
                })
                .collect()),
            _ => decline(format!("argument '{name}' is not a tensor list")),
        }
    }

    pub fn int(&self, name: &str) -> LResult<i64> {
        match self.get(name) {
            Some(Arg::Int(i)) => Ok(*i),
            Some(Arg::Bool(b)) => Ok(*b as i64),
            _ => decline(format!("argument '{name}' is not an int")),
        }
    }

    pub fn int_or(&self, name: &str, default: i64) -> i64 {
        self.opt_int(name).unwrap_or(default)
    }

    pub fn opt_int(&self, name: &str) -> Option<i64> {
        match self.get(name) {
            Some(Arg::Int(i)) => Some(*i),
            _ => None,
        }
    }

    pub fn float(&self, name: &str) -> LResult<f64> {
        match self.get(name) {
            Some(Arg::Float(f)) => Ok(*f),
            Some(Arg::Int(i)) => Ok(*i as f64),
            Some(Arg::Bool(b)) => Ok(*b as i64 as f64),
            _ => decline(format!("argument '{name}' is not a float")),
        }
    }

    pub fn opt_float(&self, name: &str) -> Option<f64> {
        self.float(name).ok()
    }

    pub fn bool_or(&self, name: &str, default: bool) -> bool {
        match self.get(name) {
            Some(Arg::Bool(b)) => *b,
            Some(Arg::Int(i)) => *i != 0,
            _ => default,
        }
    }

    pub fn str_or<'a>(&'a self, name: &str, default: &'a str) -> &'a str {
        match self.get(name) {
            Some(Arg::Str(s)) => s,
            _ => default,
        }
    }

    pub fn opt_str(&self, name: &str) -> Option<&str> {
        match self.get(name) {
            Some(Arg::Str(s)) => Some(s),
            _ => None,
        }
    }

    /// A `Scalar` argument (or a number given where a Scalar is expected).
    pub fn scalar(&self, name: &str) -> LResult<Scalar> {
        match self.get(name) {
            Some(Arg::Int(i)) => Ok(Scalar::Int(*i)),
            Some(Arg::Float(f)) => Ok(Scalar::Float(*f)),
            Some(Arg::Bool(b)) => Ok(Scalar::Bool(*b)),
            Some(Arg::Complex(re, im)) => Ok(Scalar::Complex(*re, *im)),
            _ => decline(format!("argument '{name}' is not a scalar")),
        }
    }

    pub fn opt_scalar(&self, name: &str) -> Option<Scalar> {
        self.scalar(name).ok()
    }

    /// An `int[]` argument; a bare int (as `dim=1` in `int[1]`) is a one-element list.
    pub fn ints(&self, name: &str) -> LResult<Vec<i64>> {
        match self.get(name) {
            Some(Arg::List(items)) => items
                .iter()
                .map(|a| match a {
                    Arg::Int(i) => Ok(*i),
                    _ => decline(format!("argument '{name}' holds a non-int")),
                })
                .collect(),
            Some(Arg::Int(i)) => Ok(vec![*i]),
            _ => decline(format!("argument '{name}' is not an int list")),
        }
    }

    pub fn opt_ints(&self, name: &str) -> Option<Vec<i64>> {
        match self.get(name) {
            None | Some(Arg::None) => None,
            _ => self.ints(name).ok(),
        }
    }

    pub fn floats(&self, name: &str) -> LResult<Vec<f64>> {
        match self.get(name) {
            Some(Arg::List(items)) => items
                .iter()
                .map(|a| match a {
                    Arg::Float(f) => Ok(*f),
                    Arg::Int(i) => Ok(*i as f64),
                    _ => decline(format!("argument '{name}' holds a non-float")),
                })
                .collect(),
            _ => decline(format!("argument '{name}' is not a float list")),
        }
    }

    pub fn bools(&self, name: &str) -> LResult<Vec<bool>> {
        match self.get(name) {
            Some(Arg::List(items)) => items
                .iter()
                .map(|a| match a {
                    Arg::Bool(b) => Ok(*b),
                    _ => decline(format!("argument '{name}' holds a non-bool")),
                })
                .collect(),
            _ => decline(format!("argument '{name}' is not a bool list")),
        }
    }

    pub fn opt_dtype(&self, name: &str) -> Option<DType> {
        match self.get(name) {
            Some(Arg::ScalarType(d)) => Some(*d),
            _ => None,
        }
    }

    /// Scalars given as a list (`Scalar[]` of `_foreach_add.ScalarList`).
    pub fn scalars(&self, name: &str) -> LResult<Vec<Scalar>> {
        match self.get(name) {
            Some(Arg::List(items)) => items
                .iter()
                .map(|a| match a {
                    Arg::Int(i) => Ok(Scalar::Int(*i)),
                    Arg::Float(f) => Ok(Scalar::Float(*f)),
                    Arg::Bool(b) => Ok(Scalar::Bool(*b)),
                    Arg::Complex(re, im) => Ok(Scalar::Complex(*re, *im)),
                    _ => decline(format!("argument '{name}' holds a non-scalar")),
                })
                .collect(),
            _ => decline(format!("argument '{name}' is not a scalar list")),
        }
    }
}

/// Unit tests of rules: a fresh builder parameter as a tensor argument.
#[cfg(test)]
pub(crate) fn param_arg(b: &mut crate::Builder, dt: DType, shape: &[i64]) -> Arg {
    let value = b.param(stablehlo::TensorType::new(dt, shape));
    Arg::Tensor(TensorArg {
        value,
        dtype: dt,
        shape: shape.to_vec(),
        wrapped_number: false,
    })
}
