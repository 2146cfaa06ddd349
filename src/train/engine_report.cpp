// engine_report.cpp — what rank 0 prints and writes about a run: the start-up lines, each
// step's metrics.jsonl record and report line, and the end-of-run summary.


#include "base/errors.hpp"
#include "io/checkpoint.hpp"
#include "kernels/device.hpp"
#include "kernels/gemm.hpp"
#include "train/engine.hpp"
#include "train/estimator.hpp"
#include "train/job_control.hpp"
#include "train/memory_breakdown.hpp"
#include <algorithm>
#include <cstdio>

namespace zero3d {

namespace {
// Where this rank sits on its node (MPI_Comm_split_type): its local rank, the node's ranks, and
// how many nodes the job spans.
struct NodePlace {
  int local_rank = 0, local_size = 1, nodes = 1;
};
NodePlace node_place(MPI_Comm world) {
  MPI_Comm node;
  MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  NodePlace p;
  MPI_Comm_rank(node, &p.local_rank);
  MPI_Comm_size(node, &p.local_size);
  MPI_Comm_free(&node);
  int is_leader = p.local_rank == 0 ? 1 : 0;
  MPI_Allreduce(&is_leader, &p.nodes, 1, MPI_INT, MPI_SUM, world);
  return p;
}
}  // namespace

std::string node_summary(MPI_Comm world, int* local_rank_out) {
  const NodePlace p = node_place(world);
  *local_rank_out = p.local_rank;
  return std::to_string(p.nodes) + (p.nodes == 1 ? " node, " : " nodes, ") + std::to_string(p.local_size) +
         " ranks on rank 0's node";
}

void check_device_memory(const Config& cfg, MPI_Comm world) {
  const NodePlace p = node_place(world);
  int world_size = 1;
  MPI_Comm_size(world, &world_size);
  const kernels::DeviceInfo d = kernels::device_info();
  const int visible = std::max(1, d.visible), id = p.local_rank % visible;
  const int sharing = (p.local_size - id + visible - 1) / visible;
  const std::string why = device_memory_shortfall(estimate_budget(cfg, world_size, cfg.zero.stage).device_need(), sharing,
                                                  d.free_bytes, d.name + " (device " + std::to_string(d.id) + ")");
  if (!why.empty()) throw InputError(why);
}

namespace {
// activation_checkpointing.profile: this rank's checkpoints in block order, named by their blocks.
nlohmann::json checkpoint_profile(const StepResult& r) {
  std::vector<GPT::CheckpointTime> times = r.checkpoint_times;
  std::sort(times.begin(), times.end(), [](const auto& a, const auto& b) { return a.first_block < b.first_block; });
  nlohmann::json out = nlohmann::json::array();
  for (const GPT::CheckpointTime& t : times) {
    const int last = t.first_block + t.num_blocks - 1;
    out.push_back({{"blocks", "h." + std::to_string(t.first_block) + (last > t.first_block ? "-" + std::to_string(last) : "")},
                   {"forward_ms", t.forward_ms},
                   {"recompute_ms", t.recompute_ms}});
  }
  return out;
}

std::string format_number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}
}  // namespace

void Engine::open_metrics() {
  const std::string path = output_dir_ + "/metrics.jsonl";
  // A resumed run continues the history from its step: records past it (steps a killed run took
  // after its last save) are dropped so that no step appears twice.
  const int64_t dropped = resumed_ ? drop_metrics_after(path, step_) : 0;
  if (dropped > 0)
    std::printf("resume  %s: dropped %lld record%s past step %lld (taken after the last save)\n", path.c_str(),
                (long long)dropped, dropped == 1 ? "" : "s", (long long)step_);
  metrics_ = std::make_unique<MetricsWriter>(path, resumed_);
}

void Engine::print_startup() const {
  if (groups_.rank() != 0) return;
  const GPTShape& s = model_->shape();
  const ProcessTopology& topo = groups_.topology();
  std::printf("zero3d %s | world size %d | topology pipe=%d data=%d model=%d | Kokkos %s | %s\n", ZERO3D_VERSION,
              topo.world_size(), topo.get_dim("pipe"), topo.get_dim("data"), topo.get_dim("model"),
              Kokkos::DefaultExecutionSpace::name(), node_summary_.c_str());
  if (groups_.nodes().emulated_ranks_per_node() > 0 || !shard_comms_.empty()) {
    // The groups' links, as the bytes are split (parallel/nodes.hpp)
    std::string groups;
    for (const auto& [name, c] : shard_comms_)
      groups += (groups.empty() ? "; " : ", ") + name + " " + std::to_string(c->size()) + " ranks " +
                (c->intra_node() ? "intra-node" : "inter-node");
    std::printf("nodes   %s; data group %s%s\n", groups_.nodes().describe().c_str(),
                dp_comm_->intra_node() ? "intra-node" : "inter-node", groups.c_str());
  }
  if (cfg_.zero.quantized_gradients && !groups_.has("qgz_intra"))  // DeepSpeed's stage3.py: qgZ only when num_nodes > 1
    std::printf("qgZ     the data group lies on one node: gradients are reduce-scattered unquantised, as DeepSpeed "
                "does on one node%s\n", cfg_.zero.loco.enabled ? " (zeropp_loco_param has nothing to compensate)" : "");
  if constexpr (kernels::kGpuBuild) {  // rank 0's device; every rank took the one of its rank on its node
    const kernels::DeviceInfo d = kernels::device_info();
    std::printf("device  %s (device %d of %d visible) | %.1f GiB, %.1f GiB free | %s\n", d.name.c_str(), d.id,
                d.visible, d.total_bytes / 1073741824.0, d.free_bytes / 1073741824.0, d.backend.c_str());
  }
  if (!model_comms_.transport().empty() && topo.world_size() > 1)
    std::printf("comms   collectives on model memory: %s\n", model_comms_.transport().c_str());
  const int64_t total_params = gpt_layout(s).total();
  const std::string init = cfg_.model.init_from.empty() ? "initialised from seed " + std::to_string(cfg_.training.seed)
                                                        : "loaded from " + cfg_.model.init_from;
  if (s.llama()) {
    const DecoderFamily& f = s.family;
    int64_t windowed = 0, widest = 0;
    for (int64_t l = 0; l < s.n_layer; ++l) {
      windowed += f.window_of(l) > 0 ? 1 : 0;
      widest = std::max(widest, f.window_of(l));
    }
    const std::string window = windowed == 0 ? "no sliding window"
                               : "sliding window " + std::to_string(widest) + " on " + std::to_string(windowed) +
                                     " of " + std::to_string(s.n_layer) + " layers";
    std::printf("model   %s V=%lld T=%lld L=%lld H=%lld KV=%lld d=%lld C=%lld I=%lld (%s head%s%s, %s): %lld parameters "
                "(%.2f MB fp32), %s\n",
                architecture_name(f.arch), (long long)s.vocab_size, (long long)s.n_positions, (long long)s.n_layer,
                (long long)s.n_head, (long long)f.num_key_value_heads, (long long)f.head_dim, (long long)s.n_embd,
                (long long)f.intermediate_size, s.tied_head() ? "tied" : "untied", f.qkv_bias ? ", q/k/v biases" : "",
                f.mlp_bias ? ", MLP biases" : "", window.c_str(), (long long)total_params, total_params * 4.0 / 1e6,
                init.c_str());
  } else {
    std::printf("model   GPT-2 V=%lld T=%lld L=%lld H=%lld C=%lld: %lld parameters (%.2f MB fp32), %s\n",
                (long long)s.vocab_size, (long long)s.n_positions, (long long)s.n_layer, (long long)s.n_head,
                (long long)s.n_embd, (long long)total_params, total_params * 4.0 / 1e6, init.c_str());
  }
  if (tp_comm_->size() == 1 && model_->part().vocab_padded > s.vocab_size)  // (with t > 1 the tensor line says it)
    std::printf("vocab   padded %lld -> %lld (model.make_vocab_size_divisible_by %lld): the padding rows hold zeros, "
                "are masked out of the loss and never saved\n",
                (long long)s.vocab_size, (long long)model_->part().vocab_padded, (long long)s.make_vocab_size_divisible_by);
  if (cfg_.model.moe.enabled()) {
    const MoeConfig& mo = cfg_.model.moe;
    std::string blocks;
    for (int b = 0; b < s.n_layer; ++b)
      if (s.moe.is_moe_block(b)) blocks += (blocks.empty() ? "" : ",") + std::to_string(b);
    char routing[200], jitter[64] = "";
    if (mo.router_jitter_noise > 0) std::snprintf(jitter, sizeof(jitter), ", input jitter U(1 - %g, 1 + %g)", mo.router_jitter_noise, mo.router_jitter_noise);
    if (mo.mixtral_routing && mo.aux_loss_coef > 0)  // MixtralSparseMoeBlock: renormalised top-k, no capacity
      std::snprintf(routing, sizeof(routing),
                    "Mixtral routing (renormalised top-k, no capacity), load-balancing loss x %g%s", mo.aux_loss_coef,
                    jitter);
    else if (mo.mixtral_routing)
      std::snprintf(routing, sizeof(routing), "Mixtral routing (renormalised top-k, no capacity), no load-balancing loss%s",
                    jitter);
    else
      std::snprintf(routing, sizeof(routing), "capacity factor %g (eval %g), min %lld%s%s", mo.capacity_factor,
                    mo.eval_capacity_factor, (long long)mo.min_capacity, mo.drop_tokens ? "" : ", no drops",
                    mo.use_residual ? ", residual" : "");
    std::printf("moe     %lld experts, top-%lld, in blocks %s | ep_size %lld (%lld experts per rank) | %s | %lld of %lld "
                "parameters active per token\n",
                (long long)mo.num_experts, (long long)mo.k, blocks.c_str(), (long long)mo.ep_size,
                (long long)(mo.num_experts / mo.ep_size), routing, (long long)gpt_active_params(s, mo.k),
                (long long)gpt_layout(s).total());
  }
  if (s.sparse.enabled)
    std::printf("sparse  %s\n", sparse_attention_summary(s.sparse, s.n_head, s.n_positions, s.n_layer).c_str());
  std::printf("batch   %s\n", cfg_.batch.derivation.c_str());
  if (tp_comm_->size() > 1) {
    const ModelPart& part = model_->part();
    std::printf("tensor  %d ranks (Megatron): %s vocab-parallel "
                "(%lld rows each, vocabulary padded %lld -> %lld)%s%s; %lld parameters on tensor rank 0 of stage 0\n",
                tp_comm_->size(),
                s.llama() ? "q/k/v_proj (whole K/V-head groups) and gate/up_proj column-parallel, o_proj and down_proj "
                            "row-parallel, embed_tokens and lm_head"
                          : "c_attn and c_fc column-parallel, c_proj row-parallel, wte",
                (long long)part.vocab_local, (long long)s.vocab_size, (long long)part.vocab_padded,
                cfg_.tensor.sequence_parallel ? ", sequence parallel" : "",
                cfg_.tensor.overlap_comm ? ", input-gradient all-reduces overlapped" : "",
                (long long)model_->num_params());
  }
  if (stages_ > 1) {
    const PipelineConfig& pc = cfg_.pipeline;
    const pipe::ScheduleSpec spec{pc.schedule, stages_, static_cast<int>(cfg_.batch.gradient_accumulation_steps),
                                  pc.virtual_stages};
    std::printf("pipeline %d stages%s, schedule %s, partition %s, %lld micro-batches, %d activation buffers on "
                "stage 0; bubble formula %.3f\n",
                stages_, pc.virtual_stages > 1 ? (" x " + std::to_string(pc.virtual_stages) + " virtual").c_str() : "",
                pc.schedule_name.c_str(), pc.partition_name.c_str(), (long long)cfg_.batch.gradient_accumulation_steps,
                schedule_steps_.num_buffers, pipe::bubble_fraction(spec));
    const std::vector<PipeLayer> layers = gpt_pipe_layers(s.vocab_size, s.n_positions, s.n_layer, s.n_embd);
    for (int st = 0; st < stages_; ++st) {
      const ModelPart part = gpt_model_part(s, cfg_.pipe_bounds, stages_, st);
      std::string what;
      for (int k = st; k + 1 < static_cast<int>(cfg_.pipe_bounds.size()); k += stages_) {
        const int a = cfg_.pipe_bounds[k], b = cfg_.pipe_bounds[k + 1];
        auto name = [&](int i) {
          return layers[i].kind == "block" ? (s.llama() ? "model.layers." : "h.") + std::to_string(layers[i].block)
                                           : layers[i].kind;
        };
        what += (what.empty() ? "" : " + ") + name(a) + (b - a > 1 ? ".." + name(b - 1) : "");
      }
      std::printf("  stage %d: %s | %lld parameters%s\n", st, what.c_str(), (long long)part.layout.total(),
                  part.tied_unit >= 0 ? (s.llama() ? " (incl. the tied embed_tokens copy)" : " (incl. the tied wte copy)") : "");
    }
  }
  std::printf("data    %s\n", data_->describe().c_str());
  if (validation_) std::printf("eval    %s\n", eval_description().c_str());
  std::printf("optim   %s lr %.3g%s | clip %.3g | %lld steps | MFU peak %.1f GFLOP/s (%s)\n",
              cfg_.optimizer.type_name.c_str(), cfg_.optimizer.lr,
              cfg_.scheduler.type == SchedulerType::None ? "" : (" | scheduler " + cfg_.scheduler.type_name).c_str(),
              cfg_.gradient_clipping, (long long)cfg_.training.steps, peak_gflops_total_,
              cfg_.training.peak_gflops > 0
                  ? "training.peak_gflops"
                  : (model_->compute_type() == DType::BF16 ? "measured bf16 gemm, all ranks" : "measured sgemm, all ranks"));
  const OptimizerConfig& oc = cfg_.optimizer;
  if (oc.one_bit()) {  // FACTS-2 §5: the phases, as DeepSpeed's 1-bit optimizers print them when they start
    std::printf("optim   %s: step 1 initialises (no update); ", oc.type_name.c_str());
    if (oc.type == OptimizerType::ZeroOneAdam)
      std::printf("the variance is updated from all-reduced gradients at intervals doubling every %lld updates "
                  "(1-bit all-reduced gradients between) through step %lld, then frozen; local steps synchronised "
                  "by the 1-bit compressed all-reduce over %d ranks every 1 to %lld steps\n",
                  (long long)oc.var_update_scaler, (long long)std::max<int64_t>(oc.var_freeze_step, 1) + 1,
                  dp_comm_->size(), (long long)oc.local_step_clipper);
    else
      std::printf("gradients all-reduced through step %lld, then the variance is frozen and the momentum averaged "
                  "by the 1-bit compressed all-reduce over %d ranks%s\n",
                  (long long)std::max<int64_t>(oc.freeze_step, 2), dp_comm_->size(),
                  oc.type == OptimizerType::OneBitLamb ? " (one flat buffer, LAMB coefficients frozen)" : "");
  }
  const PrecisionConfig& pc = cfg_.precision;
  std::string scaling = "no loss scaling";
  if (pc.param == DType::F16)
    scaling = pc.loss_scale > 0 ? "static loss scale " + format_number(pc.loss_scale)
                                : "dynamic loss scale 2^" + std::to_string(pc.initial_scale_power) + ", window " +
                                      std::to_string(pc.loss_scale_window) + ", hysteresis " +
                                      std::to_string(pc.hysteresis) + ", min " + format_number(pc.min_loss_scale);
  std::string autocast;
  if (pc.autocast.enabled()) {  // torch_autocast: what runs and what travels in its dtype
    const LowPrecisionModules& l = pc.autocast.modules;
    std::string listed = std::string(l.linear ? ", Linear" : "") + (l.embedding ? ", Embedding" : "") +
                         (l.layer_norm ? ", LayerNorm" : "");
    listed = listed.empty() ? "no module's" : listed.substr(2) + " modules'";
    autocast = " (torch_autocast: products in " + dtype_name(pc.autocast.dtype) + "; " + listed +
               " gradients reduced" + (cfg_.zero.stage == 3 ? " and parameters gathered" : "") + " in " +
               dtype_name(pc.autocast.dtype) + ")";
    if (pc.autocast.dtype == DType::F16) scaling = "torch GradScaler 2^16, growth interval 2000, backoff 0.5";
  }
  std::printf("precision %s parameters, %s gradient accumulation, %s communication%s%s; %s; %s; matmuls: %s\n",
              dtype_name(pc.param).c_str(), dtype_name(pc.grad_accum).c_str(), dtype_name(pc.comm).c_str(),
              autocast.c_str(), pc.param == DType::F32 ? "" : ", fp32 master and optimizer states", scaling.c_str(),
              check_overflow_ ? "inf/NaN gradients skip the step" : "no overflow check",
              gemm_path(model_->compute_type()).c_str());
  const MemoryBytes m = model_state_memory();
  std::printf("zero    stage %d over %d data-parallel ranks (%s), reduce buckets of %lld elements, overlap_comm %s%s\n",
              zero_->stage(), world_, model_comms_.of(*dp_comm_).backend().c_str(), (long long)cfg_.zero.reduce_bucket_size,
              cfg_.zero.overlap_comm ? "on" : "off",
              cfg_.training.comms_timeout > 0 ? (", comms_timeout " + format_number(cfg_.training.comms_timeout) + " s").c_str() : "");
  std::printf("memory  bytes per rank: params %lld | grads %lld | master %lld | optimizer_states %lld | "
              "comm_buffers %lld | model states %.1f MB (stage 0 would hold %.1f MB) | activations %.1f MB\n",
              (long long)m.params, (long long)m.grads, (long long)m.master, (long long)m.optimizer_states,
              (long long)m.comm_buffers, m.model_states() / 1e6, 16.0 * model_->num_params() / 1e6,
              activation_bytes() / 1e6);
  const ActivationCheckpointing& ac = cfg_.activation_checkpointing;
  if (ac.enabled()) {
    std::string how = ac.full() ? "full: " + std::to_string(ac.interval) + " block(s) per checkpoint keep only their "
                                  "input, recomputed in backward"
                                : "selective: every block recomputes its attention probabilities in backward";
    if (ac.partition_activations) how += "; inputs partitioned over " + std::to_string(tp_comm_->size()) + " tensor rank(s)";
    if (ac.cpu_checkpointing)
      how += kernels::kGpuBuild ? "; inputs in page-locked host memory"
                                : "; inputs in host memory (on this CPU build host and device memory are the same)";
    if (ac.contiguous_memory_optimization)
      how += "; one contiguous buffer of " + std::to_string(ac.number_checkpoints) + " slots per micro-batch";
    if (ac.synchronize_checkpoint_boundary) how += "; fenced boundaries";
    if (ac.profile) how += "; profiled";
    std::printf("checkpointing %s (pipeline.activation_checkpoint_interval %d)\n", how.c_str(), ac.interval);
  }
  {
    const MemoryBudget b = estimate_budget(cfg_, world_comm_->size(), cfg_.zero.stage, groups_.nodes().ranks_per_node());
    char tiers[128] = "";  // offload: where model states live besides device memory
    if (b.offload_host > 0 || b.offload_nvme > 0)
      std::snprintf(tiers, sizeof tiers, " (offload: %.1f MB of them in host memory, %.1f MB in swap files, not counted)",
                    b.offload_host / 1e6, b.offload_nvme / 1e6);
    std::printf("plan    per rank (largest: pipeline stage %d): model states %.1f MB%s | communication %.1f MB | gathered "
                "parameters %.1f MB | activations %.1f MB (%d micro-batch(es) in flight%s) | workspace %.1f MB | runtime "
                "%.1f MB | predicted peak %.1f MB, checked at the end\n",
                b.pipe_stage, b.model_states() / 1e6, tiers, (b.comm_reduce + b.comm_gather + b.comm_prefetch) / 1e6,
                b.live_params / 1e6, b.activations / 1e6, b.in_flight,
                b.activations_host > 0 ? ", checkpoints in host memory included" : "", b.workspace / 1e6,
                b.runtime / 1e6, b.total() / 1e6);
  }
  if (const std::string off = zero_->offload_summary(); !off.empty()) std::printf("offload %s\n", off.c_str());
  if (!output_dir_.empty()) std::printf("output  %s/{config.json,metrics.jsonl}\n", output_dir_.c_str());
  std::fflush(stdout);
}

// The model states of this rank in every tier: the dense optimizer's and, with MoE, the experts'
// own optimizer's partition (in memory, in host memory, in swap files).
MemoryBytes Engine::model_state_memory() const {
  MemoryBytes m = zero_->memory();
  if (expert_zero_) {
    const MemoryBytes x = expert_zero_->memory();
    m.params += x.params, m.grads += x.grads, m.master += x.master, m.optimizer_states += x.optimizer_states;
    m.comm_buffers += x.comm_buffers, m.live_params_peak += x.live_params_peak, m.gathered += x.gathered;
    m.host += x.host, m.nvme += x.nvme, m.swap_buffers += x.swap_buffers;
  }
  return m;
}

// One step's record in metrics.jsonl and, at steps_per_print, its report line (rank 0).
// moe, dropped: moe_metrics() of the step (null, 0 on a dense model); last_step: the run's
// last, whose record carries the memory plan's check.
void Engine::report_step(const StepResult& r, const nlohmann::json& moe, double dropped, bool last_step) {
  const auto& ms = timers_.ms();
  const MemoryBytes m = model_state_memory();
  if (metrics_) {
    nlohmann::json rec = {{"step", r.step},
                          {"loss", r.loss},
                          {"lr", r.lr},
                          {"grad_norm", r.grad_norm},
                          {"tokens_per_s", r.tokens_per_s},
                          {"mfu", r.mfu},
                          {"elapsed_ms", r.elapsed_ms},
                          {"samples", samples_},
                          {"comm_bytes", r.comm_bytes},
                          {"comm_bytes_by_axis",
                           {{"data", r.comm_by_axis[0]}, {"tensor", r.comm_by_axis[1]}, {"pipe", r.comm_by_axis[2]}}},
                          {"comm_bytes_by_link", {{"intra_node", r.link_bytes[0]}, {"inter_node", r.link_bytes[1]}}},
                          {"peak_rss_bytes", peak_rss_bytes()},
                          {"loss_scale", r.loss_scale},
                          {"skipped", r.skipped},
                          {"skipped_steps", r.skipped_steps}};
    const pipe::ScheduleSpec spec{cfg_.pipeline.schedule, stages_,
                                  static_cast<int>(cfg_.batch.gradient_accumulation_steps), cfg_.pipeline.virtual_stages};
    rec["pipeline"] = {{"stages", stages_},
                       {"schedule", cfg_.pipeline.schedule_name},
                       {"virtual_stages", cfg_.pipeline.virtual_stages},
                       {"bubble_fraction", {{"formula", pipe::bubble_fraction(spec)}, {"measured", r.stage_idle}}}};
    rec["memory"] = {{"params", m.params},           {"grads", m.grads},
                     {"master", m.master},           {"optimizer_states", m.optimizer_states},
                     {"comm_buffers", m.comm_buffers}, {"live_params_peak", m.live_params_peak},
                     {"activations", activation_bytes()}};
    if (cfg_.zero.stage == 3) rec["memory"]["gathered"] = m.gathered;  // the gather buffers held (live and kept)
    if (has_tiers(cfg_.zero)) {  // tiers, and this step's swap traffic
      offload::IoStats io = zero_->take_swap_stats();
      if (expert_zero_) {  // the experts' optimizer swaps in its own step, after the dense one
        const offload::IoStats x = expert_zero_->take_swap_stats();
        io.read_bytes += x.read_bytes, io.read_s += x.read_s, io.write_bytes += x.write_bytes, io.write_s += x.write_s;
      }
      rec["memory"].update({{"host", m.host}, {"nvme", m.nvme}, {"swap_buffers", m.swap_buffers},
                            {"host_is_device", !kernels::kGpuBuild}});
      rec["swap"] = {{"read_bytes", io.read_bytes}, {"read_ms", 1e3 * io.read_s},
                     {"read_gbps", io.read_s > 0 ? io.read_bytes / io.read_s / 1e9 : 0.0},
                     {"write_bytes", io.write_bytes}, {"write_ms", 1e3 * io.write_s},
                     {"write_gbps", io.write_s > 0 ? io.write_bytes / io.write_s / 1e9 : 0.0}};
    }
    if (cfg_.wall_clock_breakdown) {
      const double fwd = ms.count("forward") ? ms.at("forward") : 0.0;
      const double inner = ms.count("backward_inner") ? ms.at("backward_inner") : 0.0;
      const double ar = ms.count("backward_allreduce") ? ms.at("backward_allreduce") : 0.0;
      const double st = ms.count("step") ? ms.at("step") : 0.0;
      rec["time_ms"] = {{"forward", fwd}, {"backward", inner + ar}, {"backward_inner", inner},
                        {"backward_allreduce", ar}, {"step", st}, {"tensor_comm", r.tensor_comm_ms}};
    }
    if (cfg_.pld.enabled)
      rec["pld"] = pld_metrics(cfg_.pld, cfg_.training.seed, r.step - 1, cfg_.batch.gradient_accumulation_steps,
                               cfg_.model.n_layer);
    for (const auto& [name, bytes] : r.shard_comm_bytes) rec["comm_bytes_by_axis"][name] = bytes;
    if (cfg_.zero.hpz_partition_size > 1) rec["memory"]["hpz_secondary"] = m.secondary;
    if (!moe.is_null()) {
      rec["moe"] = moe;
      rec["comm_bytes_by_axis"]["expert"] = r.expert_comm_bytes[0];
      rec["comm_bytes_by_axis"]["expert_data"] = r.expert_comm_bytes[1];
    }
    observer_->annotate(rec);
    if (cfg_.activation_checkpointing.profile) rec["activation_checkpointing"] = {{"profile", checkpoint_profile(r)}};
    if (cfg_.activation_checkpointing.cpu_checkpointing) {  // of memory.activations, in host memory (here the same memory)
      int64_t host = 0;
      for (const ActivationBuffer& b : buffers_) host += b.host_bytes();
      rec["memory"]["activations_host"] = host;
    }
    if (last_step)
      rec["memory_plan"] = {{"predicted_peak_bytes", predicted_peak_},
                            {"measured_peak_bytes", measured_peak_},
                            {"ratio", double(predicted_peak_) / double(std::max<int64_t>(1, measured_peak_))}};
    if (r.eval) {
      rec["eval_loss"] = r.eval->loss;
      rec["eval_ppl"] = r.eval->ppl;
      rec["eval_ms"] = r.eval->elapsed_ms;
    }
    metrics_->write(rec);
  }
  if (r.step % cfg_.steps_per_print == 0 || r.step == 1 || r.step == cfg_.training.steps || r.eval) {
    std::string scale, eval;
    if (r.eval) {
      char buf[80];
      std::snprintf(buf, sizeof buf, " | eval_loss %.4f | eval_ppl %.4g", r.eval->loss, r.eval->ppl);
      eval = buf;
    }
    if (cfg_.model.moe.enabled()) {
      char buf[48];
      std::snprintf(buf, sizeof buf, " | dropped %.1f%%", 100.0 * dropped);
      eval += buf;
    }
    if (cfg_.precision.param != DType::F32 || cfg_.precision.autocast.dtype == DType::F16) {
      char buf[96];
      std::snprintf(buf, sizeof buf, " | loss_scale %g | skipped %lld%s", r.loss_scale, (long long)r.skipped_steps,
                    r.skipped ? " (this step)" : "");
      scale = buf;
    }
    std::printf("step %6lld/%lld | loss %.4f | lr %.3e | grad_norm %.4f | %8.0f tok/s | MFU %5.1f%% | %7.1f ms%s%s\n",
                (long long)r.step, (long long)cfg_.training.steps, r.loss, r.lr, r.grad_norm, r.tokens_per_s,
                100.0 * r.mfu, r.elapsed_ms, scale.c_str(), eval.c_str());
    std::fputs(observer_->breakdown_lines().c_str(), stdout);
    if (cfg_.memory_breakdown) {  // DeepSpeed's see_memory_usage at the report points (memory_breakdown.hpp)
      MemoryBreakdown b{m, activation_bytes(), has_tiers(cfg_.zero)};
      process_memory(&b.rss, &b.peak_rss);
      machine_memory(&b.machine_total, &b.machine_available);
      if (kernels::kGpuBuild) {
        const kernels::DeviceInfo d = kernels::device_info();
        b.on_device = true;
        b.device_allocated = kernels::device_live_bytes();
        b.device_peak = kernels::device_peak_bytes();
        b.device_free = d.free_bytes;
        b.device_total = d.total_bytes;
      }
      std::printf("%s\n", memory_breakdown_line(b).c_str());
    }
    if (cfg_.activation_checkpointing.profile) {
      std::string line = "checkpoints (ms)";
      for (const auto& t : checkpoint_profile(r)) {
        char buf[128];
        std::snprintf(buf, sizeof buf, " | %s: forward %.2f recompute %.2f", t["blocks"].get<std::string>().c_str(),
                      t["forward_ms"].get<double>(), t["recompute_ms"].get<double>());
        line += buf;
      }
      std::printf("%s\n", line.c_str());
    }
    std::fflush(stdout);
  }
}

// The end-of-run line (rank 0): throughput over the timed steps, and the memory plan's check.
void Engine::print_summary(const std::vector<StepResult>& results, double total_ms) const {
  // The first step warms caches and is left out, unless it is the only one.
  if (total_ms <= 0.0) total_ms = results.front().elapsed_ms;
  const int64_t timed = std::max<int64_t>(1, static_cast<int64_t>(results.size()) - 1);
  const double tokens = static_cast<double>(timed) * cfg_.batch.train_batch_size * cfg_.model.n_positions;
  const double tps = total_ms > 0.0 ? tokens / (total_ms / 1e3) : 0.0;
  double flops = 0.0;  // per token, over the timed steps (the same tokens each)
  for (size_t i = results.size() > 1 ? 1 : 0; i < results.size(); ++i) flops += results[i].flops_per_token;
  flops /= static_cast<double>(timed);
  std::printf("done: %lld steps | final loss %.4f (first %.4f) | %.0f tokens/s | MFU %.1f%% of %.1f GFLOP/s | "
              "%.1f s\n",
              (long long)results.size(), results.back().loss, results.front().loss, tps,
              100.0 * flops * tps / (peak_gflops_total_ * 1e9), peak_gflops_total_,
              (total_ms + results.front().elapsed_ms) / 1e3);
  if (measured_peak_ > 0)
    std::printf("memory plan: predicted peak %.1f MB per rank, measured %.1f MB (max over %d ranks), ratio %.3f\n",
                predicted_peak_ / 1e6, measured_peak_ / 1e6, world_comm_->size(),
                double(predicted_peak_) / double(measured_peak_));
  std::fflush(stdout);
}

}  // namespace zero3d
