// compressed_allreduce.cpp — the 1-bit all-reduce of compressed_allreduce.hpp over the
// Communicator interface (all_to_all and all_gather of bytes and scales), so it runs on any
// backend and its bytes are counted and logged as every other collective's.
#include "parallel/compressed_allreduce.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace zero3d {

namespace {
// ‖x‖₂/sqrt(len) as DeepSpeed computes it: torch.linalg.norm (the sum in wide precision here,
// rounded to fp32 as torch's fp32 result), divided by np.sqrt(len) in fp32 arithmetic.
float rms_scale(const float* x, int64_t len) {
  double sq = 0.0;
  for (int64_t i = 0; i < len; ++i) sq += double(x[i]) * double(x[i]);
  return static_cast<float>(std::sqrt(sq)) / static_cast<float>(std::sqrt(double(len)));
}

// Packs the sign bits (v >= 0) of len values (a multiple of 8), cupy.packbits order.
void pack_signs(const float* v, int64_t len, uint8_t* out) {
  for (int64_t b = 0; b < len / 8; ++b) {
    uint8_t byte = 0;
    for (int k = 0; k < 8; ++k) byte = static_cast<uint8_t>(byte | ((v[8 * b + k] >= 0.0f ? 1u : 0u) << (7 - k)));
    out[b] = byte;
  }
}

inline float sign_of(const uint8_t* packed, int64_t i) {
  return (packed[i >> 3] >> (7 - (i & 7))) & 1u ? 1.0f : -1.0f;
}

// x − s·(±1) where the sign is x's own (x >= 0 → +1): the compression error fed back.
void feed_back(const float* x, int64_t len, float s, float* error) {
  for (int64_t i = 0; i < len; ++i) error[i] = x[i] - s * (x[i] >= 0.0f ? 1.0f : -1.0f);
}
}  // namespace

int64_t onebit_padded_size(int64_t n, int world) {
  if (world < 1) throw std::logic_error("onebit_padded_size: world < 1");
  const int64_t divider = int64_t(world) * 8 / std::gcd(world, 8);
  const int64_t unit = int64_t(world) * divider;
  return n % unit == 0 ? n : n + unit - n % unit;
}

void CompressedAllReduce::run(float* buf, int64_t n, OneBitErrors& e) {
  const int w = comm_.size();
  if (n == 0) {  // DeepSpeed returns at once, zeroing what errors there are
    std::fill(e.worker.begin(), e.worker.end(), 0.0f);
    std::fill(e.server.begin(), e.server.end(), 0.0f);
    return;
  }
  const int64_t padded = onebit_padded_size(n, w), chunk = padded / w, chunk_bytes = chunk / 8;
  if (static_cast<int64_t>(e.worker.size()) != padded) e.worker.assign(static_cast<size_t>(padded), 0.0f);
  if (static_cast<int64_t>(e.server.size()) != chunk) e.server.assign(static_cast<size_t>(chunk), 0.0f);

  // 1. worker compression with error feedback
  x_.resize(static_cast<size_t>(padded));
  for (int64_t i = 0; i < padded; ++i) x_[i] = (i < n ? buf[i] : 0.0f) + e.worker[i];
  const float worker_scale = rms_scale(x_.data(), padded);
  feed_back(x_.data(), padded, worker_scale, e.worker.data());
  packed_.resize(static_cast<size_t>(padded / 8));
  pack_signs(x_.data(), padded, packed_.data());

  // 2. phase 1: chunk j of every rank to rank j, and every worker scale to every rank
  received_.resize(static_cast<size_t>(padded / 8));
  comm_.all_to_all(packed_.data(), received_.data(), chunk_bytes, DType::U8);
  scales_.resize(static_cast<size_t>(w));
  comm_.all_gather(&worker_scale, scales_.data(), 1, DType::F32);

  // 3. server: the mean of the decoded chunks (each term ±s_i·(1/W) in fp32, summed in rank
  // order), plus this server's error, recompressed
  y_.assign(static_cast<size_t>(chunk), 0.0f);
  const float inv_w = static_cast<float>(1.0 / w);
  for (int i = 0; i < w; ++i) {
    const uint8_t* bits = received_.data() + int64_t(i) * chunk_bytes;
    const float s = scales_[i] * inv_w;
    for (int64_t k = 0; k < chunk; ++k) y_[k] += sign_of(bits, k) * s;
  }
  for (int64_t k = 0; k < chunk; ++k) y_[k] += e.server[k];
  const float server_scale = rms_scale(y_.data(), chunk);
  feed_back(y_.data(), chunk, server_scale, e.server.data());
  server_packed_.resize(static_cast<size_t>(chunk_bytes));
  pack_signs(y_.data(), chunk, server_packed_.data());

  // 4. phase 2: every server's chunk and scale to every rank; rebuild and un-pad
  gathered_.resize(static_cast<size_t>(padded / 8));
  comm_.all_gather(server_packed_.data(), gathered_.data(), chunk_bytes, DType::U8);
  server_scales_.resize(static_cast<size_t>(w));
  comm_.all_gather(&server_scale, server_scales_.data(), 1, DType::F32);
  for (int j = 0; j < w; ++j) {
    const uint8_t* bits = gathered_.data() + int64_t(j) * chunk_bytes;
    const int64_t first = int64_t(j) * chunk, last = std::min(n, first + chunk);
    for (int64_t i = first; i < last; ++i) buf[i] = sign_of(bits, i - first) * server_scales_[j];
  }
}

}  // namespace zero3d
