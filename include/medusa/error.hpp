// SPDX-License-Identifier: Apache-2.0
//! @file error.hpp
//! The root of medusa's typed exceptions.
//!
//! Every error the library throws derives from `medusa::error`, so an engine can catch one type
//! at its boundary, and from the matching standard exception (`std::invalid_argument` for bad
//! input, `std::runtime_error` for I/O), so generic handlers keep working. Each header adds its
//! own subclasses (`tree_error`, `checkpoint_error`, ...) carrying a code for programmatic use.
#pragma once

#include <medusa/config.hpp>

#include <stdexcept>
#include <string>

MEDUSA_NAMESPACE_BEGIN

namespace detail {
inline std::string with_prefix(const std::string& what) {
  return what.rfind("medusa: ", 0) == 0 ? what : "medusa: " + what;
}
}  // namespace detail

//! Marker base of all medusa exceptions; `what()` comes from the standard base.
class error {
 public:
  virtual ~error() = default;
  //! The message, prefixed with "medusa: ".
  [[nodiscard]] virtual const char* message() const noexcept = 0;
};

//! Bad input: malformed trees, shape or vocab mismatches, NaN logits, capacity overflow.
class invalid_input : public std::invalid_argument, public error {
 public:
  explicit invalid_input(const std::string& what) : std::invalid_argument(detail::with_prefix(what)) {}
  [[nodiscard]] const char* message() const noexcept override { return what(); }
};

//! Failures outside the caller's arguments: unreadable files, corrupt checkpoints.
class io_error : public std::runtime_error, public error {
 public:
  explicit io_error(const std::string& what) : std::runtime_error(detail::with_prefix(what)) {}
  [[nodiscard]] const char* message() const noexcept override { return what(); }
};

MEDUSA_NAMESPACE_END
