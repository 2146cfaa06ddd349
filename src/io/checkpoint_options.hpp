// checkpoint_options.hpp — the `checkpoint` section at run time (config.hpp CheckpointOptions;
// DEEPSPEED-FACTS §7). use_node_local_storage lives in save_checkpoint and CheckpointReader
// (checkpoint.hpp: who publishes a tag, which shards a node holds); this file resolves what a
// resume opens under load_universal.
#pragma once

#include <string>

#include "config/config.hpp"

namespace zero3d {

// DeepSpeed's tag file for a universal checkpoint (its load_checkpoint reads it instead of
// `latest` when checkpoint.load_universal is set).
inline constexpr const char* kLatestUniversal = "latest_universal";

// What training.resume opens. With load_universal, "latest" (and "auto") follow
// <save_dir>/latest_universal when the save_dir has one; otherwise, and for a tag or a path,
// the spec is as given. `from` names the tag file that was followed (empty: none here).
struct ResumeTarget {
  std::string spec;
  std::string from;
};
ResumeTarget resume_target(const std::string& resume, const std::string& save_dir, const CheckpointOptions& o);

// Whether save_dir holds a tag file that resume "auto" follows (`latest`, or `latest_universal`
// under load_universal).
bool resumable_checkpoint_exists(const std::string& save_dir, const CheckpointOptions& o);

// The step of the tag training.resume opens, from its name (global_step<N>); -1 for a run that
// starts fresh (no resume, or "auto" with nothing to resume), 0 when the name does not say.
int64_t resumed_step(const std::string& resume, const std::string& save_dir, const CheckpointOptions& o);

}  // namespace zero3d
