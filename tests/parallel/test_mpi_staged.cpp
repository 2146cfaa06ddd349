// test_mpi_staged.cpp — StagedCommunicator (comm_staged.hpp), the collectives a GPU build runs
// when its ranks share a device: run under mpiexec at np 1, 2 and 4. "Model memory" here is an
// arena of host memory that only the staging may touch: the wrapped MPI communicator sits behind
// a guard that fails the test when it is handed a pointer into the arena, and the results must
// be what MPI gives on plain buffers.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "parallel/comm.hpp"
#include "parallel/comm_staged.hpp"

using namespace zero3d;

namespace {

// Host memory standing in for a device's: buffers are carved from it in order.
class Arena {
 public:
  template <typename T>
  T* take(size_t n) {
    used_ = (used_ + 63) / 64 * 64;
    T* p = reinterpret_cast<T*>(bytes_.data() + used_);
    used_ += n * sizeof(T);
    EXPECT_LE(used_, bytes_.size());
    return p;
  }
  bool holds(const void* p) const {
    const char* c = static_cast<const char*>(p);
    return c >= bytes_.data() && c < bytes_.data() + bytes_.size();
  }

 private:
  std::vector<char> bytes_ = std::vector<char>(1 << 20);
  size_t used_ = 0;
};

// MPI behind a check that no arena pointer reaches it.
class Guard : public Communicator {
 public:
  Guard(Communicator& mpi, const Arena& arena) : mpi_(mpi), arena_(arena) {}
  std::string backend() const override { return mpi_.backend(); }
  int rank() const override { return mpi_.rank(); }
  int size() const override { return mpi_.size(); }
  void all_reduce(void* b, int64_t n, DType t, ReduceOp op) override { mpi_.all_reduce(ok(b), n, t, op); }
  std::unique_ptr<CommRequest> all_reduce_async(void* b, int64_t n, DType t, ReduceOp op) override {
    return mpi_.all_reduce_async(ok(b), n, t, op);
  }
  void reduce_scatter(const void* s, void* r, int64_t n, DType t, ReduceOp op) override {
    mpi_.reduce_scatter(ok(s), ok(r), n, t, op);
  }
  void all_gather(const void* s, void* r, int64_t n, DType t) override { mpi_.all_gather(ok(s), ok(r), n, t); }
  std::unique_ptr<CommRequest> reduce_scatter_v_async(const void* s, void* r, const std::vector<int64_t>& c, DType t,
                                                     ReduceOp op) override {
    return mpi_.reduce_scatter_v_async(ok(s), ok(r), c, t, op);
  }
  std::unique_ptr<CommRequest> all_gather_v_async(void* b, const std::vector<int64_t>& c, const std::vector<int64_t>& d,
                                                 DType t) override {
    return mpi_.all_gather_v_async(ok(b), c, d, t);
  }
  void broadcast(void* b, int64_t n, DType t, int root) override { mpi_.broadcast(ok(b), n, t, root); }
  void send(const void* b, int64_t n, DType t, int p, int tag) override { mpi_.send(ok(b), n, t, p, tag); }
  void recv(void* b, int64_t n, DType t, int p, int tag) override { mpi_.recv(ok(b), n, t, p, tag); }
  std::unique_ptr<CommRequest> isend(const void* b, int64_t n, DType t, int p, int tag) override {
    return mpi_.isend(ok(b), n, t, p, tag);
  }
  std::unique_ptr<CommRequest> irecv(void* b, int64_t n, DType t, int p, int tag) override {
    return mpi_.irecv(ok(b), n, t, p, tag);
  }
  void barrier() override { mpi_.barrier(); }
  int64_t bus_bytes() const override { return mpi_.bus_bytes(); }
  void reset_bus_bytes() override { mpi_.reset_bus_bytes(); }
  void all_to_all(const void* s, void* r, int64_t n, DType t) override { mpi_.all_to_all(ok(s), ok(r), n, t); }
  void all_to_all_v(const void* s, const std::vector<int64_t>& sc, void* r, const std::vector<int64_t>& rc,
                    DType t) override {
    mpi_.all_to_all_v(ok(s), sc, ok(r), rc, t);
  }

 private:
  template <typename P>
  P* ok(P* p) const {
    EXPECT_FALSE(arena_.holds(p)) << "model memory reached MPI";
    return p;
  }
  Communicator& mpi_;
  const Arena& arena_;
};

struct Staged {
  Arena arena;
  MpiCommunicator mpi{MPI_COMM_WORLD};
  Guard guard{mpi, arena};
  StagedCommunicator comm{guard, StagingRoutes{[this](const void* p) { return arena.holds(p); },
                                               [](void* h, const void* m, size_t b) { std::memcpy(h, m, b); },
                                               [](void* m, const void* h, size_t b) { std::memcpy(m, h, b); }}};
  int r = mpi.rank(), n = mpi.size();
};

TEST(StagedCommunicator, AllReduceOfModelMemoryAndOfAHostScalar) {
  Staged w;
  float* x = w.arena.take<float>(3);
  x[0] = float(w.r), x[1] = float(w.r + 1), x[2] = 1.0f;
  w.comm.all_reduce(x, 3, DType::F32, ReduceOp::Sum);
  const float sum_r = w.n * (w.n - 1) / 2.0f;
  EXPECT_EQ(x[0], sum_r);
  EXPECT_EQ(x[1], sum_r + w.n);
  EXPECT_EQ(x[2], float(w.n));
  double host = 1.0;  // not model memory: straight through
  w.comm.all_reduce(&host, 1, DType::F64, ReduceOp::Sum);
  EXPECT_EQ(host, double(w.n));
}

TEST(StagedCommunicator, AsyncAllReduceLandsInModelMemoryAtWait) {
  Staged w;
  const int64_t count = 5000;
  double* x = w.arena.take<double>(count);
  for (int64_t i = 0; i < count; ++i) x[i] = double(w.r + 1);
  auto req = w.comm.all_reduce_async(x, count, DType::F64, ReduceOp::Sum);
  req->wait();
  for (int64_t i = 0; i < count; i += 999) EXPECT_EQ(x[i], w.n * (w.n + 1) / 2.0);
}

TEST(StagedCommunicator, ReduceScatterVAndAllGatherVMoveTheRightElements) {
  Staged w;
  // uneven blocks: rank k owns k + 2 elements
  std::vector<int64_t> counts(w.n), displs(w.n);
  for (int k = 0; k < w.n; ++k) counts[k] = k + 2;
  std::partial_sum(counts.begin(), counts.end() - 1, displs.begin() + 1);
  const int64_t total = displs.back() + counts.back();
  float* send = w.arena.take<float>(total);
  float* mine = w.arena.take<float>(counts[w.r]);
  for (int64_t i = 0; i < total; ++i) send[i] = float(100 * w.r + i);
  w.comm.reduce_scatter_v_async(send, mine, counts, DType::F32, ReduceOp::Sum)->wait();
  const float rank_sum = 100.0f * w.n * (w.n - 1) / 2.0f;
  for (int64_t k = 0; k < counts[w.r]; ++k) EXPECT_EQ(mine[k], rank_sum + w.n * float(displs[w.r] + k));
  // in place: each rank's block at its displacement, every block everywhere afterwards
  float* all = w.arena.take<float>(total);
  for (int64_t i = 0; i < total; ++i) all[i] = -1.0f;
  for (int64_t k = 0; k < counts[w.r]; ++k) all[displs[w.r] + k] = float(w.r);
  w.comm.all_gather_v_async(all, counts, displs, DType::F32)->wait();
  for (int q = 0; q < w.n; ++q)
    for (int64_t k = 0; k < counts[q]; ++k) EXPECT_EQ(all[displs[q] + k], float(q));
}

// ZeRO-3 gathers each unit in place, and a rank owning none of a unit has an empty block whose
// displacement may lie past the unit's end: the staging copies only the unit, never beyond it
// (a device copy past an allocation is an error, cudaErrorInvalidValue on an H100).
TEST(StagedCommunicator, AllGatherVStagesOnlyTheBufferWhenAnEmptyBlockPointsPastIt) {
  Arena arena;
  MpiCommunicator mpi{MPI_COMM_WORLD};
  const int r = mpi.rank(), n = mpi.size();
  std::vector<int64_t> counts(n), displs(n);
  int64_t total = 0;
  for (int k = 0; k < n; ++k) {
    counts[k] = n > 1 && k == n - 1 ? 0 : k + 2;  // the last rank owns nothing
    displs[k] = counts[k] > 0 ? total : total + 1000;
    total += counts[k];
  }
  float* unit = arena.take<float>(total);
  const char* end = reinterpret_cast<const char*>(unit + total);
  auto within = [&](const void* m, size_t b) {
    EXPECT_LE(static_cast<const char*>(m) + b, end) << "staging copied past the unit";
  };
  StagedCommunicator comm{mpi, StagingRoutes{[&](const void* p) { return arena.holds(p); },
                                             [&](void* h, const void* m, size_t b) { within(m, b), std::memcpy(h, m, b); },
                                             [&](void* m, const void* h, size_t b) { within(m, b), std::memcpy(m, h, b); }}};
  for (int64_t k = 0; k < counts[r]; ++k) unit[displs[r] + k] = float(r);
  comm.all_gather_v_async(unit, counts, displs, DType::F32)->wait();
  for (int q = 0; q < n; ++q)
    for (int64_t k = 0; k < counts[q]; ++k) EXPECT_EQ(unit[displs[q] + k], float(q));
}

TEST(StagedCommunicator, ReduceScatterAllGatherAndBroadcast) {
  Staged w;
  const int block = 3;
  float* send = w.arena.take<float>(w.n * block);
  float* recv = w.arena.take<float>(block);
  for (int i = 0; i < w.n * block; ++i) send[i] = float(w.r * 100 + i);
  w.comm.reduce_scatter(send, recv, block, DType::F32, ReduceOp::Sum);
  const float rank_sum = 100.0f * w.n * (w.n - 1) / 2.0f;
  for (int k = 0; k < block; ++k) EXPECT_EQ(recv[k], rank_sum + w.n * float(w.r * block + k));
  int32_t* pair = w.arena.take<int32_t>(2);
  int32_t* gathered = w.arena.take<int32_t>(2 * w.n);
  pair[0] = w.r, pair[1] = -w.r;
  w.comm.all_gather(pair, gathered, 2, DType::I32);
  for (int k = 0; k < w.n; ++k) EXPECT_TRUE(gathered[2 * k] == k && gathered[2 * k + 1] == -k) << k;
  uint8_t* b = w.arena.take<uint8_t>(5);
  std::memset(b, w.r, 5);
  w.comm.broadcast(b, 5, DType::U8, w.n - 1);
  for (int k = 0; k < 5; ++k) EXPECT_EQ(b[k], uint8_t(w.n - 1));
}

TEST(StagedCommunicator, PointToPointAlongARingAndAllToAll) {
  Staged w;
  float* out = w.arena.take<float>(4);
  float* in = w.arena.take<float>(4);
  for (int k = 0; k < 4; ++k) out[k] = float(10 * w.r + k), in[k] = -1.0f;
  const int next = (w.r + 1) % w.n, prev = (w.r + w.n - 1) % w.n;
  auto rx = w.comm.irecv(in, 4, DType::F32, prev, 7);
  auto tx = w.comm.isend(out, 4, DType::F32, next, 7);
  tx->wait();
  rx->wait();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(in[k], float(10 * prev + k));
  int64_t* a = w.arena.take<int64_t>(w.n);
  int64_t* b = w.arena.take<int64_t>(w.n);
  for (int q = 0; q < w.n; ++q) a[q] = 100 * w.r + q;  // element q goes to rank q
  w.comm.all_to_all(a, b, 1, DType::I64);
  for (int q = 0; q < w.n; ++q) EXPECT_EQ(b[q], 100 * q + w.r);
}

TEST(StagedCommunicator, CountsBusBytesInTheCommunicatorItCalls) {
  Staged w;
  float* x = w.arena.take<float>(16);
  const int64_t before = w.mpi.bus_bytes();
  w.comm.all_reduce(x, 16, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(w.comm.bus_bytes(), w.mpi.bus_bytes());
  EXPECT_EQ(w.mpi.bus_bytes() - before, w.n > 1 ? int64_t(2.0 * (w.n - 1) / w.n * 16 * 4) : 0);
  w.comm.reset_bus_bytes();
  EXPECT_EQ(w.mpi.bus_bytes(), 0);
}

}  // namespace
