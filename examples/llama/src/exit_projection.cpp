// SPDX-License-Identifier: Apache-2.0
#include <medusa_llama/exit_projection.hpp>
#include <medusa_llama/errors.hpp>

#include <medusa/error.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>

namespace medusa_llama {

namespace {
constexpr std::array<char, 8> exit_magic = {'M', 'E', 'D', 'U', 'S', 'A', 'E', 'X'};
constexpr std::int32_t exit_version = 1;
constexpr std::uint64_t exit_header = 20;
}  // namespace

exit_projection load_exit_projection(const std::filesystem::path& path) {
  const std::string where = path.string();
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw load_error(load_errc::open_failed, "cannot open the exit projection", where);
  const auto size = static_cast<std::uint64_t>(in.tellg());
  in.seekg(0);
  std::array<char, 8> magic{};
  std::int32_t head[3] = {};
  if (size < exit_header || !in.read(magic.data(), 8) || !in.read(reinterpret_cast<char*>(head), sizeof head))
    throw load_error(load_errc::truncated, "the exit projection ends inside its 20-byte header", where);
  if (magic != exit_magic) throw load_error(load_errc::bad_header, "not an exit projection file (no MEDUSAEX magic)", where);
  if (head[0] != exit_version)
    throw load_error(load_errc::unsupported, "exit projection version " + std::to_string(head[0]) + " (this reader: 1)", where);
  if (head[1] < 1 || head[2] < 1 || head[2] > 65536)
    throw load_error(load_errc::bad_header,
                     "the exit projection says " + std::to_string(head[1]) + " layers and width " + std::to_string(head[2]), where);
  const auto d = static_cast<std::uint64_t>(head[2]);
  const std::uint64_t want = exit_header + sizeof(float) * d * d;
  if (size < want) throw load_error(load_errc::truncated, "the exit projection ends before its weights do", where);
  if (size > want) throw load_error(load_errc::size_mismatch, "the exit projection is longer than its header says", where);
  exit_projection e{head[1], head[2], std::vector<float>(d * d)};
  in.read(reinterpret_cast<char*>(e.w.data()), static_cast<std::streamsize>(e.w.size() * sizeof(float)));
  if (!in) throw load_error(load_errc::truncated, "the exit projection could not be read", where);
  for (std::size_t i = 0; i < e.w.size(); ++i)
    if (!std::isfinite(e.w[i]))
      throw load_error(load_errc::bad_header, "the exit projection's weight " + std::to_string(i) + " is not finite", where);
  return e;
}

void save_exit_projection(const std::filesystem::path& path, const exit_projection& e) {
  const auto d = static_cast<std::size_t>(e.dim);
  if (e.dim < 1 || e.layers < 1 || e.w.size() != d * d)
    throw medusa::invalid_input("exit projection: " + std::to_string(e.w.size()) + " weights for width " + std::to_string(e.dim) +
                                " after " + std::to_string(e.layers) + " layers");
  std::ofstream out(path, std::ios::binary);
  const std::int32_t head[3] = {exit_version, e.layers, e.dim};
  out.write(exit_magic.data(), 8);
  out.write(reinterpret_cast<const char*>(head), sizeof head);
  out.write(reinterpret_cast<const char*>(e.w.data()), static_cast<std::streamsize>(e.w.size() * sizeof(float)));
  if (!out) throw medusa::io_error("cannot write the exit projection " + path.string());
}

model self_draft(const model& target, const exit_projection& e) {
  const model_config& c = target.config();
  if (e.dim != c.dim || e.layers >= c.n_layers || e.w.size() != static_cast<std::size_t>(c.dim) * static_cast<std::size_t>(c.dim))
    throw load_error(load_errc::size_mismatch,
                     "the exit projection is for width " + std::to_string(e.dim) + " after " + std::to_string(e.layers) +
                         " layers, the target has width " + std::to_string(c.dim) + " and " + std::to_string(c.n_layers) +
                         " layers (the exit must come before the last)",
                     "(exit projection)");
  const auto V = static_cast<std::size_t>(c.vocab_size), d = static_cast<std::size_t>(c.dim);
  // C'[v][j] = Σ_i C[v][i] W[i][j]: logits C (W x) = C' x.
  std::vector<float> folded(V * d, 0.0f);
  const float* C = target.classifier();
  for (std::size_t v = 0; v < V; ++v) {
    float* out = folded.data() + v * d;
    for (std::size_t i = 0; i < d; ++i) {
      const float cv = C[v * d + i];
      const float* wr = e.w.data() + i * d;
      for (std::size_t j = 0; j < d; ++j) out[j] += cv * wr[j];
    }
  }
  return target.first_layers(e.layers).with_classifier(std::move(folded));
}

}  // namespace medusa_llama
