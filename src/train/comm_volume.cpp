// comm_volume.cpp — see comm_volume.hpp. Each count below names the ZeroOptimizer (or 1-bit
// optimizer) call it stands for; a change there that moves bytes must move them here too, and
// the estimate-against-measurement test (test_cli_comm_volume.cpp) says so.
#include "train/comm_volume.hpp"

#include <algorithm>
#include <map>
#include <set>

#include "kernels/moe.hpp"
#include "kernels/quantize.hpp"
#include "model/bf16_activations.hpp"
#include "optim/onebit.hpp"
#include "parallel/compressed_allreduce.hpp"
#include "parallel/grad_reducer.hpp"
#include "parallel/partition.hpp"
#include "parallel/pipe_schedule.hpp"
#include "parallel/quantized_reduce_scatter.hpp"
#include "train/estimator.hpp"
#include "train/rank_plan.hpp"
#include "zero/zero.hpp"

namespace zero3d {

namespace {

// Communicator::count_bus_bytes for one call: factor · elements · element size, rounded down.
int64_t bus(double factor, int64_t elements, DType type) {
  return static_cast<int64_t>(factor * static_cast<double>(elements) * static_cast<double>(dtype_size(type)));
}
double ring(int w) { return w > 1 ? double(w - 1) / w : 0.0; }

// The world ranks of rank 0's groups (ProcessTopology pipe_data_model: model fastest, then data)
// and whether they share a node when ranks fill nodes in order.
struct Placement {
  RankLayout layout;
  int64_t per_node = 1;
  int64_t world_rank(int64_t pipe, int64_t data) const { return (pipe * layout.data + data) * layout.tensor; }
  int64_t node(int64_t rank) const { return rank / per_node; }
  bool one_node(const std::vector<int64_t>& ranks) const {
    for (int64_t r : ranks)
      if (node(r) != node(ranks.front())) return false;
    return true;
  }
  // Data ranks `first`, `first + stride`, ... (`count` of them) at pipeline stage 0.
  std::vector<int64_t> data_ranks(int64_t first, int64_t count, int64_t stride = 1) const {
    std::vector<int64_t> out;
    for (int64_t i = 0; i < count; ++i) out.push_back(world_rank(0, first + i * stride));
    return out;
  }
};

// What moe::capacity reads of model.moe (the training step's capacity factor).
kernels::moe::GateConfig moe_gate_config(const MoeConfig& moe) {
  kernels::moe::GateConfig g;
  g.num_experts = static_cast<int>(moe.num_experts);
  g.k = static_cast<int>(moe.k);
  g.capacity_factor = moe.capacity_factor;
  g.min_capacity = moe.min_capacity;
  g.training = true;
  return g;
}

// The rows an expert keeps from one rank's S tokens at most (kernels/moe.hpp gate_forward_assign
// keeps min(choices, capacity) per expert, and a token chooses an expert once): its capacity with
// drop_tokens, S without (the capacity is then the largest load).
int64_t most_rows_per_expert(const MoeConfig& moe, int64_t S) {
  return moe.drop_tokens ? std::min(S, kernels::moe::capacity(S, moe_gate_config(moe))) : S;
}

// The rows every expert keeps from one rank's S tokens where routing cannot change them: with
// k = E every token chooses every expert, so each keeps the most it can. -1 where the gate's
// choices decide them.
int64_t fixed_rows_per_expert(const MoeConfig& moe, int64_t S) {
  return moe.k == moe.num_experts ? most_rows_per_expert(moe, S) : -1;
}

// The tensor and pipeline axes of rank 0 (pipeline stage 0, tensor rank 0): the activations of
// each micro-batch through Megatron's regions (tensor_parallel.hpp, FACTS-2 §1.1, §1.8) as
// GPT's forward and backward call them, the sequence-parallel LayerNorm gradients summed once
// per step (Engine::finalize_grads), and what stage 0 sends down the pipeline (Engine::execute:
// the residual stream, Mixtral's router sums) with the step's span all-reduce. An MoE block
// (no sequence parallelism: model.moe's checks) exchanges its attention half's two; PR-MoE's
// dense branch its two; split experts (expert tensor parallelism) sum their rows' outputs
// forward and their input gradients backward (moe_layer.cpp), rows that routing decides unless
// fixed_rows_per_expert knows them, or one expert rank keeps every choice. `why_not`: the
// reason a layout's tensor traffic depends on the data (such rows, progressive layer drop).
std::vector<GroupBytes> activation_groups(const Config& cfg, const Placement& at, const RankPlan& plan,
                                          const StateTypes& types, const Partition& part, int stage,
                                          std::string& why_not) {
  std::vector<GroupBytes> out;
  const GPTShape shape = gpt_shape_of(cfg.model);
  const int t = static_cast<int>(at.layout.tensor), p = static_cast<int>(at.layout.stages);
  const bool sp = cfg.tensor.sequence_parallel && t > 1;
  const int64_t C = shape.n_embd, BT = cfg.batch.micro_batch * shape.n_positions, X = BT * C;
  const int64_t Ns = sp ? BT / t : BT, micro = std::max<int64_t>(1, cfg.batch.gradient_accumulation_steps);
  const ActivationCheckpointing& ac = cfg.activation_checkpointing;
  // whether a dense block's attention and MLP halves keep bf16 saves on the planned build
  const DType products = cfg.precision.products();
  const bool attn16 = !shape.sparse.enabled && activations_bf16(products, t > 1, false, false, cfg.backend),
             mlp16 = activations_bf16(products, t > 1, false, true, cfg.backend);
  if (t > 1) {
    std::vector<int64_t> ranks;
    for (int i = 0; i < t; ++i) ranks.push_back(at.world_rank(0, 0) + i);
    GroupBytes tensor{"tensor", t, at.one_node(ranks), 0};
    // One token exchange of the whole stream: an all-reduce, or an all-gather or reduce-scatter
    // of its shards with sequence parallelism.
    const int64_t exchange = sp ? bus(ring(t), X, DType::F32) : bus(2.0 * ring(t), X, DType::F32);
    GroupBytes per_micro;
    const MoeConfig& moe = cfg.model.moe;
    const int64_t ep = std::max<int64_t>(1, moe.ep_size), S = BT;
    // Rows each rank's local experts receive per micro-batch: fixed ones from every expert rank,
    // or, with one expert rank, every choice when none can be dropped.
    const int64_t fixed = fixed_rows_per_expert(moe, S);
    int64_t rows = -1;
    if (fixed >= 0) rows = moe.num_experts * fixed;
    else if (ep == 1 && most_rows_per_expert(moe, S) == S) rows = S * moe.k;
    for (const ModelChunk& c : plan.part.chunks) {
      int64_t moe_blocks = 0;
      for (int l = 0; l < c.num_blocks; ++l) moe_blocks += shape.moe.is_moe_block(c.first_block + l) ? 1 : 0;
      // Each block: the two row-parallel outputs forward; backward their gradients (all-gathered
      // with sequence parallelism, the identity without) and the two column-parallel input
      // gradients, whose weight products re-gather their inputs with sequence parallelism.
      const int64_t forward = sp ? 4 : 2, backward = sp ? 6 : 2;
      const int64_t recomputed = ac.full() ? forward : 0;  // a checkpoint reruns its blocks' forward
      // The gathered inputs are the two norms' outputs: bf16 where the half keeps bf16 saves
      // (model/bf16_activations.hpp), each gathered forward (and in a recompute) and for the
      // weight product.
      const int64_t gathers = sp ? 2 + (ac.full() ? 1 : 0) : 0, dense = c.num_blocks - moe_blocks;
      const int64_t norm_outputs = bus(ring(t), X, attn16 ? DType::BF16 : DType::F32) +
                                   bus(ring(t), X, mlp16 ? DType::BF16 : DType::F32);
      per_micro.add(dense * ((forward + backward + recomputed - 2 * gathers) * exchange + gathers * norm_outputs),
                    dense * (forward + backward + recomputed));
      const int64_t moe_exchanges = shape.moe.use_residual ? 4 : 2;
      per_micro.add(moe_blocks * moe_exchanges * exchange, moe_blocks * moe_exchanges);
      if (moe_blocks > 0 && shape.moe.expert_tensor_parallel) {
        if (rows >= 0) per_micro.add(moe_blocks * 2 * bus(2.0 * ring(t), rows * C, DType::F32), moe_blocks * 2);
        else why_not = "split experts sum the rows their routing sends them (k " + std::to_string(moe.k) + " of " +
                       std::to_string(moe.num_experts) + " experts, ep_size " + std::to_string(ep) + ")";
      }
      if (ac.full() && ac.partition_activations) {  // each checkpoint's input all-gathered from its 1/t slots
        const int64_t checkpoints = (c.num_blocks + ac.interval - 1) / ac.interval;
        per_micro.add(checkpoints * bus(ring(t), Ns * C / t * t, DType::F32), checkpoints);
      }
      if (c.embedding) per_micro.add((sp ? 2 : 1) * exchange, sp ? 2 : 1);  // vocab-parallel sum (and its gradient)
      if (c.final) {
        // ln_f gathered for the head and its gradient scattered back (the input gradient summed
        // without sequence parallelism), and the vocab-parallel cross-entropy's max, sum-exp
        // and target logit
        per_micro.add((sp ? 2 : 1) * exchange, sp ? 2 : 1);
        per_micro.add(bus(2.0 * ring(t), BT, DType::F32) + bus(2.0 * ring(t), 2 * BT, DType::F32), 2);
      }
    }
    tensor.add(micro * per_micro.bytes, micro * per_micro.calls);
    if (sp)  // each LayerNorm's gradient, partial over the token shards, summed over the group
      for (const TensorSpec& ts : plan.part.dense_layout.tensors()) {
        if (!sequence_parallel_partial(ts.name)) continue;
        int64_t lo = ts.offset, hi = ts.offset + ts.numel;
        if (stage > 0) {  // ZeroOptimizer::sum_grad_range: the partition's part of it
          const auto owned = part.owned(0, lo, hi);
          lo = owned.first, hi = owned.second;
        }
        if (hi > lo) tensor.add(bus(2.0 * ring(t), hi - lo, types.grad));
      }
    if (cfg.pld.enabled) why_not = "progressive layer drop skips the dropped blocks' exchanges";
    out.push_back(tensor);
  }
  if (p > 1) {
    std::vector<int64_t> ranks;
    for (int s = 0; s < p; ++s) ranks.push_back(at.world_rank(s, 0));
    GroupBytes pipe{"pipe", p, at.one_node(ranks), 0};
    const int64_t E = shape.family.mixtral() ? shape.moe.num_experts : 0;  // GPT::router_experts
    const pipe::ScheduleSpec spec{cfg.pipeline.schedule, p, static_cast<int>(micro), cfg.pipeline.virtual_stages};
    for (const auto& step : pipe::make_schedule(spec, 0).steps)
      for (const pipe::Instruction& in : step) {
        if (in.op != pipe::Op::SendActivation && in.op != pipe::Op::SendGrad) continue;
        pipe.add(bus(1.0, Ns * C, DType::F32));
        const bool sums = in.op == pipe::Op::SendActivation;  // 2E fp64 sums forward, E fp32 fractions back
        if (E > 0) pipe.add(sums ? bus(1.0, 2 * E, DType::F64) : bus(1.0, E, DType::F32));
      }
    pipe.add(bus(2.0 * ring(p), 1, DType::F64));  // the step's span, the pipeline's slowest stage
    out.push_back(pipe);
  }
  return out;
}
// ZeRO++'s qgZ (ZeroOptimizer with zero_quantized_gradients; parallel/quantized_reduce_scatter.hpp):
// over a data group of `dp` ranks on several nodes of k ranks, each quantised bucket is two
// all-to-alls in "qgz_intra" and two in "qgz_inter" (values, then scales); rank 0 sends
// qgz_sent_bytes of them. One node: DeepSpeed's plain reduce-scatter, no groups.
struct QgzGroups : QgzPlacement {
  GroupBytes intra{"qgz_intra", 1, true, 0}, inter{"qgz_inter", 1, false, 0};
  explicit QgzGroups(const QgzPlacement& q) : QgzPlacement(q) {
    intra.ranks = per_node;
    inter.ranks = nodes;
  }
  // A bucket of `part`'s ranks, `passes` times a step.
  void add(const ReduceBucket& b, const Partition& part, int64_t passes) {
    const QgzBytes q = qgz_sent_bytes(part.counts(b.begin, b.end), b.quant_group, nodes, per_node, 0);
    intra.add(passes * q.intra, passes * 2);
    inter.add(passes * q.inter, passes * 2);
  }
};

}  // namespace

int64_t CommVolume::intra_node() const {
  int64_t n = 0;
  for (const GroupBytes& g : groups) n += g.intra_node ? g.bytes : 0;
  return n;
}

int64_t CommVolume::inter_node() const {
  int64_t n = 0;
  for (const GroupBytes& g : groups) n += g.intra_node ? 0 : g.bytes;
  return n;
}

nlohmann::json CommVolume::to_json() const {
  // metrics.jsonl counts the embedding group's bytes with the data axis
  nlohmann::json by_axis = nlohmann::json::object();
  nlohmann::json calls = nlohmann::json::object(), ranks = nlohmann::json::object();
  for (const GroupBytes& g : groups) {
    calls[g.axis] = g.calls;
    ranks[g.axis] = g.ranks;
    const std::string axis = g.axis == "embedding" ? "data" : g.axis;
    by_axis[axis] = by_axis.value(axis, int64_t(0)) + g.bytes;
  }
  nlohmann::json out = {{"stage", stage},
                        {"comm_bytes_by_axis", by_axis},
                        {"collectives_by_group", calls},
                        {"ranks_by_group", ranks},
                        {"comm_bytes_by_link", {{"intra_node", intra_node()}, {"inter_node", inter_node()}}}};
  if (!activations_not_predicted.empty()) out["activations_not_predicted"] = activations_not_predicted;
  if (!expert_not_predicted.empty()) {
    out["expert_not_predicted"] = expert_not_predicted;
    out["expert_bytes_at_most"] = expert_bound;
  }
  return out;
}

namespace {

// qwZ (parallel/quantized_gather.hpp): each of `ranks` slices of [offset, offset + numel) under
// `split` as int8 groups and their scales, gathered as bytes.
int64_t quantized_slices(const Partition& split, int ranks, int64_t offset, int64_t numel) {
  int64_t bytes = 0;
  for (int r = 0; r < ranks; ++r) {
    const auto [a, b] = split.owned(r, offset, offset + numel);
    bytes += kernels::quantized_bytes(b - a);
  }
  return bytes;
}

// One stage-3 gather of `unit` over the whole partition group (ZeroOptimizer's start_gather):
// the autocast tensors packed in their dtype as bytes, qwZ's int8 groups, or the unit itself.
int64_t unit_gather_bytes(const ZeroConfig& zero, const StateTypes& types, const ParamLayout& layout,
                          const Partition& part, const ParamUnit& unit) {
  const int W = part.world;
  if (types.autocast != DType::F32) {
    int64_t bytes = 0;
    bool mixed = false;
    for (size_t i = 0; i < layout.tensors().size(); ++i) {
      const TensorSpec& t = layout.tensors()[i];
      const int64_t n = std::min(t.offset + t.numel, unit.offset + unit.numel) - std::max(t.offset, unit.offset);
      if (n <= 0) continue;
      bytes += n * static_cast<int64_t>(dtype_size(types.low(i) ? types.autocast : types.param));
      mixed = mixed || types.low(i);
    }
    return mixed ? bus(ring(W), bytes, DType::U8) : bus(ring(W), unit.numel, types.param);
  }
  if (zero.quantized_nontrainable_weights && types.any_frozen())  // the frozen pieces' int8 groups (zero/quantized_frozen.hpp)
    return bus(ring(W), frozen_gather_plan(layout, types, part, unit, zero.quantized_weights).total, DType::U8);
  if (zero.quantized_weights) return bus(ring(W), quantized_slices(part, W, unit.offset, unit.numel), DType::U8);
  return bus(ring(W), unit.numel, types.param);
}

// One ZeroOptimizer's own traffic in a step of `micro` micro-batches over its partition group
// `group` (part.world ranks): the gradient buckets (reduce_work's; qgZ's in its groups where it
// is on), stages 1-2's all-gathers of the updated partition, the gradient norm's sum (and a
// 1-bit optimizer's agreed overflow flag on the steps that keep the gradients local), and a
// 1-bit optimizer's compressed all-reduces. Stage 3's gathers follow the caller's trace.
void add_optimizer_traffic(GroupBytes& group, QgzGroups& qgz, const ZeroConfig& zero, int stage, int64_t micro,
                           const StateTypes& types, const ParamLayout& layout, const std::vector<ParamUnit>& units,
                           const Partition& part, const OptimizerTraffic& traffic) {
  const int W = part.world;
  // Gradients (GradientReducer over reduce_work's buckets): stages 0-1 once at the accumulation
  // boundary, stages 2-3 every backward (each unit's fp32 window).
  if (traffic.gradients_reduced) {  // ZeroOptimizer::reduces_gradients
    const ReduceWork work = reduce_work(stage, zero, types, layout, units, part, qgz.world());
    GroupBytes one_pass;
    const int64_t passes = stage >= 2 ? micro : 1;
    for (const ReduceBucket& b : work.buckets) {
      if (qgz.on() && b.quant_group > 0) qgz.add(b, part, passes);
      else one_pass.add(bus(stage == 0 ? 2.0 * ring(W) : ring(W), b.end - b.begin, b.type));
    }
    group.add(passes * one_pass.bytes, passes * one_pass.calls);
  }
  // Stages 1-2: the updated partitions all-gathered in allgather_bucket_size pieces (gather_updated_params).
  if (stage == 1 || stage == 2) {
    const int64_t bucket = std::max<int64_t>(2 * W, zero.allgather_bucket_size);
    for (int64_t a = 0; a < part.padded; a += bucket)
      group.add(bus(ring(W), std::min(part.padded, a + bucket) - a, types.param));
  }
  if (stage > 0) group.add(bus(2.0 * ring(W), 1, DType::F64));  // grad_stats
  if (!traffic.gradients_reduced && W > 1) group.add(bus(2.0 * ring(W), 1, DType::I64));
  // A 1-bit optimizer's compressed all-reduces (compressed_allreduce.hpp; stage 0 only, so over
  // the whole data group): each tensor's momentum (OneBitAdam), gradient or accumulated update
  // (ZeroOneAdam), or all momenta at once (OneBitLamb); sign bits through an all-to-all and an
  // all-gather, and two all-gathers of one fp32 scale per rank. Empty tensors are skipped, as
  // the optimizers' loops skip them.
  if (traffic.onebit != OptimizerTraffic::OneBit::None && W > 1) {
    const auto call = [&](int64_t n) {
      const int64_t chunk_bytes = onebit_padded_size(n, W) / W / 8;
      return 2 * bus(ring(W), chunk_bytes * W, DType::U8) + 2 * bus(ring(W), W, DType::F32);
    };
    if (traffic.onebit == OptimizerTraffic::OneBit::EachTensor) {
      for (const TensorSpec& t : layout.tensors())
        if (t.numel > 0) group.add(call(t.numel), 4);
    } else {
      group.add(call(layout.total()), 4);
    }
  }
}

// MoE (DEEPSPEED-FACTS-2 §4.5-4.6) on rank 0: the experts' own ZeroOptimizer over the
// expert-data group (Engine::setup_expert_optimizer: dp/ep ranks, every ep-th data rank, the
// config's ZeRO without MiCS, hpZ or qgZ, gathering the expert units along their own trace), and
// each MoE block's exchanges over the expert group (ep consecutive data ranks; moe_layer.cpp)
// every micro-batch: the kept-row counts (an all-to-all of E/ep int64 to each rank), without
// drop_tokens the capacity's MAX, and the rows — dispatched and returned forward, their
// gradients the same two ways backward — which fixed_rows_per_expert predicts where routing
// cannot change them; elsewhere `why_not` says so and `bound` is the most they can be.
std::vector<GroupBytes> expert_groups(const Config& cfg, const Placement& at, const RankPlan& plan, int stage,
                                      const OptimizerTraffic& traffic, std::string& why_not, int64_t& bound) {
  const MoeConfig& moe = cfg.model.moe;
  const GPTShape shape = gpt_shape_of(cfg.model);
  const int64_t dp = at.layout.data, ep = std::max<int64_t>(1, moe.ep_size), edp = std::max<int64_t>(1, dp / ep);
  const int64_t micro = std::max<int64_t>(1, cfg.batch.gradient_accumulation_steps);
  GroupBytes expert{"expert", static_cast<int>(ep), at.one_node(at.data_ranks(0, ep)), 0};
  GroupBytes expert_data{"expert_data", static_cast<int>(edp), at.one_node(at.data_ranks(0, edp, ep)), 0};
  const ParamLayout& layout = plan.part.expert_layout;
  if (layout.total() > 0) {
    const StateTypes types = state_types_of(cfg, layout);
    const Partition part(layout.total(), static_cast<int>(edp));
    QgzGroups none{QgzPlacement{}};
    add_optimizer_traffic(expert_data, none, cfg.zero, stage, micro, types, layout, plan.part.expert_units, part, traffic);
    if (stage == 3)
      for (const auto& [u, pos] : simulate_gathers(cfg.zero, plan.part.expert_units, plan.expert_trace).gathers)
        expert_data.add(unit_gather_bytes(cfg.zero, types, layout, part, plan.part.expert_units[static_cast<size_t>(u)]));
  }
  int64_t moe_blocks = 0;
  for (const ModelChunk& c : plan.part.chunks)
    for (int l = 0; l < c.num_blocks; ++l) moe_blocks += shape.moe.is_moe_block(c.first_block + l) ? 1 : 0;
  if (ep > 1 && moe_blocks > 0) {
    const int64_t local = moe.num_experts / ep, S = cfg.batch.micro_batch * shape.n_positions;
    const int64_t row = shape.n_embd * static_cast<int64_t>(sizeof(float));
    GroupBytes per_block;  // one MoE block's forward and backward of one micro-batch
    per_block.add(bus(ring(static_cast<int>(ep)), local * ep, DType::I64));
    if (!moe.drop_tokens) per_block.add(bus(2.0 * ring(static_cast<int>(ep)), 1, DType::I64));
    // Rows rank 0 sends to the other expert ranks' experts, and receives for its own from them:
    // each all-to-all_v counts the rows that leave the rank, twice each way.
    const int64_t fixed = fixed_rows_per_expert(moe, S), most = most_rows_per_expert(moe, S);
    const int64_t sent = fixed >= 0 ? (ep - 1) * local * fixed : std::min(S * moe.k, (ep - 1) * local * most);
    const int64_t received = fixed >= 0 ? (ep - 1) * local * fixed : (ep - 1) * std::min(S * moe.k, local * most);
    const int64_t rows_bytes = 2 * (sent + received) * row;
    if (fixed >= 0) {
      per_block.add(rows_bytes, 4);
    } else {
      why_not = "the rows each expert receives depend on the gate's choices (k " + std::to_string(moe.k) + " of " +
                std::to_string(moe.num_experts) + " experts); the expert axis counts the kept-row counts" +
                (moe.drop_tokens ? "" : " and the capacity") + " only";
      per_block.calls += 4;
    }
    if (cfg.pld.enabled)  // the count then takes every block as kept: at most what the run moves
      why_not += std::string(why_not.empty() ? "" : "; ") + "progressive layer drop skips the dropped blocks' all-to-alls";
    expert.add(micro * moe_blocks * per_block.bytes, micro * moe_blocks * per_block.calls);
    if (!why_not.empty()) bound = expert.bytes + (fixed >= 0 ? 0 : micro * moe_blocks * rows_bytes);
  }
  return {expert, expert_data};
}

}  // namespace

CommVolume estimate_comm_volume(const Config& cfg, int64_t world, int stage, int64_t ranks_per_node,
                                const OptimizerTraffic& traffic) {
  const ZeroConfig& zero = cfg.zero;
  Placement at{rank_layout(cfg, world), std::max<int64_t>(1, ranks_per_node)};
  const int64_t dp = at.layout.data, micro = std::max<int64_t>(1, cfg.batch.gradient_accumulation_steps);
  // Rank 0's stage over the step's whole trace (every micro-batch's fetches).
  const RankPlan plan = plan_ranks(cfg, micro).front();
  const ParamLayout& layout = plan.part.dense_layout;
  const std::vector<ParamUnit>& units = plan.part.dense_units;
  const StateTypes types = state_types_of(cfg, layout);

  // ZeroOptimizer partitions over the data group, or MiCS's shard group (stage 3).
  const bool mics = stage == 3 && zero.mics_shard_size > 0;
  const int64_t w = mics ? zero.mics_shard_size : dp;
  const Partition part(plan.partition_numel, static_cast<int>(w));
  const std::vector<int64_t> partition_ranks = at.data_ranks(0, w);
  CommVolume out;
  out.stage = stage;
  GroupBytes data{"data", static_cast<int>(dp), at.one_node(at.data_ranks(0, dp)), 0};
  GroupBytes shard{"mics_shard", static_cast<int>(w), at.one_node(partition_ranks), 0};
  GroupBytes& partition_group = mics ? shard : data;
  QgzGroups qgz(qgz_placement(zero, stage, mics ? 1 : dp, at.per_node));
  add_optimizer_traffic(partition_group, qgz, zero, stage, micro, types, layout, units, part, traffic);

  std::vector<GroupBytes> shard_groups;
  // Stage 3: every gather of a steady step, as ZeroOptimizer's fetch and release decide them.
  if (stage == 3) {
    const GatherElems g = simulate_gathers(zero, units, plan.trace);
    const int hpz = zero.hpz_partition_size;
    GroupBytes secondary{"hpz", hpz, at.one_node(at.data_ranks(0, hpz)), 0};
    // MiCS hierarchical: the shard's ranks by node; rank 0 is position 0 on the first.
    std::map<int64_t, std::vector<int64_t>> by_node;
    for (int64_t d = 0; d < w; ++d) by_node[at.node(partition_ranks[d])].push_back(d);
    const bool hierarchical = mics && zero.mics_hierarchical_params_gather;
    const int nodes = static_cast<int>(by_node.size()), k = static_cast<int>(by_node.begin()->second.size());
    GroupBytes inter{"mics_inter", nodes, nodes == 1, 0}, intra{"mics_intra", k, true, 0};
    std::set<int> primary;  // units whose hpZ secondary slice this step already holds (keep_secondary)
    for (const auto& [u, pos] : g.gathers) {
      const ParamUnit& unit = units[static_cast<size_t>(u)];
      const bool backward = pos < plan.trace_backward.size() && plan.trace_backward[pos];
      if (hpz > 1 && backward && primary.count(u)) {  // start_secondary_gather
        secondary.add(zero.quantized_weights
                          ? bus(ring(hpz), quantized_slices(Partition(unit.numel, hpz), hpz, 0, unit.numel), DType::U8)
                          : bus(ring(hpz), unit.numel, types.param));
      } else if (hierarchical) {  // start_hierarchical_gather: across nodes at position 0, then inside the node
        int64_t across = 0;
        for (const auto& [node, ds] : by_node) {
          const auto [a, b] = part.owned(static_cast<int>(ds.front()), unit.offset, unit.offset + unit.numel);
          across += b - a;
        }
        inter.add(bus(ring(nodes), across, types.param));
        intra.add(bus(ring(k), unit.numel, types.param));
      } else {
        partition_group.add(unit_gather_bytes(zero, types, layout, part, unit));
      }
      if (!backward) primary.insert(u);
    }
    if (hpz > 1) shard_groups.push_back(secondary);
    if (hierarchical) {
      shard_groups.push_back(inter);
      shard_groups.push_back(intra);
    }
  }
  // MiCS: the shard's gradient partition summed over its replicas (reduce_over_replicas).
  if (mics) {
    const int64_t replicas = dp / w;
    GroupBytes rep{"mics_replicate", static_cast<int>(replicas), at.one_node(at.data_ranks(0, replicas, w)), 0};
    rep.add(bus(2.0 * ring(static_cast<int>(replicas)), part.part, types.grad));
    shard_groups.insert(shard_groups.begin(), rep);
  }
  // Pipelines: the tied wte's gradient summed between the first and the last stage (Engine::
  // finalize_grads' sum_grad_range over the embedding group, counted with the data axis).
  const int64_t tied = plan.part.vocab_local * gpt_shape_of(cfg.model).n_embd;
  if (at.layout.stages > 1 && gpt_shape_of(cfg.model).tied_head() && traffic.gradients_reduced) {
    const int64_t n = stage == 0 ? tied : [&] {
      const auto [lo, hi] = part.owned(0, 0, tied);
      return hi - lo;
    }();
    const std::vector<int64_t> pair = {at.world_rank(0, 0), at.world_rank(at.layout.stages - 1, 0)};
    shard_groups.insert(shard_groups.begin(), {"embedding", 2, at.one_node(pair), bus(2.0 * ring(2), n, types.grad), 1});
  }
  out.groups.push_back(data);
  if (mics) out.groups.push_back(shard);
  for (const GroupBytes& g : shard_groups) out.groups.push_back(g);
  if (qgz.on()) {
    out.groups.push_back(qgz.intra);
    out.groups.push_back(qgz.inter);
  }
  if (cfg.model.moe.enabled())
    for (const GroupBytes& g : expert_groups(cfg, at, plan, stage, traffic, out.expert_not_predicted, out.expert_bound))
      out.groups.push_back(g);
  for (const GroupBytes& g : activation_groups(cfg, at, plan, types, part, stage, out.activations_not_predicted))
    out.groups.push_back(g);
  return out;
}

OptimizerTraffic compressed_traffic(const OptimizerConfig& cfg) {
  OptimizerTraffic t;
  t.phase = "compressed";
  t.gradients_reduced = false;
  t.onebit = cfg.type == OptimizerType::OneBitLamb ? OptimizerTraffic::OneBit::AllTensors
                                                   : OptimizerTraffic::OneBit::EachTensor;
  return t;
}

std::vector<OptimizerTraffic> optimizer_traffic(const OptimizerConfig& cfg, int64_t first, int64_t last) {
  std::vector<OptimizerTraffic> out;
  ZeroOneAdamSchedule zero_one(cfg);
  zero_one.replay(first - 1);
  for (int64_t s = first; s <= last; ++s) {
    OptimizerTraffic t;
    if (cfg.one_bit() && s == 1) {
      t.phase = "initialisation";  // the engine all-reduces; the optimizer updates nothing (§5.3)
    } else if (cfg.type == OptimizerType::OneBitAdam || cfg.type == OptimizerType::OneBitLamb) {
      if (onebit_past_freeze(s, cfg.freeze_step)) t = compressed_traffic(cfg);
      else t.phase = "warm-up";
    } else if (cfg.type == OptimizerType::ZeroOneAdam) {
      // ZeroOneAdam::step: the averaged gradient on variance steps; before the freeze the local
      // gradient through the 1-bit all-reduce, after it local steps that 1-bit all-reduce their
      // accumulated update every local_step_interval steps.
      t.gradients_reduced = zero_one.variance_step(s);
      if (t.gradients_reduced) {
        t.phase = "variance update";
      } else if (!zero_one.frozen(s)) {
        t.phase = "compressed gradient";
        t.onebit = OptimizerTraffic::OneBit::EachTensor;
      } else if (zero_one.sync_step(s)) {
        t.phase = "local step, synchronised";
        t.onebit = OptimizerTraffic::OneBit::EachTensor;
      } else {
        t.phase = "local step";
      }
      zero_one.count(s);
    }
    out.push_back(t);
  }
  return out;
}

int64_t StepRangeVolume::total_intra_node() const {
  int64_t n = 0;
  for (const Phase& p : phases) n += p.steps * p.volume.intra_node();
  return n;
}

int64_t StepRangeVolume::total_inter_node() const {
  int64_t n = 0;
  for (const Phase& p : phases) n += p.steps * p.volume.inter_node();
  return n;
}

nlohmann::json StepRangeVolume::to_json() const {
  const double steps = static_cast<double>(last - first + 1);
  nlohmann::json by_phase = nlohmann::json::array();
  for (const Phase& p : phases) {
    nlohmann::json v = p.volume.to_json();
    v["phase"] = p.traffic.phase;
    v["steps"] = p.steps;
    by_phase.push_back(v);
  }
  return {{"step", step},
          {"phase", step_phase},
          {"communication", step_volume.to_json()},
          {"range",
           {{"first", first},
            {"last", last},
            {"total_bytes_by_link", {{"intra_node", total_intra_node()}, {"inter_node", total_inter_node()}}},
            {"average_bytes_by_link",
             {{"intra_node", double(total_intra_node()) / steps}, {"inter_node", double(total_inter_node()) / steps}}},
            {"phases", by_phase}}}};
}

StepRangeVolume estimate_step_range(const Config& cfg, int64_t world, int64_t ranks_per_node, int64_t step,
                                    int64_t first, int64_t last) {
  StepRangeVolume out;
  out.first = first, out.last = last, out.step = step;
  const int stage = static_cast<int>(cfg.zero.stage);
  std::map<std::string, size_t> seen;  // phase -> its entry; a phase's steps all move the same bytes
  for (const OptimizerTraffic& t : optimizer_traffic(cfg.optimizer, first, last)) {
    auto [it, added] = seen.emplace(t.phase, out.phases.size());
    if (added) out.phases.push_back({t, 0, estimate_comm_volume(cfg, world, stage, ranks_per_node, t)});
    ++out.phases[it->second].steps;
  }
  const OptimizerTraffic at = optimizer_traffic(cfg.optimizer, step, step).front();
  out.step_phase = at.phase;
  out.step_volume = estimate_comm_volume(cfg, world, stage, ranks_per_node, at);
  return out;
}

}  // namespace zero3d
