// test_data.cpp — micro-batches are a pure function of (seed, k); llm.c shards read as llm.c does.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>

#include "base/errors.hpp"
#include "io/data.hpp"

using namespace zero3d;

namespace {

std::string write_shard(const std::string& name, int n_tokens, int32_t magic = 20240520) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream out(path, std::ios::binary);
  int32_t header[256] = {};
  header[0] = magic;
  header[1] = 1;
  header[2] = n_tokens;
  out.write(reinterpret_cast<const char*>(header), sizeof(header));
  for (int i = 0; i < n_tokens; ++i) {
    const uint16_t t = static_cast<uint16_t>(i % 50);
    out.write(reinterpret_cast<const char*>(&t), 2);
  }
  return path;
}

DataConfig tokens_config(const std::string& path) {
  DataConfig d;
  d.source = DataSource::Tokens;
  d.path = path;
  return d;
}

TEST(TokenShards, MicroBatchKIsTheWindowStartingAtKTimesBT) {
  DataLoader data(tokens_config(write_shard("shard_a.bin", 100)), 50, 2, 4, 1);
  std::vector<int32_t> in(8), tgt(8);
  data.micro_batch(1 * 2, in.data(), tgt.data());  // micro-batch k = 1 starts at sample k·B
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(in[i], 8 + i);       // window of B*T+1 starting at k*B*T
    EXPECT_EQ(tgt[i], 8 + i + 1);  // targets shifted by one
  }
}

TEST(TokenShards, SamplesWrapAroundAfterTheLastWholeOne) {
  // 103 tokens, T = 4: samples start at 0, 4, ..., 96 (96 + 5 <= 103) -> 25 samples.
  DataLoader data(tokens_config(write_shard("shard_b.bin", 103)), 50, 2, 4, 1);
  EXPECT_EQ(data.samples_per_epoch(), 25);
  std::vector<int32_t> in(8), tgt(8);
  data.micro_batch(24, in.data(), tgt.data());  // the last sample, then the first again
  EXPECT_EQ(in[0], 96 % 50);
  EXPECT_EQ(in[4], 0);
}

// Which tokens sample s reads depends on (seed, s) only: micro-batches of 1, 2 or 3 samples see
// the same samples across a shard's end and the wrap-around (a global batch split over more
// data-parallel ranks has smaller micro-batches).
TEST(TokenShards, ASampleIsTheSameWhateverMicroBatchItIsPartOf) {
  const std::string glob = ::testing::TempDir() + "shard_e_*.bin";
  write_shard("shard_e_0.bin", 31);
  write_shard("shard_e_1.bin", 23);
  auto samples = [&](int64_t B) {
    DataLoader data(tokens_config(glob), 50, B, 4, 1);
    std::vector<int32_t> all, in(4 * B), tgt(4 * B);
    for (int64_t s = 0; s < 24; s += B) {
      data.micro_batch(s, in.data(), tgt.data());
      all.insert(all.end(), in.begin(), in.end());
      all.insert(all.end(), tgt.begin(), tgt.end());
    }
    return std::make_pair(data.samples_per_epoch(), all);
  };
  const auto one = samples(1);
  EXPECT_EQ(one.first, 7 + 5);  // (31 - 1) / 4 and (23 - 1) / 4 whole samples
  for (int64_t B : {2, 3}) {
    const auto b = samples(B);
    EXPECT_EQ(b.first, one.first) << "B = " << B;
    for (size_t s = 0; s < 24; s += size_t(B))  // samples s..s+B-1: inputs then targets
      for (int64_t k = 0; k < B; ++k)
        EXPECT_EQ(std::vector<int32_t>(b.second.begin() + (s * 8 + k * 4), b.second.begin() + (s * 8 + k * 4 + 4)),
                  std::vector<int32_t>(one.second.begin() + (s + k) * 8, one.second.begin() + (s + k) * 8 + 4))
            << "sample " << s + k << " at B = " << B;
  }
}

TEST(TokenShards, BytesBeyondTheHeadersCountAreRejectedNamingTheFile) {
  const std::string path = write_shard("shard_f.bin", 100);
  std::ofstream(path, std::ios::binary | std::ios::app) << "xyz";
  try {
    DataLoader data(tokens_config(path), 50, 2, 4, 1);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(TokenShards, WrongMagicIsRejectedNamingTheFile) {
  const std::string path = write_shard("shard_bad.bin", 100, 12345);
  try {
    DataLoader data(tokens_config(path), 50, 2, 4, 1);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("magic"), std::string::npos);
  }
}

TEST(TokenShards, TokenOutsideVocabularyIsRejected) {
  EXPECT_THROW(DataLoader(tokens_config(write_shard("shard_c.bin", 100)), 40, 2, 4, 1), InputError);
}

TEST(TokenShards, ShardTooSmallForOneSampleIsRejected) {
  EXPECT_THROW(DataLoader(tokens_config(write_shard("shard_d.bin", 4)), 50, 2, 4, 1), InputError);
  EXPECT_NO_THROW(DataLoader(tokens_config(write_shard("shard_d5.bin", 5)), 50, 2, 4, 1));
}

// llm.c's uint32 shards (magic 20240801, version 7: Llama 3's 128,256 tokens do not fit uint16).
std::string write_shard32(const std::string& name, const std::vector<uint32_t>& tokens, int32_t version = 7) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream out(path, std::ios::binary);
  int32_t header[256] = {};
  header[0] = 20240801;
  header[1] = version;
  header[2] = static_cast<int32_t>(tokens.size());
  out.write(reinterpret_cast<const char*>(header), sizeof(header));
  out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 4));
  return path;
}

TEST(TokenShards, Uint32ShardsReadTokensBeyond65535) {
  std::vector<uint32_t> toks;
  for (uint32_t i = 0; i < 40; ++i) toks.push_back(128000 + i * 5);  // up to 128195: inside Llama 3's 128,256
  const std::string path = write_shard32("shard32_a.bin", toks);
  EXPECT_EQ(read_token_shard(path), std::vector<int32_t>(toks.begin(), toks.end()));
  DataLoader data(tokens_config(path), 128256, 2, 4, 1);
  std::vector<int32_t> in(8), tgt(8);
  data.micro_batch(2, in.data(), tgt.data());  // samples 2 and 3: tokens 8..16
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(in[i], int32_t(toks[8 + i]));
    EXPECT_EQ(tgt[i], int32_t(toks[9 + i]));
  }
  // The same ids checked against the model's vocabulary as uint16 shards are.
  EXPECT_THROW(DataLoader(tokens_config(path), 128000, 2, 4, 1), InputError);
}

TEST(TokenShards, Uint32ShardsCheckTheirVersionAndSize) {
  const std::vector<uint32_t> toks(20, 3);
  try {
    read_token_shard(write_shard32("shard32_v1.bin", toks, 1));
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("version 1"), std::string::npos) << e.what();
  }
  const std::string path = write_shard32("shard32_b.bin", toks);
  std::ofstream(path, std::ios::binary | std::ios::app) << "xy";  // 2 bytes: a uint16 count would accept 1 more
  try {
    read_token_shard(path);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("80 bytes"), std::string::npos) << e.what();
  }
}

TEST(TextData, BytesAreTokens) {
  const std::string path = ::testing::TempDir() + "text.txt";
  std::ofstream(path) << "hello, world! hello, world!";
  DataConfig d;
  d.source = DataSource::Text;
  d.path = path;
  DataLoader data(d, 256, 1, 4, 1);
  std::vector<int32_t> in(4), tgt(4);
  data.micro_batch(0, in.data(), tgt.data());
  EXPECT_EQ(in, (std::vector<int32_t>{'h', 'e', 'l', 'l'}));
  EXPECT_EQ(tgt, (std::vector<int32_t>{'e', 'l', 'l', 'o'}));
}

TEST(SyntheticData, SameMicroBatchNumberGivesSameTokens) {
  DataLoader a(DataConfig{}, 64, 2, 16, 5), b(DataConfig{}, 64, 2, 16, 5);
  std::vector<int32_t> i1(32), t1(32), i2(32), t2(32);
  a.micro_batch(14, i1.data(), t1.data());
  b.micro_batch(14, i2.data(), t2.data());
  EXPECT_EQ(i1, i2);
  EXPECT_EQ(t1, t2);
  a.micro_batch(16, i2.data(), t2.data());
  EXPECT_NE(i1, i2);
}

TEST(SyntheticData, ASampleIsTheSameWhateverMicroBatchItIsPartOf) {
  DataLoader two(DataConfig{}, 64, 2, 16, 5), one(DataConfig{}, 64, 1, 16, 5);
  std::vector<int32_t> pair_in(32), pair_tgt(32), in(16), tgt(16);
  two.micro_batch(6, pair_in.data(), pair_tgt.data());  // samples 6 and 7
  one.micro_batch(7, in.data(), tgt.data());
  EXPECT_EQ(std::vector<int32_t>(pair_in.begin() + 16, pair_in.end()), in);
}

TEST(SyntheticData, TargetsAreInputsShiftedByOne) {
  DataLoader a(DataConfig{}, 64, 2, 16, 5);
  std::vector<int32_t> in(32), tgt(32);
  a.micro_batch(3, in.data(), tgt.data());
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t + 1 < 16; ++t) EXPECT_EQ(tgt[b * 16 + t], in[b * 16 + t + 1]);
}

TEST(SyntheticData, MostTransitionsFollowTheHiddenPermutation) {
  // Learnable: the same token is followed by the same successor about 90% of the time.
  DataLoader a(DataConfig{}, 16, 8, 64, 5);
  std::vector<int32_t> in(512), tgt(512);
  std::map<std::pair<int, int>, int> pairs;
  for (int k = 0; k < 4; ++k) {
    a.micro_batch(k * 8, in.data(), tgt.data());
    for (int i = 0; i < 512; ++i) pairs[{in[i], tgt[i]}]++;
  }
  std::map<int, int> best;
  for (auto& [p, n] : pairs) best[p.first] = std::max(best[p.first], n);
  int top = 0;
  for (auto& [tok, n] : best) top += n;
  EXPECT_GT(top, 0.85 * 2048);
}

}  // namespace
