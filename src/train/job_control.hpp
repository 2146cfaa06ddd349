// job_control.hpp — living inside a batch scheduler (Slurm, PBS): the warning signal before
// preemption, launch mistakes found before any training, one job per output directory, and
// paths checked writable at start-up rather than at the first save.
//
// No MPI here: callers pass what MPI reports and agree on the outcome themselves.
#pragma once

#include <cstdint>
#include <string>

namespace zero3d {

// SIGTERM (Slurm's and PBS's warning before a kill) and SIGUSR1 (`sbatch --signal=USR1@120`)
// set a flag instead of ending the process; the training loop reads it at every step
// boundary, saves and exits kExitRequeue. Further signals (a second SIGTERM during the save)
// only count: the save is atomic either way.
//
// A signal must not be lost during start-up, so main() calls, in this order:
//   hold_preemption_signals()    first of all: the flag handler, with both signals blocked
//                                (held pending); the mask survives the supervisor's re-exec and
//                                fork, and threads MPI and Kokkos start inherit it;
//   accept_preemption_signals()  after MPI_Init, which may have put its own SIGUSR1 handler in
//                                place: the flag handler again, then unblocked, so that a signal
//                                held meanwhile sets the flag now;
//   default_preemption_signals() for a command that has no step boundary (all but train): the
//                                default action again, and a signal that came during start-up
//                                ends the process now, as it would have then.
void hold_preemption_signals();
void accept_preemption_signals();
void default_preemption_signals();
int preemption_signal();  // 0 = none yet, else the first signal received
std::string signal_name(int sig);  // "SIGTERM", "SIGUSR1", ...

// What the scheduler or launcher says the job's task count is: the first of PMI_SIZE,
// PMIX_SIZE, OMPI_COMM_WORLD_SIZE (the launcher's own), SLURM_STEP_NUM_TASKS, SLURM_NTASKS,
// PBS_NP that is set. tasks = 0 when none is.
struct SchedulerTasks {
  std::string variable;
  int64_t tasks = 0;
};
SchedulerTasks scheduler_tasks();

// InputError when the scheduler started N > 1 tasks but MPI reports a single rank: `srun`
// without PMI support (or an MPI that does not match the launcher) runs N independent
// one-rank jobs that would all write into one output directory.
void check_launch(int mpi_ranks);

// InputError unless files can be created in `path` (or, when it does not exist yet, in its
// nearest existing ancestor, from which it would be created). `key` names the setting.
void check_writable_directory(const std::string& path, const std::string& key);

// InputError when `dir` holds a file a run replaces there (config.json, metrics.jsonl,
// flops_profile.json, trace.json, comms_logger.json) but no zero3d run has held it (no
// .zero3d.lock): those files are not the run's own. (save_dir has its own check.)
void check_output_directory_is_ours(const std::string& dir);

// Holds `<dir>/.zero3d.lock` (an fcntl write lock, released by the kernel whenever the
// process ends, even by SIGKILL) for the run's lifetime; the file names the holder. A second
// run into the same directory gets an InputError naming that holder. Where the filesystem
// cannot lock (Lustre without -o flock: ENOSYS), `note()` says so and the run goes on.
class OutputDirLock {
 public:
  explicit OutputDirLock(const std::string& dir);
  ~OutputDirLock();
  OutputDirLock(const OutputDirLock&) = delete;
  OutputDirLock& operator=(const OutputDirLock&) = delete;
  const std::string& note() const { return note_; }

 private:
  int fd_ = -1;
  std::string note_;
};

// BLAS threads per rank (OpenBLAS's own count), for the oversubscription report.
int blas_threads_per_rank();

// The start-up note when `threads` BLAS threads per rank × `ranks` ranks on a node exceed its
// `cores` (empty when they do not), naming the cause: more ranks than cores (fewer BLAS threads
// cannot help then), or threads per rank (then OPENBLAS_NUM_THREADS to set).
std::string oversubscription_note(int threads, int ranks, int cores);

}  // namespace zero3d
