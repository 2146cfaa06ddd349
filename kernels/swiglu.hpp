// swiglu.hpp — the SwiGLU gate of Llama-family MLPs (Shazeer 2020, "GLU Variants Improve
// Transformer"; Hugging Face's LlamaMLP: down(silu(gate(x)) · up(x))):
// out = silu(gate) · up, silu(g) = g · σ(g) (Swish with β = 1; Ramachandran et al. 2017).
//
// gate and up are [N, I] with row stride ld (I for two buffers, 2I for one fused [gate | up]
// product, whose up is then gate + I); out and dout are [N, I], dense.
#pragma once

#include <vector>

#include "kernels/common.hpp"
#include "kernels/device_forms.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

// σ(g) through one exponential: fastmath.hpp's, plain arithmetic, so the loops vectorise (libm's
// expf is an opaque call) and it compiles for a device; clamped there, so σ stays finite for any g.
KOKKOS_INLINE_FUNCTION float swiglu_sigmoid(float g) { return 1.0f / (1.0f + fast_exp(-g)); }

// dgate = dout · up · σ(g)(1 + g(1 - σ(g))) (silu's derivative), dup = dout · silu(g).
KOKKOS_INLINE_FUNCTION void swiglu_grad(float g, float u, float dy, float& dgate, float& dup) {
  const float s = swiglu_sigmoid(g);
  dgate = dy * u * s * (1.0f + g * (1.0f - s));
  dup = dy * g * s;
}

#ifdef ZERO3D_AVX512
// σ(g) = 1 / (1 + 2^(-g·log2 e)) on 16 lanes, through gelu's base-2 exponential (fastmath.hpp).
inline __m512 swiglu_sigmoid_x16(__m512 g) {
  const __m512 e = exp2_x16(_mm512_mul_ps(g, _mm512_set1_ps(-1.4426950408889634f)));
  return _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
// swiglu_grad on 16 lanes: s = σ(g), dup = dy·g·s, dgate = dy·u·s(1 + g(1 - s)) = dy·u·(s + g·s(1 - s)).
inline void swiglu_grad_x16(__m512 g, __m512 u, __m512 dy, __m512& dgate, __m512& dup) {
  const __m512 s = swiglu_sigmoid_x16(g), gs = _mm512_mul_ps(g, s);
  dup = _mm512_mul_ps(dy, gs);
  dgate = _mm512_mul_ps(_mm512_mul_ps(dy, u), _mm512_fmadd_ps(gs, _mm512_sub_ps(_mm512_set1_ps(1.0f), s), s));
}
#endif

namespace gpu {

// kVec elements of a row a thread where I, ld and the pointers allow whole vectors
// (device_forms.hpp), one element a thread otherwise; each element's arithmetic is the portable
// form's.
template <typename O, typename In>
ZERO3D_KERNEL void swiglu_forward(O* out, const In* gate, const In* up, Index N, Index I, Index ld) {
  if (vectorizable(I, out) && vectorizable(ld, gate, up)) {
    Kokkos::parallel_for("swiglu_forward", range(N * I / kVec), KOKKOS_LAMBDA(Index p) {
      const Index j = p * kVec, i = j / I, c0 = j - i * I;
      float g[kVec], u[kVec];
      load_floats(g, gate + i * ld + c0);
      load_floats(u, up + i * ld + c0);
      for (int k = 0; k < kVec; ++k) g[k] = g[k] * swiglu_sigmoid(g[k]) * u[k];
      store_floats(out + j, g);
    });
  } else {
    Kokkos::parallel_for("swiglu_forward", range(N * I), KOKKOS_LAMBDA(Index j) {
      const Index i = j / I, c = j % I;
      const float g = to_float(gate[i * ld + c]);
      out[j] = from_float<O>(g * swiglu_sigmoid(g) * to_float(up[i * ld + c]));
    });
  }
}

// Without biases: element-wise, W elements of a row a thread.
template <int W>
ZERO3D_KERNEL void swiglu_backward_rounded(Width<W>, bf16* d, const float* dout, const bf16* gate_up, Index N,
                                           Index I) {
  const Index ld = 2 * I;
  Kokkos::parallel_for("swiglu_backward", range(N * I / W), KOKKOS_LAMBDA(Index p) {
    const Index j = p * W, i = j / I, c0 = j - i * I;
    float g[W], u[W], dy[W];
    load_floats(g, gate_up + i * ld + c0);
    load_floats(u, gate_up + i * ld + I + c0);
    load_floats(dy, dout + j);
    for (int k = 0; k < W; ++k) swiglu_grad(g[k], u[k], dy[k], g[k], u[k]);
    store_floats(d + i * ld + c0, g);
    store_floats(d + i * ld + I + c0, u);
  });
}

// Stage 1 of a two-stage column sum (device_forms.hpp) does the element-wise work of the
// elements it sums, as gelu_backward_summing_columns': a thread per (chunk of rows, W columns c)
// writes its chunk's dgate and dup of columns c and adds their unrounded values in row order.
template <int W>
ZERO3D_KERNEL void swiglu_backward_summing_columns(Width<W>, bf16* d, float* partial, const float* dout,
                                                   const bf16* gate_up, Index N, Index I) {
  const Index ld = 2 * I;
  Kokkos::parallel_for("swiglu_backward", range(column_chunk_threads<W>(N, I)), KOKKOS_LAMBDA(Index j) {
    const ColumnChunk<W> at(j, N, I);
    float sum_g[W] = {}, sum_u[W] = {};
    ZERO3D_UNROLL(4)
    for (Index i = at.i0; i < at.i1; ++i) {
      float g[W], u[W], dy[W];
      load_floats(g, gate_up + i * ld + at.o0);
      load_floats(u, gate_up + i * ld + I + at.o0);
      load_floats(dy, dout + i * I + at.o0);
      for (int k = 0; k < W; ++k) {
        swiglu_grad(g[k], u[k], dy[k], g[k], u[k]);
        sum_g[k] += g[k];
        sum_u[k] += u[k];
      }
      store_floats(d + i * ld + at.o0, g);
      store_floats(d + i * ld + I + at.o0, u);
    }
    float* row = partial + at.i0 / kColumnChunkRows * ld + at.o0;  // the chunk's row of [gate | up] sums
    store_floats(row, sum_g);
    store_floats(row + I, sum_u);
  });
}

ZERO3D_KERNEL void swiglu_backward_summing_columns(bf16* d, float* column_sums, const float* dout, const bf16* gate_up,
                                                   Index N, Index I) {
  const bool vec = vectorizable(I, d, dout, gate_up);  // I a multiple of kVec: so are 2I and I's offset
  if (!column_sums) {
    if (vec) swiglu_backward_rounded(Width<kVec>{}, d, dout, gate_up, N, I);
    else swiglu_backward_rounded(Width<1>{}, d, dout, gate_up, N, I);
    return;
  }
  const Index chunks = column_chunks(N);
  float* partial = kernel_scratch<float>(chunks * 2 * I);
  if (vec && aligned16(partial)) swiglu_backward_summing_columns(Width<kVec>{}, d, partial, dout, gate_up, N, I);
  else swiglu_backward_summing_columns(Width<1>{}, d, partial, dout, gate_up, N, I);
  add_chunk_sums(column_sums, partial, chunks, 2 * I);
}

}  // namespace gpu

// O: the output's type (bf16 when the output only feeds the bf16 down product); I: the inputs'
// (bf16 when the gate/up product wrote bf16, as PyTorch's autocast does). Element-wise: no sum,
// so no order to choose.
template <typename O = float, typename In = float>
ZERO3D_KERNEL void swiglu_forward(O* out, const In* gate, const In* up, Index N, Index I, Index ld) {
#ifdef ZERO3D_DEVICE
  gpu::swiglu_forward(out, gate, up, N, I, ld);
#else
  Kokkos::parallel_for("swiglu_forward", range(N * I), KOKKOS_LAMBDA(Index j) {
    const Index i = j / I, c = j % I;
    const float g = to_float(gate[i * ld + c]);
    out[j] = from_float<O>(g * swiglu_sigmoid(g) * to_float(up[i * ld + c]));
  });
#endif
}

#ifdef ZERO3D_AVX512
// The bf16-in, bf16-out SwiGLU of the bf16 MLP (gate_up_proj wrote bf16, down_proj reads bf16):
// a row at a time, 16 lanes at a time, where the element-wise form divides by I per element and
// stays scalar. (Plain stores for whole vectors, as gelu_forward's.)
inline void swiglu_forward(bf16* out, const bf16* gate, const bf16* up, Index N, Index I, Index ld) {
  const ProfileRegion region("swiglu_forward");
  for (Index i = 0; i < N; ++i) {
    const bf16 *g = gate + i * ld, *u = up + i * ld;
    bf16* o = out + i * I;
    Index c = 0;
    for (; c + 16 <= I; c += 16) {
      const __m512 x = load_bf16_x16(g + c, 0xFFFF);
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(x, swiglu_sigmoid_x16(x)), load_bf16_x16(u + c, 0xFFFF));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c), round_bf16_x16(y));
    }
    for (; c < I; ++c) {
      const float x = to_float(g[c]);
      o[c] = to_bf16(x * swiglu_sigmoid(x) * to_float(u[c]));
    }
  }
}
#endif

// dgate and dup (swiglu_grad) both written (=), at the inputs' layout (stride ld: a fused
// [dgate | dup] buffer feeds the fused product's backward).
template <typename In = float>
ZERO3D_KERNEL void swiglu_backward(float* dgate, float* dup, const float* dout, const In* gate, const In* up, Index N, Index I,
                            Index ld) {
  Kokkos::parallel_for("swiglu_backward", range(N * I), KOKKOS_LAMBDA(Index j) {
    const Index i = j / I, c = j % I;
    swiglu_grad(to_float(gate[i * ld + c]), to_float(up[i * ld + c]), dout[j], dgate[i * ld + c], dup[i * ld + c]);
  });
}



// The backward of the bf16 MLP, whose gradient's readers are gate_up_proj's two bf16 products
// and its biases' gradient (mlp_bias): d = bf16([dgate | dup]) [N, 2I] from the fused bf16
// [gate | up] [N, 2I] and dout [N, I], and column_sums[2I] += Σ_i of the unrounded values (null:
// no biases), in one pass (no fp32 gradient written and read back), as GELU's
// gelu_backward_summing_columns. The sums add each column's rows in order into a fresh sum.
ZERO3D_KERNEL void swiglu_backward_summing_columns(bf16* d, float* column_sums, const float* dout, const bf16* gate_up,
                                                   Index N, Index I) {
#if defined(ZERO3D_DEVICE)
  gpu::swiglu_backward_summing_columns(d, column_sums, dout, gate_up, N, I);
#elif defined(ZERO3D_SERIAL_HOST)
  // one thread: stream the rows in memory order, the sums (2I floats) stay in L1; 16 lanes at a
  // time with AVX-512, the rest (or all, without it) one by one
  const ProfileRegion region("swiglu_backward");
  const Index ld = 2 * I;
  std::vector<float> acc(column_sums ? static_cast<size_t>(ld) : 0, 0.0f);
  float* const ag = acc.data();
  float* const au = column_sums ? ag + I : nullptr;
  for (Index i = 0; i < N; ++i) {
    const bf16 *g = gate_up + i * ld, *u = g + I;
    const float* dy = dout + i * I;
    bf16 *dg = d + i * ld, *du = dg + I;
    Index c = 0;
#ifdef ZERO3D_AVX512
    for (; c + 16 <= I; c += 16) {
      __m512 vg, vu;
      swiglu_grad_x16(load_bf16_x16(g + c, 0xFFFF), load_bf16_x16(u + c, 0xFFFF), _mm512_loadu_ps(dy + c), vg, vu);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dg + c), round_bf16_x16(vg));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(du + c), round_bf16_x16(vu));
      if (au) {
        _mm512_storeu_ps(ag + c, _mm512_add_ps(_mm512_loadu_ps(ag + c), vg));
        _mm512_storeu_ps(au + c, _mm512_add_ps(_mm512_loadu_ps(au + c), vu));
      }
    }
#endif
    for (; c < I; ++c) {
      float vg, vu;
      swiglu_grad(to_float(g[c]), to_float(u[c]), dy[c], vg, vu);
      dg[c] = to_bf16(vg);
      du[c] = to_bf16(vu);
      if (au) ag[c] += vg, au[c] += vu;
    }
  }
  if (column_sums)
    for (Index o = 0; o < ld; ++o) column_sums[o] += acc[o];
#else
  constexpr Index kBlock = 64;  // parallel over column blocks: no two iterations share a sum
  const Index ld = 2 * I;
  Kokkos::parallel_for("swiglu_backward", range((I + kBlock - 1) / kBlock), KOKKOS_LAMBDA(Index blk) {
    const Index c0 = blk * kBlock, width = c0 + kBlock < I ? kBlock : I - c0;
    float acc_g[kBlock] = {}, acc_u[kBlock] = {};
    for (Index i = 0; i < N; ++i)
      for (Index c = 0; c < width; ++c) {
        float vg, vu;
        swiglu_grad(to_float(gate_up[i * ld + c0 + c]), to_float(gate_up[i * ld + I + c0 + c]), dout[i * I + c0 + c], vg,
                    vu);
        acc_g[c] += vg;
        acc_u[c] += vu;
        d[i * ld + c0 + c] = to_bf16(vg);
        d[i * ld + I + c0 + c] = to_bf16(vu);
      }
    if (column_sums)
      for (Index c = 0; c < width; ++c) column_sums[c0 + c] += acc_g[c], column_sums[I + c0 + c] += acc_u[c];
  });
#endif
}

// The same gradient kept in fp32 (dgate and dup at stride ld, as swiglu_backward writes them): a
// split backward's input pass (a zero-bubble schedule), whose weight pass rounds it and sums its
// columns (linear_backward) where a whole backward does both here. Each element is the value
// swiglu_backward_summing_columns computes (its 16-lane rows on one AVX-512 thread), so the two
// backwards give the same bits.
inline void swiglu_backward(float* dgate, float* dup, const float* dout, const bf16* gate, const bf16* up, Index N,
                            Index I, Index ld) {
#ifdef ZERO3D_AVX512
  const ProfileRegion region("swiglu_backward");
  for (Index i = 0; i < N; ++i) {
    const bf16 *g = gate + i * ld, *u = up + i * ld;
    const float* dy = dout + i * I;
    float *dg = dgate + i * ld, *du = dup + i * ld;
    Index c = 0;
    for (; c + 16 <= I; c += 16) {  // swiglu_backward_summing_columns' arithmetic, lane for lane
      __m512 vg, vu;
      swiglu_grad_x16(load_bf16_x16(g + c, 0xFFFF), load_bf16_x16(u + c, 0xFFFF), _mm512_loadu_ps(dy + c), vg, vu);
      _mm512_storeu_ps(dg + c, vg);
      _mm512_storeu_ps(du + c, vu);
    }
    for (; c < I; ++c) swiglu_grad(to_float(g[c]), to_float(u[c]), dy[c], dg[c], du[c]);
  }
#else
  swiglu_backward<bf16>(dgate, dup, dout, gate, up, N, I, ld);  // every other form computes swiglu_grad's
#endif
}

}  // namespace zero3d::kernels
