// test_llama_golden.cpp — the Llama-family model against PyTorch (tests/golden/make_llama_goldens.py:
// Hugging Face's LlamaForCausalLM written by hand in float64). Each golden carries the config.json
// a Hugging Face directory would hold; the model is built from it through model.hf_config, so the
// reader of Hugging Face configs is part of what is checked. From the same Hugging Face-named
// weights: logits, loss and every parameter's gradient, then 8 AdamW steps whose losses and
// gradient norms (before clipping) must stay within 1e-5 relative of PyTorch's.
//   llama_gqa       GQA 4/2, head_dim 16 != C/H, llama3 RoPE, untied head, clipping
//   llama_biases    attention_bias and mlp_bias, one K/V head, linear RoPE
//   qwen2_bias      q/k/v biases, tied head, a sliding window on layer 1 only
//   mistral_window  window 20 < T 72 (two attention row blocks), dynamic RoPE
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "config/config.hpp"
#include "io/h5.hpp"
#include "io/weights.hpp"
#include "model/model.hpp"
#include "optim/optimizer.hpp"
#include "support/golden_file.hpp"
#include "train/estimator.hpp"

using namespace zero3d;

namespace {

constexpr double kLossTolerance = 1e-5;  // relative, losses and gradient norms
constexpr float kTensorTolerance = 1e-5f;  // per-tensor max |diff| over max(1, max |reference|)

std::string golden_path(const std::string& name) { return std::string(ZERO3D_GOLDEN_DIR) + "/" + name + ".h5"; }

using test::read_doubles;

// The model section a golden's config.json gives, read as a run reads it (model.hf_config).
GPTShape shape_from_golden(const h5::File& f, int64_t B, int64_t T, const std::string& name) {
  std::string text;
  EXPECT_TRUE(h5::read_attribute(f.id(), "hf_config", text)) << name;
  const std::string path = ::testing::TempDir() + "zero3d_" + name + "_config.json";
  std::ofstream(path) << text;
  const nlohmann::json cfg = {{"train_batch_size", B},
                              {"model", {{"hf_config", path}, {"seq_length", T}}}};
  const Config c = read_config(cfg, name + ".json", 1);
  std::remove(path.c_str());
  return gpt_shape_of(c.model);
}

// max |got − want| over one tensor, against kTensorTolerance scaled by the tensor's size; printed.
void expect_tensor(const std::string& what, const float* got, const std::vector<float>& want) {
  double worst = 0.0, scale = 1.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    worst = std::isnan(d) ? INFINITY : std::max(worst, d);
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
  }
  std::printf("[ golden   ] %-48s max |diff| %.3g (scale %.3g)\n", what.c_str(), worst, scale);
  EXPECT_LE(worst, kTensorTolerance * scale) << what;
}

class LlamaGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const h5::File f = h5::File::open_read(golden_path(GetParam()));
    int64_t B = 0;
    ASSERT_TRUE(h5::read_attribute(f.id(), "batch", B));
    inputs_ = f.read_ints("golden/inputs");
    targets_ = f.read_ints("golden/targets");
    const int64_t T = static_cast<int64_t>(inputs_.size()) / B;
    shape_ = shape_from_golden(f, B, T, GetParam());
    ASSERT_TRUE(shape_.llama());
    model_ = std::make_unique<FlatModel>(shape_, B, T);
    load_weights(golden_path(GetParam()), model_->model.layout(), model_->params.data());
    B_ = B;
    T_ = T;
  }
  GPTShape shape_;
  int64_t B_ = 0, T_ = 0;
  std::unique_ptr<FlatModel> model_;
  std::vector<int32_t> inputs_, targets_;
};

TEST_P(LlamaGolden, LogitsAndLossMatchPyTorch) {
  const h5::File f = h5::File::open_read(golden_path(GetParam()));
  const float loss = model_->forward(inputs_.data(), targets_.data());
  const std::vector<float> logits = f.read_floats("golden/logits");
  ASSERT_EQ(logits.size(), static_cast<size_t>(B_ * T_ * shape_.vocab_size));
  expect_tensor(GetParam() + " logits", model_->model.logits(), logits);
  const double ref = f.read_floats("golden/loss")[0];
  EXPECT_NEAR(loss, ref, kLossTolerance * std::fabs(ref));
}

TEST_P(LlamaGolden, EveryParameterGradientMatchesPyTorch) {
  const h5::File f = h5::File::open_read(golden_path(GetParam()));
  model_->zero_grad();
  model_->forward(inputs_.data(), targets_.data());
  model_->backward(1.0f);
  for (const TensorSpec& t : model_->model.layout().tensors()) {
    const std::vector<float> ref = f.read_floats("golden/grads/" + t.name);
    ASSERT_EQ(ref.size(), static_cast<size_t>(t.numel)) << t.name;
    expect_tensor(t.name, model_->grads.data() + t.offset, ref);
  }
}

TEST_P(LlamaGolden, EightAdamWStepsFollowPyTorchLossesAndGradientNorms) {
  const h5::File f = h5::File::open_read(golden_path(GetParam()));
  const std::vector<double> losses = read_doubles(f, "golden/adamw_losses"), norms = read_doubles(f, "golden/grad_norms");
  const std::vector<double> hp = read_doubles(f, "golden/hparams");
  const OptimizerConfig oc = test::golden_adamw(hp);
  Optimizer opt(oc, model_->model.layout());
  for (size_t step = 0; step < losses.size(); ++step) {
    model_->zero_grad();
    const double loss = model_->forward(inputs_.data(), targets_.data());
    model_->backward(1.0f);
    const double norm = clip_grad_norm(model_->grads.data(), model_->model.num_params(), hp[5]);  // 0: no clipping
    std::printf("[ golden   ] %s step %zu: loss %.9f (PyTorch %.9f), grad norm %.9f (PyTorch %.9f)\n",
                GetParam().c_str(), step + 1, loss, losses[step], norm, norms[step]);
    EXPECT_NEAR(loss, losses[step], kLossTolerance * std::fabs(losses[step])) << "step " << step + 1;
    EXPECT_NEAR(norm, norms[step], kLossTolerance * norms[step]) << "step " << step + 1;
    opt.step(model_->params.data(), model_->grads.data(), oc.lr);
  }
}

INSTANTIATE_TEST_SUITE_P(PyTorch, LlamaGolden,
                         ::testing::Values("llama_gqa", "llama_biases", "qwen2_bias", "mistral_window"));

}  // namespace
