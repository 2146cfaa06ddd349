// test_mpi_loco.cpp — LoCo-ZeRO++ (zeropp_loco_param): qgZ's reduce with error feedback
// (parallel/quantized_reduce_scatter.hpp, kernels/loco.hpp) against the NumPy simulation of
// DeepSpeed's all_to_all_loco_quant_reduce in tests/golden/make_loco_goldens.py (loco.h5): at
// np 4 two nodes of two ranks, at np 2 two nodes of one; five reductions of one bucket of
// several tensors, crossing resets of single tensors (reset_T 3 and 2). Every rank's reduced
// block after every reduction, and its kept errors (codes, scales) and the counter after the
// last, bit for bit. (np 1: no golden, skipped.)
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/h5.hpp"
#include "parallel/quantized_reduce_scatter.hpp"

using namespace zero3d;

namespace {

const std::string kGolden = std::string(ZERO3D_GOLDEN_DIR) + "/loco.h5";

std::vector<int64_t> longs(const std::vector<int32_t>& v) { return std::vector<int64_t>(v.begin(), v.end()); }

struct Split {
  MPI_Comm intra = MPI_COMM_NULL, inter = MPI_COMM_NULL;
  Split(int r, int k) {  // rank r = node·k + local
    MPI_Comm_split(MPI_COMM_WORLD, r / k, r % k, &intra);
    MPI_Comm_split(MPI_COMM_WORLD, r % k, r / k, &inter);
  }
  ~Split() {
    MPI_Comm_free(&intra);
    MPI_Comm_free(&inter);
  }
};

// One golden case: the world's, read on every rank.
struct LocoCase {
  int w = 0, r = 0, k = 0;
  std::string g;
  int64_t group = 0, total = 0, mine = 0, steps = 0;
  std::vector<int64_t> counts, tensors;
  LocoParams params;
  std::vector<float> x, want;  // every rank's bucket each reduction; this rank's blocks
  const float* src(int64_t s) const { return x.data() + (s * w + r) * total; }
  std::vector<float> want_at(int64_t s) const { return {want.begin() + s * mine, want.begin() + (s + 1) * mine}; }
};

LocoCase load_case(const h5::File& f) {
  LocoCase c;
  MPI_Comm_size(MPI_COMM_WORLD, &c.w);
  MPI_Comm_rank(MPI_COMM_WORLD, &c.r);
  c.g = c.w == 4 ? "loco_w4_nodes2" : "loco_w2_nodes2";
  c.k = f.read_ints(c.g + "/per_node")[0];
  c.group = f.read_ints(c.g + "/group")[0];
  c.counts = longs(f.read_ints(c.g + "/counts"));
  c.tensors = longs(f.read_ints(c.g + "/tensors"));
  c.params = {f.read_floats(c.g + "/err_beta")[0], f.read_ints(c.g + "/reset_T")[0]};
  for (int64_t n : c.counts) c.total += n;
  c.x = f.read_floats(c.g + "/x");  // [steps, world, total]
  c.want = f.read_floats(c.g + "/out_" + std::to_string(c.r));
  c.mine = c.counts[static_cast<size_t>(c.r)];
  c.steps = static_cast<int64_t>(c.x.size()) / (c.w * c.total);
  return c;
}

bool golden_world() {
  int w = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  return w == 2 || w == 4;
}

TEST(LocoReduce, MatchesTheNumPySimulationOfDeepSpeedsErrorFeedbackOverResets) {
  if (!golden_world()) GTEST_SKIP() << "goldens at world 2 and 4";
  const h5::File f = h5::File::open_read(kGolden);
  const LocoCase c = load_case(f);
  const int r = c.r;
  const std::string& g = c.g;
  ASSERT_EQ(static_cast<int64_t>(c.want.size()), c.steps * c.mine);
  Split split(r, c.k);
  {
    MpiCommunicator intra(split.intra), inter(split.inter);
    QuantizedReduceScatter qgz(intra, inter);
    qgz.enable_loco(c.params);
    for (int64_t s = 0; s < c.steps; ++s) {
      std::vector<float> out(static_cast<size_t>(c.mine), -1.0f);
      qgz.reduce(c.src(s), c.counts, c.group, out.data(), /*begin=*/0, c.tensors);
      EXPECT_EQ(out, c.want_at(s)) << "rank " << r << ", reduction " << s + 1;
    }
    // The kept errors: step 1's over the bucket, then step 2's over the blocks (m, local).
    const LocoState st = qgz.loco_state();
    std::vector<int32_t> codes(st.codes.begin(), st.codes.end());
    std::vector<int32_t> want_codes = f.read_ints(g + "/intra_codes_" + std::to_string(r));
    const std::vector<int32_t> inter_codes = f.read_ints(g + "/inter_codes_" + std::to_string(r));
    want_codes.insert(want_codes.end(), inter_codes.begin(), inter_codes.end());
    EXPECT_EQ(codes, want_codes) << "rank " << r;
    std::vector<float> want_scales = f.read_floats(g + "/intra_scales_" + std::to_string(r));
    const std::vector<float> inter_scales = f.read_floats(g + "/inter_scales_" + std::to_string(r));
    want_scales.insert(want_scales.end(), inter_scales.begin(), inter_scales.end());
    EXPECT_EQ(st.scales, want_scales) << "rank " << r;
    EXPECT_EQ(nlohmann::json::parse(st.meta).at("counter").get<int64_t>(), f.read_ints(g + "/counter")[0]);
    // the errors are really there: some codes are not zero
    EXPECT_NE(std::count(codes.begin(), codes.end(), 0), static_cast<long>(codes.size())) << "rank " << r;
    EXPECT_EQ(qgz.loco_bytes(), static_cast<int64_t>(st.codes.size() + 4 * st.scales.size()));
    EXPECT_EQ(qgz.loco_bytes(), loco_kept_bytes(c.counts, c.group, c.w / c.k, c.k, r));
  }
}

// A state saved and restored into a fresh reducer continues bit for bit (what a resume does).
TEST(LocoReduce, RestoredStateContinuesBitForBit) {
  if (!golden_world()) GTEST_SKIP() << "goldens at world 2 and 4";
  const LocoCase c = load_case(h5::File::open_read(kGolden));
  Split split(c.r, c.k);
  {
    MpiCommunicator intra(split.intra), inter(split.inter);
    std::vector<float> out(static_cast<size_t>(c.mine));
    LocoState saved;
    {
      QuantizedReduceScatter first(intra, inter);
      first.enable_loco(c.params);
      for (int64_t s = 0; s < 2; ++s) first.reduce(c.src(s), c.counts, c.group, out.data(), 0, c.tensors);
      saved = first.loco_state();
    }
    QuantizedReduceScatter resumed(intra, inter);
    resumed.enable_loco(c.params);
    resumed.set_loco_state(saved);
    for (int64_t s = 2; s < c.steps; ++s) {
      resumed.reduce(c.src(s), c.counts, c.group, out.data(), 0, c.tensors);
      EXPECT_EQ(out, c.want_at(s)) << "rank " << c.r << ", reduction " << s + 1;
    }
  }
}

// fp16's loss scale (stage3.py _loco_err_buf_update): a new scale multiplies every kept scale by
// new/old; an overflow drops the errors, so the next reduction is a fresh reducer's first.
TEST(LocoReduce, LossScaleRescalesTheErrorsAndAnOverflowDropsThem) {
  if (!golden_world()) GTEST_SKIP() << "goldens at world 2 and 4";
  const LocoCase c = load_case(h5::File::open_read(kGolden));
  Split split(c.r, c.k);
  {
    MpiCommunicator intra(split.intra), inter(split.inter);
    std::vector<float> out(static_cast<size_t>(c.mine)), fresh_out(out.size());
    QuantizedReduceScatter qgz(intra, inter);
    qgz.enable_loco(c.params);
    for (int64_t s = 0; s < 2; ++s) qgz.reduce(c.src(s), c.counts, c.group, out.data(), 0, c.tensors);
    const LocoState before = qgz.loco_state();
    qgz.loss_scale_changed(false, 0.5);
    const LocoState after = qgz.loco_state();
    EXPECT_EQ(after.codes, before.codes);
    std::vector<float> halved = before.scales;
    for (float& v : halved) v *= 0.5f;
    EXPECT_EQ(after.scales, halved);
    qgz.loss_scale_changed(true, 0.5);
    qgz.reduce(c.src(2), c.counts, c.group, out.data(), 0, c.tensors);
    QuantizedReduceScatter fresh(intra, inter);
    fresh.enable_loco(c.params);
    fresh.reduce(c.src(2), c.counts, c.group, fresh_out.data(), 0, c.tensors);
    EXPECT_EQ(out, fresh_out) << "rank " << c.r;
    // with the errors kept, reduction 3 differs somewhere (a rank whose blocks reset at reduction 3
    // by reset_T gets a fresh reducer's result either way)
    int differs = out != c.want_at(2), anywhere = 0;
    MPI_Allreduce(&differs, &anywhere, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    EXPECT_EQ(anywhere, 1);
  }
}

}  // namespace
