// test_config_deepspeed.cpp — real DeepSpeed configs read in one pass (issue 18): every
// problem at once, the three kinds of key, "auto" as Hugging Face resolves it, Lightning's
// strategy presets, and a resolved config that is itself a valid config.
#include <gtest/gtest.h>

#include <algorithm>

#include "base/errors.hpp"
#include "config/config.hpp"
#include "support/config_test_helpers.hpp"
#include "train/estimator.hpp"

using namespace zero3d;
using json = nlohmann::json;

namespace {

using config_test::error_of;
using config_test::minimal;

size_t lines(const std::string& s) { return s.empty() ? 0 : 1 + std::count(s.begin(), s.end(), '\n'); }

// The start-up line that begins with `prefix` ("" when there is none).
std::string note(const Config& c, const std::string& prefix) {
  for (const std::string& n : c.notes)
    if (n.rfind(prefix, 0) == 0) return n;
  return "";
}

// ---- one pass --------------------------------------------------------------------------------

TEST(OnePass, FiveIndependentErrorsAreAllReportedWithACount) {
  json j = minimal();
  j["steps_per_print"] = "ten";                                   // wrong type
  j["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", -1}}}};  // out of range
  j["zero_optimization"] = {{"stage", 7}};                         // out of range
  j["optimiser"] = 1;                                              // misspelt
  j["eigenvalue"] = {{"enabled", true}};                           // a feature zero3d lacks
  const std::string e = error_of(j);
  EXPECT_EQ(e.rfind("5 problems in cfg.json:", 0), 0u) << e;
  EXPECT_EQ(lines(e), 6u) << e;
  for (const char* key : {"`steps_per_print`", "`optimizer.params.lr`", "`zero_optimization.stage`", "`optimiser`",
                          "`eigenvalue`"})
    EXPECT_NE(e.find(key), std::string::npos) << key << " missing from\n" << e;
  EXPECT_NE(e.find("\"ten\""), std::string::npos) << e;  // each line names the value
}

TEST(OnePass, ASingleProblemStaysOneLineNamingTheFile) {
  json j = minimal();
  j["steps_per_print"] = "ten";
  const std::string e = error_of(j);
  EXPECT_EQ(lines(e), 1u) << e;
  EXPECT_EQ(e.rfind("cfg.json: `steps_per_print`:", 0), 0u) << e;
}

TEST(OnePass, AProblemIsNotRepeatedAsItsConsequences) {
  // A bad n_head takes its default (2), which divides n_embd: no second, derived complaint.
  json j = minimal();
  j["model"] = {{"n_head", "four"}, {"n_embd", 64}};
  j["zero_optimization"] = {{"stage", "two"}};
  const std::string e = error_of(j);
  EXPECT_EQ(e.rfind("2 problems in cfg.json:", 0), 0u) << e;
}

// ---- three kinds of key -------------------------------------------------------------------

// sparse_attention is implemented (config/sparse_attention.cpp); a key its mode does not read
// is an unknown key there, never silently ignored as DeepSpeed's reader ignores it.
TEST(KeyKinds, ASparseAttentionKeyItsModeDoesNotReadIsUnknown) {
  json j = minimal();
  j["sparse_attention"] = {{"mode", "fixed"}, {"block", 16}, {"num_random_blocks", 2}};
  const std::string e = error_of(j);
  EXPECT_NE(e.find("`sparse_attention.num_random_blocks`"), std::string::npos) << e;
  j["sparse_attention"].erase("num_random_blocks");
  EXPECT_TRUE(read_config(j, "cfg.json", 2).model.sparse_attention.enabled);
}

TEST(KeyKinds, HardwareOnlyKeysAreAcceptedAndListedWithTheirReason) {
  json j = minimal();
  j["zero_optimization"] = {{"stage", 2}, {"contiguous_gradients", false}, {"round_robin_gradients", true},
                            {"offload_optimizer", {{"device", "cpu"}, {"pin_memory", true}}}};
  j["aio"] = {{"use_gds", true}};
  const Config c = read_config(j, "cfg.json", 2);
  for (const char* key : {"`zero_optimization.contiguous_gradients` = false", "`zero_optimization.round_robin_gradients` = true",
                          "`zero_optimization.offload_optimizer.pin_memory` = true", "`aio.use_gds` = true"}) {
    const auto it = std::find_if(c.notes.begin(), c.notes.end(), [&](const std::string& n) {
      return n.rfind("no effect on this build: ", 0) == 0 && n.find(key) != std::string::npos && n.find(" (") != std::string::npos;
    });
    EXPECT_NE(it, c.notes.end()) << key;
  }
  EXPECT_EQ(c.resolved["zero_optimization"]["contiguous_gradients"], false);
}

TEST(KeyKinds, AKeyAtWhatZero3dAlwaysDoesIsNotNoted) {
  json j = minimal();
  j["zero_optimization"] = {{"stage", 2}, {"contiguous_gradients", true}};
  EXPECT_EQ(note(read_config(j, "cfg.json", 2), "no effect"), "");
}

TEST(KeyKinds, AMissingFeatureNamesTheNearestAlternative) {
  json j = minimal();
  j["sequence_parallel_size"] = 2;
  EXPECT_NE(error_of(j).find("use tensor_parallel.sequence_parallel"), std::string::npos) << error_of(j);
}

TEST(KeyKinds, KeysWhoseDeepSpeedMeaningZero3dHasAreAccepted) {
  json j = minimal();
  j["disable_allgather"] = true;     // DeepSpeed reads it and uses it nowhere
  j["dataloader_drop_last"] = true;  // zero3d's batches are always whole
  j["memory_breakdown"] = true;      // a memory line at each report point
  const Config c = read_config(j, "cfg.json", 2);
  EXPECT_TRUE(c.memory_breakdown);
  EXPECT_FALSE(read_config(minimal(), "cfg.json", 2).memory_breakdown);
  EXPECT_EQ(c.resolved["disable_allgather"], true);
  EXPECT_EQ(c.resolved["dataloader_drop_last"], true);
}

TEST(KeyKinds, FusedAndCpuOptimizerNamesAreAdamAndLamb) {
  for (const char* name : {"FusedAdam", "CPUAdam", "DeepSpeedCPUAdam"}) {
    json j = minimal();
    j["optimizer"] = {{"type", name}, {"params", {{"lr", 1e-4}}}};
    EXPECT_EQ(read_config(j, "cfg.json", 2).optimizer.type, OptimizerType::Adam) << name;
  }
  json j = minimal();
  j["optimizer"] = {{"type", "FusedLamb"}};
  EXPECT_EQ(read_config(j, "cfg.json", 2).optimizer.type, OptimizerType::Lamb);
}

TEST(KeyKinds, Gather16BitWeightsOnSaveIsReadUnderEachOfItsNames) {
  for (const char* key : {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                          "stage3_gather_fp16_weights_on_model_save"}) {
    json j = minimal();
    j["zero_optimization"] = {{"stage", 3}, {key, true}};
    EXPECT_TRUE(read_config(j, "cfg.json", 2).zero.gather_16bit_weights_on_model_save) << key;
  }
  EXPECT_FALSE(read_config(minimal(), "cfg.json", 2).zero.gather_16bit_weights_on_model_save);
}

TEST(KeyKinds, CheckpointSectionIsReadWithDeepSpeedsKeysAndDefaults) {
  for (const char* mode : {"Ignore", "Warn", "FAIL"}) {
    json j = minimal();
    j["checkpoint"] = {{"tag_validation", mode}};
    EXPECT_EQ(error_of(j), "") << mode;
  }
  const CheckpointOptions defaults = read_config(minimal(), "cfg.json", 2).checkpoint;
  EXPECT_EQ(defaults.tag_validation, "Warn");
  EXPECT_FALSE(defaults.load_universal || defaults.use_node_local_storage || defaults.parallel_write_pipeline_stage);
  json j = minimal();
  j["checkpoint"] = {{"load_universal", true}, {"use_node_local_storage", true}, {"parallel_write", {{"pipeline_stage", true}}}};
  const CheckpointOptions o = read_config(j, "cfg.json", 2).checkpoint;
  EXPECT_TRUE(o.load_universal && o.use_node_local_storage && o.parallel_write_pipeline_stage);
  j["checkpoint"] = {{"use_node_local_storage", "yes"}};
  EXPECT_NE(error_of(j).find("`checkpoint.use_node_local_storage`: expected true or false"), std::string::npos) << error_of(j);
}

// Where the mean of the gradient sum divides (DeepSpeed's prescale_gradients and
// gradient_predivide_factor): read into the ZeRO optimizer's config.
TEST(KeyKinds, GradientAveragingKeysReachTheZeroConfig) {
  json j = minimal();
  j["prescale_gradients"] = true;
  j["gradient_predivide_factor"] = 8;
  const Config c = read_config(j, "cfg.json", 2);
  EXPECT_TRUE(c.zero.prescale_gradients);
  EXPECT_EQ(c.zero.gradient_predivide_factor, 8.0);
  j["prescale_gradients"] = "on";
  EXPECT_NE(error_of(j).find("`prescale_gradients`: expected true or false"), std::string::npos) << error_of(j);
}

// bf16_master_weights_and_grads / bf16_optimizer_states set the types the ZeRO optimizer keeps.
TEST(KeyKinds, Bf16MasterWeightsAndStatesReachTheZeroConfig) {
  json j = minimal();
  j["bf16"] = {{"enabled", true}, {"bf16_master_weights_and_grads", true}};
  j["zero_optimization"] = {{"stage", 2}};
  Config c = read_config(j, "cfg.json", 2);
  EXPECT_EQ(c.zero.master_weights, DType::BF16);
  EXPECT_EQ(c.zero.optimizer_states, DType::F32);
  j["bf16"]["bf16_optimizer_states"] = true;
  c = read_config(j, "cfg.json", 2);
  EXPECT_EQ(c.zero.optimizer_states, DType::BF16);
  j["data_types"] = {{"grad_accum_dtype", "fp32"}};
  EXPECT_NE(error_of(j).find("`data_types.grad_accum_dtype`: fp32 gradients contradict bf16.bf16_master_weights_and_grads"),
            std::string::npos)
      << error_of(j);
}

// ---- "auto" as Hugging Face resolves it (transformers integrations/deepspeed.py) ------------

TEST(HfAuto, BucketSizesComeFromTheHiddenSize) {
  json j = minimal();
  j["model"] = {{"n_embd", 64}, {"n_head", 2}};
  j["zero_optimization"] = {{"stage", 3},
                            {"reduce_bucket_size", "auto"},
                            {"stage3_prefetch_bucket_size", "auto"},
                            {"stage3_param_persistence_threshold", "auto"}};
  const Config c = read_config(j, "cfg.json", 2);
  EXPECT_EQ(c.zero.reduce_bucket_size, 64 * 64);
  EXPECT_EQ(c.zero.prefetch_bucket_size, static_cast<int64_t>(0.9 * 64 * 64));
  EXPECT_EQ(c.zero.param_persistence_threshold, 10 * 64);
  EXPECT_NE(note(c, "auto    zero_optimization.reduce_bucket_size = 4096 (C*C"), "");
}

TEST(HfAuto, OtherZeroKeysTakeDeepSpeedsDefault) {
  json j = minimal();
  j["zero_optimization"] = {{"stage", 3}, {"stage3_max_live_parameters", "auto"}};
  const Config c = read_config(j, "cfg.json", 2);
  EXPECT_EQ(c.zero.max_live_parameters, 1000000000);
  EXPECT_NE(note(c, "auto    zero_optimization.stage3_max_live_parameters = 1000000000"), "");
}

TEST(HfAuto, OptimizerAndSchedulerTakeTrainingArgumentsDefaults) {
  json j = minimal();
  j["optimizer"] = {{"type", "AdamW"},
                    {"params", {{"lr", "auto"}, {"betas", "auto"}, {"eps", "auto"}, {"weight_decay", "auto"}}}};
  j["scheduler"] = {{"type", "WarmupDecayLR"},
                    {"params", {{"warmup_min_lr", "auto"}, {"warmup_max_lr", "auto"}, {"warmup_num_steps", "auto"},
                                {"total_num_steps", "auto"}}}};
  j["training"] = {{"steps", 40}};
  j["gradient_clipping"] = "auto";
  const Config c = read_config(j, "cfg.json", 2);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 5e-5);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.999);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 5e-5);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 0);
  EXPECT_EQ(c.scheduler.total_num_steps, 40);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_NE(note(c, "auto    optimizer.params.lr = 5e-05"), "");
  EXPECT_NE(note(c, "auto    scheduler.params.total_num_steps = 40 (training.steps)"), "");
}

TEST(HfAuto, PrecisionEnabledAutoIsFp32UnlessTheOtherSectionAsks) {
  json j = minimal();
  j["fp16"] = {{"enabled", "auto"}, {"loss_scale", 0}};
  j["bf16"] = {{"enabled", "auto"}};
  Config c = read_config(j, "cfg.json", 2);
  EXPECT_EQ(c.precision.param, DType::F32);
  EXPECT_NE(note(c, "auto    fp16.enabled = false"), "");
  j["bf16"] = {{"enabled", true}};
  EXPECT_EQ(read_config(j, "cfg.json", 2).precision.param, DType::BF16);
}

TEST(HfAuto, BatchKeysAreDerivedFromTheGivenOnes) {
  json j = {{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", "auto"}, {"gradient_accumulation_steps", "auto"}};
  const Config c = read_config(j, "cfg.json", 2);
  EXPECT_EQ(c.batch.gradient_accumulation_steps, 1);  // DeepSpeed: only T given -> G = 1, M = T / W
  EXPECT_EQ(c.batch.micro_batch, 16);
}

TEST(HfAuto, AllBatchKeysAutoTakeAMicroBatchThatFitsAtMostEight) {
  json j = {{"train_batch_size", "auto"}, {"train_micro_batch_size_per_gpu", "auto"}, {"gradient_accumulation_steps", "auto"}};
  const Config c = resolve_config(j, "cfg.json", 2);
  EXPECT_GE(c.batch.micro_batch, 1);
  EXPECT_LE(c.batch.micro_batch, 8);
  EXPECT_EQ(c.batch.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.batch.train_batch_size, c.batch.micro_batch * 2);
  EXPECT_NE(note(c, "auto    train_micro_batch_size_per_gpu = "), "");
  EXPECT_EQ(c.resolved["train_micro_batch_size_per_gpu"], c.batch.micro_batch);
}

// config/ sits below the memory planner: it reads such a micro-batch as Hugging Face's default
// and marks it, and resolve_config (train/) lets the planner choose.
TEST(HfAuto, ReadingLeavesAMicroBatchNothingDerivesToTheMemoryPlanner) {
  json j = {{"train_batch_size", "auto"}, {"train_micro_batch_size_per_gpu", "auto"}, {"gradient_accumulation_steps", 2}};
  const Config read = read_config(j, "cfg.json", 2);
  EXPECT_TRUE(read.batch.micro_batch_from_memory);
  EXPECT_EQ(read.batch.micro_batch, kHfPerDeviceBatch);
  EXPECT_EQ(note(read, "auto    train_micro_batch_size_per_gpu = "), "");
  const Config planned = resolve_config(j, "cfg.json", 2);
  EXPECT_FALSE(planned.batch.micro_batch_from_memory);
  EXPECT_NE(note(planned, "auto    train_micro_batch_size_per_gpu = "), "");
  EXPECT_EQ(planned.batch.train_batch_size, planned.batch.micro_batch * 2 * 2);
  EXPECT_EQ(planned.resolved["train_batch_size"], planned.batch.train_batch_size);
}

TEST(HfAuto, AutoWhereNothingDerivesItIsRejectedByKey) {
  json j = minimal();
  j["training"] = {{"seed", "auto"}};
  EXPECT_NE(error_of(j).find("`training.seed`: \"auto\" cannot be derived"), std::string::npos) << error_of(j);
}

TEST(Scheduler, WarmupLongerThanTheScheduleWarnsAsDeepSpeedDoes) {
  json j = minimal();
  j["scheduler"] = {{"type", "WarmupDecayLR"}, {"params", {{"warmup_num_steps", 50}, {"total_num_steps", 20}}}};
  const Config c = read_config(j, "cfg.json", 2);
  EXPECT_EQ(c.scheduler.total_num_steps, 20);
  EXPECT_NE(note(c, "warning scheduler.params.total_num_steps = 20 is less than warmup_num_steps = 50"), "");
}

// ---- Lightning strategy presets (DeepSpeedStrategy defaults) ---------------------------------

TEST(StrategyPreset, EachNameExpandsToDeepSpeedStrategysDefaults) {
  struct Want {
    const char* name;
    int stage;
    const char* optimizer_device;  // "" = no offload_optimizer
    const char* param_device;
  };
  const Want wants[] = {{"deepspeed", 2, "", ""},
                        {"deepspeed_stage_1", 1, "", ""},
                        {"deepspeed_stage_2", 2, "", ""},
                        {"deepspeed_stage_2_offload", 2, "cpu", ""},
                        {"deepspeed_stage_3", 3, "", ""},
                        {"deepspeed_stage_3_offload", 3, "cpu", "cpu"},
                        {"deepspeed_stage_3_offload_nvme", 3, "nvme", "nvme"}};
  ASSERT_EQ(strategy_names().size(), 7u);
  for (const Want& w : wants) {
    const json p = strategy_preset(w.name);
    ASSERT_TRUE(p.is_object()) << w.name;
    const json& z = p["zero_optimization"];
    EXPECT_EQ(z["stage"], w.stage) << w.name;
    EXPECT_EQ(z["allgather_bucket_size"], 200000000) << w.name;
    EXPECT_EQ(z["reduce_bucket_size"], 200000000) << w.name;
    EXPECT_EQ(z["contiguous_gradients"], true) << w.name;
    EXPECT_EQ(z["overlap_comm"], true) << w.name;
    EXPECT_EQ(z["sub_group_size"], 1000000000000LL) << w.name;
    EXPECT_EQ(p["zero_allow_untested_optimizer"], true) << w.name;
    EXPECT_EQ(p["fp16"]["initial_scale_power"], 16) << w.name;
    EXPECT_EQ(z.contains("offload_optimizer") ? z["offload_optimizer"]["device"].get<std::string>() : "",
              w.optimizer_device) << w.name;
    EXPECT_EQ(z.contains("offload_param") ? z["offload_param"]["device"].get<std::string>() : "", w.param_device)
        << w.name;
    if (z.contains("offload_optimizer")) {
      EXPECT_EQ(z["offload_optimizer"]["pin_memory"], false) << w.name;
    }
  }
  EXPECT_TRUE(strategy_preset("deepspeed_stage_4").is_null());
}

TEST(StrategyPreset, TheStrategyKeyExpandsAndConfigKeysOverrideIt) {
  json j = minimal();
  j["strategy"] = "deepspeed_stage_3_offload";
  Config c = read_config(j, "cfg.json", 2);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::Cpu);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::Cpu);
  EXPECT_EQ(c.zero.reduce_bucket_size, 200000000);
  EXPECT_TRUE(c.zero_allow_untested_optimizer);
  j["zero_optimization"] = {{"reduce_bucket_size", 1000}, {"offload_param", {{"device", "none"}}}};
  c = read_config(j, "cfg.json", 2);
  EXPECT_EQ(c.zero.stage, 3);                  // from the preset
  EXPECT_EQ(c.zero.reduce_bucket_size, 1000);  // the config's own key wins
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::None);
}

TEST(StrategyPreset, AnUnknownNameSuggestsTheNearest) {
  json j = minimal();
  j["strategy"] = "deepspeed_stage_2_ofload";
  const std::string e = error_of(j);
  EXPECT_NE(e.find("`strategy`"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean \"deepspeed_stage_2_offload\""), std::string::npos) << e;
}

// ---- elasticity (values from DeepSpeed's elasticity.py run on the same inputs) ------------------

json elastic(json section) {
  section["enabled"] = true;
  return json{{"elasticity", section}};
}

TEST(Elasticity, V01PicksTheBatchWithTheMostCompatibleWorldSizes) {
  // _get_compatible_gpus_v01([2, 4, 6], 2000, 1, 10000, True) = 1680 over 32 sizes.
  const Config c = read_config(elastic({{"max_train_batch_size", 2000}, {"micro_batch_sizes", {2, 4, 6}}, {"version", 0.1}}),
                               "cfg.json", 4);
  EXPECT_EQ(c.batch.train_batch_size, 1680);
  EXPECT_EQ(c.batch.micro_batch, 6);  // the largest that divides 1680 / 4
  EXPECT_EQ(c.batch.gradient_accumulation_steps, 70);
  EXPECT_NE(note(c, "elastic train_batch_size 1680"), "");
  EXPECT_NE(note(c, "elastic   3 ranks: micro-batch 4 x gradient_accumulation_steps 140"), "");
}

TEST(Elasticity, PreferSmallerBatchAndAGpuRange) {
  // _get_compatible_gpus_v01([3, 5], 100, 2, 50, False) = (90, [2, 3, 5, 6, 9, 10, 15, 18, 30]).
  const Config c = read_config(elastic({{"max_train_batch_size", 100}, {"micro_batch_sizes", {3, 5}}, {"min_gpus", 2},
                                        {"max_gpus", 50}, {"prefer_larger_batch", false}, {"version", 0.1}}),
                               "cfg.json", 2);
  EXPECT_EQ(c.batch.train_batch_size, 90);
  EXPECT_NE(note(c, "elastic train_batch_size 90").find("[2, 3, 5, 6, 9, 10, 15, 18, 30]"), std::string::npos);
}

TEST(Elasticity, AnIncompatibleWorldSizeOrAGivenBatchKeyIsRejected) {
  const json j = elastic({{"max_train_batch_size", 100}, {"micro_batch_sizes", {3, 5}}, {"min_gpus", 2}, {"max_gpus", 50},
                          {"prefer_larger_batch", false}, {"version", 0.1}});
  EXPECT_NE(error_of(j, 4).find("world size (4) is not valid"), std::string::npos) << error_of(j, 4);
  json k = j;
  k["train_batch_size"] = 90;
  EXPECT_NE(error_of(k).find("`train_batch_size`: elasticity is enabled"), std::string::npos) << error_of(k);
  k["elasticity"]["ignore_non_elastic_batch_info"] = true;
  EXPECT_EQ(error_of(k), "");
}

TEST(Elasticity, TheResolvedConfigReadsBack) {
  const json j = elastic({{"micro_batch_sizes", {2, 4}}});  // version 0.2, DeepSpeed's default
  const Config first = read_config(j, "cfg.json", 2);
  const Config second = read_config(first.resolved, "resolved.json", 2);
  EXPECT_EQ(second.batch.train_batch_size, first.batch.train_batch_size);
  EXPECT_EQ(second.resolved, first.resolved);
}

// ---- the resolved config is a config -------------------------------------------------------

// Reading the resolved config again gives the same resolved config (and so the same run).
void expect_round_trip(const json& j, const std::string& what) {
  const Config first = read_config(j, "cfg.json", 2);
  Config second;
  try {
    second = read_config(first.resolved, "resolved.json", 2);
  } catch (const InputError& e) {
    FAIL() << what << ": the resolved config is rejected: " << e.what() << "\n" << first.resolved.dump(1);
  }
  EXPECT_EQ(second.resolved, first.resolved) << what;
}

TEST(RoundTrip, ResolvedConfigsValidateAndResolveToThemselves) {
  expect_round_trip(quickstart_json(), "quickstart");
  json j = quickstart_json();
  j["strategy"] = "deepspeed_stage_3";
  expect_round_trip(j, "quickstart with a preset");
  json hf = {{"fp16", {{"enabled", "auto"}}},
             {"bf16", {{"enabled", "auto"}}},
             {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", "auto"}, {"betas", "auto"}}}}},
             {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", "auto"}}}}},
             {"zero_optimization", {{"stage", 2}, {"reduce_bucket_size", "auto"}, {"contiguous_gradients", false}}},
             {"train_batch_size", 16},
             {"train_micro_batch_size_per_gpu", "auto"},
             {"gradient_accumulation_steps", "auto"},
             {"gradient_clipping", "auto"}};
  expect_round_trip(hf, "Hugging Face zero2 style");
}

TEST(RoundTrip, TheSchedulerTypeIsKept) {
  const Config c = read_config(quickstart_json(), "cfg.json", 2);
  EXPECT_EQ(c.resolved["scheduler"]["type"], "WarmupDecayLR");
}

}  // namespace
