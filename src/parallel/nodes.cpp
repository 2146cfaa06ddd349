// nodes.cpp
#include "parallel/nodes.hpp"

#include <algorithm>
#include <cstdlib>
#include <set>

#include "base/errors.hpp"
#include "base/failure.hpp"

namespace zero3d {

int emulated_ranks_per_node() {
  const char* v = std::getenv("ZERO3D_RANKS_PER_NODE");
  if (!v || !*v) return 0;
  char* end = nullptr;
  const long k = std::strtol(v, &end, 10);
  if (*end != '\0' || k < 1 || k > (1 << 24))
    throw InputError("ZERO3D_RANKS_PER_NODE=" + std::string(v) + ": expected a positive number of ranks per emulated node");
  return static_cast<int>(k);
}

NodeMap::NodeMap(MPI_Comm world) : world_(world) {
  int rank = 0, size = 1;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &size);
  try {
    emulated_ = zero3d::emulated_ranks_per_node();  // the environment's, not the member
  } catch (const InputError& e) {  // every rank reads the same environment: one message, from rank 0
    throw AgreedFailure(e.what(), kExitBadInput, 0, rank == 0);
  }
  int node = 0;
  if (emulated_ > 0) {
    node = rank / emulated_;
  } else {
    // A node is named by its first rank in world.
    MPI_Comm shared;
    MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &shared);
    MPI_Group g, w;
    MPI_Comm_group(shared, &g);
    MPI_Comm_group(world, &w);
    const int first = 0;
    MPI_Group_translate_ranks(g, 1, &first, w, &node);
    MPI_Group_free(&g);
    MPI_Group_free(&w);
    MPI_Comm_free(&shared);
  }
  node_of_.resize(static_cast<size_t>(size));
  MPI_Allgather(&node, 1, MPI_INT, node_of_.data(), 1, MPI_INT, world);
  // Renumber nodes 0, 1, ... in order of their first rank.
  std::vector<int> firsts(node_of_);
  std::sort(firsts.begin(), firsts.end());
  firsts.erase(std::unique(firsts.begin(), firsts.end()), firsts.end());
  for (int& n : node_of_) n = static_cast<int>(std::lower_bound(firsts.begin(), firsts.end(), n) - firsts.begin());
  nodes_ = static_cast<int>(firsts.size());
}

int NodeMap::ranks_per_node() const {
  return static_cast<int>(std::count(node_of_.begin(), node_of_.end(), 0));
}

int planned_ranks_per_node(MPI_Comm world) {
  const NodeMap nodes(world);
  // Emulated: k itself, so that a plan for more ranks than this job has (validate --world-size)
  // still places k a node; the planners cap it at the data-parallel size (qgz_placement).
  return nodes.emulated_ranks_per_node() > 0 ? nodes.emulated_ranks_per_node() : nodes.ranks_per_node();
}

std::vector<int> NodeMap::nodes_of(MPI_Comm comm) const {
  MPI_Group g, w;
  int n = 0;
  MPI_Comm_group(comm, &g);
  MPI_Comm_group(world_, &w);
  MPI_Group_size(g, &n);
  std::vector<int> ranks(static_cast<size_t>(n)), in_world(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ranks[static_cast<size_t>(i)] = i;
  MPI_Group_translate_ranks(g, n, ranks.data(), w, in_world.data());
  MPI_Group_free(&g);
  MPI_Group_free(&w);
  std::vector<int> out;
  for (int r : in_world) {
    if (r == MPI_UNDEFINED) throw std::logic_error("NodeMap: a group holds a rank outside the job's world");
    out.push_back(node_of(r));
  }
  return out;
}

bool NodeMap::within_one_node(MPI_Comm comm) const {
  if (comm == MPI_COMM_NULL || node_of_.empty()) return true;
  const std::vector<int> nodes = nodes_of(comm);
  return std::set<int>(nodes.begin(), nodes.end()).size() <= 1;
}

std::string NodeMap::describe() const {
  std::string s = std::to_string(nodes_) + (nodes_ == 1 ? " node" : " nodes");
  if (emulated_ > 0) s += " (emulated: ZERO3D_RANKS_PER_NODE=" + std::to_string(emulated_) + ")";
  return s;
}

}  // namespace zero3d
