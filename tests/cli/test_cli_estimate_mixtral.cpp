// test_cli_estimate_mixtral.cpp — `zero3d estimate` at Mixtral-8x7B's Hugging Face sizes: the
// parameters are Hugging Face's count (46.7B, of which 12.9B active), DeepSpeed's table counts
// them, expert parallelism shards the experts' states, and a token's experts receive k rows.
// (test_cli_llama.cpp holds the plan against a real run of a small Mixtral.)
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "config/config.hpp"
#include "parallel/partition.hpp"
#include "support/cli_helpers.hpp"
#include "train/estimator.hpp"

namespace {

using namespace cli;
using namespace zero3d;

// Mixtral-8x7B's config.json sizes (V 32000, C 4096, I 14336, L 32, 32 heads over 8 K/V heads,
// 8 experts, top-2), T 4096, on 8 ranks.
json mixtral_8x7b(int64_t ep, int stage) {
  return {{"train_batch_size", 8},
          {"zero_optimization", {{"stage", stage}}},
          {"model",
           {{"architecture", "mixtral"}, {"vocab_size", 32000}, {"hidden_size", 4096}, {"intermediate_size", 14336},
            {"num_hidden_layers", 32}, {"num_attention_heads", 32}, {"num_key_value_heads", 8},
            {"num_local_experts", 8}, {"num_experts_per_tok", 2}, {"max_position_embeddings", 32768},
            {"rope_theta", 1e6}, {"seq_length", 4096}, {"moe", {{"ep_size", ep}}}}}};
}

constexpr int64_t V = 32000, C = 4096, I = 14336, L = 32, H = 32, KV = 8, d = 128, E = 8, k = 2;
constexpr int64_t kExpert = 3 * I * C;  // w1, w3, w2

// Hugging Face's count: embed_tokens and lm_head V·C, per layer two norms, q and o (H·d)·C, k and
// v (KV·d)·C, the router E·C and E experts, then the final norm; a token meets k of each layer's E.
TEST(EstimateMixtral, EightBySevenBCountsHuggingFacesParameters) {
  const int64_t hf = 2 * V * C + L * (2 * C + 2 * H * d * C + 2 * KV * d * C + E * C + E * kExpert) + C;
  ASSERT_EQ(hf, 46702792704);  // the model card's 46.7B
  const Result r = run("estimate --config " + write_config("mixtral_8x7b.json", mixtral_8x7b(8, 3)) +
                       " --world-size 8 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json est = json::parse(r.out);
  EXPECT_EQ(est["parameters"].get<int64_t>(), hf);
  EXPECT_EQ(est["active_parameters"].get<int64_t>(), hf - L * (E - k) * kExpert);
  EXPECT_EQ(est["active_parameters"].get<int64_t>(), 12879925248);  // "12.9B active"
  const Result text = run("estimate --config " + write_config("mixtral_8x7b.json", mixtral_8x7b(8, 3)) +
                          " --world-size 8");
  EXPECT_NE(text.out.find("46702792704 parameters (12879925248 active: 2 of 8 experts per token)"), std::string::npos)
      << text.out;
  // DeepSpeed's table counts every expert, and the largest module is embed_tokens (lm_head's equal)
  const Result table = run("estimate zero3 --model " + write_config("mixtral_8x7b_ep1.json", mixtral_8x7b(1, 3)) +
                           " --gpus-per-node 8 --nodes 1");
  ASSERT_EQ(table.code, 0) << table.err;
  EXPECT_NE(table.out.find("SW: Model with 46702M total params, 131M largest layer params."), std::string::npos)
      << table.out;
}

// Expert parallelism shards the experts' states: at ZeRO 0 (fp32 Adam: 16 bytes an element) a rank
// holds every dense parameter and E/ep of each layer's experts; at ZeRO 3 the dense ones over the 8
// data ranks and its experts over the dp/ep ranks of its expert-data group (itself alone at ep 8).
TEST(EstimateMixtral, ExpertStatesAreShardedByEpAndTheExpertDataGroup) {
  const int64_t experts = L * E * kExpert, dense = 46702792704 - experts;
  const auto states = [](int64_t ep, int stage) {
    return estimate_budget(read_config(mixtral_8x7b(ep, stage), "mixtral-8x7b", 8), 8).model_states();
  };
  EXPECT_EQ(states(1, 0), 16 * (dense + experts));
  EXPECT_EQ(states(8, 0), 16 * (dense + experts / 8));
  EXPECT_EQ(states(1, 3), 16 * (Partition(dense, 8).part + Partition(experts, 8).part));
  EXPECT_EQ(states(8, 3), 16 * (Partition(dense, 8).part + Partition(experts / 8, 1).part));
}

// A Mixtral token sends one row to each of its k distinct experts (no capacity tensor): a rank's
// experts receive at most min(k, E/ep) rows per token from each of the ep ranks routing to them,
// where DeepSpeed's dispatch tensor would be E·S rows at any ep.
TEST(EstimateMixtral, ExpertRowsAreTheTopKChoicesOfEachSourcesTokens) {
  const int64_t S = 4096;
  for (const auto& [ep, rows] : std::vector<std::pair<int, int64_t>>{{1, 2 * S}, {2, 4 * S}, {4, 8 * S}, {8, 8 * S}}) {
    const Config c = read_config(mixtral_8x7b(ep, 0), "mixtral-8x7b", 8);
    EXPECT_EQ(moe_rows_bound(gpt_shape_of(c.model).moe, moe_routing_of(c.model.moe, 0), S, ep), rows) << "ep " << ep;
  }
}

}  // namespace
