// test_config.cpp — validation messages and DeepSpeed's batch-triad derivation (FACTS §1.2).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "base/errors.hpp"
#include "config/config.hpp"
#include "kernels/device.hpp"
#include "support/config_test_helpers.hpp"

using namespace zero3d;
using json = nlohmann::json;

namespace {

using config_test::error_of;
using config_test::minimal;

Config batch(std::optional<int64_t> T, std::optional<int64_t> M, std::optional<int64_t> G, int64_t W = 2) {
  json j = json::object();
  if (T) j["train_batch_size"] = *T;
  if (M) j["train_micro_batch_size_per_gpu"] = *M;
  if (G) j["gradient_accumulation_steps"] = *G;
  return read_config(j, "cfg.json", W);
}

TEST(BatchTriad, AcceptsConsistentTriplesAtWorldSizeTwo) {
  EXPECT_EQ(batch(32, 16, 1).batch.train_batch_size, 32);
  EXPECT_EQ(batch(32, 8, 2).batch.gradient_accumulation_steps, 2);
}

TEST(BatchTriad, RejectsTriplesThatDoNotMultiplyOut) {
  EXPECT_THROW(batch(33, 17, 2), InputError);
  EXPECT_THROW(batch(32, 18, 1), InputError);
  EXPECT_NE(error_of(json{{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 18},
                          {"gradient_accumulation_steps", 1}}).find("32 != 18 * 1 * 2"),
            std::string::npos);
}

TEST(BatchTriad, DerivesAccumulationStepsWithFloorDivision) {
  EXPECT_EQ(batch(32, 8, std::nullopt).batch.gradient_accumulation_steps, 2);  // (32 // 8) // 2
}

TEST(BatchTriad, FloorDivisionToZeroIsRejectedNamingTheKey) {
  // W=2, T=33, M=17 -> G = (33 // 17) // 2 = 0
  const std::string e = error_of(json{{"train_batch_size", 33}, {"train_micro_batch_size_per_gpu", 17}});
  EXPECT_NE(e.find("gradient_accumulation_steps"), std::string::npos) << e;
  EXPECT_NE(e.find("greater than 0"), std::string::npos) << e;
}

TEST(BatchTriad, DerivesMicroBatchFromBatchAndAccumulation) {
  EXPECT_EQ(batch(32, std::nullopt, 4).batch.micro_batch, 4);  // (32 // 2) // 4
}

TEST(BatchTriad, DerivesBatchFromMicroBatchAndAccumulation) {
  EXPECT_EQ(batch(std::nullopt, 4, 3).batch.train_batch_size, 24);
}

TEST(BatchTriad, BatchAloneMeansNoAccumulation) {
  Config c = batch(32, std::nullopt, std::nullopt);
  EXPECT_EQ(c.batch.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.batch.micro_batch, 16);
}

TEST(BatchTriad, MicroBatchAloneMeansNoAccumulation) {
  EXPECT_EQ(batch(std::nullopt, 4, std::nullopt).batch.train_batch_size, 8);
}

TEST(BatchTriad, NeitherBatchNorMicroBatchIsAnError) {
  EXPECT_NE(error_of(json{{"gradient_accumulation_steps", 2}}).find("train_micro_batch_size_per_gpu"),
            std::string::npos);
}

TEST(BatchTriad, AutoIsDerivedFromTheOtherTwo) {
  json j = {{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", "auto"}, {"gradient_accumulation_steps", 2}};
  EXPECT_EQ(read_config(j, "cfg.json", 2).batch.micro_batch, 8);
}

TEST(ConfigValidation, UnknownTopLevelKeyNamesItAndSuggestsTheNearest) {
  json j = minimal();
  j["optimiser"] = {{"type", "AdamW"}};
  const std::string e = error_of(j);
  EXPECT_NE(e.find("cfg.json"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown key"), std::string::npos) << e;
  EXPECT_NE(e.find("`optimiser`"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean `optimizer`"), std::string::npos) << e;
}

TEST(ConfigValidation, UnknownNestedKeyNamesTheFullPath) {
  json j = minimal();
  j["optimizer"] = {{"type", "AdamW"}, {"params", {{"lrr", 0.1}}}};
  const std::string e = error_of(j);
  EXPECT_NE(e.find("`optimizer.params.lrr`"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean `optimizer.params.lr`"), std::string::npos) << e;
}

TEST(ConfigValidation, DeepSpeedKeyZero3dLacksIsNamedUnsupportedNotMisspelt) {
  json j = minimal();
  j["seq_parallel_communication_data_type"] = "fp16";
  const std::string e = error_of(j);
  EXPECT_NE(e.find("DeepSpeed feature `seq_parallel_communication_data_type` is not supported by zero3d"),
            std::string::npos) << e;
  EXPECT_EQ(e.find("unknown key"), std::string::npos) << e;
}

TEST(ConfigValidation, EnabledDeepSpeedSectionZero3dLacksIsRejected) {
  json j = minimal();
  j["amp"] = {{"enabled", true}};
  const std::string e = error_of(j);
  EXPECT_NE(e.find("`amp`: zero3d does not have NVIDIA Apex AMP"), std::string::npos) << e;
  EXPECT_NE(e.find("\"bf16\": {\"enabled\": true}"), std::string::npos) << e;  // the nearest zero3d feature
}

TEST(ConfigValidation, DisabledDeepSpeedSectionIsAccepted) {
  json j = minimal();
  j["fp16"] = {{"enabled", false}};
  j["tensorboard"] = {{"enabled", false}, {"output_path", "x"}};
  EXPECT_EQ(error_of(j), "");
}

TEST(ConfigValidation, WrongTypeNamesKeyAndValue) {
  json j = minimal();
  j["steps_per_print"] = "ten";
  const std::string e = error_of(j);
  EXPECT_NE(e.find("`steps_per_print`"), std::string::npos) << e;
  EXPECT_NE(e.find("\"ten\""), std::string::npos) << e;
}

TEST(ConfigValidation, OutOfRangeValueNamesKeyAndValue) {
  json j = minimal();
  j["optimizer"] = {{"type", "Adam"}, {"params", {{"lr", -0.1}}}};
  const std::string e = error_of(j);
  EXPECT_NE(e.find("`optimizer.params.lr`"), std::string::npos) << e;
  EXPECT_NE(e.find("-0.1"), std::string::npos) << e;
}

TEST(ConfigValidation, UnderscoreKeysAreComments) {
  json j = minimal();
  j["_comment"] = "anything";
  j["optimizer"] = {{"type", "AdamW"}, {"_note", 1}};
  EXPECT_EQ(error_of(j), "");
}

TEST(ConfigValidation, UnknownOptimizerSuggestsTheRightSpelling) {
  json j = minimal();
  j["optimizer"] = {{"type", "sgd"}};
  EXPECT_NE(error_of(j).find("did you mean \"SGD\""), std::string::npos);
}

TEST(ConfigValidation, DeepSpeedOptimizerZero3dLacksIsNamedUnsupported) {
  json j = minimal();
  j["optimizer"] = {{"type", "MuAdam"}};
  EXPECT_NE(error_of(j).find("not supported by zero3d"), std::string::npos);
}

TEST(ConfigValidation, MaxGradNormInOptimizerParamsPointsToGradientClipping) {
  json j = minimal();
  j["optimizer"] = {{"type", "AdamW"}, {"params", {{"max_grad_norm", 1.0}}}};
  EXPECT_NE(error_of(j).find("gradient_clipping"), std::string::npos);
}

TEST(ConfigValidation, AutoThatCannotBeDerivedIsRejectedByName) {
  json j = minimal();
  j["model"] = {{"n_layer", "auto"}};  // zero3d's own key: nothing to derive it from
  const std::string e = error_of(j);
  EXPECT_NE(e.find("`model.n_layer`"), std::string::npos) << e;
  EXPECT_NE(e.find("\"auto\""), std::string::npos) << e;
}

TEST(ConfigValidation, AutoTotalStepsResolvesToTrainingSteps) {
  json j = minimal();
  j["training"] = {{"steps", 77}};
  j["scheduler"] = {{"type", "WarmupDecayLR"}, {"params", {{"total_num_steps", "auto"}, {"warmup_num_steps", 5}}}};
  Config c = read_config(j, "cfg.json", 2);
  EXPECT_EQ(c.scheduler.total_num_steps, 77);
  EXPECT_EQ(c.resolved["scheduler"]["params"]["total_num_steps"], 77);
  // training.steps 0 leaves the "auto" schedule without a step: the message names the key set.
  j["training"]["steps"] = 0;
  EXPECT_NE(error_of(j).find("`training.steps`: value 0"), std::string::npos) << error_of(j);
}

TEST(ConfigValidation, ResolvedConfigHoldsEveryDefault) {
  Config c = read_config(minimal(), "cfg.json", 2);
  EXPECT_EQ(c.resolved["gradient_clipping"], 1.0);
  EXPECT_EQ(c.resolved["optimizer"]["params"]["betas"], json({0.9, 0.999}));
  EXPECT_EQ(c.resolved["gradient_accumulation_steps"], 1);
  EXPECT_EQ(c.resolved["model"]["n_layer"], 2);
}

// model.make_vocab_size_divisible_by (Megatron's key): the build's default (1 on the CPU, whose
// vocabulary and bits stay as they are; 128 on a GPU, whose products want tile-sized shapes),
// for every family, resolved; only a positive integer is a multiple.
TEST(ConfigValidation, VocabularyPaddingDefaultsByBuildAndTakesOnlyPositiveIntegers) {
  const int64_t build_default = kernels::kGpuBuild ? 128 : 1;
  for (const json& model : {json::object(), json{{"architecture", "llama"}}}) {
    json j = minimal();
    j["model"] = model;
    const Config c = read_config(j, "cfg.json", 2);
    EXPECT_EQ(c.model.make_vocab_size_divisible_by, build_default) << model;
    EXPECT_EQ(c.resolved["model"]["make_vocab_size_divisible_by"], build_default) << model;
    j["model"]["make_vocab_size_divisible_by"] = 64;
    EXPECT_EQ(read_config(j, "cfg.json", 2).model.make_vocab_size_divisible_by, 64) << model;
  }
  for (const json& bad : {json(0), json(-128), json(1.5), json("128"), json(true)}) {
    json j = minimal();
    j["model"] = {{"make_vocab_size_divisible_by", bad}};
    EXPECT_NE(error_of(j).find("`model.make_vocab_size_divisible_by`"), std::string::npos) << bad << ": " << error_of(j);
  }
}

TEST(ConfigValidation, OffloadWithoutAnOptimizerPartitionIsRejectedNamingTheKey) {
  json j = minimal();  // stage 0 (more in test_offload.cpp)
  j["zero_optimization"] = {{"offload_optimizer", {{"device", "cpu"}}}};
  EXPECT_NE(error_of(j).find("`zero_optimization.offload_optimizer`"), std::string::npos) << error_of(j);
}

TEST(ConfigValidation, DeprecatedStage3AliasIsAcceptedButNotWithItsNewName) {
  json j = minimal();
  j["zero_optimization"] = {{"stage", 3}, {"stage3_max_live_parameters", 1000}};
  EXPECT_EQ(read_config(j, "cfg.json", 2).zero.max_live_parameters, 1000);
  j["zero_optimization"]["max_live_parameters"] = 2000;
  EXPECT_NE(error_of(j).find("stage3_max_live_parameters"), std::string::npos);
}

TEST(ConfigValidation, ZeroTuningKeyAtItsDefaultIsAcceptedOtherwiseUnsupported) {
  json j = minimal();
  j["zero_optimization"] = {{"stage", 2}, {"contiguous_gradients", true}, {"reduce_scatter", true}};
  EXPECT_EQ(error_of(j), "");
  j["zero_optimization"]["zero_quantized_gradients"] = true;
  const std::string e = error_of(j);
  EXPECT_NE(e.find("`zero_optimization.zero_quantized_gradients`: ZeRO++'s qgZ"), std::string::npos) << e;
  EXPECT_NE(e.find("applies it at stage 3 only"), std::string::npos) << e;
}

// ZeRO++'s qgZ at stage 3; refused where DeepSpeed does not run it (MiCS's optimizer, a data
// group smaller than the job).
TEST(ConfigValidation, QuantizedGradientsAreStageThreesAndPurelyDataParallel) {
  json j = minimal();
  j["zero_optimization"] = {{"stage", 3}, {"zero_quantized_gradients", true}};
  EXPECT_EQ(error_of(j), "");
  EXPECT_TRUE(read_config(j, "cfg.json", 2).zero.quantized_gradients);
  j["zero_optimization"]["mics_shard_size"] = 2;
  EXPECT_NE(error_of(j).find("`zero_optimization.zero_quantized_gradients`: cannot be combined with mics_shard_size"),
            std::string::npos) << error_of(j);
  j["zero_optimization"].erase("mics_shard_size");
  j["zero_optimization"]["zero_quantized_gradients"] = "yes";
  EXPECT_NE(error_of(j).find("zero_quantized_gradients"), std::string::npos) << error_of(j);
}

TEST(ConfigValidation, OverlapCommDefaultsOnForStageThreeOnly) {
  json j = minimal();
  j["zero_optimization"] = {{"stage", 3}};
  EXPECT_TRUE(read_config(j, "cfg.json", 2).zero.overlap_comm);
  j["zero_optimization"] = {{"stage", 2}};
  EXPECT_FALSE(read_config(j, "cfg.json", 2).zero.overlap_comm);
}

TEST(ConfigValidation, LambWithZeroIsRejectedNamingTheOptimizer) {
  json j = minimal();
  j["optimizer"] = {{"type", "Lamb"}};
  j["zero_optimization"] = {{"stage", 1}};
  EXPECT_NE(error_of(j).find("`optimizer.type`"), std::string::npos);
}

TEST(ConfigValidation, EmbeddingMustSplitIntoHeads) {
  json j = minimal();
  j["model"] = {{"n_embd", 10}, {"n_head", 3}};
  EXPECT_NE(error_of(j).find("`model.n_embd`"), std::string::npos);
}

// A key that is read nowhere would be a silent substitute: a data path under the synthetic
// source (the default), an interleaved schedule with one chunk per stage (which is 1F1B).
TEST(ConfigValidation, DataPathWithTheSyntheticSourceIsRejectedNotIgnored) {
  json j = minimal();
  j["data"] = {{"path", "corpus.txt"}};
  const std::string e = error_of(j);
  EXPECT_NE(e.find("`data.path`"), std::string::npos) << e;
  EXPECT_NE(e.find("(the default)"), std::string::npos) << e;
  j["data"]["source"] = "text";
  EXPECT_EQ(error_of(j).find("`data.path`"), std::string::npos);
  j["data"] = {{"source", "text"}, {"path", "a.txt"}, {"validation", {{"source", "synthetic"}, {"path", "b.txt"}}}};
  EXPECT_NE(error_of(j).find("`data.validation.path`"), std::string::npos) << error_of(j);
}

// data.tokenizer names what turns the token data back into text (generation, samples): a path
// that exists (a file or a directory), reported by key when it does not.
TEST(ConfigValidation, DataTokenizerMustExist) {
  json j = minimal();
  const std::string dir = ::testing::TempDir() + "cfg_tokenizer_dir";
  std::filesystem::remove_all(dir);  // a file left by an earlier run would exist already
  std::filesystem::create_directories(dir);
  j["data"] = {{"tokenizer", dir}};
  EXPECT_EQ(read_config(j, "cfg.json", 1).data.tokenizer, dir);
  j["data"]["tokenizer"] = dir + "/tokenizer.json";
  const std::string e = error_of(j);
  EXPECT_NE(e.find("`data.tokenizer`"), std::string::npos) << e;
  EXPECT_NE(e.find("does not exist"), std::string::npos) << e;
  std::ofstream(dir + "/tokenizer.json") << "{}";
  EXPECT_EQ(read_config(j, "cfg.json", 1).data.tokenizer, dir + "/tokenizer.json");
  EXPECT_EQ(read_config(minimal(), "cfg.json", 1).data.tokenizer, "");
}

TEST(ConfigValidation, InterleavedScheduleNeedsTwoOrMoreVirtualStages) {
  json j = minimal();
  j["pipeline"] = {{"stages", 2}, {"schedule", "interleaved"}};
  EXPECT_NE(error_of(j, 2).find("`pipeline.virtual_stages`"), std::string::npos) << error_of(j, 2);
  j["pipeline"]["virtual_stages"] = 1;
  EXPECT_NE(error_of(j, 2).find("needs virtual_stages >= 2"), std::string::npos) << error_of(j, 2);
  j["pipeline"]["virtual_stages"] = 2;
  EXPECT_EQ(error_of(j, 2).find("virtual_stages"), std::string::npos) << error_of(j, 2);
}

TEST(JsonParsing, SyntaxErrorGivesFileLineAndColumn) {
  try {
    parse_json_text("{\n  \"a\": 1,\n  \"b\": ,\n}", "bad.json");
    FAIL() << "accepted invalid JSON";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("bad.json:3:8:", 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("JSON syntax error: parsing value"), std::string::npos) << e.what();
  }
}

TEST(JsonParsing, DuplicateKeysAreRejected) {
  try {
    parse_json_text(R"({"optimizer": {"type": "Adam", "type": "SGD"}})", "dup.json");
    FAIL() << "accepted duplicate keys";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("duplicate key `optimizer.type`"), std::string::npos) << e.what();
  }
}

TEST(Overrides, SetReplacesANestedNumber) {
  json j = minimal();
  apply_override(j, "optimizer.params.lr=0.5");
  EXPECT_EQ(j["optimizer"]["params"]["lr"], 0.5);
}

TEST(Overrides, SetTakesBareWordsAsStrings) {
  json j = minimal();
  apply_override(j, "scheduler.type=WarmupLR");
  EXPECT_EQ(j["scheduler"]["type"], "WarmupLR");
}

TEST(Overrides, SetWithoutEqualsIsRejected) {
  json j = minimal();
  EXPECT_THROW(apply_override(j, "training.steps"), InputError);
}

TEST(Quickstart, ShippedFileEqualsTheBuiltInDefault) {
  EXPECT_EQ(load_json_file(std::string(ZERO3D_SOURCE_DIR) + "/input/quickstart.json"), quickstart_json());
}

TEST(Quickstart, EveryShippedConfigValidates) {
  for (const char* name : {"quickstart.json", "gpt-small-cpu.json"}) {
    const std::string path = std::string(ZERO3D_SOURCE_DIR) + "/input/" + name;
    EXPECT_NO_THROW(read_config(load_json_file(path), path, 2)) << path;
  }
}

}  // namespace

// --- mixed precision keys (DEEPSPEED-FACTS §1.4; DEEPSPEED-TEST-BEHAVIOURS §A) -----------------

TEST(PrecisionConfig, Fp32IsTheDefaultForParametersGradientsAndCommunication) {
  const Config c = read_config(minimal(), "c.json", 2);
  EXPECT_EQ(c.precision.param, DType::F32);
  EXPECT_EQ(c.precision.grad_accum, DType::F32);
  EXPECT_EQ(c.precision.comm, DType::F32);
}

TEST(PrecisionConfig, Fp16DefaultsAreDeepSpeeds) {
  json j = minimal();
  j["fp16"] = {{"enabled", true}};
  const PrecisionConfig p = read_config(j, "c.json", 2).precision;
  EXPECT_EQ(p.param, DType::F16);
  EXPECT_EQ(p.grad_accum, DType::F16);
  EXPECT_EQ(p.comm, DType::F16);
  EXPECT_EQ(p.loss_scale, 0.0);
  EXPECT_EQ(p.initial_scale_power, 16);
  EXPECT_EQ(p.loss_scale_window, 1000);
  EXPECT_EQ(p.hysteresis, 2);
  EXPECT_FALSE(p.consecutive_hysteresis);
  EXPECT_EQ(p.min_loss_scale, 1.0);
}

TEST(PrecisionConfig, LossScaleAcceptsZeroIntegersFloatsAndNumericStrings) {
  for (const json& v : {json(0), json(1), json(2.0), json("3")}) {
    json j = minimal();
    j["fp16"] = {{"enabled", true}, {"loss_scale", v}};
    EXPECT_EQ(error_of(j), "") << v.dump();
  }
  json j = minimal();
  j["fp16"] = {{"enabled", true}, {"loss_scale", "3"}};
  EXPECT_EQ(read_config(j, "c.json", 2).precision.loss_scale, 3.0);
}

TEST(PrecisionConfig, LossScaleRejectsNegativeNonFiniteBooleansListsAndObjects) {
  for (const json& v : {json(-1), json("inf"), json("nan"), json(true), json::array({1}), json::object({{"a", 1}})}) {
    json j = minimal();
    j["fp16"] = {{"enabled", true}, {"loss_scale", v}};
    const std::string e = error_of(j);
    EXPECT_NE(e.find("`fp16.loss_scale`"), std::string::npos) << v.dump() << ": " << e;
    EXPECT_NE(e.find("number"), std::string::npos) << v.dump() << ": " << e;
  }
}

TEST(PrecisionConfig, Fp16AndBf16TogetherAreRejected) {
  json j = minimal();
  j["fp16"] = {{"enabled", true}};
  j["bf16"] = {{"enabled", true}};
  EXPECT_NE(error_of(j).find("both enabled"), std::string::npos);
}

TEST(PrecisionConfig, Bfloat16IsAnAliasOfBf16) {
  json j = minimal();
  j["bfloat16"] = {{"enabled", true}};
  EXPECT_EQ(read_config(j, "c.json", 2).precision.param, DType::BF16);
}

TEST(PrecisionConfig, CommunicationDataTypeIsCaseInsensitiveAndValidated) {
  json j = minimal();
  j["bf16"] = {{"enabled", true}};
  j["communication_data_type"] = "FP32";
  EXPECT_EQ(read_config(j, "c.json", 2).precision.comm, DType::F32);
  j["communication_data_type"] = "int8";
  EXPECT_NE(error_of(j).find("`communication_data_type`"), std::string::npos);
}

TEST(PrecisionConfig, GradAccumDtypeIsFp32OrTheModelDtype) {
  json j = minimal();
  j["bf16"] = {{"enabled", true}};
  j["data_types"] = {{"grad_accum_dtype", "fp32"}};
  EXPECT_EQ(read_config(j, "c.json", 2).precision.grad_accum, DType::F32);
  j["data_types"] = {{"grad_accum_dtype", "fp16"}};
  EXPECT_NE(error_of(j).find("`data_types.grad_accum_dtype`"), std::string::npos);
}

TEST(PrecisionConfig, Bf16ChecksGradientOverflowByDefault) {
  json j = minimal();
  j["bf16"] = {{"enabled", true}};
  EXPECT_TRUE(read_config(j, "c.json", 2).precision.check_grad_overflow);
  j["bf16"]["check_grad_overflow"] = false;
  EXPECT_FALSE(read_config(j, "c.json", 2).precision.check_grad_overflow);
}

