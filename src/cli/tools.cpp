// tools.cpp — one-process commands over layouts and checkpoints: topology, inspect, convert.
#include <cstdio>
#include <string>

#include "base/errors.hpp"
#include "cli/commands.hpp"
#include "io/checkpoint.hpp"
#include "parallel/topology.hpp"

namespace zero3d::cli {

namespace {

// One process group along an axis: `size` ranks from `first`, `stride` apart (row-major
// ranks make every group an arithmetic progression, as ProcessTopology::get_axis_comm_lists).
struct Progression {
  int64_t first, stride, size;
};

// "[0,1,2]" in full up to 16 ranks, else "[0,4,...,60] (16 ranks)": O(1) per line, so the
// whole listing stays linear in the number of ranks.
std::string group_text(const Progression& g) {
  std::string s = "[";
  if (g.size <= 16) {
    for (int64_t k = 0; k < g.size; ++k) s += (k ? "," : "") + std::to_string(g.first + k * g.stride);
    return s + "]";
  }
  return s + std::to_string(g.first) + "," + std::to_string(g.first + g.stride) + ",...," +
         std::to_string(g.first + (g.size - 1) * g.stride) + "] (" + std::to_string(g.size) + " ranks)";
}

std::string group_json(const Progression& g) {
  std::string s = "[";
  for (int64_t k = 0; k < g.size; ++k) s += (k ? "," : "") + std::to_string(g.first + k * g.stride);
  return s + "]";
}

}  // namespace

// Prints each rank's coordinates and groups for a pipe x data x model job, computed from the
// coordinates (rank = (pipe·dp + data)·tp + model) in O(1) per rank.
int cmd_topology(int64_t pp, int64_t dp, int64_t tp, bool as_json, int rank) {
  if (rank != 0) return kExitOk;
  // Each factor is at most kMaxRanks (CLI check), so the product fits int64 before comparing.
  const int64_t world = pp * dp * tp;
  if (world > kMaxRanks)
    throw InputError("topology --pp " + std::to_string(pp) + " --dp " + std::to_string(dp) + " --tp " +
                     std::to_string(tp) + ": " + std::to_string(world) + " ranks, more than the " +
                     std::to_string(kMaxRanks) + " zero3d supports");
  // The JSON lists every group in full: bounded, as its size grows with ranks x group sizes.
  const int64_t kMaxJsonEntries = int64_t(1) << 24;
  if (as_json && world * (pp + dp + tp) > kMaxJsonEntries)
    throw InputError("topology --json: " + std::to_string(world) + " ranks with their groups would list " +
                     std::to_string(world * (pp + dp + tp)) + " ranks (at most " + std::to_string(kMaxJsonEntries) +
                     "); the text form abbreviates long groups");
  const ProcessTopology topo = ProcessTopology::pipe_data_model(int(pp), int(dp), int(tp));
  auto groups = [&](int64_t p, int64_t d, int64_t m) {
    struct {
      Progression data, model, pipe;
    } g{{p * dp * tp + m, tp, dp}, {(p * dp + d) * tp, 1, tp}, {d * tp + m, dp * tp, pp}};
    return g;
  };
  if (as_json) {
    nlohmann::json head = {{"axes", topo.get_axis_names()}, {"dims", topo.dims()}};
    std::string text = head.dump();
    text.pop_back();
    std::fputs((text + ",\"ranks\":[").c_str(), stdout);
    for (int64_t r = 0; r < world; ++r) {
      const int64_t p = r / (dp * tp), d = r / tp % dp, m = r % tp;
      const auto g = groups(p, d, m);
      std::printf("%s{\"coord\":{\"data\":%lld,\"model\":%lld,\"pipe\":%lld},\"groups\":{\"data\":%s,\"model\":%s,"
                  "\"pipe\":%s},\"rank\":%lld}",
                  r ? "," : "", (long long)d, (long long)m, (long long)p, group_json(g.data).c_str(),
                  group_json(g.model).c_str(), group_json(g.pipe).c_str(), (long long)r);
    }
    std::printf("]}\n");
    return kExitOk;
  }
  std::printf("%lld ranks = pipe %lld x data %lld x model %lld (row-major, model fastest)\n", (long long)world,
              (long long)pp, (long long)dp, (long long)tp);
  for (int64_t r = 0; r < world; ++r) {
    const int64_t p = r / (dp * tp), d = r / tp % dp, m = r % tp;
    const auto g = groups(p, d, m);
    std::printf("rank %3lld  pipe %lld data %lld model %lld  | data group %s  tensor group %s  pipe group %s\n",
                (long long)r, (long long)p, (long long)d, (long long)m, group_text(g.data).c_str(),
                group_text(g.model).c_str(), group_text(g.pipe).c_str());
  }
  return kExitOk;
}

int cmd_inspect(const std::string& dir, const std::string& tag, const std::string& tensor, bool as_json, int rank) {
  if (rank != 0) return kExitOk;
  const nlohmann::json r = inspect_checkpoint(dir, tag, tensor);
  if (as_json) {
    std::printf("%s\n", r.dump(2).c_str());
    return kExitOk;
  }
  std::printf("checkpoint %s\n", r["dir"].get<std::string>().c_str());
  if (r.contains("tags")) {
    std::string tags;
    for (const auto& t : r["tags"]) tags += (tags.empty() ? "" : ", ") + t.get<std::string>();
    std::printf("tags       %s (latest: %s)\n", tags.c_str(), r["latest"].get<std::string>().c_str());
  }
  std::printf("step %lld | samples %lld | ZeRO stage %lld | topology pipe %lld x data %lld x model %lld | %zu shards | "
              "master %s | optimizer %s | checksums verified\n",
              r["step"].get<long long>(), r["global_samples"].get<long long>(), r["zero_stage"].get<long long>(),
              r["topology"]["pipe"].get<long long>(), r["topology"]["data"].get<long long>(),
              r["topology"]["model"].get<long long>(), r["shards"].get<size_t>(),
              r["dtypes"]["master"].get<std::string>().c_str(), r["optimizer"].get<std::string>().c_str());
  std::printf("%-28s %-14s %-5s %12s %12s %12s %12s\n", "tensor", "shape", "dtype", "min", "max", "mean", "l2_norm");
  for (const auto& t : r["tensors"])
    std::printf("%-28s %-14s %-5s %12.5g %12.5g %12.5g %12.5g\n", t["name"].get<std::string>().c_str(),
                t["shape"].dump().c_str(), t["dtype"].get<std::string>().c_str(), t["min"].get<double>(),
                t["max"].get<double>(), t["mean"].get<double>(), t["l2_norm"].get<double>());
  return kExitOk;
}

int cmd_convert(const std::string& dir, const std::string& out, const std::string& tag, const std::string& format,
                const std::string& dtype, const std::string& max_shard, int rank) {
  if (rank != 0) return kExitOk;
  const int64_t shard = max_shard.empty() ? 0 : size_option("--max-shard-size", max_shard);
  const ConvertResult r = convert_checkpoint(dir, tag, out, format, dtype, shard);
  for (const auto& f : r.written) std::printf("wrote %s\n", f.c_str());
  for (const auto& f : r.removed) std::printf("removed %s (a stale output of an earlier convert to this name)\n", f.c_str());
  return kExitOk;
}

}  // namespace zero3d::cli
