// partition.hpp — ZeRO's split of a flat buffer over the ranks of a data-parallel group: the
// arithmetic every partitioned state, reduce-scatter and gather shares. Plain data, no MPI.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace zero3d {

// ZeRO's split of a flat buffer over W ranks (DEEPSPEED-FACTS §5.2): the buffer is padded
// at its end to a multiple of 2·W elements and cut into W equal contiguous ranges.
// Example: 10 elements, W = 4 -> padded 16, part 4: rank 2 owns [8, 12), of which [8, 10) real.
struct Partition {
  int64_t numel = 0, padded = 0, part = 0;
  int world = 1;
  Partition() = default;
  Partition(int64_t numel_, int world_) : numel(numel_), world(world_) {
    const int64_t align = 2 * static_cast<int64_t>(world_);
    padded = (numel_ + align - 1) / align * align;
    part = padded / world_;
  }
  int64_t begin(int r) const { return r * part; }
  int64_t end(int r) const { return (r + 1) * part; }
  // Elements of [a, b) that rank r owns, as [first, last) (empty: first == last).
  std::pair<int64_t, int64_t> owned(int r, int64_t a, int64_t b) const {
    const int64_t lo = a > begin(r) ? a : begin(r), hi = b < end(r) ? b : end(r);
    return lo < hi ? std::make_pair(lo, hi) : std::make_pair(lo, lo);
  }
  // How many elements of [a, b) each rank owns, in rank order (a reduce-scatter's counts).
  std::vector<int64_t> counts(int64_t a, int64_t b) const {
    std::vector<int64_t> out(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      const auto [lo, hi] = owned(r, a, b);
      out[static_cast<size_t>(r)] = hi - lo;
    }
    return out;
  }
};

}  // namespace zero3d
