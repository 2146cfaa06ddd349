// test_gpu_training.cpp — the `gpu` label's training checks, through the executable as users
// run it: 10-step losses against the CPU build's (committed in cpu_reference_losses.json by
// make_cpu_reference.sh; block-sparse attention's and Mixture of Experts' too), run-to-run bit identity, two ranks
// sharing one GPU against one rank for each layout, the offload tiers against the run without them,
// and checkpoints crossing between the GPU and the CPU build both ways.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "kernels/device.hpp"
#include "support/cli_helpers.hpp"

namespace {

using namespace cli;

const json& reference() {
  static const json ref = json::parse(slurp(kSource + "/tests/gpu/cpu_reference_losses.json"));
  return ref;
}

std::vector<double> reference_losses(const std::string& model, const std::string& precision) {
  return reference().at(model).at(precision).get<std::vector<double>>();
}

// The same 10 steps the reference script trains (its "args").
std::vector<double> train_losses(const std::string& model, const std::string& extra, int np, const std::string& dir) {
  const Result r = run("train " + kSource + "/input/" + model + ".json --output " + dir + " " +
                           reference().at("args").get<std::string>() + " " + extra,
                       np);
  EXPECT_EQ(r.code, 0) << r.err;
  return losses_of(read_metrics(dir));
}

double max_distance(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}

// fp32 within 1e-5 of the CPU build's losses, step by step.
TEST(GpuTraining, Fp32LossesMatchTheCpuBuild) {
  for (const std::string model : {"quickstart", "gpt-small-cpu", "llama-tiny"}) {
    const std::vector<double> got = train_losses(model, "", 1, temp_path(model + "_fp32"));
    expect_losses_close(got, reference_losses(model, "fp32"), 1e-5, model + " fp32");
  }
}

// bf16 as far from the CPU's fp32 losses as the CPU's own bf16 run is (twice, for rounding
// the device's products do in another order).
TEST(GpuTraining, Bf16LossesStayWithinTheCpusBf16Distance) {
  for (const std::string model : {"quickstart", "gpt-small-cpu", "llama-tiny"}) {
    const std::vector<double> got = train_losses(model, "--set bf16.enabled=true", 1, temp_path(model + "_bf16"));
    const std::vector<double> fp32 = reference_losses(model, "fp32"), bf16 = reference_losses(model, "bf16");
    ASSERT_EQ(got.size(), fp32.size()) << model;
    EXPECT_LE(max_distance(got, fp32), 2 * max_distance(bf16, fp32)) << model;
  }
}

// Deterministic kernels: no atomics in any reduction, so two runs give the same bits.
TEST(GpuTraining, TwoRunsGiveBitIdenticalLosses) {
  for (const std::string precision : {"", "--set bf16.enabled=true"}) {
    const std::vector<double> a = train_losses("quickstart", precision, 1, temp_path("repeat_a"));
    const std::vector<double> b = train_losses("quickstart", precision, 1, temp_path("repeat_b"));
    ASSERT_FALSE(a.empty());
    EXPECT_TRUE(a == b) << "two runs of the quick-start" << precision << " differ";
  }
}

// Two ranks on one GPU (collectives staged through the host) train what one rank trains.
TEST(GpuTraining, TwoRanksSharingOneGpuEqualOneRankInEveryLayout) {
  const std::vector<double> one = train_losses("quickstart", "", 1, temp_path("np1"));
  for (const std::string layout :
       {"--set zero_optimization.stage=1", "--set zero_optimization.stage=2", "--set zero_optimization.stage=3",
        "--set pipeline.stages=2", "--set tensor_parallel.autotp_size=2"}) {
    const std::vector<double> two = train_losses("quickstart", layout, 2, temp_path("np2"));
    expect_losses_close(two, one, 1e-5, "np 2 " + layout);
  }
}

// NCCL refuses two ranks on one GPU: such a job finds them on one PCI address (the device's own,
// not a count of devices) and stages its collectives through the host, and says so.
TEST(GpuTraining, TwoRanksSharingOneGpuSayTheyStageThroughTheHost) {
  if (!zero3d::kernels::kGpuBuild) GTEST_SKIP() << "a CPU build's ranks share no GPU";
  const Result r = run("train " + kSource + "/input/quickstart.json --output " + temp_path("np2_comms") +
                           " --set training.steps=2 --set zero_optimization.stage=2",
                       2);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("comms   collectives on model memory: MPI through page-locked host copies (2 ranks share a GPU, "
                       "which NCCL refuses)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("over 2 data-parallel ranks (mpi (model memory staged through the host))"), std::string::npos)
      << r.out;
}

// The Llama family (GQA split by whole K/V groups under tensor parallelism) likewise.
TEST(GpuTraining, TwoRanksSharingOneGpuTrainTheLlamaFamilyAsOneRank) {
  const std::vector<double> one = train_losses("llama-tiny", "", 1, temp_path("llama_np1"));
  for (const std::string layout : {"--set zero_optimization.stage=3", "--set pipeline.stages=2",
                                   "--set tensor_parallel.autotp_size=2"}) {
    const std::vector<double> two = train_losses("llama-tiny", layout, 2, temp_path("llama_np2"));
    expect_losses_close(two, one, 1e-5, "llama np 2 " + layout);
  }
}

// A GPU keeps a tensor rank's bf16 saves as one rank's are kept (model/bf16_activations.hpp):
// two ranks sharing the GPU at t = 2, plain and sequence-parallel, train one rank's bf16 losses
// within bf16 rounding (a row-parallel product's partial sums round apart from the whole one's,
// as tests/cli/test_cli_tensor_parallel.cpp's bound on the CPU says), and the tensor group moves
// the bytes `estimate` predicts for the build (its sequence-parallel gathers in bf16 on a GPU).
TEST(GpuTraining, TensorRanksKeepingBf16SavesTrainOneRanksBf16Losses) {
  const std::string bf16 = "--set bf16.enabled=true";
  for (const std::string model : {"quickstart", "llama-tiny"}) {
    const std::vector<double> one = train_losses(model, bf16, 1, temp_path(model + "_tp_bf16_np1"));
    for (const std::string sp : {"", " --set tensor_parallel.sequence_parallel=true"}) {
      const std::string layout = bf16 + " --set tensor_parallel.autotp_size=2" + sp, dir = temp_path(model + "_tp_bf16");
      const std::vector<double> two = train_losses(model, layout, 2, dir);
      expect_losses_close(two, one, 5e-4, model + " bf16 np 2, autotp 2" + sp);
      const Result est = run("estimate --config " + kSource + "/input/" + model + ".json --world-size 2 --json " +
                             reference().at("args").get<std::string>() + " " + layout);
      ASSERT_EQ(est.code, 0) << est.err;
      const std::vector<json> rows = read_metrics(dir);
      ASSERT_FALSE(rows.empty());
      EXPECT_EQ(rows.back().at("comm_bytes_by_axis").at("tensor"),
                json::parse(est.out).at("communication").at(0).at("comm_bytes_by_axis").at("tensor"))
          << model << sp;
    }
  }
}

// ZeRO-Offload: DeepSpeed's CPU Adam over host tiers, page-locked or not, partly resident
// (ratio) or on NVMe, trains the device optimizer's losses.
TEST(GpuTraining, ZeroOffloadTrainsTheLossesOfTheDeviceOptimizer) {
  const std::string cpu = " --set zero_optimization.offload_optimizer.device=cpu";
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"--set zero_optimization.stage=2",
       {cpu, cpu + " --set zero_optimization.offload_optimizer.pin_memory=false",
        cpu + " --set zero_optimization.offload_optimizer.ratio=0.5 --set zero_optimization.sub_group_size=20000",
        " --set zero_optimization.offload_optimizer.device=nvme --set zero_optimization.offload_optimizer.nvme_path=" +
            temp_path("offload_swap_fp32")}},
      {"--set zero_optimization.stage=3 --set bf16.enabled=true",
       {cpu, " --set zero_optimization.offload_optimizer.device=nvme --set zero_optimization.offload_optimizer.nvme_path=" +
                 temp_path("offload_swap_bf16")}}};
  int run_id = 0;
  for (const auto& [base, tiers] : cases) {
    const std::vector<double> want = train_losses("quickstart", base, 1, temp_path("offload_none_" + std::to_string(run_id++)));
    ASSERT_FALSE(want.empty());
    for (const std::string& tier : tiers) {
      const std::vector<double> got = train_losses("quickstart", base + tier, 1, temp_path("offload_" + std::to_string(run_id++)));
      expect_losses_close(got, want, 1e-5, base + tier);
    }
  }
}

// ZeRO-Infinity's parameter offload at stage 3: the partition in page-locked host memory that
// the kernels read in place (cpu), or in swap files whose slices are copied into the gather
// buffers (nvme), with the optimizer in device memory, on the host, or partly resident (ratio:
// device kernels on the page-locked sub-group stage), trains the losses of the partition in device
// memory, at one rank and at two sharing the GPU. A run saved with its parameters on NVMe resumes
// without offload. fp32 within 1e-5 (the H200 caught a race there at 0.33); bf16 with the CPU
// optimizer within 3e-4: its fp32 update rounds apart from the device kernel's, and bf16
// parameters turn a last-bit difference of the master into a rounding flip (measured on an H200:
// 9.4e-5 at step 10 with ratio 0.5 at np 1).
TEST(GpuTraining, ParameterOffloadTrainsTheLossesOfTheParametersInDeviceMemory) {
  const std::string param_cpu = " --set zero_optimization.offload_param.device=cpu";
  const std::string optimizer_cpu = " --set zero_optimization.offload_optimizer.device=cpu";
  const auto param_nvme = [](const std::string& tag) {
    return " --set zero_optimization.offload_param.device=nvme --set zero_optimization.offload_param.nvme_path=" +
           temp_path("param_swap_" + tag);
  };
  int run_id = 0;
  for (const std::string base : {"--set zero_optimization.stage=3", "--set zero_optimization.stage=3 --set bf16.enabled=true"})
    for (int np : {1, 2}) {
      const std::string what = base + " at np " + std::to_string(np);
      const std::vector<double> want = train_losses("quickstart", base, np, temp_path("param_none_" + std::to_string(run_id++)));
      ASSERT_EQ(want.size(), 10u) << what;
      for (const std::string& tier :
           {param_cpu, param_cpu + optimizer_cpu, param_nvme("a" + std::to_string(run_id)),
            param_nvme("b" + std::to_string(run_id)) + optimizer_cpu +
                " --set zero_optimization.offload_optimizer.ratio=0.5 --set zero_optimization.sub_group_size=20000"}) {
        const std::string dir = temp_path("param_offload_" + std::to_string(run_id++));
        const std::vector<double> got = train_losses("quickstart", base + tier, np, dir);
        const bool bf16_cpu_optimizer = base.find("bf16") != std::string::npos && tier.find(optimizer_cpu) != std::string::npos;
        expect_losses_close(got, want, bf16_cpu_optimizer ? 3e-4 : 1e-5, what + tier);
        if (tier == param_cpu) {  // the partition's bytes are host memory, and said to be
          const json last = read_metrics(dir).back();
          EXPECT_EQ(last["memory"]["host"], last["memory"]["params"]) << what;
          EXPECT_EQ(last["memory"]["host_is_device"], !zero3d::kernels::kGpuBuild) << what;
        }
      }
    }
  const std::string saved = temp_path("param_nvme_saves");
  const std::vector<double> with_nvme =
      train_losses("quickstart", "--set zero_optimization.stage=3 --set training.save_interval=5" + param_nvme("save"), 1, saved);
  ASSERT_EQ(with_nvme.size(), 10u);
  const std::vector<double> resumed =
      train_losses("quickstart", "--set zero_optimization.stage=3 --set training.resume=" + saved + "/checkpoints/global_step5",
                   1, temp_path("param_nvme_resumed"));
  expect_losses_close(resumed, std::vector<double>(with_nvme.begin() + 5, with_nvme.end()), 1e-5, "resumed from NVMe parameters");
}

// Block-sparse attention: the device form (the layout's index table in model memory, panels
// gathered on the device, batched products) trains the CPU build's losses with per-head fixed
// layouts, and with bigbird's random blocks under attention dropout; two runs give the same bits,
// and two ranks splitting the heads (tensor parallelism: each its heads' layouts and dropout
// bits) train what one rank trains.
TEST(GpuTraining, SparseAttentionTrainsTheLossesOfTheCpuBuild) {
  const json& variants = reference().at("sparse_attention");
  ASSERT_EQ(variants.size(), 2u);
  for (const auto& item : variants.items()) {
    const std::string variant = item.key();
    const json& ref = item.value();
    const std::string args = ref.at("args").get<std::string>();
    const std::vector<double> want = ref.at("fp32").get<std::vector<double>>();
    const std::vector<double> got = train_losses("quickstart", args, 1, temp_path("sparse_" + variant));
    expect_losses_close(got, want, 1e-5, "sparse attention " + variant);
    const std::vector<double> again = train_losses("quickstart", args, 1, temp_path("sparse_again_" + variant));
    EXPECT_TRUE(got == again) << "two runs of sparse attention " << variant << " differ";
    const std::vector<double> two =
        train_losses("quickstart", args + " --set tensor_parallel.autotp_size=2", 2, temp_path("sparse_t2_" + variant));
    expect_losses_close(two, got, 1e-5, "sparse attention " + variant + " np 2, autotp 2");
  }
}

// Mixture of Experts in its device form (kernels/moe_device.hpp): a GPT-2 MoE on
// the quick-start (top-2 of 4 experts dropping half, Jitter noise, sampled second experts) and a
// tiny Mixtral (llama-tiny with 4 SwiGLU experts, top-2, router jitter) train the CPU build's
// losses within 1e-5; two runs give the same bits; at np 2 with ep_size 2 the all-to-all stages
// through the host and the losses stay the one-rank ones.
TEST(GpuTraining, MixtureOfExpertsTrainsTheLossesOfTheCpuBuild) {
  const json& variants = reference().at("moe");
  ASSERT_EQ(variants.size(), 2u);
  for (const auto& item : variants.items()) {
    const std::string variant = item.key();
    const json& ref = item.value();
    const std::string model = ref.at("model").get<std::string>(), args = ref.at("args").get<std::string>();
    const std::vector<double> want = ref.at("fp32").get<std::vector<double>>();
    const std::vector<double> got = train_losses(model, args, 1, temp_path("moe_" + variant));
    expect_losses_close(got, want, 1e-5, "MoE " + variant);
    const std::vector<double> again = train_losses(model, args, 1, temp_path("moe_again_" + variant));
    EXPECT_TRUE(got == again) << "two runs of MoE " << variant << " differ";
    const std::vector<double> ep2 =
        train_losses(model, args + " --set model.moe.ep_size=2", 2, temp_path("moe_ep2_" + variant));
    expect_losses_close(ep2, got, 1e-5, "MoE " + variant + " np 2, ep_size 2");
  }
}

// A checkpoint written by the GPU build at step 5 resumes on the CPU build (ZERO3D_CPU_EXE):
// its first step's loss is the GPU's within 1e-6, the rest within the fp32 distance.
TEST(GpuTraining, ACheckpointSavedOnTheGpuResumesOnTheCpu) {
  const char* cpu_exe = std::getenv("ZERO3D_CPU_EXE");
  if (cpu_exe == nullptr) GTEST_SKIP() << "ZERO3D_CPU_EXE (the CPU build's zero3d) is not set";
  const std::string dir = temp_path("gpu_saves");
  const std::vector<double> gpu = train_losses("quickstart", "--set training.save_interval=5", 1, dir);
  ASSERT_EQ(gpu.size(), 10u);
  const std::string out = temp_path("cpu_resumes");
  const Result r = run_exe(cpu_exe, "train " + kSource + "/input/quickstart.json --output " + out + " " +
                                         reference().at("args").get<std::string>() +
                                         " --set training.resume=" + dir + "/checkpoints/global_step5");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<double> cpu = losses_of(read_metrics(out));
  ASSERT_EQ(cpu.size(), 5u);
  EXPECT_LE(std::fabs(cpu[0] - gpu[5]), 1e-6 * std::fabs(gpu[5]));
  expect_losses_close(cpu, std::vector<double>(gpu.begin() + 5, gpu.end()), 1e-5, "resumed on the CPU");
}

// And the other way round: a checkpoint the CPU build wrote at step 5 resumes on the GPU, its
// first loss the CPU run's step 6 within 1e-6 and the rest within the fp32 tolerance.
TEST(GpuTraining, ACheckpointSavedOnTheCpuResumesOnTheGpu) {
  const char* cpu_exe = std::getenv("ZERO3D_CPU_EXE");
  if (cpu_exe == nullptr) GTEST_SKIP() << "ZERO3D_CPU_EXE (the CPU build's zero3d) is not set";
  const std::string dir = temp_path("cpu_saves");
  const Result r = run_exe(cpu_exe, "train " + kSource + "/input/quickstart.json --output " + dir + " " +
                                         reference().at("args").get<std::string>() + " --set training.save_interval=5");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<double> cpu = losses_of(read_metrics(dir));
  ASSERT_EQ(cpu.size(), 10u);
  const std::vector<double> gpu = train_losses(
      "quickstart", "--set training.resume=" + dir + "/checkpoints/global_step5", 1, temp_path("gpu_resumes"));
  ASSERT_EQ(gpu.size(), 5u);
  EXPECT_LE(std::fabs(gpu[0] - cpu[5]), 1e-6 * std::fabs(cpu[5]));
  expect_losses_close(gpu, std::vector<double>(cpu.begin() + 5, cpu.end()), 1e-5, "resumed on the GPU");
}

}  // namespace
