// layernorm.hpp — LayerNorm over the last dimension, eps 1e-5, biased variance (as torch).
#pragma once

#include <cmath>

#include "kernels/common.hpp"
#include "kernels/device_forms.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

constexpr float kLayerNormEps = 1e-5f;

namespace gpu {

// A row to a warp (common.hpp row_teams; llm.c layernorm.cuh:20-65, kernel 3): the mean and the
// variance are lane-strided sums added in the vector reduction's tree, then every lane writes
// its columns. 16-bit parameters are widened as they are read (to_float: exact, a few
// instructions), so nothing is allocated per call.
template <typename P, typename O = float>
ZERO3D_KERNEL void layernorm_forward(O* out, float* mean, float* rstd, const float* inp, const P* weight, const P* bias,
                              Index N, Index C) {
  Kokkos::parallel_for("layernorm_forward", row_teams(N), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index i = team_row(team);
    if (i >= N) return;
    const float* x = inp + i * C;
    float m = 0.0f;
    Kokkos::parallel_reduce(Kokkos::ThreadVectorRange(team, C), [&](Index c, float& sum) { sum += x[c]; }, m);
    m /= static_cast<float>(C);
    float v = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, C), [&](Index c, float& sum) { sum += (x[c] - m) * (x[c] - m); }, v);
    v /= static_cast<float>(C);
    const float s = 1.0f / std::sqrt(v + kLayerNormEps);
    O* o = out + i * C;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, C), [&](Index c) {
      o[c] = from_float<O>((x[c] - m) * s * to_float(weight[c]) + to_float(bias[c]));
    });
    Kokkos::single(Kokkos::PerThread(team), [&] {
      mean[i] = m;
      rstd[i] = s;
    });
  });
}

// The input part a row to a warp (two lane-strided reductions, then the row's writes); the
// parameter part as a column sum in two stages (device_forms.hpp), both sums in one stage-1
// pass. llm.c fuses the two parts (layernorm.cuh:492+); zero3d keeps them apart because
// zero-bubble schedules run them at different times.
template <typename P>
ZERO3D_KERNEL void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const P* weight, const float* mean, const float* rstd, Index N, Index C) {
  if (dinp) Kokkos::parallel_for("layernorm_backward_input", row_teams(N), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index i = team_row(team);
    if (i >= N) return;
    const float* x = inp + i * C;
    const float* dy = dout + i * C;
    const float m = mean[i], s = rstd[i];
    float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, C), [&](Index c, float& sum) { sum += to_float(weight[c]) * dy[c]; },
        dnorm_mean);
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, C),
        [&](Index c, float& sum) {
          const float dnorm = to_float(weight[c]) * dy[c];
          sum += dnorm * (x[c] - m) * s;
        },
        dnorm_norm_mean);
    dnorm_mean /= static_cast<float>(C);
    dnorm_norm_mean /= static_cast<float>(C);
    float* dx = dinp + i * C;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, C), [&](Index c) {
      const float norm = (x[c] - m) * s;
      dx[c] += (to_float(weight[c]) * dy[c] - dnorm_mean - norm * dnorm_norm_mean) * s;
    });
  });
  if (!dweight) return;
  const Index chunks = column_chunks(N);
  float* partial_dw = kernel_scratch<float>(2 * chunks * C);
  float* partial_db = partial_dw + chunks * C;
  Kokkos::parallel_for("layernorm_backward_params", range(chunks * C), KOKKOS_LAMBDA(Index j) {
    const Index c = j % C, i0 = j / C * kColumnChunkRows, i1 = i0 + kColumnChunkRows < N ? i0 + kColumnChunkRows : N;
    float dw = 0.0f, db = 0.0f;
    for (Index i = i0; i < i1; ++i) {
      const float dy = dout[i * C + c];
      dw += dy * (inp[i * C + c] - mean[i]) * rstd[i];
      db += dy;
    }
    partial_dw[j] = dw;
    partial_db[j] = db;
  });
  add_chunk_sums(dweight, partial_dw, chunks, C);
  add_chunk_sums(dbias, partial_db, chunks, C);
}

}  // namespace gpu

// Saves mean[N] and rstd[N] for the backward pass. P: the parameters' stored type; O: the
// output's (bf16 when the output only feeds a bf16 product). A row (C floats) is read from
// memory once: the statistics' second pass and the output pass find it in L1. The sums are
// `omp simd` reductions so they vectorise (a plain float sum must keep its order, and stays scalar).
template <typename P, typename O = float>
ZERO3D_KERNEL void layernorm_forward(O* out, float* mean, float* rstd, const float* inp, const P* weight16, const P* bias16,
                              Index N, Index C) {
#ifdef ZERO3D_DEVICE
  gpu::layernorm_forward(out, mean, rstd, inp, weight16, bias16, N, C);
#else
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
#endif
}

// dinp += (accumulates: the residual stream's gradient flows through), dweight += , dbias += .
// A null dinp skips the input part, a null dweight the parameter part: zero-bubble schedules
// run them at different times (Qi et al. 2023, "B" and "W"), with the same arithmetic.
template <typename P>
ZERO3D_KERNEL void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const P* weight, const float* mean, const float* rstd, Index N, Index C) {
#ifdef ZERO3D_DEVICE
  gpu::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
#else
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
#endif
}

}  // namespace zero3d::kernels
