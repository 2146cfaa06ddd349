// NCCL's group communicator (src/parallel/comm_nccl.cpp) against the fake NCCL (fake_nccl.hpp),
// under mpiexec at np 2 and 3: every collective on device buffers gives the MPI group's result
// through NCCL's own calls, host buffers stay on MPI, the group's bytes and log are the MPI
// group's, groups split from the world keep MPI's ranks, ranks sharing a GPU get no NCCL, and the
// fake refuses what NCCL forbids (so that the engine's runs under it can fail).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdlib>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "cuda_runtime.h"
#include "fake_nccl/fake_nccl.hpp"
#include "kernels/half.hpp"
#include "nccl.h"
#include "parallel/comm.hpp"

using namespace zero3d;

namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

// The world's MPI communicator, the NCCL world and one NCCL group over all ranks (its staged path
// the MPI communicator itself, as on a CPU build), made once for the binary's tests.
struct Groups {
  MpiCommunicator mpi{MPI_COMM_WORLD};
  std::unique_ptr<NcclWorld> world;
  std::unique_ptr<Communicator> nccl;
  Groups() {
    std::string why;
    world = open_nccl_world(MPI_COMM_WORLD, nullptr, &why);
    if (world) nccl = world->split(&mpi, &mpi);
  }
};
Groups& groups() {
  static Groups* g = new Groups;  // never destroyed: its communicators would outlive MPI_Finalize
  return *g;
}

// Whole numbers small enough that every sum is exact in fp32 and bf16, different on every rank.
std::vector<float> values(int64_t n, int salt = 0) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = float((world_rank() + 1) * ((i + salt) % 7) - 3);
  return v;
}

int64_t calls(const fake_nccl::Counts& c) {
  return c.all_reduce + c.reduce_scatter + c.all_gather + c.reduce + c.broadcast + c.send + c.recv;
}

class NcclGroup : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(groups().nccl) << "the fake NCCL serves ranks with a GPU each";
    fake_nccl::set_host_ranges({});
    fake_nccl::take_error();
    before_ = fake_nccl::counts();
  }
  void TearDown() override {
    fake_nccl::set_host_ranges({});
    EXPECT_EQ(fake_nccl::take_error(), "") << "a call NCCL forbids";
  }
  Communicator& nccl() { return *groups().nccl; }
  MpiCommunicator& mpi() { return groups().mpi; }
  int64_t nccl_calls() const { return calls(fake_nccl::counts()) - calls(before_); }
  fake_nccl::Counts before_;
};

TEST_F(NcclGroup, AllReduceOfDeviceBuffersIsTheMpiGroupsInFp32Bf16AndInt64) {
  std::vector<float> a = values(1000), b = a;
  nccl().all_reduce(a.data(), 1000, DType::F32, ReduceOp::Sum);
  mpi().all_reduce(b.data(), 1000, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(a, b);
  std::vector<kernels::bf16> h(300), g(300);
  for (size_t i = 0; i < h.size(); ++i) h[i] = g[i] = kernels::to_bf16(values(300)[i]);
  nccl().all_reduce(h.data(), 300, DType::BF16, ReduceOp::Sum);
  mpi().all_reduce(g.data(), 300, DType::BF16, ReduceOp::Sum);
  for (size_t i = 0; i < h.size(); ++i) ASSERT_EQ(h[i].bits, g[i].bits) << i;
  std::vector<int64_t> m(5, world_rank() * 10), n = m;
  nccl().all_reduce(m.data(), 5, DType::I64, ReduceOp::Max);
  mpi().all_reduce(n.data(), 5, DType::I64, ReduceOp::Max);
  EXPECT_EQ(m, n);
  std::vector<float> c = values(64, 3), d = c;
  nccl().all_reduce_async(c.data(), 64, DType::F32, ReduceOp::Sum)->wait();
  mpi().all_reduce(d.data(), 64, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(c, d);
  EXPECT_EQ(fake_nccl::counts().all_reduce - before_.all_reduce, 4);
}

TEST_F(NcclGroup, ReduceScatterAndAllGatherAreTheMpiGroups) {
  const int W = world_size();
  const std::vector<float> send = values(40 * W);
  std::vector<float> got(40), want(40);
  nccl().reduce_scatter(send.data(), got.data(), 40, DType::F32, ReduceOp::Sum);
  mpi().reduce_scatter(send.data(), want.data(), 40, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(got, want);
  std::vector<float> all(40 * W), all_mpi(40 * W);
  nccl().all_gather(send.data(), all.data(), 40, DType::F32);
  mpi().all_gather(send.data(), all_mpi.data(), 40, DType::F32);
  EXPECT_EQ(all, all_mpi);
  EXPECT_EQ(fake_nccl::counts().reduce_scatter - before_.reduce_scatter, 1);
  EXPECT_EQ(fake_nccl::counts().all_gather - before_.all_gather, 1);
}

// ZeRO's buckets: equal blocks are one ring reduce-scatter, unequal ones (an empty block among
// them) a reduce per block in one group, each in place at this rank's block or into a buffer apart.
TEST_F(NcclGroup, VariableReduceScatterIsTheMpiGroupsInPlaceOrApart) {
  const int W = world_size(), me = world_rank();
  for (const bool equal : {true, false}) {
    std::vector<int64_t> counts(size_t(W), 24);
    if (!equal) {
      counts[0] = 0;
      counts[size_t(W - 1)] = 37;
    }
    const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0));
    const int64_t at = std::accumulate(counts.begin(), counts.begin() + me, int64_t(0)), mine = counts[size_t(me)];
    const std::vector<float> send = values(total, equal ? 1 : 2);
    std::vector<float> want(static_cast<size_t>(mine) + 1), apart(static_cast<size_t>(mine) + 1);
    mpi().reduce_scatter_v_async(send.data(), want.data(), counts, DType::F32, ReduceOp::Sum)->wait();
    nccl().reduce_scatter_v_async(send.data(), apart.data(), counts, DType::F32, ReduceOp::Sum)->wait();
    EXPECT_EQ(apart, want) << (equal ? "equal" : "unequal") << " blocks, apart";
    std::vector<float> in_place = send;
    nccl().reduce_scatter_v_async(in_place.data(), in_place.data() + at, counts, DType::F32, ReduceOp::Sum)->wait();
    EXPECT_EQ(std::vector<float>(in_place.begin() + at, in_place.begin() + at + mine),
              std::vector<float>(want.begin(), want.begin() + mine))
        << (equal ? "equal" : "unequal") << " blocks, in place";
  }
  const fake_nccl::Counts now = fake_nccl::counts();
  EXPECT_EQ(now.reduce_scatter - before_.reduce_scatter, 2);  // the equal blocks, twice
  EXPECT_EQ(now.reduce - before_.reduce, 2 * (W - 1));        // the unequal ones: a reduce per non-empty block
}

// ZeRO-3's parameter gathers: blocks end to end are one all-gather in place; blocks with gaps or
// of unequal sizes a broadcast each, in one group. What lies between the blocks is not touched.
TEST_F(NcclGroup, VariableAllGatherInPlaceIsTheMpiGroupsAndLeavesTheGapsAlone) {
  const int W = world_size(), me = world_rank();
  for (const bool end_to_end : {true, false}) {
    std::vector<int64_t> counts(size_t(W), 16), displs(static_cast<size_t>(W));
    for (int r = 0; r < W; ++r) displs[size_t(r)] = 5 + (end_to_end ? 16 * r : 20 * r);
    if (!end_to_end) counts[1] = 3;
    std::vector<float> a(size_t(5 + 20 * W + 8), -7.0f);
    const std::vector<float> mine = values(counts[size_t(me)], 4);
    std::copy(mine.begin(), mine.end(), a.begin() + displs[size_t(me)]);
    std::vector<float> b = a;
    nccl().all_gather_v_async(a.data(), counts, displs, DType::F32)->wait();
    mpi().all_gather_v_async(b.data(), counts, displs, DType::F32)->wait();
    EXPECT_EQ(a, b) << (end_to_end ? "end to end" : "with gaps");
  }
  const fake_nccl::Counts now = fake_nccl::counts();
  EXPECT_EQ(now.all_gather - before_.all_gather, 1);
  EXPECT_EQ(now.broadcast - before_.broadcast, W);
}

// MoE's dispatch and combine: per-rank counts, some zero, a rank's own rows included.
TEST_F(NcclGroup, AllToAllWithPerRankCountsIsTheMpiGroups) {
  const int W = world_size(), me = world_rank();
  std::vector<int64_t> send_counts(static_cast<size_t>(W)), recv_counts(static_cast<size_t>(W));
  for (int r = 0; r < W; ++r) {
    send_counts[size_t(r)] = (me + 2 * r) % 3 * 5;  // what this rank sends to r
    recv_counts[size_t(r)] = (r + 2 * me) % 3 * 5;  // what r sends to this rank
  }
  const std::vector<float> send = values(std::accumulate(send_counts.begin(), send_counts.end(), int64_t(0)), 5);
  const int64_t n = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t(0));
  std::vector<float> got(static_cast<size_t>(n)), want(static_cast<size_t>(n));
  nccl().all_to_all_v(send.data(), send_counts, got.data(), recv_counts, DType::F32);
  mpi().all_to_all_v(send.data(), send_counts, want.data(), recv_counts, DType::F32);
  EXPECT_EQ(got, want);
  const std::vector<float> fixed = values(3 * W, 6);
  std::vector<float> f(static_cast<size_t>(3 * W)), g(static_cast<size_t>(3 * W));
  nccl().all_to_all(fixed.data(), f.data(), 3, DType::F32);
  mpi().all_to_all(fixed.data(), g.data(), 3, DType::F32);
  EXPECT_EQ(f, g);
  EXPECT_EQ(fake_nccl::counts().groups - before_.groups, 2);
  std::vector<float> bcast = values(9, 7), bcast_mpi = bcast;
  nccl().broadcast(bcast.data(), 9, DType::F32, W - 1);
  mpi().broadcast(bcast_mpi.data(), 9, DType::F32, W - 1);
  EXPECT_EQ(bcast, bcast_mpi);
}

// Losses, norms and flags live on the host: their calls never reach NCCL, nor does a call that
// mixes host and device buffers (it takes the staged path), nor point-to-point (MPI's tags).
TEST_F(NcclGroup, HostBuffersMixedCallsAndPointToPointStayOnMpi) {
  const int W = world_size(), me = world_rank();
  double loss = me + 0.5;
  std::vector<float> host = values(8 * W), device = values(8 * W, 1);
  fake_nccl::set_host_ranges({{&loss, sizeof loss}, {host.data(), host.size() * sizeof(float)}});
  nccl().all_reduce(&loss, 1, DType::F64, ReduceOp::Sum);
  EXPECT_EQ(loss, W * (W - 1) / 2.0 + 0.5 * W);
  nccl().reduce_scatter(device.data(), host.data(), 8, DType::F32, ReduceOp::Sum);  // device to host
  std::vector<float> want(8);
  mpi().reduce_scatter(values(8 * W, 1).data(), want.data(), 8, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(std::vector<float>(host.begin(), host.begin() + 8), want);
  const int next = (me + 1) % W, prev = (me + W - 1) % W;
  float token = float(me), got = -1.0f;
  auto r = nccl().irecv(&got, 1, DType::F32, prev, 3);
  nccl().isend(&token, 1, DType::F32, next, 3)->wait();
  r->wait();
  EXPECT_EQ(got, float(prev));
  EXPECT_EQ(nccl_calls(), 0);
}

TEST_F(NcclGroup, ItsBytesAndLogAreTheMpiGroups) {
  const int W = world_size();
  mpi().reset_bus_bytes();
  std::vector<float> a = values(100);
  nccl().all_reduce(a.data(), 100, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(nccl().bus_bytes(), int64_t(2.0 * (W - 1) / W * 100 * 4));
  EXPECT_EQ(mpi().bus_bytes(), nccl().bus_bytes());
  std::vector<float> all(static_cast<size_t>(10 * W));
  nccl().all_gather(a.data(), all.data(), 10, DType::F32);
  EXPECT_EQ(mpi().bus_bytes(), int64_t(2.0 * (W - 1) / W * 100 * 4) + int64_t(double(W - 1) / W * 10 * W * 4));
  EXPECT_EQ(nccl().log(), mpi().log());
}

// Groups of a 2-D layout (consecutive ranks, and ranks a stride apart): NCCL's ranks in a group
// are MPI's, so rank-ordered blocks land where MPI puts them; a group of one gets no NCCL.
TEST(NcclWorld, SplitsKeepTheMpiGroupsRanks) {
  Groups& g = groups();
  ASSERT_TRUE(g.world);
  const int W = world_size(), me = world_rank();
  for (const int stride : {1, 2}) {
    MPI_Comm sub;
    MPI_Comm_split(MPI_COMM_WORLD, stride == 1 ? me / 2 : me % 2, W - me, &sub);  // reversed: MPI rank ≠ world rank
    MpiCommunicator group(sub);
    std::unique_ptr<Communicator> nccl = g.world->split(&group, &group);
    if (group.size() == 1) {
      EXPECT_EQ(nccl, nullptr);
    } else {
      ASSERT_NE(nccl, nullptr);
      EXPECT_EQ(nccl->rank(), group.rank());
      const int64_t id = me;
      std::vector<int64_t> ids(static_cast<size_t>(group.size())), want(static_cast<size_t>(group.size()));
      const int64_t before = fake_nccl::counts().all_gather;
      nccl->all_gather(&id, ids.data(), 1, DType::I64);
      group.all_gather(&id, want.data(), 1, DType::I64);
      EXPECT_EQ(ids, want);
      EXPECT_EQ(fake_nccl::counts().all_gather, before + 1);
    }
    nccl.reset();
    MPI_Comm_free(&sub);
  }
}

// NCCL refuses two ranks on one GPU: such a job gets no NCCL world and says why, as does one
// whose environment turns NCCL off.
TEST(NcclWorld, RanksSharingAGpuOrZero3dNcclZeroGetNoNccl) {
  std::string why;
  setenv("ZERO3D_FAKE_GPU_SHARED", "1", 1);
  EXPECT_EQ(open_nccl_world(MPI_COMM_WORLD, nullptr, &why), nullptr);
  EXPECT_EQ(why, std::to_string(world_size()) + " ranks share a GPU, which NCCL refuses");
  unsetenv("ZERO3D_FAKE_GPU_SHARED");
  setenv("ZERO3D_NCCL", "0", 1);
  EXPECT_EQ(open_nccl_world(MPI_COMM_WORLD, nullptr, &why), nullptr);
  EXPECT_EQ(why, "ZERO3D_NCCL=0");
  unsetenv("ZERO3D_NCCL");
}

// The fake's own checks, each able to fail a run that breaks NCCL's contract.
TEST(FakeNccl, RefusesOverlapsNcclLeavesUndefinedAndCallsNotOrderedAfterTheKernels) {
  Groups& g = groups();
  ASSERT_TRUE(g.world);
  ncclComm_t comm = nullptr;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  ncclComm_t world = nullptr;
  ASSERT_EQ(ncclCommInitRank(&world, world_size(), id, world_rank()), ncclSuccess);
  ASSERT_EQ(ncclCommSplit(world, 0, world_rank(), &comm, &config), ncclSuccess);
  cudaStream_t stream;
  cudaEvent_t computed;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  cudaEventCreateWithFlags(&computed, cudaEventDisableTiming);
  std::vector<float> buf(64, 1.0f);
  EXPECT_EQ(ncclAllReduce(buf.data(), buf.data(), 8, ncclFloat32, ncclSum, comm, stream), ncclInvalidUsage);
  EXPECT_NE(fake_nccl::take_error().find("not ordered after the compute stream"), std::string::npos);
  auto ordered = [&] {
    cudaEventRecord(computed, nullptr);
    cudaStreamWaitEvent(stream, computed, 0);
  };
  ordered();
  EXPECT_EQ(ncclAllGather(buf.data() + 1, buf.data(), 8, ncclFloat32, comm, stream), ncclInvalidArgument);
  EXPECT_NE(fake_nccl::take_error().find("other than at recv + rank"), std::string::npos);
  EXPECT_EQ(ncclAllReduce(buf.data(), buf.data() + 4, 8, ncclFloat32, ncclSum, comm, stream), ncclInvalidArgument);
  ordered();
  EXPECT_EQ(ncclAllReduce(buf.data(), buf.data(), 8, ncclFloat32, ncclSum, comm, stream), ncclSuccess);
  EXPECT_EQ(buf[0], float(world_size()));
  ordered();
  ncclGroupStart();
  ncclSend(buf.data(), 8, ncclFloat32, (world_rank() + 1) % world_size(), comm, stream);
  ncclRecv(buf.data() + 4, 8, ncclFloat32, (world_rank() + world_size() - 1) % world_size(), comm, stream);
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidArgument);
  EXPECT_NE(fake_nccl::take_error().find("overlaps one of its send buffers"), std::string::npos);
  cudaEventDestroy(computed);
  cudaStreamDestroy(stream);
  ncclCommDestroy(comm);
  ncclCommDestroy(world);
}

}  // namespace
