// fastmath.hpp — exp and tanh as plain arithmetic, so loops over them vectorise.
//
// libm's expf/tanhf are opaque calls that keep GELU and softmax loops scalar (GELU alone
// was a third of a gpt-small-cpu step). Cody-Waite reduction x = n·ln2 + r, |r| <= ln2/2,
// then a degree-6 polynomial for e^r and 2^n assembled in the exponent bits: max relative
// error ~2 ulp over the whole float range (tests/kernels/test_kernels.cpp checks it against std::exp).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/common.hpp"

namespace zero3d::kernels {

KOKKOS_INLINE_FUNCTION float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);  // keep 2^n a normal float
  // n = round(x / ln2) by the 1.5·2^23 trick: plain adds vectorise where floorf does not.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  // r = x - n·ln2 in two parts for accuracy (Cody-Waite)
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  // e^r on [-ln2/2, ln2/2]: Taylor to degree 6 in Horner form
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // Shifted as unsigned: a NaN x skips the clamps and converts to INT_MIN on x86, whose signed
  // shift UBSan reports; p is NaN then and so is the result, which the overflow check must see.
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#ifdef ZERO3D_AVX512
// fast_exp on 16 lanes: the same reduction and polynomial (fused multiply-adds, so the last bit
// may differ from the scalar form). NaN stays NaN: max/min return their second operand then.
inline __m512 fast_exp_x16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-87.3f), x));
  const __m512 shifter = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shifter), shifter);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}
#endif

#ifdef ZERO3D_AVX512
// 2^x on 16 lanes: x = n + f with n = round(x), |f| <= 1/2; 2^f by its Taylor polynomial of
// degree 6 (relative error below 2^-22, far inside the bf16 rounding the probabilities get), 2^n
// by vscalefps, which also takes x far below -126 to 0 and keeps NaN. 9 instructions where
// fast_exp_x16 takes 17: the softmax's exponentials are the bulk of its work.
inline __m512 exp2_x16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);  // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// tanh(u) = 1 - 2 / (e^{2u} + 1): exact limits ±1, absolute error ~1e-7.
KOKKOS_INLINE_FUNCTION float fast_tanh(float u) { return 1.0f - 2.0f / (fast_exp(2.0f * u) + 1.0f); }

}  // namespace zero3d::kernels
