// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/trainer.hpp>

#include "common.hpp"

#include <medusa_llama/thread_pool.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numbers>
#include <set>

namespace medusa_train {

namespace {

// A splitmix64 stream.
struct rng64 {
  std::uint64_t s;
  std::uint64_t next() noexcept {
    const std::uint64_t r = detail::mix(s);
    s += 0x9e3779b97f4a7c15ull;
    return r;
  }
  std::uint64_t below(std::uint64_t n) noexcept { return detail::below(next(), n); }  // uniform in [0, n), n > 0
};

using detail::clock_type;
using detail::seconds_since;

float* arena_begin(medusa::head_weights& w) {
  return reinterpret_cast<float*>(w.num_layers() > 0 ? w.resblock_weight_bytes(0, 0).data() : w.projection_bytes(0).data());
}

}  // namespace

double learning_rate(const optimizer_options& o, std::size_t step, std::size_t total) {
  if (total == 0) return o.lr;
  const auto warm = static_cast<std::size_t>(std::ceil(o.warmup_fraction * static_cast<double>(total)));
  if (step < warm) return o.lr * static_cast<double>(step + 1) / static_cast<double>(warm);
  const double span = static_cast<double>(std::max<std::size_t>(1, total - warm));
  const double p = std::min(1.0, static_cast<double>(step - warm) / span);
  const double c = 0.5 * (1.0 + std::cos(std::numbers::pi * p));
  return o.lr * (o.min_lr_fraction + (1.0 - o.min_lr_fraction) * c);
}

// ---------------------------------------------------------------------------------------------
// head_trainer
// ---------------------------------------------------------------------------------------------

head_trainer::head_trainer(const head_shape& shape, const float* lm_head, std::uint64_t seed, int threads) : shape_(shape) {
  check_shape(shape);
  if (threads < 1) throw medusa::invalid_input("train: threads must be >= 1, got " + std::to_string(threads));
  weights_ = medusa::head_weights::initialize(shape.d, shape.V, shape.K, shape.L, medusa::projection_kind::per_head,
                                              medusa::weight_dtype::f32,
                                              lm_head ? medusa::weight_ptr::of(lm_head) : medusa::weight_ptr{}, seed);
  start(threads);
}

void head_trainer::start(int threads) {
  if (weights_.size_bytes() != shape_.num_params() * sizeof(float))
    throw medusa::invalid_input("train: head_weights layout differs from the trainer's");
  grads_.assign(shape_.num_params(), 0.0f);
  m_.assign(shape_.num_params(), 0.0f);
  v_.assign(shape_.num_params(), 0.0f);
  pool_ = std::make_unique<medusa_llama::thread_pool>(threads);
  openblas_set_num_threads(threads);
}

head_trainer::~head_trainer() = default;

std::span<float> head_trainer::params() noexcept { return {arena_begin(weights_), shape_.num_params()}; }
std::span<const float> head_trainer::params() const noexcept {
  return {arena_begin(const_cast<medusa::head_weights&>(weights_)), shape_.num_params()};
}

int head_trainer::threads() const noexcept { return pool_->size(); }

void head_trainer::parallel_for(std::size_t n, const std::function<void(std::size_t)>& body) {
  if (n == 0) return;
  const int threads = pool_->size();
  const std::size_t chunk = std::max<std::size_t>(1, (n + 4 * static_cast<std::size_t>(threads) - 1) / (4 * static_cast<std::size_t>(threads)));
  const int chunks = static_cast<int>((n + chunk - 1) / chunk);
  pool_->run(chunks, [&](int c, int) {
    const std::size_t b = static_cast<std::size_t>(c) * chunk, e = std::min(n, b + chunk);
    for (std::size_t i = b; i < e; ++i) body(i);
  });
}

head_batch_stats head_trainer::loss(const float* x, std::size_t batch, const std::int32_t* targets, std::span<const float> hw) {
  if (hw.size() != shape_.K) throw medusa::invalid_input("train: " + std::to_string(hw.size()) + " head weights for " + std::to_string(shape_.K) + " heads");
  return head_loss_grad<float>(shape_, params().data(), nullptr, x, batch, targets, hw.data(), ws_,
                               [this](std::size_t n, const auto& f) { parallel_for(n, f); });
}

head_trainer::head_trainer(const medusa::head_weights& init, int threads) {
  if (init.kind() != medusa::projection_kind::per_head)
    throw medusa::invalid_input("train: heads with a shared projection cannot be trained here (per-head projections only)");
  shape_ = head_shape{init.hidden_size(), init.vocab_size(), init.num_heads(), init.num_layers()};
  check_shape(shape_);
  if (threads < 1) throw medusa::invalid_input("train: threads must be >= 1, got " + std::to_string(threads));
  weights_ = init.dtype() == medusa::weight_dtype::f32 ? init : init.to_dtype(medusa::weight_dtype::f32);
  start(threads);
}

namespace {
constexpr std::size_t block = 65536;  // parameters per parallel chunk
}  // namespace

head_batch_stats head_trainer::accumulate(const float* x, std::size_t batch, const std::int32_t* targets, std::span<const float> hw,
                                          float* dx) {
  if (hw.size() != shape_.K) throw medusa::invalid_input("train: " + std::to_string(hw.size()) + " head weights for " + std::to_string(shape_.K) + " heads");
  const std::size_t n = grads_.size();
  float* g = grads_.data();
  parallel_for((n + block - 1) / block, [&](std::size_t c) { std::fill(g + c * block, g + std::min(n, (c + 1) * block), 0.0f); });
  return head_loss_grad<float>(shape_, params().data(), g, x, batch, targets, hw.data(), ws_,
                               [this](std::size_t rows, const auto& f) { parallel_for(rows, f); }, dx);
}

double head_trainer::grad_squared_norm() {
  // In double, summed in a fixed order (deterministic for any thread count).
  const std::size_t n = grads_.size(), nblk = (n + block - 1) / block;
  const float* g = grads_.data();
  std::vector<double> part(nblk);
  parallel_for(nblk, [&](std::size_t c) {
    double s = 0;
    for (std::size_t i = c * block, e = std::min(n, i + block); i < e; ++i) s += static_cast<double>(g[i]) * g[i];
    part[c] = s;
  });
  double sq = 0;
  for (double p : part) sq += p;
  return sq;
}

void head_trainer::apply(double lr, const optimizer_options& o, double grad_scale) {
  ++t_;
  detail::adamw_update(params(), grads_, m_, v_, t_, lr, o, grad_scale,
                       [this](std::size_t nb, const std::function<void(std::size_t)>& f) { parallel_for(nb, f); });
}

head_batch_stats head_trainer::step(const float* x, std::size_t batch, const std::int32_t* targets, std::span<const float> hw,
                                    double lr, const optimizer_options& o) {
  auto st = accumulate(x, batch, targets, hw);
  grad_norm_ = std::sqrt(grad_squared_norm());
  const double clip = o.clip_norm > 0 && grad_norm_ > o.clip_norm ? o.clip_norm / (grad_norm_ + 1e-12) : 1.0;
  apply(lr, o, clip);
  return st;
}

namespace detail {

void adamw_update(std::span<float> p, std::span<const float> g, std::span<float> m, std::span<float> v, std::size_t t, double lr,
                  const optimizer_options& o, double grad_scale,
                  const std::function<void(std::size_t, const std::function<void(std::size_t)>&)>& pf) {
  const std::size_t n = p.size(), nblk = (n + block - 1) / block;
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(t));
  const float b1 = static_cast<float>(o.beta1), b2 = static_cast<float>(o.beta2);
  const float step_size = static_cast<float>(lr / bc1);
  const float inv_bc2 = static_cast<float>(1.0 / bc2);
  const float eps = static_cast<float>(o.eps), wd = static_cast<float>(lr * o.weight_decay), cs = static_cast<float>(grad_scale);
  pf(nblk, [&](std::size_t c) {
    for (std::size_t i = c * block, e = std::min(n, i + block); i < e; ++i) {
      const float gi = g[i] * cs;
      m[i] = b1 * m[i] + (1.0f - b1) * gi;
      v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
      p[i] -= step_size * m[i] / (std::sqrt(v[i] * inv_bc2) + eps) + wd * p[i];
    }
  });
}

}  // namespace detail

void head_trainer::logits(const float* x, std::size_t batch, float* out) { head_logits<float>(shape_, params().data(), x, batch, out, ws_); }

// ---------------------------------------------------------------------------------------------
// fit
// ---------------------------------------------------------------------------------------------

namespace {

void check_data(const head_trainer& t, const distill_cache& data) {
  if (data.hidden_size() != t.shape().d || data.vocab_size() != t.shape().V)
    throw medusa::invalid_input("train: the data has d=" + std::to_string(data.hidden_size()) + " V=" + std::to_string(data.vocab_size()) +
                                ", the heads d=" + std::to_string(t.shape().d) + " V=" + std::to_string(t.shape().V));
}

// Rows of `which` split that have at least the head-0 target (j + 2 < n), as (record, row).
std::vector<std::pair<std::uint32_t, std::uint32_t>> rows_of(const distill_cache& data, split which) {
  std::vector<std::pair<std::uint32_t, std::uint32_t>> rows;
  for (std::size_t r = 0; r < data.size(); ++r) {
    if (data[r].which != which) continue;
    const std::size_t n = data[r].tokens.size();
    for (std::size_t j = 0; j + 2 < n; ++j) rows.emplace_back(static_cast<std::uint32_t>(r), static_cast<std::uint32_t>(j));
  }
  return rows;
}

void gather(const distill_cache& data, std::span<const std::pair<std::uint32_t, std::uint32_t>> rows, std::size_t K, float* x,
            std::int32_t* targets, std::int32_t* next) {
  const std::size_t d = data.hidden_size();
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto [r, j] = rows[i];
    data.load_hidden(r, j, x + i * d);
    const auto tok = data[r].tokens;
    for (std::size_t k = 0; k < K; ++k) {
      const std::size_t at = j + k + 2;
      targets[i * K + k] = at < tok.size() ? tok[at] : ignore_index;
    }
    if (next) next[i] = tok[j + 1];
  }
}

}  // namespace

fit_result fit(head_trainer& t, const distill_cache& data, const fit_options& opt) {
  check_data(t, data);
  if (opt.batch == 0) throw medusa::invalid_input("train: batch size must be positive");
  if (!(opt.epochs > 0)) throw medusa::invalid_input("train: epochs must be positive");
  if (!(opt.decay > 0)) throw medusa::invalid_input("train: decay must be positive");
  const auto t0 = clock_type::now();
  const std::size_t K = t.shape().K, d = t.shape().d;
  auto rows = rows_of(data, split::train);
  fit_result res;
  res.train_positions = rows.size();
  if (rows.empty()) throw medusa::invalid_input("train: the data has no training position (sequences too short or no train split)");
  const std::size_t per_epoch = (rows.size() + opt.batch - 1) / opt.batch;
  res.planned_steps = std::max<std::size_t>(1, static_cast<std::size_t>(std::ceil(opt.epochs * static_cast<double>(rows.size()) / static_cast<double>(opt.batch))));
  std::size_t total = res.planned_steps;
  if (opt.max_steps > 0) total = std::min(total, opt.max_steps);
  std::vector<float> hw(K);
  for (std::size_t k = 0; k < K; ++k) hw[k] = static_cast<float>(std::pow(static_cast<double>(opt.decay), static_cast<double>(k)));
  std::vector<float> x(opt.batch * d);
  std::vector<std::int32_t> targets(opt.batch * K);
  rng64 rng{opt.seed ^ 0x5eed5eedull};
  std::size_t pos_in_epoch = per_epoch;  // forces a shuffle before the first step
  fit_progress pr;
  detail::training_meter meter(K);
  auto last_report = clock_type::now();
  detail::deadline_plan budget{opt.deadline, opt.reserve_seconds, 8, 3.0};
  for (std::size_t step = 0; step < total; ++step) {
    if (pos_in_epoch >= per_epoch) {  // new epoch: Fisher-Yates with the portable generator
      for (std::size_t i = rows.size(); i > 1; --i) std::swap(rows[i - 1], rows[rng.below(i)]);
      pos_in_epoch = 0;
    }
    const std::size_t b0 = pos_in_epoch * opt.batch, n = std::min(opt.batch, rows.size() - b0);
    ++pos_in_epoch;
    gather(data, std::span(rows).subspan(b0, n), K, x.data(), targets.data(), nullptr);
    const double lr = learning_rate(opt.opt, step, total);
    const auto st = t.step(x.data(), n, targets.data(), hw, lr, opt.opt);
    res.steps = step + 1;
    res.positions_seen += n;
    meter.add(st.loss, st);
    const double elapsed = seconds_since(t0);
    if (budget.update(step, elapsed, total)) res.budget_limited = true;
    const bool last = step + 1 == total;
    if (opt.on_progress && (last || seconds_since(last_report) >= opt.progress_interval)) {
      last_report = clock_type::now();
      meter.report(pr, step, total, lr, elapsed, static_cast<double>(res.positions_seen));
      opt.on_progress(pr);
    }
  }
  res.seconds = seconds_since(t0);
  res.final_loss = meter.loss.value();
  return res;
}

// ---------------------------------------------------------------------------------------------
// evaluation
// ---------------------------------------------------------------------------------------------

double calibration::acc(std::size_t k, std::size_t r) const {
  if (k >= num_heads || r >= topk || positions[k] == 0) return 0.0;
  return static_cast<double>(hits[k][r]) / static_cast<double>(positions[k]);
}

double calibration::top(std::size_t k, std::size_t n) const {
  double s = 0;
  for (std::size_t r = 0; r < std::min(n, topk); ++r) s += acc(k, r);
  return s;
}

medusa::path_calibration calibration::paths() const {
  if (path_positions > 0)
    return medusa::path_calibration::from_counts(static_cast<int>(num_heads), static_cast<int>(topk), path_positions,
                                                 {path_counts.begin(), path_counts.end()});
  std::vector<std::vector<double>> table(num_heads, std::vector<double>(topk));
  for (std::size_t k = 0; k < num_heads; ++k)
    for (std::size_t r = 0; r < topk; ++r) table[k][r] = acc(k, r);
  return medusa::path_calibration::from_accuracy(std::move(table));
}

calibration evaluate(head_trainer& t, const distill_cache& data, split which, std::size_t topk, const float* lm_head, std::size_t batch) {
  check_data(t, data);
  if (batch == 0 || topk == 0) throw medusa::invalid_input("evaluate: batch and topk must be positive");
  const std::size_t K = t.shape().K, d = t.shape().d, V = t.shape().V;
  topk = std::min(topk, V);
  calibration c;
  c.num_heads = K;
  c.topk = topk;
  c.positions.assign(K, 0);
  c.hits.assign(K, std::vector<std::uint64_t>(topk, 0));
  c.mean_loss.assign(K, 0.0);
  for (std::size_t r = 0; r < data.size(); ++r) c.sequences += data[r].which == which;
  const auto rows = rows_of(data, which);
  std::vector<float> x(batch * d), logits(batch * K * V), base(lm_head ? batch * V : 0);
  std::vector<std::int32_t> targets(batch * K), next(batch);
  std::vector<std::int32_t> rank(batch * K);
  std::vector<double> ce(batch * K);
  std::vector<char> base_hit(batch);
  for (std::size_t b0 = 0; b0 < rows.size(); b0 += batch) {
    const std::size_t n = std::min(batch, rows.size() - b0);
    gather(data, std::span(rows).subspan(b0, n), K, x.data(), targets.data(), next.data());
    t.logits(x.data(), n, logits.data());
    if (lm_head) detail::blas_gemm(false, true, n, V, d, 1.0f, x.data(), d, lm_head, d, 0.0f, base.data(), V);
    t.parallel_for(n, [&](std::size_t i) {
      for (std::size_t k = 0; k < K; ++k) {
        const std::int32_t y = targets[i * K + k];
        rank[i * K + k] = -1;
        if (y == ignore_index) continue;
        const float* z = logits.data() + (i * K + k) * V;
        // Rank of y with the decoder's order: larger logit first, ties by ascending id.
        const float zy = z[y];
        std::size_t above = 0;
        float mx = z[0];
        for (std::size_t v = 0; v < V; ++v) {
          above += z[v] > zy || (z[v] == zy && v < static_cast<std::size_t>(y));
          mx = std::max(mx, z[v]);
        }
        double sum = 0;
        for (std::size_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(z[v] - mx));
        ce[i * K + k] = std::log(sum) - static_cast<double>(zy - mx);
        rank[i * K + k] = static_cast<std::int32_t>(above);
      }
      if (lm_head) {
        const float* z = base.data() + i * V;
        base_hit[i] = static_cast<std::size_t>(std::max_element(z, z + V) - z) == static_cast<std::size_t>(next[i]);
      }
    });
    for (std::size_t i = 0; i < n; ++i) {
      for (std::size_t k = 0; k < K; ++k) {
        const std::int32_t rk = rank[i * K + k];
        if (rk < 0) continue;
        ++c.positions[k];
        c.mean_loss[k] += ce[i * K + k];
        if (static_cast<std::size_t>(rk) < topk) ++c.hits[k][static_cast<std::size_t>(rk)];
      }
      if (lm_head) {
        ++c.base_positions;
        c.base_hits += base_hit[i] != 0;
      }
      // The path this position's drafts would have been right on: the targets' ranks in heads
      // 0, 1, ... up to the first one outside the top-k (or without a target).
      if (rank[i * K] < 0) continue;
      ++c.path_positions;
      std::vector<int> path;
      for (std::size_t k = 0; k < K; ++k) {
        const std::int32_t rk = rank[i * K + k];
        if (rk < 0 || static_cast<std::size_t>(rk) >= topk) break;
        path.push_back(rk);
        ++c.path_counts[path];
      }
    }
  }
  for (std::size_t k = 0; k < K; ++k)
    if (c.positions[k]) c.mean_loss[k] /= static_cast<double>(c.positions[k]);
  return c;
}

std::string calibration_json(const calibration& c, const std::string& meta) {
  auto num = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%.6f", v);
    return std::string(b);
  };
  std::string j = "{\n  \"format\": \"medusa-calibration\",\n  \"version\": " + std::string(c.path_positions ? "2" : "1") + ",\n";
  if (!meta.empty()) j += meta + ",\n";
  j += "  \"num_heads\": " + std::to_string(c.num_heads) + ",\n  \"topk\": " + std::to_string(c.topk) + ",\n";
  j += "  \"sequences\": " + std::to_string(c.sequences) + ",\n  \"positions\": [";
  for (std::size_t k = 0; k < c.num_heads; ++k) j += (k ? ", " : "") + std::to_string(c.positions[k]);
  j += "],\n  \"accuracy\": [\n";
  for (std::size_t k = 0; k < c.num_heads; ++k) {
    j += "    [";
    for (std::size_t r = 0; r < c.topk; ++r) j += (r ? ", " : "") + num(c.acc(k, r));
    j += k + 1 < c.num_heads ? "],\n" : "]\n";
  }
  j += "  ],\n  \"hits\": [\n";
  for (std::size_t k = 0; k < c.num_heads; ++k) {
    j += "    [";
    for (std::size_t r = 0; r < c.topk; ++r) j += (r ? ", " : "") + std::to_string(c.hits[k][r]);
    j += k + 1 < c.num_heads ? "],\n" : "]\n";
  }
  j += "  ],\n  \"top1\": [";
  for (std::size_t k = 0; k < c.num_heads; ++k) j += (k ? ", " : "") + num(c.top(k, 1));
  j += "],\n  \"top5\": [";
  for (std::size_t k = 0; k < c.num_heads; ++k) j += (k ? ", " : "") + num(c.top(k, 5));
  j += "],\n  \"mean_loss\": [";
  for (std::size_t k = 0; k < c.num_heads; ++k) j += (k ? ", " : "") + num(c.mean_loss[k]);
  j += "],\n  \"base_agreement\": " +
       (c.base_positions ? num(static_cast<double>(c.base_hits) / static_cast<double>(c.base_positions)) : std::string("null"));
  if (c.path_positions) {
    j += ",\n  \"path_positions\": " + std::to_string(c.path_positions) + ",\n  \"path_counts\": [";
    bool first = true;
    for (const auto& [path, n] : c.path_counts) {
      j += first ? "\n    [[" : ",\n    [[";
      first = false;
      for (std::size_t i = 0; i < path.size(); ++i) {
        if (i) j += ',';
        j += std::to_string(path[i]);
      }
      j += "], ";
      j += std::to_string(n);
      j += ']';
    }
    j += "\n  ]";
  }
  j += "\n}\n";
  return j;
}

std::vector<std::vector<int>> best_tree(const calibration& c, std::size_t nodes, std::size_t max_depth) {
  if (nodes < 2) return {};
  auto paths = medusa::ranked_paths(c.paths(), static_cast<int>(nodes - 1), static_cast<int>(max_depth));
  std::sort(paths.begin(), paths.end(), [](const auto& x, const auto& y) { return x.size() != y.size() ? x.size() < y.size() : x < y; });
  return paths;
}

}  // namespace medusa_train
