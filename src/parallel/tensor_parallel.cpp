// tensor_parallel.cpp — see tensor_parallel.hpp.
#include "parallel/tensor_parallel.hpp"

#include <chrono>

#include "kernels/half.hpp"
#include "parallel/comm.hpp"

namespace zero3d {

namespace {
// Adds the scope's duration to *ms (no-op when ms is null).
struct Timed {
  double* ms;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  ~Timed() {
    if (ms) *ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
};
}  // namespace

void TensorGroup::all_reduce_sum(float* x, int64_t n) const {
  Timed t{comm_ms};
  if (comm && size > 1) comm->all_reduce(x, n, DType::F32, ReduceOp::Sum);
}

void TensorGroup::all_reduce_max(float* x, int64_t n) const {
  Timed t{comm_ms};
  if (comm && size > 1) comm->all_reduce(x, n, DType::F32, ReduceOp::Max);
}

std::unique_ptr<CommRequest> TensorGroup::all_reduce_sum_async(float* x, int64_t n) const {
  return comm->all_reduce_async(x, n, DType::F32, ReduceOp::Sum);
}

void TensorGroup::all_gather_tokens(const float* shard, float* full, int64_t n) const {
  Timed t{comm_ms};
  comm->all_gather(shard, full, n, DType::F32);
}

void TensorGroup::all_gather_tokens(const kernels::bf16* shard, kernels::bf16* full, int64_t n) const {
  Timed t{comm_ms};
  comm->all_gather(shard, full, n, DType::BF16);
}

void TensorGroup::reduce_scatter_tokens(const float* full, float* shard, int64_t n) const {
  Timed t{comm_ms};
  comm->reduce_scatter(full, shard, n, DType::F32, ReduceOp::Sum);
}

}  // namespace zero3d
