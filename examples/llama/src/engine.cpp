// SPDX-License-Identifier: Apache-2.0
// The batched forward pass: embeddings → n_layers × (RMSNorm, QKV, RoPE, KV write, attention,
// Wo + residual, RMSNorm, SwiGLU FFN + residual) → final RMSNorm → classifier.
#include <medusa_llama/engine.hpp>
#include <medusa_llama/thread_pool.hpp>

#include <medusa/attention.hpp>
#include <medusa/heads.hpp>

#include "gemm.hpp"
#include "kernels.hpp"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(MEDUSA_LLAMA_HAVE_OPENBLAS)
#include <cblas.h>
#endif

namespace medusa_llama {

namespace {

std::size_t sz(int v) { return static_cast<std::size_t>(v); }

// Row ranges of a projection job: about 4 chunks per thread (so a descheduled thread's share
// is picked up by the others), each a multiple of 16 rows.
struct row_chunks {
  int rows, n, per;
  row_chunks(int rows_, int threads) : rows(rows_) {
    const int blocks = (rows + 15) / 16;
    n = std::max(1, std::min(blocks, threads == 1 ? 1 : 4 * threads));
    per = (blocks + n - 1) / n * 16;
    n = (rows + per - 1) / per;
  }
  void range(int c, int& r0, int& r1) const {
    r0 = c * per;
    r1 = std::min(rows, r0 + per);
  }
};

}  // namespace

struct engine::impl {
  model m;
  model_config c;
  engine_options opt;
  thread_pool pool;
  std::vector<float> k_cache, v_cache;  // [layer][capacity][kv_dim]
  medusa::kv_cache_view<float> kv;      // the cache as the library sees it (NHD)
  std::vector<float> rope_cos, rope_sin;  // [seq_len][head_dim / 2]
  std::vector<float> x, xb, q, k, v, att, h1, h3, xf;

  impl(model mm, engine_options o) : m(std::move(mm)), c(m.config()), opt(o), pool(o.threads) {}

  [[nodiscard]] bool use_blas(int T) const {
    if (T <= 1 || !detail::have_blas() || opt.weights != weight_format::f32) return false;
    switch (opt.backend) {
      case gemm_backend::builtin: return false;
      case gemm_backend::blas: return true;
      case gemm_backend::automatic: return T >= opt.blas_min_batch;
    }
    return false;
  }

  // The projection weights packed once into the kernels' panel layout (gemm.hpp).
  struct packed_layer {
    detail::packed_matrix wq, wk, wv, wo, w13, w2;  // w13: w1/w3 interleaved for the fused SwiGLU
  };
  std::vector<packed_layer> packed;
  detail::packed_matrix cls;

  void pack_weights() {
    const weight_format f = opt.weights;
    const int d = c.dim, kvd = c.kv_dim(), H = c.hidden_dim;
    packed.resize(sz(c.n_layers));
    for (int l = 0; l < c.n_layers; ++l) {
      const layer_weights& w = m.layer(l);
      auto& p = packed[sz(l)];
      p.wq = detail::packed_matrix(w.wq, d, d, f);
      p.wk = detail::packed_matrix(w.wk, kvd, d, f);
      p.wv = detail::packed_matrix(w.wv, kvd, d, f);
      p.wo = detail::packed_matrix(w.wo, d, d, f);
      p.w13 = detail::packed_matrix::swiglu_pair(w.w1, w.w3, H, d, f);
      p.w2 = detail::packed_matrix(w.w2, d, H, f);
    }
    cls = detail::packed_matrix(m.classifier(), c.vocab_size, d, f);
  }

  // One projection of a packed job: Y (=|+=|swiglu) X · W^T, Y rows ldy apart.
  struct pjob {
    const detail::packed_matrix* W;
    const float* raw;  // the model's row-major weights (OpenBLAS path); null for the SwiGLU pair
    float* Y;
    int ldy;
    detail::epilogue op;
  };
  // Several projections sharing X (T rows of `in`), their column groups split across the threads
  // in one fork-join job.
  void linear(std::initializer_list<pjob> jobs, const float* X, int T, int in) {
    if (use_blas(T)) {
      linear_blas(jobs, X, T, in);
      return;
    }
    const detail::gemm_input gi{X, sz(in), T};
    detail::gemm_job packed[3];  // the callers pass Q/K/V at most
    assert(jobs.size() <= std::size(packed));
    std::size_t n = 0;
    for (const auto& j : jobs) packed[n++] = {j.W, gi, j.Y, sz(j.ldy), j.op};
    detail::run_gemm_jobs(pool, std::span(packed, n));
  }

  // The OpenBLAS path (gemm_backend::blas / automatic above blas_min_batch), on the model's own
  // row-major float32 weights, rows split across the threads.
  void linear_blas(std::initializer_list<pjob> jobs, const float* X, int T, int in) {
    for (const auto& j : jobs)
      if (j.op == detail::epilogue::swiglu) {
        swiglu_blas(X, T);
        return;
      }
    int total = 0;
    for (const auto& j : jobs) total += j.W->rows();
    const row_chunks rc(total, pool.size());
    pool.run(rc.n, [&](int chunk, int) {
      int a, b;
      rc.range(chunk, a, b);
      int base = 0;
      for (const auto& j : jobs) {
        const int r0 = std::max(a - base, 0), r1 = std::min(b - base, j.W->rows());
        const bool acc = j.op == detail::epilogue::add;
        if (r0 < r1 && !detail::linear_rows_blas(j.raw, X, j.Y, T, in, j.ldy, r0, r1, acc))
          detail::linear_rows(j.raw, X, j.Y, T, in, j.ldy, r0, r1, acc);
        base += j.W->rows();
      }
    });
  }

  // h1 = silu(X W1^T) ⊙ (X W3^T) through OpenBLAS, each thread owning a range of hidden units.
  void swiglu_blas(const float* X, int T) {
    const layer_weights& w = m.layer(cur_layer);
    const int H = c.hidden_dim, d = c.dim;
    const row_chunks rc(H, pool.size());
    pool.run(rc.n, [&](int chunk, int) {
      int a, b;
      rc.range(chunk, a, b);
      for (const float* W : {w.w1, w.w3}) {
        float* Y = W == w.w1 ? h1.data() : h3.data();
        if (!detail::linear_rows_blas(W, X, Y, T, d, H, a, b, false)) detail::linear_rows(W, X, Y, T, d, H, a, b, false);
      }
      for (int t = 0; t < T; ++t) {
        float* g = h1.data() + sz(t) * sz(H);
        const float* u = h3.data() + sz(t) * sz(H);
        for (int i = a; i < b; ++i) g[i] = medusa::silu(g[i]) * u[i];
      }
    });
  }
  int cur_layer = 0;

  void rope(float* vec, int n_heads_here, int pos) const {
    const int hd = c.head_dim(), half = hd / 2;
    const float* cs = rope_cos.data() + sz(pos) * sz(half);
    const float* sn = rope_sin.data() + sz(pos) * sz(half);
    for (int h = 0; h < n_heads_here; ++h) {
      float* v = vec + sz(h) * sz(hd);
      for (int i = 0; i < half; ++i) {
        const int a = c.rope == rope_style::adjacent_pairs ? 2 * i : i;
        const int b = c.rope == rope_style::adjacent_pairs ? 2 * i + 1 : i + half;
        const float v0 = v[a], v1 = v[b];
        v[a] = v0 * cs[i] - v1 * sn[i];
        v[b] = v0 * sn[i] + v1 * cs[i];
      }
    }
  }

  void validate(const medusa::forward_batch& b) const {
    const auto T = b.tokens.size();
    auto fail = [](engine_errc code, const std::string& msg) { throw engine_error(code, msg); };
    if (T < 1) fail(engine_errc::bad_batch, "empty batch");
    if (b.positions.size() != T)
      fail(engine_errc::bad_batch, "batch of " + std::to_string(T) + " tokens has " + std::to_string(b.positions.size()) + " positions");
    const int L = b.cache_length;
    if (L < 0 || T > sz(opt.capacity) || L > opt.capacity - static_cast<int>(T))
      fail(engine_errc::bad_slot, "batch of " + std::to_string(T) + " tokens at cache length " + std::to_string(L) +
                                      " does not fit the capacity " + std::to_string(opt.capacity));
    const int n = static_cast<int>(T);
    for (int i = 0; i < n; ++i) {
      const int tok = b.tokens[sz(i)], pos = b.positions[sz(i)];
      if (tok < 0 || tok >= c.vocab_size)
        fail(engine_errc::bad_token, "token " + std::to_string(tok) + " at batch row " + std::to_string(i) + " is outside [0, " + std::to_string(c.vocab_size) + ")");
      if (pos < 0 || pos >= c.seq_len)
        fail(engine_errc::bad_position, "position " + std::to_string(pos) + " at batch row " + std::to_string(i) + " is outside [0, seq_len " + std::to_string(c.seq_len) + ")");
    }
    if (!b.tree_mask.empty()) {
      const auto& m = b.tree_mask;
      if (n > opt.max_batch)
        fail(engine_errc::bad_batch, "tree batch of " + std::to_string(n) + " tokens exceeds max_batch " + std::to_string(opt.max_batch));
      if (!m.covers(n))
        fail(engine_errc::bad_mask, "tree mask of " + std::to_string(m.words.size()) + " words, " + std::to_string(m.words_per_row) +
                                        " per row, does not cover " + std::to_string(n) + " tokens");
      for (int i = 0; i < n; ++i) {
        if (!m.visible(i, i)) fail(engine_errc::bad_mask, "tree mask row " + std::to_string(i) + " does not see itself");
        for (int j = i + 1; j < 32 * m.words_per_row; ++j)  // only earlier rows (and itself) can be ancestors
          if (m.visible(i, j))
            fail(engine_errc::bad_mask, "tree mask row " + std::to_string(i) + " sees column " + std::to_string(j) + ", which is not an earlier row");
      }
    }
    if (b.first_output_row < 0 || b.first_output_row >= n)
      fail(engine_errc::bad_output, "first output row " + std::to_string(b.first_output_row) + " is outside the batch [0, " + std::to_string(n) + ")");
    const std::size_t rows = T - sz(b.first_output_row);
    if (!b.logits.empty() && b.logits.size() != rows * sz(c.vocab_size))
      fail(engine_errc::bad_output, "logits buffer has " + std::to_string(b.logits.size()) + " floats, " + std::to_string(rows) + " rows need " + std::to_string(rows * sz(c.vocab_size)));
    if (!b.hidden.empty() && b.hidden.size() != rows * sz(c.dim))
      fail(engine_errc::bad_output, "hidden buffer has " + std::to_string(b.hidden.size()) + " floats, " + std::to_string(rows) + " rows need " + std::to_string(rows * sz(c.dim)));
  }

  // One pass of T <= max_batch tokens at slots [L, L+T); outputs of rows [first, T) when wanted.
  void run(std::span<const std::int32_t> tokens, std::span<const std::int32_t> positions, int L, const medusa::tree_mask_view& mask,
           int first, float* logits, float* hidden) {
    const int T = static_cast<int>(tokens.size());
    const int d = c.dim, kvd = c.kv_dim(), H = c.hidden_dim;
    for (int t = 0; t < T; ++t)
      std::memcpy(x.data() + sz(t) * sz(d), m.token_embedding() + sz(tokens[sz(t)]) * sz(d), sz(d) * sizeof(float));
    auto on_pool = [this](std::size_t count, auto&& body) {
      pool.run(static_cast<int>(count), [&body](int i, int) { body(static_cast<std::size_t>(i)); });
    };
    const std::size_t qn = sz(T) * sz(d);
    for (int l = 0; l < c.n_layers; ++l) {
      const layer_weights& w = m.layer(l);
      const packed_layer& pw = packed[sz(l)];
      cur_layer = l;
      using detail::epilogue;
      for (int t = 0; t < T; ++t) detail::rmsnorm(xb.data() + sz(t) * sz(d), x.data() + sz(t) * sz(d), w.rms_att, d, c.rms_eps);
      linear({{&pw.wq, w.wq, q.data(), d, epilogue::store},
              {&pw.wk, w.wk, k.data(), kvd, epilogue::store},
              {&pw.wv, w.wv, v.data(), kvd, epilogue::store}},
             xb.data(), T, d);
      for (int t = 0; t < T; ++t) {
        rope(q.data() + sz(t) * sz(d), c.n_heads, positions[sz(t)]);
        rope(k.data() + sz(t) * sz(kvd), c.n_kv_heads, positions[sz(t)]);
        std::memcpy(kv.k_row(l, L + t, 0), k.data() + sz(t) * sz(kvd), sz(kvd) * sizeof(float));
        std::memcpy(kv.v_row(l, L + t, 0), v.data() + sz(t) * sz(kvd), sz(kvd) * sizeof(float));
      }
      const std::span<const float> qs(q.data(), qn);
      const std::span<float> out(att.data(), qn);
      if (mask.empty())
        medusa::causal_attention(kv, l, L, qs, T, c.n_heads, out, {}, on_pool);
      else
        medusa::tree_attention(kv, l, L, qs, T, c.n_heads, mask, out, {}, on_pool);
      linear({{&pw.wo, w.wo, x.data(), d, epilogue::add}}, att.data(), T, d);
      for (int t = 0; t < T; ++t) detail::rmsnorm(xb.data() + sz(t) * sz(d), x.data() + sz(t) * sz(d), w.rms_ffn, d, c.rms_eps);
      linear({{&pw.w13, nullptr, h1.data(), H, epilogue::swiglu}}, xb.data(), T, d);
      linear({{&pw.w2, w.w2, x.data(), d, epilogue::add}}, h1.data(), T, H);
    }
    const int R = T - first;
    if (R <= 0 || (logits == nullptr && hidden == nullptr)) return;
    for (int r = 0; r < R; ++r) {
      float* dst = xf.data() + sz(r) * sz(d);
      detail::rmsnorm(dst, x.data() + sz(first + r) * sz(d), m.rms_final(), d, c.rms_eps);
      if (hidden != nullptr) std::memcpy(hidden + sz(r) * sz(d), dst, sz(d) * sizeof(float));
    }
    if (logits != nullptr)
      linear({{&cls, m.classifier(), logits, c.vocab_size, detail::epilogue::store}}, xf.data(), R, d);
  }

  void forward(const medusa::forward_batch& b) {
    validate(b);
    const int T = static_cast<int>(b.tokens.size());
    const std::size_t V = sz(c.vocab_size), d = sz(c.dim);
    const int maxb = b.tree_mask.empty() ? opt.max_batch : T;
    for (int c0 = 0; c0 < T; c0 += maxb) {
      const int n = std::min(maxb, T - c0);
      const int first = std::max(b.first_output_row - c0, 0);  // output rows of this chunk: [first, n)
      const std::size_t o0 = sz(c0 + first - b.first_output_row);
      const bool wanted = first < n;
      run(b.tokens.subspan(sz(c0), sz(n)), b.positions.subspan(sz(c0), sz(n)), b.cache_length + c0, b.tree_mask, first,
          wanted && !b.logits.empty() ? b.logits.data() + o0 * V : nullptr,
          wanted && !b.hidden.empty() ? b.hidden.data() + o0 * d : nullptr);
    }
  }
};

engine::engine(model m, engine_options o) {
  const auto& c = m.config();
  auto bad = [](const std::string& msg) { throw engine_error(engine_errc::bad_option, msg); };
  if (o.capacity == 0) o.capacity = c.seq_len;
  if (o.capacity < 1 || o.capacity > (1 << 24)) bad("capacity " + std::to_string(o.capacity) + " is outside [1, 2^24]");
  if (o.max_batch < 1 || o.max_batch > 4096) bad("max_batch " + std::to_string(o.max_batch) + " is outside [1, 4096]");
  if (o.threads < 0 || o.threads > 256) bad("threads " + std::to_string(o.threads) + " is outside [0, 256]");
  if (o.weights == weight_format::int8) bad("int8 weights are for Medusa heads only (packed_heads); the model needs f32 or bf16");
  if (o.weights != weight_format::f32 && o.weights != weight_format::bf16)
    bad("weight format " + std::to_string(static_cast<int>(o.weights)) + " is unknown");
  if (o.blas_min_batch < 2) bad("blas_min_batch " + std::to_string(o.blas_min_batch) + " must be at least 2");
  p_ = std::make_unique<impl>(std::move(m), o);
  auto& s = *p_;
  s.opt.threads = s.pool.size();
#if defined(MEDUSA_LLAMA_HAVE_OPENBLAS)
  // The engine splits each GEMM across its own threads; OpenBLAS threads would fight them.
  openblas_set_num_threads(1);
#endif
  const std::size_t B = sz(o.max_batch), d = sz(c.dim), kvd = sz(c.kv_dim()), H = sz(c.hidden_dim);
  s.k_cache.assign(sz(c.n_layers) * sz(o.capacity) * kvd, 0.0f);
  s.v_cache.assign(s.k_cache.size(), 0.0f);
  s.x.assign(B * d, 0.0f);
  s.xb.assign(B * d, 0.0f);
  s.q.assign(B * d, 0.0f);
  s.k.assign(B * kvd, 0.0f);
  s.v.assign(B * kvd, 0.0f);
  s.att.assign(B * d, 0.0f);
  s.h1.assign(B * H, 0.0f);
  s.h3.assign(B * H, 0.0f);
  s.xf.assign(B * d, 0.0f);
  s.pack_weights();
  s.kv = medusa::make_kv_view<float>(std::span<float>(s.k_cache), std::span<float>(s.v_cache),
                                     medusa::kv_extents{c.n_layers, c.n_kv_heads, c.head_dim()}, o.capacity,
                                     medusa::kv_layout::nhd);
  // RoPE tables in float, as llama2.c's run.c and HF compute them.
  const int hd = c.head_dim(), half = hd / 2;
  s.rope_cos.resize(sz(c.seq_len) * sz(half));
  s.rope_sin.resize(s.rope_cos.size());
  for (int pos = 0; pos < c.seq_len; ++pos)
    for (int i = 0; i < half; ++i) {
      const float freq = 1.0f / std::pow(c.rope_theta, static_cast<float>(2 * i) / static_cast<float>(hd));
      const float val = static_cast<float>(pos) * freq;
      s.rope_cos[sz(pos) * sz(half) + sz(i)] = std::cos(val);
      s.rope_sin[sz(pos) * sz(half) + sz(i)] = std::sin(val);
    }
}

engine::engine(engine&&) noexcept = default;
engine& engine::operator=(engine&&) noexcept = default;
engine::~engine() = default;

const model_config& engine::config() const noexcept { return p_->c; }
const model& engine::weights() const noexcept { return p_->m; }
const engine_options& engine::options() const noexcept { return p_->opt; }
int engine::vocab_size() const noexcept { return p_->c.vocab_size; }
int engine::hidden_size() const noexcept { return p_->c.dim; }
medusa::kv_cache_view<float> engine::kv_cache() noexcept { return p_->kv; }
int engine::capacity() const noexcept { return p_->opt.capacity; }
int engine::threads() const noexcept { return p_->pool.size(); }
thread_pool& engine::pool() noexcept { return p_->pool; }

void engine::forward(const medusa::forward_batch& batch) { p_->forward(batch); }

void engine::prefill(std::span<const int> tokens, int start, std::span<float> last_logits, std::span<float> last_hidden) {
  const int n = static_cast<int>(tokens.size());
  if (n < 1) throw engine_error(engine_errc::bad_batch, "prefill of an empty prompt");
  std::vector<std::int32_t> positions(tokens.size());
  for (int i = 0; i < n; ++i) positions[sz(i)] = start + i;
  medusa::forward_batch b;
  b.tokens = tokens;
  b.positions = positions;
  b.cache_length = start;
  b.first_output_row = n - 1;
  b.logits = last_logits;
  b.hidden = last_hidden;
  forward(b);
}

void engine::decode(int token, int pos, std::span<float> logits, std::span<float> hidden) {
  medusa::forward_batch b;
  b.tokens = std::span<const std::int32_t>(&token, 1);
  b.positions = std::span<const std::int32_t>(&pos, 1);
  b.cache_length = pos;
  b.logits = logits;
  b.hidden = hidden;
  forward(b);
}

}  // namespace medusa_llama
