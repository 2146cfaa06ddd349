// attention_sparse.hpp — block-sparse causal self-attention (DeepSpeed's sparse_attention,
// DEEPSPEED-FACTS-2 §8) on the fused qkv activation, fp32.
//
// layout[H, nb, nb] (nb = T / block) says which key blocks each query block of each head
// attends; the model is causal, so only key blocks kb <= qb are computed, and inside the
// diagonal block key j <= query i. Per (batch, head, query block) the selected key and value
// rows are gathered into one panel, so each product is a single sgemm over only the work the
// layout keeps. att keeps the probabilities as those panels: for each (batch, head), at
// att_stride apart, query block after query block, each bs rows of its n kept keys.
// Attention dropout (attn_pdrop) drops the computed blocks' probabilities with the dense
// kernel's mask (kernels/dropout.hpp: element (head·T + query)·T + key, the global key, not its
// panel column), so every layout, and a dense layout against attention.hpp, draw the same bits;
// att keeps the undropped probabilities and the backward redraws the mask, as attention.hpp.
#pragma once

#include <cblas.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "base/profiler.hpp"
#include "kernels/common.hpp"
#include "kernels/dropout.hpp"
#include "kernels/fastmath.hpp"

namespace zero3d::kernels {

namespace sparse_detail {

// The key blocks query block qb of head h computes: those set in the layout, up to the diagonal.
inline void key_blocks(std::vector<Index>& out, const uint8_t* layout, Index h, Index nb, Index qb) {
  out.clear();
  for (Index kb = 0; kb <= qb; ++kb)
    if (layout[(h * nb + qb) * nb + kb]) out.push_back(kb);
}

// rows [kb·bs, kb·bs + bs) of a head's k (or v) for each listed block, packed into panel[n, hs].
ZERO3D_KERNEL void gather_rows(float* panel, const float* src, const std::vector<Index>& blocks, Index bs, Index hs,
                        Index stride) {
  const Index* kb = blocks.data();
  Kokkos::parallel_for("sparse_gather", range(static_cast<Index>(blocks.size()) * bs), KOKKOS_LAMBDA(Index r) {
    const float* from = src + (kb[r / bs] * bs + r % bs) * stride;
    for (Index c = 0; c < hs; ++c) panel[r * hs + c] = from[c];
  });
}

// The reverse: panel rows added into their blocks' rows (the blocks are distinct, so no row twice).
ZERO3D_KERNEL void scatter_add_rows(float* dst, const float* panel, const std::vector<Index>& blocks, Index bs, Index hs,
                             Index stride) {
  const Index* kb = blocks.data();
  Kokkos::parallel_for("sparse_scatter_add", range(static_cast<Index>(blocks.size()) * bs), KOKKOS_LAMBDA(Index r) {
    float* to = dst + (kb[r / bs] * bs + r % bs) * stride;
    for (Index c = 0; c < hs; ++c) to[c] += panel[r * hs + c];
  });
}

// dst = src ∘ mask over a panel's bs rows (query rows r0..; row stride n): panel key block q is
// dense keys [blocks[q]·bs, +bs), so each block takes the dense probabilities' bits. dst may be src.
inline void drop_panel(float* dst, const float* src, Index n, const std::vector<Index>& blocks, const DropoutMask& m,
                       Index b, Index h, Index r0, Index bs, Index T) {
  for (size_t q = 0; q < blocks.size(); ++q)
    dropout_probability_rows(dst + q * bs, n, src + q * bs, n, m, b, h, r0, bs, blocks[q] * bs, bs, T);
}

inline double macs(const uint8_t* layout, Index B, Index H, Index nb, Index bs, Index hs) {
  double blocks = 0;
  for (Index h = 0; h < H; ++h)
    for (Index qb = 0; qb < nb; ++qb)
      for (Index kb = 0; kb <= qb; ++kb) blocks += layout[(h * nb + qb) * nb + kb];
  return static_cast<double>(B) * blocks * static_cast<double>(bs * bs * hs);
}

}  // namespace sparse_detail

ZERO3D_KERNEL void sparse_attention_forward(float* out, float* att, Index att_stride, const float* qkv, const uint8_t* layout,
                                     Index block, Index B, Index T, Index C, Index H, DropoutMask dropout = {}) {
  using namespace sparse_detail;
  const Index hs = C / H, C3 = 3 * C, nb = T / block, bs = block;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  obs::add_macs(2.0 * macs(layout, B, H, nb, bs, hs));  // q·kᵀ and p·v over the computed blocks
  const ProfileRegion region("sparse_attention_forward");
  std::vector<float> kp(T * hs), vp(T * hs), dropped(dropout.on() ? bs * T : 0);
  std::vector<Index> blocks;
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const float* q = qkv + b * T * C3 + h * hs;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* p = att + (b * H + h) * att_stride;  // advances panel by panel
      float* o = out + b * T * C + h * hs;
      for (Index qb = 0; qb < nb; ++qb) {
        key_blocks(blocks, layout, h, nb, qb);
        const Index n = static_cast<Index>(blocks.size()) * bs, r0 = qb * bs;
        if (n == 0) {  // every DeepSpeed pattern sets the diagonal block; a row with no key outputs zero
          Kokkos::parallel_for("sparse_no_key", range(bs * hs),
                               KOKKOS_LAMBDA(Index e) { o[(r0 + e / hs) * C + e % hs] = 0.0f; });
          continue;
        }
        gather_rows(kp.data(), k, blocks, bs, hs, C3);
        gather_rows(vp.data(), v, blocks, bs, hs, C3);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bs, n, hs, scale, q + r0 * C3, C3, kp.data(), hs, 0.0f,
                    p, n);
        // The diagonal block is always last in the panel (blocks ascend and end at qb when set).
        const bool diagonal = !blocks.empty() && blocks.back() == qb;
        Kokkos::parallel_for("sparse_causal_softmax", range(bs), KOKKOS_LAMBDA(Index i) {
          float* row = p + i * n;
          const Index valid = diagonal ? n - bs + i + 1 : n;  // keys after query r0 + i are masked
          float mx = row[0];
          for (Index j = 1; j < valid; ++j) mx = row[j] > mx ? row[j] : mx;
          float sum = 0.0f;
          for (Index j = 0; j < valid; ++j) {
            row[j] = fast_exp(row[j] - mx);
            sum += row[j];
          }
          const float inv = 1.0f / sum;
          for (Index j = 0; j < valid; ++j) row[j] *= inv;
          for (Index j = valid; j < n; ++j) row[j] = 0.0f;
        });
        const float* pv = p;  // Y = (P ∘ M)·V
        if (dropout.on()) {
          drop_panel(dropped.data(), p, n, blocks, dropout, b, h, r0, bs, T);
          pv = dropped.data();
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, bs, hs, n, 1.0f, pv, n, vp.data(), hs, 0.0f, o + r0 * C,
                    C);
        p += bs * n;
      }
    }
}

// dqkv written (all of it), from the probabilities sparse_attention_forward kept in att; dropout:
// the forward's mask, redrawn.
ZERO3D_KERNEL void sparse_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                                      Index att_stride, const uint8_t* layout, Index block, Index B, Index T, Index C,
                                      Index H, DropoutMask dropout = {}) {
  using namespace sparse_detail;
  const Index hs = C / H, C3 = 3 * C, nb = T / block, bs = block;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  obs::add_macs(4.0 * macs(layout, B, H, nb, bs, hs));  // dp, dv, dq, dk: twice the forward's products
  const ProfileRegion region("sparse_attention_backward");
  // dk and dv accumulate over query blocks: start from zero
  Kokkos::parallel_for("sparse_zero_dkv", range(B * T), KOKKOS_LAMBDA(Index bt) {
    for (Index c = C; c < C3; ++c) dqkv[bt * C3 + c] = 0.0f;
  });
  std::vector<float> kp(T * hs), vp(T * hs), dp(bs * T), dkp(T * hs), dvp(T * hs), dropped(dropout.on() ? bs * T : 0);
  std::vector<Index> blocks;
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const float* q = qkv + b * T * C3 + h * hs;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* dq = dqkv + b * T * C3 + h * hs;
      float* dk = dq + C;
      float* dv = dq + 2 * C;
      const float* p = att + (b * H + h) * att_stride;  // advances panel by panel
      const float* dy = dout + b * T * C + h * hs;
      for (Index qb = 0; qb < nb; ++qb) {
        key_blocks(blocks, layout, h, nb, qb);
        const Index n = static_cast<Index>(blocks.size()) * bs, r0 = qb * bs;
        if (n == 0) {  // no key, no gradient (see the forward)
          Kokkos::parallel_for("sparse_no_key", range(bs * hs),
                               KOKKOS_LAMBDA(Index e) { dq[(r0 + e / hs) * C3 + e % hs] = 0.0f; });
          continue;
        }
        gather_rows(kp.data(), k, blocks, bs, hs, C3);
        gather_rows(vp.data(), v, blocks, bs, hs, C3);
        const float* pp = p;  // [bs, n], zero at the masked keys of the diagonal block
        p += bs * n;
        // dP = (dY · Vᵀ) ∘ M ; dV = (P ∘ M)ᵀ · dY
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bs, n, hs, 1.0f, dy + r0 * C, C, vp.data(), hs, 0.0f,
                    dp.data(), n);
        const float* pk = pp;
        if (dropout.on()) {
          drop_panel(dp.data(), dp.data(), n, blocks, dropout, b, h, r0, bs, T);
          drop_panel(dropped.data(), pp, n, blocks, dropout, b, h, r0, bs, T);
          pk = dropped.data();
        }
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, hs, bs, 1.0f, pk, n, dy + r0 * C, C, 0.0f,
                    dvp.data(), hs);
        // softmax backward: dS = P ⊙ (dP − Σ P·dP); masked entries have P = 0
        float* dsp = dp.data();
        Kokkos::parallel_for("sparse_softmax_backward", range(bs), KOKKOS_LAMBDA(Index i) {
          const float* pi = pp + i * n;
          float* ds = dsp + i * n;
          float dot = 0.0f;
          for (Index j = 0; j < n; ++j) dot += pi[j] * ds[j];
          for (Index j = 0; j < n; ++j) ds[j] = pi[j] * (ds[j] - dot);
        });
        // dQ = scale · dS · K ; dK = scale · dSᵀ · Q
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, bs, hs, n, scale, dp.data(), n, kp.data(), hs, 0.0f,
                    dq + r0 * C3, C3);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, hs, bs, scale, dp.data(), n, q + r0 * C3, C3, 0.0f,
                    dkp.data(), hs);
        scatter_add_rows(dk, dkp.data(), blocks, bs, hs, C3);
        scatter_add_rows(dv, dvp.data(), blocks, bs, hs, C3);
      }
    }
}

}  // namespace zero3d::kernels
