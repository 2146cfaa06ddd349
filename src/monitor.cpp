// monitor.cpp
#include "monitor.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "gemm.hpp"

#include "base.hpp"

namespace zero3d {

double measure_gemm_peak_gflops(DType compute) {
  constexpr int n = 512;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n, 0.0f);
  const double flops = 2.0 * n * n * n;
  double best = 0.0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(250);
  for (int rep = 0; rep < 3 || std::chrono::steady_clock::now() < deadline; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    gemm(n, n, n, {a.data(), DType::F32, false, n}, {b.data(), DType::F32, false, n}, c.data(), n, false, compute);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0) best = std::max(best, flops / s / 1e9);
    if (rep > 200) break;
  }
  return best;
}

MetricsWriter::MetricsWriter(const std::string& path, bool append)
    : out_(path, append ? std::ios::app : std::ios::trunc), path_(path) {
  if (!out_) throw SystemError(path + ": cannot open for writing");
}

void MetricsWriter::write(const nlohmann::json& record) {
  out_ << record.dump() << '\n';
  out_.flush();
  if (!out_) throw SystemError(path_ + ": write failed");
}

void make_directories(const std::string& path) {
  std::string partial;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      if (!partial.empty() && ::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST)
        throw SystemError(partial + ": cannot create directory: " + std::strerror(errno));
    }
    if (i < path.size()) partial += path[i];
  }
}

}  // namespace zero3d
