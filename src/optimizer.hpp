// optimizer.hpp — the optimizer over one flat fp32 parameter buffer and its state.
//
// Adam keeps m and v, SGD a momentum buffer, LAMB m and v plus per-tensor trust ratios
// (LAMB normalises each named tensor on its own, hence the ParamLayout).
#pragma once

#include <optional>
#include <string>
#include <vector>
#include <utility>

#include "buffer.hpp"
#include "config.hpp"
#include "dtype.hpp"

namespace zero3d {

class Optimizer {
 public:
  Optimizer(const OptimizerConfig& cfg, const ParamLayout& layout);

  // One update with learning rate `lr`; `betas` overrides (beta1, beta2) for this step (OneCycle).
  void step(float* params, const float* grads, double lr,
            std::optional<std::pair<double, double>> betas = std::nullopt);
  // The same with gradients stored as grad_type and multiplied by grad_mul on the way in
  // (mixed precision: 16-bit gradients, DeepSpeed's combined unscale-and-clip factor).
  // They are widened in cache-sized chunks, so no fp32 copy of the gradient is kept.
  void step(float* params, const void* grads, DType grad_type, float grad_mul, double lr,
            std::optional<std::pair<double, double>> betas = std::nullopt);

  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t n) { step_count_ = n; }
  // Names of the state buffers, as checkpoints store them ("exp_avg", "exp_avg_sq" or
  // "momentum_buffer"), and the buffers themselves in the same order.
  std::vector<std::string> state_names() const;
  std::vector<FlatBuffer*> state_buffers();
  const OptimizerConfig& config() const { return cfg_; }
  // Bytes of optimizer state held (m, v or momentum).
  int64_t state_bytes() const;

 private:
  OptimizerConfig cfg_;
  const ParamLayout& layout_;
  FlatBuffer m_, v_;  // Adam/LAMB: first and second moments; SGD: m_ is the momentum buffer
  int64_t step_count_ = 0;
  std::vector<float> widened_;  // chunk (Adam, SGD) or tensor (LAMB) of widened gradients
};

// Global L2-norm clipping as torch.nn.utils.clip_grad_norm_ (DeepSpeed's fp32 path, FACTS §3):
// the factor max_norm / (norm + 1e-6) when that is < 1, else 1 (also when max_norm is 0: off).
double clip_coefficient(double norm, double max_norm);
// Clips a whole local gradient buffer; returns the norm before clipping.
double clip_grad_norm(float* grads, int64_t n, double max_norm);

}  // namespace zero3d
