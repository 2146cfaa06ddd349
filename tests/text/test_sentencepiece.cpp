// test_sentencepiece.cpp — SentencePiece models through libsentencepiece: a BPE model trained
// here with Debian's spm_train (Llama 2's options: byte fallback, identity normalization, no
// whitespace folding) encodes as `spm_encode --output_format=id` does, round-trips, and streams.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "base/errors.hpp"
#include "text/tokenizer.hpp"
#include "text/unicode.hpp"

using namespace zero3d;
using namespace zero3d::text;

namespace {

std::string dir() {
  static const std::string d = [] {
    const std::string p = ::testing::TempDir() + "spm_" + std::to_string(::getpid());
    std::filesystem::create_directories(p);
    return p;
  }();
  return d;
}

// A small training text: sentences from word lists, some accents and CJK, numbers.
std::string training_text() {
  const char* subjects[] = {"The cat", "A dog", "My friend", "Le caf\xC3\xA9", "The model", "Our trainer", "\xE6\x97\xA5\xE6\x9C\xAC"};
  const char* verbs[] = {"eats", "sees", "trains", "writes", "reads", "tokenizes", "likes"};
  const char* objects[] = {"the fish", "a book", "many tokens", "2024 shards", "the data", "na\xC3\xAFve text", "42 files"};
  std::string s;
  for (int i = 0; i < 700; ++i)
    s += std::string(subjects[i % 7]) + " " + verbs[(i / 7) % 7] + " " + objects[(i / 49 + i) % 7] + ".\n";
  return s;
}

// Trains once per test process; returns the model path.
const std::string& model() {
  static const std::string path = [] {
    const std::string text = dir() + "/train.txt";
    std::ofstream(text) << training_text();
    const std::string cmd = std::string(ZERO3D_SPM_TRAIN) + " --input=" + text + " --model_prefix=" + dir() +
                            "/tiny --vocab_size=300 --model_type=bpe --byte_fallback=true "
                            "--normalization_rule_name=identity --remove_extra_whitespaces=false "
                            "--character_coverage=1.0 --split_digits=true --minloglevel=2 >" +
                            dir() + "/spm_train.log 2>&1";
    const int rc = std::system(cmd.c_str());
    EXPECT_EQ(rc, 0) << cmd;
    return dir() + "/tiny.model";
  }();
  return path;
}

const std::vector<std::string> kLines = {
    "The cat reads the fish.",
    "A dog tokenizes 2024 shards and 31337 more.",
    "  Leading spaces and trailing   ",
    "Unseen characters: \xF0\x9F\x98\x80 \xD0\x9F\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82 zebra quux",
    "Le caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E",
    "x",
};

TEST(SentencePiece, EncodesAsSpmEncodeDoes) {
  const std::string input = dir() + "/lines.txt", ids = dir() + "/ids.txt";
  {
    std::ofstream out(input);
    for (const std::string& l : kLines) out << l << "\n";
  }
  const std::string cmd = std::string(ZERO3D_SPM_ENCODE) + " --model=" + model() + " --output_format=id <" + input +
                          " >" + ids;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const std::unique_ptr<Tokenizer> tok = open_tokenizer(model());
  std::ifstream in(ids);
  std::string line;
  for (const std::string& text : kLines) {
    ASSERT_TRUE(std::getline(in, line));
    std::vector<int32_t> want;
    std::istringstream ss(line);
    for (int32_t id; ss >> id;) want.push_back(id);
    const std::vector<int32_t> got = tok->encode(text);
    EXPECT_EQ(got, want) << text;
    EXPECT_EQ(tok->decode(got), text);
  }
}

TEST(SentencePiece, VocabularyAndSpecialIds) {
  const std::unique_ptr<Tokenizer> tok = open_tokenizer(model());
  EXPECT_EQ(tok->vocab_size(), 300);
  EXPECT_EQ(tok->bos_id(), 1);  // spm_train's defaults: <unk> 0, <s> 1, </s> 2
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->document_delimiter(), 1);
  EXPECT_THROW(tok->decode({300}), InputError);
  // A directory holding tokenizer.model is the same tokenizer.
  const std::string d = dir() + "/as_dir";
  std::filesystem::create_directories(d);
  std::filesystem::copy_file(model(), d + "/tokenizer.model", std::filesystem::copy_options::overwrite_existing);
  EXPECT_EQ(open_tokenizer(d)->encode(kLines[1]), tok->encode(kLines[1]));
}

// Byte-fallback pieces (the emoji) decode alone to U+FFFD: the stream waits for whole characters,
// and the leading space of a word survives being decoded after its neighbours.
TEST(SentencePiece, StreamingGivesTheDecodedTextInWholeCharacters) {
  const std::unique_ptr<Tokenizer> tok = open_tokenizer(model());
  for (const std::string& text : kLines) {
    StreamingDecoder d(*tok);
    std::string streamed;
    for (int32_t id : tok->encode(text)) {
      const std::string part = d.push(id);
      EXPECT_EQ(first_invalid_utf8(part), std::string::npos) << text;
      EXPECT_EQ(part.find("\xEF\xBF\xBD"), std::string::npos) << text;
      streamed += part;
    }
    streamed += d.finish();
    EXPECT_EQ(streamed, text);
  }
}

TEST(SentencePiece, ACorruptModelIsBadInputNamingTheFile) {
  const std::string bad = dir() + "/broken.model";
  std::ofstream(bad) << "this is not a protobuf";
  try {
    open_tokenizer(bad);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not a SentencePiece model"), std::string::npos) << e.what();
  }
}

}  // namespace
