// trace.hpp — zero3d's timeline (`trace` section): each rank records named regions of the
// chosen steps ("block3/attention/forward", "pipe/send_activation", "zero/reduce_scatter", ...)
// as begin/end pairs; rank 0 writes one Chrome trace-event JSON (Perfetto, chrome://tracing)
// with one track per rank. Regions nest (every one is a scope), so each begin has its end.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "profiler.hpp"

namespace zero3d::obs {

struct TraceEvent {
  std::string name;
  double begin_us = 0.0, end_us = 0.0;  // since the trace origin
  int depth = 0;                        // nesting level when it began
};

class TraceRecorder {
 public:
  // Common origin of every rank's clock: taken by all ranks right after a barrier.
  void set_origin(std::chrono::steady_clock::time_point t) { origin_ = t; }
  // A region opened: returns its slot; close() fills its end.
  size_t open(std::string name, std::chrono::steady_clock::time_point t0);
  void close(size_t slot, std::chrono::steady_clock::time_point t1);
  const std::vector<TraceEvent>& events() const { return events_; }
  int open_regions() const { return depth_; }

 private:
  double us(std::chrono::steady_clock::time_point t) const {
    return std::chrono::duration<double, std::micro>(t - origin_).count();
  }
  std::chrono::steady_clock::time_point origin_ = std::chrono::steady_clock::now();
  std::vector<TraceEvent> events_;
  int depth_ = 0;
};
extern TraceRecorder g_trace;

// A named region of a traced step (nothing when the step is not traced).
class TraceScope {
 public:
  explicit TraceScope(const char* name) {
    if (g_hooks.trace) start(name);
  }
  explicit TraceScope(const std::string& name) {
    if (g_hooks.trace) start(name);
  }
  ~TraceScope() {
    if (active_) g_trace.close(slot_, std::chrono::steady_clock::now());
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  void start(std::string name) {
    slot_ = g_trace.open(std::move(name), std::chrono::steady_clock::now());
    active_ = true;
  }
  size_t slot_ = 0;
  bool active_ = false;
};

// One rank's events as Chrome trace-event JSON objects ("B"/"E" pairs on track pid = rank),
// comma-separated, with the track's name: what rank 0 concatenates.
std::string trace_events_json(const std::vector<TraceEvent>& events, int rank, const std::string& track_name);

}  // namespace zero3d::obs
