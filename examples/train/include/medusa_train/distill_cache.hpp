// SPDX-License-Identifier: Apache-2.0
//! @file distill_cache.hpp
//! The self-distillation cache: sequences of tokens the frozen base model emitted, each with the
//! final-normed hidden state of every position, in one file that training memory-maps.
//!
//! File layout (little-endian, see docs/training.md):
//!
//!     header (64 bytes): "MDSTILL1", u32 version, u32 dtype (0 f32, 2 bf16), u32 d, u32 V,
//!                        u64 records, u64 rows, u64 key hash, u64 complete flag, 8 reserved
//!     record:            u32 n, u32 split (0 train, 1 eval), u32 prompt_len, u32 reserved,
//!                        i32 tokens[n], hidden[n][d] (dtype), zero padding to 4 bytes
//!
//! Row j of a record is position `prompt_len − 1 + j` of the generated sequence: `tokens[j]` is
//! the token at that position and `hidden[j]` the state after it, so `tokens[j+1]` is the base
//! model's own next token and head k's target is `tokens[j+k+2]`.
//!
//! The file is written to a temporary name beside `path` and renamed when complete, so a crash
//! never leaves a file that looks valid. A JSON manifest beside it (`cache_key`) records what
//! produced the data.
//!
//! @code
//! medusa_train::distill_cache_writer w("c.bin", 384, 2048, medusa::weight_dtype::bf16, key.hash);
//! w.add(tokens, hidden, medusa_train::split::train, prompt_len);
//! w.finish();
//! auto c = medusa_train::distill_cache::open("c.bin");
//! @endcode
#pragma once

#include <medusa/error.hpp>
#include <medusa/gemm.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace medusa_train {

class distill_cache;

//! Which part of the data a sequence belongs to.
enum class split : std::uint32_t { train = 0, eval = 1 };

//! Streams records to a cache file (bounded memory: one record at a time).
class distill_cache_writer {
 public:
  //! Opens a temporary file beside `path` (`path.tmp-<pid>-<n>`) for writing. `dtype` is f32 or
  //! bf16 (f16 is refused: hidden states can exceed its range). Throws `medusa::io_error` /
  //! `medusa::invalid_input`.
  distill_cache_writer(std::filesystem::path path, std::size_t hidden, std::size_t vocab, medusa::weight_dtype dtype,
                       std::uint64_t key_hash);
  ~distill_cache_writer();
  distill_cache_writer(const distill_cache_writer&) = delete;
  distill_cache_writer& operator=(const distill_cache_writer&) = delete;

  //! Appends one sequence: `tokens` [n] and `hidden` [n][d] floats (n ≥ 1).
  void add(std::span<const std::int32_t> tokens, std::span<const float> hidden, split s, std::uint32_t prompt_len);
  //! Appends every record of `prior` byte for byte (it must have this writer's d, V and dtype,
  //! else `medusa::invalid_input`): how a cache cut short is continued.
  void append(const distill_cache& prior);
  //! Writes the header and renames the file to `as` (empty: the path given at construction; it
  //! must be in the same directory, for the rename to be atomic). Returns the path.
  std::filesystem::path finish(const std::filesystem::path& as = {});

  //! Records written so far.
  [[nodiscard]] std::uint64_t records() const noexcept { return records_; }
  //! Rows (positions) written so far.
  [[nodiscard]] std::uint64_t rows() const noexcept { return rows_; }
  //! Bytes written so far.
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }

 private:
  std::filesystem::path path_, tmp_;
  std::FILE* f_ = nullptr;
  std::size_t d_, v_;
  medusa::weight_dtype dtype_;
  std::uint64_t hash_, records_ = 0, rows_ = 0, bytes_ = 0;
  std::vector<unsigned char> buf_;
};

//! A read-only, memory-mapped cache file.
class distill_cache {
 public:
  //! One sequence.
  struct record {
    std::span<const std::int32_t> tokens;  //!< [n]
    const void* hidden = nullptr;          //!< [n][d] in `dtype()`
    split which = split::train;            //!< train or eval
    std::uint32_t prompt_len = 0;          //!< prompt tokens before row 0 (+1)
  };

  //! Maps `path` and validates the header and every record bound. Throws `medusa::io_error`
  //! (unreadable, truncated, incomplete or corrupt file).
  static distill_cache open(const std::filesystem::path& path);

  distill_cache(distill_cache&&) noexcept;
  distill_cache& operator=(distill_cache&&) noexcept;
  ~distill_cache();

  [[nodiscard]] std::size_t hidden_size() const noexcept { return d_; }        //!< d
  [[nodiscard]] std::size_t vocab_size() const noexcept { return v_; }         //!< V
  [[nodiscard]] medusa::weight_dtype dtype() const noexcept { return dtype_; } //!< hidden dtype
  [[nodiscard]] std::uint64_t key_hash() const noexcept { return hash_; }      //!< manifest hash
  [[nodiscard]] std::size_t size() const noexcept { return records_.size(); }  //!< records
  [[nodiscard]] std::uint64_t rows() const noexcept { return rows_; }          //!< total positions
  [[nodiscard]] std::uint64_t file_bytes() const noexcept { return bytes_; }   //!< file size
  //! Record `i` (unchecked).
  [[nodiscard]] const record& operator[](std::size_t i) const noexcept { return records_[i]; }
  //! Row `j` of record `i` converted to float into `out` [d].
  void load_hidden(std::size_t i, std::size_t j, float* out) const;
  //! Reads only the header: the key hash, or nothing when the file is missing/incomplete/foreign.
  static std::optional<std::uint64_t> peek_key(const std::filesystem::path& path);

 private:
  friend class distill_cache_writer;  // append() copies the records as mapped
  distill_cache() = default;
  void* map_ = nullptr;
  std::uint64_t bytes_ = 0;
  std::size_t d_ = 0, v_ = 0;
  medusa::weight_dtype dtype_ = medusa::weight_dtype::f32;
  std::uint64_t hash_ = 0, rows_ = 0;
  std::vector<record> records_;
};

//! What produced a cache: canonical JSON text of the inputs and its 64-bit FNV-1a hash.
struct cache_key {
  std::string json;        //!< manifest (one object)
  std::uint64_t hash = 0;  //!< FNV-1a 64 of `json`
  //! 16 hex digits of `hash`.
  [[nodiscard]] std::string hex() const;
};

//! Builds a `cache_key` from named values; files are recorded by their size and the FNV-1a-64 hash
//! of their bytes, so a copy or a touched file keeps its key and any changed byte changes it.
class cache_key_builder {
 public:
  //! Adds a string field.
  cache_key_builder& add(const std::string& name, const std::string& value);
  //! Adds a number field (recorded exactly: integers as integers, others with 17 digits).
  cache_key_builder& add(const std::string& name, double value);
  //! Adds a file (size, content hash); a missing or unreadable file throws `medusa::io_error`.
  cache_key_builder& add_file(const std::string& name, const std::filesystem::path& file);
  //! Adds a list of files under `root` (relative path, size, content hash each).
  cache_key_builder& add_files(const std::string& name, const std::filesystem::path& root,
                               const std::vector<std::filesystem::path>& files);
  //! The key.
  [[nodiscard]] cache_key build() const;

 private:
  std::vector<std::pair<std::string, std::string>> fields_;  // name, JSON value
};

//! FNV-1a 64-bit hash of `bytes`.
[[nodiscard]] std::uint64_t fnv1a64(std::string_view bytes) noexcept;

}  // namespace medusa_train
