// swiglu.hpp — the SwiGLU gate of Llama-family MLPs (Shazeer 2020, "GLU Variants Improve
// Transformer"; Hugging Face's LlamaMLP: down(silu(gate(x)) · up(x))):
// out = silu(gate) · up, silu(g) = g · σ(g) (Swish with β = 1; Ramachandran et al. 2017).
//
// gate and up are [N, I] with row stride ld (I for two buffers, 2I for one fused [gate | up]
// product, whose up is then gate + I); out and dout are [N, I], dense.
#pragma once

#include "kernels/common.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

// σ(g) through one exponential: fastmath.hpp's, plain arithmetic, so the loops vectorise (libm's
// expf is an opaque call) and it compiles for a device; clamped there, so σ stays finite for any g.
KOKKOS_INLINE_FUNCTION float swiglu_sigmoid(float g) { return 1.0f / (1.0f + fast_exp(-g)); }

// O: the output's type (bf16 when the output only feeds the bf16 down product); I: the inputs'
// (bf16 when the gate/up product wrote bf16, as PyTorch's autocast does). One element a thread,
// on every build: no sum, so no order to choose.
template <typename O = float, typename In = float>
ZERO3D_KERNEL void swiglu_forward(O* out, const In* gate, const In* up, Index N, Index I, Index ld) {
  Kokkos::parallel_for("swiglu_forward", range(N * I), KOKKOS_LAMBDA(Index j) {
    const Index i = j / I, c = j % I;
    const float g = to_float(gate[i * ld + c]);
    out[j] = from_float<O>(g * swiglu_sigmoid(g) * to_float(up[i * ld + c]));
  });
}

// dgate = dout · up · σ(g)(1 + g(1 - σ(g))) (silu's derivative), dup = dout · silu(g); both
// written (=), at the inputs' layout (stride ld: a fused [dgate | dup] buffer feeds the fused
// product's backward).
template <typename In = float>
ZERO3D_KERNEL void swiglu_backward(float* dgate, float* dup, const float* dout, const In* gate, const In* up, Index N, Index I,
                            Index ld) {
  Kokkos::parallel_for("swiglu_backward", range(N * I), KOKKOS_LAMBDA(Index j) {
    const Index i = j / I, c = j % I;
    const float g = to_float(gate[i * ld + c]);
    const float u = to_float(up[i * ld + c]);
    const float s = swiglu_sigmoid(g);
    const float dy = dout[j];
    dgate[i * ld + c] = dy * u * s * (1.0f + g * (1.0f - s));
    dup[i * ld + c] = dy * g * s;
  });
}

}  // namespace zero3d::kernels
