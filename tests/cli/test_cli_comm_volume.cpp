// test_cli_comm_volume.cpp — `zero3d estimate --config` predicts the bytes a step moves over the
// data-parallel groups (issue 34: bytes per step by link class), and a run measures exactly them.
// Each layout trains on 4 ranks in 2 emulated nodes (ranks 0-1 and 2-3 share one), so the data
// group crosses nodes, MiCS's and hpZ's inner groups do not, and every group's link is tested.
#include <gtest/gtest.h>

#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

// The tiny model, micro-batches of 2: one per rank and step at 4 ranks, two with train_batch_size 16.
json base_config() {
  json c = tiny_config();
  c["train_micro_batch_size_per_gpu"] = 2;
  c["training"]["steps"] = 3;
  return c;
}

json zero(int stage, const json& keys = json::object()) {
  json z = keys;
  z["stage"] = stage;
  return json{{"zero_optimization", z}};
}

struct Case {
  std::string name;
  json patch;
};

// The estimate's communication entry for the config's own stage, and the run's last step.
void expect_estimate_equals_run(const Case& k, const std::string& env = "ZERO3D_RANKS_PER_NODE=2") {
  SCOPED_TRACE(k.name);
  json c = base_config();
  c.merge_patch(k.patch);
  const std::string config = write_config("cv_" + k.name + ".json", c), dir = temp_path("cv_" + k.name);
  const Result est = run("estimate --config " + config + " --world-size 4 --ranks-per-node 2 --json");
  ASSERT_EQ(est.code, 0) << est.out << est.err;
  const int stage = c.contains("zero_optimization") ? c["zero_optimization"].value("stage", 0) : 0;
  const json predicted = json::parse(est.out).at("communication").at(stage);
  const Result r = run("train " + config + " --output " + dir, 4, env);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const json measured = read_metrics(dir).back();
  // Rank 0's groups: the data axis and the ZeRO shard groups (the tensor and pipe axes carry
  // activations, which this estimate does not count; these layouts have none or say so).
  for (const auto& [axis, bytes] : predicted.at("comm_bytes_by_axis").items())
    EXPECT_EQ(measured.at("comm_bytes_by_axis").at(axis).get<int64_t>(), bytes.get<int64_t>()) << axis;
  const json& axes = measured.at("comm_bytes_by_axis");
  if (axes.at("tensor").get<int64_t>() == 0 && axes.at("pipe").get<int64_t>() == 0) {
    EXPECT_EQ(measured.at("comm_bytes_by_link"), predicted.at("comm_bytes_by_link"));
  }
}

TEST(CommVolume, EveryZeroStageMovesThePredictedBytes) {
  const std::vector<Case> cases = {
      {"stage0", zero(0)},
      {"stage1_bf16", [] {
         json p = zero(1);
         p["bf16"] = {{"enabled", true}};
         return p;
       }()},
      // Small buckets: every bucket is a call of its own, rounded on its own.
      {"stage2_buckets_accumulated", [] {
         json p = zero(2, {{"reduce_bucket_size", 3001}, {"allgather_bucket_size", 5002}});
         p["train_batch_size"] = 16;
         return p;
       }()},
      {"stage3_persistent", zero(3)},
      {"stage3_regathered", [] {
         json p = zero(3, {{"param_persistence_threshold", 0}, {"max_reuse_distance", 0}, {"prefetch_bucket_size", 0}});
         p["train_batch_size"] = 16;
         return p;
       }()},
      {"stage3_fp16_live_limit", [] {
         json p = zero(3, {{"param_persistence_threshold", 100}, {"max_live_parameters", 9000}});
         p["fp16"] = {{"enabled", true}};
         return p;
       }()},
  };
  for (const Case& k : cases) expect_estimate_equals_run(k);
}

TEST(CommVolume, ZeroPlusPlusAndMicsGroupsMoveThePredictedBytesOnTheirLinks) {
  const json s3 = {{"stage", 3}, {"param_persistence_threshold", 0}, {"max_reuse_distance", 0}};
  const auto with = [&](const json& keys) {
    json z = s3;
    z.merge_patch(keys);
    return json{{"zero_optimization", z}};
  };
  for (const Case& k : std::vector<Case>{{"mics2", with({{"mics_shard_size", 2}})},
                                         {"mics4_hierarchical",
                                          with({{"mics_shard_size", 4}, {"mics_hierarchical_params_gather", true}})},
                                         {"hpz2", with({{"zero_hpz_partition_size", 2}})},
                                         // ZeRO++'s qwZ: int8 groups and their scales, in the data group and hpZ's
                                         {"qwz", with({{"zero_quantized_weights", true}})},
                                         {"qwz_hpz2", with({{"zero_quantized_weights", true}, {"zero_hpz_partition_size", 2}})},
                                         // qgZ: int4 groups and scales in two all-to-alls inside the node
                                         // (qgz_intra), two across (qgz_inter), the vectors reduce-scattered
                                         {"qgz", with({{"zero_quantized_gradients", true}})},
                                         {"zeropp", with({{"zero_quantized_weights", true},
                                                          {"zero_hpz_partition_size", 2},
                                                          {"zero_quantized_gradients", true}})}})
    expect_estimate_equals_run(k);
}

TEST(CommVolume, PipelineTiedEmbeddingAndOneBitPhasesArePredicted) {
  json pipe = zero(1);
  pipe["pipeline"] = {{"stages", 2}};
  expect_estimate_equals_run({"pipe2", pipe});
  // A 1-bit optimizer all-reduces the gradients until its freeze, then only the compressed
  // momentum (sign bits and scales) and the overflow flag: over 16x fewer bytes (issue 34).
  for (const char* optimizer : {"OneBitAdam", "OneBitLamb"}) {
    SCOPED_TRACE(optimizer);
    json c = base_config();
    c["optimizer"] = {{"type", optimizer}, {"params", {{"lr", 1e-3}, {"freeze_step", 2}}}};
    c["training"]["steps"] = 4;
    const std::string config = write_config(std::string("cv_") + optimizer + ".json", c);
    const Result est = run("estimate --config " + config + " --world-size 4 --ranks-per-node 2 --json");
    ASSERT_EQ(est.code, 0) << est.out << est.err;
    const json doc = json::parse(est.out);
    const std::string dir = temp_path(std::string("cv_") + optimizer);
    const Result r = run("train " + config + " --output " + dir, 4, "ZERO3D_RANKS_PER_NODE=2");
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    const std::vector<json> rows = read_metrics(dir);
    EXPECT_EQ(rows.front().at("comm_bytes_by_link"), doc.at("communication").at(0).at("comm_bytes_by_link"));
    EXPECT_EQ(rows.back().at("comm_bytes_by_link"), doc.at("communication_compressed").at("comm_bytes_by_link"));
    EXPECT_LT(16 * rows.back().at("comm_bytes").get<int64_t>(), rows.front().at("comm_bytes").get<int64_t>());
  }
}

}  // namespace
