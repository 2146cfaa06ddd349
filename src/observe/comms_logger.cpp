// comms_logger.cpp — DeepSpeed's comms logger (deepspeed/utils/comms_logging.py: calc_bw_log,
// convert_size, log_summary) over zero3d's communicator records.
#include "observe/comms_logger.hpp"

#include <cmath>
#include <cstdio>

#include "base/profiler.hpp"

namespace zero3d {

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::AllReduce: return "all_reduce";
    case CommOp::ReduceScatter: return "reduce_scatter";
    case CommOp::AllGather: return "all_gather";
    case CommOp::Broadcast: return "broadcast";
    case CommOp::Send: return "send";
    case CommOp::Recv: return "recv";
    case CommOp::Barrier: return "barrier";
    case CommOp::AllToAll: return "all_to_all_single";
    case CommOp::kCount: break;
  }
  return "?";
}

double comm_bus_factor(CommOp op, int world) {
  const double w = world;
  switch (op) {
    case CommOp::AllReduce: return world > 1 ? 2.0 * (w - 1) / w : 0.0;
    case CommOp::ReduceScatter:
    case CommOp::AllGather:
    case CommOp::AllToAll: return world > 1 ? (w - 1) / w : 0.0;  // nccl-tests alltoall: n·(W−1)/W
    default: return 1.0;
  }
}

double comm_alg_factor(CommOp op) { return op == CommOp::AllReduce ? 2.0 : 1.0; }

bool CommsLog::observed() const { return logger_ || timing_ || obs::g_hooks.trace; }

void CommsLog::record(CommOp op, int64_t bytes, double latency_ms, double blocked_ms) {
  blocked_ms_[static_cast<int>(op)] += blocked_ms;
  if (!logger_ || !cfg_.logs(comm_op_name(op))) return;
  // calc_bw_log: bytes per ms × 8 / 1e6 = Gbit/s
  const double ms = std::max(latency_ms, 1e-6);
  const double alg = comm_alg_factor(op) * bytes / ms * 8.0 / 1e6;
  const double bus = comm_bus_factor(op, world_) * bytes / ms * 8.0 / 1e6;
  CommRecord& r = records_[{static_cast<int>(op), bytes}];
  ++r.count;
  r.total_ms += latency_ms;
  r.alg_gbps_sum += alg;
  r.bus_gbps_sum += bus;
  // The communicator counts a point-to-point message once, at its sender.
  if (op != CommOp::Recv) r.bus_bytes += static_cast<int64_t>(comm_bus_factor(op, world_) * static_cast<double>(bytes));
  if (print_verbose_) {
    std::printf("comm op: %s%s%s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f\n",
                comm_op_name(op), cfg_.debug ? " | axis: " : "", cfg_.debug ? axis_.c_str() : "", latency_ms,
                convert_size(static_cast<double>(bytes)).c_str(), alg, bus);
  }
}

std::vector<double> CommsLog::take_blocked_ms() {
  std::vector<double> out(std::begin(blocked_ms_), std::end(blocked_ms_));
  for (double& x : blocked_ms_) x = 0.0;
  return out;
}

std::string convert_size(double bytes) {
  if (bytes <= 0) return "0B";
  static const char* names[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  int i = static_cast<int>(std::floor(std::log(bytes) / std::log(1024.0)));
  i = std::max(0, std::min(i, 5));
  // round(s, 2) as Python rounds (the exact binary value, ties to even, as printf does), then
  // printed as repr prints it: 4.0, 1.5, 49.62
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.2f", bytes / std::pow(1024.0, i));
  std::string text = buf;
  while (text.back() == '0' && text[text.size() - 2] != '.') text.pop_back();
  return text + " " + names[i];
}

std::string comms_table(const std::vector<const CommsLog*>& logs) {
  std::string out;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-20s%-20s%-20s%-20s%-20s%-20s%-20s\n", "Comm. Op", "Message Size", "Count",
                "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)", "busbw_avg (Gbps)");
  out += buf;
  // One block per (axis, op), DeepSpeed's rows per message size below it.
  int64_t by_link[2] = {0, 0};  // intra-node, inter-node
  for (const CommsLog* log : logs) {
    int last_op = -1;
    for (const auto& [key, r] : log->records()) {
      if (key.first != last_op) {
        out += log->axis() + "/" + comm_op_name(static_cast<CommOp>(key.first)) +
               (log->world() > 1 ? (log->intra_node() ? " (intra-node)" : " (inter-node)") : "") + "\n";
        last_op = key.first;
      }
      by_link[log->intra_node() ? 0 : 1] += r.bus_bytes;
      std::snprintf(buf, sizeof buf, "%-20s%-20s%-20lld%-20.2f%-20.2f%-20.2f%-20.2f\n", "",
                    convert_size(static_cast<double>(key.second)).c_str(), (long long)r.count, r.total_ms,
                    r.total_ms / r.count, r.alg_gbps_sum / r.count, r.bus_gbps_sum / r.count);
      out += buf;
    }
  }
  out += "bus bytes by link: intra-node " + convert_size(static_cast<double>(by_link[0])) + ", inter-node " +
         convert_size(static_cast<double>(by_link[1])) + "\n";
  return out;
}

}  // namespace zero3d
