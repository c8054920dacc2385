// SPDX-License-Identifier: Apache-2.0
// llama2.c and Hugging Face BPE tokenizers.
#include <medusa_llama/tokenizer.hpp>

#include "gguf_reader.hpp"
#include "json_int.hpp"

#include <nlohmann/json.hpp>

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <queue>
#include <utility>

namespace medusa_llama {

namespace {

// "<0xXX>" (upper or lower case hex) → XX, else -1.
int parse_byte_piece(std::string_view p) {
  if (p.size() != 6 || p.substr(0, 3) != "<0x" || p[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int hi = hex(p[3]), lo = hex(p[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw load_error(load_errc::open_failed, "cannot open", path.string());
  return std::string(std::istreambuf_iterator<char>(in), {});
}

const std::string kSpaceMarker = "\xE2\x96\x81";  // U+2581 "▁"

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  std::size_t i = 0;
  while (i < s.size()) {
    if (s.compare(i, from.size(), from) == 0) {
      out += to;
      i += from.size();
    } else {
      out += s[i++];
    }
  }
  return out;
}

// Merges adjacent tokens until no pair merges, the best pair first: the highest priority, the
// leftmost of equal ones (run.c's and the tokenizers library's order). `pair(left, right)` gives
// the priority and merged token of a pair that merges, or nothing. A rescan per merge, as run.c
// does, is quadratic in the text (a 100 KiB file took half a minute); here the candidate pairs
// wait in a heap and a pair whose tokens have since changed is dropped when it comes up. The
// tokens keep their order in a linked list, so "leftmost" is the smallest original index.
template <class Priority, class Pair>
std::vector<int> merge_best_pairs(std::vector<int> tokens, bool bos, int bos_id, bool eos, int eos_id, Pair&& pair) {
  const std::size_t n = tokens.size();
  std::vector<std::size_t> next(n), prev(n);
  std::vector<std::uint32_t> version(n, 0);  // bumped when a token changes or is merged away
  for (std::size_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i == 0 ? n : i - 1;
  }
  struct candidate {
    Priority priority;
    std::size_t left, right;
    std::uint32_t left_version, right_version;
    int merged;
  };
  const auto worse = [](const candidate& a, const candidate& b) {
    return a.priority < b.priority || (a.priority == b.priority && a.left > b.left);
  };
  std::priority_queue<candidate, std::vector<candidate>, decltype(worse)> heap(worse);
  const auto offer = [&](std::size_t left) {
    if (left >= n || next[left] >= n) return;
    const std::size_t right = next[left];
    if (const std::optional<std::pair<Priority, int>> m = pair(tokens[left], tokens[right]))
      heap.push({m->first, left, right, version[left], version[right], m->second});
  };
  for (std::size_t i = 0; i + 1 < n; ++i) offer(i);
  while (!heap.empty()) {
    const candidate c = heap.top();
    heap.pop();
    // Stale: either token changed or was merged away (a changed next[left] bumps left's version).
    if (version[c.left] != c.left_version || version[c.right] != c.right_version) continue;
    tokens[c.left] = c.merged;
    ++version[c.left];
    ++version[c.right];
    next[c.left] = next[c.right];
    if (next[c.left] < n) prev[next[c.left]] = c.left;
    offer(c.left);
    if (prev[c.left] < n) offer(prev[c.left]);
  }
  std::vector<int> out;
  out.reserve(n + 2);
  if (bos) out.push_back(bos_id);
  for (std::size_t i = 0; i < n; i = next[i]) out.push_back(tokens[i]);
  if (eos) out.push_back(eos_id);
  return out;
}

}  // namespace

// --- llama2.c -------------------------------------------------------------------------------------

llama2c_tokenizer::llama2c_tokenizer(const std::filesystem::path& path, int vocab_size, bool add_dummy_prefix)
    : dummy_prefix_(add_dummy_prefix) {
  const std::string p = path.string();
  if (vocab_size < 0) throw load_error(load_errc::bad_tokenizer, "negative vocab_size " + std::to_string(vocab_size), p);
  const std::string data = read_file(path);
  std::size_t off = 0;
  auto need = [&](std::size_t n, const char* what) {
    if (data.size() - off < n)
      throw load_error(load_errc::truncated, std::string("file ends inside ") + what + " of token " +
                                                    std::to_string(pieces_.size()) + " (offset " + std::to_string(off) + ")", p);
  };
  need(4, "the header");
  std::int32_t max_len = 0;
  std::memcpy(&max_len, data.data(), 4);
  off = 4;
  if (max_len <= 0 || max_len > (1 << 16))
    throw load_error(load_errc::bad_tokenizer, "max_token_length " + std::to_string(max_len) + " is out of range", p);
  while (vocab_size == 0 ? off < data.size() : pieces_.size() < static_cast<std::size_t>(vocab_size)) {
    need(8, "the score/length");
    float score;
    std::int32_t len;
    std::memcpy(&score, data.data() + off, 4);
    std::memcpy(&len, data.data() + off + 4, 4);
    off += 8;
    if (len < 0 || len > max_len)
      throw load_error(load_errc::bad_tokenizer, "token " + std::to_string(pieces_.size()) + " has length " +
                                                        std::to_string(len) + " outside [0, max_token_length " +
                                                        std::to_string(max_len) + "]", p);
    need(static_cast<std::size_t>(len), "the text");
    pieces_.emplace_back(data.data() + off, static_cast<std::size_t>(len));
    scores_.push_back(score);
    off += static_cast<std::size_t>(len);
  }
  if (off != data.size())
    throw load_error(load_errc::size_mismatch, std::to_string(data.size() - off) + " bytes follow the " +
                                                      std::to_string(pieces_.size()) + " tokens the model expects", p);
  if (pieces_.size() < 3) throw load_error(load_errc::bad_tokenizer, "fewer than 3 tokens (unk, BOS, EOS)", p);
  for (std::size_t i = 0; i < pieces_.size(); ++i) index_.emplace(pieces_[i], static_cast<int>(i));
  control_.assign(pieces_.size(), false);
  control_[0] = control_[1] = control_[2] = true;  // unk, BOS, EOS
  // run.c: a byte without a piece of its own is token byte + 3.
  for (int b = 0; b < 256; ++b) byte_ids_[b] = b + 3 < static_cast<int>(pieces_.size()) ? b + 3 : 0;
}

llama2c_tokenizer::llama2c_tokenizer(std::vector<std::string> pieces, std::vector<float> scores, int bos_id, int eos_id,
                                     bool add_dummy_prefix, std::vector<bool> control, int unk_id)
    : pieces_(std::move(pieces)), scores_(std::move(scores)), control_(std::move(control)), bos_(bos_id), eos_(eos_id),
      dummy_prefix_(add_dummy_prefix) {
  const std::string origin = "llama2c_tokenizer";
  const std::size_t n = pieces_.size();
  if (n == 0 || n > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    throw load_error(load_errc::bad_tokenizer, "vocabulary of " + std::to_string(n) + " pieces", origin);
  if (scores_.size() != n)
    throw load_error(load_errc::bad_tokenizer, std::to_string(scores_.size()) + " scores for " + std::to_string(n) + " pieces", origin);
  if (!control_.empty() && control_.size() != n)
    throw load_error(load_errc::bad_tokenizer, std::to_string(control_.size()) + " control flags for " + std::to_string(n) + " pieces", origin);
  for (const int id : {bos_id, eos_id, unk_id})
    if (id < 0 || static_cast<std::size_t>(id) >= n)
      throw load_error(load_errc::bad_tokenizer, "special token id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(n), origin);
  if (control_.empty()) {
    control_.assign(n, false);
    control_[static_cast<std::size_t>(unk_id)] = control_[static_cast<std::size_t>(bos_id)] = control_[static_cast<std::size_t>(eos_id)] = true;
  }
  // Control pieces ("<s>", "<unk>", ...) never come out of text.
  for (std::size_t i = 0; i < n; ++i)
    if (!control_[i]) index_.emplace(pieces_[i], static_cast<int>(i));
  static const char* hex = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    const char piece[7] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>', 0};
    const int id = lookup(piece);
    byte_ids_[b] = id >= 0 ? id : unk_id;
  }
}

const std::string& llama2c_tokenizer::piece(int token) const {
  if (token < 0 || token >= vocab_size())
    throw engine_error(engine_errc::bad_token, "token " + std::to_string(token) + " is outside [0, " + std::to_string(vocab_size()) + ")");
  return pieces_[static_cast<std::size_t>(token)];
}

float llama2c_tokenizer::score(int token) const {
  (void)piece(token);
  return scores_[static_cast<std::size_t>(token)];
}

int llama2c_tokenizer::lookup(std::string_view s) const {
  auto it = index_.find(std::string(s));
  return it == index_.end() ? -1 : it->second;
}

std::vector<int> llama2c_tokenizer::encode(std::string_view text, bool bos, bool eos) const {
  std::vector<int> tokens;
  tokens.reserve(text.size() + 3);
  if (dummy_prefix_ && !text.empty()) {
    if (int id = lookup(" "); id >= 0) tokens.push_back(id);
  }
  // Whole UTF-8 code points (at most 4 bytes) are looked up; misses become byte tokens (id = byte + 3).
  char buf[8];
  std::size_t len = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if ((c & 0xC0) != 0x80) len = 0;
    buf[len++] = static_cast<char>(c);
    const auto next = i + 1 < text.size() ? static_cast<unsigned char>(text[i + 1]) : 0u;
    if ((next & 0xC0) == 0x80 && len < 4) continue;
    if (int id = lookup(std::string_view(buf, len)); id >= 0) {
      tokens.push_back(id);
    } else {
      for (std::size_t b = 0; b < len; ++b) tokens.push_back(byte_ids_[static_cast<unsigned char>(buf[b])]);
    }
    len = 0;
  }
  // Merge the best-scoring adjacent pair until none merges (run.c: ties go to the leftmost pair; a
  // score must beat run.c's starting -1e10, which no NaN does).
  return merge_best_pairs<float>(std::move(tokens), bos, bos_, eos, eos_, [&](int left, int right) -> std::optional<std::pair<float, int>> {
    const int id = lookup(pieces_[static_cast<std::size_t>(left)] + pieces_[static_cast<std::size_t>(right)]);
    if (id < 0 || !(scores_[static_cast<std::size_t>(id)] > -1e10f)) return std::nullopt;
    return std::make_pair(scores_[static_cast<std::size_t>(id)], id);
  });
}

std::string llama2c_tokenizer::decode_piece(int prev, int token) const {
  const std::string& p = piece(token);
  if (control_[static_cast<std::size_t>(token)]) return {};  // unk, BOS, EOS and other control tokens
  std::string_view s = p;
  // run.c: after BOS the SentencePiece decoder strips the dummy-prefix space.
  if (dummy_prefix_ && prev == bos_ && !s.empty() && s[0] == ' ') s.remove_prefix(1);
  if (const int b = parse_byte_piece(s); b >= 0) return std::string(1, static_cast<char>(b));
  return std::string(s);
}

std::string run_c_printable(std::string piece) {
  if (piece.size() == 1) {
    const auto b = static_cast<unsigned char>(piece[0]);
    // C-locale isprint/isspace: ASCII only.
    const bool printable = (b >= 0x20 && b < 0x7f) || b == ' ' || (b >= '\t' && b <= '\r');
    if (!printable) return {};
  }
  return piece;
}

// --- Hugging Face ---------------------------------------------------------------------------------

hf_tokenizer::hf_tokenizer(const std::filesystem::path& path) {
  const std::string p = path.string();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw load_error(load_errc::bad_json, std::string("invalid JSON: ") + e.what(), p);
  }
  try {
    const auto& m = j.at("model");
    if (m.at("type").get<std::string>() != "BPE")
      throw load_error(load_errc::unsupported, "model type \"" + m.at("type").get<std::string>() + "\" (BPE only)", p);
    if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null())
      throw load_error(load_errc::unsupported, "pre_tokenizer " + j["pre_tokenizer"].dump() + " (only null is supported)", p);
    // Normalizer: nothing, or the Llama conversion Sequence[Prepend("▁"), Replace(" " → "▁")].
    prepend_ = false;
    bool replace_spaces = false;
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      const auto& n = j["normalizer"];
      std::vector<nlohmann::json> steps;
      if (n.at("type") == "Sequence") {
        for (const auto& s : n.at("normalizers")) steps.push_back(s);
      } else {
        steps.push_back(n);
      }
      for (const auto& s : steps) {
        if (s.at("type") == "Prepend" && s.at("prepend") == kSpaceMarker) prepend_ = true;
        else if (s.at("type") == "Replace" && s.at("pattern").value("String", "") == " " && s.at("content") == kSpaceMarker) replace_spaces = true;
        else throw load_error(load_errc::unsupported, "normalizer step " + s.dump(), p);
      }
    }
    if (!replace_spaces && prepend_) throw load_error(load_errc::unsupported, "Prepend without Replace(\" \")", p);
    const auto& vocab = m.at("vocab");
    if (!vocab.is_object() || vocab.empty()) throw load_error(load_errc::bad_tokenizer, "model.vocab is not a non-empty object", p);
    const std::size_t n = vocab.size();
    pieces_.assign(n, {});
    byte_of_.assign(n, -1);
    special_.assign(n, false);
    std::vector<bool> seen(n, false);
    for (const auto& [text, idj] : vocab.items()) {
      if (idj.is_number() && !detail::exact_int64(idj))
        throw load_error(load_errc::bad_tokenizer, "vocab id " + idj.dump() + " of \"" + text + "\" is not an integer in range", p);
      const auto id = idj.get<std::int64_t>();
      if (id < 0 || static_cast<std::size_t>(id) >= n || seen[static_cast<std::size_t>(id)])
        throw load_error(load_errc::bad_tokenizer, "vocab id " + std::to_string(id) + " of \"" + text + "\" is out of range or repeated", p);
      seen[static_cast<std::size_t>(id)] = true;
      vocab_.emplace(text, static_cast<int>(id));
      const auto u = static_cast<std::size_t>(id);
      byte_of_[u] = parse_byte_piece(text);
      pieces_[u] = replace_all(text, kSpaceMarker, " ");
    }
    std::fill(std::begin(byte_ids_), std::end(byte_ids_), -1);
    for (std::size_t i = 0; i < n; ++i)
      if (byte_of_[i] >= 0) byte_ids_[byte_of_[i]] = static_cast<int>(i);
    if (j.contains("added_tokens")) {
      for (const auto& a : j["added_tokens"]) {
        if (a.at("id").is_number() && !detail::exact_int64(a.at("id")))
          throw load_error(load_errc::bad_tokenizer, "added token id " + a.at("id").dump() + " is not an integer in range", p);
        const auto id = a.at("id").get<std::int64_t>();
        if (id < 0 || static_cast<std::size_t>(id) >= n)
          throw load_error(load_errc::bad_tokenizer, "added token id " + std::to_string(id) + " is outside the vocab of " + std::to_string(n), p);
        if (a.value("special", false)) special_[static_cast<std::size_t>(id)] = true;
      }
    }
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      auto it = vocab_.find(m["unk_token"].get<std::string>());
      if (it != vocab_.end()) unk_ = it->second;
    }
    // BOS: the first special token of the post-processor template, else "<s>", else 1.
    bos_ = 1;
    if (auto it = vocab_.find("<s>"); it != vocab_.end()) bos_ = it->second;
    if (j.contains("post_processor") && j["post_processor"].is_object() && j["post_processor"].contains("single")) {
      for (const auto& s : j["post_processor"]["single"]) {
        if (s.contains("SpecialToken")) {
          auto it = vocab_.find(s["SpecialToken"].at("id").get<std::string>());
          if (it != vocab_.end()) bos_ = it->second;
          break;
        }
      }
    }
    eos_ = 2;
    if (auto it = vocab_.find("</s>"); it != vocab_.end()) eos_ = it->second;
    if (static_cast<std::size_t>(bos_) >= n || static_cast<std::size_t>(eos_) >= n)
      throw load_error(load_errc::bad_tokenizer, "vocabulary too small for BOS/EOS", p);
    int rank = 0;
    for (const auto& mg : m.at("merges")) {
      std::string a, b;
      if (mg.is_string()) {
        const auto s = mg.get<std::string>();
        const auto sp = s.find(' ');
        if (sp == std::string::npos) throw load_error(load_errc::bad_tokenizer, "merge \"" + s + "\" has no space", p);
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        a = mg.at(0).get<std::string>();
        b = mg.at(1).get<std::string>();
      }
      auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
      if (ia == vocab_.end() || ib == vocab_.end() || iab == vocab_.end())
        throw load_error(load_errc::bad_tokenizer, "merge \"" + a + "\" + \"" + b + "\" uses a piece outside the vocab", p);
      const std::uint64_t key = (static_cast<std::uint64_t>(ia->second) << 32) | static_cast<std::uint32_t>(ib->second);
      merges_.emplace(key, std::make_pair(rank++, iab->second));
    }
  } catch (const nlohmann::json::exception& e) {
    throw load_error(load_errc::bad_json, std::string("unexpected tokenizer.json structure: ") + e.what(), p);
  }
}

std::vector<int> hf_tokenizer::encode(std::string_view text, bool bos, bool eos) const {
  std::string norm;
  if (prepend_ && !text.empty()) norm = kSpaceMarker;
  norm += prepend_ ? replace_all(text, " ", kSpaceMarker) : std::string(text);
  std::vector<int> sym;
  // Split into UTF-8 characters; an invalid byte is a character of its own.
  for (std::size_t i = 0; i < norm.size();) {
    const auto c = static_cast<unsigned char>(norm[i]);
    std::size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + len > norm.size()) len = 1;
    for (std::size_t k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(norm[i + k]) & 0xC0) != 0x80) len = 1;
    const std::string ch = norm.substr(i, len);
    if (auto it = vocab_.find(ch); it != vocab_.end()) {
      sym.push_back(it->second);
    } else {
      bool all_bytes = true;
      for (unsigned char b : ch) all_bytes = all_bytes && byte_ids_[b] >= 0;
      if (all_bytes) {
        for (unsigned char b : ch) sym.push_back(byte_ids_[b]);
      } else if (sym.empty() || sym.back() != unk_) {
        sym.push_back(unk_);  // fuse_unk: a run of unknown characters is one unk
      }
    }
    i += len;
  }
  // Lowest-rank merge first, leftmost on ties (equivalent to tokenizers' priority queue).
  return merge_best_pairs<std::int64_t>(std::move(sym), bos, bos_, eos, eos_, [&](int left, int right) -> std::optional<std::pair<std::int64_t, int>> {
    const std::uint64_t key = (static_cast<std::uint64_t>(left) << 32) | static_cast<std::uint32_t>(right);
    const auto it = merges_.find(key);
    if (it == merges_.end() || it->second.second < 0) return std::nullopt;
    return std::make_pair(-static_cast<std::int64_t>(it->second.first), it->second.second);
  });
}

std::string hf_tokenizer::decode_piece(int prev, int token) const {
  if (token < 0 || token >= vocab_size())
    throw engine_error(engine_errc::bad_token, "token " + std::to_string(token) + " is outside [0, " + std::to_string(vocab_size()) + ")");
  const auto u = static_cast<std::size_t>(token);
  if (special_[u]) return {};
  if (byte_of_[u] >= 0) return std::string(1, static_cast<char>(byte_of_[u]));
  std::string_view s = pieces_[u];
  const bool first = prev < 0 || (prev < vocab_size() && special_[static_cast<std::size_t>(prev)]);
  if (prepend_ && first && !s.empty() && s[0] == ' ') s.remove_prefix(1);  // the Strip decoder
  return std::string(s);
}

std::unique_ptr<llama2c_tokenizer> load_gguf_tokenizer(const std::filesystem::path& path, std::optional<bool> add_dummy_prefix) {
  return detail::gguf_llama_tokenizer(detail::gguf_file::open(path), 0, add_dummy_prefix);
}

std::unique_ptr<tokenizer> load_tokenizer(const std::filesystem::path& path, bool add_dummy_prefix) {
  if (path.extension() == ".json") return std::make_unique<hf_tokenizer>(path);
  if (is_gguf(path)) return load_gguf_tokenizer(path, add_dummy_prefix);
  return std::make_unique<llama2c_tokenizer>(path, 0, add_dummy_prefix);
}

std::string vocabulary_difference(const tokenizer& first, const tokenizer& second, std::string_view first_name,
                                  std::string_view second_name) {
  const std::string in_first = " in " + std::string(first_name), in_second = " in " + std::string(second_name);
  if (first.vocab_size() != second.vocab_size())
    return std::string(first_name) + " has " + std::to_string(first.vocab_size()) + " tokens, " + std::string(second_name) + " " +
           std::to_string(second.vocab_size());
  if (first.bos_id() != second.bos_id() || first.eos_id() != second.eos_id())
    return "BOS/EOS are " + std::to_string(first.bos_id()) + "/" + std::to_string(first.eos_id()) + in_first + " and " +
           std::to_string(second.bos_id()) + "/" + std::to_string(second.eos_id()) + in_second;
  auto quoted = [](const std::string& piece) {
    std::string q = "\"";
    for (unsigned char c : piece) {
      if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
        q += static_cast<char>(c);
      } else {
        char b[8];
        std::snprintf(b, sizeof b, "\\x%02x", c);
        q += b;
      }
    }
    return q + "\"";
  };
  // After an ordinary token, so that no BOS rule (run.c drops a leading space after BOS) applies.
  const int prev = first.bos_id() == 0 ? 1 : 0;
  for (int t = 0; t < first.vocab_size(); ++t) {
    const std::string a = first.decode_piece(prev, t), b = second.decode_piece(prev, t);
    if (a != b) return "token " + std::to_string(t) + " is " + quoted(a) + in_first + " and " + quoted(b) + in_second;
  }
  return {};
}

}  // namespace medusa_llama
