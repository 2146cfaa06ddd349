#!/usr/bin/env node
// tokenizer_speed_js.js — the peer figure for bench_tokenizer.cpp: js-tiktoken's gpt2 encoding
// (and, given a tokenizer.json, @huggingface/tokenizers) on the same text, best of N rounds.
//   node tokenizer_speed_js.js <build/npm/node_modules> TEXT [ROUNDS] [tokenizer.json]
"use strict";
const fs = require("fs");
const path = require("path");
const { createRequire } = require("module");
const [modules, textPath, roundsArg, tokenizerJson] = process.argv.slice(2);
const req = createRequire(path.resolve(modules) + "/");
const text = fs.readFileSync(textPath, "utf8");
const bytes = Buffer.byteLength(text);
const rounds = Math.max(1, Number(roundsArg || 3));
function measure(name, encode) {
  let best = Infinity, tokens = 0;
  for (let r = 0; r < rounds; ++r) {
    const t0 = process.hrtime.bigint();
    tokens = encode(text).length;
    best = Math.min(best, Number(process.hrtime.bigint() - t0) / 1e9);
  }
  console.log(JSON.stringify({ encoder: name, bytes, tokens, seconds: +best.toFixed(4), mb_per_s: +(bytes / 1e6 / best).toFixed(2) }));
}
const { getEncoding } = req("js-tiktoken");
const enc = getEncoding("gpt2");
measure("js-tiktoken 1.0.21 gpt2", (t) => enc.encode(t, "all"));
if (tokenizerJson) {
  const { Tokenizer } = req("@huggingface/tokenizers");
  const tok = new Tokenizer(JSON.parse(fs.readFileSync(tokenizerJson, "utf8")), {});
  measure("@huggingface/tokenizers 0.2.0 (" + path.basename(path.dirname(tokenizerJson)) + ")",
          (t) => tok.encode(t, { add_special_tokens: false }).ids);
}
