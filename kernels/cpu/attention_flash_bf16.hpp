// attention_flash_bf16.hpp — fused causal self-attention in bf16 for CPUs with AVX512-BF16,
// in the manner of FlashAttention-2 (T. Dao, "FlashAttention-2: Faster Attention with Better
// Parallelism and Work Partitioning", 2023): the forward runs blocks of query rows against
// blocks of keys with an online softmax (a running row max m and sum l, the partial output
// rescaled by exp(m_old - m_new) when the max grows), so no T×T probability matrix is written;
// it keeps each row's log-sum-exp L = m·scale + log l and the fp32 output O. The backward
// recomputes each tile's probabilities P = exp(S·scale - L) from them, with D = rowsum(dO ∘ O)
// standing in for rowsum(P ∘ dP), and walks key blocks outermost as FlashAttention-2 does:
// dK and dV of a key block accumulate in L1 while dQ (kept transposed) accumulates per tile.
//
// Every product is a register-tiled AVX512-BF16 micro-kernel (vdpbf16ps, fp32 accumulation)
// over operands packed per (batch, head) into L1/L2-sized bf16 layouts, so there are no
// library calls per tile; causal masking is at 16-column granularity (only tiles that touch
// the diagonal carry masked lanes). Scores, softmax and every sum stay fp32; the products read
// bf16 q, k, v, dO, P and dS, as the tiled kernel in attention_bf16.hpp does.
//
// att holds, instead of probabilities: L [B·H][T] fp32, then (from attention_flash_o_offset) O
// [B·H][T][hs] in bf16 — about B·H·T·(1 + hs/2) floats, which fit in att's B·H·T·T unless T is
// below ~hs/2 (attention_flash_fits); the caller uses the tiled kernel otherwise.
//
// The same kernels serve grouped-query attention (attention_gqa.hpp's layout and mask, the
// Llama family): qkv rows of H query heads, then Hkv K heads, then Hkv V heads; query head h
// reads K/V head h / (H/Hkv) where it is packed, once per group, never copied per query head;
// the backward sums dK and dV over the group's query heads in head order (fixed, so the bits
// repeat). A sliding window W masks keys j <= i - W as well; the forward starts each query
// block at its first row's first key, the backward ends each key block at its last key's last
// query. GPT-2 is the case Hkv = H, W = 0 (flash::forward/backward with C and H).
//
// Attention dropout (the Llama family's attention_dropout; GPT-2's attn_pdrop still takes the
// tiled kernel) draws dropout.hpp's counter-based mask per tile, 16 elements at a time, the same
// elements dropout_probability_rows drops: the forward multiplies each tile's exponentials by the
// mask (the row sums stay undropped), the backward redraws it for dV = (P ∘ M)ᵀ·dO and dP ∘ M
// (FlashAttention-2's own dropout, with the stored mask replaced by the recomputed one). The
// backward can also fold rope's backward into dQ and dK (the Llama family's q and k are rotated
// after their product), so the q/k/v product gets its bf16 operand in one pass.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <type_traits>

#include "kernels/attention_window.hpp"  // gqa_first_key
#include "kernels/common.hpp"
#include "kernels/dropout.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/half.hpp"
#include "kernels/rope.hpp"  // RopeUnrotate: rope's backward folded into the Llama family's dqkv

// (AVX512-DQ: the dropout mask's 64-bit products; every CPU with AVX512-BF16 has it)
#if defined(ZERO3D_AVX512) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define ZERO3D_FLASH_ATTENTION 1
#endif

namespace zero3d::kernels {

// Whether attention_flash_forward/backward serve a shape: built with AVX512-BF16 (Serial
// execution space) and room for L and O in att.
inline Index attention_flash_o_offset(Index BH, Index T) { return (BH * T + 15) / 16 * 16; }
inline bool attention_flash_fits(Index BH, Index T, Index hs) {
#ifdef ZERO3D_FLASH_ATTENTION
  return attention_flash_o_offset(BH, T) + (BH * T * hs + 1) / 2 <= BH * T * T;
#else
  (void)BH;
  (void)T;
  (void)hs;
  return false;
#endif
}

#ifdef ZERO3D_FLASH_ATTENTION
namespace flash {

inline Index round_up(Index x, Index m) { return (x + m - 1) / m * m; }

// ---- the micro-kernel -------------------------------------------------------------------------
// C[R][16·NZ] (+)= Σ_p A[r][2p, 2p+1] · B[p][n][0, 1]: A row-major bf16 (row stride lda, pairs
// along the reduction), B in pair-interleaved ("VNNI") layout, pair p at B + p·ldb, column n
// at 2n. R·NZ accumulators in registers; A's pairs are broadcast from memory.
template <int R, int NZ, bool ACC>
inline void micro(const bf16* A, Index lda, const bf16* B, Index ldb, Index kp, float* C, Index ldc) {
  __m512 acc[R][NZ];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int z = 0; z < NZ; ++z) acc[r][z] = ACC ? _mm512_loadu_ps(C + r * ldc + 16 * z) : _mm512_setzero_ps();
  for (Index p = 0; p < kp; ++p) {
    __m512bh b[NZ];
#pragma GCC unroll 4
    for (int z = 0; z < NZ; ++z) b[z] = (__m512bh)_mm512_loadu_si512(B + p * ldb + 32 * z);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * p, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int z = 0; z < NZ; ++z) acc[r][z] = _mm512_dpbf16_ps(acc[r][z], a, b[z]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int z = 0; z < NZ; ++z) _mm512_storeu_ps(C + r * ldc + 16 * z, acc[r][z]);
}

template <int NZ, bool ACC>
inline void micro_rows(Index rows, const bf16* A, Index lda, const bf16* B, Index ldb, Index kp, float* C, Index ldc) {
  switch (rows) {
    case 8: return micro<8, NZ, ACC>(A, lda, B, ldb, kp, C, ldc);
    case 7: return micro<7, NZ, ACC>(A, lda, B, ldb, kp, C, ldc);
    case 6: return micro<6, NZ, ACC>(A, lda, B, ldb, kp, C, ldc);
    case 5: return micro<5, NZ, ACC>(A, lda, B, ldb, kp, C, ldc);
    case 4: return micro<4, NZ, ACC>(A, lda, B, ldb, kp, C, ldc);
    case 3: return micro<3, NZ, ACC>(A, lda, B, ldb, kp, C, ldc);
    case 2: return micro<2, NZ, ACC>(A, lda, B, ldb, kp, C, ldc);
    default: return micro<1, NZ, ACC>(A, lda, B, ldb, kp, C, ldc);
  }
}

template <bool ACC>
inline void mm(Index M, Index N, Index kp, const bf16* A, Index lda, const bf16* B, Index ldb, float* C, Index ldc) {
  for (Index m = 0; m < M; m += 8) {
    const Index rows = M - m < 8 ? M - m : 8;
    Index n = 0;
    for (; n + 32 <= N; n += 32) micro_rows<2, ACC>(rows, A + m * lda, lda, B + 2 * n, ldb, kp, C + m * ldc + n, ldc);
    if (n < N) micro_rows<1, ACC>(rows, A + m * lda, lda, B + 2 * n, ldb, kp, C + m * ldc + n, ldc);
  }
}

constexpr float kLog2e = 1.4426950408889634f;

// ---- packing ----------------------------------------------------------------------------------
// The first n of 16 lanes (n clamped to [0, 16]), without branches: a row's last key is data
// to the branch predictor, and each mispredicted mask cost a pipeline flush per row.
inline __mmask16 lanes_below(Index n) {
  const unsigned k = static_cast<unsigned>(n < 0 ? 0 : n > 16 ? 16 : n);
  return static_cast<__mmask16>(_bzhi_u32(0xFFFFu, k));
}

// 16 lanes of a row as fp32 (the first n; the rest 0): fp32 as stored, bf16 widened exactly,
// so packing either gives the same bf16 bits. A whole vector is a plain load: the AMD EPYC
// cores this was measured on run masked loads, the 16-bit ones above all, several times slower.
inline __m512 load_lanes(const float* p, Index n) { return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(lanes_below(n), p); }
inline __m512 load_lanes(const bf16* p, Index n) {
  return n >= 16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))
                 : load_bf16_x16(p, lanes_below(n));
}

// Whether row t of a packing is a straight copy: a bf16 source row inside T, whole 32-lane
// vectors, no padding to write.
template <typename S>
inline bool copies_whole_lanes(Index t, Index T, Index hs, Index hsp) {
  return std::is_same_v<S, bf16> && t < T && hs == hsp && hs % 32 == 0;
}

// Every head's rows at once: dst[h][Tp][hsp] = bf16(src[t·ld + h·hs + d]) (zeros past T and hs),
// reading src's rows front to back. Both passes pack a whole sequence this way (q, k and v as
// 3H heads of one qkv row) rather than gathering hs-wide slivers 3C apart per head: attention
// at gpt-small's shape, in a training step, forward 11.8 -> 10.6 ms, backward 24.2 -> 23.4 ms.
template <typename S>
inline void pack_heads(bf16* dst, const S* src, Index ld, Index T, Index H, Index hs, Index Tp, Index hsp) {
  for (Index t = 0; t < Tp; ++t)
    for (Index h = 0; h < H; ++h) {
      const S* row = src + t * ld + h * hs;
      bf16* out = dst + (h * Tp + t) * hsp;
      if (copies_whole_lanes<S>(t, T, hs, hsp)) {
        // bf16 already: a plain copy (attention 48.9 -> 35.5 ms per gpt-small step)
        for (Index d = 0; d < hs; d += 32) _mm512_storeu_si512(out + d, _mm512_loadu_si512(row + d));
        continue;
      }
      for (Index d = 0; d < hsp; d += 16) {
        const __m512 x = t < T ? load_lanes(row + d, hs - d) : _mm512_setzero_ps();
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), (__m256i)_mm512_cvtneps_pbh(x));
      }
    }
}

// Rows 2t and 2t+1 of a packed bf16 [Tp][hsp] interleaved into dst[Tp/2][hsp][2]: the pairs
// over positions that a product reducing over positions reads.
inline void row_pairs(bf16* dst, const bf16* src, Index Tp, Index hsp) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                      36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (Index t = 0; t < Tp; t += 2) {
    const bf16* a = src + t * hsp;
    Index d = 0;
    for (; d + 32 <= hsp; d += 32) {
      const __m512i x0 = _mm512_loadu_si512(a + d), x1 = _mm512_loadu_si512(a + hsp + d);
      _mm512_storeu_si512(dst + t * hsp + 2 * d, _mm512_permutex2var_epi16(x0, lo, x1));
      _mm512_storeu_si512(dst + t * hsp + 2 * d + 32, _mm512_permutex2var_epi16(x0, hi, x1));
    }
    for (; d < hsp; ++d) {
      dst[t * hsp + 2 * d] = a[d];
      dst[t * hsp + 2 * d + 1] = a[hsp + d];
    }
  }
}

// A 16×16 block of 32-bit elements transposed: dst[c·ldd + r] = src[r·lds + c] (strides in elements).
inline void transpose_16x16(float* dst, Index ldd, const float* src, Index lds) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  const auto lo = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  const auto hi = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  for (int i = 0; i < 16; i += 4) {
    r[i] = lo(t[i], t[i + 2]);
    r[i + 1] = hi(t[i], t[i + 2]);
    r[i + 2] = lo(t[i + 1], t[i + 3]);
    r[i + 3] = hi(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 v = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), w = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD);
    const __m512 v2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88), w2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
    const __m512 out[4] = {_mm512_shuffle_f32x4(v, v2, 0x88), _mm512_shuffle_f32x4(w, w2, 0x88),
                           _mm512_shuffle_f32x4(v, v2, 0xDD), _mm512_shuffle_f32x4(w, w2, 0xDD)};
    for (int l = 0; l < 4; ++l) _mm512_storeu_ps(dst + (4 * l + k) * ldd, out[l]);
  }
}

// dst[c][r] = src[r][c] for 32-bit elements (a pair of bf16 moves as one), r < rows, c < cols.
inline void transpose32(void* dstv, const void* srcv, Index rows, Index cols) {
  float* dst = static_cast<float*>(dstv);
  const float* src = static_cast<const float*>(srcv);
  const Index rows16 = rows / 16 * 16, cols16 = cols / 16 * 16;
  for (Index r0 = 0; r0 < rows16; r0 += 16)
    for (Index c0 = 0; c0 < cols16; c0 += 16) transpose_16x16(dst + c0 * rows + r0, rows, src + r0 * cols + c0, cols);
  for (Index c = 0; c < cols; ++c)
    for (Index r = c < cols16 ? rows16 : 0; r < rows; ++r) dst[c * rows + r] = src[r * cols + c];
}

// ---- scratch ----------------------------------------------------------------------------------
struct Scratch {
  void* p = nullptr;
  size_t bytes = 0;
  template <typename T>
  T* take(Index n) {
    const size_t want = static_cast<size_t>(n) * sizeof(T);
    if (want > bytes) {
      ::operator delete(p, std::align_val_t(64));
      p = ::operator new(want, std::align_val_t(64));
      bytes = want;
    }
    return static_cast<T*>(p);
  }
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { ::operator delete(p, std::align_val_t(64)); }
};
struct Workspace {
  Scratch b, c, d, e, f, g, tmp, dqt, dq, sums, rows, tiles, heads, group;
};
inline Workspace& workspace() {
  static Workspace w;
  return w;
}

// ---- attention dropout ------------------------------------------------------------------------
// The probabilities' mask of dropout.hpp, drawn 16 elements at a time: DropoutMask::factor's
// keep test on elements e0 + k·stride (k = 0..15) of a sample's stream, SplitMix64 in eight
// 64-bit lanes (AVX512-DQ products), so the fused kernel drops exactly the elements that
// dropout_probability_rows drops in the portable form.
struct DropoutDraw {
  const DropoutMask* mask = nullptr;  // null: no dropout
  uint64_t stream = 0;                // the sample's stream
  // element (query i, key j) of query head h (this rank's) is ((first_head + h)·T + i)·T + j
  uint64_t element(Index h, Index i, Index j, Index T) const {
    return static_cast<uint64_t>(((mask->first_head + h) * T + i) * T + j);
  }
};

inline __mmask8 keep_x8(__m512i e, uint64_t stream, uint32_t threshold) {
  const __m512i one = _mm512_set1_epi64(1);
  __m512i z = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(stream)),
                               _mm512_mullo_epi64(_mm512_add_epi64(e, one), _mm512_set1_epi64(0x9E3779B97F4A7C15ll)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(0xBF58476D1CE4E5B9ll));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(0x94D049BB133111EBll));
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
  return _mm512_cmpge_epu64_mask(_mm512_srli_epi64(z, 40), _mm512_set1_epi64(threshold));
}

// The keep lanes of elements e0 + k·stride, k = 0..15.
inline __mmask16 keep_x16(const DropoutDraw& d, uint64_t e0, uint64_t stride) {
  const __m512i k = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i lo = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(e0)),
                                      _mm512_mullo_epi64(k, _mm512_set1_epi64(static_cast<long long>(stride))));
  const __m512i hi = _mm512_add_epi64(lo, _mm512_set1_epi64(static_cast<long long>(8 * stride)));
  const uint32_t t = d.mask->threshold;
  return static_cast<__mmask16>(keep_x8(lo, d.stream, t) | (static_cast<unsigned>(keep_x8(hi, d.stream, t)) << 8));
}

// Block sizes: forward query rows per block and keys per online-softmax block (a multiple of
// it, so a query block's rows meet the same key blocks); backward keys per block and queries
// per tile. The tiles stay in L1, the packed operands of a head in L2.
constexpr Index kFwdQ = 32, kFwdK = 256, kBwdK = 32, kBwdQ = 64;

// The online softmax step for `rows` rows of scores s (row stride ld, nc columns of a key block;
// row r sees the block's keys up to column r + diag, and with a window from column
// gqa_first_key(r + diag + k0, window) − k0, k0 the block's first key): the running max m and sum l updated, the
// partial output o (row stride ldo) rescaled by exp(m_old - m_new), and P = exp(s - m_new) (in
// base 2, scale2 = scale·log2 e) written to p as bf16, zero past each row's last key. Each pass
// runs over all the rows before the next, so their dependency chains overlap.
// Under attention dropout (drop.mask set; row r's element for column c is e_row0 + r·T + c) p
// holds the kept exponentials times 1/(1 − p) and the dropped ones zero, while l sums them all
// undropped: O = (P ∘ M)·V with P normalised by the whole row, as the portable form computes.
inline void softmax_rows(const float* s, bf16* p, Index ld, float* m, float* l, float* o, Index ldo, Index rows, Index nc,
                         Index diag, Index k0, Index window, bool first, float scale2, const DropoutDraw& drop = {},
                         uint64_t e_row0 = 0, Index T = 0) {
  float mnew[8];
  // lanes c.. of row r that the row sees: below its last key, from its first (no lower bound without a window)
  const auto seen = [&](Index r, Index c) {
    const Index valid = std::min(nc, diag + r + 1), from = window > 0 ? gqa_first_key(diag + r + k0, window) - k0 : 0;
    return static_cast<__mmask16>(lanes_below(valid - c) & ~lanes_below(from - c));
  };
  for (Index r = 0; r < rows; ++r) {
    const float* sr = s + r * ld;
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (Index c = 0; c < nc; c += 16) vmax = _mm512_mask_max_ps(vmax, seen(r, c), vmax, _mm512_loadu_ps(sr + c));
    mnew[r] = _mm512_reduce_max_ps(vmax);
  }
  for (Index r = 0; r < rows; ++r) {
    const float* sr = s + r * ld;
    bf16* pr = p + r * ld;
    const float mx = first ? mnew[r] : std::max(m[r], mnew[r]);
    const __m512 vshift = _mm512_set1_ps(mx * scale2), vscale2 = _mm512_set1_ps(scale2);
    __m512 vsum = _mm512_setzero_ps();
    for (Index c = 0; c < nc; c += 16) {
      __m512 e =
          _mm512_maskz_mov_ps(seen(r, c), exp2_x16(_mm512_fmsub_ps(_mm512_loadu_ps(sr + c), vscale2, vshift)));
      vsum = _mm512_add_ps(vsum, e);
      if (drop.mask)
        e = _mm512_maskz_mul_ps(keep_x16(drop, e_row0 + static_cast<uint64_t>(r * T + c), 1), e,
                                _mm512_set1_ps(drop.mask->scale));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c), (__m256i)_mm512_cvtneps_pbh(e));
    }
    const float sum = _mm512_reduce_add_ps(vsum);
    if (first) {
      l[r] = sum;
    } else {
      const float alpha = std::exp2((m[r] - mx) * scale2);
      l[r] = l[r] * alpha + sum;
      const __m512 va = _mm512_set1_ps(alpha);
      for (Index d = 0; d < ldo; d += 16) _mm512_storeu_ps(o + r * ldo + d, _mm512_mul_ps(va, _mm512_loadu_ps(o + r * ldo + d)));
    }
    m[r] = mx;
  }
}

// The heads of a qkv row and what a query sees: H query heads, then Hkv K and Hkv V heads of hs
// values (query head h reads K/V head h / (H/Hkv)); window 0: causal, else also i − j < window.
struct Heads {
  Index H, Hkv, hs, window;
  Index group() const { return H / Hkv; }
  Index width() const { return (H + 2 * Hkv) * hs; }  // a qkv row
};

// ---- forward ----------------------------------------------------------------------------------
// out[B,T,H·hs] and att (L, O) from qkv[B,T,(H + 2·Hkv)·hs]. dropout: the probabilities'
// mask (dropout.hpp; off by default), L kept undropped as the portable form keeps P.
template <typename O, typename Q>
inline void forward(O* out, float* att, const Q* qkv, Index B, Index T, const Heads& a,
                    const DropoutMask& dropout = {}) {
  const Index H = a.H, Hkv = a.Hkv, hs = a.hs, G = a.group(), W = a.width(), A = H * hs, BH = B * H;
  const Index Tp = round_up(T, 16), hsp = round_up(hs, 16), hp = hsp / 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const float scale2 = scale * kLog2e;  // exponentials in base 2
  float* lse = att;
  bf16* osave = reinterpret_cast<bf16*>(att + attention_flash_o_offset(BH, T));
  Workspace& w = workspace();
  const bf16* qn = nullptr;              // Q rows [Tp][hsp] (in `heads` below)
  bf16* kv = w.b.take<bf16>(hsp * Tp);   // K pairs over hs [hsp/2][Tp][2]: the B operand of Q·Kᵀ
  bf16* vk = w.c.take<bf16>(Tp * hsp);   // V pairs over keys [Tp/2][hsp][2]: the B operand of P·V
  float* tiles = w.tiles.take<float>(kFwdQ * kFwdK + kFwdQ * kFwdK / 2 + kFwdQ * hsp + 2 * kFwdQ);
  float* s = tiles;                                              // scores [kFwdQ][kFwdK]
  bf16* p = reinterpret_cast<bf16*>(s + kFwdQ * kFwdK);          // probabilities [kFwdQ][kFwdK]
  float* o = s + kFwdQ * kFwdK + kFwdQ * kFwdK / 2;              // output [kFwdQ][hsp]
  float* m = o + kFwdQ * hsp;                                    // running max (raw scores)
  float* l = m + kFwdQ;                                          // running sum
  const Index head = Tp * hsp;
  bf16* heads = w.heads.take<bf16>((H + 2 * Hkv) * head);  // one sequence's Q, K and V, every head packed
  DropoutDraw drop;
  if (dropout.on()) drop.mask = &dropout;
  for (Index bh = 0; bh < BH; ++bh) {
    const Index b = bh / H, h = bh % H, g = h / G;
    if (drop.mask && h == 0) drop.stream = dropout.stream(b);
    // q, k and v as H + 2·Hkv heads of one row: each qkv row read whole, front to back
    if (h == 0) pack_heads(heads, qkv + b * T * W, W, T, H + 2 * Hkv, hs, Tp, hsp);
    qn = heads + h * head;
    if (h % G == 0) {  // the group's K/V head, laid out once for its G query heads
      transpose32(kv, heads + (H + g) * head, Tp, hp);
      row_pairs(vk, heads + (H + Hkv + g) * head, Tp, hsp);
    }
    for (Index q0 = 0; q0 < T; q0 += kFwdQ) {
      const Index nq = std::min(kFwdQ, T - q0), qend = q0 + nq;
      // from the 16-key group holding the block's first row's first key: within kFwdK of it lie
      // every row's first key, so each row meets one of its keys in the first key block
      const Index kstart = gqa_first_key(q0, a.window) / 16 * 16;
      for (Index r = 0; r < nq * hsp; ++r) o[r] = 0.0f;
      for (Index k0 = kstart; k0 < qend; k0 += kFwdK) {
        const bool first = k0 == kstart;
        for (Index rb = 0; rb < nq; rb += 8) {
          const Index rows = std::min<Index>(8, nq - rb);
          // keys k0.. up to the block's last row, in whole 16-column groups
          const Index nc = std::min(kFwdK, round_up(q0 + rb + rows, 16) - k0);
          mm<false>(rows, nc, hp, qn + (q0 + rb) * hsp, hsp, kv + 2 * k0, 2 * Tp, s + rb * kFwdK, kFwdK);
          softmax_rows(s + rb * kFwdK, p + rb * kFwdK, kFwdK, m + rb, l + rb, o + rb * hsp, hsp, rows, nc, q0 + rb - k0,
                       k0, a.window, first, scale2, drop, drop.mask ? drop.element(h, q0 + rb, k0, T) : 0, T);
          // O += P · V over the same keys
          mm<true>(rows, hsp, nc / 2, p + rb * kFwdK, kFwdK, vk + k0 * hsp, 2 * hsp, o + rb * hsp, hsp);
        }
      }
      for (Index r = 0; r < nq; ++r) {
        const Index t = q0 + r;
        const float inv = 1.0f / l[r];
        const float* orow = o + r * hsp;
        O* dst = out + (b * T + t) * A + h * hs;
        bf16* saved = osave + (bh * T + t) * hs;
#pragma omp simd
        for (Index d = 0; d < hs; ++d) {
          const float y = orow[d] * inv;
          saved[d] = to_bf16(y);
          dst[d] = from_float<O>(y);
        }
        lse[bh * T + t] = m[r] * scale + std::log(l[r]);
      }
    }
  }
}

// GPT-2's causal attention: qkv[B,T,3C], H heads of C/H, no window.
template <typename O, typename Q>
inline void forward(O* out, float* att, const Q* qkv, Index B, Index T, Index C, Index H) {
  forward(out, att, qkv, B, T, Heads{H, H, C / H, 0});
}

// One row of a gradient written as D (when out is set), its values added to the column sums
// (when sums is set).
template <typename D>
inline void write_row(D* out, float* sums, const float* x, Index n) {
  if (out) {
#pragma omp simd
    for (Index d = 0; d < n; ++d) out[d] = from_float<D>(x[d]);
  }
  if (sums) {
#pragma omp simd
    for (Index d = 0; d < n; ++d) sums[d] += x[d];
  }
}

// rope's backward on one fp32 head row of position t (rope.hpp's rope_pairs loop on one head).
inline void unrotate_row(float* x, const float* cos, const float* sin, Index t, Index hs) {
  const Index half = hs / 2;
  const float* c = cos + t * half;
  const float* s = sin + t * half;
#pragma omp simd
  for (Index i = 0; i < half; ++i) RopeUnrotate{}(x, i, half, c[i], s[i]);
}

// ---- backward ---------------------------------------------------------------------------------
// dqkv written (all of it) from dout, the forward's qkv and what the forward left in att. D: fp32,
// or bf16 for c_attn's products (rounded to nearest even, as converting the fp32 dqkv rounds);
// column_sums (nullable, 3C) then gets c_attn's bias gradient added: each column's fp32 values
// summed over the B·T rows in order into a fresh sum, as convert_summing_columns sums them (same
// bits), without writing and re-reading an fp32 dqkv.
// With groups (Hkv < H) each K/V head's dK and dV are summed over its query heads in fp32, head
// by head, before they are written.
// rope_cos/rope_sin (nullable, [T][hs/2]: rope.hpp's tables): q and k were rotated after their
// product, so each fp32 dQ and dK row gets rope's backward (RopeUnrotate, the same arithmetic as
// rope_backward on an fp32 dqkv) before it is rounded and summed: the q/k/v product's operand in
// one pass, without an fp32 dqkv written, rotated and rounded after.
template <typename D, typename Q>
// dropout: the forward's mask, redrawn per tile: dV = (P ∘ M)ᵀ·dO, dS = P ∘ (dP ∘ M − D), with
// D = rowsum(dO ∘ O) still rowsum(P ∘ dP ∘ M) as O is the dropped output.
inline void backward(D* dqkv, float* column_sums, const float* dout, const Q* qkv, const float* att, Index B, Index T,
                     const Heads& a, const float* rope_cos = nullptr, const float* rope_sin = nullptr,
                     const DropoutMask& dropout = {}) {
  const Index H = a.H, Hkv = a.Hkv, hs = a.hs, G = a.group(), W = a.width(), A = H * hs, BH = B * H;
  const Index Tp = round_up(T, 16), hsp = round_up(hs, 16), hp = hsp / 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const __m512 vscale = _mm512_set1_ps(scale), vscale2 = _mm512_set1_ps(scale * kLog2e);
  const float* lse = att;
  const bf16* osave = reinterpret_cast<const bf16*>(att + attention_flash_o_offset(BH, T));
  Workspace& w = workspace();
  const bf16* kn = nullptr;              // K rows: the A operand of S^T = K·Qᵀ (in `heads` below)
  const bf16* vn = nullptr;              // V rows: the A operand of dP^T = V·dOᵀ (likewise)
  bf16* qv = w.c.take<bf16>(hsp * Tp);   // Q pairs over hs [hsp/2][Tp][2]: the B operand of K·Qᵀ
  bf16* dov = w.d.take<bf16>(hsp * Tp);  // dO pairs over hs: the B operand of V·dOᵀ
  bf16* qq = w.e.take<bf16>(Tp * hsp);   // Q pairs over queries [Tp/2][hsp][2]: the B operand of dSᵀ·Q
  bf16* doq = w.f.take<bf16>(Tp * hsp);  // dO pairs over queries: the B operand of Pᵀ·dO
  bf16* kt = w.g.take<bf16>(hsp * Tp);   // Kᵀ rows [hsp][Tp], pairs over keys: the A operand of Kᵀ·dSᵀ
  bf16* pairs = w.tmp.take<bf16>(Tp * hsp);  // K pairs over keys, on the way to Kᵀ
  const bf16* tmp = nullptr;                  // dO rows (in `heads` below)
  float* dqt = w.dqt.take<float>(hsp * Tp);  // dQᵀ [hsp][Tp]
  float* rows = w.rows.take<float>(2 * Tp);
  float* dd = rows;        // D = rowsum(dO ∘ O)
  float* ll = rows + Tp;   // L
  constexpr Index tile = kBwdK * kBwdQ;
  float* st = w.tiles.take<float>(2 * tile + 3 * tile / 2 + 2 * kBwdK * hsp);
  float* dpt = st + tile;                                    // dPᵀ [kBwdK][kBwdQ]
  bf16* pt = reinterpret_cast<bf16*>(dpt + tile);            // Pᵀ bf16
  bf16* dst = pt + tile;                                     // dSᵀ bf16
  bf16* dstv = dst + tile;                                   // dSᵀ pairs over keys [kBwdK/2][kBwdQ][2]
  float* dka = dpt + tile + 3 * tile / 2;                    // dK [kBwdK][hsp]
  float* dva = dka + kBwdK * hsp;                            // dV [kBwdK][hsp]
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const Index head = Tp * hsp;
  bf16* heads = w.heads.take<bf16>((2 * H + 2 * Hkv) * head);  // one sequence's dO, Q, K and V, every head packed
  float* sums = column_sums ? w.sums.take<float>(W) : nullptr;  // the bias gradient's fresh sums
  if (sums) std::fill(sums, sums + W, 0.0f);
  float* dq = std::is_same_v<D, float> ? nullptr : w.dq.take<float>(Tp * hsp);  // dQ rows, on the way to bf16
  float* group = G > 1 ? w.group.take<float>(2 * Tp * hsp) : nullptr;  // a K/V head's dK and dV [Tp][hsp], summed
  DropoutDraw drop;
  if (dropout.on()) drop.mask = &dropout;
  const __m512 vkeep = _mm512_set1_ps(dropout.scale);
  for (Index bh = 0; bh < BH; ++bh) {
    const Index b = bh / H, h = bh % H, g = h / G;
    const bool group_first = h % G == 0, group_last = h % G == G - 1;
    if (drop.mask && h == 0) drop.stream = dropout.stream(b);
    // each input read once, in memory order: packed to bf16 rows, the other layouts made from those
    if (h == 0) {
      pack_heads(heads, dout + b * T * A, A, T, H, hs, Tp, hsp);
      // q, k and v as H + 2·Hkv heads of one row: each qkv row read whole, front to back
      pack_heads(heads + H * head, qkv + b * T * W, W, T, H + 2 * Hkv, hs, Tp, hsp);
    }
    tmp = heads + h * head;  // dO rows
    const bf16* qh = heads + (H + h) * head;
    kn = heads + (2 * H + g) * head;
    vn = heads + (2 * H + Hkv + g) * head;
    for (Index t = 0; t < Tp; ++t) {  // D from the bf16 dO and O (FlashAttention-2 reads both in bf16)
      float dot = 0.0f;
      if (t < T) {
        const bf16* y = osave + (bh * T + t) * hs;
        const bf16* g = tmp + t * hsp;
#pragma omp simd reduction(+ : dot)
        for (Index d = 0; d < hs; ++d) dot += to_float(g[d]) * to_float(y[d]);
      }
      dd[t] = dot;
      ll[t] = t < T ? lse[bh * T + t] * kLog2e : 0.0f;  // in base 2
    }
    transpose32(dov, tmp, Tp, hp);
    row_pairs(doq, tmp, Tp, hsp);
    transpose32(qv, qh, Tp, hp);
    row_pairs(qq, qh, Tp, hsp);
    if (group_first) {  // Kᵀ of the group's K/V head, once for its G query heads
      row_pairs(pairs, kn, Tp, hsp);
      transpose32(kt, pairs, Tp / 2, hsp);
    }
    std::memset(dqt, 0, sizeof(float) * hsp * Tp);
    for (Index k0 = 0; k0 < T; k0 += kBwdK) {
      const Index nk = std::min(kBwdK, Tp - k0);  // a multiple of 16
      // the block's keys are seen by queries up to its last key's last one: k0 + nk − 1 + window − 1
      const Index qend = a.window > 0 ? std::min(T, k0 + nk - 1 + a.window) : T;
      std::memset(dka, 0, sizeof(float) * 2 * kBwdK * hsp);
      for (Index q0 = k0 / kBwdQ * kBwdQ; q0 < qend; q0 += kBwdQ) {
        const Index nq = std::min(kBwdQ, Tp - q0);
        for (Index rb = 0; rb < nk; rb += 8) {
          const Index kr = k0 + rb;
          const Index cs = std::max<Index>(0, kr / 16 * 16 - q0);  // queries before key kr are all masked
          if (cs >= nq) continue;                                  // (and these rows' dSᵀ is never read)
          mm<false>(8, nq - cs, hp, kn + kr * hsp, hsp, qv + 2 * (q0 + cs), 2 * Tp, st + rb * kBwdQ + cs, kBwdQ);
          mm<false>(8, nq - cs, hp, vn + kr * hsp, hsp, dov + 2 * (q0 + cs), 2 * Tp, dpt + rb * kBwdQ + cs, kBwdQ);
          for (Index i = rb; i < rb + 8; i += 2) {
            bf16* vrow = dstv + (i / 2) * kBwdQ * 2;
            for (Index c = 0; c < cs; c += 16) _mm512_storeu_si512(vrow + 2 * c, _mm512_setzero_si512());
            for (Index c = cs; c < nq; c += 16) {
              const Index qb = q0 + c;
              const __m512i qi = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(qb)));
              const __mmask16 inside = _mm512_cmplt_epi32_mask(qi, _mm512_set1_epi32(static_cast<int>(T)));
              const __m512 lv = _mm512_loadu_ps(ll + qb), dv = _mm512_loadu_ps(dd + qb);
              __m512 pe[2], ge[2];
              for (int e = 0; e < 2; ++e) {
                const Index row = i + e;
                __mmask16 valid = inside & _mm512_cmpge_epi32_mask(qi, _mm512_set1_epi32(static_cast<int>(k0 + row)));
                if (a.window > 0)  // and query < key + window
                  valid &= _mm512_cmplt_epi32_mask(qi, _mm512_set1_epi32(static_cast<int>(k0 + row + a.window)));
                pe[e] = _mm512_maskz_mov_ps(valid, exp2_x16(_mm512_fmsub_ps(_mm512_loadu_ps(st + row * kBwdQ + c), vscale2, lv)));
                __m512 dp = _mm512_loadu_ps(dpt + row * kBwdQ + c);
                if (drop.mask) {  // queries qb.. of key k0 + row: elements T apart
                  const __mmask16 keep = keep_x16(drop, drop.element(h, qb, k0 + row, T), static_cast<uint64_t>(T));
                  dp = _mm512_maskz_mul_ps(keep, dp, vkeep);
                  ge[e] = _mm512_mul_ps(_mm512_mul_ps(pe[e], vscale), _mm512_sub_ps(dp, dv));
                  pe[e] = _mm512_maskz_mul_ps(keep, pe[e], vkeep);  // Pᵀ ∘ M for dV
                  continue;
                }
                ge[e] = _mm512_mul_ps(_mm512_mul_ps(pe[e], vscale), _mm512_sub_ps(dp, dv));
              }
              const __m512i p2 = (__m512i)_mm512_cvtne2ps_pbh(pe[1], pe[0]), g2 = (__m512i)_mm512_cvtne2ps_pbh(ge[1], ge[0]);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(pt + i * kBwdQ + c), _mm512_castsi512_si256(p2));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(pt + (i + 1) * kBwdQ + c), _mm512_extracti64x4_epi64(p2, 1));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * kBwdQ + c), _mm512_castsi512_si256(g2));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (i + 1) * kBwdQ + c), _mm512_extracti64x4_epi64(g2, 1));
              _mm512_storeu_si512(vrow + 2 * c, _mm512_permutexvar_epi16(interleave, g2));
            }
          }
          // dV += Pᵀ·dO and dK += dSᵀ·Q over this tile's queries from cs on
          mm<true>(8, hsp, (nq - cs) / 2, pt + rb * kBwdQ + cs, kBwdQ, doq + (q0 + cs) * hsp, 2 * hsp, dva + rb * hsp, hsp);
          mm<true>(8, hsp, (nq - cs) / 2, dst + rb * kBwdQ + cs, kBwdQ, qq + (q0 + cs) * hsp, 2 * hsp, dka + rb * hsp, hsp);
        }
        // dQᵀ += Kᵀ·dSᵀ, each 32-column group over the keys up to its last query
        for (Index c = 0; c < nq; c += 32) {
          const Index wd = std::min<Index>(32, nq - c);
          const Index kend = std::min(nk, q0 + c + wd - k0);
          if (kend > 0) mm<true>(hsp, wd, kend / 2, kt + k0, Tp, dstv + 2 * c, 2 * kBwdQ, dqt + q0 + c, Tp);
        }
      }
      const Index kc = (H + g) * hs, vc = (H + Hkv + g) * hs;  // the K/V head's columns
      for (Index r = 0; r < nk && k0 + r < T; ++r) {
        float* dk = dka + r * hsp;
        const float* dv = dva + r * hsp;
        if (G > 1) {  // this query head's part added to the group's sums (the first one starts them)
          float* gk = group + (k0 + r) * hsp;
          float* gv = group + (Tp + k0 + r) * hsp;
#pragma omp simd
          for (Index d = 0; d < hs; ++d) {
            gk[d] = group_first ? dk[d] : gk[d] + dk[d];
            gv[d] = group_first ? dv[d] : gv[d] + dv[d];
          }
          dk = gk, dv = gv;
        }
        if (!group_last) continue;
        if (rope_cos) unrotate_row(dk, rope_cos, rope_sin, k0 + r, hs);
        D* row = dqkv + (b * T + k0 + r) * W;
        write_row(row + kc, sums ? sums + kc : nullptr, dk, hs);
        write_row(row + vc, sums ? sums + vc : nullptr, dv, hs);
      }
    }
    // dQ = (dQᵀ)ᵀ
    D* gq = dqkv + b * T * W + h * hs;
    if constexpr (std::is_same_v<D, float>) {
      const Index T16 = T / 16 * 16, hs16 = hs / 16 * 16;
      for (Index t0 = 0; t0 < T16; t0 += 16)
        for (Index d0 = 0; d0 < hs16; d0 += 16) transpose_16x16(gq + t0 * W + d0, W, dqt + d0 * Tp + t0, Tp);
      for (Index t = 0; t < T; ++t)
        for (Index d = t < T16 ? hs16 : 0; d < hs; ++d) gq[t * W + d] = dqt[d * Tp + t];
      if (rope_cos)
        for (Index t = 0; t < T; ++t) unrotate_row(gq + t * W, rope_cos, rope_sin, t, hs);
      if (sums)
        for (Index t = 0; t < T; ++t) write_row<float>(nullptr, sums + h * hs, gq + t * W, hs);
    } else {
      transpose32(dq, dqt, hsp, Tp);
      for (Index t = 0; t < T; ++t) {
        if (rope_cos) unrotate_row(dq + t * hsp, rope_cos, rope_sin, t, hs);
        write_row(gq + t * W, sums ? sums + h * hs : nullptr, dq + t * hsp, hs);
      }
    }
  }
  if (sums)
    for (Index o = 0; o < W; ++o) column_sums[o] += sums[o];
}

// GPT-2's: qkv[B,T,3C], H heads of C/H, no window.
template <typename D, typename Q>
inline void backward(D* dqkv, float* column_sums, const float* dout, const Q* qkv, const float* att, Index B, Index T,
                     Index C, Index H) {
  backward(dqkv, column_sums, dout, qkv, att, B, T, Heads{H, H, C / H, 0});
}

}  // namespace flash
#endif

}  // namespace zero3d::kernels
