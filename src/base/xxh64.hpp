// xxh64.hpp — the project's one content digest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace zero3d {

// XXH64 (Yann Collet's xxHash, 64-bit; spec: github.com/Cyan4973/xxHash doc/xxhash_spec.md),
// streaming: the content digest of checkpoint files, agreed configurations and replicas. Not cryptographic — it catches damage and
// mix-ups, not an adversary.
class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const void* data, size_t n);
  uint64_t digest() const;

 private:
  void stripe(const unsigned char* p);
  uint64_t seed_, v_[4], total_ = 0;
  unsigned char buf_[32];
  size_t buf_len_ = 0;
};
uint64_t xxh64(const void* data, size_t n, uint64_t seed = 0);
// v as 16 lowercase hex digits.
std::string hex64(uint64_t v);

}  // namespace zero3d
