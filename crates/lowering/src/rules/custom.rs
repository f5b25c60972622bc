//! Custom kernels: StableHLO modules made outside the rule table (JAX and Pallas functions
//! exported by `jax.export`), registered once and called by `torch_pjrt::jax_call` like
//! any op. The kernel's functions become private functions of the calling program (see
//! `stablehlo::import`); in a deferred graph they sit next to the op fragments, so XLA
//! fuses the kernel with the ops around it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use stablehlo::import::Imported;

use crate::{user_err, Ctx, ErrorKind, LResult, Out, Rule, TensorType};

/// A registered kernel.
#[derive(Debug)]
pub struct Kernel {
    /// The user's name for it (error messages).
    pub name: String,
    pub module: Imported,
    /// `module.text`, shared by every program that calls it.
    pub text: Arc<str>,
}

fn registry() -> &'static Mutex<HashMap<String, Arc<Kernel>>> {
    static K: OnceLock<Mutex<HashMap<String, Arc<Kernel>>>> = OnceLock::new();
    K.get_or_init(Default::default)
}

/// Registers `kernel` under `id` (the runtime names it by a hash of its module).
pub fn register(id: &str, kernel: Kernel) -> Arc<Kernel> {
    let mut m = registry().lock().unwrap_or_else(|p| p.into_inner());
    m.entry(id.to_string())
        .or_insert_with(|| Arc::new(kernel))
        .clone()
}

pub fn get(id: &str) -> Option<Arc<Kernel>> {
    let m = registry().lock().unwrap_or_else(|p| p.into_inner());
    m.get(id).cloned()
}

fn describe(t: &TensorType) -> String {
    format!("{}{:?}", t.dtype.mlir(), t.shape)
}

/// `torch_pjrt::jax_call(Tensor[] args, str kernel) -> Tensor[]`.
fn jax_call(c: &mut Ctx) -> LResult<Vec<Out>> {
    // `id/suffix`: the Python side tells apart kernels with one module (their backwards
    // may differ); the module is the part before the slash.
    let id = c.args.str_or("kernel", "");
    let id = id.split('/').next().unwrap_or(id);
    let Some(k) = get(id) else {
        return user_err(
            ErrorKind::Runtime,
            format!("no custom kernel is registered as '{id}'; call the kernel through torch.tpu.pallas"),
        );
    };
    let args = c.args.tensors("args")?;
    let want = &k.module.inputs;
    if args.len() != want.len() {
        return user_err(
            ErrorKind::Type,
            format!(
                "kernel '{}' takes {} tensor arguments, got {}",
                k.name,
                want.len(),
                args.len()
            ),
        );
    }
    let mut vals = Vec::with_capacity(args.len());
    for (i, (a, w)) in args.iter().zip(want).enumerate() {
        let got = TensorType::new(a.dtype, &a.shape);
        if &got != w {
            return user_err(
                ErrorKind::Value,
                format!(
                    "kernel '{}' was traced with argument {i} as {}, got {}",
                    k.name,
                    describe(w),
                    describe(&got)
                ),
            );
        }
        vals.push(a.value);
    }
    c.b.add_func(&k.module.entry, &k.text);
    let outs = c.b.call(&k.module.entry, &vals, &k.module.outputs);
    Ok(vec![Out::List(outs)])
}

pub const RULES: &[(&str, Rule)] = &[("torch_pjrt::jax_call", jax_call)];
