// text/pretokenize.hpp — the byte-level BPE pre-tokenizers' regex splits, as hand-written
// scanners (std::regex is slow and has no \p classes). Three patterns are known, verbatim as
// tokenizer.json files hold them:
//   GPT-2:  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   Llama 3 (and cl100k): (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//           ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//   Qwen2:  the Llama 3 pattern with \p{N} (one digit per piece) for \p{N}{1,3}
// A scanner tries the alternatives in order at each position and takes the first that
// matches, with the match length a backtracking regex engine would give.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace zero3d::text {

enum class SplitPattern { Gpt2, Llama3, Qwen2 };

// The pattern a regex string names, or nothing when it is none of the known ones.
std::optional<SplitPattern> known_split_pattern(const std::string& regex);
const char* split_pattern_name(SplitPattern p);
// The regex text of a pattern (as tokenizer.json writes it).
const std::string& split_pattern_regex(SplitPattern p);

// Calls piece(text.substr(begin, len)) for each piece, in order; the pieces cover the text.
template <class F>
void split_pieces(std::string_view text, SplitPattern p, F&& piece);

// The length in bytes of the piece that starts at `pos`.
size_t next_piece(std::string_view text, size_t pos, SplitPattern p);

template <class F>
void split_pieces(std::string_view text, SplitPattern p, F&& piece) {
  for (size_t pos = 0; pos < text.size();) {
    const size_t len = next_piece(text, pos, p);
    piece(text.substr(pos, len));
    pos += len;
  }
}

}  // namespace zero3d::text
