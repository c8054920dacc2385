// SPDX-License-Identifier: Apache-2.0
//! @file load.hpp
//! One call that loads what a tool needs from a model path: the weights and the matching tokenizer.
//!
//! @code
//! auto m = medusa_llama::load("../shared/models/pycode-15m/model.bin");   // tokenizer.bin beside it
//! auto hf = medusa_llama::load("../shared/models/tinystories-656K");      // config + safetensors + tokenizer.json
//! auto gg = medusa_llama::load("model-q8_0.gguf");                        // weights and tokenizer in one file
//! std::vector<int> ids = m.tok->encode("def f():\n", /*bos=*/true, /*eos=*/false);
//! @endcode
#pragma once

#include <medusa/io/head_checkpoint.hpp>

#include <medusa_llama/model.hpp>
#include <medusa_llama/tokenizer.hpp>

#include <filesystem>
#include <memory>
#include <string>

namespace medusa_llama {

//! A model with its tokenizer.
struct loaded_model {
  model weights;                    //!< the checkpoint (memory-mapped where possible)
  std::unique_ptr<tokenizer> tok;   //!< its tokenizer
  std::filesystem::path model_path; //!< what was loaded
  std::filesystem::path tokenizer_path;
};

//! Loads `model_path`: a directory is a Hugging Face checkpoint (`config.json`,
//! `model.safetensors`, `tokenizer.json`); a GGUF file (name ending in `.gguf`, or the magic
//! "GGUF") loads with `model::load_gguf` and its tokenizer from its own metadata
//! (tokenizer.ggml.*, dummy prefix from tokenizer.ggml.add_space_prefix) unless `tokenizer_path`
//! is given; any other file is a llama2.c checkpoint whose tokenizer is `tokenizer_path` or, when
//! empty, `tokenizer.bin` beside the model. For llama2.c tokenizers the SentencePiece dummy-prefix
//! rule is read from a `tokenizer.model` beside `tokenizer.bin` when there is one (pycode-15m has
//! none), else run.c's behaviour (dummy prefix) applies. Throws `load_error` for missing or
//! corrupt files and for a tokenizer whose vocabulary differs from the model's.
[[nodiscard]] loaded_model load(const std::filesystem::path& model_path,
                                const std::filesystem::path& tokenizer_path = {});

//! Whether a tokenizer file wants run.c's dummy-prefix space: `tokenizer.json` files decide for
//! themselves (true here, unused); a GGUF file says so in tokenizer.ggml.add_space_prefix (default
//! true); a llama2.c `tokenizer.bin` follows the SentencePiece model `tokenizer.model` beside it
//! when there is one, else run.c's behaviour (true).
[[nodiscard]] bool default_dummy_prefix(const std::filesystem::path& tokenizer_path);

//! Reads `add_dummy_prefix` from a SentencePiece `tokenizer.model` (protobuf `ModelProto`,
//! field 3 `normalizer_spec`, its field 3); true when the field is absent (the protobuf default).
//! Throws `load_error` on an unreadable or malformed file.
[[nodiscard]] bool sentencepiece_adds_dummy_prefix(const std::filesystem::path& model_file);

//! `heads` Medusa heads of one ResBlock each with random weights (W ~ N(0, 1/d), seeded) and
//! projections copied from the model's classifier: decoding with them is exact but accepts few
//! drafts. For tests and demos without trained heads.
[[nodiscard]] medusa::head_weights random_heads(const model& m, int heads, std::uint64_t seed);

}  // namespace medusa_llama
