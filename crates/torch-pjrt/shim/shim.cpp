// torch-pjrt C++ shim: the parts of the PrivateUse1 ("tpu") backend that only
// C++ can register with PyTorch. Everything that decides what runs lives in
// Rust behind tpu_abi.h. Nothing registers from a static initialiser: the
// shim is a static archive inside a Rust cdylib (initialisers may be dropped)
// and double registration of the hooks aborts the process, so all of it
// happens in the explicit, idempotent tpu_shim_init().
//
// Storage model: a tpu DataPtr's data and context are both an opaque Rust
// handle, never host memory. Hence tensor.data_ptr() is meaningless for tpu
// tensors; we always read storage().data_ptr().get_context(), and we never let
// torch's CPU resize/set paths memcpy these pointers.

#include "tpu_abi.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/SDPBackend.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/profiler/stubs/base.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

// autocast.cpp: CUDA's autocast op policy for AutocastPrivateUse1.
void tpu_register_autocast_policy(torch::Library& m);
void tpu_register_kineto_profiler();  // kineto.cpp

namespace {

constexpr c10::DeviceType kTpu = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 128;  // DeviceIndex is int8

// ----------------------------------------------------------------------------
// Errors
// ----------------------------------------------------------------------------

void clear_error(TpuError& e) {
  e.kind = TPU_ERR_RUNTIME;
  e.msg[0] = '\0';
  e.n_resize = 0;
}

// Rethrows a Rust error as the c10 exception Python maps to the right class.
[[noreturn]] void throw_tpu_error(TpuError& e) {
  e.msg[TPU_ERR_MSG_LEN - 1] = '\0';  // Rust may have filled the whole buffer
  const char* m = e.msg;
  switch (e.kind) {
    case TPU_ERR_VALUE:
      TORCH_CHECK_VALUE(false, m);
    case TPU_ERR_TYPE:
      TORCH_CHECK_TYPE(false, m);
    case TPU_ERR_INDEX:
      TORCH_CHECK_INDEX(false, m);
    case TPU_ERR_NOT_IMPLEMENTED:
      TORCH_CHECK_NOT_IMPLEMENTED(false, m);
    case TPU_ERR_OUT_OF_MEMORY:
      TORCH_CHECK_WITH(OutOfMemoryError, false, m);
    default:
      TORCH_CHECK(false, m);
  }
}

// ----------------------------------------------------------------------------
// Current device (per thread: autograd runs backward on its own threads)
// ----------------------------------------------------------------------------

thread_local c10::DeviceIndex tl_device = 0;
// The current stream of each device, per thread (0: the default stream).
thread_local int64_t tl_streams[kMaxDevices] = {};

c10::DeviceIndex stream_slot(c10::DeviceIndex idx) {
  return idx < 0 ? tl_device : std::min<c10::DeviceIndex>(idx, kMaxDevices - 1);
}

// The device's current stream is where Rust queues this thread's work.
void set_current_device(c10::DeviceIndex idx) noexcept {
  tl_device = idx;
  tpu_rs_stream_set_current(tl_streams[stream_slot(idx)]);
}

int32_t device_count() {
  int32_t n = tpu_rs_device_count();
  return std::clamp<int32_t>(n, 0, kMaxDevices);
}

void check_device_index(int64_t idx) {
  TORCH_CHECK(idx >= 0 && idx < device_count(), "tpu: invalid device index ", idx,
              " (", device_count(), " device(s) available)");
}

// Scoped switch of the current device, like the device guard that codegen
// puts around CUDA kernels (the dispatcher does not do it for us).
struct DeviceScope {
  c10::DeviceIndex prev;
  bool active;
  explicit DeviceScope(int64_t idx) : prev(tl_device), active(idx >= 0 && idx != tl_device) {
    if (active) set_current_device(static_cast<c10::DeviceIndex>(idx));
  }
  ~DeviceScope() {
    if (active) set_current_device(prev);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
};

// ----------------------------------------------------------------------------
// Allocator: DataPtr(data = ctx = Rust handle)
// ----------------------------------------------------------------------------

void tpu_deleter(void* handle) {
  if (handle) tpu_rs_storage_free(handle);
}

c10::DataPtr new_handle(size_t nbytes, c10::DeviceIndex dev) {
  TpuError err;
  clear_error(err);
  void* h = tpu_rs_storage_new(static_cast<int64_t>(nbytes), dev, &err);
  if (h == nullptr) throw_tpu_error(err);
  return c10::DataPtr(h, h, &tpu_deleter, c10::Device(kTpu, dev));
}

// A DeviceAllocator, so that torch.accelerator.memory_* reach Rust's accounting
// (runtime's memory.rs); PJRT owns the buffers, there is no cache of our own.
struct TpuAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t n) override { return new_handle(n, tl_device); }
  c10::DeleterFnPtr raw_deleter() const override { return &tpu_deleter; }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {
    TpuError err;
    clear_error(err);
    if (tpu_rs_empty_cache(&err) != 0) throw_tpu_error(err);
  }
  // A storage's buffer lives as long as the queued work that reads it holds it.
  void recordStream(const c10::DataPtr&, c10::Stream) override {}
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex d) override {
    int64_t v[12];
    tpu_rs_memory_stats(d, v);
    c10::CachingDeviceAllocator::DeviceStats s;
    auto fill = [](c10::CachingAllocator::StatArray& a, const int64_t* q) {
      auto& st = a[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
      st.current = q[0];
      st.peak = q[1];
      st.allocated = q[2];
      st.freed = q[3];
    };
    fill(s.allocated_bytes, v);
    fill(s.active_bytes, v);
    fill(s.requested_bytes, v);
    fill(s.allocation, v + 4);
    fill(s.active, v + 4);
    auto& r = s.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    r.current = v[8];
    r.peak = v[9];
    s.num_ooms = v[10];
    return s;
  }
  void resetAccumulatedStats(c10::DeviceIndex d) override { tpu_rs_memory_reset(d, 1); }
  void resetPeakStats(c10::DeviceIndex d) override { tpu_rs_memory_reset(d, 0); }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex d) override {
    int64_t free_bytes = 0, total = 0;
    tpu_rs_memory_info(d, &free_bytes, &total);
    return {static_cast<size_t>(free_bytes), static_cast<size_t>(total)};
  }
  // dest/src are DataPtr data pointers, i.e. handles.
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    TpuError err;
    clear_error(err);
    if (tpu_rs_storage_copy(dest, const_cast<void*>(src), static_cast<int64_t>(count), &err) != 0)
      throw_tpu_error(err);
  }
};

TpuAllocator g_alloc;

bool is_our_storage(const c10::Storage& st) {
  return st.data_ptr().get_deleter() == &tpu_deleter;
}

// Grows/shrinks a tpu storage in place via Rust (torch's resize_bytes_cpu
// would memcpy the handle pointer as if it were host memory).
void resize_storage_bytes(c10::StorageImpl* st, size_t nbytes) {
  TORCH_CHECK(st->resizable(), "Trying to resize storage that is not resizable");
  const c10::DataPtr& dp = st->data_ptr();
  if (dp.get_deleter() == &tpu_deleter && dp.get_context() != nullptr) {
    TpuError err;
    clear_error(err);
    if (tpu_rs_storage_resize(dp.get_context(), static_cast<int64_t>(nbytes), &err) != 0)
      throw_tpu_error(err);
  } else {
    // A storage without one of our handles (e.g. a null DataPtr): nothing to
    // keep, so give it a fresh handle.
    TORCH_CHECK(dp.get() == nullptr || st->nbytes() == 0,
                "tpu: cannot resize a storage that does not hold a tpu handle");
    c10::DeviceIndex dev = st->device().has_index() ? st->device().index() : tl_device;
    st->set_data_ptr_noswap(new_handle(nbytes, dev));
  }
  st->set_nbytes(nbytes);
}

// Sets sizes/strides and grows the storage if needed (our resize_impl_cpu_).
void resize_impl(c10::TensorImpl* self, c10::IntArrayRef size, at::OptionalIntArrayRef stride) {
  if (self->sizes() == size && (!stride || self->strides() == *stride)) return;
  const auto itemsize = self->dtype().itemsize();
  const auto offset = self->storage_offset();
  size_t nbytes;
  if (stride) {
    self->set_sizes_and_strides(size, *stride);
    nbytes = at::detail::computeStorageNbytes(size, *stride, itemsize, offset);
  } else {
    self->set_sizes_contiguous(size);
    nbytes = at::detail::computeStorageNbytesContiguous(size, itemsize, offset);
  }
  if (self->numel() == 0) return;  // like CPU: no storage needed for 0 elements
  const c10::Storage& st = self->unsafe_storage();
  if (!st) {
    self->set_storage_keep_dtype(c10::Storage(c10::Storage::use_byte_size_t(), nbytes,
                                              new_handle(nbytes, self->device().index()),
                                              &g_alloc, /*resizable=*/true));
  } else if (nbytes > st.nbytes()) {
    resize_storage_bytes(st.unsafeGetStorageImpl(), nbytes);
  }
}

// ----------------------------------------------------------------------------
// Tensor descriptors
// ----------------------------------------------------------------------------

// Fills `d` for a strided cpu or tpu tensor; false if it cannot be described
// (other device, sparse, no storage, symbolic, or a tpu storage not ours).
bool describe_tensor(const at::Tensor& t, bool writable, TpuTensor* d) {
  std::memset(d, 0, sizeof(*d));
  if (t.layout() != c10::kStrided || !t.has_storage()) return false;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->has_symbolic_sizes_strides()) return false;
  const c10::Storage& st = impl->unsafe_storage();
  const c10::Device dev = t.device();
  if (dev.type() == kTpu) {
    if (!is_our_storage(st)) return false;
    d->handle = st.data_ptr().get_context();  // never t.data_ptr() (P1)
    d->is_cpu = 0;
    d->device_index = dev.index();
  } else if (dev.is_cpu()) {
    // mutable_data_ptr materialises copy-on-write storages we may write to.
    d->host_data = writable ? st.mutable_data_ptr().get() : const_cast<void*>(st.data_ptr().get());
    d->is_cpu = 1;
    d->device_index = -1;
  } else {
    return false;
  }
  d->dtype = static_cast<int32_t>(t.scalar_type());
  d->ndim = static_cast<int32_t>(t.dim());
  d->sizes = t.sizes().data();
  d->strides = t.strides().data();
  d->storage_offset = t.storage_offset();
  d->storage_nbytes = static_cast<int64_t>(st.nbytes());
  d->is_wrapped_number = impl->is_wrapped_number() ? 1 : 0;
  d->requires_grad = t.requires_grad() ? 1 : 0;
  return true;
}

void describe_or_throw(const at::Tensor& t, bool writable, TpuTensor* d, const char* what) {
  TORCH_CHECK(describe_tensor(t, writable, d), "tpu: ", what, ": unsupported tensor (device ",
              t.device(), ", layout ", t.layout(), ")");
}

// ----------------------------------------------------------------------------
// Generator: state = {seed, offset}; Rust reads it and bumps the offset.
// ----------------------------------------------------------------------------

class TpuGenerator final : public c10::GeneratorImpl {
 public:
  explicit TpuGenerator(c10::DeviceIndex idx)
      : c10::GeneratorImpl(c10::Device(kTpu, idx), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}
  static c10::DeviceType device_type() { return kTpu; }

  int64_t* state() { return state_; }

  void set_current_seed(uint64_t seed) override {
    state_[0] = static_cast<int64_t>(seed);
    state_[1] = 0;
  }
  void set_offset(uint64_t offset) override { state_[1] = static_cast<int64_t>(offset); }
  uint64_t get_offset() const override { return static_cast<uint64_t>(state_[1]); }
  uint64_t current_seed() const override { return static_cast<uint64_t>(state_[0]); }
  uint64_t seed() override {
    uint64_t s = c10::detail::getNonDeterministicRandom();
    set_current_seed(s);
    return s;
  }
  // The serialized state is 16 bytes: seed, offset (get_rng_state/set_rng_state).
  void set_state(const c10::TensorImpl& s) override {
    TORCH_CHECK(s.device().is_cpu() && s.dtype() == at::kByte && s.numel() == int64_t(sizeof(state_)),
                "tpu generator: expected a cpu ByteTensor of ", sizeof(state_), " bytes as state");
    std::memcpy(state_, s.data(), sizeof(state_));
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    at::TensorBase t = at::detail::empty_cpu({int64_t(sizeof(state_))}, at::kByte);
    std::memcpy(t.mutable_data_ptr(), state_, sizeof(state_));
    return t.getIntrusivePtr();
  }

 private:
  TpuGenerator* clone_impl() const override {
    auto* g = new TpuGenerator(device_.index());
    g->state_[0] = state_[0];
    g->state_[1] = state_[1];
    return g;
  }
  int64_t state_[2] = {static_cast<int64_t>(c10::default_rng_seed_val), 0};
};

std::once_flag g_default_gen_once[kMaxDevices];

const at::Generator& default_generator(c10::DeviceIndex idx) {
  // Leaked on purpose: generators may be touched during interpreter teardown.
  static at::Generator* gens = new at::Generator[kMaxDevices];
  if (idx < 0) idx = tl_device;
  TORCH_CHECK(idx >= 0 && idx < kMaxDevices, "tpu: invalid device index ", int(idx));
  std::call_once(g_default_gen_once[idx], [idx] { gens[idx] = at::make_generator<TpuGenerator>(idx); });
  return gens[idx];
}

TpuGenerator* default_tpu_generator(c10::DeviceIndex idx) {
  return static_cast<TpuGenerator*>(default_generator(idx).unsafeGetGeneratorImpl());
}

// ----------------------------------------------------------------------------
// Device guard: one in-order "stream" per device, events are device markers.
// ----------------------------------------------------------------------------

struct TpuGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kTpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kTpu, tl_device); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kTpu, "tpu guard: expected a tpu device, got ", d);
    check_device_index(d.index());
    set_current_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) set_current_device(d.index());
  }
  // Streams are Rust's (runtime stream.rs): id 0 is the default stream, others are side
  // streams; the current one is per thread and device, as CUDA's.
  static c10::Device concrete(c10::Device d) { return c10::Device(kTpu, stream_slot(d.index())); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, concrete(d), tl_streams[stream_slot(d.index())]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, concrete(d));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return c10::Stream(c10::Stream::UNSAFE, concrete(d), tpu_rs_stream_new());
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    c10::Stream old = getStream(s.device());
    tl_streams[stream_slot(s.device_index())] = s.id();
    if (stream_slot(s.device_index()) == tl_device) tpu_rs_stream_set_current(s.id());
    return old;
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override { tpu_rs_event_free(event); }
  void record(void** event, const c10::Stream& s, const c10::DeviceIndex, const c10::EventFlag) const override {
    TpuError err;
    clear_error(err);
    if (tpu_rs_event_record(event, s.id(), &err) != 0) throw_tpu_error(err);
  }
  void block(void* event, const c10::Stream& s) const override {
    TpuError err;
    clear_error(err);
    if (tpu_rs_event_block(event, s.id(), &err) != 0) throw_tpu_error(err);
  }
  bool queryEvent(void* event) const override { return tpu_rs_event_query(event) != 0; }
  void synchronizeEvent(void* event) const override {
    TpuError err;
    clear_error(err);
    if (tpu_rs_event_synchronize(event, &err) != 0) throw_tpu_error(err);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TpuError err;
    clear_error(err);
    double ms = 0.0;
    if (tpu_rs_event_elapsed(start, end, &ms, &err) != 0) throw_tpu_error(err);
    return ms;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(device_count());
  }
  bool queryStream(const c10::Stream& s) const override {
    TpuError err;
    clear_error(err);
    int32_t r = tpu_rs_stream_query(s.id(), &err);
    if (r == 2) throw_tpu_error(err);
    return r == 1;
  }
  void synchronizeStream(const c10::Stream& s) const override {
    TpuError err;
    clear_error(err);
    if (tpu_rs_stream_synchronize(s.id(), &err) != 0) throw_tpu_error(err);
  }
  void synchronizeDevice(const c10::DeviceIndex idx) const override {
    TpuError err;
    clear_error(err);
    if (tpu_rs_synchronize(idx < 0 ? tl_device : idx, &err) != 0) throw_tpu_error(err);
  }
};

// ----------------------------------------------------------------------------
// Profiler: torch.profiler's PrivateUse1 activity times each op between two markers on the
// current stream (device time, see runtime stream.rs). Markers never flush DeferAndFuse's
// graph: there ops run fused at the flush and their own device time is ~0.
// ----------------------------------------------------------------------------

struct TpuProfilerStubs final : torch::profiler::impl::ProfilerStubs {
  void record(c10::DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    if (device) *device = tl_device;
    void* ev = nullptr;
    TpuError err;
    clear_error(err);
    if (tpu_rs_event_marker(&ev, tl_streams[stream_slot(tl_device)], &err) != 0) throw_tpu_error(err);
    if (cpu_ns) *cpu_ns = c10::getTime();
    *event = std::shared_ptr<void>(ev, [](void* p) { tpu_rs_event_free(p); });
  }
  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* a,
                const torch::profiler::impl::ProfilerVoidEventStub* b) const override {
    TpuError err;
    clear_error(err);
    double ms = 0.0;
    if (tpu_rs_event_elapsed(a->get(), b->get(), &ms, &err) != 0) throw_tpu_error(err);
    return static_cast<float>(ms * 1000.0);  // the profiler expects microseconds
  }
  void mark(const char*) const override {}
  void rangePush(const char*) const override {}
  void rangePop() const override {}
  bool enabled() const override { return true; }
  void onEachDevice(std::function<void(int)> op) const override {
    c10::DeviceIndex prev = tl_device;
    for (int i = 0; i < device_count(); i++) {
      set_current_device(static_cast<c10::DeviceIndex>(i));
      op(i);
    }
    set_current_device(prev);
  }
  void synchronize() const override {
    TpuError err;
    clear_error(err);
    if (tpu_rs_synchronize(tl_device, &err) != 0) throw_tpu_error(err);
  }
};

// ----------------------------------------------------------------------------
// PrivateUse1 hooks
// ----------------------------------------------------------------------------

struct TpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return static_cast<c10::DeviceIndex>(device_count()); }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    check_device_index(d);
    set_current_device(d);
  }
  c10::DeviceIndex getCurrentDevice() const override { return tl_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    c10::DeviceIndex old = tl_device;
    if (d >= 0 && d != old) setCurrentDevice(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex idx) const override {
    return default_generator(idx);
  }
  at::Generator getNewGenerator(c10::DeviceIndex idx = -1) const override {
    return at::make_generator<TpuGenerator>(idx < 0 ? tl_device : idx);
  }
  // Handles carry no device; the current one is the best answer we have.
  at::Device getDeviceFromPtr(void*) const override { return at::Device(kTpu, tl_device); }
  bool isPinnedPtr(const void*) const override { return false; }
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage.unsafeGetStorageImpl(), newsize);
  }
};

// ----------------------------------------------------------------------------
// C++ kernels: factories, views, storage/metadata, copies
// ----------------------------------------------------------------------------

// Element types XLA gets from us; anything else (complex32, quantized, float8) is refused
// up front, before a tensor of that type can exist on the device.
void check_supported_dtype(at::ScalarType t) {
  using S = at::ScalarType;
  switch (t) {
    case S::Bool: case S::Byte: case S::Char: case S::Short: case S::Int: case S::Long:
    case S::UInt32: case S::UInt64: case S::Half: case S::BFloat16: case S::Float: case S::Double:
    case S::ComplexFloat: case S::ComplexDouble:
      return;
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(false, "the tpu device does not support ", t,
                                  " tensors (complex32, quantized and float8 types have no lowering); "
                                  "compute this part on the CPU");
  }
}

void check_factory_args(std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                        std::optional<bool> pin_memory, std::optional<at::ScalarType> dtype) {
  check_supported_dtype(c10::dtype_or_default(dtype));
  TORCH_CHECK(!layout || *layout == c10::kStrided, "tpu: only strided tensors are supported, got layout ", *layout);
  TORCH_CHECK(!device || device->type() == kTpu, "tpu: factory kernel called for device ", *device);
  TORCH_CHECK(!pin_memory || !*pin_memory, "tpu: only dense CPU tensors can be pinned");
  if (device && device->has_index()) check_device_index(device->index());
}

at::Tensor tpu_empty(c10::SymIntArrayRef size, std::optional<at::ScalarType> dtype,
                     std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                     std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  check_factory_args(layout, device, pin_memory, dtype);
  DeviceScope scope(device && device->has_index() ? device->index() : -1);
  return at::detail::empty_generic(C10_AS_INTARRAYREF_SLOW(size), &g_alloc,
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor tpu_empty_strided(c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                             std::optional<at::ScalarType> dtype, std::optional<c10::Layout> layout,
                             std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  check_factory_args(layout, device, pin_memory, dtype);
  DeviceScope scope(device && device->has_index() ? device->index() : -1);
  return at::detail::empty_strided_generic(C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
                                           &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// Views: torch's native implementations only touch metadata and share the StorageImpl.
at::Tensor tpu_view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}
at::Tensor tpu_reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}
at::Tensor tpu_as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                          std::optional<c10::SymInt> storage_offset) {
  std::optional<int64_t> off;
  if (storage_offset) off = storage_offset->expect_int();
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride), off);
}
at::Tensor tpu_unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  return at::native::unfold(self, dimension, size, step);
}
at::Tensor tpu_view_as_real(const at::Tensor& self) { return at::native::view_as_real(self); }
at::Tensor tpu_view_as_complex(const at::Tensor& self) { return at::native::view_as_complex(self); }

void resize_tensor(const at::Tensor& self, c10::IntArrayRef size) {
  resize_impl(self.unsafeGetTensorImpl(), size, std::nullopt);
}

const at::Tensor& tpu_resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                              std::optional<c10::MemoryFormat> memory_format) {
  resize_tensor(self, C10_AS_INTARRAYREF_SLOW(size));
  if (memory_format) {
    TORCH_CHECK(*memory_format != c10::MemoryFormat::Preserve, "Unsupported memory format ", *memory_format);
    self.unsafeGetTensorImpl()->empty_tensor_restride(*memory_format);
  }
  return self;
}

// set_ family: our own so the storage growth goes through resize_storage_bytes.
at::Tensor& set_storage_impl(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                             c10::IntArrayRef stride) {
  at::native::checkSetStorage<int64_t>(self, std::move(source), offset, size, stride);
  self.unsafeGetTensorImpl()->set_storage_offset(offset);
  at::OptionalIntArrayRef stride_opt;
  if (stride.data() != nullptr) stride_opt = stride;
  resize_impl(self.unsafeGetTensorImpl(), size, stride_opt);
  return self;
}

at::Tensor& tpu_set_storage_offset(at::Tensor& self, c10::Storage source, c10::SymInt storage_offset,
                                   c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return set_storage_impl(self, std::move(source), storage_offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size),
                          C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& tpu_set_storage(at::Tensor& self, c10::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage_impl(self, std::move(source), 0, {n}, {});
}

at::Tensor& tpu_set_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) return self;
  return set_storage_impl(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

at::Tensor& tpu_set_empty(at::Tensor& self) {
  DeviceScope scope(self.device().index());
  c10::Storage st(c10::Storage::use_byte_size_t(), 0, g_alloc.allocate(0), &g_alloc, /*resizable=*/true);
  return set_storage_impl(self, std::move(st), 0, {0}, {});
}

// src -> dst, any mix of cpu/tpu, dtype conversion and broadcasting done by Rust.
void release_tensor(void* t) { delete static_cast<at::Tensor*>(t); }

// Tensor.record_stream: nothing to do. A queued job holds the storages it reads (and
// their PJRT buffers) until it has run, on whatever stream, so freeing the tensor early
// never hands its memory to other work.
void tpu_record_stream(at::Tensor& self, c10::Stream s) {
  TORCH_CHECK(s.device_type() == kTpu, "record_stream: expected a tpu stream, got ", s);
}

// The tensor's memory as it is, without its lazy conjugate/negative bit.
at::Tensor physical(const at::Tensor& t) {
  at::Tensor a = t.alias();
  a._set_conj(false);
  a._set_neg(false);
  return a;
}

void copy_impl(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  if (src.device().type() == kTpu || dst.device().type() == kTpu) {
    check_supported_dtype(src.scalar_type());
    check_supported_dtype(dst.scalar_type());
  }
  if (dst.numel() == 0) return;
  // Lazy bits (conj() of a complex tensor, the negative views autograd makes): copy the
  // memory, then apply to the destination what the two bits disagree on.
  const bool conj = src.is_conj() != dst.is_conj();
  const bool neg = src.is_neg() != dst.is_neg();
  if (src.is_conj() || src.is_neg() || dst.is_conj() || dst.is_neg()) {
    at::Tensor d = physical(dst);
    copy_impl(physical(src), d, non_blocking);
    if (conj) at::conj_physical_(d);
    if (neg) d.neg_();
    return;
  }
  TpuTensor s, d;
  describe_or_throw(src, false, &s, "copy source");
  describe_or_throw(dst, true, &d, "copy destination");
  TpuError err;
  clear_error(err);
  // A non_blocking copy from the CPU may be queued on the current stream: Rust keeps
  // the source alive through this reference until the upload has read it.
  void* keep = nullptr;
  if (non_blocking && src.is_cpu()) keep = new at::Tensor(src);
  if (tpu_rs_copy(&s, &d, non_blocking ? 1 : 0, keep, &release_tensor, &err) != 0) throw_tpu_error(err);
}

// The c10d backend's zero-copy hand-off to Gloo on the CPU plugin (torch_pjrt::host_alias,
// torch_pjrt::adopt_host): a CPU tensor over a tpu tensor's buffer (`writable`: for an
// in-place writer, only a buffer nothing else holds), and host memory that becomes a tpu
// tensor's value. An undefined tensor (None) / false: copy instead.
at::Tensor tpu_host_alias(const at::Tensor& t, bool writable) {
  TORCH_CHECK(t.device().type() == kTpu, "host_alias: expected a tpu tensor, got ", t.device());
  if (t.is_conj() || t.is_neg()) return at::Tensor();
  TpuTensor d;
  describe_or_throw(t, false, &d, "host_alias input");
  TpuError err;
  clear_error(err);
  void* data = nullptr;
  void* hold = nullptr;
  int32_t r = tpu_rs_host_alias(&d, writable ? 1 : 0, &data, &hold, &err);
  if (r == TPU_ERROR) throw_tpu_error(err);
  if (r == 0) return at::Tensor();
  const int64_t n = static_cast<int64_t>(t.storage().nbytes()) / static_cast<int64_t>(t.element_size());
  at::Tensor flat = at::from_blob(
      data, {n}, [hold](void*) { tpu_rs_host_alias_release(hold); },
      at::TensorOptions().dtype(t.scalar_type()).device(at::kCPU));
  return flat.as_strided(t.sizes(), t.strides(), t.storage_offset());
}

void release_storage(void* s) { delete static_cast<c10::Storage*>(s); }

bool tpu_adopt_host(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.device().type() == kTpu && src.is_cpu(), "adopt_host: expected a tpu destination and a CPU source");
  if (src.scalar_type() != dst.scalar_type() || !src.is_contiguous() || src.sizes() != dst.sizes() ||
      src.is_conj() || src.is_neg() || dst.is_conj() || dst.is_neg())
    return false;
  TpuTensor d;
  describe_or_throw(dst, true, &d, "adopt_host destination");
  TpuError err;
  clear_error(err);
  // Rust holds the source's storage (not the tensor: no Python object to release off the
  // Python thread) until the device lets go of the memory.
  void* keep = new c10::Storage(src.storage());
  const int64_t len = src.numel() * static_cast<int64_t>(src.element_size());
  int32_t r = tpu_rs_adopt_host(&d, src.data_ptr(), len, keep, &release_storage, &err);
  if (r == TPU_ERROR) throw_tpu_error(err);
  return r == 1;
}

at::Tensor tpu_copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  copy_impl(self, dst, non_blocking);
  return dst;
}

at::Tensor tpu_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) {
    if (dst.device().type() == kTpu)
      resize_tensor(dst, self.sizes());
    else
      dst.resize_(self.sizes());
  }
  copy_impl(self, dst, false);
  return dst;
}

at::Scalar tpu_local_scalar_dense(const at::Tensor& self) {
  TORCH_CHECK(self.numel() == 1, "a Tensor with ", self.numel(), " elements cannot be converted to Scalar");
  if (c10::isComplexType(self.scalar_type())) {
    // TpuRet has no imaginary part: go through a host copy.
    at::Tensor host = at::empty(self.sizes(), self.options().device(c10::kCPU));
    copy_impl(self, host, false);
    return host.item();
  }
  TpuTensor t;
  describe_or_throw(self, false, &t, "item");
  TpuRet r;
  std::memset(&r, 0, sizeof(r));
  TpuError err;
  clear_error(err);
  if (tpu_rs_item(&t, &r, &err) != 0) throw_tpu_error(err);
  switch (r.kind) {
    case TPU_RET_INT:
      return at::Scalar(static_cast<int64_t>(r.i));
    case TPU_RET_DOUBLE:
      return at::Scalar(r.d);
    case TPU_RET_BOOL:
      return at::Scalar(r.i != 0);
    default:
      TORCH_CHECK(false, "tpu: tpu_rs_item returned kind ", r.kind);
  }
}

// ----------------------------------------------------------------------------
// Boxed fallback: schema-driven, language-neutral arguments for Rust
// ----------------------------------------------------------------------------

// Owns everything the TpuArg array points at for the duration of one call.
struct ArgBuilder {
  std::vector<TpuArg> top;
  std::deque<std::vector<TpuArg>> lists;  // deque: stable addresses while growing
  std::deque<std::string> strings;
  std::vector<TpuArg*> pending_default_gen;
  std::vector<c10::GeneratorImpl*> gens;  // to lock while Rust reads/bumps state
  int64_t device = -1;                    // first tpu tensor's device

  void build(const c10::FunctionSchema& schema, const c10::IValue* args, size_t n) {
    top.assign(n, TpuArg{});
    const auto& sargs = schema.arguments();
    for (size_t k = 0; k < n; ++k) {
      const c10::Argument& sa = sargs[k];
      TpuArg& a = top[k];
      a.name = sa.name().c_str();
      a.is_write = (sa.alias_info() && sa.alias_info()->isWrite()) ? 1 : 0;
      a.is_out = sa.is_out() ? 1 : 0;
      fill(a, *sa.real_type(), args[k]);
    }
    if (!pending_default_gen.empty()) {
      TpuGenerator* g = default_tpu_generator(static_cast<c10::DeviceIndex>(device >= 0 ? device : tl_device));
      for (TpuArg* a : pending_default_gen) a->gen_state = g->state();
      add_gen(g);
    }
  }

  void add_gen(c10::GeneratorImpl* g) {
    if (std::find(gens.begin(), gens.end(), g) == gens.end()) gens.push_back(g);
  }

  void fill(TpuArg& a, const c10::Type& type, const c10::IValue& v) {
    using K = c10::TypeKind;
    switch (type.kind()) {
      case K::OptionalType: {
        const c10::Type& elem = *type.castRaw<c10::OptionalType>()->getElementType();
        if (v.isNone()) {
          if (elem.kind() == K::GeneratorType) {
            a.kind = TPU_ARG_GENERATOR;  // state of the device's default generator
            pending_default_gen.push_back(&a);
          } else {
            a.kind = TPU_ARG_NONE;
          }
          return;
        }
        fill(a, elem, v);
        return;
      }
      case K::TensorType:
        tensor(a, v);
        return;
      case K::IntType:
      case K::SymIntType:
        integer(a, v, TPU_ARG_INT);
        return;
      case K::ScalarTypeType:  // ScalarType/Layout/MemoryFormat arrive as Int IValues
        integer(a, v, TPU_ARG_SCALAR_TYPE);
        return;
      case K::LayoutType:
        integer(a, v, TPU_ARG_LAYOUT);
        return;
      case K::MemoryFormatType:
        integer(a, v, TPU_ARG_MEMORY_FORMAT);
        return;
      case K::FloatType:
      case K::SymFloatType:
        if (v.isDouble()) {
          a.kind = TPU_ARG_DOUBLE;
          a.d = v.toDouble();
        } else if (v.isInt()) {
          a.kind = TPU_ARG_DOUBLE;
          a.d = static_cast<double>(v.toInt());
        } else {
          a.kind = TPU_ARG_OTHER;
        }
        return;
      case K::BoolType:
      case K::SymBoolType:
        if (v.isBool()) {
          a.kind = TPU_ARG_BOOL;
          a.i = v.toBool() ? 1 : 0;
        } else {
          a.kind = TPU_ARG_OTHER;
        }
        return;
      case K::StringType:
        if (v.isString()) {
          a.kind = TPU_ARG_STRING;
          a.s = v.toStringRef().c_str();  // owned by the IValue on the stack
        } else {
          a.kind = TPU_ARG_OTHER;
        }
        return;
      case K::NumberType:
        scalar(a, v);
        return;
      case K::ComplexType:
        if (v.isComplexDouble()) {
          auto c = v.toComplexDouble();
          a.kind = TPU_ARG_COMPLEX;
          a.d = c.real();
          a.d_imag = c.imag();
        } else {
          a.kind = TPU_ARG_OTHER;
        }
        return;
      case K::DeviceObjType:
        if (v.isDevice() && v.toDevice().type() == kTpu) {
          // A factory's device: its index (the current one when unspecified) also places
          // the call, as a tensor argument would.
          c10::Device dev = v.toDevice();
          a.kind = TPU_ARG_DEVICE;
          a.i = dev.has_index() ? dev.index() : tl_device;
          if (device < 0) device = a.i;
          strings.push_back(c10::DeviceTypeName(dev.type(), /*lower_case=*/true));
          a.s = strings.back().c_str();
        } else {
          a.kind = TPU_ARG_OTHER;
        }
        return;
      case K::GeneratorType:
        generator(a, v);
        return;
      case K::ListType:
        list(a, *type.castRaw<c10::ListType>()->getElementType(), v);
        return;
      default:
        a.kind = TPU_ARG_OTHER;
        return;
    }
  }

  static void integer(TpuArg& a, const c10::IValue& v, int32_t kind) {
    if (v.isInt()) {
      a.kind = kind;
      a.i = v.toInt();
    } else if (v.isSymInt() && v.toSymInt().maybe_as_int()) {
      a.kind = kind;
      a.i = *v.toSymInt().maybe_as_int();
    } else {
      a.kind = TPU_ARG_OTHER;  // symbolic: Rust declines
    }
  }

  static void scalar(TpuArg& a, const c10::IValue& v) {
    if (v.isInt()) {
      a.kind = TPU_ARG_INT;
      a.scalar_kind = TPU_SCALAR_INT;
      a.i = v.toInt();
    } else if (v.isDouble()) {
      a.kind = TPU_ARG_DOUBLE;
      a.scalar_kind = TPU_SCALAR_DOUBLE;
      a.d = v.toDouble();
    } else if (v.isBool()) {
      a.kind = TPU_ARG_BOOL;
      a.scalar_kind = TPU_SCALAR_BOOL;
      a.i = v.toBool() ? 1 : 0;
    } else if (v.isComplexDouble()) {
      auto c = v.toComplexDouble();
      a.kind = TPU_ARG_COMPLEX;
      a.d = c.real();
      a.d_imag = c.imag();
    } else if (v.isSymInt() && v.toSymInt().maybe_as_int()) {
      a.kind = TPU_ARG_INT;
      a.scalar_kind = TPU_SCALAR_INT;
      a.i = *v.toSymInt().maybe_as_int();
    } else {
      a.kind = TPU_ARG_OTHER;
    }
  }

  void tensor(TpuArg& a, const c10::IValue& v) {
    if (!v.isTensor()) {
      a.kind = v.isNone() ? TPU_ARG_NONE : TPU_ARG_OTHER;
      return;
    }
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {
      a.kind = TPU_ARG_NONE;
      return;
    }
    if (!describe_tensor(t, a.is_write != 0, &a.t)) {
      a.kind = TPU_ARG_OTHER;
      return;
    }
    a.kind = TPU_ARG_TENSOR;
    if (device < 0 && !a.t.is_cpu) device = a.t.device_index;
  }

  void generator(TpuArg& a, const c10::IValue& v) {
    if (v.isNone()) {
      a.kind = TPU_ARG_GENERATOR;
      pending_default_gen.push_back(&a);
      return;
    }
    if (!v.isGenerator()) {
      a.kind = TPU_ARG_OTHER;
      return;
    }
    auto* g = dynamic_cast<TpuGenerator*>(v.toGenerator().unsafeGetGeneratorImpl());
    if (!g) {  // e.g. a CPU generator: Rust declines, cpu_fallback may take it
      a.kind = TPU_ARG_OTHER;
      return;
    }
    a.kind = TPU_ARG_GENERATOR;
    a.gen_state = g->state();
    add_gen(g);
  }

  void list(TpuArg& a, const c10::Type& elem, const c10::IValue& v) {
    if (!v.isList()) {
      a.kind = TPU_ARG_OTHER;
      return;
    }
    c10::ArrayRef<c10::IValue> items = v.toListRef();
    lists.emplace_back(items.size(), TpuArg{});
    std::vector<TpuArg>& out = lists.back();
    for (size_t i = 0; i < items.size(); ++i) {
      out[i].name = a.name;
      out[i].is_write = a.is_write;
      out[i].is_out = a.is_out;
      fill(out[i], elem, items[i]);
    }
    a.kind = TPU_ARG_LIST;
    a.list_len = static_cast<int64_t>(items.size());
    a.list = out.data();
  }
};

// Locks the generators an op uses (sorted, so two threads cannot deadlock).
struct GenLocks {
  std::vector<std::unique_lock<std::mutex>> locks;
  explicit GenLocks(std::vector<c10::GeneratorImpl*>& gens) {
    std::sort(gens.begin(), gens.end());
    locks.reserve(gens.size());
    for (auto* g : gens) locks.emplace_back(g->mutex_);
  }
};

TpuRet* ret_buffer() {
  thread_local std::vector<TpuRet> buf(TPU_MAX_RETS);
  return buf.data();
}

// A Rust-made handle becomes a contiguous tensor that owns it.
at::Tensor wrap_handle(const TpuRet& r) {
  // Take ownership first so the handle is freed if a check below throws.
  c10::DataPtr dp(r.handle, r.handle, &tpu_deleter, c10::Device(kTpu, static_cast<c10::DeviceIndex>(r.device_index)));
  TORCH_CHECK(r.handle != nullptr, "tpu: Rust returned a null tensor handle");
  TORCH_CHECK(r.ndim >= 0 && r.ndim <= TPU_MAX_DIMS, "tpu: Rust returned ndim ", r.ndim);
  TORCH_CHECK(r.dtype >= 0 && r.dtype < static_cast<int32_t>(c10::ScalarType::NumOptions),
              "tpu: Rust returned dtype ", r.dtype);
  const auto meta = c10::scalarTypeToTypeMeta(static_cast<c10::ScalarType>(r.dtype));
  c10::IntArrayRef sizes(r.sizes, static_cast<size_t>(r.ndim));
  const size_t nbytes = static_cast<size_t>(c10::multiply_integers(sizes)) * meta.itemsize();
  c10::Storage st(c10::Storage::use_byte_size_t(), nbytes, std::move(dp), &g_alloc, /*resizable=*/true);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(st), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), meta);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

// Replaces the op's arguments on the stack by its returns built from `rets`.
void push_results(const c10::FunctionSchema& schema, torch::jit::Stack* stack, size_t base, size_t nargs,
                  const TpuRet* rets, int32_t nrets) {
  TORCH_CHECK(nrets >= 0 && nrets <= TPU_MAX_RETS, "tpu: Rust returned ", nrets, " results");
  // Pass 1: own every new handle before anything can throw.
  std::vector<c10::IValue> owned(static_cast<size_t>(nrets));
  for (int32_t k = 0; k < nrets; ++k)
    if (rets[k].kind == TPU_RET_TENSOR) owned[k] = wrap_handle(rets[k]);
  // Results PyTorch lays out column-major (Rust says which): copied to that layout.
  for (int32_t k = 0; k < nrets; ++k)
    if (rets[k].kind == TPU_RET_TENSOR && rets[k].i == 1) {
      const at::Tensor& t = owned[k].toTensor();
      owned[k] = t.mT().contiguous().mT();
    }

  const c10::IValue* args = stack->data() + base;
  auto single = [&](int32_t k, bool tensor_typed) -> c10::IValue {
    const TpuRet& r = rets[k];
    switch (r.kind) {
      case TPU_RET_TENSOR:
        return owned[k];
      case TPU_RET_ALIAS:
        TORCH_CHECK(r.alias_arg >= 0 && size_t(r.alias_arg) < nargs, "tpu: bad alias_arg ", r.alias_arg);
        return args[r.alias_arg];
      case TPU_RET_ALIAS_LIST_ELEM: {
        TORCH_CHECK(r.alias_arg >= 0 && size_t(r.alias_arg) < nargs && args[r.alias_arg].isList(),
                    "tpu: bad alias_arg ", r.alias_arg, " for a list element");
        auto items = args[r.alias_arg].toListRef();
        TORCH_CHECK(r.i >= 0 && size_t(r.i) < items.size(), "tpu: bad list element ", r.i);
        return items[r.i];
      }
      case TPU_RET_INT:
        return c10::IValue(static_cast<int64_t>(r.i));
      case TPU_RET_DOUBLE:
        return c10::IValue(r.d);
      case TPU_RET_BOOL:
        return c10::IValue(r.i != 0);
      case TPU_RET_NONE:
        // A non-optional Tensor return must still unbox as a Tensor (undefined).
        return tensor_typed ? c10::IValue(at::Tensor()) : c10::IValue();
      default:
        TORCH_CHECK(false, "tpu: unexpected return kind ", r.kind);
    }
  };

  const auto& sret = schema.returns();
  std::vector<c10::IValue> out;
  out.reserve(sret.size());
  int32_t pos = 0;
  for (const c10::Argument& ra : sret) {
    TORCH_CHECK(pos < nrets, "tpu: Rust returned ", nrets, " results for ", schema.operator_name(), " which has ",
                sret.size(), " returns");
    if (rets[pos].kind == TPU_RET_LIST) {
      const int64_t n = rets[pos].i;
      TORCH_CHECK(n >= 0 && pos + 1 + n <= nrets, "tpu: TPU_RET_LIST of ", n, " overruns the results");
      c10::List<at::Tensor> lst;
      lst.reserve(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) {
        c10::IValue e = single(pos + 1 + static_cast<int32_t>(j), true);
        TORCH_CHECK(e.isTensor(), "tpu: a Tensor[] return element is not a tensor");
        lst.push_back(std::move(e).toTensor());
      }
      out.emplace_back(std::move(lst));
      pos += 1 + static_cast<int32_t>(n);
    } else {
      out.push_back(single(pos, ra.type()->kind() == c10::TypeKind::TensorType));
      ++pos;
    }
  }
  TORCH_CHECK(pos == nrets, "tpu: Rust returned ", nrets, " result entries for ", schema.operator_name(),
              ", expected ", pos);
  torch::jit::drop(*stack, nargs);
  for (auto& v : out) stack->push_back(std::move(v));
}

// TPU_NEED_RESIZE: resize the listed out= tensors like structured kernels do.
void apply_resizes(const TpuError& err, torch::jit::Stack* stack, size_t base, size_t nargs) {
  TORCH_CHECK(err.n_resize > 0 && err.n_resize <= 8, "tpu: TPU_NEED_RESIZE with n_resize ", err.n_resize);
  for (int32_t r = 0; r < err.n_resize; ++r) {
    const int32_t idx = err.resize_arg[r];
    const int32_t ndim = err.resize_ndim[r];
    TORCH_CHECK(idx >= 0 && size_t(idx) < nargs && (*stack)[base + idx].isTensor(),
                "tpu: TPU_NEED_RESIZE names argument ", idx, " which is not a tensor");
    TORCH_CHECK(ndim >= 0 && ndim <= TPU_MAX_DIMS, "tpu: TPU_NEED_RESIZE with ndim ", ndim);
    const at::Tensor& t = (*stack)[base + idx].toTensor();
    c10::IntArrayRef sizes(err.resize_sizes[r], static_cast<size_t>(ndim));
    // resize_output_check warns (like CPU) when a non-empty out gets resized.
    if (at::native::resize_output_check(t, sizes)) {
      if (t.device().type() == kTpu)
        resize_tensor(t, sizes);
      else
        t.resize_(sizes);
      if (err.resize_column_major[r] == 1) {
        // Batched column-major, as PyTorch's LAPACK-backed kernels lay out their outs.
        std::vector<int64_t> strides(t.strides().begin(), t.strides().end());
        // (Empty dims count as 1, as in PyTorch's contiguous strides: no overlap.)
        auto at_least_1 = [](int64_t n) { return std::max<int64_t>(n, 1); };
        strides[ndim - 2] = 1;
        strides[ndim - 1] = at_least_1(sizes[ndim - 2]);
        int64_t step = strides[ndim - 1] * at_least_1(sizes[ndim - 1]);
        for (int32_t d = ndim - 3; d >= 0; --d) {
          strides[d] = step;
          step *= at_least_1(sizes[d]);
        }
        t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
      }
    }
  }
}

// convolution_overrideable and its backward have no CPU kernel, so the generic
// cpu_fallback cannot run them: compute with at::convolution on host copies.
void conv_on_cpu(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t base, size_t nargs,
                 c10::Device dev) {
  c10::IValue* a = stack->data() + base;
  auto host = [](const c10::IValue& v) { return v.toTensor().cpu(); };
  const bool backward = op.schema().name() == "aten::convolution_backward_overrideable";
  std::vector<c10::IValue> out;
  if (!backward) {
    // (input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
    std::optional<at::Tensor> bias;
    if (a[2].isTensor() && a[2].toTensor().defined()) bias = host(a[2]);
    at::Tensor r = at::convolution(host(a[0]), host(a[1]), bias, a[3].toIntVector(), a[4].toIntVector(),
                                   a[5].toIntVector(), a[6].toBool(), a[7].toIntVector(), a[8].toInt());
    out.emplace_back(r.to(dev));
  } else {
    // (grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups, output_mask)
    at::Tensor go = host(a[0]);
    auto mask_list = a[9].toBoolList();
    std::array<bool, 3> mask = {mask_list.get(0), mask_list.get(1), mask_list.get(2)};
    std::vector<int64_t> bias_sizes = {go.size(1)};  // bias has one entry per output channel
    auto [gi, gw, gb] = at::convolution_backward(
        go, host(a[1]), host(a[2]), mask[2] ? at::OptionalIntArrayRef(bias_sizes) : std::nullopt,
        a[3].toIntVector(), a[4].toIntVector(), a[5].toIntVector(), a[6].toBool(), a[7].toIntVector(),
        a[8].toInt(), mask);
    for (at::Tensor* t : {&gi, &gw, &gb}) out.emplace_back(t->defined() ? t->to(dev) : at::Tensor());
  }
  torch::jit::drop(*stack, nargs);
  for (auto& v : out) stack->push_back(std::move(v));
}

void run_declined(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t base, size_t nargs,
                  int64_t device) {
  const auto& schema = op.schema();
  std::string full = schema.name();
  if (!schema.overload_name().empty()) full += "." + schema.overload_name();
  TpuError err;
  clear_error(err);
  if (tpu_rs_fallback_begin(full.c_str(), &err) == 0) {
    err.msg[TPU_ERR_MSG_LEN - 1] = '\0';
    TORCH_CHECK_NOT_IMPLEMENTED(false, err.msg);
  }
  const std::string& name = schema.name();
  if (name == "aten::convolution_overrideable" || name == "aten::convolution_backward_overrideable") {
    conv_on_cpu(op, stack, base, nargs, c10::Device(kTpu, static_cast<c10::DeviceIndex>(device < 0 ? tl_device : device)));
    return;
  }
  // native_batch_norm updates running_mean/var (args 3, 4) in training mode but
  // its schema does not say so, so cpu_fallback would drop the update: hand it
  // host copies and write them back ourselves.
  std::vector<std::pair<at::Tensor, at::Tensor>> writeback;
  if (name == "aten::native_batch_norm" && nargs >= 6 && (*stack)[base + 5].isBool() &&
      (*stack)[base + 5].toBool()) {
    for (size_t k : {size_t(3), size_t(4)}) {
      c10::IValue& v = (*stack)[base + k];
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kTpu) {
        at::Tensor orig = v.toTensor();
        at::Tensor hostc = orig.cpu();
        writeback.emplace_back(orig, hostc);
        v = hostc;
      }
    }
  }
  at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
  for (auto& [orig, hostc] : writeback) copy_impl(hostc, orig, false);
}

// A tensor with its lazy conjugate/negative bit applied, in new memory.
at::Tensor resolved(const at::Tensor& t) {
  if (!t.is_conj() && !t.is_neg()) return t;
  if (t.device().type() != kTpu) return t.resolve_conj().resolve_neg();
  at::Tensor out = at::empty(t.sizes(), t.options());
  copy_impl(t, out, false);
  return out;
}

// PyTorch hands some ops (mm, dot, add, ...) tensors still carrying a lazy conjugate or
// negative bit; the programs read memory, so the inputs are resolved first.
void resolve_lazy_bits(const c10::FunctionSchema& schema, torch::jit::Stack* stack, size_t base, size_t nargs) {
  const auto& sargs = schema.arguments();
  for (size_t k = 0; k < nargs; ++k) {
    c10::IValue& v = (*stack)[base + k];
    if (sargs[k].alias_info() && sargs[k].alias_info()->isWrite()) continue;
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.defined() && (t.is_conj() || t.is_neg())) v = resolved(t);
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t i = 0; i < list.size(); ++i) {
        const at::Tensor t = list.get(i);
        if (t.defined() && (t.is_conj() || t.is_neg())) list.set(i, resolved(t));
      }
    }
  }
}

void tpu_boxed_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= nargs);
  const size_t base = stack->size() - nargs;
  resolve_lazy_bits(schema, stack, base, nargs);
  const char* name = schema.name().c_str();
  const char* overload = schema.overload_name().c_str();

  for (int attempt = 0;; ++attempt) {
    ArgBuilder b;
    b.build(schema, stack->data() + base, nargs);
    DeviceScope scope(b.device);
    TpuError err;
    clear_error(err);
    int32_t nrets = 0;
    TpuRet* rets = ret_buffer();
    int32_t status;
    {
      GenLocks locks(b.gens);
      status = tpu_rs_dispatch(name, overload, static_cast<int32_t>(nargs), b.top.data(), TPU_MAX_RETS, &nrets,
                               rets, &err);
    }
    switch (status) {
      case TPU_OK:
        push_results(schema, stack, base, nargs, rets, nrets);
        return;
      case TPU_ERROR:
        throw_tpu_error(err);
      case TPU_NEED_RESIZE:
        TORCH_CHECK(attempt < 3, "tpu: ", schema.operator_name(), " kept asking for out= resizes");
        apply_resizes(err, stack, base, nargs);
        continue;
      case TPU_DECLINED:
        run_declined(op, stack, base, nargs, b.device);
        return;
      default:
        TORCH_CHECK(false, "tpu: tpu_rs_dispatch returned unknown status ", status, " for ",
                    schema.operator_name());
    }
  }
}

// ----------------------------------------------------------------------------
// Compiled-graph replays: torch_pjrt::replay. One native call per graph call, so the input
// key and the outputs are not built tensor by tensor in Python. Which program runs is
// decided in Rust; this only describes the inputs.
// ----------------------------------------------------------------------------

// The key of a graph call: [n, n shape words, layout words]. Shape words: each tensor's
// dim and sizes, each Python value (tag, bits); layout words: each tensor's dtype, device,
// strides, offset, storage size and first input sharing its storage. A program reads each
// input's whole storage and inputs sharing one share a parameter, so all of it is keyed.
// Also the inputs' storage handles. False when a tensor is not on tpu.
bool replay_key(at::TensorList args, at::ArrayRef<c10::Scalar> values, std::vector<int64_t>& key,
                std::vector<void*>& handles) {
  thread_local std::vector<int64_t> layout;
  key.assign(1, 0);
  layout.clear();
  handles.clear();
  for (size_t i = 0; i < args.size(); ++i) {
    const at::Tensor& t = args[i];
    if (!t.defined() || t.device().type() != kTpu || !t.has_storage()) return false;
    const c10::Storage& st = t.storage();
    if (!is_our_storage(st)) return false;
    void* h = st.data_ptr().get();
    const int64_t first = std::find(handles.begin(), handles.end(), h) - handles.begin();
    handles.push_back(h);
    key.push_back(t.dim());
    for (int64_t s : t.sizes()) key.push_back(s);
    layout.push_back(static_cast<int64_t>(t.scalar_type()));
    layout.push_back(t.device().index());
    for (int64_t s : t.strides()) layout.push_back(s);
    layout.push_back(t.storage_offset());
    layout.push_back(static_cast<int64_t>(st.nbytes()));
    layout.push_back(first);
  }
  for (const c10::Scalar& v : values) {
    if (v.isBoolean()) {
      key.push_back(2);
      key.push_back(v.toBool());
    } else if (v.isIntegral(false)) {
      key.push_back(0);
      key.push_back(v.toLong());
    } else if (v.isFloatingPoint()) {
      double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      key.push_back(1);
      key.push_back(bits);
    } else {
      return false;
    }
  }
  key[0] = static_cast<int64_t>(key.size()) - 1;
  key.insert(key.end(), layout.begin(), layout.end());
  return true;
}

// What torch_pjrt::replay returns as its program id besides one that ran.
constexpr int64_t kReplayMissed = -1;     // nothing for this key yet: Python captures
constexpr int64_t kReplayUnkeyable = -3;  // an input is not a tpu tensor: Python runs eagerly
// (-2, the graph runs eagerly for this key, comes from Rust.)

// Runs the program `graph` has for the key of (args, values): (program id, outputs), or
// (a negative status, []) when nothing ran.
std::tuple<int64_t, std::vector<at::Tensor>> tpu_replay_op(int64_t graph, at::TensorList args,
                                                           at::ArrayRef<c10::Scalar> values) {
  thread_local std::vector<int64_t> key;
  thread_local std::vector<void*> handles;
  thread_local std::vector<TpuRet> rets(64);
  std::vector<at::Tensor> outs;
  if (!replay_key(args, values, key, handles)) return {kReplayUnkeyable, std::move(outs)};
  for (int attempt = 0;; ++attempt) {
    TpuError err;
    clear_error(err);
    int32_t nrets = 0;
    int64_t program = kReplayMissed;
    int32_t status = tpu_rs_graph_replay(graph, key.data(), static_cast<int64_t>(key.size()), handles.data(),
                                         static_cast<int64_t>(handles.size()), static_cast<int32_t>(rets.size()),
                                         &nrets, rets.data(), &program, &err);
    switch (status) {
      case TPU_OK:
        outs.reserve(nrets);
        for (int32_t k = 0; k < nrets; ++k) {
          try {
            outs.push_back(wrap_handle(rets[k]));
          } catch (...) {
            for (int32_t j = k + 1; j < nrets; ++j) tpu_deleter(rets[j].handle);
            throw;
          }
        }
        return {program, std::move(outs)};
      case TPU_DECLINED:
        return {kReplayMissed, std::move(outs)};
      case TPU_NEED_RESIZE:  // more outputs than `rets` holds; nothing ran
        TORCH_CHECK(attempt == 0 && nrets > static_cast<int32_t>(rets.size()), "tpu: replay output count");
        rets.resize(nrets);
        continue;
      default:
        throw_tpu_error(err);
    }
  }
}

// ----------------------------------------------------------------------------
// Registration
// ----------------------------------------------------------------------------

std::mutex g_reg_mutex;
bool g_initialized = false;
std::map<std::string, torch::Library*> g_libs;  // per namespace, leaked on purpose
std::set<std::string> g_boxed;                  // "ns::name.overload" with the boxed kernel
std::set<std::string> g_cpp_kernels;            // ops the shim implements in C++

torch::Library& impl_lib(const std::string& ns) {
  auto it = g_libs.find(ns);
  if (it != g_libs.end()) return *it->second;
  auto* lib = new torch::Library(torch::Library::IMPL, ns, c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  g_libs.emplace(ns, lib);
  return *lib;
}

// "add.Tensor" / "aten::add.Tensor" -> (ns, "add.Tensor", OperatorName)
struct ParsedName {
  std::string ns, local, key;
  c10::OperatorName op{"", ""};
};

ParsedName parse_op_name(const std::string& full) {
  ParsedName p;
  auto sep = full.find("::");
  p.ns = sep == std::string::npos ? "aten" : full.substr(0, sep);
  p.local = sep == std::string::npos ? full : full.substr(sep + 2);
  auto dot = p.local.find('.');
  std::string base = dot == std::string::npos ? p.local : p.local.substr(0, dot);
  std::string overload = dot == std::string::npos ? "" : p.local.substr(dot + 1);
  p.op = c10::OperatorName(p.ns + "::" + base, overload);
  p.key = p.ns + "::" + p.local;
  return p;
}

// Caller holds g_reg_mutex.
void register_boxed_locked(const std::string& full) {
  ParsedName p = parse_op_name(full);
  if (g_boxed.count(p.key)) return;
  TORCH_CHECK(!g_cpp_kernels.count(p.key), "tpu: ", p.key, " is implemented by the C++ shim");
  TORCH_CHECK(c10::Dispatcher::singleton().findSchema(p.op).has_value(), "tpu: unknown operator ", p.key);
  impl_lib(p.ns).impl(p.local.c_str(), torch::CppFunction::makeFromBoxedFunction<&tpu_boxed_kernel>());
  g_boxed.insert(p.key);
}

// scaled_dot_product_attention asks each device which kernel to run. Rust decides whether
// the fused entry (one op, lowered with its backward) fits; otherwise PyTorch's math path
// runs (and raises its own errors). Fake tensors reach here under torch.compile: only
// dtypes and sizes are read. A symbolic size (dynamic=True) goes as a negative id, one per
// expression, so Rust sees equal what is equal for every length (duck sizing gives equal
// input sizes one symbol); other symbolic sizes compare unequal (the math path). No guard
// is added: the choice holds for every length the graph serves.
int64_t tpu_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& mask, double dropout, bool /*is_causal*/,
                       std::optional<double> /*scale*/, bool enable_gqa) {
  auto& ctx = at::globalContext();
  const auto math = static_cast<int64_t>(ctx.userEnabledMathSDP() ? at::SDPBackend::math : at::SDPBackend::error);
  if (!ctx.userEnabledOverrideableSDP()) return math;
  std::vector<std::vector<int64_t>> sizes;
  std::vector<std::string> symbols;
  auto meta = [&](const at::Tensor& t, TpuTensor& d) {
    std::vector<int64_t> s;
    for (const c10::SymInt& n : t.sym_sizes()) {
      if (auto i = n.maybe_as_int()) {
        s.push_back(*i);
        continue;
      }
      const std::string expr = n.toSymNodeImplUnowned()->str();
      auto at = std::find(symbols.begin(), symbols.end(), expr);
      if (at == symbols.end()) at = symbols.insert(symbols.end(), expr);
      s.push_back(-2 - static_cast<int64_t>(at - symbols.begin()));
    }
    sizes.push_back(std::move(s));
    std::memset(&d, 0, sizeof d);
    d.dtype = static_cast<int32_t>(t.scalar_type());
    d.ndim = static_cast<int32_t>(t.dim());
  };
  TpuTensor d[4];
  const bool has_mask = mask.has_value() && mask->defined();
  meta(q, d[0]);
  meta(k, d[1]);
  meta(v, d[2]);
  if (has_mask) meta(*mask, d[3]);
  for (size_t i = 0; i < sizes.size(); ++i) d[i].sizes = sizes[i].data();
  const bool fused = tpu_rs_sdpa_fused(&d[0], &d[1], &d[2], has_mask ? &d[3] : nullptr, dropout, enable_gqa) != 0;
  return fused ? static_cast<int64_t>(at::SDPBackend::overrideable) : math;
}

void init_locked() {
  // Another PrivateUse1 backend (or a second copy of this library) owns the
  // hooks already; registering again would terminate the process.
  TORCH_CHECK(!at::isPrivateUse1HooksRegistered(),
              "a PrivateUse1 backend is already registered in this process (is torch_pjrt loaded twice?)");

  c10::SetAllocator(kTpu, &g_alloc);
  c10::impl::registerDeviceGuard(kTpu, new TpuGuardImpl());
  at::RegisterPrivateUse1HooksInterface(new TpuHooks());
  static TpuProfilerStubs profiler_stubs;
  torch::profiler::impl::registerPrivateUse1Methods(&profiler_stubs);

  torch::Library& m = impl_lib("aten");
  auto cpp = [&](const char* name, auto&& fn) {
    m.impl(name, std::forward<decltype(fn)>(fn));
    g_cpp_kernels.insert(std::string("aten::") + name);
  };
  cpp("empty.memory_format", TORCH_FN(tpu_empty));
  cpp("empty_strided", TORCH_FN(tpu_empty_strided));
  cpp("view", TORCH_FN(tpu_view));
  cpp("_reshape_alias", TORCH_FN(tpu_reshape_alias));
  cpp("as_strided", TORCH_FN(tpu_as_strided));
  cpp("unfold", TORCH_FN(tpu_unfold));
  cpp("view_as_real", TORCH_FN(tpu_view_as_real));
  cpp("view_as_complex", TORCH_FN(tpu_view_as_complex));
  cpp("resize_", TORCH_FN(tpu_resize_));
  cpp("set_.source_Storage", TORCH_FN(tpu_set_storage));
  cpp("set_.source_Storage_storage_offset", TORCH_FN(tpu_set_storage_offset));
  cpp("set_.source_Tensor", TORCH_FN(tpu_set_tensor));
  cpp("set_", TORCH_FN(tpu_set_empty));
  cpp("_copy_from", TORCH_FN(tpu_copy_from));
  cpp("_copy_from_and_resize", TORCH_FN(tpu_copy_from_and_resize));
  cpp("_local_scalar_dense", TORCH_FN(tpu_local_scalar_dense));
  cpp("record_stream", TORCH_FN(tpu_record_stream));

  // Our own ops, called by compile.py. A catch-all kernel: no autograd, any device.
  static torch::Library* own =
      new torch::Library(torch::Library::DEF, "torch_pjrt", std::nullopt, __FILE__, __LINE__);
  own->def("replay(int graph, Tensor[] args, Scalar[] values) -> (int, Tensor[])", TORCH_FN(tpu_replay_op));
  own->def("host_alias(Tensor self, bool writable=False) -> Tensor", TORCH_FN(tpu_host_alias));
  own->def("adopt_host(Tensor(a!) self, Tensor src) -> bool", TORCH_FN(tpu_adopt_host));

  // Their composite defaults throw for non-CPU/CUDA devices (P5).
  register_boxed_locked("convolution_overrideable");
  register_boxed_locked("convolution_backward_overrideable");
  // Composite kernels that call a CPU/CUDA-only DispatchStub.
  register_boxed_locked("conj_physical_");
  register_boxed_locked("_conj_physical");
  at::native::_fused_sdp_choice_stub.set_privateuse1_dispatch_ptr(&tpu_sdp_choice);

  static torch::Library* fallback =
      new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  fallback->fallback(torch::CppFunction::makeFromBoxedFunction<&tpu_boxed_kernel>());

  // Copies apply lazy conjugate/negative bits themselves (copy_impl); PyTorch's fallback
  // for those keys would resolve the source with a copy, i.e. recurse into this one.
  for (auto key : {c10::DispatchKey::Conjugate, c10::DispatchKey::Negative}) {
    auto* lib = new torch::Library(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
    lib->impl("_copy_from", torch::CppFunction::makeFallthrough());
    lib->impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
  }

  // Without this every op fails inside torch.autocast("tpu") (P7).
  static torch::Library* autocast =
      new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::AutocastPrivateUse1, __FILE__, __LINE__);
  autocast->fallback(torch::CppFunction::makeFallthrough());
  static torch::Library* policy =
      new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::AutocastPrivateUse1, __FILE__, __LINE__);
  tpu_register_autocast_policy(*policy);
  tpu_register_kineto_profiler();
}

thread_local std::string tl_message;

const char* remember(const char* prefix, const char* what) {
  tl_message = std::string(prefix) + what;
  return tl_message.c_str();
}

}  // namespace

// ----------------------------------------------------------------------------
// C entry points for Rust: no C++ exception may cross these.
// ----------------------------------------------------------------------------

extern "C" {

const char* tpu_shim_init(void) {
  static std::string failure;  // "static storage" per the ABI; set once
  try {
    std::lock_guard<std::mutex> g(g_reg_mutex);
    if (g_initialized) return nullptr;
    if (!failure.empty()) return failure.c_str();  // a failed init is not retried
    try {
      init_locked();
    } catch (const c10::Error& e) {
      failure = std::string("tpu_shim_init: ") + e.what_without_backtrace();
      return failure.c_str();
    } catch (const std::exception& e) {
      failure = std::string("tpu_shim_init: ") + e.what();
      return failure.c_str();
    }
    g_initialized = true;
    return nullptr;
  } catch (...) {
    return "tpu_shim_init: unknown C++ exception";
  }
}

int32_t tpu_shim_current_device(void) { return tl_device; }

void tpu_shim_manual_seed(int32_t device_index, uint64_t seed) {
  try {
    if (device_index < 0 || device_index >= kMaxDevices) return;
    TpuGenerator* g = default_tpu_generator(static_cast<c10::DeviceIndex>(device_index));
    std::lock_guard<std::mutex> lock(g->mutex_);
    g->set_current_seed(seed);
  } catch (...) {
  }
}

uint64_t tpu_shim_initial_seed(int32_t device_index) {
  try {
    if (device_index < 0 || device_index >= kMaxDevices) return 0;
    TpuGenerator* g = default_tpu_generator(static_cast<c10::DeviceIndex>(device_index));
    std::lock_guard<std::mutex> lock(g->mutex_);
    return g->current_seed();
  } catch (...) {
    return 0;
  }
}

int64_t* tpu_shim_generator_state(int32_t device_index) {
  try {
    if (device_index < 0 || device_index >= kMaxDevices) return nullptr;
    return default_tpu_generator(static_cast<c10::DeviceIndex>(device_index))->state();
  } catch (...) {
    return nullptr;
  }
}

const char* tpu_shim_register_boxed(const char* const* names, int32_t n) {
  try {
    std::lock_guard<std::mutex> g(g_reg_mutex);
    if (!g_initialized) return remember("tpu_shim_register_boxed: ", "call tpu_shim_init first");
    for (int32_t k = 0; k < n; ++k) {
      if (names[k] == nullptr) continue;
      register_boxed_locked(names[k]);
    }
    return nullptr;
  } catch (const c10::Error& e) {
    return remember("tpu_shim_register_boxed: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    return remember("tpu_shim_register_boxed: ", e.what());
  } catch (...) {
    return remember("tpu_shim_register_boxed: ", "unknown C++ exception");
  }
}

}  // extern "C"
