// bf16_activations.hpp — which activations a block keeps in bf16 (GPT-2's block in model.cpp,
// the Llama family's in llama_block.cpp; the saves' sizes in model_layout.cpp follow it), and
// whether the head keeps its logits in bf16.
#pragma once

#include "base/dtype.hpp"
#include "kernels/device.hpp"
#include "kernels/half.hpp"

namespace zero3d {

// Tests turn on the GPU build's bf16 saves under tensor parallelism (activations_bf16) in a CPU
// build, whose own tensor-parallel saves stay fp32.
inline bool& tensor_parallel_bf16_on_host() {
  static bool on = false;
  return on;
}

// bf16 compute keeps the inputs of the bf16 products (ln_1, the attention output, ln_2, the
// MLP's activation) in bf16 in their float-sized buffers, and the products round their own
// outputs where bf16 is all their reader takes (q, k, v; c_fc's): the products round them
// anyway, so the rounding passes go and the backward reads half the bytes. An MoE block's MLP
// half keeps fp32 (its gate and experts read ln_2). Forward and backward ask the same question.
// Under tensor parallelism a GPU build does the same to each rank's slices (Megatron keeps its
// activations in the model's bf16 too): a norm's output that sequence parallelism gathers is
// gathered in bf16, half the bytes, while the row-parallel products' partial sums still cross the
// group in fp32. The CPU build keeps fp32 saves there, so its tensor-parallel losses keep their
// bits. backend: the build asked about (a plan's).
inline bool activations_bf16(DType compute, bool tensor_parallel, bool moe_block, bool mlp_half,
                             kernels::Backend backend = kernels::kBuildBackend) {
  const bool tp_ok = !tensor_parallel || backend == kernels::Backend::Gpu || tensor_parallel_bf16_on_host();
  return compute == DType::BF16 && tp_ok && !(mlp_half && moe_block);
}

// Tests turn on the GPU build's bf16 logits in a CPU build (logits_bf16), whose own logits stay fp32.
inline bool& logits_bf16_on_host() {
  static bool on = false;
  return on;
}

// A GPU's bf16 step keeps the logits in bf16 (the head's product rounds them in its epilogue, as
// DeepSpeed's bf16 model and torch.autocast's linear give them) and writes their gradient over
// them: 2 bytes an element where the fp32 logits and the gradient's bf16 operand beside them held 6
// (3.3 GB less at GPT-2 124M's micro-batch 16, T 1024, V 50,304), and the classifier reads and
// writes half the bytes. The vocab-parallel head too: its row maxima and sums cross the tensor
// group in fp32, as Megatron's vocab_parallel_cross_entropy takes them from bf16 logits. The CPU
// build keeps fp32 logits, so its losses keep their bits. backend: the build asked about (a plan's).
inline bool logits_bf16(DType compute, kernels::Backend backend = kernels::kBuildBackend) {
  return compute == DType::BF16 && (backend == kernels::Backend::Gpu || logits_bf16_on_host());
}

// A float-sized buffer read as the bf16 values it holds.
inline kernels::bf16* as_bf16(float* x) { return reinterpret_cast<kernels::bf16*>(x); }
inline const kernels::bf16* as_bf16(const float* x) { return reinterpret_cast<const kernels::bf16*>(x); }

}  // namespace zero3d
