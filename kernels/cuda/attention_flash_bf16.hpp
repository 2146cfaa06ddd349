// attention_flash_bf16.hpp (CUDA) — fused causal self-attention in bf16 on the GPU: the device
// form of kernels/cpu/attention_flash_bf16.hpp, same algorithm and contract (FlashAttention-2,
// T. Dao, 2023). The forward runs blocks of 64 query rows against blocks of 64 keys with an
// online softmax, so no T×T matrix is ever written; it leaves each row's natural log-sum-exp
// L = m·scale + ln l and the bf16 output O for the backward. The backward recomputes
// P = exp(S·scale − L) per tile, with D = rowsum(dO ∘ O): one kernel per key block for dK and dV
// (query blocks walked in order), one per query block for dQ (key blocks in order), so every sum
// has one owner and a fixed order: no atomics, the same bits on every run.
//
// Products are tensor-core WMMA 16×16×16 tiles with bf16 operands and fp32 accumulation; q, k,
// v, dO, P and dS enter them as bf16 (as the CPU kernel's do), scores, softmax and sums stay
// fp32. Head sizes 64 and 128 (serves()); the dense path in attention_bf16.hpp takes the rest.
#pragma once

#include "kernels/common.hpp"

namespace zero3d::kernels {
struct bf16;

namespace cuda_flash {

// Whether the fused kernels serve a head size.
bool serves(Index hs);

// out [B][T][C] (O: float or bf16); lse [B·H][T]; osave [B·H][T][hs] bf16; qkv [B][T][3C] (Q: float
// or bf16). Launched on the default execution space's stream.
template <typename O, typename Q>
void forward(O* out, float* lse, bf16* osave, const Q* qkv, Index B, Index T, Index C, Index H);

// dqkv [B][T][3C] written (all of it) from dout [B][T][C], the forward's qkv, lse and osave.
template <typename Q>
void backward(float* dqkv, const float* dout, const Q* qkv, const float* lse, const bf16* osave, Index B, Index T,
              Index C, Index H);

}  // namespace cuda_flash
}  // namespace zero3d::kernels
