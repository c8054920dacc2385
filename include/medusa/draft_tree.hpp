// SPDX-License-Identifier: Apache-2.0
//! @file draft_tree.hpp
//! Draft trees from a drafter that runs a model (EAGLE-2's dynamic trees): instead of one greedy
//! chain, each step grows a tree best first by the drafter's own joint probability.
//!
//! From the root, each depth expands the `expand` most probable nodes of the depth before (the
//! root at depth 1): their `topk` most probable next tokens become children, each scored by its
//! path's joint probability under the drafter (the product of its softmax along the path). One
//! drafter pass per depth gives the logits of the nodes to expand next. The step's tree is the
//! `max_nodes` most probable nodes drafted (a set closed under parent: a child is never more
//! probable than its parent), leaving out nodes less probable than `min_prob`. Growth stops early
//! once no node still to expand can enter that set.
//!
//! The drafter is a `tree_draft_source`: `draft_model_branch` (draft_model.hpp) and
//! `feature_draft_branch` (feature_draft.hpp) are. Each pass runs the tree of the nodes to expand
//! and their ancestors, root first, with the tree's mask (the drafter's cache keeps only the
//! request's committed tokens, so ancestors drafted in an earlier pass run again). An optional
//! prompt lookup (`ngram_lookup`) joins its continuation as a branch, merged into the drafted nodes
//! where they propose the same tokens.
//!
//! Verification is unchanged, so the output stays lossless whatever the drafter proposes. The
//! tree's tokens are the drafter's top-k (no sampling): at T > 0 the verification's own rules
//! (e.g. `rejection_policy`) keep the target's distribution, with a point mass as each node's
//! draft distribution.
//!
//! `tree_sampler` grows the same trees from *sampled* tokens, for `speculative_policy` at T > 0:
//! each node's children are drawn without replacement from the drafter's warped distribution at
//! that node, and every node comes with the distribution its token was drawn from (see the class).
//!
//! @code
//! medusa::feature_draft_branch<medusa_llama::eagle_engine> eagle(drafter, target.vocab_size(), target.hidden_size());
//! medusa::tree_drafter drafts(eagle, {.max_nodes = 24, .max_depth = 6, .topk = 4, .expand = 4});
//! medusa::no_heads none;
//! medusa::decoder dec(target, none, drafts, medusa::greedy_policy{});
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/acceptance/policies.hpp>
#include <medusa/acceptance/sampling.hpp>
#include <medusa/acceptance_error.hpp>
#include <medusa/candidates.hpp>
#include <medusa/detail/philox.hpp>
#include <medusa/detail/row_math.hpp>
#include <medusa/drafts.hpp>
#include <medusa/error.hpp>
#include <medusa/tree.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! How a `tree_drafter` grows each step's tree.
struct draft_tree_options {
  int max_nodes = 16;  //!< drafted nodes per step, the root not counted (≥ 1)
  int max_depth = 5;   //!< deepest drafted node (≥ 1)
  int topk = 4;        //!< children scored under each expanded node, in [1, max_tree_topk − 1)
  int expand = 4;      //!< nodes expanded per depth: the depth's most probable (≥ 1)
  //! Nodes whose joint probability under the drafter is below this are not drafted (in [0, 1);
  //! 0: none left out): where the drafter is unsure, the tree (or chain) is smaller or empty, and
  //! the step spends fewer rows on drafts the target is unlikely to accept.
  double min_prob = 0.0;

  //! Throws `invalid_input` naming the first option out of range.
  void validate() const {
    auto bad = [](const std::string& what) { throw invalid_input("draft tree: " + what); };
    if (max_nodes < 1) bad("max_nodes must be >= 1, got " + std::to_string(max_nodes));
    if (max_depth < 1) bad("max_depth must be >= 1, got " + std::to_string(max_depth));
    if (topk < 1 || topk >= max_tree_topk - 1)
      bad("topk must be in [1, " + std::to_string(max_tree_topk - 1) + "), got " + std::to_string(topk));
    if (expand < 1) bad("expand must be >= 1, got " + std::to_string(expand));
    if (!(min_prob >= 0.0 && min_prob < 1.0)) bad("min_prob must be in [0, 1), got " + std::to_string(min_prob));
  }
};

//! One drafter pass of a growing draft tree: `shape` holds the root and the drafted nodes of the
//! pass in canonical order (node 0 the root, depth `shape.node_depth(i)` after it), `tokens[i]`
//! node i's token (`tokens[0]` the root, the request's last token), `ids[i]` the node's id in the
//! drafter's tree (0 for the root; stable over the step's passes, so a source can keep a per-node
//! result, e.g. a predicted feature, and find it again under `ids[shape.parent(i)]`). The logits
//! of the last `outputs` nodes are wanted: the nodes to expand, the deepest of the pass.
//!
//! A pass that is a chain (one node a depth) may find its leading rows done: `cached` > 0 says that
//! rows `[0, cached)` sit in the drafter's cache at their slots from this step's earlier passes,
//! so only rows `[cached, T)` run, causally after them (an `expand = 1` tree then costs what a chain
//! does).
struct draft_tree_pass {
  const tree& shape;
  std::span<const std::int32_t> tokens;
  std::span<const int> ids;
  int outputs = 0;
  int cached = 0;
};

//! A drafter that `tree_drafter` can grow trees with:
//! - `draft_root(request, history)`: runs what the drafter has not seen of `history` (request
//!   `request`'s tokens, ending with the step's root) and returns the logit row after the root
//!   (`[vocab]`), or an empty span when it drafts nothing now (its context is full);
//! - `draft_pass(request, history, pass)`: runs the pass (`draft_tree_pass`, rows from
//!   `pass.cached` on) and returns the logit rows of its last `pass.outputs` nodes (`[outputs][vocab]`, in the pass's order), or an empty
//!   span when the pass does not fit its context (the tree then stops growing);
//! - `vocab_size()`, and optionally `release(request)`, `observes_features()` and `observe(...)`
//!   (the `feature_observing` members), which `tree_drafter` passes on.
//! The spans stay valid until the source's next call.
template <class S>
concept tree_draft_source = std::copy_constructible<S> &&
    requires(S& s, int request, std::span<const std::int32_t> history, const draft_tree_pass& pass) {
      { s.vocab_size() } -> std::convertible_to<int>;
      { s.draft_root(request, history) } -> std::convertible_to<std::span<const float>>;
      { s.draft_pass(request, history, pass) } -> std::convertible_to<std::span<const float>>;
    };

template <tree_draft_source Source>
class tree_sampler;

//! A per-step drafter (`step_drafts`, drafts.hpp) whose trees a model-running drafter grows (see
//! the file comment). Not thread-safe (scratch buffers); copies share the source's state when the
//! source's copies do.
template <tree_draft_source Source>
class tree_drafter {
 public:
  //! The drafter.
  using source_type = Source;

  //! Throws `invalid_input` for options out of range (`draft_tree_options::validate`,
  //! `ngram_lookup::validate`).
  tree_drafter(Source source, draft_tree_options opt, std::optional<ngram_lookup> lookup = std::nullopt)
      : source_(std::move(source)), opt_(opt), lookup_(lookup) {
    opt_.validate();
    if (lookup_) lookup_->validate();
    floor_ = opt_.min_prob > 0.0 ? std::log(opt_.min_prob) : -std::numeric_limits<double>::infinity();
    const int lookup_len = lookup_ ? lookup_->max_tokens : 0;
    max_nodes_ = 1 + opt_.max_nodes + lookup_len;
    max_depth_ = std::max(opt_.max_depth, lookup_len);
    continuation_.resize(static_cast<std::size_t>(lookup_len));
  }

  //! Most nodes a step's tree can have (root included): sizes the decoder's buffers.
  [[nodiscard]] int max_nodes() const noexcept { return max_nodes_; }
  //! Deepest path a step's tree can have.
  [[nodiscard]] int max_depth() const noexcept { return max_depth_; }
  //! Heads read: none (the trees come from the drafter).
  [[nodiscard]] static constexpr int heads_depth() noexcept { return 0; }
  //! The options.
  [[nodiscard]] const draft_tree_options& options() const noexcept { return opt_; }
  //! The drafter.
  [[nodiscard]] Source& source() noexcept { return source_; }
  [[nodiscard]] const Source& source() const noexcept { return source_; }

  //! This step's tree for request `request`; `history` = its tokens, ending with the root. Writes
  //! the nodes' tokens to `node_tokens` (at least `max_nodes()` entries). Returns nothing when
  //! nothing is drafted (a plain step). Throws `acceptance_error` for a non-finite drafter logit
  //! row or a vocabulary other than `vocab`, and what the source throws.
  std::optional<tree> draft(int request, std::span<const std::int32_t> history, std::span<const float> /*head_logits*/,
                            int vocab, std::span<std::int32_t> node_tokens) {
    return draft_tree(request, history, vocab, node_tokens, nullptr);
  }

  //! The same for request 0 (one request alone).
  std::optional<tree> draft(std::span<const std::int32_t> history, std::span<const float> head_logits, int vocab,
                            std::span<std::int32_t> node_tokens) {
    return draft(0, history, head_logits, vocab, node_tokens);
  }

  //! Whether the decoders should pass the target's features (the source reads them).
  [[nodiscard]] bool observes_features() const {
    if constexpr (requires(const Source& s) {
                    { s.observes_features() } -> std::convertible_to<bool>;
                  })
      return source_.observes_features();
    else return false;
  }
  //! The target's features of request `request`'s positions from `position` on, for the source.
  void observe(int request, int position, std::span<const float> rows) {
    if constexpr (requires(Source& s) { s.observe(request, position, rows); }) source_.observe(request, position, rows);
  }
  //! Request `request` left: the source hears of it when it has `release(request)`.
  void release(int request) {
    if constexpr (requires(Source& s) { s.release(request); }) source_.release(request);
  }

  //! Drafter passes per depth so far, summed over steps (entry d: passes that expanded depth d + 1's
  //! nodes; entry 0 counts the root's), for how deep trees grow.
  [[nodiscard]] std::span<const std::int64_t> passes_by_depth() const noexcept { return passes_by_depth_; }

 private:
  friend class tree_sampler<Source>;

  // The sampled trees of `tree_sampler`: tokens drawn with the warp.
  tree_drafter(Source source, draft_tree_options opt, const sampling_warp& warp, std::optional<ngram_lookup> lookup)
      : tree_drafter(std::move(source), opt, lookup) {
    warp.validate();
    warp_ = warp;
    const auto slots = static_cast<std::size_t>(opt_.max_nodes);
    slot_parent_.resize(slots);
    slot_token_.resize(slots);
  }

  // The step's tree (see `draft`). Sampled (`warp_`): the draws come from Philox(seed_, step_), and
  // `rows` (`[max_nodes()][vocab]`) receives each node's draft distribution.
  std::optional<tree> draft_tree(int request, std::span<const std::int32_t> history, int vocab,
                                 std::span<std::int32_t> node_tokens, float* rows) {
    if (history.empty()) return std::nullopt;
    if (static_cast<int>(source_.vocab_size()) != vocab)
      throw acceptance_error(acceptance_errc::size_mismatch, "draft tree: the drafter has a vocabulary of " +
                                                                 std::to_string(source_.vocab_size()) + ", the target " +
                                                                 std::to_string(vocab));
    if (static_cast<int>(node_tokens.size()) < max_nodes_)
      throw acceptance_error(acceptance_errc::size_mismatch, "draft tree: node_tokens holds " +
                                                                 std::to_string(node_tokens.size()) + " nodes, a tree up to " +
                                                                 std::to_string(max_nodes_));
    grow(request, history, vocab);
    std::vector<std::vector<int>> paths = chosen_paths();
    int found = 0;
    if (lookup_) {
      found = lookup_->find(history, continuation_);
      if (found > 0) add_lookup_branch(paths, std::span<const std::int32_t>(continuation_.data(), static_cast<std::size_t>(found)));
    }
    if (paths.empty()) return std::nullopt;
    tree_options topt;
    topt.topk = opt_.topk + 1;  // rank `topk`: lookup nodes
    topt.max_depth = max_depth_;
    tree out = tree::from_paths(paths, topt);
    node_tokens[0] = history.back();
    const auto v = static_cast<std::size_t>(vocab);
    for (int u = 1; u < out.num_nodes(); ++u) {
      const auto& p = out.sorted_paths()[static_cast<std::size_t>(u) - 1];
      const int id = node_at(p);
      node_tokens[static_cast<std::size_t>(u)] = id >= 0 ? nodes_[static_cast<std::size_t>(id)].token : continuation_[p.size() - 1];
      if (rows == nullptr) continue;
      float* row = rows + static_cast<std::size_t>(u) * v;
      if (id >= 0) {
        const float* drawn = draw_rows_.data() + static_cast<std::size_t>(nodes_[static_cast<std::size_t>(id)].slot) * v;
        std::copy(drawn, drawn + v, row);
      } else {  // the lookup's own token: a point mass
        std::fill(row, row + v, 0.0f);
        row[static_cast<std::size_t>(node_tokens[static_cast<std::size_t>(u)])] = 1.0f;
      }
    }
    return out;
  }

  struct node {
    int parent;         // node id; -1 for the root
    int rank;           // among the parent's children (the drafter's top-k order, or the draw order)
    int depth;
    std::int32_t token;
    double logp;        // joint log-probability of the path under the drafter (warped when sampled)
    int first_child;    // id of child rank 0 (children are consecutive), -1 before expansion
    int slot = -1;      // sampled: the draw that made the node (its row in `draw_rows_`)
  };

  // Children of `parent` from its logit row: the drafter's top-k, each with the path's log-probability.
  void expand(int parent, std::span<const float> row, int vocab) {
    detail::check_logit_row(row, parent, "draft tree: the drafter's row after node");
    const auto v = static_cast<std::size_t>(vocab);
    const int k = std::min(opt_.topk, vocab);
    ids_.resize(static_cast<std::size_t>(k));
    detail::top_k_ids(row.data(), v, k, ids_.data());
    const float m = detail::row_max(row.data(), v).max;
    const double log_sum = std::log(detail::softmax_sum(row.data(), v, m, 1.0f).sum);
    node& p = nodes_[static_cast<std::size_t>(parent)];
    p.first_child = static_cast<int>(nodes_.size());
    const double base = p.logp;
    const int depth = p.depth + 1;
    for (int r = 0; r < k; ++r) {
      const std::int32_t t = ids_[static_cast<std::size_t>(r)];
      const double lp = static_cast<double>(row[static_cast<std::size_t>(t)] - m) - log_sum;
      nodes_.push_back({parent, r, depth, t, base + std::min(lp, 0.0), -1});
    }
  }

  // Sampled children of the `parents` (rows `[parents][vocab]`, in that order): the children of
  // each are drawn without replacement from its warped row, one draw at a time, from the parent
  // whose next draw is the most probable to carry (its path's probability times its row's mass not
  // drawn yet; ties: the earlier parent), until `max_nodes` nodes are drawn, a parent has `topk`
  // children, its row is spent, or no draw reaches `min_prob`. Which parent draws next depends only
  // on draws already made, and every drawn token is kept: conditioned on everything before it, each
  // draw follows the row it is verified against, which is what keeps speculative sampling exact.
  void expand_sampled(std::span<const int> parents, std::span<const float> rows, int vocab) {
    const auto v = static_cast<std::size_t>(vocab);
    const std::size_t np = parents.size();
    q_rows_.resize(np * v);
    rest_.assign(np, 0.0);
    children_.assign(np, 0);
    for (std::size_t j = 0; j < np; ++j) {
      const auto row = rows.subspan(j * v, v);
      detail::check_logit_row(row, parents[j], "draft tree: the drafter's row after node");
      const double mass = detail::warp_into(row, *warp_, r_.data(), warp_ids_.data(), keys_.data());
      float* q = q_rows_.data() + j * v;
      double total = 0.0;
      for (std::size_t x = 0; x < v; ++x) total += q[x] = static_cast<float>(r_[x] / mass);
      rest_[j] = total;
    }
    const int first_slot = drawn_;
    while (drawn_ < opt_.max_nodes) {
      int best = -1;
      double best_score = -std::numeric_limits<double>::infinity();
      for (std::size_t j = 0; j < np; ++j) {
        if (children_[j] >= opt_.topk || !(rest_[j] > 0.0)) continue;
        const double score = nodes_[static_cast<std::size_t>(parents[j])].logp + std::log(rest_[j]);
        if (score >= floor_ && (best < 0 || score > best_score)) {
          best = static_cast<int>(j);
          best_score = score;
        }
      }
      if (best < 0) break;
      const auto j = static_cast<std::size_t>(best);
      // The row drawn from: the parent's row without its children so far, renormalised.
      const float* q = q_rows_.data() + j * v;
      float* p = draw_rows_.data() + static_cast<std::size_t>(drawn_) * v;
      std::copy(q, q + v, p);
      for (int s = first_slot; s < drawn_; ++s)
        if (slot_parent_[static_cast<std::size_t>(s)] == best) p[static_cast<std::size_t>(slot_token_[static_cast<std::size_t>(s)])] = 0.0f;
      double rest = 0.0;
      for (std::size_t x = 0; x < v; ++x) rest += p[x];
      if (!(rest > 0.0)) {
        rest_[j] = 0.0;
        continue;
      }
      double mass = 0.0;  // draw from exactly the float row the verification reads
      for (std::size_t x = 0; x < v; ++x) {
        p[x] = static_cast<float>(static_cast<double>(p[x]) / rest);
        mass += r_[x] = static_cast<double>(p[x]);
      }
      const double u = detail::philox_uniform(seed_, step_, detail::draft_draw_offset + draws_++);
      const std::int32_t token = detail::draw_from(r_.data(), v, mass, u);
      slot_parent_[static_cast<std::size_t>(drawn_)] = best;
      slot_token_[static_cast<std::size_t>(drawn_)] = token;
      ++drawn_;
      ++children_[j];
      rest_[j] = std::max(rest - static_cast<double>(q[static_cast<std::size_t>(token)]), 0.0);
    }
    // The drawn nodes, each parent's children consecutive in draw order.
    for (std::size_t j = 0; j < np; ++j) {
      node& parent = nodes_[static_cast<std::size_t>(parents[j])];
      if (children_[j] == 0) continue;
      parent.first_child = static_cast<int>(nodes_.size());
      const double base = parent.logp;
      const int depth = parent.depth + 1;
      int rank = 0;
      for (int s = first_slot; s < drawn_; ++s) {
        if (slot_parent_[static_cast<std::size_t>(s)] != static_cast<int>(j)) continue;
        const std::int32_t t = slot_token_[static_cast<std::size_t>(s)];
        const double lp = std::log(static_cast<double>(q_rows_[j * v + static_cast<std::size_t>(t)]));
        nodes_.push_back({parents[static_cast<std::size_t>(j)], rank++, depth, t, base + lp, -1, s});
      }
    }
  }

  // Ranks of node `id`'s path from the root.
  void path_of(int id, std::vector<int>& out) const {
    out.clear();
    for (int u = id; u > 0; u = nodes_[static_cast<std::size_t>(u)].parent) out.push_back(nodes_[static_cast<std::size_t>(u)].rank);
    std::reverse(out.begin(), out.end());
  }

  // More probable first; equal ones shallower first (a parent before its child), then by id.
  [[nodiscard]] bool before(int a, int b) const {
    const node& x = nodes_[static_cast<std::size_t>(a)];
    const node& y = nodes_[static_cast<std::size_t>(b)];
    if (x.logp != y.logp) return x.logp > y.logp;
    if (x.depth != y.depth) return x.depth < y.depth;
    return a < b;
  }

  // Grows this step's nodes (`nodes_`) best first, one drafter pass per depth.
  void grow(int request, std::span<const std::int32_t> history, int vocab) {
    nodes_.clear();
    nodes_.push_back({-1, -1, 0, history.back(), 0.0, -1});
    drawn_ = 0;
    if (warp_) {
      const auto v = static_cast<std::size_t>(vocab);
      draw_rows_.resize(static_cast<std::size_t>(opt_.max_nodes) * v);
      r_.resize(v);
      warp_ids_.resize(v);
      keys_.resize(v);
    }
    const std::span<const float> root = source_.draft_root(request, history);
    if (root.empty()) return;
    chain_end_ = 0;  // the drafter's cache holds the root's row
    count_pass(0);
    const auto v = static_cast<std::size_t>(vocab);
    if (root.size() < v) throw acceptance_error(acceptance_errc::size_mismatch, "draft tree: the drafter's root row is short");
    if (warp_) {
      const int root_id = 0;
      expand_sampled(std::span<const int>(&root_id, 1), root.first(v), vocab);
    } else {
      expand(0, root.first(v), vocab);
    }
    for (int depth = 1; depth < opt_.max_depth; ++depth) {
      // The depth's nodes, most probable first: the first `expand` of them grow.
      frontier_.clear();
      for (int u = 0; u < static_cast<int>(nodes_.size()); ++u)
        if (nodes_[static_cast<std::size_t>(u)].depth == depth) frontier_.push_back(u);
      std::sort(frontier_.begin(), frontier_.end(), [&](int a, int b) { return before(a, b); });
      if (frontier_.size() > static_cast<std::size_t>(opt_.expand)) frontier_.resize(static_cast<std::size_t>(opt_.expand));
      // Below min_prob a node is not drafted, nor any descendant (never more probable).
      std::erase_if(frontier_, [&](int u) { return nodes_[static_cast<std::size_t>(u)].logp < floor_; });
      if (frontier_.empty()) break;
      if (warp_) {
        if (drawn_ >= opt_.max_nodes) break;  // sampled: every draw is kept, the budget is spent
      } else {
        // Stop once `max_nodes` drafted nodes beat the best of them: no descendant can enter the tree.
        int better = 0;
        for (int u = 1; u < static_cast<int>(nodes_.size()); ++u) better += before(u, frontier_.front()) ? 1 : 0;
        if (better >= opt_.max_nodes) break;
      }
      if (!run_pass(request, history, vocab)) break;
      count_pass(depth);
    }
  }

  // One drafter pass over the frontier and its ancestors; expands the frontier from its rows.
  bool run_pass(int request, std::span<const std::int32_t> history, int vocab) {
    // The pass's nodes: the frontier and every ancestor, as paths.
    in_pass_.assign(nodes_.size(), 0);
    pass_paths_.clear();
    for (const int f : frontier_)
      for (int u = f; u > 0 && !in_pass_[static_cast<std::size_t>(u)]; u = nodes_[static_cast<std::size_t>(u)].parent) {
        in_pass_[static_cast<std::size_t>(u)] = 1;
        path_of(u, path_);
        pass_paths_.push_back(path_);
      }
    tree_options topt;
    topt.topk = opt_.topk;
    topt.max_depth = opt_.max_depth;
    const tree shape = tree::from_paths(pass_paths_, topt);
    const auto n = static_cast<std::size_t>(shape.num_nodes());
    pass_ids_.resize(n);
    pass_tokens_.resize(n);
    pass_ids_[0] = 0;
    pass_tokens_[0] = nodes_[0].token;
    for (std::size_t i = 1; i < n; ++i) {
      const int parent = pass_ids_[static_cast<std::size_t>(shape.parent(static_cast<int>(i)))];
      const int id = nodes_[static_cast<std::size_t>(parent)].first_child + shape.rank(static_cast<int>(i));
      pass_ids_[i] = id;
      pass_tokens_[i] = nodes_[static_cast<std::size_t>(id)].token;
    }
    // The frontier is the deepest depth of the pass: its last nodes in canonical order.
    const int outputs = static_cast<int>(frontier_.size());
    // A chain whose parent's row ended the last pass (or is the root's): only the new row runs.
    const bool chain = outputs == 1;
    const int cached = chain && nodes_[static_cast<std::size_t>(frontier_[0])].parent == chain_end_ ? static_cast<int>(n) - 1 : 0;
    const draft_tree_pass pass{shape, pass_tokens_, pass_ids_, outputs, cached};
    const std::span<const float> rows = source_.draft_pass(request, history, pass);
    if (rows.empty()) return false;
    // A chain pass leaves the chain's rows at consecutive slots, in its canonical order.
    chain_end_ = chain ? frontier_[0] : -1;
    const auto v = static_cast<std::size_t>(vocab);
    if (rows.size() < static_cast<std::size_t>(outputs) * v)
      throw acceptance_error(acceptance_errc::size_mismatch, "draft tree: the drafter returned " + std::to_string(rows.size()) +
                                                                 " logits for " + std::to_string(outputs) + " rows of " +
                                                                 std::to_string(vocab));
    // The rows stay valid until the source's next call; expanding does not call it.
    if (warp_) {
      expand_sampled(std::span<const int>(pass_ids_).subspan(n - static_cast<std::size_t>(outputs)),
                     rows.first(static_cast<std::size_t>(outputs) * v), vocab);
      return true;
    }
    for (int j = 0; j < outputs; ++j)
      expand(pass_ids_[n - static_cast<std::size_t>(outputs) + static_cast<std::size_t>(j)],
             rows.subspan(static_cast<std::size_t>(j) * v, v), vocab);
    return true;
  }

  // The step's tree: the `max_nodes` most probable drafted nodes, as paths (sampled: every node
  // drawn; leaving one out for its value would bias the draws that remain).
  std::vector<std::vector<int>> chosen_paths() {
    chosen_.clear();
    for (int u = 1; u < static_cast<int>(nodes_.size()); ++u)
      if (warp_ || nodes_[static_cast<std::size_t>(u)].logp >= floor_) chosen_.push_back(u);
    const auto keep = std::min(chosen_.size(), static_cast<std::size_t>(opt_.max_nodes));
    std::partial_sort(chosen_.begin(), chosen_.begin() + static_cast<std::ptrdiff_t>(keep), chosen_.end(),
                      [&](int a, int b) { return before(a, b); });
    chosen_.resize(keep);
    std::vector<std::vector<int>> paths;
    paths.reserve(keep);
    for (const int u : chosen_) {
      path_of(u, path_);
      paths.push_back(path_);
    }
    return paths;
  }

  // Adds the lookup's continuation as a branch: it follows drafted nodes proposing its tokens,
  // then continues with nodes of rank `topk`.
  void add_lookup_branch(std::vector<std::vector<int>>& paths, std::span<const std::int32_t> continuation) const {
    std::vector<int> at;
    int u = 0;  // the branch's node among the drafted ones while it follows them
    bool own = false;
    for (const std::int32_t t : continuation) {
      int next = -1;
      if (!own)
        for (const auto& p : paths)
          if (p.size() == at.size() + 1 && std::equal(at.begin(), at.end(), p.begin())) {
            const int c = nodes_[static_cast<std::size_t>(u)].first_child + p.back();
            if (nodes_[static_cast<std::size_t>(c)].token == t) {
              next = p.back();
              u = c;
              break;
            }
          }
      if (next < 0) {
        own = true;
        next = opt_.topk;
      }
      at.push_back(next);
      if (own) paths.push_back(at);
    }
  }

  // The drafted node at ranks `p`, or -1 for the lookup's own node (rank `topk` on the way).
  [[nodiscard]] int node_at(const std::vector<int>& p) const {
    int u = 0;
    for (std::size_t d = 0; d < p.size(); ++d) {
      if (p[d] == opt_.topk) return -1;
      u = nodes_[static_cast<std::size_t>(u)].first_child + p[d];
    }
    return u;
  }

  void count_pass(int depth) {
    if (passes_by_depth_.size() <= static_cast<std::size_t>(depth)) passes_by_depth_.resize(static_cast<std::size_t>(depth) + 1, 0);
    ++passes_by_depth_[static_cast<std::size_t>(depth)];
  }

  Source source_;
  draft_tree_options opt_;
  std::optional<ngram_lookup> lookup_;
  int max_nodes_ = 1, max_depth_ = 1;
  double floor_ = 0.0;  // log(min_prob), −∞ for 0
  int chain_end_ = -1;  // the node whose row ends the chain of rows in the drafter's cache; -1: none
  std::vector<node> nodes_;
  std::vector<int> frontier_, chosen_, pass_ids_, path_;
  std::vector<char> in_pass_;
  std::vector<std::vector<int>> pass_paths_;
  std::vector<std::int32_t> pass_tokens_, ids_, continuation_;
  std::vector<std::int64_t> passes_by_depth_;
  // Sampled trees only.
  std::optional<sampling_warp> warp_;
  std::uint64_t seed_ = 0, step_ = 0, draws_ = 0;  // the step's Philox key and draw counter
  int drawn_ = 0;                                  // draws this step (each is a node)
  std::vector<float> draw_rows_;                   // [max_nodes][vocab]: the row of each draw
  std::vector<float> q_rows_;                      // [expanded][vocab]: the parents' warped rows
  std::vector<double> r_, rest_;
  std::vector<int> children_, slot_parent_;
  std::vector<std::int32_t> slot_token_, warp_ids_;
  std::vector<std::uint64_t> keys_;
};

//! Draft trees of sampled tokens, for `speculative_policy` at T > 0: a `tree_drafter` whose nodes'
//! tokens are drawn from the drafter's warped distribution (`sampling_warp`, the target's warp the
//! usual choice), with the distribution of every node (`node_distribution_drafts`, drafts.hpp).
//!
//! - **Sampling.** Each expanded node's children are drawn one at a time *without replacement*
//!   from its warped row; node c's row (`draft_probs`) is the distribution c's token was drawn
//!   from, its parent's row without its earlier siblings' tokens, renormalised. `speculative_policy`
//!   then verifies the children in draw order against those rows, so a rejected sibling's mass
//!   goes to the next sibling (recursive rejection sampling), and the output follows the target's
//!   warped distribution exactly.
//! - **Shape.** Each depth expands the `expand` nodes of highest joint probability under the
//!   warped drafter; their children are drawn one at a time from the parent whose next draw carries
//!   the most probability (its path's probability times the mass of its row not drawn yet), at most
//!   `topk` per parent, until `max_nodes` nodes are drawn or no draw would reach `min_prob`. Every
//!   drawn node is kept: the tree never drops a node for its value, which would bias the draws
//!   that stay. `max_nodes` therefore bounds the draws, and `expand` × `topk` the nodes of a depth
//!   (e.g. topk 2, expand 2 for a deep tree).
//! - **Lookup.** An `ngram_lookup`'s continuation joins as in `tree_drafter`, its own nodes with a
//!   point mass as their distribution.
//! - **Randomness.** Philox(seed, step) at draw indices from 2^63 up (`sample_candidates`' range);
//!   the decoders pass the request's seed and the step of the verification.
//! - **T = 0.** The warp is one-hot: each node's only child is the drafter's argmax, a greedy chain.
//!
//! A step's tree is whole or nothing: the decoders take a plain step where a sampled tree does not
//! fit the KV cache (its first nodes in node order would not be an unbiased set of draws).
//!
//! @code
//! medusa::draft_model_branch<medusa_llama::engine> draft(draft_engine, target.vocab_size(), {});
//! medusa::tree_sampler drafts(draft, {.max_nodes = 8, .max_depth = 5, .topk = 2, .expand = 2}, {.temperature = 0.7f});
//! medusa::no_heads none;
//! medusa::decoder dec(target, none, drafts, medusa::speculative_policy{{.temperature = 0.7f}});
//! @endcode
template <tree_draft_source Source>
class tree_sampler {
 public:
  //! The drafter.
  using source_type = Source;

  //! Throws `invalid_input` for options out of range and `acceptance_error` (`bad_parameter`) for
  //! a bad warp.
  tree_sampler(Source source, draft_tree_options opt, sampling_warp warp, std::optional<ngram_lookup> lookup = std::nullopt)
      : trees_(std::move(source), opt, warp, lookup) {}

  //! Most nodes a step's tree can have (root included).
  [[nodiscard]] int max_nodes() const noexcept { return trees_.max_nodes(); }
  //! Deepest path a step's tree can have.
  [[nodiscard]] int max_depth() const noexcept { return trees_.max_depth(); }
  //! Heads read: none.
  [[nodiscard]] static constexpr int heads_depth() noexcept { return 0; }
  //! The options.
  [[nodiscard]] const draft_tree_options& options() const noexcept { return trees_.options(); }
  //! The warp the tokens are drawn with.
  [[nodiscard]] const sampling_warp& warp() const noexcept { return *trees_.warp_; }
  //! The drafter.
  [[nodiscard]] Source& source() noexcept { return trees_.source(); }
  [[nodiscard]] const Source& source() const noexcept { return trees_.source(); }

  //! This step's tree for request `request` (as `tree_drafter::draft`), its tokens drawn with
  //! Philox(`seed`, `step`) and their rows kept for `draft_probs(request)`.
  std::optional<tree> draft(int request, std::span<const std::int32_t> history, std::span<const float> /*head_logits*/,
                            int vocab, std::span<std::int32_t> node_tokens, std::uint64_t seed, std::uint64_t step) {
    trees_.seed_ = seed;
    trees_.step_ = step;
    trees_.draws_ = 0;
    std::vector<float>& rows = probs_[request];
    rows.resize(static_cast<std::size_t>(max_nodes()) * static_cast<std::size_t>(std::max(vocab, 0)));
    return trees_.draft_tree(request, history, vocab, node_tokens, rows.data());
  }

  //! `[max_nodes][vocab]` draft distributions of `request`'s last tree, in its node order: row u is
  //! the distribution node u's token was drawn from (row 0, the root's, unused). Empty before its
  //! first draft.
  [[nodiscard]] std::span<const float> draft_probs(int request) const {
    const auto it = probs_.find(request);
    return it == probs_.end() ? std::span<const float>{} : std::span<const float>(it->second);
  }

  //! Whether the decoders should pass the target's features (the source reads them).
  [[nodiscard]] bool observes_features() const { return trees_.observes_features(); }
  //! The target's features, for the source.
  void observe(int request, int position, std::span<const float> rows) { trees_.observe(request, position, rows); }
  //! Request `request` left: its rows are dropped and the source hears of it.
  void release(int request) {
    probs_.erase(request);
    trees_.release(request);
  }
  //! Drafter passes per depth so far (as `tree_drafter::passes_by_depth`).
  [[nodiscard]] std::span<const std::int64_t> passes_by_depth() const noexcept { return trees_.passes_by_depth(); }

 private:
  tree_drafter<Source> trees_;
  std::map<int, std::vector<float>> probs_;  // per request: its last tree's rows
};

MEDUSA_NAMESPACE_END
