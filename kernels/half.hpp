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

}  // namespace zero3d::kernels
