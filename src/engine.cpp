// engine.cpp — the training loop. Reads like the algorithm (DEEPSPEED-FACTS §1.2, §3, §4).
#include "engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>

#include <sys/resource.h>

#include <cstdlib>
#include <thread>

#include "base.hpp"
#include "checkpoint.hpp"
#include "failure.hpp"
#include "gemm.hpp"
#include "reduce.hpp"
#include "weights.hpp"

namespace zero3d {

namespace {
GPTShape shape_of(const ModelConfig& m) {
  return GPTShape{m.vocab_size, m.n_positions, m.n_layer, m.n_head, m.n_embd};
}

std::string format_number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// The process's resident-memory high-water mark (getrusage reports KiB on Linux).
int64_t peak_rss_bytes() {
  struct rusage u {};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

// "2 nodes, 4 ranks per node (local rank from MPI_COMM_TYPE_SHARED)"
std::string node_summary(MPI_Comm world, int* local_rank_out) {
  MPI_Comm node;
  MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int local_rank = 0, local_size = 1, leaders = 0;
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);
  *local_rank_out = local_rank;
  int is_leader = local_rank == 0 ? 1 : 0;
  MPI_Allreduce(&is_leader, &leaders, 1, MPI_INT, MPI_SUM, world);
  MPI_Comm_free(&node);
  return std::to_string(leaders) + (leaders == 1 ? " node, " : " nodes, ") + std::to_string(local_size) +
         " ranks on rank 0's node";
}
}  // namespace

Engine::Engine(const Config& cfg, const ProcessGroups& groups, std::string output_dir, Watchdog* watchdog)
    : cfg_(cfg), groups_(groups), output_dir_(std::move(output_dir)) {
  dp_comm_ = std::make_unique<MpiCommunicator>(groups.data_parallel(), watchdog);
  rank_ = dp_comm_->rank();
  world_ = dp_comm_->size();
  run_collectively(groups.world(), [this] { setup_local(); });
  if (!cfg_.training.resume.empty()) resume_from_checkpoint();
  flops_per_token_ = gpt_flops_per_token(model_->shape(), model_->num_params());
  double peak = cfg_.training.peak_gflops > 0 ? cfg_.training.peak_gflops : measure_gemm_peak_gflops(model_->compute_type());
  peak_gflops_total_ = peak;
  dp_comm_->all_reduce(&peak_gflops_total_, 1, DType::F64, ReduceOp::Sum);
  node_summary_ = node_summary(groups.world(), &local_rank_);
  print_startup();
}

void Engine::setup_local() {
  const int64_t B = cfg_.batch.micro_batch, T = cfg_.model.n_positions;
  const PrecisionConfig& pc = cfg_.precision;
  model_ = std::make_unique<GPT>(shape_of(cfg_.model), B, T, pc.param);
  zero_ = std::make_unique<ZeroOptimizer>(cfg_.zero, cfg_.optimizer, StateTypes{pc.param, pc.grad_accum, pc.comm},
                                          model_->layout(), model_->units(), *dp_comm_);
  // DeepSpeed: fp16 scales the loss (dynamic when loss_scale is 0); bf16 and fp32 use 1.
  LossScalerConfig ls;
  ls.dynamic = pc.param == DType::F16 && pc.loss_scale == 0.0;
  ls.static_scale = pc.param == DType::F16 && pc.loss_scale > 0.0 ? pc.loss_scale : 1.0;
  ls.initial_scale_power = pc.initial_scale_power;
  ls.scale_window = pc.loss_scale_window;
  ls.hysteresis = pc.hysteresis;
  ls.consecutive_hysteresis = pc.consecutive_hysteresis;
  ls.min_scale = pc.min_loss_scale;
  ls.zero_path = cfg_.zero.stage > 0;  // stage 0 behaves as DeepSpeed's non-ZeRO FP16_Optimizer
  scaler_ = std::make_unique<LossScaler>(ls);
  check_overflow_ = pc.param == DType::F16 || (pc.param == DType::BF16 && pc.check_grad_overflow);
  if (cfg_.model.init_from.empty()) {
    zero_->init_params([&](float* out, int64_t begin, int64_t end) {
      init_gpt_params_range(out, model_->layout(), model_->shape(), cfg_.training.seed, begin, end);
    });
  } else {
    std::vector<float> full(static_cast<size_t>(model_->num_params()));
    load_weights(cfg_.model.init_from, model_->layout(), full.data());
    zero_->init_params([&](float* out, int64_t begin, int64_t end) {
      std::copy(full.begin() + begin, full.begin() + end, out);
    });
  }
  data_ = std::make_unique<DataLoader>(cfg_.data, cfg_.model.vocab_size, B, T, cfg_.training.seed);
  schedule_ = std::make_unique<LRSchedule>(cfg_.scheduler, cfg_.optimizer.lr);
  inputs_ = Kokkos::View<int32_t*>("inputs", B * T);
  targets_ = Kokkos::View<int32_t*>("targets", B * T);
  if (groups_.rank() == 0 && !output_dir_.empty()) {
    make_directories(output_dir_);
    std::ofstream out(output_dir_ + "/config.json");
    out << cfg_.resolved.dump(2) << '\n';
    if (!out) throw SystemError(output_dir_ + "/config.json: write failed");
    metrics_ = std::make_unique<MetricsWriter>(output_dir_ + "/metrics.jsonl", !cfg_.training.resume.empty());
  }
  inject_fault(-1);
}

// Fault injection for the failure tests: ZERO3D_FAULT="KIND:RANK[:STEP]" with KIND one of
// input (bad input at setup), throw (a system error at STEP), stall (hang at STEP).
void Engine::inject_fault(int64_t step) const {
  const char* spec = std::getenv("ZERO3D_FAULT");
  if (!spec) return;
  char kind[16] = {};
  int rank = -1;
  long long at = -1;
  if (std::sscanf(spec, "%15[a-z]:%d:%lld", kind, &rank, &at) < 2 || rank != groups_.rank() || at != step) return;
  const std::string k = kind;
  if (k == "input") throw InputError("injected bad input (ZERO3D_FAULT=" + std::string(spec) + ")");
  if (k == "throw") throw SystemError("injected failure at step " + std::to_string(step));
  if (k == "stall") std::this_thread::sleep_for(std::chrono::hours(1));
}

// Re-partitions on load: each rank reads its own range of the flat buffers, whatever the
// world size and stage of the run that saved.
void Engine::resume_from_checkpoint() {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<CheckpointReader> reader;
  run_collectively(groups_.world(), [&] {
    reader = std::make_unique<CheckpointReader>(CheckpointReader::open(cfg_.training.resume, cfg_.training.save_dir));
    reader->check_layout(model_->layout());
    const CheckpointMeta& m = reader->meta();
    const std::string type = cfg_.optimizer.type == OptimizerType::SGD ? "SGD"
                             : cfg_.optimizer.type == OptimizerType::Lamb ? "Lamb" : "Adam";
    if (m.optimizer_type != type)
      throw InputError(reader->dir() + ": saved with optimizer " + m.optimizer_type + ", the config uses " + type);
    zero_->read_checkpoint(*reader);
  });
  zero_->finish_checkpoint_load();
  const CheckpointMeta& m = reader->meta();
  step_ = m.step;
  schedule_->set_last_batch_iteration(m.lr_last_batch_iteration);
  skipped_steps_ = m.skipped_steps;
  // A dynamic scale continues where the saved run left it (when that run scaled dynamically too).
  if (scaler_->dynamic() && m.loss_scaler.value("dynamic", false)) {
    LossScalerState st;
    st.cur_scale = m.loss_scaler.at("cur_scale");
    st.cur_iter = m.loss_scaler.at("cur_iter");
    st.last_overflow_iter = m.loss_scaler.at("last_overflow_iter");
    st.cur_hysteresis = m.loss_scaler.at("cur_hysteresis");
    scaler_->set_state(st);
  }
  if (rank_ == 0) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double mb = 4.0 * m.states.size() * m.total_params / 1e6;
    std::printf("resume  %s: step %lld, saved by %lld rank%s at ZeRO stage %lld; loaded %.1f MB in %.2f s (%.0f MB/s)\n",
                reader->dir().c_str(), (long long)m.step, (long long)m.dp_world_size, m.dp_world_size == 1 ? "" : "s",
                (long long)m.zero_stage, mb, s, mb / s);
    if (m.global_samples != step_ * cfg_.batch.train_batch_size)
      std::printf("resume  note: train_batch_size differs from the saved run's (%lld samples in %lld steps); the data "
                  "continues at sample %lld\n", (long long)m.global_samples, (long long)m.step,
                  (long long)(step_ * cfg_.batch.train_batch_size));
  }
}

void Engine::save(bool final_step) {
  const int64_t every = cfg_.training.save_interval;
  if (every <= 0 || (step_ % every != 0 && !final_step)) return;
  const auto t0 = std::chrono::steady_clock::now();
  CheckpointMeta m;
  m.step = step_;
  m.global_samples = step_ * cfg_.batch.train_batch_size;
  m.zero_stage = zero_->stage();
  m.dp_world_size = world_;
  m.optimizer_step = zero_->optimizer_step();
  m.lr_last_batch_iteration = schedule_->last_batch_iteration();
  m.micro_batch = cfg_.batch.micro_batch;
  m.gradient_accumulation_steps = cfg_.batch.gradient_accumulation_steps;
  m.data_position = step_ * cfg_.batch.train_batch_size;  // samples consumed
  m.seed = cfg_.training.seed;
  m.optimizer_type = cfg_.optimizer.type == OptimizerType::SGD ? "SGD" : cfg_.optimizer.type == OptimizerType::Lamb ? "Lamb" : "Adam";
  m.config = cfg_.resolved;
  m.model_dtype = dtype_name(cfg_.precision.param);
  m.skipped_steps = skipped_steps_;
  const LossScalerState& ls = scaler_->state();
  m.loss_scaler = {{"dynamic", scaler_->dynamic()}, {"cur_scale", ls.cur_scale}, {"cur_iter", ls.cur_iter},
                   {"last_overflow_iter", ls.last_overflow_iter}, {"cur_hysteresis", ls.cur_hysteresis}};
  m.total_params = model_->num_params();
  for (const TensorSpec& t : model_->layout().tensors())
    m.tensors.push_back({{"name", t.name}, {"shape", t.shape}, {"offset", t.offset}});
  for (int r = 0; r < world_; ++r) m.ranges.push_back(zero_->partition().owned(r, 0, model_->num_params()));
  m.states = zero_->checkpoint_states();
  const std::string tag = "global_step" + std::to_string(step_);
  save_checkpoint(cfg_.training.save_dir, tag, m, zero_->checkpoint_slice(), model_->layout(), groups_.world(),
                  cfg_.training.keep_last);
  if (rank_ == 0) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double mb = 4.0 * m.states.size() * model_->num_params() / 1e6;
    std::printf("checkpoint %s/%s: %.1f MB in %.2f s (%.0f MB/s)\n", cfg_.training.save_dir.c_str(), tag.c_str(), mb, s,
                mb / s);
    std::fflush(stdout);
  }
}

void Engine::print_startup() const {
  if (rank_ != 0) return;
  const GPTShape& s = model_->shape();
  const ProcessTopology& topo = groups_.topology();
  std::printf("zero3d %s | world size %d | topology pipe=%d data=%d model=%d | Kokkos %s | %s\n", ZERO3D_VERSION,
              topo.world_size(), topo.get_dim("pipe"), topo.get_dim("data"), topo.get_dim("model"),
              Kokkos::DefaultExecutionSpace::name(), node_summary_.c_str());
  std::printf("model   GPT-2 V=%lld T=%lld L=%lld H=%lld C=%lld: %lld parameters (%.2f MB fp32), %s\n",
              (long long)s.vocab_size, (long long)s.n_positions, (long long)s.n_layer, (long long)s.n_head,
              (long long)s.n_embd, (long long)model_->num_params(), model_->num_params() * 4.0 / 1e6,
              cfg_.model.init_from.empty() ? ("initialised from seed " + std::to_string(cfg_.training.seed)).c_str()
                                           : ("loaded from " + cfg_.model.init_from).c_str());
  std::printf("batch   %s\n", cfg_.batch.derivation.c_str());
  std::printf("data    %s\n", data_->describe().c_str());
  std::printf("optim   %s lr %.3g%s | clip %.3g | %lld steps | MFU peak %.1f GFLOP/s (%s)\n",
              cfg_.optimizer.type_name.c_str(), cfg_.optimizer.lr,
              cfg_.scheduler.type == SchedulerType::None ? "" : (" | scheduler " + cfg_.scheduler.type_name).c_str(),
              cfg_.gradient_clipping, (long long)cfg_.training.steps, peak_gflops_total_,
              cfg_.training.peak_gflops > 0
                  ? "training.peak_gflops"
                  : (model_->compute_type() == DType::BF16 ? "measured bf16 gemm, all ranks" : "measured sgemm, all ranks"));
  const PrecisionConfig& pc = cfg_.precision;
  std::string scaling = "no loss scaling";
  if (pc.param == DType::F16)
    scaling = pc.loss_scale > 0 ? "static loss scale " + format_number(pc.loss_scale)
                                : "dynamic loss scale 2^" + std::to_string(pc.initial_scale_power) + ", window " +
                                      std::to_string(pc.loss_scale_window) + ", hysteresis " +
                                      std::to_string(pc.hysteresis) + ", min " + format_number(pc.min_loss_scale);
  std::printf("precision %s parameters, %s gradient accumulation, %s communication%s; %s; %s; matmuls: %s\n",
              dtype_name(pc.param).c_str(), dtype_name(pc.grad_accum).c_str(), dtype_name(pc.comm).c_str(),
              pc.param == DType::F32 ? "" : ", fp32 master and optimizer states", scaling.c_str(),
              check_overflow_ ? "inf/NaN gradients skip the step" : "no overflow check",
              gemm_path(model_->compute_type()).c_str());
  const MemoryBytes m = zero_->memory();
  std::printf("zero    stage %d over %d data-parallel ranks (%s), reduce buckets of %lld elements, overlap_comm %s%s\n",
              zero_->stage(), world_, dp_comm_->backend().c_str(), (long long)cfg_.zero.reduce_bucket_size,
              cfg_.zero.overlap_comm ? "on" : "off",
              cfg_.training.comms_timeout > 0 ? (", comms_timeout " + std::to_string(cfg_.training.comms_timeout) + " s").c_str() : "");
  std::printf("memory  bytes per rank: params %lld | grads %lld | master %lld | optimizer_states %lld | "
              "comm_buffers %lld | model states %.1f MB (stage 0 would hold %.1f MB) | activations %.1f MB\n",
              (long long)m.params, (long long)m.grads, (long long)m.master, (long long)m.optimizer_states,
              (long long)m.comm_buffers, m.model_states() / 1e6, 16.0 * model_->num_params() / 1e6,
              model_->activation_bytes() / 1e6);
  if (!output_dir_.empty()) std::printf("output  %s/{config.json,metrics.jsonl}\n", output_dir_.c_str());
  std::fflush(stdout);
}

StepResult Engine::train_step() {
  const auto t0 = std::chrono::steady_clock::now();
  timers_.reset();
  inject_fault(step_ + 1);
  const int64_t gas = cfg_.batch.gradient_accumulation_steps;
  StepResult r;
  r.step = step_ + 1;
  r.lr = schedule_->lr();

  dp_comm_->reset_bus_bytes();
  zero_->zero_grad();
  auto host_in = Kokkos::create_mirror_view(inputs_);
  auto host_tgt = Kokkos::create_mirror_view(targets_);
  double local_loss = 0.0;
  for (int64_t micro = 0; micro < gas; ++micro) {
    // This rank's samples of the global batch (data.hpp): independent of how it is split.
    const int64_t first = step_ * cfg_.batch.train_batch_size + (micro * world_ + rank_) * cfg_.batch.micro_batch;
    data_->micro_batch(first, host_in.data(), host_tgt.data());
    Kokkos::deep_copy(inputs_, host_in);
    Kokkos::deep_copy(targets_, host_tgt);
    // Gradients accumulate locally; the last micro-batch's backward completes them.
    zero_->begin_micro_step(micro == gas - 1);
    {
      auto t = timers_.time("forward");
      local_loss += model_->forward(inputs_.data(), targets_.data(), *zero_);
    }
    {
      auto t = timers_.time("backward_inner");
      // DeepSpeed scales the loss by 1/GAS so that accumulated gradients are a mean.
      // fp16: the loss is multiplied by the loss scale as well (FACTS §2.4).
      model_->backward(static_cast<float>(scaler_->scale()) / static_cast<float>(gas), *zero_);
    }
  }
  {
    auto t = timers_.time("backward_allreduce");
    zero_->finish_reduction();
  }
  {
    auto t = timers_.time("step");
    // DeepSpeed's order: overflow check, scaler update, then unscale+clip with the new scale.
    const GradStats stats = zero_->grad_stats();
    const bool overflow = check_overflow_ && !stats.finite;
    std::string scaler_log;
    try {
      scaler_log = scaler_->update(overflow, r.step);
    } catch (const SystemError& e) {  // every rank saw the same overflow: agreed, one report
      throw AgreedFailure(e.what(), kExitSystem, 0, rank_ == 0);
    }
    if (!scaler_log.empty() && rank_ == 0) std::printf("[zero3d] %s\n", scaler_log.c_str());
    r.loss_scale = scaler_->scale();
    if (overflow) {  // no update, scheduler not advanced; the global step still counts
      zero_->skip_step();
      r.skipped = true;
      r.grad_norm = -1.0;
      ++skipped_steps_;
    } else {
      r.grad_norm = stats.norm_scaled / scaler_->scale();
      zero_->apply_step(r.lr, schedule_->betas(), cfg_.gradient_clipping, scaler_->scale(), stats);
      schedule_->step();
    }
    r.skipped_steps = skipped_steps_;
  }
  r.comm_bytes = dp_comm_->bus_bytes();
  double mean_loss = local_loss / static_cast<double>(gas);
  dp_comm_->all_reduce(&mean_loss, 1, DType::F64, ReduceOp::Sum);
  r.loss = mean_loss / world_;
  ++step_;

  r.elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const double tokens = static_cast<double>(cfg_.batch.train_batch_size * cfg_.model.n_positions);
  r.tokens_per_s = tokens / (r.elapsed_ms / 1e3);
  r.mfu = flops_per_token_ * r.tokens_per_s / (peak_gflops_total_ * 1e9);
  return r;
}

std::vector<StepResult> Engine::train() {
  std::vector<StepResult> results;
  double total_ms = 0.0;
  for (int64_t s = step_; s < cfg_.training.steps; ++s) {
    StepResult r = train_step();
    save(s + 1 == cfg_.training.steps);
    results.push_back(r);
    if (results.size() > 1 || cfg_.training.steps == 1) total_ms += r.elapsed_ms;  // the first step warms caches
    if (rank_ != 0) continue;
    const auto& ms = timers_.ms();
    if (metrics_) {
      nlohmann::json rec = {{"step", r.step},
                            {"loss", r.loss},
                            {"lr", r.lr},
                            {"grad_norm", r.grad_norm},
                            {"tokens_per_s", r.tokens_per_s},
                            {"mfu", r.mfu},
                            {"elapsed_ms", r.elapsed_ms},
                            {"samples", r.step * cfg_.batch.train_batch_size},
                            {"comm_bytes", r.comm_bytes},
                            {"peak_rss_bytes", peak_rss_bytes()},
                            {"loss_scale", r.loss_scale},
                            {"skipped", r.skipped},
                            {"skipped_steps", r.skipped_steps}};
      const MemoryBytes m = zero_->memory();
      rec["memory"] = {{"params", m.params},           {"grads", m.grads},
                       {"master", m.master},           {"optimizer_states", m.optimizer_states},
                       {"comm_buffers", m.comm_buffers}, {"live_params_peak", m.live_params_peak}};
      if (cfg_.wall_clock_breakdown) {
        const double fwd = ms.count("forward") ? ms.at("forward") : 0.0;
        const double inner = ms.count("backward_inner") ? ms.at("backward_inner") : 0.0;
        const double ar = ms.count("backward_allreduce") ? ms.at("backward_allreduce") : 0.0;
        const double st = ms.count("step") ? ms.at("step") : 0.0;
        rec["time_ms"] = {{"forward", fwd}, {"backward", inner + ar}, {"backward_inner", inner},
                          {"backward_allreduce", ar}, {"step", st}};
      }
      metrics_->write(rec);
    }
    if (r.step % cfg_.steps_per_print == 0 || r.step == 1 || r.step == cfg_.training.steps) {
      std::string scale;
      if (cfg_.precision.param != DType::F32) {
        char buf[96];
        std::snprintf(buf, sizeof buf, " | loss_scale %g | skipped %lld%s", r.loss_scale, (long long)r.skipped_steps,
                      r.skipped ? " (this step)" : "");
        scale = buf;
      }
      std::printf("step %6lld/%lld | loss %.4f | lr %.3e | grad_norm %.4f | %8.0f tok/s | MFU %5.1f%% | %7.1f ms%s\n",
                  (long long)r.step, (long long)cfg_.training.steps, r.loss, r.lr, r.grad_norm, r.tokens_per_s,
                  100.0 * r.mfu, r.elapsed_ms, scale.c_str());
      if (cfg_.wall_clock_breakdown) {
        std::printf("time (ms) | forward: %.2f | backward: %.2f | backward_inner: %.2f | backward_allreduce: %.2f | "
                    "step: %.2f\n",
                    ms.count("forward") ? ms.at("forward") : 0.0,
                    (ms.count("backward_inner") ? ms.at("backward_inner") : 0.0) +
                        (ms.count("backward_allreduce") ? ms.at("backward_allreduce") : 0.0),
                    ms.count("backward_inner") ? ms.at("backward_inner") : 0.0,
                    ms.count("backward_allreduce") ? ms.at("backward_allreduce") : 0.0,
                    ms.count("step") ? ms.at("step") : 0.0);
      }
      std::fflush(stdout);
    }
  }
  if (rank_ == 0 && !results.empty()) {
    const int64_t timed = std::max<int64_t>(1, static_cast<int64_t>(results.size()) - 1);
    const double tokens = static_cast<double>(timed) * cfg_.batch.train_batch_size * cfg_.model.n_positions;
    const double tps = tokens / (total_ms / 1e3);
    std::printf("done: %lld steps | final loss %.4f (first %.4f) | %.0f tokens/s | MFU %.1f%% of %.1f GFLOP/s | "
                "%.1f s\n",
                (long long)results.size(), results.back().loss, results.front().loss, tps,
                100.0 * flops_per_token_ * tps / (peak_gflops_total_ * 1e9), peak_gflops_total_,
                (total_ms + results.front().elapsed_ms) / 1e3);
    std::fflush(stdout);
  }
  return results;
}

}  // namespace zero3d
