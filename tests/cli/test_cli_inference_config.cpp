// DeepSpeed's init_inference keys, black-box: zero3d generate reads them from the config's
// `inference` section or from --inference-config (DeepSpeed's inference JSON, its keys at the top
// level). dtype, tensor_parallel.tp_size / mp_size and zero.stage choose the layout generation
// runs at (the same tokens as the equivalent training keys give); max_out_tokens and
// min_out_tokens bound the sequences up front; checkpoint (under base_dir) names the weights;
// the keys with no meaning here are listed once, and a wrong type or value is exit 2 naming it.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "io/h5.hpp"
#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

// The generation goldens' GPT-2 (tests/golden/make_generate_goldens.py): vocabulary 64, 32
// positions, and the prompts' greedy continuations PyTorch gives.
struct Golden {
  json config;
  std::string prompts;
  std::vector<std::vector<int32_t>> greedy;
};

const Golden& golden() {
  static const Golden g = [] {
    Golden out;
    const std::string weights = kSource + "/tests/golden/generate_gpt2.h5";
    const zero3d::h5::File f = zero3d::h5::File::open_read(weights);
    std::string text;
    int64_t prompts = 0;
    EXPECT_TRUE(zero3d::h5::read_attribute(f.id(), "config", text));
    EXPECT_TRUE(zero3d::h5::read_attribute(f.id(), "prompts", prompts));
    json model = json::parse(text);
    model["init_from"] = weights;
    out.config = {{"train_micro_batch_size_per_gpu", 1},
                  {"gradient_accumulation_steps", 1},
                  {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                  {"model", model},
                  {"training", {{"steps", 2}, {"seed", 7}, {"peak_gflops", 50}}},
                  {"steps_per_print", 100}};
    out.prompts = temp_path("inference_prompts.txt");
    std::ofstream file(out.prompts);
    for (int64_t k = 0; k < prompts; ++k) {
      std::string line;
      for (int32_t id : f.read_ints("golden/prompt_" + std::to_string(k))) line += (line.empty() ? "" : ",") + std::to_string(id);
      file << line << "\n";
      out.greedy.push_back(f.read_ints("golden/greedy_" + std::to_string(k)));
    }
    return out;
  }();
  return g;
}

std::string config_with(const std::string& name, const json& inference) {
  json c = golden().config;
  if (!inference.is_null()) c["inference"] = inference;
  return write_config(name, c);
}

const std::string kGreedy = " --greedy --max-new-tokens 10 --eos-id -1 --batch-size 3 --json";

json last_line(const Result& r) {
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  if (r.code != 0) return json();
  const size_t at = r.out.rfind("\n{");
  return json::parse(at == std::string::npos ? r.out : r.out.substr(at + 1));
}

std::vector<std::vector<int32_t>> tokens(const json& doc) {
  std::vector<std::vector<int32_t>> out;
  if (doc.is_null()) return out;
  for (const json& o : doc.at("outputs")) out.push_back(o.at("tokens").get<std::vector<int32_t>>());
  return out;
}

json generate(const std::string& config, const std::string& args, int np = 0) {
  return last_line(run("generate " + config + " --prompt-ids-file " + golden().prompts + kGreedy + " " + args, np));
}

// tensor_parallel.tp_size, its deprecated name mp_size and zero.stage 3 at two ranks: PyTorch's tokens.
TEST(InferenceConfig, TensorRanksAndZeroStageAreTheLayout) {
  EXPECT_EQ(tokens(generate(config_with("inf_tp.json", {{"tensor_parallel", {{"tp_size", 2}}}}), "", 2)), golden().greedy);
  EXPECT_EQ(tokens(generate(config_with("inf_mp.json", {{"mp_size", 2}}), "", 2)), golden().greedy);
  EXPECT_EQ(tokens(generate(config_with("inf_zero.json", {{"zero", {{"stage", 3}}}}), "", 2)), golden().greedy);
  expect_one_line_rejection(run("generate " + config_with("inf_tp3.json", {{"tp", {{"tp_size", 3}}}}) +
                                " --prompt-ids 1,2", 2),
                            "`inference.tensor_parallel.tp_size` 3 does not divide the number of ranks (2)");
}

// dtype "bf16" (or DeepSpeed's "torch.bfloat16") generates as bf16.enabled does; "float" (fp32)
// overrides the training config's bf16.
TEST(InferenceConfig, DtypeIsThePrecisionGenerationRunsIn) {
  const json plain = generate(config_with("inf_plain.json", nullptr), "");
  const json bf16 = generate(config_with("inf_plain.json", nullptr), "--set bf16.enabled=true");
  const json asked = generate(config_with("inf_bf16.json", {{"dtype", "torch.bfloat16"}}), "");
  const json fp32 = generate(config_with("inf_fp32.json", {{"dtype", "float"}}), "--set bf16.enabled=true");
  ASSERT_FALSE(plain.is_null() || bf16.is_null() || asked.is_null() || fp32.is_null());
  EXPECT_EQ(plain.at("dtype"), "fp32");
  EXPECT_EQ(bf16.at("dtype"), "bf16");
  EXPECT_EQ(asked.at("dtype"), "bf16");
  EXPECT_EQ(tokens(asked), tokens(bf16));
  EXPECT_EQ(fp32.at("dtype"), "fp32");
  EXPECT_EQ(tokens(fp32), golden().greedy);
}

// --inference-config: DeepSpeed's inference JSON, its keys at the top level.
TEST(InferenceConfig, ADeepSpeedInferenceJsonIsTheSection) {
  const std::string file = temp_path("ds_inference.json");
  std::ofstream(file) << json{{"tensor_parallel", {{"tp_size", 2}}}, {"dtype", "fp32"}, {"max_out_tokens", 32},
                              {"replace_with_kernel_inject", true}}.dump();
  const Result r = run("generate " + config_with("inf_file.json", nullptr) + " --inference-config " + file +
                       " --prompt-ids-file " + golden().prompts + kGreedy, 2);
  EXPECT_EQ(tokens(last_line(r)), golden().greedy);
  EXPECT_NE(r.out.find("no effect on this build: `inference.replace_with_kernel_inject` = true"), std::string::npos)
      << r.out;
}

// max_out_tokens bounds prompt + new tokens; min_out_tokens demands room for new tokens.
TEST(InferenceConfig, OutTokensBoundTheSequencesUpFront) {
  const std::string capped = config_with("inf_max.json", {{"max_out_tokens", 12}});
  // prompt 0 has 5 tokens: 5 + 10 > 12
  expect_one_line_rejection(run("generate " + capped + " --prompt-ids-file " + golden().prompts + kGreedy),
                            "line 1: 5 prompt tokens + --max-new-tokens 10 exceed `inference.max_out_tokens` 12");
  const json fits = last_line(run("generate " + capped + " --prompt-ids-file " + golden().prompts +
                                  " --greedy --max-new-tokens 5 --eos-id -1 --json"));  // 7 + 5 <= 12
  ASSERT_FALSE(fits.is_null());
  for (size_t k = 0; k < 3; ++k)
    EXPECT_EQ(tokens(fits)[k], std::vector<int32_t>(golden().greedy[k].begin(), golden().greedy[k].begin() + 5));
  const std::string room = config_with("inf_min.json", {{"min_out_tokens", 26}});  // 32 positions
  expect_one_line_rejection(run("generate " + room + " --prompt-ids-file " + golden().prompts + kGreedy),
                            "line 3: 7 prompt tokens leave room for 25 new tokens within the model's 32 positions "
                            "(n_positions), fewer than `inference.min_out_tokens` 26");
  EXPECT_EQ(tokens(generate(config_with("inf_min_ok.json", {{"min_tokens", 25}}), "")), golden().greedy);
}

// Keys with no meaning here are accepted with their type and listed once at start-up.
TEST(InferenceConfig, KeysWithoutEffectAreListedOnce) {
  const json section = {{"enable_cuda_graph", true}, {"kernel_inject", false}, {"replace_method", "auto"},
                        {"injection_policy", nullptr}, {"training_mp_size", 2}, {"use_triton", true},
                        {"triangular_masking", true}};
  const Result r = run("generate " + config_with("inf_noop.json", section) + " --prompt-ids-file " + golden().prompts +
                       kGreedy);
  EXPECT_EQ(tokens(last_line(r)), golden().greedy);
  for (const char* key : {"enable_cuda_graph", "training_mp_size", "use_triton"})
    EXPECT_EQ(count(r.out, std::string("no effect on this build: `inference.") + key + "`"), 1u) << key << "\n" << r.out;
  // values that are what zero3d does anyway (DeepSpeed's defaults) are not listed
  for (const char* key : {"kernel_inject", "replace_method", "injection_policy", "triangular_masking"})
    EXPECT_EQ(count(r.out, key), 0u) << key << "\n" << r.out;
  // training reads the section and is not changed by it
  const Result t = run("validate " + config_with("inf_train.json", section));
  EXPECT_EQ(t.code, 0) << t.err;
}

// The checkpoint the section names, under base_dir, is the one loaded.
TEST(InferenceConfig, CheckpointUnderBaseDirIsLoaded) {
  json c = golden().config;
  c["training"]["save_interval"] = 2;
  const std::string dir = temp_path("inf_ckpt_run");
  ASSERT_EQ(run("train " + write_config("inf_ckpt_train.json", c) + " --output " + dir).code, 0);
  const json doc = generate(config_with("inf_ckpt.json", {{"checkpoint", "checkpoints"}, {"base_dir", dir}}), "");
  ASSERT_FALSE(doc.is_null());
  EXPECT_EQ(doc.at("step"), 2);
  EXPECT_EQ(doc.at("checkpoint"), dir + "/checkpoints");
}

TEST(InferenceConfig, AWrongTypeOrValueIsRefusedNamingTheKey) {
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"dtype", "int8"}}, "`inference.dtype`: value \"int8\": int8 is DeepSpeed's quantized inference"},
      {{{"dtype", 16}}, "`inference.dtype`: expected one of \"fp32\", \"fp16\", \"bf16\""},
      {{{"tensor_parallel", {{"tp_size", 0}}}}, "`inference.tensor_parallel.tp_size`: value 0 is out of range"},
      {{{"tensor_parallel", "two"}}, "`inference.tensor_parallel`: expected an object"},
      {{{"tensor_parallel", {{"tp_size", 2}}}, {"mp_size", 1}}, "`inference.mp_size`: value 1 differs"},
      {{{"max_out_tokens", "many"}}, "`inference.max_out_tokens`: expected an integer"},
      {{{"max_out_tokens", 0}}, "`inference.max_out_tokens`: value 0 is out of range"},
      {{{"max_out_tokens", 8}, {"min_out_tokens", 9}}, "`inference.min_out_tokens`: value 9 exceeds"},
      {{{"max_tokens", 8}, {"max_out_tokens", 9}}, "`inference.max_tokens`: `inference.max_out_tokens` is given too"},
      {{{"enable_cuda_graph", "yes"}}, "`inference.enable_cuda_graph`: expected true or false"},
      {{{"checkpoint", {{"type", "Megatron"}}}}, "`inference.checkpoint`: a checkpoint description"},
      {{{"checkpoint", 3}}, "`inference.checkpoint`: expected a path"},
      {{{"triangular_masking", false}}, "`inference.triangular_masking`: false: zero3d's models are causal"},
      {{{"zero", {{"stage", 4}}}}, "`inference.zero.stage`: value 4 is out of range"},
      {{{"cuda_graph", true}}, "`inference.cuda_graph`: unknown key"},
  };
  for (const auto& [section, message] : cases) {
    SCOPED_TRACE(section.dump());
    expect_one_line_rejection(run("generate " + config_with("inf_bad.json", section) + " --prompt-ids 1,2"), message);
  }
}

}  // namespace
