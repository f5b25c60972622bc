//! Mixed precision's gradient-scaler kernels (`torch.amp.GradScaler`): unscaling gradients
//! while looking for infinities, and the scale's update. Both are in-place ops; the runtime
//! writes the first result into `self` and `Ctx::write_arg` values into the other mutated
//! arguments, so a scaler step never reads a value back to the host.

use super::opmath;
use crate::{user_err, Ctx, DType, ErrorKind, LResult, Out, Rule, TensorArg};

/// The functional overloads (what `torch.compile` functionalizes the in-place ops into)
/// return the second mutated argument's new value instead of writing it.
fn functional(c: &Ctx) -> bool {
    !c.op.ends_with('_') && c.overload != "out"
}

/// A one-element tensor argument of `dtype` (`kind` names it in the kernels' message:
/// "a float", "an int"); `what` is the kernels' name for it.
fn one_element(c: &Ctx, name: &str, what: &str, dtype: DType, kind: &str) -> LResult<TensorArg> {
    let t = c.args.tensor(name)?.clone();
    if t.shape.iter().product::<i64>() != 1 {
        return user_err(
            ErrorKind::Runtime,
            format!("{what} must be a 1-element tensor."),
        );
    }
    if t.dtype != dtype {
        return user_err(ErrorKind::Runtime, format!("{what} must be {kind} tensor."));
    }
    Ok(t)
}

/// `_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)`: every
/// gradient times `inv_scale` (in its opmath type, rounded once), and `found_inf` set to 1
/// if any gradient holds an infinity or NaN (left as it was otherwise).
fn non_finite_check_and_unscale(c: &mut Ctx) -> LResult<Vec<Out>> {
    let found = one_element(c, "found_inf", "found_inf", DType::F32, "a float")?;
    let inv = one_element(c, "inv_scale", "inv_scale", DType::F32, "a float")?;
    let grads: Vec<TensorArg> = c.args.tensors("self")?.into_iter().cloned().collect();
    if let Some(g) = grads.iter().find(|g| !g.dtype.is_float()) {
        return super::not_implemented("_amp_foreach_non_finite_check_and_unscale_cpu", g.dtype);
    }
    let b = &mut *c.b;
    let inv = b.reshape(inv.value, &[]);
    let mut any = b.full(DType::Bool, &[], 0.0);
    let mut outs = Vec::with_capacity(grads.len());
    for g in &grads {
        let x = b.convert(g.value, opmath(g.dtype));
        let fin = b.is_finite(x);
        let dims: Vec<i64> = (0..g.shape.len() as i64).collect();
        let all = b.reduce(fin, &dims, stablehlo::ReduceKind::And);
        let bad = b.not(all);
        any = b.or(any, bad);
        let s = b.convert(inv, opmath(g.dtype));
        let s = b.broadcast_to(s, &g.shape);
        let r = b.mul(x, s);
        outs.push(b.convert(r, g.dtype));
    }
    let one = b.full(DType::F32, &found.shape, 1.0);
    let any = b.broadcast_to(any, &found.shape);
    let f = b.select(any, one, found.value);
    if functional(c) {
        return Ok(vec![Out::List(outs), Out::T(f)]);
    }
    c.write_arg("found_inf", f);
    Ok(vec![Out::List(outs)])
}

/// `_amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, interval)`: after
/// an overflow the scale backs off and the tracker restarts; after `interval` clean steps
/// in a row the scale grows (unless that overflows float32) and the tracker restarts.
fn update_scale(c: &mut Ctx) -> LResult<Vec<Out>> {
    let tracker = one_element(c, "growth_tracker", "growth_tracker", DType::I32, "an int")?;
    let scale = one_element(c, "self", "current_scale", DType::F32, "a float")?;
    let found = one_element(c, "found_inf", "found_inf", DType::F32, "a float")?;
    let growth = c.args.float("scale_growth_factor")?;
    let backoff = c.args.float("scale_backoff_factor")?;
    let interval = c.args.int("growth_interval")?;
    let b = &mut *c.b;
    let zero_f = b.splat(found.value, 0.0);
    let overflow = b.compare(found.value, zero_f, stablehlo::CmpDir::Ne);
    let one = b.splat(tracker.value, 1.0);
    let next = b.add(tracker.value, one);
    let limit = b.splat(tracker.value, interval as f64);
    let grow = b.compare(next, limit, stablehlo::CmpDir::Eq);
    let backed = {
        let k = b.splat(scale.value, backoff);
        b.mul(scale.value, k)
    };
    let grown = {
        let k = b.splat(scale.value, growth);
        let g = b.mul(scale.value, k);
        let fin = b.is_finite(g);
        b.select(fin, g, scale.value)
    };
    let kept = b.select(grow, grown, scale.value);
    let new_scale = b.select(overflow, backed, kept);
    let zero = b.splat(tracker.value, 0.0);
    let counted = b.select(grow, zero, next);
    let new_tracker = b.select(overflow, zero, counted);
    if functional(c) {
        return Ok(vec![Out::T(new_scale), Out::T(new_tracker)]);
    }
    c.write_arg("growth_tracker", new_tracker);
    Ok(vec![Out::T(new_scale)])
}

pub const RULES: &[(&str, Rule)] = &[
    (
        "aten::_amp_foreach_non_finite_check_and_unscale",
        non_finite_check_and_unscale,
    ),
    ("aten::_amp_update_scale", update_scale),
];
