// file_bytes.hpp — a file's bytes, and a safetensors file split into its JSON header and data
// (the format: an 8-byte little-endian header length, the header, then the tensors' bytes;
// huggingface/safetensors' README), for the tests that read what zero3d wrote.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

namespace zero3d::test {

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct Safetensors {
  nlohmann::json header;
  std::string data;
};

// An empty Safetensors (header null) when the file is shorter than its length prefix.
inline Safetensors read_safetensors(const std::string& path) {
  const std::string bytes = read_bytes(path);
  Safetensors s;
  if (bytes.size() < 8) return s;
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  s.header = nlohmann::json::parse(bytes.substr(8, n));
  s.data = bytes.substr(8 + n);
  return s;
}

}  // namespace zero3d::test
