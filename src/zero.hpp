// zero.hpp — ZeRO stages 0-3 as one object (DEEPSPEED-FACTS §5; Rajbhandari et al. 2020).
//
// It owns the model state (parameters, gradients, optimizer moments) and serves it to the
// model unit by unit through ParamStore. Everything is a range of ONE flat layout, padded to
// a multiple of 2·W and split into W equal partitions (Partition); the stages differ only in
// what stays partitioned:
//
//   stage | parameters          | gradients                        | optimizer moments
//   0     | full                | full, all-reduced                | full
//   1     | full, all-gathered  | full, reduce-scattered at GAS end| partition
//   2     | full, all-gathered  | partition (+ per-unit windows)   | partition
//   3     | partition, gathered | partition (+ per-unit windows)   | partition
//         | per unit when used  |                                  |
//
// fp32 Adam bytes per rank for Ψ parameters over N ranks (up to padding): 16Ψ; 4Ψ+4Ψ+8Ψ/N;
// 4Ψ+12Ψ/N; 16Ψ/N — plus communication buffers and, at stage 3, the gathered units.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "buffer.hpp"
#include "checkpoint.hpp"
#include "comm.hpp"
#include "config.hpp"
#include "grad_reducer.hpp"
#include "model.hpp"
#include "optimizer.hpp"

namespace zero3d {

// Bytes held by this rank, by category (what metrics.jsonl reports as "memory").
struct MemoryBytes {
  int64_t params = 0, grads = 0, master = 0, optimizer_states = 0, comm_buffers = 0, live_params_peak = 0;
  int64_t model_states() const { return params + grads + master + optimizer_states; }
};

class ZeroOptimizer : public ParamStore {
 public:
  ZeroOptimizer(const ZeroConfig& zero, const OptimizerConfig& opt, const ParamLayout& layout,
                std::vector<ParamUnit> units, Communicator& dp);

  // Sets the parameters from a function that writes elements [begin, end) of the full flat
  // buffer (every rank produces identical values); each rank keeps what its stage needs.
  template <typename Fill>
  void init_params(Fill&& fill) {
    if (stage_ < 3) {
      fill(params_.data(), 0, layout_.total());
    } else {
      const auto [lo, hi] = part_.owned(rank_, 0, layout_.total());
      if (hi > lo) fill(params_.data(), lo, hi);  // the partition buffer starts at part.begin(rank)
    }
  }

  // Before each micro-batch's backward; `boundary`: this one completes the accumulation.
  void begin_micro_step(bool boundary);
  // Waits for the gradient reduction still in flight (the exposed communication).
  void finish_reduction();
  // Grad norm (of the averaged gradient, before clipping), clipping, update, parameter gather.
  double step(double lr, std::optional<std::pair<double, double>> betas, double clip);
  void zero_grad();

  // Full parameters, gathered (collective); for tests and tools.
  std::vector<float> gather_full_params();

  MemoryBytes memory() const;

  // --- checkpoints: every stage saves and loads the same thing, the flat buffers cut by
  // partition() (each rank its own range), so any stage and world size can load any save.
  ShardSlice checkpoint_slice();
  std::vector<std::string> checkpoint_states() const;  // "params" then the optimizer's
  int64_t optimizer_step() const { return optimizer_->step_count(); }
  // Local part of a load: reads this rank's ranges (no collectives; may throw InputError).
  void read_checkpoint(const CheckpointReader& reader);
  // Collective part: rebuilds replicated buffers from the ranks' ranges.
  void finish_checkpoint_load();
  int stage() const { return stage_; }
  const Partition& partition() const { return part_; }

  // ParamStore
  const float* fetch(int u) override;
  void release(int u) override;
  float* grad_target(int u) override;
  void grads_done(int u) override;
  void progress() override;

 private:
  struct Gathered {
    FlatBuffer buffer;
    std::unique_ptr<CommRequest> pending;  // prefetch in flight
  };
  void start_gather(int u);
  void free_gathered(int u);
  bool keep_after_use(int u) const;  // stage 3: persistent, or reused soon enough
  float* window_for(int u);
  int window_key(int u) const;
  double partition_sum_of_squares() const;
  void gather_updated_params();
  void all_gather_replicated(float* full);  // every rank's owned(r, 0, Ψ) range of a full buffer

  ZeroConfig cfg_;
  const ParamLayout& layout_;
  std::vector<ParamUnit> units_;
  Communicator& dp_;
  int rank_, world_, stage_;
  Partition part_;

  FlatBuffer params_;       // full (stages 0-2) or this rank's partition (stage 3)
  FlatBuffer grads_;        // full (stages 0-1) or this rank's partition (stages 2-3)
  ParamLayout state_layout_;  // stages 1-3: the optimizer sees one tensor, the partition
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<GradientReducer> reducer_;
  bool boundary_ = false;

  // stages 2-3: gradient windows (unit 0, the last unit, and two alternating block windows)
  std::map<int, FlatBuffer> windows_;

  // stage 3: gathered units and the fetch trace
  std::map<int, Gathered> gathered_;
  std::vector<bool> persistent_;
  std::vector<int> trace_;
  size_t trace_pos_ = 0;  // index in trace_ of the current (or next) fetch
  int64_t live_elems_ = 0, live_peak_elems_ = 0;
};

}  // namespace zero3d
