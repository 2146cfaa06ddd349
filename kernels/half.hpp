// half.hpp — 16-bit floating-point storage types and their conversions.
//
// bf16 and fp16 are stored as raw 16 bits; arithmetic always happens in fp32 (the kernels
// load, compute in float, store). float -> 16 bits rounds to nearest, ties to even (RNE),
// as torch's .to(torch.bfloat16 / torch.float16) does; NaN stays NaN and values beyond the
// format's range become inf (which the loss scaler detects as overflow).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/common.hpp"
#include "kernels/device_forms.hpp"

namespace zero3d::kernels {

struct bf16 {
  uint16_t bits;
};
struct fp16 {
  uint16_t bits;
};

KOKKOS_INLINE_FUNCTION float to_float(float x) { return x; }

KOKKOS_INLINE_FUNCTION float to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// RNE on the upper 16 bits: add 0x7FFF plus the lowest kept bit, then truncate. A NaN is
// forced quiet so that rounding cannot turn it into inf.
KOKKOS_INLINE_FUNCTION bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  u += 0x7FFFu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// fp16 in integer arithmetic: exact (IEEE conversions are), with selects instead of branches so
// loops over fp16 data vectorise. Through _Float16 they did not: GCC 12 without AVX512-FP16
// converts one element at a time, which left every fp16 kernel scalar (LayerNorm 5x, the grad
// norm 30x slower than fp32: issue 17).
KOKKOS_INLINE_FUNCTION float to_float(fp16 x) {
  const uint32_t h = x.bits, em = h & 0x7FFFu, e = em >> 10;
  const uint32_t normal = (em << 13) + (112u << 23);        // rebias the exponent: 127 - 15
  const uint32_t special = (em << 13) | 0x7F800000u;        // inf, or NaN with its payload
  const float sub = static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f;  // m · 2^-24
  uint32_t sub_bits;
  std::memcpy(&sub_bits, &sub, 4);
  // selects as masks: written as ?: GCC keeps a branch here and the loops around stay scalar
  const uint32_t is_sub = 0u - static_cast<uint32_t>(e == 0), is_special = 0u - static_cast<uint32_t>(e == 31);
  const uint32_t u = (normal & ~(is_sub | is_special)) | (sub_bits & is_sub) | (special & is_special) |
                     ((h & 0x8000u) << 16);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, subnormals, overflow to inf, NaN to a quiet NaN (F. Giesen's
// float_to_half_fast3_rtne, exhaustively equal to the hardware conversion for non-NaN input).
KOKKOS_INLINE_FUNCTION fp16 to_fp16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint32_t overflow = u > 0x7F800000u ? 0x7E00u : 0x7C00u;  // >= 65536 (after rounding: inf), NaN
  // below 2^-14 the result is subnormal: adding 0.5 aligns the 10 mantissa bits at the bottom,
  // and the float addition rounds them to nearest even
  float a;
  std::memcpy(&a, &u, 4);
  a += 0.5f;
  uint32_t sub;
  std::memcpy(&sub, &a, 4);
  sub -= 0x3F000000u;
  const uint32_t normal = (u - (112u << 23) + 0xFFFu + ((u >> 13) & 1u)) >> 13;  // rebias, round half to even
  const uint32_t bits = u >= (143u << 23) ? overflow : u < (113u << 23) ? sub : normal;
  return fp16{static_cast<uint16_t>(bits | (sign >> 16))};
}

template <typename T>
KOKKOS_INLINE_FUNCTION T from_float(float f);
template <>
KOKKOS_INLINE_FUNCTION float from_float<float>(float f) { return f; }
template <>
KOKKOS_INLINE_FUNCTION bf16 from_float<bf16>(float f) { return to_bf16(f); }
template <>
KOKKOS_INLINE_FUNCTION fp16 from_float<fp16>(float f) { return to_fp16(f); }

namespace gpu {

// x[k] = float(p[k]) for k < W, and back: one vector access where W is kVec (p then 16-byte
// aligned, device_forms.hpp), element by element where W is 1.
template <int W, typename T>
KOKKOS_INLINE_FUNCTION void load_floats(float (&x)[W], const T* p) {
  if constexpr (W == kVec) {
    const Vec<T> v = load_vec(p);
    for (int k = 0; k < W; ++k) x[k] = to_float(v.v[k]);
  } else {
    for (int k = 0; k < W; ++k) x[k] = to_float(p[k]);
  }
}
template <int W, typename T>
KOKKOS_INLINE_FUNCTION void store_floats(T* p, const float (&x)[W]) {
  if constexpr (W == kVec) {
    Vec<T> v;
    for (int k = 0; k < W; ++k) v.v[k] = from_float<T>(x[k]);
    store_vec(p, v);
  } else {
    for (int k = 0; k < W; ++k) p[k] = from_float<T>(x[k]);
  }
}

// Σ term(x) over the n·W elements x of a row p, in the row's lanes (common.hpp row_teams), W a
// lane at a time; the lanes' sums added in the vector reduction's tree.
template <int W, typename T, typename Term>
KOKKOS_INLINE_FUNCTION float row_sum(const RowTeam& team, const T* p, Index n, Term term) {
  float s = 0.0f;
  Kokkos::parallel_reduce(
      Kokkos::ThreadVectorRange(team, n),
      [&](Index j, float& acc) {
        float x[W];
        load_floats(x, p + j * W);
        for (int k = 0; k < W; ++k) acc += term(x[k]);
      },
      s);
  return s;
}

// Stage 1 of a two-stage column sum over N rows and OC columns (device_forms.hpp), W columns a
// thread: row(e, i, acc) adds row i's W elements from flat index e = i·OC + o0 into acc (and does
// the element-wise work of those elements), rows in order, four rows' loads in flight.
template <int W, typename Row>
ZERO3D_KERNEL void column_chunk_pass(const char* label, float* partial, Index N, Index OC, Row row) {
  Kokkos::parallel_for(label, range(column_chunk_threads<W>(N, OC)), KOKKOS_LAMBDA(Index j) {
    const ColumnChunk<W> at(j, N, OC);
    float acc[W] = {};
    ZERO3D_UNROLL(4)
    for (Index i = at.i0; i < at.i1; ++i) row(i * OC + at.o0, i, acc);
    store_floats(partial + at.at, acc);
  });
}

// convert's device form: kVec elements a thread, by vectors where both pointers are 16-byte
// aligned (device_forms.hpp); each element's arithmetic is the portable form's.
template <typename D, typename S>
ZERO3D_KERNEL void convert(D* dst, const S* src, Index n, float scale, bool accumulate) {
  const bool vec = all_aligned16(dst, src);
  const char* label = accumulate ? "convert_accumulate" : scale == 1.0f ? "convert" : "convert_scale";
  Kokkos::parallel_for(label, vector_threads(n), KOKKOS_LAMBDA(Index p) {
    const Index i0 = p * kVec;
    if (vec && i0 + kVec <= n) {
      float x[kVec], y[kVec];
      load_floats(x, src + i0);
      if (accumulate) {
        load_floats(y, dst + i0);
        for (int k = 0; k < kVec; ++k) y[k] = y[k] + x[k] * scale;
      } else {
        for (int k = 0; k < kVec; ++k) y[k] = x[k] * scale;
      }
      store_floats(dst + i0, y);
    } else {
      for (Index i = i0; i < vector_end(i0, n); ++i)
        dst[i] = from_float<D>(accumulate ? to_float(dst[i]) + to_float(src[i]) * scale : to_float(src[i]) * scale);
    }
  });
}

}  // namespace gpu

#ifdef ZERO3D_AVX512
// fp16 <-> fp32 for convert(): the hardware's own conversions (AVX512F vcvtph2ps, and vcvtps2ph
// rounding to nearest even), 16 lanes an instruction where the integer forms above take a dozen
// operations a lane. The bits of to_float and to_fp16 except inside NaN (still NaN; tested).
inline __m512 load16_as_float(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16_as_float(const fp16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16_from_float(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16_from_float(fp16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// dst[i] = src[i]·scale (accumulate: dst[i] += src[i]·scale), computed in fp32 and stored
// in dst's type.
template <typename D, typename S>
ZERO3D_KERNEL void convert(D* dst, const S* src, Index n, float scale = 1.0f, bool accumulate = false) {
#ifdef ZERO3D_DEVICE
  return gpu::convert(dst, src, n, scale, accumulate);
#endif
#ifdef ZERO3D_AVX512
  constexpr bool fp16_pair = (std::is_same_v<D, float> && std::is_same_v<S, fp16>) ||
                             (std::is_same_v<D, fp16> && std::is_same_v<S, float>);
  if constexpr (fp16_pair) {
    if (scale == 1.0f) {  // (a scale keeps the portable loop: its contraction decides the bits)
      const ProfileRegion region(accumulate ? "convert_accumulate" : "convert");
      Index i = 0;
      for (; i + 16 <= n; i += 16) {
        const __m512 x = load16_as_float(src + i);
        store16_from_float(dst + i, accumulate ? _mm512_add_ps(load16_as_float(dst + i), x) : x);
      }
      for (; i < n; ++i) dst[i] = from_float<D>(accumulate ? to_float(dst[i]) + to_float(src[i]) : to_float(src[i]));
      return;
    }
  }
#endif
  if (accumulate)
    Kokkos::parallel_for("convert_accumulate", range(n), KOKKOS_LAMBDA(Index i) {
      dst[i] = from_float<D>(to_float(dst[i]) + to_float(src[i]) * scale);
    });
  else if (scale == 1.0f)
    Kokkos::parallel_for("convert", range(n), KOKKOS_LAMBDA(Index i) { dst[i] = from_float<D>(to_float(src[i])); });
  else
    Kokkos::parallel_for("convert_scale", range(n), KOKKOS_LAMBDA(Index i) {
      dst[i] = from_float<D>(to_float(src[i]) * scale);
    });
}

// dst[i] = T(a[i] + b[i]): the sum in fp32, rounded once (RNE), the arithmetic of NCCL's 16-bit
// sums, which the communicator's MPI operation and its rings both use. dst may alias a or b.
template <typename T>
inline void sum_rounded(T* dst, const T* a, const T* b, Index n) {
  Index i = 0;
#ifdef ZERO3D_AVX512
  if constexpr (std::is_same_v<T, fp16>)  // the hardware's conversions, the same bits (above)
    for (; i + 16 <= n; i += 16) store16_from_float(dst + i, _mm512_add_ps(load16_as_float(a + i), load16_as_float(b + i)));
#endif
  for (; i < n; ++i) dst[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

// A short parameter vector (a bias, a LayerNorm's weight) as fp32 for a kernel that reads it
// once per row: widened once here instead of N times there (fp16's widening is integer
// arithmetic; gpt-small's fp16 bias adds and LayerNorms took 1.5-1.8x their fp32 time).
// Exact, so the kernels' bits do not change. fp32 parameters are used where they lie.
// The CPU forms only: on a device a View per call would be a cudaMalloc and a synchronising
// cudaFree, so the device forms (LayerNorm, add_bias_rows) widen each value as they read it.
class WidenedParams {
 public:
  template <typename P>
  const float* operator()(const P* x, Index n) {
    if constexpr (std::is_same_v<P, float>) {
      return x;
    } else {
      if (!x) return nullptr;
      views_.emplace_back(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string("widened_params")), n);
      float* w = views_.back().data();
      convert(w, x, n);
      return w;
    }
  }

 private:
  std::vector<Kokkos::View<float*>> views_;
};

#ifdef ZERO3D_AVX512
// 16 floats rounded to bf16 exactly as to_bf16 rounds one (RNE, NaN kept and made quiet).
inline __m256i to_bf16_x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                               _mm512_set1_epi32(0x7F800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

// 16 lanes of bf16 (n of them; the rest read as 0) widened to fp32.
inline __m512 load_bf16_x16(const bf16* p, __mmask16 n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(n, p)), 16));
}
// 16 lanes rounded to bf16 (RNE): the CPU's own conversion where it has one, as the fused
// attention uses (one instruction where to_bf16_x16 takes nine; it differs from to_bf16 only
// in flushing fp32 subnormals, below 1.2e-38, to zero).
inline __m256i round_bf16_x16(__m512 x) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  return to_bf16_x16(x);
#endif
}

// A 16×16 block of src (row stride lds) rounded into dst transposed (row stride ldd): four
// unpack/shuffle stages in registers, so both sides move whole cache lines.
inline void convert_transposed_16x16(bf16* dst, Index ldd, const float* src, Index lds) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[4g + k], lane l: column 4l + k of rows 4g..4g+3
    const auto lo = [](__m512 a, __m512 b) {
      return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
    };
    const auto hi = [](__m512 a, __m512 b) {
      return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
    };
    r[i] = lo(t[i], t[i + 2]);
    r[i + 1] = hi(t[i], t[i + 2]);
    r[i + 2] = lo(t[i + 1], t[i + 3]);
    r[i + 3] = hi(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // gather lane l of the four row groups: column 4l + k
    const __m512 v = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), w = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD);
    const __m512 v2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88), w2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
    const __m512 cols[4] = {_mm512_shuffle_f32x4(v, v2, 0x88), _mm512_shuffle_f32x4(w, w2, 0x88),
                            _mm512_shuffle_f32x4(v, v2, 0xDD), _mm512_shuffle_f32x4(w, w2, 0xDD)};
    for (int l = 0; l < 4; ++l)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (4 * l + k) * ldd), to_bf16_x16(cols[l]));
  }
}
#endif

// dst[c·rows + r] = bf16(src[r·ld + c]) for r < rows, c < cols: an fp32 matrix rounded into
// its transpose (a product that reads an operand transposed runs ~12% faster on the plain
// layout, and the rounding pass is needed anyway). Square blocks keep both sides in cache.
ZERO3D_KERNEL void convert_transposed(bf16* dst, const float* src, Index rows, Index cols, Index ld) {
#ifdef ZERO3D_AVX512
  const ProfileRegion region("convert_transposed");
  const Index rows16 = rows / 16 * 16, cols16 = cols / 16 * 16;
  constexpr Index kBand = 256;  // rows per band (256-512 measured fastest at 2048 x 1536): fewer TLB misses than whole strips
  for (Index b0 = 0; b0 < rows16; b0 += kBand)
    for (Index c0 = 0; c0 < cols16; c0 += 16)
      for (Index r0 = b0; r0 < b0 + kBand && r0 < rows16; r0 += 16)
        convert_transposed_16x16(dst + c0 * rows + r0, rows, src + r0 * ld + c0, ld);
  for (Index c = 0; c < cols; ++c)  // the ragged edges
    for (Index r = c < cols16 ? rows16 : 0; r < rows; ++r) dst[c * rows + r] = to_bf16(src[r * ld + c]);
#else
  constexpr Index kBlock = 32;
  const Index row_blocks = (rows + kBlock - 1) / kBlock, col_blocks = (cols + kBlock - 1) / kBlock;
  Kokkos::parallel_for("convert_transposed", range(row_blocks * col_blocks), KOKKOS_LAMBDA(Index blk) {
    const Index r0 = (blk / col_blocks) * kBlock, c0 = (blk % col_blocks) * kBlock;
    const Index r1 = r0 + kBlock < rows ? r0 + kBlock : rows, c1 = c0 + kBlock < cols ? c0 + kBlock : cols;
    for (Index c = c0; c < c1; ++c)
#pragma omp simd
      for (Index r = r0; r < r1; ++r) dst[c * rows + r] = to_bf16(src[r * ld + c]);
  });
#endif
}

namespace gpu {

// column_sums[o] += Σ_i src[i, o] in two stages (device_forms.hpp), the first also rounding the
// elements it sums into dst where dst is not null: one pass.
template <int W>
ZERO3D_KERNEL void sum_columns(Width<W>, bf16* dst, float* partial, const float* src, Index N, Index OC,
                               const char* label) {
  column_chunk_pass<W>(label, partial, N, OC, KOKKOS_LAMBDA(Index e, Index, float(&acc)[W]) {
    float x[W];
    load_floats(x, src + e);
    for (int k = 0; k < W; ++k) acc[k] += x[k];
    if (dst) store_floats(dst + e, x);
  });
}
ZERO3D_KERNEL void sum_columns(bf16* dst, float* column_sums, const float* src, Index N, Index OC, const char* label) {
  const Index chunks = column_chunks(N);
  float* partial = kernel_scratch<float>(chunks * OC);
  if (vectorizable(OC, dst, src, partial)) sum_columns(Width<kVec>{}, dst, partial, src, N, OC, label);
  else sum_columns(Width<1>{}, dst, partial, src, N, OC, label);
  add_chunk_sums(column_sums, partial, chunks, OC);
}

ZERO3D_KERNEL void convert_summing_columns(bf16* dst, float* column_sums, const float* src, Index N, Index OC) {
  if (!column_sums) return kernels::convert(dst, src, N * OC);
  sum_columns(dst, column_sums, src, N, OC, "convert_summing_columns");
}

}  // namespace gpu

// dst = bf16(src) for src[N, OC] (dense), and column_sums[o] += Σ_i src[i, o] when column_sums
// is not null: a linear layer's output gradient is rounded for its two products and summed for
// its bias gradient in one pass over memory. Each column's rows are added in order into a
// fresh sum that then joins column_sums, as accumulate_column_sums adds them (same bits).
ZERO3D_KERNEL void convert_summing_columns(bf16* dst, float* column_sums, const float* src, Index N, Index OC) {
  if (!column_sums) return convert(dst, src, N * OC);
#if defined(ZERO3D_DEVICE)
  gpu::convert_summing_columns(dst, column_sums, src, N, OC);
#elif defined(ZERO3D_SERIAL_HOST)
  // one thread: stream the rows in memory order, the sums (OC floats) stay in L1
  const ProfileRegion region("convert_summing_columns");
  std::vector<float> acc(static_cast<size_t>(OC), 0.0f);
  float* a = acc.data();
  for (Index i = 0; i < N; ++i) {
    const float* x = src + i * OC;
    bf16* y = dst + i * OC;
#pragma omp simd
    for (Index o = 0; o < OC; ++o) {
      a[o] += x[o];
      y[o] = to_bf16(x[o]);
    }
  }
  for (Index o = 0; o < OC; ++o) column_sums[o] += a[o];
#else
  constexpr Index kBlock = 64;  // parallel over column blocks: no two iterations share a sum
  Kokkos::parallel_for("convert_summing_columns", range((OC + kBlock - 1) / kBlock), KOKKOS_LAMBDA(Index blk) {
    const Index o0 = blk * kBlock, width = o0 + kBlock < OC ? kBlock : OC - o0;
    float acc[kBlock] = {};
    for (Index i = 0; i < N; ++i)
      for (Index o = 0; o < width; ++o) {
        acc[o] += src[i * OC + o0 + o];
        dst[i * OC + o0 + o] = to_bf16(src[i * OC + o0 + o]);
      }
    for (Index o = 0; o < width; ++o) column_sums[o0 + o] += acc[o];
  });
#endif
}

}  // namespace zero3d::kernels
