// byte_pool.hpp — staging buffers kept from one use to the next. A fresh vector of megabytes
// costs a zero fill and its page faults every time (a ZeRO-3 step on gpt-small faulted 10,000
// pages in its gradient reduction alone), so the gradient reducer and the communicator's rings
// hand their buffers back here and take them again for the next bucket or round. The buffer
// type is host bytes (std::vector<char>) or, for a GPU build's reducer, device bytes
// (kernels/memory.hpp DeviceBuffer): anything sized at construction with size(), data(), empty().
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace zero3d {

template <typename Buffer>
class BasicPool {
 public:
  // A buffer of at least `bytes` (its contents are whatever the last user left): the smallest
  // spare that fits, else a fresh one. Then the largest spare, too small, is dropped, so the
  // spares never outnumber the buffers once in use together.
  Buffer take(int64_t bytes) {
    if (bytes <= 0) return {};
    auto fit = spares_.end(), largest = spares_.end();
    for (auto it = spares_.begin(); it != spares_.end(); ++it) {
      const auto size = static_cast<int64_t>(it->size());
      if (size >= bytes && (fit == spares_.end() || size < static_cast<int64_t>(fit->size()))) fit = it;
      if (largest == spares_.end() || it->size() > largest->size()) largest = it;
    }
    if (fit != spares_.end()) {
      Buffer buffer = std::move(*fit);
      spares_.erase(fit);
      return buffer;
    }
    if (largest != spares_.end()) {
      held_ -= static_cast<int64_t>(largest->size());
      spares_.erase(largest);
    }
    held_ += bytes;
    peak_ = std::max(peak_, held_);
    return Buffer(static_cast<size_t>(bytes));
  }
  void give_back(Buffer&& buffer) {
    if (!buffer.empty()) spares_.push_back(std::move(buffer));
    buffer = {};
  }
  // Bytes of the buffers this pool handed out or keeps (in use + spare), and their peak.
  int64_t held_bytes() const { return held_; }
  int64_t peak_bytes() const { return peak_; }

 private:
  std::vector<Buffer> spares_;
  int64_t held_ = 0, peak_ = 0;
};

using BytePool = BasicPool<std::vector<char>>;

}  // namespace zero3d
