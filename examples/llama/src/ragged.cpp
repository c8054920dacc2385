// SPDX-License-Identifier: Apache-2.0
#include "ragged.hpp"

#include <medusa_llama/errors.hpp>

#include "layer_stack.hpp"

#include <medusa/kv_cache.hpp>

#include <algorithm>
#include <random>
#include <string>

namespace medusa_llama::detail {

namespace {

std::size_t sz(int v) { return static_cast<std::size_t>(v); }

[[noreturn]] void fail(engine_errc code, const std::string& msg, int request = -1) {
  throw engine_error(code, msg, request);
}

std::string request_name(int r) { return "request " + std::to_string(r); }

}  // namespace

page_allocator::page_allocator(int num_pages, int page_size, int max_requests, int max_context)
    : num_pages_(num_pages), page_size_(page_size), max_requests_(max_requests), max_context_(max_context) {
  tables_.resize(sz(max_requests));
  for (auto& t : tables_) t.reserve(sz(medusa::kv_pages_for(max_context, page_size)));  // views stay valid
  free_.resize(sz(num_pages));
  for (int p = 0; p < num_pages; ++p) free_[sz(p)] = p;
  std::shuffle(free_.begin(), free_.end(), std::mt19937(0x5eed));
}

void page_allocator::check_request(int r) const {
  if (r < 0 || r >= max_requests_)
    fail(engine_errc::bad_request, request_name(r) + " is outside [0, max_requests " + std::to_string(max_requests_) + ")", r);
}

void page_allocator::reserve(int r, int slots) {
  check_request(r);
  if (slots < 0 || slots > max_context_)
    fail(engine_errc::bad_slot, request_name(r) + ": " + std::to_string(slots) + " slots are outside [0, max_context " +
                                    std::to_string(max_context_) + "]", r);
  auto& table = tables_[sz(r)];
  const int need = medusa::kv_pages_to_map(static_cast<int>(table.size()), 0, slots, page_size_);
  if (need > static_cast<int>(free_.size()))
    fail(engine_errc::out_of_pages, request_name(r) + ": " + std::to_string(slots) + " slots need " + std::to_string(need) +
                                        " more pages of " + std::to_string(page_size_) + " (it holds " + std::to_string(table.size()) +
                                        "), the pool has " + std::to_string(free_.size()) + " free of " + std::to_string(num_pages_), r);
  for (int i = 0; i < need; ++i) {
    table.push_back(free_.back());
    free_.pop_back();
  }
  peak_ = std::max(peak_, in_use());
}

void page_allocator::release(int r, int length) {
  check_request(r);
  if (length < 0) fail(engine_errc::bad_slot, request_name(r) + ": release to negative length " + std::to_string(length), r);
  auto& table = tables_[sz(r)];
  for (int n = medusa::kv_pages_releasable(static_cast<int>(table.size()), length, page_size_); n > 0; --n) {
    free_.push_back(table.back());
    table.pop_back();
  }
}

void check_ragged_batch(const model_config& c, const ragged_limits& lim, const medusa::ragged_batch& b,
                        const std::function<int(int request)>& mapped_slots, std::vector<char>& seen) {
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
  seen.assign(sz(lim.max_requests), 0);
  for (std::size_t i = 0; i < B; ++i) {
    const int r = b.requests[i];
    if (r < 0 || r >= lim.max_requests)
      fail(engine_errc::bad_request, request_name(r) + " is outside [0, max_requests " + std::to_string(lim.max_requests) + ")", r);
    if (seen[sz(r)] != 0) fail(engine_errc::bad_request, request_name(r) + " appears twice in the batch", r);
    seen[sz(r)] = 1;
  }
  const bool tree = !b.request_masks.empty();
  if (!b.request_masks.empty() && b.request_masks.size() != B)
    fail(engine_errc::bad_batch, "request_masks has " + std::to_string(b.request_masks.size()) + " masks for " +
                                     std::to_string(B) + " requests");
  for (std::size_t i = 0; i < B; ++i) {
    const int r = b.requests[i], q0 = b.qo_indptr[i], n = b.qo_indptr[i + 1] - q0, L = b.cache_lengths[i];
    const std::string who = request_name(r) + ": ";
    if (n == 0 && b.last_row_only) fail(engine_errc::bad_batch, who + "no tokens, but last_row_only asks for its last row", r);
    check_rows(c, b.tokens.subspan(sz(q0), sz(n)), b.positions.subspan(sz(q0), sz(n)), q0, who, r);
    if (L < 0 || L > lim.max_context - n)
      fail(engine_errc::bad_slot, who + std::to_string(n) + " tokens at cache length " + std::to_string(L) + " do not fit max_context " +
                                      std::to_string(lim.max_context), r);
    const int mapped = mapped_slots(r);
    if (L + n > mapped)
      fail(engine_errc::bad_slot, who + "slots [" + std::to_string(L) + ", " + std::to_string(L + n) + ") are not all mapped (it holds " +
                                      std::to_string(mapped / lim.page_size) + " page(s) of " + std::to_string(lim.page_size) +
                                      " slots; reserve first)", r);
    if (tree && n > lim.max_tokens)
      fail(engine_errc::bad_batch, who + "tree of " + std::to_string(n) + " tokens exceeds max_tokens " + std::to_string(lim.max_tokens), r);
    if (tree) check_tree_mask(b.mask_of(static_cast<int>(i)), n);
  }
  check_outputs(c, b.last_row_only ? B : sz(T), b.logits, b.hidden);
}

void for_each_pass(const medusa::ragged_batch& b, int max_tokens, const std::function<void(const pass_plan&)>& run) {
  const int B = b.size();
  const bool tree = !b.request_masks.empty();
  const bool wanted = !b.logits.empty() || !b.hidden.empty();
  std::vector<pass_piece> pieces;
  std::vector<int> out_rows;
  int pass0 = 0, rows = 0, out0 = -1;  // first batch row of the pass, its rows, its first output row
  auto flush = [&] {
    if (rows == 0) return;
    run({.pieces = pieces, .first_row = pass0, .rows = rows, .out_rows = out_rows, .first_output = out0 < 0 ? 0 : out0});
    pass0 += rows;
    rows = 0;
    out0 = -1;
    pieces.clear();
    out_rows.clear();
  };
  for (int i = 0; i < B; ++i) {
    const int r = b.requests[sz(i)], n = b.count(i), L = b.cache_lengths[sz(i)];
    if (tree && rows + n > max_tokens) flush();
    for (int done = 0; done < n;) {
      if (rows == max_tokens) flush();
      const int piece = tree ? n : std::min(n - done, max_tokens - rows);
      pieces.push_back({.index = i, .request = r, .row0 = rows, .rows = piece, .cache_length = L + done, .mask = b.mask_of(i)});
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

}  // namespace medusa_llama::detail
