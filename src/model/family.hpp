// family.hpp — which decoder a model is (model.architecture) and the Llama family's settings
// beyond the sizes GPTShape holds. Plain C++ (no Kokkos): the configuration reader fills it.
//
// The Llama family (Llama, Mistral, Qwen2) shares one block, Hugging Face's LlamaDecoderLayer
// (modeling_llama.py): x + o_proj(attn(rope(q), rope(k), v)) on RMSNorm(x), then
// x + down_proj(silu(gate_proj(h)) · up_proj(h)) on RMSNorm(x); grouped-query attention, no
// position embedding, a final RMSNorm and an LM head that is untied by default. The families
// differ in defaults and in two switches: q/k/v biases (Qwen2) and a sliding window
// (Mistral on every layer, Qwen2 on layers >= max_window_layers when use_sliding_window).
// Mixtral (modeling_mixtral.py MixtralDecoderLayer) is Mistral's attention with the MLP replaced
// by a sparse MoE block in every layer (MixtralSparseMoeBlock: a router, num_local_experts
// SwiGLU experts), which runs on zero3d's MoE machinery (moe_layer.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/rope_config.hpp"

namespace zero3d {

enum class Architecture { GPT2, Llama, Mistral, Qwen2, Mixtral };

// Dropout in training (kernels/dropout.hpp): GPT-2's embd_pdrop (after wte + wpe), attn_pdrop
// (the attention probabilities) and resid_pdrop (each residual branch's output); the Llama
// family's attention_dropout is attn. All 0 (zero3d's default): no dropout, today's bits.
// seed: the masks' stream (training.seed).
// The masks compare 24 random bits with ⌊p·2²⁴⌋ (kernels/dropout.hpp): a p > 0 below this
// would drop nothing, so the reader refuses it.
constexpr double kDropoutResolution = 1.0 / 16777216.0;
struct DropoutRates {
  double embd = 0.0, attn = 0.0, resid = 0.0;
  uint64_t seed = 0;
  bool any() const { return embd > 0.0 || attn > 0.0 || resid > 0.0; }
};

// "gpt2", "llama", "mistral", "qwen2", "mixtral": the model.architecture value (Hugging Face's model_type).
inline const char* architecture_name(Architecture a) {
  switch (a) {
    case Architecture::Llama: return "llama";
    case Architecture::Mistral: return "mistral";
    case Architecture::Qwen2: return "qwen2";
    case Architecture::Mixtral: return "mixtral";
    case Architecture::GPT2: break;
  }
  return "gpt2";
}

// The Llama-family knobs, under Hugging Face's config.json names (configuration_llama.py,
// configuration_mistral.py, configuration_qwen2.py). Sizes shared with GPT-2 live in GPTShape:
// hidden_size = n_embd, num_hidden_layers = n_layer, num_attention_heads = n_head, vocab_size.
struct DecoderFamily {
  Architecture arch = Architecture::GPT2;
  int64_t num_key_value_heads = 0;  // Hkv: divides n_head
  int64_t head_dim = 0;             // d: need not be n_embd / n_head
  int64_t intermediate_size = 0;    // I: SwiGLU's hidden width
  double rms_norm_eps = 1e-6;
  kernels::RopeConfig rope;         // rope_theta, rope_scaling, max_position_embeddings
  bool tie_word_embeddings = false;  // the LM head reads model.embed_tokens.weight (no lm_head.weight)
  bool qkv_bias = false;            // q/k/v_proj biases: Qwen2 always, Llama with attention_bias
  bool o_bias = false;              // o_proj bias: Llama's attention_bias
  bool mlp_bias = false;            // gate/up/down_proj biases: Llama's mlp_bias
  std::vector<int64_t> window;      // per layer: its sliding window, 0 for full causal attention
  double initializer_range = 0.02;  // std of every Linear and Embedding weight at initialisation
  // config.json's bos_token_id and eos_token_id (an id, or a list of them: Llama 3's several
  // end-of-turn ids); empty for None. Informational: no computation reads them, `zero3d
  // convert` writes them back.
  std::vector<int64_t> bos_token_id, eos_token_id;
  // Mixtral's router (configuration_mixtral.py): the expert count and top-k are model.moe's
  // num_experts and k; these two say whether the load-balancing loss enters the loss, as
  // MixtralForCausalLM adds router_aux_loss_coef · aux only when output_router_logits is true.
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;

  bool llama() const { return arch != Architecture::GPT2; }
  bool mixtral() const { return arch == Architecture::Mixtral; }
  int64_t window_of(int64_t layer) const {
    return layer < static_cast<int64_t>(window.size()) ? window[static_cast<size_t>(layer)] : 0;
  }
};

}  // namespace zero3d
