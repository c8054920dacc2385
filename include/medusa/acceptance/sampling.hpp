// SPDX-License-Identifier: Apache-2.0
//! @file acceptance/sampling.hpp
//! Lossless tree speculative sampling: the warp of the target distribution, the algorithms of the
//! sampling policies (rejection, speculative, recursive rejection without replacement over
//! per-depth drafts), `sample_token` for a sampled root and `sample_candidates` for drafts drawn
//! from the heads' own distributions. `verify` (acceptance/verify.hpp) runs them.
//!
//! @code
//! #include <medusa/acceptance/sampling.hpp>
//! medusa::acceptance_workspace ws(0, vocab);
//! const std::int32_t root = medusa::sample_token(prefill_logits, medusa::sampling_warp{.temperature = 0.8f},
//!                                                /*seed=*/42, /*step=*/0, ws);
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/acceptance/policies.hpp>
#include <medusa/acceptance/request.hpp>
#include <medusa/acceptance_error.hpp>
#include <medusa/candidates.hpp>
#include <medusa/detail/philox.hpp>
#include <medusa/detail/row_math.hpp>
#include <medusa/tree.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

namespace detail {

//! Writes the unnormalised warped target of row z into r[0, V) and returns its mass.
inline double warp_into(std::span<const float> z, const sampling_warp& w, double* r,
                        std::int32_t* ids, std::uint64_t* keys) {
  const std::size_t v = z.size();
  if (!(w.temperature > 0.0f)) {
    std::fill(r, r + v, 0.0);
    r[argmax_finite(z.data(), v)] = 1.0;
    return 1.0;
  }
  const float* x = z.data();
  const float m = row_max(x, v).max;
  double mass = softmax_fill(x, v, m, 1.0f / w.temperature, r);
  // Keep exactly the tokens ranked at or above `last` (ranking: logit desc, id asc).
  auto keep_through = [&](std::int32_t last) {
    double kept = 0.0;
    for (std::size_t i = 0; i < v; ++i) {
      const auto id = static_cast<std::int32_t>(i);
      if (id != last && !ranks_before(x, id, last)) r[i] = 0.0;
      kept += r[i];
    }
    return kept;
  };
  const bool use_k = w.top_k > 0 && static_cast<std::size_t>(w.top_k) < v;
  const bool use_p = w.top_p < 1.0f;
  if (use_k) {
    top_k_ids(x, v, w.top_k, ids);
    mass = keep_through(ids[w.top_k - 1]);
  }
  if (use_p) {
    const double budget = static_cast<double>(w.top_p) * mass;
    // Ranks kept: up to and including the first whose inclusive prefix mass exceeds the budget.
    auto scan = [&](const std::int32_t* ranked, std::size_t count, double before) -> std::int32_t {
      for (std::size_t i = 0; i < count; ++i) {
        before += r[ranked[i]];
        if (before > budget) return ranked[i];
      }
      return -1;
    };
    if (use_k) {  // the top-k ids are already ranked
      const std::int32_t last = scan(ids, static_cast<std::size_t>(w.top_k), 0.0);
      if (last >= 0) mass = keep_through(last);
    } else {
      // Usually the nucleus is small: try the 64 best first (cheap insertion top-k).
      const std::size_t k0 = std::min<std::size_t>(64, v);
      top_k_ids(x, v, static_cast<int>(k0), ids);
      std::int32_t last = scan(ids, k0, 0.0);
      if (last < 0 && k0 < v) {
        // Weighted quickselect: halve the candidate range around its median rank, keeping the
        // half that contains the crossing; O(V) expected, no full sort.
        // Sort keys: ascending key = descending logit, then ascending id (no indirection).
        for (std::size_t i = 0; i < v; ++i) {
          const auto ok = static_cast<std::uint32_t>(ordered_key(x[i])) ^ 0x80000000u;
          keys[i] = (static_cast<std::uint64_t>(~ok) << 32) | static_cast<std::uint64_t>(i);
        }
        auto id_of = [](std::uint64_t key) { return static_cast<std::int32_t>(key & 0xffffffffu); };
        std::size_t lo = 0, hi = v;
        double before = 0.0;
        while (hi - lo > 64) {
          const std::size_t mid = lo + (hi - lo) / 2;
          std::nth_element(keys + lo, keys + mid, keys + hi);
          double upper = 0.0;
          for (std::size_t i = lo; i < mid; ++i) upper += r[id_of(keys[i])];
          if (before + upper > budget) {
            hi = mid;
          } else {
            before += upper;
            lo = mid;
          }
        }
        std::sort(keys + lo, keys + hi);
        for (std::size_t i = lo; i < hi; ++i) ids[i - lo] = id_of(keys[i]);
        last = scan(ids, hi - lo, before);
        if (last < 0 && hi < v) last = ids[hi - lo - 1];  // summation-order rounding at the boundary
      }
      if (last >= 0) mass = keep_through(last);
    }
  }
  return mass;
}

//! Inverse-CDF draw over ascending token id from the unnormalised r (mass m).
inline std::int32_t draw_from(const double* r, std::size_t v, double mass, double u) {
  const double target = u * mass;
  double acc = 0.0;
  std::int32_t last_positive = -1;
  for (std::size_t i = 0; i < v; ++i) {
    if (r[i] <= 0.0) continue;
    acc += r[i];
    last_positive = static_cast<std::int32_t>(i);
    if (target < acc) return last_positive;
  }
  return last_positive;  // rounding guard: the mass ran out before the target
}

//! Inverse-CDF draw over ascending token id from the unnormalised r at `target` (u · mass),
//! skipping whole blocks of `block` tokens by their masses `sums` (one pass over the blocks and
//! one block instead of one pass over the vocabulary).
inline std::int32_t draw_blocked(const double* r, std::size_t v, const double* sums, std::size_t block,
                                 double target) {
  const std::size_t blocks = (v + block - 1) / block;
  double acc = 0.0;
  std::size_t b = 0;
  for (; b < blocks && !(target < acc + sums[b]); ++b) acc += sums[b];
  std::int32_t last_positive = -1;
  for (std::size_t i = std::min(b, blocks) * block; i < v; ++i) {  // past the block if rounding says so
    if (r[i] <= 0.0) continue;
    acc += r[i];
    last_positive = static_cast<std::int32_t>(i);
    if (target < acc) return last_positive;
  }
  if (last_positive >= 0) return last_positive;
  for (std::size_t i = v; i-- > 0;)  // rounding guard: the mass ran out before the target
    if (r[i] > 0.0) return static_cast<std::int32_t>(i);
  return -1;
}

// Mass of r over [b·block, min((b+1)·block, v)).
inline double block_mass(const double* r, std::size_t v, std::size_t block, std::size_t b) noexcept {
  const std::size_t begin = b * block, end = std::min(v, begin + block);
  double acc[4] = {};
  std::size_t i = begin;
  for (; i + 4 <= end; i += 4)
    for (std::size_t j = 0; j < 4; ++j) acc[j] += r[i + j];
  for (; i < end; ++i) acc[0] += r[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

inline void check_draft_row(std::span<const float> q, int node, std::int32_t token) {
  double sum = 0.0;
  for (std::size_t i = 0; i < q.size(); ++i) {
    const float p = q[i];
    if (!(p >= 0.0f) || !std::isfinite(p))
      throw acceptance_error(acceptance_errc::bad_draft,
                             "node " + std::to_string(node) + ": draft probability of token " +
                                 std::to_string(i) + " is " + std::to_string(p),
                             node);
    sum += p;
  }
  if (std::abs(sum - 1.0) > 1e-3)
    throw acceptance_error(acceptance_errc::bad_draft,
                           "node " + std::to_string(node) + ": draft distribution sums to " +
                               std::to_string(sum) + ", not 1",
                           node);
  if (!(q[static_cast<std::size_t>(token)] > 0.0f))
    throw acceptance_error(acceptance_errc::bad_draft,
                           "node " + std::to_string(node) + ": its token " +
                               std::to_string(token) + " has draft probability 0",
                           node);
}

template <tree_like Tree, sampling_policy Policy>
verify_result verify_sampling(const Tree& t, const verify_request& req, const Policy& policy,
                              acceptance_workspace& ws) {
  const sampling_warp w{static_cast<float>(policy.temperature), static_cast<int>(policy.top_k),
                        static_cast<float>(policy.top_p)};
  const auto v = static_cast<std::size_t>(req.vocab);
  double* r = workspace_access::residual(ws);
  std::int32_t* ids = workspace_access::ids(ws);
  philox_stream uniform{req.seed, req.step, 0};
  verify_result res;
  int u = 0;
  for (;;) {
    double m = warp_into(checked_row(req, u), w, r, ids, workspace_access::keys(ws));
    int accepted = -1;
    const int cb = t.child_begin(u);
    for (int c = cb; c < cb + t.child_count(u); ++c) {
      const std::int32_t x = req.node_tokens[static_cast<std::size_t>(c)];
      const double rx = r[x];
      if constexpr (Policy::draft_distributions) {
        const auto q = req.draft_probs.subspan(static_cast<std::size_t>(c) * v, v);
        check_draft_row(q, c, x);
        const double qx = static_cast<double>(q[static_cast<std::size_t>(x)]);
        // Accept with probability min(1, (r(x)/m) / q(x)); rounding guard when it reaches 1.
        const double u01 = uniform();
        if (rx > 0.0 && (rx >= m * qx || u01 * m * qx < rx)) {
          accepted = c;
          break;
        }
        // Residual norm(max(r/m − q, 0)), kept unnormalised: r ← max(r − m·q, 0).
        double next = 0.0;
        for (std::size_t i = 0; i < v; ++i) next += std::max(r[i] - m * static_cast<double>(q[i]), 0.0);
        if (next > 0.0) {  // 0 only when r/m == q up to rounding: then rejection had probability 0
          for (std::size_t i = 0; i < v; ++i) r[i] = std::max(r[i] - m * static_cast<double>(q[i]), 0.0);
          m = next;
        }
      } else {
        const double u01 = uniform();
        if (rx > 0.0 && (rx >= m || u01 * m < rx)) {
          accepted = c;
          break;
        }
        m -= rx;
        r[x] = 0.0;
        if (!(m > 0.0)) {  // rounding left no mass: restore the exact remainder
          m = 0.0;
          for (std::size_t i = 0; i < v; ++i) m += r[i];
        }
      }
    }
    if (accepted < 0) {
      fill_path(t, req, u, res);
      res.bonus = draw_from(r, v, m, uniform());
      break;
    }
    u = accepted;
    if (req.node_tokens[static_cast<std::size_t>(u)] == req.eos_token) {
      fill_path(t, req, u, res);
      res.eos = true;
      res.bonus = -1;
      break;
    }
  }
  set_first_row_through(t, res);
  return res;
}

// Philox draw indices of the draft draws (`sample_candidates`): the upper half of the counter
// space of a (seed, step), disjoint from the verify uniforms, which count up from 0.
inline constexpr std::uint64_t draft_draw_offset = std::uint64_t{1} << 63;

struct draft_row_stats {
  double sum = 0.0;      // Σ p in double (fixed 8-lane order, shared by drawing and verifying)
  int positive = 0;      // tokens with p > 0
  long first_bad = -1;   // first NaN, negative or +Inf entry
};

// Sum, positive count and first invalid entry of a draft row. The sum runs in 8 independent
// lanes (a fixed order, so drawing and verifying get the same value) and, like the counting pass,
// vectorises.
inline draft_row_stats draft_row_scan(const float* p, std::size_t v) noexcept {
  constexpr std::size_t lanes = 8;
  double acc[lanes] = {};
  std::size_t i = 0;
  for (; i + lanes <= v; i += lanes)
    for (std::size_t j = 0; j < lanes; ++j) acc[j] += static_cast<double>(p[i + j]);
  for (std::size_t j = 0; j < lanes && i + j < v; ++j) acc[j] += static_cast<double>(p[i + j]);
  draft_row_stats st;
  st.sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  int ok = 1;
  constexpr float top = std::numeric_limits<float>::max();
  for (std::size_t k = 0; k < v; ++k) {
    const float x = p[k];
    st.positive += x > 0.0f ? 1 : 0;
    ok &= (x >= 0.0f ? 1 : 0) & (x <= top ? 1 : 0);  // NaN, negative and +Inf fail
  }
  if (!ok)
    for (std::size_t k = 0; k < v && st.first_bad < 0; ++k)
      if (!(p[k] >= 0.0f && p[k] <= top)) st.first_bad = static_cast<long>(k);
  return st;
}

// Checks one per-depth draft row (finite, ≥ 0, sums to 1 ± 1e-3) and returns its statistics.
inline draft_row_stats scan_draft_row(std::span<const float> p, int depth, int node) {
  const draft_row_stats st = draft_row_scan(p.data(), p.size());
  if (st.first_bad >= 0)
    throw acceptance_error(acceptance_errc::bad_draft,
                           "depth " + std::to_string(depth) + " draft row: probability of token " +
                               std::to_string(st.first_bad) + " is " +
                               std::to_string(p[static_cast<std::size_t>(st.first_bad)]),
                           node);
  if (std::abs(st.sum - 1.0) > 1e-3)
    throw acceptance_error(acceptance_errc::bad_draft,
                           "depth " + std::to_string(depth) + " draft row sums to " +
                               std::to_string(st.sum) + ", not 1",
                           node);
  return st;
}

// Mass of a draft row without its draws so far: kept by subtraction, and summed again over the
// tokens not drawn when cancellation would cost precision (the draws took all but 1e-6 of the
// mass since the last summation). Drawing and verifying update it identically, so both see
// bit-identical conditional distributions p_i.
struct draft_mass {
  double rest = 0.0;
  double base = 0.0;  // the mass at the last exact summation

  explicit draft_mass(double sum) noexcept : rest(sum), base(sum) {}

  // Token x of probability p[x] > 0 was drawn; drawn[0, count) holds every draw, x included.
  void remove(std::span<const float> p, std::int32_t x, const std::int32_t* drawn, int count) noexcept {
    rest -= static_cast<double>(p[static_cast<std::size_t>(x)]);
    if (rest > 1e-6 * base) return;
    double exact = 0.0;
    for (std::size_t i = 0; i < p.size(); ++i) {
      if (!(p[i] > 0.0f)) continue;
      bool taken = false;
      for (int j = 0; j < count && !taken; ++j) taken = drawn[j] == static_cast<std::int32_t>(i);
      if (!taken) exact += static_cast<double>(p[i]);
    }
    rest = base = exact;
  }
};

// Recursive rejection sampling without replacement over per-depth draft rows (see
// `draft_sampling_policy`).
template <tree_like Tree, sampling_policy Policy>
verify_result verify_depth_drafts(const Tree& t, const verify_request& req, const Policy& policy,
                                  acceptance_workspace& ws) {
  const sampling_warp w{static_cast<float>(policy.temperature), static_cast<int>(policy.top_k),
                        static_cast<float>(policy.top_p)};
  const auto v = static_cast<std::size_t>(req.vocab);
  double* r = workspace_access::residual(ws);
  std::int32_t* ids = workspace_access::ids(ws);
  std::int32_t* drawn = workspace_access::drawn(ws);
  double* saved = workspace_access::drawn_r(ws);
  philox_stream uniform{req.seed, req.step, 0};
  verify_result res;
  int u = 0;
  for (;;) {
    double m = warp_into(checked_row(req, u), w, r, ids, workspace_access::keys(ws));
    int accepted = -1;
    const int cc = t.child_count(u);
    if (cc > 0) {
      const int d = t.node_depth(u) + 1;
      const int cb = t.child_begin(u);
      const auto p = req.draft_rows.subspan(static_cast<std::size_t>(d - 1) * v, v);
      const draft_row_stats st = scan_draft_row(p, d, cb);
      int last_rank = 0;
      for (int c = cb; c < cb + cc; ++c) last_rank = std::max(last_rank, t.rank(c));
      const int db = t.depth_begin(d);
      const int de = d < t.depth() ? t.depth_begin(d + 1) : t.num_nodes();
      int count = 0, drawn_positive = 0;
      draft_mass mass(st.sum);
      // The draws of depth d in order, up to the last one that is a child of u.
      for (int k = 0; k <= last_rank; ++k) {
        int first = -1;  // the draw of rank k is the token of every depth-d node of that rank
        for (int x = db; x < de && first < 0; ++x)
          if (t.rank(x) == k) first = x;
        if (first < 0) continue;  // no node of this rank: never drawn
        const std::int32_t x = req.node_tokens[static_cast<std::size_t>(first)];
        int child = -1;
        for (int c = cb; c < cb + cc && child < 0; ++c)
          if (t.rank(c) == k) child = c;
        if (child >= 0 && req.node_tokens[static_cast<std::size_t>(child)] != x)
          throw acceptance_error(acceptance_errc::bad_draft,
                                 "node " + std::to_string(child) + ": token " +
                                     std::to_string(req.node_tokens[static_cast<std::size_t>(child)]) +
                                     " differs from token " + std::to_string(x) + " of node " +
                                     std::to_string(first) +
                                     " of the same depth and rank (one draw per depth and rank)",
                                 child);
        for (int j = 0; j < count; ++j)
          if (drawn[j] == x)
            throw acceptance_error(acceptance_errc::bad_draft,
                                   "node " + std::to_string(first) + ": token " + std::to_string(x) +
                                       " repeats an earlier draw of depth " + std::to_string(d) +
                                       " (draws are without replacement)",
                                   first);
        const double px = static_cast<double>(p[static_cast<std::size_t>(x)]);
        // Every token of positive draft mass drawn: later draws are point masses.
        const bool exhausted = drawn_positive == st.positive;
        if (!exhausted && !(px > 0.0))
          throw acceptance_error(acceptance_errc::bad_draft,
                                 "node " + std::to_string(first) + ": its token " + std::to_string(x) +
                                     " has draft probability 0",
                                 first);
        if (child >= 0) {
          const double rx = r[x];
          const double rest = exhausted ? 1.0 : mass.rest;
          const double qx = exhausted ? 1.0 : px / rest;  // p_i(x)
          // Accept with probability min(1, (r(x)/m) / p_i(x)); rounding guard when it reaches 1.
          const double u01 = uniform();
          if (rx > 0.0 && (rx >= m * qx || u01 * m * qx < rx)) {
            accepted = child;
            break;
          }
          if (exhausted) {  // point mass: the residual loses exactly x
            m -= rx;
            r[x] = 0.0;
            if (!(m > 0.0)) {
              m = 0.0;
              for (std::size_t i = 0; i < v; ++i) m += r[i];
            }
          } else {
            // r ← max(r − m·p_i, 0) in one pass; p_i is 0 at the earlier draws: their r is kept.
            const double scale = m / rest;
            for (int j = 0; j < count; ++j) saved[j] = r[drawn[j]];
            constexpr std::size_t lanes = 8;  // independent partial sums: the pass vectorises
            double part[lanes] = {};
            std::size_t i0 = 0;
            for (; i0 + lanes <= v; i0 += lanes)
              for (std::size_t j = 0; j < lanes; ++j) {
                const double y = std::max(r[i0 + j] - scale * static_cast<double>(p[i0 + j]), 0.0);
                r[i0 + j] = y;
                part[j] += y;
              }
            for (std::size_t j = 0; j < lanes && i0 + j < v; ++j) {
              const double y = std::max(r[i0 + j] - scale * static_cast<double>(p[i0 + j]), 0.0);
              r[i0 + j] = y;
              part[j] += y;
            }
            double next = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
            for (int j = 0; j < count; ++j) {
              next += saved[j] - r[drawn[j]];
              r[drawn[j]] = saved[j];
            }
            if (!(next > 0.0)) {
              // Only when r/m == p_i up to rounding (rejection had probability 0): the residual
              // is then p_i itself.
              for (std::size_t i = 0; i < v; ++i) r[i] = scale * static_cast<double>(p[i]);
              for (int j = 0; j < count; ++j) r[drawn[j]] = 0.0;
              next = 0.0;
              for (std::size_t i = 0; i < v; ++i) next += r[i];
            }
            m = next;
          }
        }
        drawn[count++] = x;
        if (px > 0.0) {
          ++drawn_positive;
          mass.remove(p, x, drawn, count);
        }
      }
    }
    if (accepted < 0) {
      fill_path(t, req, u, res);
      res.bonus = draw_from(r, v, m, uniform());
      break;
    }
    u = accepted;
    if (req.node_tokens[static_cast<std::size_t>(u)] == req.eos_token) {
      fill_path(t, req, u, res);
      res.eos = true;
      res.bonus = -1;
      break;
    }
  }
  set_first_row_through(t, res);
  return res;
}

}  // namespace detail

//! Draws one token from the warped distribution of a logit row (a sampled root: the rejection
//! mode's first root after prefill). Uses draw 0 of Philox(`seed`, `step`): give the
//! prefill root a step number that no verify call of the same request uses.
//! @throws acceptance_error on an empty row, NaN/+Inf, every token masked, or bad warp parameters.
inline std::int32_t sample_token(std::span<const float> z, const sampling_warp& warp,
                                 std::uint64_t seed, std::uint64_t step,
                                 acceptance_workspace& ws) {
  warp.validate();
  detail::check_vocab(static_cast<int>(z.size()));
  detail::check_logit_row(z, -1, "sampled row");
  ws.reserve(0, static_cast<int>(z.size()));
  using detail::workspace_access;
  const double m = detail::warp_into(z, warp, workspace_access::residual(ws), workspace_access::ids(ws),
                                     workspace_access::keys(ws));
  return detail::draw_from(workspace_access::residual(ws), z.size(), m, detail::philox_uniform(seed, step, 0));
}

//! Draws the tree's candidate tokens from the heads' own distributions, for
//! `draft_sampling_policy`. For each depth d, the draft p_d = `warp` applied to head d-1's logits
//! (the target's temperature, top-k and top-p: the drafts propose what the target may keep) is
//! written to `draft_rows` row d-1 (float; pass it as `verify_request::draft_rows`), and one
//! token is drawn without replacement from it for each rank present at depth d, in ascending rank
//! order (`max_rank(d) + 1` draws for a tree without rank gaps); every depth-d node of that rank
//! gets the token. Once the tokens of positive draft probability run out, the remaining ranks take
//! the best remaining head logits (ties → lower id), so T = 0 gives exactly `generate_candidates`'
//! top-K tokens. `node_tokens[0] = root`.
//!
//! Randomness: Philox(`seed`, `step`) at draw indices from 2^63 up, disjoint from the uniforms of
//! the verify call of the same (seed, step), which count up from 0: give it the step of the
//! verify call that checks these drafts.
//! @throws acceptance_error `vocab_mismatch` (vocab ≤ 0, more ranks than tokens), `size_mismatch`
//!         (head rows fewer than the depth or not whole, `node_tokens` or `draft_rows` of the
//!         wrong length), `token_out_of_range` (root), `non_finite_logit` (node() = head),
//!         `bad_parameter` (warp).
template <tree_like Tree>
void sample_candidates(const Tree& t, std::int32_t root, std::span<const float> head_logits, int vocab,
                       const sampling_warp& warp, std::uint64_t seed, std::uint64_t step,
                       std::span<std::int32_t> node_tokens, std::span<float> draft_rows,
                       acceptance_workspace& ws) {
  warp.validate();
  detail::check_vocab(vocab);
  const auto v = static_cast<std::size_t>(vocab);
  const int depth = t.depth();
  if (head_logits.size() % v != 0 || head_logits.size() / v < static_cast<std::size_t>(depth))
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "head logits have " + std::to_string(head_logits.size()) +
                               " values: need a whole number of vocab-" + std::to_string(vocab) +
                               " rows, at least " + std::to_string(depth) + " (one per tree depth)");
  if (node_tokens.size() != static_cast<std::size_t>(t.num_nodes()))
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "node_tokens has " + std::to_string(node_tokens.size()) +
                               " entries, the tree has " + std::to_string(t.num_nodes()) + " nodes");
  if (draft_rows.size() != static_cast<std::size_t>(depth) * v)
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "draft_rows have " + std::to_string(draft_rows.size()) +
                               " values, expected depth " + std::to_string(depth) + " x vocab " +
                               std::to_string(vocab));
  if (root < 0 || root >= vocab)
    throw acceptance_error(acceptance_errc::token_out_of_range,
                           "root token " + std::to_string(root) + " is outside [0, " +
                               std::to_string(vocab) + ")",
                           0);
  for (int d = 1; d <= depth; ++d) {
    detail::check_logit_row(head_logits.subspan(static_cast<std::size_t>(d - 1) * v, v), d - 1, "head");
    if (t.max_rank(d) + 1 > vocab)
      throw acceptance_error(acceptance_errc::vocab_mismatch,
                             "depth " + std::to_string(d) + " needs " + std::to_string(t.max_rank(d) + 1) +
                                 " distinct tokens but the vocab has only " + std::to_string(vocab),
                             d - 1);
  }
  ws.reserve(t.num_nodes(), vocab);
  using detail::workspace_access;
  double* r = workspace_access::residual(ws);
  std::int32_t* ids = workspace_access::ids(ws);
  std::int32_t* drawn = workspace_access::drawn(ws);
  double* sums = workspace_access::blocks(ws);
  detail::philox_stream uniform{seed, step, detail::draft_draw_offset};
  node_tokens[0] = root;
  for (int d = 1; d <= depth; ++d) {
    const auto z = head_logits.subspan(static_cast<std::size_t>(d - 1) * v, v);
    const auto p = draft_rows.subspan(static_cast<std::size_t>(d - 1) * v, v);
    const double m = detail::warp_into(z, warp, r, ids, workspace_access::keys(ws));
    // The float row is the distribution: draw from exactly what the verifier will read.
    const double inv_m = 1.0 / m;
    for (std::size_t i = 0; i < v; ++i) {
      p[i] = static_cast<float>(r[i] * inv_m);
      r[i] = static_cast<double>(p[i]);
    }
    const detail::draft_row_stats st = detail::draft_row_scan(p.data(), v);
    const int db = t.depth_begin(d);
    const int de = d < depth ? t.depth_begin(d + 1) : t.num_nodes();
    const int ranks = t.max_rank(d) + 1;
    constexpr std::size_t block = acceptance_workspace::draw_block;
    const std::size_t blocks = (v + block - 1) / block;
    for (std::size_t b = 0; b < blocks; ++b) sums[b] = detail::block_mass(r, v, block, b);
    bool ranked = false;
    int count = 0, drawn_positive = 0;
    detail::draft_mass mass(st.sum);
    for (int k = 0; k < ranks; ++k) {
      bool present = false;
      for (int x = db; x < de && !present; ++x) present = t.rank(x) == k;
      if (!present) continue;
      const double u01 = uniform();
      std::int32_t x = -1;
      if (drawn_positive < st.positive) {
        // r holds p with the earlier draws zeroed: an inverse-CDF draw from p_i.
        x = detail::draw_blocked(r, v, sums, block, u01 * mass.rest);
      } else {
        if (!ranked) {  // past the draft's support: the best head logits not drawn yet
          detail::top_k_ids(z.data(), v, ranks, ids);
          ranked = true;
        }
        for (int i = 0; i < ranks && x < 0; ++i) {
          bool taken = false;
          for (int j = 0; j < count && !taken; ++j) taken = drawn[j] == ids[i];
          if (!taken) x = ids[i];
        }
      }
      for (int c = db; c < de; ++c)
        if (t.rank(c) == k) node_tokens[static_cast<std::size_t>(c)] = x;
      drawn[count++] = x;
      if (p[static_cast<std::size_t>(x)] > 0.0f) {
        ++drawn_positive;
        mass.remove(p, x, drawn, count);
        r[x] = 0.0;
        const std::size_t b = static_cast<std::size_t>(x) / block;
        sums[b] = detail::block_mass(r, v, block, b);
      }
    }
  }
}

MEDUSA_NAMESPACE_END
