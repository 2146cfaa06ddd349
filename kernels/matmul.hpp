// matmul.hpp — Hugging Face Conv1D linear layer: out[N,OC] = inp[N,IC] · weight[IC,OC] + bias.
// The weight is input-major (GPT-2's Conv1D layout), so both products are plain row-major sgemm.
#pragma once

#include <cblas.h>

#include "common.hpp"
#include "half.hpp"

namespace zero3d::kernels {

// Adds bias[OC] (stored as P) to every row of out[N,OC].
template <typename P>
inline void add_bias_rows(float* out, const P* bias, Index N, Index OC) {
  Kokkos::parallel_for("add_bias_rows", range(N), KOKKOS_LAMBDA(Index i) {
    float* row = out + i * OC;
    for (Index o = 0; o < OC; ++o) row[o] += to_float(bias[o]);
  });
}

// Column sums: dbias[OC] += sum over rows of dout[N,OC] (each column owned by one iteration).
inline void accumulate_column_sums(float* dbias, const float* dout, Index N, Index OC) {
  constexpr Index kBlock = 16;  // 16 columns = one cache line per row visit
  Kokkos::parallel_for("column_sums", range((OC + kBlock - 1) / kBlock), KOKKOS_LAMBDA(Index blk) {
    const Index o0 = blk * kBlock, o1 = o0 + kBlock < OC ? o0 + kBlock : OC;
    float acc[kBlock] = {};
    for (Index i = 0; i < N; ++i)
      for (Index o = o0; o < o1; ++o) acc[o - o0] += dout[i * OC + o];
    for (Index o = o0; o < o1; ++o) dbias[o] += acc[o - o0];
  });
}

// accumulate=true adds into out (used to fold the residual add into the projection).
inline void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, Index N, Index IC,
                           Index OC, bool accumulate = false) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, OC, IC, 1.0f, inp, IC, weight, OC,
              accumulate ? 1.0f : 0.0f, out, OC);
  if (bias) add_bias_rows(out, bias, N, OC);
}

// dinp = dout · weightᵀ (written; accumulated when accumulate_dinp); dweight += inpᵀ · dout; dbias += Σ rows.
inline void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                            const float* weight, Index N, Index IC, Index OC, bool accumulate_dinp = false) {
  if (dinp)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, IC, OC, 1.0f, dout, OC, weight, OC,
                accumulate_dinp ? 1.0f : 0.0f, dinp, IC);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, IC, OC, N, 1.0f, inp, IC, dout, OC, 1.0f, dweight, OC);
  if (dbias) accumulate_column_sums(dbias, dout, N, OC);
}

}  // namespace zero3d::kernels
