// SPDX-License-Identifier: Apache-2.0
//! @file safetensors.hpp
//! Validating safetensors reader (memory-mapped or in-memory) and writer.
//!
//! Format: 8-byte little-endian header length `N`, `N` bytes of JSON
//! `{"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {..}}`,
//! then the data section; offsets are relative to the data section. The reader checks everything
//! before handing out a single byte: file size, header length, strict JSON, known dtypes, shape ×
//! dtype size == byte range, ranges inside the data section and not overlapping, string→string
//! metadata. Problems throw `safetensors_error` (an `invalid_input`) with a `safetensors_errc` and a
//! message naming the tensor; failing to open/read/write a file throws `io_error`.
//!
//! @code
//! medusa::safetensors_writer w;
//! std::vector<float> x{1, 2, 3};
//! w.add("x", medusa::safetensors_dtype::f32, {3}, std::as_bytes(std::span(x)));
//! auto file = medusa::safetensors_file::from_bytes(w.to_bytes());
//! const medusa::safetensors_tensor* t = file.find("x");   // t->shape == {3}
//! std::span<const std::byte> raw = file.data(*t);           // 12 bytes
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>
#include <medusa/io/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define MEDUSA_SAFETENSORS_MMAP 1
#else
#define MEDUSA_SAFETENSORS_MMAP 0
#endif

MEDUSA_NAMESPACE_BEGIN

//! Element types of the safetensors format.
enum class safetensors_dtype : std::uint8_t {
  f64, f32, f16, bf16, i64, i32, i16, i8, u64, u32, u16, u8, boolean, f8_e4m3, f8_e5m2
};

//! Size in bytes of one element of `t`.
constexpr std::size_t dtype_size(safetensors_dtype t) noexcept {
  switch (t) {
    case safetensors_dtype::f64: case safetensors_dtype::i64: case safetensors_dtype::u64: return 8;
    case safetensors_dtype::f32: case safetensors_dtype::i32: case safetensors_dtype::u32: return 4;
    case safetensors_dtype::f16: case safetensors_dtype::bf16: case safetensors_dtype::i16:
    case safetensors_dtype::u16: return 2;
    default: return 1;
  }
}

//! The format's name of `t` ("F32", "BF16", "BOOL", ...).
constexpr std::string_view dtype_name(safetensors_dtype t) noexcept {
  constexpr std::string_view names[] = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8",
                                        "U64", "U32", "U16", "U8", "BOOL", "F8_E4M3", "F8_E5M2"};
  return names[static_cast<std::size_t>(t)];
}

//! Parses a dtype name; `std::nullopt` when unknown.
constexpr std::optional<safetensors_dtype> parse_dtype_name(std::string_view name) noexcept {
  for (std::size_t i = 0; i <= static_cast<std::size_t>(safetensors_dtype::f8_e5m2); ++i) {
    const auto t = static_cast<safetensors_dtype>(i);
    if (dtype_name(t) == name) return t;
  }
  return std::nullopt;
}

//! What is wrong with a safetensors file.
enum class safetensors_errc : std::uint8_t {
  file_too_small,      //!< fewer than 8 bytes
  header_too_large,    //!< header length past the end of the file or above the size limit
  header_not_json,     //!< the header is not strict JSON
  header_not_object,   //!< the header is not a JSON object
  bad_entry,           //!< a tensor entry lacks dtype/shape/data_offsets or has wrong types/extra keys
  unknown_dtype,       //!< a dtype string the reader does not know
  size_mismatch,       //!< shape × dtype size != data_offsets range
  range_out_of_bounds, //!< a range ends past the data section or begins after it ends
  overlapping_ranges,  //!< two tensors share bytes
  bad_metadata,        //!< `__metadata__` is not an object of strings
  invalid_tensor,      //!< writer: empty/duplicate/reserved name, or data size != shape × dtype
};

//! Short name of an error code.
constexpr std::string_view to_string(safetensors_errc e) noexcept {
  constexpr std::string_view names[] = {"file_too_small", "header_too_large", "header_not_json",
                                        "header_not_object", "bad_entry", "unknown_dtype",
                                        "size_mismatch", "range_out_of_bounds", "overlapping_ranges",
                                        "bad_metadata", "invalid_tensor"};
  return names[static_cast<std::size_t>(e)];
}

//! A malformed safetensors file (or a bad writer call). `code()` says which rule was broken.
class safetensors_error : public coded_error<safetensors_errc> {
 public:
  //! @param code which rule was broken; @param what the message (prefixed with "safetensors: ").
  safetensors_error(safetensors_errc code, const std::string& what) : coded_error(code, "safetensors: " + what) {}
};

//! One tensor of a validated file. Offsets are relative to the data section.
struct safetensors_tensor {
  std::string name;                  //!< tensor name (key of the header)
  safetensors_dtype dtype{};         //!< element type
  std::vector<std::uint64_t> shape;  //!< dimensions, outermost first
  std::uint64_t begin = 0;           //!< first byte in the data section
  std::uint64_t end = 0;             //!< one past the last byte

  //! Number of elements (product of the shape; 1 for a scalar).
  [[nodiscard]] std::uint64_t numel() const noexcept {
    std::uint64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  //! Size in bytes.
  [[nodiscard]] std::uint64_t size_bytes() const noexcept { return end - begin; }
};

namespace detail {

inline constexpr std::uint64_t safetensors_max_header = 100ull << 20;  // as the reference crate

#if MEDUSA_SAFETENSORS_MMAP
// Owns one read-only mapping.
struct mmap_region {
  void* addr = nullptr;
  std::size_t size = 0;
  mmap_region() = default;
  mmap_region(const mmap_region&) = delete;
  mmap_region& operator=(const mmap_region&) = delete;
  ~mmap_region() {
    if (addr != nullptr) ::munmap(addr, size);
  }
};
#endif

}  // namespace detail

//! A validated safetensors file: tensor table, metadata and the bytes.
//!
//! Copies share the underlying storage (a memory map or a byte vector, reference counted), so a
//! copy or a `data()` span stays valid as long as any copy of the file object lives. Objects built
//! with `from_span` do not own the bytes: the caller keeps them alive.
class safetensors_file {
 public:
  //! Memory-maps `path` (read-only) and validates it. Throws `io_error` if the file cannot be
  //! opened or mapped, `safetensors_error` if it is malformed.
  static safetensors_file open(const std::filesystem::path& path) {
#if MEDUSA_SAFETENSORS_MMAP
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw io_error("cannot open " + path.string() + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw io_error("cannot read " + path.string() + ": not a regular file");
    }
    auto region = std::make_shared<detail::mmap_region>();
    region->size = static_cast<std::size_t>(st.st_size);
    if (region->size < 8) {
      ::close(fd);
      fail(safetensors_errc::file_too_small, path.string() + ": file has " + std::to_string(region->size) +
                                                 " bytes, fewer than the 8-byte header length");
    }
    {
      void* p = ::mmap(nullptr, region->size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        throw io_error("cannot map " + path.string() + ": " + std::strerror(errno));
      }
      region->addr = p;
    }
    ::close(fd);
    const std::span<const std::byte> bytes(static_cast<const std::byte*>(region->addr), region->size);
    try {
      return safetensors_file(bytes, std::shared_ptr<const void>(region, region->addr));
    } catch (const safetensors_error& e) {
      throw safetensors_error(e.code(), path.string() + ": " + strip(e.what()));
    }
#else
    std::ifstream in(path, std::ios::binary);
    if (!in) throw io_error("cannot open " + path.string());
    std::vector<std::byte> buf;
    in.seekg(0, std::ios::end);
    buf.resize(static_cast<std::size_t>(in.tellg()));
    in.seekg(0);
    in.read(reinterpret_cast<char*>(buf.data()), static_cast<std::streamsize>(buf.size()));
    if (!in) throw io_error("cannot read " + path.string());
    return from_bytes(std::move(buf));
#endif
  }

  //! Validates an in-memory file and takes ownership of the bytes.
  static safetensors_file from_bytes(std::vector<std::byte> bytes) {
    auto owner = std::make_shared<std::vector<std::byte>>(std::move(bytes));
    const std::span<const std::byte> view(owner->data(), owner->size());
    return safetensors_file(view, std::shared_ptr<const void>(owner, owner->data()));
  }

  //! Validates bytes the caller keeps alive (no copy; used by the fuzzer).
  static safetensors_file from_span(std::span<const std::byte> bytes) { return safetensors_file(bytes, nullptr); }

  //! Tensors sorted by their begin offset.
  [[nodiscard]] const std::vector<safetensors_tensor>& tensors() const noexcept { return tensors_; }
  //! The tensor called `name`, or nullptr.
  [[nodiscard]] const safetensors_tensor* find(std::string_view name) const noexcept {
    const auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                                     [&](std::size_t i, std::string_view n) { return tensors_[i].name < n; });
    if (it == by_name_.end() || tensors_[*it].name != name) return nullptr;
    return &tensors_[*it];
  }
  //! The bytes of `t` (which must come from this file's `tensors()`/`find()`).
  [[nodiscard]] std::span<const std::byte> data(const safetensors_tensor& t) const noexcept {
    return data_.subspan(static_cast<std::size_t>(t.begin), static_cast<std::size_t>(t.end - t.begin));
  }
  //! `__metadata__` entries in file order (empty when absent).
  [[nodiscard]] const std::vector<std::pair<std::string, std::string>>& metadata() const noexcept { return metadata_; }
  //! Size of the JSON header in bytes (excluding the 8-byte length).
  [[nodiscard]] std::uint64_t header_size() const noexcept { return header_size_; }

 private:
  static std::string strip(const char* what) {
    std::string s(what);
    for (std::string_view p : {"medusa: ", "safetensors: "})
      if (s.rfind(p, 0) == 0) s.erase(0, p.size());
    return s;
  }

  [[noreturn]] static void fail(safetensors_errc c, const std::string& what) { throw safetensors_error(c, what); }

  safetensors_file(std::span<const std::byte> bytes, std::shared_ptr<const void> keep) : keep_(std::move(keep)) {
    if (bytes.size() < 8)
      fail(safetensors_errc::file_too_small, "file has " + std::to_string(bytes.size()) + " bytes, fewer than the 8-byte header length");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(bytes[static_cast<std::size_t>(i)]);
    const std::uint64_t avail = bytes.size() - 8;
    if (n > avail)
      fail(safetensors_errc::header_too_large, "header length " + std::to_string(n) + " exceeds the " +
                                                   std::to_string(avail) + " bytes after the length field");
    if (n > detail::safetensors_max_header)
      fail(safetensors_errc::header_too_large, "header length " + std::to_string(n) + " exceeds the limit of " +
                                                   std::to_string(detail::safetensors_max_header) + " bytes");
    header_size_ = n;
    const std::string_view text(reinterpret_cast<const char*>(bytes.data()) + 8, static_cast<std::size_t>(n));
    data_ = bytes.subspan(8 + static_cast<std::size_t>(n));
    json_value header;
    try {
      header = parse_json(text);
    } catch (const json_error& e) {
      fail(safetensors_errc::header_not_json, "header is not valid JSON: " + strip(e.what()));
    }
    if (!header.is_object()) fail(safetensors_errc::header_not_object, "header is not a JSON object");
    parse_entries(header);
  }

  void parse_entries(const json_value& header) {
    for (std::size_t i = 0; i < header.size(); ++i) {
      const std::string& name = header.key(i);
      const json_value& v = header.value(i);
      if (name == "__metadata__") {
        parse_metadata(v);
        continue;
      }
      tensors_.push_back(parse_tensor(name, v));
    }
    std::sort(tensors_.begin(), tensors_.end(), [](const auto& a, const auto& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    // Sorted by begin, a non-empty range overlaps another one iff it overlaps its predecessor
    // with the largest end so far.
    const safetensors_tensor* reach = nullptr;
    for (const auto& t : tensors_) {
      if (t.begin == t.end) continue;
      if (reach != nullptr && t.begin < reach->end)
        fail(safetensors_errc::overlapping_ranges, "tensor '" + t.name + "' [" + std::to_string(t.begin) + ", " +
                                                       std::to_string(t.end) + ") overlaps tensor '" + reach->name + "' [" +
                                                       std::to_string(reach->begin) + ", " + std::to_string(reach->end) + ")");
      if (reach == nullptr || t.end > reach->end) reach = &t;
    }
    by_name_.resize(tensors_.size());
    for (std::size_t i = 0; i < by_name_.size(); ++i) by_name_[i] = i;
    std::sort(by_name_.begin(), by_name_.end(), [&](std::size_t a, std::size_t b) { return tensors_[a].name < tensors_[b].name; });
  }

  void parse_metadata(const json_value& v) {
    if (!v.is_object()) fail(safetensors_errc::bad_metadata, "__metadata__ is not an object");
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (!v.value(i).is_string())
        fail(safetensors_errc::bad_metadata, "__metadata__ entry '" + v.key(i) + "' is not a string");
      metadata_.emplace_back(v.key(i), v.value(i).as_string());
    }
  }

  safetensors_tensor parse_tensor(const std::string& name, const json_value& v) const {
    const std::string where = "tensor '" + name + "': ";
    if (!v.is_object()) fail(safetensors_errc::bad_entry, where + "entry is not an object");
    const json_value* dt = v.find("dtype");
    const json_value* shape = v.find("shape");
    const json_value* offs = v.find("data_offsets");
    if (dt == nullptr || shape == nullptr || offs == nullptr)
      fail(safetensors_errc::bad_entry, where + "needs dtype, shape and data_offsets");
    if (v.size() != 3) fail(safetensors_errc::bad_entry, where + "has keys other than dtype, shape and data_offsets");
    if (!dt->is_string()) fail(safetensors_errc::bad_entry, where + "dtype is not a string");
    safetensors_tensor t;
    t.name = name;
    const auto parsed = parse_dtype_name(dt->as_string());
    if (!parsed) fail(safetensors_errc::unknown_dtype, where + "unknown dtype \"" + dt->as_string() + "\"");
    t.dtype = *parsed;
    if (!shape->is_array()) fail(safetensors_errc::bad_entry, where + "shape is not an array");
    // Element count with overflow checks (a shape may claim 2^64 elements).
    std::uint64_t numel = 1;
    bool overflow = false;
    for (const auto& s : shape->as_array()) {
      const auto dim = s.as_uint64();
      if (!dim) fail(safetensors_errc::bad_entry, where + "shape entries must be non-negative integers");
      t.shape.push_back(*dim);
      if (*dim != 0 && numel > UINT64_MAX / *dim) overflow = true;
      numel *= *dim;
    }
    if (!offs->is_array() || offs->size() != 2)
      fail(safetensors_errc::bad_entry, where + "data_offsets is not an array of two integers");
    const auto b = offs->as_array()[0].as_uint64();
    const auto e = offs->as_array()[1].as_uint64();
    if (!b || !e) fail(safetensors_errc::bad_entry, where + "data_offsets are not non-negative integers");
    t.begin = *b;
    t.end = *e;
    if (t.begin > t.end)
      fail(safetensors_errc::range_out_of_bounds, where + "data_offsets [" + std::to_string(t.begin) + ", " +
                                                      std::to_string(t.end) + ") begin after they end");
    if (t.end > data_.size())
      fail(safetensors_errc::range_out_of_bounds, where + "data_offsets [" + std::to_string(t.begin) + ", " +
                                                      std::to_string(t.end) + ") end past the data section of " +
                                                      std::to_string(data_.size()) + " bytes");
    const std::uint64_t esize = dtype_size(t.dtype);
    if (overflow || numel > UINT64_MAX / esize || numel * esize != t.end - t.begin) {
      std::string shp = "[";
      for (std::size_t i = 0; i < t.shape.size(); ++i) { if (i) shp += ","; shp += std::to_string(t.shape[i]); }
      shp += "]";
      fail(safetensors_errc::size_mismatch, where + "shape " + shp + " of " + std::string(dtype_name(t.dtype)) +
                                                (overflow ? " overflows" : " needs " + std::to_string(numel * esize) + " bytes") +
                                                " but data_offsets cover " + std::to_string(t.end - t.begin));
    }
    return t;
  }

  std::shared_ptr<const void> keep_;
  std::span<const std::byte> data_;
  std::uint64_t header_size_ = 0;
  std::vector<safetensors_tensor> tensors_;
  std::vector<std::size_t> by_name_;
  std::vector<std::pair<std::string, std::string>> metadata_;
};

//! Builds a safetensors file from tensors the caller keeps alive until `write`/`to_bytes`.
//!
//! Layout follows the format's rules (and the reference writer): tensors ordered by descending
//! element size, then name, so every tensor is aligned to its element size; the header lists
//! `__metadata__` first, then the tensors by offset, and is padded with spaces so the data section
//! starts at a multiple of 8.
class safetensors_writer {
 public:
  //! Adds a tensor; `data.size()` must equal shape × dtype size. The bytes are not copied.
  void add(std::string name, safetensors_dtype dtype, std::vector<std::uint64_t> shape, std::span<const std::byte> data) {
    if (name.empty() || name == "__metadata__")
      throw safetensors_error(safetensors_errc::invalid_tensor, "invalid tensor name '" + name + "'");
    for (const auto& e : entries_)
      if (e.name == name) throw safetensors_error(safetensors_errc::invalid_tensor, "duplicate tensor name '" + name + "'");
    std::uint64_t n = dtype_size(dtype);
    for (auto s : shape) n *= s;
    if (n != data.size())
      throw safetensors_error(safetensors_errc::invalid_tensor, "tensor '" + name + "': " + std::to_string(data.size()) +
                                                                    " bytes given, shape needs " + std::to_string(n));
    entries_.push_back({std::move(name), dtype, std::move(shape), data});
  }
  //! Adds a `__metadata__` entry (string → string); a repeated key replaces the value.
  void add_metadata(std::string key, std::string value) {
    for (auto& kv : metadata_)
      if (kv.first == key) {
        kv.second = std::move(value);
        return;
      }
    metadata_.emplace_back(std::move(key), std::move(value));
  }

  //! The 8-byte length, the padded header: everything before the data section.
  [[nodiscard]] std::string header_bytes() const {
    std::string json = "{";
    bool first = true;
    if (!metadata_.empty()) {
      json += "\"__metadata__\":{";
      for (std::size_t i = 0; i < metadata_.size(); ++i)
        { if (i) json += ","; json += json_quote(metadata_[i].first) + ":" + json_quote(metadata_[i].second); }
      json += "}";
      first = false;
    }
    std::uint64_t offset = 0;
    for (const auto* e : layout()) {
      json += first ? "" : ",";
      first = false;
      json += json_quote(e->name) + ":{\"dtype\":\"" + std::string(dtype_name(e->dtype)) + "\",\"shape\":[";
      for (std::size_t i = 0; i < e->shape.size(); ++i) { if (i) json += ","; json += std::to_string(e->shape[i]); }
      json += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + e->data.size()) + "]}";
      offset += e->data.size();
    }
    json += "}";
    while (json.size() % 8 != 0) json += ' ';
    std::string out(8, '\0');
    std::uint64_t n = json.size();
    for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xffu);
    return out + json;
  }

  //! The whole file in memory.
  [[nodiscard]] std::vector<std::byte> to_bytes() const {
    const std::string head = header_bytes();
    std::vector<std::byte> out(head.size());
    std::memcpy(out.data(), head.data(), head.size());
    for (const auto* e : layout()) out.insert(out.end(), e->data.begin(), e->data.end());
    return out;
  }

  //! Writes the file (to `path.tmp`, then renames, so a crash never leaves a half file at `path`).
  //! On `io_error` the temporary file is removed and `path` is as it was.
  void write(const std::filesystem::path& path) const {
    std::filesystem::path tmp = path;
    tmp += ".tmp";
    std::error_code ec;
    auto fail = [&](const std::string& what) {
      std::filesystem::remove(tmp, ec);
      throw io_error(what);
    };
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      if (!out) throw io_error("cannot create " + tmp.string());  // nothing of ours to remove
      const std::string head = header_bytes();
      out.write(head.data(), static_cast<std::streamsize>(head.size()));
      for (const auto* e : layout())
        out.write(reinterpret_cast<const char*>(e->data.data()), static_cast<std::streamsize>(e->data.size()));
      out.flush();
      if (!out) {
        out.close();
        fail("cannot write " + tmp.string());
      }
    }
    std::filesystem::rename(tmp, path, ec);
    if (ec) fail("cannot rename " + tmp.string() + " to " + path.string() + ": " + ec.message());
  }

 private:
  struct entry {
    std::string name;
    safetensors_dtype dtype;
    std::vector<std::uint64_t> shape;
    std::span<const std::byte> data;
  };
  [[nodiscard]] std::vector<const entry*> layout() const {
    std::vector<const entry*> order;
    for (const auto& e : entries_) order.push_back(&e);
    std::sort(order.begin(), order.end(), [](const entry* a, const entry* b) {
      const auto sa = dtype_size(a->dtype), sb = dtype_size(b->dtype);
      return sa != sb ? sa > sb : a->name < b->name;
    });
    return order;
  }
  std::vector<entry> entries_;
  std::vector<std::pair<std::string, std::string>> metadata_;
};

MEDUSA_NAMESPACE_END
