// test_cli_tokenize.cpp — `zero3d tokenize`: llm.c shards (header, magic by vocabulary, counts),
// every document prefixed with its delimiter, the validation split exactly round(F·N) leading
// tokens, read back by the training data loader and trained on; bad input exits 2 with one
// line naming the file (and byte offset, line or key).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "config/config.hpp"
#include "io/data.hpp"
#include "support/cli_helpers.hpp"
#include "text/tokenizer.hpp"

using namespace cli;

namespace {

namespace fs = std::filesystem;
const std::string kGpt2 = ZERO3D_GPT2_DIR;

struct Shard {
  int32_t magic, version, count;
  std::vector<int32_t> tokens;
  int64_t file_bytes;
};

Shard read_shard(const std::string& path) {
  Shard s{};
  std::ifstream in(path, std::ios::binary);
  int32_t header[256];
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  s.magic = header[0], s.version = header[1], s.count = header[2];
  for (int32_t i = 0; i < s.count; ++i) {
    if (s.magic == 20240801) {
      uint32_t t = 0;
      in.read(reinterpret_cast<char*>(&t), 4);
      s.tokens.push_back(static_cast<int32_t>(t));
    } else {
      uint16_t t = 0;
      in.read(reinterpret_cast<char*>(&t), 2);
      s.tokens.push_back(t);
    }
  }
  s.file_bytes = static_cast<int64_t>(fs::file_size(path));
  return s;
}

std::vector<std::string> shard_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The corpus: two plain documents and three JSON Lines records (a blank line between them).
struct Corpus {
  std::vector<std::string> docs, files;
};
Corpus write_corpus(const std::string& tag) {
  Corpus c;
  const std::string a = temp_path(tag + "_a.txt"), b = temp_path(tag + "_b.jsonl"), d = temp_path(tag + "_d.md");
  c.docs.push_back("The quick brown fox jumps over the lazy dog.\nIt's 2024: caf\xC3\xA9, \xE6\x97\xA5\xE6\x9C\xAC, \xF0\x9F\x98\x80!\n");
  std::ofstream(a) << c.docs.back();
  const std::vector<std::string> records = {"First record, with \"quotes\".", "Second:\tTabs\nand lines.", ""};
  std::ofstream jl(b);
  for (size_t i = 0; i < records.size(); ++i) {
    jl << json{{"id", i}, {"text", records[i]}}.dump() << "\n" << (i == 0 ? "\n" : "");
    c.docs.push_back(records[i]);
  }
  jl.close();
  c.docs.push_back(std::string(300, 'z') + " the end");
  std::ofstream(d) << c.docs.back();
  c.files = {a, b, d};
  return c;
}

std::vector<int32_t> expected_stream(const zero3d::text::Tokenizer& tok, const std::vector<std::string>& docs) {
  std::vector<int32_t> all;
  for (const std::string& d : docs) {
    all.push_back(tok.document_delimiter());
    const std::vector<int32_t> ids = tok.encode(d);
    all.insert(all.end(), ids.begin(), ids.end());
  }
  return all;
}

std::string files_arg(const std::vector<std::string>& files) {
  std::string s;
  for (const std::string& f : files) s += " " + f;
  return s;
}

TEST(Tokenize, WritesLlmcShardsWithTheValidationSplitFirst) {
  const Corpus c = write_corpus("gpt2");
  const std::string out = temp_path("shards_gpt2");
  const Result r = run("tokenize --tokenizer " + kGpt2 + " --out " + out + " --shard-size 40 --val-fraction 0.3" +
                       files_arg(c.files));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("tokens/s"), std::string::npos) << r.out;
  const auto tok = zero3d::text::open_tokenizer(kGpt2);
  const std::vector<int32_t> want = expected_stream(*tok, c.docs);
  const int64_t n = static_cast<int64_t>(want.size());
  const int64_t n_val = std::llround(0.3 * double(n));
  ASSERT_GT(n, 100);  // several shards of each split
  EXPECT_NE(r.out.find(std::to_string(n) + " tokens (" + std::to_string(n_val) + " validation, " +
                       std::to_string(n - n_val) + " training)"),
            std::string::npos)
      << r.out;
  // Shards named as llm.c names them: validation from 0, training numbered after it.
  const std::vector<std::string> files = shard_files(out);
  std::vector<int32_t> got;
  int64_t val_tokens = 0;
  const int64_t n_val_shards = (n_val + 39) / 40, n_train_shards = (n - n_val + 39) / 40;
  std::vector<std::string> names;  // in shard order
  for (int64_t i = 0; i < n_val_shards + n_train_shards; ++i) {
    char name[64];
    std::snprintf(name, sizeof(name), "shards_gpt2_%s_%06lld.bin", i < n_val_shards ? "val" : "train",
                  static_cast<long long>(i));
    names.push_back(name);
  }
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  ASSERT_EQ(files, sorted);
  for (int64_t i = 0; i < int64_t(names.size()); ++i) {
    const bool val = i < n_val_shards;
    const Shard s = read_shard(out + "/" + names[i]);
    EXPECT_EQ(s.magic, 20240520);
    EXPECT_EQ(s.version, 1);
    EXPECT_LE(s.count, 40);
    EXPECT_EQ(s.file_bytes, 1024 + 2 * int64_t(s.count));
    if (val) val_tokens += s.count;
    got.insert(got.end(), s.tokens.begin(), s.tokens.end());
  }
  EXPECT_EQ(val_tokens, n_val);
  EXPECT_EQ(got, want);  // each document prefixed with <|endoftext|>, in file and line order
  EXPECT_EQ(got[0], 50256);
  EXPECT_EQ(std::count(got.begin(), got.end(), 50256), int64_t(c.docs.size()));
  EXPECT_FALSE(fs::exists(out + "/.shards_gpt2.tokens.tmp"));

  // A second run with fewer shards removes the first run's shards beyond its own.
  const Result again = run("tokenize --tokenizer " + kGpt2 + " --out " + out + " --shard-size 1000 --val-fraction 0.3" +
                           files_arg(c.files));
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(shard_files(out), (std::vector<std::string>{"shards_gpt2_train_000001.bin", "shards_gpt2_val_000000.bin"}));
  EXPECT_EQ(read_shard(out + "/shards_gpt2_val_000000.bin").count, n_val);

  // The training data loader reads exactly the training tokens, in order.
  zero3d::DataConfig cfg;
  cfg.source = zero3d::DataSource::Tokens;
  cfg.path = out + "/shards_gpt2_train_*.bin";
  const int64_t T = 8;
  zero3d::DataLoader loader(cfg, 50257, 1, T, 1);
  std::vector<int32_t> in(T), tgt(T);
  EXPECT_EQ(loader.num_tokens(), n - n_val);
  ASSERT_EQ(loader.samples_per_epoch(), (n - n_val - 1) / T);
  for (int64_t k = 0; k < loader.samples_per_epoch(); ++k) {  // sample k: training tokens [kT, kT + T + 1)
    loader.micro_batch(k, in.data(), tgt.data());
    const auto first = want.begin() + n_val + k * T;
    EXPECT_EQ(in, std::vector<int32_t>(first, first + T)) << "sample " << k;
    EXPECT_EQ(tgt, std::vector<int32_t>(first + 1, first + T + 1)) << "sample " << k;
  }

  // And `zero3d train` trains on them, with the validation shards evaluated.
  json config = tiny_config();
  config["model"] = {{"vocab_size", 50257}, {"n_positions", 8}, {"n_layer", 1}, {"n_head", 2}, {"n_embd", 16}};
  config["data"] = {{"source", "tokens"}, {"path", cfg.path}, {"tokenizer", kGpt2},
                    {"validation", {{"path", out + "/shards_gpt2_val_*.bin"}}}};
  config["train_batch_size"] = 4;  // one global batch fits the validation shard's samples
  config["train_micro_batch_size_per_gpu"] = 4;
  config["training"]["steps"] = 2;
  config["training"]["eval_interval"] = 1;
  config["training"]["eval_steps"] = 1;
  const std::string run_dir = temp_path("train_on_shards");
  const Result t = run("train " + write_config("shards.json", config) + " --output " + run_dir, 1);
  EXPECT_EQ(t.code, 0) << t.out << t.err;
  EXPECT_EQ(read_metrics(run_dir).size(), 2u) << t.out;
}

// A vocabulary beyond 65,536 ids: uint32 tokens under magic 20240801, version 7 (llm.c's Llama 3
// shards), which the data loader reads too. No validation split: the first shard is number 1.
TEST(Tokenize, LargeVocabulariesWriteUint32Shards) {
  json tj = {{"model", {{"type", "BPE"}, {"vocab", json::parse(slurp(kGpt2 + "/encoder.json"))}}},
             {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
             {"added_tokens", {{{"id", 50256}, {"content", "<|endoftext|>"}, {"special", true}},
                               {{"id", 70000}, {"content", "<|big|>"}, {"special", true}}}}};
  json merges = json::array();
  std::istringstream bpe(slurp(kGpt2 + "/vocab.bpe"));
  std::string line;
  std::getline(bpe, line);
  while (std::getline(bpe, line))
    if (!line.empty()) merges.push_back(line);
  tj["model"]["merges"] = merges;
  const std::string tdir = temp_path("big_vocab");
  fs::create_directories(tdir);
  std::ofstream(tdir + "/tokenizer.json") << tj.dump();
  const std::string doc = temp_path("big.txt");
  std::ofstream(doc) << "a <|big|> b <|big|>";
  const std::string out = temp_path("shards_big");
  const Result r = run("tokenize --tokenizer " + tdir + "/tokenizer.json --out " + out + " --name big --val-fraction 0 " + doc);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(shard_files(out), std::vector<std::string>{"big_train_000001.bin"});
  const Shard s = read_shard(out + "/big_train_000001.bin");
  EXPECT_EQ(s.magic, 20240801);
  EXPECT_EQ(s.version, 7);
  EXPECT_EQ(s.file_bytes, 1024 + 4 * int64_t(s.count));
  EXPECT_EQ(s.tokens, (std::vector<int32_t>{50256, 64, 220, 70000, 275, 220, 70000}));
  EXPECT_EQ(zero3d::read_token_shard(out + "/big_train_000001.bin"), s.tokens);
}

TEST(Tokenize, TextThatIsNotUtf8IsNamedWithItsByteOffset) {
  const std::string good = temp_path("good.txt"), bad = temp_path("bad.txt"), out = temp_path("shards_bad");
  std::ofstream(good) << "fine";
  std::ofstream(bad) << "caf\xC3\xA9 ok, then \xE9t\xE9";
  Result r = run("tokenize --tokenizer " + kGpt2 + " --out " + out + " " + good + " " + bad);
  expect_one_line_rejection(r, bad + ": not valid UTF-8 at byte offset 15 (byte 0xE9)");
  EXPECT_TRUE(!fs::exists(out) || shard_files(out).empty());  // nothing written, no scratch left
  const std::string jl = temp_path("bad.jsonl");
  std::ofstream(jl) << "{\"text\": \"ok\"}\n{\"text\": \"\xFF\"}\n";
  r = run("tokenize --tokenizer " + kGpt2 + " --out " + out + " " + jl);
  expect_one_line_rejection(r, jl + ": not valid UTF-8 at byte offset 25 (line 2, byte 0xFF)");
}

TEST(Tokenize, BadRecordsTokenizersAndOptionsAreOneLineErrors) {
  const std::string out = temp_path("shards_err"), jl = temp_path("err.jsonl");
  std::ofstream(jl) << "{\"text\": \"ok\"}\n{\"body\": \"no text field\"}\n";
  expect_one_line_rejection(run("tokenize --tokenizer " + kGpt2 + " --out " + out + " " + jl),
                            jl + ": line 2 has no string field \"text\" (--field)");
  std::ofstream(jl) << "{\"text\": \"ok\"}\nnot json\n";
  expect_one_line_rejection(run("tokenize --tokenizer " + kGpt2 + " --out " + out + " " + jl), jl + ": line 2 is not JSON");
  // A tokenizer.json cut short, and one whose split pattern is none the scanner knows.
  const std::string cut = temp_path("cut/tokenizer.json");
  fs::create_directories(temp_path("cut"));
  std::ofstream(cut) << "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0";
  expect_one_line_rejection(run("tokenize --tokenizer " + cut + " --out " + out + " " + jl), cut + ": not valid JSON");
  const std::string odd = temp_path("odd.json");
  std::ofstream(odd) << json{{"model", {{"type", "BPE"}, {"vocab", json::object()}, {"merges", json::array()}}},
                             {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers",
                               {{{"type", "Split"}, {"pattern", {{"Regex", "\\w+|\\s+"}}}, {"behavior", "Isolated"}},
                                {{"type", "ByteLevel"}, {"use_regex", false}}}}}}}.dump();
  expect_one_line_rejection(run("tokenize --tokenizer " + odd + " --out " + out + " " + jl),
                            odd + ": `pre_tokenizer.pretokenizers[0].pattern.Regex` is \"\\\\w+|\\\\s+\", none of the patterns");
  const std::string uni = temp_path("unigram.json");
  std::ofstream(uni) << R"({"model": {"type": "Unigram", "vocab": []}})";
  expect_one_line_rejection(run("tokenize --tokenizer " + uni + " --out " + out + " " + jl), uni + ": `model.type` is \"Unigram\"");
  expect_one_line_rejection(run("tokenize --tokenizer " + temp_path("nope") + " --out " + out + " " + jl),
                            temp_path("nope") + ": no such tokenizer file or directory");
  expect_one_line_rejection(run("tokenize --tokenizer " + kGpt2 + " --out " + out + " " + temp_path("missing.txt")),
                            temp_path("missing.txt"));
  expect_one_line_rejection(run("tokenize --tokenizer " + kGpt2 + " --out " + out + " --val-fraction 1 " + jl),
                            "--val-fraction");
  EXPECT_TRUE(!fs::exists(out) || shard_files(out).empty());
}

TEST(Tokenize, DataTokenizerThatDoesNotExistIsNamedByValidate) {
  json config = tiny_config();
  config["data"] = {{"tokenizer", temp_path("no_such_tokenizer.json")}};
  expect_one_line_rejection(run("validate " + write_config("tok_missing.json", config)), "`data.tokenizer`");
}

}  // namespace
