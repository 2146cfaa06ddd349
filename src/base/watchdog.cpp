// watchdog.cpp
#include "base/watchdog.hpp"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/errors.hpp"
#include "base/failure.hpp"

namespace zero3d {

namespace {
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

Watchdog::Watchdog(double timeout_s, int world_rank) : timeout_s_(timeout_s), rank_(world_rank) {
  if (enabled()) thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

Watchdog::Scope::Scope(Watchdog* w, const char* op) : w_(w && w->enabled() ? w : nullptr) {
  note_comm_begin(op);  // for the supervisor's message if this rank is killed (failure.hpp)
  if (!w_) return;
  w_->started_ns_.store(now_ns());
  w_->seq_.fetch_add(1);
  w_->op_.store(op);
}

Watchdog::Scope::~Scope() {
  note_comm_end();
  if (w_) w_->op_.store(nullptr);
}

void Watchdog::run() {
  const auto tick = std::chrono::milliseconds(100);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, tick, [this] { return stop_.load(); })) {
    const char* op = op_.load();
    if (!op) continue;
    const double waited = static_cast<double>(now_ns() - started_ns_.load()) / 1e9;
    if (waited < timeout_s_) continue;
    // Every rank waiting for a stuck one times out at about the same moment: one of them speaks
    // (failure.hpp: first_to_report); the others wait for the abort it sends, and send their
    // own only if none has come (then it is news).
    if (!first_to_report()) {
      if (wake_.wait_for(lock, std::chrono::seconds(10), [this] { return stop_.load(); })) return;
    }
    // Which peer? Only ranks on this host can be looked at (stopped or vanished processes).
    const std::string trouble = local_peer_trouble(rank_);
    std::fprintf(stderr, "zero3d: rank %d waits in %s #%lld for %.1f s (training.comms_timeout %.1f s): %s; aborting the job\n",
                 rank_, op, static_cast<long long>(seq_.load()), waited, timeout_s_,
                 trouble.empty() ? "a peer rank is stuck or dead" : trouble.c_str());
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the launcher forward it
    abort_job(kExitSystem);  // failure.hpp: the launcher takes the other ranks down
  }
}

}  // namespace zero3d
