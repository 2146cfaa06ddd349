// attention.hpp — causal multi-head self-attention on the fused qkv activation.
//
// qkv[B,T,3C] holds q | k | v per token; head h uses channels [h*hs, (h+1)*hs) of each part.
// att[B,H,T,T] keeps the softmax probabilities for the backward. Scores are scaled by
// 1/sqrt(hs) (GPT-2). Work is done per (batch, head) and per block of kRowBlock query rows:
// a row block only needs keys up to its last row, so sgemm skips most of the masked half.
// compute = BF16 runs attention_bf16.hpp's kernels instead: on CPUs with AVX512-BF16 the fused
// FlashAttention-2 style kernel (attention_flash_bf16.hpp; att then holds each row's log-sum-exp
// and the bf16 output, no probabilities), else the tiled kernel (bf16 probabilities in att).
#pragma once

#include <cblas.h>

#include <cmath>
#include <stdexcept>
#include <type_traits>

#include "base/dtype.hpp"
#include "base/profiler.hpp"
#include "kernels/attention_bf16.hpp"
#include "kernels/common.hpp"
#include "kernels/fastmath.hpp"

namespace zero3d::kernels {

constexpr Index kRowBlock = 64;

// Row-wise causal softmax of rows [r0, r1) of the T×T block at s (row stride T), in place.
inline void causal_softmax_rows(float* s, Index r0, Index r1, Index cols, Index T) {
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

// fp32: sgemm per (batch, head) and row block.
inline void attention_forward_fp32(float* out, float* att, const float* qkv, Index B, Index T, Index C, Index H) {
  const Index hs = C / H, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
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
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hs, cols, 1.0f, p + r0 * T, T, v, C3, 0.0f,
                    o + r0 * C, C);
      }
    }
}

// O: the output's type; Q: qkv's. bf16 (an output that only feeds a bf16 product, a qkv its
// product already rounded) needs compute = BF16.
template <typename O = float, typename Q = float>
inline void attention_forward(O* out, float* att, const Q* qkv, Index B, Index T, Index C, Index H,
                              DType compute = DType::F32) {
  obs::add_macs(2.0 * B * T * T * C);  // q·kᵀ and p·v, counted densely as the FLOPs formula does
  const ProfileRegion region("attention_forward");
  if (compute == DType::BF16) return attention_forward_bf16(out, att, qkv, B, T, C, H);
  if constexpr (std::is_same_v<O, float> && std::is_same_v<Q, float>) attention_forward_fp32(out, att, qkv, B, T, C, H);
  else throw std::invalid_argument("attention_forward: bf16 operands need bf16 compute");
}

// The backward over a qkv its product rounded to bf16: the bf16 kernels only.
inline void attention_backward(float* dqkv, float*, const float* dout, const bf16* qkv, const float* att, Index B,
                               Index T, Index C, Index H, DType compute) {
  if (compute != DType::BF16) throw std::invalid_argument("attention_backward: a bf16 qkv needs bf16 compute");
  obs::add_macs(4.0 * B * T * T * C);
  const ProfileRegion region("attention_backward");
  attention_backward_bf16(dqkv, dout, qkv, att, B, T, C, H);
}

// The backward for c_attn's bf16 products: dqkv rounded to bf16, and c_attn's bias gradient
// added to dbias, the bits gemm_operand makes from an fp32 dqkv. The fused kernel writes them
// as it goes; the tiled one writes fp32 into scratch (B·T·3C floats), converted after.
inline void attention_backward_summing_columns(bf16* dqkv, float* dbias, float* scratch, const float* dout,
                                               const bf16* qkv, const float* att, Index B, Index T, Index C, Index H) {
  obs::add_macs(4.0 * B * T * T * C);
  const ProfileRegion region("attention_backward");
#ifdef ZERO3D_FLASH_ATTENTION
  if (attention_flash_chosen(B * H, T, C / H)) return flash::backward(dqkv, dbias, dout, qkv, att, B, T, C, H);
#endif
  attention_backward_tiled_bf16(scratch, dout, qkv, att, B, T, C, H);
  convert_summing_columns(dqkv, dbias, scratch, B * T, 3 * C);
}

// dqkv written (all of it); scratch needs kRowBlock*T floats (fp32 only).
inline void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* att,
                               Index B, Index T, Index C, Index H, DType compute = DType::F32) {
  const Index hs = C / H, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  obs::add_macs(4.0 * B * T * T * C);  // dp, dv, dq, dk: twice the forward's products
  const ProfileRegion region("attention_backward");
  if (compute == DType::BF16) return attention_backward_bf16(dqkv, dout, qkv, att, B, T, C, H);
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
        // dP = dY · Vᵀ  (rows × cols), row stride T in scratch
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, hs, 1.0f, dy + r0 * C, C, v, C3, 0.0f,
                    scratch, T);
        // dV += Pᵀ · dY
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, hs, rows, 1.0f, prow, T, dy + r0 * C, C, 1.0f, dv,
                    C3);
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
}

}  // namespace zero3d::kernels
