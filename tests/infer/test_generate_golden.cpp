// test_generate_golden.cpp — generation against an independent PyTorch implementation
// (tests/golden/make_generate_goldens.py: GPT-2, Llama with GQA, Mistral with a sliding window,
// Qwen2 with q/k/v biases, a tied head and a window on one layer, each with its own KV cache):
//   * each prompt alone: the last position's logits before every new token within 1e-4 and the
//     greedy continuation token for token;
//   * the three prompts as one left-padded batch: every row's logits within 1e-5 of its unbatched
//     run's and the same continuation (padding masked, positions from each row's first token);
//   * generate_batch, the loop the CLI runs, gives the golden continuations in any batch size;
//     its TokenSink sees every token and may end a prompt (a stop string); vocab_limit bars ids;
//   * data-parallel replicas take contiguous blocks of the prompts, in order.
#include <gtest/gtest.h>

#include <map>

#include "infer/decoder.hpp"
#include "infer/generate.hpp"
#include "infer/generate_fixture.hpp"
#include "infer/sampling.hpp"

using namespace zero3d;
using namespace gen_test;

namespace {

constexpr double kGoldenTolerance = 1e-4;   // against PyTorch's float64, relative to the logits' scale
constexpr double kBatchTolerance = 1e-5;    // batched against unbatched, the same kernels

// Teacher-forced along `feed` (the golden continuation): the logits before each of N new tokens,
// per row, [N][rows·V].
std::vector<std::vector<float>> run(const GPT& model, ParamStore& store, const std::vector<std::vector<int32_t>>& prompts,
                                    const std::vector<std::vector<int32_t>>& feed, int64_t N) {
  size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());
  infer::Decoder dec(model, store, static_cast<int64_t>(prompts.size()), static_cast<int64_t>(longest) + N - 1);
  std::vector<std::vector<float>> steps;
  steps.push_back(dec.prefill(prompts));
  for (int64_t s = 0; s + 1 < N; ++s) {
    std::vector<int32_t> next;
    for (const auto& f : feed) next.push_back(f[static_cast<size_t>(s)]);
    steps.push_back(dec.decode(next));
  }
  return steps;
}

class GenerateGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(GenerateGolden, EachPromptAloneGivesPyTorchsLogitsAndGreedyTokens) {
  const Golden g = load_golden(GetParam());
  const int64_t V = g.shape.vocab_size, N = g.new_tokens;
  GPT model(g.shape, 1, g.shape.n_positions);
  TypedStore store(model, g.path, DType::F32);
  for (size_t k = 0; k < g.prompts.size(); ++k) {
    const auto steps = run(model, store, {g.prompts[k]}, {g.greedy[k]}, N);
    for (int64_t s = 0; s < N; ++s) {
      const float* got = steps[static_cast<size_t>(s)].data();
      expect_close(got, g.logits[k].data() + s * V, static_cast<size_t>(V), kGoldenTolerance,
                   g.family + " prompt " + std::to_string(k) + " step " + std::to_string(s));
      EXPECT_EQ(infer::argmax(got, V, {}), g.greedy[k][static_cast<size_t>(s)])
          << g.family << " prompt " << k << " step " << s;
    }
  }
}

TEST_P(GenerateGolden, LeftPaddedBatchEqualsEachPromptAlone) {
  const Golden g = load_golden(GetParam());
  const int64_t V = g.shape.vocab_size, N = g.new_tokens;
  GPT model(g.shape, 1, g.shape.n_positions);
  TypedStore store(model, g.path, DType::F32);
  const auto batched = run(model, store, g.prompts, g.greedy, N);  // prompts of 5, 2 and 7 tokens
  for (size_t k = 0; k < g.prompts.size(); ++k) {
    const auto alone = run(model, store, {g.prompts[k]}, {g.greedy[k]}, N);
    for (int64_t s = 0; s < N; ++s) {
      const float* row = batched[static_cast<size_t>(s)].data() + k * V;
      expect_close(row, alone[static_cast<size_t>(s)].data(), static_cast<size_t>(V), kBatchTolerance,
                   g.family + " row " + std::to_string(k) + " step " + std::to_string(s));
      EXPECT_EQ(infer::argmax(row, V, {}), g.greedy[k][static_cast<size_t>(s)]) << g.family << " row " << k;
    }
  }
}

// Greedy decoding of the golden's new tokens.
infer::GenerationOptions greedy_options(const Golden& g) {
  infer::GenerationOptions o;
  o.sampling.greedy = true;
  o.max_new_tokens = g.new_tokens;
  return o;
}

TEST_P(GenerateGolden, TheGenerationLoopGivesTheGreedyContinuationsInAnyBatchSize) {
  const Golden g = load_golden(GetParam());
  GPT model(g.shape, 1, g.shape.n_positions);
  TypedStore store(model, g.path, DType::F32);
  infer::GenerationOptions o = greedy_options(g);
  for (int64_t batch : {1, 2, 3}) {
    infer::GenerationStats stats;
    const auto out = infer::generate_all(model, store, g.prompts, batch, o, stats);
    ASSERT_EQ(out.size(), g.prompts.size());
    for (size_t k = 0; k < out.size(); ++k) {
      EXPECT_EQ(out[k].tokens, g.greedy[k]) << g.family << " batch " << batch << " prompt " << k;
      EXPECT_EQ(out[k].finish, infer::Finish::Length);
    }
    EXPECT_EQ(stats.prefill_tokens, 5 + 2 + 7);
    EXPECT_EQ(stats.decode_tokens, 3 * (g.new_tokens - 1));
  }
}

// EOS ends a row where it appears (and is returned, as Hugging Face returns it); min_new_tokens
// bans it until then, so the row takes the next most likely token instead.
TEST_P(GenerateGolden, EosEndsARowAndMinNewTokensHoldsItBack) {
  const Golden g = load_golden(GetParam());
  GPT model(g.shape, 1, g.shape.n_positions);
  TypedStore store(model, g.path, DType::F32);
  infer::GenerationOptions o = greedy_options(g);
  const int32_t eos = g.greedy[0][3];  // prompt 0's fourth new token
  o.eos = {eos};
  infer::GenerationStats stats;
  auto out = infer::generate_all(model, store, g.prompts, 3, o, stats);
  const auto first = std::find(g.greedy[0].begin(), g.greedy[0].end(), eos) - g.greedy[0].begin();
  EXPECT_EQ(out[0].tokens, std::vector<int32_t>(g.greedy[0].begin(), g.greedy[0].begin() + first + 1));
  EXPECT_EQ(out[0].finish, infer::Finish::Eos);
  for (size_t k = 1; k < 3; ++k) {  // the other rows run on, unchanged, to their own EOS if any
    const auto end = std::find(g.greedy[k].begin(), g.greedy[k].end(), eos);
    EXPECT_EQ(out[k].tokens, std::vector<int32_t>(g.greedy[k].begin(), end == g.greedy[k].end() ? end : end + 1));
  }
  o.min_new_tokens = first + 1;
  out = infer::generate_all(model, store, {g.prompts[0]}, 1, o, stats);
  ASSERT_GT(out[0].tokens.size(), static_cast<size_t>(first));
  EXPECT_EQ(std::vector<int32_t>(out[0].tokens.begin(), out[0].tokens.begin() + first),
            std::vector<int32_t>(g.greedy[0].begin(), g.greedy[0].begin() + first));
  EXPECT_NE(out[0].tokens[static_cast<size_t>(first)], eos) << "min_new_tokens lets EOS through";
}

// A TokenSink sees every token of every prompt as it is chosen, and its stop ends that prompt
// after the token (Finish::Stop) while the others run on; each prompt is finished once.
TEST_P(GenerateGolden, ASinkSeesEachTokenAndItsStopEndsThePrompt) {
  const Golden g = load_golden(GetParam());
  GPT model(g.shape, 1, g.shape.n_positions);
  TypedStore store(model, g.path, DType::F32);
  infer::GenerationOptions o = greedy_options(g);
  struct Sink : infer::TokenSink {
    std::map<int64_t, std::vector<int32_t>> seen;
    std::map<int64_t, int> finished_count;
    bool token(int64_t prompt, int32_t id) override {
      seen[prompt].push_back(id);
      return prompt == 1 && seen[prompt].size() == 2;  // prompt 1 stops after its second token
    }
    void finished(int64_t prompt, const infer::Generated& out) override {
      ++finished_count[prompt];
      EXPECT_EQ(out.tokens, seen[prompt]) << "prompt " << prompt;
    }
  } sink;
  infer::GenerationStats stats;
  const auto out = infer::generate_all(model, store, g.prompts, 3, o, stats, &sink);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[1].tokens, std::vector<int32_t>(g.greedy[1].begin(), g.greedy[1].begin() + 2));
  EXPECT_EQ(out[1].finish, infer::Finish::Stop);
  for (size_t k : {0u, 2u}) {
    EXPECT_EQ(out[k].tokens, g.greedy[k]) << "prompt " << k;
    EXPECT_EQ(out[k].finish, infer::Finish::Length);
  }
  for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(sink.finished_count[k], 1) << "prompt " << k;
  EXPECT_EQ(std::string(infer::finish_name(infer::Finish::Stop)), "stop");
}

// vocab_limit: ids from it on are never chosen (a padded vocabulary's rows without text); a limit
// of the whole vocabulary changes nothing.
TEST_P(GenerateGolden, AVocabularyLimitBarsTheIdsPastIt) {
  const Golden g = load_golden(GetParam());
  GPT model(g.shape, 1, g.shape.n_positions);
  TypedStore store(model, g.path, DType::F32);
  infer::GenerationOptions o;
  o.sampling = {false, 3.0, 0, 1.0};  // hot and unfiltered: every id is likely somewhere
  o.max_new_tokens = g.new_tokens;
  o.seed = 11;
  infer::GenerationStats stats;
  const auto free = infer::generate_all(model, store, g.prompts, 3, o, stats);
  o.vocab_limit = g.shape.vocab_size;
  const auto whole = infer::generate_all(model, store, g.prompts, 3, o, stats);
  o.vocab_limit = g.shape.vocab_size / 4;
  const auto limited = infer::generate_all(model, store, g.prompts, 3, o, stats);
  bool above = false;
  for (size_t k = 0; k < 3; ++k) {
    EXPECT_EQ(whole[k].tokens, free[k].tokens);
    for (int32_t id : free[k].tokens) above |= id >= o.vocab_limit;
    for (int32_t id : limited[k].tokens) EXPECT_LT(id, o.vocab_limit) << "prompt " << k;
  }
  EXPECT_TRUE(above) << "the unlimited run never went past the limit: the test shows nothing";
}

INSTANTIATE_TEST_SUITE_P(Families, GenerateGolden, ::testing::ValuesIn(families()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// Replica r of D generates prompts [first, last): the blocks follow each other in prompt order,
// cover every prompt once, and differ by at most one prompt, the longer ones first.
TEST(ReplicaPrompts, AreContiguousBlocksInOrder) {
  using Block = std::pair<int64_t, int64_t>;
  EXPECT_EQ(infer::replica_prompts(5, 2, 0), Block(0, 3));
  EXPECT_EQ(infer::replica_prompts(5, 2, 1), Block(3, 5));
  EXPECT_EQ(infer::replica_prompts(2, 4, 3), Block(2, 2));  // more replicas than prompts: an empty block
  for (int64_t P = 0; P < 10; ++P)
    for (int D = 1; D <= 4; ++D) {
      int64_t at = 0;
      for (int r = 0; r < D; ++r) {
        const Block b = infer::replica_prompts(P, D, r);
        EXPECT_EQ(b.first, at) << P << " prompts, replica " << r << " of " << D;
        EXPECT_EQ(b.second - b.first, P / D + (r < P % D ? 1 : 0)) << P << " prompts, replica " << r << " of " << D;
        at = b.second;
      }
      EXPECT_EQ(at, P);
    }
}

}  // namespace
