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
//
// The device form (namespace gpu, what a GPU build runs) reads the layout's index table in model
// memory (attention_sparse_table.hpp, built once per layout), gathers the panels of equal shape
// into model-memory workspace with Kokkos kernels, multiplies them batched over (batch, head,
// query block) through gemm_batched (cuBLASLt on a GPU), and does the softmax (a team per row),
// the dropout mask and the backward as Kokkos kernels, with no host vector or host product.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "base/profiler.hpp"
#include "kernels/common.hpp"
#include "kernels/dropout.hpp"
#include "kernels/attention_sparse_table.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/gemm.hpp"
#include "kernels/memory.hpp"

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

// The device form. A group of the table (pairs with n key blocks, N = n·bs panel columns) is one
// batch of B·count equal problems, problem i = b·count + m for sample b and member m: q [bs, hs],
// k and v [N, hs], scores [bs, N]. Products cover the whole panel; the softmax writes zeros at the
// causal mask inside the diagonal block, so P·V and the backward read only the causal part.
namespace gpu {

inline DeviceScratch& sparse_panel_scratch() { return static_scratch<5>("sparse_attention_panels"); }

// The workspace of the largest group's backward (two [bs, hs], two [N, hs] and two [bs, N] per
// problem), which the forward's fits in: one size for both, so it is sized once. (The memory plan
// sizes it from the groups alone: model/sparse_attention.hpp sparse_attention_model_bytes.)
inline Index sparse_panel_floats(const std::vector<SparseBlockTable::Group>& groups, Index bs, Index B, Index hs) {
  Index most = 0;
  for (const SparseBlockTable::Group& g : groups) {
    const Index N = g.blocks * bs;
    most = std::max(most, g.count * (2 * bs * hs + 2 * N * hs + 2 * bs * N));
  }
  return B * most;
}
inline Index sparse_panel_floats(const SparseBlockTable& t, Index B, Index hs) {
  return sparse_panel_floats(t.groups(), t.block(), B, hs);
}

// dst[i][r][x] = src[(b·T + qb·bs + r)·ld + c0 + h·hs + x] for the `count` members' query blocks.
ZERO3D_KERNEL void gather_query_blocks(float* dst, const float* src, Index ld, Index c0, const Index* members,
                                       Index count, Index B, Index T, Index bs, Index hs, Index nb) {
  Kokkos::parallel_for("sparse_gather_queries", range(B * count * bs * hs), KOKKOS_LAMBDA(Index e) {
    const Index x = e % hs, r = (e / hs) % bs, i = e / (hs * bs), p = members[i % count];
    dst[e] = src[((i / count) * T + (p % nb) * bs + r) * ld + c0 + (p / nb) * hs + x];
  });
}

// The reverse: dst's query-block rows written from the panels (each pair once, so no row twice).
ZERO3D_KERNEL void scatter_query_blocks(float* dst, Index ld, Index c0, const float* src, const Index* members,
                                        Index count, Index B, Index T, Index bs, Index hs, Index nb) {
  Kokkos::parallel_for("sparse_scatter_queries", range(B * count * bs * hs), KOKKOS_LAMBDA(Index e) {
    const Index x = e % hs, r = (e / hs) % bs, i = e / (hs * bs), p = members[i % count];
    dst[((i / count) * T + (p % nb) * bs + r) * ld + c0 + (p / nb) * hs + x] = src[e];
  });
}

// Query-block rows of pairs with no key block: zero (no key, no output and no gradient).
ZERO3D_KERNEL void zero_query_blocks(float* dst, Index ld, const Index* members, Index count, Index B, Index T,
                                     Index bs, Index hs, Index nb) {
  Kokkos::parallel_for("sparse_no_key", range(B * count * bs * hs), KOKKOS_LAMBDA(Index e) {
    const Index x = e % hs, r = (e / hs) % bs, i = e / (hs * bs), p = members[i % count];
    dst[((i / count) * T + (p % nb) * bs + r) * ld + (p / nb) * hs + x] = 0.0f;
  });
}

// k and v rows of each member's key blocks, kp and vp [i][N][hs] (panel row j·bs + r: row r of
// its j-th key block).
ZERO3D_KERNEL void gather_key_panels(float* kp, float* vp, const float* qkv, const Index* members, const Index* offsets,
                                     const Index* key_blocks, Index count, Index n, Index B, Index T, Index C, Index bs,
                                     Index hs, Index nb) {
  const Index N = n * bs;
  Kokkos::parallel_for("sparse_gather_keys", range(B * count * N * hs), KOKKOS_LAMBDA(Index e) {
    const Index x = e % hs, row = (e / hs) % N, i = e / (hs * N), p = members[i % count];
    const Index t = key_blocks[offsets[p] + row / bs] * bs + row % bs;
    const float* from = qkv + ((i / count) * T + t) * 3 * C + (p / nb) * hs + x;
    kp[e] = from[C];
    vp[e] = from[2 * C];
  });
}

// Where problem i's panel of probabilities sits in att: (b·H + h)·att_stride, then bs² per block
// of the head's earlier query blocks (the CPU form's layout, so either form's backward reads it).
KOKKOS_INLINE_FUNCTION Index panel_offset(Index b, Index p, const Index* offsets, Index H, Index nb, Index bs,
                                          Index att_stride) {
  return (b * H + p / nb) * att_stride + bs * bs * (offsets[p] - offsets[(p / nb) * nb]);
}

// Dropout's element for panel column j of query row ri: the dense kernel's (global key), so
// every layout draws the dense kernel's bits (kernels/dropout.hpp).
KOKKOS_INLINE_FUNCTION uint64_t probability_element(const DropoutMask& m, Index h, Index qb, Index ri, Index kb,
                                                    Index kr, Index T, Index bs) {
  return static_cast<uint64_t>(((m.first_head + h) * T + qb * bs + ri) * T + kb * bs + kr);
}

// s[B·count·bs][N] (scores) -> the causal softmax of scale·s: att's panels get it, and s gets it
// with the dropout mask applied (the P ∘ M that P·V reads). A team per row.
ZERO3D_KERNEL void sparse_softmax(float* s, float* att, Index att_stride, const Index* members, const Index* offsets,
                                  const Index* key_blocks, Index count, Index n, Index B, Index H, Index T, Index bs,
                                  Index nb, float scale, DropoutMask m) {
  const Index rows = B * count * bs, N = n * bs;
  Kokkos::parallel_for("sparse_causal_softmax", row_teams(rows), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index row = team_row(team);
    if (row >= rows) return;
    const Index ri = row % bs, i = row / bs, b = i / count, p = members[i % count], h = p / nb, qb = p % nb;
    const Index* kb = key_blocks + offsets[p];
    const Index valid = kb[n - 1] == qb ? N - bs + ri + 1 : N;  // keys after the query masked in the diagonal block
    float* x = s + row * N;
    float* prob = att + panel_offset(b, p, offsets, H, nb, bs, att_stride) + ri * N;
    float mx = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, valid), [&](Index j, float& v) { v = scale * x[j] > v ? scale * x[j] : v; },
        Kokkos::Max<float>(mx));
    float sum = 0.0f;
    Kokkos::parallel_reduce(Kokkos::ThreadVectorRange(team, valid), [&](Index j, float& acc) {
      const float e = fast_exp(scale * x[j] - mx);
      x[j] = e;
      acc += e;
    }, sum);
    const float inv = 1.0f / sum;
    const uint64_t stream = m.on() ? m.stream(b) : 0;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, N), [&](Index j) {
      const float pj = j < valid ? x[j] * inv : 0.0f;
      prob[j] = pj;
      x[j] = m.on() ? pj * m.factor(stream, probability_element(m, h, qb, ri, kb[j / bs], j % bs, T, bs)) : pj;
    });
  });
}

// pk[i][ri][j] = P ∘ M of att's panels (the probabilities dV = (P ∘ M)ᵀ·dY reads).
ZERO3D_KERNEL void gather_probabilities(float* pk, const float* att, Index att_stride, const Index* members,
                                        const Index* offsets, const Index* key_blocks, Index count, Index n, Index B,
                                        Index H, Index T, Index bs, Index nb, DropoutMask m) {
  const Index N = n * bs;
  Kokkos::parallel_for("sparse_gather_probabilities", range(B * count * bs * N), KOKKOS_LAMBDA(Index e) {
    const Index j = e % N, ri = (e / N) % bs, i = e / (N * bs), b = i / count, p = members[i % count];
    const float pj = att[panel_offset(b, p, offsets, H, nb, bs, att_stride) + ri * N + j];
    const Index kb = key_blocks[offsets[p] + j / bs];
    pk[e] = m.on() ? pj * m.factor(m.stream(b), probability_element(m, p / nb, p % nb, ri, kb, j % bs, T, bs)) : pj;
  });
}

// ds[B·count·bs][N] holds dP on entry; <- scale · P ⊙ (dP∘M − Σ_j P·(dP∘M)), P from att's panels
// (zero at the masked keys, so their gradient is zero). A team per row.
ZERO3D_KERNEL void sparse_softmax_backward(float* ds, const float* att, Index att_stride, const Index* members,
                                           const Index* offsets, const Index* key_blocks, Index count, Index n, Index B,
                                           Index H, Index T, Index bs, Index nb, float scale, DropoutMask m) {
  const Index rows = B * count * bs, N = n * bs;
  Kokkos::parallel_for("sparse_softmax_backward", row_teams(rows), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index row = team_row(team);
    if (row >= rows) return;
    const Index ri = row % bs, i = row / bs, b = i / count, p = members[i % count], h = p / nb, qb = p % nb;
    const Index* kb = key_blocks + offsets[p];
    const float* pr = att + panel_offset(b, p, offsets, H, nb, bs, att_stride) + ri * N;
    float* d = ds + row * N;
    const uint64_t stream = m.on() ? m.stream(b) : 0;
    float dot = 0.0f;
    Kokkos::parallel_reduce(Kokkos::ThreadVectorRange(team, N), [&](Index j, float& acc) {
      const float dm =
          m.on() ? d[j] * m.factor(stream, probability_element(m, h, qb, ri, kb[j / bs], j % bs, T, bs)) : d[j];
      d[j] = dm;
      acc += pr[j] * dm;
    }, dot);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, N), [&](Index j) { d[j] = scale * pr[j] * (d[j] - dot); });
  });
}

// dqkv's k and v rows += the group's key-panel gradients dkp, dvp [i][N][hs]: a thread per
// element of each (sample, target) adds the panel rows holding it in order (no atomics).
ZERO3D_KERNEL void add_key_panel_gradients(float* dqkv, const float* dkp, const float* dvp, const Index* target_ids,
                                           const Index* target_offsets, const Index* target_entries, Index targets,
                                           Index count, Index n, Index B, Index T, Index C, Index bs, Index hs,
                                           Index nb) {
  Kokkos::parallel_for("sparse_add_key_gradients", range(B * targets * bs * hs), KOKKOS_LAMBDA(Index e) {
    const Index x = e % hs, r = (e / hs) % bs, k = e / (hs * bs), b = k / targets, tg = k % targets;
    const Index id = target_ids[tg];
    float* dk = dqkv + (b * T + (id % nb) * bs + r) * 3 * C + C + (id / nb) * hs + x;
    float ak = dk[0], av = dk[C];
    for (Index q = target_offsets[tg]; q < target_offsets[tg + 1]; ++q) {
      const Index at = ((b * count * n + target_entries[q]) * bs + r) * hs + x;
      ak += dkp[at];
      av += dvp[at];
    }
    dk[0] = ak;
    dk[C] = av;
  });
}

ZERO3D_KERNEL void sparse_attention_forward(float* out, float* att, Index att_stride, const float* qkv,
                                            const SparseBlockTable& t, Index B, Index T, Index C, Index H,
                                            DropoutMask dropout = {}) {
  const Index hs = C / H, bs = t.block(), nb = t.blocks_per_row();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  obs::add_macs(2.0 * static_cast<double>(B * t.computed_blocks()) * static_cast<double>(bs * bs * hs));
  const ProfileRegion region("sparse_attention_forward");
  float* ws = sparse_panel_scratch().take<float>(sparse_panel_floats(t, B, hs));
  for (const SparseBlockTable::Group& g : t.groups()) {
    const Index n = g.blocks, N = n * bs, batch = B * g.count;
    const Index* members = t.members() + g.first;
    float *q = ws, *k = q + batch * bs * hs, *v = k + batch * N * hs, *s = v + batch * N * hs;
    gather_query_blocks(q, qkv, 3 * C, 0, members, g.count, B, T, bs, hs, nb);
    gather_key_panels(k, v, qkv, members, t.offsets(), t.key_blocks(), g.count, n, B, T, C, bs, hs, nb);
    gemm_batched(batch, bs, N, hs, q, false, k, true, s, false);  // S = Q·Kᵀ
    sparse_softmax(s, att, att_stride, members, t.offsets(), t.key_blocks(), g.count, n, B, H, T, bs, nb, scale,
                   dropout);
    gemm_batched(batch, bs, hs, N, s, false, v, false, q, false);  // Y = (P ∘ M)·V, into q's panels
    scatter_query_blocks(out, C, 0, q, members, g.count, B, T, bs, hs, nb);
  }
  if (t.empty_pairs() > 0)
    zero_query_blocks(out, C, t.members() + t.computing_pairs(), t.empty_pairs(), B, T, bs, hs, nb);
}

ZERO3D_KERNEL void sparse_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                                             Index att_stride, const SparseBlockTable& t, Index B, Index T, Index C,
                                             Index H, DropoutMask dropout = {}) {
  const Index hs = C / H, bs = t.block(), nb = t.blocks_per_row();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  obs::add_macs(4.0 * static_cast<double>(B * t.computed_blocks()) * static_cast<double>(bs * bs * hs));
  const ProfileRegion region("sparse_attention_backward");
  // dk and dv accumulate over the groups: start from zero
  Kokkos::parallel_for("sparse_zero_dkv", range(B * T * 2 * C), KOKKOS_LAMBDA(Index e) {
    dqkv[(e / (2 * C)) * 3 * C + C + e % (2 * C)] = 0.0f;
  });
  float* ws = sparse_panel_scratch().take<float>(sparse_panel_floats(t, B, hs));
  for (const SparseBlockTable::Group& g : t.groups()) {
    const Index n = g.blocks, N = n * bs, batch = B * g.count;
    const Index* members = t.members() + g.first;
    float *q = ws, *dy = q + batch * bs * hs, *k = dy + batch * bs * hs, *v = k + batch * N * hs;
    float *pk = v + batch * N * hs, *ds = pk + batch * bs * N;
    gather_query_blocks(q, qkv, 3 * C, 0, members, g.count, B, T, bs, hs, nb);
    gather_query_blocks(dy, dout, C, 0, members, g.count, B, T, bs, hs, nb);
    gather_key_panels(k, v, qkv, members, t.offsets(), t.key_blocks(), g.count, n, B, T, C, bs, hs, nb);
    gather_probabilities(pk, att, att_stride, members, t.offsets(), t.key_blocks(), g.count, n, B, H, T, bs, nb,
                         dropout);
    gemm_batched(batch, bs, N, hs, dy, false, v, true, ds, false);   // dP = dY·Vᵀ
    gemm_batched(batch, N, hs, bs, pk, true, dy, false, v, false);   // dV = (P ∘ M)ᵀ·dY, into v's panels
    sparse_softmax_backward(ds, att, att_stride, members, t.offsets(), t.key_blocks(), g.count, n, B, H, T, bs, nb,
                            scale, dropout);
    gemm_batched(batch, bs, hs, N, ds, false, k, false, dy, false);  // dQ = dS·K, into dy's panels
    gemm_batched(batch, N, hs, bs, ds, true, q, false, k, false);    // dK = dSᵀ·Q, into k's panels
    scatter_query_blocks(dqkv, 3 * C, 0, dy, members, g.count, B, T, bs, hs, nb);
    add_key_panel_gradients(dqkv, k, v, t.target_ids() + g.first_target, t.target_offsets() + g.first_target,
                            t.target_entries(), g.targets, g.count, n, B, T, C, bs, hs, nb);
  }
  if (t.empty_pairs() > 0)
    zero_query_blocks(dqkv, 3 * C, t.members() + t.computing_pairs(), t.empty_pairs(), B, T, bs, hs, nb);
}

}  // namespace gpu

// Tests only: a CPU build runs the device form through the dispatch below (a GPU build always
// does), so the CPU suite trains through it (tests/model/test_sparse_attention_device_form.cpp).
inline bool& sparse_attention_device_form_on_host() {
  static bool on = false;
  return on;
}

// The model's entry points: the layout's table; the device form on a GPU build, the CPU form
// (over the table's host layout) otherwise.
ZERO3D_KERNEL void sparse_attention_forward(float* out, float* att, Index att_stride, const float* qkv,
                                     const SparseBlockTable& t, Index B, Index T, Index C, Index H,
                                     DropoutMask dropout = {}) {
#ifndef ZERO3D_DEVICE
  if (!sparse_attention_device_form_on_host())
    return sparse_attention_forward(out, att, att_stride, qkv, t.layout(), t.block(), B, T, C, H, dropout);
#endif
  gpu::sparse_attention_forward(out, att, att_stride, qkv, t, B, T, C, H, dropout);
}

ZERO3D_KERNEL void sparse_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                                      Index att_stride, const SparseBlockTable& t, Index B, Index T, Index C, Index H,
                                      DropoutMask dropout = {}) {
#ifndef ZERO3D_DEVICE
  if (!sparse_attention_device_form_on_host())
    return sparse_attention_backward(dqkv, dout, qkv, att, att_stride, t.layout(), t.block(), B, T, C, H, dropout);
#endif
  gpu::sparse_attention_backward(dqkv, dout, qkv, att, att_stride, t, B, T, C, H, dropout);
}

}  // namespace zero3d::kernels
