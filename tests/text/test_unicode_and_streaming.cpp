// test_unicode_and_streaming.cpp — the pieces under the tokenizers: UTF-8 validation with the
// offending offset, NFC, the pre-tokenizer scanners on cases worked out from the regexes, and
// StreamingDecoder emitting whole characters only.
#include <gtest/gtest.h>

#include "base/errors.hpp"
#include "text/pretokenize.hpp"
#include "text/tokenizer.hpp"
#include "text/unicode.hpp"

using namespace zero3d;
using namespace zero3d::text;

namespace {

TEST(Utf8, FirstInvalidByteIsFound) {
  EXPECT_EQ(first_invalid_utf8("plain ascii text, long enough for the 8-byte steps"), std::string::npos);
  EXPECT_EQ(first_invalid_utf8("caf\xC3\xA9 \xE6\x97\xA5 \xF0\x9F\x98\x80"), std::string::npos);
  EXPECT_EQ(first_invalid_utf8("abc\xC0\x80"), 3u);              // overlong NUL
  EXPECT_EQ(first_invalid_utf8("abcdefghij\xE0\x80\x80"), 10u);  // overlong 3-byte form
  EXPECT_EQ(first_invalid_utf8("x\xED\xA0\x80"), 1u);            // a surrogate
  EXPECT_EQ(first_invalid_utf8("xy\xF4\x90\x80\x80"), 2u);       // past U+10FFFF
  EXPECT_EQ(first_invalid_utf8("xyz\xE6\x97"), 3u);              // cut short at the end
  EXPECT_EQ(first_invalid_utf8("\x80"), 0u);                     // a lone continuation byte
  EXPECT_EQ(first_invalid_utf8("12345678\xFF"), 8u);
}

TEST(Utf8, IncompleteTailAndSanitize) {
  EXPECT_EQ(incomplete_utf8_tail("ab\xE6\x97"), 2u);
  EXPECT_EQ(incomplete_utf8_tail("ab\xF0\x9F\x98"), 3u);
  EXPECT_EQ(incomplete_utf8_tail("ab\xC3"), 1u);
  EXPECT_EQ(incomplete_utf8_tail("ab\xE6\x97\xA5"), 0u);
  EXPECT_EQ(incomplete_utf8_tail("ab\xED\xA0"), 0u);  // a surrogate never completes: not held
  EXPECT_EQ(incomplete_utf8_tail("ab\x80"), 0u);
  EXPECT_EQ(sanitize_utf8("a\xE6\x97" "b\xC3\xA9"), "a\xEF\xBF\xBD\xEF\xBF\xBD" "b\xC3\xA9");
}

TEST(Nfc, ComposesReordersAndKeepsExclusions) {
  EXPECT_EQ(nfc("e\xCC\x81"), "\xC3\xA9");                                 // e + U+0301 -> é
  EXPECT_EQ(nfc("A\xCC\x8A"), "\xC3\x85");                                 // A + ring -> Å
  EXPECT_EQ(nfc("\xE2\x84\xAB"), "\xC3\x85");                              // U+212B ANGSTROM SIGN -> Å
  EXPECT_EQ(nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // jamo G+A+G -> 각
  EXPECT_EQ(nfc("q\xCC\x87\xCC\xA3"), "q\xCC\xA3\xCC\x87");                // dot above, dot below: reordered
  EXPECT_EQ(nfc("\xE0\xA5\x98"), "\xE0\xA4\x95\xE0\xA4\xBC");              // U+0958: a composition exclusion
  EXPECT_EQ(nfc("o\xCC\x83\xCC\x81"), "\xE1\xB9\x8D");                     // o + tilde + acute -> ṍ
  EXPECT_EQ(nfc("plain"), "plain");
}

std::vector<std::string> pieces(const std::string& text, SplitPattern p) {
  std::vector<std::string> out;
  split_pieces(text, p, [&](std::string_view s) { out.emplace_back(s); });
  return out;
}
using V = std::vector<std::string>;

TEST(PreTokenizer, Gpt2Pattern) {
  EXPECT_EQ(pieces("Hello  world", SplitPattern::Gpt2), (V{"Hello", " ", " world"}));
  EXPECT_EQ(pieces("it's 12345 ok!!", SplitPattern::Gpt2), (V{"it", "'s", " 12345", " ok", "!!"}));
  EXPECT_EQ(pieces("IT'S", SplitPattern::Gpt2), (V{"IT", "'", "S"}));  // case-sensitive contractions
  EXPECT_EQ(pieces("a \n\n b  ", SplitPattern::Gpt2), (V{"a", " \n\n", " b", "  "}));
  EXPECT_EQ(pieces("x\xE3\x80\x80\xE3\x80\x80y", SplitPattern::Gpt2),  // U+3000 runs back off by a character
            (V{"x", "\xE3\x80\x80", "\xE3\x80\x80", "y"}));
}

TEST(PreTokenizer, Llama3AndQwen2Patterns) {
  EXPECT_EQ(pieces("12345", SplitPattern::Llama3), (V{"123", "45"}));
  EXPECT_EQ(pieces("12345", SplitPattern::Qwen2), (V{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(pieces("IT'S", SplitPattern::Llama3), (V{"IT", "'S"}));  // (?i:...) contractions
  EXPECT_EQ(pieces("\n\n  x", SplitPattern::Llama3), (V{"\n\n", " ", " x"}));
  EXPECT_EQ(pieces("\tword", SplitPattern::Llama3), (V{"\tword"}));  // [^\r\n\p{L}\p{N}]?\p{L}+
  EXPECT_EQ(pieces("a ...\n\nb", SplitPattern::Llama3), (V{"a", " ...\n\n", "b"}));
  EXPECT_EQ(pieces("x  \n \ny", SplitPattern::Llama3), (V{"x", "  \n \n", "y"}));
}

TEST(PreTokenizer, KnownPatternsAreRecognisedVerbatimOnly) {
  for (SplitPattern p : {SplitPattern::Gpt2, SplitPattern::Llama3, SplitPattern::Qwen2})
    EXPECT_EQ(known_split_pattern(split_pattern_regex(p)), p);
  EXPECT_FALSE(known_split_pattern(split_pattern_regex(SplitPattern::Gpt2) + "|x"));
  EXPECT_FALSE(known_split_pattern("\\p{L}+"));
}

// A tokenizer whose ids are single bytes, to feed StreamingDecoder byte by byte.
class ByteTokenizer : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    return std::vector<int32_t>(reinterpret_cast<const unsigned char*>(text.data()),
                                reinterpret_cast<const unsigned char*>(text.data()) + text.size());
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    for (int32_t id : ids) s += static_cast<char>(id);
    return s;
  }
  int64_t vocab_size() const override { return 256; }
  int32_t eos_id() const override { return 0; }
  int32_t bos_id() const override { return -1; }
  std::string describe() const override { return "bytes"; }
};

TEST(StreamingDecoder, HoldsAnUnfinishedCharacterUntilItCompletes) {
  const ByteTokenizer bytes;
  StreamingDecoder d(bytes);
  EXPECT_EQ(d.push('a'), "a");
  EXPECT_EQ(d.push(0xE6), "");
  EXPECT_EQ(d.push(0x97), "");
  EXPECT_EQ(d.push(0xA5), "\xE6\x97\xA5");
  EXPECT_EQ(d.push(0xF0), "");
  EXPECT_EQ(d.push(0x9F), "");
  EXPECT_EQ(d.finish(), "\xEF\xBF\xBD\xEF\xBF\xBD");  // never completed: replaced
  // Bytes that cannot complete a character come out replaced, with what follows them.
  EXPECT_EQ(d.push(0xE6), "");
  EXPECT_EQ(d.push(0x97), "");
  EXPECT_EQ(d.push('A'), "\xEF\xBF\xBD\xEF\xBF\xBD" "A");
  EXPECT_EQ(d.finish(), "");
}

}  // namespace
