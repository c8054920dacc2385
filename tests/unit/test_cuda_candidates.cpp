// SPDX-License-Identifier: Apache-2.0
// The CUDA top-k and candidate-gather kernel bodies, run by the host emulation, against the CPU
// library: bit-exact ids (ties to the lower id), every preset, batches, f32/f16/bf16 logits.
#include <doctest/doctest.h>
#include <medusa/candidates.hpp>
#include <medusa/cuda/emulation.hpp>
#include <medusa/cuda/kernels/gather.hpp>
#include <medusa/cuda/kernels/top_k.hpp>
#include <medusa/cuda/kernels/tree_arrays.hpp>
#include <medusa/tree.hpp>

#include <algorithm>
#include <limits>
#include <random>
#include <vector>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;

namespace {

// Logits rounded to a coarse grid so that ties are common, stored as T.
template <class T>
std::vector<T> random_logits(std::size_t n, std::uint32_t seed, float grid = 0.25f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<T> out(n);
  for (auto& x : out) x = T(std::round(d(rng) / grid) * grid);
  return out;
}

template <class T>
std::vector<float> as_float(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(v[i]);
  return out;
}

// Runs both stages of the top-k through the emulation.
template <class T>
std::vector<std::int32_t> emulated_top_k(const std::vector<T>& logits, int rows, int vocab, int k,
                                         int target_blocks, std::vector<std::int32_t>* status = nullptr,
                                         int rows_per_status = 1) {
  const mk::top_k_plan plan = mk::plan_top_k(rows, vocab, k, target_blocks);
  std::vector<unsigned char> workspace(plan.workspace_bytes);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows * k), -7);
  mk::top_k_args<T> a;
  a.logits = logits.data();
  a.row_stride = vocab;
  a.out_ids = ids.data();
  a.status = status != nullptr ? status->data() : nullptr;
  a.rows_per_status = rows_per_status;
  REQUIRE(mk::bind_top_k_workspace(plan, a, workspace.data(), workspace.size()));
  mk::with_top_k_bucket(plan.bucket, [&](auto bucket) {
    constexpr int K = decltype(bucket)::value;
    mc::emulate(plan.scan, [&](auto& ctx) { mk::top_k_scan<K>(ctx, a); });
    if (plan.splits > 1) mc::emulate(plan.merge, [&](auto& ctx) { mk::top_k_merge_splits<K>(ctx, a); });
  });
  return ids;
}

template <class T>
void check_top_k(int rows, int vocab, int k, int target_blocks, std::uint32_t seed) {
  const auto logits = random_logits<T>(static_cast<std::size_t>(rows * vocab), seed);
  const auto ids = emulated_top_k(logits, rows, vocab, k, target_blocks);
  const auto f = as_float(logits);
  for (int r = 0; r < rows; ++r) {
    std::vector<std::int32_t> expect(static_cast<std::size_t>(k));
    medusa::top_k(std::span<const float>(f).subspan(static_cast<std::size_t>(r * vocab), static_cast<std::size_t>(vocab)),
                  expect);
    for (int j = 0; j < k; ++j) CHECK(ids[static_cast<std::size_t>(r * k + j)] == expect[static_cast<std::size_t>(j)]);
  }
}

}  // namespace

TEST_CASE("top-k ids equal the CPU's, ties to the lower id, one split and several") {
  for (const int k : {1, 2, 3, 8, 10, 16}) {
    CAPTURE(k);
    check_top_k<float>(3, 300, k, 1, 11u + static_cast<std::uint32_t>(k));     // one split
    check_top_k<float>(2, 5000, k, 264, 23u + static_cast<std::uint32_t>(k));  // 3 splits per row
  }
  check_top_k<medusa::bfloat16>(4, 4500, 5, 264, 5u);
  check_top_k<medusa::half>(4, 700, 16, 1, 6u);
}

TEST_CASE("a row of equal logits ranks by ascending id") {
  const std::vector<float> flat(3000, 1.5f);
  const auto ids = emulated_top_k(flat, 1, 3000, 16, 264);
  for (int j = 0; j < 16; ++j) CHECK(ids[static_cast<std::size_t>(j)] == j);
}

TEST_CASE("a non-finite logit marks its request, the other requests stay ok") {
  auto logits = random_logits<float>(4 * 500, 3u);
  logits[2 * 500 + 77] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::int32_t> status(2, 0);
  (void)emulated_top_k(logits, 4, 500, 4, 1, &status, /*rows_per_status=*/2);
  CHECK(status[0] == 0);
  CHECK(status[1] == static_cast<std::int32_t>(mc::request_status::non_finite_logit));
}

TEST_CASE("top-k plans refuse bad shapes with a typed error") {
  CHECK_THROWS_AS(mk::plan_top_k(0, 100, 4), mc::launch_error);
  CHECK_THROWS_AS(mk::plan_top_k(2, 3, 4), mc::launch_error);
  CHECK_THROWS_WITH_AS(mk::plan_top_k(2, 100, 17), doctest::Contains("exceeds the 16"), mc::launch_error);
  const auto p = mk::plan_top_k(1, 128256, 10);
  CHECK(p.bucket == 16);
  CHECK(p.splits > 1);
  CHECK(p.splits * p.chunk >= 128256);
}

TEST_CASE("candidate gather equals generate_candidates for every preset, batched") {
  const int vocab = 400, batch = 3;
  for (const auto& name : medusa::preset_names()) {
    CAPTURE(name);
    const auto t = medusa::tree::preset(std::string(name));
    const int heads = t.depth() + 1;  // one head more than the tree reads
    int k = 0;
    for (int d = 1; d <= t.depth(); ++d) k = std::max(k, t.max_rank(d) + 1);
    const auto logits = random_logits<float>(static_cast<std::size_t>(batch * heads * vocab), 99u, 0.01f);
    const auto top = emulated_top_k(logits, batch * heads, vocab, k, 1);
    const std::vector<std::int32_t> roots{5, 17, 399};
    const std::vector<std::int32_t> lengths{0, 12, 7};
    const int n = t.num_nodes();
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(batch * n), -1), positions(tokens.size(), -1);
    const std::vector<int> packed = mc::pack_tree(t);
    const auto view = mc::tree_arrays::over(t, packed.data());
    mk::gather_args g{.batch = batch, .heads = heads, .k_stride = k, .roots = roots.data(),
                      .head_top_k = top.data(), .lengths = lengths.data(), .node_tokens = tokens.data(),
                      .positions = positions.data()};
    mc::emulate(mk::plan_gather(view, batch, heads, k), [&](auto& ctx) { mk::gather_candidates(ctx, view, g); });
    for (int b = 0; b < batch; ++b) {
      std::vector<std::int32_t> flat(medusa::flat_candidates_size(t, heads)), expect(static_cast<std::size_t>(n));
      medusa::generate_candidates(t, roots[static_cast<std::size_t>(b)],
                                  std::span<const float>(logits).subspan(static_cast<std::size_t>(b * heads * vocab),
                                                                         static_cast<std::size_t>(heads * vocab)),
                                  vocab, flat, expect);
      for (int u = 0; u < n; ++u) {
        CHECK(tokens[static_cast<std::size_t>(b * n + u)] == expect[static_cast<std::size_t>(u)]);
        CHECK(positions[static_cast<std::size_t>(b * n + u)] == lengths[static_cast<std::size_t>(b)] + t.node_depth(u));
      }
    }
  }
}

TEST_CASE("masked logits rank last; a row with every token masked marks its request") {
  auto logits = random_logits<float>(4 * 3000, 8u);
  for (std::size_t i = 1; i < logits.size(); i += 2) logits[i] = -std::numeric_limits<float>::infinity();
  for (const int target : {1, 264}) {  // one split and several
    const auto ids = emulated_top_k(logits, 4, 3000, 16, target);
    for (int r = 0; r < 4; ++r) {
      std::vector<std::int32_t> expect(16);
      medusa::top_k(std::span<const float>(logits).subspan(static_cast<std::size_t>(r * 3000), 3000), expect);
      for (int j = 0; j < 16; ++j) CHECK(ids[static_cast<std::size_t>(r * 16 + j)] == expect[static_cast<std::size_t>(j)]);
    }
  }
  std::fill(logits.begin() + 3000, logits.begin() + 6000, -std::numeric_limits<float>::infinity());
  for (const int target : {1, 264}) {
    std::vector<std::int32_t> status(4, 0);
    (void)emulated_top_k(logits, 4, 3000, 4, target, &status, 1);
    CHECK(status == std::vector<std::int32_t>{0, static_cast<std::int32_t>(mc::request_status::non_finite_logit), 0, 0});
  }
}
