// background_job.hpp — a training job started in the background, for tests that act on it while
// it runs (kill or stop a rank, send the scheduler's warning signal, start a second job).
#pragma once

#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "support/cli_helpers.hpp"

namespace cli {

using Clock = std::chrono::steady_clock;

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// `mpiexec -np NP zero3d train CONFIG --output DIR ARGS`, bounded by `timeout 120`; stdout and
// stderr go to DIR.out and DIR.err. keep_dir: do not clear DIR first (a job that resumes).
struct BackgroundJob {
  std::string dir, rc_file, out_file, err_file;

  BackgroundJob(const std::string& name, const json& config, const std::string& env = "", int np = 2,
                const std::string& args = "", bool keep_dir = false) {
    dir = temp_path(name);
    if (!keep_dir) std::system(("rm -rf " + dir).c_str());
    rc_file = dir + ".rc";
    out_file = dir + ".out";
    err_file = dir + ".err";
    std::remove(rc_file.c_str());
    const std::string cfg = write_config(name + ".json", config);
    const std::string cmd = "(" + env + (env.empty() ? "" : " ") + "timeout -k 10 120 " + kMpiexec + " -np " +
                            std::to_string(np) + " " + kExe + " train " + cfg + " --output " + dir + " " + args + " >" +
                            out_file + " 2>" + err_file + "; echo $? >" + rc_file + ".tmp; mv " + rc_file + ".tmp " +
                            rc_file + ") &";
    std::system(cmd.c_str());
  }

  // The exit code, or -1 if the job has not ended within `seconds`.
  int wait(double seconds) const {
    const auto end = Clock::now() + std::chrono::duration<double>(seconds);
    while (Clock::now() < end) {
      std::ifstream in(rc_file);
      int rc = -1;
      if (in >> rc) return rc;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return -1;
  }

  // Complete rows only: rank 0 may be writing the next one while the job runs.
  size_t metrics_rows() const {
    const std::string text = read_file(dir + "/metrics.jsonl");
    return static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
  }

  // Waits until rank 0 has logged `rows` steps (false after `seconds`).
  bool wait_for_rows(size_t rows, double seconds) const {
    const auto end = Clock::now() + std::chrono::duration<double>(seconds);
    while (Clock::now() < end) {
      if (metrics_rows() >= rows) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  // The pid of the process doing rank `rank`'s work: a process of this job (its command line
  // names `dir`) with PMI_RANK=rank in its environment; where there are two (zero3d's
  // supervisor and its worker) the one whose parent is also one.
  int rank_pid(int rank) const {
    struct Proc {
      int pid, ppid;
    };
    std::vector<Proc> found;
    DIR* proc = opendir("/proc");
    if (!proc) return -1;
    while (dirent* e = readdir(proc)) {
      const int pid = std::atoi(e->d_name);
      if (pid <= 0) continue;
      const std::string base = "/proc/" + std::string(e->d_name);
      const std::string cmdline = read_file(base + "/cmdline");
      if (cmdline.find(dir) == std::string::npos || cmdline.find(kExe) != 0) continue;  // not mpiexec/timeout
      const std::string env = read_file(base + "/environ");
      if (env.find(std::string("PMI_RANK=") + std::to_string(rank) + '\0') == std::string::npos) continue;
      const std::string stat = read_file(base + "/stat");
      const size_t p = stat.rfind(')');
      int ppid = 0;
      if (p != std::string::npos) std::sscanf(stat.c_str() + p + 2, "%*c %d", &ppid);
      found.push_back({pid, ppid});
    }
    closedir(proc);
    for (const Proc& a : found)
      for (const Proc& b : found)
        if (a.ppid == b.pid) return a.pid;
    return found.size() == 1 ? found[0].pid : -1;
  }
};

}  // namespace cli
