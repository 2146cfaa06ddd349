// warp_simulation.hpp — a host simulation of what CUDA device code needs from the hardware, for
// kernels/cuda/mma_sync.hpp's ZERO3D_WARP_SIMULATION: each CUDA thread of a block is a fiber
// (ucontext) of one host thread, switched at every barrier, so threadIdx, blockIdx and gridDim are
// plain variables the scheduler sets; __syncthreads is a barrier of the block's fibers, and each
// warp instruction exchanges its 32 lanes' registers through the warp's own area and computes
// every lane's result from the PTX ISA's fragment layouts ("Matrix Fragments for mma.m16n8k16",
// "Warp-level matrix load instruction: ldmatrix"), written here from the ISA and not from the
// kernels. Products sum in double: the check is of layouts, not of rounding.
//
// Every shared-memory access the kernels make goes through mma_sync.hpp, so the simulation also
// checks them as compute-sanitizer's racecheck and memcheck would on a GPU: two threads touching
// one word between the same pair of __syncthreads, one of them writing (a hazard the fibers' order
// may hide: on a GPU the warps run in any order); a word read before any thread wrote it (shared
// memory starts as garbage); an access outside the launch's shared memory or off its alignment.
// A cp.async may land anywhere between its issue and the cp.async.wait_group that covers it: it
// counts as its thread's write at the issue and again at the wait, and any access to its words in
// between is a hazard (what a GPU's asynchronous copy may or may not have written yet).
#pragma once

#include <cuda_bf16.h>
#include <vector_types.h>

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#undef __global__
#define __global__
#undef __host__
#define __host__
#undef __device__
#define __device__
#undef __launch_bounds__
#define __launch_bounds__(...)

struct SimDim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline SimDim3 threadIdx, blockIdx, gridDim, blockDim;
inline int min(int a, int b) { return a < b ? a : b; }

namespace zero3d::cuda_sim {

// The fibers of a block and the host thread that runs them in turn.
struct Fibers {
  ucontext_t host;
  std::vector<ucontext_t> context;
  std::vector<std::vector<char>> stack;
  std::vector<char> done;
  unsigned current = 0;
  const std::function<void()>* body = nullptr;
};
inline Fibers fibers;
inline void yield_to_host() { swapcontext(&fibers.context[fibers.current], &fibers.host); }
inline void run_fiber() {
  (*fibers.body)();
  fibers.done[fibers.current] = 1;  // then uc_link: back to the host
}

// Every one of n fibers waits until all n have arrived.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    const unsigned generation = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0, ++generation_;
      return;
    }
    while (generation_ == generation) yield_to_host();
  }
  // How many times the barrier has opened: the interval between barriers a thread is in.
  unsigned generation() const { return generation_; }

 private:
  const int n_;
  int arrived_ = 0;
  unsigned generation_ = 0;
};

// What a warp's lanes post for a collective instruction.
struct Warp {
  Barrier barrier{32};
  uint32_t a[32][4], b[32][2];
  const __nv_bfloat16* row[32];
  float value[32];
};

// Shared memory's 32 banks of 4 bytes serve a warp's request in as many passes as the most
// distinct words it asks of one bank (the same word is broadcast); ldmatrix's each 8×8 matrix,
// 8 rows of 16 bytes, in one pass where its rows' words fall on distinct banks. The worst pass
// count over every fragment load (every one is an ldmatrix) of the kernels run since reset(): 1
// is free of bank conflicts.
struct BankCensus {
  int64_t matrices = 0;
  int worst_matrix = 0;
  void reset() { *this = BankCensus{}; }
};
inline BankCensus bank_census;

// The passes one request takes: each of `words` (word indices into shared memory) on bank word % 32.
inline int passes(const std::vector<size_t>& words) {
  std::vector<std::vector<size_t>> bank(32);
  int worst = 0;
  for (size_t w : words) {
    std::vector<size_t>& b = bank[w % 32];
    if (std::find(b.begin(), b.end(), w) == b.end()) b.push_back(w);
    worst = std::max(worst, static_cast<int>(b.size()));
  }
  return worst;
}

// The shared-memory faults of the kernels run since reset(), and the first one described.
struct SharedCensus {
  int64_t accesses = 0, async_copies = 0, hazards = 0, uninitialized = 0, misaligned = 0, unwaited = 0;
  std::string first;
  void reset() { *this = SharedCensus{}; }
};
inline SharedCensus shared_census;

// Who last wrote a 4-byte word of shared memory and who read it, and in which barrier interval
// (the barrier's generation + 1; 0: never); the thread whose cp.async is still to land on it.
struct WordState {
  static constexpr int kManyReaders = -2;
  int writer = -1, reader = -1, in_flight = -1;
  unsigned written_in = 0, read_in = 0;
};

// A thread's cp.async copies: those issued since its last commit, then its committed groups,
// oldest first.
struct AsyncCopy {
  __nv_bfloat16* dst;
  const __nv_bfloat16* src;
  int src_bytes;
};
struct ThreadCopies {
  std::vector<AsyncCopy> issued;
  std::vector<std::vector<AsyncCopy>> groups;
};

struct Block {
  explicit Block(unsigned threads, size_t smem_bytes)
      : barrier(static_cast<int>(threads)), warps(threads / 32), smem(smem_bytes, 0xA5),  // garbage, as a GPU's
        words((smem_bytes + 3) / 4), copies(threads) {}
  Barrier barrier;
  std::vector<Warp> warps;
  std::vector<unsigned char> smem;
  std::vector<WordState> words;
  std::vector<ThreadCopies> copies;
};
inline Block* current_block = nullptr;
inline Warp& current_warp() { return current_block->warps[threadIdx.x / 32]; }
inline int lane_id() { return static_cast<int>(threadIdx.x % 32); }
inline size_t smem_offset(const void* p) {
  return static_cast<size_t>(static_cast<const unsigned char*>(p) - current_block->smem.data());
}

inline void shared_fault(int64_t& count, const std::string& what) {
  ++count;
  if (shared_census.first.empty())
    shared_census.first = what + " (thread " + std::to_string(threadIdx.x) + " of block (" +
                          std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) + "))";
}

// The offset of `bytes` of shared memory at p, which must lie inside the launch's and be
// `align`-byte aligned.
inline size_t checked_offset(const void* p, size_t bytes, size_t align) {
  SharedCensus& c = shared_census;
  Block& b = *current_block;
  const auto at = static_cast<const unsigned char*>(p) - b.smem.data();
  if (at < 0 || static_cast<size_t>(at) + bytes > b.smem.size()) {  // a GPU's fault: the kernel stops here
    std::fprintf(stderr, "cuda_sim: thread %u of block (%u, %u) accesses shared byte %td, outside the launch's %zu\n",
                 threadIdx.x, blockIdx.x, blockIdx.y, at, b.smem.size());
    std::abort();
  }
  const size_t off = static_cast<size_t>(at);
  if (off % align != 0)
    shared_fault(c.misaligned, std::to_string(bytes) + " bytes at shared byte " + std::to_string(off) +
                                   ", not " + std::to_string(align) + "-byte aligned");
  return off;
}

// A thread's access to `bytes` of shared memory at p, which must be `align`-byte aligned.
inline void access_shared(const void* p, size_t bytes, size_t align, bool write) {
  SharedCensus& c = shared_census;
  Block& b = *current_block;
  ++c.accesses;
  const size_t off = checked_offset(p, bytes, align);
  const unsigned interval = b.barrier.generation() + 1;
  const int t = static_cast<int>(threadIdx.x);
  for (size_t w = off / 4; w < (off + bytes + 3) / 4; ++w) {
    WordState& s = b.words[w];
    const auto hazard = [&](const char* kind, int other) {
      shared_fault(c.hazards, std::string(kind) + " of shared byte " + std::to_string(4 * w) + " by thread " +
                                  (other == WordState::kManyReaders ? std::string("s") : std::to_string(other)) +
                                  " with no __syncthreads between");
    };
    if (s.in_flight >= 0) {
      shared_fault(c.hazards, std::string(write ? "write" : "read") + " of shared byte " + std::to_string(4 * w) +
                                  " while thread " + std::to_string(s.in_flight) + "'s cp.async to it is in flight");
      continue;
    }
    if (write) {
      if (s.written_in == interval && s.writer != t) hazard("write after the write", s.writer);
      else if (s.read_in == interval && s.reader != t) hazard("write after the read", s.reader);
      s.writer = t, s.written_in = interval;
    } else {
      if (s.written_in == 0)
        shared_fault(c.uninitialized, "shared byte " + std::to_string(4 * w) + " read, never written");
      else if (s.written_in == interval && s.writer != t) hazard("read after the write", s.writer);
      if (s.read_in != interval) s.read_in = interval, s.reader = t;
      else if (s.reader != t) s.reader = WordState::kManyReaders;
    }
  }
}

// A thread's cp.async lands: the bytes copied (zeros past src_bytes), then written as the thread's.
inline void land(const AsyncCopy& copy) {
  Block& b = *current_block;
  const size_t off = smem_offset(copy.dst);
  for (size_t w = off / 4; w < off / 4 + 4; ++w) b.words[w].in_flight = -1;
  std::memset(static_cast<void*>(copy.dst), 0, 16);
  if (copy.src_bytes > 0) std::memcpy(static_cast<void*>(copy.dst), copy.src, static_cast<size_t>(copy.src_bytes));
  access_shared(copy.dst, 16, 16, true);
}

inline float half_of(uint32_t word, int upper) {
  __nv_bfloat16_raw raw;
  raw.x = upper ? uint16_t(word >> 16) : uint16_t(word & 0xffffu);
  return __bfloat162float(__nv_bfloat16(raw));
}
inline uint32_t bits_of(__nv_bfloat16 h) { return static_cast<__nv_bfloat16_raw>(h).x; }

// Runs fibers.body as block (bx, by) of `threads` threads, its fibers in turn until all return.
inline void run_block(unsigned bx, unsigned by, unsigned threads, size_t smem_bytes) {
  constexpr size_t kStack = 256 * 1024;
  Block block(threads, smem_bytes);
  current_block = &block, blockIdx = {bx, by, 0};
  fibers.context.resize(threads), fibers.stack.resize(threads), fibers.done.assign(threads, 0);
  for (unsigned t = 0; t < threads; ++t) {
    fibers.stack[t].resize(kStack);
    getcontext(&fibers.context[t]);
    fibers.context[t].uc_stack = {fibers.stack[t].data(), 0, kStack};
    fibers.context[t].uc_link = &fibers.host;
    makecontext(&fibers.context[t], run_fiber, 0);
  }
  for (unsigned left = threads; left > 0;)
    for (unsigned t = 0; t < threads; ++t) {
      if (fibers.done[t]) continue;
      fibers.current = t, threadIdx = {t, 0, 0};
      swapcontext(&fibers.host, &fibers.context[t]);
      left -= fibers.done[t];
    }
  for (unsigned t = 0; t < threads; ++t) {  // a kernel that ends with a copy in flight
    ThreadCopies& mine = block.copies[t];
    if (!mine.issued.empty() || !mine.groups.empty()) {
      threadIdx = {t, 0, 0};
      shared_fault(shared_census.unwaited, "a cp.async never waited for");
    }
  }
}

// Runs kernel() as a grid of blocks of `threads` threads, one block at a time.
template <typename Kernel>
void launch(unsigned grid_x, unsigned grid_y, unsigned threads, size_t smem_bytes, const Kernel& kernel) {
  gridDim = {grid_x, grid_y, 1}, blockDim = {threads, 1, 1};
  const std::function<void()> body = kernel;
  fibers.body = &body;
  for (unsigned by = 0; by < grid_y; ++by)
    for (unsigned bx = 0; bx < grid_x; ++bx) run_block(bx, by, threads, smem_bytes);
}

}  // namespace zero3d::cuda_sim

inline void __syncthreads() { zero3d::cuda_sim::current_block->barrier.wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  using namespace zero3d::cuda_sim;
  Warp& w = current_warp();
  w.value[lane_id()] = v;
  w.barrier.wait();
  const float r = w.value[lane_id() ^ lane_mask];
  w.barrier.wait();
  return r;
}

namespace zero3d::kernels::cuda_ptx {

// mma.m16n8k16, .bf16: a's element (r, k) is in lane 4·(r % 8) + (k % 8)/2, register r/8 + 2·(k/8),
// half k % 2; b's (k, n) in lane 4n + (k % 8)/2, register k/8, half k % 2; c's (r, n) in lane
// 4·(r % 8) + n/2, element 2·(r/8) + n % 2.
inline void mma_bf16_16x8x16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  using namespace zero3d::cuda_sim;
  Warp& w = current_warp();
  const int lane = lane_id();
  for (int i = 0; i < 4; ++i) w.a[lane][i] = a[i];
  w.b[lane][0] = b0, w.b[lane][1] = b1;
  w.barrier.wait();
  const auto A = [&](int r, int k) { return half_of(w.a[4 * (r % 8) + (k % 8) / 2][r / 8 + 2 * (k / 8)], k % 2); };
  const auto B = [&](int k, int n) { return half_of(w.b[4 * n + (k % 8) / 2][k / 8], k % 2); };
  float d[4];
  for (int i = 0; i < 4; ++i) {
    const int r = lane / 4 + 8 * (i / 2), n = 2 * (lane % 4) + i % 2;
    double sum = c[i];
    for (int k = 0; k < 16; ++k) sum += double(A(r, k)) * double(B(k, n));
    d[i] = float(sum);
  }
  w.barrier.wait();
  for (int i = 0; i < 4; ++i) c[i] = d[i];
}

// ldmatrix.m8n8 of M matrices (.x2, .x4; .trans when `trans`): lane l names row l % 8 of matrix
// l / 8 (with two matrices, lanes 16-31 name none); lane 4g + t receives, of matrix i, the stored
// elements [g][2t] (lower half) and [g][2t + 1], or transposed [2t][g] and [2t + 1][g].
template <int M>
inline void ldmatrix_rows(uint32_t (&m)[M], const __nv_bfloat16* row, bool trans) {
  using namespace zero3d::cuda_sim;
  Warp& w = current_warp();
  const int lane = lane_id(), g = lane / 4, t = lane % 4;
  if (lane < 8 * M) access_shared(row, 16, 16, false);
  w.row[lane] = row;
  w.barrier.wait();
  for (int i = 0; i < M; ++i)
    m[i] = trans ? bits_of(w.row[8 * i + 2 * t][g]) | bits_of(w.row[8 * i + 2 * t + 1][g]) << 16
                 : bits_of(w.row[8 * i + g][2 * t]) | bits_of(w.row[8 * i + g][2 * t + 1]) << 16;
  if (lane == 0)
    for (int i = 0; i < M; ++i) {  // matrix i's 8 rows of 4 words
      std::vector<size_t> words;
      for (int r = 0; r < 8; ++r)
        for (size_t k = 0; k < 4; ++k) words.push_back(smem_offset(w.row[8 * i + r]) / 4 + k);
      bank_census.worst_matrix = std::max(bank_census.worst_matrix, passes(words));
      ++bank_census.matrices;
    }
  w.barrier.wait();
}
inline void ldmatrix_x2(uint32_t (&m)[2], const __nv_bfloat16* row) { ldmatrix_rows(m, row, false); }
inline void ldmatrix_x4(uint32_t (&m)[4], const __nv_bfloat16* row) { ldmatrix_rows(m, row, false); }
inline void ldmatrix_x4_trans(uint32_t (&m)[4], const __nv_bfloat16* row) { ldmatrix_rows(m, row, true); }

// ex2.approx.ftz.f32: subnormal inputs read as 0 and subnormal results written as 0.
inline float ex2_approx(float x) {
  const float y = std::exp2(std::fpclassify(x) == FP_SUBNORMAL ? 0.0f : x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

inline unsigned char* dynamic_smem() { return zero3d::cuda_sim::current_block->smem.data(); }

inline void st_shared_b128(__nv_bfloat16* p, uint4 v) {
  zero3d::cuda_sim::access_shared(p, 16, 16, true);
  std::memcpy(static_cast<void*>(p), &v, 16);
}

inline float ld_shared_f32(const float* p) {
  zero3d::cuda_sim::access_shared(p, 4, 4, false);
  return *p;
}

inline void st_shared_f32(float* p, float v) {
  zero3d::cuda_sim::access_shared(p, 4, 4, true);
  *p = v;
}

// Issued: a write of the words now (it may land at once), and in flight, a hazard to any access,
// until cp_async_wait lands it (it may land as late as that).
inline void cp_async_16(__nv_bfloat16* dst, const __nv_bfloat16* src, int src_bytes) {
  using namespace zero3d::cuda_sim;
  SharedCensus& c = shared_census;
  ++c.async_copies;
  if (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % 16 != 0)
    shared_fault(c.misaligned, "a cp.async from a global address not 16-byte aligned");
  access_shared(dst, 16, 16, true);  // it may land at once: a write now, against this interval's readers
  const size_t off = smem_offset(dst);
  for (size_t w = off / 4; w < off / 4 + 4; ++w) current_block->words[w].in_flight = static_cast<int>(threadIdx.x);
  current_block->copies[threadIdx.x].issued.push_back({dst, src, src_bytes});
}

inline void cp_async_commit() {
  zero3d::cuda_sim::ThreadCopies& mine = zero3d::cuda_sim::current_block->copies[threadIdx.x];
  mine.groups.push_back(std::move(mine.issued));
  mine.issued.clear();
}

template <int N>
inline void cp_async_wait() {
  zero3d::cuda_sim::ThreadCopies& mine = zero3d::cuda_sim::current_block->copies[threadIdx.x];
  while (mine.groups.size() > N) {
    for (const zero3d::cuda_sim::AsyncCopy& copy : mine.groups.front()) zero3d::cuda_sim::land(copy);
    mine.groups.erase(mine.groups.begin());
  }
}

}  // namespace zero3d::kernels::cuda_ptx
