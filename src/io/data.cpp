// data.cpp — the three data sources behind DataLoader.
#include "io/data.hpp"

#include <glob.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <numeric>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "base/rng.hpp"

namespace zero3d {

namespace {
constexpr int32_t kShardMagic = 20240520;  // uint16 tokens (GPT-2's vocabulary)
constexpr int32_t kShardVersion = 1;
constexpr int32_t kShardMagic32 = 20240801;  // uint32 tokens (llm.c's Llama 3 shards)
constexpr int32_t kShardVersion32 = 7;
constexpr double kSyntheticNoise = 0.1;  // probability that the next token is random
// Data files are held in memory (4 bytes per token or text byte): a bound keeps a wrong path
// (a disk image) from exhausting it; the start-up memory check covers what is below.
constexpr int64_t kMaxDataFileBytes = int64_t(1) << 36;
constexpr int64_t kShardHeaderBytes = 256 * sizeof(int32_t);

std::vector<std::string> expand_glob(const std::string& pattern) {
  glob_t g{};
  std::vector<std::string> out;
  if (::glob(pattern.c_str(), 0, nullptr, &g) == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

std::vector<int32_t> read_token_shard(const std::string& path, const std::string& key) {
  const std::string name = echo(path, 200);
  const int64_t size = regular_file_size(path, "token shard (" + key + ")", kMaxDataFileBytes);
  if (size < kShardHeaderBytes)
    throw InputError(name + ": too short for an llm.c token shard header (1024 bytes)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(name + ": cannot open token shard");
  int32_t header[256];
  if (!in.read(reinterpret_cast<char*>(header), sizeof(header)))
    throw InputError(name + ": too short for an llm.c token shard header (1024 bytes)");
  if (header[0] != kShardMagic && header[0] != kShardMagic32)
    throw InputError(name + ": not an llm.c token shard (magic " + std::to_string(header[0]) + ", expected " +
                     std::to_string(kShardMagic) + " or " + std::to_string(kShardMagic32) + ")");
  const bool wide = header[0] == kShardMagic32;
  const int32_t version = wide ? kShardVersion32 : kShardVersion;
  if (header[1] != version)
    throw InputError(name + ": unsupported token shard version " + std::to_string(header[1]) + " (expected " +
                     std::to_string(version) + " with magic " + std::to_string(header[0]) + ")");
  const int64_t n = header[2];
  if (n < 0) throw InputError(name + ": header says " + std::to_string(n) + " tokens (a count cannot be negative)");
  // Checked against the file before allocating: a header may promise gigabytes. A longer file
  // (a shard with something appended) is rejected as llm.c rejects it: its tail would go unread.
  const int64_t width = wide ? 4 : 2;
  if (width * n != size - kShardHeaderBytes)
    throw InputError(name + ": header promises " + std::to_string(n) + " tokens (" + std::to_string(width * n) +
                     " bytes) but the file holds " + std::to_string(size - kShardHeaderBytes) + " bytes after it");
  if (wide) {
    std::vector<uint32_t> raw(static_cast<size_t>(n));
    if (!in.read(reinterpret_cast<char*>(raw.data()), n * 4))
      throw InputError(name + ": header promises " + std::to_string(n) + " tokens but the file is shorter");
    std::vector<int32_t> out(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      // Beyond int32 no vocabulary reaches; the caller's vocab_size check names the position.
      if (raw[i] > uint32_t(INT32_MAX))
        throw InputError(name + ": token " + std::to_string(raw[i]) + " at position " + std::to_string(i) +
                         " does not fit a token id");
      out[i] = static_cast<int32_t>(raw[i]);
    }
    return out;
  }
  std::vector<uint16_t> raw(static_cast<size_t>(n));
  if (!in.read(reinterpret_cast<char*>(raw.data()), n * 2))
    throw InputError(name + ": header promises " + std::to_string(n) + " tokens but the file is shorter");
  return std::vector<int32_t>(raw.begin(), raw.end());
}

DataLoader::DataLoader(const DataSourceConfig& cfg, int64_t vocab_size, int64_t B, int64_t T, uint64_t seed)
    : cfg_(cfg), V_(vocab_size), B_(B), T_(T), seed_(seed) {
  // Validation samples: the same successor permutation (the same task), a stream of their own.
  if (cfg.role == DataRole::Validation) stream_ = hash_name("data.validation");
  const std::string path_key = std::string(key()) + ".path";
  if (cfg.source == DataSource::Synthetic) {
    // A random permutation: token x is followed by successor[x] with probability 1 - noise.
    successor_.resize(static_cast<size_t>(V_));
    std::iota(successor_.begin(), successor_.end(), 0);
    Rng rng(seed, hash_name("data.synthetic.successor"));
    for (int64_t i = V_ - 1; i > 0; --i) std::swap(successor_[i], successor_[rng.below(static_cast<uint64_t>(i + 1))]);
    description_ = "synthetic: next token = fixed permutation of the current one, randomised with p=0.1";
    return;
  }
  std::vector<std::string> files;
  if (cfg.source == DataSource::Text) {
    files = {cfg.path};
  } else {
    files = expand_glob(cfg.path);
    if (files.empty()) throw InputError(path_key + ": no token shard matches \"" + echo(cfg.path) + "\"");
  }
  for (const std::string& f : files) {
    std::vector<int32_t> toks;
    if (cfg.source == DataSource::Text) {
      const std::string bytes = read_regular_file(f, "text file (" + path_key + ")", kMaxDataFileBytes);
      toks.reserve(bytes.size());
      for (unsigned char c : bytes) toks.push_back(c);
    } else {
      toks = read_token_shard(f, path_key);
    }
    add_tokens(echo(f, 200), toks, cfg.source != DataSource::Text);
  }
  description_ = std::string(cfg.source == DataSource::Text ? "byte-level text" : "llm.c token shards") + " (" +
                 std::to_string(files.size()) + " file" + (files.size() > 1 ? "s" : "") + ", " +
                 std::to_string(tokens_.size()) + " tokens, " +
                 (cfg.shuffle ? "shuffled samples" : std::to_string(sample_starts_.size()) + " sequential samples") +
                 ")";
}

DataLoader::DataLoader(const std::vector<int32_t>& tokens, const std::string& name, int64_t vocab_size, int64_t B,
                       int64_t T)
    : V_(vocab_size), B_(B), T_(T), seed_(0) {
  cfg_.source = DataSource::Tokens;
  cfg_.role = DataRole::Validation;
  add_tokens(name, tokens, true);
  description_ = name + " (" + std::to_string(tokens_.size()) + " tokens, " + std::to_string(sample_starts_.size()) +
                 " sequential samples)";
}

void DataLoader::add_tokens(const std::string& name, const std::vector<int32_t>& toks, bool check_vocab) {
  if (check_vocab)
    for (size_t i = 0; i < toks.size(); ++i)
      if (toks[i] >= V_)
        throw InputError(name + ": token " + std::to_string(toks[i]) + " at position " + std::to_string(i) +
                         " is outside model.vocab_size " + std::to_string(V_));
  const int64_t n = static_cast<int64_t>(toks.size());
  if (n < T_ + 1)
    throw InputError(name + ": has " + std::to_string(n) + " tokens; one sample needs n_positions+1 = " +
                     std::to_string(T_ + 1));
  // Sample k of a file: its tokens [k·T, k·T + T + 1), as long as they fit. Inside a file this
  // is llm.c's order (a micro-batch of B samples is its window of B·T+1 tokens); at a file's
  // end every whole sample is read (llm.c drops the tail shorter than B·T+1), so which tokens a
  // sample number reads never depends on the micro-batch size, hence on the data-parallel size.
  const int64_t base = static_cast<int64_t>(tokens_.size());
  for (int64_t pos = 0; pos + T_ + 1 <= n; pos += T_) sample_starts_.push_back(base + pos);
  tokens_.insert(tokens_.end(), toks.begin(), toks.end());
}

std::string DataLoader::describe() const { return description_; }

int64_t DataLoader::samples_per_epoch() const {
  if (cfg_.source == DataSource::Synthetic || cfg_.shuffle) return 0;
  return static_cast<int64_t>(sample_starts_.size());
}

void DataLoader::synthetic_sample(int64_t s, int32_t* inputs, int32_t* targets) const {
  Rng rng(seed_, static_cast<uint64_t>(s) ^ 0xD5A7A5EEDull ^ stream_);
  int32_t x = static_cast<int32_t>(rng.below(static_cast<uint64_t>(V_)));
  for (int64_t t = 0; t <= T_; ++t) {
    if (t < T_) inputs[t] = x;
    if (t > 0) targets[t - 1] = x;
    x = rng.uniform() < kSyntheticNoise ? static_cast<int32_t>(rng.below(static_cast<uint64_t>(V_))) : successor_[x];
  }
}

void DataLoader::micro_batch(int64_t first_sample, int32_t* inputs, int32_t* targets) const {
  const int64_t n = static_cast<int64_t>(tokens_.size());
  const int64_t samples_per_epoch = static_cast<int64_t>(sample_starts_.size());
  for (int64_t b = 0; b < B_; ++b) {
    const int64_t s = first_sample + b;
    int32_t* in = inputs + b * T_;
    int32_t* tgt = targets + b * T_;
    if (cfg_.source == DataSource::Synthetic) {
      synthetic_sample(s, in, tgt);
      continue;
    }
    int64_t start;
    if (cfg_.shuffle) {  // a seeded random offset per sample
      Rng rng(seed_, static_cast<uint64_t>(s) ^ 0x5EFF1Eull ^ stream_);
      start = static_cast<int64_t>(rng.below(static_cast<uint64_t>(n - T_)));
    } else {  // the next whole sample, wrapping after the last one
      start = sample_starts_[static_cast<size_t>(s % samples_per_epoch)];
    }
    std::copy_n(tokens_.begin() + start, T_, in);
    std::copy_n(tokens_.begin() + start + 1, T_, tgt);
  }
}

}  // namespace zero3d
