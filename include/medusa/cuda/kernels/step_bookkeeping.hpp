// SPDX-License-Identifier: Apache-2.0
//! @file cuda/kernels/step_bookkeeping.hpp
//! The last kernel of a device step, one thread per request, after the KV commit:
//! - `step_bookkeeping`: a Medusa step's requests take the commit's new length, and the hidden
//!   state of the node the next step continues from (verify's `next_node`) becomes the heads'
//!   input, in their type;
//! - `plain_bookkeeping`: a plain step's input token is now committed; its argmax is the next input,
//!   at the next position.
//!
//! Requests whose `active` entry is 0 keep their state, so a finished request keeps its slots while
//! the batch goes on, and a request that failed the commit (`new_lengths[b] < 0`) is not advanced.
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/launch.hpp>

#include <cstddef>
#include <cstdint>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {
namespace kernels {

//! Arguments of `step_bookkeeping`; `T` is the heads' input type.
template <class T>
struct step_bookkeeping_args {
  int batch = 0;                              //!< B
  int nodes = 0;                              //!< tree nodes per request (rows of the pass)
  int dim = 0;                                //!< hidden size
  const std::int32_t* next_node = nullptr;    //!< [B] verify's output
  const std::int32_t* new_lengths = nullptr;  //!< [B] the commit's output
  const std::int32_t* active = nullptr;       //!< [B] 0: leave the request as it is
  std::int32_t* lengths = nullptr;            //!< [B] committed slots, advanced
  const float* hidden = nullptr;              //!< [B·nodes][dim] the pass's final-normed states
  T* head_input = nullptr;                    //!< [B][dim] out
};

//! Grid-stride over the requests.
template <class Ctx, class T>
MEDUSA_KERNEL_FN void step_bookkeeping(Ctx& ctx, const step_bookkeeping_args<T>& a) {
  for (int b = ctx.block_x() * ctx.threads() + ctx.thread(); b < a.batch; b += ctx.grid_x() * ctx.threads()) {
    if (a.active[b] == 0 || a.new_lengths[b] < 0) continue;
    a.lengths[b] = a.new_lengths[b];
    const int node = a.next_node[b] < 0 ? 0 : a.next_node[b];
    const float* h = a.hidden + (static_cast<std::size_t>(b) * static_cast<std::size_t>(a.nodes) + static_cast<std::size_t>(node)) *
                                    static_cast<std::size_t>(a.dim);
    T* dst = a.head_input + static_cast<std::size_t>(b) * static_cast<std::size_t>(a.dim);
    for (int c = 0; c < a.dim; ++c) dst[c] = store_float<T>(h[c]);
  }
}

//! Arguments of `plain_bookkeeping`.
struct plain_bookkeeping_args {
  int batch = 0;                         //!< B
  const std::int32_t* chosen = nullptr;  //!< [B] the argmax of each row
  const std::int32_t* active = nullptr;  //!< [B] 0: leave the request as it is
  std::int32_t* lengths = nullptr;       //!< [B] committed slots, + 1
  std::int32_t* tokens = nullptr;        //!< [B] next input
  std::int32_t* positions = nullptr;     //!< [B] next input's position
};

//! Grid-stride over the requests.
template <class Ctx>
MEDUSA_KERNEL_FN void plain_bookkeeping(Ctx& ctx, const plain_bookkeeping_args& a) {
  for (int b = ctx.block_x() * ctx.threads() + ctx.thread(); b < a.batch; b += ctx.grid_x() * ctx.threads()) {
    if (a.active[b] == 0) continue;
    a.lengths[b] += 1;
    a.tokens[b] = a.chosen[b];
    a.positions[b] = a.lengths[b];
  }
}

//! One thread per request, 128 a block.
[[nodiscard]] constexpr launch_shape plan_bookkeeping(int batch) noexcept {
  return {.grid_x = batch < 1 ? 1 : (batch + 127) / 128, .grid_y = 1, .threads = 128, .shared_bytes = 0};
}

}  // namespace kernels
}  // namespace cuda
MEDUSA_NAMESPACE_END
