// stopwatch.hpp — the model's timer of checkpointed regions (activation_checkpointing.profile):
// internal to src/model (model.cpp, llama_block.cpp).
#pragma once

#include <Kokkos_Core.hpp>
#include <chrono>

namespace zero3d {

// Milliseconds of a region, fenced so device work is counted (profile only; free otherwise).
struct Stopwatch {
  bool on;
  std::chrono::steady_clock::time_point t0;
  explicit Stopwatch(bool on_) : on(on_) {
    if (on) Kokkos::fence(), t0 = std::chrono::steady_clock::now();
  }
  double ms() const {
    if (!on) return 0.0;
    Kokkos::fence();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
};

}  // namespace zero3d
