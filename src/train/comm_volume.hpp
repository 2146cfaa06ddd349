// comm_volume.hpp — the bytes one optimizer step moves over rank 0's groups, predicted
// from the config before a run (`zero3d estimate --config`, issue 34's bytes per step by link).
//
// Rank 0's tensor and pipeline axes carry the activations: Megatron's all-reduces, all-gathers
// and reduce-scatters of each micro-batch and the sends between pipeline stages. With MoE, the
// expert axis carries each MoE block's token all-to-alls and the expert-data axis the experts'
// own ZeRO traffic.
//
// The count is the communicator's: nccl-tests' bus bytes (all-reduce 2(W−1)/W·n, reduce-scatter
// and all-gather (W−1)/W·n, each call rounded down), of rank 0 (pipeline stage 0, tensor rank 0),
// which is what metrics.jsonl reports as comm_bytes_by_axis. The collectives are ZeroOptimizer's,
// cut as it cuts them (reduce_work's buckets, simulate_gathers' fetch decisions, the all-gather
// buckets of stages 1-2, MiCS's and hpZ's groups) so a prediction equals the measured step.
// A group is intra-node when all its ranks share a node (nodes.hpp); ranks fill nodes in order,
// `ranks_per_node` each.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/config.hpp"

namespace zero3d {

struct GroupBytes {
  std::string axis;   // metrics.jsonl's name: data (with the tied wte's embedding group), mics_shard, mics_replicate, ...
  int ranks = 1;      // the group's size
  bool intra_node = true;
  int64_t bytes = 0;  // bus bytes per step
  int64_t calls = 0;  // collectives per step (the α of an α–β time model)
  void add(int64_t b, int64_t n = 1) {
    bytes += b;
    calls += n;
  }
};

struct CommVolume {
  int stage = 0;
  std::vector<GroupBytes> groups;
  // Set when some of the tensor axis's exchanges depend on the data (the reason), so its bytes
  // are the others' only: a lower bound.
  std::string activations_not_predicted;
  // Set when the expert axis's all-to-alls carry rows that routing decides (the reason): its
  // bytes are then the fixed exchanges only (a lower bound), and expert_bound the most the
  // axis can move, every expert receiving all it may keep.
  std::string expert_not_predicted;
  int64_t expert_bound = 0;
  int64_t intra_node() const;
  int64_t inter_node() const;
  nlohmann::json to_json() const;
};

// What the optimizer makes of one step's data-parallel traffic: whether the engine reduces the
// gradients (DeepSpeed's enable_backward_allreduce) and what a 1-bit optimizer all-reduces
// compressed (compressed_allreduce.hpp), named by the optimizer's phase.
struct OptimizerTraffic {
  enum class OneBit { None, EachTensor, AllTensors };  // OneBitAdam/ZeroOneAdam per tensor; OneBitLamb one flat buffer
  std::string phase = "every step";
  bool gradients_reduced = true;
  OneBit onebit = OneBit::None;
};

// The traffic of optimizer steps first..last (1-based, as metrics.jsonl counts them while no
// step is skipped on overflow), each step's phase replayed from the optimizer's own schedule
// (onebit.hpp): the 1-bit optimizers' initialisation step, warm-up and freeze; 0/1 Adam's
// variance updates, compressed-gradient steps and local steps with their synchronisations.
std::vector<OptimizerTraffic> optimizer_traffic(const OptimizerConfig& cfg, int64_t first, int64_t last);
// A 1-bit optimizer's compressed steps (OneBitAdam, OneBitLamb past the freeze).
OptimizerTraffic compressed_traffic(const OptimizerConfig& cfg);

// The data-parallel groups' bytes of one step of `cfg` on `world` ranks at ZeRO `stage`, nodes of
// `ranks_per_node` ranks, the optimizer's part as `traffic` says (default: every gradient reduced).
CommVolume estimate_comm_volume(const Config& cfg, int64_t world, int stage, int64_t ranks_per_node,
                                const OptimizerTraffic& traffic = {});

// Steps first..last of the configured stage: each phase's bytes per step and how many steps it
// has, in the order the phases first appear, and the step `step`'s own volume.
struct StepRangeVolume {
  struct Phase {
    OptimizerTraffic traffic;
    int64_t steps = 0;
    CommVolume volume;  // per step of this phase
  };
  int64_t first = 1, last = 1, step = 1;
  std::string step_phase;
  CommVolume step_volume;
  std::vector<Phase> phases;
  int64_t total_intra_node() const;
  int64_t total_inter_node() const;
  nlohmann::json to_json() const;
};
StepRangeVolume estimate_step_range(const Config& cfg, int64_t world, int64_t ranks_per_node, int64_t step,
                                    int64_t first, int64_t last);

}  // namespace zero3d
