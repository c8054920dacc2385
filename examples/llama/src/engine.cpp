// SPDX-License-Identifier: Apache-2.0
// The single-request engine: one contiguous NHD cache; a forward is a pass of the layer stack
// (layer_stack.hpp) with one segment, or consecutive passes for a causal batch over max_batch.
#include <medusa_llama/engine.hpp>
#include <medusa_llama/thread_pool.hpp>

#include "layer_stack.hpp"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace medusa_llama {

namespace {
std::size_t sz(int v) { return static_cast<std::size_t>(v); }
}  // namespace

struct engine::impl {
  detail::layer_stack stack;
  engine_options opt;
  std::vector<float> k_cache, v_cache;  // [layer][capacity][kv_dim]
  medusa::kv_cache_view<float> kv;      // the cache as the library sees it (NHD)
  std::vector<int> out_rows;            // output rows of the current chunk

  impl(model m, const engine_options& o)
      : stack(std::move(m), {.max_rows = o.max_batch, .threads = o.threads, .pool = o.pool, .backend = o.backend,
                             .blas_min_batch = o.blas_min_batch, .weights = o.weights,
                             .classifier_weights = o.classifier_weights}),
        opt(o) {
    opt.threads = stack.pool().size();
  }

  [[nodiscard]] const model_config& config() const noexcept { return stack.config(); }

  void validate(const medusa::forward_batch& b) const {
    const model_config& c = config();
    const auto T = b.tokens.size();
    auto fail = [](engine_errc code, const std::string& msg) { throw engine_error(code, msg); };
    if (T < 1) fail(engine_errc::bad_batch, "empty batch");
    if (b.positions.size() != T)
      fail(engine_errc::bad_batch, "batch of " + std::to_string(T) + " tokens has " + std::to_string(b.positions.size()) + " positions");
    const int L = b.cache_length;
    if (L < 0 || T > sz(opt.capacity) || L > opt.capacity - static_cast<int>(T))
      fail(engine_errc::bad_slot, "batch of " + std::to_string(T) + " tokens at cache length " + std::to_string(L) +
                                      " does not fit the capacity " + std::to_string(opt.capacity));
    const int n = static_cast<int>(T);
    detail::check_rows(c, b.tokens, b.positions, 0);
    if (!b.tree_mask.empty()) {
      if (n > opt.max_batch)
        fail(engine_errc::bad_batch, "tree batch of " + std::to_string(n) + " tokens exceeds max_batch " + std::to_string(opt.max_batch));
      detail::check_tree_mask(b.tree_mask, n);
    }
    if (b.first_output_row < 0 || b.first_output_row >= n)
      fail(engine_errc::bad_output, "first output row " + std::to_string(b.first_output_row) + " is outside the batch [0, " + std::to_string(n) + ")");
    detail::check_outputs(c, T - sz(b.first_output_row), b.logits, b.hidden);
  }

  // Causal batches longer than max_batch run as consecutive chunks, each a one-segment pass.
  void forward(const medusa::forward_batch& b) {
    validate(b);
    const int T = static_cast<int>(b.tokens.size());
    const std::size_t V = sz(config().vocab_size), d = sz(config().dim);
    const int maxb = b.tree_mask.empty() ? opt.max_batch : T;
    for (int c0 = 0; c0 < T; c0 += maxb) {
      const int n = std::min(maxb, T - c0);
      const int first = std::max(b.first_output_row - c0, 0);  // output rows of this chunk: [first, n)
      const std::size_t o0 = sz(c0 + first - b.first_output_row);
      out_rows.clear();
      for (int r = first; r < n; ++r) out_rows.push_back(r);
      const detail::segment<medusa::kv_cache_view<float>> seg{0, n, b.cache_length + c0, kv, b.tree_mask};
      stack.run(b.tokens.subspan(sz(c0), sz(n)), b.positions.subspan(sz(c0), sz(n)), std::span(&seg, 1),
                std::span<const int>(out_rows), !out_rows.empty() && !b.logits.empty() ? b.logits.data() + o0 * V : nullptr,
                !out_rows.empty() && !b.hidden.empty() ? b.hidden.data() + o0 * d : nullptr);
    }
  }
};

engine::engine(model m, engine_options o) {
  const auto& c = m.config();
  auto bad = [](const std::string& msg) { throw engine_error(engine_errc::bad_option, msg); };
  if (o.capacity == 0) o.capacity = c.seq_len;
  if (o.capacity < 1 || o.capacity > (1 << 24)) bad("capacity " + std::to_string(o.capacity) + " is outside [1, 2^24]");
  if (o.max_batch < 1 || o.max_batch > 4096) bad("max_batch " + std::to_string(o.max_batch) + " is outside [1, 4096]");
  detail::check_stack_options({.threads = o.threads, .blas_min_batch = o.blas_min_batch, .weights = o.weights,
                               .classifier_weights = o.classifier_weights});
  p_ = std::make_unique<impl>(std::move(m), o);
  auto& s = *p_;
  const auto& cc = s.config();
  s.k_cache.assign(sz(cc.n_layers) * sz(o.capacity) * sz(cc.kv_dim()), 0.0f);
  s.v_cache.assign(s.k_cache.size(), 0.0f);
  s.out_rows.reserve(sz(o.max_batch));
  s.kv = medusa::make_kv_view<float>(std::span<float>(s.k_cache), std::span<float>(s.v_cache),
                                     medusa::kv_extents{cc.n_layers, cc.n_kv_heads, cc.head_dim()}, o.capacity,
                                     medusa::kv_layout::nhd);
}

engine::engine(engine&&) noexcept = default;
engine& engine::operator=(engine&&) noexcept = default;
engine::~engine() = default;

const model_config& engine::config() const noexcept { return p_->config(); }
const model& engine::weights() const noexcept { return p_->stack.weights(); }
std::size_t engine::weight_bytes() const noexcept { return p_->stack.packed_bytes(); }
const engine_options& engine::options() const noexcept { return p_->opt; }
int engine::vocab_size() const noexcept { return p_->config().vocab_size; }
int engine::hidden_size() const noexcept { return p_->config().dim; }
medusa::kv_cache_view<float> engine::kv_cache() noexcept { return p_->kv; }
int engine::capacity() const noexcept { return p_->opt.capacity; }
int engine::threads() const noexcept { return p_->stack.pool().size(); }
thread_pool& engine::pool() noexcept { return p_->stack.pool(); }

void engine::forward(const medusa::forward_batch& batch) { p_->forward(batch); }

void engine::prefill(std::span<const int> tokens, int start, std::span<float> last_logits, std::span<float> last_hidden) {
  const int n = static_cast<int>(tokens.size());
  if (n < 1) throw engine_error(engine_errc::bad_batch, "prefill of an empty prompt");
  std::vector<std::int32_t> positions(tokens.size());
  for (int i = 0; i < n; ++i) positions[sz(i)] = start + i;
  medusa::forward_batch b;
  b.tokens = tokens;
  b.positions = positions;
  b.cache_length = start;
  b.first_output_row = n - 1;
  b.logits = last_logits;
  b.hidden = last_hidden;
  forward(b);
}

void engine::decode(int token, int pos, std::span<float> logits, std::span<float> hidden) {
  medusa::forward_batch b;
  b.tokens = std::span<const std::int32_t>(&token, 1);
  b.positions = std::span<const std::int32_t>(&pos, 1);
  b.cache_length = pos;
  b.logits = logits;
  b.hidden = hidden;
  forward(b);
}

}  // namespace medusa_llama
