// loss_scaler.cpp — the update rule of DeepSpeed's DynamicLossScaler (see the header).
#include "optim/loss_scaler.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "base/errors.hpp"

namespace zero3d {

LossScaler::LossScaler(const LossScalerConfig& cfg) : cfg_(cfg) {
  s_.cur_scale = cfg.dynamic ? std::ldexp(1.0, cfg.initial_scale_power) : cfg.static_scale;
  s_.cur_hysteresis = cfg.hysteresis;
}

namespace {
std::string format_scale(double s) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.10g", s);
  return buf;
}
}  // namespace

std::string LossScaler::update(bool overflow, int64_t step) {
  std::string log;
  if (!cfg_.dynamic) {
    if (overflow) log = "OVERFLOW! Skipping step " + std::to_string(step) + ". Static loss scale " + format_scale(s_.cur_scale);
    return log;
  }
  if (cfg_.grad_scaler) {  // torch.amp.GradScaler.update: backoff 0.5, growth 2 after growth_interval clean steps
    if (overflow) {
      log = "OVERFLOW! Skipping step " + std::to_string(step) + ". GradScaler scale " + format_scale(s_.cur_scale) +
            ", reducing to " + format_scale(s_.cur_scale / 2.0);
      s_.cur_scale /= 2.0;
      s_.last_overflow_iter = s_.cur_iter;
    } else if ((s_.cur_iter - s_.last_overflow_iter) % cfg_.scale_window == 0) {  // this is the n-th clean step in a row
      s_.cur_scale *= 2.0;
      log = "loss scale raised to " + format_scale(s_.cur_scale) + " after " +
            std::to_string(s_.cur_iter - s_.last_overflow_iter) + " clean steps";
    }
    ++s_.cur_iter;
    return log;
  }
  // DeepSpeed's non-ZeRO optimizers have no hysteresis: behave as if it were 1.
  const int delayed_shift = cfg_.zero_path ? cfg_.hysteresis : 1;
  if (overflow) {
    if (delayed_shift == 1 || s_.cur_hysteresis == 1) {
      if (s_.cur_scale == cfg_.min_scale && cfg_.zero_path)
        throw SystemError("fp16 gradients overflowed at step " + std::to_string(step) + " while the loss scale was " +
                         "already at its minimum (fp16.min_loss_scale = " + format_scale(cfg_.min_scale) +
                         "); the run cannot continue. Lower the learning rate or use bf16 (\"bf16\": {\"enabled\": "
                         "true}), whose range does not need loss scaling.");
      const double next = std::max(s_.cur_scale / 2.0, cfg_.min_scale);
      log = "OVERFLOW! Skipping step " + std::to_string(step) + ". Attempted loss scale: " + format_scale(s_.cur_scale) +
            ", reducing to " + format_scale(next);
      s_.cur_scale = next;
    } else {
      log = "OVERFLOW! Skipping step " + std::to_string(step) + ". Attempted loss scale: " + format_scale(s_.cur_scale) +
            ", but hysteresis is " + std::to_string(s_.cur_hysteresis) + ". Reducing hysteresis to " +
            std::to_string(s_.cur_hysteresis - 1);
      --s_.cur_hysteresis;
    }
    s_.last_overflow_iter = s_.cur_iter;
  } else {
    if (cfg_.consecutive_hysteresis) s_.cur_hysteresis = delayed_shift;
    const int64_t stable = s_.cur_iter - s_.last_overflow_iter - 1;
    if (stable > 0 && stable % cfg_.scale_window == 0) {
      if (!cfg_.consecutive_hysteresis) s_.cur_hysteresis = delayed_shift;
      s_.cur_scale *= 2.0;
      log = "loss scale raised to " + format_scale(s_.cur_scale) + " after " + std::to_string(stable) + " clean steps";
    }
  }
  ++s_.cur_iter;
  return log;
}

}  // namespace zero3d
