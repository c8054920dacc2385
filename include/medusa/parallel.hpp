// SPDX-License-Identifier: Apache-2.0
//! @file parallel.hpp
//! How the library spreads work over the caller's threads: a parallel-for is any callable
//! `pf(count, body)` that calls `body(i)` exactly once for every `i` in `[0, count)`, in any
//! order and on any threads, and returns when all calls have returned. The library creates no
//! thread; `sequential_for` (the default everywhere) runs the calls in order on the caller.
//!
//! @code
//! #include <medusa/parallel.hpp>
//! // an engine's pool, adapted: pool.run(n, f) calls f(i) for i < n on its threads
//! auto on_pool = [&pool](std::size_t n, auto&& body) { pool.run(n, body); };
//! static_assert(medusa::parallel_for<decltype(on_pool)>);
//! @endcode
#pragma once

#include <medusa/config.hpp>

#include <concepts>
#include <cstddef>

MEDUSA_NAMESPACE_BEGIN

//! Runs `body(0) .. body(count - 1)` in order on the calling thread.
struct sequential_for {
  //! Calls `body(i)` for `i < count`.
  template <class F>
  void operator()(std::size_t count, F&& body) const {
    for (std::size_t i = 0; i < count; ++i) body(i);
  }
};

namespace detail {
// A body as the library passes it: callable with an index.
struct parallel_body_archetype {
  void operator()(std::size_t) const noexcept {}
};
}  // namespace detail

//! A parallel-for (see the file comment).
template <class P>
concept parallel_for = std::invocable<P&, std::size_t, detail::parallel_body_archetype&>;

static_assert(parallel_for<sequential_for>);

MEDUSA_NAMESPACE_END
