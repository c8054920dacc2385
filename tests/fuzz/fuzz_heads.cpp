// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for medusa::load_heads on whole checkpoint directories: the legacy single file
// (medusa_lm_head.safetensors), the HF-style file (model.safetensors) and the sharded form
// (model.safetensors.index.json + shards), each with or without a config.json.
//
// Input: a small container that the seeds (scripts/make-fuzz-corpus) and the mutator share:
//   byte 0   flags: bits 0-1 layout (0 legacy, 1 HF, 2 sharded, 3 HF saved by save_heads:
//            medusa_heads.safetensors), bit 2 config.json present, bit 3 strict_config, bit 4
//            pass the directory (else the weights file), bit 5 convert to f32, bit 6 min_heads 2
//   byte 1   hidden_size option (0 = unchecked)
//   byte 2   vocab_size option (0 = unchecked)
//   then files, each a u32 little-endian length and that many bytes (a length past the end takes
//   what is left): config.json first when present, then the weights file, or for the sharded
//   layout the index and then shards named model-00001.safetensors, model-00002.safetensors, ...
// Any crash, sanitizer report, broken invariant or exception other than medusa's typed errors is
// a bug.
#include <medusa/io/head_checkpoint.hpp>

#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace {

struct reader {
  const std::uint8_t* p;
  std::size_t n;
  bool more() const { return n > 0; }
  std::string_view next_file() {
    std::uint32_t len = 0;
    const std::size_t k = n < 4 ? n : 4;
    std::memcpy(&len, p, k);  // little-endian hosts (the engine checks it too)
    p += k, n -= k;
    const std::size_t take = len < n ? len : n;
    const std::string_view out(reinterpret_cast<const char*>(p), take);
    p += take, n -= take;
    return out;
  }
};

void check_heads(const medusa::head_load_result& r, const medusa::head_load_options& opt) {
  const auto& w = r.heads;
  MEDUSA_FUZZ_CHECK(w.num_heads() >= 1 && w.hidden_size() >= 1);
  MEDUSA_FUZZ_CHECK(opt.hidden_size == 0 || w.hidden_size() == opt.hidden_size);
  MEDUSA_FUZZ_CHECK(w.num_heads() >= opt.min_heads);
  MEDUSA_FUZZ_CHECK(!r.files.empty());
  // Views build, and every byte of the arena is read once (to_dtype below).
  if (w.kind() == medusa::projection_kind::per_head) {
    MEDUSA_FUZZ_CHECK(opt.vocab_size == 0 || w.vocab_size() == opt.vocab_size);
    (void)w.view();
  } else if (w.vocab_size() <= (std::size_t{1} << 16) / w.hidden_size()) {
    const std::size_t vocab = w.vocab_size() ? w.vocab_size() : 3;
    std::vector<float> lm_head(vocab * w.hidden_size());
    (void)w.view(medusa::weight_ptr::of(lm_head.data()), vocab);
  }
  (void)w.to_dtype(medusa::weight_dtype::bf16);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  const std::uint8_t flags = data[0];
  medusa::head_load_options opt;
  opt.hidden_size = data[1];
  opt.vocab_size = data[2];
  opt.strict_config = (flags & 8) != 0;
  if (flags & 32) opt.dtype = medusa::weight_dtype::f32;
  if (flags & 64) opt.min_heads = 2;
  reader in{data + 3, size - 3};

  medusa_fuzz::clear_scratch();
  const auto& dir = medusa_fuzz::scratch_dir();
  if (flags & 4) medusa_fuzz::write_file(dir / "config.json", in.next_file());
  const int layout = flags & 3;
  std::filesystem::path weights;
  if (layout == 2) {
    weights = dir / "model.safetensors.index.json";
    medusa_fuzz::write_file(weights, in.next_file());
    for (int k = 1; in.more() && k <= 8; ++k) {
      char name[40];
      std::snprintf(name, sizeof name, "model-%05d.safetensors", k);
      medusa_fuzz::write_file(dir / name, in.next_file());
    }
  } else {
    weights = dir / (layout == 0 ? "medusa_lm_head.safetensors" : layout == 1 ? "model.safetensors" : "medusa_heads.safetensors");
    medusa_fuzz::write_file(weights, in.next_file());
  }
  try {
    const auto r = medusa::load_heads((flags & 16) ? dir : weights, opt);
    check_heads(r, opt);
  } catch (const medusa::error&) {
    // Typed rejection: the expected outcome for almost every input.
  }
  return 0;
}
