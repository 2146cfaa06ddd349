// dropout.hpp — inverted dropout (Srivastava et al. 2014, as torch.nn.functional.dropout: each
// element zeroed with probability p, the kept ones scaled by 1/(1 − p)) whose masks are never
// stored: each element's keep bit is a pure function of (seed, global sample, layer, site,
// element index within the sample), a counter-based stream (Salmon et al. 2011, "Random123")
// built on SplitMix64. Forward, backward and any recompute draw the same bits, and so does every
// layout: tensor ranks index global heads and channels, sequence-parallel ranks global token
// rows, data-parallel ranks and micro-batches global samples.
//
// Element e of a sample is kept when the top 24 bits of splitmix64(stream + (e + 1)·γ) are at
// least ⌊p·2²⁴⌋, stream = splitmix64(splitmix64(splitmix64(seed ⊕ K) ⊕ sample) ⊕ (layer·256 + site)),
// γ = 0x9E3779B97F4A7C15 (SplitMix64's increment), K = 0xD1B54A32D192ED03.
// tests/golden/make_dropout_goldens.py re-implements this in NumPy.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

// SplitMix64's finaliser (Steele, Lea & Flood 2014), the mix base/rng.hpp's stream uses.
KOKKOS_INLINE_FUNCTION uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Where in a block a mask applies (Hugging Face GPT2Model: drop after wte + wpe; GPT2Attention:
// attn_dropout on the probabilities, resid_dropout on c_proj's output; GPT2MLP: dropout on
// c_proj's output). Part of the stream key, so every site draws its own bits.
enum class DropoutSite : uint64_t { Embedding = 0, Probabilities = 1, AttentionOutput = 2, MlpOutput = 3 };

// The masks of one site in one layer of one micro-batch. threshold 0: nothing is dropped (the
// kernels are then not called, so p = 0 keeps every bit of the undropped model).
struct DropoutMask {
  uint64_t seed = 0;
  int64_t first_sample = 0;  // the micro-batch's first global sample
  uint64_t layer_site = 0;   // layer · 256 + site
  uint32_t threshold = 0;    // ⌊p · 2²⁴⌋
  float scale = 1.0f;        // 1/(1 − p)
  int64_t first_head = 0;    // attention: the global index of this rank's first (query) head

  KOKKOS_INLINE_FUNCTION bool on() const { return threshold > 0; }
  // The stream of sample b of the micro-batch.
  KOKKOS_INLINE_FUNCTION uint64_t stream(int64_t b) const {
    uint64_t h = splitmix64(seed ^ 0xD1B54A32D192ED03ull);
    h = splitmix64(h ^ static_cast<uint64_t>(first_sample + b));
    return splitmix64(h ^ layer_site);
  }
  // 0 (dropped) or 1/(1 − p) (kept) for element e of a sample's stream.
  KOKKOS_INLINE_FUNCTION float factor(uint64_t stream, uint64_t e) const {
    const uint64_t x = splitmix64(stream + (e + 1) * 0x9E3779B97F4A7C15ull);
    return static_cast<uint32_t>(x >> 40) >= threshold ? scale : 0.0f;
  }
};

inline DropoutMask dropout_mask(double p, uint64_t seed, int64_t first_sample, int64_t layer, DropoutSite site) {
  DropoutMask m;
  m.seed = seed;
  m.first_sample = first_sample;
  m.layer_site = static_cast<uint64_t>(layer) * 256 + static_cast<uint64_t>(site);
  m.threshold = static_cast<uint32_t>(std::floor(p * 16777216.0));
  m.scale = static_cast<float>(1.0 / (1.0 - p));
  return m;
}

// dst = src ∘ mask over token rows [row0, row0 + rows) of the micro-batch's B·T (row = sample·T +
// position; sequence parallelism's shard starts at its first global row), C channels each:
// element position·C + channel of its sample. dst may be src. The forward of a dropout and its
// backward (the gradient through a kept element is scaled alike, a dropped one's is 0).
ZERO3D_KERNEL void dropout_rows(float* dst, const float* src, DropoutMask m, Index row0, Index rows, Index T, Index C) {
#ifndef ZERO3D_DEVICE
  // CPU: each row's stream once, then one mix per element
  Kokkos::parallel_for("dropout_rows", range(rows), KOKKOS_LAMBDA(Index r) {
    const Index g = row0 + r;
    const uint64_t s = m.stream(g / T);
    const uint64_t e0 = static_cast<uint64_t>((g % T) * C);
    for (Index c = 0; c < C; ++c) dst[r * C + c] = src[r * C + c] * m.factor(s, e0 + static_cast<uint64_t>(c));
  });
#else
  Kokkos::parallel_for("dropout_rows", range(rows * C), KOKKOS_LAMBDA(Index j) {
    const Index g = row0 + j / C;
    dst[j] = src[j] * m.factor(m.stream(g / T), static_cast<uint64_t>((g % T) * C + j % C));
  });
#endif
}

// res = residual + mask ∘ (branch + bias): a residual branch's dropout (GPT2Attention's and
// GPT2MLP's resid_dropout) and the residual add in one pass, rows as dropout_rows. res may be
// branch; bias may be null.
template <typename P>
ZERO3D_KERNEL void dropout_residual_add(float* res, const float* residual, const float* branch, const P* bias,
                                        DropoutMask m, Index row0, Index rows, Index T, Index C) {
#ifndef ZERO3D_DEVICE
  Kokkos::parallel_for("dropout_residual_add", range(rows), KOKKOS_LAMBDA(Index r) {
    const Index g = row0 + r;
    const uint64_t s = m.stream(g / T);
    const uint64_t e0 = static_cast<uint64_t>((g % T) * C);
    for (Index c = 0; c < C; ++c) {
      const Index j = r * C + c;
      const float x = bias ? branch[j] + to_float(bias[c]) : branch[j];
      res[j] = residual[j] + x * m.factor(s, e0 + static_cast<uint64_t>(c));
    }
  });
#else
  Kokkos::parallel_for("dropout_residual_add", range(rows * C), KOKKOS_LAMBDA(Index j) {
    const Index g = row0 + j / C, c = j % C;
    const float x = bias ? branch[j] + to_float(bias[c]) : branch[j];
    res[j] = residual[j] + x * m.factor(m.stream(g / T), static_cast<uint64_t>((g % T) * C + c));
  });
#endif
}

// Rows [i0, i0 + rows) of one head's attention probabilities, columns (keys) [c0, c0 + cols):
// dst[r][k] = src[r][k] · mask of element (head·T + i0 + r)·T + c0 + k of sample b (head: this
// rank's head, m.first_head added). Row strides ldd, lds; dst may be src.
ZERO3D_KERNEL void dropout_probability_rows(float* dst, Index ldd, const float* src, Index lds, DropoutMask m, Index b,
                                            Index head, Index i0, Index rows, Index c0, Index cols, Index T) {
  const uint64_t s = m.stream(b);
  Kokkos::parallel_for("dropout_probability_rows", range(rows), KOKKOS_LAMBDA(Index r) {
    const uint64_t e0 = static_cast<uint64_t>(((m.first_head + head) * T + i0 + r) * T + c0);
    for (Index k = 0; k < cols; ++k) dst[r * ldd + k] = src[r * lds + k] * m.factor(s, e0 + static_cast<uint64_t>(k));
  });
}

// The device form: dst = src ∘ mask over B·H·T·T probabilities [B][H][T][T] (this rank's H
// heads); one thread per element. dst may be src.
ZERO3D_KERNEL void dropout_probabilities(float* dst, const float* src, DropoutMask m, Index B, Index H, Index T) {
  Kokkos::parallel_for("dropout_probabilities", range(B * H * T * T), KOKKOS_LAMBDA(Index e) {
    const Index bh = e / (T * T), b = bh / H, h = bh % H, ij = e % (T * T);
    dst[e] = src[e] * m.factor(m.stream(b), static_cast<uint64_t>((m.first_head + h) * T * T + ij));
  });
}

}  // namespace zero3d::kernels
