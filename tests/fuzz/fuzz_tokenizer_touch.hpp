// SPDX-License-Identifier: Apache-2.0
// Exercises a loaded tokenizer: encode fixed texts and a slice of the input, decode every id that
// comes out and the first ids of the vocabulary. Ids must stay in range.
#pragma once

#include <medusa_llama/tokenizer.hpp>

#include "fuzz_common.hpp"

#include <algorithm>
#include <string_view>

namespace medusa_fuzz {

inline void touch_tokenizer(const medusa_llama::tokenizer& tok, std::string_view sample) {
  const int n = tok.vocab_size();
  MEDUSA_FUZZ_CHECK(n > 0);
  MEDUSA_FUZZ_CHECK(tok.bos_id() >= 0 && tok.bos_id() < n && tok.eos_id() >= 0 && tok.eos_id() < n);
  for (std::string_view text : {std::string_view(""), std::string_view("Once upon a time"),
                                std::string_view(" a\nb\xc3\xa9\xff\xe2\x96\x81 "), sample.substr(0, 64)}) {
    const auto ids = tok.encode(text, true, true);
    for (int id : ids) MEDUSA_FUZZ_CHECK(id >= 0 && id < n);
    (void)tok.decode(ids);
  }
  for (int id = 0; id < std::min(n, 300); ++id) (void)tok.decode_piece(id == 0 ? -1 : id - 1, id);
}

}  // namespace medusa_fuzz
