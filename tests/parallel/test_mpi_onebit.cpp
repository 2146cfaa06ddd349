// test_mpi_onebit.cpp — the 1-bit compressed all-reduce (DEEPSPEED-FACTS-2 §5.2) against the
// NumPy simulation of tests/golden/make_onebit_goldens.py (onebit.h5: /allreduce), run under
// mpiexec at np 2, 3 and 4 (at np 1 there is no golden: the tests skip). Each rank feeds its own
// input of every call, with the error buffers carried from call to call, and compares the
// result and both of its error buffers after each call. Then OneBitAdam, ZeroOneAdam and
// OneBitLamb (§5.3-5.5) through the Optimizer the engine uses, driven as the engine drives it,
// against the PyTorch references of the same script (/onebit_adam, /zero_one_adam,
// /onebit_lamb; np 2 and 4) over 20 steps crossing the freeze, and their checkpoint loads.
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

// The optimizer of a golden group: its type and the hyper-parameters the script wrote.
OptimizerConfig golden_config(const h5::File& f, const std::string& g, OptimizerType type) {
  OptimizerConfig c;
  c.type = type;
  const auto has = [&](const char* name) { return H5Aexists_by_name(f.id(), g.c_str(), name, H5P_DEFAULT) > 0; };
  const auto integer = [&](const char* name) { return static_cast<int64_t>(attr(f, g, name)); };
  c.beta1 = attr(f, g, "beta1");
  c.beta2 = attr(f, g, "beta2");
  c.eps = attr(f, g, "eps");
  c.weight_decay = attr(f, g, "weight_decay");
  if (has("freeze_step")) c.freeze_step = integer("freeze_step");
  if (has("var_freeze_step")) {
    c.var_freeze_step = integer("var_freeze_step");
    c.var_update_scaler = integer("var_update_scaler");
    c.local_step_scaler = integer("local_step_scaler");
    c.local_step_clipper = integer("local_step_clipper");
  }
  if (has("coeff_beta")) {
    c.max_coeff = attr(f, g, "max_coeff");
    c.min_coeff = attr(f, g, "min_coeff");
    c.coeff_beta = attr(f, g, "coeff_beta");
    c.factor_max = attr(f, g, "factor_max");
    c.factor_min = attr(f, g, "factor_min");
    c.factor_threshold = attr(f, g, "factor_threshold");
  }
  return c;
}

// The bytes one 1-bit all-reduce of n elements puts on the bus: the all-to-all and the
// all-gather of padded/8 sign bytes, two all-gathers of W scales.
int64_t onebit_bytes(int64_t n, int w) {
  const double ring = double(w - 1) / w;
  return 2 * static_cast<int64_t>(ring * double(onebit_padded_size(n, w) / 8)) + 2 * static_cast<int64_t>(ring * 4.0 * w);
}

struct ReferenceRun {
  std::vector<int> averaged;  // the steps whose gradients the engine averaged
  std::vector<int64_t> bytes;  // each step's bus bytes besides that average
};

// Drives the Optimizer as the engine drives it over a golden group's 20 steps (the averaged
// gradient, sum then 1/W, where backward_allreduce() says so, else this rank's own) and checks
// this rank's parameters after every step against the PyTorch reference's within 1e-5. The
// reference's params are [S, N], or [S, W, N] where the ranks' parameters differ (per_rank).
ReferenceRun run_reference(const h5::File& f, const std::string& g, Optimizer& opt, MpiCommunicator& comm,
                           const ParamLayout& layout, bool per_rank) {
  const int w = comm.size(), r = comm.rank();
  const int64_t n = layout.total();
  std::vector<float> p = f.read_floats(g + "/p0");
  const std::vector<float> grads = f.read_floats(g + "/grads"), lr = f.read_floats(g + "/lr");
  const std::vector<float> want = f.read_floats(g + "/params");
  const int steps = static_cast<int>(lr.size());
  EXPECT_EQ(static_cast<int64_t>(want.size()), int64_t(steps) * n * (per_rank ? w : 1));
  ReferenceRun run;
  for (int s = 0; s < steps; ++s) {
    std::vector<float> grad(grads.begin() + (int64_t(s) * w + r) * n, grads.begin() + (int64_t(s) * w + r + 1) * n);
    const bool averaged = opt.backward_allreduce();
    if (averaged) {
      run.averaged.push_back(s + 1);
      comm.all_reduce(grad.data(), n, DType::F32, ReduceOp::Sum);
      for (float& x : grad) x *= 1.0f / float(w);
    }
    comm.reset_bus_bytes();
    const std::vector<float> before = p;
    opt.step(p.data(), grad.data(), double(lr[s]));
    run.bytes.push_back(comm.bus_bytes());
    if (s == 0) {
      EXPECT_EQ(p, before) << "the initialisation step updates nothing";
    }
    const float* expect = want.data() + (per_rank ? (int64_t(s) * w + r) * n : int64_t(s) * n);
    EXPECT_LT(worst(p.data(), expect, n), 1e-5) << g << " step " << s + 1;
  }
  return run;
}

ParamLayout golden_layout(const h5::File& f, const std::string& g) {
  ParamLayout layout;
  const std::vector<int32_t> sizes = f.read_ints(g + "/sizes");
  for (size_t k = 0; k < sizes.size(); ++k) layout.add("t" + std::to_string(k), {sizes[k]});
  return layout;
}

std::vector<int> steps_through(int last) {
  std::vector<int> s;
  for (int i = 1; i <= last; ++i) s.push_back(i);
  return s;
}

TEST(OneBitAdam, MatchesThePyTorchReferenceAcrossTheFreeze) {
  MpiCommunicator comm(MPI_COMM_WORLD);
  const int w = comm.size();
  if (w != 2 && w != 4) GTEST_SKIP() << "goldens at world 2 and 4";
  const h5::File f = h5::File::open_read(kGolden);
  const std::string g = "onebit_adam/w" + std::to_string(w);
  const ParamLayout layout = golden_layout(f, g);
  const OptimizerConfig c = golden_config(f, g, OptimizerType::OneBitAdam);
  Optimizer opt(c, layout, DType::F32, &comm);
  const ReferenceRun run = run_reference(f, g, opt, comm, layout, false);
  // warm-up through step max(freeze_step, 2), then one 1-bit all-reduce per tensor each step
  const int frozen_from = static_cast<int>(std::max<int64_t>(c.freeze_step, 2)) + 1;
  EXPECT_EQ(run.averaged, steps_through(frozen_from - 1));
  int64_t per_step = 0;
  for (const TensorSpec& t : layout.tensors()) per_step += onebit_bytes(t.numel, w);
  for (size_t s = frozen_from - 1; s < run.bytes.size(); ++s) EXPECT_EQ(run.bytes[s], per_step) << "step " << s + 1;
}

// 0/1 Adam with var_freeze_step 8, var_update_scaler 2, local_step_scaler 2, local_step_clipper 4:
// the variance is updated on steps 2, 3 (interval 1, doubled after two updates), 4, 6 (interval
// 2, doubled) and 8 (interval 4), the gradient is 1-bit all-reduced on steps 5, 7 and 9; from
// step 10 the ranks step locally and synchronise on steps 10, 11 (interval 1, doubled after two
// local steps), 12 (interval 2), 16 and 20 (interval 4, the clipper), their parameters
// differing in between.
TEST(ZeroOneAdam, MatchesThePyTorchReferenceAcrossTheFreeze) {
  MpiCommunicator comm(MPI_COMM_WORLD);
  const int w = comm.size();
  if (w != 2 && w != 4) GTEST_SKIP() << "goldens at world 2 and 4";
  const h5::File f = h5::File::open_read(kGolden);
  const std::string g = "zero_one_adam/w" + std::to_string(w);
  const ParamLayout layout = golden_layout(f, g);
  Optimizer opt(golden_config(f, g, OptimizerType::ZeroOneAdam), layout, DType::F32, &comm);
  const ReferenceRun run = run_reference(f, g, opt, comm, layout, true);
  EXPECT_EQ(run.averaged, (std::vector<int>{1, 2, 3, 4, 6, 8}));
  int64_t per_step = 0;
  for (const TensorSpec& t : layout.tensors()) per_step += onebit_bytes(t.numel, w);
  for (int s = 1; s <= 20; ++s) {
    const bool compressed = s == 5 || s == 7 || s == 9 || s == 10 || s == 11 || s == 12 || s == 16 || s == 20;
    EXPECT_EQ(run.bytes[s - 1], compressed ? per_step : 0) << "step " << s;
  }
}

// 1-bit Lamb with freeze_step 8: LAMB on averaged gradients through step 8, then every
// momentum in one flat 1-bit all-reduce per step; lamb_coeff_freeze as the reference's.
TEST(OneBitLamb, MatchesThePyTorchReferenceAcrossTheFreeze) {
  MpiCommunicator comm(MPI_COMM_WORLD);
  const int w = comm.size();
  if (w != 2 && w != 4) GTEST_SKIP() << "goldens at world 2 and 4";
  const h5::File f = h5::File::open_read(kGolden);
  const std::string g = "onebit_lamb/w" + std::to_string(w);
  const ParamLayout layout = golden_layout(f, g);
  Optimizer opt(golden_config(f, g, OptimizerType::OneBitLamb), layout, DType::F32, &comm);
  const ReferenceRun run = run_reference(f, g, opt, comm, layout, false);
  EXPECT_EQ(run.averaged, steps_through(8));
  for (size_t s = 8; s < run.bytes.size(); ++s) EXPECT_EQ(run.bytes[s], onebit_bytes(layout.total(), w)) << "step " << s + 1;
  const std::vector<float> coeff = f.read_floats(g + "/lamb_coeff_freeze");
  const auto* lamb = dynamic_cast<const OneBitLamb*>(opt.one_bit());
  ASSERT_NE(lamb, nullptr);
  for (size_t t = 0; t < coeff.size(); ++t) EXPECT_NEAR(lamb->lamb_coeff_freeze()[t], coeff[t], 1e-6 * coeff[t]);
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

// 0/1 Adam's intervals are functions of the step: an optimizer loaded at step n has the
// intervals and the all-reduce schedule of one that took n steps, fresh errors and a zero
// accumulator (DeepSpeed pops momentum_accumulator).
TEST(ZeroOneAdam, ALoadRederivesTheIntervalsFromTheStep) {
  MpiCommunicator comm(MPI_COMM_WORLD);
  ParamLayout layout;
  layout.add("a", {10});
  OptimizerConfig c;
  c.type = OptimizerType::ZeroOneAdam;
  c.var_freeze_step = 30, c.var_update_scaler = 3, c.local_step_scaler = 4, c.local_step_clipper = 8;
  Optimizer run(c, layout, DType::F32, &comm);
  std::vector<float> p(10, 0.5f), g(10);
  for (int s = 1; s <= 60; ++s) {
    for (int i = 0; i < 10; ++i) g[i] = std::cos(float(i + s + comm.rank()));
    run.step(p.data(), g.data(), 1e-3);
    Optimizer loaded(c, layout, DType::F32, &comm);
    loaded.set_step_count(s);
    const auto* a = dynamic_cast<const ZeroOneAdam*>(run.one_bit());
    const auto* b = dynamic_cast<const ZeroOneAdam*>(loaded.one_bit());
    ASSERT_TRUE(a && b);
    ASSERT_EQ(b->var_interval(), a->var_interval()) << "after step " << s;
    ASSERT_EQ(b->local_step_interval(), a->local_step_interval()) << "after step " << s;
    ASSERT_EQ(loaded.backward_allreduce(), run.backward_allreduce()) << "after step " << s;
  }
  // 30 + 1 steps of variance schedule (intervals 1, 2, 4, 8 after 3 updates each), then local
  // steps whose interval doubles every 4 up to 8
  const auto* a = dynamic_cast<const ZeroOneAdam*>(run.one_bit());
  EXPECT_EQ(a->var_interval(), 8);
  EXPECT_EQ(a->local_step_interval(), 8);
  EXPECT_TRUE(a->frozen(32));
  EXPECT_FALSE(a->frozen(31));
  run.set_step_count(60);
  for (const OneBitErrors& e : run.one_bit()->errors()) EXPECT_TRUE(e.worker.empty() && e.server.empty());
}

// 1-bit Lamb's per-tensor scalars live in its states, so a checkpoint carries them: loaded past
// the freeze they continue; loaded during the warm-up they restart (lamb_coeff_freeze 0,
// last_factor 1, no scaling_coeff), as DeepSpeed's load_state_dict resets them.
TEST(OneBitLamb, ALoadContinuesTheFrozenCoefficientsAndResetsTheWarmUps) {
  MpiCommunicator comm(MPI_COMM_WORLD);
  ParamLayout layout;
  layout.add("a", {10});
  layout.add("b", {7});
  OptimizerConfig c;
  c.type = OptimizerType::OneBitLamb;
  c.freeze_step = 4;
  c.weight_decay = 0.01;
  Optimizer run(c, layout, DType::F32, &comm);
  std::vector<float> p(17), g(17);
  for (int i = 0; i < 17; ++i) p[i] = 0.1f * float(i % 5) - 0.2f;
  const auto gradient = [&](int s) {
    for (int i = 0; i < 17; ++i) g[i] = std::cos(float(i * 3 + s + comm.rank()));
  };
  for (int s = 1; s <= 7; ++s) gradient(s), run.step(p.data(), g.data(), 1e-2);
  const auto* a = dynamic_cast<const OneBitLamb*>(run.one_bit());
  ASSERT_NE(a, nullptr);
  ASSERT_GT(a->scaling_coeff()[0], 0.0);
  ASSERT_NE(a->last_factor()[1], 1.0);
  const std::vector<double> scaling = a->scaling_coeff(), coeff = a->lamb_coeff_freeze();
  // A second optimizer given the first one's states and loaded at step 7 takes step 8 as the
  // first one does after the same load (errors restarted on both): the states hold all of it.
  Optimizer loaded(c, layout, DType::F32, &comm);
  const std::vector<TypedBuffer*> from = run.state_buffers(), to = loaded.state_buffers();
  ASSERT_EQ(run.state_names(), (std::vector<std::string>{"exp_avg", "exp_avg_sq", "exp_avg_sq_fresh",
                                                          "lamb_coeff_freeze", "last_factor", "scaling_coeff"}));
  for (size_t k = 0; k < from.size(); ++k) std::copy(from[k]->as<float>(), from[k]->as<float>() + 17, to[k]->as<float>());
  run.set_step_count(7);
  loaded.set_step_count(7);
  EXPECT_FALSE(loaded.backward_allreduce());
  std::vector<float> q = p;
  gradient(8);
  run.step(p.data(), g.data(), 1e-2);
  loaded.step(q.data(), g.data(), 1e-2);
  EXPECT_EQ(q, p);
  const auto* b = dynamic_cast<const OneBitLamb*>(loaded.one_bit());
  EXPECT_EQ(b->last_factor(), a->last_factor());
  for (size_t t = 0; t < 2; ++t) {  // continued, as saved (fp32)
    EXPECT_EQ(b->scaling_coeff()[t], double(float(scaling[t])));
    EXPECT_EQ(b->lamb_coeff_freeze()[t], double(float(coeff[t])));
  }
  // loaded during the warm-up: the coefficients restart
  Optimizer early(c, layout, DType::F32, &comm);
  early.set_step_count(3);
  const auto* e = dynamic_cast<const OneBitLamb*>(early.one_bit());
  EXPECT_EQ(e->lamb_coeff_freeze(), (std::vector<double>{0.0, 0.0}));
  EXPECT_EQ(e->last_factor(), (std::vector<double>{1.0, 1.0}));
  EXPECT_EQ(e->scaling_coeff(), (std::vector<double>{0.0, 0.0}));
  EXPECT_TRUE(early.backward_allreduce());
}

}  // namespace
