// shard_groups.hpp — the groups MiCS and ZeRO++'s hpZ add to ZeRO-3 (FACTS-2 §3.6; DeepSpeed
// zero/mics.py, zero/partition_parameters.py), as the ZeRO optimizer receives them.
//
// MiCS (mics_shard_size s): the optimizer's data group is the shard group of s ranks, over which
// parameters, gradients and moments are partitioned; the R = W/s shard groups are replicas of
// each other. Gradients are reduce-scattered in the shard group, then (at the accumulation
// boundary) all-reduced over `replicas`, divided by W = s·R in all (DeepSpeed's
// allreduce_mics_shard_grads divides by R before its all-reduce). mics_hierarchical_params_gather:
// a gather first crosses nodes inside `gather_inter` (the shard's ranks at this rank's position
// on each of its n nodes), then gathers the n slices each rank holds inside `gather_intra` (its
// node's k ranks): inter-node bytes per rank (n−1)/n of n slices instead of (s−1)/s of the unit.
//
// hpZ (zero_hpz_partition_size h): the first gather of a unit in a step crosses the whole data
// group and leaves each rank its slice of the unit split h ways (the secondary partition);
// backward gathers read those slices inside `hpz`, h consecutive data ranks (a node). The
// slices are stale after the step's update and gathered afresh in the next step.
#pragma once

#include "config/config.hpp"
#include "parallel/comm.hpp"
#include "parallel/topology.hpp"

namespace zero3d {

struct ShardGroups {
  Communicator* replicas = nullptr;      // MiCS: the ranks holding the same shard (null: one replica)
  Communicator* gather_inter = nullptr;  // MiCS hierarchical gather (null: the flat gather)
  Communicator* gather_intra = nullptr;
  Communicator* hpz = nullptr;  // hpZ's secondary partition group (null: none)
  // qgZ's all-to-all groups (parallel/quantized_reduce_scatter.hpp; null: unquantised reduce-scatter)
  Communicator* qgz_intra = nullptr;
  Communicator* qgz_inter = nullptr;
  int replica_count() const { return replicas ? replicas->size() : 1; }
};

// The groups ProcessGroups builds for a config's MiCS and hpZ keys.
inline DataShards data_shards(const ZeroConfig& z) {
  return {z.mics_shard_size, z.mics_hierarchical_params_gather, z.hpz_partition_size, z.quantized_gradients};
}

}  // namespace zero3d
