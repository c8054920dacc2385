// SPDX-License-Identifier: Apache-2.0
// Medusa heads on the engine's packed kernels (see packed_heads.hpp). Per step: layer 0 of all
// heads as one [K·d, d] matrix (they share the input h), later layers one matrix per head, then
// the K vocabulary projections (or the shared lm_head over K rows); all column groups of a stage
// are split across the engine's threads in one fork-join.
#include <medusa_llama/packed_heads.hpp>
#include <medusa_llama/thread_pool.hpp>

#include "gemm.hpp"
#include "kernels.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace medusa_llama {

namespace {
std::size_t sz(int v) { return static_cast<std::size_t>(v); }

// The weights of `w` (`n` elements, any dtype) as float32.
std::vector<float> to_float(medusa::weight_ptr w, std::size_t n) {
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = w.load(i);
  return out;
}
}  // namespace

struct packed_heads::impl {
  thread_pool* pool = nullptr;
  int K = 0, L = 0, d = 0, V = 0;
  bool shared = false;
  detail::packed_matrix first;               // [K·d, d]: layer 0 of every head
  std::vector<detail::packed_matrix> later;  // [k·(L-1) + l-1]: layer l ≥ 1 of head k
  std::vector<float> bias;                   // [k·L + l][d]
  std::vector<detail::packed_matrix> proj;   // K per-head projections, or one shared lm_head
  std::vector<float> x, t;                   // [rows][K][d]: residual stream and linear outputs
  std::vector<detail::gemm_job> jobs;        // one stage's GEMMs (kept: no allocation per step)

  void run(std::span<const detail::gemm_job> stage) { detail::run_gemm_jobs(*pool, stage); }

  // x_{m,k} = x_{m,k} + SiLU(t_{m,k} + b_{k,l}) for every row m and head k (x_{m,k} = h_m at layer 0).
  void residual(const float* h, int l, int M) {
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < K; ++k) {
        const std::size_t mk = (sz(m) * sz(K) + sz(k)) * sz(d);
        const float* in = l == 0 ? h + sz(m) * sz(d) : x.data() + mk;
        const float* tk = t.data() + mk;
        const float* b = bias.data() + (sz(k) * sz(L) + sz(l)) * sz(d);
        detail::silu_residual(x.data() + mk, in, tk, b, d);
      }
  }
};

packed_heads::packed_heads(engine& eng, const medusa::head_stack<>& stack, weight_format format, int num_heads)
    : packed_heads(eng.pool(), eng.config(), stack, format, num_heads) {}

packed_heads::packed_heads(batch_engine& eng, const medusa::head_stack<>& stack, weight_format format, int num_heads)
    : packed_heads(eng.pool(), eng.config(), stack, format, num_heads) {}

packed_heads::packed_heads(thread_pool& pool, const model_config& config, const medusa::head_stack<>& stack,
                           weight_format format, int num_heads)
    : p_(std::make_unique<impl>()) {
  auto bad = [](const std::string& msg) { throw engine_error(engine_errc::bad_option, "packed_heads: " + msg); };
  stack.validate();
  impl& s = *p_;
  s.pool = &pool;
  const int available = static_cast<int>(stack.num_heads());
  if (num_heads < 0 || num_heads > available)
    bad("asked for " + std::to_string(num_heads) + " heads of a stack of " + std::to_string(available));
  s.K = num_heads == 0 ? available : num_heads;
  s.L = static_cast<int>(stack.num_layers());
  s.d = static_cast<int>(stack.hidden_size());
  s.V = static_cast<int>(stack.vocab_size());
  s.shared = stack.kind() == medusa::projection_kind::shared_lm_head;
  if (s.d != config.dim)
    bad("heads of hidden size " + std::to_string(s.d) + " for a model of dim " + std::to_string(config.dim));
  if (s.V != config.vocab_size)
    bad("heads of vocabulary " + std::to_string(s.V) + " for a model of vocabulary " + std::to_string(config.vocab_size));
  if (s.K < 1) bad("a stack without heads");
  const std::size_t d = sz(s.d), V = sz(s.V);
  if (s.L > 0) {
    std::vector<float> w0(sz(s.K) * d * d);
    for (int k = 0; k < s.K; ++k) {
      const auto blk = stack.resblock(sz(k), 0);
      const auto w = to_float(blk.weight, d * d);
      std::copy(w.begin(), w.end(), w0.begin() + static_cast<std::ptrdiff_t>(sz(k) * d * d));
    }
    s.first = detail::packed_matrix(w0.data(), s.K * s.d, s.d, format);
    s.bias.resize(sz(s.K) * sz(s.L) * d);
    for (int k = 0; k < s.K; ++k)
      for (int l = 0; l < s.L; ++l) {
        const auto blk = stack.resblock(sz(k), sz(l));
        const auto b = to_float(blk.bias, d);
        std::copy(b.begin(), b.end(), s.bias.begin() + static_cast<std::ptrdiff_t>((sz(k) * sz(s.L) + sz(l)) * d));
        if (l > 0) s.later.emplace_back(to_float(blk.weight, d * d).data(), s.d, s.d, format);
      }
  }
  for (int k = 0; k < (s.shared ? 1 : s.K); ++k) s.proj.emplace_back(to_float(stack.projection(sz(k)), V * d).data(), s.V, s.d, format);
  s.x.assign(sz(s.K) * d, 0.0f);
  s.t.assign(sz(s.K) * d, 0.0f);
  s.jobs.reserve(sz(s.K));
}

packed_heads::packed_heads(packed_heads&&) noexcept = default;
packed_heads& packed_heads::operator=(packed_heads&&) noexcept = default;
packed_heads::~packed_heads() = default;

int packed_heads::num_heads() const noexcept { return p_->K; }
int packed_heads::vocab_size() const noexcept { return p_->V; }

void packed_heads::forward(std::span<const float> hidden, std::span<float> logits) { forward(hidden, 1, logits); }

void packed_heads::forward(std::span<const float> hidden, int rows, std::span<float> logits) {
  impl& s = *p_;
  const std::size_t d = sz(s.d), V = sz(s.V), K = sz(s.K);
  if (rows < 1 || hidden.size() != sz(rows) * d || logits.size() != sz(rows) * K * V)
    throw engine_error(engine_errc::bad_output, "packed_heads: " + std::to_string(rows) + " rows: hidden has " +
                                                     std::to_string(hidden.size()) + " floats (needs rows × " +
                                                     std::to_string(d) + "), logits " + std::to_string(logits.size()) +
                                                     " (needs rows × " + std::to_string(K * V) + ")");
  const int M = rows;
  const std::size_t KD = K * d;
  if (s.x.size() < sz(M) * KD) {  // grows once to the largest batch seen
    s.x.resize(sz(M) * KD);
    s.t.resize(sz(M) * KD);
  }
  // x, t: [M][K][d]; head k of all rows is the strided matrix at x + k·d, rows K·d apart.
  const float* h = hidden.data();
  auto& jobs = s.jobs;
  if (s.L > 0) {
    const detail::gemm_job j0{&s.first, {h, d, M}, s.t.data(), KD, detail::epilogue::store};  // M rows of K·d outputs
    s.run(std::span(&j0, 1));
    s.residual(h, 0, M);
    for (int l = 1; l < s.L; ++l) {
      jobs.clear();
      for (std::size_t k = 0; k < K; ++k)
        jobs.push_back({&s.later[k * sz(s.L - 1) + sz(l - 1)], {s.x.data() + k * d, KD, M}, s.t.data() + k * d, KD,
                        detail::epilogue::store});
      s.run(jobs);
      s.residual(h, l, M);
    }
  } else {
    for (int m = 0; m < M; ++m)
      for (std::size_t k = 0; k < K; ++k)
        std::copy(h + sz(m) * d, h + sz(m) * d + d, s.x.begin() + static_cast<std::ptrdiff_t>(sz(m) * KD + k * d));
  }
  // logits: [M][K][V], the rows of head k at logits + k·V, K·V apart.
  jobs.clear();
  if (s.shared) {
    jobs.push_back({&s.proj[0], {s.x.data(), d, M * s.K}, logits.data(), V, detail::epilogue::store});  // M·K rows through lm_head
  } else {
    for (std::size_t k = 0; k < K; ++k)
      jobs.push_back({&s.proj[k], {s.x.data() + k * d, KD, M}, logits.data() + k * V, K * V, detail::epilogue::store});
  }
  s.run(jobs);
}

}  // namespace medusa_llama
