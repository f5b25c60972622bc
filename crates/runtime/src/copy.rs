//! Copies between host and device (`_copy_from`, `.item()`), built on the op path.

use std::sync::Arc;

use crate::exec::{dispatch, Loc, Outcome, Param, RArg, Ret, TensorRef};
use crate::layout::View;
use crate::storage::Storage;
use crate::{host, Error, Result, Runtime};
use stablehlo::DType;

fn p(name: &str, arg: RArg, out: bool) -> Param {
    Param {
        name: name.into(),
        arg,
        is_write: out,
        is_out: out,
    }
}

fn dims_arg(sizes: &[i64]) -> RArg {
    RArg::List(sizes.iter().map(|s| RArg::Int(*s)).collect())
}

fn dtype_of(t: &TensorRef) -> Result<DType> {
    t.dtype.ok_or_else(|| {
        Error::new(
            crate::ErrorKind::NotImplemented,
            "copy of a dtype the tpu device does not support",
        )
    })
}

/// `dst.copy_(src, non_blocking=True)` from the host: in Strict mode, a plain copy of a
/// dense CPU tensor into a fresh tpu tensor (what `.to("tpu", non_blocking=True)` makes) is
/// uploaded by the current stream's thread, so a copy issued on a side stream overlaps the
/// default stream's work; `host` owns the CPU tensor until then (as with CUDA's pinned
/// memory, the caller must not modify it before the stream has run the copy). Anything
/// else copies now.
pub fn copy_nonblocking(
    rt: &'static Runtime,
    src: &TensorRef,
    dst: &TensorRef,
    mut host: crate::worker::HostSource,
) -> Result<()> {
    let (sdt, ddt) = (dtype_of(src)?, dtype_of(dst)?);
    if let (Loc::Host(sp), Loc::Device(dp)) = (src.loc, dst.loc) {
        // SAFETY: handles from the shim point at live storages.
        let storage = unsafe { &*dp };
        let n = dst.nbytes / ddt.size() as i64;
        let fresh = !storage.is_lazy() && !storage.is_pending() && !storage.is_written();
        if crate::mode::get() == crate::mode::EagerMode::Strict
            && fresh
            && sdt == ddt
            && src.view.sizes == dst.view.sizes
            && src.view.is_contiguous()
            && dst.view.is_whole(n)
            && n > 0
        {
            // SAFETY: the view is contiguous inside the CPU storage PyTorch keeps alive
            // (`host` holds a reference until the job has read it).
            host.ptr = unsafe { sp.add((src.view.offset * sdt.size() as i64) as usize) };
            host.len = (n * ddt.size() as i64) as usize;
            // SAFETY: the shim's handle is alive for the call; the job keeps its own Arc.
            let target = unsafe { Storage::share(dp) };
            let device = dst.device;
            rt.worker.current().submit(move |seq| {
                target.mark_pending(seq);
                crate::worker::Job {
                    op: "aten::copy_ (non_blocking)".into(),
                    work: crate::worker::Work::Upload {
                        src: host,
                        dtype: ddt,
                        dims: vec![n],
                        device,
                    },
                    inputs: Vec::new(),
                    outputs: vec![(target, ddt)],
                    new_outputs: 0,
                    deps: Vec::new(),
                    padded: Vec::new(),
                }
            })?;
            return Ok(());
        }
    }
    drop(host);
    copy(rt, src, dst)
}

/// `dst.copy_(src)`: any mix of host and device, with dtype conversion and broadcasting.
pub fn copy(rt: &Runtime, src: &TensorRef, dst: &TensorRef) -> Result<()> {
    let (sdt, ddt) = (dtype_of(src)?, dtype_of(dst)?);
    if dst.view.numel() == 0 {
        return Ok(());
    }
    match (src.loc, dst.loc) {
        (Loc::Host(sp), Loc::Device(dp)) => {
            // SAFETY: handles from the shim point at live storages.
            let storage = unsafe { &*dp };
            let n = dst.nbytes / ddt.size() as i64;
            if sdt == ddt && src.view.sizes == dst.view.sizes && dst.view.is_whole(n) {
                // SAFETY: PyTorch keeps the source alive; its view lies in its storage, and
                // the upload has copied it before returning.
                let buf = match unsafe { host::contiguous_ref(sp, &src.view, sdt.size()) } {
                    Some(bytes) => rt.upload(bytes, ddt, &[n], dst.device)?,
                    None => {
                        // SAFETY: as above.
                        let bytes = unsafe { host::read(sp, &src.view, sdt.size()) };
                        rt.upload(&bytes, ddt, &[n], dst.device)?
                    }
                };
                storage.set(Arc::new(buf), ddt)?;
                return Ok(());
            }
            device_copy(rt, src, dst)
        }
        (Loc::Device(_), Loc::Device(dp)) if src.device != dst.device => {
            // Converted on the source device, moved by the plugin, then written into the
            // destination's view on its own device.
            let moved =
                Arc::new(rt.copy_to_device(&*dense(rt, src, ddt, &dst.view.sizes)?, dst.device)?);
            // SAFETY: handles from the shim point at live storages.
            let storage = unsafe { &*dp };
            if dst.view.is_whole(dst.nbytes / ddt.size() as i64) {
                return storage.set(moved, ddt);
            }
            let tmp = Storage::with_buffer(moved, ddt, dst.device).into_handle();
            let part = TensorRef {
                loc: Loc::Device(tmp),
                dtype: Some(ddt),
                view: View {
                    sizes: dst.view.sizes.clone(),
                    strides: lowering::shape::contiguous_strides(&dst.view.sizes),
                    offset: 0,
                },
                nbytes: dst.view.numel() * ddt.size() as i64,
                wrapped: false,
                device: dst.device,
            };
            let r = device_copy(rt, &part, dst);
            // SAFETY: drops the reference into_handle made; queued or deferred work holds
            // its own.
            drop(unsafe { Storage::from_handle(tmp) });
            r
        }
        (Loc::Device(_), Loc::Device(_)) => device_copy(rt, src, dst),
        (Loc::Device(_), Loc::Host(dp)) => {
            // A value read mid-capture can steer Python (sizes, slices of a grouped matmul's
            // offsets): even from an input's buffer, which needs no flush, a replay would
            // reuse the first call's choices.
            rt.defer.note_host_read(src.device);
            let buf = dense(rt, src, ddt, &dst.view.sizes)?;
            // SAFETY: the destination CPU tensor is alive, its view lies in its storage and
            // the download has finished writing it before returning.
            if let Some(out) = unsafe { host::contiguous(dp, &dst.view, ddt.size()) } {
                // Straight into the CPU tensor: `.cpu()` of a large tensor is one copy.
                return rt.download_into(&buf, out);
            }
            let bytes = rt.download(&buf)?;
            // SAFETY: as above.
            unsafe { host::write(dp, &dst.view, ddt.size(), &bytes) };
            Ok(())
        }
        (Loc::Host(_), Loc::Host(_)) => Err(Error::runtime(
            "copy between two CPU tensors reached the tpu backend",
        )),
    }
}

fn device_copy(rt: &Runtime, src: &TensorRef, dst: &TensorRef) -> Result<()> {
    let ddt = dtype_of(dst)?;
    let params = [
        p("self", RArg::Tensor(src.clone()), false),
        p("dtype", RArg::ScalarType(Some(ddt)), false),
        p("size", dims_arg(&dst.view.sizes), false),
        p("out", RArg::Tensor(dst.clone()), true),
    ];
    match dispatch(rt, "torch_pjrt::copy", "", &params)? {
        Outcome::Done(_) => Ok(()),
        Outcome::Declined(w) => Err(Error::runtime(format!("copy failed: {w}"))),
        Outcome::Resize(_) => Err(Error::runtime("copy: destination has the wrong shape")),
    }
}

/// `src` as a dense buffer of `dtype` and `sizes` on its device: its storage's own buffer
/// when that already is it, else a converted copy.
fn dense(rt: &Runtime, src: &TensorRef, dtype: DType, sizes: &[i64]) -> Result<Arc<pjrt::Buffer>> {
    let sdt = dtype_of(src)?;
    match src.storage() {
        Some(s)
            if sdt == dtype
                && src.view.sizes == sizes
                && src.view.is_whole(src.nbytes / sdt.size() as i64) =>
        {
            s.buffer_as(rt, sdt)
        }
        _ => converted(rt, src, dtype, sizes),
    }
}

/// `src` converted to `dtype` and broadcast to `sizes`, as a new contiguous device buffer.
fn converted(
    rt: &Runtime,
    src: &TensorRef,
    dtype: DType,
    sizes: &[i64],
) -> Result<Arc<pjrt::Buffer>> {
    let params = [
        p("self", RArg::Tensor(src.clone()), false),
        p("dtype", RArg::ScalarType(Some(dtype)), false),
        p("size", dims_arg(sizes), false),
    ];
    match dispatch(rt, "torch_pjrt::copy", "", &params)? {
        Outcome::Done(rets) => match rets.into_iter().next() {
            Some(Ret::Tensor { handle, .. }) => {
                // SAFETY: dispatch returns a fresh handle whose reference we now own.
                let s = unsafe { Storage::from_handle(handle) };
                let (buf, _) = s
                    .current()?
                    .ok_or_else(|| Error::runtime("copy produced no buffer"))?;
                Ok(buf)
            }
            _ => Err(Error::runtime("copy produced no tensor")),
        },
        Outcome::Declined(w) => Err(Error::runtime(format!("copy failed: {w}"))),
        Outcome::Resize(_) => Err(Error::runtime("copy: unexpected resize")),
    }
}

/// A scalar read back to the host (`.item()`).
pub enum Item {
    Int(i64),
    Float(f64),
    Bool(bool),
}

pub fn item(rt: &Runtime, t: &TensorRef) -> Result<Item> {
    let dt = dtype_of(t)?;
    if t.view.numel() != 1 {
        return Err(Error::runtime(format!(
            "a Tensor with {} elements cannot be converted to Scalar",
            t.view.numel()
        )));
    }
    let mut bytes = [0u8; 8];
    let dst = TensorRef {
        loc: Loc::Host(bytes.as_mut_ptr()),
        dtype: Some(dt),
        view: View {
            sizes: t.view.sizes.clone(),
            strides: vec![0; t.view.sizes.len()],
            offset: 0,
        },
        nbytes: dt.size() as i64,
        wrapped: false,
        device: 0,
    };
    copy(rt, t, &dst)?;
    Ok(match (dt, host::scalar(&bytes, dt)) {
        (DType::Bool, host::Scalar::Int(i)) => Item::Bool(i != 0),
        (_, host::Scalar::Int(i)) => Item::Int(i),
        (_, host::Scalar::Float(f)) => Item::Float(f),
        // The shim reads complex items through a host copy.
        (_, host::Scalar::Complex(..)) => {
            return Err(Error::runtime(
                "item(): complex values are read through .cpu()",
            ))
        }
    })
}

/// Allocator `copy_data`: raw bytes between two storages.
pub fn storage_copy(rt: &Runtime, dst: &Storage, src: &Storage, nbytes: i64) -> Result<()> {
    let mut bytes = src.bytes(rt)?;
    bytes.truncate(nbytes as usize);
    let mut d = dst.bytes(rt)?;
    d[..bytes.len()].copy_from_slice(&bytes);
    dst.set_bytes(rt, &d)
}

/// Host memory that XLA's CPU buffers hold can be handed to host code (Gloo, in the c10d
/// backend) without a copy; these two return None/false elsewhere and the caller copies.
///
/// The flat buffer holding `t`'s storage as `t`'s dtype, once computed, and the address of
/// its first byte: a reader of the bytes keeps the buffer, so no later op donates it. With
/// `writable`, only a buffer nothing else holds once the work queued before has run (the
/// writer changes the storage's value in place, as an in-place op would).
pub fn host_alias(
    rt: &Runtime,
    t: &TensorRef,
    writable: bool,
) -> Result<Option<(Arc<pjrt::Buffer>, *mut u8)>> {
    let Loc::Device(sp) = t.loc else {
        return Ok(None);
    };
    if !rt.cpu_plugin {
        return Ok(None);
    }
    let dtype = dtype_of(t)?;
    rt.defer.note_host_read(t.device);
    // SAFETY: handles from the shim point at live storages.
    let storage = unsafe { &*sp };
    if writable && storage.current()?.is_none() {
        return Ok(None); // never written: no buffer to write into
    }
    let buf = storage.buffer_as(rt, dtype)?;
    if buf.dims() != [storage.nbytes() / dtype.size() as i64] {
        return Ok(None);
    }
    if writable {
        // Queued jobs and a pending graph that read the old value run first; the list of
        // executions whose failure a sync would report no longer needs this one.
        storage.before_write()?;
        rt.untrack(&buf)?;
        let same = storage
            .current()?
            .is_some_and(|(b, _)| Arc::ptr_eq(&b, &buf));
        // The storage's reference and ours: nothing else reads or donates it.
        if !same || Arc::strong_count(&buf) != 2 {
            return Ok(None);
        }
    }
    let ptr = buf.device_pointer()?;
    Ok(Some((buf, ptr)))
}

/// Makes `len` bytes at `data` the value of `dst`, without a copy, where buffers are host
/// memory and `dst` is its whole storage, dense, of the same size (else false, and the
/// caller copies). `release` runs once the device no longer reads the memory (at once when
/// false); until then the caller keeps it alive and unchanged.
pub fn adopt_host(
    rt: &Runtime,
    dst: &TensorRef,
    data: *mut u8,
    len: usize,
    release: Box<dyn FnOnce() + Send>,
) -> Result<bool> {
    let Loc::Device(dp) = dst.loc else {
        release();
        return Ok(false);
    };
    let dtype = dtype_of(dst)?;
    let n = dst.nbytes / dtype.size() as i64;
    // XLA:CPU's kernels assume aligned buffers (PyTorch's CPU allocator gives 64 bytes).
    if !rt.cpu_plugin
        || !dst.view.is_whole(n)
        || len as i64 != dst.nbytes
        || !(data as usize).is_multiple_of(64)
    {
        release();
        return Ok(false);
    }
    let buf =
        rt.client
            .view_host_memory(data, crate::dtype_to_pjrt(dtype), &[n], dst.device, release)?;
    // SAFETY: handles from the shim point at live storages.
    unsafe { &*dp }.set(Arc::new(buf), dtype)?;
    Ok(true)
}
