/* Flat C wrapper over the PJRT C API (pjrt_c_api.h) for the `pjrt` Rust crate.
 *
 * PJRT handles are opaque pointers; `api` is the plugin's `const PJRT_Api*`.
 * Every fallible function returns a `pw_err*` (NULL on success) holding a copy
 * of the PJRT error code and message; the PJRT_Error itself is always
 * destroyed here. `const` string/array outputs live as long as the object they
 * were queried from; `char**` outputs are malloc'd and released with pw_free. */
#ifndef TORCH_PJRT_WRAP_H_
#define TORCH_PJRT_WRAP_H_

#include <stddef.h>
#include <stdint.h>

typedef struct pw_err pw_err;

int pw_err_code(const pw_err* e);
const char* pw_err_msg(const pw_err* e, size_t* len);
void pw_err_free(pw_err* e);
void pw_free(void* p);

/* dlopen + GetPjrtApi; the library is never unloaded. */
pw_err* pw_load(const char* path, const void** api_out);
void pw_api_version(const void* api, int* major, int* minor);
pw_err* pw_plugin_initialize(const void* api);

/* A child of fork() inherits the plugin's state but none of its threads: it must not call
   into the plugin. pw_watch_fork registers the handler that marks the child. */
int pw_watch_fork(void);
int pw_in_forked_child(void);

/* which: 0 = platform name, 1 = platform version. */
pw_err* pw_client_create(const void* api, void** client_out);
int pw_keep_freed_host_memory(size_t bytes);
int pw_trim_host_memory(void);
pw_err* pw_device_memory(const void* api, void* dev, int64_t* in_use, int64_t* peak, int64_t* limit,
                         int* limit_set);
pw_err* pw_client_destroy(const void* api, void* client);
pw_err* pw_plugin_attribute(const void* api, const char* name, char* buf, size_t cap, size_t* n);
pw_err* pw_client_string(const void* api, void* client, int which, const char** s, size_t* n);
pw_err* pw_client_devices(const void* api, void* client, void* const** devs, size_t* n);
pw_err* pw_device_info(const void* api, void* dev, const char** kind, size_t* kind_n, int* id);
pw_err* pw_compile(const void* api, void* client, const char* code, size_t code_size,
                   const char* options, size_t options_size, void** exe_out);
pw_err* pw_deserialize(const void* api, void* client, const char* bytes, size_t n,
                       const char* options, size_t options_size, void** exe_out);

/* Uploads with kImmutableUntilTransferCompletes and waits until `data` is free. */
pw_err* pw_buffer_from_host(const void* api, void* client, const void* data, int type,
                            const int64_t* dims, size_t num_dims, void* device, void** buf_out);
/* A copy of buf on another device of the same client. */
pw_err* pw_buffer_copy_to_device(const void* api, void* buf, void* device, void** buf_out);
pw_err* pw_buffer_destroy(const void* api, void* buf);
pw_err* pw_buffer_meta(const void* api, void* buf, const int64_t** dims, size_t* num_dims,
                       int* type, void** dev);
pw_err* pw_buffer_on_device_size(const void* api, void* buf, size_t* n);
pw_err* pw_buffer_unpadded_dims(const void* api, void* buf, const int64_t** dims, size_t* num_dims);
pw_err* pw_buffer_to_host(const void* api, void* buf, void* dst, size_t dst_size);
pw_err* pw_buffer_ready(const void* api, void* buf);
pw_err* pw_buffer_pointer(const void* api, void* buf, uintptr_t* out);
pw_err* pw_buffer_view(const void* api, void* client, void* data, int type, const int64_t* dims,
                       size_t num_dims, void* device, void (*on_delete)(void*, void*), void* arg,
                       void** buf_out);
pw_err* pw_buffer_is_ready(const void* api, void* buf, int* ready);

pw_err* pw_exe_destroy(const void* api, void* exe);
pw_err* pw_exe_info(const void* api, void* exe, size_t* num_outputs, void* const** devs,
                    size_t* num_devs);
/* Inputs the program aliases to outputs are donated, except the `num_keep` indices in `keep`. */
pw_err* pw_exe_execute(const void* api, void* exe, void* const* args, size_t num_args,
                       void** outs, const int64_t* keep, size_t num_keep);
pw_err* pw_exe_execute_replicated(const void* api, void* exe, void* const* in,
                                  size_t num_devices, size_t num_args, void** outs,
                                  size_t num_outputs);
pw_err* pw_exe_serialize(const void* api, void* exe, char** bytes, size_t* n);
pw_err* pw_exe_fingerprint(const void* api, void* exe, char** s, size_t* n);

#endif /* TORCH_PJRT_WRAP_H_ */
