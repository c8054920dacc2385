// SPDX-License-Identifier: Apache-2.0
//! @file acceptance/policies.hpp
//! The acceptance policies and their concepts: node-test policies (`greedy_policy`,
//! `typical_policy`, user policies) and the lossless sampling policies (`rejection_policy`,
//! `speculative_policy`, `draft_sampling_policy`) with their shared warp, `sampling_warp`.
//!
//! @code
//! #include <medusa/acceptance/policies.hpp>
//! medusa::typical_policy typical{.temperature = 0.7f};
//! typical.validate();  // acceptance_error on a negative or non-finite parameter
//! static_assert(medusa::node_test_policy<medusa::greedy_policy>);
//! static_assert(medusa::sampling_policy<medusa::rejection_policy>);
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/acceptance_error.hpp>
#include <medusa/detail/row_math.hpp>

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

//! A deterministic per-node test. Required: a `parent_state` type, `prepare(z)` computing it
//! from the parent's logit row (finite, checked by the caller), and `accepts(state, z, token)`.
//! Optional members, detected with `requires`:
//! - `double log_score(const parent_state&, std::span<const float> z, std::int32_t token) const`:
//!   when present, rows of equal accepted length are ranked by the sum of these scores along the
//!   accepted prefix (largest first, exact ties → first row); otherwise the first row wins;
//! - `std::int32_t bonus(std::span<const float> z) const`: the next root from the final node's
//!   row (default: argmax, ties → lowest id);
//! - `void validate() const`: throws `acceptance_error` on bad parameters.
template <class P>
concept node_test_policy =
    requires(const P& p, std::span<const float> z, const typename P::parent_state& s,
             std::int32_t token) {
      { p.prepare(z) } -> std::convertible_to<typename P::parent_state>;
      { p.accepts(s, z, token) } -> std::convertible_to<bool>;
    };

//! Lossless tree speculative sampling (docs/acceptance.md). Required: `temperature`, `top_k`
//! (0 = off), `top_p` (≥ 1 = off) describing the warp of the target distribution, and a
//! `static constexpr bool draft_distributions`: false = drafts are deterministic (point masses,
//! e.g. top-k tokens); true = each node's token was drawn from a draft distribution given in the
//! request.
template <class P>
concept sampling_policy = requires(const P& p) {
  { p.temperature } -> std::convertible_to<float>;
  { p.top_k } -> std::convertible_to<int>;
  { p.top_p } -> std::convertible_to<float>;
  { P::draft_distributions } -> std::convertible_to<bool>;
};

//! Anything `verify` accepts as a policy.
template <class P>
concept acceptance_policy = node_test_policy<P> || sampling_policy<P>;

namespace detail {
inline void check_param(bool ok, const std::string& what) {
  if (!ok) throw acceptance_error(acceptance_errc::bad_parameter, what);
}
}  // namespace detail

//! Greedy acceptance: a child passes iff its token is the argmax of the parent's raw
//! logits (ties → lowest id). First row of maximal length wins.
struct greedy_policy {
  static constexpr std::string_view name = "greedy";  //!< name in `dispatch_policy` and the tools
  //! The parent's argmax.
  struct parent_state {
    std::int32_t argmax;
  };
  //! Argmax of the parent row.
  [[nodiscard]] parent_state prepare(std::span<const float> z) const noexcept {
    return {detail::argmax_finite(z.data(), z.size())};
  }
  //! Pass iff the token is the argmax.
  [[nodiscard]] bool accepts(const parent_state& s, std::span<const float>,
                             std::int32_t token) const noexcept {
    return token == s.argmax;
  }
};

//! Typical acceptance, lossy and deterministic:
//! `q = softmax(z/T)`, `H = −Σ q·ln(q + 1e-5)`, `τ = min(posterior_threshold,
//! posterior_alpha·exp(−H))`; a child passes iff `q(token) > τ` (strict). Rows of equal length are
//! ranked by the summed `ln q` of their accepted tokens. `temperature == 0` is greedy (as in the
//! reference). The bonus is the argmax (the reference's default "fast" root).
//!
//! The default temperature is the reference's 0.7, the same in `typical_policy{}`,
//! `dispatch_policy("typical", {})` and the tools. `temperature = 0` accepts exactly what
//! `greedy_policy{}` accepts.
struct typical_policy {
  static constexpr std::string_view name = "typical";  //!< name in `dispatch_policy` and the tools
  float temperature = 0.7f;           //!< T (default 0.7); 0 = greedy
  float posterior_threshold = 0.09f;  //!< ε of the paper (default 0.09)
  float posterior_alpha = 0.3f;       //!< δ of the paper (default 0.3)

  //! Softmax statistics of the parent row and its threshold τ.
  struct parent_state {
    float max;
    float inv_t;
    double log_sum;
    double tau;
    std::int32_t argmax;  //!< used when temperature == 0
  };

  //! Throws `bad_parameter` unless T ≥ 0 and the threshold and alpha are finite and ≥ 0.
  void validate() const {
    detail::check_param(std::isfinite(temperature) && temperature >= 0.0f,
                        "typical: temperature must be finite and >= 0, got " +
                            std::to_string(temperature));
    detail::check_param(std::isfinite(posterior_threshold) && posterior_threshold >= 0.0f,
                        "typical: posterior_threshold must be finite and >= 0, got " +
                            std::to_string(posterior_threshold));
    detail::check_param(std::isfinite(posterior_alpha) && posterior_alpha >= 0.0f,
                        "typical: posterior_alpha must be finite and >= 0, got " +
                            std::to_string(posterior_alpha));
  }

  //! Max, log-sum-exp, entropy and τ of the parent row (or its argmax when T == 0).
  [[nodiscard]] parent_state prepare(std::span<const float> z) const noexcept {
    if (!(temperature > 0.0f)) return {0.0f, 0.0f, 0.0, 0.0, detail::argmax_finite(z.data(), z.size())};
    const float inv_t = 1.0f / temperature;
    const float m = detail::row_max(z.data(), z.size()).max;
    const detail::softmax_stats st = detail::softmax_sum(z.data(), z.size(), m, inv_t);
    const double h = detail::softmax_entropy(z.data(), z.size(), st, inv_t, 1e-5f);
    const double tau = std::min(static_cast<double>(posterior_threshold),
                                static_cast<double>(posterior_alpha) * std::exp(-h));
    return {m, inv_t, std::log(st.sum), tau, -1};
  }

  //! ln q(token) under the parent (0 when T == 0).
  [[nodiscard]] double log_score(const parent_state& s, std::span<const float> z,
                                 std::int32_t token) const noexcept {
    if (s.argmax >= 0) return 0.0;
    return static_cast<double>((z[static_cast<std::size_t>(token)] - s.max) * s.inv_t) - s.log_sum;
  }

  //! Pass iff q(token) > τ (or token == argmax when T == 0).
  [[nodiscard]] bool accepts(const parent_state& s, std::span<const float> z,
                             std::int32_t token) const noexcept {
    if (s.argmax >= 0) return token == s.argmax;
    return std::exp(log_score(s, z, token)) > s.tau;
  }
};

//! Warp parameters of the target distribution shared by the sampling policies: divide by
//! `temperature`, softmax, keep the `top_k` best (0 = all), then top-p on the renormalised result
//! (a token survives iff the mass ranked strictly above it is ≤ `top_p`; the top token always
//! survives; `top_p ≥ 1` = off), renormalise. `temperature == 0` = one-hot at the argmax.
struct sampling_warp {
  float temperature = 1.0f;  //!< T ≥ 0; 0 = greedy
  int top_k = 0;             //!< sampling top-k filter (unrelated to the tree's K); 0 = off
  float top_p = 1.0f;        //!< nucleus mass; ≥ 1 = off

  //! Throws `bad_parameter` on T < 0, top_k < 0, top_p < 0 or NaN.
  void validate() const {
    detail::check_param(std::isfinite(temperature) && temperature >= 0.0f,
                        "sampling: temperature must be finite and >= 0, got " +
                            std::to_string(temperature));
    detail::check_param(top_k >= 0, "sampling: top_k must be >= 0, got " + std::to_string(top_k));
    detail::check_param(!std::isnan(top_p) && top_p >= 0.0f,
                        "sampling: top_p must be >= 0, got " + std::to_string(top_p));
  }
};

//! Lossless tree rejection sampling for deterministic drafts (docs/acceptance.md): at each node the
//! children are tried in node order against the residual of the target; the bonus is drawn from
//! the final residual. With T == 0 it is exactly greedy plus bonus = argmax.
struct rejection_policy : sampling_warp {
  static constexpr std::string_view name = "rejection";  //!< name in `dispatch_policy` and the tools
  static constexpr bool draft_distributions = false;
};

//! Speculative sampling with draft distributions: child c's token was drawn from the request's
//! draft row c (`verify_request::draft_probs`), given every draw before it. The children are tried
//! in node order: accept with probability min(1, r(x)/q_c(x)) where r is the normalised residual;
//! on rejection r ← norm(max(r − q_c, 0)). Siblings may be drawn independently (each row their
//! parent's distribution) or without replacement (row i = the parent's distribution without the
//! earlier siblings' tokens, renormalised: `tree_sampler`). A chain tree with a draft model's
//! distributions is classic speculative decoding; a tree whose tokens are sampled from the heads'
//! softmax verifies losslessly too.
struct speculative_policy : sampling_warp {
  static constexpr std::string_view name = "speculative";  //!< name in `dispatch_policy` and the tools
  static constexpr bool draft_distributions = true;
};

//! Lossless sampling with the heads' own distributions as drafts: recursive rejection sampling
//! without replacement (SpecTr; "recursive speculative decoding", Jeon et al. 2024), fed by
//! `sample_candidates`.
//!
//! Drafts: the tokens of the depth-d nodes are the successive draws *without replacement* from
//! one distribution p_d per depth (`verify_request::draft_rows`, row d-1; for the heads,
//! p_d = warp of head d-1's logits): draw j goes to the nodes of the j-th smallest rank present
//! at depth d, so every parent at depth d-1 sees the same tokens for the same ranks. Once every
//! token of positive draft probability is drawn, later draws are point masses (any token not drawn
//! yet; `sample_candidates` takes the next best head logit), so T = 0 gives exactly the top-K
//! candidates and greedy verification.
//!
//! Verification at a node u with warped target r = q_u (unnormalised, mass m): for the draws
//! x_1, x_2, ... of depth d = depth(u)+1 in order, with p_i = p_d without x_1..x_{i-1},
//! renormalised: if x_i is a child of u, accept it with probability min(1, (r(x_i)/m) / p_i(x_i));
//! on rejection r ← max(r − m·p_i, 0) (mass renormalised); a draw that is not a child of u is only
//! removed from the draft. All rejected: bonus ~ r. Accepted: descend and repeat with q_child.
//!
//! Why it is exact: conditioned on everything seen so far at u (earlier draws, rejections), the
//! next draw is distributed as p_i, and the output still to be produced must follow the current
//! normalised residual r̂. One step of speculative sampling with proposal p_i and target r̂ emits
//! x_i with probability min(r̂(x_i), p_i(x_i)) and otherwise continues with the target
//! norm(max(r̂ − p_i, 0)), whose total is exactly the rejected mass, so "accept now or continue
//! with the residual" reproduces r̂ token by token (the standard speculative-sampling identity);
//! by induction over the draws, and since the final bonus is drawn from the last residual, the
//! token emitted at u follows q_u. A skipped draw changes nothing to be matched (the output must
//! follow r̂ for every value of it) and only changes later proposals, which are conditioned on
//! it. The draws of deeper levels are independent of everything decided at u, so the same
//! argument holds at the accepted child with q_child: the emitted sequence is autoregressive
//! sampling from the warped target. Sampling the children without replacement is what lets a
//! rejected sibling's mass go to the next sibling instead of being proposed again.
struct draft_sampling_policy : sampling_warp {
  static constexpr std::string_view name = "sampled";  //!< name in `dispatch_policy` and the tools
  static constexpr bool draft_distributions = true;
  //! The drafts are one distribution per depth (`verify_request::draft_rows`), sampled without
  //! replacement across ranks.
  static constexpr bool draft_rows_per_depth = true;
};

//! A sampling policy whose drafts are drawn without replacement from one distribution per depth
//! (`draft_sampling_policy`, and user policies with `draft_rows_per_depth = true`).
template <class P>
concept depth_draft_policy = sampling_policy<P> && requires {
  requires static_cast<bool>(P::draft_rows_per_depth);
};

MEDUSA_NAMESPACE_END
