// encoder.hpp — GPT-2 input embedding: out[b,t,:] = wte[token[b,t],:] + wpe[t,:]; and the Llama
// family's, the token rows alone (token_embedding_forward/backward).
#pragma once

#include <Kokkos_Sort.hpp>
#include <limits>

#include "kernels/common.hpp"
#include "kernels/device_forms.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

namespace gpu {

// A thread per element: neighbouring threads read neighbouring channels (coalesced), where a
// thread per row strides C apart. Each element's sum is the CPU form's.
template <typename P>
ZERO3D_KERNEL void encoder_forward(float* out, const int32_t* tokens, const P* wte, const P* wpe, Index B, Index T, Index C) {
  Kokkos::parallel_for("encoder_forward", range(B * T * C), KOKKOS_LAMBDA(Index j) {
    const Index bt = j / C, c = j % C;
    out[j] = to_float(wte[static_cast<Index>(tokens[bt]) * C + c]) + to_float(wpe[(bt % T) * C + c]);
  });
}

// dwpe[t] += Σ_b dout[b,t]: a thread per (t, channel) adds the batch in order, the order in which
// the CPU form's walk over b·T + t reaches it (the same bits).
ZERO3D_KERNEL void position_embedding_backward(float* dwpe, const float* dout, Index B, Index T, Index C) {
  Kokkos::parallel_for("position_embedding_backward", range(T * C), KOKKOS_LAMBDA(Index j) {
    float acc = dwpe[j];
    for (Index b = 0; b < B; ++b) acc += dout[b * T * C + j];
    dwpe[j] = acc;
  });
}

// dwte_local[token - v0] += dout[bt] for tokens in [v0, v0 + Vl), without atomics: the positions
// are grouped by token by sorting unique keys token·BT + bt (so a token's positions stay in
// order), and a warp per run of one token adds that token's rows in position order into its row
// of dwte: the CPU form's order, the same bits, on every run (llm.c encoder.cuh:47-60 buckets the
// positions by token the same way, on the host). A token that repeats many times is one warp's
// serial work; the other warps carry on. Kokkos::sort returns when the keys are sorted (on CUDA
// through thrust): one wait for the host a backward pass.
ZERO3D_KERNEL void embedding_rows_backward(float* dwte_local, const float* dout, const int32_t* tokens, Index v0, Index Vl,
                                    Index BT, Index C) {
  Index* keys = kernel_scratch<Index>(BT);
  // tokens this rank does not own get negative keys (unique too), sorted ahead of the rest
  Kokkos::parallel_for("embedding_backward_keys", range(BT), KOKKOS_LAMBDA(Index bt) {
    const Index id = static_cast<Index>(tokens[bt]) - v0;
    keys[bt] = id >= 0 && id < Vl ? id * BT + bt : -1 - bt;
  });
  Kokkos::sort(Kokkos::View<Index*, ExecSpace::memory_space, Kokkos::MemoryUnmanaged>(keys, static_cast<size_t>(BT)));
  Kokkos::parallel_for("embedding_backward_rows", row_teams(BT), KOKKOS_LAMBDA(const RowTeam& team) {
    const Index k = team_row(team);
    if (k >= BT || keys[k] < 0) return;
    const Index id = keys[k] / BT;
    if (k > 0 && keys[k - 1] >= 0 && keys[k - 1] / BT == id) return;  // not the first position of its run
    Index end = k + 1;
    while (end < BT && keys[end] / BT == id) ++end;
    float* w = dwte_local + id * C;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, C), [&](Index c) {
      float acc = w[c];
      for (Index r = k; r < end; ++r) acc += dout[(keys[r] % BT) * C + c];
      w[c] = acc;
    });
  });
}

inline void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, Index B, Index T,
                             Index C) {
  position_embedding_backward(dwpe, dout, B, T, C);
  embedding_rows_backward(dwte, dout, tokens, 0, std::numeric_limits<int32_t>::max(), B * T, C);
}

template <typename P>
ZERO3D_KERNEL void token_embedding_forward(float* out, const int32_t* tokens, const P* weight, Index N, Index C) {
  Kokkos::parallel_for("token_embedding_forward", range(N * C), KOKKOS_LAMBDA(Index j) {
    out[j] = to_float(weight[static_cast<Index>(tokens[j / C]) * C + j % C]);
  });
}

}  // namespace gpu

template <typename P>
ZERO3D_KERNEL void encoder_forward(float* out, const int32_t* tokens, const P* wte, const P* wpe, Index B, Index T, Index C) {
#ifdef ZERO3D_DEVICE
  gpu::encoder_forward(out, tokens, wte, wpe, B, T, C);
#else
  Kokkos::parallel_for("encoder_forward", range(B * T), KOKKOS_LAMBDA(Index bt) {
    const P* w = wte + static_cast<Index>(tokens[bt]) * C;
    const P* p = wpe + (bt % T) * C;
    float* o = out + bt * C;
    for (Index c = 0; c < C; ++c) o[c] = to_float(w[c]) + to_float(p[c]);
  });
#endif
}

// dst[c] += src[c] for c in [c0, c1): the embedding backwards' column-block step (a block
// belongs to one iteration, so a repeated token needs no atomics).
KOKKOS_INLINE_FUNCTION void add_row_block(float* dst, const float* src, Index c0, Index c1) {
  for (Index c = c0; c < c1; ++c) dst[c] += src[c];
}

#ifndef ZERO3D_DEVICE
// body(c0, c1) for each block of 16 columns, blocks in parallel (host forms only: the device
// forms sort positions by token instead).
template <typename Body>
inline void column_blocks(const char* name, Index C, const Body& body) {
  constexpr Index kBlock = 16;
  Kokkos::parallel_for(name, range((C + kBlock - 1) / kBlock), [&](Index blk) {
    const Index c0 = blk * kBlock;
    body(c0, c0 + kBlock < C ? c0 + kBlock : C);
  });
}
#endif

// dwte[token] += dout, dwpe[t] += dout. Parallel over channel blocks, so no two iterations
// touch the same element even when a token repeats (no atomics needed).
ZERO3D_KERNEL void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, Index B, Index T,
                             Index C) {
#ifdef ZERO3D_DEVICE
  gpu::encoder_backward(dwte, dwpe, dout, tokens, B, T, C);
#else
  column_blocks("encoder_backward", C, [=](Index c0, Index c1) {
    for (Index bt = 0; bt < B * T; ++bt) {
      const float* d = dout + bt * C;
      add_row_block(dwte + static_cast<Index>(tokens[bt]) * C, d, c0, c1);
      add_row_block(dwpe + (bt % T) * C, d, c0, c1);
    }
  });
#endif
}

// The Llama family's input embedding (LlamaModel.embed_tokens, no position embedding; RoPE
// places tokens inside attention): out[i,:] = weight[token[i],:] for N tokens.
template <typename P>
ZERO3D_KERNEL void token_embedding_forward(float* out, const int32_t* tokens, const P* weight, Index N, Index C) {
#ifdef ZERO3D_DEVICE
  gpu::token_embedding_forward(out, tokens, weight, N, C);
#else
  Kokkos::parallel_for("token_embedding_forward", range(N), KOKKOS_LAMBDA(Index i) {
    const P* w = weight + static_cast<Index>(tokens[i]) * C;
    float* o = out + i * C;
    for (Index c = 0; c < C; ++c) o[c] = to_float(w[c]);
  });
#endif
}

// dweight_local[token − v0] += dout for the N tokens in [v0, v0 + Vl) (the rows this rank holds:
// all of them, or its vocabulary share with tensor parallelism): channel blocks on the CPU (no two
// iterations touch the same element when a token repeats), the device form's positions sorted
// by token; both add a token's rows in position order (the same bits).
ZERO3D_KERNEL void token_embedding_backward(float* dweight_local, const float* dout, const int32_t* tokens, Index v0,
                                            Index Vl, Index N, Index C) {
#ifdef ZERO3D_DEVICE
  gpu::embedding_rows_backward(dweight_local, dout, tokens, v0, Vl, N, C);
#else
  column_blocks("token_embedding_backward", C, [=](Index c0, Index c1) {
    for (Index i = 0; i < N; ++i) {
      const Index id = static_cast<Index>(tokens[i]) - v0;
      if (id < 0 || id >= Vl) continue;
      add_row_block(dweight_local + id * C, dout + i * C, c0, c1);
    }
  });
#endif
}

}  // namespace zero3d::kernels
