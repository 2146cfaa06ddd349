// pipe_schedule.cpp — see pipe_schedule.hpp.
#include "parallel/pipe_schedule.hpp"

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <stdexcept>
#include <utility>

namespace zero3d::pipe {

const char* op_name(Op op) {
  switch (op) {
    case Op::LoadMicroBatch: return "LoadMicroBatch";
    case Op::RecvActivation: return "RecvActivation";
    case Op::SendActivation: return "SendActivation";
    case Op::RecvGrad: return "RecvGrad";
    case Op::SendGrad: return "SendGrad";
    case Op::Forward: return "ForwardPass";
    case Op::Backward: return "BackwardPass";
    case Op::BackwardInput: return "BackwardInputPass";
    case Op::BackwardWeight: return "BackwardWeightPass";
    case Op::ReduceTiedGrads: return "ReduceTiedGrads";
    case Op::ReduceGrads: return "ReduceGrads";
    case Op::OptimizerStep: return "OptimizerStep";
  }
  return "?";
}

std::string to_string(const Instruction& in) {
  if (in.micro_batch < 0) return std::string(op_name(in.op)) + "()";
  return std::string(op_name(in.op)) + "(m=" + std::to_string(in.micro_batch) + ",c=" + std::to_string(in.chunk) +
         ",b=" + std::to_string(in.buffer) + ")";
}

const char* schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::OneFOneB: return "1f1b";
    case ScheduleKind::Interleaved: return "interleaved";
    case ScheduleKind::ZeroBubbleH1: return "zb-h1";
  }
  return "?";
}

std::string check_schedule_spec(const ScheduleSpec& spec) {
  const std::string name = schedule_name(spec.kind);
  if (spec.stages < 1) return "pipeline.stages (" + std::to_string(spec.stages) + ") must be at least 1";
  if (spec.micro_batches < 1)
    return "gradient_accumulation_steps (" + std::to_string(spec.micro_batches) + ") must be at least 1";
  if (spec.virtual_stages < 1)
    return "pipeline.virtual_stages (" + std::to_string(spec.virtual_stages) + ") must be at least 1";
  if (spec.virtual_stages > 1 && spec.kind != ScheduleKind::Interleaved)
    return "pipeline.virtual_stages (" + std::to_string(spec.virtual_stages) +
           ") needs pipeline.schedule interleaved (the schedule is " + name + ")";
  if (spec.kind == ScheduleKind::Interleaved) {
    if (spec.stages < 2)
      return "pipeline.schedule interleaved needs pipeline.stages (" + std::to_string(spec.stages) +
             ") to be at least 2";
    // Megatron with microbatch group size N = p needs p <= N <= m and m mod N in {0} ∪ [p, N),
    // i.e. m a multiple of p (FACTS-2 §2.8).
    if (spec.micro_batches % spec.stages != 0)
      return "pipeline.schedule interleaved needs gradient_accumulation_steps (" +
             std::to_string(spec.micro_batches) + ") to be a multiple of pipeline.stages (" +
             std::to_string(spec.stages) + ")";
  }
  return "";
}

namespace {

void append_step_end(std::vector<Instruction>& step) {
  // DeepSpeed's final step: tied grads first so the DP reduction sees the summed tie (FACTS §8.2).
  step.push_back({Op::ReduceTiedGrads});
  step.push_back({Op::ReduceGrads});
  step.push_back({Op::OptimizerStep});
}

// DeepSpeed DataParallelSchedule (schedule.py docstring; FACTS §8.2), plus ReduceTiedGrads
// so one executor handles every stage count.
StageSchedule data_parallel_schedule(int micro_batches) {
  StageSchedule s;
  s.stage = 0;
  s.num_buffers = 1;
  for (int m = 0; m < micro_batches; ++m)
    s.steps.push_back({{Op::LoadMicroBatch, m, 0, 0}, {Op::Forward, m, 0, 0}, {Op::Backward, m, 0, 0}});
  append_step_end(s.steps.back());
  return s;
}

// DeepSpeed TrainSchedule, step for step (runtime/pipe/schedule.py; FACTS §8.2).
StageSchedule train_schedule(int M, int S, int s) {
  StageSchedule out;
  out.stage = s;
  out.num_buffers = std::max(2, std::min(S - s, M));
  const auto valid = [M](int m) { return 0 <= m && m < M; };
  const auto buf = [&out](int m) { return m % out.num_buffers; };
  const bool first = s == 0, last = s == S - 1;
  const int total = 2 * (M + S - 1);
  int prev = -1;
  for (int t = 0; t < total; ++t) {
    // Even stages run forwards on even steps, odd stages on odd steps; backwards fill the others.
    const bool forward = (t % 2) == (s % 2);
    int m;
    if (forward)
      m = (t % 2 == 0 ? t / 2 : (t - 1) / 2) - s / 2;
    else if (t % 2 == 0)
      m = t / 2 - S + (s + 1) / 2;
    else
      m = (t - 1) / 2 - S + 1 + s / 2;
    std::vector<Instruction> step;
    if (forward) {
      if (valid(prev) && !first) step.push_back({Op::SendGrad, prev, 0, buf(prev)});
      if (valid(m) && !first) step.push_back({Op::RecvActivation, m, 0, buf(m)});
    } else {
      if (valid(m) && !last) step.push_back({Op::RecvGrad, m, 0, buf(m)});
      if (valid(prev) && !last) step.push_back({Op::SendActivation, prev, 0, buf(prev)});
    }
    if ((first || last) && forward && valid(m)) step.push_back({Op::LoadMicroBatch, m, 0, buf(m)});
    if (valid(m)) step.push_back({forward ? Op::Forward : Op::Backward, m, 0, buf(m)});
    if (t == total - 1) append_step_end(step);
    out.steps.push_back(std::move(step));
    prev = m;
  }
  return out;
}

// One compute operation of a stage's order: Forward, Backward, BackwardInput or BackwardWeight.
struct Work {
  Op op;
  int micro_batch;
  int chunk;
};

// Megatron get_schedule_table with group size N = p: per group of p micro-batches, chunk 0 for
// all of them, then chunk 1, ... (FACTS-2 §2.8).
std::vector<std::pair<int, int>> interleaved_table(int p, int v, int m) {
  std::vector<std::pair<int, int>> table;
  for (int lo = 0; lo < m; lo += p)
    for (int c = 0; c < v; ++c)
      for (int mb = lo; mb < std::min(lo + p, m); ++mb) table.emplace_back(mb, c);
  return table;
}

// Megatron forward_backward_pipelining_with_interleaving: warm-up of 2(p−r−1) + (v−1)·p
// forwards (capped at m·v), then one forward and one backward per iteration, then the
// remaining backwards; backward k runs table entry k on chunk v−1−c (FACTS-2 §2.8).
std::vector<Work> interleaved_order(int p, int v, int m, int r) {
  const auto table = interleaved_table(p, v, m);
  const int total = m * v;
  const int warmup = std::min(2 * (p - r - 1) + (v - 1) * p, total);
  const auto fwd = [&](int k) { return Work{Op::Forward, table[k].first, table[k].second}; };
  const auto bwd = [&](int k) { return Work{Op::Backward, table[k].first, v - 1 - table[k].second}; };
  std::vector<Work> order;
  for (int k = 0; k < warmup; ++k) order.push_back(fwd(k));
  for (int k = 0; k < total - warmup; ++k) {
    order.push_back(fwd(warmup + k));
    order.push_back(bwd(k));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(bwd(k));
  return order;
}

// ZB-H1 (Qi et al. 2024, arXiv:2401.10241; FACTS-2 §2.9): 1F1B's order (warm-up p−r−1
// forwards) with each backward split into B and a queued W; backward k is followed by the
// oldest queued W only when k >= r, so rank r pushes r W's into its tail bubble; the rest
// are flushed before the optimizer step.
std::vector<Work> zb_h1_order(int p, int m, int r) {
  const int warmup = std::min(p - r - 1, m);
  std::vector<Work> order;
  std::deque<int> queued;
  const auto backward = [&](int k) {
    order.push_back({Op::BackwardInput, k, 0});
    queued.push_back(k);
    if (k >= r) {
      order.push_back({Op::BackwardWeight, queued.front(), 0});
      queued.pop_front();
    }
  };
  for (int k = 0; k < warmup; ++k) order.push_back({Op::Forward, k, 0});
  for (int k = 0; k < m - warmup; ++k) {
    order.push_back({Op::Forward, warmup + k, 0});
    backward(k);
  }
  for (int k = m - warmup; k < m; ++k) backward(k);
  for (int k : queued) order.push_back({Op::BackwardWeight, k, 0});
  return order;
}

// Turns a compute order into steps with communication and buffers. One step per compute op:
// [RecvActivation] [LoadMicroBatch] Forward [SendActivation], [RecvGrad] Backward|B [SendGrad],
// BackwardWeight. A (micro-batch, chunk) holds one buffer from its first instruction to its
// last (SendGrad, Backward, or W, which reads the activations kept in it). Buffers are an
// interval colouring, so their number is the peak of simultaneously live micro-batches; each
// receive is then hoisted to the point its buffer is free (RecvActivation: after the previous
// occupant's last instruction; RecvGrad: after its own forward), never ahead of the previous
// receive on the same channel, so MPI's in-order matching pairs them with the sends.
StageSchedule emit(const std::vector<Work>& order, int p, int v, int stage) {
  const int last_vs = p * v - 1;
  struct Placed {
    Instruction in;
    int step;
  };
  std::vector<Placed> flat;  // every instruction except receives, in program order
  std::map<std::pair<int, int>, int> first_at, last_at, forward_end;
  const auto put = [&](Op op, const Work& w, int step) {
    const std::pair<int, int> key{w.micro_batch, w.chunk};
    const int at = static_cast<int>(flat.size());
    flat.push_back({{op, w.micro_batch, w.chunk, -1}, step});
    first_at.emplace(key, at);
    last_at[key] = at;
  };
  for (int step = 0; step < static_cast<int>(order.size()); ++step) {
    const Work& w = order[step];
    const int vs = w.chunk * p + stage;
    if (w.op == Op::Forward) {
      if (vs == 0 || vs == last_vs) put(Op::LoadMicroBatch, w, step);  // tokens / targets
      put(Op::Forward, w, step);
      if (vs < last_vs) put(Op::SendActivation, w, step);
      forward_end[{w.micro_batch, w.chunk}] = static_cast<int>(flat.size()) - 1;
    } else {
      put(w.op, w, step);
      if (w.op != Op::BackwardWeight && vs > 0) put(Op::SendGrad, w, step);
    }
  }

  // Interval colouring in order of first use, reusing the buffer freed longest ago so the
  // receive into it can be posted earliest.
  std::vector<std::pair<int, std::pair<int, int>>> by_start;
  for (const auto& [key, at] : first_at) by_start.push_back({at, key});
  std::sort(by_start.begin(), by_start.end());
  std::vector<int> buffer_free_after;  // flat index of the last instruction of the buffer's occupant
  std::map<std::pair<int, int>, int> buffer_of, recv_act_after;
  for (const auto& [start, key] : by_start) {
    int best = -1;
    for (int b = 0; b < static_cast<int>(buffer_free_after.size()); ++b)
      if (buffer_free_after[b] < start && (best < 0 || buffer_free_after[b] < buffer_free_after[best])) best = b;
    if (best < 0) {
      best = static_cast<int>(buffer_free_after.size());
      buffer_free_after.push_back(-1);
    }
    recv_act_after[key] = buffer_free_after[best];
    buffer_free_after[best] = last_at[key];
    buffer_of[key] = best;
  }
  for (Placed& pl : flat) pl.in.buffer = buffer_of[{pl.in.micro_batch, pl.in.chunk}];

  // Receives, per channel (kind, chunk) in the order the peer sends: by micro-batch, which is
  // both the forward and the backward order of every chunk in these schedules.
  std::multimap<int, Instruction> after;  // flat index (-1: schedule start) -> receives posted after it
  std::map<std::pair<Op, int>, int> channel_at;
  for (const auto& [start, key] : by_start) {
    const int mb = key.first, c = key.second;  // named, not bound: a lambda below captures them (C++17)
    const int vs = c * p + stage;
    const int b = buffer_of[key];
    const auto post = [&](Op op, int at) {
      auto it = channel_at.find({op, c});
      if (it != channel_at.end()) at = std::max(at, it->second);
      channel_at[{op, c}] = at;
      after.insert({at, {op, mb, c, b}});
    };
    if (vs > 0) post(Op::RecvActivation, recv_act_after[key]);
    if (vs < last_vs) post(Op::RecvGrad, forward_end[key]);
  }

  StageSchedule out;
  out.stage = stage;
  out.num_buffers = static_cast<int>(buffer_free_after.size());
  out.steps.assign(order.size(), {});
  const auto emit_after = [&](int at, int step) {
    auto [lo, hi] = after.equal_range(at);
    for (auto it = lo; it != hi; ++it) out.steps[step].push_back(it->second);
  };
  emit_after(-1, 0);
  for (int i = 0; i < static_cast<int>(flat.size()); ++i) {
    out.steps[flat[i].step].push_back(flat[i].in);
    emit_after(i, flat[i].step);
  }
  append_step_end(out.steps.back());
  return out;
}

}  // namespace

StageSchedule make_schedule(const ScheduleSpec& spec, int stage) {
  const std::string why = check_schedule_spec(spec);
  if (!why.empty()) throw std::invalid_argument(why);
  if (stage < 0 || stage >= spec.stages)
    throw std::invalid_argument("pipeline stage " + std::to_string(stage) + " is outside [0, " +
                                std::to_string(spec.stages) + ")");
  const int p = spec.stages, m = spec.micro_batches;
  if (p == 1) return data_parallel_schedule(m);
  switch (spec.kind) {
    case ScheduleKind::OneFOneB: return train_schedule(m, p, stage);
    case ScheduleKind::Interleaved:
      return emit(interleaved_order(p, spec.virtual_stages, m, stage), p, spec.virtual_stages, stage);
    case ScheduleKind::ZeroBubbleH1: return emit(zb_h1_order(p, m, stage), p, 1, stage);
  }
  throw std::invalid_argument("unknown pipeline schedule kind");
}

StageSchedule make_inference_schedule(const ScheduleSpec& spec, int stage) {
  const std::string why = check_schedule_spec(spec);
  if (!why.empty()) throw std::invalid_argument(why);
  const int p = spec.stages, M = spec.micro_batches, v = spec.virtual_stages;
  StageSchedule out;
  out.stage = stage;
  out.num_buffers = p == 1 ? 1 : 2;
  if (p == 1) {
    for (int m = 0; m < M; ++m) out.steps.push_back({{Op::LoadMicroBatch, m, 0, 0}, {Op::Forward, m, 0, 0}});
    return out;
  }
  const bool first = stage == 0, last = stage == p - 1;
  if (v == 1) {
    const auto valid = [M](int m) { return 0 <= m && m < M; };
    for (int t = 0; t < M + p - 1; ++t) {
      const int m = t - stage;
      // Even stages receive into t % 2 and send from the other buffer; odd stages the reverse.
      const int recv_buf = stage % 2 == 0 ? t % 2 : (t + 1) % 2, send_buf = 1 - recv_buf;
      std::vector<Instruction> step;
      if (first || last)
        if (valid(m)) step.push_back({Op::LoadMicroBatch, m, 0, recv_buf});
      const Instruction send{Op::SendActivation, m - 1, 0, send_buf}, recv{Op::RecvActivation, m, 0, recv_buf};
      const bool do_send = !last && valid(m - 1), do_recv = !first && valid(m);
      if (stage % 2 == 0) {
        if (do_send) step.push_back(send);
        if (do_recv) step.push_back(recv);
      } else {
        if (do_recv) step.push_back(recv);
        if (do_send) step.push_back(send);
      }
      if (valid(m)) step.push_back({Op::Forward, m, 0, recv_buf});
      out.steps.push_back(std::move(step));
    }
    return out;
  }
  int k = 0;
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < v; ++c, ++k) {
      const int vs = c * p + stage, b = k % 2;
      std::vector<Instruction> step;
      if (vs == 0 || vs == p * v - 1) step.push_back({Op::LoadMicroBatch, m, c, b});
      if (vs > 0) step.push_back({Op::RecvActivation, m, c, b});
      step.push_back({Op::Forward, m, c, b});
      if (vs < p * v - 1) step.push_back({Op::SendActivation, m, c, b});
      out.steps.push_back(std::move(step));
    }
  return out;
}

double bubble_fraction(const ScheduleSpec& spec) {
  const double p = spec.stages, m = spec.micro_batches, v = spec.virtual_stages;
  if (spec.stages <= 1) return 0.0;
  switch (spec.kind) {
    // idle (p−1)(T_F+T_B) against busy m(T_F+T_B) (Narayanan et al. 2021; FACTS-2 §2.8).
    case ScheduleKind::OneFOneB: return (p - 1) / (m + p - 1);
    // chunks of 1/v the work shrink the idle time v-fold (Narayanan et al. 2021 §2.2; FACTS-2 §2.8).
    case ScheduleKind::Interleaved: return (p - 1) / (v * m + p - 1);
    // T_F=T_B=T_W=T: the last stage ends at (3m+p−1)T, idle (p−1)(T_F+T_B−T_W) (Qi et al. 2024 Table 2;
    // FACTS-2 §2.9); with m < p the last micro-batch's B chain back to stage 0 and its W end later, at (2m+2p−1)T.
    case ScheduleKind::ZeroBubbleH1: {
      const double end = std::max(3 * m + p - 1, 2 * m + 2 * p - 1);
      return (end - 3 * m) / end;
    }
  }
  return 0.0;
}

std::vector<int> partition_uniform(int num_items, int num_parts) {
  if (num_parts < 1) throw std::invalid_argument("partition_uniform: num_parts (" + std::to_string(num_parts) +
                                                 ") must be at least 1");
  std::vector<int> parts(num_parts + 1);
  if (num_items <= num_parts) {
    for (int i = 0; i <= num_parts; ++i) parts[i] = std::min(i, num_items);
    return parts;
  }
  // DeepSpeed runtime/utils.py: equal chunks, the first `residual` parts one item larger (FACTS §8.3).
  const int chunk = num_items / num_parts, residual = num_items - chunk * num_parts;
  for (int i = 0; i <= num_parts; ++i) parts[i] = i * chunk + std::min(i, residual);
  return parts;
}

std::vector<int> partition_balanced(const std::vector<double>& weights, int num_parts) {
  if (num_parts < 1) throw std::invalid_argument("partition_balanced: num_parts (" + std::to_string(num_parts) +
                                                 ") must be at least 1");
  const int n = static_cast<int>(weights.size()), p = num_parts;
  if (n <= p) return partition_uniform(n, p);
  // DeepSpeed runtime/utils.py (DP since #4312; FACTS §8.3): minimise max part − min part over
  // non-empty parts; `>=` moves ties to the later split. Unreachable states stay +inf as in numpy.
  const double inf = std::numeric_limits<double>::infinity();
  const auto at = [p](int i, int j) { return static_cast<size_t>(i) * (p + 1) + j; };
  std::vector<double> dp_max((n + 1) * (p + 1), inf), dp_min(dp_max), dp_cost(dp_max);
  std::vector<int> position((n + 1) * (p + 1), 0);
  std::vector<double> prefix(n + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + weights[i];
  dp_max[at(0, 0)] = 0;
  dp_cost[at(0, 0)] = 0;
  for (int i = 1; i <= n; ++i)
    for (int j = 1; j <= std::min(i, p); ++j)
      for (int k = 0; k < i; ++k) {
        const double part = prefix[i] - prefix[k];
        const double max_sum = std::max(dp_max[at(k, j - 1)], part);
        const double min_sum = std::min(dp_min[at(k, j - 1)], part);
        const double cost = max_sum - min_sum;
        if (dp_cost[at(i, j)] >= cost) {
          dp_cost[at(i, j)] = cost;
          dp_max[at(i, j)] = max_sum;
          dp_min[at(i, j)] = min_sum;
          position[at(i, j)] = k;
        }
      }
  std::vector<int> parts(p + 1);
  parts[p] = n;
  for (int j = p; j >= 1; --j) parts[j - 1] = position[at(parts[j], j)];
  return parts;
}

}  // namespace zero3d::pipe
