// reduce.hpp — whole-buffer reductions and scalings used around the optimizer step.
#pragma once

#include "common.hpp"

namespace zero3d::kernels {

// Σ x² accumulated in double (DeepSpeed computes grad norms in fp64).
inline double sum_of_squares(const float* x, Index n) {
  double acc = 0.0;
  Kokkos::parallel_reduce(
      "sum_of_squares", range(n), KOKKOS_LAMBDA(Index i, double& s) { s += static_cast<double>(x[i]) * x[i]; }, acc);
  return acc;
}

inline void scale_in_place(float* x, Index n, float factor) {
  Kokkos::parallel_for("scale_in_place", range(n), KOKKOS_LAMBDA(Index i) { x[i] *= factor; });
}

}  // namespace zero3d::kernels
