//! torch.compile support: capture a graph's ops once (through the DeferAndFuse recorder and
//! the same lowering rules), then replay the compiled program on new inputs.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use runtime::defer::{Captured, Handles};
use runtime::exec::Loc;
use runtime::{Storage, TensorRef, View};

use crate::abi::{dtype_from_c10, dtype_to_c10};

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
#[pyfunction]
fn capture_end(
    device: usize,
    inputs: Vec<Meta>,
    outputs: Vec<Meta>,
) -> PyResult<Option<(usize, Vec<OutMeta>)>> {
    let rt = rt()?;
    let ins: Vec<TensorRef> = inputs.iter().map(|m| tensor(m, device)).collect();
    let outs: Vec<TensorRef> = outputs.iter().map(|m| tensor(m, device)).collect();
    let Some((captured, handles)) = rt
        .capture_end(device, &ins, &outs, gen_state(device))
        .map_err(err)?
    else {
        return Ok(None);
    };
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
    // Dropped outside the table's lock; PJRT frees the buffers without the GIL.
    py.allow_threads(|| drop(e));
    live
}

/// The number of compiled graphs not yet released.
#[pyfunction]
fn live_programs() -> usize {
    programs().len()
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
    Ok(())
}
