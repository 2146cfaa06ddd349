// attention_flash_bf16.cpp (CUDA) — see attention_flash_bf16.hpp: the launches of the kernels in
// attention_flash_bf16_kernels.hpp.
#include "kernels/cuda/attention_flash_bf16.hpp"

#include <cuda_runtime.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdint>
#include <string>

#include "base/errors.hpp"
#include "kernels/cuda/attention_flash_bf16_kernels.hpp"
#include "kernels/half.hpp"
#include "kernels/memory.hpp"

namespace zero3d::kernels::cuda_flash {

namespace {
using namespace device;

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

// Whether every row of a [rows][ld] operand of T starts 16-byte aligned: the tiles' vector loads.
template <typename T>
bool vector_aligned(const T* p, int64_t ld) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0 && (ld * int64_t(sizeof(T))) % 16 == 0;
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
      1.0f / std::sqrt(static_cast<float>(HS)), vector_aligned(qkv, lay.width(HS)));
  check(cudaGetLastError(), "forward launch");
}

template <int HS, typename Q>
void backward_hs(float* dqkv, const float* dout, const Q* qkv, const float* lse, const bf16* osave, Index B,
                 Layout lay) {
  using QT = typename Cuda<Q>::type;
  static const bool allowed =
      (allow_smem(dkdv_kernel<HS, QT>, dkdv_smem<HS>()), allow_smem(dq_kernel<HS, QT>, dq_smem<HS>()), true);
  (void)allowed;
  const Index rows = B * lay.H * lay.T;
  // backward_scratch_bytes: D = rowsum(dO ∘ O), read by both gradient kernels, and dO rounded to
  // bf16 once (the products read it so): its tiles then come by cp.async, and the dK/dV kernel,
  // which reads every later query block's dO for each key block, reads half the bytes.
  float* dd = static_scratch<16>("flash_attention_rowdot").take<float>(rows);
  bf16* dout16 = static_scratch<17>("flash_attention_dout16").take<bf16>(rows * HS);
  kernels::convert(dout16, dout, rows * HS);
  const bfloat* dO = reinterpret_cast<const bfloat*>(dout16);
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const bool vec_qkv = vector_aligned(qkv, lay.width(HS)), vec_dout = vector_aligned(dO, int64_t(lay.H) * HS);
  row_dot_kernel<HS><<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream()>>>(
      dd, dO, reinterpret_cast<const bfloat*>(osave), lay.T, lay.H, rows);
  check(cudaGetLastError(), "row-dot launch");
  const unsigned blocks = static_cast<unsigned>((lay.T + kRows - 1) / kRows);
  dkdv_kernel<HS, QT><<<dim3(blocks, static_cast<unsigned>(B * lay.Hkv)), kThreads, dkdv_smem<HS>(), stream()>>>(
      dqkv, dO, reinterpret_cast<const QT*>(qkv), lse, dd, lay, scale, vec_qkv, vec_dout);
  check(cudaGetLastError(), "dK/dV launch");
  dq_kernel<HS, QT><<<dim3(blocks, static_cast<unsigned>(B * lay.H)), kThreads, dq_smem<HS>(), stream()>>>(
      dqkv, dO, reinterpret_cast<const QT*>(qkv), lse, dd, lay, scale, vec_qkv, vec_dout);
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
