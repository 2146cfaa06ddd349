// monitors.hpp — DeepSpeed's csv_monitor and tensorboard monitors (monitor/csv_monitor.py,
// monitor/tensorboard.py; DEEPSPEED-FACTS §9.3): events (name, value, global samples) written by
// rank 0. TensorBoard event files are TFRecord files — length, masked CRC32C of the length,
// payload, masked CRC32C of the payload — whose payloads are Event protobufs encoded here by
// hand (wall_time, step, file_version or a Summary with one simple_value).
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "observe/observability_config.hpp"

namespace zero3d {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), and TFRecord's mask of it.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
inline uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// One TFRecord: the framing around `payload`.
std::string tfrecord(const std::string& payload);
// Event{wall_time, step, summary{value{tag, simple_value}}} and the first Event{file_version}.
std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value);
std::string file_version_event(double wall_time);

using MonitorEvent = std::tuple<std::string, double, int64_t>;  // name, value, global samples

// <dir>/<name with '/' and ' ' as '_'>.csv, appended; the header `step,<last name component>`
// once per file in this process, as Python's csv module writes (values as repr prints them).
class CsvMonitor {
 public:
  explicit CsvMonitor(std::string dir);
  void write(const std::vector<MonitorEvent>& events);
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::set<std::string> headed_;
};

// events.out.tfevents.<time>.<host>.<pid>.0 in <dir>, flushed after every batch of events.
class TensorBoardMonitor {
 public:
  explicit TensorBoardMonitor(std::string dir);
  void write(const std::vector<MonitorEvent>& events);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

// Python's repr of a float: the shortest text that reads back as the same double.
std::string python_float(double x);

}  // namespace zero3d
