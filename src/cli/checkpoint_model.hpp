// checkpoint_model.hpp — what `eval` and `generate` share: a config's model at its layout, with
// the parameters of a checkpoint (or the config's initial weights) and nothing that trains on.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>

#include "base/watchdog.hpp"
#include "config/config.hpp"
#include "parallel/topology.hpp"
#include "train/engine.hpp"

namespace zero3d::cli {

// The parameters come from a checkpoint given on the command line: no resume, no saves.
inline void without_resume_or_saves(Config& cfg) {
  cfg.training.resume.clear();
  cfg.training.save_interval = 0;
  cfg.resolved["training"]["resume"] = "";
  cfg.resolved["training"]["save_interval"] = 0;
}

// The ranks' groups, the watchdog and the engine (members in that order: each needs the one
// before), and the step of the loaded checkpoint (0: the initial weights).
struct CheckpointModel {
  ProcessGroups groups;
  Watchdog watchdog;
  Engine engine;
  int64_t step = 0;
  CheckpointModel(const Config& cfg, MPI_Comm world, int rank, const std::string& checkpoint, const std::string& tag)
      : groups(ProcessTopology::pipe_data_model(cfg.pipeline.stages, world_size(world) / (cfg.pipeline.stages * cfg.tensor.size),
                                                cfg.tensor.size),
               world, static_cast<int>(cfg.model.moe.ep_size), data_shards(cfg.zero)),
        watchdog(cfg.training.comms_timeout, rank),
        engine(cfg, groups, "", &watchdog),
        step(checkpoint.empty() ? 0 : engine.load_checkpoint_params(checkpoint, tag)) {}

 private:
  static int world_size(MPI_Comm world) {
    int size = 1;
    MPI_Comm_size(world, &size);
    return size;
  }
};

}  // namespace zero3d::cli
