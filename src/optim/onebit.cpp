// onebit.cpp — OneBitAdam's step in DeepSpeed's fp32 arithmetic (onebit/adam.py), element by
// element as its tensor operations are written: exp_avg.mul_(β1).add_(1−β1, g),
// exp_avg_sq.mul_(β2).addcmul_(1−β2, g, g), update = exp_avg/(exp_avg_sq.sqrt() + eps),
// update += wd·p (when wd > 0), p.add_(−lr·update).
#include "optim/onebit.hpp"

#include <algorithm>
#include <cmath>

namespace zero3d {

OneBitAdam::OneBitAdam(const OptimizerConfig& cfg, const ParamLayout& layout, Communicator* dp)
    : cfg_(cfg), layout_(layout), errors_(layout.tensors().size()) {
  if (dp && dp->size() > 1) reduce_ = std::make_unique<CompressedAllReduce>(*dp);
}

bool OneBitAdam::compressed(int64_t step) const {
  // DeepSpeed sets adam_freeze_key at the end of a step whose state['step'] >= freeze_step; the
  // initialisation step (step 1) returns before that check, so step 2 always warms up.
  const int64_t previous = step - 1;
  return previous >= 2 && previous >= cfg_.freeze_step;
}

void OneBitAdam::reset_errors() {
  for (OneBitErrors& e : errors_) e.reset();
}

void OneBitAdam::step(int64_t step, float* p, const float* g, float* m, float* v, double lr, double beta1,
                      double beta2) {
  if (step == 1) return;  // the initialisation step: buffers set up, nothing updated (§5.3)
  const bool frozen = compressed(step);
  const float b1 = static_cast<float>(beta1), c1 = static_cast<float>(1.0 - beta1);
  const float b2 = static_cast<float>(beta2), c2 = static_cast<float>(1.0 - beta2);
  const float eps = static_cast<float>(cfg_.eps), wd = static_cast<float>(cfg_.weight_decay);
  const float neg_lr = static_cast<float>(-lr);
  const std::vector<TensorSpec>& tensors = layout_.tensors();
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t a = tensors[t].offset, n = tensors[t].numel;
    if (n == 0) continue;
    float *pt = p + a, *mt = m + a, *vt = v + a;
    const float* gt = g + a;
    for (int64_t i = 0; i < n; ++i) mt[i] = mt[i] * b1 + c1 * gt[i];
    if (!frozen) {
      for (int64_t i = 0; i < n; ++i) vt[i] = vt[i] * b2 + c2 * gt[i] * gt[i];
    } else if (reduce_) {
      // DeepSpeed: exp_avg.set_(compressed_allreduce(exp_avg, worker_error, server_error)); every
      // rank ends with the same momentum, v stays as it froze.
      reduce_->run(mt, n, errors_[t]);
    }
    for (int64_t i = 0; i < n; ++i) {
      float update = mt[i] / (std::sqrt(vt[i]) + eps);
      if (wd > 0.0f) update += wd * pt[i];
      pt[i] += neg_lr * update;
    }
  }
}

}  // namespace zero3d
