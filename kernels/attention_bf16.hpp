// attention_bf16.hpp — causal self-attention with bf16 products (the BF16 compute dtype).
//
// Same contract as attention.hpp's fp32 kernels, computed in tiles: positions are cut into
// n tiles of TB (TB = ceil(T/n) <= attention_tile(T)) and only the tiles on or below the
// diagonal are multiplied — a causal row tile i needs key tiles 0..i, about half the dense
// T×T work. Each tile product runs batched over every (batch, head) pair on dense operands,
// which is what lets oneDNN pick its brgemm kernels (strided views of qkv fall back to a path
// at half the speed). q, k and v are packed per tile in bf16, [tile][b·H + h][row][hs]; scores
// and every sum stay fp32, softmax runs in fp32 and keeps the probabilities as bf16 tiles
// in `att` (the products read them in bf16 anyway). Rows past T (T not a multiple of TB) are
// zero rows: their keys are in every real row's future, so they are masked like any other. A GPU
// takes one tile of all T positions and makes its products in causal query blocks instead
// (AttentionProducts below).
//
// att holds the tiles (i, j ≤ i) at tile index i(i+1)/2 + j, each [B·H][TB][TB] bf16: at most
// T(T+TB)/2 bf16 per (batch, head), inside the B·H·T·T floats the fp32 kernel uses.
//
// attention_forward_bf16 / attention_backward_bf16 (the end of this file) run the fused kernel of
// attention_flash_bf16.hpp instead where it is built (AVX512-BF16) and att has room for what it
// keeps; ZERO3D_ATTENTION_KERNEL=tiled in the environment keeps this tiled kernel, for A/B
// benchmarks of the two in one binary (benchmarks/bf16_breakdown.sh).
//
// Attention dropout (attn_pdrop) runs the tiled kernel (the fused one carries no mask): att keeps
// the undropped bf16 probabilities, O = Σ_j (P_ij ∘ M_ij)·V_j, and the backward redraws M for
// dV = (P ∘ M)ᵀ·dY and dP ∘ M, as attention.hpp's fp32 kernels. M's bits are the fp32 kernels'
// (kernels/dropout.hpp, element (head·T + query)·T + key), so the two differ by bf16 rounding only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "base/profiler.hpp"
#include "kernels/attention_causal_blocks.hpp"
#include "kernels/common.hpp"
#include "kernels/cpu/attention_flash_bf16.hpp"
#include "kernels/cuda/attention_flash_bf16.hpp"  // (on a CPU build its sizes only: a GPU run's plan)
#include "kernels/device.hpp"
#include "kernels/device_forms.hpp"
#include "kernels/dropout.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/gemm.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

// Tiles of up to 64 positions, 128 past T = 512: longer sequences have many more tiles, and
// fewer, larger products pay less per call (GPT-2's T = 1024: attention 18% faster at 128).
inline Index attention_tile(Index T) { return T > 512 ? 128 : 64; }

// How the products cover the causal triangle. Tiles: a batched product per (query tile, key
// tile ≤ it) pair, on dense tile operands (which let oneDNN pick brgemm): a CPU's. CausalBlocks:
// one tile of all T positions, the products in causal query blocks (attention_causal_blocks.hpp):
// a GPU's, whose products want size and whose every call costs a launch (measured on an H100 at
// GPT-2 124M: 30 ms a layer in pair products of 128-tiles; the square's dense products, twice
// the causal work, were far faster).
enum class AttentionProducts { Tiles, CausalBlocks };
constexpr AttentionProducts attention_products(Backend backend) {
  return backend == Backend::Gpu ? AttentionProducts::CausalBlocks : AttentionProducts::Tiles;
}
constexpr AttentionProducts kAttentionProducts = attention_products(kBuildBackend);

// The tiling of T positions: n tiles of TB rows, Tp = n·TB >= T (one tile of T for CausalBlocks).
struct AttentionTiles {
  Index n, TB, Tp;
  explicit AttentionTiles(Index T, AttentionProducts how = kAttentionProducts)
      : AttentionTiles(T, how == AttentionProducts::CausalBlocks ? T : attention_tile(T), 0) {}
  static Index pair(Index i, Index j) { return i * (i + 1) / 2 + j; }

 private:
  AttentionTiles(Index T, Index tile, int) : n((T + tile - 1) / tile), TB((T + n - 1) / n), Tp(n * TB) {}
};

// Scratch reused by every call (grown on first use, so a training step allocates nothing).
struct AttentionWorkspace {
  Kokkos::View<bf16*> q, k, v, dy, ds, dropped;
  Kokkos::View<float*> scores, dq, dk, dv;
  template <typename V>
  static auto* take(V& view, Index n) {
    if (static_cast<Index>(view.extent(0)) < n) view = V(Kokkos::view_alloc(Kokkos::WithoutInitializing, "attention_bf16"), n);
    return view.data();
  }
  int64_t bytes() const {
    return static_cast<int64_t>((q.extent(0) + k.extent(0) + v.extent(0) + dy.extent(0) + ds.extent(0) + dropped.extent(0)) * 2 +
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

namespace gpu {

// The pack's device form: a thread per W elements of a row of a head (W = kVec where hs, ld and
// the pointers allow whole vectors, device_forms.hpp; a block per thread, as the CPU form takes,
// leaves a GPU with a few hundred busy threads).
template <int W, typename S>
ZERO3D_KERNEL void attention_pack(Width<W>, bf16* dst, const S* src, Index ld, Index g0, Index G, Index T, Index H,
                                  Index hs, const AttentionTiles& t) {
  const Index TB = t.TB;
  Kokkos::parallel_for("attention_pack", range(t.n * G * TB * hs / W), KOKKOS_LAMBDA(Index p) {
    const Index e = p * W, x = e % hs, r = (e / hs) % TB, blk = e / (hs * TB);
    const Index bh = g0 + blk % G, i = blk / G, b = bh / H, h = bh % H, row = i * TB + r;
    float v[W] = {};
    if (row < T) load_floats(v, src + (b * T + row) * ld + h * hs + x);
    store_floats(dst + e, v);
  });
}
template <typename S>
ZERO3D_KERNEL void attention_pack(bf16* dst, const S* src, Index ld, Index g0, Index G, Index T, Index H, Index hs,
                                  const AttentionTiles& t) {
  if (hs % kVec == 0 && vectorizable(ld, dst, src)) attention_pack(Width<kVec>{}, dst, src, ld, g0, G, T, H, hs, t);
  else attention_pack(Width<1>{}, dst, src, ld, g0, G, T, H, hs, t);
}

// The unpack's device form, as the pack's.
template <int W, typename O>
ZERO3D_KERNEL void attention_unpack(Width<W>, O* dst, Index ld, const float* src, Index g0, Index G, Index T, Index H,
                                    Index hs, const AttentionTiles& t) {
  const Index TB = t.TB;
  Kokkos::parallel_for("attention_unpack", range(t.n * G * TB * hs / W), KOKKOS_LAMBDA(Index p) {
    const Index e = p * W, x = e % hs, r = (e / hs) % TB, blk = e / (hs * TB);
    const Index bh = g0 + blk % G, i = blk / G, b = bh / H, h = bh % H, row = i * TB + r;
    if (row >= T) return;
    float v[W];
    load_floats(v, src + e);
    store_floats(dst + (b * T + row) * ld + h * hs + x, v);
  });
}
template <typename O>
ZERO3D_KERNEL void attention_unpack(O* dst, Index ld, const float* src, Index g0, Index G, Index T, Index H, Index hs,
                                    const AttentionTiles& t) {
  if (hs % kVec == 0 && vectorizable(ld, dst, src)) attention_unpack(Width<kVec>{}, dst, ld, src, g0, G, T, H, hs, t);
  else attention_unpack(Width<1>{}, dst, ld, src, g0, G, T, H, hs, t);
}

}  // namespace gpu

// One part (q, k or v) of qkv[B,T,3C] — or any [B,T,·] array with row stride ld and head h at
// channels h·hs — for the G heads g0.. (of the B·H (batch, head) pairs) into tiles
// [n][G][TB][hs] of bf16; rows past T are zero. One iteration per (tile, head) block.
template <typename S>
ZERO3D_KERNEL void attention_pack(bf16* dst, const S* src, Index ld, Index g0, Index G, Index T, Index H, Index hs,
                           const AttentionTiles& t) {
#ifdef ZERO3D_DEVICE
  gpu::attention_pack(dst, src, ld, g0, G, T, H, hs, t);
#else
  const Index TB = t.TB;
  Kokkos::parallel_for("attention_pack", range(t.n * G), KOKKOS_LAMBDA(Index blk) {
    const Index bh = g0 + blk % G, i = blk / G, b = bh / H, h = bh % H;
    const Index rows = T - i * TB < TB ? T - i * TB : TB;
    bf16* d = dst + blk * TB * hs;
    const S* s = src + (b * T + i * TB) * ld + h * hs;
    for (Index r = 0; r < rows; ++r)
#pragma omp simd
      for (Index x = 0; x < hs; ++x) d[r * hs + x] = to_bf16(to_float(s[r * ld + x]));
    for (Index r = rows; r < TB; ++r)
      for (Index x = 0; x < hs; ++x) d[r * hs + x] = bf16{0};
  });
#endif
}

// Tiles [n][G][TB][hs] of the heads g0.. back into dst[B,T,·] (row stride ld), rows past T dropped.
template <typename O>
ZERO3D_KERNEL void attention_unpack(O* dst, Index ld, const float* src, Index g0, Index G, Index T, Index H, Index hs,
                             const AttentionTiles& t) {
#ifdef ZERO3D_DEVICE
  gpu::attention_unpack(dst, ld, src, g0, G, T, H, hs, t);
#else
  const Index TB = t.TB;
  Kokkos::parallel_for("attention_unpack", range(t.n * G), KOKKOS_LAMBDA(Index blk) {
    const Index bh = g0 + blk % G, i = blk / G, b = bh / H, h = bh % H;
    const Index rows = T - i * TB < TB ? T - i * TB : TB;
    const float* s = src + blk * TB * hs;
    O* d = dst + (b * T + i * TB) * ld + h * hs;
    for (Index r = 0; r < rows; ++r)
#pragma omp simd
      for (Index x = 0; x < hs; ++x) d[r * ld + x] = from_float<O>(s[r * hs + x]);
  });
#endif
}

// Tiles j = 0..i of row tile i of the head group g0.. ([j][G][TB][TB], at src_stride and
// dst_stride apart): dst = src ∘ M, M the dense probabilities' mask at query i·TB + r, key
// j·TB + c of pair (b, h) = g0 + g (dropout.hpp). Padding rows and keys (past T) get 0: their
// probabilities meet only zero rows of dY. dst may be src.
template <typename D, typename S>
ZERO3D_KERNEL void attention_dropout_tiles(D* dst, Index dst_stride, const S* src, Index src_stride, DropoutMask m,
                                           Index i, Index g0, Index G, Index TB, Index T, Index H) {
#ifdef ZERO3D_DEVICE
  Kokkos::parallel_for("attention_dropout_tiles", range((i + 1) * G * TB * TB), KOKKOS_LAMBDA(Index e) {
    const Index c = e % TB, r = (e / TB) % TB, g = (e / (TB * TB)) % G, j = e / (G * TB * TB);
    const Index bh = g0 + g, row = i * TB + r, key = j * TB + c, at = g * TB * TB + r * TB + c;
    const float f = row < T && key < T
                        ? m.factor(m.stream(bh / H), static_cast<uint64_t>(((m.first_head + bh % H) * T + row) * T + key))
                        : 0.0f;
    dst[j * dst_stride + at] = from_float<D>(to_float(src[j * src_stride + at]) * f);
  });
#else
  // CPU: a row of one tile per iteration, the pair's stream once
  Kokkos::parallel_for("attention_dropout_tiles", range((i + 1) * G * TB), KOKKOS_LAMBDA(Index x) {
    const Index r = x % TB, g = (x / TB) % G, j = x / (G * TB);
    const Index bh = g0 + g, row = i * TB + r, at = g * TB * TB + r * TB;
    const uint64_t s = m.stream(bh / H), e0 = static_cast<uint64_t>(((m.first_head + bh % H) * T + row) * T + j * TB);
    for (Index c = 0; c < TB; ++c) {
      const float f = row < T && j * TB + c < T ? m.factor(s, e0 + static_cast<uint64_t>(c)) : 0.0f;
      dst[j * dst_stride + at + c] = from_float<D>(to_float(src[j * src_stride + at + c]) * f);
    }
  });
#endif
}

namespace gpu {

// The softmax's device form, a warp per row (row_teams), its lanes striding over the keys W at a
// time (kVec where TB and the pointers allow whole vectors, device_forms.hpp). Three passes over
// the row's scores: the max, the sum of exponentials, then P written from exponentials computed
// again, so S is read (the later passes mostly from cache) and never written back; and only the
// keys the row sees are read, its future keys written as zeros without a load. (The CPU forms
// keep the exponentials in S: a GPU's loads and stores, not its arithmetic, set the time.)
template <int W>
KOKKOS_INLINE_FUNCTION void attention_softmax_row(const RowTeam& team, bf16* p, Index p_stride, const float* s, Index sg,
                                                  Index i, Index TB, Index row, float scale) {
  const Index bh = row / TB, r = row % TB, seg = bh * TB * TB + r * TB;
  const auto seen = [&](Index j) { return j < i ? TB : r + 1; };  // the keys of tile j the row sees
  float mx = -INFINITY;
  for (Index j = 0; j <= i; ++j) {
    const float* sr = s + j * sg + seg;
    const Index last = seen(j);
    float m = -INFINITY;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, (last + W - 1) / W),
        [&](Index v, float& x) {
          float e[W];
          load_floats(e, sr + v * W);
          for (int k = 0; k < W; ++k)
            if (v * W + k < last && e[k] > x) x = e[k];
        },
        Kokkos::Max<float>(m));
    mx = m > mx ? m : mx;
  }
  const float shift = mx * scale;
  float sum = 0.0f;
  for (Index j = 0; j <= i; ++j) {
    const float* sr = s + j * sg + seg;
    const Index last = seen(j);
    float part = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, (last + W - 1) / W),
        [&](Index v, float& acc) {
          float e[W];
          load_floats(e, sr + v * W);
          for (int k = 0; k < W; ++k) acc += v * W + k < last ? fast_exp(e[k] * scale - shift) : 0.0f;
        },
        part);
    sum += part;
  }
  const float inv = 1.0f / sum;
  for (Index j = 0; j <= i; ++j) {
    const float* sr = s + j * sg + seg;
    bf16* pr = p + j * p_stride + seg;
    const Index last = seen(j);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, TB / W), [&](Index v) {
      float e[W] = {};
      if (v * W < last) {
        load_floats(e, sr + v * W);
        for (int k = 0; k < W; ++k) e[k] = v * W + k < last ? fast_exp(e[k] * scale - shift) * inv : 0.0f;
      }
      store_floats(pr + v * W, e);
    });
  }
}

ZERO3D_KERNEL void attention_softmax_rows(bf16* p, Index p_stride, float* s, Index i, Index G, Index TB, float scale) {
  const Index sg = G * TB * TB;
  const bool vec = vectorizable(TB, p, s) && p_stride % kVec == 0;
  Kokkos::parallel_for("attention_softmax", row_teams(G * TB), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index row = team_row(team);
    if (row >= G * TB) return;
    if (vec) attention_softmax_row<kVec>(team, p, p_stride, s, sg, i, TB, row, scale);
    else attention_softmax_row<1>(team, p, p_stride, s, sg, i, TB, row, scale);
  });
}

// The softmax backward's device form, as the forward's: the row's dot Σ P·dP over the keys it
// sees (P is zero at the others), then dS over them and zeros, without a load, past them.
template <int W>
KOKKOS_INLINE_FUNCTION void attention_softmax_backward_row(const RowTeam& team, bf16* ds, const bf16* p, Index p_stride,
                                                           const float* dp, Index sg, Index i, Index TB, Index row,
                                                           float scale) {
  const Index bh = row / TB, r = row % TB, seg = bh * TB * TB + r * TB;
  float dot = 0.0f;
  for (Index j = 0; j <= i; ++j) {
    const bf16* pr = p + j * p_stride + seg;
    const float* dpr = dp + j * sg + seg;
    const Index last = j < i ? TB : r + 1;
    float part = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, (last + W - 1) / W),
        [&](Index v, float& acc) {
          float pv[W], g[W];
          load_floats(pv, pr + v * W);
          load_floats(g, dpr + v * W);
          for (int k = 0; k < W; ++k) acc += v * W + k < last ? pv[k] * g[k] : 0.0f;
        },
        part);
    dot += part;
  }
  for (Index j = 0; j <= i; ++j) {
    const bf16* pr = p + j * p_stride + seg;
    const float* dpr = dp + j * sg + seg;
    bf16* dsr = ds + j * sg + seg;
    const Index last = j < i ? TB : r + 1;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, TB / W), [&](Index v) {
      float d[W] = {};
      if (v * W < last) {
        float pv[W];
        load_floats(pv, pr + v * W);
        load_floats(d, dpr + v * W);
        for (int k = 0; k < W; ++k) d[k] = v * W + k < last ? scale * pv[k] * (d[k] - dot) : 0.0f;
      }
      store_floats(dsr + v * W, d);
    });
  }
}

ZERO3D_KERNEL void attention_softmax_backward_rows(bf16* ds, const bf16* p, Index p_stride, const float* dp, Index i,
                                                   Index G, Index TB, float scale) {
  const Index sg = G * TB * TB;
  const bool vec = vectorizable(TB, ds, p, dp) && p_stride % kVec == 0;
  Kokkos::parallel_for("attention_softmax_backward", row_teams(G * TB), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index row = team_row(team);
    if (row >= G * TB) return;
    if (vec) attention_softmax_backward_row<kVec>(team, ds, p, p_stride, dp, sg, i, TB, row, scale);
    else attention_softmax_backward_row<1>(team, ds, p, p_stride, dp, sg, i, TB, row, scale);
  });
}

}  // namespace gpu

// Row-wise causal softmax of scale·S for row tile i of a head group: S holds the group's score
// tiles [j][G][TB][TB] for j = 0..i (fp32; the CPU forms overwrite it with the exponentials, the
// device form leaves it), P_ij goes to p + j·p_stride as bf16. Full-width loops with the diagonal
// tile's future keys masked: no ragged tails.
ZERO3D_KERNEL void attention_softmax_rows(bf16* p, Index p_stride, float* s, Index i, Index G, Index TB, float scale) {
#ifdef ZERO3D_DEVICE
  gpu::attention_softmax_rows(p, p_stride, s, i, G, TB, scale);
#else
  const Index sg = G * TB * TB;
#ifdef ZERO3D_AVX512
  if (TB % 16 == 0) {  // vector registers carry the row's max and sum across its tiles
    const ProfileRegion region("attention_softmax");
    for (Index row = 0; row < G * TB; ++row) {
      const Index bh = row / TB, r = row % TB;
      const auto valid = [&](Index j, Index c) -> __mmask16 {  // keys up to r in the diagonal tile
        if (j < i || c + 16 <= r + 1) return 0xFFFF;
        return c > r ? 0 : static_cast<__mmask16>((1u << (r + 1 - c)) - 1);
      };
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      for (Index j = 0; j <= i; ++j) {
        const float* sr = s + j * sg + bh * TB * TB + r * TB;
        for (Index c = 0; c < TB; c += 16) vmax = _mm512_mask_max_ps(vmax, valid(j, c), vmax, _mm512_loadu_ps(sr + c));
      }
      const __m512 vscale = _mm512_set1_ps(scale), vshift = _mm512_set1_ps(_mm512_reduce_max_ps(vmax) * scale);
      __m512 vsum = _mm512_setzero_ps();
      for (Index j = 0; j <= i; ++j) {
        float* sr = s + j * sg + bh * TB * TB + r * TB;
        for (Index c = 0; c < TB; c += 16) {
          const __m512 e = _mm512_maskz_mov_ps(valid(j, c), fast_exp_x16(_mm512_fmsub_ps(_mm512_loadu_ps(sr + c), vscale, vshift)));
          _mm512_storeu_ps(sr + c, e);
          vsum = _mm512_add_ps(vsum, e);
        }
      }
      const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
      for (Index j = 0; j <= i; ++j) {
        const float* sr = s + j * sg + bh * TB * TB + r * TB;
        bf16* pr = p + j * p_stride + bh * TB * TB + r * TB;
        for (Index c = 0; c < TB; c += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c), to_bf16_x16(_mm512_mul_ps(_mm512_loadu_ps(sr + c), inv)));
      }
    }
    return;
  }
#endif
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
#endif
}

// Softmax backward for row tile i of a head group, the score scale folded in:
// dS = scale · P ∘ (dP − Σ_c P·dP), written as bf16 tiles [j][G][TB][TB] (future keys zero).
ZERO3D_KERNEL void attention_softmax_backward_rows(bf16* ds, const bf16* p, Index p_stride, const float* dp, Index i, Index G,
                                            Index TB, float scale) {
#ifdef ZERO3D_DEVICE
  gpu::attention_softmax_backward_rows(ds, p, p_stride, dp, i, G, TB, scale);
#else
  const Index sg = G * TB * TB;
#ifdef ZERO3D_AVX512
  if (TB % 16 == 0) {
    const ProfileRegion region("attention_softmax_backward");
    const auto widen = [](const bf16* x) {  // 16 bf16 -> fp32: the bits move up
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
    };
    for (Index row = 0; row < G * TB; ++row) {
      const Index bh = row / TB, r = row % TB;
      __m512 vdot = _mm512_setzero_ps();
      for (Index j = 0; j <= i; ++j) {
        const bf16* pr = p + j * p_stride + bh * TB * TB + r * TB;
        const float* dpr = dp + j * sg + bh * TB * TB + r * TB;
        for (Index c = 0; c < TB; c += 16) vdot = _mm512_fmadd_ps(widen(pr + c), _mm512_loadu_ps(dpr + c), vdot);
      }
      const __m512 dot = _mm512_set1_ps(_mm512_reduce_add_ps(vdot)), vscale = _mm512_set1_ps(scale);
      for (Index j = 0; j <= i; ++j) {
        const bf16* pr = p + j * p_stride + bh * TB * TB + r * TB;
        const float* dpr = dp + j * sg + bh * TB * TB + r * TB;
        bf16* dsr = ds + j * sg + bh * TB * TB + r * TB;
        for (Index c = 0; c < TB; c += 16) {
          const __m512 g = _mm512_mul_ps(_mm512_mul_ps(vscale, widen(pr + c)), _mm512_sub_ps(_mm512_loadu_ps(dpr + c), dot));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsr + c), to_bf16_x16(g));
        }
      }
    }
    return;
  }
#endif
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
#endif
}

// Heads are processed a group at a time, each group packed, multiplied and unpacked before the
// next, so its q, k, v tiles (G · T · hs · 6 bytes) stay near L2's 1 MiB from the packing
// through the products and the softmax: 8 heads at T = 256, 2 at T = 1024 (measured best at
// both; fewer heads per product cost more per call than the cache saves). A GPU takes every
// head at once: its products want size, and each small one costs a launch (measured on an H100:
// 2 heads at a time made GPT-2 124M's attention 1.3 s a layer).
inline Index attention_head_group(Index T, Index hs, Index BH, Backend backend = kBuildBackend) {
  if (backend == Backend::Gpu) return BH;
  const Index fits = (Index(1) << 20) / (T * hs * 6);
  return std::min(BH, fits < 2 ? Index(2) : fits > 8 ? Index(8) : fits);
}

template <typename O, typename Q>
inline void attention_forward_tiled_bf16(O* out, float* att, const Q* qkv, Index B, Index T, Index C, Index H,
                                         DropoutMask dropout = {}, AttentionProducts how = kAttentionProducts) {
  const Index hs = C / H, BH = B * H, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const AttentionTiles t(T, how);
  const bool blocks = how == AttentionProducts::CausalBlocks;
  const Index TB = t.TB, tile_p = BH * TB * TB, G0 = attention_head_group(T, hs, BH);
  AttentionWorkspace& w = attention_workspace();
  bf16* q = AttentionWorkspace::take(w.q, t.n * G0 * TB * hs);
  bf16* k = AttentionWorkspace::take(w.k, t.n * G0 * TB * hs);
  bf16* v = AttentionWorkspace::take(w.v, t.n * G0 * TB * hs);
  float* s = AttentionWorkspace::take(w.scores, t.n * G0 * TB * TB);
  float* o = AttentionWorkspace::take(w.dq, t.n * G0 * TB * hs);
  bf16* kept = dropout.on() ? AttentionWorkspace::take(w.dropped, t.n * G0 * TB * TB) : nullptr;  // P ∘ M, row tile i
  bf16* p = reinterpret_cast<bf16*>(att);
  for (Index g0 = 0; g0 < BH; g0 += G0) {
    const Index G = std::min(G0, BH - g0), tq = G * TB * hs, sg = G * TB * TB;
    const CausalProducts products(G, 1, T, hs);  // (blocks: the group's heads over one tile of T)
    attention_pack(q, qkv, C3, g0, G, T, H, hs, t);
    attention_pack(k, qkv + C, C3, g0, G, T, H, hs, t);
    attention_pack(v, qkv + 2 * C, C3, g0, G, T, H, hs, t);
    for (Index i = 0; i < t.n; ++i) {
      bf16* pi = p + AttentionTiles::pair(i, 0) * tile_p + g0 * TB * TB;
      // S_ij = Q_i · K_jᵀ for the key tiles 0..i; softmax; O_i = Σ_j P_ij · V_j (one tile of T:
      // a query block at a time, over the keys up to its end)
      if (blocks) {
        products.scores(s, q, k);
      } else {
        for (Index j = 0; j <= i; ++j)
          gemm_batched_bf16(G, TB, TB, hs, q + i * tq, false, k + j * tq, true, s + j * sg, false);
      }
      attention_softmax_rows(pi, tile_p, s, i, G, TB, scale);
      const bf16* pv = pi;
      Index pv_stride = tile_p;
      if (kept) {
        attention_dropout_tiles(kept, sg, pi, tile_p, dropout, i, g0, G, TB, T, H);
        pv = kept, pv_stride = sg;
      }
      if (blocks) {
        products.rows(o, pv, v);
      } else {
        for (Index j = 0; j <= i; ++j)
          gemm_batched_bf16(G, TB, hs, TB, pv + j * pv_stride, false, v + j * tq, false, o + i * tq, j > 0);
      }
    }
    attention_unpack(out, C, o, g0, G, T, H, hs, t);
  }
}

// dqkv written (all of it) from dout = d(out), the forward's qkv and bf16 probabilities in att.
template <typename Q>
inline void attention_backward_tiled_bf16(float* dqkv, const float* dout, const Q* qkv, const float* att, Index B,
                                          Index T, Index C, Index H, DropoutMask dropout = {},
                                          AttentionProducts how = kAttentionProducts) {
  const Index hs = C / H, BH = B * H, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const AttentionTiles t(T, how);
  const bool blocks = how == AttentionProducts::CausalBlocks;
  const Index TB = t.TB, tile_p = BH * TB * TB, G0 = attention_head_group(T, hs, BH);
  AttentionWorkspace& w = attention_workspace();
  bf16* q = AttentionWorkspace::take(w.q, t.n * G0 * TB * hs);
  bf16* k = AttentionWorkspace::take(w.k, t.n * G0 * TB * hs);
  bf16* v = AttentionWorkspace::take(w.v, t.n * G0 * TB * hs);
  bf16* dy = AttentionWorkspace::take(w.dy, t.n * G0 * TB * hs);
  bf16* ds = AttentionWorkspace::take(w.ds, t.n * G0 * TB * TB);
  float* dp = AttentionWorkspace::take(w.scores, t.n * G0 * TB * TB);
  float* dq = AttentionWorkspace::take(w.dq, t.n * G0 * TB * hs);
  float* dk = AttentionWorkspace::take(w.dk, t.n * G0 * TB * hs);
  float* dv = AttentionWorkspace::take(w.dv, t.n * G0 * TB * hs);
  bf16* kept = dropout.on() ? AttentionWorkspace::take(w.dropped, t.n * G0 * TB * TB) : nullptr;
  const bf16* p = reinterpret_cast<const bf16*>(att);
  for (Index g0 = 0; g0 < BH; g0 += G0) {
    const Index G = std::min(G0, BH - g0), tq = G * TB * hs, sg = G * TB * TB;
    const CausalProducts products(G, 1, T, hs);  // (blocks: the group's heads over one tile of T)
    attention_pack(q, qkv, C3, g0, G, T, H, hs, t);
    attention_pack(k, qkv + C, C3, g0, G, T, H, hs, t);
    attention_pack(v, qkv + 2 * C, C3, g0, G, T, H, hs, t);
    attention_pack(dy, dout, C, g0, G, T, H, hs, t);
    for (Index i = 0; i < t.n; ++i) {
      const bf16* pi = p + AttentionTiles::pair(i, 0) * tile_p + g0 * TB * TB;
      // dP_ij = (dY_i · V_jᵀ) ∘ M_ij, then dS (one tile of T: a query block at a time)
      if (blocks) {
#ifndef ZERO3D_DEVICE
        // The CPU form of the softmax backward multiplies dP past the diagonal by P's zeros, and the
        // blocks leave it unwritten there: zeros keep a stale NaN out (on a CPU only tests run this).
        Kokkos::deep_copy(Kokkos::View<float*, Kokkos::MemoryUnmanaged>(dp, sg), 0.0f);
#endif
        products.scores(dp, dy, v);
      } else {
        for (Index j = 0; j <= i; ++j)
          gemm_batched_bf16(G, TB, TB, hs, dy + i * tq, false, v + j * tq, true, dp + j * sg, false);
      }
      const bf16* pv = pi;  // P ∘ M for dV
      Index pv_stride = tile_p;
      if (kept) {
        attention_dropout_tiles(dp, sg, dp, sg, dropout, i, g0, G, TB, T, H);
        attention_dropout_tiles(kept, sg, pi, tile_p, dropout, i, g0, G, TB, T, H);
        pv = kept, pv_stride = sg;
      }
      attention_softmax_backward_rows(ds, pi, tile_p, dp, i, G, TB, scale);
      // dQ_i = Σ_j dS_ij · K_j ; dK_j += dS_ijᵀ · Q_i ; dV_j += P_ijᵀ · dY_i (tile j is first met at
      // i = j). One tile of T: dQ a query block at a time, dK and dV a key block at a time.
      if (blocks) {
        products.rows(dq, ds, k);
        products.keys(dk, ds, q);
        products.keys(dv, pv, dy);
      } else {
        for (Index j = 0; j <= i; ++j) {
          gemm_batched_bf16(G, TB, hs, TB, ds + j * sg, false, k + j * tq, false, dq + i * tq, j > 0);
          gemm_batched_bf16(G, TB, hs, TB, ds + j * sg, true, q + i * tq, false, dk + j * tq, i > j);
          gemm_batched_bf16(G, TB, hs, TB, pv + j * pv_stride, true, dy + i * tq, false, dv + j * tq, i > j);
        }
      }
    }
    attention_unpack(dqkv, C3, dq, g0, G, T, H, hs, t);
    attention_unpack(dqkv + C, C3, dk, g0, G, T, H, hs, t);
    attention_unpack(dqkv + 2 * C, C3, dv, g0, G, T, H, hs, t);
  }
}

// The bf16 attention the model runs: the fused kernel (attention_flash_bf16.hpp) where it is
// built and att has room for what it keeps, the tiled kernel above otherwise or under dropout.
// A forward and the backward that reads its att take the same branch (the shape and the mask,
// which the backward redraws). ZERO3D_ATTENTION_KERNEL=tiled keeps the tiled kernel. On a GPU the
// fused CUDA kernel (kernels/cuda/attention_flash_bf16.hpp) is chosen only by
// ZERO3D_ATTENTION_KERNEL=flash: its first form matched the host on an H200 but trained GPT-2 124M
// bf16 at 109,874 tokens/s against the dense tile's 165,200; its register-resident rewrite has
// run only in tests/cuda_sim's simulation so far. backend: the build asked about (a plan's).
inline bool attention_flash_chosen(Index BH, Index T, Index hs, const DropoutMask& dropout = {},
                                   Backend backend = kBuildBackend) {
  static const std::string kernel = [] {
    const char* e = std::getenv("ZERO3D_ATTENTION_KERNEL");
    return std::string(e ? e : "");
  }();
  if (backend == Backend::Gpu)
    return kernel == "flash" && !dropout.on() && cuda_flash::serves(hs) &&
           attention_flash_o_offset(BH, T) + (BH * T * hs + 1) / 2 <= BH * T * T;
  return kernel != "tiled" && !dropout.on() && attention_flash_fits(BH, T, hs);
}

// The floats of `att` the bf16 attention writes for B·H = BH heads: the fused kernel's log-sum-
// exp and bf16 output (attention_flash_bf16.hpp), else the tiled kernel's bf16 probabilities, one
// TB×TB tile per (query tile, key tile ≤ it) pair and head. What the model allocates for it;
// dropout (attn_pdrop set): training passes run the tiled kernel, evaluation the fused one,
// room for either.
inline Index attention_bf16_saved_floats(Index BH, Index T, Index hs, bool dropout = false,
                                         Backend backend = kBuildBackend) {
  const AttentionTiles t(T, attention_products(backend));
  const Index tiled = ((AttentionTiles::pair(t.n - 1, t.n - 1) + 1) * BH * t.TB * t.TB + 1) / 2;
  if (attention_flash_chosen(BH, T, hs, {}, backend)) {
    const Index fused = attention_flash_o_offset(BH, T) + (BH * T * hs + 1) / 2;
    return dropout ? std::max(fused, tiled) : fused;
  }
  return tiled;
}

// The bytes the tiled kernels' workspace grows to for B·H = BH heads of size hs over T positions
// (attention_workspace()'s takes below, forward and backward): the q, k, v and dY tiles and dS in
// bf16, under dropout P ∘ M too; the scores (dP in the backward) and dQ (the forward's O), dK and
// dV in fp32. Where the fused kernel runs every pass (a training pass under dropout runs this
// one), 0 on a CPU and the CUDA kernel's D and bf16 dO on a GPU (cuda_flash::backward_scratch_bytes). A GPU
// takes every head in one tile of T: about 1.5 GB at GPT-2 124M's micro-batch 16, which the H200
// measured as the plan's shortfall (0.919 of the device's peak) before it counted it.
inline int64_t attention_bf16_workspace_bytes(Index BH, Index T, Index hs, bool dropout,
                                              Backend backend = kBuildBackend) {
  if (!dropout && attention_flash_chosen(BH, T, hs, {}, backend))
    return backend == Backend::Gpu ? cuda_flash::backward_scratch_bytes(BH, T, hs) : 0;
  const AttentionTiles t(T, attention_products(backend));
  const int64_t rows = t.n * attention_head_group(T, hs, BH, backend) * t.TB, tiles = rows * hs, scores = rows * t.TB;
  return 2 * (4 * tiles + scores + (dropout ? scores : 0)) + 4 * (scores + 3 * tiles);
}

// Q: qkv's type — fp32, or bf16 when the c_attn product rounded its own output (the kernels
// round q, k and v to bf16 as they pack them, so both give the same bits).
template <typename O, typename Q>
inline void attention_forward_bf16(O* out, float* att, const Q* qkv, Index B, Index T, Index C, Index H,
                                   DropoutMask dropout = {}) {
#ifdef ZERO3D_FLASH_ATTENTION
  if (attention_flash_chosen(B * H, T, C / H, dropout)) return flash::forward(out, att, qkv, B, T, C, H);
#endif
#ifdef ZERO3D_DEVICE
  if (attention_flash_chosen(B * H, T, C / H, dropout)) {
    const ProfileRegion region("attention_forward");  // the kernel timer's row (its launches are no Kokkos kernel)
    return cuda_flash::forward(out, att, reinterpret_cast<bf16*>(att + attention_flash_o_offset(B * H, T)), qkv, B, T,
                               C, H);
  }
#endif
  attention_forward_tiled_bf16(out, att, qkv, B, T, C, H, dropout);
}

template <typename Q>
inline void attention_backward_bf16(float* dqkv, const float* dout, const Q* qkv, const float* att, Index B, Index T,
                                    Index C, Index H, DropoutMask dropout = {}) {
#ifdef ZERO3D_FLASH_ATTENTION
  if (attention_flash_chosen(B * H, T, C / H, dropout)) return flash::backward(dqkv, nullptr, dout, qkv, att, B, T, C, H);
#endif
#ifdef ZERO3D_DEVICE
  if (attention_flash_chosen(B * H, T, C / H, dropout)) {
    const ProfileRegion region("attention_backward");
    return cuda_flash::backward(dqkv, dout, qkv, att,
                                reinterpret_cast<const bf16*>(att + attention_flash_o_offset(B * H, T)), B, T, C, H);
  }
#endif
  attention_backward_tiled_bf16(dqkv, dout, qkv, att, B, T, C, H, dropout);
}

}  // namespace zero3d::kernels
