// test_mpi_nodes.cpp — nodes and ZeRO's shard groups (parallel/nodes.hpp, topology.hpp
// DataShards), run under mpiexec at np 1, 2 and 4 with 2 emulated ranks per node.
#include <gtest/gtest.h>

#include <cstdlib>

#include "parallel/comm.hpp"
#include "parallel/topology.hpp"

using namespace zero3d;

namespace {

// ZERO3D_RANKS_PER_NODE for the scope of one test (set on every rank before any collective).
struct EmulatedNodes {
  explicit EmulatedNodes(const char* k) { setenv("ZERO3D_RANKS_PER_NODE", k, 1); }
  ~EmulatedNodes() { unsetenv("ZERO3D_RANKS_PER_NODE"); }
};

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

TEST(NodeMap, EmulatedNodesAreRunsOfConsecutiveRanks) {
  EmulatedNodes two("2");
  const NodeMap nodes(MPI_COMM_WORLD);
  const int n = world_size();
  EXPECT_EQ(nodes.nodes(), (n + 1) / 2);
  for (int r = 0; r < n; ++r) EXPECT_EQ(nodes.node_of(r), r / 2);
  EXPECT_EQ(nodes.within_one_node(MPI_COMM_WORLD), n <= 2);
  EXPECT_EQ(nodes.emulated_ranks_per_node(), 2);
  EXPECT_NE(nodes.describe().find("emulated: ZERO3D_RANKS_PER_NODE=2"), std::string::npos);
}

TEST(NodeMap, RealNodesComeFromSharedMemory) {
  const NodeMap nodes(MPI_COMM_WORLD);  // one machine: one node
  EXPECT_EQ(nodes.nodes(), 1);
  EXPECT_TRUE(nodes.within_one_node(MPI_COMM_WORLD));
  EXPECT_EQ(nodes.emulated_ranks_per_node(), 0);
}

// Data ranks 0-3 (one data group): shard groups {0,1} {2,3}, replicas {0,2} {1,3}.
TEST(ProcessGroups, MicsShardAndReplicaGroupsCutTheDataGroup) {
  const int n = world_size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  EmulatedNodes two("2");
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ProcessGroups g(ProcessTopology::pipe_data_model(1, n, 1), MPI_COMM_WORLD, 1, DataShards{2, false, 1});
  MpiCommunicator shard(g.axis("mics_shard")), replicas(g.axis("mics_replicate"));
  EXPECT_EQ(shard.size(), 2);
  EXPECT_EQ(shard.rank(), rank % 2);
  EXPECT_EQ(replicas.size(), n / 2);
  EXPECT_EQ(replicas.rank(), rank / 2);
  EXPECT_TRUE(g.nodes().within_one_node(g.axis("mics_shard")));
  EXPECT_EQ(g.nodes().within_one_node(g.axis("mics_replicate")), n == 2);
  EXPECT_FALSE(g.has("hpz") || g.has("mics_inter"));
  // whose shard: the replica group sums the same position of every shard
  int64_t x = rank;
  replicas.all_reduce(&x, 1, DType::I64, ReduceOp::Sum);
  int64_t want = 0;
  for (int r = rank % 2; r < n; r += 2) want += r;
  EXPECT_EQ(x, want);
}

// One shard group over 2 nodes of 2: inside it, "mics_intra" is the node, "mics_inter" the
// ranks at the same position on each node.
TEST(ProcessGroups, HierarchicalMicsGroupsSplitTheShardByNode) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  EmulatedNodes two("2");
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ProcessGroups g(ProcessTopology::pipe_data_model(1, 4, 1), MPI_COMM_WORLD, 1, DataShards{4, true, 2});
  MpiCommunicator intra(g.axis("mics_intra")), inter(g.axis("mics_inter")), hpz(g.axis("hpz"));
  EXPECT_EQ(intra.size(), 2);
  EXPECT_EQ(intra.rank(), rank % 2);
  EXPECT_EQ(inter.size(), 2);
  EXPECT_EQ(inter.rank(), rank / 2);
  EXPECT_TRUE(g.nodes().within_one_node(g.axis("mics_intra")));
  EXPECT_FALSE(g.nodes().within_one_node(g.axis("mics_inter")));
  EXPECT_TRUE(g.nodes().within_one_node(g.axis("hpz")));
  EXPECT_EQ(hpz.rank(), rank % 2);
}

}  // namespace
