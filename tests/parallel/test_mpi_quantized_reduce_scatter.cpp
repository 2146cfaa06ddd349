// test_mpi_quantized_reduce_scatter.cpp — ZeRO++'s qgZ reduce-scatter (parallel/
// quantized_reduce_scatter.hpp) against the NumPy simulation of DeepSpeed's
// all_to_all_quant_reduce in tests/golden/make_quantize_int4_goldens.py (quantize_int4.h5,
// /reduce_*): at np 4 two nodes of two ranks, at np 2 two nodes of one, each rank feeding its
// own bucket; every rank's reduced block bit for bit, and the bytes each all-to-all moved equal
// qgz_sent_bytes. (np 1: no golden, skipped.)
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "io/h5.hpp"
#include "parallel/quantized_reduce_scatter.hpp"

using namespace zero3d;

namespace {

const std::string kGolden = std::string(ZERO3D_GOLDEN_DIR) + "/quantize_int4.h5";

TEST(QuantizedReduceScatter, MatchesTheNumPySimulationOfDeepSpeedsTwoStageAllToAll) {
  int w = 0, r = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  if (w != 2 && w != 4) GTEST_SKIP() << "goldens at world 2 and 4";
  const std::string g = w == 4 ? "reduce_w4_nodes2" : "reduce_w2_nodes2";
  const h5::File f = h5::File::open_read(kGolden);
  const int nodes = f.read_ints(g + "/nodes")[0], k = f.read_ints(g + "/per_node")[0];
  const int64_t group = f.read_ints(g + "/group")[0];
  ASSERT_EQ(nodes * k, w);
  const std::vector<int32_t> c = f.read_ints(g + "/counts");
  const std::vector<int64_t> counts(c.begin(), c.end());
  int64_t total = 0;
  for (int64_t n : counts) total += n;
  const std::vector<float> all = f.read_floats(g + "/x");
  const std::vector<float> mine(all.begin() + r * total, all.begin() + (r + 1) * total);
  const std::vector<float> want = f.read_floats(g + "/out_" + std::to_string(r));

  MPI_Comm intra_comm, inter_comm;  // rank r = node·k + local
  MPI_Comm_split(MPI_COMM_WORLD, r / k, r % k, &intra_comm);
  MPI_Comm_split(MPI_COMM_WORLD, r % k, r / k, &inter_comm);
  {
    MpiCommunicator intra(intra_comm), inter(inter_comm);
    QuantizedReduceScatter qgz(intra, inter);
    ASSERT_EQ(qgz.data_rank(), r);
    std::vector<float> out(want.size(), -1.0f);
    qgz.reduce(mine.data(), counts, group, out.data());
    EXPECT_EQ(out, want) << "rank " << r;
    // the buffers it holds are the ones the memory planner counts for this rank
    EXPECT_EQ(qgz.staging_bytes(), qgz_staging(qgz_blocks(counts, group), nodes, k, r).total()) << "rank " << r;
    const QgzBytes b = qgz_sent_bytes(counts, group, nodes, k, r);
    EXPECT_EQ(intra.bus_bytes(), b.intra) << "rank " << r;
    EXPECT_EQ(inter.bus_bytes(), b.inter) << "rank " << r;
    // something crosses nodes, but from rank 0 at np 4: its cross-node block (rank 2's) is empty
    if (w == 2 || r != 0) {
      EXPECT_GT(b.inter, 0) << "rank " << r;
    }
  }
  MPI_Comm_free(&intra_comm);
  MPI_Comm_free(&inter_comm);
}

// The bytes by hand for the np 4 bucket: blocks 40, 33, 0, 27 in groups of 12 start at phases
// 0, 4, 1, 1 and have 4, 4, 0, 3 groups: 20+4·4, 17+4·4, 0, 14+4·3 bytes. Rank 0 (node 0,
// local 0) sends blocks 1 and 3 inside its node and the node's sum of block 2 (empty) across.
TEST(QuantizedReduceScatter, BytesFollowTheBlocksEachAllToAllMoves) {
  const std::vector<int64_t> counts = {40, 33, 0, 27};
  const std::vector<QgzBlock> b = qgz_blocks(counts, 12);
  EXPECT_EQ(b[1].phase, 4);
  EXPECT_EQ(b[1].scales, 4);  // 8 values finish block 0's last group, then 12, 12 and 1
  EXPECT_EQ(b[3].phase, 1);
  EXPECT_EQ(qgz_sent_bytes(counts, 12, 2, 2, 0).intra, (17 + 16) + (14 + 12));
  EXPECT_EQ(qgz_sent_bytes(counts, 12, 2, 2, 0).inter, 0);
  EXPECT_EQ(qgz_sent_bytes(counts, 12, 2, 2, 3).inter, 17 + 16);  // node 1, local 1: block 1 to node 0
  EXPECT_EQ(qgz_sent_bytes(counts, 12, 2, 2, 3).intra, (20 + 16) + 0);
}

// The staging the same bucket needs (the memory planner's qgZ rows): rank 0 quantises the whole
// bucket (51 value bytes, 11 scales), receives blocks 0 and 2 from both local peers and then its
// block 0 from both nodes (2·20 bytes, 2·4 scales), and sums 40-value blocks; rank 3 receives
// blocks 1 and 3 from both peers (2·31 bytes, 2·7 scales) and sums up to 33 values.
TEST(QuantizedReduceScatter, StagingIsEachBuffersLargestNeed) {
  const std::vector<QgzBlock> b = qgz_blocks({40, 33, 0, 27}, 12);
  const QgzStaging r0 = qgz_staging(b, 2, 2, 0), r3 = qgz_staging(b, 2, 2, 3);
  EXPECT_EQ(r0.send, 51);
  EXPECT_EQ(r0.send_scales, 4 * 11);
  EXPECT_EQ(r0.recv, 2 * 20);
  EXPECT_EQ(r0.recv_scales, 4 * 2 * 4);
  EXPECT_EQ(r0.sum, 4 * 40);
  EXPECT_EQ(r0.total(), 51 + 44 + 40 + 32 + 2 * 160);
  EXPECT_EQ(r3.recv, 2 * 31);
  EXPECT_EQ(r3.recv_scales, 4 * 2 * 7);
  EXPECT_EQ(r3.copy, 4 * 33);
  QgzStaging grown = r0;  // buffers only grow: each one's larger need
  grown.grow(r3);
  EXPECT_EQ(grown.total(), 51 + 44 + 62 + 56 + 2 * 160);
}

}  // namespace
