//! Strict mode's asynchrony: ops are executed by worker threads, one per stream, each in the
//! order Python issued them, while the Python thread goes on dispatching.
//!
//! Streams (`Streams`): stream 0 is every device's default stream; `torch.tpu.Stream`s
//! share a pool of side streams. A job's sequence number carries its stream in the high
//! bits (`tag`), so a pending storage says which stream's job fills it. A job that reads a
//! storage another stream is still computing waits for that job before it runs (the
//! dependency is taken when the job is queued, so it only ever waits for earlier work):
//! unlike CUDA, a missing `wait_stream` never reads garbage. Events are jobs too: a marker
//! that records when the stream's earlier work finished (`Work::Mark`), and a wait for
//! another stream's marker (`Work::Wait`).
//!
//! An op's output storages are "pending" (they carry the sequence number of the job that
//! fills them) until the worker has run it. The Python thread waits only where it needs a
//! value: reading a pending storage waits for its job, replacing a storage's contents from
//! the Python thread waits for every queued job (one of them may still read the old
//! contents), `synchronize()` waits for all and raises the first failure. A failed job
//! poisons its outputs, so the jobs that read them are skipped, not run on garbage.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use stablehlo::DType;

use crate::storage::Storage;
use crate::{Error, Result};

/// One input of a job: a buffer known at dispatch, or a storage read when the job runs.
pub(crate) enum JobIn {
    Buf(Arc<pjrt::Buffer>),
    Storage(Arc<Storage>, DType),
    /// A staged input of a bucketed program: the storage's view, laid out in the padded
    /// dims when the job runs (see `buckets::stage`).
    Staged(Arc<Storage>, DType, crate::layout::View, Vec<i64>),
    /// The padded buffer (of this layout) a bucketed program left in a storage.
    Padded(Arc<Storage>, DType, crate::buckets::Padded),
}

/// Host memory a queued upload reads; the owner (the shim's reference to the CPU tensor)
/// is released when the job is done with it.
pub struct HostSource {
    pub ptr: *const u8,
    pub len: usize,
    pub keep: *mut std::ffi::c_void,
    pub release: Option<unsafe extern "C" fn(*mut std::ffi::c_void)>,
}

// SAFETY: the memory and its owner are handed over to the job; nothing else uses them
// until `release` runs (once, on drop).
unsafe impl Send for HostSource {}

impl Drop for HostSource {
    fn drop(&mut self) {
        if let Some(f) = self.release {
            // SAFETY: the shim's release function for `keep`, called exactly once.
            unsafe { f(self.keep) }
        }
    }
}

/// When a stream reached an event: set by the worker that runs the marker.
#[derive(Default)]
pub struct Mark {
    /// Nanoseconds since the process's first mark; 0 until reached.
    nanos: AtomicU64,
}

impl Mark {
    pub fn reached(&self) -> Option<u64> {
        match self.nanos.load(Ordering::Acquire) {
            0 => None,
            n => Some(n),
        }
    }

    pub(crate) fn set_now(&self) {
        static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        let t0 = *START.get_or_init(std::time::Instant::now);
        let n = t0.elapsed().as_nanos() as u64;
        self.nanos.store(n.max(1), Ordering::Release);
    }
}

/// What a job runs.
pub(crate) enum Work {
    /// A host-to-device copy (`non_blocking=True`): uploads on the stream's thread.
    Upload {
        src: HostSource,
        dtype: DType,
        dims: Vec<i64>,
        device: usize,
    },
    /// An event: records the time once the stream's earlier work has finished.
    Mark(Arc<Mark>),
    /// Waits for another stream's job (Event.wait, Stream.wait_stream).
    Wait(u64),
    /// One op's program (its outputs say which results are checks).
    Op(Arc<crate::exec::Program>),
    /// A compiled graph or the queued part of a deferred one: its inputs at `aliased` are
    /// donated when nothing but their storage holds them; `checks` are its results after
    /// the storages' ones. `precheck` computes only the checks: run first when donating,
    /// so that a failed check leaves the donated inputs' values intact.
    Graph {
        exe: Arc<pjrt::Executable>,
        aliased: Vec<usize>,
        checks: Vec<(crate::ErrorKind, String)>,
        precheck: Option<Arc<pjrt::Executable>>,
    },
}

pub(crate) struct Job {
    pub op: String,
    pub work: Work,
    pub inputs: Vec<JobIn>,
    /// Where each program output goes, in order: new tensors first, then in-place
    /// targets; the program's check outputs (if any) follow.
    pub outputs: Vec<(Arc<Storage>, DType)>,
    /// How many of `outputs` are new tensors.
    pub new_outputs: usize,
    /// Jobs of other streams it must wait for (filled by `Worker::submit`).
    pub deps: Vec<u64>,
    /// A bucketed program's results: the layout of each (new tensors, then targets) in
    /// its buffer. Empty otherwise.
    pub padded: Vec<crate::buckets::ResultLayout>,
}

/// A sequence number tagged with its stream.
pub(crate) fn tag(stream: usize, local: u64) -> u64 {
    ((stream as u64) << STREAM_SHIFT) | local
}

const STREAM_SHIFT: u32 = 48;

fn untag(seq: u64) -> (usize, u64) {
    (
        (seq >> STREAM_SHIFT) as usize,
        seq & ((1 << STREAM_SHIFT) - 1),
    )
}

impl Job {
    /// The device its program runs on (None for markers and waits).
    fn device(&self) -> Option<usize> {
        match &self.work {
            Work::Op(p) => Some(p.device),
            Work::Graph { exe, .. } => Some(exe.device()),
            Work::Upload { device, .. } => Some(*device),
            Work::Mark(_) | Work::Wait(_) => None,
        }
    }

    /// A failed check's error, naming the op (a graph's checks already name theirs).
    fn found(&self, e: Error) -> Error {
        match self.work {
            Work::Op(_) => Error::new(e.kind, crate::exec::checked_by(&e.msg, &self.op)),
            _ => e,
        }
    }
}

struct State {
    /// Queued jobs with their trace data (when the profiler's trace is on).
    jobs: VecDeque<(u64, Job, Option<crate::trace::Queued>)>,
    enqueued: u64,
    /// The first failure not yet reported by `synchronize`.
    error: Option<Error>,
    started: bool,
}

pub struct Worker {
    /// Its stream: the tag of its sequence numbers.
    index: usize,
    state: Mutex<State>,
    work: Condvar,
    finished: Condvar,
    /// Highest (untagged) sequence number the worker has completed.
    done: AtomicU64,
    sleeping: AtomicBool,
    /// The outputs of the last job it ran (a marker waits for them to be computed). Weak:
    /// holding them would keep the next job from donating them.
    last: Mutex<Vec<std::sync::Weak<pjrt::Buffer>>>,
}

/// Jobs in flight before the Python thread waits (bounds memory held by the queue).
const MAX_IN_FLIGHT: u64 = 2048;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Worker {
    fn new(index: usize) -> Self {
        Worker {
            index,
            last: Mutex::new(Vec::new()),
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                enqueued: 0,
                error: None,
                started: false,
            }),
            work: Condvar::new(),
            finished: Condvar::new(),
            done: AtomicU64::new(0),
            sleeping: AtomicBool::new(false),
        }
    }

    /// Queues the job `make(seq)` builds (`seq` tagged with the stream); it marks its
    /// outputs pending with `seq` before the worker can see it.
    pub(crate) fn submit(&'static self, make: impl FnOnce(u64) -> Job) -> Result<u64> {
        let mut st = lock(&self.state);
        if !st.started {
            let name = match self.index {
                0 => "tpu-worker".to_string(),
                i => format!("tpu-stream-{i}"),
            };
            std::thread::Builder::new()
                .name(name)
                .spawn(move || self.run())
                .map_err(|e| Error::runtime(format!("cannot start the tpu worker: {e}")))?;
            st.started = true;
        }
        let local = st.enqueued + 1;
        let seq = tag(self.index, local);
        // Writers of its inputs on other streams, as queued before it (the marks it
        // replaces on its outputs included): waiting only for earlier jobs cannot deadlock.
        let prev = crate::storage::collect_marks(|| make(seq));
        let (mut job, mut deps) = prev;
        for i in &job.inputs {
            if let JobIn::Storage(s, _) | JobIn::Staged(s, ..) | JobIn::Padded(s, ..) = i {
                deps.push(s.pending_seq());
            }
        }
        deps.retain(|d| *d != 0 && untag(*d).0 != self.index);
        deps.sort_unstable();
        deps.dedup();
        job.deps = deps;
        st.enqueued = local;
        st.jobs.push_back((seq, job, crate::trace::queued()));
        drop(st);
        if self.sleeping.load(Ordering::Acquire) {
            self.work.notify_one();
        }
        let done = self.done.load(Ordering::Acquire);
        if local.saturating_sub(done) > MAX_IN_FLIGHT {
            self.wait_local(local - MAX_IN_FLIGHT / 2);
        }
        Ok(seq)
    }

    /// Whether every job queued so far has run.
    pub(crate) fn idle(&self) -> bool {
        self.done.load(Ordering::Acquire) >= lock(&self.state).enqueued
    }

    /// Queues a graph program whose results go to `targets` (the first `new_outputs` are
    /// new tensors, the others in-place targets): they are pending until it has run.
    pub(crate) fn submit_graph(
        &'static self,
        op: &str,
        work: Work,
        inputs: Vec<JobIn>,
        targets: Vec<(Arc<Storage>, DType)>,
        new_outputs: usize,
    ) -> Result<()> {
        self.submit(|seq| {
            for (s, _) in &targets {
                s.mark_pending(seq);
            }
            Job {
                op: op.to_string(),
                work,
                inputs,
                new_outputs,
                outputs: targets,
                deps: Vec::new(),
                padded: Vec::new(),
            }
        })
        .map(|_| ())
    }

    /// Waits until its job number `seq` (untagged) has run.
    fn wait_local(&self, seq: u64) {
        // A short spin first: most waits are for a job that is just finishing.
        for _ in 0..2000 {
            if self.done.load(Ordering::Acquire) >= seq {
                return;
            }
            std::hint::spin_loop();
        }
        let mut st = lock(&self.state);
        while self.done.load(Ordering::Acquire) < seq {
            st = self.finished.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Waits for every job queued so far.
    pub fn drain(&self) {
        let last = lock(&self.state).enqueued;
        if self.done.load(Ordering::Acquire) < last {
            self.wait_local(last);
        }
    }

    /// A host read already raised `e` (a failed job's poisoned output): the next
    /// synchronization does not raise it again, nor the same error found by another op
    /// (one call can run several ops that check the same data).
    fn reported(&self, e: &Error) {
        let first = |m: &str| m.lines().next().unwrap_or("").to_string();
        let mut st = lock(&self.state);
        if st
            .error
            .as_ref()
            .is_some_and(|x| first(&x.msg) == first(&e.msg))
        {
            st.error = None;
        }
    }

    fn take_first_error(&self) -> Option<Error> {
        lock(&self.state).error.take()
    }

    fn next_job(&self) -> (u64, Job, Option<crate::trace::Queued>) {
        // Spin briefly before sleeping: the Python thread usually queues the next op within
        // microseconds, and a futex wake-up costs more than that.
        for _ in 0..1_000 {
            if let Ok(mut st) = self.state.try_lock() {
                if let Some(j) = st.jobs.pop_front() {
                    return j;
                }
            }
            std::hint::spin_loop();
        }
        let mut st = lock(&self.state);
        loop {
            if let Some(j) = st.jobs.pop_front() {
                self.sleeping.store(false, Ordering::Release);
                return j;
            }
            self.sleeping.store(true, Ordering::Release);
            st = self.work.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn run(&self) {
        loop {
            let (seq, job, traced) = self.next_job();
            let start = crate::trace::now();
            let r = self.execute(seq, &job);
            if let (Some(q), Ok(()), Some(device)) = (traced, &r, job.device()) {
                let outs: Vec<Arc<pjrt::Buffer>> = lock(&self.last)
                    .iter()
                    .filter_map(|w| w.upgrade())
                    .collect();
                let q = match &job.work {
                    // Compiled on the pool: its first run reports the compilation.
                    Work::Op(p) => p.traced(q),
                    _ => q,
                };
                crate::trace::finish(&job.op, device, self.index, q, start, &outs);
            }
            if let Err(e) = r {
                for (s, _) in &job.outputs {
                    s.poison(seq, &e);
                }
                let mut st = lock(&self.state);
                st.error.get_or_insert(e);
            }
            drop(job);
            self.done.store(untag(seq).1, Ordering::Release);
            let _g = lock(&self.state);
            self.finished.notify_all();
        }
    }

    fn execute(&self, seq: u64, job: &Job) -> Result<()> {
        let rt = crate::get()?;
        let failed =
            |msg: String| Error::runtime(format!("{} failed on the tpu device: {msg}", job.op));
        if let Some(msg) = injected_failure(&job.op) {
            return Err(Error::runtime(msg));
        }
        match &job.work {
            Work::Mark(m) => {
                let last = std::mem::take(&mut *lock(&self.last));
                for b in last.iter().filter_map(|w| w.upgrade()) {
                    // A failed buffer is reported by its op; the marker only needs it done.
                    let _ = b.ready();
                }
                m.set_now();
                return Ok(());
            }
            Work::Wait(other) => {
                rt.worker.wait_for(*other);
                return Ok(());
            }
            Work::Upload {
                src,
                dtype,
                dims,
                device,
            } => {
                // SAFETY: the shim keeps the CPU tensor alive until `src` drops.
                let bytes = unsafe { std::slice::from_raw_parts(src.ptr, src.len) };
                let b = Arc::new(rt.upload(bytes, *dtype, dims, *device)?);
                *lock(&self.last) = vec![Arc::downgrade(&b)];
                for (s, dt) in &job.outputs {
                    s.fill(seq, b.clone(), *dt);
                }
                return Ok(());
            }
            Work::Op(_) | Work::Graph { .. } => {}
        }
        // Inputs another stream was computing when this job was queued.
        for d in &job.deps {
            rt.worker.wait_for(*d);
        }
        let mut bufs = Vec::with_capacity(job.inputs.len());
        for i in &job.inputs {
            bufs.push(match i {
                JobIn::Buf(b) => b.clone(),
                JobIn::Storage(s, dt) => {
                    if let Some(e) = s.poisoned() {
                        // Skipped: its input came from a failed op.
                        return Err(e);
                    }
                    s.buffer_now(rt, *dt).map_err(|e| failed(e.msg))?
                }
                JobIn::Staged(s, dt, view, padded) => {
                    if let Some(e) = s.poisoned() {
                        return Err(e);
                    }
                    let whole = s.buffer_now(rt, *dt).map_err(|e| failed(e.msg))?;
                    crate::buckets::stage(rt, &whole, *dt, view, padded)
                        .map_err(|e| failed(e.msg))?
                }
                JobIn::Padded(s, dt, layout) => {
                    if let Some(e) = s.poisoned() {
                        return Err(e);
                    }
                    crate::buckets::padded_input(rt, s, *dt, layout).map_err(|e| failed(e.msg))?
                }
            });
        }
        let refs: Vec<&pjrt::Buffer> = bufs.iter().map(|b| b.as_ref()).collect();
        let mut donated = Vec::new();
        let outs = match &job.work {
            Work::Op(p) => match p.exe() {
                Ok(exe) => exe.execute(&refs),
                Err(e) => return Err(e),
            },
            Work::Mark(_) | Work::Wait(_) | Work::Upload { .. } => unreachable!("handled above"),
            Work::Graph {
                exe,
                aliased,
                checks,
                precheck,
            } => {
                // Queue order settled every earlier reader; later jobs read the new value.
                // Finished outputs are no longer held for error reporting.
                rt.forget_finished();
                let (give, keep): (Vec<usize>, Vec<usize>) = aliased
                    .iter()
                    .partition(|i| Arc::strong_count(&bufs[**i]) <= 2);
                if let (Some(pre), false) = (precheck, give.is_empty()) {
                    let cbufs: Vec<Arc<pjrt::Buffer>> = pre
                        .execute(&refs)
                        .map_err(|e| failed(e.message))?
                        .into_iter()
                        .map(Arc::new)
                        .collect();
                    let check = rt
                        .failed_checks(checks.iter().map(|c| (c.0, c.1.as_str())), &cbufs)
                        .map_err(|e| failed(e.msg))?;
                    if let Some(e) = check {
                        self.check_failed(seq, job, e);
                        return Ok(());
                    }
                }
                donated = give;
                let keep: Vec<i64> = keep.iter().map(|i| *i as i64).collect();
                exe.execute_donating(&refs, &keep)
            }
        }
        .map_err(|e| failed(e.message))?;
        rt.metrics.executions.fetch_add(1, Ordering::Relaxed);
        rt.metrics
            .donated_buffers
            .fetch_add(donated.len() as u64, Ordering::Relaxed);
        let mut outs: Vec<Arc<pjrt::Buffer>> = outs.into_iter().map(Arc::new).collect();
        rt.track(&job.op, &outs);
        *lock(&self.last) = outs.iter().map(Arc::downgrade).collect();
        let check = match &job.work {
            Work::Op(p) => crate::exec::failed_check(rt, &p.outputs, &outs),
            Work::Graph { checks, .. } => {
                let cbufs = outs.split_off(job.outputs.len().min(outs.len()));
                rt.failed_checks(checks.iter().map(|c| (c.0, c.1.as_str())), &cbufs)
            }
            Work::Mark(_) | Work::Wait(_) | Work::Upload { .. } => Ok(None),
        }
        .map_err(|e| failed(e.msg))?;
        if let (Some(e), false) = (&check, donated.is_empty()) {
            // A donated input's old value is gone: every target fails.
            let e = job.found(e.clone());
            for (s, _) in &job.outputs {
                s.poison(seq, &e);
            }
            lock(&self.state).error.get_or_insert(e);
            return Ok(());
        }
        if let Some(e) = check {
            self.check_failed(seq, job, e);
            return Ok(());
        }
        // A bucketed program's results stay padded (read on the device by the next one)
        // unless a permuted target needs them laid out.
        let mut filled = Vec::with_capacity(job.outputs.len());
        for (i, ((_, dt), b)) in job.outputs.iter().zip(outs).enumerate() {
            filled.push(match job.padded.get(i) {
                Some(r) if r.target.is_some() => (
                    crate::buckets::compact(rt, &b, *dt, r).map_err(|e| failed(e.msg))?,
                    None,
                ),
                // A result with no padding is an exact buffer already.
                Some(r) if !r.layout.is_exact() => (b, Some(r.layout.clone())),
                _ => (b, None),
            });
        }
        for ((s, dt), (b, padded)) in job.outputs.iter().zip(filled) {
            s.fill_as(seq, b, *dt, padded);
        }
        Ok(())
    }

    /// A data check of job `seq` failed, nothing donated: the job did not happen. In-place
    /// targets keep their value, new tensors (and so the ops that read them) fail, and the
    /// next synchronization raises.
    fn check_failed(&self, seq: u64, job: &Job, e: Error) {
        let e = job.found(e);
        // Recorded before the targets are released: a read that no longer waits for
        // this job must find the error.
        lock(&self.state).error.get_or_insert(e.clone());
        for (i, (s, _)) in job.outputs.iter().enumerate() {
            if i < job.new_outputs {
                s.poison(seq, &e);
            } else {
                s.unpend(seq);
            }
        }
    }
}

/// Side streams: `torch.tpu.Stream`s are handed out round robin from this many workers
/// (CUDA keeps a pool too); each starts its thread on first use.
pub const SIDE_STREAMS: usize = 8;

thread_local! {
    /// The calling thread's current stream (set by the shim's device guard).
    static CURRENT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The default stream (0) and the side streams, with the queue operations over all of them.
pub struct Streams {
    workers: Vec<Worker>,
    next_side: AtomicU64,
}

impl Default for Streams {
    fn default() -> Self {
        Streams {
            workers: (0..=SIDE_STREAMS).map(Worker::new).collect(),
            next_side: AtomicU64::new(0),
        }
    }
}

impl Streams {
    /// The calling thread's current stream.
    pub fn current_index() -> usize {
        CURRENT.with(|c| c.get())
    }

    /// Makes `stream` the calling thread's current stream (out-of-range: the default).
    pub fn set_current(stream: usize) {
        CURRENT.with(|c| c.set(if stream <= SIDE_STREAMS { stream } else { 0 }));
    }

    /// A side stream for a new `torch.tpu.Stream` (1..=SIDE_STREAMS, round robin).
    pub fn new_side(&self) -> usize {
        1 + (self.next_side.fetch_add(1, Ordering::Relaxed) as usize % SIDE_STREAMS)
    }

    pub fn get(&'static self, stream: usize) -> &'static Worker {
        &self.workers[stream.min(SIDE_STREAMS)]
    }

    /// The calling thread's current stream's worker.
    pub(crate) fn current(&'static self) -> &'static Worker {
        self.get(Self::current_index())
    }

    /// Waits until the job numbered `seq` (tagged) has run.
    pub(crate) fn wait_for(&self, seq: u64) {
        let (stream, local) = untag(seq);
        if let Some(w) = self.workers.get(stream) {
            w.wait_local(local);
        }
    }

    /// Whether the job numbered `seq` (tagged) has run.
    pub fn reached(&self, seq: u64) -> bool {
        let (stream, local) = untag(seq);
        self.workers
            .get(stream)
            .is_none_or(|w| w.done.load(Ordering::Acquire) >= local)
    }

    /// Waits for every job queued so far on every stream.
    pub fn drain(&self) {
        for w in &self.workers {
            w.drain();
        }
    }

    /// Drains, then reports (once) the first failure since the last call.
    pub fn synchronize(&self) -> Result<()> {
        self.drain();
        self.take_error()
    }

    /// A failed job's error not raised yet: a host read raises it (once), as the next
    /// synchronization would. Without it, reading an out= or in-place target of a job whose
    /// data check failed would return the target's old value with no error.
    pub(crate) fn take_error(&self) -> Result<()> {
        for w in &self.workers {
            if let Some(e) = w.take_first_error() {
                return Err(e);
            }
        }
        Ok(())
    }

    /// A host read already raised `e`: no stream raises it again.
    pub(crate) fn reported(&self, e: &Error) {
        for w in &self.workers {
            w.reported(e);
        }
    }
}

/// Test hook: `TORCH_PJRT_INJECT_FAILURE=aten::mul` makes every execution of that op fail
/// on the device, to exercise how failures surface in each mode.
pub(crate) fn injected_failure(op: &str) -> Option<String> {
    static OP: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let target = OP.get_or_init(|| std::env::var("TORCH_PJRT_INJECT_FAILURE").ok());
    (target.as_deref() == Some(op)).then(|| {
        format!("{op} failed on the tpu device: injected failure (TORCH_PJRT_INJECT_FAILURE)")
    })
}
