// comm.hpp — the communicator interface the training code talks to: collectives and
// point-to-point over one process group. Implementations: MPI (always), MPI on host-staged
// copies (comm_staged.hpp) and NCCL (a GPU build whose ranks each have a GPU; device buffers).
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
  // Counts bytes another transport moved for this group (NCCL beside MPI), as the group's own.
  void count_traffic(double factor, int64_t elements, DType type) { count_bus_bytes(factor, elements, type); }
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

// A group's communicator over another path (MPI on host-staged copies, NCCL): the group's own
// communicator counts its bytes and logs its operations, so that a group's figures read the same
// whichever path carried them.
class GroupPath : public Communicator {
 public:
  explicit GroupPath(Communicator& group) : group_(group) {}
  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  int64_t bus_bytes() const override { return group_.bus_bytes(); }
  void reset_bus_bytes() override { group_.reset_bus_bytes(); }
  int64_t total_bus_bytes() const override { return group_.total_bus_bytes(); }
  void observe(const std::string& axis, const std::string& trace_prefix) override { group_.observe(axis, trace_prefix); }
  CommsLog* log() const override { return group_.log(); }
  bool intra_node() const override { return group_.intra_node(); }
  void set_intra_node(bool intra) override { group_.set_intra_node(intra); }

 protected:
  Communicator& group_;
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

// NCCL for the collectives on model memory (comm_nccl.cpp), when every rank of the job has a GPU
// of its own: one NCCL communicator over the world, split into one per group (ncclCommSplit), as
// torch.distributed's new_group and Megatron's groups are made. A group's communicator sends the
// buffers the device holds to NCCL on a stream of its own, ordered after the kernels queued
// before the call; host buffers (losses, norms, flags, counts) to the group's MPI communicator;
// point-to-point (pipeline stages, whose messages MPI matches by tag where NCCL matches them in
// issue order) and a call mixing the two through `staged`. Its bus bytes and comms-log records
// are the MPI group's, so that a group's figures read the same whichever transport moved them.
class NcclWorld {
 public:
  virtual ~NcclWorld() = default;
  // Collective over the world: every rank calls it for the same groups in the same order, with
  // group null where it belongs to no group of that kind. Null for a group of one rank (nothing
  // crosses) or none. staged: the group's communicator for buffers in model memory without NCCL.
  virtual std::unique_ptr<Communicator> split(MpiCommunicator* group, Communicator* staged) = 0;
  virtual std::string version() const = 0;  // "NCCL 2.28.9"
};

// Whether this build has NCCL (a GPU build; a CPU build has no device buffers to give it).
bool nccl_available();

// Collective over world: the NCCL world when NCCL can serve every rank, else null and *why (for
// the start-up line): one rank, ZERO3D_NCCL=0 in the environment, or ranks sharing a GPU (NCCL
// refuses two ranks on one device; those jobs stage their buffers through MPI, comm_staged.hpp).
std::unique_ptr<NcclWorld> open_nccl_world(MPI_Comm world, Watchdog* watchdog, std::string* why);

}  // namespace zero3d
