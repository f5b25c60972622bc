//! Two-tier compilation of per-op programs (Strict and Debug).
//!
//! A per-op program is first compiled quickly: XLA's backend optimizations off
//! (`xla_backend_optimization_level=0`), about half the compile time of the optimized
//! program, which matters when a new model or new shapes compile hundreds of small programs
//! (measured in ARCHITECTURE.md). Once the program has run `HOT` times, a background thread
//! (low priority) compiles the optimized version and swaps it into the cache under the same
//! key; calls already queued keep the quick one. The disk cache keeps both: a process
//! finding the optimized one on disk uses it at once.
//!
//! The same thread compiles exact-shape programs for calls a bucketed program serves again
//! and again at one shape (a static loop whose op sizes differ between call sites): see
//! `exec::bucketed`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use crate::options::Custom;

/// Runs of a quick program before its optimized version is compiled.
pub const HOT: u32 = 8;

/// The option that makes a quick program.
pub const QUICK: &str = "xla_backend_optimization_level";

/// Off with `TORCH_TPU_QUICK_COMPILE=0` (every program optimized at once).
pub fn quick_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TORCH_TPU_QUICK_COMPILE").map_or(true, |v| v != "0"))
}

/// What a quick program needs to be compiled again, optimized.
pub struct Quick {
    pub mlir: String,
    pub custom: Option<Arc<Custom>>,
    pub runs: AtomicU32,
}

impl Quick {
    /// Counts a run; true exactly once, when the program becomes hot.
    pub fn hot(&self) -> bool {
        self.runs.fetch_add(1, Ordering::Relaxed) + 1 == HOT
    }
}

type Task = Box<dyn FnOnce() + Send>;

#[cfg(target_os = "linux")]
fn lower_priority() {
    extern "C" {
        fn setpriority(which: i32, who: u32, prio: i32) -> i32;
    }
    // SAFETY: PRIO_PROCESS (0) with who 0 names the calling thread on Linux; a failure only
    // leaves its priority unchanged.
    unsafe {
        setpriority(0, 0, 10);
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_priority() {}

#[derive(Default)]
struct State {
    queue: VecDeque<Task>,
    busy: bool,
    started: bool,
    closed: bool,
}

struct Pool {
    state: Mutex<State>,
    changed: Condvar,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        state: Mutex::new(State::default()),
        changed: Condvar::new(),
    })
}

fn lock(p: &Pool) -> MutexGuard<'_, State> {
    p.state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Queues `f` on the background compilation thread (started on first use, at low
/// priority so that it takes the cores the program's own work leaves). Dropped after
/// `shutdown`.
pub fn background(f: impl FnOnce() + Send + 'static) {
    let p = pool();
    let mut st = lock(p);
    if st.closed {
        return;
    }
    st.queue.push_back(Box::new(f));
    if !st.started {
        st.started = true;
        let spawned = std::thread::Builder::new()
            .name("torch_pjrt-compile".into())
            .spawn(run);
        if spawned.is_err() {
            // No thread: the quick programs stay, which work.
            st.queue.clear();
            st.closed = true;
        }
    }
    p.changed.notify_all();
}

fn run() {
    lower_priority();
    let p = pool();
    loop {
        let task = {
            let mut st = lock(p);
            st.busy = false;
            p.changed.notify_all();
            loop {
                if st.closed {
                    return;
                }
                if let Some(t) = st.queue.pop_front() {
                    st.busy = true;
                    break t;
                }
                st = p.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        task();
    }
}

/// Waits until every queued compilation is done (benchmarks measuring the steady state,
/// tests counting programs).
pub fn wait_idle() {
    let p = pool();
    let mut st = lock(p);
    while !st.closed && (st.busy || !st.queue.is_empty()) {
        st = p.changed.wait(st).unwrap_or_else(|e| e.into_inner());
    }
}

/// At exit: drops what is queued and waits for the compilation in flight, which must not
/// outlive the PJRT client.
pub fn shutdown() {
    let p = pool();
    let mut st = lock(p);
    st.closed = true;
    st.queue.clear();
    p.changed.notify_all();
    while st.busy {
        st = p.changed.wait(st).unwrap_or_else(|e| e.into_inner());
    }
}
