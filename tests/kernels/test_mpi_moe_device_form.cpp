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

#include "support/moe_training.hpp"

using namespace zero3d;
using json = nlohmann::json;

namespace {

using test_support::moe_losses_and_norms;
using test_support::tiny_gpt2_moe;

}  // namespace

TEST(MoeDeviceFormExpertParallel, GivesTheCpuFormsLossesAtEpOfTheWorldSize) {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2 && size != 4) GTEST_SKIP() << "runs at np 2 and 4 (ep_size = np over 4 experts)";
  for (const auto& [name, extra] :
       {std::pair<std::string, json>{"top-2 dropping", json::object()},
        {"top-1 RSample without drops", json{{"k", 1}, {"drop_tokens", false}, {"noisy_gate_policy", "RSample"}}},
        {"top-1 RTS", json{{"k", 1}, {"capacity_factor", 0.7}}}}) {
    const json j = tiny_gpt2_moe(size, extra);
    const std::vector<double> cpu = moe_losses_and_norms(j, false), dev = moe_losses_and_norms(j, true);
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
