// layernorm.hpp — LayerNorm over the last dimension, eps 1e-5, biased variance (as torch).
#pragma once

#include <cmath>

#include "common.hpp"
#include "half.hpp"

namespace zero3d::kernels {

constexpr float kLayerNormEps = 1e-5f;

// Saves mean[N] and rstd[N] for the backward pass. P: the parameters' stored type.
template <typename P>
inline void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const P* weight, const P* bias,
                              Index N, Index C) {
  Kokkos::parallel_for("layernorm_forward", range(N), KOKKOS_LAMBDA(Index i) {
    const float* x = inp + i * C;
    float m = 0.0f;
    for (Index c = 0; c < C; ++c) m += x[c];
    m /= static_cast<float>(C);
    float v = 0.0f;
    for (Index c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
    v /= static_cast<float>(C);
    const float s = 1.0f / std::sqrt(v + kLayerNormEps);
    float* o = out + i * C;
    for (Index c = 0; c < C; ++c) o[c] = (x[c] - m) * s * to_float(weight[c]) + to_float(bias[c]);
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
    for (Index c = 0; c < C; ++c) {
      const float dnorm = to_float(weight[c]) * dy[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * (x[c] - m) * s;
    }
    dnorm_mean /= static_cast<float>(C);
    dnorm_norm_mean /= static_cast<float>(C);
    float* dx = dinp + i * C;
    for (Index c = 0; c < C; ++c) {
      const float norm = (x[c] - m) * s;
      dx[c] += (to_float(weight[c]) * dy[c] - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  });
  constexpr Index kBlock = 16;
  if (dweight) Kokkos::parallel_for("layernorm_backward_params", range((C + kBlock - 1) / kBlock), KOKKOS_LAMBDA(Index blk) {
    const Index c0 = blk * kBlock, c1 = c0 + kBlock < C ? c0 + kBlock : C;
    float dw[kBlock] = {}, db[kBlock] = {};
    for (Index i = 0; i < N; ++i) {
      const float m = mean[i], s = rstd[i];
      for (Index c = c0; c < c1; ++c) {
        const float dy = dout[i * C + c];
        dw[c - c0] += dy * (inp[i * C + c] - m) * s;
        db[c - c0] += dy;
      }
    }
    for (Index c = c0; c < c1; ++c) {
      dweight[c] += dw[c - c0];
      dbias[c] += db[c - c0];
    }
  });
}

}  // namespace zero3d::kernels
