// estimator.hpp — memory estimates before a job runs.
//
// 1. DeepSpeed's model-state estimators, reproduced to the digit (DEEPSPEED-FACTS §6:
//    zero/stage_1_and_2.py and zero/stage3.py): GiB = 2^30, the 1.5 buffer factor, row order.
// 2. zero3d's complete per-rank budget for one configuration: every category the engine
//    allocates (model states byte for byte as ZeroOptimizer counts them, communication
//    buffers, gathered parameters, activations, workspace, the process's fixed runtime), so
//    the total predicts the measured peak resident memory.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/config.hpp"
#include "config/model_shape.hpp"
#include "kernels/device.hpp"
#include "model/model.hpp"
#include "zero/zero.hpp"

namespace zero3d {

// --- DeepSpeed's cold estimators ---------------------------------------------------------------
struct DeepSpeedEstimateRow {
  double cpu_bytes, gpu_bytes;
  std::string options;
};

// estimate_zero2_model_states_mem_needs_all_cold: rows offload_optimizer=cpu, then none.
std::vector<DeepSpeedEstimateRow> deepspeed_zero2_rows(double params, int gpus_per_node, int nodes,
                                                       double buffer_factor = 1.5);
// estimate_zero3_model_states_mem_needs_all_cold: the six rows in DeepSpeed's order.
std::vector<DeepSpeedEstimateRow> deepspeed_zero3_rows(double params, double largest_layer, int gpus_per_node,
                                                       int nodes, double buffer_factor = 1.5);
// The printed table, exactly as DeepSpeed prints it (largest_layer < 0: the ZeRO-2 header).
std::string deepspeed_table(const std::vector<DeepSpeedEstimateRow>& rows, double params, double largest_layer,
                            int gpus_per_node, int nodes);

// Parameter count and largest layer (params of one module: weight + bias) of a GPT config; with
// MoE the parameters a token meets (k of each block's E experts), as the FLOPs count them.
struct ModelCounts {
  int64_t params = 0, active_params = 0, largest_layer = 0;
  std::string largest_layer_name;
};
ModelCounts count_model(const ModelConfig& model);

// How a config's MoE blocks route (model.moe; the expert group is the engine's to attach); the
// model itself is gpt_shape_of's (config/model_shape.hpp).
MoeRouting moe_routing_of(const MoeConfig& moe, uint64_t seed);

// The element types the engine hands a ZeroOptimizer over `layout` (the dense model's, or the
// experts'): the configured dtypes, and torch_autocast's tensors.
StateTypes state_types_of(const Config& cfg, const ParamLayout& layout);

// ZeRO++'s qgZ as ProcessGroups places it for `dp` data ranks on nodes of `ranks_per_node`
// (0: every rank on one node): on at stage 3 with zero_quantized_gradients when the data group
// spans more than one node; off (DeepSpeed's plain reduce-scatter) otherwise.
struct QgzPlacement {
  int nodes = 1, per_node = 1;
  bool on() const { return nodes > 1; }
  int64_t world() const { return on() ? int64_t(per_node) * nodes : 0; }  // gradient_segments' qgz_world
};
QgzPlacement qgz_placement(const ZeroConfig& zero, int stage, int64_t dp, int64_t ranks_per_node);

// --- the complete budget -------------------------------------------------------------------------
struct MemoryBudget {
  kernels::Backend backend = kernels::kBuildBackend;  // the build it is planned for (Config::backend)
  int stage = 0;
  int pipe_stage = 0, tensor_rank = 0;  // the rank this budget is for (pipeline stage, tensor rank)
  int64_t micro_batch = 0;
  int in_flight = 1;  // micro-batches whose activations the rank's schedule holds at once
  // bytes per rank
  int64_t params = 0, grads = 0, master = 0, optimizer_states = 0;
  // Offload: of the model states above, the bytes in host memory (device cpu: on a CPU-only build
  // the same memory, so counted in the total) plus a GPU build's page-locked stages of the offloaded
  // optimizer (counted in the workspace), and the bytes in swap files instead (not counted).
  int64_t offload_host = 0, offload_nvme = 0;
  int64_t offload_nvme_params = 0;  // of offload_nvme, the stage-3 parameters' (offload_param nvme)
  int64_t comm_reduce = 0;    // gradient buckets, reduce-scatter staging, fp32 gradient windows, qgZ's staging
  int64_t comm_gather = 0;    // stage 3: the unit being gathered for use (the largest)
  int64_t comm_prefetch = 0;  // stage 3: units gathered ahead along the fetch trace (prefetch_bucket_size)
  int64_t live_params = 0;    // stage 3: further gathered units kept for reuse (max_live_parameters)
  // Activations under the configured checkpointing (every in-flight buffer and the shared
  // workspaces, gpt_activation_plan), of them in host memory (cpu_checkpointing; on a CPU
  // build the same memory, so counted in the total); and the same with no checkpointing,
  // selective recompute, and full recompute of every block (interval 1), for comparison.
  int64_t activations = 0, activations_host = 0;
  int64_t activations_none = 0, activations_selective = 0, activations_checkpointed = 0;
  int64_t workspace = 0;                                        // startup sgemm, token buffers, init staging
  int64_t runtime = 0;                                          // MPI, Kokkos, BLAS, libraries: measured constant
  int64_t model_states() const { return params + grads + master + optimizer_states; }
  int64_t total() const {
    return model_states() + comm_reduce + comm_gather + comm_prefetch + live_params + activations + workspace + runtime;
  }
  // What stays in device memory: the total less what offload and cpu_checkpointing put in host
  // memory (the same memory on a CPU-only build, so the total counts both).
  int64_t host_total() const { return offload_host + activations_host; }
  int64_t device_total() const { return total() - host_total(); }
  // What each memory must hold for this rank. A CPU build's host and device memory are one
  // memory, which holds the total; on a GPU build the device holds device_total() and the host
  // the offload tiers and host checkpoints plus the process's runtime (the start-up checks, the
  // end-of-run comparison against the device's measured peak, and estimate's --memory-per-rank).
  bool gpu() const { return backend == kernels::Backend::Gpu; }
  int64_t device_need() const { return gpu() ? device_total() : total(); }
  int64_t host_need() const { return gpu() ? host_total() + runtime : total(); }
  nlohmann::json to_json() const;
};

// How `world_size` ranks in all factor: pipeline stages × data-parallel ranks × tensor ranks.
struct RankLayout {
  int stages = 1, tensor = 1;
  int64_t data = 1;
};
RankLayout rank_layout(const Config& cfg, int64_t world_size);
// "8 ranks = 2 pipeline stages x 2 data-parallel x 2 tensor-parallel": how estimate and
// validate name a layout.
std::string layout_text(const RankLayout& layout, int64_t world_size);

// The budget of every pipeline stage of `cfg` on `world_size` ranks in all (the data-parallel
// size is world ÷ (pipeline.stages × tensor_parallel.autotp_size)) at ZeRO `stage` (cfg's own
// if < 0), in stage order. Model states are what that rank's ZeroOptimizer allocates (its
// local layout: tensor slices, vocabulary padding, the tied wte copy of a last stage; the
// partition the largest stage's), activations what its schedule's buffers and the backward
// scratch take. Tensor ranks of one stage hold equal sizes: each entry is tensor rank 0's (data
// rank 0's where data ranks differ: qgZ's blocks). ranks_per_node: nodes of that many ranks (0:
// every rank on one node), which decide whether qgZ runs.
std::vector<MemoryBudget> estimate_rank_budgets(const Config& cfg, int64_t world_size, int stage = -1,
                                                int64_t ranks_per_node = 0);
// The largest of them (by total; ties: the lowest stage): the budget per rank.
MemoryBudget estimate_budget(const Config& cfg, int64_t world_size, int stage = -1, int64_t ranks_per_node = 0);

// The offloaded optimizer's page-locked host stages over a partition of `elems` state elements at
// ZeRO `stage` (offload::host_stage_bytes in cfg's types and placement), which the budgets count
// in host memory with host_is_device = this build's (none on a CPU build); 0 without offload.
int64_t offload_stage_bytes(const Config& cfg, int stage, int64_t elems, bool host_is_device);

// A GPU build's start-up check, before any model memory exists: `ranks_on_device` ranks each
// planning `plan_bytes` (the budget's total) share a device with `free_bytes` free. Empty when
// they fit; otherwise the message naming the shortfall and what lowers the plan.
std::string device_memory_shortfall(int64_t plan_bytes, int ranks_on_device, int64_t free_bytes,
                                    const std::string& device);

// Largest micro-batch per stage whose total fits `bytes_per_rank` on every rank (0: not even
// micro-batch 1). world_size, ranks_per_node: the ranks in all and on each node, as for
// estimate_budget (the node layout decides qgZ's staging). checkpointing: plan with this
// activation checkpointing instead of cfg's.
int64_t largest_fitting_micro_batch(const Config& cfg, int64_t world_size, int stage, int64_t bytes_per_rank,
                                    int64_t ranks_per_node);
int64_t largest_fitting_micro_batch(const Config& cfg, int64_t world_size, int stage, int64_t bytes_per_rank,
                                    int64_t ranks_per_node, const ActivationCheckpointing& checkpointing);

// "What fits" in bytes_per_rank at one ZeRO stage: the largest micro-batch under the configured
// checkpointing, without any, with selective and with full recompute (interval 1), and whether
// the configured micro-batch needs checkpointing (fits with it, not without).
struct FitAnswer {
  int stage = 0;
  int64_t configured = 0, none = 0, selective = 0, full = 0;
  bool configured_fits = false, needs_checkpointing = false;
  nlohmann::json to_json() const;
};
// ranks_per_node: as for estimate_budget (0: every rank on one node).
FitAnswer what_fits(const Config& cfg, int64_t world_size, int stage, int64_t bytes_per_rank, int64_t ranks_per_node);

// Memory this process may use: /proc/meminfo's MemAvailable, or the cgroup's remaining
// limit where that is lower. bytes < 0: unknown (the check is skipped).
struct AvailableMemory {
  int64_t bytes = -1;
  std::string source;  // "MemAvailable" or "cgroup memory limit"
};
AvailableMemory available_memory();
// A GPU build's memory per rank for the "auto" micro-batch: the device's total memory shared by
// the ranks of a node that map to one device (ranks_here ranks over `visible` devices, round robin).
int64_t device_bytes_per_rank(int64_t device_total, int visible, int64_t ranks_here);

// read_config, then the one value config/ leaves to the memory planner: a
// train_micro_batch_size_per_gpu "auto" that nothing derives becomes the largest micro-batch that
// fits this machine's available memory shared by `world_size` ranks (a GPU build whose device has
// started: the device's memory shared by the ranks on it, device_bytes_per_rank), at most Hugging Face's
// default of 8, with the notes and resolved keys that say so; planned on nodes of
// `ranks_per_node` ranks (0: one node), as check_memory_fits then checks it. Every command that
// trains, checks or sizes a config reads it through here. backend: the build planned for
// (Config::backend; a GPU's from a CPU build knows no device memory: Hugging Face's default).
// memory_per_rank > 0: the memory each rank has, given (estimate --memory-per-rank), in place of
// this machine's or the device's.
Config resolve_config(const nlohmann::json& root, const std::string& file, int64_t world_size,
                      const std::vector<std::string>& set_keys = {}, int64_t ranks_per_node = 0,
                      kernels::Backend backend = kernels::kBuildBackend, int64_t memory_per_rank = 0);

// The start-up memory check: the budget of `cfg` at its configured stage on nodes of
// `ranks_per_node` ranks (the run's layout: planned_ranks_per_node, parallel/nodes.hpp; 0: one
// node), times the ranks sharing this machine, against `avail`. InputError naming the shortfall
// and the keys that drive the largest categories when it does not fit. Returns the per-rank
// budget: byte for byte the plan the engine prints and checks at the end.
MemoryBudget check_memory_fits(const Config& cfg, int ranks_here, const AvailableMemory& avail,
                               int64_t ranks_per_node);

// Writes the budgets (one per stage) to an HDF5 report: inputs as attributes, one dataset per
// category holding the bytes at stages 0..3.
// fits (optional, one per stage): the --memory-per-rank answers, written as largest_micro_batch
// and its companions.
void write_budget_report(const std::string& path, const Config& cfg, int64_t world_size,
                         const std::vector<MemoryBudget>& budgets, const std::vector<FitAnswer>& fits = {},
                         int64_t bytes_per_rank = 0);

}  // namespace zero3d
