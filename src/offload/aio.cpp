// aio.cpp — io_uring workers behind AioEngine (see aio.hpp).
#include "offload/aio.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/vfs.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "kernels/device.hpp"

namespace zero3d::offload {

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
std::string errno_text(int e) { return std::strerror(e); }
}  // namespace

void AlignedBuffer::Free::operator()(void* p) const {
  if (locked) kernels::page_unlock(p);
  std::free(p);
}

AlignedBuffer::AlignedBuffer(int64_t bytes, bool page_locked) : bytes_(align_up(std::max<int64_t>(bytes, 1))) {
  void* p = nullptr;
  if (posix_memalign(&p, kIoAlign, static_cast<size_t>(bytes_)) != 0)
    throw SystemError("cannot allocate " + std::to_string(bytes_) + " bytes of aligned swap buffer");
  ptr_.reset(p);
  if (page_locked && kernels::kGpuBuild) {
    kernels::page_lock(p, static_cast<size_t>(bytes_));
    ptr_.get_deleter().locked = true;
  }
}

struct AioEngine::Worker {
  io_uring ring{};
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Part> queue;
  bool stop = false;
};

AioEngine::AioEngine(const AioConfig& cfg) : cfg_(cfg) {
  for (int i = 0; i < cfg_.intra_op_parallelism; ++i) {
    auto w = std::make_unique<Worker>();
    const int rc = io_uring_queue_init(static_cast<unsigned>(cfg_.queue_depth), &w->ring, 0);
    if (rc < 0) throw SystemError("io_uring_queue_init (aio.queue_depth " + std::to_string(cfg_.queue_depth) +
                                  "): " + errno_text(-rc));
    workers_.push_back(std::move(w));
  }
  for (auto& w : workers_) {
    Worker* p = w.get();
    p->thread = std::thread([this, p] { run(*p); });
  }
}

AioEngine::~AioEngine() {
  for (auto& w : workers_) {
    {
      std::lock_guard<std::mutex> lk(w->mu);
      w->stop = true;
    }
    w->cv.notify_all();
  }
  for (auto& w : workers_) {
    if (w->thread.joinable()) w->thread.join();
    io_uring_queue_exit(&w->ring);
  }
}

bool Transfer::done() const {
  std::lock_guard<std::mutex> lk(engine_->mu_);
  return parts_left_ == 0;
}

Ticket AioEngine::read(int fd, void* buf, int64_t bytes, int64_t offset, const std::string& what) {
  return submit(false, fd, buf, bytes, offset, what);
}

Ticket AioEngine::write(int fd, const void* buf, int64_t bytes, int64_t offset, const std::string& what) {
  return submit(true, fd, const_cast<void*>(buf), bytes, offset, what);
}

Ticket AioEngine::submit(bool write, int fd, void* buf, int64_t bytes, int64_t offset, const std::string& what) {
  auto t = std::make_shared<Transfer>();
  t->engine_ = this;
  t->write_ = write;
  t->bytes_ = bytes;
  t->what_ = what;
  // Cut into one contiguous, page-aligned part per worker (DeepSpeed's intra-op split).
  const int64_t pages = bytes / kIoAlign, n = static_cast<int64_t>(workers_.size());
  std::vector<std::pair<int64_t, int64_t>> parts;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = pages * i / n * kIoAlign, b = pages * (i + 1) / n * kIoAlign;
    if (b > a) parts.emplace_back(a, b);
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    t->parts_left_ = static_cast<int>(parts.size());
    if (!parts.empty() && inflight_[write]++ == 0) busy_since_[write] = now_s();
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    Worker& w = *workers_[i];
    {
      std::lock_guard<std::mutex> lk(w.mu);
      w.queue.push_back(Part{t, fd, static_cast<char*>(buf) + parts[i].first, parts[i].second - parts[i].first,
                             offset + parts[i].first});
    }
    w.cv.notify_one();
  }
  return t;
}

void AioEngine::part_done(const Ticket& t, int error) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (error && !t->error_) t->error_ = error;
    if (--t->parts_left_ == 0) {
      const int d = t->write_;
      (d ? stats_.write_bytes : stats_.read_bytes) += t->bytes_;
      if (--inflight_[d] == 0) (d ? stats_.write_s : stats_.read_s) += now_s() - busy_since_[d];
    }
  }
  done_cv_.notify_all();
}

void AioEngine::wait(const Ticket& t) {
  if (!t) return;
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return t->parts_left_ == 0; });
  if (t->error_) {
    const int e = t->error_;
    t->error_ = 0;  // reported once
    throw SystemError(std::string(t->write_ ? "writing" : "reading") + " swap file " + t->what_ + ": " +
                      errno_text(e) + (e == ENOSPC ? " (the drive holding nvme_path is full)" : ""));
  }
}

IoStats AioEngine::take_stats() {
  std::lock_guard<std::mutex> lk(mu_);
  IoStats s = stats_;
  const double t = now_s();
  for (int d = 0; d < 2; ++d)  // count the time of transfers still in flight up to now
    if (inflight_[d] > 0) {
      (d ? s.write_s : s.read_s) += t - busy_since_[d];
      busy_since_[d] = t;
    }
  stats_ = IoStats{};
  return s;
}

// One io_uring per worker: blocks of block_size bytes, at most queue_depth in flight.
void AioEngine::run(Worker& w) {
  struct Active {
    Part part;
    int64_t submitted = 0;
    int outstanding = 0;
    int error = 0;
  };
  struct Block {
    Active* a;
    int64_t off, len;
  };
  std::vector<std::unique_ptr<Active>> active;
  int inflight = 0;
  const int qd = static_cast<int>(cfg_.queue_depth);
  auto prep = [&](Block* b) {
    io_uring_sqe* sqe = io_uring_get_sqe(&w.ring);
    if (!sqe) return false;
    Active& a = *b->a;
    char* buf = a.part.buf + b->off;
    const auto len = static_cast<unsigned>(b->len);
    const auto off = static_cast<uint64_t>(a.part.offset + b->off);
    if (a.part.transfer->write_) io_uring_prep_write(sqe, a.part.fd, buf, len, off);
    else io_uring_prep_read(sqe, a.part.fd, buf, len, off);
    io_uring_sqe_set_data(sqe, b);
    ++a.outstanding;
    ++inflight;
    if (cfg_.single_submit) io_uring_submit(&w.ring);
    return true;
  };
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(w.mu);
      if (inflight == 0 && active.empty())
        w.cv.wait(lk, [&] { return w.stop || !w.queue.empty(); });
      if (w.stop && w.queue.empty() && inflight == 0 && active.empty()) return;
      while (!w.queue.empty()) {
        active.push_back(std::make_unique<Active>(Active{std::move(w.queue.front())}));
        w.queue.pop_front();
      }
    }
    // Without overlap_events a new batch starts only when the previous one has completed.
    if (cfg_.overlap_events || inflight == 0) {
      int queued = 0;
      for (auto& a : active)
        while (inflight < qd && a->submitted < a->part.bytes) {
          const int64_t len = std::min(cfg_.block_size, a->part.bytes - a->submitted);
          auto* b = new Block{a.get(), a->submitted, len};
          if (!prep(b)) {
            delete b;
            break;
          }
          a->submitted += len;
          ++queued;
        }
      if (queued && !cfg_.single_submit) io_uring_submit(&w.ring);
    }
    if (inflight == 0) continue;
    // Reap: one completion or more (overlap_events), else the whole batch.
    do {
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(&w.ring, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) throw SystemError("io_uring_wait_cqe: " + errno_text(-rc));  // the ring itself broke
      unsigned head;
      unsigned seen = 0;
// liburing's macro assigns in its loop condition; a compiler that sees it expanded (nvcc's host
// pass) warns on it as if it were ours.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wparentheses"
      io_uring_for_each_cqe(&w.ring, head, cqe) {
        ++seen;
        auto* b = static_cast<Block*>(io_uring_cqe_get_data(cqe));
        const int res = cqe->res;
        --inflight;
        --b->a->outstanding;
        if (res < 0) {
          if (!b->a->error) b->a->error = -res;
          b->a->submitted = b->a->part.bytes;  // stop the part
          delete b;
        } else if (res == 0) {
          if (!b->a->error) b->a->error = EIO;  // a read past the end of the file
          b->a->submitted = b->a->part.bytes;
          delete b;
        } else if (res < b->len) {  // short transfer: the rest goes again
          b->off += res;
          b->len -= res;
          if (!prep(b)) {
            if (!b->a->error) b->a->error = EAGAIN;
            delete b;
          } else if (!cfg_.single_submit) {
            io_uring_submit(&w.ring);
          }
        } else {
          delete b;
        }
      }
#pragma GCC diagnostic pop
      io_uring_cq_advance(&w.ring, seen);
    } while (!cfg_.overlap_events && inflight > 0);
    for (size_t i = 0; i < active.size();) {
      Active& a = *active[i];
      if (a.submitted >= a.part.bytes && a.outstanding == 0) {
        part_done(a.part.transfer, a.error);
        active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }
}

void file_span(AioEngine& aio, int fd, const std::string& what, char* buf, int64_t begin, int64_t end,
               int64_t used_end, const std::function<void(char*)>& change, bool write_back) {
  const int64_t first = begin / kIoAlign * kIoAlign, last = align_up(end);
  const bool whole = begin == first && (end == last || end >= used_end);
  if (!(write_back && whole)) aio.wait(aio.read(fd, buf, last - first, first, what));
  change(buf + (begin - first));
  if (write_back) aio.wait(aio.write(fd, buf, last - first, first, what));
}

int open_swap_file(const std::string& path, bool& direct, const std::string& key) {
  int fd = direct ? ::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600) : -1;
  if (fd < 0 && direct && errno == EINVAL) direct = false;
  if (fd < 0) fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
  if (fd < 0) throw InputError("`" + key + "`: cannot create swap file " + echo(path) + ": " + errno_text(errno));
  return fd;
}

namespace {
// A probe file of this process's own in `dir`: the ranks of a job check one shared nvme_path at
// the same moment, and with one name a rank's O_TRUNC could empty the page another had just
// written before that one read it back (which then refused a good directory).
std::string probe_path(const std::string& dir, const char* what) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return dir + "/.zero3d_" + what + "_probe." + host + "." + std::to_string(::getpid());
}
}  // namespace

bool directory_supports_direct_io(const std::string& dir) {
  const std::string probe = probe_path(dir, "direct_io");
  int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  bool ok = fd >= 0;
  if (ok) {
    AlignedBuffer page(kIoAlign);
    std::memset(page.data(), 0, kIoAlign);
    ok = ::pwrite(fd, page.data(), kIoAlign, 0) == kIoAlign && ::pread(fd, page.data(), kIoAlign, 0) == kIoAlign;
    ::close(fd);
  }
  ::unlink(probe.c_str());
  return ok;
}

void require_direct_io(const std::string& dir, const std::string& key) {
  // Newer kernels give tmpfs O_DIRECT: the probe passes, yet the "swapped" state stays in memory.
  struct statfs fs {};
  if (::statfs(dir.c_str(), &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC))
    throw InputError("`" + key + "`: " + echo(dir) + " is in memory (tmpfs or ramfs): NVMe offload to it would free "
                     "no memory; give a directory on a disk (ext4, xfs, ...)");
  if (!directory_supports_direct_io(dir))
    throw InputError("`" + key + "`: " + echo(dir) + " is on a file system without direct I/O (O_DIRECT); NVMe offload "
                     "needs one that has it (ext4, xfs, ...): through the page cache the swapped state would stay in "
                     "memory");
}

void check_swap_directory(const std::string& dir, int64_t bytes, const std::string& key) {
  // Where the swap directory is, or would be created: the nearest existing ancestor.
  std::string at = dir.empty() ? "." : dir;
  struct stat st {};
  while (::stat(at.c_str(), &st) != 0) {
    if (errno != ENOENT && errno != ENOTDIR)
      throw InputError("`" + key + "`: " + echo(dir) + ": " + echo(at) + ": " + errno_text(errno));
    const size_t slash = at.find_last_of('/', at.size() > 1 ? at.size() - 2 : 0);
    at = slash == std::string::npos ? "." : slash == 0 ? "/" : at.substr(0, slash);
  }
  if (!S_ISDIR(st.st_mode))
    throw InputError("`" + key + "`: cannot create swap directory " + echo(dir) + ": " + echo(at) +
                     " is not a directory");
  struct statfs fs {};
  if (::statfs(at.c_str(), &fs) == 0 && (fs.f_type == PROC_SUPER_MAGIC || fs.f_type == SYSFS_MAGIC))
    throw InputError("`" + key + "`: " + echo(dir) + " is in a kernel file system (" +
                     (fs.f_type == PROC_SUPER_MAGIC ? "/proc" : "/sys") + "), not on a drive");
  const std::string probe = probe_path(at, "write");
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0)
    throw InputError("`" + key + "`: swap directory " + echo(dir) + " is not writable" +
                     (at == dir ? "" : " (creating it in " + echo(at) + ")") + ": " + errno_text(errno));
  ::close(fd);
  ::unlink(probe.c_str());
  struct statvfs vfs {};
  if (::statvfs(at.c_str(), &vfs) == 0) {
    const int64_t avail = static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
    if (avail < bytes)
      throw InputError("`" + key + "`: " + echo(dir) + " has " + std::to_string(avail) + " bytes free; this rank's swap "
                       "files need " + std::to_string(bytes));
  }
  require_direct_io(at, key);
}

void reserve_swap_file(int fd, int64_t bytes, const std::string& key, const std::string& dir, const std::string& path) {
  const int rc = ::posix_fallocate(fd, 0, bytes);
  if (rc == ENOSPC)
    throw InputError("`" + key + "`: " + echo(dir) + " is full: cannot reserve " + std::to_string(bytes) + " bytes for " +
                     echo(path));
  if (rc != 0 && ::ftruncate(fd, bytes) != 0)
    throw InputError("`" + key + "`: cannot size swap file " + echo(path) + ": " + std::strerror(errno));
}

void prepare_swap_dir(const std::string& dir, int64_t bytes, const std::string& key) {
  check_swap_directory(dir, bytes, key);  // validate's check too (one place that says what is refused)
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw InputError("`" + key + "`: cannot create swap directory " + echo(dir) + ": " +
                     (ec ? ec.message() : std::string("not a directory")));
  // Swap files are scratch: whatever an earlier run left here is not trusted.
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const std::string suffix = ".tensor.swp";
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      fs::remove(e.path(), ec);
  }
}

}  // namespace zero3d::offload
