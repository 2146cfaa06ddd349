// test_offload.cpp — ZeRO-Offload / ZeRO-Infinity units: the offload keys, aligned buffers, the
// io_uring pool, the CPU Adam and the sub-group swap pipeline (DEEPSPEED-FACTS-2 §3).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "base/errors.hpp"
#include "config/config.hpp"
#include "kernels/memory.hpp"
#include "kernels/optimizers.hpp"
#include "kernels/typed.hpp"
#include "offload/aio.hpp"
#include "offload/offload_optimizer.hpp"
#include "offload/param_swapper.hpp"
#include "optim/optimizer.hpp"
#include "train/estimator.hpp"

using namespace zero3d;
using namespace zero3d::offload;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

json minimal() { return json{{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 16}}; }

std::string error_of(const json& j) {
  try {
    read_config(j, "cfg.json", 2);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

json with_zero(const json& zero, const json& extra = json::object()) {
  json j = minimal();
  j["zero_optimization"] = zero;
  for (auto it = extra.begin(); it != extra.end(); ++it) j[it.key()] = it.value();
  return j;
}

// A fresh directory per test under the test's temp dir, removed at the end.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& name)
      : path(::testing::TempDir() + "zero3d_offload_" + std::to_string(::getpid()) + "_" + name) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::vector<float> random_values(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(gen);
  return v;
}

size_t swap_files_in(const std::string& dir) {
  size_t n = 0;
  if (!fs::exists(dir)) return 0;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.path().string().find(".tensor.swp") != std::string::npos) ++n;
  return n;
}

}  // namespace

// ---- configuration ----------------------------------------------------------------------

TEST(OffloadConfig, EveryKeyHasDeepSpeedsDefault) {
  const Config c = read_config(with_zero({{"stage", 3}}), "cfg.json", 2);
  const ZeroConfig& z = c.zero;
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::None);
  EXPECT_EQ(z.offload_optimizer.buffer_count, 4);
  EXPECT_TRUE(z.offload_optimizer.pin_memory);
  EXPECT_FALSE(z.offload_optimizer.pipeline_read);
  EXPECT_FALSE(z.offload_optimizer.pipeline_write);
  EXPECT_FALSE(z.offload_optimizer.fast_init);
  EXPECT_EQ(z.offload_optimizer.ratio, 1.0);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::None);
  EXPECT_EQ(z.offload_param.buffer_count, 5);
  EXPECT_EQ(z.offload_param.buffer_size, 100000000);
  EXPECT_EQ(z.offload_param.max_in_cpu, 1000000000);
  EXPECT_EQ(z.sub_group_size, 1000000000);
  EXPECT_EQ(z.aio.block_size, 1048576);
  EXPECT_EQ(z.aio.queue_depth, 8);
  EXPECT_EQ(z.aio.intra_op_parallelism, 1);
  EXPECT_FALSE(z.aio.single_submit);
  EXPECT_TRUE(z.aio.overlap_events);
  EXPECT_EQ(c.resolved["zero_optimization"]["offload_optimizer"]["device"], "none");
}

TEST(OffloadConfig, NvmeKeysAndTheAioSectionAreRead) {
  const json j = with_zero({{"stage", 2},
                            {"sub_group_size", 1000},
                            {"offload_optimizer",
                             {{"device", "nvme"}, {"nvme_path", "/tmp/x"}, {"buffer_count", 9}, {"pipeline_read", true},
                              {"pipeline_write", true}, {"ratio", 0.5}, {"pin_memory", false}, {"fast_init", true}}}},
                           {{"aio",
                             {{"block_size", 8192}, {"queue_depth", 4}, {"thread_count", 2}, {"single_submit", true},
                              {"overlap_events", false}, {"use_gds", false}}},
                            {"bf16", {{"enabled", true}}}});
  const Config c = read_config(j, "cfg.json", 2);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::Nvme);
  EXPECT_EQ(c.zero.offload_optimizer.nvme_path, "/tmp/x");
  EXPECT_EQ(c.zero.offload_optimizer.ratio, 0.5);
  EXPECT_EQ(c.zero.sub_group_size, 1000);
  EXPECT_EQ(c.zero.aio.block_size, 8192);
  EXPECT_EQ(c.zero.aio.queue_depth, 4);
  EXPECT_EQ(c.zero.aio.intra_op_parallelism, 2);  // thread_count is the old name
  EXPECT_TRUE(c.zero.aio.single_submit);
  EXPECT_FALSE(c.zero.aio.overlap_events);
  // Keys accepted without an effect here are listed at start-up, never silently taken.
  auto noted = [&](const Config& cfg, const std::string& key) {
    for (const std::string& n : cfg.notes)
      if (n.rfind("no effect on this build: `" + key + "`", 0) == 0) return true;
    return false;
  };
  EXPECT_TRUE(noted(c, "zero_optimization.offload_optimizer.fast_init"));
  json k = j;
  k["zero_optimization"]["offload_optimizer"]["cpuadam_cores_perc"] = 0.5;
  EXPECT_TRUE(noted(read_config(k, "cfg.json", 2), "zero_optimization.offload_optimizer.cpuadam_cores_perc"));
}

TEST(OffloadConfig, TheAioSectionIsReadWithTheDeprecatedBooleanZeroForm) {
  json j = minimal();
  j["zero_optimization"] = true;
  j["aio"] = {{"queue_depth", 32}};
  EXPECT_EQ(read_config(j, "cfg.json", 2).zero.aio.queue_depth, 32);
}

TEST(OffloadConfig, DeprecatedCpuOffloadMeansOffloadOptimizerCpu) {
  const Config c = read_config(with_zero({{"stage", 2}, {"cpu_offload", true}, {"cpu_offload_use_pin_memory", true}}),
                               "cfg.json", 2);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::Cpu);
  const Config p = read_config(with_zero({{"stage", 3}, {"cpu_offload_param", true}}), "cfg.json", 2);
  EXPECT_EQ(p.zero.offload_param.device, OffloadDevice::Cpu);
  EXPECT_NE(error_of(with_zero({{"stage", 2}, {"cpu_offload", true}, {"offload_optimizer", {{"device", "cpu"}}}}))
                .find("`zero_optimization.cpu_offload`"),
            std::string::npos);
}

TEST(OffloadConfig, InvalidCombinationsAreRejectedWithTheirReason) {
  struct Case {
    json j;
    std::string key, reason;
  };
  const std::vector<Case> cases = {
      {with_zero({{"stage", 2}, {"offload_optimizer", {{"device", "nvme"}}}}),
       "`zero_optimization.offload_optimizer.nvme_path`", "needs an nvme_path"},
      {with_zero({{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"nvme_path", "/x"}}}}),
       "`zero_optimization.offload_optimizer.nvme_path`", "only used with"},
      {with_zero({{"stage", 2}, {"offload_param", {{"device", "cpu"}}}}), "`zero_optimization.offload_param`",
       "only stage 3"},
      {with_zero({{"stage", 3}, {"offload_param", {{"device", "nvme"}}}}), "`zero_optimization.offload_param.nvme_path`",
       "needs an nvme_path"},
      {with_zero({{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}, {{"optimizer", {{"type", "Lamb"}}}}),
       "", "Lamb"},
      {with_zero({{"stage", 2},
                  {"offload_optimizer",
                   {{"device", "nvme"}, {"nvme_path", "/x"}, {"buffer_count", 3}, {"pipeline_read", true}}}}),
       "`zero_optimization.offload_optimizer.buffer_count`", "at least 4"},
      {with_zero({{"stage", 2}, {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/x"}, {"buffer_count", 2}}}},
                 {{"bf16", {{"enabled", true}}}}),
       "`zero_optimization.offload_optimizer.buffer_count`", "fp32 master, exp_avg, exp_avg_sq"},
      {with_zero({{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}, {"ratio", 1.5}}}}),
       "`zero_optimization.offload_optimizer.ratio`", "out of range"},
      {with_zero({{"stage", 2}}, {{"aio", {{"block_size", 5000}}}}), "`aio.block_size`", "multiple of 4096"},
      {with_zero({{"stage", 2}}, {{"aio", {{"thread_count", 2}, {"intra_op_parallelism", 2}}}}), "`aio.thread_count`",
       "new name"},
      {with_zero({{"stage", 2}, {"offload_optimizer", {{"device", "disk"}}}}),
       "`zero_optimization.offload_optimizer.device`", "none, cpu, nvme"},
      {with_zero({{"stage", 2}, {"offload_optimizer", {{"super_offload", true}}}}),
       "`zero_optimization.offload_optimizer.super_offload`", "not supported"},
  };
  for (const Case& c : cases) {
    const std::string e = error_of(c.j);
    EXPECT_NE(e.find(c.key), std::string::npos) << c.j.dump() << " -> " << e;
    EXPECT_NE(e.find(c.reason), std::string::npos) << c.j.dump() << " -> " << e;
  }
}

// ---- aligned buffers and the io_uring pool -----------------------------------------------

TEST(AlignedBuffer, IsPageAlignedAndRoundedUpToWholePages) {
  AlignedBuffer b(5000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % kIoAlign, 0u);
  EXPECT_EQ(b.bytes(), 8192);
  EXPECT_EQ(align_up(4096), 4096);
  EXPECT_EQ(align_up(1), 4096);
}

class AioRoundTrip : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

TEST_P(AioRoundTrip, WhatIsWrittenReadsBackAndIsCounted) {
  const auto [threads, single_submit, overlap] = GetParam();
  TempDir dir("aio_" + std::to_string(threads) + std::to_string(single_submit) + std::to_string(overlap));
  AioConfig cfg;
  cfg.block_size = 8192;  // many blocks per transfer, more than the queue holds
  cfg.queue_depth = 3;
  cfg.intra_op_parallelism = threads;
  cfg.single_submit = single_submit;
  cfg.overlap_events = overlap;
  AioEngine aio(cfg);
  bool direct = directory_supports_direct_io(dir.path);
  const int fd = open_swap_file(dir.path + "/a.tensor.swp", direct, "test");
  const int64_t n = 100003;  // floats: not a whole number of blocks
  const int64_t bytes = align_up(n * 4);
  AlignedBuffer out(bytes), in(bytes);
  const auto values = random_values(n, 3);
  std::memcpy(out.data(), values.data(), n * 4);
  aio.wait(aio.write(fd, out.data(), bytes, 4096, "a"));
  aio.wait(aio.read(fd, in.data(), bytes, 4096, "a"));
  EXPECT_EQ(std::memcmp(in.data(), values.data(), n * 4), 0);
  const IoStats s = aio.take_stats();
  EXPECT_EQ(s.write_bytes, bytes);
  EXPECT_EQ(s.read_bytes, bytes);
  EXPECT_GT(s.read_s, 0.0);
  EXPECT_EQ(aio.take_stats().read_bytes, 0);  // taken
  ::close(fd);
}

INSTANTIATE_TEST_SUITE_P(Knobs, AioRoundTrip,
                         ::testing::Values(std::make_tuple(1, false, true), std::make_tuple(3, false, true),
                                           std::make_tuple(2, true, false), std::make_tuple(1, true, true)));

TEST(AioEngine, SeveralTransfersInFlightCompleteIndependently) {
  TempDir dir("many");
  AioConfig cfg;
  cfg.block_size = 4096;
  cfg.queue_depth = 2;
  AioEngine aio(cfg);
  bool direct = true;
  const int fd = open_swap_file(dir.path + "/m.tensor.swp", direct, "test");
  std::vector<AlignedBuffer> bufs;
  std::vector<Ticket> tickets;
  for (int i = 0; i < 6; ++i) {
    bufs.emplace_back(3 * 4096);
    std::memset(bufs.back().data(), 'a' + i, 3 * 4096);
    tickets.push_back(aio.write(fd, bufs.back().data(), 3 * 4096, i * 3 * 4096, "m"));
  }
  for (int i = 5; i >= 0; --i) aio.wait(tickets[i]);  // any order
  for (int i = 0; i < 6; ++i) {
    AlignedBuffer r(3 * 4096);
    aio.wait(aio.read(fd, r.data(), 3 * 4096, i * 3 * 4096, "m"));
    EXPECT_EQ(static_cast<char*>(r.data())[3 * 4096 - 1], 'a' + i);
  }
  ::close(fd);
}

TEST(AioEngine, AFailedTransferThrowsSystemErrorNamingTheFile) {
  TempDir dir("fail");
  AioEngine aio(AioConfig{});
  const std::string path = dir.path + "/ro.tensor.swp";
  std::ofstream(path) << "x";
  const int fd = ::open(path.c_str(), O_RDONLY);
  AlignedBuffer b(4096);
  try {
    aio.wait(aio.write(fd, b.data(), 4096, 0, path));
    FAIL() << "a write to a read-only descriptor succeeded";
  } catch (const SystemError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  // Reading past the end of a file is an error too, not silent zeros.
  EXPECT_THROW(aio.wait(aio.read(fd, b.data(), 4096, 1 << 20, path)), SystemError);
  ::close(fd);
}

TEST(SwapDir, AnUncreatableNvmePathIsBadInputNamingKeyAndPath) {
  TempDir dir("bad");
  const std::string file = dir.path + "/plain_file";
  std::ofstream(file) << "x";
  try {
    prepare_swap_dir(file + "/swap", 0, "zero_optimization.offload_optimizer.nvme_path");
    FAIL() << "a directory under a regular file was created";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("`zero_optimization.offload_optimizer.nvme_path`"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
  }
}

// A memory file system (Linux 6.x gives tmpfs O_DIRECT, so the direct-I/O probe passes) would
// keep the "offloaded" state in memory: refused, naming the key. /dev/shm is tmpfs on Linux.
TEST(SwapDir, AMemoryFileSystemIsRefusedThoughItTakesODirect) {
  const std::string dir = "/dev/shm/zero3d_test_swap_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  try {
    require_direct_io(dir, "zero_optimization.offload_param.nvme_path");
    FAIL() << "tmpfs was accepted as NVMe";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("`zero_optimization.offload_param.nvme_path`"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("is in memory"), std::string::npos) << e.what();
  }
  std::system(("rm -rf " + dir).c_str());
}

TEST(SwapDir, NotEnoughFreeSpaceIsBadInputWithTheNumbers) {
  TempDir dir("full");
  try {
    prepare_swap_dir(dir.path, int64_t(1) << 60, "zero_optimization.offload_optimizer.nvme_path");
    FAIL() << "an exabyte of swap was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(int64_t(1) << 60)), std::string::npos) << e.what();
  }
}

// validate's check (check_swap_directory) creates nothing and looks where the directory would be
// created; /proc and /sys are refused by name, as train refuses them.
TEST(SwapDir, TheSharedCheckCreatesNothingAndRefusesKernelFileSystems) {
  TempDir dir("check");
  check_swap_directory(dir.path + "/a/b", 4096, "zero_optimization.offload_optimizer.nvme_path");
  EXPECT_FALSE(fs::exists(dir.path + "/a"));
  for (const std::string& path : {std::string("/proc/self/swap"), std::string("/sys/kernel")}) {
    try {
      check_swap_directory(path, 0, "zero_optimization.offload_param.nvme_path");
      FAIL() << path << " was accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("is in a kernel file system"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("`zero_optimization.offload_param.nvme_path`"), std::string::npos);
    }
  }
}

// The ranks of a job check one shared nvme_path at the same moment: each probes with files of
// its own. (With one probe name, one rank's O_TRUNC could empty the page another had just
// written before it read it back, and that rank refused a good directory as lacking O_DIRECT:
// a 2-rank NVMe run of benchmarks/estimate_vs_measured.sh failed so at start-up.)
TEST(SwapDir, RanksCheckingOneDirectoryAtOnceAllAcceptIt) {
  TempDir dir("shared");
  constexpr int kProcs = 4, kTries = 400;
  std::vector<pid_t> children;
  for (int p = 0; p < kProcs; ++p) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int refused = 0;
      for (int i = 0; i < kTries; ++i) {
        try {
          check_swap_directory(dir.path, 4096, "zero_optimization.offload_param.nvme_path");
        } catch (const std::exception&) {
          ++refused;
        }
      }
      ::_exit(refused > 0 ? 1 : 0);
    }
    children.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  EXPECT_EQ(failed, 0) << "of " << kProcs << " processes checking " << dir.path << " together, some were refused";
}

TEST(SwapDir, SwapFilesOfAnEarlierRunAreRemovedOthersKept) {
  TempDir dir("stale");
  std::ofstream(dir.path + "/exp_avg-0_10.tensor.swp") << "stale";
  std::ofstream(dir.path + "/notes.txt") << "mine";
  prepare_swap_dir(dir.path, 0, "k");
  EXPECT_FALSE(fs::exists(dir.path + "/exp_avg-0_10.tensor.swp"));
  EXPECT_TRUE(fs::exists(dir.path + "/notes.txt"));
}

// ---- CPU Adam --------------------------------------------------------------------------

class CpuAdam : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

// The reference update of torch.optim.Adam / AdamW in double precision.
TEST_P(CpuAdam, MatchesTheReferenceAndTheDeviceKernelBitForBit) {
  const auto [adamw, bias_correction] = GetParam();
  const int64_t n = 1003;  // not a multiple of any vector width
  auto p = random_values(n, 1), m = random_values(n, 2, 0.01f), v = random_values(n, 3, 0.01f);
  for (auto& x : v) x = x * x;
  const auto g = random_values(n, 4);
  auto p2 = p, m2 = m, v2 = v;
  const double lr = 1e-2, b1 = 0.9, b2 = 0.99, eps = 1e-8, wd = 0.1;
  const int64_t step = 3;
  const auto s = kernels::make_adam_step(lr, b1, b2, eps, wd, step, bias_correction, adamw);
  kernels::cpu_adam_update(p.data(), g.data(), m.data(), v.data(), n, s);
  kernels::adam_update(p2.data(), g.data(), m2.data(), v2.data(), n, s);
  EXPECT_EQ(std::memcmp(p.data(), p2.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(m.data(), m2.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(v.data(), v2.data(), n * 4), 0);
  const double bc1 = bias_correction ? 1 - std::pow(b1, step) : 1, bc2 = bias_correction ? 1 - std::pow(b2, step) : 1;
  auto p0 = random_values(n, 1), m0 = random_values(n, 2, 0.01f), v0 = random_values(n, 3, 0.01f);
  for (auto& x : v0) x = x * x;
  for (int64_t i = 0; i < n; ++i) {
    double pi = p0[i], gi = g[i];
    if (!adamw) gi += wd * pi;
    const double mi = b1 * m0[i] + (1 - b1) * gi, vi = b2 * v0[i] + (1 - b2) * gi * gi;
    const double upd = (mi / bc1) / (std::sqrt(vi / bc2) + eps);
    const double want = adamw ? pi - lr * (upd + wd * pi) : pi - lr * upd;
    ASSERT_NEAR(p[i], want, 1e-6 * (1 + std::fabs(want))) << i;
    ASSERT_NEAR(m[i], mi, 1e-6) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, CpuAdam,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

// ---- the offloaded optimizer ----------------------------------------------------------

namespace {
OptimizerConfig adamw() {
  OptimizerConfig o;
  o.lr = 1e-2;
  o.weight_decay = 0.01;
  return o;
}

struct SwapCase {
  const char* name;
  OffloadDevice device;
  int64_t sub_group_size, buffer_count;
  bool pipeline_read, pipeline_write, master;
  double ratio;
};

OptimizerConfig lion() {
  OptimizerConfig o;
  o.type = OptimizerType::Lion;
  o.lr = 1e-3;
  o.weight_decay = 0.1;
  return o;
}

// Without weight decay DeepSpeedCPUAdagrad, which offload runs, and torch's Adagrad are one update.
OptimizerConfig adagrad() {
  OptimizerConfig o;
  o.type = OptimizerType::Adagrad;
  o.lr = 1e-2;
  o.eps = 1e-10;
  return o;
}

// Runs three steps over n elements with the plain Optimizer and with OffloadedOptimizer, and
// compares parameters and every state bit for bit. params_type BF16: bf16 master weights, updated
// where they lie; state_type: of the optimizer's states on both sides.
void expect_same_as_in_memory(const SwapCase& c, const std::string& dir, const OptimizerConfig& opt = adamw(),
                              DType params_type = DType::F32, DType state_type = DType::F32) {
  const int64_t n = 10007;
  ParamLayout layout;
  layout.add("partition", {n});
  Optimizer plain(opt, layout, state_type);
  OffloadOptimizerConfig off;
  off.device = c.device;
  off.buffer_count = c.buffer_count;
  off.pipeline_read = c.pipeline_read;
  off.pipeline_write = c.pipeline_write;
  off.ratio = c.ratio;
  AioConfig aio;
  aio.block_size = 8192;
  aio.queue_depth = 4;
  const bool master = c.master && params_type == DType::F32;  // an fp32 master copy held by the optimizer
  OffloadedOptimizer swapped(off, aio, opt, n, c.sub_group_size, master, dir, state_type);
  const size_t es = dtype_size(params_type);
  std::vector<char> p_plain(n * es), p_off(n * es);
  const auto init = random_values(n, 11);
  convert_any(p_plain.data(), params_type, init.data(), DType::F32, n);
  p_off = p_plain;
  std::vector<float> from_master(static_cast<size_t>(n));
  if (master) swapped.write("master", 0, n, init.data());
  ParamAccess access;
  access.acquire = [&](int64_t b, int64_t) { return master ? TypedSpan{} : TypedSpan{p_off.data() + b * es, params_type}; };
  access.release = [&](int64_t b, int64_t len, TypedSpan upd) {
    if (master) std::copy_n(static_cast<const float*>(upd.data), len, from_master.data() + b);
  };
  for (int step = 1; step <= 3; ++step) {
    const auto g = random_values(n, 100 + step);
    plain.step(TypedSpan{p_plain.data(), params_type}, g.data(), DType::F32, 1.0f, opt.lr);
    swapped.step(access, g.data(), DType::F32, 1.0f, opt.lr, std::nullopt);
  }
  const void* got = master ? static_cast<const void*>(from_master.data()) : p_off.data();
  EXPECT_EQ(std::memcmp(got, p_plain.data(), n * es), 0) << c.name;
  const std::vector<std::string> names = plain.state_names();
  ASSERT_EQ(swapped.optimizer_states(), names) << c.name;
  std::vector<float> state(static_cast<size_t>(n)), want(static_cast<size_t>(n));
  for (size_t k = 0; k < names.size(); ++k) {
    swapped.read(names[k], 0, n, state.data());
    convert_any(want.data(), DType::F32, plain.state_buffers()[k]->data(), state_type, n);
    EXPECT_EQ(std::memcmp(state.data(), want.data(), n * 4), 0) << c.name << " " << names[k];
  }
  if (master) {
    swapped.read("master", 0, n, state.data());
    EXPECT_EQ(std::memcmp(state.data(), p_plain.data(), n * 4), 0) << c.name;
  }
  EXPECT_EQ(swapped.step_count(), 3);
}
}  // namespace

TEST(OffloadedOptimizer, EverySwapScheduleGivesTheInMemoryResultBitForBit) {
  const std::vector<SwapCase> cases = {
      {"cpu", OffloadDevice::Cpu, 1000, 4, false, false, true, 1.0},
      {"cpu, ratio 0.5", OffloadDevice::Cpu, 1000, 4, false, false, false, 0.5},
      {"nvme, buffer_count 2, sub-groups smaller than the tensor", OffloadDevice::Nvme, 999, 2, false, false, false, 1.0},
      {"nvme, master, pipelined read and write", OffloadDevice::Nvme, 1500, 9, true, true, true, 1.0},
      {"nvme, pipelined read only", OffloadDevice::Nvme, 4096, 4, true, false, false, 1.0},
      {"nvme, pipelined write only", OffloadDevice::Nvme, 4096, 6, false, true, true, 1.0},
      {"nvme, ratio 0.5", OffloadDevice::Nvme, 1000, 3, false, false, true, 0.5},
      {"nvme, one sub-group", OffloadDevice::Nvme, 1 << 30, 3, false, false, true, 1.0},
  };
  for (const SwapCase& c : cases) {
    TempDir dir("adam");
    expect_same_as_in_memory(c, dir.path + "/rank0");
  }
}

// DeepSpeedCPULion and DeepSpeedCPUAdagrad (one state each) in host memory and in swap files:
// the offloaded update equals the device kernel's bit for bit, as CPU Adam's does.
TEST(OffloadedOptimizer, LionAndAdagradGiveTheInMemoryResultBitForBit) {
  const std::vector<SwapCase> cases = {
      {"cpu", OffloadDevice::Cpu, 1000, 4, false, false, true, 1.0},
      {"nvme, buffer_count 1, no master", OffloadDevice::Nvme, 999, 1, false, false, false, 1.0},
      {"nvme, master, pipelined read and write", OffloadDevice::Nvme, 1500, 6, true, true, true, 1.0},
      {"nvme, ratio 0.5", OffloadDevice::Nvme, 1000, 2, false, false, false, 0.5},
  };
  for (const auto& [name, opt] : {std::pair<const char*, OptimizerConfig>{"Lion", lion()}, {"Adagrad", adagrad()}})
    for (const SwapCase& c : cases) {
      SCOPED_TRACE(name);
      TempDir dir(name);
      expect_same_as_in_memory(c, dir.path + "/rank0", opt);
    }
}

// bf16_master_weights_and_grads: the optimizer updates the bf16 partition where it lies (no
// master copy); with bf16_optimizer_states its moments are bf16 on the tier and in the files too.
TEST(OffloadedOptimizer, Bf16MasterWeightsAndStatesGiveTheInMemoryResultBitForBit) {
  const std::vector<SwapCase> cases = {
      {"cpu", OffloadDevice::Cpu, 1000, 4, false, false, false, 1.0},
      {"nvme, pipelined read and write", OffloadDevice::Nvme, 999, 6, true, true, false, 1.0},
      {"nvme, ratio 0.5", OffloadDevice::Nvme, 1000, 2, false, false, false, 0.5},
  };
  for (DType states : {DType::F32, DType::BF16})
    for (const auto& [name, opt] : {std::pair<const char*, OptimizerConfig>{"AdamW", adamw()}, {"Lion", lion()}})
      for (const SwapCase& c : cases) {
        SCOPED_TRACE(std::string(name) + (states == DType::BF16 ? ", bf16 states" : ", fp32 states"));
        TempDir dir("bf16");
        expect_same_as_in_memory(c, dir.path + "/rank0", opt, DType::BF16, states);
      }
}

// Swap files and tiers hold each state in its own type: bf16 moments take half the bytes.
TEST(OffloadedOptimizer, Bf16StatesTakeHalfTheBytesOnEveryTier) {
  TempDir dir("bytes");
  OffloadOptimizerConfig off;
  off.device = OffloadDevice::Nvme;
  off.ratio = 0.5;
  // Sub-groups [0, 3000), [3000, 6000) stay in device memory; [6000, 9000), [9000, 10000) are swapped.
  OffloadedOptimizer a(off, AioConfig{}, adamw(), 10000, 3000, /*hold_master=*/true, dir.path + "/r", DType::BF16);
  const TierBytes t = a.bytes();
  EXPECT_EQ(t.device, 6000 * (4 + 2 + 2));  // the fp32 master, exp_avg and exp_avg_sq
  EXPECT_EQ(t.nvme, 4000 * (4 + 2 + 2));
  EXPECT_EQ(t.master, 6000 * 4);
  EXPECT_EQ(t.moments, 6000 * (2 + 2));
  EXPECT_EQ(fs::file_size(dir.path + "/r/exp_avg-6000_9000.tensor.swp"), 8192u);  // 6000 bytes in whole pages
  EXPECT_EQ(fs::file_size(dir.path + "/r/6000_9000.tensor.swp"), 12288u);         // 12000 bytes
  OffloadedOptimizer cpu_lion(OffloadOptimizerConfig{OffloadDevice::Cpu, ""}, AioConfig{}, lion(), 1000, 100,
                              /*hold_master=*/false, "", DType::BF16);
  EXPECT_EQ(cpu_lion.state_names(), std::vector<std::string>{"exp_avg"});
  EXPECT_EQ(cpu_lion.bytes().host, 1000 * 2);
}

// A GPU build's CPU optimizer moves each host sub-group's gradients (and parameters held in device
// memory) through two page-locked stages alternating on the copy stream, stage k % 2 for sub-group
// k, each as large as the largest host sub-group; the memory plan counts the same figure. A CPU
// build reads model memory itself: no stage.
TEST(OffloadedOptimizer, HostStagesHoldTheLargestHostSubGroupTwiceOnAGpuBuildAndNothingOnACpuBuild) {
  // 10000 elements in sub-groups of 3000 at ratio 0.5: [0, 3000) and [3000, 6000) stay in device
  // memory (int(0.5·4) = 2); [6000, 9000) comes through stage 0 and [9000, 10000) through stage 1.
  const HostStageBytes fp32 = host_stage_bytes(10000, 3000, 0.5, DType::F32, DType::F32, /*hold_master=*/false,
                                               /*params_in_model_memory=*/true, /*host_is_device=*/false);
  EXPECT_EQ(fp32.grad[0], 3000 * 4);
  EXPECT_EQ(fp32.grad[1], 3000 * 4);  // grown for the largest host sub-group, not only [9000, 10000)
  EXPECT_EQ(fp32.param[0], 3000 * 4);
  EXPECT_EQ(fp32.param[1], 3000 * 4);
  EXPECT_EQ(fp32.total(), 4 * 3000 * 4);
  // bf16 master weights (updated where they lie) with fp32 gradient accumulation
  EXPECT_EQ(host_stage_bytes(10000, 3000, 0.5, DType::F32, DType::BF16, false, true, false).total(),
            2 * 3000 * 4 + 2 * 3000 * 2);
  // an fp32 master copy on the host: no parameter stage for the host sub-groups; a resident
  // sub-group's master copy is read back into stage 0 for release()
  const HostStageBytes master = host_stage_bytes(10000, 3000, 0.5, DType::BF16, DType::BF16, true, true, false);
  EXPECT_EQ(master.grad[0], 3000 * 2);
  EXPECT_EQ(master.grad[1], 3000 * 2);
  EXPECT_EQ(master.param[0], 3000 * 4);
  EXPECT_EQ(master.param[1], 0);
  EXPECT_EQ(host_stage_bytes(10000, 3000, 1.0, DType::BF16, DType::BF16, true, true, false).total(), 2 * 3000 * 2);
  // parameters in swap files (offload_param nvme) reach the CPU optimizer in host memory already
  EXPECT_EQ(host_stage_bytes(10000, 3000, 0.5, DType::F32, DType::F32, false, false, false).total(), 2 * 3000 * 4);
  // one sub-group on the host, [9000, 10000) (ratio 0.25: int(0.75·4) = 3): the one stage its index picks
  const HostStageBytes one = host_stage_bytes(10000, 3000, 0.25, DType::F32, DType::F32, false, true, false);
  EXPECT_EQ(one.grad[0], 0);
  EXPECT_EQ(one.grad[1], 1000 * 4);
  EXPECT_EQ(one.param[0], 0);
  EXPECT_EQ(one.param[1], 1000 * 4);
  // DeepSpeed's default sub_group_size (1e9) over a smaller partition: the whole partition, once
  const HostStageBytes whole = host_stage_bytes(10000, 1000000000, 1.0, DType::BF16, DType::BF16, false, true, false);
  EXPECT_EQ(whole.grad[0], 10000 * 2);
  EXPECT_EQ(whole.total(), 2 * 10000 * 2);
  // everything resident (ratio 0), or a CPU build: none
  EXPECT_EQ(host_stage_bytes(10000, 3000, 0.0, DType::F32, DType::F32, false, true, false).total(), 0);
  EXPECT_EQ(host_stage_bytes(10000, 3000, 0.5, DType::F32, DType::F32, false, true, /*host_is_device=*/true).total(), 0);
}

// bytes() counts the stages the steps allocated: host_stage_bytes for this build, which on a CPU
// build is none, so its host row stays the host tier's.
TEST(OffloadedOptimizer, TheHostRowCountsTheStagesTheStepAllocated) {
  OffloadOptimizerConfig off;
  off.device = OffloadDevice::Cpu;
  off.ratio = 0.5;
  const int64_t n = 10000;
  OffloadedOptimizer a(off, AioConfig{}, adamw(), n, 3000, /*hold_master=*/false, "");
  EXPECT_EQ(a.bytes().host, 2 * 4000 * 4);  // exp_avg and exp_avg_sq of [6000, 10000)
  std::vector<float> params = random_values(n, 5);
  ParamAccess access;
  access.acquire = [&](int64_t b, int64_t) { return TypedSpan{params.data() + b, DType::F32}; };
  access.release = [](int64_t, int64_t, TypedSpan) {};
  const auto grads = random_values(n, 6);  // (this build's model memory, as the parameters)
  a.step(access, grads.data(), DType::F32, 1.0f, 1e-2, std::nullopt);
  EXPECT_EQ(a.bytes().host,
            2 * 4000 * 4 + host_stage_bytes(n, 3000, 0.5, DType::F32, DType::F32, false, true, kernels::kHostIsDevice).total());
}

TEST(OffloadedOptimizer, RatioKeepsTheFirstSubGroupsInDeviceMemoryAndTheRestOnTheTier) {
  TempDir dir("ratio");
  OffloadOptimizerConfig off;
  off.device = OffloadDevice::Nvme;
  off.ratio = 0.5;
  OffloadedOptimizer a(off, AioConfig{}, adamw(), 10000, 1000, /*hold_master=*/false, dir.path + "/r");
  EXPECT_EQ(a.sub_groups(), 10);
  EXPECT_EQ(a.resident_sub_groups(), 5);  // DeepSpeed: index >= int((1 - ratio)·G) offloaded
  const TierBytes t = a.bytes();
  EXPECT_EQ(t.device, 2 * 5000 * 4);
  EXPECT_EQ(t.nvme, 2 * 5000 * 4);
  EXPECT_EQ(t.host, 0);
  EXPECT_EQ(a.swap_files().size(), 10u);  // exp_avg and exp_avg_sq of 5 sub-groups
  EXPECT_EQ(swap_files_in(dir.path), 10u);
}

TEST(OffloadedOptimizer, SwapFilesFollowDeepSpeedsNamesAndAreGoneAfterwards) {
  TempDir dir("names");
  const std::string rank_dir = dir.path + "/zero_stage_2/optimizer/rank0";
  {
    OffloadOptimizerConfig off;
    off.device = OffloadDevice::Nvme;
    OffloadedOptimizer a(off, AioConfig{}, adamw(), 2500, 1000, /*hold_master=*/true, rank_dir);
    EXPECT_TRUE(fs::exists(rank_dir + "/0_1000.tensor.swp"));
    EXPECT_TRUE(fs::exists(rank_dir + "/exp_avg-1000_2000.tensor.swp"));
    EXPECT_TRUE(fs::exists(rank_dir + "/exp_avg_sq-2000_2500.tensor.swp"));
    EXPECT_EQ(swap_files_in(dir.path), 9u);
  }
  EXPECT_EQ(swap_files_in(dir.path), 0u);
  EXPECT_FALSE(fs::exists(rank_dir));
}

TEST(OffloadedOptimizer, RangesAcrossSubGroupsReadAndWriteLikeOneBuffer) {
  TempDir dir("ranges");
  OffloadOptimizerConfig off;
  off.device = OffloadDevice::Nvme;
  off.ratio = 0.4;  // a resident prefix, then files
  OffloadedOptimizer a(off, AioConfig{}, adamw(), 5000, 700, /*hold_master=*/true, dir.path + "/r");
  const auto values = random_values(5000, 9);
  a.write("exp_avg", 0, 5000, values.data());
  std::vector<float> got(1234);
  a.read("exp_avg", 1999, 1234, got.data());  // crosses the resident/file boundary and three sub-groups
  EXPECT_EQ(std::memcmp(got.data(), values.data() + 1999, 1234 * 4), 0);
  const std::vector<float> patch(10, 42.0f);
  a.write("exp_avg", 695, 10, patch.data());  // straddles sub-groups 0 and 1
  a.read("exp_avg", 690, 20, got.data());
  EXPECT_EQ(got[4], values[694]);
  EXPECT_EQ(got[5], 42.0f);
  EXPECT_EQ(got[14], 42.0f);
  EXPECT_EQ(got[15], values[705]);
  a.read("exp_avg_sq", 4000, 10, got.data());  // never written: zeros
  EXPECT_EQ(got[0], 0.0f);
}

// The host tier is converted by the host thread (convert_on_host; on a GPU build a kernel could
// not read pageable host memory): the host loop gives convert_any's bits for every type pair,
// scale and accumulation, including values that round to even, overflow fp16 and are subnormal.
TEST(HostConversion, TheHostLoopGivesConvertAnysBitsForEveryTypePair) {
  const int64_t n = 4099;  // a tail after every vector width
  std::vector<float> source = random_values(n, 21);
  const float edges[] = {0.0f, -0.0f, 1.00390625f, 1.01171875f, 65504.0f, 70000.0f, -1e-40f, 6e-8f, 3e38f, 1e-30f};
  for (size_t i = 0; i < std::size(edges); ++i) source[i] = edges[i];
  const DType types[] = {DType::F32, DType::BF16, DType::F16};
  for (DType from : types)
    for (DType to : types)
      for (float scale : {1.0f, 0.37f})
        for (bool accumulate : {false, true}) {
          std::vector<char> src(n * dtype_size(from)), a(n * dtype_size(to)), b(n * dtype_size(to));
          convert_any(src.data(), from, source.data(), DType::F32, n);
          convert_any(a.data(), to, source.data(), DType::F32, n, 0.5f);  // a non-zero start to accumulate onto
          b = a;
          convert_any(a.data(), to, src.data(), from, n, scale, accumulate);
          convert_serial(b.data(), to, src.data(), from, n, scale, accumulate);
          EXPECT_EQ(a, b) << dtype_name(from) << " -> " << dtype_name(to) << " scale " << scale
                          << (accumulate ? " accumulating" : "");
        }
}

// The host tier's memory: zeroed, grown on demand (page-locked on a GPU build when asked).
TEST(HostBuffer, StartsZeroedAndGrowsToTheLargestRequest) {
  for (bool pinned : {false, true}) {
    kernels::HostBuffer b("test_host_buffer", 64, pinned);
    ASSERT_NE(b.data(), nullptr);
    EXPECT_EQ(b.size(), 64u);
    EXPECT_EQ(std::count(b.data(), b.data() + 64, 0), 64);
    char* same = b.grow(32);
    EXPECT_EQ(same, b.data());
    EXPECT_EQ(b.size(), 64u);
    b.grow(4096);
    EXPECT_EQ(b.size(), 4096u);
    std::vector<char> host(100, 7);
    EXPECT_EQ(kernels::host_view_of(b, host.data(), 100)[99], 7);  // model memory is host memory here
  }
}

// ---- the parameter tier ----------------------------------------------------------------

TEST(ParamSwapper, UnitsReadBackWhatWasWrittenAndTheCacheStaysWithinMaxInCpu) {
  TempDir dir("params");
  OffloadParamConfig cfg;
  cfg.device = OffloadDevice::Nvme;
  cfg.max_in_cpu = 1500;  // one slice and a half
  cfg.buffer_count = 2;
  // three unit slices and padding beyond the last one
  ParamSwapper sw(cfg, AioConfig{}, DType::BF16, {{0, 1000}, {1000, 1000}, {1000, 2500}}, dir.path + "/r");
  EXPECT_EQ(sw.swap_files().size(), 3u);
  EXPECT_EQ(swap_files_in(dir.path), 2u);  // the empty slice has no file
  std::vector<uint16_t> values(2600);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<uint16_t>(i * 7 + 1);
  sw.write(0, 2600, values.data());
  std::vector<uint16_t> got(2600, 0xFFFF);
  sw.read(0, 2600, got.data());
  EXPECT_EQ(std::memcmp(got.data(), values.data(), 2500 * 2), 0);
  EXPECT_EQ(got[2550], 0);  // padding reads as zeros
  EXPECT_TRUE(sw.prefetch(0));
  EXPECT_FALSE(sw.prefetch(2));  // 1000 + 1500 elements would exceed max_in_cpu
  const auto* u2 = static_cast<const uint16_t*>(sw.acquire(2));
  EXPECT_EQ(u2[0], values[1000]);
  EXPECT_LE(sw.cached_elems(), 1500);  // unit 0 was evicted for it
  const auto* u0 = static_cast<const uint16_t*>(sw.acquire(0));
  EXPECT_EQ(u0[999], values[999]);
  EXPECT_LE(sw.cached_elems(), 1500);
  // A write keeps a cached slice current.
  const uint16_t patch = 4242;
  sw.write(999, 1, &patch);
  EXPECT_EQ(static_cast<const uint16_t*>(sw.acquire(0))[999], 4242);
}

TEST(ParamSwapper, ASliceLargerThanBufferSizeIsRejectedNamingTheKey) {
  TempDir dir("bufsize");
  OffloadParamConfig cfg;
  cfg.buffer_size = 100;
  try {
    ParamSwapper sw(cfg, AioConfig{}, DType::F32, {{0, 50}, {50, 250}}, dir.path + "/r");
    FAIL() << "a 200-element slice fit a 100-element buffer";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("`zero_optimization.offload_param.buffer_size`: value 100"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("200 elements"), std::string::npos) << e.what();
  }
}

// ---- the estimator's tiers ---------------------------------------------------------------

TEST(OffloadEstimate, NvmeMovesTheOffloadedStatesOutOfTheTotalAndCpuOnlyRelabelsThem) {
  json j = with_zero({{"stage", 3}}, {{"bf16", {{"enabled", true}}}});
  const MemoryBudget none = estimate_budget(read_config(j, "cfg.json", 2), 2);
  j["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  j["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
  const MemoryBudget cpu = estimate_budget(read_config(j, "cfg.json", 2), 2);
  EXPECT_EQ(cpu.total(), none.total());  // host memory is this build's device memory
  EXPECT_EQ(cpu.offload_host, none.master + none.optimizer_states + none.params);
  j["zero_optimization"]["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", "/x"}};
  j["zero_optimization"]["offload_param"] = {{"device", "nvme"}, {"nvme_path", "/x"}};
  const MemoryBudget nvme = estimate_budget(read_config(j, "cfg.json", 2), 2);
  EXPECT_EQ(nvme.offload_nvme, none.master + none.optimizer_states + none.params);
  EXPECT_EQ(nvme.master + nvme.optimizer_states + nvme.params, 0);
  EXPECT_LT(nvme.model_states(), none.model_states());
  EXPECT_EQ(nvme.to_json()["nvme"], nvme.offload_nvme);
}
