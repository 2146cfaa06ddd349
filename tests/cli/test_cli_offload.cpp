// test_cli_offload.cpp — ZeRO-Offload / ZeRO-Infinity end to end: an offloaded run trains the
// same model bit for bit, checkpoints cross offload settings, swap files are scratch, and bad
// swap locations are rejected naming the key.
#include <filesystem>

#include "support/cli_helpers.hpp"

using namespace cli;
namespace fs = std::filesystem;

namespace {

json offload_config(int stage, bool bf16) {
  json j = tiny_config();
  j["model"]["vocab_size"] = 61;  // partitions that do not divide evenly
  j["optimizer"]["params"]["weight_decay"] = 0.01;
  j["training"]["steps"] = 10;
  j["zero_optimization"] = {{"stage", stage}};
  if (bf16) j["bf16"] = {{"enabled", true}};
  return j;
}

// --set arguments that offload the optimizer (and at stage 3 the parameters) to `device`.
std::string offload_args(const std::string& device, const std::string& swap, bool params = false) {
  std::string a = " --set zero_optimization.offload_optimizer.device=" + device;
  if (device == "nvme")
    a += " --set zero_optimization.offload_optimizer.nvme_path=" + swap +
         " --set zero_optimization.sub_group_size=5000 --set zero_optimization.offload_optimizer.buffer_count=9"
         " --set zero_optimization.offload_optimizer.pipeline_read=true"
         " --set zero_optimization.offload_optimizer.pipeline_write=true --set aio.block_size=16384";
  if (params) {
    a += " --set zero_optimization.offload_param.device=" + device;
    if (device == "nvme") a += " --set zero_optimization.offload_param.nvme_path=" + swap;
  }
  return a;
}

std::vector<double> losses(const std::string& config, int np, const std::string& dir, const std::string& args) {
  const Result r = run("train " + config + " --output " + dir + args, np);
  EXPECT_EQ(r.code, 0) << args << "\n" << r.err;
  return losses_of(read_metrics(dir));
}

size_t swap_files_under(const std::string& dir) {
  size_t n = 0;
  std::error_code ec;
  if (!fs::exists(dir)) return 0;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec))
    if (e.path().string().find(".tensor.swp") != std::string::npos) ++n;
  return n;
}

// Every stage, tier and precision at `np` ranks gives the losses of the run without offload.
void expect_placement_does_not_change_losses(int np) {
  for (bool bf16 : {false, true})
    for (int stage : {1, 2, 3}) {
      const std::string tag = std::to_string(np) + (bf16 ? "bf16" : "fp32") + std::to_string(stage);
      const std::string config = write_config("offload" + tag + ".json", offload_config(stage, bf16));
      const std::vector<double> want = losses(config, np, temp_path("none" + tag), "");
      ASSERT_EQ(want.size(), 10u);
      for (const std::string device : {"cpu", "nvme"}) {
        const std::string swap = temp_path("swap" + tag + device);
        const std::vector<double> got = losses(config, np, temp_path(device + tag), offload_args(device, swap));
        EXPECT_EQ(got, want) << device << " at np " << np << ", stage " << stage << (bf16 ? ", bf16" : ", fp32");
        EXPECT_EQ(swap_files_under(swap), 0u) << "swap files left after a normal exit";
        if (stage != 3) continue;
        const std::vector<double> with_params =
            losses(config, np, temp_path(device + tag + "p"), offload_args(device, swap, /*params=*/true));
        EXPECT_EQ(with_params, want) << device << " parameters too at np " << np << (bf16 ? ", bf16" : ", fp32");
      }
    }
}

}  // namespace

TEST(Offload, LossesEqualTheRunWithoutOffloadBitForBitAtOneRank) { expect_placement_does_not_change_losses(1); }

TEST(Offload, LossesEqualTheRunWithoutOffloadBitForBitAtTwoRanks) { expect_placement_does_not_change_losses(2); }

// Lion and Adagrad offloaded run DeepSpeedCPULion and DeepSpeedCPUAdagrad, which compute the
// device update element for element (Adagrad without weight decay: with it DeepSpeedCPUAdagrad's
// decay differs, see test_optimizers_lion_adagrad.cpp): the losses of the run without offload,
// bit for bit, in host memory and in swap files, at stages 2 and 3 (parameters too), fp32 and bf16.
TEST(Offload, LionAndAdagradTrainTheLossesOfTheRunWithoutOffloadBitForBit) {
  for (const char* type : {"Lion", "Adagrad"})
    for (bool bf16 : {false, true})
      for (int stage : {2, 3}) {
        json j = offload_config(stage, bf16);
        j["optimizer"] = {{"type", type}, {"params", {{"lr", std::string(type) == "Lion" ? 1e-3 : 1e-2}}}};
        if (std::string(type) == "Lion") j["optimizer"]["params"]["weight_decay"] = 0.1;
        j["training"]["steps"] = 6;
        const std::string tag = std::string(type) + (bf16 ? "bf16" : "fp32") + std::to_string(stage);
        const std::string config = write_config("la" + tag + ".json", j);
        const std::vector<double> want = losses(config, 2, temp_path("la_none" + tag), "");
        ASSERT_EQ(want.size(), 6u) << tag;
        for (const std::string device : {"cpu", "nvme"}) {
          const std::string swap = temp_path("la_swap" + tag + device);
          EXPECT_EQ(losses(config, 2, temp_path("la_" + device + tag), offload_args(device, swap, stage == 3)), want)
              << tag << " " << device;
        }
      }
}

// bf16_master_weights_and_grads (and bf16_optimizer_states) with the optimizer offloaded: the
// bf16 partition is updated where it lies, the moments live on the tier in their type.
TEST(Offload, Bf16MasterWeightsAndStatesOffloadedTrainTheSameLossesBitForBit) {
  for (bool states : {false, true}) {
    json j = offload_config(2, true);
    j["bf16"]["bf16_master_weights_and_grads"] = true;
    j["bf16"]["bf16_optimizer_states"] = states;
    j["training"]["steps"] = 6;
    const std::string tag = states ? "states" : "master";
    const std::string config = write_config("b16off" + tag + ".json", j);
    const std::vector<double> want = losses(config, 2, temp_path("b16off_none" + tag), "");
    ASSERT_EQ(want.size(), 6u);
    for (const std::string device : {"cpu", "nvme"}) {
      const std::string dir = temp_path("b16off_" + device + tag);
      EXPECT_EQ(losses(config, 2, dir, offload_args(device, temp_path("b16off_swap" + tag))), want) << tag << " " << device;
      const json m = read_metrics(dir).back()["memory"];
      EXPECT_EQ(m["master"], 0) << tag << " " << device;
    }
  }
}

TEST(Offload, MetricsReportBytesPerTierAndSwapTrafficHonestly) {
  const std::string config = write_config("metrics.json", offload_config(2, true));
  const std::string swap = temp_path("swap_metrics");
  const Result r = run("train " + config + " --output " + temp_path("m") + offload_args("nvme", swap), 2);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("offload optimizer state (fp32 master, exp_avg, exp_avg_sq) on nvme"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("host and device memory are the same memory"), std::string::npos) << r.out;
  const json last = read_metrics(temp_path("m")).back();
  EXPECT_EQ(last["memory"]["optimizer_states"], 0);  // all on the drive (ratio 1)
  EXPECT_EQ(last["memory"]["master"], 0);
  EXPECT_GT(last["memory"]["nvme"].get<int64_t>(), 0);
  EXPECT_EQ(last["memory"]["host_is_device"], true);
  // One step reads and writes the three states of this rank's partition, page-rounded.
  EXPECT_EQ(last["swap"]["read_bytes"], last["swap"]["write_bytes"]);
  EXPECT_GE(last["swap"]["read_bytes"].get<int64_t>(), last["memory"]["nvme"].get<int64_t>());
  EXPECT_GT(last["swap"]["read_gbps"].get<double>(), 0.0);
}

// offload_param cpu puts the stage-3 partition in host memory whether the optimizer's state is
// offloaded or not: the run reports those bytes in `host` (and says where the partition lies),
// and estimate's plan puts the same bytes in its host row.
TEST(Offload, ParametersInHostMemoryAreReportedAndPlannedThereWithTheOptimizerAnywhere) {
  const std::string config = write_config("params_host.json", offload_config(3, true));
  for (const std::string optimizer : {"none", "cpu"}) {
    const std::string dir = temp_path("params_host_" + optimizer);
    const std::string args = " --set zero_optimization.offload_param.device=cpu"
                             " --set zero_optimization.offload_optimizer.device=" + optimizer;
    const Result r = run("train " + config + " --output " + dir + args, 2);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_NE(r.out.find("parameter partition in host memory"), std::string::npos) << r.out;
    const json m = read_metrics(dir).back()["memory"];
    ASSERT_TRUE(m.contains("host")) << optimizer;
    if (optimizer == "none") EXPECT_EQ(m["host"], m["params"]);
    else EXPECT_GT(m["host"].get<int64_t>(), m["params"].get<int64_t>());
    const Result e = run("estimate --config " + config + " --world-size 2 --json" + args);
    ASSERT_EQ(e.code, 0) << e.err;
    const json plan = json::parse(e.out)["budgets"][3];
    EXPECT_EQ(plan["host"], m["host"]) << "optimizer " << optimizer;
    EXPECT_EQ(plan["params"], m["params"]) << "optimizer " << optimizer;
  }
}

TEST(Offload, RatioHalfKeepsHalfTheSubGroupsInMemoryAndStillMatches) {
  const std::string config = write_config("ratio.json", offload_config(2, false));
  const std::vector<double> want = losses(config, 2, temp_path("ratio_none"), "");
  const std::string swap = temp_path("swap_ratio");
  const std::vector<double> got = losses(config, 2, temp_path("ratio_half"),
                                         offload_args("nvme", swap) + " --set zero_optimization.sub_group_size=1000"
                                                                      " --set zero_optimization.offload_optimizer.ratio=0.5");
  EXPECT_EQ(got, want);
  const json last = read_metrics(temp_path("ratio_half")).back();
  EXPECT_GT(last["memory"]["optimizer_states"].get<int64_t>(), 0);
  EXPECT_GT(last["memory"]["nvme"].get<int64_t>(), 0);
}

TEST(Offload, CheckpointsResumeAcrossOffloadSettingsBitForBit) {
  json j = offload_config(3, true);
  const std::string config = write_config("resume.json", j);
  const std::vector<double> want = losses(config, 2, temp_path("resume_ref"), "");
  ASSERT_EQ(want.size(), 10u);
  const std::string swap = temp_path("swap_resume");
  // nvme -> none, and none -> nvme, each saved at step 5 and resumed for steps 6..10
  for (const auto& [first, second] : {std::pair<std::string, std::string>{"nvme", "none"}, {"none", "nvme"}}) {
    const std::string save = temp_path("ckpt_" + first);
    const std::string a1 = (first == "nvme" ? offload_args("nvme", swap) : std::string()) +
                           " --set training.steps=5 --set training.save_interval=5 --set training.save_dir=" + save;
    ASSERT_EQ(losses(config, 2, temp_path("resume_a_" + first), a1).size(), 5u);
    const std::string a2 = (second == "nvme" ? offload_args("nvme", swap) : std::string()) +
                           " --set training.resume=latest --set training.save_dir=" + save;
    const std::vector<double> got = losses(config, 2, temp_path("resume_b_" + first), a2);
    ASSERT_EQ(got.size(), 5u) << first << " -> " << second;
    EXPECT_EQ(got, std::vector<double>(want.begin() + 5, want.end())) << first << " -> " << second;
  }
  EXPECT_EQ(swap_files_under(swap), 0u);
}

TEST(Offload, SwapFilesAreRemovedAfterAnInjectedFailure) {
  const std::string config = write_config("fault.json", offload_config(2, false));
  const std::string swap = temp_path("swap_fault");
  const Result r = run("train " + config + " --output " + temp_path("fault") + offload_args("nvme", swap), 1,
                       "ZERO3D_FAULT=throw:0:3");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("injected failure at step 3"), std::string::npos) << r.err;
  EXPECT_EQ(swap_files_under(swap), 0u);
}

TEST(Offload, AnUnwritableNvmePathIsRejectedNamingKeyAndPath) {
  const std::string config = write_config("badpath.json", offload_config(2, false));
  const std::string file = temp_path("a_plain_file");
  std::ofstream(file) << "not a directory";
  const Result r = run("train " + config + " --output " + temp_path("badpath") + offload_args("nvme", file + "/swap"), 2);
  expect_one_line_rejection(r, "`zero_optimization.offload_optimizer.nvme_path`");
  EXPECT_NE(r.err.find(file), std::string::npos) << r.err;
}

// use_gds needs GPU memory to read into (issue 18: a key of the hardware kind): accepted and
// named once at start-up as having no effect on this build.
TEST(Offload, ValidateListsUseGdsAsNoEffectOnThisBuild) {
  const std::string config = write_config("gds.json", offload_config(2, false));
  const Result r = run("validate " + config + " --set aio.use_gds=true");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("no effect on this build: `aio.use_gds` = true (GPUDirect Storage"), std::string::npos) << r.out;
}

TEST(Offload, MaxInCpuSmallerThanOneUnitStillTrainsTheSameModel) {
  const std::string config = write_config("maxincpu.json", offload_config(3, true));
  const std::vector<double> want = losses(config, 2, temp_path("maxin_none"), "");
  const std::string swap = temp_path("swap_maxin");
  const std::string args = offload_args("nvme", swap, /*params=*/true) +
                           " --set zero_optimization.offload_param.max_in_cpu=100"
                           " --set zero_optimization.offload_param.buffer_count=1";
  EXPECT_EQ(losses(config, 2, temp_path("maxin"), args), want);
  const json last = read_metrics(temp_path("maxin")).back();
  EXPECT_EQ(last["memory"]["params"], 0);  // the partition is on the drive
  EXPECT_GT(last["swap"]["read_bytes"].get<int64_t>(), 0);
}

TEST(Offload, AParameterBufferSmallerThanOneUnitSliceIsRejectedWithTheNumbers) {
  const std::string config = write_config("bufsize.json", offload_config(3, false));
  const Result r = run("train " + config + " --output " + temp_path("bufsize") +
                           offload_args("nvme", temp_path("swap_bufsize"), /*params=*/true) +
                           " --set zero_optimization.offload_param.buffer_size=10",
                       2);
  expect_one_line_rejection(r, "`zero_optimization.offload_param.buffer_size`: value 10 is smaller than unit");
}
