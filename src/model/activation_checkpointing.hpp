// model/activation_checkpointing.hpp — what activation checkpointing keeps and recomputes (DEEPSPEED-FACTS §9.1,
// DEEPSPEED-FACTS-2 §6), as plain data: the config reader fills it, the model and the memory
// planner read it. No dependencies, so config.hpp can hold it without pulling in the model.
#pragma once

#include <cstdint>

namespace zero3d {

// full: a checkpoint keeps only its input and recomputes its blocks in backward (Chen et al.
// 2016; DeepSpeed's checkpoint()). selective: every block keeps everything but the attention
// probabilities, which backward recomputes (Korthikanti et al. 2022, "selective recompute").
enum class RecomputeGranularity { Full, Selective };

struct ActivationCheckpointing {
  // pipeline.activation_checkpoint_interval: consecutive blocks per checkpoint, counted from
  // each chunk's first block; 0 = off.
  int interval = 0;
  RecomputeGranularity granularity = RecomputeGranularity::Full;
  bool partition_activations = false;  // a saved input keeps 1/t per tensor rank, all-gathered before recompute
  bool cpu_checkpointing = false;      // saved inputs in the host memory space
  bool contiguous_memory_optimization = false;  // saved inputs in one preallocated buffer of number_checkpoints slots
  int64_t number_checkpoints = 0;
  bool synchronize_checkpoint_boundary = false;  // fence + tensor-group barrier at each checkpoint boundary
  bool profile = false;                          // forward and recompute time per checkpoint
  bool enabled() const { return interval > 0; }
  bool full() const { return enabled() && granularity == RecomputeGranularity::Full; }
  bool selective() const { return enabled() && granularity == RecomputeGranularity::Selective; }
};

}  // namespace zero3d
