// observer.cpp — the engine's observability: DEEPSPEED-FACTS §9.2 (flops profiler), §9.3
// (monitors), §9.4 (timers), DeepSpeed's comms_logger, and zero3d's trace.
#include "train/observer.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "base/errors.hpp"
#include "observe/flops_report.hpp"
#include "train/engine.hpp"

namespace zero3d {

const char* instruction_region(pipe::Op op) {
  using pipe::Op;
  switch (op) {
    case Op::LoadMicroBatch: return "load_micro_batch";
    case Op::RecvActivation: return "pipe/recv_activation";
    case Op::SendActivation: return "pipe/send_activation";
    case Op::RecvGrad: return "pipe/recv_grad";
    case Op::SendGrad: return "pipe/send_grad";
    case Op::Forward: return "forward";
    case Op::Backward: return "backward";
    case Op::BackwardInput: return "backward_input";
    case Op::BackwardWeight: return "backward_weight";
    case Op::ReduceTiedGrads:
    case Op::ReduceGrads: return "reduce_grads";
    case Op::OptimizerStep: return "optimizer_step";
  }
  return "instruction";
}

namespace {
std::vector<std::pair<Communicator*, std::pair<const char*, const char*>>> named(const ObservedComms& c) {
  // (communicator, (axis in tables, trace prefix)): the data axis's traffic is ZeRO's
  std::vector<std::pair<Communicator*, std::pair<const char*, const char*>>> out = {
      {c.data, {"data", "zero"}},  {c.embedding, {"embedding", "embedding"}}, {c.tensor, {"tensor", "tensor"}},
      {c.pipe, {"pipe", "pipe"}},  {c.model_parallel, {"model_parallel", "model_parallel"}},
      {c.world, {"world", "world"}}};
  for (const auto& [comm, name] : c.shards) out.push_back({comm, {name.c_str(), name.c_str()}});
  return out;
}
double at(const std::map<std::string, double>& m, const char* k) {
  auto it = m.find(k);
  return it == m.end() ? 0.0 : it->second;
}
void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.flush();
  if (!out) throw SystemError(path + ": write failed");
}
}  // namespace

Observer::Observer(const Config& cfg, int world_rank, ObservedComms comms, const GPT& model, std::string output_dir,
                   double peak_gflops_total)
    : cfg_(cfg), o_(cfg.observability), rank_(world_rank), comms_(comms), model_(model),
      output_dir_(std::move(output_dir)), peak_gflops_total_(peak_gflops_total) {
  if (o_.trace.enabled) {  // one clock origin for every rank's track
    comms_.world->barrier();
    obs::g_trace.set_origin(std::chrono::steady_clock::now());
  }
  if (cfg.wall_clock_breakdown || o_.comms_logger.enabled || o_.trace.enabled) {
    for (auto& [comm, names] : named(comms_)) {
      if (!comm) continue;
      comm->observe(names.first, names.second);
      comm->log()->enable_logger(o_.comms_logger, rank_ == 0);
      if (cfg.wall_clock_breakdown) comm->log()->enable_timing();
    }
  }
  if (rank_ == 0 && !output_dir_.empty()) {
    const auto dir = [&](const MonitorConfig& m) {
      return (m.output_path.empty() ? output_dir_ : m.output_path) + "/" + m.job_name;
    };
    if (o_.csv_monitor.enabled) csv_ = std::make_unique<CsvMonitor>(dir(o_.csv_monitor));
    if (o_.tensorboard.enabled) tensorboard_ = std::make_unique<TensorBoardMonitor>(dir(o_.tensorboard));
  }
}

// The data group's blocked all-gathers (ZeRO-3 fetches, ZeRO-1/2's after the update) since the
// last take.
double Observer::take_allgather_ms() const {
  double gather = 0.0;
  for (Communicator* c : {comms_.data, comms_.embedding})
    if (c && c->log()) gather += c->log()->take_blocked_ms()[static_cast<int>(CommOp::AllGather)];
  return gather;
}

void Observer::begin_step(int64_t step) {
  step_ = step;
  take_allgather_ms();  // what came between steps (an evaluation's fetches) is not this step's
  obs::g_hooks.flops = o_.flops_profiler.enabled && step == o_.flops_profiler.profile_step;
  if (obs::g_hooks.flops) obs::g_counters.reset(static_cast<int>(model_.shape().n_layer));
  obs::g_counters.n_layer = static_cast<int>(model_.shape().n_layer);
  traced_ = o_.trace.enabled && std::count(o_.trace.steps.begin(), o_.trace.steps.end(), step) > 0;
  obs::g_hooks.trace = traced_;
  if (traced_) step_slot_ = obs::g_trace.open("step " + std::to_string(step), obs::g_hooks.now());
}

void Observer::end_step() {
  step_allgather_ms_ = take_allgather_ms();  // taken before an evaluation gathers: eval_ms has its time
  if (traced_) obs::g_trace.close(step_slot_, obs::g_hooks.now());
  obs::g_hooks.flops = obs::g_hooks.trace = false;  // the device fence stays: it is the build's, not the step's
}

std::vector<std::pair<std::string, double>> Observer::phases(const std::map<std::string, double>& t) const {
  // DeepSpeed's global timers (fwd, bwd, bwd_inner, bwd_allreduce, step), its pipeline timers,
  // then zero3d's: ZeRO's blocked parameter all-gathers and the tensor group's collectives.
  const double inner = at(t, "backward_inner"), reduce = at(t, "backward_allreduce");
  std::vector<std::pair<std::string, double>> p = {
      {"fwd", at(t, "forward")}, {"bwd", inner + reduce}, {"bwd_inner", inner}, {"bwd_allreduce", reduce},
      {"step", at(t, "step")}};
  if (comms_.pipe && comms_.pipe->size() > 1)
    for (const char* k : {"pipe_send_output", "pipe_send_grad", "pipe_recv_input", "pipe_recv_grad"})
      p.emplace_back(k, at(t, k));
  p.emplace_back("allgather", at(t, "allgather"));
  if (comms_.tensor && comms_.tensor->size() > 1) p.emplace_back("tensor_comm", at(t, "tensor_comm"));
  return p;
}

void Observer::after_step(const StepResult& r, int64_t global_samples, const std::map<std::string, double>& timers) {
  std::map<std::string, double> t = timers;
  if (cfg_.wall_clock_breakdown) {
    t["allgather"] = step_allgather_ms_;
    t["tensor_comm"] = r.tensor_comm_ms;
    const auto p = phases(t);
    const int64_t n = static_cast<int64_t>(p.size());
    std::vector<double> mine(p.size()), lo, hi, sum;
    for (size_t i = 0; i < p.size(); ++i) mine[i] = p[i].second;
    lo = hi = sum = mine;
    comms_.world->all_reduce(lo.data(), n, DType::F64, ReduceOp::Min);
    comms_.world->all_reduce(hi.data(), n, DType::F64, ReduceOp::Max);
    comms_.world->all_reduce(sum.data(), n, DType::F64, ReduceOp::Sum);
    breakdown_.clear();
    for (size_t i = 0; i < p.size(); ++i)
      breakdown_.push_back({p[i].first, mine[i], lo[i], sum[i] / comms_.world->size(), hi[i]});
  }
  if (o_.flops_profiler.enabled && r.step == o_.flops_profiler.profile_step) write_flops_profile(r, t);
  if (csv_ || tensorboard_) {
    std::vector<MonitorEvent> events = {{"Train/Samples/train_loss", r.loss, global_samples},
                                        {"Train/Samples/lr", r.lr, global_samples}};
    if (cfg_.precision.param == DType::F16 || cfg_.precision.autocast.dtype == DType::F16)
      events.emplace_back("Train/Samples/loss_scale", r.loss_scale, global_samples);
    if (cfg_.wall_clock_breakdown || o_.flops_profiler.enabled) {
      const double inner = at(t, "backward_inner"), reduce = at(t, "backward_allreduce");
      events.emplace_back("Train/Samples/elapsed_time_ms_forward", at(t, "forward"), global_samples);
      events.emplace_back("Train/Samples/elapsed_time_ms_backward", inner + reduce, global_samples);
      events.emplace_back("Train/Samples/elapsed_time_ms_backward_inner", inner, global_samples);
      events.emplace_back("Train/Samples/elapsed_time_ms_backward_allreduce", reduce, global_samples);
      events.emplace_back("Train/Samples/elapsed_time_ms_step", at(t, "step"), global_samples);
    }
    if (csv_) csv_->write(events);
    if (tensorboard_) tensorboard_->write(events);
  }
  if (traced_ && step_ == *std::max_element(o_.trace.steps.begin(), o_.trace.steps.end())) write_trace();
}

void Observer::annotate(nlohmann::json& rec) const {
  if (breakdown_.empty()) return;
  nlohmann::json ranks = nlohmann::json::object();
  for (const Phase& p : breakdown_) {
    ranks[p.name] = {{"min", p.min}, {"avg", p.avg}, {"max", p.max}};
    if (p.name.rfind("pipe_", 0) == 0 || p.name == "allgather") rec["time_ms"][p.name] = p.ms;
  }
  rec["time_ms_ranks"] = ranks;
}

std::string Observer::breakdown_lines() const {
  if (breakdown_.empty()) return "";
  std::string mine = "time (ms)", spread = "time (ms) min/avg/max over " + std::to_string(comms_.world->size()) + " ranks";
  char buf[160];
  for (const Phase& p : breakdown_) {
    std::snprintf(buf, sizeof buf, " | %s: %.2f", p.name.c_str(), p.ms);
    mine += buf;
    std::snprintf(buf, sizeof buf, " | %s: %.2f/%.2f/%.2f", p.name.c_str(), p.min, p.avg, p.max);
    spread += buf;
  }
  return mine + "\n" + spread + "\n";
}

void Observer::write_flops_profile(const StepResult& r, const std::map<std::string, double>& t) {
  const int L = static_cast<int>(model_.shape().n_layer), M = obs::num_modules(L);
  const std::vector<obs::ModuleCounts>& counts = obs::g_counters.modules;
  // Every rank's per-module figures: (fwd, bwd, recompute MACs, fwd ms) per module, plus unattributed MACs.
  const int64_t per_rank = 4 * M + 1;
  std::vector<double> mine(static_cast<size_t>(per_rank), 0.0);
  for (int m = 0; m < M && m < static_cast<int>(counts.size()); ++m) {
    for (int p = 0; p < obs::kPasses; ++p) mine[static_cast<size_t>(4 * m + p)] = counts[static_cast<size_t>(m)].macs[p];
    mine[static_cast<size_t>(4 * m + 3)] = counts[static_cast<size_t>(m)].ms[0];
  }
  mine.back() = obs::g_counters.unattributed_macs;
  const int W = comms_.world->size();
  std::vector<double> all(static_cast<size_t>(per_rank * W));
  comms_.world->all_gather(mine.data(), all.data(), per_rank, DType::F64);
  if (rank_ != 0) return;

  obs::FlopsReport rep;
  rep.cfg = o_.flops_profiler;
  rep.step = r.step;
  rep.world_size = W;
  rep.dp_size = comms_.data->size();
  rep.mp_size = comms_.model_parallel ? comms_.model_parallel->size() : 1;
  rep.batch_per_gpu = cfg_.batch.micro_batch;
  rep.wall_clock_breakdown = cfg_.wall_clock_breakdown;
  // This rank's module tree, from the tensors it holds (their global names).
  std::vector<int64_t> params(static_cast<size_t>(M), 0);
  const bool has_embedding = std::any_of(model_.part().chunks.begin(), model_.part().chunks.end(),
                                         [](const ModelChunk& c) { return c.embedding; });
  for (const TensorSpec& ts : model_.layout().tensors()) {
    const std::string& n = ts.name;
    int m = -1;
    if (n.rfind("wte.", 0) == 0 || n.rfind("wpe.", 0) == 0 || n.rfind("model.embed_tokens.", 0) == 0)
      m = has_embedding ? 0 : obs::lm_head_module(L);
    else if (n.rfind("lm_head.", 0) == 0) m = obs::lm_head_module(L);
    else if (n.rfind("ln_f.", 0) == 0 || n.rfind("model.norm.", 0) == 0) m = obs::ln_f_module(L);
    else if (n.rfind("h.", 0) == 0 || n.rfind("model.layers.", 0) == 0) {  // GPT-2's h.N, the Llama family's model.layers.N
      const int b = std::stoi(n.substr(n[0] == 'h' ? 2 : 13));
      const bool mlp = n.find(".mlp.") != std::string::npos || n.find(".ln_2.") != std::string::npos ||
                       n.find(".post_attention_layernorm.") != std::string::npos;
      m = mlp ? obs::mlp_module(b) : obs::attention_module(b);
    }
    if (m >= 0) params[static_cast<size_t>(m)] += ts.numel;
  }
  const auto macs = [&](int rank, int m, int pass) { return all[static_cast<size_t>(rank * per_rank + 4 * m + pass)]; };
  const auto fwd_ms = [&](int m) { return all[static_cast<size_t>(4 * m + 3)]; };
  std::vector<bool> present(static_cast<size_t>(M), false);
  for (const ModelChunk& c : model_.part().chunks) {
    if (c.embedding) present[0] = true;
    for (int b = c.first_block; b < c.first_block + c.num_blocks; ++b)
      present[static_cast<size_t>(obs::attention_module(b))] = present[static_cast<size_t>(obs::mlp_module(b))] = true;
    if (c.final) present[static_cast<size_t>(obs::ln_f_module(L))] = present[static_cast<size_t>(obs::lm_head_module(L))] = true;
  }
  const auto leaf = [&](int m, std::string name, std::string type, int depth) {
    return obs::ProfiledModule{std::move(name), std::move(type), depth, params[static_cast<size_t>(m)], macs(0, m, 0),
                               fwd_ms(m)};
  };
  const bool llama = model_.shape().llama();
  rep.modules.push_back({"", llama ? "LlamaForCausalLM" : "GPT2LMHeadModel", 0, 0, 0.0, 0.0});
  if (present[0]) rep.modules.push_back(leaf(0, "embedding", "Embedding", 1));
  for (int b = 0; b < L; ++b) {
    if (!present[static_cast<size_t>(obs::attention_module(b))]) continue;
    const obs::ProfiledModule a = leaf(obs::attention_module(b), "attn", "Attention", 2);
    const obs::ProfiledModule f = leaf(obs::mlp_module(b), "mlp", "MLP", 2);
    rep.modules.push_back({(llama ? "model.layers." : "h.") + std::to_string(b), llama ? "LlamaDecoderLayer" : "Block", 1,
                           a.params + f.params, a.macs + f.macs, a.ms + f.ms});
    rep.modules.push_back(a);
    rep.modules.push_back(f);
  }
  if (present[static_cast<size_t>(obs::ln_f_module(L))]) {
    rep.modules.push_back(leaf(obs::ln_f_module(L), llama ? "model.norm" : "ln_f", llama ? "RMSNorm" : "LayerNorm", 1));
    rep.modules.push_back(leaf(obs::lm_head_module(L), "lm_head", "Linear", 1));
  }
  for (const obs::ProfiledModule& p : rep.modules)
    if (p.depth == 1) {
      rep.modules[0].params += p.params;
      rep.modules[0].macs += p.macs;
      rep.modules[0].ms += p.ms;
    }
  rep.params_per_gpu = model_.num_params();
  rep.params_of_model = rep.params_per_gpu * rep.mp_size;
  double all_model = 0.0, all_hardware = 0.0, all_fwd = 0.0;
  for (int k = 0; k < W; ++k)
    for (int m = 0; m < M; ++m) {
      all_fwd += macs(k, m, 0);
      all_model += 2.0 * (macs(k, m, 0) + macs(k, m, 1));
      all_hardware += 2.0 * (macs(k, m, 0) + macs(k, m, 1) + macs(k, m, 2));
    }
  for (int m = 0; m < M; ++m) {
    rep.fwd_macs += macs(0, m, 0);
    rep.bwd_macs += macs(0, m, 1);
    rep.recompute_macs += macs(0, m, 2);
  }
  rep.fwd_macs_of_model = all_fwd / rep.dp_size;
  rep.model_flops = 2.0 * (rep.fwd_macs + rep.bwd_macs);
  rep.hardware_flops = rep.model_flops + 2.0 * rep.recompute_macs;
  rep.fwd_ms = at(t, "forward");
  rep.bwd_ms = at(t, "backward_inner") + at(t, "backward_allreduce");
  rep.step_ms = at(t, "step");
  rep.iter_ms = r.elapsed_ms;
  rep.samples_per_s = r.elapsed_ms > 0 ? cfg_.batch.train_batch_size / (r.elapsed_ms / 1e3) : 0.0;
  rep.peak_flops_total = peak_gflops_total_ * 1e9;
  const double seconds = r.elapsed_ms / 1e3;
  rep.mfu = seconds > 0 && rep.peak_flops_total > 0 ? all_model / seconds / rep.peak_flops_total : 0.0;
  rep.hfu = seconds > 0 && rep.peak_flops_total > 0 ? all_hardware / seconds / rep.peak_flops_total : 0.0;

  const std::string report = obs::flops_profile_report(rep);
  if (o_.flops_profiler.output_file.empty()) {
    std::fputs(report.c_str(), stdout);
    std::fflush(stdout);
  } else {
    write_file(o_.flops_profiler.output_file, report);
  }
  if (output_dir_.empty()) return;
  // Every rank's counts, for tools and tests: MACs per module and pass, forward milliseconds.
  nlohmann::json j = {{"step", r.step}, {"n_layer", L}, {"world_size", W}, {"mfu", rep.mfu}, {"hfu", rep.hfu},
                      {"model_flops_all_ranks", all_model}, {"hardware_flops_all_ranks", all_hardware}};
  for (int k = 0; k < W; ++k) {
    nlohmann::json mods = nlohmann::json::array();
    for (int m = 0; m < M; ++m)
      mods.push_back({{"name", obs::module_name(m, L)}, {"forward_macs", macs(k, m, 0)}, {"backward_macs", macs(k, m, 1)},
                      {"recompute_macs", macs(k, m, 2)}});
    j["ranks"].push_back({{"rank", k}, {"modules", mods},
                          {"unattributed_macs", all[static_cast<size_t>(k * per_rank + per_rank - 1)]}});
  }
  nlohmann::json tree = nlohmann::json::array();
  for (const obs::ProfiledModule& p : rep.modules)
    tree.push_back({{"name", p.name}, {"type", p.type}, {"depth", p.depth}, {"params", p.params}, {"macs", p.macs},
                    {"ms", p.ms}});
  j["tree"] = tree;
  write_file(output_dir_ + "/flops_profile.json", j.dump(1) + "\n");
}

void Observer::write_trace() {
  trace_written_ = true;
  const std::string mine =
      obs::trace_events_json(obs::g_trace.events(), rank_, "rank " + std::to_string(rank_));
  const int W = comms_.world->size();
  int64_t len = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lens(static_cast<size_t>(W)), displs(static_cast<size_t>(W));
  comms_.world->all_gather(&len, lens.data(), 1, DType::I64);
  int64_t total = 0;
  for (int k = 0; k < W; ++k) displs[static_cast<size_t>(k)] = total, total += lens[static_cast<size_t>(k)];
  std::string all(static_cast<size_t>(total), '\0');
  std::copy(mine.begin(), mine.end(), all.begin() + displs[static_cast<size_t>(rank_)]);
  comms_.world->all_gather_v_async(all.data(), lens, displs, DType::U8)->wait();
  if (rank_ != 0 || output_dir_.empty()) return;
  std::string out = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [";
  for (int k = 0; k < W; ++k) {
    if (k > 0) out += ",\n";
    out.append(all, static_cast<size_t>(displs[static_cast<size_t>(k)]), static_cast<size_t>(lens[static_cast<size_t>(k)]));
  }
  out += "]}\n";
  write_file(output_dir_ + "/trace.json", out);
  std::printf("trace   %s/trace.json: steps", output_dir_.c_str());
  for (int64_t s : o_.trace.steps) std::printf(" %lld", (long long)s);
  std::printf(", %d ranks (open in https://ui.perfetto.dev or chrome://tracing)\n", W);
  std::fflush(stdout);
}

void Observer::finish() {
  if (o_.trace.enabled && !trace_written_) write_trace();
  if (!o_.comms_logger.enabled || rank_ != 0) return;
  std::vector<const CommsLog*> logs;
  nlohmann::json axes = nlohmann::json::array();
  for (auto& [comm, names] : named(comms_)) {
    if (!comm || !comm->log()) continue;
    const CommsLog* log = comm->log();
    logs.push_back(log);
    nlohmann::json records = nlohmann::json::array();
    for (const auto& [key, rec] : log->records())
      records.push_back({{"op", comm_op_name(static_cast<CommOp>(key.first))}, {"msg_size", key.second},
                         {"count", rec.count}, {"total_latency_ms", rec.total_ms},
                         {"avg_latency_ms", rec.total_ms / rec.count}, {"algbw_gbps", rec.alg_gbps_sum / rec.count},
                         {"busbw_gbps", rec.bus_gbps_sum / rec.count}, {"bus_bytes", rec.bus_bytes}});
    axes.push_back({{"axis", log->axis()}, {"world", log->world()},
                    {"link", log->intra_node() ? "intra_node" : "inter_node"},
                    {"communicator_bus_bytes", comm->total_bus_bytes() - log->counter_base()}, {"records", records}});
  }
  std::printf("comms logger (rank 0, every operation since start-up):\n%s", comms_table(logs).c_str());
  std::fflush(stdout);
  if (!output_dir_.empty()) write_file(output_dir_ + "/comms_logger.json", nlohmann::json{{"rank", 0}, {"axes", axes}}.dump(1) + "\n");
}

}  // namespace zero3d
