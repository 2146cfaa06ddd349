// failure.cpp
#include "base/failure.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstddef>
#include <random>
#include <fstream>
#include <new>
#include <thread>

#include "base/errors.hpp"

namespace zero3d {

void agree_on_failure(MPI_Comm comm, std::exception_ptr local) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  int code = kExitOk;
  std::string message;
  if (local) {
    try {
      std::rethrow_exception(local);
    } catch (const InputError& e) {
      code = kExitBadInput;
      message = e.what();
    } catch (const std::exception& e) {
      code = kExitSystem;
      message = e.what();
    } catch (...) {
      code = kExitSystem;
      message = "unknown exception";
    }
  }
  // first failing rank (MIN) and the worst exit code (MAX: a system failure beats bad input)
  int first = local ? rank : INT_MAX, worst = code;
  MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, comm);
  MPI_Allreduce(MPI_IN_PLACE, &worst, 1, MPI_INT, MPI_MAX, comm);
  if (first == INT_MAX) return;
  throw AgreedFailure(rank == first ? message : "", worst, first, rank == first);
}

// ---- ranks that die (failure.hpp) ----------------------------------------------------------

namespace {

// Written by the worker, read by its supervisor once the worker is dead. Text is copied in
// (a pointer into the worker's heap would mean nothing to the supervisor); relaxed atomics
// keep concurrent writers from different threads well defined.
constexpr size_t kText = 48;
struct Text {
  std::atomic<char> c[kText];
  void set(const char* s) {
    size_t i = 0;
    for (; s && s[i] && i + 1 < kText; ++i) c[i].store(s[i], std::memory_order_relaxed);
    c[i].store('\0', std::memory_order_relaxed);
  }
  std::string get() const {
    std::string out;
    for (size_t i = 0; i + 1 < kText; ++i) {
      const char ch = c[i].load(std::memory_order_relaxed);
      if (!ch) break;
      out += ch;
    }
    return out;
  }
};
struct RankRecord {
  Text phase;
  Text last_op;                // the last communication begun
  std::atomic<bool> in_op;     // ... and still in progress
  std::atomic<int64_t> step;   // the training step in progress, or -1
  std::atomic<int64_t> ops;    // communications begun
  std::atomic<int> reported_exit;  // the exit code main() has printed its message for, or -1
  void reset() {
    phase.set("start-up");
    last_op.set("");
    in_op = false;
    step = -1;
    ops = 0;
    reported_exit = -1;
  }
};
static_assert(std::atomic<char>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free &&
                  std::atomic<bool>::is_always_lock_free && std::atomic<int>::is_always_lock_free,
              "the record is shared between processes");

RankRecord g_local;                // without a supervisor (zero-initialised: "start-up")
RankRecord* g_record = &g_local;  // or the page shared with the supervisor
std::vector<RankIdentity> g_identities;
uint64_t g_job_key = 0;  // exchange_rank_identities: the same on every rank of the job

RankRecord& record() { return *g_record; }

volatile sig_atomic_t g_forwarded = 0;
volatile pid_t g_worker = 0;

void forward_signal(int sig) {
  g_forwarded = sig;
  if (g_worker > 0) kill(g_worker, sig);
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

// Text built without allocating, for a signal handler: appends to a fixed buffer, truncating.
struct SafeText {
  char buf[512];
  size_t n = 0;
  SafeText& add(const char* s) {
    for (; s && *s && n + 1 < sizeof buf; ++s) buf[n++] = *s;
    buf[n] = '\0';
    return *this;
  }
  SafeText& add(int64_t v) {
    char digits[24];
    int k = 0;
    const bool negative = v < 0;
    uint64_t u = negative ? uint64_t(0) - uint64_t(v) : uint64_t(v);
    do {
      digits[k++] = char('0' + u % 10);
      u /= 10;
    } while (u > 0);
    if (negative) add("-");
    while (k > 0 && n + 1 < sizeof buf) buf[n++] = digits[--k];
    buf[n] = '\0';
    return *this;
  }
  SafeText& add(const Text& t) {
    for (size_t i = 0; i + 1 < kText && n + 1 < sizeof buf; ++i) {
      const char ch = t.c[i].load(std::memory_order_relaxed);
      if (!ch) break;
      buf[n++] = ch;
    }
    buf[n] = '\0';
    return *this;
  }
};

// " during step 3, in all_reduce #57": what the record says the rank was doing.
void add_where(SafeText& t, const RankRecord& r) {
  const int64_t step = r.step.load();
  t.add(" during ");
  if (step > 0) t.add("step ").add(step);
  else if (r.phase.c[0].load()) t.add(r.phase);
  else t.add("start-up");
  if (r.last_op.c[0].load()) t.add(r.in_op.load() ? ", in " : ", after ").add(r.last_op).add(" #").add(r.ops.load());
}

std::string where(const RankRecord& r) {
  const int64_t step = r.step.load();
  const std::string phase = r.phase.get();
  std::string s = " during " + (step > 0 ? "step " + std::to_string(step) : phase.empty() ? "start-up" : phase);
  const std::string op = r.last_op.get();
  if (!op.empty()) s += (r.in_op.load() ? ", in " : ", after ") + op + " #" + std::to_string(r.ops.load());
  return s;
}

// Asks the launcher to end the job with `code` whatever the other ranks' statuses: exiting is
// not enough, since hydra's proxy records the status of a survivor it SIGKILLs while it still
// reads that survivor's output, and mpiexec then exits 9 about half of the time. An abort over
// the rank's PMI connection (what MPI_Abort sends; a supervisor and its worker share it since
// the fork) makes mpiexec exit with the given code. False without one. Async-signal-safe.
bool abort_over_pmi(int code) {
  const char* fd = std::getenv("PMI_FD");
  if (!fd) return false;
  SafeText cmd;
  cmd.add("cmd=abort exitcode=").add(int64_t(code)).add("\n");
  return write(std::atoi(fd), cmd.buf, cmd.n) == static_cast<ssize_t>(cmd.n);
}

[[noreturn]] void abort_job_over_pmi() {
  abort_over_pmi(kExitSystem);
  _exit(kExitSystem);
}

[[noreturn]] void supervise(pid_t worker, int rank) {
  sigset_t forwarded;
  sigemptyset(&forwarded);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2}) {
    struct sigaction sa = {};
    sa.sa_handler = forward_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(sig, &sa, nullptr);
    sigaddset(&forwarded, sig);
  }
  // Signals held since main() began (job_control.hpp) reach the worker now.
  sigprocmask(SIG_UNBLOCK, &forwarded, nullptr);
  int status = 0;
  while (waitpid(worker, &status, 0) < 0) {
    if (errno != EINTR) _exit(kExitSystem);
  }
  if (WIFEXITED(status)) {
    const int code = WEXITSTATUS(status);
    if (code == 0 || g_record->reported_exit.load() == code) _exit(code);
    // Ended with a failure code that no zero3d message explains. As below, a moment first, so
    // that a rank whose death caused this one is the one named.
    sleep(1);
    SafeText t;
    t.add("zero3d: rank ").add(int64_t(rank)).add(" (pid ").add(int64_t(worker)).add(", host ");
    t.add(host_name().c_str()).add(") exited with code ").add(int64_t(code)).add(" without a message");
    add_where(t, *g_record);
    t.add("\n");
    std::fputs(t.buf, stderr);
    std::fflush(stderr);
    usleep(300 * 1000);  // the launcher forwards output and the abort on separate paths
    abort_job_over_pmi();
  }
  const int sig = WIFSIGNALED(status) ? WTERMSIG(status) : SIGKILL;
  if (sig == g_forwarded) {  // a signal meant for the whole rank: die of it too, silently
    signal(sig, SIG_DFL);
    raise(sig);
    _exit(128 + sig);
  }
  // A rank killed outright speaks at once. Any other signal (SIGABRT, SIGSEGV) may be the
  // consequence of a peer's death (UCX aborts a survivor that was reading the dead rank's
  // memory): wait a moment so that the first rank to die is the one named — the launcher
  // ends this one quietly once that rank's supervisor has aborted the job.
  if (sig != SIGKILL) sleep(1);
  const char* name = strsignal(sig);
  std::fprintf(stderr, "zero3d: rank %d (pid %d, host %s) ended without a message (killed by signal %d, %s)%s\n", rank,
               static_cast<int>(worker), host_name().c_str(), sig, name ? name : "?", where(*g_record).c_str());
  std::fflush(stderr);
  usleep(300 * 1000);  // the launcher forwards output and the abort on separate paths
  abort_job_over_pmi();
}

// The worker's parent-death signal: its supervisor is gone without waiting for it, which only
// a signal the supervisor cannot handle (SIGKILL) does. Prepared before the handler can run.
SafeText g_orphan_line;  // "zero3d: rank 1 (pid 4242, host node7): its launched process (pid 4241), which supervises it,"

void on_supervisor_gone(int) {
  // A launcher ending the whole job kills this process within moments: then nothing is news.
  usleep(500 * 1000);
  SafeText t = g_orphan_line;
  t.add(" was killed");
  add_where(t, *g_record);
  t.add("; ending the job\n");
  if (write(STDERR_FILENO, t.buf, t.n) < 0) {
  }
  usleep(300 * 1000);
  abort_job_over_pmi();
}

}  // namespace

void supervise_rank(char** argv) {
  const char* size = std::getenv("PMI_SIZE");
  const char* rank = std::getenv("PMI_RANK");
  const char* off = std::getenv("ZERO3D_SUPERVISE");
  if (!size || !rank || std::atoi(size) < 2 || (off && std::strcmp(off, "0") == 0)) return;
  // A survivor that was copying from the dead rank's memory (UCX's CMA transport) dies in
  // UCX's fatal-error path, which by default prints a 30-line backtrace; with
  // UCX_HANDLE_ERRORS=none one line, and this rank's supervisor then defers to the dead
  // rank's (see supervise()). UCX reads the variable in a library constructor, before
  // main(), so it takes a re-exec of this same process (same pid, same launcher child) to
  // set it. `export UCX_HANDLE_ERRORS=bt` keeps UCX's backtraces.
  if (!std::getenv("UCX_HANDLE_ERRORS") && argv && argv[0]) {
    // the executable's own path, so that the process keeps its name (`ps`, `pkill zero3d`)
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
      exe[n] = '\0';
      setenv("UCX_HANDLE_ERRORS", "none", 1);
      execv(exe, argv);  // returns only on failure: go on with UCX's default
      unsetenv("UCX_HANDLE_ERRORS");
    }
  }
  void* page = mmap(nullptr, sizeof(RankRecord), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) return;
  auto* shared = new (page) RankRecord();
  shared->reset();
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child < 0) {  // no supervisor then
    munmap(page, sizeof(RankRecord));
    return;
  }
  g_record = shared;
  if (child > 0) {
    g_worker = child;
    supervise(child, std::atoi(rank));
  }
  g_orphan_line.add("zero3d: rank ").add(int64_t(std::atoi(rank))).add(" (pid ").add(int64_t(getpid()));
  g_orphan_line.add(", host ").add(host_name().c_str()).add("): its launched process (pid ").add(int64_t(parent));
  g_orphan_line.add("), which supervises it,");
  const int orphan_signal = SIGRTMIN + 8;  // real-time: nothing else (MPI, UCX, the launcher) sends it
  struct sigaction sa = {};
  sa.sa_handler = on_supervisor_gone;
  sigemptyset(&sa.sa_mask);
  sigaction(orphan_signal, &sa, nullptr);
  prctl(PR_SET_PDEATHSIG, orphan_signal);
  if (getppid() != parent) on_supervisor_gone(orphan_signal);  // the supervisor died before prctl
}

void note_exit(int code) { record().reported_exit.store(code); }

void fault_pause_point(const char* point) {
  const char* spec = std::getenv("ZERO3D_FAULT");
  if (!spec) return;
  int rank = -1;
  char at[16] = {};
  if (std::sscanf(spec, "startup_pause:%d:%15[a-z]", &rank, at) != 2 || std::strcmp(at, point) != 0) return;
  const char* mine = std::getenv("PMI_RANK");
  if (rank == (mine ? std::atoi(mine) : 0)) raise(SIGSTOP);
}

void note_phase(const char* phase) { record().phase.set(phase); }
void note_step(int64_t step) { record().step.store(step, std::memory_order_relaxed); }

void note_comm_begin(const char* op) {
  RankRecord& r = record();
  r.ops.fetch_add(1, std::memory_order_relaxed);
  r.last_op.set(op);
  r.in_op.store(true, std::memory_order_relaxed);
}

void note_comm_end() { record().in_op.store(false, std::memory_order_relaxed); }

void exchange_rank_identities(MPI_Comm world) {
  // The job's name for first_to_report(): rank 0's pid, start time and a random draw.
  uint64_t key = (uint64_t(getpid()) << 32) ^ uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                 uint64_t(std::random_device{}());
  MPI_Bcast(&key, 1, MPI_UINT64_T, 0, world);
  g_job_key = key;
  constexpr int kHost = 64;
  struct Entry {
    int pid;
    char host[kHost];
  } mine = {};
  mine.pid = static_cast<int>(getpid());
  std::strncpy(mine.host, host_name().c_str(), kHost - 1);
  int size = 1;
  MPI_Comm_size(world, &size);
  std::vector<Entry> all(static_cast<size_t>(size));
  MPI_Allgather(&mine, sizeof(Entry), MPI_BYTE, all.data(), sizeof(Entry), MPI_BYTE, world);
  g_identities.clear();
  for (const Entry& e : all) g_identities.push_back({e.pid, std::string(e.host, strnlen(e.host, kHost))});
}

const std::vector<RankIdentity>& rank_identities() { return g_identities; }

std::string describe_rank(int rank) {
  if (rank < 0 || rank >= static_cast<int>(g_identities.size())) return "rank " + std::to_string(rank);
  const RankIdentity& id = g_identities[static_cast<size_t>(rank)];
  return "rank " + std::to_string(rank) + " (pid " + std::to_string(id.pid) + ", host " + id.host + ")";
}

std::string local_peer_trouble(int self) {
  if (g_identities.empty()) return "";
  const std::string here = host_name();
  std::string out;
  for (int r = 0; r < static_cast<int>(g_identities.size()); ++r) {
    const RankIdentity& id = g_identities[static_cast<size_t>(r)];
    if (r == self || id.host != here || id.pid <= 0) continue;
    std::string state;
    if (kill(id.pid, 0) != 0 && errno == ESRCH) {
      state = "has ended";
    } else {
      // /proc/PID/stat: "pid (comm) S ..." — the state follows the last ')'
      std::ifstream in("/proc/" + std::to_string(id.pid) + "/stat");
      std::string line;
      std::getline(in, line);
      const size_t p = line.rfind(')');
      const char st = p != std::string::npos && p + 2 < line.size() ? line[p + 2] : '?';
      if (st == 'T' || st == 't') state = "is stopped (SIGSTOP or a debugger)";
      else if (st == 'Z' || st == 'X') state = "has ended";
    }
    if (!state.empty()) out += (out.empty() ? "" : "; ") + describe_rank(r) + " " + state;
  }
  return out;
}

namespace {

void on_mpi_error(MPI_Comm* comm, int* code, ...) {
  // Give a dead peer's supervisor the first word (the launcher then ends this rank quietly).
  std::this_thread::sleep_for(std::chrono::seconds(2));
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(*code, text, &len);
  std::string first_line(text, static_cast<size_t>(len));
  first_line = first_line.substr(0, first_line.find('\n'));
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string trouble = local_peer_trouble(rank);
  std::fprintf(stderr, "zero3d: rank %d: fatal: MPI error%s: %s%s%s\n", rank, where(record()).c_str(),
               first_line.c_str(), trouble.empty() ? "" : "; ", trouble.c_str());
  std::fflush(stderr);
  note_exit(kExitSystem);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the launcher forward it
  abort_job(kExitSystem);  // a plain exit would let mpiexec report a SIGKILL
}

}  // namespace

void abort_job(int code) {
  note_exit(code);
  std::fflush(stdout);
  std::fflush(stderr);
  if (abort_over_pmi(code)) _exit(code);
  // MPI_Abort from a thread other than main's (the watchdog) needs MPI_THREAD_MULTIPLE; without
  // it, exiting leaves the launcher to take the other ranks down.
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  if (level == MPI_THREAD_MULTIPLE) MPI_Abort(MPI_COMM_WORLD, code);
  _exit(code);
}

bool first_to_report() {
  if (g_job_key == 0) return true;
  static int holder = -1;  // kept open for the process's life: the name stays taken
  if (holder >= 0) return false;
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  char name[64];
  const int len = std::snprintf(name, sizeof name, "zero3d-report-%016llx", (unsigned long long)g_job_key);
  std::memcpy(addr.sun_path + 1, name, static_cast<size_t>(len));  // sun_path[0] = 0: the abstract namespace
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), socklen_t(offsetof(sockaddr_un, sun_path) + 1 + len)) != 0) {
    ::close(fd);
    return errno != EADDRINUSE;  // taken: another rank of this job on this host speaks
  }
  holder = fd;
  return true;
}

void install_mpi_error_handler(MPI_Comm comm) {
  MPI_Errhandler handler;
  MPI_Comm_create_errhandler(on_mpi_error, &handler);
  MPI_Comm_set_errhandler(comm, handler);
  MPI_Errhandler_free(&handler);
}

}  // namespace zero3d
