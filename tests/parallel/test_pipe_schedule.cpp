// Pipeline schedules as data: DeepSpeed's TrainSchedule word for word, and for every kind a
// simulation of all stages together (pairing, deadlock, dependencies, buffers, idle time).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "parallel/pipe_schedule.hpp"

namespace zero3d::pipe {
namespace {

using Step = std::vector<Instruction>;

Instruction I(Op op, int m, int b) { return {op, m, 0, b}; }
Instruction Load(int m, int b) { return I(Op::LoadMicroBatch, m, b); }
Instruction Fwd(int m, int b) { return I(Op::Forward, m, b); }
Instruction Bwd(int m, int b) { return I(Op::Backward, m, b); }
Instruction SendAct(int m, int b) { return I(Op::SendActivation, m, b); }
Instruction RecvAct(int m, int b) { return I(Op::RecvActivation, m, b); }
Instruction SendG(int m, int b) { return I(Op::SendGrad, m, b); }
Instruction RecvG(int m, int b) { return I(Op::RecvGrad, m, b); }
const Instruction kTied{Op::ReduceTiedGrads}, kReduce{Op::ReduceGrads}, kStep{Op::OptimizerStep};

std::string show(const std::vector<Step>& steps) {
  std::string s;
  for (size_t t = 0; t < steps.size(); ++t) {
    s += "t" + std::to_string(t) + ":";
    for (const Instruction& in : steps[t]) s += " " + to_string(in);
    s += "\n";
  }
  return s;
}

std::vector<Instruction> flatten(const StageSchedule& s) {
  std::vector<Instruction> out;
  for (const Step& step : s.steps) out.insert(out.end(), step.begin(), step.end());
  return out;
}

bool is_compute(Op op) {
  return op == Op::Forward || op == Op::Backward || op == Op::BackwardInput || op == Op::BackwardWeight;
}

// Every spec the grid covers: p ∈ 1..5, m ∈ 1..9, each kind; interleaved with v ∈ 1..3 where
// check_schedule_spec accepts it.
std::vector<ScheduleSpec> grid() {
  std::vector<ScheduleSpec> specs;
  for (int p = 1; p <= 5; ++p)
    for (int m = 1; m <= 9; ++m) {
      specs.push_back({ScheduleKind::OneFOneB, p, m, 1});
      specs.push_back({ScheduleKind::ZeroBubbleH1, p, m, 1});
      for (int v = 1; v <= 3; ++v) {
        ScheduleSpec s{ScheduleKind::Interleaved, p, m, v};
        if (check_schedule_spec(s).empty()) specs.push_back(s);
      }
    }
  return specs;
}

std::string name(const ScheduleSpec& s) {
  return std::string(schedule_name(s.kind)) + " p=" + std::to_string(s.stages) + " m=" +
         std::to_string(s.micro_batches) + " v=" + std::to_string(s.virtual_stages);
}

std::vector<StageSchedule> all_stages(const ScheduleSpec& spec, bool inference = false) {
  std::vector<StageSchedule> out;
  for (int s = 0; s < spec.stages; ++s)
    out.push_back(inference ? make_inference_schedule(spec, s) : make_schedule(spec, s));
  return out;
}

// Runs every stage's instruction list together. Sends never block; a Forward (Backward,
// BackwardInput) that consumes a received buffer starts once the peer has executed the
// matching send; messages are FIFO per (sender, receiver, kind, receiving virtual stage) and the
// k-th send must carry the k-th receive's micro-batch. A buffer taken by a new micro-batch
// also waits until every earlier send from it has a posted receive (an MPI rendezvous send
// completes no sooner). Compute takes the given times, communication none.
struct Costs {
  double forward = 1, backward_input = 1, backward_weight = 1;
};

struct Simulation {
  std::string error;  // empty when every stage ran to its end with all messages paired
  double makespan = 0;
  std::vector<double> busy;
  std::map<std::tuple<Op, int, int>, std::pair<double, double>> span;  // (op, mb, virtual stage) -> start, end
};

Simulation simulate(const ScheduleSpec& spec, Costs cost = {}, bool inference = false) {
  const int p = spec.stages, V = p * spec.virtual_stages;
  const std::vector<StageSchedule> stages = all_stages(spec, inference);
  std::vector<std::vector<Instruction>> prog;
  for (const StageSchedule& s : stages) prog.push_back(flatten(s));

  using Channel = std::tuple<int, int, int, int>;  // sender, receiver, 0 activation / 1 grad, receiving vs
  struct Messages {
    std::vector<int> sent, received;
    std::vector<double> sent_at, received_at;
  };
  struct Posted {
    Channel channel;
    int k, buffer;
    bool consumed = false;
  };
  std::map<Channel, Messages> channels;
  std::map<std::tuple<int, Op, int, int>, Posted> posted;  // (stage, recv op, mb, chunk)
  std::vector<std::map<int, std::vector<std::pair<Channel, int>>>> sends_from(p);  // stage -> buffer -> sends
  std::vector<std::map<int, std::pair<int, int>>> occupant(p);                     // stage -> buffer -> (mb, chunk)
  std::vector<size_t> pc(p, 0);
  std::vector<double> clock(p, 0.0);
  Simulation sim;
  sim.busy.assign(p, 0.0);

  const auto fail = [&](int s, const Instruction& in, const std::string& why) {
    if (sim.error.empty()) sim.error = "stage " + std::to_string(s) + " " + to_string(in) + ": " + why;
  };
  const auto pair_check = [&](const Channel& ch, int s, const Instruction& in) {
    const Messages& q = channels[ch];
    const size_t k = std::min(q.sent.size(), q.received.size());
    if (k > 0 && q.sent[k - 1] != q.received[k - 1])
      fail(s, in, "message " + std::to_string(k - 1) + " carries micro-batch " + std::to_string(q.sent[k - 1]) +
                      " into the receive of micro-batch " + std::to_string(q.received[k - 1]));
  };
  const auto rank_of = [p](int vs) { return vs % p; };

  // The time at which instruction `in` of stage s can run, or a negative value while it waits.
  const auto ready_at = [&](int s, const Instruction& in) -> double {
    double t = clock[s];
    if (in.micro_batch >= 0) {
      auto occ = occupant[s].find(in.buffer);
      const bool takes = occ == occupant[s].end() || occ->second != std::make_pair(in.micro_batch, in.chunk);
      if (takes)
        for (const auto& [ch, k] : sends_from[s][in.buffer]) {
          const Messages& q = channels[ch];
          if (static_cast<int>(q.received.size()) <= k) return -1;
          t = std::max(t, q.received_at[k]);
        }
    }
    const int vs = in.chunk * p + s;
    Op needs = in.op;
    if (in.op == Op::Forward && vs > 0)
      needs = Op::RecvActivation;
    else if ((in.op == Op::Backward || in.op == Op::BackwardInput) && vs < V - 1)
      needs = Op::RecvGrad;
    if (needs != in.op) {
      auto it = posted.find({s, needs, in.micro_batch, in.chunk});
      if (it == posted.end()) {
        fail(s, in, std::string("consumes a buffer with no ") + op_name(needs) + " posted");
        return -1;
      }
      const Messages& q = channels[it->second.channel];
      if (static_cast<int>(q.sent.size()) <= it->second.k) return -1;
      t = std::max(t, q.sent_at[it->second.k]);
    }
    return t;
  };

  const auto execute = [&](int s, const Instruction& in, double t) {
    const int vs = in.chunk * p + s;
    if (in.micro_batch >= 0) {
      auto& occ = occupant[s][in.buffer];
      if (occ != std::make_pair(in.micro_batch, in.chunk)) {
        occ = {in.micro_batch, in.chunk};
        sends_from[s][in.buffer].clear();
      }
    }
    clock[s] = t;
    const auto send = [&](int kind, int to_vs) {
      if (to_vs < 0 || to_vs >= V) return fail(s, in, "has no peer");
      const Channel ch{s, rank_of(to_vs), kind, to_vs};
      Messages& q = channels[ch];
      sends_from[s][in.buffer].push_back({ch, static_cast<int>(q.sent.size())});
      q.sent.push_back(in.micro_batch);
      q.sent_at.push_back(t);
      pair_check(ch, s, in);
    };
    const auto receive = [&](int kind, int from_vs) {
      if (from_vs < 0 || from_vs >= V) return fail(s, in, "has no peer");
      const Channel ch{rank_of(from_vs), s, kind, vs};
      Messages& q = channels[ch];
      if (!posted.emplace(std::make_tuple(s, in.op, in.micro_batch, in.chunk),
                          Posted{ch, static_cast<int>(q.received.size()), in.buffer})
               .second)
        return fail(s, in, "is posted twice");
      q.received.push_back(in.micro_batch);
      q.received_at.push_back(t);
      pair_check(ch, s, in);
    };
    const auto compute = [&](double c) {
      if (!sim.span.emplace(std::make_tuple(in.op, in.micro_batch, vs), std::make_pair(t, t + c)).second)
        fail(s, in, "runs twice");
      clock[s] = t + c;
      sim.busy[s] += c;
    };
    const auto consume = [&](Op recv) {
      auto it = posted.find({s, recv, in.micro_batch, in.chunk});
      if (it == posted.end()) return;
      if (it->second.buffer != in.buffer) fail(s, in, "reads a different buffer than its receive");
      if (it->second.consumed) fail(s, in, "consumes a receive twice");
      it->second.consumed = true;
    };
    switch (in.op) {
      case Op::SendActivation: send(0, vs + 1); break;
      case Op::SendGrad: send(1, vs - 1); break;
      case Op::RecvActivation: receive(0, vs - 1); break;
      case Op::RecvGrad: receive(1, vs + 1); break;
      case Op::Forward:
        consume(Op::RecvActivation);
        compute(cost.forward);
        break;
      case Op::Backward:
        consume(Op::RecvGrad);
        compute(cost.backward_input + cost.backward_weight);
        break;
      case Op::BackwardInput:
        consume(Op::RecvGrad);
        compute(cost.backward_input);
        break;
      case Op::BackwardWeight: compute(cost.backward_weight); break;
      default: break;
    }
  };

  for (;;) {
    bool progress = false, done = true;
    for (int s = 0; s < p; ++s)
      while (pc[s] < prog[s].size() && sim.error.empty()) {
        const Instruction& in = prog[s][pc[s]];
        const double t = ready_at(s, in);
        if (t < 0) break;
        execute(s, in, t);
        ++pc[s];
        progress = true;
      }
    if (!sim.error.empty()) return sim;
    for (int s = 0; s < p; ++s) done = done && pc[s] == prog[s].size();
    if (done) break;
    if (!progress) {
      sim.error = "deadlock:";
      for (int s = 0; s < p; ++s)
        if (pc[s] < prog[s].size()) sim.error += " stage " + std::to_string(s) + " at " + to_string(prog[s][pc[s]]);
      return sim;
    }
  }
  for (const auto& [ch, q] : channels)
    if (q.sent.size() != q.received.size())
      sim.error = "channel " + std::to_string(std::get<0>(ch)) + "->" + std::to_string(std::get<1>(ch)) + " has " +
                  std::to_string(q.sent.size()) + " sends and " + std::to_string(q.received.size()) + " receives";
  for (const auto& [key, post] : posted)
    if (!post.consumed) sim.error = "a receive of stage " + std::to_string(std::get<0>(key)) + " is never consumed";
  sim.makespan = *std::max_element(clock.begin(), clock.end());
  return sim;
}

// The compute operations of one stage, in order, as (op, micro-batch, chunk).
std::vector<std::tuple<Op, int, int>> compute_order(const StageSchedule& s) {
  std::vector<std::tuple<Op, int, int>> out;
  for (const Instruction& in : flatten(s))
    if (is_compute(in.op)) out.emplace_back(in.op, in.micro_batch, in.chunk);
  return out;
}

// ---------------------------------------------------------------------------------------------

TEST(PipeSchedule, OneFOneBMatchesDeepSpeedWorkedExampleForAllThreeStages) {
  // DEEPSPEED-FACTS §8.2, M=4, S=3 (F/B carry the micro-batch, the rest the buffer there).
  const ScheduleSpec spec{ScheduleKind::OneFOneB, 3, 4, 1};
  const std::vector<Step> stage0 = {
      {Load(0, 0), Fwd(0, 0)},
      {SendAct(0, 0)},
      {Load(1, 1), Fwd(1, 1)},
      {SendAct(1, 1)},
      {Load(2, 2), Fwd(2, 2)},
      {RecvG(0, 0), SendAct(2, 2), Bwd(0, 0)},
      {Load(3, 0), Fwd(3, 0)},
      {RecvG(1, 1), SendAct(3, 0), Bwd(1, 1)},
      {},
      {RecvG(2, 2), Bwd(2, 2)},
      {},
      {RecvG(3, 0), Bwd(3, 0), kTied, kReduce, kStep},
  };
  const std::vector<Step> stage1 = {
      {},
      {RecvAct(0, 0), Fwd(0, 0)},
      {SendAct(0, 0)},
      {RecvAct(1, 1), Fwd(1, 1)},
      {RecvG(0, 0), SendAct(1, 1), Bwd(0, 0)},
      {SendG(0, 0), RecvAct(2, 0), Fwd(2, 0)},
      {RecvG(1, 1), SendAct(2, 0), Bwd(1, 1)},
      {SendG(1, 1), RecvAct(3, 1), Fwd(3, 1)},
      {RecvG(2, 0), SendAct(3, 1), Bwd(2, 0)},
      {SendG(2, 0)},
      {RecvG(3, 1), Bwd(3, 1)},
      {SendG(3, 1), kTied, kReduce, kStep},
  };
  const std::vector<Step> stage2 = {
      {},
      {},
      {RecvAct(0, 0), Load(0, 0), Fwd(0, 0)},
      {Bwd(0, 0)},
      {SendG(0, 0), RecvAct(1, 1), Load(1, 1), Fwd(1, 1)},
      {Bwd(1, 1)},
      {SendG(1, 1), RecvAct(2, 0), Load(2, 0), Fwd(2, 0)},
      {Bwd(2, 0)},
      {SendG(2, 0), RecvAct(3, 1), Load(3, 1), Fwd(3, 1)},
      {Bwd(3, 1)},
      {SendG(3, 1)},
      {kTied, kReduce, kStep},
  };
  const std::vector<std::vector<Step>> expected = {stage0, stage1, stage2};
  const std::vector<int> buffers = {3, 2, 2};
  for (int s = 0; s < 3; ++s) {
    const StageSchedule got = make_schedule(spec, s);
    EXPECT_EQ(got.stage, s);
    EXPECT_EQ(got.num_buffers, buffers[s]) << "stage " << s;
    EXPECT_EQ(show(got.steps), show(expected[s])) << "stage " << s;
  }
}

TEST(PipeSchedule, OneStageIsDeepSpeedDataParallelSchedule) {
  for (ScheduleKind kind : {ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1}) {
    const StageSchedule got = make_schedule({kind, 1, 3, 1}, 0);
    const std::vector<Step> expected = {
        {Load(0, 0), Fwd(0, 0), Bwd(0, 0)},
        {Load(1, 0), Fwd(1, 0), Bwd(1, 0)},
        {Load(2, 0), Fwd(2, 0), Bwd(2, 0), kTied, kReduce, kStep},
    };
    EXPECT_EQ(got.num_buffers, 1);
    EXPECT_EQ(show(got.steps), show(expected)) << schedule_name(kind);
  }
}

TEST(PipeSchedule, OneFOneBReservesDeepSpeedBufferCountAndTwoStepsPerMicroBatchAndStage) {
  for (int S = 2; S <= 6; ++S)
    for (int M = 1; M <= 9; ++M)
      for (int s = 0; s < S; ++s) {
        const StageSchedule got = make_schedule({ScheduleKind::OneFOneB, S, M, 1}, s);
        EXPECT_EQ(got.num_buffers, std::max(2, std::min(S - s, M))) << "S=" << S << " M=" << M << " s=" << s;
        EXPECT_EQ(got.steps.size(), static_cast<size_t>(2 * (M + S - 1)));
      }
}

TEST(PipeSchedule, EveryKindRunsWithoutDeadlockAndPairsEverySendWithItsReceive) {
  for (const ScheduleSpec& spec : grid()) {
    const Simulation sim = simulate(spec);
    EXPECT_EQ(sim.error, "") << name(spec);
  }
}

TEST(PipeSchedule, InferenceRunsEveryForwardOnceInOrderWithoutDeadlock) {
  for (const ScheduleSpec& spec : grid()) {
    const Simulation sim = simulate(spec, {}, /*inference=*/true);
    ASSERT_EQ(sim.error, "") << name(spec);
    const int V = spec.stages * spec.virtual_stages;
    EXPECT_EQ(sim.span.size(), static_cast<size_t>(spec.micro_batches * V)) << name(spec);
    for (int m = 0; m < spec.micro_batches; ++m)
      for (int vs = 1; vs < V; ++vs)  // each virtual stage after the one before it
        EXPECT_GE(sim.span.at({Op::Forward, m, vs}).first, sim.span.at({Op::Forward, m, vs - 1}).second) << name(spec);
    for (int s = 0; s < spec.stages; ++s) {
      const StageSchedule sched = make_inference_schedule(spec, s);
      EXPECT_EQ(sched.num_buffers, spec.stages == 1 ? 1 : 2) << name(spec);
      for (const Instruction& in : flatten(sched)) EXPECT_LT(in.buffer, sched.num_buffers) << name(spec);
      // DeepSpeed's InferenceSchedule: m + p - 1 steps with one chunk per stage
      if (spec.virtual_stages == 1 && spec.stages > 1) {
        EXPECT_EQ(sched.steps.size(), static_cast<size_t>(spec.micro_batches + spec.stages - 1)) << name(spec);
      }
    }
  }
}

TEST(PipeSchedule, InferenceEvenStagesSendBeforeTheyReceiveOddStagesAfter) {
  const ScheduleSpec spec{ScheduleKind::OneFOneB, 3, 4, 1};
  // stage 1 (odd) at step 2 runs micro-batch 1: receive into buffer 0... (t+1)%2 = 1, send m=0 from 0
  const StageSchedule odd = make_inference_schedule(spec, 1);
  EXPECT_EQ(odd.steps[2], (Step{RecvAct(1, 1), SendAct(0, 0), Fwd(1, 1)})) << show(odd.steps);
  const StageSchedule even = make_inference_schedule(spec, 0);
  EXPECT_EQ(even.steps[2], (Step{Load(2, 0), SendAct(1, 1), Fwd(2, 0)})) << show(even.steps);
  const StageSchedule last = make_inference_schedule(spec, 2);
  EXPECT_EQ(last.steps[2], (Step{Load(0, 0), RecvAct(0, 0), Fwd(0, 0)})) << show(last.steps);
}

TEST(PipeSchedule, EveryPassRunsOnceAfterWhatItDependsOn) {
  for (const ScheduleSpec& spec : grid()) {
    const Simulation sim = simulate(spec);
    ASSERT_EQ(sim.error, "") << name(spec);
    const int V = spec.stages * spec.virtual_stages;
    const bool split = spec.kind == ScheduleKind::ZeroBubbleH1 && spec.stages > 1;
    const std::vector<Op> ops = split ? std::vector<Op>{Op::Forward, Op::BackwardInput, Op::BackwardWeight}
                                      : std::vector<Op>{Op::Forward, Op::Backward};
    EXPECT_EQ(sim.span.size(), ops.size() * spec.micro_batches * V) << name(spec);
    const Op backward = split ? Op::BackwardInput : Op::Backward;
    for (int m = 0; m < spec.micro_batches; ++m)
      for (int vs = 0; vs < V; ++vs) {
        for (Op op : ops) ASSERT_TRUE(sim.span.count({op, m, vs})) << name(spec) << " " << op_name(op) << " m=" << m;
        const auto F = sim.span.at({Op::Forward, m, vs});
        const auto B = sim.span.at({backward, m, vs});
        if (vs > 0) {
          EXPECT_GE(F.first, sim.span.at({Op::Forward, m, vs - 1}).second) << name(spec);
        }
        if (vs < V - 1) {
          EXPECT_GE(B.first, sim.span.at({backward, m, vs + 1}).second) << name(spec);
        }
        EXPECT_GE(B.first, F.second) << name(spec);
        if (split) {
          EXPECT_GE(sim.span.at({Op::BackwardWeight, m, vs}).first, B.second) << name(spec);
        }
      }
  }
}

TEST(PipeSchedule, LastStepEndsWithTiedReduceThenGradReduceThenOptimizerStep) {
  for (const ScheduleSpec& spec : grid())
    for (const StageSchedule& s : all_stages(spec)) {
      const std::vector<Instruction> flat = flatten(s);
      ASSERT_GE(s.steps.back().size(), 3u);
      const Step& last = s.steps.back();
      EXPECT_EQ(std::vector<Instruction>(last.end() - 3, last.end()), (std::vector<Instruction>{kTied, kReduce, kStep}))
          << name(spec);
      EXPECT_EQ(std::count_if(flat.begin(), flat.end(), [](const Instruction& in) { return in.micro_batch < 0; }), 3)
          << name(spec) << " stage " << s.stage;
    }
}

// A (micro-batch, chunk) holds its buffer from its first instruction (Load, RecvActivation or
// Forward) to its last (SendGrad, Backward or BackwardWeight).
TEST(PipeSchedule, NoBufferIsReusedWhileItsMicroBatchIsLive) {
  for (const ScheduleSpec& spec : grid())
    for (const StageSchedule& s : all_stages(spec)) {
      const std::vector<Instruction> flat = flatten(s);
      std::map<std::pair<int, int>, std::pair<int, int>> live;  // (mb, chunk) -> first, last index
      std::map<std::pair<int, int>, int> buffer;
      for (int i = 0; i < static_cast<int>(flat.size()); ++i) {
        const Instruction& in = flat[i];
        if (in.micro_batch < 0) continue;
        const std::pair<int, int> key{in.micro_batch, in.chunk};
        ASSERT_GE(in.buffer, 0);
        ASSERT_LT(in.buffer, s.num_buffers) << name(spec) << " stage " << s.stage << " " << to_string(in);
        auto [it, fresh] = buffer.emplace(key, in.buffer);
        EXPECT_EQ(it->second, in.buffer) << name(spec) << " " << to_string(in) << " changes buffer";
        if (fresh) {
          const Op first = in.op;
          EXPECT_TRUE(first == Op::LoadMicroBatch || first == Op::RecvActivation || first == Op::Forward)
              << name(spec) << " " << to_string(in);
          live[key] = {i, i};
        }
        live[key].second = i;
      }
      int peak = 0;
      for (int i = 0; i < static_cast<int>(flat.size()); ++i) {
        std::set<int> held;
        int n = 0;
        for (const auto& [key, range] : live)
          if (range.first <= i && i <= range.second) {
            ++n;
            EXPECT_TRUE(held.insert(buffer[key]).second)
                << name(spec) << " stage " << s.stage << ": buffer " << buffer[key] << " shared at " << to_string(flat[i]);
          }
        peak = std::max(peak, n);
      }
      // DeepSpeed reserves at least 2; the other kinds reserve exactly the peak of live micro-batches.
      if (spec.kind == ScheduleKind::OneFOneB || spec.stages == 1)
        EXPECT_LE(peak, s.num_buffers) << name(spec);
      else
        EXPECT_EQ(peak, s.num_buffers) << name(spec) << " stage " << s.stage;
    }
}

// Posted early, a receive overlaps compute: each one directly follows the point where its
// buffer is free (RecvActivation: the previous occupant's last instruction or the schedule's
// start; RecvGrad: its own SendActivation) or, later, the previous receive on its channel,
// with only other receives in between.
TEST(PipeSchedule, ReceivesArePostedAsSoonAsTheirBufferIsFree) {
  for (const ScheduleSpec& spec : grid()) {
    if (spec.kind == ScheduleKind::OneFOneB || spec.stages == 1) continue;  // DeepSpeed's own placement
    for (const StageSchedule& s : all_stages(spec)) {
      const std::vector<Instruction> flat = flatten(s);
      for (int i = 0; i < static_cast<int>(flat.size()); ++i) {
        const Instruction& in = flat[i];
        if (in.op != Op::RecvActivation && in.op != Op::RecvGrad) continue;
        int free_at = -1, channel_at = -1;
        for (int j = 0; j < i; ++j) {
          const Instruction& o = flat[j];
          if (in.op == Op::RecvActivation && o.micro_batch >= 0 && o.buffer == in.buffer) free_at = j;
          if (in.op == Op::RecvGrad && o.op == Op::SendActivation && o.micro_batch == in.micro_batch &&
              o.chunk == in.chunk)
            free_at = j;
          if (o.op == in.op && o.chunk == in.chunk) channel_at = j;
        }
        if (in.op == Op::RecvGrad) {
          ASSERT_GE(free_at, 0) << name(spec) << " " << to_string(in);
        }
        for (int j = std::max(free_at, channel_at) + 1; j < i; ++j)
          EXPECT_TRUE(flat[j].op == Op::RecvActivation || flat[j].op == Op::RecvGrad)
              << name(spec) << " stage " << s.stage << ": " << to_string(in) << " could be posted before "
              << to_string(flat[j]);
      }
    }
  }
}

TEST(PipeSchedule, InterleavedFollowsMegatronTableWithGroupSizeP) {
  // get_schedule_table with N = p = 2, v = 2, m = 4; backward runs the same table on chunk v−1−c.
  const ScheduleSpec spec{ScheduleKind::Interleaved, 2, 4, 2};
  const std::vector<std::pair<int, int>> forwards = {{0, 0}, {1, 0}, {0, 1}, {1, 1}, {2, 0}, {3, 0}, {2, 1}, {3, 1}};
  const std::vector<std::pair<int, int>> backwards = {{0, 1}, {1, 1}, {0, 0}, {1, 0}, {2, 1}, {3, 1}, {2, 0}, {3, 0}};
  for (int r = 0; r < 2; ++r) {
    std::vector<std::pair<int, int>> f, b;
    for (const auto& [op, m, c] : compute_order(make_schedule(spec, r)))
      (op == Op::Forward ? f : b).emplace_back(m, c);
    EXPECT_EQ(f, forwards) << "rank " << r;
    EXPECT_EQ(b, backwards) << "rank " << r;
  }
}

TEST(PipeSchedule, InterleavedWarmupIsMegatronsForwardCountPerRank) {
  for (int p = 2; p <= 5; ++p)
    for (int v = 1; v <= 3; ++v)
      for (int m = p; m <= 3 * p; m += p)
        for (int r = 0; r < p; ++r) {
          const auto order = compute_order(make_schedule({ScheduleKind::Interleaved, p, m, v}, r));
          const auto first_b = std::find_if(order.begin(), order.end(),
                                            [](const auto& w) { return std::get<0>(w) == Op::Backward; });
          // the warm-up, then the first 1F1B iteration's forward (none when the warm-up is everything)
          const int warmup = std::min(2 * (p - r - 1) + (v - 1) * p, m * v);
          EXPECT_EQ(first_b - order.begin(), std::min(warmup + 1, m * v))
              << "p=" << p << " v=" << v << " m=" << m << " r=" << r;
          // one buffer per forward in flight: the warm-up's and the iteration's own
          EXPECT_EQ(make_schedule({ScheduleKind::Interleaved, p, m, v}, r).num_buffers, std::min(warmup + 1, m * v));
          // then strictly one forward, one backward until the forwards run out
          for (auto it = first_b; it != order.end() && it + 1 != order.end(); it += 2) {
            if (std::get<0>(*(it + 1)) != Op::Forward) break;
            EXPECT_EQ(std::get<0>(*it), Op::Backward);
          }
        }
}

TEST(PipeSchedule, ZeroBubbleH1DefersWeightGradsByTheStageIndex) {
  // p=4, m=6, rank 2: warm-up 1 forward; backward k is followed by the oldest queued W when k >= 2.
  using W = std::tuple<Op, int, int>;
  const auto F = [](int m) { return W{Op::Forward, m, 0}; };
  const auto B = [](int m) { return W{Op::BackwardInput, m, 0}; };
  const auto Wt = [](int m) { return W{Op::BackwardWeight, m, 0}; };
  EXPECT_EQ(compute_order(make_schedule({ScheduleKind::ZeroBubbleH1, 4, 6, 1}, 2)),
            (std::vector<W>{F(0), F(1), B(0), F(2), B(1), F(3), B(2), Wt(0), F(4), B(3), Wt(1), F(5), B(4), Wt(2), B(5),
                            Wt(3), Wt(4), Wt(5)}));
  // Rank 0 runs each W right after its B, as an unsplit backward.
  EXPECT_EQ(compute_order(make_schedule({ScheduleKind::ZeroBubbleH1, 2, 2, 1}, 0)),
            (std::vector<W>{F(0), F(1), B(0), Wt(0), B(1), Wt(1)}));
  for (int p = 2; p <= 5; ++p)
    for (int m = 1; m <= 9; ++m)
      for (int r = 0; r < p; ++r) {
        const auto order = compute_order(make_schedule({ScheduleKind::ZeroBubbleH1, p, m, 1}, r));
        const auto first_w = std::find_if(order.begin(), order.end(),
                                          [](const W& w) { return std::get<0>(w) == Op::BackwardWeight; });
        EXPECT_EQ(std::count_if(order.begin(), first_w, [](const W& w) { return std::get<0>(w) == Op::BackwardInput; }),
                  std::min(r + 1, m))
            << "p=" << p << " m=" << m << " r=" << r;
      }
}

TEST(PipeSchedule, ZeroBubbleH1SendsTheInputGradRightAfterBackwardInput) {
  for (int p = 2; p <= 5; ++p)
    for (int s = 1; s < p; ++s) {
      const std::vector<Instruction> flat = flatten(make_schedule({ScheduleKind::ZeroBubbleH1, p, 7, 1}, s));
      for (size_t i = 0; i < flat.size(); ++i)
        if (flat[i].op == Op::BackwardInput) {
          ASSERT_LT(i + 1, flat.size());
          EXPECT_EQ(to_string(flat[i + 1]), to_string(I(Op::SendGrad, flat[i].micro_batch, flat[i].buffer)));
        }
    }
}

TEST(PipeSchedule, ZeroBubbleH1KeepsPMicroBatchesLiveOnEveryStage) {
  // W reads its micro-batch's activations, so the W's rank s defers add to its p − s forwards
  // in flight: every stage holds min(p, m) (Qi et al. Table 2: ZB-H1 memory p·M_B, 1F1B's
  // first stage), against 1F1B's p − s.
  for (int p = 2; p <= 5; ++p)
    for (int m = 1; m <= 9; ++m)
      for (int s = 0; s < p; ++s)
        EXPECT_EQ(make_schedule({ScheduleKind::ZeroBubbleH1, p, m, 1}, s).num_buffers, std::min(p, m))
            << "p=" << p << " m=" << m << " s=" << s;
}

TEST(PipeSchedule, SimulatedIdleMatchesBubbleFraction) {
  // Unit costs F = B = W = 1 (an unsplit backward costs 2): every stage idles
  // makespan − 3m, whose share is bubble_fraction for 1F1B, interleaved (chunk costs) and zb-h1.
  for (const ScheduleSpec& spec : grid()) {
    const Simulation sim = simulate(spec);
    ASSERT_EQ(sim.error, "") << name(spec);
    const double busy = 3.0 * spec.micro_batches * spec.virtual_stages;
    for (double b : sim.busy) ASSERT_DOUBLE_EQ(b, busy);
    const double idle = sim.makespan - busy;
    EXPECT_NEAR(idle / sim.makespan, bubble_fraction(spec), 1e-12) << name(spec) << " idle " << idle;
  }
}

TEST(PipeSchedule, ZeroBubbleH1IdlesAThirdOfOneFOneB) {
  // Unit costs: 1F1B idles 3(p−1) slots, zb-h1 (p−1) once m >= p (Qi et al. Table 2); with
  // m < p the B chain of the last micro-batch adds p − m, still below 1F1B.
  for (int p = 2; p <= 5; ++p)
    for (int m = 1; m <= 9; ++m) {
      const Simulation zb = simulate({ScheduleKind::ZeroBubbleH1, p, m, 1});
      const Simulation ofob = simulate({ScheduleKind::OneFOneB, p, m, 1});
      ASSERT_EQ(zb.error + ofob.error, "");
      EXPECT_DOUBLE_EQ(ofob.makespan - 3 * m, 3.0 * (p - 1)) << "p=" << p << " m=" << m;
      EXPECT_DOUBLE_EQ(zb.makespan - 3 * m, (p - 1) + std::max(0, p - m)) << "p=" << p << " m=" << m;
      EXPECT_LT(zb.makespan, ofob.makespan);
    }
}

TEST(PipeSchedule, BubbleFractionFormulas) {
  EXPECT_DOUBLE_EQ(bubble_fraction({ScheduleKind::OneFOneB, 4, 8, 1}), 3.0 / 11.0);
  EXPECT_DOUBLE_EQ(bubble_fraction({ScheduleKind::Interleaved, 4, 8, 2}), 3.0 / 19.0);
  EXPECT_DOUBLE_EQ(bubble_fraction({ScheduleKind::ZeroBubbleH1, 4, 8, 1}), 3.0 / 27.0);
  EXPECT_DOUBLE_EQ(bubble_fraction({ScheduleKind::ZeroBubbleH1, 4, 2, 1}), 5.0 / 11.0);
  EXPECT_DOUBLE_EQ(bubble_fraction({ScheduleKind::OneFOneB, 1, 8, 1}), 0.0);
}

TEST(PipeSchedule, CheckScheduleSpecNamesTheNumbers) {
  EXPECT_EQ(check_schedule_spec({ScheduleKind::OneFOneB, 4, 6, 1}), "");
  EXPECT_EQ(check_schedule_spec({ScheduleKind::Interleaved, 4, 8, 3}), "");
  EXPECT_EQ(check_schedule_spec({ScheduleKind::Interleaved, 4, 6, 2}),
            "pipeline.schedule interleaved needs gradient_accumulation_steps (6) to be a multiple of "
            "pipeline.stages (4)");
  const auto has = [](const std::string& msg, const std::string& part) { return msg.find(part) != std::string::npos; };
  EXPECT_TRUE(has(check_schedule_spec({ScheduleKind::OneFOneB, 0, 6, 1}), "(0)"));
  EXPECT_TRUE(has(check_schedule_spec({ScheduleKind::OneFOneB, 2, 0, 1}), "gradient_accumulation_steps (0)"));
  EXPECT_TRUE(has(check_schedule_spec({ScheduleKind::Interleaved, 2, 2, 0}), "virtual_stages (0)"));
  EXPECT_TRUE(has(check_schedule_spec({ScheduleKind::ZeroBubbleH1, 2, 2, 3}), "virtual_stages (3)"));
  EXPECT_TRUE(has(check_schedule_spec({ScheduleKind::ZeroBubbleH1, 2, 2, 3}), "zb-h1"));
  EXPECT_TRUE(has(check_schedule_spec({ScheduleKind::Interleaved, 1, 2, 2}), "pipeline.stages (1)"));
  EXPECT_THROW(make_schedule({ScheduleKind::Interleaved, 4, 6, 2}, 0), std::invalid_argument);
  EXPECT_THROW(make_schedule({ScheduleKind::OneFOneB, 4, 6, 1}, 4), std::invalid_argument);
}

TEST(PipeSchedule, InstructionsPrintWithDeepSpeedNames) {
  EXPECT_EQ(to_string({Op::Forward, 3, 0, 1}), "ForwardPass(m=3,c=0,b=1)");
  EXPECT_EQ(to_string({Op::Backward, 2, 1, 0}), "BackwardPass(m=2,c=1,b=0)");
  EXPECT_EQ(to_string(kStep), "OptimizerStep()");
  EXPECT_STREQ(op_name(Op::LoadMicroBatch), "LoadMicroBatch");
  EXPECT_STREQ(op_name(Op::ReduceTiedGrads), "ReduceTiedGrads");
}

TEST(Partition, BalancedMatchesDeepSpeedTests) {
  EXPECT_EQ(partition_balanced({0, 1, 2, 3, 3, 3}, 4), (std::vector<int>{0, 3, 4, 5, 6}));
  EXPECT_EQ(partition_balanced({0, 1.1, 30, 3}, 3), (std::vector<int>{0, 2, 3, 4}));
}

TEST(Partition, BalancedBreaksTiesTowardTheLaterSplit) {
  // [1,1,1,1] in 2: the only zero-cost split is 2|2; all-equal weights in 3 parts of 4 items
  // cost 1 whichever part gets two, and `>=` keeps the last candidate: the doubled part is first.
  EXPECT_EQ(partition_balanced({1, 1, 1, 1}, 2), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(partition_balanced({1, 1, 1, 1}, 3), (std::vector<int>{0, 2, 3, 4}));
}

TEST(Partition, BalancedWithNoMoreItemsThanPartsIsUniform) {
  EXPECT_EQ(partition_balanced({5, 1, 7}, 3), partition_uniform(3, 3));
  EXPECT_EQ(partition_balanced({5, 1}, 4), (std::vector<int>{0, 1, 2, 2, 2}));
}

TEST(Partition, UniformGivesTheResidualToTheFirstParts) {
  EXPECT_EQ(partition_uniform(10, 3), (std::vector<int>{0, 4, 7, 10}));
  EXPECT_EQ(partition_uniform(12, 4), (std::vector<int>{0, 3, 6, 9, 12}));
  EXPECT_EQ(partition_uniform(11, 4), (std::vector<int>{0, 3, 6, 9, 11}));
  EXPECT_EQ(partition_uniform(2, 4), (std::vector<int>{0, 1, 2, 2, 2}));
  EXPECT_EQ(partition_uniform(4, 4), (std::vector<int>{0, 1, 2, 3, 4}));
}

}  // namespace
}  // namespace zero3d::pipe
