// onebit.hpp — DeepSpeed's 1-bit Adam (DEEPSPEED-FACTS-2 §5.3; runtime/fp16/onebit/adam.py
// OnebitAdam.step) over the tensors of a ParamLayout.
//
// Step 1 (the first step() of a run) is DeepSpeed's initialisation step: it sets up the error
// buffers and updates nothing (the step still counts). Then, while warming up, the engine
// all-reduces the gradients as usual and m = β1·m + (1−β1)·g, v = β2·v + (1−β2)·g²,
// p −= lr·(m/(sqrt(v)+eps) + wd·p) — no bias correction. At the end of the step whose count
// reaches freeze_step the variance freezes and the engine's backward all-reduce goes off: each
// rank updates m with its local gradient and each tensor's m is replaced by the 1-bit
// all-reduce of it (compressed_allreduce.hpp, per tensor with its own error buffers, as
// DeepSpeed loops over its parameters), then the same update with the frozen v.
//
// Checkpoints hold exp_avg and exp_avg_sq (identical on every rank: the compressed result is);
// the error buffers are not saved and restart at zero after a load, and whether the variance is
// frozen follows from the loaded step, as DeepSpeed's load_state_dict does. (DeepSpeed's fresh
// optimizer object also repeats its initialisation step after a load, dropping that step's
// gradient; zero3d continues with a normal step: the initialisation step exists to allocate
// buffers, which a loaded run has.)
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "config/config.hpp"
#include "model/buffer.hpp"
#include "parallel/compressed_allreduce.hpp"

namespace zero3d {

class OneBitAdam {
 public:
  // dp: the data-parallel group the momentum is averaged over (null or size 1: no communication).
  OneBitAdam(const OptimizerConfig& cfg, const ParamLayout& layout, Communicator* dp);

  // Whether step `step` (1-based) runs with the variance frozen and the momentum compressed;
  // then the engine does not all-reduce its gradients (DeepSpeed's enable_backward_allreduce).
  bool compressed(int64_t step) const;
  // Step `step` over host fp32 arrays of the layout's total: g is the averaged gradient while
  // warming up and this rank's local one once compressed.
  void step(int64_t step, float* p, const float* g, float* m, float* v, double lr, double beta1, double beta2);
  // A checkpoint was loaded: the compression errors restart at zero (§5.3).
  void reset_errors();
  const std::vector<OneBitErrors>& errors() const { return errors_; }

 private:
  OptimizerConfig cfg_;
  const ParamLayout& layout_;
  std::unique_ptr<CompressedAllReduce> reduce_;  // null without a data-parallel group
  std::vector<OneBitErrors> errors_;             // per layout tensor
};

}  // namespace zero3d
