// SPDX-License-Identifier: Apache-2.0
// The GPU engine on a device: greedy tokens equal to the shared models' references, logits within
// a stated tolerance of the CPU engine, a row's logits independent of the pass it is in (the
// batch-invariant GEMMs and attention), and Medusa decoding (the whole step one CUDA graph) equal
// to plain decoding on every shared model, with random heads and, when MEDUSA_GPU_HEADS names a
// directory of pycode-15m heads (medusa-train output), trained ones; the 16-bit engines both with
// cuBLASLt and with the library's skinny GEMM (`library_gemm`). Exits 77 (ctest: skipped)
// without a CUDA device, without CUDA support in the build, or when no check ran (no shared model).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <medusa_llama/cuda_engine.hpp>
#include <medusa_llama/llama.hpp>
#include <medusa_llama/load.hpp>
#include <medusa_llama/openblas_env.hpp>

#include <medusa/decoder.hpp>
#include <medusa/io.hpp>
#include <medusa/tree.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "checked_nothing.hpp"

namespace fs = std::filesystem;
using namespace medusa_llama;

namespace {

const fs::path models = fs::path(MEDUSA_SHARED_DIR) / "models";

bool have(const fs::path& p) {
  if (fs::exists(p)) return true;
  MESSAGE("skipped: " << p.string() << " is absent");
  return false;
}

// Every element within `tol` of the largest |want|.
void check_close(const std::vector<float>& got, const std::vector<float>& want, float tol, const char* what) {
  REQUIRE(got.size() == want.size());
  float scale = 0.0f, worst = 0.0f;
  for (float w : want) scale = std::max(scale, std::fabs(w));
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
  MESSAGE(what << ": largest difference " << worst / scale << " of the scale " << scale);
  CHECK(worst <= tol * scale);
}

// Last-row logits of a prompt prefilled as request 0 of `e` (any batch model).
template <class Engine>
std::vector<float> prefill_logits(Engine& e, const std::vector<std::int32_t>& prompt) {
  const int V = e.vocab_size();
  std::vector<float> logits(static_cast<std::size_t>(V));
  std::vector<std::int32_t> pos(prompt.size());
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int32_t>(i);
  const int requests[] = {0}, indptr[] = {0, static_cast<int>(prompt.size())}, lengths[] = {0};
  e.reserve(0, static_cast<int>(prompt.size()));
  medusa::ragged_batch b;
  b.requests = requests;
  b.qo_indptr = indptr;
  b.tokens = prompt;
  b.positions = pos;
  b.cache_lengths = lengths;
  b.last_row_only = true;
  b.logits = logits;
  e.forward(b);
  e.release(0, 0);
  return logits;
}

// Plain and Medusa device decoding of `prompts` give the same tokens.
void check_lossless(cuda_engine& e, const medusa::head_stack<>& heads, const medusa::tree& tree,
                    const std::vector<std::vector<std::int32_t>>& prompts, int n) {
  cuda_decoder plain(e), med(e, heads, tree);
  const auto p = plain.generate(prompts, n);
  const auto m = med.generate(prompts, n);
  REQUIRE(p.size() == m.size());
  for (std::size_t b = 0; b < p.size(); ++b) {
    CAPTURE(b);
    CHECK(m[b].tokens == p[b].tokens);
  }
  double accepted = 0, steps = 0;
  for (std::size_t a = 0; a < med.stats().accepted.size(); ++a) {
    accepted += static_cast<double>(a) * static_cast<double>(med.stats().accepted[a]);
    steps += static_cast<double>(med.stats().accepted[a]);
  }
  MESSAGE(tree.num_nodes() << "-node tree: " << (steps > 0 ? 1.0 + accepted / steps : 0.0) << " tokens per step; plain "
                           << p[0].tokens.size() << " tokens");
}

}  // namespace

TEST_CASE("stories260K (f32): greedy from BOS prints run.c's reference text") {
  const auto dir = models / "stories260K";
  if (!have(dir / "stories260K.bin") || !have(dir / "reference-greedy-200.txt")) return;
  const auto loaded = load(dir / "stories260K.bin", dir / "tok512.bin");
  cuda_engine e(loaded.weights, {.precision = medusa::dtype::f32, .max_requests = 1});
  MESSAGE("device: " << e.device_name());
  cuda_decoder plain(e);
  const std::vector<std::vector<std::int32_t>> prompts = {{1}};
  const auto r = plain.generate(prompts, 200, -1, /*stop on BOS*/ 1);
  std::string printed;
  int prev = 1;
  for (int t : r[0].tokens) {
    printed += run_c_printable(loaded.tok->decode_piece(prev, t));
    prev = t;
  }
  printed += "\n";
  std::ifstream in(dir / "reference-greedy-200.txt", std::ios::binary);
  const std::string want(std::istreambuf_iterator<char>(in), {});
  CHECK(r[0].tokens.size() == 200);
  CHECK(printed == want);
}

TEST_CASE("pycode-15m (f32): greedy continuations of the five prompts, batched, match the float64 reference") {
  const auto dir = models / "pycode-15m";
  if (!have(dir / "model.bin") || !have(dir / "reference-greedy.json")) return;
  const auto m = model::load_llama2c(dir / "model.bin");
  std::ifstream in(dir / "reference-greedy.json");
  const auto j = nlohmann::json::parse(in);
  std::vector<std::vector<std::int32_t>> prompts, want;
  for (const auto& c : j.at("cases")) {
    prompts.push_back(c.at("prompt_ids").get<std::vector<std::int32_t>>());
    want.push_back(c.at("greedy_ids").get<std::vector<std::int32_t>>());
  }
  cuda_engine e(m, {.precision = medusa::dtype::f32, .max_requests = static_cast<int>(prompts.size())});
  cuda_decoder plain(e);
  const auto r = plain.generate(prompts, j.at("new_tokens").get<int>());
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(i);
    CHECK(r[i].tokens == want[i]);
  }
}

namespace {

// The shared models small enough to take to a GPU machine, and pycode-15m where it is present.
std::vector<fs::path> shared_models() {
  std::vector<fs::path> out;
  for (const fs::path& p : {models / "stories260K" / "stories260K.bin", models / "tinystories-656K",
                            models / "pycode-15m" / "model.bin"})
    if (have(p)) out.push_back(p);
  return out;
}
model load_shared(const fs::path& p) { return fs::is_directory(p) ? model::load_hf(p) : model::load_llama2c(p); }

// An engine configuration of a case: a precision, and whether the GEMMs are the library's skinny
// GEMM (`library_gemm`, 16-bit precisions only) or cuBLASLt.
struct engine_config {
  medusa::dtype precision;
  bool library_gemm;
  [[nodiscard]] std::string name() const { return std::string(to_string(precision)) + (library_gemm ? " (library GEMM)" : ""); }
};
// Each precision with cuBLASLt, then the 16-bit ones with the library GEMM.
std::vector<engine_config> configs_of(std::initializer_list<medusa::dtype> precisions) {
  std::vector<engine_config> out;
  for (const medusa::dtype p : precisions) out.push_back({p, false});
  for (const medusa::dtype p : precisions)
    if (p != medusa::dtype::f32) out.push_back({p, true});
  return out;
}

}  // namespace

TEST_CASE("logits within a stated tolerance of the CPU engine: f32 1e-4, bf16 and f16 (cuBLASLt or the library GEMM) 3e-2 of the largest logit") {
  for (const fs::path& path : shared_models()) {
    CAPTURE(path.string());
    const auto m = load_shared(path);
    std::vector<std::int32_t> prompt = {1};
    const int n = std::min(120, m.config().seq_len - 1);
    for (int i = 0; i < n; ++i) prompt.push_back(3 + (i * 37) % (m.config().vocab_size - 3));
    batch_engine cpu(m, {.max_requests = 1});
    const auto want = prefill_logits(cpu, prompt);
    for (const engine_config& c : configs_of({medusa::dtype::f32, medusa::dtype::bf16, medusa::dtype::f16})) {
      CAPTURE(c.name());
      cuda_engine e(m, {.precision = c.precision, .max_requests = 1, .library_gemm = c.library_gemm});
      check_close(prefill_logits(e, prompt), want, c.precision == medusa::dtype::f32 ? 1e-4f : 3e-2f, c.name().c_str());
    }
  }
}

TEST_CASE("a row's logits do not depend on the pass: passes of 2, 3, 8, 64 and 128 rows equal one row at a time, bit for bit") {
  for (const fs::path& path : shared_models()) {
    CAPTURE(path.string());
    const auto m = load_shared(path);
    const int n = std::min(128, m.config().seq_len);
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(n)), pos(tokens.size());
    for (int i = 0; i < n; ++i) {
      tokens[static_cast<std::size_t>(i)] = 3 + (i * 53) % (m.config().vocab_size - 3);
      pos[static_cast<std::size_t>(i)] = i;
    }
    for (const engine_config& c : configs_of({medusa::dtype::bf16, medusa::dtype::f32})) {
      CAPTURE(c.name());
      cuda_engine e(m, {.precision = c.precision, .max_requests = 2, .max_tokens = 128, .library_gemm = c.library_gemm});
      const int V = e.vocab_size();
      // request 1: one token at a time, every row (M = 1)
      e.reserve(1, n);
      std::vector<float> single(static_cast<std::size_t>(n) * static_cast<std::size_t>(V));
      for (int i = 0; i < n; ++i) {
        const int r1[] = {1}, ind1[] = {0, 1}, len1[] = {i};
        medusa::ragged_batch s;
        s.requests = r1;
        s.qo_indptr = ind1;
        s.tokens = std::span<const std::int32_t>(tokens).subspan(static_cast<std::size_t>(i), 1);
        s.positions = std::span<const std::int32_t>(pos).subspan(static_cast<std::size_t>(i), 1);
        s.cache_lengths = len1;
        s.logits = std::span<float>(single).subspan(static_cast<std::size_t>(i) * static_cast<std::size_t>(V),
                                                     static_cast<std::size_t>(V));
        e.forward(s);
      }
      // request 0: the same tokens in passes of M rows
      for (const int M : {2, 3, 8, 64, 128}) {
        if (M > n) continue;
        CAPTURE(M);
        e.release(0, 0);
        e.reserve(0, n);
        std::vector<float> rows(static_cast<std::size_t>(M) * static_cast<std::size_t>(V));
        int differ = 0;
        for (int start = 0; start + M <= n; start += M) {
          const int r0[] = {0}, ind[] = {0, M}, len0[] = {start};
          medusa::ragged_batch b;
          b.requests = r0;
          b.qo_indptr = ind;
          b.tokens = std::span<const std::int32_t>(tokens).subspan(static_cast<std::size_t>(start), static_cast<std::size_t>(M));
          b.positions = std::span<const std::int32_t>(pos).subspan(static_cast<std::size_t>(start), static_cast<std::size_t>(M));
          b.cache_lengths = len0;
          b.logits = rows;
          e.forward(b);
          for (int i = 0; i < M; ++i)
            differ += std::memcmp(rows.data() + static_cast<std::size_t>(i) * static_cast<std::size_t>(V),
                                  single.data() + static_cast<std::size_t>(start + i) * static_cast<std::size_t>(V),
                                  static_cast<std::size_t>(V) * sizeof(float)) != 0;
        }
        CHECK(differ == 0);
      }
      e.release(0, 0);
      e.release(1, 0);
    }
  }
}

TEST_CASE("Medusa on the device equals plain decoding on every shared model, random heads, f32, bf16 and bf16 with the library GEMM") {
  struct shared_model {
    fs::path path;
    std::vector<std::vector<std::int32_t>> prompts;
  };
  const std::vector<shared_model> all = {
      {models / "stories260K" / "stories260K.bin", {{1}, {1, 403, 407, 261}}},
      {models / "pycode-15m" / "model.bin", {{1, 1017, 1496}, {1, 378, 1193, 1002, 1028}, {1}}},
      {models / "tinystories-656K", {{1}, {1, 420, 261}}},
  };
  for (const auto& sm : all) {
    if (!have(sm.path)) continue;
    CAPTURE(sm.path.string());
    const auto m = load_shared(sm.path);
    const medusa::head_weights hw = random_heads(m, 4, 3);
    for (const engine_config& c : configs_of({medusa::dtype::f32, medusa::dtype::bf16})) {
      CAPTURE(c.name());
      cuda_engine e(m, {.precision = c.precision, .max_requests = 4, .library_gemm = c.library_gemm});
      const auto heads = hw.kind() == medusa::projection_kind::per_head
                             ? hw.view()
                             : hw.view(medusa::weight_ptr::of(m.classifier()), static_cast<std::size_t>(m.config().vocab_size));
      check_lossless(e, heads, medusa::tree::preset("mc_sim_7b_63"), sm.prompts, 256);
      check_lossless(e, heads, medusa::tree::from_text("[[0],[0,0],[0,0,0]]"), sm.prompts, 200);
    }
  }
}

TEST_CASE("Medusa on the device with trained pycode-15m heads (MEDUSA_GPU_HEADS) equals plain decoding") {
  const char* dir = std::getenv("MEDUSA_GPU_HEADS");
  if (dir == nullptr) {
    MESSAGE("skipped: MEDUSA_GPU_HEADS is not set (a directory of pycode-15m heads from medusa-train)");
    return;
  }
  const auto path = models / "pycode-15m" / "model.bin";
  if (!have(path)) return;
  const auto m = model::load_llama2c(path);
  medusa::head_load_options opt;
  opt.hidden_size = static_cast<std::size_t>(m.config().dim);
  opt.vocab_size = static_cast<std::size_t>(m.config().vocab_size);
  opt.dtype = medusa::weight_dtype::f32;
  const auto loaded = medusa::load_heads(dir, opt);
  const auto heads = loaded.heads.view();
  const std::vector<std::vector<std::int32_t>> prompts = {{1, 1017, 1496, 270}, {1, 378, 1193}, {1}, {1, 1002, 1028, 270}};
  for (const medusa::dtype p : {medusa::dtype::f32, medusa::dtype::bf16}) {
    CAPTURE(to_string(p));
    cuda_engine e(m, {.precision = p, .max_requests = 4});
    for (const char* preset : {"mc_sim_7b_63", "vicuna_7b_stage2"}) {
      const auto tree = medusa::tree::preset(preset);
      if (tree.depth() <= static_cast<int>(heads.num_heads())) check_lossless(e, heads, tree, prompts, 256);
    }
  }
}

TEST_CASE("bad input: a tree deeper than the heads, an empty prompt, too many prompts") {
  const auto path = models / "stories260K" / "stories260K.bin";
  if (!have(path)) return;
  const auto m = model::load_llama2c(path);
  cuda_engine e(m, {.max_requests = 2});
  const medusa::head_weights hw = random_heads(m, 2, 1);
  CHECK_THROWS_AS(cuda_decoder(e, hw.view(), medusa::tree::from_text("[[0],[0,0],[0,0,0]]")), engine_error);
  cuda_decoder plain(e);
  const std::vector<std::vector<std::int32_t>> empty = {{}};
  CHECK_THROWS_AS(plain.generate(empty, 4), engine_error);
  const std::vector<std::vector<std::int32_t>> three = {{1}, {1}, {1}};
  CHECK_THROWS_AS(plain.generate(three, 4), engine_error);
}

int main(int argc, char** argv) {
  // The reference CPU engine's prefill on OpenBLAS's AVX-512 kernels where it misdetects the CPU.
  medusa_llama::reexec_with_fast_openblas(argv);
  if (cuda_device_count() == 0) {
    std::puts(cuda_engine_compiled() ? "no CUDA device: GPU tests skipped" : "no CUDA support in this build: GPU tests skipped");
    return 77;
  }
  return medusa_test::run(argc, argv);  // 77 when no check ran (the shared models are absent)
}
