// test_stop_strings.cpp — streamed text with stop strings (text/stop_strings.hpp), on GPT-2's
// tokenizer and the token ids js-tiktoken gives for the tokenizer corpus
// (tests/golden/tokenizer_goldens.json): whatever is printed is always a beginning of the final
// text, every piece is whole UTF-8 characters, and the pieces add up to the decoded text cut
// before the first stop string.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/errors.hpp"
#include "text/stop_strings.hpp"
#include "text/tokenizer.hpp"
#include "text/unicode.hpp"

using namespace zero3d;
using namespace zero3d::text;
using json = nlohmann::json;

namespace {

const Tokenizer& gpt2() {
  static const std::unique_ptr<Tokenizer> tok = open_tokenizer(ZERO3D_GPT2_DIR);
  return *tok;
}

const json& corpus() {
  static const json g = [] {
    std::ifstream in(std::string(ZERO3D_GOLDEN_DIR) + "/tokenizer_goldens.json", std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return json::parse(ss.str());
  }();
  return g.at("cases");
}

struct Streamed {
  std::string text;
  bool stopped = false;
  size_t ids_read = 0;  // ids pushed up to and including the one that completed the stop string
  int held = 0;         // pushes that returned less than the text had grown by
};

// Streams `ids`, checking at every push that the text so far is whole characters and a
// beginning of `want` (the text that may ever be printed).
Streamed stream(const std::vector<int32_t>& ids, const std::vector<std::string>& stops, const std::string& want) {
  StopStringStream s(gpt2(), stops);
  Streamed r;
  std::vector<int32_t> so_far;
  for (int32_t id : ids) {
    const bool was_stopped = s.stopped();
    const std::string part = s.push(id);
    if (!was_stopped) ++r.ids_read;
    if (was_stopped) {
      EXPECT_EQ(part, "") << "text after the stop";
    }
    EXPECT_EQ(first_invalid_utf8(part), std::string::npos);
    r.text += part;
    EXPECT_EQ(want.compare(0, r.text.size(), r.text), 0) << "printed " << r.text << " is not a beginning of " << want;
    so_far.push_back(id);
    const std::string decoded = sanitize_utf8(gpt2().decode(so_far));
    if (!s.stopped() && r.text.size() < std::min(decoded.size(), want.size()) &&
        incomplete_utf8_tail(gpt2().decode(so_far)) == 0)
      ++r.held;
  }
  r.text += s.finish();
  r.stopped = s.stopped();
  return r;
}

// s without a broken character at either end: whole characters only.
std::string whole_characters(std::string s) {
  while (!s.empty() && (static_cast<unsigned char>(s[0]) & 0xC0) == 0x80) s.erase(0, 1);
  s.resize(s.size() - incomplete_utf8_tail(s));
  return s;
}

// The decoded text cut before the first occurrence of any stop string.
std::string cut(const std::string& text, const std::vector<std::string>& stops) {
  size_t first = std::string::npos;
  for (const std::string& s : stops) first = std::min(first, text.find(s));
  return text.substr(0, first);
}

TEST(StopStrings, TheStreamIsTheDecodedTextCutBeforeTheFirstStopString) {
  int stopped_mid_text = 0, held_back = 0;
  for (const json& c : corpus()) {
    const std::vector<int32_t> ids = c.at("gpt2").get<std::vector<int32_t>>();
    const std::string text = sanitize_utf8(gpt2().decode(ids));
    if (text.size() < 12) continue;
    SCOPED_TRACE(text);
    // A stop string across the middle token boundary: the bytes of two tokens' texts around it.
    const size_t mid = ids.size() / 2;
    const size_t boundary = gpt2().decode(std::vector<int32_t>(ids.begin(), ids.begin() + mid)).size();
    const std::string across = whole_characters(text.substr(boundary >= 2 ? boundary - 2 : 0, 4));
    // A stop string that begins like the text's middle but never occurs: held back, then released.
    const std::string middle = whole_characters(text.substr(text.size() / 2, 3));
    const std::string near_miss = middle.empty() ? "" : middle + "\x01\x02";
    for (const std::vector<std::string>& stops :
         {std::vector<std::string>{across}, {near_miss}, {near_miss, across}, {"\xE2\x9D\xA4"}, {"s", "e"}}) {
      if (std::find(stops.begin(), stops.end(), "") != stops.end()) continue;
      const std::string want = cut(text, stops);
      const Streamed r = stream(ids, stops, want);
      EXPECT_EQ(r.text, want) << "stop " << json(stops).dump();
      EXPECT_EQ(r.stopped, want.size() < text.size());
      if (r.stopped && r.ids_read < ids.size()) {
        // It stopped at the token that completed the stop string, not later.
        const std::string before =
            sanitize_utf8(gpt2().decode(std::vector<int32_t>(ids.begin(), ids.begin() + r.ids_read - 1)));
        EXPECT_EQ(cut(before, stops), before) << "a stop string was complete a token earlier";
        ++stopped_mid_text;
      }
      held_back += r.held;
    }
  }
  EXPECT_GT(stopped_mid_text, 20);  // the cases do stop inside the text
  EXPECT_GT(held_back, 20);         // and text that might start a stop string does wait
}

// "❤" (3 bytes) inside a multi-token emoji sequence: found once its character is whole.
TEST(StopStrings, AStopStringSplitOverTokensInsideACharacterIsFound) {
  const std::string text = "Emoji: \xF0\x9F\x98\x80 love \xE2\x9D\xA4\xEF\xB8\x8F end";
  const std::vector<int32_t> ids = gpt2().encode(text);
  const Streamed r = stream(ids, {"\xE2\x9D\xA4"}, "Emoji: \xF0\x9F\x98\x80 love ");
  EXPECT_EQ(r.text, "Emoji: \xF0\x9F\x98\x80 love ");
  EXPECT_TRUE(r.stopped);
}

TEST(StopStrings, AnEmptyOrBrokenStopStringIsBadInput) {
  EXPECT_THROW(StopStringStream(gpt2(), {"x", ""}), InputError);
  EXPECT_THROW(StopStringStream(gpt2(), {"\xA9x"}), InputError);  // a character's tail: it could split one
}

TEST(StopStrings, TheHeldBackSuffixIsTheLongestThatBeginsAStopString) {
  EXPECT_EQ(stop_string_prefix_at_end("the end", {"ending", "d."}), 3u);  // "end" begins "ending"
  EXPECT_EQ(stop_string_prefix_at_end("the end", {"d."}), 1u);
  EXPECT_EQ(stop_string_prefix_at_end("the end", {"x"}), 0u);
  EXPECT_EQ(stop_string_prefix_at_end("ab", {"abc"}), 2u);
  EXPECT_EQ(stop_string_prefix_at_end("abc", {"abc"}), 0u);  // a whole stop string is found, not held
}

}  // namespace
