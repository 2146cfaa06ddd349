// half.hpp — 16-bit floating-point storage types and their conversions.
//
// bf16 and fp16 are stored as raw 16 bits; arithmetic always happens in fp32 (the kernels
// load, compute in float, store). float -> 16 bits rounds to nearest, ties to even (RNE),
// as torch's .to(torch.bfloat16 / torch.float16) does; NaN stays NaN and values beyond the
// format's range become inf (which the loss scaler detects as overflow).
#pragma once

#include <cstdint>
#include <cstring>

#include "common.hpp"

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

// dst[i] = src[i]·scale (accumulate: dst[i] += src[i]·scale), computed in fp32 and stored
// in dst's type.
template <typename D, typename S>
inline void convert(D* dst, const S* src, Index n, float scale = 1.0f, bool accumulate = false) {
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

// dst[c·rows + r] = bf16(src[r·ld + c]) for r < rows, c < cols: an fp32 matrix rounded into
// its transpose (a product that reads an operand transposed runs ~12% faster on the plain
// layout, and the rounding pass is needed anyway). Square blocks keep both sides in cache.
inline void convert_transposed(bf16* dst, const float* src, Index rows, Index cols, Index ld) {
  constexpr Index kBlock = 32;
  const Index row_blocks = (rows + kBlock - 1) / kBlock, col_blocks = (cols + kBlock - 1) / kBlock;
  Kokkos::parallel_for("convert_transposed", range(row_blocks * col_blocks), KOKKOS_LAMBDA(Index blk) {
    const Index r0 = (blk / col_blocks) * kBlock, c0 = (blk % col_blocks) * kBlock;
    const Index r1 = r0 + kBlock < rows ? r0 + kBlock : rows, c1 = c0 + kBlock < cols ? c0 + kBlock : cols;
    for (Index c = c0; c < c1; ++c)
#pragma omp simd
      for (Index r = r0; r < r1; ++r) dst[c * rows + r] = to_bf16(src[r * ld + c]);
  });
}

// dst = bf16(src) for src[N, OC] (dense), and column_sums[o] += Σ_i src[i, o] when column_sums
// is not null: a linear layer's output gradient is rounded for its two products and summed for
// its bias gradient in one pass over memory. Parallel over column blocks (no two iterations
// share a sum); the rows are added in order, as accumulate_column_sums adds them.
inline void convert_summing_columns(bf16* dst, float* column_sums, const float* src, Index N, Index OC) {
  if (!column_sums) return convert(dst, src, N * OC);
  constexpr Index kBlock = 64;
  Kokkos::parallel_for("convert_summing_columns", range((OC + kBlock - 1) / kBlock), KOKKOS_LAMBDA(Index blk) {
    const Index o0 = blk * kBlock, width = o0 + kBlock < OC ? kBlock : OC - o0;
    float acc[kBlock] = {};
    for (Index i = 0; i < N; ++i) {
      const float* x = src + i * OC + o0;
      bf16* y = dst + i * OC + o0;
      if (width == kBlock) {
#pragma omp simd
        for (Index o = 0; o < kBlock; ++o) {
          acc[o] += x[o];
          y[o] = to_bf16(x[o]);
        }
      } else {
        for (Index o = 0; o < width; ++o) {
          acc[o] += x[o];
          y[o] = to_bf16(x[o]);
        }
      }
    }
    for (Index o = 0; o < width; ++o) column_sums[o0 + o] += acc[o];
  });
}

}  // namespace zero3d::kernels
