// test_config_model_family.cpp — model.architecture and the Llama family's keys: Hugging Face's
// config.json names and defaults (configuration_llama.py, configuration_mistral.py,
// configuration_qwen2.py), read from the model section or from a Hugging Face config.json
// (model.hf_config, the section's keys winning); every key zero3d cannot honour is an error
// naming it, never ignored.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "config/config.hpp"
#include "support/config_test_helpers.hpp"

using namespace zero3d;
using json = nlohmann::json;

namespace {

using config_test::error_of;
using config_test::minimal;

json with_model(const json& model) {
  json j = minimal();
  j["model"] = model;
  return j;
}

Config read(const json& model) { return read_config(with_model(model), "cfg.json", 2); }

// A Hugging Face config.json in a directory of its own; returns the directory.
std::string hf_dir(const std::string& name, const json& config) {
  const std::string dir = ::testing::TempDir() + "zero3d_hf_" + name;
  std::system(("mkdir -p " + dir).c_str());
  std::ofstream(dir + "/config.json") << config.dump(2);
  return dir;
}

// Llama-2-7B's config.json as the Hub has it.
json llama2_7b() {
  return json{{"architectures", {"LlamaForCausalLM"}}, {"bos_token_id", 1}, {"eos_token_id", 2},
              {"hidden_act", "silu"}, {"hidden_size", 4096}, {"initializer_range", 0.02},
              {"intermediate_size", 11008}, {"max_position_embeddings", 4096}, {"model_type", "llama"},
              {"num_attention_heads", 32}, {"num_hidden_layers", 32}, {"num_key_value_heads", 32},
              {"pretraining_tp", 1}, {"rms_norm_eps", 1e-05}, {"rope_scaling", nullptr},
              {"tie_word_embeddings", false}, {"torch_dtype", "float16"}, {"transformers_version", "4.31.0.dev0"},
              {"use_cache", true}, {"vocab_size", 32000}};
}

TEST(ModelFamily, Gpt2IsTheDefaultAndResolvesAsBefore) {
  const Config c = read(json{{"n_embd", 32}, {"n_head", 2}});
  EXPECT_FALSE(c.model.family.llama());
  EXPECT_FALSE(c.resolved["model"].contains("architecture"));
  EXPECT_FALSE(c.resolved["model"].contains("hf_config"));
}

TEST(ModelFamily, EachFamilyTakesHuggingFacesDefaults) {
  const Config llama = read(json{{"architecture", "llama"}});
  EXPECT_EQ(llama.model.vocab_size, 32000);
  EXPECT_EQ(llama.model.n_embd, 4096);
  EXPECT_EQ(llama.model.family.intermediate_size, 11008);
  EXPECT_EQ(llama.model.family.num_key_value_heads, 32);  // None: num_attention_heads
  EXPECT_EQ(llama.model.family.head_dim, 128);              // None: hidden_size / num_attention_heads
  EXPECT_EQ(llama.model.family.rope.max_position_embeddings, 2048);
  EXPECT_EQ(llama.model.family.rms_norm_eps, 1e-6);
  EXPECT_FALSE(llama.model.family.tie_word_embeddings);
  EXPECT_FALSE(llama.model.family.qkv_bias);
  EXPECT_EQ(llama.model.family.window_of(0), 0);

  const Config mistral = read(json{{"architecture", "mistral"}});
  EXPECT_EQ(mistral.model.family.intermediate_size, 14336);
  EXPECT_EQ(mistral.model.family.num_key_value_heads, 8);
  EXPECT_EQ(mistral.model.family.window_of(0), 4096);  // every layer slides
  EXPECT_EQ(mistral.model.family.window_of(31), 4096);

  const Config qwen2 = read(json{{"architecture", "qwen2"}});
  EXPECT_EQ(qwen2.model.vocab_size, 151936);
  EXPECT_EQ(qwen2.model.family.intermediate_size, 22016);
  EXPECT_TRUE(qwen2.model.family.qkv_bias);  // q/k/v biases, o_proj none
  EXPECT_FALSE(qwen2.model.family.o_bias);
  EXPECT_EQ(qwen2.model.family.window_of(31), 0);  // use_sliding_window false
}

// Qwen2: a window only with use_sliding_window, on layers >= max_window_layers (or those
// layer_types names); Mistral: sliding_window null is full attention.
TEST(ModelFamily, SlidingWindowsFollowEachFamilysRule) {
  const Config q = read(json{{"architecture", "qwen2"}, {"num_hidden_layers", 4}, {"use_sliding_window", true},
                             {"sliding_window", 8}, {"max_window_layers", 2}});
  EXPECT_EQ(q.model.family.window, (std::vector<int64_t>{0, 0, 8, 8}));
  const Config typed = read(json{{"architecture", "qwen2"}, {"num_hidden_layers", 3}, {"use_sliding_window", true},
                                 {"sliding_window", 8},
                                 {"layer_types", {"sliding_attention", "full_attention", "sliding_attention"}}});
  EXPECT_EQ(typed.model.family.window, (std::vector<int64_t>{8, 0, 8}));
  const Config m = read(json{{"architecture", "mistral"}, {"num_hidden_layers", 2}, {"sliding_window", nullptr}});
  EXPECT_EQ(m.model.family.window, (std::vector<int64_t>{0, 0}));
}

TEST(ModelFamily, ReadsAHuggingFaceDirectoryAndTheSectionWins) {
  const std::string dir = hf_dir("llama2", llama2_7b());
  const Config c = read(json{{"hf_config", dir}, {"num_hidden_layers", 2}, {"seq_length", 32}});
  EXPECT_EQ(c.model.family.arch, Architecture::Llama);  // from model_type
  EXPECT_EQ(c.model.n_layer, 2);                         // the section's
  EXPECT_EQ(c.model.n_embd, 4096);                       // the file's
  EXPECT_EQ(c.model.family.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.model.family.rope.max_position_embeddings, 4096);
  EXPECT_EQ(c.model.n_positions, 32);
  EXPECT_EQ(c.resolved["model"]["architecture"], "llama");
  EXPECT_EQ(c.resolved["model"]["hidden_size"], 4096);
  // a config.json path works as its directory does
  EXPECT_EQ(read(json{{"hf_config", dir + "/config.json"}}).model.n_layer, 32);
}

// Legacy rope_scaling ("type" an alias of "rope_type") and transformers v5's rope_parameters.
TEST(ModelFamily, ReadsEveryRopeTypeInBothForms) {
  const Config llama3 = read(json{{"architecture", "llama"},
                                  {"rope_theta", 500000.0},
                                  {"rope_scaling",
                                   {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                                    {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}}}});
  EXPECT_EQ(llama3.model.family.rope.type, kernels::RopeType::Llama3);
  EXPECT_EQ(llama3.model.family.rope.theta, 500000.0);
  EXPECT_EQ(llama3.model.family.rope.original_max_position_embeddings, 8192);
  const Config linear = read(json{{"architecture", "llama"}, {"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}}});
  EXPECT_EQ(linear.model.family.rope.type, kernels::RopeType::Linear);
  EXPECT_EQ(linear.model.family.rope.factor, 2.0);
  const Config v5 = read(json{{"architecture", "mistral"},
                              {"rope_parameters", {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 4.0}}}});
  EXPECT_EQ(v5.model.family.rope.type, kernels::RopeType::Yarn);
  EXPECT_EQ(v5.model.family.rope.theta, 1e6);
  EXPECT_EQ(read(json{{"architecture", "qwen2"}, {"rope_scaling", {{"rope_type", "dynamic"}, {"factor", 2.0}}}})
                .model.family.rope.type,
            kernels::RopeType::Dynamic);
}

TEST(ModelFamily, InconsistentSizesNameTheKeyAndNumbers) {
  EXPECT_NE(error_of(with_model({{"architecture", "llama"}, {"num_attention_heads", 8}, {"num_key_value_heads", 3}}))
                .find("`model.num_key_value_heads`: value 3 does not divide num_attention_heads (8)"),
            std::string::npos);
  EXPECT_NE(error_of(with_model({{"architecture", "llama"}, {"hidden_size", 100}, {"num_attention_heads", 8}}))
                .find("`model.hidden_size`: value 100 is not divisible by num_attention_heads (8)"),
            std::string::npos);
  // an explicit head_dim lifts that rule, but it must be even for rotate_half
  EXPECT_EQ(error_of(with_model({{"architecture", "llama"}, {"hidden_size", 100}, {"num_attention_heads", 8},
                                 {"head_dim", 16}})),
            "");
  EXPECT_NE(error_of(with_model({{"architecture", "llama"}, {"head_dim", 15}})).find("`model.head_dim`: head_dim 15 is odd"),
            std::string::npos);
}

TEST(ModelFamily, RopeScalingWithoutItsRequiredKeysOrOfAnotherTypeIsAnError) {
  EXPECT_NE(error_of(with_model({{"architecture", "llama"},
                                 {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}, {"high_freq_factor", 4.0},
                                                   {"original_max_position_embeddings", 8192}}}}))
                .find("`model.rope_scaling.low_freq_factor`: rope type llama3 needs it"),
            std::string::npos);
  EXPECT_NE(error_of(with_model({{"architecture", "llama"}, {"rope_scaling", {{"type", "linear"}}}}))
                .find("`model.rope_scaling.factor`: rope type linear needs it"),
            std::string::npos);
  EXPECT_NE(error_of(with_model({{"architecture", "llama"},
                                 {"rope_scaling", {{"rope_type", "longrope"}, {"short_factor", {1.0}}}}}))
                .find("(Phi-3's LongRoPE) is not implemented"),
            std::string::npos);
  EXPECT_NE(error_of(with_model({{"architecture", "llama"}, {"rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}},
                                 {"rope_parameters", {{"rope_type", "default"}}}}))
                .find("give either rope_parameters (transformers v5) or rope_scaling"),
            std::string::npos);
}

// What zero3d's block cannot compute is refused, naming the key: another activation, an
// attention dropout of 1 (everything dropped), Llama's pretraining_tp, a key of another family, a key a Hugging Face file holds
// that zero3d does not read.
TEST(ModelFamily, KeysThatWouldChangeTheArchitectureAreErrors) {
  EXPECT_NE(error_of(with_model({{"architecture", "llama"}, {"hidden_act", "gelu"}}))
                .find("`model.hidden_act`: value \"gelu\": zero3d's MLP is SwiGLU with silu"),
            std::string::npos);
  EXPECT_NE(error_of(with_model({{"architecture", "qwen2"}, {"attention_dropout", 1.0}}))
                .find("`model.attention_dropout`: value 1.0 is outside [0, 1)"),
            std::string::npos);
  EXPECT_NE(error_of(with_model({{"architecture", "mistral"}, {"attention_bias", true}})).find("`model.attention_bias`: unknown key"),
            std::string::npos);
  EXPECT_NE(error_of(with_model({{"architecture", "llama"}, {"sliding_window", 4}})).find("`model.sliding_window`: unknown key"),
            std::string::npos);
  json mixtral_keys = llama2_7b();
  mixtral_keys["num_local_experts"] = 8;
  EXPECT_NE(error_of(with_model({{"hf_config", hf_dir("llama_moe", mixtral_keys)}}))
                .find("`model.hf_config.num_local_experts`: not a key of Hugging Face's LlamaConfig that zero3d reads"),
            std::string::npos);
  json tp = llama2_7b();
  tp["pretraining_tp"] = 2;
  EXPECT_NE(error_of(with_model({{"hf_config", hf_dir("llama_tp", tp)}})).find("`model.hf_config.pretraining_tp`: value 2"),
            std::string::npos);
}

TEST(ModelFamily, ArchitectureAndModelTypeMustAgree) {
  const std::string dir = hf_dir("llama2_agree", llama2_7b());
  EXPECT_NE(error_of(with_model({{"architecture", "qwen2"}, {"hf_config", dir}}))
                .find("`model.architecture`: value \"qwen2\" differs from model_type \"llama\""),
            std::string::npos);
  json phi = llama2_7b();
  phi["model_type"] = "phi3";
  EXPECT_NE(error_of(with_model({{"hf_config", hf_dir("phi3", phi)}}))
                .find("model_type \"phi3\" is not a family zero3d reads"),
            std::string::npos);
  EXPECT_NE(error_of(with_model({{"architecture", "mixtral"}, {"num_local_experts", 1}}))
                .find("`model.num_experts_per_tok`: value 2 is more than num_local_experts (1)"),
            std::string::npos);
  EXPECT_NE(error_of(with_model({{"hf_config", dir}, {"architecture", "gpt2"}})).find("differs from model_type"),
            std::string::npos);
}

TEST(ModelFamily, GptAndLlamaKeysDoNotMix) {
  EXPECT_NE(error_of(with_model({{"architecture", "llama"}, {"n_layer", 2}}))
                .find("`model.n_layer`: GPT-2's key; model.architecture llama takes num_hidden_layers"),
            std::string::npos);
  EXPECT_NE(error_of(with_model({{"hidden_size", 64}}))
                .find("`model.hidden_size`: a key of the Llama family; set model.architecture"),
            std::string::npos);
}

// Tensor parallelism keeps whole K/V-head groups on a rank and splits the MLP's width evenly.
TEST(ModelFamily, TensorParallelSplitsMustDivideTheHeadsGroupsAndWidths) {
  const json tiny = {{"architecture", "llama"}, {"hidden_size", 32}, {"num_attention_heads", 4},
                     {"num_key_value_heads", 2}, {"intermediate_size", 48}, {"num_hidden_layers", 2}, {"vocab_size", 61}};
  json ok = with_model(tiny);
  ok["tensor_parallel"] = {{"autotp_size", 2}, {"sequence_parallel", true}};
  EXPECT_EQ(error_of(ok), "");
  json mqa = ok;
  mqa["model"]["num_key_value_heads"] = 1;
  EXPECT_NE(error_of(mqa).find("`tensor_parallel.autotp_size`: autotp_size 2 does not divide "
                               "model.num_key_value_heads (1): each rank must hold whole K/V heads"),
            std::string::npos);
  json mlp = ok;
  mlp["model"]["intermediate_size"] = 50;
  mlp["tensor_parallel"]["autotp_size"] = 4;
  mlp["model"]["num_key_value_heads"] = 4;
  EXPECT_NE(error_of(mlp, 4).find("autotp_size 4 does not divide model.intermediate_size (50)"), std::string::npos);
}

// Layouts and features the family does not have yet stop at validation, naming the key.
TEST(ModelFamily, UnsupportedCombinationsAreRejectedAtValidation) {
  const json tiny = {{"architecture", "llama"}, {"hidden_size", 32}, {"num_attention_heads", 4},
                     {"num_hidden_layers", 2}, {"vocab_size", 64}};
  json moe = tiny;
  moe["moe"] = {{"num_experts", 2}};
  EXPECT_NE(error_of(with_model(moe)).find("`model.moe.num_experts`: zero3d's MoE layers replace GPT-2 MLPs"),
            std::string::npos);
  json pld = with_model(tiny);
  pld["progressive_layer_drop"] = {{"enabled", true}};
  EXPECT_NE(error_of(pld).find("`progressive_layer_drop.enabled`: progressive layer drop is not implemented"),
            std::string::npos);
  json sparse = with_model(tiny);
  sparse["sparse_attention"] = {{"mode", "fixed"}, {"block", 16}};
  EXPECT_NE(error_of(sparse).find("`sparse_attention`: block-sparse attention is GPT-2's"), std::string::npos);
}

}  // namespace
