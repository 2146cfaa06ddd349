// encoder.hpp — GPT-2 input embedding: out[b,t,:] = wte[token[b,t],:] + wpe[t,:].
#pragma once

#include "kernels/common.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

template <typename P>
inline void encoder_forward(float* out, const int32_t* tokens, const P* wte, const P* wpe, Index B, Index T, Index C) {
  Kokkos::parallel_for("encoder_forward", range(B * T), KOKKOS_LAMBDA(Index bt) {
    const P* w = wte + static_cast<Index>(tokens[bt]) * C;
    const P* p = wpe + (bt % T) * C;
    float* o = out + bt * C;
    for (Index c = 0; c < C; ++c) o[c] = to_float(w[c]) + to_float(p[c]);
  });
}

// dwte[token] += dout, dwpe[t] += dout. Parallel over channel blocks, so no two iterations
// touch the same element even when a token repeats (no atomics needed).
inline void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, Index B, Index T,
                             Index C) {
  constexpr Index kBlock = 16;
  Kokkos::parallel_for("encoder_backward", range((C + kBlock - 1) / kBlock), KOKKOS_LAMBDA(Index blk) {
    const Index c0 = blk * kBlock, c1 = c0 + kBlock < C ? c0 + kBlock : C;
    for (Index bt = 0; bt < B * T; ++bt) {
      float* w = dwte + static_cast<Index>(tokens[bt]) * C;
      float* p = dwpe + (bt % T) * C;
      const float* d = dout + bt * C;
      for (Index c = c0; c < c1; ++c) {
        w[c] += d[c];
        p[c] += d[c];
      }
    }
  });
}

}  // namespace zero3d::kernels
