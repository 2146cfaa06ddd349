// elementwise.hpp — flat element-wise kernels the model composes: copies, sums of buffers,
// scalings. One thread per element, so they are coalesced on a GPU as they are (GPU-GAP §3).
// `label` names the kernel for Kokkos Tools (benchmarks/kernel_timer.cpp) as its caller means it.
#pragma once

#include "kernels/common.hpp"

namespace zero3d::kernels {

// dst[i] = src[i].
ZERO3D_KERNEL void copy(float* dst, const float* src, Index n, const char* label = "copy") {
  Kokkos::parallel_for(label, range(n), KOKKOS_LAMBDA(Index i) { dst[i] = src[i]; });
}

// out[i] = a[i] + b[i].
ZERO3D_KERNEL void add(float* out, const float* a, const float* b, Index n, const char* label = "add") {
  Kokkos::parallel_for(label, range(n), KOKKOS_LAMBDA(Index i) { out[i] = a[i] + b[i]; });
}

// dst[i] += src[i].
ZERO3D_KERNEL void add_into(float* dst, const float* src, Index n, const char* label = "add_into") {
  Kokkos::parallel_for(label, range(n), KOKKOS_LAMBDA(Index i) { dst[i] += src[i]; });
}

// dst[i] += s·src[i].
ZERO3D_KERNEL void add_scaled_into(float* dst, const float* src, float s, Index n, const char* label = "add_scaled_into") {
  Kokkos::parallel_for(label, range(n), KOKKOS_LAMBDA(Index i) { dst[i] += s * src[i]; });
}

// keep[i] = x[i], then x[i] *= s: a value kept before it is scaled in place.
ZERO3D_KERNEL void keep_and_scale(float* keep, float* x, float s, Index n, const char* label = "keep_and_scale") {
  Kokkos::parallel_for(label, range(n), KOKKOS_LAMBDA(Index i) {
    keep[i] = x[i];
    x[i] *= s;
  });
}

// out[i] = in[i] + s·(out[i] − in[i]): out moved towards in, keeping the share s of their difference.
ZERO3D_KERNEL void scale_towards(float* out, const float* in, float s, Index n, const char* label = "scale_towards") {
  Kokkos::parallel_for(label, range(n), KOKKOS_LAMBDA(Index i) { out[i] = in[i] + s * (out[i] - in[i]); });
}

// Σ x[i] in fp32, in index order on the CPU (a tree on a GPU).
ZERO3D_KERNEL float sum(const float* x, Index n, const char* label = "sum") {
  float total = 0.0f;
  Kokkos::parallel_reduce(label, range(n), KOKKOS_LAMBDA(Index i, float& acc) { acc += x[i]; }, total);
  return total;
}

}  // namespace zero3d::kernels
