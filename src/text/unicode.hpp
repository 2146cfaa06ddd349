// text/unicode.hpp — UTF-8 and the little Unicode data a tokenizer needs: letter/number classes
// (the pre-tokenizer's \p{L}, \p{N}), White_Space (its \s), canonical composition (NFC).
//
// The category and NFC tables are generated from Python's unicodedata (make_unicode_tables.py,
// Unicode 14.0 with Debian bookworm's Python); a character assigned in a later Unicode version is
// neither letter nor number here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace zero3d::text {

struct CodeRange {
  char32_t first, last;
  uint8_t value;
};
struct Decomposition {
  char32_t cp;
  uint32_t offset, length;
};
struct Composition {
  char32_t first, second, composite;
};

namespace tables {
extern const char* const kUnicodeVersion;
extern const CodeRange kCategoryRanges[];
extern const size_t kCategoryRangeCount;
extern const CodeRange kCombiningRanges[];
extern const size_t kCombiningRangeCount;
extern const Decomposition kDecompositions[];
extern const size_t kDecompositionCount;
extern const char32_t kDecompositionData[];
extern const Composition kCompositions[];
extern const size_t kCompositionCount;
}  // namespace tables

enum CharClass : uint8_t { kOther = 0, kLetter = 1, kNumber = 2 };

// The general-category class of a code point (\p{L}, \p{N} or neither).
CharClass char_class(char32_t cp);
// Unicode's White_Space property (what \s means in Oniguruma and Rust's regex).
bool is_whitespace(char32_t cp);

// Decodes the code point at s[i] and sets `len` to its byte length. An invalid byte decodes as
// itself (0x80..0xFF, length 1): the scanner then treats it as "other", never a letter.
inline char32_t decode_utf8(std::string_view s, size_t i, size_t& len) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) {
    len = 1;
    return c;
  }
  auto cont = [&](size_t k) { return i + k < s.size() && (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80; };
  auto at = [&](size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[i + k]) & 0x3F); };
  if (c >= 0xC2 && c <= 0xDF && cont(1)) {
    len = 2;
    return (char32_t(c & 0x1F) << 6) | at(1);
  }
  if (c >= 0xE0 && c <= 0xEF && cont(1) && cont(2)) {
    const char32_t cp = (char32_t(c & 0x0F) << 12) | (at(1) << 6) | at(2);
    if (cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF)) {
      len = 3;
      return cp;
    }
  } else if (c >= 0xF0 && c <= 0xF4 && cont(1) && cont(2) && cont(3)) {
    const char32_t cp = (char32_t(c & 0x07) << 18) | (at(1) << 12) | (at(2) << 6) | at(3);
    if (cp >= 0x10000 && cp <= 0x10FFFF) {
      len = 4;
      return cp;
    }
  }
  len = 1;
  return c;
}

void append_utf8(std::string& out, char32_t cp);

// Byte offset of the first byte that does not start a valid UTF-8 sequence (overlong forms,
// surrogates and code points past U+10FFFF are invalid), or std::string::npos.
size_t first_invalid_utf8(std::string_view s);

// Length of a trailing incomplete (but so far valid) UTF-8 sequence at the end of s: 0 when s
// ends on a character boundary. A stream decoder holds these bytes back until the rest arrives.
size_t incomplete_utf8_tail(std::string_view s);

// s with every invalid byte replaced by U+FFFD (what a streaming decoder may emit).
std::string sanitize_utf8(std::string_view s);

// Canonical composition (Unicode Normalization Form C), for tokenizer.json's NFC normalizer.
std::string nfc(std::string_view s);

}  // namespace zero3d::text
