// layernorm.hpp — LayerNorm over the last dimension, eps 1e-5, biased variance (as torch).
#pragma once

#include <cmath>

#include "kernels/common.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

constexpr float kLayerNormEps = 1e-5f;

// Saves mean[N] and rstd[N] for the backward pass. P: the parameters' stored type; O: the
// output's (bf16 when the output only feeds a bf16 product). A row (C floats) is read from
// memory once: the statistics' second pass and the output pass find it in L1. The sums are
// `omp simd` reductions so they vectorise (a plain float sum must keep its order, and stays scalar).
template <typename P, typename O = float>
inline void layernorm_forward(O* out, float* mean, float* rstd, const float* inp, const P* weight16, const P* bias16,
                              Index N, Index C) {
  WidenedParams widen;
  const float* weight = widen(weight16, C);
  const float* bias = widen(bias16, C);
  Kokkos::parallel_for("layernorm_forward", range(N), KOKKOS_LAMBDA(Index i) {
    const float* x = inp + i * C;
    float m = 0.0f;
#pragma omp simd reduction(+ : m)
    for (Index c = 0; c < C; ++c) m += x[c];
    m /= static_cast<float>(C);
    float v = 0.0f;
#pragma omp simd reduction(+ : v)
    for (Index c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
    v /= static_cast<float>(C);
    const float s = 1.0f / std::sqrt(v + kLayerNormEps);
    O* o = out + i * C;
#pragma omp simd
    for (Index c = 0; c < C; ++c) o[c] = from_float<O>((x[c] - m) * s * weight[c] + bias[c]);
    mean[i] = m;
    rstd[i] = s;
  });
}

// dinp += (accumulates: the residual stream's gradient flows through), dweight += , dbias += .
// A null dinp skips the input part, a null dweight the parameter part: zero-bubble schedules
// run them at different times (Qi et al. 2023, "B" and "W"), with the same arithmetic.
template <typename P>
inline void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const P* weight, const float* mean, const float* rstd, Index N, Index C) {
  if (dinp) Kokkos::parallel_for("layernorm_backward_input", range(N), KOKKOS_LAMBDA(Index i) {
    const float* x = inp + i * C;
    const float* dy = dout + i * C;
    const float m = mean[i], s = rstd[i];
    float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
    for (Index c = 0; c < C; ++c) {
      const float dnorm = to_float(weight[c]) * dy[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * (x[c] - m) * s;
    }
    dnorm_mean /= static_cast<float>(C);
    dnorm_norm_mean /= static_cast<float>(C);
    float* dx = dinp + i * C;
#pragma omp simd
    for (Index c = 0; c < C; ++c) {
      const float norm = (x[c] - m) * s;
      dx[c] += (to_float(weight[c]) * dy[c] - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  });
  // Parallel over column blocks (no two iterations share a parameter); a block of 64 columns
  // reads 256 contiguous bytes of each row and keeps its sums in eight vector registers.
  constexpr Index kBlock = 64;
  if (dweight) Kokkos::parallel_for("layernorm_backward_params", range((C + kBlock - 1) / kBlock), KOKKOS_LAMBDA(Index blk) {
    const Index c0 = blk * kBlock, width = c0 + kBlock < C ? kBlock : C - c0;
    float dw[kBlock] = {}, db[kBlock] = {};
    for (Index i = 0; i < N; ++i) {
      const float m = mean[i], s = rstd[i];
      const float* dy = dout + i * C + c0;
      const float* x = inp + i * C + c0;
      if (width == kBlock) {
#pragma omp simd
        for (Index c = 0; c < kBlock; ++c) {
          dw[c] += dy[c] * (x[c] - m) * s;
          db[c] += dy[c];
        }
      } else {
        for (Index c = 0; c < width; ++c) {
          dw[c] += dy[c] * (x[c] - m) * s;
          db[c] += dy[c];
        }
      }
    }
    for (Index c = 0; c < width; ++c) {
      dweight[c0 + c] += dw[c];
      dbias[c0 + c] += db[c];
    }
  });
}

}  // namespace zero3d::kernels
