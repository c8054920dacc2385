// SPDX-License-Identifier: Apache-2.0
//! @file acceptance_error.hpp
//! The typed error of candidates and acceptance, in a header below both (candidates throw it and
//! sit below acceptance): bad shapes, vocab mismatches, token ids out of range, non-finite logits,
//! bad policy parameters and bad draft distributions.
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>

#include <string>
#include <string_view>

MEDUSA_NAMESPACE_BEGIN

//! What went wrong in a candidates or acceptance call.
enum class acceptance_errc {
  size_mismatch,       //!< a span has the wrong length for the tree / vocab / head count
  vocab_mismatch,      //!< vocab size is not positive or disagrees with the data given
  token_out_of_range,  //!< a token id outside [0, vocab)
  non_finite_logit,    //!< NaN or +Inf in a logit row that the call reads, or every token masked (-Inf)
  bad_parameter,       //!< a policy parameter outside its domain (negative temperature, ...)
  bad_draft,           //!< a draft distribution that is negative, non-finite or zero at its token
  too_deep,            //!< the tree is deeper than a verify result can hold
};

//! The enumerator's name, e.g. `"non_finite_logit"`.
constexpr std::string_view to_string(acceptance_errc code) noexcept {
  switch (code) {
    case acceptance_errc::size_mismatch: return "size_mismatch";
    case acceptance_errc::vocab_mismatch: return "vocab_mismatch";
    case acceptance_errc::token_out_of_range: return "token_out_of_range";
    case acceptance_errc::non_finite_logit: return "non_finite_logit";
    case acceptance_errc::bad_parameter: return "bad_parameter";
    case acceptance_errc::bad_draft: return "bad_draft";
    case acceptance_errc::too_deep: return "too_deep";
  }
  return "unknown";
}

//! Bad input to a candidates or acceptance call. `node()` is the tree node (or head, for top-k
//! calls, as documented per function) that the error is about, -1 when none.
class acceptance_error : public coded_error<acceptance_errc> {
 public:
  //! @param code the kind of problem; @param what the message; @param node the node (or head)
  //! concerned, -1 if none.
  using coded_error::coded_error;
  //! The node (or head) concerned, -1 if none.
  [[nodiscard]] int node() const noexcept { return index(); }
};

MEDUSA_NAMESPACE_END
