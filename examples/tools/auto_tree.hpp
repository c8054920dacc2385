// SPDX-License-Identifier: Apache-2.0
// `medusa-run --tree auto` (docs/tools.md): the calibration beside the heads, the step-cost curve
// of this machine (measured in a short warm-up, cached per CPU, model, thread count and weight
// formats), and the tree `medusa::optimize_tree` picks from them.
#pragma once

#include <medusa/decoder/step_cost.hpp>
#include <medusa/io/tree_search_files.hpp>
#include <medusa/tree.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

namespace medusa_tools {

//! `calibration.json` beside a heads file, or in a heads directory; nullopt when there is none.
inline std::optional<std::filesystem::path> calibration_beside(const std::string& heads) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(heads);
  const fs::path dir = fs::is_directory(p, ec) ? p : p.parent_path();
  const fs::path f = (dir.empty() ? fs::path(".") : dir) / "calibration.json";
  if (fs::is_regular_file(f, ec)) return f;
  return std::nullopt;
}

//! A chain of `depth` rank-0 drafts: [[0], [0,0], ...].
inline std::vector<std::vector<int>> chain_paths(int depth) {
  std::vector<std::vector<int>> paths;
  for (int d = 1; d <= depth; ++d) paths.emplace_back(static_cast<std::size_t>(d), 0);
  return paths;
}

//! The CPU's model name (`/proc/cpuinfo`), or "unknown-cpu".
inline std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown-cpu";
}

//! What a step-cost curve depends on, as one line: CPU, model file (path, size, mtime), threads,
//! weight formats, heads, the sizes measured and the context they attend to.
inline std::string step_cost_key(const std::string& model, int threads, const std::string& weights,
                                 const std::string& head_weights, int heads, const std::vector<int>& rows, int context) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(model, ec);
  const fs::path file = fs::is_directory(canonical, ec) ? canonical / "model.safetensors" : canonical;
  const auto size = fs::file_size(file, ec);
  const auto mtime = fs::last_write_time(file, ec).time_since_epoch().count();
  std::string key = "cpu=" + cpu_name() + " model=" + canonical.string() + ":" + std::to_string(ec ? 0 : size) + ":" +
                    std::to_string(mtime) + " threads=" + std::to_string(threads) + " weights=" + weights +
                    " heads=" + std::to_string(heads) + "x" + head_weights + " context=" + std::to_string(context) + " rows=";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (i) key += ',';
    key += std::to_string(rows[i]);
  }
  return key;
}

//! The cache directory: `--cost-cache`, else $MEDUSA_CACHE_DIR, $XDG_CACHE_HOME/medusa,
//! $HOME/.cache/medusa; empty = no cache ("none", or no home).
inline std::filesystem::path cost_cache_dir(const std::string& option) {
  if (option == "none") return {};
  if (!option.empty()) return option;
  if (const char* d = std::getenv("MEDUSA_CACHE_DIR"); d && *d) return d;
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d && *d) return std::filesystem::path(d) / "medusa";
  if (const char* d = std::getenv("HOME"); d && *d) return std::filesystem::path(d) / ".cache" / "medusa";
  return {};
}

//! The cache file of a key: `step-cost-<FNV-1a 64 of the key>.json`.
inline std::filesystem::path cost_cache_file(const std::filesystem::path& dir, const std::string& key) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : key) h = (h ^ c) * 1099511628211ull;
  char name[48];
  std::snprintf(name, sizeof name, "step-cost-%016llx.json", static_cast<unsigned long long>(h));
  return dir / name;
}

//! Where a curve came from, for the report.
struct step_cost_source {
  std::string kind;  // "measured", "cached", "file"
  std::string file;  // the cache file or --step-cost file ("" if measured without a cache)
  double seconds = 0;  // measuring time
};

//! The curve of `key`: from the cache when it holds one for the key, else measured with
//! `measure()` and written to the cache (atomically). A cache file that cannot be read is
//! reported on stderr and replaced.
template <class Measure>
medusa::step_cost_curve cached_step_cost(const std::filesystem::path& dir, const std::string& key, Measure&& measure,
                                         step_cost_source& src) {
  namespace fs = std::filesystem;
  fs::path file;
  if (!dir.empty()) {
    file = cost_cache_file(dir, key);
    std::error_code ec;
    if (fs::is_regular_file(file, ec)) {
      try {
        std::ifstream in(file, std::ios::binary);
        const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        const auto doc = medusa::parse_json(text);
        const auto* k = doc.find("key");
        if (k && k->is_string() && k->as_string() == key) {
          src = {"cached", file.string(), 0.0};
          return medusa::parse_step_cost(text);
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "medusa-run: warning: step-cost cache %s is unusable (%s): measuring again\n", file.string().c_str(),
                     e.what());
      }
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  medusa::step_cost_curve curve = measure();
  src = {"measured", "", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
  if (!file.empty()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    const fs::path tmp = file.string() + ".tmp" + std::to_string(::getpid());
    {
      std::ofstream out(tmp, std::ios::binary);
      out << medusa::step_cost_json(curve, key);
    }
    fs::rename(tmp, file, ec);
    if (ec) {
      std::fprintf(stderr, "medusa-run: warning: cannot write the step-cost cache %s: %s\n", file.string().c_str(),
                   ec.message().c_str());
      fs::remove(tmp, ec);
    } else {
      src.file = file.string();
    }
  }
  return curve;
}

//! A curve for a batch of `batch` requests each taking an n-node step: one pass holds batch × n
//! rows and runs the heads batch times (`optimize_tree` then compares it with a plain pass of
//! `batch` rows). Sizes 1..max_nodes.
inline medusa::step_cost_curve per_request_curve(const medusa::step_cost_curve& c, int batch, int max_nodes) {
  if (batch <= 1) return c;
  medusa::step_cost_curve out;
  for (int n = 1; n <= max_nodes; ++n) {
    out.rows.push_back(n);
    out.seconds.push_back(c.forward_seconds(batch * n));
  }
  out.head_seconds = c.head_seconds * batch;
  out.overhead_seconds = c.overhead_seconds * batch;
  return out;
}

}  // namespace medusa_tools
