// attention_flash_bf16.cpp (CUDA) — see attention_flash_bf16.hpp.
//
// Each thread block holds 64 rows (query rows, or keys for dK/dV) of one (batch, head) in four
// warps of 16 rows; a warp's tiles of scores, probabilities and accumulators are its own
// shared-memory rows, so warps synchronise only to load the operands they share.
//
// The kernels take the Llama family's layout too: H query heads over Hkv K/V heads (query head h
// reads K/V head h / (H/Hkv); qkv rows [q heads | k heads | v heads], (H + 2·Hkv)·hs wide) and a
// sliding window (Mistral: query t sees keys t − window < k ≤ t). GPT-2 is Hkv = H, window 0: the
// same loops, the same order, the same bits as before the groups came.
#include "kernels/cuda/attention_flash_bf16.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <string>
#include <type_traits>

#include "base/errors.hpp"
#include "kernels/half.hpp"
#include "kernels/memory.hpp"

namespace zero3d::kernels::cuda_flash {

namespace {
using namespace nvcuda;
using bfloat = __nv_bfloat16;

constexpr int kRows = 64;               // rows of a block, keys (or queries) of a tile it meets
constexpr int kWarps = 4;               // 16 rows each
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;

// Where a (batch, query head)'s q, k and v sit in qkv's rows, and which keys a query sees.
struct Layout {
  int T, H, Hkv, window;
  __device__ int64_t width(int hs) const { return int64_t(H + 2 * Hkv) * hs; }  // a qkv row
  __device__ int group(int h) const { return h / (H / Hkv); }                   // its K/V head
  __device__ int64_t q_col(int h, int hs) const { return int64_t(h) * hs; }
  __device__ int64_t k_col(int g, int hs) const { return int64_t(H + g) * hs; }
  __device__ int64_t v_col(int g, int hs) const { return int64_t(H + Hkv + g) * hs; }
  // causal, inside the sequence, and inside the window where there is one
  __device__ bool visible(int query, int key) const {
    return key <= query && query < T && key < T && (window == 0 || key > query - window);
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

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bfloat, wmma::row_major>;
using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

__device__ inline float widen(float x) { return x; }
__device__ inline float widen(bfloat x) { return __bfloat162float(x); }
template <typename T>
__device__ inline T narrow(float x);
template <>
__device__ inline float narrow<float>(float x) { return x; }
template <>
__device__ inline bfloat narrow<bfloat>(float x) { return __float2bfloat16_rn(x); }

// dst[r][d] = bf16(src[(row0 + r)·ld + col + d]) for the rows below `valid`, zero rows after.
template <int HS, typename S>
__device__ inline void load_rows(bfloat* dst, const S* src, int64_t row0, int valid, int64_t ld, int64_t col) {
  for (int i = threadIdx.x; i < kRows * HS; i += kThreads) {
    const int r = i / HS, d = i % HS;
    dst[i] = __float2bfloat16_rn(r < valid ? widen(src[(row0 + r) * ld + col + d]) : 0.0f);
  }
}

// A warp's 16×N fp32 tile c (row stride ldc) = a·b, or c + a·b: a [16][K] bf16 rows (stride lda);
// b [K][N] stored row-major (Layout row_major) or as the rows of its transpose [N][K] (col_major),
// row stride ldb.
template <int N, int K, typename Layout, bool Accumulate>
__device__ inline void warp_product(float* c, int ldc, const bfloat* a, int lda, const bfloat* b, int ldb) {
  constexpr bool row_major = std::is_same<Layout, wmma::row_major>::value;
  for (int n = 0; n < N / 16; ++n) {
    FragAcc acc;
    if constexpr (Accumulate) wmma::load_matrix_sync(acc, c + n * 16, ldc, wmma::mem_row_major);
    else wmma::fill_fragment(acc, 0.0f);
    for (int k = 0; k < K / 16; ++k) {
      FragA fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bfloat, Layout> fb;
      wmma::load_matrix_sync(fa, a + k * 16, lda);
      wmma::load_matrix_sync(fb, row_major ? b + k * 16 * ldb + n * 16 : b + n * 16 * ldb + k * 16, ldb);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + n * 16, acc, ldc, wmma::mem_row_major);
  }
}

// out[r][n] = Σ_d a[r][d]·b[n][d] over a warp's 16 rows and a block's 64: a [16][HS], b [64][HS]
// (read transposed), out's row stride 64.
template <int HS>
__device__ inline void rows_times_rows_t(float* out, const bfloat* a, const bfloat* b) {
  warp_product<kRows, HS, wmma::col_major, false>(out, kRows, a, HS, b, HS);
}

// acc[r][d] += Σ_j p[r][j]·b[j][d]: p a warp's [16][64] tile, b [64][HS] rows, acc's row stride HS.
template <int HS>
__device__ inline void accumulate_tile_times_rows(float* acc, const bfloat* p, const bfloat* b) {
  warp_product<HS, kRows, wmma::row_major, true>(acc, HS, p, kRows, b, HS);
}

template <int HS>
constexpr size_t forward_smem() {
  return 3 * kRows * HS * sizeof(bfloat) + kRows * kRows * (sizeof(float) + sizeof(bfloat)) + kRows * HS * sizeof(float);
}

// grid (query blocks, B·H). Lane pairs share a row: lane 2r and 2r+1 of a warp take row r's
// key columns 0-31 and 32-63 (and halves of its output), and combine through a shuffle.
template <int HS, typename OT, typename QT>
__global__ void __launch_bounds__(kThreads) forward_kernel(OT* out, float* lse, bfloat* osave, const QT* qkv,
                                                           Layout lay, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  bfloat* sq = reinterpret_cast<bfloat*>(smem);
  bfloat* sk = sq + kRows * HS;
  bfloat* sv = sk + kRows * HS;
  float* ss = reinterpret_cast<float*>(sv + kRows * HS);  // scores [64][64]
  bfloat* sp = reinterpret_cast<bfloat*>(ss + kRows * kRows);  // probabilities [64][64]
  float* so = reinterpret_cast<float*>(sp + kRows * kRows);  // output [64][HS]
  const int T = lay.T, H = lay.H;
  const int64_t C = int64_t(H) * HS, W = lay.width(HS);
  const int bh = blockIdx.y, b = bh / H, h = bh % H, g = lay.group(h), q0 = blockIdx.x * kRows;
  const int64_t row0 = int64_t(b) * T;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = warp * 16 + lane / 2, half = lane % 2;
  const int q = q0 + r;
  const float scale2 = scale * kLog2e;
  load_rows<HS>(sq, qkv, row0 + q0, T - q0, W, lay.q_col(h, HS));
  for (int i = threadIdx.x; i < kRows * HS; i += kThreads) so[i] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const int last_key = min(q0 + kRows, T);  // keys below it meet some row of the block
  for (int k0 = lay.first_key_block(q0); k0 < last_key; k0 += kRows) {
    __syncthreads();  // every warp is done with the previous keys
    load_rows<HS>(sk, qkv, row0 + k0, T - k0, W, lay.k_col(g, HS));
    load_rows<HS>(sv, qkv, row0 + k0, T - k0, W, lay.v_col(g, HS));
    __syncthreads();
    rows_times_rows_t<HS>(ss + warp * 16 * kRows, sq + warp * 16 * HS, sk);
    __syncwarp();
    // online softmax of row r over this block's visible keys (without a window key k0 is one
    // of them; with one a row may see none of a block's keys yet: m stays -inf, l and O 0)
    const float* srow = ss + r * kRows + half * 32;
    bfloat* prow = sp + r * kRows + half * 32;
    const int kfirst = k0 + half * 32;
    // Column c + lane (mod 32): the lanes of a warp read 32 different shared-memory banks where
    // the same c would put all of them on one (rows are 64 floats apart).
    float mx = -INFINITY;
    for (int i = 0; i < 32; ++i) {
      const int c = (i + lane) & 31;
      if (lay.visible(q, kfirst + c)) mx = fmaxf(mx, srow[c]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float mnew = fmaxf(m, mx);
    // 0 on the row's first block with a visible key (m = -inf); before it, nothing to rescale
    const float alpha = mnew == -INFINITY ? 0.0f : exp2f((m - mnew) * scale2);
    float sum = 0.0f;
    for (int i = 0; i < 32; ++i) {
      const int c = (i + lane) & 31;
      const float p = lay.visible(q, kfirst + c) ? exp2f((srow[c] - mnew) * scale2) : 0.0f;
      prow[c] = __float2bfloat16_rn(p);
      sum += p;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = mnew;
    float* orow = so + r * HS + half * (HS / 2);
    for (int i = 0; i < HS / 2; ++i) orow[(i + lane) % (HS / 2)] *= alpha;
    __syncwarp();
    accumulate_tile_times_rows<HS>(so + warp * 16 * HS, sp + warp * 16 * kRows, sv);
    __syncwarp();
  }
  if (q >= T) return;
  const float inv = 1.0f / l;
  for (int d = half * (HS / 2); d < (half + 1) * (HS / 2); ++d) {
    const float y = so[r * HS + d] * inv;
    out[(row0 + q) * C + int64_t(h) * HS + d] = narrow<OT>(y);
    osave[(int64_t(bh) * T + q) * HS + d] = __float2bfloat16_rn(y);
  }
  if (half == 0) lse[int64_t(bh) * T + q] = m * scale + logf(l);
}

// D[bh][t] = Σ_d bf16(dO[b][t][h·hs + d])·O[bh][t][d]: one warp per row.
template <int HS>
__global__ void __launch_bounds__(kThreads) row_dot_kernel(float* dd, const float* dout, const bfloat* osave, int T,
                                                           int H, int64_t rows) {
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t bh = row / T, t = row % T, b = bh / H, h = bh % H, C = int64_t(H) * HS;
  float dot = 0.0f;
  for (int d = lane; d < HS; d += 32)
    dot += __bfloat162float(__float2bfloat16_rn(dout[(b * T + t) * C + h * HS + d])) *
           __bfloat162float(osave[row * HS + d]);
  for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (lane == 0) dd[row] = dot;
}

template <int HS>
constexpr size_t backward_smem() {
  // four bf16 operand blocks, two fp32 tiles, two bf16 tiles, an fp32 [64][HS] accumulator pair,
  // and L, D of 64 rows
  return 4 * kRows * HS * sizeof(bfloat) + 2 * kRows * kRows * sizeof(float) + 2 * kRows * kRows * sizeof(bfloat) +
         2 * kRows * HS * sizeof(float) + 2 * kRows * sizeof(float);
}

// The backward kernels' shared memory as backward_smem() sizes it: four bf16 operand blocks
// [64][HS], the fp32 tiles S and dP and the bf16 tiles P and dS [64][64] (a warp's 16 rows each),
// two fp32 accumulators [64][HS], and L and D of the 64 query rows in play.
template <int HS>
struct BackwardSmem {
  bfloat* operand[4];
  float *s, *dp;
  bfloat *p, *ds;
  float* acc[2];
  float *l, *d;
  __device__ explicit BackwardSmem(unsigned char* base) {
    bfloat* b = reinterpret_cast<bfloat*>(base);
    for (int i = 0; i < 4; ++i) operand[i] = b + i * kRows * HS;
    s = reinterpret_cast<float*>(b + 4 * kRows * HS);
    dp = s + kRows * kRows;
    p = reinterpret_cast<bfloat*>(dp + kRows * kRows);
    ds = p + kRows * kRows;
    acc[0] = reinterpret_cast<float*>(ds + kRows * kRows);
    acc[1] = acc[0] + kRows * HS;
    l = acc[1] + kRows * HS;
    d = l + kRows;
  }
};

// The tile of a warp's 16 rows once the fp32 tiles s (scores) and dp are in place: p = exp(s·scale
// − L) where `keep`, dS = p∘(dp − D), as bf16 in pb and dsb. For dK/dV the rows are keys and the
// columns queries (transposed: `rows_are_keys`), for dQ the other way round.
template <bool rows_are_keys>
__device__ inline void probabilities_and_ds(bfloat* pb, bfloat* dsb, const float* s, const float* dp, const float* sl,
                                            const float* sd, int row_pos, int col0, int r, int half,
                                            const Layout& lay, float scale) {
  const float scale2 = scale * kLog2e;
  for (int i = 0; i < 32; ++i) {
    const int c = half * 32 + ((i + threadIdx.x) & 31);  // one bank per lane, as in the forward
    const int col = col0 + c;
    const int query = rows_are_keys ? col : row_pos, key = rows_are_keys ? row_pos : col;
    const int qi = rows_are_keys ? c : r;  // the query's index into sl and sd
    const bool keep = lay.visible(query, key);
    const float p = keep ? exp2f(s[r * kRows + c] * scale2 - sl[qi] * kLog2e) : 0.0f;
    pb[r * kRows + c] = __float2bfloat16_rn(p);
    dsb[r * kRows + c] = __float2bfloat16_rn(p * (dp[r * kRows + c] - sd[qi]));
  }
}

// grid (key blocks, B·Hkv): dK and dV of 64 keys of one K/V head, over its group's query heads
// in head order and, for each, the query blocks from the keys' own on (to the window's end):
// one owner per sum, a fixed order (the CPU kernel sums the group in head order too).
template <int HS, typename QT>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(float* dqkv, const float* dout, const QT* qkv, const float* lse,
                                                        const float* dd, Layout lay, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  const BackwardSmem<HS> m(smem);
  bfloat *sk = m.operand[0], *sv = m.operand[1], *sq = m.operand[2], *sdo = m.operand[3], *sp = m.p, *sds = m.ds;
  float *ss = m.s, *sdp = m.dp, *sdk = m.acc[0], *sdv = m.acc[1], *sl = m.l, *sd = m.d;  // S, dP transposed: [key][query]
  const int T = lay.T, H = lay.H, group_size = H / lay.Hkv;
  const int64_t C = int64_t(H) * HS, W = lay.width(HS);
  const int bg = blockIdx.y, b = bg / lay.Hkv, g = bg % lay.Hkv, k0 = blockIdx.x * kRows;
  const int64_t row0 = int64_t(b) * T;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = warp * 16 + lane / 2, half = lane % 2;
  load_rows<HS>(sk, qkv, row0 + k0, T - k0, W, lay.k_col(g, HS));
  load_rows<HS>(sv, qkv, row0 + k0, T - k0, W, lay.v_col(g, HS));
  for (int i = threadIdx.x; i < kRows * HS; i += kThreads) sdk[i] = sdv[i] = 0.0f;
  const int q_end = lay.query_end(k0);
  for (int h = g * group_size; h < (g + 1) * group_size; ++h) {
    const int64_t bh = int64_t(b) * H + h;
    for (int q0 = k0; q0 < q_end; q0 += kRows) {
      __syncthreads();
      load_rows<HS>(sq, qkv, row0 + q0, T - q0, W, lay.q_col(h, HS));
      load_rows<HS>(sdo, dout, row0 + q0, T - q0, C, int64_t(h) * HS);
      for (int i = threadIdx.x; i < kRows; i += kThreads) {
        sl[i] = q0 + i < T ? lse[bh * T + q0 + i] : 0.0f;
        sd[i] = q0 + i < T ? dd[bh * T + q0 + i] : 0.0f;
      }
      __syncthreads();
      rows_times_rows_t<HS>(ss + warp * 16 * kRows, sk + warp * 16 * HS, sq);    // Sᵀ = K·Qᵀ
      rows_times_rows_t<HS>(sdp + warp * 16 * kRows, sv + warp * 16 * HS, sdo);  // dPᵀ = V·dOᵀ
      __syncwarp();
      probabilities_and_ds<true>(sp, sds, ss, sdp, sl, sd, k0 + r, q0, r, half, lay, scale);
      __syncwarp();
      accumulate_tile_times_rows<HS>(sdv + warp * 16 * HS, sp + warp * 16 * kRows, sdo);  // dV += Pᵀ·dO
      accumulate_tile_times_rows<HS>(sdk + warp * 16 * HS, sds + warp * 16 * kRows, sq);  // dK += dSᵀ·Q
      __syncwarp();
    }
  }
  const int key = k0 + r;
  if (key >= T) return;
  for (int d = half * (HS / 2); d < (half + 1) * (HS / 2); ++d) {
    dqkv[(row0 + key) * W + lay.k_col(g, HS) + d] = sdk[r * HS + d] * scale;
    dqkv[(row0 + key) * W + lay.v_col(g, HS) + d] = sdv[r * HS + d];
  }
}

// grid (query blocks, B·H): dQ of 64 queries, over the key blocks up to their own.
template <int HS, typename QT>
__global__ void __launch_bounds__(kThreads) dq_kernel(float* dqkv, const float* dout, const QT* qkv, const float* lse,
                                                      const float* dd, Layout lay, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  const BackwardSmem<HS> m(smem);
  bfloat *sq = m.operand[0], *sdo = m.operand[1], *sk = m.operand[2], *sv = m.operand[3], *sp = m.p, *sds = m.ds;
  float *ss = m.s, *sdp = m.dp, *sdq = m.acc[0], *sl = m.l, *sd = m.d;  // S, dP: [query][key]
  const int T = lay.T, H = lay.H;
  const int64_t C = int64_t(H) * HS, W = lay.width(HS);
  const int bh = blockIdx.y, b = bh / H, h = bh % H, g = lay.group(h), q0 = blockIdx.x * kRows;
  const int64_t row0 = int64_t(b) * T;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = warp * 16 + lane / 2, half = lane % 2;
  load_rows<HS>(sq, qkv, row0 + q0, T - q0, W, lay.q_col(h, HS));
  load_rows<HS>(sdo, dout, row0 + q0, T - q0, C, int64_t(h) * HS);
  for (int i = threadIdx.x; i < kRows * HS; i += kThreads) sdq[i] = 0.0f;
  for (int i = threadIdx.x; i < kRows; i += kThreads) {
    sl[i] = q0 + i < T ? lse[int64_t(bh) * T + q0 + i] : 0.0f;
    sd[i] = q0 + i < T ? dd[int64_t(bh) * T + q0 + i] : 0.0f;
  }
  const int last_key = min(q0 + kRows, T);
  for (int k0 = lay.first_key_block(q0); k0 < last_key; k0 += kRows) {
    __syncthreads();
    load_rows<HS>(sk, qkv, row0 + k0, T - k0, W, lay.k_col(g, HS));
    load_rows<HS>(sv, qkv, row0 + k0, T - k0, W, lay.v_col(g, HS));
    __syncthreads();
    rows_times_rows_t<HS>(ss + warp * 16 * kRows, sq + warp * 16 * HS, sk);    // S = Q·Kᵀ
    rows_times_rows_t<HS>(sdp + warp * 16 * kRows, sdo + warp * 16 * HS, sv);  // dP = dO·Vᵀ
    __syncwarp();
    probabilities_and_ds<false>(sp, sds, ss, sdp, sl, sd, q0 + r, k0, r, half, lay, scale);
    __syncwarp();
    accumulate_tile_times_rows<HS>(sdq + warp * 16 * HS, sds + warp * 16 * kRows, sk);  // dQ += dS·K
    __syncwarp();
  }
  const int q = q0 + r;
  if (q >= T) return;
  for (int d = half * (HS / 2); d < (half + 1) * (HS / 2); ++d)
    dqkv[(row0 + q) * W + lay.q_col(h, HS) + d] = sdq[r * HS + d] * scale;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw SystemError(std::string("fused attention: ") + what + ": " + cudaGetErrorString(e));
}

cudaStream_t stream() { return Kokkos::DefaultExecutionSpace().cuda_stream(); }

// Shared memory past 48 KiB is an opt-in per kernel (cudaFuncAttributeMaxDynamicSharedMemorySize).
template <typename K>
void allow_smem(K kernel, size_t bytes) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
        "cudaFuncSetAttribute");
}

template <typename T>
struct Cuda {
  using type = T;
};
template <>
struct Cuda<bf16> {
  using type = bfloat;
};

template <int HS, typename O, typename Q>
void forward_hs(O* out, float* lse, bf16* osave, const Q* qkv, Index B, Layout lay) {
  using OT = typename Cuda<O>::type;
  using QT = typename Cuda<Q>::type;
  constexpr size_t smem = forward_smem<HS>();
  static const bool allowed = (allow_smem(forward_kernel<HS, OT, QT>, smem), true);
  (void)allowed;
  const dim3 grid(static_cast<unsigned>((lay.T + kRows - 1) / kRows), static_cast<unsigned>(B * lay.H));
  forward_kernel<HS, OT, QT><<<grid, kThreads, smem, stream()>>>(
      reinterpret_cast<OT*>(out), lse, reinterpret_cast<bfloat*>(osave), reinterpret_cast<const QT*>(qkv), lay,
      1.0f / std::sqrt(static_cast<float>(HS)));
  check(cudaGetLastError(), "forward launch");
}

template <int HS, typename Q>
void backward_hs(float* dqkv, const float* dout, const Q* qkv, const float* lse, const bf16* osave, Index B,
                 Layout lay) {
  using QT = typename Cuda<Q>::type;
  constexpr size_t smem = backward_smem<HS>();
  static const bool allowed =
      (allow_smem(dkdv_kernel<HS, QT>, smem), allow_smem(dq_kernel<HS, QT>, smem), true);
  (void)allowed;
  const Index rows = B * lay.H * lay.T;
  // D = rowsum(dO ∘ O), read by both gradient kernels
  float* dd = static_scratch<16>("flash_attention_rowdot").take<float>(rows);
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  row_dot_kernel<HS><<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream()>>>(
      dd, dout, reinterpret_cast<const bfloat*>(osave), lay.T, lay.H, rows);
  check(cudaGetLastError(), "row-dot launch");
  const unsigned blocks = static_cast<unsigned>((lay.T + kRows - 1) / kRows);
  dkdv_kernel<HS, QT><<<dim3(blocks, static_cast<unsigned>(B * lay.Hkv)), kThreads, smem, stream()>>>(
      dqkv, dout, reinterpret_cast<const QT*>(qkv), lse, dd, lay, scale);
  check(cudaGetLastError(), "dK/dV launch");
  dq_kernel<HS, QT><<<dim3(blocks, static_cast<unsigned>(B * lay.H)), kThreads, smem, stream()>>>(
      dqkv, dout, reinterpret_cast<const QT*>(qkv), lse, dd, lay, scale);
  check(cudaGetLastError(), "dQ launch");
}

Layout layout_of(Index T, const Heads& heads) {
  if (heads.H <= 0 || heads.Hkv <= 0 || heads.H % heads.Hkv != 0 || heads.window < 0)
    throw std::invalid_argument("fused attention: " + std::to_string(heads.H) + " query heads over " +
                                std::to_string(heads.Hkv) + " K/V heads, window " + std::to_string(heads.window));
  return Layout{static_cast<int>(T), static_cast<int>(heads.H), static_cast<int>(heads.Hkv),
                static_cast<int>(heads.window)};
}
}  // namespace

bool serves(Index hs) { return hs == 64 || hs == 128; }

template <typename O, typename Q>
void forward(O* out, float* lse, bf16* osave, const Q* qkv, Index B, Index T, const Heads& heads) {
  const Layout lay = layout_of(T, heads);
  if (heads.hs == 64) return forward_hs<64>(out, lse, osave, qkv, B, lay);
  if (heads.hs == 128) return forward_hs<128>(out, lse, osave, qkv, B, lay);
  throw std::invalid_argument("fused attention: head size " + std::to_string(heads.hs) + " is not served");
}

template <typename Q>
void backward(float* dqkv, const float* dout, const Q* qkv, const float* lse, const bf16* osave, Index B, Index T,
              const Heads& heads) {
  const Layout lay = layout_of(T, heads);
  if (heads.hs == 64) return backward_hs<64>(dqkv, dout, qkv, lse, osave, B, lay);
  if (heads.hs == 128) return backward_hs<128>(dqkv, dout, qkv, lse, osave, B, lay);
  throw std::invalid_argument("fused attention: head size " + std::to_string(heads.hs) + " is not served");
}

template void forward<float, float>(float*, float*, bf16*, const float*, Index, Index, const Heads&);
template void forward<bf16, float>(bf16*, float*, bf16*, const float*, Index, Index, const Heads&);
template void forward<float, bf16>(float*, float*, bf16*, const bf16*, Index, Index, const Heads&);
template void forward<bf16, bf16>(bf16*, float*, bf16*, const bf16*, Index, Index, const Heads&);
template void backward<float>(float*, const float*, const float*, const float*, const bf16*, Index, Index, const Heads&);
template void backward<bf16>(float*, const float*, const bf16*, const float*, const bf16*, Index, Index, const Heads&);

}  // namespace zero3d::kernels::cuda_flash
