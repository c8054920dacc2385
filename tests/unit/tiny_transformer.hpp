// SPDX-License-Identifier: Apache-2.0
// A tiny but real transformer (2 layers, GQA, RoPE, SiLU MLP, library attention) and draft heads
// for it (random, and oracles that know the greedy continuation), shared by the decoder tests.
#pragma once

#include <medusa/attention.hpp>
#include <medusa/decoder.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <span>
#include <vector>

namespace tiny {

// A small but real decoder-only transformer. Weights are random with a large enough scale that
// argmaxes are far from ties.
class tiny_model {
 public:
  static constexpr int vocab = 40, dim = 32, layers = 2, q_heads = 4, kv_heads = 2, head_dim = 8, ffn = 48;

  explicit tiny_model(int capacity, std::uint32_t seed = 7) : capacity_(capacity) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& w, std::size_t size, float scale) {
      w.resize(size);
      for (float& x : w) x = n(rng) * scale;
    };
    fill(embed_, vocab * dim, 1.0f);
    const float s = 1.0f / std::sqrt(static_cast<float>(dim));
    for (int l = 0; l < layers; ++l) {
      layer_w& w = layer_[l];
      fill(w.wq, dim * q_heads * head_dim, s);
      fill(w.wk, dim * kv_heads * head_dim, s);
      fill(w.wv, dim * kv_heads * head_dim, s);
      fill(w.wo, q_heads * head_dim * dim, s);
      fill(w.w1, dim * ffn, s);
      fill(w.w2, ffn * dim, 1.0f / std::sqrt(static_cast<float>(ffn)));
    }
    fill(lm_head_, dim * vocab, 3.0f * s);
    const std::size_t kv_size = static_cast<std::size_t>(layers) * capacity * kv_heads * head_dim;
    k_.assign(kv_size, 0.0f);
    v_.assign(kv_size, 0.0f);
    kv_ = medusa::make_kv_view<float>(k_, v_, medusa::kv_extents{layers, kv_heads, head_dim}, capacity);
  }

  [[nodiscard]] int capacity() const { return capacity_; }
  int vocab_size() const { return vocab; }
  int hidden_size() const { return dim; }
  medusa::kv_cache_view<float> kv_cache() const { return kv_; }
  int forward_calls = 0;

  void forward(const medusa::forward_batch& b) {
    ++forward_calls;
    REQUIRE(b.cache_length + static_cast<int>(b.tokens.size()) <= capacity_);
    run(kv_, b);
  }

  //! The forward pass over any writable KV view of this model's extents (a batch engine runs each
  //! request through it with that request's view). Rows are independent of the batch around them.
  template <class View>
  void run(const View& kv, const medusa::forward_batch& b) const {
    const int T = static_cast<int>(b.tokens.size());
    REQUIRE(b.positions.size() == b.tokens.size());
    std::vector<float> x(static_cast<std::size_t>(T) * dim), xn(x.size());
    for (int i = 0; i < T; ++i) {
      REQUIRE(b.tokens[i] >= 0);
      REQUIRE(b.tokens[i] < vocab);
      for (int j = 0; j < dim; ++j) x[i * dim + j] = embed_[b.tokens[i] * dim + j];
    }
    std::vector<float> q(static_cast<std::size_t>(T) * q_heads * head_dim), att(q.size());
    std::vector<float> kk(static_cast<std::size_t>(kv_heads) * head_dim), vv(kk.size()), hid(ffn);
    for (int l = 0; l < layers; ++l) {
      const layer_w& w = layer_[l];
      rmsnorm(x, xn, T);
      for (int i = 0; i < T; ++i) {
        const float* xi = &xn[i * dim];
        matvec(xi, w.wq.data(), dim, q_heads * head_dim, &q[i * q_heads * head_dim]);
        matvec(xi, w.wk.data(), dim, kv_heads * head_dim, kk.data());
        matvec(xi, w.wv.data(), dim, kv_heads * head_dim, vv.data());
        const int pos = b.positions[i];
        for (int h = 0; h < q_heads; ++h) rope(&q[(i * q_heads + h) * head_dim], pos);
        for (int h = 0; h < kv_heads; ++h) {
          rope(&kk[h * head_dim], pos);
          for (int e = 0; e < head_dim; ++e) {
            kv.k(l, b.cache_length + i, h, e) = kk[h * head_dim + e];
            kv.v(l, b.cache_length + i, h, e) = vv[h * head_dim + e];
          }
        }
      }
      if (b.tree_mask.empty())
        medusa::causal_attention(kv, l, b.cache_length, q, T, q_heads, att);
      else
        medusa::tree_attention(kv, l, b.cache_length, q, T, q_heads,
                               b.tree_mask, att);
      for (int i = 0; i < T; ++i) {
        std::vector<float> o(dim);
        matvec(&att[i * q_heads * head_dim], w.wo.data(), q_heads * head_dim, dim, o.data());
        for (int j = 0; j < dim; ++j) x[i * dim + j] += o[j];
      }
      rmsnorm(x, xn, T);
      for (int i = 0; i < T; ++i) {
        matvec(&xn[i * dim], w.w1.data(), dim, ffn, hid.data());
        for (float& a : hid) a = a / (1.0f + std::exp(-a));
        std::vector<float> o(dim);
        matvec(hid.data(), w.w2.data(), ffn, dim, o.data());
        for (int j = 0; j < dim; ++j) x[i * dim + j] += o[j];
      }
    }
    rmsnorm(x, xn, T);
    const int rows = T - b.first_output_row;
    REQUIRE(b.logits.size() == static_cast<std::size_t>(rows) * vocab);
    REQUIRE(b.hidden.size() == static_cast<std::size_t>(rows) * dim);
    for (int r = 0; r < rows; ++r) {
      const float* h = &xn[(b.first_output_row + r) * dim];
      for (int j = 0; j < dim; ++j) b.hidden[r * dim + j] = h[j];
      matvec(h, lm_head_.data(), dim, vocab, &b.logits[static_cast<std::size_t>(r) * vocab]);
    }
  }

 private:
  struct layer_w {
    std::vector<float> wq, wk, wv, wo, w1, w2;
  };
  static void matvec(const float* x, const float* w, int in, int out, float* y) {
    for (int o = 0; o < out; ++o) y[o] = 0.0f;
    for (int i = 0; i < in; ++i)
      for (int o = 0; o < out; ++o) y[o] += x[i] * w[i * out + o];
  }
  static void rmsnorm(const std::vector<float>& x, std::vector<float>& y, int T) {
    for (int i = 0; i < T; ++i) {
      float ss = 0.0f;
      for (int j = 0; j < dim; ++j) ss += x[i * dim + j] * x[i * dim + j];
      const float r = 1.0f / std::sqrt(ss / dim + 1e-5f);
      for (int j = 0; j < dim; ++j) y[i * dim + j] = x[i * dim + j] * r;
    }
  }
  static void rope(float* v, int pos) {
    for (int e = 0; e < head_dim; e += 2) {
      const float freq = std::pow(10000.0f, -static_cast<float>(e) / head_dim);
      const float c = std::cos(pos * freq), s = std::sin(pos * freq);
      const float a = v[e], b = v[e + 1];
      v[e] = a * c - b * s;
      v[e + 1] = a * s + b * c;
    }
  }

  int capacity_;
  std::vector<float> embed_, lm_head_, k_, v_;
  layer_w layer_[layers];
  medusa::kv_cache_view<float> kv_;
};

static_assert(medusa::decoder_model<tiny_model>);

// Heads with random projections of the hidden state: low acceptance, arbitrary drafts.
struct random_heads {
  int heads;
  std::vector<float> w;  // [heads][vocab][dim]
  random_heads(int h, std::uint32_t seed) : heads(h), w(static_cast<std::size_t>(h) * tiny_model::vocab * tiny_model::dim) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (float& x : w) x = n(rng);
  }
  int num_heads() const { return heads; }
  void forward(std::span<const float> h, std::span<float> logits) const {
    REQUIRE(h.size() == static_cast<std::size_t>(tiny_model::dim));
    REQUIRE(logits.size() == static_cast<std::size_t>(heads) * tiny_model::vocab);
    for (std::size_t r = 0; r < logits.size(); ++r) {
      float s = 0.0f;
      for (int j = 0; j < tiny_model::dim; ++j) s += w[r * tiny_model::dim + j] * h[j];
      logits[r] = s;
    }
  }
};
static_assert(medusa::draft_heads<random_heads>);

// Heads that know the future: they find the position of the hidden state they are given among
// the states of the plain greedy run (nearest neighbour) and rank the true token at t+2+k first,
// second or third (seeded per position), so steps accept 0..depth drafts through many paths.
struct oracle_heads {
  int heads;
  std::vector<std::int32_t> sequence;  // prompt + greedy continuation
  std::vector<float> states;           // hidden state at every position of `sequence`
  int calls = 0;
  // Further sequences (a batch of requests): searched after the first.
  std::vector<std::vector<std::int32_t>> more_sequences = {};
  std::vector<std::vector<float>> more_states = {};
  int num_heads() const { return heads; }
  void forward(std::span<const float> h, std::span<float> logits) {
    ++calls;
    // The nearest stored state: which sequence, which position.
    const std::vector<std::int32_t>* seq = &sequence;
    int best = 0;
    float best_d = std::numeric_limits<float>::max();
    auto search = [&](const std::vector<std::int32_t>& sq, const std::vector<float>& st) {
      const int positions = static_cast<int>(st.size() / tiny_model::dim);
      for (int t = 0; t < positions; ++t) {
        float d = 0.0f;
        for (int j = 0; j < tiny_model::dim; ++j) {
          const float e = st[t * tiny_model::dim + j] - h[j];
          d += e * e;
        }
        if (d < best_d) best_d = d, best = t, seq = &sq;
      }
    };
    search(sequence, states);
    for (std::size_t i = 0; i < more_sequences.size(); ++i) search(more_sequences[i], more_states[i]);
    REQUIRE(best_d < 1e-6f);  // the decoder hands the heads the state of an accepted position
    for (int k = 0; k < heads; ++k) {
      float* row = &logits[static_cast<std::size_t>(k) * tiny_model::vocab];
      for (int x = 0; x < tiny_model::vocab; ++x) row[x] = -static_cast<float>((x * 7 + k * 3 + best) % tiny_model::vocab) / 8.0f;
      const int target = best + 2 + k;
      if (target >= static_cast<int>(seq->size())) continue;
      const int truth = (*seq)[target];
      const int rank = static_cast<int>((static_cast<unsigned>(best) * 2654435761u + static_cast<unsigned>(k) * 40503u) >> 16) % 4;
      if (rank == 3) continue;  // not in the top 3 at all
      // Put `truth` at `rank`: raise it above all but `rank` others.
      std::vector<int> order(tiny_model::vocab);
      for (int x = 0; x < tiny_model::vocab; ++x) order[x] = x;
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
      float above = row[order[0]] + 1.0f;
      int placed = 0;
      for (int x : order) {
        if (x == truth) continue;
        if (placed == rank) break;
        row[x] = above + static_cast<float>(rank - placed);
        ++placed;
      }
      row[truth] = above - 0.5f;
    }
  }
};

// Logits [T][vocab] and hidden states [T][dim] of every position of `seq` (a fresh forward from slot 0).
struct sequence_outputs {
  std::vector<float> logits, hidden;
};
inline sequence_outputs outputs_of(tiny_model& m, const std::vector<std::int32_t>& seq) {
  const int T = static_cast<int>(seq.size());
  std::vector<std::int32_t> pos(T);
  for (int i = 0; i < T; ++i) pos[i] = i;
  sequence_outputs out{std::vector<float>(static_cast<std::size_t>(T) * tiny_model::vocab),
                       std::vector<float>(static_cast<std::size_t>(T) * tiny_model::dim)};
  medusa::forward_batch b;
  b.tokens = seq;
  b.positions = pos;
  b.logits = out.logits;
  b.hidden = out.hidden;
  m.forward(b);
  return out;
}

inline std::vector<float> states_of(tiny_model& m, const std::vector<std::int32_t>& seq) { return outputs_of(m, seq).hidden; }


// Request `i` of a ragged batch as the forward_batch a model runs for it alone: its tokens,
// positions, cache length and mask, and its rows of the batch's logits and hidden states.
inline medusa::forward_batch request_slice(const medusa::ragged_batch& b, int i) {
  const std::size_t V = tiny_model::vocab, d = tiny_model::dim;
  const auto u = static_cast<std::size_t>(i);
  const auto r0 = static_cast<std::size_t>(b.qo_indptr[u]);
  const int n = b.count(i);
  medusa::forward_batch f;
  f.tokens = b.tokens.subspan(r0, static_cast<std::size_t>(n));
  f.positions = b.positions.subspan(r0, static_cast<std::size_t>(n));
  f.cache_length = b.cache_lengths[u];
  f.tree_mask = b.mask_of(i);
  f.first_output_row = b.last_row_only ? n - 1 : 0;
  const std::size_t out0 = b.last_row_only ? u : r0;
  const std::size_t rows = static_cast<std::size_t>(n - f.first_output_row);
  f.logits = b.logits.subspan(out0 * V, rows * V);
  f.hidden = b.hidden.subspan(out0 * d, rows * d);
  return f;
}

// A ragged-batch engine over a tiny_model's weights, one contiguous cache of `capacity` slots per
// request id.
class batch_engine {
 public:
  batch_engine(const tiny_model& w, int capacity) : w_(w), capacity_(capacity) {}
  int vocab_size() const { return tiny_model::vocab; }
  int hidden_size() const { return tiny_model::dim; }
  medusa::kv_cache_view<float> kv_cache(int r) {
    auto& c = caches_[r];
    const std::size_t size =
        static_cast<std::size_t>(tiny_model::layers) * static_cast<std::size_t>(capacity_) * tiny_model::kv_heads * tiny_model::head_dim;
    if (c.k.empty()) c.k.assign(size, 0.0f), c.v.assign(size, 0.0f);
    return medusa::make_kv_view<float>(c.k, c.v, {tiny_model::layers, tiny_model::kv_heads, tiny_model::head_dim}, capacity_);
  }
  void forward(const medusa::ragged_batch& b) {
    for (int i = 0; i < b.size(); ++i) w_.run(kv_cache(b.requests[static_cast<std::size_t>(i)]), request_slice(b, i));
  }

 private:
  struct cache {
    std::vector<float> k, v;
  };
  const tiny_model& w_;
  int capacity_;
  std::map<int, cache> caches_;
};

// Serves `prompts` through the batch decoder `dec` (request ids 10, 11, …; prompt r asks for
// 40 + 10·r new tokens, joining at once) and checks that every request finished without an error
// and with the tokens of plain greedy decoding on a fresh `tiny_model(capacity)`.
template <class BatchDecoder>
void check_batch_lossless(BatchDecoder& dec, const std::vector<std::vector<std::int32_t>>& prompts, int capacity) {
  auto asked = [](std::size_t r) {
    medusa::decode_options opt;
    opt.max_new_tokens = 40 + 10 * static_cast<int>(r);
    return opt;
  };
  std::map<int, std::vector<std::int32_t>> out;
  for (std::size_t r = 0; r < prompts.size(); ++r) dec.join(10 + static_cast<int>(r), prompts[r], asked(r));
  while (dec.size() > 0)
    for (auto& u : dec.step())
      if (u.finished) {
        REQUIRE_FALSE(u.error);
        out[u.request] = u.result.tokens;
      }
  for (std::size_t r = 0; r < prompts.size(); ++r) {
    tiny_model alone(capacity);
    CHECK(out[10 + static_cast<int>(r)] == medusa::generate_vanilla(alone, prompts[r], medusa::greedy_policy{}, asked(r)).tokens);
  }
}

}  // namespace tiny
