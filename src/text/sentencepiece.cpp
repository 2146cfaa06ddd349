// sentencepiece.cpp — SentencePiece models (Llama 2, Mistral tokenizer.model) through Debian's
// libsentencepiece: encoding and decoding are the library's own, so they equal spm_encode's.
#include <sentencepiece_processor.h>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "text/loaders.hpp"

namespace zero3d::text {

namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    // Checked first: the library would block on a FIFO and read any size.
    regular_file_size(path, "tokenizer (SentencePiece model)", int64_t(1) << 30);
    const auto status = sp_.Load(path);
    if (!status.ok())
      throw InputError(echo(path, 200) + ": not a SentencePiece model (" + echo(status.ToString(), 200) + ")");
    if (sp_.eos_id() < 0)
      throw InputError(echo(path, 200) + ": the SentencePiece model has no end-of-sequence piece (eos_id -1)");
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(absl::string_view(text.data(), text.size()), &ids);
    if (!status.ok()) throw InputError(echo(path_, 200) + ": cannot encode: " + echo(status.ToString(), 200));
    return std::vector<int32_t>(ids.begin(), ids.end());
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    const int n = sp_.GetPieceSize();
    for (int32_t id : ids)
      if (id < 0 || id >= n)
        throw InputError("token id " + std::to_string(id) + " is outside the vocabulary of " + echo(path_, 200) + " (" +
                         std::to_string(n) + " pieces)");
    std::string out;
    const auto status = sp_.Decode(std::vector<int>(ids.begin(), ids.end()), &out);
    if (!status.ok()) throw InputError(echo(path_, 200) + ": cannot decode: " + echo(status.ToString(), 200));
    return out;
  }

  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  int32_t eos_id() const override { return sp_.eos_id(); }
  int32_t bos_id() const override { return sp_.bos_id(); }
  std::string describe() const override {
    return "SentencePiece, " + std::to_string(sp_.GetPieceSize()) + " pieces, from " + echo(path_, 200);
  }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

}  // namespace zero3d::text
