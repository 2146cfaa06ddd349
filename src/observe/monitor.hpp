// monitor.hpp — timers, the MFU denominator, and the metrics.jsonl writer.
#pragma once

#include "base/dtype.hpp"
#include "kernels/device.hpp"

#include <chrono>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace zero3d {

// Wall-clock milliseconds accumulated per named phase; reset once per optimizer step.
// Names follow DeepSpeed's wall_clock_breakdown timers: forward, backward, backward_inner,
// backward_allreduce, step. On a GPU build each boundary waits for the device first, as
// DeepSpeed's timers synchronise CUDA, so a phase counts the work it queued, not the queueing.
class PhaseTimers {
 public:
  class Scope {
   public:
    Scope(PhaseTimers& t, const char* name) : t_(t), name_(name), start_(now()) {}
    ~Scope() { t_.ms_[name_] += std::chrono::duration<double, std::milli>(now() - start_).count(); }
    static std::chrono::steady_clock::time_point now() {
      if constexpr (kernels::kGpuBuild) kernels::fence();
      return std::chrono::steady_clock::now();
    }

   private:
    PhaseTimers& t_;
    const char* name_;
    std::chrono::steady_clock::time_point start_;
  };
  Scope time(const char* name) { return Scope(*this, name); }
  const std::map<std::string, double>& ms() const { return ms_; }
  void reset() { ms_.clear(); }
  // Re-attributes time measured inside one phase to another (blocked communication in backward).
  void move(const std::string& from, const std::string& to, double ms) {
    if (ms == 0.0) return;
    ms_[from] -= ms;
    ms_[to] += ms;
  }

 private:
  std::map<std::string, double> ms_;
};

// Peak single-rank GFLOP/s of a square matrix product in the model's compute dtype (sgemm, or
// the bf16 path; cuBLASLt at 8192³ on a GPU build): the MFU denominator when
// training.peak_gflops is not given. Takes about a quarter of a second.
double measure_gemm_peak_gflops(DType compute = DType::F32);

// Appends one JSON object per line; flushed after each so a killed run keeps its history.
class MetricsWriter {
 public:
  // append: continue an existing file (a resumed run), else start it anew.
  MetricsWriter(const std::string& path, bool append);
  void write(const nlohmann::json& record);

 private:
  std::ofstream out_;
  std::string path_;
};

// Rewrites a metrics.jsonl (atomically: temporary file, then rename) keeping the records of
// steps up to `last_step`; a torn last line of a killed run goes too. Returns how many records
// were dropped; a missing file is left missing.
int64_t drop_metrics_after(const std::string& path, int64_t last_step);

// mkdir -p; SystemError naming the path on failure.
void make_directories(const std::string& path);

}  // namespace zero3d
