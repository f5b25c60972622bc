//! torch.compile support: capture a graph's ops once (through the DeferAndFuse recorder and
//! the same lowering rules), then replay the compiled program on new inputs.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use runtime::defer::{Captured, Handles};
use runtime::exec::Loc;
use runtime::{Storage, TensorRef, View};

use crate::abi::{dtype_from_c10, dtype_to_c10, TpuError, TpuRet, MAX_DIMS};
use crate::ffi::{fill_tensor_ret, guarded, DECLINED, NEED_RESIZE, OK};

/// A tensor as Python describes it: (storage handle, c10 dtype, sizes, strides, offset, nbytes).
type Meta = (usize, i32, Vec<i64>, Vec<i64>, i64, i64);

/// An output's (c10 dtype, sizes).
type OutMeta = (i32, Vec<i64>);

struct Entry {
    captured: Captured,
    first: Mutex<Option<SendHandles>>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        // First results nobody took, then the executable's place in the program cache;
        // the constants and the executable itself go with `captured`.
        let first = self.first.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(SendHandles(handles)) = first.take() {
            for (h, _, _) in handles {
                // SAFETY: fresh boxes nobody else owns.
                drop(unsafe { Storage::from_handle(h) });
            }
        }
        if let Ok(rt) = runtime::get() {
            rt.release_captured(&self.captured);
        }
    }
}

/// Live compiled graphs by id; ids are never reused.
static PROGRAMS: Mutex<BTreeMap<usize, Arc<Entry>>> = Mutex::new(BTreeMap::new());
static NEXT_ID: AtomicUsize = AtomicUsize::new(0);

fn programs() -> std::sync::MutexGuard<'static, BTreeMap<usize, Arc<Entry>>> {
    PROGRAMS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Per graph (compile.py's `_Graph.gid`): program ids by the input layout key the shim
/// computes, for `torch_pjrt::replay`. Entries go with their program (`release`).
type BoundKeys = HashMap<i64, HashMap<Vec<i64>, usize>>;
static BOUND: Mutex<Option<BoundKeys>> = Mutex::new(None);

fn bound() -> std::sync::MutexGuard<'static, Option<BoundKeys>> {
    BOUND.lock().unwrap_or_else(|e| e.into_inner())
}

fn err(e: runtime::Error) -> PyErr {
    crate::py_err(e)
}

fn rt() -> PyResult<&'static runtime::Runtime> {
    runtime::get().map_err(err)
}

fn tensor(m: &Meta, device: usize) -> TensorRef {
    TensorRef {
        loc: Loc::Device(m.0 as *const Storage),
        dtype: dtype_from_c10(m.1),
        view: View {
            sizes: m.2.clone(),
            strides: m.3.clone(),
            offset: m.4,
        },
        nbytes: m.5,
        wrapped: false,
        device,
    }
}

fn entry(id: usize) -> PyResult<Arc<Entry>> {
    programs()
        .get(&id)
        .cloned()
        .ok_or_else(|| PyRuntimeError::new_err(format!("no compiled graph {id}")))
}

fn gen_state(device: usize) -> *mut i64 {
    // SAFETY: returns the default generator's state array (or NULL).
    unsafe { crate::tpu_shim_generator_state(device as i32) }
}

/// Moves each new output buffer into the storage of a tensor Python allocated for it.
fn deliver(handles: Handles, outs: &[usize]) -> PyResult<()> {
    if handles.len() != outs.len() {
        for (h, _, _) in handles {
            // SAFETY: fresh boxes nobody else owns.
            drop(unsafe { Storage::from_handle(h) });
        }
        return Err(PyRuntimeError::new_err(
            "compiled graph: output count mismatch",
        ));
    }
    for ((h, dtype, _), out) in handles.into_iter().zip(outs) {
        // SAFETY: `h` is a fresh box; `out` is the live storage of a tensor Python holds.
        let src = unsafe { Storage::from_handle(h) };
        let dst = unsafe { &*(*out as *const Storage) };
        if let Some((buf, _)) = src.current().map_err(err)? {
            dst.set(buf, dtype).map_err(err)?;
        }
    }
    Ok(())
}

#[pyfunction]
fn capture_begin(py: Python<'_>, device: usize) -> PyResult<()> {
    let rt = rt()?;
    py.allow_threads(|| rt.capture_begin(device)).map_err(err)
}

/// Ends a capture; returns (id, [(dtype, sizes)] of the outputs) or None if it broke.
/// `inference`: AOTAutograd's graph without autograd (an optimizer step when it writes
/// its inputs).
#[pyfunction]
#[pyo3(signature = (device, inputs, outputs, inference=false))]
fn capture_end(
    device: usize,
    inputs: Vec<Meta>,
    outputs: Vec<Meta>,
    inference: bool,
) -> PyResult<Option<(usize, Vec<OutMeta>)>> {
    let rt = rt()?;
    let ins: Vec<TensorRef> = inputs.iter().map(|m| tensor(m, device)).collect();
    let outs: Vec<TensorRef> = outputs.iter().map(|m| tensor(m, device)).collect();
    let Some((mut captured, handles)) = rt
        .capture_end(device, &ins, &outs, gen_state(device))
        .map_err(err)?
    else {
        return Ok(None);
    };
    captured.set_ends_step(inference);
    let meta = captured
        .outputs
        .iter()
        .map(|(d, s)| (dtype_to_c10(*d), s.clone()))
        .collect();
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let e = Arc::new(Entry {
        captured,
        first: Mutex::new(Some(SendHandles(handles))),
    });
    programs().insert(id, e);
    Ok(Some((id, meta)))
}

/// Frees a compiled graph (its executable, constants and untaken first results) once no
/// replay still runs it; returns whether it was live.
#[pyfunction]
fn release(py: Python<'_>, id: usize) -> bool {
    let e = programs().remove(&id);
    let live = e.is_some();
    if let Some(b) = bound().as_mut() {
        b.values_mut().for_each(|keys| keys.retain(|_, p| *p != id));
        b.retain(|_, keys| !keys.is_empty());
    }
    // Dropped outside the table's lock; PJRT frees the buffers without the GIL.
    py.allow_threads(|| drop(e));
    live
}

/// The number of compiled graphs not yet released.
#[pyfunction]
fn live_programs() -> usize {
    programs().len()
}

/// The number of (graph, input layout) pairs `torch_pjrt::replay` can find (for tests).
#[pyfunction]
fn bound_layouts() -> usize {
    bound()
        .as_ref()
        .map_or(0, |b| b.values().map(|k| k.len()).sum())
}

/// Delivers the capture's first results into freshly allocated output tensors.
#[pyfunction]
fn take_outputs(id: usize, outs: Vec<usize>) -> PyResult<()> {
    let e = entry(id)?;
    let handles = e.first.lock().unwrap_or_else(|e| e.into_inner()).take();
    deliver(
        handles
            .ok_or_else(|| PyRuntimeError::new_err("outputs already taken"))?
            .0,
        &outs,
    )
}

/// Runs a compiled graph: inputs and (preallocated) outputs are storage handles.
#[pyfunction]
fn replay(py: Python<'_>, id: usize, inputs: Vec<usize>, outs: Vec<usize>) -> PyResult<()> {
    let e = entry(id)?;
    let rt = rt()?;
    py.allow_threads(|| {
        let ins: Vec<*const Storage> = inputs.iter().map(|h| *h as *const Storage).collect();
        let outs: Vec<*const Storage> = outs.iter().map(|h| *h as *const Storage).collect();
        rt.replay(&e.captured, &ins, &outs, gen_state(e.captured.device))
    })
    .map_err(err)
}

/// `torch_pjrt::replay`'s work: runs the program bound to (graph, key) on `inputs` and
/// fills `rets` with its outputs as new storages.
///
/// # Safety
/// Pointers as described in tpu_abi.h; `inputs` are live storage handles.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_graph_replay(
    graph: i64,
    key: *const i64,
    nkey: i64,
    inputs: *const *mut c_void,
    ninputs: i64,
    max_rets: i32,
    nrets: *mut i32,
    rets: *mut TpuRet,
    program: *mut i64,
    err: *mut TpuError,
) -> i32 {
    guarded(err, "graph replay", || {
        // SAFETY: arrays of the given lengths per the ABI.
        let key = unsafe { std::slice::from_raw_parts(key, nkey.max(0) as usize) };
        let inputs = unsafe { std::slice::from_raw_parts(inputs, ninputs.max(0) as usize) };
        let id = bound()
            .as_ref()
            .and_then(|b| b.get(&graph)?.get(key).copied());
        let Some((id, e)) = id.and_then(|id| Some((id, programs().get(&id).cloned()?))) else {
            return Ok(DECLINED);
        };
        let c = &e.captured;
        // SAFETY: nrets and program are valid per the ABI.
        unsafe { *nrets = c.outputs.len() as i32 };
        if c.outputs.len() > max_rets.max(0) as usize {
            return Ok(NEED_RESIZE);
        }
        if c.outputs.iter().any(|(_, s)| s.len() > MAX_DIMS) {
            return Ok(DECLINED);
        }
        let outs: Vec<*const Storage> = c
            .outputs
            .iter()
            .map(|(dt, s)| {
                let n = s.iter().product::<i64>() * dt.size() as i64;
                Storage::new(n, c.device).into_handle() as *const Storage
            })
            .collect();
        let ins: Vec<*const Storage> = inputs.iter().map(|h| *h as *const Storage).collect();
        let rt = runtime::get()?;
        if let Err(er) = rt.replay(c, &ins, &outs, gen_state(c.device)) {
            for h in outs {
                // SAFETY: fresh boxes nobody else owns.
                drop(unsafe { Storage::from_handle(h) });
            }
            return Err(er);
        }
        // SAFETY: rets has room for max_rets >= outputs entries.
        let slots = unsafe { std::slice::from_raw_parts_mut(rets, c.outputs.len()) };
        for ((slot, h), (dt, s)) in slots.iter_mut().zip(outs).zip(&c.outputs) {
            fill_tensor_ret(slot, h as *mut Storage, *dt, s, c.device)?;
        }
        // SAFETY: as above.
        unsafe { *program = id as i64 };
        Ok(OK)
    })
}

/// `torch_pjrt::bind`: later replays of `graph` with this layout key run `program`.
///
/// # Safety
/// `key` holds `nkey` values.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_graph_bind(
    graph: i64,
    key: *const i64,
    nkey: i64,
    program: i64,
    err: *mut TpuError,
) -> i32 {
    guarded(err, "graph bind", || {
        // SAFETY: per the ABI.
        let key = unsafe { std::slice::from_raw_parts(key, nkey.max(0) as usize) };
        let id = program as usize;
        if program < 0 || !programs().contains_key(&id) {
            return Err(runtime::Error::runtime(format!(
                "no compiled graph {program}"
            )));
        }
        bound()
            .get_or_insert_with(HashMap::new)
            .entry(graph)
            .or_default()
            .insert(key.to_vec(), id);
        Ok(OK)
    })
}

struct SendHandles(Handles);
// SAFETY: the raw storage pointers are fresh boxes owned by whoever holds this value;
// Storage itself is Send + Sync (a mutex around a PJRT buffer).
unsafe impl Send for SendHandles {}
// SAFETY: as above; shared access only moves the value out under the entry's mutex.
unsafe impl Sync for SendHandles {}

/// The StableHLO text of a compiled graph.
#[pyfunction]
fn captured_mlir(id: usize) -> PyResult<String> {
    Ok(entry(id)?.captured.mlir.clone())
}

/// For each parameter of a compiled graph: the input it reads, or -1 (constant or RNG).
#[pyfunction]
fn captured_inputs(id: usize) -> PyResult<Vec<i64>> {
    let e = entry(id)?;
    Ok(runtime::Runtime::captured_inputs(&e.captured)
        .into_iter()
        .map(|i| i.map(|i| i as i64).unwrap_or(-1))
        .collect())
}

/// Compiles `mlir` and runs it on storages (for exported programs): inputs as
/// (handle, c10 dtype); outputs are written into the given storages.
#[pyfunction]
fn run_mlir(
    mlir: &str,
    device: usize,
    inputs: Vec<(usize, i32)>,
    outs: Vec<(usize, i32)>,
) -> PyResult<()> {
    let rt = rt()?;
    let exe = rt.compile(mlir, device, false).map_err(err)?;
    let mut bufs = Vec::new();
    for (h, d) in &inputs {
        let dt = dtype_from_c10(*d).ok_or_else(|| PyRuntimeError::new_err("unsupported dtype"))?;
        // SAFETY: the caller holds the tensors alive.
        bufs.push(
            unsafe { &*(*h as *const Storage) }
                .buffer_as(rt, dt)
                .map_err(err)?,
        );
    }
    let refs: Vec<&pjrt::Buffer> = bufs.iter().map(|b| b.as_ref()).collect();
    let res = exe
        .execute(&refs)
        .map_err(|e| PyRuntimeError::new_err(e.message))?;
    if res.len() != outs.len() {
        return Err(PyRuntimeError::new_err(format!(
            "program has {} outputs, {} given",
            res.len(),
            outs.len()
        )));
    }
    for (buf, (h, d)) in res.into_iter().zip(outs) {
        let dt = dtype_from_c10(d).ok_or_else(|| PyRuntimeError::new_err("unsupported dtype"))?;
        // SAFETY: as above.
        unsafe { &*(h as *const Storage) }
            .set(Arc::new(buf), dt)
            .map_err(err)?;
    }
    Ok(())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(capture_begin, m)?)?;
    m.add_function(wrap_pyfunction!(capture_end, m)?)?;
    m.add_function(wrap_pyfunction!(take_outputs, m)?)?;
    m.add_function(wrap_pyfunction!(replay, m)?)?;
    m.add_function(wrap_pyfunction!(captured_mlir, m)?)?;
    m.add_function(wrap_pyfunction!(run_mlir, m)?)?;
    m.add_function(wrap_pyfunction!(captured_inputs, m)?)?;
    m.add_function(wrap_pyfunction!(release, m)?)?;
    m.add_function(wrap_pyfunction!(live_programs, m)?)?;
    m.add_function(wrap_pyfunction!(bound_layouts, m)?)?;
    Ok(())
}
