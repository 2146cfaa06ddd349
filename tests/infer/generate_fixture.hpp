// generate_fixture.hpp — the generation goldens (tests/golden/make_generate_goldens.py: GPT-2 and
// the Llama family in plain PyTorch with a KV cache of their own) and a parameter store over their
// weights in fp32 or bf16, for the in-process generation tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "config/config.hpp"
#include "io/h5.hpp"
#include "io/weights.hpp"
#include "kernels/half.hpp"
#include "kernels/memory.hpp"
#include "model/model.hpp"
#include "train/estimator.hpp"

namespace gen_test {

using namespace zero3d;

inline std::string golden_path(const std::string& family) {
  return std::string(ZERO3D_GOLDEN_DIR) + "/generate_" + family + ".h5";
}

// One golden model: its shape (from the zero3d model section the file records), the prompts,
// PyTorch's greedy continuations and the last position's logits before each new token.
struct Golden {
  std::string family, path;
  nlohmann::json model;  // the model section
  GPTShape shape;
  std::vector<std::vector<int32_t>> prompts, greedy;
  std::vector<std::vector<float>> logits;  // per prompt: [new_tokens][V]
  int64_t new_tokens = 0;
};

inline Golden load_golden(const std::string& family) {
  Golden g;
  g.family = family;
  g.path = golden_path(family);
  const h5::File f = h5::File::open_read(g.path);
  std::string text;
  EXPECT_TRUE(h5::read_attribute(f.id(), "config", text));
  g.model = nlohmann::json::parse(text);
  const Config c = read_config(nlohmann::json{{"train_batch_size", 1}, {"model", g.model}}, family + ".json", 1);
  g.shape = gpt_shape_of(c.model);
  int64_t prompts = 0;
  EXPECT_TRUE(h5::read_attribute(f.id(), "prompts", prompts));
  EXPECT_TRUE(h5::read_attribute(f.id(), "new_tokens", g.new_tokens));
  for (int64_t k = 0; k < prompts; ++k) {
    g.prompts.push_back(f.read_ints("golden/prompt_" + std::to_string(k)));
    g.greedy.push_back(f.read_ints("golden/greedy_" + std::to_string(k)));
    g.logits.push_back(f.read_floats("golden/logits_" + std::to_string(k)));
  }
  return g;
}

// Whole parameters in model memory, fp32 or rounded to bf16 (as a bf16 run holds them).
class TypedStore : public ParamStore {
 public:
  TypedStore(const GPT& model, const std::string& weights, DType type) : units_(model.units()), type_(type) {
    const int64_t n = model.num_params();
    std::vector<float> host(static_cast<size_t>(n));
    load_weights(weights, model.layout(), host.data());
    if (type == DType::F32) {
      f32_ = Kokkos::View<float*>("params", n);
      kernels::copy_to_device(f32_.data(), host.data(), host.size() * sizeof(float));
    } else {
      std::vector<kernels::bf16> b(host.size());
      for (size_t i = 0; i < host.size(); ++i) b[i] = kernels::to_bf16(host[i]);
      b16_ = Kokkos::View<kernels::bf16*>("params", n);
      kernels::copy_to_device(b16_.data(), b.data(), b.size() * sizeof(kernels::bf16));
    }
  }
  const void* fetch(int u) override {
    const int64_t o = units_[static_cast<size_t>(u)].offset;
    return type_ == DType::F32 ? static_cast<const void*>(f32_.data() + o) : static_cast<const void*>(b16_.data() + o);
  }
  void release(int) override {}
  float* grad_target(int) override { return nullptr; }
  void grads_done(int) override {}
  void progress() override {}

 private:
  std::vector<ParamUnit> units_;
  DType type_;
  Kokkos::View<float*> f32_;
  Kokkos::View<kernels::bf16*> b16_;
};

// max |got − want| against tol · max(1, max |want|); returns the difference.
inline double expect_close(const float* got, const float* want, size_t n, double tol, const std::string& what) {
  double worst = 0.0, scale = 1.0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    worst = std::isnan(d) ? INFINITY : std::max(worst, d);
    scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
  }
  EXPECT_LE(worst, tol * scale) << what << ": max |diff| " << worst << " (scale " << scale << ")";
  return worst;
}

inline const std::vector<std::string>& families() {
  static const std::vector<std::string> f = {"gpt2", "llama", "mistral", "qwen2"};
  return f;
}

}  // namespace gen_test
