// tensor_parallel.cpp — see tensor_parallel.hpp.
#include "tensor_parallel.hpp"

#include "comm.hpp"

namespace zero3d {

void TensorGroup::all_reduce_sum(float* x, int64_t n) const {
  if (comm && size > 1) comm->all_reduce(x, n, DType::F32, ReduceOp::Sum);
}

void TensorGroup::all_reduce_max(float* x, int64_t n) const {
  if (comm && size > 1) comm->all_reduce(x, n, DType::F32, ReduceOp::Max);
}

std::unique_ptr<CommRequest> TensorGroup::all_reduce_sum_async(float* x, int64_t n) const {
  return comm->all_reduce_async(x, n, DType::F32, ReduceOp::Sum);
}

void TensorGroup::all_gather_tokens(const float* shard, float* full, int64_t n) const {
  comm->all_gather(shard, full, n, DType::F32);
}

void TensorGroup::reduce_scatter_tokens(const float* full, float* shard, int64_t n) const {
  comm->reduce_scatter(full, shard, n, DType::F32, ReduceOp::Sum);
}

}  // namespace zero3d
