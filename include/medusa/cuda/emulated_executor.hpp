// SPDX-License-Identifier: Apache-2.0
//! @file cuda/emulated_executor.hpp
//! The `device_step` executor of CI: host memory, every kernel body under the host emulation
//! (<medusa/cuda/emulation.hpp>), the step kernels planned as `step_kernels` plans them, the CPU
//! `head_stack` for the heads, and "graphs" that run the recorded function again. It needs no CUDA
//! toolkit. An engine derives from it to add its forward's GEMMs and attention (see executor.hpp).
//!
//! @code
//! medusa::cuda::emulated_executor ex;
//! medusa::cuda::device_step<medusa::cuda::emulated_executor, float> step(ex, tree, heads);
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/emulation.hpp>
#include <medusa/cuda/executor.hpp>
#include <medusa/cuda/kernels/gather.hpp>
#include <medusa/cuda/kernels/kv_commit.hpp>
#include <medusa/cuda/kernels/top_k.hpp>
#include <medusa/cuda/kernels/tree_arrays.hpp>
#include <medusa/cuda/kernels/verify.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/gemm.hpp>
#include <medusa/heads.hpp>
#include <medusa/tree.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <new>
#include <span>
#include <stdexcept>
#include <utility>
#include <vector>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

//! Runs a device step on the host (see the file comment); counts launches and allocations.
class emulated_executor {
 public:
  void* alloc(std::size_t bytes) {
    ++allocations_;
    return ::operator new(bytes, std::align_val_t{256});
  }
  void release(void* p) noexcept { ::operator delete(p, std::align_val_t{256}); }
  void upload(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
  void download(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }
  void fill_zero(void* dst, std::size_t bytes) { std::memset(dst, 0, bytes); }
  void sync() {}

  //! Runs `body(ctx)` over `shape` under the emulation.
  template <class Body>
  void launch(const launch_shape& shape, const Body& body) {
    ++launches_;
    emulate(shape, [&](auto& ctx) { body(ctx); });
  }

  //! Candidates and greedy verification of `batch` requests over a run-time tree with `heads` heads.
  struct step_op {
    int batch = 0, vocab = 0, heads = 0, k = 0;
    kernels::top_k_plan top_k;
    launch_shape gather;
    kernels::verify_plan verify;
    std::vector<int> packed;  // pack_tree
    tree_arrays tree;
    std::size_t ids_bytes = 0;
    std::vector<unsigned char> workspace;  // head top-k ids, then the top-k or verify scratch
  };
  step_op make_step_op(const medusa::tree& t, int heads, int batch, int vocab) {
    step_op op;
    op.batch = batch;
    op.vocab = vocab;
    op.heads = heads;
    for (int d = 1; d <= t.depth(); ++d) op.k = std::max(op.k, t.max_rank(d) + 1);
    op.packed = pack_tree(t);
    op.tree = tree_arrays::over(t, op.packed.data());
    op.top_k = kernels::plan_top_k(batch * heads, vocab, op.k);
    op.gather = kernels::plan_gather(op.tree, batch, heads, op.k);
    op.verify = kernels::plan_verify(kernels::verify_kind::greedy, batch, t.num_nodes(), t.depth(), vocab);
    op.ids_bytes = workspace_carver::round_up(static_cast<std::size_t>(batch * heads * op.k) * 4);
    op.workspace.resize(op.ids_bytes + std::max(op.top_k.workspace_bytes, op.verify.workspace_bytes));
    return op;
  }
  void candidates(step_op& op, const float* head_logits, const std::int32_t* roots, const std::int32_t* lengths,
                  std::int32_t* node_tokens, std::int32_t* positions, std::int32_t* status) {
    auto* ids = reinterpret_cast<std::int32_t*>(op.workspace.data());
    kernels::top_k_args<float> a;
    a.logits = head_logits;
    a.row_stride = op.vocab;
    a.out_ids = ids;
    a.status = status;
    a.rows_per_status = op.heads;
    if (!kernels::bind_top_k_workspace(op.top_k, a, op.workspace.data() + op.ids_bytes, op.workspace.size() - op.ids_bytes))
      throw std::logic_error("emulated executor: top-k workspace too small");
    kernels::with_top_k_bucket(op.top_k.bucket, [&](auto bucket) {
      constexpr int K = decltype(bucket)::value;
      launch(op.top_k.scan, [&](auto& ctx) { kernels::top_k_scan<K>(ctx, a); });
      if (op.top_k.splits > 1) launch(op.top_k.merge, [&](auto& ctx) { kernels::top_k_merge_splits<K>(ctx, a); });
    });
    const kernels::gather_args g{.batch = op.batch, .heads = op.heads, .k_stride = op.k, .roots = roots, .head_top_k = ids,
                                 .lengths = lengths, .node_tokens = node_tokens, .positions = positions};
    launch(op.gather, [&](auto& ctx) { kernels::gather_candidates(ctx, op.tree, g); });
  }
  void verify(step_op& op, kernels::verify_args<float> a) {
    if (!kernels::bind_verify_workspace(op.verify, a, op.workspace.data() + op.ids_bytes, op.workspace.size() - op.ids_bytes))
      throw std::logic_error("emulated executor: verify workspace too small");
    launch(op.verify.rows, [&](auto& ctx) { kernels::node_rows<kernels::verify_kind::greedy>(ctx, a); });
    launch(op.verify.path, [&](auto& ctx) { kernels::select_path<kernels::verify_kind::greedy>(ctx, op.tree, a); });
  }

  //! Argmax of rows (top-k with k = 1: ties to the lower id, status on non-finite rows).
  struct argmax_op {
    kernels::top_k_plan plan;
    std::vector<unsigned char> workspace;
  };
  argmax_op make_argmax_op(int rows, int vocab) {
    argmax_op op;
    op.plan = kernels::plan_top_k(rows, vocab, 1);
    op.workspace.resize(op.plan.workspace_bytes);
    return op;
  }
  void argmax(argmax_op& op, const float* logits, std::int32_t* ids, std::int32_t* status) {
    kernels::top_k_args<float> a = detail::argmax_args(op.plan.vocab, logits, ids, status);
    if (!kernels::bind_top_k_workspace(op.plan, a, op.workspace.data(), op.workspace.size()))
      throw std::logic_error("emulated executor: argmax workspace too small");
    launch(op.plan.scan, [&](auto& ctx) { kernels::top_k_scan<1>(ctx, a); });
    if (op.plan.splits > 1) launch(op.plan.merge, [&](auto& ctx) { kernels::top_k_merge_splits<1>(ctx, a); });
  }

  //! The heads on the CPU (`head_stack::forward`, float) for hidden states given in T.
  template <class T>
  struct heads_op {
    medusa::head_stack<> stack;
    int rows = 0;
    std::vector<float> hidden;
  };
  template <class T>
  heads_op<T> make_heads_op(const medusa::head_stack<>& stack, int rows) {
    return {stack, rows, std::vector<float>(static_cast<std::size_t>(rows) * stack.hidden_size())};
  }
  template <class T>
  void heads(heads_op<T>& op, const T* hidden, float* logits) {
    for (std::size_t i = 0; i < op.hidden.size(); ++i) op.hidden[i] = load_float(hidden[i]);
    medusa::portable_gemm gemm;
    const std::size_t n = static_cast<std::size_t>(op.rows) * op.stack.num_heads() * op.stack.vocab_size();
    op.stack.forward(gemm, op.hidden, static_cast<std::size_t>(op.rows), std::span<float>(logits, n));
  }

  void kv_commit(const kernels::kv_commit_params& params) {
    const kernels::kv_commit_plan plan = kernels::plan_kv_commit(params);
    launch(plan.shape, [&](auto& ctx) { kernels::kv_commit(ctx, params); });
  }

  //! A recorded sequence: replaying it runs the function again.
  using graph = std::function<void()>;
  template <class F>
  graph capture(F&& f) {
    return graph(std::forward<F>(f));
  }
  void replay(const graph& g) { g(); }

  [[nodiscard]] long long launches() const noexcept { return launches_; }        //!< bodies launched so far
  [[nodiscard]] long long allocations() const noexcept { return allocations_; }  //!< `alloc` calls so far

 private:
  long long launches_ = 0, allocations_ = 0;
};

}  // namespace cuda
MEDUSA_NAMESPACE_END
