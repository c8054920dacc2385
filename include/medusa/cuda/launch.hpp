// SPDX-License-Identifier: Apache-2.0
//! @file cuda/launch.hpp
//! What every CUDA launcher shares: the typed error of a bad launch, the per-request status that
//! kernels report data errors through, and the workspace carving of a plan.
//!
//! Launchers follow the CUB/FlashInfer split (docs/cuda.md):
//! - `plan(...)` runs on the host, validates the shapes, and returns the launch shapes and the
//!   workspace bytes; bad shapes throw `launch_error` before anything is launched. A plan is
//!   plain C++, so the host emulation runs the same plan as the device.
//! - `run(plan, ..., workspace, stream)` takes a caller-owned workspace and a `cudaStream_t`,
//!   returns `cudaError_t`, and never allocates or synchronises, so a whole step can be captured
//!   in a CUDA graph. Null pointers or a short workspace give `cudaErrorInvalidValue` with nothing
//!   launched.
//! - Errors that depend on the data (a NaN logit) cannot be thrown by a kernel: they are written
//!   to a per-request `request_status` that the engine reads with its results.
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

//! Grid, block and dynamic shared memory of one launch (the device's and the emulation's).
struct launch_shape {
  int grid_x = 1;                //!< blocks along x
  int grid_y = 1;                //!< blocks along y
  int threads = 32;              //!< threads per block: a multiple of 32 in [32, 1024]
  std::size_t shared_bytes = 0;  //!< dynamic shared memory per block
};

//! What was wrong with a launch's arguments.
enum class launch_errc {
  invalid_shape,  //!< a size out of range: batch, vocab, k, heads, tree nodes, threads
  unsupported,    //!< a valid request these kernels do not implement (named in the message)
};

//! The name of a `launch_errc` value.
[[nodiscard]] constexpr std::string_view to_string(launch_errc c) noexcept {
  return c == launch_errc::invalid_shape ? "invalid_shape" : "unsupported";
}

//! A plan refused its arguments; nothing was launched.
class launch_error : public coded_error<launch_errc> {
 public:
  using coded_error::coded_error;
};

//! Data errors found by a kernel, one `std::int32_t` per request (0 = ok). A request with a
//! non-zero status has no valid result; the others are unaffected.
enum class request_status : std::int32_t {
  ok = 0,
  non_finite_logit = 1,    //!< NaN or ±Inf in a logit row the kernel read
  token_out_of_range = 2,  //!< a token id outside [0, vocab)
  bad_draft = 3,           //!< a draft distribution that is negative, non-finite or 0 at its token
};

//! The name of a `request_status` value.
[[nodiscard]] constexpr std::string_view to_string(request_status s) noexcept {
  switch (s) {
    case request_status::ok: return "ok";
    case request_status::non_finite_logit: return "non_finite_logit";
    case request_status::token_out_of_range: return "token_out_of_range";
    case request_status::bad_draft: return "bad_draft";
  }
  return "unknown";
}

//! Carves a caller's workspace into aligned pieces, in the order a plan sized them.
class workspace_carver {
 public:
  //! Alignment of every piece (bytes): enough for 16-byte vector loads.
  static constexpr std::size_t alignment = 256;

  //! Rounds `bytes` up to the alignment.
  [[nodiscard]] static constexpr std::size_t round_up(std::size_t bytes) noexcept {
    return (bytes + alignment - 1) / alignment * alignment;
  }

  constexpr workspace_carver(void* base, std::size_t bytes) noexcept
      : base_(static_cast<unsigned char*>(base)), size_(bytes) {}

  //! The next `count` elements of T, or nullptr if the workspace is too short.
  template <class T>
  T* take(std::size_t count) noexcept {
    const std::size_t bytes = round_up(count * sizeof(T));
    if (base_ == nullptr || used_ + bytes > size_) {
      ok_ = false;
      return nullptr;
    }
    T* p = reinterpret_cast<T*>(base_ + used_);
    used_ += bytes;
    return p;
  }
  //! False once a `take` did not fit.
  [[nodiscard]] constexpr bool ok() const noexcept { return ok_; }

 private:
  unsigned char* base_;
  std::size_t size_;
  std::size_t used_ = 0;
  bool ok_ = true;
};

}  // namespace cuda
MEDUSA_NAMESPACE_END
