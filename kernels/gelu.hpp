// gelu.hpp — GELU, tanh approximation (GPT-2's "gelu_new"):
// gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
#pragma once

#include <cmath>

#include "common.hpp"
#include "fastmath.hpp"
#include "half.hpp"

namespace zero3d::kernels {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

// O: the output's type (bf16 when the output only feeds a bf16 product).
template <typename O = float>
inline void gelu_forward(O* out, const float* inp, Index n) {
  Kokkos::parallel_for("gelu_forward", range(n), KOKKOS_LAMBDA(Index i) {
    const float x = inp[i];
    out[i] = from_float<O>(0.5f * x * (1.0f + fast_tanh(kGeluScale * (x + 0.044715f * x * x * x))));
  });
}

// dinp = gelu'(inp) * dout (written).
inline void gelu_backward(float* dinp, const float* inp, const float* dout, Index n) {
  Kokkos::parallel_for("gelu_backward", range(n), KOKKOS_LAMBDA(Index i) {
    const float x = inp[i];
    const float u = kGeluScale * (x + 0.044715f * x * x * x);
    const float th = fast_tanh(u);
    const float sech2 = 1.0f - th * th;
    const float du = kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = (0.5f * (1.0f + th) + 0.5f * x * sech2 * du) * dout[i];
  });
}

}  // namespace zero3d::kernels
