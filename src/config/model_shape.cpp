#include "config/model_shape.hpp"

namespace zero3d {

GPTShape gpt_shape_of(const ModelConfig& m) {
  GPTShape s{m.vocab_size, m.n_positions, m.n_layer, m.n_head, m.n_embd};
  s.moe = MoeShape{m.moe.num_experts, m.moe.every, m.moe.use_residual, m.moe.enable_expert_tensor_parallelism};
  s.sparse = m.sparse_attention;
  s.family = m.family;
  return s;
}

}  // namespace zero3d
