// SPDX-License-Identifier: Apache-2.0
// Private: greedy decoding of a batch with the whole step on the device, over an executor. The
// host prefills (a ragged forward), then each step is one replay of a captured sequence and a
// small download (the committed tokens and each request's status):
//
//   Medusa:  heads(h) → candidates (top-k + gather: tree tokens, positions L + depth)
//            → forward over the B × N tree tokens → verify (greedy: accepted path, bonus)
//            → KV commit of the accepted rows → bookkeeping (lengths, h of the final node)
//   plain:   forward over B tokens → argmax (top-k, k = 1) → bookkeeping (length + 1, next token)
//
// Near the end of its context, where a whole tree no longer fits, a request of a Medusa decode
// takes plain steps (its pending token, which the host keeps, as the one row), as
// medusa::batch_decoder does: a second captured sequence, replayed for those requests alone
// while the others go on with the tree. Every slot of the context is used, so the tokens and
// their number equal plain decoding's; `context` ends a request only once no slot is left.
//
// The bonus of a step is the root of the next, so a step commits its root and the accepted
// drafts, as medusa::decoder does; the tokens equal plain greedy decoding's when every row of a
// pass is computed as it would be alone (the attention kernels do that; the GEMMs must too).
#pragma once

#include <medusa/cuda/kernels/attention.hpp>
#include <medusa/cuda/kernels/kv_commit.hpp>
#include <medusa/cuda/kernels/verify.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/heads.hpp>
#include <medusa/tree.hpp>

#include "engine_state.hpp"
#include "kernels.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace medusa_llama::cuda_detail {

// Why a request of a device decode ended.
enum class device_stop { length, eos, stop_token, context, failed };

struct device_request_result {
  std::vector<std::int32_t> tokens;
  device_stop stop = device_stop::length;
  int steps = 0;      // steps the request took part in
  std::string error;  // with `failed`: what the step's status said
};

struct device_decode_stats {
  int steps = 0;                     // replays
  std::vector<long long> accepted;   // Medusa: histogram of accepted drafts per request tree step
  double prefill_seconds = 0;
  double decode_seconds = 0;         // capture, steps and downloads
  double step_seconds = 0;           // the steps alone: replays and their downloads
};

// The first `n` heads of `stack` (the ones a tree of depth n reaches).
inline medusa::head_stack<> first_heads(const medusa::head_stack<>& stack, std::size_t n) {
  medusa::head_stack<> out(stack.hidden_size(), stack.vocab_size(), n, stack.num_layers(), stack.kind());
  for (std::size_t h = 0; h < n; ++h) {
    for (std::size_t l = 0; l < stack.num_layers(); ++l) {
      const medusa::resblock_weights w = stack.resblock(h, l);
      out.set_resblock(h, l, w.weight, w.bias);
    }
    if (stack.kind() == medusa::projection_kind::per_head) out.set_projection(h, stack.projection(h));
  }
  if (stack.kind() == medusa::projection_kind::shared_lm_head) out.set_lm_head(stack.projection(0));
  return out;
}

template <class Exec, class T>
class device_decoder {
 public:
  // Medusa decoding with `heads` (at least the tree's depth; the first depth are used) over `tree`;
  // with `heads` null, plain decoding (the tree is ignored).
  device_decoder(engine_state<Exec, T>& eng, const medusa::tree* tree, const medusa::head_stack<>* heads)
      : eng_(eng), ex_(eng.executor()) {
    if (heads != nullptr) {
      if (tree == nullptr || tree->num_nodes() < 2)
        throw engine_error(engine_errc::bad_option, "device decoding with heads needs a tree of at least 2 nodes");
      const int depth = tree->depth();
      if (static_cast<int>(heads->num_heads()) < depth)
        throw engine_error(engine_errc::bad_option, "a depth-" + std::to_string(depth) + " tree needs " +
                                                        std::to_string(depth) + " heads, " +
                                                        std::to_string(heads->num_heads()) + " are loaded");
      tree_.emplace(*tree);
      heads_.emplace(first_heads(*heads, static_cast<std::size_t>(depth)));
    }
  }

  [[nodiscard]] bool medusa() const noexcept { return heads_.has_value(); }
  [[nodiscard]] const device_decode_stats& stats() const noexcept { return stats_; }

  // Decodes `prompts` (requests 0..B-1 of the engine) for up to `max_new_tokens` each, greedily.
  // `eos_token` ends a request unemitted; `stop_token` ends it after it is emitted (-1: none).
  std::vector<device_request_result> generate(std::span<const std::vector<std::int32_t>> prompts, int max_new_tokens,
                                              int eos_token, int stop_token = -1) {
    using clock = std::chrono::steady_clock;
    const int B = static_cast<int>(prompts.size());
    const model_config& c = eng_.config();
    if (B < 1 || B > eng_.limits().max_requests)
      throw engine_error(engine_errc::bad_batch, std::to_string(B) + " prompts for an engine of " +
                                                     std::to_string(eng_.limits().max_requests) + " requests");
    if (max_new_tokens < 1) throw engine_error(engine_errc::bad_option, "max_new_tokens must be at least 1");
    const int N = medusa() ? tree_->num_nodes() : 1;
    if (B * N > eng_.limits().max_tokens)
      throw engine_error(engine_errc::bad_batch, std::to_string(B) + " requests of " + std::to_string(N) +
                                                     " tree tokens exceed max_tokens " + std::to_string(eng_.limits().max_tokens));
    stats_ = {};
    stats_.accepted.assign(medusa() ? sz(tree_->depth() + 1) : 1, 0);
    results_.assign(sz(B), {});
    std::vector<int> length(sz(B));
    for (int b = 0; b < B; ++b) {
      const auto& p = prompts[sz(b)];
      if (p.empty()) throw engine_error(engine_errc::bad_batch, "request " + std::to_string(b) + ": empty prompt", b);
      length[sz(b)] = static_cast<int>(p.size());
      eng_.release(b, 0);
      eng_.reserve(b, std::min(eng_.max_context(), length[sz(b)] + max_new_tokens + N + 1));
    }
    // Prefill: every prompt in one ragged forward, each request's last row.
    const auto t0 = clock::now();
    std::vector<std::int32_t> tokens, positions;
    std::vector<int> requests, indptr{0}, lengths(sz(B), 0);
    for (int b = 0; b < B; ++b) {
      const auto& p = prompts[sz(b)];
      tokens.insert(tokens.end(), p.begin(), p.end());
      for (std::size_t i = 0; i < p.size(); ++i) positions.push_back(static_cast<std::int32_t>(i));
      requests.push_back(b);
      indptr.push_back(static_cast<int>(tokens.size()));
    }
    std::vector<float> logits(sz(B) * sz(c.vocab_size)), hidden(sz(B) * sz(c.dim));
    medusa::ragged_batch rb;
    rb.requests = requests;
    rb.qo_indptr = indptr;
    rb.tokens = tokens;
    rb.positions = positions;
    rb.cache_lengths = lengths;
    rb.last_row_only = true;
    rb.logits = logits;
    rb.hidden = hidden;
    eng_.forward(rb);
    std::vector<std::int32_t> first(sz(B));
    for (int b = 0; b < B; ++b) first[sz(b)] = argmax(std::span<const float>(logits).subspan(sz(b) * sz(c.vocab_size), sz(c.vocab_size)));
    stats_.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();

    const auto t1 = clock::now();
    allocate(B, N);
    upload_state(B, N, first, length, hidden, eos_token);
    // The steps, run once outside the capture (so that libraries load what they load lazily),
    // then captured; their effects are undone by uploading the state again.
    step(B, N);
    if (medusa()) fallback_step(B);
    ex_.sync();
    upload_state(B, N, first, length, hidden, eos_token);
    auto graph = ex_.capture([&] { step(B, N); });
    std::optional<typename Exec::graph> fallback;  // Medusa: the plain steps near the context's end
    if (medusa()) fallback.emplace(ex_.capture([&] { fallback_step(B); }));
    std::vector<char> active(sz(B), 1);
    // The requests each sequence advances, and what the device holds of that (d_active_ and
    // d_plain_active_ after upload_state).
    std::vector<std::int32_t> in_step(sz(B)), in_plain(sz(B)), step_dev(sz(B), 1), plain_dev(sz(B), 0);
    std::vector<std::int32_t> pending(first);  // Medusa: the bonus each request's next step commits first
    int live = B;
    if (!medusa()) {  // plain decoding emits the first token now; Medusa emits it as its first root
      for (int b = 0; b < B; ++b) live -= emit(b, first[sz(b)], max_new_tokens, eos_token, stop_token, active) ? 0 : 1;
    }
    std::vector<std::int32_t> out_tokens, out_accept, out_status, out_bonus(sz(B));
    const auto t2 = clock::now();
    while (live > 0) {
      // A step writes slots [L, L + N): a request whose step no longer fits takes a plain step
      // (Medusa) or, with no slot left, ends here.
      int steps = 0, plains = 0;
      for (int b = 0; b < B; ++b) {
        in_step[sz(b)] = in_plain[sz(b)] = 0;
        if (!active[sz(b)]) continue;
        if (length[sz(b)] + N <= eng_.max_context()) {
          in_step[sz(b)] = 1;
          ++steps;
          continue;
        }
        // Medusa: the plain step's token is the pending bonus, emitted now as the library's
        // decoder emits it; plain decoding emitted its pending token after the last step.
        if (medusa() && !emit(b, pending[sz(b)], max_new_tokens, eos_token, stop_token, active)) {
          --live;
          continue;
        }
        if (!medusa() || length[sz(b)] >= eng_.max_context()) {
          finish(b, device_stop::context, active);
          --live;
          continue;
        }
        in_plain[sz(b)] = 1;
        ++plains;
      }
      if (live == 0) break;
      if (in_step != step_dev) {
        step_dev = in_step;
        ex_.upload(d_active_.template as<void>(), step_dev.data(), sz(B) * 4);
      }
      if (in_plain != plain_dev) {
        plain_dev = in_plain;
        ex_.upload(d_plain_active_.template as<void>(), plain_dev.data(), sz(B) * 4);
      }
      if (plains > 0) run_fallback(*fallback, B, in_plain, length, pending, active, live);
      if (steps == 0) continue;
      ex_.replay(graph);
      ++stats_.steps;
      // The step's outputs: committed tokens (Medusa: path tokens, root first; plain: the argmax)
      // and statuses.
      const int stride = medusa() ? tree_->depth() + 1 : 1;
      out_tokens.resize(sz(B) * sz(stride));
      out_accept.assign(sz(B), 0);
      out_status.resize(sz(B));
      ex_.download(out_tokens.data(), (medusa() ? d_path_tokens_ : d_chosen_).template as<const void>(), out_tokens.size() * 4);
      if (medusa()) {
        ex_.download(out_accept.data(), d_accept_.template as<const void>(), sz(B) * 4);
        ex_.download(out_bonus.data(), d_bonus_.template as<const void>(), sz(B) * 4);
      }
      ex_.download(out_status.data(), d_status_.template as<const void>(), sz(B) * 4);
      ex_.sync();
      for (int b = 0; b < B; ++b) {
        if (!in_step[sz(b)] || !active[sz(b)]) continue;
        if (!stepped(b, out_status[sz(b)], "", active, live)) continue;
        const int a = out_accept[sz(b)];
        if (medusa()) {
          ++stats_.accepted[sz(a)];
          pending[sz(b)] = out_bonus[sz(b)];
        }
        length[sz(b)] += a + 1;
        for (int j = 0; j <= a; ++j)
          if (!emit(b, out_tokens[sz(b) * sz(stride) + sz(j)], max_new_tokens, eos_token, stop_token, active)) {
            --live;
            break;
          }
      }
    }
    stats_.step_seconds = std::chrono::duration<double>(clock::now() - t2).count();
    stats_.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
    for (int b = 0; b < B; ++b) eng_.release(b, 0);
    return std::move(results_);
  }

 private:
  // Lowest id of the largest logit, as medusa::greedy_policy picks.
  static std::int32_t argmax(std::span<const float> row) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < row.size(); ++i)
      if (row[i] > row[best]) best = i;
    return static_cast<std::int32_t>(best);
  }

  // Appends `token` to request b under its stop rules; false once the request is over.
  bool emit(int b, std::int32_t token, int max_new_tokens, int eos_token, int stop_token, std::vector<char>& active) {
    if (!active[sz(b)]) return false;
    if (token == eos_token) {
      finish(b, device_stop::eos, active);
      return false;
    }
    results_[sz(b)].tokens.push_back(token);
    if (token == stop_token) {
      finish(b, device_stop::stop_token, active);
      return false;
    }
    if (static_cast<int>(results_[sz(b)].tokens.size()) >= max_new_tokens) {
      finish(b, device_stop::length, active);
      return false;
    }
    return true;
  }

  void finish(int b, device_stop why, std::vector<char>& active) {
    results_[sz(b)].stop = why;
    active[sz(b)] = 0;
  }

  // Counts a step of request b; false (the request failed, with what the status says) for a
  // nonzero status.
  bool stepped(int b, std::int32_t status, const char* what, std::vector<char>& active, int& live) {
    ++results_[sz(b)].steps;
    if (status == 0) return true;
    results_[sz(b)].error = "request " + std::to_string(b) + ": step " + std::to_string(stats_.steps) + what + ": " +
                            std::string(medusa::cuda::to_string(static_cast<medusa::cuda::request_status>(status)));
    finish(b, device_stop::failed, active);
    --live;
    return false;
  }

  // One replay of the plain-step sequence for the requests of `in_plain` (their pending token was
  // emitted): each commits it at its next slot, and the argmax becomes its pending token.
  void run_fallback(const typename Exec::graph& g, int B, const std::vector<std::int32_t>& in_plain, std::vector<int>& length,
                    std::vector<std::int32_t>& pending, std::vector<char>& active, int& live) {
    std::vector<std::int32_t> positions(length.begin(), length.end()), chosen(sz(B)), status(sz(B));
    ex_.upload(d_tokens_.template as<void>(), pending.data(), sz(B) * 4);
    ex_.upload(d_positions_.template as<void>(), positions.data(), sz(B) * 4);
    ex_.replay(g);
    ++stats_.steps;
    ex_.download(chosen.data(), d_chosen_.template as<const void>(), sz(B) * 4);
    ex_.download(status.data(), d_plain_status_.template as<const void>(), sz(B) * 4);
    ex_.sync();
    for (int b = 0; b < B; ++b) {
      if (!in_plain[sz(b)]) continue;
      if (!stepped(b, status[sz(b)], " (plain, near the context's end)", active, live)) continue;
      length[sz(b)] += 1;
      pending[sz(b)] = chosen[sz(b)];
    }
  }

  void allocate(int B, int N) {
    const model_config& c = eng_.config();
    const std::size_t b = sz(B), n = sz(N), V = sz(c.vocab_size), d = sz(c.dim);
    auto i32 = [&](std::size_t count) { return buffer<Exec>(ex_, std::max<std::size_t>(count, 1) * 4); };
    d_tokens_ = i32(b * n);
    d_positions_ = i32(b * n);
    d_indptr_ = i32(b + 1);
    d_lengths_ = i32(b);
    d_active_ = i32(b);
    d_status_ = i32(b);
    d_tables_ = i32(b * sz(eng_.blocks_per_request()));
    d_logits_ = buffer<Exec>(ex_, b * n * V * sizeof(float));
    if (medusa()) {
      const int stride = tree_->depth() + 1;
      const std::size_t H = heads_->num_heads();
      d_hidden_ = buffer<Exec>(ex_, b * n * d * sizeof(float));
      d_head_input_ = buffer<Exec>(ex_, b * d * sizeof(T));
      d_head_logits_ = buffer<Exec>(ex_, b * H * V * sizeof(float));
      d_accept_ = i32(b);
      d_next_node_ = i32(b);
      d_bonus_ = i32(b);
      d_eos_ = i32(b);
      d_best_row_ = i32(b);
      d_path_nodes_ = i32(b * sz(stride));
      d_path_tokens_ = i32(b * sz(stride));
      d_new_lengths_ = i32(b);
      d_eos_tokens_ = i32(b);
      const int wpr = tree_->words_per_row();
      std::vector<std::uint32_t> words(n * sz(wpr));
      medusa::copy_packed_mask(*tree_, std::span<std::uint32_t>(words));
      d_mask_ = buffer<Exec>(ex_, words.size() * 4);
      ex_.upload(d_mask_.template as<void>(), words.data(), words.size() * 4);
      step_op_.emplace(ex_.make_step_op(*tree_, static_cast<int>(H), B, c.vocab_size));
      heads_op_.emplace(ex_.template make_heads_op<T>(*heads_, B));
      commit_params_.reset();
      d_plain_indptr_ = i32(b + 1);
      d_plain_active_ = i32(b);
      d_plain_status_ = i32(b);
    }
    // Plain decoding's argmax, and a Medusa decode's plain steps'.
    d_chosen_ = i32(b);
    argmax_op_.emplace(ex_.make_argmax_op(B, c.vocab_size));
  }

  void upload_state(int B, int N, const std::vector<std::int32_t>& first, const std::vector<int>& length,
                    const std::vector<float>& hidden, int eos_token) {
    const model_config& c = eng_.config();
    std::vector<std::int32_t> indptr(sz(B) + 1), lengths(sz(B)), zeros(sz(B), 0), ones(sz(B), 1);
    for (int b = 0; b <= B; ++b) indptr[sz(b)] = b * N;
    for (int b = 0; b < B; ++b) lengths[sz(b)] = length[sz(b)];
    ex_.upload(d_indptr_.template as<void>(), indptr.data(), indptr.size() * 4);
    ex_.upload(d_lengths_.template as<void>(), lengths.data(), lengths.size() * 4);
    ex_.upload(d_active_.template as<void>(), ones.data(), ones.size() * 4);
    ex_.upload(d_status_.template as<void>(), zeros.data(), zeros.size() * 4);
    std::vector<int> requests(sz(B));
    for (int b = 0; b < B; ++b) requests[sz(b)] = b;
    std::vector<std::int32_t> tables;
    eng_.table_rows(requests, tables);
    ex_.upload(d_tables_.template as<void>(), tables.data(), tables.size() * 4);
    if (medusa()) {
      // The roots are the bonus tokens of the step before: the prefill's choices.
      ex_.upload(d_bonus_.template as<void>(), first.data(), sz(B) * 4);
      std::vector<T> h(sz(B) * sz(c.dim));
      for (std::size_t i = 0; i < h.size(); ++i) h[i] = to_element<T>(hidden[i]);
      ex_.upload(d_head_input_.template as<void>(), h.data(), h.size() * sizeof(T));
      std::vector<std::int32_t> eos(sz(B), eos_token);
      ex_.upload(d_eos_tokens_.template as<void>(), eos.data(), eos.size() * 4);
      std::vector<std::int32_t> plain_indptr(sz(B) + 1);
      for (int b = 0; b <= B; ++b) plain_indptr[sz(b)] = b;
      ex_.upload(d_plain_indptr_.template as<void>(), plain_indptr.data(), plain_indptr.size() * 4);
      ex_.upload(d_plain_active_.template as<void>(), zeros.data(), zeros.size() * 4);
      ex_.upload(d_plain_status_.template as<void>(), zeros.data(), zeros.size() * 4);
    } else {
      ex_.upload(d_tokens_.template as<void>(), first.data(), sz(B) * 4);
      ex_.upload(d_positions_.template as<void>(), lengths.data(), sz(B) * 4);
    }
  }

  // A pass of N rows per request; `indptr` (B + 1 offsets) defaults to the step's, b · N.
  pass_desc pass(int B, int N, const std::int32_t* indptr = nullptr) const {
    pass_desc p;
    p.tokens = B * N;
    p.batch = B;
    p.max_tokens_per_request = N;
    p.token_ids = d_tokens_.template as<const std::int32_t>();
    p.positions = d_positions_.template as<const std::int32_t>();
    p.qo_indptr = indptr != nullptr ? indptr : d_indptr_.template as<const std::int32_t>();
    p.cache_lengths = d_lengths_.template as<const std::int32_t>();
    p.kv = eng_.kv_for(d_tables_.template as<const std::int32_t>());
    p.out_rows = B * N;
    p.logits = d_logits_.template as<float>();
    if (N > 1) {
      p.mask = medusa::cuda::kernels::attention_mask_kind::tree;
      p.tree_mask = d_mask_.template as<const std::uint32_t>();
      p.words_per_row = tree_->words_per_row();
      p.hidden = d_hidden_.template as<float>();
    }
    return p;
  }

  // A plain step of a Medusa decode (the fallback graph): one row per request, the token and
  // position the host uploaded to d_tokens_ / d_positions_ (a tree step's verify overwrites
  // d_bonus_ of every request, so the host's copy of the pending token is the one to trust);
  // the argmax is the next pending token. A request outside it (d_plain_active_ 0) keeps its
  // length: the row wrote only a slot it has not committed.
  void fallback_step(int B) {
    plain_step(B, d_plain_indptr_.template as<const std::int32_t>(), d_plain_active_.template as<const std::int32_t>(),
               d_plain_status_.template as<std::int32_t>());
  }

  // One token per request (rows at `indptr`), its argmax the next input; `active` requests advance.
  void plain_step(int B, const std::int32_t* indptr, const std::int32_t* active, std::int32_t* status) {
    eng_.core().run(pass(B, 1, indptr));
    ex_.argmax(*argmax_op_, d_logits_.template as<const float>(), d_chosen_.template as<std::int32_t>(), status);
    plain_bookkeeping_body body;
    body.batch = B;
    body.chosen = d_chosen_.template as<const std::int32_t>();
    body.active = active;
    body.lengths = d_lengths_.template as<std::int32_t>();
    body.tokens = d_tokens_.template as<std::int32_t>();
    body.positions = d_positions_.template as<std::int32_t>();
    ex_.launch({.grid_x = (B + 127) / 128, .grid_y = 1, .threads = 128, .shared_bytes = 0}, body);
  }

  // One step: what the graph holds.
  void step(int B, int N) {
    namespace mk = medusa::cuda::kernels;
    const model_config& c = eng_.config();
    auto* status = d_status_.template as<std::int32_t>();
    if (!medusa()) {
      plain_step(B, d_indptr_.template as<const std::int32_t>(), d_active_.template as<const std::int32_t>(), status);
      return;
    }
    const int stride = tree_->depth() + 1;
    ex_.heads(*heads_op_, d_head_input_.template as<const T>(), d_head_logits_.template as<float>());
    ex_.candidates(*step_op_, d_head_logits_.template as<const float>(), d_bonus_.template as<const std::int32_t>(),
                   d_lengths_.template as<const std::int32_t>(), d_tokens_.template as<std::int32_t>(),
                   d_positions_.template as<std::int32_t>(), status);
    eng_.core().run(pass(B, N));
    mk::verify_args<float> v{};
    v.logits = d_logits_.template as<const float>();
    v.row_stride = c.vocab_size;
    v.node_tokens = d_tokens_.template as<const std::int32_t>();
    v.eos_tokens = d_eos_tokens_.template as<const std::int32_t>();
    v.path_stride = stride;
    v.accept_length = d_accept_.template as<std::int32_t>();
    v.next_node = d_next_node_.template as<std::int32_t>();
    v.bonus = d_bonus_.template as<std::int32_t>();
    v.eos = d_eos_.template as<std::int32_t>();
    v.best_row = d_best_row_.template as<std::int32_t>();
    v.path_nodes = d_path_nodes_.template as<std::int32_t>();
    v.path_tokens = d_path_tokens_.template as<std::int32_t>();
    v.status = status;
    ex_.verify(*step_op_, v);
    if (!commit_params_) {
      mk::kv_commit_params cp;
      static_cast<mk::batch_kv&>(cp) = eng_.kv_for(d_tables_.template as<const std::int32_t>());
      cp.batch.size = B;
      cp.batch.committed_lengths = d_lengths_.template as<const std::int32_t>();
      cp.batch.paths = d_path_nodes_.template as<const std::int32_t>();
      cp.batch.new_lengths = d_new_lengths_.template as<std::int32_t>();
      cp.batch.path_stride = stride;  // the paths are verify's output rows
      cp.batch.accept_lengths = d_accept_.template as<const std::int32_t>();
      commit_params_ = cp;
    }
    ex_.kv_commit(*commit_params_);
    step_bookkeeping_body<T> body;
    body.batch = B;
    body.nodes = N;
    body.dim = c.dim;
    body.next_node = d_next_node_.template as<const std::int32_t>();
    body.new_lengths = d_new_lengths_.template as<const std::int32_t>();
    body.active = d_active_.template as<const std::int32_t>();
    body.lengths = d_lengths_.template as<std::int32_t>();
    body.hidden = d_hidden_.template as<const float>();
    body.head_input = d_head_input_.template as<T>();
    ex_.launch({.grid_x = (B + 127) / 128, .grid_y = 1, .threads = 128, .shared_bytes = 0}, body);
  }

  engine_state<Exec, T>& eng_;
  Exec& ex_;
  std::optional<medusa::tree> tree_;
  std::optional<medusa::head_stack<>> heads_;
  device_decode_stats stats_;
  std::vector<device_request_result> results_;
  buffer<Exec> d_tokens_, d_positions_, d_indptr_, d_lengths_, d_active_, d_status_, d_tables_, d_logits_, d_hidden_,
      d_head_input_, d_head_logits_, d_accept_, d_next_node_, d_bonus_, d_eos_, d_best_row_, d_path_nodes_,
      d_path_tokens_, d_new_lengths_, d_eos_tokens_, d_mask_, d_chosen_, d_plain_indptr_, d_plain_active_, d_plain_status_;
  std::optional<typename Exec::step_op> step_op_;
  std::optional<typename Exec::template heads_op<T>> heads_op_;
  std::optional<typename Exec::argmax_op> argmax_op_;
  std::optional<medusa::cuda::kernels::kv_commit_params> commit_params_;
};

}  // namespace medusa_llama::cuda_detail
