// test_agreement.cpp — the pieces of the ranks' start-up agreement (agreement.hpp): the
// first differing key, the digest, and what the agreement document leaves out.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "base/xxh64.hpp"
#include "cli/agreement.hpp"

using json = nlohmann::json;
using namespace zero3d;

namespace {

TEST(Agreement, FirstDifferenceWalksKeysInOrderAndNamesThePath) {
  const json a = {{"model", {{"n_embd", 64}, {"n_layer", 2}}}, {"training", {{"seed", 1}}}};
  json b = a;
  b["model"]["n_layer"] = 3;
  b["training"]["seed"] = 2;
  std::string key, va, vb;
  ASSERT_TRUE(first_difference(a, b, key, va, vb));
  EXPECT_EQ(key, "model.n_layer");
  EXPECT_EQ(va, "2");
  EXPECT_EQ(vb, "3");
  EXPECT_FALSE(first_difference(a, a, key, va, vb));
}

TEST(Agreement, AKeyOnOneSideOnlyIsAbsentOnTheOther) {
  const json a = {{"model", {{"n_layer", 2}}}};
  const json b = {{"model", {{"init_from", "w.h5"}, {"n_layer", 2}}}};
  std::string key, va, vb;
  ASSERT_TRUE(first_difference(a, b, key, va, vb));
  EXPECT_EQ(key, "model.init_from");
  EXPECT_EQ(va, "absent");
  EXPECT_EQ(vb, "\"w.h5\"");
}

TEST(Agreement, LongValuesAreCutWithTheirLength) {
  const json a = {{"k", std::string(1000, 'x')}}, b = {{"k", "y"}};
  std::string key, va, vb;
  ASSERT_TRUE(first_difference(a, b, key, va, vb));
  EXPECT_LT(va.size(), 120u);
  EXPECT_NE(va.find("(1002 characters)"), std::string::npos) << va;
}

TEST(Agreement, DigestSeesOneBit) {
  std::string s(1001, 'a');
  const uint64_t d = xxh64(s.data(), s.size());
  s[500] ^= 1;
  EXPECT_NE(xxh64(s.data(), s.size()), d);
  EXPECT_NE(xxh64(s.data(), s.size() - 1), xxh64(s.data(), s.size()));
}

TEST(Agreement, FileDigestFollowsTheBytesAndReportsAnUnreadableFile) {
  const std::string path = ::testing::TempDir() + "agreement_digest.bin";
  std::ofstream(path, std::ios::binary) << "weights";
  const std::string d1 = file_digest(path);
  EXPECT_EQ(d1.size(), 16u);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << "weightz";
  EXPECT_NE(file_digest(path), d1);
  std::remove(path.c_str());
  EXPECT_EQ(file_digest(path).rfind("unreadable (", 0), 0u) << file_digest(path);
}

TEST(Agreement, DocumentLeavesOutPerRankKeysAndComparesInitFromByContent) {
  Config c;
  c.resolved = {{"model", {{"n_layer", 2}, {"init_from", ""}}},
                {"training", {{"output_dir", "out/a"}, {"peak_gflops", 50.0}, {"comms_timeout", 0.0},
                              {"save_dir", "out/a/checkpoints"}, {"seed", 7}}}};
  json doc = agreement_document(c);
  EXPECT_FALSE(doc["training"].contains("output_dir"));
  EXPECT_FALSE(doc["training"].contains("peak_gflops"));
  EXPECT_FALSE(doc["training"].contains("comms_timeout"));
  EXPECT_FALSE(doc["training"].contains("save_dir")) << "no checkpoint is saved or read";
  EXPECT_FALSE(doc["model"].contains("init_from"));
  EXPECT_EQ(doc["training"]["seed"], 7);

  c.training.save_interval = 10;
  c.model.init_from = ::testing::TempDir() + "no_such_weights.h5";
  doc = agreement_document(c);
  EXPECT_EQ(doc["training"]["save_dir"], "out/a/checkpoints") << "every rank writes its shard there";
  EXPECT_EQ(doc["model"]["init_from (file content digest)"].get<std::string>().rfind("unreadable", 0), 0u);
}

}  // namespace
