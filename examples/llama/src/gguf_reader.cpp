// SPDX-License-Identifier: Apache-2.0
// GGUF reader (written from ggml's docs/gguf.md) and the llama config/tokenizer extraction.
#include "gguf_reader.hpp"

#include "mapped_file.hpp"

#include <medusa/half.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

static_assert(std::endian::native == std::endian::little, "GGUF files are read as little-endian");

namespace medusa_llama::detail {

namespace {

constexpr std::uint64_t kMaxKeyBytes = 65535;   // docs/gguf.md: keys are at most 2^16 - 1 bytes
constexpr std::uint64_t kMaxNameBytes = 64;     // docs/gguf.md: tensor names are at most 64 bytes
constexpr std::uint32_t kMaxDims = 4;
constexpr int kMaxArrayDepth = 8;               // nested arrays deeper than this are refused
constexpr std::uint64_t kMinKvBytes = 8 + 4 + 1;          // key length, type, smallest value
constexpr std::uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // name length, n_dims, 1 dim, type, offset

struct type_traits {
  const char* name = nullptr;  // nullptr: not a ggml type
  std::uint32_t block = 0;     // elements per block
  std::uint32_t bytes = 0;     // bytes per block
};

// ggml's tensor types (ggml.h, ggml-common.h block sizes); ids 4, 5, 31-33, 36-38 are retired.
constexpr std::array<type_traits, 40> kTypes = [] {
  std::array<type_traits, 40> t{};
  t[0] = {"F32", 1, 4};
  t[1] = {"F16", 1, 2};
  t[2] = {"Q4_0", 32, 18};
  t[3] = {"Q4_1", 32, 20};
  t[6] = {"Q5_0", 32, 22};
  t[7] = {"Q5_1", 32, 24};
  t[8] = {"Q8_0", 32, 34};
  t[9] = {"Q8_1", 32, 36};
  t[10] = {"Q2_K", 256, 84};
  t[11] = {"Q3_K", 256, 110};
  t[12] = {"Q4_K", 256, 144};
  t[13] = {"Q5_K", 256, 176};
  t[14] = {"Q6_K", 256, 210};
  t[15] = {"Q8_K", 256, 292};
  t[16] = {"IQ2_XXS", 256, 66};
  t[17] = {"IQ2_XS", 256, 74};
  t[18] = {"IQ3_XXS", 256, 98};
  t[19] = {"IQ1_S", 256, 50};
  t[20] = {"IQ4_NL", 32, 18};
  t[21] = {"IQ3_S", 256, 110};
  t[22] = {"IQ2_S", 256, 82};
  t[23] = {"IQ4_XS", 256, 136};
  t[24] = {"I8", 1, 1};
  t[25] = {"I16", 1, 2};
  t[26] = {"I32", 1, 4};
  t[27] = {"I64", 1, 8};
  t[28] = {"F64", 1, 8};
  t[29] = {"IQ1_M", 256, 56};
  t[30] = {"BF16", 1, 2};
  t[34] = {"TQ1_0", 256, 54};
  t[35] = {"TQ2_0", 256, 66};
  return t;
}();

const type_traits* traits_of(std::uint32_t type) noexcept {
  if (type >= kTypes.size() || kTypes[type].name == nullptr) return nullptr;
  return &kTypes[type];
}

// Bytes of one element of a fixed-size metadata value type, 0 for string / array / unknown.
std::uint64_t scalar_bytes(std::uint32_t type) noexcept {
  switch (static_cast<gguf_value_type>(type)) {
    case gguf_value_type::u8: case gguf_value_type::i8: case gguf_value_type::boolean: return 1;
    case gguf_value_type::u16: case gguf_value_type::i16: return 2;
    case gguf_value_type::u32: case gguf_value_type::i32: case gguf_value_type::f32: return 4;
    case gguf_value_type::u64: case gguf_value_type::i64: case gguf_value_type::f64: return 8;
    default: return 0;
  }
}

bool known_value_type(std::uint32_t type) noexcept { return type <= 12; }

bool is_signed(gguf_value_type t) noexcept {
  return t == gguf_value_type::i8 || t == gguf_value_type::i16 || t == gguf_value_type::i32 || t == gguf_value_type::i64;
}

// Checked a * b and a + b on uint64.
bool mul_overflows(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept { return __builtin_mul_overflow(a, b, &out); }
bool add_overflows(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept { return __builtin_add_overflow(a, b, &out); }

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char ch : s.substr(0, 80)) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += ch;
    }
  }
  if (s.size() > 80) out += "...";
  out += '"';
  return out;
}

template <class T>
T load(const unsigned char* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Reads the file front to back; every read checks the bytes left first.
class cursor {
 public:
  cursor(const gguf_file& f, std::span<const unsigned char> b) : f_(f), b_(b) {}
  [[nodiscard]] std::size_t pos() const noexcept { return pos_; }
  [[nodiscard]] std::uint64_t left() const noexcept { return b_.size() - pos_; }
  // Where we are, for messages ("the value of \"general.name\"").
  void context(std::string c) { ctx_ = std::move(c); }

  void need(std::uint64_t n, const char* what) const {
    if (n > left()) {
      std::string m = "file ends inside ";
      m += what;
      if (!ctx_.empty()) {
        m += " of ";
        m += ctx_;
      }
      m += " (offset ";
      m += std::to_string(pos_);
      m += ": ";
      m += std::to_string(n);
      m += " bytes needed, ";
      m += std::to_string(left());
      m += " left)";
      f_.fail(load_errc::truncated, m);
    }
  }
  template <class T>
  T get(const char* what) {
    need(sizeof(T), what);
    const T v = load<T>(b_.data() + pos_);
    pos_ += sizeof(T);
    return v;
  }
  void skip(std::uint64_t n, const char* what) {
    need(n, what);
    pos_ += static_cast<std::size_t>(n);
  }
  std::string_view str(const char* what, std::uint64_t max_len) {
    const auto n = get<std::uint64_t>(what);
    if (n > max_len) {
      std::string m = std::string(what) + " is " + std::to_string(n) + " bytes long, more than the " + std::to_string(max_len) + " allowed";
      if (!ctx_.empty()) {
        m += " (";
        m += ctx_;
        m += ")";
      }
      f_.fail(load_errc::bad_header, m);
    }
    need(n, what);
    const std::string_view s(reinterpret_cast<const char*>(b_.data() + pos_), static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }
  // A count of items of at least `min_bytes` each must fit in the bytes left.
  void bound(std::uint64_t count, std::uint64_t min_bytes, const char* what) const {
    if (count > left() / min_bytes) {
      std::string m = what;
      if (!ctx_.empty()) {
        m += " of ";
        m += ctx_;
      }
      m += " is ";
      m += std::to_string(count);
      m += ", but only ";
      m += std::to_string(left());
      m += " bytes are left (at least ";
      m += std::to_string(min_bytes);
      m += " per item)";
      f_.fail(load_errc::truncated, m);
    }
  }

 private:
  const gguf_file& f_;
  std::span<const unsigned char> b_;
  std::size_t pos_ = 0;
  std::string ctx_;
};

// Validates (and skips) one value of `type`; `key` names it in messages.
void skip_value(const gguf_file& f, cursor& c, std::uint32_t type, const std::string& key, int depth) {
  if (!known_value_type(type))
    f.fail(load_errc::bad_header, "key " + quote(key) + " has an array element of unknown value type " + std::to_string(type));
  const auto vt = static_cast<gguf_value_type>(type);
  if (vt == gguf_value_type::string) {
    (void)c.str("a string", std::numeric_limits<std::uint64_t>::max());
    return;
  }
  if (vt == gguf_value_type::array) {
    if (depth >= kMaxArrayDepth)
      f.fail(load_errc::bad_header, "key " + quote(key) + " nests arrays deeper than " + std::to_string(kMaxArrayDepth) + " levels");
    const auto elem = c.get<std::uint32_t>("an array element type");
    if (!known_value_type(elem))
      f.fail(load_errc::bad_header, "key " + quote(key) + " has an array of unknown value type " + std::to_string(elem));
    const auto n = c.get<std::uint64_t>("an array length");
    if (const auto sz = scalar_bytes(elem); sz != 0) {
      std::uint64_t bytes = 0;
      if (mul_overflows(n, sz, bytes) || bytes > c.left())
        f.fail(load_errc::truncated, "array of " + std::to_string(n) + " " + gguf_value_type_name(elem) + " in key " + quote(key) +
                                         " needs more than the " + std::to_string(c.left()) + " bytes left");
      c.skip(bytes, "an array");
      return;
    }
    c.bound(n, elem == static_cast<std::uint32_t>(gguf_value_type::string) ? 8 : 12, "the array length");
    for (std::uint64_t k = 0; k < n; ++k) skip_value(f, c, elem, key, depth + 1);
    return;
  }
  if (vt == gguf_value_type::boolean) {
    const auto b = c.get<std::uint8_t>("a bool");
    if (b > 1) f.fail(load_errc::bad_header, "key " + quote(key) + " has a bool of value " + std::to_string(b) + " (0 or 1 allowed)");
    return;
  }
  c.skip(scalar_bytes(type), "a value");
}

}  // namespace

std::string gguf_value_type_name(std::uint32_t type) {
  static const char* names[] = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
                                "bool", "string", "array", "uint64", "int64", "float64"};
  if (type <= 12) return names[type];
  return "type " + std::to_string(type);
}

std::string_view ggml_type_name(std::uint32_t type) noexcept {
  const auto* t = traits_of(type);
  return t == nullptr ? std::string_view{} : std::string_view(t->name);
}

std::string gguf_tensor::shape() const {
  std::string s = "[";
  for (std::uint32_t k = 0; k < n_dims; ++k) {
    if (k) s += ", ";
    s += std::to_string(dims[k]);
  }
  return s + "]";
}

std::optional<stored_type> stored_type_of(std::uint32_t type) noexcept {
  switch (type) {
    case 0: return stored_type::f32;
    case 1: return stored_type::f16;
    case 2: return stored_type::q4_0;
    case 8: return stored_type::q8_0;
    case 30: return stored_type::bf16;
    default: return std::nullopt;
  }
}

void gguf_file::fail(load_errc code, const std::string& what) const { throw load_error(code, what, origin_); }

gguf_file gguf_file::open(const std::filesystem::path& path) {
  auto map = std::make_shared<mapped_file>(path);
  gguf_file f;
  f.origin_ = path.string();
  f.bytes_ = std::span<const unsigned char>(map->data(), map->size());
  f.storage_ = std::move(map);
  f.parse();
  return f;
}

gguf_file gguf_file::from_bytes(std::span<const unsigned char> bytes, std::string origin) {
  gguf_file f;
  f.origin_ = std::move(origin);
  f.bytes_ = bytes;
  f.parse();
  return f;
}

void gguf_file::parse() {
  static constexpr unsigned char magic[4] = {'G', 'G', 'U', 'F'};
  const std::size_t have = bytes_.size() < 4 ? bytes_.size() : 4;
  if (have == 0) fail(load_errc::truncated, "empty file (a GGUF file starts with the magic \"GGUF\")");
  if (std::memcmp(bytes_.data(), magic, have) != 0) {
    std::string got;
    for (std::size_t k = 0; k < have; ++k) {
      static const char* hex = "0123456789abcdef";
      got += hex[bytes_[k] >> 4];
      got += hex[bytes_[k] & 15];
    }
    fail(load_errc::bad_header, "bad magic 0x" + got + ": not a GGUF file (expected \"GGUF\")");
  }
  cursor c(*this, bytes_);
  c.skip(4, "the magic");
  version_ = c.get<std::uint32_t>("the version");
  if (version_ != 2 && version_ != 3) {
    std::string m = "GGUF version " + std::to_string(version_) + " is not supported (only 2 and 3)";
    if (__builtin_bswap32(version_) <= 3) m += "; the file may be big-endian";
    fail(load_errc::unsupported, m);
  }
  const auto n_tensors = c.get<std::uint64_t>("the tensor count");
  const auto n_kv = c.get<std::uint64_t>("the metadata count");
  c.bound(n_kv, kMinKvBytes, "the metadata count");

  for (std::uint64_t k = 0; k < n_kv; ++k) {
    c.context("metadata entry " + std::to_string(k));
    const auto key = c.str("the key", kMaxKeyBytes);
    if (key.empty()) fail(load_errc::bad_header, "metadata entry " + std::to_string(k) + " has an empty key");
    gguf_kv kv;
    kv.key = std::string(key);
    if (kv_index_.count(kv.key) != 0) fail(load_errc::bad_header, "duplicate metadata key " + quote(key));
    c.context(quote(key));
    const auto type = c.get<std::uint32_t>("the value type");
    if (!known_value_type(type))
      fail(load_errc::bad_header, "key " + quote(key) + " has unknown value type " + std::to_string(type));
    kv.type = static_cast<gguf_value_type>(type);
    switch (kv.type) {
      case gguf_value_type::u8: kv.u = c.get<std::uint8_t>("the value"); break;
      case gguf_value_type::u16: kv.u = c.get<std::uint16_t>("the value"); break;
      case gguf_value_type::u32: kv.u = c.get<std::uint32_t>("the value"); break;
      case gguf_value_type::u64: kv.u = c.get<std::uint64_t>("the value"); break;
      case gguf_value_type::i8: kv.i = c.get<std::int8_t>("the value"); break;
      case gguf_value_type::i16: kv.i = c.get<std::int16_t>("the value"); break;
      case gguf_value_type::i32: kv.i = c.get<std::int32_t>("the value"); break;
      case gguf_value_type::i64: kv.i = c.get<std::int64_t>("the value"); break;
      case gguf_value_type::f32: kv.f = c.get<float>("the value"); break;
      case gguf_value_type::f64: kv.f = c.get<double>("the value"); break;
      case gguf_value_type::boolean:
        kv.u = c.get<std::uint8_t>("the value");
        if (kv.u > 1) fail(load_errc::bad_header, "key " + quote(key) + " is a bool of value " + std::to_string(kv.u) + " (0 or 1 allowed)");
        break;
      case gguf_value_type::string: kv.str = c.str("the string", std::numeric_limits<std::uint64_t>::max()); break;
      case gguf_value_type::array: {
        const auto elem = c.get<std::uint32_t>("the array element type");
        if (!known_value_type(elem))
          fail(load_errc::bad_header, "key " + quote(key) + " is an array of unknown value type " + std::to_string(elem));
        kv.elem = static_cast<gguf_value_type>(elem);
        kv.count = c.get<std::uint64_t>("the array length");
        kv.begin = c.pos();
        if (const auto sz = scalar_bytes(elem); sz != 0) {
          std::uint64_t bytes = 0;
          if (mul_overflows(kv.count, sz, bytes) || bytes > c.left())
            fail(load_errc::truncated, "key " + quote(key) + " announces " + std::to_string(kv.count) + " " + gguf_value_type_name(elem) +
                                           " values, more than the " + std::to_string(c.left()) + " bytes left hold");
          if (kv.elem == gguf_value_type::boolean) {
            for (std::uint64_t j = 0; j < kv.count; ++j)
              if (bytes_[c.pos() + j] > 1)
                fail(load_errc::bad_header, "key " + quote(key) + " element " + std::to_string(j) + " is a bool of value " +
                                                std::to_string(bytes_[c.pos() + j]));
          }
          c.skip(bytes, "the array");
        } else {
          c.bound(kv.count, kv.elem == gguf_value_type::string ? 8 : 12, "the array length");
          for (std::uint64_t j = 0; j < kv.count; ++j) skip_value(*this, c, elem, kv.key, 1);
        }
        break;
      }
    }
    kv_index_.emplace(kv.key, kvs_.size());
    kvs_.push_back(std::move(kv));
  }
  c.context({});

  if (find("general.alignment") != nullptr) {
    const auto v = get_int("general.alignment", 1, std::int64_t{1} << 30);
    if (!v || (*v & (*v - 1)) != 0)
      fail(load_errc::bad_header, "general.alignment " + std::to_string(v.value_or(0)) + " is not a power of two");
    alignment_ = static_cast<std::uint64_t>(*v);
  }

  c.bound(n_tensors, kMinTensorInfoBytes, "the tensor count");
  for (std::uint64_t k = 0; k < n_tensors; ++k) {
    c.context("tensor info " + std::to_string(k) + " (" + std::to_string(k + 1) + " of " + std::to_string(n_tensors) + ")");
    gguf_tensor t;
    const auto name = c.str("the tensor name", kMaxNameBytes);
    t.name = std::string(name);
    if (tensor_index_.count(t.name) != 0) fail(load_errc::bad_header, "duplicate tensor " + quote(name));
    c.context("tensor " + quote(name));
    t.n_dims = c.get<std::uint32_t>("the dimension count");
    if (t.n_dims < 1 || t.n_dims > kMaxDims)
      fail(load_errc::bad_header, "tensor " + quote(name) + " has " + std::to_string(t.n_dims) + " dimensions (1 to 4 allowed)");
    std::uint64_t elements = 1;
    bool overflow = false;
    for (std::uint32_t d = 0; d < t.n_dims; ++d) {
      t.dims[d] = c.get<std::uint64_t>("the dimensions");
      overflow = overflow || t.dims[d] > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
                 mul_overflows(elements, t.dims[d], elements);
    }
    if (overflow || elements > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail(load_errc::bad_header, "tensor " + quote(name) + " has dimensions " + t.shape() + " whose product overflows");
    t.elements = elements;
    t.type = c.get<std::uint32_t>("the tensor type");
    const auto* tr = traits_of(t.type);
    if (tr == nullptr)
      fail(load_errc::unsupported, "tensor " + quote(name) + " has unknown ggml type id " + std::to_string(t.type));
    if (t.dims[0] % tr->block != 0)
      fail(load_errc::bad_header, "tensor " + quote(name) + " of type " + tr->name + " has rows of " + std::to_string(t.dims[0]) +
                                      " elements, not a multiple of its block size " + std::to_string(tr->block));
    if (mul_overflows(elements / tr->block, tr->bytes, t.bytes))
      fail(load_errc::bad_header, "tensor " + quote(name) + " with dimensions " + t.shape() + " has a byte size that overflows");
    t.offset = c.get<std::uint64_t>("the data offset");
    if (t.offset % alignment_ != 0)
      fail(load_errc::bad_header, "tensor " + quote(name) + " has data offset " + std::to_string(t.offset) +
                                      ", not a multiple of the alignment " + std::to_string(alignment_));
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }
  c.context({});

  // The data section starts at the next multiple of the alignment.
  data_offset_ = (static_cast<std::uint64_t>(c.pos()) + alignment_ - 1) / alignment_ * alignment_;
  for (auto& t : tensors_) {
    std::uint64_t begin = 0, end = 0;
    if (add_overflows(data_offset_, t.offset, begin) || add_overflows(begin, t.bytes, end) || end > bytes_.size())
      fail(load_errc::truncated, "tensor " + quote(t.name) + " (" + std::string(ggml_type_name(t.type)) + " " + t.shape() + ", " +
                                     std::to_string(t.bytes) + " bytes at data offset " + std::to_string(t.offset) +
                                     ") extends past the end of the file (" + std::to_string(bytes_.size()) + " bytes, data section at " +
                                     std::to_string(data_offset_) + ")");
    t.offset = begin;
  }
  // No two tensors share bytes: the decoded model is then bounded by the file size.
  std::vector<const gguf_tensor*> by_offset;
  for (const auto& t : tensors_)
    if (t.bytes != 0) by_offset.push_back(&t);
  std::stable_sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) { return a->offset < b->offset; });
  for (std::size_t k = 1; k < by_offset.size(); ++k) {
    const auto& a = *by_offset[k - 1];
    const auto& b = *by_offset[k];
    if (a.offset + a.bytes > b.offset)
      fail(load_errc::bad_header, "tensors " + quote(a.name) + " and " + quote(b.name) + " overlap (bytes [" + std::to_string(a.offset) + ", " +
                                      std::to_string(a.offset + a.bytes) + ") and [" + std::to_string(b.offset) + ", " +
                                      std::to_string(b.offset + b.bytes) + "))");
  }
}

const gguf_kv* gguf_file::find(std::string_view key) const {
  auto it = kv_index_.find(std::string(key));
  return it == kv_index_.end() ? nullptr : &kvs_[it->second];
}

const gguf_tensor* gguf_file::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const gguf_kv* gguf_file::typed(std::string_view key, load_errc code, std::initializer_list<gguf_value_type> ok,
                                const char* expected) const {
  const gguf_kv* kv = find(key);
  if (kv == nullptr) return nullptr;
  for (auto t : ok)
    if (kv->type == t) return kv;
  std::string got = gguf_value_type_name(static_cast<std::uint32_t>(kv->type));
  if (kv->type == gguf_value_type::array) got += " of " + gguf_value_type_name(static_cast<std::uint32_t>(kv->elem));
  fail(code, "key " + quote(key) + " is " + got + ", expected " + expected);
}

const gguf_kv* gguf_file::typed_array(std::string_view key, load_errc code, std::initializer_list<gguf_value_type> ok,
                                      const char* expected) const {
  const gguf_kv* kv = find(key);
  if (kv == nullptr) return nullptr;
  if (kv->type == gguf_value_type::array)
    for (auto t : ok)
      if (kv->elem == t) return kv;
  std::string got = gguf_value_type_name(static_cast<std::uint32_t>(kv->type));
  if (kv->type == gguf_value_type::array) got += " of " + gguf_value_type_name(static_cast<std::uint32_t>(kv->elem));
  fail(code, "key " + quote(key) + " is " + got + ", expected an array of " + expected);
}

std::optional<std::int64_t> gguf_file::get_int(std::string_view key, std::int64_t lo, std::int64_t hi, load_errc code) const {
  using t = gguf_value_type;
  const gguf_kv* kv = typed(key, code, {t::u8, t::i8, t::u16, t::i16, t::u32, t::i32, t::u64, t::i64}, "an integer");
  if (kv == nullptr) return std::nullopt;
  const bool in_range = is_signed(kv->type) ? kv->i >= lo && kv->i <= hi
                                            : hi >= 0 && kv->u <= static_cast<std::uint64_t>(hi) &&
                                                  (lo <= 0 || kv->u >= static_cast<std::uint64_t>(lo));
  if (!in_range) {
    std::string m = "key " + quote(key) + " = ";
    m += is_signed(kv->type) ? std::to_string(kv->i) : std::to_string(kv->u);
    m += " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    fail(code, m);
  }
  return is_signed(kv->type) ? kv->i : static_cast<std::int64_t>(kv->u);
}

std::optional<double> gguf_file::get_float(std::string_view key, load_errc code) const {
  const gguf_kv* kv = typed(key, code, {gguf_value_type::f32, gguf_value_type::f64}, "a float");
  if (kv == nullptr) return std::nullopt;
  return kv->f;
}

std::optional<bool> gguf_file::get_bool(std::string_view key, load_errc code) const {
  const gguf_kv* kv = typed(key, code, {gguf_value_type::boolean}, "a bool");
  if (kv == nullptr) return std::nullopt;
  return kv->u != 0;
}

std::optional<std::string> gguf_file::get_string(std::string_view key, load_errc code) const {
  const gguf_kv* kv = typed(key, code, {gguf_value_type::string}, "a string");
  if (kv == nullptr) return std::nullopt;
  return std::string(kv->str);
}

std::optional<std::vector<std::string>> gguf_file::get_string_array(std::string_view key, load_errc code) const {
  const gguf_kv* kv = typed_array(key, code, {gguf_value_type::string}, "strings");
  if (kv == nullptr) return std::nullopt;
  std::vector<std::string> out;
  out.reserve(static_cast<std::size_t>(kv->count));  // bounded by the file size at parse time
  std::size_t p = kv->begin;
  for (std::uint64_t k = 0; k < kv->count; ++k) {  // validated by parse()
    const auto n = static_cast<std::size_t>(load<std::uint64_t>(bytes_.data() + p));
    out.emplace_back(reinterpret_cast<const char*>(bytes_.data() + p + 8), n);
    p += 8 + n;
  }
  return out;
}

std::optional<std::vector<float>> gguf_file::get_float_array(std::string_view key, load_errc code) const {
  const gguf_kv* kv = typed_array(key, code, {gguf_value_type::f32, gguf_value_type::f64}, "floats");
  if (kv == nullptr) return std::nullopt;
  std::vector<float> out(static_cast<std::size_t>(kv->count));
  const unsigned char* p = bytes_.data() + kv->begin;
  for (std::size_t k = 0; k < out.size(); ++k)
    out[k] = kv->elem == gguf_value_type::f32 ? load<float>(p + 4 * k) : static_cast<float>(load<double>(p + 8 * k));
  return out;
}

std::optional<std::vector<std::int32_t>> gguf_file::get_int_array(std::string_view key, load_errc code) const {
  using t = gguf_value_type;
  const gguf_kv* kv = typed_array(key, code, {t::u8, t::i8, t::u16, t::i16, t::u32, t::i32, t::u64, t::i64}, "integers");
  if (kv == nullptr) return std::nullopt;
  std::vector<std::int32_t> out(static_cast<std::size_t>(kv->count));
  const unsigned char* p = bytes_.data() + kv->begin;
  const auto sz = scalar_bytes(static_cast<std::uint32_t>(kv->elem));
  for (std::size_t k = 0; k < out.size(); ++k) {
    const unsigned char* e = p + sz * k;
    std::int64_t v = 0;
    bool fits = true;
    switch (kv->elem) {
      case t::u8: v = load<std::uint8_t>(e); break;
      case t::i8: v = load<std::int8_t>(e); break;
      case t::u16: v = load<std::uint16_t>(e); break;
      case t::i16: v = load<std::int16_t>(e); break;
      case t::u32: v = load<std::uint32_t>(e); break;
      case t::i32: v = load<std::int32_t>(e); break;
      case t::i64: v = load<std::int64_t>(e); break;
      default: {
        const auto u = load<std::uint64_t>(e);
        fits = u <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
        v = fits ? static_cast<std::int64_t>(u) : 0;
      }
    }
    if (!fits || v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max())
      fail(code, "key " + quote(key) + " element " + std::to_string(k) + " does not fit in int32");
    out[k] = static_cast<std::int32_t>(v);
  }
  return out;
}

void gguf_file::check_decodable(const gguf_tensor& t) const {
  if (stored_type_of(t.type)) return;
  const auto name = ggml_type_name(t.type);
  fail(load_errc::unsupported, "tensor " + quote(t.name) + " has type " + (name.empty() ? "id " + std::to_string(t.type) : std::string(name)) +
                                   "; supported: F32, F16, BF16, Q8_0, Q4_0");
}

void gguf_file::read_f32(const gguf_tensor& t, float* out) const {
  check_decodable(t);
  const auto st = stored_type_of(t.type);
  const unsigned char* p = bytes_.data() + t.offset;
  const auto n = static_cast<std::size_t>(t.elements);
  if (n == 0) return;
  switch (*st) {
    case stored_type::f32: std::memcpy(out, p, n * sizeof(float)); break;
    case stored_type::f16:
      for (std::size_t k = 0; k < n; ++k) out[k] = medusa::detail::half_bits_to_float(load<std::uint16_t>(p + 2 * k));
      break;
    case stored_type::bf16:
      for (std::size_t k = 0; k < n; ++k) out[k] = medusa::detail::bfloat16_bits_to_float(load<std::uint16_t>(p + 2 * k));
      break;
    case stored_type::q8_0:
      for (std::size_t b = 0; b < n / 32; ++b) {
        const unsigned char* blk = p + 34 * b;
        const float d = medusa::detail::half_bits_to_float(load<std::uint16_t>(blk));
        for (std::size_t j = 0; j < 32; ++j) out[32 * b + j] = static_cast<float>(static_cast<std::int8_t>(blk[2 + j])) * d;
      }
      break;
    case stored_type::q4_0:
      for (std::size_t b = 0; b < n / 32; ++b) {
        const unsigned char* blk = p + 18 * b;
        const float d = medusa::detail::half_bits_to_float(load<std::uint16_t>(blk));
        for (std::size_t j = 0; j < 16; ++j) {
          out[32 * b + j] = static_cast<float>((blk[2 + j] & 0x0F) - 8) * d;
          out[32 * b + j + 16] = static_cast<float>((blk[2 + j] >> 4) - 8) * d;
        }
      }
      break;
    case stored_type::mixed: break;
  }
}

// --- llama ----------------------------------------------------------------------------------------

namespace {

// True when `t` has exactly `want` as its leading dims (trailing dims of 1 are allowed).
bool shape_is(const gguf_tensor& t, std::initializer_list<std::uint64_t> want) {
  if (t.n_dims < want.size()) return false;
  std::size_t k = 0;
  for (auto w : want)
    if (t.dims[k++] != w) return false;
  for (; k < t.n_dims; ++k)
    if (t.dims[k] != 1) return false;
  return true;
}

}  // namespace

model_config gguf_llama_config(const gguf_file& f) {
  const auto arch = f.get_string("general.architecture");
  if (!arch) f.fail(load_errc::bad_header, "missing key \"general.architecture\"");
  if (*arch != "llama")
    f.fail(load_errc::unsupported, "general.architecture is " + quote(*arch) + "; only \"llama\" is supported");
  auto per_layer_check = [&](const char* key) {
    if (const gguf_kv* kv = f.find(key); kv != nullptr && kv->type == gguf_value_type::array)
      f.fail(load_errc::unsupported, std::string("key \"") + key + "\" is an array (per-layer values are not supported)");
  };
  constexpr std::int64_t kMax = std::int64_t{1} << 30;
  auto required = [&](const char* key) {
    per_layer_check(key);
    const auto v = f.get_int(key, 1, kMax);
    if (!v) f.fail(load_errc::bad_header, std::string("missing key \"") + key + "\"");
    return static_cast<int>(*v);
  };
  model_config c;
  c.dim = required("llama.embedding_length");
  c.hidden_dim = required("llama.feed_forward_length");
  c.n_layers = required("llama.block_count");
  c.n_heads = required("llama.attention.head_count");
  per_layer_check("llama.attention.head_count_kv");
  c.n_kv_heads = static_cast<int>(f.get_int("llama.attention.head_count_kv", 1, kMax).value_or(c.n_heads));
  c.seq_len = required("llama.context_length");
  const auto eps = f.get_float("llama.attention.layer_norm_rms_epsilon");
  if (!eps) f.fail(load_errc::bad_header, "missing key \"llama.attention.layer_norm_rms_epsilon\"");
  c.rms_eps = static_cast<float>(*eps);
  c.rope_theta = static_cast<float>(f.get_float("llama.rope.freq_base").value_or(10000.0));
  c.rope = rope_style::adjacent_pairs;  // convert_hf_to_gguf permutes q/k into llama.cpp's layout

  // Features the engine does not have.
  if (const auto type = f.get_string("llama.rope.scaling.type"); type && *type != "none")
    f.fail(load_errc::unsupported, "RoPE scaling " + quote(*type) + " (llama.rope.scaling.type) is not supported");
  for (const char* key : {"llama.rope.scaling.factor", "llama.rope.scale_linear"}) {
    const auto factor = f.get_float(key);
    if (factor && *factor != 0.0 && *factor != 1.0 && f.get_string("llama.rope.scaling.type").value_or("linear") != "none")
      f.fail(load_errc::unsupported, std::string("RoPE scaling factor ") + std::to_string(*factor) + " (" + key + ") is not supported");
  }
  if (const auto experts = f.get_int("llama.expert_count", 0, kMax); experts && *experts > 0)
    f.fail(load_errc::unsupported, "mixture of experts (llama.expert_count = " + std::to_string(*experts) + ") is not supported");
  if (f.find_tensor("rope_freqs.weight") != nullptr)
    f.fail(load_errc::unsupported, "tensor \"rope_freqs.weight\" (RoPE frequency scaling) is not supported");

  const gguf_tensor* emb = f.find_tensor("token_embd.weight");
  if (emb == nullptr) f.fail(load_errc::missing_tensor, "tensor \"token_embd.weight\" is missing");
  if (emb->n_dims < 2 || !shape_is(*emb, {emb->dims[0], emb->dims[1]}) || emb->dims[0] != static_cast<std::uint64_t>(c.dim))
    f.fail(load_errc::size_mismatch, "tensor \"token_embd.weight\" has dims " + emb->shape() + ", expected [" + std::to_string(c.dim) +
                                         ", vocab] (GGUF dims are innermost first)");
  if (emb->dims[1] == 0 || emb->dims[1] > static_cast<std::uint64_t>(kMax))
    f.fail(load_errc::bad_header, "tensor \"token_embd.weight\" has " + std::to_string(emb->dims[1]) + " rows, not a vocabulary size");
  c.vocab_size = static_cast<int>(emb->dims[1]);
  if (const auto v = f.get_int("llama.vocab_size", 1, kMax); v && *v != c.vocab_size)
    f.fail(load_errc::bad_header, "llama.vocab_size = " + std::to_string(*v) + " but token_embd.weight has " +
                                      std::to_string(c.vocab_size) + " rows");
  c.shared_classifier = f.find_tensor("output.weight") == nullptr;
  c.validate(f.origin());
  for (const char* key : {"llama.attention.key_length", "llama.attention.value_length"}) {
    if (const auto v = f.get_int(key, 1, kMax); v && *v != c.head_dim())
      f.fail(load_errc::unsupported, std::string(key) + " = " + std::to_string(*v) + " differs from embedding_length / head_count = " +
                                         std::to_string(c.head_dim()));
  }
  if (const auto rd = f.get_int("llama.rope.dimension_count", 0, kMax); rd && *rd != c.head_dim())
    f.fail(load_errc::unsupported, "llama.rope.dimension_count = " + std::to_string(*rd) + " differs from the head size " +
                                       std::to_string(c.head_dim()) + " (partial RoPE is not supported)");
  return c;
}

std::unique_ptr<llama2c_tokenizer> gguf_llama_tokenizer(const gguf_file& f, int vocab_size, std::optional<bool> add_dummy_prefix) {
  constexpr auto bad = load_errc::bad_tokenizer;
  const auto kind = f.get_string("tokenizer.ggml.model", bad);
  if (!kind) f.fail(bad, "missing key \"tokenizer.ggml.model\" (the file has no tokenizer; pass one)");
  if (*kind != "llama") {
    std::string m = "tokenizer.ggml.model " + quote(*kind) + " is not supported (only \"llama\", SentencePiece)";
    if (*kind == "gpt2") m += "; byte-level BPE vocabularies are not implemented";
    f.fail(load_errc::unsupported, m);
  }
  auto tokens = f.get_string_array("tokenizer.ggml.tokens", bad);
  if (!tokens) f.fail(bad, "missing key \"tokenizer.ggml.tokens\"");
  const std::size_t n = tokens->size();
  if (n < 1 || n > (std::size_t{1} << 30)) f.fail(bad, "tokenizer.ggml.tokens has " + std::to_string(n) + " entries");
  if (vocab_size > 0 && n != static_cast<std::size_t>(vocab_size))
    f.fail(bad, "tokenizer has " + std::to_string(n) + " tokens, the model " + std::to_string(vocab_size));
  auto scores = f.get_float_array("tokenizer.ggml.scores", bad).value_or(std::vector<float>(n, 0.0f));
  if (scores.size() != n)
    f.fail(bad, "tokenizer.ggml.scores has " + std::to_string(scores.size()) + " entries, tokenizer.ggml.tokens " + std::to_string(n));
  const auto types = f.get_int_array("tokenizer.ggml.token_type", bad);
  if (types && types->size() != n)
    f.fail(bad, "tokenizer.ggml.token_type has " + std::to_string(types->size()) + " entries, tokenizer.ggml.tokens " + std::to_string(n));
  const auto hi = static_cast<std::int64_t>(n) - 1;
  auto id = [&](const char* key, std::int64_t fallback) {
    // llama.cpp writes -1 (as uint32 0xFFFFFFFF) for "none"; only BOS/EOS/unk matter here.
    const auto v = f.get_int(key, 0, std::numeric_limits<std::int64_t>::max(), bad);
    if (v && *v > hi) f.fail(bad, std::string(key) + " = " + std::to_string(*v) + " is outside the vocabulary of " + std::to_string(n));
    return static_cast<int>(v.value_or(fallback));
  };
  const int bos = id("tokenizer.ggml.bos_token_id", 1), eos = id("tokenizer.ggml.eos_token_id", 2);
  if (bos > hi || eos > hi) f.fail(bad, "vocabulary of " + std::to_string(n) + " tokens is too small for BOS and EOS (1, 2)");
  // No unknown token (absent, or llama.cpp's -1 written as uint32): bytes without a piece become 0.
  const auto unk_v = f.get_int("tokenizer.ggml.unknown_token_id", std::numeric_limits<std::int64_t>::min(),
                               std::numeric_limits<std::int64_t>::max(), bad);
  const int unk = unk_v && *unk_v >= 0 && *unk_v <= hi ? static_cast<int>(*unk_v) : 0;
  const bool prefix = add_dummy_prefix.value_or(f.get_bool("tokenizer.ggml.add_space_prefix", bad).value_or(true));
  std::vector<bool> control(n, false);
  for (std::size_t k = 0; k < n; ++k) {
    if (types && ((*types)[k] == 2 || (*types)[k] == 3)) control[k] = true;  // unknown, control
    // SentencePiece's space marker U+2581 is a space in llama2.c's pieces.
    auto& p = (*tokens)[k];
    std::string out;
    for (std::size_t i = 0; i < p.size();) {
      if (p.compare(i, 3, "\xE2\x96\x81") == 0) {
        out += ' ';
        i += 3;
      } else {
        out += p[i++];
      }
    }
    p = std::move(out);
  }
  control[static_cast<std::size_t>(bos)] = control[static_cast<std::size_t>(eos)] = control[static_cast<std::size_t>(unk)] = true;
  return std::make_unique<llama2c_tokenizer>(std::move(*tokens), std::move(scores), bos, eos, prefix, std::move(control), unk);
}

}  // namespace medusa_llama::detail
