//! Device storages: what a tpu tensor's DataPtr points at.
//!
//! A storage is a byte size plus (once written) one flat PJRT buffer of some element type.
//! PJRT buffers are immutable, so a write swaps the buffer; views and in-place ops keep
//! PyTorch's semantics because every tensor sharing the storage sees the swap.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use stablehlo::DType;

use crate::{Error, Result, Runtime};

pub struct Storage {
    pub device: usize,
    inner: Mutex<Inner>,
    /// Its current value is pending in the device's deferred graph (DeferAndFuse).
    lazy: AtomicBool,
    /// The Strict worker's job that writes its next value (0: none pending).
    pending: AtomicU64,
}

struct Inner {
    nbytes: i64,
    /// The flat buffer and its element type; None until first written.
    buf: Option<(Arc<pjrt::Buffer>, DType)>,
    /// The failure of the async op that should have written it.
    poison: Option<Error>,
}

impl Storage {
    pub fn new(nbytes: i64, device: usize) -> Storage {
        Storage {
            device,
            inner: Mutex::new(Inner {
                nbytes,
                buf: None,
                poison: None,
            }),
            lazy: AtomicBool::new(false),
            pending: AtomicU64::new(0),
        }
    }

    pub fn with_buffer(buf: Arc<pjrt::Buffer>, dtype: DType, device: usize) -> Storage {
        let n = buf.dims().iter().product::<i64>() * dtype.size() as i64;
        Storage {
            device,
            inner: Mutex::new(Inner {
                nbytes: n,
                buf: Some((buf, dtype)),
                poison: None,
            }),
            lazy: AtomicBool::new(false),
            pending: AtomicU64::new(0),
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

    pub fn is_lazy(&self) -> bool {
        self.lazy.load(Ordering::Acquire)
    }

    pub(crate) fn mark_lazy(&self) {
        self.lazy.store(true, Ordering::Release);
    }

    /// A worker job will write its next value.
    pub(crate) fn is_pending(&self) -> bool {
        self.pending.load(Ordering::Acquire) != 0
    }

    /// Its next value comes from the worker's job `seq`.
    pub(crate) fn mark_pending(&self, seq: u64) {
        self.pending.store(seq, Ordering::Release);
    }

    /// The worker's job `seq` produced the value.
    pub(crate) fn fill(&self, seq: u64, buf: Arc<pjrt::Buffer>, dtype: DType) {
        {
            let mut g = self.lock();
            g.buf = Some((buf, dtype));
            g.poison = None;
        }
        self.unpend(seq);
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
    fn before_write(&self) -> Result<()> {
        if self.is_lazy() {
            crate::get()?.flush(self.device, "read")?;
        }
        let rt = crate::get()?;
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
        Ok(self.lock().buf.clone())
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
        let bytes = match &g.buf {
            Some((b, _)) => rt.download(b)?,
            None => vec![0u8; n as usize],
        };
        let buf = Arc::new(rt.upload(&bytes, dtype, &[n / dtype.size() as i64], self.device)?);
        g.buf = Some((buf.clone(), dtype));
        Ok(buf)
    }

    /// Replaces the contents (the buffer must hold exactly nbytes).
    pub fn set(&self, buf: Arc<pjrt::Buffer>, dtype: DType) -> Result<()> {
        self.before_write()?;
        let mut g = self.lock();
        g.buf = Some((buf, dtype));
        Ok(())
    }

    /// The raw bytes (host copy), zero if never written.
    pub fn bytes(&self, rt: &Runtime) -> Result<Vec<u8>> {
        let cur = self.current()?;
        let n = self.nbytes() as usize;
        match cur {
            Some((b, _)) => {
                let mut v = rt.download(&b)?;
                v.resize(n, 0);
                Ok(v)
            }
            None => Ok(vec![0u8; n]),
        }
    }

    /// Stores raw bytes as u8 elements (the next typed reader re-types them).
    pub fn set_bytes(&self, rt: &Runtime, bytes: &[u8]) -> Result<()> {
        self.before_write()?;
        let n = bytes.len() as i64;
        let buf = Arc::new(rt.upload(bytes, DType::U8, &[n], self.device)?);
        let mut g = self.lock();
        g.nbytes = n;
        g.buf = Some((buf, DType::U8));
        Ok(())
    }

    /// Resizes to `nbytes`, keeping the common prefix.
    pub fn resize(&self, rt: &Runtime, nbytes: i64) -> Result<()> {
        let old = self.nbytes();
        if nbytes == old {
            return Ok(());
        }
        if self.current()?.is_none() {
            self.lock().nbytes = nbytes;
            return Ok(());
        }
        let mut bytes = self.bytes(rt)?;
        bytes.resize(nbytes as usize, 0);
        self.set_bytes(rt, &bytes)
    }
}
