// The Kineto plugin: `torch.profiler.profile(activities=[..., ProfilerActivity.PrivateUse1])`
// records what ran on the tpu device. PyTorch 2.15 forwards a PrivateUse1 IActivityProfiler
// to Kineto (PrivateUse1ProfilerRegistry); each session switches the runtime's device trace
// (runtime/src/trace.rs) on and off and hands its program runs to Kineto as kernel
// activities, one track per device and stream. PyTorch maps kernel activities of a renamed
// PrivateUse1 backend to the device type PrivateUse1, so `key_averages()` shows their device
// time and `export_chrome_trace` puts them on device tracks.

#define USE_KINETO 1

#include <deque>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <GenericTraceActivity.h>
#include <libkineto.h>
#include <IActivityProfiler.h>
#include <output_base.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>

#include "tpu_abi.h"

namespace {

using libkineto::ActivityType;

struct Run {
  std::string name;
  int32_t device;
  int32_t stream;
  int64_t queued, start, end;
  std::string source;
  double source_s;
};

class TpuSession : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    tpu_rs_trace_start();
    status_ = libkineto::TraceStatus::RECORDING;
  }

  void stop() override {
    tpu_rs_trace_stop(&TpuSession::collect, this);
    status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override { return {}; }

  void processTrace(libkineto::ActivityLogger& logger) override {
    int64_t lo = runs_.empty() ? 0 : runs_.front().start, hi = lo;
    for (const Run& r : runs_) {
      lo = std::min(lo, r.start);
      hi = std::max(hi, r.end);
    }
    span_ = std::make_unique<libkineto::TraceSpan>(lo, hi, "tpu");
    int32_t id = 0;
    for (const Run& r : runs_) {
      // Activities must outlive the logger's use of them: the session owns them.
      auto& a = activities_.emplace_back(*span_, ActivityType::CONCURRENT_KERNEL, r.name);
      a.startTime = r.start;
      a.endTime = r.end;
      a.id = ++id;
      a.device = r.device;
      a.resource = r.stream;
      a.addMetadataQuoted("device", "tpu:" + std::to_string(r.device));
      a.addMetadataQuoted("stream", std::to_string(r.stream));
      a.addMetadataQuoted("queued (us before start)", std::to_string((r.start - r.queued) / 1000));
      a.addMetadataQuoted("program", r.source);
      a.addMetadataQuoted("program seconds", std::to_string(r.source_s));
      logger.handleGenericActivity(a);
    }
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override { return nullptr; }

  std::vector<libkineto::ResourceInfo> getResourceInfos() override { return {}; }

  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return nullptr; }

 private:
  static void collect(void* ctx, const char* name, int32_t device, int32_t stream, int64_t queued,
                      int64_t start, int64_t end, const char* source, double source_s) {
    static_cast<TpuSession*>(ctx)->runs_.push_back(
        Run{name, device, stream, queued, start, end, source, source_s});
  }

  std::vector<Run> runs_;
  std::unique_ptr<libkineto::TraceSpan> span_;
  std::deque<libkineto::GenericTraceActivity> activities_;
};

class TpuActivityProfiler : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }

  const std::set<ActivityType>& availableActivities() const override { return activities_; }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      const std::set<ActivityType>& types, const libkineto::Config&) override {
    if (types.count(ActivityType::CONCURRENT_KERNEL) == 0) return nullptr;
    return std::make_unique<TpuSession>();
  }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      int64_t, int64_t, const std::set<ActivityType>& types, const libkineto::Config& config) override {
    return configure(types, config);
  }

 private:
  std::string name_{"tpu"};
  std::set<ActivityType> activities_{ActivityType::CONCURRENT_KERNEL};
};

}  // namespace

// Called once from the shim's init (not a static initializer: the library loads first).
void tpu_register_kineto_profiler() {
  torch::profiler::impl::PrivateUse1ProfilerRegistry::instance().registerFactory(
      [] { return std::make_unique<TpuActivityProfiler>(); });
}
