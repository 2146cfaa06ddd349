// test_cli_hostile_input.cpp — hostile input to the executable (issue 20, items 9 and 11-24):
// every bad value, file or option ends in one short message and exit 2 (1 for a failed
// allocation), within a time and memory bound; plus a seeded fuzz of `validate`.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "support/cli_helpers.hpp"

using json = nlohmann::json;
using namespace cli;

namespace {

// Each hostile run gets at most this much address space: a run that tried to allocate what
// a header or a value promises would fail with exit 1 instead of 2. (validate needs ~300 MB.)
// AddressSanitizer reserves terabytes of shadow address space, so there the bound is off
// (and its slower runs get more time).
#ifdef __SANITIZE_ADDRESS__
const std::string kAddressLimit = "";
constexpr double kSlowdown = 4.0;
#else
const std::string kAddressLimit = "prlimit --as=1073741824 ";
constexpr double kSlowdown = 1.0;
#endif
const std::string kBounded = kAddressLimit + "timeout 60";

// One message: exit 2, a single line, short, with no raw control bytes or invalid UTF-8.
void expect_one_short_message(const Result& r, const std::string& what) {
  EXPECT_EQ(r.code, 2) << what << "\n" << r.err.substr(0, 2000);
  EXPECT_EQ(count(r.err, "\n"), 1u) << what << "\n" << r.err.substr(0, 2000);
  EXPECT_LT(r.err.size(), 600u) << what << "\n" << r.err.substr(0, 2000);
  for (size_t i = 0; i < r.err.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(r.err[i]);
    EXPECT_FALSE((c < 0x20 && c != '\n') || c == 0x7f || c >= 0xf8)
        << what << ": raw byte " << int(c) << " at " << i << " in " << r.err.substr(0, 600);
  }
}

std::string write_text(const std::string& name, const std::string& text) {
  const std::string path = temp_path(name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// An llm.c token shard header (magic, version, count) followed by `payload` bytes.
std::string write_shard(const std::string& name, int32_t count, size_t payload) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520, header[1] = 1, header[2] = count;
  std::string bytes(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  bytes.append(payload, '\0');
  return write_text(name, bytes);
}

// A safetensors file whose header is `header` (no tensor data).
std::string write_safetensors(const std::string& name, const std::string& header) {
  const uint64_t n = header.size();
  return write_text(name, std::string(reinterpret_cast<const char*>(&n), 8) + header);
}

std::string tiny_path() { return write_config("hostile_tiny.json", tiny_config()); }

// --- item 9: a finite comms_timeout by default ------------------------------------------------

TEST(HostileInput, CommsTimeoutDefaultsToThirtyMinutesAndZeroTurnsItOff) {
  const std::string dir = temp_path("hostile_timeout");
  Result r = run("train " + tiny_path() + " --output " + dir + " --set training.steps=1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(slurp(dir + "/config.json"))["training"]["comms_timeout"], 1800.0);
  r = run("train " + tiny_path() + " --output " + dir + " --set training.steps=1 --set training.comms_timeout=0");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(slurp(dir + "/config.json"))["training"]["comms_timeout"], 0.0);
}

// --- item 11: numbers beyond double range -----------------------------------------------------

TEST(HostileInput, NumberBeyondDoubleRangeInTheFileExitsTwo) {
  for (const std::string& text : std::vector<std::string>{R"({"train_batch_size": 1e400})", R"({"train_batch_size": -1e400})",
                                 R"({"train_batch_size": 8, "optimizer": {"params": {"betas": [1e999, 0.9]}}})"}) {
    Result r = run("validate " + write_text("hostile_1e400.json", text));
    expect_one_short_message(r, text);
    EXPECT_NE(r.err.find("hostile_1e400.json"), std::string::npos) << r.err;
  }
}

TEST(HostileInput, NumberBeyondDoubleRangeInSetNamesTheKey) {
  Result r = run("validate " + tiny_path() + " --set training.steps=1e400");
  expect_one_short_message(r, "--set training.steps=1e400");
  EXPECT_NE(r.err.find("training.steps=1e400"), std::string::npos) << r.err;
}

// --- item 12: invalid UTF-8 -------------------------------------------------------------------

TEST(HostileInput, InvalidUtf8InSetValueExitsTwoEscaped) {
  Result r = run("validate " + tiny_path() + " --set 'model.vocab_size=\xff'");
  expect_one_short_message(r, "--set model.vocab_size=\\xff");
  EXPECT_NE(r.err.find("model.vocab_size=\\xff"), std::string::npos) << r.err;
}

TEST(HostileInput, InvalidUtf8InTheFileExitsTwoEscaped) {
  Result r = run("validate " + write_text("hostile_utf8.json", "{\"optimizer\": {\"type\": \"Ad\xff\xfe\"}}"));
  expect_one_short_message(r, "invalid UTF-8 in the file");
}

// --- item 13: control bytes in paths ----------------------------------------------------------

TEST(HostileInput, NulInAPathKeyIsAValidationError) {
  for (const std::string& key : std::vector<std::string>{"training.output_dir", "training.save_dir", "data.path", "model.init_from"}) {
    json j = tiny_config();
    const auto dot = key.find('.');
    j[key.substr(0, dot)][key.substr(dot + 1)] = std::string("out\0put", 7);
    if (key == "data.path") j["data"]["source"] = "text", j["model"]["vocab_size"] = 256;
    Result r = run("validate " + write_config("hostile_nul.json", j));
    expect_one_short_message(r, key);
    EXPECT_NE(r.err.find(key), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("control byte"), std::string::npos) << r.err;
  }
}

// --- item 14: echoed values are capped and escaped ---------------------------------------------

TEST(HostileInput, HugeValueIsEchoedCappedWithItsLength) {
  json j = tiny_config();
  j["optimizer"]["type"] = std::string(5000000, 'A');
  Result r = run("validate " + write_config("hostile_huge_value.json", j));
  expect_one_short_message(r, "5 MB optimizer.type");
  EXPECT_NE(r.err.find("optimizer.type"), std::string::npos) << r.err.substr(0, 600);
  EXPECT_NE(r.err.find("(5000002 bytes)"), std::string::npos) << r.err.substr(0, 600);
}

TEST(HostileInput, HugeOrControlKeyIsEchoedCappedAndEscaped) {
  json j = tiny_config();
  j[std::string(1000000, 'k')] = 1;
  const auto start = std::chrono::steady_clock::now();
  Result r = run("validate " + write_config("hostile_huge_key.json", j));
  expect_one_short_message(r, "1 MB key");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0 * kSlowdown);
  json k = tiny_config();
  k["\x1b[31mred\x07"] = 1;
  r = run("validate " + write_config("hostile_escape_key.json", k));
  expect_one_short_message(r, "escape sequence in a key");
  EXPECT_NE(r.err.find("\\x1b[31mred\\x07"), std::string::npos) << r.err;
}

TEST(HostileInput, ConfigPathWithControlBytesIsEchoedEscaped) {
  json j = tiny_config();
  j["gradient_clipin"] = 1.0;
  write_config("hostile_\x01\x1b[2Jname.json", j);
  Result r = run("validate '" + temp_path("hostile_\x01\x1b[2Jname.json") + "'");
  expect_one_short_message(r, "control bytes in the config path");
  EXPECT_NE(r.err.find("hostile_\\x01\\x1b[2Jname.json"), std::string::npos) << r.err;
}

// --- item 15: memory check at start-up; allocation failures said as such -----------------------

TEST(HostileInput, PlanBeyondAvailableMemoryExitsTwoNamingTheShortfallAndKeys) {
  // 2^36 parameters: a TiB of model states, beyond any machine running the suite.
  for (const std::string& cmd : std::vector<std::string>{"validate", "train"}) {
    Result r = run(cmd + " " + tiny_path() + (cmd == "train" ? " --output " + temp_path("hostile_oom") : "") +
                       " --set model.vocab_size=16777216 --set model.n_embd=4096 --set model.n_head=1",
                   0, kBounded);
    expect_one_short_message(r, cmd);
    EXPECT_NE(r.err.find("short by"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("model.vocab_size 16777216"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("model.n_embd 4096"), std::string::npos) << r.err;
  }
  Result r = run("validate " + tiny_path() + " --set model.n_embd=1048576 --set model.n_head=1", 0, kBounded);
  expect_one_short_message(r, "n_embd 1048576");
  EXPECT_NE(r.err.find("model.n_embd 1048576"), std::string::npos) << r.err;
}

TEST(HostileInput, ValidateReportsTheMemoryItChecked) {
  Result r = run("validate " + tiny_path());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("memory  "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("per rank at ZeRO stage 0"), std::string::npos) << r.out;
}

TEST(HostileInput, FailedAllocationIsReportedAsOutOfMemoryInOneLine) {
  if (kAddressLimit.empty()) GTEST_SKIP() << "needs an address-space limit, which AddressSanitizer cannot run under";
  // 92M parameters fit the machine (the start-up check passes) but not a 1 GiB address space.
  Result r = run("train " + tiny_path() + " --output " + temp_path("hostile_alloc") +
                     " --set model.vocab_size=65536 --set model.n_embd=1024",
                 0, kBounded);
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(count(r.err, "\n"), 1u) << r.err;
  EXPECT_NE(r.err.find("out of memory"), std::string::npos) << r.err;
}

// --- items 16-18, 23: data files ------------------------------------------------------------------

json tokens_config(const std::string& path) {
  json j = tiny_config();
  j["data"] = {{"source", "tokens"}, {"path", path}};
  return j;
}

TEST(HostileInput, TokenShardWithNegativeCountExitsTwoNamingTheFile) {
  const std::string shard = write_shard("hostile_neg.bin", -1, 11000);
  Result r = run("train " + write_config("hostile_neg.json", tokens_config(shard)) + " --output " +
                 temp_path("hostile_data"), 0, kBounded);
  expect_one_short_message(r, "count -1");
  EXPECT_NE(r.err.find(shard), std::string::npos) << r.err;
}

TEST(HostileInput, TokenShardPromisingMoreThanTheFileIsRejectedBeforeAllocating) {
  // 2^31-1 tokens would be a 4 GiB vector; the 1 GiB address space turns an allocation into exit 1.
  const std::string shard = write_shard("hostile_promise.bin", 2147483647, 11000);
  Result r = run("train " + write_config("hostile_promise.json", tokens_config(shard)) + " --output " +
                 temp_path("hostile_data"), 0, kBounded);
  expect_one_short_message(r, "count 2^31-1");
  EXPECT_NE(r.err.find(shard), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("2147483647 tokens"), std::string::npos) << r.err;
}

TEST(HostileInput, DirectoryAsDataPathExitsTwo) {
  json j = tiny_config();
  j["model"]["vocab_size"] = 256;
  j["data"] = {{"source", "text"}, {"path", temp_path("")}};
  Result r = run("train " + write_config("hostile_dir.json", j) + " --output " + temp_path("hostile_data"));
  expect_one_short_message(r, "directory");
  EXPECT_NE(r.err.find("is a directory"), std::string::npos) << r.err;
  r = run("train " + write_config("hostile_dir_tokens.json", tokens_config(temp_path(""))) + " --output " +
          temp_path("hostile_data"));
  expect_one_short_message(r, "directory as token shard");
}

TEST(HostileInput, SpecialFilesAreRefusedWithoutHanging) {
  const std::string fifo = temp_path("hostile.fifo");
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {std::string("/dev/zero"), fifo}) {
    Result r = run("validate " + path, 0, kAddressLimit + "timeout 20");
    expect_one_short_message(r, "config " + path);
    EXPECT_NE(r.err.find("not a regular file"), std::string::npos) << r.err;
  }
  json text = tiny_config();
  text["model"]["vocab_size"] = 256;
  text["data"] = {{"source", "text"}, {"path", "/dev/zero"}};
  json init = tiny_config();
  init["model"]["init_from"] = fifo + ".safetensors";
  ::unlink((fifo + ".safetensors").c_str());
  ASSERT_EQ(::mkfifo((fifo + ".safetensors").c_str(), 0600), 0);
  json h5 = tiny_config();
  h5["model"]["init_from"] = "/dev/zero";
  for (const json& j : {text, tokens_config("/dev/zero"), tokens_config(fifo), init, h5}) {
    Result r = run("train " + write_config("hostile_special.json", j) + " --output " + temp_path("hostile_data"), 0,
                   kBounded);
    expect_one_short_message(r, j.dump());
    EXPECT_NE(r.err.find("not a regular file"), std::string::npos) << r.err;
  }
}

// --- item 19: safetensors header with wrongly typed fields ---------------------------------------

TEST(HostileInput, SafetensorsHeaderWithWrongTypesNamesFileAndField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"wte.weight":5})", "wte.weight"},
      {R"({"wte.weight":{"dtype":7,"shape":[64,32],"data_offsets":[0,8192]}})", "dtype"},
      {R"({"wte.weight":{"dtype":"F32","shape":"x","data_offsets":[0,8192]}})", "shape"},
      {R"({"wte.weight":{"dtype":"F32","shape":[64,32],"data_offsets":[0,-1]}})", "data_offsets"},
      {R"({"wte.weight":{"dtype":"F32","shape":[64,32],"data_offsets":[0,8192]}})", "past the end"},
      {R"([1,2,3])", "not a JSON object"}};
  for (const auto& [header, field] : cases) {
    const std::string file = write_safetensors("hostile_weights.safetensors", header);
    json j = tiny_config();
    j["model"]["init_from"] = file;
    Result r = run("train " + write_config("hostile_weights.json", j) + " --output " + temp_path("hostile_data"), 0,
                   kBounded);
    expect_one_short_message(r, header);
    EXPECT_NE(r.err.find(file), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(field), std::string::npos) << header << ": " << r.err;
  }
}

// --- item 20: the batch triad never overflows ---------------------------------------------------

TEST(HostileInput, BatchTriadOverflowExitsTwo) {
  const std::vector<json> triads = {
      {{"train_batch_size", 4}, {"train_micro_batch_size_per_gpu", 4611686018427387905LL}, {"gradient_accumulation_steps", 4}},
      {{"train_micro_batch_size_per_gpu", 2147483647}, {"gradient_accumulation_steps", 2147483647}},
      {{"train_batch_size", 4}, {"train_micro_batch_size_per_gpu", 2147483647}, {"gradient_accumulation_steps", 2147483647}},
      {{"train_batch_size", 18446744073709551615ULL}},
      {{"train_micro_batch_size_per_gpu", 2147483647}},
      // found by the fuzz test: a given 0 was divided by before the positivity check
      {{"train_batch_size", 8}, {"train_micro_batch_size_per_gpu", 0}},
      {{"train_batch_size", 8}, {"gradient_accumulation_steps", 0}}};
  for (const json& t : triads) {
    json j = tiny_config();
    j.erase("train_batch_size");
    j.erase("train_micro_batch_size_per_gpu");
    j.update(t);
    Result r = run("validate " + write_config("hostile_triad.json", j) + " --world-size 1024", 0, kBounded);
    expect_one_short_message(r, t.dump());
    EXPECT_TRUE(r.err.find("train_") != std::string::npos || r.err.find("gradient_accumulation_steps") != std::string::npos)
        << r.err;
  }
}

// --- item 21: topology is bounded and linear ------------------------------------------------------

TEST(HostileInput, TopologyBeyondTheRankBoundExitsTwo) {
  Result r = run("topology --pp 100000 --dp 100000 --tp 100000", 0, kBounded);
  expect_one_short_message(r, "1e15 ranks");
  EXPECT_NE(r.err.find("1000000000000000 ranks"), std::string::npos) << r.err;
  expect_one_short_message(run("topology --dp 3000000", 0, kBounded), "--dp 3000000");
}

TEST(HostileInput, TopologyOfTenThousandRanksIsFastAndLinear) {
  const auto start = std::chrono::steady_clock::now();
  Result r = run("topology --dp 10000", 0, kBounded);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_LT(seconds, 5.0 * kSlowdown);
  EXPECT_EQ(count(r.out, "\n"), 10001u);
  EXPECT_LT(r.out.size(), 10001u * 200) << "rank lines must not list whole long groups";
  EXPECT_NE(r.out.find("rank 9999  pipe 0 data 9999 model 0  | data group [0,1,...,9999] (10000 ranks)"),
            std::string::npos);
  // Arithmetic groups agree with ProcessTopology's lists (pipe 2 x data 3 x model 2).
  const json t = json::parse(run("topology --pp 2 --dp 3 --tp 2 --json").out);
  EXPECT_EQ(t["ranks"][7]["groups"]["data"], json({7, 9, 11}));
  EXPECT_EQ(t["ranks"][7]["groups"]["pipe"], json({1, 7}));
  EXPECT_EQ(t["ranks"][7]["groups"]["model"], json({6, 7}));
  EXPECT_EQ(t["ranks"][7]["coord"], json({{"pipe", 1}, {"data", 0}, {"model", 1}}));
}

// --- items 22, 24: numeric options and messages -----------------------------------------------------

TEST(HostileInput, EstimateRejectsNonFiniteAndOutOfRangeOptions) {
  for (const std::string& args : std::vector<std::string>
       {"zero2 --params nan", "zero2 --params inf", "zero2 --params 1e308", "zero2 --params -5",
        "zero3 --params 1e9 --largest-layer-params nan", "zero2 --params 1e9 --additional-buffer-factor -1.5",
        "zero2 --params 1e9 --additional-buffer-factor nan", "zero2 --params 1e9 --gpus-per-node 100000 --nodes 100000",
        "zero2 --params 1e9 --gpus-per-node 99999999999"}) {
    Result r = run("estimate " + args, 0, kBounded);
    expect_one_short_message(r, args);
    EXPECT_EQ(r.out.find("-9223372036854775808"), std::string::npos) << r.out;
  }
}

TEST(HostileInput, WorldSizeZeroSaysTheRangeBriefly) {
  for (const std::string& args : std::vector<std::string>{"validate " + tiny_path() + " --world-size 0",
                                 "estimate --config " + tiny_path() + " --world-size 0", "topology --dp 0"}) {
    Result r = run(args);
    EXPECT_EQ(r.code, 2) << args;
    EXPECT_LT(r.err.size(), 200u) << r.err;  // not DBL_MAX in 309 digits
  }
}

TEST(HostileInput, NegativeOrNonFiniteMemoryPerRankIsNamedAsSuch) {
  Result r = run("estimate --config " + tiny_path() + " --memory-per-rank -5GB");
  expect_one_short_message(r, "-5GB");
  EXPECT_NE(r.err.find("negative"), std::string::npos) << r.err;
  for (const std::string& size : std::vector<std::string>{"infGB", "nanGB", "1e30GB", "5XB"}) {
    r = run("estimate --config " + tiny_path() + " --memory-per-rank " + size);
    expect_one_short_message(r, size);
    EXPECT_NE(r.err.find("--memory-per-rank " + size), std::string::npos) << r.err;
  }
}

TEST(HostileInput, EstimateReportInAnUnwritablePlaceExitsTwo) {
  Result r = run("estimate --config " + tiny_path() + " --report /proc/zero3d_no_such_dir/x.h5");
  expect_one_short_message(r, "--report /proc");
  EXPECT_NE(r.err.find("--report"), std::string::npos) << r.err;
}

TEST(HostileInput, EstimateColdTablesHonourSet) {
  const std::string model = kSource + "/input/quickstart.json";
  Result base = run("estimate zero3 --model " + model);
  Result wide = run("estimate zero3 --model " + model + " --set model.n_layer=12 --set model.n_embd=768 --set model.n_head=12");
  ASSERT_EQ(base.code, 0) << base.err;
  ASSERT_EQ(wide.code, 0) << wide.err;
  EXPECT_NE(wide.out.find("SW: Model with 85M total params"), std::string::npos) << wide.out;
  expect_one_short_message(run("estimate zero3 --model " + model + " --set model.bogus=1"), "unknown key via --set");
  expect_one_short_message(run("estimate zero2 --params 1e9 --set model.n_layer=3"), "--set without a config");
}

// --- config fuzz ------------------------------------------------------------------------------------

// Hostile variants of a valid tiny config: every key's value replaced by wrong types, extreme
// numbers, long or invalid strings, deep nesting; plus hostile keys and special files. Values
// that JSON cannot hold (1e400, raw bytes) are spliced into the text in place of a marker.
struct FuzzCase {
  std::string text;        // config file content (when path is empty)
  std::string path;        // a special file to validate instead
  std::string args;        // extra arguments (--set ...)
};

std::vector<FuzzCase> fuzz_cases(uint32_t seed, size_t n) {
  const json base = tiny_config();
  // Every path to a value of the base config, and a few keys it does not set.
  std::vector<std::vector<std::string>> paths;
  std::function<void(const json&, std::vector<std::string>)> walk = [&](const json& j, std::vector<std::string> p) {
    if (!p.empty()) paths.push_back(p);
    if (j.is_object())
      for (auto it = j.begin(); it != j.end(); ++it) {
        auto q = p;
        q.push_back(it.key());
        walk(it.value(), q);
      }
  };
  walk(base, {});
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {"zero_optimization", "stage"}, {"zero_optimization", "reduce_bucket_size"}, {"scheduler", "type"},
           {"scheduler", "params", "warmup_num_steps"}, {"gradient_accumulation_steps"}, {"gradient_clipping"},
           {"data", "path"}, {"data", "source"}, {"bf16", "enabled"}, {"fp16", "loss_scale"},
           {"training", "output_dir"}, {"training", "comms_timeout"}, {"model", "init_from"}, {"steps_per_print"}})
    paths.push_back(extra);
  const std::string marker = "\"@@RAW@@\"";
  std::string deep;
  for (int i = 0; i < 100000; ++i) deep += '[';
  for (int i = 0; i < 100000; ++i) deep += ']';
  const std::vector<std::string> raw_values = {
      "1e400", "-1e400", "1e308", "-1e308", "9223372036854775807", "9223372036854775808", "18446744073709551616",
      "-9223372036854775809", "4611686018427387905", "-1", "0", "0.5", "2147483648", "1e-400", "true", "null",
      "[]", "{}", "[1,[2,[3]]]", "\"\"", "\"auto\"", "\"x\"", "\"\\u0000\"", "\"a\\u0000b\"", "\"\xff\xfe\"",
      "\"\xc0\x80\"", "\"\xed\xa0\x80\"", "\"\x1b[2J\"", "\"" + std::string(2000000, 'z') + "\"", deep,
      "{\"\": 1}", "{\"a\": 1, \"a\": 2}", "\"/dev/zero\"", "\"/tmp\"", "[1e400]", "{\"enabled\": \"yes\"}"};
  std::vector<FuzzCase> all;
  for (const auto& p : paths)
    for (const auto& v : raw_values) {
      json j = base;
      json* node = &j;
      for (size_t k = 0; k + 1 < p.size(); ++k) {
        if (!node->is_object()) break;
        node = &(*node)[p[k]];
      }
      if (!node->is_object()) continue;
      (*node)[p.back()] = "@@RAW@@";
      std::string text = j.dump();
      text.replace(text.find(marker), marker.size(), v);
      all.push_back({text, "", ""});
    }
  // Hostile keys and documents.
  for (const std::string& text : std::vector<std::string>
       {std::string("{\"\": 1}"), std::string("{\"\xff\": 1}"), std::string("{\"a\\u0000b\": 1}"),
        std::string("{\"" + std::string(100000, 'k') + "\": 1}"), std::string("[]"), std::string("null"),
        std::string("\"x\""), std::string("{"), std::string(""), std::string("\xef\xbb\xbf{}"), deep,
        std::string("{\"train_batch_size\": 8} trailing"), std::string("{\"train_batch_size\": 8 /* c */}")})
    all.push_back({text, "", ""});
  // --set values: the same hostile values on the command line.
  for (const std::string& set : std::vector<std::string>
       {"training.steps=1e400", "model.vocab_size=$'\\xff'", "model.n_embd=1e308", "train_batch_size=-1",
        "training.output_dir=$'a\\x01b'", "a..b=1", "model=3", "model.n_layer.x=1", "=1", "x",
        "optimizer.type=" + std::string(100000, 'Q'), "model.vocab_size=" + std::string(5000, '[')})
    all.push_back({base.dump(), "", "--set " + set});
  std::mt19937 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  if (all.size() > n) all.resize(n);
  for (const std::string& special : std::vector<std::string>{"/dev/zero", "/dev/null", "/dev/urandom", "/proc/self/mem", "/tmp", "FIFO"})
    all.push_back({"", special, ""});
  return all;
}

TEST(HostileInput, ConfigFuzzEveryVariantExitsZeroOrTwoBriefly) {
  const std::vector<FuzzCase> cases = fuzz_cases(20, 300);
  const std::string dir = temp_path("fuzz");
  std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str());
  const std::string fifo = dir + "/config.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // One script runs every case (two at a time) and records each exit code; outputs stay per case.
  std::string script = "cd " + dir + "\nrun() { " + kBounded + " " + kExe +
                       " validate \"$1\" $3 >\"$2.out\" 2>\"$2.err\"; echo $? >\"$2.rc\"; }\n";
  for (size_t i = 0; i < cases.size(); ++i) {
    std::string path = cases[i].path == "FIFO" ? fifo : cases[i].path;
    if (path.empty()) path = write_text("fuzz/case" + std::to_string(i) + ".json", cases[i].text);
    script += "run '" + path + "' case" + std::to_string(i) + " " + cases[i].args + " &\n";
    if (i % 2 == 1) script += "wait\n";
  }
  script += "wait\n";
  write_text("fuzz/run.sh", script);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(std::system(("bash " + dir + "/run.sh").c_str()), 0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 120.0 * kSlowdown);
  size_t exit0 = 0, exit2 = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string stem = dir + "/case" + std::to_string(i);
    const int code = std::atoi(slurp(stem + ".rc").c_str());
    const std::string out = slurp(stem + ".out"), err = slurp(stem + ".err");
    const std::string what = "case " + std::to_string(i) + " (" + (cases[i].path.empty() ? stem + ".json" : cases[i].path) +
                             " " + cases[i].args.substr(0, 80) + ")";
    EXPECT_TRUE(code == 0 || code == 2) << what << ": exit " << code << "\n" << err.substr(0, 1000);
    exit0 += code == 0, exit2 += code == 2;
    EXPECT_LE(count(out + err, "\n"), 4u) << what << "\n" << err.substr(0, 1000);
    EXPECT_LT(out.size() + err.size(), 1200u) << what << "\n" << err.substr(0, 1000);
    for (unsigned char c : err)
      if ((c < 0x20 && c != '\n') || c == 0x7f) {
        ADD_FAILURE() << what << ": raw control byte " << int(c) << " in " << err.substr(0, 600);
        break;
      }
  }
  EXPECT_GT(exit2, cases.size() / 2);
  std::printf("fuzz: %zu variants in %.1f s, %zu valid, %zu rejected\n", cases.size(), seconds, exit0, exit2);
}

}  // namespace
