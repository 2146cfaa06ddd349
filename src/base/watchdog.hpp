// watchdog.hpp — turns a hang into an error: a thread that aborts the job when one
// communication operation has waited longer than `training.comms_timeout` seconds.
//
// Communicators mark each blocking operation with a Watchdog::Scope; the message says which
// rank waits in which operation ("rank 1 waits in all_reduce #42 for 30.0 s"), and which peers
// on the same host are stopped or gone (failure.hpp: local_peer_trouble). Each Scope also
// records the operation for a supervisor's message should this rank be killed (failure.hpp).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace zero3d {

class Watchdog {
 public:
  // timeout_s <= 0: disabled (Scope costs a few relaxed atomic stores).
  Watchdog(double timeout_s, int world_rank);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  class Scope {
   public:
    Scope(Watchdog* w, const char* op);
    ~Scope();

   private:
    Watchdog* w_;
  };

  bool enabled() const { return timeout_s_ > 0; }

 private:
  void run();
  double timeout_s_;
  int rank_;
  std::atomic<const char*> op_{nullptr};
  std::atomic<int64_t> seq_{0};
  std::atomic<int64_t> started_ns_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::thread thread_;
};

}  // namespace zero3d
