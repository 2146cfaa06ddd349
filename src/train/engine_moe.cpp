// engine_moe.cpp — the engine's MoE pieces (DEEPSPEED-FACTS-2 §4.5-4.7): the experts' own ZeRO
// optimizer over the expert-data group, their place in the gradient norm and the step, their
// checkpoint segments, and the routing figures metrics.jsonl reports.
#include <algorithm>
#include <cmath>

#include "train/engine.hpp"
#include "train/estimator.hpp"

namespace zero3d {

MoeRouting Engine::moe_routing() const {
  MoeRouting r = moe_routing_of(cfg_.model.moe, cfg_.training.seed);
  r.expert = ep_comm_ ? &model_comms_.of(*ep_comm_) : nullptr;
  return r;
}

void Engine::setup_expert_optimizer(const std::function<void(float*, int64_t, int64_t)>& fill_global) {
  const ModelPart& part = model_->part();
  // The experts' swap files (NVMe offload) sit beside the dense ones, in a folder of their own.
  ZeroConfig zero = cfg_.zero;
  if (!zero.offload_optimizer.nvme_path.empty()) zero.offload_optimizer.nvme_path += "/moe_experts";
  if (!zero.offload_param.nvme_path.empty()) zero.offload_param.nvme_path += "/moe_experts";
  expert_zero_ = std::make_unique<ZeroOptimizer>(zero, cfg_.optimizer, state_types_of(cfg_, part.expert_layout),
                                                 part.expert_layout, part.expert_units, model_comms_.of(*edp_comm_), -1,
                                                 /*ordered_backward=*/model_->num_chunks() == 1, groups_.rank());
  expert_zero_->set_fetch_trace(expert_trace_);
  // Each expert starts from its own draw (seed, h.{l}.mlp.experts.{e}...), whatever ep_size.
  expert_zero_->init_params([&](float* out, int64_t begin, int64_t end) {
    for (const LayoutSegment& run :
         part.global_runs(begin + part.expert_begin, end + part.expert_begin, /*saving=*/false))
      fill_global(out + (run.local_begin - part.expert_begin - begin), run.global_begin,
                  run.global_begin + (run.local_end - run.local_begin));
  });
}

void Engine::expert_grad_stats() {
  // Every rank takes part (a pipeline stage without MoE blocks adds 0). Within the expert-data
  // group grad_stats sums the partitions; expert_norm then adds the other experts, stages and
  // tensor ranks — tensor ranks above 0 hold replicas and add nothing.
  double sq = 0.0;
  if (expert_zero_) {
    // tensor ranks above 0 skip their replicas: whole experts, or the c_proj biases of split ones
    std::vector<std::pair<int64_t, int64_t>> skip;
    const ModelPart& part = model_->part();
    if (tp_comm_->rank() > 0)
      for (const auto& [lo, hi] : part.replicated_ranges())
        if (hi > part.expert_begin)  // (a run of replicas may begin among the dense tensors: ln_f)
          skip.emplace_back(std::max(lo, part.expert_begin) - part.expert_begin, hi - part.expert_begin);
    const double n = expert_zero_->grad_stats(nullptr, skip).norm_scaled;
    sq = n * n;
  }
  enorm_comm_->all_reduce(&sq, 1, DType::F64, ReduceOp::Sum);
  // The expert-data reduction averaged over dp/ep ranks; DeepSpeed divides by dp (FACTS-2 §4.6).
  const double ep = static_cast<double>(cfg_.model.moe.ep_size);
  const double total = stats_.norm_scaled * stats_.norm_scaled + sq / (ep * ep);
  stats_.finite = stats_.finite && std::isfinite(sq);
  stats_.norm_scaled = std::sqrt(total);
}

void Engine::expert_step(double lr, double clip, double loss_scale, bool skip) {
  if (!expert_zero_) return;
  if (skip) return expert_zero_->skip_step();
  // unscale_clip_multiplier(n, s, clip) = 1/(c·s), c = max((n/s + 1e-6)/clip, 1): with n·ep and s·ep
  // c is unchanged and the multiplier gains the 1/ep that turns the expert-data mean into /dp.
  const double ep = static_cast<double>(cfg_.model.moe.ep_size);
  expert_zero_->apply_step(lr, schedule_->betas(), clip, loss_scale * ep, GradStats{stats_.norm_scaled * ep, stats_.finite});
}

void Engine::expert_checkpoint_segments(ShardSlice& slice) {
  const ModelPart& part = model_->part();
  const auto [b, e] = expert_zero_->checkpoint_range();
  const auto arrays = expert_zero_->checkpoint_arrays();
  for (const LayoutSegment& run : part.global_runs(b + part.expert_begin, e + part.expert_begin, /*saving=*/true)) {
    ShardSegment seg;
    seg.begin = run.global_begin;
    seg.end = run.global_begin + (run.local_end - run.local_begin);
    for (const auto& [name, first] : arrays) seg.arrays.emplace_back(name, first + (run.local_begin - part.expert_begin - b));
    slice.segments.push_back(std::move(seg));
  }
}

void Engine::read_expert_checkpoint(const CheckpointReader& reader) {
  const ModelPart& part = model_->part();
  expert_zero_->read_checkpoint(
      [&](const std::string& state, int64_t b, int64_t e, float* out) {
        for (const LayoutSegment& run : part.global_runs(b + part.expert_begin, e + part.expert_begin, false))
          reader.read_range(state, run.global_begin, run.global_begin + (run.local_end - run.local_begin),
                            out + (run.local_begin - part.expert_begin - b));
      },
      reader.meta().optimizer_step);
}

nlohmann::json Engine::moe_metrics(double* dropped_fraction) {
  // Per MoE block of the model: expert counts, choices and drops summed over every data rank's
  // micro-batches (each block counted on tensor rank 0 of the stage holding it), l_aux averaged
  // over its forwards.
  const GPTShape& s = model_->shape();
  const int64_t E = s.moe.num_experts;
  std::vector<int> blocks;
  for (int b = 0; b < s.n_layer; ++b)
    if (s.moe.is_moe_block(b)) blocks.push_back(b);
  const size_t width = static_cast<size_t>(E + 3);
  std::vector<double> sums(blocks.size() * width, 0.0);  // per block: E counts, routed, dropped, forwards; then l_aux
  std::vector<double> aux(blocks.size(), 0.0);
  if (tp_comm_->rank() == 0)
    for (const GPT::MoeLayerStats& st : model_->take_moe_stats()) {
      const size_t i = static_cast<size_t>(std::find(blocks.begin(), blocks.end(), st.block) - blocks.begin());
      for (int64_t e = 0; e < E; ++e) sums[i * width + e] += static_cast<double>(st.tokens_per_expert[e]);
      sums[i * width + E] += static_cast<double>(st.routed);
      sums[i * width + E + 1] += static_cast<double>(st.dropped);
      sums[i * width + E + 2] += static_cast<double>(st.forwards);
      aux[i] += st.l_aux;
    }
  else
    model_->take_moe_stats();
  world_comm_->all_reduce(sums.data(), static_cast<int64_t>(sums.size()), DType::F64, ReduceOp::Sum);
  world_comm_->all_reduce(aux.data(), static_cast<int64_t>(aux.size()), DType::F64, ReduceOp::Sum);
  nlohmann::json out = nlohmann::json::array();
  double routed = 0.0, dropped = 0.0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::vector<int64_t> tokens(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) tokens[e] = static_cast<int64_t>(sums[i * width + e]);
    const double r = sums[i * width + E], d = sums[i * width + E + 1], f = sums[i * width + E + 2];
    routed += r, dropped += d;
    out.push_back({{"layer", blocks[i]},
                   {"tokens_per_expert", tokens},
                   {"dropped_fraction", r > 0 ? d / r : 0.0},
                   {"l_aux", f > 0 ? aux[i] / f : 0.0}});
  }
  *dropped_fraction = routed > 0 ? dropped / routed : 0.0;
  return out;
}

}  // namespace zero3d
