// SPDX-License-Identifier: Apache-2.0
//! @file cuda/kernels/verify.hpp
//! Verification of a batch of requests on the GPU: the same decisions as `medusa::verify` with
//! `greedy_policy`, `typical_policy`, `rejection_policy` and `speculative_policy` (docs/cuda.md).
//!
//! Node-test policies (greedy, typical) take two kernels:
//! - `node_rows`: one block per tree-node row (B × N rows): argmax (ties to the lower id), and for
//!   typical the softmax statistics (max, log Σ exp, entropy → threshold τ);
//! - `select_path`: one block per request: a node is accepted when its parent is and its token
//!   passes against the parent's row, level by level as on the CPU (so typical's path scores sum in
//!   the same order); then the first retrieve row of maximal accepted length (typical: of maximal
//!   score), EOS truncation and the bonus (the argmax of the final node's row).
//!
//! Sampling policies (rejection, speculative) take one kernel, `sample_path`: one block per request
//! walks the tree like the CPU, drawing the same Philox uniforms (seed, step, draw index), with the
//! vocabulary-wide sums done by the block. The residual after rejected children is recomputed
//! from the row and the rejected list instead of being stored, so no workspace is needed.
//!
//! Numerics: greedy is bit-exact. Typical uses the device `exp2f` and a parallel summation order,
//! so its statistics differ from the CPU's by a few float ulp (relative 1e-5 at most); a decision
//! differs only when q(token) is that close to τ. Sampling sums the residual in double in a
//! parallel order: the accepted path and tokens equal the CPU's for the same seeds unless a
//! uniform falls within rounding distance (≈1e-15 relative) of a decision boundary.
//! -Inf is a masked token with probability 0, as on the CPU. Data errors (NaN or +Inf in a row
//! that is read, a row with every token masked, token ids outside the vocabulary, bad draft rows)
//! set the request's `request_status`; that request's result is accept length 0, bonus -1.
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/kernels/top_k.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/detail/philox.hpp>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {
namespace kernels {

//! Most threads of a `node_rows` block (the launchers' `__launch_bounds__`).
inline constexpr int verify_row_threads_max = 512;
//! Most threads of a `sample_path` block: one block walks a request's tree with all it can have.
inline constexpr int verify_walk_threads_max = 1024;

//! The acceptance rule a verify launch applies.
enum class verify_kind { greedy, typical, rejection, speculative };

//! Per-node-row results of `node_rows` (workspace).
struct node_row_stats {
  double log_sum = 0.0;  //!< ln Σ exp((z - max)/T) (typical, T > 0)
  double tau = 0.0;      //!< min(threshold, alpha·exp(−H)) (typical, T > 0)
  float max = 0.0f;      //!< the row max
  std::int32_t argmax = 0;  //!< id of the max, lowest on ties
  std::int32_t finite = 1;  //!< 0 when the row holds NaN or +Inf, or every token is masked
  std::int32_t unused = 0;
};

//! Arguments of a verify launch for B requests sharing one tree of N nodes.
template <class T>
struct verify_args {
  int batch = 0;                         //!< B
  int vocab = 0;                         //!< V
  const T* logits = nullptr;             //!< row (b·N + u) at `logits + (b·N + u)·row_stride`
  std::int64_t row_stride = 0;           //!< elements between rows (≥ V)
  const std::int32_t* node_tokens = nullptr;  //!< [B][N], node 0 = the root token
  const float* draft_probs = nullptr;    //!< [B][N][V] (speculative only; row 0 unused)
  const std::uint64_t* seeds = nullptr;  //!< [B] Philox keys (sampling)
  const std::uint64_t* steps = nullptr;  //!< [B] Philox step counters (sampling)
  const std::int32_t* eos_tokens = nullptr;  //!< [B] EOS id per request (-1 = off), or nullptr
  float temperature = 0.0f;              //!< T (typical, rejection, speculative)
  float posterior_threshold = 0.09f;     //!< typical ε
  float posterior_alpha = 0.3f;          //!< typical δ
  node_row_stats* row_stats = nullptr;   //!< [B][N] workspace (node-test policies)
  int path_stride = 0;                   //!< columns of `path_nodes` / `path_tokens` (≥ depth + 1)
  std::int32_t* accept_length = nullptr;  //!< [B] A: accepted drafts, root not counted
  std::int32_t* next_node = nullptr;      //!< [B] the final node (row of the next state)
  std::int32_t* bonus = nullptr;          //!< [B] next root; -1 when the path ended on EOS
  std::int32_t* eos = nullptr;            //!< [B] 1 when an accepted draft was EOS
  std::int32_t* best_row = nullptr;       //!< [B] retrieve row of the path
  std::int32_t* path_nodes = nullptr;     //!< [B][path_stride] nodes[0..A], root first
  std::int32_t* path_tokens = nullptr;    //!< [B][path_stride] tokens to commit, root first
  std::int32_t* status = nullptr;         //!< [B] `request_status`, written by every verify
};

namespace detail {

// Sum over the block, the same value returned to every thread (fixed order: deterministic).
template <class Ctx>
MEDUSA_KERNEL_FN double block_sum(Ctx& ctx, double v, double* scratch) {
  for (int m = warp_size / 2; m > 0; m /= 2) v += ctx.shfl_xor(v, m);
  if (ctx.lane() == 0) scratch[ctx.warp()] = v;
  ctx.sync();
  if (ctx.thread() == 0) {
    double s = 0.0;
    for (int w = 0; w < ctx.threads() / warp_size; ++w) s += scratch[w];
    scratch[warp_size] = s;
  }
  ctx.sync();
  const double out = scratch[warp_size];
  ctx.sync();
  return out;
}

// Logical or over the block, returned to every thread.
template <class Ctx>
MEDUSA_KERNEL_FN bool block_any(Ctx& ctx, bool p, int* scratch) {
  const bool warp_any = ctx.ballot(p) != 0u;
  if (ctx.thread() == 0) scratch[0] = 0;
  ctx.sync();
  if (ctx.lane() == 0 && warp_any) scratch[0] = 1;
  ctx.sync();
  const bool out = scratch[0] != 0;
  ctx.sync();
  return out;
}

// Best (value, id) over the block (larger value, then lower id), returned to every thread.
template <class Ctx>
MEDUSA_KERNEL_FN void block_argmax(Ctx& ctx, float& v, int& id) {
  top_list<1> l;
  l.v[0] = v;
  l.id[0] = id;
  block_merge(ctx, l);
  float* sv = static_cast<float*>(ctx.shared());
  int* si = reinterpret_cast<int*>(sv + warp_size);
  if (ctx.thread() == 0) {
    sv[0] = l.v[0];
    si[0] = l.id[0];
  }
  ctx.sync();
  v = sv[0];
  id = si[0];
  ctx.sync();
}

// Max and argmax of row x[0, V), and whether it is finite.
template <class Ctx, class T>
MEDUSA_KERNEL_FN void row_argmax(Ctx& ctx, const T* x, int vocab, float& max, int& argmax, bool& finite) {
  float best = -__builtin_inff();
  int best_id = INT_MAX;
  bool ok = true;
  for_each_element(ctx, x, 0, vocab, [&](float xi, int i) {
    ok = ok && is_valid_logit(xi);
    if (ranks_before(xi, i, best, best_id)) {
      best = xi;
      best_id = i;
    }
  });
  block_argmax(ctx, best, best_id);
  max = best;
  argmax = best_id;
  // Valid: no NaN or +Inf, and some token not masked (the max above -Inf).
  finite = !block_any(ctx, !ok, static_cast<int*>(ctx.shared())) && best != -__builtin_inff();
}

// Result of a request whose data was bad.
template <class T>
MEDUSA_KERNEL_FN void write_failure(const verify_args<T>& a, int b, request_status s) {
  a.status[b] = static_cast<std::int32_t>(s);
  a.accept_length[b] = 0;
  a.next_node[b] = 0;
  a.bonus[b] = -1;
  a.eos[b] = 0;
  a.best_row[b] = 0;
  a.path_nodes[static_cast<std::int64_t>(b) * a.path_stride] = 0;
  a.path_tokens[static_cast<std::int64_t>(b) * a.path_stride] = -1;
}

// Path, EOS truncation and bonus of request b ending at node `last` (one thread).
template <class Tree, class T>
MEDUSA_KERNEL_FN void write_path(const Tree& tree, const verify_args<T>& a, int b, int last, int row,
                                 std::int32_t bonus, bool ended_on_eos) {
  const int n = tree.num_nodes();
  const std::int32_t* tokens = a.node_tokens + static_cast<std::int64_t>(b) * n;
  std::int32_t* nodes_out = a.path_nodes + static_cast<std::int64_t>(b) * a.path_stride;
  std::int32_t* tokens_out = a.path_tokens + static_cast<std::int64_t>(b) * a.path_stride;
  int length = tree.node_depth(last);
  for (int j = length, u = last; j >= 0; --j, u = tree.parent(u)) {
    nodes_out[j] = u;
    tokens_out[j] = tokens[u];
  }
  const std::int32_t eos_token = a.eos_tokens != nullptr ? a.eos_tokens[b] : -1;
  bool eos = ended_on_eos;
  if (!eos && eos_token >= 0) {
    for (int j = 1; j <= length; ++j) {
      if (tokens_out[j] == eos_token) {
        length = j;
        last = nodes_out[j];
        eos = true;
        break;
      }
    }
  }
  a.accept_length[b] = length;
  a.next_node[b] = last;
  a.bonus[b] = eos ? -1 : bonus;
  a.eos[b] = eos ? 1 : 0;
  a.best_row[b] = row;
  a.status[b] = 0;
}

}  // namespace detail

//! `node_rows`: block x = row b·N + u. Argmax always; typical (T > 0) adds max, log Σ exp and τ.
template <verify_kind Kind, class Ctx, class T>
MEDUSA_KERNEL_FN void node_rows(Ctx& ctx, const verify_args<T>& a) {
  const int row = ctx.block_x();
  const T* x = a.logits + static_cast<std::int64_t>(row) * a.row_stride;
  float max = 0.0f;
  int argmax = 0;
  bool finite = true;
  detail::row_argmax(ctx, x, a.vocab, max, argmax, finite);
  node_row_stats s;
  s.max = max;
  s.argmax = argmax;
  s.finite = finite ? 1 : 0;
  if constexpr (Kind == verify_kind::typical) {
    if (a.temperature > 0.0f && finite) {
      double* scratch = static_cast<double*>(ctx.shared());
      const float k = (1.0f / a.temperature) * 1.44269504088896341f;
      float part = 0.0f;
      for_each_element(ctx, x, 0, a.vocab, [&](float xi, int) { part += exp2f((xi - max) * k); });
      const double sum = detail::block_sum(ctx, static_cast<double>(part), scratch);
      const auto inv_sum = static_cast<float>(1.0 / sum);
      float h = 0.0f;
      for_each_element(ctx, x, 0, a.vocab, [&](float xi, int) {
        const float q = exp2f((xi - max) * k) * inv_sum;
        h += q * logf(q + 1e-5f);
      });
      const double entropy = -detail::block_sum(ctx, static_cast<double>(h), scratch);
      s.log_sum = log(sum);
      const double by_entropy = static_cast<double>(a.posterior_alpha) * exp(-entropy);
      s.tau = by_entropy < static_cast<double>(a.posterior_threshold) ? by_entropy
                                                                       : static_cast<double>(a.posterior_threshold);
    }
  }
  if (ctx.thread() == 0) a.row_stats[row] = s;
}

//! Shared bytes of `select_path` for a tree of `num_nodes` nodes.
constexpr std::size_t select_path_shared_bytes(int num_nodes) noexcept {
  return static_cast<std::size_t>(num_nodes) * (sizeof(double) + sizeof(int)) + 64;
}

//! `select_path`: block x = request b.
template <verify_kind Kind, class Ctx, class Tree, class T>
MEDUSA_KERNEL_FN void select_path(Ctx& ctx, const Tree& tree, const verify_args<T>& a) {
  const int b = ctx.block_x();
  const int n = tree.num_nodes();
  const std::int32_t* tokens = a.node_tokens + static_cast<std::int64_t>(b) * n;
  const node_row_stats* stats = a.row_stats + static_cast<std::int64_t>(b) * n;
  double* score = static_cast<double*>(ctx.shared());
  int* accepted = reinterpret_cast<int*>(score + n);
  int* flags = accepted + n;  // [0] bad token, [1] non-finite row read
  if (ctx.thread() == 0) {
    flags[0] = 0;
    flags[1] = 0;
    accepted[0] = 1;
    score[0] = 0.0;
  }
  for (int u = ctx.thread(); u < n; u += ctx.threads())
    if (tokens[u] < 0 || tokens[u] >= a.vocab) flags[0] = 1;
  ctx.sync();
  if (flags[0] != 0) {
    if (ctx.thread() == 0) detail::write_failure(a, b, request_status::token_out_of_range);
    return;
  }
  const bool use_t = Kind == verify_kind::typical && a.temperature > 0.0f;
  const float inv_t = use_t ? 1.0f / a.temperature : 0.0f;
  // Level by level: a node's parent is final before the node is tested.
  for (int d = 1; d <= tree.depth(); ++d) {
    for (int u = ctx.thread(); u < n; u += ctx.threads()) {
      if (tree.node_depth(u) != d) continue;
      const int p = tree.parent(u);
      int ok = 0;
      double sc = 0.0;
      if (accepted[p] != 0) {
        const node_row_stats& s = stats[p];
        if (s.finite == 0) {
          flags[1] = 1;
        } else if (!use_t) {
          ok = tokens[u] == s.argmax ? 1 : 0;
        } else {
          const T* z = a.logits + (static_cast<std::int64_t>(b) * n + p) * a.row_stride;
          const double lq = static_cast<double>((load_float(z[tokens[u]]) - s.max) * inv_t) - s.log_sum;
          ok = exp(lq) > s.tau ? 1 : 0;
          sc = score[p] + lq;
        }
      }
      accepted[u] = ok;
      score[u] = sc;
    }
    ctx.sync();
  }
  if (ctx.thread() != 0) return;
  // The deepest level with an accepted node.
  int a_len = 0;
  for (int u = 1; u < n; ++u)
    if (accepted[u] != 0 && tree.node_depth(u) > a_len) a_len = tree.node_depth(u);
  int row = 0;
  int last = 0;
  if (a_len > 0) {
    row = -1;
    double best = 0.0;
    for (int p = 0; p < tree.num_leaves(); ++p) {
      const int u = tree.retrieve(p, a_len);
      if (u < 0 || accepted[u] == 0) continue;
      if (!use_t) {
        row = p;
        last = u;
        break;
      }
      if (row < 0 || score[u] > best) {
        row = p;
        best = score[u];
        last = u;
      }
    }
  }
  // Rows read: every accepted parent (checked above) and the final node's, for the bonus.
  if (flags[1] != 0 || stats[last].finite == 0) {
    detail::write_failure(a, b, request_status::non_finite_logit);
    return;
  }
  detail::write_path(tree, a, b, last, row, stats[last].argmax, false);
}

//! Shared bytes of `sample_path` with `threads` threads and a tree of `num_nodes` nodes.
constexpr std::size_t sample_path_shared_bytes(int threads, int num_nodes) noexcept {
  return static_cast<std::size_t>(threads) * (sizeof(double) + sizeof(int)) +
         static_cast<std::size_t>(num_nodes) * (sizeof(double) + sizeof(int)) + 64 * sizeof(double);
}

//! `sample_path`: block x = request b; rejection (`Draft` false) or speculative (`Draft` true).
template <bool Draft, class Ctx, class Tree, class T>
MEDUSA_KERNEL_FN void sample_path(Ctx& ctx, const Tree& tree, const verify_args<T>& a) {
  const int b = ctx.block_x();
  const int n = tree.num_nodes();
  const int v = a.vocab;
  const std::int32_t* tokens = a.node_tokens + static_cast<std::int64_t>(b) * n;
  // Shared: reduction scratch | per-thread chunk sums | chunk last ids | rejected m | rejected ids.
  double* scratch = static_cast<double*>(ctx.shared());
  double* chunk_sum = scratch + 64;
  double* rejected_m = chunk_sum + ctx.threads();
  int* chunk_last = reinterpret_cast<int*>(rejected_m + n);
  int* rejected = chunk_last + ctx.threads();
  int* flag = reinterpret_cast<int*>(scratch + 40);

  bool bad_token = false;
  for (int u = ctx.thread(); u < n; u += ctx.threads()) bad_token = bad_token || tokens[u] < 0 || tokens[u] >= v;
  if (detail::block_any(ctx, bad_token, flag)) {
    if (ctx.thread() == 0) detail::write_failure(a, b, request_status::token_out_of_range);
    return;
  }
  const bool sampled = a.temperature > 0.0f;
  const float k = sampled ? (1.0f / a.temperature) * 1.44269504088896341f : 0.0f;
  const std::uint64_t seed = a.seeds != nullptr ? a.seeds[b] : 0;
  const std::uint64_t step = a.steps != nullptr ? a.steps[b] : 0;
  const std::int32_t eos_token = a.eos_tokens != nullptr ? a.eos_tokens[b] : -1;
  std::uint64_t draw = 0;
  int u = 0;
  for (;;) {
    const T* z = a.logits + (static_cast<std::int64_t>(b) * n + u) * a.row_stride;
    float max = 0.0f;
    int argmax = 0;
    bool finite = true;
    detail::row_argmax(ctx, z, v, max, argmax, finite);
    if (!finite) {
      if (ctx.thread() == 0) detail::write_failure(a, b, request_status::non_finite_logit);
      return;
    }
    int num_rejected = 0;
    // The warped target, unnormalised, after the rejections so far (recomputed, never stored).
    auto residual_of = [&](float zi, int i) -> double {
      double r = sampled ? static_cast<double>(exp2f((zi - max) * k)) : (i == argmax ? 1.0 : 0.0);
      for (int j = 0; j < num_rejected; ++j) {
        if constexpr (Draft) {
          const float* q = a.draft_probs + (static_cast<std::int64_t>(b) * n + rejected[j]) * v;
          const double rq = r - rejected_m[j] * static_cast<double>(q[i]);
          r = rq > 0.0 ? rq : 0.0;
        } else if (rejected[j] == i) {
          r = 0.0;
        }
      }
      return r;
    };
    auto residual = [&](int i) { return residual_of(load_float(z[i]), i); };
    auto residual_mass = [&]() {
      double part = 0.0;
      for_each_element(ctx, z, 0, v, [&](float zi, int i) { part += residual_of(zi, i); });
      return detail::block_sum(ctx, part, scratch);
    };
    double m = residual_mass();
    int accepted = -1;
    const int cb = tree.child_begin(u);
    for (int c = cb; c < cb + tree.child_count(u); ++c) {
      const int x = tokens[c];
      const double rx = residual(x);
      const double u01 = medusa::detail::philox_uniform(seed, step, draw++);
      if constexpr (Draft) {
        const float* q = a.draft_probs + (static_cast<std::int64_t>(b) * n + c) * v;
        // The draft row must be a distribution with mass at its token.
        double q_sum = 0.0;
        bool q_bad = false;
        for (int i = ctx.thread(); i < v; i += ctx.threads()) {
          const float qi = q[i];
          q_bad = q_bad || !(qi >= 0.0f) || !is_finite(qi);
          q_sum += static_cast<double>(qi);
        }
        q_sum = detail::block_sum(ctx, q_sum, scratch);
        q_bad = detail::block_any(ctx, q_bad, flag);
        const double qx = static_cast<double>(q[x]);
        if (q_bad || fabs(q_sum - 1.0) > 1e-3 || !(qx > 0.0)) {
          if (ctx.thread() == 0) detail::write_failure(a, b, request_status::bad_draft);
          return;
        }
        if (rx > 0.0 && (rx >= m * qx || u01 * m * qx < rx)) {
          accepted = c;
          break;
        }
        double next = 0.0;
        for_each_element(ctx, z, 0, v, [&](float zi, int i) {
          const double ri = residual_of(zi, i) - m * static_cast<double>(q[i]);
          next += ri > 0.0 ? ri : 0.0;
        });
        next = detail::block_sum(ctx, next, scratch);
        // The barrier stays outside the branch, so no compiler can see it in divergent code.
        if (next > 0.0 && ctx.thread() == 0) {
          rejected[num_rejected] = c;
          rejected_m[num_rejected] = m;
        }
        ctx.sync();
        if (next > 0.0) {
          ++num_rejected;
          m = next;
        }
      } else {
        if (rx > 0.0 && (rx >= m || u01 * m < rx)) {
          accepted = c;
          break;
        }
        if (ctx.thread() == 0) rejected[num_rejected] = x;
        ctx.sync();
        ++num_rejected;
        m -= rx;
        // Rounding left no mass (every thread sees the same m): restore the exact remainder.
        if (!(m > 0.0)) m = residual_mass();
      }
    }
    if (accepted < 0) {
      // Bonus: inverse CDF over ascending ids. Each thread sums a contiguous chunk; thread 0 finds
      // the chunk holding the target; that thread walks it.
      const double target = medusa::detail::philox_uniform(seed, step, draw++) * m;
      const int chunk = (v + ctx.threads() - 1) / ctx.threads();
      const int lo = ctx.thread() * chunk;
      const int hi = lo + chunk < v ? lo + chunk : v;
      double sum = 0.0;
      int last_positive = -1;
      for (int i = lo; i < hi; ++i) {
        const double r = residual(i);
        if (r > 0.0) {
          sum += r;
          last_positive = i;
        }
      }
      chunk_sum[ctx.thread()] = sum;
      chunk_last[ctx.thread()] = last_positive;
      ctx.sync();
      if (ctx.thread() == 0) {
        double before = 0.0;
        int owner = -1;
        int overall_last = -1;
        for (int t = 0; t < ctx.threads(); ++t) {
          if (chunk_last[t] >= 0) overall_last = chunk_last[t];
          if (owner < 0 && target < before + chunk_sum[t]) {
            owner = t;
            scratch[0] = before;
          }
          if (owner < 0) before += chunk_sum[t];
        }
        flag[0] = owner;
        flag[1] = overall_last;
      }
      ctx.sync();
      const int owner = flag[0];
      if (owner < 0) {  // rounding: the mass ran out before the target
        if (ctx.thread() == 0) detail::write_path(tree, a, b, u, 0, flag[1], false);
      } else if (ctx.thread() == owner) {
        double acc = scratch[0];
        int token = -1;
        for (int i = lo; i < hi; ++i) {
          const double r = residual(i);
          if (r <= 0.0) continue;
          acc += r;
          token = i;
          if (target < acc) break;
        }
        detail::write_path(tree, a, b, u, 0, token, false);
      }
      break;
    }
    u = accepted;
    if (tokens[u] == eos_token) {
      if (ctx.thread() == 0) detail::write_path(tree, a, b, u, 0, -1, true);
      break;
    }
  }
  ctx.sync();
  // Reference-compatible row: the first leaf row through the final node.
  if (ctx.thread() == 0) {
    const int length = a.accept_length[b];
    const int last = a.next_node[b];
    for (int p = 0; p < tree.num_leaves(); ++p) {
      if (tree.retrieve(p, length) == last) {
        a.best_row[b] = p;
        break;
      }
    }
  }
}

//! Launch shapes and workspace of a verify.
struct verify_plan {
  verify_kind kind = verify_kind::greedy;
  int batch = 0;
  int num_nodes = 0;
  int vocab = 0;
  launch_shape rows;  //!< node-test policies: `node_rows` over B × N rows
  launch_shape path;  //!< `select_path` or `sample_path`: one block per request
  std::size_t workspace_bytes = 0;
};

//! Plans a verify of `batch` requests of a tree with `num_nodes` nodes (depth `depth`) over
//! `vocab`. `top_k` / `top_p` are the sampling warp's filters: the kernels implement the
//! temperature only, so a filter that is on is refused.
//! @throws launch_error `invalid_shape` (batch, vocab, nodes), `unsupported` (top-k / top-p warps,
//!         trees over 256 nodes, depth over 63).
inline verify_plan plan_verify(verify_kind kind, int batch, int num_nodes, int depth, int vocab,
                               float temperature = 0.0f, int top_k = 0, float top_p = 1.0f) {
  if (batch < 1 || vocab < 1 || num_nodes < 1 || depth < 0 || depth >= num_nodes)
    throw launch_error(launch_errc::invalid_shape,
                       "verify: need batch >= 1, vocab >= 1 and a tree, got batch " + std::to_string(batch) +
                           ", vocab " + std::to_string(vocab) + ", nodes " + std::to_string(num_nodes));
  if (num_nodes > 256 || depth > 63)
    throw launch_error(launch_errc::unsupported,
                       "verify: trees of up to 256 nodes and depth 63, got " + std::to_string(num_nodes) +
                           " nodes of depth " + std::to_string(depth));
  if (!(temperature >= 0.0f) || !std::isfinite(temperature))
    throw launch_error(launch_errc::invalid_shape,
                       "verify: temperature must be finite and >= 0, got " + std::to_string(temperature));
  const bool sampling = kind == verify_kind::rejection || kind == verify_kind::speculative;
  if (sampling && ((top_k > 0 && top_k < vocab) || top_p < 1.0f))
    throw launch_error(launch_errc::unsupported,
                       "verify: the CUDA sampling kernels apply the temperature only; top_k " +
                           std::to_string(top_k) + " / top_p " + std::to_string(top_p) +
                           " filters run on the CPU policies");
  verify_plan p;
  p.kind = kind;
  p.batch = batch;
  p.num_nodes = num_nodes;
  p.vocab = vocab;
  const int row_threads =
      std::clamp((vocab / 16 + warp_size - 1) / warp_size * warp_size, warp_size, verify_row_threads_max);
  const int walk_threads =
      std::clamp((vocab / 16 + warp_size - 1) / warp_size * warp_size, warp_size, verify_walk_threads_max);
  if (!sampling) {
    p.rows = {.grid_x = batch * num_nodes, .grid_y = 1, .threads = row_threads,
              .shared_bytes = block_merge_shared_bytes(1) + 64 * sizeof(double)};
    const int path_threads = std::clamp((num_nodes + warp_size - 1) / warp_size * warp_size, warp_size, 256);
    p.path = {.grid_x = batch, .grid_y = 1, .threads = path_threads,
              .shared_bytes = select_path_shared_bytes(num_nodes)};
    p.workspace_bytes = workspace_carver::round_up(static_cast<std::size_t>(batch) *
                                                   static_cast<std::size_t>(num_nodes) * sizeof(node_row_stats));
  } else {
    p.path = {.grid_x = batch, .grid_y = 1, .threads = walk_threads,
              .shared_bytes = std::max(sample_path_shared_bytes(walk_threads, num_nodes), block_merge_shared_bytes(1))};
  }
  return p;
}

//! Points the row statistics of `a` into `workspace`; false if it is too short.
template <class T>
bool bind_verify_workspace(const verify_plan& p, verify_args<T>& a, void* workspace, std::size_t bytes) {
  a.batch = p.batch;
  a.vocab = p.vocab;
  if (p.workspace_bytes == 0) return true;
  workspace_carver carve(workspace, bytes);
  a.row_stats = carve.take<node_row_stats>(static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.num_nodes));
  return carve.ok();
}

}  // namespace kernels
}  // namespace cuda
MEDUSA_NAMESPACE_END
