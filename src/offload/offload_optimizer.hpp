// offload_optimizer.hpp — ZeRO-Offload / ZeRO-Infinity for the optimizer partition
// (DEEPSPEED-FACTS-2 §3.1-3.5).
//
// The partition's optimizer state (the fp32 master copy under mixed precision, then the
// optimizer's own states: exp_avg and exp_avg_sq for Adam, exp_avg for Lion, exp_avg_sq for
// Adagrad) is cut into sub-groups of sub_group_size elements. The first int((1-ratio)·G)
// sub-groups stay in device memory and use the device kernels; the rest live on the offload
// tier — host memory (device cpu) or one swap file per state and sub-group under nvme_path
// (device nvme) — and are updated by the CPU optimizer DeepSpeed runs there (DeepSpeedCPUAdam,
// DeepSpeedCPULion, DeepSpeedCPUAdagrad). The optimizer's states are fp32, or bf16 with
// bf16_optimizer_states (DeepSpeedCPUAdam's fp32_optimizer_states false); the master copy is
// always fp32. NVMe sub-groups move through buffer_count page-aligned buffers, one state of one
// sub-group each: with pipeline_read sub-group k+1 is read while k is updated, with
// pipeline_write k−1 is still being written meanwhile.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

#include "base/dtype.hpp"
#include "config/config.hpp"
#include "kernels/device.hpp"
#include "kernels/memory.hpp"
#include "kernels/typed.hpp"
#include "model/buffer.hpp"
#include "offload/aio.hpp"
#include "optim/optimizer.hpp"

namespace zero3d::offload {

// Bytes of state by where it lies. On a CPU-only build device and host memory are the same
// memory; `device` and `host` still say which space the engine placed them in. `host` also holds
// a GPU build's page-locked stages (HostStageBytes) once the first step has allocated them.
// `master` and `moments` split the bytes of state in memory (device + host, stages apart) between
// the fp32 master copy and the optimizer's own states.
struct TierBytes {
  int64_t device = 0, host = 0, nvme = 0, swap_buffers = 0;
  int64_t master = 0, moments = 0;
};

// The page-locked host stages through which a GPU build's CPU optimizer moves a step's data, per
// stage in bytes (stage k % 2 serves host sub-group k): the host sub-groups' gradients and, for
// parameters in model memory without a master copy, their parameters (two of each alternating on
// the copy stream, one when a single sub-group is on the host); with an fp32 master copy and
// sub-groups kept in device memory, param[0] holds a resident sub-group's master copy read back
// for release(). Each stage is as large as the largest sub-group it serves.
struct HostStageBytes {
  int64_t grad[2] = {0, 0}, param[2] = {0, 0};
  int64_t total() const { return grad[0] + grad[1] + param[0] + param[1]; }
};
// The stages OffloadedOptimizer allocates (at its first step) over a partition of numel elements
// in sub-groups of sub_group_size, int((1 - ratio)·G) of them kept in device memory; none where
// the host is the device (a CPU build: the CPU optimizer reads model memory itself). The memory
// plan counts the same figure (train/estimator.cpp).
HostStageBytes host_stage_bytes(int64_t numel, int64_t sub_group_size, double ratio, DType grad_type, DType param_type,
                                bool hold_master, bool params_in_model_memory, bool host_is_device);

// How the optimizer reaches the parameters of a sub-group [begin, begin + n) of the partition.
struct ParamAccess {
  // The parameters to update in place: fp32, or bf16 master weights (bf16_master_weights_and_grads);
  // {nullptr} when the master copy is held by the optimizer.
  std::function<TypedSpan(int64_t begin, int64_t n)> acquire;
  // After the update: the updated values (the fp32 master copy, in host memory, or what
  // acquire() gave). Parameters in model memory that a GPU build updates on a host copy are
  // released at the end of the step, once the copy stream has brought them back.
  std::function<void(int64_t begin, int64_t n, TypedSpan updated)> release;
  // Whether acquire() gives model memory (device memory on a GPU build, where the CPU optimizer
  // updates a host copy) rather than host memory (parameters read from their swap files). A GPU
  // build acquires such parameters a sub-group ahead, to copy them over during the update before.
  bool in_model_memory = true;
};

class OffloadedOptimizer {
 public:
  // numel: the partition's elements; hold_master: keep an fp32 master copy (mixed precision with
  // fp32 master weights); state_type: of the optimizer's states; swap_dir: this rank's folder for
  // device nvme (created and emptied here). opt: Adam, Lion or Adagrad.
  OffloadedOptimizer(const OffloadOptimizerConfig& off, const AioConfig& aio, const OptimizerConfig& opt,
                     int64_t numel, int64_t sub_group_size, bool hold_master, const std::string& swap_dir,
                     DType state_type = DType::F32);
  ~OffloadedOptimizer();
  OffloadedOptimizer(const OffloadedOptimizer&) = delete;
  OffloadedOptimizer& operator=(const OffloadedOptimizer&) = delete;

  // One step over every sub-group in order; gradients as in Optimizer::step.
  void step(const ParamAccess& params, const void* grads, DType grad_type, float grad_mul, double lr,
            std::optional<std::pair<double, double>> betas);
  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t n) { step_count_ = n; }

  // "master" (when held), then the optimizer's states; read/write any range of one state in fp32,
  // from and into host memory.
  std::vector<std::string> state_names() const;
  std::vector<std::string> optimizer_states() const;  // without "master"
  void read(const std::string& state, int64_t begin, int64_t n, float* out);
  void write(const std::string& state, int64_t begin, int64_t n, const float* in);

  TierBytes bytes() const;
  IoStats take_io_stats() { return aio_ ? aio_->take_stats() : IoStats{}; }
  bool direct_io() const { return direct_; }
  int64_t sub_groups() const { return static_cast<int64_t>(groups_.size()); }
  int64_t resident_sub_groups() const { return cut_; }
  int64_t sub_groups_in_flight() const { return static_cast<int64_t>(slots_.size()); }
  const std::vector<std::string>& swap_files() const { return paths_; }

 private:
  struct Group {
    int64_t begin, n;
  };
  struct Slot {
    std::vector<AlignedBuffer> state;  // one buffer per state
    int64_t group = -1;
    std::vector<Ticket> reads, writes;  // per state
  };
  int states() const { return static_cast<int>(names_.size()); }
  int state_at(const std::string& name) const;
  int64_t esize(int s) const { return static_cast<int64_t>(dtype_size(types_[static_cast<size_t>(s)])); }
  char* resident(int s, int64_t begin);  // device tier (k < cut) or host tier (device cpu)
  // Elements [a, b) of state s in sub-group k as host memory for use(): the host tier or a swap
  // buffer where they lie, a host copy of the device tier's on a GPU build (written back after
  // use() when write_back).
  void on_host(int s, int64_t k, int64_t a, int64_t b, const std::function<void(char*)>& use, bool write_back);
  void update(int64_t k, char* const* state, const ParamAccess& params, const void* grads, DType grad_type,
              float grad_mul, bool on_host);
  // Whether a host sub-group's parameters are model memory updated on a host copy (a GPU build).
  bool stages_params(const ParamAccess& params) const {
    return !master_ && params.in_model_memory && !kernels::kHostIsDevice;
  }
  HostStageBytes planned_stages(DType grad_type, DType param_type, bool params_in_model_memory) const {
    return host_stage_bytes(numel_, sub_group_size_, off_.ratio, grad_type, param_type, master_, params_in_model_memory,
                            kernels::kHostIsDevice);
  }
  // Host sub-group k's gradients, and its parameters when staged, queued on the copy stream into
  // stages k % 2 (a GPU build).
  void queue_inputs(int64_t k, const ParamAccess& params, const void* grads, DType grad_type);
  // Host sub-group k's gradients in host memory for the CPU optimizer (its staged parameters in
  // param_stage_[k % 2]); the previous sub-group's updated parameters sent back and the next
  // sub-group's inputs queued behind them. On a CPU build the gradients themselves.
  const char* host_inputs(int64_t k, const ParamAccess& params, const void* grads, DType grad_type);
  // The updated parameters waiting in their stage (sub-group sending_) queued back to model memory.
  void send_back();
  // The end of a step on a GPU build: the last parameters sent back, every copy done, the
  // returned sub-groups released.
  void finish_copies(const ParamAccess& params);
  // device nvme: the offloaded sub-groups through the swap buffers, read, updated and written.
  void swap_sub_groups(const ParamAccess& params, const void* grads, DType grad_type, float grad_mul);
  void start_read(Slot& slot, int64_t k);
  void wait_reads(Slot& slot);
  void start_write(Slot& slot);
  void wait_writes(Slot& slot);
  const std::string& path(int s, int64_t k) const { return paths_[static_cast<size_t>(s * (sub_groups() - cut_) + (k - cut_))]; }
  // Elements [a, b) of one offloaded sub-group's state s through slot 0's buffer (file_span).
  void file_access(int s, int64_t k, int64_t a, int64_t b, const std::function<void(char*)>& use, bool write_back);

  OffloadOptimizerConfig off_;
  OptimizerConfig opt_;
  int64_t numel_, sub_group_size_;
  std::vector<std::string> names_;
  std::vector<DType> types_;  // per state
  bool master_ = false;       // names_[0] is the fp32 master copy
  std::vector<Group> groups_;
  int64_t cut_ = 0, cut_elems_ = 0;  // sub-groups (elements) kept in device memory
  std::vector<TypedBuffer> device_;  // per state, the resident sub-groups
  std::vector<kernels::HostBuffer> host_;  // per state, the offloaded sub-groups (device cpu), pinned per pin_memory
  // A GPU build's CPU optimizer works on host copies of a sub-group's gradients and of
  // parameters held in device memory, in two stages of each (HostStageBytes): while the CPU
  // updates sub-group k, the copy stream sends k - 1's parameters back and brings k + 1's
  // gradients and parameters over (queued_: the sub-group coming over, in stages queued_ % 2;
  // incoming_[j]: the model memory of the parameters in param_stage_[j]; sending_: the sub-group
  // whose updated parameters wait in their stage; returning_: those sent back this step).
  kernels::HostBuffer grad_stage_[2], param_stage_[2];
  std::unique_ptr<kernels::CopyStream> copies_;  // a GPU build's, made by the first step
  int64_t queued_ = -1, sending_ = -1;
  TypedSpan incoming_[2];
  std::vector<std::pair<int64_t, TypedSpan>> returning_;
  // device nvme
  std::string dir_;
  std::unique_ptr<AioEngine> aio_;
  bool direct_ = true;
  std::vector<std::vector<int>> fds_;  // [state][group - cut]
  std::vector<std::string> paths_;
  std::vector<Slot> slots_;
  // the step
  int64_t step_count_ = 0;
  ElementwiseStep step_;
  ElementwiseUpdater updater_;
};

}  // namespace zero3d::offload
