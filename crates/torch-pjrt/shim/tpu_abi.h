// The C ABI between the C++ shim (what only C++ can register with PyTorch)
// and the Rust runtime (everything that decides what runs). Plain C so both
// sides can read it; Rust mirrors these structs in src/abi.rs.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TPU_MAX_DIMS 16

// Argument kinds, classified from the schema (real_type), not the IValue tag.
enum TpuArgKind {
  TPU_ARG_NONE = 0,
  TPU_ARG_TENSOR = 1,
  TPU_ARG_INT = 2,          // int, SymInt
  TPU_ARG_DOUBLE = 3,       // float
  TPU_ARG_BOOL = 4,
  TPU_ARG_STRING = 5,       // str (gelu approximate, div rounding_mode, ...)
  TPU_ARG_LIST = 6,         // any list: elements in `list`
  TPU_ARG_SCALAR_TYPE = 7,  // ScalarType: value in `i` (c10::ScalarType)
  TPU_ARG_GENERATOR = 8,    // gen_state points at [seed, offset] of the generator
  TPU_ARG_COMPLEX = 9,      // d + i*d_imag
  TPU_ARG_DEVICE = 10,      // a tpu device: i = its index (the current one if unset), s = type name
  TPU_ARG_LAYOUT = 11,      // i = c10::Layout
  TPU_ARG_MEMORY_FORMAT = 12,  // i = c10::MemoryFormat
  TPU_ARG_OTHER = 13,       // anything else: Rust declines the op
};

// Scalar arguments (schema type `Scalar`) carry the Python kind they had.
enum TpuScalarKind { TPU_SCALAR_NOT = 0, TPU_SCALAR_INT = 1, TPU_SCALAR_DOUBLE = 2, TPU_SCALAR_BOOL = 3 };

typedef struct TpuTensor {
  void* handle;           // tpu: the Rust storage handle (DataPtr context); NULL for cpu
  void* host_data;        // cpu: storage base pointer (offset NOT applied); NULL for tpu
  int32_t is_cpu;
  int32_t dtype;          // c10::ScalarType
  int32_t device_index;
  int32_t ndim;
  const int64_t* sizes;
  const int64_t* strides;
  int64_t storage_offset; // in elements
  int64_t storage_nbytes;
  int32_t is_wrapped_number;  // a Python scalar promoted to a 0-dim cpu tensor
  int32_t requires_grad;
} TpuTensor;

// Where values live: INT/SCALAR_TYPE/LAYOUT/MEMORY_FORMAT/BOOL(0|1) in `i`,
// DOUBLE in `d`, COMPLEX in `d`+`d_imag`, STRING in `s`. A None `Generator?`
// arrives as TPU_ARG_GENERATOR with the default generator of the op's device.
// List elements copy the list's name/is_write/is_out.
typedef struct TpuArg {
  const char* name;       // schema argument name
  int32_t kind;           // TpuArgKind
  int32_t scalar_kind;    // TpuScalarKind when the schema type is Scalar
  int32_t is_write;       // (a!) alias annotation
  int32_t is_out;         // kwarg-only out= argument
  int64_t i;
  double d;
  double d_imag;
  const char* s;
  TpuTensor t;
  int64_t list_len;
  const struct TpuArg* list;
  int64_t* gen_state;     // [seed, offset]; Rust bumps offset
} TpuArg;

enum TpuRetKind {
  TPU_RET_TENSOR = 0,     // new tensor: handle/dtype/device/ndim/sizes (contiguous);
                          // i == 1: PyTorch's layout is column-major, the shim copies
  TPU_RET_ALIAS = 1,      // push back argument `alias_arg` (mutable return / out)
  TPU_RET_INT = 2,
  TPU_RET_DOUBLE = 3,
  TPU_RET_BOOL = 4,
  TPU_RET_NONE = 5,
  TPU_RET_LIST = 6,       // a Tensor[] return: the next `i` entries are its elements
  TPU_RET_ALIAS_LIST_ELEM = 7,  // element `i` of list argument `alias_arg`
};

typedef struct TpuRet {
  int32_t kind;
  int32_t alias_arg;
  void* handle;
  int32_t dtype;
  int32_t device_index;
  int32_t ndim;
  int64_t sizes[TPU_MAX_DIMS];
  int64_t i;
  double d;
} TpuRet;

enum TpuStatus {
  TPU_OK = 0,
  TPU_DECLINED = 1,       // no native rule: shim runs the CPU fallback
  TPU_ERROR = 2,          // err filled: shim throws
  TPU_NEED_RESIZE = 3,    // out= args must be resized first: see TpuResize, then call again
};

enum TpuErrorKind {
  TPU_ERR_RUNTIME = 0,    // RuntimeError
  TPU_ERR_VALUE = 1,      // ValueError
  TPU_ERR_TYPE = 2,       // TypeError
  TPU_ERR_INDEX = 3,      // IndexError
  TPU_ERR_NOT_IMPLEMENTED = 4,  // NotImplementedError
  TPU_ERR_OUT_OF_MEMORY = 5,    // torch.OutOfMemoryError
};

#define TPU_ERR_MSG_LEN 2048
typedef struct TpuError {
  int32_t kind;
  char msg[TPU_ERR_MSG_LEN];
  // For TPU_NEED_RESIZE: which args and to what sizes.
  int32_t n_resize;
  int32_t resize_arg[8];
  int32_t resize_ndim[8];
  int64_t resize_sizes[8][TPU_MAX_DIMS];
  int32_t resize_column_major[8];  // 1: lay it out column-major (PyTorch's LAPACK outputs)
} TpuError;

#define TPU_MAX_RETS 512

// ---- Provided by Rust ----

// tpu_rs_storage_copy/_resize, tpu_rs_copy, tpu_rs_item and tpu_rs_synchronize
// return 0 on success, anything else with err set.
// Runs one op. Returns a TpuStatus. `rets` may only hold new handles on TPU_OK.
int32_t tpu_rs_dispatch(const char* op_name, const char* overload, int32_t nargs,
                        const TpuArg* args, int32_t max_rets, int32_t* nrets, TpuRet* rets,
                        TpuError* err);
// Compiled graphs (torch.compile): `key` describes a graph call's inputs (see replay_key
// in shim.cpp), `inputs` are their storage handles. Replay runs the program the graph has
// for the key and returns its outputs as new tensors, with its id in `program`: TPU_OK
// (`program` is -2 when the graph runs eagerly for this key, -4 when it runs eagerly on
// bucketed per-op programs: nothing ran), TPU_DECLINED
// (nothing for this key yet; Rust keeps it for the bind after the capture), TPU_NEED_RESIZE
// (more than max_rets outputs: nrets says how many, nothing ran) or TPU_ERROR.
int32_t tpu_rs_graph_replay(int64_t graph, const int64_t* key, int64_t nkey, void* const* inputs, int64_t ninputs,
                            int32_t max_rets, int32_t* nrets, TpuRet* rets, int64_t* program, TpuError* err);
// Storage handles: a DataPtr's data and context are the handle. NULL with err set when
// the device cannot hold nbytes.
void* tpu_rs_storage_new(int64_t nbytes, int32_t device_index, TpuError* err);
// Memory statistics of a device (see runtime's memory.rs): out[0..4] bytes of live storages
// (current, peak, allocated and freed in total), out[4..8] the same for their number,
// out[8] reserved bytes, out[9] their peak, out[10] out-of-memory errors, out[11] limit.
void tpu_rs_memory_stats(int32_t device_index, int64_t* out);
// Resets the peaks (accumulated = 0) or the totals (accumulated = 1).
void tpu_rs_memory_reset(int32_t device_index, int32_t accumulated);
// Free and total bytes of the device.
void tpu_rs_memory_info(int32_t device_index, int64_t* free_bytes, int64_t* total_bytes);
// Waits for queued work (its freed buffers go) and returns freed host memory to the system.
int32_t tpu_rs_empty_cache(TpuError* err);
void tpu_rs_storage_free(void* handle);
// Copies nbytes between storages (allocator copy_data). Returns 0 or sets err.
int32_t tpu_rs_storage_copy(void* dst, void* src, int64_t nbytes, TpuError* err);
// Re-allocates `handle` to new_nbytes keeping the first min(old,new) bytes.
int32_t tpu_rs_storage_resize(void* handle, int64_t new_nbytes, TpuError* err);
// _copy_from(src, dst): any mix of cpu/tpu, dtype conversion, broadcasting src to dst.
// With non_blocking, `keep` (may be NULL) owns the CPU source: Rust calls release(keep)
// once it no longer reads it (at once, or after a queued upload has run).
int32_t tpu_rs_copy(const TpuTensor* src, const TpuTensor* dst, int32_t non_blocking, void* keep,
                    void (*release)(void*), TpuError* err);
// Host memory shared with the CPU plugin's buffers (the c10d backend hands it to Gloo).
// host_alias: 1 with *data (the storage's bytes as t's dtype) and *hold (release it with
// tpu_rs_host_alias_release once done), 0 where buffers are not host memory (or, with
// `writable`, where something else holds the buffer: the caller writes it in place), TPU_ERROR.
// adopt_host: 1 if `len` bytes at `data` became dst's value without a copy (dst is its whole
// dense storage), 0 if the caller must copy, TPU_ERROR; release(keep) runs once the memory
// is no longer read (at once unless 1).
int32_t tpu_rs_host_alias(const TpuTensor* t, int32_t writable, void** data, void** hold, TpuError* err);
void tpu_rs_host_alias_release(void* hold);
int32_t tpu_rs_adopt_host(const TpuTensor* dst, void* data, int64_t len, void* keep, void (*release)(void*),
                          TpuError* err);
// Streams: 0 is the default stream; tpu_rs_stream_new hands out a side stream. The current
// stream is per thread (the device guard sets it). query returns 1 (idle), 0 (busy) or
// TPU_ERROR (2) with err set.
int64_t tpu_rs_stream_new(void);
void tpu_rs_stream_set_current(int64_t stream);
int32_t tpu_rs_stream_query(int64_t stream, TpuError* err);
int32_t tpu_rs_stream_synchronize(int64_t stream, TpuError* err);
// Events: *event is NULL or a handle made by tpu_rs_event_record (re-recording replaces it).
int32_t tpu_rs_event_record(void** event, int64_t stream, TpuError* err);
// The profiler's markers: like an event record, but never a flush point.
int32_t tpu_rs_event_marker(void** event, int64_t stream, TpuError* err);
void tpu_rs_event_free(void* event);
int32_t tpu_rs_event_query(void* event);
int32_t tpu_rs_event_synchronize(void* event, TpuError* err);
int32_t tpu_rs_event_block(void* event, int64_t stream, TpuError* err);
int32_t tpu_rs_event_elapsed(void* start, void* end, double* ms, TpuError* err);
// _local_scalar_dense: the single element, as int64 / double / bool by dtype.
int32_t tpu_rs_item(const TpuTensor* t, TpuRet* out, TpuError* err);
int32_t tpu_rs_device_count(void);
// 1 when scaled_dot_product_attention should take its fused entry for these operands
// (only dtype, ndim and sizes are read); mask may be NULL.
int32_t tpu_rs_sdpa_fused(const TpuTensor* q, const TpuTensor* k, const TpuTensor* v, const TpuTensor* mask,
                          double dropout, int32_t enable_gqa);

// The device trace behind the Kineto plugin (kineto.cpp): start recording; wait for queued
// work, stop and hand each program run to `emit` (times: wall-clock ns since 1970).
typedef void (*TpuTraceEmit)(void* ctx, const char* name, int32_t device, int32_t stream,
                             int64_t queued_ns, int64_t start_ns, int64_t end_ns,
                             const char* source, double source_s);
void tpu_rs_trace_start(void);
void tpu_rs_trace_stop(TpuTraceEmit emit, void* ctx);
int32_t tpu_rs_synchronize(int32_t device_index, TpuError* err);
// Warns once per op name ("aten::add.out"; no ".overload" when the overload
// name is empty); returns 0 when the CPU fallback is disabled (err set).
int32_t tpu_rs_fallback_begin(const char* op_name, TpuError* err);

// ---- Provided by the C++ shim ----

// Registers allocator, guard, hooks, generator, kernels and the fallback.
// Idempotent; returns 0 or a message (static storage) on failure.
const char* tpu_shim_init(void);
// Current device of the calling thread.
int32_t tpu_shim_current_device(void);
// Default generator of a device (created lazily): seed it / read its seed.
void tpu_shim_manual_seed(int32_t device_index, uint64_t seed);
uint64_t tpu_shim_initial_seed(int32_t device_index);
// The default generator's [seed, offset] of a device (for replaying compiled graphs).
int64_t* tpu_shim_generator_state(int32_t device_index);
// Registers the Rust-dispatching boxed kernel for PrivateUse1 on these ops
// ("add.Tensor", "aten::mul.Tensor", "mm", "myns::op.overload"), overriding
// composite kernels so the functional call reaches tpu_rs_dispatch.
// Idempotent per name. Returns NULL, or a message valid until the next call
// on this thread. Fails for unknown ops and for ops the shim implements in C++.
const char* tpu_shim_register_boxed(const char* const* names, int32_t n);

#ifdef __cplusplus
}
#endif
