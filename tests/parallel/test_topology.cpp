// test_topology.cpp — every ProcessTopology example of the DeepSpeed API docs (seeds), exactly.
#include <gtest/gtest.h>

#include <stdexcept>

#include "parallel/topology.hpp"

using namespace zero3d;
using Lists = std::vector<std::vector<int>>;

namespace {

TEST(ProcessTopology, GetRankOfDocsExample) {
  ProcessTopology X({"x", "y"}, {2, 3});
  EXPECT_EQ(X.get_rank({{"x", 0}, {"y", 1}}), 1);
}

TEST(ProcessTopology, GetRankReprOmitsDataAndPipeByDefault) {
  ProcessTopology topo({"a", "b"}, {2, 2});
  EXPECT_EQ(topo.get_rank_repr(3), "a_01-b_01");
  EXPECT_EQ(topo.get_rank_repr(3, {"a"}), "b_01");
}

TEST(ProcessTopology, GetRankReprOfPipeDataModelShowsOnlyModel) {
  auto topo = ProcessTopology::pipe_data_model(2, 2, 2);
  EXPECT_EQ(topo.get_rank_repr(5), "model_01");
  EXPECT_EQ(topo.get_rank_repr(5, {}, "=", "/"), "pipe=01/data=00/model=01");
}

TEST(ProcessTopology, GetDimOfDocsExample) {
  ProcessTopology X({"x", "y"}, {2, 3});
  EXPECT_EQ(X.get_dim("y"), 3);
  EXPECT_EQ(X.get_dim("z"), 0);
}

TEST(ProcessTopology, GetCoordOfDocsExample) {
  ProcessTopology X({"x", "y"}, {2, 3});
  auto c = X.get_coord(1);
  EXPECT_EQ(c["x"], 0);
  EXPECT_EQ(c["y"], 1);
}

TEST(ProcessTopology, GetAxisCommListsOfDocsExample) {
  auto topo = ProcessTopology::pipe_data_model(2, 2, 2);
  EXPECT_EQ(topo.get_axis_comm_lists("pipe"), (Lists{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(topo.get_axis_comm_lists("data"), (Lists{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(topo.get_axis_comm_lists("model"), (Lists{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(topo.get_axis_comm_lists("expert"), Lists{});
}

TEST(ProcessTopology, FilterMatchOfDocsExample) {
  ProcessTopology X({"pipe", "data", "model"}, {2, 2, 2});
  EXPECT_EQ(X.filter_match({{"pipe", 0}, {"data", 1}}), (std::vector<int>{2, 3}));
  auto c = X.get_coord(3);
  EXPECT_EQ(c, (ProcessTopology::Coord{{"pipe", 0}, {"data", 1}, {"model", 1}}));
}

TEST(ProcessTopology, GetAxisListOfDocsExample) {
  ProcessTopology X({"x", "y"}, {2, 3});
  EXPECT_EQ(X.get_axis_list("x", 0), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(X.get_axis_list("y", 0), (std::vector<int>{0, 3}));
}

TEST(ProcessTopology, AxisOrderDecidesAdjacency) {
  ProcessTopology xy({"x", "y"}, {2, 3}), yx({"y", "x"}, {3, 2});
  EXPECT_EQ(xy.get_rank({{"x", 0}, {"y", 1}}), 1);  // (x, y+1) adjacent
  EXPECT_EQ(yx.get_rank({{"x", 1}, {"y", 0}}), 1);  // (x+1, y) adjacent
}

TEST(ProcessTopology, RankAndCoordRoundTrip) {
  auto topo = ProcessTopology::pipe_data_model(3, 2, 4);
  for (int r = 0; r < topo.world_size(); ++r) EXPECT_EQ(topo.get_rank(topo.get_coord(r)), r);
}

TEST(ProcessTopology, GetRankNeedsEveryAxis) {
  ProcessTopology X({"x", "y"}, {2, 3});
  EXPECT_THROW(X.get_rank({{"x", 0}}), std::invalid_argument);
}

}  // namespace
