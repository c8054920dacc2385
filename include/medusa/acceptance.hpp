// SPDX-License-Identifier: Apache-2.0
//! @file acceptance.hpp
//! Acceptance (docs/acceptance.md): which drafted tree nodes to commit, and the bonus token of the
//! next step.
//!
//! A policy is a small struct passed as a template parameter. Two kinds exist:
//! - *node-test* policies (`greedy_policy`, `typical_policy`, user policies): a deterministic
//!   pass/fail test of each child token against its parent's logits, plus an optional log-score
//!   that breaks ties between equally long rows;
//! - *sampling* policies (`rejection_policy`, `speculative_policy`, `draft_sampling_policy`):
//!   lossless tree speculative sampling with a counter-based generator; the committed tokens and
//!   the bonus are distributed exactly as autoregressive sampling from the warped target
//!   distribution.
//!
//! Logits are row-major `[num_nodes][vocab]` floats, row u = the model's output after node u.
//! Node-test policies read only the rows of nodes whose whole ancestry passed (and the final
//! node's row for the bonus); only rows that are read are checked. -Inf is a legal logit: a masked
//! token, which every policy treats as probability 0 (never accepted, never drawn); NaN, +Inf
//! and rows with every token masked are errors.
//!
//! @code
//! auto t = medusa::tree::preset("mc_sim_7b_63");
//! medusa::acceptance_workspace ws(t.num_nodes(), vocab);  // once
//! medusa::verify_request req{.node_tokens = node_tokens, .logits = logits, .vocab = vocab};
//! auto r = medusa::verify(t, req, medusa::typical_policy{.temperature = 0.7f}, ws);
//! // commit r.tokens() (root + r.accept_length drafts); next step's root = r.bonus;
//! // next state = row r.next_node of the tree pass.
//! @endcode
#pragma once

#include <medusa/config.hpp>
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

// ------------------------------------------------------------------------------------------------
// Policies
// ------------------------------------------------------------------------------------------------

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
//! draft row c (`verify_request::draft_probs`), independently of its siblings. Accept with
//! probability min(1, r(x)/q_c(x)) where r is the normalised residual; on rejection
//! r ← norm(max(r − q_c, 0)). A chain tree with a draft model's distributions is classic
//! speculative decoding; a tree whose tokens are sampled from the heads' softmax verifies
//! losslessly too.
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

// ------------------------------------------------------------------------------------------------
// Requests, results, workspace
// ------------------------------------------------------------------------------------------------

//! One request of a verify call. All spans are caller memory and only read.
struct verify_request {
  std::span<const std::int32_t> node_tokens;  //!< [num_nodes], node 0 = the root token
  std::span<const float> logits;              //!< [num_nodes][vocab] row-major
  int vocab = 0;                              //!< vocabulary size
  std::span<const float> draft_probs = {};    //!< [num_nodes][vocab]; speculative_policy only (row 0 unused)
  std::uint64_t seed = 0;                     //!< per-request Philox key (sampling policies)
  std::uint64_t step = 0;                     //!< step counter of the request (Philox counter)
  std::int32_t eos_token = -1;                //!< stop after an accepted EOS draft (-1 = off)
  //! [depth][vocab]; `draft_sampling_policy` only: row d-1 = the distribution the depth-d node
  //! tokens were drawn from without replacement (`sample_candidates` writes it).
  std::span<const float> draft_rows = {};
};

//! Result of verifying one request.
struct verify_result {
  //! Longest root-to-node path a result can hold (depth + 1).
  static constexpr int max_path = 64;

  int best_row = 0;       //!< row of retrieve_indices (rejection: first row through next_node)
  int accept_length = 0;  //!< A: accepted drafts, root not counted
  int next_node = 0;      //!< nodes[A]: the row of the next state (z, h)
  std::int32_t bonus = -1;  //!< next step's root; -1 when the step ended on EOS
  bool eos = false;         //!< an accepted draft was the EOS token (the path ends there)
  std::array<int, max_path> node_ids{};          //!< nodes[0..A], root first
  std::array<std::int32_t, max_path> token_ids{};  //!< tokens to commit: root + drafts

  //! Accepted node ids, root first (A + 1 entries).
  [[nodiscard]] std::span<const int> nodes() const noexcept {
    return {node_ids.data(), static_cast<std::size_t>(accept_length + 1)};
  }
  //! Tokens to commit, root first (A + 1 entries).
  [[nodiscard]] std::span<const std::int32_t> tokens() const noexcept {
    return {token_ids.data(), static_cast<std::size_t>(accept_length + 1)};
  }
};

namespace detail {
struct workspace_access;
}  // namespace detail

//! Scratch memory of `verify`, sized once for a tree size and vocabulary; a call with larger
//! sizes grows it (once), equal or smaller ones never allocate.
class acceptance_workspace {
 public:
  //! Tokens per block of the block masses that speed up draft draws.
  static constexpr std::size_t draw_block = 256;

  acceptance_workspace() = default;
  //! Sizes the scratch for trees of up to `num_nodes` nodes and vocabularies up to `vocab`.
  acceptance_workspace(int num_nodes, int vocab) { reserve(num_nodes, vocab); }

  //! Grows the scratch if needed (never shrinks).
  void reserve(int num_nodes, int vocab) {
    const auto n = static_cast<std::size_t>(std::max(num_nodes, 0));
    const auto v = static_cast<std::size_t>(std::max(vocab, 0));
    if (accepted_.size() < n) {
      accepted_.resize(n);
      score_.resize(n);
      drawn_.assign(n, 0);  // scratch: old contents need not move
      drawn_r_.assign(n, 0.0);
    }
    if (residual_.size() < v) {
      residual_.resize(v);
      ids_.resize(v);
      keys_.resize(v);
      blocks_.assign((v + draw_block - 1) / draw_block, 0.0);
    }
  }

  //! Nodes the scratch holds now.
  [[nodiscard]] std::size_t node_capacity() const noexcept { return accepted_.size(); }
  //! Vocabulary size the scratch holds now.
  [[nodiscard]] std::size_t vocab_capacity() const noexcept { return residual_.size(); }

 private:
  friend struct detail::workspace_access;
  std::vector<std::uint8_t> accepted_;  // per node: the node and its ancestry passed
  std::vector<double> score_;           // per node: summed log-score of the path
  std::vector<double> residual_;        // [vocab]: residual of rejection sampling
  std::vector<std::int32_t> ids_;       // [vocab]: ranking for top-k / top-p
  std::vector<std::uint64_t> keys_;     // [vocab]: sort keys for top-p selection
  std::vector<std::int32_t> drawn_;     // per node: draws of one depth (draft sampling)
  std::vector<double> drawn_r_;         // per node: residual saved at those draws
  std::vector<double> blocks_;          // [vocab / draw_block]: block masses of a draft row
};

namespace detail {
// The implementation's way into the workspace's scratch (the members are not an API).
struct workspace_access {
  static std::uint8_t* accepted(acceptance_workspace& w) noexcept { return w.accepted_.data(); }
  static double* score(acceptance_workspace& w) noexcept { return w.score_.data(); }
  static double* residual(acceptance_workspace& w) noexcept { return w.residual_.data(); }
  static std::int32_t* ids(acceptance_workspace& w) noexcept { return w.ids_.data(); }
  static std::uint64_t* keys(acceptance_workspace& w) noexcept { return w.keys_.data(); }
  static std::int32_t* drawn(acceptance_workspace& w) noexcept { return w.drawn_.data(); }
  static double* drawn_r(acceptance_workspace& w) noexcept { return w.drawn_r_.data(); }
  static double* blocks(acceptance_workspace& w) noexcept { return w.blocks_.data(); }
};
}  // namespace detail

// ------------------------------------------------------------------------------------------------
// Implementation
// ------------------------------------------------------------------------------------------------

namespace detail {

template <tree_like Tree, class Policy>
void validate_request(const Tree& t, const verify_request& req, const Policy& policy) {
  if constexpr (requires { policy.validate(); }) policy.validate();
  check_vocab(req.vocab);
  const int n = t.num_nodes();
  if (t.depth() + 1 > verify_result::max_path)
    throw acceptance_error(acceptance_errc::too_deep,
                           "tree depth " + std::to_string(t.depth()) + " exceeds the verify limit " +
                               std::to_string(verify_result::max_path - 1));
  if (req.node_tokens.size() != static_cast<std::size_t>(n))
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "node_tokens has " + std::to_string(req.node_tokens.size()) +
                               " entries, the tree has " + std::to_string(n) + " nodes");
  const std::size_t cells = static_cast<std::size_t>(n) * static_cast<std::size_t>(req.vocab);
  if (req.logits.size() != cells)
    throw acceptance_error(
        req.logits.size() % static_cast<std::size_t>(n) == 0 ? acceptance_errc::vocab_mismatch
                                                              : acceptance_errc::size_mismatch,
        "logits have " + std::to_string(req.logits.size()) + " values, expected " +
            std::to_string(n) + " nodes x vocab " + std::to_string(req.vocab) + " = " +
            std::to_string(cells));
  for (int u = 0; u < n; ++u) {
    const std::int32_t tok = req.node_tokens[static_cast<std::size_t>(u)];
    if (tok < 0 || tok >= req.vocab)
      throw acceptance_error(acceptance_errc::token_out_of_range,
                             "node " + std::to_string(u) + ": token " + std::to_string(tok) +
                                 " is outside [0, " + std::to_string(req.vocab) + ")",
                             u);
  }
  if constexpr (depth_draft_policy<Policy>) {
    const std::size_t rows = static_cast<std::size_t>(t.depth()) * static_cast<std::size_t>(req.vocab);
    if (req.draft_rows.size() != rows)
      throw acceptance_error(acceptance_errc::size_mismatch,
                             "draft_rows have " + std::to_string(req.draft_rows.size()) +
                                 " values, expected depth " + std::to_string(t.depth()) +
                                 " x vocab " + std::to_string(req.vocab) + " = " +
                                 std::to_string(rows));
  } else if constexpr (sampling_policy<Policy>) {
    if constexpr (Policy::draft_distributions) {
      if (req.draft_probs.size() != cells)
        throw acceptance_error(acceptance_errc::size_mismatch,
                               "draft_probs have " + std::to_string(req.draft_probs.size()) +
                                   " values, expected " + std::to_string(cells));
    }
  }
}

inline std::span<const float> node_row(const verify_request& req, int u) {
  const auto v = static_cast<std::size_t>(req.vocab);
  return req.logits.subspan(static_cast<std::size_t>(u) * v, v);
}

inline std::span<const float> checked_row(const verify_request& req, int u) {
  const auto row = node_row(req, u);
  check_logit_row(row, u, "node");
  return row;
}

//! Fills nodes/tokens of `res` by walking up from `last` (depth `a`).
template <tree_like Tree>
void fill_path(const Tree& t, const verify_request& req, int last, verify_result& res) {
  const int a = t.node_depth(last);
  res.accept_length = a;
  res.next_node = last;
  for (int j = a, u = last; j >= 0; --j, u = t.parent(u)) {
    res.node_ids[static_cast<std::size_t>(j)] = u;
    res.token_ids[static_cast<std::size_t>(j)] = req.node_tokens[static_cast<std::size_t>(u)];
  }
}

//! Reference-compatible row of a sampled path: the first leaf row through its final node.
template <tree_like Tree>
void set_first_row_through(const Tree& t, verify_result& res) {
  for (int p = 0; p < t.num_leaves(); ++p) {
    if (t.retrieve(p, res.accept_length) == res.next_node) {
      res.best_row = p;
      return;
    }
  }
}

//! Shortens an accepted path at its first EOS draft; true if it did.
inline bool truncate_at_eos(const verify_request& req, verify_result& res) {
  if (req.eos_token < 0) return false;
  for (int j = 1; j <= res.accept_length; ++j) {
    if (res.token_ids[static_cast<std::size_t>(j)] == req.eos_token) {
      res.accept_length = j;
      res.next_node = res.node_ids[static_cast<std::size_t>(j)];
      res.eos = true;
      res.bonus = -1;
      return true;
    }
  }
  return false;
}

template <tree_like Tree, node_test_policy Policy>
verify_result verify_node_test(const Tree& t, const verify_request& req, const Policy& policy,
                               acceptance_workspace& ws) {
  constexpr bool scored = requires(const Policy& p, const typename Policy::parent_state& s,
                                   std::span<const float> z, std::int32_t x) {
    { p.log_score(s, z, x) } -> std::convertible_to<double>;
  };
  const int n = t.num_nodes();
  std::uint8_t* acc = workspace_access::accepted(ws);
  double* score = workspace_access::score(ws);
  std::fill(acc, acc + n, std::uint8_t{0});
  acc[0] = 1;
  score[0] = 0.0;
  int a = 0;
  // Node order puts ancestors first, so a node's flag is final before its children are tested;
  // only parents that are themselves accepted are ever prepared (usually a handful of rows).
  for (int v = 0; v < n; ++v) {
    const int cc = t.child_count(v);
    if (!acc[v] || cc == 0) continue;
    const auto z = checked_row(req, v);
    const typename Policy::parent_state s = policy.prepare(z);
    const int cb = t.child_begin(v);
    for (int c = cb; c < cb + cc; ++c) {
      const std::int32_t x = req.node_tokens[static_cast<std::size_t>(c)];
      if (!policy.accepts(s, z, x)) continue;
      acc[c] = 1;
      if constexpr (scored) score[c] = score[v] + static_cast<double>(policy.log_score(s, z, x));
      a = std::max(a, t.node_depth(c));
    }
  }
  verify_result res;
  int best_row = 0;
  int last = 0;
  if (a > 0) {
    best_row = -1;
    double best = 0.0;
    for (int p = 0; p < t.num_leaves(); ++p) {
      const int u = t.retrieve(p, a);
      if (u < 0 || !acc[u]) continue;
      if constexpr (scored) {
        if (best_row < 0 || score[u] > best) {
          best_row = p;
          best = score[u];
          last = u;
        }
      } else {
        best_row = p;
        last = u;
        break;
      }
    }
  }
  res.best_row = best_row;
  fill_path(t, req, last, res);
  if (truncate_at_eos(req, res)) return res;
  const auto z = checked_row(req, res.next_node);
  if constexpr (requires { { policy.bonus(z) } -> std::convertible_to<std::int32_t>; })
    res.bonus = policy.bonus(z);
  else
    res.bonus = argmax_finite(z.data(), z.size());
  return res;
}

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

// One validated request through the policy's algorithm.
template <tree_like Tree, acceptance_policy Policy>
verify_result verify_validated(const Tree& t, const verify_request& req, const Policy& policy,
                               acceptance_workspace& ws) {
  if constexpr (node_test_policy<Policy>)
    return verify_node_test(t, req, policy, ws);
  else if constexpr (depth_draft_policy<Policy>)
    return verify_depth_drafts(t, req, policy, ws);
  else
    return verify_sampling(t, req, policy, ws);
}

}  // namespace detail

//! Verifies one request: runs the policy over the tree and returns the accepted path, the tokens
//! to commit and the bonus token.
//! @throws acceptance_error on shape/vocab mismatches, token ids outside [0, vocab), NaN or +Inf
//!         (or every token masked) in a row that is read (node() names it), bad policy parameters
//!         or draft rows.
template <tree_like Tree, acceptance_policy Policy>
verify_result verify(const Tree& t, const verify_request& req, const Policy& policy,
                     acceptance_workspace& ws) {
  detail::validate_request(t, req, policy);
  ws.reserve(t.num_nodes(), req.vocab);
  return detail::verify_validated(t, req, policy, ws);
}

//! Convenience overload that allocates its own workspace (use the workspace form per step).
template <tree_like Tree, acceptance_policy Policy>
verify_result verify(const Tree& t, const verify_request& req, const Policy& policy) {
  acceptance_workspace ws(t.num_nodes(), req.vocab);
  return verify(t, req, policy, ws);
}

//! Verifies a batch of requests sharing one tree and policy, each with its own logits, seed and
//! step. `results[b]` receives request b. If `commit_offsets` is non-empty it must have
//! `requests.size() + 1` entries and receives the exclusive prefix sum of `A + 1` (where each
//! request's committed tokens start in a packed output) with the total last.
//! Every request is validated before any result is written.
template <tree_like Tree, acceptance_policy Policy>
void verify_batch(const Tree& t, std::span<const verify_request> requests, const Policy& policy,
                  acceptance_workspace& ws, std::span<verify_result> results,
                  std::span<int> commit_offsets = {}) {
  if (results.size() != requests.size())
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "batch: " + std::to_string(requests.size()) + " requests but " +
                               std::to_string(results.size()) + " result slots");
  if (!commit_offsets.empty() && commit_offsets.size() != requests.size() + 1)
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "batch: commit_offsets needs " + std::to_string(requests.size() + 1) +
                               " entries, got " + std::to_string(commit_offsets.size()));
  for (const verify_request& req : requests) detail::validate_request(t, req, policy);
  for (std::size_t b = 0; b < requests.size(); ++b) {
    ws.reserve(t.num_nodes(), requests[b].vocab);
    results[b] = detail::verify_validated(t, requests[b], policy, ws);
  }
  if (!commit_offsets.empty()) {
    commit_offsets[0] = 0;
    for (std::size_t b = 0; b < requests.size(); ++b)
      commit_offsets[b + 1] = commit_offsets[b] + results[b].accept_length + 1;
  }
}

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
