// optimizer.hpp — the optimizer over one flat parameter buffer and its state.
//
// Adam keeps m and v, Lion m, Adagrad the sum of squares, SGD a momentum buffer, LAMB m and v
// plus per-tensor trust ratios (LAMB normalises each named tensor on its own, hence the
// ParamLayout). Every optimizer but LAMB updates element by element: ElementwiseUpdater runs
// one step of it over any range, with parameters and states in fp32 or 16 bits (DeepSpeed's
// bf16_master_weights_and_grads / bf16_optimizer_states), for the device and for the offloaded
// CPU optimizer alike.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.hpp"
#include "config/config.hpp"
#include "kernels/memory.hpp"
#include "kernels/optimizers.hpp"
#include "kernels/typed.hpp"
#include "model/buffer.hpp"
#include "parallel/comm.hpp"

namespace zero3d {

class OneBitOptimizer;  // optim/onebit.hpp

// An array whose element type is chosen at run time.
struct TypedSpan {
  void* data = nullptr;
  DType type = DType::F32;
};

// The constants of one step of an elementwise optimizer (all but Lamb).
struct ElementwiseStep {
  OptimizerType type = OptimizerType::Adam;
  kernels::AdamStep adam{};
  kernels::LionStep lion{};
  kernels::AdagradStep adagrad{};
  kernels::SgdStep sgd{};
};

// Step `step` (1-based) at learning rate lr; betas override (beta1, beta2) for this step
// (OneCycle). cpu_optimizer: the update of DeepSpeed's CPU optimizer class that offload runs
// (DeepSpeedCPUAdagrad's weight decay; the others compute what their device kernels compute).
ElementwiseStep make_elementwise_step(const OptimizerConfig& cfg, int64_t step, double lr,
                                      std::optional<std::pair<double, double>> betas, bool cpu_optimizer);

// The states an optimizer keeps, as checkpoints name them: "exp_avg" and "exp_avg_sq" (Adam,
// Lamb), "exp_avg" (Lion), "exp_avg_sq" (Adagrad's sum, DeepSpeedCPUAdagrad's name),
// "momentum_buffer" (SGD with momentum) or none.
std::vector<std::string> optimizer_state_names(const OptimizerConfig& cfg);

// Runs one elementwise step over n elements in place. Gradients of grad_type are multiplied by
// grad_mul on the way in (mixed precision: DeepSpeed's combined unscale-and-clip factor).
// 16-bit parameters or states are widened into fp32 in cache-sized chunks, updated by the
// kernels' fp32 arithmetic and rounded back (RNE), as DeepSpeed's FusedAdam and CPU optimizers
// treat bf16 tensors; all-fp32 arrays are updated where they lie. on_host: the CPU
// optimizer's loop (offloaded state) instead of the device kernel; both run the same element
// functions, so they agree bit for bit.
// Chunks widened for an update, where the update runs: host vectors for the CPU optimizer (and
// every update of a CPU build, whose model memory is host memory), device scratch for a GPU
// build's device update.
class WidenScratch {
 public:
  float* take(int64_t n, bool on_host) {
    if (kernels::kHostIsDevice || on_host) {
      if (host_.size() < static_cast<size_t>(n)) host_.resize(static_cast<size_t>(n));
      return host_.data();
    }
    return device_.take<float>(n);
  }

 private:
  std::vector<float> host_;
  kernels::DeviceScratch device_{"optimizer_widened"};
};

class ElementwiseUpdater {
 public:
  // rounded (when not null): the first rounded_n updated parameters also written there in its
  // type, chunk by chunk while they are in cache (the 16-bit model copy of fp32 master weights).
  void run(const ElementwiseStep& s, TypedSpan params, const void* grads, DType grad_type, float grad_mul,
           const std::vector<TypedSpan>& states, int64_t n, bool on_host, TypedSpan rounded = {},
           int64_t rounded_n = 0);

 private:
  WidenScratch g_, p_, st_[2];  // widened chunks
};

class Optimizer {
 public:
  // state_type: the element type of the states (bf16 with bf16_optimizer_states), fp32 otherwise.
  // dp: the data-parallel group, which the 1-bit optimizers communicate over themselves.
  // trainable (model.frozen_parameters): the sorted ranges of the layout's elements it updates
  // and keeps state for, the states holding them back to back (nullopt: every element).
  // Frozen elements get no state, no update and no weight decay, as parameters outside
  // PyTorch's param groups; only the elementwise optimizers take ranges.
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  Optimizer(const OptimizerConfig& cfg, const ParamLayout& layout, DType state_type = DType::F32,
            Communicator* dp = nullptr, std::optional<Ranges> trainable = std::nullopt);
  ~Optimizer();

  // Whether the engine averages the gradients of the next step before step() (DeepSpeed's
  // enable_backward_allreduce): always, except for a 1-bit optimizer on a step it communicates
  // compressed (past its freeze, or 0/1 Adam between its variance updates), which is given this
  // rank's local gradients instead.
  bool backward_allreduce() const;
  const OneBitOptimizer* one_bit() const { return onebit_.get(); }  // null for the other optimizers

  // One update with learning rate `lr`; `betas` overrides (beta1, beta2) for this step (OneCycle).
  void step(float* params, const float* grads, double lr,
            std::optional<std::pair<double, double>> betas = std::nullopt);
  // The same with gradients stored as grad_type and multiplied by grad_mul on the way in
  // (mixed precision: 16-bit gradients, DeepSpeed's combined unscale-and-clip factor).
  // They are widened in cache-sized chunks, so no fp32 copy of the gradient is kept.
  void step(float* params, const void* grads, DType grad_type, float grad_mul, double lr,
            std::optional<std::pair<double, double>> betas = std::nullopt);
  // The same over parameters of any type: bf16 master weights are updated where they lie.
  // rounded/rounded_n: as ElementwiseUpdater::run's (fp32 master weights cast to the model's
  // 16-bit parameters in the same pass).
  void step(TypedSpan params, const void* grads, DType grad_type, float grad_mul, double lr,
            std::optional<std::pair<double, double>> betas = std::nullopt, TypedSpan rounded = {},
            int64_t rounded_n = 0);

  int64_t step_count() const { return step_count_; }
  // (A checkpoint load: a 1-bit optimizer's error buffers restart at zero and its phase follows
  // from n, FACTS-2 §5.3.)
  void set_step_count(int64_t n);
  // Names of the state buffers, as checkpoints store them (optimizer_state_names), and the
  // buffers themselves in the same order, each of state_type().
  std::vector<std::string> state_names() const;
  std::vector<TypedBuffer*> state_buffers();
  DType state_type() const { return state_type_; }
  const OptimizerConfig& config() const { return cfg_; }
  // Bytes of optimizer state held (m, v, the sum or momentum).
  int64_t state_bytes() const;
  // The trainable ranges (nullopt: all of the layout), and the elements each state holds.
  const std::optional<Ranges>& trainable() const { return trainable_; }
  // With trainable ranges: the parameters step() is given are packed as the states are (an fp32
  // master copy of the trainable elements only), not laid out as the gradients.
  void set_params_packed(bool packed) { params_packed_ = packed; }
  int64_t state_elems() const;

 private:
  OptimizerConfig cfg_;
  const ParamLayout& layout_;
  DType state_type_;
  std::vector<std::string> names_;
  std::vector<TypedBuffer> states_;  // in names_' order
  std::optional<Ranges> trainable_;
  bool params_packed_ = false;
  int64_t step_count_ = 0;
  ElementwiseUpdater updater_;
  WidenScratch widened_;  // LAMB: one tensor's widened gradients
  std::unique_ptr<OneBitOptimizer> onebit_;
  // 1-bit steps run on host arrays (GPU build): the parameters, the states, the gradients
  std::vector<std::vector<float>> host_;
  void one_bit_step(TypedSpan params, const void* grads, DType grad_type, float grad_mul, double lr,
                    std::optional<std::pair<double, double>> betas, TypedSpan rounded, int64_t rounded_n);
};

// Global L2-norm clipping as torch.nn.utils.clip_grad_norm_ (DeepSpeed's fp32 path, FACTS §3):
// the factor max_norm / (norm + 1e-6) when that is < 1, else 1 (also when max_norm is 0: off).
double clip_coefficient(double norm, double max_norm);
// Clips a whole local gradient buffer; returns the norm before clipping.
double clip_grad_norm(float* grads, int64_t n, double max_norm);

}  // namespace zero3d
