// test_mpi_onebit.cpp — the 1-bit compressed all-reduce (DEEPSPEED-FACTS-2 §5.2) against the
// NumPy simulation of tests/golden/make_onebit_goldens.py (onebit.h5: /allreduce), run under
// mpiexec at np 2, 3 and 4 (at np 1 there is no golden: the tests skip). Each rank feeds its own
// input of every call, with the error buffers carried from call to call, and compares the
// result and both of its error buffers after each call. Then OneBitAdam (§5.3) through the
// Optimizer the engine uses, driven as the engine drives it, against the PyTorch reference of
// the same script (/onebit_adam, np 2 and 4) over 20 steps crossing the freeze.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "io/h5.hpp"
#include "optim/onebit.hpp"
#include "optim/optimizer.hpp"
#include "parallel/compressed_allreduce.hpp"

using namespace zero3d;

namespace {

const std::string kGolden = std::string(ZERO3D_GOLDEN_DIR) + "/onebit.h5";

// Largest |a − b| / max(1, |b|) over the range: absolute below 1, relative above.
double worst(const float* a, const float* b, int64_t n) {
  double w = 0.0;
  for (int64_t i = 0; i < n; ++i) w = std::max(w, std::abs(double(a[i]) - b[i]) / std::max(1.0, std::abs(double(b[i]))));
  return w;
}

TEST(CompressedAllReduce, PaddingIsDeepSpeedsCorrectedTensorSize) {
  // W·lcm(W, 8): 16 at W 2, 72 at W 3, 32 at W 4, 8 at W 1
  EXPECT_EQ(onebit_padded_size(1, 2), 16);
  EXPECT_EQ(onebit_padded_size(16, 2), 16);
  EXPECT_EQ(onebit_padded_size(17, 2), 32);
  EXPECT_EQ(onebit_padded_size(37, 3), 72);
  EXPECT_EQ(onebit_padded_size(73, 3), 144);
  EXPECT_EQ(onebit_padded_size(200, 4), 224);
  EXPECT_EQ(onebit_padded_size(5, 1), 8);
  EXPECT_EQ(onebit_padded_size(0, 4), 0);
  EXPECT_EQ(onebit_padded_size(6, 6), 144);  // lcm(6, 8) = 24
}

TEST(CompressedAllReduce, MatchesTheNumPySimulationWithBothErrorBuffers) {
  MpiCommunicator comm(MPI_COMM_WORLD);
  const int w = comm.size(), r = comm.rank();
  if (w == 1) GTEST_SKIP() << "goldens at world 2, 3 and 4";
  const h5::File f = h5::File::open_read(kGolden);
  for (int n : {1, 7, 37, 200, 1003}) {
    const std::string g = "allreduce/w" + std::to_string(w) + "/n" + std::to_string(n);
    ASSERT_TRUE(f.has(g + "/input")) << g;
    const std::vector<float> input = f.read_floats(g + "/input"), output = f.read_floats(g + "/output");
    const std::vector<float> werr = f.read_floats(g + "/worker_error"), serr = f.read_floats(g + "/server_error");
    const int64_t padded = onebit_padded_size(n, w), chunk = padded / w;
    const int calls = static_cast<int>(output.size() / n);
    ASSERT_EQ(static_cast<int64_t>(werr.size()), int64_t(calls) * w * padded) << g;
    CompressedAllReduce car(comm);
    OneBitErrors e;
    for (int c = 0; c < calls; ++c) {
      std::vector<float> buf(input.begin() + (int64_t(c) * w + r) * n, input.begin() + (int64_t(c) * w + r + 1) * n);
      comm.reset_bus_bytes();
      car.run(buf.data(), n, e);
      // bytes: all-to-all and all-gather of padded/8 sign bytes, two all-gathers of W scales
      const double ring = double(w - 1) / w;
      const auto part = [&](int64_t bytes) { return static_cast<int64_t>(ring * double(bytes)); };
      EXPECT_EQ(comm.bus_bytes(), 2 * part(padded / 8) + 2 * part(4 * w)) << g;
      ASSERT_EQ(static_cast<int64_t>(e.worker.size()), padded);
      ASSERT_EQ(static_cast<int64_t>(e.server.size()), chunk);
      EXPECT_LT(worst(buf.data(), output.data() + int64_t(c) * n, n), 1e-6) << g << " call " << c << " result";
      EXPECT_LT(worst(e.worker.data(), werr.data() + (int64_t(c) * w + r) * padded, padded), 1e-6)
          << g << " call " << c << " worker error";
      EXPECT_LT(worst(e.server.data(), serr.data() + (int64_t(c) * w + r) * chunk, chunk), 1e-6)
          << g << " call " << c << " server error";
    }
  }
}

// The result is the same on every rank, and a constant tensor that needs no padding comes back
// exactly, with both errors zero: every sign agrees, so both scales are |value|. (Padded, it
// would not: the zeros of the padding count in ‖x‖/sqrt(padded).)
TEST(CompressedAllReduce, AgreesOnEveryRankAndKeepsAConstantExactly) {
  MpiCommunicator comm(MPI_COMM_WORLD);
  const int w = comm.size();
  const int64_t n = onebit_padded_size(50, w);
  std::vector<float> buf(static_cast<size_t>(n), -0.25f);
  OneBitErrors e;
  CompressedAllReduce(comm).run(buf.data(), n, e);
  for (float v : buf) ASSERT_EQ(v, -0.25f);
  for (float v : e.worker) ASSERT_EQ(v, 0.0f);
  for (float v : e.server) ASSERT_EQ(v, 0.0f);
  // rank-dependent input: the result must still agree bit for bit
  std::vector<float> mine(33);
  for (int i = 0; i < 33; ++i) mine[i] = std::sin(float(i * (comm.rank() + 1)));
  OneBitErrors e2;
  CompressedAllReduce(comm).run(mine.data(), 33, e2);
  std::vector<float> all(static_cast<size_t>(33 * w));
  comm.all_gather(mine.data(), all.data(), 33, DType::F32);
  for (int k = 1; k < w; ++k)
    for (int i = 0; i < 33; ++i) ASSERT_EQ(all[k * 33 + i], all[i]) << "rank " << k << " element " << i;
}

double attr(const h5::File& f, const std::string& group, const char* name) {
  double v = 0.0;
  h5::Handle a(H5Aopen_by_name(f.id(), group.c_str(), name, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  H5Aread(a.get(), H5T_NATIVE_DOUBLE, &v);
  return v;
}

TEST(OneBitAdam, MatchesThePyTorchReferenceAcrossTheFreeze) {
  MpiCommunicator comm(MPI_COMM_WORLD);
  const int w = comm.size(), r = comm.rank();
  if (w != 2 && w != 4) GTEST_SKIP() << "goldens at world 2 and 4";
  const h5::File f = h5::File::open_read(kGolden);
  const std::string g = "onebit_adam/w" + std::to_string(w);
  ParamLayout layout;
  const std::vector<int32_t> sizes = f.read_ints(g + "/sizes");
  for (size_t k = 0; k < sizes.size(); ++k) layout.add("t" + std::to_string(k), {sizes[k]});
  OptimizerConfig c;
  c.type = OptimizerType::OneBitAdam;
  c.freeze_step = static_cast<int64_t>(attr(f, g, "freeze_step"));
  c.beta1 = attr(f, g, "beta1");
  c.beta2 = attr(f, g, "beta2");
  c.eps = attr(f, g, "eps");
  c.weight_decay = attr(f, g, "weight_decay");
  Optimizer opt(c, layout, DType::F32, &comm);
  const int64_t n = layout.total();
  std::vector<float> p = f.read_floats(g + "/p0");
  const std::vector<float> grads = f.read_floats(g + "/grads"), lr = f.read_floats(g + "/lr");
  const std::vector<float> want = f.read_floats(g + "/params");
  const int steps = static_cast<int>(lr.size());
  ASSERT_GT(steps, c.freeze_step + 2);
  int compressed_steps = 0;
  for (int s = 0; s < steps; ++s) {
    std::vector<float> grad(grads.begin() + (int64_t(s) * w + r) * n, grads.begin() + (int64_t(s) * w + r + 1) * n);
    // the engine: the averaged gradient (sum, then 1/W) while warming up, the local one after
    const bool averaged = opt.backward_allreduce();
    EXPECT_EQ(averaged, s + 1 <= std::max<int64_t>(c.freeze_step, 2)) << "step " << s + 1;
    comm.reset_bus_bytes();
    if (averaged) {
      comm.all_reduce(grad.data(), n, DType::F32, ReduceOp::Sum);
      for (float& x : grad) x *= 1.0f / float(w);
    } else {
      ++compressed_steps;
    }
    const std::vector<float> before = p;
    opt.step(p.data(), grad.data(), double(lr[s]));
    if (s == 0) {
      EXPECT_EQ(p, before) << "the initialisation step updates nothing";
    }
    if (!averaged) {  // the step's only traffic: one 1-bit all-reduce per tensor
      int64_t bytes = 0;
      const double ring = double(w - 1) / w;
      for (int32_t k : sizes)
        bytes += 2 * static_cast<int64_t>(ring * double(onebit_padded_size(k, w) / 8)) +
                 2 * static_cast<int64_t>(ring * 4.0 * w);
      EXPECT_EQ(comm.bus_bytes(), bytes) << "step " << s + 1;
    }
    EXPECT_LT(worst(p.data(), want.data() + int64_t(s) * n, n), 1e-5) << "step " << s + 1;
  }
  EXPECT_EQ(compressed_steps, steps - std::max<int64_t>(c.freeze_step, 2));
}

// A checkpoint load (set_step_count) drops the error buffers and re-derives the phase from the
// step, as DeepSpeed's load_state_dict does.
TEST(OneBitAdam, ALoadResetsTheErrorsAndRederivesTheFreeze) {
  MpiCommunicator comm(MPI_COMM_WORLD);
  ParamLayout layout;
  layout.add("a", {10});
  OptimizerConfig c;
  c.type = OptimizerType::OneBitAdam;
  c.freeze_step = 3;
  Optimizer opt(c, layout, DType::F32, &comm);
  std::vector<float> p(10, 0.5f), g(10);
  for (int s = 0; s < 5; ++s) {
    for (int i = 0; i < 10; ++i) g[i] = std::cos(float(i + s + comm.rank()));
    opt.step(p.data(), g.data(), 1e-2);
  }
  EXPECT_FALSE(opt.backward_allreduce());  // step 6: past the freeze
  ASSERT_NE(opt.one_bit(), nullptr);
  if (comm.size() > 1) {  // steps 4 and 5 were compressed: their errors are held
    ASSERT_EQ(opt.one_bit()->errors().size(), 1u);
    EXPECT_EQ(static_cast<int64_t>(opt.one_bit()->errors()[0].worker.size()), onebit_padded_size(10, comm.size()));
  }
  opt.set_step_count(2);
  EXPECT_TRUE(opt.one_bit()->errors()[0].worker.empty());
  EXPECT_TRUE(opt.one_bit()->errors()[0].server.empty());
  EXPECT_TRUE(opt.backward_allreduce());   // step 3 warms up
  opt.set_step_count(3);
  EXPECT_FALSE(opt.backward_allreduce());  // step 4 is compressed (3 >= freeze_step)
}

}  // namespace
