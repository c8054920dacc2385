// SPDX-License-Identifier: Apache-2.0
// The checks an engine author runs on their own types: the static model checks (each requirement
// in one sentence; the failing side is tests/compile_fail/model_check_missing_member.cpp) and
// check_row_invariance, which must pass a real transformer and catch rows that depend on the pass.
#include <medusa/decoder/model_check.hpp>
#include <medusa/decoder/row_invariance.hpp>
#include <medusa/heads.hpp>

#include "tiny_transformer.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

namespace {

// A batch model over tiny_model's weights: one cache per request, each request run alone with its
// own mask. `leak` moves every logit by one ULP for each row of the pass that is not the
// request's own: a row that depends on the rest of the pass, as a GEMM that picks its blocking by
// the pass's row count does.
struct tiny_batch {
  tiny::tiny_model weights{64};
  std::vector<std::vector<float>> k, v;
  bool leak = false;
  explicit tiny_batch(int requests) {
    for (int r = 0; r < requests; ++r) {
      k.emplace_back(std::size_t{64} * tiny::tiny_model::layers * tiny::tiny_model::kv_heads * tiny::tiny_model::head_dim);
      v.emplace_back(k.back().size());
    }
  }
  int vocab_size() const { return tiny::tiny_model::vocab; }
  int hidden_size() const { return tiny::tiny_model::dim; }
  medusa::kv_cache_view<float> kv_cache(int request) {
    const auto r = static_cast<std::size_t>(request);
    return medusa::make_kv_view<float>(k[r], v[r],
                                       {tiny::tiny_model::layers, tiny::tiny_model::kv_heads, tiny::tiny_model::head_dim}, 64);
  }
  void forward(const medusa::ragged_batch& b) {
    const auto vocab = static_cast<std::size_t>(vocab_size()), dim = static_cast<std::size_t>(hidden_size());
    for (int i = 0; i < b.size(); ++i) {
      const auto first = static_cast<std::size_t>(b.qo_indptr[static_cast<std::size_t>(i)]);
      const auto n = static_cast<std::size_t>(b.count(i));
      medusa::forward_batch f;
      f.tokens = b.tokens.subspan(first, n);
      f.positions = b.positions.subspan(first, n);
      f.cache_length = b.cache_lengths[static_cast<std::size_t>(i)];
      f.tree_mask = b.mask_of(i);
      f.logits = b.logits.subspan(first * vocab, n * vocab);
      f.hidden = b.hidden.subspan(first * dim, n * dim);
      weights.run(kv_cache(b.requests[static_cast<std::size_t>(i)]), f);
      if (leak)  // one ULP for each row of the pass that is not this request's
        for (std::size_t extra = n; extra < b.tokens.size(); ++extra)
          for (float& z : f.logits) z = std::nextafter(z, 1e30f);
    }
  }
};

// A model whose causal passes differ from one-token passes in the last bit of one logit.
struct pass_size_model : tiny::tiny_model {
  using tiny_model::tiny_model;
  void forward(const medusa::forward_batch& b) {
    tiny_model::forward(b);
    if (b.tokens.size() > 1 && !b.logits.empty()) b.logits[3] = std::nextafter(b.logits[3], 1e30f);
  }
};

// A model that ignores the tree mask (attends causally over every node of a tree pass).
struct mask_blind_model : tiny::tiny_model {
  using tiny_model::tiny_model;
  void forward(const medusa::forward_batch& b) {
    medusa::forward_batch causal = b;
    causal.tree_mask = {};
    tiny_model::forward(causal);
  }
};

std::vector<std::int32_t> some_tokens(int n) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<std::size_t>(i)] = (i * 7 + 3) % tiny::tiny_model::vocab;
  return t;
}

}  // namespace

// The checks pass the library's own types and the test models, and agree with the concepts.
static_assert(medusa::check_decoder_model<tiny::tiny_model>());
static_assert(medusa::check_batch_decoder_model<tiny_batch>());
static_assert(medusa::check_draft_heads<tiny::random_heads>());
static_assert(medusa::check_draft_heads<medusa::head_stack_runner<medusa::head_stack<>, medusa::portable_gemm<>>>());
static_assert(medusa::check_step_drafts<medusa::step_drafter>());

TEST_CASE("check_row_invariance: a real transformer over the library's attention is invariant") {
  tiny::tiny_model model(64);
  const auto tokens = some_tokens(40);
  const auto r = medusa::check_row_invariance(model, tokens);
  INFO(r.message());
  CHECK(r.invariant);
  // 8 causal pass sizes over 40 rows, and the chain rows of the tree passes.
  CHECK(r.rows_checked > 8 * 40);
  CHECK(r.message().find("invariant") != std::string::npos);
}

TEST_CASE("check_row_invariance: one ULP that depends on the pass size is found and named") {
  pass_size_model model(64);
  const auto tokens = some_tokens(20);
  const auto r = medusa::check_row_invariance(model, tokens);
  REQUIRE_FALSE(r.invariant);
  CHECK(r.pass == "causal, 2 tokens a pass");
  CHECK(r.row == 0);
  CHECK_FALSE(r.in_hidden);
  CHECK(r.index == 3);
  CHECK(r.in_pass == std::nextafter(r.alone, 1e30f));
  CHECK(r.message().find("row 0 differs in causal, 2 tokens a pass: logit[3]") != std::string::npos);
  CHECK(r.message().find("(1 in the bit pattern)") != std::string::npos);
}

TEST_CASE("check_row_invariance: a model that attends to masked-out tree nodes is found") {
  mask_blind_model model(64);
  const auto tokens = some_tokens(20);
  medusa::row_invariance_options o;
  o.pass_sizes = {4};  // causal passes are right: only the tree passes can tell
  const auto r = medusa::check_row_invariance(model, tokens, o);
  REQUIRE_FALSE(r.invariant);
  CHECK(r.pass == "a tree pass with a masked-out sibling beside each token");
  CHECK(r.row >= 1);
}

TEST_CASE("check_row_invariance: a batch model's rows beside another request") {
  tiny_batch model(3);
  const auto tokens = some_tokens(24);
  medusa::row_invariance_options o;
  o.request = 2;
  o.companion_request = 0;
  const auto clean = medusa::check_row_invariance(model, tokens, o);
  INFO(clean.message());
  CHECK(clean.invariant);
  model.leak = true;  // rows now depend on the rest of the pass
  const auto r = medusa::check_row_invariance(model, tokens, o);
  REQUIRE_FALSE(r.invariant);
  CHECK(r.pass == "causal, 2 tokens a pass");
  o.companion_request = -1;  // alone, a one-request pass has no other rows to depend on
  model.leak = true;
  CHECK(medusa::check_row_invariance(model, tokens, o).invariant);
}

TEST_CASE("check_row_invariance refuses input it cannot check") {
  tiny::tiny_model model(16);
  CHECK_THROWS_AS(medusa::check_row_invariance(model, some_tokens(1)), medusa::invalid_input);
  CHECK_THROWS_WITH_AS(medusa::check_row_invariance(model, some_tokens(14)),
                       "medusa: check_row_invariance: 14 tokens need 18 slots, more than the context of 16",
                       medusa::invalid_input);
  medusa::row_invariance_options o;
  o.pass_sizes = {4, 0};
  CHECK_THROWS_AS(medusa::check_row_invariance(model, some_tokens(8), o), medusa::invalid_input);
}
