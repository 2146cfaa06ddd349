// cli_helpers.hpp — running the zero3d executable from black-box tests (test_cli*.cpp).
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

using json = nlohmann::json;

namespace cli {

// The build's paths, unless the environment names others (ZERO3D_TEST_EXE, ZERO3D_TEST_MPIEXEC,
// ZERO3D_TEST_SOURCE_DIR): a test binary carried to another machine (the GPU checks,
// benchmarks/gpu_check.sh) runs the zero3d, launcher and source tree it finds there.
inline std::string build_path(const char* variable, const char* built) {
  const char* given = std::getenv(variable);
  return given != nullptr && *given != '\0' ? given : built;
}
inline const std::string kExe = build_path("ZERO3D_TEST_EXE", ZERO3D_EXE);
inline const std::string kMpiexec = build_path("ZERO3D_TEST_MPIEXEC", ZERO3D_MPIEXEC);
inline const std::string kSource = build_path("ZERO3D_TEST_SOURCE_DIR", ZERO3D_SOURCE_DIR);

struct Result {
  int code;
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The names of path's subdirectories (an autotuner's results_dir holds one per experiment).
inline std::vector<std::string> subdirectories(const std::string& path) {
  std::vector<std::string> out;
  if (DIR* d = opendir(path.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != ".." && e->d_type == DT_DIR) out.push_back(n);
    }
    closedir(d);
  }
  return out;
}

// One directory per test process (ctest runs each test in its own), so test binaries of two
// build trees, or a developer's run beside CI, never share files; removed when the process ends.
inline std::string temp_path(const std::string& name) {
  struct Dir {
    std::string path = ::testing::TempDir() + "zero3d_cli_" + std::to_string(::getpid());
    Dir() { std::system(("mkdir -p " + path).c_str()); }
    ~Dir() { std::system(("rm -rf " + path).c_str()); }
  };
  static const Dir dir;
  return dir.path + "/" + name;
}

// Runs `EXE ARGS` on `np` ranks (np 0: without mpiexec). `prefix` goes before the launch:
// environment assignments (VAR=value) or a wrapper such as `timeout 60`.
inline Result run_exe(const std::string& exe, const std::string& args, int np = 0, const std::string& prefix = "") {
  const std::string out = temp_path("stdout.txt"), err = temp_path("stderr.txt");
  std::string cmd = prefix + (prefix.empty() ? "" : " ") + (np > 0 ? kMpiexec + " -np " + std::to_string(np) + " " : "") +
                    exe + " " + args;
  int status = std::system((cmd + " >" + out + " 2>" + err).c_str());
  return Result{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}
// The same with zero3d itself.
inline Result run(const std::string& args, int np = 0, const std::string& prefix = "") {
  return run_exe(kExe, args, np, prefix);
}

inline std::string write_config(const std::string& name, const json& j) {
  const std::string path = temp_path(name);
  std::ofstream(path) << j.dump(2);
  return path;
}

// The model of tiny_config and of the CLI goldens (V=64, T=16, L=2, H=2, C=32), loaded from
// `init_from` when one is given.
inline json tiny_model(const std::string& init_from = "") {
  json m = {{"vocab_size", 64}, {"n_positions", 16}, {"n_layer", 2}, {"n_head", 2}, {"n_embd", 32}};
  if (!init_from.empty()) m["init_from"] = init_from;
  return m;
}

inline json tiny_config() {
  return json{{"train_batch_size", 8},
              {"train_micro_batch_size_per_gpu", 4},
              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
              {"model", tiny_model()},
              {"training", {{"steps", 5}, {"seed", 7}, {"peak_gflops", 50}}}};
}

inline std::vector<json> read_metrics(const std::string& dir) {
  std::vector<json> rows;
  std::ifstream in(dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) rows.push_back(json::parse(line));
  return rows;
}

inline size_t count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t p = haystack.find(needle); p != std::string::npos; p = haystack.find(needle, p + 1)) ++n;
  return n;
}

// Parameters of the ZeRO tests' model (test_cli.cpp zero_config: V=61, T=16, L=2, C=32):
// 61·32 + 16·32 + 2·12,704 + 64. Vocab 61 keeps it from dividing evenly once padded per rank.
inline constexpr int64_t kZeroPsi = 27936;

// ZeRO's split of psi elements over np ranks: padded to a multiple of 2·np, np equal parts.
struct ZeroSplit {
  int64_t padded, part;
};
inline ZeroSplit zero_split(int64_t psi, int np) {
  const int64_t padded = (psi + 2 * np - 1) / (2 * np) * (2 * np);
  return {padded, padded / np};
}

// Trains `config` on np ranks into `dir` with extra arguments (`--set ...`) and returns the
// last step's metrics record (null, with a test failure, when the run fails).
inline json last_metrics(const std::string& config, int np, const std::string& dir, const std::string& args) {
  const Result r = run("train " + config + " --output " + dir + " " + args, np);
  EXPECT_EQ(r.code, 0) << r.err;
  const std::vector<json> rows = read_metrics(dir);
  return r.code == 0 && !rows.empty() ? rows.back() : json();
}

// The loss of every metrics record, in order.
inline std::vector<double> losses_of(const std::vector<json>& rows) {
  std::vector<double> out;
  for (const json& row : rows) out.push_back(row.at("loss").get<double>());
  return out;
}

// Step by step, |got − want| ≤ rel·|want|.
inline void expect_losses_close(const std::vector<double>& got, const std::vector<double>& want, double rel,
                                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_LE(std::fabs(got[i] - want[i]), rel * std::fabs(want[i])) << what << " step " << i + 1;
}

// Bad input: exit 2, one line, holding `message`.
inline void expect_one_line_rejection(const Result& r, const std::string& message) {
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  EXPECT_EQ(count(r.err, "\n"), 1u) << r.err;
}

}  // namespace cli
