// SPDX-License-Identifier: Apache-2.0
//! @file dispatch/value.hpp
//! Run-time values to template arguments: `dispatch_value`, `dispatch_dtype`,
//! `dispatch_head_count`, and their error `dispatch_error`. Low in the include graph (it needs only
//! `dtype.hpp` and `error.hpp`), so kernels and heads dispatch without pulling in trees or policies.
//!
//! @code
//! #include <medusa/dispatch/value.hpp>
//! std::size_t bytes = medusa::dispatch_dtype(medusa::dtype::bf16, []<medusa::dtype D>() {
//!   return sizeof(medusa::dtype_type<D>);
//! });  // 2
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/dtype.hpp>
#include <medusa/error.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

MEDUSA_NAMESPACE_BEGIN

//! A run-time value that no instantiation exists for (an unknown policy name, a head count of 0).
class dispatch_error : public invalid_input {
 public:
  //! @param what the message; @param kind what was dispatched ("policy", "dtype", ...).
  dispatch_error(const std::string& what, std::string_view kind) : invalid_input(what), kind_(kind) {}
  //! What was dispatched.
  [[nodiscard]] std::string_view kind() const noexcept { return kind_; }

 private:
  std::string_view kind_;
};

namespace detail {

template <class V>
std::string dispatch_name(const V& v) {
  if constexpr (std::is_integral_v<V>) return std::to_string(v);
  else if constexpr (std::is_convertible_v<V, std::string_view>) return "'" + std::string(std::string_view(v)) + "'";
  else return std::string(to_string(v));
}

template <auto... Values, class V>
[[noreturn]] void dispatch_unsupported(const V& v, std::string_view what) {
  std::string msg = "unsupported " + std::string(what) + " " + dispatch_name(v) + "; supported:";
  const char* sep = " ";
  ((msg += sep + dispatch_name(Values), sep = ", "), ...);
  throw dispatch_error(msg, what);
}

// `v` is one of the values (checked by the caller).
template <auto First, auto... Rest, class V, class F>
decltype(auto) dispatch_known(const V& v, F& f) {
  if constexpr (sizeof...(Rest) == 0) {
    return f.template operator()<First>();
  } else {
    if (v == First) return f.template operator()<First>();
    return dispatch_known<Rest...>(v, f);
  }
}

}  // namespace detail

//! Calls `f.template operator()<V>()` for the `V` among `Values` that equals `v`; throws
//! `dispatch_error` ("unsupported <what> <v>; supported: ...") when there is none.
template <auto... Values, class V, class F>
decltype(auto) dispatch_value(const V& v, std::string_view what, F&& f) {
  static_assert(sizeof...(Values) > 0, "medusa: dispatch_value needs at least one supported value");
  bool hit = false;
  ((hit = hit || v == Values), ...);
  if (!hit) detail::dispatch_unsupported<Values...>(v, what);
  return detail::dispatch_known<Values...>(v, f);
}

//! Calls `f.template operator()<D>()` with the `dtype` constant `D == d` (use `dtype_type<D>` for
//! the element type).
template <class F>
decltype(auto) dispatch_dtype(dtype d, F&& f) {
  return dispatch_value<dtype::f32, dtype::f16, dtype::bf16>(d, "dtype", f);
}

//! Head counts with their own instantiation; larger counts run as `std::dynamic_extent`.
inline constexpr int max_static_heads = 8;

//! Calls `f.template operator()<H>()` with `H = num_heads` (a `std::size_t`) for 1..8, and
//! `H = std::dynamic_extent` above; throws `dispatch_error` for a count below 1.
template <class F>
decltype(auto) dispatch_head_count(int num_heads, F&& f) {
  if (num_heads < 1) throw dispatch_error("unsupported head count " + std::to_string(num_heads) + " (at least 1)", "head count");
  if (num_heads > max_static_heads) return f.template operator()<std::dynamic_extent>();
  return [&]<std::size_t... H>(std::index_sequence<H...>) -> decltype(auto) {
    return dispatch_value<static_cast<int>(H + 1)...>(num_heads, "head count", [&]<int N>() -> decltype(auto) {
      return f.template operator()<static_cast<std::size_t>(N)>();
    });
  }(std::make_index_sequence<max_static_heads>{});
}

MEDUSA_NAMESPACE_END
