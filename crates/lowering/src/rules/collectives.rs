//! XLA-native collectives, for programs compiled with one replica per rank (`pjrt`'s
//! `compile_replicated`): the values move inside the program, so a step keeps its
//! collectives in its one program. Each rule takes the ranks of its groups as replica ids
//! (`ranks`, the groups back to back, `group_size` each), as c10d's groups name them; the
//! functional collectives' semantics (`_c10d_functional`): gathers and scatters along dim 0,
//! in group order.
//!
//! Runs on the CPU plugin with its devices driven by one process; the multi-process wiring
//! these need on GPU/TPU (see ARCHITECTURE.md) is not there yet, so the eager and compiled
//! paths still use the c10d backend (Gloo on the CPU plugin).

use stablehlo::ReduceKind;

use super::input;
use crate::{user_err, Ctx, ErrorKind, LResult, Out, Rule};

/// The replica groups: `ranks` cut into `group_size` pieces.
fn groups(c: &Ctx) -> LResult<Vec<Vec<i64>>> {
    let ranks = c.args.ints("ranks")?;
    let n = c.args.int("group_size")?;
    if n <= 0 || ranks.is_empty() || ranks.len() as i64 % n != 0 {
        return user_err(
            ErrorKind::Value,
            format!("{}: {} ranks do not form groups of {n}", c.op, ranks.len()),
        );
    }
    Ok(ranks.chunks(n as usize).map(<[i64]>::to_vec).collect())
}

/// c10d's reduce op by name, and whether it averages.
fn reduce_op(c: &Ctx) -> LResult<(ReduceKind, bool)> {
    let dt = input(c)?.dtype;
    let op = c
        .args
        .opt_str("reduce_op")
        .unwrap_or("sum")
        .to_ascii_lowercase();
    let bits = dt.is_int() || dt == crate::DType::Bool;
    Ok(match op.as_str() {
        "sum" => (ReduceKind::Sum, false),
        "avg" if dt.is_float() => (ReduceKind::Sum, true),
        "product" => (ReduceKind::Prod, false),
        "min" => (ReduceKind::Min, false),
        "max" => (ReduceKind::Max, false),
        "band" if bits => (ReduceKind::And, false),
        "bor" if bits => (ReduceKind::Or, false),
        "bxor" if bits => (ReduceKind::Xor, false),
        _ => {
            return user_err(
                ErrorKind::Value,
                format!(
                    "{}: reduce op '{op}' is not supported for {}",
                    c.op,
                    crate::promote::torch_name(dt)
                ),
            )
        }
    })
}

fn dim0(c: &Ctx, n: usize, what: &str) -> LResult<()> {
    let t = input(c)?;
    if t.shape.is_empty() || t.shape[0] % n as i64 != 0 {
        return user_err(
            ErrorKind::Value,
            format!(
                "{}: the input's first dim ({:?}) must split into {n} equal {what}",
                c.op,
                t.shape.first()
            ),
        );
    }
    Ok(())
}

fn all_reduce(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = input(c)?.value;
    let groups = groups(c)?;
    let (kind, avg) = reduce_op(c)?;
    let r = c.b.all_reduce(x, &groups, kind);
    let r = if avg {
        super::scale(c.b, r, 1.0 / groups[0].len() as f64)
    } else {
        r
    };
    Ok(vec![Out::T(r)])
}

fn all_gather(c: &mut Ctx) -> LResult<Vec<Out>> {
    let t = input(c)?;
    let groups = groups(c)?;
    let x = if t.shape.is_empty() {
        c.b.reshape(t.value, &[1])
    } else {
        t.value
    };
    Ok(vec![Out::T(c.b.all_gather(x, 0, &groups))])
}

fn reduce_scatter(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = input(c)?.value;
    let groups = groups(c)?;
    dim0(c, groups[0].len(), "pieces")?;
    let (kind, avg) = reduce_op(c)?;
    let r = c.b.reduce_scatter(x, 0, &groups, kind);
    let r = if avg {
        super::scale(c.b, r, 1.0 / groups[0].len() as f64)
    } else {
        r
    };
    Ok(vec![Out::T(r)])
}

fn all_to_all(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = input(c)?.value;
    let groups = groups(c)?;
    dim0(c, groups[0].len(), "splits")?;
    Ok(vec![Out::T(c.b.all_to_all(x, 0, 0, &groups))])
}

/// Sends along `pairs` (source, target replica ids, back to back): send/recv and rings.
fn permute(c: &mut Ctx) -> LResult<Vec<Out>> {
    let x = input(c)?.value;
    let flat = c.args.ints("pairs")?;
    if flat.len() % 2 != 0 {
        return user_err(
            ErrorKind::Value,
            format!("{}: pairs must be (source, target) ids", c.op),
        );
    }
    let pairs: Vec<(i64, i64)> = flat.chunks(2).map(|p| (p[0], p[1])).collect();
    Ok(vec![Out::T(c.b.collective_permute(x, &pairs))])
}

pub const RULES: &[(&str, Rule)] = &[
    ("torch_pjrt::all_reduce", all_reduce),
    ("torch_pjrt::all_gather", all_gather),
    ("torch_pjrt::reduce_scatter", reduce_scatter),
    ("torch_pjrt::all_to_all", all_to_all),
    ("torch_pjrt::collective_permute", permute),
];
