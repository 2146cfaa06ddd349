// moe_training.hpp — what the MoE device-form tests share (tests/kernels/test_moe_device_form.cpp
// and its expert-parallel MPI twin): a tiny GPT-2 with MoE, and its losses and gradient norms
// trained through the engine with the CPU form or the device form (moe_device_form_on_host()).
#pragma once

#include <mpi.h>

#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.hpp"
#include "kernels/moe.hpp"
#include "parallel/topology.hpp"
#include "train/engine.hpp"
#include "zero/shard_groups.hpp"

namespace test_support {

// Two MoE blocks, top-2 over 4 experts dropping about half (capacity factor 0.5), ep_size `ep`;
// `moe_extra` overrides or adds model.moe keys.
inline nlohmann::json tiny_gpt2_moe(int ep = 1, const nlohmann::json& moe_extra = nlohmann::json::object()) {
  nlohmann::json moe = {{"num_experts", 4}, {"k", 2}, {"capacity_factor", 0.5}, {"min_capacity", 2}, {"ep_size", ep}};
  moe.update(moe_extra);
  return {{"train_batch_size", 8},
          {"train_micro_batch_size_per_gpu", 2},
          {"gradient_clipping", 0.05},
          {"steps_per_print", 1000},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
          {"model",
           {{"vocab_size", 61}, {"n_positions", 16}, {"n_layer", 2}, {"n_head", 2}, {"n_embd", 16}, {"moe", moe}}},
          {"training", {{"steps", 4}, {"seed", 11}}}};
}

// Each step's loss and gradient norm, in turn, over MPI_COMM_WORLD (one data-parallel group).
inline std::vector<double> moe_losses_and_norms(const nlohmann::json& j, bool device_form) {
  using namespace zero3d;
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const Config cfg = read_config(j, "moe_device_form.json", size);
  ProcessGroups groups(ProcessTopology::pipe_data_model(1, size, 1), MPI_COMM_WORLD,
                       static_cast<int>(cfg.model.moe.ep_size), data_shards(cfg.zero));
  kernels::moe::moe_device_form_on_host() = device_form;
  std::vector<double> out;
  {
    Engine engine(cfg, groups, "");
    for (const StepResult& r : engine.train()) out.push_back(r.loss), out.push_back(r.grad_norm);
  }
  kernels::moe::moe_device_form_on_host() = false;
  return out;
}

}  // namespace test_support
