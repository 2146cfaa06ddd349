// trace.hpp — zero3d's timeline (`trace` section): each rank records named regions of the
// chosen steps ("block3/attention/forward", "pipe/send_activation", "zero/reduce_scatter", ...)
// as begin/end pairs in base/profiler.hpp's recorder (g_trace); rank 0 writes one Chrome
// trace-event JSON (Perfetto, chrome://tracing) with one track per rank.
#pragma once

#include <string>
#include <vector>

#include "base/profiler.hpp"

namespace zero3d::obs {

// One rank's events as Chrome trace-event JSON objects ("B"/"E" pairs on track pid = rank),
// comma-separated, with the track's name: what rank 0 concatenates.
std::string trace_events_json(const std::vector<TraceEvent>& events, int rank, const std::string& track_name);

}  // namespace zero3d::obs
