// onebit.hpp — DeepSpeed's 1-bit optimizers (DEEPSPEED-FACTS-2 §5; runtime/fp16/onebit/
// {adam,zoadam,lamb}.py) over the tensors of a ParamLayout, each communicating through the
// error-compensated 1-bit all-reduce of compressed_allreduce.hpp.
//
// All three begin with DeepSpeed's initialisation step: step 1 (the first step() of a run) sets
// up the error buffers and updates nothing (the step still counts). Their updates have no bias
// correction. While the engine all-reduces the gradients (backward_allreduce) they see the
// average; otherwise this rank's local gradient, and they compress what they communicate.
//
//  * OneBitAdam (§5.3): warm-up m = β1·m + (1−β1)·g, v = β2·v + (1−β2)·g²,
//    p −= lr·(m/(sqrt(v)+eps) + wd·p). At the end of the step whose count reaches freeze_step the
//    variance freezes and the gradient all-reduce goes off: each rank updates m with its local
//    gradient and each tensor's m is replaced by its 1-bit all-reduce (per tensor, with its own
//    error buffers, as DeepSpeed loops over its parameters).
//  * ZeroOneAdam (§5.4, Lu et al. 2022): up to step max(var_freeze_step, 1) + 1 the variance is
//    updated on the steps divisible by var_interval (gradients all-reduced), which doubles after
//    every var_update_scaler such updates; on the other steps the gradient itself goes through
//    the 1-bit all-reduce and only m moves. Then v is frozen and the ranks take local steps,
//    accumulating their updates (the paper's u): every local_step_interval steps the accumulated
//    update, scaled by sqrt(v)+eps, is 1-bit all-reduced and replaces the local progress, and m
//    is re-derived from it; the interval doubles every local_step_scaler steps up to
//    local_step_clipper.
//  * OneBitLamb (§5.5, Li et al. 2022): warm-up is LAMB without bias correction (trust ratio
//    ‖p‖/‖u‖ clamped to [min_coeff, max_coeff]), its coefficients averaged into lamb_coeff_freeze
//    (EMA, coeff_beta); v is snapshot into exp_avg_sq_fresh at step freeze_step. After the freeze
//    (as OneBitAdam's) each tensor's momentum is scaled to a common magnitude (scaling_coeff,
//    computed once), all momenta are 1-bit all-reduced as one flat buffer, and the update is
//    scaled by lamb_coeff_freeze times a factor max(denom/denom_fresh) clamped to
//    [factor_min, factor_max] and to last_factor·(1 ± factor_threshold).
//
// Checkpoints (as DeepSpeed's load_state_dict): the error buffers are not saved and restart at
// zero; ZeroOneAdam's momentum accumulator restarts at zero too. The phase follows from the
// loaded step, and ZeroOneAdam's intervals are functions of the step (DeepSpeed stores them).
// OneBitLamb saves lamb_coeff_freeze, last_factor and scaling_coeff (one value per tensor,
// stored over the tensor's elements so every layout reads them back); a load during its warm-up
// resets them as DeepSpeed does. (DeepSpeed's fresh optimizer object also repeats its
// initialisation step after a load, dropping that step's gradient; zero3d continues with a
// normal step: the initialisation step exists to allocate buffers, which a loaded run has.)
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "config/config.hpp"
#include "model/buffer.hpp"
#include "parallel/compressed_allreduce.hpp"

namespace zero3d {

struct OneBitScalars;  // the step's hyper-parameters in fp32 (onebit.cpp)

class OneBitOptimizer {
 public:
  // dp: the data-parallel group the optimizer communicates over (null or size 1: no communication).
  // errors: how many error-buffer pairs it keeps (one per tensor, or one for a flat buffer).
  OneBitOptimizer(const OptimizerConfig& cfg, const ParamLayout& layout, Communicator* dp, size_t errors);
  virtual ~OneBitOptimizer() = default;

  // Whether the engine averages the gradients of the next step, `step` (1-based), before step()
  // (DeepSpeed's enable_backward_allreduce); otherwise step() gets this rank's local gradient.
  // OneBitAdam and OneBitLamb: until their freeze (onebit_past_freeze).
  virtual bool backward_allreduce(int64_t step) const;
  // Step `step` over host fp32 arrays of the layout's total: the parameters, the gradient, and
  // the states in optimizer_state_names order.
  virtual void step(int64_t step, float* p, const float* g, float* const* states, double lr, double beta1,
                    double beta2) = 0;
  // A checkpoint taken after `step` steps was loaded (its states are in place by the next step):
  // the compression errors restart at zero (§5.3) and what derives from the step is re-derived.
  virtual void loaded(int64_t step);
  const std::vector<OneBitErrors>& errors() const { return errors_; }

 protected:
  OptimizerConfig cfg_;
  const ParamLayout& layout_;
  std::unique_ptr<CompressedAllReduce> reduce_;  // null without a data-parallel group
  std::vector<OneBitErrors> errors_;
};

// OneBitAdam's and OneBitLamb's freeze: DeepSpeed freezes at the end of a step whose
// state['step'] >= freeze_step; the initialisation step (step 1) returns before that check, so
// step 2 always warms up and step max(freeze_step, 2) + 1 is the first compressed one.
bool onebit_past_freeze(int64_t step, int64_t freeze_step);

class OneBitAdam : public OneBitOptimizer {
 public:
  OneBitAdam(const OptimizerConfig& cfg, const ParamLayout& layout, Communicator* dp);
  void step(int64_t step, float* p, const float* g, float* const* states, double lr, double beta1,
            double beta2) override;
};

// 0/1 Adam's intervals (zoadam.py), which follow from the step alone: the optimizer keeps one,
// and the communication estimate (train/comm_volume.cpp) replays one to predict each step's bytes.
class ZeroOneAdamSchedule {
 public:
  explicit ZeroOneAdamSchedule(const OptimizerConfig& cfg) : cfg_(cfg) {}
  // Whether step `step` runs with the variance frozen (local steps).
  bool frozen(int64_t step) const;
  // A phase-1 step that updates the variance from the averaged gradient (the engine's all-reduce on).
  bool variance_step(int64_t step) const { return !frozen(step) && step % var_interval_ == 0; }
  // A local step that ends by 1-bit all-reducing the accumulated update.
  bool sync_step(int64_t step) const { return frozen(step) && step % local_interval_ == 0; }
  bool backward_allreduce(int64_t step) const;
  void count(int64_t step);   // DeepSpeed's interval bookkeeping at the end of step `step`
  void replay(int64_t step);  // the intervals after steps 2..step, as an unbroken run has them
  int64_t var_interval() const { return var_interval_; }
  int64_t local_step_interval() const { return local_interval_; }

 private:
  OptimizerConfig cfg_;
  int64_t var_interval_ = 1, var_counter_ = 0, local_interval_ = 1, local_counter_ = 0;
};

class ZeroOneAdam : public OneBitOptimizer {
 public:
  ZeroOneAdam(const OptimizerConfig& cfg, const ParamLayout& layout, Communicator* dp);
  bool backward_allreduce(int64_t step) const override;
  void step(int64_t step, float* p, const float* g, float* const* states, double lr, double beta1,
            double beta2) override;
  void loaded(int64_t step) override;
  // Whether step `step` runs with the variance frozen (local steps).
  bool frozen(int64_t step) const { return schedule_.frozen(step); }
  int64_t var_interval() const { return schedule_.var_interval(); }
  int64_t local_step_interval() const { return schedule_.local_step_interval(); }

 private:
  void count(int64_t step);  // the schedule's bookkeeping at the end of step `step`, and the freeze's error reset
  ZeroOneAdamSchedule schedule_;
  double lrs_ = 0.0;                  // the learning rates summed since the last synchronisation
  std::vector<float> accumulator_;    // DeepSpeed's momentum_accumulator (the paper's u), this rank's
  std::vector<float> onebit_grad_;    // a tensor's gradient through the 1-bit all-reduce
};

class OneBitLamb : public OneBitOptimizer {
 public:
  OneBitLamb(const OptimizerConfig& cfg, const ParamLayout& layout, Communicator* dp);
  void step(int64_t step, float* p, const float* g, float* const* states, double lr, double beta1,
            double beta2) override;
  void loaded(int64_t step) override;
  // Per tensor, as DeepSpeed's state holds them (a scaling_coeff of 0: not computed yet).
  const std::vector<double>& lamb_coeff_freeze() const { return coeff_freeze_; }
  const std::vector<double>& last_factor() const { return last_factor_; }
  const std::vector<double>& scaling_coeff() const { return scaling_; }

 private:
  void warm_up(int64_t step, float* p, const float* g, float* const* st, double lr, const OneBitScalars& k);
  void compressed(float* p, const float* g, float* const* st, double lr, const OneBitScalars& k);
  std::vector<double> coeff_freeze_, last_factor_, scaling_;
  bool read_scalars_ = false;     // after a load past the freeze: the scalars come from the states
  std::vector<float> last_m_, update_;
  std::vector<float> flat_;       // DeepSpeed's exp_avg_flat: the momenta and the padding tail
};

std::unique_ptr<OneBitOptimizer> make_one_bit_optimizer(const OptimizerConfig& cfg, const ParamLayout& layout,
                                                        Communicator* dp);

}  // namespace zero3d
