// tokenizer.cpp — open_tokenizer (which file a path names) and StreamingDecoder.
#include "text/tokenizer.hpp"

#include <sys/stat.h>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "text/loaders.hpp"
#include "text/unicode.hpp"

namespace zero3d::text {

namespace {

bool exists(const std::string& p, bool want_dir) {
  struct stat st{};
  return ::stat(p.c_str(), &st) == 0 && (want_dir ? S_ISDIR(st.st_mode) : S_ISREG(st.st_mode));
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string base_name(const std::string& p) {
  const size_t slash = p.find_last_of('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

}  // namespace

Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> open_tokenizer(const std::string& path) {
  const std::string name = echo(path, 200);
  if (path.empty()) throw InputError("tokenizer: no path given");
  if (exists(path, true)) {
    const std::string dir = ends_with(path, "/") ? path : path + "/";
    if (exists(dir + "tokenizer.json", false)) return load_tokenizer_json(dir + "tokenizer.json");
    if (exists(dir + "tokenizer.model", false)) return load_sentencepiece(dir + "tokenizer.model");
    if (exists(dir + "encoder.json", false) && exists(dir + "vocab.bpe", false))
      return load_gpt2_pair(dir + "encoder.json", dir + "vocab.bpe");
    throw InputError(name + ": a directory without a tokenizer (looked for tokenizer.json, tokenizer.model, and "
                            "encoder.json with vocab.bpe)");
  }
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) throw InputError(name + ": no such tokenizer file or directory");
  if (base_name(path) == "encoder.json") {
    const size_t slash = path.find_last_of('/');
    const std::string bpe = (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) + "vocab.bpe";
    if (!exists(bpe, false)) throw InputError(name + ": GPT-2's encoder.json needs vocab.bpe beside it (" + echo(bpe) + ")");
    return load_gpt2_pair(path, bpe);
  }
  if (ends_with(path, ".json")) return load_tokenizer_json(path);
  if (ends_with(path, ".model")) return load_sentencepiece(path);
  throw InputError(name + ": not a tokenizer file zero3d knows (a Hugging Face tokenizer.json, a SentencePiece .model, "
                          "GPT-2's encoder.json, or a directory holding one)");
}

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer) : tok_(tokenizer) {}

// The ids from prefix_ to read_ were emitted; decoding them again with the new ids gives the new
// ids' text in context (a SentencePiece word keeps its leading space, which a decode of the new
// ids alone would drop). Text is emitted when it ends on a whole character: not inside a UTF-8
// sequence, not on U+FFFD (SentencePiece's stand-in for a byte piece that waits for the rest).
std::string StreamingDecoder::push(int32_t id) {
  ids_.push_back(id);
  const std::vector<int32_t> prefix_ids(ids_.begin() + prefix_, ids_.begin() + read_);
  const std::vector<int32_t> all_ids(ids_.begin() + prefix_, ids_.end());
  const std::string before = tok_.decode(prefix_ids);
  const std::string now = tok_.decode(all_ids);
  if (now.size() <= before.size() || incomplete_utf8_tail(now) > 0 || ends_with(now, "\xEF\xBF\xBD")) return "";
  std::string out = sanitize_utf8(std::string_view(now).substr(before.size()));
  // The context window moves on: the ids before the new prefix are not needed again.
  prefix_ = read_;
  read_ = ids_.size();
  ids_.erase(ids_.begin(), ids_.begin() + prefix_);
  read_ -= prefix_;
  prefix_ = 0;
  return out;
}

std::string StreamingDecoder::finish() {
  const std::vector<int32_t> prefix_ids(ids_.begin() + prefix_, ids_.begin() + read_);
  const std::vector<int32_t> all_ids(ids_.begin() + prefix_, ids_.end());
  const std::string before = tok_.decode(prefix_ids);
  const std::string now = tok_.decode(all_ids);
  ids_.clear();
  prefix_ = read_ = 0;
  if (now.size() <= before.size()) return "";
  return sanitize_utf8(std::string_view(now).substr(before.size()));
}

}  // namespace zero3d::text
