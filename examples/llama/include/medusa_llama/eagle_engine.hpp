// SPDX-License-Identifier: Apache-2.0
//! @file eagle_engine.hpp
//! An EAGLE-style feature drafter on the CPU: a `medusa::feature_draft_model`
//! (<medusa/feature_draft.hpp>) for `medusa::feature_draft_branch`.
//!
//! Row i takes the target's feature f_i (its final-normed hidden state at position i) and the
//! token t_{i+1} after it: x_i = W_fc [E(t_{i+1}); f_i], with E the target's token embedding and
//! W_fc `[dim][2·dim]`; then one Llama decoder layer (RoPE at position i, attention over the
//! request's own cache, causal or a draft tree's mask) and a final RMSNorm give the predicted feature g_i ≈ f_{i+1}, and the
//! target's classifier gives the logits of t_{i+2}. The layer, the embedding, the final norm and
//! the classifier are a one-layer `model` (as `medusa-train --recipe eagle` writes it); each
//! request has its own cache of the model's context.
//!
//! @code
//! auto drafter = medusa_llama::eagle_engine::load("out/eagle", target.config(), {.pool = &target.pool()});
//! medusa::feature_draft_branch<medusa_llama::eagle_engine> eagle(drafter, target.vocab_size(), target.hidden_size(),
//!                                                                {.max_tokens = 5});
//! @endcode
#pragma once

#include <medusa/feature_draft.hpp>

#include <medusa_llama/engine.hpp>
#include <medusa_llama/model.hpp>

#include <filesystem>
#include <memory>
#include <span>
#include <vector>

namespace medusa_llama {

//! Threads and precision of an `eagle_engine`.
struct eagle_options {
  int threads = 0;                              //!< threads including the caller; 0 = all
  thread_pool* pool = nullptr;                  //!< run on this pool (the target's) instead
  weight_format weights = weight_format::f32;   //!< precision of the layer's projections and classifier
                                                //!< and input projection (not `int8`)
  int max_rows = 64;                            //!< rows of one pass; longer catch-ups run in chunks,
                                                //!< a draft tree's pass must fit in one
};

//! The file name of a feature drafter's input projection beside its `model.bin`.
inline constexpr const char* eagle_fc_file = "fc.bin";

//! Reads an input projection file: the 8 bytes `MEDUSAFC`, int32 version 1, int32 in (= 2·dim),
//! int32 out (= dim), then `[out][in]` float32, little-endian. Throws `load_error` naming the
//! problem (a missing, truncated or longer file, another magic or version, a shape other than
//! `dim × 2·dim`).
[[nodiscard]] std::vector<float> load_eagle_fc(const std::filesystem::path& path, int dim);
//! Writes `fc` (`[dim][2·dim]`) in that format. Throws `medusa::io_error` when it cannot.
void save_eagle_fc(const std::filesystem::path& path, const std::vector<float>& fc, int dim);

//! A feature drafter over a one-layer model and its input projection (see the file comment).
class eagle_engine {
 public:
  //! `layer`: one block plus the target's embedding and classifier; `fc`: `[dim][2·dim]`. Throws
  //! `engine_error` (`bad_option`) for a model of more than one layer, a projection of another
  //! size, or bad options.
  eagle_engine(model layer, std::vector<float> fc, eagle_options o = {});
  //! Reads `dir/model.bin` (or a Hugging Face directory `dir`) and `dir/fc.bin`, and checks them
  //! against the target's shape: `load_error` (`size_mismatch`) naming both when the width or the
  //! vocabulary differs.
  static eagle_engine load(const std::filesystem::path& dir, const model_config& target, eagle_options o = {});
  eagle_engine(eagle_engine&&) noexcept;
  eagle_engine& operator=(eagle_engine&&) noexcept;
  ~eagle_engine();

  //! The one-layer model's configuration.
  [[nodiscard]] const model_config& config() const noexcept;
  //! Vocabulary size (the target's).
  [[nodiscard]] int vocab_size() const noexcept;
  //! Feature width (the target's model width).
  [[nodiscard]] int hidden_size() const noexcept;
  //! Slots of a request's cache: the model's context.
  [[nodiscard]] int max_context() const noexcept;
  //! Runs `b` (see `medusa::feature_batch`). Throws `engine_error` for inconsistent arguments
  //! (sizes, tokens, positions, slots) before anything is written.
  void forward(const medusa::feature_batch& b);
  //! Runs each batch as `forward` would, several requests' rows in one pass where they fit
  //! `max_rows` together (the weights read once for all), each request at most once
  //! (`medusa::feature_draft_batch_model`). Throws `engine_error` as `forward` does, and for a
  //! request that appears twice, before anything is written.
  void forward_batch(std::span<const medusa::feature_batch> batches);
  //! Frees request `request`'s cache.
  void release(int request);
  //! Requests holding a cache now.
  [[nodiscard]] int requests() const noexcept;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

static_assert(medusa::feature_draft_batch_model<eagle_engine>);

}  // namespace medusa_llama
