// Dropout (model.embd_pdrop, attn_pdrop, resid_pdrop; the Llama family's attention_dropout),
// black-box: the masks are keyed by global sample, layer, site and global element, so tensor,
// sequence, pipeline and data-parallel layouts and activation checkpointing give one rank's
// losses — with bf16 products (within bf16 rounding), block-sparse attention and MoE layers
// under expert parallelism too; bf16 products drop as fp32 does, within bf16 rounding;
// probabilities 0 are today's run in every bit; evaluation and generation never drop; a
// probability outside [0, 1) exits 2 naming the key.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

// H=4 so that t=2 splits heads, L=4 for two pipeline stages of two blocks, two micro-batches of 8
// per step on one rank (data-parallel ranks take one each), clipping active.
json gpt2_config() {
  return json{{"train_batch_size", 16},
              {"train_micro_batch_size_per_gpu", 8},
              {"gradient_clipping", 1.0},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}}}}},
              {"model",
               {{"vocab_size", 64}, {"n_positions", 16}, {"n_layer", 4}, {"n_head", 4}, {"n_embd", 32},
                {"embd_pdrop", 0.1}, {"attn_pdrop", 0.2}, {"resid_pdrop", 0.15}}},
              {"training", {{"steps", 5}, {"seed", 21}, {"peak_gflops", 50}}},
              {"steps_per_print", 100}};
}

// A Llama with grouped-query attention (4 heads over 2 K/V heads) and attention_dropout.
json llama_config() {
  json c = gpt2_config();
  c["model"] = {{"architecture", "llama"}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 48},
                {"num_hidden_layers", 4}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                {"seq_length", 16}, {"attention_dropout", 0.2}};
  return c;
}

// GPT-2's dropout with bf16 products, with block-sparse attention (blocks of 4: per-head
// patterns, some key blocks skipped), and with MoE layers (2 experts of top-1, ep_size by --set).
json gpt2_variant(const std::string& variant) {
  json c = gpt2_config();
  if (variant == "gpt2_bf16") c["bf16"] = {{"enabled", true}};
  if (variant == "gpt2_sparse")
    c["sparse_attention"] = {{"mode", "fixed"}, {"block", 4}, {"num_local_blocks", 2},
                             {"different_layout_per_head", true}, {"num_different_global_patterns", 2}};
  if (variant == "gpt2_moe") c["model"]["moe"] = {{"num_experts", 2}, {"k", 1}};
  return c;
}

// The Llama with bf16 products: in training with attention_dropout its bf16 attention runs the
// fused kernel, which draws the mask itself (ZERO3D_ATTENTION_KERNEL=tiled: the portable form).
json llama_bf16_config() {
  json c = llama_config();
  c["bf16"] = {{"enabled", true}};
  return c;
}

json config_of(const std::string& family) {
  if (family == "llama") return llama_config();
  if (family == "llama_bf16") return llama_bf16_config();
  return gpt2_variant(family);
}

struct TrainRun {
  int code;
  std::string err;
  std::vector<json> rows;
};

TrainRun train(const json& config, int np, const std::string& name, const std::string& args = "") {
  const std::string path = write_config("dropout_" + name + ".json", config);
  const std::string dir = temp_path("dropout_" + name);
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + path + " --output " + dir + " " + args, np);
  return {r.code, r.out + r.err, read_metrics(dir)};
}

std::vector<double> norms_of(const std::vector<json>& rows) {
  std::vector<double> out;
  for (const json& row : rows) out.push_back(row.at("grad_norm").get<double>());
  return out;
}

// The one-rank run of a family's config (cached).
const TrainRun& one_rank(const std::string& family) {
  static std::map<std::string, TrainRun> cache;
  auto it = cache.find(family);
  if (it == cache.end())
    it = cache.emplace(family, train(config_of(family), 1, family + "_ref")).first;
  return it->second;
}

struct Layout {
  std::string family;
  int np;
  std::string args, name;
  double tolerance = 1e-5;  // relative; bf16 products: another layout rounds elsewhere
};
class DropoutLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(DropoutLayout, GivesTheLossesAndGradientNormsOfOneRank) {
  const Layout& l = GetParam();
  const TrainRun& ref = one_rank(l.family);
  ASSERT_EQ(ref.code, 0) << ref.err;
  const TrainRun r = train(config_of(l.family), l.np, l.name, l.args);
  ASSERT_EQ(r.code, 0) << r.err;
  expect_losses_close(losses_of(r.rows), losses_of(ref.rows), l.tolerance, l.name + " loss");
  expect_losses_close(norms_of(r.rows), norms_of(ref.rows), l.tolerance, l.name + " grad_norm");
}

const std::string kFull = "--set activation_checkpointing.partition_activations=false "
                          "--set pipeline.activation_checkpoint_interval=1";
const std::string kSelective = "--set activation_checkpointing.recompute_granularity=selective";
// bf16 products: t = 2 keeps fp32 activations where one rank keeps bf16 ones, so the gradient
// norms drift by bf16 rounding (1% by step 5 here; 0.6% without dropout)
const double kBf16Layout = 2e-2;

INSTANTIATE_TEST_SUITE_P(
    Layouts, DropoutLayout,
    ::testing::Values(Layout{"gpt2", 2, "--set tensor_parallel.autotp_size=2", "gpt2_t2"},
                      Layout{"gpt2", 2, "--set tensor_parallel.autotp_size=2 --set tensor_parallel.sequence_parallel=true",
                             "gpt2_t2_sp"},
                      Layout{"gpt2", 2, "--set zero_optimization.stage=3", "gpt2_d2_z3"},
                      Layout{"gpt2", 2, "--set pipeline.stages=2", "gpt2_p2"},
                      Layout{"gpt2", 1, kFull, "gpt2_full_recompute"},
                      Layout{"gpt2", 1, kSelective, "gpt2_selective_recompute"},
                      Layout{"llama", 2, "--set tensor_parallel.autotp_size=2", "llama_t2"},
                      Layout{"llama", 2, "--set zero_optimization.stage=3", "llama_d2_z3"},
                      Layout{"llama", 2, "--set pipeline.stages=2", "llama_p2"},
                      Layout{"llama", 1, kFull, "llama_full_recompute"},
                      Layout{"gpt2_bf16", 2, "--set tensor_parallel.autotp_size=2", "gpt2_bf16_t2", kBf16Layout},
                      Layout{"gpt2_bf16", 2, "--set zero_optimization.stage=3", "gpt2_bf16_d2_z3", kBf16Layout},
                      Layout{"gpt2_bf16", 1, kSelective, "gpt2_bf16_selective_recompute"},
                      Layout{"llama_bf16", 2, "--set zero_optimization.stage=3", "llama_bf16_d2_z3", kBf16Layout},
                      Layout{"llama_bf16", 2, "--set pipeline.stages=2", "llama_bf16_p2", kBf16Layout},
                      Layout{"llama_bf16", 1, kSelective, "llama_bf16_selective_recompute"},
                      Layout{"gpt2_sparse", 2, "--set tensor_parallel.autotp_size=2", "gpt2_sparse_t2"},
                      Layout{"gpt2_sparse", 2, "--set zero_optimization.stage=3", "gpt2_sparse_d2_z3"},
                      Layout{"gpt2_moe", 2, "--set model.moe.ep_size=2", "gpt2_moe_ep2"}),
    [](const ::testing::TestParamInfo<Layout>& info) { return info.param.name; });

// Probabilities 0 written out are today's run without the keys, in every bit (with bf16
// products, sparse attention and MoE layers too); any probability changes the losses (so the
// layouts above compare runs that drop).
TEST(Dropout, ZeroProbabilitiesAreTodaysRunBitForBitAndDroppingChangesTheLosses) {
  for (const std::string variant : {"gpt2", "gpt2_bf16", "gpt2_sparse", "gpt2_moe"}) {
    json zero = gpt2_variant(variant), absent = gpt2_variant(variant);
    for (const char* key : {"embd_pdrop", "attn_pdrop", "resid_pdrop"}) {
      zero["model"][key] = 0.0;
      absent["model"].erase(key);
    }
    const TrainRun a = train(zero, 1, variant + "_zero"), b = train(absent, 1, variant + "_absent");
    ASSERT_EQ(a.code, 0) << a.err;
    ASSERT_EQ(b.code, 0) << b.err;
    EXPECT_EQ(losses_of(a.rows), losses_of(b.rows)) << variant;
    EXPECT_EQ(norms_of(a.rows), norms_of(b.rows)) << variant;
    ASSERT_EQ(one_rank(variant).code, 0) << one_rank(variant).err;
    EXPECT_NE(losses_of(one_rank(variant).rows).front(), losses_of(b.rows).front()) << variant;
  }
}

// bf16 products draw fp32's masks: the two runs differ by bf16 rounding, far less than bf16
// products without attention dropout differ from fp32 with it.
TEST(Dropout, Bf16ProductsDropAsFp32DoesWithinBf16Rounding) {
  ASSERT_EQ(one_rank("gpt2").code, 0);
  ASSERT_EQ(one_rank("gpt2_bf16").code, 0) << one_rank("gpt2_bf16").err;
  const std::vector<double> fp32 = losses_of(one_rank("gpt2").rows), bf16 = losses_of(one_rank("gpt2_bf16").rows);
  const TrainRun other = train(gpt2_variant("gpt2_bf16"), 1, "bf16_no_attn_pdrop", "--set model.attn_pdrop=0");
  ASSERT_EQ(other.code, 0) << other.err;
  const std::vector<double> unmasked = losses_of(other.rows);
  double same = 0, differ = 0;
  for (size_t i = 0; i < fp32.size(); ++i) {
    same = std::max(same, std::fabs(bf16[i] - fp32[i]) / fp32[i]);
    differ = std::max(differ, std::fabs(unmasked[i] - fp32[i]) / fp32[i]);
  }
  std::printf("[ bf16     ] losses against fp32's: %.2e relative (without attn_pdrop: %.2e)\n", same, differ);
  EXPECT_LT(same, 1e-3);
  EXPECT_GT(differ, 3 * same);
}

// The Llama's fused bf16 attention draws the portable form's attention_dropout mask: the two runs
// (the portable form is the fp32 kernel on the widened bf16 q, k, v) differ by bf16 rounding, far
// less than the run without attention dropout differs from them.
TEST(Dropout, LlamaFusedBf16AttentionDropsAsThePortableFormWithinBf16Rounding) {
  ASSERT_EQ(one_rank("llama_bf16").code, 0) << one_rank("llama_bf16").err;
  const std::vector<double> fused = losses_of(one_rank("llama_bf16").rows);
  const std::string path = write_config("dropout_llama_bf16_tiled.json", llama_bf16_config());
  const std::string dir = temp_path("dropout_llama_bf16_tiled");
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + path + " --output " + dir, 1, "ZERO3D_ATTENTION_KERNEL=tiled");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const std::vector<double> portable = losses_of(read_metrics(dir));
  const TrainRun other = train(llama_bf16_config(), 1, "llama_bf16_no_dropout", "--set model.attention_dropout=0");
  ASSERT_EQ(other.code, 0) << other.err;
  const std::vector<double> unmasked = losses_of(other.rows);
  ASSERT_EQ(portable.size(), fused.size());
  double same = 0, differ = 0;
  for (size_t i = 0; i < fused.size(); ++i) {
    same = std::max(same, std::fabs(fused[i] - portable[i]) / portable[i]);
    differ = std::max(differ, std::fabs(unmasked[i] - portable[i]) / portable[i]);
  }
  std::printf("[ bf16     ] fused against portable: %.2e relative (without attention_dropout: %.2e)\n", same, differ);
  EXPECT_LT(same, 1e-3);
  EXPECT_GT(differ, 3 * same);
}

// `zero3d eval` --json: the last stdout line's eval_loss.
double eval_loss(const json& config, const std::string& name) {
  const Result r = run("eval " + write_config("dropout_eval_" + name + ".json", config) + " --json", 1);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  const std::string out = r.out.substr(0, r.out.find_last_not_of('\n') + 1);
  return r.code == 0 ? json::parse(out.substr(out.find_last_of('\n') + 1)).at("eval_loss").get<double>() : -1.0;
}

// `zero3d generate` --json: the outputs.
json generated(const json& config, const std::string& name, const std::string& args) {
  const Result r = run("generate " + write_config("dropout_gen_" + name + ".json", config) + " " + args + " --json", 1);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  const std::string out = r.out.substr(0, r.out.find_last_not_of('\n') + 1);
  return r.code == 0 ? json::parse(out.substr(out.find_last_of('\n') + 1)).at("outputs") : json();
}

TEST(Dropout, EvaluationAndGenerationNeverDrop) {
  for (const std::string family : {"gpt2", "llama"}) {
    json dropping = family == "llama" ? llama_config() : gpt2_config();
    dropping["data"] = {{"source", "synthetic"}, {"validation", {{"source", "synthetic"}}}};
    dropping["training"]["eval_steps"] = 2;
    json plain = dropping;
    for (const char* key : {"embd_pdrop", "attn_pdrop", "resid_pdrop", "attention_dropout"}) plain["model"].erase(key);
    EXPECT_EQ(eval_loss(dropping, family + "_drop"), eval_loss(plain, family + "_plain")) << family;
    const std::string sampled = "--prompt-ids 1,2,3 --max-new-tokens 8 --eos-id -1 --temperature 1.0 --seed 3";
    const json a = generated(dropping, family + "_drop", sampled), b = generated(plain, family + "_plain", sampled);
    EXPECT_FALSE(a.is_null());
    EXPECT_EQ(a, b) << family;
  }
}

// `zero3d convert` writes the probabilities a run trained with into Hugging Face's config.json.
TEST(Dropout, ConvertWritesTheProbabilitiesIntoConfigJson) {
  for (const std::string family : {"gpt2", "llama"}) {
    const TrainRun r = train(family == "llama" ? llama_config() : gpt2_config(), 1, family + "_saved",
                             "--set training.steps=1 --set training.save_interval=1");
    ASSERT_EQ(r.code, 0) << r.err;
    const std::string out = temp_path("dropout_hf_" + family);
    std::system(("rm -rf " + out).c_str());
    const Result c = run("convert " + temp_path("dropout_" + family + "_saved") + "/checkpoints " + out +
                         "/model.safetensors --tag global_step1");
    ASSERT_EQ(c.code, 0) << c.err;
    const json hf = json::parse(slurp(out + "/config.json"));
    if (family == "llama") {
      EXPECT_EQ(hf.at("attention_dropout"), 0.2);
    } else {
      EXPECT_EQ(hf.at("embd_pdrop"), 0.1);
      EXPECT_EQ(hf.at("attn_pdrop"), 0.2);
      EXPECT_EQ(hf.at("resid_pdrop"), 0.15);
    }
  }
}

// Hostile values: one line, exit 2, naming the key (before any work).
TEST(DropoutSettings, OutsideZeroToOneOrNotANumberExitTwoNamingTheKey) {
  const std::vector<std::pair<json, std::string>> values = {{-0.1, "is outside [0, 1)"},
                                                           {1.0, "would drop every element"},
                                                           {1.5, "is outside [0, 1)"},
                                                           {"0.1", "expected a number"},
                                                           {true, "expected a number"},
                                                           {1e-9, "below 2^-24"}};
  for (const char* key : {"embd_pdrop", "attn_pdrop", "resid_pdrop", "attention_dropout"}) {
    for (const auto& [value, why] : values) {
      json c = std::string(key) == "attention_dropout" ? llama_config() : gpt2_config();
      c["model"][key] = value;
      const Result r = run("train " + write_config("dropout_bad.json", c) + " --output " + temp_path("dropout_bad"));
      expect_one_line_rejection(r, "`model." + std::string(key) + "`");
      EXPECT_NE(r.err.find(why), std::string::npos) << key << " = " << value.dump() << ": " << r.err;
    }
  }
}

}  // namespace
