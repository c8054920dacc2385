// SPDX-License-Identifier: Apache-2.0
// The serving engine and scheduler loop of docs/serving.md, compiled and run: a ragged-batch
// model over one paged KV pool whose pages are mapped on demand, decoded with batch_decoder;
// every request gets the tokens it gets alone.
#include <doctest/doctest.h>
#include <medusa/decoder.hpp>
#include <medusa/io/head_checkpoint.hpp>
#include <medusa/tree.hpp>

#include <algorithm>
#include <deque>
#include <numeric>
#include <stdexcept>
#include <random>
#include <vector>

namespace {

// --- docs/serving.md, "What your engine provides" ----------------------------------------------
// A bigram model (logits depend on the token alone) that still writes K/V for every token, into a
// paged pool shared by the requests: 1 layer, 1 head of `dim`, pages of 8 slots.
struct my_engine {
  static constexpr int vocab = 64, dim = 16, page = 8, pool_pages = 256, max_requests = 8;
  std::vector<float> embed, lm_head;                   // [vocab][dim] each
  std::vector<float> k, v;                             // the pool: [pool_pages][page][dim]
  std::vector<std::int32_t> free_pages;                // pages not mapped by any request
  std::vector<std::vector<std::int32_t>> block_table;  // per request: logical block -> page

  explicit my_engine(std::uint32_t seed, int pages = pool_pages)
      : embed(vocab * dim), lm_head(vocab * dim), k(pool_pages * page * dim), v(k.size()), block_table(max_requests) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (auto& x : embed) x = n(rng);
    for (auto& x : lm_head) x = n(rng);
    for (int p = pages - 1; p >= 0; --p) free_pages.push_back(p);
  }

  int vocab_size() const { return vocab; }
  int hidden_size() const { return dim; }
  int max_context() const { return 1024; }  // what a request may grow to, mapped or not

  medusa::paged_kv_cache_view<float> kv_cache(int request) {
    return medusa::make_paged_kv_view<float>(k, v, medusa::kv_extents{1, 1, dim}, page, medusa::kv_layout::nhd,
                                             block_table.at(static_cast<std::size_t>(request)));
  }
  // Before a forward writes slots [L, slots): map the pages they need, or what the pool has left;
  // returns the slots now addressable (fewer than asked: the decoder takes a smaller step).
  int reserve(int request, int slots) {
    auto& table = block_table.at(static_cast<std::size_t>(request));
    const int need = std::min(medusa::kv_pages_to_map(static_cast<int>(table.size()), 0, slots, page),
                              static_cast<int>(free_pages.size()));
    for (int i = 0; i < need; ++i, free_pages.pop_back()) table.push_back(free_pages.back());
    return static_cast<int>(table.size()) * page;
  }
  // After a commit: give back the pages wholly past the request's length.
  void release(int request, int length) {
    auto& table = block_table.at(static_cast<std::size_t>(request));
    for (int n = medusa::kv_pages_releasable(static_cast<int>(table.size()), length, page); n > 0; --n) {
      free_pages.push_back(table.back());
      table.pop_back();
    }
  }

  void forward(const medusa::ragged_batch& b) {
    for (int r = 0; r < b.size(); ++r) {  // request r: rows [qo_indptr[r], qo_indptr[r + 1])
      auto cache = kv_cache(b.requests[static_cast<std::size_t>(r)]);
      const int first = b.qo_indptr[static_cast<std::size_t>(r)], count = b.count(r);
      for (int i = 0; i < count; ++i) {
        const int t = first + i;
        const float* e = embed.data() + static_cast<std::ptrdiff_t>(b.tokens[static_cast<std::size_t>(t)] * dim);
        std::copy(e, e + dim, cache.k_row(0, b.cache_lengths[static_cast<std::size_t>(r)] + i, 0));
        std::copy(e, e + dim, cache.v_row(0, b.cache_lengths[static_cast<std::size_t>(r)] + i, 0));
        if (b.last_row_only && i != count - 1) continue;
        const auto row = static_cast<std::size_t>(b.last_row_only ? r : t);  // output row
        std::copy(e, e + dim, b.hidden.begin() + static_cast<std::ptrdiff_t>(row * dim));
        for (int w = 0; w < vocab; ++w) {
          float z = 0.0f;
          for (int j = 0; j < dim; ++j) z += lm_head[static_cast<std::size_t>(w * dim + j)] * e[j];
          b.logits[row * vocab + static_cast<std::size_t>(w)] = z;
        }
      }
    }
  }
};
static_assert(medusa::batch_decoder_model<my_engine>);
static_assert(medusa::kv_granting_model<my_engine>);
// ---------------------------------------------------------------------------------------------

std::vector<std::int32_t> prompt_of(int i) {
  std::vector<std::int32_t> p;
  for (int t = 0; t < 4 + 3 * i; ++t) p.push_back((t * 5 + i * 11 + 1) % my_engine::vocab);
  return p;
}

// Decodes `prompts` through `dec` with a waiting queue; returns each prompt's tokens.
template <class Decoder>
std::vector<std::vector<std::int32_t>> serve(my_engine& engine, Decoder& dec,
                                             const std::vector<std::vector<std::int32_t>>& prompts) {
  std::vector<std::vector<std::int32_t>> done(prompts.size());
  std::vector<std::vector<std::int32_t>> streamed(prompts.size());
  // --- docs/serving.md, "A scheduler loop" -----------------------------------------------------
  std::deque<int> waiting(prompts.size());          // clients not yet admitted
  std::iota(waiting.begin(), waiting.end(), 0);
  std::vector<int> client_of(my_engine::max_requests, -1);  // request id -> client
  while (!waiting.empty() || !dec.empty()) {
    // Admit clients while the batch has room: the request id is a free engine slot.
    for (int id = 0; id < my_engine::max_requests && !waiting.empty() && dec.size() < dec.max_batch(); ++id) {
      if (client_of[static_cast<std::size_t>(id)] >= 0) continue;
      const int client = waiting.front();
      waiting.pop_front();
      dec.join(id, prompts[static_cast<std::size_t>(client)], {.max_new_tokens = 40});
      client_of[static_cast<std::size_t>(id)] = client;
    }
    for (const medusa::request_update& u : dec.step()) {
      const int client = client_of[static_cast<std::size_t>(u.request)];
      auto& out = streamed[static_cast<std::size_t>(client)];
      out.insert(out.end(), u.tokens.begin(), u.tokens.end());  // stream to the client
      if (u.finished) {
        if (u.reason == medusa::stop_reason::failed) throw std::runtime_error(u.error_message());
        engine.release(u.request, 0);  // the request is over: free all its pages
        client_of[static_cast<std::size_t>(u.request)] = -1;
        done[static_cast<std::size_t>(client)] = u.result.tokens;
      }
    }
  }
  // ---------------------------------------------------------------------------------------------
  CHECK(streamed == done);
  return done;
}

// Decodes `prompts` over a pool too small for all of them at once, preempting requests the pool
// cannot take one more token of; returns each prompt's tokens.
template <class Decoder>
std::vector<std::vector<std::int32_t>> serve_preempting(my_engine& engine, Decoder& dec,
                                                        const std::vector<std::vector<std::int32_t>>& prompts,
                                                        int& preempted) {
  const medusa::decode_options opt{.max_new_tokens = 40};
  std::vector<std::vector<std::int32_t>> done(prompts.size());
  // --- docs/serving.md, "Preemption" ------------------------------------------------------------
  struct job {
    int client;
    std::vector<std::int32_t> so_far;  // prompt + the tokens streamed so far
    int cached = 0;                    // slots of its cache still valid (kept mapped while it waits)
    int id = -1;                       // its engine request id while it holds pages
  };
  std::deque<job> waiting;
  for (int c = 0; c < static_cast<int>(prompts.size()); ++c) waiting.push_back({c, prompts[static_cast<std::size_t>(c)]});
  std::vector<job> running(my_engine::max_requests);  // by request id
  std::vector<bool> held(my_engine::max_requests, false);  // the id's pages belong to a job
  auto pool_exhausted = [](const medusa::request_update& u) {
    try {
      std::rethrow_exception(u.error);
    } catch (const medusa::kv_cache_error& e) {
      return e.code() == medusa::kv_errc::pool_exhausted;
    } catch (...) {
      return false;
    }
  };
  int steps = 0;
  while (!waiting.empty() || !dec.empty()) {
    REQUIRE(++steps < 2000);
    if (dec.empty())  // every request was preempted: all but the first in line give their pages back
      for (std::size_t w = 1; w < waiting.size(); ++w)
        if (waiting[w].cached > 0) {
          engine.release(waiting[w].id, 0);
          held[static_cast<std::size_t>(waiting[w].id)] = false;
          waiting[w].cached = 0;
        }
    int promised = 0;  // pages the requests admitted below will take
    for (int id = 0; id < my_engine::max_requests && !waiting.empty() && dec.size() < dec.max_batch(); ++id) {
      job& next = waiting.front();
      // A new request joins only if the pool has room for its prompt and a step, past a page for the
      // next step of each request in the batch (preempted ones go first).
      const int room = medusa::kv_pages_for(static_cast<int>(next.so_far.size()) + 1, my_engine::page);
      if (next.cached == 0 && static_cast<int>(engine.free_pages.size()) - promised - dec.size() < room) break;
      if (next.cached > 0 ? id != next.id : held[static_cast<std::size_t>(id)]) continue;
      if (next.cached == 0) promised += room;
      medusa::decode_options again = opt;  // resumed over its cached prefix: only the rest is prefilled
      again.cached_prompt_tokens = next.cached;
      again.max_new_tokens = opt.max_new_tokens - static_cast<int>(next.so_far.size() - prompts[static_cast<std::size_t>(next.client)].size());
      dec.join(id, next.so_far, again);
      next.id = id;
      held[static_cast<std::size_t>(id)] = true;
      running[static_cast<std::size_t>(id)] = std::move(next);
      waiting.pop_front();
      id = -1;  // a resumed job may take a lower id than the last
    }
    for (const medusa::request_update& u : dec.step()) {
      job& j = running[static_cast<std::size_t>(u.request)];
      j.so_far.insert(j.so_far.end(), u.tokens.begin(), u.tokens.end());
      if (!u.finished) continue;
      if (u.reason == medusa::stop_reason::failed && pool_exhausted(u)) {  // preempt: wait, keeping its cache
        j.cached = std::min<int>(u.result.cache_length, static_cast<int>(j.so_far.size()) - 1);
        if (j.cached == 0) {  // nothing worth keeping
          engine.release(u.request, 0);
          held[static_cast<std::size_t>(u.request)] = false;
        }
        waiting.push_front(std::move(j));  // it resumes first
        ++preempted;
        continue;
      }
      if (u.reason == medusa::stop_reason::failed) throw std::runtime_error(u.error_message());
      engine.release(u.request, 0);
      held[static_cast<std::size_t>(u.request)] = false;
      done[static_cast<std::size_t>(j.client)].assign(j.so_far.begin() + static_cast<std::ptrdiff_t>(prompts[static_cast<std::size_t>(j.client)].size()), j.so_far.end());
    }
  }
  // ---------------------------------------------------------------------------------------------
  return done;
}

// Random heads over the engine's lm_head, as the doc's examples use them.
struct doc_heads {
  medusa::head_weights weights;
  medusa::portable_gemm<> gemm;
  decltype(weights.view()) stack = weights.view();
  medusa::head_stack_runner<decltype(weights.view()), medusa::portable_gemm<>> runner{stack, gemm};
  explicit doc_heads(my_engine& engine)
      : weights(medusa::head_weights::random(my_engine::dim, my_engine::vocab, 4, 1, medusa::weight_dtype::f32,
                                             medusa::weight_ptr::of(engine.lm_head.data()), /*seed=*/17)) {}
};

}  // namespace

TEST_CASE("docs/serving.md: preemption over a short pool resumes requests over their cached prefix") {
  my_engine engine(5, /*pages=*/14);  // 112 slots: about two requests at once, not four
  doc_heads h(engine);
  auto& heads = h.runner;
  std::vector<std::vector<std::int32_t>> prompts;
  for (int i = 0; i < 8; ++i) prompts.push_back(prompt_of(i));
  medusa::batch_decoder dec(engine, heads, medusa::tree::preset("mc_sim_7b_63"), medusa::greedy_policy{}, 4);
  int preempted = 0;
  const auto out = serve_preempting(engine, dec, prompts, preempted);
  CHECK(preempted > 0);
  my_engine roomy(5);
  medusa::no_heads none;
  medusa::batch_decoder plain(roomy, none, medusa::plain_tree{}, medusa::greedy_policy{}, 4);
  CHECK(out == serve(roomy, plain, prompts));
  CHECK(engine.free_pages.size() == 14);
}

TEST_CASE("docs/serving.md: the documented engine and scheduler loop; Medusa equals plain, batched") {
  my_engine engine(5);
  doc_heads h(engine);
  auto& heads = h.runner;
  std::vector<std::vector<std::int32_t>> prompts;
  for (int i = 0; i < 12; ++i) prompts.push_back(prompt_of(i));

  medusa::batch_decoder dec(engine, heads, medusa::tree::preset("mc_sim_7b_63"), medusa::greedy_policy{},
                            /*max_batch=*/4);
  const auto medusa_out = serve(engine, dec, prompts);
  CHECK(engine.free_pages.size() == static_cast<std::size_t>(my_engine::pool_pages));  // every page came back

  medusa::no_heads none;
  medusa::batch_decoder plain(engine, none, medusa::plain_tree{}, medusa::greedy_policy{}, 3);
  const auto plain_out = serve(engine, plain, prompts);
  CHECK(medusa_out == plain_out);
  for (const auto& t : medusa_out) CHECK(t.size() == 40);
}
