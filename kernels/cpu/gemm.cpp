// gemm.cpp — see gemm.hpp. Operand conversions go through a reusable workspace so that a
// training step allocates nothing.
#include "kernels/gemm.hpp"

#include <cblas.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "base/errors.hpp"
#include "base/profiler.hpp"
#include "kernels/half.hpp"
#include "kernels/matmul.hpp"

#ifdef ZERO3D_HAVE_ONEDNN
#include <dnnl.hpp>
extern "C" void omp_set_num_threads(int);
#endif

namespace zero3d {

namespace {
using kernels::bf16;
using kernels::fp16;

struct Workspace {
  std::vector<uint16_t> a16, b16, shared16;
  std::vector<float> a32, b32, c32;
  int64_t peak_bytes = 0;
  template <typename T>
  T* take(std::vector<T>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
    const int64_t bytes = static_cast<int64_t>((a16.size() + b16.size() + shared16.size()) * 2 +
                                               (a32.size() + b32.size() + c32.size()) * 4);
    if (bytes > peak_bytes) peak_bytes = bytes;
    return v.data();
  }
};
Workspace& workspace() {
  static Workspace w;
  return w;
}

// Elements a stored operand of `rows` rows spans (the model's operands are dense).
int64_t stored_elems(int64_t rows, const GemmOperand& x) { return rows * x.ld; }

const float* as_f32(const GemmOperand& x, int64_t n, std::vector<float>& scratch) {
  if (x.type == DType::F32) return static_cast<const float*>(x.data);
  float* out = workspace().take(scratch, n);
  if (x.type == DType::BF16) kernels::convert(out, static_cast<const bf16*>(x.data), n);
  else kernels::convert(out, static_cast<const fp16*>(x.data), n);
  return out;
}

const bf16* as_bf16(const GemmOperand& x, int64_t n, std::vector<uint16_t>& scratch) {
  if (x.type == DType::BF16) return static_cast<const bf16*>(x.data);
  bf16* out = reinterpret_cast<bf16*>(workspace().take(scratch, n));
  if (x.type == DType::F32) kernels::convert(out, static_cast<const float*>(x.data), n);
  else kernels::convert(out, static_cast<const fp16*>(x.data), n);
  return out;
}

// An fp32 operand rounded to fp16 and widened back (F16 compute: the product of fp16 operands
// with fp32 accumulation, on sgemm); a stored fp16 operand is only widened.
const float* as_f16_valued(const GemmOperand& x, int64_t n, std::vector<float>& scratch, std::vector<uint16_t>& half) {
  if (x.type == DType::BF16) throw SystemError("gemm: fp16 products of a bf16 operand");
  float* out = workspace().take(scratch, n);
  if (x.type == DType::F16) {
    kernels::convert(out, static_cast<const fp16*>(x.data), n);
    return out;
  }
  fp16* h = reinterpret_cast<fp16*>(workspace().take(half, n));
  kernels::convert(h, static_cast<const float*>(x.data), n);
  kernels::convert(out, h, n);
  return out;
}

// An fp32 bias joining a 16-bit product is rounded to the product's dtype first, as
// torch.autocast's linear casts its bias with its weight (the bf16/fp16 runs' biases are stored
// in 16 bits already). Returns the bias to use and sets its type.
const void* bias_in(DType compute, const void* bias, DType& bias_type, int64_t n) {
  if (!bias || bias_type != DType::F32 || compute == DType::F32) return bias;
  static std::vector<uint16_t> rounded;
  if (static_cast<int64_t>(rounded.size()) < n) rounded.resize(static_cast<size_t>(n));
  if (compute == DType::BF16) kernels::convert(reinterpret_cast<bf16*>(rounded.data()), static_cast<const float*>(bias), n);
  else kernels::convert(reinterpret_cast<fp16*>(rounded.data()), static_cast<const float*>(bias), n);
  bias_type = compute;
  return rounded.data();
}

#ifdef ZERO3D_HAVE_ONEDNN
struct Dnnl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int64_t, bool, int, bool, bool>;
  std::map<Key, dnnl::matmul> primitives;
  using BatchedKey = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool, bool>;
  std::map<BatchedKey, dnnl::matmul> batched;
  Dnnl() {
    // One rank per core: oneDNN's OpenMP threads would oversubscribe unless asked for.
    const char* env = std::getenv("OMP_NUM_THREADS");
    omp_set_num_threads(env ? std::max(1, std::atoi(env)) : 1);
  }
};
Dnnl& dnnl_state() {
  static Dnnl d;
  return d;
}

dnnl::memory::data_type dnnl_type(DType t) {
  return t == DType::BF16 ? dnnl::memory::data_type::bf16
         : t == DType::F16 ? dnnl::memory::data_type::f16
                           : dnnl::memory::data_type::f32;
}

// bias: [N] of bias_type, or null. c is fp32, or bf16 when c_bf16 (rounded in the epilogue).
// addend (fp32 [M][N] with c's row stride, or null): added to the result in the epilogue (a
// binary post-op), for a residual that would otherwise be copied into c and accumulated onto.
void gemm_onednn(int64_t M, int64_t N, int64_t K, const bf16* a, bool ta, int64_t lda, const bf16* b, bool tb,
                 int64_t ldb, void* c, int64_t ldc, bool accumulate, const void* bias, DType bias_type,
                 bool c_bf16 = false, const float* addend = nullptr) {
  using namespace dnnl;
  Dnnl& d = dnnl_state();
  const memory::desc ad({M, K}, memory::data_type::bf16, ta ? memory::dims{1, lda} : memory::dims{lda, 1});
  const memory::desc bd({K, N}, memory::data_type::bf16, tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
  const memory::desc cd({M, N}, c_bf16 ? memory::data_type::bf16 : memory::data_type::f32, memory::dims{ldc, 1});
  const memory::desc biasd = bias ? memory::desc({1, N}, dnnl_type(bias_type), memory::dims{N, 1}) : memory::desc();
  const memory::desc addd = addend ? memory::desc({M, N}, memory::data_type::f32, memory::dims{ldc, 1}) : memory::desc();
  const Dnnl::Key key{M,      N,      K,           ta,
                      tb,     lda,    ldb,         ldc,
                      accumulate, bias ? static_cast<int>(bias_type) : -1, c_bf16, addend != nullptr};
  auto it = d.primitives.find(key);
  if (it == d.primitives.end()) {
    primitive_attr attr;
    if (accumulate || addend) {
      post_ops po;
      if (accumulate) po.append_sum(1.0f);
      if (addend) po.append_binary(algorithm::binary_add, addd);
      attr.set_post_ops(po);
    }
    const matmul::desc md = bias ? matmul::desc(ad, bd, biasd, cd) : matmul::desc(ad, bd, cd);
    it = d.primitives.emplace(key, matmul(matmul::primitive_desc(md, attr, d.engine))).first;
  }
  memory am(ad, d.engine, const_cast<bf16*>(a)), bm(bd, d.engine, const_cast<bf16*>(b)), cm(cd, d.engine, c);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
  if (bias) args.emplace(DNNL_ARG_BIAS, memory(biasd, d.engine, const_cast<void*>(bias)));
  if (addend)
    args.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(accumulate ? 1 : 0) | DNNL_ARG_SRC_1,
                 memory(addd, d.engine, const_cast<float*>(addend)));
  it->second.execute(d.stream, args);
  d.stream.wait();
}

void gemm_batched_onednn(int64_t batch, int64_t M, int64_t N, int64_t K, const void* a, bool ta, const void* b, bool tb,
                         float* c, bool accumulate) {
  using namespace dnnl;
  Dnnl& d = dnnl_state();
  const memory::desc ad({batch, M, K}, memory::data_type::bf16, ta ? memory::dims{M * K, 1, M} : memory::dims{M * K, K, 1});
  const memory::desc bd({batch, K, N}, memory::data_type::bf16, tb ? memory::dims{K * N, 1, K} : memory::dims{K * N, N, 1});
  const memory::desc cd({batch, M, N}, memory::data_type::f32, memory::dims{M * N, N, 1});
  const Dnnl::BatchedKey key{batch, M, N, K, ta, tb, accumulate};
  auto it = d.batched.find(key);
  if (it == d.batched.end()) {
    primitive_attr attr;
    if (accumulate) {
      post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    it = d.batched.emplace(key, matmul(matmul::primitive_desc(matmul::desc(ad, bd, cd), attr, d.engine))).first;
  }
  memory am(ad, d.engine, const_cast<void*>(a)), bm(bd, d.engine, const_cast<void*>(b)), cm(cd, d.engine, c);
  it->second.execute(d.stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  d.stream.wait();
}
#endif

// out[M,N] += bias[n] on every row, bias in its stored type.
void add_bias(float* out, int64_t M, int64_t N, int64_t ldc, const void* bias, DType type) {
  if (ldc != N) throw SystemError("gemm: a bias needs a dense output");
  if (type == DType::BF16) kernels::add_bias_rows(out, static_cast<const bf16*>(bias), M, N);
  else if (type == DType::F16) kernels::add_bias_rows(out, static_cast<const fp16*>(bias), M, N);
  else kernels::add_bias_rows(out, static_cast<const float*>(bias), M, N);
}
}  // namespace

void gemm_batched_bf16(int64_t batch, int64_t M, int64_t N, int64_t K, const void* A, bool ta, const void* B, bool tb,
                       float* C, bool accumulate) {
  const kernels::ProfileRegion region("attention_products");
#ifdef ZERO3D_HAVE_ONEDNN
  gemm_batched_onednn(batch, M, N, K, A, ta, B, tb, C, accumulate);
#else
  Workspace& w = workspace();
  float* a32 = w.take(w.a32, M * K);
  float* b32 = w.take(w.b32, K * N);
  for (int64_t i = 0; i < batch; ++i) {
    kernels::convert(a32, static_cast<const bf16*>(A) + i * M * K, M * K);
    kernels::convert(b32, static_cast<const bf16*>(B) + i * K * N, K * N);
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, a32,
                ta ? M : K, b32, tb ? K : N, accumulate ? 1.0f : 0.0f, C + i * M * N, N);
  }
#endif
}

void gemm_batched(int64_t batch, int64_t M, int64_t N, int64_t K, const float* A, bool ta, const float* B, bool tb,
                  float* C, bool accumulate) {
  const kernels::ProfileRegion region("attention_products");
  for (int64_t i = 0; i < batch; ++i)
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0f,
                A + i * M * K, ta ? M : K, B + i * K * N, tb ? K : N, accumulate ? 1.0f : 0.0f, C + i * M * N, N);
}

void gemm_batched_blocks(int64_t batch, int64_t M, int64_t N, int64_t K, BatchedOperand A, BatchedOperand B, float* C,
                         int64_t ldc, int64_t stride_c, bool accumulate) {
  const kernels::ProfileRegion region("attention_products");
  if (const char* why = batched_blocks_refusal(A, B, stride_c)) throw SystemError(std::string("gemm_batched_blocks: ") + why);
  const bool wide = A.x.type == DType::F32;
  // A bf16 operand's block widened to a dense fp32 one (ld its stored columns).
  const auto widened = [&](std::vector<float>& dst, const GemmOperand& x, int64_t offset, int64_t rows, int64_t cols) {
    dst.resize(static_cast<size_t>(rows * cols));
    const bf16* src = static_cast<const bf16*>(x.data) + offset;
    for (int64_t r = 0; r < rows; ++r) kernels::convert(dst.data() + r * cols, src + r * x.ld, cols);
  };
  std::vector<float> a32, b32;
  for (int64_t i = 0; i < batch; ++i) {
    const float *a = nullptr, *b = nullptr;
    int64_t lda = A.x.ld, ldb = B.x.ld;
    if (wide) {
      a = static_cast<const float*>(A.x.data) + i * A.stride;
      b = static_cast<const float*>(B.x.data) + i * B.stride;
    } else {
      const int64_t a_rows = A.x.trans ? K : M, a_cols = A.x.trans ? M : K;
      const int64_t b_rows = B.x.trans ? N : K, b_cols = B.x.trans ? K : N;
      widened(a32, A.x, i * A.stride, a_rows, a_cols);
      widened(b32, B.x, i * B.stride, b_rows, b_cols);
      a = a32.data(), b = b32.data(), lda = a_cols, ldb = b_cols;
    }
    cblas_sgemm(CblasRowMajor, A.x.trans ? CblasTrans : CblasNoTrans, B.x.trans ? CblasTrans : CblasNoTrans, M, N, K,
                1.0f, a, lda, b, ldb, accumulate ? 1.0f : 0.0f, C + i * stride_c, ldc);
  }
}

void gemm(int64_t M, int64_t N, int64_t K, GemmOperand A, GemmOperand B, float* C, int64_t ldc, bool accumulate,
          DType compute, const void* bias, DType bias_type) {
  obs::add_macs(static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K));  // the flops profiler's count
  const kernels::ProfileRegion region(compute == DType::BF16 ? "gemm_bf16" : compute == DType::F16 ? "gemm_f16" : "gemm_f32");
  Workspace& w = workspace();
  const int64_t na = stored_elems(A.trans ? K : M, A);
  const int64_t nb = stored_elems(B.trans ? N : K, B);
  bias = bias_in(compute, bias, bias_type, N);
  if (compute == DType::F16) {  // both operands rounded to fp16 (torch.autocast's fp16 products), fp32 accumulation
    A = {as_f16_valued(A, na, w.a32, w.a16), DType::F32, A.trans, A.ld};
    B = {as_f16_valued(B, nb, w.b32, w.b16), DType::F32, B.trans, B.ld};
  }
  if (compute == DType::BF16) {
    const bf16* a;
    if (A.type == DType::F32 && A.trans) {  // rounded into the plain layout: op(A) = A then
      bf16* at = reinterpret_cast<bf16*>(w.take(w.a16, M * K));
      kernels::convert_transposed(at, static_cast<const float*>(A.data), K, M, A.ld);
      a = at;
      A = {at, DType::BF16, false, K};
    } else {
      a = as_bf16(A, na, w.a16);
    }
    const bf16* b = as_bf16(B, nb, w.b16);
#ifdef ZERO3D_HAVE_ONEDNN
    gemm_onednn(M, N, K, a, A.trans, A.ld, b, B.trans, B.ld, C, ldc, accumulate, bias, bias_type);
    return;
#else
    const int64_t na16 = stored_elems(A.trans ? K : M, A);
    float* a32 = w.take(w.a32, na16);
    float* b32 = w.take(w.b32, nb);
    kernels::convert(a32, a, na16);
    kernels::convert(b32, b, nb);
    A = {a32, DType::F32, A.trans, A.ld};
    B = {b32, DType::F32, B.trans, B.ld};
#endif
  }
  const float* a = as_f32(A, stored_elems(A.trans ? K : M, A), w.a32);
  const float* b = as_f32(B, nb, w.b32);
  if (M == 1) {
    // One row (a generation step of one sequence; no training product has M = 1): sgemv reads B
    // once, where sgemm first packs all of it (OpenBLAS 0.3.21 forwards no such call to gemv).
    // C = a · op(B): op(B) = Bᵀ of the stored N×K, or the stored K×N read transposed.
    cblas_sgemv(CblasRowMajor, B.trans ? CblasNoTrans : CblasTrans, B.trans ? N : K, B.trans ? K : N, 1.0f, b, B.ld, a,
                A.trans ? A.ld : 1, accumulate ? 1.0f : 0.0f, C, 1);
  } else {
    cblas_sgemm(CblasRowMajor, A.trans ? CblasTrans : CblasNoTrans, B.trans ? CblasTrans : CblasNoTrans, M, N, K, 1.0f,
                a, A.ld, b, B.ld, accumulate ? 1.0f : 0.0f, C, ldc);
  }
  if (bias) add_bias(C, M, N, ldc, bias, bias_type);
}

namespace {
// The bf16 product with its epilogue in oneDNN (output rounded to bf16, or a residual added)
// for an untransposed 16-bit A and a 16-bit B either way round (nn.Linear's output-major
// weight is read transposed); false where it does not apply (no oneDNN, or other layouts),
// for the caller's fp32 route.
bool gemm_epilogue_in_onednn(int64_t M, int64_t N, int64_t K, const GemmOperand& A, const GemmOperand& B, void* C,
                             bool c_bf16, const float* addend, const void* bias, DType bias_type) {
#ifdef ZERO3D_HAVE_ONEDNN
  if (A.trans || A.type == DType::F32) return false;
  bias = bias_in(DType::BF16, bias, bias_type, N);
  obs::add_macs(static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K));
  const kernels::ProfileRegion region("gemm_bf16");
  Workspace& w = workspace();
  const bf16* a = as_bf16(A, stored_elems(M, A), w.a16);
  const bf16* b = as_bf16(B, stored_elems(B.trans ? N : K, B), w.b16);
  gemm_onednn(M, N, K, a, false, A.ld, b, B.trans, B.ld, C, N, false, bias, bias_type, c_bf16, addend);
  return true;
#else
  (void)M, (void)N, (void)K, (void)A, (void)B, (void)C, (void)c_bf16, (void)addend, (void)bias, (void)bias_type;
  return false;
#endif
}
}  // namespace

void gemm_bf16_output(int64_t M, int64_t N, int64_t K, GemmOperand A, GemmOperand B, kernels::bf16* C,
                      const void* bias, DType bias_type) {
  if (gemm_epilogue_in_onednn(M, N, K, A, B, C, /*c_bf16=*/true, nullptr, bias, bias_type)) return;
  // Without oneDNN (or for operand layouts it is not asked for here): the fp32 product, rounded.
  Workspace& w = workspace();
  float* c32 = w.take(w.c32, M * N);
  gemm(M, N, K, A, B, c32, N, false, DType::BF16, bias, bias_type);
  kernels::convert(C, c32, M * N);
}

void gemm_adding(int64_t M, int64_t N, int64_t K, GemmOperand A, GemmOperand B, float* C, const float* R,
                 const void* bias, DType bias_type) {
  if (gemm_epilogue_in_onednn(M, N, K, A, B, C, /*c_bf16=*/false, R, bias, bias_type)) return;
  // Without oneDNN (or for operand layouts it is not asked for here): R copied into C, the
  // product accumulated onto it.
  using Unmanaged = Kokkos::View<float*, Kokkos::MemoryUnmanaged>;
  Kokkos::deep_copy(Unmanaged(C, M * N), Unmanaged(const_cast<float*>(R), M * N));
  gemm(M, N, K, A, B, C, N, true, DType::BF16, bias, bias_type);
}

GemmOperand gemm_operand(GemmOperand x, int64_t elems, DType compute, float* column_sums) {
  if (column_sums && (x.type != DType::F32 || x.trans)) throw SystemError("gemm_operand: column sums of a plain fp32 operand only");
  if (compute != DType::BF16 || x.type == DType::BF16) {
    if (column_sums) kernels::accumulate_column_sums(column_sums, static_cast<const float*>(x.data), elems / x.ld, x.ld);
    return x;
  }
  bf16* out = reinterpret_cast<bf16*>(workspace().take(workspace().shared16, elems));
  kernels::convert_summing_columns(out, column_sums, static_cast<const float*>(x.data), elems / x.ld, x.ld);
  x.data = out;
  x.type = DType::BF16;
  return x;
}

GemmOperand gemm_operand_slot(int64_t rows, int64_t ld) {
  return {workspace().take(workspace().shared16, rows * ld), DType::BF16, false, ld};
}

std::string gemm_path(DType compute) {
  if (compute == DType::F16) return "OpenBLAS sgemm on fp16-rounded operands";
  if (compute != DType::BF16) return "OpenBLAS sgemm";
#ifdef ZERO3D_HAVE_ONEDNN
  return "oneDNN bf16 matmul";
#else
  return "sgemm on bf16-rounded operands (built without oneDNN)";
#endif
}

int64_t gemm_workspace_bytes() { return workspace().peak_bytes; }

}  // namespace zero3d
