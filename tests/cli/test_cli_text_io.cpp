// Text around training, black-box: llm.c's samples while training (training.sample_every) come
// from the model being trained, are the same in every run, and leave the training losses the
// same bits at every layout they run at (pipeline stages, interleaved ones too, give the one-rank
// samples); the models generation cannot run are refused before any work. `zero3d eval --text`
// scores a text file's tokens exactly as the same tokens written by `zero3d tokenize` and read as
// data.validation.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"
#include "text/tokenizer.hpp"
#include "text/unicode.hpp"

using namespace cli;

namespace {

const std::string kGpt2 = ZERO3D_GPT2_DIR;

// A small GPT-2 with GPT-2's vocabulary and tokenizer on the synthetic task.
json text_model_config() {
  json c = tiny_config();
  c["model"]["vocab_size"] = 50257;
  c["model"]["n_positions"] = 32;
  c["data"] = {{"source", "synthetic"}, {"tokenizer", kGpt2}};
  c["training"]["steps"] = 4;
  c["steps_per_print"] = 1;
  return c;
}

std::vector<json> read_samples(const std::string& dir) {
  std::vector<json> rows;
  std::ifstream in(dir + "/samples.jsonl");
  for (std::string line; std::getline(in, line);) rows.push_back(json::parse(line));
  return rows;
}

// The metrics lines' losses and gradient norms, as written (the exact bits).
std::vector<std::string> loss_bits(const std::string& dir) {
  std::vector<std::string> out;
  for (const json& row : read_metrics(dir)) out.push_back(row.at("loss").dump() + " " + row.at("grad_norm").dump());
  return out;
}

// Two stages of two chunks each, trained with the interleaved schedule.
const std::string kInterleaved = "pipeline.stages=2 pipeline.schedule=interleaved pipeline.virtual_stages=2";

struct SampleLayout {
  std::string name, set;
  int np;
};
void PrintTo(const SampleLayout& l, std::ostream* os) { *os << l.name; }

class TrainingSamples : public ::testing::TestWithParam<SampleLayout> {};

TEST_P(TrainingSamples, AreLoggedAndLeaveTheLossesAlone) {
  const SampleLayout& l = GetParam();
  json c = text_model_config();
  const std::string plain = write_config("samples_off_" + l.name + ".json", c);
  c["training"]["sample_every"] = 2;
  c["training"]["sample_tokens"] = 8;
  const std::string sampled = write_config("samples_on_" + l.name + ".json", c);
  const std::string off = temp_path("samples_off_" + l.name), on = temp_path("samples_on_" + l.name);
  ASSERT_EQ(run("train " + plain + " --output " + off + " " + l.set, l.np).code, 0);
  const Result r = run("train " + sampled + " --output " + on + " " + l.set, l.np);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(loss_bits(on), loss_bits(off));
  EXPECT_EQ(loss_bits(on).size(), 4u);

  const std::vector<json> samples = read_samples(on);
  ASSERT_EQ(samples.size(), 2u) << r.out;
  const auto tok = zero3d::text::open_tokenizer(kGpt2);
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_EQ(samples[k].at("step"), 2 * (k + 1));
    const auto ids = samples[k].at("tokens").get<std::vector<int32_t>>();
    EXPECT_EQ(ids.size(), 8u);
    EXPECT_EQ(samples[k].at("text"), zero3d::text::sanitize_utf8(tok->decode(ids)));
    EXPECT_NE(r.out.find("sample  step " + std::to_string(2 * (k + 1)) + " | " + samples[k].at("text").dump()),
              std::string::npos)
        << r.out;
  }
  EXPECT_NE(samples[0].at("tokens"), samples[1].at("tokens"));  // other weights, another stream
  EXPECT_NE(r.out.find("sample  every 2 steps: 8 tokens from \"<|endoftext|>\" (id 50256)"), std::string::npos) << r.out;
}

INSTANTIATE_TEST_SUITE_P(Layouts, TrainingSamples,
                         ::testing::Values(SampleLayout{"np1", "", 0},
                                           SampleLayout{"zero3", "--set zero_optimization.stage=3", 2},
                                           SampleLayout{"tp2", "--set tensor_parallel.autotp_size=2", 2},
                                           SampleLayout{"p2", "--set pipeline.stages=2", 2},
                                           SampleLayout{"p2_interleaved", "--set " + kInterleaved, 2}),
                         [](const ::testing::TestParamInfo<SampleLayout>& info) { return info.param.name; });

// The same config gives the same samples (the draws are Rng(seed, step)); another seed others.
TEST(TrainingSamplesAre, TheSameInEveryRun) {
  json c = text_model_config();
  c["training"]["sample_every"] = 4;
  c["training"]["sample_tokens"] = 6;
  const std::string config = write_config("samples_repeat.json", c);
  const std::string a = temp_path("samples_a"), b = temp_path("samples_b"), other = temp_path("samples_seed");
  ASSERT_EQ(run("train " + config + " --output " + a).code, 0);
  ASSERT_EQ(run("train " + config + " --output " + b).code, 0);
  ASSERT_EQ(run("train " + config + " --output " + other + " --set training.seed=8").code, 0);
  ASSERT_EQ(read_samples(a).size(), 1u);
  EXPECT_EQ(read_samples(a), read_samples(b));
  EXPECT_NE(read_samples(a), read_samples(other));
}

// A resumed run continues samples.jsonl from its step: a record past the saved step (a killed
// run's) goes, the earlier ones stay, and the resumed step's samples follow.
TEST(TrainingSamplesAre, ContinuedByAResumedRun) {
  json c = text_model_config();
  c["training"]["sample_every"] = 2;
  c["training"]["sample_tokens"] = 4;
  c["training"]["save_interval"] = 2;
  c["training"]["steps"] = 2;
  const std::string first = write_config("samples_resume_a.json", c);
  c["training"]["steps"] = 4;
  c["training"]["resume"] = "latest";
  const std::string second = write_config("samples_resume_b.json", c);
  const std::string dir = temp_path("samples_resume");
  ASSERT_EQ(run("train " + first + " --output " + dir).code, 0);
  std::ofstream(dir + "/samples.jsonl", std::ios::app) << json{{"step", 3}, {"tokens", {1}}, {"text", "x"}}.dump() << "\n";
  const Result r = run("train " + second + " --output " + dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<json> samples = read_samples(dir);
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(samples[0].at("step"), 2);
  EXPECT_EQ(samples[1].at("step"), 4);
}

// Over pipeline stages (1F1B, and interleaved with each stage's two chunks as training holds
// them) the samples are the one-rank run's tokens: the stages decode the weights as they sit on
// each stage, which are the one-rank run's.
TEST(TrainingSamplesAre, TheOneRankSamplesOverPipelineStages) {
  json c = text_model_config();
  c["training"]["sample_every"] = 2;
  c["training"]["sample_tokens"] = 8;
  const std::string config = write_config("samples_pipe.json", c);
  const std::string one = temp_path("samples_pipe_np1");
  ASSERT_EQ(run("train " + config + " --output " + one).code, 0);
  ASSERT_EQ(read_samples(one).size(), 2u);
  for (const auto& [name, layout] :
       std::vector<std::pair<std::string, std::string>>{{"p2", "pipeline.stages=2"}, {"p2_interleaved", kInterleaved}}) {
    const std::string dir = temp_path("samples_pipe_" + name);
    const Result r = run("train " + config + " --output " + dir + " --set " + layout, 2);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(read_samples(dir), read_samples(one)) << layout;
  }
}

TEST(TrainingSamplesAre, RefusedWhereGenerationCannotRun) {
  json c = text_model_config();
  c["training"]["sample_every"] = 2;
  c["training"]["sample_tokens"] = 8;
  const std::string config = write_config("samples_bad.json", c);
  expect_one_line_rejection(run("validate " + config + " --set model.moe.num_experts=2"),
                            "`training.sample_every`: value 2: samples are generated as zero3d generate generates, "
                            "and `moe`: zero3d generate's decoder runs dense blocks");
  expect_one_line_rejection(run("validate " + config + " --set data.tokenizer="),
                            "`training.sample_every`: value 2: samples start from the tokenizer's document delimiter");
  expect_one_line_rejection(run("validate " + config + " --set training.sample_tokens=32"),
                            "`training.sample_tokens`: value 32: the start token and the samples' tokens exceed "
                            "model.n_positions (32)");
}

// Text with enough tokens for a few samples of 32.
std::string write_text(const std::string& name, int paragraphs) {
  const std::string path = temp_path(name);
  std::ofstream out(path);
  for (int i = 0; i < paragraphs; ++i)
    out << "Paragraph " << i << ": the quick brown fox jumps over the lazy dog, caf\xC3\xA9 and na\xC3\xAFve words; "
        << "numbers 3.14 and 2024 appear, as do emoji \xF0\x9F\x98\x80 now and then.\n";
  return path;
}

json eval_json(const Result& r) {
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  if (r.code != 0) return json();
  const size_t at = r.out.rfind("\n{");
  return json::parse(at == std::string::npos ? r.out : r.out.substr(at + 1));
}

// The text file through the tokenizer, and the same tokens through `zero3d tokenize` as
// data.validation: the same loss to the bit, on one rank and on two.
TEST(EvalText, ScoresTheTokensTokenizeWrites) {
  const std::string text = write_text("eval_text.txt", 12);
  const std::string shards = temp_path("eval_text_shards");
  const Result tok = run("tokenize --tokenizer " + kGpt2 + " --out " + shards + " --val-fraction 0 " + text);
  ASSERT_EQ(tok.code, 0) << tok.err;
  json c = text_model_config();
  const std::string config = write_config("eval_text.json", c);
  const json by_text = eval_json(run("eval " + config + " --text " + text + " --json"));
  ASSERT_FALSE(by_text.is_null());
  const int64_t tokens = by_text.at("text").at("tokens");
  const int64_t rounds = by_text.at("samples").get<int64_t>() / 8;
  EXPECT_EQ(rounds, ((tokens - 1) / 32) / 8);  // every whole global batch of 32-token samples
  EXPECT_GE(rounds, 1);
  const std::string ids = " --set data.validation.source=tokens data.validation.path=" + shards +
                          "/eval_text_shards_train_000001.bin training.eval_steps=" + std::to_string(rounds);
  const json by_ids = eval_json(run("eval " + config + ids + " --json"));
  ASSERT_FALSE(by_ids.is_null());
  EXPECT_EQ(by_text.at("eval_loss").get<double>(), by_ids.at("eval_loss").get<double>());
  EXPECT_EQ(by_text.at("tokens"), by_ids.at("tokens"));
  EXPECT_GT(by_text.at("eval_loss").get<double>(), 5.0);  // an untrained model over 50,257 ids
  EXPECT_NEAR(by_text.at("eval_ppl").get<double>(), std::exp(by_text.at("eval_loss").get<double>()), 1e-6);
  const json two = eval_json(run("eval " + config + " --text " + text + " --json --set zero_optimization.stage=3", 2));
  ASSERT_FALSE(two.is_null());
  EXPECT_EQ(two.at("eval_loss").get<double>(), by_text.at("eval_loss").get<double>());
  // --tokenizer names it where the config does not.
  c["data"].erase("tokenizer");
  const std::string bare = write_config("eval_text_bare.json", c);
  const json named = eval_json(run("eval " + bare + " --text " + text + " --tokenizer " + kGpt2 + " --json"));
  ASSERT_FALSE(named.is_null());
  EXPECT_EQ(named.at("eval_loss").get<double>(), by_text.at("eval_loss").get<double>());
  const Result line = run("eval " + config + " --text " + text);
  EXPECT_NE(line.out.find("text    " + text + ": " + std::to_string(tokens) + " tokens through"), std::string::npos)
      << line.out;
}

TEST(EvalText, BadTextIsRefusedWithTheReason) {
  json c = text_model_config();
  const std::string config = write_config("eval_text_bad.json", c);
  const std::string short_text = write_text("eval_short.txt", 1);
  expect_one_line_rejection(run("eval " + config + " --text " + short_text),
                            "fewer than one global batch (train_batch_size 8)");
  const std::string broken = temp_path("eval_broken.txt");
  std::ofstream(broken) << "fine text then \xC3\x28 broken";
  expect_one_line_rejection(run("eval " + config + " --text " + broken), "not valid UTF-8 at byte offset 15");
  c["data"].erase("tokenizer");
  const std::string bare = write_config("eval_text_none.json", c);
  expect_one_line_rejection(run("eval " + bare + " --text " + short_text), "eval --text: no tokenizer");
  expect_one_line_rejection(run("eval " + bare + " --text " + temp_path("absent.txt") + " --tokenizer " + kGpt2),
                            "absent.txt");
  json small = tiny_config();  // vocabulary 64: GPT-2's ids do not fit
  small["data"] = {{"tokenizer", kGpt2}};
  expect_one_line_rejection(run("eval " + write_config("eval_small.json", small) + " --text " + short_text),
                            "is outside model.vocab_size 64");
}

}  // namespace
