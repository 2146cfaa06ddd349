// engine_checkpoint.cpp — the engine's checkpoints: whether to resume, the resume itself
// (re-partitioned for this run's world size and stage), the save, and the save a preemption
// signal asks for before the job is requeued.
#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include "base/errors.hpp"
#include "base/failure.hpp"
#include "io/checkpoint.hpp"
#include "io/checkpoint_options.hpp"
#include "io/weights.hpp"
#include "kernels/memory.hpp"
#include "train/engine.hpp"
#include "train/job_control.hpp"

namespace zero3d {

namespace {

// The checkpoint's optimizer-state family, and the update rule within it.
std::string optimizer_family(const OptimizerConfig& o) {
  switch (o.type) {
    case OptimizerType::SGD: return "SGD";
    case OptimizerType::Lamb: return "Lamb";
    case OptimizerType::Lion: return "Lion";
    case OptimizerType::Adagrad: return "Adagrad";
    case OptimizerType::OneBitLamb: return "OneBitLamb";  // Lamb's states and exp_avg_sq_fresh, its coefficients
    case OptimizerType::Adam:
    case OptimizerType::OneBitAdam:
    case OptimizerType::ZeroOneAdam: break;  // exp_avg and exp_avg_sq, as Adam's
  }
  return "Adam";
}
std::string update_rule(const OptimizerConfig& o) {
  if (o.type == OptimizerType::OneBitAdam) return "OneBitAdam";
  if (o.type == OptimizerType::ZeroOneAdam) return "ZeroOneAdam";
  if (o.type != OptimizerType::Adam) return optimizer_family(o);
  return o.adam_w_mode ? "AdamW" : "Adam";
}
std::string rule_text(const std::string& rule) {
  if (rule == "AdamW") return "decoupled weight decay, adam_w_mode true";
  if (rule == "Adam") return "L2 weight decay added to the gradient, adam_w_mode false";
  if (rule == "OneBitAdam") return "no bias correction, variance frozen after freeze_step";
  if (rule == "ZeroOneAdam") return "no bias correction, variance updated at growing intervals, then local steps";
  return rule;
}

}  // namespace

// resume "auto": whether every rank finds a checkpoint to follow. With node-local storage each
// node looks in its own save_dir, and they must agree (one node without it is bad input).
bool Engine::resume_agreed() {
  int64_t here = resumable_checkpoint_exists(cfg_.training.save_dir, cfg_.checkpoint) ? 1 : 0, lo = here, hi = here;
  world_comm_->all_reduce(&lo, 1, DType::I64, ReduceOp::Min);
  world_comm_->all_reduce(&hi, 1, DType::I64, ReduceOp::Max);
  if (lo != hi)
    throw AgreedFailure("training.resume \"auto\": " + cfg_.training.save_dir + " holds a checkpoint on some nodes and none "
                        "on others (checkpoint.use_node_local_storage: every node resumes from its own)",
                        kExitBadInput, 0, groups_.rank() == 0);
  return hi == 1;
}

// Re-partitions on load: each rank reads its own range of the flat buffers, whatever the
// world size and stage of the run that saved.
void Engine::resume_from_checkpoint() {
  const auto t0 = std::chrono::steady_clock::now();
  // "auto" (the requeued batch job's setting): the save_dir's latest tag when there is one, else
  // a fresh start. A `latest` that names a damaged tag is an error, never a silent restart.
  const bool automatic = cfg_.training.resume == "auto";
  if (automatic && !resume_agreed()) {
    if (groups_.rank() == 0)
      std::printf("resume  auto: no checkpoint in %s yet; starting fresh\n", cfg_.training.save_dir.c_str());
    return;
  }
  std::unique_ptr<CheckpointReader> reader;
  ResumeTarget target;
  run_collectively(groups_.world(), [&] {
    // checkpoint.load_universal: DeepSpeed's `latest_universal` names the tag when there is one.
    target = resume_target(cfg_.training.resume, cfg_.training.save_dir, cfg_.checkpoint);
    reader = std::make_unique<CheckpointReader>(
        CheckpointReader::open(target.spec, cfg_.training.save_dir, cfg_.checkpoint.use_node_local_storage));
    reader->check_layout(gpt_layout(model_->shape()));
    reader->check_model(cfg_.resolved.value("model", nlohmann::json::object()));
    const CheckpointMeta& m = reader->meta();
    const std::string family = optimizer_family(cfg_.optimizer), rule = update_rule(cfg_.optimizer);
    if (m.optimizer_type != family)
      throw InputError(reader->dir() + ": saved with optimizer " + m.optimizer_type + ", the config uses " +
                       cfg_.optimizer.type_name + ": their states differ");
    // Adam and AdamW keep the same states but update differently (DEEPSPEED-FACTS: FusedAdam's
    // adam_w_mode): continuing under the other rule would silently change the training.
    if (!m.update_rule.empty() && m.update_rule != rule)
      throw InputError(reader->dir() + ": saved with the " + m.update_rule + " update rule (" + rule_text(m.update_rule) +
                       "), the config gives " + rule + " (" + rule_text(rule) + "); " +
                       (m.update_rule == "OneBitAdam" || m.update_rule == "ZeroOneAdam" || rule == "OneBitAdam" ||
                                rule == "ZeroOneAdam"
                            ? "set optimizer.type to " + (m.update_rule == "AdamW" || m.update_rule == "Adam"
                                                              ? std::string("Adam or AdamW")
                                                              : m.update_rule)
                            : "set optimizer.params.adam_w_mode to " + std::string(m.update_rule == "AdamW" ? "true" : "false")) +
                       " to continue this run");
    // This rank's local range, read through the global offsets its elements have.
    const ModelPart& part = model_->part();
    zero_->read_checkpoint(
        [&](const std::string& state, int64_t b, int64_t e, float* out) {
          for (const LayoutSegment& run : part.global_runs(b, e, /*saving=*/false))
            reader->read_range(state, run.global_begin, run.global_begin + (run.local_end - run.local_begin),
                               out + (run.local_begin - b));
        },
        reader->meta().optimizer_step);
    if (expert_zero_) read_expert_checkpoint(*reader);
  });
  // With node-local storage each node resolves `latest` (or `latest_universal`) in its own
  // save_dir: nodes that name different tags would each train on from a different state.
  int64_t lo = reader->meta().step, hi = lo;
  world_comm_->all_reduce(&lo, 1, DType::I64, ReduceOp::Min);
  world_comm_->all_reduce(&hi, 1, DType::I64, ReduceOp::Max);
  if (lo != hi)
    throw AgreedFailure("training.resume \"" + cfg_.training.resume + "\": the ranks found checkpoints of different steps (" +
                            std::to_string(lo) + " and " + std::to_string(hi) + ") in " + cfg_.training.save_dir +
                            " (checkpoint.use_node_local_storage: every node resumes from its own copy, and their "
                            "latest tags differ); name the tag to resume from",
                        kExitBadInput, 0, groups_.rank() == 0);
  zero_->finish_checkpoint_load();
  if (expert_zero_) expert_zero_->finish_checkpoint_load();
  resume_loco(*reader);
  if (zero_->quantizes_frozen()) {
    // zero_quantized_nontrainable_weights: the frozen pieces' codes and scales as saved when the
    // save holds this rank's pieces (the same world size); otherwise (another world size, a save
    // without them) the dequantised values read were quantised afresh.
    int64_t restored = 0;
    run_collectively(groups_.world(), [&] {
      const std::optional<RankState> saved =
          reader->meta().dp_world_size == world_ ? reader->read_rank_state(groups_.rank(), "quantized_frozen") : std::nullopt;
      restored = saved && zero_->restore_quantized_frozen(*saved) ? 1 : 0;
      if (restored) return;
      // Another world size: every saved rank's scales (the groups are the tensors', not the
      // partitions'), and the codes from the saved dequantised values.
      std::map<int64_t, float> scales;
      for (int64_t q = 0; q < static_cast<int64_t>(reader->meta().ranges.size()); ++q) {
        const std::optional<RankState> st = reader->read_rank_state(q, "quantized_frozen");
        if (!st) continue;
        size_t at = 0;
        const nlohmann::json meta = nlohmann::json::parse(st->meta);  // (a range-for over parse(..).at() would dangle)
        for (const auto& piece : meta.at("pieces")) {
          const int64_t group = piece.at(2), groups = piece.at(3), first = piece.at(4);
          for (int64_t g = 0; g < groups && at < st->scales.size(); ++g) scales[first + g * group] = st->scales[at++];
        }
      }
      const ModelPart& part = model_->part();
      restored = zero_->restore_quantized_frozen_scales(scales, [&](const std::string& state, int64_t b, int64_t e, float* out) {
        for (const LayoutSegment& run : part.global_runs(b, e, /*saving=*/false))
          reader->read_range(state, run.global_begin, run.global_begin + (run.local_end - run.local_begin),
                             out + (run.local_begin - b));
      }) ? 1 : 0;
    });
    world_comm_->all_reduce(&restored, 1, DType::I64, ReduceOp::Min);
    if (!restored && groups_.rank() == 0)
      std::printf("resume  note: zero_quantized_nontrainable_weights: the checkpoint holds no int8 frozen pieces "
                  "(saved without the key); the saved frozen values were quantised\n");
  }
  const CheckpointMeta& m = reader->meta();
  step_ = m.step;
  samples_ = m.global_samples;
  resumed_ = true;
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
  if (groups_.rank() == 0) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double mb = 4.0 * m.states.size() * m.total_params / 1e6;
    if (!target.from.empty()) std::printf("resume  %s names %s (checkpoint.load_universal)\n", target.from.c_str(), reader->dir().c_str());
    const int64_t ranks = m.pipe_size * m.dp_world_size * m.tensor_size;
    std::printf("resume  %s: step %lld, saved by %lld rank%s (pipe %lld x data %lld x model %lld) at ZeRO stage %lld; "
                "loaded %.1f MB in %.2f s (%.0f MB/s)\n",
                reader->dir().c_str(), (long long)m.step, (long long)ranks, ranks == 1 ? "" : "s", (long long)m.pipe_size,
                (long long)m.dp_world_size, (long long)m.tensor_size, (long long)m.zero_stage, mb, s, mb / s);
    if (m.global_samples != step_ * cfg_.batch.train_batch_size)
      std::printf("resume  note: train_batch_size differs from the saved run's (%lld samples in %lld steps); the data "
                  "continues at sample %lld, where that run stopped\n", (long long)m.global_samples, (long long)m.step,
                  (long long)samples_);
  }
}

// LoCo's kept errors continue where the saved run left them when it ran LoCo on the same ranks
// and nodes; otherwise they start from zero, as DeepSpeed's always do after a load (they live
// on its parameters, outside the checkpoint).
void Engine::resume_loco(const CheckpointReader& reader) {
  QuantizedReduceScatter* loco = zero_->loco();
  if (!loco) return;
  std::optional<RankState> saved;
  run_collectively(groups_.world(), [&] {
    if (reader.meta().dp_world_size == world_) saved = reader.read_rank_state(groups_.rank(), "loco");
    if (saved) {
      const nlohmann::json meta = nlohmann::json::parse(saved->meta);
      if (meta.value("nodes", 0) != loco->nodes() || meta.value("per_node", 0) != loco->per_node()) saved.reset();
    }
  });
  int64_t restored = saved ? 1 : 0;  // every rank or none
  world_comm_->all_reduce(&restored, 1, DType::I64, ReduceOp::Min);
  if (restored) {
    run_collectively(groups_.world(), [&] { loco->set_loco_state({saved->meta, saved->codes, saved->scales}); });
  } else if (groups_.rank() == 0) {
    std::printf("resume  note: zeropp_loco_param: the checkpoint holds no LoCo errors of this layout (%d nodes of %d "
                "ranks); they start from zero, as DeepSpeed's do after every load\n", loco->nodes(), loco->per_node());
  }
}

void Engine::save(bool final_step, bool forced) {
  const int64_t every = cfg_.training.save_interval;
  if (!forced && (every <= 0 || (step_ % every != 0 && !final_step))) return;
  if (forced && saved_this_step_) return;
  saved_this_step_ = true;
  const auto t0 = std::chrono::steady_clock::now();
  CheckpointMeta m;
  m.step = step_;
  m.global_samples = samples_;
  m.zero_stage = zero_->stage();
  m.dp_world_size = world_;
  m.pipe_size = cfg_.pipeline.stages;
  m.tensor_size = cfg_.tensor.size;
  m.optimizer_step = zero_->optimizer_step();
  m.lr_last_batch_iteration = schedule_->last_batch_iteration();
  m.micro_batch = cfg_.batch.micro_batch;
  m.gradient_accumulation_steps = cfg_.batch.gradient_accumulation_steps;
  m.data_position = samples_;  // samples consumed
  m.seed = cfg_.training.seed;
  m.optimizer_type = optimizer_family(cfg_.optimizer);
  m.update_rule = update_rule(cfg_.optimizer);
  m.optimizer_name = cfg_.optimizer.type_name;
  m.config = cfg_.resolved;
  m.model_dtype = dtype_name(cfg_.precision.param);
  m.skipped_steps = skipped_steps_;
  const LossScalerState& ls = scaler_->state();
  m.loss_scaler = {{"dynamic", scaler_->dynamic()}, {"cur_scale", ls.cur_scale}, {"cur_iter", ls.cur_iter},
                   {"last_overflow_iter", ls.last_overflow_iter}, {"cur_hysteresis", ls.cur_hysteresis}};
  // One logical model whatever the layout: the global tensors, and each rank's range mapped
  // to global offsets (the tied wte copy is the first stage's to save).
  const ParamLayout global = gpt_layout(model_->shape());
  m.total_params = global.total();
  for (const TensorSpec& t : global.tensors())
    m.tensors.push_back({{"name", t.name}, {"shape", t.shape}, {"offset", t.offset}});
  m.states = zero_->checkpoint_states();
  const auto [b, e] = zero_->save_range();  // MiCS: one replica saves the shard
  const auto arrays = zero_->checkpoint_arrays();
  ShardSlice slice;
  for (const LayoutSegment& run : model_->part().global_runs(b, e, /*saving=*/true)) {
    ShardSegment seg;
    seg.begin = run.global_begin;
    seg.end = run.global_begin + (run.local_end - run.local_begin);
    for (const auto& [name, first] : arrays) seg.arrays.emplace_back(name, first + (run.local_begin - b));
    slice.segments.push_back(std::move(seg));
  }
  if (expert_zero_) expert_checkpoint_segments(slice);
  if (std::optional<RankState> frozen = zero_->quantized_frozen_state())  // the int8 frozen pieces, as held
    slice.rank_state.push_back(std::move(*frozen));
  if (const QuantizedReduceScatter* loco = zero_->loco()) {  // LoCo's kept errors: this rank's own
    LocoState st = loco->loco_state();
    slice.rank_state.push_back({"loco", std::move(st.meta), std::move(st.codes), std::move(st.scales)});
  }
  const std::string tag = "global_step" + std::to_string(step_);
  save_checkpoint(cfg_.training.save_dir, tag, m, slice, global, groups_.world(), cfg_.training.keep_last,
                  cfg_.checkpoint.use_node_local_storage);
  // zero_optimization.stage3_gather_16bit_weights_on_model_save: DeepSpeed's save_16bit_model
  // beside each save; here `zero3d convert`'s consolidated weights inside the tag (pruned with it).
  if (cfg_.zero.gather_16bit_weights_on_model_save && groups_.rank() == 0) {
    const DType d = cfg_.precision.param;
    const std::string out = cfg_.training.save_dir + "/" + tag + "/hf/model.safetensors";
    convert_checkpoint(cfg_.training.save_dir, tag, out, "safetensors",
                       d == DType::BF16 ? "bf16" : d == DType::F16 ? "fp16" : "fp32", 0);
    std::printf("weights %s (consolidated, %s)\n", out.c_str(), dtype_name(d).c_str());
  }
  if (groups_.rank() == 0) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double mb = 4.0 * m.states.size() * m.total_params / 1e6;
    std::printf("checkpoint %s/%s: %.1f MB in %.2f s (%.0f MB/s)\n", cfg_.training.save_dir.c_str(), tag.c_str(), mb, s,
                mb / s);
    std::fflush(stdout);
  }
}

void Engine::stop_for_preemption(int signal, bool stepped) {
  stopped_by_signal_ = signal;
  // Nothing trained since the start (or the resume): the state is already on disk, or nowhere to save.
  if (stepped) save(false, /*forced=*/true);
  if (groups_.rank() != 0) return;
  const std::string tag = cfg_.training.save_dir + "/global_step" + std::to_string(step_);
  char line[1024];
  std::snprintf(line, sizeof line,
                "preempted: %s received; %s at step %lld of %lld; exit %d so that the job is requeued (training.resume "
                "\"auto\" continues from it)\n",
                signal_name(signal).c_str(), stepped ? ("saved " + tag).c_str() : "no step taken since start-up, nothing new to save",
                (long long)step_, (long long)cfg_.training.steps, kExitRequeue);
  std::fputs(line, stdout);
  std::fflush(stdout);
  // The exit status can be lost on the way out: a launcher signalled with its ranks (mpirun
  // under a scheduler's job-wide SIGTERM) may report 0. <output>/requeue tells the job script.
  if (std::FILE* f = std::fopen((output_dir_ + "/" + kRequeueFile).c_str(), "w")) {
    std::fputs(line, f);
    std::fclose(f);
  }
}

}  // namespace zero3d
