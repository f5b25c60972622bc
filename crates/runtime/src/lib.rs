//! The tpu runtime: one PJRT client, device storages, op execution through the lowering
//! rules, the compilation cache and the metrics.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

pub use lowering::{is_no_rule, ErrorKind};
pub use stablehlo::DType;

pub mod buckets;
pub mod cache;
pub mod copy;
pub mod datadep;
pub mod defer;
pub mod diskcache;
pub mod exec;
pub mod host;
pub mod kernels;
pub mod layout;
pub mod memory;
pub mod metrics;
pub mod mode;
pub mod options;
pub mod storage;
pub mod stream;
pub mod tiers;
pub mod trace;
pub mod worker;

pub use exec::{dispatch, Outcome, Param, RArg, Ret, TensorRef};
pub use layout::View;
pub use storage::Storage;

/// An error with the Python exception type it should become.
#[derive(Clone, Debug)]
pub struct Error {
    pub kind: ErrorKind,
    pub msg: String,
}

impl Error {
    pub fn runtime(msg: impl Into<String>) -> Error {
        Error {
            kind: ErrorKind::Runtime,
            msg: msg.into(),
        }
    }
    pub fn new(kind: ErrorKind, msg: impl Into<String>) -> Error {
        Error {
            kind,
            msg: msg.into(),
        }
    }
}

impl From<pjrt::Error> for Error {
    fn from(e: pjrt::Error) -> Error {
        Error::runtime(format!("PJRT: {}", e.message))
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Where runtime warnings go: the Python extension installs `warnings.warn` here.
pub static WARN: OnceLock<fn(&str)> = OnceLock::new();

/// The device's default generator state [seed, offset] (set by the PyTorch glue), used by
/// random ops that take no generator argument (e.g. dropout).
pub static DEFAULT_GENERATOR: OnceLock<fn(usize) -> *mut i64> = OnceLock::new();

/// The RNG input of a program: [seed, offset] of `gen` (or the device's default
/// generator), whose offset then advances past the `consumed` values.
pub(crate) fn rng_input(
    rt: &Runtime,
    gen: Option<*mut i64>,
    device: usize,
    consumed: u64,
) -> Result<Arc<pjrt::Buffer>> {
    let g = gen
        .filter(|g| !g.is_null())
        .or_else(|| DEFAULT_GENERATOR.get().map(|f| f(device)))
        .filter(|g| !g.is_null());
    let (seed, offset) = match g {
        // SAFETY: a live generator's [seed, offset] (the shim's generators are never freed).
        Some(g) => unsafe {
            let o = *g.add(1);
            *g.add(1) = o.wrapping_add(consumed as i64);
            (*g, o)
        },
        None => (0, 0),
    };
    let mut bytes = Vec::with_capacity(16);
    bytes.extend_from_slice(&seed.to_le_bytes());
    bytes.extend_from_slice(&offset.to_le_bytes());
    Ok(Arc::new(rt.upload(&bytes, DType::I64, &[2], device)?))
}

/// Emits a warning through `WARN` (stderr before it is set). Never call with a lock held
/// that a thread holding the GIL may wait for.
pub fn warn(msg: &str) {
    match WARN.get() {
        Some(f) => f(msg),
        None => eprintln!("warning: {msg}"),
    }
}

pub fn from_pjrt(e: pjrt::ElementType) -> Option<DType> {
    use pjrt::ElementType as E;
    Some(match e {
        E::Pred => DType::Bool,
        E::U8 => DType::U8,
        E::S8 => DType::I8,
        E::S16 => DType::I16,
        E::S32 => DType::I32,
        E::S64 => DType::I64,
        E::U32 => DType::U32,
        E::U64 => DType::U64,
        E::F16 => DType::F16,
        E::BF16 => DType::BF16,
        E::F32 => DType::F32,
        E::F64 => DType::F64,
        E::C64 => DType::C64,
        E::C128 => DType::C128,
        _ => return None,
    })
}

pub fn dtype_to_pjrt(d: DType) -> pjrt::ElementType {
    use pjrt::ElementType as E;
    match d {
        DType::Bool => E::Pred,
        DType::U8 => E::U8,
        DType::I8 => E::S8,
        DType::I16 => E::S16,
        DType::I32 => E::S32,
        DType::I64 => E::S64,
        DType::U32 => E::U32,
        DType::U64 => E::U64,
        DType::F16 => E::F16,
        DType::BF16 => E::BF16,
        DType::F32 => E::F32,
        DType::F64 => E::F64,
        DType::C64 => E::C64,
        DType::C128 => E::C128,
    }
}

/// The process-wide runtime: the PJRT client and everything that caches work for it.
pub struct Runtime {
    pub client: Arc<pjrt::Client>,
    pub cache: cache::Cache,
    /// The on-disk level under both in-memory caches (`cache`, deferred graphs).
    pub disk: diskcache::DiskCache,
    pub metrics: metrics::Metrics,
    pub defer: defer::Deferred,
    /// Strict mode's executor threads: the default stream and the side streams.
    pub worker: worker::Streams,
    /// Which ops' shapes change, and the real sizes of bucketed calls.
    pub buckets: buckets::Buckets,
    /// Recently uploaded 0-d host inputs (Python scalars), by (device, dtype, bits): buffers
    /// are immutable, so ops passing the same scalar share one upload.
    scalars: Mutex<std::collections::HashMap<(usize, DType, u64), Arc<pjrt::Buffer>>>,
    /// Output buffers (and the op that made them) not yet known to be complete.
    pending: Mutex<Vec<(String, Arc<pjrt::Buffer>)>>,
    /// Compiled graphs' data checks not yet read: (check buffer, error kind, message).
    checks: Mutex<Vec<(Arc<pjrt::Buffer>, ErrorKind, String)>>,
    /// The plugin is the XLA CPU plugin (`tiers::quick_options`).
    cpu_plugin: bool,
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

static INIT_LOCK: Mutex<()> = Mutex::new(());

/// XLA options every compilation sets, on the CPU plugin only (where they are verified; the
/// plugin checks their names at compile time):
/// - no excess precision: fused programs (DeferAndFuse, torch.compile) round every
///   half-precision intermediate as eager PyTorch does, instead of keeping them in f32;
/// - generated code for AVX2 at most, unless `XLA_FLAGS` chooses an ISA: on hosts with
///   AVX512-FP16, LLVM turns a fused float16 `a * b + c` into one float16 FMA (one rounding,
///   not eager's two), so results would depend on the processor. Capped, fused kernels are
///   the same code on every x86-64 host with AVX2 (matrix products run in XLA's prebuilt
///   libraries, not in generated code: no GPT/MLP step got slower, see ARCHITECTURE.md).
fn compile_overrides(cpu_plugin: bool) -> Vec<(&'static str, pjrt::OptionValue)> {
    use pjrt::OptionValue::{Bool, Str};
    if !cpu_plugin {
        return vec![];
    }
    let mut o = vec![("xla_allow_excess_precision", Bool(false))];
    let user_isa = std::env::var("XLA_FLAGS").is_ok_and(|f| f.contains("xla_cpu_max_isa"));
    if cfg!(target_arch = "x86_64") && !user_isa {
        o.push(("xla_cpu_max_isa", Str("AVX2".into())));
    }
    o
}

/// Loads the plugin (see `pjrt::find_plugin`) and creates the client, once.
pub fn init(search_dirs: &[PathBuf]) -> Result<&'static Runtime> {
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    let _g = INIT_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    let path = pjrt::find_plugin(search_dirs).map_err(|e| Error::runtime(e.message))?;
    let plugin = pjrt::Plugin::load(&path).map_err(|e| {
        Error::runtime(format!(
            "loading PJRT plugin {}: {}",
            path.display(),
            e.message
        ))
    })?;
    let user_tuned = [
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_ARENA_MAX",
        "GLIBC_TUNABLES",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some());
    let cpu_plugin = path
        .file_name()
        .is_some_and(|f| f.to_string_lossy().contains("cpu"));
    if cpu_plugin && !user_tuned {
        // Device buffers are host memory here: reuse freed ones (32 MiB: glibc's maximum).
        // Before the client exists, so that the arena cap binds its threads too.
        pjrt::keep_freed_host_memory(32 << 20);
    }
    let client = pjrt::Client::with_overrides(plugin, &compile_overrides(cpu_plugin))?;
    let devices = client.num_devices();
    let rt = Runtime {
        disk: diskcache::DiskCache::new(&client),
        client,
        cache: cache::Cache::default(),
        metrics: metrics::Metrics::default(),
        buckets: buckets::Buckets::default(),
        defer: defer::Deferred::new(devices, cpu_plugin),
        worker: worker::Streams::default(),
        scalars: Mutex::new(std::collections::HashMap::new()),
        pending: Mutex::new(Vec::new()),
        checks: Mutex::new(Vec::new()),
        cpu_plugin,
    };
    mode::store(mode::from_env());
    let _ = RUNTIME.set(rt);
    Ok(RUNTIME.get().expect("runtime just set"))
}

/// The runtime, if `init` succeeded.
pub fn get() -> Result<&'static Runtime> {
    let rt = RUNTIME
        .get()
        .ok_or_else(|| Error::runtime("torch_pjrt is not initialized: import torch_pjrt first"))?;
    if pjrt::in_forked_child() {
        // As CUDA: the parent's client cannot serve a forked child (its threads are gone).
        return Err(Error::runtime(FORKED));
    }
    Ok(rt)
}

const FORKED: &str = "Cannot re-initialize tpu in forked subprocess. To use tpu with \
    multiprocessing, you must use the 'spawn' start method";

/// The number of devices, also in a forked child (read from the client, no plugin call).
pub fn device_count() -> usize {
    RUNTIME.get().map_or(0, Runtime::num_devices)
}

impl Runtime {
    pub fn num_devices(&self) -> usize {
        self.client.num_devices()
    }

    pub fn upload(
        &self,
        bytes: &[u8],
        dtype: DType,
        dims: &[i64],
        device: usize,
    ) -> Result<pjrt::Buffer> {
        self.metrics.add_h2d(bytes.len());
        Ok(self
            .client
            .buffer_from_host(bytes, dtype_to_pjrt(dtype), dims, device)?)
    }

    /// A buffer of `elems` zeros: uploaded from the host when small, computed on the device
    /// when large (no host copy as big as the buffer; the program is cached on disk).
    pub fn zeros(&self, dtype: DType, elems: i64, device: usize) -> Result<pjrt::Buffer> {
        let n = elems * dtype.size() as i64;
        if n < 64 << 20 {
            let mut v = Vec::new();
            storage::host_resize(&mut v, n as usize)?;
            return self.upload(&v, dtype, &[elems], device);
        }
        let mut b = stablehlo::Builder::new();
        let z = b.full(dtype, &[elems], 0.0);
        let exe = self.compile(&b.finish(&[z]), device, false)?;
        let mut out = exe.execute(&[])?;
        out.pop()
            .ok_or_else(|| Error::runtime("the zeros program returned nothing"))
    }

    /// A host tensor's contiguous bytes as a device buffer; scalars come from a small cache.
    pub(crate) fn upload_input(
        &self,
        bytes: &[u8],
        dtype: DType,
        dims: &[i64],
        device: usize,
    ) -> Result<Arc<pjrt::Buffer>> {
        if !dims.is_empty() || bytes.len() > 8 {
            return Ok(Arc::new(self.upload(bytes, dtype, dims, device)?));
        }
        let mut word = [0u8; 8];
        word[..bytes.len()].copy_from_slice(bytes);
        let k = (device, dtype, u64::from_le_bytes(word));
        if let Some(b) = self
            .scalars
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&k)
        {
            return Ok(b.clone());
        }
        let b = Arc::new(self.upload(bytes, dtype, dims, device)?);
        let mut m = self.scalars.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() >= 1024 {
            m.clear();
        }
        m.insert(k, b.clone());
        Ok(b)
    }

    /// A copy of `buf` on another device (counted as device-to-device bytes).
    pub fn copy_to_device(&self, buf: &pjrt::Buffer, device: usize) -> Result<pjrt::Buffer> {
        let b = buf
            .copy_to_device(device)
            .map_err(|e| Error::runtime(format!("device computation failed: {}", e.message)))?;
        self.metrics
            .add_d2d(b.on_device_size_in_bytes().unwrap_or(0));
        Ok(b)
    }

    pub fn download(&self, buf: &pjrt::Buffer) -> Result<Vec<u8>> {
        let mut v = vec![0u8; buf.byte_size()];
        self.download_into(buf, &mut v)?;
        Ok(v)
    }

    /// `download` into `out`, which must hold exactly the buffer's bytes.
    pub fn download_into(&self, buf: &pjrt::Buffer, out: &mut [u8]) -> Result<()> {
        buf.to_host(out)
            .map_err(|e| Error::runtime(format!("device computation failed: {}", e.message)))?;
        self.metrics.add_d2h(out.len());
        Ok(())
    }

    /// The error of the first false check (`bufs` parallel to `checks`); waits for them.
    pub(crate) fn failed_checks<'a>(
        &self,
        checks: impl IntoIterator<Item = (ErrorKind, &'a str)>,
        bufs: &[Arc<pjrt::Buffer>],
    ) -> Result<Option<Error>> {
        Ok(self.first_failed_check(checks, bufs)?.map(|(_, e)| e))
    }

    /// `failed_checks` with the failed check's index (its op's place in a graph).
    pub(crate) fn first_failed_check<'a>(
        &self,
        checks: impl IntoIterator<Item = (ErrorKind, &'a str)>,
        bufs: &[Arc<pjrt::Buffer>],
    ) -> Result<Option<(usize, Error)>> {
        for (i, ((kind, msg), b)) in checks.into_iter().zip(bufs).enumerate() {
            if let Some(e) = self.check_error(b, kind, msg)? {
                return Ok(Some((i, e)));
            }
        }
        Ok(None)
    }

    /// Reads one check's value (see `lowering::Check`): its error, if it failed.
    pub(crate) fn check_error(
        &self,
        buf: &pjrt::Buffer,
        kind: ErrorKind,
        msg: &str,
    ) -> Result<Option<Error>> {
        let v = self.download(buf)?;
        let bad = i64::from_le_bytes(
            v.get(..8)
                .and_then(|s| s.try_into().ok())
                .ok_or_else(|| Error::runtime("malformed index check"))?,
        );
        Ok(lowering::Check::error(kind, msg, bad).map(|(k, m)| Error::new(k, m)))
    }

    /// Keeps a compiled graph's check results to verify at the next synchronization or
    /// host read, so that replays stay asynchronous.
    pub(crate) fn defer_checks(
        &self,
        checks: &[(ErrorKind, String)],
        bufs: Vec<Arc<pjrt::Buffer>>,
    ) {
        if checks.is_empty() {
            return;
        }
        let mut c = self.checks.lock().unwrap_or_else(|e| e.into_inner());
        for ((kind, msg), b) in checks.iter().zip(bufs) {
            c.push((b, *kind, msg.clone()));
        }
    }

    /// Reads the deferred checks; raises the first that failed (each is reported once).
    pub(crate) fn verify_checks(&self) -> Result<()> {
        let pending = std::mem::take(&mut *self.checks.lock().unwrap_or_else(|e| e.into_inner()));
        for (b, kind, msg) in pending {
            if let Some(e) = self.check_error(&b, kind, &msg)? {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Keeps one execution's outputs until it is known to have succeeded. They complete
    /// together (one event per execution), so the first stands for all.
    pub(crate) fn track(&self, op: &str, bufs: &[Arc<pjrt::Buffer>]) {
        let Some(first) = bufs.first() else {
            return;
        };
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        p.push((op.to_string(), first.clone()));
        if p.len() > 256 {
            // Keep the list short: drop what has finished without error.
            p.retain(|(_, b)| !matches!(b.is_ready_nonblocking(), Ok(true)) || b.ready().is_err());
        }
    }

    /// Stops tracking `buf`, which finished without error (a caller about to own it).
    pub(crate) fn untrack(&self, buf: &Arc<pjrt::Buffer>) -> Result<()> {
        buf.ready()?;
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        p.retain(|(_, b)| !Arc::ptr_eq(b, buf));
        Ok(())
    }

    /// Drops tracked buffers that finished without error (they need no check at sync).
    pub(crate) fn forget_finished(&self) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        p.retain(|(_, b)| !matches!(b.is_ready_nonblocking(), Ok(true)) || b.ready().is_err());
    }

    /// At exit: waits for the jobs the workers hold and the executions PJRT still runs, so
    /// no thread is inside the plugin while the process tears it down. Pending deferred
    /// graphs are dropped with the process; failures are not raised (nothing can read them).
    pub fn quiesce(&self) {
        self.worker.drain();
        let bufs = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        for (_, b) in bufs {
            let _ = b.ready();
        }
    }

    /// Runs pending graphs and waits for every op issued so far; raises the first
    /// asynchronous failure, naming its op.
    pub fn synchronize(&self) -> Result<()> {
        self.flush_all("synchronize")?;
        self.worker.synchronize()?;
        self.verify_checks()?;
        let bufs = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        for (op, b) in bufs {
            b.ready().map_err(|e| {
                Error::runtime(format!("{op} failed on the tpu device: {}", e.message))
            })?;
        }
        Ok(())
    }

    /// Compiles a StableHLO module for `device` (every compilation goes through here), or
    /// loads it from the disk cache.
    pub fn compile(&self, mlir: &str, device: usize, deferred: bool) -> Result<pjrt::Executable> {
        self.compile_full(
            mlir,
            device,
            deferred,
            options::current().as_deref(),
            false,
            false,
        )
        .map(|(exe, _)| exe)
    }

    /// Compiles with explicit custom options; `quick`: the optimized program if the disk
    /// cache has it, else a quick one (see `tiers`); `background`: counted apart
    /// (`metrics()["background_compilations"]`), not in the compilations a caller waited for.
    /// Returns the executable and whether it is quick.
    pub(crate) fn compile_full(
        &self,
        mlir: &str,
        device: usize,
        deferred: bool,
        custom: Option<&options::Custom>,
        quick: bool,
        background: bool,
    ) -> Result<(pjrt::Executable, bool)> {
        let mut extra: Vec<(String, pjrt::OptionValue)> =
            custom.map_or(Vec::new(), |c| c.list.clone());
        let base = custom.map_or(Vec::new(), |c| c.key.clone());
        let key = self.disk.key(mlir, device, &base);
        let t0 = std::time::Instant::now();
        // Nobody waits for a background compilation: its disk lookups are not counted.
        let quiet = metrics::Metrics::default();
        let counted = if background { &quiet } else { &self.metrics };
        // A quick or background compile looks for the optimized program without counting a
        // miss.
        if let Some(exe) = key
            .as_ref()
            .filter(|k| !(quick || background) || self.disk.contains(k))
            .and_then(|k| self.disk.load(&self.client, counted, k, device, &extra))
        {
            trace::note(trace::Source::Loaded(t0.elapsed().as_secs_f64()));
            return Ok((exe, false));
        }
        let mut key = key;
        if quick {
            let options = tiers::quick_options(self.cpu_plugin);
            let mut qk = base.clone();
            qk.extend_from_slice(b"quick");
            for (name, _) in &options {
                qk.extend_from_slice(name.as_bytes());
            }
            extra.extend(options.into_iter().map(|(n, v)| (n.to_string(), v)));
            key = self.disk.key(mlir, device, &qk);
            if let Some(exe) = key
                .as_ref()
                .and_then(|k| self.disk.load(&self.client, counted, k, device, &extra))
            {
                trace::note(trace::Source::Loaded(t0.elapsed().as_secs_f64()));
                return Ok((exe, true));
            }
        }
        let t0 = std::time::Instant::now();
        let exe = self
            .client
            .compile_with(mlir, device, &extra)
            .map_err(|e| Error::runtime(e.message))?;
        let secs = t0.elapsed().as_secs_f64();
        trace::note(trace::Source::Compiled(secs));
        if background {
            self.metrics.compiled_background(secs);
        } else if deferred {
            self.metrics.compiled_deferred(secs);
        } else {
            self.metrics.compiled(secs);
        }
        if let Some(k) = key {
            self.disk.store(&k, &exe);
        }
        Ok((exe, quick))
    }

    /// Changes the eager mode; pending deferred work runs first.
    pub fn set_mode(&self, m: mode::EagerMode) -> Result<()> {
        if m != mode::get() {
            self.flush_all("mode change")?;
            self.worker.drain();
            mode::store(m);
        }
        Ok(())
    }
}

/// Names of the ops with a native lowering rule.
pub fn lowered_ops() -> Vec<&'static str> {
    lowering::rules::names()
}

/// Ops whose every overload the glue must route to the runtime (see `rules::claimed`).
pub fn claimed_ops() -> Vec<&'static str> {
    lowering::rules::claimed()
}

/// Whether `op`'s programs may serve a range of sizes (see `rules::serves_sizes`).
pub fn serves_sizes(op: &str) -> bool {
    lowering::rules::serves_sizes(op)
}

/// Whether result `k` of `op` is laid out column-major by PyTorch (the shim copies it so).
pub fn column_major_result(op: &str, k: usize) -> bool {
    lowering::rules::column_major_result(op, k)
}

/// Whether scaled_dot_product_attention runs its fused entry on these operands (dtype,
/// sizes each; see `rules::attention::sdpa_fused_ok`).
pub fn sdpa_fused_ok(
    q: (DType, &[i64]),
    k: (DType, &[i64]),
    v: (DType, &[i64]),
    mask: Option<(DType, &[i64])>,
    dropout: f64,
    enable_gqa: bool,
) -> bool {
    lowering::rules::attention::sdpa_fused_ok(q, k, v, mask, dropout, enable_gqa)
}
