// SPDX-License-Identifier: Apache-2.0
// The GPU engine and decoder on a CUDA device: the executor-generic engine (engine_state.hpp) and
// the library's device step (device_decoder.hpp) over device_executor.cuh, for the three precisions.
#include <medusa_llama/cuda_engine.hpp>

#include "device_decoder.hpp"
#include "device_executor.cuh"
#include "engine_state.hpp"
#include "options.hpp"

#include <medusa/cuda/common.cuh>

#include <memory>
#include <string>
#include <utility>

namespace medusa_llama {

namespace {

using cuda_detail::device_executor;

// What the public classes need of an engine or decoder of one precision.
struct decoder_iface {
  virtual ~decoder_iface() = default;
  virtual std::vector<medusa::cuda::device_request_result> generate(std::span<const std::vector<std::int32_t>> prompts,
                                                                   int max_new_tokens, int eos, int stop) = 0;
  virtual const cuda_detail::device_decode_stats& stats() const = 0;
};

struct engine_iface {
  virtual ~engine_iface() = default;
  virtual void forward(const medusa::ragged_batch& b) = 0;
  virtual int commit(int request, int length, int nodes, std::span<const int> path) = 0;
  virtual void reserve(int request, int slots) = 0;
  virtual void release(int request, int length) = 0;
  virtual std::unique_ptr<decoder_iface> decoder(const medusa::tree* tree, const medusa::head_stack<>* heads) = 0;
  virtual std::vector<double> measure_forward(std::span<const int> rows, int context, int repeats, int request) = 0;
  virtual double measure_heads(const medusa::head_stack<>& heads, int repeats) = 0;
};

template <class T>
struct decoder_impl final : decoder_iface {
  cuda_detail::device_decoder<device_executor, T> d;
  decoder_impl(cuda_detail::engine_state<device_executor, T>& e, const medusa::tree* tree, const medusa::head_stack<>* heads)
      : d(e, tree, heads) {}
  std::vector<medusa::cuda::device_request_result> generate(std::span<const std::vector<std::int32_t>> prompts,
                                                           int max_new_tokens, int eos, int stop) override {
    return d.generate(prompts, max_new_tokens, eos, stop);
  }
  const cuda_detail::device_decode_stats& stats() const override { return d.stats(); }
};

template <class T>
struct engine_impl final : engine_iface {
  cuda_detail::engine_state<device_executor, T> s;
  engine_impl(device_executor& ex, cuda_detail::device_weights<device_executor, T> w, const cuda_detail::engine_limits& lim)
      : s(ex, std::move(w), lim) {}
  void forward(const medusa::ragged_batch& b) override { s.forward(b); }
  int commit(int request, int length, int nodes, std::span<const int> path) override {
    return s.commit(request, length, nodes, path);
  }
  void reserve(int request, int slots) override { s.reserve(request, slots); }
  void release(int request, int length) override { s.release(request, length); }
  std::unique_ptr<decoder_iface> decoder(const medusa::tree* tree, const medusa::head_stack<>* heads) override {
    return std::make_unique<decoder_impl<T>>(s, tree, heads);
  }
  std::vector<double> measure_forward(std::span<const int> rows, int context, int repeats, int request) override {
    return s.measure_forward(rows, context, repeats, request);
  }
  double measure_heads(const medusa::head_stack<>& heads, int repeats) override { return s.measure_heads(heads, repeats); }
};

// Runs `f`, turning the CUDA layer's own exceptions into engine_error (device_failure).
template <class F>
decltype(auto) on_device(F&& f) {
  try {
    return f();
  } catch (const medusa::cuda::cuda_error& e) {
    throw engine_error(engine_errc::device_failure, e.what());
  } catch (const medusa::cuda::cublas_error& e) {
    throw engine_error(engine_errc::device_failure, e.what());
  } catch (const medusa::cuda::launch_error& e) {
    throw engine_error(engine_errc::device_failure, e.what());
  }
}

}  // namespace

bool cuda_engine_compiled() noexcept { return true; }
int cuda_device_count() noexcept { return medusa::cuda::device_count(); }

struct cuda_engine::impl {
  cuda_engine_options opt;
  model_config cfg;
  std::unique_ptr<device_executor> ex;
  std::unique_ptr<engine_iface> e;
};

cuda_engine::cuda_engine(const model& m, cuda_engine_options o) : cuda_engine(m.config(), &m, o, 0) {}

cuda_engine cuda_engine::synthetic(const model_config& c, cuda_engine_options o, std::uint64_t seed) {
  try {
    c.validate("synthetic model");
  } catch (const load_error& e) {
    throw engine_error(engine_errc::bad_option, e.what());
  }
  return cuda_engine(c, nullptr, o, seed);
}

cuda_engine::cuda_engine(const model_config& c, const model* m, cuda_engine_options o, std::uint64_t seed) {
  o = cuda_detail::resolve_options(c, o);
  const int devices = cuda_device_count();
  if (devices == 0) throw engine_error(engine_errc::no_device, "no CUDA device");
  if (o.device >= devices)
    throw engine_error(engine_errc::no_device, "CUDA device " + std::to_string(o.device) + " does not exist (" +
                                                   std::to_string(devices) + " visible)");
  auto p = std::make_unique<impl>();
  p->opt = o;
  p->cfg = c;
  p->ex = std::make_unique<device_executor>(o.device, o.max_tokens, o.batch_invariant, o.library_gemm);
  const cuda_detail::engine_limits lim{.max_requests = o.max_requests, .max_context = o.max_context,
                                       .max_tokens = o.max_tokens, .page_size = o.page_size,
                                       .num_pages = o.num_pages, .kv_split = o.kv_split,
                                       .single_query_attention = o.single_query_attention};
  auto make = [&](auto element) -> std::unique_ptr<engine_iface> {
    using T = decltype(element);
    if (m != nullptr) return std::make_unique<engine_impl<T>>(*p->ex, cuda_detail::device_weights<device_executor, T>(*p->ex, *m), lim);
    return std::make_unique<engine_impl<T>>(*p->ex, cuda_detail::device_weights<device_executor, T>(*p->ex, c, seed), lim);
  };
  on_device([&] {
    switch (o.precision) {
      case medusa::dtype::f32: p->e = make(float{}); break;
      case medusa::dtype::f16: p->e = make(medusa::half{}); break;
      case medusa::dtype::bf16: p->e = make(medusa::bfloat16{}); break;
    }
    p->ex->sync();
  });
  p_ = std::move(p);
}

cuda_engine::cuda_engine(cuda_engine&&) noexcept = default;
cuda_engine& cuda_engine::operator=(cuda_engine&&) noexcept = default;
cuda_engine::~cuda_engine() {
  if (p_) p_->e.reset();  // device memory before the executor's stream and handles
}

const model_config& cuda_engine::config() const noexcept { return p_->cfg; }
const cuda_engine_options& cuda_engine::options() const noexcept { return p_->opt; }
std::string cuda_engine::device_name() const { return p_->ex->device_name(); }
std::size_t cuda_engine::weight_bytes() const noexcept { return cuda_detail::streamed_weight_bytes(p_->cfg, p_->opt.precision); }
int cuda_engine::vocab_size() const noexcept { return p_->cfg.vocab_size; }
int cuda_engine::hidden_size() const noexcept { return p_->cfg.dim; }
int cuda_engine::max_context() const noexcept { return p_->opt.max_context; }
void cuda_engine::reserve(int request, int slots) { p_->e->reserve(request, slots); }
void cuda_engine::release(int request, int length) { p_->e->release(request, length); }
void cuda_engine::forward(const medusa::ragged_batch& batch) {
  on_device([&] { p_->e->forward(batch); });
}
int cuda_engine::commit(int request, int committed_length, int num_tree_nodes, std::span<const int> path) {
  return on_device([&] { return p_->e->commit(request, committed_length, num_tree_nodes, path); });
}

medusa::step_cost_curve cuda_engine::measure_step_cost(const medusa::step_cost_options& opt, const medusa::head_stack<>* heads) {
  medusa::step_cost_curve curve{.rows = opt.rows, .seconds = std::vector<double>(opt.rows.size(), 1.0)};
  curve.validate();  // rows ascending from 1
  if (opt.repeats < 1) throw engine_error(engine_errc::bad_option, "step cost: repeats must be >= 1");
  if (opt.request < 0 || opt.request >= p_->opt.max_requests)
    throw engine_error(engine_errc::bad_request, "step cost: request " + std::to_string(opt.request) + " is outside [0, " +
                                                     std::to_string(p_->opt.max_requests) + ")");
  const int context = std::min(opt.context, p_->opt.max_context - opt.rows.back());
  curve.seconds = on_device([&] { return p_->e->measure_forward(opt.rows, context, opt.repeats, opt.request); });
  for (std::size_t i = 1; i < curve.seconds.size(); ++i) curve.seconds[i] = std::max(curve.seconds[i], curve.seconds[i - 1]);
  if (heads != nullptr && heads->num_heads() > 0)
    curve.head_seconds = on_device([&] { return p_->e->measure_heads(*heads, opt.repeats); }) /
                         static_cast<double>(heads->num_heads());
  return curve;
}

struct cuda_decoder::impl {
  std::unique_ptr<decoder_iface> d;
  cuda_decode_stats stats;
};

cuda_decoder::cuda_decoder(cuda_engine& engine) : p_(std::make_unique<impl>()) {
  p_->d = on_device([&] { return engine.p_->e->decoder(nullptr, nullptr); });
}

cuda_decoder::cuda_decoder(cuda_engine& engine, const medusa::head_stack<>& heads, const medusa::tree& tree)
    : p_(std::make_unique<impl>()) {
  const model_config& c = engine.config();
  if (heads.hidden_size() != static_cast<std::size_t>(c.dim) || heads.vocab_size() != static_cast<std::size_t>(c.vocab_size))
    throw engine_error(engine_errc::bad_option, "heads of hidden size " + std::to_string(heads.hidden_size()) + " and vocabulary " +
                                                    std::to_string(heads.vocab_size()) + " for a model of " +
                                                    std::to_string(c.dim) + " and " + std::to_string(c.vocab_size));
  if (tree.depth() > 5)
    throw engine_error(engine_errc::bad_option, "the device step takes trees up to 5 deep, got " + std::to_string(tree.depth()));
  p_->d = on_device([&] { return engine.p_->e->decoder(&tree, &heads); });
}

cuda_decoder::cuda_decoder(cuda_decoder&&) noexcept = default;
cuda_decoder& cuda_decoder::operator=(cuda_decoder&&) noexcept = default;
cuda_decoder::~cuda_decoder() = default;

std::vector<cuda_request_result> cuda_decoder::generate(std::span<const std::vector<std::int32_t>> prompts,
                                                        int max_new_tokens, int eos_token, int stop_token) {
  auto r = on_device([&] { return p_->d->generate(prompts, max_new_tokens, eos_token, stop_token); });
  const cuda_detail::device_decode_stats& s = p_->d->stats();
  p_->stats = {.steps = s.step.steps, .accepted = s.step.accepted, .by_size = s.step.by_size,
               .prefill_seconds = s.prefill_seconds, .decode_seconds = s.decode_seconds,
               .step_seconds = s.step.step_seconds};
  std::vector<cuda_request_result> out;
  out.reserve(r.size());
  for (auto& x : r) out.push_back({std::move(x.tokens), x.stop, x.steps, std::move(x.error)});
  return out;
}

const cuda_decode_stats& cuda_decoder::stats() const noexcept { return p_->stats; }

}  // namespace medusa_llama
