// Observability (issue 16): monitors, flops profiler, wall-clock breakdown, comms logger, trace.
// Black-box: runs zero3d and reads the files it writes.
#include <cstring>
#include <iterator>
#include <map>
#include <set>

#include "support/cli_helpers.hpp"
#include "support/file_bytes.hpp"

using namespace cli;
using namespace zero3d::test;  // read_bytes, read_safetensors

namespace {

json observed_config() {
  json j = tiny_config();
  j["model"]["vocab_size"] = 61;  // not a multiple of 2: the tensor-parallel vocabulary is padded
  j["train_micro_batch_size_per_gpu"] = 2;
  j["training"]["steps"] = 3;
  j["steps_per_print"] = 1;
  return j;
}

// A shell command's standard output.
Result run_shell(const std::string& cmd) {
  const std::string out = temp_path("shell.txt");
  const int status = std::system((cmd + " >" + out + " 2>&1").c_str());
  return Result{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), ""};
}


std::string only_file_in(const std::string& dir) {
  const Result r = run_shell("ls " + dir);
  std::istringstream names(r.out);
  std::string name;
  std::getline(names, name);
  return dir + "/" + name;
}

// ---- a TFRecord and protobuf reader, written from the formats' specifications ----------

uint32_t crc32c_bitwise(const std::string& s) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : s) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}
uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }
uint64_t le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = v << 8 | static_cast<unsigned char>(s[at + i]);
  return v;
}

// Every record's payload; a CRC mismatch or a torn record fails the test.
std::vector<std::string> tfrecords(const std::string& file) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < file.size()) {
    EXPECT_GE(file.size() - at, 12u) << "torn length at byte " << at;
    if (file.size() - at < 12) break;
    const uint64_t len = le(file, at, 8);
    EXPECT_EQ(le(file, at + 8, 4), masked(crc32c_bitwise(file.substr(at, 8)))) << "length CRC at byte " << at;
    EXPECT_GE(file.size() - at - 12, len + 4) << "torn record at byte " << at;
    if (file.size() - at - 12 < len + 4) break;
    const std::string data = file.substr(at + 12, len);
    EXPECT_EQ(le(file, at + 12 + len, 4), masked(crc32c_bitwise(data))) << "data CRC at byte " << at;
    out.push_back(data);
    at += 12 + len + 4;
  }
  return out;
}

struct Field {
  int number, wire;
  uint64_t value;     // varint, fixed32, fixed64
  std::string bytes;  // length-delimited
};
std::vector<Field> protobuf_fields(const std::string& s) {
  std::vector<Field> out;
  size_t at = 0;
  const auto varint = [&]() {
    uint64_t v = 0;
    for (int shift = 0; at < s.size(); shift += 7) {
      const auto b = static_cast<unsigned char>(s[at++]);
      v |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) break;
    }
    return v;
  };
  while (at < s.size()) {
    const uint64_t key = varint();
    Field f{static_cast<int>(key >> 3), static_cast<int>(key & 7), 0, ""};
    if (f.wire == 0) f.value = varint();
    else if (f.wire == 1) f.value = le(s, at, 8), at += 8;
    else if (f.wire == 5) f.value = le(s, at, 4), at += 4;
    else if (f.wire == 2) {
      const uint64_t n = varint();
      f.bytes = s.substr(at, n);
      at += n;
    } else {
      ADD_FAILURE() << "unexpected wire type " << f.wire;
      break;
    }
    out.push_back(f);
  }
  return out;
}

struct Scalar {
  int64_t step;
  float value;
};
// tag → (step, value) of every Summary event; file_version of the first event.
std::map<std::string, std::vector<Scalar>> decode_events(const std::vector<std::string>& records,
                                                         std::string* file_version) {
  std::map<std::string, std::vector<Scalar>> out;
  for (const std::string& rec : records) {
    int64_t step = 0;
    bool has_wall_time = false;
    for (const Field& f : protobuf_fields(rec)) {
      if (f.number == 1 && f.wire == 1) has_wall_time = true;
      if (f.number == 2 && f.wire == 0) step = static_cast<int64_t>(f.value);
      if (f.number == 3 && f.wire == 2) *file_version = f.bytes;
      if (f.number == 5 && f.wire == 2)
        for (const Field& v : protobuf_fields(f.bytes)) {  // Summary.value
          std::string tag;
          float value = NAN;
          for (const Field& x : protobuf_fields(v.bytes)) {
            if (x.number == 1) tag = x.bytes;
            if (x.number == 2 && x.wire == 5) {
              const auto bits = static_cast<uint32_t>(x.value);
              std::memcpy(&value, &bits, 4);
            }
          }
          out[tag].push_back({step, value});
        }
    }
    EXPECT_TRUE(has_wall_time);
  }
  return out;
}

// The value DeepSpeed's event `name` carries, from a metrics.jsonl record.
double metric_for(const std::string& name, const json& row) {
  if (name == "Train/Samples/train_loss") return row.at("loss");
  if (name == "Train/Samples/lr") return row.at("lr");
  if (name == "Train/Samples/loss_scale") return row.at("loss_scale");
  const std::string phase = name.substr(std::string("Train/Samples/elapsed_time_ms_").size());
  return row.at("time_ms").at(phase);
}

const std::vector<std::string> kEvents = {
    "Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale",
    "Train/Samples/elapsed_time_ms_forward", "Train/Samples/elapsed_time_ms_backward",
    "Train/Samples/elapsed_time_ms_backward_inner", "Train/Samples/elapsed_time_ms_backward_allreduce",
    "Train/Samples/elapsed_time_ms_step"};

}  // namespace

TEST(Monitors, CsvAndTensorBoardHoldDeepSpeedsEventsWithTheValuesOfMetrics) {
  json j = observed_config();
  j["fp16"] = {{"enabled", true}, {"initial_scale_power", 8}};
  j["wall_clock_breakdown"] = true;
  j["csv_monitor"] = {{"enabled", true}, {"output_path", temp_path("monitors")}, {"job_name", "csvjob"}};
  j["tensorboard"] = {{"enabled", true}, {"output_path", temp_path("monitors")}, {"job_name", "tbjob"}};
  const std::string dir = temp_path("mon_run");
  const Result r = run("train " + write_config("mon.json", j) + " --output " + dir, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<json> rows = read_metrics(dir);
  ASSERT_EQ(rows.size(), 3u);

  // CSV: one file per event, DeepSpeed's name mangling, `step,<last component>` header, x = samples
  for (const std::string& name : kEvents) {
    std::string file = name;
    for (char& c : file)
      if (c == '/') c = '_';
    const std::string text = slurp(temp_path("monitors/csvjob/" + file + ".csv"));
    std::istringstream lines(text);
    std::string line;
    std::getline(lines, line);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    EXPECT_EQ(line, "step," + name.substr(name.rfind('/') + 1)) << file;
    for (const json& row : rows) {
      ASSERT_TRUE(std::getline(lines, line)) << file << ": no row for step " << row["step"];
      const size_t comma = line.find(',');
      EXPECT_EQ(std::stoll(line.substr(0, comma)), row.at("samples").get<int64_t>()) << file;
      EXPECT_EQ(std::stod(line.substr(comma + 1)), metric_for(name, row)) << file << " step " << row["step"];
    }
    EXPECT_FALSE(std::getline(lines, line) && !line.empty()) << file << ": rows beyond the steps trained";
  }

  // TensorBoard: one event file; every record's CRCs hold; every event decodes
  const std::string events_file = only_file_in(temp_path("monitors/tbjob"));
  EXPECT_NE(events_file.find("events.out.tfevents."), std::string::npos) << events_file;
  std::string version;
  const auto scalars = decode_events(tfrecords(read_bytes(events_file)), &version);
  EXPECT_EQ(version, "brain.Event:2");
  EXPECT_EQ(scalars.size(), kEvents.size());
  for (const std::string& name : kEvents) {
    ASSERT_TRUE(scalars.count(name)) << name;
    const std::vector<Scalar>& s = scalars.at(name);
    ASSERT_EQ(s.size(), rows.size()) << name;
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_EQ(s[i].step, rows[i].at("samples").get<int64_t>()) << name;
      EXPECT_EQ(s[i].value, static_cast<float>(metric_for(name, rows[i]))) << name << " step " << i + 1;
    }
  }
}

TEST(Monitors, WandbAndCometAreRefusedByNameBecauseTheyNeedANetworkService) {
  for (const char* monitor : {"wandb", "comet"}) {
    json j = observed_config();
    j[monitor] = {{"enabled", true}, {"project", "p"}};
    const Result r = run("validate " + write_config("net.json", j));
    expect_one_line_rejection(r, std::string("`") + monitor + "`");
    EXPECT_NE(r.err.find("network service"), std::string::npos) << r.err;
    j[monitor]["enabled"] = false;  // disabled: accepted with its keys
    EXPECT_EQ(run("validate " + write_config("net.json", j)).code, 0) << monitor;
  }
}

// ---- flops profiler -----------------------------------------------------------------------

struct Layout {
  std::string name;
  int np;
  std::string args;
  int stages = 1, tensor = 1;
  std::string recompute;  // "", "full", "selective"
};

void PrintTo(const Layout& l, std::ostream* os) { *os << l.name << " at np " << l.np << ": " << l.args; }

class FlopsProfiler : public ::testing::TestWithParam<Layout> {};

// The exact count of the model's matrix products (DeepSpeed's convention: MACs of each linear
// layer = rows × in × out, attention's two products dense), per micro-batch of B sequences of T:
// blocks L·(12·B·T·C² + 2·B·T²·C), LM head B·T·Vp·C (Vp: vocabulary padded to the tensor size);
// backward twice that; recompute the blocks' forward again (full) or their attention (selective).
TEST_P(FlopsProfiler, TotalsEqualTheFormulaAndTheTreeSumsToThem) {
  const Layout& l = GetParam();
  json j = observed_config();
  j["flops_profiler"] = {{"enabled", true}, {"profile_step", 2}, {"top_modules", 3}};
  const std::string dir = temp_path("flops_" + l.name);
  const Result r = run("train " + write_config("flops.json", j) + " --output " + dir + " " + l.args, l.np);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count(r.out, "-------------------------- DeepSpeed Flops Profiler --------------------------"), 1u);
  EXPECT_EQ(count(r.out, "Profile Summary at step 2:"), 1u);
  for (const char* s : {"fwd MACs per GPU:", "params per GPU:", "Aggregated Profile per GPU", "Detailed Profile per GPU",
                        "(embedding): Embedding(", "(attn): Attention(", "MFU / HFU"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s;
  // rank 0 reports its own modules: the head lives on the last pipeline stage
  EXPECT_EQ(r.out.find("(lm_head): Linear(") != std::string::npos, l.stages == 1);

  const json p = json::parse(slurp(dir + "/flops_profile.json"));
  const double B = 2, T = 16, C = 32, L = 2, V = 61;
  const double Vp = std::ceil(V / l.tensor) * l.tensor;
  const int dp = l.np / (l.stages * l.tensor);
  const double gas = 8.0 / (2 * dp);
  const double blocks = L * (12 * B * T * C * C + 2 * B * T * T * C), head = B * T * Vp * C;
  const double recompute = l.recompute == "full" ? blocks : l.recompute == "selective" ? L * 2 * B * T * T * C : 0.0;
  double fwd = 0, bwd = 0, rec = 0;
  for (const json& rank : p.at("ranks")) {
    EXPECT_EQ(rank.at("unattributed_macs").get<double>(), 0.0) << "a product outside every module";
    for (const json& m : rank.at("modules")) {
      fwd += m.at("forward_macs").get<double>();
      bwd += m.at("backward_macs").get<double>();
      rec += m.at("recompute_macs").get<double>();
    }
  }
  EXPECT_EQ(fwd, dp * gas * (blocks + head));
  EXPECT_EQ(bwd, 2 * dp * gas * (blocks + head));
  EXPECT_EQ(rec, dp * gas * recompute);
  if (recompute > 0) EXPECT_GT(p.at("hfu").get<double>(), p.at("mfu").get<double>());
  else EXPECT_EQ(p.at("hfu").get<double>(), p.at("mfu").get<double>());

  // Rank 0's tree: the root is the sum of depth 1, each block the sum of its attention and MLP,
  // and the root's MACs are rank 0's forward count.
  const json& tree = p.at("tree");
  double depth1 = 0.0, rank0 = 0.0;
  for (const json& m : p.at("ranks")[0].at("modules")) rank0 += m.at("forward_macs").get<double>();
  for (size_t i = 0; i < tree.size(); ++i) {
    if (tree[i]["depth"] == 1) depth1 += tree[i]["macs"].get<double>();
    if (tree[i]["type"] == "Block") {
      EXPECT_EQ(tree[i]["macs"].get<double>(), tree[i + 1]["macs"].get<double>() + tree[i + 2]["macs"].get<double>());
    }
  }
  EXPECT_EQ(tree[0]["macs"].get<double>(), depth1);
  EXPECT_EQ(tree[0]["macs"].get<double>(), rank0);
  EXPECT_GT(rank0, 0.0);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, FlopsProfiler,
    ::testing::Values(Layout{"data", 2, "--set zero_optimization.stage=3", 1, 1, ""},
                      Layout{"full_recompute", 2, "--set pipeline.activation_checkpoint_interval=1", 1, 1, "full"},
                      Layout{"selective", 2,
                             "--set activation_checkpointing.recompute_granularity=selective "
                             "--set pipeline.activation_checkpoint_interval=1",
                             1, 1, "selective"},
                      Layout{"pipeline", 2, "--set pipeline.stages=2", 2, 1, ""},
                      Layout{"tensor_recompute", 2,
                             "--set tensor_parallel.autotp_size=2 --set pipeline.activation_checkpoint_interval=1", 1,
                             2, "full"}),
    [](const ::testing::TestParamInfo<Layout>& i) { return i.param.name; });

// ---- wall_clock_breakdown and comms_logger ------------------------------------------------

TEST(Breakdown, ZeroStage3ShowsItsReductionAndAllGatherTimeWithTheSpreadOverRanks) {
  json j = observed_config();
  j["wall_clock_breakdown"] = true;
  j["zero_optimization"] = {{"stage", 3}, {"overlap_comm", false}};
  const std::string dir = temp_path("breakdown");
  const Result r = run("train " + write_config("bd.json", j) + " --output " + dir, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(count(r.out, "time (ms) | fwd: "), 3u) << r.out;
  EXPECT_EQ(count(r.out, "time (ms) min/avg/max over 2 ranks | fwd: "), 3u) << r.out;
  for (const json& row : read_metrics(dir)) {
    EXPECT_GT(row["time_ms"]["backward_allreduce"].get<double>(), 0.0) << "step " << row["step"];
    EXPECT_GT(row["time_ms"]["allgather"].get<double>(), 0.0) << "step " << row["step"];
    for (const char* name : {"fwd", "bwd", "bwd_inner", "bwd_allreduce", "step", "allgather"}) {
      const json& s = row["time_ms_ranks"][name];
      EXPECT_LE(s["min"].get<double>(), s["avg"].get<double>()) << name;
      EXPECT_LE(s["avg"].get<double>(), s["max"].get<double>()) << name;
    }
  }
}

TEST(Breakdown, PipelinesShowDeepSpeedsPipeTimers) {
  json j = observed_config();
  j["wall_clock_breakdown"] = true;
  const std::string dir = temp_path("breakdown_pipe");
  const Result r = run("train " + write_config("bdp.json", j) + " --output " + dir + " --set pipeline.stages=2", 2);
  ASSERT_EQ(r.code, 0) << r.err;
  const json row = read_metrics(dir).back();
  for (const char* name : {"pipe_send_output", "pipe_send_grad", "pipe_recv_input", "pipe_recv_grad"})
    EXPECT_TRUE(row["time_ms"].contains(name) && row["time_ms_ranks"].contains(name)) << name;
  EXPECT_NE(r.out.find("| pipe_recv_input: "), std::string::npos) << r.out;
}

class CommsLogger : public ::testing::TestWithParam<std::pair<std::string, std::string>> {};

// Per axis, the table's bytes (message size × count × DeepSpeed's bus factor, summed) equal the
// communicator's own bus-byte counter over the same operations.
TEST_P(CommsLogger, TableBytesEqualTheCommunicatorsCounters) {
  const auto& [name, args] = GetParam();
  json j = observed_config();
  j["comms_logger"] = {{"enabled", true}};
  const std::string dir = temp_path("comms_" + name);
  const Result r = run("train " + write_config("comms.json", j) + " --output " + dir + " " + args, 2);
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* col : {"Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
                          "busbw_avg (Gbps)"})
    EXPECT_NE(r.out.find(col), std::string::npos) << col;
  const json log = json::parse(slurp(dir + "/comms_logger.json"));
  std::map<std::string, int64_t> counted;
  std::set<std::string> ops;
  for (const json& axis : log.at("axes")) {
    int64_t bytes = 0;
    for (const json& rec : axis.at("records")) {
      bytes += rec.at("bus_bytes").get<int64_t>();
      ops.insert(axis.at("axis").get<std::string>() + "/" + rec.at("op").get<std::string>());
      EXPECT_GT(rec.at("count").get<int64_t>(), 0);
    }
    EXPECT_EQ(bytes, axis.at("communicator_bus_bytes").get<int64_t>()) << axis.at("axis");
    counted[axis.at("axis")] = bytes;
  }
  // The training steps' traffic (metrics.jsonl, reset every step) is part of what was logged.
  int64_t data = 0, tensor = 0, pipe = 0;
  for (const json& row : read_metrics(dir)) {
    data += row["comm_bytes_by_axis"]["data"].get<int64_t>();
    tensor += row["comm_bytes_by_axis"]["tensor"].get<int64_t>();
    pipe += row["comm_bytes_by_axis"]["pipe"].get<int64_t>();
  }
  EXPECT_LE(data, counted["data"] + counted["embedding"]);
  EXPECT_LE(tensor, counted["tensor"]);
  EXPECT_LE(pipe, counted["pipe"]);
  if (name == "zero3") {
    EXPECT_TRUE(ops.count("data/all_gather") && ops.count("data/reduce_scatter")) << r.out;
  }
  if (name == "pipeline") {
    EXPECT_TRUE(ops.count("pipe/send") && ops.count("pipe/recv")) << r.out;
    EXPECT_GT(pipe, 0);
    EXPECT_NE(r.out.find("pipe/send"), std::string::npos);
    EXPECT_NE(r.out.find("4.0 KB"), std::string::npos) << "a [2,16,32] fp32 activation is 4 KiB";
  }
  if (name == "tensor") {
    EXPECT_GT(tensor, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Axes, CommsLogger,
                         ::testing::Values(std::make_pair(std::string("zero3"), std::string("--set zero_optimization.stage=3")),
                                           std::make_pair(std::string("pipeline"), std::string("--set pipeline.stages=2")),
                                           std::make_pair(std::string("tensor"),
                                                          std::string("--set tensor_parallel.autotp_size=2"))),
                         [](const auto& i) { return i.param.first; });

// ---- trace --------------------------------------------------------------------------------

TEST(Trace, ParsesWithOneTrackPerRankAndEveryRegionClosed) {
  for (const std::string& layout : {std::string("--set pipeline.stages=2"), std::string("--set zero_optimization.stage=3")}) {
    json j = observed_config();
    j["trace"] = {{"enabled", true}, {"steps", {2}}};
    const std::string dir = temp_path("trace");
    run_shell("rm -rf " + dir);
    const Result r = run("train " + write_config("trace.json", j) + " --output " + dir + " " + layout, 2);
    ASSERT_EQ(r.code, 0) << r.err;
    const json t = json::parse(slurp(dir + "/trace.json"));
    std::map<int, std::vector<std::string>> stacks;
    std::map<int, double> last_ts;
    std::set<std::string> names;
    std::set<int> tracks;
    for (const json& e : t.at("traceEvents")) {
      const int pid = e.at("pid");
      if (e.at("ph") == "M") {
        if (e.at("name") == "process_name") tracks.insert(pid);
        continue;
      }
      const double ts = e.at("ts");
      EXPECT_GE(ts, last_ts[pid]) << "events of rank " << pid << " out of order";
      last_ts[pid] = ts;
      if (e.at("ph") == "B") {
        stacks[pid].push_back(e.at("name"));
        names.insert(e.at("name").get<std::string>());
      } else {
        ASSERT_EQ(e.at("ph"), "E");
        ASSERT_FALSE(stacks[pid].empty()) << "an end without a begin on rank " << pid;
        EXPECT_EQ(stacks[pid].back(), e.at("name").get<std::string>()) << "regions of rank " << pid << " interleave";
        stacks[pid].pop_back();
      }
    }
    EXPECT_EQ(tracks, (std::set<int>{0, 1})) << layout;
    for (const auto& [pid, stack] : stacks) EXPECT_TRUE(stack.empty()) << "rank " << pid << " left regions open";
    EXPECT_TRUE(names.count("step 2")) << layout;
    EXPECT_FALSE(names.count("step 1") || names.count("step 3")) << "only the chosen step is recorded";
    EXPECT_TRUE(names.count("block0/attention/forward") && names.count("block1/mlp/backward")) << layout;
    if (layout.find("stages") != std::string::npos)
      EXPECT_TRUE(names.count("pipe/send_activation") && names.count("pipe/recv_grad") && names.count("pipe/recv"))
          << layout;
    else
      EXPECT_TRUE(names.count("zero/all_gather") && names.count("zero/reduce_scatter")) << layout;
  }
}

// ---- nothing changes the training ---------------------------------------------------------

TEST(Observability, LossesAndGradientNormsAreBitIdenticalWithEverythingOn) {
  for (const std::string& layout : {std::string("--set zero_optimization.stage=3"),
                                    std::string("--set pipeline.stages=2 --set pipeline.activation_checkpoint_interval=1")}) {
    json off = observed_config(), on = observed_config();
    on["wall_clock_breakdown"] = true;
    on["flops_profiler"] = {{"enabled", true}, {"profile_step", 2}};
    on["csv_monitor"] = {{"enabled", true}};
    on["tensorboard"] = {{"enabled", true}};
    on["comms_logger"] = {{"enabled", true}};
    on["trace"] = {{"enabled", true}, {"steps", {1, 3}}};
    const std::string a = temp_path("plain"), b = temp_path("observed");
    run_shell("rm -rf " + a + " " + b);
    ASSERT_EQ(run("train " + write_config("off.json", off) + " --output " + a + " " + layout, 2).code, 0);
    ASSERT_EQ(run("train " + write_config("on.json", on) + " --output " + b + " " + layout, 2).code, 0);
    const std::vector<json> x = read_metrics(a), y = read_metrics(b);
    ASSERT_EQ(x.size(), y.size());
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_EQ(x[i]["loss"].get<double>(), y[i]["loss"].get<double>()) << layout << " step " << i + 1;
      EXPECT_EQ(x[i]["grad_norm"].get<double>(), y[i]["grad_norm"].get<double>()) << layout << " step " << i + 1;
    }
  }
}
