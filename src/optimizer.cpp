// optimizer.cpp — dispatch to the fused update kernels.
#include "optimizer.hpp"

#include <cmath>

#include "optimizers.hpp"
#include "reduce.hpp"

namespace zero3d {

Optimizer::Optimizer(const OptimizerConfig& cfg, const ParamLayout& layout) : cfg_(cfg), layout_(layout) {
  const int64_t n = layout.total();
  if (cfg.type == OptimizerType::SGD) {
    if (cfg.momentum != 0.0) m_ = make_flat_buffer("momentum_buffer", n);
  } else {
    m_ = make_flat_buffer("exp_avg", n);
    v_ = make_flat_buffer("exp_avg_sq", n);
  }
}

int64_t Optimizer::state_bytes() const {
  return static_cast<int64_t>((m_.extent(0) + v_.extent(0)) * sizeof(float));
}

std::vector<std::string> Optimizer::state_names() const {
  if (cfg_.type == OptimizerType::SGD) return m_.extent(0) ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  return {"exp_avg", "exp_avg_sq"};
}

std::vector<FlatBuffer*> Optimizer::state_buffers() {
  if (cfg_.type == OptimizerType::SGD) return m_.extent(0) ? std::vector<FlatBuffer*>{&m_} : std::vector<FlatBuffer*>{};
  return {&m_, &v_};
}

void Optimizer::step(float* params, const float* grads, double lr, std::optional<std::pair<double, double>> betas) {
  ++step_count_;
  const double beta1 = betas ? betas->first : cfg_.beta1;
  const double beta2 = betas ? betas->second : cfg_.beta2;
  switch (cfg_.type) {
    case OptimizerType::Adam: {
      const auto s = kernels::make_adam_step(lr, beta1, beta2, cfg_.eps, cfg_.weight_decay, step_count_,
                                             cfg_.bias_correction, cfg_.adam_w_mode);
      kernels::adam_update(params, grads, m_.data(), v_.data(), layout_.total(), s);
      break;
    }
    case OptimizerType::Lamb: {
      const auto s = kernels::make_lamb_step(lr, beta1, beta2, cfg_.eps, cfg_.weight_decay, step_count_,
                                             cfg_.bias_correction, cfg_.eps_inside_sqrt, cfg_.max_coeff,
                                             cfg_.min_coeff);
      for (const TensorSpec& t : layout_.tensors())
        kernels::lamb_update(params + t.offset, grads + t.offset, m_.data() + t.offset, v_.data() + t.offset,
                             t.numel, s);
      break;
    }
    case OptimizerType::SGD: {
      const kernels::SgdStep s{static_cast<float>(lr), static_cast<float>(cfg_.momentum),
                               static_cast<float>(cfg_.dampening), static_cast<float>(cfg_.weight_decay),
                               cfg_.nesterov, step_count_ == 1};
      kernels::sgd_update(params, grads, m_.data(), layout_.total(), s);
      break;
    }
  }
}

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0;
  const double coef = max_norm / (norm + 1e-6);
  return coef < 1.0 ? coef : 1.0;
}

double clip_grad_norm(float* grads, int64_t n, double max_norm) {
  const double norm = std::sqrt(kernels::sum_of_squares(grads, n));
  const double coef = clip_coefficient(norm, max_norm);
  if (coef < 1.0) kernels::scale_in_place(grads, n, static_cast<float>(coef));
  return norm;
}

}  // namespace zero3d
