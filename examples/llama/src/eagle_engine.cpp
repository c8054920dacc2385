// SPDX-License-Identifier: Apache-2.0
// The feature drafter: the input projection on the pool, then the one-layer stack (layer_stack.hpp)
// over the projected rows, one contiguous cache per request.
#include <medusa_llama/eagle_engine.hpp>
#include <medusa_llama/errors.hpp>
#include <medusa_llama/thread_pool.hpp>

#include "gemm.hpp"
#include "layer_stack.hpp"

#include <medusa/error.hpp>
#include <medusa/kv_cache.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <utility>

namespace medusa_llama {

namespace {
std::size_t sz(int v) { return static_cast<std::size_t>(v); }

constexpr std::array<char, 8> fc_magic = {'M', 'E', 'D', 'U', 'S', 'A', 'F', 'C'};
constexpr std::int32_t fc_version = 1;
}  // namespace

std::vector<float> load_eagle_fc(const std::filesystem::path& path, int dim) {
  const std::string where = path.string();
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw load_error(load_errc::open_failed, "cannot open the feature drafter's input projection", where);
  const auto size = static_cast<std::uint64_t>(in.tellg());
  in.seekg(0);
  std::array<char, 8> magic{};
  std::int32_t head[3] = {};
  if (size < 20 || !in.read(magic.data(), 8) || !in.read(reinterpret_cast<char*>(head), sizeof head))
    throw load_error(load_errc::truncated, "the input projection ends inside its 20-byte header", where);
  if (magic != fc_magic) throw load_error(load_errc::bad_header, "not an input projection file (no MEDUSAFC magic)", where);
  if (head[0] != fc_version)
    throw load_error(load_errc::unsupported, "input projection version " + std::to_string(head[0]) + " (this reader: 1)", where);
  if (head[1] != 2 * dim || head[2] != dim)
    throw load_error(load_errc::size_mismatch,
                     "the input projection is " + std::to_string(head[2]) + " x " + std::to_string(head[1]) +
                         ", the model width " + std::to_string(dim) + " needs " + std::to_string(dim) + " x " +
                         std::to_string(2 * dim),
                     where);
  const std::uint64_t want = 20 + sizeof(float) * static_cast<std::uint64_t>(dim) * 2 * static_cast<std::uint64_t>(dim);
  if (size < want) throw load_error(load_errc::truncated, "the input projection ends before its weights do", where);
  if (size > want) throw load_error(load_errc::size_mismatch, "the input projection is longer than its header says", where);
  std::vector<float> fc(sz(dim) * 2 * sz(dim));
  in.read(reinterpret_cast<char*>(fc.data()), static_cast<std::streamsize>(fc.size() * sizeof(float)));
  if (!in) throw load_error(load_errc::truncated, "the input projection could not be read", where);
  return fc;
}

void save_eagle_fc(const std::filesystem::path& path, const std::vector<float>& fc, int dim) {
  if (fc.size() != sz(dim) * 2 * sz(dim))
    throw medusa::invalid_input("input projection: " + std::to_string(fc.size()) + " weights for width " + std::to_string(dim));
  std::ofstream out(path, std::ios::binary);
  const std::int32_t head[3] = {fc_version, 2 * dim, dim};
  out.write(fc_magic.data(), 8);
  out.write(reinterpret_cast<const char*>(head), sizeof head);
  out.write(reinterpret_cast<const char*>(fc.data()), static_cast<std::streamsize>(fc.size() * sizeof(float)));
  if (!out) throw medusa::io_error("cannot write the input projection " + path.string());
}

struct eagle_engine::impl {
  detail::layer_stack stack;
  detail::packed_matrix fc;  // W_fc [dim][2·dim], packed as the layer's projections
  eagle_options opt;
  struct cache {
    std::vector<float> k, v;  // [capacity][kv_dim]
    medusa::kv_cache_view<float> view;
  };
  std::map<int, cache> caches;
  std::vector<float> x, u;  // projected rows [max_rows][dim]; concatenated inputs [max_rows][2·dim]
  std::vector<int> out_rows;
  // A batched pass's rows, segments and outputs (`forward_batch`).
  std::vector<std::int32_t> tokens, positions;
  std::vector<detail::segment<medusa::kv_cache_view<float>>> segments;
  std::vector<float> logits, hidden;

  impl(model m, std::vector<float> w, const eagle_options& o)
      : stack(std::move(m), {.max_rows = o.max_rows, .threads = o.threads, .pool = o.pool, .weights = o.weights}),
        fc(w.data(), stack.config().dim, 2 * stack.config().dim, o.weights),
        opt(o) {}

  [[nodiscard]] const model_config& config() const noexcept { return stack.config(); }

  cache& cache_of(int request) {
    auto [it, fresh] = caches.try_emplace(request);
    if (fresh) {
      const model_config& c = config();
      it->second.k.assign(sz(c.seq_len) * sz(c.kv_dim()), 0.0f);
      it->second.v.assign(it->second.k.size(), 0.0f);
      it->second.view = medusa::make_kv_view<float>(std::span<float>(it->second.k), std::span<float>(it->second.v),
                                                    medusa::kv_extents{1, c.n_kv_heads, c.head_dim()}, c.seq_len,
                                                    medusa::kv_layout::nhd);
    }
    return it->second;
  }

  void validate(const medusa::feature_batch& b) const {
    const model_config& c = config();
    const auto T = b.tokens.size();
    auto fail = [](engine_errc code, const std::string& msg) { throw engine_error(code, "feature drafter: " + msg); };
    if (T < 1) fail(engine_errc::bad_batch, "empty batch");
    if (b.positions.size() != T || b.features.size() != T * sz(c.dim))
      fail(engine_errc::bad_batch, "batch of " + std::to_string(T) + " tokens has " + std::to_string(b.positions.size()) +
                                       " positions and " + std::to_string(b.features.size()) + " feature values (" +
                                       std::to_string(c.dim) + " a row)");
    if (b.cache_length < 0 || T > sz(c.seq_len) || b.cache_length > c.seq_len - static_cast<int>(T))
      fail(engine_errc::bad_slot, "batch of " + std::to_string(T) + " rows at cache length " + std::to_string(b.cache_length) +
                                      " does not fit the context " + std::to_string(c.seq_len));
    detail::check_rows(c, b.tokens, b.positions, 0, "feature drafter: ", b.request);
    if (b.outputs < 1 || sz(b.outputs) > T)
      fail(engine_errc::bad_output, "outputs for " + std::to_string(b.outputs) + " of " + std::to_string(T) + " rows");
    detail::check_outputs(c, sz(b.outputs), b.logits, b.hidden);
    if (!b.tree_mask.empty()) {
      // A tree's rows see each other only within one pass: no chunks.
      if (static_cast<int>(T) > opt.max_rows)
        fail(engine_errc::bad_batch, "a tree pass of " + std::to_string(T) + " rows exceeds max_rows " +
                                         std::to_string(opt.max_rows));
      detail::check_tree_mask(b.tree_mask, static_cast<int>(T));
    }
  }

  // The inputs [E(token); feature] of rows [r0, r0 + n) of `b`, to rows from `at` of `u`.
  void gather(const medusa::feature_batch& b, int r0, int n, int at) {
    const std::size_t d = sz(config().dim), in = 2 * d;
    const float* emb = stack.weights().token_embedding();
    for (int i = 0; i < n; ++i) {
      float* u_row = u.data() + sz(at + i) * in;
      std::memcpy(u_row, emb + sz(b.tokens[sz(r0 + i)]) * d, d * sizeof(float));
      std::memcpy(u_row + d, b.features.data() + sz(r0 + i) * d, d * sizeof(float));
    }
  }

  // x = W_fc u for the first n rows: one GEMM on the engine's kernels.
  void project(int n) {
    const std::size_t in = 2 * sz(config().dim);
    const detail::gemm_job job{&fc, detail::gemm_input{u.data(), in, n}, x.data(), sz(config().dim), detail::epilogue::store};
    detail::run_gemm_jobs(stack.pool(), std::span(&job, 1));
  }

  void forward(const medusa::feature_batch& b) {
    validate(b);
    cache& kv = cache_of(b.request);
    const int T = static_cast<int>(b.tokens.size());
    const int first_out = T - b.outputs;
    const std::size_t V = sz(config().vocab_size), d = sz(config().dim);
    for (int c0 = 0; c0 < T; c0 += opt.max_rows) {
      const int n = std::min(opt.max_rows, T - c0);
      gather(b, c0, n, 0);
      project(n);
      // Output rows of this chunk, local to it; they go to the outputs' rows from `done` on.
      out_rows.clear();
      for (int i = std::max(c0, first_out); i < c0 + n; ++i) out_rows.push_back(i - c0);
      const std::size_t done = sz(std::max(0, c0 - first_out));
      const detail::segment<medusa::kv_cache_view<float>> seg{0, n, b.cache_length + c0, kv.view, b.tree_mask};
      stack.run(b.tokens.subspan(sz(c0), sz(n)), b.positions.subspan(sz(c0), sz(n)), std::span(&seg, 1),
                std::span<const int>(out_rows), !out_rows.empty() && !b.logits.empty() ? b.logits.data() + done * V : nullptr,
                !out_rows.empty() && !b.hidden.empty() ? b.hidden.data() + done * d : nullptr, x.data());
    }
  }

  // Batches of several requests in passes of at most max_rows rows, each batch one segment over its
  // request's cache; a batch longer than that runs alone, in chunks. A row's results do not depend
  // on the other rows of its pass (the kernels' row invariance), so each batch gets what `forward`
  // gives it.
  void forward_batch(std::span<const medusa::feature_batch> bs) {
    for (std::size_t i = 0; i < bs.size(); ++i) {
      validate(bs[i]);
      for (std::size_t j = 0; j < i; ++j)
        if (bs[i].request == bs[j].request)
          throw engine_error(engine_errc::bad_batch, "feature drafter: request " + std::to_string(bs[i].request) +
                                                         " appears twice in one batched pass");
    }
    for (std::size_t i = 0; i < bs.size();) {
      if (static_cast<int>(bs[i].tokens.size()) > opt.max_rows) {
        forward(bs[i++]);
        continue;
      }
      std::size_t j = i;
      for (int rows = 0; j < bs.size() && rows + static_cast<int>(bs[j].tokens.size()) <= opt.max_rows; ++j)
        rows += static_cast<int>(bs[j].tokens.size());
      run_together(bs.subspan(i, j - i));
      i = j;
    }
  }

  // One pass over whole batches that fit max_rows together.
  void run_together(std::span<const medusa::feature_batch> bs) {
    const std::size_t V = sz(config().vocab_size), d = sz(config().dim);
    tokens.clear();
    positions.clear();
    segments.clear();
    out_rows.clear();
    int rows = 0;
    for (const medusa::feature_batch& b : bs) {
      const int T = static_cast<int>(b.tokens.size());
      gather(b, 0, T, rows);
      tokens.insert(tokens.end(), b.tokens.begin(), b.tokens.end());
      positions.insert(positions.end(), b.positions.begin(), b.positions.end());
      segments.push_back({rows, T, b.cache_length, cache_of(b.request).view, b.tree_mask});
      for (int k = T - b.outputs; k < T; ++k) out_rows.push_back(rows + k);
      rows += T;
    }
    project(rows);
    logits.resize(out_rows.size() * V);
    hidden.resize(out_rows.size() * d);
    stack.run(std::span<const std::int32_t>(tokens), std::span<const std::int32_t>(positions),
              std::span<const detail::segment<medusa::kv_cache_view<float>>>(segments), std::span<const int>(out_rows),
              logits.data(), hidden.data(), x.data());
    std::size_t o = 0;
    for (const medusa::feature_batch& b : bs) {
      const auto outs = sz(b.outputs);
      if (!b.logits.empty()) std::copy_n(logits.begin() + static_cast<std::ptrdiff_t>(o * V), outs * V, b.logits.begin());
      if (!b.hidden.empty()) std::copy_n(hidden.begin() + static_cast<std::ptrdiff_t>(o * d), outs * d, b.hidden.begin());
      o += outs;
    }
  }
};

eagle_engine::eagle_engine(model layer, std::vector<float> fc, eagle_options o) {
  const model_config& c = layer.config();
  auto bad = [](const std::string& msg) { throw engine_error(engine_errc::bad_option, "feature drafter: " + msg); };
  if (c.n_layers != 1) bad("its model has " + std::to_string(c.n_layers) + " layers, a feature drafter one");
  if (fc.size() != sz(c.dim) * 2 * sz(c.dim))
    bad("its input projection has " + std::to_string(fc.size()) + " weights, width " + std::to_string(c.dim) + " needs " +
        std::to_string(2 * c.dim * c.dim));
  if (o.max_rows < 1 || o.max_rows > 4096) bad("max_rows " + std::to_string(o.max_rows) + " is outside [1, 4096]");
  if (o.weights == weight_format::int8) bad("int8 is a format for Medusa heads; the drafter takes f32, bf16, q8_0 or q4_0");
  detail::check_stack_options({.threads = o.threads, .weights = o.weights});
  p_ = std::make_unique<impl>(std::move(layer), std::move(fc), o);
  p_->x.resize(sz(o.max_rows) * sz(c.dim));
  p_->u.resize(sz(o.max_rows) * 2 * sz(c.dim));
  p_->out_rows.reserve(sz(o.max_rows));
}

eagle_engine eagle_engine::load(const std::filesystem::path& dir, const model_config& target, eagle_options o) {
  std::error_code ec;
  const bool hf = std::filesystem::exists(dir / "config.json", ec);
  model m = hf ? model::load_hf(dir) : model::load_llama2c(dir / "model.bin");
  const model_config& c = m.config();
  if (c.dim != target.dim || c.vocab_size != target.vocab_size)
    throw load_error(load_errc::size_mismatch,
                     "the feature drafter has width " + std::to_string(c.dim) + " and a vocabulary of " +
                         std::to_string(c.vocab_size) + ", the target width " + std::to_string(target.dim) + " and " +
                         std::to_string(target.vocab_size),
                     dir.string());
  auto fc = load_eagle_fc(dir / eagle_fc_file, c.dim);
  return eagle_engine(std::move(m), std::move(fc), o);
}

eagle_engine::eagle_engine(eagle_engine&&) noexcept = default;
eagle_engine& eagle_engine::operator=(eagle_engine&&) noexcept = default;
eagle_engine::~eagle_engine() = default;

const model_config& eagle_engine::config() const noexcept { return p_->config(); }
int eagle_engine::vocab_size() const noexcept { return p_->config().vocab_size; }
int eagle_engine::hidden_size() const noexcept { return p_->config().dim; }
int eagle_engine::max_context() const noexcept { return p_->config().seq_len; }
void eagle_engine::forward(const medusa::feature_batch& b) { p_->forward(b); }
void eagle_engine::forward_batch(std::span<const medusa::feature_batch> batches) { p_->forward_batch(batches); }
void eagle_engine::release(int request) { p_->caches.erase(request); }
int eagle_engine::requests() const noexcept { return static_cast<int>(p_->caches.size()); }

}  // namespace medusa_llama
