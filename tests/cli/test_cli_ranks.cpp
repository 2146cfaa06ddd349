// test_cli_ranks.cpp — ranks that disagree and ranks that die (issue 20, items 8 and 10):
// MPMD launches with a different config per rank, and a rank SIGKILLed or SIGSTOPped
// mid-step while the other waits for it in a collective.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <dirent.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "support/background_job.hpp"
#include "support/cli_helpers.hpp"

using json = nlohmann::json;
using namespace cli;

namespace {

// `mpiexec -np 1 zero3d ARGS_A : -np 1 zero3d ARGS_B` (one config per rank).
Result run_mpmd(const std::string& args_a, const std::string& args_b) {
  const std::string out = temp_path("ranks_mpmd_stdout.txt"), err = temp_path("ranks_mpmd_stderr.txt");
  const std::string cmd = "timeout 120 " + kMpiexec + " -np 1 " + kExe + " " + args_a + " : -np 1 " + kExe + " " + args_b;
  const int status = std::system((cmd + " >" + out + " 2>" + err).c_str());
  return Result{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

json small_config(int64_t steps) {
  json j = tiny_config();
  j["training"]["steps"] = steps;
  return j;
}

// ---- item 8: ranks with different configurations ------------------------------------------

TEST(Ranks, DifferentLayerCountsAreRejectedNamingTheKey) {
  json a = small_config(2), b = small_config(2);
  b["model"]["n_layer"] = 3;
  const std::string dir = temp_path("ranks_layers");
  std::system(("rm -rf " + dir).c_str());
  Result r = run_mpmd("train " + write_config("ranks_a.json", a) + " --output " + dir,
                      "train " + write_config("ranks_b.json", b) + " --output " + dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("ranks disagree on the configuration: model.n_layer is 2 on rank 0 but 3 on rank 1"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(count(r.err, "zero3d:"), 1u) << r.err;
  EXPECT_TRUE(read_metrics(dir).empty()) << "no step may run";
}

TEST(Ranks, DifferentWidthsAtStageTwoAreRejectedNamingTheKey) {
  json a = small_config(2);
  a["zero_optimization"] = {{"stage", 2}};
  json b = a;
  b["model"]["n_embd"] = 64;
  Result r = run_mpmd("train " + write_config("ranks_a.json", a) + " --output " + temp_path("ranks_width"),
                      "train " + write_config("ranks_b.json", b) + " --output " + temp_path("ranks_width"));
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("model.n_embd is 32 on rank 0 but 64 on rank 1"), std::string::npos) << r.err;
}

TEST(Ranks, TheFirstDifferingKeyInKeyOrderIsNamed) {
  json a = small_config(2), b = small_config(2);
  b["optimizer"]["params"]["lr"] = 2e-3;
  Result r = run_mpmd("train " + write_config("ranks_a.json", a) + " --output " + temp_path("ranks_lr"),
                      "train " + write_config("ranks_b.json", b) + " --output " + temp_path("ranks_lr") +
                          " --set training.seed=8");
  EXPECT_EQ(r.code, 2) << r.err;
  // keys in sorted order: optimizer.* comes before training.seed
  EXPECT_NE(r.err.find("optimizer.params.lr is 0.001 on rank 0 but 0.002 on rank 1"), std::string::npos) << r.err;
}

TEST(Ranks, PerRankKeysMayDifferAndTheRunTrains) {
  // output_dir (only rank 0 writes there), peak_gflops (each rank's own) and comms_timeout
  // may differ; so may the config's file name.
  json a = small_config(2), b = small_config(2);
  b["training"]["peak_gflops"] = 80;
  b["training"]["comms_timeout"] = 600;
  const std::string dir = temp_path("ranks_same");
  std::system(("rm -rf " + dir).c_str());
  Result r = run_mpmd("train " + write_config("ranks_same_a.json", a) + " --output " + dir,
                      "train " + write_config("ranks_same_b.json", b) + " --output " + temp_path("ranks_same_other"));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(read_metrics(dir).size(), 2u);
}

TEST(Ranks, InitFromIsComparedByContentNotByPath) {
  // weights to start from: one step, saved and converted
  const std::string dir = temp_path("ranks_init_src");
  std::system(("rm -rf " + dir).c_str());
  json src = small_config(1);
  src["training"]["save_interval"] = 1;
  ASSERT_EQ(run("train " + write_config("ranks_init_src.json", src) + " --output " + dir).code, 0);
  const std::string w1 = temp_path("ranks_init_1.safetensors"), w2 = temp_path("ranks_init_2.safetensors");
  Result c = run("convert " + dir + "/checkpoints " + w1 + " --format safetensors");
  ASSERT_EQ(c.code, 0) << c.err;
  std::string bytes = read_file(w1);
  ASSERT_GT(bytes.size(), 1000u);
  std::ofstream(w2, std::ios::binary) << bytes;

  json a = small_config(1), b = small_config(1);
  a["model"]["init_from"] = w1;
  b["model"]["init_from"] = w2;
  Result same = run_mpmd("train " + write_config("ranks_init_a.json", a) + " --output " + temp_path("ranks_init_ok"),
                         "train " + write_config("ranks_init_b.json", b) + " --output " + temp_path("ranks_init_ok"));
  EXPECT_EQ(same.code, 0) << "the same bytes at another path: " << same.err;

  bytes[bytes.size() - 3] ^= 0x40;  // one weight differs
  std::ofstream(w2, std::ios::binary | std::ios::trunc) << bytes;
  Result differ = run_mpmd("train " + write_config("ranks_init_a.json", a) + " --output " + temp_path("ranks_init"),
                           "train " + write_config("ranks_init_b.json", b) + " --output " + temp_path("ranks_init"));
  EXPECT_EQ(differ.code, 2) << differ.err;
  EXPECT_NE(differ.err.find("ranks disagree on the configuration: model.init_from (file content digest) is \""),
            std::string::npos)
      << differ.err;
}

// ---- item 10: a rank that dies or stops ------------------------------------------------------

void expect_no_backtrace(const std::string& err) {
  EXPECT_EQ(err.find("backtrace"), std::string::npos) << err;
  EXPECT_EQ(err.find("libucs"), std::string::npos) << err;
  EXPECT_EQ(err.find("BAD TERMINATION"), std::string::npos) << err;
}

TEST(Ranks, ASigkilledRankIsNamedAndTheJobExitsOne) {
  // rank 1 sits still at step 2 (ZERO3D_FAULT) while rank 0 waits for it in a collective
  BackgroundJob job("ranks_kill_stalled", small_config(5), "ZERO3D_FAULT=stall:1:2");
  ASSERT_TRUE(job.wait_for_rows(1, 60)) << read_file(job.err_file);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int pid = job.rank_pid(1);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  const auto t0 = Clock::now();
  const int rc = job.wait(30);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  const std::string err = read_file(job.err_file);
  EXPECT_EQ(rc, 1) << err;
  EXPECT_LT(took, 10.0);
  EXPECT_NE(err.find("zero3d: rank 1 (pid " + std::to_string(pid) + ", host "), std::string::npos) << err;
  EXPECT_NE(err.find("ended without a message (killed by signal 9"), std::string::npos) << err;
  EXPECT_NE(err.find("during step "), std::string::npos) << err;  // the step in progress (note_step)
  expect_no_backtrace(err);
}

TEST(Ranks, ARankSigkilledWhileBothCommunicateIsNamed) {
  // no stall: the survivor may be in the middle of a transfer from the rank that dies
  json j = small_config(1000000);
  BackgroundJob job("ranks_kill_busy", j);
  ASSERT_TRUE(job.wait_for_rows(3, 60)) << read_file(job.err_file);
  const int pid = job.rank_pid(0);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  const int rc = job.wait(30);
  const std::string err = read_file(job.err_file);
  EXPECT_EQ(rc, 1) << err;
  EXPECT_NE(err.find("zero3d: rank 0 (pid " + std::to_string(pid) + ", host "), std::string::npos) << err;
  expect_no_backtrace(err);
}

TEST(Ranks, AStoppedRankEndsTheJobWithinTheTimeoutNamingIt) {
  json j = small_config(1000000);
  j["training"]["comms_timeout"] = 5;
  BackgroundJob job("ranks_stop", j);
  ASSERT_TRUE(job.wait_for_rows(2, 60)) << read_file(job.err_file);
  const int pid = job.rank_pid(1);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(kill(pid, SIGSTOP), 0);
  const auto t0 = Clock::now();
  const int rc = job.wait(30);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  if (rc < 0) kill(pid, SIGKILL);  // do not leave it behind
  const std::string err = read_file(job.err_file);
  EXPECT_EQ(rc, 1) << err;
  EXPECT_LT(took, 20.0);
  EXPECT_NE(err.find("rank 1 (pid " + std::to_string(pid) + ", host "), std::string::npos) << err;
  EXPECT_NE(err.find("is stopped"), std::string::npos) << err;
  EXPECT_NE(err.find("training.comms_timeout 5.0 s"), std::string::npos) << err;
  expect_no_backtrace(err);
}

}  // namespace
