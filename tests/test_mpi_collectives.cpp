// test_mpi_collectives.cpp — run under mpiexec at np 1, 2 and 4 (tests/CMakeLists.txt).
// Inputs are rank-valued so each result can be computed by hand for any group size.
#include <gtest/gtest.h>

#include <numeric>

#include "base.hpp"
#include "comm.hpp"
#include "failure.hpp"
#include "grad_reducer.hpp"
#include "topology.hpp"

using namespace zero3d;

namespace {

struct World {
  MpiCommunicator comm{MPI_COMM_WORLD};
  int r = comm.rank(), n = comm.size();
};

TEST(MpiCommunicator, AllReduceSumsRankValues) {
  World w;
  std::vector<float> x = {float(w.r), float(w.r + 1), 1.0f};
  w.comm.all_reduce(x.data(), 3, DType::F32, ReduceOp::Sum);
  const float sum_r = w.n * (w.n - 1) / 2.0f;
  EXPECT_EQ(x, (std::vector<float>{sum_r, sum_r + w.n, float(w.n)}));
}

TEST(MpiCommunicator, AllReduceMaxAndMin) {
  World w;
  int64_t hi = w.r, lo = w.r;
  w.comm.all_reduce(&hi, 1, DType::I64, ReduceOp::Max);
  w.comm.all_reduce(&lo, 1, DType::I64, ReduceOp::Min);
  EXPECT_EQ(hi, w.n - 1);
  EXPECT_EQ(lo, 0);
}

TEST(MpiCommunicator, AsyncAllReduceCompletesAfterWait) {
  World w;
  std::vector<double> x(1000, double(w.r + 1));
  auto req = w.comm.all_reduce_async(x.data(), 1000, DType::F64, ReduceOp::Sum);
  req->wait();
  EXPECT_EQ(x[999], w.n * (w.n + 1) / 2.0);
}

TEST(MpiCommunicator, ReduceScatterLeavesEachRankItsSummedBlock) {
  World w;
  const int block = 3;
  std::vector<float> send(w.n * block), recv(block);
  for (int i = 0; i < w.n * block; ++i) send[i] = float(w.r * 100 + i);  // element i from rank r
  w.comm.reduce_scatter(send.data(), recv.data(), block, DType::F32, ReduceOp::Sum);
  const float rank_sum = 100.0f * w.n * (w.n - 1) / 2.0f;
  for (int k = 0; k < block; ++k) EXPECT_EQ(recv[k], rank_sum + w.n * float(w.r * block + k));
}

TEST(MpiCommunicator, AllGatherConcatenatesInRankOrder) {
  World w;
  std::vector<int32_t> send = {w.r, -w.r}, recv(2 * w.n);
  w.comm.all_gather(send.data(), recv.data(), 2, DType::I32);
  for (int k = 0; k < w.n; ++k) {
    EXPECT_EQ(recv[2 * k], k);
    EXPECT_EQ(recv[2 * k + 1], -k);
  }
}

TEST(MpiCommunicator, BroadcastCopiesTheRootsBuffer) {
  World w;
  std::vector<uint8_t> x(5, uint8_t(w.r));
  const int root = w.n - 1;
  w.comm.broadcast(x.data(), 5, DType::U8, root);
  EXPECT_EQ(x, std::vector<uint8_t>(5, uint8_t(root)));
}

TEST(MpiCommunicator, SendRecvPassesAlongARing) {
  World w;
  if (w.n == 1) return;  // a ring needs two ranks; np 2 and np 4 cover it
  float out = float(w.r), in = -1.0f;
  const int next = (w.r + 1) % w.n, prev = (w.r + w.n - 1) % w.n;
  if (w.r % 2 == 0) {
    w.comm.send(&out, 1, DType::F32, next, 7);
    w.comm.recv(&in, 1, DType::F32, prev, 7);
  } else {
    w.comm.recv(&in, 1, DType::F32, prev, 7);
    w.comm.send(&out, 1, DType::F32, next, 7);
  }
  EXPECT_EQ(in, float(prev));
}

TEST(ProcessGroups, DataGroupsFollowTheTopology) {
  World w;
  const int dp = w.n >= 2 ? 2 : 1, tp = w.n / dp;
  ProcessGroups groups(ProcessTopology::pipe_data_model(1, dp, tp), MPI_COMM_WORLD);
  MpiCommunicator data(groups.data_parallel());
  EXPECT_EQ(data.size(), dp);
  // Sum of world ranks over my data group = ranks sharing my model coordinate.
  int32_t x = w.r;
  data.all_reduce(&x, 1, DType::I32, ReduceOp::Sum);
  const int model = groups.coord()["model"];
  int expected = 0;
  for (int d = 0; d < dp; ++d) expected += d * tp + model;
  EXPECT_EQ(x, expected);
}

class Reducer : public ::testing::TestWithParam<std::tuple<bool, int64_t>> {};

TEST_P(Reducer, AveragesEveryElementWhateverTheBucketsAndOverlap) {
  World w;
  const auto [overlap, bucket] = GetParam();
  const int64_t n = 1003;  // not a multiple of any bucket
  std::vector<float> g(n);
  for (int64_t i = 0; i < n; ++i) g[i] = float(w.r * 1000 + i);
  GradientReducer reducer(w.comm, g.data(), DType::F32, n, bucket, overlap, DType::F32);
  reducer.begin();
  reducer.grads_ready(700);  // what backward reports as blocks finish
  reducer.progress();
  reducer.grads_ready(0);
  const int64_t buckets = reducer.finish();
  EXPECT_EQ(buckets, (n + bucket - 1) / bucket);
  for (int64_t i = 0; i < n; ++i) ASSERT_FLOAT_EQ(g[i], 1000.0f * (w.n - 1) / 2.0f + float(i)) << i;
}

INSTANTIATE_TEST_SUITE_P(BucketsAndOverlap, Reducer,
                         ::testing::Combine(::testing::Bool(), ::testing::Values<int64_t>(1, 64, 300, 5000)));

TEST(FailureAgreement, NoFailureReturnsOnEveryRank) {
  EXPECT_NO_THROW(run_collectively(MPI_COMM_WORLD, [] {}));
}

TEST(FailureAgreement, OneFailingRankMakesEveryRankThrowAndOnlyItReport) {
  World w;
  const int bad = w.n - 1;
  try {
    run_collectively(MPI_COMM_WORLD, [&] {
      if (w.r == bad) throw InputError("only the last rank sees this");
    });
    FAIL() << "no rank failed";
  } catch (const AgreedFailure& e) {
    EXPECT_EQ(e.code(), kExitBadInput);
    EXPECT_EQ(e.failed_rank(), bad);
    EXPECT_EQ(e.report(), w.r == bad);
  }
}

}  // namespace
