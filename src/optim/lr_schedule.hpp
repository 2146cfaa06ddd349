// lr_schedule.hpp — DeepSpeed's LR schedules (runtime/lr_schedules.py; DEEPSPEED-FACTS §4).
//
// Step-counting convention: last_batch_iteration starts at -1 and construction already sets
// the "before start" LR; step() is called once per applied optimizer step, after it. So the
// n-th applied step (1-based) trains with the LR of iteration n-2.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>

#include "config/config.hpp"

namespace zero3d {

class LRSchedule {
 public:
  // base_lr: the optimizer's configured lr (used when there is no scheduler, by WarmupCosineLR).
  LRSchedule(const SchedulerConfig& cfg, double base_lr);

  double lr() const { return lr_at(last_batch_iteration_); }
  // OneCycle with cycle_momentum: (beta1, beta2) to train with; otherwise nothing.
  std::optional<std::pair<double, double>> betas() const;
  void step() { ++last_batch_iteration_; }
  int64_t last_batch_iteration() const { return last_batch_iteration_; }
  void set_last_batch_iteration(int64_t i) { last_batch_iteration_ = i; }

  // The LR for iteration i (i = -1: value set at construction).
  double lr_at(int64_t i) const;
  std::optional<std::pair<double, double>> betas_at(int64_t i) const;

 private:
  double warmup_gamma(int64_t i) const;
  double onecycle_scale(int64_t i) const;  // sf in [0, 1] during the cycle

  SchedulerConfig cfg_;
  double base_lr_;
  int64_t last_batch_iteration_ = -1;
};

}  // namespace zero3d
