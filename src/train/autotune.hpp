// autotune.hpp — DeepSpeed's autotuner (DEEPSPEED-FACTS §10) in-process: the memory planner
// prunes ZeRO stage × micro-batch (× pipeline × tensor sizes × activation checkpointing when
// `autotuning.fast` is false) before anything runs, each surviving experiment trains
// start_profile_step … end_profile_step steps on the job's own ranks (an Engine per experiment,
// no re-launch, so it works under srun), and DeepSpeed's results_dir / exps_dir layout is
// written with the best configuration as results_dir/ds_config_optimal.json.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/estimator.hpp"

namespace zero3d {

// The memory each rank may plan for: --memory-per-rank, else the machine's available memory
// shared by the ranks on it (as train's start-up check), else unknown (nothing is pruned).
struct AutotuneMemory {
  int64_t bytes_per_rank = -1;  // < 0: unknown
  std::string source;
};
AutotuneMemory autotune_memory(int64_t memory_per_rank, const AvailableMemory& avail, int ranks_here);

// Failed: the experiment could not run (its planned memory cannot be allocated); tuning goes on
// without it, as DeepSpeed's autotuner goes on past an experiment that fails.
enum class ExperimentOutcome { Measured, Pruned, Invalid, Failed, NotRun };

struct Experiment {
  std::string name;           // z{stage}_gas{G}_tmbspg{mbs}[_pp{p}][_tp{t}][_ckpt]
  std::string space;          // the tuning space: z{stage}[_pp{p}][_tp{t}][_ckpt]
  nlohmann::json ds_config;   // the user's config with this experiment's keys, without `autotuning`
  int stage = 0, pipe = 1, tensor = 1;
  bool checkpointing = false;
  int64_t micro_batch = 1, gas = 1, train_batch_size = 1;
  int64_t planned_bytes = 0;  // the planner's per-rank total (the largest rank's budget)
  ExperimentOutcome outcome = ExperimentOutcome::NotRun;
  std::string why;            // Invalid: the config reader's message; NotRun: trial limit or early stop
  // Measured (the slowest rank's step times, so every rank ranks alike)
  double latency_ms = 0.0;    // mean optimizer-step time over the profiled steps
  double throughput = 0.0;    // samples/s: train_batch_size / latency
  double flops_per_rank = 0.0;  // model FLOPs per rank per second
  std::vector<double> step_ms;
  double metric = 0.0;        // the value of autotuning.metric (latency: lower is better)
};

struct AutotuneResult {
  std::vector<Experiment> experiments;  // in the order the tuner considered them
  int best = -1;                        // index of the best measured experiment
  std::string metric;
  nlohmann::json optimal;  // the best ds_config (what ds_config_optimal.json holds)
  std::string optimal_path, results_dir, exps_dir;
  double seconds = 0.0;
  std::string summary;  // the table rank 0 prints and writes to results_dir/summary.txt
};

// True when `root` says "autotuning": {"enabled": true} (train then tunes first).
bool autotuning_enabled(const nlohmann::json& root);

// Collective over `world` (every rank of the job). `root` is the user's config after --set
// (zero_optimization.stage may be a number, a list or "all"; the batch keys may be absent or
// "auto"); `file` names it in messages. Rank 0 writes the files and prints the summary.
// InputError for a bad config or when no experiment fits.
AutotuneResult autotune(const nlohmann::json& root, const std::string& file, MPI_Comm world,
                        const AutotuneMemory& memory);

}  // namespace zero3d
