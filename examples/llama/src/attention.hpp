// SPDX-License-Identifier: Apache-2.0
// Private: the engine's one attention entry point. Everything the engine knows about attention
// goes through `attend`, so it can be replaced by another implementation (e.g. a core
// tree-attention header) by changing this function only.
#pragma once

#include <medusa_llama/engine.hpp>
#include <medusa_llama/thread_pool.hpp>

#include <medusa/attention.hpp>
#include <medusa/kv_cache.hpp>

#include <cstddef>

namespace medusa_llama::detail {

//! One attention problem of one layer, for a batch of T rows.
struct attention_problem {
  const float* q;           //!< [T][n_heads * head_dim], RoPE applied
  float* out;               //!< [T][n_heads * head_dim]
  const float* k_cache;     //!< [capacity][n_kv_heads][head_dim] (batch K already written)
  const float* v_cache;     //!< same layout
  const int* slots;         //!< [T] slots of the batch rows
  int T;                    //!< batch rows
  int n_heads, n_kv_heads, head_dim;
  mask_source mask;         //!< prefix length + causal/tree mask among the batch
  int layer;                //!< layer index (for `view`)
  const medusa::kv_cache_view<float>* view;  //!< the whole cache, or null to force the local kernel
};

//! Scratch entries (floats and ints each) `attend` needs per thread.
std::size_t attention_scratch_size(int capacity, int max_batch);

//! True when the batch sits at slots prefix_len + i, the layout the core `medusa::tree_attention`
//! expects; `attend` then uses it (with the engine's threads), else the local kernel.
bool core_attention_applies(const attention_problem& p) noexcept;

//! out[t][h] = softmax(q[t][h]·K_visible / sqrt(head_dim)) · V_visible, over the prefix slots
//! [0, prefix_len) and the batch rows the mask lets row t see. `scores` and `slots` hold
//! pool.size() × `per_thread` entries, per_thread ≥ attention_scratch_size(...).
void attend(const attention_problem& p, float* scores, int* slots, std::size_t per_thread, thread_pool& pool);

}  // namespace medusa_llama::detail
