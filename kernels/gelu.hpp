// gelu.hpp — GELU, tanh approximation (GPT-2's "gelu_new"):
// gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
#pragma once

#include <cmath>

#include "kernels/common.hpp"
#include "kernels/device_forms.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

KOKKOS_INLINE_FUNCTION float gelu(float x) {
  return 0.5f * x * (1.0f + fast_tanh(kGeluScale * (x + 0.044715f * x * x * x)));
}

KOKKOS_INLINE_FUNCTION float gelu_grad(float x, float dout) {
  const float u = kGeluScale * (x + 0.044715f * x * x * x);
  const float th = fast_tanh(u);
  const float sech2 = 1.0f - th * th;
  const float du = kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
  return (0.5f * (1.0f + th) + 0.5f * x * sech2 * du) * dout;
}

namespace gpu {

// kVec elements a thread, by vectors where the pointers are 16-byte aligned (device_forms.hpp):
// a thread per element kept 1.1 MB in flight on an H200, 1.6 TB/s. Each element's arithmetic is
// the portable form's.
template <typename O, typename I>
ZERO3D_KERNEL void gelu_forward(O* out, const I* inp, Index n) {
  const bool vec = all_aligned16(out, inp);
  Kokkos::parallel_for("gelu_forward", vector_threads(n), KOKKOS_LAMBDA(Index p) {
    const Index i0 = p * kVec;
    if (vec && i0 + kVec <= n) {
      float x[kVec];
      load_floats(x, inp + i0);
      for (int k = 0; k < kVec; ++k) x[k] = gelu(x[k]);
      store_floats(out + i0, x);
    } else {
      for (Index i = i0; i < vector_end(i0, n); ++i) out[i] = from_float<O>(gelu(to_float(inp[i])));
    }
  });
}

template <typename I>
ZERO3D_KERNEL void gelu_backward(float* dinp, const I* inp, const float* dout, Index n) {
  const bool vec = all_aligned16(dinp, inp, dout);
  Kokkos::parallel_for("gelu_backward", vector_threads(n), KOKKOS_LAMBDA(Index p) {
    const Index i0 = p * kVec;
    if (vec && i0 + kVec <= n) {
      float x[kVec], dy[kVec];
      load_floats(x, inp + i0);
      load_floats(dy, dout + i0);
      for (int k = 0; k < kVec; ++k) x[k] = gelu_grad(x[k], dy[k]);
      store_floats(dinp + i0, x);
    } else {
      for (Index i = i0; i < vector_end(i0, n); ++i) dinp[i] = gelu_grad(to_float(inp[i]), dout[i]);
    }
  });
}

}  // namespace gpu

// O: the output's type (bf16 when the output only feeds a bf16 product); I: the input's (bf16
// when the product before it wrote bf16, as PyTorch's autocast does).
template <typename O = float, typename I = float>
ZERO3D_KERNEL void gelu_forward(O* out, const I* inp, Index n) {
#ifdef ZERO3D_DEVICE
  gpu::gelu_forward(out, inp, n);
#else
  Kokkos::parallel_for("gelu_forward", range(n),
                       KOKKOS_LAMBDA(Index i) { out[i] = from_float<O>(gelu(to_float(inp[i]))); });
#endif
}

#ifdef ZERO3D_AVX512
// σ(2u), u = sqrt(2/π)(x + 0.044715x³): the tanh GELU is x·σ(2u), since 0.5(1 + tanh u) = σ(2u).
// One base-2 exponential and one division where the scalar form takes tanh through e^{2u}.
inline __m512 gelu_sigmoid_x16(__m512 x) {
  const __m512 x2 = _mm512_mul_ps(x, x);
  const __m512 inner = _mm512_fmadd_ps(x2, _mm512_set1_ps(0.044715f), _mm512_set1_ps(1.0f));
  const __m512 minus_2u_log2e = _mm512_mul_ps(_mm512_mul_ps(x, inner), _mm512_set1_ps(-2.0f * kGeluScale * 1.4426950408889634f));
  return _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), exp2_x16(minus_2u_log2e)));
}
// gelu'(x)·dout from s = σ(2u): 0.5(1 + tanh u) = s and 1 - tanh²u = 4s(1 - s).
inline __m512 gelu_grad_x16(__m512 x, __m512 dout) {
  const __m512 s = gelu_sigmoid_x16(x);
  const __m512 du = _mm512_mul_ps(_mm512_set1_ps(kGeluScale),
                                  _mm512_fmadd_ps(_mm512_mul_ps(x, x), _mm512_set1_ps(3.0f * 0.044715f), _mm512_set1_ps(1.0f)));
  const __m512 s1s = _mm512_mul_ps(s, _mm512_sub_ps(_mm512_set1_ps(1.0f), s));
  const __m512 g = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(2.0f), x), s1s), du, s);
  return _mm512_mul_ps(g, dout);
}

// The bf16-in, bf16-out GELU of the bf16 MLP (c_fc wrote bf16; c_proj reads bf16): 16 lanes at
// a time (the scalar loop's tanh kept it compute-bound at ~1.5 cycles an element).
// (Whole vectors use plain stores: a masked narrowing store is microcoded on Zen 4 and cost
// more than the arithmetic.)
inline void gelu_forward(bf16* out, const bf16* inp, Index n) {
  const ProfileRegion region("gelu_forward");
  Index i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = load_bf16_x16(inp + i, 0xFFFF);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), round_bf16_x16(_mm512_mul_ps(x, gelu_sigmoid_x16(x))));
  }
  for (; i < n; ++i) {
    const float x = to_float(inp[i]);
    out[i] = to_bf16(0.5f * x * (1.0f + fast_tanh(kGeluScale * (x + 0.044715f * x * x * x))));
  }
}
#endif

// dinp = gelu'(inp) * dout (written; dinp may be dout).
template <typename I = float>
ZERO3D_KERNEL void gelu_backward(float* dinp, const I* inp, const float* dout, Index n) {
#ifdef ZERO3D_DEVICE
  gpu::gelu_backward(dinp, inp, dout, n);
#else
  Kokkos::parallel_for("gelu_backward", range(n), KOKKOS_LAMBDA(Index i) { dinp[i] = gelu_grad(to_float(inp[i]), dout[i]); });
#endif
}

namespace gpu {

// Stage 1 of a two-stage column sum (device_forms.hpp) does the element-wise work of the
// elements it sums: a thread per (chunk of rows, W columns) writes its chunk's dinp and adds its
// unrounded values in row order; stage 2 adds the chunks. One pass over memory, no atomics.
template <int W>
ZERO3D_KERNEL void gelu_backward_summing_columns(Width<W>, bf16* dinp, float* partial, const bf16* inp,
                                                 const float* dout, Index N, Index OC) {
  column_chunk_pass<W>("gelu_backward", partial, N, OC, KOKKOS_LAMBDA(Index e, Index, float(&acc)[W]) {
    float x[W], dy[W];
    load_floats(x, inp + e);
    load_floats(dy, dout + e);
    for (int k = 0; k < W; ++k) {
      x[k] = gelu_grad(x[k], dy[k]);
      acc[k] += x[k];
    }
    store_floats(dinp + e, x);
  });
}
ZERO3D_KERNEL void gelu_backward_summing_columns(bf16* dinp, float* column_sums, const bf16* inp, const float* dout, Index N,
                                          Index OC) {
  const Index chunks = column_chunks(N);
  float* partial = kernel_scratch<float>(chunks * OC);
  if (vectorizable(OC, dinp, inp, dout, partial))
    gelu_backward_summing_columns(Width<kVec>{}, dinp, partial, inp, dout, N, OC);
  else
    gelu_backward_summing_columns(Width<1>{}, dinp, partial, inp, dout, N, OC);
  add_chunk_sums(column_sums, partial, chunks, OC);
}

}  // namespace gpu

// The same for a gradient whose readers are the next linear layer's two bf16 products and its
// bias gradient: dinp = bf16(gelu'(inp)·dout) for [N, OC], and column_sums[o] += Σ_i of the
// unrounded values, in one pass (no fp32 gradient written and read back). The sums add each
// column's rows in order into a fresh sum, as convert_summing_columns does (same bits).
ZERO3D_KERNEL void gelu_backward_summing_columns(bf16* dinp, float* column_sums, const bf16* inp, const float* dout, Index N,
                                          Index OC) {
#if defined(ZERO3D_DEVICE)
  gpu::gelu_backward_summing_columns(dinp, column_sums, inp, dout, N, OC);
#elif defined(ZERO3D_SERIAL_HOST)
  // one thread: stream the rows in memory order, the sums (OC floats) stay in L1; 16 lanes at a
  // time with AVX-512, the rest (or all, without it) one by one
  const ProfileRegion region("gelu_backward");
  std::vector<float> acc(static_cast<size_t>(OC), 0.0f);
  float* a = acc.data();
  for (Index i = 0; i < N; ++i) {
    const bf16* x = inp + i * OC;
    const float* dy = dout + i * OC;
    bf16* dx = dinp + i * OC;
    Index o = 0;
#ifdef ZERO3D_AVX512
    for (; o + 16 <= OC; o += 16) {
      const __m512 g = gelu_grad_x16(load_bf16_x16(x + o, 0xFFFF), _mm512_loadu_ps(dy + o));
      _mm512_storeu_ps(a + o, _mm512_add_ps(_mm512_loadu_ps(a + o), g));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dx + o), round_bf16_x16(g));
    }
#endif
#pragma omp simd
    for (Index r = o; r < OC; ++r) {
      const float g = gelu_grad(to_float(x[r]), dy[r]);
      a[r] += g;
      dx[r] = to_bf16(g);
    }
  }
  for (Index o = 0; o < OC; ++o) column_sums[o] += a[o];
#else
  constexpr Index kBlock = 64;  // parallel over column blocks: no two iterations share a sum
  Kokkos::parallel_for("gelu_backward", range((OC + kBlock - 1) / kBlock), KOKKOS_LAMBDA(Index blk) {
    const Index o0 = blk * kBlock, width = o0 + kBlock < OC ? kBlock : OC - o0;
    float acc[kBlock] = {};
    for (Index i = 0; i < N; ++i)
      for (Index o = 0; o < width; ++o) {
        const float g = gelu_grad(to_float(inp[i * OC + o0 + o]), dout[i * OC + o0 + o]);
        acc[o] += g;
        dinp[i * OC + o0 + o] = to_bf16(g);
      }
    for (Index o = 0; o < width; ++o) column_sums[o0 + o] += acc[o];
  });
#endif
}

// The same gradient kept in fp32 for [N, OC] rows of the bf16 MLP (dinp may be dout): a split
// backward's input pass (a zero-bubble schedule), whose weight pass rounds it and sums its columns
// (matmul_backward) where a whole backward does both here. Each element is the value
// gelu_backward_summing_columns computes (its 16-lane rows on one AVX-512 thread), so the two
// backwards give the same bits.
ZERO3D_KERNEL void gelu_backward(float* dinp, const bf16* inp, const float* dout, Index N, Index OC) {
#ifdef ZERO3D_AVX512
  const ProfileRegion region("gelu_backward");
  for (Index i = 0; i < N; ++i) {
    const bf16* x = inp + i * OC;
    const float* dy = dout + i * OC;
    float* dx = dinp + i * OC;
    Index o = 0;
    for (; o + 16 <= OC; o += 16) _mm512_storeu_ps(dx + o, gelu_grad_x16(load_bf16_x16(x + o, 0xFFFF), _mm512_loadu_ps(dy + o)));
    for (; o < OC; ++o) dx[o] = gelu_grad(to_float(x[o]), dy[o]);
  }
#else
  gelu_backward(dinp, inp, dout, N * OC);  // every other form computes each element as gelu_grad does
#endif
}

}  // namespace zero3d::kernels
