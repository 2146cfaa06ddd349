// attention_bf16.hpp — causal self-attention with bf16 products (the BF16 compute dtype).
//
// Same contract as attention.hpp's fp32 kernels, computed in tiles: positions are cut into
// n tiles of TB (TB = ceil(T/n) <= kAttentionTile) and only the tiles on or below the
// diagonal are multiplied — a causal row tile i needs key tiles 0..i, about half the dense
// T×T work. Each tile product runs batched over every (batch, head) pair on dense operands,
// which is what lets oneDNN pick its brgemm kernels (strided views of qkv fall back to a path
// at half the speed). q, k and v are packed per tile in bf16, [tile][b·H + h][row][hs]; scores
// and every sum stay fp32, softmax runs in fp32 and keeps the probabilities as bf16 tiles
// in `att` (the products read them in bf16 anyway). Rows past T (T not a multiple of TB) are
// zero rows: their keys are in every real row's future, so they are masked like any other.
//
// att holds the tiles (i, j ≤ i) at tile index i(i+1)/2 + j, each [B·H][TB][TB] bf16: at most
// T(T+TB)/2 bf16 per (batch, head), inside the B·H·T·T floats the fp32 kernel uses.
#pragma once

#include <algorithm>
#include <cmath>

#include "common.hpp"
#include "fastmath.hpp"
#include "gemm.hpp"
#include "half.hpp"
#include "profiler.hpp"

namespace zero3d::kernels {

constexpr Index kAttentionTile = 64;

// The tiling of T positions: n tiles of TB rows, Tp = n·TB >= T.
struct AttentionTiles {
  Index n, TB, Tp;
  explicit AttentionTiles(Index T)
      : n((T + kAttentionTile - 1) / kAttentionTile), TB((T + n - 1) / n), Tp(n * ((T + n - 1) / n)) {}
  static Index pair(Index i, Index j) { return i * (i + 1) / 2 + j; }
};

// Scratch reused by every call (grown on first use, so a training step allocates nothing).
struct AttentionWorkspace {
  Kokkos::View<bf16*> q, k, v, dy, ds;
  Kokkos::View<float*> scores, dq, dk, dv;
  template <typename V>
  static auto* take(V& view, Index n) {
    if (static_cast<Index>(view.extent(0)) < n) view = V(Kokkos::view_alloc(Kokkos::WithoutInitializing, "attention_bf16"), n);
    return view.data();
  }
  int64_t bytes() const {
    return static_cast<int64_t>((q.extent(0) + k.extent(0) + v.extent(0) + dy.extent(0) + ds.extent(0)) * 2 +
                                (scores.extent(0) + dq.extent(0) + dk.extent(0) + dv.extent(0)) * 4);
  }
};
// Released by Kokkos::finalize (a View freed after it aborts the process).
inline AttentionWorkspace& attention_workspace() {
  static AttentionWorkspace* w = [] {
    static AttentionWorkspace workspace;
    Kokkos::push_finalize_hook([] { workspace = AttentionWorkspace{}; });
    return &workspace;
  }();
  return *w;
}

// part 0/1/2 (q, k, v) of qkv[B,T,3C] into tiles [n][B·H][TB][hs] of bf16; rows past T are zero.
// One iteration per (tile, batch·head) block, so the index arithmetic stays out of the rows.
inline void attention_pack(bf16* dst, const float* src, Index ld, Index B, Index T, Index H, Index hs,
                           const AttentionTiles& t) {
  const Index BH = B * H, TB = t.TB;
  Kokkos::parallel_for("attention_pack", range(t.n * BH), KOKKOS_LAMBDA(Index blk) {
    const Index bh = blk % BH, i = blk / BH, b = bh / H, h = bh % H;
    const Index rows = T - i * TB < TB ? T - i * TB : TB;
    bf16* d = dst + blk * TB * hs;
    const float* s = src + (b * T + i * TB) * ld + h * hs;
    for (Index r = 0; r < rows; ++r)
#pragma omp simd
      for (Index x = 0; x < hs; ++x) d[r * hs + x] = to_bf16(s[r * ld + x]);
    for (Index r = rows; r < TB; ++r)
      for (Index x = 0; x < hs; ++x) d[r * hs + x] = bf16{0};
  });
}

// Tiles [count][B·H][TB][hs] into dst[B,T,·] (row stride ld, head h at channels h·hs), rows
// past T dropped; first_tile: the tile index of src's first tile.
inline void attention_unpack(float* dst, Index ld, const float* src, Index first_tile, Index count, Index B, Index T,
                             Index H, Index hs, const AttentionTiles& t) {
  const Index BH = B * H, TB = t.TB;
  Kokkos::parallel_for("attention_unpack", range(count * BH), KOKKOS_LAMBDA(Index blk) {
    const Index bh = blk % BH, i = first_tile + blk / BH, b = bh / H, h = bh % H;
    const Index rows = T - i * TB < TB ? T - i * TB : TB;
    const float* s = src + blk * TB * hs;
    float* d = dst + (b * T + i * TB) * ld + h * hs;
    for (Index r = 0; r < rows; ++r)
#pragma omp simd
      for (Index x = 0; x < hs; ++x) d[r * ld + x] = s[r * hs + x];
  });
}

// Row-wise causal softmax of scale·S for row tile i of a head group: S holds the group's score
// tiles [j][G][TB][TB] for j = 0..i (fp32, overwritten with exp), P_ij goes to p + j·p_stride
// as bf16. Full-width loops with the diagonal tile's future keys masked: no ragged tails.
inline void attention_softmax_rows(bf16* p, Index p_stride, float* s, Index i, Index G, Index TB, float scale) {
  const Index sg = G * TB * TB;
  Kokkos::parallel_for("attention_softmax", range(G * TB), KOKKOS_LAMBDA(Index row) {
    const Index bh = row / TB, r = row % TB;
    float mx = -INFINITY;
    for (Index j = 0; j <= i; ++j) {
      const float* sr = s + j * sg + bh * TB * TB + r * TB;
      const Index last = j < i ? TB : r + 1;
#pragma omp simd reduction(max : mx)
      for (Index c = 0; c < TB; ++c) mx = c < last && sr[c] > mx ? sr[c] : mx;
    }
    const float shift = mx * scale;
    float sum = 0.0f;
    for (Index j = 0; j <= i; ++j) {
      float* sr = s + j * sg + bh * TB * TB + r * TB;
      const Index last = j < i ? TB : r + 1;
#pragma omp simd reduction(+ : sum)
      for (Index c = 0; c < TB; ++c) {
        const float e = c < last ? fast_exp(sr[c] * scale - shift) : 0.0f;
        sr[c] = e;
        sum += e;
      }
    }
    const float inv = 1.0f / sum;
    for (Index j = 0; j <= i; ++j) {
      const float* sr = s + j * sg + bh * TB * TB + r * TB;
      bf16* pr = p + j * p_stride + bh * TB * TB + r * TB;
#pragma omp simd
      for (Index c = 0; c < TB; ++c) pr[c] = to_bf16(sr[c] * inv);
    }
  });
}

// Softmax backward for row tile i of a head group, the score scale folded in:
// dS = scale · P ∘ (dP − Σ_c P·dP), written as bf16 tiles [j][G][TB][TB] (future keys zero).
inline void attention_softmax_backward_rows(bf16* ds, const bf16* p, Index p_stride, const float* dp, Index i, Index G,
                                            Index TB, float scale) {
  const Index sg = G * TB * TB;
  Kokkos::parallel_for("attention_softmax_backward", range(G * TB), KOKKOS_LAMBDA(Index row) {
    const Index bh = row / TB, r = row % TB;
    float dot = 0.0f;
    for (Index j = 0; j <= i; ++j) {
      const bf16* pr = p + j * p_stride + bh * TB * TB + r * TB;
      const float* dpr = dp + j * sg + bh * TB * TB + r * TB;
#pragma omp simd reduction(+ : dot)
      for (Index c = 0; c < TB; ++c) dot += to_float(pr[c]) * dpr[c];  // P is zero at future keys
    }
    for (Index j = 0; j <= i; ++j) {
      const bf16* pr = p + j * p_stride + bh * TB * TB + r * TB;
      const float* dpr = dp + j * sg + bh * TB * TB + r * TB;
      bf16* dsr = ds + j * sg + bh * TB * TB + r * TB;
#pragma omp simd
      for (Index c = 0; c < TB; ++c) dsr[c] = to_bf16(scale * to_float(pr[c]) * (dpr[c] - dot));
    }
  });
}

// Heads are processed kAttentionHeadGroup at a time, all row tiles of a group before the next:
// the group's q, k, v tiles and a row tile's scores (8 heads · (i+1) · 16 KB at TB = 64) stay in
// L2 between the products and the softmax.
constexpr Index kAttentionHeadGroup = 8;

inline void attention_forward_bf16(float* out, float* att, const float* qkv, Index B, Index T, Index C, Index H) {
  const Index hs = C / H, BH = B * H, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const AttentionTiles t(T);
  const Index TB = t.TB, tile_qkv = BH * TB * hs, tile_p = BH * TB * TB;
  const Index G0 = std::min(kAttentionHeadGroup, BH);
  AttentionWorkspace& w = attention_workspace();
  bf16* q = AttentionWorkspace::take(w.q, t.n * tile_qkv);
  bf16* k = AttentionWorkspace::take(w.k, t.n * tile_qkv);
  bf16* v = AttentionWorkspace::take(w.v, t.n * tile_qkv);
  float* s = AttentionWorkspace::take(w.scores, t.n * G0 * TB * TB);
  float* o = AttentionWorkspace::take(w.dq, t.n * tile_qkv);
  bf16* p = reinterpret_cast<bf16*>(att);
  attention_pack(q, qkv, C3, B, T, H, hs, t);
  attention_pack(k, qkv + C, C3, B, T, H, hs, t);
  attention_pack(v, qkv + 2 * C, C3, B, T, H, hs, t);
  for (Index g0 = 0; g0 < BH; g0 += G0) {
    const Index G = std::min(G0, BH - g0), sg = G * TB * TB, head = g0 * TB * hs;
    for (Index i = 0; i < t.n; ++i) {
      bf16* pi = p + AttentionTiles::pair(i, 0) * tile_p + g0 * TB * TB;
      // S_ij = Q_i · K_jᵀ for the key tiles 0..i; softmax; O_i = Σ_j P_ij · V_j
      for (Index j = 0; j <= i; ++j)
        gemm_batched_bf16(G, TB, TB, hs, q + i * tile_qkv + head, false, k + j * tile_qkv + head, true, s + j * sg, false);
      attention_softmax_rows(pi, tile_p, s, i, G, TB, scale);
      for (Index j = 0; j <= i; ++j)
        gemm_batched_bf16(G, TB, hs, TB, pi + j * tile_p, false, v + j * tile_qkv + head, false, o + i * tile_qkv + head,
                          j > 0);
    }
  }
  attention_unpack(out, C, o, 0, t.n, B, T, H, hs, t);
}

// dqkv written (all of it) from dout = d(out), the forward's qkv and bf16 probabilities in att.
inline void attention_backward_bf16(float* dqkv, const float* dout, const float* qkv, const float* att, Index B, Index T,
                                    Index C, Index H) {
  const Index hs = C / H, BH = B * H, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const AttentionTiles t(T);
  const Index TB = t.TB, tile_qkv = BH * TB * hs, tile_p = BH * TB * TB;
  const Index G0 = std::min(kAttentionHeadGroup, BH);
  AttentionWorkspace& w = attention_workspace();
  bf16* q = AttentionWorkspace::take(w.q, t.n * tile_qkv);
  bf16* k = AttentionWorkspace::take(w.k, t.n * tile_qkv);
  bf16* v = AttentionWorkspace::take(w.v, t.n * tile_qkv);
  bf16* dy = AttentionWorkspace::take(w.dy, t.n * tile_qkv);
  bf16* ds = AttentionWorkspace::take(w.ds, t.n * G0 * TB * TB);
  float* dp = AttentionWorkspace::take(w.scores, t.n * G0 * TB * TB);
  float* dq = AttentionWorkspace::take(w.dq, t.n * tile_qkv);
  float* dk = AttentionWorkspace::take(w.dk, t.n * tile_qkv);
  float* dv = AttentionWorkspace::take(w.dv, t.n * tile_qkv);
  const bf16* p = reinterpret_cast<const bf16*>(att);
  attention_pack(q, qkv, C3, B, T, H, hs, t);
  attention_pack(k, qkv + C, C3, B, T, H, hs, t);
  attention_pack(v, qkv + 2 * C, C3, B, T, H, hs, t);
  attention_pack(dy, dout, C, B, T, H, hs, t);
  for (Index g0 = 0; g0 < BH; g0 += G0) {
    const Index G = std::min(G0, BH - g0), sg = G * TB * TB, head = g0 * TB * hs;
    for (Index i = 0; i < t.n; ++i) {
      const bf16* pi = p + AttentionTiles::pair(i, 0) * tile_p + g0 * TB * TB;
      // dP_ij = dY_i · V_jᵀ, then dS
      for (Index j = 0; j <= i; ++j)
        gemm_batched_bf16(G, TB, TB, hs, dy + i * tile_qkv + head, false, v + j * tile_qkv + head, true, dp + j * sg,
                          false);
      attention_softmax_backward_rows(ds, pi, tile_p, dp, i, G, TB, scale);
      // dQ_i = Σ_j dS_ij · K_j ; dK_j += dS_ijᵀ · Q_i ; dV_j += P_ijᵀ · dY_i (tile j is first met at i = j)
      for (Index j = 0; j <= i; ++j) {
        float* dqi = dq + i * tile_qkv + head;
        gemm_batched_bf16(G, TB, hs, TB, ds + j * sg, false, k + j * tile_qkv + head, false, dqi, j > 0);
        gemm_batched_bf16(G, TB, hs, TB, ds + j * sg, true, q + i * tile_qkv + head, false, dk + j * tile_qkv + head,
                          i > j);
        gemm_batched_bf16(G, TB, hs, TB, pi + j * tile_p, true, dy + i * tile_qkv + head, false,
                          dv + j * tile_qkv + head, i > j);
      }
    }
  }
  attention_unpack(dqkv, C3, dq, 0, t.n, B, T, H, hs, t);
  attention_unpack(dqkv + C, C3, dk, 0, t.n, B, T, H, hs, t);
  attention_unpack(dqkv + 2 * C, C3, dv, 0, t.n, B, T, H, hs, t);
}

}  // namespace zero3d::kernels
