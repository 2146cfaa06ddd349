// unicode.cpp — UTF-8 helpers, the category and White_Space predicates, NFC.
#include "text/unicode.hpp"

#include <algorithm>
#include <array>
#include <vector>

namespace zero3d::text {

namespace {

uint8_t range_value(const CodeRange* ranges, size_t count, char32_t cp) {
  const CodeRange* end = ranges + count;
  const CodeRange* it = std::upper_bound(ranges, end, cp, [](char32_t c, const CodeRange& r) { return c < r.first; });
  if (it == ranges) return 0;
  --it;
  return cp <= it->last ? it->value : 0;
}

// The Basic Multilingual Plane's classes in one array: most text never reaches the binary search.
const std::array<uint8_t, 0x10000>& bmp_classes() {
  static const std::array<uint8_t, 0x10000> table = [] {
    std::array<uint8_t, 0x10000> t{};
    for (size_t i = 0; i < tables::kCategoryRangeCount; ++i) {
      const CodeRange& r = tables::kCategoryRanges[i];
      for (char32_t c = r.first; c <= r.last && c < 0x10000; ++c) t[c] = r.value;
    }
    return t;
  }();
  return table;
}

uint8_t combining_class(char32_t cp) {
  if (cp < 0x300) return 0;  // nothing below U+0300 combines
  return range_value(tables::kCombiningRanges, tables::kCombiningRangeCount, cp);
}

// Hangul syllables compose and decompose by arithmetic (Unicode §3.12), not by table.
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

void decompose(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const char32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  const Decomposition* begin = tables::kDecompositions;
  const Decomposition* end = begin + tables::kDecompositionCount;
  const Decomposition* it = std::lower_bound(begin, end, cp, [](const Decomposition& d, char32_t c) { return d.cp < c; });
  if (it != end && it->cp == cp) {
    out.insert(out.end(), tables::kDecompositionData + it->offset, tables::kDecompositionData + it->offset + it->length);
    return;
  }
  out.push_back(cp);
}

// The primary composite of (a, b), or 0.
char32_t compose(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount)
    return a + (b - kTBase);
  const Composition* begin = tables::kCompositions;
  const Composition* end = begin + tables::kCompositionCount;
  const Composition* it = std::lower_bound(begin, end, std::make_pair(a, b), [](const Composition& c, const auto& key) {
    return c.first != key.first ? c.first < key.first : c.second < key.second;
  });
  return it != end && it->first == a && it->second == b ? it->composite : 0;
}

}  // namespace

CharClass char_class(char32_t cp) {
  if (cp < 0x10000) return static_cast<CharClass>(bmp_classes()[cp]);
  return static_cast<CharClass>(range_value(tables::kCategoryRanges, tables::kCategoryRangeCount, cp));
}

bool is_whitespace(char32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
         cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t first_invalid_utf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    // Eight ASCII bytes at a time: the common case of text files.
    while (i + 8 <= n) {
      uint64_t w;
      std::copy_n(s.data() + i, 8, reinterpret_cast<char*>(&w));
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    decode_utf8(s, i, len);
    if (len == 1) return i;  // a non-ASCII byte that decodes alone is no valid sequence
    i += len;
  }
  return std::string::npos;
}

size_t incomplete_utf8_tail(std::string_view s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: the lead is further back
    size_t need = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (need <= back) return 0;  // complete, or not a lead byte at all
    // The second byte's range depends on the lead (no overlongs, surrogates, > U+10FFFF).
    if (back >= 2) {
      const unsigned char c1 = static_cast<unsigned char>(s[n - back + 1]);
      const bool ok = c == 0xE0 ? c1 >= 0xA0 : c == 0xED ? c1 <= 0x9F : c == 0xF0 ? c1 >= 0x90 : c == 0xF4 ? c1 <= 0x8F : true;
      if (!ok) return 0;
    }
    return back;
  }
  return 0;
}

std::string sanitize_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t len;
    decode_utf8(s, i, len);
    if (len == 1 && static_cast<unsigned char>(s[i]) >= 0x80) out += "\xEF\xBF\xBD";
    else out.append(s.data() + i, len);
    i += len;
  }
  return out;
}

std::string nfc(std::string_view s) {
  // Below U+0300 every character is already composed and none combines with its neighbour.
  bool simple = true;
  for (size_t i = 0; i < s.size() && simple;) {
    size_t len;
    if (decode_utf8(s, i, len) >= 0x300) simple = false;
    i += len;
  }
  if (simple) return std::string(s);
  std::vector<char32_t> d;
  d.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t len;
    const char32_t cp = decode_utf8(s, i, len);
    decompose(cp, d);
    i += len;
  }
  // Canonical ordering: within each run of non-starters, a stable sort by combining class.
  for (size_t i = 0; i < d.size();) {
    if (combining_class(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && combining_class(d[j]) != 0) ++j;
    std::stable_sort(d.begin() + i, d.begin() + j, [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
  // Canonical composition (UAX #15): a mark composes with the last starter unless blocked.
  std::vector<char32_t> r;
  r.reserve(d.size());
  size_t starter = 0;
  int last_class = -1;  // -1: no starter yet
  for (char32_t cp : d) {
    const int cls = combining_class(cp);
    if (last_class >= 0 && (last_class == 0 ? r.size() - 1 == starter : last_class < cls)) {
      const char32_t c = compose(r[starter], cp);
      if (c) {
        r[starter] = c;
        continue;
      }
    }
    if (cls == 0) {
      starter = r.size();
      last_class = 0;
    } else if (last_class >= 0) {
      last_class = cls;
    }
    r.push_back(cp);
  }
  std::string out;
  out.reserve(s.size());
  for (char32_t cp : r) append_utf8(out, cp);
  return out;
}

}  // namespace zero3d::text
