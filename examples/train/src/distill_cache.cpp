// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/distill_cache.hpp>

#include <medusa/half.hpp>

#include "common.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string_view>
#include <system_error>
#include <vector>

namespace medusa_train {

namespace {

constexpr char magic[8] = {'M', 'D', 'S', 'T', 'I', 'L', 'L', '1'};
constexpr std::uint32_t format_version = 1;
constexpr std::size_t header_bytes = 64;
constexpr std::size_t record_header_bytes = 16;

std::uint32_t dtype_code(medusa::weight_dtype t) { return t == medusa::weight_dtype::f32 ? 0u : t == medusa::weight_dtype::f16 ? 1u : 2u; }

template <class T>
void put(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <class T>
T get(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

std::size_t record_bytes(std::size_t n, std::size_t d, std::size_t es) {
  const std::size_t raw = record_header_bytes + 4 * n + n * d * es;
  return (raw + 3) & ~std::size_t{3};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// writer
// ---------------------------------------------------------------------------------------------

distill_cache_writer::distill_cache_writer(std::filesystem::path path, std::size_t hidden, std::size_t vocab,
                                           medusa::weight_dtype dtype, std::uint64_t key_hash)
    : path_(std::move(path)), d_(hidden), v_(vocab), dtype_(dtype), hash_(key_hash) {
  if (dtype == medusa::weight_dtype::f16)
    throw medusa::invalid_input("distill cache: hidden states are stored as f32 or bf16, not f16 (range)");
  if (hidden == 0 || vocab == 0 || hidden > (1u << 24) || vocab > (1u << 30))
    throw medusa::invalid_input("distill cache: bad sizes d=" + std::to_string(hidden) + " V=" + std::to_string(vocab));
  tmp_ = detail::temp_beside(path_);
  std::error_code ec;
  if (path_.has_parent_path()) std::filesystem::create_directories(path_.parent_path(), ec);
  f_ = std::fopen(tmp_.c_str(), "wb");
  if (f_ == nullptr) throw medusa::io_error("cannot write " + tmp_.string() + ": " + std::strerror(errno));
  unsigned char h[header_bytes] = {};  // placeholder; finish() writes the real header
  if (std::fwrite(h, 1, header_bytes, f_) != header_bytes) throw medusa::io_error("cannot write " + tmp_.string());
  bytes_ = header_bytes;
}

distill_cache_writer::~distill_cache_writer() {
  if (f_ != nullptr) {  // not finished: leave nothing behind
    std::fclose(f_);
    std::error_code ec;
    std::filesystem::remove(tmp_, ec);
  }
}

void distill_cache_writer::add(std::span<const std::int32_t> tokens, std::span<const float> hidden, split s,
                               std::uint32_t prompt_len) {
  if (f_ == nullptr) throw medusa::invalid_input("distill cache: add() after finish()");
  const std::size_t n = tokens.size();
  if (n == 0) throw medusa::invalid_input("distill cache: empty record");
  if (n > (1u << 24)) throw medusa::invalid_input("distill cache: record of " + std::to_string(n) + " rows is too long");
  if (hidden.size() != n * d_)
    throw medusa::invalid_input("distill cache: record has " + std::to_string(n) + " tokens but " + std::to_string(hidden.size()) +
                                " hidden floats (d = " + std::to_string(d_) + ")");
  for (std::size_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || static_cast<std::size_t>(tokens[i]) >= v_)
      throw medusa::invalid_input("distill cache: token " + std::to_string(tokens[i]) + " outside [0, " + std::to_string(v_) + ")");
  const std::size_t es = medusa::dtype_size(dtype_);
  const std::size_t bytes = record_bytes(n, d_, es);
  buf_.assign(bytes, 0);
  unsigned char* p = buf_.data();
  put<std::uint32_t>(p, static_cast<std::uint32_t>(n));
  put<std::uint32_t>(p + 4, static_cast<std::uint32_t>(s));
  put<std::uint32_t>(p + 8, prompt_len);
  std::memcpy(p + record_header_bytes, tokens.data(), 4 * n);
  unsigned char* hp = p + record_header_bytes + 4 * n;
  if (dtype_ == medusa::weight_dtype::f32) {
    std::memcpy(hp, hidden.data(), 4 * n * d_);
  } else {
    for (std::size_t i = 0; i < n * d_; ++i) put<std::uint16_t>(hp + 2 * i, medusa::detail::float_to_bfloat16_bits(hidden[i]));
  }
  if (std::fwrite(p, 1, bytes, f_) != bytes) throw medusa::io_error("cannot write " + tmp_.string() + " (disk full?)");
  ++records_;
  rows_ += n;
  bytes_ += bytes;
}

void distill_cache_writer::append(const distill_cache& prior) {
  if (f_ == nullptr) throw medusa::invalid_input("distill cache: append() after finish()");
  if (prior.hidden_size() != d_ || prior.vocab_size() != v_ || prior.dtype() != dtype_)
    throw medusa::invalid_input("distill cache: records of d=" + std::to_string(prior.hidden_size()) + " V=" + std::to_string(prior.vocab_size()) +
                                " " + std::string(medusa::to_string(prior.dtype())) + " cannot continue a cache of d=" + std::to_string(d_) +
                                " V=" + std::to_string(v_) + " " + std::string(medusa::to_string(dtype_)));
  // open() checked that the records fill the file exactly from the header on.
  const std::size_t n = static_cast<std::size_t>(prior.file_bytes()) - header_bytes;
  const auto* records = static_cast<const unsigned char*>(prior.map_) + header_bytes;
  if (n > 0 && std::fwrite(records, 1, n, f_) != n) throw medusa::io_error("cannot write " + tmp_.string() + " (disk full?)");
  records_ += prior.size();
  rows_ += prior.rows();
  bytes_ += n;
}

std::filesystem::path distill_cache_writer::finish(const std::filesystem::path& as) {
  if (f_ == nullptr) throw medusa::invalid_input("distill cache: finish() called twice");
  unsigned char h[header_bytes] = {};
  std::memcpy(h, magic, 8);
  put<std::uint32_t>(h + 8, format_version);
  put<std::uint32_t>(h + 12, dtype_code(dtype_));
  put<std::uint32_t>(h + 16, static_cast<std::uint32_t>(d_));
  put<std::uint32_t>(h + 20, static_cast<std::uint32_t>(v_));
  put<std::uint64_t>(h + 24, records_);
  put<std::uint64_t>(h + 32, rows_);
  put<std::uint64_t>(h + 40, hash_);
  put<std::uint64_t>(h + 48, 1);  // complete
  const bool ok = std::fflush(f_) == 0 && std::fseek(f_, 0, SEEK_SET) == 0 && std::fwrite(h, 1, header_bytes, f_) == header_bytes;
  const bool closed = std::fclose(f_) == 0;
  f_ = nullptr;
  std::error_code ec;
  if (!ok || !closed) {
    std::filesystem::remove(tmp_, ec);
    throw medusa::io_error("cannot finish " + tmp_.string());
  }
  const std::filesystem::path& to = as.empty() ? path_ : as;
  std::filesystem::rename(tmp_, to, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp_, ignored);
    throw medusa::io_error("cannot rename " + tmp_.string() + " to " + to.string() + ": " + ec.message());
  }
  return to;
}

// ---------------------------------------------------------------------------------------------
// reader
// ---------------------------------------------------------------------------------------------

distill_cache::distill_cache(distill_cache&& o) noexcept
    : map_(std::exchange(o.map_, nullptr)), bytes_(std::exchange(o.bytes_, 0)), d_(o.d_), v_(o.v_), dtype_(o.dtype_),
      hash_(o.hash_), rows_(o.rows_), records_(std::move(o.records_)) {}

distill_cache& distill_cache::operator=(distill_cache&& o) noexcept {
  if (this != &o) {
    if (map_ != nullptr) ::munmap(map_, bytes_);
    map_ = std::exchange(o.map_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    d_ = o.d_, v_ = o.v_, dtype_ = o.dtype_, hash_ = o.hash_, rows_ = o.rows_;
    records_ = std::move(o.records_);
  }
  return *this;
}

distill_cache::~distill_cache() {
  if (map_ != nullptr) ::munmap(map_, bytes_);
}

std::optional<std::uint64_t> distill_cache::peek_key(const std::filesystem::path& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return std::nullopt;
  unsigned char h[header_bytes];
  const bool ok = std::fread(h, 1, header_bytes, f) == header_bytes;
  std::fclose(f);
  if (!ok || std::memcmp(h, magic, 8) != 0 || get<std::uint32_t>(h + 8) != format_version || get<std::uint64_t>(h + 48) != 1)
    return std::nullopt;
  return get<std::uint64_t>(h + 40);
}

distill_cache distill_cache::open(const std::filesystem::path& path) {
  const std::string name = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw medusa::io_error("cannot open distill cache " + name + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw medusa::io_error("cannot stat " + name);
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size < header_bytes) {
    ::close(fd);
    throw medusa::io_error("distill cache " + name + " is truncated (" + std::to_string(size) + " bytes)");
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) throw medusa::io_error("cannot map " + name + ": " + std::strerror(errno));
  distill_cache c;
  c.map_ = m;
  c.bytes_ = size;
  const auto* base = static_cast<const unsigned char*>(m);
  auto fail = [&](const std::string& why) -> void { throw medusa::io_error("distill cache " + name + ": " + why); };
  if (std::memcmp(base, magic, 8) != 0) fail("not a distill cache (bad magic)");
  if (get<std::uint32_t>(base + 8) != format_version) fail("unsupported version " + std::to_string(get<std::uint32_t>(base + 8)));
  const auto dt = get<std::uint32_t>(base + 12);
  if (dt != 0 && dt != 2) fail("unsupported dtype code " + std::to_string(dt));
  c.dtype_ = dt == 0 ? medusa::weight_dtype::f32 : medusa::weight_dtype::bf16;
  c.d_ = get<std::uint32_t>(base + 16);
  c.v_ = get<std::uint32_t>(base + 20);
  const auto n_rec = get<std::uint64_t>(base + 24);
  const auto n_rows = get<std::uint64_t>(base + 32);
  c.hash_ = get<std::uint64_t>(base + 40);
  if (get<std::uint64_t>(base + 48) != 1) fail("incomplete file");
  if (c.d_ == 0 || c.v_ == 0) fail("zero hidden or vocab size");
  const std::size_t es = medusa::dtype_size(c.dtype_);
  std::uint64_t off = header_bytes, rows = 0;
  if (n_rec > size / record_header_bytes) fail("record count " + std::to_string(n_rec) + " exceeds the file");
  c.records_.reserve(static_cast<std::size_t>(n_rec));
  for (std::uint64_t r = 0; r < n_rec; ++r) {
    if (size - off < record_header_bytes) fail("record " + std::to_string(r) + " is truncated");
    const auto n = get<std::uint32_t>(base + off);
    const auto s = get<std::uint32_t>(base + off + 4);
    if (n == 0 || n > (1u << 24)) fail("record " + std::to_string(r) + " has " + std::to_string(n) + " rows");
    if (s > 1) fail("record " + std::to_string(r) + " has split " + std::to_string(s));
    const std::uint64_t rb = record_bytes(n, c.d_, es);
    if (size - off < rb) fail("record " + std::to_string(r) + " is truncated");
    record rec;
    rec.tokens = {reinterpret_cast<const std::int32_t*>(base + off + record_header_bytes), n};
    for (std::int32_t t : rec.tokens)
      if (t < 0 || static_cast<std::size_t>(t) >= c.v_) fail("record " + std::to_string(r) + " has token " + std::to_string(t));
    rec.hidden = base + off + record_header_bytes + 4 * std::uint64_t{n};
    rec.which = static_cast<split>(s);
    rec.prompt_len = get<std::uint32_t>(base + off + 8);
    c.records_.push_back(rec);
    off += rb;
    rows += n;
  }
  if (rows != n_rows) fail("row count " + std::to_string(rows) + " differs from the header's " + std::to_string(n_rows));
  if (off != size) fail("trailing bytes after the last record");
  c.rows_ = rows;
  ::madvise(m, size, MADV_RANDOM);
  return c;
}

void distill_cache::load_hidden(std::size_t i, std::size_t j, float* out) const {
  const record& r = records_[i];
  if (dtype_ == medusa::weight_dtype::f32) {
    std::memcpy(out, static_cast<const float*>(r.hidden) + j * d_, 4 * d_);
  } else {
    const auto* p = static_cast<const unsigned char*>(r.hidden) + 2 * j * d_;
    for (std::size_t e = 0; e < d_; ++e) out[e] = medusa::detail::bfloat16_bits_to_float(get<std::uint16_t>(p + 2 * e));
  }
}

// ---------------------------------------------------------------------------------------------
// cache key
// ---------------------------------------------------------------------------------------------

namespace {
constexpr std::uint64_t fnv_offset = 0xcbf29ce484222325ull;
std::uint64_t fnv1a64_update(std::uint64_t h, std::string_view bytes) noexcept {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}
}  // namespace

std::uint64_t fnv1a64(std::string_view bytes) noexcept { return fnv1a64_update(fnv_offset, bytes); }

std::string cache_key::hex() const {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, hash);
  return buf;
}

namespace {
std::string json_string(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += static_cast<char>(c);
    } else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else {
      o += static_cast<char>(c);
    }
  }
  return o + "\"";
}

// A file by what it holds: its size and the FNV-1a-64 hash of its bytes (a copy, a move or a new
// modification time of the same bytes keeps the key; one changed byte changes it), plus `shown`
// (a corpus file's relative path) where the name is part of the data.
std::string file_entry(const std::filesystem::path& file, const std::string& shown) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(file, ec);
  if (ec) throw medusa::io_error("cannot stat " + file.string() + ": " + ec.message());
  std::ifstream in(file, std::ios::binary);
  if (!in) throw medusa::io_error("cannot open " + file.string() + " to hash it");
  std::uint64_t h = fnv_offset;
  std::vector<char> buf(std::size_t{1} << 20);
  std::uintmax_t read = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto got = static_cast<std::size_t>(in.gcount());
    h = fnv1a64_update(h, std::string_view(buf.data(), got));
    read += got;
  }
  if (read != size) throw medusa::io_error("cannot read " + file.string() + " to hash it (" + std::to_string(read) +
                                           " of " + std::to_string(size) + " bytes)");
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  std::string e = "{";
  if (!shown.empty()) e += "\"path\": " + json_string(shown) + ", ";
  return e + "\"size\": " + std::to_string(size) + ", \"fnv1a64\": \"" + hex + "\"}";
}
}  // namespace

cache_key_builder& cache_key_builder::add(const std::string& name, const std::string& value) {
  fields_.emplace_back(name, json_string(value));
  return *this;
}

cache_key_builder& cache_key_builder::add(const std::string& name, double value) {
  char buf[40];
  if (std::isfinite(value) && value == std::floor(value) && std::fabs(value) < 9e15)
    std::snprintf(buf, sizeof buf, "%.0f", value);
  else
    std::snprintf(buf, sizeof buf, "%.17g", value);
  fields_.emplace_back(name, buf);
  return *this;
}

cache_key_builder& cache_key_builder::add_file(const std::string& name, const std::filesystem::path& file) {
  fields_.emplace_back(name, file_entry(file, ""));
  return *this;
}

cache_key_builder& cache_key_builder::add_files(const std::string& name, const std::filesystem::path& root,
                                                const std::vector<std::filesystem::path>& files) {
  std::string v = "[";
  for (std::size_t i = 0; i < files.size(); ++i) {
    if (i) v += ",\n    ";
    v += file_entry(files[i], files[i].lexically_relative(root).generic_string());
  }
  fields_.emplace_back(name, v + "]");
  return *this;
}

cache_key cache_key_builder::build() const {
  std::string j = "{\n";
  for (std::size_t i = 0; i < fields_.size(); ++i) {
    j += "  " + json_string(fields_[i].first) + ": " + fields_[i].second;
    j += i + 1 < fields_.size() ? ",\n" : "\n";
  }
  j += "}\n";
  return {j, fnv1a64(j)};
}

}  // namespace medusa_train
