// observe/observability_config.hpp — the option structs of the sections that look inside a run:
// flops_profiler, csv_monitor, tensorboard, comms_logger (DeepSpeed's keys and defaults,
// DEEPSPEED-FACTS §9.2–9.4) and zero3d's own trace. Read by config/observability.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zero3d {

// flops_profiler (DeepSpeed profiling/config.py): the report of one step, printed by rank 0.
struct FlopsProfilerConfig {
  bool enabled = false;
  int64_t profile_step = 1;  // the global step (1-based) profiled
  int module_depth = -1;     // deepest level of the aggregated profile; -1 = all
  int top_modules = 1;       // modules per depth in the aggregated profile
  bool detailed = true;      // also print the per-module tree
  std::string output_file;   // empty: standard output
};

// csv_monitor / tensorboard (DeepSpeed monitor/config.py): files under <output_path>/<job_name>/.
struct MonitorConfig {
  bool enabled = false;
  std::string output_path;  // empty: the run's output directory (DeepSpeed: the working directory or ~/tensorboard)
  std::string job_name = "DeepSpeedJobName";
};

// comms_logger (DeepSpeed comm/config.py): per-operation latency and bandwidth of every collective.
struct CommsLoggerConfig {
  bool enabled = false;
  bool verbose = false;   // print every operation as it completes
  bool prof_all = true;   // log every operation (else only those in prof_ops)
  bool debug = false;     // name the caller's axis in verbose lines
  std::vector<std::string> prof_ops;  // operation names logged when prof_all is false
  bool logs(const std::string& op) const {
    if (prof_all) return true;
    for (const std::string& p : prof_ops)
      if (p == op) return true;
    return false;
  }
};

// trace (zero3d's key): a Chrome trace-event timeline of the chosen steps, output/<run>/trace.json.
struct TraceConfig {
  bool enabled = false;
  std::vector<int64_t> steps{1};  // 1-based optimizer steps recorded
};

struct ObservabilityConfig {
  FlopsProfilerConfig flops_profiler;
  MonitorConfig csv_monitor, tensorboard;
  CommsLoggerConfig comms_logger;
  TraceConfig trace;
};

}  // namespace zero3d
