// pipe_plan.hpp — which layers each pipeline stage runs (DeepSpeed PipelineModule's
// partitioning, DEEPSPEED-FACTS §8.3) for the GPT-2 layer list. Pure: no MPI, no Kokkos.
//
// The partitionable layer list is [embedding, block × L, final]: `embedding` holds wte and
// wpe, `final` is ln_f with the tied LM head and the loss. As DeepSpeed counts a
// TiedLayerSpec on every owner, `parameters` counts wte in both embedding and final.
// With v virtual stages (interleaved 1F1B) the list is cut into p·v parts and part k runs
// on stage k mod p as its chunk k div p (Megatron's round-robin assignment).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/pipe_schedule.hpp"

namespace zero3d {

enum class PartitionMethod { Parameters, Uniform, Type };

// The `pipeline` section (DEEPSPEED-FACTS-2 §2.1 plus zero3d's schedule keys).
struct PipelineConfig {
  int stages = 1;                 // p; DeepSpeed's "auto" = 1
  PartitionMethod partition = PartitionMethod::Parameters;
  std::string type_regex;         // for PartitionMethod::Type ("type:<regex>")
  std::string partition_name = "parameters";
  pipe::ScheduleKind schedule = pipe::ScheduleKind::OneFOneB;
  std::string schedule_name = "1f1b";
  int virtual_stages = 1;         // v (interleaved)
};

struct PipeLayer {
  std::string kind;  // "embedding", "block", "final" (what type:<regex> matches)
  int block = -1;    // block index for kind "block"
  int64_t params = 0;
};

// The layer list of a GPT-2 shape.
std::vector<PipeLayer> gpt_pipe_layers(int64_t vocab, int64_t positions, int64_t n_layer, int64_t n_embd);
// The layer list of a decoder whose embedding, blocks and final layer hold these many parameters
// (the Llama family: the final layer counts the LM head, tied or not).
std::vector<PipeLayer> decoder_pipe_layers(int64_t embedding, int64_t block, int64_t n_layer, int64_t final);

// p·v + 1 boundaries into the layer list; std::invalid_argument with the numbers when a
// part would be empty or the regex is invalid or matches nothing.
std::vector<int> partition_pipe_layers(const std::vector<PipeLayer>& layers, const PipelineConfig& pc);

}  // namespace zero3d
