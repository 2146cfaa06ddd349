// gemm.cpp — see gemm.hpp. Operand conversions go through a reusable workspace so that a
// training step allocates nothing.
#include "gemm.hpp"

#include <cblas.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "base.hpp"
#include "half.hpp"
#include "profiler.hpp"

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
  std::vector<float> a32, b32;
  int64_t peak_bytes = 0;
  template <typename T>
  T* take(std::vector<T>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
    const int64_t bytes =
        static_cast<int64_t>((a16.size() + b16.size() + shared16.size()) * 2 + (a32.size() + b32.size()) * 4);
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

#ifdef ZERO3D_HAVE_ONEDNN
struct Dnnl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int64_t, bool>;
  std::map<Key, dnnl::matmul> primitives;
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

void gemm_onednn(int64_t M, int64_t N, int64_t K, const bf16* a, bool ta, int64_t lda, const bf16* b, bool tb,
                 int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  using namespace dnnl;
  Dnnl& d = dnnl_state();
  const memory::desc ad({M, K}, memory::data_type::bf16, ta ? memory::dims{1, lda} : memory::dims{lda, 1});
  const memory::desc bd({K, N}, memory::data_type::bf16, tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
  const memory::desc cd({M, N}, memory::data_type::f32, memory::dims{ldc, 1});
  const Dnnl::Key key{M, N, K, ta, tb, lda, ldb, ldc, accumulate};
  auto it = d.primitives.find(key);
  if (it == d.primitives.end()) {
    primitive_attr attr;
    if (accumulate) {
      post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    it = d.primitives.emplace(key, matmul(matmul::primitive_desc(matmul::desc(ad, bd, cd), attr, d.engine))).first;
  }
  memory am(ad, d.engine, const_cast<bf16*>(a)), bm(bd, d.engine, const_cast<bf16*>(b)), cm(cd, d.engine, c);
  it->second.execute(d.stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  d.stream.wait();
}
#endif
}  // namespace

void gemm(int64_t M, int64_t N, int64_t K, GemmOperand A, GemmOperand B, float* C, int64_t ldc, bool accumulate,
          DType compute) {
  obs::add_macs(static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K));  // the flops profiler's count
  Workspace& w = workspace();
  const int64_t na = stored_elems(A.trans ? K : M, A);
  const int64_t nb = stored_elems(B.trans ? N : K, B);
  if (compute == DType::BF16) {
    const bf16* a = as_bf16(A, na, w.a16);
    const bf16* b = as_bf16(B, nb, w.b16);
#ifdef ZERO3D_HAVE_ONEDNN
    gemm_onednn(M, N, K, a, A.trans, A.ld, b, B.trans, B.ld, C, ldc, accumulate);
    return;
#else
    float* a32 = w.take(w.a32, na);
    float* b32 = w.take(w.b32, nb);
    kernels::convert(a32, a, na);
    kernels::convert(b32, b, nb);
    A = {a32, DType::F32, A.trans, A.ld};
    B = {b32, DType::F32, B.trans, B.ld};
#endif
  }
  const float* a = as_f32(A, na, w.a32);
  const float* b = as_f32(B, nb, w.b32);
  cblas_sgemm(CblasRowMajor, A.trans ? CblasTrans : CblasNoTrans, B.trans ? CblasTrans : CblasNoTrans, M, N, K, 1.0f,
              a, A.ld, b, B.ld, accumulate ? 1.0f : 0.0f, C, ldc);
}

GemmOperand gemm_operand(GemmOperand x, int64_t elems, DType compute) {
  if (compute != DType::BF16 || x.type == DType::BF16) return x;
  x.data = as_bf16(x, elems, workspace().shared16);
  x.type = DType::BF16;
  return x;
}

std::string gemm_path(DType compute) {
  if (compute != DType::BF16) return "OpenBLAS sgemm";
#ifdef ZERO3D_HAVE_ONEDNN
  return "oneDNN bf16 matmul";
#else
  return "sgemm on bf16-rounded operands (built without oneDNN)";
#endif
}

int64_t gemm_workspace_bytes() { return workspace().peak_bytes; }

}  // namespace zero3d
