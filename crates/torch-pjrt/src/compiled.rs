//! torch.compile support: capture a graph's ops once (through the DeferAndFuse recorder and
//! the same lowering rules), then replay the compiled program on new inputs.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
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

/// What a graph call with one input key runs.
#[derive(Clone, Copy)]
enum Slot {
    Program(usize),
    /// The capture broke (an op fell back, a value was read): the graph runs eagerly.
    Eager,
    /// A new shape of a graph captured at another one, with shape buckets on: the graph runs
    /// eagerly, its ops on bucketed per-op programs, after this many calls (see `Graph::miss`).
    Bucketed(u32),
}

/// Calls of a bucketed key after which it is captured, if the graph holds fewer than
/// `STATIC_SHAPES` programs: a shape that recurs (a last partial batch) gets its fused
/// program; one of many lengths (a growing cache, varying batches) stays on bucketed ops.
const HOT_CALLS: u32 = 4;
const STATIC_SHAPES: usize = 4;
/// Bucketed keys a graph remembers; beyond, they are all forgotten (they cost nothing to
/// rebuild: a forgotten one only counts its calls again).
const BUCKETED_KEYS: usize = 4096;

/// One compiled graph (compile.py's `_Graph`): what each input key runs, least recently
/// used first when there are more than `max_programs`.
///
/// A key is what the shim computes from a call's arguments (`replay_key` in shim.cpp):
/// `[n, shape words (n), layout words]`. The shape words (sizes, Python values) tell a new
/// shape from a new layout (dtype, strides, offset, storage size, shared storages) of the
/// same shapes when a recompilation is counted.
struct Graph {
    slots: HashMap<Vec<i64>, (Slot, u64)>,
    /// Keys freed by eviction or release, with why, to name the reason if they come back.
    dropped: VecDeque<(Vec<i64>, &'static str)>,
    max_programs: Option<usize>,
    captures: usize,
    clock: u64,
}

impl Graph {
    fn shapes(key: &[i64]) -> &[i64] {
        let n = key
            .first()
            .map_or(0, |n| (*n).clamp(0, key.len() as i64 - 1) as usize);
        &key[1..1 + n]
    }

    /// Why a key is compiled again (None for the graph's first capture).
    fn recompile_reason(&mut self, key: &[i64]) -> Option<&'static str> {
        if self.captures == 0 {
            return None;
        }
        if let Some(i) = self.dropped.iter().position(|(k, _)| k == key) {
            return self.dropped.remove(i).map(|(_, why)| why);
        }
        Some(if self.has_shapes(key) {
            "new_layout"
        } else {
            "new_shape"
        })
    }

    /// Another key with the shapes of `key` runs a program or eagerly (a capture was tried).
    fn has_shapes(&self, key: &[i64]) -> bool {
        let shapes = Self::shapes(key);
        self.slots.iter().any(|(k, (s, _))| {
            k.as_slice() != key && !matches!(s, Slot::Bucketed(_)) && Self::shapes(k) == shapes
        })
    }

    fn programs(&self) -> usize {
        self.slots
            .values()
            .filter(|(s, _)| matches!(s, Slot::Program(_)))
            .count()
    }

    /// What a replay that found no program for `key` does: with shape buckets on, a new shape
    /// of a graph captured before runs eagerly, so its ops' bucketed programs serve it (a
    /// capture per length compiled a whole graph per token of a growing cache); a recurring
    /// bucketed key is captured after `HOT_CALLS`. Returns whether the call runs bucketed.
    fn miss(&mut self, key: &[i64]) -> bool {
        let now = self.clock;
        if let Some((Slot::Bucketed(n), used)) = self.slots.get_mut(key) {
            *used = now;
            if *n < HOT_CALLS {
                *n += 1;
                return true;
            }
            // Counted only past HOT_CALLS: a bucketed call does not scan the slots.
            return self.programs() >= STATIC_SHAPES;
        }
        let dropped = self.dropped.iter().any(|(k, _)| k == key);
        if !runtime::buckets::enabled() || self.captures == 0 || dropped || self.has_shapes(key) {
            return false;
        }
        let bucketed = |s: &Slot| matches!(s, Slot::Bucketed(_));
        if self.slots.values().filter(|(s, _)| bucketed(s)).count() >= BUCKETED_KEYS {
            self.slots.retain(|_, (s, _)| !bucketed(s));
        }
        self.slots.insert(key.to_vec(), (Slot::Bucketed(1), now));
        true
    }

    fn forget(&mut self, key: Vec<i64>, why: &'static str) {
        self.dropped.push_back((key, why));
        let cap = self.max_programs.map_or(DROPPED_UNBOUNDED, |m| 4 * m);
        while self.dropped.len() > cap {
            self.dropped.pop_front();
        }
    }

    /// Removes the least recently used keys beyond `max_programs`: their programs.
    fn evict(&mut self) -> Vec<Slot> {
        let mut out = Vec::new();
        let Some(max) = self.max_programs else {
            return out;
        };
        let held = |s: &Slot| !matches!(s, Slot::Bucketed(_));
        while self.slots.values().filter(|(s, _)| held(s)).count() > max {
            let Some(key) = self
                .slots
                .iter()
                .filter(|(_, (s, _))| held(s))
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            if let Some((slot, _)) = self.slots.remove(&key) {
                out.push(slot);
            }
            self.forget(key, "evicted");
        }
        out
    }
}

/// Dropped keys remembered by a graph without a `max_programs` bound (else 4 per program).
const DROPPED_UNBOUNDED: usize = 64;

/// Live graphs by id; ids are never reused.
static GRAPHS: Mutex<BTreeMap<i64, Graph>> = Mutex::new(BTreeMap::new());
static NEXT_GRAPH: AtomicI64 = AtomicI64::new(0);

fn graphs() -> std::sync::MutexGuard<'static, BTreeMap<i64, Graph>> {
    GRAPHS.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// Per graph, the key of this thread's last replay that found nothing, for the
    /// `graph_bind` that follows its capture (captures can nest).
    static MISSED: RefCell<HashMap<i64, Vec<i64>>> = RefCell::new(HashMap::new());
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

/// Ends a capture without a program: what it recorded runs as a DeferAndFuse flush.
#[pyfunction]
fn capture_abort(py: Python<'_>, device: usize) -> PyResult<()> {
    let rt = rt()?;
    py.allow_threads(|| rt.capture_abort(device)).map_err(err)
}

/// An output that is a view of an input: (output index, input index, sizes, strides, offset).
type InputView = (usize, usize, Vec<i64>, Vec<i64>, i64);

/// A finished capture: (program id, its outputs' metadata, the outputs that are input views).
type Capture = (usize, Vec<OutMeta>, Vec<InputView>);

/// Outputs the capture's eager run made as views of an input (same storage and dtype).
/// AOTAutograd regenerates such an output from the input with the strides of the tensor
/// the graph returns (`as_strided`), so a replay must return the view itself: the
/// program's dense copy read the input in another order (a permute then reshape under
/// dynamic shapes).
fn input_views(inputs: &[Meta], outputs: &[Meta]) -> Vec<InputView> {
    let input_of = |m: &Meta| {
        // Empty storages all have the null handle.
        (m.0 != 0)
            .then(|| inputs.iter().position(|i| i.0 == m.0 && i.1 == m.1))
            .flatten()
    };
    outputs
        .iter()
        .enumerate()
        .filter_map(|(k, m)| input_of(m).map(|i| (k, i, m.2.clone(), m.3.clone(), m.4)))
        .collect()
}

/// Ends a capture; returns (id, [(dtype, sizes)] of the outputs, the outputs that are views
/// of an input) or None if it broke. `inference`: AOTAutograd's graph without autograd (an
/// optimizer step when it writes its inputs).
#[pyfunction]
#[pyo3(signature = (device, inputs, outputs, inference=false))]
fn capture_end(
    device: usize,
    inputs: Vec<Meta>,
    outputs: Vec<Meta>,
    inference: bool,
) -> PyResult<Option<Capture>> {
    let rt = rt()?;
    // A replay returns its outputs through the shim's fixed-size descriptors.
    if outputs.iter().any(|m| m.2.len() > MAX_DIMS) {
        rt.capture_abort(device).map_err(err)?;
        return Ok(None);
    }
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
    Ok(Some((id, meta, input_views(&inputs, &outputs))))
}

/// Frees compiled programs (executables, constants, untaken first results) once no
/// replay still runs them; returns how many were live.
fn free(py: Python<'_>, ids: &[usize]) -> usize {
    let gone: Vec<Arc<Entry>> = {
        let mut p = programs();
        ids.iter().filter_map(|id| p.remove(id)).collect()
    };
    let n = gone.len();
    // Dropped outside the table's lock; PJRT frees the buffers without the GIL.
    py.allow_threads(|| drop(gone));
    n
}

/// Frees a compiled graph that no graph table holds (an export); returns whether it was live.
#[pyfunction]
fn release(py: Python<'_>, id: usize) -> bool {
    free(py, &[id]) == 1
}

/// The number of compiled graphs not yet released.
#[pyfunction]
fn live_programs() -> usize {
    programs().len()
}

/// A new graph table; `max_programs`: keys kept, least recently used freed first (None:
/// no limit).
#[pyfunction]
#[pyo3(signature = (max_programs=None))]
fn graph_new(max_programs: Option<usize>) -> i64 {
    let id = NEXT_GRAPH.fetch_add(1, Ordering::Relaxed);
    let g = Graph {
        slots: HashMap::new(),
        dropped: VecDeque::new(),
        max_programs,
        captures: 0,
        clock: 0,
    };
    graphs().insert(id, g);
    id
}

/// After a replay of `graph` found nothing for its key, makes that key run `program` (None:
/// the graph runs eagerly for it). Returns (why this is a recompilation, or None for the
/// graph's first capture; the keys evicted beyond max_programs; the programs freed).
#[pyfunction]
#[pyo3(signature = (graph, program))]
fn graph_bind(
    py: Python<'_>,
    graph: i64,
    program: Option<usize>,
) -> PyResult<(Option<&'static str>, usize, Vec<usize>)> {
    let Some(key) = MISSED.with(|m| m.borrow_mut().remove(&graph)) else {
        return Err(PyRuntimeError::new_err(format!(
            "graph {graph}: bind without a missed replay"
        )));
    };
    if let Some(p) = program {
        if !programs().contains_key(&p) {
            return Err(PyRuntimeError::new_err(format!("no compiled graph {p}")));
        }
    }
    let (reason, evicted) = {
        let mut all = graphs();
        let Some(t) = all.get_mut(&graph) else {
            return Err(PyRuntimeError::new_err(format!("no graph {graph}")));
        };
        let reason = t.recompile_reason(&key);
        t.captures += 1;
        t.clock += 1;
        let slot = program.map_or(Slot::Eager, Slot::Program);
        t.slots.insert(key, (slot, t.clock));
        (reason, t.evict())
    };
    let ids: Vec<usize> = evicted
        .iter()
        .filter_map(|s| match s {
            Slot::Program(p) => Some(*p),
            Slot::Eager | Slot::Bucketed(_) => None,
        })
        .collect();
    free(py, &ids);
    Ok((reason, evicted.len(), ids))
}

/// Frees every program of `graph`, remembering its keys as released (a later call with one
/// captures again); `forget`: the graph itself is gone too. Returns the programs freed.
#[pyfunction]
fn graph_release(py: Python<'_>, graph: i64, forget: bool) -> Vec<usize> {
    let slots: Vec<(Vec<i64>, Slot)> = {
        let mut all = graphs();
        let Some(t) = all.get_mut(&graph) else {
            return Vec::new();
        };
        let slots: Vec<_> = t.slots.drain().map(|(k, (s, _))| (k, s)).collect();
        if forget {
            all.remove(&graph);
        } else {
            for (k, s) in &slots {
                if !matches!(s, Slot::Bucketed(_)) {
                    t.forget(k.clone(), "released");
                }
            }
        }
        slots
    };
    let ids: Vec<usize> = slots
        .iter()
        .filter_map(|(_, s)| match s {
            Slot::Program(p) => Some(*p),
            Slot::Eager | Slot::Bucketed(_) => None,
        })
        .collect();
    free(py, &ids);
    ids
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

/// What `program` holds when the graph runs eagerly for this key (nothing ran).
const EAGER: i64 = -2;
/// Same, on bucketed per-op programs (`Slot::Bucketed`).
const BUCKETED: i64 = -4;

/// `torch_pjrt::replay`'s work: runs the program `graph` has for `key` on `inputs` and
/// fills `rets` with its outputs as new storages. DECLINED when it has none (the key is
/// kept for `graph_bind`).
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
        let slot = {
            let mut all = graphs();
            let t = all.get_mut(&graph);
            t.and_then(|t| {
                t.clock += 1;
                let now = t.clock;
                let held = t.slots.get_mut(key);
                if let Some((slot, used)) = held.filter(|(s, _)| !matches!(s, Slot::Bucketed(_))) {
                    *used = now;
                    return Some(*slot);
                }
                t.miss(key).then_some(Slot::Bucketed(0))
            })
        };
        let eager = match slot {
            Some(Slot::Eager) => EAGER,
            Some(Slot::Bucketed(_)) => BUCKETED,
            _ => 0,
        };
        if eager != 0 {
            // SAFETY: nrets and program are valid per the ABI.
            unsafe {
                *nrets = 0;
                *program = eager;
            }
            return Ok(OK);
        }
        let e = match slot {
            Some(Slot::Program(id)) => programs().get(&id).cloned().map(|e| (id, e)),
            _ => None,
        };
        let Some((id, e)) = e else {
            MISSED.with(|m| m.borrow_mut().insert(graph, key.to_vec()));
            return Ok(DECLINED);
        };
        let c = &e.captured;
        // SAFETY: nrets and program are valid per the ABI.
        unsafe { *nrets = c.outputs.len() as i32 };
        if c.outputs.len() > max_rets.max(0) as usize {
            return Ok(NEED_RESIZE);
        }
        let bytes: i64 = c
            .outputs
            .iter()
            .map(|(dt, s)| s.iter().product::<i64>() * dt.size() as i64)
            .sum();
        runtime::memory::admit(c.device, bytes)?;
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
    m.add_function(wrap_pyfunction!(capture_abort, m)?)?;
    m.add_function(wrap_pyfunction!(take_outputs, m)?)?;
    m.add_function(wrap_pyfunction!(captured_mlir, m)?)?;
    m.add_function(wrap_pyfunction!(run_mlir, m)?)?;
    m.add_function(wrap_pyfunction!(captured_inputs, m)?)?;
    m.add_function(wrap_pyfunction!(release, m)?)?;
    m.add_function(wrap_pyfunction!(live_programs, m)?)?;
    m.add_function(wrap_pyfunction!(graph_new, m)?)?;
    m.add_function(wrap_pyfunction!(graph_bind, m)?)?;
    m.add_function(wrap_pyfunction!(graph_release, m)?)?;
    Ok(())
}
