// observer.hpp — what the engine calls to be seen from outside: the flops profiler's report,
// csv/tensorboard monitors, the wall_clock_breakdown across ranks, the comms logger's table
// and the trace. The engine hands it the communicators and the model once, then reports each
// step; everything here is collective where it says so, and idle when its sections are off.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/profiler.hpp"
#include "config/config.hpp"
#include "model/model.hpp"
#include "observe/monitor.hpp"
#include "observe/monitors.hpp"
#include "observe/trace.hpp"
#include "parallel/comm.hpp"
#include "parallel/pipe_schedule.hpp"

namespace zero3d {

struct StepResult;
class ProcessGroups;

// The engine's communicators, each with the axis name its table rows and trace regions carry.
struct ObservedComms {
  Communicator *data = nullptr, *pipe = nullptr, *tensor = nullptr, *world = nullptr, *model_parallel = nullptr,
               *embedding = nullptr;
  std::vector<std::pair<Communicator*, std::string>> shards;  // MiCS / hpZ's groups, by name
};

class Observer {
 public:
  // Collective over the world (the trace's common clock origin).
  Observer(const Config& cfg, int world_rank, ObservedComms comms, const GPT& model, std::string output_dir,
           double peak_gflops_total);

  // Around the schedule of one optimizer step: switches the hooks on for a profiled or traced
  // step and off again before anything else (evaluation) runs.
  void begin_step(int64_t step);
  void end_step();
  // After each step, on every rank (collective when the breakdown, profiler or trace need it):
  // breakdown statistics, the profiler's report, monitor events, the trace file.
  void after_step(const StepResult& r, int64_t global_samples, const std::map<std::string, double>& timers);
  // Fields for metrics.jsonl (rank 0): extra time_ms phases and their min/avg/max over ranks.
  void annotate(nlohmann::json& record) const;
  // The breakdown lines printed beside the step line (empty unless wall_clock_breakdown).
  std::string breakdown_lines() const;
  // End of training (collective): the comms logger's table, a trace not yet written.
  void finish();

 private:
  void write_flops_profile(const StepResult& r, const std::map<std::string, double>& timers);
  void write_trace();
  std::vector<std::pair<std::string, double>> phases(const std::map<std::string, double>& timers) const;

  const Config& cfg_;
  const ObservabilityConfig& o_;
  int rank_ = 0;
  ObservedComms comms_;
  const GPT& model_;
  std::string output_dir_;
  double peak_gflops_total_ = 0.0;
  int64_t step_ = 0;
  bool traced_ = false, trace_written_ = false;
  size_t step_slot_ = 0;
  std::unique_ptr<CsvMonitor> csv_;
  std::unique_ptr<TensorBoardMonitor> tensorboard_;
  // The breakdown of the last step: (name, this rank, min, avg, max over the world).
  struct Phase {
    std::string name;
    double ms = 0.0, min = 0.0, avg = 0.0, max = 0.0;
  };
  std::vector<Phase> breakdown_;
  double take_allgather_ms() const;
  double step_allgather_ms_ = 0.0;  // the step's blocked all-gathers, taken at its end (end_step)
};

// Blocked time in the data group's gradient reductions inside a backward pass is moved from
// backward_inner to backward_allreduce (DeepSpeed's bwd_inner is compute, bwd_allreduce the
// reduction, DEEPSPEED-FACTS §9.4), so stage 2/3 reductions that run inside backward still show.
class ReductionWait {
 public:
  ReductionWait(const Communicator& data, PhaseTimers& timers)
      : log_(data.log()), timers_(timers), start_(log_ ? reduce_ms() : 0.0) {}
  ~ReductionWait() {
    if (log_) timers_.move("backward_inner", "backward_allreduce", reduce_ms() - start_);
  }

 private:
  double reduce_ms() const { return log_->blocked_ms(CommOp::AllReduce) + log_->blocked_ms(CommOp::ReduceScatter); }
  const CommsLog* log_;
  PhaseTimers& timers_;
  double start_;
};

// The trace region of one schedule instruction ("pipe/send_activation", "forward", ...).
const char* instruction_region(pipe::Op op);

}  // namespace zero3d
