// test_cli_zeropp.cpp — MiCS and ZeRO++'s hpZ through `zero3d train` (issue 34; FACTS-2 §3.6),
// on 4 ranks in 2 emulated nodes (ZERO3D_RANKS_PER_NODE=2: ranks 0-1 and 2-3 share a node).
// Each layout trains the losses of the single-rank run; each group's bytes are intra-node or
// inter-node by where its ranks lie, and the bytes show where the collectives went.
#include <gtest/gtest.h>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

const std::string kTwoNodes = "ZERO3D_RANKS_PER_NODE=2";

// The tiny model at ZeRO-3 with every unit released after use (no persistence, no reuse), so
// that the backward gathers each unit again, and micro-batches of 2 (8 samples: 1 x 4 ranks, or
// 4 accumulated on one).
json zero3_config() {
  json c = tiny_config();
  c["train_micro_batch_size_per_gpu"] = 2;
  c["zero_optimization"] = {{"stage", 3}, {"param_persistence_threshold", 0}, {"max_reuse_distance", 0}};
  c["training"]["steps"] = 4;
  return c;
}

std::vector<json> train(const json& c, const std::string& name, int np, const std::string& env = kTwoNodes) {
  const std::string dir = temp_path(name);
  const Result r = run("train " + write_config(name + ".json", c) + " --output " + dir, np, env);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  return read_metrics(dir);
}

int64_t axis_bytes(const json& row, const char* axis) { return row.at("comm_bytes_by_axis").at(axis).get<int64_t>(); }
int64_t link_bytes(const json& row, const char* link) { return row.at("comm_bytes_by_link").at(link).get<int64_t>(); }

const std::vector<double>& single_rank_losses() {
  static const std::vector<double> losses = losses_of(train(zero3_config(), "zpp_np1", 1, ""));
  return losses;
}

TEST(ZeroPlusPlus, MisplacedOrUnfinishedKeysAreRejectedWithTheReason) {
  const auto zero = [](const json& keys) { return json{{"zero_optimization", keys}}; };
  const std::vector<std::pair<json, std::string>> cases = {
      {zero({{"stage", 2}, {"mics_shard_size", 2}}), "DeepSpeed builds it at stage 3 only"},
      {zero({{"mics_shard_size", 3}}), "does not divide the data-parallel size (4 ranks)"},
      {zero({{"mics_hierarchical_params_gather", true}}), "needs mics_shard_size > 0"},
      {zero({{"stage", 1}, {"zero_hpz_partition_size", 2}}),
       "ZeRO++'s hpZ (a secondary partition of the parameters) is ZeRO-3's"},
      {zero({{"zero_hpz_partition_size", 2}, {"mics_shard_size", 2}}), "cannot be combined with mics_shard_size"},
      {zero({{"zero_quantized_weights", true}}), "qwZ (int8 block-quantised parameter all-gather) is not implemented"},
      {zero({{"zero_quantized_gradients", true}}), "qgZ"},
      {json{{"zero_optimization", {{"mics_shard_size", 2}}}, {"pipeline", {{"stages", 2}}}},
       "is not run with pipeline.stages 2"}};
  for (const auto& [patch, message] : cases) {
    json c = zero3_config();
    c.merge_patch(patch);
    expect_one_line_rejection(run("validate " + write_config("zpp_bad.json", c), 4), message);
  }
  // A shard group inside one node has no hierarchy to use (DeepSpeed asserts), found at start-up
  json c = zero3_config();
  c["zero_optimization"]["mics_shard_size"] = 2;
  c["zero_optimization"]["mics_hierarchical_params_gather"] = true;
  expect_one_line_rejection(
      run("train " + write_config("zpp_hier1.json", c) + " --output " + temp_path("zpp_hier1"), 4, kTwoNodes),
      "must span more than one node");
}

// MiCS, 2 shard groups of 2 ranks, one per node: gathers and reduce-scatters stay in the node;
// the only gradient traffic between nodes is the replicas' all-reduce of the shard's gradient
// partition at the step's end, 2(R−1)/R of 4·part bytes at R = 2 replicas.
TEST(ZeroPlusPlus, MicsShardsInsideNodesAndAllReducesAcrossReplicas) {
  json c = zero3_config();
  c["zero_optimization"]["mics_shard_size"] = 2;
  const std::vector<json> rows = train(c, "zpp_mics", 4);
  ASSERT_EQ(rows.size(), 4u);
  expect_losses_close(losses_of(rows), single_rank_losses(), 1e-5, "MiCS shard 2 vs 1 rank");
  for (const json& row : rows) {
    const int64_t part = row.at("memory").at("params").get<int64_t>() / 4;  // fp32 partition over the shard group
    EXPECT_EQ(axis_bytes(row, "mics_replicate"), 4 * part);
    EXPECT_GT(axis_bytes(row, "mics_shard"), 0);
    EXPECT_EQ(link_bytes(row, "intra_node"), axis_bytes(row, "mics_shard"));
    EXPECT_EQ(link_bytes(row, "inter_node"), axis_bytes(row, "mics_replicate") + axis_bytes(row, "data"));
    EXPECT_EQ(row.at("comm_bytes").get<int64_t>(), link_bytes(row, "intra_node") + link_bytes(row, "inter_node"));
  }
}

// One shard group of 4 ranks over both nodes: the flat gather crosses nodes with (s−1)/s of each
// unit per rank; the hierarchical one exchanges one slice across nodes, then the rest inside.
TEST(ZeroPlusPlus, MicsHierarchicalGatherCrossesNodesWithFewerBytes) {
  json c = zero3_config();
  c["zero_optimization"]["mics_shard_size"] = 4;
  const std::vector<json> flat = train(c, "zpp_flat", 4);
  c["zero_optimization"]["mics_hierarchical_params_gather"] = true;
  const std::vector<json> hier = train(c, "zpp_hier", 4);
  ASSERT_EQ(hier.size(), 4u);
  ASSERT_EQ(flat.size(), 4u);
  expect_losses_close(losses_of(flat), single_rank_losses(), 1e-5, "MiCS shard 4 vs 1 rank");
  expect_losses_close(losses_of(hier), single_rank_losses(), 1e-5, "MiCS hierarchical vs 1 rank");
  for (size_t s = 0; s < hier.size(); ++s) {
    EXPECT_GT(axis_bytes(hier[s], "mics_intra"), 0);
    EXPECT_EQ(link_bytes(hier[s], "intra_node"), axis_bytes(hier[s], "mics_intra"));
    // the gathers' inter-node part: (n−1)/n of n slices = one slice of each unit, a third of (s−1)/s
    const int64_t flat_gathers = axis_bytes(flat[s], "mics_shard") - (axis_bytes(hier[s], "mics_shard"));
    EXPECT_GT(flat_gathers, 0);
    EXPECT_NEAR(static_cast<double>(axis_bytes(hier[s], "mics_inter")), flat_gathers / 3.0, 0.02 * flat_gathers);
    EXPECT_LT(link_bytes(hier[s], "inter_node"), link_bytes(flat[s], "inter_node"));
  }
}

TEST(ZeroPlusPlus, MicsCheckpointsResumeAndLoadAtAnotherWorldSize) {
  json c = zero3_config();
  c["zero_optimization"]["mics_shard_size"] = 2;
  const std::vector<json> whole = train(c, "zpp_ck_whole", 4);
  ASSERT_EQ(whole.size(), 4u);
  c["training"]["save_interval"] = 2;
  c["training"]["save_dir"] = temp_path("zpp_ckpt");
  c["training"]["steps"] = 2;
  train(c, "zpp_ck_first", 4);
  c["training"]["steps"] = 4;
  c["training"]["resume"] = "auto";
  // the checkpoint of step 2 on one rank (no MiCS, nothing saved): the flat buffers load into any layout
  json one = c;
  one["zero_optimization"].erase("mics_shard_size");
  one["training"]["save_interval"] = 0;
  const std::vector<json> single = train(one, "zpp_ck_single", 1, "");
  ASSERT_EQ(single.size(), 2u);
  for (size_t s = 0; s < single.size(); ++s)
    EXPECT_NEAR(single[s].at("loss").get<double>(), whole[s + 2].at("loss").get<double>(),
                1e-5 * whole[s + 2].at("loss").get<double>());
  // and at np 4 with MiCS it continues bit for bit
  const std::vector<json> resumed = train(c, "zpp_ck_resumed", 4);
  ASSERT_EQ(resumed.size(), 2u);
  for (size_t s = 0; s < resumed.size(); ++s)
    EXPECT_EQ(resumed[s].at("loss").get<double>(), whole[s + 2].at("loss").get<double>()) << "step " << s + 3;
}

// hpZ over 2-rank node groups: the forward gathers cross the data group, and each backward
// gather, (W−1)/W = 3/4 of its unit per rank there, becomes 1/2 of it in the node group.
TEST(ZeroPlusPlus, HpzKeepsTheBackwardGathersInsideTheNode) {
  const std::vector<json> zero3 = train(zero3_config(), "zpp_z3", 4);
  json c = zero3_config();
  c["zero_optimization"]["zero_hpz_partition_size"] = 2;
  const std::vector<json> hpz = train(c, "zpp_hpz", 4);
  ASSERT_EQ(hpz.size(), 4u);
  ASSERT_EQ(zero3.size(), 4u);
  expect_losses_close(losses_of(hpz), single_rank_losses(), 1e-5, "hpZ vs 1 rank");
  expect_losses_close(losses_of(zero3), single_rank_losses(), 1e-5, "ZeRO-3 vs 1 rank");
  for (size_t s = 0; s < hpz.size(); ++s) {
    const int64_t moved = axis_bytes(zero3[s], "data") - axis_bytes(hpz[s], "data");
    EXPECT_GT(moved, 0);
    EXPECT_EQ(2 * moved, 3 * axis_bytes(hpz[s], "hpz")) << "step " << s + 1;
    EXPECT_EQ(link_bytes(hpz[s], "intra_node"), axis_bytes(hpz[s], "hpz"));
    EXPECT_EQ(link_bytes(hpz[s], "inter_node"), axis_bytes(hpz[s], "data"));
    EXPECT_EQ(link_bytes(zero3[s], "intra_node"), 0);
    EXPECT_GT(hpz[s].at("memory").at("hpz_secondary").get<int64_t>(), 0);
  }
}

}  // namespace
