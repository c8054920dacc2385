// SPDX-License-Identifier: Apache-2.0
// The serving engine: a paged KV pool with per-request block tables, and ragged batches cut into
// passes of the layer stack (layer_stack.hpp), one segment per request (or piece of a request).
#include <medusa_llama/batch_engine.hpp>
#include <medusa_llama/thread_pool.hpp>

#include "layer_stack.hpp"
#include "ragged.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace medusa_llama {

namespace {

std::size_t sz(int v) { return static_cast<std::size_t>(v); }

using paged_view = medusa::paged_kv_cache_view<float>;

[[noreturn]] void fail(engine_errc code, const std::string& msg, int request = -1) {
  throw engine_error(code, msg, request);
}

}  // namespace

struct batch_engine::impl {
  detail::layer_stack stack;
  batch_engine_options opt;
  medusa::kv_extents ext;
  std::vector<float> k_pool, v_pool;                // [layer][page][page_size][kv_dim]
  detail::page_allocator pages;
  // Scratch of one forward (kept: no allocation per pass once grown).
  std::vector<detail::segment<paged_view>> segments;
  std::vector<char> seen;

  impl(model m, const batch_engine_options& o)
      : stack(std::move(m), {.max_rows = o.max_tokens, .threads = o.threads, .pool = o.pool, .weights = o.weights,
                              .classifier_weights = o.classifier_weights}),
        opt(o),
        pages(o.num_pages, o.page_size, o.max_requests, o.max_context) {
    opt.threads = stack.pool().size();
    const model_config& c = stack.config();
    ext = {c.n_layers, c.n_kv_heads, c.head_dim()};
    k_pool.assign(sz(c.n_layers) * sz(opt.num_pages) * sz(opt.page_size) * sz(c.kv_dim()), 0.0f);
    v_pool.assign(k_pool.size(), 0.0f);
  }

  [[nodiscard]] const model_config& config() const noexcept { return stack.config(); }

  paged_view view(int r) {
    return medusa::make_paged_kv_view<float>(std::span<float>(k_pool), std::span<float>(v_pool), ext, opt.page_size,
                                             medusa::kv_layout::nhd, std::span<const std::int32_t>(pages.table(r)));
  }

  void validate(const medusa::ragged_batch& b) {
    detail::check_ragged_batch(config(),
                               {.max_requests = opt.max_requests, .max_context = opt.max_context,
                                .max_tokens = opt.max_tokens, .page_size = opt.page_size},
                               b, [this](int r) { return pages.mapped_slots(r); }, seen);
  }

  // One pass of the layer stack per pass of detail::for_each_pass.
  void forward(const medusa::ragged_batch& b) {
    validate(b);
    const std::size_t V = sz(config().vocab_size), d = sz(config().dim);
    detail::for_each_pass(b, opt.max_tokens, [&](const detail::pass_plan& p) {
      segments.clear();
      for (const detail::pass_piece& piece : p.pieces)
        segments.push_back({piece.row0, piece.rows, piece.cache_length, view(piece.request), piece.mask});
      const std::size_t o = sz(p.first_output);
      stack.run(b.tokens.subspan(sz(p.first_row), sz(p.rows)), b.positions.subspan(sz(p.first_row), sz(p.rows)),
                std::span<const detail::segment<paged_view>>(segments), p.out_rows,
                b.logits.empty() ? nullptr : b.logits.data() + o * V, b.hidden.empty() ? nullptr : b.hidden.data() + o * d);
    });
  }
};

batch_engine::batch_engine(model m, batch_engine_options o) {
  const model_config& c = m.config();
  auto bad = [](const std::string& msg) { fail(engine_errc::bad_option, msg); };
  if (o.page_size < 1 || o.page_size > 4096) bad("page_size " + std::to_string(o.page_size) + " is outside [1, 4096]");
  if (o.max_requests < 1 || o.max_requests > (1 << 16)) bad("max_requests " + std::to_string(o.max_requests) + " is outside [1, 2^16]");
  if (o.max_context == 0) o.max_context = c.seq_len;
  if (o.max_context < 1 || o.max_context > (1 << 24)) bad("max_context " + std::to_string(o.max_context) + " is outside [1, 2^24]");
  if (o.max_tokens < 1 || o.max_tokens > 4096) bad("max_tokens " + std::to_string(o.max_tokens) + " is outside [1, 4096]");
  const long long full = static_cast<long long>(o.max_requests) * medusa::kv_pages_for(o.max_context, o.page_size);
  if (o.num_pages == 0) o.num_pages = static_cast<int>(std::min<long long>(full, std::numeric_limits<int>::max()));
  if (o.num_pages < 1 || o.num_pages > (1 << 24)) bad("num_pages " + std::to_string(o.num_pages) + " is outside [1, 2^24]");
  const double floats = 2.0 * o.num_pages * o.page_size * c.n_layers * c.kv_dim();
  if (floats > 0x1p36)
    bad("a pool of " + std::to_string(o.num_pages) + " pages of " + std::to_string(o.page_size) +
        " slots needs more than 2^36 floats for K and V");
  detail::check_stack_options({.threads = o.threads, .weights = o.weights, .classifier_weights = o.classifier_weights});
  p_ = std::make_unique<impl>(std::move(m), o);
}

batch_engine::batch_engine(batch_engine&&) noexcept = default;
batch_engine& batch_engine::operator=(batch_engine&&) noexcept = default;
batch_engine::~batch_engine() = default;

const model_config& batch_engine::config() const noexcept { return p_->config(); }
const model& batch_engine::weights() const noexcept { return p_->stack.weights(); }
const batch_engine_options& batch_engine::options() const noexcept { return p_->opt; }
int batch_engine::vocab_size() const noexcept { return p_->config().vocab_size; }
int batch_engine::hidden_size() const noexcept { return p_->config().dim; }
int batch_engine::max_context() const noexcept { return p_->opt.max_context; }

medusa::paged_kv_cache_view<float> batch_engine::kv_cache(int request) {
  p_->pages.check_request(request);
  return p_->view(request);
}

void batch_engine::reserve(int request, int slots) { p_->pages.reserve(request, slots); }
void batch_engine::release(int request, int length) { p_->pages.release(request, length); }
void batch_engine::forward(const medusa::ragged_batch& batch) { p_->forward(batch); }

int batch_engine::pages_mapped(int request) const {
  p_->pages.check_request(request);
  return static_cast<int>(p_->pages.table(request).size());
}
int batch_engine::pages_in_use() const noexcept { return p_->pages.in_use(); }
int batch_engine::peak_pages_in_use() const noexcept { return p_->pages.peak(); }
void batch_engine::reset_peak() noexcept { p_->pages.reset_peak(); }
int batch_engine::free_pages() const noexcept { return p_->pages.free_pages(); }
int batch_engine::threads() const noexcept { return p_->stack.pool().size(); }
thread_pool& batch_engine::pool() noexcept { return p_->stack.pool(); }

}  // namespace medusa_llama
