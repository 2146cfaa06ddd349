// text/stop_strings.hpp — generated text as it can be shown while tokens arrive, ending before a
// stop string (Hugging Face's `stop_strings`, vLLM's `stop`: the text up to the first occurrence
// of any of them; the stop string itself is not part of the output).
//
// Two things hold text back: a token may end inside a UTF-8 character (StreamingDecoder waits
// for the rest), and the text's end may be the start of a stop string that the next tokens
// complete. What push() returns is final: the concatenation of every push() and finish() is the
// decoded text of all the ids, cut before the first stop string (the whole text when none
// occurs).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "text/tokenizer.hpp"

namespace zero3d::text {

class StopStringStream {
 public:
  // stops: non-empty, valid UTF-8 (InputError otherwise: an empty one would stop before any text).
  StopStringStream(const Tokenizer& tokenizer, std::vector<std::string> stops);
  // The next generated id; returns the text that is now certain. After a stop string was found
  // it returns "" and the id is not read.
  std::string push(int32_t id);
  // A stop string occurred: the sequence is finished.
  bool stopped() const { return stopped_; }
  // Which stop string ended the text (empty when none did).
  const std::string& stopped_by() const { return stopped_by_; }
  // Everything still held back: the end of the text (it is final now).
  std::string finish();

 private:
  size_t find_stop();
  StreamingDecoder decoder_;
  std::vector<std::string> stops_;
  std::string held_;  // decoded whole characters not yet returned: a possible start of a stop string
  bool stopped_ = false;
  std::string stopped_by_;
};

// The length of the longest suffix of `text` that is a proper prefix of one of `stops`: the
// bytes that must wait, since the next text may complete a stop string from there.
size_t stop_string_prefix_at_end(const std::string& text, const std::vector<std::string>& stops);

}  // namespace zero3d::text
