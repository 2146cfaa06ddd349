// nodes.hpp — which ranks share a node (ZeRO++'s hpZ and MiCS place their groups by it, and
// byte counts split by the link a group's collectives cross).
//
// A node is the ranks MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) puts together, or, when the
// environment sets ZERO3D_RANKS_PER_NODE=k, every k consecutive ranks of the job (emulated
// nodes: the hierarchical paths run and are tested on one machine). A group whose ranks all lie
// on one node moves intra-node bytes; any other group's collectives cross the slower inter-node
// link (a ring is as slow as its slowest link), so all their bytes count as inter-node.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

namespace zero3d {

class NodeMap {
 public:
  NodeMap() = default;
  // Collective over world: every rank's node (real, or emulated from ZERO3D_RANKS_PER_NODE).
  explicit NodeMap(MPI_Comm world);
  int nodes() const { return nodes_; }
  int node_of(int world_rank) const { return node_of_[static_cast<size_t>(world_rank)]; }
  // The emulated ranks per node (0: real nodes from MPI_COMM_TYPE_SHARED).
  int emulated_ranks_per_node() const { return emulated_; }
  // The ranks of the first node (nodes fill in rank order: each node's count where they are even,
  // as qgZ requires), for the planners that place groups on nodes.
  int ranks_per_node() const;
  // Whether every rank of `comm` (a group of world's ranks) lies on one node. Local (no messages).
  bool within_one_node(MPI_Comm comm) const;
  // Every rank's node, of the ranks of `comm` in comm's rank order. Local.
  std::vector<int> nodes_of(MPI_Comm comm) const;
  // "2 nodes (emulated: ZERO3D_RANKS_PER_NODE=2)" or "1 node"
  std::string describe() const;

 private:
  MPI_Comm world_ = MPI_COMM_NULL;
  std::vector<int> node_of_;  // per rank of world_
  int nodes_ = 1, emulated_ = 0;
};

// ZERO3D_RANKS_PER_NODE as a positive integer; 0 when unset. InputError when malformed.
int emulated_ranks_per_node();

// The ranks per node the memory planners (check_memory_fits, the autotuner, the "auto"
// micro-batch) size node-placed groups by before the run's ProcessGroups exist: the emulated k
// (ranks 0..k-1 a node, whatever the planned world), else NodeMap's first node under
// MPI_COMM_TYPE_SHARED, the figure the engine's own plan takes. Collective over world;
// AgreedFailure (exit 2) when ZERO3D_RANKS_PER_NODE is malformed, as NodeMap.
int planned_ranks_per_node(MPI_Comm world);

}  // namespace zero3d
