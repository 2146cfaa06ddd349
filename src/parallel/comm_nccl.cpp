// comm_nccl.cpp — NCCL for the collectives on model memory when every rank has a GPU of its own
// (comm.hpp, NcclWorld). Built where CUDA and NCCL are found (ZERO3D_ENABLE_NCCL); the CPU suite
// also builds it against tests/fake_nccl/, an NCCL over MPI on host memory that holds every call to
// NCCL's contracts, so that the engine's use of it is checked without a GPU.
#include "parallel/comm.hpp"

#ifdef ZERO3D_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "base/errors.hpp"
#include "kernels/device.hpp"
#include "parallel/comm_observed.hpp"

namespace zero3d {

using namespace comm_observed;

namespace {

void check_cuda(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw SystemError(std::string("CUDA ") + what + ": " + cudaGetErrorString(rc));
}
void check_nccl(ncclResult_t rc, const char* what) {
  if (rc != ncclSuccess) throw SystemError(std::string("NCCL ") + what + ": " + ncclGetErrorString(rc));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    case DType::U8: return ncclUint8;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

size_t count_of(int64_t n) { return static_cast<size_t>(n); }

// Memory NCCL is given: what the device holds, as the staged path decides what to stage
// (kernels::is_device_memory). Host memory, page-locked or not, goes to MPI.
bool on_device(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // a pointer the runtime does not know is host memory; clear the error
    return false;
  }
  return a.type == cudaMemoryTypeDevice;
}

// Which transport a call takes, from the buffers it names with elements on this rank (an empty
// block's pointer says nothing): NCCL when the device holds them all, the MPI group when none, the
// staged path when a call mixes them. Every rank of a call holds its buffers in the same memory,
// so every rank takes the same transport.
enum class Route { Nccl, Host, Staged };
Route route(std::initializer_list<std::pair<const void*, int64_t>> buffers) {
  bool device = false, host = false;
  for (const auto& [p, n] : buffers)
    if (p && n > 0) (on_device(p) ? device : host) = true;
  return host ? (device ? Route::Staged : Route::Host) : Route::Nccl;
}

int64_t total(const std::vector<int64_t>& counts) {
  int64_t n = 0;
  for (int64_t c : counts) n += c;
  return n;
}

class NcclRequest : public CommRequest {
 public:
  NcclRequest(cudaStream_t stream, Watchdog* w, const char* what, Observed o) : watchdog_(w), what_(what), o_(o) {
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(event_, stream), "cudaEventRecord");
  }
  ~NcclRequest() override {
    if (!done_) cudaEventSynchronize(event_);  // the buffers stay the caller's only once NCCL is done with them
    o_.complete(0.0);
    cudaEventDestroy(event_);
  }
  bool test() override {
    if (done_) return true;
    const cudaError_t rc = cudaEventQuery(event_);
    if (rc == cudaErrorNotReady) return false;
    check_cuda(rc, "cudaEventQuery");
    done_ = true;
    o_.complete(0.0);
    return true;
  }
  void wait() override {
    if (done_) return;
    Watchdog::Scope watch(watchdog_, what_);
    const Clock::time_point t0 = Clock::now();
    check_cuda(cudaEventSynchronize(event_), "cudaEventSynchronize");
    done_ = true;
    o_.complete(ms_between(t0, Clock::now()));
  }

 private:
  cudaEvent_t event_ = nullptr;
  Watchdog* watchdog_;
  const char* what_;
  Observed o_;
  bool done_ = false;
};

// One group's collectives: device buffers on NCCL, the rest as comm.hpp says. Its bytes and log
// are the MPI group's (GroupPath, count_traffic).
class NcclGroup : public GroupPath {
 public:
  NcclGroup(ncclComm_t comm, MpiCommunicator& host, Communicator& staged, Watchdog* w)
      : GroupPath(host), comm_(comm), staged_(staged), watchdog_(w) {
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaEventCreateWithFlags(&computed_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~NcclGroup() override {
    cudaStreamSynchronize(stream_);
    cudaEventDestroy(computed_);
    cudaStreamDestroy(stream_);
    ncclCommDestroy(comm_);
  }
  std::string backend() const override { return "nccl"; }

  void all_reduce(void* buf, int64_t count, DType type, ReduceOp op) override {
    switch (route({{buf, count}})) {
      case Route::Host: return group_.all_reduce(buf, count, type, op);
      case Route::Staged: return staged_.all_reduce(buf, count, type, op);
      case Route::Nccl: break;
    }
    group_.count_traffic(2.0 * ring_factor(), count, type);
    const BlockingCall observed(log(), CommOp::AllReduce, count, type);
    after_compute();
    check_nccl(ncclAllReduce(buf, buf, count_of(count), nccl_type(type), nccl_op(op), comm_, stream_), "ncclAllReduce");
    sync("all_reduce");
  }
  std::unique_ptr<CommRequest> all_reduce_async(void* buf, int64_t count, DType type, ReduceOp op) override {
    switch (route({{buf, count}})) {
      case Route::Host: return group_.all_reduce_async(buf, count, type, op);
      case Route::Staged: return staged_.all_reduce_async(buf, count, type, op);
      case Route::Nccl: break;
    }
    group_.count_traffic(2.0 * ring_factor(), count, type);
    const Observed o = observe_op(log(), CommOp::AllReduce, count, type);
    after_compute();
    check_nccl(ncclAllReduce(buf, buf, count_of(count), nccl_type(type), nccl_op(op), comm_, stream_), "ncclAllReduce");
    return std::make_unique<NcclRequest>(stream_, watchdog_, "all_reduce(wait)", o);
  }
  void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType type, ReduceOp op) override {
    switch (route({{send, recv_count * size()}, {recv, recv_count}})) {
      case Route::Host: return group_.reduce_scatter(send, recv, recv_count, type, op);
      case Route::Staged: return staged_.reduce_scatter(send, recv, recv_count, type, op);
      case Route::Nccl: break;
    }
    group_.count_traffic(ring_factor(), recv_count * size(), type);
    const BlockingCall observed(log(), CommOp::ReduceScatter, recv_count * size(), type);
    after_compute();
    check_nccl(ncclReduceScatter(send, recv, count_of(recv_count), nccl_type(type), nccl_op(op), comm_, stream_),
               "ncclReduceScatter");
    sync("reduce_scatter");
  }
  void all_gather(const void* send, void* recv, int64_t send_count, DType type) override {
    switch (route({{send, send_count}, {recv, send_count * size()}})) {
      case Route::Host: return group_.all_gather(send, recv, send_count, type);
      case Route::Staged: return staged_.all_gather(send, recv, send_count, type);
      case Route::Nccl: break;
    }
    group_.count_traffic(ring_factor(), send_count * size(), type);
    const BlockingCall observed(log(), CommOp::AllGather, send_count * size(), type);
    after_compute();
    check_nccl(ncclAllGather(send, recv, count_of(send_count), nccl_type(type), comm_, stream_), "ncclAllGather");
    sync("all_gather");
  }
  // NCCL has no v-collectives. Equal blocks are one ncclReduceScatter (a ring); unequal ones an
  // ncclReduce of each block to its rank, fused in one group, as DeepSpeed's ZeRO-1/2
  // average_tensor reduces each partition's slice to its owner (stage_1_and_2.py, dist.reduce).
  std::unique_ptr<CommRequest> reduce_scatter_v_async(const void* send, void* recv, const std::vector<int64_t>& counts,
                                                     DType type, ReduceOp op) override {
    const int64_t n = total(counts), mine = counts[static_cast<size_t>(rank())];
    if (n == 0) return std::make_unique<CompletedRequest>();
    switch (route({{send, n}, {recv, mine}})) {
      case Route::Host: return group_.reduce_scatter_v_async(send, recv, counts, type, op);
      case Route::Staged: return staged_.reduce_scatter_v_async(send, recv, counts, type, op);
      case Route::Nccl: break;
    }
    group_.count_traffic(ring_factor(), n, type);
    const Observed o = observe_op(log(), CommOp::ReduceScatter, n, type);
    after_compute();
    const size_t es = dtype_size(type);
    const char* base = static_cast<const char*>(send);
    if (equal(counts)) {  // recv in place at this rank's block, or apart: NCCL's two forms
      check_nccl(ncclReduceScatter(send, recv, count_of(mine), nccl_type(type), nccl_op(op), comm_, stream_),
                 "ncclReduceScatter");
    } else {
      check_nccl(ncclGroupStart(), "ncclGroupStart");
      for (int r = 0; r < size(); ++r) {
        const int64_t c = counts[static_cast<size_t>(r)];
        if (c > 0)
          check_nccl(ncclReduce(base, r == rank() ? recv : nullptr, count_of(c), nccl_type(type), nccl_op(op), r, comm_,
                                stream_),
                     "ncclReduce");
        base += c * static_cast<int64_t>(es);
      }
      check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    }
    return std::make_unique<NcclRequest>(stream_, watchdog_, "reduce_scatter(wait)", o);
  }
  // In place. Equal blocks laid end to end are one ncclAllGather; otherwise each rank broadcasts
  // its block, fused in a group.
  std::unique_ptr<CommRequest> all_gather_v_async(void* buf, const std::vector<int64_t>& counts,
                                                 const std::vector<int64_t>& displs, DType type) override {
    const int64_t n = total(counts);
    if (n == 0) return std::make_unique<CompletedRequest>();
    int64_t end = 0;
    for (size_t r = 0; r < counts.size(); ++r) end = std::max(end, displs[r] + counts[r]);
    switch (route({{buf, end}})) {
      case Route::Host: return group_.all_gather_v_async(buf, counts, displs, type);
      case Route::Staged: return staged_.all_gather_v_async(buf, counts, displs, type);
      case Route::Nccl: break;
    }
    group_.count_traffic(ring_factor(), n, type);
    const Observed o = observe_op(log(), CommOp::AllGather, n, type);
    after_compute();
    const size_t es = dtype_size(type);
    char* base = static_cast<char*>(buf);
    bool end_to_end = equal(counts);
    for (size_t r = 1; r < counts.size() && end_to_end; ++r) end_to_end = displs[r] == displs[0] + counts[0] * int64_t(r);
    if (end_to_end) {
      const int64_t c = counts[0];
      check_nccl(ncclAllGather(base + (displs[0] + c * rank()) * int64_t(es), base + displs[0] * int64_t(es), count_of(c),
                               nccl_type(type), comm_, stream_),
                 "ncclAllGather");
    } else {
      check_nccl(ncclGroupStart(), "ncclGroupStart");
      for (int r = 0; r < size(); ++r) {
        const int64_t c = counts[static_cast<size_t>(r)];
        char* block = base + displs[static_cast<size_t>(r)] * int64_t(es);
        if (c > 0)
          check_nccl(ncclBroadcast(block, block, count_of(c), nccl_type(type), r, comm_, stream_), "ncclBroadcast");
      }
      check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    }
    return std::make_unique<NcclRequest>(stream_, watchdog_, "all_gather(wait)", o);
  }
  void broadcast(void* buf, int64_t count, DType type, int root) override {
    switch (route({{buf, count}})) {
      case Route::Host: return group_.broadcast(buf, count, type, root);
      case Route::Staged: return staged_.broadcast(buf, count, type, root);
      case Route::Nccl: break;
    }
    group_.count_traffic(1.0, count, type);
    const BlockingCall observed(log(), CommOp::Broadcast, count, type);
    after_compute();
    check_nccl(ncclBroadcast(buf, buf, count_of(count), nccl_type(type), root, comm_, stream_), "ncclBroadcast");
    sync("broadcast");
  }
  // Point-to-point keeps MPI's tags (comm.hpp): a pipeline posts its receives ahead of the sends
  // they match, which NCCL, matching in issue order on one stream, would deadlock or cross.
  void send(const void* buf, int64_t count, DType type, int peer, int tag) override {
    staged_.send(buf, count, type, peer, tag);
  }
  void recv(void* buf, int64_t count, DType type, int peer, int tag) override { staged_.recv(buf, count, type, peer, tag); }
  std::unique_ptr<CommRequest> isend(const void* buf, int64_t count, DType type, int peer, int tag) override {
    return staged_.isend(buf, count, type, peer, tag);
  }
  std::unique_ptr<CommRequest> irecv(void* buf, int64_t count, DType type, int peer, int tag) override {
    return staged_.irecv(buf, count, type, peer, tag);
  }
  void barrier() override { group_.barrier(); }
  void all_to_all(const void* send, void* recv, int64_t count, DType type) override {
    switch (route({{send, count * size()}, {recv, count * size()}})) {
      case Route::Host: return group_.all_to_all(send, recv, count, type);
      case Route::Staged: return staged_.all_to_all(send, recv, count, type);
      case Route::Nccl: break;
    }
    const std::vector<int64_t> counts(static_cast<size_t>(size()), count);
    exchange(send, counts, recv, counts, type);
  }
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                    const std::vector<int64_t>& recv_counts, DType type) override {
    switch (route({{send, total(send_counts)}, {recv, total(recv_counts)}})) {
      case Route::Host: return group_.all_to_all_v(send, send_counts, recv, recv_counts, type);
      case Route::Staged: return staged_.all_to_all_v(send, send_counts, recv, recv_counts, type);
      case Route::Nccl: break;
    }
    exchange(send, send_counts, recv, recv_counts, type);
  }

 private:
  // NCCL's all-to-all is grouped point-to-point (nccl-tests alltoall.cu); a rank's own block too.
  void exchange(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                const std::vector<int64_t>& recv_counts, DType type) {
    const char* out = static_cast<const char*>(send);
    char* in = static_cast<char*>(recv);
    const int64_t es = static_cast<int64_t>(dtype_size(type));
    int64_t leaving = 0;
    for (int r = 0; r < size(); ++r)
      if (r != rank()) leaving += send_counts[static_cast<size_t>(r)];
    group_.count_traffic(1.0, leaving, type);  // the rows that really cross to another rank
    const BlockingCall observed(log(), CommOp::AllToAll, total(send_counts), type);
    after_compute();
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < size(); ++r) {
      const int64_t s = send_counts[static_cast<size_t>(r)], v = recv_counts[static_cast<size_t>(r)];
      if (s > 0) check_nccl(ncclSend(out, count_of(s), nccl_type(type), r, comm_, stream_), "ncclSend");
      if (v > 0) check_nccl(ncclRecv(in, count_of(v), nccl_type(type), r, comm_, stream_), "ncclRecv");
      out += s * es;
      in += v * es;
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    sync("all_to_all_v");
  }
  // NCCL's stream waits for the kernels queued before the call (they wrote what it reads, or
  // read what it overwrites), on the device, not the host.
  void after_compute() {
    check_cuda(cudaEventRecord(computed_, static_cast<cudaStream_t>(kernels::compute_stream_handle())), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_, computed_, 0), "cudaStreamWaitEvent");
  }
  void sync(const char* op) {
    Watchdog::Scope watch(watchdog_, op);
    check_cuda(cudaStreamSynchronize(stream_), op);
  }
  static bool equal(const std::vector<int64_t>& counts) {
    for (int64_t c : counts)
      if (c != counts.front()) return false;
    return true;
  }

  ncclComm_t comm_;
  Communicator& staged_;
  Watchdog* watchdog_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t computed_ = nullptr;
};

class NcclWorldComm : public NcclWorld {
 public:
  NcclWorldComm(MPI_Comm world, Watchdog* w) : world_(world), watchdog_(w) {
    int rank = 0, size = 1;
    MPI_Comm_rank(world_, &rank);
    MPI_Comm_size(world_, &size);
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (rank == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, world_);
    Watchdog::Scope watch(watchdog_, "ncclCommInitRank");
    check_nccl(ncclCommInitRank(&comm_, size, id, rank), "ncclCommInitRank");
  }
  ~NcclWorldComm() override { ncclCommDestroy(comm_); }

  std::unique_ptr<Communicator> split(MpiCommunicator* group, Communicator* staged) override {
    // A group's colour is its first rank's place in the world (the same on every member, distinct
    // between groups); its key the member's rank in the MPI group, so that NCCL's ranks are MPI's.
    int color = NCCL_SPLIT_NOCOLOR, key = 0;
    if (group && group->size() > 1) {
      MPI_Comm_rank(world_, &color);
      MPI_Bcast(&color, 1, MPI_INT, 0, group->comm());
      key = group->rank();
    }
    ncclComm_t sub = nullptr;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    {
      Watchdog::Scope watch(watchdog_, "ncclCommSplit");
      check_nccl(ncclCommSplit(comm_, color, key, &sub, &config), "ncclCommSplit");
    }
    if (color == NCCL_SPLIT_NOCOLOR) return nullptr;
    return std::make_unique<NcclGroup>(sub, *group, *staged, watchdog_);
  }

  std::string version() const override {
    int v = 0;
    ncclGetVersion(&v);
    return "NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
  }

 private:
  MPI_Comm world_;
  Watchdog* watchdog_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<NcclWorld> open_nccl_world(MPI_Comm world, Watchdog* watchdog, std::string* why) {
  int size = 1;
  MPI_Comm_size(world, &size);
  if (size == 1) {
    *why = "one rank";
    return nullptr;
  }
  const char* env = std::getenv("ZERO3D_NCCL");
  int off = env && std::string(env) == "0" ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &off, 1, MPI_INT, MPI_MAX, world);
  if (off) {
    *why = "ZERO3D_NCCL=0";
    return nullptr;
  }
  // Two ranks of a node on one GPU (more ranks than GPUs, or CUDA_VISIBLE_DEVICES naming one GPU
  // twice) share it: NCCL refuses that ("Duplicate GPU detected"). GPUs are told apart by their PCI
  // address, since a launcher may give each rank a different single visible device.
  MPI_Comm node;
  MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int node_size = 1;
  MPI_Comm_size(node, &node_size);
  char bus[32] = {};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetPCIBusId(bus, sizeof bus - 1, device), "cudaDeviceGetPCIBusId");
  std::vector<char> all(static_cast<size_t>(node_size) * sizeof bus);
  MPI_Allgather(bus, sizeof bus, MPI_CHAR, all.data(), sizeof bus, MPI_CHAR, node);
  MPI_Comm_free(&node);
  int most = 1;  // the most ranks on one GPU of this node
  for (int a = 0; a < node_size; ++a) {
    int same = 0;
    for (int b = 0; b < node_size; ++b) same += std::strcmp(&all[size_t(a) * sizeof bus], &all[size_t(b) * sizeof bus]) == 0;
    most = std::max(most, same);
  }
  MPI_Allreduce(MPI_IN_PLACE, &most, 1, MPI_INT, MPI_MAX, world);
  if (most > 1) {
    *why = std::to_string(most) + " ranks share a GPU, which NCCL refuses";
    return nullptr;
  }
  return std::make_unique<NcclWorldComm>(world, watchdog);
}

}  // namespace zero3d

#else  // built without NCCL: model memory's collectives go through MPI (comm_staged.hpp)

namespace zero3d {
bool nccl_available() { return false; }
std::unique_ptr<NcclWorld> open_nccl_world(MPI_Comm, Watchdog*, std::string* why) {
  *why = "built without NCCL";
  return nullptr;
}
}  // namespace zero3d

#endif
