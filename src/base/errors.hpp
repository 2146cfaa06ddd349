// base/errors.hpp — the error type every module throws, and the exit-code contract.
//
// Exit codes (DESIGN.md §1): 0 success, 2 bad input (config, arguments, data, checkpoint),
// 1 internal or system failure, 75 preempted after a save (requeue). Library code throws;
// only main() turns errors into exit codes.
#pragma once

#include <stdexcept>
#include <string>

namespace zero3d {

// Bad input the user can fix: the message names the file, key or value (exit code 2).
class InputError : public std::runtime_error {
 public:
  explicit InputError(const std::string& what) : std::runtime_error(what) {}
};

// A failure of the system or of zero3d itself (exit code 1).
class SystemError : public std::runtime_error {
 public:
  explicit SystemError(const std::string& what) : std::runtime_error(what) {}
};

constexpr int kExitOk = 0;
constexpr int kExitSystem = 1;
constexpr int kExitBadInput = 2;
// The run stopped early on the scheduler's warning signal (SIGTERM, SIGUSR1) after saving a
// checkpoint at the step it reached: the job script should requeue it (sysexits.h EX_TEMPFAIL,
// "a temporary failure; the user is invited to retry").
constexpr int kExitRequeue = 75;
// <output>/requeue: written beside exit 75 (the preemption line), removed when a run starts.
constexpr const char* kRequeueFile = "requeue";

}  // namespace zero3d
