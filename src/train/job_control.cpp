// job_control.cpp
#include "train/job_control.hpp"

#include <cblas.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

#include "base/errors.hpp"
#include "base/input_file.hpp"

namespace zero3d {

namespace {
volatile sig_atomic_t g_signal = 0;

void on_preemption_signal(int sig) {
  if (g_signal == 0) g_signal = sig;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

// The parent directory of a path ("a/b/c" -> "a/b", "c" -> ".", "/c" -> "/").
std::string parent_of(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : p.substr(0, slash);
}
}  // namespace

namespace {
constexpr int kPreemptionSignals[] = {SIGTERM, SIGUSR1};

void set_preemption_action(void (*handler)(int)) {
  for (int sig : kPreemptionSignals) {
    struct sigaction sa = {};
    sa.sa_handler = handler;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // MPI's and the filesystem's calls go on undisturbed
    sigaction(sig, &sa, nullptr);
  }
}

void mask_preemption_signals(int how) {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : kPreemptionSignals) sigaddset(&set, sig);
  pthread_sigmask(how, &set, nullptr);
}
}  // namespace

void hold_preemption_signals() {
  mask_preemption_signals(SIG_BLOCK);
  set_preemption_action(on_preemption_signal);
}

void accept_preemption_signals() {
  set_preemption_action(on_preemption_signal);
  mask_preemption_signals(SIG_UNBLOCK);
}

void default_preemption_signals() {
  set_preemption_action(SIG_DFL);
  mask_preemption_signals(SIG_UNBLOCK);
  if (g_signal != 0) raise(g_signal);
}

int preemption_signal() { return g_signal; }

std::string signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case SIGINT: return "SIGINT";
    default: return "signal " + std::to_string(sig);
  }
}

SchedulerTasks scheduler_tasks() {
  for (const char* var : {"PMI_SIZE", "PMIX_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
                          "PBS_NP"}) {
    const char* v = std::getenv(var);
    if (!v || !*v) continue;
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v, &end, 10);
    if (errno != 0 || *end != '\0' || n < 1) continue;  // unparsable: not evidence either way
    return {var, n};
  }
  return {};
}

void check_launch(int mpi_ranks) {
  const SchedulerTasks s = scheduler_tasks();
  if (mpi_ranks != 1 || s.tasks <= 1) return;
  throw InputError(s.variable + "=" + std::to_string(s.tasks) + " says this job has " + std::to_string(s.tasks) +
                   " tasks, but MPI reports 1 rank: the launcher did not connect the ranks (srun without PMI support — "
                   "try `srun --mpi=pmi2` — or an MPI library that does not match the launcher), so each task would "
                   "train alone into the same output. Launch with `srun --mpi=pmi2` or `mpiexec -np " +
                   std::to_string(s.tasks) + "`; for one rank on purpose, `srun -n 1` or `mpiexec -np 1`");
}

void check_writable_directory(const std::string& path, const std::string& key) {
  const std::string name = key + " " + echo(path, 200);
  std::string dir = path.empty() ? "." : path;
  struct stat st {};
  // The nearest existing ancestor: where the directory would be created.
  while (::stat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT && errno != ENOTDIR) throw InputError(name + ": " + echo(dir, 200) + ": " + std::strerror(errno));
    const std::string up = parent_of(dir);
    if (up == dir) break;
    dir = up;
  }
  if (!S_ISDIR(st.st_mode))
    throw InputError(name + ": " + (dir == path ? std::string("exists and is not a directory")
                                                : echo(dir, 200) + " is not a directory, so it cannot be created"));
  // access() lies for root and on some network filesystems: create a file to know.
  std::string probe = dir + "/.zero3d-write-test-XXXXXX";
  std::vector<char> buf(probe.begin(), probe.end());
  buf.push_back('\0');
  const int fd = ::mkstemp(buf.data());
  if (fd < 0)
    throw InputError(name + ": not writable (" + (dir == path ? std::string() : "creating it in " + echo(dir, 200) + ": ") +
                     std::strerror(errno) + ")");
  ::close(fd);
  ::unlink(buf.data());
}

namespace {
constexpr const char* kLockFile = ".zero3d.lock";
}  // namespace

void check_output_directory_is_ours(const std::string& dir) {
  struct stat st {};
  if (::stat((dir + "/" + kLockFile).c_str(), &st) == 0) return;  // a zero3d run's directory: its files are runs'
  for (const char* name : {"config.json", "metrics.jsonl", "flops_profile.json", "trace.json", "comms_logger.json"})
    if (::lstat((dir + "/" + name).c_str(), &st) == 0)
      throw InputError("output directory " + echo(dir, 200) + ": holds " + name + ", but no zero3d run wrote there (no " +
                       kLockFile + "), and a run writes its own " + name +
                       " there. Give this run a new or empty directory (--output or training.output_dir)");
}

OutputDirLock::OutputDirLock(const std::string& dir) {
  const std::string path = dir + "/" + kLockFile;
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw InputError(echo(path, 200) + ": cannot open the output directory's lock: " + std::strerror(errno));
  struct flock fl = {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  if (::fcntl(fd_, F_SETLK, &fl) != 0) {
    const int err = errno;
    if (err == EACCES || err == EAGAIN) {
      char holder[512] = {};
      const ssize_t n = ::pread(fd_, holder, sizeof(holder) - 1, 0);
      std::string who = n > 0 ? std::string(holder, static_cast<size_t>(n)) : std::string("another process");
      while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
      ::close(fd_);
      fd_ = -1;
      throw InputError("output directory " + echo(dir, 200) + " is in use by a running zero3d job (" + echo(who, 300) +
                       "); give this run its own --output (or training.output_dir), or wait for that job to end");
    }
    ::close(fd_);
    fd_ = -1;
    note_ = "output directory " + dir + " is not locked (this filesystem cannot lock: " + std::strerror(err) +
            "); make sure no other job writes into it";
    return;
  }
  char when[64] = {};
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  std::string who = "pid " + std::to_string(::getpid()) + " on host " + host_name();
  for (const char* job : {"SLURM_JOB_ID", "PBS_JOBID"})
    if (const char* id = std::getenv(job)) who += ", job " + std::string(id);
  who += ", since " + std::string(when) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, who.data(), who.size(), 0) != static_cast<ssize_t>(who.size()))
    note_ = "output directory lock " + path + ": could not record the holder (" + std::strerror(errno) + ")";
}

OutputDirLock::~OutputDirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the lock
}

int blas_threads_per_rank() { return openblas_get_num_threads(); }

std::string oversubscription_note(int threads, int ranks, int cores) {
  if (cores <= 0 || static_cast<int64_t>(threads) * ranks <= cores) return "";
  const std::string head = std::to_string(ranks) + " ranks on this node";
  if (ranks > cores)  // one BLAS thread each is still more than the cores
    return head + " > " + std::to_string(cores) + " cores" +
           (threads > 1 ? " (and " + std::to_string(threads) + " BLAS threads per rank)" : "") +
           ": oversubscribed, ranks wait for a core in every matrix product and collective; run at most " +
           std::to_string(cores) + " ranks per node" + (threads > 1 ? " with OPENBLAS_NUM_THREADS=1" : "");
  return "BLAS uses " + std::to_string(threads) + " threads per rank x " + head + " = " +
         std::to_string(threads * ranks) + " > " + std::to_string(cores) +
         " cores: oversubscribed, which slows every matrix product; set OPENBLAS_NUM_THREADS=" +
         std::to_string(std::max(1, cores / ranks));
}

}  // namespace zero3d
