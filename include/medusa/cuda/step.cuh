// SPDX-License-Identifier: Apache-2.0
//! @file cuda/step.cuh
//! The non-model kernels of a Medusa step on the GPU, for a batch of requests sharing one tree:
//! candidates (per-head top-k, then the gather of tree tokens and positions) and verification
//! (greedy, typical, rejection, speculative). The KV commit is `kv_commit.cuh`, the heads
//! `heads.cuh`. docs/cuda.md shows how an engine chains them into its step.
//!
//! `step_kernels<Tree, T>` is instantiated per tree shape and logit type: `Tree` is a compile-time
//! tree tag (`medusa::presets::tag<I>`; the tree then travels as a kernel parameter, in the
//! constant bank) or `runtime_tree` (any other tree, its arrays in device memory, see
//! `tree_arrays.hpp`). The head count is a field of the plan: no kernel depends on it. The library
//! target `medusa::cuda_kernels` holds the explicit instantiations for the 9 presets and
//! `runtime_tree` × f32/bf16/f16 logits (`step_instances.cuh`).
//!
//! @code
//! using tag = medusa::presets::tag_of<"mc_sim_7b_63">;
//! using kernels = medusa::cuda::step_kernels<tag, medusa::bfloat16>;
//! auto plan = kernels::plan(batch, /*heads*/ 4, vocab, medusa::cuda::kernels::verify_kind::greedy);
//! // workspace: plan.workspace_bytes, allocated once by the engine
//! kernels::verify(plan, {}, verify_args, workspace, plan.workspace_bytes, stream);
//! kernels::candidates(plan, {}, head_logits, roots, lengths, node_tokens, positions, status,
//!                     workspace, plan.workspace_bytes, stream);
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/kernels/gather.hpp>
#include <medusa/cuda/kernels/top_k.hpp>
#include <medusa/cuda/kernels/tree_arrays.hpp>
#include <medusa/cuda/kernels/verify.hpp>
#include <medusa/cuda/launch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

//! The tree tag of `step_kernels` for trees known only at run time.
struct runtime_tree {};

//! What the kernels of tree tag `Tree` read: a `fixed_tree`, or `tree_arrays` for `runtime_tree`.
template <class Tree>
struct kernel_tree_for {
  using type = decltype(fixed_tree_of<Tree>());
};
template <>
struct kernel_tree_for<runtime_tree> {
  using type = tree_arrays;
};

namespace detail {

template <int K, class T>
__global__ void __launch_bounds__(kernels::top_k_threads_max) top_k_scan_kernel(kernels::top_k_args<T> a) {
  device_context ctx;
  kernels::top_k_scan<K>(ctx, a);
}

template <int K, class T>
__global__ void __launch_bounds__(kernels::top_k_threads_max) top_k_merge_kernel(kernels::top_k_args<T> a) {
  device_context ctx;
  kernels::top_k_merge_splits<K>(ctx, a);
}

template <class Tree>
__global__ void gather_kernel(const Tree tree, kernels::gather_args a) {
  device_context ctx;
  kernels::gather_candidates(ctx, tree, a);
}

template <kernels::verify_kind Kind, class T>
__global__ void __launch_bounds__(kernels::verify_row_threads_max) node_rows_kernel(kernels::verify_args<T> a) {
  device_context ctx;
  kernels::node_rows<Kind>(ctx, a);
}

template <kernels::verify_kind Kind, class Tree, class T>
__global__ void select_path_kernel(const Tree tree, kernels::verify_args<T> a) {
  device_context ctx;
  kernels::select_path<Kind>(ctx, tree, a);
}

template <bool Draft, class Tree, class T>
__global__ void __launch_bounds__(kernels::verify_walk_threads_max, 1) sample_path_kernel(const Tree tree, kernels::verify_args<T> a) {
  device_context ctx;
  kernels::sample_path<Draft>(ctx, tree, a);
}

inline dim3 grid_of(const launch_shape& s) {
  return {static_cast<unsigned>(s.grid_x), static_cast<unsigned>(s.grid_y), 1u};
}

}  // namespace detail

//! Top-k of `plan.rows` rows (`a.logits`, `a.row_stride`, `a.out_ids`, optional `a.out_values`,
//! `a.status`, `a.rows_per_status` set by the caller; the rest comes from the plan). Never
//! allocates or synchronises.
//! @return cudaErrorInvalidValue (nothing launched) on null pointers or a short workspace.
template <class T>
cudaError_t run_top_k(const kernels::top_k_plan& plan, kernels::top_k_args<T> a, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream) {
  if (a.logits == nullptr || a.out_ids == nullptr || a.row_stride < plan.vocab || a.rows_per_status < 1)
    return cudaErrorInvalidValue;
  if (!kernels::bind_top_k_workspace(plan, a, workspace, workspace_bytes)) return cudaErrorInvalidValue;
  return kernels::with_top_k_bucket(plan.bucket, [&](auto bucket) -> cudaError_t {
    constexpr int K = decltype(bucket)::value;
    detail::top_k_scan_kernel<K, T>
        <<<detail::grid_of(plan.scan), plan.scan.threads, plan.scan.shared_bytes, stream>>>(a);
    if (plan.splits > 1)
      detail::top_k_merge_kernel<K, T>
          <<<detail::grid_of(plan.merge), plan.merge.threads, plan.merge.shared_bytes, stream>>>(a);
    return cudaGetLastError();
  });
}

//! Launches the candidate gather over the kernel form of a tree (`fixed_tree` or `tree_arrays`).
template <class KernelTree>
cudaError_t run_gather(const KernelTree& tree, const launch_shape& shape, const kernels::gather_args& a,
                       cudaStream_t stream) {
  if (a.roots == nullptr || a.head_top_k == nullptr || a.node_tokens == nullptr ||
      (a.positions != nullptr && a.lengths == nullptr))
    return cudaErrorInvalidValue;
  detail::gather_kernel<KernelTree><<<detail::grid_of(shape), shape.threads, 0, stream>>>(tree, a);
  return cudaGetLastError();
}

//! Launches the verification of `plan` over the kernel form of a tree. The caller sets the data
//! and output pointers of `a`; the plan sets the sizes and the workspace.
template <class KernelTree, class T>
cudaError_t run_verify(const kernels::verify_plan& plan, const KernelTree& tree, kernels::verify_args<T> a,
                       void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  using kernels::verify_kind;
  if (a.logits == nullptr || a.node_tokens == nullptr || a.row_stride < plan.vocab ||
      a.path_stride < tree.depth() + 1 || a.accept_length == nullptr || a.next_node == nullptr ||
      a.bonus == nullptr || a.eos == nullptr || a.best_row == nullptr || a.path_nodes == nullptr ||
      a.path_tokens == nullptr || a.status == nullptr || tree.num_nodes() != plan.num_nodes)
    return cudaErrorInvalidValue;
  if (plan.kind == verify_kind::speculative && a.draft_probs == nullptr) return cudaErrorInvalidValue;
  if (!kernels::bind_verify_workspace(plan, a, workspace, workspace_bytes)) return cudaErrorInvalidValue;
  const dim3 rows = detail::grid_of(plan.rows);
  const dim3 path = detail::grid_of(plan.path);
  switch (plan.kind) {
    case verify_kind::greedy:
      detail::node_rows_kernel<verify_kind::greedy, T><<<rows, plan.rows.threads, plan.rows.shared_bytes, stream>>>(a);
      detail::select_path_kernel<verify_kind::greedy, KernelTree, T>
          <<<path, plan.path.threads, plan.path.shared_bytes, stream>>>(tree, a);
      break;
    case verify_kind::typical:
      detail::node_rows_kernel<verify_kind::typical, T><<<rows, plan.rows.threads, plan.rows.shared_bytes, stream>>>(a);
      detail::select_path_kernel<verify_kind::typical, KernelTree, T>
          <<<path, plan.path.threads, plan.path.shared_bytes, stream>>>(tree, a);
      break;
    case verify_kind::rejection:
      detail::sample_path_kernel<false, KernelTree, T><<<path, plan.path.threads, plan.path.shared_bytes, stream>>>(tree, a);
      break;
    case verify_kind::speculative:
      detail::sample_path_kernel<true, KernelTree, T><<<path, plan.path.threads, plan.path.shared_bytes, stream>>>(tree, a);
      break;
  }
  return cudaGetLastError();
}

//! The candidate and verification launchers of one tree shape and logit type.
//! @tparam Tree a compile-time tree tag (with a `static constexpr` `tree`) or `runtime_tree`
//! @tparam T logits: float, medusa::half or medusa::bfloat16
template <class Tree, class T>
class step_kernels {
  static constexpr bool is_static = !std::is_same_v<Tree, runtime_tree>;

 public:
  //! What kernels read: a `fixed_tree` for a tag, `tree_arrays` (device pointer) at run time.
  using kernel_tree = typename kernel_tree_for<Tree>::type;

  //! Sizes, launch shapes and workspace of one step's candidate and verification kernels.
  struct plan_type {
    int batch = 0;
    int heads = 0;  //!< Medusa heads: rows per request in `candidates`' head logits
    int vocab = 0;
    int k = 0;  //!< ids kept per head row: the tree's largest rank + 1
    kernels::top_k_plan top_k;
    launch_shape gather;
    kernels::verify_plan verify;
    std::size_t workspace_bytes = 0;  //!< for `candidates` (head top-k ids first) and `verify`
  };

  //! Plans a step for `batch` requests with `heads` Medusa heads over `vocab`. For `runtime_tree`,
  //! `shape` is the tree as the host reads it (the CPU `medusa::tree`, or `tree_arrays` over host
  //! memory); a compile-time tree ignores it. `temperature`, `top_k`, `top_p` are the policy's
  //! warp.
  //! @throws launch_error `invalid_shape` for fewer than 1 head or fewer heads than the tree's
  //! depth, and on bad sizes or unsupported warps (see `plan_top_k`, `plan_verify`).
  template <class HostTree = kernel_tree>
  static plan_type plan(int batch, int heads, int vocab, kernels::verify_kind kind,
                        const HostTree& shape = {}, float temperature = 0.0f, int top_k = 0,
                        float top_p = 1.0f, int target_blocks = 528) {
    if constexpr (is_static)
      return plan_for(static_kernel_tree(), batch, heads, vocab, kind, temperature, top_k, top_p,
                      target_blocks);
    else
      return plan_for(shape, batch, heads, vocab, kind, temperature, top_k, top_p, target_blocks);
  }

 private:
  template <class HostTree>
  static plan_type plan_for(const HostTree& t, int batch, int heads, int vocab,
                            kernels::verify_kind kind, float temperature, int top_k, float top_p,
                            int target_blocks) {
    if (heads < 1)
      throw launch_error(launch_errc::invalid_shape,
                         "step: the head count must be at least 1, got " + std::to_string(heads));
    if (t.num_nodes() < 2)
      throw launch_error(launch_errc::invalid_shape, "step: the run-time tree is empty (build tree_arrays::over)");
    if (heads < t.depth())
      throw launch_error(launch_errc::invalid_shape,
                         "step: a depth-" + std::to_string(t.depth()) + " tree needs " +
                             std::to_string(t.depth()) + " heads, the plan has " +
                             std::to_string(heads));
    if (batch < 1 || heads > std::numeric_limits<int>::max() / batch)
      throw launch_error(
          launch_errc::invalid_shape,
          "step: need batch >= 1 and batch × heads head rows within an int, got batch " +
              std::to_string(batch) + ", heads " + std::to_string(heads));
    plan_type p;
    p.batch = batch;
    p.heads = heads;
    p.vocab = vocab;
    for (int d = 1; d <= t.depth(); ++d) p.k = std::max(p.k, t.max_rank(d) + 1);
    p.top_k = kernels::plan_top_k(batch * heads, vocab, p.k, target_blocks);
    p.gather = kernels::plan_gather(t, batch, heads, p.k);
    p.verify = kernels::plan_verify(kind, batch, t.num_nodes(), t.depth(), vocab, temperature, top_k, top_p);
    p.workspace_bytes = head_ids_bytes(p) + std::max(p.top_k.workspace_bytes, p.verify.workspace_bytes);
    return p;
  }

 public:
  //! Next step's candidates: top-k of each head row (`head_logits` `[B][heads][vocab]`, rows
  //! `head_row_stride` apart), then the tree tokens `[B][N]` and positions `[B][N]` (`L + depth`)
  //! from `roots[B]` (the bonus tokens) and `lengths[B]`. `status[B]` gets `non_finite_logit` for
  //! a request with NaN/Inf head logits (it is not cleared: `verify` writes it first in a step).
  static cudaError_t candidates(const plan_type& p, const kernel_tree& tree, const T* head_logits,
                                std::int64_t head_row_stride, const std::int32_t* roots, const std::int32_t* lengths,
                                std::int32_t* node_tokens, std::int32_t* positions, std::int32_t* status,
                                void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

  //! Verifies the batch (see `verify_args` for the inputs and outputs the caller points to).
  static cudaError_t verify(const plan_type& p, const kernel_tree& tree, const kernels::verify_args<T>& a,
                            void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

 private:
  static std::size_t head_ids_bytes(const plan_type& p) {
    return workspace_carver::round_up(static_cast<std::size_t>(p.batch) *
                                      static_cast<std::size_t>(p.heads) *
                                      static_cast<std::size_t>(p.k) * sizeof(std::int32_t));
  }
  static const kernel_tree& static_kernel_tree() {
    if constexpr (is_static) {
      static constexpr kernel_tree fixed = fixed_tree_of<Tree>();
      return fixed;
    } else {
      static const kernel_tree none{};
      return none;
    }
  }
  static const kernel_tree& tree_of(const kernel_tree& given) {
    if constexpr (is_static)
      return static_kernel_tree();
    else
      return given;
  }
};

// Out of the class, so that `extern template class` (step_instances.cuh) keeps a translation
// unit from instantiating them and the kernels they launch: members defined in the class are
// inline, which an explicit instantiation declaration does not cover.
template <class Tree, class T>
cudaError_t step_kernels<Tree, T>::candidates(const plan_type& p, const kernel_tree& tree, const T* head_logits,
                                              std::int64_t head_row_stride, const std::int32_t* roots,
                                              const std::int32_t* lengths, std::int32_t* node_tokens,
                                              std::int32_t* positions, std::int32_t* status, void* workspace,
                                              std::size_t workspace_bytes, cudaStream_t stream) {
  if (workspace == nullptr || workspace_bytes < p.workspace_bytes) return cudaErrorInvalidValue;
  auto* ids = static_cast<std::int32_t*>(workspace);
  kernels::top_k_args<T> a;
  a.logits = head_logits;
  a.row_stride = head_row_stride;
  a.out_ids = ids;
  a.status = status;
  a.rows_per_status = p.heads;
  const std::size_t used = head_ids_bytes(p);
  if (const cudaError_t e = run_top_k(p.top_k, a, static_cast<unsigned char*>(workspace) + used,
                                      workspace_bytes - used, stream);
      e != cudaSuccess)
    return e;
  kernels::gather_args g{.batch = p.batch,
                         .heads = p.heads,
                         .k_stride = p.k,
                         .roots = roots,
                         .head_top_k = ids,
                         .lengths = lengths,
                         .node_tokens = node_tokens,
                         .positions = positions};
  return run_gather(tree_of(tree), p.gather, g, stream);
}

template <class Tree, class T>
cudaError_t step_kernels<Tree, T>::verify(const plan_type& p, const kernel_tree& tree,
                                          const kernels::verify_args<T>& a, void* workspace,
                                          std::size_t workspace_bytes, cudaStream_t stream) {
  if (workspace == nullptr && p.workspace_bytes > 0) return cudaErrorInvalidValue;
  if (workspace_bytes < p.workspace_bytes) return cudaErrorInvalidValue;
  const std::size_t used = head_ids_bytes(p);
  return run_verify(p.verify, tree_of(tree), a, static_cast<unsigned char*>(workspace) + used,
                    workspace_bytes - used, stream);
}

}  // namespace cuda
MEDUSA_NAMESPACE_END
