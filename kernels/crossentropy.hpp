// crossentropy.hpp — softmax + cross-entropy over the vocabulary, mean over tokens.
//
// The forward keeps the logits and saves one log-sum-exp per row; the backward turns the
// logits into their gradient in place, so no [N,V] probability buffer is ever held (a bf16
// step's backward writes the gradient rounded into the head products' operand instead:
// crossentropy_backward_bf16, llm.c's fused classifier). The logits are fp32, or bf16 where the
// head's product rounds them (a GPU's bf16 step, as DeepSpeed's bf16 and torch.autocast's linear
// give them): the forward widens each one as it reads it, and the bf16 backward may then write
// the gradient over the logits themselves.
// Rows are Vp apart: a padded vocabulary (Megatron's make_vocab_size_divisible_by; llm.c's
// fused_classifier takes V and Vp alike) has Vp − V columns past the real V, masked out of the
// softmax and given a zero gradient. Vp = V is the unpadded head.
#pragma once

#include <cfloat>
#include <cmath>

#include "kernels/common.hpp"
#include "kernels/device_forms.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

namespace gpu {

// A softmax denominator over the values seen so far: their max, and the sum of exp(x − max)
// over them. Two such merge by rescaling the sum with the smaller max to the larger (Milakov &
// Gimelshein 2018, "Online normalizer calculation for softmax"), so one read of a row gives both.
struct SoftmaxDenominator {
  float max, sum;
};

// Kokkos reducer of lanes' SoftmaxDenominators (the identity: max −FLT_MAX, which leaves finite
// logits the CPU form's max, and sum 0).
struct OnlineSoftmax {
  using reducer = OnlineSoftmax;
  using value_type = SoftmaxDenominator;
  using result_view_type = Kokkos::View<value_type, Kokkos::MemoryUnmanaged>;
  value_type* result;
  KOKKOS_INLINE_FUNCTION explicit OnlineSoftmax(value_type& r) : result(&r) {}
  KOKKOS_INLINE_FUNCTION void join(value_type& dst, const value_type& src) const {
    const float m = src.max > dst.max ? src.max : dst.max;
    dst.sum = dst.sum * fast_exp(dst.max - m) + src.sum * fast_exp(src.max - m);
    dst.max = m;
  }
  KOKKOS_INLINE_FUNCTION void init(value_type& v) const {
    v.max = -FLT_MAX;
    v.sum = 0.0f;
  }
  KOKKOS_INLINE_FUNCTION value_type& reference() const { return *result; }
  KOKKOS_INLINE_FUNCTION result_view_type view() const { return result_view_type(result); }
  KOKKOS_INLINE_FUNCTION bool references_scalar() const { return true; }
};

// One row's max and sum of exponentials over its V real columns in one read, in the row's lanes, W
// columns at a time (the last vector may run into the padding, Vp a multiple of W: masked out).
// A lane rescales its sum only when a vector raises its max, one fast_exp per such vector.
template <int W, typename L>
KOKKOS_INLINE_FUNCTION SoftmaxDenominator crossentropy_row(const RowTeam& team, const L* z, Index V) {
  SoftmaxDenominator d;
  Kokkos::parallel_reduce(
      Kokkos::ThreadVectorRange(team, (V + W - 1) / W),
      [&](Index j, SoftmaxDenominator& acc) {
        float v[W];
        load_floats(v, z + j * W);
        float m = acc.max;
        for (int k = 0; k < W; ++k)
          if (j * W + k < V && v[k] > m) m = v[k];
        if (m > acc.max) {
          acc.sum *= fast_exp(acc.max - m);
          acc.max = m;
        }
        for (int k = 0; k < W; ++k)
          if (j * W + k < V) acc.sum += fast_exp(v[k] - m);
      },
      OnlineSoftmax(d));
  return d;
}

// A row to a warp (common.hpp row_teams) where a thread walked a whole 200 KB row of GPT-2's
// vocabulary, kVec columns at a time where the rows allow (device_forms.hpp): the max and the sum
// of exponentials are one lane-strided online reduction, so each row is read once; the 8192 rows
// of 200 KB in flight do not stay in L2 for a second read (llm.c fused_classifier.cuh:68-140 takes
// a block per row; 8192 rows of warps already fill an H100).
template <typename L>
ZERO3D_KERNEL void crossentropy_forward(float* losses, float* lse, const L* logits, const int32_t* targets, Index N,
                                 Index V, Index Vp) {
  const bool vec = vectorizable(Vp, logits);
  Kokkos::parallel_for("crossentropy_forward", row_teams(N), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index i = team_row(team);
    if (i >= N) return;
    const L* z = logits + i * Vp;
    const SoftmaxDenominator d = vec ? crossentropy_row<kVec>(team, z, V) : crossentropy_row<1>(team, z, V);
    Kokkos::single(Kokkos::PerThread(team), [&] {
      const float l = d.max + std::log(d.sum);
      lse[i] = l;
      losses[i] = l - to_float(z[targets[i]]);
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

// The fused classifier's backward (llm.c fused_classifier.cuh): the loss gradient rounded to bf16
// into the head products' operand, the fp32 logits only read. One read of 4 bytes and one write of
// 2 an element, where crossentropy_backward and then convert read 4, wrote 4, read 4 and wrote 2.
// kVec logits a thread where the rows allow; each element's arithmetic is the CPU form's. bf16
// logits may be the gradient's own memory: a thread reads its elements before it writes them.
template <typename L>
ZERO3D_KERNEL void crossentropy_backward_bf16(bf16* dlogits, const L* logits, const float* lse,
                                              const int32_t* targets, float dloss, Index N, Index V, Index Vp) {
  if (vectorizable(Vp, logits, dlogits)) {
    Kokkos::parallel_for("crossentropy_backward_bf16", range(N * Vp / kVec), KOKKOS_LAMBDA(Index p) {
      const Index j = p * kVec, i = j / Vp, c0 = j - i * Vp, t = targets[i];
      float x[kVec];
      load_floats(x, logits + j);
      const float l = lse[i];
      for (int k = 0; k < kVec; ++k) x[k] = c0 + k < V ? fast_exp(x[k] - l) * dloss : 0.0f;
      for (int k = 0; k < kVec; ++k)  // (x[t − c0] would put x in local memory: a runtime index)
        if (c0 + k == t) x[k] -= dloss;
      store_floats(dlogits + j, x);
    });
  } else {
    Kokkos::parallel_for("crossentropy_backward_bf16", range(N * Vp), KOKKOS_LAMBDA(Index j) {
      const Index i = j / Vp, c = j - i * Vp;
      float g = c < V ? fast_exp(to_float(logits[j]) - lse[i]) * dloss : 0.0f;
      if (c == targets[i]) g -= dloss;
      dlogits[j] = to_bf16(g);
    });
  }
}

}  // namespace gpu

// losses[i] = logsumexp(logits[i,:V]) - logits[i, target[i]]; lse[i] saved for the backward.
// Logits fp32 or bf16 (L), each widened as it is read: the bits of the fp32 form on the widened values.
template <typename L>
ZERO3D_KERNEL void crossentropy_forward(float* losses, float* lse, const L* logits, const int32_t* targets, Index N,
                                 Index V, Index Vp) {
#ifdef ZERO3D_DEVICE
  gpu::crossentropy_forward(losses, lse, logits, targets, N, V, Vp);
#else
  Kokkos::parallel_for("crossentropy_forward", range(N), KOKKOS_LAMBDA(Index i) {
    const L* z = logits + i * Vp;
    float mx = to_float(z[0]);
#pragma omp simd reduction(max : mx)  // a float reduction vectorises only when told it may reorder
    for (Index v = 1; v < V; ++v) mx = to_float(z[v]) > mx ? to_float(z[v]) : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (Index v = 0; v < V; ++v) sum += fast_exp(to_float(z[v]) - mx);
    const float l = mx + std::log(sum);
    lse[i] = l;
    losses[i] = l - to_float(z[targets[i]]);
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

// dlogits[i,:Vp] <- to_bf16 of crossentropy_backward's gradient, logits left as they are: the
// head's bf16 products take the gradient without an fp32 copy written and converted (the same bits
// as crossentropy_backward, then convert). The CPU form computes a row in L1-sized pieces through
// the same fp32 statements, so the target's subtraction rounds apart from the product as it did.
// bf16 logits (L) may be dlogits' own memory: each piece of a row is read before it is written.
template <typename L>
ZERO3D_KERNEL void crossentropy_backward_bf16(bf16* dlogits, const L* logits, const float* lse,
                                              const int32_t* targets, float dloss, Index N, Index V, Index Vp) {
#ifdef ZERO3D_DEVICE
  gpu::crossentropy_backward_bf16(dlogits, logits, lse, targets, dloss, N, V, Vp);
#else
  Kokkos::parallel_for("crossentropy_backward_bf16", range(N), KOKKOS_LAMBDA(Index i) {
    constexpr Index kPiece = 512;
    const L* z = logits + i * Vp;
    bf16* d = dlogits + i * Vp;
    const float l = lse[i];
    const Index t = targets[i];
    float g[kPiece];
    for (Index v0 = 0; v0 < Vp; v0 += kPiece) {
      const Index n = Vp - v0 < kPiece ? Vp - v0 : kPiece;
      const Index real = V <= v0 ? 0 : (V - v0 < n ? V - v0 : n);
      for (Index k = 0; k < real; ++k) g[k] = fast_exp(to_float(z[v0 + k]) - l) * dloss;
      for (Index k = real; k < n; ++k) g[k] = 0.0f;
      if (t >= v0 && t < v0 + n) g[t - v0] -= dloss;
      for (Index k = 0; k < n; ++k) d[v0 + k] = to_bf16(g[k]);
    }
  });
#endif
}

}  // namespace zero3d::kernels
