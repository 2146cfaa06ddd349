// comm_staged.hpp — collectives on model memory over a communicator that reads host memory.
//
// MPI here is not CUDA-aware, and NCCL refuses two ranks on one GPU, so a GPU build whose
// ranks share a device stages (GPU-GAP §4, "MPI on host-staged copies: correct, slower"): each
// buffer in model memory that a call names is copied to host staging before the call and the
// results are copied back after it; host buffers (losses, norms, flags, counts) pass straight
// through. Which elements move is what the call reads and writes, so the wrapped communicator
// computes exactly what it computes on host buffers, in the same order, and keeps the bus bytes
// and the comms log. On a CPU build model memory is host memory and nothing is staged.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/byte_pool.hpp"
#include "kernels/memory.hpp"
#include "parallel/comm.hpp"

namespace zero3d {

// Where a pointer lies and how bytes cross: kernels/device.hpp and kernels/memory.hpp in a GPU
// build (model_memory_staging()); a test's own arena and memcpy on the CPU.
struct StagingRoutes {
  std::function<bool(const void*)> in_model_memory;
  std::function<void(void* host, const void* model, size_t bytes)> to_host;
  std::function<void(void* model, const void* host, size_t bytes)> to_model;
};
StagingRoutes model_memory_staging();

// The host side of staged buffers: page-locked on a GPU build (kernels::HostStagingBuffer).
using StagingPool = BasicPool<kernels::HostStagingBuffer>;

class StagedCommunicator : public GroupPath {
 public:
  // host: the communicator the calls go to (not owned; it outlives this one).
  StagedCommunicator(Communicator& host, StagingRoutes routes);
  std::string backend() const override { return group_.backend() + " (model memory staged through the host)"; }

  void all_reduce(void* buf, int64_t count, DType type, ReduceOp op) override;
  std::unique_ptr<CommRequest> all_reduce_async(void* buf, int64_t count, DType type, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType type, ReduceOp op) override;
  void all_gather(const void* send, void* recv, int64_t send_count, DType type) override;
  std::unique_ptr<CommRequest> reduce_scatter_v_async(const void* send, void* recv, const std::vector<int64_t>& counts,
                                                     DType type, ReduceOp op) override;
  std::unique_ptr<CommRequest> all_gather_v_async(void* buf, const std::vector<int64_t>& counts,
                                                 const std::vector<int64_t>& displs, DType type) override;
  void broadcast(void* buf, int64_t count, DType type, int root) override;
  void send(const void* buf, int64_t count, DType type, int peer, int tag) override;
  void recv(void* buf, int64_t count, DType type, int peer, int tag) override;
  std::unique_ptr<CommRequest> isend(const void* buf, int64_t count, DType type, int peer, int tag) override;
  std::unique_ptr<CommRequest> irecv(void* buf, int64_t count, DType type, int peer, int tag) override;
  void barrier() override { group_.barrier(); }
  void all_to_all(const void* send, void* recv, int64_t count, DType type) override;
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                    const std::vector<int64_t>& recv_counts, DType type) override;

  // Host staging bytes held (in use and spare) and their peak, for the memory report.
  int64_t staging_bytes() const { return pool_->held_bytes(); }

 private:
  class Staged;  // one buffer's host side for the length of a call
  Staged out(const void* buf, int64_t count, DType type);  // copied to the host now (the call reads it)
  Staged in(void* buf, int64_t count, DType type);         // copied back by finish() (the call writes it)
  Staged inout(void* buf, int64_t count, DType type);      // both

  StagingRoutes routes_;
  // shared with the requests in flight, which give their buffers back; page-locked on a GPU build
  std::shared_ptr<StagingPool> pool_;
};

// The communicator each MPI group uses for buffers in model memory: the MPI communicator itself
// on a CPU build (model memory is host memory); on a GPU build NCCL where every rank has a GPU of
// its own (comm.hpp, NcclWorld), else one staging through the host (kept here, one per group).
// Host scalars keep going to the MPI communicators themselves.
class ModelMemoryComms {
 public:
  // Collective over world: NCCL for the groups named, when this build has it and it can serve the
  // job. Every rank names the same kinds of group in the same order, null where it has none.
  void open_nccl(MPI_Comm world, const std::vector<MpiCommunicator*>& groups, Watchdog* watchdog);
  Communicator& of(MpiCommunicator& group);
  // What carries the collectives on model memory and why, for the start-up line; empty on a CPU
  // build without NCCL, where nothing is in question.
  const std::string& transport() const { return transport_; }

 private:
  Communicator& staged(MpiCommunicator& group);

  std::vector<std::pair<const Communicator*, std::unique_ptr<StagedCommunicator>>> staged_;
  std::unique_ptr<NcclWorld> nccl_world_;
  // declared after what they use (the staged paths, the world they were split from), so they go first
  std::vector<std::pair<const Communicator*, std::unique_ptr<Communicator>>> nccl_;
  std::string transport_;
};

}  // namespace zero3d
