// SPDX-License-Identifier: Apache-2.0
// Soak run: greedy Medusa decoding through the example engine for many thousands of tokens in one
// process, the prompt restarting whenever the context fills (or the model ends its text). Every
// round is checked token for token against plain greedy decoding of the same prompt, and the
// resident set size is sampled after each round, so a leak or a state carried over between
// requests shows up as a growing RSS or a mismatch. Not a timed test: run it directly.
//
//   build/release/bench/soak [--model PATH] [--tokenizer PATH] [--heads DIR|random:K[:SEED]]
//                            [--tree PRESET|TEXT|FILE] [--tokens N] [--threads T] [--json FILE]
//                            [--max-rss-growth-mb M]
//
// Exit status: 0 when every round was lossless (and, with --max-rss-growth-mb, the RSS after the
// warm-up grew by at most M MiB), 1 on a mismatch or a growth above M, 2 on bad arguments or input,
// 77 when the default model is absent.
#include <medusa/medusa.hpp>

#include <medusa_llama/engine.hpp>
#include <medusa_llama/load.hpp>
#include <medusa_llama/openblas_env.hpp>
#include <medusa_llama/packed_heads.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

// Python openings of different kinds, so rounds do not repeat one another.
const std::vector<std::string> prompts = {
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_args(argv):\n    \"\"\"Parse the command line.\"\"\"\n",
    "import re\n\n_pattern = re.compile(",
    "    def __repr__(self):\n        return",
    "from collections import defaultdict\n\n\ndef group_by(items, key):\n",
    "import json\n\n\ndef load_config(path):\n",
    "class Node:\n    \"\"\"A node of a binary tree.\"\"\"\n\n    def __init__(self, value):\n",
    "def fibonacci(n):\n",
    "import unittest\n\n\nclass TestParser(unittest.TestCase):\n",
    "def read_lines(path, encoding='utf-8'):\n",
    "import logging\n\nlogger = logging.getLogger(__name__)\n\n\n",
    "def merge_sort(items):\n    if len(items) <= 1:\n",
    "class Config(object):\n",
    "try:\n    import threading\nexcept ImportError:\n",
    "def __getitem__(self, index):\n",
    "import socket\n\n\ndef connect(host, port, timeout=None):\n",
    "    @property\n    def name(self):\n",
    "def _check_type(value, expected):\n    if not isinstance(value,",
    "import argparse\n\nparser = argparse.ArgumentParser(",
    "with open(filename) as f:\n",
    "def flatten(nested):\n    result = []\n",
    "class Error(Exception):\n    pass\n\n\nclass",
    "    for key, value in sorted(d.items()):\n",
};

// Resident set size in bytes, from /proc/self/statm (0 where it cannot be read).
std::size_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  std::size_t pages = 0, resident = 0;
  if (!(in >> pages >> resident)) return 0;
  return resident * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

double mib(std::size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

struct soak_args {
  std::filesystem::path model;
  std::filesystem::path tokenizer;
  std::string heads = "random:4:17";
  std::string tree = "mc_sim_7b_63";
  long long tokens = 20000;
  int threads = 2;
  std::filesystem::path json;
  double max_rss_growth_mb = -1;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "soak: %s\n", why.c_str());
  std::exit(2);
}

soak_args parse(int argc, char** argv) {
  soak_args a;
  const char* env = std::getenv("MEDUSA_SHARED_DIR");
  a.model = std::filesystem::path(env != nullptr ? env : MEDUSA_SHARED_DIR) / "models/pycode-15m/model.bin";
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(k + " needs a value");
      return argv[++i];
    };
    auto number = [&](const std::string& v) {
      try {
        std::size_t used = 0;
        const double d = std::stod(v, &used);
        if (used != v.size()) throw std::invalid_argument(v);
        return d;
      } catch (const std::exception&) {
        usage(k + ": not a number: " + v);
      }
    };
    if (k == "--model") a.model = value();
    else if (k == "--tokenizer") a.tokenizer = value();
    else if (k == "--heads") a.heads = value();
    else if (k == "--tree") a.tree = value();
    else if (k == "--tokens") a.tokens = static_cast<long long>(number(value()));
    else if (k == "--threads") a.threads = static_cast<int>(number(value()));
    else if (k == "--json") a.json = value();
    else if (k == "--max-rss-growth-mb") a.max_rss_growth_mb = number(value());
    else usage("unknown argument " + k);
  }
  if (a.tokens < 1) usage("--tokens must be at least 1");
  if (a.threads < 1) usage("--threads must be at least 1");
  return a;
}

medusa::head_weights load_head_weights(const soak_args& a, const medusa_llama::model& m) {
  if (a.heads.rfind("random:", 0) == 0) {
    int k = 4;
    unsigned long long seed = 17;
    if (std::sscanf(a.heads.c_str(), "random:%d:%llu", &k, &seed) < 1 || k < 1) usage("bad --heads " + a.heads);
    return medusa_llama::random_heads(m, k, seed);
  }
  medusa::head_load_options opt;
  opt.hidden_size = static_cast<std::size_t>(m.config().dim);
  opt.vocab_size = static_cast<std::size_t>(m.config().vocab_size);
  opt.dtype = medusa::weight_dtype::f32;
  return medusa::load_heads(a.heads, opt).heads;
}

medusa::tree load_tree(const std::string& spec) {
  std::error_code ec;
  if (std::filesystem::is_regular_file(spec, ec)) return medusa::tree::from_file(spec);
  return medusa::tree::from_text(spec);
}

struct sample {
  long long tokens;  // Medusa tokens generated so far
  int round;
  std::size_t rss;
};

int run(const soak_args& a) {
  if (!std::filesystem::exists(a.model)) {
    std::printf("soak: skipped, %s not found\n", a.model.string().c_str());
    return 77;
  }
  auto lm = medusa_llama::load(a.model, a.tokenizer);
  const auto tree = load_tree(a.tree);
  const auto head_w = load_head_weights(a, lm.weights);
  if (static_cast<int>(head_w.num_heads()) < tree.depth())
    usage("the tree is " + std::to_string(tree.depth()) + " deep, the heads only " + std::to_string(head_w.num_heads()));
  const int eos = lm.tok->eos_id();
  std::vector<std::vector<std::int32_t>> encoded;
  for (const auto& p : prompts) {
    std::vector<std::int32_t> ids;
    for (int id : lm.tok->encode(p, true, false)) ids.push_back(id);
    encoded.push_back(std::move(ids));
  }

  medusa_llama::engine_options eo;
  eo.threads = a.threads;
  eo.max_batch = std::max(64, tree.num_nodes());
  medusa_llama::engine model(std::move(lm.weights), eo);
  const auto stack = head_w.kind() == medusa::projection_kind::per_head
                         ? head_w.view()
                         : head_w.view(medusa::weight_ptr::of(model.weights().classifier()),
                                       static_cast<std::size_t>(model.config().vocab_size));
  medusa_llama::packed_heads heads(model, stack, medusa_llama::weight_format::int8, tree.depth());
  medusa::decoder dec(model, heads, tree, medusa::greedy_policy{});

  medusa::decode_options opt;
  opt.max_new_tokens = 1 << 30;  // until the context fills or the model ends its text
  opt.eos_token = eos;

  std::vector<sample> curve;
  curve.push_back({0, 0, rss_bytes()});
  long long total = 0, plain_total = 0, steps = 0, context_stops = 0;
  double medusa_s = 0, plain_s = 0;
  int round = 0;
  std::printf("%8s %6s %10s %10s %8s %8s\n", "tokens", "round", "reason", "rss_MiB", "tok/step", "match");
  while (total < a.tokens) {
    const auto& prompt = encoded[static_cast<std::size_t>(round) % encoded.size()];
    auto t0 = std::chrono::steady_clock::now();
    const auto plain = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
    auto t1 = std::chrono::steady_clock::now();
    const auto out = dec.generate(prompt, opt);
    auto t2 = std::chrono::steady_clock::now();
    plain_s += std::chrono::duration<double>(t1 - t0).count();
    medusa_s += std::chrono::duration<double>(t2 - t1).count();
    ++round;
    total += static_cast<long long>(out.tokens.size());
    plain_total += static_cast<long long>(plain.tokens.size());
    steps += out.stats.steps;
    if (out.reason == medusa::stop_reason::context_full) ++context_stops;
    const bool same = out.tokens == plain.tokens && out.reason == plain.reason;
    curve.push_back({total, round, rss_bytes()});
    std::printf("%8lld %6d %10s %10.1f %8.2f %8s\n", total, round, std::string(medusa::to_string(out.reason)).c_str(), mib(curve.back().rss),
                static_cast<double>(out.tokens.size()) / std::max(1, out.stats.steps), same ? "yes" : "NO");
    std::fflush(stdout);
    if (!same) {
      std::fprintf(stderr, "soak: round %d (prompt %zu): Medusa differs from plain decoding (%zu vs %zu tokens, %s vs %s)\n",
                   round, static_cast<std::size_t>(round - 1) % encoded.size(), out.tokens.size(), plain.tokens.size(),
                   std::string(medusa::to_string(out.reason)).c_str(), std::string(medusa::to_string(plain.reason)).c_str());
      return 1;
    }
    if (out.tokens.empty() && out.reason != medusa::stop_reason::eos) usage("a round generated nothing: the prompt fills the context");
  }

  // Warm-up: the first tenth of the run (at least one round) fills the caches and the allocator.
  const long long warm = a.tokens / 10;
  std::size_t first = 0;
  while (first + 1 < curve.size() && (curve[first].tokens < warm || curve[first].round == 0)) ++first;
  std::size_t lo = curve[first].rss, hi = curve[first].rss;
  for (std::size_t i = first; i < curve.size(); ++i) {
    lo = std::min(lo, curve[i].rss);
    hi = std::max(hi, curve[i].rss);
  }
  const double growth = mib(curve.back().rss) - mib(curve[first].rss);
  std::printf("soak: %lld Medusa tokens in %d rounds (%lld context stops), all identical to plain decoding\n", total, round,
              context_stops);
  std::printf("soak: %.2f tokens/step; Medusa %.1f tok/s, plain %.1f tok/s (%.2fx)\n",
              static_cast<double>(total) / static_cast<double>(std::max(1LL, steps)), static_cast<double>(total) / medusa_s,
              static_cast<double>(plain_total) / plain_s, (static_cast<double>(total) / medusa_s) / (static_cast<double>(plain_total) / plain_s));
  std::printf("soak: RSS at start %.1f MiB; after warm-up (%lld tokens) %.1f MiB; min/max after warm-up %.1f/%.1f MiB; "
              "at the end %.1f MiB (growth after warm-up %+.2f MiB)\n",
              mib(curve.front().rss), curve[first].tokens, mib(curve[first].rss), mib(lo), mib(hi), mib(curve.back().rss), growth);
  if (!a.json.empty()) {
    nlohmann::json j;
    j["tokens"] = total;
    j["rounds"] = round;
    j["context_stops"] = context_stops;
    j["lossless"] = true;
    j["tokens_per_step"] = static_cast<double>(total) / static_cast<double>(std::max(1LL, steps));
    j["rss_growth_after_warmup_mib"] = growth;
    for (const auto& s : curve) j["rss_curve"].push_back({{"tokens", s.tokens}, {"round", s.round}, {"rss_bytes", s.rss}});
    std::ofstream(a.json) << j.dump(1) << "\n";
  }
  if (a.max_rss_growth_mb >= 0 && growth > a.max_rss_growth_mb) {
    std::fprintf(stderr, "soak: RSS grew by %.2f MiB after the warm-up (limit %.2f)\n", growth, a.max_rss_growth_mb);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The prefill's GEMMs on OpenBLAS's AVX-512 kernels where it misdetects the CPU.
  medusa_llama::reexec_with_fast_openblas(argv);
  const soak_args a = parse(argc, argv);
  try {
    return run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "soak: %s\n", e.what());
    return 2;
  }
}
