//! Strict mode's asynchrony: ops are executed by one worker thread, in the order Python
//! issued them, while the Python thread goes on dispatching.
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
}

/// What a job runs.
pub(crate) enum Work {
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
}

impl Job {
    /// A failed check's error, naming the op (a graph's checks already name theirs).
    fn found(&self, e: Error) -> Error {
        match self.work {
            Work::Op(_) => Error::new(e.kind, crate::exec::checked_by(&e.msg, &self.op)),
            Work::Graph { .. } => e,
        }
    }
}

struct State {
    jobs: VecDeque<(u64, Job)>,
    enqueued: u64,
    /// The first failure not yet reported by `synchronize`.
    error: Option<Error>,
    started: bool,
}

pub struct Worker {
    state: Mutex<State>,
    work: Condvar,
    finished: Condvar,
    /// Highest sequence number the worker has completed.
    done: AtomicU64,
    sleeping: AtomicBool,
}

/// Jobs in flight before the Python thread waits (bounds memory held by the queue).
const MAX_IN_FLIGHT: u64 = 2048;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Default for Worker {
    fn default() -> Self {
        Worker {
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
}

impl Worker {
    /// Queues the job `make(seq)` builds; it marks its outputs pending with `seq` before
    /// the worker can see it.
    pub(crate) fn submit(&'static self, make: impl FnOnce(u64) -> Job) -> Result<()> {
        let mut st = lock(&self.state);
        if !st.started {
            std::thread::Builder::new()
                .name("tpu-worker".into())
                .spawn(move || self.run())
                .map_err(|e| Error::runtime(format!("cannot start the tpu worker: {e}")))?;
            st.started = true;
        }
        let seq = st.enqueued + 1;
        let job = make(seq);
        st.enqueued = seq;
        st.jobs.push_back((seq, job));
        drop(st);
        if self.sleeping.load(Ordering::Acquire) {
            self.work.notify_one();
        }
        let done = self.done.load(Ordering::Acquire);
        if seq.saturating_sub(done) > MAX_IN_FLIGHT {
            self.wait_for(seq - MAX_IN_FLIGHT / 2);
        }
        Ok(())
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
            }
        })
    }

    /// Waits until job `seq` has run.
    pub(crate) fn wait_for(&self, seq: u64) {
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
            self.wait_for(last);
        }
    }

    /// Drains, then reports (once) the first failure since the last call.
    pub fn synchronize(&self) -> Result<()> {
        self.drain();
        match lock(&self.state).error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A failed job's error not raised yet: a host read raises it (once), as the next
    /// synchronization would. Without it, reading an out= or in-place target of a job whose
    /// data check failed would return the target's old value with no error.
    pub(crate) fn take_error(&self) -> Result<()> {
        match lock(&self.state).error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A host read already raised `e` (a failed job's poisoned output): the next
    /// synchronization does not raise it again, nor the same error found by another op
    /// (one call can run several ops that check the same data).
    pub(crate) fn reported(&self, e: &Error) {
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

    fn next_job(&self) -> (u64, Job) {
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
            let (seq, job) = self.next_job();
            if let Err(e) = self.execute(seq, &job) {
                for (s, _) in &job.outputs {
                    s.poison(seq, &e);
                }
                let mut st = lock(&self.state);
                st.error.get_or_insert(e);
            }
            drop(job);
            self.done.store(seq, Ordering::Release);
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
            });
        }
        let refs: Vec<&pjrt::Buffer> = bufs.iter().map(|b| b.as_ref()).collect();
        let mut donated = Vec::new();
        let outs = match &job.work {
            Work::Op(p) => p.exe.execute(&refs),
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
        let check = match &job.work {
            Work::Op(p) => crate::exec::failed_check(rt, &p.outputs, &outs),
            Work::Graph { checks, .. } => {
                let cbufs = outs.split_off(job.outputs.len().min(outs.len()));
                rt.failed_checks(checks.iter().map(|c| (c.0, c.1.as_str())), &cbufs)
            }
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
        for ((s, dt), b) in job.outputs.iter().zip(outs) {
            s.fill(seq, b, *dt);
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

/// Test hook: `TORCH_PJRT_INJECT_FAILURE=aten::mul` makes every execution of that op fail
/// on the device, to exercise how failures surface in each mode.
pub(crate) fn injected_failure(op: &str) -> Option<String> {
    static OP: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let target = OP.get_or_init(|| std::env::var("TORCH_PJRT_INJECT_FAILURE").ok());
    (target.as_deref() == Some(op)).then(|| {
        format!("{op} failed on the tpu device: injected failure (TORCH_PJRT_INJECT_FAILURE)")
    })
}
