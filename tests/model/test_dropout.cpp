// test_dropout.cpp — dropout (kernels/dropout.hpp) against its independent references
// (tests/golden/make_dropout_goldens.py): the mask stream re-implemented in NumPy bit for bit,
// and AdamW steps of Hugging Face's GPT-2 (embd_pdrop, attn_pdrop, resid_pdrop) and Llama
// (attention_dropout) in float64 PyTorch with those masks: losses and gradient norms within
// 1e-5 relative. The masks keep 1 − p of a large tensor within the binomial spread, and a
// model that evaluates (or has every p 0) is the model without dropout, bit for bit. Causal
// attention alone with attn_pdrop in float64 PyTorch holds the fp32 kernels, the bf16 kernels
// (the same mask: within bf16 rounding) and the block-sparse kernels (the dense mask on the
// computed blocks) to one reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "config/config.hpp"
#include "config/model_shape.hpp"
#include "io/h5.hpp"
#include "io/weights.hpp"
#include "kernels/attention.hpp"
#include "kernels/attention_sparse.hpp"
#include "kernels/dropout.hpp"
#include "model/model.hpp"
#include "optim/optimizer.hpp"
#include "support/golden_file.hpp"

using namespace zero3d;
using namespace zero3d::kernels;

namespace {

constexpr double kTolerance = 1e-5;  // relative: losses and gradient norms
const std::string kGoldenDir = ZERO3D_GOLDEN_DIR;

using test::read_doubles;

const auto attr = test::group_attribute;

// mask ∘ 1 over `samples` rows of n elements (row b: sample b at position 0, elements 0..n-1).
std::vector<float> factors(const DropoutMask& m, int64_t samples, int64_t n) {
  Kokkos::View<float*> ones("ones", samples * n), out("out", samples * n);
  Kokkos::deep_copy(ones, 1.0f);
  dropout_rows(out.data(), ones.data(), m, 0, samples, 1, n);
  std::vector<float> host(static_cast<size_t>(samples * n));
  Kokkos::deep_copy(Kokkos::View<float*, Kokkos::HostSpace>(host.data(), host.size()), out);
  return host;
}

TEST(DropoutMask, EveryBitIsTheNumPyStreams) {
  const h5::File f = h5::File::open_read(kGoldenDir + "/dropout.h5");
  const std::vector<int32_t> keep = f.read_ints("mask/keep");  // [3, 4096]: seed 99, sample 5.., layer 3, site 1, p 0.3
  ASSERT_EQ(keep.size(), 3u * 4096u);
  const DropoutMask m = dropout_mask(0.3, 99, 5, 3, DropoutSite::Probabilities);
  const std::vector<float> got = factors(m, 3, 4096);
  int64_t kept = 0;
  for (size_t i = 0; i < keep.size(); ++i) {
    ASSERT_EQ(got[i] != 0.0f, keep[i] != 0) << "sample " << 5 + i / 4096 << " element " << i % 4096;
    if (keep[i]) {
      ASSERT_EQ(got[i], static_cast<float>(1.0 / 0.7));
    }
    kept += keep[i];
  }
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, 3 * 4096);
}

// Over 2^22 elements the kept count is Binomial(n, 1 − q), q = ⌊p·2²⁴⌋/2²⁴ (the comparison's
// exact drop probability): within 5 standard deviations, a bound a fair stream misses with
// probability below 1e-6. Each site, layer and sample draws its own bits.
TEST(DropoutMask, KeepsOneMinusPWithinTheBinomialSpread) {
  const int64_t n = int64_t(1) << 22;
  for (const double p : {0.05, 0.1, 0.5, 0.9}) {
    const DropoutMask m = dropout_mask(p, 7, 1000, 2, DropoutSite::MlpOutput);
    const std::vector<float> got = factors(m, 1, n);
    int64_t kept = 0;
    for (const float x : got) kept += x != 0.0f ? 1 : 0;
    const double q = std::floor(p * 16777216.0) / 16777216.0, mean = n * (1.0 - q), sd = std::sqrt(n * q * (1.0 - q));
    std::printf("[ dropout  ] p %.2f: kept %lld of %lld (expected %.0f ± %.0f)\n", p, (long long)kept, (long long)n,
                mean, sd);
    EXPECT_LE(std::fabs(kept - mean), 5.0 * sd) << "p " << p;
  }
  // distinct keys, distinct masks: about half of the p-0.5 bits differ
  const std::vector<float> a = factors(dropout_mask(0.5, 7, 0, 0, DropoutSite::Embedding), 1, 4096);
  for (const DropoutMask& other : {dropout_mask(0.5, 8, 0, 0, DropoutSite::Embedding),
                                   dropout_mask(0.5, 7, 1, 0, DropoutSite::Embedding),
                                   dropout_mask(0.5, 7, 0, 1, DropoutSite::Embedding),
                                   dropout_mask(0.5, 7, 0, 0, DropoutSite::AttentionOutput)}) {
    const std::vector<float> b = factors(other, 1, 4096);
    int differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += (a[i] != 0.0f) != (b[i] != 0.0f) ? 1 : 0;
    EXPECT_NEAR(differ, 2048, 5 * 32);  // Binomial(4096, 1/2): sd 32
  }
}

// The GPT-2 golden (gpt_tiny.h5) and its model with dropout probabilities.
struct Gpt2Golden {
  h5::File weights = h5::File::open_read(kGoldenDir + "/gpt_tiny.h5");
  int64_t B = 0, T = 0;
  GPTShape shape(const DropoutRates& rates) {
    GPTShape s = test::golden_gpt_shape(weights, B);
    T = s.n_positions;
    s.dropout = rates;
    return s;
  }
};

// Steps of AdamW on the golden batch, step s drawing samples s·B ...: the losses and norms
// against PyTorch's.
void expect_steps_follow_pytorch(FlatModel& model, const h5::File& weights, int64_t B, const std::string& name) {
  const h5::File f = h5::File::open_read(kGoldenDir + "/dropout.h5");
  const std::vector<double> losses = read_doubles(f, name + "/adamw_losses"), norms = read_doubles(f, name + "/grad_norms");
  const std::vector<int32_t> inputs = weights.read_ints("golden/inputs"), targets = weights.read_ints("golden/targets");
  const std::vector<double> hp = read_doubles(weights, "golden/hparams");
  const OptimizerConfig oc = test::golden_adamw(hp);
  Optimizer opt(oc, model.model.layout());
  ASSERT_EQ(losses.size(), 5u);
  for (size_t step = 0; step < losses.size(); ++step) {
    model.model.set_samples(static_cast<int64_t>(step) * B, /*training=*/true);
    model.zero_grad();
    const double loss = model.forward(inputs.data(), targets.data());
    model.backward(1.0f);
    const double norm = clip_grad_norm(model.grads.data(), model.model.num_params(), hp[5]);
    std::printf("[ golden   ] %s step %zu: loss %.9f (PyTorch %.9f), grad norm %.9f (PyTorch %.9f)\n", name.c_str(),
                step + 1, loss, losses[step], norm, norms[step]);
    EXPECT_NEAR(loss, losses[step], kTolerance * losses[step]) << name << " step " << step + 1;
    EXPECT_NEAR(norm, norms[step], kTolerance * norms[step]) << name << " step " << step + 1;
    opt.step(model.params.data(), model.grads.data(), oc.lr);
  }
}

TEST(DropoutGolden, Gpt2EmbeddingAttentionAndResidualDropoutFollowPyTorch) {
  const h5::File f = h5::File::open_read(kGoldenDir + "/dropout.h5");
  DropoutRates rates;
  rates.embd = attr(f, "gpt2", "embd");
  rates.attn = attr(f, "gpt2", "attn");
  rates.resid = attr(f, "gpt2", "resid");
  rates.seed = static_cast<uint64_t>(attr(f, "gpt2", "seed"));
  ASSERT_TRUE(rates.embd > 0 && rates.attn > 0 && rates.resid > 0);
  Gpt2Golden g;
  const GPTShape shape = g.shape(rates);
  FlatModel model(shape, g.B, g.T);
  load_weights(g.weights.path(), model.model.layout(), model.params.data());
  expect_steps_follow_pytorch(model, g.weights, g.B, "gpt2");
}

TEST(DropoutGolden, LlamaAttentionDropoutFromItsConfigFollowsPyTorch) {
  const h5::File f = h5::File::open_read(kGoldenDir + "/dropout.h5");
  const h5::File weights = h5::File::open_read(kGoldenDir + "/llama_gqa.h5");
  int64_t B = 0;
  ASSERT_TRUE(h5::read_attribute(weights.id(), "batch", B));
  const int64_t T = static_cast<int64_t>(weights.read_ints("golden/inputs").size()) / B;
  // the golden's config.json with attention_dropout, read as a run reads model.hf_config
  std::string text;
  ASSERT_TRUE(h5::read_attribute(weights.id(), "hf_config", text));
  nlohmann::json hf = nlohmann::json::parse(text);
  hf["attention_dropout"] = attr(f, "llama", "attn");
  const std::string path = ::testing::TempDir() + "zero3d_dropout_llama_config.json";
  std::ofstream(path) << hf.dump();
  const nlohmann::json cfg = {{"train_batch_size", B}, {"model", {{"hf_config", path}, {"seq_length", T}}}};
  GPTShape shape = gpt_shape_of(read_config(cfg, "llama_dropout.json", 1).model);
  std::remove(path.c_str());
  ASSERT_TRUE(shape.llama());
  ASSERT_EQ(shape.dropout.attn, 0.25);
  shape.dropout.seed = static_cast<uint64_t>(attr(f, "llama", "seed"));
  FlatModel model(shape, B, T);
  load_weights(weights.path(), model.model.layout(), model.params.data());
  expect_steps_follow_pytorch(model, weights, B, "llama");
}

// Forward and backward of the golden batch: logits and gradients.
struct Pass {
  std::vector<float> logits, grads;
};
Pass pass_of(const GPTShape& shape, int64_t B, int64_t T, bool training) {
  FlatModel model(shape, B, T);
  Gpt2Golden g;
  load_weights(g.weights.path(), model.model.layout(), model.params.data());
  const std::vector<int32_t> inputs = g.weights.read_ints("golden/inputs"), targets = g.weights.read_ints("golden/targets");
  model.model.set_samples(3 * B, training);
  model.zero_grad();
  model.forward(inputs.data(), targets.data());
  model.backward(1.0f);
  Pass p;
  p.logits.assign(model.model.logits(), model.model.logits() + B * T * shape.vocab_size);
  p.grads.assign(model.grads.data(), model.grads.data() + model.model.num_params());
  return p;
}

// dropout.h5's /attention/<case>: qkv, the upstream gradient, PyTorch's output and d(qkv), and
// the mask (seed, first sample, layer; first head 0).
struct AttentionGolden {
  int64_t B, T, C, H, block;
  std::vector<uint8_t> layout;
  std::vector<float> qkv, d_out, out, d_qkv;
  DropoutMask mask;
  explicit AttentionGolden(const std::string& name) {
    const h5::File f = h5::File::open_read(kGoldenDir + "/dropout.h5");
    const std::string g = "attention/" + name;
    const auto integer = [&](const char* key) { return static_cast<int64_t>(attr(f, g, key)); };
    B = integer("B"), T = integer("T"), C = integer("C"), H = integer("H");
    const std::vector<int32_t> lay = f.read_ints(g + "/layout");
    layout.assign(lay.begin(), lay.end());
    block = T / static_cast<int64_t>(std::lround(std::sqrt(static_cast<double>(lay.size() / H))));
    qkv = f.read_floats(g + "/qkv"), d_out = f.read_floats(g + "/d_out");
    out = f.read_floats(g + "/out"), d_qkv = f.read_floats(g + "/d_qkv");
    mask = dropout_mask(attr(f, g, "p"), static_cast<uint64_t>(integer("seed")), integer("first_sample"),
                        integer("layer"), DropoutSite::Probabilities);
  }
};

// The largest difference, relative to the reference's largest magnitude.
double worst(const std::vector<float>& got, const std::vector<float>& want) {
  double d = 0, m = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    d = std::max(d, std::fabs(static_cast<double>(got[i]) - want[i]));
    m = std::max(m, std::fabs(static_cast<double>(want[i])));
  }
  return d / m;
}

struct AttentionResult {
  std::vector<float> out, d_qkv;
};
// The dense kernels' forward and backward in `compute` (fp32, or bf16's tiled kernel under dropout).
AttentionResult dense_attention(const AttentionGolden& g, DType compute, const DropoutMask& mask) {
  const int64_t B = g.B, T = g.T, C = g.C, H = g.H;
  std::vector<float> att(std::max(B * H * T * T, attention_bf16_saved_floats(B * H, T, C / H, true)));
  std::vector<float> scratch(kRowBlock * T);
  AttentionResult r{std::vector<float>(B * T * C), std::vector<float>(B * T * 3 * C)};
  attention_forward(r.out.data(), att.data(), g.qkv.data(), B, T, C, H, compute, mask);
  attention_backward(r.d_qkv.data(), scratch.data(), g.d_out.data(), g.qkv.data(), att.data(), B, T, C, H, compute, mask);
  return r;
}

TEST(DropoutAttention, Fp32KernelsFollowPyTorch) {
  const AttentionGolden g("dense");
  const AttentionResult r = dense_attention(g, DType::F32, g.mask);
  EXPECT_LT(worst(r.out, g.out), 1e-5);
  EXPECT_LT(worst(r.d_qkv, g.d_qkv), 1e-5);
}

// bf16 products draw the fp32 kernels' bits: the output and gradients within bf16 rounding of
// the reference, where the same kernel without the mask is off by the dropout itself.
TEST(DropoutAttention, Bf16KernelsDrawTheFp32KernelsMaskWithinBf16Rounding) {
  const AttentionGolden g("dense");
  const AttentionResult r = dense_attention(g, DType::BF16, g.mask), plain = dense_attention(g, DType::BF16, {});
  const double out = worst(r.out, g.out), grad = worst(r.d_qkv, g.d_qkv);
  std::printf("[ bf16     ] attention with dropout: output %.2e, d(qkv) %.2e (without the mask %.2e, %.2e)\n", out,
              grad, worst(plain.out, g.out), worst(plain.d_qkv, g.d_qkv));
  EXPECT_LT(out, 2e-2);
  EXPECT_LT(grad, 2e-2);
  EXPECT_GT(worst(plain.out, g.out), 0.1);
  EXPECT_GT(worst(plain.d_qkv, g.d_qkv), 0.1);
}

// Block-sparse attention drops the computed blocks' probabilities with the dense mask at the
// global key: a DeepSpeed fixed layout (per-head patterns, blocks skipped inside each row), and
// the dense layout, which is the dense kernel's attention.
TEST(DropoutAttention, SparseKernelsDropTheComputedBlocksWithTheDenseMask) {
  for (const std::string name : {"fixed", "dense"}) {
    const AttentionGolden g(name);
    const int64_t B = g.B, T = g.T, C = g.C, H = g.H, nb = T / g.block;
    int64_t most = 0;  // the panels' stride: the most blocks any head computes
    for (int64_t h = 0; h < H; ++h) {
      int64_t on = 0;
      for (int64_t q = 0; q < nb; ++q)
        for (int64_t k = 0; k <= q; ++k) on += g.layout[(h * nb + q) * nb + k];
      most = std::max(most, on);
    }
    const int64_t stride = most * g.block * g.block;
    std::vector<float> out(B * T * C), att(B * H * stride), d_qkv(B * T * 3 * C);
    sparse_attention_forward(out.data(), att.data(), stride, g.qkv.data(), g.layout.data(), g.block, B, T, C, H, g.mask);
    sparse_attention_backward(d_qkv.data(), g.d_out.data(), g.qkv.data(), att.data(), stride, g.layout.data(), g.block,
                              B, T, C, H, g.mask);
    EXPECT_LT(worst(out, g.out), 1e-5) << name;
    EXPECT_LT(worst(d_qkv, g.d_qkv), 1e-5) << name;
  }
}

// Evaluation (zero3d eval, evaluation in training) runs the model without dropout whatever the
// probabilities; probabilities 0 are the model without dropout in training too.
TEST(Dropout, EvaluationAndZeroProbabilitiesAreTheModelWithoutDropoutBitForBit) {
  Gpt2Golden g;
  const GPTShape plain = g.shape({});
  DropoutRates rates;
  rates.embd = rates.attn = rates.resid = 0.3;
  rates.seed = 5;
  const GPTShape dropping = g.shape(rates);
  const Pass reference = pass_of(plain, g.B, g.T, true);
  const Pass eval = pass_of(dropping, g.B, g.T, false);
  EXPECT_EQ(eval.logits, reference.logits);
  EXPECT_EQ(eval.grads, reference.grads);
  rates.embd = rates.attn = rates.resid = 0.0;
  const Pass zero = pass_of(g.shape(rates), g.B, g.T, true);
  EXPECT_EQ(zero.logits, reference.logits);
  EXPECT_EQ(zero.grads, reference.grads);
  // and training with dropout is another computation (the check above can fail)
  EXPECT_NE(pass_of(dropping, g.B, g.T, true).logits, reference.logits);
}

}  // namespace
