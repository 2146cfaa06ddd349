// test_mpi_observer.cpp — the wall_clock_breakdown's all-gather phase is the step's own (issue
// 35): blocked time the data group's log records between Observer::end_step and the next
// begin_step (an in-training evaluation's ZeRO-3 fetches) belongs to eval_ms, not to the step
// before or after it. Run under mpiexec at np 1, 2 and 4; the times are recorded by hand, so
// the figures are exact.
#include <gtest/gtest.h>

#include "config/config.hpp"
#include "model/model.hpp"
#include "observe/comms_logger.hpp"
#include "parallel/comm.hpp"
#include "train/engine.hpp"
#include "train/observer.hpp"

using namespace zero3d;

namespace {

TEST(ObserverBreakdown, AllgatherPhaseLeavesOutWhatCameBetweenSteps) {
  MpiCommunicator world(MPI_COMM_WORLD), data(MPI_COMM_WORLD);
  nlohmann::json j = {{"train_micro_batch_size_per_gpu", 1},
                      {"gradient_accumulation_steps", 1},
                      {"wall_clock_breakdown", true},
                      {"model", {{"vocab_size", 64}, {"n_positions", 16}, {"n_layer", 1}, {"n_head", 2}, {"n_embd", 32}}}};
  const Config cfg = read_config(j, "observer.json", world.size());
  const GPTShape shape{64, 16, 1, 2, 32};
  GPT model(shape, 1, 16);
  Observer observer(cfg, world.rank(), ObservedComms{&data, nullptr, nullptr, &world, nullptr, nullptr, {}}, model, "", 1.0);
  ASSERT_NE(data.log(), nullptr);
  const auto step = [&](int64_t n, double during, double after) {
    observer.begin_step(n);
    data.log()->record(CommOp::AllGather, 4096, during, during);  // the step's fetches
    observer.end_step();
    data.log()->record(CommOp::AllGather, 4096, after, after);  // an evaluation's, after the step
    StepResult r;
    r.step = n;
    observer.after_step(r, 8 * n, {});
    nlohmann::json record;
    observer.annotate(record);
    return record.at("time_ms").at("allgather").get<double>();
  };
  EXPECT_EQ(step(1, 5.0, 7.0), 5.0);
  EXPECT_EQ(step(2, 3.0, 0.0), 3.0);  // the evaluation's 7 ms do not arrive a step late either
}

}  // namespace
