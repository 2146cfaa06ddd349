// failure.hpp — one message for a failure anywhere, and no hang.
//
// Setup steps that may fail on some ranks only (a config or data file readable on one node
// but not another) run through run_collectively(): afterwards every rank knows whether any
// rank failed, and all of them throw AgreedFailure with the same exit code; only the lowest
// failing rank reports its message. Failures that are not agreed (inside training) are
// reported by the failing rank, which aborts the job (main.cpp).
//
// A rank that dies without a word (SIGKILL, the OOM killer, a segfault) is named by its
// supervisor; see supervise_rank() below for why the survivors cannot do it under MPICH.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

namespace zero3d {

class AgreedFailure : public std::runtime_error {
 public:
  AgreedFailure(const std::string& what, int code, int failed_rank, bool report)
      : std::runtime_error(what), code_(code), failed_rank_(failed_rank), report_(report) {}
  int code() const { return code_; }
  int failed_rank() const { return failed_rank_; }
  bool report() const { return report_; }  // true on the one rank that prints the message

 private:
  int code_, failed_rank_;
  bool report_;
};

// Collective over `comm`. `local` is this rank's error from the step just run (null if none).
// Returns if no rank failed; otherwise throws AgreedFailure on every rank.
void agree_on_failure(MPI_Comm comm, std::exception_ptr local);

// Runs `step` on every rank, then agree_on_failure().
template <typename Step>
void run_collectively(MPI_Comm comm, Step&& step) {
  std::exception_ptr error;
  try {
    step();
  } catch (...) {
    error = std::current_exception();
  }
  agree_on_failure(comm, error);
}

// ---- ranks that die ----------------------------------------------------------------------
//
// What MPICH's hydra launcher (Debian mpich 4.0, ch4:ucx) does when a rank dies — measured
// with strace on hydra_pmi_proxy while `kill -9` hit one rank of a 2-rank job:
//   1. the proxy reaps the dead rank (wait4: WTERMSIG 9) and within 1 ms sends SIGKILL to the
//      process group of every other rank of the job ("forced cleanup");
//   2. mpiexec exits with the dead rank's signal, 9 ("YOUR APPLICATION TERMINATED WITH THE
//      EXIT STRING: Killed (signal 9)"). A process the cleanup kills counts too whenever the
//      proxy reaps it while still reading its output (a race): even a clean exit 1 of some
//      rank gives mpiexec exit 9 about half of the time. Only a PMI abort (what MPI_Abort
//      sends: "cmd=abort exitcode=N") makes mpiexec exit N whatever the statuses.
// So a survivor cannot notice the death and print anything (no heartbeat, no kill(pid, 0)
// watchdog, no MPI error handler gets the time), and nothing a survivor does can change the
// exit code. The only process that reliably outlives a killed rank is one the launcher does
// not count as that rank: its parent.
//
// supervise_rank() therefore runs first in main(), before MPI_Init: under an MPI launcher with
// more than one rank (PMI_SIZE > 1) it forks. The child (the "worker") returns and is zero3d;
// the launched process stays behind as a supervisor that only waits for the worker:
//   - worker exits with code c      -> supervisor exits c (the launcher sees what it saw before);
//   - worker killed by signal s that the supervisor did not itself receive (kill -9 of the
//     worker, the OOM killer, SIGSEGV) -> supervisor prints
//       zero3d: rank 1 (pid 4242, host node7) ended without a message (killed by signal 9,
//       Killed) during step 3, in all_reduce #57
//     then aborts the job over the PMI connection it shares with the worker (PMI_FD) and
//     exits 1; the launcher cleans up the survivors as in 1., and mpiexec exits 1;
//   - SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 sent to the supervisor are forwarded to the
//     worker; if the worker dies of such a signal, the supervisor dies of it too, silently.
//     Those held pending before the fork (job_control.hpp) are forwarded once it is set up.
// The worker ends with its supervisor (PR_SET_PDEATHSIG, see note_exit below), and both are in
// the process group the launcher signals. The phase in the message comes from a page shared by the two (mmap before
// fork): note_phase(), note_step() and the communication operation marked by Watchdog::Scope.
// Without a supervisor the same calls write to a process-local record.
// Before forking it sets UCX_HANDLE_ERRORS=none (unless set) and re-execs itself, so that a
// survivor UCX kills for reading a dead peer's memory prints one line, not a backtrace.
// ZERO3D_SUPERVISE=0 turns all of this off.
//
// A stopped rank (SIGSTOP, a debugger) does not die: the watchdog (training.comms_timeout) of
// a rank that waits for it ends the job, naming stopped or vanished ranks on its own host from
// the pid/host table exchanged at start-up (exchange_rank_identities).
void supervise_rank(char** argv);  // argv: main's, for a re-exec that sets UCX_HANDLE_ERRORS

// A worker that exits with a code other than 0 that main() did not report with a message (a
// library's exit(), a test hook's _Exit) is named by its supervisor too:
//   zero3d: rank 1 (pid 4242, host node7) exited with code 137 without a message during step 2
// and the job is aborted with exit 1. main() (and the watchdog, the MPI error handler) call
// note_exit(code) once their message is out, just before they exit or abort.
//
// SIGKILL of the supervisor itself (the pid the launcher knows) reaches the worker as its
// parent-death signal, a real-time signal it handles: unless the launcher is ending the whole
// job anyway (then it kills the worker within moments and nothing is said), the worker prints
//   zero3d: rank 1 (pid 4242, host node7): its launched process (pid 4241), which supervises
//   it, was killed (SIGKILL) during step 3; ending the job
// aborts the job over PMI like a supervisor would, and exits 1.
void note_exit(int code);

// Test hook for the start-up signal tests: with ZERO3D_FAULT=startup_pause:RANK:POINT the rank
// whose PMI_RANK (0 without a launcher) is RANK stops itself with SIGSTOP at `point`
// ("launch": in the worker before MPI_Init; "mpi": after MPI_Init), for a test to signal it
// there and continue it.
void fault_pause_point(const char* point);

// What the worker is doing, for the supervisor's message (texts are copied, up to 47 bytes).
// Cheap enough for every step and every communication (a few relaxed atomic stores).
void note_phase(const char* phase);    // "start-up" until set; then "set-up" (agreement.cpp), "training" (main.cpp)
void note_step(int64_t step);          // the training step in progress (1-based)
void note_comm_begin(const char* op);  // a blocking communication starts (Watchdog::Scope)
void note_comm_end();

// Ends the whole job with `code` once this rank's message is out: over the rank's PMI
// connection where the launcher gave one (hydra's PMI_FD), which ends every rank without
// MPICH's own "application called MPI_Abort" line after zero3d's; else MPI_Abort.
[[noreturn]] void abort_job(int code);

// True for the first caller on this host in this job, false for every later one: for a failure
// all waiting ranks see at once (the watchdog's timeout), so that one of them speaks. Held by an
// abstract Unix socket named after the job (exchange_rank_identities), which the kernel drops
// when its holder ends; true before the exchange. One line per host on a multi-node job.
bool first_to_report();

// Every rank's pid and host, gathered once at start-up (collective over `world`).
struct RankIdentity {
  int pid = 0;
  std::string host;
};
void exchange_rank_identities(MPI_Comm world);
const std::vector<RankIdentity>& rank_identities();  // empty before the exchange
std::string describe_rank(int rank);                 // "rank 1 (pid 4242, host node7)"

// Ranks on this host that are stopped (state T/t) or have vanished, as "rank 1 (pid 4242,
// host node7) is stopped" phrases joined by "; " — empty if none is known to be.
std::string local_peer_trouble(int self);

// MPI errors (a peer's connection lost) become one zero3d line and exit 1 instead of MPI's
// abort with a backtrace: an error handler on `comm` (communicators split or duplicated from
// it inherit it). The handler first waits a moment so that a dead rank's supervisor, whose
// message names that rank, speaks first and the launcher ends this rank quietly.
void install_mpi_error_handler(MPI_Comm comm);

}  // namespace zero3d
