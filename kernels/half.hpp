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

// fp16 through the compiler's _Float16 (F16C vcvtps2ph/vcvtph2ps on x86: RNE, IEEE
// subnormals and overflow to inf).
KOKKOS_INLINE_FUNCTION float to_float(fp16 x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, 2);
  return static_cast<float>(h);
}

KOKKOS_INLINE_FUNCTION fp16 to_fp16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  fp16 out;
  std::memcpy(&out.bits, &h, 2);
  return out;
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
