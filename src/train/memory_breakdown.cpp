// memory_breakdown.cpp — the `memory_breakdown` report line (see memory_breakdown.hpp).
#include "train/memory_breakdown.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace zero3d {

void process_memory(int64_t* rss, int64_t* peak) {
  // VmHWM is max(high-water mark, current RSS) when read; getrusage's ru_maxrss lags the
  // current RSS between the kernel's updates of the mark.
  *rss = *peak = 0;
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string key;
    int64_t kb = 0;
    if (!(fields >> key >> kb)) continue;
    if (key == "VmRSS:") *rss = kb * 1024;
    if (key == "VmHWM:") *peak = kb * 1024;
  }
  *peak = std::max({*peak, *rss, peak_rss_bytes()});
}

int64_t peak_rss_bytes() {
  struct rusage u {};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

void machine_memory(int64_t* total, int64_t* available) {
  *total = *available = 0;
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string key;
    int64_t kb = 0;
    if (!(fields >> key >> kb)) continue;
    if (key == "MemTotal:") *total = kb * 1024;
    if (key == "MemAvailable:") *available = kb * 1024;
  }
}

namespace {
std::string mb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MB", bytes / 1e6);
  return buf;
}
}  // namespace

std::string memory_breakdown_line(const MemoryBreakdown& m) {
  const MemoryBytes& s = m.states;
  std::string line = "memory  rank 0 | params " + mb(s.params) + " | grads " + mb(s.grads) + " | master " +
                     mb(s.master) + " | optimizer_states " + mb(s.optimizer_states) + " | comm_buffers " +
                     mb(s.comm_buffers) + " | live_params_peak " + mb(s.live_params_peak) + " | activations " +
                     mb(m.activations);
  if (m.tiers) line += " | host " + mb(s.host) + " | nvme " + mb(s.nvme) + " | swap_buffers " + mb(s.swap_buffers);
  if (m.on_device)
    line += " | device allocated " + mb(m.device_allocated) + " (peak " + mb(m.device_peak) + ") | device free " +
            mb(m.device_free) + " of " + mb(m.device_total);
  line += " | resident " + mb(m.rss) + " (peak " + mb(m.peak_rss) + ")";
  if (m.machine_total > 0) {
    // DeepSpeed's "CPU Virtual Memory: used = total - available, percent" (psutil.virtual_memory).
    const int64_t used = m.machine_total - m.machine_available;
    char buf[64];
    std::snprintf(buf, sizeof buf, " | machine used %.2f GB (%.1f%%)", used / 1e9, 100.0 * used / m.machine_total);
    line += buf;
  }
  return line;
}

}  // namespace zero3d
