// test_config_autotp.cpp — DeepSpeed's AutoTP keys, tensor_parallel.preset_model and
// tensor_parallel.partition_config, with DeepSpeed's meaning (autotp_config.py, auto_tp.py),
// checked against the split zero3d makes of a Llama-family model: rules that ask for that split
// are accepted, anything else is an error naming the key, the spec and the parameter.
#include <gtest/gtest.h>

#include "config/config.hpp"
#include "support/config_test_helpers.hpp"

using namespace zero3d;
using json = nlohmann::json;

namespace {

using config_test::error_of;
using config_test::minimal;

// A small GQA model (4 query heads over 2 K/V heads, head_dim 16) at autotp_size t over 2 ranks.
json llama(const std::string& arch = "llama", int t = 2) {
  json j = minimal();
  j["model"] = {{"architecture", arch}, {"vocab_size", 256},      {"hidden_size", 64},
                {"intermediate_size", 96}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                {"num_key_value_heads", 2}, {"seq_length", 32}};
  j["tensor_parallel"] = {{"autotp_size", t}};
  return j;
}

// AutoTPPresets.llama() written out as a partition_config.
json llama_rules() {
  return json::array({{{"patterns", {R"(.*\.self_attn\.o_proj\.weight$)"}}, {"partition_type", "row"}},
                      {{"patterns", {R"(.*\.self_attn\.[qkv]_proj\.weight$)"}}, {"partition_type", "column"}},
                      {{"patterns", {R"(.*\.mlp\.down_proj\.weight$)"}}, {"partition_type", "row"}},
                      {{"patterns", {R"(.*\.mlp\.(up|gate)_proj\.weight$)"}}, {"partition_type", "column"}}});
}

json with_rules(json j, const json& specs, bool use_default_specs = false) {
  j["tensor_parallel"]["partition_config"] = {{"use_default_specs", use_default_specs}, {"layer_specs", specs}};
  return j;
}

bool has_note(const Config& c, const std::string& text) {
  for (const std::string& n : c.notes)
    if (n.find(text) != std::string::npos) return true;
  return false;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST(AutoTp, EachFamilysPresetGivesTheBuiltInSplit) {
  for (const std::string arch : {"llama", "mistral", "qwen2"}) {
    json j = llama(arch);
    j["tensor_parallel"]["preset_model"] = arch;
    const Config c = read_config(j, "cfg.json", 2);
    EXPECT_EQ(c.tensor.preset_model, arch);
    EXPECT_TRUE(has_note(c, "tensor_parallel.preset_model: the rules agree with zero3d's split of this " + arch)) << arch;
    EXPECT_EQ(c.resolved["tensor_parallel"]["preset_model"], arch);
  }
  json upper = llama();
  upper["tensor_parallel"]["preset_model"] = "Llama";  // get_preset lower-cases the name
  EXPECT_EQ(read_config(upper, "cfg.json", 2).tensor.preset_model, "llama");
  json one_rank = llama("llama", 1);  // accepted, and the start-up line says nothing is split
  one_rank["tensor_parallel"]["preset_model"] = "llama";
  EXPECT_TRUE(has_note(read_config(one_rank, "cfg.json", 2), "autotp_size is 1, so nothing is split"));
}

TEST(AutoTp, APresetOfAnotherOrUntrainedFamilyExitsNamingKeyAndValue) {
  json other = llama();
  other["tensor_parallel"]["preset_model"] = "qwen2";
  EXPECT_EQ(error_of(other), "cfg.json: `tensor_parallel.preset_model`: value \"qwen2\" does not match model.architecture "
                             "\"llama\"; use preset_model \"llama\"");
  json bloom = llama();
  bloom["tensor_parallel"]["preset_model"] = "bloom";
  EXPECT_TRUE(contains(error_of(bloom), "`tensor_parallel.preset_model`: value \"bloom\": DeepSpeed's AutoTP preset for "
                                        "a family zero3d does not train"));
  json mixtral = llama();  // a preset zero3d trains, for another model
  mixtral["tensor_parallel"]["preset_model"] = "mixtral";
  EXPECT_TRUE(contains(error_of(mixtral), "value \"mixtral\" does not match model.architecture \"llama\""));
  json unknown = llama();
  unknown["tensor_parallel"]["preset_model"] = "gptj";
  EXPECT_TRUE(contains(error_of(unknown), "value \"gptj\": not an AutoTP preset"));
  json both = with_rules(other, llama_rules());  // one problem, the other key still known
  EXPECT_EQ(error_of(both), error_of(other));
  json gpt2 = minimal();
  gpt2["tensor_parallel"] = {{"autotp_size", 2}, {"preset_model", "llama"}};
  EXPECT_TRUE(contains(error_of(gpt2), "`tensor_parallel.preset_model`: value \"llama\": model.architecture is gpt2"));
  json gpt2_rules = minimal();
  gpt2_rules["tensor_parallel"] = {{"autotp_size", 2}, {"partition_config", {{"layer_specs", llama_rules()}}}};
  EXPECT_TRUE(contains(error_of(gpt2_rules), "`tensor_parallel.partition_config`: AutoTP rules over Hugging Face parameter names"));
}

TEST(AutoTp, APartitionConfigEqualToThePresetIsAccepted) {
  const Config c = read_config(with_rules(llama("qwen2"), llama_rules()), "cfg.json", 2);
  EXPECT_TRUE(c.tensor.preset_model.empty());
  EXPECT_TRUE(has_note(c, "tensor_parallel.partition_config: the rules agree"));
  // the same rules in another order and grouping, an explicit partition_dim, a shape that is
  // the plain split, and rules for the embedding (skip) and the head (column) it keeps whole
  json specs = json::array(
      {{{"patterns", {R"(model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight)"}}, {"partition_dim", 0}},
       {{"patterns", {R"(.*q_proj\.weight$)", R"(.*[kv]_proj\.weight$)"}}, {"shape", {-1, 64}}, {"partition_dim", 0}},
       {{"patterns", {R"(.*(o|down)_proj\.weight$)"}}, {"partition_type", "ROW"}},
       {{"patterns", {"model.embed_tokens"}}, {"partition_type", "skip"}},
       {{"patterns", {"lm_head"}}, {"partition_type", "column"}}});
  EXPECT_EQ(error_of(with_rules(llama(), specs)), "");
  // one list of unequal sub-parameters covering the rows is still the plain split
  json nested = llama_rules();
  nested[1]["patterns"] = {R"(.*q_proj\.weight$)"};
  nested[1]["shape"] = json::array({json::array({64}), -1});
  nested.push_back({{"patterns", {R"(.*[kv]_proj\.weight$)"}}});
  EXPECT_EQ(error_of(with_rules(llama(), nested)), "");
  // the same shape on k_proj (32 rows): DeepSpeed refuses it as well
  nested[1]["patterns"] = {R"(.*[qk]_proj\.weight$)"};
  EXPECT_TRUE(contains(error_of(with_rules(llama(), nested)),
                       "model.layers.0.self_attn.k_proj.weight zero3d cannot make: its shape [64,32] is not the weight's [32, 64]"));
}

TEST(AutoTp, ADifferentSplitOfAWeightNamesThePatternAndTheParameter) {
  json row_q = llama_rules();
  row_q[1]["partition_type"] = "row";
  EXPECT_EQ(error_of(with_rules(llama(), row_q)),
            "cfg.json: `tensor_parallel.partition_config.layer_specs[1]`: asks for a split of "
            "model.layers.0.self_attn.q_proj.weight zero3d cannot make: partition_type \"row\"; zero3d splits it "
            "column-parallel (output rows in contiguous blocks: whole K/V-head groups)");
  json skip_down = llama_rules();
  skip_down[2]["partition_type"] = "skip";
  EXPECT_TRUE(contains(error_of(with_rules(llama(), skip_down)),
                       "`tensor_parallel.partition_config.layer_specs[2]`: asks for a split of "
                       "model.layers.0.mlp.down_proj.weight zero3d cannot make: \"skip\" keeps it whole"));
  // two equal sub-parameters (a fused layout) interleave the ranks' rows
  json fused = llama_rules();
  fused[1]["shape"] = {2, -1};
  EXPECT_TRUE(contains(error_of(with_rules(llama(), fused)),
                       "model.layers.0.self_attn.q_proj.weight zero3d cannot make: its shape gives row 16 to rank 1, zero3d to rank 0"));
  json unequal = llama_rules();  // q_proj's 64 rows as [48, 16]: 48/2 and 16/2 per rank
  unequal[1]["patterns"] = {R"(.*q_proj\.weight$)"};
  unequal[1]["shape"] = json::array({json::array({48, 16}), -1});
  unequal.push_back({{"patterns", {R"(.*[kv]_proj\.weight$)"}}});
  EXPECT_TRUE(contains(error_of(with_rules(llama(), unequal)), "its shape gives row 24 to rank 1, zero3d to rank 0"));
  json along_input = llama_rules();  // a column spec whose shape splits the input
  along_input[3]["shape"] = {-1, -1};  // both inferred: the weight's own [rows, cols]
  along_input[3]["partition_dim"] = 1;
  EXPECT_TRUE(contains(error_of(with_rules(llama(), along_input)),
                       "model.layers.0.mlp.gate_proj.weight zero3d cannot make: its shape splits the input columns"));
  json embedding = llama_rules();
  embedding.push_back({{"patterns", {R"(model\.embed_tokens\.weight)"}}});
  EXPECT_TRUE(contains(error_of(with_rules(llama(), embedding)),
                       "`tensor_parallel.partition_config.layer_specs[4]`: asks for a split of model.embed_tokens.weight "
                       "zero3d cannot make: DeepSpeed splits an embedding along its hidden dimension"));
  json head_row = llama_rules();
  head_row.push_back({{"patterns", {"lm_head"}}, {"partition_type", "row"}});
  EXPECT_TRUE(contains(error_of(with_rules(llama(), head_row)), "lm_head.weight zero3d cannot make: partition_type \"row\""));
  json counted = llama_rules();  // an integer at partition_dim counts sub-parameters: 64 of one column
  counted[3]["shape"] = {-1, 64};
  counted[3]["partition_dim"] = 1;
  EXPECT_TRUE(contains(error_of(with_rules(llama(), counted)),
                       "gate_proj.weight zero3d cannot make: a sub-parameter of 1 does not split evenly over 2 ranks"));
  json gathered = llama_rules();
  gathered[3]["gather_output"] = true;
  EXPECT_TRUE(contains(error_of(with_rules(llama(), gathered)), "gather_output gives every rank the whole output"));
}

TEST(AutoTp, CustomSpecsComeBeforeThePresetsWithUseDefaultSpecs) {
  json j = llama();
  j["tensor_parallel"]["preset_model"] = "llama";
  // an extra rule on top of the preset's: accepted
  json head = with_rules(j, json::array({{{"patterns", {"lm_head"}}}}), /*use_default_specs=*/true);
  EXPECT_EQ(error_of(head), "");
  // a custom rule is matched first, before the preset's rule for the same weight
  json override = with_rules(j, json::array({{{"patterns", {R"(.*\.v_proj\.weight$)"}}, {"partition_type", "row"}}}), true);
  EXPECT_TRUE(contains(error_of(override), "`tensor_parallel.partition_config.layer_specs[0]`: asks for a split of "
                                           "model.layers.0.self_attn.v_proj.weight"));
  // without use_default_specs the preset's rules are not used: the projections have none
  json alone = with_rules(j, json::array({{{"patterns", {"lm_head"}}}}), /*use_default_specs=*/false);
  EXPECT_EQ(error_of(alone), "cfg.json: `tensor_parallel.partition_config`: 14 weights have no rule "
                             "(model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.k_proj.weight, "
                             "model.layers.0.self_attn.v_proj.weight, ...) with use_default_specs false: AutoTP would "
                             "leave them whole, zero3d splits every projection (q/k/v, gate/up column-parallel, o/down "
                             "row-parallel); add layer specs for them");
}

TEST(AutoTp, ASpecThatMatchesNoParameterOrLeavesOneWithoutARuleIsNamed) {
  json moe = llama_rules();
  moe.push_back({{"patterns", {R"(.*\.block_sparse_moe\.experts\.\d+\.w2\.weight$)"}}, {"partition_type", "row"}});
  EXPECT_TRUE(contains(error_of(with_rules(llama(), moe)),
                       "`tensor_parallel.partition_config.layer_specs[4]`: patterns "
                       "[\".*\\\\.block_sparse_moe\\\\.experts\\\\.\\\\d+\\\\.w2\\\\.weight$\"] match no parameter"));
  json norms = llama_rules();  // RMSNorm weights are no Linear: AutoTP never splits them
  norms.push_back({{"patterns", {".*layernorm.*"}}, {"partition_type", "skip"}});
  EXPECT_TRUE(contains(error_of(with_rules(llama(), norms)), "layer_specs[4]`: patterns [\".*layernorm.*\"] match no parameter"));
  json no_down = llama_rules();
  no_down.erase(2);
  EXPECT_TRUE(contains(error_of(with_rules(llama(), no_down)),
                       "`tensor_parallel.partition_config`: 2 weights have no rule (model.layers.0.mlp.down_proj.weight, "
                       "model.layers.1.mlp.down_proj.weight)"));
  json strict = with_rules(llama(), llama_rules());  // strict_mode: the head needs a rule too
  strict["tensor_parallel"]["partition_config"]["strict_mode"] = true;
  EXPECT_TRUE(contains(error_of(strict), "lm_head.weight matches no layer spec and strict_mode is true"));
}

TEST(AutoTp, ModelTypesRestrictASpecToItsFamilies) {
  json specs = llama_rules();
  for (json& s : specs) s["model_types"] = {"QWEN2"};  // lower-cased as DeepSpeed compares them
  EXPECT_EQ(error_of(with_rules(llama("qwen2"), specs)), "");
  specs.push_back({{"patterns", {".*"}}, {"partition_type", "skip"}, {"model_types", {"mixtral"}}});
  const Config c = read_config(with_rules(llama("qwen2"), specs), "cfg.json", 2);
  EXPECT_TRUE(has_note(c, "applies to model_types [\"mixtral\"], not qwen2: not used"));
  // on a llama none of the qwen2 rules applies
  EXPECT_TRUE(contains(error_of(with_rules(llama("llama"), specs)), "14 weights have no rule"));
}

TEST(AutoTp, MalformedSpecsExitNamingTheKey) {
  auto spec_error = [](const json& spec) { return error_of(with_rules(llama(), json::array({spec}))); };
  EXPECT_TRUE(contains(spec_error({{"patterns", {"(unclosed"}}}),
                       "`tensor_parallel.partition_config.layer_specs[0].patterns`: \"(unclosed\" is not a regular expression"));
  EXPECT_TRUE(contains(spec_error({{"patterns", json::array()}}), "layer_specs[0].patterns`: expected a non-empty list"));
  EXPECT_TRUE(contains(spec_error({{"patterns", {".*"}}, {"partition_type", "diagonal"}}),
                       "layer_specs[0].partition_type`: value \"diagonal\": expected \"column\", \"row\" or \"skip\""));
  EXPECT_TRUE(contains(spec_error({{"patterns", {".*"}}, {"shape", {-1, json::array({2, 2})}}}),
                       "layer_specs[0].shape`: value [-1,[2,2]]"));
  EXPECT_TRUE(contains(spec_error({{"patterns", {".*"}}, {"partition_type", "row"}, {"partition_dim", 0}}),
                       "layer_specs[0].partition_dim`: value 0 without a shape"));
  EXPECT_TRUE(contains(spec_error({{"patterns", {".*norm.*"}}, {"grad_allreduce", true}}), "layer_specs[0].grad_allreduce`"));
  EXPECT_TRUE(contains(spec_error({{"patterns", {".*"}}, {"bias_split", true}}), "layer_specs[0].bias_split`: unknown key"));
  json tp_size = with_rules(llama(), llama_rules());
  tp_size["tensor_parallel"]["partition_config"]["tp_size"] = 4;
  EXPECT_TRUE(contains(error_of(tp_size), "`tensor_parallel.partition_config.tp_size`: value 4 differs from "
                                          "tensor_parallel.autotp_size (2)"));
  json dim = with_rules(llama(), llama_rules());
  dim["tensor_parallel"]["partition_config"]["embedding_partition_dim"] = 0;
  EXPECT_TRUE(contains(error_of(dim), "tensor_parallel.partition_config.embedding_partition_dim"));
}

}  // namespace
