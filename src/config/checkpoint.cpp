// config/checkpoint.cpp — the `checkpoint` section (DEEPSPEED-FACTS §1.4 and §7; DeepSpeed's
// runtime/config.py get_checkpoint_params and the engine's save_checkpoint / load_checkpoint).
#include "config/section.hpp"

namespace zero3d::config_detail {

CheckpointOptions read_checkpoint_section(Section& top, const Config& c) {
  CheckpointOptions o;
  Section sec = top.child("checkpoint");
  // DeepSpeed all-reduces a hash of the tag and warns or fails on a mismatch
  // (_checkpoint_tag_validation); zero3d derives the tag from the step on every rank
  // (global_stepN), so every mode passes.
  o.tag_validation = sec.choice("tag_validation", "Warn", {"Ignore", "Warn", "Fail"});
  o.load_universal = sec.boolean("load_universal", false);
  if (o.load_universal)
    sec.note("note    `checkpoint.load_universal` = true: resume \"latest\" reads the tag from " +
             (c.training.save_dir.empty() ? std::string("save_dir") : c.training.save_dir) +
             "/latest_universal when it exists (DeepSpeed's name for a universal checkpoint's tag), else from "
             "`latest`; every zero3d tag is universal: each rank reads its range of every tensor at any layout");
  o.use_node_local_storage = sec.boolean("use_node_local_storage", false);
  // Where the ranks run is known only at start-up (agreement.cpp check_node_placement).
  if (o.use_node_local_storage && c.zero.gather_16bit_weights_on_model_save)
    sec.note("note    `checkpoint.use_node_local_storage` = true with "
             "`zero_optimization.stage3_gather_16bit_weights_on_model_save`: one node only; train stops at start-up "
             "(exit 2) when its ranks span more nodes (rank 0 writes the consolidated weights from every rank's shard)");
  {
    Section pw = sec.child("parallel_write");
    o.parallel_write_pipeline_stage = pw.boolean("pipeline_stage", false);
    if (pw.has("pipeline_stage") && !o.parallel_write_pipeline_stage)
      pw.note("note    `checkpoint.parallel_write.pipeline_stage` = false: DeepSpeed's data-parallel rank 0 then writes "
              "its stage's layers alone; zero3d's ranks always write their own slices (what true asks for), and the "
              "saved state is the same");
    pw.finish();
  }
  // DeepSpeed's fast/decoupled checkpoint writers: torch.save variants with nothing to replace here.
  sec.accept_default_only("checkpoint_serialization", true);
  sec.feature_missing("writer", nullptr, "pluggable checkpoint writers (DeepSpeed's fast and decoupled engines)",
                      "remove the key: each rank writes its HDF5 shard itself");
  sec.finish();
  return o;
}

}  // namespace zero3d::config_detail
