// SPDX-License-Identifier: Apache-2.0
//! @file exit_projection.hpp
//! A trained exit for self-speculative decoding: the draft is the target's first k layers, its
//! final norm and its classifier, with one linear layer W (`[dim][dim]`) between the norm and the
//! classifier: logits = C · W · norm(h_k). `medusa-train --recipe exit` trains W by distillation
//! (docs/training.md); `medusa-run --self-draft-layers k --exit DIR` runs the draft with it.
//!
//! W is folded into the classifier once (C' = C · W), so a draft pass costs what the plain first
//! layers cost; the layers themselves share the target's storage.
//!
//! @code
//! const auto exit = medusa_llama::load_exit_projection("out/exit/exit.bin");
//! medusa_llama::model draft = medusa_llama::self_draft(target_weights, exit);
//! @endcode
#pragma once

#include <medusa_llama/model.hpp>

#include <filesystem>
#include <vector>

namespace medusa_llama {

//! The file name of an exit projection in the directory `medusa-train --recipe exit` writes.
inline constexpr const char* exit_projection_file = "exit.bin";

//! An exit projection: after layer `layers` of a model of width `dim`, y = W x with W `[dim][dim]`
//! row-major (y_i = Σ_j W[i][j] x_j), x the final-normed hidden state.
struct exit_projection {
  int layers = 0;
  int dim = 0;
  std::vector<float> w;
};

//! Reads an exit projection: the 8 bytes `MEDUSAEX`, int32 version 1, int32 layers, int32 dim,
//! then `[dim][dim]` float32, little-endian. Throws `load_error` naming the problem (a missing,
//! truncated or longer file, another magic or version, a non-positive layer count or width, a
//! non-finite weight).
exit_projection load_exit_projection(const std::filesystem::path& path);

//! Writes `e` in that format. Throws `medusa::invalid_input` for a `w` of another size than
//! dim × dim, `medusa::io_error` when it cannot write.
void save_exit_projection(const std::filesystem::path& path, const exit_projection& e);

//! The draft of self-speculative decoding with a trained exit: `target.first_layers(e.layers)`
//! whose classifier is C · W. Throws `load_error` (`size_mismatch`) when the projection's width is
//! not the target's or its layer count not below the target's.
model self_draft(const model& target, const exit_projection& e);

}  // namespace medusa_llama
