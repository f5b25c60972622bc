//! Device storages: what a tpu tensor's DataPtr points at.
//!
//! A storage is a byte size plus (once written) one flat PJRT buffer of some element type.
//! PJRT buffers are immutable, so a write swaps the buffer; views and in-place ops keep
//! PyTorch's semantics because every tensor sharing the storage sees the swap.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use stablehlo::DType;

use crate::{memory, Error, ErrorKind, Result, Runtime};

thread_local! {
    /// While a job is being queued: the pending marks its outputs replaced.
    static MARKS: std::cell::RefCell<Option<Vec<u64>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` (which queues a job and marks its outputs pending), returning its result and
/// the earlier jobs whose pending marks it replaced.
pub(crate) fn collect_marks<T>(f: impl FnOnce() -> T) -> (T, Vec<u64>) {
    MARKS.with(|m| *m.borrow_mut() = Some(Vec::new()));
    let r = f();
    let prev = MARKS.with(|m| m.borrow_mut().take()).unwrap_or_default();
    (r, prev)
}

pub struct Storage {
    pub device: usize,
    /// Unique for the process (addresses are reused): tells tensors that persist across
    /// calls (parameters) from fresh ones (see `buckets`).
    pub id: u64,
    inner: Mutex<Inner>,
    /// Its current value is pending in the device's deferred graph (DeferAndFuse).
    lazy: AtomicBool,
    /// The Strict worker's job that writes its next value (0: none pending).
    pending: AtomicU64,
    /// Its bytes count in `memory` (from creation until PyTorch lets go of it or it drops:
    /// a deferred graph may keep a dead tensor's storage until it runs).
    counted: AtomicBool,
}

struct Inner {
    nbytes: i64,
    /// The flat buffer and its element type; None until first written.
    buf: Option<(Arc<pjrt::Buffer>, DType)>,
    /// The failure of the async op that should have written it.
    poison: Option<Error>,
    /// `buf` is a bucketed program's result in its padded layout (see `buckets::Padded`).
    /// Readers other than bucketed programs get it compacted (`buffer_now`, `current`).
    padded: Option<crate::buckets::Padded>,
    /// Dtype and layout of the padded buffer the last queued write leaves (None: exact), so
    /// that the next op's key can name it. Queue-time state only: the worker compacting the
    /// buffer for an exact reader leaves it, or a later op's program would depend on how far
    /// the worker got (`buckets::padded_input` pads a compacted buffer again).
    layout: Option<(DType, crate::buckets::Padded)>,
}

fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Storage {
    /// A storage of `nbytes` on `device`, or an out-of-memory error if the device cannot
    /// hold it (see `memory::admit`); nothing is allocated until it is first written.
    pub fn alloc(nbytes: i64, device: usize) -> Result<Storage> {
        memory::admit(device, nbytes)?;
        Ok(Storage::new(nbytes, device))
    }

    /// A storage counted without admission (its bytes are accounted for elsewhere, or the
    /// caller checked them).
    pub fn new(nbytes: i64, device: usize) -> Storage {
        memory::on_alloc(device, nbytes);
        Storage {
            device,
            id: next_id(),
            inner: Mutex::new(Inner {
                nbytes,
                buf: None,
                poison: None,
                padded: None,
                layout: None,
            }),
            lazy: AtomicBool::new(false),
            pending: AtomicU64::new(0),
            counted: AtomicBool::new(true),
        }
    }

    pub fn with_buffer(buf: Arc<pjrt::Buffer>, dtype: DType, device: usize) -> Storage {
        let n = buf.dims().iter().product::<i64>();
        Self::with_layout(buf, dtype, device, crate::buckets::Padded::exact(n))
    }

    /// A storage holding `buf` in `layout` (a bucketed program's padded result).
    pub(crate) fn with_layout(
        buf: Arc<pjrt::Buffer>,
        dtype: DType,
        device: usize,
        layout: crate::buckets::Padded,
    ) -> Storage {
        let n = layout.real.iter().product::<i64>() * dtype.size() as i64;
        let padded = (!layout.is_exact()).then_some(layout);
        memory::on_alloc(device, n);
        Storage {
            device,
            id: next_id(),
            inner: Mutex::new(Inner {
                nbytes: n,
                buf: Some((buf, dtype)),
                poison: None,
                layout: padded.clone().map(|p| (dtype, p)),
                padded,
            }),
            lazy: AtomicBool::new(false),
            pending: AtomicU64::new(0),
            counted: AtomicBool::new(true),
        }
    }

    /// Hands the storage to PyTorch: the handle a DataPtr holds (one reference).
    pub fn into_handle(self) -> *mut Storage {
        Arc::into_raw(Arc::new(self)) as *mut Storage
    }

    /// Takes back the reference a handle holds.
    ///
    /// # Safety
    /// `h` comes from `into_handle` and its reference was not taken back before.
    pub unsafe fn from_handle(h: *const Storage) -> Arc<Storage> {
        // SAFETY: per the contract, `h` is an `Arc::into_raw` pointer with a live reference.
        unsafe { Arc::from_raw(h) }
    }

    /// A new reference to a live handle's storage (the handle keeps its own).
    ///
    /// # Safety
    /// `h` comes from `into_handle` and is still alive.
    pub unsafe fn share(h: *const Storage) -> Arc<Storage> {
        // SAFETY: per the contract; the count goes up before the new Arc is made.
        unsafe {
            Arc::increment_strong_count(h);
            Arc::from_raw(h)
        }
    }

    /// PyTorch freed its tensor storage: its bytes no longer count (once).
    pub fn uncount(&self) {
        if self.counted.swap(false, Ordering::AcqRel) {
            memory::on_free(self.device, self.nbytes());
        }
    }

    fn resized(&self, old: i64, new: i64) {
        if self.counted.load(Ordering::Acquire) {
            memory::on_resize(self.device, old, new);
        }
    }

    pub fn is_lazy(&self) -> bool {
        self.lazy.load(Ordering::Acquire)
    }

    pub(crate) fn mark_lazy(&self) {
        self.lazy.store(true, Ordering::Release);
    }

    /// The (tagged) number of the worker job that writes its next value, 0 if none.
    pub(crate) fn pending_seq(&self) -> u64 {
        self.pending.load(Ordering::Acquire)
    }

    /// A worker job will write its next value.
    pub(crate) fn is_pending(&self) -> bool {
        self.pending.load(Ordering::Acquire) != 0
    }

    /// Its next value comes from the worker's job `seq`.
    pub(crate) fn mark_pending(&self, seq: u64) {
        // An exact write unless the queuing op says otherwise (`will_pack`).
        self.lock().layout = None;
        let prev = self.pending.swap(seq, Ordering::AcqRel);
        if prev != 0 {
            MARKS.with(|m| {
                if let Some(v) = m.borrow_mut().as_mut() {
                    v.push(prev);
                }
            });
        }
    }

    /// The worker's job `seq` produced the value.
    pub(crate) fn fill(&self, seq: u64, buf: Arc<pjrt::Buffer>, dtype: DType) {
        self.fill_as(seq, buf, dtype, None);
    }

    /// `fill` with a bucketed program's padded result (see `Inner::padded`).
    pub(crate) fn fill_as(
        &self,
        seq: u64,
        buf: Arc<pjrt::Buffer>,
        dtype: DType,
        padded: Option<crate::buckets::Padded>,
    ) {
        {
            let mut g = self.lock();
            g.buf = Some((buf, dtype));
            g.poison = None;
            g.padded = padded;
        }
        self.unpend(seq);
    }

    /// A queued bucketed program will write a padded buffer of `dtype` and `layout`.
    pub(crate) fn will_pad(&self, dtype: DType, layout: crate::buckets::Padded) {
        self.lock().layout = Some((dtype, layout));
    }

    /// Dtype and layout of its padded buffer (held or coming), None if exact.
    pub(crate) fn padded_layout(&self) -> Option<(DType, crate::buckets::Padded)> {
        self.lock().layout.clone()
    }

    /// The worker's padded buffer, if it still holds one of `layout` and `dtype`.
    pub(crate) fn padded_now(
        &self,
        dtype: DType,
        layout: &crate::buckets::Padded,
    ) -> Option<Arc<pjrt::Buffer>> {
        let g = self.lock();
        match (&g.buf, &g.padded) {
            (Some((b, d)), Some(p)) if *d == dtype && p == layout => Some(b.clone()),
            _ => None,
        }
    }

    /// Replaces a padded buffer by its real elements, as a flat buffer of its own.
    fn unpack(&self, rt: &Runtime, g: &mut Inner) -> Result<()> {
        let (Some((b, d)), Some(p)) = (g.buf.clone(), g.padded.clone()) else {
            return Ok(());
        };
        let exact = crate::buckets::unpadded(rt, &b, d, &p)?;
        g.buf = Some((exact, d));
        g.padded = None;
        Ok(())
    }

    /// The worker's job `seq` failed: readers get its error instead of a value.
    pub(crate) fn poison(&self, seq: u64, e: &Error) {
        self.lock().poison = Some(e.clone());
        self.unpend(seq);
    }

    /// The worker's job `seq` is done with it (a failed check: it keeps its value).
    pub(crate) fn unpend(&self, seq: u64) {
        let _ = self
            .pending
            .compare_exchange(seq, 0, Ordering::AcqRel, Ordering::Acquire);
    }

    pub(crate) fn poisoned(&self) -> Option<Error> {
        self.lock().poison.clone()
    }

    /// Waits until the value is computed: runs the pending graph if it is in one, waits
    /// for the worker's job if one writes it.
    fn settle(&self) -> Result<()> {
        if self.is_lazy() {
            crate::get()?.flush_read(self.device, self as *const Storage as usize)?;
        }
        let seq = self.pending.load(Ordering::Acquire);
        if seq != 0 {
            crate::get()?.worker.wait_for(seq);
        }
        // A compiled graph's out-of-range index must not go unnoticed past a host read.
        crate::get()?.verify_checks()?;
        match self.poisoned() {
            Some(e) => {
                crate::get()?.worker.reported(&e);
                Err(e)
            }
            None => crate::get()?.worker.take_error(),
        }
    }

    /// Before the Python thread replaces the contents: queued jobs may still read them.
    pub(crate) fn before_write(&self) -> Result<()> {
        let rt = crate::get()?;
        if rt.defer.write_flushes(self) {
            rt.flush(self.device, "write of a graph input")?;
        }
        rt.worker.drain();
        rt.defer.read_later_inputs(rt, self.device);
        self.lock().poison = None;
        Ok(())
    }

    /// Drops the pending mark of a traced value that nobody will read.
    pub(crate) fn clear_lazy(&self) {
        self.lazy.store(false, Ordering::Release);
    }

    /// Stores a flushed graph's output (the graph holds its lock).
    pub(crate) fn set_flushed(&self, buf: Arc<pjrt::Buffer>, dtype: DType) {
        {
            let mut g = self.lock();
            g.buf = Some((buf, dtype));
            g.poison = None;
            g.padded = None;
            g.layout = None;
        }
        self.lazy.store(false, Ordering::Release);
    }

    /// Whether it holds a value (a buffer), pending writes aside.
    pub(crate) fn is_written(&self) -> bool {
        self.lock().buf.is_some()
    }

    /// A flushed graph failed before producing its value: readers get the error.
    pub(crate) fn fail_flushed(&self, e: &Error) {
        self.lock().poison = Some(e.clone());
        self.lazy.store(false, Ordering::Release);
    }

    pub fn nbytes(&self) -> i64 {
        self.lock().nbytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock only means another thread panicked mid-update; the data is a
        // plain Option swap, so it is still consistent.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The buffer and its dtype, if written.
    pub fn current(&self) -> Result<Option<(Arc<pjrt::Buffer>, DType)>> {
        self.settle()?;
        let mut g = self.lock();
        self.unpack(crate::get()?, &mut g)?;
        Ok(g.buf.clone())
    }

    /// The flat buffer viewed as `dtype`: re-typed through the host if the storage holds
    /// another element type, zeros if never written.
    pub fn buffer_as(&self, rt: &Runtime, dtype: DType) -> Result<Arc<pjrt::Buffer>> {
        self.settle()?;
        self.buffer_now(rt, dtype)
    }

    /// `buffer_as` for the worker, whose queue order already settled the value.
    pub(crate) fn buffer_now(&self, rt: &Runtime, dtype: DType) -> Result<Arc<pjrt::Buffer>> {
        let mut g = self.lock();
        self.unpack(rt, &mut g)?;
        if let Some((b, d)) = &g.buf {
            if *d == dtype {
                return Ok(b.clone());
            }
        }
        let n = g.nbytes;
        if n % dtype.size() as i64 != 0 {
            return Err(Error::runtime(format!(
                "storage of {n} bytes cannot be viewed as {dtype:?} elements"
            )));
        }
        let elems = n / dtype.size() as i64;
        let buf = match &g.buf {
            Some((b, _)) => {
                let bytes = rt.download(b)?;
                rt.upload(&bytes, dtype, &[elems], self.device)?
            }
            None => rt.zeros(dtype, elems, self.device)?,
        };
        let buf = Arc::new(buf);
        g.buf = Some((buf.clone(), dtype));
        Ok(buf)
    }

    /// Replaces the contents (the buffer must hold exactly nbytes).
    pub fn set(&self, buf: Arc<pjrt::Buffer>, dtype: DType) -> Result<()> {
        self.set_as(buf, dtype, None)
    }

    /// `set` with a bucketed program's padded result (`padded`: its layout, None if exact).
    pub(crate) fn set_as(
        &self,
        buf: Arc<pjrt::Buffer>,
        dtype: DType,
        padded: Option<crate::buckets::Padded>,
    ) -> Result<()> {
        self.before_write()?;
        let mut g = self.lock();
        g.buf = Some((buf, dtype));
        g.layout = padded.clone().map(|p| (dtype, p));
        g.padded = padded;
        Ok(())
    }

    /// The raw bytes (host copy), zero if never written.
    pub fn bytes(&self, rt: &Runtime) -> Result<Vec<u8>> {
        let cur = self.current()?;
        let n = self.nbytes() as usize;
        match cur {
            Some((b, _)) => {
                let mut v = rt.download(&b)?;
                host_resize(&mut v, n)?;
                Ok(v)
            }
            None => {
                let mut v = Vec::new();
                host_resize(&mut v, n)?;
                Ok(v)
            }
        }
    }

    /// Stores raw bytes as u8 elements (the next typed reader re-types them).
    pub fn set_bytes(&self, rt: &Runtime, bytes: &[u8]) -> Result<()> {
        self.before_write()?;
        let n = bytes.len() as i64;
        let buf = Arc::new(rt.upload(bytes, DType::U8, &[n], self.device)?);
        let mut g = self.lock();
        self.resized(g.nbytes, n);
        g.nbytes = n;
        g.buf = Some((buf, DType::U8));
        g.padded = None;
        g.layout = None;
        Ok(())
    }

    /// Resizes to `nbytes`, keeping the common prefix.
    pub fn resize(&self, rt: &Runtime, nbytes: i64) -> Result<()> {
        let old = self.nbytes();
        if nbytes == old {
            return Ok(());
        }
        if nbytes > old {
            memory::admit(self.device, nbytes - old)?;
        }
        if self.current()?.is_none() {
            let mut g = self.lock();
            self.resized(g.nbytes, nbytes);
            g.nbytes = nbytes;
            return Ok(());
        }
        let mut bytes = self.bytes(rt)?;
        host_resize(&mut bytes, nbytes as usize)?;
        self.set_bytes(rt, &bytes)
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        self.uncount();
    }
}

/// Resizes a host copy, zero-filling, with an out-of-memory error instead of an abort when
/// the host cannot hold it.
pub(crate) fn host_resize(v: &mut Vec<u8>, n: usize) -> Result<()> {
    if n > v.len() {
        v.try_reserve_exact(n - v.len()).map_err(|_| {
            Error::new(
                ErrorKind::OutOfMemory,
                format!("tpu out of memory: cannot make a host copy of {n} bytes"),
            )
        })?;
    }
    v.resize(n, 0);
    Ok(())
}
