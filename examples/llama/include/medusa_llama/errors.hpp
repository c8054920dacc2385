// SPDX-License-Identifier: Apache-2.0
//! @file errors.hpp
//! Typed exceptions of the example Llama engine.
//!
//! Loading problems (unreadable, truncated or inconsistent checkpoints and tokenizers) throw
//! `load_error` (a `medusa::io_error`); bad arguments to the engine (token ids, positions, slots,
//! masks, output buffers) throw `engine_error` (a `medusa::invalid_input`).
#pragma once

#include <medusa/error.hpp>

#include <string>
#include <string_view>

namespace medusa_llama {

//! What went wrong while loading a model or tokenizer.
enum class load_errc {
  open_failed,     //!< the file cannot be opened or mapped
  truncated,       //!< the file ends before the data its header announces
  size_mismatch,   //!< the file is longer than its header announces, or a tensor has the wrong shape
  bad_header,      //!< a header field is out of range or inconsistent
  bad_json,        //!< a JSON file cannot be parsed or lacks a field
  missing_tensor,  //!< a required tensor is absent
  unsupported,     //!< a valid but unsupported feature (dtype, activation, RoPE scaling, ...)
  bad_tokenizer,   //!< a malformed tokenizer file
};

//! Name of a `load_errc` value ("truncated", ...).
[[nodiscard]] std::string_view to_string(load_errc code) noexcept;

//! A checkpoint or tokenizer could not be loaded; `what()` names the file and the numbers involved.
class load_error : public medusa::io_error {
 public:
  //! @param code the kind of failure; @param what the problem; @param path the file.
  load_error(load_errc code, const std::string& what, const std::string& path)
      : medusa::io_error(path + ": " + what), code_(code), path_(path) {}
  //! The kind of failure.
  [[nodiscard]] load_errc code() const noexcept { return code_; }
  //! The file that failed.
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  load_errc code_;
  std::string path_;
};

//! What was wrong with the arguments of an engine call.
enum class engine_errc {
  bad_batch,       //!< empty batch, too many tokens, or spans of different lengths
  bad_token,       //!< token id outside [0, vocab_size)
  bad_position,    //!< position outside [0, seq_len)
  bad_slot,        //!< the batch does not fit the cache: slots [L, L+T) beyond the capacity, or L < 0
  bad_mask,        //!< a tree mask too small for the batch, a row that cannot see itself, or sees a later row
  bad_output,      //!< output row out of range or output buffer of the wrong size
  bad_option,      //!< an engine or generation option out of range
  bad_request,     //!< a request id outside the engine's range, or twice in one batch
  out_of_pages,    //!< the KV page pool has too few free pages for a reservation
  no_device,       //!< no CUDA device (or a build without CUDA) for the GPU engine
  device_failure,  //!< a CUDA or cuBLAS call of the GPU engine failed (the message has the status)
};

//! Name of an `engine_errc` value ("bad_batch", ...).
[[nodiscard]] constexpr std::string_view to_string(engine_errc code) noexcept {
  switch (code) {
    case engine_errc::bad_batch: return "bad_batch";
    case engine_errc::bad_token: return "bad_token";
    case engine_errc::bad_position: return "bad_position";
    case engine_errc::bad_slot: return "bad_slot";
    case engine_errc::bad_mask: return "bad_mask";
    case engine_errc::bad_output: return "bad_output";
    case engine_errc::bad_option: return "bad_option";
    case engine_errc::bad_request: return "bad_request";
    case engine_errc::out_of_pages: return "out_of_pages";
    case engine_errc::no_device: return "no_device";
    case engine_errc::device_failure: return "device_failure";
  }
  return "unknown";
}

//! Bad arguments to an engine, or (GPU engine) a device that is missing or failed.
class engine_error : public medusa::coded_error<engine_errc> {
 public:
  //! @param code the kind of failure; @param what the message; @param request the id of the
  //! request at fault (`batch_engine`), -1 if none.
  using coded_error::coded_error;
  //! The id of the request at fault, -1 if the error concerns no single request.
  [[nodiscard]] int request() const noexcept { return index(); }
};

}  // namespace medusa_llama
