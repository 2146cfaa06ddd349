// test_mpi_collectives.cpp — run under mpiexec at np 1, 2 and 4 (tests/CMakeLists.txt).
// Inputs are rank-valued so each result can be computed by hand for any group size.
#include <gtest/gtest.h>

#include <numeric>

#include "base/errors.hpp"
#include "base/failure.hpp"
#include "kernels/half.hpp"
#include "parallel/comm.hpp"
#include "parallel/grad_reducer.hpp"
#include "parallel/topology.hpp"

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

// Large sums go round a ring (comm_ring.hpp) instead of through MPI. Rank r's element i is a
// pseudo-random 16-bit value (T: bf16 or fp16) known to every rank, so each test recomputes the
// ring's own order: block b's sum starts at rank b+1 and ends at rank b, rounding to T after
// every addition.
template <typename T = kernels::bf16>
float ring_value(int rank, int64_t i) {
  const uint32_t h = static_cast<uint32_t>(i * 2654435761u) ^ static_cast<uint32_t>(rank * 40503u + 17u);
  return kernels::to_float(kernels::from_float<T>(static_cast<float>(h % 20011u) / 997.0f - 10.0f));
}
template <typename T>
float ring_sum(int n, int block, int64_t i) {
  float acc = ring_value<T>((block + 1) % n, i);
  for (int k = 2; k <= n; ++k) acc = kernels::to_float(kernels::from_float<T>(ring_value<T>((block + k) % n, i) + acc));
  return acc;
}

// 300 001 elements: above the ring's threshold, not a multiple of the group size, of the 1 MiB
// chunk or of a 16-lane vector, so uneven blocks, a short last chunk and the additions' scalar
// tail are all exercised. fp16 adds with the hardware's conversions where it has them.
template <typename T>
void expect_ring_all_reduce_bits(DType type) {
  World w;
  const int64_t n = 300001;
  std::vector<T> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = kernels::from_float<T>(ring_value<T>(w.r, i));
  w.comm.all_reduce(x.data(), n, type, ReduceOp::Sum);
  const int64_t base = n / w.n, extra = n % w.n;
  for (int64_t i = 0, b = 0, end = base + (extra > 0); i < n; ++i) {
    if (i == end) ++b, end += base + (b < extra);
    ASSERT_EQ(kernels::to_float(x[i]), w.n == 1 ? ring_value<T>(0, i) : ring_sum<T>(w.n, int(b), i))
        << dtype_name(type) << " element " << i;
  }
}

TEST(MpiCommunicator, LargeBf16AllReduceSumsInTheRingsFixedOrderOnEveryRank) {
  expect_ring_all_reduce_bits<kernels::bf16>(DType::BF16);
}
TEST(MpiCommunicator, LargeFp16AllReduceSumsInTheRingsFixedOrderOnEveryRank) {
  expect_ring_all_reduce_bits<kernels::fp16>(DType::F16);
}

// Several large sums in flight at once, as overlapped gradient buckets are: each keeps its
// own messages, whatever order the ranks test them in. bf16 (the ring's type at any size from
// 256 KiB) with small integers, which it holds exactly.
TEST(MpiCommunicator, OverlappingLargeAllReducesEachGetTheirOwnSum) {
  World w;
  const int64_t n = 200003;
  std::vector<std::vector<kernels::bf16>> bufs(3, std::vector<kernels::bf16>(n));
  for (int k = 0; k < 3; ++k)
    for (int64_t i = 0; i < n; ++i) bufs[k][i] = kernels::to_bf16(float((w.r + 1) * (k + 1)) + float(i % 7));
  std::vector<std::unique_ptr<CommRequest>> reqs;
  for (auto& b : bufs) reqs.push_back(w.comm.all_reduce_async(b.data(), n, DType::BF16, ReduceOp::Sum));
  for (int k = (w.r % 2 ? 2 : 0), seen = 0; seen < 3; k = (k + (w.r % 2 ? 2 : 1)) % 3, ++seen) reqs[k]->test();
  for (int k = 2; k >= 0; --k) reqs[k]->wait();
  const float ranks = w.n * (w.n + 1) / 2.0f;
  for (int k = 0; k < 3; ++k)
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(kernels::to_float(bufs[k][i]), ranks * float(k + 1) + float(w.n * (i % 7))) << k << " " << i;
}

// Each rank polls the sums in flight in its own order until all are done (rank 0 last first,
// the others first first), as overlapped gradient buckets finish at different times on
// different ranks: the all-gather halves then start in different orders, which MPI
// collectives cannot do (they would deadlock or mix up buffers); the ring's matches by tag.
TEST(MpiCommunicator, OverlappingAllReducesFinishWhateverOrderEachRankPollsThemIn) {
  World w;
  const int64_t n = 150001;
  constexpr int kSums = 4;
  std::vector<std::vector<kernels::bf16>> bufs(kSums, std::vector<kernels::bf16>(n));
  for (int k = 0; k < kSums; ++k)
    for (int64_t i = 0; i < n; ++i) bufs[k][i] = kernels::to_bf16(float(w.r + 2 * k) + float(i % 5));
  std::vector<std::unique_ptr<CommRequest>> reqs;
  for (auto& b : bufs) reqs.push_back(w.comm.all_reduce_async(b.data(), n, DType::BF16, ReduceOp::Sum));
  std::vector<bool> done(kSums, false);
  for (int left = kSums; left > 0;)
    for (int j = 0; j < kSums; ++j) {
      const int k = w.r == 0 ? kSums - 1 - j : j;
      if (!done[k] && reqs[k]->test()) done[k] = true, --left;
    }
  for (int k = 0; k < kSums; ++k)
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(kernels::to_float(bufs[k][i]), w.n * (w.n - 1) / 2.0f + float(w.n * (2 * k + i % 5))) << k << " " << i;
}

// A large fp32 all-reduce (above the 16 MiB where fp32 joins the ring) sums exactly.
TEST(MpiCommunicator, LargeF32AllReduceSumsEveryElement) {
  World w;
  const int64_t n = (int64_t(16) << 20) / 4 + 12345;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = float(w.r) + float(i % 13);
  w.comm.all_reduce(x.data(), n, DType::F32, ReduceOp::Sum);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(x[i], w.n * (w.n - 1) / 2.0f + float(w.n * (i % 13))) << i;
}

// ZeRO's partitions: uneven per-rank counts, one of them empty, through the ring.
TEST(MpiCommunicator, LargeReduceScatterVGivesEachRankItsOwnUnevenBlock) {
  World w;
  std::vector<int64_t> counts(w.n);
  for (int r = 0; r < w.n; ++r) counts[r] = r == 1 ? 0 : 90001 + 1000 * r;
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  std::vector<float> send(total);
  for (int64_t i = 0; i < total; ++i) send[i] = float(w.r) + float(i % 11);
  std::vector<float> recv(std::max<int64_t>(1, counts[w.r]), -1.0f);
  w.comm.reduce_scatter_v_async(send.data(), recv.data(), counts, DType::F32, ReduceOp::Sum)->wait();
  int64_t start = 0;
  for (int r = 0; r < w.r; ++r) start += counts[r];
  for (int64_t k = 0; k < counts[w.r]; ++k)
    ASSERT_EQ(recv[k], w.n * (w.n - 1) / 2.0f + float(w.n * ((start + k) % 11))) << k;
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
