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

use crate::exec::{lower_into, returns_of, tensor_at, Loc, LowerOutcome, Outcome, Param, Path, RArg, Ret, Sources, TensorRef, Variant};
use crate::storage::Storage;
use crate::{host, Error, Result, Runtime};

struct Graph {
    b: Builder,
    inputs: Vec<Arc<pjrt::Buffer>>,
    /// Storages read from their materialized buffer: their parameter.
    params: HashMap<usize, (Value, DType)>,
    ops: usize,
}

impl Graph {
    fn new() -> Graph {
        Graph { b: Builder::new(), inputs: Vec::new(), params: HashMap::new(), ops: 0 }
    }
}

/// Per-device pending graphs and their lazy storages.
pub struct Deferred {
    graphs: Vec<Mutex<Graph>>,
    /// Lazy storage -> its current flat value. Locked after its graph, never before.
    lazy: Vec<Mutex<HashMap<usize, (Value, DType)>>>,
    /// Compiled graphs by module text.
    programs: Mutex<HashMap<String, Arc<pjrt::Executable>>>,
    max_ops: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Deferred {
    pub fn new(devices: usize) -> Deferred {
        let max_ops = std::env::var("TORCH_TPU_DEFER_MAX_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(4000);
        Deferred {
            graphs: (0..devices.max(1)).map(|_| Mutex::new(Graph::new())).collect(),
            lazy: (0..devices.max(1)).map(|_| Mutex::new(HashMap::new())).collect(),
            programs: Mutex::new(HashMap::new()),
            max_ops,
        }
    }

    /// A lazy storage is being freed: drop it from the outputs.
    pub(crate) fn forget(&self, device: usize, s: *const Storage) {
        if let Some(m) = self.lazy.get(device) {
            lock(m).remove(&(s as usize));
        }
    }

    pub fn pending_ops(&self, device: usize) -> usize {
        self.graphs.get(device).map(|g| lock(g).ops).unwrap_or(0)
    }

    pub fn clear_programs(&self) {
        lock(&self.programs).clear();
    }
}

struct GraphSources<'a> {
    rt: &'a Runtime,
    device: usize,
    inputs: &'a mut Vec<Arc<pjrt::Buffer>>,
    params: &'a mut HashMap<usize, (Value, DType)>,
    lazy: &'a Mutex<HashMap<usize, (Value, DType)>>,
    gen: Option<*mut i64>,
}

impl Sources for GraphSources<'_> {
    fn storage(&mut self, b: &mut Builder, _path: Path, t: &TensorRef, dtype: DType, n: i64) -> Result<Value> {
        let Loc::Device(p) = t.loc else { return Err(Error::runtime("host tensor as storage")) };
        let key = p as usize;
        let pending = lock(self.lazy).get(&key).copied();
        if let Some((v, d)) = pending {
            if d == dtype {
                return Ok(v);
            }
            if d.size() == dtype.size() {
                return Ok(b.bitcast_convert(v, dtype));
            }
            return Err(Error::runtime(
                "DeferAndFuse cannot reinterpret a pending tensor with another element size; call torch.tpu.synchronize() first",
            ));
        }
        if let Some((v, d)) = self.params.get(&key) {
            if *d == dtype {
                return Ok(*v);
            }
        }
        // SAFETY: the shim keeps the storage alive during the call.
        let storage = unsafe { &*p };
        let buf = storage.buffer_as(self.rt, dtype)?;
        let v = b.param(TensorType::new(dtype, &[n]));
        self.inputs.push(buf);
        self.params.insert(key, (v, dtype));
        Ok(v)
    }

    fn host(&mut self, b: &mut Builder, _path: Path, t: &TensorRef, dtype: DType) -> Result<Value> {
        let Loc::Host(p) = t.loc else { return Err(Error::runtime("device tensor as host input")) };
        // SAFETY: PyTorch keeps the CPU tensor alive during the call; the view is inside it.
        let bytes = unsafe { host::read(p, &t.view, dtype.size()) };
        self.inputs.push(Arc::new(self.rt.upload(&bytes, dtype, &t.view.sizes, self.device)?));
        Ok(b.param(TensorType::new(dtype, &t.view.sizes)))
    }

    fn rng(&mut self, _gen: Option<Path>, consumed: u64) -> Result<()> {
        let (seed, offset) = match self.gen {
            // SAFETY: the shim passes the generator's live [seed, offset] and holds its lock.
            Some(g) if !g.is_null() => unsafe {
                let s = *g;
                let o = *g.add(1);
                *g.add(1) = o.wrapping_add(consumed as i64);
                (s, o)
            },
            _ => (0, 0),
        };
        let mut bytes = Vec::with_capacity(16);
        bytes.extend_from_slice(&seed.to_le_bytes());
        bytes.extend_from_slice(&offset.to_le_bytes());
        self.inputs.push(Arc::new(self.rt.upload(&bytes, DType::I64, &[2], self.device)?));
        Ok(())
    }
}

impl Runtime {
    /// Records one op into the device's pending graph.
    pub(crate) fn record(&self, op: &str, overload: &str, device: usize, params: &[Param], var: Variant) -> Result<Outcome> {
        let d = &self.defer;
        let mut g = lock(&d.graphs[device]);
        let gen = params.iter().find_map(|p| match p.arg {
            RArg::Generator(g) => Some(g),
            _ => None,
        });
        let Graph { b, inputs, params: pmap, ops } = &mut *g;
        let mut src = GraphSources { rt: self, device, inputs, params: pmap, lazy: &d.lazy[device], gen };
        let low = match lower_into(b, &mut src, op, overload, device, params, var)? {
            LowerOutcome::Done(l) => l,
            LowerOutcome::Declined(w) => return Ok(Outcome::Declined(w)),
            LowerOutcome::Resize(r) => return Ok(Outcome::Resize(r)),
        };
        *ops += 1;
        let mut new = Vec::new();
        {
            let mut lazy = lock(&d.lazy[device]);
            for v in &low.new {
                let ty = b.ty(*v).clone();
                let flat = b.reshape(*v, &[ty.numel()]);
                let s = Box::new(Storage::new(ty.numel() * ty.dtype.size() as i64, device));
                s.mark_lazy();
                let h = Box::into_raw(s);
                lazy.insert(h as usize, (flat, ty.dtype));
                new.push(Ret::Tensor { handle: h, dtype: ty.dtype, sizes: ty.shape, device });
            }
            for (path, dtype, v) in &low.writes {
                let t = tensor_at(params, *path);
                if let Loc::Device(p) = t.loc {
                    lazy.insert(p as usize, (*v, *dtype));
                    // SAFETY: alive for the call (the shim holds the tensor).
                    unsafe { &*p }.mark_lazy();
                }
            }
        }
        let full = *ops >= d.max_ops;
        drop(g);
        self.metrics.native(op);
        if full {
            self.flush(device, "size limit")?;
        }
        Ok(Outcome::Done(returns_of(&low.rets, params, var, new)))
    }

    /// Runs the device's pending graph, if any.
    pub fn flush(&self, device: usize, reason: &str) -> Result<()> {
        let d = &self.defer;
        let Some(gm) = d.graphs.get(device) else { return Ok(()) };
        let mut g = lock(gm);
        let mut lazy = lock(&d.lazy[device]);
        if g.ops == 0 && lazy.is_empty() {
            return Ok(());
        }
        let graph = std::mem::replace(&mut *g, Graph::new());
        let mut entries: Vec<(usize, Value, DType)> = lazy.drain().map(|(k, (v, t))| (k, v, t)).collect();
        // Output order must not depend on hashing, or the module text (the cache key) would.
        entries.sort_by_key(|e| (e.1, e.0));
        let outs: Vec<Value> = entries.iter().map(|e| e.1).collect();
        let mlir = graph.b.finish(&outs);
        if std::env::var_os("TORCH_PJRT_DUMP").is_some() {
            eprintln!("// deferred graph: {} ops ({reason})\n{mlir}", graph.ops);
        }
        let cached = lock(&d.programs).get(&mlir).cloned();
        let exe = match cached {
            Some(e) => {
                self.metrics.cache_hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                e
            }
            None => {
                self.metrics.cache_misses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let exe = Arc::new(self.compile(&mlir, device, true).map_err(|e| {
                    Error::runtime(format!("XLA failed to compile a deferred graph of {} ops: {}", graph.ops, e.msg))
                })?);
                lock(&d.programs).insert(mlir, exe.clone());
                exe
            }
        };
        let refs: Vec<&pjrt::Buffer> = graph.inputs.iter().map(|b| b.as_ref()).collect();
        let bufs = exe.execute(&refs)?;
        self.metrics.executions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.metrics.flushed(graph.ops, reason);
        let bufs: Vec<Arc<pjrt::Buffer>> = bufs.into_iter().map(Arc::new).collect();
        self.track("deferred graph", &bufs);
        for ((ptr, _, dtype), buf) in entries.into_iter().zip(bufs) {
            // SAFETY: entries are removed from `lazy` when their storage is dropped, and we
            // hold that lock, so every remaining pointer is alive.
            unsafe { &*(ptr as *const Storage) }.set_flushed(buf, dtype);
        }
        Ok(())
    }

    /// Flushes every device.
    pub fn flush_all(&self, reason: &str) -> Result<()> {
        for dev in 0..self.defer.graphs.len() {
            self.flush(dev, reason)?;
        }
        Ok(())
    }
}
