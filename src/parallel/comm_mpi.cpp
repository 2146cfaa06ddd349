// comm_mpi.cpp — MpiCommunicator: every call checked, every blocking call watched.
#include <chrono>
#include <optional>
#include <string>

#include "base/errors.hpp"
#include "kernels/half.hpp"
#include "observe/trace.hpp"
#include "parallel/comm.hpp"
#include "parallel/comm_observed.hpp"
#include "parallel/comm_ring.hpp"

namespace zero3d {

using namespace comm_observed;

namespace {
MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::U8: return MPI_UINT8_T;
    case DType::BF16: return MPI_UINT16_T;  // moved as raw bits; reductions use the ops below
    case DType::F16: return MPI_UINT16_T;
  }
  return MPI_DATATYPE_NULL;
}

// MPI has no 16-bit float types: a user operation adds two bf16/fp16 vectors in fp32 and
// rounds once (RNE), the same arithmetic as NCCL's bf16/fp16 sum.
template <typename T>
void half_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  T* b = static_cast<T*>(inout);
  kernels::sum_rounded(b, static_cast<const T*>(in), b, *len);
}

MPI_Op half_sum_op(DType t) {
  static MPI_Op bf16_op = MPI_OP_NULL, fp16_op = MPI_OP_NULL;
  MPI_Op& op = t == DType::BF16 ? bf16_op : fp16_op;
  if (op == MPI_OP_NULL)
    MPI_Op_create(t == DType::BF16 ? &half_sum<kernels::bf16> : &half_sum<kernels::fp16>, /*commute=*/1, &op);
  return op;
}

MPI_Op mpi_op(ReduceOp op, DType type = DType::F32) {
  if (type == DType::BF16 || type == DType::F16) {
    if (op != ReduceOp::Sum) throw SystemError("16-bit reductions support only sum");
    return half_sum_op(type);
  }
  switch (op) {
    case ReduceOp::Sum: return MPI_SUM;
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  return MPI_OP_NULL;
}

class MpiRequest : public CommRequest {
 public:
  MpiRequest(MPI_Request r, Watchdog* w, const char* what = "all_reduce(wait)", Observed o = {})
      : req_(r), watchdog_(w), what_(what), o_(o) {}
  ~MpiRequest() override {
    if (req_ != MPI_REQUEST_NULL) MPI_Wait(&req_, MPI_STATUS_IGNORE);
    o_.complete(0.0);
  }
  bool test() override {
    int flag = 0;
    check_mpi(MPI_Test(&req_, &flag, MPI_STATUS_IGNORE), "Test");
    if (flag) o_.complete(0.0);
    return flag != 0;
  }
  void wait() override {
    Watchdog::Scope watch(watchdog_, what_);
    if (!o_.log) return check_mpi(MPI_Wait(&req_, MPI_STATUS_IGNORE), "Wait");
    std::optional<obs::TraceScope> trace;
    if (obs::g_hooks.trace) trace.emplace(o_.log->trace_prefix() + "/" + comm_op_name(o_.op));
    const Clock::time_point t0 = Clock::now();
    check_mpi(MPI_Wait(&req_, MPI_STATUS_IGNORE), "Wait");
    o_.complete(ms_between(t0, Clock::now()));
  }

 private:
  MPI_Request req_;
  Watchdog* watchdog_;
  const char* what_;
  Observed o_;
};

// A ring reduction in flight (comm_ring.hpp): the reduce-scatter round by round, then, for an
// all-reduce, the ring all-gather of the summed blocks. test() advances it without blocking.
class RingRequest : public CommRequest {
 public:
  RingRequest(std::unique_ptr<RingReduceScatter> rs, std::unique_ptr<RingAllGather> gather, Watchdog* w,
              const char* what, Observed o)
      : rs_(std::move(rs)), gather_(std::move(gather)), watchdog_(w), what_(what), o_(o) {}
  // Finished before it goes, as MpiRequest waits for its request: the other ranks' rounds need
  // this rank's messages (an error here has nowhere to go; the watchdog covers a dead peer).
  ~RingRequest() override {
    try {
      rs_->wait();
      if (gather_) gather_->wait();
    } catch (const std::exception&) {
    }
  }
  bool test() override {
    if (!rs_->test()) return false;
    if (gather_ && !gather_->test()) return false;
    o_.complete(0.0);
    return true;
  }
  void wait() override {
    Watchdog::Scope watch(watchdog_, what_);
    std::optional<obs::TraceScope> trace;
    if (o_.log && obs::g_hooks.trace) trace.emplace(o_.log->trace_prefix() + "/" + comm_op_name(o_.op));
    const Clock::time_point t0 = Clock::now();
    rs_->wait();
    if (gather_) gather_->wait();
    o_.complete(ms_between(t0, Clock::now()));
  }

 private:
  std::unique_ptr<RingReduceScatter> rs_;
  std::unique_ptr<RingAllGather> gather_;  // null for a reduce-scatter
  Watchdog* watchdog_;
  const char* what_;
  Observed o_;
};

// An all-reduce's blocks: as even as the count allows, the first count % n one larger.
std::vector<int64_t> even_blocks(int64_t count, int n) {
  std::vector<int64_t> c(static_cast<size_t>(n), count / n);
  for (int r = 0; r < count % n; ++r) ++c[static_cast<size_t>(r)];
  return c;
}
std::vector<int64_t> block_starts(const std::vector<int64_t>& counts) {
  std::vector<int64_t> d(counts.size(), 0);
  for (size_t r = 1; r < d.size(); ++r) d[r] = d[r - 1] + counts[r - 1];
  return d;
}
std::unique_ptr<CommRequest> ring_all_reduce(MPI_Comm comm, int tag, RingScratch& scratch, void* buf, int64_t count,
                                             DType type, Watchdog* watchdog, Observed o) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  std::vector<int64_t> counts = even_blocks(count, size);
  std::vector<int64_t> displs = block_starts(counts);
  char* mine = static_cast<char*>(buf) + displs[rank] * static_cast<int64_t>(dtype_size(type));
  auto rs = std::make_unique<RingReduceScatter>(comm, tag, buf, mine, counts, displs, type, scratch);
  // the same tag: a pair's messages arrive in the order sent, so the gather's never meet the
  // reduce-scatter's receives
  auto gather = std::make_unique<RingAllGather>(comm, tag, buf, counts, displs, type);
  return std::make_unique<RingRequest>(std::move(rs), std::move(gather), watchdog, "all_reduce(wait)", o);
}

std::unique_ptr<CommRequest> ring_reduce_scatter(MPI_Comm comm, int tag, RingScratch& scratch, const void* send,
                                                 void* recv, const std::vector<int64_t>& counts, DType type,
                                                 Watchdog* watchdog, Observed o) {
  auto rs =
      std::make_unique<RingReduceScatter>(comm, tag, send, recv, counts, block_starts(counts), type, scratch);
  return std::make_unique<RingRequest>(std::move(rs), nullptr, watchdog, "reduce_scatter(wait)", o);
}
}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, Watchdog* watchdog)
    : comm_(comm), watchdog_(watchdog), ring_scratch_(std::make_unique<RingScratch>()) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}
MpiCommunicator::~MpiCommunicator() = default;

int MpiCommunicator::next_ring_tag() {
  // Each reduction in flight has its own tag, so the rounds of two overlapping ones never
  // match each other's messages; every rank starts collectives in the same order.
  constexpr int kRingTagBase = 30000, kRingTags = 2048;
  return kRingTagBase + static_cast<int>(ring_sequence_++ % kRingTags);
}

void MpiCommunicator::all_reduce(void* buf, int64_t count, DType type, ReduceOp op) {
  count_bus_bytes(2.0 * ring_factor(), count, type);
  if (op == ReduceOp::Sum && size_ > 1 && ring_reduces(RingCall::AllReduce, type, count)) {
    return ring_all_reduce(comm_, next_ring_tag(), *ring_scratch_, buf, count, type, watchdog_,
                           observe_op(log_.get(), CommOp::AllReduce, count, type))
        ->wait();
  }
  const BlockingCall observed(log_.get(), CommOp::AllReduce, count, type);
  Watchdog::Scope watch(watchdog_, "all_reduce");
  check_mpi(MPI_Allreduce_c(MPI_IN_PLACE, buf, count, mpi_type(type), mpi_op(op, type), comm_), "Allreduce");
}

std::unique_ptr<CommRequest> MpiCommunicator::all_reduce_async(void* buf, int64_t count, DType type, ReduceOp op) {
  count_bus_bytes(2.0 * ring_factor(), count, type);
  const Observed o = observe_op(log_.get(), CommOp::AllReduce, count, type);
  if (op == ReduceOp::Sum && size_ > 1 && ring_reduces(RingCall::AllReduce, type, count))
    return ring_all_reduce(comm_, next_ring_tag(), *ring_scratch_, buf, count, type, watchdog_, o);
  MPI_Request req;
  check_mpi(MPI_Iallreduce_c(MPI_IN_PLACE, buf, count, mpi_type(type), mpi_op(op, type), comm_, &req), "Iallreduce");
  return std::make_unique<MpiRequest>(req, watchdog_, "all_reduce(wait)", o);
}

void MpiCommunicator::reduce_scatter(const void* send, void* recv, int64_t recv_count, DType type, ReduceOp op) {
  count_bus_bytes(ring_factor(), recv_count * size_, type);
  if (op == ReduceOp::Sum && size_ > 1 && ring_reduces(RingCall::ReduceScatter, type, recv_count * size_)) {
    return ring_reduce_scatter(comm_, next_ring_tag(), *ring_scratch_, send, recv, std::vector<int64_t>(size_, recv_count), type,
                               watchdog_, observe_op(log_.get(), CommOp::ReduceScatter, recv_count * size_, type))
        ->wait();
  }
  const BlockingCall observed(log_.get(), CommOp::ReduceScatter, recv_count * size_, type);
  Watchdog::Scope watch(watchdog_, "reduce_scatter");
  check_mpi(MPI_Reduce_scatter_block_c(send, recv, recv_count, mpi_type(type), mpi_op(op, type), comm_), "Reduce_scatter_block");
}

void MpiCommunicator::all_gather(const void* send, void* recv, int64_t send_count, DType type) {
  count_bus_bytes(ring_factor(), send_count * size_, type);
  const BlockingCall observed(log_.get(), CommOp::AllGather, send_count * size_, type);
  Watchdog::Scope watch(watchdog_, "all_gather");
  check_mpi(MPI_Allgather_c(send, send_count, mpi_type(type), recv, send_count, mpi_type(type), comm_), "Allgather");
}

std::unique_ptr<CommRequest> MpiCommunicator::reduce_scatter_v_async(const void* send, void* recv,
                                                                     const std::vector<int64_t>& counts, DType type,
                                                                     ReduceOp op) {
  std::vector<MPI_Count> c(counts.begin(), counts.end());
  int64_t total = 0;
  for (int64_t n : counts) total += n;
  count_bus_bytes(ring_factor(), total, type);
  const Observed o = observe_op(log_.get(), CommOp::ReduceScatter, total, type);
  if (op == ReduceOp::Sum && size_ > 1 && ring_reduces(RingCall::ReduceScatter, type, total))
    return ring_reduce_scatter(comm_, next_ring_tag(), *ring_scratch_, send, recv, counts, type, watchdog_, o);
  static float empty;  // a valid address for an empty block
  MPI_Request req;
  check_mpi(MPI_Ireduce_scatter_c(send, counts[rank_] > 0 ? recv : &empty, c.data(), mpi_type(type), mpi_op(op, type), comm_,
                              &req),
        "Ireduce_scatter");
  return std::make_unique<MpiRequest>(req, watchdog_, "reduce_scatter(wait)", o);
}

// Below this many bytes all_gather_v_async runs the blocking MPI_Allgatherv (see there); from
// 1 MiB up MPICH's nonblocking Iallgatherv is the faster of the two on shared memory (2x at
// 1-4 MiB, np 2), and it overlaps.
constexpr int64_t kBlockingAllGatherBytes = 512 << 10;

std::unique_ptr<CommRequest> MpiCommunicator::all_gather_v_async(void* buf, const std::vector<int64_t>& counts,
                                                                 const std::vector<int64_t>& displs, DType type) {
  int64_t total = 0;
  for (int64_t n : counts) total += n;
  count_bus_bytes(ring_factor(), total, type);
  if (total * static_cast<int64_t>(dtype_size(type)) < kBlockingAllGatherBytes) {
    // Small: MPICH's blocking algorithms finish in a few microseconds, where the nonblocking
    // schedule costs ~2x (bench_comm all_gather_v at 1-256 KiB); returned already complete. The
    // counts fit MPI's int form, which skips the large-count variant's conversions, and sit on
    // the stack: at 1 KiB a heap allocation is a measurable part of the call.
    constexpr int kStackRanks = 64;
    int cs[kStackRanks], ds[kStackRanks];
    std::vector<int> ch, dh;
    int *c = cs, *d = ds;
    if (size_ > kStackRanks) ch.resize(size_), dh.resize(size_), c = ch.data(), d = dh.data();
    for (int r = 0; r < size_; ++r) c[r] = static_cast<int>(counts[r]), d[r] = static_cast<int>(displs[r]);
    const BlockingCall observed(log_.get(), CommOp::AllGather, total, type);
    Watchdog::Scope watch(watchdog_, "all_gather");
    check_mpi(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, c, d, mpi_type(type), comm_), "Allgatherv");
    return std::make_unique<CompletedRequest>();
  }
  std::vector<MPI_Count> c(counts.begin(), counts.end());
  std::vector<MPI_Aint> d(displs.begin(), displs.end());
  MPI_Request req;
  const Observed o = observe_op(log_.get(), CommOp::AllGather, total, type);
  check_mpi(MPI_Iallgatherv_c(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, c.data(), d.data(), mpi_type(type), comm_, &req),
        "Iallgatherv");
  return std::make_unique<MpiRequest>(req, watchdog_, "all_gather(wait)", o);
}

void MpiCommunicator::broadcast(void* buf, int64_t count, DType type, int root) {
  count_bus_bytes(1.0, count, type);
  const BlockingCall observed(log_.get(), CommOp::Broadcast, count, type);
  Watchdog::Scope watch(watchdog_, "broadcast");
  check_mpi(MPI_Bcast_c(buf, count, mpi_type(type), root, comm_), "Bcast");
}

std::unique_ptr<CommRequest> MpiCommunicator::isend(const void* buf, int64_t count, DType type, int peer, int tag) {
  count_bus_bytes(1.0, count, type);
  MPI_Request req;
  const Observed o = observe_op(log_.get(), CommOp::Send, count, type);
  check_mpi(MPI_Isend_c(buf, count, mpi_type(type), peer, tag, comm_, &req), "Isend");
  return std::make_unique<MpiRequest>(req, watchdog_, "send(wait)", o);
}

std::unique_ptr<CommRequest> MpiCommunicator::irecv(void* buf, int64_t count, DType type, int peer, int tag) {
  MPI_Request req;
  const Observed o = observe_op(log_.get(), CommOp::Recv, count, type);
  check_mpi(MPI_Irecv_c(buf, count, mpi_type(type), peer, tag, comm_, &req), "Irecv");
  return std::make_unique<MpiRequest>(req, watchdog_, "recv(wait)", o);
}

void MpiCommunicator::send(const void* buf, int64_t count, DType type, int peer, int tag) {
  count_bus_bytes(1.0, count, type);
  const BlockingCall observed(log_.get(), CommOp::Send, count, type);
  Watchdog::Scope watch(watchdog_, "send");
  check_mpi(MPI_Send_c(buf, count, mpi_type(type), peer, tag, comm_), "Send");
}

void MpiCommunicator::recv(void* buf, int64_t count, DType type, int peer, int tag) {
  const BlockingCall observed(log_.get(), CommOp::Recv, count, type);
  Watchdog::Scope watch(watchdog_, "recv");
  check_mpi(MPI_Recv_c(buf, count, mpi_type(type), peer, tag, comm_, MPI_STATUS_IGNORE), "Recv");
}

void MpiCommunicator::barrier() {
  const BlockingCall observed(log_.get(), CommOp::Barrier, 0, DType::U8);
  Watchdog::Scope watch(watchdog_, "barrier");
  check_mpi(MPI_Barrier(comm_), "Barrier");
}

void MpiCommunicator::all_to_all(const void* send, void* recv, int64_t count, DType type) {
  count_bus_bytes(ring_factor(), count * size_, type);  // what leaves this rank: all blocks but its own
  const BlockingCall observed(log_.get(), CommOp::AllToAll, count * size_, type);
  Watchdog::Scope watch(watchdog_, "all_to_all");
  check_mpi(MPI_Alltoall_c(send, count, mpi_type(type), recv, count, mpi_type(type), comm_), "Alltoall");
}

void MpiCommunicator::all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                                   const std::vector<int64_t>& recv_counts, DType type) {
  std::vector<MPI_Count> sc(send_counts.begin(), send_counts.end()), rc(recv_counts.begin(), recv_counts.end());
  std::vector<MPI_Aint> sd(static_cast<size_t>(size_)), rd(static_cast<size_t>(size_));
  int64_t total = 0, leaving = 0;
  for (int r = 0; r < size_; ++r) {
    sd[r] = r == 0 ? 0 : sd[r - 1] + sc[r - 1];
    rd[r] = r == 0 ? 0 : rd[r - 1] + rc[r - 1];
    total += send_counts[r];
    if (r != rank_) leaving += send_counts[r];
  }
  count_bus_bytes(1.0, leaving, type);  // the rows that really cross to another rank
  const BlockingCall observed(log_.get(), CommOp::AllToAll, total, type);
  Watchdog::Scope watch(watchdog_, "all_to_all_v");
  static float empty;  // a valid address when this rank sends or receives nothing
  check_mpi(MPI_Alltoallv_c(total > 0 ? send : &empty, sc.data(), sd.data(), mpi_type(type),
                        recv ? recv : &empty, rc.data(), rd.data(), mpi_type(type), comm_),
        "Alltoallv");
}

}  // namespace zero3d
