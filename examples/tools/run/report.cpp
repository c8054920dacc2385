// SPDX-License-Identifier: Apache-2.0
#include "run/report.hpp"

#include <medusa_llama/cpu.hpp>

#include <fmt/format.h>

#include <sys/resource.h>

namespace medusa_run {

nlohmann::json to_json(const run_report& r) {
  const auto& s = r.result.stats;
  nlohmann::json j;
  j["mode"] = r.mode;
  j["tokens"] = r.result.tokens;
  j["text"] = r.text;
  j["new_tokens"] = s.new_tokens;
  j["steps"] = s.steps;
  j["mean_accepted"] = s.mean_accepted();
  j["seconds"] = s.seconds.total;
  j["tokens_per_second"] = s.tokens_per_second();
  j["stop_reason"] = std::string(medusa::to_string(r.result.reason));
  j["prompt_tokens"] = s.prompt_tokens;
  if (!r.tree.is_null()) j["tree"] = r.tree;
  if (r.mode == "medusa") {
    j["accepted_histogram"] = s.accepted_histogram;
    j["accepted_at_depth"] = s.accepted_at_depth;
    j["phase_seconds"] = {{"prefill", s.seconds.prefill}, {"heads", s.seconds.heads},
                          {"candidates", s.seconds.candidates}, {"forward", s.seconds.forward},
                          {"accept", s.seconds.accept}, {"commit", s.seconds.commit}};
  }
  return j;
}

std::string json_line(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// The process's peak resident set so far, in bytes (0 if the system does not say): what --json
// reports as peak_rss_bytes. ru_maxrss counts kilobytes on Linux, bytes on macOS.
std::int64_t peak_rss_bytes() {
  rusage ru{};
  if (::getrusage(RUSAGE_SELF, &ru) != 0 || ru.ru_maxrss < 0) return 0;
#if defined(__APPLE__)
  return static_cast<std::int64_t>(ru.ru_maxrss);
#else
  return static_cast<std::int64_t>(ru.ru_maxrss) * 1024;
#endif
}

// Medusa tokens/s over plain tokens/s (0 when plain decoding produced nothing).
double speedup_of(double plain_tps, double medusa_tps) { return plain_tps > 0 ? medusa_tps / plain_tps : 0.0; }

nlohmann::json to_json(const batch_report& r) {
  return {{"tokens", r.tokens()},          {"seconds", r.seconds},
          {"tokens_per_second", r.tokens_per_second()}, {"mean_accepted", r.mean_accepted()},
          {"batch_steps", r.steps}};
}

std::string predicted_note(const nlohmann::json& info) {
  if (!info.is_object() || !info.contains("predicted_speedup")) return {};
  return fmt::format(" (predicted {:.2f}x)", info["predicted_speedup"].get<double>());
}

int report_batch(const run_args& a, const std::vector<batch_report>& reports, std::size_t requests, int batch,
                 nlohmann::json summary, bool greedy, const std::string& note) {
  std::vector<std::size_t> differ;
  if (reports.size() == 2)
    for (std::size_t i = 0; i < requests; ++i)
      if (reports[0].results[i].tokens != reports[1].results[i].tokens) differ.push_back(i);
  const double speedup = reports.size() == 2 ? speedup_of(reports[0].tokens_per_second(), reports[1].tokens_per_second()) : 0.0;
  if (a.json) {
    for (const auto& r : reports)
      for (std::size_t i = 0; i < requests; ++i) {
        run_report one{r.mode, r.results[i], r.texts[i], {}};
        auto j = to_json(one);
        j["request"] = i;
        std::printf("%s\n", json_line(j).c_str());
      }
    for (const auto& r : reports) summary[r.mode].update(to_json(r));
    if (reports.size() == 2) {
      summary["identical"] = differ.empty();
      summary["differing_requests"] = differ;
      summary["speedup"] = speedup;
    }
    summary["peak_rss_bytes"] = peak_rss_bytes();
    summary["cpu_target"] = medusa_llama::cpu_target();
    std::printf("%s\n", json_line(summary).c_str());
  } else {
    const auto& last = reports.back();
    for (std::size_t i = 0; i < requests; ++i)
      std::printf("--- request %zu (%s, %s) ---\n%s\n", i, last.mode.c_str(),
                  std::string(medusa::to_string(last.results[i].reason)).c_str(), last.texts[i].c_str());
    std::fflush(stdout);
    for (const auto& r : reports)
      std::fprintf(stderr, "%-7s %zu requests, batch %d: %ld tokens in %6.3f s: %7.1f tokens/s, %5.2f tokens/step\n",
                   r.mode.c_str(), requests, batch, r.tokens(), r.seconds, r.tokens_per_second(), r.mean_accepted());
    if (reports.size() == 2)
      std::fprintf(stderr, "tokens identical: %s (%zu of %zu requests differ)%s\nspeedup (medusa / vanilla tokens per second): %.2fx%s\n",
                   differ.empty() ? "yes" : "no", differ.size(), requests,
                   greedy ? "" : " (only greedy decoding is expected to match token for token)", speedup, note.c_str());
  }
  if (greedy && !differ.empty()) {
    std::fprintf(stderr, "medusa-run: error: greedy Medusa tokens differ from plain decoding for request %zu\n", differ[0]);
    return medusa_tools::exit_failure;
  }
  return medusa_tools::exit_ok;
}

}  // namespace medusa_run
