// rmsnorm.hpp — RMSNorm over the last dimension (Zhang & Sennrich 2019, "Root Mean Square Layer
// Normalization"; Llama's LlamaRMSNorm): out = w · x · rstd, rstd = 1/sqrt(mean(x²) + eps), no
// mean subtraction and no bias. The statistics are fp32 whatever the parameters' type, as
// LlamaRMSNorm computes them in float32 under bf16. eps is the model's (rms_norm_eps: 1e-6 for
// Llama, 1e-5 for Mixtral), so it is an argument.
#pragma once

#include <cmath>
#include <vector>

#include "kernels/common.hpp"
#include "kernels/device_forms.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

namespace gpu {

// A row to a warp (common.hpp row_teams), as layernorm_forward, W columns at a time (kVec where
// the row's pointers allow, device_forms.hpp): one lane-strided sum of squares added in the
// vector reduction's tree, then every lane writes its columns.
template <int W, typename P, typename O>
KOKKOS_INLINE_FUNCTION void rmsnorm_forward_row(const RowTeam& team, O* o, float* rstd, const float* x, const P* weight,
                                                Index C, float eps) {
  const Index n = C / W;
  const float ss = row_sum<W>(team, x, n, [](float v) { return v * v; });
  const float s = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
  Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, n), [&](Index j) {
    float v[W], w[W];
    load_floats(v, x + j * W);
    load_floats(w, weight + j * W);
    for (int k = 0; k < W; ++k) v[k] = v[k] * s * w[k];
    store_floats(o + j * W, v);
  });
  Kokkos::single(Kokkos::PerThread(team), [&] { *rstd = s; });
}

template <typename P, typename O = float>
ZERO3D_KERNEL void rmsnorm_forward(O* out, float* rstd, const float* inp, const P* weight, Index N, Index C, float eps) {
  const bool vec = vectorizable(C, out, inp, weight);
  Kokkos::parallel_for("rmsnorm_forward", row_teams(N), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index i = team_row(team);
    if (i >= N) return;
    if (vec) rmsnorm_forward_row<kVec>(team, out + i * C, rstd + i, inp + i * C, weight, C, eps);
    else rmsnorm_forward_row<1>(team, out + i * C, rstd + i, inp + i * C, weight, C, eps);
  });
}

// The input part of a row, W columns at a time: one lane-strided reduction, then the row's writes.
template <int W, typename P>
KOKKOS_INLINE_FUNCTION void rmsnorm_backward_row(const RowTeam& team, float* dx, const float* dy, const float* x,
                                                 const P* weight, float s, Index C) {
  const Index n = C / W;
  float dnorm_norm_mean = 0.0f;
  Kokkos::parallel_reduce(
      Kokkos::ThreadVectorRange(team, n),
      [&](Index j, float& sum) {
        float w[W], g[W], v[W];
        load_floats(w, weight + j * W);
        load_floats(g, dy + j * W);
        load_floats(v, x + j * W);
        for (int k = 0; k < W; ++k) sum += w[k] * g[k] * v[k] * s;
      },
      dnorm_norm_mean);
  dnorm_norm_mean /= static_cast<float>(C);
  Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, n), [&](Index j) {
    float w[W], g[W], v[W], d[W];
    load_floats(w, weight + j * W);
    load_floats(g, dy + j * W);
    load_floats(v, x + j * W);
    load_floats(d, dx + j * W);
    for (int k = 0; k < W; ++k) d[k] += (w[k] * g[k] - v[k] * s * dnorm_norm_mean) * s;
    store_floats(dx + j * W, d);
  });
}

// The weight part's stage 1, W columns a thread.
template <int W>
ZERO3D_KERNEL void rmsnorm_backward_params(Width<W>, float* partial, const float* dout, const float* inp,
                                    const float* rstd, Index N, Index C) {
  column_chunk_pass<W>("rmsnorm_backward_params", partial, N, C, KOKKOS_LAMBDA(Index e, Index i, float(&dw)[W]) {
    float g[W], v[W];
    load_floats(g, dout + e);
    load_floats(v, inp + e);
    const float s = rstd[i];
    for (int k = 0; k < W; ++k) dw[k] += g[k] * v[k] * s;
  });
}

// The input part a row to a warp; the weight part as a column sum in two stages
// (device_forms.hpp), as layernorm_backward.
template <typename P>
ZERO3D_KERNEL void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const P* weight,
                             const float* rstd, Index N, Index C) {
  if (dinp) {
    const bool vec = vectorizable(C, dinp, dout, inp, weight);
    Kokkos::parallel_for("rmsnorm_backward_input", row_teams(N), KOKKOS_LAMBDA(const RowTeam& team) {
      const Index i = team_row(team);
      if (i >= N) return;
      if (vec) rmsnorm_backward_row<kVec>(team, dinp + i * C, dout + i * C, inp + i * C, weight, rstd[i], C);
      else rmsnorm_backward_row<1>(team, dinp + i * C, dout + i * C, inp + i * C, weight, rstd[i], C);
    });
  }
  if (!dweight) return;
  const Index chunks = column_chunks(N);
  float* partial = kernel_scratch<float>(chunks * C);
  if (vectorizable(C, dout, inp, partial)) rmsnorm_backward_params(Width<kVec>{}, partial, dout, inp, rstd, N, C);
  else rmsnorm_backward_params(Width<1>{}, partial, dout, inp, rstd, N, C);
  add_chunk_sums(dweight, partial, chunks, C);
}

}  // namespace gpu

// Saves rstd[N] for the backward pass. P: the weight's stored type; O: the output's (bf16 when
// the output only feeds a bf16 product). The sum of squares is an `omp simd` reduction so it
// vectorises; the output pass finds the row in L1.
template <typename P, typename O = float>
ZERO3D_KERNEL void rmsnorm_forward(O* out, float* rstd, const float* inp, const P* weight16, Index N, Index C, float eps) {
#ifdef ZERO3D_DEVICE
  gpu::rmsnorm_forward(out, rstd, inp, weight16, N, C, eps);
#else
  WidenedParams widen;
  const float* weight = widen(weight16, C);
  Kokkos::parallel_for("rmsnorm_forward", range(N), KOKKOS_LAMBDA(Index i) {
    const float* x = inp + i * C;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (Index c = 0; c < C; ++c) ss += x[c] * x[c];
    const float s = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
    O* o = out + i * C;
#pragma omp simd
    for (Index c = 0; c < C; ++c) o[c] = from_float<O>(x[c] * s * weight[c]);
    rstd[i] = s;
  });
#endif
}

// dinp += (accumulates: the residual stream's gradient flows through), dweight += . With
// norm = x·s and dnorm = w·dy, d(norm)/dx = s(I - norm normᵀ/C), so
// dx = s · (dnorm - norm · mean(dnorm ⊙ norm)). A null dinp skips the input part, a null
// dweight the weight part (zero-bubble schedules run them apart, as layernorm_backward).
template <typename P>
ZERO3D_KERNEL void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const P* weight,
                             const float* rstd, Index N, Index C) {
#ifdef ZERO3D_DEVICE
  gpu::rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C);
#else
#ifdef ZERO3D_SERIAL_HOST
  // One thread: both parts in one pass over the rows (dout and inp read once, not twice), the
  // weight widened once. Each column's rows are summed in order into a fresh sum that then joins
  // dweight, as the column-block loop below sums them; either part alone runs the same
  // arithmetic, so a split backward (zero-bubble schedules) gives the whole one's bits.
  if (!dinp && !dweight) return;
  const ProfileRegion region("rmsnorm_backward");
  WidenedParams widen;
  const float* w = dinp ? widen(weight, C) : nullptr;
  std::vector<float> sums(dweight ? static_cast<size_t>(C) : 0, 0.0f);
  float* dw = sums.data();
  for (Index i = 0; i < N; ++i) {
    const float* x = inp + i * C;
    const float* dy = dout + i * C;
    const float s = rstd[i];
    if (dinp) {
      float dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_norm_mean)
      for (Index c = 0; c < C; ++c) dnorm_norm_mean += w[c] * dy[c] * x[c] * s;
      dnorm_norm_mean /= static_cast<float>(C);
      float* dx = dinp + i * C;
      if (dweight) {
#pragma omp simd
        for (Index c = 0; c < C; ++c) {
          dx[c] += (w[c] * dy[c] - x[c] * s * dnorm_norm_mean) * s;
          dw[c] += dy[c] * x[c] * s;
        }
        continue;
      }
#pragma omp simd
      for (Index c = 0; c < C; ++c) dx[c] += (w[c] * dy[c] - x[c] * s * dnorm_norm_mean) * s;
    } else {
#pragma omp simd
      for (Index c = 0; c < C; ++c) dw[c] += dy[c] * x[c] * s;
    }
  }
  if (dweight)
    for (Index c = 0; c < C; ++c) dweight[c] += dw[c];
  return;
#endif
  if (dinp) Kokkos::parallel_for("rmsnorm_backward_input", range(N), KOKKOS_LAMBDA(Index i) {
    const float* x = inp + i * C;
    const float* dy = dout + i * C;
    const float s = rstd[i];
    float dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_norm_mean)
    for (Index c = 0; c < C; ++c) dnorm_norm_mean += to_float(weight[c]) * dy[c] * x[c] * s;
    dnorm_norm_mean /= static_cast<float>(C);
    float* dx = dinp + i * C;
#pragma omp simd
    for (Index c = 0; c < C; ++c) dx[c] += (to_float(weight[c]) * dy[c] - x[c] * s * dnorm_norm_mean) * s;
  });
  // Parallel over column blocks (no two iterations share a parameter), as layernorm_backward.
  constexpr Index kBlock = 64;
  if (dweight) Kokkos::parallel_for("rmsnorm_backward_params", range((C + kBlock - 1) / kBlock), KOKKOS_LAMBDA(Index blk) {
    const Index c0 = blk * kBlock, width = c0 + kBlock < C ? kBlock : C - c0;
    float dw[kBlock] = {};
    for (Index i = 0; i < N; ++i) {
      const float s = rstd[i];
      const float* dy = dout + i * C + c0;
      const float* x = inp + i * C + c0;
      if (width == kBlock) {
#pragma omp simd
        for (Index c = 0; c < kBlock; ++c) dw[c] += dy[c] * x[c] * s;
      } else {
        for (Index c = 0; c < width; ++c) dw[c] += dy[c] * x[c] * s;
      }
    }
    for (Index c = 0; c < width; ++c) dweight[c0 + c] += dw[c];
  });
#endif
}

}  // namespace zero3d::kernels
