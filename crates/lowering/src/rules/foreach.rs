//! `_foreach_*` ops. One generic rule runs the per-tensor rule of the op (`aten::add` for
//! `_foreach_add`, ...) once per list element on the same builder, so a whole optimizer
//! update compiles to one program. The table says, per foreach op, which rule to run and
//! how its arguments are filled from the foreach arguments; overloads (List, Scalar,
//! ScalarList, Tensor) differ only in which foreach argument is present.
//! In-place variants (`_foreach_add_`) reach this functional rule through the runtime.

use crate::args::Arg;
use crate::shape::reduce_dims;
use crate::{decline, user_err, Args, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg};

/// Where one argument of the per-element op comes from.
#[derive(Clone, Copy)]
enum Src {
    /// The first of these foreach arguments given: its element i if it is a list
    /// (tensors or scalars), else the argument itself (a scalar, or one tensor for all).
    Arg(&'static [&'static str]),
    /// Like `Arg`, but a tensor that is not a wrapped number holds one value per element
    /// (`addcmul.Tensor`'s packed scalars): element i is its entry i.
    Packed(&'static [&'static str]),
    /// The dtype of element i of a tensor list.
    DtypeOf(&'static str),
    /// The shape of element i of a tensor list.
    SizeOf(&'static str),
}

#[derive(Clone, Copy)]
enum Target {
    /// A rule of the table, looked up by name when the op runs.
    Named(&'static str),
    /// A per-element rule of this file.
    Local(Rule),
}

struct Spec {
    name: &'static str,
    target: Target,
    args: &'static [(&'static str, Src)],
}

const SELF: (&str, Src) = ("self", Src::Arg(&["self"]));
const OTHER: Src = Src::Arg(&["other", "scalar", "scalars"]);

const UNARY: &[(&str, Src)] = &[SELF];
const BINARY: &[(&str, Src)] = &[SELF, ("other", OTHER)];
const BINARY_ALPHA: &[(&str, Src)] = &[SELF, ("other", OTHER), ("alpha", Src::Arg(&["alpha"]))];
const CLAMP_MIN: &[(&str, Src)] = &[SELF, ("min", OTHER)];
const CLAMP_MAX: &[(&str, Src)] = &[SELF, ("max", OTHER)];
const POW: &[(&str, Src)] = &[SELF, ("exponent", Src::Arg(&["exponent"]))];
const ADDC: &[(&str, Src)] = &[
    SELF,
    ("tensor1", Src::Arg(&["tensor1"])),
    ("tensor2", Src::Arg(&["tensor2"])),
    ("value", Src::Packed(&["value", "scalars"])),
];
const LERP: &[(&str, Src)] = &[
    SELF,
    ("end", Src::Arg(&["tensors1"])),
    ("weight", Src::Arg(&["weight", "weights"])),
];
const COPY: &[(&str, Src)] = &[
    ("self", Src::Arg(&["src"])),
    ("dtype", Src::DtypeOf("self")),
    ("size", Src::SizeOf("self")),
];
const NORM: &[(&str, Src)] = &[
    SELF,
    ("ord", Src::Arg(&["ord"])),
    ("dtype", Src::Arg(&["dtype"])),
];

macro_rules! table {
    ($( $name:literal => $target:expr, $args:expr; )*) => {
        const SPECS: &[Spec] = &[
            $( Spec { name: concat!("aten::_foreach_", $name), target: $target, args: $args }, )*
        ];
        pub const RULES: &[(&str, Rule)] = &[ $( (concat!("aten::_foreach_", $name), foreach), )* ];
    };
}

use Target::{Local, Named};

table! {
    "add" => Named("aten::add"), BINARY_ALPHA;
    "sub" => Named("aten::sub"), BINARY_ALPHA;
    "mul" => Named("aten::mul"), BINARY;
    "div" => Named("aten::div"), BINARY;
    "maximum" => Named("aten::maximum"), BINARY;
    "minimum" => Named("aten::minimum"), BINARY;
    "clamp_min" => Named("aten::clamp_min"), CLAMP_MIN;
    "clamp_max" => Named("aten::clamp_max"), CLAMP_MAX;
    "pow" => Named("aten::pow"), POW;
    "addcmul" => Named("aten::addcmul"), ADDC;
    "addcdiv" => Named("aten::addcdiv"), ADDC;
    "lerp" => Named("aten::lerp"), LERP;
    "copy" => Named("torch_pjrt::copy"), COPY;
    "clone" => Named("aten::clone"), UNARY;
    "zero" => Named("aten::zero"), UNARY;
    "max" => Named("aten::max"), UNARY;
    "norm" => Local(norm), NORM;
    "abs" => Named("aten::abs"), UNARY;
    "acos" => Named("aten::acos"), UNARY;
    "asin" => Named("aten::asin"), UNARY;
    "atan" => Named("aten::atan"), UNARY;
    "ceil" => Named("aten::ceil"), UNARY;
    "cos" => Named("aten::cos"), UNARY;
    "cosh" => Named("aten::cosh"), UNARY;
    "erf" => Named("aten::erf"), UNARY;
    "erfc" => Named("aten::erfc"), UNARY;
    "exp" => Named("aten::exp"), UNARY;
    "expm1" => Named("aten::expm1"), UNARY;
    "floor" => Named("aten::floor"), UNARY;
    "frac" => Named("aten::frac"), UNARY;
    "lgamma" => Named("aten::lgamma"), UNARY;
    "log" => Named("aten::log"), UNARY;
    "log10" => Named("aten::log10"), UNARY;
    "log1p" => Named("aten::log1p"), UNARY;
    "log2" => Named("aten::log2"), UNARY;
    "neg" => Named("aten::neg"), UNARY;
    "reciprocal" => Named("aten::reciprocal"), UNARY;
    "round" => Named("aten::round"), UNARY;
    "rsqrt" => Named("aten::rsqrt"), UNARY;
    "sigmoid" => Named("aten::sigmoid"), UNARY;
    "sign" => Named("aten::sign"), UNARY;
    "sin" => Named("aten::sin"), UNARY;
    "sinh" => Named("aten::sinh"), UNARY;
    "sqrt" => Named("aten::sqrt"), UNARY;
    "tan" => Named("aten::tan"), UNARY;
    "tanh" => Named("aten::tanh"), UNARY;
    "trunc" => Named("aten::trunc"), UNARY;
}

/// The shim returns at most this many results (a list takes one more for its length).
const MAX_RESULTS: usize = 511;

/// The foreach argument a `Src::Arg` reads, if given.
fn source<'a>(args: &'a Args, names: &[&str]) -> Option<&'a Arg> {
    names.iter().find_map(|n| args.get(n))
}

/// A list of tensors (not of numbers; the runtime may pass Python floats as wrapped 0-d tensors).
fn is_tensor_list(items: &[Arg]) -> bool {
    items
        .iter()
        .all(|a| matches!(a, Arg::Tensor(t) if !t.wrapped_number))
}

/// The number of elements, with PyTorch's checks that the lists agree.
fn element_count(c: &Ctx, spec: &Spec) -> LResult<usize> {
    let mut tensor_lists: Vec<usize> = Vec::new();
    let mut scalar_lists: Vec<usize> = Vec::new();
    for (_, src) in spec.args {
        let (Src::Arg(names) | Src::Packed(names)) = src else {
            continue;
        };
        if let Some(Arg::List(items)) = source(c.args, names) {
            if is_tensor_list(items) {
                tensor_lists.push(items.len());
            } else {
                scalar_lists.push(items.len());
            }
        }
    }
    let n = match tensor_lists.first() {
        Some(n) => *n,
        None => return decline("foreach op without a tensor list"),
    };
    if n == 0 {
        return user_err(
            ErrorKind::Runtime,
            "Tensor list must have at least one tensor.",
        );
    }
    if let Some(m) = tensor_lists.iter().find(|m| **m != n) {
        return user_err(
            ErrorKind::Runtime,
            format!("Tensor lists must have the same number of tensors, got {n} and {m}"),
        );
    }
    if scalar_lists.iter().any(|m| *m != n) {
        return user_err(
            ErrorKind::Runtime,
            "Tensor list must have same number of elements as scalar list.",
        );
    }
    Ok(n)
}

fn list_tensor<'a>(args: &'a Args, name: &str, i: usize) -> LResult<&'a TensorArg> {
    match args.get(name) {
        Some(Arg::List(items)) => match items.get(i) {
            Some(Arg::Tensor(t)) => Ok(t),
            _ => decline(format!("argument '{name}' element {i} is not a tensor")),
        },
        _ => decline(format!("argument '{name}' is not a tensor list")),
    }
}

/// Entry `i` of a packed scalar tensor, as a 0-d tensor.
fn packed_entry(c: &mut Ctx, t: &TensorArg, n: usize, i: usize) -> LResult<Arg> {
    if t.shape.len() != 1 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected packed scalar Tensor to be of dimension 1. Got {} instead.",
                t.shape.len()
            ),
        );
    }
    if t.shape[0] != n as i64 {
        return user_err(
            ErrorKind::Runtime,
            format!(
                "Expected length of scalars to match input of length {n} but got {} instead.",
                t.shape[0]
            ),
        );
    }
    let i = i as i64;
    let v = c.b.slice(t.value, &[i], &[i + 1], &[1]);
    let v = c.b.reshape(v, &[]);
    Ok(Arg::Tensor(TensorArg {
        value: v,
        dtype: t.dtype,
        shape: vec![],
        wrapped_number: false,
    }))
}

/// The arguments of the per-element op for element `i` of `n`.
fn element_args(c: &mut Ctx, spec: &Spec, n: usize, i: usize) -> LResult<Args> {
    let mut items = Vec::with_capacity(spec.args.len());
    for (name, src) in spec.args {
        let arg = match src {
            Src::Arg(names) | Src::Packed(names) => match source(c.args, names) {
                None => continue,
                Some(Arg::List(items)) => items.get(i).cloned().unwrap_or(Arg::None),
                Some(Arg::Tensor(t)) if matches!(src, Src::Packed(_)) && !t.wrapped_number => {
                    let t = t.clone();
                    packed_entry(c, &t, n, i)?
                }
                Some(Arg::Tensor(t)) => {
                    if c.overload == "Tensor" && !t.shape.is_empty() {
                        return user_err(
                            ErrorKind::Runtime,
                            format!(
                                "scalar tensor expected to be 0 dim but it has {} dimensions and {} elements.",
                                t.shape.len(),
                                t.shape.iter().product::<i64>()
                            ),
                        );
                    }
                    Arg::Tensor(t.clone())
                }
                Some(a) => a.clone(),
            },
            Src::DtypeOf(list) => Arg::ScalarType(list_tensor(c.args, list, i)?.dtype),
            Src::SizeOf(list) => Arg::List(
                list_tensor(c.args, list, i)?
                    .shape
                    .iter()
                    .map(|d| Arg::Int(*d))
                    .collect(),
            ),
        };
        items.push((name.to_string(), arg));
    }
    Ok(Args { items })
}

/// Every `_foreach_*` op: the per-element rule over the lists, results as one list.
fn foreach(c: &mut Ctx) -> LResult<Vec<Out>> {
    let base = c.op.trim_end_matches('_');
    let Some(spec) = SPECS.iter().find(|s| s.name == base) else {
        return decline(format!("no foreach entry for {}", c.op));
    };
    let (target, rule) = match spec.target {
        Target::Named(name) => match crate::rules::lookup(name) {
            Some(r) => (name, r),
            None => return decline(crate::no_rule(name)),
        },
        Target::Local(r) => (spec.name, r),
    };
    let n = element_count(c, spec)?;
    let inplace = c.op.ends_with('_');
    if !inplace && n > MAX_RESULTS {
        return decline(format!(
            "{} over {n} tensors returns too many results",
            c.op
        ));
    }
    let mut outs = Vec::with_capacity(n);
    for i in 0..n {
        let args = element_args(c, spec, n, i)?;
        let mut sub = Ctx::new(&mut *c.b, target, "", &args);
        let r = rule(&mut sub)?;
        if sub.rng_state.is_some() || !sub.writes.is_empty() {
            return decline(format!("{target} needs more than its result"));
        }
        match r.first() {
            Some(Out::T(v)) => outs.push(*v),
            _ => return decline(format!("{target} does not return one tensor")),
        }
    }
    Ok(vec![Out::List(outs)])
}

/// `linalg.vector_norm` of a whole tensor, as `_foreach_norm` takes it per element.
fn norm(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = c.args.tensor("self")?.clone();
    super::norms::vector_norm_input(t.dtype)?;
    if c.args.opt_tensor("ord").is_some() {
        return decline("norm order given as a tensor");
    }
    let ord = c.args.opt_scalar("ord").map(|s| s.as_f64()).unwrap_or(2.0);
    let out = c.args.opt_dtype("dtype").unwrap_or(t.dtype);
    // Half types accumulate in float32, as PyTorch does.
    let acc = if out == DType::F64 || t.dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let dims = reduce_dims(None, t.shape.len())?;
    if ord.is_infinite() && t.shape.iter().product::<i64>() == 0 {
        return decline("infinity norm of an empty tensor");
    }
    let b = &mut *c.b;
    let x = b.convert(t.value, acc);
    let r = super::norms::norm_keep(b, x, &dims, ord);
    let r = b.reshape(r, &[]);
    Ok(vec![Out::T(b.convert(r, out))])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Builder, TensorType};

    fn tensor(b: &mut Builder, shape: &[i64]) -> Arg {
        let v = b.param(TensorType::new(DType::F32, shape));
        Arg::Tensor(TensorArg {
            value: v,
            dtype: DType::F32,
            shape: shape.to_vec(),
            wrapped_number: false,
        })
    }

    #[test]
    fn every_entry_is_registered_once() {
        assert_eq!(SPECS.len(), RULES.len());
        for s in SPECS {
            assert!(crate::rules::lookup(s.name).is_some(), "{}", s.name);
        }
    }

    #[test]
    fn add_list_with_alpha() {
        let mut b = Builder::new();
        let xs = Arg::List(vec![tensor(&mut b, &[2]), tensor(&mut b, &[3, 4])]);
        let ys = Arg::List(vec![tensor(&mut b, &[2]), tensor(&mut b, &[3, 4])]);
        let args = Args {
            items: vec![
                ("self".into(), xs),
                ("other".into(), ys),
                ("alpha".into(), Arg::Float(0.5)),
            ],
        };
        let mut c = Ctx::new(&mut b, "aten::_foreach_add_", "List", &args);
        let out = foreach(&mut c).unwrap();
        let Out::List(vs) = &out[0] else {
            panic!("list result")
        };
        assert_eq!(vs.len(), 2);
        assert_eq!(b.shape(vs[1]), vec![3, 4]);
    }

    #[test]
    fn scalar_list_length_is_checked() {
        let mut b = Builder::new();
        let xs = Arg::List(vec![tensor(&mut b, &[2]), tensor(&mut b, &[3])]);
        let args = Args {
            items: vec![
                ("self".into(), xs),
                ("scalars".into(), Arg::List(vec![Arg::Float(1.0)])),
            ],
        };
        let mut c = Ctx::new(&mut b, "aten::_foreach_mul", "ScalarList", &args);
        match foreach(&mut c) {
            Err(crate::LowerError::User(_, m)) => {
                assert_eq!(
                    m,
                    "Tensor list must have same number of elements as scalar list."
                )
            }
            _ => panic!("expected an error"),
        }
    }
}
