// SPDX-License-Identifier: Apache-2.0
// Batches for the tree-attention tests (the emulated unit test and the GPU test): requests with
// their own committed lengths and trees, contiguous or paged caches of random K/V, queries, the
// packed tree masks and the FlashInfer custom-mask stream, and the references the kernels are
// held to: the CPU `medusa::tree_attention` and a double-precision computation over the mask bits.
#pragma once

#include <doctest/doctest.h>
#include <medusa/attention.hpp>
#include <medusa/cuda/emulation.hpp>
#include <medusa/cuda/kernels/attention.hpp>
#include <medusa/kv_cache.hpp>
#include <medusa/tree.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <type_traits>
#include <vector>

namespace medusa_test {

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;
using mk::attention_mask_kind;


inline std::vector<int> random_parents(std::mt19937& rng, int n) {
  std::vector<int> p(static_cast<std::size_t>(n), -1);
  for (int i = 1; i < n; ++i) {
    const int lo = (i % 5 == 0) ? i - 1 : 0;  // shallow and wide, with some chains
    p[static_cast<std::size_t>(i)] = std::uniform_int_distribution<int>(lo, i - 1)(rng);
  }
  return p;
}

inline std::vector<int> parents_of(const medusa::tree& t) {
  std::vector<int> p(static_cast<std::size_t>(t.num_nodes()));
  for (int u = 0; u < t.num_nodes(); ++u) p[static_cast<std::size_t>(u)] = u == 0 ? -1 : t.parent(u);
  return p;
}

// Packed ancestor-or-self rows, `wpr` words each.
inline std::vector<std::uint32_t> packed_mask(const std::vector<int>& parents, int wpr) {
  const int n = static_cast<int>(parents.size());
  std::vector<std::uint32_t> w(static_cast<std::size_t>(n * wpr), 0u);
  for (int i = 0; i < n; ++i)
    for (int u = i; u >= 0; u = parents[static_cast<std::size_t>(u)])
      w[static_cast<std::size_t>(i * wpr + u / 32)] |= 1u << (u % 32);
  return w;
}

// One request of a batch: committed length, new tokens and (tree masks) the tree's parents.
struct request {
  int L = 0;
  int n = 1;
  std::vector<int> parents;  // empty: causal
};

struct shape {
  int hq = 2, hkv = 1, dim = 16, layers = 2, layer = 1;
  int capacity = 128;  // slots per request
  int page_size = 0;   // 0: contiguous
  int kv_split = 0;
  attention_mask_kind mask = attention_mask_kind::tree;
  bool single_query = true;  // plans of one token per request may use the single-query kernel
};

// A batch's caches, queries and masks in host memory, with the emulated kernels and the
// references over the same bytes.
template <class KV>
struct batch_fixture {
  shape s;
  std::vector<request> req;
  int B = 0, T = 0, wpr = 1, q_stride = 0, out_stride = 0;
  std::vector<KV> k, v;
  std::vector<std::int32_t> slot_bases, tables, indptr, lengths, mask_offsets, mask_indptr;
  std::vector<std::uint32_t> words;
  std::vector<std::uint8_t> custom;
  std::vector<float> q;
  int num_pages = 0, blocks = 0;
  bool shared_mask = false;  // one tree for all requests: no per-request mask offsets

  batch_fixture(const shape& sh, std::vector<request> rs, std::mt19937& rng) : s(sh), req(std::move(rs)) {
    B = static_cast<int>(req.size());
    indptr.assign(1, 0);
    for (const request& r : req) {
      indptr.push_back(indptr.back() + r.n);
      lengths.push_back(r.L);
    }
    T = indptr.back();
    q_stride = s.hq * s.dim + 5;  // rows further apart than one token's heads
    out_stride = s.hq * s.dim + 3;
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const std::size_t row = static_cast<std::size_t>(s.hkv * s.dim);
    if (s.page_size == 0) {
      const std::size_t slots = static_cast<std::size_t>(B * s.capacity);
      k.resize(static_cast<std::size_t>(s.layers) * slots * row);
      for (int b = 0; b < B; ++b) slot_bases.push_back(b * s.capacity);
    } else {
      blocks = (s.capacity + s.page_size - 1) / s.page_size;
      num_pages = B * blocks + 3;
      k.resize(static_cast<std::size_t>(s.layers * num_pages * s.page_size) * row);
      std::vector<std::int32_t> pages(static_cast<std::size_t>(num_pages));
      std::iota(pages.begin(), pages.end(), 0);
      std::shuffle(pages.begin(), pages.end(), rng);
      tables.assign(pages.begin(), pages.begin() + B * blocks);
    }
    v.resize(k.size());
    for (auto& x : k) x = KV(u(rng));
    for (auto& x : v) x = KV(u(rng));
    q.resize(static_cast<std::size_t>(T * q_stride));
    for (auto& x : q) x = 2.5f * u(rng);  // peaky enough that the running max matters
    int max_n = 1;
    for (const request& r : req) max_n = std::max(max_n, r.n);
    wpr = (max_n + 31) / 32 + (max_n % 3 == 0 ? 1 : 0);  // sometimes more words than needed
    for (const request& r : req) {
      mask_offsets.push_back(static_cast<std::int32_t>(words.size()));
      const auto w = packed_mask(r.parents.empty() ? std::vector<int>(1, -1) : r.parents, wpr);
      words.insert(words.end(), w.begin(), w.end());
      if (r.parents.empty()) words.resize(words.size() + static_cast<std::size_t>((r.n - 1) * wpr), 0u);
    }
    build_custom();
  }

  // New committed lengths, as a replay over grown caches reads them: the run (`lengths`) and the
  // references (`req`, the FlashInfer stream, rebuilt without any edited bits) alike.
  void set_lengths(const std::vector<int>& L) {
    REQUIRE(L.size() == req.size());
    for (std::size_t b = 0; b < L.size(); ++b) {
      REQUIRE(L[b] + req[b].n <= s.capacity);
      req[b].L = L[b];
      lengths[b] = L[b];
    }
    build_custom();
  }

  // FlashInfer stream: the tree (or causal) rows, prefix visible, unless the test edits bits.
  void build_custom() {
    custom.clear();
    mask_indptr.clear();
    for (int b = 0; b < B; ++b) {
      const request& r = req[static_cast<std::size_t>(b)];
      mask_indptr.push_back(static_cast<std::int32_t>(custom.size()));
      const std::size_t kv_len = static_cast<std::size_t>(r.L + r.n);
      custom.resize(custom.size() + (static_cast<std::size_t>(r.n) * kv_len + 7) / 8, 0);
      for (int i = 0; i < r.n; ++i)
        for (int key = 0; key < r.L + r.n; ++key)
          if (sees(b, i, key)) set_custom(b, i, key, true);
    }
  }

  // The tree/causal visibility of slot `key` for query i of request b.
  [[nodiscard]] bool sees(int b, int i, int key) const {
    const request& r = req[static_cast<std::size_t>(b)];
    if (key < r.L) return true;
    const int j = key - r.L;
    if (r.parents.empty()) return j <= i;
    for (int u = i; u >= 0; u = r.parents[static_cast<std::size_t>(u)])
      if (u == j) return true;
    return false;
  }
  void set_custom(int b, int i, int key, bool on) {
    const request& r = req[static_cast<std::size_t>(b)];
    const std::size_t bit = static_cast<std::size_t>(i) * static_cast<std::size_t>(r.L + r.n) + static_cast<std::size_t>(key);
    std::uint8_t& byte = custom[static_cast<std::size_t>(mask_indptr[static_cast<std::size_t>(b)]) + bit / 8];
    byte = static_cast<std::uint8_t>(on ? byte | (1u << (bit % 8)) : byte & ~(1u << (bit % 8)));
  }
  [[nodiscard]] bool custom_bit(int b, int i, int key) const {
    const request& r = req[static_cast<std::size_t>(b)];
    const std::size_t bit = static_cast<std::size_t>(i) * static_cast<std::size_t>(r.L + r.n) + static_cast<std::size_t>(key);
    return ((custom[static_cast<std::size_t>(mask_indptr[static_cast<std::size_t>(b)]) + bit / 8] >> (bit % 8)) & 1u) != 0;
  }

  // Request b's cache as a CPU view over the same memory.
  [[nodiscard]] auto contiguous_view(int b) const {
    const std::size_t row = static_cast<std::size_t>(s.hkv * s.dim);
    const std::size_t layer = static_cast<std::size_t>(B * s.capacity) * row;
    const auto m = medusa::layout_kv_strided::mapping::strided({s.layers, s.hkv, s.dim}, s.capacity, layer, row,
                                                               static_cast<std::size_t>(s.dim));
    const std::size_t base = static_cast<std::size_t>(b * s.capacity) * row;
    return medusa::kv_cache_view<const KV>(k.data() + base, v.data() + base, m);
  }
  [[nodiscard]] auto paged_view(int b) const {
    const std::span<const std::int32_t> table(tables.data() + static_cast<std::size_t>(b * blocks),
                                              static_cast<std::size_t>(blocks));
    const auto m = medusa::layout_kv_paged::mapping::dense({s.layers, s.hkv, s.dim}, s.page_size, num_pages,
                                                          medusa::kv_layout::nhd, table);
    return medusa::kv_cache_view<const KV, medusa::layout_kv_paged>(k.data(), v.data(), m);
  }

  // The arrays a run reads, in host memory here or in device memory (the GPU test's copies).
  struct arrays {
    const float* q = nullptr;
    KV* k = nullptr;
    KV* v = nullptr;
    const std::int32_t* slot_bases = nullptr;
    const std::int32_t* tables = nullptr;
    const std::int32_t* indptr = nullptr;
    const std::int32_t* lengths = nullptr;
    const std::uint32_t* words = nullptr;
    const std::int32_t* mask_offsets = nullptr;
    const std::uint8_t* custom = nullptr;
    const std::int32_t* mask_indptr = nullptr;
  };
  [[nodiscard]] arrays host_arrays() {
    return {q.data(), k.data(), v.data(), slot_bases.data(), tables.data(), indptr.data(), lengths.data(),
            words.data(), mask_offsets.data(), custom.data(), mask_indptr.data()};
  }

  // The cache geometry over `k` and `v` with the slot bases or block tables at the given addresses.
  [[nodiscard]] mk::batch_kv kv_over(KV* kp, KV* vp, const std::int32_t* bases, const std::int32_t* tabs) const {
    if (s.page_size == 0) {
      const std::size_t row = static_cast<std::size_t>(s.hkv * s.dim);
      const auto m = medusa::layout_kv_strided::mapping::strided({s.layers, s.hkv, s.dim}, B * s.capacity,
                                                                 static_cast<std::size_t>(B * s.capacity) * row, row,
                                                                 static_cast<std::size_t>(s.dim));
      return mk::make_batch_kv(medusa::kv_cache_view<KV>(kp, vp, m), bases, s.capacity);
    }
    const auto m = medusa::layout_kv_paged::mapping::dense({s.layers, s.hkv, s.dim}, s.page_size, num_pages,
                                                          medusa::kv_layout::nhd, {});
    return mk::make_batch_kv(medusa::kv_cache_view<KV, medusa::layout_kv_paged>(kp, vp, m), tabs, blocks);
  }
  [[nodiscard]] mk::batch_kv device_kv() { return kv_over(k.data(), v.data(), slot_bases.data(), tables.data()); }

  // The arguments of a run over `arr`, writing `out` ([T][out_stride]).
  template <class O>
  [[nodiscard]] mk::attention_params<KV, O> params(const arrays& arr, O* out, float scale = 0.0f) const {
    mk::attention_params<KV, O> a;
    a.q = arr.q;
    a.q_row_stride = q_stride;
    a.out = out;
    a.out_row_stride = out_stride;
    a.batch = B;
    a.qo_indptr = arr.indptr;
    a.cache_lengths = arr.lengths;
    a.kv = kv_over(arr.k, arr.v, arr.slot_bases, arr.tables);
    a.layer = s.layer;
    a.scale = scale;
    a.tree_mask = arr.words;
    a.words_per_row = wpr;
    a.tree_mask_offsets = shared_mask ? nullptr : arr.mask_offsets;
    a.custom_mask = arr.custom;
    a.mask_indptr = arr.mask_indptr;
    return a;
  }

  [[nodiscard]] mk::attention_problem problem() const {
    int max_n = 1;
    for (const request& r : req) max_n = std::max(max_n, r.n);
    return {.batch = B, .max_tokens = T, .max_tokens_per_request = max_n, .max_kv_length = s.capacity,
            .num_q_heads = s.hq, .num_kv_heads = s.hkv, .head_dim = s.dim, .mask = s.mask, .kv_split = s.kv_split,
            .single_query_kernel = s.single_query};
  }

  // The kernels through the emulation (host compilers only: under nvcc the bodies are device
  // code); outputs [T][out_stride] as float (cells start at 1e4, so that a row left unwritten shows).
  // `misaligned`: K and V copied one element off 16-byte alignment (the element-wise reads).
  template <class O>
  std::vector<float> emulate(float scale = 0.0f, mk::attention_plan* plan_out = nullptr, bool misaligned = false) {
    const mk::attention_plan plan = mk::plan_attention(problem());
    if (plan_out != nullptr) *plan_out = plan;
    std::vector<O> out(static_cast<std::size_t>(T * out_stride), O(1e4f));
    arrays arr = host_arrays();
    std::vector<KV> k_off, v_off;
    if (misaligned) {
      k_off.assign(k.size() + 1, KV(0.0f));
      v_off.assign(v.size() + 1, KV(0.0f));
      std::copy(k.begin(), k.end(), k_off.begin() + 1);
      std::copy(v.begin(), v.end(), v_off.begin() + 1);
      arr.k = k_off.data() + 1;
      arr.v = v_off.data() + 1;
    }
    mk::attention_params<KV, O> a = params(arr, out.data(), scale);
    mk::check_attention_args(plan, a);
    // Poisoned workspace: a merge that read a cell no split wrote would give NaN.
    std::vector<float> ws((plan.workspace_bytes + sizeof(float) - 1) / sizeof(float),
                          std::numeric_limits<float>::quiet_NaN());
    REQUIRE(mk::bind_attention_workspace(plan, a, ws.data(), ws.size() * sizeof(float)));
    mc::emulate(plan.main, [&](auto& ctx) { mk::attention_main(ctx, plan, a); });
    if (plan.splits > 1) mc::emulate(plan.merge, [&](auto& ctx) { mk::attention_merge(ctx, plan, a); });
    std::vector<float> f(out.size());
    for (std::size_t i = 0; i < out.size(); ++i) f[i] = static_cast<float>(out[i]);
    return f;
  }

  // Request b's queries as the CPU takes them: [n][hq][dim].
  [[nodiscard]] std::vector<float> queries(int b) const {
    const request& r = req[static_cast<std::size_t>(b)];
    std::vector<float> out(static_cast<std::size_t>(r.n * s.hq * s.dim));
    for (int i = 0; i < r.n; ++i)
      std::copy_n(q.data() + static_cast<std::size_t>((indptr[static_cast<std::size_t>(b)] + i) * q_stride),
                  s.hq * s.dim, out.data() + static_cast<std::size_t>(i * s.hq * s.dim));
    return out;
  }

  // medusa::tree_attention for request b (tree or causal masks).
  [[nodiscard]] std::vector<float> cpu(int b, float scale = 0.0f) const {
    const request& r = req[static_cast<std::size_t>(b)];
    const auto qs = queries(b);
    std::vector<float> out(qs.size());
    const auto run = [&](const auto& view) {
      if (r.parents.empty())
        medusa::causal_attention(view, s.layer, r.L, qs, r.n, s.hq, out, {scale});
      else
        medusa::tree_attention(view, s.layer, r.L, qs, r.n, s.hq,
                               medusa::tree_mask_view{std::span<const std::uint32_t>(words).subspan(
                                                          shared_mask ? 0 : static_cast<std::size_t>(mask_offsets[static_cast<std::size_t>(b)])),
                                                      wpr},
                               out, {scale});
    };
    if (s.page_size == 0) run(contiguous_view(b));
    else run(paged_view(b));
    return out;
  }

  // Double-precision reference over the custom bits (every mode writes them).
  [[nodiscard]] std::vector<float> naive(int b, float scale = 0.0f) const {
    const request& r = req[static_cast<std::size_t>(b)];
    const int G = s.hq / s.hkv;
    const double sc = scale > 0.0f ? scale : 1.0 / std::sqrt(static_cast<double>(s.dim));
    const auto qs = queries(b);
    std::vector<float> out(qs.size(), 0.0f);
    const auto read = [&](const auto& view) {
      for (int i = 0; i < r.n; ++i)
        for (int h = 0; h < s.hq; ++h) {
          std::vector<int> keys;
          for (int key = 0; key < r.L + r.n; ++key)
            if (custom_bit(b, i, key)) keys.push_back(key);
          if (keys.empty()) continue;
          const float* qi = qs.data() + static_cast<std::size_t>((i * s.hq + h) * s.dim);
          std::vector<double> w;
          double mx = -1e300;
          for (int key : keys) {
            double dot = 0;
            for (int d = 0; d < s.dim; ++d)
              dot += static_cast<double>(qi[d]) * static_cast<double>(static_cast<float>(view.k(s.layer, key, h / G, d)));
            w.push_back(dot * sc);
            mx = std::max(mx, w.back());
          }
          double sum = 0;
          for (double& x : w) sum += (x = std::exp(x - mx));
          for (int d = 0; d < s.dim; ++d) {
            double acc = 0;
            for (std::size_t j = 0; j < keys.size(); ++j)
              acc += w[j] * static_cast<double>(static_cast<float>(view.v(s.layer, keys[j], h / G, d)));
            out[static_cast<std::size_t>((i * s.hq + h) * s.dim + d)] = static_cast<float>(acc / sum);
          }
        }
    };
    if (s.page_size == 0) read(contiguous_view(b));
    else read(paged_view(b));
    return out;
  }

  // Request b's rows of an emulated output, [n][hq][dim].
  [[nodiscard]] std::vector<float> rows_of(const std::vector<float>& out, int b) const {
    const request& r = req[static_cast<std::size_t>(b)];
    std::vector<float> got(static_cast<std::size_t>(r.n * s.hq * s.dim));
    for (int i = 0; i < r.n; ++i)
      std::copy_n(out.data() + static_cast<std::size_t>((indptr[static_cast<std::size_t>(b)] + i) * out_stride),
                  s.hq * s.dim, got.data() + static_cast<std::size_t>(i * s.hq * s.dim));
    return got;
  }
};

// Node u of request 0 of the tree batch `tree` (its parents `parents`) decoded alone: the same
// cache with u's ancestors' rows committed at L, L+1, ... and u's at L + depth, one causal query
// (u's). Its output must have the bits of u's row in the tree pass.
template <class KV>
batch_fixture<KV> alone_fixture(const batch_fixture<KV>& tree, const std::vector<int>& parents, int u, std::mt19937& rng) {
  std::vector<int> path;
  for (int x = u; x >= 0; x = parents[static_cast<std::size_t>(x)]) path.push_back(x);
  std::reverse(path.begin(), path.end());
  const int depth = static_cast<int>(path.size()) - 1;
  const int L = tree.req[0].L;
  shape sa = tree.s;
  sa.mask = attention_mask_kind::causal;
  batch_fixture<KV> alone(sa, {{L + depth, 1, {}}}, rng);
  alone.k = tree.k;
  alone.v = tree.v;
  alone.tables = tree.tables;
  alone.num_pages = tree.num_pages;
  alone.blocks = tree.blocks;
  // element offset of (layer, slot, head 0) of request 0
  const auto row_of = [&](int slot) {
    if (tree.s.page_size == 0)
      return static_cast<std::size_t>(slot * tree.s.hkv * tree.s.dim) +
             static_cast<std::size_t>(tree.s.layer) * static_cast<std::size_t>(tree.B * tree.s.capacity * tree.s.hkv * tree.s.dim);
    return tree.paged_view(0).mapping().offset(tree.s.layer, slot, 0);
  };
  // The path's rows to L, L+1, ... in ascending order (path[j] >= j: no row is clobbered).
  for (int j = 0; j <= depth; ++j)
    for (std::size_t e = 0; e < static_cast<std::size_t>(tree.s.hkv * tree.s.dim); ++e) {
      alone.k[row_of(L + j) + e] = tree.k[row_of(L + path[static_cast<std::size_t>(j)]) + e];
      alone.v[row_of(L + j) + e] = tree.v[row_of(L + path[static_cast<std::size_t>(j)]) + e];
    }
  std::copy_n(tree.q.data() + static_cast<std::size_t>(u * tree.q_stride), tree.s.hq * tree.s.dim, alone.q.data());
  return alone;
}

inline void check_close(const std::vector<float>& got, const std::vector<float>& want, float tol) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= tol * (1.0f + std::fabs(want[i])))) {
      FAIL("element " << i << ": got " << got[i] << ", want " << want[i]);
    }
}

// Tolerance of an output of type O over a cache of type KV against float references.
template <class KV, class O>
float tolerance() {
  if constexpr (!std::is_same_v<O, float>) return std::is_same_v<O, medusa::bfloat16> ? 1e-2f : 2e-3f;
  return 2e-5f;
}

// A launch replayed over a growing cache, as a captured CUDA graph is: two 7-node tree requests
// over paged f16 caches, whose committed lengths grow each round (`replay_lengths`) past the
// first round's key splits.
inline constexpr int replay_rounds = 4;
inline batch_fixture<medusa::half> replay_fixture(std::mt19937& rng) {
  shape s;
  s.hq = 4;
  s.hkv = 2;
  s.dim = 64;
  s.capacity = 256;
  s.page_size = 16;
  s.kv_split = 64;
  return batch_fixture<medusa::half>(s, {{50, 7, {-1, 0, 0, 1, 1, 2, 3}}, {120, 7, {-1, 0, 1, 2, 3, 4, 5}}}, rng);
}
inline std::vector<int> replay_lengths(int round) { return {50 + 40 * round, 120 + 40 * round}; }

// Token i of the causal chunk `chunk` (request 0) decoded alone: its K/V and its query.
template <class KV>
batch_fixture<KV> one_of_chunk(const batch_fixture<KV>& chunk, int i, std::mt19937& rng) {
  batch_fixture<KV> one(chunk.s, {{chunk.req[0].L + i, 1, {}}}, rng);
  one.k = chunk.k;
  one.v = chunk.v;
  std::copy_n(chunk.q.data() + static_cast<std::size_t>(i * chunk.q_stride), chunk.s.hq * chunk.s.dim, one.q.data());
  return one;
}

inline std::vector<request> random_batch(std::mt19937& rng, int B, int max_L, int max_n, bool tree) {
  std::vector<request> rs;
  for (int b = 0; b < B; ++b) {
    request r;
    r.L = std::uniform_int_distribution<int>(0, max_L)(rng);
    r.n = std::uniform_int_distribution<int>(1, max_n)(rng);
    if (tree) r.parents = random_parents(rng, r.n);
    rs.push_back(r);
  }
  return rs;
}

}  // namespace medusa_test
