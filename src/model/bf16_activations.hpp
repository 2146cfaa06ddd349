// bf16_activations.hpp — which activations a block keeps in bf16 (GPT-2's block in model.cpp,
// the Llama family's in llama_block.cpp; the saves' sizes in model_layout.cpp follow it).
#pragma once

#include "base/dtype.hpp"
#include "kernels/half.hpp"

namespace zero3d {

// bf16 compute without tensor parallelism keeps the inputs of the bf16 products (ln_1, the
// attention output, ln_2, the MLP's activation) in bf16 in their float-sized buffers: the
// products round them anyway, so the rounding passes go and the backward reads half the bytes.
// An MoE block's MLP half keeps fp32 (its gate and experts read ln_2). Forward and backward ask
// the same question.
inline bool activations_bf16(DType compute, bool tensor_parallel, bool moe_block, bool mlp_half) {
  return compute == DType::BF16 && !tensor_parallel && !(mlp_half && moe_block);
}

// A float-sized buffer read as the bf16 values it holds.
inline kernels::bf16* as_bf16(float* x) { return reinterpret_cast<kernels::bf16*>(x); }
inline const kernels::bf16* as_bf16(const float* x) { return reinterpret_cast<const kernels::bf16*>(x); }

}  // namespace zero3d
