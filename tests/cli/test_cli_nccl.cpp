// The engine's collectives on NCCL, black-box, where no GPU is: zero3d_nccl_sim is zero3d with
// src/parallel/comm_nccl.cpp built over the fake NCCL (tests/fake_nccl/fake_nccl.hpp), which
// carries every call through MPI on host memory and refuses what NCCL forbids (overlapping
// buffers, a call not ordered after the kernels). In every layout whose groups carry model memory
// (data parallelism at ZeRO 1-3, tensor parallelism, experts, a pipeline's data groups, ZeRO++'s
// MiCS, hpZ and qgZ groups), training over NCCL gives the MPI build's losses (bit for bit where a
// sum has two terms), NCCL carried the groups' collectives, and none was refused. A build with the
// real NCCL runs it on GPUs instead (the `gpu` label).
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

#ifdef ZERO3D_NCCL_SIM_EXE
const std::string kNcclSim = build_path("ZERO3D_TEST_NCCL_SIM_EXE", ZERO3D_NCCL_SIM_EXE);
#endif

// The tensor-parallel suite's model (V=61, H=4, L=3), 16 samples in micro-batches of 4, clipping on.
json nccl_config() {
  return json{{"train_batch_size", 16},
              {"train_micro_batch_size_per_gpu", 4},
              {"gradient_clipping", 0.05},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
              {"model", {{"vocab_size", 61}, {"n_positions", 16}, {"n_layer", 3}, {"n_head", 4}, {"n_embd", 32}}},
              {"training", {{"steps", 6}, {"seed", 11}, {"peak_gflops", 50}}},
              {"steps_per_print", 100}};
}

struct TrainResult {
  Result result;
  std::vector<double> losses;
  std::map<std::string, std::string> nccl;  // rank 0's fake-NCCL report (fake_nccl.hpp), empty if none
};

TrainResult train(const std::string& exe, int np, const std::string& name, const std::string& args, const std::string& env = "") {
  const std::string config = write_config("nccl.json", nccl_config());
  const std::string dir = temp_path("nccl_" + name), report = temp_path("nccl_report_" + name);
  std::system(("rm -rf " + dir + " " + report + " && mkdir -p " + report).c_str());
  TrainResult r;
  r.result = run_exe(exe, "train " + config + " --output " + dir + " " + args, np,
                     "ZERO3D_FAKE_NCCL_REPORT=" + report + " " + env);
  r.losses = losses_of(read_metrics(dir));
  std::ifstream in(report + "/rank0.txt");
  for (std::string key, value; in >> key && std::getline(in >> std::ws, value);) r.nccl[key] = value;
  return r;
}

int64_t count(const TrainResult& r, const std::string& op) { return r.nccl.count(op) ? std::stoll(r.nccl.at(op)) : 0; }

struct Layout {
  int np;
  std::string args, name;
  std::vector<std::string> nccl_ops;  // what NCCL must have carried on rank 0 (one of them at least)
  std::string env = "";
  // Sums of two ranks have one result in any order; four ranks' follow MPI's ring on one side and
  // the fake's MPI_Reduce tree on the other, so their losses agree within fp32 rounding instead.
  bool bits = true;
};
class NcclLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(NcclLayout, TrainsTheMpiBuildsLossesWithNcclCarryingTheGroupsCollectives) {
#ifndef ZERO3D_NCCL_SIM_EXE
  GTEST_SKIP() << "this build has the real NCCL: the gpu label runs it";
#else
  const Layout& l = GetParam();
  const TrainResult mpi = train(kExe, l.np, l.name + "_mpi", l.args, l.env);
  const TrainResult nccl = train(kNcclSim, l.np, l.name + "_nccl", l.args, l.env);
  ASSERT_EQ(mpi.result.code, 0) << mpi.result.err;
  ASSERT_EQ(nccl.result.code, 0) << nccl.result.err;
  ASSERT_EQ(mpi.losses.size(), 6u);
  if (l.bits) {
    EXPECT_EQ(nccl.losses, mpi.losses) << l.name;
  } else {
    expect_losses_close(nccl.losses, mpi.losses, 1e-6, l.name);
  }
  EXPECT_NE(nccl.result.out.find("comms   collectives on model memory: NCCL 2.28.9 (each rank has a GPU of its own)"),
            std::string::npos)
      << nccl.result.out;
  EXPECT_EQ(mpi.result.out.find("comms "), std::string::npos) << "a CPU build without NCCL has nothing to say";
  ASSERT_FALSE(nccl.nccl.empty()) << "no fake-NCCL report: the world's communicator was never destroyed";
  EXPECT_EQ(nccl.nccl.at("refused"), "none");
  int64_t carried = 0;
  for (const std::string& op : l.nccl_ops) carried += count(nccl, op);
  EXPECT_GT(carried, 0) << l.name << ": NCCL carried none of the layout's collectives";
#endif
}

INSTANTIATE_TEST_SUITE_P(
    Groups, NcclLayout,
    ::testing::Values(Layout{2, "--set zero_optimization.stage=1", "d2_z1", {"reduce_scatter", "reduce", "all_reduce"}},
                      Layout{2, "--set zero_optimization.stage=2 --set zero_optimization.overlap_comm=true "
                                "--set bf16.enabled=true",
                             "d2_z2_bf16_overlap", {"reduce_scatter", "reduce"}},
                      Layout{2, "--set zero_optimization.stage=3", "d2_z3", {"all_gather", "broadcast"}},
                      Layout{2, "--set tensor_parallel.autotp_size=2", "t2", {"all_reduce"}},
                      Layout{2,
                             "--set model.moe.num_experts=4 --set model.moe.k=2 --set model.moe.ep_size=2 "
                             "--set model.moe.capacity_factor=0.5 --set model.moe.min_capacity=2",
                             "moe_ep2", {"send"}},
                      Layout{4, "--set pipeline.stages=2 --set zero_optimization.stage=1", "p2_d2_z1",
                             {"reduce_scatter", "reduce", "all_reduce"}},
                      // ZeRO++'s groups: MiCS's shard and replica groups; hpZ's secondary partition
                      // with qgZ's all-to-all over two (emulated) nodes
                      Layout{4, "--set zero_optimization.stage=3 --set zero_optimization.mics_shard_size=2", "d4_mics2",
                             {"all_gather", "broadcast"}},
                      Layout{4,
                             "--set zero_optimization.stage=3 --set zero_optimization.zero_hpz_partition_size=2 "
                             "--set zero_optimization.zero_quantized_gradients=true",
                             "d4_hpz2_qgz", {"send"}, "ZERO3D_RANKS_PER_NODE=2", false}),
    [](const ::testing::TestParamInfo<Layout>& i) { return i.param.name; });

// Ranks that share a GPU cannot use NCCL (it refuses them): such a job says so and trains over MPI.
TEST(NcclRanks, SharingAGpuTrainsOverMpiAndSaysWhy) {
#ifndef ZERO3D_NCCL_SIM_EXE
  GTEST_SKIP() << "this build has the real NCCL: the gpu label runs it";
#else
  const TrainResult mpi = train(kExe, 2, "shared_mpi", "--set zero_optimization.stage=2");
  const TrainResult shared = train(kNcclSim, 2, "shared", "--set zero_optimization.stage=2", "ZERO3D_FAKE_GPU_SHARED=1");
  ASSERT_EQ(shared.result.code, 0) << shared.result.err;
  EXPECT_EQ(shared.losses, mpi.losses);
  EXPECT_NE(shared.result.out.find("comms   collectives on model memory: MPI (2 ranks share a GPU, which NCCL refuses)"),
            std::string::npos)
      << shared.result.out;
  EXPECT_TRUE(shared.nccl.empty()) << "NCCL was opened";
#endif
}

// A pipeline whose head is untied has no group but the pipe's spanning ranks, and the pipe's traffic
// is point-to-point (MPI's tags): NCCL is not opened for nothing.
TEST(NcclRanks, APipelineWithAnUntiedHeadOpensNoNccl) {
#ifndef ZERO3D_NCCL_SIM_EXE
  GTEST_SKIP() << "this build has the real NCCL: the gpu label runs it";
#else
  const std::string dir = temp_path("nccl_untied_pipe");
  const Result r = run_exe(kNcclSim, "train " + kSource + "/input/llama-tiny.json --output " + dir +
                                         " --set pipeline.stages=2 --set training.steps=3", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("comms   collectives on model memory: MPI (no group but the pipeline's spans ranks)"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(losses_of(read_metrics(dir)).size(), 3u);
#endif
}

}  // namespace
