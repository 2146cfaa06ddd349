// test_mpi_onebit.cpp — the 1-bit compressed all-reduce (DEEPSPEED-FACTS-2 §5.2) against the
// NumPy simulation of tests/golden/make_onebit_goldens.py (onebit.h5: /allreduce), run under
// mpiexec at np 2, 3 and 4 (at np 1 there is no golden: the tests skip). Each rank feeds its own
// input of every call, with the error buffers carried from call to call, and compares the
// result and both of its error buffers after each call.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "io/h5.hpp"
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

}  // namespace
