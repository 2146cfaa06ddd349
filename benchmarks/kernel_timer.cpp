// kernel_timer.cpp — a Kokkos Tools library that times every named kernel of a real run:
// each parallel_for/reduce/scan by its label, each profiling region (the products: gemm.cpp
// and attention.hpp push one per call) and deep_copy. Times are the thread's CPU time
// (CLOCK_THREAD_CPUTIME_ID), exclusive of nested events, so a loaded machine changes them
// little. Load it into any zero3d run:
//   KOKKOS_PROFILE_LIBRARY=build/benchmarks/libzero3d_kernel_timer.so  (and, same line:)
//   ZERO3D_KERNEL_TIMER_OUT=out/timer zero3d train input/gpt-small-cpu.json --set bf16.enabled=true
// Each rank writes out/timer.<rank>.tsv at exit: name, calls, exclusive ms, inclusive ms; the
// line "(process)" holds the process's whole CPU time (user + system), so what no named
// kernel covers is that minus the sum. benchmarks/bf16_breakdown.sh turns two runs of
// different lengths into milliseconds per step.
// On a GPU build a kernel returns at its launch, so there ZERO3D_KERNEL_TIMER_CLOCK=wall times
// every event and "(process)" by the wall clock: Kokkos fences the device before each callback
// of a tool that keeps its default settings (requires_global_fencing, Kokkos_Profiling.cpp),
// region pushes and pops included, so an event's time is its device work (plus one fence each).
#include <sys/resource.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <map>
#include <string>
#include <vector>

namespace {

bool wall_clock() {
  static const bool wall = [] {
    const char* c = std::getenv("ZERO3D_KERNEL_TIMER_CLOCK");
    return c != nullptr && std::string(c) == "wall";
  }();
  return wall;
}

double clock_ms(clockid_t id) {
  timespec ts;
  clock_gettime(id, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}
// An event's clock: the thread's CPU time, or the wall clock (above).
double event_ms() { return clock_ms(wall_clock() ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID); }
double started_ms = 0.0;  // the wall clock at kokkosp_init_library

struct Totals {
  int64_t calls = 0;
  double exclusive_ms = 0.0, inclusive_ms = 0.0;
};
struct Open {
  std::string name;
  double start_ms = 0.0, children_ms = 0.0;
};

std::map<std::string, Totals>& totals() {
  static std::map<std::string, Totals> t;
  return t;
}
std::vector<Open>& open_events() {
  static std::vector<Open> s;
  return s;
}

void begin(const char* name) { open_events().push_back({name, event_ms(), 0.0}); }

void end() {
  std::vector<Open>& s = open_events();
  if (s.empty()) return;
  const Open e = s.back();
  s.pop_back();
  const double ms = event_ms() - e.start_ms;
  Totals& t = totals()[e.name];
  ++t.calls;
  t.inclusive_ms += ms;
  t.exclusive_ms += ms - e.children_ms;
  if (!s.empty()) s.back().children_ms += ms;
}

}  // namespace

extern "C" {

struct SpaceHandle {
  char name[64];
};

void kokkosp_init_library(int, uint64_t, uint32_t, void*) { started_ms = clock_ms(CLOCK_MONOTONIC); }

void kokkosp_finalize_library() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double process_ms = wall_clock() ? clock_ms(CLOCK_MONOTONIC) - started_ms
                                         : (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e3 +
                                               (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-3;
  const char* out = std::getenv("ZERO3D_KERNEL_TIMER_OUT");
  const char* rank = std::getenv("PMI_RANK");
  FILE* f = stderr;
  if (out) {
    const std::string path = std::string(out) + "." + (rank ? rank : "0") + ".tsv";
    f = std::fopen(path.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "kernel_timer: cannot write %s\n", path.c_str());
      return;
    }
  }
  std::fprintf(f, "name\tcalls\texclusive_ms\tinclusive_ms\n");
  std::fprintf(f, "(process)\t1\t%.3f\t%.3f\n", process_ms, process_ms);
  for (const auto& [name, t] : totals())
    std::fprintf(f, "%s\t%lld\t%.3f\t%.3f\n", name.c_str(), static_cast<long long>(t.calls), t.exclusive_ms,
                 t.inclusive_ms);
  if (f != stderr) std::fclose(f);
}

void kokkosp_begin_parallel_for(const char* name, uint32_t, uint64_t* id) { *id = 0, begin(name); }
void kokkosp_end_parallel_for(uint64_t) { end(); }
void kokkosp_begin_parallel_reduce(const char* name, uint32_t, uint64_t* id) { *id = 0, begin(name); }
void kokkosp_end_parallel_reduce(uint64_t) { end(); }
void kokkosp_begin_parallel_scan(const char* name, uint32_t, uint64_t* id) { *id = 0, begin(name); }
void kokkosp_end_parallel_scan(uint64_t) { end(); }
void kokkosp_push_profile_region(const char* name) { begin(name); }
void kokkosp_pop_profile_region() { end(); }
void kokkosp_begin_deep_copy(SpaceHandle, const char*, const void*, SpaceHandle, const char*, const void*, uint64_t) {
  begin("deep_copy");
}
void kokkosp_end_deep_copy() { end(); }

}  // extern "C"
