// autocast.hpp — torch_autocast (DeepSpeed's "PyTorch Automatic Mixed Precision", seed API docs
// §2.1.5) as this model takes it: fp32 parameters, matrix products in the autocast dtype (GPT's
// `autocast`), and the parameters of the lower_precision_safe_modules communicated in that dtype
// (their gradients reduced, at ZeRO stage 3 their parameters gathered). Config fills it.
#pragma once

#include <string>

#include "base/dtype.hpp"

namespace zero3d {

// lower_precision_safe_modules as the module kinds of this model: Linear (the blocks' four
// projections, and an MoE block's gate, coefficient and experts), Embedding (wte, wpe; the LM
// head is tied to wte, so it is the embedding's tensor) and LayerNorm (ln_1, ln_2, ln_f).
// DeepSpeed's default list [Linear, Conv1d, Conv2d, Conv3d] is `linear` alone here.
struct LowPrecisionModules {
  bool linear = true, embedding = false, layer_norm = false;
};

struct AutocastConfig {
  DType dtype = DType::F32;  // BF16 or F16 when torch_autocast.enabled; F32: off
  LowPrecisionModules modules;
  bool enabled() const { return dtype != DType::F32; }
};

// Whether layout tensor `name` is a parameter of one of `modules`.
bool low_precision_tensor(const std::string& name, const LowPrecisionModules& modules);

}  // namespace zero3d
