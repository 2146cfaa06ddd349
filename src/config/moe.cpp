// config/moe.cpp — model.moe: DeepSpeed's MoE layer arguments (deepspeed/moe/layer.py MoE(...),
// DEEPSPEED-FACTS-2 §4.1) as a config section, and the checks that need the whole run's layout.
#include "config/section.hpp"

namespace zero3d::config_detail {

MoeConfig read_moe(Section& model) {
  MoeConfig m;
  if (!model.has("moe")) return m;  // a dense model: nothing recorded, the resolved config stays as it was
  Section sec = model.child("moe");
  m.num_experts = sec.integer("num_experts", 1, 1, 1 << 16);
  m.every = sec.integer("every", 1, 1, 4096);
  m.ep_size = sec.integer("ep_size", 1, 1, 1 << 16);
  m.k = sec.integer("k", 1, 1, 1 << 16);  // top-1, top-2, or top-k (DeepSpeed topkgating) for k > 2
  m.capacity_factor = sec.number("capacity_factor", 1.0, 0.0, 1e6, /*lo_open=*/true);
  m.eval_capacity_factor = sec.number("eval_capacity_factor", 1.0, 0.0, 1e6, /*lo_open=*/true);
  m.min_capacity = sec.integer("min_capacity", 4, 0, int64_t(1) << 40);
  m.use_residual = sec.boolean("use_residual", false);
  // DeepSpeed asserts noisy_gate_policy in (None, 'None', 'Jitter', 'RSample').
  const json* noise = sec.raw("noisy_gate_policy");
  if (noise && !noise->is_null()) {
    const std::string v = noise->is_string() ? noise->get<std::string>() : "";
    if (v == "Jitter" || v == "RSample") m.noisy_gate_policy = v;
    else if (v != "None")
      sec.report_key("noisy_gate_policy", "value " + show(*noise) + " is not one of null, \"None\", \"Jitter\", \"RSample\"");
  }
  sec.record("noisy_gate_policy", m.noisy_gate_policy.empty() ? json(nullptr) : json(m.noisy_gate_policy));
  m.drop_tokens = sec.boolean("drop_tokens", true);
  m.use_rts = sec.boolean("use_rts", true);
  m.top2_2nd_expert_sampling = sec.boolean("top2_2nd_expert_sampling", true);
  m.enable_expert_tensor_parallelism = sec.boolean("enable_expert_tensor_parallelism", false);
  m.aux_loss_coef = sec.number("aux_loss_coef", 0.01, 0.0, 1e6);
  // Tutel is a CUDA kernel library: the same routing, computed by other kernels.
  sec.hardware_only("use_tutel", false, "Tutel's fused CUDA dispatch kernels; zero3d routes with its own kernels, same result");
  sec.finish();
  if (m.k > m.num_experts)
    sec.report_key("k", "k " + std::to_string(m.k) + " is more than num_experts (" + std::to_string(m.num_experts) + ")");
  if (m.num_experts % m.ep_size != 0)
    sec.report_key("ep_size", "num_experts (" + std::to_string(m.num_experts) + ") is not divisible by ep_size (" +
                                  std::to_string(m.ep_size) + ")");
  return m;
}

void read_mixtral_moe(Section& model, MoeConfig& m) {
  if (!model.has("moe")) return;
  Section sec = model.child("moe");
  m.ep_size = sec.integer("ep_size", 1, 1, 1 << 16);
  // the rest is Mixtral's routing, set by its own keys (num_local_experts, num_experts_per_tok, ...)
  for (const char* key : {"num_experts", "every", "k", "capacity_factor", "eval_capacity_factor", "min_capacity",
                          "use_residual", "noisy_gate_policy", "drop_tokens", "use_rts", "top2_2nd_expert_sampling",
                          "enable_expert_tensor_parallelism", "aux_loss_coef", "use_tutel"}) {
    sec.mark_known(key);
    if (sec.has(key))
      sec.report_key(key, "model.architecture mixtral routes as Hugging Face's MixtralSparseMoeBlock (experts from "
                          "num_local_experts, top-k from num_experts_per_tok, no capacity, router_aux_loss_coef); "
                          "model.moe takes ep_size only");
  }
  sec.finish();
  if (m.num_experts % m.ep_size != 0)
    sec.report_key("ep_size", "num_local_experts (" + std::to_string(m.num_experts) + ") is not divisible by ep_size (" +
                                  std::to_string(m.ep_size) + ")");
}

void check_moe(Section& top, const Config& c, int64_t dp) {
  const MoeConfig& m = c.model.moe;
  if (!m.enabled()) return;
  if (m.every > c.model.n_layer)
    top.report("model.moe.every", "every " + std::to_string(m.every) + " leaves no MoE block among model.n_layer (" +
                                      std::to_string(c.model.n_layer) + ") blocks");
  // DeepSpeed's expert groups are cut from the data-parallel group (utils/groups.py).
  if (dp % m.ep_size != 0)
    top.report("model.moe.ep_size", "ep_size " + std::to_string(m.ep_size) + " does not divide the data-parallel size (" +
                                        std::to_string(dp) + " ranks)");
  // DeepSpeed's top1gating asserts S >= min_capacity (S: the tokens one rank routes per micro-batch).
  const int64_t S = c.batch.micro_batch * c.model.n_positions;
  if (m.k == 1 && S < m.min_capacity)
    top.report("model.moe.min_capacity", "min_capacity " + std::to_string(m.min_capacity) +
                                             " exceeds the tokens a rank routes per micro-batch (micro-batch " +
                                             std::to_string(c.batch.micro_batch) + " x n_positions " +
                                             std::to_string(c.model.n_positions) + " = " + std::to_string(S) +
                                             "), which top-1 gating requires");
  if (c.tensor.sequence_parallel)
    top.report("tensor_parallel.sequence_parallel",
               "an MoE layer routes the micro-batch's tokens together, and sequence parallelism gives each tensor rank "
               "a different shard of them; set it to false with model.moe");
  if (c.activation_checkpointing.enabled())
    top.report("activation_checkpointing",
               "recomputing an MoE block would route its tokens and exchange them between expert ranks again; zero3d "
               "keeps MoE activations (remove activation checkpointing, or use a dense model)");
  if (c.pipeline.schedule == pipe::ScheduleKind::ZeroBubbleH1)
    top.report("pipeline.schedule",
               "zb-h1 splits backward into input and weight passes, and an expert's weight gradient arrives by "
               "all-to-all inside the input pass; use \"1f1b\" or \"interleaved\" with model.moe");
}

}  // namespace zero3d::config_detail
