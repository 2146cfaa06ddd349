// grad_reducer.hpp — data-parallel gradient averaging in buckets of reduce_bucket_size
// elements, once per optimizer step (micro-batches accumulate locally before it).
//
// Buckets are cut from the END of the flat gradient buffer, because backward finishes the
// last block first: with overlap_comm, each bucket's all_reduce is launched non-blocking as
// soon as backward reports that its range is final, and progress() is polled between
// kernels (MPICH advances non-blocking collectives only inside MPI calls). finish() launches
// what is left, waits, and divides by the group size (DeepSpeed's post-scaling, FACTS §5.6).
//
// Example: 10 elements, bucket 4, ready(6) -> launch [6,10); ready(0) -> launch [2,6);
// finish() -> launch [0,2), wait for all three, scale by 1/W.
#pragma once

#include <memory>
#include <vector>

#include "comm.hpp"
#include "model.hpp"

namespace zero3d {

class GradientReducer : public BackwardHooks {
 public:
  GradientReducer(Communicator& comm, float* grads, int64_t n, int64_t bucket_elems, bool overlap);

  // Call before the backward pass whose gradients complete the accumulation.
  void begin();
  void grads_ready(int64_t offset) override;
  void progress() override;
  // Reduces everything not yet launched, waits for all buckets, averages. Returns buckets used.
  int64_t finish();

  int64_t bucket_elems() const { return bucket_; }

 private:
  void launch(int64_t begin, int64_t end);

  Communicator& comm_;
  float* grads_;
  int64_t n_, bucket_;
  bool overlap_;
  int64_t frontier_ = 0;  // [frontier_, n_) has been launched
  int64_t launched_ = 0;
  std::vector<std::unique_ptr<CommRequest>> inflight_;
};

}  // namespace zero3d
