// comm.hpp — the communicator interface the training code talks to: collectives and
// point-to-point over one process group. Implementations: MPI (always) and NCCL (when
// built with CUDA and NCCL; device buffers).
//
// Counts are elements, 64-bit. all_reduce is in place; reduce_scatter takes size()·recv_count
// elements and leaves this rank's block; all_gather concatenates every rank's send_count
// elements in rank order.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.hpp"
#include "base/watchdog.hpp"
#include "observe/comms_logger.hpp"

namespace zero3d {

enum class ReduceOp { Sum, Max, Min };

class RingScratch;

class CommRequest;

// A nonblocking collective in flight.
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  virtual bool test() = 0;  // advances progress; true once complete
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual std::string backend() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  virtual void all_reduce(void* buf, int64_t count, DType type, ReduceOp op) = 0;
  virtual std::unique_ptr<CommRequest> all_reduce_async(void* buf, int64_t count, DType type, ReduceOp op) = 0;
  virtual void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType type, ReduceOp op) = 0;
  virtual void all_gather(const void* send, void* recv, int64_t send_count, DType type) = 0;
  // Variable blocks: rank r's result block has counts[r] elements; `send` holds all blocks in
  // rank order (Σ counts elements) and `recv` receives this rank's block.
  virtual std::unique_ptr<CommRequest> reduce_scatter_v_async(const void* send, void* recv,
                                                             const std::vector<int64_t>& counts, DType type,
                                                             ReduceOp op) = 0;
  // In place: rank r's counts[r] elements already sit at buf + displs[r]; afterwards every
  // rank holds every block.
  virtual std::unique_ptr<CommRequest> all_gather_v_async(void* buf, const std::vector<int64_t>& counts,
                                                         const std::vector<int64_t>& displs, DType type) = 0;
  virtual void broadcast(void* buf, int64_t count, DType type, int root) = 0;
  virtual void send(const void* buf, int64_t count, DType type, int peer, int tag) = 0;
  virtual void recv(void* buf, int64_t count, DType type, int peer, int tag) = 0;
  // Nonblocking point-to-point (pipeline activations and gradients): messages between a pair
  // with the same tag arrive in the order they were posted; buf stays untouched until wait().
  virtual std::unique_ptr<CommRequest> isend(const void* buf, int64_t count, DType type, int peer, int tag) = 0;
  virtual std::unique_ptr<CommRequest> irecv(void* buf, int64_t count, DType type, int peer, int tag) = 0;
  virtual void barrier() = 0;
  // All-to-all with a fixed block: count elements of send go to each rank in rank order, and
  // recv gets count from each (the counts exchange before an all_to_all_v).
  virtual void all_to_all(const void* send, void* recv, int64_t count, DType type) = 0;
  // All-to-all with per-rank counts (MoE dispatch and combine, FACTS-2 §4.5): send_counts[r]
  // elements of send, in rank order, go to rank r; recv receives recv_counts[r] from rank r, in
  // rank order. Both sides must agree on the counts (exchanged first with all_to_all).
  virtual void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                            const std::vector<int64_t>& recv_counts, DType type) = 0;

  // Bytes this rank moved, counted as nccl-tests' bus bytes: all_reduce 2(W-1)/W·n,
  // reduce_scatter and all_gather (W-1)/W of the whole buffer, broadcast/send n.
  // (Virtual so that a communicator wrapping another, comm_staged.hpp, reports the one it calls.)
  virtual int64_t bus_bytes() const { return bus_bytes_; }
  virtual void reset_bus_bytes() { bus_bytes_ = 0; }
  // The same count since construction, never reset (what the comms logger's table must add up to).
  virtual int64_t total_bus_bytes() const { return total_bus_bytes_; }
  // Whether the group's ranks all share one node (nodes.hpp): its bytes are intra-node ones,
  // else inter-node ones. Set by whoever built the group from the job's NodeMap.
  virtual bool intra_node() const { return intra_node_; }
  virtual void set_intra_node(bool intra) {
    intra_node_ = intra;
    if (log_) log_->set_intra_node(intra);
  }

  // Per-operation records for the comms logger, the breakdown's blocked time and the trace;
  // null (nothing measured) until observe() names the group.
  virtual void observe(const std::string& axis, const std::string& trace_prefix) {
    if (!log_) log_ = std::make_unique<CommsLog>(axis, trace_prefix, size(), rank(), total_bus_bytes_);
    log_->set_intra_node(intra_node_);
  }
  virtual CommsLog* log() const { return log_.get(); }

 protected:
  void count_bus_bytes(double factor, int64_t elements, DType type) {
    const auto b = static_cast<int64_t>(factor * static_cast<double>(elements) * static_cast<double>(dtype_size(type)));
    bus_bytes_ += b;
    total_bus_bytes_ += b;
  }
  double ring_factor() const { return size() > 1 ? double(size() - 1) / size() : 0.0; }
  int64_t bus_bytes_ = 0, total_bus_bytes_ = 0;
  bool intra_node_ = false;
  std::unique_ptr<CommsLog> log_;
};

// MPI over one communicator (MPI-4 large-count calls, so counts beyond 2^31 work).
class MpiCommunicator : public Communicator {
 public:
  // watchdog may be null; the communicator does not own comm or watchdog.
  MpiCommunicator(MPI_Comm comm, Watchdog* watchdog = nullptr);
  ~MpiCommunicator() override;
  std::string backend() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MPI_Comm comm() const { return comm_; }

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
  void barrier() override;
  void all_to_all(const void* send, void* recv, int64_t count, DType type) override;
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                    const std::vector<int64_t>& recv_counts, DType type) override;

 private:
  int next_ring_tag();

  MPI_Comm comm_;
  Watchdog* watchdog_;
  int rank_ = 0, size_ = 1;
  int64_t ring_sequence_ = 0;                 // ring reductions started (comm_ring.hpp), for their tags
  std::unique_ptr<RingScratch> ring_scratch_;  // their buffers, reused call after call
};

// NCCL communicator over device buffers; nullptr when zero3d was built without NCCL.
// Rank 0 of `comm` creates the NCCL id and broadcasts it over MPI.
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, int device, Watchdog* watchdog = nullptr);
bool nccl_available();

}  // namespace zero3d
