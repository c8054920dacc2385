// SPDX-License-Identifier: Apache-2.0
// The error catalogue of docs/errors.md, one test case per typed error and code: each builds valid
// data, keeps a copy, makes one input bad, checks the exception's type, code and message, and then
// that the caller's data (inputs, output buffers, caches, files, decoder state) equals the copy.
// MEDUSA_PRINT_ERRORS=1 prints every message (how the examples of docs/errors.md were taken).
#include "tiny_transformer.hpp"

#include <medusa/acceptance.hpp>
#include <medusa/attention.hpp>
#include <medusa/candidates.hpp>
#include <medusa/cuda/emulation.hpp>
#include <medusa/cuda/kernels/attention.hpp>
#include <medusa/cuda/kernels/top_k.hpp>
#include <medusa/decoder.hpp>
#include <medusa/dispatch.hpp>
#include <medusa/heads.hpp>
#include <medusa/io/head_checkpoint.hpp>
#include <medusa/io/json.hpp>
#include <medusa/io/safetensors.hpp>
#include <medusa/kv_cache.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fs = std::filesystem;
using medusa::acceptance_errc;
using medusa::checkpoint_errc;
using medusa::kv_errc;
using medusa::safetensors_errc;
using medusa::tree_errc;
using tiny::tiny_model;
using P = std::vector<std::vector<int>>;

namespace {

constexpr float nan_value = std::numeric_limits<float>::quiet_NaN();

// Runs `f`, which must throw exactly `E` (or a subclass); checks the "medusa: " prefix and that the
// message holds every needle, and returns the exception for the code and index checks.
template <class E, class F>
E thrown(F&& f, std::initializer_list<std::string_view> needles) {
  try {
    f();
  } catch (const E& e) {
    const std::string what = e.what();
    if (std::getenv("MEDUSA_PRINT_ERRORS") != nullptr) std::printf("%s\n", what.c_str());
    CHECK_MESSAGE(what.rfind("medusa: ", 0) == 0, what);
    CHECK(std::string(e.message()) == what);
    for (std::string_view n : needles) CHECK_MESSAGE(what.find(n) != std::string::npos, "'" << n << "' not in: " << what);
    return e;
  } catch (const std::exception& e) {
    FAIL("expected another exception type, got: " << e.what());
  }
  FAIL("no exception");
  throw std::logic_error("unreachable");
}

// ------------------------------------------------------------------------------------------------
// Files: a directory's contents, compared before and after a failing call.
// ------------------------------------------------------------------------------------------------

fs::path fresh_dir(const std::string& name) {
  const fs::path p = fs::path(MEDUSA_TEST_TMPDIR) / ("errors_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

void write_bytes(const fs::path& p, std::string_view s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(s.data(), static_cast<std::streamsize>(s.size()));
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Every entry under `dir` (relative path -> bytes; directories map to "<dir>").
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> s;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    s[fs::relative(e.path(), dir).string()] = e.is_directory() ? "<dir>" : read_bytes(e.path());
  return s;
}

// ------------------------------------------------------------------------------------------------
// KV caches
// ------------------------------------------------------------------------------------------------

// A contiguous NHD cache of 2 layers x 2 KV heads x 4 dims x 16 slots, every element distinct.
struct small_cache {
  static constexpr medusa::kv_extents extents{2, 2, 4};
  static constexpr int capacity = 16;
  std::vector<float> k, v;
  small_cache() : k(2 * 16 * 2 * 4), v(k.size()) {
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>(i);
      v[i] = -static_cast<float>(i);
    }
  }
  medusa::kv_cache_view<float> view() { return medusa::make_kv_view<float>(k, v, extents, capacity); }
};

// A paged cache: 1 layer x 2 heads x 4 dims, pages of 4 slots, a pool of 6 pages, 3 mapped.
struct small_paged_cache {
  static constexpr medusa::kv_extents extents{1, 2, 4};
  std::vector<float> k, v;
  std::vector<std::int32_t> table{4, 1, 3};
  small_paged_cache() : k(6 * 4 * 2 * 4), v(k.size()) {
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>(i) + 0.5f;
      v[i] = -static_cast<float>(i) - 0.5f;
    }
  }
  medusa::paged_kv_cache_view<float> view() {
    return medusa::make_paged_kv_view<float>(k, v, extents, 4, medusa::kv_layout::nhd, table);
  }
};

// ------------------------------------------------------------------------------------------------
// Acceptance: a 4-node tree (root, two children, one grandchild), vocab 6
// ------------------------------------------------------------------------------------------------

struct verify_data {
  medusa::tree t = medusa::tree::from_paths(P{{0}, {1}, {0, 0}});
  static constexpr int vocab = 6;
  std::vector<std::int32_t> tokens{2, 3, 4, 5};
  std::vector<float> logits;
  verify_data() : logits(4 * vocab) {
    for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>((i * 7) % 11) * 0.25f;
  }
  medusa::verify_request request() const { return {.node_tokens = tokens, .logits = logits, .vocab = vocab}; }
};

// ------------------------------------------------------------------------------------------------
// safetensors files
// ------------------------------------------------------------------------------------------------

// A file with the given raw JSON header and `data_size` zero bytes of data.
std::string make_file(const std::string& header, std::size_t data_size, std::uint64_t claimed = UINT64_MAX) {
  std::string out(8 + header.size() + data_size, '\0');
  const std::uint64_t n = claimed == UINT64_MAX ? header.size() : claimed;
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

// Parses `bytes` from memory; the bytes must be unchanged afterwards.
medusa::safetensors_error safetensors_error_of(const std::string& bytes, std::initializer_list<std::string_view> needles) {
  const std::string copy = bytes;
  const auto span = std::as_bytes(std::span(bytes.data(), bytes.size()));
  auto e = thrown<medusa::safetensors_error>([&] { (void)medusa::safetensors_file::from_span(span); }, needles);
  CHECK(bytes == copy);
  return e;
}

// ------------------------------------------------------------------------------------------------
// Head checkpoints: 2 heads, 1 layer, d = 4, V = 6, f32, HF-style names
// ------------------------------------------------------------------------------------------------

struct checkpoint_builder {
  struct tensor {
    medusa::safetensors_dtype dtype;
    std::vector<std::uint64_t> shape;
    std::vector<std::byte> bytes;
  };
  std::map<std::string, tensor> tensors;

  void add(const std::string& name, std::vector<std::uint64_t> shape,
           medusa::safetensors_dtype dtype = medusa::safetensors_dtype::f32) {
    std::size_t n = 1;
    for (auto s : shape) n *= static_cast<std::size_t>(s);
    tensor t{dtype, std::move(shape), std::vector<std::byte>(n * medusa::dtype_size(dtype))};
    for (std::size_t i = 0; i < t.bytes.size(); ++i) t.bytes[i] = static_cast<std::byte>((i * 13 + name.size()) % 61);
    tensors[name] = std::move(t);
  }
  checkpoint_builder() {
    for (int h = 0; h < 2; ++h) {
      const std::string base = "medusa_head." + std::to_string(h);
      add(base + ".0.linear.weight", {4, 4});
      add(base + ".0.linear.bias", {4});
      add(base + ".1.weight", {6, 4});
    }
  }
  void write(const fs::path& p) const {
    medusa::safetensors_writer w;
    for (const auto& [name, t] : tensors) w.add(name, t.dtype, t.shape, t.bytes);
    w.write(p);
  }
};

// Load options set by `f`.
template <class F>
medusa::head_load_options with(F&& f) {
  medusa::head_load_options o;
  f(o);
  return o;
}

// Loads `path`; the directory holding it must be unchanged afterwards.
medusa::checkpoint_error checkpoint_error_of(const fs::path& dir, const fs::path& path, const medusa::head_load_options& opt,
                                             std::initializer_list<std::string_view> needles) {
  const auto before = snapshot(dir);
  auto e = thrown<medusa::checkpoint_error>([&] { (void)medusa::load_heads(path, opt); }, needles);
  CHECK(snapshot(dir) == before);
  return e;
}

// ------------------------------------------------------------------------------------------------
// Decoding: the tiny transformer, alone or behind a batch engine with one cache per request
// ------------------------------------------------------------------------------------------------

const std::vector<std::int32_t> prompt{1, 5, 9, 13, 2, 7};

// The tiny model behind a batch interface: request r has its own cache of `context` slots.
class tiny_batch_engine {
 public:
  tiny_batch_engine(const tiny_model& weights, int context, int requests) : w_(weights), context_(context) {
    const std::size_t size = static_cast<std::size_t>(tiny_model::layers) * static_cast<std::size_t>(context) *
                             tiny_model::kv_heads * tiny_model::head_dim;
    for (int r = 0; r < requests; ++r) caches_.push_back({std::vector<float>(size), std::vector<float>(size)});
  }
  int vocab_size() const { return tiny_model::vocab; }
  int hidden_size() const { return tiny_model::dim; }
  medusa::kv_cache_view<float> kv_cache(int r) {
    auto& c = caches_.at(static_cast<std::size_t>(r));
    return medusa::make_kv_view<float>(c.first, c.second,
                                       medusa::kv_extents{tiny_model::layers, tiny_model::kv_heads, tiny_model::head_dim}, context_);
  }
  void forward(const medusa::ragged_batch& b) {
    for (int i = 0; i < b.size(); ++i) {
      const medusa::forward_batch f = tiny::request_slice(b, i);
      w_.run(kv_cache(b.requests[static_cast<std::size_t>(i)]), f);
    }
  }

 private:
  const tiny_model& w_;
  int context_;
  std::vector<std::pair<std::vector<float>, std::vector<float>>> caches_;
};
static_assert(medusa::batch_decoder_model<tiny_batch_engine>);

// Runs a batch to its end; request id -> tokens.
template <class Decoder>
std::map<int, std::vector<std::int32_t>> drain(Decoder& dec) {
  std::map<int, std::vector<std::int32_t>> out;
  while (!dec.empty())
    for (medusa::request_update& u : dec.step())
      if (u.finished) {
        REQUIRE(u.reason != medusa::stop_reason::failed);
        out[u.request] = u.result.tokens;
      }
  return out;
}

// The tiny model whose outputs go bad at one forward pass (1 = the prefill).
struct faulty_model {
  tiny_model& m;
  int bad_pass;
  medusa::model_output what;
  int passes = 0;
  int vocab_size() const { return tiny_model::vocab; }
  int hidden_size() const { return tiny_model::dim; }
  medusa::kv_cache_view<float> kv_cache() const { return m.kv_cache(); }
  void forward(const medusa::forward_batch& b) {
    m.forward(b);
    if (++passes != bad_pass) return;
    if (what == medusa::model_output::logits) b.logits[2] = nan_value;
    else b.hidden[1] = std::numeric_limits<float>::infinity();
  }
};
static_assert(medusa::decoder_model<faulty_model>);

// The tiny model committing its own cache, and reporting one slot too many.
struct miscounting_model {
  tiny_model& m;
  int vocab_size() const { return tiny_model::vocab; }
  int hidden_size() const { return tiny_model::dim; }
  int max_context() const { return m.capacity(); }
  void forward(const medusa::forward_batch& b) { m.forward(b); }
  int commit(int L, int N, std::span<const int> path) { return medusa::kv_commit(m.kv_cache(), L, N, path) + 1; }
};
static_assert(medusa::kv_committing_single_model<miscounting_model>);

}  // namespace

// ================================================================================================
// tree_error: every tree_errc from tree::from_paths / from_text / preset
// ================================================================================================

TEST_CASE("tree_error: empty_tree") {
  const P paths{};
  auto e = thrown<medusa::tree_error>([&] { (void)medusa::tree::from_paths(paths); }, {"no paths"});
  CHECK(e.code() == tree_errc::empty_tree);
  CHECK(e.path_index() == -1);
  CHECK(paths.empty());
}

TEST_CASE("tree_error: empty_path") {
  const P paths{{0}, {}}, copy = paths;
  auto e = thrown<medusa::tree_error>([&] { (void)medusa::tree::from_paths(paths); }, {"tree path #1 []", "empty path"});
  CHECK(e.code() == tree_errc::empty_path);
  CHECK(e.path_index() == 1);
  CHECK(paths == copy);
}

TEST_CASE("tree_error: rank_out_of_range") {
  const P paths{{0}, {1}, {1, 10}}, copy = paths;
  auto e = thrown<medusa::tree_error>([&] { (void)medusa::tree::from_paths(paths); }, {"tree path #2 [1,10]", "rank 10 >= topk 10"});
  CHECK(e.code() == tree_errc::rank_out_of_range);
  CHECK(e.path_index() == 2);
  CHECK(paths == copy);
}

TEST_CASE("tree_error: too_deep") {
  const P paths{{0}, {0, 0}, {0, 0, 0}}, copy = paths;
  auto e = thrown<medusa::tree_error>([&] { (void)medusa::tree::from_paths(paths, {.max_depth = 2}); }, {"#2", "max_depth 2"});
  CHECK(e.code() == tree_errc::too_deep);
  CHECK(e.path_index() == 2);
  CHECK(paths == copy);
}

TEST_CASE("tree_error: duplicate_path") {
  const P paths{{0}, {1}, {0}}, copy = paths;
  auto e = thrown<medusa::tree_error>([&] { (void)medusa::tree::from_paths(paths); }, {"#2 [0]", "#0"});
  CHECK(e.code() == tree_errc::duplicate_path);
  CHECK(e.path_index() == 2);
  CHECK(paths == copy);
}

TEST_CASE("tree_error: not_prefix_closed") {
  const P paths{{0}, {1, 0}}, copy = paths;
  auto e = thrown<medusa::tree_error>([&] { (void)medusa::tree::from_paths(paths); }, {"#1 [1,0]", "[1]"});
  CHECK(e.code() == tree_errc::not_prefix_closed);
  CHECK(e.path_index() == 1);
  CHECK(paths == copy);
}

TEST_CASE("tree_error: too_many_nodes") {
  const P paths{{0}, {1}, {2}}, copy = paths;
  auto e = thrown<medusa::tree_error>([&] { (void)medusa::tree::from_paths(paths, {.max_nodes = 3}); }, {"max_nodes 3"});
  CHECK(e.code() == tree_errc::too_many_nodes);
  CHECK(paths == copy);
}

TEST_CASE("tree_error: malformed_text") {
  const std::string text = "[[0], [1, ]]x", copy = text;
  auto e = thrown<medusa::tree_error>([&] { (void)medusa::tree::from_text(text); }, {"offset"});
  CHECK(e.code() == tree_errc::malformed_text);
  CHECK(text == copy);
}

TEST_CASE("tree_error: unknown_preset") {
  const std::string name = "vicuna_7b_stage9", copy = name;
  auto e = thrown<medusa::tree_error>([&] { (void)medusa::tree::preset(name); }, {"'vicuna_7b_stage9'", "mc_sim_7b_63"});
  CHECK(e.code() == tree_errc::unknown_preset);
  CHECK(name == copy);
}

TEST_CASE("invalid_input: tree options out of range") {
  const P paths{{0}}, copy = paths;
  (void)thrown<medusa::invalid_input>([&] { (void)medusa::tree::from_paths(paths, {.topk = 0}); }, {"topk"});
  CHECK(paths == copy);
}

TEST_CASE("io_error: tree file that does not exist") {
  const auto dir = fresh_dir("tree_file");
  (void)thrown<medusa::io_error>([&] { (void)medusa::tree::from_file(dir / "missing.json"); }, {"missing.json"});
  CHECK(snapshot(dir).empty());
}

TEST_CASE("invalid_input: packed mask buffer too short") {
  const auto t = medusa::tree::preset("mc_sim_7b_63");
  std::vector<std::uint32_t> out(10, 0xdeadbeefu);
  const auto copy = out;
  (void)thrown<medusa::invalid_input>([&] { medusa::copy_packed_mask(t, std::span<std::uint32_t>(out)); },
                                      {"buffer holds 10 words, needs 128"});
  CHECK(out == copy);
}

TEST_CASE("invalid_input: full-row stream batch with a negative prefix writes nothing") {
  const auto t = medusa::tree::from_paths(P{{0}, {1}, {0, 0}});
  const std::vector<int> prefixes{3, -1};
  std::vector<std::uint8_t> out(64, 0xAB);
  std::vector<std::int64_t> indptr(3, -7);
  const auto out_copy = out;
  const auto indptr_copy = indptr;
  (void)thrown<medusa::invalid_input>([&] { (void)medusa::write_full_row_stream_batch(t, prefixes, out, indptr); },
                                      {"request 1: prefix length -1 < 0"});
  CHECK(out == out_copy);
  CHECK(indptr == indptr_copy);
  std::vector<std::uint8_t> small(3, 0xAB);
  const auto small_copy = small;
  (void)thrown<medusa::invalid_input>(
      [&] { (void)medusa::write_full_row_stream_batch(t, std::vector<int>{3, 3}, small, indptr); }, {"buffer holds 3 bytes, the batch needs"});
  CHECK(small == small_copy);
  CHECK(indptr == indptr_copy);
}

// ================================================================================================
// kv_cache_error: every kv_errc, the cache bytes unchanged
// ================================================================================================

TEST_CASE("kv_cache_error: invalid_shape (buffers smaller than the mapping)") {
  std::vector<float> k(100, 1.0f), v(100, 2.0f);
  const auto kc = k, vc = v;
  auto e = thrown<medusa::kv_cache_error>(
      [&] { (void)medusa::make_kv_view<float>(k, v, medusa::kv_extents{2, 2, 4}, 10); }, {"160"});
  CHECK(e.code() == kv_errc::invalid_shape);
  CHECK(e.request() == -1);
  CHECK(k == kc);
  CHECK(v == vc);
}

TEST_CASE("kv_cache_error: invalid_shape (attention layer out of range)") {
  small_cache c;
  const auto kc = c.k, vc = c.v;
  std::vector<float> q(2 * 4 * 4, 0.25f), out(q.size(), 9.0f);
  const auto qc = q, oc = out;
  auto e = thrown<medusa::kv_cache_error>(
      [&] { medusa::tree_attention(c.view(), 2, 3, q, 2, 4, medusa::causal_mask{}, out); }, {"layer 2"});
  CHECK(e.code() == kv_errc::invalid_shape);
  CHECK(c.k == kc);
  CHECK(c.v == vc);
  CHECK(q == qc);
  CHECK(out == oc);
}

TEST_CASE("kv_cache_error: invalid_shape (attention kernels with a null member)") {
  small_cache c;
  const auto kc = c.k, vc = c.v;
  std::vector<float> q(2 * 4 * 4, 0.25f), out(q.size(), 9.0f);
  const auto qc = q, oc = out;
  medusa::attention_kernels kernels = medusa::builtin_attention_kernels();
  kernels.exp2_sum = nullptr;
  auto e = thrown<medusa::kv_cache_error>(
      [&] { medusa::tree_attention(c.view(), 0, 3, q, 2, 4, medusa::causal_mask{}, out, {0.0f, &kernels}); },
      {"attention kernels", "exp2_sum"});
  CHECK(e.code() == kv_errc::invalid_shape);
  CHECK(c.k == kc);
  CHECK(c.v == vc);
  CHECK(q == qc);
  CHECK(out == oc);
}

TEST_CASE("kv_cache_error: capacity_exceeded") {
  small_cache c;
  const auto kc = c.k, vc = c.v;
  const std::vector<int> path{0, 1}, copy = path;
  auto e = thrown<medusa::kv_cache_error>([&] { (void)medusa::kv_commit(c.view(), 9, 8, path); }, {"17", "16"});
  CHECK(e.code() == kv_errc::capacity_exceeded);
  CHECK(c.k == kc);
  CHECK(c.v == vc);
  CHECK(path == copy);
}

TEST_CASE("kv_cache_error: invalid_length") {
  small_cache c;
  const auto kc = c.k, vc = c.v;
  auto e = thrown<medusa::kv_cache_error>([&] { (void)medusa::kv_truncate(c.view(), 5, 6); },
                                          {"truncation to 6 from length 5"});
  CHECK(e.code() == kv_errc::invalid_length);
  CHECK(c.k == kc);
  CHECK(c.v == vc);
}

TEST_CASE("kv_cache_error: invalid_path") {
  small_cache c;
  const auto kc = c.k, vc = c.v;
  const std::vector<int> path{0, 4, 2}, copy = path;
  auto e = thrown<medusa::kv_cache_error>([&] { (void)medusa::kv_commit(c.view(), 2, 8, path); }, {"[0,4,2]", "increasing"});
  CHECK(e.code() == kv_errc::invalid_path);
  CHECK(c.k == kc);
  CHECK(c.v == vc);
  CHECK(path == copy);
}

TEST_CASE("kv_cache_error: path_not_in_tree") {
  small_cache c;
  const auto kc = c.k, vc = c.v;
  const auto t = medusa::tree::from_paths(P{{0}, {1}, {0, 0}});  // node 3 is the child of node 1
  const std::vector<int> path{0, 2, 3}, copy = path;
  auto e = thrown<medusa::kv_cache_error>([&] { (void)medusa::kv_commit(c.view(), 2, t, path); }, {"node 3", "parent"});
  CHECK(e.code() == kv_errc::path_not_in_tree);
  CHECK(c.k == kc);
  CHECK(c.v == vc);
  CHECK(path == copy);
}

TEST_CASE("kv_cache_error: block_table_too_short") {
  small_paged_cache c;
  const auto kc = c.k, vc = c.v;
  const auto tc = c.table;
  const std::vector<int> path{0, 7};
  auto e = thrown<medusa::kv_cache_error>([&] { (void)medusa::kv_commit(c.view(), 5, 8, path); }, {"block table"});
  CHECK(e.code() == kv_errc::block_table_too_short);
  CHECK(c.k == kc);
  CHECK(c.v == vc);
  CHECK(c.table == tc);
}

TEST_CASE("kv_cache_error: invalid_block") {
  small_paged_cache c;
  c.table[2] = 6;  // the pool has pages 0..5
  const auto kc = c.k, vc = c.v;
  const auto tc = c.table;
  auto e = thrown<medusa::kv_cache_error>([&] { medusa::kv_check_append(c.view(), 8, 2); }, {"page 6"});
  CHECK(e.code() == kv_errc::invalid_block);
  CHECK(c.k == kc);
  CHECK(c.v == vc);
  CHECK(c.table == tc);
}

TEST_CASE("kv_cache_error: size_mismatch, and a batch error names its request") {
  small_cache a, b;
  const auto ak = a.k, bk = b.k;
  const std::vector<medusa::kv_cache_view<float>> views{a.view(), b.view()};
  const std::vector<int> path{0, 1}, bad_path{0, 9};
  const std::vector<medusa::kv_commit_request> reqs{{2, 4, path}, {2, 4, bad_path}};
  std::vector<int> lengths(1, -1);
  auto e = thrown<medusa::kv_cache_error>([&] { medusa::kv_commit_batch(views, reqs, lengths); },
                                          {"2 views, 2 requests, 1 output lengths"});
  CHECK(e.code() == kv_errc::size_mismatch);
  lengths.assign(2, -1);
  auto e2 = thrown<medusa::kv_cache_error>([&] { medusa::kv_commit_batch(views, reqs, lengths); }, {"kv request #1"});
  CHECK(e2.code() == kv_errc::invalid_path);
  CHECK(e2.request() == 1);
  CHECK(a.k == ak);  // request 0 was valid, but nothing moves before every request is checked
  CHECK(b.k == bk);
  CHECK(lengths == std::vector<int>{-1, -1});
}

// ================================================================================================
// acceptance_error: every acceptance_errc; inputs and output spans unchanged
// ================================================================================================

TEST_CASE("acceptance_error: size_mismatch") {
  const verify_data d;
  const auto tokens = d.tokens;
  auto req = d.request();
  req.node_tokens = std::span(d.tokens).first(3);
  auto e = thrown<medusa::acceptance_error>([&] { (void)medusa::verify(d.t, req, medusa::greedy_policy{}); },
                                            {"node_tokens has 3 entries, the tree has 4 nodes"});
  CHECK(e.code() == acceptance_errc::size_mismatch);
  CHECK(d.tokens == tokens);
}

TEST_CASE("acceptance_error: vocab_mismatch") {
  const verify_data d;
  const auto logits = d.logits;
  auto req = d.request();
  req.vocab = 8;  // 24 logits are 4 rows of 6
  auto e = thrown<medusa::acceptance_error>([&] { (void)medusa::verify(d.t, req, medusa::greedy_policy{}); },
                                            {"logits have 24 values, expected 4 nodes x vocab 8 = 32"});
  CHECK(e.code() == acceptance_errc::vocab_mismatch);
  CHECK(d.logits == logits);
}

TEST_CASE("acceptance_error: token_out_of_range") {
  verify_data d;
  d.tokens[2] = 6;
  const auto tokens = d.tokens;
  auto e = thrown<medusa::acceptance_error>([&] { (void)medusa::verify(d.t, d.request(), medusa::greedy_policy{}); },
                                            {"node 2: token 6 is outside [0, 6)"});
  CHECK(e.code() == acceptance_errc::token_out_of_range);
  CHECK(e.node() == 2);
  CHECK(d.tokens == tokens);
}

TEST_CASE("acceptance_error: non_finite_logit (verify)") {
  verify_data d;
  d.logits[3] = nan_value;  // the root's row is always read
  const auto logits = d.logits;
  auto e = thrown<medusa::acceptance_error>([&] { (void)medusa::verify(d.t, d.request(), medusa::greedy_policy{}); },
                                            {"node 0: logit 3 is NaN"});
  CHECK(e.code() == acceptance_errc::non_finite_logit);
  CHECK(e.node() == 0);
  CHECK(std::memcmp(d.logits.data(), logits.data(), logits.size() * sizeof(float)) == 0);
}

TEST_CASE("acceptance_error: non_finite_logit (candidates), the outputs untouched") {
  const auto t = medusa::tree::from_paths(P{{0}, {1}, {0, 0}});
  std::vector<float> heads(2 * 6, 0.5f);
  heads[6 + 4] = std::numeric_limits<float>::infinity();  // head 1, token 4
  const auto heads_copy = heads;
  std::vector<std::int32_t> flat(1 + 10 * 2, 77), node_tokens(4, 77);
  const auto flat_copy = flat, nodes_copy = node_tokens;
  auto e = thrown<medusa::acceptance_error>([&] { medusa::generate_candidates(t, 1, heads, 6, flat, node_tokens); },
                                            {"head 1: logit 4 is +Inf"});
  CHECK(e.code() == acceptance_errc::non_finite_logit);
  CHECK(e.node() == 1);
  CHECK(heads == heads_copy);
  CHECK(flat == flat_copy);
  CHECK(node_tokens == nodes_copy);
}

TEST_CASE("acceptance_error: non_finite_logit (every token masked)") {
  const std::vector<float> row(5, -std::numeric_limits<float>::infinity());
  auto e = thrown<medusa::acceptance_error>([&] { (void)medusa::argmax(row); }, {"every logit is -Inf"});
  CHECK(e.code() == acceptance_errc::non_finite_logit);
  CHECK(row == std::vector<float>(5, -std::numeric_limits<float>::infinity()));
}

TEST_CASE("acceptance_error: bad_parameter") {
  const verify_data d;
  const auto logits = d.logits;
  auto e = thrown<medusa::acceptance_error>(
      [&] { (void)medusa::verify(d.t, d.request(), medusa::typical_policy{.temperature = -0.5f}); }, {"temperature"});
  CHECK(e.code() == acceptance_errc::bad_parameter);
  CHECK(d.logits == logits);
}

TEST_CASE("acceptance_error: bad_draft") {
  const verify_data d;
  std::vector<float> draft(d.logits.size(), 1.0f / 6.0f);
  draft[6 + 2] = -0.1f;  // node 1's draft row
  const auto draft_copy = draft;
  auto req = d.request();
  req.draft_probs = draft;
  auto e = thrown<medusa::acceptance_error>([&] { (void)medusa::verify(d.t, req, medusa::speculative_policy{}); },
                                            {"node 1: draft probability of token 2"});
  CHECK(e.code() == acceptance_errc::bad_draft);
  CHECK(e.node() == 1);
  CHECK(draft == draft_copy);
}

TEST_CASE("acceptance_error: too_deep") {
  P chain;
  for (int d = 1; d <= 64; ++d) chain.push_back(std::vector<int>(static_cast<std::size_t>(d), 0));
  const auto t = medusa::tree::from_paths(chain, {.max_depth = 64});
  const std::vector<std::int32_t> tokens(65, 0);
  const std::vector<float> logits(65 * 2, 0.0f);
  auto e = thrown<medusa::acceptance_error>(
      [&] { (void)medusa::verify(t, {.node_tokens = tokens, .logits = logits, .vocab = 2}, medusa::greedy_policy{}); },
      {"tree depth 64 exceeds the verify limit 63"});
  CHECK(e.code() == acceptance_errc::too_deep);
  CHECK(tokens == std::vector<std::int32_t>(65, 0));
}

TEST_CASE("acceptance_error: a bad batch writes no result") {
  const verify_data d;
  verify_data bad;
  bad.tokens[1] = -1;
  const std::vector<medusa::verify_request> reqs{d.request(), bad.request()};
  std::vector<medusa::verify_result> results(2);
  results[0].accept_length = 42;
  std::vector<int> offsets(3, -5);
  medusa::acceptance_workspace ws(4, 6);
  auto e = thrown<medusa::acceptance_error>(
      [&] { medusa::verify_batch(d.t, std::span<const medusa::verify_request>(reqs), medusa::greedy_policy{}, ws, results, offsets); },
      {"node 1: token -1"});
  CHECK(e.code() == acceptance_errc::token_out_of_range);
  CHECK(results[0].accept_length == 42);
  CHECK(offsets == std::vector<int>(3, -5));
}

// ================================================================================================
// json_error
// ================================================================================================

TEST_CASE("json_error: strict JSON, with the byte offset") {
  const std::string text = R"({"medusa_num_heads": 4,})", copy = text;
  auto e = thrown<medusa::json_error>([&] { (void)medusa::parse_json(text); }, {"JSON error at byte 23"});
  CHECK(e.offset() == 23);
  CHECK(text == copy);
  const std::string dup = R"({"a": 1, "a": 2})";
  (void)thrown<medusa::json_error>([&] { (void)medusa::parse_json(dup); }, {"duplicate key \"a\""});
}

// ================================================================================================
// safetensors_error: every safetensors_errc; the bytes (or the file) unchanged
// ================================================================================================

TEST_CASE("safetensors_error: file_too_small") {
  auto e = safetensors_error_of(std::string(5, '\0'), {"file has 5 bytes"});
  CHECK(e.code() == safetensors_errc::file_too_small);
}

TEST_CASE("safetensors_error: header_too_large") {
  auto e = safetensors_error_of(make_file("{}", 0, 1000), {"header length 1000"});
  CHECK(e.code() == safetensors_errc::header_too_large);
}

TEST_CASE("safetensors_error: header_not_json") {
  auto e = safetensors_error_of(make_file(R"({"a":)", 0), {"header is not valid JSON"});
  CHECK(e.code() == safetensors_errc::header_not_json);
}

TEST_CASE("safetensors_error: header_not_object") {
  auto e = safetensors_error_of(make_file("[]", 0), {"header is not a JSON object"});
  CHECK(e.code() == safetensors_errc::header_not_object);
}

TEST_CASE("safetensors_error: bad_entry") {
  auto e = safetensors_error_of(make_file(R"({"w":{"dtype":"F32","shape":[1]}})", 4), {"'w'", "data_offsets"});
  CHECK(e.code() == safetensors_errc::bad_entry);
}

TEST_CASE("safetensors_error: unknown_dtype") {
  auto e = safetensors_error_of(make_file(R"({"w":{"dtype":"F128","shape":[1],"data_offsets":[0,8]}})", 8),
                                {"unknown dtype \"F128\""});
  CHECK(e.code() == safetensors_errc::unknown_dtype);
}

TEST_CASE("safetensors_error: size_mismatch") {
  auto e = safetensors_error_of(make_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                                {"shape [3] of F32"});
  CHECK(e.code() == safetensors_errc::size_mismatch);
}

TEST_CASE("safetensors_error: range_out_of_bounds") {
  auto e = safetensors_error_of(make_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 7),
                                {"data_offsets [0, 8) end past the data section of 7 bytes"});
  CHECK(e.code() == safetensors_errc::range_out_of_bounds);
}

TEST_CASE("safetensors_error: overlapping_ranges") {
  auto e = safetensors_error_of(
      make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
      {"overlaps"});
  CHECK(e.code() == safetensors_errc::overlapping_ranges);
}

TEST_CASE("safetensors_error: bad_metadata") {
  auto e = safetensors_error_of(make_file(R"({"__metadata__":{"format":1}})", 0), {"__metadata__ entry 'format'"});
  CHECK(e.code() == safetensors_errc::bad_metadata);
}

TEST_CASE("safetensors_error: invalid_tensor (writer), the writer unchanged") {
  const std::vector<float> a(4, 1.0f);
  medusa::safetensors_writer w;
  w.add("a", medusa::safetensors_dtype::f32, {4}, std::as_bytes(std::span(a)));
  const auto before = w.to_bytes();
  auto e = thrown<medusa::safetensors_error>(
      [&] { w.add("b", medusa::safetensors_dtype::f32, {5}, std::as_bytes(std::span(a))); }, {"tensor 'b'", "16"});
  CHECK(e.code() == safetensors_errc::invalid_tensor);
  auto e2 = thrown<medusa::safetensors_error>(
      [&] { w.add("a", medusa::safetensors_dtype::f32, {4}, std::as_bytes(std::span(a))); }, {"duplicate tensor name 'a'"});
  CHECK(e2.code() == safetensors_errc::invalid_tensor);
  CHECK(w.to_bytes() == before);
}

TEST_CASE("safetensors_error from a file names it; the file is unchanged") {
  const auto dir = fresh_dir("safetensors_file");
  const std::string bytes = make_file("[]", 0);
  write_bytes(dir / "bad.safetensors", bytes);
  const auto before = snapshot(dir);
  auto e = thrown<medusa::safetensors_error>([&] { (void)medusa::safetensors_file::open(dir / "bad.safetensors"); },
                                             {"bad.safetensors: header is not a JSON object"});
  CHECK(e.code() == safetensors_errc::header_not_object);
  CHECK(snapshot(dir) == before);
  (void)thrown<medusa::io_error>([&] { (void)medusa::safetensors_file::open(dir / "none.safetensors"); }, {"none.safetensors"});
  CHECK(snapshot(dir) == before);
}

TEST_CASE("io_error: a safetensors write that fails leaves no file behind") {
  const auto dir = fresh_dir("safetensors_write");
  fs::create_directories(dir / "taken" / "inside");  // the target is a non-empty directory
  const auto before = snapshot(dir);
  const std::vector<float> a(4, 1.0f);
  medusa::safetensors_writer w;
  w.add("a", medusa::safetensors_dtype::f32, {4}, std::as_bytes(std::span(a)));
  (void)thrown<medusa::io_error>([&] { w.write(dir / "taken"); }, {"taken"});
  CHECK(snapshot(dir) == before);  // no taken.tmp
}

// ================================================================================================
// checkpoint_error: every checkpoint_errc; the checkpoint files unchanged
// ================================================================================================

TEST_CASE("checkpoint_error: not_found") {
  const auto dir = fresh_dir("ckpt_not_found");
  write_bytes(dir / "notes.txt", "no weights here");
  auto e = checkpoint_error_of(dir, dir, {}, {"no Medusa checkpoint in"});
  CHECK(e.code() == checkpoint_errc::not_found);
  auto e2 = checkpoint_error_of(dir, dir / "nothing.safetensors", {}, {"does not exist"});
  CHECK(e2.code() == checkpoint_errc::not_found);
}

TEST_CASE("checkpoint_error: unsupported_format") {
  const auto dir = fresh_dir("ckpt_pickle");
  write_bytes(dir / "medusa_lm_head.pt", "PK\x03\x04 a zip of pickles");
  auto e = checkpoint_error_of(dir, dir, {}, {"PyTorch pickle", "save_file"});
  CHECK(e.code() == checkpoint_errc::unsupported_format);
}

TEST_CASE("checkpoint_error: no_head_tensors") {
  const auto dir = fresh_dir("ckpt_no_heads");
  checkpoint_builder b;
  b.tensors.clear();
  b.add("model.embed_tokens.weight", {6, 4});
  b.write(dir / "model.safetensors");
  auto e = checkpoint_error_of(dir, dir, {}, {"no Medusa head tensor"});
  CHECK(e.code() == checkpoint_errc::no_head_tensors);
}

TEST_CASE("checkpoint_error: unknown_tensor") {
  const auto dir = fresh_dir("ckpt_unknown");
  checkpoint_builder b;
  b.add("medusa_head.0.0.linear.scale", {4});
  b.write(dir / "medusa_heads.safetensors");
  auto e = checkpoint_error_of(dir, dir, {}, {"'medusa_head.0.0.linear.scale'"});
  CHECK(e.code() == checkpoint_errc::unknown_tensor);
}

TEST_CASE("checkpoint_error: incomplete_heads") {
  const auto dir = fresh_dir("ckpt_incomplete");
  checkpoint_builder b;
  b.tensors.erase("medusa_head.1.0.linear.bias");
  b.write(dir / "medusa_heads.safetensors");
  auto e = checkpoint_error_of(dir, dir, {}, {"medusa_head.1.0.linear.bias"});
  CHECK(e.code() == checkpoint_errc::incomplete_heads);
}

TEST_CASE("checkpoint_error: bad_shape") {
  const auto dir = fresh_dir("ckpt_shape");
  checkpoint_builder b;
  b.add("medusa_head.1.0.linear.weight", {4, 5});
  b.write(dir / "medusa_heads.safetensors");
  auto e = checkpoint_error_of(dir, dir, {}, {"'medusa_head.1.0.linear.weight' has shape [4, 5]"});
  CHECK(e.code() == checkpoint_errc::bad_shape);
}

TEST_CASE("checkpoint_error: unsupported_dtype") {
  const auto dir = fresh_dir("ckpt_dtype");
  checkpoint_builder b;
  b.add("medusa_head.0.0.linear.bias", {4}, medusa::safetensors_dtype::i32);
  b.write(dir / "medusa_heads.safetensors");
  auto e = checkpoint_error_of(dir, dir, {}, {"dtype I32"});
  CHECK(e.code() == checkpoint_errc::unsupported_dtype);
}

TEST_CASE("checkpoint_error: hidden_size_mismatch and vocab_size_mismatch") {
  const auto dir = fresh_dir("ckpt_sizes");
  checkpoint_builder().write(dir / "medusa_heads.safetensors");
  auto e = checkpoint_error_of(dir, dir, with([](auto& o) { o.hidden_size = 8; }), {"hidden size 4 but the base model has 8"});
  CHECK(e.code() == checkpoint_errc::hidden_size_mismatch);
  auto e2 = checkpoint_error_of(dir, dir, with([](auto& o) { o.vocab_size = 7; }), {"vocab size 6 but the base model has 7"});
  CHECK(e2.code() == checkpoint_errc::vocab_size_mismatch);
}

TEST_CASE("checkpoint_error: config_mismatch (strict_config)") {
  const auto dir = fresh_dir("ckpt_config");
  checkpoint_builder().write(dir / "medusa_heads.safetensors");
  write_bytes(dir / "config.json", R"({"medusa_num_heads": 3, "medusa_num_layers": 1})");
  auto e = checkpoint_error_of(dir, dir, with([](auto& o) { o.strict_config = true; }), {"medusa_num_heads", "3", "2"});
  CHECK(e.code() == checkpoint_errc::config_mismatch);
  // Without strict_config the same finding is a warning and the heads load.
  const auto loaded = medusa::load_heads(dir);
  REQUIRE(loaded.warnings.size() == 1);
  CHECK(loaded.warnings[0].code == checkpoint_errc::config_mismatch);
}

TEST_CASE("checkpoint_error: too_few_heads") {
  const auto dir = fresh_dir("ckpt_few");
  checkpoint_builder().write(dir / "medusa_heads.safetensors");
  auto e = checkpoint_error_of(dir, dir, with([](auto& o) { o.min_heads = 4; }), {"2 heads, at least 4"});
  CHECK(e.code() == checkpoint_errc::too_few_heads);
}

TEST_CASE("checkpoint_error: bad_config") {
  const auto dir = fresh_dir("ckpt_bad_config");
  checkpoint_builder().write(dir / "medusa_heads.safetensors");
  write_bytes(dir / "config.json", R"({"medusa_num_heads": "two"})");
  auto e = checkpoint_error_of(dir, dir, {}, {"config.json", "\"medusa_num_heads\" is not a non-negative integer"});
  CHECK(e.code() == checkpoint_errc::bad_config);
  write_bytes(dir / "config.json", "{");
  auto e2 = checkpoint_error_of(dir, dir, {}, {"config.json", "JSON error"});
  CHECK(e2.code() == checkpoint_errc::bad_config);
}

TEST_CASE("checkpoint_error: invalid_argument") {
  const auto dir = fresh_dir("ckpt_view");
  checkpoint_builder().write(dir / "medusa_heads.safetensors");
  const auto loaded = medusa::load_heads(dir);
  const std::vector<float> lm_head(6 * 4, 0.0f);
  auto e = thrown<medusa::checkpoint_error>(
      [&] { (void)loaded.heads.view(medusa::weight_ptr{lm_head.data(), medusa::weight_dtype::f32}, 6); }, {"call view()"});
  CHECK(e.code() == checkpoint_errc::invalid_argument);
  CHECK(lm_head == std::vector<float>(6 * 4, 0.0f));
}

TEST_CASE("invalid_input / io_error: save_heads leaves no partial output") {
  const auto dir = fresh_dir("save_heads");
  // Heads with no weights set: refused before anything is written.
  medusa::head_stack<> unset(4, 6, 2, 1, medusa::projection_kind::per_head);
  (void)thrown<medusa::invalid_input>([&] { (void)medusa::save_heads(dir / "out", unset); }, {"has no weights set"});
  CHECK(!fs::exists(dir / "out"));
  // config.json cannot be written (a directory is in its place): no weights file either.
  checkpoint_builder().write(dir / "medusa_heads.safetensors");
  const auto heads = medusa::load_heads(dir);
  const auto out = dir / "taken";
  fs::create_directories(out / "config.json" / "inside");
  const auto before = snapshot(dir);
  (void)thrown<medusa::io_error>([&] { (void)medusa::save_heads(out, heads.heads.view()); },
                                 {"config.json: a directory is in the way"});
  CHECK(snapshot(dir) == before);
  // The weights cannot be written (their file name names a missing directory): the config's
  // temporary file and the directories the call created are gone again.
  medusa::head_save_options so;
  so.weights_file = "missing/heads.safetensors";
  (void)thrown<medusa::io_error>([&] { (void)medusa::save_heads(dir / "new" / "deeper", heads.heads.view(), so); },
                                 {"cannot create", "heads.safetensors.tmp"});
  CHECK(snapshot(dir) == before);
}

// ================================================================================================
// decode_error and model_output_error: the caller's prompt unchanged, the decoder still usable
// ================================================================================================

TEST_CASE("decode_error: bad arguments to generate leave the decoder usable") {
  tiny_model model(64);
  tiny::random_heads heads(3, 11);
  const auto t = medusa::tree::from_paths(P{{0}, {1}, {0, 0}});
  medusa::decoder dec(model, heads, t, medusa::greedy_policy{});
  medusa::decode_options opt;
  opt.max_new_tokens = 12;
  const auto good = dec.generate(prompt, opt).tokens;
  struct bad_case {
    std::vector<std::int32_t> prompt;
    medusa::decode_options opt;
    const char* needle;
  };
  medusa::decode_options negative = opt, zero_chunk = opt, cached = opt;
  negative.max_new_tokens = -1;
  zero_chunk.prefill_chunk = 0;
  cached.cached_prompt_tokens = 6;
  const bad_case cases[] = {
      {{}, opt, "the prompt is empty"},
      {{1, 5, 40, 2}, opt, "prompt token #2 = 40 is outside the vocabulary"},
      {std::vector<std::int32_t>(65, 1), opt, "prompt of 65 tokens does not fit the context of 64"},
      {prompt, negative, "max_new_tokens must be >= 0, got -1"},
      {prompt, zero_chunk, "prefill_chunk must be >= 1, got 0"},
      {prompt, cached, "cached_prompt_tokens must be in [0, 5]"},
  };
  for (const bad_case& c : cases) {
    CAPTURE(c.needle);
    const auto copy = c.prompt;
    (void)thrown<medusa::decode_error>([&] { (void)dec.generate(c.prompt, c.opt); }, {c.needle});
    CHECK(c.prompt == copy);
  }
  CHECK(dec.generate(prompt, opt).tokens == good);
}

TEST_CASE("decode_error: too few heads for the tree") {
  tiny_model model(64);
  tiny::random_heads heads(1, 11);
  const auto t = medusa::tree::from_paths(P{{0}, {0, 0}});
  (void)thrown<medusa::decode_error>([&] { medusa::decoder dec(model, heads, t, medusa::greedy_policy{}); },
                                     {"the tree is 2 deep but only 1"});
  CHECK(heads.num_heads() == 1);
}

TEST_CASE("decode_error: join and leave of a batch change nothing when refused") {
  tiny_model weights(64);
  tiny::random_heads heads(3, 11);
  const auto t = medusa::tree::from_paths(P{{0}, {1}, {0, 0}});
  medusa::decode_options opt;
  opt.max_new_tokens = 10;
  const std::vector<std::int32_t> other{3, 8, 1};
  std::map<int, std::vector<std::int32_t>> clean;
  {
    tiny_batch_engine eng(weights, 64, 2);
    medusa::batch_decoder dec(eng, heads, t, medusa::greedy_policy{}, 2);
    dec.join(0, prompt, opt);
    (void)dec.step();
    dec.join(1, other, opt);
    clean = drain(dec);
  }
  tiny_batch_engine eng(weights, 64, 2);
  medusa::batch_decoder dec(eng, heads, t, medusa::greedy_policy{}, 2);
  dec.join(0, prompt, opt);
  (void)dec.step();
  (void)thrown<medusa::decode_error>([&] { dec.join(0, other, opt); }, {"request 0 is already in the batch"});
  (void)thrown<medusa::decode_error>([&] { dec.leave(1); }, {"request 1 is not in the batch"});
  dec.join(1, other, opt);
  (void)thrown<medusa::decode_error>([&] { dec.join(2, other, opt); }, {"the batch is full (2 requests)"});
  CHECK(dec.size() == 2);
  CHECK(other == std::vector<std::int32_t>{3, 8, 1});
  CHECK(drain(dec) == clean);  // the refused calls changed nothing
  (void)thrown<medusa::decode_error>(
      [&] { medusa::batch_decoder bad(eng, heads, t, medusa::greedy_policy{}, 0); }, {"max_batch must be >= 1, got 0"});
}

TEST_CASE("model_output_error: NaN logits and Inf hidden states name the request, step and output") {
  medusa::decode_options opt;
  opt.max_new_tokens = 16;
  tiny::random_heads heads(3, 11);
  const auto t = medusa::tree::from_paths(P{{0}, {1}, {0, 0}});
  for (const auto what : {medusa::model_output::logits, medusa::model_output::hidden}) {
    CAPTURE(medusa::to_string(what));
    tiny_model weights(64);
    faulty_model model{weights, 3, what};
    medusa::decoder dec(model, heads, t, medusa::greedy_policy{});
    const auto copy = prompt;
    auto e = thrown<medusa::model_output_error>(
        [&] { (void)dec.generate(prompt, opt); },
        {"request 0, step 2: non-finite", std::string(medusa::to_string(what)), "from the model"});
    CHECK(e.request() == 0);
    CHECK(e.step() == 2);
    CHECK(e.output() == what);
    CHECK(prompt == copy);
    CHECK_NOTHROW((void)dec.generate(prompt, opt));  // pass 3 is behind: the decoder runs again
  }
}

TEST_CASE("kv_cache_error: invalid_length (a model's own commit miscounts)") {
  tiny_model weights(64);
  miscounting_model model{weights};
  tiny::random_heads heads(3, 11);
  const auto t = medusa::tree::from_paths(P{{0}, {1}, {0, 0}});
  medusa::decoder dec(model, heads, t, medusa::greedy_policy{});
  const auto copy = prompt;
  auto e = thrown<medusa::kv_cache_error>([&] { (void)dec.generate(prompt); }, {"the model's commit returned length"});
  CHECK(e.code() == kv_errc::invalid_length);
  CHECK(prompt == copy);
}

// ================================================================================================
// dispatch_error
// ================================================================================================

TEST_CASE("dispatch_error: unknown policy, head count, value") {
  const std::string name = "fastest", copy = name;
  auto e = thrown<medusa::dispatch_error>([&] { medusa::dispatch_policy(name, {}, [](auto) {}); },
                                          {"unsupported policy 'fastest'", "greedy"});
  CHECK(e.kind() == "policy");
  CHECK(name == copy);
  auto e2 = thrown<medusa::dispatch_error>([] { medusa::dispatch_head_count(0, []<std::size_t H>() {}); },
                                           {"unsupported head count 0"});
  CHECK(e2.kind() == "head count");
  auto e3 = thrown<medusa::dispatch_error>([] { medusa::dispatch_value<1, 2, 4>(3, "width", []<int W>() {}); },
                                           {"unsupported width 3; supported: 1, 2, 4"});
  CHECK(e3.kind() == "width");
}

// ================================================================================================
// launch_error and emulation_error (the CUDA layer's host-side plans and emulation)
// ================================================================================================

TEST_CASE("launch_error: invalid_shape and unsupported") {
  namespace mc = medusa::cuda;
  auto e = thrown<mc::launch_error>([] { (void)mc::kernels::plan_top_k(4, 100, 0); }, {"top-k", "k 0"});
  CHECK(e.code() == mc::launch_errc::invalid_shape);
  auto e2 = thrown<mc::launch_error>([] { (void)mc::kernels::plan_top_k(4, 100, 17); }, {"k = 17 exceeds the 16"});
  CHECK(e2.code() == mc::launch_errc::unsupported);
  const mc::kernels::attention_problem p{.batch = 2, .max_tokens = 8, .max_tokens_per_request = 4, .max_kv_length = 64,
                                         .num_q_heads = 6, .num_kv_heads = 4, .head_dim = 64};
  auto e3 = thrown<mc::launch_error>([&] { (void)mc::kernels::plan_attention(p); }, {"6 query heads are not a multiple of 4"});
  CHECK(e3.code() == mc::launch_errc::invalid_shape);
}

TEST_CASE("emulation_error: a bad launch runs nothing; a divergent barrier is reported") {
  namespace mc = medusa::cuda;
  std::vector<int> out(64, -1);
  auto body = [&](auto& ctx) { out[static_cast<std::size_t>(ctx.thread())] = ctx.thread(); };
  (void)thrown<mc::emulation_error>([&] { mc::emulate({.threads = 48}, body); }, {"multiple of 32", "got 48"});
  CHECK(out == std::vector<int>(64, -1));
  auto divergent = [](auto& ctx) {
    if (ctx.thread() < 16) ctx.sync();
  };
  (void)thrown<mc::emulation_error>([&] { mc::emulate({.threads = 32}, divergent); }, {"barrier that the others never reach"});
}

// ================================================================================================
// invalid_input from the heads
// ================================================================================================

TEST_CASE("invalid_input: head_stack forward with a short buffer writes nothing") {
  const std::size_t d = 4, V = 6, K = 2;
  std::vector<float> w(d * d, 0.1f), b(d, 0.0f), u(V * d, 0.2f);
  medusa::head_stack<> heads(d, V, K, 1, medusa::projection_kind::per_head);
  for (std::size_t h = 0; h < K; ++h) {
    heads.set_resblock(h, 0, {w.data(), medusa::weight_dtype::f32}, {b.data(), medusa::weight_dtype::f32});
    heads.set_projection(h, {u.data(), medusa::weight_dtype::f32});
  }
  const std::vector<float> hidden(d, 1.0f);
  std::vector<float> logits(K * V - 1, 3.0f), ws(heads.workspace_size(1), 0.0f);
  const auto logits_copy = logits;
  medusa::portable_gemm gemm;
  (void)thrown<medusa::invalid_input>([&] { heads.forward(gemm, hidden, 1, logits, ws); }, {"logits has 11 floats, needs 12"});
  CHECK(logits == logits_copy);
  CHECK(hidden == std::vector<float>(d, 1.0f));
}
