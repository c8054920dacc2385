// SPDX-License-Identifier: Apache-2.0
// The GPU engine in a build without CUDA (nvcc was not found at configure time): the options are
// still checked, then construction says there is no device.
#include <medusa_llama/cuda_engine.hpp>

#include "options.hpp"

namespace medusa_llama {

namespace {
[[noreturn]] void no_cuda() {
  throw engine_error(engine_errc::no_device, "no CUDA device: this build has no CUDA support (nvcc was not found when it was configured)");
}
}  // namespace

bool cuda_engine_compiled() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }

struct cuda_engine::impl {
  cuda_engine_options opt;
  model_config cfg;
};

cuda_engine::cuda_engine(const model& m, cuda_engine_options o) : cuda_engine(m.config(), &m, o, 0) {}
cuda_engine cuda_engine::synthetic(const model_config& c, cuda_engine_options o, std::uint64_t seed) {
  return cuda_engine(c, nullptr, o, seed);
}
cuda_engine::cuda_engine(const model_config& c, const model*, cuda_engine_options o, std::uint64_t) {
  (void)cuda_detail::resolve_options(c, o);
  no_cuda();
}
cuda_engine::cuda_engine(cuda_engine&&) noexcept = default;
cuda_engine& cuda_engine::operator=(cuda_engine&&) noexcept = default;
cuda_engine::~cuda_engine() = default;
// An engine cannot be constructed here, so none of these is ever reached on a live object.
const model_config& cuda_engine::config() const noexcept { return p_->cfg; }
const cuda_engine_options& cuda_engine::options() const noexcept { return p_->opt; }
std::string cuda_engine::device_name() const { no_cuda(); }
std::size_t cuda_engine::weight_bytes() const noexcept { return 0; }
int cuda_engine::vocab_size() const noexcept { return p_->cfg.vocab_size; }
int cuda_engine::hidden_size() const noexcept { return p_->cfg.dim; }
int cuda_engine::max_context() const noexcept { return p_->opt.max_context; }
void cuda_engine::reserve(int, int) { no_cuda(); }
void cuda_engine::release(int, int) { no_cuda(); }
void cuda_engine::forward(const medusa::ragged_batch&) { no_cuda(); }
int cuda_engine::commit(int, int, int, std::span<const int>) { no_cuda(); }
medusa::step_cost_curve cuda_engine::measure_step_cost(const medusa::step_cost_options&, const medusa::head_stack<>*) { no_cuda(); }

struct cuda_decoder::impl {
  cuda_decode_stats stats;
};
cuda_decoder::cuda_decoder(cuda_engine&) { no_cuda(); }
cuda_decoder::cuda_decoder(cuda_engine&, const medusa::head_stack<>&, const medusa::tree&) { no_cuda(); }
cuda_decoder::cuda_decoder(cuda_decoder&&) noexcept = default;
cuda_decoder& cuda_decoder::operator=(cuda_decoder&&) noexcept = default;
cuda_decoder::~cuda_decoder() = default;
std::vector<cuda_request_result> cuda_decoder::generate(std::span<const std::vector<std::int32_t>>, int, int, int) { no_cuda(); }
const cuda_decode_stats& cuda_decoder::stats() const noexcept { return p_->stats; }

}  // namespace medusa_llama
