// SPDX-License-Identifier: Apache-2.0
// The forward pass: embeddings → n_layers × (RMSNorm, QKV, RoPE, KV write, attention, Wo +
// residual, RMSNorm, SwiGLU FFN + residual) → final RMSNorm → classifier, over the segments of a
// pass (see layer_stack.hpp).
#include "layer_stack.hpp"

#include <medusa/attention.hpp>
#include <medusa/heads.hpp>

#include "kernels.hpp"
#include "simd/attention.hpp"
#include "simd/targets.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <cassert>
#include <cmath>
#include <cstring>
#include <utility>

#if defined(MEDUSA_LLAMA_HAVE_OPENBLAS)
#include <cblas.h>
#endif

namespace medusa_llama::detail {

namespace {

std::size_t sz(int v) { return static_cast<std::size_t>(v); }

[[noreturn]] void fail(engine_errc code, const std::string& msg, int request = -1) {
  throw engine_error(code, msg, request);
}

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

void check_stack_options(const stack_options& o) {
  auto bad = [](const std::string& msg) { fail(engine_errc::bad_option, msg); };
  if (o.threads < 0 || o.threads > 256) bad("threads " + std::to_string(o.threads) + " is outside [0, 256]");
  for (const weight_format f : {o.weights, o.classifier_format()}) {
    if (f == weight_format::int8)
      bad("int8 (per-column) weights are for Medusa heads only (packed_heads); the model takes f32, bf16, q8_0 or q4_0");
    if (f != weight_format::f32 && f != weight_format::bf16 && f != weight_format::q8_0 && f != weight_format::q4_0)
      bad("weight format " + std::to_string(static_cast<int>(f)) + " is unknown");
  }
  if (o.blas_min_batch < 2) bad("blas_min_batch " + std::to_string(o.blas_min_batch) + " must be at least 2");
}

void check_rows(const model_config& c, std::span<const std::int32_t> tokens, std::span<const std::int32_t> positions,
                int row0, const std::string& context, int request) {
  const int n = static_cast<int>(tokens.size());
  for (int i = 0; i < n; ++i) {
    const int tok = tokens[sz(i)], pos = positions[sz(i)];
    const std::string row = std::to_string(row0 + i);
    if (tok < 0 || tok >= c.vocab_size)
      fail(engine_errc::bad_token, context + "token " + std::to_string(tok) + " at batch row " + row + " is outside [0, " + std::to_string(c.vocab_size) + ")", request);
    if (pos < 0 || pos >= c.seq_len)
      fail(engine_errc::bad_position, context + "position " + std::to_string(pos) + " at batch row " + row + " is outside [0, seq_len " + std::to_string(c.seq_len) + ")", request);
  }
}

void check_outputs(const model_config& c, std::size_t rows, std::span<const float> logits, std::span<const float> hidden) {
  if (!logits.empty() && logits.size() != rows * sz(c.vocab_size))
    fail(engine_errc::bad_output, "logits buffer has " + std::to_string(logits.size()) + " floats, " + std::to_string(rows) + " rows need " + std::to_string(rows * sz(c.vocab_size)));
  if (!hidden.empty() && hidden.size() != rows * sz(c.dim))
    fail(engine_errc::bad_output, "hidden buffer has " + std::to_string(hidden.size()) + " floats, " + std::to_string(rows) + " rows need " + std::to_string(rows * sz(c.dim)));
}

void check_tree_mask(const medusa::tree_mask_view& m, int n) {
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

layer_stack::layer_stack(model mm, const stack_options& o) : m_(std::move(mm)), c_(m_.config()), opt_(o),
      own_pool_(o.pool ? nullptr : std::make_unique<thread_pool>(o.threads)), pool_(o.pool ? o.pool : own_pool_.get()) {
  apply_cpu_target_environment();
  opt_.threads = pool_->size();
#if defined(MEDUSA_LLAMA_HAVE_OPENBLAS)
  // The stack splits each GEMM across its own threads; OpenBLAS threads would fight them.
  openblas_set_num_threads(1);
#endif
  const std::size_t B = sz(o.max_rows), d = sz(c_.dim), kvd = sz(c_.kv_dim()), H = sz(c_.hidden_dim);
  for (auto* buf : {&x_, &xb_, &q_, &att_, &xf_}) buf->assign(B * d, 0.0f);
  for (auto* buf : {&k_, &v_}) buf->assign(B * kvd, 0.0f);
  for (auto* buf : {&h1_, &h3_}) buf->assign(B * H, 0.0f);
  pack_weights();
  // RoPE tables in float, as llama2.c's run.c and HF compute them.
  const int hd = c_.head_dim(), half = hd / 2;
  rope_cos_.resize(sz(c_.seq_len) * sz(half));
  rope_sin_.resize(rope_cos_.size());
  for (int pos = 0; pos < c_.seq_len; ++pos)
    for (int i = 0; i < half; ++i) {
      const float freq = 1.0f / std::pow(c_.rope_theta, static_cast<float>(2 * i) / static_cast<float>(hd));
      const float val = static_cast<float>(pos) * freq;
      rope_cos_[sz(pos) * sz(half) + sz(i)] = std::cos(val);
      rope_sin_[sz(pos) * sz(half) + sz(i)] = std::sin(val);
    }
}

bool layer_stack::use_blas(int T) const {
  if (T <= 1 || !have_blas() || opt_.weights != weight_format::f32 || opt_.classifier_format() != weight_format::f32) return false;
  switch (opt_.backend) {
    case gemm_backend::builtin: return false;
    case gemm_backend::blas: return true;
    case gemm_backend::automatic: return T >= opt_.blas_min_batch;
  }
  return false;
}

// The projection weights packed once into the kernels' panel layout (gemm.hpp).
//
// Ownership: the passes read the packed copies, plus the model's embedding rows and norms; the
// model's own matrices are read again only by the OpenBLAS path and by whoever else holds the model
// (export, the trainer, tests). So unless this stack may take the OpenBLAS path, each matrix of a
// memory-mapped model is released as soon as it is packed (model::release_pages): its pages leave
// the resident set, and any later reader maps them in again from the file. The resident weights are
// then one copy (plus the matrix being packed), not the file and the copy. Owned buffers (GGUF,
// Hugging Face, random) stay as they are: dropping their pages would lose them.
void layer_stack::pack_weights() {
  const weight_format f = opt_.weights;
  const int d = c_.dim, kvd = c_.kv_dim(), H = c_.hidden_dim;
  const bool release = !use_blas(opt_.max_rows);
  auto packed = [&](const float* w, int rows, int cols) {
    if (release) m_.release_pages(w, sz(rows) * sz(cols));
  };
  packed_.resize(sz(c_.n_layers));
  for (int l = 0; l < c_.n_layers; ++l) {
    const layer_weights& w = m_.layer(l);
    auto& p = packed_[sz(l)];
    p.wq = packed_matrix(w.wq, d, d, f);
    packed(w.wq, d, d);
    p.wk = packed_matrix(w.wk, kvd, d, f);
    packed(w.wk, kvd, d);
    p.wv = packed_matrix(w.wv, kvd, d, f);
    packed(w.wv, kvd, d);
    p.wo = packed_matrix(w.wo, d, d, f);
    packed(w.wo, d, d);
    p.w13 = packed_matrix::swiglu_pair(w.w1, w.w3, H, d, f);
    packed(w.w1, H, d);
    packed(w.w3, H, d);
    p.w2 = packed_matrix(w.w2, d, H, f);
    packed(w.w2, d, H);
  }
  cls_ = packed_matrix(m_.classifier(), c_.vocab_size, d, opt_.classifier_format());
  if (m_.classifier() != m_.token_embedding()) packed(m_.classifier(), c_.vocab_size, d);  // a tied one is the embedding
}

std::size_t layer_stack::packed_bytes() const noexcept {
  std::size_t n = cls_.bytes() + cls_.block_bytes_extra();
  for (const auto& p : packed_)
    for (const packed_matrix* w : {&p.wq, &p.wk, &p.wv, &p.wo, &p.w13, &p.w2}) n += w->bytes() + w->block_bytes_extra();
  return n;
}

// Several projections sharing X (T rows of `in`), their column groups split across the threads in
// one fork-join job.
void layer_stack::linear(std::initializer_list<pjob> jobs, const float* X, int T, int in) {
  if (use_blas(T)) {
    linear_blas(jobs, X, T, in);
    return;
  }
  const gemm_input gi{X, sz(in), T};
  gemm_job packed[3];  // the callers pass Q/K/V at most
  assert(jobs.size() <= std::size(packed));
  std::size_t n = 0;
  for (const auto& j : jobs) packed[n++] = {j.W, gi, j.Y, sz(j.ldy), j.op};
  run_gemm_jobs(*pool_, std::span(packed, n));
}

// The OpenBLAS path (gemm_backend::blas / automatic above blas_min_batch), on the model's own
// row-major float32 weights, rows split across the threads.
void layer_stack::linear_blas(std::initializer_list<pjob> jobs, const float* X, int T, int in) {
  for (const auto& j : jobs)
    if (j.op == epilogue::swiglu) {
      swiglu_blas(X, T);
      return;
    }
  int total = 0;
  for (const auto& j : jobs) total += j.W->rows();
  const row_chunks rc(total, pool_->size());
  pool_->run(rc.n, [&](int chunk, int) {
    int a, b;
    rc.range(chunk, a, b);
    int base = 0;
    for (const auto& j : jobs) {
      const int r0 = std::max(a - base, 0), r1 = std::min(b - base, j.W->rows());
      const bool acc = j.op == epilogue::add;
      if (r0 < r1 && !linear_rows_blas(j.raw, X, j.Y, T, in, j.ldy, r0, r1, acc))
        linear_rows(j.raw, X, j.Y, T, in, j.ldy, r0, r1, acc);
      base += j.W->rows();
    }
  });
}

// h1 = silu(X W1^T) ⊙ (X W3^T) through OpenBLAS, each thread owning a range of hidden units.
void layer_stack::swiglu_blas(const float* X, int T) {
  const layer_weights& w = m_.layer(cur_layer_);
  const int H = c_.hidden_dim, d = c_.dim;
  const row_chunks rc(H, pool_->size());
  pool_->run(rc.n, [&](int chunk, int) {
    int a, b;
    rc.range(chunk, a, b);
    for (const float* W : {w.w1, w.w3}) {
      float* Y = W == w.w1 ? h1_.data() : h3_.data();
      if (!linear_rows_blas(W, X, Y, T, d, H, a, b, false)) linear_rows(W, X, Y, T, d, H, a, b, false);
    }
    for (int t = 0; t < T; ++t) silu_mul(h1_.data() + sz(t) * sz(H) + a, h3_.data() + sz(t) * sz(H) + a, b - a);
  });
}

void layer_stack::rope(float* vec, int n_heads_here, int pos) const {
  const std::size_t half = sz(c_.head_dim() / 2);
  detail::rope(vec, n_heads_here, c_.head_dim(), rope_cos_.data() + sz(pos) * half, rope_sin_.data() + sz(pos) * half,
               c_.rope == rope_style::adjacent_pairs);
}

void layer_stack::embed(std::span<const std::int32_t> tokens) {
  const int d = c_.dim;
  for (std::size_t t = 0; t < tokens.size(); ++t)
    std::memcpy(x_.data() + t * sz(d), m_.token_embedding() + sz(tokens[t]) * sz(d), sz(d) * sizeof(float));
}

// RMSNorm, the Q/K/V projections of all rows, RoPE at each row's position.
void layer_stack::project_qkv(int l, std::span<const std::int32_t> positions) {
  const int T = static_cast<int>(positions.size());
  const int d = c_.dim, kvd = c_.kv_dim();
  const layer_weights& w = m_.layer(l);
  const packed_layer& pw = packed_[sz(l)];
  cur_layer_ = l;
  for (int t = 0; t < T; ++t) rmsnorm(xb_.data() + sz(t) * sz(d), x_.data() + sz(t) * sz(d), w.rms_att, d, c_.rms_eps);
  linear({{&pw.wq, w.wq, q_.data(), d, epilogue::store},
          {&pw.wk, w.wk, k_.data(), kvd, epilogue::store},
          {&pw.wv, w.wv, v_.data(), kvd, epilogue::store}},
         xb_.data(), T, d);
  for (int t = 0; t < T; ++t) {
    rope(q_.data() + sz(t) * sz(d), c_.n_heads, positions[sz(t)]);
    rope(k_.data() + sz(t) * sz(kvd), c_.n_kv_heads, positions[sz(t)]);
  }
}

// Wo + residual, RMSNorm, SwiGLU FFN + residual over all rows.
void layer_stack::finish_layer(int l, int T) {
  const int d = c_.dim, H = c_.hidden_dim;
  const layer_weights& w = m_.layer(l);
  const packed_layer& pw = packed_[sz(l)];
  linear({{&pw.wo, w.wo, x_.data(), d, epilogue::add}}, att_.data(), T, d);
  for (int t = 0; t < T; ++t) rmsnorm(xb_.data() + sz(t) * sz(d), x_.data() + sz(t) * sz(d), w.rms_ffn, d, c_.rms_eps);
  linear({{&pw.w13, nullptr, h1_.data(), H, epilogue::swiglu}}, xb_.data(), T, d);
  linear({{&pw.w2, w.w2, x_.data(), d, epilogue::add}}, h1_.data(), T, H);
}

// Final RMSNorm of the listed rows, then the classifier over them.
void layer_stack::outputs(std::span<const int> out_rows, float* logits, float* hidden) {
  const int R = static_cast<int>(out_rows.size());
  if (R == 0 || (logits == nullptr && hidden == nullptr)) return;
  const int d = c_.dim;
  for (int r = 0; r < R; ++r) {
    float* dst = xf_.data() + sz(r) * sz(d);
    rmsnorm(dst, x_.data() + sz(out_rows[sz(r)]) * sz(d), m_.rms_final(), d, c_.rms_eps);
    if (hidden != nullptr) std::memcpy(hidden + sz(r) * sz(d), dst, sz(d) * sizeof(float));
  }
  if (logits != nullptr) linear({{&cls_, m_.classifier(), logits, c_.vocab_size, epilogue::store}}, xf_.data(), R, d);
}

template <class View>
void layer_stack::run(std::span<const std::int32_t> tokens, std::span<const std::int32_t> positions,
                      std::span<const segment<View>> segments, std::span<const int> out_rows, float* logits,
                      float* hidden, const float* inputs) {
  const int T = static_cast<int>(tokens.size());
  const int d = c_.dim, kvd = c_.kv_dim();
  auto on_pool = [this](std::size_t count, auto&& body) {
    pool_->run(static_cast<int>(count), [&body](int i, int) { body(static_cast<std::size_t>(i)); });
  };
  // One request's K/V writes and attention, its work spread by `pf`.
  auto attend = [&](const segment<View>& s, int l, auto&& pf) {
    if (s.rows == 0) return;
    // NHD rows (contiguous or paged): the KV heads of one slot are one run of kv_dim floats.
    for (int i = 0; i < s.rows; ++i) {
      const std::size_t t = sz(s.row0 + i);
      std::memcpy(s.kv.k_row(l, s.cache_length + i, 0), k_.data() + t * sz(kvd), sz(kvd) * sizeof(float));
      std::memcpy(s.kv.v_row(l, s.cache_length + i, 0), v_.data() + t * sz(kvd), sz(kvd) * sizeof(float));
    }
    const std::size_t r0 = sz(s.row0) * sz(d), rn = sz(s.rows) * sz(d);
    const std::span<const float> qs(q_.data() + r0, rn);
    const std::span<float> out(att_.data() + r0, rn);
    // The library's attention on the engine's kernels, dispatched to this CPU's instruction set.
    const medusa::attention_options ao{.kernels = &attention_kernels()};
    if (s.mask.empty())
      medusa::causal_attention(s.kv, l, s.cache_length, qs, s.rows, c_.n_heads, out, ao, pf);
    else
      medusa::tree_attention(s.kv, l, s.cache_length, qs, s.rows, c_.n_heads, s.mask, out, ao, pf);
  };
  if (inputs) std::memcpy(x_.data(), inputs, tokens.size() * sz(c_.dim) * sizeof(float));
  else embed(tokens);
  for (int l = 0; l < c_.n_layers; ++l) {
    project_qkv(l, positions);
    if (segments.size() == 1) {
      attend(segments[0], l, on_pool);  // one request: its heads share the threads
    } else {
      // Several requests: one fork-join per layer over the requests (not one per request), each
      // request's attention on one thread. Jobs must not throw: the first error is rethrown here
      // (the callers validate first, so none is expected).
      std::exception_ptr error;
      std::atomic_flag failed;
      pool_->run(static_cast<int>(segments.size()), [&](int i, int) {
        try {
          attend(segments[sz(i)], l, medusa::sequential_for{});
        } catch (...) {
          if (!failed.test_and_set()) error = std::current_exception();
        }
      });
      if (error) std::rethrow_exception(error);
    }
    finish_layer(l, T);
  }
  outputs(out_rows, logits, hidden);
}

template void layer_stack::run(std::span<const std::int32_t>, std::span<const std::int32_t>,
                               std::span<const segment<medusa::kv_cache_view<float>>>, std::span<const int>, float*,
                               float*, const float*);
template void layer_stack::run(std::span<const std::int32_t>, std::span<const std::int32_t>,
                               std::span<const segment<medusa::paged_kv_cache_view<float>>>, std::span<const int>,
                               float*, float*, const float*);

}  // namespace medusa_llama::detail
