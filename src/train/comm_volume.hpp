// comm_volume.hpp — the bytes one optimizer step moves over the data-parallel groups, predicted
// from the config before a run (`zero3d estimate --config`, issue 34's bytes per step by link).
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
  int64_t intra_node() const;
  int64_t inter_node() const;
  nlohmann::json to_json() const;
};

// The data-parallel groups' bytes of one step of `cfg` on `world` ranks at ZeRO `stage`, nodes of
// `ranks_per_node` ranks. `compressed`: a 1-bit optimizer past its freeze (OneBitAdam,
// OneBitLamb: the momentum through the compressed all-reduce); otherwise its warm-up.
CommVolume estimate_comm_volume(const Config& cfg, int64_t world, int stage, int64_t ranks_per_node,
                                bool compressed = false);

}  // namespace zero3d
