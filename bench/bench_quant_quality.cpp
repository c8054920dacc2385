// SPDX-License-Identifier: Apache-2.0
// What each weight format costs in quality, on held-out code: pycode-15m scores the first 257
// tokens of 32 Python files under /usr/lib/python3/dist-packages (never seen in training; the
// first 32 in path order of at least 4 KiB) in float32 and in each packed format, and reports
//  * ppl: the format's perplexity of the text (teacher forcing);
//  * ppl_vs_f32: that perplexity ÷ the float32 one;
//  * top1_agree: how often its argmax equals the float32 argmax at the same position;
//  * kl: the mean KL(p_f32 ‖ p_format) in nats per token.
// The time is one pass over the set in that format (prefill-style batches of 257 tokens).
// Set MEDUSA_SHARED_DIR to point elsewhere; skipped when the model or the files are absent.
#include <medusa_llama/llama.hpp>
#include <medusa_llama/load.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace medusa_llama;
namespace fs = std::filesystem;

constexpr int kTokens = 257;  // BOS + 256
constexpr int kFiles = 32;

struct dataset {
  std::unique_ptr<model> m;
  std::vector<std::vector<int>> texts;
  std::vector<std::vector<float>> ref_logp;  // float32 log-probabilities, [position][vocab]
};

std::vector<float> log_softmax(const float* x, int n) {
  std::vector<float> out(static_cast<std::size_t>(n));
  const float mx = *std::max_element(x, x + n);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(static_cast<double>(x[i] - mx));
  const float lse = mx + static_cast<float>(std::log(s));
  for (int i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = x[i] - lse;
  return out;
}

// Logits of every position of `tokens` in one causal pass.
std::vector<float> all_logits(engine& e, const std::vector<int>& tokens) {
  const auto V = static_cast<std::size_t>(e.config().vocab_size);
  std::vector<float> logits(tokens.size() * V);
  std::vector<int> pos(tokens.size());
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int>(i);
  medusa::forward_batch b;
  b.tokens = tokens;
  b.positions = pos;
  b.cache_length = 0;
  b.logits = logits;
  e.forward(b);
  return logits;
}

const dataset* data() {
  static const dataset* d = [] {
    const char* env = std::getenv("MEDUSA_SHARED_DIR");
    const fs::path dir = fs::path(env != nullptr ? env : MEDUSA_SHARED_DIR) / "models" / "pycode-15m";
    const fs::path code = "/usr/lib/python3/dist-packages";
    std::error_code ec;
    if (!fs::exists(dir / "model.bin", ec) || !fs::is_directory(code, ec)) return static_cast<const dataset*>(nullptr);
    auto lm = load(dir / "model.bin");
    auto* out = new dataset;
    std::vector<fs::path> files;
    for (const auto& f : fs::recursive_directory_iterator(code, fs::directory_options::skip_permission_denied, ec))
      if (f.is_regular_file(ec) && f.path().extension() == ".py" && f.file_size(ec) >= 4096) files.push_back(f.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      // Only the head of a file: its first 257 tokens come from its first few KiB, and encoding a
      // whole file of 100 KiB takes seconds.
      std::ifstream in(f, std::ios::binary);
      std::string head(16384, '\0');
      in.read(head.data(), static_cast<std::streamsize>(head.size()));
      head.resize(static_cast<std::size_t>(in.gcount()));
      auto ids = lm.tok->encode(head, true, false);
      if (static_cast<int>(ids.size()) < kTokens) continue;
      ids.resize(kTokens);
      out->texts.push_back(std::move(ids));
      if (static_cast<int>(out->texts.size()) == kFiles) break;
    }
    out->m = std::make_unique<model>(std::move(lm.weights));
    engine e(*out->m, {.max_batch = kTokens, .threads = 2});
    const int V = out->m->config().vocab_size;
    for (const auto& t : out->texts) {
      const auto logits = all_logits(e, t);
      for (int p = 0; p + 1 < kTokens; ++p) out->ref_logp.push_back(log_softmax(logits.data() + static_cast<std::size_t>(p) * static_cast<std::size_t>(V), V));
    }
    return static_cast<const dataset*>(out);
  }();
  return d;
}

void BM_quality(benchmark::State& state) {
  const dataset* d = data();
  if (d == nullptr) {
    state.SkipWithError("pycode-15m or /usr/lib/python3/dist-packages is absent");
    return;
  }
  const auto fmt = static_cast<weight_format>(state.range(0));
  engine e(*d->m, {.max_batch = kTokens, .threads = 2, .weights = fmt});
  const int V = d->m->config().vocab_size;
  double nll = 0, nll_ref = 0, kl = 0;
  long agree = 0, n = 0;
  for (auto _ : state) {
    nll = nll_ref = kl = 0;
    agree = n = 0;
    for (std::size_t f = 0; f < d->texts.size(); ++f) {
      const auto& t = d->texts[f];
      const auto logits = all_logits(e, t);
      for (int p = 0; p + 1 < kTokens; ++p, ++n) {
        const auto lp = log_softmax(logits.data() + static_cast<std::size_t>(p) * static_cast<std::size_t>(V), V);
        const auto& ref = d->ref_logp[f * (kTokens - 1) + static_cast<std::size_t>(p)];
        const auto next = static_cast<std::size_t>(t[static_cast<std::size_t>(p) + 1]);
        nll -= lp[next];
        nll_ref -= ref[next];
        agree += std::max_element(lp.begin(), lp.end()) - lp.begin() == std::max_element(ref.begin(), ref.end()) - ref.begin();
        for (int v = 0; v < V; ++v) kl += std::exp(static_cast<double>(ref[static_cast<std::size_t>(v)])) * (ref[static_cast<std::size_t>(v)] - lp[static_cast<std::size_t>(v)]);
      }
    }
  }
  state.counters["ppl"] = std::exp(nll / static_cast<double>(n));
  state.counters["ppl_vs_f32"] = std::exp((nll - nll_ref) / static_cast<double>(n));
  state.counters["top1_agree"] = static_cast<double>(agree) / static_cast<double>(n);
  state.counters["kl"] = kl / static_cast<double>(n);
  state.counters["positions"] = static_cast<double>(n);
}
// weights: 0 f32, 1 bf16, 3 q8_0, 4 q4_0 (medusa_llama::weight_format)
BENCHMARK(BM_quality)->Arg(0)->Arg(1)->Arg(3)->Arg(4)->ArgName("weights")->Iterations(1)->Unit(benchmark::kMillisecond);

}  // namespace
