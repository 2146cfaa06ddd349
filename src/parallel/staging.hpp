// staging.hpp — the communicator layer's staging buffers grown on demand.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/memory.hpp"

namespace zero3d {

// A staging buffer of at least `bytes` (contents undefined): the old one freed before the new
// one is allocated, so the two never coexist.
inline void fit(kernels::StagingBuffer& buffer, int64_t bytes) {
  if (static_cast<int64_t>(buffer.size()) >= bytes) return;
  buffer = kernels::StagingBuffer();
  buffer = kernels::StagingBuffer(static_cast<size_t>(bytes));
}

}  // namespace zero3d
