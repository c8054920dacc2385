// SPDX-License-Identifier: Apache-2.0
// safetensors reader/writer: round trip, format rules of the writer, and one typed error per
// malformed-file case.
#include <medusa/io/safetensors.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

// A file with the given raw JSON header and `data_size` bytes of data.
std::vector<std::byte> make_file(const std::string& header, std::size_t data_size, std::uint64_t claimed_len = UINT64_MAX) {
  std::vector<std::byte> out(8 + header.size() + data_size, std::byte{0});
  const std::uint64_t n = claimed_len == UINT64_MAX ? header.size() : claimed_len;
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

medusa::safetensors_errc error_of(const std::vector<std::byte>& bytes) {
  try {
    (void)medusa::safetensors_file::from_bytes(bytes);
  } catch (const medusa::safetensors_error& e) {
    MESSAGE(std::string(e.what()));
    return e.code();
  }
  FAIL("no error");
  return {};
}

}  // namespace

TEST_CASE("safetensors: writer output follows the format and reads back") {
  std::vector<float> a{1.5f, -2.0f, 3.25f, 4.0f, 5.0f, 6.0f};
  std::vector<std::uint16_t> b{1, 2, 3};
  std::vector<std::int8_t> c{-1, 2};
  medusa::safetensors_writer w;
  w.add("b", medusa::safetensors_dtype::bf16, {3}, std::as_bytes(std::span(b)));
  w.add("c", medusa::safetensors_dtype::i8, {2, 1}, std::as_bytes(std::span(c)));
  w.add("a", medusa::safetensors_dtype::f32, {2, 3}, std::as_bytes(std::span(a)));
  w.add("empty", medusa::safetensors_dtype::f32, {0, 4}, {});
  w.add_metadata("format", "pt");
  const auto bytes = w.to_bytes();
  // 8-byte little-endian length; header padded with spaces to a multiple of 8.
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(bytes[static_cast<std::size_t>(i)]);
  CHECK((8 + n) % 8 == 0);
  const std::string header(reinterpret_cast<const char*>(bytes.data()) + 8, n);
  CHECK(header.rfind("{\"__metadata__\":{\"format\":\"pt\"}", 0) == 0);
  CHECK(header.find_last_not_of(' ') == header.rfind('}'));
  CHECK(bytes.size() == 8 + n + 24 + 6 + 2);
  const auto f = medusa::safetensors_file::from_bytes(bytes);
  REQUIRE(f.tensors().size() == 4);
  // Sorted by offset; the f32 tensor first (largest element), so everything is aligned.
  CHECK(f.tensors()[0].name == "a");
  for (std::size_t i = 1; i < f.tensors().size(); ++i) CHECK(f.tensors()[i - 1].begin <= f.tensors()[i].begin);
  const auto* ta = f.find("a");
  REQUIRE(ta != nullptr);
  CHECK(ta->dtype == medusa::safetensors_dtype::f32);
  CHECK(ta->shape == std::vector<std::uint64_t>{2, 3});
  CHECK(ta->begin % 4 == 0);
  std::vector<float> back(6);
  std::memcpy(back.data(), f.data(*ta).data(), 24);
  CHECK(back == a);
  const auto* tc = f.find("c");
  REQUIRE(tc != nullptr);
  CHECK(static_cast<std::int8_t>(f.data(*tc)[0]) == -1);
  CHECK(f.find("nope") == nullptr);
  CHECK(f.find("empty")->numel() == 0);
  REQUIRE(f.metadata().size() == 1);
  CHECK(f.metadata()[0].second == "pt");
  // Re-writing what was read gives identical bytes.
  medusa::safetensors_writer w2;
  for (const auto& t : f.tensors()) w2.add(t.name, t.dtype, t.shape, f.data(t));
  w2.add_metadata("format", "pt");
  CHECK(w2.to_bytes() == bytes);
}

TEST_CASE("safetensors: memory-mapped file round trip") {
  const std::filesystem::path dir = MEDUSA_TEST_TMPDIR;
  std::filesystem::create_directories(dir);
  const auto path = dir / "st_roundtrip.safetensors";
  std::vector<double> x{1.0, 2.0, 3.0};
  medusa::safetensors_writer w;
  w.add("x", medusa::safetensors_dtype::f64, {3}, std::as_bytes(std::span(x)));
  w.write(path);
  const auto f = medusa::safetensors_file::open(path);
  const auto copy = f;  // shares the mapping
  REQUIRE(copy.find("x") != nullptr);
  double v = 0;
  std::memcpy(&v, copy.data(*copy.find("x")).data() + 16, 8);
  CHECK(v == 3.0);
  CHECK_THROWS_AS((void)medusa::safetensors_file::open(dir / "does-not-exist.safetensors"), medusa::io_error);
}

TEST_CASE("safetensors: writer rejects bad tensors") {
  medusa::safetensors_writer w;
  std::vector<float> a(4);
  CHECK_THROWS_AS(w.add("a", medusa::safetensors_dtype::f32, {5}, std::as_bytes(std::span(a))), medusa::safetensors_error);
  CHECK_THROWS_AS(w.add("__metadata__", medusa::safetensors_dtype::f32, {4}, std::as_bytes(std::span(a))), medusa::safetensors_error);
  w.add("a", medusa::safetensors_dtype::f32, {4}, std::as_bytes(std::span(a)));
  CHECK_THROWS_AS(w.add("a", medusa::safetensors_dtype::f32, {4}, std::as_bytes(std::span(a))), medusa::safetensors_error);
}

TEST_CASE("safetensors error: truncated file") {
  CHECK(error_of(std::vector<std::byte>(5)) == medusa::safetensors_errc::file_too_small);
  CHECK(error_of({}) == medusa::safetensors_errc::file_too_small);
  // A valid file cut short: its last tensor now ends past the data section.
  std::vector<float> a(8, 1.0f);
  medusa::safetensors_writer w;
  w.add("a", medusa::safetensors_dtype::f32, {8}, std::as_bytes(std::span(a)));
  auto bytes = w.to_bytes();
  bytes.pop_back();
  CHECK(error_of(bytes) == medusa::safetensors_errc::range_out_of_bounds);
  bytes.resize(12);  // cut inside the header
  CHECK(error_of(bytes) == medusa::safetensors_errc::header_too_large);
}

TEST_CASE("safetensors error: header length past the end") {
  CHECK(error_of(make_file("{}", 0, 1000)) == medusa::safetensors_errc::header_too_large);
  CHECK(error_of(make_file("{}", 0, UINT64_MAX - 1)) == medusa::safetensors_errc::header_too_large);
}

TEST_CASE("safetensors error: overlapping ranges") {
  const std::string h = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  CHECK(error_of(make_file(h, 12)) == medusa::safetensors_errc::overlapping_ranges);
  // A range nested inside an earlier, longer one overlaps too.
  const std::string h2 = R"({"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},"c":{"dtype":"U8","shape":[2],"data_offsets":[8,10]}})";
  CHECK(error_of(make_file(h2, 16)) == medusa::safetensors_errc::overlapping_ranges);
}

TEST_CASE("safetensors error: unknown dtype") {
  const std::string h = R"({"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})";
  CHECK(error_of(make_file(h, 8)) == medusa::safetensors_errc::unknown_dtype);
}

TEST_CASE("safetensors error: shape/size mismatch") {
  const std::string h = R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})";
  CHECK(error_of(make_file(h, 8)) == medusa::safetensors_errc::size_mismatch);
  // A shape whose element count overflows 64 bits.
  const std::string h2 = R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,8]}})";
  CHECK(error_of(make_file(h2, 8)) == medusa::safetensors_errc::size_mismatch);
}

TEST_CASE("safetensors error: range past the data section") {
  const std::string h = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  CHECK(error_of(make_file(h, 7)) == medusa::safetensors_errc::range_out_of_bounds);
  const std::string h2 = R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})";
  CHECK(error_of(make_file(h2, 8)) == medusa::safetensors_errc::range_out_of_bounds);
}

TEST_CASE("safetensors error: malformed headers and entries") {
  CHECK(error_of(make_file("{\"a\":", 0)) == medusa::safetensors_errc::header_not_json);
  CHECK(error_of(make_file("[]", 0)) == medusa::safetensors_errc::header_not_object);
  CHECK(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1]}})", 4)) == medusa::safetensors_errc::bad_entry);
  CHECK(error_of(make_file(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4)) == medusa::safetensors_errc::bad_entry);
  CHECK(error_of(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", 4)) == medusa::safetensors_errc::bad_entry);
  CHECK(error_of(make_file(R"({"__metadata__":{"k":1}})", 0)) == medusa::safetensors_errc::bad_metadata);
  CHECK(error_of(make_file(R"({"__metadata__":[]})", 0)) == medusa::safetensors_errc::bad_metadata);
}

TEST_CASE("safetensors: a real model file from ../shared, if present") {
  const std::filesystem::path p = std::filesystem::path(MEDUSA_SHARED_DIR) / "models/tinystories-656K/model.safetensors";
  if (!std::filesystem::exists(p)) {
    MESSAGE("skipped: " << p << " not found");
    return;
  }
  const auto f = medusa::safetensors_file::open(p);
  CHECK(f.tensors().size() > 5);
  const auto* emb = f.find("lm_head.weight");
  REQUIRE(emb != nullptr);
  CHECK(emb->shape == std::vector<std::uint64_t>{2048, 128});
  CHECK(emb->dtype == medusa::safetensors_dtype::f32);
  CHECK(f.metadata().size() == 2);
}
