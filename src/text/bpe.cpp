// bpe.cpp — ByteLevelBpe: added-token matching, the pre-tokenizer split, merges by rank, a cache.
#include "text/bpe.hpp"

#include <algorithm>
#include <climits>
#include <queue>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "text/unicode.hpp"

namespace zero3d::text {

namespace {

// The pieces a document repeats ("Ġthe", "Ġof") are merged once: a cache of this many pieces,
// emptied when full (bounded memory on text with few repeats, such as base64).
constexpr size_t kCacheEntries = 1 << 18;
// Pieces this long merge through a heap (O(n log n)); shorter ones rescan their pairs (O(n²),
// faster for the few bytes of a word).
constexpr size_t kLongPiece = 128;

uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

// The reverse of byte_to_unicode for the code points it uses (all below 324).
const std::vector<int>& unicode_to_byte_table() {
  static const std::vector<int> table = [] {
    std::vector<int> t(324, -1);
    const auto& fwd = byte_to_unicode();
    for (int b = 0; b < 256; ++b) {
      size_t len;
      t[decode_utf8(fwd[b], 0, len)] = b;
    }
    return t;
  }();
  return table;
}

bool is_word_char(char32_t cp) { return cp == '_' || char_class(cp) != kOther; }

}  // namespace

const std::vector<std::string>& byte_to_unicode() {
  static const std::vector<std::string> table = [] {
    // GPT-2's encoder.py: printable Latin-1 bytes stand for themselves, the other 68 bytes are
    // written as U+0100 upwards, in byte order.
    std::vector<std::string> t(256);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      append_utf8(t[b], printable ? char32_t(b) : char32_t(256 + n++));
    }
    return t;
  }();
  return table;
}

std::string unicode_to_bytes(std::string_view mapped) {
  const auto& table = unicode_to_byte_table();
  std::string out;
  out.reserve(mapped.size());
  for (size_t i = 0; i < mapped.size();) {
    size_t len;
    const char32_t cp = decode_utf8(mapped, i, len);
    if (cp < table.size() && table[cp] >= 0 && len > 0 && !(len == 1 && cp >= 0x80)) out += static_cast<char>(table[cp]);
    else out.append(mapped.data() + i, len);
    i += len;
  }
  return out;
}

ByteLevelBpe::ByteLevelBpe(const std::vector<std::pair<std::string, int32_t>>& vocab,
                           const std::vector<std::pair<std::string, std::string>>& merges, std::vector<AddedToken> added,
                           int32_t eos, int32_t bos, BpeOptions opts, const std::string& where)
    : added_(std::move(added)), eos_(eos), bos_(bos), opts_(std::move(opts)) {
  const std::string src = echo(opts_.source, 200);
  int64_t n_ids = 0;
  for (const auto& [tok, id] : vocab) n_ids = std::max<int64_t>(n_ids, int64_t(id) + 1);
  for (const AddedToken& a : added_) n_ids = std::max<int64_t>(n_ids, int64_t(a.id) + 1);
  id_bytes_.resize(static_cast<size_t>(n_ids));
  id_known_.assign(static_cast<size_t>(n_ids), 0);
  std::unordered_map<std::string, int32_t> written;  // the file's spelling -> id, for the merges
  written.reserve(vocab.size() * 2);
  for (const auto& [tok, id] : vocab) {
    id_bytes_[id] = unicode_to_bytes(tok);
    id_known_[id] = 1;
    written.emplace(tok, id);
  }
  for (const auto& [tok, id] : vocab) vocab_.emplace(id_bytes_[id], id);
  for (int b = 0; b < 256; ++b) {
    const auto it = written.find(byte_to_unicode()[b]);
    if (it == written.end())
      throw InputError(src + ": " + where + " lacks the byte-level token of byte " + std::to_string(b) + " (\"" +
                       byte_to_unicode()[b] + "\"), which byte-level BPE needs for every byte");
    byte_id_[b] = it->second;
  }
  merges_.reserve(merges.size() * 2);
  for (size_t i = 0; i < merges.size(); ++i) {
    const auto& [a, b] = merges[i];
    const auto ia = written.find(a), ib = written.find(b), im = written.find(a + b);
    const char* missing = ia == written.end() ? "its first part" : ib == written.end() ? "its second part"
                          : im == written.end() ? "the merged token" : nullptr;
    if (missing)
      throw InputError(src + ": merges[" + std::to_string(i) + "] (" + echo(a + " " + b) + "): " + missing +
                       " is not in the vocabulary");
    // A pair listed twice takes its later rank, as Hugging Face's and GPT-2's loaders do.
    merges_[pair_key(ia->second, ib->second)] = {static_cast<int32_t>(i), im->second};
  }
  n_merges_ = merges.size();
  added_by_first_byte_.assign(256, {});
  for (size_t k = 0; k < added_.size(); ++k) {
    const AddedToken& a = added_[k];
    id_bytes_[a.id] = a.content;
    id_known_[a.id] = 1;
    if (!a.content.empty()) added_by_first_byte_[static_cast<unsigned char>(a.content[0])].push_back(uint32_t(k));
  }
  for (auto& list : added_by_first_byte_)  // longest first: leftmost-longest matching
    std::stable_sort(list.begin(), list.end(),
                     [&](uint32_t x, uint32_t y) { return added_[x].content.size() > added_[y].content.size(); });
  if (eos_ < 0 || eos_ >= n_ids || !id_known_[eos_])
    throw InputError(src + ": the end-of-text token id " + std::to_string(eos_) + " is not in the vocabulary");
  if (bos_ >= n_ids || (bos_ >= 0 && !id_known_[bos_]))
    throw InputError(src + ": the beginning-of-sequence token id " + std::to_string(bos_) + " is not in the vocabulary");
}

int32_t ByteLevelBpe::token_id(const std::string& written) const {
  for (const AddedToken& a : added_)
    if (a.content == written) return a.id;
  const auto it = vocab_.find(unicode_to_bytes(written));
  return it == vocab_.end() ? -1 : it->second;
}

std::string ByteLevelBpe::describe() const {
  return std::string("byte-level BPE (") + split_pattern_name(opts_.pattern) + " split" + (opts_.nfc ? ", NFC" : "") +
         (opts_.ignore_merges ? ", ignore_merges" : "") + (opts_.add_prefix_space ? ", add_prefix_space" : "") +
         "), " + std::to_string(vocab_size()) + " tokens (" + std::to_string(n_merges_) + " merges, " +
         std::to_string(added_.size()) + " added), from " + echo(opts_.source, 200);
}

bool ByteLevelBpe::find_added(std::string_view text, size_t from, size_t& start, size_t& end, size_t& which) const {
  if (added_.empty()) return false;
  for (size_t pos = from; pos < text.size(); ++pos) {
    const auto& cands = added_by_first_byte_[static_cast<unsigned char>(text[pos])];
    for (uint32_t k : cands) {
      const AddedToken& a = added_[k];
      if (text.compare(pos, a.content.size(), a.content) != 0) continue;
      size_t s = pos, e = pos + a.content.size();
      if (a.single_word) {  // not inside a word on either side
        size_t len;
        bool inside = false;
        if (s > 0) {
          size_t b = s - 1;
          while (b > 0 && (static_cast<unsigned char>(text[b]) & 0xC0) == 0x80) --b;
          inside = is_word_char(decode_utf8(text, b, len));
        }
        if (e < text.size() && is_word_char(decode_utf8(text, e, len))) inside = true;
        if (inside) continue;
      }
      if (a.lstrip)
        while (s > from && (text[s - 1] == ' ' || (text[s - 1] >= 0x09 && text[s - 1] <= 0x0D))) --s;
      if (a.rstrip)
        while (e < text.size() && (text[e] == ' ' || (text[e] >= 0x09 && text[e] <= 0x0D))) ++e;
      start = s, end = e, which = k;
      return true;
    }
  }
  return false;
}

std::vector<int32_t> ByteLevelBpe::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  size_t pos = 0, s, e, k;
  while (find_added(text, pos, s, e, k)) {
    encode_segment(text.substr(pos, s - pos), out);
    out.push_back(added_[k].id);
    pos = e;
  }
  encode_segment(text.substr(pos), out);
  return out;
}

void ByteLevelBpe::encode_segment(std::string_view seg, std::vector<int32_t>& out) const {
  if (seg.empty()) return;
  std::string owned;
  if (opts_.nfc) {
    owned = nfc(seg);
    seg = owned;
  }
  if (opts_.add_prefix_space && seg[0] != ' ') {
    owned = " " + std::string(seg);
    seg = owned;
  }
  split_pieces(seg, opts_.pattern, [&](std::string_view piece) { encode_piece(piece, out); });
}

void ByteLevelBpe::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1) {
    out.push_back(byte_id_[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (opts_.ignore_merges) {
    const auto it = vocab_.find(std::string(piece));
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    const auto it = cache_.find(piece);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> sym(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) sym[i] = byte_id_[static_cast<unsigned char>(piece[i])];
  if (sym.size() >= kLongPiece) merge_long(sym);
  else merge(sym);
  out.insert(out.end(), sym.begin(), sym.end());
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (cache_.size() >= kCacheEntries) {
    cache_.clear();
    cache_keys_.clear();
  }
  cache_keys_.emplace_back(piece);
  cache_.emplace(cache_keys_.back(), std::move(sym));
}

void ByteLevelBpe::merge(std::vector<int32_t>& sym) const {
  // rank[i]/merged[i]: the merge of the pair (sym[i], sym[i+1]), INT_MAX when there is none.
  std::vector<int32_t> rank(sym.size()), merged(sym.size());
  auto look = [&](size_t i) {
    if (i + 1 >= sym.size()) {
      rank[i] = INT_MAX;
      return;
    }
    const auto it = merges_.find(pair_key(sym[i], sym[i + 1]));
    rank[i] = it == merges_.end() ? INT_MAX : it->second.first;
    merged[i] = it == merges_.end() ? -1 : it->second.second;
  };
  for (size_t i = 0; i < sym.size(); ++i) look(i);
  while (sym.size() > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < sym.size(); ++i)
      if (rank[i] < rank[best]) best = i;  // strict: the leftmost of equal ranks
    if (rank[best] == INT_MAX) break;
    sym[best] = merged[best];
    sym.erase(sym.begin() + best + 1);
    rank.erase(rank.begin() + best + 1);
    merged.erase(merged.begin() + best + 1);
    look(best);
    if (best > 0) look(best - 1);
  }
}

void ByteLevelBpe::merge_long(std::vector<int32_t>& sym) const {
  // Symbols as a linked list; candidate merges in a heap by (rank, position). An entry is stale
  // when either symbol changed since it was pushed; it is then skipped.
  const int32_t n = static_cast<int32_t>(sym.size());
  std::vector<int32_t> prev(n), next(n);
  std::vector<uint8_t> alive(n, 1);
  for (int32_t i = 0; i < n; ++i) prev[i] = i - 1, next[i] = i + 1 < n ? i + 1 : -1;
  struct Cand {
    int32_t rank, pos, left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int32_t i) {
    if (i < 0 || next[i] < 0) return;
    const auto it = merges_.find(pair_key(sym[i], sym[next[i]]));
    if (it != merges_.end()) heap.push({it->second.first, i, sym[i], sym[next[i]]});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const int32_t j = next[c.pos];
    if (!alive[c.pos] || j < 0 || sym[c.pos] != c.left || sym[j] != c.right) continue;
    sym[c.pos] = merges_.find(pair_key(c.left, c.right))->second.second;
    alive[j] = 0;
    next[c.pos] = next[j];
    if (next[j] >= 0) prev[next[j]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  std::vector<int32_t> out;
  for (int32_t i = 0; i >= 0; i = next[i]) out.push_back(sym[i]);
  sym.swap(out);
}

std::string ByteLevelBpe::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= static_cast<int32_t>(id_bytes_.size()) || !id_known_[id])
      throw InputError("token id " + std::to_string(id) + " is outside the vocabulary of " + echo(opts_.source, 200) +
                       " (" + std::to_string(id_bytes_.size()) + " ids" +
                       (id >= 0 && id < static_cast<int32_t>(id_bytes_.size()) ? ", this one unassigned" : "") + ")");
    out += id_bytes_[id];
  }
  return out;
}

}  // namespace zero3d::text
