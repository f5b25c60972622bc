//! The device trace behind `torch.tpu.profiler`: while it is on, every program run (an op's
//! program, a deferred graph, a compiled graph, a queued upload) leaves one record with its
//! name, device, stream, when it was queued, when it started and finished (outputs
//! computed), and how its program was obtained (cache hit, compiled, loaded from disk).
//! Off, it costs one atomic load per program.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

static ON: AtomicBool = AtomicBool::new(false);
static RECORDS: Mutex<Vec<Record>> = Mutex::new(Vec::new());

/// How a run's program was obtained.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Source {
    /// Found in the in-memory cache.
    Hit,
    /// Compiled by XLA (seconds).
    Compiled(f64),
    /// Loaded from the disk cache (seconds).
    Loaded(f64),
}

impl Source {
    /// How the program was obtained, in words, and the seconds it took.
    pub fn describe(self) -> (&'static str, f64) {
        match self {
            Source::Hit => ("cache hit", 0.0),
            Source::Compiled(s) => ("compiled", s),
            Source::Loaded(s) => ("loaded from disk", s),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Record {
    pub name: String,
    pub device: usize,
    pub stream: usize,
    /// Nanoseconds since `epoch()`.
    pub queued: u64,
    pub start: u64,
    pub end: u64,
    pub source: Source,
}

thread_local! {
    /// The last compilation or load on this thread (read by the run that follows it).
    static LAST: Cell<Option<Source>> = const { Cell::new(None) };
}

fn epoch() -> &'static (Instant, u64) {
    static E: OnceLock<(Instant, u64)> = OnceLock::new();
    E.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        (Instant::now(), wall)
    })
}

/// Wall-clock nanoseconds (since 1970) of the trace's time zero.
pub fn epoch_wall_ns() -> u64 {
    epoch().1
}

pub fn now() -> u64 {
    epoch().0.elapsed().as_nanos() as u64
}

pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Starts recording (dropping earlier records).
pub fn start() {
    epoch();
    RECORDS.lock().unwrap_or_else(|e| e.into_inner()).clear();
    ON.store(true, Ordering::Release);
}

/// Stops recording and returns the records.
pub fn stop() -> Vec<Record> {
    ON.store(false, Ordering::Release);
    std::mem::take(&mut *RECORDS.lock().unwrap_or_else(|e| e.into_inner()))
}

/// `Runtime::compile` obtained a program (compiled or loaded).
pub(crate) fn note(source: Source) {
    if on() {
        LAST.with(|l| l.set(Some(source)));
    }
}

/// How the program about to run was obtained (a hit unless a compile was noted since).
pub(crate) fn take_source() -> Source {
    LAST.with(|l| l.take()).unwrap_or(Source::Hit)
}

/// What a queued run carries from the Python thread to the worker.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Queued {
    pub at: u64,
    pub source: Source,
}

pub(crate) fn queued() -> Option<Queued> {
    on().then(|| Queued {
        at: now(),
        source: take_source(),
    })
}

/// Records a run that started at `start` and whose outputs `outs` are now computed
/// (waits for them: tracing measures device time, not dispatch).
pub(crate) fn finish(
    name: &str,
    device: usize,
    stream: usize,
    q: Queued,
    start: u64,
    outs: &[std::sync::Arc<pjrt::Buffer>],
) {
    for b in outs {
        let _ = b.ready();
    }
    let r = Record {
        name: name.to_string(),
        device,
        stream,
        queued: q.at,
        start,
        end: now(),
        source: q.source,
    };
    RECORDS.lock().unwrap_or_else(|e| e.into_inner()).push(r);
}
