// topology.hpp — DeepSpeed's ProcessTopology (runtime/pipe/topology.py; FACTS §8.1): pure
// rank <-> coordinate arithmetic over named axes, row-major (the last axis varies fastest).
//
// Worked example: axes [pipe, data, model], dims [2, 2, 2] (8 ranks)
//   rank 5 = (pipe 1, data 0, model 1); get_axis_comm_lists("pipe") = [[0,4],[1,5],[2,6],[3,7]];
//   data groups [[0,2],[1,3],[4,6],[5,7]]; model (tensor) groups [[0,1],[2,3],[4,5],[6,7]].
//
// ProcessGroups turns one topology into MPI communicators, one per axis, for this rank.
#pragma once

#include <mpi.h>

#include <map>
#include <string>
#include <vector>

#include "parallel/nodes.hpp"

namespace zero3d {

class ProcessTopology {
 public:
  using Coord = std::map<std::string, int>;

  ProcessTopology(std::vector<std::string> axes, std::vector<int> dims);

  // pipe/data/model topology with model fastest, then data (PipeModelDataParallelTopology).
  static ProcessTopology pipe_data_model(int pp, int dp, int tp);

  int world_size() const { return world_size_; }
  const std::vector<std::string>& get_axis_names() const { return axes_; }
  const std::vector<int>& dims() const { return dims_; }
  int get_dim(const std::string& axis) const;  // 0 for an unknown axis
  // Every axis must be given (std::invalid_argument otherwise).
  int get_rank(const Coord& coord) const;
  Coord get_coord(int rank) const;
  // For every combination of the other axes (row-major), the ranks varying along `axis`.
  std::vector<std::vector<int>> get_axis_comm_lists(const std::string& axis) const;
  // Ranks whose coordinates match every given axis value, in rank order.
  std::vector<int> filter_match(const Coord& filter) const;
  std::vector<int> get_axis_list(const std::string& axis, int idx) const;
  std::string get_rank_repr(int rank, const std::vector<std::string>& omit_axes = {"data", "pipe"},
                            const std::string& inner_sep = "_", const std::string& outer_sep = "-") const;

 private:
  int axis_index(const std::string& axis) const;  // -1 if unknown
  std::vector<std::string> axes_;
  std::vector<int> dims_;
  int world_size_ = 1;
};

// One MPI communicator per topology axis, for the calling rank (built with MPI_Comm_split),
// and the derived groups Megatron's ProcessGroupCollection names: "model_parallel" (every
// rank with this rank's data index: pipe × model; grad norm and overflow) and "embedding"
// (the first and last pipeline stage at this rank's data and model index: the tied wte;
// MPI_COMM_NULL on the stages between). With MoE (DeepSpeed utils/groups.py
// _create_expert_and_data_parallel, FACTS-2 §4.5) the data group of each (pipe, model) index is
// cut into "expert" groups of ep_size consecutive data ranks (tokens move by all-to-all inside
// one) and strided "expert_data" groups (ranks holding the same experts: their gradients are
// reduced there); "expert_norm" joins the ranks at one expert_data position across expert,
// pipe and model ranks (with the expert_data sum, every expert gradient once: the grad norm).
// ZeRO's groups inside each data group (DeepSpeed zero/mics_utils.py create_mics_comm_groups and
// utils/groups.py _create_zero_param_parallel_group; FACTS-2 §3.6), by data rank d:
//  * "mics_shard": d / mics_shard (consecutive ranks hold one copy of the model states between
//    them), "mics_replicate": d % mics_shard (the ranks holding the same shard);
//  * with mics_hierarchical, inside each shard group that spans n nodes of k ranks each,
//    "mics_intra" (the shard's ranks on this node) and "mics_inter" (the shard's ranks at this
//    rank's position on every node): the gather crosses nodes in the smaller group first;
//  * "hpz": d / hpz, hpZ's secondary partition group;
//  * with qgz, when the data group spans more than one node (k ranks on each, consecutively):
//    "qgz_intra" (the data group's ranks on this node, ranked by position) and "qgz_inter" (its
//    ranks at this position on every node, ranked by node), DeepSpeed's local_<node> and
//    global_<position> (utils/groups.py _get_local_all_to_all_group).
// Groups not asked for (mics_shard 0, hpz 1, qgz false, or qgz on one node) are not built.
struct DataShards {
  int mics_shard = 0;
  bool mics_hierarchical = false;
  int hpz = 1;
  bool qgz = false;
};

// Owned here and handed out by name; nothing is global. nodes(): which ranks share a node.
class ProcessGroups {
 public:
  ProcessGroups(const ProcessTopology& topology, MPI_Comm world, int ep_size = 1, DataShards shards = {});
  ~ProcessGroups();
  ProcessGroups(const ProcessGroups&) = delete;
  ProcessGroups& operator=(const ProcessGroups&) = delete;

  const ProcessTopology& topology() const { return topology_; }
  MPI_Comm world() const { return world_; }
  // "data", "model", "pipe", "model_parallel", "embedding", "expert", "expert_data", "expert_norm"
  MPI_Comm axis(const std::string& name) const;
  bool has(const std::string& name) const { return comms_.count(name) > 0; }
  const NodeMap& nodes() const { return nodes_; }
  MPI_Comm data_parallel() const { return axis("data"); }
  int rank() const { return rank_; }
  ProcessTopology::Coord coord() const { return topology_.get_coord(rank_); }

 private:
  ProcessTopology topology_;
  MPI_Comm world_;
  int rank_ = 0;
  std::map<std::string, MPI_Comm> comms_;
  NodeMap nodes_;
  void build_data_shards(const DataShards& shards, int dp, int data, int stage_group);
};

}  // namespace zero3d
