// Tensor parallelism (Megatron's GPT-2 split), black-box: every pipe × data × tensor layout of
// the same global batch gives one rank's losses, replicated parameters stay identical, the
// tensor axis moves exactly Megatron's all-reduce volume, checkpoints reshard across layouts.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "io/h5.hpp"
#include "support/cli_helpers.hpp"

using namespace cli;

namespace {

// V=61 (padded to 62 at t=2, 64 at t=4: the padding must change nothing), H=4 so t=4 holds
// one head per rank, L=6, clipping active, 16 samples in micro-batches of 8 per step (few
// micro-batches: every one costs tensor collectives, slow on oversubscribed ranks).
json tp_config() {
  return json{{"train_batch_size", 16},
              {"train_micro_batch_size_per_gpu", 8},
              {"gradient_clipping", 0.05},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
              {"model", {{"vocab_size", 61}, {"n_positions", 16}, {"n_layer", 6}, {"n_head", 4}, {"n_embd", 32}}},
              {"training", {{"steps", 10}, {"seed", 11}, {"peak_gflops", 50}}},
              {"steps_per_print", 100}};
}

struct TrainRun {
  int code;
  std::string err;
  std::vector<json> rows;
};

TrainRun train(int np, const std::string& name, const std::string& args, const std::string& prefix = "") {
  const std::string config = write_config("tp.json", tp_config());
  const std::string dir = temp_path("tp_" + name);
  std::system(("rm -rf " + dir).c_str());
  const Result r = run("train " + config + " --output " + dir + " " + args, np, prefix);
  return {r.code, r.out + r.err, read_metrics(dir)};
}

const std::vector<double>& reference(const std::string& args) {
  static std::map<std::string, std::vector<double>> cache;
  auto it = cache.find(args);
  if (it == cache.end()) {
    const TrainRun r = train(1, "ref", args);
    EXPECT_EQ(r.code, 0) << r.err;
    it = cache.emplace(args, losses_of(r.rows)).first;
  }
  return it->second;
}

struct Layout {
  int np, pipe, tensor, zero;
  std::string extra, name;
};
class TensorLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(TensorLayout, GivesTheLossesOfOneRankOverTenSteps) {
  const Layout& l = GetParam();
  const TrainRun r = train(l.np, l.name,
                      "--set tensor_parallel.autotp_size=" + std::to_string(l.tensor) + " --set pipeline.stages=" +
                          std::to_string(l.pipe) + " --set zero_optimization.stage=" + std::to_string(l.zero) + " " +
                          l.extra);
  ASSERT_EQ(r.code, 0) << r.err;
  expect_losses_close(losses_of(r.rows), reference(""), 1e-5, l.name);
}

INSTANTIATE_TEST_SUITE_P(
    PipeDataTensor, TensorLayout,
    ::testing::Values(Layout{2, 1, 2, 0, "", "t2_z0"}, Layout{2, 1, 2, 3, "", "t2_z3"},
                      Layout{2, 1, 2, 2, "--set tensor_parallel.tp_overlap_comm=true", "t2_z2_overlap"},
                      Layout{4, 1, 4, 1, "", "t4_z1"},
                      Layout{4, 2, 2, 2, "", "p2_t2_z2"},                          // 2x1x2
                      Layout{4, 1, 2, 3, "", "d2_t2_z3"},                          // 1x2x2
                      Layout{8, 2, 2, 1, "--set pipeline.schedule=zb-h1", "p2_d2_t2_zbh1_z1"},  // 2x2x2
                      Layout{4, 2, 2, 0, "--set pipeline.schedule=interleaved --set pipeline.virtual_stages=2",
                             "p2_t2_interleaved_z0"},
                      // Megatron sequence parallelism: LayerNorms and residuals on token shards
                      Layout{2, 1, 2, 0, "--set tensor_parallel.sequence_parallel=true", "t2_sp_z0"},
                      Layout{4, 1, 4, 3, "--set tensor_parallel.sequence_parallel=true", "t4_sp_z3"},
                      Layout{4, 2, 2, 2, "--set tensor_parallel.sequence_parallel=true --set pipeline.schedule=zb-h1",
                             "p2_t2_sp_zbh1_z2"},
                      Layout{8, 2, 2, 1, "--set tensor_parallel.sequence_parallel=true", "p2_d2_t2_sp_z1"}),
    [](const ::testing::TestParamInfo<Layout>& info) { return info.param.name; });

// bf16 matrix products round their operands to 8 bits; a row-parallel product summed from
// partial products rounds differently from the whole one, which moves the loss ~1e-4.
TEST(TensorParallelBf16, StaysWithinBf16RoundingOfOneRank) {
  const std::string bf16 = "--set bf16.enabled=true --set data_types.grad_accum_dtype=fp32";
  const TrainRun r = train(2, "bf16", bf16 + " --set tensor_parallel.autotp_size=2 --set zero_optimization.stage=1");
  ASSERT_EQ(r.code, 0) << r.err;
  expect_losses_close(losses_of(r.rows), reference(bf16 + " --set zero_optimization.stage=1"), 5e-4, "bf16 t2");
}

TEST(TensorParallel, ReplicatedParametersThatDivergeStopTheRunNamingTheStep) {
  // The per-step replica check passes on a healthy run (the equivalence tests) and catches a
  // copy nudged on one rank.
  const TrainRun r = train(2, "replica", "--set tensor_parallel.autotp_size=2", "ZERO3D_FAULT=replica:1:3");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("tensor-parallel replicas diverged at step 3"), std::string::npos) << r.err;
}

TEST(TensorParallel, TensorAxisMovesMegatronsAllReduceVolume) {
  const TrainRun r = train(2, "bytes", "--set tensor_parallel.autotp_size=2 --set training.steps=2");
  ASSERT_EQ(r.code, 0) << r.err;
  // Per micro-batch: 2 all-reduces of B·T·C per block forward and 2 backward (Megatron), the
  // vocab-parallel embedding's sum and the head's input gradient (B·T·C each), and the
  // cross-entropy's max, sum-exp and target logit (B·T each); bus bytes 2(t−1)/t · 4 per element.
  const int64_t BT = 8 * 16, C = 32, L = 6, micro = 2;
  const int64_t elements = micro * ((4 * L + 2) * BT * C + 3 * BT);
  const int64_t expected = elements * 4;  // 2(t-1)/t = 1 at t = 2
  EXPECT_EQ(r.rows.back().at("comm_bytes_by_axis").at("tensor").get<int64_t>(), expected);
  EXPECT_EQ(r.rows.back().at("comm_bytes_by_axis").at("pipe").get<int64_t>(), 0);
}

TEST(TensorParallel, SequenceParallelismMovesAllGathersAndReduceScattersAndHoldsFewerActivations) {
  const TrainRun plain = train(2, "plain", "--set tensor_parallel.autotp_size=2 --set training.steps=2");
  const TrainRun sp = train(2, "sp", "--set tensor_parallel.autotp_size=2 --set training.steps=2 "
                                     "--set tensor_parallel.sequence_parallel=true");
  ASSERT_EQ(plain.code, 0) << plain.err;
  ASSERT_EQ(sp.code, 0) << sp.err;
  // Each all-gather or reduce-scatter of B·T·C moves (t−1)/t of it: per block 2 in forward
  // (entering c_attn, c_fc) + 2 (leaving the c_projs), in backward the 2 mirrors of each plus
  // the 2 re-gathers of the LayerNorm outputs for the weight products; the embedding, the head
  // and ln_f one each way. The cross-entropy's all-reduces stay, and once per step the
  // LayerNorm gradients (each rank saw only its tokens) are summed over the group.
  const int64_t BT = 8 * 16, C = 32, L = 6, micro = 2;
  const int64_t half = BT * C * 4 / 2;  // (t−1)/t · B·T·C · 4 bytes at t = 2
  const int64_t expected = micro * ((10 * L + 4) * half + 3 * BT * 4) + (4 * L + 2) * C * 4;
  EXPECT_EQ(sp.rows.back().at("comm_bytes_by_axis").at("tensor").get<int64_t>(), expected);
  // ln_1, ln_2, res_2, res_3 per block, the stream and its gradient: B·T/t tokens instead of B·T
  const int64_t saved = 4 * (L * (4 * BT * C / 2 + 4 * BT / 2) + 2 * BT * C / 2 + 2 * BT / 2);
  const int64_t sp_scratch = 4 * (BT * C + BT * C / 2);  // the gathered tokens and one shard
  EXPECT_EQ(plain.rows.back().at("memory").at("activations").get<int64_t>() -
                sp.rows.back().at("memory").at("activations").get<int64_t>(),
            saved - sp_scratch);
}

TEST(TensorParallel, ResumesAcrossPipeDataTensorLayoutsWithinOneInAMillion) {
  const TrainRun saved = train(4, "saved", "--set pipeline.stages=2 --set tensor_parallel.autotp_size=2 "
                                      "--set zero_optimization.stage=1 --set training.save_interval=5");
  ASSERT_EQ(saved.code, 0) << saved.err;
  const std::vector<double> whole = losses_of(saved.rows);
  ASSERT_EQ(whole.size(), 10u);
  const std::vector<double> tail(whole.begin() + 5, whole.end());
  const std::string tag = temp_path("tp_saved") + "/checkpoints/global_step5";
  for (const auto& [np, args] : std::vector<std::pair<int, std::string>>{
           {4, "--set zero_optimization.stage=3 --set train_micro_batch_size_per_gpu=4"},  // 1x4x1
           {1, ""},                                                                         // 1x1x1
           {4, "--set tensor_parallel.autotp_size=4 --set zero_optimization.stage=2"}}) {  // 1x1x4
    const TrainRun r = train(np, "resumed", "--set training.resume=" + tag + " " + args);
    ASSERT_EQ(r.code, 0) << r.err;
    expect_losses_close(losses_of(r.rows), tail, 1e-6, "resumed at np " + std::to_string(np) + " " + args);
  }
  // The index shows whole Hugging Face tensors stitched from the slices.
  const Result inspect = run("inspect " + temp_path("tp_saved") + "/checkpoints --tag global_step10 --json");
  ASSERT_EQ(inspect.code, 0) << inspect.err;
  std::map<std::string, json> shapes;
  const json report = json::parse(inspect.out);  // held: a range-for over a temporary's member dangles
  for (const json& t : report.at("tensors")) shapes[t.at("name").get<std::string>()] = t.at("shape");
  ASSERT_EQ(shapes.size(), 76u) << inspect.out;
  EXPECT_EQ(shapes["wte.weight"], json::array({61, 32}));
  EXPECT_EQ(shapes["h.0.attn.c_attn.weight"], json::array({32, 96}));
  EXPECT_EQ(shapes["h.5.mlp.c_proj.weight"], json::array({128, 32}));
}

// A tensor-parallel shard holds each column-split matrix as one segment per row: at 12 layers
// of width 64 the metadata outgrows an HDF5 attribute (64 KiB), and index.h5 must still map each
// column block (c_attn's q, k and v of a shard) as one rectangle, not one piece per row.
TEST(TensorParallel, SavesShardsOfThousandsOfRowSegmentsMappingEachColumnBlockOnce) {
  json cfg = tp_config();
  cfg["model"]["n_layer"] = 12;
  cfg["model"]["n_embd"] = 64;
  cfg["training"]["steps"] = 3;
  cfg["training"]["save_interval"] = 2;
  const std::string config = write_config("tp_rows.json", cfg), dir = temp_path("tp_rows");
  const Result saved = run("train " + config + " --output " + dir + " --set tensor_parallel.autotp_size=2", 2);
  ASSERT_EQ(saved.code, 0) << saved.out << saved.err;
  const std::vector<double> losses = losses_of(read_metrics(dir));
  ASSERT_EQ(losses.size(), 3u);
  const std::string tag = dir + "/checkpoints/global_step2";
  {
    hid_t f = H5Fopen((tag + "/index.h5").c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    std::string meta;
    EXPECT_TRUE(zero3d::h5::read_text(f, "meta", meta));
    EXPECT_GT(meta.size(), 65536u) << "the case this test is for: metadata beyond an attribute's limit";
    hid_t ds = H5Dopen2(f, "/h.0.attn.c_attn.weight", H5P_DEFAULT), dcpl = H5Dget_create_plist(ds);
    size_t pieces = 0;
    ASSERT_GE(H5Pget_virtual_count(dcpl, &pieces), 0);
    EXPECT_EQ(pieces, 6u) << "2 shards x (q, k, v) column blocks of 64 rows each";
    H5Pclose(dcpl);
    H5Dclose(ds);
    H5Fclose(f);
  }
  const Result inspect = run("inspect " + dir + "/checkpoints --tag global_step2 --json");
  ASSERT_EQ(inspect.code, 0) << inspect.err;
  EXPECT_EQ(json::parse(inspect.out).at("topology"), (json{{"pipe", 1}, {"data", 1}, {"model", 2}}));
  const Result none = run("inspect " + dir + "/checkpoints --tag global_step9");
  EXPECT_EQ(none.code, 2);
  EXPECT_NE(none.err.find("--tag global_step9: " + dir + "/checkpoints holds no such tag (it holds global_step2, "
                          "global_step3)"), std::string::npos) << none.err;
  const std::string resumed = temp_path("tp_rows_resumed");
  const Result r = run("train " + config + " --output " + resumed + " --set training.resume=" + tag, 1);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  expect_losses_close(losses_of(read_metrics(resumed)), {losses[2]}, 1e-6, "resumed at one rank");
}

struct Misconfig {
  std::string name, args, message;
};
class TensorMisconfig : public ::testing::TestWithParam<Misconfig> {};

TEST_P(TensorMisconfig, ExitsTwoWithOneMessageHoldingTheNumbers) {
  const std::string config = write_config("tp.json", tp_config());
  expect_one_line_rejection(run("validate " + config + " " + GetParam().args), GetParam().message);
}

INSTANTIATE_TEST_SUITE_P(
    Validation, TensorMisconfig,
    ::testing::Values(
        Misconfig{"NotDividingHeads", "--world-size 3 --set tensor_parallel.autotp_size=3",
                  "autotp_size 3 does not divide model.n_head (4)"},
        Misconfig{"NotDividingTheWorldWithTheStages",
                  "--world-size 6 --set tensor_parallel.autotp_size=2 --set pipeline.stages=2",
                  "pipeline.stages (2) x tensor_parallel.autotp_size (2) = 4 does not divide the number of ranks (6)"},
        Misconfig{"NestedTpSizeDisagreeing", "--world-size 2 --set tensor_parallel.autotp_size=2 --set tensor_parallel.tp.tp_size=4",
                  "differs from tensor_parallel.autotp_size (2)"},
        Misconfig{"SequenceParallelWithoutTensorParallel", "--world-size 1 --set tensor_parallel.sequence_parallel=true",
                  "it needs tensor_parallel.autotp_size > 1"}),
    [](const ::testing::TestParamInfo<Misconfig>& info) { return info.param.name; });

}  // namespace
