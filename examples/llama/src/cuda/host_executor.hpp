// SPDX-License-Identifier: Apache-2.0
// Private: the executor of forward.hpp and step.hpp on the host, for CI: memory is host memory,
// kernel bodies run under the kernel emulation (<medusa/cuda/emulation.hpp>), GEMMs are plain
// float loops, the heads are the CPU `head_stack`. It runs every line of the GPU engine's pass
// and step except the cuBLAS calls and the graph capture, which only a device can run.
#pragma once

#include <medusa/cuda/emulation.hpp>
#include <medusa/cuda/kernels/attention.hpp>
#include <medusa/cuda/kernels/gather.hpp>
#include <medusa/cuda/kernels/kv_commit.hpp>
#include <medusa/cuda/kernels/top_k.hpp>
#include <medusa/cuda/kernels/verify.hpp>
#include <medusa/cuda/kernels/tree_arrays.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/gemm.hpp>
#include <medusa/half.hpp>
#include <medusa/heads.hpp>
#include <medusa/tree.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <new>
#include <stdexcept>
#include <vector>

namespace medusa_llama::cuda_detail {

class host_executor {
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

  template <class Body>
  void launch(const medusa::cuda::launch_shape& shape, const Body& body) {
    ++launches_;
    medusa::cuda::emulate(shape, [&](auto& ctx) { body(ctx); });
  }

  // Y[rows][n_out] (+)= X[rows][k] · W[n_out][k]ᵀ, float accumulation in order of k: every row is
  // computed the same way whatever the number of rows (as the device's pinned algorithms are).
  template <class T>
  void gemm(const T* w, const T* x, float* y, int n_out, int rows, int k, bool accumulate) {
    ++gemms_;
    for (int r = 0; r < rows; ++r) {
      const T* xr = x + static_cast<std::size_t>(r) * static_cast<std::size_t>(k);
      float* yr = y + static_cast<std::size_t>(r) * static_cast<std::size_t>(n_out);
      for (int o = 0; o < n_out; ++o) {
        const T* wo = w + static_cast<std::size_t>(o) * static_cast<std::size_t>(k);
        float s = 0.0f;
        for (int i = 0; i < k; ++i) s += medusa::cuda::load_float(xr[i]) * medusa::cuda::load_float(wo[i]);
        yr[o] = accumulate ? yr[o] + s : s;
      }
    }
  }

  template <class KV, class O>
  void attention(const medusa::cuda::kernels::attention_plan& plan, medusa::cuda::kernels::attention_params<KV, O> a,
                 void* workspace, std::size_t bytes) {
    namespace mk = medusa::cuda::kernels;
    mk::check_attention_args(plan, a);
    if (!mk::bind_attention_workspace(plan, a, workspace, bytes))
      throw std::logic_error("host executor: attention workspace too small");
    medusa::cuda::emulate(plan.main, [&](auto& ctx) { mk::attention_main(ctx, plan, a); });
    if (plan.splits > 1) medusa::cuda::emulate(plan.merge, [&](auto& ctx) { mk::attention_merge(ctx, plan, a); });
  }

  // --- the Medusa step's library kernels, planned as `medusa::cuda::step_kernels` plans them ----

  // Candidates and greedy verification of `batch` requests over a run-time tree with `heads` heads.
  struct step_op {
    int batch = 0, vocab = 0, heads = 0, k = 0;
    medusa::cuda::kernels::top_k_plan top_k;
    medusa::cuda::launch_shape gather;
    medusa::cuda::kernels::verify_plan verify;
    std::vector<int> packed;  // pack_tree
    medusa::cuda::tree_arrays tree;
    std::size_t ids_bytes = 0;
    std::vector<unsigned char> workspace;  // head top-k ids, then the top-k or verify scratch
  };
  step_op make_step_op(const medusa::tree& t, int heads, int batch, int vocab) {
    namespace mk = medusa::cuda::kernels;
    step_op op;
    op.batch = batch;
    op.vocab = vocab;
    op.heads = heads;
    for (int d = 1; d <= t.depth(); ++d) op.k = std::max(op.k, t.max_rank(d) + 1);
    op.packed = medusa::cuda::pack_tree(t);
    op.tree = medusa::cuda::tree_arrays::over(t, op.packed.data());
    op.top_k = mk::plan_top_k(batch * heads, vocab, op.k);
    op.gather = mk::plan_gather(op.tree, batch, heads, op.k);
    op.verify = mk::plan_verify(mk::verify_kind::greedy, batch, t.num_nodes(), t.depth(), vocab);
    op.ids_bytes = medusa::cuda::workspace_carver::round_up(static_cast<std::size_t>(batch * heads * op.k) * 4);
    op.workspace.resize(op.ids_bytes + std::max(op.top_k.workspace_bytes, op.verify.workspace_bytes));
    return op;
  }
  void candidates(step_op& op, const float* head_logits, const std::int32_t* roots, const std::int32_t* lengths,
                  std::int32_t* node_tokens, std::int32_t* positions, std::int32_t* status) {
    namespace mk = medusa::cuda::kernels;
    auto* ids = reinterpret_cast<std::int32_t*>(op.workspace.data());
    mk::top_k_args<float> a;
    a.logits = head_logits;
    a.row_stride = op.vocab;
    a.out_ids = ids;
    a.status = status;
    a.rows_per_status = op.heads;
    if (!mk::bind_top_k_workspace(op.top_k, a, op.workspace.data() + op.ids_bytes, op.workspace.size() - op.ids_bytes))
      throw std::logic_error("host executor: top-k workspace too small");
    mk::with_top_k_bucket(op.top_k.bucket, [&](auto bucket) {
      constexpr int K = decltype(bucket)::value;
      launch(op.top_k.scan, [&](auto& ctx) { mk::top_k_scan<K>(ctx, a); });
      if (op.top_k.splits > 1) launch(op.top_k.merge, [&](auto& ctx) { mk::top_k_merge_splits<K>(ctx, a); });
    });
    const mk::gather_args g{.batch = op.batch, .heads = op.heads, .k_stride = op.k, .roots = roots, .head_top_k = ids,
                            .lengths = lengths, .node_tokens = node_tokens, .positions = positions};
    launch(op.gather, [&](auto& ctx) { mk::gather_candidates(ctx, op.tree, g); });
  }
  void verify(step_op& op, medusa::cuda::kernels::verify_args<float> a) {
    namespace mk = medusa::cuda::kernels;
    if (!mk::bind_verify_workspace(op.verify, a, op.workspace.data() + op.ids_bytes, op.workspace.size() - op.ids_bytes))
      throw std::logic_error("host executor: verify workspace too small");
    launch(op.verify.rows, [&](auto& ctx) { mk::node_rows<mk::verify_kind::greedy>(ctx, a); });
    launch(op.verify.path, [&](auto& ctx) { mk::select_path<mk::verify_kind::greedy>(ctx, op.tree, a); });
  }

  // Argmax of rows (top-k with k = 1: ties to the lower id, status on non-finite rows).
  struct argmax_op {
    medusa::cuda::kernels::top_k_plan plan;
    std::vector<unsigned char> workspace;
  };
  argmax_op make_argmax_op(int rows, int vocab) {
    argmax_op op;
    op.plan = medusa::cuda::kernels::plan_top_k(rows, vocab, 1);
    op.workspace.resize(op.plan.workspace_bytes);
    return op;
  }
  void argmax(argmax_op& op, const float* logits, std::int32_t* ids, std::int32_t* status) {
    namespace mk = medusa::cuda::kernels;
    mk::top_k_args<float> a;
    a.logits = logits;
    a.row_stride = op.plan.vocab;
    a.out_ids = ids;
    a.status = status;
    a.rows_per_status = 1;
    if (!mk::bind_top_k_workspace(op.plan, a, op.workspace.data(), op.workspace.size()))
      throw std::logic_error("host executor: argmax workspace too small");
    launch(op.plan.scan, [&](auto& ctx) { mk::top_k_scan<1>(ctx, a); });
    if (op.plan.splits > 1) launch(op.plan.merge, [&](auto& ctx) { mk::top_k_merge_splits<1>(ctx, a); });
  }

  // The heads on the CPU (`head_stack::forward`, float) for hidden states given in T.
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
    for (std::size_t i = 0; i < op.hidden.size(); ++i) op.hidden[i] = medusa::cuda::load_float(hidden[i]);
    medusa::portable_gemm gemm;
    const std::size_t n = static_cast<std::size_t>(op.rows) * op.stack.num_heads() * op.stack.vocab_size();
    op.stack.forward(gemm, op.hidden, static_cast<std::size_t>(op.rows), std::span<float>(logits, n));
  }

  void kv_commit(const medusa::cuda::kernels::kv_commit_params& params) {
    namespace mk = medusa::cuda::kernels;
    const mk::kv_commit_plan plan = mk::plan_kv_commit(params);
    launch(plan.shape, [&](auto& ctx) { mk::kv_commit(ctx, params); });
  }

  // "Graphs": the host replays the recorded step by running it again.
  using graph = std::function<void()>;
  template <class F>
  graph capture(F&& f) {
    return graph(std::forward<F>(f));
  }
  void replay(const graph& g) { g(); }
  // Mean seconds of `n` replays of `g`.
  double time_replays(const graph& g, int n) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) g();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
  }

  [[nodiscard]] long long launches() const noexcept { return launches_; }
  [[nodiscard]] long long gemms() const noexcept { return gemms_; }
  [[nodiscard]] long long allocations() const noexcept { return allocations_; }

 private:
  long long launches_ = 0, gemms_ = 0, allocations_ = 0;
};

}  // namespace medusa_llama::cuda_detail
