// SPDX-License-Identifier: Apache-2.0
// The serving engine: a paged KV pool with per-request block tables, and ragged batches cut into
// passes of the layer stack (layer_stack.hpp), one segment per request (or piece of a request).
#include <medusa_llama/batch_engine.hpp>
#include <medusa_llama/thread_pool.hpp>

#include "layer_stack.hpp"

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

std::string request_name(int r) { return "request " + std::to_string(r); }

}  // namespace

struct batch_engine::impl {
  detail::layer_stack stack;
  batch_engine_options opt;
  medusa::kv_extents ext;
  std::vector<float> k_pool, v_pool;                // [layer][page][page_size][kv_dim]
  std::vector<std::vector<std::int32_t>> tables;    // per request: logical block -> page
  std::vector<std::int32_t> free_list;              // free pages, handed out from the back
  int peak = 0;
  // Scratch of one forward (kept: no allocation per pass once grown).
  std::vector<detail::segment<paged_view>> segments;
  std::vector<int> out_rows;
  std::vector<char> seen;

  impl(model m, const batch_engine_options& o)
      : stack(std::move(m), {.max_rows = o.max_tokens, .threads = o.threads, .weights = o.weights,
                              .classifier_weights = o.classifier_weights}), opt(o) {
    opt.threads = stack.pool().size();
    const model_config& c = stack.config();
    ext = {c.n_layers, c.n_kv_heads, c.head_dim()};
    k_pool.assign(sz(c.n_layers) * sz(opt.num_pages) * sz(opt.page_size) * sz(c.kv_dim()), 0.0f);
    v_pool.assign(k_pool.size(), 0.0f);
    tables.resize(sz(opt.max_requests));
    for (auto& t : tables) t.reserve(sz(medusa::kv_pages_for(opt.max_context, opt.page_size)));  // views stay valid
    // A fixed shuffle: consecutive reservations get scattered pages, as in a pool that has served
    // many requests.
    free_list.resize(sz(opt.num_pages));
    for (int p = 0; p < opt.num_pages; ++p) free_list[sz(p)] = p;
    std::shuffle(free_list.begin(), free_list.end(), std::mt19937(0x5eed));
    seen.assign(sz(opt.max_requests), 0);
  }

  [[nodiscard]] const model_config& config() const noexcept { return stack.config(); }
  [[nodiscard]] int in_use() const noexcept { return opt.num_pages - static_cast<int>(free_list.size()); }

  void check_request(int r) const {
    if (r < 0 || r >= opt.max_requests)
      fail(engine_errc::bad_request, request_name(r) + " is outside [0, max_requests " + std::to_string(opt.max_requests) + ")", r);
  }

  paged_view view(int r) {
    return medusa::make_paged_kv_view<float>(std::span<float>(k_pool), std::span<float>(v_pool), ext, opt.page_size,
                                             medusa::kv_layout::nhd, std::span<const std::int32_t>(tables[sz(r)]));
  }

  void reserve(int r, int slots) {
    check_request(r);
    if (slots < 0 || slots > opt.max_context)
      fail(engine_errc::bad_slot, request_name(r) + ": " + std::to_string(slots) + " slots are outside [0, max_context " + std::to_string(opt.max_context) + "]", r);
    auto& table = tables[sz(r)];
    const int need = medusa::kv_pages_to_map(static_cast<int>(table.size()), 0, slots, opt.page_size);
    if (need > static_cast<int>(free_list.size()))
      fail(engine_errc::out_of_pages, request_name(r) + ": " + std::to_string(slots) + " slots need " + std::to_string(need) + " more pages of " +
                                          std::to_string(opt.page_size) + " (it holds " + std::to_string(table.size()) + "), the pool has " +
                                          std::to_string(free_list.size()) + " free of " + std::to_string(opt.num_pages), r);
    for (int i = 0; i < need; ++i) {
      table.push_back(free_list.back());
      free_list.pop_back();
    }
    peak = std::max(peak, in_use());
  }

  void release(int r, int length) {
    check_request(r);
    if (length < 0) fail(engine_errc::bad_slot, request_name(r) + ": release to negative length " + std::to_string(length), r);
    auto& table = tables[sz(r)];
    for (int n = medusa::kv_pages_releasable(static_cast<int>(table.size()), length, opt.page_size); n > 0; --n) {
      free_list.push_back(table.back());
      table.pop_back();
    }
  }

  void validate(const medusa::ragged_batch& b) {
    const model_config& c = config();
    const std::size_t B = b.requests.size();
    if (B == 0) fail(engine_errc::bad_batch, "ragged batch of no requests");
    if (b.qo_indptr.size() != B + 1 || b.cache_lengths.size() != B)
      fail(engine_errc::bad_batch, "ragged batch of " + std::to_string(B) + " requests has " + std::to_string(b.qo_indptr.size()) +
                                       " qo_indptr entries (needs B + 1) and " + std::to_string(b.cache_lengths.size()) + " cache lengths");
    if (b.qo_indptr[0] != 0) fail(engine_errc::bad_batch, "qo_indptr[0] is " + std::to_string(b.qo_indptr[0]) + ", not 0");
    for (std::size_t i = 0; i < B; ++i)
      if (b.qo_indptr[i + 1] < b.qo_indptr[i])
        fail(engine_errc::bad_batch, "qo_indptr decreases at entry " + std::to_string(i + 1) + " (" + std::to_string(b.qo_indptr[i]) +
                                         " -> " + std::to_string(b.qo_indptr[i + 1]) + ")");
    const int T = b.qo_indptr[B];
    if (T < 1) fail(engine_errc::bad_batch, "ragged batch of no tokens");
    if (b.tokens.size() != sz(T) || b.positions.size() != sz(T))
      fail(engine_errc::bad_batch, "qo_indptr announces " + std::to_string(T) + " tokens; the batch has " + std::to_string(b.tokens.size()) +
                                       " tokens and " + std::to_string(b.positions.size()) + " positions");
    // Request ids: in range and each at most once (a request's K/V rows go to one place).
    std::fill(seen.begin(), seen.end(), 0);
    for (std::size_t i = 0; i < B; ++i) {
      const int r = b.requests[i];
      check_request(r);
      if (seen[sz(r)] != 0) fail(engine_errc::bad_request, request_name(r) + " appears twice in the batch", r);
      seen[sz(r)] = 1;
    }
    const bool tree = !b.tree_mask.empty() || !b.request_masks.empty();
    if (!b.request_masks.empty() && b.request_masks.size() != B)
      fail(engine_errc::bad_batch, "request_masks has " + std::to_string(b.request_masks.size()) + " masks for " +
                                       std::to_string(B) + " requests");
    int widest = 0;
    for (std::size_t i = 0; i < B; ++i) {
      const int r = b.requests[i], q0 = b.qo_indptr[i], n = b.qo_indptr[i + 1] - q0, L = b.cache_lengths[i];
      const std::string who = request_name(r) + ": ";
      if (n == 0 && b.last_row_only) fail(engine_errc::bad_batch, who + "no tokens, but last_row_only asks for its last row", r);
      detail::check_rows(c, b.tokens.subspan(sz(q0), sz(n)), b.positions.subspan(sz(q0), sz(n)), q0, who, r);
      if (L < 0 || L > opt.max_context - n)
        fail(engine_errc::bad_slot, who + std::to_string(n) + " tokens at cache length " + std::to_string(L) + " do not fit max_context " +
                                        std::to_string(opt.max_context), r);
      const int mapped = static_cast<int>(tables[sz(r)].size()) * opt.page_size;
      if (L + n > mapped)
        fail(engine_errc::bad_slot, who + "slots [" + std::to_string(L) + ", " + std::to_string(L + n) + ") are not all mapped (it holds " +
                                        std::to_string(tables[sz(r)].size()) + " page(s) of " + std::to_string(opt.page_size) + " slots; reserve first)", r);
      if (tree && n > opt.max_tokens)
        fail(engine_errc::bad_batch, who + "tree of " + std::to_string(n) + " tokens exceeds max_tokens " + std::to_string(opt.max_tokens), r);
      widest = std::max(widest, n);
      if (!b.request_masks.empty()) detail::check_tree_mask(b.request_masks[i], n);
    }
    // One check for all: the first n_b rows of a mask valid for the widest request are valid too.
    if (tree && b.request_masks.empty()) detail::check_tree_mask(b.tree_mask, widest);
    detail::check_outputs(c, b.last_row_only ? B : sz(T), b.logits, b.hidden);
  }

  // Requests in batch order fill passes of at most max_tokens rows: a causal request is cut where a
  // pass is full (its pieces see the earlier ones through the cache), a tree request starts a new
  // pass when it does not fit the current one. A pass covers consecutive batch rows, and its output
  // rows are consecutive output rows.
  void forward(const medusa::ragged_batch& b) {
    validate(b);
    const int B = b.size();
    const bool tree = !b.tree_mask.empty() || !b.request_masks.empty();
    const bool wanted = !b.logits.empty() || !b.hidden.empty();
    const std::size_t V = sz(config().vocab_size), d = sz(config().dim);
    int pass0 = 0, rows = 0, out0 = -1;  // first batch row of the pass, its rows, its first output row
    auto flush = [&] {
      if (rows == 0) return;
      const std::size_t o = out0 < 0 ? 0 : sz(out0);
      stack.run(b.tokens.subspan(sz(pass0), sz(rows)), b.positions.subspan(sz(pass0), sz(rows)),
                std::span<const detail::segment<paged_view>>(segments), std::span<const int>(out_rows),
                b.logits.empty() ? nullptr : b.logits.data() + o * V, b.hidden.empty() ? nullptr : b.hidden.data() + o * d);
      pass0 += rows;
      rows = 0;
      out0 = -1;
      segments.clear();
      out_rows.clear();
    };
    for (int i = 0; i < B; ++i) {
      const int r = b.requests[sz(i)], n = b.count(i), L = b.cache_lengths[sz(i)];
      if (tree && rows + n > opt.max_tokens) flush();
      for (int done = 0; done < n;) {
        if (rows == opt.max_tokens) flush();
        const int piece = tree ? n : std::min(n - done, opt.max_tokens - rows);
        segments.push_back({rows, piece, L + done, view(r), b.mask_of(i)});
        if (wanted && b.last_row_only && done + piece == n) {
          out_rows.push_back(rows + piece - 1);
          if (out0 < 0) out0 = i;
        } else if (wanted && !b.last_row_only) {
          for (int k = 0; k < piece; ++k) out_rows.push_back(rows + k);
          if (out0 < 0) out0 = b.qo_indptr[sz(i)] + done;
        }
        rows += piece;
        done += piece;
      }
    }
    flush();
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
  p_->check_request(request);
  return p_->view(request);
}

void batch_engine::reserve(int request, int slots) { p_->reserve(request, slots); }
void batch_engine::release(int request, int length) { p_->release(request, length); }
void batch_engine::forward(const medusa::ragged_batch& batch) { p_->forward(batch); }

int batch_engine::pages_mapped(int request) const {
  p_->check_request(request);
  return static_cast<int>(p_->tables[sz(request)].size());
}
int batch_engine::pages_in_use() const noexcept { return p_->in_use(); }
int batch_engine::peak_pages_in_use() const noexcept { return p_->peak; }
void batch_engine::reset_peak() noexcept { p_->peak = p_->in_use(); }
int batch_engine::free_pages() const noexcept { return static_cast<int>(p_->free_list.size()); }
int batch_engine::threads() const noexcept { return p_->stack.pool().size(); }
thread_pool& batch_engine::pool() noexcept { return p_->stack.pool(); }

}  // namespace medusa_llama
