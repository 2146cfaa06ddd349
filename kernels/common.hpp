// common.hpp — what every kernel shares: the Kokkos execution space and index types.
//
// Kernels are free functions over raw pointers into the big flat buffers (llm.c style).
// Element-wise work runs as Kokkos::parallel_for on the default execution space, so a
// CUDA-enabled Kokkos runs them on the GPU unchanged; matrix products go to CBLAS.
// Convention for every backward: parameter gradients ACCUMULATE (+=), activation
// gradients are WRITTEN (=) unless the name says `accumulate`.
#pragma once

#include <Kokkos_Core.hpp>
#include <cstdint>

namespace zero3d::kernels {

using ExecSpace = Kokkos::DefaultExecutionSpace;
using Index = int64_t;

inline Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<Index>> range(Index n) {
  return Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<Index>>(0, n);
}

// A named region for Kokkos Tools (benchmarks/kernel_timer.cpp): products and other work that
// is not a parallel_for announce themselves with it. One branch when no tool is loaded.
class ProfileRegion {
 public:
  explicit ProfileRegion(const char* name) : on_(Kokkos::Tools::profileLibraryLoaded()) {
    if (on_) Kokkos::Profiling::pushRegion(name);
  }
  ~ProfileRegion() {
    if (on_) Kokkos::Profiling::popRegion();
  }
  ProfileRegion(const ProfileRegion&) = delete;
  ProfileRegion& operator=(const ProfileRegion&) = delete;

 private:
  bool on_;
};

}  // namespace zero3d::kernels
