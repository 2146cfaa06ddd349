// pipe_schedule.hpp — pipeline schedules as pure data (DeepSpeed runtime/pipe/schedule.py;
// DEEPSPEED-FACTS §8.2, DEEPSPEED-FACTS-2 §2.8–2.9), and the layer partitioners
// (DeepSpeed runtime/utils.py partition_uniform / partition_balanced; FACTS §8.3).
//
// No MPI, no model: a schedule is, for one pipeline stage, a list of clock steps, each a list
// of instructions executed in order. The executor (engine) maps each instruction to a call.
// Buffers are activation buffers of one in-flight micro-batch, ids in [0, num_buffers).
//
// Chunks (interleaved 1F1B, Megatron): rank `stage` of p holds v model chunks; chunk c is
// virtual stage c·p + stage. For the other kinds v = 1 and chunk is always 0.
// Send/Recv instructions name the buffer on the *local* side; the peer is the neighbouring
// virtual stage (next for SendActivation/RecvGrad, previous for RecvActivation/SendGrad).
// Messages between two ranks of one kind and one receiving virtual stage arrive in the
// order they were sent (MPI non-overtaking), so the executor can tag them by
// (kind, receiving virtual stage): the schedules post each channel's receives in the order
// its peer sends.
//
// Execution model the schedules are checked against (tests/parallel/test_pipe_schedule.cpp simulates
// all stages together): a Recv* posts a nonblocking receive, waited on only by the Forward /
// Backward / BackwardInput that consumes it; Send* are nonblocking and waited on before
// their buffer is taken by another micro-batch. A (micro-batch, chunk) owns its buffer from
// its first instruction (RecvActivation, LoadMicroBatch or Forward) to its last (SendGrad,
// Backward, or BackwardWeight for zb-h1). Interleaved and zb-h1 post RecvGrad right after
// the micro-batch's SendActivation, so a buffer needs an output-gradient slot of its own,
// apart from the output that SendActivation may still be reading.
//
// Steps: 1F1B is DeepSpeed's TrainSchedule, 2(m+p−1) steps with the empty ones kept.
// Interleaved and zb-h1 have one step per compute instruction, with that instruction's
// communication and the receives posted early after it.
// Every schedule ends its last step with ReduceTiedGrads, ReduceGrads, OptimizerStep.
//
// num_buffers: 1 with one stage; 1F1B max(2, min(p − s, m)) (DeepSpeed); interleaved
// min(w + 1, m·v) with w Megatron's warm-up min(2(p−s−1) + (v−1)·p, m·v) (the forwards in
// flight); zb-h1 min(p, m) on every stage (a W deferred by s slots keeps its activations).
#pragma once

#include <string>
#include <vector>

namespace zero3d::pipe {

enum class Op {
  LoadMicroBatch,   // first stage: tokens; last stage: targets (both on a one-stage pipeline)
  RecvActivation,   // from the previous virtual stage into buffer
  SendActivation,   // buffer's output to the next virtual stage
  RecvGrad,         // gradient of buffer's output, from the next virtual stage
  SendGrad,         // gradient of buffer's input, to the previous virtual stage
  Forward,
  Backward,         // input and weight gradients together
  BackwardInput,    // zb-h1 "B": input gradients only (weight-gradient operands are kept)
  BackwardWeight,   // zb-h1 "W": weight gradients of a micro-batch whose B has run
  ReduceTiedGrads,  // sum the tied wte gradient over the embedding group
  ReduceGrads,      // finish the data-parallel gradient reduction
  OptimizerStep,
};

// "ForwardPass", "SendActivation", ... (DeepSpeed's class names); zb-h1's B and W print as
// "BackwardInputPass" and "BackwardWeightPass".
const char* op_name(Op op);

struct Instruction {
  Op op;
  int micro_batch = -1;  // -1 for ReduceTiedGrads, ReduceGrads, OptimizerStep
  int chunk = 0;         // model chunk on this rank, 0..v-1
  int buffer = -1;       // activation buffer, -1 for the three step-level instructions
  bool operator==(const Instruction& o) const {
    return op == o.op && micro_batch == o.micro_batch && chunk == o.chunk && buffer == o.buffer;
  }
};
std::string to_string(const Instruction& in);  // e.g. "ForwardPass(m=3,c=0,b=1)"

enum class ScheduleKind { OneFOneB, Interleaved, ZeroBubbleH1 };
const char* schedule_name(ScheduleKind kind);  // "1f1b", "interleaved", "zb-h1" (pipeline.schedule values)

struct ScheduleSpec {
  ScheduleKind kind = ScheduleKind::OneFOneB;
  int stages = 1;          // p
  int micro_batches = 1;   // m (gradient_accumulation_steps)
  int virtual_stages = 1;  // v (Interleaved only; 1 otherwise)
};

struct StageSchedule {
  int stage = 0;
  int num_buffers = 1;
  std::vector<std::vector<Instruction>> steps;
};

// Empty when the spec can run, else a message with the numbers (what validation prints).
// Interleaved needs p >= 2 and m a multiple of p (Megatron's group size N = p).
std::string check_schedule_spec(const ScheduleSpec& spec);

// The schedule of one stage; std::invalid_argument when check_schedule_spec fails or the
// stage is outside [0, p). With stages == 1 (1f1b, zb-h1) it is DeepSpeed's
// DataParallelSchedule (Load, Forward, Backward per micro-batch on buffer 0; one buffer).
StageSchedule make_schedule(const ScheduleSpec& spec, int stage);

// Forward only (evaluation): DeepSpeed's InferenceSchedule for one chunk per stage (m + p − 1
// steps, two buffers, even stages send before they receive, odd stages after; FACTS §8.2).
// With interleaved chunks each rank runs its (micro-batch, chunk) pairs in that order over two
// alternating buffers: every pair waits only on pairs earlier in the same order, so no cycle.
// No step-level instructions: nothing is reduced or updated.
StageSchedule make_inference_schedule(const ScheduleSpec& spec, int stage);

// The schedule's idle share of a step with equal forward, input-grad and weight-grad times:
// 1F1B (p−1)/(m+p−1); interleaved (p−1)/(v·m+p−1); zb-h1 (p−1)/(3m+p−1), a third of 1F1B's
// idle time, once m >= p (below that the last backward chain sets the end: 1 − 3m/(2m+2p−1)).
double bubble_fraction(const ScheduleSpec& spec);

// DeepSpeed's partition_uniform(num_items, num_parts): num_parts + 1 boundaries.
std::vector<int> partition_uniform(int num_items, int num_parts);
// DeepSpeed's partition_balanced(weights, num_parts) (the DP version, ties toward the later split).
std::vector<int> partition_balanced(const std::vector<double>& weights, int num_parts);

}  // namespace zero3d::pipe
