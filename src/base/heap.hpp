// heap.hpp — the process's malloc policy.
#pragma once

namespace zero3d {

// Keeps glibc's mmap threshold at its initial 128 KiB. By default glibc raises the threshold to
// the size of each large block freed, so later buffers of that size come from the heap, where
// freed ones stay resident: with the optimizer and parameters on NVMe (a sub-group's parameters
// and each cached unit slice allocated and freed every step) the peak resident memory grew by
// 55 MB per step on a 42M-parameter model at np 2 (587, 642, 697, 753 MB), against a stable
// 556 MB with the threshold fixed. Large buffers kept for reuse are pooled explicitly
// (byte_pool.hpp), so what this returns to the system is what no one holds.
void keep_mmap_threshold();

}  // namespace zero3d
