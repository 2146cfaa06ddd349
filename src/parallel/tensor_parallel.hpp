// tensor_parallel.hpp — Megatron's tensor-parallel communication regions (core/tensor_parallel/
// mappings.py; DEEPSPEED-FACTS-2 §1.1), each a forward/backward pair that the model calls on
// mirrored lines of its forward and backward passes. With one tensor rank every region is the
// identity and no call reaches the communicator.
#pragma once

#include <cstdint>
#include <memory>

namespace zero3d {

namespace kernels {
struct bf16;  // kernels/half.hpp
}

class Communicator;
class CommRequest;

struct TensorGroup {
  Communicator* comm = nullptr;  // null when the tensor-parallel size is 1
  int size = 1, rank = 0;
  bool overlap = false;  // tp_overlap_comm: input-gradient all-reduces run under the weight products
  // Megatron sequence parallelism: outside the tensor-parallel regions each rank holds a
  // contiguous 1/size of the micro-batch's B·T tokens.
  bool sequence_parallel = false;
  double* comm_ms = nullptr;  // when set, time spent in the group's collectives accumulates here
  void all_reduce_sum(float* x, int64_t n) const;
  void all_reduce_max(float* x, int64_t n) const;
  std::unique_ptr<CommRequest> all_reduce_sum_async(float* x, int64_t n) const;
  // Token shards in rank order: shard (n elements) -> full (size·n), and its adjoint.
  void all_gather_tokens(const float* shard, float* full, int64_t n) const;
  // The same for shards kept in bf16 (a GPU's bf16 norm outputs): half the bytes.
  void all_gather_tokens(const kernels::bf16* shard, kernels::bf16* full, int64_t n) const;
  void reduce_scatter_tokens(const float* full, float* shard, int64_t n) const;
};

// "f": enters a column-parallel layer. Forward: identity; backward: the input gradient, partial
// on each rank, is summed over the group.
inline void copy_to_tp_region_forward(const TensorGroup&, const float*, int64_t) {}
inline void copy_to_tp_region_backward(const TensorGroup& g, float* grad, int64_t n) { g.all_reduce_sum(grad, n); }

// "g": leaves a row-parallel layer (or the vocab-parallel embedding). Forward: the partial
// products are summed over the group; backward: identity.
inline void reduce_from_tp_region_forward(const TensorGroup& g, float* x, int64_t n) { g.all_reduce_sum(x, n); }
inline void reduce_from_tp_region_backward(const TensorGroup&, const float*, int64_t) {}

// Sequence parallelism replaces "f" and "g" (FACTS-2 §1.8). Entering a column-parallel layer:
// forward all-gathers the token shards, backward reduce-scatters the input gradient.
inline void gather_from_sequence_parallel_region_forward(const TensorGroup& g, const float* shard, float* full,
                                                         int64_t n) {
  g.all_gather_tokens(shard, full, n);
}
// A bf16 shard gathered as it is kept (Megatron gathers its bf16 activations).
inline void gather_from_sequence_parallel_region_forward(const TensorGroup& g, const kernels::bf16* shard,
                                                         kernels::bf16* full, int64_t n) {
  g.all_gather_tokens(shard, full, n);
}
inline void gather_from_sequence_parallel_region_backward(const TensorGroup& g, const float* full_grad,
                                                          float* shard_grad, int64_t n) {
  g.reduce_scatter_tokens(full_grad, shard_grad, n);
}
// Leaving a row-parallel layer: forward reduce-scatters the partial products into token
// shards, backward all-gathers the shards' gradient.
inline void reduce_scatter_to_sequence_parallel_region_forward(const TensorGroup& g, const float* full, float* shard,
                                                               int64_t n) {
  g.reduce_scatter_tokens(full, shard, n);
}
inline void reduce_scatter_to_sequence_parallel_region_backward(const TensorGroup& g, const float* shard_grad,
                                                                float* full_grad, int64_t n) {
  g.all_gather_tokens(shard_grad, full_grad, n);
}

}  // namespace zero3d
