// optimizer.cpp — dispatch to the fused update kernels.
#include "optimizer.hpp"

#include <cmath>

#include "optimizers.hpp"
#include "reduce.hpp"
#include "typed.hpp"

namespace zero3d {

Optimizer::Optimizer(const OptimizerConfig& cfg, const ParamLayout& layout) : cfg_(cfg), layout_(layout) {
  const int64_t n = layout.total();
  if (cfg.type == OptimizerType::SGD) {
    if (cfg.momentum != 0.0) m_ = make_flat_buffer("momentum_buffer", n);
  } else if (cfg.type == OptimizerType::Lion) {
    m_ = make_flat_buffer("exp_avg", n);
  } else if (cfg.type == OptimizerType::Adagrad) {
    v_ = make_flat_buffer("exp_avg_sq", n);  // torch's state "sum", DeepSpeedCPUAdagrad's name
    if (cfg.initial_accumulator_value != 0.0) {
      float* v = v_.data();
      const float init = static_cast<float>(cfg.initial_accumulator_value);
      for (int64_t i = 0; i < n; ++i) v[i] = init;
    }
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
  if (cfg_.type == OptimizerType::Lion) return {"exp_avg"};
  if (cfg_.type == OptimizerType::Adagrad) return {"exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}

std::vector<FlatBuffer*> Optimizer::state_buffers() {
  if (cfg_.type == OptimizerType::SGD) return m_.extent(0) ? std::vector<FlatBuffer*>{&m_} : std::vector<FlatBuffer*>{};
  if (cfg_.type == OptimizerType::Lion) return {&m_};
  if (cfg_.type == OptimizerType::Adagrad) return {&v_};
  return {&m_, &v_};
}

void Optimizer::step(float* params, const float* grads, double lr, std::optional<std::pair<double, double>> betas) {
  step(params, grads, DType::F32, 1.0f, lr, betas);
}

void Optimizer::step(float* params, const void* grads, DType grad_type, float grad_mul, double lr,
                     std::optional<std::pair<double, double>> betas) {
  ++step_count_;
  const double beta1 = betas ? betas->first : cfg_.beta1;
  const double beta2 = betas ? betas->second : cfg_.beta2;
  const bool direct = grad_type == DType::F32 && grad_mul == 1.0f;
  const size_t esize = dtype_size(grad_type);
  // Gradients [a, a+n) as fp32: the buffer itself, or a widened and scaled copy.
  auto fp32_grads = [&](int64_t a, int64_t n) -> const float* {
    if (direct) return static_cast<const float*>(grads) + a;
    if (widened_.size() < static_cast<size_t>(n)) widened_.resize(static_cast<size_t>(n));
    convert_any(widened_.data(), DType::F32, static_cast<const char*>(grads) + a * esize, grad_type, n, grad_mul);
    return widened_.data();
  };
  const int64_t total = layout_.total();
  const int64_t chunk = direct ? std::max<int64_t>(total, 1) : 16384;  // 64 KiB of fp32: stays in L2
  switch (cfg_.type) {
    case OptimizerType::Adam: {
      const auto s = kernels::make_adam_step(lr, beta1, beta2, cfg_.eps, cfg_.weight_decay, step_count_,
                                             cfg_.bias_correction, cfg_.adam_w_mode);
      for (int64_t a = 0; a < total; a += chunk) {
        const int64_t n = std::min(chunk, total - a);
        kernels::adam_update(params + a, fp32_grads(a, n), m_.data() + a, v_.data() + a, n, s);
      }
      break;
    }
    case OptimizerType::Lamb: {
      const auto s = kernels::make_lamb_step(lr, beta1, beta2, cfg_.eps, cfg_.weight_decay, step_count_,
                                             cfg_.bias_correction, cfg_.eps_inside_sqrt, cfg_.max_coeff,
                                             cfg_.min_coeff);
      for (const TensorSpec& t : layout_.tensors())  // the trust ratio needs whole tensors
        kernels::lamb_update(params + t.offset, fp32_grads(t.offset, t.numel), m_.data() + t.offset,
                             v_.data() + t.offset, t.numel, s);
      break;
    }
    case OptimizerType::Lion: {
      const kernels::LionStep s{static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
                                static_cast<float>(cfg_.weight_decay)};
      for (int64_t a = 0; a < total; a += chunk) {
        const int64_t n = std::min(chunk, total - a);
        kernels::lion_update(params + a, fp32_grads(a, n), m_.data() + a, n, s);
      }
      break;
    }
    case OptimizerType::Adagrad: {
      // torch.optim.Adagrad: clr = lr / (1 + (step - 1) * lr_decay)
      const kernels::AdagradStep s{static_cast<float>(lr / (1.0 + double(step_count_ - 1) * cfg_.lr_decay)),
                                   static_cast<float>(cfg_.eps), static_cast<float>(cfg_.weight_decay)};
      for (int64_t a = 0; a < total; a += chunk) {
        const int64_t n = std::min(chunk, total - a);
        kernels::adagrad_update(params + a, fp32_grads(a, n), v_.data() + a, n, s);
      }
      break;
    }
    case OptimizerType::SGD: {
      const kernels::SgdStep s{static_cast<float>(lr), static_cast<float>(cfg_.momentum),
                               static_cast<float>(cfg_.dampening), static_cast<float>(cfg_.weight_decay),
                               cfg_.nesterov, step_count_ == 1};
      for (int64_t a = 0; a < total; a += chunk) {
        const int64_t n = std::min(chunk, total - a);
        kernels::sgd_update(params + a, fp32_grads(a, n), m_.extent(0) ? m_.data() + a : nullptr, n, s);
      }
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
