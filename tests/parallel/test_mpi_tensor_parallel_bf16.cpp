// test_mpi_tensor_parallel_bf16.cpp — a GPU build's bf16 step under tensor parallelism keeps each
// rank's saves in bf16 as one rank's step does (model/bf16_activations.hpp activations_bf16: the
// norms' outputs, q/k/v, the attention output, the MLP's hidden rows and activation; a
// sequence-parallel shard gathered in bf16) and its vocabulary slice's logits in bf16 (logits_bf16);
// tensor_parallel_bf16_on_host() and logits_bf16_on_host() run those choices here. As
// specifications, under mpiexec with t = np, for GPT-2 and a Qwen2 with grouped-query attention,
// plain, overlapped, split into input and weight passes, sequence-parallel, with dropout: the split
// model's loss is the unsplit bf16 model's (which keeps its saves in bf16 on either build) and its
// gradient slices are within bf16 rounding of the unsplit model's, nearer than the CPU build's
// fp32 saves bring them; its buffer is the plan's, smaller than the CPU build's; with sequence
// parallelism its four gathers of norm outputs a block move half the bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/device.hpp"
#include "model/bf16_activations.hpp"
#include "model/model.hpp"
#include "parallel/comm.hpp"
#include "support/model_section.hpp"
#include "support/typed_param_store.hpp"

using namespace zero3d;

namespace {

constexpr int64_t kB = 2, kT = 8;

GPTShape gpt2_shape() { return GPTShape{61, kT, 2, 4, 32}; }  // V 61 pads to a multiple of t

GPTShape qwen2_shape() {  // 4 query heads over 2 K/V heads, biases on q/k/v (Qwen2's)
  return test_support::shape_of_model_section({{"architecture", "qwen2"}, {"vocab_size", 61},
                                               {"max_position_embeddings", kT}, {"hidden_size", 32},
                                               {"intermediate_size", 48}, {"num_hidden_layers", 2},
                                               {"num_attention_heads", 4}, {"num_key_value_heads", 2}});
}

// The GPU build's choices for the scope (bf16 saves under tensor parallelism, bf16 logits),
// whatever they were before.
class GpuChoices {
 public:
  explicit GpuChoices(bool on) : saves_(tensor_parallel_bf16_on_host()), logits_(logits_bf16_on_host()) {
    tensor_parallel_bf16_on_host() = logits_bf16_on_host() = on;
  }
  ~GpuChoices() {
    tensor_parallel_bf16_on_host() = saves_;
    logits_bf16_on_host() = logits_;
  }
  GpuChoices(const GpuChoices&) = delete;
  GpuChoices& operator=(const GpuChoices&) = delete;

 private:
  bool saves_, logits_;
};

struct Variant {
  bool llama, sequence_parallel, overlap, split_backward, dropout = false;  // dropout: 0.1 at every site
};

class TensorParallelBf16Saves : public ::testing::TestWithParam<Variant> {};

struct Pass {
  float loss = 0.0f;
  double grad_error = 0.0, grad_norm = 0.0;  // over this rank's slices, against the unsplit model's
  int64_t buffer_bytes = 0, planned_bytes = 0;
  int64_t tensor_bytes = 0;  // what the tensor group moved (bus bytes) in the forward and backward
};

// One forward and backward of this rank's part, with the GPU build's choices or the CPU build's.
Pass split_pass(const GPTShape& shape, const Variant& v, Communicator& comm, const std::vector<float>& full_params,
                const std::vector<float>& full_grads, const int32_t* tokens, const int32_t* targets, bool gpu) {
  const GpuChoices hook(gpu);
  const int t = comm.size(), rank = comm.rank();
  const ModelPart part = gpt_model_part(shape, {0, static_cast<int>(shape.n_layer) + 2}, 1, 0, t, rank);
  GPT local(shape, kB, kT, DType::BF16, part, TensorGroup{&comm, t, rank, v.overlap, v.sequence_parallel});
  std::vector<float> params(static_cast<size_t>(local.num_params()), 0.0f);
  for (const LayoutSegment& r : local.part().global_runs(0, local.num_params(), false))
    for (int64_t i = r.local_begin; i < r.local_end; ++i) params[i] = full_params[r.global_begin + (i - r.local_begin)];
  TypedParamStore store(local, DType::BF16, params);  // rounded to bf16 as the unsplit model's
  ActivationBuffer buf = local.make_buffer(v.split_backward);
  buf.tokens = tokens;
  buf.targets = targets;
  Pass p;
  p.buffer_bytes = buf.bytes();
  p.planned_bytes = gpt_activation_bytes(shape, part, kB, kT, v.sequence_parallel, v.split_backward, {}, {},
                                         DType::BF16, kernels::Backend::Cpu)
                        .buffer;
  const int64_t bytes_before = comm.bus_bytes();
  p.loss = local.forward(0, buf, store);
  if (v.split_backward) {
    local.backward(0, buf, 1.0f, store, BackwardPart::Input);
    local.backward(0, buf, 1.0f, store, BackwardPart::Weight);
  } else {
    local.backward(0, buf, 1.0f, store);
  }
  p.tensor_bytes = comm.bus_bytes() - bytes_before;
  // with sequence parallelism a norm's gradient is a per-shard part: summed over the group
  std::vector<float> g = store.grads(), summed = g;
  comm.all_reduce(summed.data(), static_cast<int64_t>(summed.size()), DType::F32, ReduceOp::Sum);
  for (const TensorSpec& ts : local.layout().tensors())
    if (v.sequence_parallel && sequence_parallel_partial(ts.name))
      for (int64_t i = ts.offset; i < ts.offset + ts.numel; ++i) g[i] = summed[i];
  for (const LayoutSegment& r : local.part().global_runs(0, local.num_params(), false))
    for (int64_t i = r.local_begin; i < r.local_end; ++i) {
      const double want = full_grads[r.global_begin + (i - r.local_begin)];
      p.grad_error += (g[i] - want) * (g[i] - want);
      p.grad_norm += want * want;
    }
  p.grad_error = std::sqrt(p.grad_error);
  p.grad_norm = std::sqrt(p.grad_norm);
  return p;
}

TEST_P(TensorParallelBf16Saves, GiveTheUnsplitBf16ModelsLossAndGradientsInHalfTheFloats) {
  MpiCommunicator comm(MPI_COMM_WORLD);
  const int t = comm.size();
  const Variant v = GetParam();
  GPTShape shape = v.llama ? qwen2_shape() : gpt2_shape();
  if (v.dropout) shape.dropout = {v.llama ? 0.0 : 0.1, 0.1, v.llama ? 0.0 : 0.1, 5};  // the Llama family's is attention's
  const int64_t kv_heads = v.llama ? shape.family.num_key_value_heads : shape.n_head;
  if (t == 1 || kv_heads % t != 0) GTEST_SKIP() << "t = " << t << " splits no whole K/V head group here";

  // The unsplit model on every rank (its saves bf16 on either build), as each build runs it.
  std::vector<float> init;
  std::vector<int32_t> tokens(kB * kT), targets(kB * kT);
  for (int64_t i = 0; i < kB * kT; ++i) {
    tokens[i] = static_cast<int32_t>((i * 7 + 3) % shape.vocab_size);
    targets[i] = static_cast<int32_t>((i * 5 + 11) % shape.vocab_size);
  }
  struct Unsplit {
    float loss;
    std::vector<float> grads;
  };
  const auto unsplit = [&](bool gpu) {
    const GpuChoices hook(gpu);
    GPT full(shape, kB, kT, DType::BF16);
    init.assign(static_cast<size_t>(full.num_params()), 0.0f);
    init_gpt_params(init.data(), full.layout(), shape, 7);
    TypedParamStore store(full, DType::BF16, init);
    const float loss = full.forward(tokens.data(), targets.data(), store);
    full.backward(1.0f, store);
    return Unsplit{loss, store.grads()};
  };
  const Unsplit gpu_full = unsplit(true), cpu_full = unsplit(false);
  const Pass gpu = split_pass(shape, v, comm, init, gpu_full.grads, tokens.data(), targets.data(), true);
  const Pass cpu = split_pass(shape, v, comm, init, cpu_full.grads, tokens.data(), targets.data(), false);
  const std::string what = std::string(v.llama ? "qwen2" : "gpt2") + " t=" + std::to_string(t);
  // the figures, for --gtest_output: each build's gradient distance from its unsplit model
  char figures[96];
  std::snprintf(figures, sizeof figures, "%.3g (CPU build: %.3g)", gpu.grad_error / gpu.grad_norm,
                cpu.grad_error / cpu.grad_norm);
  RecordProperty("relative_gradient_error", figures);
  // A GPU build's split model rounds where its unsplit one does, so its loss is the unsplit
  // model's and its gradients are within bf16 rounding of them (a row-parallel product's partial
  // sums, summed over the group, round apart from the whole product's sums) ...
  EXPECT_NEAR(gpu.loss, gpu_full.loss, 1e-6 * std::fabs(gpu_full.loss)) << what;
  EXPECT_LE(gpu.grad_error, 2e-3 * gpu.grad_norm) << what;
  // ... nearer than the CPU build's fp32 saves bring its split model to its unsplit one: those
  // round q, k, v and c_fc's rows elsewhere.
  EXPECT_LT(gpu.grad_error, cpu.grad_error) << what;
  EXPECT_NEAR(cpu.loss, cpu_full.loss, 1e-4 * std::fabs(cpu_full.loss)) << what;
  // The buffer is carved as planned, and bf16 saves and logits take fewer bytes.
  EXPECT_EQ(gpu.buffer_bytes, gpu.planned_bytes) << what;
  EXPECT_EQ(cpu.buffer_bytes, cpu.planned_bytes) << what;
  EXPECT_LT(gpu.buffer_bytes, cpu.buffer_bytes) << what;
  // Sequence parallelism gathers ln_1 and ln_2 forward and again for the weight products: in
  // bf16, each gather's (t−1)/t of the B·T·C elements at 2 bytes where they took 4.
  const int64_t gathered = shape.n_layer * 4 * (t - 1) * (kB * kT * shape.n_embd / t) * 2;
  EXPECT_EQ(cpu.tensor_bytes - gpu.tensor_bytes, v.sequence_parallel ? gathered : 0) << what;
}

INSTANTIATE_TEST_SUITE_P(
    Regions, TensorParallelBf16Saves,
    ::testing::Values(Variant{false, false, false, false}, Variant{false, false, true, false},
                      Variant{false, false, false, true}, Variant{false, true, false, false},
                      Variant{false, true, false, true}, Variant{true, false, false, false},
                      Variant{true, false, true, false}, Variant{true, false, false, true},
                      Variant{true, true, false, false}, Variant{true, true, false, true},
                      Variant{false, false, false, false, true}, Variant{false, true, false, false, true},
                      Variant{true, false, false, false, true}),
    [](const ::testing::TestParamInfo<Variant>& info) {
      return std::string(info.param.llama ? "Qwen2" : "Gpt2") + (info.param.sequence_parallel ? "SequenceParallel" : "Plain") +
             (info.param.overlap ? "Overlap" : "") + (info.param.split_backward ? "Split" : "") +
             (info.param.dropout ? "Dropout" : "");
    });

}  // namespace
