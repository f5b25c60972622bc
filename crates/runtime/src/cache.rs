//! The in-memory compilation cache: program key -> compiled program and its I/O plan.
//!
//! Bounded: every loaded executable keeps its JIT code mapped, and XLA:CPU fails ("Cannot
//! allocate memory", then a crash) once a process holds some 12 000 of them (the kernel's
//! limit on memory mappings). Past `capacity` programs the least recently used tenth is
//! dropped; a dropped program comes back from the disk cache when next needed. Programs
//! in flight stay alive through their jobs' references.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::exec::Program;

/// Default bound on cached per-op programs (`TORCH_TPU_MAX_CACHED_PROGRAMS`).
pub const DEFAULT_CAPACITY: usize = 4096;

struct Entry<V> {
    prog: V,
    /// Tick of the last use: a relaxed store on the hot path, read only when evicting.
    used: AtomicU64,
}

pub struct Cache<V = Arc<Program>> {
    map: Mutex<HashMap<Vec<u8>, Entry<V>>>,
    tick: AtomicU64,
    capacity: usize,
    evicted: AtomicU64,
}

impl<V: Clone> Default for Cache<V> {
    fn default() -> Self {
        let capacity = std::env::var("TORCH_TPU_MAX_CACHED_PROGRAMS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|n| *n > 0)
            .unwrap_or(DEFAULT_CAPACITY);
        Cache::with_capacity(capacity)
    }
}

impl<V: Clone> Cache<V> {
    pub fn with_capacity(capacity: usize) -> Self {
        Cache {
            map: Mutex::new(HashMap::new()),
            tick: AtomicU64::new(0),
            capacity: capacity.max(1),
            evicted: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Vec<u8>, Entry<V>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn get(&self, key: &[u8]) -> Option<V> {
        let m = self.lock();
        let e = m.get(key)?;
        e.used
            .store(self.tick.fetch_add(1, Ordering::Relaxed), Ordering::Relaxed);
        Some(e.prog.clone())
    }

    pub fn insert(&self, key: Vec<u8>, prog: V) {
        let used = AtomicU64::new(self.tick.fetch_add(1, Ordering::Relaxed));
        let mut m = self.lock();
        m.insert(key, Entry { prog, used });
        if m.len() > self.capacity {
            // Drop the least recently used tenth at once: eviction stays off the hot path.
            let mut ticks: Vec<u64> = m.values().map(|e| e.used.load(Ordering::Relaxed)).collect();
            let n = (self.capacity / 10).max(m.len() - self.capacity);
            let (_, cut, _) = ticks.select_nth_unstable(n - 1);
            let cut = *cut;
            let before = m.len();
            m.retain(|_, e| e.used.load(Ordering::Relaxed) > cut);
            self.evicted
                .fetch_add((before - m.len()) as u64, Ordering::Relaxed);
        }
    }

    /// Programs dropped to stay within the bound, since start.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&self) {
        self.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_most_recently_used_within_capacity() {
        let c: Cache<u32> = Cache::with_capacity(20);
        for i in 0..20u32 {
            c.insert(vec![i as u8], i);
        }
        // Key 0 is used again: it must survive the next eviction.
        assert_eq!(c.get(&[0]), Some(0));
        c.insert(vec![20], 20);
        assert!(c.len() <= 20, "{}", c.len());
        assert_eq!(c.evicted(), 21 - c.len() as u64);
        assert_eq!(c.get(&[0]), Some(0));
        assert_eq!(c.get(&[20]), Some(20));
        assert_eq!(c.get(&[1]), None, "the least recently used goes first");
        for i in 21..200u32 {
            c.insert(vec![i as u8, 1], i);
        }
        assert!(c.len() <= 20);
    }
}
