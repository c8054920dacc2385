// SPDX-License-Identifier: Apache-2.0
// The CUDA KV-cache commit body, run by the host emulation, against the CPU `medusa::kv_commit`:
// bit-exact buffers for overlapping paths, batches of mixed lengths, NHD/HND contiguous and paged
// caches, f32/f16/bf16, rows of any byte size; rows outside the committed ranges untouched; bad
// requests rejected alone; bad geometry refused by the plan.
#include <doctest/doctest.h>
#include <medusa/cuda/emulation.hpp>
#include <medusa/cuda/kernels/kv_commit.hpp>
#include <medusa/half.hpp>
#include <medusa/kv_cache.hpp>

#include "../common_kv_commit_cases.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <vector>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;
using medusa::kv_extents;
using medusa::kv_layout;

namespace {

using medusa_test::fixed_requests;
using medusa_test::random_elements;
using medusa_test::random_requests;
using medusa_test::request_case;

// The batch arrays of the kernel, packed.
struct packed_batch {
  std::vector<std::int32_t> lengths, offsets, paths, new_lengths;
  explicit packed_batch(const std::vector<request_case>& requests) {
    offsets.push_back(0);
    for (const auto& r : requests) {
      lengths.push_back(r.committed);
      paths.insert(paths.end(), r.path.begin(), r.path.end());
      offsets.push_back(static_cast<std::int32_t>(paths.size()));
    }
    new_lengths.assign(requests.size(), -7);
  }
  mk::kv_commit_batch view() {
    return {.size = static_cast<int>(lengths.size()),
            .committed_lengths = lengths.data(),
            .path_offsets = offsets.data(),
            .paths = paths.data(),
            .new_lengths = new_lengths.data()};
  }
};

// Whether a slot's row lies in the buffers (a paged view's table may hold a bad page on purpose).
template <class View>
bool addressable(const View& view, int slot) {
  const auto& m = view.mapping();
  if constexpr (requires { m.block_table; }) {
    const std::int32_t page = m.block_table[slot / m.page_size];
    return page >= 0 && page < m.num_pages;
  } else {
    return true;
  }
}

// Runs the emulated kernel on `k`/`v` and the CPU commit on copies (per request, through the
// views `views_of(k, v)` returns), then compares both buffers bit for bit, the new lengths, and
// checks that every row outside a request's committed range [L+1, L+A] kept its bytes.
template <class T, class ViewsOf>
void check_commit(std::vector<T>& k, std::vector<T>& v, T* k_base, T* v_base, mk::kv_commit_params params,
                  const std::vector<request_case>& requests, ViewsOf views_of, const mc::launch_shape* shape,
                  bool strided = false) {
  std::vector<T> ref_k = k, ref_v = v, old_k = k, old_v = v;
  const auto shift = [](std::vector<T>& to, const std::vector<T>& from, T* p) {
    return to.data() + (p - from.data());
  };
  const auto ref_views = views_of(shift(ref_k, k, k_base), shift(ref_v, v, v_base));
  std::vector<std::int32_t> expected;
  for (std::size_t b = 0; b < requests.size(); ++b) {
    const auto& r = requests[b];
    expected.push_back(r.valid ? medusa::kv_commit(ref_views[b], r.committed, r.nodes, r.path) : -1);
  }
  packed_batch batch(requests);
  params.batch = batch.view();
  // The verify kernels' layout: [B][stride] paths and accept lengths A_b.
  std::vector<std::int32_t> strided_paths, accept_lengths;
  if (strided) {
    int stride = 1;
    for (const auto& r : requests) stride = std::max(stride, static_cast<int>(r.path.size()));
    strided_paths.assign(requests.size() * static_cast<std::size_t>(stride), -5);
    for (std::size_t b = 0; b < requests.size(); ++b) {
      std::copy(requests[b].path.begin(), requests[b].path.end(), strided_paths.begin() + static_cast<std::ptrdiff_t>(b) * stride);
      accept_lengths.push_back(static_cast<std::int32_t>(requests[b].path.size()) - 1);
    }
    params.batch.path_offsets = nullptr;
    params.batch.paths = strided_paths.data();
    params.batch.path_stride = stride;
    params.batch.accept_lengths = accept_lengths.data();
  }
  const mk::kv_commit_plan plan = mk::plan_kv_commit(params);
  CHECK(plan.workspace_bytes == 0);
  CHECK(plan.vector_bytes == mk::kv_commit_vector_bytes(params));
  mc::emulate(shape != nullptr ? *shape : plan.shape, [&](auto& ctx) { mk::kv_commit(ctx, params); });
  CHECK(std::memcmp(k.data(), ref_k.data(), k.size() * sizeof(T)) == 0);
  CHECK(std::memcmp(v.data(), ref_v.data(), v.size() * sizeof(T)) == 0);
  CHECK(batch.new_lengths == expected);

  const auto out_views = views_of(k_base, v_base);
  const auto old_views = views_of(shift(old_k, k, k_base), shift(old_v, v, v_base));
  const std::size_t row_bytes = static_cast<std::size_t>(params.shape.head_dim) * sizeof(T);
  int changed_rows_outside = 0;
  for (std::size_t b = 0; b < requests.size(); ++b) {
    const auto& r = requests[b];
    const int moved_end = r.valid ? r.committed + static_cast<int>(r.path.size()) : 0;
    for (int layer = 0; layer < params.shape.num_layers; ++layer)
      for (int slot = 0; slot < out_views[b].capacity(); ++slot) {
        if ((slot > r.committed && slot < moved_end) || !addressable(out_views[b], slot)) continue;
        for (int head = 0; head < params.shape.num_kv_heads; ++head) {
          changed_rows_outside += std::memcmp(out_views[b].k_row(layer, slot, head),
                                              old_views[b].k_row(layer, slot, head), row_bytes) != 0;
          changed_rows_outside += std::memcmp(out_views[b].v_row(layer, slot, head),
                                              old_views[b].v_row(layer, slot, head), row_bytes) != 0;
        }
      }
  }
  CHECK(changed_rows_outside == 0);
}

// A batch in one contiguous cache `[layers][B·capacity][heads][dim]` (NHD) or
// `[layers][heads][B·capacity][dim]` (HND); request b owns slots [b·capacity, (b+1)·capacity).
// `base_shift` elements in front of the cache misalign it for vector moves.
template <class T>
void check_contiguous(kv_layout layout, kv_extents ext, int capacity, const std::vector<request_case>& requests,
                      std::uint32_t seed, int expect_vector_bytes, int base_shift = 0,
                      const mc::launch_shape* shape = nullptr, bool strided = false) {
  using mapping = medusa::layout_kv_strided::mapping;
  const int batch = static_cast<int>(requests.size());
  const mapping whole = mapping::dense(ext, batch * capacity, layout);
  const mapping per_request =
      mapping::strided(ext, capacity, whole.layer_stride, whole.slot_stride, whole.head_stride);
  std::mt19937 rng(seed);
  const std::size_t n = whole.required_span_size() + static_cast<std::size_t>(base_shift);
  std::vector<T> k = random_elements<T>(n, rng), v = random_elements<T>(n, rng);
  T* const k_base = k.data() + base_shift;
  T* const v_base = v.data() + base_shift;
  const auto views_of = [&](T* kp, T* vp) {
    std::vector<medusa::kv_cache_view<T>> views;
    for (int b = 0; b < batch; ++b) {
      const std::size_t first = static_cast<std::size_t>(b * capacity) * whole.slot_stride;
      views.emplace_back(kp + first, vp + first, per_request);
    }
    return views;
  };
  std::vector<std::int32_t> slot_bases(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) slot_bases[static_cast<std::size_t>(b)] = b * capacity;
  const auto params = mk::make_kv_commit_params(medusa::kv_cache_view<T>(k_base, v_base, whole), {},
                                                slot_bases.data(), capacity);
  CHECK(mk::kv_commit_vector_bytes(params) == expect_vector_bytes);
  check_commit(k, v, k_base, v_base, params, requests, views_of, shape, strided);
}

// A batch in a page pool `[layers][pages][page]` with a scrambled block table per request
// (`blocks` pages each, distinct, and a few pages nobody maps).
template <class T>
void check_paged(kv_layout page_layout, kv_extents ext, int page_size, int blocks,
                 const std::vector<request_case>& requests, std::uint32_t seed, int expect_vector_bytes,
                 const mc::launch_shape* shape = nullptr,
                 const std::function<void(std::vector<std::int32_t>&)>& edit_tables = {}) {
  const int batch = static_cast<int>(requests.size());
  const int pages = batch * blocks + 3;
  std::mt19937 rng(seed);
  const std::size_t n = static_cast<std::size_t>(ext.num_layers) * static_cast<std::size_t>(pages) *
                        static_cast<std::size_t>(page_size * ext.num_kv_heads * ext.head_dim);
  std::vector<T> k = random_elements<T>(n, rng), v = random_elements<T>(n, rng);
  std::vector<std::int32_t> order(static_cast<std::size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::int32_t> tables(order.begin(), order.begin() + batch * blocks);
  if (edit_tables) edit_tables(tables);
  const auto views_of = [&](T* kp, T* vp) {
    std::vector<medusa::paged_kv_cache_view<T>> views;
    for (int b = 0; b < batch; ++b)
      views.push_back(medusa::make_paged_kv_view<T>(
          std::span<T>(kp, n), std::span<T>(vp, n), ext, page_size, page_layout,
          std::span<const std::int32_t>(tables.data() + b * blocks, static_cast<std::size_t>(blocks))));
    return views;
  };
  // One request: the view's own block table; a batch: the batch table.
  const auto params = batch == 1 ? mk::make_kv_commit_params(views_of(k.data(), v.data())[0], {})
                                 : mk::make_kv_commit_params(views_of(k.data(), v.data())[0], {}, tables.data(), blocks);
  CHECK(mk::kv_commit_vector_bytes(params) == expect_vector_bytes);
  check_commit(k, v, k.data(), v.data(), params, requests, views_of, shape);
}

}  // namespace

TEST_CASE("overlapping and corner-case paths commit as on the CPU (f32 NHD, 16-byte moves)") {
  check_contiguous<float>(kv_layout::nhd, {2, 3, 8}, 24, fixed_requests(), 1, 16);
  check_contiguous<float>(kv_layout::hnd, {2, 3, 8}, 24, fixed_requests(), 2, 16);
}

TEST_CASE("random batches match the CPU commit: NHD/HND, f32/f16/bf16, every row width") {
  std::mt19937 rng(42);
  // (head_dim, expected move width) per element size: rows of 16·k bytes, 8, 4 and 2 bytes.
  for (kv_layout layout : {kv_layout::nhd, kv_layout::hnd}) {
    for (auto [dim, width] : {std::pair{8, 16}, {6, 4}, {3, 2}, {12, 8}}) {
      INFO("layout ", layout == kv_layout::nhd ? "nhd" : "hnd", ", 16-bit head_dim ", dim);
      const auto requests = random_requests(rng, 5, 20, 12);
      check_contiguous<medusa::half>(layout, {2, 2, dim}, 20, requests, rng(), width);
      check_contiguous<medusa::bfloat16>(layout, {1, 3, dim}, 20, requests, rng(), width);
    }
    for (auto [dim, width] : {std::pair{4, 16}, {6, 8}, {5, 4}, {64, 16}}) {
      INFO("layout ", layout == kv_layout::nhd ? "nhd" : "hnd", ", f32 head_dim ", dim);
      check_contiguous<float>(layout, {2, 2, dim}, 18, random_requests(rng, 4, 18, 10), rng(), width);
    }
  }
}

TEST_CASE("paged caches with scrambled block tables and pages that do not divide the lengths") {
  std::mt19937 rng(7);
  for (kv_layout layout : {kv_layout::nhd, kv_layout::hnd}) {
    for (int page_size : {1, 3, 4, 5}) {
      INFO("page layout ", layout == kv_layout::nhd ? "nhd" : "hnd", ", page_size ", page_size);
      const int blocks = (21 + page_size - 1) / page_size;
      const int capacity = blocks * page_size;
      check_paged<float>(layout, {2, 2, 8}, page_size, blocks, random_requests(rng, 4, capacity, 12), rng(), 16);
      check_paged<medusa::half>(layout, {2, 2, 6}, page_size, blocks, random_requests(rng, 3, capacity, 12), rng(), 4);
      check_paged<medusa::bfloat16>(layout, {1, 3, 8}, page_size, blocks, fixed_requests(), rng(), 16);
    }
  }
  // A single request through the view's own block table.
  check_paged<medusa::half>(kv_layout::nhd, {2, 2, 8}, 4, 6, {{5, 9, {0, 2, 3, 8}}}, 11, 16);
}

TEST_CASE("any launch shape gives the same result (grid-stride over requests and columns)") {
  const mc::launch_shape one_block{.grid_x = 1, .grid_y = 1, .threads = 32};
  const mc::launch_shape two_rows{.grid_x = 2, .grid_y = 2, .threads = 64};
  std::mt19937 rng(3);
  check_contiguous<float>(kv_layout::nhd, {3, 4, 16}, 20, random_requests(rng, 5, 20, 12), rng(), 16, 0, &one_block);
  check_contiguous<medusa::half>(kv_layout::hnd, {2, 3, 6}, 20, fixed_requests(), rng(), 4, 0, &two_rows);
  check_paged<float>(kv_layout::hnd, {2, 2, 5}, 3, 7, random_requests(rng, 5, 21, 12), rng(), 4, &one_block);
}

TEST_CASE("a misaligned cache falls back to narrower moves") {
  std::mt19937 rng(5);
  // One element in front: 2-byte moves for 16-bit elements, 4-byte moves for f32.
  check_contiguous<medusa::half>(kv_layout::nhd, {2, 2, 8}, 16, random_requests(rng, 3, 16, 10), rng(), 2, 1);
  check_contiguous<float>(kv_layout::hnd, {2, 2, 8}, 16, random_requests(rng, 3, 16, 10), rng(), 4, 1);
  // Two f32 elements in front: 8-byte aligned.
  check_contiguous<float>(kv_layout::nhd, {2, 2, 8}, 16, fixed_requests(), rng(), 8, 2);
}

TEST_CASE("a request with bad data is rejected alone: new length -1, nothing moved") {
  std::vector<request_case> requests = fixed_requests();
  requests.push_back({2, 4, {1, 2}, false});         // does not start at the root
  requests.push_back({2, 4, {0, 3, 3}, false});      // not strictly increasing
  requests.push_back({20, 6, {0, 5}, false});        // L + node beyond the request's 24 slots
  requests.push_back({-1, 3, {0, 1}, false});        // negative committed length
  requests.push_back({24, 1, {0}, false});           // L + 1 beyond the capacity
  requests.push_back({4, 5, {0, 3, 2, 4}, false});   // decreasing in the middle
  requests.push_back({4, 5, {}, false});             // empty path
  std::mt19937 rng(9);
  check_contiguous<float>(kv_layout::nhd, {2, 2, 8}, 24, requests, rng(), 16);

  // Paged: a block-table entry outside the pool (only slots that move need valid pages).
  std::vector<request_case> paged = {{1, 6, {0, 1, 5}}, {0, 8, {0, 2, 7}, false}, {4, 3, {0, 2}}};
  const int blocks = 3;
  check_paged<float>(kv_layout::nhd, {1, 2, 4}, 4, blocks, paged, rng(), 16, nullptr,
                     [&](std::vector<std::int32_t>& tables) { tables[blocks + 1] = 1000; });  // request 1's slots 4..7
}

TEST_CASE("the plan refuses bad geometry with launch_error") {
  std::vector<float> k(4096), v(4096);
  const auto good = [&] {
    mk::kv_commit_params p;
    p.batch.size = 2;
    p.k = k.data();
    p.v = v.data();
    p.element_bytes = 4;
    p.shape = {2, 2, 8};
    p.layer_stride = 1024;
    p.head_stride = 8;
    p.slot_stride = 16;
    p.slots_per_request = 32;
    return p;
  };
  const auto refused = [](const mk::kv_commit_params& p, mc::launch_errc code) {
    try {
      (void)mk::plan_kv_commit(p);
    } catch (const mc::launch_error& e) {
      return e.code() == code;
    }
    return false;
  };
  const mk::kv_commit_plan plan = mk::plan_kv_commit(good());
  CHECK(plan.vector_bytes == 16);
  CHECK(plan.items_per_request == 2 * 2 * 2 * 2);
  CHECK(plan.shape.threads == 32);
  CHECK(plan.shape.grid_x == 1);
  CHECK(plan.shape.grid_y == 2);
  CHECK(plan.shape.shared_bytes == 0);

  using enum mc::launch_errc;
  auto p = good();
  p.batch.size = 0;
  CHECK(refused(p, invalid_shape));
  p = good();
  p.element_bytes = 3;
  CHECK(refused(p, unsupported));
  p.element_bytes = 8;
  CHECK(refused(p, unsupported));
  p.element_bytes = 0;
  CHECK(refused(p, invalid_shape));
  p = good();
  p.shape.num_layers = 0;
  CHECK(refused(p, invalid_shape));
  p = good();
  p.shape.num_kv_heads = -1;
  CHECK(refused(p, invalid_shape));
  p = good();
  p.shape.head_dim = 0;
  CHECK(refused(p, invalid_shape));
  p = good();
  p.slot_stride = 4;  // below head_dim: slots overlap
  CHECK(refused(p, invalid_shape));
  p = good();
  p.head_stride = 0;
  CHECK(refused(p, invalid_shape));
  p = good();
  p.slots_per_request = 0;
  CHECK(refused(p, invalid_shape));
  p = good();
  p.layer_stride = std::size_t{1} << 62;  // offsets overflow
  CHECK(refused(p, invalid_shape));
  p = good();
  p.shape = {1 << 14, 1 << 10, 1 << 10};  // columns beyond the int range
  CHECK(refused(p, invalid_shape));
  p = good();
  p.k = reinterpret_cast<unsigned char*>(k.data()) + 2;  // not aligned to the element size
  CHECK(refused(p, invalid_shape));
  p = good();
  p.layout = static_cast<mk::kv_commit_layout>(7);
  CHECK(refused(p, invalid_shape));

  // Paged geometry.
  const auto paged = [&] {
    auto q = good();
    q.layout = mk::kv_commit_layout::paged;
    q.page_size = 4;
    q.num_pages = 8;
    q.blocks_per_request = 3;
    q.page_stride = 4 * 2 * 8;
    q.token_stride = 16;
    return q;
  };
  CHECK_NOTHROW((void)mk::plan_kv_commit(paged()));
  p = paged();
  p.page_size = 0;
  CHECK(refused(p, invalid_shape));
  p = paged();
  p.num_pages = 0;
  CHECK(refused(p, invalid_shape));
  p = paged();
  p.blocks_per_request = -2;
  CHECK(refused(p, invalid_shape));
  p = paged();
  p.token_stride = 2;
  CHECK(refused(p, invalid_shape));
  p = paged();
  p.blocks_per_request = 1 << 30;  // capacity overflows int
  CHECK(refused(p, invalid_shape));

  // Null pointers are the launcher's business: the plan of a geometry accepts them.
  p = good();
  p.k = p.v = nullptr;
  CHECK_NOTHROW((void)mk::plan_kv_commit(p));
  p = paged();
  p.page_size = -1;
  CHECK_THROWS_WITH_AS((void)mk::plan_kv_commit(p), doctest::Contains("kv commit: page_size"), mc::launch_error);
}

TEST_CASE("paths read straight from the verify kernels' output ([B][stride] + accept lengths)") {
  check_contiguous<float>(kv_layout::nhd, {2, 3, 8}, 24, fixed_requests(), 3, 16, 0, nullptr, /*strided=*/true);
  std::mt19937 rng(11);
  check_contiguous<medusa::bfloat16>(kv_layout::hnd, {2, 2, 8}, 20, random_requests(rng, 6, 20, 12), rng(), 16, 0,
                                     nullptr, /*strided=*/true);
}
