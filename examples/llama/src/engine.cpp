// SPDX-License-Identifier: Apache-2.0
// The batched forward pass: embeddings → n_layers × (RMSNorm, QKV, RoPE, KV write, attention,
// Wo + residual, RMSNorm, SwiGLU FFN + residual) → final RMSNorm → classifier.
#include <medusa_llama/engine.hpp>
#include <medusa_llama/thread_pool.hpp>

#include "attention.hpp"
#include "gemm.hpp"
#include "kernels.hpp"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(MEDUSA_LLAMA_HAVE_OPENBLAS)
#include <cblas.h>
#endif

namespace medusa_llama {

namespace detail {

std::size_t attention_scratch_size(int capacity, int max_batch) {
  return static_cast<std::size_t>(capacity) + static_cast<std::size_t>(max_batch);
}

bool core_attention_applies(const attention_problem& p) noexcept {
  if (p.view == nullptr) return false;
  for (int i = 0; i < p.T; ++i)
    if (p.slots[i] != p.mask.prefix_len() + i) return false;
  return true;
}

void attend(const attention_problem& p, float* score_scratch, int* slot_scratch, std::size_t per_thread, thread_pool& pool) {
  if (core_attention_applies(p)) {
    const std::size_t n = static_cast<std::size_t>(p.T) * static_cast<std::size_t>(p.n_heads) * static_cast<std::size_t>(p.head_dim);
    auto par = [&pool](int count, auto&& body) { pool.run(count, [&body](int i, int) { body(i); }); };
    std::span<const float> q(p.q, n);
    std::span<float> out(p.out, n);
    if (p.mask.is_tree()) {
      const medusa::packed_tree_mask m{p.mask.words(), (p.T + 31) / 32};
      medusa::tree_attention(*p.view, p.layer, p.mask.prefix_len(), q, p.T, p.n_heads, m, out, {}, par);
    } else {
      medusa::causal_attention(*p.view, p.layer, p.mask.prefix_len(), q, p.T, p.n_heads, out, {}, par);
    }
    return;
  }
  const int hd = p.head_dim;
  const int group = p.n_heads / p.n_kv_heads;
  const std::size_t kv_stride = static_cast<std::size_t>(p.n_kv_heads) * static_cast<std::size_t>(hd);
  const std::size_t q_stride = static_cast<std::size_t>(p.n_heads) * static_cast<std::size_t>(hd);
  const int L = p.mask.prefix_len();
  const float inv_scale = std::sqrt(static_cast<float>(hd));
  const int tasks = p.T * p.n_heads;
  const int chunks = std::min(tasks, 4 * pool.size());
  pool.run(chunks, [&](int chunk, int tid) {
    float* scores = score_scratch + static_cast<std::size_t>(tid) * per_thread;
    int* idx = slot_scratch + static_cast<std::size_t>(tid) * per_thread;  // visible slots
    const int begin = tasks * chunk / chunks, end = tasks * (chunk + 1) / chunks;
    for (int task = begin; task < end; ++task) {
      const int t = task / p.n_heads, h = task % p.n_heads;
      const float* q = p.q + static_cast<std::size_t>(t) * q_stride + static_cast<std::size_t>(h) * static_cast<std::size_t>(hd);
      const std::size_t head_off = static_cast<std::size_t>(h / group) * static_cast<std::size_t>(hd);
      int m = 0;
      for (int j = 0; j < L; ++j) idx[m++] = j;
      for (int j = 0; j < p.T; ++j)
        if (p.mask.visible(t, j, p.T)) idx[m++] = p.slots[j];
      float mx = -INFINITY;
      for (int s = 0; s < m; ++s) {
        const float v = dot(q, p.k_cache + static_cast<std::size_t>(idx[s]) * kv_stride + head_off, hd) / inv_scale;
        scores[s] = v;
        mx = std::max(mx, v);
      }
      float sum = 0.0f;
      for (int s = 0; s < m; ++s) {
        scores[s] = std::exp(scores[s] - mx);
        sum += scores[s];
      }
      float* o = p.out + static_cast<std::size_t>(t) * q_stride + static_cast<std::size_t>(h) * static_cast<std::size_t>(hd);
      std::fill(o, o + hd, 0.0f);
      for (int s = 0; s < m; ++s)
        axpy(scores[s] / sum, p.v_cache + static_cast<std::size_t>(idx[s]) * kv_stride + head_off, o, hd);
    }
  });
}

}  // namespace detail

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
  int length = 0;
  std::vector<float> k_cache, v_cache;  // [layer][capacity][kv_dim]
  std::vector<float> rope_cos, rope_sin;  // [seq_len][head_dim / 2]
  std::vector<float> x, xb, q, k, v, att, h1, h3, xf;
  std::optional<medusa::kv_cache_view<float>> view;  // the cache for the core attention
  std::vector<float> score_scratch;
  std::vector<int> slot_scratch;
  std::size_t scratch_per_thread = 0;

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
        for (int i = a; i < b; ++i) g[i] = g[i] * (1.0f / (1.0f + std::exp(-g[i]))) * u[i];
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

  void validate(std::span<const int> tokens, std::span<const int> positions, std::span<const int> slots,
                const mask_source& mask, const forward_outputs& out) const {
    const int T = static_cast<int>(tokens.size());
    auto fail = [](engine_errc code, const std::string& msg) { throw engine_error(code, msg); };
    if (T < 1 || T > opt.max_batch)
      fail(engine_errc::bad_batch, "batch of " + std::to_string(tokens.size()) + " tokens is outside [1, max_batch " + std::to_string(opt.max_batch) + "]");
    if (positions.size() != tokens.size() || slots.size() != tokens.size())
      fail(engine_errc::bad_batch, "tokens, positions and kv_slots have " + std::to_string(tokens.size()) + ", " +
                                       std::to_string(positions.size()) + " and " + std::to_string(slots.size()) + " entries");
    const int L = mask.prefix_len();
    if (L < 0 || L > length)
      fail(engine_errc::bad_mask, "prefix length " + std::to_string(L) + " is outside [0, cache length " + std::to_string(length) + "]");
    for (int i = 0; i < T; ++i) {
      const int tok = tokens[sz(i)], pos = positions[sz(i)], s = slots[sz(i)];
      if (tok < 0 || tok >= c.vocab_size)
        fail(engine_errc::bad_token, "token " + std::to_string(tok) + " at batch row " + std::to_string(i) + " is outside [0, " + std::to_string(c.vocab_size) + ")");
      if (pos < 0 || pos >= c.seq_len)
        fail(engine_errc::bad_position, "position " + std::to_string(pos) + " at batch row " + std::to_string(i) + " is outside [0, seq_len " + std::to_string(c.seq_len) + ")");
      if (s < L || s >= opt.capacity)
        fail(engine_errc::bad_slot, "KV slot " + std::to_string(s) + " at batch row " + std::to_string(i) + " is outside [prefix " + std::to_string(L) + ", capacity " + std::to_string(opt.capacity) + ")");
      for (int j = 0; j < i; ++j)
        if (slots[sz(j)] == s) fail(engine_errc::bad_slot, "KV slot " + std::to_string(s) + " is used by batch rows " + std::to_string(j) + " and " + std::to_string(i));
    }
    if (mask.is_tree()) {
      const std::size_t words = sz((T + 31) / 32);
      if (mask.words().size() != sz(T) * words)
        fail(engine_errc::bad_mask, "tree mask has " + std::to_string(mask.words().size()) + " words, a batch of " + std::to_string(T) + " needs " + std::to_string(sz(T) * words));
      for (int i = 0; i < T; ++i) {
        if (!mask.visible(i, i, T)) fail(engine_errc::bad_mask, "tree mask row " + std::to_string(i) + " does not see itself");
        // Bits beyond T in the last word must be clear: they name no token.
        if (T % 32 != 0 && (mask.words()[sz(i) * words + words - 1] >> (T % 32)) != 0)
          fail(engine_errc::bad_mask, "tree mask row " + std::to_string(i) + " has bits set beyond column " + std::to_string(T - 1));
      }
    }
    for (std::size_t k = 0; k < out.rows.size(); ++k)
      if (out.rows[k] < 0 || out.rows[k] >= T)
        fail(engine_errc::bad_output, "output row " + std::to_string(out.rows[k]) + " is outside the batch [0, " + std::to_string(T) + ")");
    if (!out.logits.empty() && out.logits.size() != out.rows.size() * sz(c.vocab_size))
      fail(engine_errc::bad_output, "logits buffer has " + std::to_string(out.logits.size()) + " floats, " + std::to_string(out.rows.size()) + " rows need " + std::to_string(out.rows.size() * sz(c.vocab_size)));
    if (!out.hidden.empty() && out.hidden.size() != out.rows.size() * sz(c.dim))
      fail(engine_errc::bad_output, "hidden buffer has " + std::to_string(out.hidden.size()) + " floats, " + std::to_string(out.rows.size()) + " rows need " + std::to_string(out.rows.size() * sz(c.dim)));
  }

  void forward(std::span<const int> tokens, std::span<const int> positions, std::span<const int> slots,
               const mask_source& mask, const forward_outputs& out) {
    validate(tokens, positions, slots, mask, out);
    const int T = static_cast<int>(tokens.size());
    const int d = c.dim, kvd = c.kv_dim(), H = c.hidden_dim;
    for (int t = 0; t < T; ++t)
      std::memcpy(x.data() + sz(t) * sz(d), m.token_embedding() + sz(tokens[sz(t)]) * sz(d), sz(d) * sizeof(float));
    const std::size_t layer_stride = sz(opt.capacity) * sz(kvd);
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
      float* kc = k_cache.data() + sz(l) * layer_stride;
      float* vc = v_cache.data() + sz(l) * layer_stride;
      for (int t = 0; t < T; ++t) {
        rope(q.data() + sz(t) * sz(d), c.n_heads, positions[sz(t)]);
        rope(k.data() + sz(t) * sz(kvd), c.n_kv_heads, positions[sz(t)]);
        std::memcpy(kc + sz(slots[sz(t)]) * sz(kvd), k.data() + sz(t) * sz(kvd), sz(kvd) * sizeof(float));
        std::memcpy(vc + sz(slots[sz(t)]) * sz(kvd), v.data() + sz(t) * sz(kvd), sz(kvd) * sizeof(float));
      }
      detail::attention_problem ap{q.data(), att.data(), kc, vc, slots.data(), T, c.n_heads, c.n_kv_heads, c.head_dim(),
                                   mask, l, opt.core_attention ? &*view : nullptr};
      detail::attend(ap, score_scratch.data(), slot_scratch.data(), scratch_per_thread, pool);
      linear({{&pw.wo, w.wo, x.data(), d, epilogue::add}}, att.data(), T, d);
      for (int t = 0; t < T; ++t) detail::rmsnorm(xb.data() + sz(t) * sz(d), x.data() + sz(t) * sz(d), w.rms_ffn, d, c.rms_eps);
      linear({{&pw.w13, nullptr, h1.data(), H, epilogue::swiglu}}, xb.data(), T, d);
      linear({{&pw.w2, w.w2, x.data(), d, epilogue::add}}, h1.data(), T, H);
    }
    const int R = static_cast<int>(out.rows.size());
    if (R == 0) return;
    for (int k2 = 0; k2 < R; ++k2) {
      float* dst = xf.data() + sz(k2) * sz(d);
      detail::rmsnorm(dst, x.data() + sz(out.rows[sz(k2)]) * sz(d), m.rms_final(), d, c.rms_eps);
      if (!out.hidden.empty()) std::memcpy(out.hidden.data() + sz(k2) * sz(d), dst, sz(d) * sizeof(float));
    }
    if (!out.logits.empty()) {
      // Rows beyond max_batch are impossible (R ≤ rows of a batch ≤ max_batch is not required:
      // rows may repeat), so the classifier runs in groups of max_batch rows.
      for (int r0 = 0; r0 < R; r0 += opt.max_batch) {
        const int n = std::min(opt.max_batch, R - r0);
        linear({{&cls, m.classifier(), out.logits.data() + sz(r0) * sz(c.vocab_size), c.vocab_size, detail::epilogue::store}},
               xf.data() + sz(r0) * sz(d), n, d);
      }
    }
  }
};

engine::engine(model m, engine_options o) {
  const auto& c = m.config();
  auto bad = [](const std::string& msg) { throw engine_error(engine_errc::bad_option, msg); };
  if (o.capacity == 0) o.capacity = c.seq_len;
  if (o.capacity < 1 || o.capacity > (1 << 24)) bad("capacity " + std::to_string(o.capacity) + " is outside [1, 2^24]");
  if (o.max_batch < 1 || o.max_batch > 4096) bad("max_batch " + std::to_string(o.max_batch) + " is outside [1, 4096]");
  if (o.prefill_chunk < 1) bad("prefill_chunk " + std::to_string(o.prefill_chunk) + " must be positive");
  o.prefill_chunk = std::min(o.prefill_chunk, o.max_batch);
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
  s.view = medusa::make_kv_view<float>(std::span<float>(s.k_cache), std::span<float>(s.v_cache),
                                       medusa::kv_extents{c.n_layers, c.n_kv_heads, c.head_dim()}, o.capacity,
                                       medusa::kv_layout::nhd);
  s.scratch_per_thread = detail::attention_scratch_size(o.capacity, o.max_batch);
  s.score_scratch.assign(s.scratch_per_thread * sz(s.pool.size()), 0.0f);
  s.slot_scratch.assign(s.scratch_per_thread * sz(s.pool.size()), 0);
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
int engine::length() const noexcept { return p_->length; }
int engine::capacity() const noexcept { return p_->opt.capacity; }
int engine::threads() const noexcept { return p_->pool.size(); }
thread_pool& engine::pool() noexcept { return p_->pool; }

void engine::truncate(int n) {
  if (n < 0 || n > p_->length)
    throw engine_error(engine_errc::bad_slot, "truncate(" + std::to_string(n) + ") is outside [0, length " + std::to_string(p_->length) + "]");
  p_->length = n;
}

kv_layer_view engine::kv_layer(int l) {
  const auto& c = p_->c;
  if (l < 0 || l >= c.n_layers)
    throw engine_error(engine_errc::bad_option, "layer " + std::to_string(l) + " is outside [0, " + std::to_string(c.n_layers) + ")");
  const std::size_t stride = sz(p_->opt.capacity) * sz(c.kv_dim());
  return {p_->k_cache.data() + sz(l) * stride, p_->v_cache.data() + sz(l) * stride, sz(c.kv_dim()), c.n_kv_heads, c.head_dim(),
          p_->opt.capacity};
}

void engine::forward(std::span<const int> tokens, std::span<const int> positions, std::span<const int> kv_slots,
                     const mask_source& mask, const forward_outputs& out) {
  p_->forward(tokens, positions, kv_slots, mask, out);
  int hi = p_->length;
  for (int s : kv_slots) hi = std::max(hi, s + 1);
  p_->length = hi;
}

void engine::prefill(std::span<const int> tokens, int start, std::span<float> last_logits, std::span<float> last_hidden) {
  auto& s = *p_;
  const int n = static_cast<int>(tokens.size());
  if (n < 1) throw engine_error(engine_errc::bad_batch, "prefill of an empty prompt");
  if (start < 0 || start > s.length)
    throw engine_error(engine_errc::bad_slot, "prefill start " + std::to_string(start) + " is outside [0, length " + std::to_string(s.length) + "]");
  if (n > s.opt.capacity - start || n > s.c.seq_len - start)
    throw engine_error(engine_errc::bad_batch, "prompt of " + std::to_string(n) + " tokens after " + std::to_string(start) +
                                                   " does not fit capacity " + std::to_string(s.opt.capacity) + " / seq_len " + std::to_string(s.c.seq_len));
  std::vector<int> idx(sz(s.opt.prefill_chunk));
  for (int off = 0; off < n; off += s.opt.prefill_chunk) {
    const int m = std::min(s.opt.prefill_chunk, n - off);
    for (int i = 0; i < m; ++i) idx[sz(i)] = start + off + i;
    const bool last = off + m == n;
    int row[1] = {m - 1};
    forward_outputs out{last ? std::span<const int>(row, 1) : std::span<const int>{}, last ? last_logits : std::span<float>{},
                        last ? last_hidden : std::span<float>{}};
    std::span<const int> ids(idx.data(), sz(m));
    forward(tokens.subspan(sz(off), sz(m)), ids, ids, mask_source::causal(start + off), out);
  }
  s.length = start + n;
}

void engine::decode(int token, int pos, std::span<float> logits, std::span<float> hidden) {
  const int row[1] = {0};
  forward({&token, 1}, {&pos, 1}, {&pos, 1}, mask_source::causal(pos), {row, logits, hidden});
}

}  // namespace medusa_llama
