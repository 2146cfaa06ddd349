// rank_plan.hpp — what the engine builds on one (pipeline stage, tensor rank), derived from the
// config alone (Engine::setup_local's model part, schedule buffers and ZeRO-3 fetch trace), for
// the planners that predict a run before it starts: memory (estimator.cpp) and communication
// (comm_volume.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "config/config.hpp"
#include "model/model.hpp"

namespace zero3d {

struct RankPlan {
  int pipe_stage = 0, tensor_rank = 0;
  ModelPart part;
  int64_t partition_numel = 0;  // every stage partitions the largest stage's element count
  int num_buffers = 1;          // activation buffers the schedule keeps in flight
  bool split = false;           // zb-h1: buffers keep the weight-gradient operands
  std::vector<int> trace;       // the dense units one step fetches, as the engine sets ZeRO-3's trace
  std::vector<bool> trace_backward;  // per trace entry: fetched by a backward pass (hpZ gathers those in its group)
  std::vector<int> expert_trace;     // MoE: the expert units it fetches, numbered from the first (the experts' optimizer's trace)
};

// One plan per pipeline stage, in stage order. Tensor ranks hold equal element counts (every
// split is even, the vocabulary padded to a multiple of t), so tensor rank 0 stands for its
// stage's whole tensor group. The trace covers `trace_micro_batches` micro-batches (default: the
// accumulation steps up to 4, which show what a longer one would hold in memory).
std::vector<RankPlan> plan_ranks(const Config& cfg, int64_t trace_micro_batches = -1);

}  // namespace zero3d
