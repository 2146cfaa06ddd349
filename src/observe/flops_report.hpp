// flops_report.hpp — what the flops profiler's report (DeepSpeed print_model_profile,
// DEEPSPEED-FACTS §9.2) is made of; filled by the observer from the counted step.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "observe/observability_config.hpp"

namespace zero3d::obs {

// One node of the module tree, in pre-order (depth 0 = the model): forward figures of one rank.
struct ProfiledModule {
  std::string name, type;  // "h.3", "Block"
  int depth = 0;
  int64_t params = 0;
  double macs = 0.0;  // forward MACs of the profiled step
  double ms = 0.0;    // forward wall time of the profiled step
};

struct FlopsReport {
  FlopsProfilerConfig cfg;
  int64_t step = 0;
  int world_size = 1, dp_size = 1, mp_size = 1;
  int64_t batch_per_gpu = 0;
  int64_t params_per_gpu = 0, params_of_model = 0;
  double fwd_macs = 0.0, bwd_macs = 0.0, recompute_macs = 0.0;  // this rank, the whole step
  double fwd_macs_of_model = 0.0;                               // summed over the model-parallel ranks
  double fwd_ms = 0.0, bwd_ms = 0.0, step_ms = 0.0, iter_ms = 0.0;
  bool wall_clock_breakdown = false;
  double samples_per_s = 0.0;
  double model_flops = 0.0, hardware_flops = 0.0;  // this rank: 2·(fwd + bwd) MACs; + recompute
  double mfu = 0.0, hfu = 0.0;                     // all ranks' flops per second over all ranks' peak
  double peak_flops_total = 0.0;
  std::vector<ProfiledModule> modules;
};

std::string flops_profile_report(const FlopsReport& r);

}  // namespace zero3d::obs
