// reduce.hpp — whole-buffer reductions and scalings used around the optimizer step.
#pragma once

#include "kernels/common.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

namespace gpu {

// A thread per element and Kokkos' reduction tree (llm.c global_norm.cuh:27-69 is the same
// shape) where chunks of 4096 elements per thread read 16 KB apart. Kokkos reduces a launch's
// blocks in a fixed order: the same bits every run.
template <typename T>
ZERO3D_KERNEL double sum_of_squares(const T* x, Index n) {
  double acc = 0.0;
  Kokkos::parallel_reduce(
      "sum_of_squares", range(n),
      KOKKOS_LAMBDA(Index i, double& s) {
        const double v = static_cast<double>(to_float(x[i]));
        s += v * v;
      },
      acc);
  return acc;
}

}  // namespace gpu

// Σ x² accumulated in double (DeepSpeed computes grad norms in fp64). Chunks of kChunk
// elements are summed with an explicit SIMD reduction (reassociation the compiler may not
// do on its own), then the chunk sums are reduced by Kokkos. 16-bit inputs are widened first;
// inf or NaN anywhere makes the result non-finite (the overflow check relies on it).
template <typename T>
ZERO3D_KERNEL double sum_of_squares(const T* x, Index n) {
#ifdef ZERO3D_DEVICE
  return gpu::sum_of_squares(x, n);
#else
  constexpr Index kChunk = 4096;
  double acc = 0.0;
  Kokkos::parallel_reduce(
      "sum_of_squares", range((n + kChunk - 1) / kChunk),
      KOKKOS_LAMBDA(Index c, double& s) {
        const Index begin = c * kChunk, end = begin + kChunk < n ? begin + kChunk : n;
        double part = 0.0;
#pragma omp simd reduction(+ : part)
        for (Index i = begin; i < end; ++i) {
          const double v = static_cast<double>(to_float(x[i]));
          part += v * v;
        }
        s += part;
      },
      acc);
  return acc;
#endif
}

ZERO3D_KERNEL void scale_in_place(float* x, Index n, float factor) {
  Kokkos::parallel_for("scale_in_place", range(n), KOKKOS_LAMBDA(Index i) { x[i] *= factor; });
}

}  // namespace zero3d::kernels
