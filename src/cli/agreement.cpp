// agreement.cpp — see agreement.hpp.
#include "cli/agreement.hpp"

#include "base/xxh64.hpp"

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <vector>

#include "base/errors.hpp"
#include "base/failure.hpp"

namespace zero3d {

namespace {

using json = nlohmann::json;

// Keys that may differ between ranks without changing what is trained:
//   training.output_dir    only rank 0 writes config.json and metrics.jsonl there;
//   training.peak_gflops   each rank's own peak (the engine sums them for MFU);
//   training.comms_timeout each rank's own watchdog; a shorter one only gives up sooner.
// training.save_dir is compared only when checkpoints are written or read (every rank writes
// its shard into the same tag), so that runs started from differently named copies of one
// config, whose default save_dir follows the default output_dir, still agree.
const char* const kPerRankKeys[][2] = {{"training", "output_dir"}, {"training", "peak_gflops"},
                                       {"training", "comms_timeout"}};

constexpr size_t kMaxShownValue = 80;  // longer values are cut, with their length

std::string show(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() <= kMaxShownValue) return s;
  return s.substr(0, kMaxShownValue) + "... (" + std::to_string(s.size()) + " characters)";
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Streams a file through digest64 in 1 MiB pieces; appends to `state`.
bool hash_file(const std::string& path, uint64_t& state, std::string& why) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    why = std::strerror(errno);
    return false;
  }
  std::vector<char> buf(1 << 20);
  size_t n = 0;
  uint64_t total = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) {
    state = xxh64(buf.data(), n, state);
    total += n;
  }
  const bool ok = !std::ferror(f);
  if (!ok) why = std::strerror(errno);
  std::fclose(f);
  state = xxh64(&total, sizeof(total), state);
  return ok;
}

void diff(const json& a, const json& b, const std::string& path, bool& found, std::string& key, std::string& va,
          std::string& vb) {
  if (found || a == b) return;
  if (a.is_object() && b.is_object()) {
    // std::map order: walk the union of both key sets in sorted order
    auto ia = a.begin(), ib = b.begin();
    while (!found && (ia != a.end() || ib != b.end())) {
      const bool take_a = ib == b.end() || (ia != a.end() && ia.key() < ib.key());
      const bool take_b = ia == a.end() || (ib != b.end() && ib.key() < ia.key());
      const std::string k = take_a ? ia.key() : ib.key();
      const std::string p = path.empty() ? k : path + "." + k;
      if (take_a) {
        found = true, key = p, va = show(*ia), vb = "absent";
      } else if (take_b) {
        found = true, key = p, va = "absent", vb = show(*ib);
      } else {
        diff(*ia, *ib, p, found, key, va, vb);
        ++ia, ++ib;
      }
    }
    return;
  }
  found = true, key = path.empty() ? "(the whole configuration)" : path, va = show(a), vb = show(b);
}

}  // namespace

std::string file_digest(const std::string& path) {
  uint64_t h = 0;
  std::string why;
  if (!hash_file(path, h, why)) return "unreadable (" + why + ")";
  // A Hugging Face index: the shards it names are part of the weights too.
  if (ends_with(path, ".json")) {
    std::ifstream in(path);
    const json index = json::parse(in, nullptr, false);
    if (index.is_object() && index.contains("weight_map") && index["weight_map"].is_object()) {
      const std::string dir = path.find('/') == std::string::npos ? "" : path.substr(0, path.find_last_of('/') + 1);
      std::set<std::string> shards;
      for (const auto& [name, file] : index["weight_map"].items())
        if (file.is_string()) shards.insert(file.get<std::string>());
      for (const auto& s : shards)
        if (!hash_file(dir + s, h, why)) return "unreadable (" + dir + s + ": " + why + ")";
    }
  }
  return hex64(h);
}

json agreement_document(const Config& cfg) {
  json doc = cfg.resolved;
  for (const auto& k : kPerRankKeys)
    if (doc.contains(k[0]) && doc[k[0]].is_object()) doc[k[0]].erase(k[1]);
  // With checkpoint.use_node_local_storage each node keeps its own copy of every tag, under any
  // path: save_dir is then the node's, like output_dir is rank 0's.
  const bool shared_save_dir = cfg.training.save_interval > 0 || !cfg.training.resume.empty();
  if ((!shared_save_dir || cfg.checkpoint.use_node_local_storage) && doc.contains("training") &&
      doc["training"].is_object())
    doc["training"].erase("save_dir");
  // The weights, not where a node keeps them: two paths to the same bytes agree.
  if (doc.contains("model") && doc["model"].is_object()) doc["model"].erase("init_from");
  if (!cfg.model.init_from.empty()) doc["model"]["init_from (file content digest)"] = file_digest(cfg.model.init_from);
  return doc;
}

bool first_difference(const json& a, const json& b, std::string& key, std::string& value_a, std::string& value_b) {
  bool found = false;
  diff(a, b, "", found, key, value_a, value_b);
  return found;
}

namespace {

// What validate cannot check: the ranks' placement on nodes (MPI_COMM_TYPE_SHARED), agreed
// by every rank, so each throws the same AgreedFailure before anything is trained.
void check_node_placement(MPI_Comm comm, int rank, const Config& cfg) {
  if (!cfg.checkpoint.use_node_local_storage || !cfg.zero.gather_16bit_weights_on_model_save) return;
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int node_rank = 0, nodes = 0;
  MPI_Comm_rank(node, &node_rank);
  MPI_Comm_free(&node);
  int leader = node_rank == 0 ? 1 : 0;
  MPI_Allreduce(&leader, &nodes, 1, MPI_INT, MPI_SUM, comm);
  if (nodes > 1)
    throw AgreedFailure("`checkpoint.use_node_local_storage` = true with "
                        "`zero_optimization.stage3_gather_16bit_weights_on_model_save` = true on " +
                            std::to_string(nodes) + " nodes: rank 0 writes the consolidated weights from every "
                            "rank's shard of the tag, and node-local storage leaves each node only its own ranks' "
                            "shards; set one of them false (with every node's shards in one directory, `zero3d "
                            "convert` writes the same weights)",
                        kExitBadInput, 0, rank == 0);
}

}  // namespace

void agree_on_configuration(MPI_Comm comm, const Config& cfg) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  exchange_rank_identities(comm);  // pids and hosts, for failure messages (failure.hpp)
  if (size == 1) return;
  const std::string text = agreement_document(cfg).dump(-1, ' ', false, json::error_handler_t::replace);
  const uint64_t digest = xxh64(text.data(), text.size());

  // {min, ~max} in one allreduce(MIN)
  uint64_t range[2] = {digest, ~digest};
  MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_UINT64_T, MPI_MIN, comm);
  if (range[0] == ~range[1]) {
    check_node_placement(comm, rank, cfg);
    note_phase("set-up");
    return;
  }

  // Mismatch: the lowest rank whose document differs from rank 0's sends it to rank 0.
  uint64_t digest0 = digest;
  MPI_Bcast(&digest0, 1, MPI_UINT64_T, 0, comm);
  int other = digest != digest0 ? rank : INT_MAX;
  MPI_Allreduce(MPI_IN_PLACE, &other, 1, MPI_INT, MPI_MIN, comm);
  const int length = rank == other ? static_cast<int>(text.size()) : 0;
  std::vector<int> lengths(rank == 0 ? size : 0), offsets(rank == 0 ? size : 0);
  MPI_Gather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, 0, comm);
  std::string theirs;
  if (rank == 0) {
    theirs.resize(static_cast<size_t>(lengths[other]));
    offsets[other] = 0;
  }
  MPI_Gatherv(text.data(), length, MPI_CHAR, theirs.data(), lengths.data(), offsets.data(), MPI_CHAR, 0, comm);

  std::string message;
  if (rank == 0) {
    std::string key, mine_v, theirs_v;
    const json mine = json::parse(text, nullptr, false), other_doc = json::parse(theirs, nullptr, false);
    if (first_difference(mine, other_doc, key, mine_v, theirs_v))
      message = "ranks disagree on the configuration: " + key + " is " + mine_v + " on rank 0 but " + theirs_v +
                " on rank " + std::to_string(other);
    else  // equal documents with different digests cannot happen; say so rather than guess
      message = "ranks disagree on the configuration: rank 0 and rank " + std::to_string(other) +
                " have different configuration digests";
  }
  throw AgreedFailure(message, kExitBadInput, 0, rank == 0);
}

}  // namespace zero3d
