// vocab_parallel.hpp — the embedding and the cross-entropy with the vocabulary split over the
// tensor-parallel group (Megatron VocabParallelEmbedding and vocab_parallel_cross_entropy;
// DEEPSPEED-FACTS-2 §1.5–1.6). Each rank holds rows [v0, v0 + Vl) of wte; vocabulary padding
// (ids >= V) is never looked up and its logits are masked out, so it changes no loss.
// The kernels are the local parts; the caller all-reduces between them.
#pragma once

#include <cmath>

#include "kernels/common.hpp"
#include "kernels/encoder.hpp"
#include "kernels/fastmath.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

namespace gpu {

// The embedding's element-wise passes a thread per element (coalesced), the same value per element.
template <typename P>
ZERO3D_KERNEL void vocab_embedding_forward(float* out, const int32_t* tokens, const P* wte_local, Index v0, Index Vl, Index N,
                                    Index C) {
  Kokkos::parallel_for("vocab_embedding_forward", range(N * C), KOKKOS_LAMBDA(Index j) {
    const Index id = static_cast<Index>(tokens[j / C]) - v0;
    out[j] = id < 0 || id >= Vl ? 0.0f : to_float(wte_local[id * C + j % C]);
  });
}

template <typename P>
ZERO3D_KERNEL void add_position_embedding(float* out, const P* wpe, Index first, Index N, Index T, Index C) {
  Kokkos::parallel_for("add_position_embedding", range(N * C), KOKKOS_LAMBDA(Index j) {
    out[j] += to_float(wpe[((first + j / C) % T) * C + j % C]);
  });
}

// As encoder_backward's device form (encoder.hpp): positions sorted by owned token, a warp per
// token's run, and the batch summed in order into dwpe; the CPU form's order, the same bits.
inline void vocab_embedding_backward(float* dwte_local, float* dwpe, const float* dout, const int32_t* tokens, Index v0,
                                     Index Vl, Index B, Index T, Index C) {
  position_embedding_backward(dwpe, dout, B, T, C);
  embedding_rows_backward(dwte_local, dout, tokens, v0, Vl, B * T, C);
}

// The cross-entropy's row passes a row to a warp, as crossentropy_forward's device form
// (crossentropy.hpp). A rank whose columns are all padding keeps the CPU form's -inf max.
// Logits fp32 or bf16 (L), each widened as it is read.
template <typename L>
ZERO3D_KERNEL void vocab_ce_local_max(float* row_max, const L* logits, Index N, Index Vl, Index real_cols) {
  Kokkos::parallel_for("vocab_ce_local_max", row_teams(N), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index i = team_row(team);
    if (i >= N) return;
    const L* z = logits + i * Vl;
    float mx;  // the reducer's result (its identity is -FLT_MAX)
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, real_cols),
        [&](Index v, float& m) { m = to_float(z[v]) > m ? to_float(z[v]) : m; }, Kokkos::Max<float>(mx));
    Kokkos::single(Kokkos::PerThread(team), [&] { row_max[i] = real_cols > 0 ? mx : -INFINITY; });
  });
}

template <typename L>
ZERO3D_KERNEL void vocab_ce_local_sums(float* sum_exp, float* target_logit, const L* logits, const float* row_max,
                                const int32_t* targets, Index v0, Index N, Index Vl, Index real_cols) {
  Kokkos::parallel_for("vocab_ce_local_sums", row_teams(N), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index i = team_row(team);
    if (i >= N) return;
    const L* z = logits + i * Vl;
    const float mx = row_max[i];
    float sum = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, real_cols), [&](Index v, float& s) { s += fast_exp(to_float(z[v]) - mx); },
        sum);
    Kokkos::single(Kokkos::PerThread(team), [&] {
      sum_exp[i] = sum;
      const Index t = static_cast<Index>(targets[i]) - v0;
      target_logit[i] = t >= 0 && t < real_cols ? to_float(z[t]) : 0.0f;
    });
  });
}

// A thread per logit, then a thread per row for its target, as crossentropy_backward's device form.
ZERO3D_KERNEL void vocab_ce_backward(float* logits, const float* lse, const int32_t* targets, float dloss, Index v0, Index N,
                              Index Vl, Index real_cols) {
  Kokkos::parallel_for("vocab_ce_backward", range(N * Vl), KOKKOS_LAMBDA(Index j) {
    logits[j] = j % Vl < real_cols ? fast_exp(logits[j] - lse[j / Vl]) * dloss : 0.0f;
  });
  Kokkos::parallel_for("vocab_ce_backward_target", range(N), KOKKOS_LAMBDA(Index i) {
    const Index t = static_cast<Index>(targets[i]) - v0;
    if (t >= 0 && t < real_cols) logits[i * Vl + t] -= dloss;
  });
}

// A thread per logit, the target's subtraction in the same thread: each gradient made in fp32
// and rounded once, over its own logit.
ZERO3D_KERNEL void vocab_ce_backward_bf16(bf16* logits, const float* lse, const int32_t* targets, float dloss, Index v0,
                                          Index N, Index Vl, Index real_cols) {
  Kokkos::parallel_for("vocab_ce_backward_bf16", range(N * Vl), KOKKOS_LAMBDA(Index j) {
    const Index i = j / Vl, c = j - i * Vl;
    float g = 0.0f;
    if (c < real_cols) {
      g = fast_exp(to_float(logits[j]) - lse[i]) * dloss;
      if (c == static_cast<Index>(targets[i]) - v0) g -= dloss;
    }
    logits[j] = to_bf16(g);
  });
}

}  // namespace gpu

// out[bt,:] = wte_local[token - v0,:] for tokens this rank owns, else 0 (summed over the group next).
template <typename P>
ZERO3D_KERNEL void vocab_embedding_forward(float* out, const int32_t* tokens, const P* wte_local, Index v0, Index Vl, Index N,
                                    Index C) {
#ifdef ZERO3D_DEVICE
  gpu::vocab_embedding_forward(out, tokens, wte_local, v0, Vl, N, C);
#else
  Kokkos::parallel_for("vocab_embedding_forward", range(N), KOKKOS_LAMBDA(Index bt) {
    const Index id = static_cast<Index>(tokens[bt]) - v0;
    float* o = out + bt * C;
    if (id < 0 || id >= Vl) {
      for (Index c = 0; c < C; ++c) o[c] = 0.0f;
    } else {
      const P* w = wte_local + id * C;
      for (Index c = 0; c < C; ++c) o[c] = to_float(w[c]);
    }
  });
#endif
}

// out[i,:] += wpe[(first + i) mod T,:] for N tokens starting at token `first` of the micro-batch
// (the position embedding, replicated, added after the sum; a token shard with sequence parallelism).
template <typename P>
ZERO3D_KERNEL void add_position_embedding(float* out, const P* wpe, Index first, Index N, Index T, Index C) {
#ifdef ZERO3D_DEVICE
  gpu::add_position_embedding(out, wpe, first, N, T, C);
#else
  Kokkos::parallel_for("add_position_embedding", range(N), KOKKOS_LAMBDA(Index i) {
    const P* p = wpe + ((first + i) % T) * C;
    float* o = out + i * C;
    for (Index c = 0; c < C; ++c) o[c] += to_float(p[c]);
  });
#endif
}

// dwte_local[token - v0] += dout for owned tokens; dwpe[t] += dout (channel blocks: no atomics).
ZERO3D_KERNEL void vocab_embedding_backward(float* dwte_local, float* dwpe, const float* dout, const int32_t* tokens, Index v0,
                                     Index Vl, Index B, Index T, Index C) {
#ifdef ZERO3D_DEVICE
  gpu::vocab_embedding_backward(dwte_local, dwpe, dout, tokens, v0, Vl, B, T, C);
#else
  constexpr Index kBlock = 16;
  Kokkos::parallel_for("vocab_embedding_backward", range((C + kBlock - 1) / kBlock), KOKKOS_LAMBDA(Index blk) {
    const Index c0 = blk * kBlock, c1 = c0 + kBlock < C ? c0 + kBlock : C;
    for (Index bt = 0; bt < B * T; ++bt) {
      const Index id = static_cast<Index>(tokens[bt]) - v0;
      const float* d = dout + bt * C;
      float* p = dwpe + (bt % T) * C;
      for (Index c = c0; c < c1; ++c) p[c] += d[c];
      if (id < 0 || id >= Vl) continue;
      float* w = dwte_local + id * C;
      for (Index c = c0; c < c1; ++c) w[c] += d[c];
    }
  });
#endif
}

// Step 1: row max over this rank's real columns (global ids < V); all-reduce MAX next.
// Logits fp32 or bf16 (L: a GPU's bf16 step, model/bf16_activations.hpp logits_bf16), each
// widened as it is read: the bits of the fp32 form on the widened values, in steps 1 and 2.
template <typename L>
ZERO3D_KERNEL void vocab_ce_local_max(float* row_max, const L* logits, Index N, Index Vl, Index real_cols) {
#ifdef ZERO3D_DEVICE
  gpu::vocab_ce_local_max(row_max, logits, N, Vl, real_cols);
#else
  Kokkos::parallel_for("vocab_ce_local_max", range(N), KOKKOS_LAMBDA(Index i) {
    const L* z = logits + i * Vl;
    float mx = -INFINITY;
    for (Index v = 0; v < real_cols; ++v) mx = to_float(z[v]) > mx ? to_float(z[v]) : mx;
    row_max[i] = mx;
  });
#endif
}

// Step 2: sum of exp(z - max) over real columns, and the target's logit where this rank owns
// it (0 elsewhere); all-reduce SUM of both next.
template <typename L>
ZERO3D_KERNEL void vocab_ce_local_sums(float* sum_exp, float* target_logit, const L* logits, const float* row_max,
                                const int32_t* targets, Index v0, Index N, Index Vl, Index real_cols) {
#ifdef ZERO3D_DEVICE
  gpu::vocab_ce_local_sums(sum_exp, target_logit, logits, row_max, targets, v0, N, Vl, real_cols);
#else
  Kokkos::parallel_for("vocab_ce_local_sums", range(N), KOKKOS_LAMBDA(Index i) {
    const L* z = logits + i * Vl;
    const float mx = row_max[i];
    float sum = 0.0f;
    for (Index v = 0; v < real_cols; ++v) sum += fast_exp(to_float(z[v]) - mx);
    sum_exp[i] = sum;
    const Index t = static_cast<Index>(targets[i]) - v0;
    target_logit[i] = t >= 0 && t < real_cols ? to_float(z[t]) : 0.0f;
  });
#endif
}

// Step 3: losses[i] = lse - target logit, lse = max + log(sum_exp) saved for the backward.
ZERO3D_KERNEL void vocab_ce_finish(float* losses, float* lse, const float* row_max, const float* sum_exp,
                            const float* target_logit, Index N) {
  Kokkos::parallel_for("vocab_ce_finish", range(N), KOKKOS_LAMBDA(Index i) {
    lse[i] = row_max[i] + std::log(sum_exp[i]);
    losses[i] = lse[i] - target_logit[i];
  });
}

// logits <- dloss · (softmax − onehot) on this rank's columns, padding columns 0 (no
// communication: the group sum happens in the head's input-gradient all-reduce).
ZERO3D_KERNEL void vocab_ce_backward(float* logits, const float* lse, const int32_t* targets, float dloss, Index v0, Index N,
                              Index Vl, Index real_cols) {
#ifdef ZERO3D_DEVICE
  gpu::vocab_ce_backward(logits, lse, targets, dloss, v0, N, Vl, real_cols);
#else
  Kokkos::parallel_for("vocab_ce_backward", range(N), KOKKOS_LAMBDA(Index i) {
    float* z = logits + i * Vl;
    const float l = lse[i];
    for (Index v = 0; v < real_cols; ++v) z[v] = fast_exp(z[v] - l) * dloss;
    for (Index v = real_cols; v < Vl; ++v) z[v] = 0.0f;
    const Index t = static_cast<Index>(targets[i]) - v0;
    if (t >= 0 && t < real_cols) z[t] -= dloss;
  });
#endif
}

// The same over bf16 logits, the gradient written over them (logits_bf16): each made in fp32 by
// vocab_ce_backward's statements on the widened logit, then rounded once.
ZERO3D_KERNEL void vocab_ce_backward_bf16(bf16* logits, const float* lse, const int32_t* targets, float dloss, Index v0,
                                          Index N, Index Vl, Index real_cols) {
#ifdef ZERO3D_DEVICE
  gpu::vocab_ce_backward_bf16(logits, lse, targets, dloss, v0, N, Vl, real_cols);
#else
  Kokkos::parallel_for("vocab_ce_backward_bf16", range(N), KOKKOS_LAMBDA(Index i) {
    bf16* z = logits + i * Vl;
    const float l = lse[i];
    const Index t = static_cast<Index>(targets[i]) - v0;
    for (Index v = 0; v < Vl; ++v) {
      float g = 0.0f;
      if (v < real_cols) {
        g = fast_exp(to_float(z[v]) - l) * dloss;
        if (v == t) g -= dloss;
      }
      z[v] = to_bf16(g);
    }
  });
#endif
}

}  // namespace zero3d::kernels
