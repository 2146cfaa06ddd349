// test_cli_estimate_3d.cpp — `zero3d estimate --config` on pipeline × data × tensor layouts:
// the model-state categories and the activations equal, byte for byte, what the engine
// allocates (metrics.jsonl `memory`, written by world rank 0: pipeline stage 0, tensor rank 0),
// and the per-rank figure is the largest rank's.
#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <string>

#include "config/config.hpp"
#include "model/model.hpp"
#include "parallel/pipe_schedule.hpp"
#include "support/cli_helpers.hpp"
#include "train/estimator.hpp"

namespace {

using namespace cli;
using namespace zero3d;

// The tiny 3D model: V = 61 (padded once split over t = 2), T = 16, L = 6, H = 4, C = 32;
// micro-batch 2, global batch 16.
json model_3d(int stages, int t, bool sp, const std::string& schedule) {
  json j = tiny_config();
  j["model"] = {{"vocab_size", 61}, {"n_positions", 16}, {"n_layer", 6}, {"n_head", 4}, {"n_embd", 32}};
  j["train_batch_size"] = 16;
  j["train_micro_batch_size_per_gpu"] = 2;
  j["zero_optimization"] = {{"reduce_bucket_size", 1000}, {"allgather_bucket_size", 1000}};
  j["training"]["steps"] = 1;
  if (stages > 1) j["pipeline"] = {{"stages", stages}, {"schedule", schedule}};
  if (t > 1) j["tensor_parallel"] = {{"autotp_size", t}, {"sequence_parallel", sp}};
  return j;
}

struct Layout3d {
  int np, stages, t;
  bool sp = false;
  std::string schedule = "1f1b";
  std::string dtype = "fp32";
};
void PrintTo(const Layout3d& l, std::ostream* os) {
  *os << "np " << l.np << " stages " << l.stages << " t " << l.t << (l.sp ? " sp" : "") << " " << l.schedule << " "
      << l.dtype;
}

class EstimateVsEngine3d : public ::testing::TestWithParam<Layout3d> {};

TEST_P(EstimateVsEngine3d, RankZerosCategoriesEqualTheEngineCountsAndTheBudgetIsTheLargestRank) {
  const Layout3d l = GetParam();
  json j = model_3d(l.stages, l.t, l.sp, l.schedule);
  if (l.dtype != "fp32") j[l.dtype] = {{"enabled", true}};
  const std::string name = "est3d_np" + std::to_string(l.np) + "_p" + std::to_string(l.stages) + "_t" +
                           std::to_string(l.t) + (l.sp ? "_sp" : "") + "_" + l.schedule + "_" + l.dtype;
  const std::string cfg = write_config(name + ".json", j);
  const Result r = run("estimate --config " + cfg + " --world-size " + std::to_string(l.np) + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json est = json::parse(r.out);
  EXPECT_EQ(est["pipeline_stages"], l.stages);
  EXPECT_EQ(est["tensor_parallel_size"], l.t);
  EXPECT_EQ(est["data_parallel_size"], l.np / (l.stages * l.t));
  ASSERT_EQ(est["ranks"].size(), size_t(l.stages));
  for (int stage = 0; stage <= 3; ++stage) {
    // The per-rank budget is the largest rank's, and says which.
    const json& top = est["budgets"][stage];
    int64_t largest = 0;
    for (const json& rank : est["ranks"]) largest = std::max(largest, rank["budgets"][stage]["total"].get<int64_t>());
    EXPECT_EQ(top["total"].get<int64_t>(), largest) << "stage " << stage;
    const json& named = est["ranks"][top["pipe_stage"].get<int>()]["budgets"][stage];
    EXPECT_EQ(named, top) << "stage " << stage;
    EXPECT_EQ(top["tensor_rank"], 0);
    const std::string dir = temp_path(name + "_s" + std::to_string(stage));
    const Result train =
        run("train " + cfg + " --output " + dir + " --set zero_optimization.stage=" + std::to_string(stage), l.np);
    ASSERT_EQ(train.code, 0) << train.err;
    const json m = read_metrics(dir).back()["memory"];
    const json& rank0 = est["ranks"][0]["budgets"][stage];
    for (const char* category : {"params", "grads", "master", "optimizer_states", "activations"})
      EXPECT_EQ(rank0[category], m[category]) << "stage " << stage << " " << category;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, EstimateVsEngine3d,
    ::testing::Values(Layout3d{2, 2, 1},                         // two pipeline stages
                      Layout3d{2, 1, 2},                         // tensor parallel
                      Layout3d{2, 1, 2, true, "1f1b", "bf16"},   // sequence parallel, 16-bit states
                      Layout3d{4, 2, 2},                         // stages × tensor
                      Layout3d{4, 2, 1, false, "zb-h1"}));       // two data-parallel ranks, split backward

// --world-size is every rank: the data-parallel size divides out the stages and tensor ranks.
TEST(Estimate3d, WorldSizeCountsEveryRankAndTheTextNamesTheLargest) {
  const std::string cfg = write_config("est3d_text.json", model_3d(2, 2, false, "1f1b"));
  const Result r = run("estimate --config " + cfg + " --world-size 8");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("8 ranks = 2 pipeline stages x 2 data-parallel x 2 tensor-parallel"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the largest: pipeline stage, tensor rank"), std::string::npos) << r.out;
  const Result bad = run("estimate --config " + cfg + " --world-size 6");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("does not divide the number of ranks (6)"), std::string::npos) << bad.err;
}

// Kokkos for the in-process checks below (the CLI suite's main does not start it).
struct KokkosOnce : ::testing::Environment {
  bool mine = false;
  void start() {
    if (!mine && !Kokkos::is_initialized()) Kokkos::initialize(), mine = true;
  }
  void TearDown() override {
    if (mine && Kokkos::is_initialized()) Kokkos::finalize();
  }
};
KokkosOnce* const kokkos = static_cast<KokkosOnce*>(::testing::AddGlobalTestEnvironment(new KokkosOnce));

// The estimator's activations: the schedule's buffers × one buffer, plus the backward scratch,
// with the sizes GPT allocates (gpt_activation_bytes against make_buffer and scratch_bytes).
TEST(Estimate3d, ActivationsAreTheSchedulesBuffersTimesWhatGptAllocates) {
  kokkos->start();
  ASSERT_TRUE(Kokkos::is_initialized());
  struct Case {
    int ranks, stages, t;
    bool sp;
    std::string schedule;
  };
  for (const Case& c : {Case{2, 2, 1, false, "1f1b"}, Case{4, 2, 2, false, "1f1b"}, Case{4, 2, 2, true, "zb-h1"},
                        Case{2, 1, 2, true, "1f1b"}, Case{8, 4, 1, false, "interleaved"}}) {
    json j = model_3d(c.stages, c.t, c.sp, c.schedule);
    if (c.schedule == "interleaved") j["pipeline"]["virtual_stages"] = 2;
    const Config cfg = read_config(j, "est3d", c.ranks);
    const GPTShape shape{cfg.model.vocab_size, cfg.model.n_positions, cfg.model.n_layer, cfg.model.n_head,
                         cfg.model.n_embd};
    const std::vector<MemoryBudget> ranks = estimate_rank_budgets(cfg, c.ranks, 1);
    ASSERT_EQ(ranks.size(), size_t(c.stages));
    for (int s = 0; s < c.stages; ++s) {
      const pipe::StageSchedule schedule = pipe::make_schedule(
          {cfg.pipeline.schedule, c.stages, int(cfg.batch.gradient_accumulation_steps), cfg.pipeline.virtual_stages}, s);
      bool split = false;
      for (const auto& step : schedule.steps)
        for (const pipe::Instruction& in : step) split = split || in.op == pipe::Op::BackwardInput;
      EXPECT_EQ(split, c.schedule == "zb-h1");
      for (int tr = 0; tr < c.t; ++tr) {
        const ModelPart part = gpt_model_part(shape, cfg.pipe_bounds, c.stages, s, c.t, tr);
        const GPT model(shape, cfg.batch.micro_batch, cfg.model.n_positions, DType::F32, part,
                        TensorGroup{nullptr, c.t, tr, false, c.sp});
        const ActivationBuffer buf = model.make_buffer(split);
        const GPTActivationBytes formula =
            gpt_activation_bytes(shape, part, cfg.batch.micro_batch, cfg.model.n_positions, c.sp, split);
        EXPECT_EQ(formula.buffer, buf.bytes()) << c.schedule << " stage " << s << " tensor rank " << tr;
        EXPECT_EQ(formula.scratch, model.scratch_bytes()) << c.schedule << " stage " << s << " tensor rank " << tr;
        // Every tensor rank's budget is tensor rank 0's (the estimator reports tensor rank 0).
        EXPECT_EQ(ranks[s].activations, schedule.num_buffers * buf.bytes() + model.scratch_bytes())
            << c.schedule << " stage " << s << " tensor rank " << tr;
      }
    }
  }
}

// A long accumulation (m = 600) is planned from a short schedule: the buffers in flight are
// the full schedule's.
TEST(Estimate3d, LongAccumulationKeepsTheFullSchedulesBufferCount) {
  for (const std::string kind : {"1f1b", "interleaved", "zb-h1"}) {
    json j = model_3d(2, 1, false, kind);
    j["train_batch_size"] = 2 * 600;
    if (kind == "interleaved") j["pipeline"]["virtual_stages"] = 2;
    const Config cfg = read_config(j, "est3d", 2);
    ASSERT_EQ(cfg.batch.gradient_accumulation_steps, 600);
    const GPTShape shape{cfg.model.vocab_size, cfg.model.n_positions, cfg.model.n_layer, cfg.model.n_head,
                         cfg.model.n_embd};
    const std::vector<MemoryBudget> ranks = estimate_rank_budgets(cfg, 2, 0);
    for (int s = 0; s < 2; ++s) {
      const pipe::StageSchedule schedule =
          pipe::make_schedule({cfg.pipeline.schedule, 2, 600, cfg.pipeline.virtual_stages}, s);
      const GPTActivationBytes act = gpt_activation_bytes(shape, gpt_model_part(shape, cfg.pipe_bounds, 2, s, 1, 0),
                                                          2, cfg.model.n_positions, false, kind == "zb-h1");
      EXPECT_EQ(ranks[s].activations, schedule.num_buffers * act.buffer + act.scratch) << kind << " stage " << s;
    }
  }
}

// ZeRO 0 holds each rank's own layout; stages 1-3 partition the largest stage's count, so
// every stage's model states are equal there.
TEST(Estimate3d, ModelStatesFollowEachStagesLayout) {
  const Config cfg = read_config(model_3d(2, 2, false, "1f1b"), "est3d", 8);
  const GPTShape shape{cfg.model.vocab_size, cfg.model.n_positions, cfg.model.n_layer, cfg.model.n_head,
                       cfg.model.n_embd};
  int64_t largest = 0;
  std::vector<int64_t> totals;
  for (int s = 0; s < 2; ++s) {
    for (int tr = 0; tr < 2; ++tr)
      EXPECT_EQ(gpt_model_part(shape, cfg.pipe_bounds, 2, s, 2, tr).layout.total(),
                gpt_model_part(shape, cfg.pipe_bounds, 2, s, 2, 0).layout.total());
    totals.push_back(gpt_model_part(shape, cfg.pipe_bounds, 2, s, 2, 0).layout.total());
    largest = std::max(largest, totals.back());
  }
  const std::vector<MemoryBudget> s0 = estimate_rank_budgets(cfg, 8, 0), s3 = estimate_rank_budgets(cfg, 8, 3);
  const int64_t padded = (largest + 3) / 4 * 4, part = padded / 2;  // data-parallel size 8 / (2 x 2)
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(s0[s].params, 4 * totals[s]);
    EXPECT_EQ(s0[s].optimizer_states, 8 * totals[s]);
    EXPECT_EQ(s3[s].params, 4 * part);
    EXPECT_EQ(s3[s].optimizer_states, 8 * part);
  }
}

}  // namespace
