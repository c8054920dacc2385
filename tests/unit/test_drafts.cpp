// SPDX-License-Identifier: Apache-2.0
// Per-step drafts (drafts.hpp): n-gram lookup, dynamic trees from head probabilities, and lookup
// branches merged into the heads' tree; every result compiles as a valid tree.
#include <medusa/drafts.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <random>
#include <set>
#include <vector>

using paths_t = std::vector<std::vector<int>>;

TEST_CASE("n-gram lookup: longest suffix first, most recent occurrence, bounded continuation") {
  const medusa::ngram_lookup look{.min_ngram = 2, .max_ngram = 3, .max_tokens = 4};
  std::vector<std::int32_t> out(8, -1);
  // The 3-gram [8 6 7] never occurred before; [6 7] did, twice.
  const std::vector<std::int32_t> h{5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 9, 9, 8, 6, 7};
  CHECK(look.find(h, out) == 4);  // the most recent [6 7] is at 8: 9 9 8 6, capped at max_tokens
  CHECK(std::vector<std::int32_t>(out.begin(), out.begin() + 4) == std::vector<std::int32_t>{9, 9, 8, 6});
  const std::vector<std::int32_t> h2{1, 2, 3, 4, 5, 6, 1, 2, 3};
  CHECK(look.find(h2, out) == 4);  // [1 2 3] at 0: 4 5 6 1, capped at max_tokens
  CHECK(std::vector<std::int32_t>(out.begin(), out.begin() + 4) == std::vector<std::int32_t>{4, 5, 6, 1});
  CHECK(look.find(std::vector<std::int32_t>{1, 2, 3, 4}, out) == 0);
  CHECK(look.find(std::vector<std::int32_t>{}, out) == 0);
  CHECK(look.find(std::vector<std::int32_t>{7}, out) == 0);
  CHECK(look.find(h2, std::span<std::int32_t>(out.data(), 2)) == 2);  // the output bounds it too
  CHECK_THROWS_AS((medusa::ngram_lookup{.min_ngram = 0}.validate()), medusa::invalid_input);
  CHECK_THROWS_AS((medusa::ngram_lookup{.min_ngram = 3, .max_ngram = 2}.validate()), medusa::invalid_input);
  CHECK_THROWS_AS((medusa::ngram_lookup{.max_tokens = 0}.validate()), medusa::invalid_input);
}

TEST_CASE("dynamic paths: best first, prefix-closed at every size, always a valid tree") {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int trial = 0; trial < 50; ++trial) {
    const int heads = 1 + trial % 4, topk = 10;
    std::vector<float> probs;
    for (int k = 0; k < heads; ++k) {
      float left = 1.0f;
      for (int r = 0; r < topk; ++r) {
        probs.push_back(left * u(rng) * 0.8f);
        left -= probs.back();
      }
      std::sort(probs.end() - topk, probs.end(), std::greater<>());
    }
    const auto paths = medusa::dynamic_paths(probs, topk, 1 + trial, 0);
    CHECK(static_cast<int>(paths.size()) <= 1 + trial);
    for (std::size_t n = 1; n <= paths.size(); ++n) {
      const paths_t head(paths.begin(), paths.begin() + static_cast<std::ptrdiff_t>(n));
      REQUIRE_NOTHROW((void)medusa::tree::from_paths(head, {.topk = topk, .max_depth = heads}));
    }
  }
  // A confident head 0 and an unsure head 1: the chain first, then head 1's rank 1.
  const std::vector<float> probs{0.9f, 0.05f, 0.6f, 0.3f};
  CHECK(medusa::dynamic_paths(probs, 2, 3, 0) == paths_t{{0}, {0, 0}, {0, 1}});
  CHECK(medusa::dynamic_paths(probs, 2, 3, 1) == paths_t{{0}, {1}});
  CHECK_THROWS_AS((void)medusa::dynamic_paths(std::vector<float>{0.5f, 0.2f, 0.1f}, 2, 3, 0), medusa::invalid_input);
}

TEST_CASE("lookup branches follow the heads' nodes while they agree, then add rank-topk nodes") {
  // Heads: [0] [1] [0,0]; head 0's tokens 10 11, head 1's 20 21.
  const paths_t heads{{0}, {1}, {0, 0}};
  const std::vector<std::int32_t> top{10, 11, 20, 21};
  // 10 20 30 31: shares [0] and [0,0], then two lookup nodes under [0,0].
  const std::vector<std::int32_t> c1{10, 20, 30, 31};
  const auto p1 = medusa::with_lookup_branch(heads, top, 2, c1);
  CHECK(p1 == paths_t{{0}, {1}, {0, 0}, {0, 0, 2}, {0, 0, 2, 2}});
  // 11 25: shares [1], then [1,2] (head 1's tokens under [1] are not in the tree).
  CHECK(medusa::with_lookup_branch(heads, top, 2, std::vector<std::int32_t>{11, 25}) == paths_t{{0}, {1}, {0, 0}, {1, 2}});
  // 99: a new branch under the root.
  CHECK(medusa::with_lookup_branch(heads, top, 2, std::vector<std::int32_t>{99, 98}) == paths_t{{0}, {1}, {0, 0}, {2}, {2, 2}});
  CHECK(medusa::with_lookup_branch(heads, top, 2, {}) == heads);
  // Every result compiles with topk + 1 ranks and deeper than the heads.
  const auto t = medusa::tree::from_paths(p1, {.topk = 3, .max_depth = 16});
  CHECK(t.num_nodes() == 6);
  CHECK(t.depth() == 4);
}
