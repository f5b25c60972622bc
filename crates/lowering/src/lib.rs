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
    /// torch.OutOfMemoryError (a device allocation refused; see runtime's `memory`).
    OutOfMemory,
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

const NO_RULE: &str = "no lowering rule for ";

/// The decline of an op the table has no rule for.
pub fn no_rule(op: &str) -> String {
    format!("{NO_RULE}{op}")
}

/// Whether a decline only says that no rule exists (a fallback warning need not repeat it).
pub fn is_no_rule(why: &str) -> bool {
    why.starts_with(NO_RULE)
}

/// A rule's result, one per functional return of the op.
#[derive(Clone, Debug)]
pub enum Out {
    T(Value),
    List(Vec<Value>),
    /// An undefined (optional) tensor.
    None,
    /// An int return the rule knows from the shapes (`SymInt max_q`), not computed.
    Int(i64),
}

/// A condition on the op's data that only the device can evaluate (an index in range):
/// `bad` is an `i64[]` the runtime reads after the op ran: `NO_BAD_INDEX`, or an offending
/// index, which raises `kind` with `msg` (its `{index}` replaced by the value).
#[derive(Clone, Debug)]
pub struct Check {
    pub bad: Value,
    pub kind: ErrorKind,
    pub msg: String,
}

/// What a `Check` holds when every index was in range.
pub const NO_BAD_INDEX: i64 = i64::MIN;

impl Check {
    /// The error for the check's value `bad`, if it failed.
    pub fn error(kind: ErrorKind, msg: &str, bad: i64) -> Option<(ErrorKind, String)> {
        (bad != NO_BAD_INDEX).then(|| (kind, msg.replace("{index}", &bad.to_string())))
    }
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
    /// Data-dependent conditions the runtime verifies after the op (see `Check`).
    pub checks: Vec<Check>,
    /// Why this lowering is wrong in a padded program, if it is (see `check_range`).
    pub refuses_padding: Option<&'static str>,
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
            checks: Vec::new(),
            refuses_padding: None,
        }
    }

    /// Asks the runtime to raise `kind`/`msg` unless every element of the integer tensor
    /// `idx` lies in `[lo, hi)` (XLA clamps out-of-range gathers and drops such scatters,
    /// where PyTorch raises). `msg` may name the offending value as `{index}`.
    ///
    /// In a padded program (shape buckets) a constant bound may be a padded size, which
    /// would let an index past the real size through: the program is refused
    /// (`refuses_padding`) and the call runs exactly. Use `check_index_into` there.
    pub fn check_range(&mut self, idx: Value, lo: i64, hi: i64, kind: ErrorKind, msg: String) {
        if self.b.padded() {
            self.refuses_padding = Some("checks indices against a constant bound");
        }
        let idx = self.b.convert(idx, DType::I64);
        let h = self.b.splat(idx, hi as f64);
        self.check_range_below(idx, lo, h, kind, msg);
    }

    /// `check_range(idx, 0, n)` where `n` is `x`'s size along `dim`: in a padded program
    /// (shape buckets) its real size, as duck sizing pads a dim that equals a changing size.
    /// `x` is an input of the op (or its `convert`).
    pub fn check_index_into(
        &mut self,
        idx: Value,
        x: Value,
        dim: usize,
        kind: ErrorKind,
        msg: String,
    ) {
        let idx = self.b.convert(idx, DType::I64);
        let h = self.b.count(x, &[dim as i64], idx);
        self.check_range_below(idx, 0, h, kind, msg);
    }

    /// Indices `idx` (i64) outside `[lo, h)`, `h` shaped like `idx`.
    fn check_range_below(&mut self, idx: Value, lo: i64, h: Value, kind: ErrorKind, msg: String) {
        let b = &mut *self.b;
        let l = b.splat(idx, lo as f64);
        let below = b.compare(idx, l, stablehlo::CmpDir::Lt);
        let above = b.compare(idx, h, stablehlo::CmpDir::Ge);
        let out = b.or(below, above);
        let none = b.constant_i64(DType::I64, NO_BAD_INDEX);
        let none = b.broadcast_to(none, &b.shape(idx));
        let bad = b.select(out, idx, none);
        let dims: Vec<i64> = (0..b.shape(bad).len() as i64).collect();
        let bad = b.reduce(bad, &dims, stablehlo::ReduceKind::Max);
        self.checks.push(Check { bad, kind, msg });
    }

    /// For ops whose out= tensors must have exactly dtype `want` (not any dtype the result
    /// casts to): PyTorch's RuntimeError `msg(found)` otherwise.
    pub fn require_out_dtype(&self, want: DType, msg: impl FnOnce(DType) -> String) -> LResult<()> {
        match self.out_dtypes.iter().find(|d| **d != want) {
            Some(d) => user_err(ErrorKind::Runtime, msg(*d)),
            None => Ok(()),
        }
    }

    /// `require_out_dtype` with the message of PyTorch's kernels that name C++ types.
    pub fn require_out_dtype_cpp(&self, want: DType) -> LResult<()> {
        self.require_out_dtype(want, |o| {
            format!(
                "Expected out tensor to have dtype {}, but got {} instead",
                promote::cpp_name(want),
                promote::cpp_name(o)
            )
        })
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

/// Finds the rule for a call, `complex` when one of its tensors or numbers is complex.
pub fn find_rule_for(op: &str, complex: bool) -> Option<Rule> {
    rules::lookup_for(op, complex)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_reports_the_offending_index_only_when_there_is_one() {
        let msg = "index {index} is out of bounds for dimension 0 with size 3";
        assert_eq!(Check::error(ErrorKind::Index, msg, NO_BAD_INDEX), None);
        assert_eq!(
            Check::error(ErrorKind::Index, msg, -4),
            Some((
                ErrorKind::Index,
                "index -4 is out of bounds for dimension 0 with size 3".to_string()
            ))
        );
    }

    #[test]
    fn check_range_adds_one_i64_scalar_output() {
        let mut b = Builder::new();
        let idx = b.param(TensorType::new(DType::I32, &[2, 3]));
        let args = Args::default();
        let mut c = Ctx::new(&mut b, "aten::take", "", &args);
        c.check_range(idx, -6, 6, ErrorKind::Index, "bad".into());
        let check = c.checks.pop().expect("one check");
        assert_eq!(c.b.ty(check.bad), &TensorType::new(DType::I64, &[]));
        assert!(c.checks.is_empty());
        assert!(c.refuses_padding.is_none());
    }

    #[test]
    fn a_constant_bound_refuses_a_padded_program() {
        let mut b = Builder::new();
        b.set_padded(true);
        let idx = b.param(TensorType::new(DType::I64, &[4]));
        let x = b.param(TensorType::new(DType::F32, &[8, 3]));
        let args = Args::default();
        let mut c = Ctx::new(&mut b, "aten::index_select", "", &args);
        c.check_index_into(idx, x, 0, ErrorKind::Index, "bad".into());
        assert!(c.refuses_padding.is_none(), "the real size bounds it");
        c.check_range(idx, 0, 8, ErrorKind::Index, "bad".into());
        assert!(c.refuses_padding.is_some());
    }
}
