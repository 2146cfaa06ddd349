// crossentropy.hpp — softmax + cross-entropy over the vocabulary, mean over tokens.
//
// The forward keeps the logits and saves one log-sum-exp per row; the backward turns the
// logits into their gradient in place, so no [N,V] probability buffer is ever held.
#pragma once

#include <cmath>

#include "kernels/common.hpp"
#include "kernels/fastmath.hpp"

namespace zero3d::kernels {

// losses[i] = logsumexp(logits[i,:]) - logits[i, target[i]]; lse[i] saved for the backward.
inline void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, Index N,
                                 Index V) {
  Kokkos::parallel_for("crossentropy_forward", range(N), KOKKOS_LAMBDA(Index i) {
    const float* z = logits + i * V;
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
}

// logits[i,:] <- dloss * (softmax(logits[i,:]) - onehot(target[i])); dloss = d(total)/d(loss_i).
inline void crossentropy_backward(float* logits, const float* lse, const int32_t* targets, float dloss, Index N,
                                  Index V) {
  Kokkos::parallel_for("crossentropy_backward", range(N), KOKKOS_LAMBDA(Index i) {
    float* z = logits + i * V;
    const float l = lse[i];
    for (Index v = 0; v < V; ++v) z[v] = fast_exp(z[v] - l) * dloss;
    z[targets[i]] -= dloss;
  });
}

}  // namespace zero3d::kernels
