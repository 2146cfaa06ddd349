// autotune.cpp — the autotuner (autotune.hpp): experiments built as DeepSpeed configs, pruned
// by the memory planner, measured in-process, ranked by autotuning.metric.
#include "train/autotune.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>

#include "base/errors.hpp"
#include "base/failure.hpp"
#include "base/input_file.hpp"
#include "config/config.hpp"
#include "model/model.hpp"
#include "parallel/comm.hpp"
#include "parallel/nodes.hpp"
#include "parallel/topology.hpp"
#include "train/engine.hpp"
#include "zero/shard_groups.hpp"

namespace zero3d {

namespace fs = std::filesystem;
using json = nlohmann::json;

AutotuneMemory autotune_memory(int64_t memory_per_rank, const AvailableMemory& avail, int ranks_here) {
  if (memory_per_rank > 0) return {memory_per_rank, "--memory-per-rank"};
  if (avail.bytes >= 0)
    return {avail.bytes / std::max(1, ranks_here),
            avail.source + " shared by " + std::to_string(ranks_here) + " rank(s) on this node"};
  return {-1, "available memory unknown: nothing is pruned"};
}

bool autotuning_enabled(const json& root) {
  if (!root.is_object() || !root.contains("autotuning")) return false;
  const json& a = root["autotuning"];
  return a.is_object() && a.contains("enabled") && a["enabled"] == true;
}

namespace {

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / 1048576.0);
  return buf;
}

// zero_optimization.stage as DeepSpeed's autotuner reads it: a number, a list of them or
// "all"; absent: every stage (the search this command exists for).
std::vector<int> stages_to_tune(const json& root, const std::string& file) {
  const json* z = root.contains("zero_optimization") && root["zero_optimization"].is_object() &&
                          root["zero_optimization"].contains("stage")
                      ? &root["zero_optimization"]["stage"]
                      : nullptr;
  if (!z || (z->is_string() && *z == "all")) return {0, 1, 2, 3};
  const std::string bad = file + ": `zero_optimization.stage`: with autotuning, expected 0-3, a list of them or "
                                 "\"all\", got " + echo(z->dump(), 60);
  std::set<int> out;
  for (const json& s : z->is_array() ? *z : json::array({*z})) {
    if (!s.is_number_integer() || s.get<int64_t>() < 0 || s.get<int64_t>() > 3) throw InputError(bad);
    out.insert(s.get<int>());
  }
  if (out.empty()) throw InputError(bad);
  return {out.begin(), out.end()};
}

// The user's config as one experiment's base: the first stage to tune, batch keys a reader
// accepts (absent or "auto" micro-batch: 1, as the autotuner's own first run).
json normalized_base(json root, int stage) {
  root["zero_optimization"]["stage"] = stage;
  for (const char* key : {"train_batch_size", "gradient_accumulation_steps"})
    if (root.contains(key) && root[key] == "auto") root.erase(key);
  const char* micro = "train_micro_batch_size_per_gpu";
  if (!root.contains(micro) || root[micro] == "auto") {
    if (!root.contains("train_batch_size")) root[micro] = 1;
    else root.erase(micro);
  }
  return root;
}

json with_batch(json j, int64_t micro, int64_t gas, int64_t dp) {
  j["train_micro_batch_size_per_gpu"] = micro;
  j["gradient_accumulation_steps"] = gas;
  j["train_batch_size"] = micro * gas * dp;
  return j;
}

struct Space {
  int stage, pipe, tensor;
  bool checkpointing;
  std::string name;
  json config;  // without batch keys' final values
};

const char* outcome_name(ExperimentOutcome o) {
  switch (o) {
    case ExperimentOutcome::Measured: return "measured";
    case ExperimentOutcome::Pruned: return "pruned";
    case ExperimentOutcome::Invalid: return "invalid";
    case ExperimentOutcome::Failed: return "failed";
    case ExperimentOutcome::NotRun: return "not run";
  }
  return "";
}

// Rank 0 writes; directory failures become InputError naming the autotuning key.
void make_dir(const std::string& path, const std::string& key) {
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) throw InputError("autotuning." + key + " " + echo(path, 200) + ": cannot create it (" + ec.message() + ")");
}

void write_json(const std::string& path, const json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) throw SystemError("cannot write " + path);
}

// num_nodes: the nodes the job's ranks lie on, as the experiment was planned (per_node a node).
json exp_json(const Experiment& e, int64_t world, int64_t per_node, const AutotuneMemory& memory) {
  const int64_t nodes = (world + std::max<int64_t>(1, per_node) - 1) / std::max<int64_t>(1, per_node);
  json j = {{"name", e.name}, {"ds_config", e.ds_config}, {"num_gpus", world}, {"num_nodes", nodes}, {"hostfile", nullptr},
            {"tuning_space", e.space}, {"outcome", outcome_name(e.outcome)}, {"planned_bytes_per_rank", e.planned_bytes},
            {"memory_per_rank", memory.bytes_per_rank}, {"memory_source", memory.source}};
  if (!e.why.empty()) j["why"] = e.why;
  return j;
}

// Redirects this process's stdout into `path` while an experiment runs (DeepSpeed keeps each
// experiment's output in results_dir/<exp>/stdout.log).
class StdoutTo {
 public:
  explicit StdoutTo(const std::string& path) {
    std::fflush(stdout);
    saved_ = ::dup(1);
    FILE* f = std::fopen(path.c_str(), "w");
    if (f) {
      ::dup2(::fileno(f), 1);
      std::fclose(f);
    }
  }
  ~StdoutTo() {
    std::fflush(stdout);
    if (saved_ >= 0) {
      ::dup2(saved_, 1);
      ::close(saved_);
    }
  }

 private:
  int saved_ = -1;
};

// Trains start_profile_step … end_profile_step steps of one experiment; every rank returns the
// slowest rank's step times.
// The bytes the planner gives an experiment, asked of the allocator on every rank before its
// engine starts: a size this machine refuses outright fails that experiment alone (DeepSpeed's
// experiments run as processes, and one that fails to allocate is recorded and passed over).
// Agreed before any collective of the engine, so every rank passes it over together.
bool can_allocate(int64_t bytes, MPI_Comm world) {
  std::exception_ptr refused;
  void* p = bytes > 0 ? std::malloc(static_cast<size_t>(bytes)) : nullptr;
  if (bytes > 0 && !p) refused = std::make_exception_ptr(SystemError("cannot allocate"));
  std::free(p);
  try {
    agree_on_failure(world, refused);
  } catch (const AgreedFailure&) {
    return false;
  }
  return true;
}

void measure(Experiment& e, const AutotuningConfig& at, MPI_Comm world, MpiCommunicator& comm,
             const std::string& log_path, int64_t ranks_per_node) {
  Config cfg = resolve_config(e.ds_config, e.name, comm.size(), {}, ranks_per_node);
  // An experiment writes nothing and resumes nothing: it is timed, then dropped.
  cfg.training.steps = at.end_profile_step;
  cfg.training.save_interval = 0;
  cfg.training.resume.clear();
  cfg.training.eval_interval = 0;
  cfg.observability = ObservabilityConfig{};
  std::vector<double> ms;
  {
    std::unique_ptr<StdoutTo> redirect;
    if (comm.rank() == 0) redirect = std::make_unique<StdoutTo>(log_path);
    // ZeRO's shard groups as train builds them (MiCS, hpZ, qgZ's node groups): the experiment
    // runs what its plan priced.
    ProcessGroups groups(ProcessTopology::pipe_data_model(e.pipe, comm.size() / (e.pipe * e.tensor), e.tensor), world,
                         static_cast<int>(cfg.model.moe.ep_size), data_shards(cfg.zero));
    Engine engine(cfg, groups, "");
    for (int64_t s = 1; s <= at.end_profile_step; ++s) {
      const StepResult r = engine.train_step();
      if (s >= at.start_profile_step) ms.push_back(r.elapsed_ms);
    }
  }
  comm.all_reduce(ms.data(), int64_t(ms.size()), DType::F64, ReduceOp::Max);
  e.step_ms = ms;
  e.latency_ms = std::accumulate(ms.begin(), ms.end(), 0.0) / double(ms.size());
  e.throughput = double(e.train_batch_size) * 1e3 / e.latency_ms;
  const ModelConfig& m = cfg.model;
  const GPTShape shape = gpt_shape_of(m);
  const double flops_per_step =  // active parameters: k experts per token in MoE blocks
      gpt_flops_per_token(shape, gpt_active_params(shape, m.moe.k)) * double(e.train_batch_size) * double(m.n_positions);
  e.flops_per_rank = flops_per_step / (e.latency_ms / 1e3) / double(comm.size());
  e.metric = at.metric == "latency" ? e.latency_ms : at.metric == "flops" ? e.flops_per_rank : e.throughput;
  e.outcome = ExperimentOutcome::Measured;
}

std::string fixed(double v, int digits) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string summary_text(const AutotuneResult& r, const AutotuneMemory& memory) {
  const bool lower = r.metric == "latency";
  std::string s = "| tuning_space | num_experiments | best_metric_val | best_exp_name |\n"
                  "|:-------------|----------------:|----------------:|:--------------|\n";
  std::vector<std::string> spaces;
  for (const Experiment& e : r.experiments)
    if (std::find(spaces.begin(), spaces.end(), e.space) == spaces.end()) spaces.push_back(e.space);
  for (const std::string& sp : spaces) {
    int n = 0, best = -1;
    for (size_t i = 0; i < r.experiments.size(); ++i) {
      const Experiment& e = r.experiments[i];
      if (e.space != sp || e.outcome != ExperimentOutcome::Measured) continue;
      ++n;
      if (best < 0 || (lower ? e.metric < r.experiments[best].metric : e.metric > r.experiments[best].metric))
        best = int(i);
    }
    s += "| " + sp + " | " + std::to_string(n) + " | " + (best < 0 ? "-" : fixed(r.experiments[best].metric, 2)) +
         " | " + (best < 0 ? "-" : r.experiments[best].name) + " |\n";
  }
  s += "\n| exp_name | outcome | planned per rank | latency ms | samples/s | GFLOPS per rank |\n"
       "|:---------|:--------|-----------------:|-----------:|----------:|----------------:|\n";
  for (const Experiment& e : r.experiments) {
    const bool m = e.outcome == ExperimentOutcome::Measured;
    s += "| " + e.name + " | " + outcome_name(e.outcome) + (e.why.empty() ? "" : " (" + e.why + ")") + " | " +
         (e.outcome == ExperimentOutcome::Invalid ? "-" : mib(double(e.planned_bytes))) + " | " +
         (m ? fixed(e.latency_ms, 2) : "-") + " | " + (m ? fixed(e.throughput, 2) : "-") + " | " +
         (m ? fixed(e.flops_per_rank / 1e9, 3) : "-") + " |\n";
  }
  s += "\nmetric " + r.metric + (r.metric == "throughput" ? " (samples/s, higher is better)"
                                 : lower                  ? " (optimizer-step ms, lower is better)"
                                                          : " (model FLOPs per rank per second, higher is better)");
  s += "; memory per rank " + (memory.bytes_per_rank < 0 ? std::string("unknown") : mib(double(memory.bytes_per_rank))) +
       " (" + memory.source + ")\n";
  if (r.best >= 0)
    s += "best " + r.experiments[r.best].name + ": " + fixed(r.experiments[r.best].metric, 2) + "; optimal config " +
         r.optimal_path + "\n";
  s += "Tuning completed in " + fixed(r.seconds, 1) + " s. Total number of experiments: " +
       std::to_string(r.experiments.size()) + ".\n";
  return s;
}

}  // namespace

AutotuneResult autotune(const json& root, const std::string& file, MPI_Comm world, const AutotuneMemory& memory) {
  const auto t0 = std::chrono::steady_clock::now();
  MpiCommunicator comm(world);
  const int64_t size = comm.size();
  const bool writer = comm.rank() == 0;
  // Every experiment is planned on the nodes its engine will find (qgZ's staging is sized by them).
  const int64_t per_node = planned_ranks_per_node(world);
  std::vector<int> stages;
  Config base_cfg;
  run_collectively(world, [&] {  // a bad config: one message, from rank 0
    if (!root.is_object()) throw InputError(file + ": expected a JSON object");
    stages = stages_to_tune(root, file);
    base_cfg = resolve_config(normalized_base(root, stages.front()), file, size, {}, per_node);
  });
  const AutotuningConfig& at = base_cfg.autotuning;
  const int64_t user_gas = base_cfg.batch.gradient_accumulation_steps;

  AutotuneResult r;
  r.metric = at.metric;
  r.results_dir = at.results_dir;
  r.exps_dir = at.exps_dir;
  run_collectively(world, [&] {
    if (!writer) return;
    if (at.overwrite)
      for (const std::string& d : {at.results_dir, at.exps_dir}) fs::remove_all(d);
    make_dir(at.results_dir, "results_dir");
    make_dir(at.exps_dir, "exps_dir");
  });

  // The tuning spaces: fast tunes ZeRO stage × micro-batch in the configured layout (DeepSpeed's
  // fast mode); otherwise every pipeline × tensor size the ranks allow, checkpointing off and on.
  std::vector<std::pair<int, int>> layouts;
  std::vector<bool> checkpointing;
  if (at.fast) {
    layouts.push_back({base_cfg.pipeline.stages, base_cfg.tensor.size});
    checkpointing.push_back(base_cfg.activation_checkpointing.enabled());
  } else {
    for (int p = 1; p <= size; ++p)
      for (int t = 1; p * t <= size; ++t)
        if (size % (p * t) == 0) layouts.push_back({p, t});
    checkpointing = {false, true};
  }
  json user = root;
  user.erase("autotuning");  // each experiment is one run; the optimal config trains without tuning
  std::vector<Space> spaces;
  for (int z : stages)
    for (const auto& [p, t] : layouts)
      for (bool ck : checkpointing) {
        Space s{z, p, t, ck, "z" + std::to_string(z), normalized_base(user, z)};
        if (!at.fast) {
          s.config["pipeline"]["stages"] = p;
          s.config["tensor_parallel"]["autotp_size"] = t;
          if (ck != base_cfg.activation_checkpointing.enabled())
            s.config["pipeline"]["activation_checkpoint_interval"] = ck ? 1 : 0;
          s.name += "_pp" + std::to_string(p) + "_tp" + std::to_string(t) + (ck ? "_ckpt" : "");
        }
        spaces.push_back(std::move(s));
      }

  // Experiments, each priced by the planner before anything runs.
  const int64_t budget = memory.bytes_per_rank;
  for (const Space& sp : spaces) {
    const int64_t dp = size / (int64_t(sp.pipe) * sp.tensor);
    auto add = [&](int64_t micro, int64_t gas) {
      Experiment e;
      e.space = sp.name;
      e.stage = sp.stage, e.pipe = sp.pipe, e.tensor = sp.tensor, e.checkpointing = sp.checkpointing;
      gas = std::max<int64_t>(gas, (at.min_train_batch_size + micro * dp - 1) / (micro * dp));
      e.micro_batch = micro, e.gas = gas, e.train_batch_size = micro * gas * dp;
      e.name = "z" + std::to_string(sp.stage) + "_gas" + std::to_string(gas) + "_tmbspg" + std::to_string(micro) +
               sp.name.substr(std::to_string(sp.stage).size() + 1);
      for (const Experiment& o : r.experiments)
        if (o.name == e.name) return;
      e.ds_config = with_batch(sp.config, micro, gas, dp);
      try {
        const Config c = resolve_config(e.ds_config, e.name, size, {}, per_node);
        e.planned_bytes = estimate_budget(c, size, sp.stage, per_node).total();
        e.outcome = budget >= 0 && e.planned_bytes > budget ? ExperimentOutcome::Pruned : ExperimentOutcome::NotRun;
      } catch (const InputError& err) {
        e.outcome = ExperimentOutcome::Invalid;
        e.why = echo(err.what(), 300);
      }
      r.experiments.push_back(std::move(e));
    };
    const int64_t lo = at.min_train_micro_batch_size_per_gpu;
    int64_t hi = at.max_train_micro_batch_size_per_gpu;
    if (at.max_train_batch_size > 0) hi = std::min(hi, std::max<int64_t>(1, at.max_train_batch_size / dp));
    int64_t fit = hi;  // the planner's largest micro-batch within the budget
    bool valid = true;
    try {
      const Config c = resolve_config(with_batch(sp.config, lo, user_gas, dp), sp.name, size, {}, per_node);
      if (budget >= 0) fit = std::min(hi, largest_fitting_micro_batch(c, size, sp.stage, budget, per_node));
    } catch (const InputError&) {
      valid = false;  // the first experiment records why; the space has no other
    }
    add(lo, user_gas);  // DeepSpeed's first run: the smallest micro-batch at the configured GAS
    if (!valid || fit < lo || hi < lo) continue;
    // DeepSpeed's tuning list below the largest fitting micro-batch M: from max(min, M/2) in
    // num_tuning_micro_batch_sizes strides, then M; GAS = M·GAS_user ÷ mbs keeps the batch near.
    const int64_t top = fit, from = std::max(lo, top / 2);
    const int64_t stride = std::max<int64_t>(1, (top - from) / at.num_tuning_micro_batch_sizes);
    const int64_t per_rank = at.max_train_batch_size > 0 ? at.max_train_batch_size / dp : top * user_gas;
    for (int64_t m = from; m < top; m += stride) add(m, std::max<int64_t>(1, per_rank / m));
    add(top, std::max<int64_t>(1, per_rank / top));
    // DeepSpeed probes 5% past its memory estimate; the planner prices the probe and prunes it.
    const int64_t probe = std::max<int64_t>(top + 1, int64_t(std::ceil(1.05 * double(top))));
    if (probe <= hi) add(probe, std::max<int64_t>(1, per_rank / probe));
  }

  // The tuner's order: gridsearch as generated; random shuffled by training.seed; model_based
  // by the planner's cost model (largest micro-batch first, then fewer bytes moved per sample:
  // lower ZeRO stage, fewer model-parallel ranks, no recomputation).
  std::vector<size_t> order(r.experiments.size());
  std::iota(order.begin(), order.end(), size_t(0));
  if (at.tuner_type == "random") {
    std::mt19937_64 rng(base_cfg.training.seed);
    std::shuffle(order.begin(), order.end(), rng);
  } else if (at.tuner_type == "model_based") {
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const Experiment &x = r.experiments[a], &y = r.experiments[b];
      return std::make_tuple(-x.micro_batch, x.stage, x.pipe * x.tensor, x.checkpointing) <
             std::make_tuple(-y.micro_batch, y.stage, y.pipe * y.tensor, y.checkpointing);
    });
  }
  const bool lower = at.metric == "latency";
  int trials = 0, best_trial = -1;
  std::vector<Experiment> considered;
  for (size_t idx : order) {
    Experiment& e = r.experiments[idx];
    const std::string dir = at.results_dir + "/" + e.name;
    if (e.outcome == ExperimentOutcome::NotRun) {
      if (trials >= at.tuner_num_trials) e.why = "tuner_num_trials reached";
      else if (best_trial >= 0 && trials >= best_trial + at.tuner_early_stopping)
        e.why = "early stop: " + std::to_string(at.tuner_early_stopping) + " trials without improvement";
    }
    const bool run = e.outcome == ExperimentOutcome::NotRun && e.why.empty();
    run_collectively(world, [&] {
      if (!writer) return;
      make_dir(dir, "results_dir");
      write_json(dir + "/ds_config.json", e.ds_config);
      if (run) write_json(at.exps_dir + "/" + e.name + ".json", exp_json(e, size, per_node, memory));
    });
    if (run && !can_allocate(e.planned_bytes, world)) {
      e.outcome = ExperimentOutcome::Failed;
      e.why = "cannot allocate the planned " + mib(double(e.planned_bytes)) + " per rank";
      ++trials;
      if (writer) std::printf("autotune %s: failed: %s\n", e.name.c_str(), e.why.c_str());
    } else if (run) {
      if (writer) std::printf("autotune %s: running %lld steps (profiling %lld-%lld)\n", e.name.c_str(),
                              (long long)at.end_profile_step, (long long)at.start_profile_step,
                              (long long)at.end_profile_step);
      std::fflush(stdout);
      measure(e, at, world, comm, dir + "/stdout.log", per_node);
      ++trials;
      const Experiment* best = r.best < 0 ? nullptr : &r.experiments[r.best];
      if (!best || (lower ? e.metric < best->metric : e.metric > best->metric)) {
        r.best = int(idx);
        best_trial = trials - 1;
      }
      if (writer) {
        std::printf("autotune %s: %.2f ms per step, %.2f samples/s, %.3f GFLOPS per rank\n", e.name.c_str(),
                    e.latency_ms, e.throughput, e.flops_per_rank / 1e9);
        write_json(dir + "/metrics.json", {{"latency", e.latency_ms},
                                           {"throughput", e.throughput},
                                           {"FLOPS_per_gpu", e.flops_per_rank},
                                           {"step_ms", e.step_ms},
                                           {"profiled_steps", {at.start_profile_step, at.end_profile_step}},
                                           {"metric", at.metric},
                                           {"metric_value", e.metric}});
      }
    } else if (writer && e.outcome == ExperimentOutcome::Pruned) {
      std::printf("autotune %s: pruned: the planner needs %s per rank, more than %s\n", e.name.c_str(),
                  mib(double(e.planned_bytes)).c_str(), mib(double(budget)).c_str());
    }
    if (writer) write_json(dir + "/exp.json", exp_json(e, size, per_node, memory));
    considered.push_back(e);
  }
  const int best_index = r.best;
  r.experiments = std::move(considered);  // in the tuner's order
  if (best_index >= 0)
    r.best = int(std::find(order.begin(), order.end(), size_t(best_index)) - order.begin());
  r.optimal_path = at.results_dir + "/ds_config_optimal.json";
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (r.best >= 0) r.optimal = r.experiments[r.best].ds_config;
  r.summary = summary_text(r, memory);
  run_collectively(world, [&] {
    if (!writer) return;
    std::printf("%s", r.summary.c_str());
    std::ofstream(at.results_dir + "/summary.txt") << r.summary;
    if (r.best < 0) return;
    write_json(r.optimal_path, r.optimal);
    std::ofstream(at.results_dir + "/cmd_optimal.txt")
        << "mpiexec -np " << size << " zero3d train " << r.optimal_path << "\n";
  });
  if (r.best < 0) run_collectively(world, [&] {
    const Experiment* smallest = nullptr;
    int failed = 0;
    for (const Experiment& e : r.experiments) {
      failed += e.outcome == ExperimentOutcome::Failed;
      if ((e.outcome == ExperimentOutcome::Pruned || e.outcome == ExperimentOutcome::Failed) &&
          (!smallest || e.planned_bytes < smallest->planned_bytes))
        smallest = &e;
    }
    throw InputError(file + ": autotuning: no experiment fits " +
                     (budget < 0 ? std::string("this machine") : mib(double(budget))) + " per rank" +
                     (failed > 0 ? " (" + std::to_string(failed) + " could not allocate their planned memory)" : "") +
                     (smallest ? "; the smallest, " + smallest->name + ", needs " +
                                     mib(double(smallest->planned_bytes)) + " (zero3d estimate --config)"
                               : std::string("")));
  });
  return r;
}

}  // namespace zero3d
