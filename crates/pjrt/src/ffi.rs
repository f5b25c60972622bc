//! Hand-written declarations of the flat C wrapper in `csrc/pjrt_wrap.h`.

use std::ffi::{c_char, c_int, c_void};

/// Opaque error owned by the wrapper; freed with [`pw_err_free`].
#[repr(C)]
pub struct PwErr {
    _private: [u8; 0],
}

pub type Api = *const c_void;
pub type Handle = *mut c_void;
pub type Err = *mut PwErr;

#[rustfmt::skip]
extern "C" {
    pub fn pw_err_code(e: *const PwErr) -> c_int;
    pub fn pw_err_msg(e: *const PwErr, len: *mut usize) -> *const c_char;
    pub fn pw_err_free(e: Err);
    pub fn pw_free(p: *mut c_void);

    pub fn pw_load(path: *const c_char, api_out: *mut Api) -> Err;
    pub fn pw_api_version(api: Api, major: *mut c_int, minor: *mut c_int);
    pub fn pw_plugin_initialize(api: Api) -> Err;

    pub fn pw_watch_fork() -> c_int;
    pub fn pw_in_forked_child() -> c_int;

    pub fn pw_client_create(api: Api, client_out: *mut Handle) -> Err;
    pub fn pw_keep_freed_host_memory(bytes: usize) -> c_int;
    pub fn pw_trim_host_memory() -> c_int;
    pub fn pw_device_memory(api: Api, dev: Handle, in_use: *mut i64, peak: *mut i64, limit: *mut i64, limit_set: *mut c_int) -> Err;
    pub fn pw_client_destroy(api: Api, client: Handle) -> Err;
    pub fn pw_plugin_attribute(api: Api, name: *const c_char, buf: *mut c_char, cap: usize, n: *mut usize) -> Err;
    pub fn pw_client_string(api: Api, client: Handle, which: c_int, s: *mut *const c_char, n: *mut usize) -> Err;
    pub fn pw_client_devices(api: Api, client: Handle, devs: *mut *const Handle, n: *mut usize) -> Err;
    pub fn pw_device_info(api: Api, dev: Handle, kind: *mut *const c_char, kind_n: *mut usize, id: *mut c_int) -> Err;
    pub fn pw_compile(api: Api, client: Handle, code: *const c_char, code_size: usize, options: *const c_char, options_size: usize, exe_out: *mut Handle) -> Err;
    pub fn pw_deserialize(api: Api, client: Handle, bytes: *const c_char, n: usize, options: *const c_char, options_size: usize, exe_out: *mut Handle) -> Err;

    pub fn pw_buffer_from_host(api: Api, client: Handle, data: *const c_void, ty: c_int, dims: *const i64, num_dims: usize, device: Handle, buf_out: *mut Handle) -> Err;
    pub fn pw_buffer_copy_to_device(api: Api, buf: Handle, device: Handle, buf_out: *mut Handle) -> Err;
    pub fn pw_buffer_destroy(api: Api, buf: Handle) -> Err;
    pub fn pw_buffer_meta(api: Api, buf: Handle, dims: *mut *const i64, num_dims: *mut usize, ty: *mut c_int, dev: *mut Handle) -> Err;
    pub fn pw_buffer_on_device_size(api: Api, buf: Handle, n: *mut usize) -> Err;
    pub fn pw_buffer_unpadded_dims(api: Api, buf: Handle, dims: *mut *const i64, num_dims: *mut usize) -> Err;
    pub fn pw_buffer_to_host(api: Api, buf: Handle, dst: *mut c_void, dst_size: usize) -> Err;
    pub fn pw_buffer_ready(api: Api, buf: Handle) -> Err;
    pub fn pw_buffer_pointer(api: Api, buf: Handle, out: *mut usize) -> Err;
    pub fn pw_buffer_view(api: Api, client: Handle, data: *mut c_void, ty: c_int, dims: *const i64, num_dims: usize, device: Handle, on_delete: Option<unsafe extern "C" fn(*mut c_void, *mut c_void)>, arg: *mut c_void, buf_out: *mut Handle) -> Err;
    pub fn pw_buffer_is_ready(api: Api, buf: Handle, ready: *mut c_int) -> Err;

    pub fn pw_exe_destroy(api: Api, exe: Handle) -> Err;
    pub fn pw_exe_info(api: Api, exe: Handle, num_outputs: *mut usize, devs: *mut *const Handle, num_devs: *mut usize) -> Err;
    pub fn pw_exe_execute(api: Api, exe: Handle, args: *const Handle, num_args: usize, outs: *mut Handle, keep: *const i64, num_keep: usize) -> Err;
    pub fn pw_exe_execute_replicated(api: Api, exe: Handle, args: *const Handle, num_devices: usize, num_args: usize, outs: *mut Handle, num_outputs: usize) -> Err;
    pub fn pw_exe_serialize(api: Api, exe: Handle, bytes: *mut *mut c_char, n: *mut usize) -> Err;
    pub fn pw_exe_fingerprint(api: Api, exe: Handle, s: *mut *mut c_char, n: *mut usize) -> Err;
}
