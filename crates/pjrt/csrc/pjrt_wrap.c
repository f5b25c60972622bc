/* Flat C wrapper over the PJRT C API; see pjrt_wrap.h.
 *
 * Every *_Args struct is zeroed and its struct_size set from the header's
 * *_STRUCT_SIZE enum, so a plugin built against another API minor version
 * sees exactly the fields this header knows about. Optional entry points are
 * checked against PJRT_Api.struct_size before use. */
#include "pjrt_wrap.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pjrt_c_api.h"

struct pw_err {
  int code, is_static;
  size_t len;
  char* msg;
};

static char oom_msg[] = "out of memory while reporting a PJRT error";
static pw_err oom_err = {8, 1, sizeof(oom_msg) - 1, oom_msg};

#define ARGS(T, v) \
  T v;             \
  memset(&v, 0, sizeof v); \
  v.struct_size = T##_STRUCT_SIZE
#define API const PJRT_Api* api = (const PJRT_Api*)a
#define HAS(fn) \
  (api->struct_size >= offsetof(PJRT_Api, fn) + sizeof(api->fn) && api->fn != NULL)
#define REQUIRE(fn) \
  if (!HAS(fn)) return mk_err(12, "PJRT plugin does not implement " #fn)
#define CALL(fn, args) conv(api, api->fn(&args))
#define TRY(x)             \
  do {                     \
    pw_err* e_ = (x);      \
    if (e_) return e_;     \
  } while (0)

static pw_err* mk_err_n(int code, const char* msg, size_t len) {
  pw_err* e = (pw_err*)malloc(sizeof(pw_err));
  char* m = (char*)malloc(len + 1);
  if (!e || !m) {
    free(e);
    free(m);
    return &oom_err;
  }
  if (len) memcpy(m, msg, len);
  m[len] = 0;
  e->code = code;
  e->is_static = 0;
  e->len = len;
  e->msg = m;
  return e;
}

static pw_err* mk_err(int code, const char* msg) { return mk_err_n(code, msg, strlen(msg)); }

int pw_err_code(const pw_err* e) { return e->code; }
const char* pw_err_msg(const pw_err* e, size_t* len) { return *len = e->len, e->msg; }
void pw_err_free(pw_err* e) {
  if (!e || e->is_static) return;
  free(e->msg);
  free(e);
}
void pw_free(void* p) { free(p); }

/* Converts a PJRT_Error (NULL = success) into a pw_err and destroys it. */
static pw_err* conv(const PJRT_Api* api, PJRT_Error* pe) {
  if (!pe) return NULL;
  ARGS(PJRT_Error_Message_Args, m);
  m.error = pe;
  api->PJRT_Error_Message(&m);
  ARGS(PJRT_Error_GetCode_Args, c);
  c.error = pe;
  PJRT_Error* ce = api->PJRT_Error_GetCode(&c);
  int code = ce ? PJRT_Error_Code_UNKNOWN : (int)c.code;
  pw_err* e = mk_err_n(code, m.message ? m.message : "", m.message ? m.message_size : 0);
  ARGS(PJRT_Error_Destroy_Args, d);
  d.error = pe;
  api->PJRT_Error_Destroy(&d);
  if (ce) {
    d.error = ce;
    api->PJRT_Error_Destroy(&d);
  }
  return e;
}

static void event_destroy(const PJRT_Api* api, PJRT_Event* ev) {
  if (!ev) return;
  ARGS(PJRT_Event_Destroy_Args, a);
  a.event = ev;
  pw_err_free(CALL(PJRT_Event_Destroy, a));
}

/* Blocks on `ev`, destroys it and returns its error status. */
static pw_err* event_await(const PJRT_Api* api, PJRT_Event* ev) {
  if (!ev) return NULL;
  ARGS(PJRT_Event_Await_Args, a);
  a.event = ev;
  pw_err* e = CALL(PJRT_Event_Await, a);
  event_destroy(api, ev);
  return e;
}

/* ------------------------------- Plugin --------------------------------- */

pw_err* pw_load(const char* path, const void** api_out) {
  char buf[2048];
  *api_out = NULL;
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* why = dlerror();
    snprintf(buf, sizeof buf, "dlopen(%s) failed: %s", path, why ? why : "unknown error");
    return mk_err(5, buf);
  }
  const PJRT_Api* (*get)(void) = (const PJRT_Api* (*)(void))dlsym(h, "GetPjrtApi");
  const PJRT_Api* api = get ? get() : NULL;
  if (!api) {
    snprintf(buf, sizeof buf, "%s: no GetPjrtApi symbol (or it returned NULL); not a PJRT plugin",
             path);
    dlclose(h);
    return mk_err(5, buf);
  }
  if (!HAS(PJRT_Error_Destroy) || !HAS(PJRT_Error_Message) || !HAS(PJRT_Error_GetCode) ||
      !HAS(PJRT_Event_Await) || !HAS(PJRT_Event_Destroy)) {
    dlclose(h);
    return mk_err(12, "PJRT plugin lacks the basic error/event entry points");
  }
  *api_out = api; /* `h` is leaked on purpose: XLA plugins cannot be unloaded safely. */
  return NULL;
}

void pw_api_version(const void* a, int* major, int* minor) {
  API;
  *major = api->pjrt_api_version.major_version;
  *minor = api->pjrt_api_version.minor_version;
}

pw_err* pw_plugin_initialize(const void* a) {
  API;
  if (!HAS(PJRT_Plugin_Initialize)) return NULL;
  ARGS(PJRT_Plugin_Initialize_Args, args);
  return CALL(PJRT_Plugin_Initialize, args);
}

/* -------------------------------- Fork ---------------------------------- */

static atomic_int pw_forked;

static void pw_mark_forked(void) { atomic_store(&pw_forked, 1); }

int pw_watch_fork(void) { return pthread_atfork(NULL, NULL, pw_mark_forked) == 0; }

int pw_in_forked_child(void) { return atomic_load(&pw_forked); }

/* ------------------------------- Client --------------------------------- */

int pw_keep_freed_host_memory(size_t bytes) {
#if defined(__GLIBC__)
  /* Large blocks come from mmap by default and go back to the kernel on free, so every
     buffer of a CPU-plugin program pays fresh page faults. At most four arenas:
     blocks freed by one thread are reused by the others (XLA's pool threads allocate,
     other threads free); fewer made the dispatching and executing threads contend. */
  return mallopt(M_MMAP_THRESHOLD, (int)bytes) && mallopt(M_TRIM_THRESHOLD, (int)(2 * bytes)) &&
         mallopt(M_ARENA_MAX, 4);
#else
  (void)bytes;
  return 0;
#endif
}

/* Returns freed memory at the top of the heaps and in free chunks to the kernel (the
   thresholds above keep it otherwise). */
int pw_trim_host_memory(void) {
#if defined(__GLIBC__)
  return malloc_trim(0);
#else
  return 0;
#endif
}

pw_err* pw_client_create(const void* a, void** client_out) {
  API;
  ARGS(PJRT_Client_Create_Args, args);
  TRY(CALL(PJRT_Client_Create, args));
  *client_out = args.client;
  return NULL;
}

/* The plugin attribute `name` (PJRT_Plugin_Attributes) printed into `buf`: a string as is,
 * an int64 array joined with '.', a number in decimal. *n = 0 when the plugin has no such
 * attribute or no PJRT_Plugin_Attributes. */
pw_err* pw_plugin_attribute(const void* a, const char* name, char* buf, size_t cap, size_t* n) {
  API;
  *n = 0;
  if (!HAS(PJRT_Plugin_Attributes) || cap == 0) return NULL;
  ARGS(PJRT_Plugin_Attributes_Args, args);
  TRY(CALL(PJRT_Plugin_Attributes, args));
  size_t want = strlen(name);
  for (size_t i = 0; i < args.num_attributes; i++) {
    const PJRT_NamedValue* v = &args.attributes[i];
    if (v->name_size != want || memcmp(v->name, name, want) != 0) continue;
    int w = 0;
    buf[0] = 0;
    switch (v->type) {
      case PJRT_NamedValue_kString:
        w = snprintf(buf, cap, "%.*s", (int)v->value_size, v->string_value);
        break;
      case PJRT_NamedValue_kInt64:
        w = snprintf(buf, cap, "%lld", (long long)v->int64_value);
        break;
      case PJRT_NamedValue_kInt64List:
        for (size_t j = 0; j < v->value_size && w >= 0 && (size_t)w < cap; j++)
          w += snprintf(buf + w, cap - w, j ? ".%lld" : "%lld",
                        (long long)v->int64_array_value[j]);
        break;
      case PJRT_NamedValue_kBool:
        w = snprintf(buf, cap, "%s", v->bool_value ? "true" : "false");
        break;
      default:
        w = snprintf(buf, cap, "%g", (double)v->float_value);
    }
    *n = w < 0 ? 0 : ((size_t)w < cap ? (size_t)w : cap - 1);
    return NULL;
  }
  return NULL;
}

pw_err* pw_client_destroy(const void* a, void* client) {
  API;
  ARGS(PJRT_Client_Destroy_Args, args);
  args.client = (PJRT_Client*)client;
  return CALL(PJRT_Client_Destroy, args);
}

pw_err* pw_client_string(const void* a, void* client, int which, const char** s, size_t* n) {
  API;
  if (which == 0) {
    ARGS(PJRT_Client_PlatformName_Args, args);
    args.client = (PJRT_Client*)client;
    TRY(CALL(PJRT_Client_PlatformName, args));
    *s = args.platform_name;
    *n = args.platform_name_size;
  } else {
    ARGS(PJRT_Client_PlatformVersion_Args, args);
    args.client = (PJRT_Client*)client;
    TRY(CALL(PJRT_Client_PlatformVersion, args));
    *s = args.platform_version;
    *n = args.platform_version_size;
  }
  return NULL;
}

pw_err* pw_client_devices(const void* a, void* client, void* const** devs, size_t* n) {
  API;
  ARGS(PJRT_Client_AddressableDevices_Args, args);
  args.client = (PJRT_Client*)client;
  TRY(CALL(PJRT_Client_AddressableDevices, args));
  *devs = (void* const*)args.addressable_devices;
  *n = args.num_addressable_devices;
  return NULL;
}

pw_err* pw_device_info(const void* a, void* dev, const char** kind, size_t* kind_n, int* id) {
  API;
  ARGS(PJRT_Device_GetDescription_Args, g);
  g.device = (PJRT_Device*)dev;
  TRY(CALL(PJRT_Device_GetDescription, g));
  ARGS(PJRT_DeviceDescription_Kind_Args, k);
  k.device_description = g.device_description;
  TRY(CALL(PJRT_DeviceDescription_Kind, k));
  *kind = k.device_kind;
  *kind_n = k.device_kind_size;
  ARGS(PJRT_DeviceDescription_Id_Args, i);
  i.device_description = g.device_description;
  TRY(CALL(PJRT_DeviceDescription_Id, i));
  *id = i.id;
  return NULL;
}

pw_err* pw_device_memory(const void* a, void* dev, int64_t* in_use, int64_t* peak, int64_t* limit,
                         int* limit_set) {
  API;
  ARGS(PJRT_Device_MemoryStats_Args, m);
  m.device = (PJRT_Device*)dev;
  TRY(CALL(PJRT_Device_MemoryStats, m));
  *in_use = m.bytes_in_use;
  *peak = m.peak_bytes_in_use_is_set ? m.peak_bytes_in_use : -1;
  *limit = m.bytes_limit;
  *limit_set = m.bytes_limit_is_set;
  return NULL;
}

pw_err* pw_compile(const void* a, void* client, const char* code, size_t code_size,
                   const char* options, size_t options_size, void** exe_out) {
  API;
  ARGS(PJRT_Program, prog);
  prog.code = (char*)code; /* read-only for Compile */
  prog.code_size = code_size;
  prog.format = "mlir";
  prog.format_size = 4;
  ARGS(PJRT_Client_Compile_Args, args);
  args.client = (PJRT_Client*)client;
  args.program = &prog;
  args.compile_options = options;
  args.compile_options_size = options_size;
  TRY(CALL(PJRT_Client_Compile, args));
  *exe_out = args.executable;
  return NULL;
}

pw_err* pw_deserialize(const void* a, void* client, const char* bytes, size_t n,
                       const char* options, size_t options_size, void** exe_out) {
  API;
  REQUIRE(PJRT_Executable_DeserializeAndLoad);
  ARGS(PJRT_Executable_DeserializeAndLoad_Args, args);
  args.client = (PJRT_Client*)client;
  args.serialized_executable = bytes;
  args.serialized_executable_size = n;
  args.overridden_serialized_compile_options = options;
  args.overridden_serialized_compile_options_size = options_size;
  TRY(CALL(PJRT_Executable_DeserializeAndLoad, args));
  *exe_out = args.loaded_executable;
  return NULL;
}

/* ------------------------------- Buffers -------------------------------- */

pw_err* pw_buffer_from_host(const void* a, void* client, const void* data, int type,
                            const int64_t* dims, size_t num_dims, void* device, void** buf_out) {
  API;
  ARGS(PJRT_Client_BufferFromHostBuffer_Args, args);
  args.client = (PJRT_Client*)client;
  args.data = data;
  args.type = (PJRT_Buffer_Type)type;
  args.dims = dims;
  args.num_dims = num_dims;
  args.host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes;
  args.device = (PJRT_Device*)device;
  TRY(CALL(PJRT_Client_BufferFromHostBuffer, args));
  pw_err* e = event_await(api, args.done_with_host_buffer);
  if (e) {
    pw_err_free(pw_buffer_destroy(a, args.buffer));
    return e;
  }
  *buf_out = args.buffer;
  return NULL;
}

pw_err* pw_buffer_copy_to_device(const void* a, void* buf, void* device, void** buf_out) {
  API;
  ARGS(PJRT_Buffer_CopyToDevice_Args, args);
  args.buffer = (PJRT_Buffer*)buf;
  args.dst_device = (PJRT_Device*)device;
  TRY(CALL(PJRT_Buffer_CopyToDevice, args));
  *buf_out = args.dst_buffer;
  return NULL;
}

/* Where the buffer's bytes are (host memory on the CPU plugin), once it is ready. */
pw_err* pw_buffer_pointer(const void* a, void* buf, uintptr_t* out) {
  API;
  REQUIRE(PJRT_Buffer_UnsafePointer);
  TRY(pw_buffer_ready(a, buf));
  ARGS(PJRT_Buffer_UnsafePointer_Args, args);
  args.buffer = (PJRT_Buffer*)buf;
  TRY(CALL(PJRT_Buffer_UnsafePointer, args));
  *out = args.buffer_pointer;
  return NULL;
}

/* A buffer over memory the caller owns (dense row-major); `on_delete(ptr, arg)` runs once
 * PJRT no longer uses it. */
pw_err* pw_buffer_view(const void* a, void* client, void* data, int type, const int64_t* dims,
                       size_t num_dims, void* device, void (*on_delete)(void*, void*), void* arg,
                       void** buf_out) {
  API;
  REQUIRE(PJRT_Client_CreateViewOfDeviceBuffer);
  ARGS(PJRT_Client_CreateViewOfDeviceBuffer_Args, args);
  args.client = (PJRT_Client*)client;
  args.device_buffer_ptr = data;
  args.dims = dims;
  args.num_dims = num_dims;
  args.element_type = (PJRT_Buffer_Type)type;
  args.device = (PJRT_Device*)device;
  args.on_delete_callback = on_delete;
  args.on_delete_callback_arg = arg;
  TRY(CALL(PJRT_Client_CreateViewOfDeviceBuffer, args));
  *buf_out = args.buffer;
  return NULL;
}

pw_err* pw_buffer_destroy(const void* a, void* buf) {
  API;
  ARGS(PJRT_Buffer_Destroy_Args, args);
  args.buffer = (PJRT_Buffer*)buf;
  return CALL(PJRT_Buffer_Destroy, args);
}

pw_err* pw_buffer_meta(const void* a, void* buf, const int64_t** dims, size_t* num_dims,
                       int* type, void** dev) {
  API;
  ARGS(PJRT_Buffer_Dimensions_Args, d);
  d.buffer = (PJRT_Buffer*)buf;
  TRY(CALL(PJRT_Buffer_Dimensions, d));
  *dims = d.dims;
  *num_dims = d.num_dims;
  ARGS(PJRT_Buffer_ElementType_Args, t);
  t.buffer = (PJRT_Buffer*)buf;
  TRY(CALL(PJRT_Buffer_ElementType, t));
  *type = (int)t.type;
  ARGS(PJRT_Buffer_Device_Args, v);
  v.buffer = (PJRT_Buffer*)buf;
  TRY(CALL(PJRT_Buffer_Device, v));
  *dev = v.device;
  return NULL;
}

pw_err* pw_buffer_unpadded_dims(const void* a, void* buf, const int64_t** dims, size_t* num_dims) {
  API;
  ARGS(PJRT_Buffer_UnpaddedDimensions_Args, d);
  d.buffer = (PJRT_Buffer*)buf;
  TRY(CALL(PJRT_Buffer_UnpaddedDimensions, d));
  *dims = d.unpadded_dims;
  *num_dims = d.num_dims;
  return NULL;
}

pw_err* pw_buffer_on_device_size(const void* a, void* buf, size_t* n) {
  API;
  ARGS(PJRT_Buffer_OnDeviceSizeInBytes_Args, args);
  args.buffer = (PJRT_Buffer*)buf;
  TRY(CALL(PJRT_Buffer_OnDeviceSizeInBytes, args));
  *n = args.on_device_size_in_bytes;
  return NULL;
}

/* Whether the buffer's device layout is not dense row-major, so that a host
 * layout must be requested explicitly (NULL means "like the device", and some
 * plugins reject explicit host layouts). */
static int needs_host_layout(const PJRT_Api* api, void* buf, size_t rank) {
  if (!HAS(PJRT_Buffer_GetMemoryLayout)) return 1;
  ARGS(PJRT_Buffer_GetMemoryLayout_Args, ml);
  ml.buffer = (PJRT_Buffer*)buf;
  pw_err* e = CALL(PJRT_Buffer_GetMemoryLayout, ml);
  if (e) return pw_err_free(e), 1;
  const PJRT_Buffer_MemoryLayout_Tiled* t = &ml.layout.tiled;
  if (ml.layout.type != PJRT_Buffer_MemoryLayout_Type_Tiled || t->minor_to_major_size != rank) return 1;
  for (size_t i = 0; i < rank; i++)
    if (t->minor_to_major[i] != (int64_t)(rank - 1 - i)) return 1;
  return 0; /* tiles are dropped for the host shape */
}

pw_err* pw_buffer_to_host(const void* a, void* buf, void* dst, size_t dst_size) {
  API;
  if (dst_size == 0) return pw_buffer_ready(a, buf);
  ARGS(PJRT_Buffer_Dimensions_Args, d);
  d.buffer = (PJRT_Buffer*)buf;
  TRY(CALL(PJRT_Buffer_Dimensions, d));
  int64_t m2m[64];
  if (d.num_dims > 64) return mk_err(3, "to_host: rank > 64 is not supported");
  for (size_t i = 0; i < d.num_dims; i++) m2m[i] = (int64_t)(d.num_dims - 1 - i);
  ARGS(PJRT_Buffer_MemoryLayout, layout);
  ARGS(PJRT_Buffer_MemoryLayout_Tiled, tiled);
  tiled.minor_to_major = m2m;
  tiled.minor_to_major_size = d.num_dims;
  layout.tiled = tiled;
  layout.type = PJRT_Buffer_MemoryLayout_Type_Tiled;
  ARGS(PJRT_Buffer_ToHostBuffer_Args, args);
  args.src = (PJRT_Buffer*)buf;
  if (needs_host_layout(api, buf, d.num_dims)) args.host_layout = &layout;
  args.dst = dst; /* the caller checked dst_size; PJRT rejects a too-small one */
  args.dst_size = dst_size;
  TRY(CALL(PJRT_Buffer_ToHostBuffer, args));
  return event_await(api, args.event);
}

static pw_err* ready_event(const PJRT_Api* api, void* buf, PJRT_Event** ev) {
  ARGS(PJRT_Buffer_ReadyEvent_Args, args);
  args.buffer = (PJRT_Buffer*)buf;
  TRY(CALL(PJRT_Buffer_ReadyEvent, args));
  *ev = args.event;
  return NULL;
}

pw_err* pw_buffer_ready(const void* a, void* buf) {
  API;
  PJRT_Event* ev = NULL;
  TRY(ready_event(api, buf, &ev));
  return event_await(api, ev);
}

pw_err* pw_buffer_is_ready(const void* a, void* buf, int* ready) {
  API;
  PJRT_Event* ev = NULL;
  TRY(ready_event(api, buf, &ev));
  ARGS(PJRT_Event_IsReady_Args, args);
  args.event = ev;
  pw_err* e = CALL(PJRT_Event_IsReady, args);
  *ready = args.is_ready;
  event_destroy(api, ev);
  return e;
}

/* ------------------------------ Executables ----------------------------- */

pw_err* pw_exe_destroy(const void* a, void* exe) {
  API;
  ARGS(PJRT_LoadedExecutable_Destroy_Args, args);
  args.executable = (PJRT_LoadedExecutable*)exe;
  return CALL(PJRT_LoadedExecutable_Destroy, args);
}

/* The PJRT_Executable behind a loaded one; release with put_exe. */
static pw_err* get_exe(const PJRT_Api* api, void* exe, PJRT_Executable** out) {
  ARGS(PJRT_LoadedExecutable_GetExecutable_Args, args);
  args.loaded_executable = (PJRT_LoadedExecutable*)exe;
  TRY(CALL(PJRT_LoadedExecutable_GetExecutable, args));
  *out = args.executable;
  return NULL;
}

static void put_exe(const PJRT_Api* api, PJRT_Executable* x) {
  ARGS(PJRT_Executable_Destroy_Args, args);
  args.executable = x;
  pw_err_free(CALL(PJRT_Executable_Destroy, args));
}

pw_err* pw_exe_info(const void* a, void* exe, size_t* num_outputs, void* const** devs,
                    size_t* num_devs) {
  API;
  ARGS(PJRT_LoadedExecutable_AddressableDevices_Args, d);
  d.executable = (PJRT_LoadedExecutable*)exe;
  TRY(CALL(PJRT_LoadedExecutable_AddressableDevices, d));
  *devs = (void* const*)d.addressable_devices;
  *num_devs = d.num_addressable_devices;
  PJRT_Executable* x = NULL;
  TRY(get_exe(api, exe, &x));
  ARGS(PJRT_Executable_NumOutputs_Args, args);
  args.executable = x;
  pw_err* e = CALL(PJRT_Executable_NumOutputs, args);
  *num_outputs = args.num_outputs;
  put_exe(api, x);
  return e;
}

pw_err* pw_exe_execute(const void* a, void* exe, void* const* in, size_t num_args, void** outs,
                       const int64_t* keep, size_t num_keep) {
  API;
  ARGS(PJRT_ExecuteOptions, opts);
  /* Inputs aliased to outputs are donated unless listed here. */
  opts.non_donatable_input_indices = keep;
  opts.num_non_donatable_input_indices = num_keep;
  PJRT_Buffer* const* arg_lists[1] = {(PJRT_Buffer* const*)in};
  PJRT_Buffer** out_lists[1] = {(PJRT_Buffer**)outs};
  ARGS(PJRT_LoadedExecutable_Execute_Args, args);
  args.executable = (PJRT_LoadedExecutable*)exe;
  args.options = &opts;
  args.argument_lists = arg_lists;
  args.num_devices = 1;
  args.num_args = num_args;
  args.output_lists = out_lists;
  /* device_complete_events = NULL: async; failures surface on the outputs'
   * ready events. execute_device = NULL: the compile-time device assignment. */
  return CALL(PJRT_LoadedExecutable_Execute, args);
}

/* One run of a replicated executable on each of its `num_devices` devices: `in` holds
 * num_devices lists of num_args buffers back to back, `outs` num_devices lists of the
 * outputs (filled by PJRT). No donation. */
pw_err* pw_exe_execute_replicated(const void* a, void* exe, void* const* in, size_t num_devices,
                                  size_t num_args, void** outs, size_t num_outputs) {
  API;
  if (num_devices == 0 || num_devices > 64) return mk_err(3, "1 to 64 devices");
  ARGS(PJRT_ExecuteOptions, opts);
  PJRT_Buffer* const* arg_lists[64];
  PJRT_Buffer** out_lists[64];
  for (size_t d = 0; d < num_devices; d++) {
    arg_lists[d] = (PJRT_Buffer* const*)(in + d * num_args);
    out_lists[d] = (PJRT_Buffer**)(outs + d * num_outputs);
  }
  ARGS(PJRT_LoadedExecutable_Execute_Args, args);
  args.executable = (PJRT_LoadedExecutable*)exe;
  args.options = &opts;
  args.argument_lists = arg_lists;
  args.num_devices = num_devices;
  args.num_args = num_args;
  args.output_lists = out_lists;
  return CALL(PJRT_LoadedExecutable_Execute, args);
}

static pw_err* copy_out(const char* s, size_t n, char** out, size_t* out_n) {
  if (!(*out = (char*)malloc(n ? n : 1))) return mk_err(8, "out of memory");
  if (n) memcpy(*out, s, n);
  *out_n = n;
  return NULL;
}

pw_err* pw_exe_serialize(const void* a, void* exe, char** bytes, size_t* n) {
  API;
  REQUIRE(PJRT_Executable_Serialize);
  PJRT_Executable* x = NULL;
  TRY(get_exe(api, exe, &x));
  ARGS(PJRT_Executable_Serialize_Args, args);
  args.executable = x;
  pw_err* e = CALL(PJRT_Executable_Serialize, args);
  if (!e) e = copy_out(args.serialized_bytes, args.serialized_bytes_size, bytes, n);
  if (args.serialized_executable && args.serialized_executable_deleter)
    args.serialized_executable_deleter(args.serialized_executable);
  put_exe(api, x);
  return e;
}

pw_err* pw_exe_fingerprint(const void* a, void* exe, char** s, size_t* n) {
  API;
  REQUIRE(PJRT_Executable_Fingerprint);
  PJRT_Executable* x = NULL;
  TRY(get_exe(api, exe, &x));
  ARGS(PJRT_Executable_Fingerprint_Args, args);
  args.executable = x;
  pw_err* e = CALL(PJRT_Executable_Fingerprint, args);
  if (!e) e = copy_out(args.executable_fingerprint, args.executable_fingerprint_size, s, n);
  put_exe(api, x);
  return e;
}
