// comm_observed.hpp — what a communicator tells the comms log of each operation (comms_logger.hpp):
// latency from posting, time blocked waiting, and a trace region for a blocking call. Shared by
// the MPI and NCCL communicators, so that a group's table reads the same whichever carried it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

#include "base/dtype.hpp"
#include "observe/comms_logger.hpp"
#include "observe/trace.hpp"
#include "parallel/comm.hpp"

namespace zero3d::comm_observed {

using Clock = std::chrono::steady_clock;
inline double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// What the comms log learns of one operation: null log = nobody asked, nothing measured.
struct Observed {
  CommsLog* log = nullptr;
  CommOp op = CommOp::AllReduce;
  int64_t bytes = 0;
  Clock::time_point posted;
  // Completion, seen once: latency from posting, and the time blocked waiting for it.
  void complete(double blocked_ms) {
    if (!log) return;
    log->record(op, bytes, ms_between(posted, Clock::now()), blocked_ms);
    log = nullptr;
  }
};
inline Observed observe_op(CommsLog* log, CommOp op, int64_t elements, DType type) {
  if (!log || !log->observed()) return {};
  return {log, op, elements * static_cast<int64_t>(dtype_size(type)), Clock::now()};
}

// A blocking call: its whole duration is latency and blocked time; a trace region when traced.
class BlockingCall {
 public:
  BlockingCall(CommsLog* log, CommOp op, int64_t elements, DType type) : o_(observe_op(log, op, elements, type)) {
    if (o_.log && obs::g_hooks.trace) trace_.emplace(o_.log->trace_prefix() + "/" + comm_op_name(op));
  }
  ~BlockingCall() {
    if (!o_.log) return;
    const double ms = ms_between(o_.posted, Clock::now());
    o_.log->record(o_.op, o_.bytes, ms, ms);
  }

 private:
  Observed o_;
  std::optional<obs::TraceScope> trace_;
};

// What a call that completed before returning hands back: nothing left to wait for.
class CompletedRequest : public CommRequest {
 public:
  bool test() override { return true; }
  void wait() override {}
};

}  // namespace zero3d::comm_observed
