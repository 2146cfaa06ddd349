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

// CPU fast paths, chosen at build time: with a Serial default execution space (zero3d runs one
// rank per core) a kernel may walk memory in order in the caller's thread, and with AVX-512 it
// may use intrinsics. Any other build (CUDA, OpenMP, no AVX-512) compiles the portable
// parallel_for beside it, so every kernel keeps one name and one contract.
#if defined(KOKKOS_ENABLE_SERIAL) && !defined(KOKKOS_ENABLE_OPENMP) && !defined(KOKKOS_ENABLE_THREADS) && \
    !defined(KOKKOS_ENABLE_CUDA) && !defined(KOKKOS_ENABLE_HIP) && !defined(KOKKOS_ENABLE_SYCL)
#define ZERO3D_SERIAL_HOST 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ZERO3D_AVX512 1
// GCC 12's AVX-512 headers initialise their "undefined" vectors from themselves (__Y = __Y),
// which -Wuninitialized / -Wmaybe-uninitialized then report wherever an intrinsic is inlined
// (GCC bug 105593, fixed in GCC 13): silenced for those header lines only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif
#endif

// A device backend (CUDA): kernels choose their GPU forms (a team per row, column reductions
// in two stages) where the CPU forms walk memory serially.
#if defined(KOKKOS_ENABLE_CUDA)
#define ZERO3D_DEVICE 1
#endif

namespace zero3d::kernels {

using ExecSpace = Kokkos::DefaultExecutionSpace;
using Index = int64_t;

inline Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<Index>> range(Index n) {
  return Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<Index>>(0, n);
}

// Work over host memory (routing tables in std::vector, say) that uses host algorithms: the host
// execution space, which on a CPU build is the default one.
using HostExecSpace = Kokkos::DefaultHostExecutionSpace;
inline Kokkos::RangePolicy<HostExecSpace, Kokkos::IndexType<Index>> host_range(Index n) {
  return Kokkos::RangePolicy<HostExecSpace, Kokkos::IndexType<Index>>(0, n);
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
