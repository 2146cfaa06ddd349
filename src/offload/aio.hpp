// aio.hpp — the file tier's I/O: aligned buffers and asynchronous direct I/O through io_uring.
//
// DeepSpeed's aio handle (csrc/aio) splits each transfer over `intra_op_parallelism` threads,
// each keeping up to `queue_depth` requests of `block_size` bytes in flight. Here each of those
// threads owns one io_uring: a transfer is cut into that many contiguous parts, each part into
// blocks; `overlap_events` refills the ring as blocks complete (else batch by batch) and
// `single_submit` enters the kernel once per block (else once per batch). Files are opened with
// O_DIRECT; a file system that refuses it is bad input (exit 2), never a silent page-cache tier.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "config/config.hpp"

namespace zero3d::offload {

// Direct I/O moves whole pages from page-aligned memory at page-aligned file offsets.
constexpr int64_t kIoAlign = 4096;
inline int64_t align_up(int64_t bytes) { return (bytes + kIoAlign - 1) / kIoAlign * kIoAlign; }

// Page-aligned host memory, its size rounded up to whole pages.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // page_locked: registered with the device on a GPU build (DeepSpeed's pin_memory for its swap
  // buffers), for buffers that live long enough to repay the registration.
  explicit AlignedBuffer(int64_t bytes, bool page_locked = false);
  void* data() const { return ptr_.get(); }
  float* floats() const { return static_cast<float*>(ptr_.get()); }
  int64_t bytes() const { return bytes_; }

 private:
  struct Free {
    bool locked;  // page-locked: unregistered before it is freed
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> ptr_{nullptr, Free{false}};
  int64_t bytes_ = 0;
};

// Bytes moved and the time with at least one transfer of that direction in flight.
struct IoStats {
  int64_t read_bytes = 0, write_bytes = 0;
  double read_s = 0.0, write_s = 0.0;
};

class AioEngine;

// One transfer in flight; AioEngine::wait() completes it.
class Transfer {
 public:
  bool done() const;

 private:
  friend class AioEngine;
  AioEngine* engine_ = nullptr;
  bool write_ = false;
  int64_t bytes_ = 0;
  int parts_left_ = 0;     // guarded by the engine's mutex
  int error_ = 0;          // first errno seen
  std::string what_;       // the file, for messages
};
using Ticket = std::shared_ptr<Transfer>;

class AioEngine {
 public:
  explicit AioEngine(const AioConfig& cfg);
  ~AioEngine();
  AioEngine(const AioEngine&) = delete;
  AioEngine& operator=(const AioEngine&) = delete;

  // Starts moving `bytes` (a multiple of kIoAlign) between `buf` (page-aligned) and `fd` at
  // `offset` (page-aligned). `what` names the file in error messages.
  Ticket read(int fd, void* buf, int64_t bytes, int64_t offset, const std::string& what);
  Ticket write(int fd, const void* buf, int64_t bytes, int64_t offset, const std::string& what);
  // Blocks until the transfer is complete; an I/O error throws SystemError naming the file
  // (ENOSPC: the drive is full).
  void wait(const Ticket& t);
  // Totals since the last call, then reset.
  IoStats take_stats();
  const AioConfig& config() const { return cfg_; }

 private:
  struct Part {
    Ticket transfer;
    int fd;
    char* buf;
    int64_t bytes, offset;
  };
  struct Worker;
  Ticket submit(bool write, int fd, void* buf, int64_t bytes, int64_t offset, const std::string& what);
  void run(Worker& w);
  void part_done(const Ticket& t, int error);

  AioConfig cfg_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  // busy-time accounting per direction (guarded by mu_)
  int inflight_[2] = {0, 0};
  double busy_since_[2] = {0.0, 0.0};
  IoStats stats_;
  friend class Transfer;
};

// Bytes [begin, end) of a swap file whose data ends at `used_end`, moved through `buf` (page-
// aligned, large enough for the page span): only the pages the range touches are read, none when
// a write covers them whole; `change` sees the range at its start, then it is written back when
// asked. Checkpoint and start-up access outside the pipelined step.
void file_span(AioEngine& aio, int fd, const std::string& what, char* buf, int64_t begin, int64_t end,
               int64_t used_end, const std::function<void(char*)>& change, bool write_back);

// Opens (creating) a swap file for direct I/O when the file system allows it; `direct` says
// which it got. Errors are InputError naming the path and key.
int open_swap_file(const std::string& path, bool& direct, const std::string& key);

// Whether `dir` accepts O_DIRECT writes of one aligned page (probed with a scratch file).
bool directory_supports_direct_io(const std::string& dir);
// InputError naming `key` and `dir` when its file system refuses O_DIRECT (tmpfs, some network
// file systems): swapping through the page cache would put the "NVMe" state back in memory.
void require_direct_io(const std::string& dir, const std::string& key);
// Reserves `bytes` for a swap file up front (a full drive is found at start-up, not mid-step):
// InputError naming `key`, the directory and the numbers.
void reserve_swap_file(int fd, int64_t bytes, const std::string& key, const std::string& dir, const std::string& path);

// The one check of an NVMe offload directory, which `validate` and `train` share: `dir` (or,
// while it does not exist, the nearest existing ancestor it would be created in) is a directory,
// not in a kernel file system (/proc, /sys) or in memory (tmpfs, ramfs), writable, taking
// O_DIRECT, with `bytes` free. Creates nothing. InputError naming `key`, the path and the numbers.
void check_swap_directory(const std::string& dir, int64_t bytes, const std::string& key);

// check_swap_directory, then creates `dir` (and parents) and empties it of earlier swap files.
void prepare_swap_dir(const std::string& dir, int64_t bytes, const std::string& key);

}  // namespace zero3d::offload
