//! The `tpu_rs_*` functions the C++ shim calls. No panic crosses this boundary: each
//! entry point runs under `catch_unwind` and reports failures through `TpuError`.

use std::collections::HashSet;
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use runtime::{copy, dispatch, ErrorKind, Outcome, Ret, Storage};

use crate::abi::*;

/// `torch_pjrt.enable_cpu_fallback`.
pub static FALLBACK_ENABLED: AtomicBool = AtomicBool::new(true);
static WARNED: Mutex<Option<HashSet<String>>> = Mutex::new(None);

thread_local! {
    /// Why the last op on this thread was declined: the shim's fallback that follows names it.
    static DECLINED_WHY: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

pub(crate) const OK: i32 = 0;
pub(crate) const DECLINED: i32 = 1;
const ERROR: i32 = 2;
pub(crate) const NEED_RESIZE: i32 = 3;

fn panic_msg(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

/// Runs `f`, turning errors and panics into `err` and a non-zero code.
pub(crate) fn guarded(
    err: *mut TpuError,
    what: &str,
    f: impl FnOnce() -> runtime::Result<i32>,
) -> i32 {
    let r = catch_unwind(AssertUnwindSafe(f));
    let (kind, msg) = match r {
        Ok(Ok(code)) => return code,
        Ok(Err(e)) => (e.kind, e.msg),
        Err(p) => (
            ErrorKind::Runtime,
            format!("internal error in torch_pjrt ({what}): {}", panic_msg(p)),
        ),
    };
    if !err.is_null() {
        // SAFETY: the shim passes a valid TpuError to fill.
        unsafe { (*err).set(kind, &msg) };
    }
    ERROR
}

fn rt() -> runtime::Result<&'static runtime::Runtime> {
    runtime::get()
}

fn storage<'a>(h: *mut c_void) -> &'a Storage {
    // SAFETY: handles come from tpu_rs_storage_new / dispatch and stay alive until
    // tpu_rs_storage_free, which PyTorch calls only after the last use.
    unsafe { &*(h as *const Storage) }
}

pub(crate) fn fill_tensor_ret(
    r: &mut TpuRet,
    handle: *mut Storage,
    dtype: runtime::DType,
    sizes: &[i64],
    device: usize,
) -> runtime::Result<()> {
    if sizes.len() > MAX_DIMS {
        return Err(runtime::Error::runtime(format!(
            "tensors of rank {} are not supported (max {MAX_DIMS})",
            sizes.len()
        )));
    }
    r.kind = RET_TENSOR;
    r.handle = handle as *mut c_void;
    r.dtype = dtype_to_c10(dtype);
    r.device_index = device as i32;
    r.ndim = sizes.len() as i32;
    r.sizes[..sizes.len()].copy_from_slice(sizes);
    Ok(())
}

/// # Safety
/// Called by the shim with valid pointers as described in tpu_abi.h.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_dispatch(
    op_name: *const c_char,
    overload: *const c_char,
    nargs: i32,
    args: *const TpuArg,
    max_rets: i32,
    nrets: *mut i32,
    rets: *mut TpuRet,
    err: *mut TpuError,
) -> i32 {
    guarded(err, "dispatch", || {
        // SAFETY: valid strings and arguments per the ABI.
        let (op, ov, params) = unsafe { (cstr(op_name), cstr(overload), params(args, nargs)) };
        let rt = rt()?;
        DECLINED_WHY.with(|w| w.borrow_mut().take());
        match dispatch(rt, &op, &ov, &params)? {
            Outcome::Declined(why) => {
                DECLINED_WHY.with(|w| *w.borrow_mut() = Some(why));
                Ok(DECLINED)
            }
            Outcome::Resize(list) => {
                // SAFETY: err is valid per the ABI.
                let e = unsafe { &mut *err };
                e.n_resize = list.len().min(8) as i32;
                for (k, (idx, sizes)) in list.iter().take(8).enumerate() {
                    e.resize_arg[k] = *idx as i32;
                    let out_pos = params[..*idx].iter().filter(|p| p.is_out).count();
                    e.resize_column_major[k] =
                        (sizes.len() >= 2 && runtime::column_major_result(&op, out_pos)) as i32;
                    e.resize_ndim[k] = sizes.len().min(MAX_DIMS) as i32;
                    for (d, s) in sizes.iter().take(MAX_DIMS).enumerate() {
                        e.resize_sizes[k][d] = *s;
                    }
                }
                Ok(NEED_RESIZE)
            }
            Outcome::Done(list) => {
                if list.len() > max_rets.max(0) as usize {
                    return Err(runtime::Error::runtime("too many results for the shim"));
                }
                // SAFETY: rets has room for max_rets entries.
                let out = unsafe { std::slice::from_raw_parts_mut(rets, max_rets as usize) };
                let mut owned: Vec<*mut Storage> = Vec::new();
                let mut res = Ok(());
                for (k, (slot, r)) in out.iter_mut().zip(list.iter()).enumerate() {
                    *slot = TpuRet::zeroed();
                    match r {
                        Ret::Tensor {
                            handle,
                            dtype,
                            sizes,
                            device,
                        } => {
                            owned.push(*handle);
                            if res.is_ok() {
                                res = fill_tensor_ret(slot, *handle, *dtype, sizes, *device);
                                if sizes.len() >= 2 && runtime::column_major_result(&op, k) {
                                    slot.i = 1;
                                }
                            }
                        }
                        Ret::Alias(i) => {
                            slot.kind = RET_ALIAS;
                            slot.alias_arg = *i as i32;
                        }
                        Ret::AliasElem(i, j) => {
                            slot.kind = RET_ALIAS_LIST_ELEM;
                            slot.alias_arg = *i as i32;
                            slot.i = *j as i64;
                        }
                        Ret::List(n) => {
                            slot.kind = RET_LIST;
                            slot.i = *n as i64;
                        }
                        Ret::Int(v) => {
                            slot.kind = RET_INT;
                            slot.i = *v;
                        }
                        Ret::Float(v) => {
                            slot.kind = RET_DOUBLE;
                            slot.d = *v;
                        }
                        Ret::Bool(v) => {
                            slot.kind = RET_BOOL;
                            slot.i = *v as i64;
                        }
                        Ret::None => slot.kind = RET_NONE,
                    }
                }
                if let Err(e) = res {
                    for h in owned {
                        // SAFETY: fresh handles (one reference each) not yet handed to the shim.
                        drop(unsafe { Storage::from_handle(h) });
                    }
                    return Err(e);
                }
                // SAFETY: nrets is valid per the ABI.
                unsafe { *nrets = list.len() as i32 };
                Ok(OK)
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn tpu_rs_storage_new(
    nbytes: i64,
    device_index: i32,
    err: *mut TpuError,
) -> *mut c_void {
    let mut h: *mut c_void = std::ptr::null_mut();
    guarded(err, "allocation", || {
        h = Storage::alloc(nbytes, device_index.max(0) as usize)?.into_handle() as *mut c_void;
        Ok(OK)
    });
    h
}

/// # Safety
/// `out` has room for 12 values.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_memory_stats(device_index: i32, out: *mut i64) {
    let s = runtime::memory::stats(device_index.max(0) as usize);
    let vals = [
        s.bytes[0],
        s.bytes[1],
        s.bytes[2],
        s.bytes[3],
        s.count[0],
        s.count[1],
        s.count[2],
        s.count[3],
        s.reserved,
        s.reserved_peak,
        s.ooms,
        s.limit,
    ];
    // SAFETY: the ABI gives room for 12 values.
    unsafe { std::ptr::copy_nonoverlapping(vals.as_ptr(), out, vals.len()) };
}

#[no_mangle]
pub extern "C" fn tpu_rs_memory_reset(device_index: i32, accumulated: i32) {
    let d = device_index.max(0) as usize;
    if accumulated != 0 {
        runtime::memory::reset_accumulated(d);
    } else {
        runtime::memory::reset_peak(d);
    }
}

/// # Safety
/// Valid out pointers.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_memory_info(device_index: i32, free: *mut i64, total: *mut i64) {
    let (f, t) = runtime::memory::capacity(device_index.max(0) as usize);
    // SAFETY: valid out pointers per the ABI.
    unsafe {
        *free = f;
        *total = t;
    }
}

/// # Safety
/// Valid error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_empty_cache(err: *mut TpuError) -> i32 {
    guarded(err, "empty_cache", || {
        rt()?.synchronize()?;
        pjrt::trim_host_memory();
        Ok(OK)
    })
}

/// # Safety
/// `handle` comes from tpu_rs_storage_new or a dispatch result, freed once.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_storage_free(handle: *mut c_void) {
    if handle.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the handle holds one reference, released exactly once (DataPtr deleter).
        let s = unsafe { Storage::from_handle(handle as *const Storage) };
        s.uncount();
    }));
}

/// # Safety
/// Valid handles and error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_storage_copy(
    dst: *mut c_void,
    src: *mut c_void,
    nbytes: i64,
    err: *mut TpuError,
) -> i32 {
    guarded(err, "storage copy", || {
        copy::storage_copy(rt()?, storage(dst), storage(src), nbytes)?;
        Ok(OK)
    })
}

/// # Safety
/// Valid handle and error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_storage_resize(
    handle: *mut c_void,
    new_nbytes: i64,
    err: *mut TpuError,
) -> i32 {
    guarded(err, "storage resize", || {
        storage(handle).resize(rt()?, new_nbytes)?;
        Ok(OK)
    })
}

/// The shim's reference `keep` to host memory, released by `release(keep)` when dropped
/// (nothing to release when `keep` is NULL).
fn shim_reference(
    keep: *mut c_void,
    release: Option<unsafe extern "C" fn(*mut c_void)>,
) -> runtime::worker::HostSource {
    runtime::worker::HostSource {
        ptr: std::ptr::null(),
        len: 0,
        keep,
        release: if keep.is_null() { None } else { release },
    }
}

/// # Safety
/// Valid descriptors and error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_copy(
    src: *const TpuTensor,
    dst: *const TpuTensor,
    non_blocking: i32,
    keep: *mut c_void,
    release: Option<unsafe extern "C" fn(*mut c_void)>,
    err: *mut TpuError,
) -> i32 {
    // Owns the shim's reference to the CPU source from here on, whatever happens.
    let host = shim_reference(keep, release);
    guarded(err, "copy", || {
        // SAFETY: descriptors filled by the shim.
        let (s, d) = unsafe { (tensor(&*src), tensor(&*dst)) };
        if non_blocking != 0 {
            copy::copy_nonblocking(rt()?, &s, &d, host)?;
        } else {
            drop(host);
            copy::copy(rt()?, &s, &d)?;
        }
        Ok(OK)
    })
}

/// The bytes of `t`'s storage shared with the host (`copy::host_alias`): 1 with `*data` and
/// `*hold` set (`tpu_rs_host_alias_release(*hold)` once done with the bytes), 0 where the
/// plugin's buffers are not host memory (or, `writable`, where the buffer is shared).
///
/// # Safety
/// Valid descriptor, out pointers and error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_host_alias(
    t: *const TpuTensor,
    writable: i32,
    data: *mut *mut c_void,
    hold: *mut *mut c_void,
    err: *mut TpuError,
) -> i32 {
    guarded(err, "host alias", || {
        // SAFETY: descriptor filled by the shim.
        let t = unsafe { tensor(&*t) };
        Ok(match copy::host_alias(rt()?, &t, writable != 0)? {
            Some((buf, ptr)) => {
                // SAFETY: out pointers valid per the contract.
                unsafe {
                    *data = ptr.cast();
                    *hold = Box::into_raw(Box::new(buf)).cast();
                }
                1
            }
            None => 0,
        })
    })
}

/// Releases what `tpu_rs_host_alias` held.
///
/// # Safety
/// `hold` came from `tpu_rs_host_alias`, released once.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_host_alias_release(hold: *mut c_void) {
    if !hold.is_null() {
        // SAFETY: per the contract, a box made by tpu_rs_host_alias.
        drop(unsafe { Box::from_raw(hold as *mut std::sync::Arc<pjrt::Buffer>) });
    }
}

/// `len` bytes at `data` become `dst`'s value without a copy (`copy::adopt_host`): 1 if so,
/// 0 if the caller must copy. `release(keep)` runs once the memory is no longer read (at
/// once when 0 or on error).
///
/// # Safety
/// Valid descriptor and error pointer; `data` stays valid and unchanged until `release`.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_adopt_host(
    dst: *const TpuTensor,
    data: *mut c_void,
    len: i64,
    keep: *mut c_void,
    release: Option<unsafe extern "C" fn(*mut c_void)>,
    err: *mut TpuError,
) -> i32 {
    // Owns the shim's reference from here on, whatever happens.
    let host = shim_reference(keep, release);
    guarded(err, "adopt host memory", || {
        // SAFETY: descriptor filled by the shim.
        let d = unsafe { tensor(&*dst) };
        let done = Box::new(move || drop(host));
        Ok(copy::adopt_host(rt()?, &d, data.cast(), len.max(0) as usize, done)? as i32)
    })
}

/// A side stream for a new `torch.tpu.Stream` (0 is the default stream).
#[no_mangle]
pub extern "C" fn tpu_rs_stream_new() -> i64 {
    runtime::stream::new_stream().map_or(0, |s| s as i64)
}

/// The calling thread's current stream becomes `stream`.
#[no_mangle]
pub extern "C" fn tpu_rs_stream_set_current(stream: i64) {
    runtime::stream::set_current(stream.max(0) as usize);
}

/// # Safety
/// Valid error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_stream_query(stream: i64, err: *mut TpuError) -> i32 {
    guarded(err, "stream query", || {
        Ok(runtime::stream::query(stream.max(0) as usize)? as i32)
    })
}

/// # Safety
/// Valid error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_stream_synchronize(stream: i64, err: *mut TpuError) -> i32 {
    guarded(err, "stream synchronize", || {
        runtime::stream::synchronize(stream.max(0) as usize)?;
        Ok(OK)
    })
}

/// Puts `ev` into `*event`, freeing the event it held.
///
/// # Safety
/// `*event` is NULL or a live handle made by `store_event`.
unsafe fn store_event(event: *mut *mut c_void, ev: runtime::stream::Event) {
    // SAFETY: per the contract.
    unsafe {
        let old = *event as *mut runtime::stream::Event;
        if !old.is_null() {
            drop(Box::from_raw(old));
        }
        *event = Box::into_raw(Box::new(ev)) as *mut c_void;
    }
}

/// Records an event on `stream` into `*event` (a handle made here, replaced if set).
///
/// # Safety
/// `event` points at NULL or a handle from this function; valid error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_event_record(
    event: *mut *mut c_void,
    stream: i64,
    err: *mut TpuError,
) -> i32 {
    guarded(err, "event record", || {
        let ev = runtime::stream::record(stream.max(0) as usize)?;
        // SAFETY: per the contract, `*event` is NULL or a live handle we made.
        unsafe { store_event(event, ev) };
        Ok(OK)
    })
}

/// The profiler's per-op marker (no DeferAndFuse flush); `*event` as for a record.
///
/// # Safety
/// `event` points at NULL or a handle from these functions; valid error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_event_marker(
    event: *mut *mut c_void,
    stream: i64,
    err: *mut TpuError,
) -> i32 {
    guarded(err, "profiler marker", || {
        let ev = runtime::stream::marker(stream.max(0) as usize)?;
        // SAFETY: per the contract, `*event` is NULL or a live handle we made.
        unsafe { store_event(event, ev) };
        Ok(OK)
    })
}

/// # Safety
/// `event` is NULL or a live handle from `tpu_rs_event_record`, freed once.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_event_free(event: *mut c_void) {
    if !event.is_null() {
        // SAFETY: per the contract.
        drop(unsafe { Box::from_raw(event as *mut runtime::stream::Event) });
    }
}

/// # Safety
/// `event` is NULL or a live handle.
unsafe fn event_ref<'a>(event: *mut c_void) -> Option<&'a runtime::stream::Event> {
    // SAFETY: per the callers' contract.
    unsafe { (event as *const runtime::stream::Event).as_ref() }
}

/// 1 when the event was reached (or never recorded), 0 otherwise.
///
/// # Safety
/// `event` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_event_query(event: *mut c_void) -> i32 {
    // SAFETY: per the contract.
    unsafe { event_ref(event) }.is_none_or(|e| e.query()) as i32
}

/// # Safety
/// `event` is NULL or a live handle; valid error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_event_synchronize(event: *mut c_void, err: *mut TpuError) -> i32 {
    guarded(err, "event synchronize", || {
        // SAFETY: per the contract.
        if let Some(e) = unsafe { event_ref(event) } {
            e.synchronize()?;
        }
        Ok(OK)
    })
}

/// Work queued on `stream` from now on waits for the event.
///
/// # Safety
/// `event` is NULL or a live handle; valid error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_event_block(
    event: *mut c_void,
    stream: i64,
    err: *mut TpuError,
) -> i32 {
    guarded(err, "event wait", || {
        // SAFETY: per the contract.
        if let Some(e) = unsafe { event_ref(event) } {
            e.block(stream.max(0) as usize)?;
        }
        Ok(OK)
    })
}

/// Milliseconds between two recorded events, into `*ms`.
///
/// # Safety
/// Live handles or NULL; valid out and error pointers.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_event_elapsed(
    start: *mut c_void,
    end: *mut c_void,
    ms: *mut f64,
    err: *mut TpuError,
) -> i32 {
    guarded(err, "elapsed_time", || {
        // SAFETY: per the contract.
        let (a, b) = unsafe { (event_ref(start), event_ref(end)) };
        let (Some(a), Some(b)) = (a, b) else {
            return Err(runtime::Error::runtime(
                "Both events must be recorded before calculating elapsed time.",
            ));
        };
        let t = a.elapsed_ms(b)?;
        // SAFETY: valid out pointer per the ABI.
        unsafe { *ms = t };
        Ok(OK)
    })
}

/// # Safety
/// Valid descriptor, output and error pointers.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_item(
    t: *const TpuTensor,
    out: *mut TpuRet,
    err: *mut TpuError,
) -> i32 {
    guarded(err, "item", || {
        // SAFETY: descriptor filled by the shim; out is writable.
        let (t, out) = unsafe { (tensor(&*t), &mut *out) };
        *out = TpuRet::zeroed();
        match copy::item(rt()?, &t)? {
            copy::Item::Int(v) => {
                out.kind = RET_INT;
                out.i = v;
            }
            copy::Item::Float(v) => {
                out.kind = RET_DOUBLE;
                out.d = v;
            }
            copy::Item::Bool(v) => {
                out.kind = RET_BOOL;
                out.i = v as i64;
            }
        }
        Ok(OK)
    })
}

#[no_mangle]
pub extern "C" fn tpu_rs_device_count() -> i32 {
    catch_unwind(|| runtime::device_count() as i32).unwrap_or(0)
}

/// # Safety
/// Valid error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_synchronize(_device_index: i32, err: *mut TpuError) -> i32 {
    guarded(err, "synchronize", || {
        rt()?.synchronize()?;
        Ok(OK)
    })
}

/// Starts the device trace (the shim's Kineto plugin: `torch.profiler` with PrivateUse1).
#[no_mangle]
pub extern "C" fn tpu_rs_trace_start() {
    let _ = catch_unwind(runtime::trace::start);
}

/// One program run of the device trace: name, device, stream, queued/start/end (wall-clock
/// ns since 1970), how its program was obtained and the seconds that took.
pub type TraceEmit = unsafe extern "C" fn(
    ctx: *mut c_void,
    name: *const c_char,
    device: i32,
    stream: i32,
    queued_ns: i64,
    start_ns: i64,
    end_ns: i64,
    source: *const c_char,
    source_s: f64,
);

/// Waits for queued work, stops the device trace and hands each record to `emit`.
///
/// # Safety
/// `emit` is called with `ctx` and pointers valid during the call only.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_trace_stop(emit: Option<TraceEmit>, ctx: *mut c_void) {
    let records = catch_unwind(|| {
        if let Ok(rt) = rt() {
            // A failed job raises at the user's next synchronization, not in the profiler.
            let _ = rt.synchronize();
        }
        runtime::trace::stop()
    });
    let (Ok(records), Some(emit)) = (records, emit) else {
        return;
    };
    let base = runtime::trace::epoch_wall_ns() as i64;
    for r in records {
        let name = std::ffi::CString::new(r.name.replace('\0', "")).unwrap_or_default();
        let (kind, secs) = r.source.describe();
        let kind = std::ffi::CString::new(kind).unwrap_or_default();
        let at = |t: u64| base + t as i64;
        // SAFETY: the shim's callback, with the context it passed; the strings live
        // through the call.
        unsafe {
            emit(
                ctx,
                name.as_ptr(),
                r.device as i32,
                r.stream as i32,
                at(r.queued),
                at(r.start),
                at(r.end),
                kind.as_ptr(),
                secs,
            )
        };
    }
}

/// # Safety
/// Valid op name and error pointer.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_fallback_begin(op_name: *const c_char, err: *mut TpuError) -> i32 {
    // SAFETY: NUL-terminated name per the ABI.
    let name = unsafe { cstr(op_name) };
    // Why a rule declined (an op without a rule needs no explanation).
    let why = DECLINED_WHY
        .with(|w| w.borrow_mut().take())
        .filter(|w| !runtime::is_no_rule(w))
        .map(|w| format!(" ({w})"))
        .unwrap_or_default();
    let r = guarded(err, "fallback", || {
        if !FALLBACK_ENABLED.load(Ordering::Relaxed) {
            return Err(runtime::Error::new(
                ErrorKind::NotImplemented,
                format!(
                    "The operator '{name}' is not currently implemented for the tpu device{why}, and the CPU fallback is disabled (torch_pjrt.enable_cpu_fallback = False). Enable the fallback, or move this op to the CPU."
                ),
            ));
        }
        let base = name.split('.').next().unwrap_or(&name).to_string();
        if let Ok(rt) = rt() {
            rt.metrics.fallback(&base);
            rt.defer.note_fallback();
        }
        let first = {
            let mut w = WARNED.lock().unwrap_or_else(|e| e.into_inner());
            w.get_or_insert_with(HashSet::new).insert(base.clone())
        };
        if first {
            crate::warn(&format!(
                "The operator '{name}' is not lowered for the tpu device{why}: it runs on the CPU (copies to and from the host). Set torch_pjrt.enable_cpu_fallback = False to make this an error."
            ));
        }
        Ok(1)
    });
    if r == ERROR {
        0
    } else {
        1
    }
}

/// A tensor's dtype and sizes (None: a dtype the device lacks).
///
/// # Safety
/// `t` points at a tensor whose `sizes` hold `ndim` entries.
unsafe fn dtype_and_sizes<'a>(t: *const TpuTensor) -> Option<(runtime::DType, &'a [i64])> {
    // SAFETY: the caller's contract.
    let t = unsafe { &*t };
    let sizes = if t.ndim > 0 {
        // SAFETY: `sizes` holds `ndim` entries.
        unsafe { std::slice::from_raw_parts(t.sizes, t.ndim as usize) }
    } else {
        &[]
    };
    dtype_from_c10(t.dtype).map(|d| (d, sizes))
}

/// Whether scaled_dot_product_attention takes its fused entry for these operands (see
/// `lowering::rules::attention::sdpa_fused_ok`); only dtypes and sizes are read, so fake
/// tensors work too. `mask` may be null.
///
/// # Safety
/// `q`, `k`, `v` point at tensors whose `sizes` hold `ndim` entries; `mask` too, or is null.
#[no_mangle]
pub unsafe extern "C" fn tpu_rs_sdpa_fused(
    q: *const TpuTensor,
    k: *const TpuTensor,
    v: *const TpuTensor,
    mask: *const TpuTensor,
    dropout: f64,
    enable_gqa: i32,
) -> i32 {
    catch_unwind(|| {
        // SAFETY: the caller's contract; `mask` is read only when not null.
        let (q, k, v) = unsafe { (dtype_and_sizes(q), dtype_and_sizes(k), dtype_and_sizes(v)) };
        let (Some(q), Some(k), Some(v)) = (q, k, v) else {
            return 0;
        };
        let m = if mask.is_null() {
            None
        } else {
            // SAFETY: as above.
            match unsafe { dtype_and_sizes(mask) } {
                None => return 0,
                m => m,
            }
        };
        runtime::sdpa_fused_ok(q, k, v, m, dropout, enable_gqa != 0) as i32
    })
    .unwrap_or(0)
}
