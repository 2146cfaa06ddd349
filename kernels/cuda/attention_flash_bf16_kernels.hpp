// attention_flash_bf16_kernels.hpp (CUDA) — the fused attention's device code: the kernels that
// attention_flash_bf16.cpp launches, included by it alone (and by tests/cuda_sim, which runs them
// on a CPU through a simulation of mma_sync.hpp's instructions).
//
// FlashAttention-2's register-resident form (T. Dao, 2023, §3.3): a block holds 64 rows (query
// rows, or keys for dK/dV) of one (batch, head) in four warps of 16 rows, and a warp keeps its
// rows' scores, probabilities and accumulators in the fragments of mma.sync.m16n8k16 itself. A
// score tile's accumulator fragment is, element for element, the A fragment of the product that
// follows it (PTX ISA, "Matrix Fragments for mma.m16n8k16"), so the online softmax runs on
// registers and P and dS reach the tensor cores without a store. Shared memory holds only the
// bf16 operands a block's warps share, each row padded by 16 bytes so that the 8 rows a fragment
// load touches fall on 8 different bank quadruples; every fragment comes by ldmatrix (its
// transposing form for operands read along their rows). The tiles a block walks (keys, or
// queries for dK/dV) are double buffered: the next one's copy goes out by cp.async before the
// warps compute on this one, so the load's latency hides behind the tensor cores' work
// (FlashAttention-2's kernels and CUTLASS's multistage main loop do the same).
//
// The kernels take the Llama family's layout too: H query heads over Hkv K/V heads (query head h
// reads K/V head h / (H/Hkv); qkv rows [q heads | k heads | v heads], (H + 2·Hkv)·hs wide) and a
// sliding window (Mistral: query t sees keys t − window < k ≤ t).
#pragma once

#include <cuda_bf16.h>
#include <vector_functions.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/mma_sync.hpp"

namespace zero3d::kernels::cuda_flash::device {

using bfloat = __nv_bfloat16;

constexpr int kRows = 64;  // rows of a block: query rows (forward, dQ) or keys (dK, dV)
constexpr int kWarps = 4;  // 16 rows each
constexpr int kThreads = 32 * kWarps;
constexpr int kPad = 8;  // bf16 a shared-memory row carries past its head size: 16 bytes
constexpr float kLog2e = 1.4426950408889634f;

// Where a (batch, query head)'s q, k and v sit in qkv's rows, and which keys a query sees.
struct Layout {
  int T, H, Hkv, window;
  __host__ __device__ int64_t width(int hs) const { return int64_t(H + 2 * Hkv) * hs; }  // a qkv row
  __device__ int group(int h) const { return h / (H / Hkv); }                   // its K/V head
  __device__ int64_t q_col(int h, int hs) const { return int64_t(h) * hs; }
  __device__ int64_t k_col(int g, int hs) const { return int64_t(H + g) * hs; }
  __device__ int64_t v_col(int g, int hs) const { return int64_t(H + Hkv + g) * hs; }
  // causal, inside the sequence, and inside the window where there is one
  __device__ bool visible(int query, int key) const {
    return key <= query && query < T && key < T && (window == 0 || key > query - window);
  }
  // Whether every query of [q_first, q_last] sees every key of [k_first, k_last]: the tile then
  // needs no mask.
  __device__ bool all_visible(int q_first, int q_last, int k_first, int k_last) const {
    return k_last <= q_first && q_last < T && (window == 0 || k_first > q_last - window);
  }
  // The first key block (a multiple of 64) a query block from q0 meets.
  __device__ int first_key_block(int q0) const {
    return window == 0 || q0 < window ? 0 : ((q0 - window + 1) / kRows) * kRows;
  }
  // The query blocks a key block from k0 meets end before this row.
  __device__ int query_end(int k0) const {
    return window == 0 ? T : min(T, k0 + kRows - 1 + window);
  }
};

template <typename T>
__device__ inline T narrow(float x);
template <>
__device__ inline float narrow<float>(float x) { return x; }
template <>
__device__ inline bfloat narrow<bfloat>(float x) { return __float2bfloat16_rn(x); }

// ---- shared-memory operands ------------------------------------------------------------------

// Eight consecutive elements as bf16 in one 16-byte word: one vector load where `vec` says the
// source is 16-byte aligned, element by element otherwise.
__device__ inline uint4 read8(const bfloat* src, bool vec) {
  if (vec) return *reinterpret_cast<const uint4*>(src);
  uint4 u;
  bfloat* e = reinterpret_cast<bfloat*>(&u);
  for (int j = 0; j < 8; ++j) e[j] = src[j];
  return u;
}
__device__ inline uint4 read8(const float* src, bool vec) {
  float x[8];
  if (vec) {
    const float4 a = reinterpret_cast<const float4*>(src)[0], b = reinterpret_cast<const float4*>(src)[1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    for (int j = 0; j < 8; ++j) x[j] = src[j];
  }
  uint4 u;
  bfloat* e = reinterpret_cast<bfloat*>(&u);
  for (int j = 0; j < 8; ++j) e[j] = __float2bfloat16_rn(x[j]);
  return u;
}

// dst[r][d] = bf16(src[(row0 + r)·ld + col + d]) for the ROWS rows of a tile (row stride
// HS + kPad), rows from `valid` on zero: consecutive threads take consecutive 8-element chunks
// of a row, so a warp reads whole rows.
template <int ROWS, int HS, typename S>
__device__ inline void load_tile(bfloat* dst, const S* src, int64_t row0, int valid, int64_t ld, int64_t col,
                                 bool vec) {
  constexpr int kChunks = HS / 8;
  for (int i = threadIdx.x; i < ROWS * kChunks; i += kThreads) {
    const int r = i / kChunks, d0 = (i % kChunks) * 8;
    const uint4 u = r < valid ? read8(src + (row0 + r) * ld + col + d0, vec) : make_uint4(0, 0, 0, 0);
    cuda_ptx::st_shared_b128(dst + r * (HS + kPad) + d0, u);
  }
}

// The tile of load_tile, staged: bf16 rows that start 16-byte aligned go by cp.async, straight
// into shared memory while the warps compute on the tile before (the copies land at the wait that
// covers their group), and anything else (fp32 rows to round, unaligned rows) through registers
// at once. Either way the caller commits, waits and __syncthreads before a warp reads the tile.
template <int ROWS, int HS, typename S>
__device__ inline void stage_tile(bfloat* dst, const S* src, int64_t row0, int valid, int64_t ld, int64_t col,
                                  bool vec) {
  if constexpr (std::is_same<S, bfloat>::value) {
    if (vec) {
      constexpr int kChunks = HS / 8;
      for (int i = threadIdx.x; i < ROWS * kChunks; i += kThreads) {
        const int r = i / kChunks, d0 = (i % kChunks) * 8;
        const bool in = r < valid;  // rows past the sequence: zeros, nothing read
        cuda_ptx::cp_async_16(dst + r * (HS + kPad) + d0, src + (row0 + (in ? r : 0)) * ld + col + d0, in ? 16 : 0);
      }
      return;
    }
  }
  load_tile<ROWS, HS>(dst, src, row0, valid, ld, col, vec);
}

// ---- tensor-core fragments (PTX ISA, mma.m16n8k16 with .bf16 operands) -------------------------
// Lane 4·g + t holds rows g and g + 8 of a tile and, of each 8 columns, columns 2t and 2t + 1.
struct Lane {
  int g, t;
};
__device__ inline Lane lane_of() { return {int(threadIdx.x % 32) / 4, int(threadIdx.x % 4)}; }

// A fragment register from two fp32 values rounded to bf16, the lower column in the lower half:
// one cvt.rn.bf16x2.f32 where two roundings and the packing took four instructions.
__device__ inline uint32_t pack(float lo, float hi) {
  const __nv_bfloat162 two = __floats2bfloat162_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &two, sizeof bits);
  return bits;
}

// The B fragments of two 16×8 tiles, columns n0.. and n0 + 8.., of a [K][N] operand stored row-major
// (row stride ld): ldmatrix's transposing load, lanes 0-15 naming rows k0..k0 + 15 at column n0 and
// lanes 16-31 the same rows at n0 + 8. b[0], b[1] serve the first tile, b[2], b[3] the second.
__device__ inline void load_b_transposed(uint32_t (&b)[4], const bfloat* tile, int ld, int k0, int n0) {
  const int lane = threadIdx.x % 32;
  cuda_ptx::ldmatrix_x4_trans(b, tile + (k0 + lane % 16) * ld + n0 + (lane / 16) * 8);
}

// The B fragment of the 16×8 tile at columns n0.. of an operand stored as the rows of its transpose,
// bt [N][K] (row stride ld): ldmatrix's untransposed load of matrices (n0, k0) and (n0, k0 + 8),
// named by lanes 0-7 and 8-15. (Its four-matrix form would serve two tiles an instruction, but
// ptxas then hoists the loads and a thread's registers grow by a third: 105 → 137 in the
// head-size-64 forward, an SM's fourth block lost.)
__device__ inline void load_b_rows(uint32_t (&b)[2], const bfloat* bt, int ld, int k0, int n0) {
  const int lane = threadIdx.x % 32;
  cuda_ptx::ldmatrix_x2(b, bt + (n0 + lane % 8) * ld + k0 + (lane / 8) % 2 * 8);
}

// A fragments from a row-major bf16 tile: rows r0..r0 + 15 of row stride ld, in one ldmatrix whose
// matrices (r0, k0), (r0 + 8, k0), (r0, k0 + 8), (r0 + 8, k0 + 8) are a[0]..a[3].
struct RowsOf {
  const bfloat* tile;
  int ld, r0;
  __device__ void operator()(uint32_t (&a)[4], int k0) const {
    const int lane = threadIdx.x % 32;
    cuda_ptx::ldmatrix_x4(a, tile + (r0 + lane % 16) * ld + k0 + (lane / 16) * 8);
  }
};

// A fragments from an earlier product's fp32 accumulators p (16×K: K/8 tiles), rounded to bf16.
template <int K>
struct Rounded {
  const float (&p)[K / 8][4];
  __device__ void operator()(uint32_t (&a)[4], int k0) const {
    const int j = k0 / 8;
    a[0] = pack(p[j][0], p[j][1]), a[1] = pack(p[j][2], p[j][3]);
    a[2] = pack(p[j + 1][0], p[j + 1][1]), a[3] = pack(p[j + 1][2], p[j + 1][3]);
  }
};

// acc (16×N) += A·B over K, B stored as the rows of its transpose, bt [N][K] (row stride ld).
template <int N, int K, typename A>
__device__ inline void product_bt(float (&acc)[N / 8][4], const A& a_of, const bfloat* bt, int ld) {
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t a[4];
    a_of(a, k0);
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      uint32_t bb[2];
      load_b_rows(bb, bt, ld, k0, j * 8);
      cuda_ptx::mma_bf16_16x8x16(acc[j], a, bb[0], bb[1]);
    }
  }
}

// acc (16×N) += A·B over K, B stored row-major, b [K][N] (row stride ld).
template <int N, int K, typename A>
__device__ inline void product_b(float (&acc)[N / 8][4], const A& a_of, const bfloat* b, int ld) {
#pragma unroll
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t a[4];
    a_of(a, k0);
#pragma unroll
    for (int j = 0; j < N / 8; j += 2) {
      uint32_t bb[4];
      load_b_transposed(bb, b, ld, k0, j * 8);
      cuda_ptx::mma_bf16_16x8x16(acc[j], a, bb[0], bb[1]);
      cuda_ptx::mma_bf16_16x8x16(acc[j + 1], a, bb[2], bb[3]);
    }
  }
}

template <int N>
__device__ inline void zero(float (&acc)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
}

// The sum over a row's four lanes (lanes 4g..4g + 3 hold row g's columns).
__device__ inline float row_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ inline float row_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// f(rh, d, x) for each element x of a lane's share of a 16×HS accumulator (row rows[rh], column d)
// whose row lies inside the sequence: the kernels' stores.
template <int HS, typename F>
__device__ inline void for_each_stored(const float (&acc)[HS / 8][4], const int (&rows)[2], int T, Lane l, F f) {
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    if (rows[rh] >= T) continue;
#pragma unroll
    for (int n = 0; n < HS / 8; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) f(rh, n * 8 + 2 * l.t + e, acc[n][2 * rh + e]);
  }
}

// A query-row kernel's place in its grid (query blocks, B·H), the last query block first (it meets
// the most keys): the lane's fragment coordinates l; the sequence length T and the row widths of
// the output (C = H·hs) and of qkv (W); the (batch, query head) bh, the head h and its K/V head g;
// the block's first row q0 and the warp's rw (row r16 of the block); the lane's rows of the warp's
// tile (its fragments' g and g + 8); the sequence's first row in qkv.
struct QueryBlock {
  Lane l;
  int T;
  int64_t C, W;
  int bh, h, g, q0, r16, rw, rows[2];
  int64_t row0;
  __device__ QueryBlock(const Layout& lay, int hs)
      : l(lane_of()), T(lay.T), C(int64_t(lay.H) * hs), W(lay.width(hs)), bh(blockIdx.y), h(bh % lay.H),
        g(lay.group(h)), q0((gridDim.x - 1 - blockIdx.x) * kRows), r16(threadIdx.x / 32 * 16), rw(q0 + r16),
        rows{rw + l.g, rw + l.g + 8}, row0(int64_t(bh / lay.H) * lay.T) {}
};

// K and V of key block k0 for a query block `at`, into buffer buf of skv (K at skv + 2·buf·kRows·LD,
// V kRows·LD on), as one cp.async group: the forward's and dQ's walk over the keys.
template <int HS, typename QT>
__device__ inline void stage_key_block(bfloat* skv, int buf, const QT* qkv, const QueryBlock& at, const Layout& lay,
                                       int k0, bool vec) {
  constexpr int LD = HS + kPad;
  bfloat* sk = skv + 2 * buf * kRows * LD;
  stage_tile<kRows, HS>(sk, qkv, at.row0 + k0, at.T - k0, at.W, lay.k_col(at.g, HS), vec);
  stage_tile<kRows, HS>(sk + kRows * LD, qkv, at.row0 + k0, at.T - k0, at.W, lay.v_col(at.g, HS), vec);
  cuda_ptx::cp_async_commit();
}

// ---- forward -----------------------------------------------------------------------------------

// Q, and K and V twice: the key block the warps compute on and the next, in flight meanwhile.
template <int HS>
constexpr size_t forward_smem() {
  return 5 * kRows * (HS + kPad) * sizeof(bfloat);
}

// grid (query blocks, B·H): QueryBlock.
template <int HS, typename OT, typename QT>
__global__ void __launch_bounds__(kThreads) forward_kernel(OT* out, float* lse, bfloat* osave, const QT* qkv,
                                                           Layout lay, float scale, bool vec) {
  constexpr int LD = HS + kPad;
  unsigned char* smem = cuda_ptx::dynamic_smem();
  bfloat* sq = reinterpret_cast<bfloat*>(smem);
  bfloat* const skv = sq + kRows * LD;  // buffer b: K at skv + 2b·kRows·LD, V kRows·LD on
  const QueryBlock at(lay, HS);
  const float scale2 = scale * kLog2e;
  // keys from first_key and below last_key meet some row of the block
  const int first_key = lay.first_key_block(at.q0), last_key = min(at.q0 + kRows, at.T);
  stage_tile<kRows, HS>(sq, qkv, at.row0 + at.q0, at.T - at.q0, at.W, lay.q_col(at.h, HS), vec);
  stage_key_block<HS>(skv, 0, qkv, at, lay, first_key, vec);
  const RowsOf q_rows{sq, LD, at.r16};
  float o[HS / 8][4];
  zero(o);
  float m[2] = {-INFINITY, -INFINITY}, lsum[2] = {0.0f, 0.0f};  // lsum: this lane's columns' share
  for (int k0 = first_key, buf = 0; k0 < last_key; k0 += kRows, buf ^= 1) {
    // the next key block's copy goes out before this one's is waited for, to fly while the warps compute
    if (k0 + kRows < last_key)
      stage_key_block<HS>(skv, buf ^ 1, qkv, at, lay, k0 + kRows, vec), cuda_ptx::cp_async_wait<1>();
    else cuda_ptx::cp_async_wait<0>();
    __syncthreads();  // this key block (and Q) landed, for every warp
    const bfloat *sk = skv + 2 * buf * kRows * LD, *sv = sk + kRows * LD;
    float s[kRows / 8][4];
    zero(s);
    product_bt<kRows, HS>(s, q_rows, sk, LD);  // S = Q·Kᵀ
    const bool whole = lay.all_visible(at.rw, at.rw + 15, k0, k0 + kRows - 1);
    // online softmax of the lane's two rows over this block's visible keys (with a window a row may
    // see none of them yet: m stays -inf, the sums and O 0)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kRows / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[j][2 * rh + e];
          if (!whole && !lay.visible(at.rows[rh], k0 + j * 8 + 2 * at.l.t + e)) x = -INFINITY;
          mx = fmaxf(mx, x);
        }
      const float mnew = fmaxf(m[rh], row_max(mx));
      // The max scaled, 0 while the row has met no visible key (every score -inf: exp2(-inf) is
      // then 0, not NaN), so each probability is one FFMA and one ex2 (FlashAttention-2's
      // softmax_rescale_o). alpha is 0 on the row's first block with a visible key (m = -inf);
      // before it, nothing to rescale.
      const float mscaled = mnew == -INFINITY ? 0.0f : mnew * scale2;
      const float alpha = cuda_ptx::ex2_approx(m[rh] * scale2 - mscaled);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kRows / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[j][2 * rh + e];
          x = cuda_ptx::ex2_approx(fmaf(x, scale2, -mscaled));
          sum += x;
        }
      lsum[rh] = lsum[rh] * alpha + sum;
      m[rh] = mnew;
#pragma unroll
      for (int n = 0; n < HS / 8; ++n) o[n][2 * rh] *= alpha, o[n][2 * rh + 1] *= alpha;
    }
    product_b<HS, kRows>(o, Rounded<kRows>{s}, sv, LD);  // O += P·V
    __syncthreads();  // every warp is done with buf: the next iteration's copy goes into it
  }
  const float total[2] = {row_sum(lsum[0]), row_sum(lsum[1])}, inv[2] = {1.0f / total[0], 1.0f / total[1]};
  for_each_stored<HS>(o, at.rows, at.T, at.l, [&](int rh, int d, float x) {
    const float y = x * inv[rh];
    out[(at.row0 + at.rows[rh]) * at.C + int64_t(at.h) * HS + d] = narrow<OT>(y);
    osave[(int64_t(at.bh) * at.T + at.rows[rh]) * HS + d] = __float2bfloat16_rn(y);
  });
  for (int rh = 0; rh < 2; ++rh)
    if (at.rows[rh] < at.T && at.l.t == 0) lse[int64_t(at.bh) * at.T + at.rows[rh]] = m[rh] * scale + logf(total[rh]);
}

// ---- backward ----------------------------------------------------------------------------------

// D[bh][t] = Σ_d dO[b][t][h·hs + d]·O[bh][t][d]: one warp per row.
template <int HS>
__global__ void __launch_bounds__(kThreads) row_dot_kernel(float* dd, const bfloat* dout, const bfloat* osave, int T,
                                                           int H, int64_t rows) {
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t bh = row / T, t = row % T, b = bh / H, h = bh % H, C = int64_t(H) * HS;
  float dot = 0.0f;
  for (int d = lane; d < HS; d += 32)
    dot += __bfloat162float(dout[(b * T + t) * C + h * HS + d]) * __bfloat162float(osave[row * HS + d]);
  for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (lane == 0) dd[row] = dot;
}

// The dK/dV kernel's query blocks: 64 queries at head size 64; 32 at 128, where the two [16][128]
// fp32 accumulators take 128 registers a lane already.
template <int HS>
constexpr int kDkdvQueries = HS > 64 ? 32 : 64;

// K and V; Q, dO, L and D twice: the query block the warps compute on and the next.
template <int HS>
constexpr size_t dkdv_smem() {
  constexpr int BN = kDkdvQueries<HS>;
  return (2 * kRows + 4 * BN) * (HS + kPad) * sizeof(bfloat) + 4 * BN * sizeof(float);
}

// grid (key blocks, B·Hkv): dK and dV of 64 keys of one K/V head, over its group's query heads
// in head order and, for each, the query blocks from the keys' own on (to the window's end):
// one owner per sum, a fixed order (the CPU kernel sums the group in head order too). A warp's
// tiles are transposed: rows are its 16 keys, columns the block's queries.
template <int HS, typename QT>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(float* dqkv, const bfloat* dout, const QT* qkv, const float* lse,
                                                        const float* dd, Layout lay, float scale, bool vec_qkv,
                                                        bool vec_dout) {
  constexpr int LD = HS + kPad, BN = kDkdvQueries<HS>;
  static_assert(2 * BN <= kThreads, "a thread for each L and D of a query block");
  unsigned char* smem = cuda_ptx::dynamic_smem();
  bfloat* sk = reinterpret_cast<bfloat*>(smem);
  bfloat* sv = sk + kRows * LD;
  // buffer b: Q at sqdo + 2b·BN·LD, dO BN·LD on; L at sld + 2b·BN, D BN on
  bfloat* const sqdo = sv + kRows * LD;
  float* const sld = reinterpret_cast<float*>(sqdo + 4 * BN * LD);
  const Lane l = lane_of();
  const int warp = threadIdx.x / 32, T = lay.T, H = lay.H, group_size = H / lay.Hkv;
  const int64_t C = int64_t(H) * HS, W = lay.width(HS);
  const int bg = blockIdx.y, b = bg / lay.Hkv, g = bg % lay.Hkv, k0 = blockIdx.x * kRows, kw = k0 + warp * 16;
  const int keys[2] = {kw + l.g, kw + l.g + 8};
  const int64_t row0 = int64_t(b) * T;
  const float scale2 = scale * kLog2e;
  // The query blocks these keys meet, head by head of the group: (h, q0), q0 from k0 on by BN.
  const int h_end = (g + 1) * group_size, q_end = lay.query_end(k0);
  // Q and dO of a query block into buffer buf, as one cp.async group.
  const auto stage_queries = [&](int h, int q0, int buf) {
    bfloat* sq = sqdo + 2 * buf * BN * LD;
    stage_tile<BN, HS>(sq, qkv, row0 + q0, T - q0, W, lay.q_col(h, HS), vec_qkv);
    stage_tile<BN, HS>(sq + BN * LD, dout, row0 + q0, T - q0, C, int64_t(h) * HS, vec_dout);
    cuda_ptx::cp_async_commit();
  };
  // Its L and D: thread i < 2·BN loads the i-th of [L | D] into a register as the block's copy goes
  // out and stores it (L scaled by log2 e) once the warps are done with the buffer, so the load
  // flies while they compute, where a store straight after it would wait for it.
  const auto load_l_or_d = [&](int h, int q0) {
    const int i = int(threadIdx.x) % BN, q = q0 + i;
    if (int(threadIdx.x) >= 2 * BN || q >= T) return 0.0f;
    const int64_t at = (int64_t(b) * H + h) * T + q;
    return int(threadIdx.x) < BN ? lse[at] : dd[at];
  };
  const auto store_l_or_d = [&](int buf, float x) {
    if (int(threadIdx.x) < 2 * BN)
      cuda_ptx::st_shared_f32(sld + 2 * buf * BN + threadIdx.x, int(threadIdx.x) < BN ? x * kLog2e : x);
  };
  stage_tile<kRows, HS>(sk, qkv, row0 + k0, T - k0, W, lay.k_col(g, HS), vec_qkv);
  stage_tile<kRows, HS>(sv, qkv, row0 + k0, T - k0, W, lay.v_col(g, HS), vec_qkv);
  stage_queries(g * group_size, k0, 0);
  store_l_or_d(0, load_l_or_d(g * group_size, k0));
  const RowsOf k_rows{sk, LD, warp * 16}, v_rows{sv, LD, warp * 16};
  float dk[HS / 8][4], dv[HS / 8][4];
  zero(dk);
  zero(dv);
  for (int h = g * group_size, q0 = k0, buf = 0; h < h_end; buf ^= 1) {
    const int h_next = q0 + BN < q_end ? h : h + 1, q_next = q0 + BN < q_end ? q0 + BN : k0;
    // the next query block's copy (and its L and D load) goes out before this one's is waited for
    const bool next = h_next < h_end;
    float next_l_or_d = 0.0f;
    if (next) {
      stage_queries(h_next, q_next, buf ^ 1);
      next_l_or_d = load_l_or_d(h_next, q_next);
      cuda_ptx::cp_async_wait<1>();
    } else {
      cuda_ptx::cp_async_wait<0>();
    }
    __syncthreads();  // this query block (and K, V) landed, for every warp
    const bfloat *sq = sqdo + 2 * buf * BN * LD, *sdo = sq + BN * LD;
    const float *sl = sld + 2 * buf * BN, *sd = sl + BN;
    float st[BN / 8][4], dpt[BN / 8][4];
    zero(st);
    zero(dpt);
    product_bt<BN, HS>(st, k_rows, sq, LD);   // Sᵀ = K·Qᵀ
    product_bt<BN, HS>(dpt, v_rows, sdo, LD);  // dPᵀ = V·dOᵀ
    const bool whole = lay.all_visible(q0, q0 + BN - 1, kw, kw + 15);
    // Pᵀ = exp(Sᵀ·scale − L) and dSᵀ = Pᵀ∘(dPᵀ − D), L and D those of each column's query
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = j * 8 + 2 * l.t + e;
        const float L = cuda_ptx::ld_shared_f32(sl + c), D = cuda_ptx::ld_shared_f32(sd + c);
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          float& p = st[j][2 * rh + e];
          p = whole || lay.visible(q0 + c, keys[rh]) ? cuda_ptx::ex2_approx(fmaf(p, scale2, -L)) : 0.0f;
          dpt[j][2 * rh + e] = p * (dpt[j][2 * rh + e] - D);
        }
      }
    product_b<HS, BN>(dv, Rounded<BN>{st}, sdo, LD);  // dV += Pᵀ·dO
    product_b<HS, BN>(dk, Rounded<BN>{dpt}, sq, LD);  // dK += dSᵀ·Q
    if (next) store_l_or_d(buf ^ 1, next_l_or_d);  // buf ^ 1 has been free since the last barrier
    __syncthreads();  // every warp is done with buf: the next iteration's copy goes into it
    h = h_next, q0 = q_next;
  }
  for_each_stored<HS>(dk, keys, T, l, [&](int rh, int d, float x) {
    dqkv[(row0 + keys[rh]) * W + lay.k_col(g, HS) + d] = x * scale;
  });
  for_each_stored<HS>(dv, keys, T, l,
                      [&](int rh, int d, float x) { dqkv[(row0 + keys[rh]) * W + lay.v_col(g, HS) + d] = x; });
}

// Q, dO, and K and V twice: the key block the warps compute on and the next.
template <int HS>
constexpr size_t dq_smem() {
  return 6 * kRows * (HS + kPad) * sizeof(bfloat);
}

// grid (query blocks, B·H), as QueryBlock says: dQ of 64 queries, over the key blocks up to their own.
template <int HS, typename QT>
__global__ void __launch_bounds__(kThreads) dq_kernel(float* dqkv, const bfloat* dout, const QT* qkv, const float* lse,
                                                      const float* dd, Layout lay, float scale, bool vec_qkv,
                                                      bool vec_dout) {
  constexpr int LD = HS + kPad;
  unsigned char* smem = cuda_ptx::dynamic_smem();
  bfloat* sq = reinterpret_cast<bfloat*>(smem);
  bfloat* sdo = sq + kRows * LD;
  bfloat* const skv = sdo + kRows * LD;  // buffer b: K at skv + 2b·kRows·LD, V kRows·LD on
  const QueryBlock at(lay, HS);
  const int first_key = lay.first_key_block(at.q0), last_key = min(at.q0 + kRows, at.T);
  stage_tile<kRows, HS>(sq, qkv, at.row0 + at.q0, at.T - at.q0, at.W, lay.q_col(at.h, HS), vec_qkv);
  stage_tile<kRows, HS>(sdo, dout, at.row0 + at.q0, at.T - at.q0, at.C, int64_t(at.h) * HS, vec_dout);
  stage_key_block<HS>(skv, 0, qkv, at, lay, first_key, vec_qkv);
  float L[2], D[2];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    L[rh] = at.rows[rh] < at.T ? lse[int64_t(at.bh) * at.T + at.rows[rh]] * kLog2e : 0.0f;
    D[rh] = at.rows[rh] < at.T ? dd[int64_t(at.bh) * at.T + at.rows[rh]] : 0.0f;
  }
  const RowsOf q_rows{sq, LD, at.r16}, do_rows{sdo, LD, at.r16};
  float dq[HS / 8][4];
  zero(dq);
  const float scale2 = scale * kLog2e;
  for (int k0 = first_key, buf = 0; k0 < last_key; k0 += kRows, buf ^= 1) {
    if (k0 + kRows < last_key)
      stage_key_block<HS>(skv, buf ^ 1, qkv, at, lay, k0 + kRows, vec_qkv), cuda_ptx::cp_async_wait<1>();
    else cuda_ptx::cp_async_wait<0>();
    __syncthreads();  // this key block (and Q, dO) landed, for every warp
    const bfloat *sk = skv + 2 * buf * kRows * LD, *sv = sk + kRows * LD;
    float s[kRows / 8][4], dp[kRows / 8][4];
    zero(s);
    zero(dp);
    product_bt<kRows, HS>(s, q_rows, sk, LD);    // S = Q·Kᵀ
    product_bt<kRows, HS>(dp, do_rows, sv, LD);  // dP = dO·Vᵀ
    const bool whole = lay.all_visible(at.rw, at.rw + 15, k0, k0 + kRows - 1);
#pragma unroll
    for (int j = 0; j < kRows / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          const float x = s[j][2 * rh + e];
          const bool seen = whole || lay.visible(at.rows[rh], k0 + j * 8 + 2 * at.l.t + e);
          const float p = seen ? cuda_ptx::ex2_approx(fmaf(x, scale2, -L[rh])) : 0.0f;
          dp[j][2 * rh + e] = p * (dp[j][2 * rh + e] - D[rh]);  // dS
        }
    product_b<HS, kRows>(dq, Rounded<kRows>{dp}, sk, LD);  // dQ += dS·K
    __syncthreads();  // every warp is done with buf: the next iteration's copy goes into it
  }
  for_each_stored<HS>(dq, at.rows, at.T, at.l, [&](int rh, int d, float x) {
    dqkv[(at.row0 + at.rows[rh]) * at.W + lay.q_col(at.h, HS) + d] = x * scale;
  });
}

}  // namespace zero3d::kernels::cuda_flash::device
