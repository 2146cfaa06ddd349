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
// in two stages) where the CPU forms walk memory serially. The GPU forms sit in namespace gpu
// beside the CPU forms and compile on every build, so the CPU suite runs them on Kokkos Serial
// against the CPU forms (tests/kernels/test_kernels_device_forms.cpp).
#if defined(KOKKOS_ENABLE_CUDA)
#define ZERO3D_DEVICE 1
#endif

// The linkage of a header function that encloses a KOKKOS_LAMBDA. nvcc's host-side wrapper of
// an extended __host__ __device__ lambda copies the closure through function pointers kept in
// a per-translation-unit helper (an anonymous namespace), while the wrapper's own members have
// external linkage: with the enclosing inline function used from several units, the linker
// may pair one unit's copy constructor with another unit's pointers, still null until that
// unit has built the lambda (a call to address 0, met on an H100 in the gradient norm).
// Internal linkage on a GPU build gives each unit wrappers of its own; the CPU build keeps
// plain inline functions (and its bits).
#ifdef ZERO3D_DEVICE
#define ZERO3D_KERNEL static inline
#else
#define ZERO3D_KERNEL inline
#endif

namespace zero3d::kernels {

using ExecSpace = Kokkos::DefaultExecutionSpace;
using Index = int64_t;

inline Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<Index>> range(Index n) {
  return Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<Index>>(0, n);
}

// A row to each vector of lanes, for the device forms of row kernels (LayerNorm, softmax rows):
// on a device a team is a block of kRowsPerTeam warps and each warp takes a row, llm.c's warp
// per row (layernorm.cuh kernel 3, warpReduceSum; GPU-GAP §3); on the host a team is one row and
// one lane, all Kokkos Serial allows. A row's lanes stride over its columns and a ThreadVectorRange
// reduction adds their sums in a fixed tree: no atomics, the same bits on every run.
#ifdef ZERO3D_DEVICE
constexpr int kRowLanes = 32;
constexpr int kRowsPerTeam = 4;
#else
constexpr int kRowLanes = 1;
constexpr int kRowsPerTeam = 1;
#endif
using RowTeams = Kokkos::TeamPolicy<ExecSpace>;
using RowTeam = RowTeams::member_type;

inline RowTeams row_teams(Index rows) {
  return RowTeams(static_cast<int>((rows + kRowsPerTeam - 1) / kRowsPerTeam), kRowsPerTeam, kRowLanes);
}
// The row a team member's lanes work on; past the last row when rows do not fill the last team.
KOKKOS_INLINE_FUNCTION Index team_row(const RowTeam& team) {
  return static_cast<Index>(team.league_rank()) * team.team_size() + team.team_rank();
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
