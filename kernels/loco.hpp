// loco.hpp — LoCo's error feedback for qgZ (Xie et al. 2024, "LoCo: Low-Bit Communication
// Adaptor for Large-scale Model Training"; DeepSpeed csrc/quantization/swizzled_quantize.cu
// loco_swizzled_quant_kernel and quant_reduce.cu loco_dequant_reduce). A quantisation of x is
// compensated by the error e kept from the last one: y = x + e is quantised to ŷ, and then
//     e ← β·e + (1 − β)·(y − ŷ)         (β = zeropp_loco_param.err_beta)
// in fp32 (DeepSpeed: "Update within float precision"). nvcc contracts DeepSpeed's
// `err_beta * e + (1.0f - err_beta) * new_error` into one fused multiply-add; zero3d writes it
// as fmaf(β, e, (1 − β)·(y − ŷ)) so that every compiler and the golden agree
// (tests/golden/make_loco_goldens.py). DeepSpeed's kernels read and keep e in __half; zero3d
// computes in fp32. Between reductions the error is kept as int8 groups (quantize.hpp's
// quantize_int8_groups), as DeepSpeed keeps p.intra_ef_buf and p.inter_ef_buf.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common.hpp"

namespace zero3d::kernels {

// err[i] = β·err[i] + (1 − β)·(y[i] − y_hat[i]): the new error folded into the kept one.
ZERO3D_KERNEL void loco_update_error(const float* y, const float* y_hat, float beta, Index n, float* err) {
  const float keep = beta, take = 1.0f - beta;
  Kokkos::parallel_for(
      "loco_update_error", range(n), KOKKOS_LAMBDA(Index i) { err[i] = fmaf(keep, err[i], take * (y[i] - y_hat[i])); });
}

// q[0, n) = 0 and scales[0, groups) = 1: kept errors restarted at zero, stored as int8 groups of
// zeros are (DeepSpeed's torch.zeros_like on a reset); scales null keeps the group scales.
ZERO3D_KERNEL void clear_errors(int8_t* q, Index n, float* scales, Index groups) {
  Kokkos::parallel_for("loco_clear", range(n), KOKKOS_LAMBDA(Index i) { q[i] = 0; });
  if (scales) Kokkos::parallel_for("loco_clear_scales", range(groups), KOKKOS_LAMBDA(Index g) { scales[g] = 1.0f; });
}

}  // namespace zero3d::kernels
