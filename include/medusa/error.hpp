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

//! Bad input of one area of the library, with the area's `enum class` code and, where one item is
//! to blame, its index (a path of a tree, a node, a request of a batch; -1 when none). Each area
//! names it: `tree_error`, `acceptance_error`, `kv_cache_error`, `checkpoint_error`, ...
//! Constructed as `(code, message, index)`.
template <class Errc>
class coded_error : public invalid_input {
 public:
  //! @param code what is wrong; @param what the message; @param index the item to blame, or -1.
  coded_error(Errc code, const std::string& what, int index = -1) : invalid_input(what), code_(code), index_(index) {}
  //! What is wrong.
  [[nodiscard]] Errc code() const noexcept { return code_; }

 protected:
  //! The index given at construction (each area names it: `path_index()`, `node()`, `request()`).
  [[nodiscard]] int index() const noexcept { return index_; }

 private:
  Errc code_;
  int index_;
};

//! Failures outside the caller's arguments: unreadable files, corrupt checkpoints.
class io_error : public std::runtime_error, public error {
 public:
  explicit io_error(const std::string& what) : std::runtime_error(detail::with_prefix(what)) {}
  [[nodiscard]] const char* message() const noexcept override { return what(); }
};

MEDUSA_NAMESPACE_END
