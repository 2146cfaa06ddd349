// test_mpi_moe_device_form.cpp — expert parallelism through the MoE device form (kernels/
// moe_device.hpp, under moe_device_form_on_host()): at np 2 with ep_size 2 each rank holds half
// the experts (at np 4, ep_size 4: one each), the dispatched rows cross in the all-to-all (its counts are the device form's
// per-expert figures copied to the host), and without drop_tokens the capacity is the group's
// MAX of the device form's counts. The losses and gradient norms are the CPU form's within 1e-5.
// Run at np 2 or 4 (mpirun -np 2 zero3d_mpi_tests --gtest_filter=MoeDeviceFormExpertParallel.*).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.hpp"
#include "kernels/moe.hpp"
#include "parallel/topology.hpp"
#include "train/engine.hpp"
#include "zero/shard_groups.hpp"

using namespace zero3d;
using json = nlohmann::json;

namespace {

json gpt2_moe(int ep, const json& moe_extra) {
  json moe = {{"num_experts", 4}, {"k", 2}, {"capacity_factor", 0.5}, {"min_capacity", 2}, {"ep_size", ep}};
  moe.update(moe_extra);
  return json{{"train_batch_size", 8},
              {"train_micro_batch_size_per_gpu", 2},
              {"gradient_clipping", 0.05},
              {"steps_per_print", 1000},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
              {"model", {{"vocab_size", 61}, {"n_positions", 16}, {"n_layer", 2}, {"n_head", 2}, {"n_embd", 16},
                         {"moe", moe}}},
              {"training", {{"steps", 4}, {"seed", 11}}}};
}

std::vector<double> train(const json& j, bool device_form) {
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

}  // namespace

TEST(MoeDeviceFormExpertParallel, GivesTheCpuFormsLossesAtEpOfTheWorldSize) {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2 && size != 4) GTEST_SKIP() << "runs at np 2 and 4 (ep_size = np over 4 experts)";
  for (const auto& [name, extra] :
       {std::pair<std::string, json>{"top-2 dropping", json::object()},
        {"top-1 RSample without drops", json{{"k", 1}, {"drop_tokens", false}, {"noisy_gate_policy", "RSample"}}},
        {"top-1 RTS", json{{"k", 1}, {"capacity_factor", 0.7}}}}) {
    const json j = gpt2_moe(size, extra);
    const std::vector<double> cpu = train(j, false), dev = train(j, true);
    ASSERT_EQ(cpu.size(), 8u);
    ASSERT_EQ(dev.size(), cpu.size());
    double worst = 0.0;
    for (size_t i = 0; i < cpu.size(); ++i) worst = std::max(worst, std::fabs(dev[i] - cpu[i]) / std::fabs(cpu[i]));
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0)
      std::printf("[ moe      ] ep %d, %s: losses and gradient norms within %.1e of the CPU form's\n", size,
                  name.c_str(), worst);
    for (size_t i = 0; i < cpu.size(); ++i)
      EXPECT_NEAR(dev[i], cpu[i], 1e-5 * std::fabs(cpu[i])) << name << " step " << i / 2 + 1;
    EXPECT_NE(cpu.front(), cpu[cpu.size() - 2]) << name << ": the model trains";
  }
}
