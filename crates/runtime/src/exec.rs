//! Running one op: key -> cached program (or lower + compile) -> execute -> write back.
//!
//! The shim hands every op over as (name, overload, schema-named arguments). `.out` and
//! in-place variants use the functional rule; this module reads views out of storages,
//! writes results into `out=`/`self` (through their views), and returns new tensors.

use std::collections::HashMap;
use std::sync::Arc;

use lowering::promote::{can_cast, torch_name};
use lowering::shape::shape_str;
use lowering::{Arg, Args, Ctx, LowerError, Out, TensorArg};
use stablehlo::{Builder, DType, TensorType, Value};

use crate::buckets::{Padded, ReadView};
use crate::layout::{self, View};
use crate::storage::Storage;
use crate::worker::{Job, JobIn};
use crate::{host, Error, ErrorKind, Result, Runtime};

/// Where a tensor's elements are.
#[derive(Clone, Copy, Debug)]
pub enum Loc {
    Device(*const Storage),
    Host(*mut u8),
}

#[derive(Clone, Debug)]
pub struct TensorRef {
    pub loc: Loc,
    /// None for dtypes the device does not support (complex, quantized, ...).
    pub dtype: Option<DType>,
    pub view: View,
    pub nbytes: i64,
    pub wrapped: bool,
    pub device: usize,
}

impl TensorRef {
    pub(crate) fn storage(&self) -> Option<&Storage> {
        match self.loc {
            // SAFETY: the shim passes handles of storages that PyTorch keeps alive for
            // the duration of the call.
            Loc::Device(p) => Some(unsafe { &*p }),
            Loc::Host(_) => None,
        }
    }
}

#[derive(Clone, Debug)]
pub enum RArg {
    None,
    Tensor(TensorRef),
    Int(i64),
    Float(f64),
    /// A complex number (real, imaginary).
    Complex(f64, f64),
    Bool(bool),
    Str(String),
    /// None when the dtype is not one the device supports.
    ScalarType(Option<DType>),
    List(Vec<RArg>),
    /// Points at the generator's [seed, offset].
    Generator(*mut i64),
    /// A factory's tpu device index.
    Device(usize),
    Other(String),
}

#[derive(Clone, Debug)]
pub struct Param {
    pub name: String,
    pub arg: RArg,
    pub is_write: bool,
    pub is_out: bool,
}

#[derive(Debug)]
pub enum Ret {
    /// A new tensor; the handle holds one reference (`Storage::into_handle`) the caller now owns.
    Tensor {
        handle: *mut Storage,
        dtype: DType,
        sizes: Vec<i64>,
        device: usize,
    },
    Alias(usize),
    AliasElem(usize, usize),
    List(usize),
    Int(i64),
    Float(f64),
    Bool(bool),
    None,
}

#[derive(Debug)]
pub enum Outcome {
    Done(Vec<Ret>),
    Declined(String),
    /// out= arguments (index, sizes) that must be resized before calling again.
    Resize(Vec<(usize, Vec<i64>)>),
}

/// A tensor argument's position: (param index, list element).
pub(crate) type Path = (usize, Option<usize>);

#[derive(Clone)]
pub(crate) enum Input {
    Storage {
        path: Path,
        dtype: DType,
    },
    Host {
        path: Path,
        dtype: DType,
    },
    Rng {
        path: Option<Path>,
    },
    /// A staged tensor (bucketed programs): its view laid out in `padded` dims.
    Staged {
        path: Path,
        dtype: DType,
        padded: Vec<i64>,
    },
    /// The real size of dim `dim` of a staged tensor, as i32.
    Size {
        path: Path,
        dim: usize,
    },
    /// A staged tensor's storage as the flat buffer a bucketed program left there (padded
    /// to `padded`), or its exact buffer (`padded` its element count).
    Padded {
        path: Path,
        dtype: DType,
        padded: Vec<i64>,
    },
    /// A staged tensor's view offset (`dim` None) or the stride of `dim`, as i64, in its
    /// storage's buffer (`buckets::read_in`).
    ViewInt {
        path: Path,
        dim: Option<usize>,
    },
    /// The real size of dim `dim` of the tensor a staged tensor's storage holds padded, as
    /// i64 (a view dim merged over that dim is read with it).
    StorageSize {
        path: Path,
        dim: usize,
    },
    /// The real size of dim `dim` of the program's result `result`, as i64.
    ResultSize {
        result: usize,
        dim: usize,
    },
}

/// How many trailing dims of a staged view a bucketed program reads as whole rows: dims
/// that are not padded (`dims`: each dim's bucket) and lie adjacent in memory, innermost
/// at stride 1 (size-1 dims address nothing). Part of the program's key.
fn read_block(v: &View, dims: &[Option<i64>]) -> usize {
    let mut expect = 1;
    let mut n = 0;
    for d in (0..v.sizes.len()).rev() {
        if dims[d].is_some() || v.sizes[d] != 1 && v.strides[d] != expect {
            break;
        }
        expect *= v.sizes[d];
        n += 1;
    }
    n
}

/// How many trailing dims a bucketed program reads as rows of the staged view (`read`, in
/// the buffer of `layout`): `read_block`'s, or, when the innermost dim is padded (rows of
/// one element), that dim whole at its bucket's width. A row then runs past the view's real
/// elements into whatever follows in the buffer (padding to XLA's padder), so only where
/// every real row's start plus the width stays inside the buffer (a padded buffer read with
/// its own width: always), else XLA's gather would clamp the start and shift real elements.
/// Part of the program's key.
fn read_rows(read: &ReadView, layout: &Padded, dims: &[Option<i64>]) -> usize {
    let v = &read.view;
    let n = read_block(v, dims);
    let Some(last) = v.sizes.len().checked_sub(1) else {
        return n;
    };
    let Some(width) = dims[last] else {
        return n;
    };
    if n > 0 || v.strides[last] != 1 {
        return n;
    }
    let cap: i64 = layout.padded.iter().product();
    if crate::buckets::last_row_start(read, layout) + width <= cap {
        1
    } else {
        0
    }
}

/// The index type for positions below `n`: i32 where it fits (XLA:CPU's index math is
/// cheaper), else i64.
fn index_type(n: i64) -> DType {
    if n < i32::MAX as i64 {
        DType::I32
    } else {
        DType::I64
    }
}

/// Where a bucketed program reads staged tensor `path` on the device: the buffer its
/// storage holds (or will), as a bucketed program left it (padded) or exact where that size
/// cannot change with the padded dims (no dynamic dim steps through the storage, as in a
/// broadcast, or the signature reads this storage at every call: `Staging::stable`), and the
/// view in that buffer's terms. None: staged on the host (a view no stride reaches in the
/// padded buffer, an exact buffer whose size changes).
fn device_source(
    st: &crate::buckets::Staging,
    path: Path,
    t: &TensorRef,
) -> Option<(Padded, ReadView)> {
    let s = t.storage()?;
    let sized_by_view = || {
        let dims = st.staged.get(&path).map_or(&[][..], Vec::as_slice);
        !st.stable.contains(&path)
            && (dims.iter().zip(&t.view.strides)).any(|(d, stride)| d.is_some() && *stride != 0)
    };
    let layout = match s.padded_layout() {
        Some((dt, p)) => (Some(dt) == t.dtype).then_some(p)?,
        None if !sized_by_view() => {
            let size = t.dtype?.size() as i64;
            (t.nbytes % size == 0).then(|| Padded::exact(t.nbytes / size))?
        }
        None => return None,
    };
    let read = crate::buckets::read_in(&t.view, &layout)?;
    Some((layout, read))
}

/// A staged view as the program gathers it: its dims in the order they lie in the buffer,
/// outermost first (`perm[i]`: the view dim read as dim `i`), so that rows are runs of the
/// buffer's innermost dims whatever the view's order (a transposed operand's rows), and the
/// view, its merged dims and its buckets (`dims`) in that order. Part of the key.
struct Gathered {
    perm: Vec<usize>,
    read: ReadView,
    dims: Vec<Option<i64>>,
}

fn in_buffer_order(read: &ReadView, layout: &Padded, dims: &[Option<i64>]) -> Gathered {
    let strides = lowering::shape::contiguous_strides(&layout.padded);
    let v = &read.view;
    // Where a dim steps in the buffer: a merged one by its innermost storage dim; one that
    // steps nowhere (size 1, a broadcast) goes outermost.
    let step = |d: usize| match read.merged.iter().find(|m| m.0 == d) {
        Some((_, over)) => strides[*over.last().expect("merged over storage dims")],
        None if v.sizes[d] == 1 || v.strides[d] == 0 => i64::MAX,
        None => v.strides[d],
    };
    let mut perm: Vec<usize> = (0..v.sizes.len()).collect();
    perm.sort_by_key(|d| std::cmp::Reverse(step(*d)));
    let view = View {
        sizes: perm.iter().map(|d| v.sizes[*d]).collect(),
        strides: perm.iter().map(|d| v.strides[*d]).collect(),
        offset: v.offset,
    };
    let merged = read
        .merged
        .iter()
        .map(|(d, over)| {
            (
                perm.iter().position(|p| p == d).expect("a view dim"),
                over.clone(),
            )
        })
        .collect();
    Gathered {
        dims: perm.iter().map(|d| dims[*d]).collect(),
        read: ReadView { view, merged },
        perm,
    }
}

/// Whether a staged view, padded to `padded`, is its padded buffer itself (read without a
/// gather).
fn reads_whole(layout: &Padded, read: &ReadView, padded: &[i64]) -> bool {
    let strides = lowering::shape::contiguous_strides(&layout.padded);
    read.merged.is_empty()
        && read.view.offset == 0
        && layout.padded == padded
        && (0..padded.len()).all(|d| padded[d] == 1 || read.view.strides[d] == strides[d])
}

#[derive(Clone)]
pub(crate) enum Output {
    New {
        dtype: DType,
        sizes: Vec<i64>,
    },
    Write {
        path: Path,
        dtype: DType,
    },
    /// An index range check read after the op ran (see `lowering::Check`).
    Check {
        kind: ErrorKind,
        msg: String,
    },
}

#[derive(Clone, Copy)]
pub(crate) enum RetShape {
    T,
    List(usize),
    None,
    /// An int the rule knew from the shapes.
    Int(i64),
}

/// An executable and, if it was compiled quickly, what its optimized compilation needs.
pub(crate) struct Compiled {
    pub exe: pjrt::Executable,
    quick: Option<crate::tiers::Quick>,
}

/// A compiled op with its input/output plan. In Strict mode the compilation may still be
/// running on the compile pool (`tiers::compile`): the job waits for it.
pub struct Program {
    compiled: std::sync::OnceLock<Result<Compiled>>,
    /// How the compile pool obtained it, for the profiler's record of its first run.
    pool_source: std::sync::Mutex<Option<crate::trace::Source>>,
    pub(crate) device: usize,
    inputs: Vec<Input>,
    pub(crate) outputs: Vec<Output>,
    rets: Vec<RetShape>,
    rng_consumed: u64,
    /// Serves a range of sizes: staged inputs, results packed in padded buffers.
    pub(crate) bucketed: bool,
    /// The shape of each result before it is flattened (a bucketed program's are padded).
    result_dims: Vec<Vec<i64>>,
}

impl Program {
    /// Its executable, once compiled (waits for the compile pool); the compilation's error
    /// if it failed.
    pub(crate) fn exe(&self) -> Result<&pjrt::Executable> {
        match self.compiled.wait() {
            Ok(c) => Ok(&c.exe),
            Err(e) => Err(e.clone()),
        }
    }

    /// A traced run's record: the first run of a program the pool compiled reports how.
    pub(crate) fn traced(&self, q: crate::trace::Queued) -> crate::trace::Queued {
        match self
            .pool_source
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            Some(source) => crate::trace::Queued { source, ..q },
            None => q,
        }
    }

    /// A program of the same plan around `compiled`.
    fn with(&self, compiled: Compiled) -> Program {
        Program {
            compiled: std::sync::OnceLock::from(Ok(compiled)),
            pool_source: Default::default(),
            device: self.device,
            inputs: self.inputs.clone(),
            outputs: self.outputs.clone(),
            rets: self.rets.clone(),
            rng_consumed: self.rng_consumed,
            bucketed: self.bucketed,
            result_dims: self.result_dims.clone(),
        }
    }

    /// The same program, optimized: compiled in the background once the quick one is hot,
    /// then put in the cache under `key` (calls already holding the quick one keep it).
    fn count_run(self: &Arc<Self>, key: &[u8]) {
        let Some(Ok(Compiled { quick: Some(q), .. })) = self.compiled.get() else {
            return;
        };
        if !q.hot() {
            return;
        }
        let Ok(rt) = crate::get() else { return };
        let (me, key) = (self.clone(), key.to_vec());
        crate::tiers::background(move || {
            let Some(Ok(Compiled { quick: Some(q), .. })) = me.compiled.get() else {
                return;
            };
            // A failure keeps the quick program, which works.
            if let Ok((exe, _)) =
                rt.compile_full(&q.mlir, me.device, false, q.custom.as_deref(), false, true)
            {
                rt.cache
                    .insert(key, Arc::new(me.with(Compiled { exe, quick: None })));
            }
        });
    }
}

/// Every tensor argument with its position, lists' elements included.
pub(crate) fn tensors(params: &[Param]) -> Vec<(Path, &TensorRef)> {
    let mut v = Vec::new();
    for (i, p) in params.iter().enumerate() {
        match &p.arg {
            RArg::Tensor(t) => v.push(((i, None), t)),
            RArg::List(items) => {
                for (j, a) in items.iter().enumerate() {
                    if let RArg::Tensor(t) = a {
                        v.push(((i, Some(j)), t));
                    }
                }
            }
            _ => {}
        }
    }
    v
}

pub(crate) fn tensor_at(params: &[Param], path: Path) -> &TensorRef {
    let a = &params[path.0].arg;
    let a = match (a, path.1) {
        (RArg::List(items), Some(j)) => &items[j],
        (a, _) => a,
    };
    match a {
        RArg::Tensor(t) => t,
        _ => unreachable!("program plan points at a non-tensor"),
    }
}

fn dt_name(d: Option<DType>) -> String {
    d.map(|d| format!("{d:?}")).unwrap_or_else(|| "?".into())
}

/// What a key says about tensors.
#[derive(Clone, Copy)]
pub(crate) enum KeyMode<'a> {
    /// Everything (the exact program's key).
    Exact,
    /// Dtype, rank and storage identity only (`buckets`' signature).
    Signature,
    /// Staged tensors by their padded dims, the others exactly.
    Bucket(&'a crate::buckets::Staging),
}

/// The cache key: everything the compiled program depends on, nothing it does not. Raw
/// bytes (tag, then fixed-width little-endian fields), cheap to build on every op.
pub(crate) fn key(op: &str, overload: &str, device: usize, params: &[Param]) -> Vec<u8> {
    key_with(op, overload, device, params, KeyMode::Exact)
}

/// The key of an op's shape-independent identity (see `buckets`).
pub(crate) fn signature(op: &str, overload: &str, device: usize, params: &[Param]) -> Vec<u8> {
    key_with(op, overload, device, params, KeyMode::Signature)
}

pub(crate) fn key_with(
    op: &str,
    overload: &str,
    device: usize,
    params: &[Param],
    mode: KeyMode,
) -> Vec<u8> {
    fn num(k: &mut Vec<u8>, v: i64) {
        k.extend_from_slice(&v.to_le_bytes());
    }
    fn text(k: &mut Vec<u8>, s: &str) {
        num(k, s.len() as i64);
        k.extend_from_slice(s.as_bytes());
    }
    fn ints(k: &mut Vec<u8>, v: &[i64]) {
        num(k, v.len() as i64);
        for x in v {
            num(k, *x);
        }
    }
    fn dt(k: &mut Vec<u8>, d: Option<DType>) {
        k.push(d.map(|d| d as u8 + 1).unwrap_or(0));
    }
    /// Storages seen (their slot numbers) and the real sizes of dynamic dims seen (their
    /// symbols: equal sizes share one size parameter, see `ProgramInputs::staged`).
    struct Seen {
        slots: Vec<*const Storage>,
        sizes: Vec<i64>,
    }
    fn arg(k: &mut Vec<u8>, a: &RArg, path: Path, mode: KeyMode, seen: &mut Seen) {
        match a {
            RArg::None => k.push(b'N'),
            RArg::Tensor(t) => {
                k.push(b'T');
                dt(k, t.dtype);
                match mode {
                    KeyMode::Exact => {}
                    KeyMode::Signature => num(k, t.view.sizes.len() as i64),
                    KeyMode::Bucket(st) => match st.staged.get(&path) {
                        Some(dims) => {
                            k.push(b'b');
                            num(k, dims.len() as i64);
                            for (d, s) in dims.iter().zip(&t.view.sizes) {
                                num(k, d.map_or(*s, |b| -b));
                                if d.is_some() {
                                    let sym = seen.sizes.iter().position(|x| x == s);
                                    num(k, sym.unwrap_or(seen.sizes.len()) as i64);
                                    if sym.is_none() {
                                        seen.sizes.push(*s);
                                    }
                                }
                            }
                            // Read in the program from a device buffer, or staged on the host.
                            match device_source(st, path, t) {
                                Some((layout, read)) => {
                                    ints(k, &layout.padded);
                                    let padded = st.padded(path, t).unwrap_or_default();
                                    if reads_whole(&layout, &read, &padded) {
                                        k.push(b'w');
                                    } else {
                                        let g = in_buffer_order(&read, &layout, dims);
                                        let perm: Vec<i64> =
                                            g.perm.iter().map(|d| *d as i64).collect();
                                        ints(k, &perm);
                                        num(k, read_rows(&g.read, &layout, &g.dims) as i64);
                                        for (d, over) in &g.read.merged {
                                            num(k, *d as i64);
                                            let over: Vec<i64> =
                                                over.iter().map(|j| *j as i64).collect();
                                            ints(k, &over);
                                        }
                                    }
                                }
                                None => k.push(b'h'),
                            }
                        }
                        None => k.push(b'x'),
                    },
                }
                if matches!(mode, KeyMode::Exact)
                    || matches!(mode, KeyMode::Bucket(st) if !st.staged.contains_key(&path))
                {
                    ints(k, &t.view.sizes);
                    // The stride of a size-1 dim addresses nothing: views that differ only
                    // there (one layer's transposed head and the next's) share a program.
                    num(k, t.view.strides.len() as i64);
                    for (n, st) in t.view.sizes.iter().zip(&t.view.strides) {
                        num(k, if *n == 1 { 0 } else { *st });
                    }
                    num(k, t.view.offset);
                    num(k, t.nbytes);
                }
                k.push(t.wrapped as u8);
                match t.loc {
                    Loc::Host(_) => k.push(b'h'),
                    Loc::Device(p) => {
                        let s = seen.slots.iter().position(|q| *q == p).unwrap_or_else(|| {
                            seen.slots.push(p);
                            seen.slots.len() - 1
                        });
                        k.push(b's');
                        num(k, s as i64);
                        num(k, t.device as i64);
                    }
                }
            }
            RArg::Int(i) => {
                k.push(b'i');
                num(k, *i);
            }
            RArg::Float(f) => {
                k.push(b'f');
                k.extend_from_slice(&f.to_bits().to_le_bytes());
            }
            RArg::Complex(re, im) => {
                k.push(b'c');
                k.extend_from_slice(&re.to_bits().to_le_bytes());
                k.extend_from_slice(&im.to_bits().to_le_bytes());
            }
            RArg::Bool(b) => k.extend_from_slice(&[b'b', *b as u8]),
            RArg::Str(s) => {
                k.push(b'S');
                text(k, s);
            }
            RArg::ScalarType(d) => {
                k.push(b'd');
                dt(k, *d);
            }
            RArg::Device(d) => {
                k.push(b'D');
                num(k, *d as i64);
            }
            RArg::List(items) => {
                k.push(b'[');
                num(k, items.len() as i64);
                for (j, a) in items.iter().enumerate() {
                    arg(k, a, (path.0, Some(j)), mode, seen);
                }
            }
            RArg::Generator(_) => k.push(b'G'),
            RArg::Other(s) => {
                k.push(b'o');
                text(k, s);
            }
        }
    }
    let mut k = Vec::with_capacity(256);
    text(&mut k, op);
    text(&mut k, overload);
    num(&mut k, device as i64);
    k.push(match mode {
        KeyMode::Exact => b'E',
        KeyMode::Signature => b'S',
        KeyMode::Bucket(_) => b'B',
    });
    let mut seen = Seen {
        slots: Vec::new(),
        sizes: Vec::new(),
    };
    let unread = lowering::rules::unread_args(op);
    for (i, p) in params.iter().enumerate() {
        text(&mut k, &p.name);
        if unread.contains(&p.name.as_str()) {
            continue;
        }
        if let (KeyMode::Signature, "size", RArg::List(items)) = (mode, p.name.as_str(), &p.arg) {
            // A shape argument follows its tensor's sizes (`buckets::pad_size_args`).
            k.push(b'z');
            num(&mut k, items.len() as i64);
            continue;
        }
        arg(&mut k, &p.arg, (i, None), mode, &mut seen);
    }
    // Compiled under custom_compiler_options: another program.
    k.extend_from_slice(&crate::options::key_part());
    k
}

/// How the op's results reach PyTorch.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Variant {
    Functional,
    Out,
    Inplace,
}

fn variant(op: &str, params: &[Param]) -> Variant {
    if params.iter().any(|p| p.is_out) {
        Variant::Out
    } else if op.ends_with('_') && params.first().map(|p| p.is_write).unwrap_or(false) {
        Variant::Inplace
    } else {
        Variant::Functional
    }
}

/// Python floats that change between calls (learning rates, bias corrections) are passed
/// to these ops as wrapped 0-d inputs instead of constants, so new values reuse the program.
fn dynamic_scalars(op: &str, name: &str) -> bool {
    let base = op.trim_start_matches("aten::").trim_end_matches('_');
    let op_ok = base.starts_with("_foreach_")
        || matches!(
            base,
            "add" | "sub" | "rsub" | "mul" | "div" | "addcmul" | "addcdiv" | "lerp"
        );
    op_ok
        && matches!(
            name,
            "alpha" | "value" | "other" | "weight" | "scalar" | "scalars" | "exponent"
        )
}

/// Replaces dynamic float scalars by host 0-d f64 tensors pointing into `store`.
fn wrap_scalars(op: &str, params: &[Param], store: &mut Vec<f64>) -> Option<Vec<Param>> {
    let count = |a: &RArg| match a {
        RArg::Float(_) => 1,
        RArg::List(items) => items.iter().filter(|x| matches!(x, RArg::Float(_))).count(),
        _ => 0,
    };
    let n: usize = params
        .iter()
        .filter(|p| dynamic_scalars(op, &p.name))
        .map(|p| count(&p.arg))
        .sum();
    if n == 0 {
        return None;
    }
    store.reserve_exact(n);
    let mut wrap = |f: f64| {
        store.push(f);
        let ptr = store.last_mut().expect("pushed") as *mut f64 as *mut u8;
        RArg::Tensor(TensorRef {
            loc: Loc::Host(ptr),
            dtype: Some(DType::F64),
            view: View {
                sizes: vec![],
                strides: vec![],
                offset: 0,
            },
            nbytes: 8,
            wrapped: true,
            device: 0,
        })
    };
    let out = params
        .iter()
        .map(|p| {
            let mut p = p.clone();
            if dynamic_scalars(op, &p.name) {
                p.arg = match p.arg {
                    RArg::Float(f) => wrap(f),
                    RArg::List(items) => RArg::List(
                        items
                            .into_iter()
                            .map(|x| if let RArg::Float(f) = x { wrap(f) } else { x })
                            .collect(),
                    ),
                    a => a,
                };
            }
            p
        })
        .collect();
    Some(out)
}

/// Runs one op.
pub fn dispatch(rt: &Runtime, op: &str, overload: &str, params: &[Param]) -> Result<Outcome> {
    if let Some((expanded, _made)) = crate::datadep::expand_masks(rt, op, params)? {
        return dispatch(rt, op, overload, &expanded);
    }
    let mut store = Vec::new();
    let wrapped = wrap_scalars(op, params, &mut store);
    let params = wrapped.as_deref().unwrap_or(params);
    let var = variant(op, params);
    for p in params {
        if let RArg::Other(what) = &p.arg {
            return Ok(Outcome::Declined(format!(
                "argument '{}' of type {what}",
                p.name
            )));
        }
    }
    let ts = tensors(params);
    if ts.iter().any(|(_, t)| t.dtype.is_none()) {
        return Ok(Outcome::Declined(format!("{op}: unsupported dtype")));
    }
    check_same_device(op, params, &ts)?;
    if var == Variant::Out {
        check_out_overlap(op, params)?;
    }
    if let (Variant::Functional, Some(host_op)) = (var, crate::datadep::find(op, params)) {
        let rets = host_op(rt, params)?;
        rt.metrics.native(op);
        return Ok(Outcome::Done(rets));
    }
    let device = ts
        .iter()
        .find(|(_, t)| matches!(t.loc, Loc::Device(_)))
        .map(|(_, t)| t.device)
        .or_else(|| {
            params.iter().find_map(|p| match p.arg {
                RArg::Device(d) => Some(d),
                _ => None,
            })
        })
        .unwrap_or(0);
    if crate::buckets::host_arange(rt, op, params)? {
        return Ok(Outcome::Done(returns_of(&[], params, var, Vec::new())));
    }
    let mode = crate::mode::get();
    let mut observed = None;
    if mode == crate::mode::EagerMode::DeferAndFuse {
        match rt.record(op, overload, device, params, var)? {
            crate::defer::Recorded::Done(outcome) => return Ok(outcome),
            crate::defer::Recorded::Dynamic(st) => {
                // Outside the graph: what it reads (or writes) must be computed first, and
                // what it writes must not be an input the graph still has to read.
                let lazy = tensors(params)
                    .iter()
                    .any(|(_, t)| t.storage().is_some_and(Storage::is_lazy));
                let overwrites = params.iter().filter(|p| p.is_write).any(|p| match &p.arg {
                    RArg::Tensor(t) => t.storage().is_some_and(|s| rt.defer.write_flushes(s)),
                    _ => false,
                });
                if lazy || overwrites {
                    rt.flush(device, "dynamic shapes")?;
                }
                observed = Some(st);
            }
        }
    }
    let k = key(op, overload, device, params);
    let (prog, real) = match rt.cache.get(&k) {
        Some(p) => {
            rt.metrics
                .cache_hits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            p.count_run(&k);
            (p, None)
        }
        None => match bucketed(rt, op, overload, device, params, var, &k, observed)? {
            Some((p, real, bk)) => {
                p.count_run(&bk);
                (p, Some(real))
            }
            None => {
                rt.metrics
                    .cache_misses
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let in_pool = mode != crate::mode::EagerMode::Debug;
                match build(rt, op, overload, device, params, var, None, in_pool)? {
                    Built::Program(p) => {
                        rt.cache.insert(k.clone(), p.clone());
                        rt.metrics.exact_program(op);
                        p.count_run(&k);
                        (p, None)
                    }
                    Built::Declined(why) => return Ok(Outcome::Declined(why)),
                    Built::Resize(r) => return Ok(Outcome::Resize(r)),
                }
            }
        },
    };
    let rets = real.as_ref().map_or(&prog.rets, |r| &r.rets);
    let real = real.as_deref().map(|v| v.sizes.as_slice());
    let new = if mode != crate::mode::EagerMode::Debug {
        execute_async(rt, op, &prog, params, device, real)?
    } else {
        execute(rt, op, &prog, params, real)?
    };
    rt.metrics.native(op);
    Ok(Outcome::Done(returns_of(rets, params, var, new)))
}

pub(crate) fn returns_of(
    shapes: &[RetShape],
    params: &[Param],
    var: Variant,
    new: Vec<Ret>,
) -> Vec<Ret> {
    match var {
        Variant::Functional => {
            let mut it = new.into_iter();
            let mut rets = Vec::new();
            for r in shapes {
                match r {
                    RetShape::T => rets.extend(it.next()),
                    RetShape::List(n) => {
                        rets.push(Ret::List(*n));
                        rets.extend(it.by_ref().take(*n));
                    }
                    RetShape::None => rets.push(Ret::None),
                    RetShape::Int(v) => rets.push(Ret::Int(*v)),
                }
            }
            rets
        }
        Variant::Out => params
            .iter()
            .enumerate()
            .filter(|(_, p)| p.is_out && matches!(p.arg, RArg::Tensor(_)))
            .map(|(i, _)| Ret::Alias(i))
            .collect(),
        Variant::Inplace => match params[0].arg {
            RArg::Tensor(_) => vec![Ret::Alias(0)],
            _ => vec![],
        },
    }
}

enum Built {
    Program(Arc<Program>),
    Declined(String),
    Resize(Vec<(usize, Vec<i64>)>),
}

/// One storage used by an op: its current flat value and element type.
struct Slot {
    ptr: *const Storage,
    dtype: DType,
    n: i64,
    value: Option<Value>,
    dirty_path: Option<Path>,
}

fn user(e: LowerError) -> std::result::Result<String, Error> {
    match e {
        LowerError::Declined(w) => Ok(w),
        LowerError::User(kind, msg) => Err(Error::new(kind, msg)),
    }
}

/// Where an op's inputs come from: program parameters filled at execution (Strict), or
/// values of a pending graph (DeferAndFuse).
pub(crate) trait Sources {
    /// The flat value of a device storage, as `n` elements of `dtype`.
    fn storage(
        &mut self,
        b: &mut Builder,
        path: Path,
        t: &TensorRef,
        dtype: DType,
        n: i64,
    ) -> Result<Value>;
    /// A host tensor, contiguous, of its view's shape.
    fn host(&mut self, b: &mut Builder, path: Path, t: &TensorRef, dtype: DType) -> Result<Value>;
    /// Binds the RNG parameter the rule created (it consumed `consumed` values).
    fn rng(&mut self, gen: Option<Path>, consumed: u64) -> Result<()>;
    /// A staged tensor's value (bucketed programs): its logical shape, padded.
    fn staged(&mut self, _b: &mut Builder, _path: Path, _t: &TensorRef) -> Option<Value> {
        None
    }
    /// Bucketed programs: out=/in-place targets are whole storages, replaced by the
    /// result (whose padded shape PyTorch's real one does not match).
    fn whole_targets(&self) -> bool {
        false
    }
}

/// What one op became: new tensors and storage writes.
pub(crate) struct Lowered {
    pub rets: Vec<RetShape>,
    /// Functional results, in order.
    pub new: Vec<Value>,
    /// Final flat value of each written storage.
    pub writes: Vec<(Path, DType, Value)>,
    /// Data-dependent conditions to verify after the op ran.
    pub checks: Vec<lowering::Check>,
}

pub(crate) enum LowerOutcome {
    Done(Lowered),
    Declined(String),
    Resize(Vec<(usize, Vec<i64>)>),
}

pub(crate) fn find_rule(op: &str, var: Variant, complex: bool) -> Option<lowering::Rule> {
    lowering::find_rule_for(op, complex).or_else(|| {
        if var == Variant::Inplace {
            lowering::find_rule_for(op.trim_end_matches('_'), complex)
        } else {
            None
        }
    })
}

/// Whether a call has a complex tensor (out= included), number or dtype argument.
fn has_complex(params: &[Param]) -> bool {
    fn arg(a: &RArg) -> bool {
        match a {
            RArg::Tensor(t) => t.dtype.is_some_and(|d| d.is_complex()),
            RArg::Complex(..) => true,
            RArg::ScalarType(Some(d)) => d.is_complex(),
            RArg::List(items) => items.iter().any(arg),
            _ => false,
        }
    }
    params.iter().any(|p| arg(&p.arg))
}

/// A CPU tensor mixes with tpu ones only as a 0-dim scalar (or as indices of advanced
/// indexing), as on CUDA; otherwise CUDA's error, naming the argument.
fn check_same_device(op: &str, params: &[Param], ts: &[(Path, &TensorRef)]) -> Result<()> {
    let Some(((i, _), _)) = ts
        .iter()
        .find(|(_, t)| matches!(t.loc, Loc::Host(_)) && !t.view.sizes.is_empty())
    else {
        return Ok(());
    };
    let Some((_, dev)) = ts.iter().find(|(_, t)| matches!(t.loc, Loc::Device(_))) else {
        return Ok(());
    };
    if lowering::rules::takes_cpu_tensors(op) {
        return Ok(());
    }
    let tpu = format!("tpu:{}", dev.device);
    let first_cpu = matches!(ts[0].1.loc, Loc::Host(_));
    let (a, b) = if first_cpu {
        ("cpu", tpu.as_str())
    } else {
        (tpu.as_str(), "cpu")
    };
    let offending = if first_cpu {
        // The first tpu tensor is the one that differs from the common (cpu) device.
        ts.iter()
            .find(|(_, t)| matches!(t.loc, Loc::Device(_)))
            .map_or(*i, |((j, _), _)| *j)
    } else {
        *i
    };
    Err(Error::runtime(format!(
        "Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! (when checking argument for argument {} in method {op})",
        params[offending].name
    )))
}

/// PyTorch's memory-overlap checks on out= tensors: no element written twice, and no input
/// sharing part (not all, or for some ops any) of an output's memory. Layouts other than
/// contiguous are left unchecked, as PyTorch leaves the ones it cannot decide.
fn check_out_overlap(op: &str, params: &[Param]) -> Result<()> {
    let exclusive = lowering::rules::out_excludes_inputs(op);
    const CLONE: &str = "Please clone() the tensor before performing the operation.";
    let all = tensors(params);
    let bytes = |t: &TensorRef| {
        let size = t.dtype.map_or(1, |d| d.size() as i64);
        (
            t.view.offset * size,
            (t.view.offset + t.view.numel()) * size,
        )
    };
    for (po, o) in all.iter().filter(|(p, _)| params[p.0].is_out) {
        let Loc::Device(optr) = o.loc else { continue };
        let v = &o.view;
        if v.sizes
            .iter()
            .zip(&v.strides)
            .any(|(n, s)| *n > 1 && *s == 0)
        {
            return Err(Error::runtime(format!(
                "unsupported operation: more than one element of the written-to tensor refers to a single memory location. {CLONE}"
            )));
        }
        if v.numel() == 0 && exclusive {
            // PyTorch resizes the out= tensor before its check: if it is also an input (same
            // storage, same view), the input grew with it and the two overlap.
            if all.iter().any(|(p, i)| {
                !params[p.0].is_out
                    && matches!(i.loc, Loc::Device(ip) if ip == optr)
                    && i.view.sizes == v.sizes
                    && i.view.strides == v.strides
                    && i.view.offset == v.offset
            }) {
                return Err(Error::runtime(format!(
                    "unsupported operation: some elements of the input tensor and the written-to tensor refer to a single memory location. {CLONE}"
                )));
            }
        }
        if v.numel() == 0 || !v.is_contiguous() {
            continue;
        }
        for (_, i) in all.iter().filter(|(p, _)| !params[p.0].is_out && p != po) {
            let Loc::Device(iptr) = i.loc else { continue };
            if iptr != optr || i.view.numel() == 0 || !i.view.is_contiguous() {
                continue;
            }
            let ((a0, a1), (b0, b1)) = (bytes(o), bytes(i));
            if a0 < b1 && b0 < a1 && ((a0, a1) != (b0, b1) || exclusive) {
                return Err(Error::runtime(format!(
                    "unsupported operation: some elements of the input tensor and the written-to tensor refer to a single memory location. {CLONE}"
                )));
            }
        }
    }
    if let Some(msg) = lowering::rules::outs_exclude_each_other(op) {
        let outs: Vec<&TensorRef> = all
            .iter()
            .filter(|(p, _)| params[p.0].is_out)
            .map(|(_, t)| *t)
            .collect();
        for (k, a) in outs.iter().enumerate() {
            for b in &outs[k + 1..] {
                let (Loc::Device(pa), Loc::Device(pb)) = (a.loc, b.loc) else {
                    continue;
                };
                let ((a0, a1), (b0, b1)) = (bytes(a), bytes(b));
                if pa == pb && a0 < b1 && b0 < a1 {
                    return Err(Error::new(ErrorKind::Value, msg));
                }
            }
        }
    }
    Ok(())
}

/// Lowers one op into `b`: reads its views, runs its rule, writes out=/in-place results.
pub(crate) fn lower_into(
    b: &mut Builder,
    src: &mut dyn Sources,
    op: &str,
    overload: &str,
    device: usize,
    params: &[Param],
    var: Variant,
) -> Result<LowerOutcome> {
    let Some(rule) = find_rule(op, var, has_complex(params)) else {
        return Ok(LowerOutcome::Declined(lowering::no_rule(op)));
    };
    let mut slots: Vec<Slot> = Vec::new();
    let mut values: HashMap<Path, Value> = HashMap::new();
    for (path, t) in tensors(params) {
        if params[path.0].is_out {
            continue;
        }
        let dtype = t.dtype.expect("checked");
        if let Some(v) = src.staged(b, path, t) {
            values.insert(path, v);
            continue;
        }
        match t.loc {
            Loc::Host(_) => {
                let v = src.host(b, path, t, dtype)?;
                values.insert(path, v);
            }
            Loc::Device(p) => {
                if t.device != device {
                    return Err(Error::runtime(format!(
                        "Expected all tensors to be on the same device, but found at least two devices, tpu:{} and tpu:{}!",
                        device, t.device
                    )));
                }
                let si = match slots.iter().position(|s| s.ptr == p) {
                    Some(i) => i,
                    None => {
                        let n = t.nbytes / dtype.size() as i64;
                        let flat = src.storage(b, path, t, dtype, n)?;
                        slots.push(Slot {
                            ptr: p,
                            dtype,
                            n,
                            value: Some(flat),
                            dirty_path: None,
                        });
                        slots.len() - 1
                    }
                };
                if slots[si].dtype != dtype {
                    return Ok(LowerOutcome::Declined(
                        "one storage read as two dtypes".into(),
                    ));
                }
                let flat = slots[si].value.expect("read slot has a value");
                values.insert(path, layout::read(b, flat, &t.view));
            }
        }
    }
    // Arguments for the rule, out= excluded.
    let mut args = Args::default();
    let mut gen_path = None;
    for (i, p) in params.iter().enumerate() {
        if p.is_out {
            continue;
        }
        if let RArg::Generator(_) = p.arg {
            gen_path = Some((i, None));
        }
        args.items
            .push((p.name.clone(), to_arg(b, &p.arg, i, None, &values)));
    }
    let mut ctx = Ctx::new(b, op, overload, &args);
    ctx.out_dtypes = tensors(params)
        .iter()
        .filter(|(p, _)| params[p.0].is_out)
        .filter_map(|(_, t)| t.dtype)
        .collect();
    ctx.strided = tensors(params)
        .iter()
        .filter(|(p, t)| p.1.is_none() && !t.view.is_contiguous())
        .map(|(p, _)| params[p.0].name.clone())
        .collect();
    let outs = match rule(&mut ctx) {
        Ok(o) => o,
        Err(e) => return Ok(LowerOutcome::Declined(user(e)?)),
    };
    let rng_used = ctx.rng_state.is_some();
    let rng_consumed = ctx.rng_consumed;
    let extra_writes = std::mem::take(&mut ctx.writes);
    let checks = std::mem::take(&mut ctx.checks);
    if let Some(why) = ctx.refuses_padding {
        // The bucket path then compiles exact programs for this signature.
        return Ok(LowerOutcome::Declined(format!(
            "{op} {why}: not in a padded program"
        )));
    }
    // Arguments the schema marks mutated (other than out=/self) must be written by the rule.
    let unmodelled = params.iter().enumerate().find(|(i, p)| {
        p.is_write
            && !p.is_out
            && (var != Variant::Inplace || *i != 0)
            && !matches!(p.arg, RArg::None)
            && !extra_writes.iter().any(|(n, _)| *n == p.name)
    });
    if let Some((_, p)) = unmodelled {
        return Ok(LowerOutcome::Declined(format!(
            "{op} mutates '{}', which its rule does not write",
            p.name
        )));
    }
    if rng_used {
        src.rng(gen_path, rng_consumed)?;
    }
    let targets: Vec<Path> = match var {
        Variant::Functional => vec![],
        Variant::Out => tensors(params)
            .into_iter()
            .filter(|(p, _)| params[p.0].is_out)
            .map(|(p, _)| p)
            .collect(),
        Variant::Inplace => tensors(params)
            .into_iter()
            .filter(|(p, _)| p.0 == 0)
            .map(|(p, _)| p)
            .collect(),
    };
    let flat_outs: Vec<Option<Value>> = outs
        .iter()
        .flat_map(|o| match o {
            Out::T(v) => vec![Some(*v)],
            Out::List(vs) => vs.iter().map(|v| Some(*v)).collect(),
            Out::None => vec![None],
            Out::Int(_) => vec![],
        })
        .collect();
    let mut lowered = Lowered {
        rets: Vec::new(),
        new: Vec::new(),
        writes: Vec::new(),
        checks,
    };
    if var == Variant::Functional {
        for o in &outs {
            lowered.rets.push(match o {
                Out::T(_) => RetShape::T,
                Out::List(v) => RetShape::List(v.len()),
                Out::None => RetShape::None,
                Out::Int(v) => RetShape::Int(*v),
            });
        }
        lowered.new = flat_outs.iter().flatten().copied().collect();
    }
    let mut writes: Vec<(Path, Value)> = Vec::new();
    if var != Variant::Functional {
        if flat_outs.len() < targets.len() {
            return Ok(LowerOutcome::Declined(format!(
                "{op}: rule returned fewer results than outputs"
            )));
        }
        for (path, v) in targets.iter().zip(flat_outs.iter()) {
            if let Some(v) = v {
                writes.push((*path, *v));
            }
        }
    }
    for (name, v) in extra_writes {
        match params.iter().position(|p| p.name == name) {
            Some(i) if matches!(params[i].arg, RArg::Tensor(_)) => writes.push(((i, None), v)),
            _ => {
                return Ok(LowerOutcome::Declined(format!(
                    "{op}: rule writes unknown argument {name}"
                )))
            }
        }
    }
    let mut resize = Vec::new();
    for (path, v) in writes.iter() {
        let t = tensor_at(params, *path);
        let vt = b.ty(*v).clone();
        if src.whole_targets() {
            // Checked at the exact shapes when the call's sizes were computed.
            let tdt = t.dtype.expect("checked");
            if !can_cast(vt.dtype, tdt) {
                return Ok(LowerOutcome::Declined("result dtype".into()));
            }
            let val = b.convert(*v, tdt);
            lowered.writes.push((*path, tdt, val));
            continue;
        }
        if vt.shape != t.view.sizes {
            // An out= tensor that is also an input (x.logical_and_(y) arrives as
            // logical_and.out(x, y, out=x)) is never resized: PyTorch raises.
            let is_input = |(q, u): &(Path, &TensorRef)| {
                !params[q.0].is_out
                    && u.view == t.view
                    && matches!((u.loc, t.loc), (Loc::Device(a), Loc::Device(b)) if a == b)
            };
            if params[path.0].is_out && path.1.is_none() && !tensors(params).iter().any(is_input) {
                resize.push((path.0, vt.shape.clone()));
                continue;
            }
            return Err(Error::runtime(format!(
                "output with shape {} doesn't match the broadcast shape {}",
                shape_str(&t.view.sizes),
                shape_str(&vt.shape)
            )));
        }
        let tdt = t.dtype.expect("checked");
        if !can_cast(vt.dtype, tdt) {
            return Err(Error::runtime(format!(
                "result type {} can't be cast to the desired output type {}",
                torch_name(vt.dtype),
                torch_name(tdt)
            )));
        }
        let p = match t.loc {
            Loc::Device(p) => p,
            Loc::Host(_) => return Ok(LowerOutcome::Declined("out= tensor on the CPU".into())),
        };
        let val = b.convert(*v, tdt);
        let si = match slots.iter().position(|s| s.ptr == p) {
            Some(i) => i,
            None => {
                slots.push(Slot {
                    ptr: p,
                    dtype: tdt,
                    n: t.nbytes / tdt.size() as i64,
                    value: None,
                    dirty_path: None,
                });
                slots.len() - 1
            }
        };
        if slots[si].dtype != tdt {
            return Ok(LowerOutcome::Declined(
                "one storage written as two dtypes".into(),
            ));
        }
        let n = slots[si].n;
        let cur = match slots[si].value {
            Some(c) => c,
            // A whole-storage write ignores the old contents.
            None if t.view.is_whole(n) => b.full(tdt, &[n], 0.0),
            None => src.storage(b, *path, t, tdt, n)?,
        };
        let new = layout::write(b, cur, &t.view, val);
        slots[si].value = Some(new);
        slots[si].dirty_path = Some(*path);
    }
    if !resize.is_empty() {
        return Ok(LowerOutcome::Resize(resize));
    }
    for s in &slots {
        if let (Some(path), Some(v)) = (s.dirty_path, s.value) {
            lowered.writes.push((path, s.dtype, v));
        }
    }
    Ok(LowerOutcome::Done(lowered))
}

/// Strict sources: every input is a parameter bound at execution.
struct ProgramInputs<'a> {
    inputs: Vec<Input>,
    rng_consumed: u64,
    staging: Option<&'a crate::buckets::Staging>,
    /// The size parameters of dynamic dims, by real size: equal sizes share one (the key
    /// says which are equal), so XLA's padder sees one dynamic size where it would
    /// otherwise guard each elementwise op with implicit-broadcast selects.
    sizes: Vec<(i64, Value)>,
}

impl Sources for ProgramInputs<'_> {
    fn staged(&mut self, b: &mut Builder, path: Path, t: &TensorRef) -> Option<Value> {
        let st = self.staging?;
        let dims = st.staged.get(&path)?;
        let padded = st.padded(path, t)?;
        let dtype = t.dtype?;
        let ty = TensorType::new(dtype, &padded);
        let mut v = match device_source(st, path, t) {
            Some((layout, read)) => {
                self.inputs.push(Input::Padded {
                    path,
                    dtype,
                    padded: layout.padded.clone(),
                });
                let cap: i64 = layout.padded.iter().product();
                let flat = b.param(TensorType::new(dtype, &[cap]));
                if reads_whole(&layout, &read, &padded) {
                    b.reshape(flat, &padded)
                } else {
                    self.gather_view(b, path, flat, &layout, &read, dims, &padded)
                }
            }
            None => {
                self.inputs.push(Input::Staged {
                    path,
                    dtype,
                    padded: padded.clone(),
                });
                b.param(ty.clone())
            }
        };
        for (d, bk) in dims.iter().enumerate() {
            if bk.is_some() {
                let real = t.view.sizes[d];
                let n = match self.sizes.iter().find(|(s, _)| *s == real) {
                    Some((_, n)) => *n,
                    None => {
                        self.inputs.push(Input::Size { path, dim: d });
                        let n = b.param(TensorType::scalar(DType::I32));
                        self.sizes.push((real, n));
                        n
                    }
                };
                v = b.set_dimension_size(v, d, n);
            }
        }
        Some(v)
    }
    fn whole_targets(&self) -> bool {
        self.staging.is_some()
    }

    fn storage(
        &mut self,
        b: &mut Builder,
        path: Path,
        _t: &TensorRef,
        dtype: DType,
        n: i64,
    ) -> Result<Value> {
        self.inputs.push(Input::Storage { path, dtype });
        Ok(b.param(TensorType::new(dtype, &[n])))
    }
    fn host(&mut self, b: &mut Builder, path: Path, t: &TensorRef, dtype: DType) -> Result<Value> {
        self.inputs.push(Input::Host { path, dtype });
        Ok(b.param(TensorType::new(dtype, &t.view.sizes)))
    }
    fn rng(&mut self, gen: Option<Path>, consumed: u64) -> Result<()> {
        self.inputs.push(Input::Rng { path: gen });
        self.rng_consumed = consumed;
        Ok(())
    }
}

impl ProgramInputs<'_> {
    /// A staged view read from its storage's buffer (`flat`, of `layout`): element `i` of the
    /// padded view is flat[offset + sum(i_k * stride_k)], offset and strides (in the buffer's
    /// layout) given at run time. Gathered in the buffer's order, then transposed.
    #[allow(clippy::too_many_arguments)]
    fn gather_view(
        &mut self,
        b: &mut Builder,
        path: Path,
        flat: Value,
        layout: &Padded,
        read: &ReadView,
        dims: &[Option<i64>],
        padded: &[i64],
    ) -> Value {
        let Gathered {
            perm,
            read,
            dims: pdims,
        } = in_buffer_order(read, layout, dims);
        let order: Vec<i64> = perm.iter().map(|d| padded[*d]).collect();
        // Rows of the trailing static dims adjacent in memory are read whole
        // (`read_rows`): one index per row instead of one per element.
        let k = order.len() - read_rows(&read, layout, &pdims);
        let (lead, block) = order.split_at(k);
        let it = index_type(layout.padded.iter().product());
        self.inputs.push(Input::ViewInt { path, dim: None });
        let off = b.param(TensorType::scalar(DType::I64));
        let off = b.convert(off, it);
        let mut idx = b.broadcast_in_dim(off, lead, &[]);
        let strides = lowering::shape::contiguous_strides(&layout.padded);
        for (d, n) in lead.iter().enumerate() {
            if *n == 1 {
                continue;
            }
            let io = b.iota(it, lead, d);
            let term = match read.merged.iter().find(|m| m.0 == d) {
                // A dim over several storage dims: the digit of each, from the
                // real sizes of the ones inside it.
                Some((_, over)) => {
                    let mut term: Option<Value> = None;
                    let mut inner = b.constant_i64(it, 1);
                    for (i, j) in over.iter().enumerate().rev() {
                        let ib = b.broadcast_in_dim(inner, lead, &[]);
                        let mut digit = b.div(io, ib);
                        self.inputs.push(Input::StorageSize { path, dim: *j });
                        let size = b.param(TensorType::scalar(DType::I64));
                        let size = b.convert(size, it);
                        if i > 0 {
                            let sb = b.broadcast_in_dim(size, lead, &[]);
                            digit = b.rem(digit, sb);
                        }
                        let stride = b.full(it, lead, strides[*j] as f64);
                        let t = b.mul(digit, stride);
                        term = Some(match term {
                            Some(x) => b.add(x, t),
                            None => t,
                        });
                        inner = b.mul(inner, size);
                    }
                    term.expect("a merged dim covers storage dims")
                }
                None => {
                    self.inputs.push(Input::ViewInt {
                        path,
                        dim: Some(perm[d]),
                    });
                    let s = b.param(TensorType::scalar(DType::I64));
                    let s = b.convert(s, it);
                    let s = b.broadcast_in_dim(s, lead, &[]);
                    b.mul(io, s)
                }
            };
            idx = b.add(idx, term);
        }
        // Padding rows may point past the buffer: XLA's gather clamps a start index
        // so that the row fits, any element will do there. A real row lies inside.
        let rows: i64 = lead.iter().product();
        let width: i64 = block.iter().product();
        let idx = b.reshape(idx, &[rows, 1]);
        let g = b.gather(flat, idx, &[1], &[], &[0], 1, &[width]);
        let g = b.reshape(g, &order);
        if perm.iter().enumerate().all(|(i, d)| i == *d) {
            g
        } else {
            let mut back = vec![0i64; perm.len()];
            for (i, d) in perm.iter().enumerate() {
                back[*d] = i as i64;
            }
            b.transpose(g, &back)
        }
    }
}

impl ProgramInputs<'_> {
    /// Parameters for the real sizes of the dims of result `result` (of padded shape
    /// `shape`) that may be padded (size 1 never is), as `i32`.
    fn result_sizes(
        &mut self,
        b: &mut Builder,
        result: usize,
        shape: &[i64],
    ) -> Vec<(usize, Value)> {
        (0..shape.len())
            .filter(|d| shape[*d] > 1)
            .map(|dim| {
                self.inputs.push(Input::ResultSize { result, dim });
                let n = b.param(TensorType::scalar(DType::I64));
                (dim, b.convert(n, DType::I32))
            })
            .collect()
    }
}

/// One op as a self-contained function of its inputs: the body of a Strict program, or a
/// fragment a DeferAndFuse graph calls.
pub(crate) struct Planned {
    pub b: Builder,
    pub results: Vec<Value>,
    /// The shape of each result before it is flattened (a bucketed program's are padded).
    pub result_dims: Vec<Vec<i64>>,
    pub inputs: Vec<Input>,
    pub outputs: Vec<Output>,
    pub rets: Vec<RetShape>,
    pub rng_consumed: u64,
}

pub(crate) enum Plan {
    Done(Box<Planned>),
    Declined(String),
    Resize(Vec<(usize, Vec<i64>)>),
}

/// A bucketed program's result as a static flat array of its padded shape (`real`: the real
/// size of each dim that may be padded): it leaves as a plain buffer that the next bucketed
/// program reads in place (see `buckets::Padded`).
fn padded_result(b: &mut Builder, v: Value, real: &[(usize, Value)]) -> Value {
    let n = b.ty(v).numel();
    let v = b.forget_dynamic_sizes(v, real);
    b.reshape(v, &[n])
}

pub(crate) fn plan(
    op: &str,
    overload: &str,
    device: usize,
    params: &[Param],
    var: Variant,
) -> Result<Plan> {
    plan_with(op, overload, device, params, var, None)
}

/// `plan`, bucketed when `staging` is given: staged inputs, results in static flat arrays
/// of their padded shapes (`padded_result`), targets replaced whole.
pub(crate) fn plan_with(
    op: &str,
    overload: &str,
    device: usize,
    params: &[Param],
    var: Variant,
    staging: Option<&crate::buckets::Staging>,
) -> Result<Plan> {
    let mut b = Builder::new();
    b.set_padded(staging.is_some());
    let mut src = ProgramInputs {
        inputs: Vec::new(),
        rng_consumed: 0,
        staging,
        sizes: Vec::new(),
    };
    let low = match lower_into(&mut b, &mut src, op, overload, device, params, var)? {
        LowerOutcome::Done(l) => l,
        LowerOutcome::Declined(w) => return Ok(Plan::Declined(w)),
        LowerOutcome::Resize(r) => return Ok(Plan::Resize(r)),
    };
    let mut results = Vec::new();
    let mut outputs = Vec::new();
    let mut dims: Vec<Vec<i64>> = low.new.iter().map(|v| b.shape(*v)).collect();
    dims.extend(low.writes.iter().map(|w| b.shape(w.2)));
    for v in &low.new {
        let ty = b.ty(*v).clone();
        results.push(if staging.is_some() {
            let real = src.result_sizes(&mut b, results.len(), &ty.shape);
            padded_result(&mut b, *v, &real)
        } else {
            b.reshape(*v, &[ty.numel()])
        });
        outputs.push(Output::New {
            dtype: ty.dtype,
            sizes: ty.shape,
        });
    }
    for (path, dtype, v) in &low.writes {
        results.push(if staging.is_some() {
            let shape = b.shape(*v);
            let real = src.result_sizes(&mut b, results.len(), &shape);
            padded_result(&mut b, *v, &real)
        } else {
            *v
        });
        outputs.push(Output::Write {
            path: *path,
            dtype: *dtype,
        });
    }
    for c in low.checks {
        dims.push(b.shape(c.bad));
        results.push(c.bad);
        outputs.push(Output::Check {
            kind: c.kind,
            msg: c.msg,
        });
    }
    Ok(Plan::Done(Box::new(Planned {
        result_dims: dims,
        b,
        results,
        inputs: src.inputs,
        outputs,
        rets: low.rets,
        rng_consumed: src.rng_consumed,
    })))
}

/// Plans and compiles an op's program; `in_pool`: the compilation runs on the compile pool
/// and the program is returned at once (Strict).
#[allow(clippy::too_many_arguments)]
fn build(
    rt: &Runtime,
    op: &str,
    overload: &str,
    device: usize,
    params: &[Param],
    var: Variant,
    staging: Option<&crate::buckets::Staging>,
    in_pool: bool,
) -> Result<Built> {
    let p = match plan_with(op, overload, device, params, var, staging)? {
        Plan::Done(p) => p,
        Plan::Declined(w) => return Ok(Built::Declined(w)),
        Plan::Resize(r) => return Ok(Built::Resize(r)),
    };
    let mlir = p.b.finish(&p.results);
    if std::env::var_os("TORCH_PJRT_DUMP").is_some() {
        eprintln!("// {op}.{overload}\n{mlir}");
    }
    let shapes: Vec<String> = tensors(params)
        .iter()
        .map(|(_, t)| format!("{}{}", dt_name(t.dtype), shape_str(&t.view.sizes)))
        .collect();
    let what = format!("{op}.{overload} for inputs ({})", shapes.join(", "));
    let prog = Program {
        compiled: std::sync::OnceLock::new(),
        pool_source: Default::default(),
        device,
        inputs: p.inputs,
        outputs: p.outputs,
        rets: p.rets,
        rng_consumed: p.rng_consumed,
        bucketed: staging.is_some(),
        result_dims: p.result_dims,
    };
    let custom = crate::options::current();
    let compile = move |rt: &Runtime| -> Result<Compiled> {
        let quick = crate::tiers::quick_enabled();
        let (exe, quick) = rt
            .compile_full(&mlir, device, false, custom.as_deref(), quick, false)
            .map_err(|e| Error::runtime(format!("XLA failed to compile {what}: {}", e.msg)))?;
        Ok(Compiled {
            exe,
            quick: quick.then(|| crate::tiers::Quick {
                mlir,
                custom,
                runs: Default::default(),
            }),
        })
    };
    if !in_pool {
        let c = compile(rt)?;
        let _ = prog.compiled.set(Ok(c));
        return Ok(Built::Program(Arc::new(prog)));
    }
    // Strict: compiled by the pool while Python goes on; the op's job waits for it.
    let prog = Arc::new(prog);
    let me = prog.clone();
    crate::tiers::compile(move || {
        // A job waits for this cell: it must be set, whatever happens.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            crate::get().and_then(compile)
        }))
        .unwrap_or_else(|_| Err(Error::runtime("the XLA compilation of an op panicked")));
        // The compilation noted on this thread, for the profiler (when it is on).
        let source = crate::trace::take_source();
        if source != crate::trace::Source::Hit {
            *me.pool_source.lock().unwrap_or_else(|e| e.into_inner()) = Some(source);
        }
        let _ = me.compiled.set(r);
    });
    Ok(Built::Program(prog))
}

/// A bucketed program, the real sizes of the call's new tensors, the program's cache key.
type Served = (Arc<Program>, crate::buckets::NewSizes, Vec<u8>);

/// The bucketed program for a call whose exact program is not cached, if its signature
/// has changing shapes (see `buckets`; `observed`: DeferAndFuse asked already), with the real
/// sizes of its new tensors.
#[allow(clippy::too_many_arguments)]
fn bucketed(
    rt: &Runtime,
    op: &str,
    overload: &str,
    device: usize,
    params: &[Param],
    var: Variant,
    exact_key: &[u8],
    observed: Option<crate::buckets::Staging>,
) -> Result<Option<Served>> {
    let Some(st) = observed.or_else(|| rt.buckets.observe(op, overload, device, params, var))
    else {
        return Ok(None);
    };
    let real = rt.buckets.new_sizes(exact_key, || {
        Ok(match plan(op, overload, device, params, var)? {
            Plan::Done(p) => Some(crate::buckets::Exact {
                sizes: p
                    .outputs
                    .iter()
                    .filter_map(|o| match o {
                        Output::New { sizes, .. } => Some(sizes.clone()),
                        _ => None,
                    })
                    .collect(),
                rets: p.rets,
            }),
            Plan::Declined(_) | Plan::Resize(_) => None,
        })
    })?;
    let Some((real, calls)) = real else {
        return Ok(None);
    };
    if calls.is_some_and(|n| rt.buckets.exact_is_due(&st.sig, n)) {
        exact_in_background(op, overload, device, params, var, exact_key)?;
    }
    let fresh = calls == Some(1);
    let padded_params = crate::buckets::pad_size_args(params, &st);
    let params = padded_params.as_deref().unwrap_or(params);
    let bk = key_with(op, overload, device, params, KeyMode::Bucket(&st));
    if let Some(p) = rt.cache.get(&bk) {
        rt.metrics.bucket_hit(op, fresh);
        return Ok(Some((p, real, bk)));
    }
    match build(rt, op, overload, device, params, var, Some(&st), false) {
        Ok(Built::Program(p)) => {
            rt.cache.insert(bk.clone(), p.clone());
            rt.metrics.bucket_compile(op);
            Ok(Some((p, real, bk)))
        }
        // XLA's dynamic padder does not take every program: exact shapes for this one.
        Ok(_) | Err(_) => {
            rt.buckets.disable(&st.sig);
            Ok(None)
        }
    }
}

/// Plans a call's exact program here and compiles it on the background thread, into the
/// cache under `key` (a bucketed program serves the call until then).
fn exact_in_background(
    op: &str,
    overload: &str,
    device: usize,
    params: &[Param],
    var: Variant,
    key: &[u8],
) -> Result<()> {
    let Plan::Done(p) = plan(op, overload, device, params, var)? else {
        return Ok(());
    };
    let mlir = p.b.finish(&p.results);
    let (custom, key, op) = (crate::options::current(), key.to_vec(), op.to_string());
    crate::tiers::background(move || {
        let Ok(rt) = crate::get() else { return };
        if let Ok((exe, _)) = rt.compile_full(&mlir, device, false, custom.as_deref(), false, true)
        {
            rt.metrics.exact_program(&op);
            rt.cache.insert(
                key,
                Arc::new(Program {
                    compiled: std::sync::OnceLock::from(Ok(Compiled { exe, quick: None })),
                    pool_source: Default::default(),
                    device,
                    inputs: p.inputs,
                    outputs: p.outputs,
                    rets: p.rets,
                    rng_consumed: p.rng_consumed,
                    bucketed: false,
                    result_dims: p.result_dims,
                }),
            );
        }
    });
    Ok(())
}

/// Result `i` of a queued bucketed program stays padded in its buffer (of this layout) for
/// the next bucketed op to read on the device; a permuted out= target is laid out on the
/// host instead, and a result without padding is an exact buffer.
fn keep_padded(layouts: &[crate::buckets::ResultLayout], i: usize) -> Option<Padded> {
    let r = layouts.get(i)?;
    (r.target.is_none() && !r.layout.is_exact()).then(|| r.layout.clone())
}

/// The real size of dim `dim` of a bucketed program's result `result`: a new tensor's from
/// the call's real sizes, a target's from its view.
fn result_size(
    prog: &Program,
    params: &[Param],
    real: Option<&[Vec<i64>]>,
    result: usize,
    dim: usize,
) -> i64 {
    match &prog.outputs[result] {
        Output::Write { path, .. } => tensor_at(params, *path).view.sizes[dim],
        _ => {
            let k = prog.outputs[..result]
                .iter()
                .filter(|o| matches!(o, Output::New { .. }))
                .count();
            real.map_or(1, |r| r[k][dim])
        }
    }
}

/// The storage of a device tensor argument, shared with a queued job.
fn queued_storage(t: &TensorRef) -> Arc<Storage> {
    let Loc::Device(p) = t.loc else {
        unreachable!("a device input on the host")
    };
    // SAFETY: the shim holds the tensor alive during the call.
    unsafe { Storage::share(p) }
}

/// The layout of a staged tensor's storage buffer when the op is queued.
fn storage_layout(t: &TensorRef) -> Padded {
    let s = t.storage().expect("device tensor");
    match s.padded_layout() {
        Some((_, p)) => p,
        None => Padded::exact(t.nbytes / t.dtype.map_or(1, |d| d.size() as i64)),
    }
}

/// A staged view's offset (`dim` None) or the stride of `dim`, in its storage's buffer.
fn view_int(t: &TensorRef, dim: Option<usize>) -> i64 {
    let read = crate::buckets::read_in(&t.view, &storage_layout(t));
    let v = read.map_or_else(|| t.view.clone(), |r| r.view);
    dim.map_or(v.offset, |d| v.strides[d])
}

/// The layout of each result of a bucketed program (new tensors, then targets).
fn result_layouts(
    prog: &Program,
    params: &[Param],
    real: Option<&[Vec<i64>]>,
) -> Vec<crate::buckets::ResultLayout> {
    let Some(real) = real.filter(|_| prog.bucketed) else {
        return Vec::new();
    };
    let mut news = real.iter();
    prog.outputs
        .iter()
        .zip(&prog.result_dims)
        .filter_map(|(o, padded)| {
            let (real, target) = match o {
                Output::New { .. } => (news.next()?.clone(), None),
                Output::Write { path, .. } => {
                    let v = &tensor_at(params, *path).view;
                    (v.sizes.clone(), (!v.is_contiguous()).then(|| v.clone()))
                }
                Output::Check { .. } => return None,
            };
            let layout = Padded {
                padded: padded.clone(),
                real,
            };
            Some(crate::buckets::ResultLayout { layout, target })
        })
        .collect()
}

/// Debug mode: wait for the op, so its error is raised here; optionally check NaN/Inf.
fn debug_check(rt: &Runtime, op: &str, params: &[Param], outs: &[Arc<pjrt::Buffer>]) -> Result<()> {
    let shapes = || {
        tensors(params)
            .iter()
            .map(|(_, t)| shape_str(&t.view.sizes))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for b in outs {
        b.ready().map_err(|e| {
            Error::runtime(format!(
                "{op} failed on the tpu device (inputs {}): {}",
                shapes(),
                e.message
            ))
        })?;
    }
    if crate::mode::check_nans() {
        for b in outs {
            let ty = crate::from_pjrt(b.element_type());
            if let Some(ty) = ty.filter(|t| t.is_float()) {
                let bytes = rt.download(b)?;
                if crate::host::has_nan_or_inf(&bytes, ty) {
                    return Err(Error::runtime(format!(
                        "{op} produced NaN or Inf (TORCH_TPU_CHECK_NANS=1); input shapes: {}",
                        shapes()
                    )));
                }
            }
        }
    }
    Ok(())
}

fn to_arg(b: &Builder, a: &RArg, i: usize, j: Option<usize>, values: &HashMap<Path, Value>) -> Arg {
    match a {
        RArg::None => Arg::None,
        RArg::Tensor(t) => Arg::Tensor(TensorArg {
            value: values[&(i, j)],
            dtype: t.dtype.expect("checked"),
            // The value's shape: a staged tensor's is padded.
            shape: b.shape(values[&(i, j)]),
            wrapped_number: t.wrapped,
        }),
        RArg::Int(v) => Arg::Int(*v),
        RArg::Float(v) => Arg::Float(*v),
        RArg::Complex(re, im) => Arg::Complex(*re, *im),
        RArg::Bool(v) => Arg::Bool(*v),
        RArg::Str(s) => Arg::Str(s.clone()),
        RArg::ScalarType(Some(d)) => Arg::ScalarType(*d),
        RArg::ScalarType(None) => Arg::Other,
        RArg::List(items) => Arg::List(
            items
                .iter()
                .enumerate()
                .map(|(k, x)| to_arg(b, x, i, Some(k), values))
                .collect(),
        ),
        RArg::Generator(_) | RArg::Device(_) | RArg::Other(_) => Arg::Other,
    }
}

/// Strict: queues the op on the worker; its outputs are pending storages.
/// Refuses an op whose new tensors the device cannot hold, before anything runs.
pub(crate) fn admit_outputs(outputs: &[Output], device: usize) -> Result<()> {
    let bytes: i64 = outputs
        .iter()
        .map(|o| match o {
            Output::New { dtype, sizes } => sizes.iter().product::<i64>() * dtype.size() as i64,
            _ => 0,
        })
        .sum();
    crate::memory::admit(device, bytes)
}

fn execute_async(
    rt: &Runtime,
    op: &str,
    prog: &Arc<Program>,
    params: &[Param],
    device: usize,
    real: Option<&[Vec<i64>]>,
) -> Result<Vec<Ret>> {
    admit_outputs(&prog.outputs, device)?;
    let padded = result_layouts(prog, params, real);
    let mut real_new = real.filter(|_| prog.bucketed).map(|r| r.iter());
    let mut inputs = Vec::with_capacity(prog.inputs.len());
    for inp in &prog.inputs {
        match inp {
            Input::Staged {
                path,
                dtype,
                padded,
            } => {
                let t = tensor_at(params, *path);
                let s = queued_storage(t);
                inputs.push(JobIn::Staged(s, *dtype, t.view.clone(), padded.clone()));
            }
            Input::Size { path, dim } => {
                let n = tensor_at(params, *path).view.sizes[*dim] as i32;
                inputs.push(JobIn::Buf(rt.upload_input(
                    &n.to_le_bytes(),
                    DType::I32,
                    &[],
                    device,
                )?));
            }
            Input::Padded {
                path,
                dtype,
                padded,
            } => {
                let t = tensor_at(params, *path);
                let layout = storage_layout(t);
                debug_assert_eq!(&layout.padded, padded, "the key names the layout");
                inputs.push(JobIn::Padded(queued_storage(t), *dtype, layout));
            }
            Input::StorageSize { path, dim } => {
                let n = storage_layout(tensor_at(params, *path)).real[*dim];
                inputs.push(JobIn::Buf(rt.upload_input(
                    &n.to_le_bytes(),
                    DType::I64,
                    &[],
                    device,
                )?));
            }
            Input::ViewInt { path, dim } => {
                let v = view_int(tensor_at(params, *path), *dim);
                inputs.push(JobIn::Buf(rt.upload_input(
                    &v.to_le_bytes(),
                    DType::I64,
                    &[],
                    device,
                )?));
            }
            Input::ResultSize { result, dim } => {
                let v = result_size(prog, params, real, *result, *dim);
                inputs.push(JobIn::Buf(rt.upload_input(
                    &v.to_le_bytes(),
                    DType::I64,
                    &[],
                    device,
                )?));
            }
            Input::Storage { path, dtype } => {
                let t = tensor_at(params, *path);
                let Loc::Device(p) = t.loc else {
                    unreachable!("storage input on the host")
                };
                // SAFETY: the shim holds the tensor alive during the call.
                inputs.push(JobIn::Storage(unsafe { Storage::share(p) }, *dtype));
            }
            Input::Host { path, dtype } => {
                let t = tensor_at(params, *path);
                let Loc::Host(p) = t.loc else {
                    unreachable!("host input")
                };
                // SAFETY: PyTorch keeps the CPU tensor alive during the call and its view is
                // inside its storage.
                let bytes = unsafe { host::read(p, &t.view, dtype.size()) };
                inputs.push(JobIn::Buf(rt.upload_input(
                    &bytes,
                    *dtype,
                    &t.view.sizes,
                    device,
                )?));
            }
            Input::Rng { path } => {
                let state = path.and_then(|p| match params[p.0].arg {
                    RArg::Generator(g) => Some(g),
                    _ => None,
                });
                inputs.push(JobIn::Buf(crate::rng_input(
                    rt,
                    state,
                    device,
                    prog.rng_consumed,
                )?));
            }
        }
    }
    let mut new = Vec::new();
    let worker = crate::get()?.worker.current();
    worker.submit(|seq| {
        let mut outputs = Vec::with_capacity(prog.outputs.len());
        for o in &prog.outputs {
            match o {
                Output::New { dtype, sizes } => {
                    let sizes = match real_new.as_mut() {
                        Some(r) => r.next().expect("one real shape per new tensor"),
                        None => sizes,
                    };
                    let n: i64 = sizes.iter().product();
                    let s = Arc::new(Storage::new(n * dtype.size() as i64, device));
                    s.mark_pending(seq);
                    if let Some(layout) = keep_padded(&padded, outputs.len()) {
                        s.will_pad(*dtype, layout);
                    }
                    outputs.push((s.clone(), *dtype));
                    new.push(Ret::Tensor {
                        handle: Arc::into_raw(s) as *mut Storage,
                        dtype: *dtype,
                        sizes: sizes.clone(),
                        device,
                    });
                }
                Output::Write { path, dtype } => {
                    if let Loc::Device(p) = tensor_at(params, *path).loc {
                        // SAFETY: the shim holds the tensor alive during the call.
                        let s = unsafe { Storage::share(p) };
                        s.mark_pending(seq);
                        if let Some(layout) = keep_padded(&padded, outputs.len()) {
                            s.will_pad(*dtype, layout);
                        }
                        outputs.push((s, *dtype));
                    }
                }
                Output::Check { .. } => {}
            }
        }
        Job {
            op: op.to_string(),
            work: crate::worker::Work::Op(prog.clone()),
            inputs,
            new_outputs: new.len(),
            outputs,
            deps: Vec::new(),
            padded,
        }
    })?;
    Ok(new)
}

fn execute(
    rt: &Runtime,
    op: &str,
    prog: &Program,
    params: &[Param],
    real: Option<&[Vec<i64>]>,
) -> Result<Vec<Ret>> {
    if let Some(msg) = crate::worker::injected_failure(op) {
        return Err(Error::runtime(msg));
    }
    let mut bufs: Vec<Arc<pjrt::Buffer>> = Vec::with_capacity(prog.inputs.len());
    // Host inputs go to the program's device, also when they come before any device input.
    let device = prog.device;
    admit_outputs(&prog.outputs, device)?;
    for inp in &prog.inputs {
        match inp {
            Input::Storage { path, dtype } => {
                let t = tensor_at(params, *path);
                bufs.push(t.storage().expect("device tensor").buffer_as(rt, *dtype)?);
            }
            Input::Host { path, dtype } => {
                let t = tensor_at(params, *path);
                let Loc::Host(p) = t.loc else {
                    unreachable!("host input")
                };
                // SAFETY: PyTorch keeps the CPU tensor alive during the call and its view is
                // inside its storage.
                let bytes = unsafe { host::read(p, &t.view, dtype.size()) };
                bufs.push(rt.upload_input(&bytes, *dtype, &t.view.sizes, device)?);
            }
            Input::Rng { path } => {
                let state = path.and_then(|p| match params[p.0].arg {
                    RArg::Generator(g) => Some(g),
                    _ => None,
                });
                bufs.push(crate::rng_input(rt, state, device, prog.rng_consumed)?);
            }
            Input::Staged {
                path,
                dtype,
                padded,
            } => {
                let t = tensor_at(params, *path);
                let whole = t.storage().expect("device tensor").buffer_as(rt, *dtype)?;
                bufs.push(crate::buckets::stage(rt, &whole, *dtype, &t.view, padded)?);
            }
            Input::Size { path, dim } => {
                let n = tensor_at(params, *path).view.sizes[*dim] as i32;
                bufs.push(rt.upload_input(&n.to_le_bytes(), DType::I32, &[], device)?);
            }
            Input::Padded {
                path,
                dtype,
                padded,
            } => {
                let t = tensor_at(params, *path);
                let s = t.storage().expect("device tensor");
                let layout = storage_layout(t);
                debug_assert_eq!(&layout.padded, padded, "the key names the layout");
                bufs.push(crate::buckets::padded_input(rt, s, *dtype, &layout)?);
            }
            Input::StorageSize { path, dim } => {
                let n = storage_layout(tensor_at(params, *path)).real[*dim];
                bufs.push(rt.upload_input(&n.to_le_bytes(), DType::I64, &[], device)?);
            }
            Input::ViewInt { path, dim } => {
                let v = view_int(tensor_at(params, *path), *dim);
                bufs.push(rt.upload_input(&v.to_le_bytes(), DType::I64, &[], device)?);
            }
            Input::ResultSize { result, dim } => {
                let v = result_size(prog, params, real, *result, *dim);
                bufs.push(rt.upload_input(&v.to_le_bytes(), DType::I64, &[], device)?);
            }
        }
    }
    let refs: Vec<&pjrt::Buffer> = bufs.iter().map(|b| b.as_ref()).collect();
    let traced = crate::trace::queued();
    let start = crate::trace::now();
    let outs = prog.exe()?.execute(&refs)?;
    rt.metrics
        .executions
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let outs: Vec<Arc<pjrt::Buffer>> = outs.into_iter().map(Arc::new).collect();
    if let Some(q) = traced {
        let stream = crate::worker::Streams::current_index();
        crate::trace::finish(op, device, stream, q, start, &outs);
    }
    if crate::mode::get() == crate::mode::EagerMode::Debug {
        debug_check(rt, op, params, &outs)?;
    } else {
        rt.track(op, &outs);
    }
    // Nothing is written when a check fails: the op raises as if it never ran.
    if let Some(e) = failed_check(rt, &prog.outputs, &outs)? {
        return Err(e);
    }
    let padded = result_layouts(prog, params, real);
    let mut real_new = real.filter(|_| prog.bucketed).map(|r| r.iter());
    let mut new = Vec::new();
    for (i, (o, buf)) in prog.outputs.iter().zip(outs).enumerate() {
        // Kept padded for the next bucketed op, as in Strict.
        let keep = keep_padded(&padded, i);
        let buf = match (o, padded.get(i)) {
            (Output::New { dtype, .. } | Output::Write { dtype, .. }, Some(p))
                if keep.is_none() =>
            {
                crate::buckets::compact(rt, &buf, *dtype, p)?
            }
            _ => buf,
        };
        match o {
            Output::New { dtype, sizes } => {
                let sizes = match real_new.as_mut() {
                    Some(r) => r.next().expect("one real shape per new tensor"),
                    None => sizes,
                };
                let dev = buf.device();
                let s = match keep {
                    Some(layout) => Storage::with_layout(buf, *dtype, dev, layout),
                    None => Storage::with_buffer(buf, *dtype, dev),
                };
                new.push(Ret::Tensor {
                    handle: s.into_handle(),
                    dtype: *dtype,
                    sizes: sizes.clone(),
                    device: dev,
                });
            }
            Output::Write { path, dtype } => {
                tensor_at(params, *path)
                    .storage()
                    .expect("device tensor")
                    .set_as(buf, *dtype, keep)?;
            }
            Output::Check { .. } => {}
        }
    }
    Ok(new)
}

/// A failed check's message when it surfaces after the op: PyTorch's message first (as the
/// CPU would raise it at the op), then which op found it.
pub(crate) fn checked_by(msg: &str, op: &str) -> String {
    format!("{msg}\n(found by {op}'s index check on the tpu device, read after it ran)")
}

/// The error of the first failed check among a program's outputs (`outs` parallel to
/// `outputs`); reading a check waits for the program.
pub(crate) fn failed_check(
    rt: &Runtime,
    outputs: &[Output],
    outs: &[Arc<pjrt::Buffer>],
) -> Result<Option<Error>> {
    let (checks, bufs): (Vec<_>, Vec<_>) = outputs
        .iter()
        .zip(outs)
        .filter_map(|(o, b)| match o {
            Output::Check { kind, msg } => Some(((*kind, msg.as_str()), b.clone())),
            _ => None,
        })
        .unzip();
    rt.failed_checks(checks, &bufs)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::layout::view;

    #[test]
    fn a_transposed_view_is_gathered_in_its_buffers_order() {
        // [B*T, N] = [10, 4] held as [16, 4], read as its transpose [N, B*T].
        let layout = Padded {
            padded: vec![16, 4],
            real: vec![10, 4],
        };
        let read = crate::buckets::read_in(&view(&[4, 10], &[1, 4], 0), &layout).unwrap();
        let g = in_buffer_order(&read, &layout, &[None, Some(16)]);
        assert_eq!(g.perm, vec![1, 0]);
        assert_eq!(g.read.view.strides, vec![4, 1]);
        assert_eq!(g.dims, vec![Some(16), None]);
        // Rows of N: one index per row of the buffer, not one per element.
        assert_eq!(read_rows(&g.read, &layout, &g.dims), 1);
    }

    #[test]
    fn a_padded_innermost_dim_is_read_whole_only_inside_the_buffer() {
        let rows = |v: View, dims: &[Option<i64>], cap: i64| {
            let read = ReadView {
                view: v,
                merged: Vec::new(),
            };
            read_rows(&read, &Padded::exact(cap), dims)
        };
        let padded = [None, Some(32)];
        // [3, 20] in a buffer of 96: the last row starts at 40, 40 + 32 <= 96.
        assert_eq!(rows(view(&[3, 20], &[20, 1], 0), &padded, 96), 1);
        // The same view near the end of a buffer of 70: a row read whole would be clamped.
        assert_eq!(rows(view(&[3, 20], &[20, 1], 0), &padded, 70), 0);
        // Strided innermost dim: one element at a time.
        assert_eq!(rows(view(&[3, 20], &[1, 3], 0), &padded, 96), 0);
        // Static trailing dims keep their rows.
        assert_eq!(rows(view(&[20, 8], &[8, 1], 0), &[Some(32), None], 256), 1);
        // A merged dim ([B*T, C] over [B, T, C], T and C padded): its last row starts at
        // the real tensor's last row in the padded buffer.
        let layout = Padded {
            padded: vec![2, 8, 16],
            real: vec![2, 5, 10],
        };
        let read = crate::buckets::read_in(&view(&[10, 10], &[10, 1], 0), &layout).unwrap();
        assert_eq!(crate::buckets::last_row_start(&read, &layout), 128 + 4 * 16);
        assert_eq!(read_rows(&read, &layout, &[Some(16), Some(16)]), 1);
    }
}
