// profiler.cpp — the counting hooks' state and the timeline recorder (base/profiler.hpp).
#include "base/profiler.hpp"

namespace zero3d::obs {

Hooks g_hooks;
Counters g_counters;

std::string module_name(int module, int n_layer) {
  if (module == 0) return "embedding";
  if (module == ln_f_module(n_layer)) return "ln_f";
  if (module == lm_head_module(n_layer)) return "lm_head";
  const int block = (module - 1) / 2;
  return "block" + std::to_string(block) + ((module - 1) % 2 == 0 ? "/attention" : "/mlp");
}

namespace {
const char* pass_name(Pass p) {
  return p == Pass::Forward ? "forward" : p == Pass::Backward ? "backward" : "recompute";
}
}  // namespace

namespace detail {
void add_macs(double macs) {
  Counters& c = g_counters;
  if (c.module >= 0 && c.module < static_cast<int>(c.modules.size()))
    c.modules[static_cast<size_t>(c.module)].macs[static_cast<int>(c.pass)] += macs;
  else
    c.unattributed_macs += macs;
}

size_t begin_region(int module, Pass pass, std::chrono::steady_clock::time_point t0) {
  if (!g_hooks.trace) return 0;
  return g_trace.open(module_name(module, g_counters.n_layer) + "/" + pass_name(pass), t0);
}

void end_region(int module, Pass pass, std::chrono::steady_clock::time_point t0, size_t slot) {
  const auto t1 = g_hooks.now();
  Counters& c = g_counters;
  if (g_hooks.flops && module >= 0 && module < static_cast<int>(c.modules.size()))
    c.modules[static_cast<size_t>(module)].ms[static_cast<int>(pass)] +=
        std::chrono::duration<double, std::milli>(t1 - t0).count();
  if (g_hooks.trace) g_trace.close(slot, t1);
}
}  // namespace detail

TraceRecorder g_trace;

size_t TraceRecorder::open(std::string name, std::chrono::steady_clock::time_point t0) {
  events_.push_back({std::move(name), us(t0), -1.0, depth_++});
  return events_.size() - 1;
}

void TraceRecorder::close(size_t slot, std::chrono::steady_clock::time_point t1) {
  events_[slot].end_us = us(t1);
  --depth_;
}

}  // namespace zero3d::obs
