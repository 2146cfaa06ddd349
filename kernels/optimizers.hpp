// optimizers.hpp — single-pass parameter updates over flat fp32 buffers.
//
// Adam/AdamW follow DeepSpeed FusedAdam (ops/adam/multi_tensor_adam.cu): mode 1 (adam_w_mode)
// adds weight_decay·p to the update; mode 0 adds it to the gradient (L2). LAMB follows
// DeepSpeed FusedLamb (csrc/lamb/fused_lamb_cuda_kernel.cu), per tensor: the trust ratio
// ‖p‖/‖update‖ is clamped to [min_coeff, max_coeff] and the bias correction is folded into
// the step size. SGD follows torch.optim.SGD (momentum buffer = grad on the first step).
#pragma once

#include <cmath>

#include "kernels/common.hpp"
#include "kernels/half.hpp"

namespace zero3d::kernels {

struct AdamStep {
  float lr, beta1, beta2, eps, weight_decay;
  float bias_correction1, bias_correction2;  // 1 - beta^step, or 1 when bias_correction is off
  bool adam_w_mode;
};

inline AdamStep make_adam_step(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                               bool bias_correction, bool adam_w_mode) {
  AdamStep s;
  s.lr = static_cast<float>(lr);
  s.beta1 = static_cast<float>(beta1);
  s.beta2 = static_cast<float>(beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(weight_decay);
  s.bias_correction1 = bias_correction ? static_cast<float>(1.0 - std::pow(beta1, step)) : 1.0f;
  s.bias_correction2 = bias_correction ? static_cast<float>(1.0 - std::pow(beta2, step)) : 1.0f;
  s.adam_w_mode = adam_w_mode;
  return s;
}

// The per-element constants of one Adam step.
struct AdamCoeffs {
  float b1, b2, omb1, omb2, inv_bc1, inv_sqrt_bc2, lr, eps, wd;
};

inline AdamCoeffs adam_coeffs(const AdamStep& s) {
  return {s.beta1, s.beta2, 1.0f - s.beta1, 1.0f - s.beta2, 1.0f / s.bias_correction1,
          1.0f / std::sqrt(s.bias_correction2), s.lr, s.eps, s.weight_decay};
}

// One element of the update, shared by the device kernel and the CPU loop so that they agree
// bit for bit. AdamW (mode 1): decay added to the update; Adam (mode 0): added to the gradient.
KOKKOS_INLINE_FUNCTION void adamw_element(float& p, float g, float& m, float& v, const AdamCoeffs& c) {
  const float mi = c.b1 * m + c.omb1 * g;
  const float vi = c.b2 * v + c.omb2 * g * g;
  m = mi;
  v = vi;
  const float denom = std::sqrt(vi) * c.inv_sqrt_bc2 + c.eps;
  p = p - c.lr * (mi * c.inv_bc1 / denom + c.wd * p);
}

KOKKOS_INLINE_FUNCTION void adam_l2_element(float& p, float grad, float& m, float& v, const AdamCoeffs& c) {
  const float g = grad + c.wd * p;
  const float mi = c.b1 * m + c.omb1 * g;
  const float vi = c.b2 * v + c.omb2 * g * g;
  m = mi;
  v = vi;
  const float denom = std::sqrt(vi) * c.inv_sqrt_bc2 + c.eps;
  p = p - c.lr * (mi * c.inv_bc1 / denom);
}

// One fused pass: reads p, g, m, v and writes p, m, v (28 bytes per parameter).
ZERO3D_KERNEL void adam_update(float* params, const float* grads, float* m, float* v, Index n, const AdamStep& s) {
  const AdamCoeffs c = adam_coeffs(s);
  if (s.adam_w_mode)
    Kokkos::parallel_for("adamw_update", range(n),
                         KOKKOS_LAMBDA(Index i) { adamw_element(params[i], grads[i], m[i], v[i], c); });
  else
    Kokkos::parallel_for("adam_l2_update", range(n),
                         KOKKOS_LAMBDA(Index i) { adam_l2_element(params[i], grads[i], m[i], v[i], c); });
}

// Mixed precision's update: the 16-bit gradient widened and multiplied by grad_mul as it is
// read (DeepSpeed's combined unscale-and-clip factor), so no fp32 gradient is written and read
// back. The arithmetic is adam_update's on to_float(g)·grad_mul, bit for bit.
template <typename G>
ZERO3D_KERNEL void adam_update(float* params, const G* grads, float grad_mul, float* m, float* v, Index n, const AdamStep& s) {
  const AdamCoeffs c = adam_coeffs(s);
  if (s.adam_w_mode)
    Kokkos::parallel_for("adamw_update", range(n), KOKKOS_LAMBDA(Index i) {
      adamw_element(params[i], to_float(grads[i]) * grad_mul, m[i], v[i], c);
    });
  else
    Kokkos::parallel_for("adam_l2_update", range(n), KOKKOS_LAMBDA(Index i) {
      adam_l2_element(params[i], to_float(grads[i]) * grad_mul, m[i], v[i], c);
    });
}

// DeepSpeedCPUAdam's update (FACTS-2 §3.5) for state held in host memory: the step counter is
// advanced before the call, bias corrections come from make_adam_step. It runs on the host
// execution space whatever the build's device, as one SIMD loop with a scalar tail. Per element
// it calls adam_update's own element functions (DeepSpeed's CPU kernel applies the decoupled
// decay as a separate multiply-add, a rounding difference only), so an offloaded run's losses
// equal the run without offload bit for bit.
inline void cpu_adam_update(float* __restrict params, const float* __restrict grads, float* __restrict m,
                            float* __restrict v, Index n, const AdamStep& s) {
  const AdamCoeffs c = adam_coeffs(s);
  if (s.adam_w_mode) {
#pragma omp simd
    for (Index i = 0; i < n; ++i) adamw_element(params[i], grads[i], m[i], v[i], c);
  } else {
#pragma omp simd
    for (Index i = 0; i < n; ++i) adam_l2_element(params[i], grads[i], m[i], v[i], c);
  }
}

struct LambStep {
  float lr, beta1, beta2, eps, weight_decay, max_coeff, min_coeff;
  float step_size;  // lr·sqrt(1-beta2^t)/(1-beta1^t) with bias correction, else lr
  bool eps_inside_sqrt;
};

inline LambStep make_lamb_step(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                               bool bias_correction, bool eps_inside_sqrt, double max_coeff, double min_coeff) {
  LambStep s{static_cast<float>(lr),        static_cast<float>(beta1),     static_cast<float>(beta2),
             static_cast<float>(eps),       static_cast<float>(weight_decay), static_cast<float>(max_coeff),
             static_cast<float>(min_coeff), static_cast<float>(lr),        eps_inside_sqrt};
  if (bias_correction)
    s.step_size = static_cast<float>(lr * std::sqrt(1.0 - std::pow(beta2, step)) / (1.0 - std::pow(beta1, step)));
  return s;
}

// Updates one tensor; returns the trust ratio it applied.
ZERO3D_KERNEL float lamb_update(float* params, const float* grads, float* m, float* v, Index n, const LambStep& s) {
  const float b1 = s.beta1, b2 = s.beta2, eps = s.eps, wd = s.weight_decay;
  const bool inside = s.eps_inside_sqrt;
  // Pass 1: moments, and the squared norms of the weights and of the raw update.
  double w2 = 0.0, u2 = 0.0;
  Kokkos::parallel_reduce(
      "lamb_moments", range(n),
      KOKKOS_LAMBDA(Index i, double& wsum, double& usum) {
        const float g = grads[i], p = params[i];
        const float mi = b1 * m[i] + (1.0f - b1) * g;
        const float vi = b2 * v[i] + (1.0f - b2) * g * g;
        m[i] = mi;
        v[i] = vi;
        const float denom = inside ? std::sqrt(vi + eps) : std::sqrt(vi) + eps;
        const float u = mi / denom + wd * p;
        wsum += static_cast<double>(p) * p;
        usum += static_cast<double>(u) * u;
      },
      w2, u2);
  const double wn = std::sqrt(w2), un = std::sqrt(u2);
  float coeff = 1.0f;
  if (wn != 0.0 && un != 0.0) {
    coeff = static_cast<float>(wn / un);
    coeff = coeff > s.max_coeff ? s.max_coeff : coeff;
    coeff = coeff < s.min_coeff ? s.min_coeff : coeff;
  }
  const float step = s.step_size * coeff;
  // Pass 2: apply the scaled update.
  Kokkos::parallel_for("lamb_apply", range(n), KOKKOS_LAMBDA(Index i) {
    const float p = params[i];
    const float denom = inside ? std::sqrt(v[i] + eps) : std::sqrt(v[i]) + eps;
    params[i] = p - step * (m[i] / denom + wd * p);
  });
  return coeff;
}

struct SgdStep {
  float lr, momentum, dampening, weight_decay;
  bool nesterov, first_step;  // first_step: the momentum buffer starts as the gradient
};

ZERO3D_KERNEL void sgd_update(float* params, const float* grads, float* momentum_buf, Index n, const SgdStep& s) {
  const float lr = s.lr, mu = s.momentum, damp = s.dampening, wd = s.weight_decay;
  const bool nesterov = s.nesterov, first = s.first_step, use_mom = s.momentum != 0.0f;
  Kokkos::parallel_for("sgd_update", range(n), KOKKOS_LAMBDA(Index i) {
    const float p = params[i];
    float d = grads[i] + wd * p;
    if (use_mom) {
      const float buf = first ? d : mu * momentum_buf[i] + (1.0f - damp) * d;
      momentum_buf[i] = buf;
      d = nesterov ? d + mu * buf : buf;
    }
    params[i] = p - lr * d;
  });
}

// Lion as DeepSpeed's FusedLion (csrc/lion/multi_tensor_lion.cu): c = b1·m + (1-b1)·g; the step
// is -lr where c > 0, else +lr (c == 0 steps up, as that kernel does); decoupled weight decay
// p·(1 - lr·wd) first; then m = b2·m + (1-b2)·g. DeepSpeedCPULion (csrc/lion/cpu_lion_impl.cpp)
// computes the same products but takes the sign with copysign, so it steps down where c is +0;
// the CPU loop below keeps FusedLion's rule so that an offloaded run equals the one without.
struct LionStep {
  float lr, beta1, beta2, weight_decay;
};

// The per-element constants of one Lion step, computed once (not per element: a compiler may
// contract 1 - lr·wd into a fused multiply-add in one loop and not in another).
struct LionCoeffs {
  float lr, b1, omb1, b2, omb2, after_decay;
};

inline LionCoeffs lion_coeffs(const LionStep& s) {
  return {s.lr, s.beta1, 1.0f - s.beta1, s.beta2, 1.0f - s.beta2, 1.0f - s.lr * s.weight_decay};
}

// One element, shared by the device kernel and the CPU loop so that they agree bit for bit.
// The multiply-adds are written as fmaf, as nvcc compiles FusedLion's, so that no compiler
// contracts them in a vector loop and not in its scalar remainder (that differs in the last bit).
KOKKOS_INLINE_FUNCTION void lion_element(float& p, float g, float& m, const LionCoeffs& c) {
  const float mi = m;
  const float u = fmaf(c.b1, mi, c.omb1 * g);
  p = fmaf(p, c.after_decay, u > 0.0f ? -c.lr : c.lr);
  m = fmaf(c.b2, mi, c.omb2 * g);
}

ZERO3D_KERNEL void lion_update(float* params, const float* grads, float* m, Index n, const LionStep& s) {
  const LionCoeffs c = lion_coeffs(s);
  Kokkos::parallel_for("lion_update", range(n), KOKKOS_LAMBDA(Index i) { lion_element(params[i], grads[i], m[i], c); });
}

// DeepSpeedCPULion's place (offload_optimizer): the same element on the host, one SIMD loop.
inline void cpu_lion_update(float* __restrict params, const float* __restrict grads, float* __restrict m, Index n,
                            const LionStep& s) {
  const LionCoeffs c = lion_coeffs(s);
#pragma omp simd
  for (Index i = 0; i < n; ++i) lion_element(params[i], grads[i], m[i], c);
}

// Adagrad as torch.optim.Adagrad (DeepSpeed's "adagrad" without offload): g' = g + wd·p;
// sum += g'²; p += -clr·(g' / (sqrt(sum) + eps)) (addcdiv's order), clr already holding lr_decay.
// Under offload DeepSpeed runs DeepSpeedCPUAdagrad (csrc/adagrad/cpu_adagrad.cpp), which adds the
// decay to the accumulated square only and steps with the raw gradient: decay_in_step false.
// Without weight decay the two are the same update, element for element.
struct AdagradStep {
  float clr, eps, weight_decay;
  bool decay_in_step = true;
};

// One element, shared by the device kernel and the CPU loop so that they agree bit for bit; the
// multiply-adds are fmaf, as DeepSpeedCPUAdagrad's AVX loop computes them, and so that no
// compiler contracts them in one loop and not in another.
KOKKOS_INLINE_FUNCTION void adagrad_element(float& p, float grad, float& sum, const AdagradStep& s) {
  const float g = fmaf(s.weight_decay, p, grad);
  const float si = fmaf(g, g, sum);
  sum = si;
  p = fmaf(-s.clr, (s.decay_in_step ? g : grad) / (std::sqrt(si) + s.eps), p);
}

ZERO3D_KERNEL void adagrad_update(float* params, const float* grads, float* sum, Index n, const AdagradStep& s) {
  Kokkos::parallel_for("adagrad_update", range(n),
                       KOKKOS_LAMBDA(Index i) { adagrad_element(params[i], grads[i], sum[i], s); });
}

// DeepSpeedCPUAdagrad's place (offload_optimizer): the same element on the host, one SIMD loop.
inline void cpu_adagrad_update(float* __restrict params, const float* __restrict grads, float* __restrict sum, Index n,
                               const AdagradStep& s) {
#pragma omp simd
  for (Index i = 0; i < n; ++i) adagrad_element(params[i], grads[i], sum[i], s);
}

}  // namespace zero3d::kernels
