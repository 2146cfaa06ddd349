// test_cli_comm_volume.cpp — `zero3d estimate --config` predicts the bytes a step moves over
// rank 0's groups (issue 34: bytes per step by link class), and a run measures exactly them.
// Each layout trains on 4 ranks in 2 emulated nodes (ranks 0-1 and 2-3 share one), so the data
// and pipeline groups cross nodes, the tensor group and MiCS's and hpZ's inner groups do not,
// and every group's link is tested.
#include <gtest/gtest.h>

#include <map>

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

// The estimate's communication entry for the config's own stage, and the run's last step (np
// ranks, 2 a node).
struct Measured {
  json predicted, measured;
};
Measured estimate_and_run(const Case& k, int np = 4) {
  json c = base_config();
  c.merge_patch(k.patch);
  const std::string config = write_config("cv_" + k.name + ".json", c), dir = temp_path("cv_" + k.name);
  const Result est =
      run("estimate --config " + config + " --world-size " + std::to_string(np) + " --ranks-per-node 2 --json");
  EXPECT_EQ(est.code, 0) << est.out << est.err;
  if (est.code != 0) return {};
  const int stage = c.contains("zero_optimization") ? c["zero_optimization"].value("stage", 0) : 0;
  const Result r = run("train " + config + " --output " + dir, np, "ZERO3D_RANKS_PER_NODE=2");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  if (r.code != 0) return {};
  return {json::parse(est.out).at("communication").at(stage), read_metrics(dir).back()};
}

void expect_estimate_equals_run(const Case& k, int np = 4) {
  SCOPED_TRACE(k.name);
  const auto [predicted, measured] = estimate_and_run(k, np);
  ASSERT_FALSE(measured.is_null());
  // Rank 0's groups: the data axis, the ZeRO shard groups, the tensor and pipe axes'
  // activations and MoE's expert and expert-data axes; every axis that moves bytes is predicted,
  // none of them only bounded.
  EXPECT_FALSE(predicted.contains("activations_not_predicted")) << predicted.dump();
  EXPECT_FALSE(predicted.contains("expert_not_predicted")) << predicted.dump();
  for (const auto& [axis, bytes] : measured.at("comm_bytes_by_axis").items())
    EXPECT_EQ(predicted.at("comm_bytes_by_axis").value(axis, int64_t(0)), bytes.get<int64_t>()) << axis;
  EXPECT_EQ(measured.at("comm_bytes_by_link"), predicted.at("comm_bytes_by_link"));
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

// The activations: Megatron's all-reduces of the tensor axis (inside a node here), its
// all-gathers and reduce-scatters with sequence parallelism, the recomputed forward of full
// checkpointing with partitioned activations, and the residual stream sent between pipeline
// stages (across the nodes), alone and with a tensor axis.
TEST(CommVolume, TensorAndPipelineActivationsArePredictedOnTheirLinks) {
  const auto layout = [](int stages, int tensor, const json& extra = json::object()) {
    json p = extra;
    p["pipeline"]["stages"] = stages;
    p["tensor_parallel"]["autotp_size"] = tensor;
    return p;
  };
  const json sp = {{"tensor_parallel", {{"sequence_parallel", true}}}};
  json sp_z1 = sp;
  sp_z1["zero_optimization"] = {{"stage", 1}};
  const json checkpointed = {
      {"activation_checkpointing", {{"partition_activations", true}}},
      {"pipeline", {{"activation_checkpoint_interval", 1}}}};
  for (const Case& k : std::vector<Case>{{"t2", layout(1, 2)},
                                         {"t2_sp", layout(1, 2, sp)},
                                         {"t2_sp_z1", layout(1, 2, sp_z1)},
                                         {"t2_full_checkpoints", layout(1, 2, checkpointed)},
                                         {"p2", layout(2, 1)},
                                         {"p2_t2_sp", layout(2, 2, sp)}})
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

// MoE (the tiny model's two blocks both MoE): the experts' ZeRO traffic over the expert-data
// group (every ep-th data rank: across the nodes here) and each block's token all-to-alls over the
// expert group (ep consecutive ranks: inside a node), forward and backward. Top-2 of 2 experts
// routes every token to both, so each expert keeps min(S, capacity) rows of a rank's S = 32
// tokens whatever the gate decides: capacity factor 0.75 keeps 24 and drops 8, without
// drop_tokens all 32 (after the capacity's MAX over the group).
json moe(const json& routing, const json& rest = json::object()) {
  json p = rest;
  p["model"]["moe"] = {{"num_experts", 2}, {"k", 2}, {"ep_size", 2}, {"capacity_factor", 0.75}, {"min_capacity", 2}};
  p["model"]["moe"].merge_patch(routing);
  return p;
}

TEST(CommVolume, ExpertAllToAllsAndExpertDataZeroArePredictedExactlyWhereRoutingCannotMoveThem) {
  const json z3 = {{"zero_optimization", {{"stage", 3}, {"param_persistence_threshold", 0}, {"max_reuse_distance", 0}}}};
  expect_estimate_equals_run({"moe_ep2", moe(json::object())}, 2);
  expect_estimate_equals_run({"moe_edp2_ep2_z3", moe(json::object(), z3)}, 4);
  expect_estimate_equals_run({"moe_edp2_ep2_z2_nodrop", moe({{"drop_tokens", false}}, zero(2))}, 4);
}

// MoE with tensor parallelism: an MoE block exchanges its attention half's activations (and
// PR-MoE's dense branch's); split experts (expert tensor parallelism) also sum the rows they
// receive, forward and backward: every choice on one expert rank without drop_tokens (32 tokens
// x top-2), or 2 experts x 24 kept rows with top-2 of 2 on two expert ranks.
TEST(CommVolume, MoeWithTensorParallelismIsPredictedExactly) {
  const json t2 = {{"tensor_parallel", {{"autotp_size", 2}}}};
  expect_estimate_equals_run(
      {"moe_t2_split_nodrop",
       moe({{"num_experts", 4}, {"ep_size", 1}, {"drop_tokens", false}, {"enable_expert_tensor_parallelism", true}},
           t2)},
      2);
  expect_estimate_equals_run(
      {"moe_t2_ep2_split_residual", moe({{"enable_expert_tensor_parallelism", true}, {"use_residual", true}}, t2)}, 4);
  expect_estimate_equals_run({"moe_t2_ep2", moe(json::object(), t2)}, 4);
}

// Top-2 of 4 experts: how many rows go to the other expert rank is the gate's choice. The
// estimate says so, counts what is fixed (the kept-row counts, and without drop_tokens the
// capacity's MAX) and bounds the rest by every expert receiving all it may keep; the run lands
// between the two.
TEST(CommVolume, RoutedExpertRowsAreBoundedAndSaySo) {
  for (const bool drop : {true, false}) {
    SCOPED_TRACE(drop ? "drop_tokens" : "no drop_tokens");
    const auto [predicted, measured] =
        estimate_and_run({drop ? "moe_top2_of_4" : "moe_top2_of_4_nodrop",
                          moe({{"num_experts", 4}, {"drop_tokens", drop}})},
                         4);
    ASSERT_FALSE(measured.is_null());
    EXPECT_NE(predicted.value("expert_not_predicted", "").find("depend on the gate's choices (k 2 of 4 experts)"),
              std::string::npos)
        << predicted.dump();
    const int64_t fixed = predicted.at("comm_bytes_by_axis").at("expert").get<int64_t>(),
                  most = predicted.at("expert_bytes_at_most").get<int64_t>(),
                  got = measured.at("comm_bytes_by_axis").at("expert").get<int64_t>();
    EXPECT_GT(fixed, 0);
    EXPECT_LT(fixed, got);
    EXPECT_LE(got, most);
    for (const char* axis : {"data", "expert_data"})
      EXPECT_EQ(predicted.at("comm_bytes_by_axis").at(axis), measured.at("comm_bytes_by_axis").at(axis)) << axis;
  }
}

// 0/1 Adam's bytes change with its phase (§5.4): variance updates (the gradients all-reduced) at
// steps 2 and 3, then every 2nd step (var_update_scaler 2 doubles the interval after two of
// them), the steps between them 1-bit all-reduce the gradient; past var_freeze_step 6 (from step
// 8) the ranks take local steps and 1-bit all-reduce their accumulated update every step, then
// every 2nd (local_step_scaler 2), then every 4th (local_step_clipper 4): step 11 is local, 12
// synchronises.
TEST(CommVolume, ZeroOneAdamsPhasesArePredictedStepByStep) {
  json c = base_config();
  c["optimizer"] = {{"type", "ZeroOneAdam"},
                    {"params",
                     {{"lr", 1e-3}, {"var_freeze_step", 6}, {"var_update_scaler", 2}, {"local_step_scaler", 2},
                      {"local_step_clipper", 4}}}};
  c["training"]["steps"] = 12;
  const std::string var = "variance update", onebit = "compressed gradient", local = "local step",
                    sync = "local step, synchronised";
  const std::vector<std::string> phases = {"initialisation", var, var, var, onebit, var, onebit, sync,
                                           sync, sync, local, sync};
  const std::string config = write_config("cv_zero_one_adam.json", c), dir = temp_path("cv_zero_one_adam");
  const Result est = run("estimate --config " + config + " --world-size 4 --ranks-per-node 2 --json --step 12");
  ASSERT_EQ(est.code, 0) << est.out << est.err;
  const json doc = json::parse(est.out).at("optimizer_communication");
  EXPECT_EQ(doc.at("phase"), sync);
  const json& range = doc.at("range");
  EXPECT_EQ(range.at("first"), 1);
  EXPECT_EQ(range.at("last"), 12);  // training.steps
  std::map<std::string, json> by_phase;
  for (const json& p : range.at("phases")) by_phase[p.at("phase").get<std::string>()] = p;
  ASSERT_EQ(by_phase.size(), 5u) << range.dump(1);
  const Result r = run("train " + config + " --output " + dir, 4, "ZERO3D_RANKS_PER_NODE=2");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const std::vector<json> rows = read_metrics(dir);
  ASSERT_EQ(rows.size(), phases.size());
  int64_t intra = 0, inter = 0;
  std::map<std::string, int64_t> steps;
  for (size_t s = 0; s < rows.size(); ++s) {
    SCOPED_TRACE("step " + std::to_string(s + 1) + ", " + phases[s]);
    const json& predicted = by_phase.at(phases[s]);
    EXPECT_EQ(rows[s].at("comm_bytes_by_link"), predicted.at("comm_bytes_by_link"));
    EXPECT_EQ(rows[s].at("comm_bytes_by_axis").at("data"), predicted.at("comm_bytes_by_axis").at("data"));
    intra += rows[s].at("comm_bytes_by_link").at("intra_node").get<int64_t>();
    inter += rows[s].at("comm_bytes_by_link").at("inter_node").get<int64_t>();
    ++steps[phases[s]];
  }
  for (const auto& [phase, n] : steps) EXPECT_EQ(by_phase.at(phase).at("steps"), n) << phase;
  EXPECT_EQ(range.at("total_bytes_by_link").at("intra_node"), intra);
  EXPECT_EQ(range.at("total_bytes_by_link").at("inter_node"), inter);
  EXPECT_EQ(doc.at("communication").at("comm_bytes_by_link"), rows[11].at("comm_bytes_by_link"));
  // A local step moves only the agreed overflow flag; a compressed step over 16x less than an
  // all-reducing one (the tiny model's tensors are small, so the fp32 scales weigh in).
  const auto inter_of = [&](const std::string& p) {
    return by_phase.at(p).at("comm_bytes_by_link").at("inter_node").get<int64_t>();
  };
  EXPECT_LT(inter_of(local), 100);
  EXPECT_LT(16 * inter_of(onebit), inter_of(var));
  EXPECT_EQ(inter_of(onebit), inter_of(sync));
  // An explicit range: steps 5-8 are one compressed gradient, one variance update, another
  // compressed gradient and the first synchronised local step.
  const Result part = run("estimate --config " + config + " --world-size 4 --ranks-per-node 2 --json --step-range 5-8");
  ASSERT_EQ(part.code, 0) << part.out << part.err;
  const json part_range = json::parse(part.out).at("optimizer_communication").at("range");
  int64_t expected = 0;
  for (size_t s = 4; s < 8; ++s) expected += rows[s].at("comm_bytes_by_link").at("inter_node").get<int64_t>();
  EXPECT_EQ(part_range.at("total_bytes_by_link").at("inter_node"), expected);
  EXPECT_DOUBLE_EQ(part_range.at("average_bytes_by_link").at("inter_node").get<double>(), expected / 4.0);
  const Result backwards = run("estimate --config " + config + " --step-range 8-5");
  EXPECT_EQ(backwards.code, 2);
  EXPECT_NE(backwards.err.find("--step-range 8-5: expected FIRST-LAST"), std::string::npos) << backwards.err;
}

}  // namespace
