// train.cpp — the commands that read a config and run the engine: validate, train, autotune, eval.
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "base/errors.hpp"
#include "base/failure.hpp"
#include "base/input_file.hpp"
#include "base/watchdog.hpp"
#include "cli/agreement.hpp"
#include "cli/checkpoint_model.hpp"
#include "cli/commands.hpp"
#include "config/config.hpp"
#include "io/checkpoint.hpp"
#include "io/checkpoint_options.hpp"
#include "io/data.hpp"
#include "infer/training_samples.hpp"
#include "io/weights.hpp"
#include "model/model.hpp"
#include "offload/aio.hpp"
#include "observe/monitor.hpp"
#include "parallel/nodes.hpp"
#include "parallel/topology.hpp"
#include "train/autotune.hpp"
#include "train/engine.hpp"
#include "train/estimator.hpp"
#include "text/tokenizer.hpp"
#include "train/job_control.hpp"

namespace zero3d::cli {

namespace {

std::string run_name(const std::string& path) {
  if (path.empty()) return "quickstart";
  std::string base = path.substr(path.find_last_of('/') + 1);
  return base.substr(0, base.find_last_of('.'));
}

// Where a run writes: --output, else training.output_dir, else output/<config name>; save_dir
// defaults to <output>/checkpoints. Recorded in the resolved config that the run writes.
std::string resolve_run_paths(Config& cfg, const std::string& config_path, const std::string& output_override) {
  if (find_control_byte(output_override) != std::string::npos)
    throw InputError("--output " + echo(output_override) + ": the path contains a control byte");
  const std::string out = !output_override.empty()           ? output_override
                          : !cfg.training.output_dir.empty() ? cfg.training.output_dir
                                                             : "output/" + run_name(config_path);
  cfg.resolved["training"]["output_dir"] = out;
  if (cfg.training.save_dir.empty()) cfg.training.save_dir = out + "/checkpoints";
  cfg.resolved["training"]["save_dir"] = cfg.training.save_dir;
  return out;
}

// What `train` would open or create, checked without training: the data, init_from, the
// checkpoint to resume from (verified as resume verifies it), and that the output directory and
// save_dir can be written. InputError naming the key and path.
std::string check_run_files(const Config& cfg, const std::string& out) {
  const ModelConfig& mc = cfg.model;
  DataLoader(cfg.data, mc.vocab_size, cfg.batch.micro_batch, mc.n_positions, cfg.training.seed);  // reads it as train does
  open_validation_data(cfg);
  if (!mc.init_from.empty())
    check_weights(mc.init_from, gpt_layout(gpt_shape_of(mc)));
  check_writable_directory(out, "output directory");
  check_writable_directory(cfg.training.save_dir, "training.save_dir");
  check_output_directory_is_ours(out);
  check_save_dir_before_run(cfg.training.save_dir,
                            resumed_step(cfg.training.resume, cfg.training.save_dir, cfg.checkpoint),
                            cfg.training.steps);
  const std::string& resume = cfg.training.resume;
  if (resume.empty()) return "";
  if (resume == "auto" && !resumable_checkpoint_exists(cfg.training.save_dir, cfg.checkpoint))
    return "resume  auto: no checkpoint in " + cfg.training.save_dir + " yet; train would start fresh";
  // The tag train will open: with checkpoint.load_universal, the one `latest_universal` names.
  const ResumeTarget target = resume_target(resume, cfg.training.save_dir, cfg.checkpoint);
  const CheckpointReader reader =
      CheckpointReader::open(target.spec, cfg.training.save_dir, cfg.checkpoint.use_node_local_storage);
  reader.verify_files();
  return "resume  " + reader.dir() + ": step " + std::to_string(reader.meta().step) + " (verified" +
         (target.from.empty() ? "" : ", named by " + target.from) + ")";
}

// NVMe offload directories, checked as the engine checks them before it creates its swap files
// (offload/aio.hpp check_swap_directory), each with the bytes of its own files.
void check_swap_directories(const Config& cfg, const MemoryBudget& b) {
  const OffloadOptimizerConfig& oo = cfg.zero.offload_optimizer;
  const OffloadParamConfig& op = cfg.zero.offload_param;
  if (oo.device == OffloadDevice::Nvme && cfg.zero.stage >= 1)
    offload::check_swap_directory(oo.nvme_path, b.offload_nvme - b.offload_nvme_params,
                                  "zero_optimization.offload_optimizer.nvme_path");
  if (op.device == OffloadDevice::Nvme && cfg.zero.stage == 3)
    offload::check_swap_directory(op.nvme_path, b.offload_nvme_params, "zero_optimization.offload_param.nvme_path");
}

}  // namespace

int cmd_validate(const ConfigArgs& a, int64_t world_size, const std::string& output_override,
                 const std::string* device, MPI_Comm world) {
  std::string name, resume_note;
  Config cfg;
  MemoryBudget budget;
  AvailableMemory avail = available_memory();
  const int per_node = planned_ranks_per_node(world);  // the nodes train would find (ZERO3D_RANKS_PER_NODE)
  bool other_build = false;  // --device gpu on a CPU build: this machine is not the one the run needs
  run_collectively(world, [&] {
    const kernels::Backend backend = device_option("validate", device);
    other_build = backend != kernels::kBuildBackend;
    if (other_build) avail = {};
    cfg = resolve_config(load_with_overrides(a, name), name, world_size, set_keys(a), per_node, backend);
    // The same check as train's, for one rank on this machine: a plan that cannot start here is not valid here.
    budget = check_memory_fits(cfg, 1, avail, per_node);
    if (!other_build) check_swap_directories(cfg, budget);  // (a GPU node's NVMe is not this machine's)
    resume_note = check_run_files(cfg, resolve_run_paths(cfg, a.path, output_override));
  });
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  if (rank == 0) {
    std::printf("%s: valid for %s\n", echo(name, 200).c_str(),
                layout_text(rank_layout(cfg, world_size), world_size).c_str());
    std::printf("batch   %s\n", cfg.batch.derivation.c_str());
    for (const std::string& line : cfg.notes) std::printf("%s\n", line.c_str());
    const std::string host = avail.bytes < 0 ? "available memory unknown (not checked)"
                                              : human_bytes(double(avail.bytes)) + " available on this machine (" +
                                                    avail.source + ")";
    if (other_build)
      std::printf("memory  %s of device memory per rank at ZeRO stage %d (--device gpu: a GPU run's plan, not checked "
                  "against this machine)\n", human_bytes(double(budget.device_need())).c_str(), budget.stage);
    else if (budget.gpu())  // the device's share is checked when train has started the device
      std::printf("memory  %s of device memory per rank at ZeRO stage %d (train checks it against the device); %s of "
                  "host memory per rank, %s\n", human_bytes(double(budget.device_need())).c_str(), budget.stage,
                  human_bytes(double(budget.host_need())).c_str(), host.c_str());
    else
      std::printf("memory  %s per rank at ZeRO stage %d; %s\n", human_bytes(double(budget.total())).c_str(),
                  budget.stage, host.c_str());
    if (!resume_note.empty()) std::printf("%s\n", resume_note.c_str());
  }
  return kExitOk;
}

namespace {

// autotuning.enabled on train: tune first, then train the optimal configuration (DeepSpeed's
// `--autotuning run`). Returns it (null when the config does not ask), naming it in `name`.
nlohmann::json tune_first(const ConfigArgs& a, std::string& name, int ranks_here, const AvailableMemory& avail,
                          MPI_Comm world) {
  nlohmann::json root;
  run_collectively(world, [&] { root = load_with_overrides(a, name); });
  if (!autotuning_enabled(root)) return nullptr;
  const AutotuneResult r = autotune(root, name, world, autotune_memory(0, avail, ranks_here));
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  if (rank == 0) std::printf("autotune training with %s\n", r.optimal_path.c_str());
  name = r.optimal_path;
  return r.optimal;
}

}  // namespace

// zero3d autotune: DeepSpeed's autotuner on this job's own ranks (autotune.hpp). Writes
// results_dir, exps_dir and results_dir/ds_config_optimal.json; trains nothing further.
int cmd_autotune(const ConfigArgs& a, int64_t world_size, bool world_size_given, const std::string* memory_per_rank,
                 MPI_Comm world) {
  int size = 1;
  MPI_Comm_size(world, &size);
  const int ranks_here = ranks_on_this_node(world);
  const AvailableMemory avail = available_memory();
  std::string name;
  nlohmann::json root;
  AutotuneMemory memory;
  run_collectively(world, [&] {
    check_launch(size);
    if (world_size_given && world_size != size)
      throw InputError("autotune --world-size " + std::to_string(world_size) + ": every experiment runs on this job's " +
                       std::to_string(size) + " rank(s); start it with mpiexec -np " + std::to_string(world_size));
    root = load_with_overrides(a, name);
    memory = autotune_memory(memory_per_rank ? size_option("--memory-per-rank", *memory_per_rank) : 0, avail, ranks_here);
  });
  autotune(root, name, world, memory);
  return kExitOk;
}

int cmd_train(const ConfigArgs& a, const std::string& output_override, MPI_Comm world) {
  int size = 1, rank = 0;
  MPI_Comm_size(world, &size);
  MPI_Comm_rank(world, &rank);
  std::string name, out;
  Config cfg;
  const int ranks_here = ranks_on_this_node(world);  // for the start-up memory check
  const int per_node = planned_ranks_per_node(world);  // the nodes the engine's groups will find: its plan's
  const AvailableMemory avail = available_memory();
  std::unique_ptr<OutputDirLock> lock;
  run_collectively(world, [&] { check_launch(size); });  // job_control.hpp: N scheduler tasks seen by MPI as N one-rank jobs
  const nlohmann::json tuned = tune_first(a, name, ranks_here, avail, world);
  run_collectively(world, [&] {
    cfg = resolve_config(tuned.is_null() ? load_with_overrides(a, name) : tuned, name, size, set_keys(a), per_node);
    check_memory_fits(cfg, ranks_here, avail, per_node);
    out = resolve_run_paths(cfg, a.path, output_override);
    // Found now, not at the first save: every rank writes its shard into save_dir.
    if (rank == 0) check_writable_directory(out, "output directory");  // named first: save_dir may lie inside
    check_writable_directory(cfg.training.save_dir, "training.save_dir");
    if (rank == 0) {
      check_output_directory_is_ours(out);
      restore_interrupted_resave(cfg.training.save_dir);
      check_save_dir_before_run(cfg.training.save_dir,
                                resumed_step(cfg.training.resume, cfg.training.save_dir, cfg.checkpoint),
                                cfg.training.steps);
      make_directories(out);
      lock = std::make_unique<OutputDirLock>(out);  // a second job into `out` stops here, naming this one
      std::remove((out + "/" + kRequeueFile).c_str());  // the last preemption's note: this run is its requeue
    }
  });
  agree_on_configuration(world, cfg);  // agreement.hpp: exit 2 naming the first key on which ranks differ
  if (rank == 0) {
    if (lock && !lock->note().empty()) std::printf("note    %s\n", lock->note().c_str());
    const std::string busy = oversubscription_note(blas_threads_per_rank(), ranks_here,
                                                   static_cast<int>(std::thread::hardware_concurrency()));
    if (!busy.empty()) std::printf("note    %s\n", busy.c_str());
  }
  if (rank == 0)
    for (const std::string& line : cfg.notes) std::printf("%s\n", line.c_str());  // "auto" values, no-effect keys
  // SIGTERM/SIGUSR1 set a flag from the first line of main() (job_control.hpp): the first step
  // boundary finishes the step, saves and exits kExitRequeue.
  // DeepSpeed's PipeModelDataParallelTopology: ranks are placed exactly as `zero3d topology` prints.
  const int pp = cfg.pipeline.stages, tp = cfg.tensor.size;
  ProcessGroups groups(ProcessTopology::pipe_data_model(pp, size / (pp * tp), tp), world,
                       static_cast<int>(cfg.model.moe.ep_size), data_shards(cfg.zero));
  Watchdog watchdog(cfg.training.comms_timeout, rank);
  Engine engine(cfg, groups, out, &watchdog);
  if (engine.step() >= cfg.training.steps) {
    if (rank == 0)
      std::printf("nothing to do: the checkpoint is at step %lld and training.steps is %lld\n",
                  (long long)engine.step(), (long long)cfg.training.steps);
    return kExitOk;
  }
  std::unique_ptr<infer::TrainingSampler> sampler;
  if (cfg.training.sample_every > 0) {
    run_collectively(world, [&] { sampler = std::make_unique<infer::TrainingSampler>(cfg, out, engine.step(), rank); });
    engine.set_after_step([&](int64_t step) { sampler->after_step(engine, step); });
  }
  note_phase("training");  // failure.hpp: for the message if this rank is killed
  engine.train();
  return engine.stopped_by_signal() != 0 ? kExitRequeue : kExitOk;
}

// zero3d eval: the validation loss of a checkpoint's parameters, or of the weights the config
// starts from (model.init_from, else the seed) when no checkpoint is given. Any layout the ranks
// and the config describe; nothing is trained or written. With --text the samples are a text
// file's tokens (one document, as `zero3d tokenize` writes it) in place of data.validation's:
// every whole global batch of its sequential samples (the tail of less than a batch is not scored).
int cmd_eval(const EvalArgs& a, MPI_Comm world) {
  int size = 1, rank = 0;
  MPI_Comm_size(world, &size);
  MPI_Comm_rank(world, &rank);
  const int ranks_here = ranks_on_this_node(world);
  const int per_node = planned_ranks_per_node(world);
  const AvailableMemory avail = available_memory();
  std::string name, tokenizer_text;
  Config cfg;
  std::unique_ptr<DataLoader> text_data;
  int64_t text_tokens = 0;
  run_collectively(world, [&] {
    check_launch(size);
    if (!a.tag.empty() && a.checkpoint.empty()) throw InputError("eval --tag " + echo(a.tag, 100) + ": needs --checkpoint");
    if (!a.tokenizer.empty() && a.text.empty())
      throw InputError("eval --tokenizer " + echo(a.tokenizer, 200) + ": is for --text (the file's text to tokens)");
    cfg = resolve_config(load_with_overrides(a.config, name), name, size, set_keys(a.config), per_node);
    if (!a.text.empty()) {
      const std::string path = a.tokenizer.empty() ? cfg.data.tokenizer : a.tokenizer;
      if (path.empty())
        throw InputError("eval --text: no tokenizer (give --tokenizer PATH, or data.tokenizer in the config)");
      const std::unique_ptr<text::Tokenizer> tok = text::open_tokenizer(path);
      tokenizer_text = tok->describe();
      const std::vector<int32_t> ids = text_file_document(*tok, a.text, "eval --text");
      text_tokens = static_cast<int64_t>(ids.size());
      text_data = std::make_unique<DataLoader>(ids, "eval --text " + echo(a.text, 200), cfg.model.vocab_size,
                                               cfg.batch.micro_batch, cfg.model.n_positions);
      const int64_t samples = text_data->samples_per_epoch(), batch = cfg.batch.train_batch_size;
      if (samples < batch)
        throw InputError("eval --text " + echo(a.text, 200) + ": " + std::to_string(text_tokens) + " tokens make " +
                         std::to_string(samples) + " samples of n_positions " + std::to_string(cfg.model.n_positions) +
                         ", fewer than one global batch (train_batch_size " + std::to_string(batch) + ")");
      cfg.training.eval_steps = samples / batch;  // every whole round of the file's samples
      cfg.resolved["training"]["eval_steps"] = cfg.training.eval_steps;
      cfg.data.validation.reset();  // the file's samples stand in for them
    } else if (!cfg.data.validation) {
      throw InputError(name + ": `data.validation` is not given: zero3d eval evaluates on the validation data (or "
                       "give --text FILE)");
    }
    check_memory_fits(cfg, ranks_here, avail, per_node);
    without_resume_or_saves(cfg);  // the parameters come from --checkpoint
  });
  agree_on_configuration(world, cfg);
  CheckpointModel loaded(cfg, world, rank, a.checkpoint, a.tag);
  Engine& engine = loaded.engine;
  const int64_t step = loaded.step;
  if (text_data) engine.set_validation_data(std::move(text_data));
  note_phase("evaluation");
  const EvalResult e = engine.evaluate();
  if (rank != 0) return kExitOk;
  if (a.json) {
    nlohmann::json doc = {{"checkpoint", a.checkpoint.empty() ? nlohmann::json() : nlohmann::json(a.checkpoint)},
                          {"step", step},
                          {"eval_loss", e.loss},
                          {"eval_ppl", e.ppl},
                          {"samples", e.samples},
                          {"tokens", e.tokens},
                          {"elapsed_ms", e.elapsed_ms}};
    if (!a.text.empty()) doc["text"] = {{"file", a.text}, {"tokens", text_tokens}, {"tokenizer", tokenizer_text}};
    std::printf("%s\n", doc.dump().c_str());
    return kExitOk;
  }
  if (!a.text.empty())
    std::printf("text    %s: %lld tokens through %s; %lld of them scored (whole global batches of n_positions %lld)\n",
                echo(a.text, 200).c_str(), (long long)text_tokens, tokenizer_text.c_str(), (long long)e.tokens,
                (long long)cfg.model.n_positions);
  std::printf("eval    %s | eval_loss %.6f | eval_ppl %.6g | %lld samples, %lld tokens | %.2f s\n",
              a.checkpoint.empty() ? "initial weights" : ("step " + std::to_string(step)).c_str(), e.loss, e.ppl,
              (long long)e.samples, (long long)e.tokens, e.elapsed_ms / 1e3);
  return kExitOk;
}

}  // namespace zero3d::cli
