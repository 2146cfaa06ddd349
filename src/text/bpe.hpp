// text/bpe.hpp — byte-level BPE (GPT-2's scheme): bytes are mapped to printable characters,
// the text is split by the pre-tokenizer's pattern, and each piece's bytes are merged pairwise,
// lowest merge rank first (leftmost first among equals), as Hugging Face's BPE model does.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "text/pretokenize.hpp"
#include "text/tokenizer.hpp"

namespace zero3d::text {

// GPT-2's bytes_to_unicode(): the printable character each byte is written as in vocabularies.
const std::vector<std::string>& byte_to_unicode();
// The inverse: a vocabulary string back to bytes (a character outside the map is kept as UTF-8).
std::string unicode_to_bytes(std::string_view mapped);

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool lstrip = false, rstrip = false, single_word = false;
};

struct BpeOptions {
  SplitPattern pattern = SplitPattern::Gpt2;
  bool add_prefix_space = false;  // ByteLevel's option: a space before each segment that lacks one
  bool ignore_merges = false;     // a piece that is a whole vocabulary entry is that token (Llama 3)
  bool nfc = false;               // tokenizer.json's NFC normalizer (Qwen2)
  std::string source;             // the file(s), for messages and describe()
};

class ByteLevelBpe : public Tokenizer {
 public:
  // vocab: (token as written in the file, id); merges: pairs of tokens as written, rank order.
  // InputError (naming opts.source and `where`) for a merge whose parts are not in the vocabulary.
  ByteLevelBpe(const std::vector<std::pair<std::string, int32_t>>& vocab,
               const std::vector<std::pair<std::string, std::string>>& merges, std::vector<AddedToken> added,
               int32_t eos, int32_t bos, BpeOptions opts, const std::string& where);

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(id_bytes_.size()); }
  int32_t eos_id() const override { return eos_; }
  int32_t bos_id() const override { return bos_; }
  std::string describe() const override;

  // The id of a token given as written in the vocabulary file, or -1.
  int32_t token_id(const std::string& written) const;

 private:
  void encode_segment(std::string_view seg, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void merge(std::vector<int32_t>& sym) const;
  void merge_long(std::vector<int32_t>& sym) const;
  // The leftmost-longest added token at or after `from`: its start, end and index, or false.
  bool find_added(std::string_view text, size_t from, size_t& start, size_t& end, size_t& which) const;

  std::unordered_map<std::string, int32_t> vocab_;  // token bytes -> id
  std::vector<std::string> id_bytes_;               // id -> bytes (added tokens: their content)
  std::vector<uint8_t> id_known_;                   // 0 for an id no token has (a hole)
  int32_t byte_id_[256];
  // (left id, right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  std::vector<AddedToken> added_;
  std::vector<std::vector<uint32_t>> added_by_first_byte_;  // indices into added_, longest first
  int32_t eos_, bos_;
  BpeOptions opts_;
  size_t n_merges_ = 0;

  // piece -> ids; the keys view strings held in cache_keys_ (a lookup allocates nothing).
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string_view, std::vector<int32_t>> cache_;
  mutable std::deque<std::string> cache_keys_;
};

}  // namespace zero3d::text
