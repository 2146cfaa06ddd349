// comm_volume.cpp — see comm_volume.hpp. Each count below names the ZeroOptimizer (or 1-bit
// optimizer) call it stands for; a change there that moves bytes must move them here too, and
// the estimate-against-measurement test (test_cli_comm_volume.cpp) says so.
#include "train/comm_volume.hpp"

#include <algorithm>
#include <map>
#include <set>

#include "kernels/quantize.hpp"
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

// The tensor and pipeline axes of rank 0 (pipeline stage 0, tensor rank 0): the activations of
// each micro-batch through Megatron's regions (tensor_parallel.hpp, FACTS-2 §1.1, §1.8) as
// GPT's forward and backward call them, the sequence-parallel LayerNorm gradients summed once
// per step (Engine::finalize_grads), and what stage 0 sends down the pipeline (Engine::execute:
// the residual stream, Mixtral's router sums) with the step's span all-reduce. `why_not`: the
// reason a layout's tensor traffic depends on the data (MoE routing, progressive layer drop).
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
  if (t > 1) {
    std::vector<int64_t> ranks;
    for (int i = 0; i < t; ++i) ranks.push_back(at.world_rank(0, 0) + i);
    GroupBytes tensor{"tensor", t, at.one_node(ranks), 0};
    // One token exchange of the whole stream: an all-reduce, or an all-gather or reduce-scatter
    // of its shards with sequence parallelism.
    const int64_t exchange = sp ? bus(ring(t), X, DType::F32) : bus(2.0 * ring(t), X, DType::F32);
    GroupBytes per_micro;
    for (const ModelChunk& c : plan.part.chunks) {
      for (int l = 0; l < c.num_blocks; ++l)
        if (shape.moe.is_moe_block(c.first_block + l)) why_not = "MoE blocks exchange the rows their routing sends";
      // Each block: the two row-parallel outputs forward; backward their gradients (all-gathered
      // with sequence parallelism, the identity without) and the two column-parallel input
      // gradients, whose weight products re-gather their inputs with sequence parallelism.
      const int64_t forward = sp ? 4 : 2, backward = sp ? 6 : 2;
      const int64_t recomputed = ac.full() ? forward : 0;  // a checkpoint reruns its blocks' forward
      per_micro.add(c.num_blocks * (forward + backward + recomputed) * exchange,
                    c.num_blocks * (forward + backward + recomputed));
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
struct QgzGroups {
  int per_node = 1, nodes = 1;
  GroupBytes intra{"qgz_intra", 1, true, 0}, inter{"qgz_inter", 1, false, 0};
  QgzGroups(const ZeroConfig& zero, int stage, int64_t dp, int64_t ranks_per_node) {
    per_node = static_cast<int>(std::min(dp, ranks_per_node));
    if (stage == 3 && zero.quantized_gradients && per_node < dp) nodes = static_cast<int>(dp / per_node);
    intra.ranks = per_node;
    inter.ranks = nodes;
  }
  bool on() const { return nodes > 1; }
  int64_t world() const { return on() ? int64_t(per_node) * nodes : 0; }  // gradient_segments' qgz_world
  // A bucket of `part`'s ranks, `passes` times a step.
  void add(const ReduceBucket& b, const Partition& part, int64_t passes) {
    std::vector<int64_t> counts;
    for (int r = 0; r < part.world; ++r) {
      const auto [lo, hi] = part.owned(r, b.begin, b.end);
      counts.push_back(hi - lo);
    }
    const QgzBytes q = qgz_sent_bytes(counts, b.quant_group, nodes, per_node, 0);
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
  return out;
}

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
  const int W = static_cast<int>(w);
  const bool reduces = traffic.gradients_reduced;  // ZeroOptimizer::reduces_gradients

  // Gradients (GradientReducer over reduce_work's ranges, cut into its buckets): stages 0-1
  // once at the accumulation boundary, stages 2-3 every backward (each unit's fp32 window).
  QgzGroups qgz(zero, stage, mics ? 1 : dp, at.per_node);
  if (reduces) {
    const ReduceWork work = reduce_work(stage, zero, types, layout, units, part, qgz.world());
    const std::vector<CommSegment> segments =
        gradient_segments(layout, stage == 0 ? layout.total() : part.padded, types, qgz.world());
    GroupBytes one_pass;
    const int64_t passes = stage >= 2 ? micro : 1;
    for (const auto& [lo, hi] : work.ranges)
      for (const ReduceBucket& b : cut_buckets(segments, lo, hi, zero.reduce_bucket_size, types.comm)) {
        if (qgz.on() && b.quant_group > 0) qgz.add(b, part, passes);
        else one_pass.add(bus(stage == 0 ? 2.0 * ring(W) : ring(W), b.end - b.begin, b.type));
      }
    partition_group.add(passes * one_pass.bytes, passes * one_pass.calls);
  }
  // Stages 1-2: the updated partitions all-gathered in allgather_bucket_size pieces (gather_updated_params).
  if (stage == 1 || stage == 2) {
    const int64_t bucket = std::max<int64_t>(2 * w, zero.allgather_bucket_size);
    for (int64_t a = 0; a < part.padded; a += bucket)
      partition_group.add(bus(ring(W), std::min(part.padded, a + bucket) - a, types.param));
  }
  // The gradient norm's sum of squares over the partition group (grad_stats), and a 1-bit
  // optimizer's agreed overflow flag on the steps that keep the gradients local.
  if (stage > 0) partition_group.add(bus(2.0 * ring(W), 1, DType::F64));
  if (!reduces && W > 1) partition_group.add(bus(2.0 * ring(W), 1, DType::I64));

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
    // qwZ (parallel/quantized_gather.hpp): each of `ranks` slices of [offset, offset + numel) under
    // `split` as int8 groups and their scales, gathered as bytes.
    const auto quantized = [](const Partition& split, int ranks, int64_t offset, int64_t numel) {
      int64_t bytes = 0;
      for (int r = 0; r < ranks; ++r) {
        const auto [a, b] = split.owned(r, offset, offset + numel);
        bytes += kernels::quantized_bytes(b - a);
      }
      return bytes;
    };
    for (const auto& [u, pos] : g.gathers) {
      const ParamUnit& unit = units[static_cast<size_t>(u)];
      const bool backward = pos < plan.trace_backward.size() && plan.trace_backward[pos];
      if (hpz > 1 && backward && primary.count(u)) {  // start_secondary_gather
        secondary.add(zero.quantized_weights
                          ? bus(ring(hpz), quantized(Partition(unit.numel, hpz), hpz, 0, unit.numel), DType::U8)
                          : bus(ring(hpz), unit.numel, types.param));
      } else if (hierarchical) {  // start_hierarchical_gather: across nodes at position 0, then inside the node
        int64_t across = 0;
        for (const auto& [node, ds] : by_node) {
          const auto [a, b] = part.owned(static_cast<int>(ds.front()), unit.offset, unit.offset + unit.numel);
          across += b - a;
        }
        inter.add(bus(ring(nodes), across, types.param));
        intra.add(bus(ring(k), unit.numel, types.param));
      } else if (types.autocast != DType::F32) {  // the autocast tensors travel in their dtype, packed as bytes
        int64_t bytes = 0;
        bool mixed = false;
        for (size_t i = 0; i < layout.tensors().size(); ++i) {
          const TensorSpec& t = layout.tensors()[i];
          const int64_t n = std::min(t.offset + t.numel, unit.offset + unit.numel) - std::max(t.offset, unit.offset);
          if (n <= 0) continue;
          bytes += n * static_cast<int64_t>(dtype_size(types.low(i) ? types.autocast : types.param));
          mixed = mixed || types.low(i);
        }
        partition_group.add(mixed ? bus(ring(W), bytes, DType::U8) : bus(ring(W), unit.numel, types.param));
      } else if (zero.quantized_weights) {
        partition_group.add(bus(ring(W), quantized(part, W, unit.offset, unit.numel), DType::U8));
      } else {
        partition_group.add(bus(ring(W), unit.numel, types.param));
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
  // A 1-bit optimizer's compressed all-reduces (compressed_allreduce.hpp): each tensor's
  // momentum (OneBitAdam), gradient or accumulated update (ZeroOneAdam), or all momenta at once
  // (OneBitLamb); sign bits through an all-to-all and an all-gather, and two all-gathers of one
  // fp32 scale per rank. Empty tensors are skipped, as the optimizers' loops skip them.
  if (traffic.onebit != OptimizerTraffic::OneBit::None && dp > 1) {
    const int D = static_cast<int>(dp);
    const auto call = [&](int64_t n) {
      const int64_t chunk_bytes = onebit_padded_size(n, D) / D / 8;
      return 2 * bus(ring(D), chunk_bytes * D, DType::U8) + 2 * bus(ring(D), D, DType::F32);
    };
    if (traffic.onebit == OptimizerTraffic::OneBit::EachTensor) {
      for (const TensorSpec& t : layout.tensors())
        if (t.numel > 0) data.add(call(t.numel), 4);
    } else {
      data.add(call(layout.total()), 4);
    }
  }
  // Pipelines: the tied wte's gradient summed between the first and the last stage (Engine::
  // finalize_grads' sum_grad_range over the embedding group, counted with the data axis).
  const int64_t tied = plan.part.vocab_local * gpt_shape_of(cfg.model).n_embd;
  if (at.layout.stages > 1 && gpt_shape_of(cfg.model).tied_head() && reduces) {
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
