// main.cpp — CLI11 subcommands; the one place that catches errors and sets the exit code.
//
// Exit codes: 0 success, 2 bad input (one message, from rank 0), 1 system/internal failure
// (message names the failing rank; the job is aborted so that no rank hangs).
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "base.hpp"
#include "checkpoint.hpp"
#include "checkpoint_options.hpp"
#include "config.hpp"
#include "engine.hpp"
#include "estimator.hpp"
#include "agreement.hpp"
#include "autotune.hpp"
#include "failure.hpp"
#include "h5.hpp"
#include "input_file.hpp"
#include "job_control.hpp"
#include "data.hpp"
#include "monitor.hpp"
#include "weights.hpp"
#include "model.hpp"
#include "topology.hpp"

using namespace zero3d;

namespace {

// The most ranks a size given on the command line may describe: far above any job, and low
// enough that per-rank tables (topology, estimates) stay small and every product fits an int.
constexpr int64_t kMaxRanks = int64_t(1) << 20;

struct ConfigArgs {
  std::string path;  // empty = the built-in quick-start
  std::vector<std::string> overrides;
  std::string strategy;  // --strategy: a Lightning DeepSpeed preset beneath the config's keys
};

// The key paths of the --set overrides ("a.b=1" gives "a.b"), for read_config's messages.
std::vector<std::string> set_keys(const ConfigArgs& a) {
  std::vector<std::string> keys;
  for (const std::string& o : a.overrides) keys.push_back(o.substr(0, o.find('=')));
  return keys;
}

// Loads the JSON (file or built-in quick-start) and applies --set overrides in order.
nlohmann::json load_with_overrides(const ConfigArgs& a, std::string& name) {
  nlohmann::json root = a.path.empty() ? quickstart_json() : load_json_file(a.path);
  name = a.path.empty() ? "<built-in quickstart>" : echo(a.path, 200);  // names the file in every message
  for (const auto& o : a.overrides) apply_override(root, o);
  if (!a.strategy.empty() && root.is_object()) root["strategy"] = a.strategy;  // as the config key
  return root;
}

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

int cmd_validate(const ConfigArgs& a, int64_t world_size, MPI_Comm world) {
  std::string name, resume_note;
  Config cfg;
  MemoryBudget budget;
  const AvailableMemory avail = available_memory();
  run_collectively(world, [&] {
    cfg = read_config(load_with_overrides(a, name), name, world_size, set_keys(a));
    // The same check as train's, for one rank on this machine: a plan that cannot start here is not valid here.
    budget = check_memory_fits(cfg, 1, avail);
    resume_note = check_run_files(cfg, resolve_run_paths(cfg, a.path, ""));
  });
  int rank = 0;
  MPI_Comm_rank(world, &rank);
  if (rank == 0) {
    std::printf("%s: valid for %lld ranks (%d pipeline stages x %lld data-parallel)\n", echo(name, 200).c_str(),
                (long long)world_size, cfg.pipeline.stages, (long long)cfg.batch.world_size);
    std::printf("batch   %s\n", cfg.batch.derivation.c_str());
    for (const std::string& line : cfg.notes) std::printf("%s\n", line.c_str());
    std::printf("memory  %s per rank at ZeRO stage %d; %s\n", human_bytes(double(budget.total())).c_str(), budget.stage,
                avail.bytes < 0 ? "available memory unknown (not checked)"
                                : (human_bytes(double(avail.bytes)) + " available on this machine (" + avail.source +
                                   ")").c_str());
    if (!resume_note.empty()) std::printf("%s\n", resume_note.c_str());
  }
  return kExitOk;
}

// Ranks sharing this machine's memory (MPI_COMM_TYPE_SHARED).
int ranks_on_this_node(MPI_Comm world) {
  int rank = 0, ranks_here = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm node = MPI_COMM_NULL;
  if (MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
    MPI_Comm_size(node, &ranks_here);
    MPI_Comm_free(&node);
  }
  return ranks_here;
}

// A byte size option such as 16GiB (parse_byte_size says what is wrong; the option is named).
int64_t size_option(const std::string& option, const std::string& text) { return parse_byte_size(text, option); }

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

// zero3d autotune: DeepSpeed's autotuner on this job's own ranks (autotune.hpp). Writes
// results_dir, exps_dir and results_dir/ds_config_optimal.json; trains nothing further.
int cmd_autotune(const ConfigArgs& a, int64_t world_size, bool world_size_given, const std::string& memory_per_rank,
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
    memory = autotune_memory(memory_per_rank.empty() ? 0 : size_option("--memory-per-rank", memory_per_rank), avail,
                             ranks_here);
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
  const AvailableMemory avail = available_memory();
  std::unique_ptr<OutputDirLock> lock;
  run_collectively(world, [&] { check_launch(size); });  // job_control.hpp: N scheduler tasks seen by MPI as N one-rank jobs
  const nlohmann::json tuned = tune_first(a, name, ranks_here, avail, world);
  run_collectively(world, [&] {
    cfg = read_config(tuned.is_null() ? load_with_overrides(a, name) : tuned, name, size, set_keys(a));
    check_memory_fits(cfg, ranks_here, avail);
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
    const int threads = blas_threads_per_rank(), cores = static_cast<int>(std::thread::hardware_concurrency());
    if (cores > 0 && threads * ranks_here > cores)
      std::printf("note    BLAS uses %d threads per rank x %d ranks on this node = %d > %d cores: oversubscribed, "
                  "which slows every matrix product; set OPENBLAS_NUM_THREADS=%d\n",
                  threads, ranks_here, threads * ranks_here, cores, std::max(1, cores / ranks_here));
  }
  if (rank == 0)
    for (const std::string& line : cfg.notes) std::printf("%s\n", line.c_str());  // "auto" values, no-effect keys
  install_preemption_handlers();  // SIGTERM/SIGUSR1: finish the step, save, exit kExitRequeue
  // DeepSpeed's PipeModelDataParallelTopology: ranks are placed exactly as `zero3d topology` prints.
  const int pp = cfg.pipeline.stages, tp = cfg.tensor.size;
  ProcessGroups groups(ProcessTopology::pipe_data_model(pp, size / (pp * tp), tp), world,
                       static_cast<int>(cfg.model.moe.ep_size));
  Watchdog watchdog(cfg.training.comms_timeout, rank);
  Engine engine(cfg, groups, out, &watchdog);
  if (engine.step() >= cfg.training.steps) {
    if (rank == 0)
      std::printf("nothing to do: the checkpoint is at step %lld and training.steps is %lld\n",
                  (long long)engine.step(), (long long)cfg.training.steps);
    return kExitOk;
  }
  note_phase("training");  // failure.hpp: for the message if this rank is killed
  engine.train();
  return engine.stopped_by_signal() != 0 ? kExitRequeue : kExitOk;
}

// One process group along an axis: `size` ranks from `first`, `stride` apart (row-major
// ranks make every group an arithmetic progression, as ProcessTopology::get_axis_comm_lists).
struct Progression {
  int64_t first, stride, size;
};

// "[0,1,2]" in full up to 16 ranks, else "[0,4,...,60] (16 ranks)": O(1) per line, so the
// whole listing stays linear in the number of ranks.
std::string group_text(const Progression& g) {
  std::string s = "[";
  if (g.size <= 16) {
    for (int64_t k = 0; k < g.size; ++k) s += (k ? "," : "") + std::to_string(g.first + k * g.stride);
    return s + "]";
  }
  return s + std::to_string(g.first) + "," + std::to_string(g.first + g.stride) + ",...," +
         std::to_string(g.first + (g.size - 1) * g.stride) + "] (" + std::to_string(g.size) + " ranks)";
}

std::string group_json(const Progression& g) {
  std::string s = "[";
  for (int64_t k = 0; k < g.size; ++k) s += (k ? "," : "") + std::to_string(g.first + k * g.stride);
  return s + "]";
}

// Prints each rank's coordinates and groups for a pipe x data x model job, computed from the
// coordinates (rank = (pipe·dp + data)·tp + model) in O(1) per rank.
int cmd_topology(int64_t pp, int64_t dp, int64_t tp, bool as_json, int rank) {
  if (rank != 0) return kExitOk;
  // Each factor is at most kMaxRanks (CLI check), so the product fits int64 before comparing.
  const int64_t world = pp * dp * tp;
  if (world > kMaxRanks)
    throw InputError("topology --pp " + std::to_string(pp) + " --dp " + std::to_string(dp) + " --tp " +
                     std::to_string(tp) + ": " + std::to_string(world) + " ranks, more than the " +
                     std::to_string(kMaxRanks) + " zero3d supports");
  // The JSON lists every group in full: bounded, as its size grows with ranks x group sizes.
  const int64_t kMaxJsonEntries = int64_t(1) << 24;
  if (as_json && world * (pp + dp + tp) > kMaxJsonEntries)
    throw InputError("topology --json: " + std::to_string(world) + " ranks with their groups would list " +
                     std::to_string(world * (pp + dp + tp)) + " ranks (at most " + std::to_string(kMaxJsonEntries) +
                     "); the text form abbreviates long groups");
  const ProcessTopology topo = ProcessTopology::pipe_data_model(int(pp), int(dp), int(tp));
  auto groups = [&](int64_t p, int64_t d, int64_t m) {
    struct {
      Progression data, model, pipe;
    } g{{p * dp * tp + m, tp, dp}, {(p * dp + d) * tp, 1, tp}, {d * tp + m, dp * tp, pp}};
    return g;
  };
  if (as_json) {
    nlohmann::json head = {{"axes", topo.get_axis_names()}, {"dims", topo.dims()}};
    std::string text = head.dump();
    text.pop_back();
    std::fputs((text + ",\"ranks\":[").c_str(), stdout);
    for (int64_t r = 0; r < world; ++r) {
      const int64_t p = r / (dp * tp), d = r / tp % dp, m = r % tp;
      const auto g = groups(p, d, m);
      std::printf("%s{\"coord\":{\"data\":%lld,\"model\":%lld,\"pipe\":%lld},\"groups\":{\"data\":%s,\"model\":%s,"
                  "\"pipe\":%s},\"rank\":%lld}",
                  r ? "," : "", (long long)d, (long long)m, (long long)p, group_json(g.data).c_str(),
                  group_json(g.model).c_str(), group_json(g.pipe).c_str(), (long long)r);
    }
    std::printf("]}\n");
    return kExitOk;
  }
  std::printf("%lld ranks = pipe %lld x data %lld x model %lld (row-major, model fastest)\n", (long long)world,
              (long long)pp, (long long)dp, (long long)tp);
  for (int64_t r = 0; r < world; ++r) {
    const int64_t p = r / (dp * tp), d = r / tp % dp, m = r % tp;
    const auto g = groups(p, d, m);
    std::printf("rank %3lld  pipe %lld data %lld model %lld  | data group %s  tensor group %s  pipe group %s\n",
                (long long)r, (long long)p, (long long)d, (long long)m, group_text(g.data).c_str(),
                group_text(g.model).c_str(), group_text(g.pipe).c_str());
  }
  return kExitOk;
}

int cmd_inspect(const std::string& dir, const std::string& tag, const std::string& tensor, bool as_json, int rank) {
  if (rank != 0) return kExitOk;
  const nlohmann::json r = inspect_checkpoint(dir, tag, tensor);
  if (as_json) {
    std::printf("%s\n", r.dump(2).c_str());
    return kExitOk;
  }
  std::printf("checkpoint %s\n", r["dir"].get<std::string>().c_str());
  if (r.contains("tags")) {
    std::string tags;
    for (const auto& t : r["tags"]) tags += (tags.empty() ? "" : ", ") + t.get<std::string>();
    std::printf("tags       %s (latest: %s)\n", tags.c_str(), r["latest"].get<std::string>().c_str());
  }
  std::printf("step %lld | samples %lld | ZeRO stage %lld | topology pipe %lld x data %lld x model %lld | %zu shards | "
              "master %s | optimizer %s | checksums verified\n",
              r["step"].get<long long>(), r["global_samples"].get<long long>(), r["zero_stage"].get<long long>(),
              r["topology"]["pipe"].get<long long>(), r["topology"]["data"].get<long long>(),
              r["topology"]["model"].get<long long>(), r["shards"].get<size_t>(),
              r["dtypes"]["master"].get<std::string>().c_str(), r["optimizer"].get<std::string>().c_str());
  std::printf("%-28s %-14s %-5s %12s %12s %12s %12s\n", "tensor", "shape", "dtype", "min", "max", "mean", "l2_norm");
  for (const auto& t : r["tensors"])
    std::printf("%-28s %-14s %-5s %12.5g %12.5g %12.5g %12.5g\n", t["name"].get<std::string>().c_str(),
                t["shape"].dump().c_str(), t["dtype"].get<std::string>().c_str(), t["min"].get<double>(),
                t["max"].get<double>(), t["mean"].get<double>(), t["l2_norm"].get<double>());
  return kExitOk;
}

// zero3d eval: the validation loss of a checkpoint's parameters, or of the weights the config
// starts from (model.init_from, else the seed) when no checkpoint is given. Any layout the ranks
// and the config describe; nothing is trained or written.
int cmd_eval(const ConfigArgs& a, const std::string& checkpoint, const std::string& tag, bool as_json, MPI_Comm world) {
  int size = 1, rank = 0;
  MPI_Comm_size(world, &size);
  MPI_Comm_rank(world, &rank);
  const int ranks_here = ranks_on_this_node(world);
  const AvailableMemory avail = available_memory();
  std::string name;
  Config cfg;
  run_collectively(world, [&] {
    check_launch(size);
    if (!tag.empty() && checkpoint.empty()) throw InputError("eval --tag " + echo(tag, 100) + ": needs --checkpoint");
    cfg = read_config(load_with_overrides(a, name), name, size, set_keys(a));
    if (!cfg.data.validation)
      throw InputError(name + ": `data.validation` is not given: zero3d eval evaluates on the validation data");
    check_memory_fits(cfg, ranks_here, avail);
    // The parameters come from --checkpoint: no resume, no saves.
    cfg.training.resume.clear();
    cfg.training.save_interval = 0;
    cfg.resolved["training"]["resume"] = "";
    cfg.resolved["training"]["save_interval"] = 0;
  });
  agree_on_configuration(world, cfg);
  const int pp = cfg.pipeline.stages, tp = cfg.tensor.size;
  ProcessGroups groups(ProcessTopology::pipe_data_model(pp, size / (pp * tp), tp), world,
                       static_cast<int>(cfg.model.moe.ep_size));
  Watchdog watchdog(cfg.training.comms_timeout, rank);
  Engine engine(cfg, groups, "", &watchdog);
  const int64_t step = checkpoint.empty() ? 0 : engine.load_checkpoint_params(checkpoint, tag);
  note_phase("evaluation");
  const EvalResult e = engine.evaluate();
  if (rank != 0) return kExitOk;
  if (as_json) {
    const nlohmann::json doc = {{"checkpoint", checkpoint.empty() ? nlohmann::json() : nlohmann::json(checkpoint)},
                                {"step", step},
                                {"eval_loss", e.loss},
                                {"eval_ppl", e.ppl},
                                {"samples", e.samples},
                                {"tokens", e.tokens},
                                {"elapsed_ms", e.elapsed_ms}};
    std::printf("%s\n", doc.dump().c_str());
    return kExitOk;
  }
  std::printf("eval    %s | eval_loss %.6f | eval_ppl %.6g | %lld samples, %lld tokens | %.2f s\n",
              checkpoint.empty() ? "initial weights" : ("step " + std::to_string(step)).c_str(), e.loss, e.ppl,
              (long long)e.samples, (long long)e.tokens, e.elapsed_ms / 1e3);
  return kExitOk;
}

int cmd_convert(const std::string& dir, const std::string& out, const std::string& tag, const std::string& format,
                const std::string& dtype, const std::string& max_shard, int rank) {
  if (rank != 0) return kExitOk;
  const int64_t shard = max_shard.empty() ? 0 : size_option("--max-shard-size", max_shard);
  const ConvertResult r = convert_checkpoint(dir, tag, out, format, dtype, shard);
  for (const auto& f : r.written) std::printf("wrote %s\n", f.c_str());
  for (const auto& f : r.removed) std::printf("removed %s (a stale output of an earlier convert to this name)\n", f.c_str());
  return kExitOk;
}

struct EstimateArgs {
  std::string kind;  // zero2 | zero3 | empty (the complete budget of --config)
  double params = 0, largest_layer = -1, buffer_factor = 1.5;
  int gpus_per_node = 1, nodes = 1;
  std::string model, report, memory_per_rank;
  ConfigArgs config;
  int64_t world_size = 1;
  bool json = false;
  std::set<std::string> given;  // the options on the command line
  bool has(const char* option) const { return given.count(option) > 0; }
};

// Each mode reads its own options; one given to the other mode would be ignored, so it is an error.
void check_estimate_mode(const EstimateArgs& a) {
  const bool table = a.kind == "zero2" || a.kind == "zero3";
  const std::set<std::string> table_only = {"--params", "--largest-layer-params", "--gpus-per-node", "--nodes",
                                            "--additional-buffer-factor", "--model"};
  const std::set<std::string> budget_only = {"--config", "--world-size", "--memory-per-rank", "--report", "--json"};
  for (const std::string& o : a.given) {
    if (table && budget_only.count(o))
      throw InputError("estimate " + a.kind + " " + o + ": DeepSpeed's " + a.kind +
                       " table does not use it; it belongs to `zero3d estimate --config CONFIG`");
    if (!table && a.kind.empty() && table_only.count(o))
      throw InputError("estimate " + o + ": used by DeepSpeed's tables (`zero3d estimate zero2|zero3`), not by the "
                       "budget of --config");
  }
  if (table && a.has("--params") && a.has("--model"))
    throw InputError("estimate " + a.kind + ": give --params (a cold estimate) or --model CONFIG (counts from its "
                     "model), not both");
  if (a.kind == "zero2" && a.has("--largest-layer-params"))
    throw InputError("estimate zero2 --largest-layer-params: only zero3's table uses the largest layer");
}

// Options of DeepSpeed's cold estimators: finite, in range, and GPU counts whose product fits.
void check_estimate_options(const EstimateArgs& a) {
  auto number = [](const char* option, double v, double lo, double hi) {
    if (!(std::isfinite(v) && v >= lo && v <= hi)) {
      char buf[160];
      std::snprintf(buf, sizeof(buf), "estimate %s %g: expected a finite number in [%g, %g]", option, v, lo, hi);
      throw InputError(buf);
    }
  };
  if (a.has("--params")) number("--params", a.params, 1, 1e15);
  if (a.has("--largest-layer-params")) number("--largest-layer-params", a.largest_layer, 0, 1e15);
  if (a.has("--params") && a.has("--largest-layer-params") && a.largest_layer > a.params) {
    char buf[200];
    std::snprintf(buf, sizeof(buf), "estimate --largest-layer-params %g: more than the whole model (--params %g)",
                  a.largest_layer, a.params);
    throw InputError(buf);
  }
  number("--additional-buffer-factor", a.buffer_factor, 1, 100);
  if (int64_t(a.gpus_per_node) * a.nodes > kMaxRanks)
    throw InputError("estimate --gpus-per-node " + std::to_string(a.gpus_per_node) + " --nodes " +
                     std::to_string(a.nodes) + ": more than " + std::to_string(kMaxRanks) + " GPUs in all");
}

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%10.1f MiB", bytes / 1048576.0);
  return buf;
}

int cmd_estimate(EstimateArgs a, int rank) {
  if (rank != 0) return kExitOk;
  check_estimate_mode(a);
  check_estimate_options(a);
  if (a.kind == "zero2" || a.kind == "zero3") {
    // Cold (--params) or live (--model CONFIG, with --set applied: counts from the model definition).
    if (!a.config.overrides.empty() && a.model.empty())
      throw InputError("estimate " + a.kind + ": --set changes a config; give it with --model CONFIG");
    if (!a.model.empty()) {
      std::string model_name;
      const Config c = read_config(load_with_overrides({a.model, a.config.overrides, a.config.strategy}, model_name),
                                   model_name, 1, set_keys(a.config));
      const ModelCounts counts = count_model(c.model);
      a.params = double(counts.params);
      a.largest_layer = double(counts.largest_layer);
    }
    if (a.params <= 0) throw InputError("estimate " + a.kind + ": give --params P or --model CONFIG");
    if (a.kind == "zero3" && a.largest_layer < 0)
      throw InputError("estimate zero3: give --largest-layer-params L or --model CONFIG");
    const auto rows = a.kind == "zero2"
                          ? deepspeed_zero2_rows(a.params, a.gpus_per_node, a.nodes, a.buffer_factor)
                          : deepspeed_zero3_rows(a.params, a.largest_layer, a.gpus_per_node, a.nodes, a.buffer_factor);
    std::printf("%s", deepspeed_table(rows, a.params, a.kind == "zero3" ? a.largest_layer : -1, a.gpus_per_node,
                                      a.nodes).c_str());
    return kExitOk;
  }
  if (!a.kind.empty()) throw InputError("estimate: unknown kind \"" + a.kind + "\" (zero2, zero3, or --config)");
  if (a.config.path.empty()) throw InputError("estimate: give zero2/zero3 with --params, or --config CONFIG");
  std::string name;
  const Config cfg = read_config(load_with_overrides(a.config, name), name, a.world_size, set_keys(a.config));
  std::vector<MemoryBudget> budgets;
  for (int stage = 0; stage <= 3; ++stage) budgets.push_back(estimate_budget(cfg, a.world_size, stage));
  int64_t limit = 0;
  std::vector<FitAnswer> fits;  // --memory-per-rank: what fits at each ZeRO stage
  if (!a.memory_per_rank.empty()) {
    limit = size_option("--memory-per-rank", a.memory_per_rank);
    if (limit <= 0) throw InputError("estimate --memory-per-rank " + echo(a.memory_per_rank) + ": expected a size above 0");
    for (int stage = 0; stage <= 3; ++stage) fits.push_back(what_fits(cfg, a.world_size, stage, limit));
  }
  if (!a.report.empty()) write_budget_report(a.report, cfg, a.world_size, budgets, fits, limit);
  nlohmann::json doc = {{"config", name}, {"world_size", a.world_size}, {"world_size_given", a.has("--world-size")},
                        {"configured_stage", cfg.zero.stage},
                        {"parameters", count_model(cfg.model).params},
                        {"dtypes", {{"params", dtype_name(cfg.precision.param)},
                                    {"grad_accum", dtype_name(cfg.precision.grad_accum)},
                                    {"communication", dtype_name(cfg.precision.comm)}}},
                        {"budgets", nlohmann::json::array()}};
  for (const auto& b : budgets) doc["budgets"].push_back(b.to_json());
  const RankLayout layout = rank_layout(cfg, a.world_size);
  doc["pipeline_stages"] = layout.stages;
  doc["tensor_parallel_size"] = layout.tensor;
  doc["data_parallel_size"] = layout.data;
  doc["ranks"] = nlohmann::json::array();  // every pipeline stage's budgets (tensor rank 0 stands for its group)
  for (int stage = 0; stage <= 3; ++stage) {
    const std::vector<MemoryBudget> per_rank = estimate_rank_budgets(cfg, a.world_size, stage);
    for (size_t s = 0; s < per_rank.size(); ++s) {
      if (stage == 0) doc["ranks"].push_back({{"pipe_stage", per_rank[s].pipe_stage},
                                              {"tensor_rank", per_rank[s].tensor_rank},
                                              {"budgets", nlohmann::json::array()}});
      doc["ranks"][s]["budgets"].push_back(per_rank[s].to_json());
    }
  }
  if (limit > 0) {
    doc["memory_per_rank"] = limit;
    for (const FitAnswer& f : fits) {
      doc["largest_micro_batch"].push_back(f.configured);
      doc["fits"].push_back(f.to_json());
    }
  }
  if (a.json) {
    std::printf("%s\n", doc.dump(2).c_str());
    return kExitOk;
  }
  std::printf("%s: %lld parameters, micro-batch %lld, %lld ranks = %d pipeline stages x %lld data-parallel x %d "
              "tensor-parallel (configured stage %lld), %s parameters, %s gradients, %s communication\n",
              name.c_str(), (long long)doc["parameters"].get<int64_t>(), (long long)cfg.batch.micro_batch,
              (long long)a.world_size, layout.stages, (long long)layout.data, layout.tensor, (long long)cfg.zero.stage,
              dtype_name(cfg.precision.param).c_str(), dtype_name(cfg.precision.grad_accum).c_str(),
              dtype_name(cfg.precision.comm).c_str());
  if (!a.has("--world-size"))  // without --world-size the budget is for one rank, and says so
    std::printf("(--world-size not given: the budget is for %lld rank(s); give --world-size N for N ranks in all)\n",
                (long long)a.world_size);
  std::printf("bytes per rank (the largest: pipeline stage, tensor rank)");
  for (const auto& b : budgets) std::printf("  stage %d: (%d, %d)", b.stage, b.pipe_stage, b.tensor_rank);
  std::printf("\n");
  std::printf("bytes per rank            %14s %14s %14s %14s\n", "stage 0", "stage 1", "stage 2", "stage 3");
  const char* rows[] = {"params", "grads", "master", "optimizer_states", "comm_reduce", "comm_gather", "comm_prefetch",
                        "live_params", "activations", "workspace", "runtime", "total"};
  for (const char* row : rows) {
    std::printf("%-25s", row);
    for (const auto& b : budgets) std::printf(" %s", mib(b.to_json()[row].get<int64_t>()).c_str());
    std::printf("\n");
  }
  const std::pair<const char*, int64_t MemoryBudget::*> alternatives[] = {
      {"(activations in host mem)", &MemoryBudget::activations_host},
      {"(activations, none)", &MemoryBudget::activations_none},
      {"(activations, selective)", &MemoryBudget::activations_selective},
      {"(activations, full)", &MemoryBudget::activations_checkpointed}};
  for (const auto& [label, field] : alternatives) {
    std::printf("%-25s", label);
    for (const auto& b : budgets) std::printf(" %s", mib(b.*field).c_str());
    std::printf("\n");
  }
  if (limit > 0) {
    std::printf("largest micro-batch within %s per rank:", a.memory_per_rank.c_str());
    for (int stage = 0; stage <= 3; ++stage) {
      const int64_t mb = doc["largest_micro_batch"][stage];
      if (mb > 0) {
        std::printf("  stage %d: %lld", stage, (long long)mb);
      } else {
        Config one = cfg;
        one.batch.micro_batch = 1;
        const MemoryBudget b = estimate_budget(one, a.world_size, stage);
        std::printf("  stage %d: none (model states alone %.1f MiB, total at micro-batch 1 %.1f MiB)", stage,
                    b.model_states() / 1048576.0, b.total() / 1048576.0);
      }
    }
    std::printf("\n");
    const long long mb = cfg.batch.micro_batch;
    for (const FitAnswer& f : fits) {
      const char* verdict = mb <= f.none        ? "fits without checkpointing"
                            : mb <= f.selective ? "needs checkpointing: selective recompute is enough"
                            : mb <= f.full      ? "needs checkpointing: full recompute"
                                                : "does not fit even with full recompute";
      std::printf("  stage %d: largest micro-batch without checkpointing %lld, selective %lld, full (interval 1) %lld; "
                  "micro-batch %lld %s\n",
                  f.stage, (long long)f.none, (long long)f.selective, (long long)f.full, mb, verdict);
    }
  }
  if (!a.report.empty()) std::printf("report  %s\n", a.report.c_str());
  return kExitOk;
}

// A failure's message for the user: allocation failures (std::bad_alloc, Kokkos's "Allocation
// of size … failed" over several lines) say so plainly in one line.
std::string failure_text(const std::string& what) {
  const bool kokkos = what.find("Allocation of size") != std::string::npos;
  if (!kokkos && what != std::bad_alloc().what() && what != std::bad_array_new_length().what()) return what;
  std::string line;
  for (char c : what) line += (c == '\n' || c == '\t') ? ' ' : c;
  return "out of memory: an allocation failed (" + echo(line, 240) + "); `zero3d estimate --config` shows what "
         "the run needs per rank";
}

}  // namespace

int main(int argc, char** argv) {
  supervise_rank(argv);  // failure.hpp: names this rank if it is killed; before MPI_Init
  // The watchdog thread may call MPI_Abort while the main thread waits in a collective.
  int thread_level = MPI_THREAD_SINGLE;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &thread_level);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  install_mpi_error_handler(MPI_COMM_WORLD);  // failure.hpp: an MPI error is one line, exit 1
  // Kokkos takes its settings from its environment variables only: given the command line it
  // would answer `--help` with its own 40-line banner before ours.
  int kokkos_argc = 1;
  Kokkos::initialize(kokkos_argc, argv);
  h5::quiet_errors();

  CLI::App app{"zero3d — DeepSpeed-style ZeRO training of GPT models, without Python", "zero3d"};
  app.set_version_flag("--version", std::string("zero3d ") + ZERO3D_VERSION);
  app.require_subcommand(1);

  ConfigArgs train_args, validate_args;
  std::string output_dir;
  int64_t world_size = world;
  auto* train = app.add_subcommand("train", "Train a model described by a DeepSpeed-style JSON config");
  train->add_option("config", train_args.path, "config file (default: the built-in quick-start)");
  train->add_option("--set", train_args.overrides, "override a key: --set optimizer.params.lr=1e-3")->take_all();
  const std::string strategy_help = "a Lightning DeepSpeed strategy preset beneath the config's keys (deepspeed, "
                                    "deepspeed_stage_1, _2, _2_offload, _3, _3_offload, _3_offload_nvme)";
  train->add_option("--strategy", train_args.strategy, strategy_help);
  train->add_option("--output", output_dir, "output directory (default: training.output_dir or output/<config name>)");
  ConfigArgs tune_args;
  int64_t tune_world = world;
  std::string tune_memory;
  auto* tune = app.add_subcommand("autotune", "DeepSpeed's autotuner on this job's ranks: writes results_dir, exps_dir "
                                              "and ds_config_optimal.json");
  tune->add_option("config", tune_args.path, "config file (its autotuning section)")->required();
  tune->add_option("--world-size", tune_world, "ranks in all: must be the job's (experiments run on them)")
      ->check(CLI::Range(int64_t(1), kMaxRanks));
  tune->add_option("--set", tune_args.overrides, "override a key")->take_all();
  tune->add_option("--strategy", tune_args.strategy, "a Lightning DeepSpeed strategy preset beneath the config's keys");
  tune->add_option("--memory-per-rank", tune_memory, "memory each rank may use (e.g. 4GiB; default: available memory "
                                                     "÷ ranks on the node): the planner prunes what does not fit");
  auto* validate = app.add_subcommand("validate", "Check a config without training; exit 0 or 2");
  validate->add_option("config", validate_args.path, "config file")->required();
  validate->add_option("--world-size", world_size, "ranks in all (pipeline stages x data-parallel x tensor-parallel) to check the config against")
      ->check(CLI::Range(int64_t(1), kMaxRanks));
  validate->add_option("--set", validate_args.overrides, "override a key")->take_all();
  validate->add_option("--strategy", validate_args.strategy, strategy_help);
  int64_t pp = 1, dp = 1, tp = 1;
  bool as_json = false;
  auto* topology = app.add_subcommand("topology", "Print each rank's coordinates and process groups");
  topology->add_option("--pp", pp, "pipeline-parallel size")->check(CLI::Range(int64_t(1), kMaxRanks));
  topology->add_option("--dp", dp, "data-parallel size")->check(CLI::Range(int64_t(1), kMaxRanks));
  topology->add_option("--tp", tp, "tensor-parallel size")->check(CLI::Range(int64_t(1), kMaxRanks));
  topology->add_flag("--json", as_json, "machine-readable output");

  std::string ck_dir, ck_tag, ck_tensor, ck_out, ck_format, ck_dtype = "fp32", ck_shard;
  bool ck_json = false;
  auto* inspect = app.add_subcommand("inspect", "Show a checkpoint's tags, metadata and tensors; verify checksums");
  inspect->add_option("dir", ck_dir, "checkpoint directory (save_dir or one tag)")->required();
  inspect->add_option("--tag", ck_tag, "tag to inspect (default: latest)");
  inspect->add_option("--tensor", ck_tensor, "only this tensor (Hugging Face name)");
  inspect->add_flag("--json", ck_json, "machine-readable output");
  ConfigArgs eval_args;
  std::string eval_checkpoint, eval_tag;
  bool eval_json = false;
  auto* eval = app.add_subcommand("eval", "Validation loss and perplexity of a checkpoint (data.validation)");
  eval->add_option("config", eval_args.path, "config file (its data.validation is evaluated)")->required();
  eval->add_option("--checkpoint", eval_checkpoint, "save directory (its latest tag) or tag directory; default: "
                                                    "the config's initial weights");
  eval->add_option("--tag", eval_tag, "tag in --checkpoint (default: latest)");
  eval->add_option("--set", eval_args.overrides, "override a key")->take_all();
  eval->add_flag("--json", eval_json, "end with one JSON line: step, eval_loss, eval_ppl, samples, tokens");
  auto* convert = app.add_subcommand("convert", "Consolidate a checkpoint into Hugging Face-named weights");
  convert->add_option("dir", ck_dir, "checkpoint directory (save_dir or one tag)")->required();
  convert->add_option("out", ck_out, "output file: .safetensors, .h5 or .hdf5 (config.json goes beside it)")->required();
  convert->add_option("--tag", ck_tag, "tag to convert (default: latest)");
  convert->add_option("--format", ck_format, "hdf5 or safetensors (default: from the output file's extension)")
      ->check(CLI::IsMember({"hdf5", "safetensors"}));
  convert->add_option("--dtype", ck_dtype, "fp32, bf16 or fp16")->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  convert->add_option("--max-shard-size", ck_shard, "split into files of at most this size (e.g. 5GB)");

  EstimateArgs est;
  est.world_size = world;
  auto* estimate = app.add_subcommand("estimate", "Memory per rank: DeepSpeed's tables (zero2/zero3) or a full budget");
  estimate->add_option("kind", est.kind, "zero2 or zero3 for DeepSpeed's model-state tables");
  estimate->add_option("--params", est.params, "total parameters (cold estimate)");
  estimate->add_option("--largest-layer-params", est.largest_layer, "parameters of the largest layer (zero3)");
  estimate->add_option("--gpus-per-node", est.gpus_per_node, "GPUs per node")->check(CLI::Range(1, int(kMaxRanks)));
  estimate->add_option("--nodes", est.nodes, "nodes")->check(CLI::Range(1, int(kMaxRanks)));
  estimate->add_option("--additional-buffer-factor", est.buffer_factor, "DeepSpeed's buffer factor (1.5)");
  estimate->add_option("--model", est.model, "take the counts from this config's model (live estimate)");
  estimate->add_option("--config", est.config.path, "the full per-rank budget of this configuration");
  estimate->add_option("--set", est.config.overrides, "override a key of --config (or of --model)")->take_all();
  estimate->add_option("--strategy", est.config.strategy, strategy_help);
  estimate->add_option("--world-size", est.world_size, "ranks in all (pipeline stages x data-parallel x tensor-parallel)")
      ->check(CLI::Range(int64_t(1), kMaxRanks));
  estimate->add_option("--memory-per-rank", est.memory_per_rank, "find the largest micro-batch that fits (e.g. 16GiB)");
  estimate->add_option("--report", est.report, "write the budget to this HDF5 file");
  estimate->add_flag("--json", est.json, "machine-readable output");

  int code = kExitOk;
  try {
    app.parse(argc, argv);
    for (const CLI::Option* o : estimate->get_options())
      if (o->count() > 0 && !o->get_name().empty() && o->get_name()[0] == '-') est.given.insert(o->get_name());
    if (train->parsed()) code = cmd_train(train_args, output_dir, MPI_COMM_WORLD);
    else if (validate->parsed()) code = cmd_validate(validate_args, world_size, MPI_COMM_WORLD);
    else if (tune->parsed())
      code = cmd_autotune(tune_args, tune_world, tune->count("--world-size") > 0, tune_memory, MPI_COMM_WORLD);
    else if (topology->parsed()) {
      // Under `mpirun -np N` the data-parallel size defaults to what the job's ranks leave.
      if (topology->count("--dp") == 0 && world > 1)
        run_collectively(MPI_COMM_WORLD, [&] {  // one message, from rank 0
          if (world % (pp * tp) != 0)
            throw InputError("topology: " + std::to_string(world) + " ranks do not divide into --pp " +
                             std::to_string(pp) + " x --tp " + std::to_string(tp));
          dp = world / (pp * tp);
        });
      code = cmd_topology(pp, dp, tp, as_json, rank);
    }
    else if (estimate->parsed()) code = cmd_estimate(est, rank);
    else if (inspect->parsed()) code = cmd_inspect(ck_dir, ck_tag, ck_tensor, ck_json, rank);
    else if (eval->parsed()) code = cmd_eval(eval_args, eval_checkpoint, eval_tag, eval_json, MPI_COMM_WORLD);
    else if (convert->parsed())
      code = cmd_convert(ck_dir, ck_out, ck_tag, ck_format, ck_dtype, ck_shard, rank);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with exit code 0 in CLI11.
    if (rank == 0) {
      // CLI11 echoes the offending argument raw: escape and cap it like every other message.
      // A mistyped command reaches CLI11 as a stray positional: name it and the commands.
      const bool unknown_command = argc > 1 && argv[1][0] != '-' && app.get_subcommands().empty();
      if (e.get_exit_code() == 0) app.exit(e);
      else if (unknown_command) {
        std::string names;
        for (const CLI::App* sub : app.get_subcommands({})) names += (names.empty() ? "" : ", ") + sub->get_name();
        std::fprintf(stderr, "zero3d: error: unknown command `%s` (commands: %s; see --help)\n",
                     echo(argv[1], 80).c_str(), names.c_str());
      } else std::fprintf(stderr, "zero3d: error: %s (see --help)\n", echo(e.what(), 300).c_str());
    }
    code = e.get_exit_code() == 0 ? kExitOk : kExitBadInput;
  } catch (const AgreedFailure& e) {
    // Every rank knows; one reports. (Bad config: all ranks fail alike and rank 0 reports.)
    if (e.report()) {
      const char* kind = e.code() == kExitBadInput ? "error" : "fatal";
      const std::string what = failure_text(e.what());
      if (e.failed_rank() == 0) std::fprintf(stderr, "zero3d: %s: %s\n", kind, what.c_str());
      else std::fprintf(stderr, "zero3d: rank %d: %s: %s\n", e.failed_rank(), kind, what.c_str());
    }
    code = e.code();
  } catch (const std::exception& e) {
    // Not agreed: the other ranks may be waiting for this one, so take the job down.
    const bool bad_input = dynamic_cast<const InputError*>(&e) != nullptr;
    code = bad_input ? kExitBadInput : kExitSystem;
    std::fprintf(stderr, "zero3d: rank %d: %s: %s\n", rank, bad_input ? "error" : "fatal", failure_text(e.what()).c_str());
    std::fflush(stderr);
    if (world > 1) {
      // Give the launcher a moment to forward the message before it tears the job down.
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      MPI_Abort(MPI_COMM_WORLD, code);
    }
  }
  std::fflush(stdout);
  Kokkos::finalize();
  MPI_Finalize();
  return code;
}
