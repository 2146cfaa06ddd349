// attention_cached.hpp — generation's kernels: new tokens' keys and values written into a KV
// cache, their queries attending over it, and positions taken per token (learned embeddings,
// RoPE) where training's kernels take the token's place in its sequence.
//
// The cache holds, per layer, K and V as [B, Hkv, Tmax, d] (Hugging Face's past_key_values
// layout: a row's keys of one head contiguous). Generation runs rows left-padded to a common
// length: row b's first real token sits at slot start[b], so slot s holds position s − start[b].
// The n new tokens of a pass sit at slots slot0 .. slot0 + n − 1 of every row; a query at slot s
// sees keys j with start[b] <= j <= s and, with a window W > 0, s − j < W (the sliding window
// counts positions, which differ from slots by the same start[b]; transformers masking_utils:
// causal_mask_function and sliding_window_overlay). Padding slots are never attended, and a
// padding query (s < start[b]) attends to nothing and outputs zeros, which nothing reads.
//
// qkv[N, (H + 2·Hkv)·d] is the fused projection's output, a row per new token (GPT-2's c_attn is
// the case Hkv = H: q | k | v with head-major channels); query head h reads K/V head h / (H/Hkv)
// (repeat_kv). out[N, H·d] is head-major per token, what the output projection reads. Scores are
// scaled by 1/sqrt(d) (Vaswani et al. 2017; GPT-2's and LlamaAttention's scaling).
//
// round_bf16: q, k and v rounded to bf16 as they are read and cached, and the probabilities as
// P·V reads them, as GPT-2's bf16 attention does (attention_bf16.hpp packs q, k and v into bf16,
// the fused kernel multiplies bf16 exp(s − max) by V and divides by the fp32 sum after); scores,
// softmax sums and the P·V accumulation stay fp32.
//
// Every kernel is a portable Kokkos form: a team per (row, head, query) with its lanes over the
// keys (row_teams: a warp on a GPU, one lane on the CPU), no atomics, the same bits every run.
#pragma once

#include <cmath>

#include "kernels/common.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

KOKKOS_INLINE_FUNCTION float maybe_bf16(float x, bool round) { return round ? to_float(to_bf16(x)) : x; }

// out[N, C] += wpe[pos[i]] per token: GPT-2's learned position embedding at each token's own position.
template <typename P>
ZERO3D_KERNEL void add_position_embedding_at(float* out, const P* wpe, const int32_t* pos, Index N, Index C) {
  Kokkos::parallel_for("add_position_embedding_at", range(N * C), KOKKOS_LAMBDA(Index j) {
    out[j] += to_float(wpe[static_cast<Index>(pos[j / C]) * C + j % C]);
  });
}

// rope.hpp's rotation of q and k in qkv[N, (H + 2·Hkv)·d], token i at position pos[i] (cos and
// sin [Tmax, d/2], rope_tables' layout) rather than at its place in a sequence.
ZERO3D_KERNEL void rope_at_positions(float* qkv, const float* cos, const float* sin, const int32_t* pos, Index N,
                                     Index H, Index Hkv, Index head_dim, bool round_bf16 = false) {
  const Index half = head_dim / 2, heads = H + Hkv, width = (H + 2 * Hkv) * head_dim;
  Kokkos::parallel_for("rope_at_positions", range(N * heads * half), KOKKOS_LAMBDA(Index j) {
    const Index i = j % half, h = j / half % heads, tok = j / (half * heads), t = pos[tok];
    float* x = qkv + tok * width + h * head_dim;
    const float c = cos[t * half + i], s = sin[t * half + i];
    // round_bf16: q and k as bf16 training's q/k/v product hands them to rope (its readers round the result)
    const float x1 = maybe_bf16(x[i], round_bf16), x2 = maybe_bf16(x[i + half], round_bf16);
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  });
}

// K, V [B, Hkv, Tmax, d] at slots slot0 .. slot0 + n − 1 <- the k and v heads of qkv [B·n, (H + 2·Hkv)·d].
ZERO3D_KERNEL void kv_cache_write(float* K, float* V, const float* qkv, Index B, Index n, Index slot0, Index H, Index Hkv,
                                  Index d, Index Tmax, bool round_bf16) {
  const Index W = (H + 2 * Hkv) * d;
  Kokkos::parallel_for("kv_cache_write", range(B * Hkv * n * d), KOKKOS_LAMBDA(Index e) {
    const Index x = e % d, i = e / d % n, h = e / (d * n) % Hkv, b = e / (d * n * Hkv);
    const float* row = qkv + (b * n + i) * W;
    const Index at = ((b * Hkv + h) * Tmax + slot0 + i) * d + x;
    K[at] = maybe_bf16(row[(H + h) * d + x], round_bf16);
    V[at] = maybe_bf16(row[(H + Hkv + h) * d + x], round_bf16);
  });
}

// out[B·n, H·d] for the n new tokens of every row from their queries in qkv and the cache (which
// already holds their own keys and values). scores: B·H·n·(slot0 + n) floats of scratch.
ZERO3D_KERNEL void cached_attention(float* out, float* scores, const float* qkv, const float* K, const float* V,
                                    const int32_t* start, Index B, Index n, Index slot0, Index H, Index Hkv, Index d,
                                    Index Tmax, Index window, bool round_bf16) {
  const Index G = H / Hkv, W = (H + 2 * Hkv) * d, A = H * d, rows = B * H * n, S = slot0 + n;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  Kokkos::parallel_for("cached_attention", row_teams(rows), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index row = team_row(team);
    if (row >= rows) return;
    const Index i = row % n, h = row / n % H, b = row / (n * H), s = slot0 + i;
    const Index first = start[b], j0 = window > 0 && s - window + 1 > first ? s - window + 1 : first;
    const float* q = qkv + (b * n + i) * W + h * d;
    const float* k = K + (b * Hkv + h / G) * Tmax * d;
    const float* v = V + (b * Hkv + h / G) * Tmax * d;
    float* o = out + (b * n + i) * A + h * d;
    float* p = scores + row * S;
    if (j0 > s) {  // a padding query: nothing to see
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](Index x) { o[x] = 0.0f; });
      return;
    }
    const Index m = s + 1 - j0;
    float mx = -INFINITY;
    Kokkos::parallel_reduce(Kokkos::ThreadVectorRange(team, m), [&](Index kk, float& best) {
      const float* kj = k + (j0 + kk) * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (Index x = 0; x < d; ++x) dot += maybe_bf16(q[x], round_bf16) * kj[x];
      p[kk] = scale * dot;
      best = p[kk] > best ? p[kk] : best;
    }, Kokkos::Max<float>(mx));
    float sum = 0.0f;
    Kokkos::parallel_reduce(Kokkos::ThreadVectorRange(team, m), [&](Index kk, float& acc) {
      p[kk] = fast_exp(p[kk] - mx);
      acc += p[kk];
    }, sum);
    // fp32: probabilities normalised before P·V, as the fp32 forward's softmax keeps them; bf16:
    // exp(s − max) rounded to bf16 for P·V and the sum divided out after, as the fused bf16
    // kernel does (attention_flash_bf16.hpp, FlashAttention-2's epilogue)
    const float inv = 1.0f / sum;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, m), [&](Index kk) {
      p[kk] = round_bf16 ? to_float(to_bf16(p[kk])) : p[kk] * inv;
    });
    // o = Σ_j p_j·v_j, key by key: the lanes (and the CPU's vector registers) run along a row of v
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](Index x) { o[x] = 0.0f; });
    for (Index kk = 0; kk < m; ++kk) {
      const float pk = p[kk];
      const float* vj = v + (j0 + kk) * d;
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](Index x) { o[x] += pk * vj[x]; });
    }
    if (round_bf16) Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, d), [&](Index x) { o[x] *= inv; });
  });
}

// dst[B, C] <- row b's last new token src[(b·n + n − 1), :]: the head reads only the last position.
ZERO3D_KERNEL void last_positions(float* dst, const float* src, Index B, Index n, Index C) {
  Kokkos::parallel_for("last_positions", range(B * C), KOKKOS_LAMBDA(Index e) {
    const Index b = e / C, c = e % C;
    dst[e] = src[(b * n + n - 1) * C + c];
  });
}

}  // namespace zero3d::kernels
