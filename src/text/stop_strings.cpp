// stop_strings.cpp — StopStringStream (stop_strings.hpp).
#include "text/stop_strings.hpp"

#include <algorithm>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "text/unicode.hpp"

namespace zero3d::text {

StopStringStream::StopStringStream(const Tokenizer& tokenizer, std::vector<std::string> stops)
    : decoder_(tokenizer), stops_(std::move(stops)) {
  // A valid stop string begins on a character, so the text held back for it never splits one.
  for (const std::string& s : stops_) {
    if (s.empty()) throw InputError("--stop: an empty stop string (it would end every sequence before its first token)");
    if (first_invalid_utf8(s) != std::string::npos)
      throw InputError("--stop " + echo(s, 60) + ": not valid UTF-8 (the text it is looked for in is)");
  }
}

size_t stop_string_prefix_at_end(const std::string& text, const std::vector<std::string>& stops) {
  size_t longest = 0;
  for (const std::string& s : stops)
    for (size_t n = std::min(text.size(), s.size() - 1); n > longest; --n)
      if (text.compare(text.size() - n, n, s, 0, n) == 0) {
        longest = n;
        break;
      }
  return longest;
}

// The first stop string in held_ (npos: none), and which one it is in stopped_by_.
size_t StopStringStream::find_stop() {
  size_t first = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t at = held_.find(s);
    if (at < first) {
      first = at;
      stopped_by_ = s;
    }
  }
  return first;
}

// What was returned holds no beginning of a stop string that later text could complete (that
// suffix stays in held_), so searching held_ alone finds the first occurrence in the whole text.
std::string StopStringStream::push(int32_t id) {
  if (stopped_) return "";
  held_ += decoder_.push(id);
  const size_t stop = find_stop();
  const size_t keep = stop != std::string::npos ? 0 : stop_string_prefix_at_end(held_, stops_);
  std::string out = held_.substr(0, stop != std::string::npos ? stop : held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  stopped_ = stop != std::string::npos;
  return out;
}

std::string StopStringStream::finish() {
  if (stopped_) return "";
  held_ += decoder_.finish();  // an unfinished character's U+FFFD
  const size_t stop = find_stop();
  stopped_ = stop != std::string::npos;
  std::string out = held_.substr(0, stop);
  held_.clear();
  return out;
}

}  // namespace zero3d::text
