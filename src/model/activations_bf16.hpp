// activations_bf16.hpp — which block activations bf16 compute keeps in bf16 (GPT-2's block in
// model.cpp, the Llama family's in llama_block.cpp).
#pragma once

#include "base/dtype.hpp"
#include "kernels/half.hpp"

namespace zero3d {

// bf16 compute without tensor parallelism keeps the inputs of the bf16 products (ln_1, the
// attention output, ln_2, the GELU output) in bf16 in their float-sized buffers; an MoE block's
// MLP half keeps fp32 (its gate and experts read ln_2). Forward and backward ask the same question.
inline bool activations_bf16(DType compute, bool tensor_parallel, bool moe_block, bool mlp_half) {
  return compute == DType::BF16 && !tensor_parallel && !(mlp_half && moe_block);
}
inline kernels::bf16* as_bf16(float* x) { return reinterpret_cast<kernels::bf16*>(x); }

}  // namespace zero3d
