// comm_ring.hpp — sum reductions of large buffers as a ring of point-to-point transfers with
// the additions done here (Patarasuk & Yuan 2009, "bandwidth optimal all-reduce"). MPICH
// reduces a user operation (bf16/fp16, which MPI lacks) at a third of its MPI_SUM speed, and
// even its fp32 MPI_SUM all-reduce moves 2x the bytes a ring needs on shared memory
// (bench_comm: 124 M bf16 elements at np 2 take 155 ms through MPI_Allreduce, 40 ms here).
// Internal to the MPI communicator (comm_mpi.cpp); MPI stays in this layer.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "base/byte_pool.hpp"
#include "base/dtype.hpp"

namespace zero3d {

// Sums at or above this many bytes go round the ring; smaller ones stay with MPI's
// latency-optimised algorithms. bench_comm at np 2: the ring wins every reduce-scatter and
// every 16-bit all-reduce from 256 KiB; MPICH's own fp32 all-reduce stays ~10% ahead from
// 1 to 4 MiB and falls to half the ring's bandwidth by 64 MiB, so fp32 all-reduces switch at 16 MiB.
constexpr int64_t kRingReduceBytes = 256 << 10;
constexpr int64_t kRingAllReduceF32Bytes = 16 << 20;
// The ring's unit of transfer, in bytes: two such buffers per reduction in flight.
constexpr int64_t kRingChunkBytes = 1 << 20;

enum class RingCall { AllReduce, ReduceScatter };
bool ring_reduces(RingCall call, DType type, int64_t elements);

// Throws SystemError naming the call and MPI's own message unless rc is MPI_SUCCESS.
void check_mpi(int rc, const char* what);

// The rings' scratch buffers, kept between calls: a fresh buffer per call costs more than a
// 256 KiB reduction itself (page faults, and the transport pinning new pages each time).
class RingScratch : public BytePool {};

// One reduce-scatter round by round: block b = [displs[b], displs[b] + counts[b]) of `send`
// summed over the group ends in `recv` on rank b (recv may alias send's own block). Block b's
// partial sum starts at rank b+1 and travels b+2, ..., b, so every element is summed in one
// fixed order whatever the timing. Each round is one chunk of one block: post() sends and
// receives it, finish() adds what arrived. Tags are the caller's (one per reduction in flight).
class RingReduceScatter {
 public:
  RingReduceScatter(MPI_Comm comm, int tag, const void* send, void* recv, std::vector<int64_t> counts,
                    std::vector<int64_t> displs, DType type, RingScratch& scratch);
  RingReduceScatter(const RingReduceScatter&) = delete;
  RingReduceScatter& operator=(const RingReduceScatter&) = delete;
  ~RingReduceScatter();
  bool done() const { return round_ >= rounds_; }
  // Nonblocking progress: true once every round has finished.
  bool test();
  // Runs every remaining round to the end.
  void wait();

 private:
  void post();
  void finish();
  int64_t chunk_length(int block, int64_t chunk) const;

  MPI_Comm comm_;
  RingScratch& scratch_;
  int tag_, rank_ = 0, size_ = 1;
  const char* send_;
  char* recv_;
  std::vector<int64_t> counts_, displs_;
  DType type_;
  int64_t esize_, chunk_elems_, rounds_ = 0, round_ = 0;
  std::vector<char> partial_, incoming_;
  MPI_Request reqs_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  bool posted_ = false;
};

// One all-gather in place, round by round: block b = [displs[b], displs[b] + counts[b]) of buf
// holds rank b's part on entry and every rank's on exit. Block b travels b+1, b+2, ..., b-1, a
// chunk at a time, point to point under the caller's tag. An all-reduce's second half: unlike
// an MPI collective it matches by tag, so reductions in flight may reach it in any order on
// different ranks (collectives must start in one order everywhere, blocking or not alike).
class RingAllGather {
 public:
  RingAllGather(MPI_Comm comm, int tag, void* buf, std::vector<int64_t> counts, std::vector<int64_t> displs, DType type);
  RingAllGather(const RingAllGather&) = delete;
  RingAllGather& operator=(const RingAllGather&) = delete;
  ~RingAllGather();
  bool done() const { return round_ >= rounds_; }
  bool test();
  void wait();

 private:
  void post();
  int64_t chunk_length(int block, int64_t chunk) const;

  MPI_Comm comm_;
  int tag_, rank_ = 0, size_ = 1;
  char* buf_;
  std::vector<int64_t> counts_, displs_;
  int64_t esize_, chunk_elems_, rounds_ = 0, round_ = 0;
  MPI_Request reqs_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  bool posted_ = false;
};

}  // namespace zero3d
