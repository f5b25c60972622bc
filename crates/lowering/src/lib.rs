//! Lowering rules: one rule per ATen op, in one table (`rules::TABLE`).
//!
//! A rule receives the op's arguments (tensors already as StableHLO values) and emits the
//! ops computing the functional result. The runtime owns everything around it: reading
//! views out of storages, writing `out=` and in-place results back, caching, executing.
//! Shape, dtype and dimension logic lives in `shape`/`promote` and is shared by all rules.

pub mod args;
pub mod promote;
pub mod rules;
pub mod shape;

pub use args::{Arg, Args, TensorArg};
pub use stablehlo::{Builder, DType, TensorType, Value};

/// Python exception types a lowering can raise, as PyTorch on CPU would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    Runtime,
    Value,
    Type,
    Index,
    NotImplemented,
}

#[derive(Clone, Debug)]
pub enum LowerError {
    /// No native rule for these arguments: the runtime uses the CPU fallback.
    Declined(String),
    /// A user mistake, reported as PyTorch reports it.
    User(ErrorKind, String),
}

pub type LResult<T> = Result<T, LowerError>;

pub fn user_err<T>(kind: ErrorKind, msg: impl Into<String>) -> LResult<T> {
    Err(LowerError::User(kind, msg.into()))
}

pub fn decline<T>(why: impl Into<String>) -> LResult<T> {
    Err(LowerError::Declined(why.into()))
}

/// A rule's result, one per functional return of the op.
#[derive(Clone, Debug)]
pub enum Out {
    T(Value),
    List(Vec<Value>),
    /// A Python int/float/bool return computed on the host side is not a lowering;
    /// rules that return `None` (an optional tensor) use this.
    None,
}

/// What a rule may ask of the runtime beyond its arguments.
pub struct Ctx<'a> {
    pub b: &'a mut Builder,
    pub op: &'a str,
    pub overload: &'a str,
    pub args: &'a Args,
    /// The RNG state input (u64[2]: seed, offset) if the rule asked for one.
    pub rng_state: Option<Value>,
    /// Elements of random bits the rule consumed (the runtime advances the generator).
    pub rng_consumed: u64,
    /// Values to store into tensor arguments the schema does not mark as mutated
    /// (e.g. BatchNorm's running stats): (argument name, new value).
    pub writes: Vec<(String, Value)>,
    /// Dtypes of the `out=` tensors (factories like `arange.out` compute in them).
    pub out_dtypes: Vec<DType>,
    /// Tensor arguments whose memory layout is not contiguous (the few CPU kernels whose
    /// results depend on strides, like det's LU factors, follow them).
    pub strided: Vec<String>,
}

impl<'a> Ctx<'a> {
    pub fn new(b: &'a mut Builder, op: &'a str, overload: &'a str, args: &'a Args) -> Self {
        Ctx {
            b,
            op,
            overload,
            args,
            rng_state: None,
            rng_consumed: 0,
            writes: Vec::new(),
            out_dtypes: Vec::new(),
            strided: Vec::new(),
        }
    }

    /// Whether tensor argument `name` is laid out contiguously.
    pub fn is_contiguous(&self, name: &str) -> bool {
        !self.strided.iter().any(|n| n == name)
    }

    /// The value of tensor argument `name`.
    pub fn t(&self, name: &str) -> LResult<Value> {
        self.args.tensor(name).map(|t| t.value)
    }

    /// Asks the runtime to store `v` into tensor argument `name` after the op.
    pub fn write_arg(&mut self, name: &str, v: Value) {
        self.writes.push((name.to_string(), v));
    }

    /// The RNG state parameter, created on first use.
    pub fn rng(&mut self) -> Value {
        if let Some(v) = self.rng_state {
            return v;
        }
        let v = self.b.param(TensorType::new(DType::I64, &[2]));
        self.rng_state = Some(v);
        v
    }
}

/// A lowering rule.
pub type Rule = fn(&mut Ctx) -> LResult<Vec<Out>>;

/// Finds the rule for `op` (e.g. "aten::add").
pub fn find_rule(op: &str) -> Option<Rule> {
    rules::lookup(op)
}
