// typed_param_store.hpp — a model's parameters in its stored type (fp32, or bf16 rounded from the
// same fp32 draw) and its fp32 gradients, whole: what the model sees through ZeroOptimizer,
// without ZeRO, for tests that run GPT's forward and backward directly.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/half.hpp"
#include "model/model.hpp"

namespace zero3d {

class TypedParamStore : public ParamStore {
 public:
  TypedParamStore(const GPT& model, DType type, uint64_t seed)
      : TypedParamStore(model, type, initial_values(model, seed)) {}
  // The given fp32 values (a rank's slices of a whole model's draw), stored as `type`.
  TypedParamStore(const GPT& model, DType type, const std::vector<float>& values)
      : units_(model.units()), type_(type) {
    if (type == DType::F32) f32_ = values;
    for (float x : values) b16_.push_back(kernels::to_bf16(x));
    grads_.assign(values.size(), 0.0f);
  }
  const void* fetch(int u) override {
    const int64_t o = units_[u].offset;
    return type_ == DType::F32 ? static_cast<const void*>(f32_.data() + o) : static_cast<const void*>(b16_.data() + o);
  }
  void release(int) override {}
  float* grad_target(int u) override { return grads_.data() + units_[u].offset; }
  void grads_done(int) override {}
  void progress() override {}
  const std::vector<float>& grads() const { return grads_; }

 private:
  static std::vector<float> initial_values(const GPT& model, uint64_t seed) {
    std::vector<float> init(static_cast<size_t>(model.num_params()));
    init_gpt_params(init.data(), model.layout(), model.shape(), seed);
    return init;
  }
  std::vector<ParamUnit> units_;
  DType type_;
  std::vector<float> f32_;
  std::vector<kernels::bf16> b16_;
  std::vector<float> grads_;
};

}  // namespace zero3d
