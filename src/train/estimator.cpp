// estimator.cpp
#include "train/estimator.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "io/h5.hpp"
#include "kernels/attention.hpp"
#include "model/bf16_activations.hpp"
#include "model/model.hpp"
#include "parallel/compressed_allreduce.hpp"
#include "parallel/pipe_schedule.hpp"
#include "parallel/quantized_reduce_scatter.hpp"
#include "train/rank_plan.hpp"
#include "zero/zero.hpp"

namespace zero3d {

namespace {
constexpr double kGiB = 1073741824.0;  // DeepSpeed prints GB = bytes / 2^30
// Fixed resident memory of a zero3d rank before any model: MPI, Kokkos, HDF5, OpenBLAS
// buffers and the executable, measured as the peak RSS of a 28k-parameter run (np 2).
constexpr int64_t kRuntimeBytes = 30 * 1000 * 1000;
// A job of one rank maps more of its libraries at start-up (measured on a 2-layer C 64 model:
// 6.4 MB more resident at np 1 than at np 2 and 4, fp32 and bf16, under mpirun or alone; the
// file-backed pages of oneDNN, OpenBLAS, libcrypto and gnutls, anonymous memory unchanged).
constexpr int64_t kSingleRankRuntimeBytes = 6 * 1000 * 1000;
constexpr int64_t kCheckpointWriterBytes = 18 * 1000 * 1000;  // HDF5's buffers of a shard write (rank_budget)

// Products of user-sized dimensions (B·T·V, B·H·T²) can leave int64: such terms are computed
// in double and capped here, far above any machine and low enough that sums stay in int64.
constexpr double kBytesCap = 1152921504606846976.0;  // 2^60
int64_t capped(double bytes) { return static_cast<int64_t>(std::min(bytes, kBytesCap)); }

std::string plural(int n, const char* word) { return std::to_string(n) + " " + word + (n > 1 ? "s" : ""); }
}  // namespace

std::vector<DeepSpeedEstimateRow> deepspeed_zero2_rows(double P, int g, int n, double f) {
  const double total_gpus = double(g) * n;
  std::vector<DeepSpeedEstimateRow> rows;
  // offload_optimizer=cpu: gpu = 2P, cpu = P·max(4·total_gpus, 16)·f (DeepSpeed uses total_gpus)
  rows.push_back({std::trunc(P * std::max(4.0 * total_gpus, 16.0) * f), std::trunc(2 * P), "offload_optimizer=cpu "});
  // none: gpu = 2P + int(18P/total_gpus) (DeepSpeed since Jun-2024; its docs print the older 4P + 16P/N)
  rows.push_back({std::trunc(P * 4 * g * f), std::trunc(2 * P + std::trunc(18 * P / total_gpus)),
                  "offload_optimizer=none"});
  return rows;
}

std::vector<DeepSpeedEstimateRow> deepspeed_zero3_rows(double P, double L, int g, int n, double f) {
  const double total_gpus = double(g) * n, gf = 1.0 / n, llm = 4 * L;
  auto opts = [](bool opt, bool param, bool zero_init) {
    return std::string("offload_param=") + (param ? "cpu " : "none") + ", offload_optimizer=" + (opt ? "cpu " : "none") +
           ", zero_init=" + (zero_init ? "1" : "0");
  };
  auto i64 = [](double x) { return std::trunc(x); };  // DeepSpeed's int(): truncation
  std::vector<DeepSpeedEstimateRow> rows;
  rows.push_back({i64(P * 18 * gf * f), i64(llm), opts(true, true, true)});
  rows.push_back({i64(P * std::max(4.0 * g, 18 * gf) * f), i64(llm), opts(true, true, false)});
  const double gpu_opt = llm + std::trunc(2 * P / total_gpus);
  rows.push_back({i64(P * 16 * gf * f), i64(gpu_opt), opts(true, false, true)});
  rows.push_back({i64(P * std::max(4.0 * g, 16 * gf) * f), i64(gpu_opt), opts(true, false, false)});
  const double gpu_none = llm + std::trunc(18 * P / total_gpus);
  rows.push_back({i64(L * 4 * g * f), i64(gpu_none), opts(false, false, true)});
  rows.push_back({i64(P * 4 * g * f), i64(gpu_none), opts(false, false, false)});
  return rows;
}

std::string deepspeed_table(const std::vector<DeepSpeedEstimateRow>& rows, double P, double L, int g, int n) {
  char line[256];
  std::string out = "Estimated memory needed for params, optim states and gradients for a:\n";
  out += "HW: Setup with " + plural(n, "node") + ", " + plural(g, "GPU") + " per node.\n";
  std::snprintf(line, sizeof(line), "SW: Model with %lldM total params", (long long)int64_t(P / 1e6));
  out += line;
  if (L >= 0) {
    std::snprintf(line, sizeof(line), ", %lldM largest layer params", (long long)int64_t(L / 1e6));
    out += line;
  }
  out += ".\n  per CPU  |  per GPU |   Options\n";
  for (const auto& r : rows) {
    std::snprintf(line, sizeof(line), " %7.2fGB | %6.2fGB | %s\n", r.cpu_bytes / kGiB, r.gpu_bytes / kGiB, r.options.c_str());
    out += line;
  }
  return out;
}

MoeRouting moe_routing_of(const MoeConfig& m, uint64_t seed) {
  MoeRouting r;
  if (!m.enabled()) return r;
  r.k = static_cast<int>(m.k);
  r.capacity_factor = m.capacity_factor;
  r.eval_capacity_factor = m.eval_capacity_factor;
  r.min_capacity = m.min_capacity;
  r.drop_tokens = m.drop_tokens;
  r.use_rts = m.use_rts;
  r.top2_2nd_expert_sampling = m.top2_2nd_expert_sampling;
  r.noise = m.noisy_gate_policy == "Jitter"    ? kernels::moe::NoisyGate::Jitter
            : m.noisy_gate_policy == "RSample" ? kernels::moe::NoisyGate::RSample
                                               : kernels::moe::NoisyGate::None;
  r.aux_loss_coef = m.aux_loss_coef;
  r.mixtral = m.mixtral_routing;
  r.router_jitter_noise = m.router_jitter_noise;
  r.seed = seed;
  return r;
}

ModelCounts count_model(const ModelConfig& m) {
  const GPTShape shape = gpt_shape_of(m);
  const ParamLayout layout = gpt_layout(shape);
  ModelCounts c;
  c.params = layout.total();  // wte counted once: the LM head shares it
  c.active_params = gpt_active_params(shape, m.moe.k);
  // A "layer" is a module's own parameters: weight and bias together (DeepSpeed's L).
  std::map<std::string, int64_t> modules;
  for (const TensorSpec& t : layout.tensors()) modules[t.name.substr(0, t.name.find_last_of('.'))] += t.numel;
  for (const auto& [name, n] : modules)
    if (n > c.largest_layer) c.largest_layer = n, c.largest_layer_name = name;
  return c;
}

nlohmann::json MemoryBudget::to_json() const {
  return {{"stage", stage},
          {"pipe_stage", pipe_stage},
          {"tensor_rank", tensor_rank},
          {"micro_batch", micro_batch},
          {"in_flight", in_flight},
          {"params", params},
          {"grads", grads},
          {"master", master},
          {"optimizer_states", optimizer_states},
          {"host", offload_host},
          {"nvme", offload_nvme},
          {"comm_reduce", comm_reduce},
          {"comm_gather", comm_gather},
          {"comm_prefetch", comm_prefetch},
          {"live_params", live_params},
          {"activations", activations},
          {"activations_host", activations_host},
          {"activations_none", activations_none},
          {"activations_selective", activations_selective},
          {"activations_checkpointed", activations_checkpointed},
          {"workspace", workspace},
          {"runtime", runtime},
          {"model_states", model_states()},
          {"total", total()},
          {"device_total", device_total()}};
}

RankLayout rank_layout(const Config& cfg, int64_t world) {
  RankLayout r;
  r.stages = std::max(1, cfg.pipeline.stages);
  r.tensor = std::max(1, cfg.tensor.size);
  r.data = std::max<int64_t>(1, world / (int64_t(r.stages) * r.tensor));
  return r;
}

std::string layout_text(const RankLayout& l, int64_t world) {
  return std::to_string(world) + (world == 1 ? " rank = " : " ranks = ") + std::to_string(l.stages) +
         (l.stages == 1 ? " pipeline stage x " : " pipeline stages x ") + std::to_string(l.data) + " data-parallel x " +
         std::to_string(l.tensor) + " tensor-parallel";
}

std::vector<RankPlan> plan_ranks(const Config& cfg, int64_t trace_micro_batches) {
  const ModelConfig& m = cfg.model;
  const GPTShape shape = gpt_shape_of(m);
  const int stages = std::max(1, cfg.pipeline.stages), t = std::max(1, cfg.tensor.size);
  const int ep = static_cast<int>(std::max<int64_t>(1, m.moe.ep_size));
  const std::vector<int> bounds =
      cfg.pipe_bounds.size() >= 2 ? cfg.pipe_bounds : std::vector<int>{0, static_cast<int>(m.n_layer) + 2};
  std::vector<RankPlan> plans(static_cast<size_t>(stages));
  int64_t largest = 0;
  for (int s = 0; s < stages; ++s) {
    RankPlan& p = plans[s];
    p.pipe_stage = s;
    p.part = gpt_model_part(shape, bounds, stages, s, t, 0, ep, 0);  // every expert rank holds E/ep experts
    largest = std::max(largest, p.part.expert_begin);
    // Buffers in flight stop growing once m reaches the warm-up (at most (v+1)·p forwards), so
    // a long accumulation is planned with (2v+2)·p micro-batches (a multiple of p, as
    // interleaving needs): same num_buffers and split, without materialising a huge schedule.
    const int64_t v = std::max(1, cfg.pipeline.virtual_stages), saturated = (2 * v + 2) * stages;
    const int64_t micro = std::max<int64_t>(1, cfg.batch.gradient_accumulation_steps);
    const pipe::ScheduleSpec spec{cfg.pipeline.schedule, stages, static_cast<int>(std::min(micro, saturated)),
                                  cfg.pipeline.virtual_stages};
    const pipe::StageSchedule schedule = pipe::make_schedule(spec, s);
    p.num_buffers = schedule.num_buffers;
    for (const auto& step : schedule.steps)
      for (const pipe::Instruction& in : step) p.split = p.split || in.op == pipe::Op::BackwardInput;
    // Engine::setup_local's trace (forward and backward fetch orders along the schedule); a
    // step's pattern repeats every micro-batch, so four of them show what more would hold.
    const int64_t traced = trace_micro_batches > 0 ? trace_micro_batches : std::min<int64_t>(micro, 4);
    const pipe::ScheduleSpec trace_spec{cfg.pipeline.schedule, stages, static_cast<int>(traced), cfg.pipeline.virtual_stages};
    for (const auto& step : pipe::make_schedule(trace_spec, s).steps)
      for (const pipe::Instruction& in : step) {
        const bool forward = in.op == pipe::Op::Forward;
        if (!forward && in.op != pipe::Op::Backward && in.op != pipe::Op::BackwardInput) continue;
        for (int u : gpt_fetch_order(shape, p.part, cfg.activation_checkpointing, in.chunk, forward))
          if (p.part.first_expert_unit < 0 || u < p.part.first_expert_unit) {
            p.trace.push_back(u);
            p.trace_backward.push_back(!forward);
          } else {
            p.expert_trace.push_back(u - p.part.first_expert_unit);
          }
      }
  }
  for (RankPlan& p : plans) p.partition_numel = stages > 1 ? largest : p.part.expert_begin;
  return plans;
}

StateTypes state_types_of(const Config& cfg, const ParamLayout& layout) {
  const PrecisionConfig& pc = cfg.precision;
  StateTypes t;
  t.param = pc.param;
  t.grad = pc.grad_accum;
  t.comm = pc.comm;
  if (pc.autocast.enabled()) {  // the listed modules' tensors communicate in the autocast dtype
    t.autocast = pc.autocast.dtype;
    for (const TensorSpec& s : layout.tensors()) t.autocast_tensors.push_back(low_precision_tensor(s.name, pc.autocast.modules));
  }
  if (!cfg.model.frozen_parameters.empty()) {  // requires_grad=False tensors (config/frozen.cpp)
    std::vector<std::string> names;
    for (const TensorSpec& s : layout.tensors()) names.push_back(s.name);
    t.frozen_tensors = frozen_parameters_among(names, cfg.model.frozen_parameters);
  }
  return t;
}

namespace {

// model.frozen_parameters: the optimizer-state elements ZeroOptimizer keeps (the trainable ones of
// its view, zero/zero.hpp trainable_ranges), the most of any partition rank; without frozen
// parameters `state_elems`, every element of the view.
int64_t trainable_state_elems(const Config& cfg, const ParamLayout& layout, int stage, const Partition& part,
                              int64_t state_elems) {
  const StateTypes types = state_types_of(cfg, layout);
  if (!types.any_frozen()) return state_elems;
  auto count = [&](int64_t lo, int64_t hi) {
    int64_t n = 0;
    for (const auto& [a, b] : trainable_ranges(layout, types, lo, hi)) n += b - a;
    return n;
  };
  if (stage == 0) return count(0, layout.total());
  int64_t most = 0;
  for (int r = 0; r < part.world; ++r) most = std::max(most, count(part.begin(r), part.begin(r) + part.part));
  return most;
}

// MoE experts: their own ZeroOptimizer over the expert-data group (dp/ep ranks) allocates the
// same table's buffers for the rank's E/ep experts per MoE block (Engine::setup_expert_optimizer),
// plus one fp32 gradient window of an Experts unit (stages 2-3, 16-bit gradients), its reduction
// staging (stages 1-3) and, at stage 3, the gathered unit in use and its gather staging.
void add_expert_states(const Config& cfg, const RankPlan& plan, int64_t dp, MemoryBudget& b) {
  const int64_t xe = plan.part.expert_layout.total();
  if (xe == 0) return;
  const PrecisionConfig& pc = cfg.precision;
  const int64_t ps = static_cast<int64_t>(dtype_size(pc.param)), gs = static_cast<int64_t>(dtype_size(pc.grad_accum));
  const Partition part(xe, static_cast<int>(std::max<int64_t>(1, dp / std::max<int64_t>(1, cfg.model.moe.ep_size))));
  const ZeroStateElems x = zero_state_elems(b.stage, xe, part);
  const int64_t moments = static_cast<int64_t>(optimizer_state_names(cfg.optimizer).size());
  b.params += ps * x.params;
  b.grads += gs * x.grads;
  // As the dense state: no fp32 master under bf16_master_weights_and_grads, bf16 moments under
  // bf16_optimizer_states.
  b.master += pc.param != DType::F32 && cfg.zero.master_weights == DType::F32 ? 4 * x.state : 0;
  b.optimizer_states += static_cast<int64_t>(dtype_size(cfg.zero.optimizer_states)) * moments * x.state;
  // its offloaded optimizer's host stages, as the dense one's (rank_budget)
  const int64_t stages = offload_stage_bytes(cfg, b.stage, x.state, cfg.backend == kernels::Backend::Cpu);
  b.workspace += stages;
  b.offload_host += stages;
  int64_t unit = 0;
  for (const ParamUnit& u : plan.part.expert_units) unit = std::max(unit, u.numel);
  if (b.stage >= 2 || pc.grad_accum != DType::F32) b.comm_reduce += 4 * unit;
  b.comm_reduce += reduce_work(b.stage, cfg.zero, state_types_of(cfg, plan.part.expert_layout), plan.part.expert_layout,
                               plan.part.expert_units, part)
                       .staging_bytes;
  if (b.stage == 3) {
    // its gathered units as the dense ones' (ZeroOptimizer's fetch and release decisions along
    // the experts' fetch trace): the unit in use, prefetches, the rest kept for reuse
    const GatherElems g = simulate_gathers(cfg.zero, plan.part.expert_units, plan.expert_trace);
    const int64_t gathered = std::max(g.allocated, unit), prefetch = std::min(g.prefetched, gathered - unit);
    b.comm_gather += ps * unit;
    b.comm_prefetch += ps * prefetch;
    b.live_params += ps * (gathered - unit - prefetch);
    // its own gather staging pool (qwZ's packed groups and conversions, torch_autocast's packed
    // units) along the experts' fetch trace; MiCS and hpZ are refused with MoE
    b.comm_gather += simulate_gather_staging(cfg.zero, state_types_of(cfg, plan.part.expert_layout),
                                             plan.part.expert_layout, plan.part.expert_units, part, plan.expert_trace, {});
  }
}

MemoryBudget rank_budget(const Config& cfg, const RankPlan& plan, int64_t dp, int stage, int64_t ranks_per_node = 0) {
  const ModelConfig& m = cfg.model;
  const GPTShape shape = gpt_shape_of(m);
  // The dense state; MoE experts have an optimizer of their own (add_expert_states below).
  const ParamLayout& layout = plan.part.dense_layout;
  const std::vector<ParamUnit>& units = plan.part.dense_units;
  const int64_t psi = layout.total();  // what this rank's model holds (tied wte copy, vocab padding included)
  // MiCS: the state is partitioned over the shard group, replicated across the groups
  const int64_t partition_ranks = cfg.zero.mics_shard_size > 0 && (stage < 0 ? cfg.zero.stage : stage) == 3
                                     ? cfg.zero.mics_shard_size : dp;
  const Partition part(plan.partition_numel, static_cast<int>(partition_ranks));
  MemoryBudget b;
  b.backend = cfg.backend;
  b.stage = stage < 0 ? static_cast<int>(cfg.zero.stage) : stage;
  b.pipe_stage = plan.pipe_stage;
  b.tensor_rank = plan.tensor_rank;
  b.micro_batch = cfg.batch.micro_batch;
  b.in_flight = plan.num_buffers;
  // Model states: what ZeroOptimizer allocates (zero.hpp's table) in the configured dtypes.
  const PrecisionConfig& pc = cfg.precision;
  const int64_t ps = static_cast<int64_t>(dtype_size(pc.param)), gs = static_cast<int64_t>(dtype_size(pc.grad_accum));
  const bool mixed = pc.param != DType::F32;
  const ZeroStateElems elems = zero_state_elems(b.stage, psi, part);  // what ZeroOptimizer allocates
  b.params = ps * elems.params;
  if (b.stage == 3 && cfg.zero.quantized_nontrainable_weights && !m.frozen_parameters.empty()) {
    // zero_quantized_nontrainable_weights: the trainable elements in the model dtype, the frozen
    // pieces as int8 groups and scales (zero/quantized_frozen.hpp), on the rank that holds most.
    const StateTypes frozen_types = state_types_of(cfg, layout);
    b.params = 0;
    for (int r = 0; r < part.world; ++r)
      b.params = std::max(b.params, quantized_frozen_partition_bytes(layout, frozen_types, part, r, ps));
  }
  b.grads = gs * elems.grads;
  const int64_t state_elems = elems.state;
  // fp32 parameters are their own master copy, and so are bf16 ones under
  // bf16_master_weights_and_grads; bf16_optimizer_states halves each moment.
  const bool fp32_master = mixed && cfg.zero.master_weights == DType::F32;
  const int64_t trainable = trainable_state_elems(cfg, layout, b.stage, part, state_elems);  // master and moments
  b.master = fp32_master ? 4 * trainable : 0;
  const int64_t ss = static_cast<int64_t>(dtype_size(cfg.zero.optimizer_states));
  const int64_t moments = static_cast<int64_t>(optimizer_state_names(cfg.optimizer).size());
  b.optimizer_states = ss * moments * trainable;
  // Offload tiers as ZeroOptimizer places them: sub-groups from int((1 - ratio)·G) on leave
  // device memory; NVMe ones go to swap files through buffer slots (workspace), as do stage-3
  // parameters with offload_param nvme (at most max_in_cpu elements cached).
  const OffloadOptimizerConfig& oo = cfg.zero.offload_optimizer;
  int64_t swap_workspace = 0;  // swap buffers and cached parameter slices, added to the workspace below
  if (oo.device != OffloadDevice::None && b.stage >= 1 && state_elems > 0) {
    const int64_t sg = std::max<int64_t>(1, cfg.zero.sub_group_size), groups = (state_elems + sg - 1) / sg;
    const int64_t cut = std::min(groups, static_cast<int64_t>((1.0 - oo.ratio) * static_cast<double>(groups)));
    const int64_t offloaded = state_elems - std::min(state_elems, cut * sg), states = moments + (fp32_master ? 1 : 0);
    const int64_t master_moved = fp32_master ? 4 * offloaded : 0, moments_moved = ss * moments * offloaded;
    if (oo.device == OffloadDevice::Cpu) {
      b.offload_host = master_moved + moments_moved;
    } else if (offloaded > 0) {
      b.offload_nvme = master_moved + moments_moved;
      b.master -= master_moved;
      b.optimizer_states -= moments_moved;
      const int64_t slots = std::max<int64_t>(1, std::min({oo.buffer_count / states,
                                                           int64_t(1 + oo.pipeline_read + oo.pipeline_write),
                                                           groups - cut}));
      const auto pages = [](int64_t bytes) { return (bytes + 4095) / 4096 * 4096; };
      const int64_t largest = std::min(sg, offloaded);  // the largest offloaded sub-group
      swap_workspace += slots * ((fp32_master ? pages(largest * 4) : 0) + moments * pages(largest * ss));
    }
  }
  // offload_param cpu: the partition in (page-locked) host memory, whatever the optimizer's placement
  if (b.stage == 3 && cfg.zero.offload_param.device == OffloadDevice::Cpu) b.offload_host += b.params;
  // The offloaded optimizer's host stages: in the total (as workspace), and in host memory.
  const int64_t stages = offload_stage_bytes(cfg, b.stage, state_elems, cfg.backend == kernels::Backend::Cpu);
  b.workspace += stages;
  b.offload_host += stages;
  const OffloadParamConfig& op = cfg.zero.offload_param;
  if (b.stage == 3 && op.device == OffloadDevice::Nvme) {
    b.offload_nvme += b.params;
    b.offload_nvme_params = b.params;
    // ParamSwapper: cached unit slices (whole slices within max_in_cpu, plus the one read over
    // it before the next eviction) and a scratch slice for writes to uncached units; with the
    // optimizer offloaded too, each sub-group's parameters read (or rounded) in memory for its update.
    int64_t slice = 1;
    for (const ParamUnit& u : units)
      for (int r = 0; r < part.world; ++r) {
        const auto [lo, hi] = part.owned(r, u.offset, u.offset + u.numel);
        slice = std::max(slice, hi - lo);
      }
    swap_workspace += ps * std::min(part.part, (op.max_in_cpu / slice + 1) * slice) + ps * slice;
    if (oo.device != OffloadDevice::None) swap_workspace += ps * std::min(cfg.zero.sub_group_size, part.part);
    // The in-memory optimizer updating the parameters themselves (no fp32 master copy) reads
    // the whole partition back for the step (zero.cpp apply_step).
    if (oo.device == OffloadDevice::None && !fp32_master) swap_workspace += b.params;
    b.params = 0;
  }
  // Communication: reduce-scatter staging (rank 0's part of the buckets in flight, in the
  // communication dtype), send buffers for buckets converted to that dtype, and the fp32
  // gradient windows (the units that are not blocks: embeddings, ln_f, the tied wte copy;
  // one block, two with overlap_comm) that stages 2-3 and 16-bit gradients use. Parameter
  // all-gathers are in place (stages 1-2) or land in the gathered units (stage 3).
  int64_t largest_block = 0, largest_unit = 0, largest_tensor = 0, non_block = 0;
  for (const ParamUnit& u : units) {
    largest_unit = std::max(largest_unit, u.numel);
    if (u.kind == UnitKind::Block) largest_block = std::max(largest_block, u.numel);
    else non_block += u.numel;
  }
  for (const TensorSpec& t : layout.tensors()) largest_tensor = std::max(largest_tensor, t.numel);
  const bool overlap = cfg.zero.overlap_comm;
  // The reducer's bucket slots (one, two with overlap_comm: DeepSpeed double-buffers
  // reduce_bucket_size), sized by the buckets it cuts, as ZeroOptimizer reserves them.
  const StateTypes types = state_types_of(cfg, layout);
  const QgzPlacement qgz = qgz_placement(cfg.zero, b.stage, dp, ranks_per_node);
  const ReduceWork work = reduce_work(b.stage, cfg.zero, types, layout, units, part, qgz.world());
  b.comm_reduce = work.staging_bytes;
  // qgZ's own staging (QuantizedReduceScatter): each buffer grows to its largest over the
  // quantised buckets, as qgz_staging sizes them for data rank 0; LoCo keeps each bucket's errors
  // besides (loco_kept_bytes).
  if (qgz.on()) {
    const bool loco = cfg.zero.loco.enabled;
    QgzStaging peak;
    for (const ReduceBucket& k : work.buckets)
      if (k.quant_group > 0) {
        const std::vector<int64_t> counts = part.counts(k.begin, k.end);
        peak.grow(qgz_staging(qgz_blocks(counts, k.quant_group), qgz.nodes, qgz.per_node, 0, loco));
        if (loco) b.comm_reduce += loco_kept_bytes(counts, k.quant_group, qgz.nodes, qgz.per_node, 0);
      }
    b.comm_reduce += peak.total();
  }
  const bool windows = b.stage >= 2 || pc.grad_accum != DType::F32;
  if (windows) b.comm_reduce += 4 * (non_block + largest_block * (overlap ? 2 : 1));
  // MPI's own temporary for a whole-bucket reduction at stages 0-1: (N-1)/N of the message
  // (measured on gpt-small-cpu at np 2: the peak grows by half the gradient bytes; the per-unit
  // reductions of stages 2-3 showed no such growth).
  if (dp > 1 && b.stage <= 1 && !work.ranges.empty()) {
    int64_t largest_bucket = 0;
    const int64_t n = work.ranges.front().second;
    for (const ReduceBucket& k : cut_buckets(gradient_segments(layout, n, types), 0, n, cfg.zero.reduce_bucket_size, pc.comm))
      largest_bucket = std::max(largest_bucket, (k.end - k.begin) * static_cast<int64_t>(dtype_size(k.type)));
    b.comm_reduce += largest_bucket * (dp - 1) / dp;
  }
  // A 1-bit optimizer past its freeze (FACTS-2 §5): worker error buffers of the padded size and
  // server error buffers of padded/W (optim/onebit.hpp) — per tensor, or for OneBitLamb once over
  // all momenta as one flat buffer —, the compressed all-reduce's fp32 scratch and packed signs
  // for the largest buffer it is given, and the widened gradient the step reads when it is
  // clipped or 16-bit; 0/1 Adam's accumulator (and the copy of a gradient it compresses), 1-bit
  // Lamb's copy of the last momenta and its padded flat momentum (and an update tensor).
  if (cfg.optimizer.one_bit() && dp > 1) {
    int64_t largest_padded = 0, largest = 0;
    const auto errors = [&](int64_t numel) {
      const int64_t padded = onebit_padded_size(numel, static_cast<int>(dp));
      b.comm_reduce += 4 * (padded + padded / dp);
      largest_padded = std::max(largest_padded, padded);
    };
    if (cfg.optimizer.type == OptimizerType::OneBitLamb) errors(layout.total());
    for (const TensorSpec& t : layout.tensors()) {
      if (cfg.optimizer.type != OptimizerType::OneBitLamb) errors(t.numel);
      largest = std::max(largest, t.numel);
    }
    b.comm_reduce += 4 * (largest_padded + largest_padded / dp) + 3 * (largest_padded / 8) + 4 * layout.total();
    if (cfg.optimizer.type == OptimizerType::ZeroOneAdam) b.comm_reduce += 4 * (layout.total() + largest);
    if (cfg.optimizer.type == OptimizerType::OneBitLamb) b.comm_reduce += 4 * (layout.total() + largest_padded + largest);
  }
  if (b.stage == 3) {
    // Gathered units: ZeroOptimizer's fetch and release decisions along the step's trace
    // (simulate_gathers), split by purpose: the unit in use (the largest), prefetches, the rest
    // kept for reuse or persistent.
    const GatherElems g = simulate_gathers(cfg.zero, units, plan.trace);
    const int64_t gathered = std::max(g.allocated, largest_unit);
    const int64_t prefetch = std::min(g.prefetched, gathered - largest_unit);
    b.comm_gather = ps * largest_unit;
    b.comm_prefetch = ps * prefetch;
    b.live_params = ps * (gathered - largest_unit - prefetch);
    // The gathers' byte staging (ZeroOptimizer's gather_staging_: qwZ's int8 groups and fp32
    // conversions, torch_autocast's packed bytes, MiCS hierarchical's two steps), beside the unit
    // in use: the pool's peak on data rank 0, simulated along the trace.
    int mics_nodes = 0, mics_per_node = 0;
    if (cfg.zero.mics_shard_size > 0 && cfg.zero.mics_hierarchical_params_gather) {
      // The shard's ranks on data rank 0's node, ranks filling nodes in order (ProcessTopology
      // pipe_data_model: data rank d of pipeline stage p is world rank (p·dp + d)·t).
      const int64_t t = std::max(1, plan.part.tp_size), per = ranks_per_node > 0 ? ranks_per_node : dp * t;
      const auto node = [&](int64_t d) { return (plan.pipe_stage * dp + d) * t / per; };
      for (int64_t d = 0; d < partition_ranks; ++d) mics_per_node += node(d) == node(0) ? 1 : 0;
      mics_nodes = static_cast<int>(partition_ranks / mics_per_node);
    }
    // (With MoE the engine gives the dense trace no backward entries: hpZ's gathers stay primary.)
    b.comm_gather += simulate_gather_staging(cfg.zero, types, layout, units, part, plan.trace,
                                             plan.part.first_expert_unit >= 0 ? std::vector<bool>{} : plan.trace_backward,
                                             mics_nodes, mics_per_node);
    if (cfg.zero.hpz_partition_size > 1)  // hpZ's secondary partition: each unit's slice in the hpZ group
      for (const ParamUnit& u : units) {
        const auto [lo, hi] = Partition(u.numel, cfg.zero.hpz_partition_size).owned(0, 0, u.numel);
        b.live_params += ps * (hi - lo);
      }
  }
  add_expert_states(cfg, plan, dp, b);
  // Activations: exactly what the engine allocates (Engine::activation_bytes), from the
  // function GPT carves its buffers with (gpt_activation_plan): the schedule's in-flight
  // buffers plus the shared backward scratch and recompute workspace. Local widths C/t, H/t,
  // Vp/t; tokens outside tensor-parallel regions B·T, or B·T/t with sequence parallelism.
  const int64_t Bm = cfg.batch.micro_batch, Tm = m.n_positions;
  // (the plan multiplies in int64: user-sized products past 2^55, bounded here in double with
  // the whole widths, are capped instead.)
  const double B = double(Bm), T = double(Tm), C = double(m.n_embd), BT = B * T, L = double(m.n_layer);
  const double bound =
      4 * (double(plan.num_buffers) * (6 * BT * C + L * (27 * BT * C + 4 * BT + B * double(m.n_head) * T * T) +
                                       BT * double(plan.part.vocab_padded) + 6 * BT +
                                       double(cfg.activation_checkpointing.number_checkpoints) * BT * C) +
           12 * BT * C + double(kernels::kRowBlock) * T + 3 * BT + L * (27 * BT * C + 4 * BT + B * double(m.n_head) * T * T));
  const auto activations = [&](const ActivationCheckpointing& ac, int64_t* host) -> int64_t {
    if (bound >= 36028797018963968.0) return capped(bound);  // 2^55
    const GPTActivationBytes act =
        gpt_activation_bytes(shape, plan.part, Bm, Tm, cfg.tensor.sequence_parallel, plan.split, ac,
                             moe_routing_of(m.moe, cfg.training.seed), cfg.precision.products(), cfg.backend);
    if (host) *host = plan.num_buffers * act.host;
    return plan.num_buffers * act.buffer + act.scratch;
  };
  ActivationCheckpointing selective, every_block;
  selective.interval = every_block.interval = 1;
  selective.granularity = RecomputeGranularity::Selective;
  b.activations = activations(cfg.activation_checkpointing, &b.activations_host);
  b.activations_none = activations(ActivationCheckpointing{}, nullptr);
  b.activations_selective = activations(selective, nullptr);
  b.activations_checkpointed = activations(every_block, nullptr);
  // Workspace: token ids, the start-up product that measures peak GFLOP/s, initial weights
  // read whole by init_from, data held in memory (text bytes and token shards as int32).
  const double V = double(plan.part.vocab_local);
  double workspace = 2 * 4 * BT + 3 * 512 * 512 * 4;
  // 16-bit runs: operand conversions of the matrix products (gemm.cpp) and the tensor groups
  // that fill the 16-bit copy at start-up (stages 1-2). (oneDNN's own code and caches measured
  // within ±5 MB of nothing: kRuntimeBytes covers them.)
  // (the logits' bf16 gradient among them, unless it is written over bf16 logits: logits_bf16)
  const bool logits16 = logits_bf16(pc.products(), cfg.backend);
  if (pc.products() == DType::BF16) workspace += 2 * std::max(4 * BT * C, logits16 ? 0.0 : BT * V) + 2 * 4 * BT * C;
  if (pc.param == DType::F16) workspace += 4 * std::max(V * C, 4 * C * C);
  // torch_autocast: fp32 weights converted for each product (gemm.cpp): to bf16; to fp16 and
  // back, both operands (2 + 4 bytes an element).
  if (pc.autocast.dtype == DType::BF16) workspace += 2 * std::max(V * C, 4 * C * C);
  if (pc.autocast.dtype == DType::F16)
    workspace += 6 * std::max(BT * V, 4 * BT * C) + 6 * std::max({V * C, 4 * C * C, BT * C});
  b.workspace += capped(workspace) + swap_workspace;  // (the experts' offload stages are in already)
  if (shape.sparse.enabled) {  // block-sparse attention: the blocks' index tables, the device form's panels
    std::vector<int64_t> layers;
    for (const ModelChunk& c : plan.part.chunks)
      for (int l = c.first_block; l < c.first_block + c.num_blocks; ++l) layers.push_back(l);
    const int64_t Hl = shape.n_head / std::max(1, plan.part.tp_size);
    const SparseAttentionBytes sparse =
        sparse_attention_model_bytes(shape.sparse, shape.n_head, Tm, layers, plan.part.tp_rank * Hl, Hl, Bm,
                                     shape.n_embd / shape.n_head, sparse_attention_device_form(cfg.backend));
    b.workspace += sparse.tables + sparse.panels;
  }
  b.workspace += attention_scratch_bytes(shape, plan.part, Bm, Tm, pc.products(), cfg.backend);
  if (mixed && (b.stage == 1 || b.stage == 2)) b.workspace += 4 * std::min(psi, ZeroOptimizer::kInitFillElems + largest_tensor);
  if (!m.init_from.empty()) b.workspace += 4 * psi;
  // A save reads offloaded (or 16-bit) state back into fp32 staging (checkpoint_arrays), and
  // HDF5 writes each shard through its chunk cache (two 4 MiB chunks), the Fletcher32 filter's
  // copy of a chunk and its metadata cache: measured 18 MB more resident after a save than
  // without one (fp32 and bf16, ZeRO 0 and 3, a 42M-parameter model at np 2), whatever the shard.
  if (cfg.training.save_interval > 0)
    b.workspace += checkpoint_staging_bytes(b.stage, cfg.zero, pc.param, moments, b.stage == 0 ? psi : part.part,
                                            !cfg.model.frozen_parameters.empty(),
                                            b.stage == 3 && cfg.zero.quantized_nontrainable_weights) +
                   kCheckpointWriterBytes;
  struct stat st {};
  if (cfg.data.source == DataSource::Text && ::stat(cfg.data.path.c_str(), &st) == 0) b.workspace += 5 * st.st_size;
  if (cfg.data.source == DataSource::Tokens && ::stat(cfg.data.path.c_str(), &st) == 0) b.workspace += 3 * st.st_size;
  b.runtime = kRuntimeBytes + (dp * plan.part.tp_size * std::max(1, cfg.pipeline.stages) == 1 ? kSingleRankRuntimeBytes : 0);
  return b;
}

MemoryBudget largest_of(const std::vector<MemoryBudget>& budgets) {
  const MemoryBudget* best = &budgets.front();
  for (const MemoryBudget& b : budgets)
    if (b.total() > best->total()) best = &b;  // ties: the lowest stage
  return *best;
}
}  // namespace

// As ZeroOptimizer builds its OffloadedOptimizer: an fp32 master copy under mixed precision with
// fp32 master weights; parameters in model memory unless stage 3 swaps them (offload_param nvme).
int64_t offload_stage_bytes(const Config& cfg, int stage, int64_t elems, bool host_is_device) {
  const OffloadOptimizerConfig& oo = cfg.zero.offload_optimizer;
  if (oo.device == OffloadDevice::None || stage < 1 || elems <= 0) return 0;
  const PrecisionConfig& pc = cfg.precision;
  const bool fp32_master = pc.param != DType::F32 && cfg.zero.master_weights == DType::F32;
  // offload_param's partition (swap files, or page-locked host memory) is updated where it lies
  const bool params_in_model_memory = !(stage == 3 && cfg.zero.offload_param.device != OffloadDevice::None);
  return offload::host_stage_bytes(elems, cfg.zero.sub_group_size, oo.ratio, pc.grad_accum, pc.param, fp32_master,
                                   params_in_model_memory, host_is_device)
      .total();
}

QgzPlacement qgz_placement(const ZeroConfig& zero, int stage, int64_t dp, int64_t ranks_per_node) {
  QgzPlacement q;
  q.per_node = static_cast<int>(ranks_per_node > 0 ? std::min(dp, ranks_per_node) : dp);
  if (stage == 3 && zero.quantized_gradients && q.per_node < dp) q.nodes = static_cast<int>(dp / q.per_node);
  return q;
}

std::vector<MemoryBudget> estimate_rank_budgets(const Config& cfg, int64_t world, int stage, int64_t ranks_per_node) {
  const int64_t dp = rank_layout(cfg, world).data;
  std::vector<MemoryBudget> out;
  for (const RankPlan& p : plan_ranks(cfg)) out.push_back(rank_budget(cfg, p, dp, stage, ranks_per_node));
  return out;
}

MemoryBudget estimate_budget(const Config& cfg, int64_t world, int stage, int64_t ranks_per_node) {
  return largest_of(estimate_rank_budgets(cfg, world, stage, ranks_per_node));
}

int64_t largest_fitting_micro_batch(const Config& cfg, int64_t world, int stage, int64_t bytes_per_rank,
                                    int64_t ranks_per_node) {
  return largest_fitting_micro_batch(cfg, world, stage, bytes_per_rank, ranks_per_node, cfg.activation_checkpointing);
}

int64_t largest_fitting_micro_batch(const Config& cfg, int64_t world, int stage, int64_t bytes_per_rank,
                                    int64_t ranks_per_node, const ActivationCheckpointing& checkpointing) {
  Config c = cfg;
  c.activation_checkpointing = checkpointing;
  const std::vector<RankPlan> plans = plan_ranks(cfg);  // independent of the micro-batch
  const int64_t dp = rank_layout(cfg, world).data;
  auto fits = [&](int64_t micro) {
    c.batch.micro_batch = micro;
    for (const RankPlan& p : plans)
      if (rank_budget(c, p, dp, stage, ranks_per_node).device_need() > bytes_per_rank) return false;
    return true;
  };
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = 2;
  while (hi <= (int64_t(1) << 24) && fits(hi)) lo = hi, hi *= 2;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

nlohmann::json FitAnswer::to_json() const {
  return {{"stage", stage},
          {"largest_micro_batch", configured},
          {"without_checkpointing", none},
          {"with_selective_recompute", selective},
          {"with_full_recompute", full},
          {"configured_micro_batch_fits", configured_fits},
          {"needs_checkpointing", needs_checkpointing}};
}

FitAnswer what_fits(const Config& cfg, int64_t world, int stage, int64_t bytes_per_rank, int64_t ranks_per_node) {
  ActivationCheckpointing selective, full;
  selective.interval = full.interval = 1;
  selective.granularity = RecomputeGranularity::Selective;
  FitAnswer a;
  a.stage = stage;
  a.configured = largest_fitting_micro_batch(cfg, world, stage, bytes_per_rank, ranks_per_node);
  a.none = largest_fitting_micro_batch(cfg, world, stage, bytes_per_rank, ranks_per_node, ActivationCheckpointing{});
  a.selective = largest_fitting_micro_batch(cfg, world, stage, bytes_per_rank, ranks_per_node, selective);
  a.full = largest_fitting_micro_batch(cfg, world, stage, bytes_per_rank, ranks_per_node, full);
  a.configured_fits = cfg.batch.micro_batch <= a.configured;
  a.needs_checkpointing = cfg.batch.micro_batch > a.none && cfg.batch.micro_batch <= std::max(a.selective, a.full);
  return a;
}

void write_budget_report(const std::string& path, const Config& cfg, int64_t world,
                         const std::vector<MemoryBudget>& budgets, const std::vector<FitAnswer>& fits,
                         int64_t bytes_per_rank) {
  // The path is the user's (--report): a file that cannot be created there is bad input.
  auto create = [&] {
    try {
      return h5::File::create(path);
    } catch (const SystemError& e) {
      throw InputError("--report " + echo(path) + ": cannot create the report file (" + echo(e.what(), 120) + ")");
    }
  };
  h5::File f = create();
  h5::write_attribute(f.id(), "config", cfg.resolved.dump());
  h5::write_attribute(f.id(), "config_file", cfg.file);
  h5::write_attribute(f.id(), "world_size", world);
  h5::write_attribute(f.id(), "device", std::string(cfg.backend == kernels::Backend::Gpu ? "gpu" : "cpu"));
  const RankLayout layout = rank_layout(cfg, world);
  h5::write_attribute(f.id(), "pipeline_stages", int64_t(layout.stages));
  h5::write_attribute(f.id(), "tensor_parallel_size", int64_t(layout.tensor));
  h5::write_attribute(f.id(), "data_parallel_size", layout.data);
  h5::write_attribute(f.id(), "micro_batch", cfg.batch.micro_batch);
  h5::write_attribute(f.id(), "param_dtype", dtype_name(cfg.precision.param));
  h5::write_attribute(f.id(), "grad_accum_dtype", dtype_name(cfg.precision.grad_accum));
  h5::write_attribute(f.id(), "communication_data_type", dtype_name(cfg.precision.comm));
  h5::write_attribute(f.id(), "parameters", count_model(cfg.model).params);
  h5::write_attribute(f.id(), "units", "bytes per rank; element k of each dataset is ZeRO stage k");
  const nlohmann::json first = budgets.front().to_json();
  for (auto it = first.begin(); it != first.end(); ++it) {
    if (it.key() == "stage") continue;
    std::vector<double> values;
    for (const auto& b : budgets) values.push_back(b.to_json()[it.key()].get<double>());
    const hsize_t n = values.size();
    h5::Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
    h5::Handle ds(H5Dcreate2(f.id(), it.key().c_str(), H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                  H5Dclose);
    std::vector<int64_t> ints(values.begin(), values.end());
    if (ds.get() < 0 || H5Dwrite(ds.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, ints.data()) < 0)
      throw SystemError(path + ": cannot write " + it.key());
  }
  if (fits.empty()) return;
  // --memory-per-rank: one dataset per answer, element k for ZeRO stage k (booleans as 0/1)
  h5::write_attribute(f.id(), "memory_per_rank", bytes_per_rank);
  const nlohmann::json names = fits.front().to_json();
  for (auto it = names.begin(); it != names.end(); ++it) {
    if (it.key() == "stage") continue;
    std::vector<int64_t> ints;
    for (const FitAnswer& a : fits) {
      const nlohmann::json v = a.to_json()[it.key()];
      ints.push_back(v.is_boolean() ? int64_t(v.get<bool>()) : v.get<int64_t>());
    }
    const hsize_t n = ints.size();
    h5::Handle space(H5Screate_simple(1, &n, nullptr), H5Sclose);
    h5::Handle ds(H5Dcreate2(f.id(), it.key().c_str(), H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                  H5Dclose);
    if (ds.get() < 0 || H5Dwrite(ds.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, ints.data()) < 0)
      throw SystemError(path + ": cannot write " + it.key());
  }
}

}  // namespace zero3d
