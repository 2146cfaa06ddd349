// monitor.cpp
#include "observe/monitor.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include <Kokkos_Core.hpp>

#include "kernels/device.hpp"
#include "kernels/gemm.hpp"
#include "kernels/memory.hpp"
#include "kernels/typed.hpp"

#include "base/errors.hpp"

namespace zero3d {

namespace {
// A GPU reaches its product peak only on large products: 8192³, where GPU-GAP §11 measured the
// H200's bf16 rate (803-812 TFLOP/s), on device buffers, each product timed to its end.
// The operands are stored in the product's dtype, so the probe leaves no conversion scratch
// behind in the products' workspace, and the device's high-water mark restarts after it (the
// memory plan's check measures training, not this probe's 0.8 GB).
double device_gemm_peak_gflops(DType compute) {
  constexpr int64_t n = 8192;
  const size_t bytes = static_cast<size_t>(n * n) * dtype_size(compute);
  kernels::DeviceBuffer a(bytes), b(bytes);
  Kokkos::View<float*> c(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string("peak_c")), n * n);
  Kokkos::deep_copy(c, 0.5f);
  convert_any(a.data(), compute, c.data(), DType::F32, n * n);
  Kokkos::deep_copy(c, 0.25f);
  convert_any(b.data(), compute, c.data(), DType::F32, n * n);
  const double flops = 2.0 * n * n * n;
  double best = 0.0;
  for (int rep = 0; rep < 6; ++rep) {  // the first pays for cuBLASLt's set-up
    kernels::fence();
    const auto t0 = std::chrono::steady_clock::now();
    gemm(n, n, n, {a.data(), compute, false, n}, {b.data(), compute, false, n}, c.data(), n, false, compute);
    kernels::fence();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0 && s > 0) best = std::max(best, flops / s / 1e9);
  }
  return best;
}
}  // namespace

double measure_gemm_peak_gflops(DType compute) {
  if constexpr (kernels::kGpuBuild) {
    const double peak = device_gemm_peak_gflops(compute);
    kernels::reset_device_peak();
    return peak;
  }
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

int64_t drop_metrics_after(const std::string& path, int64_t last_step) {
  std::ifstream in(path);
  if (!in) return 0;
  std::vector<std::string> kept;
  int64_t dropped = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const nlohmann::json rec = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    const bool keep = rec.is_object() && rec.contains("step") && rec["step"].is_number_integer() &&
                      rec["step"].get<int64_t>() <= last_step;
    if (keep) kept.push_back(line);
    else ++dropped;
  }
  if (dropped == 0) return 0;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    for (const std::string& line : kept) out << line << '\n';
    out.flush();
    if (!out) throw SystemError(tmp + ": write failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw SystemError(path + ": cannot replace it with " + tmp + ": " + std::strerror(errno));
  return dropped;
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
