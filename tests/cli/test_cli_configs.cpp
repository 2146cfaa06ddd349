// test_cli_configs.cpp — real DeepSpeed configs through `zero3d validate` (issue 18): each one
// in tests/configs/ (sources in tests/configs/SOURCES.md) is accepted, or rejected only for a
// feature zero3d does not have yet, listed below so that the list shrinks as features land;
// one pass over a config with several problems; --strategy; a resolved config trains the same.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using namespace cli;
namespace fs = std::filesystem;

namespace {

// Configs zero3d rejects today: what rejects them (a substring of the message) and why. An
// entry whose config comes to be accepted fails the test: remove it, the feature has landed.
struct Rejection {
  const char* message;
  const char* reason;
};
const std::map<std::string, Rejection>& expected_rejections() {
  static const std::map<std::string, Rejection> table = {
      {"accelerate__examples__alst_ulysses_sequence_parallelism__sp-alst.ds-config.json",
       {"`seq_parallel_communication_data_type`", "Ulysses sequence parallelism (not in zero3d)"}},
      {"deepspeed__deepspeed__autotuning__config_templates__template_zero0.json",
       {"either train_batch_size or train_micro_batch_size_per_gpu", "an autotuner template, not a config: no batch and no autotuning section (DeepSpeed rejects it alone too)"}},
      {"deepspeed__deepspeed__autotuning__config_templates__template_zero1.json",
       {"either train_batch_size or train_micro_batch_size_per_gpu", "an autotuner template, not a config: no batch and no autotuning section (DeepSpeed rejects it alone too)"}},
      {"deepspeed__deepspeed__autotuning__config_templates__template_zero2.json",
       {"either train_batch_size or train_micro_batch_size_per_gpu", "an autotuner template, not a config: no batch and no autotuning section (DeepSpeed rejects it alone too)"}},
      {"deepspeed__deepspeed__autotuning__config_templates__template_zero3.json",
       {"either train_batch_size or train_micro_batch_size_per_gpu", "an autotuner template, not a config: no batch and no autotuning section (DeepSpeed rejects it alone too)"}},
      {"transformers__tests__deepspeed__ds_config_zero3.json",
       {"either train_batch_size or train_micro_batch_size_per_gpu", "no batch key at all: its test runner adds them (DeepSpeed rejects it too)"}},
      {"deepspeed__tests__model__BingBertSquad__deepspeed_bsz24_fp16_eigenvalue_quantize_config.json",
       {"`eigenvalue`", "eigenvalue computation and quantization-aware training"}},
      {"deepspeed__tests__torch_compile__ds_config_z2.json",
       {"`bf16.loss_scale`: unknown key", "fp16 loss-scaling keys in the bf16 section (DeepSpeed's bf16 model forbids them)"}},
      {"deepspeed__tests__torch_compile__ds_config_z3.json",
       {"`bf16.loss_scale`: unknown key", "fp16 loss-scaling keys in the bf16 section (DeepSpeed's bf16 model forbids them)"}},
      {"dsexamples__training__DeepSpeed-ZenFlow__finetuning__zf_config.json",
       {"`zero_optimization.zenflow`", "ZenFlow (not in zero3d)"}},
      {"megatron-ds__examples_deepspeed__curriculum_learning__ds_zero_stage_1_config_baseline.json",
       {"`optimizer.params.max_grad_norm`", "max_grad_norm in optimizer params (DeepSpeed rejects it too)"}},
  };
  return table;
}

// Ranks a config needs (its tensor-parallel size); 1 for all others.
int world_size_for(const std::string& name) {
  return name == "llamafactory__examples__deepspeed__ds_z2_autotp_config.json" ? 2 : 1;
}

std::vector<std::string> corpus() {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(kSource + "/tests/configs"))
    if (e.path().extension() == ".json") names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(RealConfigs, EachIsAcceptedOrRejectedOnlyForAListedMissingFeature) {
  const std::vector<std::string> names = corpus();
  ASSERT_GE(names.size(), 50u);
  const std::string sources = slurp(kSource + "/tests/configs/SOURCES.md");
  size_t accepted = 0;
  for (const std::string& name : names) {
    EXPECT_NE(sources.find("| " + name + " |"), std::string::npos) << name << " has no source in SOURCES.md";
    const Result r = run("validate " + kSource + "/tests/configs/" + name + " --world-size " +
                         std::to_string(world_size_for(name)));
    const auto it = expected_rejections().find(name);
    if (it == expected_rejections().end()) {
      EXPECT_EQ(r.code, 0) << name << " is rejected:\n" << r.err;
      accepted += r.code == 0;
    } else {
      EXPECT_EQ(r.code, 2) << name << " is accepted now: remove it from the list (" << it->second.reason << ")";
      EXPECT_NE(r.err.find(it->second.message), std::string::npos) << name << ": " << r.err;
    }
  }
  for (const auto& [name, why] : expected_rejections())
    EXPECT_TRUE(std::find(names.begin(), names.end(), name) != names.end()) << name << " is listed but not in tests/configs";
  std::printf("accepted %zu of %zu real configs (%.0f%%)\n", accepted, names.size(), 100.0 * accepted / names.size());
}

TEST(RealConfigs, AHuggingFaceAutoConfigPrintsWhereEachValueCameFrom) {
  const Result r = run("validate " + kSource + "/tests/configs/transformers__tests__deepspeed__ds_config_zero2.json");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* line : {"auto    train_micro_batch_size_per_gpu = ", "auto    optimizer.params.lr = 5e-05",
                           "auto    fp16.enabled = false", "auto    gradient_clipping = 1",
                           "no effect on this build: `zero_optimization.offload_optimizer.pin_memory` = true"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
}

TEST(OnePassCli, FiveIndependentErrorsAreReportedInOneRun) {
  json j = tiny_config();
  j["steps_per_print"] = "ten";
  j["optimizer"]["params"]["lr"] = -1;
  j["zero_optimization"] = {{"stage", 7}};
  j["optimiser"] = 1;
  j["eigenvalue"] = {{"enabled", true}};
  const std::string config = write_config("five.json", j);
  for (const std::string& cmd : {"validate " + config, "train " + config + " --output " + temp_path("five_out")}) {
    const Result r = run(cmd);
    EXPECT_EQ(r.code, 2) << cmd << r.out;
    EXPECT_NE(r.err.find("5 problems in " + config + ":"), std::string::npos) << cmd << r.err;
    EXPECT_EQ(count(r.err, "\n"), 6u) << cmd << r.err;
  }
}

TEST(StrategyCli, StrategyFlagPutsThePresetBeneathTheConfig) {
  const std::string config = write_config("preset.json", tiny_config());
  Result r = run("validate " + config + " --world-size 2 --strategy deepspeed_stage_3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("strategy deepspeed_stage_3:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("at ZeRO stage 3"), std::string::npos) << r.out;
  r = run("validate " + config + " --strategy deepspeed_stage_3 --set zero_optimization.stage=1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("at ZeRO stage 1"), std::string::npos) << r.out;  // the config's key wins
  r = run("validate " + config + " --strategy deepspeed_stage_9");
  expect_one_line_rejection(r, "`strategy`: \"deepspeed_stage_9\" is not a Lightning DeepSpeed strategy");
}

TEST(RoundTripCli, TheResolvedConfigOfAPresetRunValidatesAndTrainsTheSameLosses) {
  const std::string config = write_config("rt.json", tiny_config());
  const std::string first = temp_path("rt_first"), second = temp_path("rt_second");
  Result r = run("train " + config + " --strategy deepspeed_stage_2 --output " + first, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string resolved = first + "/config.json";
  r = run("validate " + resolved + " --world-size 2");
  ASSERT_EQ(r.code, 0) << r.err;
  r = run("train " + resolved + " --output " + second, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<double> a = losses_of(read_metrics(first)), b = losses_of(read_metrics(second));
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(a, b);
  // The same run, but for where it writes.
  json x = json::parse(slurp(resolved)), y = json::parse(slurp(second + "/config.json"));
  for (json* c : {&x, &y}) (*c)["training"].erase("output_dir"), (*c)["training"].erase("save_dir");
  EXPECT_EQ(x, y);
}

TEST(Gather16BitCli, EachSaveWritesConsolidatedWeightsAndStillResumes) {
  json j = tiny_config();
  j["bf16"] = {{"enabled", true}};
  j["zero_optimization"] = {{"stage", 3}, {"stage3_gather_16bit_weights_on_model_save", true}};
  j["training"]["save_interval"] = 2;
  j["training"]["steps"] = 4;
  const std::string config = write_config("g16.json", j);
  const std::string out = temp_path("g16_out");
  Result r = run("train " + config + " --output " + out, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* tag : {"global_step2", "global_step4"}) {
    const std::string dir = out + "/checkpoints/" + tag + "/hf";
    EXPECT_TRUE(fs::exists(dir + "/model.safetensors")) << dir;
    EXPECT_TRUE(fs::exists(dir + "/config.json")) << dir;
  }
  r = run("train " + config + " --output " + out + " --set training.steps=6 training.resume=latest", 2);
  EXPECT_EQ(r.code, 0) << r.err;
}

// Lion and Adagrad are elementwise, so ZeRO partitions them like Adam: at stage 2 on two ranks
// they learn, and a resumed run continues exactly where the saved one was.
TEST(LionAdagradCli, TrainUnderZeroAndResumeExactly) {
  for (const char* type : {"Lion", "Adagrad"}) {
    json j = tiny_config();
    j["optimizer"] = {{"type", type}, {"params", {{"lr", std::string(type) == "Lion" ? 1e-3 : 1e-2}}}};
    j["zero_optimization"] = {{"stage", 2}};
    j["training"]["steps"] = 6;
    j["training"]["save_interval"] = 3;
    const std::string config = write_config(std::string(type) + ".json", j);
    const std::string full = temp_path(std::string(type) + "_full"), resumed = temp_path(std::string(type) + "_res");
    Result r = run("train " + config + " --output " + full, 2);
    ASSERT_EQ(r.code, 0) << type << r.err;
    const std::vector<double> all = losses_of(read_metrics(full));
    ASSERT_EQ(all.size(), 6u) << type;
    EXPECT_LT(all.back(), all.front()) << type;
    r = run("train " + config + " --output " + resumed + " --set training.resume=" + full +
                "/checkpoints/global_step3",
            2);
    ASSERT_EQ(r.code, 0) << type << r.err;
    const std::vector<double> tail = losses_of(read_metrics(resumed));
    ASSERT_EQ(tail.size(), 3u) << type;
    for (size_t k = 0; k < 3; ++k) EXPECT_EQ(tail[k], all[3 + k]) << type << " step " << 4 + k;
  }
}

}  // namespace

// memory_breakdown (DeepSpeed's see_memory_usage at its report points): rank 0 prints one
// memory line under each step line, with this rank's bytes by category as metrics.jsonl
// records them, and the process's resident memory now and at its peak; none without the key.
TEST(MemoryBreakdownCli, RankZeroPrintsOneMemoryLineAtEachReportPoint) {
  json j = tiny_config();
  j["zero_optimization"] = {{"stage", 2}};
  j["steps_per_print"] = 2;  // report points: steps 1, 2, 4 and the last, 5
  const std::string out = temp_path("membreak_on");
  j["memory_breakdown"] = true;
  Result r = run("train " + write_config("membreak.json", j) + " --output " + out, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count(r.out, "memory  rank 0 | "), 4u) << r.out;  // rank 0's, not one per rank
  EXPECT_EQ(count(r.out, "\nstep "), count(r.out, "\nmemory  rank 0 | ")) << r.out;
  const std::string last = r.out.substr(r.out.rfind("memory  rank 0 | "));
  const json metrics = read_metrics(out).back();
  ASSERT_EQ(metrics["step"], 5);
  auto mb = [](const json& bytes) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f MB", bytes.get<double>() / 1e6);
    return std::string(buf);
  };
  for (const char* key : {"params", "grads", "master", "optimizer_states", "comm_buffers", "live_params_peak", "activations"})
    EXPECT_NE(last.find(std::string("| ") + key + " " + mb(metrics["memory"][key]) + " |"), std::string::npos)
        << key << "\n" << last;
  double resident = 0, peak = 0;
  ASSERT_EQ(std::sscanf(last.c_str() + last.find("| resident "), "| resident %lf MB (peak %lf MB)", &resident, &peak), 2)
      << last;
  EXPECT_GT(resident, 1.0);
  EXPECT_GE(peak, resident);
  EXPECT_GE(peak * 1e6 + 1e4, metrics["peak_rss_bytes"].get<double>());  // the peak only grows after the record
  EXPECT_NE(last.find("| machine used "), std::string::npos) << last;
  j["memory_breakdown"] = false;
  r = run("train " + write_config("membreak_off.json", j) + " --output " + temp_path("membreak_off"), 2);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count(r.out, "memory  rank 0"), 0u) << r.out;
}
