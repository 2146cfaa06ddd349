// rope.hpp — rotary position embeddings (Su et al. 2021, "RoFormer: Enhanced Transformer with
// Rotary Position Embedding"), in Hugging Face's non-interleaved layout: a head's vector x of
// head_dim d is rotated as the pairs (x[i], x[i + d/2]) by the angle position · inv_freq[i]
// (transformers' rotate_half and apply_rotary_pos_emb), so Hugging Face's q/k weights, stored
// permuted for that layout, are used as they are.
//
// The frequencies of each rope type are computed on the host, once, by the formulas of
// transformers' src/transformers/modeling_rope_utils.py (ROPE_INIT_FUNCTIONS: default, linear,
// dynamic, yarn, llama3), in double; the kernels read a cos and a sin table [T, d/2] (the
// attention factor folded in, as Hugging Face multiplies both by it) from model memory.
//
// The buffer is the fused qkv activation, a row per token of (H + 2·Hkv)·d values: q's H heads,
// then k's Hkv heads, then v's Hkv (grouped-query attention, Ainslie et al. 2023: Hkv divides H;
// head_dim need not be C/H). q and k are rotated in place, v is left alone.
#pragma once

#include "kernels/common.hpp"
#include "kernels/half.hpp"
#include "kernels/rope_config.hpp"  // the rope types' settings and their frequency tables (host code)

namespace zero3d::kernels {

// The rotation of one pair (the forward) and its transpose (the backward), as functors for
// rope_pairs below.
struct RopeRotate {
  template <typename X>
  KOKKOS_INLINE_FUNCTION void operator()(X* x, Index i, Index half, float c, float s) const {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    x[i] = from_float<X>(x1 * c - x2 * s);
    x[i + half] = from_float<X>(x2 * c + x1 * s);
  }
};
struct RopeUnrotate {
  KOKKOS_INLINE_FUNCTION void operator()(float* d, Index i, Index half, float c, float s) const {
    const float d1 = d[i], d2 = d[i + half];
    d[i] = d1 * c + d2 * s;
    d[i + half] = d2 * c - d1 * s;
  }
};

// qkv [B, T, (H + 2·Hkv)·head_dim] in place: each q and k head's pairs (x1, x2) = (x[i], x[i + d/2])
// become (x1·cos - x2·sin, x2·cos + x1·sin) (x·cos + rotate_half(x)·sin). No sum, so no order
// to choose: the device takes one pair a thread, the CPU a token an iteration with its q and k
// heads' pairs in vector loops (the device form's per-pair index arithmetic cost the CPU several
// times the rotation: rope_forward 9 ms a layer at llama-small-cpu's shape, a pair a thread).
// X: fp32, or bf16 where the q/k/v product rounded its output (bf16 compute): the rotation in
// fp32 on the bf16 values, each result rounded once.
// rope_pairs: pair(x, i, half, cos, sin) on each of those pairs (RopeRotate: the forward,
// RopeUnrotate: the backward).
template <typename X, typename Pair>
ZERO3D_KERNEL void rope_pairs(const char* label, X* qkv, const float* cos, const float* sin, Index B, Index T, Index H,
                              Index Hkv, Index head_dim, Pair pair) {
  const Index half = head_dim / 2, heads = H + Hkv, width = (H + 2 * Hkv) * head_dim;
#ifdef ZERO3D_DEVICE
  Kokkos::parallel_for(label, range(B * T * heads * half), KOKKOS_LAMBDA(Index j) {
    const Index i = j % half, h = j / half % heads, bt = j / (half * heads), t = bt % T;
    pair(qkv + bt * width + h * head_dim, i, half, cos[t * half + i], sin[t * half + i]);
  });
#else
  Kokkos::parallel_for(label, range(B * T), KOKKOS_LAMBDA(Index bt) {
    const float* c = cos + bt % T * half;
    const float* s = sin + bt % T * half;
    for (Index h = 0; h < heads; ++h) {
      X* x = qkv + bt * width + h * head_dim;
#pragma omp simd
      for (Index i = 0; i < half; ++i) pair(x, i, half, c[i], s[i]);
    }
  });
#endif
}

template <typename X>
ZERO3D_KERNEL void rope_forward(X* qkv, const float* cos, const float* sin, Index B, Index T, Index H, Index Hkv,
                         Index head_dim) {
  rope_pairs("rope_forward", qkv, cos, sin, B, T, H, Hkv, head_dim, RopeRotate{});
}

// The gradient through the rotation, in place on dqkv (same layout): a rotation's transpose,
// (d1, d2) -> (d1·cos + d2·sin, d2·cos - d1·sin); v's gradient passes unchanged.
ZERO3D_KERNEL void rope_backward(float* dqkv, const float* cos, const float* sin, Index B, Index T, Index H, Index Hkv,
                          Index head_dim) {
  rope_pairs("rope_backward", dqkv, cos, sin, B, T, H, Hkv, head_dim, RopeUnrotate{});
}

}  // namespace zero3d::kernels
