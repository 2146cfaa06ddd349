// test_sampling.cpp — sampling as Hugging Face's generate samples, against the reference's own
// warpers (tests/golden/make_generate_goldens.py warp: MinNewTokens, Temperature, TopK, TopP in
// GenerationMixin's order, softmax in float32) on fixed logits: the distribution within 1e-6,
// and the token each of a set of fixed uniforms draws (inverse CDF on both sides), exactly.
// Then what generation does with the draws: per-prompt streams make a prompt's sampled output
// independent of its batch, and the seed matters.
#include <gtest/gtest.h>

#include <set>

#include "base/errors.hpp"
#include "infer/generate.hpp"
#include "infer/generate_fixture.hpp"
#include "infer/sampling.hpp"

using namespace zero3d;
using namespace gen_test;

namespace {

std::vector<double> read_doubles(const h5::File& f, const std::string& name) {
  h5::Handle ds(H5Dopen2(f.id(), name.c_str(), H5P_DEFAULT), H5Dclose);
  h5::Handle space(H5Dget_space(ds.get()), H5Sclose);
  std::vector<double> out(static_cast<size_t>(H5Sget_simple_extent_npoints(space.get())));
  H5Dread(ds.get(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data());
  return out;
}

TEST(Sampling, WarpersGiveTheReferenceDistributionAndDraws) {
  const h5::File f = h5::File::open_read(golden_path("gpt2"));
  const std::vector<float> logits = f.read_floats("sampling/logits"), want = f.read_floats("sampling/probs");
  const std::vector<double> params = read_doubles(f, "sampling/params"), uniforms = read_doubles(f, "sampling/uniforms");
  const std::vector<int32_t> tokens = f.read_ints("sampling/tokens");
  const size_t cases = params.size() / 5, V = logits.size() / cases, U = uniforms.size();
  ASSERT_EQ(cases, 10u);
  std::vector<double> probs;
  for (size_t c = 0; c < cases; ++c) {
    infer::SamplingOptions o;
    o.temperature = params[c * 5];
    o.top_k = static_cast<int64_t>(params[c * 5 + 1]);
    o.top_p = params[c * 5 + 2];
    const int eos = static_cast<int>(params[c * 5 + 3]);
    const std::vector<int32_t> banned = eos >= 0 ? std::vector<int32_t>{eos} : std::vector<int32_t>{};
    infer::next_token_distribution(logits.data() + c * V, static_cast<int64_t>(V), o, banned, probs);
    const std::string what = "case " + std::to_string(c) + " (temperature " + std::to_string(o.temperature) +
                             ", top_k " + std::to_string(o.top_k) + ", top_p " + std::to_string(o.top_p) + ")";
    size_t kept = 0, want_kept = 0;
    for (size_t v = 0; v < V; ++v) {
      EXPECT_NEAR(probs[v], want[c * V + v], 1e-6) << what << " token " << v;
      kept += probs[v] > 0.0;
      want_kept += want[c * V + v] > 0.0f;
    }
    EXPECT_EQ(kept, want_kept) << what << ": tokens left after filtering";
    for (size_t u = 0; u < U; ++u)
      EXPECT_EQ(infer::draw(probs, uniforms[u]), tokens[c * U + u]) << what << " u " << uniforms[u];
  }
}

TEST(Sampling, TopKAndTopPKeepWhatTheyPromise) {
  // logits 0..9: probabilities rise with the id
  std::vector<float> logits(10);
  for (int i = 0; i < 10; ++i) logits[static_cast<size_t>(i)] = static_cast<float>(i);
  std::vector<double> p;
  infer::SamplingOptions o;
  o.top_k = 3;
  infer::next_token_distribution(logits.data(), 10, o, {}, p);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(p[static_cast<size_t>(i)] > 0, i >= 7) << "top_k 3, id " << i;
  // top_p: the smallest set of the most likely whose mass reaches p; 0.01 still keeps the argmax
  o.top_k = 0;
  o.top_p = 0.01;
  infer::next_token_distribution(logits.data(), 10, o, {}, p);
  EXPECT_DOUBLE_EQ(p[9], 1.0);
  o.top_p = 0.8;  // softmax(0..9): p9 = 0.632, p8 = 0.233 -> {8, 9} reaches 0.865
  infer::next_token_distribution(logits.data(), 10, o, {}, p);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(p[static_cast<size_t>(i)] > 0, i >= 8) << "top_p 0.8, id " << i;
  EXPECT_NEAR(p[9], 0.632 / 0.865, 1e-3);
  // a banned id (min_new_tokens' EOS) is never drawn, nor taken by argmax
  infer::next_token_distribution(logits.data(), 10, infer::SamplingOptions{}, {9}, p);
  EXPECT_EQ(p[9], 0.0);
  EXPECT_EQ(infer::argmax(logits.data(), 10, {9}), 8);
  EXPECT_EQ(infer::argmax(logits.data(), 10, {}), 9);
}

TEST(Sampling, OutOfRangeOptionsAreRefusedByName) {
  const auto refused = [](infer::SamplingOptions o, const std::string& option) {
    try {
      infer::check_sampling_options(o);
      ADD_FAILURE() << option << " accepted";
    } catch (const InputError& e) {
      EXPECT_EQ(std::string(e.what()).rfind(option, 0), 0u) << e.what();
    }
  };
  infer::SamplingOptions o;
  EXPECT_NO_THROW(infer::check_sampling_options(o));
  o.temperature = 0.0;
  refused(o, "--temperature");
  o.temperature = -1.0;
  refused(o, "--temperature");
  o = {};
  o.top_k = -1;
  refused(o, "--top-k");
  o = {};
  o.top_p = 0.0;
  refused(o, "--top-p");
  o.top_p = 1.5;
  refused(o, "--top-p");
}

// A prompt's draws come from its own stream (seed, prompt index): batched or alone, the same
// sampled tokens; another seed, other tokens.
TEST(Sampling, APromptsSampledTokensDependOnTheSeedNotOnItsBatch) {
  const Golden g = load_golden("llama");
  GPT model(g.shape, 1, 32);
  TypedStore store(model, g.path, DType::F32);
  infer::GenerationOptions o;
  o.sampling.temperature = 1.5;  // flat enough that draws vary
  o.sampling.top_k = 20;
  o.sampling.top_p = 0.95;
  o.max_new_tokens = 10;
  o.seed = 42;
  infer::GenerationStats stats;
  const auto together = infer::generate_all(model, store, g.prompts, 3, o, stats);
  const auto apart = infer::generate_all(model, store, g.prompts, 1, o, stats);
  const auto again = infer::generate_all(model, store, g.prompts, 2, o, stats);
  std::set<std::vector<int32_t>> seen;
  for (size_t k = 0; k < g.prompts.size(); ++k) {
    EXPECT_EQ(together[k].tokens, apart[k].tokens) << "prompt " << k;
    EXPECT_EQ(together[k].tokens, again[k].tokens) << "prompt " << k;
    EXPECT_EQ(together[k].tokens.size(), 10u);
    seen.insert(together[k].tokens);
  }
  o.seed = 43;
  const auto other = infer::generate_all(model, store, g.prompts, 3, o, stats);
  size_t differ = 0;
  for (size_t k = 0; k < g.prompts.size(); ++k) differ += other[k].tokens != together[k].tokens;
  EXPECT_GT(differ, 0u) << "seed 43 drew what seed 42 drew";
  size_t not_greedy = 0;
  for (size_t k = 0; k < g.prompts.size(); ++k) not_greedy += together[k].tokens != g.greedy[k];
  EXPECT_GT(not_greedy, 0u) << "sampling at temperature 1.5 gave the greedy continuations";
}

}  // namespace
