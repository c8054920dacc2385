// SPDX-License-Identifier: Apache-2.0
//! @file tokenizer.hpp
//! Tokenizers of the example engine: llama2.c `tokenizer.bin` (score-merge BPE, as run.c; also the
//! SentencePiece vocabulary of a GGUF file) and Hugging Face `tokenizer.json` BPE (ranked merges,
//! byte fallback, the Llama normalizer).
//!
//! @code
//! auto tok = medusa_llama::load_tokenizer("tok512.bin");
//! std::vector<int> ids = tok->encode("Once upon a time", /*bos=*/true, /*eos=*/false);
//! std::string text = tok->decode(ids);   // "Once upon a time"
//! @endcode
#pragma once

#include <medusa_llama/errors.hpp>

#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace medusa_llama {

//! Common interface of both tokenizer kinds.
class tokenizer {
 public:
  virtual ~tokenizer() = default;
  //! Token ids of `text`, with BOS first / EOS last when asked.
  [[nodiscard]] virtual std::vector<int> encode(std::string_view text, bool bos, bool eos) const = 0;
  //! The exact bytes of token `token` when it follows `prev` (-1: first token), as a streaming
  //! decoder prints them; special tokens (BOS, EOS, unk) give "".
  [[nodiscard]] virtual std::string decode_piece(int prev, int token) const = 0;
  //! Concatenated `decode_piece` over `ids`: `decode(encode(s, true, false)) == s` for texts the
  //! vocabulary covers.
  [[nodiscard]] std::string decode(std::span<const int> ids) const {
    std::string out;
    int prev = -1;
    for (int id : ids) {
      out += decode_piece(prev, id);
      prev = id;
    }
    return out;
  }
  //! Number of tokens.
  [[nodiscard]] virtual int vocab_size() const noexcept = 0;
  //! Begin-of-sequence id.
  [[nodiscard]] virtual int bos_id() const noexcept = 0;
  //! End-of-sequence id.
  [[nodiscard]] virtual int eos_id() const noexcept = 0;
};

//! llama2.c `tokenizer.bin`: int32 `max_token_length`, then per token float32 score, int32 length,
//! bytes. Encoding is run.c's: optional dummy-prefix space, code points looked up whole, else
//! `<0xXX>` byte tokens (id = byte + 3), then repeated merge of the adjacent pair whose
//! concatenation is the highest-scoring piece.
class llama2c_tokenizer final : public tokenizer {
 public:
  //! Loads `path`; `vocab_size` must match the model (pass 0 to accept the file's own count, which
  //! is then "every record up to the end of the file"). `add_dummy_prefix` is run.c's behaviour
  //! (prepend " " to non-empty text and strip a leading space after BOS when decoding); tokenizers
  //! exported without a dummy prefix (pycode-15m) want false.
  llama2c_tokenizer(const std::filesystem::path& path, int vocab_size, bool add_dummy_prefix = true);
  //! A vocabulary given in memory (e.g. a GGUF file's tokenizer.ggml.* arrays): `pieces` as
  //! tokenizer.bin stores them (SentencePiece's "▁" already replaced by a space, byte pieces as
  //! `<0xXX>`), one merge score each; `bos_id` / `eos_id` are prepended / appended by `encode`.
  //! `control` marks tokens that decode to "" and never come out of text (default: `unk_id`, BOS
  //! and EOS); `unk_id` stands for bytes that have no `<0xXX>` piece. Throws `load_error`
  //! (`bad_tokenizer`) on inconsistent sizes or ids.
  llama2c_tokenizer(std::vector<std::string> pieces, std::vector<float> scores, int bos_id, int eos_id,
                    bool add_dummy_prefix = true, std::vector<bool> control = {}, int unk_id = 0);

  [[nodiscard]] std::vector<int> encode(std::string_view text, bool bos, bool eos) const override;
  //! run.c's `decode`: after BOS a leading space is stripped (only with the dummy prefix), and
  //! `<0xXX>` pieces become the raw byte.
  [[nodiscard]] std::string decode_piece(int prev, int token) const override;
  [[nodiscard]] int vocab_size() const noexcept override { return static_cast<int>(pieces_.size()); }
  [[nodiscard]] int bos_id() const noexcept override { return bos_; }
  [[nodiscard]] int eos_id() const noexcept override { return eos_; }
  //! The stored text of a piece (byte pieces as `<0xXX>`). Throws `engine_error` when out of range.
  [[nodiscard]] const std::string& piece(int token) const;
  //! The merge score of a piece.
  [[nodiscard]] float score(int token) const;

 private:
  int lookup(std::string_view s) const;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> index_;
  std::vector<bool> control_;  // decode to ""
  int byte_ids_[256];          // the token of each byte that has no piece of its own
  int bos_ = 1, eos_ = 2;
  bool dummy_prefix_;
};

//! run.c's `safe_printf` filter: a piece that is one byte which is neither printable nor space
//! (in the C locale) is dropped. Applied to `decode_piece` output it reproduces what run.c prints.
[[nodiscard]] std::string run_c_printable(std::string piece);

//! Hugging Face `tokenizer.json` with a BPE model (the Llama/SentencePiece conversion): the
//! normalizer prepends "▁" and maps " " to "▁"; merges apply lowest rank first (leftmost on ties);
//! characters outside the vocabulary fall back to `<0xXX>` tokens if present, else to unk (runs of
//! unk fused). Added tokens written literally in the text are not split out (encoded as text).
class hf_tokenizer final : public tokenizer {
 public:
  //! Loads `path` (a tokenizer.json). Throws `load_error` on malformed files or non-BPE models.
  explicit hf_tokenizer(const std::filesystem::path& path);

  [[nodiscard]] std::vector<int> encode(std::string_view text, bool bos, bool eos) const override;
  //! The decoder chain (▁ → space, byte fallback, strip one leading space of the text): special
  //! tokens give "", and the first non-special piece loses one leading space.
  [[nodiscard]] std::string decode_piece(int prev, int token) const override;
  [[nodiscard]] int vocab_size() const noexcept override { return static_cast<int>(pieces_.size()); }
  [[nodiscard]] int bos_id() const noexcept override { return bos_; }
  [[nodiscard]] int eos_id() const noexcept override { return eos_; }

 private:
  struct pair_hash {
    std::size_t operator()(std::uint64_t v) const noexcept { return std::hash<std::uint64_t>{}(v); }
  };
  std::vector<std::string> pieces_;     // decoded text (▁ already replaced by space), "" for specials
  std::vector<int> byte_of_;            // byte value for <0xXX> pieces, else -1
  std::vector<bool> special_;
  std::unordered_map<std::string, int> vocab_;
  std::unordered_map<std::uint64_t, std::pair<int, int>, pair_hash> merges_;  // (a,b) -> (rank, merged)
  int byte_ids_[256];
  int unk_ = 0, bos_ = 1, eos_ = 2;
  bool prepend_ = true;
};

//! Where two tokenizers' vocabularies first differ, as a phrase naming the token ("token 7 is
//! \"ab\" in the draft and \"ac\" in the target" for the names "the draft", "the target"), or ""
//! when they are the same: the same size, BOS and EOS ids, and every token's bytes
//! (`decode_piece` after a non-BOS token). What a draft model must share with its target.
[[nodiscard]] std::string vocabulary_difference(const tokenizer& first, const tokenizer& second, std::string_view first_name = "the first",
                                                std::string_view second_name = "the second");

//! Opens a tokenizer by file name: `*.json` → `hf_tokenizer`; a GGUF file (see `is_gguf`) → the
//! `llama2c_tokenizer` of its tokenizer.ggml.* metadata (SentencePiece vocabularies only) with
//! `add_dummy_prefix`; anything else → a llama2.c `tokenizer.bin` (its own vocabulary size and
//! `add_dummy_prefix`).
[[nodiscard]] std::unique_ptr<tokenizer> load_tokenizer(const std::filesystem::path& path, bool add_dummy_prefix = true);

//! The tokenizer stored in a GGUF file (tokenizer.ggml.model "llama": tokens, scores, token types,
//! BOS/EOS ids). The dummy prefix is tokenizer.ggml.add_space_prefix (default true) unless
//! `add_dummy_prefix` is given. Throws `load_error`: `bad_tokenizer` for missing or inconsistent
//! keys, `unsupported` for other tokenizer models ("gpt2" byte-level BPE, ...).
[[nodiscard]] std::unique_ptr<llama2c_tokenizer> load_gguf_tokenizer(const std::filesystem::path& path,
                                                                     std::optional<bool> add_dummy_prefix = std::nullopt);

}  // namespace medusa_llama
