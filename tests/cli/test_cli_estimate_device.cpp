// test_cli_estimate_device.cpp — `zero3d estimate --device gpu`: a CPU build on a login node sizes
// a GPU run before the GPU hours are bought. The reference is a GPU build's own plan
// (tests/golden/gpu_plan.json, written by make_gpu_plan_goldens.py with a CUDA build, whose sizes
// come from the kernels it compiled): the GPU's attention kernels, bf16 logits, the vocabulary padded
// to 128, page-locked offload stages, device memory. A CPU build must give every byte of it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "io/h5.hpp"
#include "kernels/device.hpp"
#include "support/cli_helpers.hpp"

namespace {

using namespace cli;

const json& gpu_plans() {
  static const json plans = json::parse(slurp(kSource + "/tests/golden/gpu_plan.json"));
  return plans;
}

// The case's command line (configs are the repository's input/), its environment as a prefix.
std::string estimate_args(const json& c) {
  std::string args = "estimate --config " + kSource + "/" + c["config"].get<std::string>() + " --json";
  for (const json& o : c["options"]) args += " " + o.get<std::string>();
  for (const json& s : c["set"]) args += " --set " + s.get<std::string>();
  return args;
}
std::string env_prefix(const json& c) {
  std::string prefix;
  for (const auto& [name, value] : c["env"].items()) prefix += (prefix.empty() ? "" : " ") + name + "=" + value.get<std::string>();
  return prefix;
}

// The plan without what names the input (the config's path) or the build that planned it.
json plan_of(json doc) {
  doc.erase("config");
  doc.erase("device");
  return doc;
}

// Every case: the budgets of every stage and pipeline rank, what fits --memory-per-rank, the
// parameters (the padded vocabulary's), the bytes by link: the GPU build's, field for field.
TEST(EstimateDevice, ACpuBuildPlansAGpuRunByteForByteAsTheGpuBuildDoes) {
  ASSERT_GE(gpu_plans()["cases"].size(), 18u);
  for (const json& c : gpu_plans()["cases"]) {
    const std::string name = c["name"];
    const Result r = run(estimate_args(c) + " --device gpu", 0, env_prefix(c));
    ASSERT_EQ(r.code, 0) << name << ": " << r.err;
    const json got = json::parse(r.out);
    EXPECT_EQ(got["device"], "gpu") << name;
    const json want = plan_of(c["estimate"]), have = plan_of(got);
    for (const auto& [key, value] : want.items()) EXPECT_EQ(have[key], value) << name << ": " << key;
    EXPECT_EQ(have.size(), want.size()) << name;
  }
}

// Why the option exists: a CPU build's own plan of the same config is another plan (fp32 logits, its
// attention tiles or AVX512-BF16's fused kernel, no vocabulary padding), so a GPU job sized with it
// would be sized wrong. `--device cpu` is that plan, as is no --device at all.
TEST(EstimateDevice, ACpuBuildsOwnPlanIsNotAGpuRunsAndDeviceCpuIsItsOwn) {
  if (zero3d::kernels::kGpuBuild) GTEST_SKIP() << "a GPU build plans a GPU run by default";
  for (const json& c : gpu_plans()["cases"]) {
    const std::string name = c["name"];
    const Result own = run(estimate_args(c), 0, env_prefix(c)), cpu = run(estimate_args(c) + " --device cpu", 0, env_prefix(c));
    ASSERT_EQ(own.code, 0) << name << ": " << own.err;
    ASSERT_EQ(cpu.code, 0) << name << ": " << cpu.err;
    EXPECT_EQ(json::parse(own.out)["device"], "cpu");
    EXPECT_EQ(own.out, cpu.out) << name;
    EXPECT_NE(json::parse(own.out)["budgets"], c["estimate"]["budgets"]) << name;
  }
}

// The text says whose plan it is, and the offload rows say the device holds `in device memory`.
TEST(EstimateDevice, TheTextSaysTheBudgetIsAGpuRunsAndWhereOffloadPutsItsBytes) {
  const json& offload = gpu_plans()["cases"][5];
  ASSERT_EQ(offload["name"], "gpt2_bf16_offload_optimizer");
  std::string args = estimate_args(offload);
  args.erase(args.find(" --json"), 7);
  const Result r = run(args + " --device gpu");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count(r.out, "(--device gpu: the plan of a GPU build's run"), zero3d::kernels::kGpuBuild ? 0u : 1u) << r.out;
  EXPECT_NE(r.out.find("`in device memory` is what the GPU holds"), std::string::npos) << r.out;
  // where nothing fits --memory-per-rank, what micro-batch 1 needs is device memory
  const Result none = run(args + " --device gpu --memory-per-rank 1GiB");
  ASSERT_EQ(none.code, 0) << none.err;
  EXPECT_EQ(count(none.out, "device memory at micro-batch 1"), 4u) << none.out;
}

// An "auto" micro-batch fits the memory the run will have. This machine's is not a GPU's, and no
// device has started to give its own, so a GPU run's plan takes Hugging Face's default of 8; the
// CPU's plan fits GPT-3's 175B shape into this machine (micro-batch 1: nothing fits).
TEST(EstimateDevice, AnAutoMicroBatchOfAGpuRunIsNotFittedToThisMachinesMemory) {
  const std::string args = "estimate --config " + kSource +
                           "/input/gpt2-124m.json --json --set train_micro_batch_size_per_gpu=auto "
                           "--set model.n_layer=96 --set model.n_embd=12288 --set model.n_head=96";
  const Result gpu = run(args + " --device gpu");
  ASSERT_EQ(gpu.code, 0) << gpu.err;
  EXPECT_EQ(json::parse(gpu.out)["budgets"][0]["micro_batch"], 8);
  if (zero3d::kernels::kGpuBuild) return;
  const Result cpu = run(args);
  ASSERT_EQ(cpu.code, 0) << cpu.err;
  EXPECT_EQ(json::parse(cpu.out)["budgets"][0]["micro_batch"], 1);
}

// Given --memory-per-rank, an "auto" micro-batch is fitted to it (at most Hugging Face's 8), as a GPU
// run fits it to its device: the largest that fits at the configured stage, the budget's own.
TEST(EstimateDevice, AnAutoMicroBatchIsFittedToTheMemoryPerRankGiven) {
  const std::string args = "estimate --config " + kSource +
                           "/input/gpt2-124m.json --json --set bf16.enabled=true "
                           "--set train_micro_batch_size_per_gpu=auto --memory-per-rank 6GiB";
  for (const std::string device : {"gpu", "cpu"}) {
    if (device == "cpu" && zero3d::kernels::kGpuBuild) continue;
    const Result r = run(args + " --device " + device);
    ASSERT_EQ(r.code, 0) << r.err;
    const json est = json::parse(r.out);
    const int64_t fits = est["largest_micro_batch"][est["configured_stage"].get<int>()];
    EXPECT_EQ(est["budgets"][0]["micro_batch"], std::min<int64_t>(8, fits)) << device;
    if (device == "gpu") {
      EXPECT_LT(fits, 8) << "6 GiB holds fewer than 8 of a GPU's GPT-2 124M bf16 micro-batches";
    }
  }
}

// --report records whose plan it is.
TEST(EstimateDevice, TheReportNamesTheDevicePlannedFor) {
  const std::string report = temp_path("estimate_device.h5");
  ASSERT_EQ(run("estimate --config " + kSource + "/input/quickstart.json --device gpu --report " + report).code, 0);
  zero3d::h5::File f = zero3d::h5::File::open_read(report);
  std::string device;
  ASSERT_TRUE(zero3d::h5::read_attribute(f.id(), "device", device));
  EXPECT_EQ(device, "gpu");
}

// `validate --device gpu` checks a GPU run's config on a login node: the GPU's plan (the device memory
// estimate's budget holds at the configured stage), not held against this machine's memory.
TEST(EstimateDevice, ValidateOfAGpuRunPrintsItsDeviceMemoryAndDoesNotHoldItToThisMachine) {
  const json& c = gpu_plans()["cases"][1];
  ASSERT_EQ(c["name"], "gpt2_bf16");
  std::string sets;
  for (const json& s : c["set"]) sets += " --set " + s.get<std::string>();
  const std::string validate = "validate " + kSource + "/" + c["config"].get<std::string>() + sets;
  const Result r = run(validate + " --device gpu");
  ASSERT_EQ(r.code, 0) << r.err;
  char line[160];
  std::snprintf(line, sizeof line, "memory  %.1f GiB of device memory per rank at ZeRO stage 0 (--device gpu",
                c["estimate"]["budgets"][0]["device_total"].get<double>() / 1073741824.0);
  if (!zero3d::kernels::kGpuBuild) {
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  }
  // a model no machine here holds: the CPU's plan is refused, the GPU run's is not held to this machine
  const std::string huge = " --set model.n_layer=96 --set model.n_embd=12288 --set model.n_head=96";
  EXPECT_EQ(run(validate + huge + " --device gpu").code, 0);
  if (!zero3d::kernels::kGpuBuild) {
    EXPECT_EQ(run(validate + huge).code, 2);
  }
}

// Bad values, the tables' mode, and a GPU build asked for a CPU's plan: exit 2, one line each.
TEST(EstimateDevice, ADeviceItCannotPlanIsRejectedWithTheReason) {
  const std::string config = " --config " + kSource + "/input/quickstart.json";
  expect_one_line_rejection(run("estimate" + config + " --device tpu"), "estimate --device tpu: expected cpu or gpu");
  expect_one_line_rejection(run("estimate zero3 --params 1e9 --largest-layer-params 1e6 --device gpu"),
                            "estimate zero3 --device: DeepSpeed's zero3 table does not use it");
  expect_one_line_rejection(run("validate" + config.substr(9) + " --device tpu"),
                            "validate --device tpu: expected cpu or gpu");
  const Result cpu = run("estimate" + config + " --device cpu");
  if (zero3d::kernels::kGpuBuild)
    expect_one_line_rejection(cpu, "estimate --device cpu: this is a GPU build");
  else
    EXPECT_EQ(cpu.code, 0) << cpu.err;
}

}  // namespace
