// monitor.cpp
#include "monitor.hpp"

#include <cblas.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "base.hpp"

namespace zero3d {

double measure_sgemm_peak_gflops() {
  constexpr int n = 512;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n, 0.0f);
  const double flops = 2.0 * n * n * n;
  double best = 0.0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(250);
  for (int rep = 0; rep < 3 || std::chrono::steady_clock::now() < deadline; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
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
