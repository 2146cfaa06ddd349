// memory_breakdown.hpp — DeepSpeed's `memory_breakdown: true` (engine.py calls see_memory_usage
// with force=memory_breakdown() around forward, backward and step; runtime/utils.py prints
// allocated/peak/cached device memory and the machine's used virtual memory). zero3d has one
// memory, so its line at each report point (every steps_per_print steps, rank 0) gives this
// rank's bytes by the categories it tracks (the `memory` record of metrics.jsonl) and the
// process's current and peak resident memory, then the machine's, as DeepSpeed's second line does.
#pragma once

#include <cstdint>
#include <string>

#include "zero/zero.hpp"

namespace zero3d {

// Whether state lies beyond device memory: host or NVMe tiers, and swap traffic, to report.
inline bool has_tiers(const ZeroConfig& z) {
  return z.offload_optimizer.device != OffloadDevice::None || z.offload_param.device != OffloadDevice::None;
}

// What one report names, gathered by the engine.
struct MemoryBreakdown {
  MemoryBytes states;          // this rank's model states and buffers (zero.hpp)
  int64_t activations = 0;     // the activation buffers' bytes
  bool tiers = false;          // offload: host / nvme / swap buffers are reported too
  int64_t rss = 0, peak_rss = 0;  // the process's resident memory now and its high-water mark
  int64_t machine_total = 0, machine_available = 0;  // /proc/meminfo; 0 when unreadable
  // A GPU build's device: what Kokkos holds allocated now and its high-water mark (DeepSpeed's
  // "MA" and "Max_MA"), and the device's free and total memory (cudaMemGetInfo).
  bool on_device = false;
  int64_t device_allocated = 0, device_peak = 0, device_free = 0, device_total = 0;
};

// The process's resident memory now and its peak (/proc/self/status VmRSS, VmHWM); 0 if unreadable.
void process_memory(int64_t* rss, int64_t* peak);
// The process's resident-memory high-water mark (getrusage's ru_maxrss, KiB on Linux).
int64_t peak_rss_bytes();
// MemTotal and MemAvailable of /proc/meminfo in bytes (0 when unreadable).
void machine_memory(int64_t* total, int64_t* available);

// "memory  rank 0 | params 1.23 MB | … | resident 45.6 MB (peak 50.1 MB) | machine used 3.21 GB (40.1%)", and on a
// GPU build "| device allocated 1.20 GB (peak 1.50 GB) | device free 140.00 GB of 150.00 GB" before the host's figures.
std::string memory_breakdown_line(const MemoryBreakdown& m);

}  // namespace zero3d
