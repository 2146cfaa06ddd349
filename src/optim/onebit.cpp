// onebit.cpp — the 1-bit optimizers' steps in DeepSpeed's fp32 arithmetic (onebit/{adam,zoadam,
// lamb}.py), element by element as its tensor operations are written: exp_avg.mul_(β1).add_(1−β1,
// g), exp_avg_sq.mul_(β2).addcmul_(1−β2, g, g), update = exp_avg/(exp_avg_sq.sqrt() + eps),
// update += wd·p (when wd > 0), p.add_(−lr·update); a Python scalar times a tensor is the scalar
// rounded to fp32, and .item() of an fp32 result is that float, widened.
#include "optim/onebit.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace zero3d {

// The step's hyper-parameters as DeepSpeed's tensor operations see them: Python floats rounded to fp32.
struct OneBitScalars {
  float b1, c1, b2, c2, eps, wd;
  OneBitScalars(const OptimizerConfig& cfg, double beta1, double beta2)
      : b1(static_cast<float>(beta1)), c1(static_cast<float>(1.0 - beta1)), b2(static_cast<float>(beta2)),
        c2(static_cast<float>(1.0 - beta2)), eps(static_cast<float>(cfg.eps)),
        wd(static_cast<float>(cfg.weight_decay)) {}
};

namespace {
// exp_avg.mul_(β1).add_(1 − β1, g)
void momentum(float* m, const float* g, int64_t n, float b1, float c1) {
  for (int64_t i = 0; i < n; ++i) m[i] = m[i] * b1 + c1 * g[i];
}
// exp_avg_sq.mul_(β2).addcmul_(1 − β2, g, g)
void variance(float* v, const float* g, int64_t n, float b2, float c2) {
  for (int64_t i = 0; i < n; ++i) v[i] = v[i] * b2 + c2 * g[i] * g[i];
}
// p.add_(−lr·(m/(sqrt(v)+eps) + wd·p)); 0/1 Adam's local steps add the same −lr·update to their
// accumulator (comm_buffer.add_(−lr·update)).
void adam_update(float* p, const float* m, const float* v, int64_t n, float eps, float wd, float neg_lr,
                 float* accumulator = nullptr) {
  for (int64_t i = 0; i < n; ++i) {
    float update = m[i] / (std::sqrt(v[i]) + eps);
    if (wd > 0.0f) update += wd * p[i];
    p[i] += neg_lr * update;
    if (accumulator) accumulator[i] += neg_lr * update;
  }
}
// fn(t, offset, numel) for each tensor of the layout that has elements (DeepSpeed's 1-bit Lamb
// filters empty parameters out; the others skip them in their loops).
template <class Fn>
void for_each_tensor(const ParamLayout& layout, Fn fn) {
  const std::vector<TensorSpec>& tensors = layout.tensors();
  for (size_t t = 0; t < tensors.size(); ++t)
    if (tensors[t].numel > 0) fn(t, tensors[t].offset, tensors[t].numel);
}
// x.pow(2).sum().sqrt() as an fp32 result (summed wide here)
float norm(const float* x, int64_t n) {
  double sq = 0.0;
  for (int64_t i = 0; i < n; ++i) sq += double(x[i]) * double(x[i]);
  return static_cast<float>(std::sqrt(sq));
}
}  // namespace

OneBitOptimizer::OneBitOptimizer(const OptimizerConfig& cfg, const ParamLayout& layout, Communicator* dp,
                                 size_t errors)
    : cfg_(cfg), layout_(layout), errors_(errors) {
  if (dp && dp->size() > 1) reduce_ = std::make_unique<CompressedAllReduce>(*dp);
}

bool OneBitOptimizer::backward_allreduce(int64_t step) const { return !onebit_past_freeze(step, cfg_.freeze_step); }

void OneBitOptimizer::loaded(int64_t) {
  for (OneBitErrors& e : errors_) e.reset();
}

bool onebit_past_freeze(int64_t step, int64_t freeze_step) {
  const int64_t previous = step - 1;
  return previous >= 2 && previous >= freeze_step;
}

std::unique_ptr<OneBitOptimizer> make_one_bit_optimizer(const OptimizerConfig& cfg, const ParamLayout& layout,
                                                        Communicator* dp) {
  switch (cfg.type) {
    case OptimizerType::OneBitAdam: return std::make_unique<OneBitAdam>(cfg, layout, dp);
    case OptimizerType::ZeroOneAdam: return std::make_unique<ZeroOneAdam>(cfg, layout, dp);
    case OptimizerType::OneBitLamb: return std::make_unique<OneBitLamb>(cfg, layout, dp);
    default: throw std::logic_error("make_one_bit_optimizer: not a 1-bit optimizer");
  }
}

// --- OneBitAdam (adam.py OnebitAdam.step) ----------------------------------------------------

OneBitAdam::OneBitAdam(const OptimizerConfig& cfg, const ParamLayout& layout, Communicator* dp)
    : OneBitOptimizer(cfg, layout, dp, layout.tensors().size()) {}

void OneBitAdam::step(int64_t step, float* p, const float* g, float* const* states, double lr, double beta1,
                      double beta2) {
  if (step == 1) return;  // the initialisation step: buffers set up, nothing updated (§5.3)
  const bool frozen = onebit_past_freeze(step, cfg_.freeze_step);
  const OneBitScalars k(cfg_, beta1, beta2);
  for_each_tensor(layout_, [&](size_t t, int64_t a, int64_t n) {
    float *mt = states[0] + a, *vt = states[1] + a;
    momentum(mt, g + a, n, k.b1, k.c1);
    if (!frozen) {
      variance(vt, g + a, n, k.b2, k.c2);
    } else if (reduce_) {
      // DeepSpeed: exp_avg.set_(compressed_allreduce(exp_avg, worker_error, server_error)); every
      // rank ends with the same momentum, v stays as it froze.
      reduce_->run(mt, n, errors_[t]);
    }
    adam_update(p + a, mt, vt, n, k.eps, k.wd, static_cast<float>(-lr));
  });
}

// --- ZeroOneAdam (zoadam.py ZeroOneAdam.step) --------------------------------------------------

ZeroOneAdam::ZeroOneAdam(const OptimizerConfig& cfg, const ParamLayout& layout, Communicator* dp)
    : OneBitOptimizer(cfg, layout, dp, layout.tensors().size()), schedule_(cfg) {}

bool ZeroOneAdamSchedule::frozen(int64_t step) const {
  // freeze_key is set at the end of a step whose count exceeds var_freeze_step (not of the
  // initialisation step, which returns first): step max(var_freeze_step, 1) + 1 still updates
  // the variance on its schedule; the steps after it are local.
  return step >= std::max<int64_t>(cfg_.var_freeze_step, 1) + 2;
}

bool ZeroOneAdamSchedule::backward_allreduce(int64_t step) const {
  // DeepSpeed switches the engine's all-reduce on at the end of step s − 1 when s % var_interval
  // == 0 (the interval after that step's bookkeeping), off otherwise and for good at the freeze;
  // the initialisation step leaves it at the engine's default, on.
  return step <= 1 || variance_step(step);
}

void ZeroOneAdamSchedule::count(int64_t step) {
  if (!frozen(step)) {
    if (step % var_interval_ == 0 && ++var_counter_ == cfg_.var_update_scaler) {
      var_counter_ = 0;
      var_interval_ *= 2;
    }
  } else if (++local_counter_ == cfg_.local_step_scaler) {
    local_counter_ = 0;
    local_interval_ = std::min(cfg_.local_step_clipper, local_interval_ * 2);
  }
}

void ZeroOneAdamSchedule::replay(int64_t step) {
  var_interval_ = 1, var_counter_ = 0, local_interval_ = 1, local_counter_ = 0;
  for (int64_t s = 2; s <= step; ++s) count(s);  // the initialisation step (1) counts nothing
}

bool ZeroOneAdam::backward_allreduce(int64_t step) const { return schedule_.backward_allreduce(step); }

void ZeroOneAdam::count(int64_t step) {
  schedule_.count(step);
  // At the freeze DeepSpeed zeroes the error buffers once: from now on they hold the errors of
  // the accumulated updates, no longer of gradients (reinitial_error_buffer).
  if (frozen(step + 1) && !frozen(step))
    for (OneBitErrors& e : errors_) {
      std::fill(e.worker.begin(), e.worker.end(), 0.0f);
      std::fill(e.server.begin(), e.server.end(), 0.0f);
    }
}

void ZeroOneAdam::loaded(int64_t step) {
  OneBitOptimizer::loaded(step);
  // load_state_dict pops momentum_accumulator (lrs restarts with it); the intervals are replayed
  // from the initialisation step, as an unbroken run would have them.
  accumulator_.clear();
  lrs_ = 0.0;
  schedule_.replay(step);
}

void ZeroOneAdam::step(int64_t step, float* p, const float* g, float* const* states, double lr, double beta1,
                       double beta2) {
  if (step == 1) return;  // the initialisation step (§5.4)
  const bool local = frozen(step);
  const bool var_step = schedule_.variance_step(step);
  const bool sync = schedule_.sync_step(step);
  const OneBitScalars k(cfg_, beta1, beta2);
  const float neg_lr = static_cast<float>(-lr);
  if (local) {
    accumulator_.resize(static_cast<size_t>(layout_.total()), 0.0f);
    lrs_ += lr;
  }
  for_each_tensor(layout_, [&](size_t t, int64_t a, int64_t n) {
    float *pt = p + a, *mt = states[0] + a, *vt = states[1] + a;
    const float* gt = g + a;
    if (var_step) {  // the averaged gradient updates both moments
      variance(vt, gt, n, k.b2, k.c2);
      momentum(mt, gt, n, k.b1, k.c1);
    } else if (!local && reduce_) {
      // grad_onebit = compressed_allreduce(grad, ...); only m moves. (On one rank DeepSpeed
      // skips this branch, so m keeps its value between variance steps.)
      onebit_grad_.assign(gt, gt + n);
      reduce_->run(onebit_grad_.data(), n, errors_[t]);
      momentum(mt, onebit_grad_.data(), n, k.b1, k.c1);
    } else if (local) {
      momentum(mt, gt, n, k.b1, k.c1);
    }
    float* acc = local ? accumulator_.data() + a : nullptr;
    adam_update(pt, mt, vt, n, k.eps, k.wd, neg_lr, acc);
    if (!sync) return;
    // Synchronisation: undo the local progress, average it (scaled by sqrt(v)+eps, the same on
    // every rank) through the 1-bit all-reduce, re-derive m from it and apply it.
    for (int64_t i = 0; i < n; ++i) {
      pt[i] += -acc[i];
      acc[i] *= std::sqrt(vt[i]) + k.eps;
    }
    if (reduce_) reduce_->run(acc, n, errors_[t]);
    const float lrs = static_cast<float>(lrs_);
    for (int64_t i = 0; i < n; ++i) {
      mt[i] = -(acc[i] / lrs);
      pt[i] += acc[i] / (std::sqrt(vt[i]) + k.eps);
      acc[i] = 0.0f;
    }
  });
  if (sync) lrs_ = 0.0;
  count(step);
}

// --- OneBitLamb (lamb.py OnebitLamb.step) ------------------------------------------------------

OneBitLamb::OneBitLamb(const OptimizerConfig& cfg, const ParamLayout& layout, Communicator* dp)
    : OneBitOptimizer(cfg, layout, dp, 1),  // one error pair: the momenta travel as one flat buffer
      coeff_freeze_(layout.tensors().size(), 0.0),
      last_factor_(layout.tensors().size(), 1.0),
      scaling_(layout.tensors().size(), 0.0) {}

void OneBitLamb::loaded(int64_t step) {
  OneBitOptimizer::loaded(step);
  // load_state_dict: past the freeze the saved coefficients continue; during the warm-up
  // DeepSpeed resets lamb_coeff_freeze to 0 and last_factor to 1 and drops scaling_coeff.
  read_scalars_ = onebit_past_freeze(step + 1, cfg_.freeze_step);
  flat_.clear();  // exp_avg_flat is rebuilt, its tail zero
  std::fill(coeff_freeze_.begin(), coeff_freeze_.end(), 0.0);
  std::fill(last_factor_.begin(), last_factor_.end(), 1.0);
  std::fill(scaling_.begin(), scaling_.end(), 0.0);
}

void OneBitLamb::step(int64_t step, float* p, const float* g, float* const* st, double lr, double beta1,
                      double beta2) {
  if (step == 1) return;  // the initialisation step (§5.5): its all-reduce of zero momenta changes nothing
  if (read_scalars_)
    for_each_tensor(layout_, [&](size_t t, int64_t a, int64_t) {
      coeff_freeze_[t] = st[3][a], last_factor_[t] = st[4][a], scaling_[t] = st[5][a];
    });
  read_scalars_ = false;
  const OneBitScalars k(cfg_, beta1, beta2);
  if (onebit_past_freeze(step, cfg_.freeze_step)) compressed(p, g, st, lr, k);
  else warm_up(step, p, g, st, lr, k);
  // The per-tensor scalars over their tensors' elements: what a checkpoint saves.
  for_each_tensor(layout_, [&](size_t t, int64_t a, int64_t n) {
    std::fill(st[3] + a, st[3] + a + n, static_cast<float>(coeff_freeze_[t]));
    std::fill(st[4] + a, st[4] + a + n, static_cast<float>(last_factor_[t]));
    std::fill(st[5] + a, st[5] + a + n, static_cast<float>(scaling_[t]));
  });
}

void OneBitLamb::warm_up(int64_t step, float* p, const float* g, float* const* st, double lr, const OneBitScalars& k) {
  for_each_tensor(layout_, [&](size_t t, int64_t a, int64_t n) {
    float *pt = p + a, *m = st[0] + a, *v = st[1] + a;
    momentum(m, g + a, n, k.b1, k.c1);
    variance(v, g + a, n, k.b2, k.c2);
    if (step == cfg_.freeze_step) std::copy(v, v + n, st[2] + a);  // exp_avg_sq_fresh = exp_avg_sq.clone()
    update_.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      update_[i] = m[i] / (std::sqrt(v[i]) + k.eps);
      if (k.wd > 0.0f) update_[i] += k.wd * pt[i];
    }
    // LAMB's trust ratio ‖p‖/‖u‖, clamped; 1 when either norm is 0
    const float weight_norm = norm(pt, n), update_norm = norm(update_.data(), n);
    double coeff = 1.0;
    if (weight_norm != 0.0f && update_norm != 0.0f) {
      coeff = static_cast<double>(weight_norm / update_norm);
      if (coeff > cfg_.max_coeff) coeff = cfg_.max_coeff;
      if (coeff < cfg_.min_coeff) coeff = cfg_.min_coeff;
    }
    if (coeff != 1.0) coeff_freeze_[t] = cfg_.coeff_beta * coeff_freeze_[t] + (1.0 - cfg_.coeff_beta) * coeff;
    const float scale = static_cast<float>(-lr * coeff);
    for (int64_t i = 0; i < n; ++i) pt[i] += scale * update_[i];
  });
}

void OneBitLamb::compressed(float* p, const float* g, float* const* st, double lr, const OneBitScalars& k) {
  const int64_t total = layout_.total();
  float *m = st[0], *v = st[1], *v_fresh = st[2];
  last_m_.assign(m, m + total);  // exp_avg_last_step
  // At the first compressed step: each momentum's scale ‖m‖/sqrt(n) against their mean, so the
  // one flat all-reduce compresses momenta of one magnitude. (A momentum that is exactly zero
  // would divide by zero in DeepSpeed; it keeps a coefficient of 1 here.)
  if (std::all_of(scaling_.begin(), scaling_.end(), [](double s) { return s == 0.0; })) {
    std::vector<double> scales(scaling_.size(), 0.0);
    double sum = 0.0;
    int64_t count = 0;
    for_each_tensor(layout_, [&](size_t t, int64_t a, int64_t n) {
      scales[t] = static_cast<double>(norm(m + a, n) / static_cast<float>(std::sqrt(double(n))));
      sum += scales[t];
      ++count;
    });
    const double united = sum / static_cast<double>(count);
    for_each_tensor(layout_, [&](size_t t, int64_t, int64_t) { scaling_[t] = scales[t] > 0.0 ? united / scales[t] : 1.0; });
  }
  for_each_tensor(layout_, [&](size_t t, int64_t a, int64_t n) {
    momentum(m + a, g + a, n, k.b1, k.c1);
    const float s = static_cast<float>(scaling_[t]);
    for (int64_t i = 0; i < n; ++i) m[a + i] *= s;
  });
  if (reduce_) {
    // Every momentum in one 1-bit all-reduce, over DeepSpeed's exp_avg_flat: the momenta and a
    // zero-initialised tail up to the padded size, which the all-reduce overwrites in place and
    // which keeps its values into the next call (the tail is no parameter's momentum).
    const int64_t padded = onebit_padded_size(total, reduce_->comm().size());
    flat_.resize(static_cast<size_t>(padded), 0.0f);
    std::copy(m, m + total, flat_.begin());
    reduce_->run(flat_.data(), padded, errors_[0]);
    std::copy(flat_.begin(), flat_.begin() + total, m);
  }
  for_each_tensor(layout_, [&](size_t t, int64_t a, int64_t n) {
    float *pt = p + a, *mt = m + a, *vt = v + a, *ft = v_fresh + a;
    const float s = static_cast<float>(scaling_[t]);
    update_.resize(static_cast<size_t>(n));
    float factor32 = -std::numeric_limits<float>::infinity();
    double prelim_sq = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      mt[i] /= s;
      // the gradient the averaged momentum implies, for the fresh variance
      const float grad = (mt[i] - last_m_[a + i] * k.b1) / k.c1;
      ft[i] = ft[i] * k.b2 + k.c2 * grad * grad;
      const float denom = std::sqrt(vt[i]) + k.eps;
      const float prelim = mt[i] / denom;
      prelim_sq += double(prelim) * double(prelim);
      update_[i] = k.wd > 0.0f ? prelim + k.wd * pt[i] : prelim;
      factor32 = std::max(factor32, denom / (std::sqrt(ft[i]) + k.eps));
    }
    double factor = factor32;
    if (k.wd > 0.0f) {
      const double ratio =
          std::min(1.0, static_cast<double>(static_cast<float>(std::sqrt(prelim_sq)) / norm(update_.data(), n)));
      factor = factor * ratio + (1.0 - ratio);
    }
    if (factor > cfg_.factor_max) factor = cfg_.factor_max;
    if (factor < cfg_.factor_min) factor = cfg_.factor_min;
    const double up = last_factor_[t] * (1.0 + cfg_.factor_threshold), down = last_factor_[t] * (1.0 - cfg_.factor_threshold);
    if (factor > up) factor = up;
    if (factor < down) factor = down;
    last_factor_[t] = factor;
    const float scale = static_cast<float>(-lr * (coeff_freeze_[t] * factor));
    for (int64_t i = 0; i < n; ++i) pt[i] += scale * update_[i];
  });
}

}  // namespace zero3d
