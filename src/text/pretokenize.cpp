// pretokenize.cpp — the scanners behind split_pieces (pretokenize.hpp).
#include "text/pretokenize.hpp"

#include "text/unicode.hpp"

namespace zero3d::text {

namespace {

const std::string kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const std::string kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const std::string kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// One decoded character: its code point, byte length and class.
struct Ch {
  char32_t cp = 0;
  size_t len = 0;  // 0 at the end of the text
  uint8_t cls = kOther;
  bool space = false;
};

inline Ch at(std::string_view s, size_t i) {
  Ch c;
  if (i >= s.size()) return c;
  c.cp = decode_utf8(s, i, c.len);
  if (c.cp < 0x80) {
    // ASCII without the tables: letters, digits, the six whitespace characters.
    const char32_t x = c.cp;
    c.cls = ((x | 0x20) >= 'a' && (x | 0x20) <= 'z') ? kLetter : (x >= '0' && x <= '9') ? kNumber : kOther;
    c.space = x == ' ' || (x >= 0x09 && x <= 0x0D);
  } else if (c.len == 1) {
    c.cls = kOther;  // an invalid byte: "other", never a letter or a space
  } else {
    c.cls = char_class(c.cp);
    c.space = c.cls == kOther && is_whitespace(c.cp);
  }
  return c;
}

// The length of a run of characters from `pos` satisfying pred.
template <class P>
size_t run(std::string_view s, size_t pos, P pred) {
  size_t i = pos;
  for (Ch c = at(s, i); c.len && pred(c); c = at(s, i)) i += c.len;
  return i - pos;
}

// 's 't 're 've 'm 'll 'd at pos (case-sensitive for GPT-2, ASCII case-insensitive otherwise);
// returns the match length or 0.
size_t contraction(std::string_view s, size_t pos, bool fold) {
  if (s[pos] != '\'' || pos + 1 >= s.size()) return 0;
  auto low = [&](size_t i) -> char {
    if (i >= s.size()) return 0;
    const char c = s[i];
    return fold && c >= 'A' && c <= 'Z' ? static_cast<char>(c | 0x20) : c;
  };
  const char a = low(pos + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  const char b = low(pos + 2);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

bool is_letter(const Ch& c) { return c.cls == kLetter; }
bool is_number(const Ch& c) { return c.cls == kNumber; }
bool is_punct(const Ch& c) { return c.cls == kOther && !c.space; }  // [^\s\p{L}\p{N}]
bool is_space(const Ch& c) { return c.space; }
bool is_crlf(const Ch& c) { return c.cp == '\r' || c.cp == '\n'; }

// \s+(?!\S)|\s+ at a whitespace character: the run, less its last character when a
// non-space follows and the run is longer than one.
size_t whitespace_tail(std::string_view s, size_t pos) {
  const size_t n = run(s, pos, is_space);
  if (pos + n >= s.size()) return n;
  // Back off the run's last character (whatever its byte length) when there is more than one.
  size_t last = pos;
  for (size_t i = pos; i < pos + n; i += at(s, i).len) last = i;
  return last > pos ? last - pos : n;
}

size_t gpt2_piece(std::string_view s, size_t pos) {
  if (const size_t c = contraction(s, pos, false)) return c;
  const Ch c0 = at(s, pos);
  // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional leading U+0020.
  const bool sp = c0.cp == ' ';
  const Ch c1 = sp ? at(s, pos + 1) : c0;
  const size_t start = sp ? pos + 1 : pos;
  if (c1.len) {
    if (is_letter(c1)) return start - pos + run(s, start, is_letter);
    if (is_number(c1)) return start - pos + run(s, start, is_number);
    if (is_punct(c1)) return start - pos + run(s, start, is_punct);
  }
  if (is_space(c0)) return whitespace_tail(s, pos);
  // Only an invalid byte gets here (every character is letter, number, punctuation or space).
  return c0.len;
}

size_t llama3_piece(std::string_view s, size_t pos, size_t max_digits) {
  if (const size_t c = contraction(s, pos, true)) return c;
  const Ch c0 = at(s, pos);
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (is_letter(c0)) return run(s, pos, is_letter);
  if (!is_number(c0) && !is_crlf(c0)) {
    const Ch c1 = at(s, pos + c0.len);
    if (c1.len && is_letter(c1)) return c0.len + run(s, pos + c0.len, is_letter);
  }
  // \p{N}{1,3} (Qwen2: \p{N})
  if (is_number(c0)) {
    size_t i = pos;
    for (size_t k = 0; k < max_digits; ++k) {
      const Ch c = at(s, i);
      if (!c.len || !is_number(c)) break;
      i += c.len;
    }
    return i - pos;
  }
  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  {
    const bool sp = c0.cp == ' ';
    const size_t start = sp ? pos + 1 : pos;
    const Ch c1 = sp ? at(s, start) : c0;
    if (c1.len && is_punct(c1)) {
      const size_t p = start + run(s, start, is_punct);
      return p + run(s, p, is_crlf) - pos;
    }
  }
  if (is_space(c0)) {
    // `\s*[\r\n]+`: the whitespace run up to and including its last CR or LF.
    const size_t n = run(s, pos, is_space);
    size_t end_crlf = 0;
    for (size_t i = pos; i < pos + n;) {
      const Ch c = at(s, i);
      i += c.len;
      if (is_crlf(c)) end_crlf = i;
    }
    if (end_crlf) return end_crlf - pos;
    return whitespace_tail(s, pos);
  }
  return c0.len;
}

}  // namespace

std::optional<SplitPattern> known_split_pattern(const std::string& regex) {
  if (regex == kGpt2) return SplitPattern::Gpt2;
  if (regex == kLlama3) return SplitPattern::Llama3;
  if (regex == kQwen2) return SplitPattern::Qwen2;
  return std::nullopt;
}

const char* split_pattern_name(SplitPattern p) {
  switch (p) {
    case SplitPattern::Gpt2: return "GPT-2";
    case SplitPattern::Llama3: return "Llama 3";
    case SplitPattern::Qwen2: return "Qwen2";
  }
  return "?";
}

const std::string& split_pattern_regex(SplitPattern p) {
  return p == SplitPattern::Gpt2 ? kGpt2 : p == SplitPattern::Llama3 ? kLlama3 : kQwen2;
}

size_t next_piece(std::string_view text, size_t pos, SplitPattern p) {
  switch (p) {
    case SplitPattern::Gpt2: return gpt2_piece(text, pos);
    case SplitPattern::Llama3: return llama3_piece(text, pos, 3);
    case SplitPattern::Qwen2: return llama3_piece(text, pos, 1);
  }
  return 1;
}

}  // namespace zero3d::text
