// monitors.cpp — CSV and TensorBoard event files (DEEPSPEED-FACTS §9.3; TFRecord framing as
// tensorflow/core/lib/io/record_writer.cc, Event/Summary as tensorboard's event.proto and
// summary.proto).
#include "observe/monitors.hpp"

#include <unistd.h>

#include <array>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "base/errors.hpp"
#include "observe/monitor.hpp"

namespace zero3d {

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

namespace {
void put_le(std::string& s, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void put_varint(std::string& s, uint64_t v) {
  while (v >= 0x80) {
    s.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  s.push_back(static_cast<char>(v));
}
// Protobuf wire format: key = field << 3 | wire type (0 varint, 1 fixed64, 2 bytes, 5 fixed32).
void put_key(std::string& s, int field, int wire) { put_varint(s, static_cast<uint64_t>(field << 3 | wire)); }
void put_bytes(std::string& s, int field, const std::string& b) {
  put_key(s, field, 2);
  put_varint(s, b.size());
  s += b;
}
void put_double(std::string& s, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  put_key(s, field, 1);
  put_le(s, bits, 8);
}
std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_double(e, 1, wall_time);  // Event.wall_time
  if (step != 0) {              // Event.step (proto3: 0 is the default and not written)
    put_key(e, 2, 0);
    put_varint(e, static_cast<uint64_t>(step));
  }
  return e;
}
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace

std::string tfrecord(const std::string& payload) {
  std::string len;
  put_le(len, payload.size(), 8);
  std::string out = len;
  put_le(out, masked_crc32c(len.data(), len.size()), 4);
  out += payload;
  put_le(out, masked_crc32c(payload.data(), payload.size()), 4);
  return out;
}

std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value) {
  std::string v;
  put_bytes(v, 1, tag);  // Summary.Value.tag
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  put_key(v, 2, 5);  // Summary.Value.simple_value
  put_le(v, bits, 4);
  std::string summary;
  put_bytes(summary, 1, v);  // Summary.value
  std::string e = event_header(wall_time, step);
  put_bytes(e, 5, summary);  // Event.summary
  return e;
}

std::string file_version_event(double wall_time) {
  std::string e = event_header(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");  // Event.file_version
  return e;
}

std::string python_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[40];
  int prec = 1;
  for (; prec <= 17; ++prec) {  // the shortest round trip, as repr finds it
    std::snprintf(buf, sizeof buf, "%.*e", prec - 1, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  // buf = [-]d.ddde±XX: digits and exponent, then Python's layout (scientific below 1e-4 and from 1e16)
  std::string s = buf;
  const bool neg = s[0] == '-';
  if (neg) s.erase(0, 1);
  const size_t e = s.find('e');
  std::string digits = s.substr(0, 1) + (e > 2 ? s.substr(2, e - 2) : "");
  const int exp = std::atoi(s.c_str() + e + 1);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out;
  if (exp < -4 || exp >= 16) {
    out = digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "");
    char ex[16];  // room for any int exponent (doubles need at most 3 digits)
    std::snprintf(ex, sizeof ex, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += ex;
  } else if (exp < 0) {
    out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
  } else {
    const size_t point = static_cast<size_t>(exp) + 1;
    if (digits.size() <= point) out = digits + std::string(point - digits.size(), '0') + ".0";
    else out = digits.substr(0, point) + "." + digits.substr(point);
  }
  return (neg ? "-" : "") + out;
}

CsvMonitor::CsvMonitor(std::string dir) : dir_(std::move(dir)) { make_directories(dir_); }

void CsvMonitor::write(const std::vector<MonitorEvent>& events) {
  for (const auto& [name, value, step] : events) {
    std::string file = name;
    for (char& c : file)
      if (c == '/' || c == ' ') c = '_';
    const std::string path = dir_ + "/" + file + ".csv";
    std::ofstream out(path, std::ios::app);
    if (!out) throw SystemError(path + ": cannot open for writing");
    if (headed_.insert(name).second) out << "step," << name.substr(name.rfind('/') + 1) << "\r\n";
    out << step << "," << python_float(value) << "\r\n";  // csv.writer's default line terminator
    if (!out.flush()) throw SystemError(path + ": write failed");
  }
}

TensorBoardMonitor::TensorBoardMonitor(std::string dir) {
  make_directories(dir);
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  char name[400];
  std::snprintf(name, sizeof name, "events.out.tfevents.%010lld.%s.%d.0", (long long)std::time(nullptr), host,
                (int)::getpid());
  path_ = dir + "/" + name;
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) throw SystemError(path_ + ": cannot open for writing");
  out_ << tfrecord(file_version_event(now_seconds()));
  if (!out_.flush()) throw SystemError(path_ + ": write failed");
}

void TensorBoardMonitor::write(const std::vector<MonitorEvent>& events) {
  const double t = now_seconds();
  for (const auto& [name, value, step] : events)
    out_ << tfrecord(scalar_event(t, step, name, static_cast<float>(value)));
  if (!out_.flush()) throw SystemError(path_ + ": write failed");
}

}  // namespace zero3d
