// attention.hpp — causal multi-head self-attention on the fused qkv activation.
//
// qkv[B,T,3C] holds q | k | v per token; head h uses channels [h*hs, (h+1)*hs) of each part.
// att[B,H,T,T] keeps the softmax probabilities for the backward. Scores are scaled by
// 1/sqrt(hs) (GPT-2). Work is done per (batch, head) and per block of kRowBlock query rows:
// a row block only needs keys up to its last row, so sgemm skips most of the masked half.
// compute = BF16 runs attention_bf16.hpp's kernels instead: on CPUs with AVX512-BF16 the fused
// FlashAttention-2 style kernel (attention_flash_bf16.hpp; att then holds each row's log-sum-exp
// and the bf16 output, no probabilities), else the tiled kernel (bf16 probabilities in att).
// Attention dropout (GPT2Attention.attn_dropout): att keeps the undropped probabilities,
// Y = (P ∘ M)·V, and the backward redraws M (kernels/dropout.hpp): dV = (P ∘ M)ᵀ·dY, and the
// softmax backward reads dP ∘ M. BF16 compute draws the same M in its tiled kernel.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <type_traits>

#include "base/dtype.hpp"
#include "base/profiler.hpp"
#include "kernels/attention_bf16.hpp"
#include "kernels/attention_causal_blocks.hpp"
#include "kernels/common.hpp"
#include "kernels/device_forms.hpp"
#include "kernels/dropout.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/gemm.hpp"
#include "kernels/half.hpp"
#include "kernels/memory.hpp"

namespace zero3d::kernels {

constexpr Index kRowBlock = 64;

// Row-wise causal softmax of rows [r0, r1) of the T×T block at s (row stride T), in place.
ZERO3D_KERNEL void causal_softmax_rows(float* s, Index r0, Index r1, Index cols, Index T) {
  Kokkos::parallel_for("causal_softmax", range(r1 - r0), KOKKOS_LAMBDA(Index k) {
    const Index i = r0 + k;
    float* row = s + i * T;
    float mx = row[0];
#pragma omp simd reduction(max : mx)
    for (Index j = 1; j <= i; ++j) mx = row[j] > mx ? row[j] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (Index j = 0; j <= i; ++j) {
      row[j] = fast_exp(row[j] - mx);
      sum += row[j];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (Index j = 0; j <= i; ++j) row[j] *= inv;
    for (Index j = i + 1; j < cols; ++j) row[j] = 0.0f;  // masked keys inside the block
  });
}

// The CPU forms' kept probabilities of one row block (kRowBlock·T floats) under dropout.
inline DeviceScratch& dropped_scratch() { return static_scratch<3>("attention_dropped"); }
// The bytes it grows to: one row block of T keys.
inline int64_t dropped_scratch_bytes(Index T) { return 4 * kRowBlock * T; }

// fp32: sgemm per (batch, head) and row block.
inline void attention_forward_fp32(float* out, float* att, const float* qkv, Index B, Index T, Index C, Index H,
                                   DropoutMask dropout = {}) {
  const Index hs = C / H, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  float* dropped = dropout.on() ? dropped_scratch().take<float>(kRowBlock * T) : nullptr;
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const float* q = qkv + b * T * C3 + h * hs;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* p = att + (b * H + h) * T * T;
      float* o = out + b * T * C + h * hs;
      for (Index r0 = 0; r0 < T; r0 += kRowBlock) {
        const Index rows = r0 + kRowBlock < T ? kRowBlock : T - r0;
        const Index cols = r0 + rows;  // keys 0 .. last query row of the block
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, hs, scale, q + r0 * C3, C3, k, C3, 0.0f,
                    p + r0 * T, T);
        causal_softmax_rows(p, r0, r0 + rows, cols, T);
        const float* pv = p + r0 * T;
        if (dropped) {
          dropout_probability_rows(dropped, T, pv, T, dropout, b, h, r0, rows, 0, cols, T);
          pv = dropped;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hs, cols, 1.0f, pv, T, v, C3, 0.0f, o + r0 * C, C);
      }
    }
}

// The device form of the fp32 attention (llm.c attention.cuh): q, k and v split per (batch,
// head) into dense [B·H][T][hs], the products in causal query blocks over all B·H pairs
// (attention_causal_blocks.hpp: one strided-batched cuBLASLt call a block; 56% of the square's
// products at T 1024), the causal softmax a team per row. The softmax writes zeros above the
// diagonal, so the products read zeros, never garbage, past it. Compiled on every build: on the
// CPU the tests hold it against the form above.
namespace gpu {

// q, k, v, and y / dy, dq, dk, dv: 7 · B·T·C floats; dP, then dS: B·H·T·T floats.
inline DeviceScratch& head_scratch() { return static_scratch<1>("attention_heads"); }
inline DeviceScratch& score_scratch() { return static_scratch<2>("attention_dscores"); }

// dst[B·H][T][hs] <- the heads of src[B,T,·] (row stride ld) from channel c0, or back (Merge): a
// thread per W channels of a head's row (kVec where hs, ld and the pointers allow whole vectors,
// device_forms.hpp; a thread per element kept too little in flight).
enum class HeadCopy { Split, Merge };
template <HeadCopy Way, int W, typename Heads, typename Rows>
ZERO3D_KERNEL void copy_heads(Width<W>, Heads* heads, Rows* rows, Index ld, Index c0, Index B, Index T, Index C,
                              Index H, const char* label) {
  const Index hs = C / H;
  Kokkos::parallel_for(label, range(B * T * C / W), KOKKOS_LAMBDA(Index p) {
    const Index e = p * W, x = e % hs, t = (e / hs) % T, bh = e / (hs * T), b = bh / H, h = bh % H;
    float v[W];
    Heads* head = heads + e;  // (nvcc: a lambda may not first capture inside a constexpr if)
    Rows* row = rows + (b * T + t) * ld + c0 + h * hs + x;
    if constexpr (Way == HeadCopy::Split) {
      load_floats(v, row);
      store_floats(head, v);
    } else {
      load_floats(v, head);
      store_floats(row, v);
    }
  });
}
template <HeadCopy Way, typename Heads, typename Rows>
ZERO3D_KERNEL void copy_heads(Heads* heads, Rows* rows, Index ld, Index c0, Index B, Index T, Index C, Index H,
                              const char* label) {
  if ((C / H) % kVec == 0 && vectorizable(ld, heads, rows + c0))
    copy_heads<Way>(Width<kVec>{}, heads, rows, ld, c0, B, T, C, H, label);
  else
    copy_heads<Way>(Width<1>{}, heads, rows, ld, c0, B, T, C, H, label);
}

// part (0 q, 1 k, 2 v) of qkv[B,T,3C] -> dst[B·H][T][hs].
ZERO3D_KERNEL void split_heads(float* dst, const float* qkv, int part, Index B, Index T, Index C, Index H) {
  copy_heads<HeadCopy::Split>(dst, qkv, 3 * C, part * C, B, T, C, H, "attention_split_heads");
}

// src[B·H][T][hs] -> dst[B,T,·] at channel offset c0 (row stride ld).
ZERO3D_KERNEL void merge_heads(float* dst, Index ld, Index c0, const float* src, Index B, Index T, Index C, Index H) {
  copy_heads<HeadCopy::Merge>(src, dst, ld, c0, B, T, C, H, "attention_merge_heads");
}

// One row of a head's scores, W keys a lane, over the keys [j0, i] it sees (the causal mask, and
// a sliding window's start: attention_gqa.hpp): the max, the sum of exponentials, then P written
// from exponentials computed again (the row is read three times, the later passes mostly from
// cache, and written once to p: over x itself, or in bf16 for bf16 products), only the seen
// keys' vectors read, the others written as zeros.
template <int W, typename O>
KOKKOS_INLINE_FUNCTION void causal_softmax_row(const RowTeam& team, O* p, const float* x, Index j0, Index i, Index T,
                                               float scale) {
  const Index v0 = j0 / W, seen = (i + W) / W - v0;  // the vectors holding keys j0..i
  const float* xs = x + v0 * W;
  const auto visible = [&](Index v, int k) { return v0 * W + v * W + k >= j0 && v0 * W + v * W + k <= i; };
  float mx = 0.0f;
  Kokkos::parallel_reduce(
      Kokkos::ThreadVectorRange(team, seen),
      [&](Index v, float& m) {
        float e[W];
        load_floats(e, xs + v * W);
        for (int k = 0; k < W; ++k)
          if (visible(v, k) && scale * e[k] > m) m = scale * e[k];
      },
      Kokkos::Max<float>(mx));
  float sum = 0.0f;
  Kokkos::parallel_reduce(
      Kokkos::ThreadVectorRange(team, seen),
      [&](Index v, float& acc) {
        float e[W];
        load_floats(e, xs + v * W);
        for (int k = 0; k < W; ++k) acc += visible(v, k) ? fast_exp(scale * e[k] - mx) : 0.0f;
      },
      sum);
  const float inv = 1.0f / sum;
  Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, T / W), [&](Index u) {
    const Index v = u - v0;
    float e[W] = {};
    if (v >= 0 && v < seen) {
      load_floats(e, xs + v * W);
      for (int k = 0; k < W; ++k) e[k] = visible(v, k) ? fast_exp(scale * e[k] - mx) * inv : 0.0f;
    }
    store_floats(p + u * W, e);
  });
}

// s[B·H·T][T] <- softmax over keys j <= i of scale·s (row i of each head), zero above the diagonal.
ZERO3D_KERNEL void causal_softmax(float* s, Index BH, Index T, float scale) {
  const Index rows = BH * T;
  const bool vec = vectorizable(T, s);
  Kokkos::parallel_for("attention_causal_softmax", row_teams(rows), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index row = team_row(team);
    if (row >= rows) return;
    if (vec) causal_softmax_row<kVec>(team, s + row * T, s + row * T, 0, row % T, T, scale);
    else causal_softmax_row<1>(team, s + row * T, s + row * T, 0, row % T, T, scale);
  });
}

// One row of dS from dP (d) and P (pr, fp32 or bf16), W keys a lane, over the keys [j0, i] it
// sees: the dot there, then dS there and zeros elsewhere, into ds (over d itself, or in bf16).
template <int W, typename D, typename Pr>
KOKKOS_INLINE_FUNCTION void causal_softmax_backward_row(const RowTeam& team, D* ds, const float* d, const Pr* pr,
                                                        Index j0, Index i, Index T, float scale) {
  const Index v0 = j0 / W, seen = (i + W) / W - v0;
  const auto visible = [&](Index v, int k) { return v0 * W + v * W + k >= j0 && v0 * W + v * W + k <= i; };
  float dot = 0.0f;
  Kokkos::parallel_reduce(
      Kokkos::ThreadVectorRange(team, seen),
      [&](Index v, float& acc) {
        float pv[W], g[W];
        load_floats(pv, pr + (v0 + v) * W);
        load_floats(g, d + (v0 + v) * W);
        for (int k = 0; k < W; ++k) acc += visible(v, k) ? pv[k] * g[k] : 0.0f;
      },
      dot);
  Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, T / W), [&](Index u) {
    const Index v = u - v0;
    float g[W] = {};
    if (v >= 0 && v < seen) {
      float pv[W];
      load_floats(pv, pr + u * W);
      load_floats(g, d + u * W);
      for (int k = 0; k < W; ++k) g[k] = visible(v, k) ? scale * pv[k] * (g[k] - dot) : 0.0f;
    }
    store_floats(ds + u * W, g);
  });
}

// ds[B·H·T][T] <- scale · P ∘ (dP − Σ_j P·dP) (ds holds dP on entry), zero above the diagonal.
ZERO3D_KERNEL void causal_softmax_backward(float* ds, const float* p, Index BH, Index T, float scale) {
  const Index rows = BH * T;
  const bool vec = vectorizable(T, ds, p);
  Kokkos::parallel_for("attention_softmax_backward", row_teams(rows), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index row = team_row(team);
    if (row >= rows) return;
    if (vec) causal_softmax_backward_row<kVec>(team, ds + row * T, ds + row * T, p + row * T, 0, row % T, T, scale);
    else causal_softmax_backward_row<1>(team, ds + row * T, ds + row * T, p + row * T, 0, row % T, T, scale);
  });
}

inline void attention_forward_fp32(float* out, float* att, const float* qkv, Index B, Index T, Index C, Index H,
                                   DropoutMask dropout = {}) {
  const Index hs = C / H, BH = B * H, n = B * T * C;
  float* q = head_scratch().take<float>(7 * n);
  float *k = q + n, *v = k + n, *y = v + n;
  split_heads(q, qkv, 0, B, T, C, H);
  split_heads(k, qkv, 1, B, T, C, H);
  split_heads(v, qkv, 2, B, T, C, H);
  const CausalProducts products(BH, 1, T, hs);
  products.scores(att, q, k);  // S = Q·Kᵀ
  causal_softmax(att, BH, T, 1.0f / std::sqrt(static_cast<float>(hs)));
  const float* p = att;
  if (dropout.on()) {  // the kept probabilities in the backward's score scratch
    float* dropped = score_scratch().take<float>(BH * T * T);
    dropout_probabilities(dropped, att, dropout, B, H, T);
    p = dropped;
  }
  products.rows(y, p, v);  // Y = (P ∘ M)·V
  merge_heads(out, C, 0, y, B, T, C, H);
}

ZERO3D_KERNEL void attention_backward_fp32(float* dqkv, const float* dout, const float* qkv, const float* att, Index B,
                                    Index T, Index C, Index H, DropoutMask dropout = {}) {
  const Index hs = C / H, BH = B * H, n = B * T * C;
  float* q = head_scratch().take<float>(7 * n);
  float *k = q + n, *v = k + n, *dy = v + n, *dq = dy + n, *dk = dq + n, *dv = dk + n;
  float* ds = score_scratch().take<float>(BH * T * T);
  split_heads(q, qkv, 0, B, T, C, H);
  split_heads(k, qkv, 1, B, T, C, H);
  split_heads(v, qkv, 2, B, T, C, H);
  copy_heads<HeadCopy::Split>(dy, dout, C, 0, B, T, C, H, "attention_split_dout");
  const float* pk = att;  // dV = (P ∘ M)ᵀ·dY (under dropout the kept probabilities in ds), then dP = (dY·Vᵀ) ∘ M
  if (dropout.on()) {
    dropout_probabilities(ds, att, dropout, B, H, T);
    pk = ds;
  }
  const CausalProducts products(BH, 1, T, hs);
  products.keys(dv, pk, dy);
  products.scores(ds, dy, v);  // dP = (dY·Vᵀ) ∘ M
  if (dropout.on()) dropout_probabilities(ds, ds, dropout, B, H, T);
  causal_softmax_backward(ds, att, BH, T, 1.0f / std::sqrt(static_cast<float>(hs)));
  products.rows(dq, ds, k);  // dQ = dS·K
  products.keys(dk, ds, q);  // dK = dSᵀ·Q
  merge_heads(dqkv, 3 * C, 0, dq, B, T, C, H);
  merge_heads(dqkv, 3 * C, C, dk, B, T, C, H);
  merge_heads(dqkv, 3 * C, 2 * C, dv, B, T, C, H);
}

}  // namespace gpu

// The attention scratch a training step grows beyond the model's own buffers, for B·T tokens of
// H heads (C = H·hs): bf16's tiled workspace; fp32 on a GPU, the heads split out (q, k, v, dY,
// dQ, dK, dV) and the backward's dS (gpu::attention_backward_fp32); on a CPU under dropout, a row
// block's kept probabilities (the row block's scores are the model's scratch). backend: the
// build asked about (a plan's).
inline int64_t attention_workspace_bytes(Index B, Index T, Index C, Index H, DType compute, bool dropout,
                                         Backend backend = kBuildBackend) {
  if (compute == DType::BF16) return attention_bf16_workspace_bytes(B * H, T, C / H, dropout, backend);
  if (backend == Backend::Gpu) return 4 * (7 * B * T * C + B * H * T * T);
  return dropout ? dropped_scratch_bytes(T) : 0;
}

// O: the output's type; Q: qkv's. bf16 (an output that only feeds a bf16 product, a qkv its
// product already rounded) needs compute = BF16.
// dropout: the probabilities' mask (off by default).
template <typename O = float, typename Q = float>
inline void attention_forward(O* out, float* att, const Q* qkv, Index B, Index T, Index C, Index H,
                              DType compute = DType::F32, DropoutMask dropout = {}) {
  obs::add_macs(2.0 * B * T * T * C);  // q·kᵀ and p·v, counted densely as the FLOPs formula does
  const ProfileRegion region("attention_forward");
  if (compute == DType::BF16) return attention_forward_bf16(out, att, qkv, B, T, C, H, dropout);
#ifdef ZERO3D_DEVICE
  if constexpr (std::is_same_v<O, float> && std::is_same_v<Q, float>)
    gpu::attention_forward_fp32(out, att, qkv, B, T, C, H, dropout);
#else
  if constexpr (std::is_same_v<O, float> && std::is_same_v<Q, float>)
    attention_forward_fp32(out, att, qkv, B, T, C, H, dropout);
#endif
  else throw std::invalid_argument("attention_forward: bf16 operands need bf16 compute");
}

// The backward over a qkv its product rounded to bf16: the bf16 kernels only.
inline void attention_backward(float* dqkv, float*, const float* dout, const bf16* qkv, const float* att, Index B,
                               Index T, Index C, Index H, DType compute, DropoutMask dropout = {}) {
  if (compute != DType::BF16) throw std::invalid_argument("attention_backward: a bf16 qkv needs bf16 compute");
  obs::add_macs(4.0 * B * T * T * C);
  const ProfileRegion region("attention_backward");
  attention_backward_bf16(dqkv, dout, qkv, att, B, T, C, H, dropout);
}

// The backward for c_attn's bf16 products: dqkv rounded to bf16, and c_attn's bias gradient
// added to dbias, the bits gemm_operand makes from an fp32 dqkv. The fused kernel writes them
// as it goes; the tiled one writes fp32 into scratch (B·T·3C floats), converted after.
inline void attention_backward_summing_columns(bf16* dqkv, float* dbias, float* scratch, const float* dout,
                                               const bf16* qkv, const float* att, Index B, Index T, Index C, Index H,
                                               DropoutMask dropout = {}) {
  obs::add_macs(4.0 * B * T * T * C);
  const ProfileRegion region("attention_backward");
#ifdef ZERO3D_FLASH_ATTENTION
  if (attention_flash_chosen(B * H, T, C / H, dropout)) return flash::backward(dqkv, dbias, dout, qkv, att, B, T, C, H);
#endif
  attention_backward_bf16(scratch, dout, qkv, att, B, T, C, H, dropout);  // the tiled kernel, or the GPU's fused one
  convert_summing_columns(dqkv, dbias, scratch, B * T, 3 * C);
}

// dqkv written (all of it); scratch needs kRowBlock*T floats (fp32 only). dropout: the
// forward's mask, redrawn.
ZERO3D_KERNEL void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* att,
                               Index B, Index T, Index C, Index H, DType compute = DType::F32, DropoutMask dropout = {}) {
  const Index hs = C / H, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  obs::add_macs(4.0 * B * T * T * C);  // dp, dv, dq, dk: twice the forward's products
  const ProfileRegion region("attention_backward");
  if (compute == DType::BF16) return attention_backward_bf16(dqkv, dout, qkv, att, B, T, C, H, dropout);
#ifdef ZERO3D_DEVICE
  (void)scratch, (void)C3, (void)scale;
  gpu::attention_backward_fp32(dqkv, dout, qkv, att, B, T, C, H, dropout);
#else
  // dk and dv accumulate over row blocks: start from zero.
  Kokkos::parallel_for("zero_dkv", range(B * T), KOKKOS_LAMBDA(Index bt) {
    float* d = dqkv + bt * C3 + C;
    for (Index c = 0; c < 2 * C; ++c) d[c] = 0.0f;
  });
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const float* q = qkv + b * T * C3 + h * hs;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* dq = dqkv + b * T * C3 + h * hs;
      float* dk = dq + C;
      float* dv = dq + 2 * C;
      const float* p = att + (b * H + h) * T * T;
      const float* dy = dout + b * T * C + h * hs;
      for (Index r0 = 0; r0 < T; r0 += kRowBlock) {
        const Index rows = r0 + kRowBlock < T ? kRowBlock : T - r0;
        const Index cols = r0 + rows;
        const float* prow = p + r0 * T;
        // dV += (P ∘ M)ᵀ · dY (under dropout the kept probabilities in scratch), then dP = (dY · Vᵀ) ∘ M
        const float* pk = prow;
        if (dropout.on()) {
          dropout_probability_rows(scratch, T, prow, T, dropout, b, h, r0, rows, 0, cols, T);
          pk = scratch;
        }
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, hs, rows, 1.0f, pk, T, dy + r0 * C, C, 1.0f, dv, C3);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, hs, 1.0f, dy + r0 * C, C, v, C3, 0.0f,
                    scratch, T);
        if (dropout.on()) dropout_probability_rows(scratch, T, scratch, T, dropout, b, h, r0, rows, 0, cols, T);
        // softmax backward: dS_ij = P_ij (dP_ij - Σ_k P_ik dP_ik), zero above the diagonal
        Kokkos::parallel_for("softmax_backward", range(rows), KOKKOS_LAMBDA(Index kr) {
          const Index i = r0 + kr;
          const float* pi = prow + kr * T;
          float* ds = scratch + kr * T;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (Index j = 0; j <= i; ++j) dot += pi[j] * ds[j];
#pragma omp simd
          for (Index j = 0; j <= i; ++j) ds[j] = pi[j] * (ds[j] - dot);
          for (Index j = i + 1; j < cols; ++j) ds[j] = 0.0f;
        });
        // dQ = scale · dS · K ; dK += scale · dSᵀ · Q
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hs, cols, scale, scratch, T, k, C3, 0.0f,
                    dq + r0 * C3, C3);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, hs, rows, scale, scratch, T, q + r0 * C3, C3, 1.0f,
                    dk, C3);
      }
    }
#endif
}

}  // namespace zero3d::kernels
