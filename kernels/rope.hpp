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
#include "kernels/rope_config.hpp"  // the rope types' settings and their frequency tables (host code)

namespace zero3d::kernels {

// qkv [B, T, (H + 2·Hkv)·head_dim] in place: each q and k head's pairs (x1, x2) = (x[i], x[i + d/2])
// become (x1·cos - x2·sin, x2·cos + x1·sin) (x·cos + rotate_half(x)·sin). One pair a thread, on
// every build: no sum, so no order to choose, and the q and k heads are contiguous in a row.
ZERO3D_KERNEL void rope_forward(float* qkv, const float* cos, const float* sin, Index B, Index T, Index H, Index Hkv,
                         Index head_dim) {
  const Index half = head_dim / 2, heads = H + Hkv, width = (H + 2 * Hkv) * head_dim;
  Kokkos::parallel_for("rope_forward", range(B * T * heads * half), KOKKOS_LAMBDA(Index j) {
    const Index i = j % half, h = j / half % heads, bt = j / (half * heads), t = bt % T;
    float* x = qkv + bt * width + h * head_dim;
    const float c = cos[t * half + i], s = sin[t * half + i];
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  });
}

// The gradient through the rotation, in place on dqkv (same layout): a rotation's transpose,
// (d1, d2) -> (d1·cos + d2·sin, d2·cos - d1·sin); v's gradient passes unchanged.
ZERO3D_KERNEL void rope_backward(float* dqkv, const float* cos, const float* sin, Index B, Index T, Index H, Index Hkv,
                          Index head_dim) {
  const Index half = head_dim / 2, heads = H + Hkv, width = (H + 2 * Hkv) * head_dim;
  Kokkos::parallel_for("rope_backward", range(B * T * heads * half), KOKKOS_LAMBDA(Index j) {
    const Index i = j % half, h = j / half % heads, bt = j / (half * heads), t = bt % T;
    float* d = dqkv + bt * width + h * head_dim;
    const float c = cos[t * half + i], s = sin[t * half + i];
    const float d1 = d[i], d2 = d[i + half];
    d[i] = d1 * c + d2 * s;
    d[i + half] = d2 * c - d1 * s;
  });
}

}  // namespace zero3d::kernels
