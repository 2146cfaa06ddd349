// comm_nccl.cpp — NcclCommunicator over device buffers (built when CUDA and NCCL are found:
// ZERO3D_ENABLE_NCCL=AUTO|ON). Each operation runs on the communicator's own stream; blocking
// calls wait for that stream (watched by the watchdog), async all_reduce records an event.
#include "parallel/comm.hpp"

#ifdef ZERO3D_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "base/errors.hpp"

namespace zero3d {

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

class NcclRequest : public CommRequest {
 public:
  NcclRequest(cudaStream_t stream, Watchdog* w) : watchdog_(w) {
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(event_, stream), "cudaEventRecord");
  }
  ~NcclRequest() override { cudaEventDestroy(event_); }
  bool test() override {
    cudaError_t rc = cudaEventQuery(event_);
    if (rc == cudaErrorNotReady) return false;
    check_cuda(rc, "cudaEventQuery");
    return true;
  }
  void wait() override {
    Watchdog::Scope watch(watchdog_, "all_reduce(wait)");
    check_cuda(cudaEventSynchronize(event_), "cudaEventSynchronize");
  }

 private:
  cudaEvent_t event_;
  Watchdog* watchdog_;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(MPI_Comm mpi, int device, Watchdog* w) : mpi_(mpi), watchdog_(w) {
    MPI_Comm_rank(mpi_, &rank_);
    MPI_Comm_size(mpi_, &size_);
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    ncclUniqueId id;
    if (rank_ == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, mpi_);
    check_nccl(ncclCommInitRank(&comm_, size_, id, rank_), "ncclCommInitRank");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~NcclCommunicator() override {
    cudaStreamDestroy(stream_);
    ncclCommDestroy(comm_);
  }
  std::string backend() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce(void* buf, int64_t count, DType type, ReduceOp op) override {
    check_nccl(ncclAllReduce(buf, buf, static_cast<size_t>(count), nccl_type(type), nccl_op(op), comm_, stream_),
               "ncclAllReduce");
    sync("all_reduce");
  }
  std::unique_ptr<CommRequest> all_reduce_async(void* buf, int64_t count, DType type, ReduceOp op) override {
    check_nccl(ncclAllReduce(buf, buf, static_cast<size_t>(count), nccl_type(type), nccl_op(op), comm_, stream_),
               "ncclAllReduce");
    return std::make_unique<NcclRequest>(stream_, watchdog_);
  }
  void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType type, ReduceOp op) override {
    check_nccl(ncclReduceScatter(send, recv, static_cast<size_t>(recv_count), nccl_type(type), nccl_op(op), comm_,
                                 stream_),
               "ncclReduceScatter");
    sync("reduce_scatter");
  }
  void all_gather(const void* send, void* recv, int64_t send_count, DType type) override {
    check_nccl(ncclAllGather(send, recv, static_cast<size_t>(send_count), nccl_type(type), comm_, stream_),
               "ncclAllGather");
    sync("all_gather");
  }
  // NCCL has no v-collectives: one reduce (or broadcast) per rank's block, fused in a group.
  std::unique_ptr<CommRequest> reduce_scatter_v_async(const void* send, void* recv, const std::vector<int64_t>& counts,
                                                     DType type, ReduceOp op) override {
    const char* base = static_cast<const char*>(send);
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < size_; ++r) {
      if (counts[r] > 0)
        check_nccl(ncclReduce(base, r == rank_ ? recv : nullptr, static_cast<size_t>(counts[r]), nccl_type(type),
                              nccl_op(op), r, comm_, stream_),
                   "ncclReduce");
      base += counts[r] * dtype_size(type);
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    return std::make_unique<NcclRequest>(stream_, watchdog_);
  }
  std::unique_ptr<CommRequest> all_gather_v_async(void* buf, const std::vector<int64_t>& counts,
                                                 const std::vector<int64_t>& displs, DType type) override {
    char* base = static_cast<char*>(buf);
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < size_; ++r)
      if (counts[r] > 0) {
        char* block = base + displs[r] * dtype_size(type);
        check_nccl(ncclBroadcast(block, block, static_cast<size_t>(counts[r]), nccl_type(type), r, comm_, stream_),
                   "ncclBroadcast");
      }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    return std::make_unique<NcclRequest>(stream_, watchdog_);
  }
  void broadcast(void* buf, int64_t count, DType type, int root) override {
    check_nccl(ncclBroadcast(buf, buf, static_cast<size_t>(count), nccl_type(type), root, comm_, stream_),
               "ncclBroadcast");
    sync("broadcast");
  }
  // NCCL has no tags: messages between a pair are matched in issue order.
  void send(const void* buf, int64_t count, DType type, int peer, int) override {
    check_nccl(ncclSend(buf, static_cast<size_t>(count), nccl_type(type), peer, comm_, stream_), "ncclSend");
    sync("send");
  }
  void recv(void* buf, int64_t count, DType type, int peer, int) override {
    check_nccl(ncclRecv(buf, static_cast<size_t>(count), nccl_type(type), peer, comm_, stream_), "ncclRecv");
    sync("recv");
  }
  // Enqueued on the communicator's stream: a pipeline's sends and receives must be posted in
  // an order both peers agree on (the schedule's), as NCCL matches them in issue order.
  std::unique_ptr<CommRequest> isend(const void* buf, int64_t count, DType type, int peer, int) override {
    check_nccl(ncclSend(buf, static_cast<size_t>(count), nccl_type(type), peer, comm_, stream_), "ncclSend");
    return std::make_unique<NcclRequest>(stream_, watchdog_);
  }
  std::unique_ptr<CommRequest> irecv(void* buf, int64_t count, DType type, int peer, int) override {
    check_nccl(ncclRecv(buf, static_cast<size_t>(count), nccl_type(type), peer, comm_, stream_), "ncclRecv");
    return std::make_unique<NcclRequest>(stream_, watchdog_);
  }
  void barrier() override {
    Watchdog::Scope watch(watchdog_, "barrier");
    MPI_Barrier(mpi_);
  }
  // NCCL's all-to-all is grouped point-to-point (nccl-tests alltoall.cu).
  void all_to_all(const void* send, void* recv, int64_t count, DType type) override {
    const std::vector<int64_t> counts(static_cast<size_t>(size_), count);
    all_to_all_v(send, counts, recv, counts, type);
  }
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                    const std::vector<int64_t>& recv_counts, DType type) override {
    const char* out = static_cast<const char*>(send);
    char* in = static_cast<char*>(recv);
    const size_t es = dtype_size(type);
    int64_t leaving = 0;
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < size_; ++r) {
      if (send_counts[r] > 0)
        check_nccl(ncclSend(out, static_cast<size_t>(send_counts[r]), nccl_type(type), r, comm_, stream_), "ncclSend");
      if (recv_counts[r] > 0)
        check_nccl(ncclRecv(in, static_cast<size_t>(recv_counts[r]), nccl_type(type), r, comm_, stream_), "ncclRecv");
      out += send_counts[r] * es;
      in += recv_counts[r] * es;
      if (r != rank_) leaving += send_counts[r];
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    count_bus_bytes(1.0, leaving, type);
    sync("all_to_all_v");
  }

 private:
  void sync(const char* op) {
    Watchdog::Scope watch(watchdog_, op);
    check_cuda(cudaStreamSynchronize(stream_), op);
  }
  MPI_Comm mpi_;
  Watchdog* watchdog_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, int device, Watchdog* watchdog) {
  return std::make_unique<NcclCommunicator>(comm, device, watchdog);
}

}  // namespace zero3d

#else  // built without NCCL: callers ask nccl_available() and fall back to MPI

namespace zero3d {
bool nccl_available() { return false; }
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm, int, Watchdog*) { return nullptr; }
}  // namespace zero3d

#endif
