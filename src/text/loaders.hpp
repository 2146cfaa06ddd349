// text/loaders.hpp — internal to src/text: one loader per kind of tokenizer file, which
// open_tokenizer (tokenizer.cpp) picks from the path.
#pragma once

#include <memory>
#include <string>

#include "text/tokenizer.hpp"

namespace zero3d::text {

std::unique_ptr<Tokenizer> load_tokenizer_json(const std::string& path);
std::unique_ptr<Tokenizer> load_gpt2_pair(const std::string& encoder_json, const std::string& vocab_bpe);
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path);

}  // namespace zero3d::text
