//! DeferAndFuse: ops are lowered into one pending graph per device instead of running.
//!
//! A storage written by a recorded op becomes "lazy": its value is an SSA value of the
//! graph. The graph is flushed (one module, compiled once per structure, run once) when a
//! value is needed on the host, when a lazy storage is read outside the graph, when the mode
//! changes, or when it grows past a size limit. Only storages still alive at flush time are
//! outputs: intermediates nobody refers to are never written out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use stablehlo::{Builder, DType, TensorType, Value};

use crate::exec::{
    key, plan, returns_of, tensor_at, Input, Loc, Outcome, Output, Param, Path, Plan, RArg, Ret,
    RetShape, Sources, TensorRef, Variant,
};
use crate::storage::Storage;
use crate::{host, Error, ErrorKind, Result, Runtime};

mod split;

/// A pending value of a storage: (flat value, dtype, a reference that keeps the storage
/// and its address alive until the graph runs).
type Pending = (Value, DType, Arc<Storage>);

/// A graph input: a buffer, or a storage the Strict worker is still computing (a split
/// flush's queued remainder), read when the graph runs.
enum GraphIn {
    Buf(Arc<pjrt::Buffer>),
    Later(Arc<Storage>, DType),
    /// A `Later` whose computation failed (kept when the storage is then overwritten).
    Failed(Error),
}

/// One recorded op: where it is in `@main`'s body and what it reads, so that a flush can
/// run only the part a host read needs (see `split`).
struct OpRec {
    /// Byte range of its lines in the body.
    text: (usize, usize),
    /// First value id it created (its parameters, results and casts); the next op's first
    /// id ends the range.
    first: u32,
    /// Results of earlier ops it reads.
    deps: Vec<Value>,
    /// Graph parameters it reads.
    params: Vec<Value>,
    /// Its function, an index into `funcs`.
    func: usize,
    /// The functions that one calls (a replayed compiled graph's ops); empty for an op.
    callees: Vec<usize>,
}

struct Graph {
    b: Builder,
    inputs: Vec<GraphIn>,
    /// What each input is (parallel to `inputs`), for replaying captured graphs.
    sources: Vec<Src>,
    /// Storages read from their materialized buffer: their parameter.
    params: HashMap<usize, Pending>,
    /// The op functions the graph calls, each once, in first-call order.
    funcs: Vec<Arc<Fragment>>,
    /// Function (by fragment address) -> its index in `funcs`.
    called: HashMap<usize, usize>,
    /// The recorded ops, in order (kept only while split reads are on).
    recs: Vec<OpRec>,
    ops: usize,
    /// Optimizer steps that ended while this graph was pending (see `step_boundary`).
    steps: usize,
    /// Recording a graph for torch.compile: no size-limit flushes.
    capturing: bool,
    /// A flush happened while capturing: the capture cannot be replayed.
    broken: bool,
    /// Recorded ops' data checks (see `lowering::Check`), verified after the graph runs.
    checks: Vec<(Value, ErrorKind, String)>,
    /// Before each op with checks (its first check's index): the pending storages' values,
    /// which stand if that op's check fails (see `keep_before_failure`).
    snapshots: Vec<(usize, Snapshot)>,
}

/// Pending storages (their keys) and their values at one point of the graph.
type Snapshot = Vec<(usize, Value, DType)>;

/// A graph's checks as `Runtime::first_failed_check` reads them.
fn check_kinds(checks: &[(Value, ErrorKind, String)]) -> impl Iterator<Item = (ErrorKind, &str)> {
    checks.iter().map(|c| (c.1, c.2.as_str()))
}

#[derive(Clone, Copy, Debug)]
enum Src {
    Storage(usize, DType),
    Host,
    Rng(u64),
}

/// One op lowered once as a private function; recording it again only adds a call.
pub(crate) struct Fragment {
    name: String,
    text: String,
    inputs: Vec<Input>,
    outputs: Vec<Output>,
    result_types: Vec<TensorType>,
    /// The call's type signature, printed once.
    signature: String,
    rets: Vec<RetShape>,
    rng_consumed: u64,
    /// Imported kernels' functions it calls (see `Builder::add_func`).
    kernels: Vec<(String, Arc<str>)>,
}

impl Graph {
    /// The module: `@main` returning `outs`, then every function it calls.
    fn module(&self, outs: &[Value]) -> String {
        // A replayed compiled graph brings its ops' functions, which may also be called
        // directly: each name is printed once.
        let mut seen = std::collections::HashSet::new();
        let texts: Vec<&str> = self
            .funcs
            .iter()
            .filter(|f| seen.insert(f.name.as_str()))
            .map(|f| f.text.as_str())
            .collect();
        self.b.finish_with(outs, &texts)
    }

    /// Before recording an op with checks: the pending storages' values (`lazy`), if any,
    /// kept in case that op's check fails.
    fn snapshot(&mut self, lazy: &HashMap<usize, (Value, DType, Arc<Storage>)>) {
        if !lazy.is_empty() {
            let s = lazy.iter().map(|(k, (v, t, _))| (*k, *v, *t)).collect();
            self.snapshots.push((self.checks.len(), s));
        }
    }

    fn new() -> Graph {
        Graph {
            b: Builder::new(),
            inputs: Vec::new(),
            sources: Vec::new(),
            params: HashMap::new(),
            funcs: Vec::new(),
            called: HashMap::new(),
            recs: Vec::new(),
            ops: 0,
            steps: 0,
            capturing: false,
            broken: false,
            checks: Vec::new(),
            snapshots: Vec::new(),
        }
    }
}

/// A deferred graph's executable; `quick` until its optimized version replaces it.
#[derive(Clone)]
struct GraphProgram {
    exe: Arc<pjrt::Executable>,
    quick: Option<Arc<crate::tiers::Quick>>,
}

/// A function name unique to `key`'s content.
fn hashed_name(prefix: &str, key: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let h = Sha256::digest(key);
    let hex: String = h[..12].iter().map(|x| format!("{x:02x}")).collect();
    format!("{prefix}_{hex}")
}

/// Per-device pending graphs and their lazy storages.
pub struct Deferred {
    graphs: Vec<Mutex<Graph>>,
    /// Lazy storage -> its current flat value. Locked after its graph, never before.
    lazy: Vec<Mutex<HashMap<usize, Pending>>>,
    /// Compiled graphs by (device, text of `@main`): an executable is bound to its device,
    /// and the callees' names are hashes of their ops' keys. A quick program (see `tiers`)
    /// keeps what its optimized compilation needs until it becomes hot.
    programs: Mutex<HashMap<(usize, String), GraphProgram>>,
    /// Op functions by the op's cache key (the same key Strict programs use).
    fragments: Mutex<HashMap<Vec<u8>, Arc<Fragment>>>,
    max_ops: usize,
    /// Whether a host read runs only what it needs and queues the rest (see `split`).
    split_reads: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Deferred {
    /// `host_device`: the device computes on the host's cores (the CPU plugin), so queued
    /// work competes with Python's recording instead of overlapping it: split reads are off
    /// unless `TORCH_TPU_DEFER_SPLIT_READS=1`.
    pub fn new(devices: usize, host_device: bool) -> Deferred {
        let max_ops = std::env::var("TORCH_TPU_DEFER_MAX_OPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4000);
        let split_reads = match std::env::var("TORCH_TPU_DEFER_SPLIT_READS").as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => !host_device,
        };
        Deferred {
            graphs: (0..devices.max(1))
                .map(|_| Mutex::new(Graph::new()))
                .collect(),
            lazy: (0..devices.max(1))
                .map(|_| Mutex::new(HashMap::new()))
                .collect(),
            programs: Mutex::new(HashMap::new()),
            fragments: Mutex::new(HashMap::new()),
            max_ops,
            split_reads,
        }
    }

    /// An op fell back to the CPU: a graph being captured cannot be replayed.
    pub fn note_fallback(&self) {
        for g in &self.graphs {
            let mut g = lock(g);
            if g.capturing {
                g.broken = true;
            }
        }
    }

    /// A device value was read on the host: a graph being captured there cannot be replayed.
    pub fn note_host_read(&self, device: usize) {
        if let Some(g) = self.graphs.get(device) {
            let mut g = lock(g);
            if g.capturing {
                g.broken = true;
            }
        }
    }

    /// Whether a torch.compile capture is recording on `device`.
    pub(crate) fn capturing(&self, device: usize) -> bool {
        self.graphs.get(device).is_some_and(|g| lock(g).capturing)
    }

    pub fn pending_ops(&self, device: usize) -> usize {
        self.graphs.get(device).map(|g| lock(g).ops).unwrap_or(0)
    }

    /// Whether the pending graph of `device` reads storage `key` (at its address) as an
    /// input: a write from outside the graph must run the graph first, or the graph's later
    /// reads would reuse that input's old value and its earlier ones could see the new.
    pub(crate) fn graph_reads(&self, device: usize, key: usize) -> bool {
        self.graphs
            .get(device)
            .is_some_and(|g| lock(g).params.contains_key(&key))
    }

    /// Whether a write to `s` from outside the pending graph must run the graph first: the
    /// graph computes `s` (it is lazy) or reads it as an input (see `graph_reads`).
    pub(crate) fn write_flushes(&self, s: &Storage) -> bool {
        s.is_lazy() || self.graph_reads(s.device, s as *const Storage as usize)
    }

    /// The Python thread is about to replace a storage's buffer (the worker is drained):
    /// inputs still to be read from storages are read now, so that the graph keeps the
    /// value it recorded.
    pub(crate) fn read_later_inputs(&self, rt: &Runtime, device: usize) {
        let Some(g) = self.graphs.get(device) else {
            return;
        };
        for i in lock(g).inputs.iter_mut() {
            if let GraphIn::Later(s, dt) = i {
                *i = match s.poisoned() {
                    Some(e) => GraphIn::Failed(e),
                    None => match s.buffer_now(rt, *dt) {
                        Ok(b) => GraphIn::Buf(b),
                        Err(e) => GraphIn::Failed(e),
                    },
                };
            }
        }
    }

    pub fn clear_programs(&self) {
        lock(&self.programs).clear();
        lock(&self.fragments).clear();
    }
}

struct GraphSources<'a> {
    rt: &'a Runtime,
    device: usize,
    inputs: &'a mut Vec<GraphIn>,
    sources: &'a mut Vec<Src>,
    params: &'a mut HashMap<usize, Pending>,
    lazy: &'a Mutex<HashMap<usize, Pending>>,
    gen: Option<*mut i64>,
    capturing: bool,
    /// Storages this op added to `params` (removed again if the op fails).
    added: Vec<usize>,
    /// Earlier ops' results and the graph parameters this op reads (see `OpRec`), collected
    /// only when `track` (split reads are on).
    track: bool,
    deps: Vec<Value>,
    used_params: Vec<Value>,
}

impl Sources for GraphSources<'_> {
    fn storage(
        &mut self,
        b: &mut Builder,
        _path: Path,
        t: &TensorRef,
        dtype: DType,
        n: i64,
    ) -> Result<Value> {
        let Loc::Device(p) = t.loc else {
            return Err(Error::runtime("host tensor as storage"));
        };
        self.storage_at(b, p, dtype, n)
    }
    fn host(&mut self, b: &mut Builder, _path: Path, t: &TensorRef, dtype: DType) -> Result<Value> {
        let Loc::Host(p) = t.loc else {
            return Err(Error::runtime("device tensor as host input"));
        };
        // SAFETY: PyTorch keeps the CPU tensor alive during the call; the view is inside it.
        let bytes = unsafe { host::read(p, &t.view, dtype.size()) };
        if self.capturing && t.view.numel() == 1 {
            // A captured graph embeds its Python scalars (Dynamo guards on them).
            let c = match host::scalar(&bytes, dtype) {
                host::Scalar::Int(i) => b.constant_i64(dtype, i),
                host::Scalar::Float(f) => b.constant(dtype, f),
                host::Scalar::Complex(re, im) => b.constant_complex(dtype, re, im),
            };
            return Ok(b.reshape(c, &t.view.sizes));
        }
        self.inputs.push(GraphIn::Buf(self.rt.upload_input(
            &bytes,
            dtype,
            &t.view.sizes,
            self.device,
        )?));
        self.sources.push(Src::Host);
        let v = b.param(TensorType::new(dtype, &t.view.sizes));
        self.reads(None, Some(v));
        Ok(v)
    }

    fn rng(&mut self, _gen: Option<Path>, consumed: u64) -> Result<()> {
        self.inputs.push(GraphIn::Buf(crate::rng_input(
            self.rt,
            self.gen,
            self.device,
            consumed,
        )?));
        self.sources.push(Src::Rng(consumed));
        Ok(())
    }
}

impl GraphSources<'_> {
    fn reads(&mut self, dep: Option<Value>, param: Option<Value>) {
        if self.track {
            self.deps.extend(dep);
            self.used_params.extend(param);
        }
    }

    /// The parameter holding an op's RNG [seed, offset], advancing the generator by
    /// `consumed`.
    fn rng_param(&mut self, b: &mut Builder, consumed: u64) -> Result<Value> {
        let v = b.param(TensorType::new(DType::I64, &[2]));
        self.rng(None, consumed)?;
        self.reads(None, Some(v));
        Ok(v)
    }

    /// The flat value of storage `p` read as `n` elements of `dtype`: its pending value, or a
    /// new parameter bound to its buffer.
    fn storage_at(
        &mut self,
        b: &mut Builder,
        p: *const Storage,
        dtype: DType,
        n: i64,
    ) -> Result<Value> {
        let key = p as usize;
        let pending = lock(self.lazy).get(&key).map(|e| (e.0, e.1));
        if let Some((v, d)) = pending {
            self.reads(Some(v), None);
            if d == dtype {
                return Ok(v);
            }
            if let Some(r) = crate::layout::retype_flat(b, v, dtype) {
                return Ok(r);
            }
            return Err(Error::runtime(
                "DeferAndFuse cannot reinterpret a pending tensor with another element size; call torch.tpu.synchronize() first",
            ));
        }
        if let Some((v, d, _)) = self.params.get(&key) {
            if *d == dtype {
                let v = *v;
                self.reads(None, Some(v));
                return Ok(v);
            }
        }
        // SAFETY: the caller (the shim, or a replay's caller) keeps the storage alive
        // during the call.
        let storage = unsafe { &*p };
        let input = if storage.is_pending() && !storage.is_lazy() {
            // Still being computed by the worker: read when the graph runs, not now.
            // SAFETY: alive for the call (see above).
            GraphIn::Later(unsafe { Storage::share(p) }, dtype)
        } else {
            GraphIn::Buf(storage.buffer_as(self.rt, dtype)?)
        };
        let v = b.param(TensorType::new(dtype, &[n]));
        self.reads(None, Some(v));
        self.inputs.push(input);
        self.sources.push(Src::Storage(key, dtype));
        // SAFETY: alive for the call; the graph's reference keeps its address unique.
        self.params
            .insert(key, (v, dtype, unsafe { Storage::share(p) }));
        self.added.push(key);
        Ok(v)
    }

    /// A parameter bound to a fixed buffer (a compiled graph's constant).
    fn buffer(&mut self, b: &mut Builder, buf: Arc<pjrt::Buffer>, ty: TensorType) -> Value {
        self.inputs.push(GraphIn::Buf(buf));
        self.sources.push(Src::Host);
        let v = b.param(ty);
        self.reads(None, Some(v));
        v
    }
}

/// What recording an op did.
pub(crate) enum Recorded {
    Done(Outcome),
    /// The op's sizes change over time (shape buckets, see `buckets`): it runs as a per-op
    /// program serving a range of sizes, outside the graph, so that the graph keeps one
    /// structure (one compilation) whatever those sizes.
    Dynamic(crate::buckets::Staging),
}

/// The op's function, or why there is none.
enum Frag {
    Found(Arc<Fragment>),
    Outcome(Outcome),
    Dynamic(crate::buckets::Staging),
}

impl Runtime {
    /// The op's function, lowered on its first use. An op whose sizes change over time is
    /// not recorded (`Frag::Dynamic`) unless a torch.compile capture is recording.
    fn fragment(
        &self,
        op: &str,
        overload: &str,
        device: usize,
        params: &[Param],
        var: Variant,
    ) -> Result<Frag> {
        let k = key(op, overload, device, params);
        if let Some(f) = lock(&self.defer.fragments).get(&k) {
            return Ok(Frag::Found(f.clone()));
        }
        // A capture records exact fragments, but its shapes count as seen: a compiled graph's
        // next shape runs its ops eagerly on bucketed programs (`compiled.rs`, `Slot::Bucketed`).
        let dynamic = self.buckets.observe(op, overload, device, params, var);
        if let (Some(st), false) = (dynamic, self.defer.capturing(device)) {
            return Ok(Frag::Dynamic(st));
        }
        let p = match plan(op, overload, device, params, var)? {
            Plan::Done(p) => p,
            Plan::Declined(w) => return Ok(Frag::Outcome(Outcome::Declined(w))),
            Plan::Resize(r) => return Ok(Frag::Outcome(Outcome::Resize(r))),
        };
        let name = hashed_name("op", &k);
        let result_types: Vec<TensorType> = p.results.iter().map(|v| p.b.ty(*v).clone()).collect();
        let param_types: Vec<TensorType> = (0..p.inputs.len())
            .map(|i| p.b.param_type(i).clone())
            .collect();
        let f = Arc::new(Fragment {
            kernels: p.b.funcs().to_vec(),
            text: p.b.func_text(&name, &p.results),
            signature: Builder::call_signature(&param_types, &result_types),
            result_types,
            name,
            inputs: p.inputs,
            outputs: p.outputs,
            rets: p.rets,
            rng_consumed: p.rng_consumed,
        });
        lock(&self.defer.fragments).insert(k, f.clone());
        Ok(Frag::Found(f))
    }

    /// Appends one call of `f` (which calls `callees`) to the device's pending graph,
    /// counted as `n_ops` ops: `bind` reads its arguments into the graph. On error the graph
    /// is left as it was. Returns the locked graph and the call's results.
    fn append_call(
        &self,
        device: usize,
        gen: Option<*mut i64>,
        f: &Arc<Fragment>,
        callees: &[Arc<Fragment>],
        n_ops: usize,
        bind: impl FnOnce(&mut GraphSources<'_>, &mut Builder) -> Result<Vec<Value>>,
    ) -> Result<(MutexGuard<'_, Graph>, Vec<Value>)> {
        let d = &self.defer;
        let mut g = lock(&d.graphs[device]);
        let Graph {
            b,
            inputs,
            sources,
            params,
            funcs,
            called,
            recs,
            ops,
            capturing,
            ..
        } = &mut *g;
        let capturing = *capturing;
        let cp = b.checkpoint();
        let (start, first) = (b.body_len(), b.num_values());
        let n_inputs = inputs.len();
        let mut src = GraphSources {
            rt: self,
            device,
            inputs,
            sources,
            params,
            lazy: &d.lazy[device],
            gen,
            capturing,
            added: Vec::new(),
            track: d.split_reads && !capturing,
            deps: Vec::new(),
            used_params: Vec::new(),
        };
        let args = match bind(&mut src, b) {
            Ok(a) => a,
            Err(e) => {
                let added = std::mem::take(&mut src.added);
                b.rollback(cp);
                src.inputs.truncate(n_inputs);
                src.sources.truncate(n_inputs);
                for k in &added {
                    src.params.remove(k);
                }
                return Err(e);
            }
        };
        let vals = b.call_with_signature(&f.name, &args, &f.result_types, &f.signature);
        for (name, text) in &f.kernels {
            b.add_func(name, text);
        }
        let mut index = |f: &Arc<Fragment>| {
            *called.entry(Arc::as_ptr(f) as usize).or_insert_with(|| {
                funcs.push(f.clone());
                funcs.len() - 1
            })
        };
        let func = index(f);
        let callees: Vec<usize> = callees.iter().map(&mut index).collect();
        if src.track {
            recs.push(OpRec {
                text: (start, b.body_len()),
                first,
                deps: std::mem::take(&mut src.deps),
                params: std::mem::take(&mut src.used_params),
                func,
                callees,
            });
        }
        *ops += n_ops;
        Ok((g, vals))
    }

    /// Flushes a graph that has grown past the size limit (not while capturing).
    fn flush_if_full(&self, device: usize, g: MutexGuard<'_, Graph>) -> Result<()> {
        let full = g.ops >= self.defer.max_ops && !g.capturing;
        drop(g);
        if full {
            self.flush(device, "size limit")?;
        }
        Ok(())
    }

    /// Records one op into the device's pending graph: a call of the op's function.
    pub(crate) fn record(
        &self,
        op: &str,
        overload: &str,
        device: usize,
        params: &[Param],
        var: Variant,
    ) -> Result<Recorded> {
        let frag = match self.fragment(op, overload, device, params, var)? {
            Frag::Found(f) => f,
            Frag::Outcome(outcome) => return Ok(Recorded::Done(outcome)),
            Frag::Dynamic(st) => return Ok(Recorded::Dynamic(st)),
        };
        crate::exec::admit_outputs(&frag.outputs, device)?;
        let gen = params.iter().find_map(|p| match p.arg {
            RArg::Generator(g) => Some(g),
            _ => None,
        });
        let (mut g, outs) = self.append_call(device, gen, &frag, &[], 1, |src, b| {
            let mut args = Vec::with_capacity(frag.inputs.len());
            for inp in &frag.inputs {
                args.push(match inp {
                    Input::Storage { path, dtype } => {
                        let t = tensor_at(params, *path);
                        let n = t.nbytes / dtype.size() as i64;
                        src.storage(b, *path, t, *dtype, n)?
                    }
                    Input::Host { path, dtype } => {
                        src.host(b, *path, tensor_at(params, *path), *dtype)?
                    }
                    Input::Rng { .. } => src.rng_param(b, frag.rng_consumed)?,
                    Input::Staged { .. }
                    | Input::Size { .. }
                    | Input::Padded { .. }
                    | Input::StorageSize { .. }
                    | Input::ViewInt { .. }
                    | Input::ResultSize { .. } => {
                        unreachable!("fragments are planned at exact shapes")
                    }
                });
            }
            Ok(args)
        })?;
        let mut new = Vec::new();
        {
            let mut lazy = lock(&self.defer.lazy[device]);
            if frag
                .outputs
                .iter()
                .any(|o| matches!(o, Output::Check { .. }))
            {
                g.snapshot(&lazy);
            }
            for (o, v) in frag.outputs.iter().zip(&outs) {
                match o {
                    Output::New { dtype, sizes } => {
                        let numel: i64 = sizes.iter().product();
                        let s = Storage::new(numel * dtype.size() as i64, device);
                        s.mark_lazy();
                        let s = Arc::new(s);
                        let h = Arc::into_raw(s.clone()) as *mut Storage;
                        lazy.insert(h as usize, (*v, *dtype, s));
                        new.push(Ret::Tensor {
                            handle: h,
                            dtype: *dtype,
                            sizes: sizes.clone(),
                            device,
                        });
                    }
                    Output::Write { path, dtype } => {
                        let t = tensor_at(params, *path);
                        if let Loc::Device(p) = t.loc {
                            // SAFETY: alive for the call (the shim holds the tensor).
                            lazy.insert(p as usize, (*v, *dtype, unsafe { Storage::share(p) }));
                            // SAFETY: alive for the call (the shim holds the tensor).
                            unsafe { &*p }.mark_lazy();
                        }
                    }
                    Output::Check { kind, msg } => {
                        g.checks.push((*v, *kind, crate::exec::checked_by(msg, op)))
                    }
                }
            }
        }
        self.metrics.native(op);
        self.flush_if_full(device, g)?;
        Ok(Recorded::Done(Outcome::Done(returns_of(
            &frag.rets, params, var, new,
        ))))
    }

    /// Runs the device's pending graph, if any.
    pub fn flush(&self, device: usize, reason: &str) -> Result<()> {
        self.flush_for(device, reason, None)
    }

    /// A host read needs the lazy storage `key`: runs the pending graph, or only the ops
    /// its value depends on when enough other work is pending (see `split`).
    pub(crate) fn flush_read(&self, device: usize, key: usize) -> Result<()> {
        self.flush_for(device, "read", Some(key))
    }

    fn flush_for(&self, device: usize, reason: &str, target: Option<usize>) -> Result<()> {
        let d = &self.defer;
        let Some(gm) = d.graphs.get(device) else {
            return Ok(());
        };
        let mut g = lock(gm);
        let mut lazy = lock(&d.lazy[device]);
        if g.ops == 0 && lazy.is_empty() {
            return Ok(());
        }
        // Queued Strict jobs may read storages this graph overwrites.
        self.worker.drain();
        let was_capturing = g.capturing;
        let graph = std::mem::replace(&mut *g, Graph::new());
        if was_capturing {
            // Something needed a value mid-capture (a CPU fallback, a host read): the
            // graph runs now and the capture is abandoned (counted as a graph break).
            g.capturing = true;
            g.broken = true;
        }
        // Storages only the graph still refers to are dead: never written out.
        let mut entries: Vec<(usize, Value, DType, Arc<Storage>)> = lazy
            .drain()
            .filter(|(_, e)| Arc::strong_count(&e.2) > 1)
            .map(|(k, (v, t, a))| (k, v, t, a))
            .collect();
        // Output order must not depend on hashing, or the module text (the cache key) would.
        entries.sort_by_key(|e| (e.1, e.0));
        let mut graph = graph;
        let inputs = match take_inputs(self, std::mem::take(&mut graph.inputs)) {
            Ok(i) => i,
            Err(e) => {
                // An input's computation failed on the worker: nothing runs.
                self.worker.reported(&e);
                discard_flushed(&entries, &[], &e);
                return Err(e);
            }
        };
        if let (Some(key), false, true) = (target, was_capturing, d.split_reads) {
            if let Some(in_read) = split::plan(&graph, &entries, key) {
                drop(lazy);
                drop(g);
                return self.flush_split(device, reason, graph, inputs, entries, &in_read);
            }
        }
        let mut outs: Vec<Value> = entries.iter().map(|e| e.1).collect();
        outs.extend(graph.checks.iter().map(|c| c.0));
        // A storage the graph both reads (as a parameter) and rewrites (in-place updates of
        // weights and optimizer state): its old buffer can hold the new value.
        let mut aliases = Vec::new();
        for (j, (key, v, dt, _)) in entries.iter().enumerate() {
            if let Some((p, pdt, _)) = graph.params.get(key) {
                if pdt == dt && graph.b.ty(*p) == graph.b.ty(*v) {
                    if let Some(i) = graph.b.param_index(*p) {
                        aliases.push((*p, j, i));
                    }
                }
            }
        }
        // A graph that may donate buffers and has data checks runs its checks first, alone
        // (XLA keeps only what they depend on: usually the index inputs), so that a failed
        // check leaves the storages it would have donated as they were.
        let prechecks = if graph.checks.is_empty() || aliases.is_empty() {
            None
        } else {
            let couts: Vec<Value> = graph.checks.iter().map(|c| c.0).collect();
            match self.graph_program(device, &graph, &couts, false) {
                Ok(p) => Some(p),
                Err(e) => {
                    // Nothing ran: its values fail, the storages it would rewrite keep theirs.
                    discard_flushed(&entries, &[], &e);
                    return Err(e);
                }
            }
        };
        for (p, j, _) in &aliases {
            graph.b.alias(*p, *j);
        }
        let aliased: Vec<usize> = aliases.iter().map(|a| a.2).collect();
        let aliased_entries: Vec<usize> = aliases.iter().map(|a| a.1).collect();
        if std::env::var_os("TORCH_PJRT_DUMP").is_some() {
            eprintln!(
                "// deferred graph: {} ops ({reason})\n{}",
                graph.ops,
                graph.module(&outs)
            );
        }
        let exe = match self.graph_program(device, &graph, &outs, false) {
            Ok(exe) => exe,
            Err(e) => {
                discard_flushed(&entries, &[], &e);
                return Err(e);
            }
        };
        let traced = crate::trace::queued();
        // Donate an aliased input only if nothing but its storage and this graph holds the
        // buffer (a view's storage, a captured graph or an unfinished op could still read it).
        graph.params = HashMap::new();
        self.forget_finished();
        let keep: Vec<i64> = aliased
            .iter()
            .filter(|i| Arc::strong_count(&inputs[**i]) > 2)
            .map(|i| *i as i64)
            .collect();
        let donated = aliased.len() - keep.len();
        let refs: Vec<&pjrt::Buffer> = inputs.iter().map(|b| b.as_ref()).collect();
        if let (Some(pre), true) = (prechecks, donated > 0) {
            let cbufs: Vec<Arc<pjrt::Buffer>> =
                pre.execute(&refs)?.into_iter().map(Arc::new).collect();
            if let Some((i, e)) = self.first_failed_check(check_kinds(&graph.checks), &cbufs)? {
                // Nothing ran, nothing was donated.
                self.keep_before_failure(device, &mut graph, &refs, &entries, i, &e);
                return Err(e);
            }
        }
        let start = crate::trace::now();
        let bufs = match exe.execute_donating(&refs, &keep) {
            Ok(b) => b,
            Err(e) => {
                // Donated inputs may be gone with the failed run: those storages fail too.
                let e = Error::runtime(format!(
                    "a deferred graph of {} ops failed on the tpu device: {}",
                    graph.ops, e.message
                ));
                discard_flushed(&entries, &aliased_entries, &e);
                return Err(e);
            }
        };
        self.metrics
            .executions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.metrics
            .donated_buffers
            .fetch_add(donated as u64, std::sync::atomic::Ordering::Relaxed);
        self.metrics.flushed(graph.ops, reason);
        let mut bufs: Vec<Arc<pjrt::Buffer>> = bufs.into_iter().map(Arc::new).collect();
        if let Some(q) = traced {
            let name = format!("deferred graph ({} ops, {reason})", graph.ops);
            let stream = crate::worker::Streams::current_index();
            crate::trace::finish(&name, device, stream, q, start, &bufs);
        }
        self.track("deferred graph", &bufs);
        let check_bufs = bufs.split_off(entries.len());
        if let Some((i, e)) = self.first_failed_check(check_kinds(&graph.checks), &check_bufs)? {
            let donated: Vec<usize> = aliased
                .iter()
                .zip(&aliased_entries)
                .filter(|(i, _)| !keep.contains(&(**i as i64)))
                .map(|(_, j)| *j)
                .collect();
            if donated.is_empty() {
                self.keep_before_failure(device, &mut graph, &refs, &entries, i, &e);
            } else {
                discard_flushed(&entries, &donated, &e);
            }
            return Err(e);
        }
        for ((_, _, dtype, storage), buf) in entries.into_iter().zip(bufs) {
            storage.set_flushed(buf, dtype);
        }
        Ok(())
    }

    /// Check `failed` of a flushed graph failed: the op that made it writes nothing, but
    /// the ops recorded before it take effect, as they would have one by one (the last
    /// step's optimizer update, pending when the next step's lookup fails, is kept). Their
    /// values come from the graph's program returning the snapshot taken before that op
    /// (`inputs`: the graph's, not donated); later writes are dropped, later values fail.
    fn keep_before_failure(
        &self,
        device: usize,
        graph: &mut Graph,
        inputs: &[&pjrt::Buffer],
        entries: &[(usize, Value, DType, Arc<Storage>)],
        failed: usize,
        e: &Error,
    ) {
        let before = graph
            .snapshots
            .iter()
            .rev()
            .find(|(first, _)| *first <= failed)
            .map(|(_, s)| s);
        // Pending storages still alive, with their value before the failed op.
        let kept: Vec<(usize, Value, DType)> = match before {
            Some(s) => entries
                .iter()
                .filter_map(|(k, _, _, _)| s.iter().find(|(sk, _, _)| sk == k).copied())
                .collect(),
            None => Vec::new(),
        };
        let outs: Vec<Value> = kept.iter().map(|k| k.1).collect();
        graph.b.clear_aliases();
        let bufs = (!outs.is_empty())
            .then(|| {
                let exe = self.graph_program(device, graph, &outs, false).ok()?;
                exe.execute(inputs).ok()
            })
            .flatten();
        let Some(bufs) = bufs.filter(|b| b.len() == kept.len()) else {
            discard_flushed(entries, &[], e);
            return;
        };
        let mut bufs: Vec<Option<pjrt::Buffer>> = bufs.into_iter().map(Some).collect();
        let mut rest = Vec::new();
        for entry in entries {
            match kept.iter().position(|k| k.0 == entry.0) {
                Some(i) => {
                    let buf = bufs[i].take().expect("one buffer per kept storage");
                    entry.3.set_flushed(Arc::new(buf), kept[i].2);
                }
                None => rest.push(entry.clone()),
            }
        }
        discard_flushed(&rest, &[], e);
    }

    /// The executable of `graph` returning `outs` (its aliases as set now), from the
    /// structure cache or compiled: quick first (see `tiers`) unless `optimized` (a
    /// torch.compile capture keeps its executable: it would never see the swap).
    fn graph_program(
        &self,
        device: usize,
        graph: &Graph,
        outs: &[Value],
        optimized: bool,
    ) -> Result<Arc<pjrt::Executable>> {
        self.program(device, graph.b.finish(outs), graph.ops, optimized, || {
            graph.module(outs)
        })
    }

    /// The executable whose `@main` is `main` (the cache key), compiled from `module()` on
    /// a miss.
    fn program(
        &self,
        device: usize,
        main: String,
        ops: usize,
        optimized: bool,
        module: impl FnOnce() -> String,
    ) -> Result<Arc<pjrt::Executable>> {
        let custom = crate::options::key_part();
        let key = if custom.is_empty() {
            (device, main)
        } else {
            (
                device,
                format!("{}\n{main}", String::from_utf8_lossy(&custom)),
            )
        };
        if let Some(p) = lock(&self.defer.programs).get(&key).cloned() {
            self.metrics
                .cache_hits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Some(q) = p.quick.filter(|q| q.reused()) {
                self.optimize_graph(key, q);
            }
            return Ok(p.exe);
        }
        self.metrics
            .cache_misses
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.metrics
            .graph_programs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mlir = module();
        let custom = crate::options::current();
        let (exe, quick) = self
            .compile_full(
                &mlir,
                device,
                true,
                custom.as_deref(),
                !optimized && crate::tiers::quick_enabled(),
                false,
            )
            .map_err(|e| {
                Error::runtime(format!(
                    "XLA failed to compile a deferred graph of {ops} ops: {}",
                    e.msg
                ))
            })?;
        let exe = Arc::new(exe);
        let quick = quick.then(|| {
            Arc::new(crate::tiers::Quick {
                mlir,
                custom,
                runs: Default::default(),
            })
        });
        let p = GraphProgram {
            exe: exe.clone(),
            quick,
        };
        lock(&self.defer.programs).insert(key, p);
        Ok(exe)
    }

    /// Compiles a hot quick graph's optimized version on the background thread and swaps
    /// it in (later flushes run it; a failure keeps the quick one, which works).
    fn optimize_graph(&self, key: (usize, String), q: Arc<crate::tiers::Quick>) {
        crate::tiers::background(move || {
            let Ok(rt) = crate::get() else { return };
            let device = key.0;
            if let Ok((exe, _)) =
                rt.compile_full(&q.mlir, device, true, q.custom.as_deref(), false, true)
            {
                lock(&rt.defer.programs).insert(
                    key,
                    GraphProgram {
                        exe: Arc::new(exe),
                        quick: None,
                    },
                );
            }
        });
    }

    /// An optimizer step ended. A DeferAndFuse graph that already holds an earlier step (no
    /// value was read since) or is past half its size limit runs now: a loop that reads no
    /// value every step then flushes every two steps, one structure compiled once, instead
    /// of at the size limit, which cuts a step at a different op each time (a new program
    /// each time). A loop reading its loss after each step is unaffected.
    pub fn step_boundary(&self) -> Result<()> {
        self.buckets.step_ended();
        if crate::mode::get() != crate::mode::EagerMode::DeferAndFuse {
            return Ok(());
        }
        for device in 0..self.defer.graphs.len() {
            let run = self.step_ends(&mut lock(&self.defer.graphs[device]));
            if run {
                self.flush(device, "optimizer step")?;
            }
        }
        Ok(())
    }

    /// Counts a step's end in a pending graph; whether the graph should run now.
    fn step_ends(&self, g: &mut Graph) -> bool {
        if g.capturing || g.ops == 0 {
            return false;
        }
        g.steps += 1;
        g.steps >= 2 || g.ops * 2 >= self.defer.max_ops
    }

    /// Flushes every device.
    pub fn flush_all(&self, reason: &str) -> Result<()> {
        for dev in 0..self.defer.graphs.len() {
            self.flush(dev, reason)?;
        }
        Ok(())
    }
}

/// A graph recorded for `torch.compile`, replayable without re-running its Python ops.
pub struct Captured {
    exe: Arc<pjrt::Executable>,
    params: Vec<Param_>,
    /// New contiguous outputs (dtype, sizes), in order.
    pub outputs: Vec<(DType, Vec<i64>)>,
    /// After the outputs: values written back into inputs (input index, dtype).
    input_writes: Vec<(usize, DType)>,
    /// Program parameters whose buffer may be donated to the value written back.
    aliased: Vec<usize>,
    /// The last outputs: data checks, verified at the next synchronization or host read.
    checks: Vec<(ErrorKind, String)>,
    pub device: usize,
    pub mlir: String,
    /// The graph as a private function, for DeferAndFuse to call from its pending graph,
    /// with the ops' functions it calls, its parameters' types and its op count.
    callee: Arc<Fragment>,
    callees: Vec<Arc<Fragment>>,
    param_types: Vec<TensorType>,
    ops: usize,
    /// A replay ends a training step (an update graph: see `Captured::set_ends_step`).
    ends_step: bool,
}

impl Captured {
    /// Marks an inference graph that writes its inputs (a compiled optimizer step, whose
    /// Python step hooks Dynamo traced away) as the end of a training step: in DeferAndFuse
    /// its replay counts as `step_boundary` does.
    pub fn set_ends_step(&mut self, inference: bool) {
        self.ends_step = inference && !self.input_writes.is_empty();
    }
}

/// One call of a captured graph: its input storages, the storages it writes (new outputs,
/// then inputs updated in place, with their dtypes) and the RNG generator.
struct ReplayCall<'a> {
    inputs: &'a [*const Storage],
    written: Vec<(*const Storage, DType)>,
    gen: *mut i64,
}

/// A flushed graph's check failed: every value it computed may rest on a clamped index, so
/// none is kept. Storages it rewrote keep their old value unless their buffer was donated
/// (`donated`: entry indices); the others raise `e` when read.
fn discard_flushed(entries: &[(usize, Value, DType, Arc<Storage>)], donated: &[usize], e: &Error) {
    for (j, (_, _, _, storage)) in entries.iter().enumerate() {
        if storage.is_written() && !donated.contains(&j) {
            storage.clear_lazy();
        } else {
            storage.fail_flushed(e);
        }
    }
}

/// The graph's input buffers. Storages the worker was computing are read now: call after
/// draining it.
fn take_inputs(rt: &Runtime, inputs: Vec<GraphIn>) -> Result<Vec<Arc<pjrt::Buffer>>> {
    inputs
        .into_iter()
        .map(|i| match i {
            GraphIn::Buf(b) => Ok(b),
            GraphIn::Later(s, dt) => match s.poisoned() {
                Some(e) => Err(e),
                None => s.buffer_now(rt, dt),
            },
            GraphIn::Failed(e) => Err(e),
        })
        .collect()
}

/// The storage of a captured graph's input `i`.
fn input_storage(inputs: &[*const Storage], i: usize) -> Result<*const Storage> {
    inputs
        .get(i)
        .copied()
        .ok_or_else(|| Error::runtime("compiled graph: missing input"))
}

enum Param_ {
    Input(usize, DType),
    Const(Arc<pjrt::Buffer>),
    Rng(u64),
}

/// The capture's results for its first call: new output storages.
pub type Handles = Vec<(*mut Storage, DType, Vec<i64>)>;

impl Runtime {
    /// Starts recording a graph for torch.compile on `device` (pending work runs first).
    pub fn capture_begin(&self, device: usize) -> Result<()> {
        self.flush(device, "capture")?;
        let mut g = lock(&self.defer.graphs[device]);
        g.capturing = true;
        g.broken = false;
        Ok(())
    }

    /// Ends a capture without a program: what it recorded runs as an ordinary flush.
    pub fn capture_abort(&self, device: usize) -> Result<()> {
        {
            let mut g = lock(&self.defer.graphs[device]);
            if g.capturing {
                g.broken = true;
            }
        }
        self.capture_end(device, &[], &[], std::ptr::null_mut())
            .map(|_| ())
    }

    /// Ends a capture: `inputs` are the graph's tensor inputs, `outputs` its tensor outputs.
    /// Returns None when the capture broke (the recorded ops then simply run, as a flush).
    pub fn capture_end(
        &self,
        device: usize,
        inputs: &[TensorRef],
        outputs: &[TensorRef],
        gen: *mut i64,
    ) -> Result<Option<(Captured, Handles)>> {
        let d = &self.defer;
        let mut g = lock(&d.graphs[device]);
        if g.broken || !g.capturing {
            g.capturing = false;
            g.broken = false;
            drop(g);
            self.flush(device, "capture abandoned")?;
            return Ok(None);
        }
        g.capturing = false;
        let mut lazy = lock(&d.lazy[device]);
        let mut graph = std::mem::replace(&mut *g, Graph::new());
        let b = &mut graph.b;
        // Outputs, read out of their storages as contiguous values.
        let mut results = Vec::new();
        let mut out_meta = Vec::new();
        for t in outputs {
            let Loc::Device(p) = t.loc else {
                return Err(Error::runtime("compiled graph output on the CPU"));
            };
            let dtype = t
                .dtype
                .ok_or_else(|| Error::runtime("unsupported output dtype"))?;
            let key = p as usize;
            let flat = match lazy
                .get(&key)
                .map(|e| (e.0, e.1))
                .or_else(|| graph.params.get(&key).map(|e| (e.0, e.1)))
            {
                Some((v, dt)) if dt == dtype => v,
                _ => {
                    // An output the graph never touched (an input passed through).
                    // SAFETY: the caller holds the output tensor alive.
                    let buf = unsafe { &*p }.buffer_as(self, dtype)?;
                    let v = b.param(TensorType::new(dtype, &[t.nbytes / dtype.size() as i64]));
                    graph.inputs.push(GraphIn::Buf(buf));
                    graph.sources.push(Src::Storage(key, dtype));
                    v
                }
            };
            let v = crate::layout::read(b, flat, &t.view);
            results.push(b.reshape(v, &[t.view.numel()]));
            out_meta.push((dtype, t.view.sizes.clone()));
        }
        // Inputs the graph wrote (in-place updates), then any other live pending value.
        let mut input_writes = Vec::new();
        let mut aliased = Vec::new();
        let mut rest: Vec<(Value, DType, Arc<Storage>)> = Vec::new();
        let mut entries: Vec<(usize, Pending)> = lazy
            .drain()
            .filter(|(_, e)| Arc::strong_count(&e.2) > 1)
            .collect();
        entries.sort_by_key(|e| (e.1 .0, e.0));
        for (key, (v, dt, storage)) in entries {
            if outputs
                .iter()
                .any(|t| matches!(t.loc, Loc::Device(p) if p as usize == key))
            {
                // Delivered as a new output; the traced tensor itself is discarded.
                storage.clear_lazy();
                continue;
            }
            match inputs
                .iter()
                .position(|t| matches!(t.loc, Loc::Device(p) if p as usize == key))
            {
                Some(i) => {
                    // An input read whole and rewritten (an optimizer's parameters and
                    // state): its buffer can hold the new value, as in a deferred flush.
                    if let Some((p, pdt, _)) = graph.params.get(&key) {
                        if *pdt == dt && graph.b.ty(*p) == graph.b.ty(v) {
                            if let Some(pi) = graph.b.param_index(*p) {
                                graph.b.alias(*p, results.len());
                                aliased.push(pi);
                            }
                        }
                    }
                    results.push(v);
                    input_writes.push((i, dt));
                }
                None => rest.push((v, dt, storage)),
            }
        }
        // Then the data checks, then the other live values (which replays do not produce).
        results.extend(graph.checks.iter().map(|c| c.0));
        for (v, _, _) in &rest {
            results.push(*v);
        }
        let checks: Vec<(ErrorKind, String)> =
            graph.checks.iter().map(|c| (c.1, c.2.clone())).collect();
        let mlir = graph.module(&results);
        let exe = self.graph_program(device, &graph, &results, true)?;
        let param_types: Vec<TensorType> = (0..graph.sources.len())
            .map(|i| graph.b.param_type(i).clone())
            .collect();
        let result_types: Vec<TensorType> =
            results.iter().map(|v| graph.b.ty(*v).clone()).collect();
        let name = hashed_name("graph", graph.b.finish(&results).as_bytes());
        let callee = Arc::new(Fragment {
            kernels: graph.b.funcs().to_vec(),
            text: graph.b.func_text(&name, &results),
            signature: Builder::call_signature(&param_types, &result_types),
            name,
            result_types,
            inputs: Vec::new(),
            outputs: Vec::new(),
            rets: Vec::new(),
            rng_consumed: 0,
        });
        let callees = graph.funcs.clone();
        let n_ops = graph.ops;
        self.worker.drain();
        let graph_inputs = take_inputs(self, std::mem::take(&mut graph.inputs))?;
        let params = graph
            .sources
            .iter()
            .zip(&graph_inputs)
            .map(|(s, buf)| match *s {
                Src::Storage(key, dt) => {
                    match inputs
                        .iter()
                        .position(|t| matches!(t.loc, Loc::Device(p) if p as usize == key))
                    {
                        Some(i) => Param_::Input(i, dt),
                        None => Param_::Const(buf.clone()),
                    }
                }
                Src::Host => Param_::Const(buf.clone()),
                Src::Rng(n) => Param_::Rng(n),
            })
            .collect();
        // First call: run with the buffers bound at capture (none donated: the capture
        // itself still refers to them).
        let refs: Vec<&pjrt::Buffer> = graph_inputs.iter().map(|b| b.as_ref()).collect();
        let keep: Vec<i64> = aliased.iter().map(|i| *i as i64).collect();
        let bufs: Vec<Arc<pjrt::Buffer>> = exe
            .execute_donating(&refs, &keep)?
            .into_iter()
            .map(Arc::new)
            .collect();
        self.metrics
            .executions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.track("compiled graph", &bufs);
        let _ = gen;
        let mut it = bufs.into_iter();
        let mut handles = Vec::new();
        for (dtype, sizes) in &out_meta {
            let buf = it.next().ok_or_else(|| Error::runtime("missing output"))?;
            let s = Storage::with_buffer(buf, *dtype, device);
            handles.push((s.into_handle(), *dtype, sizes.clone()));
        }
        for (i, dt) in &input_writes {
            let buf = it.next().ok_or_else(|| Error::runtime("missing output"))?;
            if let Loc::Device(p) = inputs[*i].loc {
                // SAFETY: the caller holds the input alive; we hold the lazy lock.
                unsafe { &*p }.set_flushed(buf, *dt);
            }
        }
        self.defer_checks(&checks, it.by_ref().take(checks.len()).collect());
        for ((_, dt, storage), buf) in rest.iter().zip(it) {
            storage.set_flushed(buf, *dt);
        }
        Ok(Some((
            Captured {
                exe,
                params,
                outputs: out_meta,
                input_writes,
                aliased,
                checks,
                device,
                mlir,
                callee,
                callees,
                param_types,
                ops: n_ops,
                ends_step: false,
            },
            handles,
        )))
    }

    /// Runs a captured graph on new inputs (same metadata as at capture): returns new outputs
    /// and writes in-place updated inputs.
    /// For each program parameter: the input index it reads, or None (a constant or RNG).
    pub fn captured_inputs(c: &Captured) -> Vec<Option<usize>> {
        c.params
            .iter()
            .map(|p| {
                if let Param_::Input(i, _) = p {
                    Some(*i)
                } else {
                    None
                }
            })
            .collect()
    }

    /// A captured graph is being dropped: its executable leaves the program cache unless
    /// another holder (a captured graph with the same module) still uses it.
    pub fn release_captured(&self, c: &Captured) {
        lock(&self.defer.programs)
            .retain(|_, e| !(Arc::ptr_eq(&e.exe, &c.exe) && Arc::strong_count(&e.exe) == 2));
    }

    /// Runs a captured graph on new inputs (same metadata as at capture), writing `outs`
    /// (storages of the outputs Python allocated) and the rewritten inputs. In Strict mode it
    /// is queued on the worker behind the ops issued before it and returns at once, like an
    /// op; in DeferAndFuse it is recorded into the pending graph as one call (so the forward,
    /// backward and optimizer graphs of a step and the eager ops around them fuse into one
    /// program); in Debug it runs now.
    pub fn replay(
        &self,
        c: &Captured,
        inputs: &[*const Storage],
        outs: &[*const Storage],
        gen: *mut i64,
    ) -> Result<()> {
        if outs.len() != c.outputs.len() {
            return Err(Error::runtime("compiled graph: output count mismatch"));
        }
        // The storages the graph writes: its outputs, then the inputs it updates in place.
        let written = outs
            .iter()
            .zip(c.outputs.iter().map(|o| o.0))
            .map(|(p, dt)| Ok((*p, dt)))
            .chain(
                c.input_writes
                    .iter()
                    .map(|(i, dt)| Ok((input_storage(inputs, *i)?, *dt))),
            )
            .collect::<Result<Vec<_>>>()?;
        let call = ReplayCall {
            inputs,
            written,
            gen,
        };
        match crate::mode::get() {
            crate::mode::EagerMode::Strict => self.replay_queued(c, &call),
            crate::mode::EagerMode::DeferAndFuse => self.replay_deferred(c, call),
            _ => self.replay_now(c, &call),
        }
    }

    fn replay_deferred(&self, c: &Captured, call: ReplayCall<'_>) -> Result<()> {
        let ReplayCall {
            inputs,
            written,
            gen,
        } = call;
        let device = c.device;
        let (mut g, vals) =
            self.append_call(device, Some(gen), &c.callee, &c.callees, c.ops, |src, b| {
                let mut args = Vec::with_capacity(c.params.len());
                for (p, ty) in c.params.iter().zip(&c.param_types) {
                    args.push(match p {
                        Param_::Input(i, dt) => {
                            src.storage_at(b, input_storage(inputs, *i)?, *dt, ty.numel())?
                        }
                        Param_::Const(buf) => src.buffer(b, buf.clone(), ty.clone()),
                        Param_::Rng(n) => src.rng_param(b, *n)?,
                    });
                }
                Ok(args)
            })?;
        {
            // Results: the written storages' values, then the checks.
            let mut lazy = lock(&self.defer.lazy[device]);
            if !c.checks.is_empty() {
                g.snapshot(&lazy);
            }
            let mut vals = vals.into_iter();
            for ((p, dtype), v) in written.into_iter().zip(vals.by_ref()) {
                // SAFETY: the caller holds inputs and outputs alive during the call.
                lazy.insert(p as usize, (v, dtype, unsafe { Storage::share(p) }));
                // SAFETY: as above.
                unsafe { &*p }.mark_lazy();
            }
            for ((kind, msg), v) in c.checks.iter().zip(vals) {
                g.checks.push((v, *kind, msg.clone()));
            }
        }
        if c.ends_step && self.step_ends(&mut g) {
            drop(g);
            return self.flush(device, "optimizer step");
        }
        self.flush_if_full(device, g)
    }

    fn replay_queued(&self, c: &Captured, call: &ReplayCall<'_>) -> Result<()> {
        let mut job_inputs = Vec::with_capacity(c.params.len());
        for p in &c.params {
            job_inputs.push(match p {
                Param_::Input(i, dt) => {
                    // SAFETY: the caller holds the inputs alive.
                    let s = unsafe { Storage::share(input_storage(call.inputs, *i)?) };
                    if s.is_lazy() {
                        self.flush(s.device, "read")?;
                    }
                    crate::worker::JobIn::Storage(s, *dt)
                }
                Param_::Const(b) => crate::worker::JobIn::Buf(b.clone()),
                Param_::Rng(n) => {
                    crate::worker::JobIn::Buf(crate::rng_input(self, Some(call.gen), c.device, *n)?)
                }
            });
        }
        let targets: Vec<(Arc<Storage>, DType)> = call
            .written
            .iter()
            // SAFETY: the caller holds inputs and outputs alive.
            .map(|(p, dt)| (unsafe { Storage::share(*p) }, *dt))
            .collect();
        let work = crate::worker::Work::Graph {
            exe: c.exe.clone(),
            aliased: c.aliased.clone(),
            checks: c.checks.clone(),
            precheck: None,
        };
        let worker = crate::get()?.worker.current();
        worker.submit_graph("compiled graph", work, job_inputs, targets, c.outputs.len())
    }

    fn replay_now(&self, c: &Captured, call: &ReplayCall<'_>) -> Result<()> {
        let mut bufs: Vec<Arc<pjrt::Buffer>> = Vec::with_capacity(c.params.len());
        for p in &c.params {
            bufs.push(match p {
                Param_::Input(i, dt) => {
                    // SAFETY: the caller holds the inputs alive.
                    unsafe { &*input_storage(call.inputs, *i)? }.buffer_as(self, *dt)?
                }
                Param_::Const(b) => b.clone(),
                Param_::Rng(n) => crate::rng_input(self, Some(call.gen), c.device, *n)?,
            });
        }
        let mut keep = Vec::new();
        if !c.aliased.is_empty() {
            // Queued Strict jobs may still read an input this program overwrites.
            self.worker.drain();
            self.forget_finished();
            // Donate only what nothing but the input's storage and `bufs` holds.
            keep = c
                .aliased
                .iter()
                .filter(|i| Arc::strong_count(&bufs[**i]) > 2)
                .map(|i| *i as i64)
                .collect();
        }
        let refs: Vec<&pjrt::Buffer> = bufs.iter().map(|b| b.as_ref()).collect();
        let traced = crate::trace::queued();
        let start = crate::trace::now();
        let results: Vec<Arc<pjrt::Buffer>> = c
            .exe
            .execute_donating(&refs, &keep)?
            .into_iter()
            .map(Arc::new)
            .collect();
        if let Some(q) = traced {
            let stream = crate::worker::Streams::current_index();
            crate::trace::finish("compiled graph", c.device, stream, q, start, &results);
        }
        self.metrics
            .executions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.metrics.donated_buffers.fetch_add(
            (c.aliased.len() - keep.len()) as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        self.track("compiled graph", &results);
        let mut it = results.into_iter();
        for (p, dtype) in &call.written {
            let buf = it.next().ok_or_else(|| Error::runtime("missing output"))?;
            // SAFETY: the caller holds inputs and outputs alive.
            unsafe { &**p }.set(buf, *dtype)?;
        }
        self.defer_checks(&c.checks, it.take(c.checks.len()).collect());
        Ok(())
    }
}
