// zero3d generate, black-box: from the goldens' weights (tests/golden/make_generate_goldens.py,
// PyTorch with its own KV cache) through model.init_from, the greedy continuations of PyTorch
// token for token for every family, batched; the same tokens with tensor parallelism, ZeRO-3 and
// data parallelism at np 2, with pipeline stages (alone, with tensor ranks inside each stage, with
// data-parallel replicas, with interleaved virtual stages, a batch cut into micro-batches) and from
// a checkpoint saved by training; sampling reproducible and independent of the batch and the
// layout; EOS and stop strings end a prompt at the same token in every layout; every bad option is
// refused before any work, exit 2, one line naming the option.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "io/h5.hpp"
#include "support/cli_helpers.hpp"
#include "text/tokenizer.hpp"
#include "text/unicode.hpp"

using namespace cli;

namespace {

struct GoldenRun {
  std::string family, weights;
  json model;
  std::vector<std::vector<int32_t>> prompts, greedy;
};

const GoldenRun& golden(const std::string& family) {
  static std::map<std::string, GoldenRun> cache;
  auto it = cache.find(family);
  if (it != cache.end()) return it->second;
  GoldenRun g;
  g.family = family;
  g.weights = kSource + "/tests/golden/generate_" + family + ".h5";
  const zero3d::h5::File f = zero3d::h5::File::open_read(g.weights);
  std::string text;
  int64_t prompts = 0;
  EXPECT_TRUE(zero3d::h5::read_attribute(f.id(), "config", text));
  EXPECT_TRUE(zero3d::h5::read_attribute(f.id(), "prompts", prompts));
  g.model = json::parse(text);
  g.model["init_from"] = g.weights;
  for (int64_t k = 0; k < prompts; ++k) {
    g.prompts.push_back(f.read_ints("golden/prompt_" + std::to_string(k)));
    g.greedy.push_back(f.read_ints("golden/greedy_" + std::to_string(k)));
  }
  return cache.emplace(family, std::move(g)).first->second;
}

json config_of(const GoldenRun& g) {
  return json{{"train_micro_batch_size_per_gpu", 1},
              {"gradient_accumulation_steps", 1},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
              {"model", g.model},
              {"training", {{"steps", 2}, {"seed", 7}, {"peak_gflops", 50}}},
              {"steps_per_print", 100}};
}

std::string ids_text(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

std::string prompts_file(const GoldenRun& g) {
  const std::string path = temp_path(g.family + "_prompts.txt");
  std::ofstream out(path);
  for (const auto& p : g.prompts) out << ids_text(p) << "\n";
  return path;
}

// `zero3d generate` with --json on np ranks; the last stdout line, parsed (null on failure).
json generate(const std::string& config, const std::string& args, int np = 0) {
  const Result r = run("generate " + config + " " + args + " --json", np);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  if (r.code != 0) return json();
  const std::string out = r.out.substr(0, r.out.find_last_not_of('\n') + 1);
  return json::parse(out.substr(out.find_last_of('\n') + 1));
}

std::vector<std::vector<int32_t>> tokens_of(const json& doc) {
  std::vector<std::vector<int32_t>> out;
  if (doc.is_null()) return out;
  for (const json& o : doc.at("outputs")) out.push_back(o.at("tokens").get<std::vector<int32_t>>());
  return out;
}

const std::string kGreedyAnyBatch = "--greedy --max-new-tokens 10 --eos-id -1";
const std::string kGreedy = kGreedyAnyBatch + " --batch-size 3";

class GenerateFamily : public ::testing::TestWithParam<std::string> {};

TEST_P(GenerateFamily, GreedyGivesPyTorchsContinuations) {
  const GoldenRun& g = golden(GetParam());
  const std::string config = write_config(g.family + "_gen.json", config_of(g));
  const json doc = generate(config, "--prompt-ids-file " + prompts_file(g) + " " + kGreedy);
  EXPECT_EQ(tokens_of(doc), g.greedy);
  if (doc.is_null()) return;
  for (const json& o : doc.at("outputs")) EXPECT_EQ(o.at("finish_reason"), "length");
  EXPECT_EQ(doc.at("prefill_tokens"), 5 + 2 + 7);
  EXPECT_EQ(doc.at("decode_tokens"), 3 * 9);
  EXPECT_GT(doc.at("decode_tokens_per_s").get<double>(), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Families, GenerateFamily, ::testing::Values("gpt2", "llama", "mistral", "qwen2"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// Two stages of two interleaved chunks each (a checkpoint trained with the interleaved schedule).
const std::string kInterleaved =
    "pipeline.stages=2 pipeline.schedule=interleaved pipeline.virtual_stages=2 gradient_accumulation_steps=2";

struct Layout {
  std::string family, name, set;
  int np = 2;
  std::string batch = "--batch-size 3";
};
void PrintTo(const Layout& l, std::ostream* os) { *os << l.family << " " << l.name; }

class GenerateLayout : public ::testing::TestWithParam<Layout> {};

// Two ranks: the heads (and the KV cache) split over the tensor group, parameters gathered from
// ZeRO-3's partitions, or two data-parallel replicas each with its block of the prompts (with
// ZeRO-3 the replica with fewer runs passes in lockstep); two pipeline stages, one prompt a group
// so that two groups are in flight, alone, with two tensor ranks in each stage, or with two
// data-parallel replicas: PyTorch's tokens all the same.
TEST_P(GenerateLayout, SeveralRanksGiveTheOneRankTokens) {
  const Layout& l = GetParam();
  const GoldenRun& g = golden(l.family);
  const std::string config = write_config(l.family + "_" + l.name + ".json", config_of(g));
  const json doc = generate(config, "--prompt-ids-file " + prompts_file(g) + " " + kGreedyAnyBatch + " " + l.batch + " " +
                                        l.set, l.np);
  EXPECT_EQ(tokens_of(doc), g.greedy) << l.family << " " << l.name;
  if (doc.is_null()) return;
  // every replica's prompts and tokens counted
  EXPECT_EQ(doc.at("prefill_tokens"), 5 + 2 + 7);
  EXPECT_EQ(doc.at("decode_tokens"), 3 * 9);
  EXPECT_EQ(doc.at("new_tokens"), 3 * 10);
  EXPECT_GT(doc.at("tokens_per_s").get<double>(), 0.0);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, GenerateLayout,
    ::testing::Values(Layout{"gpt2", "tp2", "--set tensor_parallel.autotp_size=2"},
                      Layout{"gpt2", "zero3", "--set zero_optimization.stage=3"},
                      Layout{"gpt2", "dp2", "--set zero_optimization.stage=1"},
                      Layout{"llama", "tp2", "--set tensor_parallel.autotp_size=2"},
                      Layout{"llama", "zero3", "--set zero_optimization.stage=3"},
                      Layout{"qwen2", "tp2", "--set tensor_parallel.autotp_size=2"},
                      Layout{"mistral", "zero3", "--set zero_optimization.stage=3"},
                      Layout{"gpt2", "p2", "--set pipeline.stages=2", 2, "--batch-size 1"},
                      Layout{"llama", "p2", "--set pipeline.stages=2", 2, "--batch-size 1"},
                      Layout{"qwen2", "p2_batch2", "--set pipeline.stages=2", 2, "--batch-size 2"},
                      Layout{"gpt2", "p2_t2", "--set pipeline.stages=2 tensor_parallel.autotp_size=2", 4, "--batch-size 1"},
                      Layout{"gpt2", "dp2_batch1", "--set zero_optimization.stage=1", 2, "--batch-size 1"},
                      Layout{"gpt2", "p2_dp2", "--set pipeline.stages=2 zero_optimization.stage=1", 4, "--batch-size 1"},
                      Layout{"mistral", "p2_dp2_zero3", "--set pipeline.stages=2 zero_optimization.stage=3", 4,
                             "--batch-size 1"},
                      Layout{"gpt2", "p2_batch3", "--set pipeline.stages=2", 2, "--batch-size 3"},
                      Layout{"gpt2", "p2_v2", "--set " + kInterleaved, 2, "--batch-size 1"},
                      Layout{"llama", "p2_v2_batch3", "--set " + kInterleaved, 2, "--batch-size 3"},
                      Layout{"gpt2", "p2_v2_t2", "--set tensor_parallel.autotp_size=2 " + kInterleaved, 4,
                             "--batch-size 1"}),
    [](const ::testing::TestParamInfo<Layout>& info) { return info.param.family + "_" + info.param.name; });

// Sampled tokens depend on the seed and the prompt's place in the file, not on the batch or
// the layout; another seed draws others.
TEST(Generate, SamplingIsReproducibleAcrossBatchesAndLayouts) {
  const GoldenRun& g = golden("llama");
  const std::string config = write_config("llama_sampling.json", config_of(g));
  const std::string args = "--prompt-ids-file " + prompts_file(g) +
                           " --temperature 1.5 --top-k 20 --top-p 0.95 --max-new-tokens 10 --eos-id -1";
  const auto batch3 = tokens_of(generate(config, args + " --seed 5 --batch-size 3"));
  ASSERT_EQ(batch3.size(), 3u);
  EXPECT_EQ(tokens_of(generate(config, args + " --seed 5 --batch-size 1")), batch3);
  EXPECT_EQ(tokens_of(generate(config, args + " --seed 5 --batch-size 2 --set tensor_parallel.autotp_size=2", 2)),
            batch3);
  EXPECT_NE(tokens_of(generate(config, args + " --seed 6 --batch-size 3")), batch3);
  EXPECT_NE(batch3, g.greedy);
}

// The sampled tokens of one rank over two pipeline stages (with two tensor ranks each) and two
// data-parallel replicas (with two stages each, ZeRO-3).
TEST(Generate, SamplingGivesTheOneRankTokensOverStagesAndReplicas) {
  const GoldenRun& g = golden("llama");
  const std::string config = write_config("llama_sampling_layouts.json", config_of(g));
  const std::string args = "--prompt-ids-file " + prompts_file(g) +
                           " --temperature 1.5 --top-k 20 --top-p 0.95 --max-new-tokens 10 --eos-id -1 --seed 5"
                           " --batch-size 1";
  const auto one = tokens_of(generate(config, args));
  ASSERT_EQ(one.size(), 3u);
  EXPECT_NE(one, g.greedy);
  for (const auto& [layout, np] : std::vector<std::pair<std::string, int>>{
           {"pipeline.stages=2", 2},
           {"pipeline.stages=2 tensor_parallel.autotp_size=2", 4},
           {"zero_optimization.stage=1", 2},
           {"pipeline.stages=2 zero_optimization.stage=3", 4},
           {kInterleaved, 2},
           {kInterleaved + " zero_optimization.stage=3", 4}})
    EXPECT_EQ(tokens_of(generate(config, args + " --set " + layout, np)), one) << layout;
}

// One batch of three prompts over two stages runs as two micro-batches in flight (two prompts,
// then one), so that the stages overlap; greedy and sampled tokens are the one-rank batch's, and
// the text form names the groups with each stage's wait.
TEST(Generate, ABatchIsCutIntoMicroBatchesOverStages) {
  const GoldenRun& g = golden("llama");
  const std::string config = write_config("llama_micro_batches.json", config_of(g));
  const std::string prompts = "--prompt-ids-file " + prompts_file(g) + " --batch-size 3 --max-new-tokens 10 --eos-id -1";
  for (const std::string sampling : {"--greedy", "--temperature 1.5 --top-k 20 --seed 5"}) {
    const json one = generate(config, prompts + " " + sampling);
    const json whole = generate(config, prompts + " " + sampling + " --set pipeline.stages=2", 2);
    const json split = generate(config, prompts + " " + sampling + " --micro-batches 2 --set pipeline.stages=2", 2);
    ASSERT_FALSE(one.is_null() || whole.is_null() || split.is_null()) << sampling;
    EXPECT_EQ(one.at("groups_in_flight"), 1) << sampling;
    EXPECT_EQ(one.at("group_rows"), 3) << sampling;
    EXPECT_EQ(whole.at("groups_in_flight"), 1) << sampling << ": one batch is one group by default";
    EXPECT_EQ(whole.at("group_rows"), 3) << sampling;
    EXPECT_EQ(split.at("groups_in_flight"), 2) << sampling;
    EXPECT_EQ(split.at("group_rows"), 2) << sampling;
    EXPECT_EQ(tokens_of(whole), tokens_of(one)) << sampling;
    EXPECT_EQ(tokens_of(split), tokens_of(one)) << sampling;
    EXPECT_EQ(split.at("stage_wait_ms").size(), 2u);
  }
  EXPECT_EQ(run("generate " + config + " " + prompts + " --greedy --micro-batches 0").code, 2);
  const Result text =
      run("generate " + config + " " + prompts + " --greedy --micro-batches 2 --set pipeline.stages=2", 2);
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("pipe    2 groups of up to 2 prompts in flight | waited on other stages (ms per stage): "),
            std::string::npos)
      << text.out;
}

// bf16 and fp16 weights: two stages with two tensor ranks each give the one-rank run's tokens.
TEST(Generate, PipelineStagesGiveTheOneRankTokensInHalfPrecision) {
  const GoldenRun& g = golden("llama");
  const std::string config = write_config("llama_half_pipe.json", config_of(g));
  const std::string args = "--prompt-ids-file " + prompts_file(g) + " " + kGreedyAnyBatch + " --batch-size 1 --set ";
  for (const std::string half : {"bf16.enabled=true", "fp16.enabled=true"}) {
    const auto one = tokens_of(generate(config, args + half));
    ASSERT_EQ(one.size(), 3u) << half;
    EXPECT_EQ(tokens_of(generate(config, args + half + " pipeline.stages=2 tensor_parallel.autotp_size=2", 4)), one)
        << half;
  }
}

// An EOS id ends its prompt (returned as its last token); the other prompts run on.
TEST(Generate, EosEndsAPrompt) {
  const GoldenRun& g = golden("gpt2");
  const std::string config = write_config("gpt2_eos.json", config_of(g));
  const int32_t eos = g.greedy[0][2];
  const json doc = generate(config, "--prompt-ids-file " + prompts_file(g) +
                                        " --greedy --max-new-tokens 10 --batch-size 3 --eos-id " + std::to_string(eos));
  ASSERT_FALSE(doc.is_null());
  for (size_t k = 0; k < 3; ++k) {
    const auto& want = g.greedy[k];
    const auto end = std::find(want.begin(), want.end(), eos);
    const json& o = doc.at("outputs")[k];
    EXPECT_EQ(o.at("tokens").get<std::vector<int32_t>>(),
              std::vector<int32_t>(want.begin(), end == want.end() ? end : end + 1)) << "prompt " << k;
    EXPECT_EQ(o.at("finish_reason"), end == want.end() ? "length" : "eos") << "prompt " << k;
  }
  EXPECT_EQ(doc.at("eos"), json::array({eos}));
}

// An EOS or --max-new-tokens ends each prompt at the same token over pipeline stages and
// data-parallel replicas as on one rank.
TEST(Generate, EosAndMaxNewTokensEndTheSameOverStagesAndReplicas) {
  const GoldenRun& g = golden("gpt2");
  const std::string config = write_config("gpt2_eos_layouts.json", config_of(g));
  const int32_t eos = g.greedy[0][2];
  const std::string args = "--prompt-ids-file " + prompts_file(g) + " --greedy --batch-size 1 --eos-id " +
                           std::to_string(eos);
  for (const std::string tokens : {"10", "4"}) {
    const json one = generate(config, args + " --max-new-tokens " + tokens);
    ASSERT_FALSE(one.is_null());
    for (const auto& [layout, np] : std::vector<std::pair<std::string, int>>{
             {"pipeline.stages=2", 2}, {"zero_optimization.stage=1", 2}, {"pipeline.stages=2 zero_optimization.stage=3", 4}}) {
      const json doc = generate(config, args + " --max-new-tokens " + tokens + " --set " + layout, np);
      ASSERT_FALSE(doc.is_null()) << layout;
      EXPECT_EQ(doc.at("outputs"), one.at("outputs")) << layout << ", --max-new-tokens " << tokens;
    }
    EXPECT_EQ(one.at("outputs")[0].at("finish_reason"), "eos");
  }
}

// GPT-2's vocabulary: <|endoftext|> (50256) is the EOS without being asked for.
TEST(Generate, Gpt2sVocabularyStopsAtEndOfText) {
  json c = tiny_config();
  c["model"]["vocab_size"] = 50257;
  c["train_batch_size"] = 1;
  c["train_micro_batch_size_per_gpu"] = 1;
  const std::string config = write_config("gpt2_vocab.json", c);
  const json doc = generate(config, "--prompt-ids 464,2068 --max-new-tokens 2");
  ASSERT_FALSE(doc.is_null());
  EXPECT_EQ(doc.at("eos"), json::array({50256}));
}

// The text form: the ids of each prompt, then the speeds.
TEST(Generate, PrintsTheIdsAndTheSpeeds) {
  const GoldenRun& g = golden("qwen2");
  const std::string config = write_config("qwen2_text.json", config_of(g));
  const Result r = run("generate " + config + " --prompt-ids " + ids_text(g.prompts[1]) +
                       " --greedy --max-new-tokens 10 --eos-id -1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("[0] " + ids_text(g.prompts[1]) + " -> " + ids_text(g.greedy[1]) + "\n"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("speed   prefill 2 tokens in"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("decode 9 tokens in"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tokens/s)"), std::string::npos) << r.out;
}

// Training saves, generate loads the save at one rank and at two tensor ranks: the same tokens,
// which are not the initial weights' (the loaded parameters are the trained ones).
TEST(Generate, FromATrainingCheckpointAtAnyLayout) {
  const GoldenRun& g = golden("llama");
  json c = config_of(g);
  c["training"]["save_interval"] = 2;
  c["optimizer"]["params"]["lr"] = 3e-2;
  const std::string config = write_config("llama_ckpt_gen.json", c), dir = temp_path("gen_ckpt_run");
  ASSERT_EQ(run("train " + config + " --output " + dir).code, 0);
  const std::string args = "--prompt-ids-file " + prompts_file(g) + " " + kGreedy + " --checkpoint " + dir + "/checkpoints";
  const json one = generate(config, args);
  ASSERT_FALSE(one.is_null());
  EXPECT_EQ(one.at("step"), 2);
  EXPECT_EQ(tokens_of(generate(config, args + " --set tensor_parallel.autotp_size=2", 2)), tokens_of(one));
  EXPECT_NE(tokens_of(one), g.greedy);
}

TEST(Generate, BadOptionsAreRefusedByNameBeforeAnyWork) {
  const GoldenRun& g = golden("gpt2");  // vocab 64, 32 positions
  const std::string config = write_config("gpt2_bad.json", config_of(g));
  const std::string empty_line = temp_path("prompts_empty_line.txt");
  std::ofstream(empty_line) << "1,2\n\n3\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--prompt-ids 1,2 --top-p 0", "--top-p 0: must be in (0, 1]"},
      {"--prompt-ids 1,2 --top-p 1.5", "--top-p 1.5: must be in (0, 1]"},
      {"--prompt-ids 1,2 --temperature -1", "--temperature -1: must be a number above 0"},
      {"--prompt-ids 1,2 --temperature 0", "--temperature 0: must be a number above 0"},
      {"--prompt-ids 1,2 --top-k -1", "--top-k -1: must be 0 (off) or a positive count"},
      {"--prompt-ids 1,2 --max-new-tokens 0", "--max-new-tokens 0: must be at least 1"},
      {"--prompt-ids 1,2 --max-new-tokens 4 --min-new-tokens 5", "--min-new-tokens 5: must be in [0, --max-new-tokens 4]"},
      {"--prompt-ids 1,2 --batch-size 0", "--batch-size 0: must be at least 1"},
      {"--prompt-ids 1,2 --max-new-tokens 4 --eos-id 64", "--eos-id 64: outside the vocabulary [0, 64)"},
      {"--prompt-ids 1,2 --eos-id -5", "--eos-id -5: an id, or -1 for none"},
      {"--prompt-ids 1,x", "--prompt-ids: x is not a token id"},
      {"--prompt-ids 1,64", "--prompt-ids: token id 64 is outside the vocabulary [0, 64)"},
      {"--prompt-ids ,", "--prompt-ids: an empty prompt"},
      {"--prompt-ids 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23 --max-new-tokens 10",
       "--prompt-ids: 23 prompt tokens + --max-new-tokens 10 exceed the model's 32 positions (n_positions)"},
      {"", "generate: no prompt"},
      {"--prompt-ids 1 --prompt-ids-file " + empty_line, "give one of --prompt, --prompt-file, --prompt-ids and --prompt-ids-file"},
      {"--prompt-ids-file " + empty_line, "line 2: an empty prompt"},
      {"--prompt-ids-file " + temp_path("absent.txt"), "--prompt-ids-file"},
      {"--prompt-ids 1,2 --tag global_step1", "generate --tag global_step1: needs --checkpoint"},
  };
  for (const auto& [args, message] : cases) {
    SCOPED_TRACE(args);
    expect_one_line_rejection(run("generate " + config + " " + args), message);
  }
}

}  // namespace

namespace {

// The last line of `generate --json`.
json last_json_line(const std::string& out) {
  const size_t at = out.rfind("\n{");
  return json::parse(at == std::string::npos ? out : out.substr(at + 1));
}

// Text in and out: --prompt goes through the tokenizer (GPT-2's "Hello world" is ids 15496, 995 in
// its encoder.json), the same run with those ids generates the same tokens, and the JSON's text
// is the tokenizer's decoding of them.
TEST(Generate, TextPromptsAndOutputGoThroughTheTokenizer) {
  const std::string model = kSource + "/input/quickstart.json --set model.vocab_size=50257";
  const std::string common = " --greedy --max-new-tokens 6 --eos-id -1 --json --tokenizer " + std::string(ZERO3D_GPT2_DIR);
  const Result text = run("generate " + model + " --prompt \"Hello world\"" + common);
  const Result ids = run("generate " + model + " --prompt-ids 15496,995" + common);
  ASSERT_EQ(text.code, 0) << text.err;
  ASSERT_EQ(ids.code, 0) << ids.err;
  const json t = last_json_line(text.out).at("outputs").at(0), i = last_json_line(ids.out).at("outputs").at(0);
  EXPECT_EQ(t.at("prompt"), json::array({15496, 995}));
  EXPECT_EQ(t.at("tokens"), i.at("tokens"));
  const auto tok = zero3d::text::open_tokenizer(ZERO3D_GPT2_DIR);
  EXPECT_EQ(t.at("text").get<std::string>(), tok->decode(t.at("tokens").get<std::vector<int32_t>>()));
}

TEST(Generate, TextPromptsNeedATokenizerThatFitsTheModel) {
  const Result none = run("generate " + kSource + "/input/quickstart.json --prompt \"Hello\" --greedy");
  expect_one_line_rejection(none, "no tokenizer");
  const Result wide = run("generate " + kSource + "/input/quickstart.json --prompt \"Hello world\" --greedy --tokenizer " +
                          std::string(ZERO3D_GPT2_DIR));
  expect_one_line_rejection(wide, "outside the model's vocabulary [0, 256)");
}

}  // namespace

namespace {

// The quick-start model with GPT-2's vocabulary and tokenizer: text in and out.
const std::string kTextModel = kSource + "/input/quickstart.json --set model.vocab_size=50257 --tokenizer " +
                               std::string(ZERO3D_GPT2_DIR);

const zero3d::text::Tokenizer& gpt2_tokenizer() {
  static const auto tok = zero3d::text::open_tokenizer(ZERO3D_GPT2_DIR);
  return *tok;
}

std::string decoded(const std::vector<int32_t>& ids) { return zero3d::text::sanitize_utf8(gpt2_tokenizer().decode(ids)); }

// A stop string from the middle of `text`: three bytes of letters, digits or spaces (one that a
// shell passes as it is), at or after the middle; empty when there is none.
std::string stop_from_middle(const std::string& text) {
  for (size_t at = text.size() / 2; at + 3 <= text.size(); ++at) {
    const std::string s = text.substr(at, 3);
    if (std::all_of(s.begin(), s.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == ' '; }))
      return s;
  }
  return "";
}

// A stop string ends the sequence at the token that completes it; the text is the decoded text
// cut before it, and the text form streams exactly that text to stdout.
TEST(GenerateText, AStopStringEndsTheTextBeforeIt) {
  const std::string common = " --prompt \"Hello world\" --greedy --max-new-tokens 24 --eos-id -1";
  const Result full_run = run("generate " + kTextModel + common + " --json");
  ASSERT_EQ(full_run.code, 0) << full_run.err;
  const json full = last_json_line(full_run.out).at("outputs").at(0);
  const std::vector<int32_t> all = full.at("tokens").get<std::vector<int32_t>>();
  const std::string text = full.at("text");
  EXPECT_EQ(text, decoded(all));
  const std::string stop = stop_from_middle(text);
  ASSERT_FALSE(stop.empty()) << text;

  const Result stopped_run = run("generate " + kTextModel + common + " --json --stop '" + stop + "'");
  ASSERT_EQ(stopped_run.code, 0) << stopped_run.err;
  const json stopped = last_json_line(stopped_run.out).at("outputs").at(0);
  const std::vector<int32_t> kept = stopped.at("tokens").get<std::vector<int32_t>>();
  EXPECT_EQ(stopped.at("text"), text.substr(0, text.find(stop)));
  EXPECT_EQ(stopped.at("finish_reason"), "stop");
  EXPECT_EQ(stopped.at("stop_string"), stop);
  ASSERT_FALSE(kept.empty());
  ASSERT_LE(kept.size(), all.size());
  EXPECT_EQ(kept, std::vector<int32_t>(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(kept.size())));
  EXPECT_NE(decoded(kept).find(stop), std::string::npos) << "the last token completes the stop string";
  EXPECT_EQ(decoded(std::vector<int32_t>(kept.begin(), kept.end() - 1)).find(stop), std::string::npos)
      << "a token earlier had completed it already";

  // The text form: the prompt's text, the streamed text, then the ids with the finish reason.
  const Result streamed = run("generate " + kTextModel + common + " --stop '" + stop + "'");
  ASSERT_EQ(streamed.code, 0) << streamed.err;
  EXPECT_NE(streamed.out.find("[0] text: Hello world" + stopped.at("text").get<std::string>() + "\n[0] 15496,995 -> " +
                              ids_text(kept) + " (stop)\n"),
            std::string::npos)
      << streamed.out;
  const Result plain = run("generate " + kTextModel + common);
  EXPECT_NE(plain.out.find("[0] text: Hello world" + text + "\n[0] 15496,995 -> " + ids_text(all) + "\n"),
            std::string::npos)
      << plain.out;
}

// Three prompts in one batch stream in prompt order, each its whole text, the same as --json's;
// \n in --stop is a newline.
TEST(GenerateText, BatchedPromptsPrintInOrder) {
  const std::string prompts = temp_path("text_prompts.txt");
  std::ofstream(prompts) << "The cat\nOnce upon a time\n\xC3\xA9t\xC3\xA9 \xF0\x9F\x98\x80\n";
  const std::string common = " --prompt-file " + prompts + " --batch-size 3 --max-new-tokens 12 --seed 3 --eos-id -1";
  const Result js = run("generate " + kTextModel + common + " --json --stop '\\n'");
  ASSERT_EQ(js.code, 0) << js.err;
  const json doc = last_json_line(js.out);
  EXPECT_EQ(doc.at("stop"), json::array({"\n"}));
  const Result text = run("generate " + kTextModel + common + " --stop '\\n'");
  ASSERT_EQ(text.code, 0) << text.err;
  size_t at = 0;
  const std::vector<std::string> starts = {"The cat", "Once upon a time", "\xC3\xA9t\xC3\xA9 \xF0\x9F\x98\x80"};
  for (size_t k = 0; k < 3; ++k) {
    const json& o = doc.at("outputs").at(k);
    const std::string line = "[" + std::to_string(k) + "] text: " + starts[k] + o.at("text").get<std::string>() + "\n";
    const size_t found = text.out.find(line, at);
    EXPECT_NE(found, std::string::npos) << "prompt " << k << " in order:\n" << text.out;
    if (found != std::string::npos) at = found + line.size();
    EXPECT_EQ(o.at("text").get<std::string>().find('\n'), std::string::npos);
  }
}

// The printed text between the header line and the speeds: what rank 0 streams.
std::string streamed_text(const std::string& out) {
  const size_t begin = out.find("[0] text: "), end = out.find("speed   ");
  return begin == std::string::npos || end == std::string::npos ? "" : out.substr(begin, end - begin);
}

// A stop string ends the same prompts at the same tokens over two pipeline stages times two
// data-parallel replicas (ZeRO-3) as on one rank, and rank 0 prints the same text and ids lines in
// the same order (the second replica's prompt after the first replica's).
TEST(GenerateText, StopStringsAndTheTextAreTheOneRankRunsOverStagesAndReplicas) {
  const std::string prompts = temp_path("text_prompts_layouts.txt");
  std::ofstream(prompts) << "The cat\nOnce upon a time\nIn the\n";
  const std::string common = " --prompt-file " + prompts + " --batch-size 1 --max-new-tokens 10 --seed 3 --eos-id -1";
  const Result free_run = run("generate " + kTextModel + common + " --json");
  ASSERT_EQ(free_run.code, 0) << free_run.err;
  const std::string stop = stop_from_middle(last_json_line(free_run.out).at("outputs").at(0).at("text"));
  ASSERT_FALSE(stop.empty());
  const std::string stopped = "generate " + kTextModel + common + " --stop '" + stop + "'";
  const Result one = run(stopped);
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_NE(streamed_text(one.out).find(" (stop)\n[1] text: "), std::string::npos) << one.out;
  const Result spread = run(stopped + " --set pipeline.stages=2 zero_optimization.stage=3", 4);
  ASSERT_EQ(spread.code, 0) << spread.err;
  EXPECT_EQ(streamed_text(spread.out), streamed_text(one.out));
}

TEST(GenerateText, StopStringsNeedATokenizerAndText) {
  const GoldenRun& g = golden("gpt2");
  const std::string config = write_config("gpt2_stop.json", config_of(g));
  expect_one_line_rejection(run("generate " + config + " --prompt-ids 1,2 --stop x"),
                            "--stop: stop strings are text, and no tokenizer is named");
  expect_one_line_rejection(run("generate " + kTextModel + " --prompt Hi --stop ''"), "an empty stop string");
}

}  // namespace
