// optimizer.cpp — dispatch to the fused update kernels.
#include "optim/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "kernels/device.hpp"
#include "kernels/reduce.hpp"
#include "optim/onebit.hpp"

namespace zero3d {

namespace {
constexpr int64_t kChunk = 16384;  // elements widened at a time: 64 KiB of fp32 per array, stays in L2
// On a GPU each chunk's passes are kernel launches (~4 µs each): 16,384-element chunks made a
// 124M-parameter bf16 step 7,600 chunks and 59 ms of an H100's 192 ms step (flops profiler,
// step phase). There, a pass needing no scratch covers the whole array and one that widens into
// scratch takes 4M elements (16 MiB of fp32 per array).
constexpr int64_t kDeviceChunk = int64_t(1) << 22;

// One step over fp32 arrays.
void apply(const ElementwiseStep& s, float* p, const float* g, float* const* st, int64_t n, bool on_host) {
  switch (s.type) {
    case OptimizerType::Adam:
      if (on_host) kernels::cpu_adam_update(p, g, st[0], st[1], n, s.adam);
      else kernels::adam_update(p, g, st[0], st[1], n, s.adam);
      return;
    case OptimizerType::Lion:
      if (on_host) kernels::cpu_lion_update(p, g, st[0], n, s.lion);
      else kernels::lion_update(p, g, st[0], n, s.lion);
      return;
    case OptimizerType::Adagrad:
      if (on_host) kernels::cpu_adagrad_update(p, g, st[0], n, s.adagrad);
      else kernels::adagrad_update(p, g, st[0], n, s.adagrad);
      return;
    case OptimizerType::SGD:
      kernels::sgd_update(p, g, st[0], n, s.sgd);
      return;
    case OptimizerType::Lamb:
    case OptimizerType::OneBitAdam:
    case OptimizerType::ZeroOneAdam:
    case OptimizerType::OneBitLamb:
      break;
  }
  throw std::logic_error("Lamb's trust ratio and the 1-bit optimizers' compression need whole tensors: no elementwise step");
}
}  // namespace

ElementwiseStep make_elementwise_step(const OptimizerConfig& cfg, int64_t step, double lr,
                                      std::optional<std::pair<double, double>> betas, bool cpu_optimizer) {
  const double beta1 = betas ? betas->first : cfg.beta1;
  const double beta2 = betas ? betas->second : cfg.beta2;
  ElementwiseStep s;
  s.type = cfg.type;
  switch (cfg.type) {
    case OptimizerType::Adam:
      s.adam = kernels::make_adam_step(lr, beta1, beta2, cfg.eps, cfg.weight_decay, step, cfg.bias_correction,
                                       cfg.adam_w_mode);
      break;
    case OptimizerType::Lion:
      s.lion = {static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
                static_cast<float>(cfg.weight_decay)};
      break;
    case OptimizerType::Adagrad:
      // torch.optim.Adagrad: clr = lr / (1 + (step - 1) * lr_decay); DeepSpeedCPUAdagrad has no
      // lr_decay (the config reader refuses one with offload), so the same line gives it lr.
      s.adagrad = {static_cast<float>(lr / (1.0 + double(step - 1) * cfg.lr_decay)), static_cast<float>(cfg.eps),
                   static_cast<float>(cfg.weight_decay), !cpu_optimizer};
      break;
    case OptimizerType::SGD:
      s.sgd = {static_cast<float>(lr), static_cast<float>(cfg.momentum), static_cast<float>(cfg.dampening),
               static_cast<float>(cfg.weight_decay), cfg.nesterov, step == 1};
      break;
    case OptimizerType::Lamb:
    case OptimizerType::OneBitAdam:
    case OptimizerType::ZeroOneAdam:
    case OptimizerType::OneBitLamb:
      break;
  }
  return s;
}

std::vector<std::string> optimizer_state_names(const OptimizerConfig& cfg) {
  switch (cfg.type) {
    case OptimizerType::SGD:
      return cfg.momentum != 0.0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
    case OptimizerType::Lion:
      return {"exp_avg"};
    case OptimizerType::Adagrad:
      return {"exp_avg_sq"};
    case OptimizerType::OneBitLamb:
      // DeepSpeed's state keys; the last three are one value per tensor (onebit.hpp)
      return {"exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "lamb_coeff_freeze", "last_factor", "scaling_coeff"};
    case OptimizerType::Adam:
    case OptimizerType::Lamb:
    case OptimizerType::OneBitAdam:
    case OptimizerType::ZeroOneAdam:
      break;
  }
  return {"exp_avg", "exp_avg_sq"};
}

void ElementwiseUpdater::run(const ElementwiseStep& s, TypedSpan params, const void* grads, DType grad_type,
                             float grad_mul, const std::vector<TypedSpan>& states, int64_t n, bool on_host,
                             TypedSpan rounded, int64_t rounded_n) {
  if (states.size() > 2) throw std::logic_error("an elementwise optimizer keeps at most two states");
  bool fp32_states = params.type == DType::F32;
  for (const TypedSpan& t : states) fp32_states = fp32_states && t.type == DType::F32;
  const bool all_fp32 = fp32_states && grad_type == DType::F32 && grad_mul == 1.0f;
  // Mixed precision's common case: Adam's kernel widens the 16-bit gradient itself.
  const bool adam_widens = s.type == OptimizerType::Adam && !on_host && fp32_states &&
                           (grad_type == DType::BF16 || grad_type == DType::F16);
  const bool scratch_free = fp32_states && (adam_widens || (grad_type == DType::F32 && grad_mul == 1.0f));
  const int64_t chunk = (all_fp32 && !rounded.data) || (kernels::kGpuBuild && scratch_free) ? std::max<int64_t>(n, 1)
                        : kernels::kGpuBuild                                                ? kDeviceChunk
                                                                                            : kChunk;
  // The host's step (the CPU optimizers over an offload tier) converts on the host thread.
  auto convert = [on_host](void* dst, DType dt, const void* src, DType st, int64_t c, float mul = 1.0f) {
    if (on_host) convert_on_host(dst, dt, src, st, c, mul);
    else convert_any(dst, dt, src, st, c, mul);
  };
  // Elements [a, a + c) of an array as fp32: the array itself, or a widened copy in `scratch`.
  auto fp32 = [&](TypedSpan t, int64_t a, int64_t c, WidenScratch& scratch, float mul = 1.0f) -> float* {
    char* at = static_cast<char*>(t.data) + a * static_cast<int64_t>(dtype_size(t.type));
    if (t.type == DType::F32 && mul == 1.0f) return reinterpret_cast<float*>(at);
    float* widened = scratch.take(c, on_host);
    convert(widened, DType::F32, at, t.type, c, mul);
    return widened;
  };
  auto narrow = [&](TypedSpan t, int64_t a, int64_t c, const float* values) {
    if (t.type == DType::F32) return;  // updated where it lies
    convert(static_cast<char*>(t.data) + a * static_cast<int64_t>(dtype_size(t.type)), t.type, values, DType::F32, c);
  };
  for (int64_t a = 0; a < n; a += chunk) {
    const int64_t c = std::min(chunk, n - a);
    float* p = fp32(params, a, c, p_);
    float* st[2] = {nullptr, nullptr};
    for (size_t k = 0; k < states.size(); ++k) st[k] = fp32(states[k], a, c, st_[k]);
    if (adam_widens && grad_type == DType::BF16) {
      kernels::adam_update(p, static_cast<const kernels::bf16*>(grads) + a, grad_mul, st[0], st[1], c, s.adam);
    } else if (adam_widens) {
      kernels::adam_update(p, static_cast<const kernels::fp16*>(grads) + a, grad_mul, st[0], st[1], c, s.adam);
    } else {
      const float* g = fp32(TypedSpan{const_cast<void*>(grads), grad_type}, a, c, g_, grad_mul);
      apply(s, p, g, st, c, on_host);
    }
    narrow(params, a, c, p);
    for (size_t k = 0; k < states.size(); ++k) narrow(states[k], a, c, st[k]);
    if (rounded.data && a < rounded_n)
      convert(static_cast<char*>(rounded.data) + a * static_cast<int64_t>(dtype_size(rounded.type)), rounded.type, p,
              DType::F32, std::min(c, rounded_n - a));
  }
}

Optimizer::Optimizer(const OptimizerConfig& cfg, const ParamLayout& layout, DType state_type, Communicator* dp,
                     std::optional<Ranges> trainable)
    : cfg_(cfg), layout_(layout), state_type_(state_type), names_(optimizer_state_names(cfg)),
      trainable_(std::move(trainable)) {
  if ((cfg.type == OptimizerType::Lamb || cfg.one_bit()) && state_type != DType::F32)
    throw std::logic_error("Lamb and the 1-bit optimizers keep fp32 states");
  if ((cfg.type == OptimizerType::Lamb || cfg.one_bit()) && trainable_)
    throw std::logic_error("Lamb and the 1-bit optimizers update whole tensors, not trainable ranges");
  if (cfg.one_bit()) onebit_ = make_one_bit_optimizer(cfg, layout, dp);
  const int64_t n = state_elems();
  for (const std::string& name : names_) states_.emplace_back(name, state_type, n);
  if (cfg.type == OptimizerType::Adagrad && cfg.initial_accumulator_value != 0.0) {
    FlatBuffer init = make_scratch_buffer("adagrad_initial_accumulator", n);  // in model memory, as the state
    Kokkos::deep_copy(init, static_cast<float>(cfg.initial_accumulator_value));
    convert_any(states_[0].data(), state_type, init.data(), DType::F32, n);
  }
}

Optimizer::~Optimizer() = default;

bool Optimizer::backward_allreduce() const { return !onebit_ || onebit_->backward_allreduce(step_count_ + 1); }

void Optimizer::set_step_count(int64_t n) {
  step_count_ = n;
  if (onebit_) onebit_->loaded(n);
}

int64_t Optimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const TypedBuffer& b : states_) bytes += b.bytes();
  return bytes;
}

int64_t Optimizer::state_elems() const {
  if (!trainable_) return layout_.total();
  int64_t n = 0;
  for (const auto& [a, b] : *trainable_) n += b - a;
  return n;
}

std::vector<std::string> Optimizer::state_names() const { return names_; }

std::vector<TypedBuffer*> Optimizer::state_buffers() {
  std::vector<TypedBuffer*> out;
  for (TypedBuffer& b : states_) out.push_back(&b);
  return out;
}

void Optimizer::step(float* params, const float* grads, double lr, std::optional<std::pair<double, double>> betas) {
  step(params, grads, DType::F32, 1.0f, lr, betas);
}

void Optimizer::step(float* params, const void* grads, DType grad_type, float grad_mul, double lr,
                     std::optional<std::pair<double, double>> betas) {
  step(TypedSpan{params, DType::F32}, grads, grad_type, grad_mul, lr, betas);
}

void Optimizer::step(TypedSpan params, const void* grads, DType grad_type, float grad_mul, double lr,
                     std::optional<std::pair<double, double>> betas, TypedSpan rounded, int64_t rounded_n) {
  ++step_count_;
  const int64_t total = layout_.total();
  if (onebit_) return one_bit_step(params, grads, grad_type, grad_mul, lr, betas, rounded, rounded_n);
  if (cfg_.type != OptimizerType::Lamb) {
    const ElementwiseStep es = make_elementwise_step(cfg_, step_count_, lr, betas, /*cpu_optimizer=*/false);
    std::vector<TypedSpan> st;
    for (TypedBuffer& b : states_) st.push_back({b.data(), b.type()});
    if (!trainable_) {
      updater_.run(es, params, grads, grad_type, grad_mul, st, total, /*on_host=*/false, rounded, rounded_n);
      return;
    }
    // Each trainable range on its own, its states packed back to back; frozen elements are not read.
    auto at = [](TypedSpan t, int64_t i) {
      return TypedSpan{static_cast<char*>(t.data) + i * static_cast<int64_t>(dtype_size(t.type)), t.type};
    };
    const size_t gsize = dtype_size(grad_type);
    int64_t packed = 0;
    for (const auto& [a, b] : *trainable_) {
      std::vector<TypedSpan> sub;
      for (const TypedSpan& t : st) sub.push_back(at(t, packed));
      const int64_t cast_n = rounded.data ? std::clamp<int64_t>(rounded_n - a, 0, b - a) : 0;
      updater_.run(es, at(params, params_packed_ ? packed : a), static_cast<const char*>(grads) + a * static_cast<int64_t>(gsize), grad_type,
                   grad_mul, sub, b - a, /*on_host=*/false, cast_n > 0 ? at(rounded, a) : TypedSpan{}, cast_n);
      packed += b - a;
    }
    return;
  }
  if (params.type != DType::F32) throw std::logic_error("Lamb updates fp32 parameters");
  const double beta1 = betas ? betas->first : cfg_.beta1;
  const double beta2 = betas ? betas->second : cfg_.beta2;
  const auto s = kernels::make_lamb_step(lr, beta1, beta2, cfg_.eps, cfg_.weight_decay, step_count_,
                                         cfg_.bias_correction, cfg_.eps_inside_sqrt, cfg_.max_coeff, cfg_.min_coeff);
  float* p = static_cast<float*>(params.data);
  float* m = states_[0].as<float>();
  float* v = states_[1].as<float>();
  const size_t esize = dtype_size(grad_type);
  for (const TensorSpec& t : layout_.tensors()) {  // the trust ratio needs whole tensors
    const float* g = static_cast<const float*>(grads) + t.offset;
    if (grad_type != DType::F32 || grad_mul != 1.0f) {
      float* widened = widened_.take(t.numel, /*on_host=*/false);
      convert_any(widened, DType::F32, static_cast<const char*>(grads) + t.offset * esize, grad_type, t.numel, grad_mul);
      g = widened;
    }
    kernels::lamb_update(p + t.offset, g, m + t.offset, v + t.offset, t.numel, s);
  }
  if (rounded.data && rounded_n > 0) convert_any(rounded.data, rounded.type, p, DType::F32, rounded_n);
}

// The 1-bit step reads and writes whole tensors on the host (the packed signs and the
// collectives are host work): on a CPU build the arrays themselves, on a GPU build copies.
void Optimizer::one_bit_step(TypedSpan params, const void* grads, DType grad_type, float grad_mul, double lr,
                             std::optional<std::pair<double, double>> betas, TypedSpan rounded, int64_t rounded_n) {
  if (params.type != DType::F32) throw std::logic_error("the 1-bit optimizers update fp32 parameters");
  const int64_t n = layout_.total();
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  std::vector<float*> model = {static_cast<float*>(params.data)};  // the parameters, then the states
  for (TypedBuffer& b : states_) model.push_back(b.as<float>());
  host_.resize(model.size() + 1);
  std::vector<float*> host(model);
  if constexpr (!kernels::kHostIsDevice)
    for (size_t k = 0; k < model.size(); ++k) {
      host_[k].resize(static_cast<size_t>(n));
      kernels::copy_to_host(host_[k].data(), model[k], bytes);
      host[k] = host_[k].data();
    }
  // Gradients as fp32 (16-bit ones widened and multiplied by the unscale-and-clip factor).
  const float* g = static_cast<const float*>(grads);
  if (grad_type != DType::F32 || grad_mul != 1.0f || !kernels::kHostIsDevice) {
    float* widened = widened_.take(n, /*on_host=*/false);
    convert_any(widened, DType::F32, grads, grad_type, n, grad_mul);
    g = widened;
    if constexpr (!kernels::kHostIsDevice) {
      std::vector<float>& gh = host_.back();
      gh.resize(static_cast<size_t>(n));
      kernels::copy_to_host(gh.data(), widened, bytes);
      g = gh.data();
    }
  }
  const double beta1 = betas ? betas->first : cfg_.beta1, beta2 = betas ? betas->second : cfg_.beta2;
  onebit_->step(step_count_, host[0], g, host.data() + 1, lr, beta1, beta2);
  if constexpr (!kernels::kHostIsDevice)
    for (size_t k = 0; k < model.size(); ++k) kernels::copy_to_device(model[k], host[k], bytes);
  if (rounded.data && rounded_n > 0) convert_any(rounded.data, rounded.type, model[0], DType::F32, rounded_n);
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
