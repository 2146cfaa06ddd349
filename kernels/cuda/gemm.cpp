// gemm.cpp (CUDA) — gemm.hpp's products through cuBLASLt, on the Kokkos default instance's
// stream so that they are ordered with the kernels around them. Operands are converted into
// device scratch (never host memory); the bias, the bf16 rounding of the output and a residual
// ride in the product's epilogue where cuBLASLt offers one (llm.c matmul.cuh: matmul_cublaslt).
//
// Row-major C[M,N] = op(A)·op(B) is column-major Cᵀ[N,M] = op(B)ᵀ·op(A)ᵀ: cuBLASLt's first
// operand is B and its second A, each described as the column-major view of its storage.
// fp32 products use CUBLAS_COMPUTE_32F (no TF32: the CPU build's fp32 is IEEE fp32 too); bf16
// products read bf16 operands and accumulate in fp32, as oneDNN's do on the CPU.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "base/errors.hpp"
#include "base/profiler.hpp"
#include "kernels/elementwise.hpp"
#include "kernels/gemm.hpp"
#include "kernels/half.hpp"
#include "kernels/matmul.hpp"
#include "kernels/memory.hpp"

namespace zero3d {

namespace {
using kernels::bf16;
using kernels::fp16;
using kernels::DeviceScratch;

void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw SystemError(std::string("cuBLASLt: ") + what + " failed (status " + std::to_string(static_cast<int>(s)) + ")");
}

// llm.c's choice (cublas_common.h): 32 MiB lets cuBLASLt pick its fastest Hopper kernels.
constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;

// What determines cuBLASLt's choice of algorithm for a product (run_lt's descriptors).
using ProblemKey = std::array<int64_t, 20>;

struct Workspace {
  DeviceScratch a16{"gemm_a16"}, b16{"gemm_b16"}, shared16{"gemm_shared16"};
  DeviceScratch a32{"gemm_a32"}, b32{"gemm_b32"}, c32{"gemm_c32"}, bias32{"gemm_bias32"}, bias16{"gemm_bias16"};
  DeviceScratch lt{"gemm_cublaslt"};
  std::map<ProblemKey, std::pair<bool, cublasLtMatmulAlgo_t>> algos;  // per shape: whether one exists, and which
  int64_t peak_bytes = 0;
  void note() {
    const int64_t bytes = a16.capacity() + b16.capacity() + shared16.capacity() + a32.capacity() + b32.capacity() +
                          c32.capacity() + bias32.capacity() + lt.capacity();
    if (bytes > peak_bytes) peak_bytes = bytes;
  }
};
// Emptied when Kokkos finalises, while device memory still exists (a View freed after
// Kokkos::finalize aborts the process).
Workspace& workspace() {
  static Workspace* w = [] {
    static Workspace workspace;
    Kokkos::push_finalize_hook([] {
      for (DeviceScratch* s : {&workspace.a16, &workspace.b16, &workspace.shared16, &workspace.a32, &workspace.b32,
                               &workspace.c32, &workspace.bias32, &workspace.bias16, &workspace.lt})
        s->release();
    });
    return &workspace;
  }();
  return *w;
}

struct Lt {
  cublasLtHandle_t handle = nullptr;
  Lt() { check(cublasLtCreate(&handle), "cublasLtCreate"); }
  // Destroyed with the process (after Kokkos::finalize the context may be gone: never destroyed here).
};
Lt& lt() {
  static Lt l;
  return l;
}

// The largest power of two, at most 256, that divides every address a problem reads from
// `base` (batch problems start `stride_bytes` apart). cuBLASLt's heuristics assume 256-byte
// operands unless told (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES), while the model's named
// views start at any element of its big buffers and Kokkos's data sit 128 bytes into theirs.
uint32_t alignment_of(const void* base, uint64_t stride_bytes = 0) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(base) | stride_bytes | 256;
  return static_cast<uint32_t>(bits & (~bits + 1));  // the lowest set bit
}

// `bytes` of scratch starting on a 256-byte boundary (cuBLASLt's workspace and bias pointers).
void* aligned_256(DeviceScratch& s, int64_t bytes) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(s.take(bytes + 256));
  return reinterpret_cast<void*>((p + 255) & ~uintptr_t(255));
}

cudaStream_t compute_stream() { return Kokkos::DefaultExecutionSpace().cuda_stream(); }

cudaDataType_t cuda_type(DType t) {
  return t == DType::BF16 ? CUDA_R_16BF : t == DType::F16 ? CUDA_R_16F : CUDA_R_32F;
}

// Elements a stored operand of `rows` rows spans (the model's operands are dense).
int64_t stored_elems(int64_t rows, const GemmOperand& x) { return rows * x.ld; }

// x in `want` (F32, BF16 or F16), converted into scratch when stored otherwise.
GemmOperand in_type(const GemmOperand& x, int64_t n, DType want, DeviceScratch& s16, DeviceScratch& s32) {
  if (x.type == want) return x;
  GemmOperand out = x;
  out.type = want;
  if (want == DType::BF16) {
    bf16* dst = s16.take<bf16>(n);
    if (x.type == DType::F32) kernels::convert(dst, static_cast<const float*>(x.data), n);
    else kernels::convert(dst, static_cast<const fp16*>(x.data), n);
    out.data = dst;
  } else if (want == DType::F16) {  // torch_autocast's fp16 products: an fp32 operand rounded
    if (x.type == DType::BF16) throw SystemError("gemm: fp16 products of a bf16 operand");
    fp16* dst = s16.take<fp16>(n);
    kernels::convert(dst, static_cast<const float*>(x.data), n);
    out.data = dst;
  } else {
    float* dst = s32.take<float>(n);
    if (x.type == DType::BF16) kernels::convert(dst, static_cast<const bf16*>(x.data), n);
    else kernels::convert(dst, static_cast<const fp16*>(x.data), n);
    out.data = dst;
  }
  workspace().note();
  return out;
}

// Both operands of op(A)[M,K]·op(B)[K,N] in the product's dtype, in the workspace's A and B slots.
std::pair<GemmOperand, GemmOperand> operands_in(const GemmOperand& A, const GemmOperand& B, int64_t M, int64_t N,
                                                int64_t K, DType compute) {
  Workspace& w = workspace();
  return {in_type(A, stored_elems(A.trans ? K : M, A), compute, w.a16, w.a32),
          in_type(B, stored_elems(B.trans ? N : K, B), compute, w.b16, w.b32)};
}

// The bias widened to fp32 (cuBLASLt's epilogue adds an fp32 bias to an fp32 accumulator). An
// fp32 bias joining a 16-bit product is first rounded to the product's dtype, as torch.autocast's
// linear casts its bias with its weight (gemm.hpp; the CPU backend does the same).
const float* bias_f32(const void* bias, DType type, int64_t n, DType compute) {
  if (!bias) return nullptr;
  const bool as_is = type == DType::F32 && compute == DType::F32;
  if (as_is && alignment_of(bias) == 256) return static_cast<const float*>(bias);
  Workspace& w = workspace();
  float* dst = static_cast<float*>(aligned_256(w.bias32, n * static_cast<int64_t>(sizeof(float))));
  if (as_is) {  // the epilogue reads its bias from a 256-byte boundary
    kernels::copy(dst, static_cast<const float*>(bias), n, "gemm_bias_aligned");
  } else if (type == DType::F32 && compute == DType::BF16) {
    bf16* r = w.bias16.take<bf16>(n);
    kernels::convert(r, static_cast<const float*>(bias), n);
    kernels::convert(dst, r, n);
  } else if (type == DType::F32) {
    fp16* r = w.bias16.take<fp16>(n);
    kernels::convert(r, static_cast<const float*>(bias), n);
    kernels::convert(dst, r, n);
  } else if (type == DType::BF16) {
    kernels::convert(dst, static_cast<const bf16*>(bias), n);
  } else {
    kernels::convert(dst, static_cast<const fp16*>(bias), n);
  }
  w.note();
  return dst;
}

// One cuBLASLt product, row-major: D[M,N] = op(A)·op(B) + beta·C (+ bias[n] on every row),
// with `batch` strided problems. C may differ from D (a residual); D is fp32 or bf16.
struct Product {
  int64_t M, N, K;
  GemmOperand A, B;  // both F32, both BF16 or both F16
  const float* C;    // null: beta = 0
  void* D;
  int64_t ldd;
  DType d_type;           // F32 or BF16
  const float* bias;      // fp32 [N] or null
  int64_t batch = 1;      // problems; A, B, D advance by their dense sizes, or by:
  int64_t stride_a = 0, stride_b = 0, stride_d = 0;  // elements between problems (0: the dense size)
};

// Returns false when cuBLASLt offers no algorithm for the epilogue asked for, so the caller can
// run the product without it and apply the epilogue as kernels.
bool run_lt(const Product& p) {
  const DType ab = p.A.type;
  cublasLtMatmulDesc_t desc = nullptr;
  check(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  // First operand: op(B)ᵀ from B's storage; second: op(A)ᵀ from A's (see the file comment).
  const cublasOperation_t ta = p.B.trans ? CUBLAS_OP_T : CUBLAS_OP_N, tb = p.A.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "TRANSA");
  check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "TRANSB");
  if (p.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const int32_t bias_type = CUDA_R_32F;
    check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi), "EPILOGUE");
    check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof p.bias), "BIAS");
    check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type),
          "BIAS_DATA_TYPE");
  }
  // Storage views: B is (trans ? N×K : K×N) row-major = column-major (trans ? K×N : N×K), ld B.ld.
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr, ld = nullptr;
  const uint64_t a_rows = p.B.trans ? p.K : p.N, a_cols = p.B.trans ? p.N : p.K;
  const uint64_t b_rows = p.A.trans ? p.M : p.K, b_cols = p.A.trans ? p.K : p.M;
  check(cublasLtMatrixLayoutCreate(&la, cuda_type(ab), a_rows, a_cols, p.B.ld), "layout B");
  check(cublasLtMatrixLayoutCreate(&lb, cuda_type(ab), b_rows, b_cols, p.A.ld), "layout A");
  // C is fp32 when read (a residual, an accumulation); unread (beta 0), it is described as D.
  check(cublasLtMatrixLayoutCreate(&lc, p.C ? CUDA_R_32F : cuda_type(p.d_type), p.N, p.M, p.ldd), "layout C");
  check(cublasLtMatrixLayoutCreate(&ld, cuda_type(p.d_type), p.N, p.M, p.ldd), "layout D");
  // batch strides in elements (cuBLASLt's first operand is B, its second A)
  const int64_t sa = p.stride_b ? p.stride_b : p.K * p.N, sb = p.stride_a ? p.stride_a : p.M * p.K,
                sd = p.stride_d ? p.stride_d : p.M * p.N;
  if (p.batch > 1) {
    const int32_t count = static_cast<int32_t>(p.batch);
    for (auto [l, stride] : {std::pair{la, sa}, std::pair{lb, sb}, std::pair{lc, sd}, std::pair{ld, sd}}) {
      check(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count), "BATCH");
      check(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride),
            "BATCH_OFFSET");
    }
  }
  Workspace& w = workspace();
  void* ws = aligned_256(w.lt, static_cast<int64_t>(kLtWorkspaceBytes));
  w.note();
  cublasLtMatmulPreference_t pref = nullptr;
  check(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
  const size_t ws_bytes = kLtWorkspaceBytes;
  check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes),
        "MAX_WORKSPACE");
  const bool batched = p.batch > 1;
  const uint64_t ab_bytes = dtype_size(ab), d_bytes = dtype_size(p.d_type);
  const void* c_read = p.C ? static_cast<const void*>(p.C) : p.D;
  const uint32_t align[4] = {alignment_of(p.B.data, batched ? sa * ab_bytes : 0),
                             alignment_of(p.A.data, batched ? sb * ab_bytes : 0),
                             alignment_of(c_read, batched ? sd * (p.C ? 4 : d_bytes) : 0),
                             alignment_of(p.D, batched ? sd * d_bytes : 0)};
  const cublasLtMatmulPreferenceAttributes_t align_pref[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    check(cublasLtMatmulPreferenceSetAttribute(pref, align_pref[i], &align[i], sizeof align[i]), "MIN_ALIGNMENT");
  // The heuristic's choice, asked once per problem shape: a training step repeats a few dozen
  // shapes thousands of times, and each query costs tens of microseconds of host time.
  const ProblemKey key{p.M, p.N, p.K, static_cast<int64_t>(ab), static_cast<int64_t>(p.d_type), p.B.trans, p.A.trans,
                       p.B.ld, p.A.ld, p.ldd, p.batch, p.bias != nullptr, p.C != nullptr, align[0], align[1],
                       align[2], align[3], sa, sb, sd};
  auto chosen = w.algos.find(key);
  if (chosen == w.algos.end()) {
    cublasLtMatmulHeuristicResult_t heuristic{};
    int found = 0;
    const cublasStatus_t hs =
        cublasLtMatmulAlgoGetHeuristic(lt().handle, desc, la, lb, lc, ld, pref, 1, &heuristic, &found);
    chosen = w.algos.emplace(key, std::make_pair(hs == CUBLAS_STATUS_SUCCESS && found > 0, heuristic.algo)).first;
  }
  bool ran = false;
  if (chosen->second.first) {
    const float alpha = 1.0f, beta = p.C ? 1.0f : 0.0f;
    check(cublasLtMatmul(lt().handle, desc, &alpha, p.B.data, la, p.A.data, lb, &beta, c_read, lc, p.D, ld,
                         &chosen->second.second, ws, kLtWorkspaceBytes, compute_stream()),
          "Matmul");
    ran = true;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  for (cublasLtMatrixLayout_t l : {la, lb, lc, ld}) cublasLtMatrixLayoutDestroy(l);
  cublasLtMatmulDescDestroy(desc);
  if (!ran && !p.bias && p.d_type == DType::F32)
    throw SystemError("cuBLASLt has no algorithm for a " + std::to_string(p.M) + "x" + std::to_string(p.N) + "x" +
                      std::to_string(p.K) + " " + dtype_name(ab) + " product");
  return ran;
}

// The product with its bias, trying the epilogue first and falling back to a bias pass.
void product(Product p) {
  if (run_lt(p)) return;
  const float* bias = p.bias;
  p.bias = nullptr;
  run_lt(p);
  if (bias) kernels::add_bias_rows(static_cast<float*>(p.D), bias, p.M, p.N);
}
}  // namespace

void gemm(int64_t M, int64_t N, int64_t K, GemmOperand A, GemmOperand B, float* C, int64_t ldc, bool accumulate,
          DType compute, const void* bias, DType bias_type) {
  obs::add_macs(static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K));  // the flops profiler's count
  const kernels::ProfileRegion region(compute == DType::BF16 ? "gemm_bf16" : compute == DType::F16 ? "gemm_f16" : "gemm_f32");
  if (bias && ldc != N) throw SystemError("gemm: a bias needs a dense output");
  // BF16 and F16 (torch_autocast's fp16) products: both operands rounded, fp32 accumulation.
  const auto [a, b] = operands_in(A, B, M, N, K, compute);
  product({M, N, K, a, b, accumulate ? C : nullptr, C, ldc, DType::F32, bias_f32(bias, bias_type, N, compute)});
}

void gemm_bf16_output(int64_t M, int64_t N, int64_t K, GemmOperand A, GemmOperand B, kernels::bf16* C,
                      const void* bias, DType bias_type) {
  obs::add_macs(static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K));
  const kernels::ProfileRegion region("gemm_bf16");
  Workspace& w = workspace();
  const auto [a, b] = operands_in(A, B, M, N, K, DType::BF16);
  const float* bias32 = bias_f32(bias, bias_type, N, DType::BF16);
  // The bf16 output rounded in the epilogue; where cuBLASLt has none for it, the fp32 product rounded.
  if (run_lt({M, N, K, a, b, nullptr, C, N, DType::BF16, bias32})) return;
  float* c32 = w.c32.take<float>(M * N);
  w.note();
  product({M, N, K, a, b, nullptr, c32, N, DType::F32, bias32});
  kernels::convert(C, c32, M * N);
}

void gemm_adding(int64_t M, int64_t N, int64_t K, GemmOperand A, GemmOperand B, float* C, const float* R,
                 const void* bias, DType bias_type) {
  obs::add_macs(static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K));
  const kernels::ProfileRegion region("gemm_bf16");
  const auto [a, b] = operands_in(A, B, M, N, K, DType::BF16);
  // D = A·B + 1·R + bias: cuBLASLt reads C (here R) and writes D (here C) separately.
  product({M, N, K, a, b, R, C, N, DType::F32, bias_f32(bias, bias_type, N, DType::BF16)});
}

void gemm_batched_bf16(int64_t batch, int64_t M, int64_t N, int64_t K, const void* A, bool ta, const void* B, bool tb,
                       float* C, bool accumulate) {
  const kernels::ProfileRegion region("attention_products");
  const GemmOperand a{A, DType::BF16, ta, ta ? M : K}, b{B, DType::BF16, tb, tb ? K : N};
  product({M, N, K, a, b, accumulate ? C : nullptr, C, N, DType::F32, nullptr, batch});
}

void gemm_batched_blocks(int64_t batch, int64_t M, int64_t N, int64_t K, BatchedOperand A, BatchedOperand B, float* C,
                         int64_t ldc, int64_t stride_c, bool accumulate) {
  const kernels::ProfileRegion region("attention_products");
  if (const char* why = batched_blocks_refusal(A, B, stride_c)) throw SystemError(std::string("gemm_batched_blocks: ") + why);
  Product p{M, N, K, A.x, B.x, accumulate ? C : nullptr, C, ldc, DType::F32, nullptr, batch};
  p.stride_a = A.stride, p.stride_b = B.stride, p.stride_d = stride_c;
  product(p);
}

void gemm_batched(int64_t batch, int64_t M, int64_t N, int64_t K, const float* A, bool ta, const float* B, bool tb,
                  float* C, bool accumulate) {
  const kernels::ProfileRegion region("attention_products");
  const GemmOperand a{A, DType::F32, ta, ta ? M : K}, b{B, DType::F32, tb, tb ? K : N};
  product({M, N, K, a, b, accumulate ? C : nullptr, C, N, DType::F32, nullptr, batch});
}

GemmOperand gemm_operand(GemmOperand x, int64_t elems, DType compute, float* column_sums) {
  if (column_sums && (x.type != DType::F32 || x.trans)) throw SystemError("gemm_operand: column sums of a plain fp32 operand only");
  if (compute != DType::BF16 || x.type == DType::BF16) {
    if (column_sums) kernels::accumulate_column_sums(column_sums, static_cast<const float*>(x.data), elems / x.ld, x.ld);
    return x;
  }
  bf16* out = workspace().shared16.take<bf16>(elems);
  workspace().note();
  kernels::convert_summing_columns(out, column_sums, static_cast<const float*>(x.data), elems / x.ld, x.ld);
  x.data = out;
  x.type = DType::BF16;
  return x;
}

GemmOperand gemm_operand_slot(int64_t rows, int64_t ld) {
  GemmOperand slot{workspace().shared16.take<bf16>(rows * ld), DType::BF16, false, ld};
  workspace().note();
  return slot;
}

std::string gemm_path(DType compute) {
  return compute == DType::BF16 ? "cuBLASLt bf16 (fp32 accumulation)"
         : compute == DType::F16 ? "cuBLASLt fp16 (fp32 accumulation)"
                                 : "cuBLASLt fp32 (IEEE, no TF32)";
}

int64_t gemm_workspace_bytes() { return workspace().peak_bytes; }

}  // namespace zero3d
