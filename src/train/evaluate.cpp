// evaluate.cpp — evaluation: forward passes over the validation data, in every layout.
//
// An evaluation runs training.eval_steps rounds; round k is the global batch of validation
// samples k·train_batch_size … (k+1)·train_batch_size − 1, cut into micro-batches exactly as a
// training step cuts its batch (data.hpp), so every layout sees the same samples. Each rank runs
// the inference schedule (pipe_schedule.hpp: DeepSpeed's InferenceSchedule, forward passes
// only) through the training executor; the last stage keeps, per sample, the sum of its T token
// losses. The loss is the sum over samples, in sample order, divided by the tokens: the same
// additions whatever the layout, so layouts that compute the same token losses report the same
// bits. Nothing training reads is changed: parameters and optimizer state are only read, the
// step's timers and ZeRO-3's fetch trace are restored, buffers added for the pass are freed.
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>

#include "base/errors.hpp"
#include "base/failure.hpp"
#include "base/input_file.hpp"
#include "io/checkpoint.hpp"
#include "train/engine.hpp"

namespace zero3d {

namespace {
// The tag directory `zero3d eval --checkpoint PATH [--tag TAG]` names (CheckpointReader::open
// follows `latest`); the options are named when neither exists.
std::string checkpoint_tag_dir(const std::string& path, const std::string& tag) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(path, ec)) throw InputError("--checkpoint " + echo(path, 200) + ": no such directory");
  if (!tag.empty()) {
    const fs::path dir = fs::path(path) / tag;
    // A save killed between its two renames leaves the previous tag aside, complete; open() takes it.
    if (!fs::exists(dir, ec) && !fs::exists(dir.string() + ".old.tmp", ec))
      throw InputError("--tag " + echo(tag, 100) + ": no such tag in " + echo(path, 200));
    return dir.string();
  }
  if (fs::exists(fs::path(path) / "index.h5", ec) || fs::exists(fs::path(path) / "latest", ec)) return path;
  throw InputError("--checkpoint " + echo(path, 200) +
                   ": neither a checkpoint tag directory (index.h5) nor a save directory with `latest`");
}
}  // namespace

std::unique_ptr<DataLoader> open_validation_data(const Config& cfg) {
  if (!cfg.data.validation) return nullptr;
  auto data = std::make_unique<DataLoader>(*cfg.data.validation, cfg.model.vocab_size, cfg.batch.micro_batch,
                                           cfg.model.n_positions, cfg.training.seed);
  // Sequential windows repeat after the last one: an evaluation longer than the data would
  // count samples twice, so it is refused before training starts.
  const int64_t held = data->samples_per_epoch(), batch = cfg.batch.train_batch_size;
  const int64_t needed = cfg.training.eval_steps * batch;
  if (held > 0 && needed > held)
    throw InputError(cfg.file + ": `training.eval_steps`: " + std::to_string(cfg.training.eval_steps) +
                     " rounds of train_batch_size " + std::to_string(batch) + " need " + std::to_string(needed) +
                     " samples, but data.validation holds " + std::to_string(held) + " (" +
                     (held >= batch ? "at most " + std::to_string(held / batch) + " rounds"
                                    : "less than one global batch") +
                     ")");
  return data;
}

void Engine::setup_evaluation() { validation_ = open_validation_data(cfg_); }

std::string Engine::eval_description() const {
  const int64_t samples = cfg_.training.eval_steps * cfg_.batch.train_batch_size;
  const int64_t every = cfg_.training.eval_interval;
  return (every > 0 ? "every " + std::to_string(every) + (every == 1 ? " step" : " steps") + " and after the last"
                    : std::string("not during training (training.eval_interval 0)")) +
         ": " + std::to_string(cfg_.training.eval_steps) + " rounds x " +
         std::to_string(cfg_.batch.train_batch_size) + " samples (" +
         std::to_string(samples * cfg_.model.n_positions) + " tokens) of " + validation_->describe() +
         (stages_ > 1 ? "; DeepSpeed's InferenceSchedule" : "");
}

void Engine::evaluate_if_due(StepResult& r) {
  const int64_t every = cfg_.training.eval_interval;
  if (every <= 0 || (r.step % every != 0 && r.step != cfg_.training.steps)) return;
  r.eval = evaluate();
}

void Engine::record_eval_losses(int micro_batch, const ActivationBuffer& buf) {
  const int64_t B = cfg_.batch.micro_batch, T = model_->seq_len();
  Kokkos::View<float*, Kokkos::MemoryTraits<Kokkos::Unmanaged>> losses(buf.losses, B * T);
  auto host = Kokkos::create_mirror_view(losses);
  Kokkos::deep_copy(host, losses);
  const int64_t first = (micro_batch * world_ + rank_) * B;  // in the round, as LoadMicroBatch counts
  for (int64_t b = 0; b < B; ++b) {
    double sum = 0.0;
    for (int64_t t = 0; t < T; ++t) sum += host(b * T + t);
    eval_->sample_loss[static_cast<size_t>(first + b)] = sum;
  }
}

EvalResult Engine::evaluate() {
  const auto t0 = std::chrono::steady_clock::now();
  const PhaseTimers step_timers = timers_;  // the step's phase times are reported without the evaluation's
  const pipe::ScheduleSpec spec{cfg_.pipeline.schedule, stages_, static_cast<int>(cfg_.batch.gradient_accumulation_steps),
                                cfg_.pipeline.virtual_stages};
  const pipe::StageSchedule schedule = pipe::make_inference_schedule(spec, stage_);
  // Stage 3 gathers along the forward passes alone; training's trace is put back afterwards.
  std::vector<int> trace;
  for (const auto& step : schedule.steps)
    for (const pipe::Instruction& in : step)
      if (in.op == pipe::Op::Forward)
        for (int u : model_->fetch_order(in.chunk, true)) trace.push_back(u);
  std::vector<int> training_trace = zero_->fetch_trace(), expert_training_trace;
  std::vector<bool> training_backward = zero_->fetch_backward();
  if (expert_zero_) {  // MoE: the experts' units go to their own optimizer
    std::vector<int> dense, experts;
    for (int u : trace) (u >= first_expert_unit_ ? experts : dense).push_back(u >= first_expert_unit_ ? u - first_expert_unit_ : u);
    trace = std::move(dense);
    expert_training_trace = expert_zero_->fetch_trace();
    expert_zero_->set_fetch_trace(std::move(experts));
  }
  zero_->set_fetch_trace(std::move(trace));
  // The inference schedule may want more buffers than training's (zb-h1 with one micro-batch).
  const size_t kept = buffers_.size();
  while (buffers_.size() < static_cast<size_t>(schedule.num_buffers)) buffers_.push_back(model_->make_buffer(false));
  pending_.resize(std::max(pending_.size(), buffers_.size()));

  const int64_t batch = cfg_.batch.train_batch_size;
  double total = 0.0;
  StepResult unused;
  double unused_loss = 0.0;
  eval_.emplace();
  for (int64_t round = 0; round < cfg_.training.eval_steps; ++round) {
    eval_->first_sample = round * batch;
    eval_->sample_loss.assign(static_cast<size_t>(batch), 0.0);
    for (const auto& step : schedule.steps)
      for (const pipe::Instruction& in : step) execute(in, unused, unused_loss);
    for (size_t b = 0; b < buffers_.size(); ++b) wait_sends(static_cast<int>(b));
    // Each sample's sum comes from one rank of the data group and zeros from the others: exact.
    dp_comm_->all_reduce(eval_->sample_loss.data(), batch, DType::F64, ReduceOp::Sum);
    if (stages_ > 1) pipe_comm_->broadcast(eval_->sample_loss.data(), batch, DType::F64, stages_ - 1);
    for (double x : eval_->sample_loss) total += x;  // in sample order: the same additions in every layout
  }
  eval_.reset();

  buffers_.erase(buffers_.begin() + static_cast<std::ptrdiff_t>(kept), buffers_.end());
  pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(kept), pending_.end());
  zero_->set_fetch_trace(std::move(training_trace), std::move(training_backward));
  if (expert_zero_) expert_zero_->set_fetch_trace(std::move(expert_training_trace));
  timers_ = step_timers;
  EvalResult e;
  e.samples = cfg_.training.eval_steps * batch;
  e.tokens = e.samples * model_->seq_len();
  e.loss = total / static_cast<double>(e.tokens);
  e.ppl = std::exp(e.loss);
  e.elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return e;
}

ParamStore& Engine::inference_store() {
  // Stage 3 gathers along a forward pass of each chunk of the stage, in order (generation's
  // passes: one chunk after another for a group of prompts).
  std::vector<int> trace;
  for (int c = 0; c < model_->num_chunks(); ++c)
    for (const int u : model_->fetch_order(c, true)) trace.push_back(u);
  zero_->set_fetch_trace(std::move(trace));
  return store_;
}

void Engine::with_inference_store(const std::function<void(ParamStore&)>& f) {
  std::vector<int> training_trace = zero_->fetch_trace();
  const PhaseTimers step_timers = timers_;
  f(inference_store());
  zero_->set_fetch_trace(std::move(training_trace));
  timers_ = step_timers;
}

int64_t Engine::load_checkpoint_params(const std::string& path, const std::string& tag) {
  int64_t step = 0;
  std::string dir;
  run_collectively(groups_.world(), [&] {
    CheckpointReader reader = CheckpointReader::open(checkpoint_tag_dir(path, tag), "");
    reader.check_layout(gpt_layout(model_->shape()));
    reader.check_model(cfg_.resolved.value("model", nlohmann::json::object()));
    // Parameters only, through the global offsets of this rank's elements (as a resume reads
    // them); the optimizer's states are left at zero, as evaluation never steps.
    const ModelPart& part = model_->part();
    zero_->read_checkpoint(
        [&](const std::string& state, int64_t b, int64_t e, float* out) {
          if (state != "params") return std::fill(out, out + (e - b), 0.0f);
          for (const LayoutSegment& run : part.global_runs(b, e, /*saving=*/false))
            reader.read_range(state, run.global_begin, run.global_begin + (run.local_end - run.local_begin),
                              out + (run.local_begin - b));
        },
        0);
    if (expert_zero_) read_expert_checkpoint(reader);
    step = reader.meta().step;
    dir = reader.dir();
  });
  zero_->finish_checkpoint_load();
  if (expert_zero_) expert_zero_->finish_checkpoint_load();
  if (groups_.rank() == 0) {
    std::printf("load    %s: parameters of step %lld\n", dir.c_str(), (long long)step);
    std::fflush(stdout);
  }
  return step;
}

}  // namespace zero3d
