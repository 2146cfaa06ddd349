// text/tokenizer.hpp — text to token ids and back, in C++: byte-level BPE (GPT-2's encoder.json +
// vocab.bpe, Hugging Face tokenizer.json: GPT-2, Llama 3, Qwen2) and SentencePiece models
// (Llama 2, Mistral) through libsentencepiece.
//
// encode() adds no special tokens of its own (Hugging Face's add_special_tokens=False) but
// matches the added tokens a tokenizer.json lists (and GPT-2's <|endoftext|>) where they occur
// in the text. decode() of byte-level BPE gives the tokens' bytes, which for a prefix of a
// sequence may end inside a UTF-8 character: StreamingDecoder emits complete characters only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace zero3d::text {

class Tokenizer {
 public:
  virtual ~Tokenizer();
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // InputError for an id outside the vocabulary (a padded embedding row has no text).
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // One past the largest id (added tokens included): the embedding rows the ids need.
  virtual int64_t vocab_size() const = 0;
  // The end-of-text / end-of-sequence token (GPT-2's <|endoftext|>, SentencePiece's </s>).
  virtual int32_t eos_id() const = 0;
  // The beginning-of-sequence token, or -1 when the tokenizer has none (GPT-2).
  virtual int32_t bos_id() const = 0;
  // One line for logs: kind, file, vocabulary ("byte-level BPE (Llama 3 split), 128256 tokens, from …").
  virtual std::string describe() const = 0;

  // The token that starts every document in llm.c's shards (its `tokenizer.encode('')[0]`):
  // the BOS token where there is one (Llama 3, SentencePiece), else end-of-text (GPT-2).
  int32_t document_delimiter() const { return bos_id() >= 0 ? bos_id() : eos_id(); }
};

// A tokenizer named by a path: a tokenizer.json, a SentencePiece .model, GPT-2's encoder.json
// (with vocab.bpe beside it), or a directory holding tokenizer.json, tokenizer.model or
// encoder.json + vocab.bpe (looked for in that order). InputError naming the file and the key
// for anything it cannot read.
std::unique_ptr<Tokenizer> open_tokenizer(const std::string& path);

// Turns ids arriving one at a time into text that is always whole UTF-8 characters: bytes of an
// unfinished character wait for the next token; invalid bytes come out as U+FFFD. The text of
// all push() results plus finish() is the sanitized decode() of all the ids.
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tokenizer);
  std::string push(int32_t id);
  // What is still held (an unfinished character comes out as U+FFFD); the decoder starts afresh.
  std::string finish();

 private:
  const Tokenizer& tok_;
  std::vector<int32_t> ids_;  // the ids from prefix_ on; earlier ones are no longer needed
  size_t prefix_ = 0;         // ids_[prefix_, read_) are emitted and decode as context for the next ones
  size_t read_ = 0;
};

}  // namespace zero3d::text
