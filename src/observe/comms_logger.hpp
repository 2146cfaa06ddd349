// comms_logger.hpp — what one communicator's operations cost: DeepSpeed's comms_logger records
// (op, message size → count, total latency, bandwidths; deepspeed/utils/comms_logging.py), the
// time this rank was blocked in each kind of operation (the wall_clock_breakdown's
// communication phases), and the trace regions of blocking calls. The communicator feeds it;
// nothing is recorded unless someone asked (CommsLog::observed()).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "observe/observability_config.hpp"

namespace zero3d {

enum class CommOp : int { AllReduce, ReduceScatter, AllGather, Broadcast, Send, Recv, Barrier, AllToAll, kCount };
// DeepSpeed's names: all_reduce, reduce_scatter, all_gather, broadcast, send, recv, barrier, all_to_all_single
const char* comm_op_name(CommOp op);

// DeepSpeed calc_bw_log's factors over the message size n (bytes): algorithm bandwidth counts
// n (all_reduce 2n), bus bandwidth n·2(W−1)/W for all_reduce, n·(W−1)/W for all_gather and
// reduce_scatter (n = the whole gathered / scattered buffer), n for point-to-point and broadcast.
double comm_bus_factor(CommOp op, int world);
double comm_alg_factor(CommOp op);

struct CommRecord {
  int64_t count = 0;
  double total_ms = 0.0;
  double alg_gbps_sum = 0.0, bus_gbps_sum = 0.0;  // per-operation bandwidths, summed (averaged when printed)
  int64_t bus_bytes = 0;                           // Σ message size × bus factor (the communicator's count)
};

class CommsLog {
 public:
  // axis: the group's name in tables ("data", "tensor", "pipe", ...); trace_prefix: its regions' prefix.
  // counter_base: the communicator's bus-byte count when logging began (what came before is not logged).
  CommsLog(std::string axis, std::string trace_prefix, int world, int rank, int64_t counter_base)
      : axis_(std::move(axis)), trace_prefix_(std::move(trace_prefix)), world_(world), rank_(rank),
        counter_base_(counter_base) {}
  int64_t counter_base() const { return counter_base_; }

  // Turn recording on: the comms logger's table (config), blocked time per op, or both.
  void enable_logger(const CommsLoggerConfig& cfg, bool print_verbose) {
    logger_ = cfg.enabled;
    cfg_ = cfg;
    print_verbose_ = print_verbose && cfg.verbose;
  }
  void enable_timing() { timing_ = true; }
  bool observed() const;  // anything to record (logger, timing or a traced step)

  // One completed operation: its message bytes, how long since it was posted, and how much of
  // that this rank spent blocked in the call or its wait.
  void record(CommOp op, int64_t bytes, double latency_ms, double blocked_ms);

  const std::string& axis() const { return axis_; }
  // The link the group's bytes cross (parallel/nodes.hpp): all its ranks on one node, or not.
  void set_intra_node(bool intra) { intra_node_ = intra; }
  bool intra_node() const { return intra_node_; }
  const std::string& trace_prefix() const { return trace_prefix_; }
  int world() const { return world_; }
  // (op, message bytes) → record, since the start.
  const std::map<std::pair<int, int64_t>, CommRecord>& records() const { return records_; }
  // Blocked milliseconds per op since the last take (the breakdown's phases), then zeroed.
  std::vector<double> take_blocked_ms();
  double blocked_ms(CommOp op) const { return blocked_ms_[static_cast<int>(op)]; }

 private:
  std::string axis_, trace_prefix_;
  int world_ = 1, rank_ = 0;
  int64_t counter_base_ = 0;
  bool logger_ = false, timing_ = false, print_verbose_ = false, intra_node_ = false;
  CommsLoggerConfig cfg_;
  std::map<std::pair<int, int64_t>, CommRecord> records_;
  double blocked_ms_[static_cast<int>(CommOp::kCount)] = {};
};

// DeepSpeed's convert_size: "0B", else round(n / 1024^i, 2) and B, KB, MB, GB, TB.
std::string convert_size(double bytes);

// The comms_logger summary table (DeepSpeed log_summary's columns) of one rank's logs, each
// group's block named with the link its bytes cross, and the bus bytes by link after it.
std::string comms_table(const std::vector<const CommsLog*>& logs);

}  // namespace zero3d
