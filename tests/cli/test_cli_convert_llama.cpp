// test_cli_convert_llama.cpp — `zero3d convert` for the Llama family (Llama, Mistral, Qwen2, Mixtral):
// Hugging Face's names and shapes (LlamaForCausalLM's state_dict, written out here from the
// config, independently of zero3d's layout), the shards and their index, the dtypes, the
// family's config.json; and the round trip: the converted directory, read back through
// model.hf_config and model.init_from, is the trained model (the same loss bit for bit, HDF5
// and safetensors alike). AutoTP's preset on the command line.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "io/h5.hpp"
#include "support/cli_helpers.hpp"
#include "support/file_bytes.hpp"

using json = nlohmann::json;
using namespace cli;
using namespace zero3d::test;  // read_bytes, read_safetensors
namespace fs = std::filesystem;

namespace {

// A Qwen2 (q/k/v biases, GQA 4/2, head_dim 12 != hidden/heads, a window on layer 1, an untied
// head) and a Llama (every bias, a tied head, llama3 RoPE), trained on a text whose period
// divides B·T, saved at step 10 of 11.
json qwen2_model() {
  return {{"architecture", "qwen2"}, {"vocab_size", 256}, {"hidden_size", 32}, {"intermediate_size", 48},
          {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 12},
          {"use_sliding_window", true}, {"sliding_window", 6}, {"max_window_layers", 1}, {"rope_theta", 1e6},
          {"max_position_embeddings", 64}, {"eos_token_id", 7}, {"seq_length", 16}};
}
json llama_model() {
  return {{"architecture", "llama"}, {"vocab_size", 256}, {"hidden_size", 32}, {"intermediate_size", 40},
          {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 1},
          {"attention_bias", true}, {"mlp_bias", true}, {"tie_word_embeddings", true}, {"rms_norm_eps", 1e-5},
          {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 4.0}, {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8}}},
          {"max_position_embeddings", 64}, {"seq_length", 16}};
}

// A Mixtral: GQA 4/2, 4 SwiGLU experts, top-2, its load-balancing loss in the gradient.
json mixtral_model() {
  return {{"architecture", "mixtral"}, {"vocab_size", 256}, {"hidden_size", 32}, {"intermediate_size", 24},
          {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"num_local_experts", 4},
          {"num_experts_per_tok", 2}, {"router_aux_loss_coef", 0.01}, {"output_router_logits", true},
          {"max_position_embeddings", 64}, {"seq_length", 16}};
}

struct Trained {
  std::string name, config, dir;
  json model;
  std::string checkpoints() const { return dir + "/checkpoints --tag global_step10"; }
  double loss_after_step10() const { return losses_of(read_metrics(dir))[10]; }
};

json run_config(const json& model) {
  const std::string text = temp_path("llama_periodic.txt");
  {
    std::ofstream out(text);
    for (int i = 0; i < 400; ++i) out << "zero3d trains GPT models, fast!\n";  // 32 bytes = B·T
  }
  return json{{"train_batch_size", 2},
              {"train_micro_batch_size_per_gpu", 2},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}}}}},
              {"model", model},
              {"data", {{"source", "text"}, {"path", text}}},
              {"training", {{"steps", 11}, {"seed", 3}, {"peak_gflops", 50}, {"save_interval", 10}}}};
}

const Trained& trained(const std::string& name) {
  static std::map<std::string, Trained> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  Trained t{name, "", temp_path("convert_" + name + "_trained"),
            name == "qwen2" ? qwen2_model() : name == "mixtral" ? mixtral_model() : llama_model()};
  t.config = write_config("convert_" + name + ".json", run_config(t.model));
  std::system(("rm -rf " + t.dir).c_str());
  const Result r = run("train " + t.config + " --output " + t.dir, 1);
  EXPECT_EQ(r.code, 0) << r.err;
  return cache.emplace(name, t).first->second;
}

// One step from a converted directory alone: its config.json through model.hf_config, its
// weights through model.init_from. The loss of that step is computed before any update.
double loss_from(const Trained& t, const std::string& hf_dir, const std::string& weights, const std::string& out) {
  json cfg = run_config(json{{"hf_config", hf_dir}, {"init_from", weights}, {"seq_length", 16}});
  cfg["training"]["steps"] = 1;
  cfg["training"]["save_interval"] = 0;
  std::system(("rm -rf " + out).c_str());
  const Result r = run("train " + write_config(t.name + "_reload.json", cfg) + " --output " + out, 1);
  EXPECT_EQ(r.code, 0) << r.err;
  return r.code == 0 ? losses_of(read_metrics(out)).at(0) : -1.0;
}


// LlamaForCausalLM's / Qwen2ForCausalLM's / MixtralForCausalLM's parameters, from the config's
// sizes (modeling_llama.py, modeling_qwen2.py, modeling_mixtral.py with the on-disk expert names):
// what transformers' from_pretrained expects.
std::vector<std::pair<std::string, std::vector<int64_t>>> hugging_face_parameters(const json& c) {
  const int64_t C = c["hidden_size"], I = c["intermediate_size"], V = c["vocab_size"], H = c["num_attention_heads"];
  const int64_t KV = c["num_key_value_heads"], d = c["head_dim"], L = c["num_hidden_layers"];
  const bool qwen2 = c["model_type"] == "qwen2";
  const bool qkv_bias = qwen2 || c.value("attention_bias", false), o_bias = !qwen2 && c.value("attention_bias", false);
  const bool mlp_bias = !qwen2 && c.value("mlp_bias", false);
  std::vector<std::pair<std::string, std::vector<int64_t>>> p = {{"model.embed_tokens.weight", {V, C}}};
  for (int64_t l = 0; l < L; ++l) {
    const std::string b = "model.layers." + std::to_string(l) + ".";
    p.push_back({b + "input_layernorm.weight", {C}});
    for (const auto& [name, rows] : std::vector<std::pair<std::string, int64_t>>{{"q", H * d}, {"k", KV * d}, {"v", KV * d}})
      p.push_back({b + "self_attn." + name + "_proj.weight", {rows, C}});
    if (qkv_bias)
      for (const auto& [name, rows] : std::vector<std::pair<std::string, int64_t>>{{"q", H * d}, {"k", KV * d}, {"v", KV * d}})
        p.push_back({b + "self_attn." + name + "_proj.bias", {rows}});
    p.push_back({b + "self_attn.o_proj.weight", {C, H * d}});
    if (o_bias) p.push_back({b + "self_attn.o_proj.bias", {C}});
    p.push_back({b + "post_attention_layernorm.weight", {C}});
    if (c["model_type"] == "mixtral") {
      const int64_t E = c["num_local_experts"];
      p.push_back({b + "block_sparse_moe.gate.weight", {E, C}});
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = b + "block_sparse_moe.experts." + std::to_string(e) + ".";
        p.push_back({x + "w1.weight", {I, C}});
        p.push_back({x + "w2.weight", {C, I}});
        p.push_back({x + "w3.weight", {I, C}});
      }
      continue;
    }
    p.push_back({b + "mlp.gate_proj.weight", {I, C}});
    p.push_back({b + "mlp.up_proj.weight", {I, C}});
    if (mlp_bias) {
      p.push_back({b + "mlp.gate_proj.bias", {I}});
      p.push_back({b + "mlp.up_proj.bias", {I}});
    }
    p.push_back({b + "mlp.down_proj.weight", {C, I}});
    if (mlp_bias) p.push_back({b + "mlp.down_proj.bias", {C}});
  }
  p.push_back({"model.norm.weight", {C}});
  if (!c.value("tie_word_embeddings", false)) p.push_back({"lm_head.weight", {V, C}});
  return p;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

TEST(ConvertLlamaFamily, ConfigJsonIsTheFamilysConfigWithEveryFieldOfTheModel) {
  const std::string dir = temp_path("convert_qwen2_config");
  const Result r = run("convert " + trained("qwen2").checkpoints() + " " + dir + "/model.safetensors");
  ASSERT_EQ(r.code, 0) << r.err;
  const json c = json::parse(slurp(dir + "/config.json"));
  EXPECT_EQ(c["architectures"], json({"Qwen2ForCausalLM"}));
  EXPECT_EQ(c["model_type"], "qwen2");
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "use_sliding_window", "sliding_window", "max_window_layers",
                          "rope_theta", "max_position_embeddings", "eos_token_id"})
    EXPECT_EQ(c[key], qwen2_model()[key]) << key;
  EXPECT_EQ(c["layer_types"], json({"full_attention", "sliding_attention"}));
  EXPECT_EQ(c["rms_norm_eps"], 1e-6);  // Qwen2Config's default, which the run took
  EXPECT_EQ(c["tie_word_embeddings"], false);
  EXPECT_TRUE(c["rope_scaling"].is_null());
  EXPECT_TRUE(c["bos_token_id"].is_null()) << "not given: unknown";
  EXPECT_EQ(c["hidden_act"], "silu");
  EXPECT_EQ(c["torch_dtype"], "float32");
  EXPECT_FALSE(c.contains("attention_bias")) << "a LlamaConfig key, not Qwen2Config's";

  const std::string ldir = temp_path("convert_llama_config");
  ASSERT_EQ(run("convert " + trained("llama").checkpoints() + " " + ldir + "/model.safetensors --dtype fp16").code, 0);
  const json l = json::parse(slurp(ldir + "/config.json"));
  EXPECT_EQ(l["architectures"], json({"LlamaForCausalLM"}));
  EXPECT_EQ(l["model_type"], "llama");
  EXPECT_EQ(l["attention_bias"], true);
  EXPECT_EQ(l["mlp_bias"], true);
  EXPECT_EQ(l["tie_word_embeddings"], true);
  EXPECT_EQ(l["head_dim"], 8);
  EXPECT_EQ(l["rms_norm_eps"], 1e-5);
  EXPECT_EQ(l["rope_scaling"], llama_model()["rope_scaling"]);
  EXPECT_EQ(l["torch_dtype"], "float16");
  EXPECT_FALSE(l.contains("sliding_window"));
  const json meta = read_safetensors(ldir + "/model.safetensors").header.at("__metadata__");
  EXPECT_EQ(meta["model_type"], "llama");
  EXPECT_EQ(meta["num_key_value_heads"], "1");
  EXPECT_EQ(meta["head_dim"], "8");
  EXPECT_EQ(meta["step"], "10");
}

TEST(ConvertLlamaFamily, MixtralsConfigJsonHoldsItsRouter) {
  const std::string dir = temp_path("convert_mixtral_config");
  const Result r = run("convert " + trained("mixtral").checkpoints() + " " + dir + "/model.safetensors");
  ASSERT_EQ(r.code, 0) << r.err;
  const json c = json::parse(slurp(dir + "/config.json"));
  EXPECT_EQ(c["architectures"], json({"MixtralForCausalLM"}));
  EXPECT_EQ(c["model_type"], "mixtral");
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
                          "output_router_logits", "max_position_embeddings"})
    EXPECT_EQ(c[key], mixtral_model()[key]) << key;
  EXPECT_EQ(c["router_jitter_noise"], 0.0);
  EXPECT_EQ(c["rms_norm_eps"], 1e-5);   // MixtralConfig's defaults, which the run took
  EXPECT_EQ(c["rope_theta"], 1e6);
  EXPECT_TRUE(c["sliding_window"].is_null());
  EXPECT_FALSE(c.contains("mlp_bias")) << "a LlamaConfig key, not MixtralConfig's";
}

// A run with the router's jitter writes its router_jitter_noise into config.json.
TEST(ConvertLlamaFamily, MixtralsConfigJsonHoldsItsJitter) {
  json model = mixtral_model();
  model["router_jitter_noise"] = 0.05;
  json cfg = run_config(model);
  cfg["training"]["steps"] = 2;
  cfg["training"]["save_interval"] = 2;
  const std::string trained_dir = temp_path("convert_mixtral_jitter_trained"), dir = temp_path("convert_mixtral_jitter");
  std::system(("rm -rf " + trained_dir + " " + dir).c_str());
  ASSERT_EQ(run("train " + write_config("convert_mixtral_jitter.json", cfg) + " --output " + trained_dir, 1).code, 0);
  const Result r = run("convert " + trained_dir + "/checkpoints " + dir + "/model.safetensors");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(slurp(dir + "/config.json"))["router_jitter_noise"], 0.05);
}

TEST(ConvertLlamaFamily, ShardsAndIndexHoldHuggingFacesNamesShapesAndDtypes) {
  for (const auto& [family, dtype] : std::vector<std::pair<std::string, std::string>>{
           {"qwen2", "fp32"}, {"qwen2", "bf16"}, {"mixtral", "fp32"}}) {
    const Trained& t = trained(family);
    const std::string dir = temp_path("convert_" + family + "_shards_" + dtype);
    std::system(("rm -rf " + dir).c_str());
    const Result r = run("convert " + t.checkpoints() + " " + dir + "/model.safetensors --max-shard-size 20KB --dtype " + dtype);
    ASSERT_EQ(r.code, 0) << r.err;
    const json config = json::parse(slurp(dir + "/config.json"));
    const auto params = hugging_face_parameters(config);
    const int64_t width = dtype == "fp32" ? 4 : 2;
    const json index = json::parse(slurp(dir + "/model.safetensors.index.json"));
    // the index: every parameter, each in one shard, the total size of their bytes
    int64_t total = 0;
    std::set<std::string> names;
    for (const auto& [name, shape] : params) total += width * numel(shape), names.insert(name);
    EXPECT_EQ(index["metadata"]["total_size"], total);
    std::set<std::string> mapped, shards;
    for (const auto& [name, shard] : index["weight_map"].items()) mapped.insert(name), shards.insert(shard.get<std::string>());
    EXPECT_EQ(mapped, names);
    const size_t n = shards.size();
    ASSERT_GE(n, 3u) << "20 KB shards of a " << total << "-byte model";
    // shards named as Hugging Face names them, together every parameter once with its shape
    // and dtype, each within the limit unless it holds one larger tensor, filled greedily in
    // the order the files hold the tensors (their data_offsets)
    std::map<std::string, std::vector<int64_t>> shape_of(params.begin(), params.end());
    std::vector<std::vector<int64_t>> sizes(n);  // each shard's tensor sizes in file order
    int64_t seen = 0;
    for (size_t k = 1; k <= n; ++k) {
      char shard[64];
      std::snprintf(shard, sizeof(shard), "model-%05zu-of-%05zu.safetensors", k, n);
      ASSERT_TRUE(shards.count(shard)) << shard;
      const Safetensors s = read_safetensors(dir + "/" + shard);
      std::map<int64_t, int64_t> by_offset;  // begin -> bytes
      for (const auto& [name, entry] : s.header.items()) {
        if (name == "__metadata__") continue;
        ++seen;
        ASSERT_TRUE(shape_of.count(name)) << name << " is not a parameter of the model";
        EXPECT_EQ(index["weight_map"][name], shard) << name;
        EXPECT_EQ(entry["dtype"], dtype == "fp32" ? "F32" : "BF16") << name;
        EXPECT_EQ(entry["shape"].get<std::vector<int64_t>>(), shape_of[name]) << name;
        const int64_t begin = entry["data_offsets"][0], end = entry["data_offsets"][1];
        EXPECT_EQ(end - begin, width * numel(shape_of[name])) << name;
        by_offset[begin] = end - begin;
      }
      int64_t bytes = 0;
      for (const auto& [begin, len] : by_offset) {
        EXPECT_EQ(begin, bytes) << shard << ": tensors lie back to back";
        bytes += len;
        sizes[k - 1].push_back(len);
      }
      EXPECT_EQ(static_cast<int64_t>(s.data.size()), bytes) << shard;
      EXPECT_TRUE(bytes <= 20000 || sizes[k - 1].size() == 1) << shard << " holds " << bytes << " bytes";
    }
    EXPECT_EQ(seen, static_cast<int64_t>(params.size()));
    for (size_t k = 0; k + 1 < n; ++k) {  // the next shard's first tensor did not fit
      int64_t bytes = 0;
      for (int64_t b : sizes[k]) bytes += b;
      EXPECT_GT(bytes + sizes[k + 1].front(), 20000) << "shard " << k + 1;
    }
  }
}

TEST(ConvertLlamaFamily, TheConvertedDirectoryIsTheTrainedModel) {
  for (const std::string name : {"qwen2", "llama", "mixtral"}) {
    const Trained& t = trained(name);
    const std::string dir = temp_path("convert_" + name + "_roundtrip");
    std::system(("rm -rf " + dir).c_str());
    ASSERT_EQ(run("convert " + t.checkpoints() + " " + dir + "/model.safetensors --max-shard-size 30KB").code, 0);
    EXPECT_EQ(loss_from(t, dir, dir + "/model.safetensors.index.json", temp_path(name + "_from_shards")),
              t.loss_after_step10()) << name << ": same weights and batch, same bits";
    // the HDF5 output holds the same tensors, bit for bit, and reloads to the same loss
    const std::string h5dir = temp_path("convert_" + name + "_h5");
    std::system(("rm -rf " + h5dir).c_str());
    ASSERT_EQ(run("convert " + t.checkpoints() + " " + h5dir + "/model.h5").code, 0);
    EXPECT_EQ(loss_from(t, h5dir, h5dir + "/model.h5", temp_path(name + "_from_h5")), t.loss_after_step10()) << name;
    const std::string single = temp_path("convert_" + name + "_single");
    ASSERT_EQ(run("convert " + t.checkpoints() + " " + single + "/model.safetensors").code, 0);
    const Safetensors s = read_safetensors(single + "/model.safetensors");
    zero3d::h5::File f = zero3d::h5::File::open_read(h5dir + "/model.h5");
    int64_t compared = 0;
    for (const auto& [tensor, entry] : s.header.items()) {
      if (tensor == "__metadata__") continue;
      const std::vector<float> h5 = f.read_floats(tensor);
      const int64_t begin = entry["data_offsets"][0];
      ASSERT_EQ(static_cast<int64_t>(h5.size() * 4), entry["data_offsets"][1].get<int64_t>() - begin) << tensor;
      EXPECT_EQ(std::memcmp(h5.data(), s.data.data() + begin, h5.size() * 4), 0) << tensor;
      ++compared;
    }
    EXPECT_EQ(compared, static_cast<int64_t>(hugging_face_parameters(json::parse(slurp(single + "/config.json"))).size()));
    std::string model_type;
    ASSERT_TRUE(zero3d::h5::read_attribute(f.id(), "model_type", model_type));
    EXPECT_EQ(model_type, name);
  }
}

TEST(ConvertLlamaFamily, AutoTpPresetOfAnotherFamilyExitsTwoWithOneLine) {
  const std::string config = trained("qwen2").config;
  expect_one_line_rejection(run("validate " + config + " --world-size 2 --set tensor_parallel.autotp_size=2 "
                                "--set tensor_parallel.preset_model=llama", 0),
                            "`tensor_parallel.preset_model`: value \"llama\" does not match model.architecture \"qwen2\"");
  const Result ok = run("validate " + config + " --world-size 2 --set tensor_parallel.autotp_size=2 "
                        "--set tensor_parallel.preset_model=qwen2", 0);
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.out.find("the rules agree with zero3d's split of this qwen2 model"), std::string::npos) << ok.out;
}

}  // namespace
