// engine.cpp — the training loop. Reads like the algorithm (DEEPSPEED-FACTS §1.2, §3, §4).




#include "base/errors.hpp"
#include "base/failure.hpp"
#include "base/heap.hpp"
#include "io/checkpoint.hpp"
#include "io/checkpoint_options.hpp"
#include "io/weights.hpp"
#include "kernels/device.hpp"
#include "kernels/gemm.hpp"
#include "kernels/memory.hpp"
#include "kernels/reduce.hpp"
#include "train/engine.hpp"
#include "train/estimator.hpp"
#include "train/job_control.hpp"
#include "train/memory_breakdown.hpp"
#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sys/resource.h>
#include <thread>

namespace zero3d {

namespace {
GPTShape shape_of(const ModelConfig& m) { return gpt_shape_of(m); }

}  // namespace

ShardGroups Engine::shard_groups() {
  ShardGroups s;
  for (auto& [name, c] : shard_comms_) {
    Communicator& m = model_comms_.of(*c);
    if (name == "mics_replicate" && c->size() > 1) s.replicas = &m;
    if (name == "mics_inter") s.gather_inter = &m;
    if (name == "mics_intra") s.gather_intra = &m;
    if (name == "hpz") s.hpz = &m;
    if (name == "qgz_intra") s.qgz_intra = &m;
    if (name == "qgz_inter") s.qgz_inter = &m;
  }
  return s;
}

Engine::Engine(const Config& cfg, const ProcessGroups& groups, std::string output_dir, Watchdog* watchdog)
    : cfg_(cfg), groups_(groups), output_dir_(std::move(output_dir)) {
  keep_mmap_threshold();  // heap.hpp: freed buffers leave the resident set, step after step
  dp_comm_ = std::make_unique<MpiCommunicator>(groups.data_parallel(), watchdog);
  pipe_comm_ = std::make_unique<MpiCommunicator>(groups.axis("pipe"), watchdog);
  tp_comm_ = std::make_unique<MpiCommunicator>(groups.axis("model"), watchdog);
  world_comm_ = std::make_unique<MpiCommunicator>(groups.world(), watchdog);
  mp_comm_ = std::make_unique<MpiCommunicator>(groups.axis("model_parallel"), watchdog);
  if (groups.axis("embedding") != MPI_COMM_NULL)
    emb_comm_ = std::make_unique<MpiCommunicator>(groups.axis("embedding"), watchdog);
  if (cfg.model.moe.enabled()) {
    ep_comm_ = std::make_unique<MpiCommunicator>(groups.axis("expert"), watchdog);
    edp_comm_ = std::make_unique<MpiCommunicator>(groups.axis("expert_data"), watchdog);
    enorm_comm_ = std::make_unique<MpiCommunicator>(groups.axis("expert_norm"), watchdog);
  }
  for (const char* name : {"mics_shard", "mics_replicate", "mics_inter", "mics_intra", "hpz", "qgz_intra", "qgz_inter"})
    if (groups.has(name)) shard_comms_.emplace_back(name, std::make_unique<MpiCommunicator>(groups.axis(name), watchdog));
  // Each group's bytes are intra-node or inter-node by where its ranks lie (parallel/nodes.hpp).
  for (MpiCommunicator* c : {dp_comm_.get(), pipe_comm_.get(), tp_comm_.get(), world_comm_.get(), mp_comm_.get(),
                             emb_comm_.get(), ep_comm_.get(), edp_comm_.get(), enorm_comm_.get()})
    if (c) c->set_intra_node(groups.nodes().within_one_node(c->comm()));
  for (auto& [name, c] : shard_comms_) c->set_intra_node(groups.nodes().within_one_node(c->comm()));
  rank_ = dp_comm_->rank();
  world_ = dp_comm_->size();
  stage_ = pipe_comm_->rank();
  stages_ = pipe_comm_->size();
  // NCCL for the groups whose collectives carry model memory. The pipe group's traffic is
  // point-to-point, which keeps MPI's tags (comm.hpp), so it gets no NCCL communicator. Opened
  // before the plan is held to the device's free memory, so that NCCL's own buffers count.
  // (The embedding group carries the tied head's gradient only.)
  MpiCommunicator* tied = shape_of(cfg_.model).tied_head() ? emb_comm_.get() : nullptr;
  std::vector<MpiCommunicator*> device_groups{dp_comm_.get(), tp_comm_.get(), tied, ep_comm_.get(), edp_comm_.get()};
  for (auto& [name, c] : shard_comms_) device_groups.push_back(c.get());
  run_collectively(groups.world(), [&] { model_comms_.open_nccl(groups.world(), device_groups, watchdog); });
  if constexpr (kernels::kGpuBuild) run_collectively(groups.world(), [&] { check_device_memory(cfg_, groups.world()); });
  run_collectively(groups.world(), [this] { setup_local(); });
  if (!cfg_.training.resume.empty()) resume_from_checkpoint();
  if (groups_.rank() == 0 && !output_dir_.empty()) open_metrics();
  // MFU counts the whole model's FLOPs (6N + attention) against every rank's peak.
  // With MoE a token meets k experts per MoE block: FLOPs count the active parameters.
  flops_per_token_ = gpt_flops_per_token(model_->shape(), gpt_active_params(model_->shape(), cfg_.model.moe.k));
  block_flops_per_token_ = flops_per_token_ - 6.0 * static_cast<double>(gpt_params_outside_blocks(model_->shape()));
  double peak = cfg_.training.peak_gflops > 0 ? cfg_.training.peak_gflops : measure_gemm_peak_gflops(model_->compute_type());
  peak_gflops_total_ = peak;
  dp_comm_->all_reduce(&peak_gflops_total_, 1, DType::F64, ReduceOp::Sum);
  mp_comm_->all_reduce(&peak_gflops_total_, 1, DType::F64, ReduceOp::Sum);
  node_summary_ = node_summary(groups.world(), &local_rank_);
  // compared at the end with the measured peak: the process's on a CPU build, the device's on a GPU build
  predicted_peak_ =
      estimate_budget(cfg_, world_comm_->size(), cfg_.zero.stage, groups_.nodes().ranks_per_node()).device_need();
  run_collectively(groups.world(), [&] {
    ObservedComms observed{dp_comm_.get(), pipe_comm_.get(), tp_comm_.get(), world_comm_.get(), mp_comm_.get(), emb_comm_.get(), {}};
    for (auto& [name, c] : shard_comms_) observed.shards.emplace_back(c.get(), name);
    observer_ = std::make_unique<Observer>(cfg_, groups_.rank(), std::move(observed), *model_, output_dir_, peak_gflops_total_);
  });
  print_startup();
}

void Engine::setup_local() {
  const int64_t B = cfg_.batch.micro_batch, T = cfg_.model.n_positions;
  const PrecisionConfig& pc = cfg_.precision;
  GPTShape shape = shape_of(cfg_.model);
  shape.dropout.seed = cfg_.training.seed;  // dropout masks: the training seed's stream
  const int t = tp_comm_->size(), tp_rank = tp_comm_->rank();
  const int ep = ep_comm_ ? ep_comm_->size() : 1, ep_rank = ep_comm_ ? ep_comm_->rank() : 0;
  model_ = std::make_unique<GPT>(shape, B, T, pc.param,
                                 gpt_model_part(shape, cfg_.pipe_bounds, stages_, stage_, t, tp_rank, ep, ep_rank),
                                 TensorGroup{&model_comms_.of(*tp_comm_), t, tp_rank, cfg_.tensor.overlap_comm,
                                             cfg_.tensor.sequence_parallel, &tensor_comm_ms_},
                                 cfg_.activation_checkpointing, moe_routing(), pc.autocast.dtype);
  // Every stage partitions the same element count (the largest stage's), so the tied wte at
  // local offset 0 of the first and last stage is cut identically over the data group.
  int64_t partition_numel = model_->part().expert_begin;  // the dense state (experts have an optimizer of their own)
  for (int s = 0; s < stages_ && stages_ > 1; ++s)
    partition_numel =
        std::max(partition_numel, gpt_model_part(shape, cfg_.pipe_bounds, stages_, s, t, tp_rank, ep, ep_rank).expert_begin);
  if (stages_ > 1 && shape.tied_head() && (stage_ == 0 || stage_ == stages_ - 1))
    tied_numel_ = model_->part().vocab_local * shape.n_embd;
  // MiCS: the state is partitioned over the shard group (zero/shard_groups.hpp)
  MpiCommunicator& partition_group = groups_.has("mics_shard") ? *shard_comms_.front().second : *dp_comm_;
  zero_ = std::make_unique<ZeroOptimizer>(cfg_.zero, cfg_.optimizer, state_types_of(cfg_, model_->part().dense_layout),
                                          model_->part().dense_layout, model_->part().dense_units,
                                          model_comms_.of(partition_group), partition_numel,
                                          /*ordered_backward=*/model_->num_chunks() == 1, groups_.rank(), shard_groups());
  // The schedule is fixed for the run (micro-batches = gradient_accumulation_steps).
  const pipe::ScheduleSpec spec{cfg_.pipeline.schedule, stages_, static_cast<int>(cfg_.batch.gradient_accumulation_steps),
                                cfg_.pipeline.virtual_stages};
  schedule_steps_ = pipe::make_schedule(spec, stage_);
  bool split = false;
  std::vector<int> trace;
  std::vector<bool> backward;  // per trace entry: fetched by a backward pass
  last_backward_.assign(model_->num_chunks(), -1);
  int index = 0;
  for (const auto& step : schedule_steps_.steps)
    for (const pipe::Instruction& in : step) {
      if (in.op == pipe::Op::Forward) {
        for (int u : model_->fetch_order(in.chunk, true)) trace.push_back(u), backward.push_back(false);
      } else if (in.op == pipe::Op::Backward || in.op == pipe::Op::BackwardInput) {
        for (int u : model_->fetch_order(in.chunk, false)) trace.push_back(u), backward.push_back(true);
      }
      if (in.op == pipe::Op::Backward || in.op == pipe::Op::BackwardWeight) last_backward_[in.chunk] = index;
      split = split || in.op == pipe::Op::BackwardInput;
      ++index;
    }
  first_expert_unit_ = model_->part().first_expert_unit;
  if (first_expert_unit_ >= 0) {  // the experts' units go to their own optimizer's trace
    std::vector<int> dense, experts;
    for (int u : trace) (u >= first_expert_unit_ ? experts : dense).push_back(u >= first_expert_unit_ ? u - first_expert_unit_ : u);
    trace = std::move(dense);
    expert_trace_ = std::move(experts);
  }
  zero_->set_fetch_trace(std::move(trace), first_expert_unit_ >= 0 ? std::vector<bool>{} : std::move(backward));
  for (int b = 0; b < schedule_steps_.num_buffers; ++b) buffers_.push_back(model_->make_buffer(split));
  pending_.resize(static_cast<size_t>(schedule_steps_.num_buffers));
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
  const bool autocast16 = pc.autocast.dtype == DType::F16;
  if (autocast16) {  // torch_autocast fp16: DeepSpeed's engine makes a torch.amp.GradScaler with its defaults
    ls.dynamic = ls.grad_scaler = true;
    ls.initial_scale_power = 16;  // init_scale 2^16
    ls.scale_window = 2000;       // growth_interval
  }
  scaler_ = std::make_unique<LossScaler>(ls);
  check_overflow_ = pc.param == DType::F16 || autocast16 || (pc.param == DType::BF16 && pc.check_grad_overflow);
  // Every layout starts from the weights of the whole model: drawn from (seed, tensor name),
  // or read from init_from, then cut to this rank's slices through the part's runs (Megatron's
  // CPU initialisation: shards are exact slices of the t = 1 tensor). Vocabulary padding is 0.
  const ModelPart& part = model_->part();
  const ParamLayout global = gpt_layout(shape);
  std::vector<float> full, tensor_values;
  std::string tensor_name;
  if (!cfg_.model.init_from.empty()) {
    full.resize(static_cast<size_t>(global.total()));
    load_weights(cfg_.model.init_from, global, full.data());
  }
  const auto fill_global = [&](float* out, int64_t gb, int64_t ge) {
    if (!full.empty()) return (void)std::copy(full.begin() + gb, full.begin() + ge, out);
    if (t == 1) return init_gpt_params_range(out, global, shape, cfg_.training.seed, gb, ge);
    // Tensor slices are many short runs: draw each whole tensor once and copy from it.
    for (const TensorSpec& ts : global.tensors()) {
      const int64_t lo = std::max(gb, ts.offset), hi = std::min(ge, ts.offset + ts.numel);
      if (lo >= hi) continue;
      if (tensor_name != ts.name) {
        tensor_values.resize(static_cast<size_t>(ts.numel));
        init_gpt_params_range(tensor_values.data(), global, shape, cfg_.training.seed, ts.offset, ts.offset + ts.numel);
        tensor_name = ts.name;
      }
      std::copy(tensor_values.begin() + (lo - ts.offset), tensor_values.begin() + (hi - ts.offset), out + (lo - gb));
    }
  };
  const bool padded = part.vocab_padded > shape.vocab_size;  // rows the runs skip: zeros
  zero_->init_params([&](float* out, int64_t begin, int64_t end) {
    if (t > 1 || padded) std::fill(out, out + (end - begin), 0.0f);
    for (const LayoutSegment& run : part.global_runs(begin, end, /*saving=*/false))
      fill_global(out + (run.local_begin - begin), run.global_begin,
                  run.global_begin + (run.local_end - run.local_begin));
  });
  if (first_expert_unit_ >= 0) setup_expert_optimizer(fill_global);
  data_ = std::make_unique<DataLoader>(cfg_.data, cfg_.model.vocab_size, B, T, cfg_.training.seed);
  setup_evaluation();
  schedule_ = std::make_unique<LRSchedule>(cfg_.scheduler, cfg_.optimizer.lr);
  if (groups_.rank() == 0 && !output_dir_.empty()) {
    make_directories(output_dir_);
    std::ofstream out(output_dir_ + "/config.json");
    out << cfg_.resolved.dump(2) << '\n';
    if (!out) throw SystemError(output_dir_ + "/config.json: write failed");
  }
  inject_fault(-1);
}

// Fault injection for the failure tests: ZERO3D_FAULT="KIND:RANK[:STEP]" with KIND one of
// input (bad input at setup), throw (a system error at STEP), stall (hang at STEP), pause (the
// rank stops itself with SIGSTOP as STEP begins, for a test to signal it there and continue it:
// a fast build cannot run past the step first), replica (perturb one tensor-replicated
// parameter before STEP).
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
  if (k == "pause") std::raise(SIGSTOP);
  if (k == "replica") {  // nudge this rank's copy of the first tensor-replicated parameter it holds
    const auto [b, e] = zero_->checkpoint_range();
    float* params = const_cast<float*>(zero_->checkpoint_arrays().front().second);  // model memory
    for (const auto& [lo, hi] : model_->part().replicated_ranges())
      if (std::max(lo, b) < std::min(hi, e)) {
        float* p = params + (std::max(lo, b) - b);
        const float nudged = kernels::read_one(p) + 1e-3f;
        kernels::copy_to_device(p, &nudged, sizeof nudged);
        break;
      }
  }
}

int Engine::peer_stage(int chunk, int delta) const {
  const int v = chunk * stages_ + stage_ + delta;  // virtual stage of the peer (Megatron's round robin)
  return ((v % stages_) + stages_) % stages_;
}

// Tags name the receiving virtual stage and the kind (0 activation, 1 gradient, 2 router sums, 3
// expert fractions): messages of one (pair, tag) are matched in posting order, which both sides
// take from the schedule.
int Engine::tag(int chunk, int delta, int kind) const { return 4 * (chunk * stages_ + stage_ + delta) + kind; }

void Engine::Store::progress() {
  e_.zero_->progress();
  if (e_.expert_zero_) e_.expert_zero_->progress();
  for (Pending& p : e_.pending_)
    for (auto* r : {&p.act_recv, &p.grad_recv, &p.act_send, &p.grad_send, &p.sums_recv, &p.fraction_recv, &p.sums_send,
                    &p.fraction_send})
      if (*r) (*r)->test();
}

// Every in-flight micro-batch's buffer plus the model's backward scratch.
int64_t Engine::activation_bytes() const {
  int64_t bytes = model_->scratch_bytes();
  for (const ActivationBuffer& b : buffers_) bytes += b.bytes();
  return bytes;
}

void Engine::wait_sends(int b) {
  Pending& p = pending_[b];
  for (auto* send : {&p.act_send, &p.sums_send})
    if (*send) {
      auto t = timers_.time("pipe_send_output");
      (*send)->wait(), send->reset();
    }
  for (auto* send : {&p.grad_send, &p.fraction_send})
    if (*send) {
      auto t = timers_.time("pipe_send_grad");
      (*send)->wait(), send->reset();
    }
}

void Engine::execute(const pipe::Instruction& in, StepResult& r, double& local_loss) {
  using pipe::Op;
  // What crosses a stage boundary: the residual stream of this rank's tokens.
  const int64_t gas = cfg_.batch.gradient_accumulation_steps, BTC = model_->stream_elements();
  const int64_t E = model_->router_experts();  // Mixtral: its router sums and fractions cross too
  const obs::TraceScope region(instruction_region(in.op));
  const auto waited = [this](std::unique_ptr<CommRequest>& req, const char* timer) {  // DeepSpeed's pipe timer names
    if (!req) return;
    auto t = timers_.time(timer);
    req->wait();
    req.reset();
  };
  // Compute time and the end of the last pass: what the measured bubble is made of.
  struct Busy {
    Engine& e;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~Busy() {
      e.compute_end_ = std::chrono::steady_clock::now();
      e.busy_ms_ += std::chrono::duration<double, std::milli>(e.compute_end_ - t0).count();
    }
  };
  switch (in.op) {
    case Op::LoadMicroBatch: {
      ActivationBuffer& buf = buffers_[in.buffer];
      wait_sends(in.buffer);
      // This rank's samples of the global batch (data.hpp): independent of how it is split.
      // An evaluation reads its round of the validation data instead.
      const DataLoader& source = eval_ ? *validation_ : *data_;
      const int64_t first =
          (eval_ ? eval_->first_sample : samples_) + (in.micro_batch * world_ + rank_) * cfg_.batch.micro_batch;
      const size_t ids = buf.token_ids.extent(0) * sizeof(int32_t), targets = buf.target_ids.extent(0) * sizeof(int32_t);
      int32_t *host_in = buf.token_ids.data(), *host_tgt = buf.target_ids.data();
      if (!kernels::kHostIsDevice) {
        host_in = reinterpret_cast<int32_t*>(token_stage_.grow(ids + targets));
        host_tgt = host_in + buf.token_ids.extent(0);
      }
      source.micro_batch(first, host_in, host_tgt);
      if (!kernels::kHostIsDevice) {
        kernels::copy_to_device(buf.token_ids.data(), host_in, ids);
        kernels::copy_to_device(buf.target_ids.data(), host_tgt, targets);
      }
      break;
    }
    case Op::RecvActivation: {
      wait_sends(in.buffer);
      ActivationBuffer& buf = buffers_[in.buffer];
      pending_[in.buffer].act_recv = model_comms_.of(*pipe_comm_).irecv(buf.input, BTC, DType::F32,
                                                      peer_stage(in.chunk, -1), tag(in.chunk, 0, 0));
      buf.router_sums.resize(static_cast<size_t>(2 * E));
      if (E > 0)
        pending_[in.buffer].sums_recv = pipe_comm_->irecv(buf.router_sums.data(), 2 * E, DType::F64,
                                                          peer_stage(in.chunk, -1), tag(in.chunk, 0, 2));
      break;
    }
    case Op::SendActivation:
      pending_[in.buffer].act_send = model_comms_.of(*pipe_comm_).isend(model_->output(in.chunk, buffers_[in.buffer]), BTC, DType::F32,
                                                      peer_stage(in.chunk, +1), tag(in.chunk, +1, 0));
      if (E > 0)
        pending_[in.buffer].sums_send = pipe_comm_->isend(buffers_[in.buffer].router_sums.data(), 2 * E, DType::F64,
                                                          peer_stage(in.chunk, +1), tag(in.chunk, +1, 2));
      break;
    case Op::RecvGrad: {
      ActivationBuffer& buf = buffers_[in.buffer];
      pending_[in.buffer].grad_recv = model_comms_.of(*pipe_comm_).irecv(buf.d_output, BTC, DType::F32,
                                                       peer_stage(in.chunk, +1), tag(in.chunk, 0, 1));
      buf.router_fraction.resize(static_cast<size_t>(E));
      if (E > 0)
        pending_[in.buffer].fraction_recv = pipe_comm_->irecv(buf.router_fraction.data(), E, DType::F32,
                                                              peer_stage(in.chunk, +1), tag(in.chunk, 0, 3));
      break;
    }
    case Op::SendGrad:
      pending_[in.buffer].grad_send = model_comms_.of(*pipe_comm_).isend(buffers_[in.buffer].d_input, BTC, DType::F32,
                                                       peer_stage(in.chunk, -1), tag(in.chunk, -1, 1));
      if (E > 0)
        pending_[in.buffer].fraction_send = pipe_comm_->isend(buffers_[in.buffer].router_fraction.data(), E, DType::F32,
                                                              peer_stage(in.chunk, -1), tag(in.chunk, -1, 3));
      break;
    case Op::Forward: {
      waited(pending_[in.buffer].act_recv, "pipe_recv_input");
      waited(pending_[in.buffer].sums_recv, "pipe_recv_input");
      wait_sends(in.buffer);
      auto t = timers_.time("forward");
      Busy busy{*this};
      // MoE gates draw from the micro-batch's key, its first sample: the same on every stage and
      // layout (a middle stage never loads the micro-batch, so it is derived here)
      ActivationBuffer& buf = buffers_[in.buffer];
      const int64_t first =
          (eval_ ? eval_->first_sample : samples_) + (in.micro_batch * world_ + rank_) * cfg_.batch.micro_batch;
      buf.draw_key = static_cast<uint64_t>(first) * 2 + (eval_ ? 1 : 0);
      buf.training = !eval_;
      buf.first_sample = first;  // and dropout's masks, keyed by global sample
      // Progressive layer drop: this micro-batch's blocks, decided alike on every rank (pld.hpp).
      if (cfg_.pld.enabled && !eval_)
        buf.block_scale = pld_block_scales(cfg_.pld, cfg_.training.seed, step_, in.micro_batch, cfg_.model.n_layer);
      else
        buf.block_scale.clear();
      const float loss = model_->forward(in.chunk, buf, store_);
      if (model_->chunk(in.chunk).final) {
        if (eval_) record_eval_losses(in.micro_batch, buffers_[in.buffer]);
        else local_loss += loss;
      }
      break;
    }
    case Op::Backward:
    case Op::BackwardInput:
    case Op::BackwardWeight: {
      waited(pending_[in.buffer].grad_recv, "pipe_recv_grad");
      waited(pending_[in.buffer].fraction_recv, "pipe_recv_grad");
      if (in.op != Op::BackwardWeight) waited(pending_[in.buffer].grad_send, "pipe_send_grad");  // d_input is rewritten
      const BackwardPart part = in.op == Op::Backward ? BackwardPart::Full
                                : in.op == Op::BackwardInput ? BackwardPart::Input : BackwardPart::Weight;
      // Gradients of the chunk's units are final with its last weight-gradient pass of the step.
      if (part != BackwardPart::Input) {
        zero_->begin_micro_step(instr_index_ == last_backward_[in.chunk]);
        if (expert_zero_) expert_zero_->begin_micro_step(instr_index_ == last_backward_[in.chunk]);
      }
      const ReductionWait reductions(*dp_comm_, timers_);  // after t: moves blocked reductions to backward_allreduce
      auto t = timers_.time("backward_inner");
      Busy busy{*this};
      // DeepSpeed scales the loss by 1/GAS so that accumulated gradients are a mean; fp16
      // multiplies by the loss scale as well (FACTS §2.4). Only the head's chunk uses it.
      model_->backward(in.chunk, buffers_[in.buffer], static_cast<float>(scaler_->scale()) / static_cast<float>(gas),
                       store_, part);
      break;
    }
    case Op::ReduceTiedGrads:
    case Op::ReduceGrads:
      finalize_grads();
      break;
    case Op::OptimizerStep:
      optimizer_step(r);
      break;
  }
}

void Engine::finalize_grads() {
  if (finalized_) return;
  finalized_ = true;
  {
    auto t = timers_.time("backward_allreduce");
    zero_->finish_reduction();
    if (expert_zero_) expert_zero_->finish_reduction();
    // The tied wte (DeepSpeed ReduceTiedGrads, FACTS-2 §2.5): both copies hold the summed gradient.
    if (tied_numel_ > 0 && emb_comm_) zero_->sum_grad_range(0, tied_numel_, model_comms_.of(*emb_comm_));
    // Sequence parallelism: each tensor rank's LayerNorms saw only its token shard, so their
    // gradients are summed over the tensor group (Megatron _allreduce_non_tensor_model_parallel_grads).
    if (cfg_.tensor.sequence_parallel)
      for (const TensorSpec& ts : model_->layout().tensors())
        if (sequence_parallel_partial(ts.name))
          zero_->sum_grad_range(ts.offset, ts.offset + ts.numel, model_comms_.of(*tp_comm_));
  }
  // The norm counts every parameter once (Megatron _filter_grads_for_norm): the tied copy on the
  // first stage only, tensor-replicated ones (LayerNorms, row-parallel biases, wpe) on tensor rank 0.
  std::vector<std::pair<int64_t, int64_t>> skip;
  if (tied_numel_ > 0 && stage_ == stages_ - 1) skip.emplace_back(0, tied_numel_);
  if (tp_comm_->rank() > 0)
    for (const auto& r : model_->part().replicated_ranges()) skip.push_back(r);
  std::sort(skip.begin(), skip.end());
  stats_ = zero_->grad_stats(mp_comm_->size() > 1 ? mp_comm_.get() : nullptr, skip);
  if (cfg_.model.moe.enabled()) expert_grad_stats();
}

// Tensor-replicated parameters (LayerNorms, row-parallel biases, wpe, ln_f) see identical
// inputs and gradients on every tensor rank, so they must stay bit-identical: each step the
// ranks compare a digest (XXH64) of their copies and stop on any difference.
void Engine::check_tensor_replicas() {
  if (tp_comm_->size() == 1) return;
  const auto [b, e] = zero_->checkpoint_range();
  const float* params = zero_->checkpoint_arrays().front().second;  // "params": element b, in model memory
  Xxh64 digest;
  std::vector<float> bounce;  // a GPU build's range, copied to the host to be hashed
  for (const auto& [lo, hi] : model_->part().replicated_ranges()) {
    const int64_t a = std::max(lo, b), z = std::min(hi, e);
    if (a >= z) continue;
    const float* range = params + (a - b);
    if constexpr (!kernels::kHostIsDevice) {
      bounce.resize(static_cast<size_t>(z - a));
      kernels::copy_to_host(bounce.data(), range, bounce.size() * sizeof(float));
      range = bounce.data();
    }
    digest.update(range, static_cast<size_t>(z - a) * sizeof(float));
  }
  const uint64_t h = digest.digest();
  int64_t lo = static_cast<int64_t>(h >> 1), hi = lo;
  tp_comm_->all_reduce(&lo, 1, DType::I64, ReduceOp::Min);
  tp_comm_->all_reduce(&hi, 1, DType::I64, ReduceOp::Max);
  int64_t diverged = lo != hi ? 1 : 0;  // agreed by every rank, reported once
  world_comm_->all_reduce(&diverged, 1, DType::I64, ReduceOp::Max);
  if (diverged)
    throw AgreedFailure("tensor-parallel replicas diverged at step " + std::to_string(step_ + 1) +
                            ": the replicated parameters (LayerNorms, row-parallel biases, wpe) differ between tensor "
                            "ranks",
                        kExitSystem, 0, groups_.rank() == 0);
}

void Engine::optimizer_step(StepResult& r) {
  auto t = timers_.time("step");
  // DeepSpeed's order: overflow check, scaler update, then unscale+clip with the new scale.
  const GradStats& stats = stats_;
  const bool overflow = check_overflow_ && !stats.finite;
  std::string scaler_log;
  // The norm reported: ZeRO-1/2 divide the scaled norm by the scale before this update
  // (stage_1_and_2.py step: prev_scale), stage 0 and 3 by the updated one; the update
  // itself unscales by the updated scale at every stage, as DeepSpeed does.
  const double report_scale = cfg_.zero.stage == 1 || cfg_.zero.stage == 2 ? scaler_->scale() : 0.0;
  const double prev_scale = scaler_->scale();
  try {
    scaler_log = scaler_->update(overflow, r.step);
  } catch (const SystemError& e) {  // every rank saw the same overflow: agreed, one report
    throw AgreedFailure(e.what(), kExitSystem, 0, groups_.rank() == 0);
  }
  if (!scaler_log.empty() && groups_.rank() == 0) std::printf("[zero3d] %s\n", scaler_log.c_str());
  r.loss_scale = scaler_->scale();
  // LoCo's errors follow fp16's scale (stage3.py checks overflow for fp16 only)
  if (cfg_.precision.param == DType::F16) zero_->loss_scale_changed(overflow, scaler_->scale() / prev_scale);
  if (overflow) {  // no update, scheduler not advanced; the global step still counts
    zero_->skip_step();
    expert_step(r.lr, cfg_.gradient_clipping, scaler_->scale(), /*skip=*/true);
    r.skipped = true;
    r.grad_norm = -1.0;
    ++skipped_steps_;
  } else {
    r.grad_norm = stats.norm_scaled / (report_scale > 0.0 ? report_scale : scaler_->scale());
    zero_->apply_step(r.lr, schedule_->betas(), cfg_.gradient_clipping, scaler_->scale(), stats);
    expert_step(r.lr, cfg_.gradient_clipping, scaler_->scale(), /*skip=*/false);
    schedule_->step();
  }
  r.skipped_steps = skipped_steps_;
}

StepResult Engine::train_step() {
  const auto t0 = std::chrono::steady_clock::now();
  timers_.reset();
  model_->reset_checkpoint_times();
  note_step(step_ + 1);  // failure.hpp: names the step if this rank dies in it
  inject_fault(step_ + 1);
  const int64_t gas = cfg_.batch.gradient_accumulation_steps;
  StepResult r;
  r.step = step_ + 1;
  r.lr = schedule_->lr();

  dp_comm_->reset_bus_bytes();
  pipe_comm_->reset_bus_bytes();
  tp_comm_->reset_bus_bytes();
  if (emb_comm_) emb_comm_->reset_bus_bytes();
  for (MpiCommunicator* c : {ep_comm_.get(), edp_comm_.get()})
    if (c) c->reset_bus_bytes();
  for (auto& [name, c] : shard_comms_) c->reset_bus_bytes();
  zero_->zero_grad();
  if (expert_zero_) expert_zero_->zero_grad();
  finalized_ = false;
  busy_ms_ = 0.0;
  tensor_comm_ms_ = 0.0;
  step_start_ = compute_end_ = t0;
  instr_index_ = 0;
  observer_->begin_step(r.step);
  double local_loss = 0.0;
  // The schedule (pipe_schedule.hpp), instruction by instruction.
  for (const auto& step : schedule_steps_.steps)
    for (const pipe::Instruction& in : step) {
      execute(in, r, local_loss);
      ++instr_index_;
    }
  for (int b = 0; b < schedule_steps_.num_buffers; ++b) wait_sends(b);
  double span_ms = std::chrono::duration<double, std::milli>(compute_end_ - step_start_).count();
  if (stages_ > 1) pipe_comm_->all_reduce(&span_ms, 1, DType::F64, ReduceOp::Max);
  r.comm_by_axis = {dp_comm_->bus_bytes() + (emb_comm_ ? emb_comm_->bus_bytes() : 0), tp_comm_->bus_bytes(),
                    pipe_comm_->bus_bytes()};
  // MoE: the all-to-alls (expert group) and the experts' gradient reduction (expert-data group)
  r.expert_comm_bytes = {ep_comm_ ? ep_comm_->bus_bytes() : 0, edp_comm_ ? edp_comm_->bus_bytes() : 0};
  r.comm_bytes = r.comm_by_axis[0] + r.comm_by_axis[1] + r.comm_by_axis[2] + r.expert_comm_bytes[0] +
                 r.expert_comm_bytes[1];
  for (MpiCommunicator* c : {dp_comm_.get(), emb_comm_.get(), tp_comm_.get(), pipe_comm_.get(), ep_comm_.get(), edp_comm_.get()})
    if (c) r.link_bytes[c->intra_node() ? 0 : 1] += c->bus_bytes();
  for (auto& [name, c] : shard_comms_) {
    r.shard_comm_bytes.emplace_back(name, c->bus_bytes());
    r.comm_bytes += c->bus_bytes();
    r.link_bytes[c->intra_node() ? 0 : 1] += c->bus_bytes();
  }
  // The loss lives on the last stage: averaged over micro-batches and the data group
  // (DeepSpeed _aggregate_total_loss), then broadcast over the pipe group to rank 0.
  double mean_loss = local_loss / static_cast<double>(gas);
  dp_comm_->all_reduce(&mean_loss, 1, DType::F64, ReduceOp::Sum);
  if (stages_ > 1) pipe_comm_->broadcast(&mean_loss, 1, DType::F64, stages_ - 1);
  r.loss = mean_loss / world_;
  r.tensor_comm_ms = tensor_comm_ms_;
  check_tensor_replicas();
  r.idle_fraction = span_ms > 0 ? std::max(0.0, 1.0 - busy_ms_ / span_ms) : 0.0;
  r.stage_idle.assign(static_cast<size_t>(stages_), 0.0);
  if (stages_ > 1) pipe_comm_->all_gather(&r.idle_fraction, r.stage_idle.data(), 1, DType::F64);
  else r.stage_idle[0] = r.idle_fraction;
  ++step_;
  samples_ += cfg_.batch.train_batch_size;

  r.elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const double tokens = static_cast<double>(cfg_.batch.train_batch_size * cfg_.model.n_positions);
  r.tokens_per_s = r.elapsed_ms > 0 ? tokens / (r.elapsed_ms / 1e3) : 0.0;
  r.flops_per_token = flops_per_token_;
  if (cfg_.pld.enabled)  // progressive layer drop: the dropped blocks' FLOPs were not done
    r.flops_per_token -= (1.0 - pld_blocks_run_fraction(cfg_.pld, cfg_.training.seed, r.step - 1,
                                                         cfg_.batch.gradient_accumulation_steps, cfg_.model.n_layer)) *
                         block_flops_per_token_;
  r.mfu = r.flops_per_token * r.tokens_per_s / (peak_gflops_total_ * 1e9);
  observer_->end_step();
  return r;
}

std::vector<StepResult> Engine::train() {
  std::vector<StepResult> results;
  double total_ms = 0.0;
  for (int64_t s = step_; s < cfg_.training.steps; ++s) {
    // At every step boundary all ranks agree whether any of them got the scheduler's warning
    // signal, so that all stop at the same step (Slurm may signal one task before another).
    int signal = preemption_signal();
    world_comm_->all_reduce(&signal, 1, DType::I32, ReduceOp::Max);
    if (signal != 0) {
      stop_for_preemption(signal, !results.empty());
      break;
    }
    saved_this_step_ = false;
    StepResult r = train_step();
    r.checkpoint_times = model_->checkpoint_times();
    nlohmann::json moe;
    double dropped = 0.0;
    if (cfg_.model.moe.enabled()) moe = moe_metrics(&dropped);  // collective
    evaluate_if_due(r);
    // The plan's check (collective): the peak resident memory of the largest rank so far, or on
    // a GPU build the peak of its device memory.
    const bool last_step = s + 1 == cfg_.training.steps;
    if (last_step) {
      measured_peak_ = kernels::kGpuBuild ? kernels::device_peak_bytes() : peak_rss_bytes();
      world_comm_->all_reduce(&measured_peak_, 1, DType::I64, ReduceOp::Max);
    }
    results.push_back(r);
    observer_->after_step(r, samples_, timers_.ms());  // collective
    if (results.size() > 1 || cfg_.training.steps == 1) total_ms += r.elapsed_ms;  // the first step warms caches
    if (groups_.rank() == 0) report_step(r, moe, dropped, last_step);
    if (after_step_) after_step_(r.step);
    // After the step's record: a kill between publishing the tag and writing the record would
    // lose the record for good (resume continues after the tag); a record past the last save is
    // dropped on resume instead.
    save(last_step);
  }
  if (groups_.rank() == 0 && !results.empty()) print_summary(results, total_ms);
  observer_->finish();  // collective: the comms logger's table, a trace not yet written
  return results;
}

}  // namespace zero3d
