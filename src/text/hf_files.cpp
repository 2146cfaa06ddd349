// hf_files.cpp — byte-level BPE from Hugging Face's tokenizer.json and from GPT-2's original
// encoder.json + vocab.bpe pair. Every rejection names the file and the key.
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "text/bpe.hpp"
#include "text/loaders.hpp"

namespace zero3d::text {

namespace {

using json = nlohmann::json;

// Tokenizer files are a few MB (Llama 3's is 9 MB, o200k-sized ones about 30 MB).
constexpr int64_t kMaxTokenizerFileBytes = int64_t(1) << 30;

json parse_file(const std::string& path, const std::string& what) {
  const std::string text = read_regular_file(path, what, kMaxTokenizerFileBytes);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw InputError(echo(path, 200) + ": not valid JSON (" + echo(e.what(), 160) + ")");
  }
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

bool is_file(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Reads a tokenizer.json value at a key path, with messages naming file and key.
struct Reader {
  std::string file;
  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw InputError(echo(file, 200) + ": `" + key + "` " + why);
  }
  const json& object(const json& parent, const std::string& name, const std::string& key) const {
    const auto it = parent.find(name);
    if (it == parent.end()) fail(key, "is missing");
    if (!it->is_object()) fail(key, "is " + echo(it->dump(), 60) + ", not an object");
    return *it;
  }
  bool flag(const json& parent, const std::string& name, const std::string& key, bool def) const {
    const auto it = parent.find(name);
    if (it == parent.end() || it->is_null()) return def;
    if (!it->is_boolean()) fail(key, "is " + echo(it->dump(), 60) + ", not true or false");
    return it->get<bool>();
  }
  std::string type(const json& obj, const std::string& key) const {
    const auto it = obj.find("type");
    if (it == obj.end() || !it->is_string()) fail(key + ".type", "is missing or not a string");
    return it->get<std::string>();
  }
};

// The pre-tokenizer: GPT-2's ByteLevel (its built-in regex), or a Split by a known pattern
// followed by ByteLevel without its regex (Llama 3, Qwen2).
void read_pre_tokenizer(const Reader& r, const json& root, BpeOptions& o) {
  const auto it = root.find("pre_tokenizer");
  if (it == root.end() || it->is_null())
    r.fail("pre_tokenizer", "is missing: byte-level BPE needs the ByteLevel pre-tokenizer");
  if (!it->is_object()) r.fail("pre_tokenizer", "is not an object");
  std::vector<std::pair<const json*, std::string>> steps;
  if (r.type(*it, "pre_tokenizer") == "Sequence") {
    const auto list = it->find("pretokenizers");
    if (list == it->end() || !list->is_array()) r.fail("pre_tokenizer.pretokenizers", "is missing or not a list");
    for (size_t i = 0; i < list->size(); ++i) {
      if (!(*list)[i].is_object()) r.fail("pre_tokenizer.pretokenizers[" + std::to_string(i) + "]", "is not an object");
      steps.emplace_back(&(*list)[i], "pre_tokenizer.pretokenizers[" + std::to_string(i) + "]");
    }
  } else {
    steps.emplace_back(&*it, "pre_tokenizer");
  }
  bool split = false, byte_level = false;
  for (const auto& [step, key] : steps) {
    const std::string type = r.type(*step, key);
    if (type == "Split") {
      if (split || byte_level) r.fail(key, "is a second split: zero3d reads one Split followed by ByteLevel");
      const auto pat = step->find("pattern");
      if (pat == step->end() || !pat->is_object() || !pat->contains("Regex") || !(*pat)["Regex"].is_string())
        r.fail(key + ".pattern", "is not {\"Regex\": \"…\"}");
      const std::string regex = (*pat)["Regex"].get<std::string>();
      const auto known = known_split_pattern(regex);
      if (!known)
        r.fail(key + ".pattern.Regex", "is " + echo(json(regex).dump(), 120) +
                                           ", none of the patterns zero3d's scanner implements (GPT-2's, Llama 3's, "
                                           "Qwen2's; text/pretokenize.hpp)");
      const std::string behavior = step->value("behavior", std::string("Isolated"));
      if (behavior != "Isolated") r.fail(key + ".behavior", "is \"" + echo(behavior) + "\"; zero3d splits as Isolated");
      if (r.flag(*step, "invert", key + ".invert", false)) r.fail(key + ".invert", "is true; zero3d splits with invert false");
      o.pattern = *known;
      split = true;
    } else if (type == "ByteLevel") {
      if (byte_level) r.fail(key, "is a second ByteLevel");
      o.add_prefix_space = r.flag(*step, "add_prefix_space", key + ".add_prefix_space", false);
      const bool use_regex = r.flag(*step, "use_regex", key + ".use_regex", true);
      if (use_regex && split) r.fail(key + ".use_regex", "is true after a Split: two regex splits in a row");
      if (!use_regex && !split)
        r.fail(key + ".use_regex", "is false with no Split before it: zero3d splits by a known pattern");
      if (use_regex) o.pattern = SplitPattern::Gpt2;
      byte_level = true;
    } else {
      r.fail(key + ".type", "is \"" + echo(type) + "\"; zero3d's byte-level BPE reads Split and ByteLevel");
    }
  }
  if (!byte_level) r.fail("pre_tokenizer", "has no ByteLevel step: not a byte-level BPE tokenizer");
}

void read_normalizer(const Reader& r, const json& root, BpeOptions& o) {
  const auto it = root.find("normalizer");
  if (it == root.end() || it->is_null()) return;
  if (!it->is_object()) r.fail("normalizer", "is not an object");
  std::vector<std::pair<const json*, std::string>> steps;
  if (r.type(*it, "normalizer") == "Sequence") {
    const auto list = it->find("normalizers");
    if (list == it->end() || !list->is_array()) r.fail("normalizer.normalizers", "is missing or not a list");
    for (size_t i = 0; i < list->size(); ++i)
      steps.emplace_back(&(*list)[i], "normalizer.normalizers[" + std::to_string(i) + "]");
  } else {
    steps.emplace_back(&*it, "normalizer");
  }
  for (const auto& [step, key] : steps) {
    if (!step->is_object()) r.fail(key, "is not an object");
    const std::string type = r.type(*step, key);
    if (type != "NFC") r.fail(key + ".type", "is \"" + echo(type) + "\"; zero3d applies the NFC normalizer only");
    o.nfc = true;
  }
}

std::string token_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

// bos from the post-processor's template: a special token before the sequence ($A) in "single".
int32_t template_bos(const json& pp) {
  if (!pp.is_object()) return -1;
  const std::string type = pp.value("type", std::string());
  if (type == "Sequence" && pp.contains("processors") && pp["processors"].is_array()) {
    for (const json& p : pp["processors"])
      if (const int32_t id = template_bos(p); id >= 0) return id;
    return -1;
  }
  if (type != "TemplateProcessing" || !pp.contains("single") || !pp["single"].is_array() || pp["single"].empty())
    return -1;
  const json& first = pp["single"][0];
  if (!first.is_object() || !first.contains("SpecialToken")) return -1;
  const std::string name = first["SpecialToken"].value("id", std::string());
  const auto st = pp.find("special_tokens");
  if (st == pp.end() || !st->contains(name)) return -1;
  const json& entry = (*st)[name];
  if (!entry.is_object() || !entry.contains("ids")) return -1;
  const json& ids = entry["ids"];
  return ids.is_array() && ids.size() == 1 && ids[0].is_number_integer() ? ids[0].get<int32_t>() : -1;
}

// eos and bos: tokenizer_config.json beside the file names them (as transformers reads them);
// without it, bos comes from the post-processor and eos is the first of the usual names found.
void special_ids(const std::string& file, const json& vocab, const json* post_processor,
                 const std::vector<AddedToken>& added, int32_t& eos, int32_t& bos) {
  // A name is an added token's content, or a vocabulary entry spelled in byte-level characters.
  auto lookup = [&](const std::string& name) -> int32_t {
    for (const AddedToken& a : added)
      if (a.content == name) return a.id;
    std::string written;
    for (unsigned char c : name) written += byte_to_unicode()[c];
    const auto it = vocab.find(written);
    return it != vocab.end() && it->is_number_integer() ? it->get<int32_t>() : -1;
  };
  const std::string config = dir_of(file) + "/tokenizer_config.json";
  eos = -1;
  bos = post_processor ? template_bos(*post_processor) : -1;
  if (is_file(config)) {
    const json c = parse_file(config, "tokenizer_config.json");
    const Reader r{config};
    for (const auto& [key, out] : {std::pair<const char*, int32_t*>{"eos_token", &eos}, {"bos_token", &bos}}) {
      if (!c.is_object() || !c.contains(key)) continue;
      if (c[key].is_null()) {
        *out = -1;
        continue;
      }
      const std::string name = token_text(c[key]);
      if (name.empty()) r.fail(key, "is " + echo(c[key].dump(), 60) + ", not a token");
      *out = lookup(name);
      if (*out < 0) r.fail(key, "names " + echo(name) + ", which " + echo(file, 200) + " does not hold");
    }
  }
  if (eos < 0) {
    for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>", "<|eot_id|>"})
      if ((eos = lookup(name)) >= 0) break;
  }
  if (eos < 0)
    throw InputError(echo(file, 200) + ": names no end-of-text token (no tokenizer_config.json beside it with "
                     "eos_token, and none of <|endoftext|>, <|end_of_text|>, </s>, <|im_end|>, <|eot_id|> in its "
                     "vocabulary)");
}

// A value of an unexpected JSON type where nlohmann reads one (value(), get()) is bad input too.
template <class F>
std::unique_ptr<Tokenizer> json_errors_are_input_errors(const std::string& path, F&& load) {
  try {
    return load();
  } catch (const json::exception& e) {
    throw InputError(echo(path, 200) + ": unexpected structure (" + echo(e.what(), 160) + ")");
  }
}

std::unique_ptr<Tokenizer> read_tokenizer_json(const std::string& path) {
  const json root = parse_file(path, "tokenizer");
  const Reader r{path};
  if (!root.is_object()) r.fail("(top level)", "is not a JSON object");
  const json& model = r.object(root, "model", "model");
  const std::string type = model.value("type", std::string("BPE"));  // old files omit it
  if (type != "BPE")
    r.fail("model.type", "is \"" + echo(type) + "\"; zero3d reads byte-level BPE tokenizer.json files (GPT-2, Llama 3, "
                         "Qwen2) and SentencePiece .model files (Llama 2, Mistral)");
  BpeOptions o;
  o.source = path;
  if (r.flag(model, "byte_fallback", "model.byte_fallback", false))
    r.fail("model.byte_fallback", "is true: a SentencePiece-style BPE (Llama 2, Mistral); give its tokenizer.model");
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0))
    r.fail("model.dropout", "is " + echo(model["dropout"].dump()) + ": BPE dropout makes encoding random");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(k) && !model[k].is_null() && !(model[k].is_string() && model[k].get<std::string>().empty()))
      r.fail(std::string("model.") + k, "is " + echo(model[k].dump()) + "; byte-level BPE has none");
  o.ignore_merges = r.flag(model, "ignore_merges", "model.ignore_merges", false);
  read_normalizer(r, root, o);
  read_pre_tokenizer(r, root, o);
  if (root.contains("decoder") && !root["decoder"].is_null()) {
    if (!root["decoder"].is_object() || r.type(root["decoder"], "decoder") != "ByteLevel")
      r.fail("decoder", "is " + echo(root["decoder"].dump(), 80) + "; byte-level BPE decodes with ByteLevel");
  }

  const json& vocab_json = r.object(model, "vocab", "model.vocab");
  std::vector<std::pair<std::string, int32_t>> vocab;
  vocab.reserve(vocab_json.size());
  for (auto it = vocab_json.begin(); it != vocab_json.end(); ++it) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() >= (int64_t(1) << 30))
      r.fail("model.vocab." + echo(it.key()), "is " + echo(it->dump()) + ", not a token id");
    vocab.emplace_back(it.key(), it->get<int32_t>());
  }
  const auto mj = model.find("merges");
  if (mj == model.end() || !mj->is_array()) r.fail("model.merges", "is missing or not a list");
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(mj->size());
  for (size_t i = 0; i < mj->size(); ++i) {
    const json& m = (*mj)[i];
    if (m.is_string()) {  // "a b": the older form
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 == s.size() || s.find(' ', sp + 1) != std::string::npos)
        r.fail("model.merges[" + std::to_string(i) + "]", "is " + echo(m.dump()) + ", not two tokens \"a b\"");
      merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {  // ["a", "b"]
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      r.fail("model.merges[" + std::to_string(i) + "]", "is " + echo(m.dump()) + ", not \"a b\" or [\"a\", \"b\"]");
    }
  }
  std::vector<AddedToken> added;
  if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
    const json& list = root["added_tokens"];
    if (!list.is_array()) r.fail("added_tokens", "is not a list");
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string key = "added_tokens[" + std::to_string(i) + "]";
      const json& a = list[i];
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || a["id"].get<int64_t>() < 0 ||
          a["id"].get<int64_t>() >= (int64_t(1) << 30) || !a.contains("content") || !a["content"].is_string())
        r.fail(key, "is " + echo(a.dump(), 80) + ", not {\"id\": …, \"content\": …}");
      AddedToken t;
      t.id = a["id"].get<int32_t>();
      t.content = a["content"].get<std::string>();
      t.special = r.flag(a, "special", key + ".special", false);
      t.lstrip = r.flag(a, "lstrip", key + ".lstrip", false);
      t.rstrip = r.flag(a, "rstrip", key + ".rstrip", false);
      t.single_word = r.flag(a, "single_word", key + ".single_word", false);
      added.push_back(std::move(t));
    }
  }
  const json* pp = root.contains("post_processor") ? &root["post_processor"] : nullptr;
  int32_t eos = -1, bos = -1;
  special_ids(path, vocab_json, pp, added, eos, bos);
  return std::make_unique<ByteLevelBpe>(vocab, merges, std::move(added), eos, bos, o, "model.vocab");
}

std::unique_ptr<Tokenizer> read_gpt2_pair(const std::string& encoder_json, const std::string& vocab_bpe) {
  const json enc = parse_file(encoder_json, "GPT-2 encoder.json");
  const Reader r{encoder_json};
  if (!enc.is_object()) r.fail("(top level)", "is not a JSON object of token ids");
  std::vector<std::pair<std::string, int32_t>> vocab;
  vocab.reserve(enc.size());
  for (auto it = enc.begin(); it != enc.end(); ++it) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() >= (int64_t(1) << 30))
      r.fail(echo(it.key()), "is " + echo(it->dump()) + ", not a token id");
    vocab.emplace_back(it.key(), it->get<int32_t>());
  }
  const std::string text = read_regular_file(vocab_bpe, "GPT-2 vocab.bpe", kMaxTokenizerFileBytes);
  std::vector<std::pair<std::string, std::string>> merges;
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 == line.size() || line.find(' ', sp + 1) != std::string::npos)
      throw InputError(echo(vocab_bpe, 200) + ": line " + std::to_string(line_no) + " is " + echo(line) +
                       ", not a merge \"a b\"");
    merges.emplace_back(line.substr(0, sp), line.substr(sp + 1));
  }
  const auto eot = enc.find("<|endoftext|>");
  if (eot == enc.end() || !eot->is_number_integer())
    throw InputError(echo(encoder_json, 200) + ": has no <|endoftext|> token (GPT-2's end-of-text, 50256)");
  AddedToken t;
  t.content = "<|endoftext|>";
  t.id = eot->get<int32_t>();
  t.special = true;
  BpeOptions o;
  o.source = encoder_json + " + " + vocab_bpe;
  return std::make_unique<ByteLevelBpe>(vocab, merges, std::vector<AddedToken>{t}, t.id, -1, o, "encoder.json");
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer_json(const std::string& path) {
  return json_errors_are_input_errors(path, [&] { return read_tokenizer_json(path); });
}

std::unique_ptr<Tokenizer> load_gpt2_pair(const std::string& encoder_json, const std::string& vocab_bpe) {
  return json_errors_are_input_errors(encoder_json, [&] { return read_gpt2_pair(encoder_json, vocab_bpe); });
}

}  // namespace zero3d::text
