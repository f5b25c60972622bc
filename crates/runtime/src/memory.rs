//! Device memory accounting behind `torch.tpu.memory_*` and `torch.accelerator.memory_*`.
//!
//! "Allocated" is the bytes of live tpu storages per device, counted from a storage's
//! creation to its drop (DeferAndFuse's lazy storages and donated buffers included: a
//! storage owns its bytes whether or not its value is computed yet). There is no caching
//! allocator: PJRT owns the buffers, so "reserved" is the plugin's bytes in use where it
//! reports them (TPU, GPU) and the allocated bytes otherwise (CPU plugin).
//!
//! Admission: a new storage past the limit set by `set_per_process_memory_fraction`, or
//! larger than the device's free memory, is refused with an out-of-memory error before
//! anything is allocated, so existing tensors stay intact and the program can go on.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};

use crate::{Error, ErrorKind, Result};

/// Device slots (the shim's own bound on device indices).
const MAX_DEVICES: usize = 128;

/// Storages from this size on are checked against the device's free memory (reading it
/// costs a system call; smaller ones cannot exhaust a machine before the limit check).
const CHECK_FREE_FROM: i64 = 64 << 20;

#[derive(Default)]
struct Stat {
    current: AtomicI64,
    peak: AtomicI64,
    allocated: AtomicI64,
    freed: AtomicI64,
}

impl Stat {
    fn add(&self, n: i64) {
        let now = self.current.fetch_add(n, Relaxed) + n;
        self.peak.fetch_max(now, Relaxed);
        self.allocated.fetch_add(n, Relaxed);
    }
    fn sub(&self, n: i64) {
        self.current.fetch_sub(n, Relaxed);
        self.freed.fetch_add(n, Relaxed);
    }
    fn get(&self) -> [i64; 4] {
        [&self.current, &self.peak, &self.allocated, &self.freed].map(|a| a.load(Relaxed))
    }
}

struct DeviceMemory {
    bytes: Stat,
    count: Stat,
    ooms: AtomicI64,
    /// Bytes allowed by `set_per_process_memory_fraction` (negative: no limit).
    limit: AtomicI64,
}

impl Default for DeviceMemory {
    fn default() -> Self {
        DeviceMemory {
            bytes: Stat::default(),
            count: Stat::default(),
            ooms: AtomicI64::new(0),
            limit: AtomicI64::new(-1),
        }
    }
}

fn slot(device: usize) -> &'static DeviceMemory {
    static SLOTS: std::sync::OnceLock<Vec<DeviceMemory>> = std::sync::OnceLock::new();
    let v = SLOTS.get_or_init(|| (0..MAX_DEVICES).map(|_| DeviceMemory::default()).collect());
    &v[device.min(MAX_DEVICES - 1)]
}

/// A storage of `nbytes` came to life on `device`.
pub(crate) fn on_alloc(device: usize, nbytes: i64) {
    let m = slot(device);
    m.bytes.add(nbytes);
    m.count.add(1);
}

/// A storage of `nbytes` died.
pub(crate) fn on_free(device: usize, nbytes: i64) {
    let m = slot(device);
    m.bytes.sub(nbytes);
    m.count.sub(1);
}

/// A storage changed size (resize_, set_).
pub(crate) fn on_resize(device: usize, old: i64, new: i64) {
    let m = slot(device);
    if new > old {
        m.bytes.add(new - old);
    } else {
        m.bytes.sub(old - new);
    }
}

/// (free, total) bytes of `device`: the plugin's limit minus its use where it reports them,
/// else the host's available and total memory (the CPU plugin's buffers are host memory).
pub fn capacity(device: usize) -> (i64, i64) {
    if let Ok(rt) = crate::get() {
        if let Ok(Some(s)) = rt.client.memory_stats(device) {
            if let Some(limit) = s.bytes_limit {
                return ((limit - s.bytes_in_use).max(0), limit);
            }
        }
    }
    host_memory()
}

/// MemAvailable and MemTotal from /proc/meminfo (0, 0 where unreadable).
fn host_memory() -> (i64, i64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("MemAvailable:"), field("MemTotal:"))
}

fn gib(n: i64) -> String {
    const K: f64 = 1024.0;
    let n = n as f64;
    if n >= K * K * K {
        format!("{:.2} GiB", n / (K * K * K))
    } else if n >= K * K {
        format!("{:.2} MiB", n / (K * K))
    } else if n >= K {
        format!("{:.2} KiB", n / K)
    } else {
        format!("{n} bytes")
    }
}

/// Refuses a new storage of `nbytes` on `device` past the set limit or the free memory.
pub fn admit(device: usize, nbytes: i64) -> Result<()> {
    let m = slot(device);
    let limit = m.limit.load(Relaxed);
    let used = m.bytes.current.load(Relaxed);
    let over_limit = limit >= 0 && used + nbytes > limit;
    let free = if nbytes >= CHECK_FREE_FROM {
        Some(capacity(device))
    } else {
        None
    };
    let over_free = matches!(free, Some((f, t)) if t > 0 && nbytes > f);
    if !(over_limit || over_free) {
        return Ok(());
    }
    m.ooms.fetch_add(1, Relaxed);
    let (f, t) = free.unwrap_or_else(|| capacity(device));
    let why = if over_limit {
        format!(
            "; the process may use {} (set_per_process_memory_fraction)",
            gib(limit)
        )
    } else {
        String::new()
    };
    Err(Error::new(
        ErrorKind::OutOfMemory,
        format!(
            "tpu out of memory. Tried to allocate {} on tpu:{device}, which has a total \
             capacity of {} of which {} is free; tensors on it hold {}{why}. Free tensors \
             you no longer need (del them, then torch.tpu.empty_cache()) or use smaller \
             batches.",
            gib(nbytes),
            gib(t),
            gib(f),
            gib(used)
        ),
    ))
}

/// Limits `device` to `fraction` of its total memory (0 <= fraction <= 1).
pub fn set_fraction(device: usize, fraction: f64) -> Result<()> {
    if !(0.0..=1.0).contains(&fraction) {
        return Err(Error::new(
            ErrorKind::Value,
            format!("Invalid fraction value: {fraction}. Allowed range: 0~1"),
        ));
    }
    let total = capacity(device).1;
    slot(device)
        .limit
        .store((total as f64 * fraction) as i64, Relaxed);
    Ok(())
}

/// The counters of `device`, as CUDA's allocator names them.
#[derive(Debug, Clone, Copy)]
pub struct Stats {
    /// [current, peak, allocated (accumulated), freed (accumulated)]
    pub bytes: [i64; 4],
    pub count: [i64; 4],
    pub reserved: i64,
    pub reserved_peak: i64,
    pub ooms: i64,
    /// Negative: no limit.
    pub limit: i64,
}

pub fn stats(device: usize) -> Stats {
    let m = slot(device);
    let bytes = m.bytes.get();
    let plugin = crate::get()
        .ok()
        .and_then(|rt| rt.client.memory_stats(device).ok().flatten());
    let (reserved, reserved_peak) = match plugin {
        Some(s) => (
            s.bytes_in_use,
            s.peak_bytes_in_use.unwrap_or(s.bytes_in_use),
        ),
        None => (bytes[0], bytes[1]),
    };
    Stats {
        bytes,
        count: m.count.get(),
        reserved,
        reserved_peak,
        ooms: m.ooms.load(Relaxed),
        limit: m.limit.load(Relaxed),
    }
}

pub fn reset_peak(device: usize) {
    let m = slot(device);
    for s in [&m.bytes, &m.count] {
        s.peak.store(s.current.load(Relaxed), Relaxed);
    }
}

pub fn reset_accumulated(device: usize) {
    let m = slot(device);
    for s in [&m.bytes, &m.count] {
        s.allocated.store(0, Relaxed);
        s.freed.store(0, Relaxed);
    }
    m.ooms.store(0, Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_peaks_and_limits() {
        let d = MAX_DEVICES - 1; // a slot no other test uses
        on_alloc(d, 100);
        on_alloc(d, 50);
        on_free(d, 100);
        let s = stats(d);
        assert_eq!(s.bytes, [50, 150, 150, 100]);
        assert_eq!(s.count, [1, 2, 2, 1]);
        reset_peak(d);
        assert_eq!(stats(d).bytes[1], 50);
        slot(d).limit.store(120, Relaxed);
        assert!(admit(d, 70).is_ok());
        let e = admit(d, 71).unwrap_err();
        assert_eq!(e.kind, ErrorKind::OutOfMemory);
        assert!(e.msg.contains("Tried to allocate 71"), "{}", e.msg);
        assert_eq!(stats(d).ooms, 1);
        assert!(set_fraction(d, 1.5).is_err());
        on_free(d, 50);
    }
}
