// SPDX-License-Identifier: Apache-2.0
//! @file dtype.hpp
//! Element types as run-time values (`dtype`) and their C++ types (`dtype_type<D>`): float32,
//! IEEE binary16 (`medusa::half`) and bfloat16 (`medusa::bfloat16`), for weights, logits and caches.
//! `medusa::dispatch_dtype` (dispatch.hpp) turns a value into its type.
//!
//! @code
//! #include <medusa/dtype.hpp>
//! static_assert(medusa::dtype_of<medusa::bfloat16> == medusa::dtype::bf16);
//! static_assert(medusa::dtype_size(medusa::dtype::f16) == 2);
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/half.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

MEDUSA_NAMESPACE_BEGIN

//! An element type.
enum class dtype : std::uint8_t { f32, f16, bf16 };
//! The element type of weights (head matrices, GEMM operands).
using weight_dtype = dtype;

//! Bytes per element of `t`.
MEDUSA_HOST_DEVICE constexpr std::size_t dtype_size(dtype t) noexcept { return t == dtype::f32 ? 4 : 2; }

//! Name of `t` ("f32", "f16", "bf16").
constexpr std::string_view to_string(dtype t) noexcept {
  return t == dtype::f32 ? "f32" : t == dtype::f16 ? "f16" : "bf16";
}

//! The C++ type of `D`: `float`, `medusa::half` or `medusa::bfloat16`.
template <dtype D>
using dtype_type = std::conditional_t<D == dtype::f32, float, std::conditional_t<D == dtype::f16, half, bfloat16>>;

//! The `dtype` of a C++ element type (cv-qualifiers ignored).
template <class T>
  requires is_kv_element_v<T>
inline constexpr dtype dtype_of = std::is_same_v<std::remove_cv_t<T>, float>  ? dtype::f32
                                  : std::is_same_v<std::remove_cv_t<T>, half> ? dtype::f16
                                                                              : dtype::bf16;

MEDUSA_NAMESPACE_END
