// comm_ring.cpp
#include "parallel/comm_ring.hpp"

#include <algorithm>
#include <cstring>

#include "base/errors.hpp"
#include "kernels/half.hpp"

namespace zero3d {

bool ring_reduces(RingCall call, DType type, int64_t elements) {
  if (type != DType::F32 && type != DType::BF16 && type != DType::F16) return false;
  const int64_t bytes = elements * static_cast<int64_t>(dtype_size(type));
  if (call == RingCall::AllReduce && type == DType::F32) return bytes >= kRingAllReduceF32Bytes;
  return bytes >= kRingReduceBytes;
}

namespace {

int wrap(int r, int n) { return ((r % n) + n) % n; }

// dst = own + arrived, in fp32 with one rounding for the 16-bit types (kernels::sum_rounded: the
// arithmetic of the MPI user operation, comm_mpi.cpp half_sum, and of NCCL's bf16/fp16 sum).
template <typename T>
void add(void* dst, const void* own, const void* arrived, int64_t n) {
  kernels::sum_rounded(static_cast<T*>(dst), static_cast<const T*>(own), static_cast<const T*>(arrived), n);
}

void add_any(DType type, void* dst, const void* own, const void* arrived, int64_t n) {
  switch (type) {
    case DType::F32: return add<float>(dst, own, arrived, n);
    case DType::BF16: return add<kernels::bf16>(dst, own, arrived, n);
    case DType::F16: return add<kernels::fp16>(dst, own, arrived, n);
    default: throw SystemError("ring reduction of an unsupported type");
  }
}

int64_t widest_block(const std::vector<int64_t>& counts) {
  int64_t widest = 0;
  for (int64_t c : counts) widest = std::max(widest, c);
  return widest;
}

// A ring pass's rounds: every chunk of the widest block goes n-1 steps round the ring.
int64_t ring_rounds(const std::vector<int64_t>& counts, int64_t chunk_elems, int n) {
  return n > 1 ? (widest_block(counts) + chunk_elems - 1) / chunk_elems * (n - 1) : 0;
}

}  // namespace

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw SystemError(std::string("MPI ") + what + " failed: " + std::string(msg, len));
}

RingReduceScatter::RingReduceScatter(MPI_Comm comm, int tag, const void* send, void* recv, std::vector<int64_t> counts,
                                     std::vector<int64_t> displs, DType type, RingScratch& scratch)
    : comm_(comm),
      scratch_(scratch),
      tag_(tag),
      send_(static_cast<const char*>(send)),
      recv_(static_cast<char*>(recv)),
      counts_(std::move(counts)),
      displs_(std::move(displs)),
      type_(type),
      esize_(static_cast<int64_t>(dtype_size(type))) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  chunk_elems_ = std::max<int64_t>(1, kRingChunkBytes / esize_);
  rounds_ = ring_rounds(counts_, chunk_elems_, size_);
  const int64_t widest = widest_block(counts_);
  if (size_ == 1 && recv_ != send_ + displs_[0] * esize_) std::memcpy(recv_, send_ + displs_[0] * esize_, counts_[0] * esize_);
  const int64_t buffer = std::min(widest, chunk_elems_) * esize_;
  partial_ = scratch_.take(buffer);
  incoming_ = scratch_.take(buffer);
}

RingReduceScatter::~RingReduceScatter() {
  if (posted_) MPI_Waitall(2, reqs_, MPI_STATUSES_IGNORE);
  scratch_.give_back(std::move(partial_));
  scratch_.give_back(std::move(incoming_));
}

int64_t RingReduceScatter::chunk_length(int block, int64_t chunk) const {
  return std::clamp<int64_t>(counts_[block] - chunk * chunk_elems_, 0, chunk_elems_);
}

// Round i is chunk i / (n-1) at ring step s = i % (n-1): rank r passes block r-s-1's partial
// sum to rank r+1 and takes block r-s-2's from rank r-1; at the last step that block is r's own.
void RingReduceScatter::post() {
  const int64_t chunk = round_ / (size_ - 1);
  const int step = static_cast<int>(round_ % (size_ - 1));
  const int out = wrap(rank_ - step - 1, size_), in = wrap(rank_ - step - 2, size_);
  const char* data = step == 0 ? send_ + (displs_[out] + chunk * chunk_elems_) * esize_ : partial_.data();
  check_mpi(MPI_Irecv(incoming_.data(), static_cast<int>(chunk_length(in, chunk) * esize_), MPI_BYTE,
                  wrap(rank_ - 1, size_), tag_, comm_, &reqs_[0]),
        "Irecv");
  check_mpi(MPI_Isend(data, static_cast<int>(chunk_length(out, chunk) * esize_), MPI_BYTE, wrap(rank_ + 1, size_), tag_,
                  comm_, &reqs_[1]),
        "Isend");
  posted_ = true;
}

void RingReduceScatter::finish() {
  const int64_t chunk = round_ / (size_ - 1);
  const int step = static_cast<int>(round_ % (size_ - 1));
  const int in = wrap(rank_ - step - 2, size_);
  const char* own = send_ + (displs_[in] + chunk * chunk_elems_) * esize_;
  char* dst = step == size_ - 2 ? recv_ + chunk * chunk_elems_ * esize_ : partial_.data();
  add_any(type_, dst, own, incoming_.data(), chunk_length(in, chunk));
  posted_ = false;
  ++round_;
}

bool RingReduceScatter::test() {
  while (!done()) {
    if (!posted_) post();
    int flag = 0;
    check_mpi(MPI_Testall(2, reqs_, &flag, MPI_STATUSES_IGNORE), "Testall");
    if (!flag) return false;
    finish();
  }
  return true;
}

void RingReduceScatter::wait() {
  while (!done()) {
    if (!posted_) post();
    check_mpi(MPI_Waitall(2, reqs_, MPI_STATUSES_IGNORE), "Waitall");
    finish();
  }
}

RingAllGather::RingAllGather(MPI_Comm comm, int tag, void* buf, std::vector<int64_t> counts, std::vector<int64_t> displs,
                             DType type)
    : comm_(comm),
      tag_(tag),
      buf_(static_cast<char*>(buf)),
      counts_(std::move(counts)),
      displs_(std::move(displs)),
      esize_(static_cast<int64_t>(dtype_size(type))) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  chunk_elems_ = std::max<int64_t>(1, kRingChunkBytes / esize_);
  rounds_ = ring_rounds(counts_, chunk_elems_, size_);
}

RingAllGather::~RingAllGather() {
  if (posted_) MPI_Waitall(2, reqs_, MPI_STATUSES_IGNORE);
}

int64_t RingAllGather::chunk_length(int block, int64_t chunk) const {
  return std::clamp<int64_t>(counts_[block] - chunk * chunk_elems_, 0, chunk_elems_);
}

// Round i is chunk i / (n-1) at ring step s = i % (n-1): rank r passes block r-s (its own at
// step 0, the one it took the round before after that) to rank r+1 and takes block r-s-1 from
// rank r-1, straight into place.
void RingAllGather::post() {
  const int64_t chunk = round_ / (size_ - 1);
  const int step = static_cast<int>(round_ % (size_ - 1));
  const int out = wrap(rank_ - step, size_), in = wrap(rank_ - step - 1, size_);
  check_mpi(MPI_Irecv(buf_ + (displs_[in] + chunk * chunk_elems_) * esize_, static_cast<int>(chunk_length(in, chunk) * esize_),
                      MPI_BYTE, wrap(rank_ - 1, size_), tag_, comm_, &reqs_[0]),
            "Irecv");
  check_mpi(MPI_Isend(buf_ + (displs_[out] + chunk * chunk_elems_) * esize_, static_cast<int>(chunk_length(out, chunk) * esize_),
                      MPI_BYTE, wrap(rank_ + 1, size_), tag_, comm_, &reqs_[1]),
            "Isend");
  posted_ = true;
}

bool RingAllGather::test() {
  while (!done()) {
    if (!posted_) post();
    int flag = 0;
    check_mpi(MPI_Testall(2, reqs_, &flag, MPI_STATUSES_IGNORE), "Testall");
    if (!flag) return false;
    posted_ = false;
    ++round_;
  }
  return true;
}

void RingAllGather::wait() {
  while (!done()) {
    if (!posted_) post();
    check_mpi(MPI_Waitall(2, reqs_, MPI_STATUSES_IGNORE), "Waitall");
    posted_ = false;
    ++round_;
  }
}

}  // namespace zero3d
