// bench_tokenizer.cpp — tokenizer throughput on a text file: MB/s of encode(), a fresh tokenizer
// each round (so the piece cache starts cold, as js-tiktoken's encoder has none), best of N.
//   zero3d_tokenizer_bench TOKENIZER TEXT [ROUNDS]   -> one JSON line
// benchmarks/tokenizer_speed.sh runs it beside js-tiktoken on the same text.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "text/tokenizer.hpp"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s TOKENIZER TEXT [ROUNDS]\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[2], std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const int rounds = argc > 3 ? std::max(1, std::atoi(argv[3])) : 3;
  double best = 1e30, warm = 1e30;
  size_t tokens = 0;
  for (int r = 0; r < rounds; ++r) {
    const auto tok = zero3d::text::open_tokenizer(argv[1]);
    auto t0 = std::chrono::steady_clock::now();
    tokens = tok->encode(text).size();
    auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
    t0 = std::chrono::steady_clock::now();
    tok->encode(text);  // the same text again: every piece cached
    t1 = std::chrono::steady_clock::now();
    warm = std::min(warm, std::chrono::duration<double>(t1 - t0).count());
  }
  std::printf("{\"encoder\": \"zero3d\", \"bytes\": %zu, \"tokens\": %zu, \"seconds\": %.4f, \"mb_per_s\": %.2f, "
              "\"mb_per_s_cached\": %.2f}\n",
              text.size(), tokens, best, text.size() / 1e6 / best, text.size() / 1e6 / warm);
  return 0;
}
