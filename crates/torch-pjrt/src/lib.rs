#![allow(non_snake_case)]
//! `torch_pjrt._C`: the Python extension. It initialises the runtime and the C++ shim and
//! exposes the few calls the Python package needs; ops never pass through Python.

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use pyo3::exceptions::{PyRuntimeError, PyUserWarning};
use pyo3::prelude::*;
use pyo3::types::PyDict;

mod abi;
mod ffi;

extern "C" {
    fn tpu_shim_init() -> *const c_char;
    fn tpu_shim_current_device() -> i32;
    fn tpu_shim_manual_seed(device_index: i32, seed: u64);
    fn tpu_shim_initial_seed(device_index: i32) -> u64;
    fn tpu_shim_generator_state(device_index: i32) -> *mut i64;
    fn tpu_shim_register_boxed(names: *const *const c_char, n: i32) -> *const c_char;
}

/// Routes these ATen overloads ("aten::_foreach_add.List") to the Rust dispatcher instead of
/// their composite kernels.
#[pyfunction]
fn register_boxed(names: Vec<String>) -> PyResult<()> {
    let cs: Vec<CString> = names
        .iter()
        .map(|n| CString::new(n.as_str()).unwrap_or_default())
        .collect();
    let ptrs: Vec<*const c_char> = cs.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: `ptrs` points at NUL-terminated strings alive for the call.
    let msg = unsafe { tpu_shim_register_boxed(ptrs.as_ptr(), ptrs.len() as i32) };
    if msg.is_null() {
        return Ok(());
    }
    // SAFETY: a NUL-terminated message valid until the next call on this thread.
    let s = unsafe { CStr::from_ptr(msg) }
        .to_string_lossy()
        .into_owned();
    Err(PyRuntimeError::new_err(s))
}

mod compiled;

/// Emits a Python UserWarning from any thread.
pub(crate) fn warn(msg: &str) {
    Python::with_gil(|py| {
        let m = CString::new(msg.replace('\0', " ")).unwrap_or_default();
        let cat = py.get_type::<PyUserWarning>();
        if let Err(e) = PyErr::warn(py, &cat, &m, 1) {
            // Warnings turned into errors cannot propagate from inside an op; report it.
            e.print(py);
        }
    });
}

/// The Python exception PyTorch would raise for `e` (an index checked on the device raises
/// IndexError at the synchronization that finds it, as it would on the CPU at the op).
pub(crate) fn py_err(e: runtime::Error) -> PyErr {
    use pyo3::exceptions::{PyIndexError, PyNotImplementedError, PyTypeError, PyValueError};
    match e.kind {
        runtime::ErrorKind::Index => PyIndexError::new_err(e.msg),
        runtime::ErrorKind::Value => PyValueError::new_err(e.msg),
        runtime::ErrorKind::Type => PyTypeError::new_err(e.msg),
        runtime::ErrorKind::NotImplemented => PyNotImplementedError::new_err(e.msg),
        runtime::ErrorKind::Runtime => PyRuntimeError::new_err(e.msg),
        runtime::ErrorKind::OutOfMemory => Python::with_gil(|py| {
            let cls = py
                .import("torch")
                .and_then(|t| t.getattr("OutOfMemoryError"))
                .ok()
                .and_then(|c| c.downcast_into::<pyo3::types::PyType>().ok());
            match cls {
                Some(cls) => PyErr::from_type(cls, e.msg),
                None => PyRuntimeError::new_err(e.msg),
            }
        }),
    }
}

fn rt() -> PyResult<&'static runtime::Runtime> {
    runtime::get().map_err(|e| PyRuntimeError::new_err(e.msg))
}

/// Loads the PJRT plugin, creates the client and registers the device with PyTorch.
#[pyfunction]
fn _init(search_dirs: Vec<String>) -> PyResult<()> {
    let dirs: Vec<PathBuf> = search_dirs.into_iter().map(PathBuf::from).collect();
    let _ = runtime::WARN.set(warn);
    runtime::init(&dirs).map_err(|e| PyRuntimeError::new_err(e.msg))?;
    let _ = runtime::DEFAULT_GENERATOR.set(|d| {
        // SAFETY: returns the device's (never freed) default generator state, or NULL.
        unsafe { tpu_shim_generator_state(d as i32) }
    });
    // SAFETY: tpu_shim_init is idempotent and returns NULL or a static message.
    let msg = unsafe { tpu_shim_init() };
    if !msg.is_null() {
        // SAFETY: a NUL-terminated static string.
        let s = unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned();
        return Err(PyRuntimeError::new_err(format!(
            "registering the tpu device with PyTorch failed: {s}"
        )));
    }
    Ok(())
}

/// Limits `device`'s tensors to `fraction` of its memory (torch.OutOfMemoryError past it).
/// Registers a custom kernel's StableHLO module (generic form); returns its id.
#[pyfunction]
fn register_kernel(name: &str, module: &str) -> PyResult<String> {
    rt()?.register_kernel(name, module).map_err(py_err)
}

/// A PJRT plugin attribute as text (None when the plugin does not report it).
#[pyfunction]
fn plugin_attribute(name: &str) -> PyResult<Option<String>> {
    rt()?.plugin_attribute(name).map_err(py_err)
}

#[pyfunction]
fn set_memory_fraction(device: usize, fraction: f64) -> PyResult<()> {
    runtime::memory::set_fraction(device, fraction).map_err(py_err)
}

/// Milliseconds between two recorded tpu events, by their `torch.Event.event_id` (the
/// runtime's event handles; `torch.Event.elapsed_time` refuses subclasses as `other`).
#[pyfunction]
fn event_elapsed(start: usize, end: usize) -> PyResult<f64> {
    let (a, b) = (
        start as *const runtime::stream::Event,
        end as *const runtime::stream::Event,
    );
    // SAFETY: the ids are live handles of tpu events that the calling Python objects own
    // for the duration of the call (NULL when never recorded).
    let (a, b) = unsafe { (a.as_ref(), b.as_ref()) };
    match (a, b) {
        (Some(a), Some(b)) => a.elapsed_ms(b).map_err(py_err),
        _ => Err(PyRuntimeError::new_err(
            "Both events must be recorded before calculating elapsed time.",
        )),
    }
}

/// Sets the XLA options of the next compilations (torch.tpu.compiler.custom_compiler_options):
/// (name, bool | int | float | str) pairs; returns the previous ones.
#[pyfunction]
fn set_compiler_options(
    py: Python<'_>,
    options: Vec<(String, PyObject)>,
) -> PyResult<Vec<(String, PyObject)>> {
    use pjrt::OptionValue;
    use pyo3::types::{PyBool, PyFloat, PyInt, PyString};
    let mut list = Vec::with_capacity(options.len());
    for (name, v) in options {
        let v = v.bind(py);
        let value = if v.is_instance_of::<PyBool>() {
            OptionValue::Bool(v.extract()?)
        } else if v.is_instance_of::<PyInt>() {
            OptionValue::Int(v.extract()?)
        } else if v.is_instance_of::<PyFloat>() {
            OptionValue::Float(v.extract()?)
        } else if v.is_instance_of::<PyString>() {
            OptionValue::Str(v.extract()?)
        } else {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "compiler option {name}: expected a bool, int, float or str, got {}",
                v.get_type().name()?
            )));
        };
        list.push((name, value));
    }
    options_to_py(py, runtime::options::set(list))
}

/// The active compiler options, as (name, value) pairs.
#[pyfunction]
fn compiler_options(py: Python<'_>) -> PyResult<Vec<(String, PyObject)>> {
    let list = runtime::options::current().map_or_else(Vec::new, |c| c.list.clone());
    options_to_py(py, list)
}

fn options_to_py(
    py: Python<'_>,
    list: Vec<(String, pjrt::OptionValue)>,
) -> PyResult<Vec<(String, PyObject)>> {
    use pjrt::OptionValue;
    use pyo3::IntoPyObjectExt;
    let mut out = Vec::with_capacity(list.len());
    for (n, v) in list {
        let obj = match v {
            OptionValue::Bool(b) => b.into_py_any(py)?,
            OptionValue::Int(i) => i.into_py_any(py)?,
            OptionValue::Float(f) => f.into_py_any(py)?,
            OptionValue::Str(s) => s.into_py_any(py)?,
        };
        out.push((n, obj));
    }
    Ok(out)
}

/// Starts the device trace (torch.tpu.profiler).
#[pyfunction]
fn trace_start() {
    runtime::trace::start();
}

/// Stops the device trace: (name, device, stream, queued, start, end, source, source
/// seconds) per program run, times in ns since `trace_epoch_wall_ns()`.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn trace_stop() -> Vec<(String, usize, usize, u64, u64, u64, &'static str, f64)> {
    runtime::trace::stop()
        .into_iter()
        .map(|r| {
            let (kind, secs) = r.source.describe();
            (
                r.name, r.device, r.stream, r.queued, r.start, r.end, kind, secs,
            )
        })
        .collect()
}

/// Wall-clock nanoseconds since 1970 of the device trace's time zero.
#[pyfunction]
fn trace_epoch_wall_ns() -> u64 {
    runtime::trace::epoch_wall_ns()
}

#[pyfunction]
fn device_count() -> usize {
    runtime::device_count()
}

/// Whether this is a child forked after the device was set up (it cannot use the device).
#[pyfunction]
fn in_bad_fork() -> bool {
    pjrt::in_forked_child()
}

#[pyfunction]
fn platform_name() -> PyResult<String> {
    Ok(rt()?.client.platform_name())
}

#[pyfunction]
fn device_kind(index: usize) -> PyResult<String> {
    Ok(rt()?.client.device_kind(index))
}

#[pyfunction]
fn plugin_path() -> PyResult<String> {
    Ok(rt()?.client.plugin().path().display().to_string())
}

#[pyfunction]
fn current_device() -> i32 {
    // SAFETY: plain read of a thread-local in the shim.
    unsafe { tpu_shim_current_device() }
}

#[pyfunction]
fn synchronize(py: Python<'_>) -> PyResult<()> {
    let rt = rt()?;
    py.allow_threads(|| rt.synchronize()).map_err(py_err)
}

#[pyfunction]
fn step_boundary(py: Python<'_>) -> PyResult<()> {
    let rt = rt()?;
    py.allow_threads(|| rt.step_boundary()).map_err(py_err)
}

#[pyfunction]
fn manual_seed(device: i32, seed: u64) {
    // SAFETY: the shim creates the device's generator lazily; any index < device_count.
    unsafe { tpu_shim_manual_seed(device, seed) }
}

#[pyfunction]
fn initial_seed(device: i32) -> u64 {
    // SAFETY: as above.
    unsafe { tpu_shim_initial_seed(device) }
}

/// The default generator's [seed, offset] of a device (get_rng_state).
#[pyfunction]
fn rng_state(device: i32) -> PyResult<(i64, i64)> {
    // SAFETY: the shim returns the live state of the device's default generator (never
    // freed), or null for an index out of range.
    let p = unsafe { tpu_shim_generator_state(device) };
    if p.is_null() {
        return Err(PyRuntimeError::new_err(format!(
            "invalid tpu device {device}"
        )));
    }
    // SAFETY: `p` points at two i64 (see above).
    Ok(unsafe { (*p, *p.add(1)) })
}

/// Restores a device's default generator (set_rng_state).
#[pyfunction]
fn set_rng_state(device: i32, seed: i64, offset: i64) -> PyResult<()> {
    // SAFETY: as in `rng_state`.
    let p = unsafe { tpu_shim_generator_state(device) };
    if p.is_null() {
        return Err(PyRuntimeError::new_err(format!(
            "invalid tpu device {device}"
        )));
    }
    // SAFETY: `p` points at two i64; ops read them on the Python thread only.
    unsafe {
        *p = seed;
        *p.add(1) = offset;
    }
    Ok(())
}

#[pyfunction]
fn set_fallback_enabled(on: bool) {
    ffi::FALLBACK_ENABLED.store(on, Ordering::Relaxed);
}

#[pyfunction]
fn fallback_enabled() -> bool {
    ffi::FALLBACK_ENABLED.load(Ordering::Relaxed)
}

/// Counters as a dict: scalar counters plus `ops: {name: (native, fallback)}`.
#[pyfunction]
fn metrics(py: Python<'_>) -> PyResult<PyObject> {
    let snap = rt()?.metrics.snapshot();
    let d = PyDict::new(py);
    for (k, v) in snap.counters {
        if k.ends_with("seconds") {
            d.set_item(k, v)?;
        } else {
            d.set_item(k, v as u64)?;
        }
    }
    let ops = PyDict::new(py);
    for (name, c) in snap.ops {
        ops.set_item(name, (c.native, c.fallback))?;
    }
    d.set_item("ops", ops)?;
    let programs = PyDict::new(py);
    for (name, c) in snap.programs {
        programs.set_item(name, (c.programs, c.bucketed, c.bucket_hits))?;
    }
    d.set_item("programs", programs)?;
    let reasons = PyDict::new(py);
    for (k, v) in snap.flush_reasons {
        reasons.set_item(k, v)?;
    }
    d.set_item("flush_reasons", reasons)?;
    d.set_item("cached_programs", rt()?.cache.len())?;
    d.set_item("evicted_programs", rt()?.cache.evicted())?;
    Ok(d.into_any().unbind())
}

/// Programs that serve a range of sizes (see the runtime's `buckets`): on or off.
#[pyfunction]
fn set_shape_buckets(on: bool) {
    runtime::buckets::set_enabled(on);
}

/// Waits for the background compilations (optimized versions of hot programs).
#[pyfunction]
fn wait_background(py: Python<'_>) {
    py.allow_threads(runtime::tiers::wait_idle);
}

/// At exit: drops queued background compilations, waits for the one in flight and for the
/// work the device still runs (a thread inside the plugin while the process tears it down
/// aborts it).
#[pyfunction]
fn shutdown_background(py: Python<'_>) {
    py.allow_threads(|| {
        runtime::tiers::shutdown();
        if let Ok(rt) = runtime::get() {
            rt.quiesce();
        }
    });
}

#[pyfunction]
fn shape_buckets() -> bool {
    runtime::buckets::enabled()
}

/// Forgets the sizes each op was called with (which dims change): the tests start a
/// sequence of sizes from a known state.
#[pyfunction]
fn forget_shape_history() -> PyResult<()> {
    rt()?.buckets.forget();
    Ok(())
}

#[pyfunction]
fn reset_metrics() -> PyResult<()> {
    rt()?.metrics.reset();
    Ok(())
}

/// The compilation caches: directory, entries and bytes on disk, hits, misses and times.
#[pyfunction]
fn cache_info(py: Python<'_>) -> PyResult<PyObject> {
    let rt = rt()?;
    let info = py.allow_threads(|| rt.disk.info());
    let c: std::collections::HashMap<_, _> = rt.metrics.snapshot().counters.into_iter().collect();
    let n = |k: &str| c.get(k).copied().unwrap_or(0.0) as u64;
    let d = PyDict::new(py);
    d.set_item("directory", info.dir.map(|p| p.display().to_string()))?;
    d.set_item("entries", info.entries)?;
    d.set_item("bytes", info.bytes)?;
    d.set_item("max_bytes", info.max_bytes)?;
    d.set_item("writable", info.writable)?;
    d.set_item("memory_programs", rt.cache.len())?;
    d.set_item("memory_hits", n("cache_hits"))?;
    d.set_item("memory_misses", n("cache_misses"))?;
    d.set_item("disk_hits", n("disk_hits"))?;
    d.set_item("disk_misses", n("disk_misses"))?;
    d.set_item("corrupt_entries", info.corrupt_entries)?;
    d.set_item("compilations", n("compilations"))?;
    d.set_item(
        "compile_seconds",
        c.get("compile_seconds").copied().unwrap_or(0.0),
    )?;
    d.set_item(
        "load_seconds",
        c.get("load_seconds").copied().unwrap_or(0.0),
    )?;
    Ok(d.into_any().unbind())
}

/// Empties the in-memory caches and, with `disk`, deletes the directory's entries.
#[pyfunction]
fn clear_cache(py: Python<'_>, disk: bool) -> PyResult<usize> {
    let rt = rt()?;
    rt.cache.clear();
    rt.defer.clear_programs();
    Ok(if disk {
        py.allow_threads(|| rt.disk.clear())
    } else {
        0
    })
}

/// Switches the disk cache to `path` (None or "": off).
#[pyfunction]
#[pyo3(signature = (path))]
fn set_cache_dir(path: Option<String>) -> PyResult<()> {
    rt()?
        .disk
        .set_dir(path.filter(|p| !p.is_empty()).map(PathBuf::from));
    Ok(())
}

/// The eager mode: 0 Strict, 1 Debug, 2 DeferAndFuse.
#[pyfunction]
fn eager_mode() -> u8 {
    runtime::mode::get() as u8
}

/// Sets the eager mode (pending deferred work runs first).
#[pyfunction]
fn set_eager_mode(py: Python<'_>, mode: u8) -> PyResult<()> {
    let m = runtime::mode::EagerMode::from_u8(mode).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err(format!("unknown eager mode {mode}"))
    })?;
    let rt = rt()?;
    py.allow_threads(|| rt.set_mode(m)).map_err(py_err)
}

/// Names of the ops with a native lowering rule.
#[pyfunction]
fn lowered_ops() -> Vec<&'static str> {
    lowering_names()
}

/// Ops whose overloads must be routed to Rust over their composite kernels.
#[pyfunction]
fn claimed_ops() -> Vec<&'static str> {
    runtime::claimed_ops()
}

/// Whether `op`'s programs may serve a range of sizes (shape buckets): tests pick the
/// OpInfos to run at other sizes of a bucket.
#[pyfunction]
fn serves_sizes(op: &str) -> bool {
    runtime::serves_sizes(op)
}

fn lowering_names() -> Vec<&'static str> {
    runtime::lowered_ops()
}

#[pymodule]
fn _C(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_init, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(set_memory_fraction, m)?)?;
    m.add_function(wrap_pyfunction!(register_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(plugin_attribute, m)?)?;
    m.add_function(wrap_pyfunction!(event_elapsed, m)?)?;
    m.add_function(wrap_pyfunction!(trace_start, m)?)?;
    m.add_function(wrap_pyfunction!(set_compiler_options, m)?)?;
    m.add_function(wrap_pyfunction!(compiler_options, m)?)?;
    m.add_function(wrap_pyfunction!(trace_stop, m)?)?;
    m.add_function(wrap_pyfunction!(trace_epoch_wall_ns, m)?)?;
    m.add_function(wrap_pyfunction!(in_bad_fork, m)?)?;
    m.add_function(wrap_pyfunction!(platform_name, m)?)?;
    m.add_function(wrap_pyfunction!(device_kind, m)?)?;
    m.add_function(wrap_pyfunction!(plugin_path, m)?)?;
    m.add_function(wrap_pyfunction!(current_device, m)?)?;
    m.add_function(wrap_pyfunction!(synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(step_boundary, m)?)?;
    m.add_function(wrap_pyfunction!(manual_seed, m)?)?;
    m.add_function(wrap_pyfunction!(initial_seed, m)?)?;
    m.add_function(wrap_pyfunction!(rng_state, m)?)?;
    m.add_function(wrap_pyfunction!(set_rng_state, m)?)?;
    m.add_function(wrap_pyfunction!(set_fallback_enabled, m)?)?;
    m.add_function(wrap_pyfunction!(fallback_enabled, m)?)?;
    m.add_function(wrap_pyfunction!(metrics, m)?)?;
    m.add_function(wrap_pyfunction!(reset_metrics, m)?)?;
    m.add_function(wrap_pyfunction!(set_shape_buckets, m)?)?;
    m.add_function(wrap_pyfunction!(shape_buckets, m)?)?;
    m.add_function(wrap_pyfunction!(forget_shape_history, m)?)?;
    m.add_function(wrap_pyfunction!(wait_background, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown_background, m)?)?;
    m.add_function(wrap_pyfunction!(lowered_ops, m)?)?;
    m.add_function(wrap_pyfunction!(serves_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(eager_mode, m)?)?;
    m.add_function(wrap_pyfunction!(cache_info, m)?)?;
    m.add_function(wrap_pyfunction!(clear_cache, m)?)?;
    m.add_function(wrap_pyfunction!(set_cache_dir, m)?)?;
    compiled::register(m)?;
    m.add_function(wrap_pyfunction!(register_boxed, m)?)?;
    m.add_function(wrap_pyfunction!(claimed_ops, m)?)?;
    m.add_function(wrap_pyfunction!(set_eager_mode, m)?)?;
    Ok(())
}
