// trace.cpp — the per-rank region recorder and its Chrome trace-event form
// (Trace Event Format: "B"/"E" duration events, "M" metadata naming each track).
#include "observe/trace.hpp"

#include <nlohmann/json.hpp>

namespace zero3d::obs {

std::string trace_events_json(const std::vector<TraceEvent>& events, int rank, const std::string& track_name) {
  using nlohmann::json;
  std::string out = json{{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"tid", 0},
                         {"args", {{"name", track_name}}}}.dump();
  out += "," + json{{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank}, {"tid", 0},
                    {"args", {{"sort_index", rank}}}}.dump();
  // Begin and end events in time order; a region's end precedes a later sibling's begin, and
  // an inner region's end precedes its parent's (regions are scopes, so they nest).
  struct Mark {
    double t;
    bool end;
    int depth;
    size_t index;
  };
  std::vector<Mark> marks;
  marks.reserve(2 * events.size());
  for (size_t i = 0; i < events.size(); ++i) {
    marks.push_back({events[i].begin_us, false, events[i].depth, i});
    marks.push_back({events[i].end_us, true, events[i].depth, i});
  }
  std::stable_sort(marks.begin(), marks.end(), [](const Mark& a, const Mark& b) {
    if (a.t != b.t) return a.t < b.t;
    if (a.end != b.end) return a.end;                  // close before opening at the same instant
    return a.end ? a.depth > b.depth : a.depth < b.depth;  // inner closes first, outer opens first
  });
  for (const Mark& m : marks) {
    out += "," + json{{"name", events[m.index].name}, {"ph", m.end ? "E" : "B"}, {"ts", m.t}, {"pid", rank},
                      {"tid", 0}}.dump();
  }
  return out;
}

}  // namespace zero3d::obs
