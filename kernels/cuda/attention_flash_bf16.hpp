// attention_flash_bf16.hpp (CUDA) — fused causal self-attention in bf16 on the GPU: the device
// form of kernels/cpu/attention_flash_bf16.hpp, same algorithm and contract (FlashAttention-2,
// T. Dao, 2023). The forward runs blocks of 64 query rows against blocks of 64 keys with an
// online softmax, so no T×T matrix is ever written; it leaves each row's natural log-sum-exp
// L = m·scale + ln l and the bf16 output O for the backward. The backward recomputes
// P = exp(S·scale − L) per tile, with D = rowsum(dO ∘ O): one kernel per key block for dK and dV
// (query blocks walked in order), one per query block for dQ (key blocks in order), so every sum
// has one owner and a fixed order: no atomics, the same bits on every run.
//
// Products are tensor-core mma.sync m16n8k16 tiles with bf16 operands and fp32 accumulation,
// each warp's scores and accumulators held in registers (FlashAttention-2, §3.3); q, k, v, dO, P
// and dS enter them as bf16 (as the CPU kernel's do), scores, softmax and sums stay fp32. Head
// sizes 64 and 128 (serves()); the dense path in attention_bf16.hpp takes the rest. The kernels
// are in attention_flash_bf16_kernels.hpp.
// Grouped-query heads and a sliding window (the Llama family's attention_gqa.hpp) as the CPU
// kernel's flash::Heads takes them.
#pragma once

#include "kernels/common.hpp"

namespace zero3d::kernels {
struct bf16;

namespace cuda_flash {

// Whether the fused kernels serve a head size. (This and backward_scratch_bytes are host
// arithmetic that every build reads: a CPU build plans a GPU run with them.)
inline bool serves(Index hs) { return hs == 64 || hs == 128; }

// H query heads over Hkv K/V heads (H a multiple of Hkv; GPT-2: Hkv = H) of size hs, and a sliding
// window (0: none; Mistral: query t sees keys t − window < k ≤ t).
struct Heads {
  Index H, Hkv, hs, window;
};

// out [B][T][H·hs] (O: float or bf16); lse [B·H][T]; osave [B·H][T][hs] bf16; qkv [B][T][(H + 2·Hkv)·hs]
// (q heads, then k heads, then v heads; Q: float or bf16). Launched on the default execution
// space's stream.
template <typename O, typename Q>
void forward(O* out, float* lse, bf16* osave, const Q* qkv, Index B, Index T, const Heads& heads);

// dqkv [B][T][(H + 2·Hkv)·hs] written (all of it) from dout [B][T][H·hs], the forward's qkv, lse
// and osave; K/V's gradients summed over each group's query heads in head order.
template <typename Q>
void backward(float* dqkv, const float* dout, const Q* qkv, const float* lse, const bf16* osave, Index B, Index T,
              const Heads& heads);

// The device memory backward() takes beside its arguments for B·H = BH heads of size hs: D =
// rowsum(dO ∘ O), one float per head and query row, and dO in bf16 (the memory plan's attention
// scratch counts them).
inline int64_t backward_scratch_bytes(Index BH, Index T, Index hs) { return 4 * BH * T + 2 * BH * T * hs; }

// GPT-2's layout: qkv [B][T][3C], C = H·hs, no groups, no window.
template <typename O, typename Q>
void forward(O* out, float* lse, bf16* osave, const Q* qkv, Index B, Index T, Index C, Index H) {
  forward(out, lse, osave, qkv, B, T, Heads{H, H, C / H, 0});
}
template <typename Q>
void backward(float* dqkv, const float* dout, const Q* qkv, const float* lse, const bf16* osave, Index B, Index T,
              Index C, Index H) {
  backward(dqkv, dout, qkv, lse, osave, B, T, Heads{H, H, C / H, 0});
}

}  // namespace cuda_flash
}  // namespace zero3d::kernels
