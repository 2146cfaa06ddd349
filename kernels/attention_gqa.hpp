// attention_gqa.hpp — causal grouped-query attention (Ainslie et al. 2023, "GQA") with an optional
// sliding window, for the Llama family (Hugging Face modeling_llama.py LlamaAttention,
// modeling_mistral.py, modeling_qwen2.py).
//
// qkv[B,T,(H + 2·Hkv)·d] is rope.hpp's layout: per token q's H heads, then k's Hkv heads, then v's
// Hkv heads, d = head_dim each. Query head h reads K/V head h / (H/Hkv), as Hugging Face's
// repeat_kv pairs them, without copying K/V: the kernels index the shared head, and the backward
// sums the group's query heads into it. out[B,T,H·d] is head-major per token (attn_output
// .transpose(1, 2).reshape, what o_proj reads). Scores are scaled by 1/sqrt(d)
// (LlamaAttention.scaling = head_dim**-0.5).
//
// Key j is visible to query i when j <= i and, with a window W > 0, i − j < W (transformers
// masking_utils: causal_mask_function and sliding_window_overlay, kv_idx > q_idx − W); W = 0 is
// plain causal attention. att[B,H,T,T] keeps the softmax probabilities, zero on every key a
// query does not see, for the backward. Attention dropout (LlamaAttention's attention_dropout,
// training only) as attention.hpp's: att keeps the undropped probabilities, Y = (P ∘ M)·V, the
// backward redraws M (kernels/dropout.hpp) for dV = (P ∘ M)ᵀ·dY and dP ∘ M.
//
// The CPU form runs sgemm per (batch, head) and block of kRowBlock query rows straight on the
// strided qkv (a block reads keys from its first row's window start to its last row only); the
// device form (namespace gpu) splits heads into dense arrays and batches its products over the
// B·Hkv groups, in causal query blocks over the keys each sees (attention_causal_blocks.hpp).
// Both compile on every build; tests/kernels/test_llama_kernels.cpp holds one against the other.
//
// bf16 compute (the overloads at the end, qkv in bf16: the q/k/v product rounded its output and
// rope rotated it in bf16): on CPUs with AVX512-BF16 the fused kernel of
// cpu/attention_flash_bf16.hpp with its groups and window (att then holds each row's log-sum-exp
// and the bf16 output, as GPT-2's fused attention keeps), chosen at build time as
// attention_bf16.hpp chooses it, drawing attention dropout's mask itself (dropout.hpp's bits, 16
// elements at a time); elsewhere the portable form: the fp32 kernels above on q, k and v widened
// (exactly), the output rounded, att holding fp32 probabilities. On a GPU build under
// ZERO3D_ATTENTION_KERNEL=flash (as GPT-2's fused CUDA attention) and without attention dropout,
// the fused CUDA kernel of cuda/attention_flash_bf16.hpp with the same groups and window, att
// holding its log-sum-exp and bf16 output as on the CPU; otherwise, without attention dropout,
// gpu::gqa_attention_forward_bf16's products in bf16, att holding bf16 probabilities (GPT-2's
// bf16 attention's arithmetic); a GPU training pass with attention dropout runs the portable form.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "base/profiler.hpp"
#include "kernels/attention.hpp"  // kRowBlock, and the device form's head and score scratch
#include "kernels/attention_causal_blocks.hpp"
#include "kernels/common.hpp"
#include "kernels/dropout.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/gemm.hpp"
#include "kernels/half.hpp"
#include "kernels/memory.hpp"
#include "kernels/rope.hpp"

namespace zero3d::kernels {

// gqa_first_key (the first key query i sees) is in attention_window.hpp.

namespace gpu {

// Heads [H0 + n] of width d of a token-major array (row stride ld) -> dst[B·n][T][d]: attention.hpp's
// copy_heads (a thread per eight channels where the widths allow).
template <typename Heads, typename Rows>
ZERO3D_KERNEL void gqa_split_heads(Heads* dst, const Rows* src, Index ld, Index first_channel, Index B, Index T, Index n,
                                   Index d) {
  copy_heads<HeadCopy::Split>(dst, src, ld, first_channel, B, T, n * d, n, "gqa_split_heads");
}

// q [B·H][T][d], k and v [B·Hkv][T][d] from qkv[B,T,(H + 2·Hkv)·d] (fp32, or bf16 as they are).
template <typename Heads, typename Rows>
ZERO3D_KERNEL void gqa_split_qkv(Heads* q, Heads* k, Heads* v, const Rows* qkv, Index B, Index T, Index H, Index Hkv,
                                 Index d) {
  const Index W = (H + 2 * Hkv) * d;
  gqa_split_heads(q, qkv, W, 0, B, T, H, d);
  gqa_split_heads(k, qkv, W, H * d, B, T, Hkv, d);
  gqa_split_heads(v, qkv, W, (H + Hkv) * d, B, T, Hkv, d);
}

// src[B·n][T][d] -> the token-major dst (row stride ld) at channel first_channel.
template <typename Rows>
ZERO3D_KERNEL void gqa_merge_heads(Rows* dst, Index ld, Index first_channel, const float* src, Index B, Index T, Index n,
                                   Index d) {
  copy_heads<HeadCopy::Merge>(src, dst, ld, first_channel, B, T, n * d, n, "gqa_merge_heads");
}

// p[rows][T] (row r is query r mod T) <- softmax of scale·s over the visible keys, zero elsewhere
// (p over s itself, or bf16 probabilities): attention.hpp's rows with the window's first key.
template <typename O>
ZERO3D_KERNEL void gqa_softmax(O* p, const float* s, Index rows, Index T, float scale, Index window) {
  const bool vec = vectorizable(T, s, p);
  Kokkos::parallel_for("gqa_softmax", row_teams(rows), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index row = team_row(team);
    if (row >= rows) return;
    const Index i = row % T, j0 = gqa_first_key(i, window);
    if (vec) causal_softmax_row<kVec>(team, p + row * T, s + row * T, j0, i, T, scale);
    else causal_softmax_row<1>(team, p + row * T, s + row * T, j0, i, T, scale);
  });
}

// ds[rows][T] <- scale · P ∘ (dP − Σ_j P·dP) over the visible keys, zero elsewhere (ds over dp
// itself, or in bf16; P in fp32 or bf16).
template <typename D, typename Pr>
ZERO3D_KERNEL void gqa_softmax_backward(D* ds, const float* dp, const Pr* p, Index rows, Index T, float scale,
                                        Index window) {
  const bool vec = vectorizable(T, ds, dp, p);
  Kokkos::parallel_for("gqa_softmax_backward", row_teams(rows), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index row = team_row(team);
    if (row >= rows) return;
    const Index i = row % T, j0 = gqa_first_key(i, window);
    if (vec) causal_softmax_backward_row<kVec>(team, ds + row * T, dp + row * T, p + row * T, j0, i, T, scale);
    else causal_softmax_backward_row<1>(team, ds + row * T, dp + row * T, p + row * T, j0, i, T, scale);
  });
}

// The scratch layout: q [B·H][T][d], k and v [B·Hkv][T][d], then y (or dy), dq, dk, dv.
inline void gqa_attention_forward(float* out, float* att, const float* qkv, Index B, Index T, Index H, Index Hkv,
                                  Index d, Index window, DropoutMask dropout = {}) {
  const Index G = H / Hkv, nq = B * H * T * d, nkv = B * Hkv * T * d;
  float* q = head_scratch().take<float>(2 * nq + 2 * nkv);
  float *k = q + nq, *v = k + nkv, *y = v + nkv;
  gqa_split_qkv(q, k, v, qkv, B, T, H, Hkv, d);
  const CausalProducts products(B * Hkv, G, T, d, window);
  products.scores(att, q, k);  // S = Q·Kᵀ over each query block's keys
  gqa_softmax(att, att, B * H * T, T, 1.0f / std::sqrt(static_cast<float>(d)), window);
  const float* p = att;
  if (dropout.on()) {  // the kept probabilities in the backward's score scratch
    float* dropped = score_scratch().take<float>(B * H * T * T);
    dropout_probabilities(dropped, att, dropout, B, H, T);
    p = dropped;
  }
  products.rows(y, p, v);  // Y = (P ∘ M)·V
  gqa_merge_heads(out, H * d, 0, y, B, T, H, d);
}

inline void gqa_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, Index B, Index T,
                                   Index H, Index Hkv, Index d, Index window, DropoutMask dropout = {}) {
  const Index G = H / Hkv, W = (H + 2 * Hkv) * d, nq = B * H * T * d, nkv = B * Hkv * T * d;
  float* q = head_scratch().take<float>(3 * nq + 4 * nkv);
  float *k = q + nq, *v = k + nkv, *dy = v + nkv, *dq = dy + nq, *dk = dq + nq, *dv = dk + nkv;
  float* ds = score_scratch().take<float>(B * H * T * T);
  gqa_split_qkv(q, k, v, qkv, B, T, H, Hkv, d);
  gqa_split_heads(dy, dout, H * d, 0, B, T, H, d);
  const float* pk = att;  // dV = (P ∘ M)ᵀ·dY, the group summed (under dropout the kept probabilities in ds)
  if (dropout.on()) {
    dropout_probabilities(ds, att, dropout, B, H, T);
    pk = ds;
  }
  const CausalProducts products(B * Hkv, G, T, d, window);
  products.keys(dv, pk, dy);
  products.scores(ds, dy, v);  // dP = (dY·Vᵀ) ∘ M
  if (dropout.on()) dropout_probabilities(ds, ds, dropout, B, H, T);
  gqa_softmax_backward(ds, ds, att, B * H * T, T, 1.0f / std::sqrt(static_cast<float>(d)), window);
  products.rows(dq, ds, k);  // dQ = dS·K
  products.keys(dk, ds, q);  // dK = dSᵀ·Q, the group summed
  gqa_merge_heads(dqkv, W, 0, dq, B, T, H, d);
  gqa_merge_heads(dqkv, W, H * d, dk, B, T, Hkv, d);
  gqa_merge_heads(dqkv, W, (H + Hkv) * d, dv, B, T, Hkv, d);
}

// The bf16 form (the bf16 overloads' on a GPU, without the fused kernel or attention dropout):
// q, k and v split from the bf16 qkv as they are, the six products in bf16 with fp32 sums in
// causal query blocks, the softmax from fp32 scores to the bf16 probabilities att keeps, dS in
// bf16: GPT-2's bf16 attention's arithmetic with the groups and the window. The portable form
// made its products in fp32 on q, k and v widened (46 TFLOP/s on the H200, whose bf16 products
// ran at 160-340 with an operand's conversion included). Scratch: head_scratch the fp32 results then the bf16 heads, score_scratch
// the fp32 scores (dP), then dS in bf16 (gqa_attention_workspace_bytes).
struct GqaBf16Scratch {
  float* wide;  // y, or dq then dk, dv
  bf16* heads;  // q, k, v (then dY)
  static int64_t head_bytes(Index nq, Index nkv, bool backward) {
    return backward ? 4 * (nq + 2 * nkv) + 2 * (2 * nq + 2 * nkv) : 4 * nq + 2 * (nq + 2 * nkv);
  }
  static int64_t score_bytes(Index rows, Index T, bool backward) { return (backward ? 6 : 4) * rows * T; }
  GqaBf16Scratch(Index nq, Index nkv, bool backward) {
    char* base = static_cast<char*>(head_scratch().take(head_bytes(nq, nkv, backward)));
    wide = reinterpret_cast<float*>(base);
    heads = reinterpret_cast<bf16*>(base + 4 * (backward ? nq + 2 * nkv : nq));
  }
};

template <typename O>
inline void gqa_attention_forward_bf16(O* out, float* att, const bf16* qkv, Index B, Index T, Index H, Index Hkv,
                                       Index d, Index window) {
  const Index G = H / Hkv, nq = B * H * T * d, nkv = B * Hkv * T * d;
  const GqaBf16Scratch scratch(nq, nkv, false);
  float* y = scratch.wide;
  bf16 *q = scratch.heads, *k = q + nq, *v = k + nkv;
  float* s = static_cast<float*>(score_scratch().take(GqaBf16Scratch::score_bytes(B * H * T, T, false)));
  bf16* p = reinterpret_cast<bf16*>(att);
  gqa_split_qkv(q, k, v, qkv, B, T, H, Hkv, d);
  const CausalProducts products(B * Hkv, G, T, d, window);
  products.scores(s, q, k);  // S = Q·Kᵀ over each query block's keys
  gqa_softmax(p, s, B * H * T, T, 1.0f / std::sqrt(static_cast<float>(d)), window);
  products.rows(y, p, v);  // Y = P·V
  gqa_merge_heads(out, H * d, 0, y, B, T, H, d);
}

inline void gqa_attention_backward_bf16(float* dqkv, const float* dout, const bf16* qkv, const float* att, Index B,
                                        Index T, Index H, Index Hkv, Index d, Index window) {
  const Index G = H / Hkv, W = (H + 2 * Hkv) * d, nq = B * H * T * d, nkv = B * Hkv * T * d, rows = B * H * T;
  const GqaBf16Scratch scratch(nq, nkv, true);
  float *dq = scratch.wide, *dk = dq + nq, *dv = dk + nkv;
  bf16 *q = scratch.heads, *k = q + nq, *v = k + nkv, *dy = v + nkv;
  char* scores = static_cast<char*>(score_scratch().take(GqaBf16Scratch::score_bytes(rows, T, true)));
  float* dp = reinterpret_cast<float*>(scores);
  bf16* ds = reinterpret_cast<bf16*>(scores + 4 * rows * T);
  const bf16* p = reinterpret_cast<const bf16*>(att);
  gqa_split_qkv(q, k, v, qkv, B, T, H, Hkv, d);
  gqa_split_heads(dy, dout, H * d, 0, B, T, H, d);  // dY rounded to bf16, as GPT-2's bf16 attention packs it
  const CausalProducts products(B * Hkv, G, T, d, window);
  products.keys(dv, p, dy);    // dV = Pᵀ·dY, the group summed
  products.scores(dp, dy, v);  // dP = dY·Vᵀ
  gqa_softmax_backward(ds, dp, p, rows, T, 1.0f / std::sqrt(static_cast<float>(d)), window);
  products.rows(dq, ds, k);  // dQ = dS·K
  products.keys(dk, ds, q);  // dK = dSᵀ·Q, the group summed
  gqa_merge_heads(dqkv, W, 0, dq, B, T, H, d);
  gqa_merge_heads(dqkv, W, H * d, dk, B, T, Hkv, d);
  gqa_merge_heads(dqkv, W, (H + Hkv) * d, dv, B, T, Hkv, d);
}

}  // namespace gpu


// Rows [r0, r1) of one head's T×T probabilities at s (row stride T; the block's scores sit in
// columns [c0, cols)): softmax over each row's visible keys, every other column of the row zero.
ZERO3D_KERNEL void gqa_softmax_rows(float* s, Index r0, Index r1, Index T, Index window) {
  Kokkos::parallel_for("gqa_softmax", range(r1 - r0), KOKKOS_LAMBDA(Index k) {
    const Index i = r0 + k, j0 = gqa_first_key(i, window);
    float* row = s + i * T;
    float mx = row[j0];
#pragma omp simd reduction(max : mx)
    for (Index j = j0 + 1; j <= i; ++j) mx = row[j] > mx ? row[j] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (Index j = j0; j <= i; ++j) {
      row[j] = fast_exp(row[j] - mx);
      sum += row[j];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (Index j = j0; j <= i; ++j) row[j] *= inv;
    for (Index j = 0; j < j0; ++j) row[j] = 0.0f;
    for (Index j = i + 1; j < T; ++j) row[j] = 0.0f;
  });
}

// The query row block [r0, r0 + rows) reads keys [c0, cols): from its first row's window start to its last row.
struct GqaBlock {
  Index rows, c0, cols;
};
inline GqaBlock gqa_block(Index r0, Index T, Index window) {
  const Index rows = r0 + kRowBlock < T ? kRowBlock : T - r0;
  return {rows, gqa_first_key(r0, window), r0 + rows};
}

// out[B,T,H·d], att[B,H,T,T] from qkv; window 0: causal, else also i − j < window.
// dropout: the probabilities' mask (off by default).
ZERO3D_KERNEL void gqa_attention_forward(float* out, float* att, const float* qkv, Index B, Index T, Index H, Index Hkv,
                                         Index d, Index window, DropoutMask dropout = {}) {
  obs::add_macs(2.0 * B * T * T * H * d);  // q·kᵀ and p·v, counted densely as the FLOPs formula does
  const ProfileRegion region("attention_forward");
#ifdef ZERO3D_DEVICE
  gpu::gqa_attention_forward(out, att, qkv, B, T, H, Hkv, d, window, dropout);
#else
  const Index G = H / Hkv, W = (H + 2 * Hkv) * d, A = H * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  float* dropped = dropout.on() ? dropped_scratch().take<float>(kRowBlock * T) : nullptr;
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const float* q = qkv + b * T * W + h * d;
      const float* k = qkv + b * T * W + (H + h / G) * d;
      const float* v = qkv + b * T * W + (H + Hkv + h / G) * d;
      float* p = att + (b * H + h) * T * T;
      float* o = out + b * T * A + h * d;
      for (Index r0 = 0; r0 < T; r0 += kRowBlock) {
        const GqaBlock blk = gqa_block(r0, T, window);
        const Index keys = blk.cols - blk.c0;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blk.rows, keys, d, scale, q + r0 * W, W, k + blk.c0 * W, W,
                    0.0f, p + r0 * T + blk.c0, T);
        gqa_softmax_rows(p, r0, r0 + blk.rows, T, window);
        const float* pv = p + r0 * T + blk.c0;
        Index ld = T;
        if (dropped) {  // the block's kept probabilities, row stride keys
          dropout_probability_rows(dropped, keys, pv, T, dropout, b, h, r0, blk.rows, blk.c0, keys, T);
          pv = dropped;
          ld = keys;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blk.rows, d, keys, 1.0f, pv, ld, v + blk.c0 * W, W, 0.0f,
                    o + r0 * A, A);
      }
    }
#endif
}

// dqkv written (all of it: q's, and k's and v's summed over each group's query heads); scratch
// needs kRowBlock·T floats (the CPU form's: one row block's dP, then dS).
ZERO3D_KERNEL void gqa_attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                                          const float* att, Index B, Index T, Index H, Index Hkv, Index d, Index window,
                                          DropoutMask dropout = {}) {
  obs::add_macs(4.0 * B * T * T * H * d);  // dp, dv, dq, dk: twice the forward's products
  const ProfileRegion region("attention_backward");
#ifdef ZERO3D_DEVICE
  (void)scratch;
  gpu::gqa_attention_backward(dqkv, dout, qkv, att, B, T, H, Hkv, d, window, dropout);
#else
  const Index G = H / Hkv, W = (H + 2 * Hkv) * d, A = H * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // dK and dV accumulate over row blocks and over the group's query heads: start from zero.
  Kokkos::parallel_for("gqa_zero_dkv", range(B * T), KOKKOS_LAMBDA(Index bt) {
    float* dkv = dqkv + bt * W + A;
    for (Index c = 0; c < 2 * Hkv * d; ++c) dkv[c] = 0.0f;
  });
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const float* q = qkv + b * T * W + h * d;
      const float* k = qkv + b * T * W + (H + h / G) * d;
      const float* v = qkv + b * T * W + (H + Hkv + h / G) * d;
      float* dq = dqkv + b * T * W + h * d;
      float* dk = dqkv + b * T * W + (H + h / G) * d;
      float* dv = dqkv + b * T * W + (H + Hkv + h / G) * d;
      const float* p = att + (b * H + h) * T * T;
      const float* dy = dout + b * T * A + h * d;
      for (Index r0 = 0; r0 < T; r0 += kRowBlock) {
        const GqaBlock blk = gqa_block(r0, T, window);
        const Index keys = blk.cols - blk.c0;
        const float* pb = p + r0 * T + blk.c0;
        // dV += (P ∘ M)ᵀ · dY (under dropout the kept probabilities in scratch), then dP = (dY · Vᵀ) ∘ M
        // (rows × keys), row stride T in scratch
        const float* pk = pb;
        if (dropout.on()) {
          dropout_probability_rows(scratch, T, pb, T, dropout, b, h, r0, blk.rows, blk.c0, keys, T);
          pk = scratch;
        }
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, keys, d, blk.rows, 1.0f, pk, T, dy + r0 * A, A, 1.0f,
                    dv + blk.c0 * W, W);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blk.rows, keys, d, 1.0f, dy + r0 * A, A, v + blk.c0 * W, W,
                    0.0f, scratch, T);
        if (dropout.on())
          dropout_probability_rows(scratch, T, scratch, T, dropout, b, h, r0, blk.rows, blk.c0, keys, T);
        // dS_ij = P_ij (dP_ij − Σ_k P_ik dP_ik) over the visible keys, zero on the block's other columns
        Kokkos::parallel_for("gqa_softmax_backward", range(blk.rows), KOKKOS_LAMBDA(Index kr) {
          const Index i = r0 + kr, j0 = gqa_first_key(i, window) - blk.c0, j1 = i - blk.c0;
          const float* pi = pb + kr * T;
          float* ds = scratch + kr * T;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (Index j = j0; j <= j1; ++j) dot += pi[j] * ds[j];
#pragma omp simd
          for (Index j = j0; j <= j1; ++j) ds[j] = pi[j] * (ds[j] - dot);
          for (Index j = 0; j < j0; ++j) ds[j] = 0.0f;
          for (Index j = j1 + 1; j < keys; ++j) ds[j] = 0.0f;
        });
        // dQ = scale · dS · K ; dK += scale · dSᵀ · Q
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, blk.rows, d, keys, scale, scratch, T, k + blk.c0 * W, W,
                    0.0f, dq + r0 * W, W);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, keys, d, blk.rows, scale, scratch, T, q + r0 * W, W, 1.0f,
                    dk + blk.c0 * W, W);
      }
    }
#endif
}

// ---- bf16 compute ---------------------------------------------------------------------------

// Whether the bf16 overloads below run the fused kernel for B·H = BH query heads: built with it
// and att has room for its L and O (ZERO3D_ATTENTION_KERNEL=tiled: the portable form). The CPU's
// fused kernel draws attention dropout's mask itself (the same bits as the portable form's); the
// CUDA kernel (ZERO3D_ATTENTION_KERNEL=flash, a head size it serves) carries no mask, so a
// training pass with attention dropout runs the portable form there. backend: the build asked
// about (a plan's).
inline bool gqa_attention_flash_chosen(Index BH, Index T, Index d, const DropoutMask& dropout = {},
                                       Backend backend = kBuildBackend) {
  return attention_flash_chosen(BH, T, d, backend == Backend::Gpu ? dropout : DropoutMask{}, backend);
}

// The floats of att the bf16 overloads write for BH query heads (what the model allocates): the
// fused kernel's L and O; else a GPU's bf16 form's bf16 probabilities (half the floats), or the
// portable form's fp32 ones. With attention dropout the CPU's fused kernel serves either way; on a
// GPU, training passes run the portable form, so they need the fp32 probabilities' room (the
// fused kernel's and the bf16 form's, which evaluation runs, fit inside it).
inline Index gqa_attention_bf16_saved_floats(Index BH, Index T, Index d, bool dropout = false,
                                             Backend backend = kBuildBackend) {
  const bool gpu = backend == Backend::Gpu;
  if (gpu && dropout) return BH * T * T;
  if (gqa_attention_flash_chosen(BH, T, d, {}, backend)) return attention_flash_o_offset(BH, T) + (BH * T * d + 1) / 2;
  return gpu ? (BH * T * T + 1) / 2 : BH * T * T;
}

// q, k and v widened to fp32 for the portable form (exact: a bf16 is an fp32 with a shorter
// mantissa), then the output.
inline DeviceScratch& gqa_widened_scratch() { return static_scratch<4>("attention_gqa_widened"); }

// out (bf16 for o_proj's bf16 product, or fp32) and att from the bf16 qkv.
template <typename O>
inline void gqa_attention_forward(O* out, float* att, const bf16* qkv, Index B, Index T, Index H, Index Hkv, Index d,
                                  Index window, DropoutMask dropout = {}) {
#ifdef ZERO3D_FLASH_ATTENTION
  if (gqa_attention_flash_chosen(B * H, T, d)) {
    obs::add_macs(2.0 * B * T * T * H * d);  // counted densely, as the fp32 kernel counts
    const ProfileRegion region("attention_forward");
    return flash::forward(out, att, qkv, B, T, flash::Heads{H, Hkv, d, window}, dropout);
  }
#endif
#ifdef ZERO3D_DEVICE
  if (gqa_attention_flash_chosen(B * H, T, d, dropout)) {
    obs::add_macs(2.0 * B * T * T * H * d);
    const ProfileRegion region("attention_forward");
    return cuda_flash::forward(out, att, reinterpret_cast<bf16*>(att + attention_flash_o_offset(B * H, T)), qkv, B, T,
                               cuda_flash::Heads{H, Hkv, d, window});
  }
  if (!dropout.on()) {
    obs::add_macs(2.0 * B * T * T * H * d);
    const ProfileRegion region("attention_forward");
    return gpu::gqa_attention_forward_bf16(out, att, qkv, B, T, H, Hkv, d, window);
  }
#endif
  const Index rows = B * T * (H + 2 * Hkv) * d, outs = B * T * H * d;
  float* wide = gqa_widened_scratch().take<float>(rows + (std::is_same_v<O, float> ? 0 : outs));
  convert(wide, qkv, rows);
  if constexpr (std::is_same_v<O, float>) {
    gqa_attention_forward(out, att, wide, B, T, H, Hkv, d, window, dropout);
  } else {
    gqa_attention_forward(wide + rows, att, wide, B, T, H, Hkv, d, window, dropout);
    convert(out, wide + rows, outs);
  }
}

// dqkv (fp32, for rope's backward) from the bf16 qkv and what the forward above left in att;
// scratch as the fp32 kernel's.
inline void gqa_attention_backward(float* dqkv, float* scratch, const float* dout, const bf16* qkv, const float* att,
                                   Index B, Index T, Index H, Index Hkv, Index d, Index window,
                                   DropoutMask dropout = {}) {
#ifdef ZERO3D_FLASH_ATTENTION
  if (gqa_attention_flash_chosen(B * H, T, d)) {
    obs::add_macs(4.0 * B * T * T * H * d);
    const ProfileRegion region("attention_backward");
    return flash::backward(dqkv, static_cast<float*>(nullptr), dout, qkv, att, B, T, flash::Heads{H, Hkv, d, window},
                           nullptr, nullptr, dropout);
  }
#endif
#ifdef ZERO3D_DEVICE
  if (gqa_attention_flash_chosen(B * H, T, d, dropout)) {
    obs::add_macs(4.0 * B * T * T * H * d);
    const ProfileRegion region("attention_backward");
    return cuda_flash::backward(dqkv, dout, qkv, att,
                                reinterpret_cast<const bf16*>(att + attention_flash_o_offset(B * H, T)), B, T,
                                cuda_flash::Heads{H, Hkv, d, window});
  }
  if (!dropout.on()) {
    (void)scratch;
    obs::add_macs(4.0 * B * T * T * H * d);
    const ProfileRegion region("attention_backward");
    return gpu::gqa_attention_backward_bf16(dqkv, dout, qkv, att, B, T, H, Hkv, d, window);
  }
#endif
  const Index rows = B * T * (H + 2 * Hkv) * d;
  float* wide = gqa_widened_scratch().take<float>(rows);
  convert(wide, qkv, rows);
  gqa_attention_backward(dqkv, scratch, dout, wide, att, B, T, H, Hkv, d, window, dropout);
}

// The backward for q/k/v_proj's bf16 products (a whole backward, bf16 compute): dqkv of q and k
// before rope's rotation (and of v) rounded to bf16 into the product's operand slot, and
// q/k/v_proj's bias gradient (Qwen2's; dbias nullable) added: the bits rope_backward on the fp32
// dqkv then gemm_operand's rounding and column sums give, as GPT-2's c_attn gets them
// (attention_backward_summing_columns). The fused kernel unrotates each fp32 dQ and dK row and
// writes it rounded as it goes; the portable form (and the CUDA kernel, through the overload
// above) writes the fp32 dqkv into wide (B·T·(H + 2·Hkv)·d floats), runs rope_backward on it,
// then rounds and sums. scratch as the fp32 kernel's.
inline void gqa_attention_backward_summing_columns(bf16* dqkv, float* dbias, float* wide, float* scratch,
                                                   const float* dout, const bf16* qkv, const float* att, Index B,
                                                   Index T, Index H, Index Hkv, Index d, Index window,
                                                   const float* rope_cos, const float* rope_sin,
                                                   DropoutMask dropout = {}) {
#ifdef ZERO3D_FLASH_ATTENTION
  if (gqa_attention_flash_chosen(B * H, T, d)) {
    obs::add_macs(4.0 * B * T * T * H * d);
    const ProfileRegion region("attention_backward");
    return flash::backward(dqkv, dbias, dout, qkv, att, B, T, flash::Heads{H, Hkv, d, window}, rope_cos, rope_sin,
                           dropout);
  }
#endif
  gqa_attention_backward(wide, scratch, dout, qkv, att, B, T, H, Hkv, d, window, dropout);
  rope_backward(wide, rope_cos, rope_sin, B, T, H, Hkv, d);
  convert_summing_columns(dqkv, dbias, wide, B * T, (H + 2 * Hkv) * d);
}

// The attention scratch a training step of the kernels above grows beyond the model's own
// buffers (B·T tokens, H query heads over Hkv, head size d): where bf16 compute runs the fused
// kernel every pass, nothing on a CPU and the CUDA kernel's D on a GPU; bf16 compute otherwise on
// a GPU, the bf16 form's heads and scores (gpu::GqaBf16Scratch); otherwise q, k and v widened to
// fp32 (and the output when it is bf16: bf16_out), then the fp32 kernels' own: on a GPU the heads
// split out and the backward's dS (gpu::gqa_attention_backward), on a CPU under dropout a row
// block's kept probabilities. backend: the build asked about (a plan's).
inline int64_t gqa_attention_workspace_bytes(Index B, Index T, Index H, Index Hkv, Index d, DType compute,
                                             bool bf16_out, bool dropout, Backend backend = kBuildBackend) {
  const bool gpu = backend == Backend::Gpu;
  const int64_t nq = B * H * T * d, nkv = B * Hkv * T * d;
  int64_t bytes = 0;
  if (compute == DType::BF16) {
    if (!gpu && gqa_attention_flash_chosen(B * H, T, d, {}, backend)) return 0;  // it draws dropout's mask itself
    if (gpu && !dropout && gqa_attention_flash_chosen(B * H, T, d, {}, backend))
      return cuda_flash::backward_scratch_bytes(B * H, T, d);
    if (gpu) {
      // the bf16 form's scratch (its backward's, the larger); under attention dropout training passes
      // run the portable form and evaluation the bf16 one, each shared scratch growing to the larger
      const int64_t rows = B * H * T;
      const int64_t heads = gpu::GqaBf16Scratch::head_bytes(nq, nkv, true),
                    scores = gpu::GqaBf16Scratch::score_bytes(rows, T, true);
      if (!dropout) return heads + scores;
      return 4 * (B * T * (H + 2 * Hkv) * d + (bf16_out ? nq : 0)) + std::max<int64_t>(4 * (3 * nq + 4 * nkv), heads) +
             std::max<int64_t>(4 * rows * T, scores);
    }
    bytes += 4 * (B * T * (H + 2 * Hkv) * d + (bf16_out ? nq : 0));
  }
  if (gpu) return bytes + 4 * (3 * nq + 4 * nkv + B * H * T * T);
  return bytes + (dropout ? dropped_scratch_bytes(T) : 0);
}

}  // namespace zero3d::kernels
