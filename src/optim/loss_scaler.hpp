// loss_scaler.hpp — fp16 loss scaling exactly as DeepSpeed 0.19.6 does it
// (DEEPSPEED-FACTS §2.2-2.4; runtime/fp16/loss_scaler.py DynamicLossScaler.update_scale).
//
// The loss is multiplied by scale() before backward; after the gradient reduction the caller
// asks every rank whether any gradient is inf/NaN (agreed across the group) and calls
// update(overflow) BEFORE unscaling: on a step where the scale grows, gradients are divided
// by the new scale, as DeepSpeed does.
//
// Two flavours, as in DeepSpeed:
//  * ZeRO path (stages 1-3): hysteresis — an overflow first uses up one of `hysteresis`
//    tolerated overflows before halving — and an error when an overflow arrives while the
//    scale already sits at min_loss_scale.
//  * Non-ZeRO path (stage 0, FP16_Optimizer): every overflow halves at once, floored at
//    min_loss_scale, never an error.
// Growth: after an overflow at iteration o, the scale doubles at the update with
// cur_iter - o - 1 a positive multiple of loss_scale_window (from the start, o = -1).
// Static scaling (fp16.loss_scale > 0) and bf16/fp32 (scale 1) never change.
// torch_autocast with fp16 uses torch.amp.GradScaler instead (DeepSpeed's engine creates one
// with its defaults): every overflow halves the scale (no hysteresis, no floor, never an
// error) and the scale doubles on the growth_interval-th clean step in a row (2000).

#pragma once

#include <cstdint>
#include <string>

namespace zero3d {

struct LossScalerConfig {
  bool dynamic = false;
  double static_scale = 1.0;    // used when !dynamic
  int initial_scale_power = 16;
  int64_t scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_scale = 1.0;
  bool zero_path = true;        // hysteresis and the error at min_scale (ZeRO stages 1-3)
  bool grad_scaler = false;     // torch.amp.GradScaler's rule (scale_window = growth_interval)
};

// Everything the scaler remembers; saved in checkpoints so that a resumed run continues
// the same sequence of scales.
struct LossScalerState {
  double cur_scale = 1.0;
  int64_t cur_iter = 0;
  int64_t last_overflow_iter = -1;
  int cur_hysteresis = 1;
};

class LossScaler {
 public:
  explicit LossScaler(const LossScalerConfig& cfg);

  double scale() const { return s_.cur_scale; }
  bool dynamic() const { return cfg_.dynamic; }
  // Applies one optimizer step's outcome. Returns a log line when something happened
  // ("" otherwise). Throws SystemError when an overflow arrives at the minimum scale on the
  // ZeRO path; `step` (1-based) is named in the message.
  std::string update(bool overflow, int64_t step);

  const LossScalerState& state() const { return s_; }
  void set_state(const LossScalerState& s) { s_ = s; }

 private:
  LossScalerConfig cfg_;
  LossScalerState s_;
};

}  // namespace zero3d
