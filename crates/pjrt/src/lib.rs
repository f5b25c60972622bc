//! Safe bindings to a PJRT plugin (XLA) through the PJRT C API.
//!
//! The plugin shared library is `dlopen`ed at run time ([`Plugin::load`]). The
//! C API header comes from the `xla-cpu-pjrt` wheel at build time and is used
//! only by a small C shim (`csrc/pjrt_wrap.c`) with a flat API declared in
//! `ffi.rs`. Programs are StableHLO MLIR text compiled for a single device.

mod ffi;

use std::ffi::{c_char, c_int, c_void, CString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::{Arc, Mutex};

/// A PJRT error: PJRT_Error_Code (absl status code) and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub code: i32,
    pub message: String,
}

/// PJRT_Error_Code values used for errors raised by this crate itself.
pub mod code {
    pub const INVALID_ARGUMENT: i32 = 3;
    pub const NOT_FOUND: i32 = 5;
    pub const UNIMPLEMENTED: i32 = 12;
    pub const INTERNAL: i32 = 13;
}

impl Error {
    pub fn new(code: i32, message: impl Into<String>) -> Self {
        let message = message.into();
        Error { code, message }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PJRT error (code {}): {}", self.code, self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

fn invalid(message: impl Into<String>) -> Error {
    Error::new(code::INVALID_ARGUMENT, message)
}

/// Converts a wrapper error (NULL = success) into a `Result`, freeing it.
fn check(e: ffi::Err) -> Result<()> {
    if e.is_null() {
        return Ok(());
    }
    let mut len = 0usize;
    // SAFETY: `e` is a live error from the wrapper; its message is valid for
    // `len` bytes until `pw_err_free`, which runs exactly once, after the copy.
    unsafe {
        let message = String::from_utf8_lossy(slice(ffi::pw_err_msg(e, &mut len), len)).into();
        let code = ffi::pw_err_code(e);
        ffi::pw_err_free(e);
        Err(Error { code, message })
    }
}

/// `(ptr, len)` as a slice; NULL gives an empty slice.
///
/// # Safety
/// `p` must be NULL or valid for reads of `n` elements for `'a`.
unsafe fn slice<'a, T, U>(p: *const T, n: usize) -> &'a [U] {
    if p.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: guaranteed by the caller; T and U have the same layout at call sites.
    unsafe { std::slice::from_raw_parts(p.cast::<U>(), n) }
}

/// Calls a wrapper function returning a malloc'd `(char*, size)` and copies it out.
fn malloced(f: impl FnOnce(*mut *mut c_char, *mut usize) -> ffi::Err) -> Result<Vec<u8>> {
    let (mut p, mut n) = (ptr::null_mut(), 0usize);
    check(f(&mut p, &mut n))?;
    // SAFETY: on success `p` is NULL or a malloc'd block of `n` bytes that we
    // own; it is copied, then freed once.
    unsafe {
        let v = slice::<c_char, u8>(p, n).to_vec();
        ffi::pw_free(p.cast::<c_void>());
        Ok(v)
    }
}

/// Array element types (the PJRT_Buffer_Type values PRED..C128).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementType {
    Pred,
    S8,
    S16,
    S32,
    S64,
    U8,
    U16,
    U32,
    U64,
    F16,
    F32,
    F64,
    BF16,
    C64,
    C128,
}

impl ElementType {
    const ALL: [ElementType; 15] = {
        use ElementType::*;
        [
            Pred, S8, S16, S32, S64, U8, U16, U32, U64, F16, F32, F64, BF16, C64, C128,
        ]
    };

    /// Size of one element in bytes (PRED is one byte).
    pub fn byte_size(self) -> usize {
        use ElementType::*;
        match self {
            Pred | S8 | U8 => 1,
            S16 | U16 | F16 | BF16 => 2,
            S32 | U32 | F32 => 4,
            S64 | U64 | F64 | C64 => 8,
            C128 => 16,
        }
    }

    /// The PJRT_Buffer_Type enum value (PRED = 1 ... BF16 = 13, C64 = 14, C128 = 15).
    pub fn to_pjrt(self) -> i32 {
        self as i32 + 1
    }

    /// Inverse of [`ElementType::to_pjrt`]; `None` for types not modelled here.
    pub fn from_pjrt(v: i32) -> Option<Self> {
        usize::try_from(v - 1)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
    }
}

// ----------------------------------------------------------------- Plugin --

/// APIs for which PJRT_Plugin_Initialize ran (it must run once per process).
static INITIALIZED: Mutex<Vec<(usize, Result<()>)>> = Mutex::new(Vec::new());

/// A loaded PJRT plugin shared library (never unloaded).
pub struct Plugin {
    api: ffi::Api,
    path: PathBuf,
}

// SAFETY: the PJRT_Api table is immutable static data of a library that is
// never unloaded, and PJRT entry points may be called from any thread.
unsafe impl Send for Plugin {}
// SAFETY: see above.
unsafe impl Sync for Plugin {}

impl fmt::Debug for Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Plugin({}, api {:?})",
            self.path.display(),
            self.api_version()
        )
    }
}

impl Plugin {
    /// `dlopen`s `path` and fetches its `GetPjrtApi` table.
    pub fn load(path: &Path) -> Result<Arc<Plugin>> {
        if !path.is_file() {
            let msg = format!("PJRT plugin {} does not exist", path.display());
            return Err(Error::new(code::NOT_FOUND, msg));
        }
        let cpath = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| invalid("plugin path contains NUL"))?;
        let mut api: ffi::Api = ptr::null();
        // SAFETY: `cpath` is a valid C string; `api` is a valid out pointer.
        check(unsafe { ffi::pw_load(cpath.as_ptr(), &mut api) })?;
        Ok(Arc::new(Plugin {
            api,
            path: path.to_path_buf(),
        }))
    }

    /// The PJRT C API version (major, minor) the plugin was built with.
    pub fn api_version(&self) -> (i32, i32) {
        let (mut major, mut minor): (c_int, c_int) = (0, 0);
        // SAFETY: `self.api` is a valid PJRT_Api table; outputs are valid pointers.
        unsafe { ffi::pw_api_version(self.api, &mut major, &mut minor) };
        (major, minor)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A plugin attribute (`PJRT_Plugin_Attributes`, e.g. `stablehlo_current_version`) as
    /// text (int64 lists joined with '.'); None when the plugin does not report it.
    pub fn attribute(&self, name: &str) -> Result<Option<String>> {
        let cname = CString::new(name).map_err(|_| invalid("attribute name contains NUL"))?;
        let mut buf = vec![0u8; 1024];
        let mut n = 0usize;
        // SAFETY: `self.api` is a valid PJRT_Api table; `buf` holds `buf.len()` bytes and
        // the wrapper writes at most that many (NUL included); `n` is a valid out pointer.
        check(unsafe {
            ffi::pw_plugin_attribute(
                self.api,
                cname.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut n,
            )
        })?;
        Ok((n > 0).then(|| String::from_utf8_lossy(&buf[..n]).into_owned()))
    }

    /// Runs PJRT_Plugin_Initialize once per process for this plugin.
    fn initialize(&self) -> Result<()> {
        let mut done = INITIALIZED.lock().unwrap_or_else(|p| p.into_inner());
        let key = self.api as usize;
        if let Some((_, r)) = done.iter().find(|(k, _)| *k == key) {
            return r.clone();
        }
        // SAFETY: `self.api` is a valid PJRT_Api table.
        let r = check(unsafe { ffi::pw_plugin_initialize(self.api) });
        done.push((key, r.clone()));
        r
    }
}

// ----------------------------------------------------------------- Client --

struct ClientInner {
    plugin: Arc<Plugin>,
    raw: ffi::Handle,
    devices: Vec<ffi::Handle>,
    device_kinds: Vec<String>,
    device_ids: Vec<i64>,
    platform: [String; 2],
    /// Compile options set by name (`CompileOptionsProto.env_option_overrides`).
    overrides: Vec<(String, OptionValue)>,
}

// SAFETY: a PJRT_Client is thread-safe; device handles are immutable objects
// owned by the client, which this struct keeps alive.
unsafe impl Send for ClientInner {}
// SAFETY: see above.
unsafe impl Sync for ClientInner {}

impl ClientInner {
    /// PJRT_Client_Compile of `mlir` with serialized compile options `opts`.
    fn compile_raw(&self, mlir: &str, opts: &[u8]) -> Result<ffi::Handle> {
        let (code, copts) = (mlir.as_ptr().cast(), opts.as_ptr().cast());
        let mut raw: ffi::Handle = ptr::null_mut();
        // SAFETY: live client; inputs are valid for their lengths during the call.
        check(unsafe {
            ffi::pw_compile(
                self.api(),
                self.raw,
                code,
                mlir.len(),
                copts,
                opts.len(),
                &mut raw,
            )
        })?;
        Ok(raw)
    }

    fn api(&self) -> ffi::Api {
        self.plugin.api
    }

    fn device_index(&self, dev: ffi::Handle) -> Result<usize> {
        let found = self.devices.iter().position(|d| *d == dev);
        found.ok_or_else(|| Error::new(code::INTERNAL, "PJRT returned a non-addressable device"))
    }

    fn device(&self, i: usize) -> Result<ffi::Handle> {
        let n = self.devices.len();
        self.devices
            .get(i)
            .copied()
            .ok_or_else(|| invalid(format!("device {i} out of range ({n} devices)")))
    }
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        if in_forked_child() {
            return;
        }
        // SAFETY: `raw` is a live client; buffers and executables hold an Arc
        // to this object, so none outlive it. Errors cannot be reported here.
        let _ = check(unsafe { ffi::pw_client_destroy(self.api(), self.raw) });
    }
}

/// A PJRT client owning the plugin's addressable devices.
pub struct Client {
    inner: Arc<ClientInner>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Client({}, {} devices)",
            self.inner.platform[0],
            self.num_devices()
        )
    }
}

impl Client {
    /// Initializes the plugin (once per process), then creates a client with no options.
    pub fn new(plugin: Arc<Plugin>) -> Result<Arc<Client>> {
        Self::with_overrides(plugin, &[])
    }

    /// As `new`; every compilation also sets these XLA options by name (`DebugOptions`
    /// fields such as `xla_allow_excess_precision`). The plugin rejects names it does not
    /// know when compiling.
    pub fn with_overrides(
        plugin: Arc<Plugin>,
        overrides: &[(&str, OptionValue)],
    ) -> Result<Arc<Client>> {
        plugin.initialize()?;
        watch_fork();
        let api = plugin.api;
        let mut raw: ffi::Handle = ptr::null_mut();
        // SAFETY: `api` is valid; `raw` is a valid out pointer.
        check(unsafe { ffi::pw_client_create(api, &mut raw) })?;
        let mut c = ClientInner {
            plugin,
            raw,
            devices: vec![],
            device_kinds: vec![],
            device_ids: vec![],
            platform: Default::default(),
            overrides: overrides
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        };
        for (which, out) in c.platform.iter_mut().enumerate() {
            let (mut s, mut n) = (ptr::null(), 0usize);
            // SAFETY: live client; on success `s` is valid for `n` bytes while it lives.
            unsafe {
                check(ffi::pw_client_string(
                    api,
                    raw,
                    which as c_int,
                    &mut s,
                    &mut n,
                ))?;
                *out = String::from_utf8_lossy(slice(s, n)).into();
            }
        }
        let (mut devs, mut n) = (ptr::null(), 0usize);
        // SAFETY: live client; PJRT returns `n` device handles owned by the client.
        unsafe {
            check(ffi::pw_client_devices(api, raw, &mut devs, &mut n))?;
            c.devices = slice(devs, n).to_vec();
        }
        for &d in &c.devices {
            let (mut s, mut n, mut id) = (ptr::null(), 0usize, 0 as c_int);
            // SAFETY: `d` is a device of the live client; `s` is valid for `n` bytes.
            unsafe {
                check(ffi::pw_device_info(api, d, &mut s, &mut n, &mut id))?;
                c.device_kinds
                    .push(String::from_utf8_lossy(slice(s, n)).into());
            }
            c.device_ids.push(i64::from(id));
        }
        Ok(Arc::new(Client { inner: Arc::new(c) }))
    }

    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.inner.plugin
    }

    pub fn platform_name(&self) -> String {
        self.inner.platform[0].clone()
    }

    pub fn platform_version(&self) -> String {
        self.inner.platform[1].clone()
    }

    /// Number of addressable devices; device indices are `0..num_devices()`.
    pub fn num_devices(&self) -> usize {
        self.inner.devices.len()
    }

    /// Device kind of device `i` (empty if `i` is out of range).
    pub fn device_kind(&self, i: usize) -> String {
        self.inner.device_kinds.get(i).cloned().unwrap_or_default()
    }

    /// The plugin's memory statistics for `device` (`PJRT_Device_MemoryStats`), or None
    /// where the plugin keeps none (the CPU plugin).
    pub fn memory_stats(&self, device: usize) -> Result<Option<MemoryStats>> {
        let c = &self.inner;
        let dev = c.device(device)?;
        let (mut in_use, mut peak, mut limit, mut limit_set) = (0i64, -1i64, 0i64, 0);
        // SAFETY: live client device; every out pointer is valid for the call.
        let r = check(unsafe {
            ffi::pw_device_memory(
                c.api(),
                dev,
                &mut in_use,
                &mut peak,
                &mut limit,
                &mut limit_set,
            )
        });
        match r {
            Ok(()) => Ok(Some(MemoryStats {
                bytes_in_use: in_use,
                peak_bytes_in_use: (peak >= 0).then_some(peak),
                bytes_limit: (limit_set != 0).then_some(limit),
            })),
            Err(e) if e.code == code::UNIMPLEMENTED => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Compiles StableHLO MLIR text (with a public `func.func @main`) for `device`.
    pub fn compile(&self, mlir: &str, device: usize) -> Result<Executable> {
        self.compile_with(mlir, device, &[])
    }

    /// `compile` with more XLA options by name (overriding the client's).
    pub fn compile_with(
        &self,
        mlir: &str,
        device: usize,
        extra: &[(String, OptionValue)],
    ) -> Result<Executable> {
        let c = &self.inner;
        c.device(device)?;
        let opts = compile_options(device, c.device_ids[device], &c.overrides, extra);
        let raw = c.compile_raw(mlir, &opts)?;
        Executable::from_raw(c, raw, &[device])
    }

    /// Compiles `mlir` with one replica on each of `devices` (in replica order): one program
    /// whose collectives (`stablehlo.all_reduce` with `replica_groups`, ...) run across
    /// them. [`Executable::execute_replicated`] runs it.
    pub fn compile_replicated(&self, mlir: &str, devices: &[usize]) -> Result<Executable> {
        let c = &self.inner;
        if devices.is_empty() {
            return Err(invalid("a replicated program needs at least one device"));
        }
        let ids = devices
            .iter()
            .map(|d| c.device(*d).map(|_| c.device_ids[*d]))
            .collect::<Result<Vec<i64>>>()?;
        let opts = options_proto(-1, &ids, &c.overrides, &[]);
        let raw = c.compile_raw(mlir, &opts)?;
        Executable::from_raw(c, raw, devices)
    }

    /// The serialized compile options [`Client::compile`] passes for `device` (part of
    /// what a compiled program depends on, e.g. for cache keys).
    pub fn compile_options(&self, device: usize) -> Result<Vec<u8>> {
        let c = &self.inner;
        c.device(device)?;
        Ok(compile_options(
            device,
            c.device_ids[device],
            &c.overrides,
            &[],
        ))
    }

    /// Loads an executable produced by [`Executable::serialize`] onto `device`.
    pub fn deserialize(&self, bytes: &[u8], device: usize) -> Result<Executable> {
        self.deserialize_with(bytes, device, &[])
    }

    /// `deserialize` with the extra options the executable was compiled with.
    pub fn deserialize_with(
        &self,
        bytes: &[u8],
        device: usize,
        extra: &[(String, OptionValue)],
    ) -> Result<Executable> {
        let c = &self.inner;
        c.device(device)?;
        let opts = compile_options(device, c.device_ids[device], &c.overrides, extra);
        let (b, o) = (bytes.as_ptr().cast(), opts.as_ptr().cast());
        let mut raw: ffi::Handle = ptr::null_mut();
        // SAFETY: live client; inputs are valid for their lengths during the call.
        check(unsafe {
            ffi::pw_deserialize(c.api(), c.raw, b, bytes.len(), o, opts.len(), &mut raw)
        })?;
        Executable::from_raw(c, raw, &[device])
    }

    /// Copies dense row-major `data` to `device`; `data` is free again on return.
    pub fn buffer_from_host(
        &self,
        data: &[u8],
        ty: ElementType,
        dims: &[i64],
        device: usize,
    ) -> Result<Buffer> {
        let c = &self.inner;
        let dev = c.device(device)?;
        let mut want = ty.byte_size();
        for &d in dims {
            let d = usize::try_from(d)
                .map_err(|_| invalid(format!("negative dimension in {dims:?}")))?;
            want = want.saturating_mul(d);
        }
        if want != data.len() {
            return Err(invalid(format!(
                "{ty:?}{dims:?} needs {want} bytes, got {}",
                data.len()
            )));
        }
        let (api, p, t) = (c.api(), data.as_ptr().cast(), ty.to_pjrt());
        let mut raw: ffi::Handle = ptr::null_mut();
        // SAFETY: live client and device; `data`/`dims` are valid for the call,
        // and the wrapper waits for done_with_host_buffer before returning.
        check(unsafe {
            ffi::pw_buffer_from_host(api, c.raw, p, t, dims.as_ptr(), dims.len(), dev, &mut raw)
        })?;
        let mut b = Buffer::wrap(c, raw);
        b.load_metadata()?;
        Ok(b)
    }
}

impl Client {
    /// A buffer over host memory the caller owns, without a copy (CPU plugin: a device
    /// buffer is host memory). `data` holds `dims` of `ty`, dense row-major, aligned as
    /// the plugin requires; `on_delete` runs once, when PJRT no longer uses the memory
    /// (also if this fails).
    pub fn view_host_memory(
        &self,
        data: *mut u8,
        ty: ElementType,
        dims: &[i64],
        device: usize,
        on_delete: Box<dyn FnOnce() + Send>,
    ) -> Result<Buffer> {
        unsafe extern "C" fn deleted(_data: *mut c_void, arg: *mut c_void) {
            // SAFETY: `arg` is the box leaked below; PJRT calls this once.
            let f = unsafe { Box::from_raw(arg as *mut Box<dyn FnOnce() + Send>) };
            // A panic must not unwind into the plugin.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        }
        let arg = Box::into_raw(Box::new(on_delete)) as *mut c_void;
        let c = &self.inner;
        let dev = match c.device(device) {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: not handed to PJRT: release it here.
                unsafe { deleted(ptr::null_mut(), arg) };
                return Err(e);
            }
        };
        let mut raw: ffi::Handle = ptr::null_mut();
        // SAFETY: live client and device; `data` stays valid until `deleted` runs (the
        // caller's contract), `dims` for the call.
        let r = check(unsafe {
            ffi::pw_buffer_view(
                c.api(),
                c.raw,
                data.cast(),
                ty.to_pjrt(),
                dims.as_ptr(),
                dims.len(),
                dev,
                Some(deleted),
                arg,
                &mut raw,
            )
        });
        if let Err(e) = r {
            if raw.is_null() {
                // SAFETY: PJRT made no buffer, so it will not call `deleted`.
                unsafe { deleted(ptr::null_mut(), arg) };
            }
            return Err(e);
        }
        let mut b = Buffer::wrap(c, raw);
        b.load_metadata()?;
        Ok(b)
    }
}

// ------------------------------------------------------ compile options --

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_int(out: &mut Vec<u8>, field: u64, v: i64) {
    put_varint(out, field << 3);
    put_varint(out, v as u64);
}

fn put_bytes(out: &mut Vec<u8>, field: u64, b: &[u8]) {
    put_varint(out, (field << 3) | 2);
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// The value of an XLA option set by name (`OptionOverrideProto`).
#[derive(Clone, Debug, PartialEq)]
pub enum OptionValue {
    Bool(bool),
    Str(String),
    Int(i64),
    Float(f64),
}

/// Serialized `xla.CompileOptionsProto` for a single-device executable:
/// executable_build_options(3) { device_ordinal(1), num_replicas(4)=1,
/// num_partitions(5)=1, device_assignment(9) { replica_count(1)=1,
/// computation_count(2)=1, computation_devices(3) { replica_device_ids(1) } } }.
/// The device assignment is what places the executable: device_ordinal alone
/// still yields the default assignment (device 0). Then env_option_overrides(7), a map
/// of option name to OptionOverrideProto { string_field(1) | bool_field(2) }.
fn compile_options(
    device_ordinal: usize,
    device_id: i64,
    client: &[(String, OptionValue)],
    extra: &[(String, OptionValue)],
) -> Vec<u8> {
    options_proto(device_ordinal as i64, &[device_id], client, extra)
}

/// `compile_options` for one replica per device of `device_ids` (num_replicas and the
/// assignment's replica_count are their number; device_ordinal -1: no single device).
fn options_proto(
    device_ordinal: i64,
    device_ids: &[i64],
    client: &[(String, OptionValue)],
    extra: &[(String, OptionValue)],
) -> Vec<u8> {
    // A map: the last entry of a name wins, so `extra` overrides the client's.
    let overrides: Vec<&(String, OptionValue)> = client.iter().chain(extra).collect();
    let replicas = device_ids.len() as i64;
    let mut computation_device = vec![];
    for id in device_ids {
        put_int(&mut computation_device, 1, *id);
    }
    let mut assignment = vec![];
    put_int(&mut assignment, 1, replicas);
    put_int(&mut assignment, 2, 1);
    put_bytes(&mut assignment, 3, &computation_device);
    let mut build = vec![];
    put_int(&mut build, 1, device_ordinal);
    put_int(&mut build, 4, replicas);
    put_int(&mut build, 5, 1);
    put_bytes(&mut build, 9, &assignment);
    let mut opts = vec![];
    put_bytes(&mut opts, 3, &build);
    for (name, value) in overrides {
        let mut v = vec![];
        match value {
            // A oneof member: written even when false or empty.
            OptionValue::Str(s) => put_bytes(&mut v, 1, s.as_bytes()),
            OptionValue::Bool(b) => put_int(&mut v, 2, i64::from(*b)),
            OptionValue::Int(i) => put_int(&mut v, 3, *i),
            OptionValue::Float(f) => {
                put_varint(&mut v, (4 << 3) | 1); // fixed64
                v.extend_from_slice(&f.to_le_bytes());
            }
        }
        let mut entry = vec![];
        put_bytes(&mut entry, 1, name.as_bytes());
        put_bytes(&mut entry, 2, &v);
        put_bytes(&mut opts, 7, &entry);
    }
    opts
}

// ----------------------------------------------------------------- Buffer --

/// An array on one device. Dropping it releases the device memory.
pub struct Buffer {
    client: Arc<ClientInner>,
    raw: ffi::Handle,
    dims: Vec<i64>,
    ty: ElementType,
    device: usize,
}

// SAFETY: PJRT_Buffer operations are thread-safe; the handle is uniquely owned.
unsafe impl Send for Buffer {}
// SAFETY: see above.
unsafe impl Sync for Buffer {}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Buffer({:?}{:?} on device {})",
            self.ty, self.dims, self.device
        )
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if !self.raw.is_null() && !in_forked_child() {
            // SAFETY: `raw` is a live buffer owned by this object; the client is alive.
            let _ = check(unsafe { ffi::pw_buffer_destroy(self.client.api(), self.raw) });
        }
    }
}

impl Buffer {
    /// Takes ownership of `raw` (NULL allowed); metadata is filled by `load_metadata`.
    fn wrap(client: &Arc<ClientInner>, raw: ffi::Handle) -> Buffer {
        Buffer {
            client: client.clone(),
            raw,
            dims: vec![],
            ty: ElementType::Pred,
            device: 0,
        }
    }

    fn load_metadata(&mut self) -> Result<()> {
        if self.raw.is_null() {
            return Err(Error::new(code::INTERNAL, "PJRT returned a null buffer"));
        }
        let (mut dims, mut n, mut ty, mut dev) = (ptr::null(), 0usize, 0 as c_int, ptr::null_mut());
        // SAFETY: `raw` is a live buffer; the dims array lives as long as it does.
        unsafe {
            check(ffi::pw_buffer_meta(
                self.client.api(),
                self.raw,
                &mut dims,
                &mut n,
                &mut ty,
                &mut dev,
            ))?;
            self.dims = slice(dims, n).to_vec();
        }
        self.ty = ElementType::from_pjrt(ty).ok_or_else(|| {
            Error::new(
                code::UNIMPLEMENTED,
                format!("unsupported PJRT_Buffer_Type {ty}"),
            )
        })?;
        self.device = self.client.device_index(dev)?;
        Ok(())
    }

    pub fn dims(&self) -> Vec<i64> {
        self.dims.clone()
    }

    pub fn element_type(&self) -> ElementType {
        self.ty
    }

    /// Index of the device holding this buffer (into the client's devices).
    pub fn device(&self) -> usize {
        self.device
    }

    /// A copy on another device of the client (PJRT_Buffer_CopyToDevice, no host round trip
    /// where the plugin can avoid one).
    pub fn copy_to_device(&self, device: usize) -> Result<Buffer> {
        let c = &self.client;
        let dev = c.device(device)?;
        let mut raw: ffi::Handle = ptr::null_mut();
        // SAFETY: live buffer and device of the same client; `raw` is a valid out pointer.
        check(unsafe { ffi::pw_buffer_copy_to_device(c.api(), self.raw, dev, &mut raw) })?;
        let mut b = Buffer::wrap(c, raw);
        b.load_metadata()?;
        Ok(b)
    }

    /// Size in bytes of the dense row-major host representation.
    pub fn byte_size(&self) -> usize {
        let elems = self
            .dims
            .iter()
            .map(|&d| d.max(0) as usize)
            .product::<usize>();
        elems * self.ty.byte_size()
    }

    /// The real sizes of an array whose dimensions may be dynamic (bounded): smaller than
    /// `dims()` where XLA padded a dimension. Waits for the producing computation.
    pub fn unpadded_dims(&self) -> Result<Vec<i64>> {
        self.ready()?;
        let (mut p, mut n) = (std::ptr::null(), 0usize);
        // SAFETY: `raw` is a live buffer; the out pointers are valid. The returned array
        // lives as long as the buffer and is copied before returning.
        check(unsafe {
            ffi::pw_buffer_unpadded_dims(self.client.api(), self.raw, &mut p, &mut n)
        })?;
        if n == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: PJRT returned `n` dims at `p`, valid while the buffer lives.
        Ok(unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
    }

    pub fn on_device_size_in_bytes(&self) -> Result<usize> {
        let mut n = 0usize;
        // SAFETY: `raw` is a live buffer; `n` is a valid out pointer.
        check(unsafe { ffi::pw_buffer_on_device_size(self.client.api(), self.raw, &mut n) })?;
        Ok(n)
    }

    /// Copies the array into `out` (dense row-major, exactly `byte_size()` bytes),
    /// blocking until done. Returns the producing computation's error if it failed.
    pub fn to_host(&self, out: &mut [u8]) -> Result<()> {
        let (p, n) = (out.as_mut_ptr().cast(), out.len());
        if n != self.byte_size() {
            return Err(invalid(format!(
                "to_host: {n} bytes given, {self:?} needs {}",
                self.byte_size()
            )));
        }
        // SAFETY: `out` is valid for `n` bytes of writes, which PJRT checks
        // against its own size; the wrapper waits for the copy to finish.
        check(unsafe { ffi::pw_buffer_to_host(self.client.api(), self.raw, p, n) })
    }

    /// [`Buffer::to_host`] into a new Vec.
    pub fn to_host_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.byte_size()];
        self.to_host(&mut v)?;
        Ok(v)
    }

    /// The address of the buffer's bytes once it is ready (on the CPU plugin, host memory
    /// laid out as `to_host` would copy it, for a flat buffer). Valid while the buffer lives
    /// and is not donated.
    pub fn device_pointer(&self) -> Result<*mut u8> {
        let mut p = 0usize;
        // SAFETY: `raw` is a live buffer; `p` is a valid out pointer.
        check(unsafe { ffi::pw_buffer_pointer(self.client.api(), self.raw, &mut p) })?;
        Ok(p as *mut u8)
    }

    /// Blocks until the buffer is ready; returns the producer's error if any.
    pub fn ready(&self) -> Result<()> {
        // SAFETY: `raw` is a live buffer.
        check(unsafe { ffi::pw_buffer_ready(self.client.api(), self.raw) })
    }

    /// Whether the buffer is ready (or failed), without blocking.
    pub fn is_ready_nonblocking(&self) -> Result<bool> {
        let mut r: c_int = 0;
        // SAFETY: `raw` is a live buffer; `r` is a valid out pointer.
        check(unsafe { ffi::pw_buffer_is_ready(self.client.api(), self.raw, &mut r) })?;
        Ok(r != 0)
    }
}

// ------------------------------------------------------------- Executable --

/// A compiled program loaded on one device.
pub struct Executable {
    client: Arc<ClientInner>,
    raw: ffi::Handle,
    num_outputs: usize,
    /// The device of replica 0 (the only one unless `compile_replicated`).
    device: usize,
    /// Each replica's device.
    devices: Vec<usize>,
}

// SAFETY: PJRT_LoadedExecutable is thread-safe (concurrent Execute is allowed).
unsafe impl Send for Executable {}
// SAFETY: see above.
unsafe impl Sync for Executable {}

impl fmt::Debug for Executable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Executable({} outputs, device {})",
            self.num_outputs, self.device
        )
    }
}

impl Drop for Executable {
    fn drop(&mut self) {
        if in_forked_child() {
            return;
        }
        // SAFETY: `raw` is a live loaded executable owned by this object.
        let _ = check(unsafe { ffi::pw_exe_destroy(self.client.api(), self.raw) });
    }
}

impl Executable {
    /// Takes ownership of `raw` and checks that it is loaded on exactly `devices`.
    fn from_raw(
        client: &Arc<ClientInner>,
        raw: ffi::Handle,
        devices: &[usize],
    ) -> Result<Executable> {
        let mut e = Executable {
            client: client.clone(),
            raw,
            num_outputs: 0,
            device: devices[0],
            devices: devices.to_vec(),
        };
        let (mut devs, mut n) = (ptr::null(), 0usize);
        // SAFETY: `raw` is a live executable; the device array lives as long as it does.
        let devs: &[ffi::Handle] = unsafe {
            check(ffi::pw_exe_info(
                client.api(),
                raw,
                &mut e.num_outputs,
                &mut devs,
                &mut n,
            ))?;
            slice(devs, n)
        };
        let got = devs
            .iter()
            .map(|d| client.device_index(*d))
            .collect::<Result<Vec<_>>>()?;
        if got != devices {
            let msg = format!("executable was loaded on devices {got:?}, expected {devices:?}");
            return Err(Error::new(code::INTERNAL, msg));
        }
        Ok(e)
    }

    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }

    /// Index of the device the executable runs on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Enqueues one run on the executable's device and returns the outputs
    /// without waiting; a failure of the computation itself surfaces through
    /// [`Buffer::ready`] / [`Buffer::to_host`] of the outputs.
    pub fn execute(&self, inputs: &[&Buffer]) -> Result<Vec<Buffer>> {
        self.execute_donating(inputs, &[])
    }

    /// `execute`, where inputs the program aliases to outputs are donated (their buffers
    /// become invalid) except those listed in `keep`.
    pub fn execute_donating(&self, inputs: &[&Buffer], keep: &[i64]) -> Result<Vec<Buffer>> {
        if self.devices.len() != 1 {
            return Err(invalid(format!(
                "a program of {} replicas runs with execute_replicated",
                self.devices.len()
            )));
        }
        for (i, b) in inputs.iter().enumerate() {
            if !Arc::ptr_eq(&b.client, &self.client) {
                return Err(invalid(format!("input {i} belongs to another client")));
            }
            if b.device != self.device {
                let msg = format!(
                    "input {i} is on device {}, executable on {}",
                    b.device, self.device
                );
                return Err(invalid(msg));
            }
        }
        let args: Vec<ffi::Handle> = inputs.iter().map(|b| b.raw).collect();
        let mut outs: Vec<ffi::Handle> = vec![ptr::null_mut(); self.num_outputs];
        let (api, a, o) = (self.client.api(), args.as_ptr(), outs.as_mut_ptr());
        // SAFETY: `args` are live buffers (borrowed by `inputs`) for the call;
        // `outs` has room for num_outputs handles, which PJRT fills on success; `keep`
        // outlives the call.
        let (k, nk) = (keep.as_ptr(), keep.len());
        check(unsafe { ffi::pw_exe_execute(api, self.raw, a, args.len(), o, k, nk) })?;
        self.own_outputs(outs)
    }

    /// The buffers PJRT returned, owned first so that all are destroyed if one fails.
    fn own_outputs(&self, outs: Vec<ffi::Handle>) -> Result<Vec<Buffer>> {
        let mut bufs: Vec<Buffer> = outs
            .into_iter()
            .map(|raw| Buffer::wrap(&self.client, raw))
            .collect();
        for b in &mut bufs {
            b.load_metadata()?;
        }
        Ok(bufs)
    }

    /// Runs a [`Client::compile_replicated`] program once on each of its devices:
    /// `inputs[r]` are replica `r`'s arguments, on its device; returns each replica's outputs.
    pub fn execute_replicated(&self, inputs: &[Vec<&Buffer>]) -> Result<Vec<Vec<Buffer>>> {
        let replicas = self.devices.len();
        if inputs.len() != replicas {
            let msg = format!("{} argument lists for {replicas} replicas", inputs.len());
            return Err(invalid(msg));
        }
        let num_args = inputs[0].len();
        let mut args: Vec<ffi::Handle> = Vec::with_capacity(num_args * replicas);
        for (r, list) in inputs.iter().enumerate() {
            if list.len() != num_args {
                return Err(invalid(format!(
                    "replica {r} has {} arguments, replica 0 {num_args}",
                    list.len()
                )));
            }
            for b in list {
                if !Arc::ptr_eq(&b.client, &self.client) {
                    return Err(invalid(format!(
                        "an input of replica {r} belongs to another client"
                    )));
                }
                if b.device != self.devices[r] {
                    let msg = format!(
                        "an input of replica {r} is on device {}, the replica on {}",
                        b.device, self.devices[r]
                    );
                    return Err(invalid(msg));
                }
                args.push(b.raw);
            }
        }
        let n = self.num_outputs;
        let mut outs: Vec<ffi::Handle> = vec![ptr::null_mut(); n * replicas];
        let (api, a, o) = (self.client.api(), args.as_ptr(), outs.as_mut_ptr());
        // SAFETY: `args` holds replicas * num_args live buffers borrowed by `inputs`; `outs`
        // has room for replicas * num_outputs handles, which PJRT fills on success.
        check(unsafe {
            ffi::pw_exe_execute_replicated(api, self.raw, a, replicas, num_args, o, n)
        })?;
        let bufs = self.own_outputs(outs)?;
        let mut per: Vec<Vec<Buffer>> = (0..replicas).map(|_| Vec::new()).collect();
        for (i, b) in bufs.into_iter().enumerate() {
            per[i / n].push(b);
        }
        Ok(per)
    }

    /// Serializes the compiled executable (PJRT_Executable_Serialize).
    pub fn serialize(&self) -> Result<Vec<u8>> {
        // SAFETY: `raw` is a live executable; out pointers come from `malloced`.
        malloced(|p, n| unsafe { ffi::pw_exe_serialize(self.client.api(), self.raw, p, n) })
    }

    /// The plugin's fingerprint of the compiled executable (PJRT_Executable_Fingerprint).
    pub fn fingerprint(&self) -> Result<String> {
        // SAFETY: `raw` is a live executable; out pointers come from `malloced`.
        let v =
            malloced(|p, n| unsafe { ffi::pw_exe_fingerprint(self.client.api(), self.raw, p, n) })?;
        Ok(String::from_utf8_lossy(&v).into_owned())
    }
}

// ------------------------------------------------------------ find_plugin --

/// The alphabetically first `*.so` file directly in `dir`.
fn first_so_in(dir: &Path) -> Option<PathBuf> {
    let rd = std::fs::read_dir(dir).ok()?;
    let mut found: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    found.retain(|p| p.extension().is_some_and(|x| x == "so") && p.is_file());
    found.sort();
    found.into_iter().next()
}

/// Whether this process is a child forked after a client was created. The plugin's threads
/// did not survive the fork: a call into it could wait forever, so the child must make none
/// (objects it drops are leaked).
pub fn in_forked_child() -> bool {
    // SAFETY: reads a flag; no arguments.
    unsafe { ffi::pw_in_forked_child() != 0 }
}

fn watch_fork() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a handler that only stores to an atomic flag.
    ONCE.call_once(|| unsafe {
        ffi::pw_watch_fork();
    });
}

/// Makes the C allocator keep freed blocks of up to `bytes` for reuse instead of
/// unmapping them, in at most four arenas shared by all threads (glibc only; returns whether it
/// applied). A CPU plugin's buffers are
/// host memory: without this each new activation buffer pays fresh page faults, which
/// measured up to half the time of a 1 MB elementwise op.
pub fn keep_freed_host_memory(bytes: usize) -> bool {
    // SAFETY: mallopt only changes allocator thresholds; no pointers are involved.
    unsafe { ffi::pw_keep_freed_host_memory(bytes) != 0 }
}

/// Gives freed host memory back to the kernel (glibc's `malloc_trim`): with the CPU plugin
/// device buffers are host memory that `keep_freed_host_memory` keeps for reuse.
pub fn trim_host_memory() -> bool {
    // SAFETY: malloc_trim takes no pointers and is thread-safe.
    unsafe { ffi::pw_trim_host_memory() != 0 }
}

/// What a plugin reports of a device's memory.
#[derive(Clone, Copy, Debug)]
pub struct MemoryStats {
    pub bytes_in_use: i64,
    pub peak_bytes_in_use: Option<i64>,
    pub bytes_limit: Option<i64>,
}

/// `TORCH_PJRT_PLUGIN` (path to the .so) wins if set. Otherwise the python
/// site-packages directories `search_dirs`, then those in
/// `TORCH_PJRT_SITE_PACKAGES` (path-list separated), are searched in priority
/// order: libtpu (only if `/dev/accel*` or `/dev/vfio` exists), an XLA CUDA
/// plugin (only if `/dev/nvidia0` exists), then the `xla-cpu-pjrt` plugin.
pub fn find_plugin(search_dirs: &[PathBuf]) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("TORCH_PJRT_PLUGIN").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        let msg = format!("TORCH_PJRT_PLUGIN={} does not exist", p.display());
        return Err(Error::new(code::NOT_FOUND, msg));
    }
    let mut dirs = search_dirs.to_vec();
    if let Some(v) = std::env::var_os("TORCH_PJRT_SITE_PACKAGES") {
        dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
    }
    let accel = |rd: std::fs::ReadDir| {
        rd.flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("accel"))
    };
    let has_tpu = Path::new("/dev/vfio").exists() || std::fs::read_dir("/dev").is_ok_and(accel);
    // (path relative to site-packages, whether it is a directory holding a *.so)
    let mut candidates: Vec<(&str, bool)> = vec![];
    if has_tpu {
        candidates.push(("libtpu/libtpu.so", false));
    }
    if Path::new("/dev/nvidia0").exists() {
        candidates.extend([
            ("xla_plugins/xla_cuda13_pjrt", true),
            ("xla_plugins/xla_cuda12_pjrt", true),
            ("jax_plugins/xla_cuda13/xla_cuda_plugin.so", false),
            ("jax_plugins/xla_cuda12/xla_cuda_plugin.so", false),
        ]);
    }
    candidates.push(("xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so", false));
    for (rel, is_dir) in candidates {
        for d in &dirs {
            let p = d.join(rel);
            let hit = if is_dir {
                first_so_in(&p)
            } else {
                Some(p).filter(|p| p.is_file())
            };
            if let Some(p) = hit {
                return Ok(p);
            }
        }
    }
    Err(Error::new(
        code::NOT_FOUND,
        "no PJRT plugin found; install one: pip install xla-cpu-pjrt (CPU), \
         or set TORCH_PJRT_PLUGIN=/path/to/plugin.so",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_type_codes_roundtrip() {
        for t in ElementType::ALL {
            assert_eq!(ElementType::from_pjrt(t.to_pjrt()), Some(t));
        }
        assert_eq!(
            (
                ElementType::F32.to_pjrt(),
                ElementType::BF16.to_pjrt(),
                ElementType::C128.to_pjrt()
            ),
            (11, 13, 15)
        );
        assert_eq!(
            (ElementType::from_pjrt(0), ElementType::from_pjrt(16)),
            (None, None)
        );
    }

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn host_allocator_tuning_applies_on_glibc() {
        assert!(keep_freed_host_memory(32 << 20));
    }

    #[test]
    fn compile_options_encoding() {
        let expected = [
            0x1a, 16, 0x08, 1, 0x20, 1, 0x28, 1, 0x4a, 8, 0x08, 1, 0x10, 1, 0x1a, 2, 0x08, 1,
        ];
        assert_eq!(compile_options(1, 1, &[], &[]), expected);
        let with = compile_options(1, 1, &[("ab".into(), OptionValue::Bool(false))], &[]);
        assert_eq!(with[..expected.len()], expected);
        // 7: { key(1) "ab", value(2) { bool_field(2) false } }
        assert_eq!(
            with[expected.len()..],
            [0x3a, 8, 0x0a, 2, b'a', b'b', 0x12, 2, 0x10, 0]
        );
        let with = compile_options(1, 1, &[], &[("ab".into(), OptionValue::Str("X".into()))]);
        // 7: { key(1) "ab", value(2) { string_field(1) "X" } }
        assert_eq!(
            with[expected.len()..],
            [0x3a, 9, 0x0a, 2, b'a', b'b', 0x12, 3, 0x0a, 1, b'X']
        );
        let with = compile_options(1, 1, &[], &[("ab".into(), OptionValue::Int(5))]);
        // 7: { key(1) "ab", value(2) { int_field(3) 5 } }
        assert_eq!(
            with[expected.len()..],
            [0x3a, 8, 0x0a, 2, b'a', b'b', 0x12, 2, 0x18, 5]
        );
        let with = compile_options(1, 1, &[], &[("ab".into(), OptionValue::Float(1.0))]);
        // 7: { key(1) "ab", value(2) { double_field(4) 1.0 } }
        let mut want = vec![0x3a, 15, 0x0a, 2, b'a', b'b', 0x12, 9, 0x21];
        want.extend_from_slice(&1.0f64.to_le_bytes());
        assert_eq!(with[expected.len()..], want[..]);
    }
}
