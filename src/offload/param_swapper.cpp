// param_swapper.cpp — see param_swapper.hpp.
#include "offload/param_swapper.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>

#include "base/errors.hpp"
#include "base/input_file.hpp"

namespace zero3d::offload {

namespace {
const char* kNvmeKey = "zero_optimization.offload_param.nvme_path";
}

ParamSwapper::ParamSwapper(const OffloadParamConfig& cfg, const AioConfig& aio, DType type,
                           std::vector<std::pair<int64_t, int64_t>> slices, const std::string& dir)
    : cfg_(cfg), type_(type), esize_(dtype_size(type)), slices_(std::move(slices)), dir_(dir) {
  int64_t largest = 0;
  for (size_t u = 0; u < slices_.size(); ++u) {
    const int64_t n = slice_elems(static_cast<int>(u));
    if (n > cfg_.buffer_size)
      throw InputError("`zero_optimization.offload_param.buffer_size`: value " + std::to_string(cfg_.buffer_size) +
                       " is smaller than unit " + std::to_string(u) + "'s slice of this rank's partition (" +
                       std::to_string(n) + " elements): one swapped slice must fit one buffer");
    largest = std::max(largest, n);
    file_bytes_ += align_up(n * static_cast<int64_t>(esize_));
  }
  prepare_swap_dir(dir_, file_bytes_, kNvmeKey);
  direct_ = true;
  for (size_t u = 0; u < slices_.size(); ++u) {
    const int64_t bytes = align_up(slice_elems(static_cast<int>(u)) * static_cast<int64_t>(esize_));
    if (slice_elems(static_cast<int>(u)) == 0) {
      fds_.push_back(-1);
      paths_.emplace_back();
      continue;
    }
    const std::string path = dir_ + "/" + std::to_string(u) + "_param.tensor.swp";
    bool direct = direct_;
    const int fd = open_swap_file(path, direct, kNvmeKey);
    fds_.push_back(fd);
    paths_.push_back(path);
    reserve_swap_file(fd, bytes, kNvmeKey, dir_, path);
  }
  aio_ = std::make_unique<AioEngine>(aio);
  // Page-locked per pin_memory: it lives for the run. (The cached slices come and go with their
  // reads; registering each would cost more than the copy it speeds up.)
  scratch_ = AlignedBuffer(largest * static_cast<int64_t>(esize_), cfg_.pin_memory);
}

ParamSwapper::~ParamSwapper() {
  aio_.reset();  // transfers in flight complete before the files go
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
  for (const std::string& p : paths_)
    if (!p.empty()) ::unlink(p.c_str());
  std::error_code ec;
  std::filesystem::remove(dir_, ec);  // only when empty
}

void ParamSwapper::finish_read(Entry& e) {
  if (!e.read) return;
  aio_->wait(e.read);
  e.read.reset();
  --reads_in_flight_;
}

// Least recently used first, never `keep`, until `elems` more fit; a slice still being read
// goes too (after its read) only when `include_reads` (a prefetch never drops another).
void ParamSwapper::evict_for(int64_t elems, int keep, bool include_reads) {
  while (cached_elems_ + elems > cfg_.max_in_cpu) {
    auto victim = cache_.end();
    for (auto it = cache_.begin(); it != cache_.end(); ++it)
      if (it->first != keep && (include_reads || !it->second.read) &&
          (victim == cache_.end() || it->second.last_use < victim->second.last_use))
        victim = it;
    if (victim == cache_.end()) return;
    finish_read(victim->second);
    cached_elems_ -= slice_elems(victim->first);
    cache_.erase(victim);
  }
}

bool ParamSwapper::prefetch(int u) {
  if (cache_.count(u) || slice_elems(u) == 0) return true;
  if (reads_in_flight_ >= cfg_.buffer_count) return false;
  evict_for(slice_elems(u), -1, /*include_reads=*/false);
  if (cached_elems_ + slice_elems(u) > cfg_.max_in_cpu) return false;  // no room: read when needed
  Entry& e = cache_[u];
  const int64_t bytes = align_up(slice_elems(u) * static_cast<int64_t>(esize_));
  e.buf = AlignedBuffer(bytes);
  e.read = aio_->read(fds_[u], e.buf.data(), bytes, 0, paths_[u]);
  e.last_use = ++clock_;
  ++reads_in_flight_;
  cached_elems_ += slice_elems(u);
  cached_peak_ = std::max(cached_peak_, cached_elems_);
  return true;
}

bool ParamSwapper::ready(int u) {
  auto it = cache_.find(u);
  if (slice_elems(u) == 0) return true;
  if (it == cache_.end()) return false;
  if (it->second.read && it->second.read->done()) finish_read(it->second);
  return !it->second.read;
}

const void* ParamSwapper::acquire(int u) {
  if (slice_elems(u) == 0) return scratch_.data();
  evict_for(0, u, true);  // a slice acquired over budget last time goes now
  auto it = cache_.find(u);
  if (it == cache_.end()) {
    evict_for(slice_elems(u), u, true);
    Entry& e = cache_[u];  // may exceed max_in_cpu until the next call when one slice is larger
    const int64_t bytes = align_up(slice_elems(u) * static_cast<int64_t>(esize_));
    e.buf = AlignedBuffer(bytes);
    e.read = aio_->read(fds_[u], e.buf.data(), bytes, 0, paths_[u]);
    ++reads_in_flight_;
    cached_elems_ += slice_elems(u);
    cached_peak_ = std::max(cached_peak_, cached_elems_);
    it = cache_.find(u);
  }
  finish_read(it->second);
  it->second.last_use = ++clock_;
  return it->second.buf.data();
}

// Slice elements [a, b) of unit u: in the cached copy (kept current, and written through) or
// straight from and to the file's pages.
void ParamSwapper::transfer_slice(int u, int64_t a, int64_t b, const std::function<void(char*)>& change,
                                  bool write_back) {
  const auto es = static_cast<int64_t>(esize_);
  auto it = cache_.find(u);
  if (it != cache_.end()) {
    finish_read(it->second);
    char* buf = static_cast<char*>(it->second.buf.data());
    change(buf + a * es);
    if (write_back) {
      const int64_t first = a * es / kIoAlign * kIoAlign, last = align_up(b * es);
      aio_->wait(aio_->write(fds_[u], buf + first, last - first, first, paths_[u]));
    }
    return;
  }
  file_span(*aio_, fds_[u], paths_[u], static_cast<char*>(scratch_.data()), a * es, b * es, slice_elems(u) * es, change,
            write_back);
}

void ParamSwapper::read(int64_t begin, int64_t n, void* out) {
  char* o = static_cast<char*>(out);
  std::memset(o, 0, static_cast<size_t>(n) * esize_);  // padding beyond the slices
  for (size_t u = 0; u < slices_.size(); ++u) {
    const auto [a0, b0] = slices_[u];
    const int64_t a = std::max(begin, a0), b = std::min(begin + n, b0);
    if (a >= b) continue;
    transfer_slice(static_cast<int>(u), a - a0, b - a0, [&](char* at) {
      std::memcpy(o + (a - begin) * esize_, at, static_cast<size_t>(b - a) * esize_);
    }, false);
  }
}

void ParamSwapper::write(int64_t begin, int64_t n, const void* in) {
  const char* src = static_cast<const char*>(in);
  for (size_t u = 0; u < slices_.size(); ++u) {
    const auto [a0, b0] = slices_[u];
    const int64_t a = std::max(begin, a0), b = std::min(begin + n, b0);
    if (a >= b) continue;
    transfer_slice(static_cast<int>(u), a - a0, b - a0, [&](char* at) {
      std::memcpy(at, src + (a - begin) * esize_, static_cast<size_t>(b - a) * esize_);
    }, true);
  }
}

}  // namespace zero3d::offload
