// topology.cpp
#include "parallel/topology.hpp"

#include <algorithm>
#include <stdexcept>

#include "base/errors.hpp"
#include "base/failure.hpp"

namespace zero3d {

ProcessTopology::ProcessTopology(std::vector<std::string> axes, std::vector<int> dims)
    : axes_(std::move(axes)), dims_(std::move(dims)) {
  if (axes_.size() != dims_.size()) throw std::invalid_argument("ProcessTopology: axes and dims differ in length");
  for (int d : dims_) {
    if (d < 1) throw std::invalid_argument("ProcessTopology: every dimension must be >= 1");
    world_size_ *= d;
  }
}

ProcessTopology ProcessTopology::pipe_data_model(int pp, int dp, int tp) {
  return ProcessTopology({"pipe", "data", "model"}, {pp, dp, tp});
}

int ProcessTopology::axis_index(const std::string& axis) const {
  for (size_t i = 0; i < axes_.size(); ++i)
    if (axes_[i] == axis) return static_cast<int>(i);
  return -1;
}

int ProcessTopology::get_dim(const std::string& axis) const {
  int i = axis_index(axis);
  return i < 0 ? 0 : dims_[i];
}

int ProcessTopology::get_rank(const Coord& coord) const {
  if (coord.size() != axes_.size()) throw std::invalid_argument("get_rank: give a coordinate for every axis");
  int rank = 0;
  for (size_t i = 0; i < axes_.size(); ++i) {
    auto it = coord.find(axes_[i]);
    if (it == coord.end()) throw std::invalid_argument("get_rank: missing axis " + axes_[i]);
    if (it->second < 0 || it->second >= dims_[i]) throw std::invalid_argument("get_rank: coordinate out of range");
    rank = rank * dims_[i] + it->second;
  }
  return rank;
}

ProcessTopology::Coord ProcessTopology::get_coord(int rank) const {
  if (rank < 0 || rank >= world_size_) throw std::invalid_argument("get_coord: rank out of range");
  Coord c;
  for (size_t i = axes_.size(); i-- > 0;) {
    c[axes_[i]] = rank % dims_[i];
    rank /= dims_[i];
  }
  return c;
}

std::vector<std::vector<int>> ProcessTopology::get_axis_comm_lists(const std::string& axis) const {
  const int a = axis_index(axis);
  if (a < 0) return {};
  // Ranks are row-major over all axes, so iterating ranks in order and skipping those with a
  // non-zero coordinate along `axis` visits the other-axis combinations in row-major order.
  std::vector<std::vector<int>> lists;
  for (int r = 0; r < world_size_; ++r) {
    Coord c = get_coord(r);
    if (c[axis] != 0) continue;
    std::vector<int> group;
    for (int k = 0; k < dims_[a]; ++k) {
      c[axis] = k;
      group.push_back(get_rank(c));
    }
    lists.push_back(group);
  }
  return lists;
}

std::vector<int> ProcessTopology::filter_match(const Coord& filter) const {
  std::vector<int> out;
  for (int r = 0; r < world_size_; ++r) {
    const Coord c = get_coord(r);
    bool match = true;
    for (const auto& [axis, value] : filter) {
      auto it = c.find(axis);
      if (it == c.end() || it->second != value) match = false;
    }
    if (match) out.push_back(r);
  }
  return out;
}

std::vector<int> ProcessTopology::get_axis_list(const std::string& axis, int idx) const {
  if (axis_index(axis) < 0) return {};
  return filter_match({{axis, idx}});
}

std::string ProcessTopology::get_rank_repr(int rank, const std::vector<std::string>& omit_axes,
                                           const std::string& inner_sep, const std::string& outer_sep) const {
  const Coord c = get_coord(rank);
  std::string out;
  for (const std::string& axis : axes_) {
    bool omit = false;
    for (const auto& o : omit_axes) omit = omit || o == axis;
    if (omit) continue;
    char num[16];
    std::snprintf(num, sizeof(num), "%02d", c.at(axis));
    out += (out.empty() ? "" : outer_sep) + axis + inner_sep + num;
  }
  return out;
}

ProcessGroups::ProcessGroups(const ProcessTopology& topology, MPI_Comm world, int ep_size, DataShards shards)
    : topology_(topology), world_(world) {
  int size = 0;
  MPI_Comm_rank(world, &rank_);
  MPI_Comm_size(world, &size);
  if (size != topology.world_size())
    throw InputError("topology needs " + std::to_string(topology.world_size()) + " ranks but the job has " +
                     std::to_string(size));
  for (const std::string& axis : topology.get_axis_names()) {
    const auto lists = topology.get_axis_comm_lists(axis);
    int color = 0, key = 0;
    for (size_t g = 0; g < lists.size(); ++g)
      for (size_t k = 0; k < lists[g].size(); ++k)
        if (lists[g][k] == rank_) color = static_cast<int>(g), key = static_cast<int>(k);
    MPI_Comm comm;
    if (MPI_Comm_split(world, color, key, &comm) != MPI_SUCCESS) throw SystemError("MPI_Comm_split failed for " + axis);
    comms_[axis] = comm;
  }
  const ProcessTopology::Coord me = topology.get_coord(rank_);
  const int pipes = std::max(1, topology.get_dim("pipe")), tp = std::max(1, topology.get_dim("model"));
  const int pipe = me.count("pipe") ? me.at("pipe") : 0, data = me.count("data") ? me.at("data") : 0,
            model = me.count("model") ? me.at("model") : 0;
  MPI_Comm mp, emb;
  if (MPI_Comm_split(world, data, rank_, &mp) != MPI_SUCCESS) throw SystemError("MPI_Comm_split failed for model_parallel");
  comms_["model_parallel"] = mp;
  const bool ends = pipe == 0 || pipe == pipes - 1;
  if (MPI_Comm_split(world, ends ? data * tp + model : MPI_UNDEFINED, pipe, &emb) != MPI_SUCCESS)
    throw SystemError("MPI_Comm_split failed for embedding");
  comms_["embedding"] = emb;
  const int dp = std::max(1, topology.get_dim("data"));
  if (ep_size < 1 || dp % ep_size != 0)
    throw InputError("ep_size " + std::to_string(ep_size) + " does not divide the data-parallel size (" +
                     std::to_string(dp) + ")");
  const int stage_group = pipe * tp + model;  // one (pipe, model) index: the data group expert groups are cut from
  MPI_Comm ep, edp, enorm;
  if (MPI_Comm_split(world, stage_group * dp + data / ep_size, data % ep_size, &ep) != MPI_SUCCESS ||
      MPI_Comm_split(world, stage_group * dp + data % ep_size, data / ep_size, &edp) != MPI_SUCCESS ||
      MPI_Comm_split(world, data / ep_size, rank_, &enorm) != MPI_SUCCESS)
    throw SystemError("MPI_Comm_split failed for the expert groups");
  comms_["expert"] = ep;
  comms_["expert_data"] = edp;
  comms_["expert_norm"] = enorm;
  nodes_ = NodeMap(world);
  build_data_shards(shards, dp, data, stage_group);
}

void ProcessGroups::build_data_shards(const DataShards& shards, int dp, int data, int stage_group) {
  const auto split = [&](MPI_Comm parent, int color, int key, const char* name) {
    MPI_Comm c;
    if (MPI_Comm_split(parent, color, key, &c) != MPI_SUCCESS) throw SystemError(std::string("MPI_Comm_split failed for ") + name);
    comms_[name] = c;
    return c;
  };
  const int base = stage_group * dp;  // one data group's colours
  if (shards.mics_shard > 0) {
    const int s = shards.mics_shard;
    if (dp % s != 0)
      throw InputError("mics_shard_size " + std::to_string(s) + " does not divide the data-parallel size (" +
                       std::to_string(dp) + ")");
    const MPI_Comm shard = split(world_, base + data / s, data % s, "mics_shard");
    split(world_, base + data % s, data / s, "mics_replicate");
    if (shards.mics_hierarchical) {
      // DeepSpeed (mics_utils.py): the shard group is cut into its nodes' consecutive runs of k
      // ranks, and asserts that it spans more than one node.
      const std::vector<int> nodes = nodes_.nodes_of(shard);
      const int me = data % s;
      const int k = static_cast<int>(std::count(nodes.begin(), nodes.end(), nodes[static_cast<size_t>(me)]));
      int regular = s % k == 0 && s / k > 1 ? 1 : 0;
      for (int i = 0; i < s && regular; ++i)
        regular = nodes[static_cast<size_t>(i)] == nodes[static_cast<size_t>(i / k * k)] &&
                  (i < k || nodes[static_cast<size_t>(i)] != nodes[static_cast<size_t>(i - k)]);
      int all = regular;
      MPI_Allreduce(&regular, &all, 1, MPI_INT, MPI_MIN, world_);
      if (!all)  // agreed by every rank: one message, from rank 0
        throw AgreedFailure("zero_optimization.mics_hierarchical_params_gather: each MiCS shard group (mics_shard_size " +
                         std::to_string(s) + ") must span more than one node, in runs of the same number of "
                         "consecutive ranks per node (DeepSpeed asserts it; nodes: " + nodes_.describe() + ")",
                         kExitBadInput, 0, rank_ == 0);
      split(shard, me / k, me % k, "mics_intra");
      split(shard, me % k, me / k, "mics_inter");
    }
  }
  if (shards.hpz > 1) {
    if (dp % shards.hpz != 0)
      throw InputError("zero_hpz_partition_size " + std::to_string(shards.hpz) +
                       " does not divide the data-parallel size (" + std::to_string(dp) + ")");
    split(world_, base + data / shards.hpz, data % shards.hpz, "hpz");
  }
  if (shards.qgz) {
    // DeepSpeed's qgZ needs the same number of ranks on every node (num_nodes = W / device_count)
    // and falls back to its reduce-scatter on one node (stage3.py: num_nodes > 1).
    const std::vector<int> nodes = nodes_.nodes_of(comms_.at("data"));
    const int k = static_cast<int>(std::count(nodes.begin(), nodes.end(), nodes[static_cast<size_t>(data)]));
    int regular = dp % k == 0 ? 1 : 0;
    for (int i = 0; i < dp && regular; ++i)
      regular = nodes[static_cast<size_t>(i)] == nodes[static_cast<size_t>(i / k * k)] &&
                (i < k || nodes[static_cast<size_t>(i)] != nodes[static_cast<size_t>(i - k)]);
    int all = regular;
    MPI_Allreduce(&regular, &all, 1, MPI_INT, MPI_MIN, world_);
    if (!all)
      throw AgreedFailure("zero_optimization.zero_quantized_gradients: qgZ's all-to-alls need the data group's ranks "
                          "on its nodes in runs of the same number of consecutive ranks (DeepSpeed derives the nodes "
                          "as world size / devices per node; nodes: " + nodes_.describe() + ")",
                          kExitBadInput, 0, rank_ == 0);
    if (k < dp) {
      split(comms_.at("data"), data / k, data % k, "qgz_intra");
      split(comms_.at("data"), data % k, data / k, "qgz_inter");
    }
  }
}

ProcessGroups::~ProcessGroups() {
  for (auto& [axis, comm] : comms_)
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
}

MPI_Comm ProcessGroups::axis(const std::string& name) const {
  auto it = comms_.find(name);
  if (it == comms_.end()) throw std::invalid_argument("no process group for axis " + name);
  return it->second;
}

}  // namespace zero3d
