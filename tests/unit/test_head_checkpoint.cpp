// SPDX-License-Identifier: Apache-2.0
// Head checkpoints: save/load round trip, every layout of docs/heads.md built by hand, config
// cross-checks, and one typed error per bad-checkpoint case.
#include <medusa/gemm.hpp>
#include <medusa/half.hpp>
#include <medusa/heads.hpp>
#include <medusa/io/head_checkpoint.hpp>
#include <medusa/io/safetensors.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using medusa::checkpoint_errc;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path p = fs::path(MEDUSA_TEST_TMPDIR) / ("ckpt_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

void write_text(const fs::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary);
  out << s;
}

std::vector<std::byte> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  std::memcpy(out.data(), c.data(), c.size());
  return out;
}

// Builds a safetensors file by hand: name -> (values, shape), stored as `dtype`.
struct file_builder {
  struct tensor {
    std::vector<std::uint64_t> shape;
    std::vector<std::byte> bytes;
    medusa::safetensors_dtype dtype;
  };
  std::map<std::string, tensor> tensors;
  std::mt19937_64 rng{42};

  // Random values (deterministic per name order) of the given shape.
  void add(const std::string& name, std::vector<std::uint64_t> shape, medusa::safetensors_dtype dtype = medusa::safetensors_dtype::f32) {
    std::size_t n = 1;
    for (auto s : shape) n *= s;
    std::uniform_real_distribution<float> u(-1, 1);
    tensor t{std::move(shape), {}, dtype};
    t.bytes.resize(n * medusa::dtype_size(dtype));
    for (std::size_t i = 0; i < n; ++i) {
      const float f = u(rng);
      if (dtype == medusa::safetensors_dtype::f32) std::memcpy(t.bytes.data() + 4 * i, &f, 4);
      else if (dtype == medusa::safetensors_dtype::bf16) {
        const auto b = medusa::bfloat16(f).bits();
        std::memcpy(t.bytes.data() + 2 * i, &b, 2);
      } else if (dtype == medusa::safetensors_dtype::f16) {
        const auto b = medusa::half(f).bits();
        std::memcpy(t.bytes.data() + 2 * i, &b, 2);
      }
    }
    tensors[name] = std::move(t);
  }
  // Heads in a layout: prefix "" (legacy) or "medusa_head."; projection optional.
  void add_heads(const std::string& prefix, std::size_t K, std::size_t L, std::size_t d, std::size_t V, bool projection,
                 medusa::safetensors_dtype dtype = medusa::safetensors_dtype::f32) {
    for (std::size_t h = 0; h < K; ++h) {
      for (std::size_t l = 0; l < L; ++l) {
        const std::string base = prefix + std::to_string(h) + "." + std::to_string(l) + ".linear.";
        add(base + "weight", {d, d}, dtype);
        add(base + "bias", {d}, dtype);
      }
      if (projection) add(prefix + std::to_string(h) + "." + std::to_string(L) + ".weight", {V, d}, dtype);
    }
  }
  void write(const fs::path& p) const {
    medusa::safetensors_writer w;
    for (const auto& [name, t] : tensors) w.add(name, t.dtype, t.shape, t.bytes);
    w.write(p);
  }
};

checkpoint_errc error_of(const fs::path& p, const medusa::head_load_options& opt = {}) {
  try {
    (void)medusa::load_heads(p, opt);
  } catch (const medusa::checkpoint_error& e) {
    MESSAGE(std::string(e.what()));
    return e.code();
  }
  FAIL("no error");
  return {};
}

// The loaded tensor equals the bytes written by hand.
void check_tensor(const file_builder& fb, const std::string& name, std::span<const std::byte> got) {
  CAPTURE(name);
  const auto& t = fb.tensors.at(name);
  REQUIRE(got.size() == t.bytes.size());
  CHECK(std::memcmp(got.data(), t.bytes.data(), got.size()) == 0);
}

}  // namespace

TEST_CASE("legacy layout {h}.{l}.linear.* + {h}.{L}.weight loads (L = 1, 2, 0)") {
  for (std::size_t L : {1u, 2u, 0u}) {
    CAPTURE(L);
    const auto dir = fresh_dir("legacy" + std::to_string(L));
    file_builder fb;
    fb.add_heads("", 3, L, 8, 20, true);
    fb.write(dir / "medusa_lm_head.safetensors");
    write_text(dir / "config.json", R"({"medusa_num_heads": 3, "medusa_num_layers": )" + std::to_string(L) +
                                        R"(, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"})");
    medusa::head_load_options opt;
    opt.hidden_size = 8;
    opt.vocab_size = 20;
    auto r = medusa::load_heads(dir, opt);
    CHECK(r.format == medusa::head_checkpoint_format::legacy);
    CHECK(r.warnings.empty());
    CHECK(r.heads.num_heads() == 3);
    CHECK(r.heads.num_layers() == L);
    CHECK(r.heads.kind() == medusa::projection_kind::per_head);
    CHECK(r.heads.dtype() == medusa::weight_dtype::f32);
    REQUIRE(r.config.has_value());
    for (std::size_t h = 0; h < 3; ++h) {
      for (std::size_t l = 0; l < L; ++l) {
        check_tensor(fb, std::to_string(h) + "." + std::to_string(l) + ".linear.weight", r.heads.resblock_weight_bytes(h, l));
        check_tensor(fb, std::to_string(h) + "." + std::to_string(l) + ".linear.bias", r.heads.resblock_bias_bytes(h, l));
      }
      check_tensor(fb, std::to_string(h) + "." + std::to_string(L) + ".weight", r.heads.projection_bytes(h));
    }
    // The loaded heads run.
    auto view = r.heads.view();
    std::vector<float> hidden(8, 0.5f), logits(3 * 20);
    medusa::portable_gemm<> g;
    view.forward(g, hidden, 1, logits);
    CHECK(std::isfinite(logits[59]));
    if (L >= 1) CHECK(view.first_layer_contiguous());
  }
}

TEST_CASE("HF layout medusa_head.* inside a model file; other tensors are base weights") {
  const auto dir = fresh_dir("hf");
  file_builder fb;
  fb.add_heads("medusa_head.", 4, 1, 16, 32, true, medusa::safetensors_dtype::bf16);
  fb.add("model.embed_tokens.weight", {32, 16});
  fb.add("lm_head.weight", {32, 16});
  fb.write(dir / "model.safetensors");
  write_text(dir / "config.json", R"({"model_type": "llama", "hidden_size": 16, "vocab_size": 32, "medusa_num_heads": 4, "medusa_num_layers": 1})");
  auto r = medusa::load_heads(dir);
  CHECK(r.format == medusa::head_checkpoint_format::hf);
  CHECK(r.heads.num_heads() == 4);
  CHECK(r.heads.dtype() == medusa::weight_dtype::bf16);
  check_tensor(fb, "medusa_head.3.0.linear.weight", r.heads.resblock_weight_bytes(3, 0));
  check_tensor(fb, "medusa_head.2.1.weight", r.heads.projection_bytes(2));
  // Conversion on load: bf16 -> f32 is exact.
  medusa::head_load_options opt;
  opt.dtype = medusa::weight_dtype::f32;
  auto f = medusa::load_heads(dir / "model.safetensors", opt);
  CHECK(f.heads.dtype() == medusa::weight_dtype::f32);
  CHECK(f.heads.resblock_weight(1, 0).load(5) == r.heads.resblock_weight(1, 0).load(5));
}

TEST_CASE("sharded HF checkpoint with model.safetensors.index.json") {
  const auto dir = fresh_dir("sharded");
  file_builder a, b;
  a.add("model.embed_tokens.weight", {32, 16});
  a.add_heads("medusa_head.", 2, 1, 16, 32, true);
  b.rng.seed(7);
  for (std::size_t h = 2; h < 5; ++h) {
    b.add("medusa_head." + std::to_string(h) + ".0.linear.weight", {16, 16});
    b.add("medusa_head." + std::to_string(h) + ".0.linear.bias", {16});
    b.add("medusa_head." + std::to_string(h) + ".1.weight", {32, 16});
  }
  a.write(dir / "model-00001-of-00002.safetensors");
  b.write(dir / "model-00002-of-00002.safetensors");
  std::string index = R"({"metadata": {"total_size": 1}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors")";
  for (const auto& [n, _] : a.tensors)
    if (n.rfind("medusa_head.", 0) == 0) index += ",\"" + n + "\": \"model-00001-of-00002.safetensors\"";
  for (const auto& [n, _] : b.tensors) index += ",\"" + n + "\": \"model-00002-of-00002.safetensors\"";
  index += "}}";
  write_text(dir / "model.safetensors.index.json", index);
  write_text(dir / "config.json", R"({"hidden_size": 16, "vocab_size": 32, "medusa_num_heads": 5, "medusa_num_layers": 1})");
  auto r = medusa::load_heads(dir);
  CHECK(r.format == medusa::head_checkpoint_format::hf_sharded);
  CHECK(r.files.size() == 2);
  CHECK(r.heads.num_heads() == 5);
  check_tensor(b, "medusa_head.4.1.weight", r.heads.projection_bytes(4));
  check_tensor(a, "medusa_head.0.0.linear.bias", r.heads.resblock_bias_bytes(0, 0));

  // A shard escaping the directory is refused.
  write_text(dir / "model.safetensors.index.json", R"({"weight_map": {"medusa_head.0.0.linear.weight": "../x.safetensors"}})");
  CHECK(error_of(dir) == checkpoint_errc::bad_config);
  // A tensor listed in the index but absent from its shard.
  write_text(dir / "model.safetensors.index.json", R"({"weight_map": {"medusa_head.9.0.linear.weight": "model-00001-of-00002.safetensors"}})");
  CHECK(error_of(dir) == checkpoint_errc::incomplete_heads);
}

TEST_CASE("version 2 heads (no projections) use the base model's lm_head") {
  const auto dir = fresh_dir("v2");
  file_builder fb;
  fb.add_heads("", 3, 1, 8, 0, false);
  fb.write(dir / "medusa_lm_head.safetensors");
  write_text(dir / "config.json", R"({"medusa_num_heads": 3, "medusa_num_layers": 1, "version": "2"})");
  auto r = medusa::load_heads(dir);
  CHECK(r.heads.kind() == medusa::projection_kind::shared_lm_head);
  CHECK(r.heads.vocab_size() == 0);  // unknown until the base model says
  CHECK_THROWS_AS((void)r.heads.view(), medusa::checkpoint_error);
  std::vector<float> lm_head(20 * 8, 0.25f), hidden(8, 1.0f), logits(3 * 20);
  auto view = r.heads.view(medusa::weight_ptr::of(lm_head.data()), 20);
  medusa::portable_gemm<> g;
  view.forward(g, hidden, 1, logits);
  CHECK(std::isfinite(logits[0]));
  // With the base vocab given, it is recorded and checked.
  medusa::head_load_options opt;
  opt.vocab_size = 20;
  auto r2 = medusa::load_heads(dir, opt);
  CHECK(r2.heads.vocab_size() == 20);
  CHECK_THROWS_AS((void)r2.heads.view(medusa::weight_ptr::of(lm_head.data()), 19), medusa::checkpoint_error);
}

TEST_CASE("version 2 heads on the shared tinystories model's lm_head, if present") {
  const fs::path model = fs::path(MEDUSA_SHARED_DIR) / "models/tinystories-656K";
  if (!fs::exists(model / "model.safetensors")) {
    MESSAGE("skipped: " << model << " not found");
    return;
  }
  // The base model file itself holds no heads: a clear error, not empty heads.
  CHECK(error_of(model / "model.safetensors") == checkpoint_errc::no_head_tensors);
  const auto base = medusa::safetensors_file::open(model / "model.safetensors");
  const auto* lm = base.find("lm_head.weight");
  REQUIRE(lm != nullptr);
  std::vector<float> lm_head(lm->numel());
  std::memcpy(lm_head.data(), base.data(*lm).data(), lm->size_bytes());
  auto init = medusa::head_weights::initialize(128, 2048, 2, 1, medusa::projection_kind::shared_lm_head, medusa::weight_dtype::f32, {}, 5);
  auto view = init.view(medusa::weight_ptr::of(lm_head.data()), 2048);
  std::vector<float> hidden(128, 0.1f), logits(2 * 2048);
  medusa::portable_gemm<> g;
  view.forward(g, hidden, 1, logits);
  CHECK(std::isfinite(logits[4095]));
}

TEST_CASE("save_heads / load_heads round trip: identical values and bytes") {
  const auto dir = fresh_dir("roundtrip");
  std::vector<float> lm_head(24 * 12);
  for (std::size_t i = 0; i < lm_head.size(); ++i) lm_head[i] = static_cast<float>(i % 17) * 0.01f;
  for (auto kind : {medusa::projection_kind::per_head, medusa::projection_kind::shared_lm_head})
    for (auto dtype : {medusa::weight_dtype::f32, medusa::weight_dtype::bf16}) {
      CAPTURE(static_cast<int>(kind));
      auto w = medusa::head_weights::initialize(12, 24, 3, 2, kind, dtype, medusa::weight_ptr::of(lm_head.data()), 9);
      // Give the ResBlock weights non-zero values as well.
      for (std::size_t h = 0; h < 3; ++h)
        for (std::size_t l = 0; l < 2; ++l) {
          auto bytes = w.resblock_weight_bytes(h, l);
          for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>((i * 7 + h + l) % 61);
        }
      const auto view = kind == medusa::projection_kind::per_head ? w.view() : w.view(medusa::weight_ptr::of(lm_head.data()), 24);
      medusa::head_save_options so;
      so.base_model_name_or_path = "base/\"model\"";
      const auto path = medusa::save_heads(dir, view, so);
      CHECK(path.filename() == "medusa_heads.safetensors");
      auto r = medusa::load_heads(dir);
      CHECK(r.format == medusa::head_checkpoint_format::hf);
      CHECK(r.warnings.empty());
      CHECK(r.heads.kind() == kind);
      CHECK(r.heads.dtype() == dtype);
      CHECK(r.heads.vocab_size() == 24);  // from config.json for shared heads
      REQUIRE(r.heads.size_bytes() == w.size_bytes());
      for (std::size_t h = 0; h < 3; ++h) {
        for (std::size_t l = 0; l < 2; ++l) {
          const auto a = w.resblock_weight_bytes(h, l), b = r.heads.resblock_weight_bytes(h, l);
          CHECK(std::memcmp(a.data(), b.data(), a.size()) == 0);
          const auto c = w.resblock_bias_bytes(h, l), e = r.heads.resblock_bias_bytes(h, l);
          CHECK(std::memcmp(c.data(), e.data(), c.size()) == 0);
        }
        if (kind == medusa::projection_kind::per_head) {
          const auto a = w.projection_bytes(h), b = r.heads.projection_bytes(h);
          CHECK(std::memcmp(a.data(), b.data(), a.size()) == 0);
          // initialised as a copy of lm_head (rounded to the storage dtype)
          CHECK(r.heads.projection(h).load(5) == (dtype == medusa::weight_dtype::f32 ? lm_head[5] : static_cast<float>(medusa::bfloat16(lm_head[5]))));
        }
      }
      // Saving what was loaded reproduces the file byte for byte.
      const auto first = read_bytes(path);
      const auto dir2 = fresh_dir("roundtrip2");
      const auto view2 = kind == medusa::projection_kind::per_head ? r.heads.view() : r.heads.view(medusa::weight_ptr::of(lm_head.data()), 24);
      medusa::save_heads(dir2, view2, so);
      CHECK(read_bytes(dir2 / "medusa_heads.safetensors") == first);
    }
}

TEST_CASE("config.json head count disagreeing with the tensors: warning, error under strict_config") {
  const auto dir = fresh_dir("cfg");
  file_builder fb;
  fb.add_heads("", 5, 1, 8, 16, true);
  fb.write(dir / "medusa_lm_head.safetensors");
  write_text(dir / "config.json", R"({"medusa_num_heads": 2, "medusa_num_layers": 1})");
  auto r = medusa::load_heads(dir);
  CHECK(r.heads.num_heads() == 5);  // the tensors win
  REQUIRE(r.warnings.size() == 1);
  CHECK(r.warnings[0].code == checkpoint_errc::config_mismatch);
  CHECK(r.warnings[0].message.find("medusa_num_heads = 2") != std::string::npos);
  CHECK(r.warnings[0].message.find("5 heads") != std::string::npos);
  medusa::head_load_options strict;
  strict.strict_config = true;
  CHECK(error_of(dir, strict) == checkpoint_errc::config_mismatch);
  write_text(dir / "config.json", R"({"medusa_num_heads": "five"})");
  CHECK(error_of(dir) == checkpoint_errc::bad_config);
  write_text(dir / "config.json", R"({"medusa_num_heads": 5,})");
  CHECK(error_of(dir) == checkpoint_errc::bad_config);
}

TEST_CASE("checkpoint error: vocab size differs from the base model") {
  const auto dir = fresh_dir("vocab");
  file_builder fb;
  fb.add_heads("", 2, 1, 8, 16, true);
  fb.write(dir / "medusa_lm_head.safetensors");
  medusa::head_load_options opt;
  opt.vocab_size = 32000;
  CHECK(error_of(dir, opt) == checkpoint_errc::vocab_size_mismatch);
  write_text(dir / "config.json", R"({"vocab_size": 17})");
  CHECK(error_of(dir) == checkpoint_errc::vocab_size_mismatch);
}

TEST_CASE("checkpoint error: hidden size differs from the base model") {
  const auto dir = fresh_dir("hidden");
  file_builder fb;
  fb.add_heads("", 2, 1, 8, 16, true);
  fb.write(dir / "medusa_lm_head.safetensors");
  medusa::head_load_options opt;
  opt.hidden_size = 4096;
  CHECK(error_of(dir, opt) == checkpoint_errc::hidden_size_mismatch);
}

TEST_CASE("checkpoint error: gap in head indices") {
  const auto dir = fresh_dir("gap");
  file_builder fb;
  fb.add_heads("", 4, 1, 8, 16, true);
  for (const char* n : {"2.0.linear.weight", "2.0.linear.bias", "2.1.weight"}) fb.tensors.erase(n);
  fb.write(dir / "medusa_lm_head.safetensors");
  CHECK(error_of(dir) == checkpoint_errc::incomplete_heads);
}

TEST_CASE("checkpoint error: missing bias, missing projection, projection at the wrong index") {
  const auto dir = fresh_dir("missing");
  {
    file_builder fb;
    fb.add_heads("", 2, 2, 8, 16, true);
    fb.tensors.erase("1.1.linear.bias");
    fb.write(dir / "medusa_lm_head.safetensors");
    CHECK(error_of(dir) == checkpoint_errc::incomplete_heads);
  }
  {
    file_builder fb;
    fb.add_heads("", 2, 1, 8, 16, true);
    fb.tensors.erase("1.1.weight");
    fb.write(dir / "medusa_lm_head.safetensors");
    CHECK(error_of(dir) == checkpoint_errc::incomplete_heads);
  }
  {
    file_builder fb;
    fb.add_heads("", 2, 1, 8, 16, true);
    fb.add("0.3.weight", {16, 8});
    fb.write(dir / "medusa_lm_head.safetensors");
    CHECK(error_of(dir) == checkpoint_errc::unknown_tensor);
  }
}

TEST_CASE("checkpoint error: unknown tensor name") {
  const auto dir = fresh_dir("unknown");
  file_builder fb;
  fb.add_heads("medusa_head.", 2, 1, 8, 16, true);
  fb.add("medusa_head.0.0.linear.scale", {8});
  fb.write(dir / "model.safetensors");
  CHECK(error_of(dir) == checkpoint_errc::unknown_tensor);
  file_builder legacy;
  legacy.add_heads("", 2, 1, 8, 16, true);
  legacy.add("extra", {8});
  legacy.write(dir / "medusa_lm_head.safetensors");
  CHECK(error_of(dir / "medusa_lm_head.safetensors") == checkpoint_errc::unknown_tensor);
}

TEST_CASE("checkpoint error: wrongly shaped tensor") {
  const auto dir = fresh_dir("shape");
  file_builder fb;
  fb.add_heads("", 2, 1, 8, 16, true);
  fb.add("1.0.linear.weight", {8, 9});
  fb.write(dir / "medusa_lm_head.safetensors");
  CHECK(error_of(dir) == checkpoint_errc::bad_shape);
}

TEST_CASE("checkpoint error: unsupported dtype") {
  const auto dir = fresh_dir("dtype");
  file_builder fb;
  fb.add_heads("", 2, 1, 8, 16, true);
  fb.add("0.0.linear.bias", {8}, medusa::safetensors_dtype::i32);
  fb.write(dir / "medusa_lm_head.safetensors");
  CHECK(error_of(dir) == checkpoint_errc::unsupported_dtype);
}

TEST_CASE("checkpoint error: .pt pickles are rejected with a conversion hint") {
  const auto dir = fresh_dir("pt");
  write_text(dir / "medusa_lm_head.pt", "PK\x03\x04");
  CHECK(error_of(dir) == checkpoint_errc::unsupported_format);
  try {
    (void)medusa::load_heads(dir / "medusa_lm_head.pt");
  } catch (const medusa::checkpoint_error& e) {
    CHECK(std::string(e.what()).find("safetensors.torch import save_file") != std::string::npos);
  }
}

TEST_CASE("checkpoint errors: nothing found, too few heads, corrupt file") {
  const auto dir = fresh_dir("misc");
  CHECK(error_of(dir) == checkpoint_errc::not_found);
  CHECK(error_of(dir / "nope.safetensors") == checkpoint_errc::not_found);
  file_builder fb;
  fb.add("model.norm.weight", {8});
  fb.write(dir / "model.safetensors");
  CHECK(error_of(dir) == checkpoint_errc::no_head_tensors);
  file_builder heads;
  heads.add_heads("", 2, 1, 8, 16, true);
  heads.write(dir / "medusa_lm_head.safetensors");
  medusa::head_load_options opt;
  opt.min_heads = 4;
  CHECK(error_of(dir, opt) == checkpoint_errc::too_few_heads);
  write_text(dir / "medusa_lm_head.safetensors", "short");
  CHECK_THROWS_AS((void)medusa::load_heads(dir), medusa::safetensors_error);
}

TEST_CASE("head_weights: initialisation recipe, conversion, copies") {
  std::vector<float> lm(10 * 4, 0.5f);
  auto w = medusa::head_weights::initialize(4, 10, 2, 1, medusa::projection_kind::per_head, medusa::weight_dtype::f32,
                                            medusa::weight_ptr::of(lm.data()), 1);
  for (std::size_t i = 0; i < 16; ++i) CHECK(w.resblock_weight(1, 0).load(i) == 0.0f);  // W = 0
  for (std::size_t i = 0; i < 4; ++i) CHECK(std::abs(w.resblock_bias(1, 0).load(i)) <= 0.5f);  // ±1/sqrt(4)
  CHECK(w.resblock_bias(0, 0).load(0) != w.resblock_bias(1, 0).load(0));
  CHECK(w.projection(1).load(39) == 0.5f);
  const auto b = w.to_dtype(medusa::weight_dtype::bf16);
  CHECK(b.dtype() == medusa::weight_dtype::bf16);
  CHECK(b.projection(0).load(3) == 0.5f);
  auto copy = w;
  copy.resblock_weight_bytes(0, 0)[0] = std::byte{1};
  CHECK(w.resblock_weight_bytes(0, 0)[0] == std::byte{0});
  CHECK_THROWS_AS((void)(w.view<3, 1>()), medusa::invalid_input);
  CHECK_NOTHROW((void)(w.view<2, 1>()));
}
