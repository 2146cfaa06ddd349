// lr_schedule.cpp — formulas of DEEPSPEED-FACTS §4, one function per schedule.
#include "optim/lr_schedule.hpp"

#include <algorithm>
#include <cmath>

namespace zero3d {

LRSchedule::LRSchedule(const SchedulerConfig& cfg, double base_lr) : cfg_(cfg), base_lr_(base_lr) {}

// Warm-up fraction: ln(i+1)/ln(W') (log) or i/W' (linear) for i < W' = max(2, warmup_num_steps), else 1.
double LRSchedule::warmup_gamma(int64_t i) const {
  const double w = static_cast<double>(std::max<int64_t>(2, cfg_.warmup_num_steps));
  if (static_cast<double>(i) >= w) return 1.0;
  return cfg_.warmup_log ? std::log(static_cast<double>(i) + 1.0) / std::log(w) : static_cast<double>(i) / w;
}

double LRSchedule::onecycle_scale(int64_t i) const {
  const double first = static_cast<double>(cfg_.cycle_first_step_size);
  const double second = static_cast<double>(cfg_.cycle_second_step_size);
  const double total = first + second, ratio = first / total;
  const double b = static_cast<double>(i) + 1.0;
  const double cycle = std::floor(1.0 + b / total);
  const double x = 1.0 + b / total - cycle;
  const bool rising = x <= ratio;
  double sf = rising ? x / ratio : (x - 1.0) / (ratio - 1.0);
  const int64_t count = rising ? cfg_.cycle_first_stair_count : cfg_.cycle_second_stair_count;
  if (count > 0) {  // staircase: hold the value for step_size/count iterations
    const double c = std::fmod(b, total);
    const double pos = c <= first ? c * count / first : (total - c) * count / second;
    sf = std::floor(pos) / static_cast<double>(count);
  }
  return sf;
}

double LRSchedule::lr_at(int64_t i) const {
  switch (cfg_.type) {
    case SchedulerType::None:
      return base_lr_;
    case SchedulerType::WarmupLR:
      if (i < 0) return cfg_.warmup_min_lr;
      return cfg_.warmup_min_lr + (cfg_.warmup_max_lr - cfg_.warmup_min_lr) * warmup_gamma(i);
    case SchedulerType::WarmupDecayLR: {
      if (i < 0) return cfg_.warmup_min_lr;
      const int64_t w = std::max<int64_t>(2, cfg_.warmup_num_steps);
      double gamma = warmup_gamma(i);
      if (i >= w)
        gamma = std::max(0.0, static_cast<double>(cfg_.total_num_steps - i) /
                                  static_cast<double>(std::max<int64_t>(1, cfg_.total_num_steps - w)));
      return cfg_.warmup_min_lr + (cfg_.warmup_max_lr - cfg_.warmup_min_lr) * gamma;
    }
    case SchedulerType::WarmupCosineLR: {
      if (i < 0) return 0.0;
      const int64_t w = std::max<int64_t>(2, cfg_.warmup_num_steps);
      double ratio;
      if (i < w) {
        ratio = cfg_.warmup_min_ratio + warmup_gamma(i) * (1.0 - cfg_.warmup_min_ratio);
      } else {
        const double p = std::min(1.0, static_cast<double>(i - w + 1) /
                                            static_cast<double>(std::max<int64_t>(1, cfg_.total_num_steps - w)));
        ratio = std::max(0.0, cfg_.cos_min_ratio + (1.0 - cfg_.cos_min_ratio) * (1.0 + std::cos(M_PI * p)) / 2.0);
      }
      return base_lr_ * ratio;
    }
    case SchedulerType::OneCycle: {
      const int64_t total = cfg_.cycle_first_step_size + cfg_.cycle_second_step_size;
      if (i < total) return cfg_.cycle_min_lr + (cfg_.cycle_max_lr - cfg_.cycle_min_lr) * onecycle_scale(i);
      if (cfg_.decay_step_size == 0 || cfg_.decay_lr_rate == 0.0) return cfg_.cycle_min_lr;
      const double d = static_cast<double>(i - total + 1);
      return cfg_.cycle_min_lr / (1.0 + cfg_.decay_lr_rate * d / static_cast<double>(cfg_.decay_step_size));
    }
    case SchedulerType::LRRangeTest: {
      const double steps = (static_cast<double>(i) + 1.0) / static_cast<double>(cfg_.lr_range_test_step_size);
      const double interval = cfg_.lr_range_test_staircase ? std::floor(steps) : steps;
      return cfg_.lr_range_test_min_lr * (1.0 + cfg_.lr_range_test_step_rate * interval);
    }
  }
  return base_lr_;
}

std::optional<std::pair<double, double>> LRSchedule::betas_at(int64_t i) const {
  if (cfg_.type != SchedulerType::OneCycle || !cfg_.cycle_momentum) return std::nullopt;
  constexpr double kBeta2 = 0.99;  // OneCycle forces betas[1] to 0.99
  // Construction writes the minimum momentum (DeepSpeed quirk: get_mom() would say max).
  if (i < 0) return std::make_pair(cfg_.cycle_min_mom, kBeta2);
  const int64_t total = cfg_.cycle_first_step_size + cfg_.cycle_second_step_size;
  if (i < total)
    return std::make_pair(cfg_.cycle_max_mom - (cfg_.cycle_max_mom - cfg_.cycle_min_mom) * onecycle_scale(i), kBeta2);
  if (cfg_.decay_step_size == 0) return std::make_pair(cfg_.cycle_max_mom, kBeta2);
  const double d = static_cast<double>(i - total + 1);
  return std::make_pair(cfg_.cycle_max_mom * (1.0 + cfg_.decay_mom_rate * d / static_cast<double>(cfg_.decay_step_size)),
                        kBeta2);
}

std::optional<std::pair<double, double>> LRSchedule::betas() const { return betas_at(last_batch_iteration_); }

}  // namespace zero3d
