// SPDX-License-Identifier: Apache-2.0
// Tokenizers of the example Llama engine: round trips, reference encodings, malformed files.
#include <medusa_llama/tokenizer.hpp>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace medusa_llama;

namespace {

const fs::path shared_dir{MEDUSA_SHARED_DIR};
const fs::path tmp_dir{MEDUSA_TEST_TMPDIR};

bool have(const fs::path& p) {
  if (fs::exists(p)) return true;
  MESSAGE("skipped: " << p.string() << " is absent");
  return false;
}

// Texts with spaces at both ends, newlines, tabs, punctuation, multi-byte UTF-8, raw control
// bytes and invalid UTF-8.
std::vector<std::string> sample_texts() {
  std::vector<std::string> t = {
      "Once upon a time, there was a little girl named Lily.",
      " leading space",
      "trailing space ",
      "  two leading spaces",
      "line one\nline two\n\n",
      "\ttabs\tand\r\nCRLF",
      "def f(x):\n    return x * 2  # comment\n",
      "caf\xc3\xa9 na\xc3\xafve \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80",  // café naïve 日本語 😀
      std::string("\x01\x02\x7f bytes", 9),
      "\xff\xfe invalid utf8 \x80\x80",
      "a",
      " ",
      "!!!???...",
      "x = [1, 2, 3]; y = {'k': \"v\"}",
  };
  std::mt19937 rng(1234);
  for (int i = 0; i < 40; ++i) {
    std::string s;
    const int n = 1 + static_cast<int>(rng() % 60);
    for (int k = 0; k < n; ++k) {
      const auto r = rng() % 10;
      if (r < 6) s += static_cast<char>('a' + rng() % 26);
      else if (r < 8) s += ' ';
      else if (r < 9) s += "\n.,"[rng() % 3];
      else s += static_cast<char>(rng() % 256);  // any byte
    }
    t.push_back(s);
  }
  return t;
}

// One record of a llama2.c tokenizer.bin: float32 score, int32 length, the bytes.
std::string rec(float score, const std::string& text) {
  std::string r(8, '\0');
  const auto len = static_cast<std::int32_t>(text.size());
  std::memcpy(r.data(), &score, 4);
  std::memcpy(r.data() + 4, &len, 4);
  return r + text;
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("llama2c tokenizer: stories260K round trips and run.c conventions") {
  const auto path = shared_dir / "models/stories260K/tok512.bin";
  if (!have(path)) return;
  const llama2c_tokenizer tok(path, 512);
  CHECK(tok.vocab_size() == 512);
  for (const auto& s : sample_texts()) {
    const auto ids = tok.encode(s, true, false);
    REQUIRE(!ids.empty());
    CHECK(ids.front() == 1);
    CHECK_MESSAGE(tok.decode(ids) == s, "text: " << s);
    for (int id : ids) CHECK((id >= 0 && id < 512));
  }
  // run.c prepends the dummy-prefix space, then merges: " Once" is one piece of this vocab or a
  // few, and the first piece after BOS loses its space when decoded.
  const auto ids = tok.encode("Once", true, true);
  CHECK(ids.back() == 2);
  CHECK(tok.piece(ids[1])[0] == ' ');
  CHECK(tok.decode_piece(1, ids[1])[0] != ' ');
  CHECK(tok.encode("", true, false) == std::vector<int>{1});
  // Byte tokens decode to the byte; run.c's printer drops lone non-printable bytes.
  CHECK(tok.decode_piece(5, 3 + 0xC3) == "\xC3");
  CHECK(run_c_printable("\xC3").empty());
  CHECK(run_c_printable("\n") == "\n");
  CHECK(run_c_printable("ab") == "ab");
  CHECK_THROWS_AS((void)tok.decode_piece(1, 512), engine_error);
}

TEST_CASE("llama2c tokenizer: pycode-15m encodes the reference prompts exactly") {
  const auto dir = shared_dir / "models/pycode-15m";
  if (!have(dir / "tokenizer.bin")) return;
  const llama2c_tokenizer tok(dir / "tokenizer.bin", 2048, /*add_dummy_prefix=*/false);
  for (const auto& s : sample_texts()) CHECK_MESSAGE(tok.decode(tok.encode(s, true, false)) == s, "text: " << s);
  std::ifstream in(dir / "reference-greedy.json");
  const auto j = nlohmann::json::parse(in);
  for (const auto& c : j.at("cases")) {
    const auto prompt = c.at("prompt").get<std::string>();
    CHECK(tok.encode(prompt, true, false) == c.at("prompt_ids").get<std::vector<int>>());
    CHECK(tok.decode(c.at("greedy_ids").get<std::vector<int>>()) == c.at("greedy_text").get<std::string>());
  }
}

TEST_CASE("llama2c tokenizer: malformed files throw load_error") {
  const auto dir = tmp_dir / "llama_tok";
  fs::create_directories(dir);
  auto expect = [&](const std::string& bytes, load_errc code, int vocab) {
    write_bytes(dir / "t.bin", bytes);
    try {
      llama2c_tokenizer t(dir / "t.bin", vocab);
      FAIL("no exception");
    } catch (const load_error& e) {
      CHECK(e.code() == code);
      CHECK(std::string(e.what()).find("medusa: ") == 0);
    }
  };
  const std::string hdr("\x06\0\0\0", 4);
  const std::string good = hdr + rec(0, "<unk>") + rec(0, "<s>") + rec(0, "</s>") + rec(-1, "ab");
  write_bytes(dir / "ok.bin", good);
  CHECK(llama2c_tokenizer(dir / "ok.bin", 4).vocab_size() == 4);
  CHECK(llama2c_tokenizer(dir / "ok.bin", 0).vocab_size() == 4);
  expect("", load_errc::truncated, 4);
  expect(good.substr(0, good.size() - 1), load_errc::truncated, 4);
  expect(good, load_errc::truncated, 5);             // fewer records than the model's vocab
  expect(good + "x", load_errc::size_mismatch, 4);   // trailing bytes
  expect(hdr + rec(0, "toolong"), load_errc::bad_tokenizer, 1);
  expect(std::string("\0\0\0\0", 4), load_errc::bad_tokenizer, 0);
  CHECK_THROWS_AS(llama2c_tokenizer(dir / "missing.bin", 4), load_error);
}

namespace {

// run.c's merge loop, rescanning the sequence for each merge: the highest score, leftmost among
// equal scores. The reference the tokenizer's heap of pairs must reproduce.
std::vector<int> rescan_merges(const llama2c_tokenizer& tok, std::vector<int> t) {
  std::map<std::string, int> index;
  for (int id = 3; id < tok.vocab_size(); ++id) index.emplace(tok.piece(id), id);  // 0-2: control pieces
  for (;;) {
    float best = -1e10f;
    std::size_t at = t.size();
    int merged = -1;
    for (std::size_t i = 0; i + 1 < t.size(); ++i) {
      const auto it = index.find(tok.piece(t[i]) + tok.piece(t[i + 1]));
      if (it != index.end() && tok.score(it->second) > best) {
        best = tok.score(it->second);
        at = i;
        merged = it->second;
      }
    }
    if (at == t.size()) return t;
    t[at] = merged;
    t.erase(t.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
}

}  // namespace

TEST_CASE("llama2c tokenizer: merges equal run.c's rescanning loop, ties to the leftmost pair") {
  // Many equal scores, merges that compete for a token, and pieces reachable two ways.
  const std::vector<std::string> pieces{"<unk>", "<s>", "</s>", "a", "b", "c", " ", "ab", "bc", "ca", "aa",
                                        "abc", "cab", "aab", "bca", "  ", "a ", "aa ", "cc"};
  const std::vector<float> scores{0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 3, 3, 2, 2, 0.5f, 1, 2, -2e10f};
  const llama2c_tokenizer tok(pieces, scores, 1, 2, false, {}, 0);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    std::string text;
    std::vector<int> chars;
    const int length = 1 + static_cast<int>(rng() % 400);
    for (int i = 0; i < length; ++i) {
      const char c = "abc "[rng() % 4];
      text += c;
      chars.push_back(c == ' ' ? 6 : 3 + (c - 'a'));
    }
    CAPTURE(text);
    CHECK(tok.encode(text, false, false) == rescan_merges(tok, chars));
  }
  // A real vocabulary over a long text.
  const auto path = shared_dir / "models/pycode-15m/tokenizer.bin";
  if (!have(path)) return;
  const llama2c_tokenizer code(path, 0, false);
  std::string text;
  const std::string words[] = {"def ", "return ", "self", ".", "(", ")", ":\n", "    ", "x", "_", "1", " = ", "if ", "é", "€"};
  while (text.size() < 6000) text += words[rng() % std::size(words)];
  const std::vector<int> got = code.encode(text, false, false);
  std::string round_trip;
  for (const int id : got) round_trip += code.decode_piece(-1, id);
  CHECK(round_trip == text);
  // The reference starts, as encode does, from the text's code points (each one piece here, or its
  // bytes' pieces, which merge with nothing).
  std::vector<int> start;
  for (std::size_t i = 0; i < text.size();) {
    std::size_t len = 1;
    while (i + len < text.size() && (static_cast<unsigned char>(text[i + len]) & 0xC0) == 0x80) ++len;
    const std::vector<int> one = code.encode(text.substr(i, len), false, false);
    start.insert(start.end(), one.begin(), one.end());
    i += len;
  }
  CHECK(got == rescan_merges(code, start));
}

TEST_CASE("vocabulary_difference names the first token two vocabularies disagree on") {
  const auto dir = tmp_dir / "llama_vocab";
  fs::create_directories(dir);
  const std::string hdr("\x06\0\0\0", 4), base = hdr + rec(0, "<unk>") + rec(0, "<s>") + rec(0, "</s>") + rec(-1, "ab");
  write_bytes(dir / "a.bin", base + rec(-2, "cd"));
  write_bytes(dir / "same.bin", base + rec(-3, "cd"));  // scores differ, pieces do not
  write_bytes(dir / "other.bin", base + rec(-2, "c\n"));
  write_bytes(dir / "short.bin", base);
  const llama2c_tokenizer a(dir / "a.bin", 5), same(dir / "same.bin", 5), other(dir / "other.bin", 5), short_one(dir / "short.bin", 4);
  CHECK(vocabulary_difference(a, same).empty());
  CHECK(vocabulary_difference(a, other, "the draft", "the target") == "token 4 is \"cd\" in the draft and \"c\\x0a\" in the target");
  CHECK(vocabulary_difference(a, short_one, "the draft", "the target") == "the draft has 5 tokens, the target 4");
  // A real vocabulary against itself, read through two formats.
  const auto stories = shared_dir / "models/stories260K";
  if (!have(stories / "tok512.bin")) return;
  const auto t = load_tokenizer(stories / "tok512.bin");
  CHECK(vocabulary_difference(*t, *load_tokenizer(stories / "tok512.bin", false)).empty());
  if (have(stories / "stories260K.gguf"))  // the GGUF's own vocabulary, converted by llama.cpp's tools
    CHECK(vocabulary_difference(*t, *load_tokenizer(stories / "stories260K.gguf"), "the .bin", "the GGUF") == "");
}

TEST_CASE("hf tokenizer: tinystories-656K round trips and the Llama normalizer") {
  const auto path = shared_dir / "models/tinystories-656K/tokenizer.json";
  if (!have(path)) return;
  const hf_tokenizer tok(path);
  CHECK(tok.vocab_size() == 2048);
  CHECK(tok.bos_id() == 1);
  // This vocabulary has no byte tokens: only texts over its characters round-trip.
  const std::vector<std::string> texts = {
      "Once upon a time, there was a little girl named Lily.",
      "She had a toy car that she loved very much.\nOne day, she went to the park!",
      " leading and  double  spaces ",
      "\"Can I play?\" asked Tim. 'Yes,' said Mom; 42 - 7: 35?",
      "a",
  };
  for (const auto& s : texts) {
    const auto ids = tok.encode(s, true, false);
    REQUIRE(ids.size() >= 2);
    CHECK(ids.front() == 1);
    CHECK(std::find(ids.begin() + 1, ids.end(), 0) == ids.end());  // no unk
    CHECK_MESSAGE(tok.decode(ids) == s, "text: " << s);
  }
  // Pieces carry the word-final marker: "Once upon a time," starts "▁" then "Once▁" ...
  const auto ids = tok.encode("Once upon a time", false, false);
  CHECK(tok.decode(ids) == "Once upon a time");
  CHECK(ids.size() < 8);  // merges happened
  // A character outside the vocabulary becomes unk (fused per run).
  const auto u = tok.encode("a\xe6\x97\xa5\xe6\x9c\xac", false, false);
  CHECK(std::count(u.begin(), u.end(), 0) == 1);
}

TEST_CASE("hf tokenizer: malformed tokenizer.json throws load_error") {
  const auto dir = tmp_dir / "llama_tok";
  fs::create_directories(dir);
  auto expect = [&](const std::string& text, load_errc code) {
    write_bytes(dir / "t.json", text);
    try {
      hf_tokenizer t(dir / "t.json");
      FAIL("no exception");
    } catch (const load_error& e) {
      CHECK(e.code() == code);
    }
  };
  expect("{not json", load_errc::bad_json);
  expect(R"({"model": {"type": "Unigram", "vocab": []}})", load_errc::unsupported);
  expect(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 5}, "merges": []}})", load_errc::bad_tokenizer);
  expect(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2}, "merges": ["a x"]}})", load_errc::bad_tokenizer);
  expect(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2}}})", load_errc::bad_json);
  // Ids must be integers that fit: 1e300 once reached an unchecked double-to-int conversion
  // (tests/fuzz/regressions/tokenizer_json), 1.5 was silently truncated.
  expect(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1e300, "c": 2}, "merges": []}})", load_errc::bad_tokenizer);
  expect(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1.5, "c": 2}, "merges": []}})", load_errc::bad_tokenizer);
  expect(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 18446744073709551615, "c": 2}, "merges": []}})", load_errc::bad_tokenizer);
  expect(R"({"added_tokens": [{"id": -1e300}], "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2}, "merges": []}})",
         load_errc::bad_tokenizer);
  write_bytes(dir / "ok.json", R"({"added_tokens": [{"id": 1, "content": "<s>", "special": true}, {"id": 2, "content": "</s>", "special": true}],
                                "model": {"type": "BPE", "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "ab": 5}, "merges": ["a b"]}})");
  const hf_tokenizer ok(dir / "ok.json");
  CHECK(ok.encode("abab", false, false) == std::vector<int>{5, 5});
  CHECK(ok.decode(ok.encode("abba", true, true)) == "abba");
  (void)read_bytes;
}
