// SPDX-License-Identifier: Apache-2.0
//! @file tree/search.hpp
//! Tree search: the tree that maximises expected tokens per second on one machine, from how often
//! the heads' drafts are right (`path_calibration`) and what a step of N tokens costs there
//! (`step_cost_curve`). docs/tree.md, "Choosing a tree", explains the model.
//!
//! With greedy acceptance a node's drafts are committed iff every token on its path is the
//! model's own next token, and siblings carry distinct tokens, so at most one node per depth is
//! accepted and E[tokens per step] = 1 + Σ_{non-root nodes u} P(path(u) is right). For a fixed
//! node count the best tree is therefore the N−1 most probable paths: P never grows along a path,
//! so that set is prefix-closed (ties: shorter first, then canonical order). The search ranks
//! every path once, and the best tree of each size is a prefix of that ranking; it then picks the
//! size whose E[tokens] ÷ cost is largest.
//!
//! @code
//! #include <medusa/tree/search.hpp>
//! auto cal = medusa::path_calibration::from_accuracy({{0.7, 0.1}, {0.6, 0.1}});
//! medusa::step_cost_curve cost{.rows = {1, 4, 16}, .seconds = {1.0e-3, 1.2e-3, 2.0e-3}, .head_seconds = 5e-5};
//! medusa::tree_plan plan = medusa::optimize_tree(cal, cost, {.max_nodes = 16});
//! auto t = medusa::tree::from_paths(plan.paths);  // plan.predicted_speedup: vs plain decoding
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <queue>
#include <span>
#include <string>
#include <utility>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

namespace detail {
inline std::string path_text(std::span<const int> p) {
  std::string s = "[";
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(p[i]);
  }
  s += ']';
  return s;
}
}  // namespace detail

//! How often each draft path is right: P(the rank-r_1 token of head 0, then the rank-r_2 token of
//! head 1, ... are all the model's next tokens). Two sources:
//! - *path-conditional* counts measured from real decoding (`from_counts`): exact for models whose
//!   heads are right together or wrong together (loops, boilerplate);
//! - a per-head accuracy table (`from_accuracy`), combined as if the heads were independent.
class path_calibration {
 public:
  //! Independent heads: P(path) = Π_k acc[k][path[k]]. `acc[k][r]` = how often the rank-r token
  //! of head k is right. Throws `invalid_input` on an empty table, ragged rows, or values outside
  //! [0, 1] (or NaN), or a head whose ranks sum above 1.
  static path_calibration from_accuracy(std::vector<std::vector<double>> acc) {
    if (acc.empty() || acc[0].empty()) throw invalid_input("calibration: the accuracy table is empty");
    for (std::size_t k = 0; k < acc.size(); ++k) {
      if (acc[k].size() != acc[0].size())
        throw invalid_input("calibration: head " + std::to_string(k) + " has " + std::to_string(acc[k].size()) +
                            " ranks, head 0 has " + std::to_string(acc[0].size()));
      double sum = 0;
      for (std::size_t r = 0; r < acc[k].size(); ++r) {
        const double a = acc[k][r];
        if (!(a >= 0.0 && a <= 1.0))
          throw invalid_input("calibration: accuracy of head " + std::to_string(k) + " rank " + std::to_string(r) +
                              " is " + std::to_string(a) + ", not in [0, 1]");
        sum += a;
      }
      if (sum > 1.0 + 1e-6)
        throw invalid_input("calibration: the ranks of head " + std::to_string(k) + " sum to " + std::to_string(sum) +
                            " > 1");
    }
    path_calibration c;
    c.heads_ = static_cast<int>(acc.size());
    c.topk_ = static_cast<int>(acc[0].size());
    c.acc_ = std::move(acc);
    return c;
  }

  //! Path-conditional counts: of `positions` decoding positions, `count` had drafts matching
  //! `path` (every prefix of a listed path must be listed; unlisted paths were never right).
  //! Throws `invalid_input` on 0 positions, a path that is empty, too deep (> `num_heads`), has a
  //! rank outside [0, topk) or is listed twice, a count above `positions` or above its prefix's
  //! count, or a missing prefix.
  static path_calibration from_counts(int num_heads, int topk, std::uint64_t positions,
                                      const std::vector<std::pair<std::vector<int>, std::uint64_t>>& counts) {
    if (num_heads < 1 || topk < 1)
      throw invalid_input("calibration: num_heads and topk must be >= 1, got " + std::to_string(num_heads) + " and " +
                          std::to_string(topk));
    if (positions == 0) throw invalid_input("calibration: no positions were counted");
    path_calibration c;
    c.heads_ = num_heads;
    c.topk_ = topk;
    c.positions_ = positions;
    for (const auto& [p, n] : counts) {
      const std::string name = "calibration: path " + detail::path_text(p);
      if (p.empty()) throw invalid_input("calibration: an empty path is listed");
      if (p.size() > static_cast<std::size_t>(num_heads))
        throw invalid_input(name + " is deeper than the " + std::to_string(num_heads) + " heads");
      for (int r : p)
        if (r < 0 || r >= topk) throw invalid_input(name + ": rank " + std::to_string(r) + " is outside [0, " + std::to_string(topk) + ")");
      if (n > positions)
        throw invalid_input(name + " has count " + std::to_string(n) + " > " + std::to_string(positions) + " positions");
      if (!c.counts_.emplace(p, n).second) throw invalid_input(name + " is listed twice");
    }
    for (const auto& [p, n] : c.counts_) {
      if (p.size() < 2) continue;
      const std::vector<int> prefix(p.begin(), p.end() - 1);
      const auto it = c.counts_.find(prefix);
      if (it == c.counts_.end())
        throw invalid_input("calibration: path " + detail::path_text(p) + " is listed but its prefix " +
                            detail::path_text(prefix) + " is not");
      if (n > it->second)
        throw invalid_input("calibration: path " + detail::path_text(p) + " has count " + std::to_string(n) +
                            " > its prefix's count " + std::to_string(it->second));
    }
    return c;
  }

  //! Heads covered (the deepest path a tree may use).
  [[nodiscard]] int num_heads() const noexcept { return heads_; }
  //! Ranks covered per head.
  [[nodiscard]] int topk() const noexcept { return topk_; }
  //! True for measured path counts, false for the independence model.
  [[nodiscard]] bool conditional() const noexcept { return positions_ > 0; }
  //! Positions counted (0 for the independence model).
  [[nodiscard]] std::uint64_t positions() const noexcept { return positions_; }

  //! P(every draft of `path` is right); 0 outside the calibration (too deep, rank ≥ topk).
  [[nodiscard]] double probability(std::span<const int> path) const {
    if (path.empty()) return 1.0;
    if (path.size() > static_cast<std::size_t>(heads_)) return 0.0;
    for (int r : path)
      if (r < 0 || r >= topk_) return 0.0;
    if (conditional()) {
      const auto it = counts_.find(std::vector<int>(path.begin(), path.end()));
      return it == counts_.end() ? 0.0 : static_cast<double>(it->second) / static_cast<double>(positions_);
    }
    double p = 1.0;
    for (std::size_t k = 0; k < path.size(); ++k) p *= acc_[k][static_cast<std::size_t>(path[k])];
    return p;
  }

  //! Expected tokens per step of a tree under greedy acceptance: 1 (the root) + Σ P(path).
  //! This averages over positions; decoding visits the positions where a step starts, and steps
  //! skip over the easy stretches, so it over-states tokens per step (`replay_tokens_per_step`).
  [[nodiscard]] double expected_tokens(const std::vector<std::vector<int>>& paths) const {
    double s = 1.0;
    for (const auto& p : paths) s += probability(p);
    return s;
  }

  //! The recorded decoding (`path_counter`): per sequence, per position, the path its drafts
  //! would have been right on (truncated at the first miss). Empty when not recorded.
  using recorded_sequences = std::vector<std::vector<std::vector<int>>>;
  //! Adds a recording (replaces any); throws `invalid_input` for a path deeper than the heads or
  //! with a rank outside [0, topk).
  void set_sequences(recorded_sequences seqs) {
    for (const auto& seq : seqs)
      for (const auto& p : seq) {
        if (p.size() > static_cast<std::size_t>(heads_))
          throw invalid_input("calibration: a recorded path " + detail::path_text(p) + " is deeper than the heads");
        for (int r : p)
          if (r < 0 || r >= topk_) throw invalid_input("calibration: a recorded path " + detail::path_text(p) + " has a rank outside the top-k");
      }
    sequences_ = std::move(seqs);
  }
  //! The recording (may be empty).
  [[nodiscard]] const recorded_sequences& sequences() const noexcept { return sequences_; }

  //! Tokens per step of greedy decoding with a tree, replayed on the recording: each step starts
  //! at a position, accepts the longest prefix of that position's path the tree holds, and the
  //! next step starts after it. Exact for the recorded text; 0 without a recording.
  [[nodiscard]] double replay_tokens_per_step(const std::vector<std::vector<int>>& paths) const {
    std::map<std::vector<int>, int> in;
    for (std::size_t i = 0; i < paths.size(); ++i) in.emplace(paths[i], 0);
    return replay([&](const std::vector<int>& p, std::size_t len) {
      return in.count(std::vector<int>(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(len))) > 0;
    });
  }

  //! Replay with a membership test `holds(path, length)`: does the tree hold path[0..length)?
  template <class Holds>
  [[nodiscard]] double replay(Holds&& holds) const {
    std::uint64_t tokens = 0, steps = 0;
    for (const auto& seq : sequences_) {
      for (std::size_t t = 0; t < seq.size();) {
        const auto& p = seq[t];
        std::size_t a = 0;
        while (a < p.size() && holds(p, a + 1)) ++a;
        const std::size_t emitted = std::min(a + 1, seq.size() - t);
        tokens += emitted;
        ++steps;
        t += emitted;
      }
    }
    return steps ? static_cast<double>(tokens) / static_cast<double>(steps) : 0.0;
  }

 private:
  int heads_ = 0;
  int topk_ = 0;
  std::uint64_t positions_ = 0;
  std::map<std::vector<int>, std::uint64_t> counts_;
  std::vector<std::vector<double>> acc_;
  recorded_sequences sequences_;
};

//! Counts path-conditional calibration from real decoding: for each position, the ranks of the
//! true tokens t+2, t+3, ... in heads 0, 1, ... (`add`); every prefix of the path they spell, up to
//! the first rank outside the top-k, is counted once.
class path_counter {
 public:
  //! Throws `invalid_input` unless heads ≥ 1 and topk ≥ 1.
  path_counter(int heads, int topk) : heads_(heads), topk_(topk) {
    if (heads < 1 || topk < 1)
      throw invalid_input("path counter: heads and topk must be >= 1, got " + std::to_string(heads) + " and " +
                          std::to_string(topk));
    head_positions_.assign(static_cast<std::size_t>(heads), 0);
    hits_.assign(static_cast<std::size_t>(heads), std::vector<std::uint64_t>(static_cast<std::size_t>(topk), 0));
  }
  //! Starts a new recorded sequence (positions are replayed in order within one).
  void next_sequence() { sequences_.emplace_back(); }
  //! One position: `ranks[k]` = rank of the true token in head k (< 0: no target). Positions
  //! without a head-0 target are not counted.
  void add(std::span<const int> ranks) {
    for (std::size_t k = 0; k < ranks.size() && k < static_cast<std::size_t>(heads_); ++k) {
      if (ranks[k] < 0) continue;
      ++head_positions_[k];
      if (ranks[k] < topk_) ++hits_[k][static_cast<std::size_t>(ranks[k])];
    }
    if (ranks.empty() || ranks[0] < 0) return;
    ++positions_;
    std::vector<int> path;
    for (std::size_t k = 0; k < ranks.size() && k < static_cast<std::size_t>(heads_); ++k) {
      if (ranks[k] < 0 || ranks[k] >= topk_) break;
      path.push_back(ranks[k]);
      ++counts_[path];
    }
    if (sequences_.empty()) sequences_.emplace_back();
    sequences_.back().push_back(std::move(path));
  }
  //! The recorded paths, per sequence.
  [[nodiscard]] const path_calibration::recorded_sequences& sequences() const noexcept { return sequences_; }
  //! Positions counted.
  [[nodiscard]] std::uint64_t positions() const noexcept { return positions_; }
  //! The counts, in path order.
  [[nodiscard]] const std::map<std::vector<int>, std::uint64_t>& counts() const noexcept { return counts_; }
  //! The calibration (`path_calibration::from_counts`); throws `invalid_input` if nothing was counted.
  [[nodiscard]] path_calibration calibration() const {
    auto c = path_calibration::from_counts(heads_, topk_, positions_, {counts_.begin(), counts_.end()});
    c.set_sequences(sequences_);
    return c;
  }
  //! How often head k's rank-r token was right, over its positions (each head on its own).
  [[nodiscard]] double accuracy(int k, int r) const {
    const auto kk = static_cast<std::size_t>(k);
    return head_positions_[kk] ? static_cast<double>(hits_[kk][static_cast<std::size_t>(r)]) / static_cast<double>(head_positions_[kk])
                               : 0.0;
  }
  //! Heads and ranks counted.
  [[nodiscard]] int heads() const noexcept { return heads_; }
  [[nodiscard]] int topk() const noexcept { return topk_; }

 private:
  int heads_, topk_;
  std::uint64_t positions_ = 0;
  path_calibration::recorded_sequences sequences_;
  std::vector<std::uint64_t> head_positions_;
  std::vector<std::vector<std::uint64_t>> hits_;
  std::map<std::vector<int>, std::uint64_t> counts_;
};

namespace detail {
// A time as a message shows it: "%g" keeps 1e-12 and 1e306 readable where std::to_string does not.
inline std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}
}  // namespace detail

//! What a decoding step costs on one machine, model, thread count and weight format: the forward
//! pass of a step of `rows[i]` tokens takes `seconds[i]` (a plain step is rows = 1), and a Medusa
//! step adds the heads (`head_seconds` per head the tree reaches) and the work around the model
//! (`overhead_seconds`: candidates, acceptance, KV commit). Steps between measured sizes are
//! interpolated linearly, beyond the last extrapolated from the last two points.
struct step_cost_curve {
  std::vector<int> rows;         //!< step sizes measured, strictly ascending, rows[0] == 1
  std::vector<double> seconds;   //!< forward seconds of each size
  double head_seconds = 0;       //!< per head the tree reaches, per step
  double overhead_seconds = 0;   //!< per Medusa step, outside the model and the heads

  //! Shortest and longest time a step or its parts may take, in seconds: outside them a file is
  //! wrong (or hostile), and the ratios the tree search takes would overflow.
  static constexpr double min_seconds = 1e-9, max_seconds = 1e6;

  //! Throws `invalid_input` naming the problem: no sizes, sizes and times of different lengths,
  //! rows[0] != 1, sizes not ascending, step times outside [`min_seconds`, `max_seconds`], head or
  //! overhead times negative or above `max_seconds`.
  void validate() const {
    if (rows.empty()) throw invalid_input("step cost: no step sizes");
    if (rows.size() != seconds.size())
      throw invalid_input("step cost: " + std::to_string(rows.size()) + " step sizes but " +
                          std::to_string(seconds.size()) + " times");
    if (rows[0] != 1) throw invalid_input("step cost: the first step size must be 1 (a plain step), got " + std::to_string(rows[0]));
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (i > 0 && rows[i] <= rows[i - 1])
        throw invalid_input("step cost: step sizes must ascend, got " + std::to_string(rows[i - 1]) + " then " +
                            std::to_string(rows[i]));
      if (!(seconds[i] >= min_seconds && seconds[i] <= max_seconds))
        throw invalid_input("step cost: the time of a " + std::to_string(rows[i]) + "-token step is " +
                            detail::seconds_text(seconds[i]) + " s, not in [1e-9, 1e6]");
    }
    if (!(head_seconds >= 0.0 && head_seconds <= max_seconds))
      throw invalid_input("step cost: head_seconds is " + detail::seconds_text(head_seconds) + ", not in [0, 1e6]");
    if (!(overhead_seconds >= 0.0 && overhead_seconds <= max_seconds))
      throw invalid_input("step cost: overhead_seconds is " + detail::seconds_text(overhead_seconds) + ", not in [0, 1e6]");
  }

  //! Forward seconds of a step of `n` ≥ 1 tokens.
  [[nodiscard]] double forward_seconds(int n) const {
    const auto hi = std::lower_bound(rows.begin(), rows.end(), n);
    if (hi != rows.end() && *hi == n) return seconds[static_cast<std::size_t>(hi - rows.begin())];
    if (rows.size() == 1) return seconds[0] * n;
    std::size_t j = hi == rows.end() ? rows.size() - 1 : static_cast<std::size_t>(hi - rows.begin());
    if (j == 0) j = 1;
    const double x0 = rows[j - 1], x1 = rows[j], y0 = seconds[j - 1], y1 = seconds[j];
    return std::max(seconds[0], y0 + (y1 - y0) * (n - x0) / (x1 - x0));
  }
  //! Seconds of a plain decoding step.
  [[nodiscard]] double plain_seconds() const { return seconds[0]; }
  //! Seconds of a Medusa step over a tree of `nodes` nodes and `depth` heads.
  [[nodiscard]] double medusa_seconds(int nodes, int depth) const {
    return forward_seconds(nodes) + depth * head_seconds + overhead_seconds;
  }
};

//! Limits of `optimize_tree`.
struct tree_search_options {
  int max_nodes = 64;  //!< largest tree, root included (≥ 2)
  int max_depth = 0;   //!< longest path; 0 = every head of the calibration
};

//! The prediction for the best tree of one size.
struct tree_size_estimate {
  int nodes = 0;                //!< root included
  int depth = 0;                //!< heads reached
  double expected_tokens = 0;   //!< per step, root included
  double relative_cost = 0;     //!< step seconds ÷ plain step seconds
  double speedup = 0;           //!< expected_tokens ÷ relative_cost
};

//! The chosen tree and the prediction behind it.
struct tree_plan {
  std::vector<std::vector<int>> paths;     //!< canonical order, root excluded
  double expected_tokens = 1;              //!< per step, root included
  double relative_cost = 1;                //!< step seconds ÷ plain step seconds
  double predicted_speedup = 0;            //!< tokens per second ÷ plain decoding's
  std::vector<tree_size_estimate> sizes;   //!< every size searched, 2 nodes first

  //! Nodes of the tree, root included.
  [[nodiscard]] int nodes() const noexcept { return static_cast<int>(paths.size()) + 1; }
};

namespace detail {
// Paths in ranking order (probability descending, then shorter first, then canonical order), at
// most `count`, none deeper than `max_depth`, none with probability 0. `prob(span<const int>)`
// must never grow along a path: then the frontier (children of the paths taken) always holds the
// next path of the global ranking, and every prefix of the ranking is prefix-closed.
template <class Prob>
std::vector<std::vector<int>> ranked_by(Prob&& prob, int topk, int count, int max_depth) {
  struct entry {
    double p;
    std::vector<int> path;
  };
  auto worse = [](const entry& a, const entry& b) {
    if (a.p != b.p) return a.p < b.p;
    if (a.path.size() != b.path.size()) return a.path.size() > b.path.size();
    return a.path > b.path;
  };
  std::priority_queue<entry, std::vector<entry>, decltype(worse)> frontier(worse);
  auto push_children = [&](const std::vector<int>& parent) {
    if (static_cast<int>(parent.size()) >= max_depth) return;
    std::vector<int> child = parent;
    child.push_back(0);
    for (int r = 0; r < topk; ++r) {
      child.back() = r;
      const double p = prob(std::span<const int>(child));
      if (p > 0.0) frontier.push({p, child});
    }
  };
  std::vector<std::vector<int>> out;
  push_children({});
  while (static_cast<int>(out.size()) < count && !frontier.empty()) {
    entry e = frontier.top();
    frontier.pop();
    push_children(e.path);
    out.push_back(std::move(e.path));
  }
  return out;
}
}  // namespace detail

//! The most probable paths in ranking order (probability descending, then shorter first, then
//! canonical order), at most `count` of them, none deeper than `max_depth` (0 = every head) and
//! none with probability 0. Every prefix of the ranking is the best prefix-closed tree of its size.
[[nodiscard]] inline std::vector<std::vector<int>> ranked_paths(const path_calibration& cal, int count, int max_depth = 0) {
  if (max_depth <= 0 || max_depth > cal.num_heads()) max_depth = cal.num_heads();
  return detail::ranked_by([&](std::span<const int> p) { return cal.probability(p); }, cal.topk(), count, max_depth);
}

namespace detail {
// For each recorded position, the ranking index of each prefix of its path (SIZE_MAX if unranked).
inline std::vector<std::vector<std::vector<std::size_t>>> ranking_index(const path_calibration::recorded_sequences& seqs,
                                                                       const std::vector<std::vector<int>>& ranked) {
  std::vector<std::vector<std::vector<std::size_t>>> out;
  if (seqs.empty()) return out;
  std::map<std::vector<int>, std::size_t> index;
  for (std::size_t i = 0; i < ranked.size(); ++i) index.emplace(ranked[i], i);
  out.resize(seqs.size());
  std::vector<int> prefix;
  for (std::size_t s = 0; s < seqs.size(); ++s) {
    out[s].resize(seqs[s].size());
    for (std::size_t t = 0; t < seqs[s].size(); ++t) {
      prefix.clear();
      for (int r : seqs[s][t]) {
        prefix.push_back(r);
        const auto it = index.find(prefix);
        if (it == index.end()) break;  // an unranked prefix: nothing deeper is held either
        out[s][t].push_back(it->second);
      }
    }
  }
  return out;
}
// Tokens per step replaying the recording with the tree of ranked paths 0..limit.
inline double replay_ranked(const std::vector<std::vector<std::vector<std::size_t>>>& idx, std::size_t limit) {
  std::uint64_t tokens = 0, steps = 0;
  for (const auto& seq : idx)
    for (std::size_t t = 0; t < seq.size();) {
      std::size_t a = 0;
      while (a < seq[t].size() && seq[t][a] <= limit) ++a;
      const std::size_t emitted = std::min(a + 1, seq.size() - t);
      tokens += emitted;
      ++steps;
      t += emitted;
    }
  return steps ? static_cast<double>(tokens) / static_cast<double>(steps) : 0.0;
}
}  // namespace detail

//! The tree with the highest predicted tokens per second among the best trees of every size from
//! 2 to `max_nodes` nodes and every depth limit (the heads a tree reaches cost time too). When no
//! tree beats plain decoding the plan still holds the best one (predicted_speedup < 1): the caller
//! decides whether to decode plainly. Throws `invalid_input` for max_nodes < 2 or a bad cost curve.
[[nodiscard]] inline tree_plan optimize_tree(const path_calibration& cal, const step_cost_curve& cost,
                                             const tree_search_options& opt = {}) {
  if (opt.max_nodes < 2) throw invalid_input("tree search: max_nodes must be >= 2, got " + std::to_string(opt.max_nodes));
  cost.validate();
  const int max_depth = opt.max_depth <= 0 ? cal.num_heads() : std::min(opt.max_depth, cal.num_heads());
  tree_plan plan;
  plan.sizes.resize(static_cast<std::size_t>(opt.max_nodes - 1));
  std::vector<std::vector<int>> best_paths;
  // The best tree of n nodes and depth ≤ d is the first n − 1 paths of the depth-d ranking.
  for (int d = 1; d <= max_depth; ++d) {
    auto ranked = ranked_paths(cal, opt.max_nodes - 1, d);
    if (ranked.empty()) ranked.push_back({0});  // no draft was ever right: the cheapest tree
    // With a recording, tokens per step come from replaying it: the tree of the first i + 1
    // ranked paths holds a prefix iff the prefix's ranking index is ≤ i (looked up once here).
    const auto prefix_index = detail::ranking_index(cal.sequences(), ranked);
    double tokens = 1.0;
    int depth = 0;
    for (std::size_t i = 0; i < ranked.size(); ++i) {
      tokens += cal.probability(ranked[i]);
      if (!prefix_index.empty()) tokens = detail::replay_ranked(prefix_index, i);
      depth = std::max(depth, static_cast<int>(ranked[i].size()));
      tree_size_estimate e;
      e.nodes = static_cast<int>(i) + 2;
      e.depth = depth;
      e.expected_tokens = tokens;
      e.relative_cost = cost.medusa_seconds(e.nodes, depth) / cost.plain_seconds();
      e.speedup = tokens / e.relative_cost;
      tree_size_estimate& slot = plan.sizes[i];
      if (slot.nodes == 0 || e.speedup > slot.speedup) slot = e;
      if (best_paths.empty() || e.speedup > plan.predicted_speedup) {
        best_paths.assign(ranked.begin(), ranked.begin() + static_cast<std::ptrdiff_t>(i) + 1);
        plan.expected_tokens = e.expected_tokens;
        plan.relative_cost = e.relative_cost;
        plan.predicted_speedup = e.speedup;
      }
    }
  }
  std::erase_if(plan.sizes, [](const tree_size_estimate& e) { return e.nodes == 0; });
  std::sort(best_paths.begin(), best_paths.end(), [](const auto& x, const auto& y) {
    return x.size() != y.size() ? x.size() < y.size() : x < y;
  });
  plan.paths = std::move(best_paths);
  return plan;
}

MEDUSA_NAMESPACE_END
