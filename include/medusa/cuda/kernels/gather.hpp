// SPDX-License-Identifier: Apache-2.0
//! @file cuda/kernels/gather.hpp
//! Candidate gather: each request's tree tokens and positions from its root token and its heads'
//! top-k ids, as `medusa::generate_candidates` and `write_node_positions` do on the CPU:
//! `token[u] = u == 0 ? root : top_k[head = depth(u) - 1][rank(u)]`, `position[u] = L + depth(u)`.
//! One thread per (request, node): block y = request.
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/launch.hpp>

#include <cstdint>
#include <string>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {
namespace kernels {

//! Arguments of the gather for a batch of requests.
struct gather_args {
  int batch = 0;                        //!< B
  int heads = 0;                        //!< H ≥ the tree's depth
  int k_stride = 0;                     //!< ids per head row in `head_top_k` (≥ the tree's max rank + 1)
  const std::int32_t* roots = nullptr;  //!< [B] each request's root (the last bonus token)
  const std::int32_t* head_top_k = nullptr;  //!< [B][H][k_stride], best first
  const std::int32_t* lengths = nullptr;     //!< [B] committed length L of each request
  std::int32_t* node_tokens = nullptr;       //!< [B][N] out
  std::int32_t* positions = nullptr;         //!< [B][N] out (L + depth), or nullptr
};

//! Block (x, y = request): nodes x·threads + thread.
template <class Ctx, class Tree>
MEDUSA_KERNEL_FN void gather_candidates(Ctx& ctx, const Tree& tree, const gather_args& a) {
  const int b = ctx.block_y();
  const int n = tree.num_nodes();
  const int u = ctx.block_x() * ctx.threads() + ctx.thread();
  if (u >= n) return;
  std::int32_t token = a.roots[b];
  if (u > 0) {
    const int head = tree.node_depth(u) - 1;
    token = a.head_top_k[(static_cast<std::int64_t>(b) * a.heads + head) * a.k_stride + tree.rank(u)];
  }
  a.node_tokens[static_cast<std::int64_t>(b) * n + u] = token;
  if (a.positions != nullptr) a.positions[static_cast<std::int64_t>(b) * n + u] = a.lengths[b] + tree.node_depth(u);
}

//! Launch shape of the gather.
//! @throws launch_error `invalid_shape` (batch < 1, heads below the tree's depth, k_stride below
//!         what the tree reads).
template <class Tree>
launch_shape plan_gather(const Tree& tree, int batch, int heads, int k_stride) {
  if (batch < 1 || heads < tree.depth() || k_stride < tree.max_rank(1) + 1)
    throw launch_error(launch_errc::invalid_shape,
                       "gather: need batch >= 1, heads >= tree depth " + std::to_string(tree.depth()) +
                           " and k_stride >= " + std::to_string(tree.max_rank(1) + 1) + ", got batch " +
                           std::to_string(batch) + ", heads " + std::to_string(heads) + ", k_stride " +
                           std::to_string(k_stride));
  for (int d = 1; d <= tree.depth(); ++d)
    if (tree.max_rank(d) + 1 > k_stride)
      throw launch_error(launch_errc::invalid_shape,
                         "gather: depth " + std::to_string(d) + " reads rank " + std::to_string(tree.max_rank(d)) +
                             " but the head rows keep " + std::to_string(k_stride) + " ids");
  const int threads = tree.num_nodes() >= 128 ? 128 : (tree.num_nodes() + warp_size - 1) / warp_size * warp_size;
  return {.grid_x = (tree.num_nodes() + threads - 1) / threads, .grid_y = batch, .threads = threads};
}

}  // namespace kernels
}  // namespace cuda
MEDUSA_NAMESPACE_END
