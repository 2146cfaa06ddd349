// tokenize.cpp — `zero3d tokenize`: text files to llm.c token shards (llm.c's
// dev/data/data_common.py write_datafile, as its fineweb.py and tinyshakespeare.py use it).
//
// Every document is its delimiter token followed by its tokens (Tokenizer::document_delimiter:
// GPT-2's <|endoftext|>, or the BOS token where the tokenizer has one, as llm.c's
// `tokenizer.encode('')[0]`). The documents' tokens, in the order of the files and lines, form
// one stream of N tokens. The validation split is its first V = round(F·N) tokens (F =
// --val-fraction, rounded half away from zero), cut exactly there even inside a document as
// llm.c cuts shards; the training split is the other N − V. Each split is written in shards of
// at most --shard-size tokens, numbered from 0 across both: validation first (shard 0 is the
// validation split, as in llm.c), then training (`<name>_val_000000.bin`,
// `<name>_train_000001.bin`, …; with F = 0 there is no validation shard and the first training
// shard is still number 1). Tokens are uint16 under magic 20240520 (version 1) when every id
// fits (vocabularies up to 65,536), else uint32 under magic 20240801 (version 7).
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "base/errors.hpp"
#include "base/input_file.hpp"
#include "cli/commands.hpp"
#include "text/tokenizer.hpp"
#include "text/unicode.hpp"

namespace zero3d::cli {

namespace {

namespace fs = std::filesystem;

// One input file is held in memory while it is tokenized; a bound keeps a wrong path (a disk
// image) from exhausting memory.
constexpr int64_t kMaxInputFileBytes = int64_t(1) << 36;

bool is_jsonl(const std::string& path) {
  const std::string ext = fs::path(path).extension().string();
  return ext == ".jsonl" || ext == ".ndjson";
}

std::string utf8_problem(const std::string& file, const std::string& bytes, size_t offset, const std::string& where) {
  char hex[8];
  std::snprintf(hex, sizeof(hex), "0x%02X", static_cast<unsigned char>(bytes[offset]));
  return echo(file, 200) + ": not valid UTF-8 at byte offset " + std::to_string(offset) + " (" + where + "byte " + hex +
         ")";
}

// Progress on stderr: nothing during the first ZERO3D_PROGRESS_SECONDS (default 1), then a line
// at most that often (as convert and inspect report theirs).
class Progress {
 public:
  explicit Progress(int64_t total_bytes) : total_(total_bytes) {
    if (const char* s = std::getenv("ZERO3D_PROGRESS_SECONDS")) {
      char* end = nullptr;
      const double v = std::strtod(s, &end);
      if (end != s && *end == '\0' && std::isfinite(v) && v >= 0) interval_ = v;
    }
  }
  void update(int64_t bytes, int64_t tokens, const std::string& file) {
    const double now = seconds();
    if (now < interval_ || now - last_ < interval_) return;
    last_ = now;
    std::fprintf(stderr, "tokenize: %.1f of %.1f MB (%.0f%%), %lld tokens, %.0f tokens/s, %.2f MB/s: %s\n", bytes / 1e6,
                 total_ / 1e6, total_ > 0 ? 100.0 * double(bytes) / double(total_) : 100.0,
                 static_cast<long long>(tokens), tokens / now, bytes / 1e6 / now, echo(file, 200).c_str());
    std::fflush(stderr);
  }
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  int64_t total_;
  double interval_ = 1.0, last_ = 0.0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// Files this command writes and has not published yet: removed if it stops on an error.
struct Scratch {
  std::vector<std::string> paths;
  ~Scratch() {
    std::error_code ec;
    for (const std::string& p : paths) fs::remove(p, ec);
  }
};

void write_all(std::FILE* f, const void* data, size_t bytes, const std::string& path) {
  if (bytes && std::fwrite(data, 1, bytes, f) != bytes) throw SystemError(path + ": write failed (disk full?)");
}

std::vector<int32_t> document_ids(const text::Tokenizer& tok, std::string_view doc) {
  std::vector<int32_t> ids = tok.encode(doc);
  ids.insert(ids.begin(), tok.document_delimiter());
  return ids;
}

}  // namespace

std::vector<int32_t> text_file_document(const text::Tokenizer& tok, const std::string& path, const std::string& what) {
  const std::string bytes = read_regular_file(path, what, kMaxInputFileBytes);
  if (const size_t bad = text::first_invalid_utf8(bytes); bad != std::string::npos)
    throw InputError(utf8_problem(path, bytes, bad, ""));
  return document_ids(tok, bytes);
}

int cmd_tokenize(const TokenizeArgs& a, int rank) {
  if (rank != 0) return kExitOk;  // one process does the work; other ranks have nothing to add
  if (!(a.val_fraction >= 0.0 && a.val_fraction < 1.0))
    throw InputError("tokenize --val-fraction " + std::to_string(a.val_fraction) +
                     ": must be at least 0 and below 1 (the training split cannot be empty)");
  if (a.shard_size < 1 || a.shard_size > INT32_MAX)
    throw InputError("tokenize --shard-size " + std::to_string(a.shard_size) + ": must be 1 to " +
                     std::to_string(INT32_MAX) + " tokens (the header's count is an int32)");
  // Every input is checked before any work, so that a typo in the last name costs nothing.
  int64_t total_bytes = 0;
  for (const std::string& f : a.files) total_bytes += regular_file_size(f, "tokenize input", kMaxInputFileBytes);
  const std::unique_ptr<text::Tokenizer> tok = text::open_tokenizer(a.tokenizer);
  const int64_t vocab = tok->vocab_size();
  const bool wide = vocab > 65536;
  const int32_t delimiter = tok->document_delimiter();
  std::string name = a.name;
  if (name.empty()) name = fs::path(a.out).lexically_normal().filename().string();
  if (name.empty() || name == "." || name == "..") name = fs::absolute(a.out).lexically_normal().filename().string();
  if (name.empty() || name.find('/') != std::string::npos || find_control_byte(name) != std::string::npos)
    throw InputError("tokenize --name " + echo(name) + ": not a file name prefix");
  std::error_code ec;
  fs::create_directories(a.out, ec);
  if (!fs::is_directory(a.out)) throw InputError("tokenize --out " + echo(a.out, 200) + ": cannot create the directory");

  // Pass 1: every document's tokens into a scratch file (uint32), so that the split into
  // validation and training tokens can be exact without holding the corpus in memory.
  Scratch scratch;
  const std::string spill = (fs::path(a.out) / ("." + name + ".tokens.tmp")).string();
  scratch.paths.push_back(spill);
  std::FILE* sf = std::fopen(spill.c_str(), "wb");
  if (!sf) throw InputError("tokenize --out " + echo(a.out, 200) + ": cannot write " + echo(spill, 200));
  int64_t n_tokens = 0, n_docs = 0, done_bytes = 0;
  Progress progress(total_bytes);
  std::vector<int32_t> ids;
  auto add_document = [&](std::string_view doc) {
    ids = document_ids(*tok, doc);
    static_assert(sizeof(int32_t) == sizeof(uint32_t), "ids are written as uint32");
    write_all(sf, ids.data(), ids.size() * 4, spill);
    n_tokens += static_cast<int64_t>(ids.size());
    ++n_docs;
  };
  try {
    for (const std::string& f : a.files) {
      const std::string bytes = read_regular_file(f, "tokenize input", kMaxInputFileBytes);
      if (const size_t bad = text::first_invalid_utf8(bytes); bad != std::string::npos) {
        std::string where;
        if (is_jsonl(f)) where = "line " + std::to_string(1 + std::count(bytes.begin(), bytes.begin() + bad, '\n')) + ", ";
        throw InputError(utf8_problem(f, bytes, bad, where));
      }
      if (!is_jsonl(f)) {
        add_document(bytes);
      } else {
        size_t line_no = 0;
        for (size_t pos = 0; pos < bytes.size();) {
          size_t nl = bytes.find('\n', pos);
          if (nl == std::string::npos) nl = bytes.size();
          const std::string_view line(bytes.data() + pos, nl - pos);
          pos = nl + 1;
          ++line_no;
          if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;  // blank lines hold no document
          nlohmann::json j;
          try {
            j = nlohmann::json::parse(line);
          } catch (const nlohmann::json::exception& e) {
            throw InputError(echo(f, 200) + ": line " + std::to_string(line_no) + " is not JSON (" + echo(e.what(), 120) + ")");
          }
          if (!j.is_object() || !j.contains(a.field) || !j[a.field].is_string())
            throw InputError(echo(f, 200) + ": line " + std::to_string(line_no) + " has no string field \"" +
                             echo(a.field) + "\" (--field)");
          add_document(j[a.field].get_ref<const std::string&>());
          if ((line_no & 255) == 0) progress.update(done_bytes + int64_t(pos), n_tokens, f);
        }
      }
      done_bytes += static_cast<int64_t>(bytes.size());
      progress.update(done_bytes, n_tokens, f);
    }
  } catch (...) {
    std::fclose(sf);
    throw;
  }
  if (std::fclose(sf) != 0) throw SystemError(spill + ": write failed (disk full?)");
  const double tokenize_s = progress.seconds();

  // Pass 2: the shards, written under temporary names and renamed once all are complete.
  const int64_t n_val = std::llround(a.val_fraction * double(n_tokens));
  if (n_tokens - n_val <= 0)
    throw InputError("tokenize: --val-fraction " + std::to_string(a.val_fraction) + " of " + std::to_string(n_tokens) +
                     " tokens leaves none for training");
  struct Shard {
    std::string path;
    int64_t count;
  };
  std::vector<Shard> shards;
  int index = 0;
  auto plan = [&](const char* split, int64_t count) {
    for (int64_t left = count; left > 0; left -= a.shard_size) {
      char file[64];
      std::snprintf(file, sizeof(file), "_%s_%06d.bin", split, index++);
      shards.push_back({(fs::path(a.out) / (name + file)).string(), std::min(left, a.shard_size)});
    }
  };
  plan("val", n_val);
  if (n_val == 0) index = 1;  // shard 0 is the validation split's, even when it is empty
  plan("train", n_tokens - n_val);
  std::FILE* in = std::fopen(spill.c_str(), "rb");
  if (!in) throw SystemError(spill + ": cannot reopen");
  std::vector<uint32_t> buf;
  std::vector<uint16_t> narrow;
  try {
    for (const Shard& s : shards) {
      const std::string tmp = s.path + ".tmp";
      scratch.paths.push_back(tmp);
      std::FILE* out = std::fopen(tmp.c_str(), "wb");
      if (!out) throw InputError("tokenize --out " + echo(a.out, 200) + ": cannot write " + echo(tmp, 200));
      int32_t header[256] = {};
      header[0] = wide ? 20240801 : 20240520;
      header[1] = wide ? 7 : 1;
      header[2] = static_cast<int32_t>(s.count);
      try {
        write_all(out, header, sizeof(header), tmp);
        for (int64_t left = s.count; left > 0;) {
          const size_t n = static_cast<size_t>(std::min<int64_t>(left, 1 << 20));
          buf.resize(n);
          if (std::fread(buf.data(), 4, n, in) != n) throw SystemError(spill + ": read back short");
          if (wide) {
            write_all(out, buf.data(), n * 4, tmp);
          } else {
            narrow.assign(buf.begin(), buf.end());  // every id is below 65,536 (vocabulary checked above)
            write_all(out, narrow.data(), n * 2, tmp);
          }
          left -= static_cast<int64_t>(n);
        }
      } catch (...) {
        std::fclose(out);
        throw;
      }
      if (std::fclose(out) != 0) throw SystemError(tmp + ": write failed (disk full?)");
    }
  } catch (...) {
    std::fclose(in);
    throw;
  }
  std::fclose(in);
  std::set<std::string> written;
  for (const Shard& s : shards) {
    fs::rename(s.path + ".tmp", s.path);
    written.insert(fs::path(s.path).filename().string());
  }
  // Printed once all went well: bad input gives its one line and nothing else.
  std::printf("tokenize: %s\n", tok->describe().c_str());
  std::printf("tokenize: each document starts with token %d (%s); %s shards, magic %d\n", delimiter,
              delimiter == tok->bos_id() ? "beginning of sequence" : "end of text", wide ? "uint32" : "uint16",
              wide ? 20240801 : 20240520);
  // Shards of this name that an earlier run wrote and this one did not (it had more of them)
  // would be read by a glob as if they belonged to this corpus.
  const std::regex ours("^" + std::regex_replace(name, std::regex(R"([.^$|()\[\]{}*+?\\])"), R"(\$&)") +
                        R"(_(val|train)_[0-9]{6}\.bin$)");
  for (const auto& entry : fs::directory_iterator(a.out, ec)) {
    const std::string file = entry.path().filename().string();
    if (std::regex_match(file, ours) && !written.count(file)) {
      fs::remove(entry.path(), ec);
      std::printf("tokenize: removed %s (an earlier run's shard beyond this run's)\n", echo(entry.path().string(), 200).c_str());
    }
  }
  const double total_s = progress.seconds();
  for (const Shard& s : shards)
    std::printf("  %s: %lld tokens\n", echo(s.path, 200).c_str(), static_cast<long long>(s.count));
  std::printf("tokenize: %zu file%s, %lld document%s, %.2f MB -> %lld tokens (%lld validation, %lld training) in %zu "
              "shard%s; %.2f s: %.0f tokens/s, %.2f MB/s (tokenizing alone %.2f s: %.0f tokens/s)\n",
              a.files.size(), a.files.size() == 1 ? "" : "s", static_cast<long long>(n_docs), n_docs == 1 ? "" : "s",
              total_bytes / 1e6, static_cast<long long>(n_tokens), static_cast<long long>(n_val),
              static_cast<long long>(n_tokens - n_val), shards.size(), shards.size() == 1 ? "" : "s", total_s,
              n_tokens / std::max(total_s, 1e-9), total_bytes / 1e6 / std::max(total_s, 1e-9), tokenize_s,
              n_tokens / std::max(tokenize_s, 1e-9));
  return kExitOk;
}

}  // namespace zero3d::cli
