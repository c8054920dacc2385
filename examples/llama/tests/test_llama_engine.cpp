// SPDX-License-Identifier: Apache-2.0
// The example Llama engine on small random models it writes itself: batched forward against
// sequential decoding, tree masks against root-to-node causal paths, chunked prefill, argument and
// checkpoint validation.
#include <medusa_llama/llama.hpp>

#include "../src/gemm.hpp"     // private kernels, checked against a naive reference
#include "../src/kernels.hpp"  // have_blas

#include <medusa/decoder.hpp>
#include <medusa/half.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <cstdlib>
#include <vector>

namespace fs = std::filesystem;
using namespace medusa_llama;

namespace {

// A folder per instruction-set entry (MEDUSA_CPU_TARGET): ctest runs them in parallel, and each
// rewrites the same files.
const fs::path tmp_dir = [] {
  const char* target = std::getenv("MEDUSA_CPU_TARGET");
  return fs::path(MEDUSA_TEST_TMPDIR) / (std::string("engine-") + (target != nullptr ? target : "best"));
}();

model_config tiny_config(bool shared = true) {
  model_config c;
  c.dim = 64;
  c.hidden_dim = 96;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;  // GQA
  c.vocab_size = 97;
  c.seq_len = 96;
  c.shared_classifier = shared;
  return c;
}

// The tiny model, written as a llama2.c checkpoint and loaded back (exercises both directions).
model tiny_model(bool shared = true, rope_style rope = rope_style::adjacent_pairs) {
  fs::create_directories(tmp_dir);
  auto c = tiny_config(shared);
  c.rope = rope;
  const auto m = model::random(c, shared ? 7 : 8, 0.2f);
  if (rope == rope_style::split_halves) return m;  // llama2.c files are adjacent-pair only
  const auto path = tmp_dir / (shared ? "llama_tiny.bin" : "llama_tiny_cls.bin");
  m.save_llama2c(path);
  return model::load_llama2c(path);
}

std::vector<int> random_tokens(int n, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int> t(static_cast<std::size_t>(n));
  for (auto& x : t) x = static_cast<int>(rng() % static_cast<unsigned>(vocab));
  return t;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, static_cast<double>(std::abs(a[i] - b[i])));
  return d;
}

// `tokens` as one batch at positions and slots start, start+1, ... (causal unless `mask` is given).
medusa::forward_batch batch_at(const std::vector<int>& tokens, const std::vector<int>& positions, int start,
                               std::span<float> logits, std::span<float> hidden = {}, medusa::tree_mask_view mask = {}) {
  medusa::forward_batch b;
  b.tokens = tokens;
  b.positions = positions;
  b.cache_length = start;
  b.tree_mask = mask;
  b.logits = logits;
  b.hidden = hidden;
  return b;
}

std::vector<int> iota_from(int start, std::size_t n) {
  std::vector<int> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = start + static_cast<int>(i);
  return v;
}

// Logits of every token of `tokens` run one at a time after [0, start).
std::vector<float> sequential_logits(engine& e, const std::vector<int>& tokens, int start) {
  const auto V = static_cast<std::size_t>(e.config().vocab_size);
  std::vector<float> all(tokens.size() * V), one(V);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    e.decode(tokens[i], start + static_cast<int>(i), one);
    std::copy(one.begin(), one.end(), all.begin() + static_cast<std::ptrdiff_t>(i * V));
  }
  return all;
}

// Bytes of the mapping that holds `p` resident in this process (Rss of its /proc/self/smaps
// entry); -1 where there is no smaps (not Linux).
long long resident_bytes_of(const void* p) {
  std::ifstream in("/proc/self/smaps");
  if (!in) return -1;
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    std::uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {  // "lo-hi perms offset dev inode path"
      inside = lo <= addr && addr < hi;
    } else if (inside && line.starts_with("Rss:")) {
      return std::stoll(line.substr(4)) * 1024;
    }
  }
  return -1;
}

}  // namespace

TEST_CASE("an engine releases the mapped matrices it packed; the model still reads them unchanged") {
  fs::create_directories(tmp_dir);
  model_config c = tiny_config(false);
  c.dim = 128;
  c.hidden_dim = 384;
  c.n_heads = 4;
  c.vocab_size = 512;
  const auto owned = model::random(c, 11, 0.2f);
  const auto path = tmp_dir / "llama_release.bin";
  owned.save_llama2c(path);
  const auto m = model::load_llama2c(path);
  CHECK(m.mapped());
  CHECK_FALSE(owned.mapped());
  const std::size_t d = 128, kv = static_cast<std::size_t>(c.kv_dim()), h = 384, V = 512;
  const std::size_t matrix_bytes = sizeof(float) * (2 * (2 * d * d + 2 * kv * d + 3 * h * d) + V * d);
  auto same_weights = [&] {
    bool same = std::equal(owned.classifier(), owned.classifier() + V * d, m.classifier());
    for (int l = 0; l < 2; ++l) {
      const auto &a = owned.layer(l), &b = m.layer(l);
      same = same && std::equal(a.wq, a.wq + d * d, b.wq) && std::equal(a.wk, a.wk + kv * d, b.wk) &&
             std::equal(a.wv, a.wv + kv * d, b.wv) && std::equal(a.wo, a.wo + d * d, b.wo) &&
             std::equal(a.w1, a.w1 + h * d, b.w1) && std::equal(a.w2, a.w2 + d * h, b.w2) && std::equal(a.w3, a.w3 + h * d, b.w3);
    }
    return same;
  };
  REQUIRE(same_weights());  // every page of the file now resident
  const long long before = resident_bytes_of(m.layer(0).wq);
  if (before < 0) {
    MESSAGE("no /proc/self/smaps: residency not checked");
  } else {
    CHECK(before >= static_cast<long long>(matrix_bytes));
  }
  const auto tokens = random_tokens(9, 512, 3);
  std::vector<float> want(V), got(V);
  engine(owned, {.threads = 1, .backend = gemm_backend::builtin}).prefill(tokens, 0, want);
  {
    engine e(m, {.threads = 1, .backend = gemm_backend::builtin});
    if (before >= 0) {
      // Packed matrices and the classifier left the resident set; the embedding and norms may stay.
      const long long after = resident_bytes_of(m.layer(0).wq);
      CAPTURE(before);
      CAPTURE(after);
      CHECK(after <= before - static_cast<long long>(matrix_bytes) + 64 * 1024);
    }
    e.prefill(tokens, 0, got);
    CHECK(got == want);  // the same packed weights: bit for bit
  }
  CHECK(same_weights());  // read again from the file: unchanged
  if (before >= 0) CHECK(resident_bytes_of(m.layer(0).wq) >= static_cast<long long>(matrix_bytes));
  if (detail::have_blas() && before >= 0) {
    // The OpenBLAS path reads the model's own matrices every pass: they stay resident.
    engine e(m, {.threads = 1, .backend = gemm_backend::blas});
    CHECK(resident_bytes_of(m.layer(0).wq) >= static_cast<long long>(matrix_bytes));
  }
}

TEST_CASE("llama2c checkpoint round trip keeps config and weights") {
  const auto m = tiny_model(false);
  const auto& c = m.config();
  CHECK(c.dim == 64);
  CHECK(c.n_kv_heads == 2);
  CHECK_FALSE(c.shared_classifier);
  CHECK(m.classifier() != m.token_embedding());
  const auto r = model::random(tiny_config(false), 8, 0.2f);
  CHECK(std::equal(r.layer(1).w2, r.layer(1).w2 + 64 * 96, m.layer(1).w2));
  CHECK(std::equal(r.classifier(), r.classifier() + 97 * 64, m.classifier()));
  CHECK(m.weight_bytes() == sizeof(float) * (2 * (2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 96 * 64) + 64 + 97 * 64));
}

TEST_CASE("first_layers: the first blocks over the same weights, then the final norm and the classifier") {
  const auto m = model::random(tiny_config(false), 8, 0.2f);
  REQUIRE(m.config().n_layers == 2);
  const auto d = m.first_layers(1);
  CHECK(d.config().n_layers == 1);
  CHECK(m.config().n_layers == 2);
  CHECK(d.layer(0).wq == m.layer(0).wq);  // shared, not copied
  CHECK(d.rms_final() == m.rms_final());
  CHECK(d.classifier() == m.classifier());
  CHECK(d.weight_bytes() < m.weight_bytes());
  CHECK_THROWS_AS((void)m.first_layers(0), load_error);
  CHECK_THROWS_AS((void)m.first_layers(3), load_error);
}

TEST_CASE("batched forward equals sequential single-token forwards") {
  for (bool shared : {true, false})
    for (auto backend : {gemm_backend::builtin, gemm_backend::blas})
      for (int threads : {1, 2}) {
        CAPTURE(shared);
        CAPTURE(static_cast<int>(backend));
        CAPTURE(threads);
        engine e(tiny_model(shared), {.max_batch = 32, .threads = threads, .backend = backend});
        const auto V = static_cast<std::size_t>(e.config().vocab_size);
        const auto D = static_cast<std::size_t>(e.config().dim);
        const auto prefix = random_tokens(5, 97, 1);
        const auto batch = random_tokens(19, 97, 2);
        std::vector<float> last(V);
        e.prefill(prefix, 0, last, {});
        const auto seq = sequential_logits(e, batch, 5);
        // Now the same 19 tokens as one causal batch after the same prefix.
        const auto pos = iota_from(5, batch.size());
        std::vector<float> logits(batch.size() * V), hidden(batch.size() * D);
        e.forward(batch_at(batch, pos, 5, logits, hidden));
        // The built-in kernels: a row's logits have the same bits alone as in a batch (what keeps
        // greedy Medusa identical to plain decoding); OpenBLAS blocks its sums by the batch size.
        if (backend == gemm_backend::builtin)
          CHECK(max_abs_diff(seq, logits) == 0.0);
        else
          CHECK(max_abs_diff(seq, logits) < 1e-4);
        // Hidden states are the final-normed vectors: their classifier product is the logits.
        const float* cls = e.weights().classifier();
        double dl = 0;
        for (std::size_t v = 0; v < V; ++v) {
          double s = 0;
          for (std::size_t k = 0; k < D; ++k) s += static_cast<double>(cls[v * D + k]) * hidden[3 * D + k];
          dl = std::max(dl, std::abs(s - logits[3 * V + v]));
        }
        CHECK(dl < 1e-4);
        // Only the rows from first_output_row on: the same values.
        auto tail = batch_at(batch, pos, 5, std::span(logits).first(4 * V));
        tail.first_output_row = 15;
        std::vector<float> whole(logits);
        e.forward(tail);
        CHECK(max_abs_diff(std::vector<float>(logits.begin(), logits.begin() + static_cast<std::ptrdiff_t>(4 * V)),
                           std::vector<float>(whole.begin() + static_cast<std::ptrdiff_t>(15 * V), whole.end())) < 1e-5);
      }
}

TEST_CASE("an engine on another engine's pool computes what it computes on its own threads") {
  // A draft model runs on the target's threads (engine_options::pool): the same bits, one pool.
  engine target(tiny_model(), {.max_batch = 32, .threads = 2});
  engine own(tiny_model(false), {.max_batch = 32, .threads = 2});
  engine shared(tiny_model(false), {.max_batch = 32, .threads = 7, .pool = &target.pool()});
  CHECK(shared.threads() == 2);  // the pool's size; `threads` is ignored
  CHECK(&shared.pool() == &target.pool());
  const auto V = static_cast<std::size_t>(own.config().vocab_size);
  const auto tokens = random_tokens(23, 97, 4);
  const auto pos = iota_from(0, tokens.size());
  std::vector<float> a(tokens.size() * V), b(tokens.size() * V), t(tokens.size() * V);
  own.forward(batch_at(tokens, pos, 0, a));
  shared.forward(batch_at(tokens, pos, 0, b));
  target.forward(batch_at(tokens, pos, 0, t));  // the pool's owner, in turn
  CHECK(max_abs_diff(a, b) == 0.0);
  shared.forward(batch_at(tokens, pos, 0, b));
  CHECK(max_abs_diff(a, b) == 0.0);
}

TEST_CASE("tree-mask forward equals each root-to-node path run causally") {
  // parent[i] < i; depth from the parents. Node 0 is the root.
  const std::vector<int> parent = {-1, 0, 0, 1, 1, 2, 3, 0, 6, 5};
  const int N = static_cast<int>(parent.size());
  std::vector<int> depth(static_cast<std::size_t>(N), 0);
  for (int i = 1; i < N; ++i) depth[static_cast<std::size_t>(i)] = depth[static_cast<std::size_t>(parent[static_cast<std::size_t>(i)])] + 1;
  std::vector<std::uint32_t> mask(static_cast<std::size_t>(N), 0);
  for (int i = 0; i < N; ++i)
    for (int j = i; j >= 0; j = parent[static_cast<std::size_t>(j)]) mask[static_cast<std::size_t>(i)] |= 1u << j;
  const auto tok = random_tokens(N, 97, 3);
  for (auto rope : {rope_style::adjacent_pairs, rope_style::split_halves}) {
    engine e(tiny_model(true, rope), {.threads = 2});
    const auto V = static_cast<std::size_t>(e.config().vocab_size);
    const int L = 7;
    std::vector<float> scratch(V);
    e.prefill(random_tokens(L, 97, 4), 0, scratch, {});
    std::vector<int> pos(static_cast<std::size_t>(N));
    for (int i = 0; i < N; ++i) pos[static_cast<std::size_t>(i)] = L + depth[static_cast<std::size_t>(i)];
    std::vector<float> tree_logits(static_cast<std::size_t>(N) * V);
    e.forward(batch_at(tok, pos, L, tree_logits, {}, medusa::tree_mask_view{mask, 1}));
    for (int i = 0; i < N; ++i) {
      std::vector<int> path;
      for (int j = i; j >= 0; j = parent[static_cast<std::size_t>(j)]) path.insert(path.begin(), tok[static_cast<std::size_t>(j)]);
      std::vector<float> last(V);
      e.prefill(path, L, last, {});
      const std::vector<float> row(tree_logits.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(i) * V),
                                   tree_logits.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(i + 1) * V));
      CHECK_MESSAGE(max_abs_diff(row, last) < 1e-4, "node " << i);
    }
  }
}

TEST_CASE("causal batches longer than max_batch run in chunks with the same result") {
  const auto prompt = random_tokens(75, 97, 5);
  std::vector<float> a(97), b(97), ha(64), hb(64);
  engine e1(tiny_model(), {.max_batch = 96, .threads = 1});
  engine e2(tiny_model(), {.max_batch = 16, .threads = 2});
  e1.prefill(prompt, 0, a, ha);
  e2.prefill(prompt, 0, b, hb);
  CHECK(max_abs_diff(a, b) < 1e-4);
  CHECK(max_abs_diff(ha, hb) < 1e-4);
  const auto k1 = e1.kv_cache(), k2 = e2.kv_cache();
  REQUIRE(k1.num_layers() == 2);
  CHECK(k1.num_kv_heads() == 2);
  CHECK(k1.head_dim() == 16);
  for (int l = 0; l < 2; ++l) {
    const std::vector<float> x(k1.v_row(l, 0, 0), k1.v_row(l, 0, 0) + 75 * 32), y(k2.v_row(l, 0, 0), k2.v_row(l, 0, 0) + 75 * 32);
    CHECK(max_abs_diff(x, y) < 1e-4);
  }
}

TEST_CASE("greedy decoding through the library's loop is argmax decoding; sampling is seeded") {
  engine e(tiny_model(), {.threads = 2});
  const std::vector<std::int32_t> prompt = {1, 5, 9};
  medusa::decode_options opt;
  opt.max_new_tokens = 20;
  const auto g = medusa::generate_vanilla(e, prompt, medusa::greedy_policy{}, opt);
  REQUIRE(g.tokens.size() == 20);
  // Replay: each token is the argmax after the prompt and the previous tokens.
  std::vector<int> ctx(prompt.begin(), prompt.end());
  std::vector<float> logits(97);
  for (int t : g.tokens) {
    e.prefill(ctx, 0, logits, {});
    CHECK(medusa::argmax(logits) == t);
    ctx.push_back(t);
  }
  medusa::rejection_policy hot;
  hot.temperature = 1.0f;
  opt.max_new_tokens = 15;
  opt.seed = 42;
  const auto s1 = medusa::generate_vanilla(e, prompt, hot, opt);
  const auto s2 = medusa::generate_vanilla(e, prompt, hot, opt);
  CHECK(s1.tokens == s2.tokens);
  opt.max_new_tokens = 20;
  opt.eos_token = g.tokens[3];
  const auto stop = medusa::generate_vanilla(e, prompt, medusa::greedy_policy{}, opt);
  CHECK(stop.reason == medusa::stop_reason::eos);
  CHECK(stop.tokens.size() <= 3);
}

TEST_CASE("forward rejects inconsistent arguments without writing") {
  engine e(tiny_model(), {.capacity = 40, .max_batch = 8, .threads = 2});
  std::vector<float> logits(97);
  const std::vector<int> p = {1, 2, 3, 4};
  e.prefill(p, 0, logits, {});
  const auto kv = e.kv_cache();
  const std::vector<float> before(kv.k_row(0, 0, 0), kv.k_row(0, 0, 0) + 40 * 32);
  auto code_of = [&](auto&& f) {
    try {
      f();
    } catch (const engine_error& x) {
      CHECK(std::string(x.what()).rfind("medusa: ", 0) == 0);
      return x.code();
    }
    FAIL("no exception");
    return engine_errc::bad_option;
  };
  auto one = [&](int tok, int pos, int L) {
    const std::vector<int> t{tok}, p{pos};
    e.forward(batch_at(t, p, L, logits));
  };
  CHECK(code_of([&] { one(97, 4, 4); }) == engine_errc::bad_token);
  CHECK(code_of([&] { one(-1, 4, 4); }) == engine_errc::bad_token);
  CHECK(code_of([&] { one(5, 96, 4); }) == engine_errc::bad_position);
  CHECK(code_of([&] { one(5, 4, 40); }) == engine_errc::bad_slot);   // beyond the capacity
  CHECK(code_of([&] { one(5, 4, -1); }) == engine_errc::bad_slot);
  const std::vector<int> none, tok1{1}, pos2{4, 5}, tok2{1, 2}, nine(9, 1), nine_pos(9, 4);
  CHECK(code_of([&] { e.forward(batch_at(nine, nine_pos, 35, {})); }) == engine_errc::bad_slot);
  CHECK(code_of([&] { e.forward(batch_at(none, none, 4, {})); }) == engine_errc::bad_batch);
  CHECK(code_of([&] { e.forward(batch_at(tok1, pos2, 4, {})); }) == engine_errc::bad_batch);
  const std::uint32_t no_diag[2] = {0x1, 0x1};
  const std::uint32_t high_bits[2] = {0x1, 0x7};
  const std::uint32_t later[2] = {0x3, 0x3};  // row 0 sees row 1, which is not its ancestor
  const std::uint32_t ok_mask[2] = {0x1, 0x3};
  auto two = [&](std::span<const std::uint32_t> m, std::span<float> lg, std::span<float> hid = {}, int first = 0) {
    auto b = batch_at(tok2, pos2, 4, lg, hid, medusa::tree_mask_view{m, 1});
    b.first_output_row = first;
    e.forward(b);
  };
  CHECK(code_of([&] { two(no_diag, {}); }) == engine_errc::bad_mask);
  CHECK(code_of([&] { two(high_bits, {}); }) == engine_errc::bad_mask);
  CHECK(code_of([&] { two(later, {}); }) == engine_errc::bad_mask);
  CHECK(code_of([&] { two(std::span<const std::uint32_t>(ok_mask, 1), {}); }) == engine_errc::bad_mask);
  const std::vector<std::uint32_t> nine_rows(9, 1);
  CHECK(code_of([&] { e.forward(batch_at(nine, nine_pos, 4, {}, {}, medusa::tree_mask_view{nine_rows, 1})); }) ==
        engine_errc::bad_batch);
  CHECK(code_of([&] { two(ok_mask, logits, {}, 2); }) == engine_errc::bad_output);
  std::vector<float> small(96);
  CHECK(code_of([&] { two(ok_mask, small); }) == engine_errc::bad_output);
  CHECK(code_of([&] { two(ok_mask, {}, small); }) == engine_errc::bad_output);
  const std::vector<float> after(kv.k_row(0, 0, 0), kv.k_row(0, 0, 0) + 40 * 32);
  CHECK(after == before);  // nothing was written
  CHECK(code_of([&] { engine bad(tiny_model(), {.max_batch = 0}); }) == engine_errc::bad_option);
  CHECK(code_of([&] { engine bad(tiny_model(), {.weights = weight_format::int8}); }) == engine_errc::bad_option);
  CHECK(code_of([&] { engine bad(tiny_model(), {.classifier_weights = weight_format::int8}); }) == engine_errc::bad_option);
  CHECK(code_of([&] { engine bad(tiny_model(), {.weights = static_cast<weight_format>(42)}); }) == engine_errc::bad_option);
  CHECK(code_of([&] { e.prefill(std::vector<int>(37, 1), 4, logits, {}); }) == engine_errc::bad_slot);  // 41 > capacity
  std::vector<float> two_rows(2 * 97);
  two(ok_mask, two_rows);
  two(ok_mask, logits, {}, 1);  // the last row only
  CHECK(max_abs_diff(logits, std::vector<float>(two_rows.begin() + 97, two_rows.end())) < 1e-5);
}

TEST_CASE("llama2c loader rejects truncated, oversized and inconsistent checkpoints") {
  const auto good = tmp_dir / "llama_tiny.bin";
  (void)tiny_model();
  std::ifstream in(good, std::ios::binary);
  const std::string bytes(std::istreambuf_iterator<char>(in), {});
  auto expect = [&](const std::string& b, load_errc code) {
    const auto p = tmp_dir / "llama_bad.bin";
    {
      std::ofstream out(p, std::ios::binary | std::ios::trunc);
      out.write(b.data(), static_cast<std::streamsize>(b.size()));
    }
    try {
      (void)model::load_llama2c(p);
      FAIL("no exception");
    } catch (const load_error& e) {
      CHECK(e.code() == code);
      CHECK(e.path() == p.string());
      MESSAGE(e.what());
    }
  };
  expect(bytes.substr(0, 20), load_errc::truncated);
  expect(bytes.substr(0, bytes.size() - 4), load_errc::truncated);
  expect(bytes + "1234", load_errc::size_mismatch);
  auto patched = [&](int field, std::int32_t v) {
    std::string b = bytes;
    std::memcpy(b.data() + 4 * field, &v, 4);
    return b;
  };
  expect(patched(0, 0), load_errc::bad_header);            // dim 0
  expect(patched(3, 5), load_errc::bad_header);            // dim 64 not a multiple of 5 heads
  expect(patched(4, 3), load_errc::bad_header);            // 4 heads not a multiple of 3 kv heads
  expect(patched(2, 1 << 30), load_errc::bad_header);      // absurd layer count
  expect(patched(5, INT32_MIN), load_errc::bad_header);    // vocab
  expect(patched(5, -97), load_errc::truncated);           // separate classifier that is not there
  try {
    (void)model::load_llama2c(tmp_dir / "does-not-exist.bin");
    FAIL("no exception");
  } catch (const load_error& e) {
    CHECK(e.code() == load_errc::open_failed);
  }
  CHECK_THROWS_AS((void)model::load_llama2c(tmp_dir), load_error);  // a directory
}

TEST_CASE("HF loader rejects bad configs") {
  const auto dir = tmp_dir / "llama_hf_bad";
  fs::create_directories(dir);
  auto expect = [&](const std::string& cfg, load_errc code) {
    std::ofstream(dir / "config.json", std::ios::trunc) << cfg;
    try {
      (void)model::load_hf(dir);
      FAIL("no exception");
    } catch (const load_error& e) {
      CHECK(e.code() == code);
    }
  };
  expect("{", load_errc::bad_json);
  expect(R"({"model_type": "gpt2"})", load_errc::unsupported);
  expect(R"({"hidden_size": 64})", load_errc::bad_json);
  const std::string base = R"("hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 96)";
  expect("{" + base + R"(, "hidden_act": "gelu"})", load_errc::unsupported);
  expect("{" + base + R"(, "rope_scaling": {"type": "linear", "factor": 2}})", load_errc::unsupported);
  expect("{" + base + R"(, "num_attention_heads": "four"})", load_errc::bad_json);
  expect(R"({"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 5, "vocab_size": 97, "max_position_embeddings": 96})",
         load_errc::bad_header);
  fs::remove(dir / "model.safetensors");
  expect("{" + base + "}", load_errc::open_failed);  // no model.safetensors
  std::ofstream(dir / "model.safetensors", std::ios::binary | std::ios::trunc) << "abc";
  expect("{" + base + "}", load_errc::truncated);
}

TEST_CASE("thread_pool runs every chunk exactly once") {
  thread_pool pool(2);
  CHECK(pool.size() == 2);
  std::vector<std::atomic<int>> hits(1000);
  for (int rep = 0; rep < 200; ++rep) {
    const int n = 1 + rep % 37;
    pool.run(n, [&](int c, int tid) {
      CHECK((tid >= 0 && tid < 2));
      hits[static_cast<std::size_t>(c)].fetch_add(1);
    });
  }
  int total = 0;
  for (auto& h : hits) total += h.load();
  int want = 0;
  for (int rep = 0; rep < 200; ++rep) want += 1 + rep % 37;
  CHECK(total == want);
  CHECK_THROWS_AS(thread_pool(-1), engine_error);
}

namespace {

// Naive double-precision Y = X W^T (plus the op) over weights/activations given as floats.
std::vector<double> naive_gemm(const std::vector<float>& W, const std::vector<float>& W3, const std::vector<float>& X,
                               const std::vector<float>& Y0, int T, int rows, int in, detail::epilogue op) {
  std::vector<double> y(static_cast<std::size_t>(T) * static_cast<std::size_t>(rows));
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < rows; ++r) {
      double s = 0, u = 0;
      for (int k = 0; k < in; ++k) {
        const double x = X[static_cast<std::size_t>(t * in + k)];
        s += x * W[static_cast<std::size_t>(r * in + k)];
        if (op == detail::epilogue::swiglu) u += x * W3[static_cast<std::size_t>(r * in + k)];
      }
      const auto i = static_cast<std::size_t>(t * rows + r);
      y[i] = op == detail::epilogue::add ? Y0[i] + s : op == detail::epilogue::swiglu ? s / (1.0 + std::exp(-s)) * u : s;
    }
  return y;
}

// The int8 packing's weights: per row (output column) w ≈ round(w / s) · s, s = max |w| / 127.
std::vector<float> rounded_int8(const std::vector<float>& v, int rows, int in) {
  std::vector<float> out(v.size());
  for (int r = 0; r < rows; ++r) {
    const float* w = v.data() + static_cast<std::size_t>(r) * static_cast<std::size_t>(in);
    float amax = 0.0f;
    for (int k = 0; k < in; ++k) amax = std::max(amax, std::abs(w[k]));
    const float s = amax / 127.0f;
    for (int k = 0; k < in; ++k)
      out[static_cast<std::size_t>(r) * static_cast<std::size_t>(in) + static_cast<std::size_t>(k)] =
          s > 0.0f ? std::clamp(std::nearbyint(w[k] / s), -127.0f, 127.0f) * s : 0.0f;
  }
  return out;
}

// The int8 kernels' activations: each row quantized the same way as a weight row.
std::vector<float> quantized_rows(const std::vector<float>& x, int T, int in) { return rounded_int8(x, T, in); }

// The block formats' weights as the kernels see them: each row's blocks of 32 quantized by the
// GGUF rule and dequantized with the binary16 scale.
std::vector<float> rounded_blocks(const std::vector<float>& v, int rows, int in, weight_format fmt) {
  std::vector<float> out(v.size());
  for (int r = 0; r < rows; ++r)
    for (int k0 = 0; k0 < in; k0 += 32) {
      const std::size_t at = static_cast<std::size_t>(r) * static_cast<std::size_t>(in) + static_cast<std::size_t>(k0);
      const int n = std::min(32, in - k0);
      std::int8_t q[32];
      const std::uint16_t h = fmt == weight_format::q8_0 ? detail::quantize_block_q8_0(v.data() + at, n, q)
                                                         : detail::quantize_block_q4_0(v.data() + at, n, q);
      const float d = medusa::detail::half_bits_to_float(h);
      for (int i = 0; i < n; ++i) out[at + static_cast<std::size_t>(i)] = d * static_cast<float>(q[i]);
    }
  return out;
}

// The block kernels' activations: per row and block of 32, s = max |x| / 127, x ≈ rint(x / s) · s.
std::vector<float> quantized_blocks(const std::vector<float>& x, int T, int in) {
  std::vector<float> out(x.size());
  for (int t = 0; t < T; ++t)
    for (int k0 = 0; k0 < in; k0 += 32) {
      const std::size_t at = static_cast<std::size_t>(t) * static_cast<std::size_t>(in) + static_cast<std::size_t>(k0);
      const int n = std::min(32, in - k0);
      float amax = 0.0f;
      for (int i = 0; i < n; ++i) amax = std::max(amax, std::abs(x[at + static_cast<std::size_t>(i)]));
      const float s = amax / 127.0f;
      for (int i = 0; i < n; ++i)
        out[at + static_cast<std::size_t>(i)] = s > 0.0f ? std::nearbyint(x[at + static_cast<std::size_t>(i)] * (1.0f / s)) * s : 0.0f;
    }
  return out;
}

std::vector<float> rounded_bf16(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = detail::bf16_to_float(detail::bf16_round(v[i]));
  return r;
}

}  // namespace

TEST_CASE("packed kernels equal a naive GEMM for ragged shapes, every format and epilogue") {
  std::mt19937 rng(123);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto rnd = [&](std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = u(rng);
    return v;
  };
  const int shapes[][2] = {{1, 1}, {5, 3}, {16, 16}, {17, 31}, {33, 64}, {50, 100}, {96, 7}, {130, 45}};
  const int batches[] = {1, 2, 3, 5, 7, 8, 9, 13, 17, 64};
  int cases = 0;
  for (auto fmt : {weight_format::f32, weight_format::bf16, weight_format::int8, weight_format::q8_0, weight_format::q4_0})
    for (const auto& sh : shapes)
      for (int T : batches)
        for (auto op : {detail::epilogue::store, detail::epilogue::add, detail::epilogue::swiglu}) {
          const int rows = sh[0], in = sh[1];
          CAPTURE(static_cast<int>(fmt));
          CAPTURE(rows);
          CAPTURE(in);
          CAPTURE(T);
          CAPTURE(static_cast<int>(op));
          const auto n_w = static_cast<std::size_t>(rows) * static_cast<std::size_t>(in);
          auto W = rnd(n_w), W3 = rnd(n_w);
          // Activation rows with a stride wider than `in`, as the engine's scratch buffers have.
          const int ldx = in + 3;
          auto Xs = rnd(static_cast<std::size_t>(T) * static_cast<std::size_t>(ldx));
          std::vector<float> X(static_cast<std::size_t>(T) * static_cast<std::size_t>(in));
          for (int t = 0; t < T; ++t)
            for (int k = 0; k < in; ++k) X[static_cast<std::size_t>(t * in + k)] = Xs[static_cast<std::size_t>(t * ldx + k)];
          const bool swiglu = op == detail::epilogue::swiglu;
          const auto P = swiglu ? detail::packed_matrix::swiglu_pair(W.data(), W3.data(), rows, in, fmt)
                                : detail::packed_matrix(W.data(), rows, in, fmt);
          // Output rows with a stride wider than `rows`; the gap must stay untouched.
          const int ldy = rows + 5;
          auto Y = rnd(static_cast<std::size_t>(T) * static_cast<std::size_t>(ldy));
          const auto Yin = Y;
          std::vector<float> Y0(static_cast<std::size_t>(T) * static_cast<std::size_t>(rows));
          for (int t = 0; t < T; ++t)
            for (int r = 0; r < rows; ++r) Y0[static_cast<std::size_t>(t * rows + r)] = Y[static_cast<std::size_t>(t * ldy + r)];
          // The groups in two uneven calls, as two threads would run them.
          const int split = P.groups() / 3;
          const detail::gemm_input gi{Xs.data(), static_cast<std::size_t>(ldx), T};
          detail::gemm_packed(P, gi, Y.data(), static_cast<std::size_t>(ldy), 0, split, op);
          detail::gemm_packed(P, gi, Y.data(), static_cast<std::size_t>(ldy), split, P.groups(), op);
          // bf16 / int8: the reference takes the rounded weights (and, for int8, the quantized
          // activation rows), so only the
          // summation order differs.
          auto rounded = [&](const std::vector<float>& w) {
            if (fmt == weight_format::bf16) return rounded_bf16(w);
            if (fmt == weight_format::int8) return rounded_int8(w, rows, in);
            if (fmt == weight_format::q8_0 || fmt == weight_format::q4_0) return rounded_blocks(w, rows, in, fmt);
            return w;
          };
          const auto Xr = fmt == weight_format::int8                                ? quantized_rows(X, T, in)
                          : fmt == weight_format::q8_0 || fmt == weight_format::q4_0 ? quantized_blocks(X, T, in)
                                                                                     : X;
          const auto ref = naive_gemm(rounded(W), rounded(W3), Xr, Y0, T, rows, in, op);
          double err = 0;
          bool gap_kept = true;
          for (int t = 0; t < T; ++t) {
            for (int r = 0; r < rows; ++r)
              err = std::max(err, std::abs(ref[static_cast<std::size_t>(t * rows + r)] - Y[static_cast<std::size_t>(t * ldy + r)]));
            for (int r = rows; r < ldy; ++r) gap_kept = gap_kept && Y[static_cast<std::size_t>(t * ldy + r)] == Yin[static_cast<std::size_t>(t * ldy + r)];
          }
          // |terms| ≤ 1, in ≤ 100 terms: float32 accumulation error stays far below 1e-4.
          CHECK(err < 1e-4);
          CHECK(gap_kept);
          ++cases;
        }
  CHECK(cases == 5 * 8 * 10 * 3);
  CHECK(detail::bf16_round(1.0f) == 0x3f80);
  CHECK(detail::bf16_round(1.00390625f) == 0x3f80);  // halfway: ties to even
  CHECK(detail::bf16_round(1.01171875f) == 0x3f82);  // halfway: ties to even (up)
  CHECK(std::isnan(detail::bf16_to_float(detail::bf16_round(std::nanf("")))));
}

TEST_CASE("bf16 weights: close to float32, batched equals sequential") {
  const auto m = tiny_model(false);
  engine e32(m, {.max_batch = 32, .threads = 2});
  engine e16(m, {.max_batch = 32, .threads = 2, .weights = weight_format::bf16});
  CHECK(e16.options().weights == weight_format::bf16);
  const auto V = static_cast<std::size_t>(e32.config().vocab_size);
  const auto prefix = random_tokens(5, 97, 1);
  const auto batch = random_tokens(19, 97, 2);
  std::vector<float> last(V);
  e32.prefill(prefix, 0, last, {});
  e16.prefill(prefix, 0, last, {});
  const auto seq32 = sequential_logits(e32, batch, 5);
  const auto seq16 = sequential_logits(e16, batch, 5);
  double scale = 0;
  for (float x : seq32) scale = std::max(scale, static_cast<double>(std::abs(x)));
  const double d = max_abs_diff(seq32, seq16);
  MESSAGE("bf16 vs f32: max |logit diff| " << d << " (max |logit| " << scale << ")");
  CHECK(d > 0);             // the bf16 path really ran
  CHECK(d < 0.03 * scale);  // 8-bit mantissas through 2 layers: about 1% of the logit range
  // Batched vs sequential in bf16: the same float32 arithmetic on the same rounded weights, the
  // same bits.
  std::vector<float> logits(batch.size() * V);
  e16.forward(batch_at(batch, iota_from(5, batch.size()), 5, logits));
  const double db = max_abs_diff(seq16, logits);
  MESSAGE("bf16 batched vs sequential: " << db);
  CHECK(db == 0.0);
  // Greedy continuations agree for a while at least (weights rounding moves near-ties).
  medusa::decode_options opt;
  opt.max_new_tokens = 24;
  const std::vector<std::int32_t> prompt(prefix.begin(), prefix.end());
  const auto g32 = medusa::generate_vanilla(e32, prompt, medusa::greedy_policy{}, opt);
  const auto g16 = medusa::generate_vanilla(e16, prompt, medusa::greedy_policy{}, opt);
  int agree = 0;
  while (agree < 24 && g32.tokens[static_cast<std::size_t>(agree)] == g16.tokens[static_cast<std::size_t>(agree)]) ++agree;
  MESSAGE("greedy prefix agreement " << agree << " / 24");
  CHECK(agree >= 4);
}
