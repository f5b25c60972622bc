//! Two-tier compilation of per-op programs (Strict and Debug).
//!
//! A per-op program is first compiled quickly: XLA's backend optimizations off
//! (`xla_backend_optimization_level=0`) and, on the CPU plugin, its older kernel emitters
//! (`quick_options`), about a quarter of the compile time of the optimized program, which matters when a new model or new shapes compile hundreds of small programs
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
pub const HOT: u32 = 2;

/// The options that make a quick program: XLA's backend optimizations off and, on the CPU
/// plugin, its elemental kernel emitters instead of the MLIR fusion emitters (half the
/// compile time again: a softmax 40 ms instead of 100; the optimized program that replaces
/// it uses the fusion emitters).
pub fn quick_options(cpu_plugin: bool) -> Vec<(&'static str, pjrt::OptionValue)> {
    let mut o = vec![("xla_backend_optimization_level", pjrt::OptionValue::Int(0))];
    if cpu_plugin {
        o.push((
            "xla_cpu_use_fusion_emitters",
            pjrt::OptionValue::Bool(false),
        ));
    }
    o
}

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

    /// True exactly once, the first time the program is reused: a deferred graph's
    /// optimized version is worth its compilation as soon as the graph recurs.
    pub fn reused(&self) -> bool {
        self.runs.fetch_add(1, Ordering::Relaxed) == 0
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
    busy: usize,
    started: bool,
    closed: bool,
}

/// A queue of compilations and the threads that run them.
struct Pool {
    name: &'static str,
    threads: usize,
    low_priority: bool,
    state: Mutex<State>,
    changed: Condvar,
}

fn lock(p: &Pool) -> MutexGuard<'_, State> {
    p.state.lock().unwrap_or_else(|e| e.into_inner())
}

impl Pool {
    const fn new(name: &'static str, threads: usize, low_priority: bool) -> Pool {
        Pool {
            name,
            threads,
            low_priority,
            state: Mutex::new(State {
                queue: VecDeque::new(),
                busy: 0,
                started: false,
                closed: false,
            }),
            changed: Condvar::new(),
        }
    }

    fn submit(&'static self, f: Task) {
        let mut st = lock(self);
        if st.closed {
            return;
        }
        st.queue.push_back(f);
        if !st.started {
            st.started = true;
            let n = if self.threads == 0 {
                std::thread::available_parallelism().map_or(2, |n| n.get().min(4))
            } else {
                self.threads
            };
            for _ in 0..n {
                let spawned = std::thread::Builder::new()
                    .name(self.name.into())
                    .spawn(move || self.run());
                if spawned.is_err() {
                    break;
                }
            }
        }
        self.changed.notify_all();
    }

    fn run(&self) {
        if self.low_priority {
            lower_priority();
        }
        let mut st = lock(self);
        loop {
            if st.closed {
                return;
            }
            let Some(task) = st.queue.pop_front() else {
                st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            };
            st.busy += 1;
            drop(st);
            task();
            st = lock(self);
            st.busy -= 1;
            self.changed.notify_all();
        }
    }

    fn wait_idle(&self) {
        let mut st = lock(self);
        while !st.closed && (st.busy > 0 || !st.queue.is_empty()) {
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Drops what is queued and waits for the compilations in flight.
    fn shutdown(&self) {
        let mut st = lock(self);
        st.closed = true;
        st.queue.clear();
        self.changed.notify_all();
        while st.busy > 0 {
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Strict mode's compilations of new per-op programs: Python goes on queueing ops while
/// they compile, several at once where cores allow (up to four threads).
static COMPILE: Pool = Pool::new("torch_pjrt-compile", 0, false);
/// Optimized versions and exact programs nobody waits for: one low-priority thread.
static BACKGROUND: Pool = Pool::new("torch_pjrt-optimize", 1, true);

/// Queues a compilation a queued op waits for.
pub fn compile(f: impl FnOnce() + Send + 'static) {
    COMPILE.submit(Box::new(f));
}

/// Queues `f` on the background thread (low priority: it takes the cores the program's
/// own work leaves). Dropped after `shutdown`.
pub fn background(f: impl FnOnce() + Send + 'static) {
    BACKGROUND.submit(Box::new(f));
}

/// Waits until every queued compilation is done (benchmarks measuring the steady state,
/// tests counting programs).
pub fn wait_idle() {
    COMPILE.wait_idle();
    BACKGROUND.wait_idle();
}

/// At exit: drops queued background compilations and waits for those in flight, which
/// must not outlive the PJRT client. Foreground compilations are waited for by their jobs.
pub fn shutdown() {
    BACKGROUND.shutdown();
    COMPILE.wait_idle();
}
