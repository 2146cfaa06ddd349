// test_mpi_tensor_parallel.cpp — the tensor-parallel layers against the unsplit model, under
// mpiexec at np 1, 2 and 4 with t = np (Megatron's test_mappings / test_cross_entropy and
// DeepSpeed's TestTpLayerFwdBwd, at the level of the whole block): each rank runs its slices
// of column-parallel c_attn and c_fc, row-parallel c_projs, vocab-parallel embedding and
// cross-entropy; the loss and every gradient slice must equal the t = 1 model's.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "base/rng.hpp"
#include "model/model.hpp"
#include "parallel/comm.hpp"

using namespace zero3d;

namespace {

// V = 61 pads to a multiple of t (the padding must change nothing); H = 4 gives t = 4 one head each.
const GPTShape kShape{61, 8, 2, 4, 16};
constexpr int64_t kB = 2, kT = 8;

struct Variant {
  bool sequence_parallel, overlap, split_backward;
};

class TensorParallelLayers : public ::testing::TestWithParam<Variant> {};

TEST_P(TensorParallelLayers, LossAndEveryGradientSliceEqualTheUnsplitModel) {
  MpiCommunicator comm(MPI_COMM_WORLD);
  const int t = comm.size(), rank = comm.rank();
  const Variant v = GetParam();
  if (kShape.n_head % t != 0) GTEST_SKIP() << "t = " << t << " does not divide the heads";

  // The unsplit model on every rank.
  FlatModel full(kShape, kB, kT);
  init_gpt_params(full.params.data(), full.model.layout(), kShape, 7);
  Kokkos::View<int32_t*> tokens("tokens", kB * kT), targets("targets", kB * kT);
  for (int64_t i = 0; i < kB * kT; ++i) {
    tokens(i) = static_cast<int32_t>((i * 7 + 3) % kShape.vocab_size);
    targets(i) = static_cast<int32_t>((i * 5 + 11) % kShape.vocab_size);
  }
  const float want_loss = full.forward(tokens.data(), targets.data());
  full.backward(1.0f);

  // This rank's slices, cut from the same weights through the part's runs.
  ModelPart part = gpt_model_part(kShape, {0, static_cast<int>(kShape.n_layer) + 2}, 1, 0, t, rank);
  GPT local(kShape, kB, kT, DType::F32, part, TensorGroup{&comm, t, rank, v.overlap, v.sequence_parallel});
  FlatBuffer params = make_flat_buffer("params", local.num_params()), grads = make_flat_buffer("grads", local.num_params());
  for (const LayoutSegment& r : local.part().global_runs(0, local.num_params(), false))
    for (int64_t i = r.local_begin; i < r.local_end; ++i) params(i) = full.params(r.global_begin + (i - r.local_begin));
  FlatParamStore store(local.units(), params.data(), grads.data());
  ActivationBuffer buf = local.make_buffer(v.split_backward);
  buf.tokens = tokens.data();
  buf.targets = targets.data();
  const float got_loss = local.forward(0, buf, store);
  if (v.split_backward) {
    local.backward(0, buf, 1.0f, store, BackwardPart::Input);
    local.backward(0, buf, 1.0f, store, BackwardPart::Weight);
  } else {
    local.backward(0, buf, 1.0f, store);
  }
  EXPECT_NEAR(got_loss, want_loss, 1e-6 * std::fabs(want_loss));

  // Every local gradient element equals the unsplit gradient at its global offset; with
  // sequence parallelism the LayerNorm gradients are per-shard parts that sum to it.
  std::vector<float> ln(static_cast<size_t>(local.num_params()), 0.0f);
  for (const TensorSpec& ts : local.layout().tensors())
    if (v.sequence_parallel && (ts.name.rfind("ln_f.", 0) == 0 || ts.name.find(".ln_") != std::string::npos))
      for (int64_t i = ts.offset; i < ts.offset + ts.numel; ++i) ln[i] = 1.0f;
  std::vector<float> summed(grads.data(), grads.data() + local.num_params());
  std::vector<float> ln_sum(summed);
  comm.all_reduce(ln_sum.data(), static_cast<int64_t>(ln_sum.size()), DType::F32, ReduceOp::Sum);
  float worst = 0.0f;
  int64_t covered = 0;
  for (const LayoutSegment& r : local.part().global_runs(0, local.num_params(), false))
    for (int64_t i = r.local_begin; i < r.local_end; ++i, ++covered) {
      const float g = ln[i] != 0.0f ? ln_sum[i] : summed[i];
      worst = std::max(worst, std::fabs(g - full.grads(r.global_begin + (i - r.local_begin))));
    }
  EXPECT_LE(worst, 2e-6f) << "t=" << t << " rank " << rank;
  // padding rows of the vocabulary get no gradient
  const TensorSpec* wte = local.layout().find("wte.weight");
  for (int64_t row = part.vocab_real; row < part.vocab_local; ++row)
    for (int64_t c = 0; c < kShape.n_embd; ++c) EXPECT_EQ(grads(wte->offset + row * kShape.n_embd + c), 0.0f);
  EXPECT_GT(covered, 0);
}

INSTANTIATE_TEST_SUITE_P(Regions, TensorParallelLayers,
                         ::testing::Values(Variant{false, false, false}, Variant{false, true, false},
                                           Variant{false, false, true}, Variant{true, false, false},
                                           Variant{true, false, true}),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return std::string(info.param.sequence_parallel ? "SequenceParallel" : "Plain") +
                                  (info.param.overlap ? "Overlap" : "") + (info.param.split_backward ? "Split" : "");
                         });

}  // namespace
