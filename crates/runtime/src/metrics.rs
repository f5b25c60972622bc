//! Counters: per-op native and fallback calls, compilations, cache, executions, transfers.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

#[derive(Default, Clone, Copy, Debug)]
pub struct OpCounts {
    pub native: u64,
    pub fallback: u64,
}

/// Per op: programs compiled (exact and bucketed), bucketed ones, calls a bucketed program
/// served without compiling.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProgramCounts {
    pub programs: u64,
    pub bucketed: u64,
    pub bucket_hits: u64,
}

#[derive(Default)]
pub struct Metrics {
    ops: Mutex<BTreeMap<String, OpCounts>>,
    pub compilations: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    compile_nanos: AtomicU64,
    /// Programs loaded from the disk cache (not compilations) and disk lookups that failed.
    pub disk_hits: AtomicU64,
    pub disk_misses: AtomicU64,
    load_nanos: AtomicU64,
    pub executions: AtomicU64,
    pub h2d_bytes: AtomicU64,
    pub d2h_bytes: AtomicU64,
    pub d2d_bytes: AtomicU64,
    pub deferred_compilations: AtomicU64,
    /// Deferred graphs whose program was not in memory (compiled or loaded from disk).
    pub graph_programs: AtomicU64,
    pub flushes: AtomicU64,
    pub flushed_ops: AtomicU64,
    /// Input buffers a deferred graph reused for its outputs (in-place updates).
    pub donated_buffers: AtomicU64,
    /// Flushes for a host read that ran only what the read needed and queued the rest.
    pub split_flushes: AtomicU64,
    flush_reasons: Mutex<BTreeMap<String, u64>>,
    programs: Mutex<BTreeMap<String, ProgramCounts>>,
    /// Compilations on the background thread (optimized versions, exact programs of hot
    /// bucketed calls) and their seconds: nobody waited for them.
    pub background_compilations: AtomicU64,
    background_nanos: AtomicU64,
    /// Calls at an exact shape never seen before that a bucketed program served.
    pub new_shapes_served: AtomicU64,
    /// Device-to-host bytes of shape buckets (inputs staged, results compacted on the host):
    /// part of `d2h_bytes`, none of it a value read by the user's code.
    pub bucket_host_bytes: AtomicU64,
}

/// A plain snapshot of the counters.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub ops: BTreeMap<String, OpCounts>,
    pub counters: Vec<(&'static str, f64)>,
    pub flush_reasons: BTreeMap<String, u64>,
    pub programs: BTreeMap<String, ProgramCounts>,
}

impl Metrics {
    fn op(&self, name: &str, f: impl FnOnce(&mut OpCounts)) {
        let mut m = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        f(m.entry(name.to_string()).or_default());
    }
    pub fn native(&self, name: &str) {
        self.op(name, |c| c.native += 1);
    }
    pub fn fallback(&self, name: &str) {
        self.op(name, |c| c.fallback += 1);
    }
    pub fn compiled(&self, secs: f64) {
        self.compilations.fetch_add(1, Ordering::Relaxed);
        self.compile_nanos
            .fetch_add((secs * 1e9) as u64, Ordering::Relaxed);
    }
    pub fn compiled_background(&self, secs: f64) {
        self.background_compilations.fetch_add(1, Ordering::Relaxed);
        self.background_nanos
            .fetch_add((secs * 1e9) as u64, Ordering::Relaxed);
    }
    pub fn compiled_deferred(&self, secs: f64) {
        self.compiled(secs);
        self.deferred_compilations.fetch_add(1, Ordering::Relaxed);
    }
    pub fn loaded(&self, secs: f64) {
        self.disk_hits.fetch_add(1, Ordering::Relaxed);
        self.load_nanos
            .fetch_add((secs * 1e9) as u64, Ordering::Relaxed);
    }
    pub fn flushed(&self, ops: usize, reason: &str) {
        self.flushes.fetch_add(1, Ordering::Relaxed);
        self.flushed_ops.fetch_add(ops as u64, Ordering::Relaxed);
        *self
            .flush_reasons
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(reason.to_string())
            .or_default() += 1;
    }
    fn program(&self, name: &str, f: impl FnOnce(&mut ProgramCounts)) {
        let mut m = self.programs.lock().unwrap_or_else(|e| e.into_inner());
        f(m.entry(name.to_string()).or_default());
    }
    /// An op compiled a program at its exact shapes.
    pub fn exact_program(&self, name: &str) {
        self.program(name, |c| c.programs += 1);
    }
    /// An op compiled a program serving a range of sizes.
    pub fn bucket_compile(&self, name: &str) {
        self.program(name, |c| {
            c.programs += 1;
            c.bucketed += 1
        });
    }
    /// A bucketed program ran a call; `new_shape`: one no program was compiled for.
    pub fn bucket_hit(&self, name: &str, new_shape: bool) {
        self.program(name, |c| c.bucket_hits += 1);
        if new_shape {
            self.new_shapes_served.fetch_add(1, Ordering::Relaxed);
        }
    }
    pub fn add_h2d(&self, n: usize) {
        self.h2d_bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
    pub fn add_d2h(&self, n: usize) {
        self.d2h_bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
    pub fn add_d2d(&self, n: usize) {
        self.d2d_bytes.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Snapshot {
        let ops = self.ops.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let counters = vec![
            ("compilations", g(&self.compilations)),
            ("cache_hits", g(&self.cache_hits)),
            ("cache_misses", g(&self.cache_misses)),
            ("compile_seconds", g(&self.compile_nanos) / 1e9),
            ("disk_hits", g(&self.disk_hits)),
            ("disk_misses", g(&self.disk_misses)),
            ("load_seconds", g(&self.load_nanos) / 1e9),
            ("executions", g(&self.executions)),
            ("host_to_device_bytes", g(&self.h2d_bytes)),
            ("device_to_host_bytes", g(&self.d2h_bytes)),
            ("device_to_device_bytes", g(&self.d2d_bytes)),
            (
                "native_calls",
                ops.values().map(|c| c.native).sum::<u64>() as f64,
            ),
            (
                "fallback_calls",
                ops.values().map(|c| c.fallback).sum::<u64>() as f64,
            ),
            (
                "compilations_strict",
                g(&self.compilations) - g(&self.deferred_compilations),
            ),
            ("compilations_deferred", g(&self.deferred_compilations)),
            ("graph_programs", g(&self.graph_programs)),
            ("flushes", g(&self.flushes)),
            (
                "ops_per_flush",
                g(&self.flushed_ops) / g(&self.flushes).max(1.0),
            ),
            ("donated_buffers", g(&self.donated_buffers)),
            ("split_flushes", g(&self.split_flushes)),
            ("new_shapes_served", g(&self.new_shapes_served)),
            ("bucket_host_bytes", g(&self.bucket_host_bytes)),
            ("background_compilations", g(&self.background_compilations)),
            (
                "background_compile_seconds",
                g(&self.background_nanos) / 1e9,
            ),
            (
                // Each would have compiled a program of the mean compilation time.
                "compile_seconds_saved",
                g(&self.new_shapes_served) * g(&self.compile_nanos)
                    / 1e9
                    / g(&self.compilations).max(1.0),
            ),
        ];
        let flush_reasons = self
            .flush_reasons
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let programs = self
            .programs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        Snapshot {
            ops,
            counters,
            flush_reasons,
            programs,
        }
    }

    pub fn reset(&self) {
        self.ops.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.flush_reasons
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.programs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        for a in [
            &self.compilations,
            &self.cache_hits,
            &self.cache_misses,
            &self.compile_nanos,
            &self.disk_hits,
            &self.disk_misses,
            &self.load_nanos,
            &self.executions,
            &self.h2d_bytes,
            &self.d2h_bytes,
            &self.d2d_bytes,
            &self.deferred_compilations,
            &self.graph_programs,
            &self.flushes,
            &self.flushed_ops,
            &self.donated_buffers,
            &self.split_flushes,
            &self.new_shapes_served,
            &self.bucket_host_bytes,
            &self.background_compilations,
            &self.background_nanos,
        ] {
            a.store(0, Ordering::Relaxed);
        }
    }
}
