// config/activation_checkpointing.cpp — the `activation_checkpointing` section (DEEPSPEED-FACTS
// §9.1, FACTS-2 §6.1) with DeepSpeed's keys, plus zero3d's recompute_granularity, and the
// interval that turns it on (pipeline.activation_checkpoint_interval).
#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "config/section.hpp"

namespace zero3d::config_detail {

namespace {

const char* const kIntervalKey = "pipeline.activation_checkpoint_interval";

// Checkpoints one micro-batch's forward takes on a rank: ceil(blocks / interval) for the
// rank's largest chunk (its blocks lie between the chunk's bounds, less the embedding and head).
int64_t checkpoints_per_forward(const Config& c, int interval) {
  int64_t most = 0;
  const int64_t layers = c.model.n_layer + 2;
  for (size_t k = 0; k + 1 < c.pipe_bounds.size(); ++k) {
    const int64_t first = std::max<int64_t>(c.pipe_bounds[k], 1), last = std::min<int64_t>(c.pipe_bounds[k + 1], layers - 1);
    const int64_t blocks = std::max<int64_t>(0, last - first);
    most = std::max(most, (blocks + interval - 1) / interval);
  }
  return most;
}

std::string forward_description(const Config& c, int interval) {
  return std::to_string(c.model.n_layer) + " blocks" + (c.pipe_bounds.size() > 2 ? " over the pipeline's chunks" : "") +
         ", interval " + std::to_string(interval);
}

}  // namespace

// DeepSpeed's asserts (contiguous needs partitioning and number_checkpoints) are kept; keys that
// would have nothing to act on are rejected instead of ignored. DeepSpeed's section only
// configures deepspeed.checkpointing; the model decides what to checkpoint. Megatron-DeepSpeed's
// configs set these options and checkpoint with --checkpoint-activations, whose default
// --checkpoint-num-layers is 1, and pass num_checkpoints=num_layers to configure(); so with the
// interval absent, an option that acts only on checkpointed blocks checkpoints every block, and
// contiguous_memory_optimization sizes its buffer for one forward. An explicit 0 stays off.
ActivationCheckpointing read_activation_checkpointing(Section& top, const Config& c, std::optional<int> interval) {
  Section sec = top.child("activation_checkpointing");
  ActivationCheckpointing a;
  const std::string granularity = sec.choice("recompute_granularity", "full", {"full", "selective"});
  a.granularity = granularity == "full" ? RecomputeGranularity::Full : RecomputeGranularity::Selective;
  a.partition_activations = sec.boolean("partition_activations", false);
  a.cpu_checkpointing = sec.boolean("cpu_checkpointing", false);
  a.contiguous_memory_optimization = sec.boolean("contiguous_memory_optimization", false);
  const bool number_given = sec.has("number_checkpoints") && !sec.raw("number_checkpoints")->is_null();
  if (number_given) a.number_checkpoints = sec.integer("number_checkpoints", 0, 1, 1 << 20);
  else sec.record("number_checkpoints", nullptr);
  a.synchronize_checkpoint_boundary = sec.boolean("synchronize_checkpoint_boundary", false);
  a.profile = sec.boolean("profile", false);
  sec.finish();
  // {key, set, implies checkpointing}: the options that say how checkpointed blocks are stored or
  // recomputed imply them (Megatron's configs); the diagnostics (timing, barriers) do not, since
  // turning full recompute on to time it would cost a third more compute.
  struct Option {
    const char* key;
    bool set, implies;
  };
  const Option options[] = {
      {"recompute_granularity", a.granularity != RecomputeGranularity::Full, true},
      {"partition_activations", a.partition_activations, true},
      {"cpu_checkpointing", a.cpu_checkpointing, true},
      {"contiguous_memory_optimization", a.contiguous_memory_optimization, true},
      {"number_checkpoints", a.number_checkpoints > 0, true},
      {"synchronize_checkpoint_boundary", a.synchronize_checkpoint_boundary, false},
      {"profile", a.profile, false}};
  const char* first_set = nullptr;
  for (const Option& o : options)
    if (o.set && o.implies && !first_set) first_set = o.key;
  const bool implied = !interval && first_set;
  if (implied) {
    interval = 1;
    top.child("pipeline").record("activation_checkpoint_interval", 1);
    top.note(std::string("auto    ") + kIntervalKey + " = 1 (absent, and activation_checkpointing." + first_set +
             " acts only on checkpointed blocks: every block is checkpointed, as Megatron's --checkpoint-activations "
             "with its default --checkpoint-num-layers 1)");
  }
  a.interval = interval.value_or(0);
  if (!a.enabled()) {
    for (const Option& o : options)
      if (o.set)
        sec.report_key(o.key, std::string("no block is checkpointed: set `") + kIntervalKey +
                                  "` (blocks per checkpoint) to 1 or more" +
                                  (o.implies ? ", or leave it out to checkpoint every block"
                                             : " (this diagnostic does not turn checkpointing on)"));
    return a;
  }
  if (a.contiguous_memory_optimization && !number_given) {
    a.number_checkpoints = checkpoints_per_forward(c, a.interval);
    sec.record("number_checkpoints", a.number_checkpoints);
    sec.note("auto    " + sec.key_path("number_checkpoints") + " = " + std::to_string(a.number_checkpoints) +
             " (absent, and contiguous_memory_optimization needs the buffer's slots: the checkpoints one "
             "micro-batch's forward takes on a rank, " + forward_description(c, a.interval) +
             "; Megatron passes num_checkpoints=num_layers)");
  }
  const char* input_option = a.partition_activations ? "partition_activations"
                             : a.cpu_checkpointing   ? "cpu_checkpointing"
                             : a.contiguous_memory_optimization ? "contiguous_memory_optimization" : nullptr;
  if (a.selective() && input_option)
    sec.report_key(input_option, "selective recompute saves no checkpoint inputs (each block keeps its activations but "
                               "the attention probabilities); use recompute_granularity \"full\"");
  if (a.contiguous_memory_optimization && !a.partition_activations)
    sec.report_key("contiguous_memory_optimization",
                 "the contiguous buffer holds partitioned inputs: it needs partition_activations true (as in DeepSpeed)");
  if (a.number_checkpoints > 0 && !a.contiguous_memory_optimization)
    sec.report_key("number_checkpoints", "sizes the contiguous buffer: it needs contiguous_memory_optimization true");
  if (a.partition_activations && c.tensor.sequence_parallel)
    sec.report_key("partition_activations", "with tensor_parallel.sequence_parallel every tensor rank already holds "
                                          "only its own tokens of a checkpoint input: there is no replica to split");
  if (a.full() && c.pipeline.schedule == pipe::ScheduleKind::ZeroBubbleH1)
    top.report(kIntervalKey, std::string(implied ? "(1, implied by activation_checkpointing." : "") +
                                 (implied ? std::string(first_set) + ") " : std::string()) +
                                 "full recompute cannot serve the zb-h1 schedule: its weight-gradient pass reads each "
                                 "block's activations after the input-gradient pass has released them; use "
                                 "activation_checkpointing.recompute_granularity \"selective\" or schedule 1f1b");
  if (a.contiguous_memory_optimization && a.number_checkpoints > 0) {
    const int64_t most = checkpoints_per_forward(c, a.interval);
    if (a.number_checkpoints < most)
      sec.report_key("number_checkpoints", "value " + std::to_string(a.number_checkpoints) + " is less than the " +
                                             std::to_string(most) + " checkpoints one micro-batch's forward takes (" +
                                             forward_description(c, a.interval) + ")");
  }
  return a;
}

}  // namespace zero3d::config_detail
