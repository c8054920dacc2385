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
//! `tree_sampler` grows trees of *sampled* tokens, for `speculative_policy` at T > 0: each node's
//! children are drawn without replacement from the drafter's warped distribution at that node,
//! every draw is kept, and every node comes with the distribution its token was drawn from (see
//! the class).
//!
//! `draft_batch` grows the trees of all the requests of a serving step together: with a
//! `tree_draft_batch_source` (`draft_model_branch` over a `batch_decoder_model`), one drafter pass
//! per depth for the whole batch; `batch_decoder` calls it (`batch_step_drafts`, drafts.hpp).
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

//! One request's part of a batched `draft_roots` call (`tree_draft_batch_source`).
struct draft_root_call {
  int request = 0;
  std::span<const std::int32_t> history;
};

//! One request's part of a batched `draft_passes` call (`tree_draft_batch_source`).
struct draft_pass_call {
  int request = 0;
  std::span<const std::int32_t> history;
  const draft_tree_pass* pass = nullptr;
};

namespace detail {
// Throws `invalid_input` naming `who` when a request has two calls in one batched pass (each
// request's drafter cache takes one).
template <class Call>
void check_distinct_requests(std::span<const Call> calls, const char* who) {
  for (std::size_t i = 0; i < calls.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (calls[i].request == calls[j].request)
        throw invalid_input(std::string(who) + ": request " + std::to_string(calls[i].request) +
                            " appears twice in one batched pass");
}
}  // namespace detail

//! A `tree_draft_source` that runs many requests' rows as one ragged pass (`draft_model_branch`
//! over a `batch_decoder_model`): `draft_roots(calls, rows)` sets `rows[i]` to what
//! `draft_root(calls[i].request, calls[i].history)` returns, `draft_passes(calls, rows)` to what
//! `draft_pass(...)` returns, each request's rows as if run alone. The spans stay valid until the
//! source's next call. `tree_drafter::draft_batch` then grows every request's tree with one
//! drafter pass per depth. A source that knows only at run time whether it batches (one that
//! erases its drafter's type) may add `bool batches() const`: false makes `tree_drafter` call
//! `draft_root` and `draft_pass` one request at a time.
template <class S>
concept tree_draft_batch_source =
    tree_draft_source<S> && requires(S& s, std::span<const draft_root_call> roots, std::span<const draft_pass_call> passes,
                                     std::span<std::span<const float>> rows) {
      s.draft_roots(roots, rows);
      s.draft_passes(passes, rows);
    };

template <tree_draft_source Source>
class tree_sampler;

//! A per-step drafter (`step_drafts`, drafts.hpp) whose trees a model-running drafter grows (see
//! the file comment). `draft_batch` grows several requests' trees together, one drafter pass per
//! depth for all of them when the source is a `tree_draft_batch_source`. Not thread-safe (scratch
//! buffers); copies share the source's state when the source's copies do.
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
  std::optional<tree> draft(int request, std::span<const std::int32_t> history, std::span<const float> head_logits,
                            int vocab, std::span<std::int32_t> node_tokens) {
    step_draft_call call{request, history, head_logits, node_tokens, 0, 0, std::nullopt};
    draft_batch(std::span<step_draft_call>(&call, 1), vocab);
    return std::move(call.result);
  }

  //! The same for request 0 (one request alone).
  std::optional<tree> draft(std::span<const std::int32_t> history, std::span<const float> head_logits, int vocab,
                            std::span<std::int32_t> node_tokens) {
    return draft(0, history, head_logits, vocab, node_tokens);
  }

  //! Every request's tree of a step (`batch_step_drafts`): the same trees as `draft` for each
  //! alone, grown depth by depth together, with one drafter pass per depth for all the requests
  //! still growing when the source is a `tree_draft_batch_source` (else one per request). Throws
  //! as `draft`, and `invalid_input` when a request appears twice.
  void draft_batch(std::span<step_draft_call> calls, int vocab) { grow_all(calls, vocab, {}); }

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

  //! Drafter passes per depth so far, summed over steps and requests (entry d: passes that
  //! expanded depth d + 1's nodes; entry 0 counts the root's), for how deep trees grow.
  [[nodiscard]] std::span<const std::int64_t> passes_by_depth() const noexcept { return passes_by_depth_; }

 private:
  friend class tree_sampler<Source>;

  // The sampled trees of `tree_sampler`: tokens drawn with the warp.
  tree_drafter(Source source, draft_tree_options opt, const sampling_warp& warp, std::optional<ngram_lookup> lookup)
      : tree_drafter(std::move(source), opt, lookup) {
    warp.validate();
    warp_ = warp;
  }

  struct node {
    int parent;         // node id; -1 for the root
    int rank;           // among the parent's children (the drafter's top-k order, or the draw order)
    int depth;
    std::int32_t token;
    double logp;        // joint log-probability of the path under the drafter (warped when sampled)
    int first_child;    // id of child rank 0 (children are consecutive), -1 before expansion
    int slot = -1;      // sampled: the draw that made the node (its row in `draw_rows`)
  };

  // One request's tree while it grows.
  struct growth {
    std::vector<node> nodes;
    std::vector<int> frontier;
    int chain_end = -1;  // the node whose row ends the chain of rows in the drafter's cache; -1: none
    bool growing = false;
    // The pass being run: its shape, node ids, tokens, rows wanted and rows cached.
    std::optional<tree> shape;
    std::vector<int> pass_ids;
    std::vector<std::int32_t> pass_tokens;
    int outputs = 0, cached = 0;
    // Sampled trees only: the Philox key, the draws so far and the row of each.
    std::uint64_t seed = 0, step = 0, draws = 0;
    int drawn = 0;
    std::vector<float> draw_rows;  // [max_nodes][vocab]
    std::vector<int> slot_parent;
    std::vector<std::int32_t> slot_token;
  };

  // Grows the trees of `calls`; sampled (`warp_`), `rows[i]` (`[max_nodes()][vocab]`) receives call
  // i's nodes' draft distributions and `growths_[i]` must hold its seed and step.
  void grow_all(std::span<step_draft_call> calls, int vocab, std::span<float* const> rows) {
    if (static_cast<int>(source_.vocab_size()) != vocab)
      throw acceptance_error(acceptance_errc::size_mismatch, "draft tree: the drafter has a vocabulary of " +
                                                                 std::to_string(source_.vocab_size()) + ", the target " +
                                                                 std::to_string(vocab));
    for (std::size_t i = 0; i < calls.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        if (calls[i].request == calls[j].request)
          throw invalid_input("draft tree: request " + std::to_string(calls[i].request) + " appears twice in one batch of drafts");
    for (const step_draft_call& c : calls)
      if (static_cast<int>(c.node_tokens.size()) < max_nodes_)
        throw acceptance_error(acceptance_errc::size_mismatch, "draft tree: node_tokens holds " +
                                                                   std::to_string(c.node_tokens.size()) + " nodes, a tree up to " +
                                                                   std::to_string(max_nodes_));
    const auto v = static_cast<std::size_t>(vocab);
    if (growths_.size() < calls.size()) growths_.resize(calls.size());
    // The roots: every request's catch-up, one drafter pass for all.
    roots_.clear();
    which_.clear();
    for (std::size_t i = 0; i < calls.size(); ++i) {
      growth& g = growths_[i];
      g.growing = false;
      g.nodes.clear();
      g.drawn = 0;
      g.draws = 0;
      calls[i].result.reset();
      if (calls[i].history.empty()) continue;
      g.nodes.push_back({-1, -1, 0, calls[i].history.back(), 0.0, -1});
      if (warp_) {
        g.draw_rows.resize(static_cast<std::size_t>(opt_.max_nodes) * v);
        g.slot_parent.resize(static_cast<std::size_t>(opt_.max_nodes));
        g.slot_token.resize(static_cast<std::size_t>(opt_.max_nodes));
      }
      roots_.push_back({calls[i].request, calls[i].history});
      which_.push_back(i);
    }
    if (warp_) {
      r_.resize(v);
      warp_ids_.resize(v);
      keys_.resize(v);
    }
    for_each_rows(roots_, [&](std::size_t k, std::span<const float> root) {
      growth& g = growths_[which_[k]];
      if (root.empty()) return;
      if (root.size() < v) throw acceptance_error(acceptance_errc::size_mismatch, "draft tree: the drafter's root row is short");
      g.growing = true;
      g.chain_end = 0;  // the drafter's cache holds the root's row
      count_pass(0);
      if (warp_) {
        const int root_id = 0;
        expand_sampled(g, std::span<const int>(&root_id, 1), root.first(v), vocab);
      } else {
        expand(g, 0, root.first(v), vocab);
      }
    });
    // Each further depth: one pass for every request still growing.
    for (int depth = 1; depth < opt_.max_depth; ++depth) {
      which_.clear();
      for (std::size_t i = 0; i < calls.size(); ++i) {
        growth& g = growths_[i];
        if (!g.growing) continue;
        g.growing = select_frontier(g, depth);
        if (!g.growing) continue;
        prepare_pass(g);
        which_.push_back(i);
      }
      if (which_.empty()) break;
      passes_.clear();
      for (const std::size_t i : which_) {
        const growth& g = growths_[i];
        passes_.push_back(draft_tree_pass{*g.shape, g.pass_tokens, g.pass_ids, g.outputs, g.cached});
      }
      pass_calls_.clear();
      for (std::size_t k = 0; k < which_.size(); ++k)
        pass_calls_.push_back({calls[which_[k]].request, calls[which_[k]].history, &passes_[k]});
      for_each_rows(pass_calls_, [&](std::size_t k, std::span<const float> out) {
        growth& g = growths_[which_[k]];
        if (out.empty()) {  // the pass does not fit the drafter's context: the tree stops growing
          g.growing = false;
          return;
        }
        count_pass(depth);
        finish_pass(g, out, vocab);
      });
    }
    for (std::size_t i = 0; i < calls.size(); ++i)
      if (!growths_[i].nodes.empty()) calls[i].result = build(growths_[i], calls[i], vocab, rows.empty() ? nullptr : rows[i]);
  }

  // The source's rows for `calls` (`roots_` or `pass_calls_`), handed to `use(k, rows)` in order:
  // one pass for all, or one a request (each row is then used before the next call, which may
  // overwrite it).
  template <class Call, class Use>
  void for_each_rows(const std::vector<Call>& calls, Use&& use) {
    if constexpr (tree_draft_batch_source<Source>) {
      if (calls.size() > 1 && source_batches()) {
        rows_.assign(calls.size(), {});
        run_batched(std::span<const Call>(calls), std::span<std::span<const float>>(rows_));
        for (std::size_t k = 0; k < calls.size(); ++k) use(k, rows_[k]);
        return;
      }
    }
    for (std::size_t k = 0; k < calls.size(); ++k) use(k, run_one(calls[k]));
  }
  [[nodiscard]] bool source_batches() const {
    if constexpr (requires(const Source& src) {
                    { src.batches() } -> std::convertible_to<bool>;
                  })
      return source_.batches();
    else return true;
  }
  std::span<const float> run_one(const draft_root_call& c) { return source_.draft_root(c.request, c.history); }
  std::span<const float> run_one(const draft_pass_call& c) { return source_.draft_pass(c.request, c.history, *c.pass); }
  void run_batched(std::span<const draft_root_call> c, std::span<std::span<const float>> rows)
    requires tree_draft_batch_source<Source>
  {
    source_.draft_roots(c, rows);
  }
  void run_batched(std::span<const draft_pass_call> c, std::span<std::span<const float>> rows)
    requires tree_draft_batch_source<Source>
  {
    source_.draft_passes(c, rows);
  }

  // The nodes of depth `depth` to expand next (`g.frontier`): the `expand` most probable, none below
  // `min_prob`. False when the tree is done growing.
  bool select_frontier(growth& g, int depth) {
    g.frontier.clear();
    for (int u = 0; u < static_cast<int>(g.nodes.size()); ++u)
      if (g.nodes[static_cast<std::size_t>(u)].depth == depth) g.frontier.push_back(u);
    std::sort(g.frontier.begin(), g.frontier.end(), [&](int a, int b) { return before(g, a, b); });
    if (g.frontier.size() > static_cast<std::size_t>(opt_.expand)) g.frontier.resize(static_cast<std::size_t>(opt_.expand));
    // Below min_prob a node is not drafted, nor any descendant (never more probable).
    std::erase_if(g.frontier, [&](int u) { return g.nodes[static_cast<std::size_t>(u)].logp < floor_; });
    if (g.frontier.empty()) return false;
    if (warp_) return g.drawn < opt_.max_nodes;  // sampled: every draw is kept, the budget is spent
    // Stop once `max_nodes` drafted nodes beat the best of them: no descendant can enter the tree.
    int better = 0;
    for (int u = 1; u < static_cast<int>(g.nodes.size()); ++u) better += before(g, u, g.frontier.front()) ? 1 : 0;
    return better < opt_.max_nodes;
  }

  // The pass over the frontier and its ancestors: shape, node ids, tokens, rows wanted and cached.
  void prepare_pass(growth& g) {
    in_pass_.assign(g.nodes.size(), 0);
    pass_paths_.clear();
    for (const int f : g.frontier)
      for (int u = f; u > 0 && !in_pass_[static_cast<std::size_t>(u)]; u = g.nodes[static_cast<std::size_t>(u)].parent) {
        in_pass_[static_cast<std::size_t>(u)] = 1;
        path_of(g, u, path_);
        pass_paths_.push_back(path_);
      }
    tree_options topt;
    topt.topk = opt_.topk;
    topt.max_depth = opt_.max_depth;
    g.shape = tree::from_paths(pass_paths_, topt);
    const auto n = static_cast<std::size_t>(g.shape->num_nodes());
    g.pass_ids.resize(n);
    g.pass_tokens.resize(n);
    g.pass_ids[0] = 0;
    g.pass_tokens[0] = g.nodes[0].token;
    for (std::size_t i = 1; i < n; ++i) {
      const int parent = g.pass_ids[static_cast<std::size_t>(g.shape->parent(static_cast<int>(i)))];
      const int id = g.nodes[static_cast<std::size_t>(parent)].first_child + g.shape->rank(static_cast<int>(i));
      g.pass_ids[i] = id;
      g.pass_tokens[i] = g.nodes[static_cast<std::size_t>(id)].token;
    }
    // The frontier is the deepest depth of the pass: its last nodes in canonical order.
    g.outputs = static_cast<int>(g.frontier.size());
    // A chain whose parent's row ended the last pass (or is the root's): only the new row runs.
    const bool chain = g.outputs == 1;
    g.cached = chain && g.nodes[static_cast<std::size_t>(g.frontier[0])].parent == g.chain_end ? static_cast<int>(n) - 1 : 0;
  }

  // Expands the frontier from its pass's rows (`[outputs][vocab]`).
  void finish_pass(growth& g, std::span<const float> rows, int vocab) {
    const auto v = static_cast<std::size_t>(vocab);
    const auto n = g.pass_ids.size();
    const auto outputs = static_cast<std::size_t>(g.outputs);
    // A chain pass leaves the chain's rows at consecutive slots, in its canonical order.
    g.chain_end = g.outputs == 1 ? g.frontier[0] : -1;
    if (rows.size() < outputs * v)
      throw acceptance_error(acceptance_errc::size_mismatch, "draft tree: the drafter returned " + std::to_string(rows.size()) +
                                                                 " logits for " + std::to_string(g.outputs) + " rows of " +
                                                                 std::to_string(vocab));
    // The rows stay valid until the source's next call; expanding does not call it.
    if (warp_) {
      expand_sampled(g, std::span<const int>(g.pass_ids).subspan(n - outputs), rows.first(outputs * v), vocab);
      return;
    }
    for (std::size_t j = 0; j < outputs; ++j) expand(g, g.pass_ids[n - outputs + j], rows.subspan(j * v, v), vocab);
  }

  // The step's tree of `g` for `call`: its nodes' tokens, and (sampled) their rows in `rows`.
  std::optional<tree> build(growth& g, step_draft_call& call, int vocab, float* rows) {
    std::vector<std::vector<int>> paths = chosen_paths(g);
    if (lookup_) {
      const int found = lookup_->find(call.history, continuation_);
      if (found > 0) add_lookup_branch(g, paths, std::span<const std::int32_t>(continuation_.data(), static_cast<std::size_t>(found)));
    }
    if (paths.empty()) return std::nullopt;
    tree_options topt;
    topt.topk = opt_.topk + 1;  // rank `topk`: lookup nodes
    topt.max_depth = max_depth_;
    tree out = tree::from_paths(paths, topt);
    call.node_tokens[0] = call.history.back();
    const auto v = static_cast<std::size_t>(vocab);
    for (int u = 1; u < out.num_nodes(); ++u) {
      const auto& p = out.sorted_paths()[static_cast<std::size_t>(u) - 1];
      const int id = node_at(g, p);
      const std::int32_t token = id >= 0 ? g.nodes[static_cast<std::size_t>(id)].token : continuation_[p.size() - 1];
      call.node_tokens[static_cast<std::size_t>(u)] = token;
      if (rows == nullptr) continue;
      float* row = rows + static_cast<std::size_t>(u) * v;
      if (id >= 0) {
        const float* drawn = g.draw_rows.data() + static_cast<std::size_t>(g.nodes[static_cast<std::size_t>(id)].slot) * v;
        std::copy(drawn, drawn + v, row);
      } else {  // the lookup's own token: a point mass
        std::fill(row, row + v, 0.0f);
        row[static_cast<std::size_t>(token)] = 1.0f;
      }
    }
    return out;
  }

  // Children of `parent` from its logit row: the drafter's top-k, each with the path's log-probability.
  void expand(growth& g, int parent, std::span<const float> row, int vocab) {
    detail::check_logit_row(row, parent, "draft tree: the drafter's row after node");
    const auto v = static_cast<std::size_t>(vocab);
    const int k = std::min(opt_.topk, vocab);
    ids_.resize(static_cast<std::size_t>(k));
    detail::top_k_ids(row.data(), v, k, ids_.data());
    const float m = detail::row_max(row.data(), v).max;
    const double log_sum = std::log(detail::softmax_sum(row.data(), v, m, 1.0f).sum);
    node& p = g.nodes[static_cast<std::size_t>(parent)];
    p.first_child = static_cast<int>(g.nodes.size());
    const double base = p.logp;
    const int depth = p.depth + 1;
    for (int r = 0; r < k; ++r) {
      const std::int32_t t = ids_[static_cast<std::size_t>(r)];
      const double lp = static_cast<double>(row[static_cast<std::size_t>(t)] - m) - log_sum;
      g.nodes.push_back({parent, r, depth, t, base + std::min(lp, 0.0), -1});
    }
  }

  // Sampled children of the `parents` (rows `[parents][vocab]`, in that order, all of one depth):
  // the children of each are drawn without replacement from its warped row, one draw at a time,
  // from the parent whose next draw is the most probable to carry (its path's probability times
  // its row's mass not drawn yet; ties: the earlier parent), until the depth's share of `max_nodes`
  // is drawn (one draw is left for each deeper depth), a parent has `topk` children, its row is
  // spent, or no draw reaches `min_prob`. Which parent draws next depends only on draws already
  // made, and every drawn token is kept: conditioned on everything before it, each draw follows
  // the row it is verified against, which is what keeps speculative sampling exact.
  void expand_sampled(growth& g, std::span<const int> parents, std::span<const float> rows, int vocab) {
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
    const int first_slot = g.drawn;
    // Each depth leaves one draw for every depth below it, so that a path can reach `max_depth`.
    const int depth = g.nodes[static_cast<std::size_t>(parents[0])].depth + 1;
    const int limit = std::min(opt_.max_nodes, std::max(g.drawn + 1, opt_.max_nodes - (opt_.max_depth - depth)));
    while (g.drawn < limit) {
      int best = -1;
      double best_score = -std::numeric_limits<double>::infinity();
      for (std::size_t j = 0; j < np; ++j) {
        if (children_[j] >= opt_.topk || !(rest_[j] > 0.0)) continue;
        const double score = g.nodes[static_cast<std::size_t>(parents[j])].logp + std::log(rest_[j]);
        if (score >= floor_ && (best < 0 || score > best_score)) {
          best = static_cast<int>(j);
          best_score = score;
        }
      }
      if (best < 0) break;
      const auto j = static_cast<std::size_t>(best);
      // The row drawn from: the parent's row without its children so far, renormalised.
      const float* q = q_rows_.data() + j * v;
      float* p = g.draw_rows.data() + static_cast<std::size_t>(g.drawn) * v;
      std::copy(q, q + v, p);
      for (int s = first_slot; s < g.drawn; ++s)
        if (g.slot_parent[static_cast<std::size_t>(s)] == best) p[static_cast<std::size_t>(g.slot_token[static_cast<std::size_t>(s)])] = 0.0f;
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
      const double u = detail::philox_uniform(g.seed, g.step, detail::draft_draw_offset + g.draws++);
      const std::int32_t token = detail::draw_from(r_.data(), v, mass, u);
      g.slot_parent[static_cast<std::size_t>(g.drawn)] = best;
      g.slot_token[static_cast<std::size_t>(g.drawn)] = token;
      ++g.drawn;
      ++children_[j];
      rest_[j] = std::max(rest - static_cast<double>(q[static_cast<std::size_t>(token)]), 0.0);
    }
    // The drawn nodes, each parent's children consecutive in draw order.
    for (std::size_t j = 0; j < np; ++j) {
      if (children_[j] == 0) continue;
      node& parent = g.nodes[static_cast<std::size_t>(parents[j])];
      parent.first_child = static_cast<int>(g.nodes.size());
      const double base = parent.logp;
      const int child_depth = parent.depth + 1;
      int rank = 0;
      for (int s = first_slot; s < g.drawn; ++s) {
        if (g.slot_parent[static_cast<std::size_t>(s)] != static_cast<int>(j)) continue;
        const std::int32_t t = g.slot_token[static_cast<std::size_t>(s)];
        const double lp = std::log(static_cast<double>(q_rows_[j * v + static_cast<std::size_t>(t)]));
        g.nodes.push_back({parents[j], rank++, child_depth, t, base + lp, -1, s});
      }
    }
  }

  // Ranks of node `id`'s path from the root.
  void path_of(const growth& g, int id, std::vector<int>& out) const {
    out.clear();
    for (int u = id; u > 0; u = g.nodes[static_cast<std::size_t>(u)].parent) out.push_back(g.nodes[static_cast<std::size_t>(u)].rank);
    std::reverse(out.begin(), out.end());
  }

  // More probable first; equal ones shallower first (a parent before its child), then by id.
  [[nodiscard]] static bool before(const growth& g, int a, int b) {
    const node& x = g.nodes[static_cast<std::size_t>(a)];
    const node& y = g.nodes[static_cast<std::size_t>(b)];
    if (x.logp != y.logp) return x.logp > y.logp;
    if (x.depth != y.depth) return x.depth < y.depth;
    return a < b;
  }

  // The step's tree: the `max_nodes` most probable drafted nodes, as paths (sampled: every node
  // drawn; leaving one out for its value would bias the draws that remain).
  std::vector<std::vector<int>> chosen_paths(const growth& g) {
    chosen_.clear();
    for (int u = 1; u < static_cast<int>(g.nodes.size()); ++u)
      if (warp_ || g.nodes[static_cast<std::size_t>(u)].logp >= floor_) chosen_.push_back(u);
    const auto keep = std::min(chosen_.size(), static_cast<std::size_t>(opt_.max_nodes));
    std::partial_sort(chosen_.begin(), chosen_.begin() + static_cast<std::ptrdiff_t>(keep), chosen_.end(),
                      [&](int a, int b) { return before(g, a, b); });
    chosen_.resize(keep);
    std::vector<std::vector<int>> paths;
    paths.reserve(keep);
    for (const int u : chosen_) {
      path_of(g, u, path_);
      paths.push_back(path_);
    }
    return paths;
  }

  // Adds the lookup's continuation as a branch: it follows drafted nodes proposing its tokens,
  // then continues with nodes of rank `topk`.
  void add_lookup_branch(const growth& g, std::vector<std::vector<int>>& paths, std::span<const std::int32_t> continuation) const {
    std::vector<int> at;
    int u = 0;  // the branch's node among the drafted ones while it follows them
    bool own = false;
    for (const std::int32_t t : continuation) {
      int next = -1;
      if (!own)
        for (const auto& p : paths)
          if (p.size() == at.size() + 1 && std::equal(at.begin(), at.end(), p.begin())) {
            const int c = g.nodes[static_cast<std::size_t>(u)].first_child + p.back();
            if (g.nodes[static_cast<std::size_t>(c)].token == t) {
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
  [[nodiscard]] int node_at(const growth& g, const std::vector<int>& p) const {
    int u = 0;
    for (std::size_t d = 0; d < p.size(); ++d) {
      if (p[d] == opt_.topk) return -1;
      u = g.nodes[static_cast<std::size_t>(u)].first_child + p[d];
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
  std::optional<sampling_warp> warp_;  // sampled trees (`tree_sampler`)
  std::vector<growth> growths_;        // per call of a step
  // Scratch of one step.
  std::vector<draft_root_call> roots_;
  std::vector<draft_pass_call> pass_calls_;
  std::vector<draft_tree_pass> passes_;
  std::vector<std::span<const float>> rows_;
  std::vector<std::size_t> which_;
  std::vector<int> chosen_, path_;
  std::vector<char> in_pass_;
  std::vector<std::vector<int>> pass_paths_;
  std::vector<std::int32_t> ids_, continuation_, warp_ids_;
  std::vector<float> q_rows_;
  std::vector<double> r_, rest_;
  std::vector<int> children_;
  std::vector<std::uint64_t> keys_;
  std::vector<std::int64_t> passes_by_depth_;
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
//!   `topk` per parent, until `max_nodes` nodes are drawn (each depth leaves one draw for every
//!   depth below it, down to `max_depth`) or no draw would reach `min_prob`. Every
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
  std::optional<tree> draft(int request, std::span<const std::int32_t> history, std::span<const float> head_logits,
                            int vocab, std::span<std::int32_t> node_tokens, std::uint64_t seed, std::uint64_t step) {
    step_draft_call call{request, history, head_logits, node_tokens, seed, step, std::nullopt};
    draft_batch(std::span<step_draft_call>(&call, 1), vocab);
    return std::move(call.result);
  }

  //! Every request's tree of a step, each drawn with its call's seed and step (as
  //! `tree_drafter::draft_batch`): the same trees as `draft` for each alone.
  void draft_batch(std::span<step_draft_call> calls, int vocab) {
    if (trees_.growths_.size() < calls.size()) trees_.growths_.resize(calls.size());
    rows_.clear();
    const std::size_t cells = static_cast<std::size_t>(max_nodes()) * static_cast<std::size_t>(std::max(vocab, 0));
    for (std::size_t i = 0; i < calls.size(); ++i) {
      trees_.growths_[i].seed = calls[i].seed;
      trees_.growths_[i].step = calls[i].step;
      std::vector<float>& rows = probs_[calls[i].request];
      rows.resize(cells);
      rows_.push_back(rows.data());
    }
    trees_.grow_all(calls, vocab, rows_);
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
  std::vector<float*> rows_;                 // per call of a step: its request's rows
};

MEDUSA_NAMESPACE_END
