// layernorm.hpp — LayerNorm over the last dimension, eps 1e-5, biased variance (as torch).
#pragma once

#include <cmath>

#include "kernels/common.hpp"
#include "kernels/device_forms.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

constexpr float kLayerNormEps = 1e-5f;

namespace gpu {

// A row to a warp (common.hpp row_teams; llm.c layernorm.cuh:20-65, kernel 3), W columns at a
// time (kVec where the row's pointers allow, device_forms.hpp): the mean and the variance are
// lane-strided sums added in the vector reduction's tree, then every lane writes its columns.
// 16-bit parameters are widened as they are read (exact, a few instructions), so nothing is
// allocated per call.
template <int W, typename P, typename O>
KOKKOS_INLINE_FUNCTION void layernorm_forward_row(const RowTeam& team, O* o, float* mean, float* rstd, const float* x,
                                                  const P* weight, const P* bias, Index C) {
  const Index n = C / W;
  const float m = row_sum<W>(team, x, n, [](float v) { return v; }) / static_cast<float>(C);
  const float var = row_sum<W>(team, x, n, [&](float v) { return (v - m) * (v - m); }) / static_cast<float>(C);
  const float s = 1.0f / std::sqrt(var + kLayerNormEps);
  Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, n), [&](Index j) {
    float v[W], w[W], b[W];
    load_floats(v, x + j * W);
    load_floats(w, weight + j * W);
    load_floats(b, bias + j * W);
    for (int k = 0; k < W; ++k) v[k] = (v[k] - m) * s * w[k] + b[k];
    store_floats(o + j * W, v);
  });
  Kokkos::single(Kokkos::PerThread(team), [&] {
    *mean = m;
    *rstd = s;
  });
}

template <typename P, typename O = float>
ZERO3D_KERNEL void layernorm_forward(O* out, float* mean, float* rstd, const float* inp, const P* weight, const P* bias,
                              Index N, Index C) {
  const bool vec = vectorizable(C, out, inp, weight, bias);
  Kokkos::parallel_for("layernorm_forward", row_teams(N), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index i = team_row(team);
    if (i >= N) return;
    if (vec) layernorm_forward_row<kVec>(team, out + i * C, mean + i, rstd + i, inp + i * C, weight, bias, C);
    else layernorm_forward_row<1>(team, out + i * C, mean + i, rstd + i, inp + i * C, weight, bias, C);
  });
}

// The input part of a row, W columns at a time: two lane-strided reductions, then the row's writes.
template <int W, typename P>
KOKKOS_INLINE_FUNCTION void layernorm_backward_row(const RowTeam& team, float* dx, const float* dy, const float* x,
                                                   const P* weight, float m, float s, Index C) {
  const Index n = C / W;
  float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
  Kokkos::parallel_reduce(
      Kokkos::ThreadVectorRange(team, n),
      [&](Index j, float& sum) {
        float w[W], g[W];
        load_floats(w, weight + j * W);
        load_floats(g, dy + j * W);
        for (int k = 0; k < W; ++k) sum += w[k] * g[k];
      },
      dnorm_mean);
  Kokkos::parallel_reduce(
      Kokkos::ThreadVectorRange(team, n),
      [&](Index j, float& sum) {
        float w[W], g[W], v[W];
        load_floats(w, weight + j * W);
        load_floats(g, dy + j * W);
        load_floats(v, x + j * W);
        for (int k = 0; k < W; ++k) {
          const float dnorm = w[k] * g[k];
          sum += dnorm * (v[k] - m) * s;
        }
      },
      dnorm_norm_mean);
  dnorm_mean /= static_cast<float>(C);
  dnorm_norm_mean /= static_cast<float>(C);
  Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, n), [&](Index j) {
    float w[W], g[W], v[W], d[W];
    load_floats(w, weight + j * W);
    load_floats(g, dy + j * W);
    load_floats(v, x + j * W);
    load_floats(d, dx + j * W);
    for (int k = 0; k < W; ++k) {
      const float norm = (v[k] - m) * s;
      d[k] += (w[k] * g[k] - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
    store_floats(dx + j * W, d);
  });
}

// The parameter part's stage 1, W columns a thread: both sums in one pass.
template <int W>
ZERO3D_KERNEL void layernorm_backward_params(Width<W>, float* partial_dw, float* partial_db, const float* dout,
                                      const float* inp, const float* mean, const float* rstd, Index N, Index C) {
  Kokkos::parallel_for("layernorm_backward_params", range(column_chunk_threads<W>(N, C)), KOKKOS_LAMBDA(Index j) {
    const ColumnChunk<W> at(j, N, C);
    float dw[W] = {}, db[W] = {};
    ZERO3D_UNROLL(4)
    for (Index i = at.i0; i < at.i1; ++i) {
      float g[W], v[W];
      load_floats(g, dout + i * C + at.o0);
      load_floats(v, inp + i * C + at.o0);
      const float m = mean[i], s = rstd[i];
      for (int k = 0; k < W; ++k) {
        dw[k] += g[k] * (v[k] - m) * s;
        db[k] += g[k];
      }
    }
    store_floats(partial_dw + at.at, dw);
    store_floats(partial_db + at.at, db);
  });
}

// The input part a row to a warp; the parameter part as a column sum in two stages
// (device_forms.hpp), both sums in one stage-1 pass. llm.c fuses the two parts
// (layernorm.cuh:492+); zero3d keeps them apart because zero-bubble schedules run them at
// different times.
template <typename P>
ZERO3D_KERNEL void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const P* weight, const float* mean, const float* rstd, Index N, Index C) {
  if (dinp) {
    const bool vec = vectorizable(C, dinp, dout, inp, weight);
    Kokkos::parallel_for("layernorm_backward_input", row_teams(N), KOKKOS_LAMBDA(const RowTeam& team) {
      const Index i = team_row(team);
      if (i >= N) return;
      if (vec) layernorm_backward_row<kVec>(team, dinp + i * C, dout + i * C, inp + i * C, weight, mean[i], rstd[i], C);
      else layernorm_backward_row<1>(team, dinp + i * C, dout + i * C, inp + i * C, weight, mean[i], rstd[i], C);
    });
  }
  if (!dweight) return;
  const Index chunks = column_chunks(N);
  float* partial_dw = kernel_scratch<float>(2 * chunks * C);
  float* partial_db = partial_dw + chunks * C;
  if (vectorizable(C, dout, inp, partial_dw, partial_db))
    layernorm_backward_params(Width<kVec>{}, partial_dw, partial_db, dout, inp, mean, rstd, N, C);
  else
    layernorm_backward_params(Width<1>{}, partial_dw, partial_db, dout, inp, mean, rstd, N, C);
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
