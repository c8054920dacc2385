// SPDX-License-Identifier: Apache-2.0
// Private: the GPU engine over an executor: the forward core, a paged KV pool in executor memory,
// the host-side page tables, and the `medusa::batch_decoder_model` a decoder drives — ragged
// forwards (inputs uploaded, logits and hidden states downloaded) and the commit of accepted
// paths on the device (`kv_committing_model`: the host never touches the cache).
#pragma once

#include <medusa_llama/errors.hpp>
#include <medusa_llama/model.hpp>

#include <medusa/cuda/kernels/attention.hpp>
#include <medusa/cuda/kernels/batch_kv.hpp>
#include <medusa/cuda/kernels/kv_commit.hpp>
#include <medusa/decoder/model.hpp>
#include <medusa/heads.hpp>
#include <medusa/kv_cache.hpp>

#include "../layer_stack.hpp"
#include "../ragged.hpp"
#include "forward.hpp"

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace medusa_llama::cuda_detail {

// Sizes of an engine (checked and resolved by the public engine).
struct engine_limits {
  int max_requests = 8;
  int max_context = 0;
  int max_tokens = 256;
  int page_size = 16;
  int num_pages = 0;
  int kv_split = 0;
  bool single_query_attention = true;
};

template <class Exec, class T>
class engine_state {
 public:
  engine_state(Exec& ex, const model& m, const engine_limits& lim)
      : engine_state(ex, device_weights<Exec, T>(ex, m), lim) {}
  engine_state(Exec& ex, device_weights<Exec, T> w, const engine_limits& lim)
      : ex_(ex),
        core_(ex, std::move(w), {.max_tokens = lim.max_tokens, .max_batch = lim.max_requests,
                                 .max_context = lim.max_context, .kv_split = lim.kv_split,
                                 .single_query_attention = lim.single_query_attention}),
        lim_(lim),
        pages_(lim.num_pages, lim.page_size, lim.max_requests, lim.max_context) {
    const model_config& c = core_.config();
    blocks_ = static_cast<int>(medusa::kv_pages_for(lim.max_context, lim.page_size));
    const std::size_t pool = sz(c.n_layers) * sz(lim.num_pages) * sz(lim.page_size) * sz(c.kv_dim());
    k_pool_ = buffer<Exec>(ex, pool * sizeof(T));
    v_pool_ = buffer<Exec>(ex, pool * sizeof(T));
    ex.fill_zero(k_pool_.template as<void>(), k_pool_.bytes());
    ex.fill_zero(v_pool_.template as<void>(), v_pool_.bytes());
    const std::size_t rows = sz(lim.max_tokens), B = sz(lim.max_requests);
    d_tokens_ = buffer<Exec>(ex, rows * 4);
    d_positions_ = buffer<Exec>(ex, rows * 4);
    d_indptr_ = buffer<Exec>(ex, (B + 1) * 4);
    d_lengths_ = buffer<Exec>(ex, B * 4);
    d_tables_ = buffer<Exec>(ex, B * sz(blocks_) * 4);
    d_out_rows_ = buffer<Exec>(ex, rows * 4);
    d_logits_ = buffer<Exec>(ex, rows * sz(c.vocab_size) * sizeof(float));
    d_hidden_ = buffer<Exec>(ex, rows * sz(c.dim) * sizeof(float));
    d_mask_offsets_ = buffer<Exec>(ex, B * 4);
    d_commit_ = buffer<Exec>(ex, sz(lim.max_tokens + 8) * 4);
  }

  [[nodiscard]] const model_config& config() const noexcept { return core_.config(); }
  [[nodiscard]] int vocab_size() const noexcept { return config().vocab_size; }
  [[nodiscard]] int hidden_size() const noexcept { return config().dim; }
  [[nodiscard]] int max_context() const noexcept { return lim_.max_context; }
  [[nodiscard]] const engine_limits& limits() const noexcept { return lim_; }
  [[nodiscard]] Exec& executor() noexcept { return ex_; }
  [[nodiscard]] forward_core<Exec, T>& core() noexcept { return core_; }
  [[nodiscard]] detail::page_allocator& pages() noexcept { return pages_; }
  [[nodiscard]] int blocks_per_request() const noexcept { return blocks_; }

  void reserve(int request, int slots) { pages_.reserve(request, slots); }
  void release(int request, int length) { pages_.release(request, length); }

  // The cache geometry for a batch whose block tables ([B][blocks_per_request()]) are at `tables`.
  [[nodiscard]] medusa::cuda::kernels::batch_kv kv_for(const std::int32_t* tables) const {
    const model_config& c = core_.config();
    const auto m = medusa::layout_kv_paged::mapping::dense({c.n_layers, c.n_kv_heads, c.head_dim()}, lim_.page_size,
                                                          lim_.num_pages, medusa::kv_layout::nhd, {});
    medusa::cuda::kernels::batch_kv kv =
        medusa::cuda::kernels::make_batch_kv(medusa::kv_cache_view<T, medusa::layout_kv_paged>(
                                                 k_pool_.template as<T>(), v_pool_.template as<T>(), m),
                                             tables, blocks_);
    return kv;
  }

  // The block-table rows of `requests`, in that order, padded with -1 (unmapped).
  void table_rows(std::span<const int> requests, std::vector<std::int32_t>& out) const {
    out.assign(requests.size() * sz(blocks_), -1);
    for (std::size_t i = 0; i < requests.size(); ++i) {
      const auto& t = pages_.table(requests[i]);
      std::copy(t.begin(), t.end(), out.begin() + static_cast<std::ptrdiff_t>(i * sz(blocks_)));
    }
  }

  // A ragged forward (see medusa::ragged_batch): checked, cut into passes, each pass's inputs
  // uploaded, its outputs downloaded.
  void forward(const medusa::ragged_batch& b) {
    detail::check_ragged_batch(config(),
                               {.max_requests = lim_.max_requests, .max_context = lim_.max_context,
                                .max_tokens = lim_.max_tokens, .page_size = lim_.page_size},
                               b, [this](int r) { return pages_.mapped_slots(r); }, seen_);
    const bool tree = !b.request_masks.empty();
    const std::size_t V = sz(config().vocab_size), d = sz(config().dim);
    detail::for_each_pass(b, lim_.max_tokens, [&](const detail::pass_plan& p) {
      const int B = static_cast<int>(p.pieces.size());
      indptr_.assign(1, 0);
      lengths_.clear();
      requests_.clear();
      int widest = 0;
      for (const detail::pass_piece& piece : p.pieces) {
        indptr_.push_back(piece.row0 + piece.rows);
        lengths_.push_back(piece.cache_length);
        requests_.push_back(piece.request);
        widest = std::max(widest, piece.rows);
      }
      table_rows(requests_, tables_);
      ex_.upload(d_tokens_.template as<void>(), b.tokens.data() + p.first_row, sz(p.rows) * 4);
      ex_.upload(d_positions_.template as<void>(), b.positions.data() + p.first_row, sz(p.rows) * 4);
      ex_.upload(d_indptr_.template as<void>(), indptr_.data(), indptr_.size() * 4);
      ex_.upload(d_lengths_.template as<void>(), lengths_.data(), lengths_.size() * 4);
      ex_.upload(d_tables_.template as<void>(), tables_.data(), tables_.size() * 4);
      pass_desc pd;
      pd.tokens = p.rows;
      pd.batch = B;
      pd.max_tokens_per_request = widest;
      pd.token_ids = d_tokens_.template as<const std::int32_t>();
      pd.positions = d_positions_.template as<const std::int32_t>();
      pd.qo_indptr = d_indptr_.template as<const std::int32_t>();
      pd.cache_lengths = d_lengths_.template as<const std::int32_t>();
      pd.kv = kv_for(d_tables_.template as<const std::int32_t>());
      if (tree) {
        // Every piece's rows repacked at one width, each piece from its own offset.
        int wpr = 1;
        for (const detail::pass_piece& piece : p.pieces) wpr = std::max(wpr, (piece.rows + 31) / 32);
        words_.clear();
        offsets_.clear();
        for (const detail::pass_piece& piece : p.pieces) {
          offsets_.push_back(static_cast<std::int32_t>(words_.size()));
          for (int i = 0; i < piece.rows; ++i)
            for (int w = 0; w < wpr; ++w)
              words_.push_back(w < piece.mask.words_per_row
                                   ? piece.mask.words[sz(i) * sz(piece.mask.words_per_row) + sz(w)]
                                   : 0u);
        }
        if (d_mask_.bytes() < words_.size() * 4) d_mask_ = buffer<Exec>(ex_, words_.size() * 4);
        ex_.upload(d_mask_.template as<void>(), words_.data(), words_.size() * 4);
        ex_.upload(d_mask_offsets_.template as<void>(), offsets_.data(), offsets_.size() * 4);
        pd.mask = medusa::cuda::kernels::attention_mask_kind::tree;
        pd.tree_mask = d_mask_.template as<const std::uint32_t>();
        pd.words_per_row = wpr;
        pd.tree_mask_offsets = d_mask_offsets_.template as<const std::int32_t>();
      }
      const int R = static_cast<int>(p.out_rows.size());
      if (R > 0) {
        ex_.upload(d_out_rows_.template as<void>(), p.out_rows.data(), sz(R) * 4);
        pd.out_rows = R;
        pd.out_row_index = d_out_rows_.template as<const std::int32_t>();
        if (!b.logits.empty()) pd.logits = d_logits_.template as<float>();
        if (!b.hidden.empty()) pd.hidden = d_hidden_.template as<float>();
      }
      core_.run(pd);
      if (R > 0) {
        const std::size_t o = sz(p.first_output);
        if (!b.logits.empty()) ex_.download(b.logits.data() + o * V, d_logits_.template as<const void>(), sz(R) * V * 4);
        if (!b.hidden.empty()) ex_.download(b.hidden.data() + o * d, d_hidden_.template as<const void>(), sz(R) * d * 4);
      }
      ex_.sync();
    });
  }

  // Seconds of one forward pass of each of `rows` tokens (causal: a chain costs what a tree of as
  // many nodes does) after `context` committed slots of `request`, each the fastest mean of
  // `repeats` rounds of 5 replays of its captured graph. The request's slots [0, context + max)
  // are overwritten: measure on a free request. Logits are computed, as in a decoding step.
  std::vector<double> measure_forward(std::span<const int> rows, int context, int repeats, int request = 0) {
    const int max_rows = *std::max_element(rows.begin(), rows.end());
    if (max_rows > lim_.max_tokens || context < 0 || context + max_rows > lim_.max_context)
      throw engine_error(engine_errc::bad_option, "step cost: " + std::to_string(max_rows) + " rows after " +
                                                      std::to_string(context) + " slots do not fit max_tokens " +
                                                      std::to_string(lim_.max_tokens) + " and max_context " +
                                                      std::to_string(lim_.max_context));
    pages_.release(request, 0);
    pages_.reserve(request, context + max_rows);
    const model_config& c = config();
    // The context's K/V: a causal prefill of arbitrary tokens, in passes.
    if (context > 0) {
      std::vector<std::int32_t> t(sz(context)), pos(sz(context));
      for (int i = 0; i < context; ++i) {
        t[sz(i)] = (i * 7 + 1) % c.vocab_size;
        pos[sz(i)] = i;
      }
      const int req[1] = {request}, indptr[2] = {0, context}, len[1] = {0};
      medusa::ragged_batch b;
      b.requests = req;
      b.qo_indptr = indptr;
      b.tokens = t;
      b.positions = pos;
      b.cache_lengths = len;
      forward(b);
    }
    std::vector<double> out;
    for (const int n : rows) {
      std::vector<std::int32_t> t(sz(n)), pos(sz(n));
      for (int i = 0; i < n; ++i) {
        t[sz(i)] = (i * 13 + 5) % c.vocab_size;
        pos[sz(i)] = context + i;
      }
      const std::int32_t indptr[2] = {0, n}, len[1] = {context};
      const int req[1] = {request};
      table_rows(req, tables_);
      ex_.upload(d_tokens_.template as<void>(), t.data(), sz(n) * 4);
      ex_.upload(d_positions_.template as<void>(), pos.data(), sz(n) * 4);
      ex_.upload(d_indptr_.template as<void>(), indptr, 8);
      ex_.upload(d_lengths_.template as<void>(), len, 4);
      ex_.upload(d_tables_.template as<void>(), tables_.data(), tables_.size() * 4);
      pass_desc pd;
      pd.tokens = n;
      pd.batch = 1;
      pd.max_tokens_per_request = n;
      pd.token_ids = d_tokens_.template as<const std::int32_t>();
      pd.positions = d_positions_.template as<const std::int32_t>();
      pd.qo_indptr = d_indptr_.template as<const std::int32_t>();
      pd.cache_lengths = d_lengths_.template as<const std::int32_t>();
      pd.kv = kv_for(d_tables_.template as<const std::int32_t>());
      pd.out_rows = n;
      pd.logits = d_logits_.template as<float>();
      core_.run(pd);  // outside the capture: lazy initialisations happen here
      ex_.sync();
      auto graph = ex_.capture([&] { core_.run(pd); });
      double best = 0.0;
      for (int r = 0; r < repeats; ++r) {
        const double s = ex_.time_replays(graph, 5);
        best = r == 0 ? s : std::min(best, s);
      }
      out.push_back(best);
    }
    pages_.release(request, 0);
    return out;
  }

  // Seconds of the heads (the first `count` of `stack`) on one hidden state: the fastest mean of
  // `repeats` rounds of 5 replays.
  double measure_heads(const medusa::head_stack<>& stack, int repeats) {
    const model_config& c = config();
    auto op = ex_.template make_heads_op<T>(stack, 1);
    buffer<Exec> h(ex_, sz(c.dim) * sizeof(T)), logits(ex_, stack.num_heads() * sz(c.vocab_size) * sizeof(float));
    ex_.fill_zero(h.template as<void>(), h.bytes());
    ex_.heads(op, h.template as<const T>(), logits.template as<float>());
    ex_.sync();
    auto graph = ex_.capture([&] { ex_.heads(op, h.template as<const T>(), logits.template as<float>()); });
    double best = 0.0;
    for (int r = 0; r < repeats; ++r) {
      const double s = ex_.time_replays(graph, 5);
      best = r == 0 ? s : std::min(best, s);
    }
    return best;
  }

  // Moves request `request`'s accepted rows `path` (tree pass of `nodes` nodes at L) to
  // [L, L + |path|) with the library's commit kernel; the decoder validated the path.
  int commit(int request, int committed_length, int nodes, std::span<const int> path) {
    namespace mk = medusa::cuda::kernels;
    pages_.check_request(request);
    const int A1 = static_cast<int>(path.size());
    if (A1 < 1 || A1 > nodes || A1 > lim_.max_tokens)
      throw engine_error(engine_errc::bad_slot, "request " + std::to_string(request) + ": commit of a path of " +
                                                    std::to_string(A1) + " nodes from a tree of " + std::to_string(nodes),
                         request);
    // [L][0, A1][path..][new length][table row]
    staging_.assign(3, 0);
    staging_[0] = committed_length;
    staging_[2] = A1;
    staging_.insert(staging_.end(), path.begin(), path.end());
    const std::size_t new_length_at = staging_.size();
    staging_.push_back(-2);
    const std::size_t table_at = staging_.size();
    const int req[1] = {request};
    table_rows(req, tables_);
    staging_.insert(staging_.end(), tables_.begin(), tables_.end());
    if (d_commit_.bytes() < staging_.size() * 4) d_commit_ = buffer<Exec>(ex_, staging_.size() * 4);
    auto* dev = d_commit_.template as<std::int32_t>();
    ex_.upload(dev, staging_.data(), staging_.size() * 4);
    mk::kv_commit_params params;
    static_cast<mk::batch_kv&>(params) = kv_for(dev + table_at);
    params.batch.size = 1;
    params.batch.committed_lengths = dev;
    params.batch.path_offsets = dev + 1;
    params.batch.paths = dev + 3;
    params.batch.new_lengths = dev + new_length_at;
    ex_.kv_commit(params);
    std::int32_t got = 0;
    ex_.download(&got, dev + new_length_at, 4);
    ex_.sync();
    if (got != committed_length + A1)
      throw engine_error(engine_errc::bad_slot, "request " + std::to_string(request) + ": the device refused the commit of " +
                                                    std::to_string(A1) + " rows at length " + std::to_string(committed_length),
                         request);
    return got;
  }

 private:
  Exec& ex_;
  forward_core<Exec, T> core_;
  engine_limits lim_;
  detail::page_allocator pages_;
  int blocks_ = 0;
  buffer<Exec> k_pool_, v_pool_;
  buffer<Exec> d_tokens_, d_positions_, d_indptr_, d_lengths_, d_tables_, d_out_rows_, d_logits_, d_hidden_, d_mask_,
      d_mask_offsets_, d_commit_;
  // host scratch, kept between calls
  std::vector<char> seen_;
  std::vector<std::int32_t> indptr_, lengths_, tables_, offsets_, staging_;
  std::vector<int> requests_;
  std::vector<std::uint32_t> words_;
};

}  // namespace medusa_llama::cuda_detail
