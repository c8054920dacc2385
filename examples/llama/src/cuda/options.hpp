// SPDX-License-Identifier: Apache-2.0
// Private: the checks and defaults of `cuda_engine_options`, the same with and without CUDA.
#pragma once

#include <medusa_llama/cuda_engine.hpp>
#include <medusa_llama/errors.hpp>
#include <medusa_llama/model.hpp>

#include <medusa/cuda/kernels/attention.hpp>
#include <medusa/kv_cache.hpp>

#include <algorithm>
#include <limits>
#include <string>

namespace medusa_llama::cuda_detail {

// `o` with its defaults resolved; throws engine_error (`bad_option`) for values out of range or a
// model the kernels do not take.
inline cuda_engine_options resolve_options(const model_config& c, cuda_engine_options o) {
  auto bad = [](const std::string& msg) { throw engine_error(engine_errc::bad_option, msg); };
  if (o.precision != medusa::dtype::f32 && o.precision != medusa::dtype::f16 && o.precision != medusa::dtype::bf16)
    bad("unknown precision " + std::to_string(static_cast<int>(o.precision)));
  if (o.device < 0) bad("device " + std::to_string(o.device) + " is negative");
  if (o.page_size < 1 || o.page_size > 4096) bad("page_size " + std::to_string(o.page_size) + " is outside [1, 4096]");
  if (o.max_requests < 1 || o.max_requests > (1 << 12)) bad("max_requests " + std::to_string(o.max_requests) + " is outside [1, 4096]");
  if (o.max_context == 0) o.max_context = c.seq_len;
  if (o.max_context < 1 || o.max_context > c.seq_len)
    bad("max_context " + std::to_string(o.max_context) + " is outside [1, the model's seq_len " + std::to_string(c.seq_len) + "]");
  if (o.max_tokens < 1 || o.max_tokens > (1 << 14)) bad("max_tokens " + std::to_string(o.max_tokens) + " is outside [1, 16384]");
  const long long full = static_cast<long long>(o.max_requests) * medusa::kv_pages_for(o.max_context, o.page_size);
  if (o.num_pages == 0) o.num_pages = static_cast<int>(std::min<long long>(full, std::numeric_limits<int>::max()));
  if (o.num_pages < 1 || o.num_pages > (1 << 24)) bad("num_pages " + std::to_string(o.num_pages) + " is outside [1, 2^24]");
  if (o.kv_split == 0) o.kv_split = medusa::cuda::kernels::default_attention_kv_split(o.max_context);
  if (o.kv_split < 32 || o.kv_split % 32 != 0) bad("kv_split " + std::to_string(o.kv_split) + " is not a positive multiple of 32");
  if (c.head_dim() > medusa::cuda::kernels::attention_head_dim_max)
    bad("head_dim " + std::to_string(c.head_dim()) + " exceeds the " +
        std::to_string(medusa::cuda::kernels::attention_head_dim_max) + " the attention kernels take");
  if (c.head_dim() % 2 != 0) bad("head_dim " + std::to_string(c.head_dim()) + " is odd: RoPE needs pairs");
  return o;
}

// Bytes of weights one forward streams in `p`: every block matrix and the classifier.
inline std::size_t streamed_weight_bytes(const model_config& c, medusa::dtype p) {
  const std::size_t d = static_cast<std::size_t>(c.dim), kvd = static_cast<std::size_t>(c.kv_dim()),
                    H = static_cast<std::size_t>(c.hidden_dim), V = static_cast<std::size_t>(c.vocab_size);
  const std::size_t per_layer = d * (d + 2 * kvd) + d * d + 3 * H * d;
  const std::size_t elements = per_layer * static_cast<std::size_t>(c.n_layers) + V * d;
  return elements * (p == medusa::dtype::f32 ? 4 : 2);
}

}  // namespace medusa_llama::cuda_detail
