//! The on-disk level of the compilation cache, behind `Runtime::compile`.
//!
//! An entry is one file `<key>.pjrt` holding a serialized PJRT executable: magic, format
//! version, key, payload length, payload, then the SHA-256 of everything before it. The key
//! is a SHA-256 of everything the compiled program depends on: the compiler's identity
//! (plugin file, platform name and version, PJRT API version, torch_pjrt version, XLA_FLAGS
//! and LIBTPU_INIT_ARGS), the device kind, the compile options and the StableHLO text.
//!
//! Entries are written to a temp file in the same directory, fsynced and renamed, so other
//! threads, processes and hosts (on a shared filesystem) see a whole entry or none. An
//! unusable entry is reported once, recompiled and overwritten. A directory that cannot be
//! written turns the disk level off for the process (one warning); the in-memory caches
//! keep working. Reads touch an entry's mtime; a write that takes the directory past the
//! size cap evicts the least recently used entries.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use crate::metrics::Metrics;

const MAGIC: &[u8; 8] = b"TPJRTEXE";
const FORMAT: u32 = 1;
/// Magic, format, key, payload length.
const HEADER: usize = 8 + 4 + 32 + 8;
const SUM: usize = 32;
const EXT: &str = "pjrt";
pub const DEFAULT_MAX_BYTES: u64 = 10 << 30;
/// Eviction goes down to this fraction of the cap so that the next writes do not rescan.
const EVICT_TO: f64 = 0.9;
/// Temp files older than this are leftovers of killed writers.
const STALE_TMP: Duration = Duration::from_secs(3600);
/// How much of the plugin file's start and end is hashed into its identity.
const PLUGIN_SAMPLE: u64 = 64 << 10;

pub type Key = [u8; 32];

/// What identifies the compiler. The plugin file is identified by content (size and hashes
/// of its first and last 64 KiB: ELF headers, build id, section table) rather than mtime,
/// so that identical installations on several hosts share entries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Identity {
    pub plugin_path: String,
    pub plugin_size: u64,
    pub plugin_sample: [u8; 32],
    pub platform_name: String,
    pub platform_version: String,
    pub api_version: (i32, i32),
    pub torch_pjrt_version: String,
    /// Environment variables through which plugins take compiler flags.
    pub compiler_env: String,
}

const COMPILER_ENV: [&str; 2] = ["XLA_FLAGS", "LIBTPU_INIT_ARGS"];

fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// SHA-256 of the first and last `PLUGIN_SAMPLE` bytes of a file (zeros if unreadable).
fn sample_hash(path: &Path, size: u64) -> [u8; 32] {
    use std::io::{Read, Seek, SeekFrom};
    let read = || -> std::io::Result<[u8; 32]> {
        let mut f = std::fs::File::open(path)?;
        let mut h = Sha256::new();
        let mut buf = Vec::new();
        (&mut f).take(PLUGIN_SAMPLE).read_to_end(&mut buf)?;
        h.update(&buf);
        buf.clear();
        f.seek(SeekFrom::Start(size.saturating_sub(PLUGIN_SAMPLE)))?;
        f.take(PLUGIN_SAMPLE).read_to_end(&mut buf)?;
        h.update(&buf);
        Ok(h.finalize().into())
    };
    read().unwrap_or_default()
}

impl Identity {
    pub fn of(client: &pjrt::Client) -> Identity {
        let plugin = client.plugin();
        let path =
            std::fs::canonicalize(plugin.path()).unwrap_or_else(|_| plugin.path().to_path_buf());
        let size = std::fs::metadata(&path).map_or(0, |m| m.len());
        Identity {
            plugin_sample: sample_hash(&path, size),
            plugin_path: path.display().to_string(),
            plugin_size: size,
            platform_name: client.platform_name(),
            platform_version: client.platform_version(),
            api_version: plugin.api_version(),
            torch_pjrt_version: env!("CARGO_PKG_VERSION").to_string(),
            compiler_env: COMPILER_ENV
                .iter()
                .map(|k| format!("{k}={}\n", std::env::var(k).unwrap_or_default()))
                .collect(),
        }
    }

    pub fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        field(&mut h, b"torch_pjrt compiler");
        field(&mut h, self.plugin_path.as_bytes());
        field(&mut h, &self.plugin_size.to_le_bytes());
        field(&mut h, &self.plugin_sample);
        field(&mut h, self.platform_name.as_bytes());
        field(&mut h, self.platform_version.as_bytes());
        field(&mut h, &self.api_version.0.to_le_bytes());
        field(&mut h, &self.api_version.1.to_le_bytes());
        field(&mut h, self.torch_pjrt_version.as_bytes());
        field(&mut h, self.compiler_env.as_bytes());
        h.finalize().into()
    }
}

/// The key of `mlir` compiled with `compile_options` for a `device_kind` device by the
/// compiler whose `Identity::digest` is `identity`.
pub fn key(identity: &[u8; 32], device_kind: &str, compile_options: &[u8], mlir: &str) -> Key {
    let mut h = Sha256::new();
    field(&mut h, &FORMAT.to_le_bytes());
    field(&mut h, identity);
    field(&mut h, device_kind.as_bytes());
    field(&mut h, compile_options);
    field(&mut h, mlir.as_bytes());
    h.finalize().into()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn entry_name(key: &Key) -> String {
    format!("{}.{EXT}", hex(key))
}

/// The bytes of an entry holding `payload`.
pub fn encode(key: &Key, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + payload.len() + SUM);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    let sum: [u8; 32] = Sha256::digest(&out).into();
    out.extend_from_slice(&sum);
    out
}

/// The payload of an entry, or why it is unusable.
pub fn decode<'a>(bytes: &'a [u8], key: &Key) -> std::result::Result<&'a [u8], String> {
    if bytes.len() < HEADER + SUM {
        return Err(format!("truncated ({} bytes)", bytes.len()));
    }
    if &bytes[..8] != MAGIC {
        return Err("not a torch_pjrt cache entry".into());
    }
    let format = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or_default());
    if format != FORMAT {
        return Err(format!("entry format {format}, expected {FORMAT}"));
    }
    let len = u64::from_le_bytes(bytes[44..52].try_into().unwrap_or_default());
    let want = (HEADER as u64)
        .saturating_add(len)
        .saturating_add(SUM as u64);
    if want != bytes.len() as u64 {
        return Err(format!(
            "{} bytes, the header says {want} (truncated or appended to)",
            bytes.len()
        ));
    }
    let body = bytes.len() - SUM;
    let sum: [u8; 32] = Sha256::digest(&bytes[..body]).into();
    if sum[..] != bytes[body..] {
        return Err("checksum mismatch".into());
    }
    if &bytes[12..44] != key {
        return Err("it holds another key".into());
    }
    Ok(&bytes[HEADER..body])
}

/// Writes `dir/name` atomically: temp file in `dir`, fsync, rename.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    std::fs::create_dir_all(dir)?;
    // pid + time + sequence: unique across threads, processes and (practically) hosts.
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}.{nanos}.{seq}.tmp", std::process::id()));
    let written = (|| {
        let mut f = std::fs::File::create_new(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, dir.join(name))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    // Make the rename durable too; not every filesystem can sync a directory.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Marks an entry as just used (LRU order); failures only make eviction less precise.
fn touch(path: &Path) {
    if let Ok(f) = std::fs::File::options().write(true).open(path) {
        let _ = f.set_modified(SystemTime::now());
    }
}

struct Entry {
    path: PathBuf,
    size: u64,
    mtime: SystemTime,
}

fn is_tmp(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(".tmp")
}

/// The entries of `dir`; also deletes temp files left by killed writers.
fn scan(dir: &Path) -> Vec<Entry> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let now = SystemTime::now();
    let mut out = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let Ok(meta) = e.metadata() else { continue };
        let mtime = meta.modified().unwrap_or(UNIX_EPOCH);
        if is_tmp(&name) {
            if now.duration_since(mtime).is_ok_and(|age| age > STALE_TMP) {
                let _ = std::fs::remove_file(e.path());
            }
        } else if meta.is_file() && name.ends_with(&format!(".{EXT}")) {
            out.push(Entry {
                path: e.path(),
                size: meta.len(),
                mtime,
            });
        }
    }
    out
}

/// Deletes the least recently used entries (never `keep`) until at most `target` bytes
/// remain; returns the bytes that remain.
fn evict(dir: &Path, target: u64, keep: &str) -> u64 {
    let mut entries = scan(dir);
    let mut total: u64 = entries.iter().map(|e| e.size).sum();
    entries.sort_by_key(|e| e.mtime);
    for e in entries {
        if total <= target {
            break;
        }
        if e.path.file_name().is_some_and(|n| n == keep) {
            continue;
        }
        // Another process may have removed it already; it is gone either way.
        let _ = std::fs::remove_file(&e.path);
        total = total.saturating_sub(e.size);
    }
    total
}

/// The directory in effect at start: `TORCH_TPU_CACHE_DIR` ("" turns the disk cache off),
/// else `$XDG_CACHE_HOME/torch_pjrt`, else `~/.cache/torch_pjrt`.
pub fn dir_from_env() -> Option<PathBuf> {
    match std::env::var_os("TORCH_TPU_CACHE_DIR") {
        Some(v) if v.is_empty() => None,
        Some(v) => Some(PathBuf::from(v)),
        None => {
            let xdg = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .filter(|p| p.is_absolute());
            let home = || {
                std::env::var_os("HOME")
                    .filter(|h| !h.is_empty())
                    .map(|h| PathBuf::from(h).join(".cache"))
            };
            Some(xdg.or_else(home)?.join("torch_pjrt"))
        }
    }
}

struct State {
    dir: Option<PathBuf>,
    /// False once a write failed: the disk level is read-only for the process.
    writable: bool,
    /// Bytes in the directory as far as this process knows; None: scan at the next write.
    approx_bytes: Option<u64>,
}

/// What `cache_info` reports about the directory.
#[derive(Debug, Clone, Default)]
pub struct Info {
    pub dir: Option<PathBuf>,
    pub entries: usize,
    pub bytes: u64,
    pub writable: bool,
    pub max_bytes: u64,
    pub corrupt_entries: u64,
}

pub struct DiskCache {
    identity: [u8; 32],
    /// Per device: its kind and its compile options.
    devices: Vec<(String, Vec<u8>)>,
    max_bytes: u64,
    state: Mutex<State>,
    evicting: Mutex<()>,
    corrupt: AtomicU64,
    warned_corrupt: AtomicBool,
    warned_write: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn absolute(p: PathBuf) -> PathBuf {
    std::path::absolute(&p).unwrap_or(p)
}

impl DiskCache {
    pub fn new(client: &pjrt::Client) -> DiskCache {
        let devices = (0..client.num_devices())
            .map(|d| {
                (
                    client.device_kind(d),
                    client.compile_options(d).unwrap_or_default(),
                )
            })
            .collect();
        let max_bytes = std::env::var("TORCH_TPU_CACHE_MAX_BYTES")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_MAX_BYTES);
        DiskCache {
            identity: Identity::of(client).digest(),
            devices,
            max_bytes,
            state: Mutex::new(State {
                dir: dir_from_env().map(absolute),
                writable: true,
                approx_bytes: None,
            }),
            evicting: Mutex::new(()),
            corrupt: AtomicU64::new(0),
            warned_corrupt: AtomicBool::new(false),
            warned_write: AtomicBool::new(false),
        }
    }

    pub fn dir(&self) -> Option<PathBuf> {
        lock(&self.state).dir.clone()
    }

    /// Switches to `dir` (None: no disk cache); a new directory gets a new chance to be written.
    pub fn set_dir(&self, dir: Option<PathBuf>) {
        *lock(&self.state) = State {
            dir: dir.map(absolute),
            writable: true,
            approx_bytes: None,
        };
        self.warned_write.store(false, Ordering::Relaxed);
    }

    /// The key of `mlir` for `device`; None when the disk cache is off.
    /// `extra`: the bytes of options added for this compilation (see `options`).
    pub fn key(&self, mlir: &str, device: usize, extra: &[u8]) -> Option<Key> {
        lock(&self.state).dir.as_ref()?;
        let (kind, opts) = self.devices.get(device)?;
        if extra.is_empty() {
            return Some(key(&self.identity, kind, opts, mlir));
        }
        let all = [opts.as_slice(), extra].concat();
        Some(key(&self.identity, kind, &all, mlir))
    }

    /// The executable stored under `key`, loaded onto `device`; None (a disk miss) when
    /// absent or unusable.
    /// Whether an entry exists (not whether it loads).
    pub fn contains(&self, key: &Key) -> bool {
        self.dir().is_some_and(|d| d.join(entry_name(key)).exists())
    }

    pub fn load(
        &self,
        client: &pjrt::Client,
        metrics: &Metrics,
        key: &Key,
        device: usize,
        extra: &[(String, pjrt::OptionValue)],
    ) -> Option<pjrt::Executable> {
        let path = self.dir()?.join(entry_name(key));
        let t0 = Instant::now();
        let why = match std::fs::read(&path) {
            // Absent, or a directory we cannot read: an ordinary miss.
            Err(_) => None,
            Ok(bytes) => match decode(&bytes, key) {
                Err(why) => Some(why),
                Ok(payload) => match client.deserialize_with(payload, device, extra) {
                    Ok(exe) => {
                        touch(&path);
                        metrics.loaded(t0.elapsed().as_secs_f64());
                        return Some(exe);
                    }
                    Err(e) => Some(format!("the PJRT plugin could not load it: {}", e.message)),
                },
            },
        };
        metrics.disk_misses.fetch_add(1, Ordering::Relaxed);
        if let Some(why) = why {
            self.corrupt.fetch_add(1, Ordering::Relaxed);
            if !self.warned_corrupt.swap(true, Ordering::Relaxed) {
                crate::warn(&format!(
                    "torch_pjrt: ignoring unusable compilation cache entry {} ({why}); recompiling and \
                     overwriting it (further unusable entries are not reported)",
                    path.display()
                ));
            }
        }
        None
    }

    /// Stores `exe` under `key` if the directory can be written.
    pub fn store(&self, key: &Key, exe: &pjrt::Executable) {
        let dir = {
            let st = lock(&self.state);
            match (&st.dir, st.writable) {
                (Some(d), true) => d.clone(),
                _ => return,
            }
        };
        let payload = match exe.serialize() {
            Ok(p) => p,
            Err(e) => {
                return self.write_failed(
                    &dir,
                    &format!(
                        "the PJRT plugin cannot serialize executables: {}",
                        e.message
                    ),
                )
            }
        };
        let entry = encode(key, &payload);
        let name = entry_name(key);
        if let Err(e) = write_atomic(&dir, &name, &entry) {
            return self.write_failed(&dir, &e.to_string());
        }
        self.account(&dir, &name, entry.len() as u64);
    }

    fn write_failed(&self, dir: &Path, why: &str) {
        {
            let mut st = lock(&self.state);
            if st.dir.as_deref() != Some(dir) {
                return;
            }
            st.writable = false;
        }
        if !self.warned_write.swap(true, Ordering::Relaxed) {
            crate::warn(&format!(
                "torch_pjrt: cannot write the compilation cache in {} ({why}); compiled programs are \
                 cached in memory only in this process. Set TORCH_TPU_CACHE_DIR to a writable \
                 directory, or to \"\" to turn the disk cache off.",
                dir.display()
            ));
        }
    }

    /// Counts a written entry; evicts when the directory went past the cap.
    fn account(&self, dir: &Path, name: &str, n: u64) {
        let over = {
            let mut st = lock(&self.state);
            if st.dir.as_deref() != Some(dir) {
                return;
            }
            match st.approx_bytes {
                Some(b) => {
                    st.approx_bytes = Some(b + n);
                    b + n > self.max_bytes
                }
                None => true,
            }
        };
        if !over {
            return;
        }
        // One evicting thread is enough; the others' writes are counted at its next scan.
        let Ok(_g) = self.evicting.try_lock() else {
            return;
        };
        let target = if lock(&self.state).approx_bytes.is_none() {
            self.max_bytes
        } else {
            (self.max_bytes as f64 * EVICT_TO) as u64
        };
        let total = evict(dir, target, name);
        let mut st = lock(&self.state);
        if st.dir.as_deref() == Some(dir) {
            st.approx_bytes = Some(total);
        }
    }

    /// Deletes every entry of the directory; returns how many.
    pub fn clear(&self) -> usize {
        let Some(dir) = self.dir() else { return 0 };
        let _g = lock(&self.evicting);
        let mut n = 0;
        for e in scan(&dir) {
            if std::fs::remove_file(&e.path).is_ok() {
                n += 1;
            }
        }
        let mut st = lock(&self.state);
        if st.dir.as_deref() == Some(dir.as_path()) {
            st.approx_bytes = None;
        }
        n
    }

    pub fn info(&self) -> Info {
        let (dir, writable) = {
            let st = lock(&self.state);
            (st.dir.clone(), st.writable)
        };
        let entries = dir.as_deref().map(scan).unwrap_or_default();
        Info {
            entries: entries.len(),
            bytes: entries.iter().map(|e| e.size).sum(),
            dir,
            writable,
            max_bytes: self.max_bytes,
            corrupt_entries: self.corrupt.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident() -> Identity {
        Identity {
            plugin_path: "/site-packages/xla_cpu_pjrt.so".into(),
            plugin_size: 123_456,
            plugin_sample: [7; 32],
            platform_name: "cpu".into(),
            platform_version: "0.1".into(),
            api_version: (0, 60),
            torch_pjrt_version: "0.1.0".into(),
            compiler_env: String::new(),
        }
    }

    #[test]
    fn key_depends_on_everything_that_changes_the_program() {
        let base = ident();
        let k =
            |i: &Identity, kind: &str, opts: &[u8], mlir: &str| key(&i.digest(), kind, opts, mlir);
        let k0 = k(&base, "cpu", b"dev0", "module {}");
        assert_eq!(
            k0,
            k(&base.clone(), "cpu", b"dev0", "module {}"),
            "deterministic"
        );
        assert_ne!(k0, k(&base, "cpu", b"dev1", "module {}"), "compile options");
        assert_ne!(k0, k(&base, "tpu v5", b"dev0", "module {}"), "device kind");
        assert_ne!(k0, k(&base, "cpu", b"dev0", "module { }"), "program text");
        type Change = fn(&mut Identity);
        let changes: [(&str, Change); 8] = [
            ("plugin path", |i| i.plugin_path.push('x')),
            ("plugin size", |i| i.plugin_size += 1),
            ("plugin bytes", |i| i.plugin_sample[0] ^= 1),
            ("platform name", |i| i.platform_name = "cuda".into()),
            ("platform version", |i| i.platform_version = "0.2".into()),
            ("api version", |i| i.api_version.1 += 1),
            ("XLA_FLAGS", |i| {
                i.compiler_env = "XLA_FLAGS=--xla_cpu_fast_math\n".into()
            }),
            ("torch_pjrt version", |i| {
                i.torch_pjrt_version = "0.2.0".into()
            }),
        ];
        for (what, change) in changes {
            let mut i = base.clone();
            change(&mut i);
            assert_ne!(k0, k(&i, "cpu", b"dev0", "module {}"), "{what}");
        }
        // Fields are length-prefixed: moving bytes between fields changes the key.
        assert_ne!(
            k(&base, "cpu", b"dev0", "module {}"),
            k(&base, "cpud", b"ev0", "module {}")
        );
    }

    #[test]
    fn entries_round_trip_and_bad_ones_are_named() {
        let key = [3u8; 32];
        let e = encode(&key, b"payload bytes");
        assert_eq!(decode(&e, &key).unwrap(), b"payload bytes");
        assert!(decode(&e[..e.len() - 1], &key)
            .unwrap_err()
            .contains("truncated"));
        assert!(decode(&e[..10], &key).unwrap_err().contains("truncated"));
        let mut flipped = e.clone();
        flipped[HEADER + 2] ^= 0x40;
        assert!(decode(&flipped, &key).unwrap_err().contains("checksum"));
        let random: Vec<u8> = (0..500u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        assert!(decode(&random, &key)
            .unwrap_err()
            .contains("not a torch_pjrt"));
        assert!(decode(&e, &[4u8; 32]).unwrap_err().contains("another key"));
    }

    #[test]
    fn directory_from_environment() {
        // The only test touching these variables.
        std::env::set_var("TORCH_TPU_CACHE_DIR", "");
        assert_eq!(dir_from_env(), None);
        std::env::set_var("TORCH_TPU_CACHE_DIR", "/x/y");
        assert_eq!(dir_from_env(), Some(PathBuf::from("/x/y")));
        std::env::remove_var("TORCH_TPU_CACHE_DIR");
        std::env::set_var("XDG_CACHE_HOME", "/xdg");
        assert_eq!(dir_from_env(), Some(PathBuf::from("/xdg/torch_pjrt")));
        std::env::remove_var("XDG_CACHE_HOME");
        std::env::set_var("HOME", "/home/u");
        assert_eq!(
            dir_from_env(),
            Some(PathBuf::from("/home/u/.cache/torch_pjrt"))
        );
    }

    #[test]
    fn atomic_writes_and_lru_eviction() {
        let dir =
            std::env::temp_dir().join(format!("torch_pjrt_diskcache_test_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let old = SystemTime::now() - Duration::from_secs(100);
        for (i, name) in ["a.pjrt", "b.pjrt", "c.pjrt"].iter().enumerate() {
            write_atomic(&dir, name, &[0u8; 100]).unwrap();
            let f = std::fs::File::options()
                .write(true)
                .open(dir.join(name))
                .unwrap();
            f.set_modified(old + Duration::from_secs(10 * i as u64))
                .unwrap();
        }
        // No temp files are left behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 3);
        touch(&dir.join("a.pjrt"));
        // Over a 250-byte cap: b is the least recently used, then c.
        assert_eq!(evict(&dir, 250, "none"), 200);
        assert!(!dir.join("b.pjrt").exists());
        assert_eq!(evict(&dir, 0, "c.pjrt"), 100);
        assert!(dir.join("c.pjrt").exists() && !dir.join("a.pjrt").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
