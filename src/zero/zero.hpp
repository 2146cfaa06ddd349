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
//
// Mixed precision (bf16/fp16, DEEPSPEED-FACTS §2): parameters and gradients are 16-bit
// (2 bytes) in the same places; the optimizer partition adds an fp32 master copy next to the
// moments (12 bytes per owned parameter), so stage 3 holds (2 + 2 + 12)Ψ/N. After the update
// the master partition is rounded to 16 bits (RNE) and gathered. With
// data_types.grad_accum_dtype = fp32 the gradients stay 4 bytes. Backward always
// accumulates one unit's gradients in an fp32 window; they are rounded when they leave it.
// bf16.bf16_master_weights_and_grads drops the fp32 master copy (the bf16 partition is updated
// in fp32 arithmetic and rounded where it lies) and bf16_optimizer_states halves the moments:
// (2 + 2 + 4)Ψ/N, then (2 + 2 + 8)Ψ/N without the second option, for Adam at stage 3.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "base/byte_pool.hpp"
#include "config/config.hpp"
#include "io/checkpoint.hpp"
#include "kernels/memory.hpp"
#include "kernels/typed.hpp"
#include "model/buffer.hpp"
#include "model/model.hpp"
#include "offload/offload_optimizer.hpp"
#include "offload/param_swapper.hpp"
#include "optim/optimizer.hpp"
#include "parallel/comm.hpp"
#include "parallel/grad_reducer.hpp"
#include "parallel/partition.hpp"
#include "parallel/quantized_gather.hpp"
#include "zero/quantized_frozen.hpp"
#include "zero/shard_groups.hpp"

namespace zero3d {

// Elements of the model-state buffers a ZeRO stage allocates (the table above) for `numel` local
// parameters split as `part`: ZeroOptimizer's constructor allocates these and the memory planner
// (estimator.cpp) counts them, so the plan cannot drift from the allocation.
struct ZeroStateElems {
  int64_t params = 0, grads = 0;
  int64_t state = 0;  // the fp32 master copy (mixed precision) and each optimizer moment
};
inline ZeroStateElems zero_state_elems(int stage, int64_t numel, const Partition& part) {
  const int64_t full = stage == 0 ? numel : part.padded;  // stages 1-2 pad the full buffers to 2·W
  return {stage == 3 ? part.part : full, stage >= 2 ? part.part : full, stage == 0 ? numel : part.part};
}

// ZeRO-3's persistent units (DeepSpeed: numel <= param_persistence_threshold while the
// persistent total stays within model_persistence_threshold; here per unit): gathered once, kept.
std::vector<bool> persistent_units(const ZeroConfig& zero, const std::vector<ParamUnit>& units);

// Stage 3's gather buffers over one step, as ZeroOptimizer's fetch/release policy takes them
// along `trace` (the units one step fetches, each released right after its use): the unit in
// use, prefetches within min(prefetch_bucket_size, the live budget), units kept for reuse within
// max_reuse_distance, persistent ones. A freed buffer is kept for the next gather of its size,
// so the memory is the most buffers of each size ever live together. The memory planner counts
// `allocated` (elements), of it at most `prefetched` held by prefetches at once; the
// communication planner counts `gathers`, the gathers of a steady step (the second) in the
// order they start, each as (unit, trace position that started it).
struct GatherElems {
  int64_t allocated = 0, prefetched = 0;
  std::vector<std::pair<int, size_t>> gathers;
};
// simulate_gathers' decisions as they happen, for a planner that follows them further (the gather
// staging below): before each step, whether to simulate it (it must say yes to steps 0 and 1);
// a gather started for trace entry k; the fetch that waits for it; a unit freed (`pending`: an
// unused prefetch). All four must be set.
struct GatherEvents {
  std::function<bool(int)> next_step;
  std::function<void(int, size_t)> start;
  std::function<void(int)> use;
  std::function<void(int, bool)> free;
};
GatherElems simulate_gathers(const ZeroConfig& zero, const std::vector<ParamUnit>& units, const std::vector<int>& trace,
                             const GatherEvents* events = nullptr);

// Bytes a checkpoint save stages on this rank for state that does not lie in memory as fp32
// (ZeroOptimizer::checkpoint_arrays: offloaded master and moments read back from their tier,
// 16-bit master weights or moments widened), `n` elements per state, held until the next
// step; at the start the parameters' raw bits are read beside their fp32 copy. The memory
// planner counts this when a run saves (NVMe offload made the plan 28% short without it).
// packed (frozen parameters): every state is staged, unpacked with zeros at frozen elements, and
// with fp32 master weights the parameters too (the 16-bit values widened under the master's).
// quantized_frozen (zero_quantized_nontrainable_weights): the parameters are staged too, dequantised.
inline int64_t checkpoint_staging_bytes(int stage, const ZeroConfig& zero, DType param, int64_t moments, int64_t n,
                                        bool packed = false, bool quantized_frozen = false) {
  const bool mixed = param != DType::F32 && zero.master_weights == DType::F32;
  if (packed) return 4 * n * (moments + (param != DType::F32 || quantized_frozen ? 1 : 0));
  const bool master16 = param != DType::F32 && zero.master_weights != DType::F32;
  const bool offload = zero.offload_optimizer.device != OffloadDevice::None && stage >= 1;
  const bool param_swap = stage == 3 && zero.offload_param.device == OffloadDevice::Nvme;
  const bool params_staged = mixed ? offload : master16 || param_swap;
  const bool bits = !mixed && (master16 || param_swap);  // the raw parameters read beside the staging
  const int64_t states = (params_staged ? 1 : 0) + (offload || zero.optimizer_states != DType::F32 ? moments : 0);
  const int64_t first = params_staged ? 4 * n + (bits ? static_cast<int64_t>(dtype_size(param)) * n : 0) : 0;
  return std::max(first, 4 * n * states);
}

// Bytes held by this rank, by category (what metrics.jsonl reports as "memory").
// params..optimizer_states are bytes in memory; with offload, `host` says how many of them the
// engine placed in host memory (on a CPU-only build the same memory as the device's) and
// `nvme` counts what lies in swap files instead, moved through `swap_buffers`.
struct MemoryBytes {
  int64_t params = 0, grads = 0, master = 0, optimizer_states = 0, comm_buffers = 0, live_params_peak = 0;
  // stage 3: bytes of the gather buffers allocated (in use and kept for the next gather) and the
  // peak of the gathers' byte staging (qwZ, torch_autocast, MiCS hierarchical; in use and kept)
  int64_t gathered = 0;
  int64_t secondary = 0;  // hpZ: bytes of the secondary partition (every unit's slice in the hpZ group)
  int64_t host = 0, nvme = 0, swap_buffers = 0;
  int64_t model_states() const { return params + grads + master + optimizer_states; }
};

// What the step needs to know about the reduced gradients before touching them.
struct GradStats {
  double norm_scaled = 0.0;  // L2 norm of the averaged gradient as held (still loss-scaled)
  bool finite = true;        // no inf/NaN on any rank (the overflow check, agreed by the group)
};

// The element types of the model state (DeepSpeed's model dtype, grad_accum_dtype and
// communication_data_type). torch_autocast: the layout tensors marked in `autocast_tensors`
// (the lower_precision_safe_modules' parameters) have their gradients reduced and, at stage 3,
// their parameters gathered in `autocast` (DeepSpeed's torch_autocast dtype) instead.
struct StateTypes {
  DType param = DType::F32, grad = DType::F32, comm = DType::F32;
  DType autocast = DType::F32;         // F32: no autocast
  std::vector<bool> autocast_tensors;  // per layout tensor (empty: none)
  // model.frozen_parameters: per layout tensor, requires_grad=False (empty: every tensor trains).
  // A frozen tensor's gradient is neither reduced nor counted in the norm, and the optimizer keeps
  // no state for it and never updates it (DeepSpeed builds its groups from trainable parameters).
  std::vector<bool> frozen_tensors;
  bool low(size_t tensor) const {
    return autocast != DType::F32 && tensor < autocast_tensors.size() && autocast_tensors[tensor];
  }
  bool frozen(size_t tensor) const { return tensor < frozen_tensors.size() && frozen_tensors[tensor]; }
  bool any_frozen() const { return std::find(frozen_tensors.begin(), frozen_tensors.end(), true) != frozen_tensors.end(); }
};

// Stage 3's gather staging (ZeroOptimizer's gather_staging_ pool, in model memory) at its peak on
// partition rank `rank`: the byte buffers gathers take besides the unit they land in, kept in the
// pool for the next gather that fits. qwZ: every rank's int8 groups and scales until the unit is
// dequantised, and with 16-bit parameters this rank's slice widened to fp32 for the quantiser
// and each slice dequantised to fp32 before it is rounded; torch_autocast: the unit's bytes with
// the listed tensors in the autocast dtype; MiCS's hierarchical gather (shards of mics_nodes
// nodes × mics_per_node ranks; 0: flat): this position's slices across nodes, then the unit by
// position. The same pool driven by simulate_gathers' decisions along `trace` (backward: which
// entries hpZ gathers in its group), step after step until a step ends with the spares it began
// with. The memory planner counts it; ZeroOptimizer::memory() reports the pool's own peak.
int64_t simulate_gather_staging(const ZeroConfig& zero, const StateTypes& types, const ParamLayout& layout,
                                const std::vector<ParamUnit>& units, const Partition& part, const std::vector<int>& trace,
                                const std::vector<bool>& backward, int mics_nodes = 0, int mics_per_node = 0,
                                int rank = 0);

// The trainable elements of `layout` inside global [begin, end), as sorted ranges relative to
// `begin` (the optimizer's view: the flat buffer at stage 0, a partition otherwise; padding is
// not a tensor and is left out). Used only when any_frozen(): otherwise the optimizer covers its
// whole view, padding included, as before.
std::vector<std::pair<int64_t, int64_t>> trainable_ranges(const ParamLayout& layout, const StateTypes& types,
                                                          int64_t begin, int64_t end);
// The frozen elements of `layout` as sorted local ranges (what grad_stats leaves out).
std::vector<std::pair<int64_t, int64_t>> frozen_ranges(const ParamLayout& layout, const StateTypes& types);

// The gradients of `layout` as the reducer buckets them: one segment per tensor in its
// communication dtype, and the padding up to `n` (a partition's padded size) in comm's.
// qgz_world > 0 (ZeRO++'s qgZ over that many data ranks on several nodes): the tensors qgZ
// quantises carry their group size (qgz_group_size).
std::vector<CommSegment> gradient_segments(const ParamLayout& layout, int64_t n, const StateTypes& types,
                                           int64_t qgz_world = 0);

// DeepSpeed's qgZ groups for a tensor (runtime/comm/coalesced_collectives.py
// all_to_all_quant_reduce): numel / max(shape[0], shape[1], world) values a group; 0 (reduce-
// scattered unquantised, as DeepSpeed falls back) for a one-dimensional tensor or one whose numel
// is not a multiple of 2·world.
int64_t qgz_group_size(const TensorSpec& tensor, int64_t world);

// What a ZeroOptimizer's gradient reducer reduces: the flat buffer whole (stages 0-1, from the
// gradient buffer's type) or each unit's fp32 window (stages 2-3), and with it the staging
// bytes it reserves (one bucket slot, two with overlap_comm). The memory planner counts these.
struct ReduceWork {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::vector<ReduceBucket> buckets;  // one backward's buckets in launch order, cut from `ranges`
  DType source = DType::F32;
  int64_t staging_bytes = 0;
};
ReduceWork reduce_work(int stage, const ZeroConfig& zero, const StateTypes& types, const ParamLayout& layout,
                       const std::vector<ParamUnit>& units, const Partition& part, int64_t qgz_world = 0);

// DeepSpeed's unscale-and-clip in one factor (FACTS §3; stage_1_and_2.py
// unscale_and_clip_grads): c = ((norm_scaled/scale) + 1e-6)/clip, c = max(c, 1); the
// gradients are multiplied by 1/(c·scale). clip <= 0: no clipping, only unscaling.
double unscale_clip_multiplier(double norm_scaled, double loss_scale, double clip);

class ZeroOptimizer : public ParamStore {
 public:
  // partition_numel: the element count Partition splits (default: the layout's). Pipeline
  // stages pass their common maximum so that the tied wte, at local offset 0 on the first and
  // the last stage, is split identically there and its gradient can be summed slice by slice.
  // ordered_backward: in each accumulation-boundary backward, units complete from the layout's
  // end down to 0 (one chunk per rank), so stages 0-1 can launch buckets during backward;
  // otherwise (interleaved chunks) the reduction starts at finish_reduction().
  // global_rank names this rank's swap folder (rank<global_rank>, as DeepSpeed); default: the
  // data-parallel rank. shards: MiCS and hpZ's groups (shard_groups.hpp); with MiCS, `dp` is the
  // shard group, over which everything is partitioned.
  ZeroOptimizer(const ZeroConfig& zero, const OptimizerConfig& opt, StateTypes types, const ParamLayout& layout,
                std::vector<ParamUnit> units, Communicator& dp, int64_t partition_numel = -1,
                bool ordered_backward = true, int global_rank = -1, ShardGroups shards = {});

  // Mixed precision at stages 1-2 fills the 16-bit copy at start-up in tensor groups of at
  // least this many elements (plus at most one tensor): the transient fp32 staging.
  static constexpr int64_t kInitFillElems = int64_t(1) << 22;

  // Sets the parameters from a function that writes elements [begin, end) of the full flat
  // buffer in fp32 into host memory (every rank produces identical values); each rank keeps
  // what its stage needs. No collectives.
  void init_params(const std::function<void(float*, int64_t, int64_t)>& fill);

  // The order in which one optimizer step fetches units (stage 3 prefetches along it); the
  // default is one micro-batch's forward and backward of a one-stage model, repeated. Units
  // gathered for the previous trace are released (an evaluation's, say: a new pass starts clean).
  // backward: which entries are a backward pass's fetches (hpZ gathers those inside its group;
  // empty: none are).
  void set_fetch_trace(std::vector<int> trace, std::vector<bool> backward = {});
  const std::vector<int>& fetch_trace() const { return trace_; }
  const std::vector<bool>& fetch_backward() const { return backward_; }
  // Before each backward pass; `boundary`: the last backward of this step that touches the
  // units it completes (their accumulation ends with it).
  void begin_micro_step(bool boundary);
  // Waits for the gradient reduction still in flight (the exposed communication).
  void finish_reduction();
  // The step in DeepSpeed's order: grad_stats() (collective), then the caller updates its
  // loss scale, then apply_step() with the new scale, or skip_step() on overflow.
  // sq_group: also sums the squares over this group (pipeline × tensor: the model group);
  // skip: sorted local ranges left out of the norm (replicas counted on another rank).
  GradStats grad_stats(Communicator* sq_group = nullptr, const std::vector<std::pair<int64_t, int64_t>>& skip = {});
  // Sums the reduced gradients of local elements [begin, end) over `group` (the tied wte over
  // the embedding group); only this rank's owned part where gradients are partitioned.
  void sum_grad_range(int64_t begin, int64_t end, Communicator& group);
  void apply_step(double lr, std::optional<std::pair<double, double>> betas, double clip, double loss_scale,
                  const GradStats& stats);
  void skip_step();
  // The loss scaler's update (after grad_stats): LoCo's kept errors follow the scale
  // (parallel/quantized_reduce_scatter.hpp).
  void loss_scale_changed(bool overflow, double ratio);
  // LoCo's kept errors on this rank (null: qgZ without LoCo, or off), for checkpoints.
  QuantizedReduceScatter* loco() const { return qgz_ && qgz_->loco() ? qgz_.get() : nullptr; }
  void zero_grad();
  const StateTypes& types() const { return types_; }

  MemoryBytes memory() const;
  // Offload: the start-up line (empty without offload) and the swap traffic since the last call.
  std::string offload_summary() const;
  offload::IoStats take_swap_stats();

  // --- checkpoints: every stage saves and loads the same thing, the flat buffers cut by
  // partition() (each rank its own range), so any stage and world size can load any save.
  // This rank's local range [begin, end) and, per state ("params" then the optimizer's), a
  // pointer to its element `begin`.
  std::pair<int64_t, int64_t> checkpoint_range() const;
  // The part of checkpoint_range() this rank writes: all of it, except on MiCS replicas other
  // than the first (the same shard is saved once).
  std::pair<int64_t, int64_t> save_range() const;
  // This rank's range of each state in fp32, in model memory (device memory on a GPU build:
  // the checkpoint writer copies it to the host as it writes).
  std::vector<std::pair<std::string, const float*>> checkpoint_arrays();
  std::vector<std::string> checkpoint_states() const;  // "params" then the optimizer's
  int64_t optimizer_step() const { return offloaded_ ? offloaded_->step_count() : optimizer_->step_count(); }
  // Local part of a load: fills this rank's range of each state through
  // read(state, local_begin, local_end, out), which writes host memory (no collectives; may
  // throw InputError).
  using RangeReader = std::function<void(const std::string&, int64_t, int64_t, float*)>;
  void read_checkpoint(const RangeReader& read, int64_t optimizer_step);
  // Collective part: rebuilds replicated buffers from the ranks' ranges.
  void finish_checkpoint_load();
  // zero_quantized_nontrainable_weights: the frozen pieces' int8 codes and scales as this rank
  // holds them (nullopt: not quantised), and their restore from a save of the same pieces (false:
  // the save's pieces differ, and the values read from "params" were quantised afresh).
  bool quantizes_frozen() const { return quantized_frozen_; }
  std::optional<RankState> quantized_frozen_state() const;
  bool restore_quantized_frozen(const RankState& saved);
  // Another layout: the saved scales by each group's first global element, the codes from the
  // saved dequantised values (false: a group's scale is missing; the store is left as it was).
  bool restore_quantized_frozen_scales(const std::map<int64_t, float>& scales, const RangeReader& read);
  int stage() const { return stage_; }
  const Partition& partition() const { return part_; }

  // ParamStore
  const void* fetch(int u) override;
  void release(int u) override;
  float* grad_target(int u) override;
  bool grads_start_at_zero(int) override { return use_windows_; }
  void grads_done(int u) override;
  void progress() override;

 private:
  struct Gathered {
    TypedBuffer buffer;
    std::unique_ptr<CommRequest> pending;  // prefetch in flight
    kernels::StagingBuffer packed;         // torch_autocast: the gather's bytes, mixed dtypes (else empty)
    bool hierarchical = false;             // MiCS hierarchical: `packed` holds the slices by node position
    std::optional<QuantizedGatherPlan> quantized;  // qwZ: `packed` holds every rank's int8 groups and scales,
    std::vector<int64_t> displs;                   // and rank r's slice goes to displs[r] in the unit
    bool primary = true;                   // gathered over the whole partition group (hpZ: fills the secondary)
    int frozen = -1;                       // quantized frozen pieces: the unit whose FrozenGatherPlan `packed` holds
  };
  // param_fetch.cpp. k: the trace entry the gather is for (hpZ: a backward entry reads the
  // secondary partition).
  void start_gather(int u, size_t k);
  void unpack_gathered(int u, Gathered& g);
  // qwZ: the slices (counts, displs in the unit) over `group`, own = this rank's, quantised.
  void start_quantized_gather(Communicator& group, Gathered& g, std::vector<int64_t> counts,
                              std::vector<int64_t> displs, const void* own);
  void unpack_quantized(Gathered& g);
  // quantized_frozen.cpp: the int8 store of the frozen pieces (zero_quantized_nontrainable_weights).
  void setup_quantized_frozen();
  void load_quantized_partition(const std::function<void(float*, int64_t, int64_t)>& values);
  void start_frozen_gather(int u, Gathered& g);
  void unpack_frozen(int u, Gathered& g);
  void quantized_partition_values(float* out);
  // shard_groups.cpp: MiCS's hierarchical gather, hpZ's secondary partition.
  void start_hierarchical_gather(int u, Gathered& g, const void* own);
  void unpack_hierarchical(int u, Gathered& g);
  bool gathers_secondary(int u, size_t k) const;
  void start_secondary_gather(int u, Gathered& g);
  void keep_secondary(int u, const Gathered& g);
  void reduce_over_replicas();
  void free_gathered(int u);
  bool keep_after_use(int u) const;  // stage 3: persistent, or reused soon enough
  float* window_for(int u);
  int window_key(int u) const;
  void gather_updated_params();
  void all_gather_replicated(void* full, DType type);  // every rank's owned(r, 0, Ψ) range of a full buffer
  void cast_master_to_params();  // this rank's owned range, rounded to the parameter type
  struct MasterCast {
    TypedSpan params;           // where the first cast element goes (null: nothing to cast)
    int64_t master_offset = 0;  // the first cast element in master_
    int64_t count = 0;
  };
  MasterCast master_cast();
  // Rounds fp32 values of partition-local [begin, begin + n) into the parameters (owned part only).
  void cast_range_to_params(int64_t begin, int64_t n, const float* values);
  void drop_gathered_params();   // stage 3, end of a step: gathered copies are stale or unneeded
  // Whether this step's gradients are averaged over the data-parallel group (not for a 1-bit
  // optimizer past its freeze: FACTS-2 §5.3, DeepSpeed's enable_backward_allreduce = False).
  bool reduces_gradients() const { return !optimizer_ || optimizer_->backward_allreduce(); }
  // This rank's averaged gradients: the partition (stages 1-3) or the whole buffer (stage 0).
  const void* grad_partition() const { return stage_ == 1 ? grads_.at(part_.begin(rank_)) : grads_.data(); }

  ZeroConfig cfg_;
  StateTypes types_;
  const bool mixed_;        // 16-bit parameters with an fp32 master copy
  // bf16_master_weights_and_grads: the bf16 parameter partition is the master, updated where it
  // lies (no fp32 copy; DeepSpeed's stage 3 shares it likewise). Stages 1-3 only.
  const bool master16_;
  const bool use_windows_;  // backward writes fp32 unit windows instead of the gradient buffer
  const ParamLayout& layout_;
  std::vector<ParamUnit> units_;
  Communicator& dp_;
  int rank_, world_, stage_;
  Partition part_;

  TypedBuffer params_;      // full (stages 0-2) or this rank's partition (stage 3)
  TypedBuffer grads_;       // full (stages 0-1) or this rank's partition (stages 2-3)
  FlatBuffer master_;       // mixed only: fp32 params, full (stage 0) or this rank's partition
  // Frozen parameters: the trainable ranges of the optimizer's view (nullopt: none frozen); the
  // master copy and the optimizer states hold these elements packed.
  std::optional<std::vector<std::pair<int64_t, int64_t>>> trainable_;
  std::vector<std::pair<int64_t, int64_t>> frozen_;  // the frozen tensors' global ranges, left out of the norm
  // zero_quantized_nontrainable_weights at stage 3: params_ holds the trainable elements packed,
  // frozen_store_ each frozen piece's scales and codes (at frozen_store_at_), and every unit's
  // gather has its plan.
  bool quantized_frozen_ = false;
  std::vector<FrozenPiece> frozen_store_pieces_;
  std::vector<int64_t> frozen_store_at_;
  TypedBuffer frozen_store_;
  std::vector<FrozenGatherPlan> frozen_plans_;
  ParamLayout state_layout_;  // stages 1-3: the optimizer sees one tensor, the partition
  std::unique_ptr<Optimizer> optimizer_;          // state in device memory, or:
  std::unique_ptr<offload::OffloadedOptimizer> offloaded_;  // offload_optimizer cpu / nvme
  std::vector<FlatBuffer> ckpt_staging_;  // state read back or widened for a save (model memory)
  kernels::DeviceScratch staging_{"zero_host_values"};  // host values a kernel reads (GPU build; unused on a CPU build)
  std::unique_ptr<offload::ParamSwapper> param_swap_;  // stage 3, offload_param nvme: params_ is empty
  kernels::HostBuffer swap_step_stage_{"param_swap_step", 0, /*pinned=*/true};  // a sub-group's swapped parameters in a step
  // Partition-local parameters [begin, begin + n) in the parameter type, wherever they lie.
  void read_params(int64_t begin, int64_t n, void* out);
  void write_params(int64_t begin, int64_t n, const void* in);
  // The same into model memory (to_model) or back from it (the step's staged partition).
  void move_params_through_host(int64_t begin, int64_t n, void* model, bool to_model);
  // This rank's slice [lo, hi) of unit u where a kernel reads it: its place in model memory, or
  // (the partition in swap files) the swapped slice, copied into the gather buffer's own slot on a GPU build.
  const void* own_slice(int u, Gathered& g, int64_t lo, int64_t hi);
  std::unique_ptr<GradientReducer> reducer_;
  std::unique_ptr<QuantizedReduceScatter> qgz_;  // ZeRO++'s qgZ (null: off, or the data group on one node)
  bool boundary_ = false;
  bool ordered_backward_ = true;
  bool reduction_begun_ = false;  // stages 0-1: the boundary reduction has its frontier set

  // gradient windows (unit 0, the last unit, and two alternating block windows)
  std::map<int, FlatBuffer> windows_;

  // stage 3: gathered units and the fetch trace
  std::map<int, Gathered> gathered_;
  std::vector<TypedBuffer> spare_gathers_;  // freed gather buffers, reused: no allocation or page faults per gather
  int64_t gathered_bytes_ = 0;               // of every gather buffer allocated (they are kept, in use or spare)
  // torch_autocast at stage 3: each unit's tensors with the dtype each is gathered in, whether a
  // unit has any in the autocast dtype, and the packed gathers' byte buffers.
  std::vector<std::vector<CommSegment>> gather_segments_;
  std::vector<bool> gather_mixed_;
  BasicPool<kernels::StagingBuffer> gather_staging_;  // in model memory, where the conversions run
  std::vector<bool> persistent_;
  std::vector<int> trace_;
  std::vector<bool> backward_;  // per trace entry: a backward pass's fetch
  size_t trace_pos_ = 0;
  ShardGroups shards_;
  // hpZ: each unit's slice of the secondary partition, and whether it holds this step's values
  std::vector<TypedBuffer> secondary_;
  std::vector<bool> secondary_valid_;  // index in trace_ of the current (or next) fetch
  int64_t live_elems_ = 0, live_peak_elems_ = 0;
};

}  // namespace zero3d
