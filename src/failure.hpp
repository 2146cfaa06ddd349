// failure.hpp — one message for a failure anywhere, and no hang.
//
// Setup steps that may fail on some ranks only (a config or data file readable on one node
// but not another) run through run_collectively(): afterwards every rank knows whether any
// rank failed, and all of them throw AgreedFailure with the same exit code; only the lowest
// failing rank reports its message. Failures that are not agreed (inside training) are
// reported by the failing rank, which aborts the job (main.cpp).
#pragma once

#include <mpi.h>

#include <exception>
#include <stdexcept>
#include <string>

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

}  // namespace zero3d
