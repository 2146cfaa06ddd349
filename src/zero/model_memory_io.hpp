// model_memory_io.hpp — the ZeRO optimizer's host <-> model memory crossings (zero.cpp,
// zero_checkpoint.cpp), and the packed layout of its states under frozen parameters.
#pragma once

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "kernels/memory.hpp"
#include "zero/zero.hpp"

namespace zero3d::zero_io {

// Model memory is device memory on a GPU build: what the host draws, reads from a checkpoint or
// converts crosses kernels/memory.hpp's copies, a bounded chunk at a time. On a CPU build it is
// host memory, and the host writes and reads it in place (no copy, no extra memory).
inline constexpr int64_t kHostChunk = ZeroOptimizer::kInitFillElems;

// fill(out, a, b) writes [a, b) as the host draws it, into model memory at dst.
inline void fill_model(float* dst, int64_t a, int64_t b, const std::function<void(float*, int64_t, int64_t)>& fill) {
  if constexpr (kernels::kHostIsDevice) {
    fill(dst, a, b);
  } else {
    std::vector<float> chunk;
    for (int64_t x = a; x < b; x += kHostChunk) {
      const int64_t y = std::min(b, x + kHostChunk);
      chunk.resize(static_cast<size_t>(y - x));
      fill(chunk.data(), x, y);
      kernels::copy_to_device(dst + (x - a), chunk.data(), chunk.size() * sizeof(float));
    }
  }
}

// read(state, b, e, out) writes host memory: into model memory at dst.
inline void read_model(const ZeroOptimizer::RangeReader& read, const std::string& state, int64_t b, int64_t e, float* dst) {
  if constexpr (kernels::kHostIsDevice) {
    read(state, b, e, dst);
  } else {
    std::vector<float> chunk;
    for (int64_t x = b; x < e; x += kHostChunk) {
      const int64_t y = std::min(e, x + kHostChunk);
      chunk.resize(static_cast<size_t>(y - x));
      read(state, x, y, chunk.data());
      kernels::copy_to_device(dst + (x - b), chunk.data(), chunk.size() * sizeof(float));
    }
  }
}

// n host floats where a kernel can read them: the values themselves on a CPU build, a copy in
// the device scratch otherwise (valid until the scratch's next use).
inline const float* in_model_memory(const float* host, int64_t n, kernels::DeviceScratch& scratch) {
  if constexpr (kernels::kHostIsDevice) return host;
  float* d = scratch.take<float>(n);
  kernels::copy_to_device(d, host, static_cast<size_t>(n) * sizeof(float));
  return d;
}

// Frozen parameters: f(view offset, packed offset, count) for each trainable piece of the
// optimizer's view [lo, lo + n), whose states the optimizer packs back to back.
template <class F>
void packed_pieces(const Optimizer::Ranges& ranges, int64_t lo, int64_t n, F f) {
  int64_t packed = 0;
  for (const auto& [a, b] : ranges) {
    const int64_t x = std::max(a, lo), y = std::min(b, lo + n);
    if (x < y) f(x, packed + (x - a), y - x);
    packed += b - a;
  }
}

}  // namespace zero3d::zero_io
