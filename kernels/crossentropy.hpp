// crossentropy.hpp — softmax + cross-entropy over the vocabulary, mean over tokens.
//
// The forward keeps the logits and saves one log-sum-exp per row; the backward turns the
// logits into their gradient in place, so no [N,V] probability buffer is ever held.
// Rows are Vp apart: a padded vocabulary (Megatron's make_vocab_size_divisible_by; llm.c's
// fused_classifier takes V and Vp alike) has Vp − V columns past the real V, masked out of the
// softmax and given a zero gradient. Vp = V is the unpadded head.
#pragma once

#include <cmath>

#include "kernels/common.hpp"
#include "kernels/device_forms.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

namespace gpu {

// One row's max and sum of exponentials over its V real columns, in the row's lanes, W columns
// at a time (the last vector may run into the padding, Vp a multiple of W: masked out).
template <int W>
KOKKOS_INLINE_FUNCTION void crossentropy_row(const RowTeam& team, float& mx, float& sum, const float* z, Index V) {
  const Index n = (V + W - 1) / W;
  // the reducer's result; its identity, -FLT_MAX, leaves finite logits the CPU form's max
  Kokkos::parallel_reduce(
      Kokkos::ThreadVectorRange(team, n),
      [&](Index j, float& m) {
        float v[W];
        load_floats(v, z + j * W);
        for (int k = 0; k < W; ++k)
          if (j * W + k < V && v[k] > m) m = v[k];
      },
      Kokkos::Max<float>(mx));
  sum = 0.0f;
  Kokkos::parallel_reduce(
      Kokkos::ThreadVectorRange(team, n),
      [&](Index j, float& s) {
        float v[W];
        load_floats(v, z + j * W);
        for (int k = 0; k < W; ++k)
          if (j * W + k < V) s += fast_exp(v[k] - mx);
      },
      sum);
}

// A row to a warp (common.hpp row_teams) where a thread walked a whole 200 KB row of GPT-2's
// vocabulary, kVec columns at a time where the rows allow (device_forms.hpp): the max and the sum
// of exponentials are lane-strided reductions (llm.c fused_classifier.cuh:68-140 takes a block
// per row; 8192 rows of warps already fill an H100).
ZERO3D_KERNEL void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, Index N,
                                 Index V, Index Vp) {
  const bool vec = vectorizable(Vp, logits);
  Kokkos::parallel_for("crossentropy_forward", row_teams(N), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index i = team_row(team);
    if (i >= N) return;
    const float* z = logits + i * Vp;
    float mx, sum;
    if (vec) crossentropy_row<kVec>(team, mx, sum, z, V);
    else crossentropy_row<1>(team, mx, sum, z, V);
    Kokkos::single(Kokkos::PerThread(team), [&] {
      const float l = mx + std::log(sum);
      lse[i] = l;
      losses[i] = l - z[targets[i]];
    });
  });
}

// kVec logits a thread (a vector never crosses a row where Vp is a multiple of kVec), then a thread
// per row takes dloss off its target: each element's arithmetic, and the rounding between the
// two steps, are the CPU form's (the same bits).
ZERO3D_KERNEL void crossentropy_backward(float* logits, const float* lse, const int32_t* targets, float dloss, Index N,
                                  Index V, Index Vp) {
  if (vectorizable(Vp, logits)) {
    Kokkos::parallel_for("crossentropy_backward", range(N * Vp / kVec), KOKKOS_LAMBDA(Index p) {
      const Index j = p * kVec, i = j / Vp, c0 = j - i * Vp;
      float x[kVec];
      load_floats(x, logits + j);
      const float l = lse[i];
      for (int k = 0; k < kVec; ++k) x[k] = c0 + k < V ? fast_exp(x[k] - l) * dloss : 0.0f;
      store_floats(logits + j, x);
    });
  } else {
    Kokkos::parallel_for("crossentropy_backward", range(N * Vp), KOKKOS_LAMBDA(Index j) {
      const Index i = j / Vp;  // one division: the row, and the column j − i·Vp
      logits[j] = j - i * Vp < V ? fast_exp(logits[j] - lse[i]) * dloss : 0.0f;
    });
  }
  Kokkos::parallel_for("crossentropy_backward_target", range(N), KOKKOS_LAMBDA(Index i) {
    logits[i * Vp + targets[i]] -= dloss;
  });
}

}  // namespace gpu

// losses[i] = logsumexp(logits[i,:V]) - logits[i, target[i]]; lse[i] saved for the backward.
ZERO3D_KERNEL void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, Index N,
                                 Index V, Index Vp) {
#ifdef ZERO3D_DEVICE
  gpu::crossentropy_forward(losses, lse, logits, targets, N, V, Vp);
#else
  Kokkos::parallel_for("crossentropy_forward", range(N), KOKKOS_LAMBDA(Index i) {
    const float* z = logits + i * Vp;
    float mx = z[0];
#pragma omp simd reduction(max : mx)  // a float reduction vectorises only when told it may reorder
    for (Index v = 1; v < V; ++v) mx = z[v] > mx ? z[v] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (Index v = 0; v < V; ++v) sum += fast_exp(z[v] - mx);
    const float l = mx + std::log(sum);
    lse[i] = l;
    losses[i] = l - z[targets[i]];
  });
#endif
}

// logits[i,:V] <- dloss * (softmax(logits[i,:V]) - onehot(target[i])), the padding columns 0;
// dloss = d(total)/d(loss_i).
ZERO3D_KERNEL void crossentropy_backward(float* logits, const float* lse, const int32_t* targets, float dloss, Index N,
                                  Index V, Index Vp) {
#ifdef ZERO3D_DEVICE
  gpu::crossentropy_backward(logits, lse, targets, dloss, N, V, Vp);
#else
  Kokkos::parallel_for("crossentropy_backward", range(N), KOKKOS_LAMBDA(Index i) {
    float* z = logits + i * Vp;
    const float l = lse[i];
    for (Index v = 0; v < V; ++v) z[v] = fast_exp(z[v] - l) * dloss;
    for (Index v = V; v < Vp; ++v) z[v] = 0.0f;
    z[targets[i]] -= dloss;
  });
#endif
}

}  // namespace zero3d::kernels
