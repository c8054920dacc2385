// SPDX-License-Identifier: Apache-2.0
// Private: a validating reader of GGUF files (versions 2 and 3, little-endian; ggml docs/gguf.md)
// over a read-only byte range, plus what the example engine takes from a "llama" GGUF: its
// model_config and its SentencePiece tokenizer.
//
// Parsing checks every count against the bytes left (a lying count never allocates), every string
// length, dimension products and byte sizes (checked multiplication), alignment, tensor ranges
// (inside the file, no two overlapping), duplicate keys and tensors, and every type id. Each
// failure is a `load_error` naming the key or tensor and the numbers. Tensor data decodes to
// float32 from F32, F16, BF16, Q8_0 and Q4_0.
#pragma once

#include <medusa_llama/errors.hpp>
#include <medusa_llama/model.hpp>
#include <medusa_llama/tokenizer.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace medusa_llama::detail {

//! Types of metadata values (gguf_metadata_value_type).
enum class gguf_value_type : std::uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7, string = 8, array = 9,
  u64 = 10, i64 = 11, f64 = 12,
};

//! Name of a metadata value type ("uint32", "string", ...; "type N" for unknown ids).
[[nodiscard]] std::string gguf_value_type_name(std::uint32_t type);

//! ggml tensor type ids this reader decodes.
enum class ggml_type : std::uint32_t { f32 = 0, f16 = 1, q4_0 = 2, q8_0 = 8, bf16 = 30 };

//! Name of a ggml tensor type ("F32", "Q6_K", ...), empty for ids ggml does not define.
[[nodiscard]] std::string_view ggml_type_name(std::uint32_t type) noexcept;

//! One metadata key-value pair. Scalars are decoded; strings point into the file; arrays keep
//! their element type, count and byte range (already validated) and decode on request.
struct gguf_kv {
  std::string key;
  gguf_value_type type = gguf_value_type::u8;
  std::uint64_t u = 0;       //!< unsigned integers and bool
  std::int64_t i = 0;        //!< signed integers
  double f = 0.0;            //!< floats
  std::string_view str;      //!< strings
  gguf_value_type elem = gguf_value_type::u8;  //!< arrays: element type
  std::uint64_t count = 0;   //!< arrays: number of elements
  std::size_t begin = 0;     //!< arrays: first byte of the elements
};

//! One tensor: name, dims (innermost first), ggml type and where its bytes are.
struct gguf_tensor {
  std::string name;
  std::uint32_t type = 0;
  std::uint32_t n_dims = 0;
  std::array<std::uint64_t, 4> dims = {1, 1, 1, 1};
  std::uint64_t elements = 0;
  std::uint64_t offset = 0;  //!< from the start of the file
  std::uint64_t bytes = 0;
  //! "[d0, d1, ...]".
  [[nodiscard]] std::string shape() const;
};

class gguf_file {
 public:
  //! Maps and parses `path`. Throws `load_error`.
  static gguf_file open(const std::filesystem::path& path);
  //! Parses `bytes`, which must outlive the result (nothing is copied); `origin` names it in errors.
  static gguf_file from_bytes(std::span<const unsigned char> bytes, std::string origin);

  [[nodiscard]] const std::string& origin() const noexcept { return origin_; }
  [[nodiscard]] std::uint32_t version() const noexcept { return version_; }
  [[nodiscard]] std::uint64_t alignment() const noexcept { return alignment_; }
  [[nodiscard]] std::uint64_t data_offset() const noexcept { return data_offset_; }
  [[nodiscard]] const std::vector<gguf_kv>& metadata() const noexcept { return kvs_; }
  [[nodiscard]] const std::vector<gguf_tensor>& tensors() const noexcept { return tensors_; }

  [[nodiscard]] const gguf_kv* find(std::string_view key) const;
  [[nodiscard]] const gguf_tensor* find_tensor(std::string_view name) const;

  // Typed access to metadata: std::nullopt when the key is absent; a value of another type throws
  // `load_error(code)` naming the key and both types.
  //! Any integer type, checked against [lo, hi].
  [[nodiscard]] std::optional<std::int64_t> get_int(std::string_view key, std::int64_t lo, std::int64_t hi,
                                                    load_errc code = load_errc::bad_header) const;
  //! float32 or float64.
  [[nodiscard]] std::optional<double> get_float(std::string_view key, load_errc code = load_errc::bad_header) const;
  [[nodiscard]] std::optional<bool> get_bool(std::string_view key, load_errc code = load_errc::bad_header) const;
  [[nodiscard]] std::optional<std::string> get_string(std::string_view key, load_errc code = load_errc::bad_header) const;
  //! An array of strings.
  [[nodiscard]] std::optional<std::vector<std::string>> get_string_array(std::string_view key,
                                                                         load_errc code = load_errc::bad_header) const;
  //! An array of float32 or float64.
  [[nodiscard]] std::optional<std::vector<float>> get_float_array(std::string_view key,
                                                                  load_errc code = load_errc::bad_header) const;
  //! An array of any integer type (values outside int32 throw).
  [[nodiscard]] std::optional<std::vector<std::int32_t>> get_int_array(std::string_view key,
                                                                       load_errc code = load_errc::bad_header) const;

  //! The raw bytes of a tensor.
  [[nodiscard]] std::span<const unsigned char> data(const gguf_tensor& t) const noexcept {
    return bytes_.subspan(static_cast<std::size_t>(t.offset), static_cast<std::size_t>(t.bytes));
  }
  //! Decodes all `t.elements` values of `t` into `out` (F32, F16, BF16, Q8_0, Q4_0; other types
  //! throw `unsupported` naming the tensor and its type).
  void read_f32(const gguf_tensor& t, float* out) const;
  //! Throws what `read_f32` throws for a type it cannot decode.
  void check_decodable(const gguf_tensor& t) const;

  [[noreturn]] void fail(load_errc code, const std::string& what) const;

 private:
  gguf_file() = default;
  void parse();
  [[nodiscard]] const gguf_kv* typed(std::string_view key, load_errc code, std::initializer_list<gguf_value_type> ok,
                                     const char* expected) const;
  [[nodiscard]] const gguf_kv* typed_array(std::string_view key, load_errc code, std::initializer_list<gguf_value_type> ok,
                                           const char* expected) const;

  std::shared_ptr<const void> storage_;  // the mapping, when opened from a path
  std::span<const unsigned char> bytes_;
  std::string origin_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::uint64_t data_offset_ = 0;
  std::vector<gguf_kv> kvs_;
  std::vector<gguf_tensor> tensors_;
  std::unordered_map<std::string, std::size_t> kv_index_;
  std::unordered_map<std::string, std::size_t> tensor_index_;
};

//! The engine's stored_type of a ggml tensor type (F32, F16, BF16, Q8_0, Q4_0), nullopt for others.
[[nodiscard]] std::optional<stored_type> stored_type_of(std::uint32_t ggml_type) noexcept;

//! The model_config of a "llama" GGUF (general.architecture and llama.* keys, vocab from
//! token_embd.weight), validated. Throws `load_error`.
[[nodiscard]] model_config gguf_llama_config(const gguf_file& file);

//! The SentencePiece tokenizer of a GGUF (tokenizer.ggml.*; model "llama" only). `vocab_size` > 0
//! must match the token count; `add_dummy_prefix` overrides tokenizer.ggml.add_space_prefix.
//! Throws `load_error` (bad_tokenizer for missing or inconsistent keys, unsupported for other
//! tokenizer models).
[[nodiscard]] std::unique_ptr<llama2c_tokenizer> gguf_llama_tokenizer(const gguf_file& file, int vocab_size,
                                                                      std::optional<bool> add_dummy_prefix = std::nullopt);

}  // namespace medusa_llama::detail
