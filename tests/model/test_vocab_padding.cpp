// test_vocab_padding.cpp — model.make_vocab_size_divisible_by (Megatron's key): the embedding and
// the LM head hold the vocabulary padded to a multiple of it × t (_vocab_size_with_padding), the
// padding rows zero and masked out of the loss. At t = 1 the padded model gives the unpadded
// model's loss and every real gradient, and its padding rows a gradient of exactly zero, for GPT-2
// (tied head) and a Llama (untied lm_head). The tensor-parallel padding is
// tests/parallel/test_mpi_tensor_parallel.cpp's.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "config/config.hpp"
#include "config/model_shape.hpp"
#include "model/model.hpp"

using namespace zero3d;
using json = nlohmann::json;

namespace {

constexpr int64_t kB = 2, kT = 8;

// The shape a run builds from this model section (the config reader, then gpt_shape_of).
GPTShape shape_of(json model, int64_t multiple) {
  model["make_vocab_size_divisible_by"] = multiple;
  return gpt_shape_of(read_config(json{{"train_batch_size", kB}, {"model", model}}, "pad.json", 1).model);
}

// Megatron's _vocab_size_with_padding: V rounded up to a multiple of make_vocab_size_divisible_by × t;
// tensor rank r holds rows [r·Vp/t, (r + 1)·Vp/t), of them the ids below V real.
TEST(VocabPadding, PaddedSizeIsMegatronsAtEveryTensorDegree) {
  GPTShape s;
  s.vocab_size = 50257;
  s.n_head = 8;
  s.n_embd = 64;
  s.make_vocab_size_divisible_by = 128;
  const std::vector<int> whole = {0, static_cast<int>(s.n_layer) + 2};
  for (const auto& [t, padded] : std::vector<std::pair<int, int64_t>>{{1, 50304}, {2, 50432}, {4, 50688}, {8, 51200}}) {
    int64_t real = 0;
    for (int r = 0; r < t; ++r) {
      const ModelPart part = gpt_model_part(s, whole, 1, 0, t, r);
      EXPECT_EQ(part.vocab_padded, padded) << "t " << t;
      EXPECT_EQ(part.vocab_local, padded / t) << "t " << t;
      EXPECT_EQ(part.vocab_begin, r * padded / t) << "t " << t << " rank " << r;
      EXPECT_EQ(part.layout.find("wte.weight")->shape[0], padded / t) << "t " << t;
      real += part.vocab_real;
    }
    EXPECT_EQ(real, s.vocab_size) << "t " << t;
  }
  s.make_vocab_size_divisible_by = 1;  // today's: V itself at t = 1, a multiple of t beyond
  EXPECT_EQ(gpt_model_part(s, whole, 1, 0).vocab_padded, 50257);
  EXPECT_EQ(gpt_model_part(s, whole, 1, 0, 2, 0).vocab_padded, 50258);
  // the global layout (checkpoints, files) keeps V rows at any padding
  EXPECT_EQ(gpt_layout(s).find("wte.weight")->shape[0], 50257);
}

struct Family {
  std::string name;
  json model;
  int64_t multiple, padded;
};
void PrintTo(const Family& f, std::ostream* os) { *os << f.name; }

class PaddedHead : public ::testing::TestWithParam<Family> {};

TEST_P(PaddedHead, GivesTheUnpaddedLossAndGradientsAndZeroPaddingGradients) {
  const Family& f = GetParam();
  const GPTShape plain = shape_of(f.model, 1), padded = shape_of(f.model, f.multiple);
  FlatModel full(plain, kB, kT);
  init_gpt_params(full.params.data(), full.model.layout(), plain, 7);
  FlatModel pad(padded, kB, kT);
  const ModelPart& part = pad.model.part();
  ASSERT_EQ(part.vocab_padded, f.padded);
  ASSERT_EQ(full.model.part().vocab_padded, plain.vocab_size);
  // The same weights through the runs (as a run initialises and resumes); padding rows zero.
  Kokkos::deep_copy(pad.params, 0.0f);
  for (const LayoutSegment& r : part.global_runs(0, pad.model.num_params(), false))
    for (int64_t i = r.local_begin; i < r.local_end; ++i) pad.params(i) = full.params(r.global_begin + (i - r.local_begin));
  // every id, the last real one included, as a token and as a target
  Kokkos::View<int32_t*> tokens("tokens", kB * kT), targets("targets", kB * kT);
  for (int64_t i = 0; i < kB * kT; ++i) {
    tokens(i) = static_cast<int32_t>((i * 7 + 3) % plain.vocab_size);
    targets(i) = static_cast<int32_t>(plain.vocab_size - 1 - (i * 5) % plain.vocab_size);
  }
  full.zero_grad();
  pad.zero_grad();
  const float want = full.forward(tokens.data(), targets.data());
  full.backward(1.0f);
  const float got = pad.forward(tokens.data(), targets.data());
  pad.backward(1.0f);
  EXPECT_NEAR(got, want, 1e-6 * std::fabs(want)) << f.name;
  float worst = 0.0f;
  int64_t covered = 0;
  for (const LayoutSegment& r : part.global_runs(0, pad.model.num_params(), false))
    for (int64_t i = r.local_begin; i < r.local_end; ++i, ++covered)
      worst = std::max(worst, std::fabs(pad.grads(i) - full.grads(r.global_begin + (i - r.local_begin))));
  EXPECT_LE(worst, 1e-6f) << f.name;
  EXPECT_EQ(covered, full.model.num_params()) << f.name;  // every real element once
  // The padding rows (the embedding's, and an untied head's) get exactly zero.
  const int64_t C = plain.n_embd;
  int64_t padding = 0;
  for (const char* name : {"wte.weight", "model.embed_tokens.weight", "lm_head.weight"}) {
    const TensorSpec* ts = pad.model.layout().find(name);
    if (!ts) continue;
    for (int64_t row = part.vocab_real; row < part.vocab_local; ++row)
      for (int64_t c = 0; c < C; ++c, ++padding) ASSERT_EQ(pad.grads(ts->offset + row * C + c), 0.0f) << name << " row " << row;
  }
  EXPECT_EQ(padding, (f.model.value("tie_word_embeddings", true) ? 1 : 2) * (f.padded - plain.vocab_size) * C);
}

INSTANTIATE_TEST_SUITE_P(
    Families, PaddedHead,
    ::testing::Values(
        Family{"gpt2_128", json{{"vocab_size", 61}, {"n_positions", kT}, {"n_layer", 2}, {"n_head", 4}, {"n_embd", 16}},
               128, 128},
        Family{"gpt2_8", json{{"vocab_size", 61}, {"n_positions", kT}, {"n_layer", 2}, {"n_head", 4}, {"n_embd", 16}}, 8,
               64},
        Family{"llama_untied_128",
               json{{"architecture", "llama"}, {"vocab_size", 61}, {"hidden_size", 16}, {"intermediate_size", 24},
                    {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                    {"seq_length", kT}, {"max_position_embeddings", 64}, {"tie_word_embeddings", false}},
               128, 128}),
    [](const ::testing::TestParamInfo<Family>& info) { return info.param.name; });

}  // namespace
