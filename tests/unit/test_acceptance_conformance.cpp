// SPDX-License-Identifier: Apache-2.0
// The posterior golden cases (../shared/conformance/cases/posterior) run through the library
// directly: a port of the cases' splitmix64 logits generator (checked against the explicit
// matrices of the small-vocab cases), then greedy / typical verify against the reference results.
#include <medusa/acceptance.hpp>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::uint64_t sm(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  std::uint64_t z = x;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Quantized logits q (value = q / 16) of a "splitmix64_v1" matrix, overrides applied.
std::vector<long long> generate_q(const json& g) {
  const auto seed = g.at("seed").get<std::uint64_t>();
  const auto rows = g.at("rows").get<std::uint64_t>();
  const auto cols = g.at("cols").get<std::uint64_t>();
  const auto lo = g.at("lo_q").get<long long>();
  const auto hi = g.at("hi_q").get<long long>();
  const auto span = static_cast<std::uint64_t>(hi - lo + 1);
  std::vector<long long> q(rows * cols);
  const std::uint64_t s0 = sm(seed);
  for (std::uint64_t r = 0; r < rows; ++r) {
    const std::uint64_t s1 = sm(s0 ^ r);
    for (std::uint64_t c = 0; c < cols; ++c)
      q[r * cols + c] = lo + static_cast<long long>(sm(s1 ^ c) % span);
  }
  for (const auto& o : g.at("overrides"))
    q[o.at(0).get<std::uint64_t>() * cols + o.at(1).get<std::uint64_t>()] = o.at(2).get<long long>();
  return q;
}

json load(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

}  // namespace

TEST_CASE("posterior golden cases: generator port and verify results") {
  const fs::path dir = fs::path(MEDUSA_SHARED_DIR) / "conformance" / "cases";
  if (!fs::exists(dir / "posterior")) {
    MESSAGE("skipped: no conformance cases under " << dir.string());
    return;
  }
  int cases = 0, explicit_checked = 0;
  medusa::acceptance_workspace ws;
  for (const auto& entry : fs::directory_iterator(dir / "posterior")) {
    if (entry.path().extension() != ".json") continue;
    const json c = load(entry.path());
    const json tj = load(dir / "trees" / (c.at("tree").get<std::string>() + ".json"));
    const auto t = medusa::tree::from_paths(tj.at("choices").get<std::vector<std::vector<int>>>(),
                                            {.topk = tj.at("topk").get<int>()});
    const json& g = c.at("node_logits");
    REQUIRE(g.at("generator") == "splitmix64_v1");
    const auto q = generate_q(g);
    if (!g.at("explicit_q").is_null()) {
      std::vector<long long> flat;
      for (const auto& row : g.at("explicit_q"))
        for (const auto& v : row) flat.push_back(v.get<long long>());
      CHECK_MESSAGE(flat == q, entry.path().filename().string());
      ++explicit_checked;
    }
    const int vocab = g.at("cols").get<int>();
    std::vector<float> logits(q.size());
    for (std::size_t i = 0; i < q.size(); ++i) logits[i] = static_cast<float>(q[i]) / 16.0f;
    const auto tokens = c.at("tree_candidates").get<std::vector<std::int32_t>>();
    const medusa::verify_request req{.node_tokens = tokens, .logits = logits, .vocab = vocab};
    const json& call = c.at("call");
    const float temperature = call.at("temperature").get<float>();
    const auto r = temperature == 0.0f
                       ? medusa::verify(t, req, medusa::greedy_policy{}, ws)
                       : medusa::verify(t, req,
                                        medusa::typical_policy{
                                            .temperature = temperature,
                                            .posterior_threshold = call.at("posterior_threshold").get<float>(),
                                            .posterior_alpha = call.at("posterior_alpha").get<float>()},
                                        ws);
    const json& want = c.at("diagnostics").at("fixed_semantics");
    CHECK_MESSAGE(r.best_row == want.at("best_candidate").get<int>(), entry.path().filename().string());
    CHECK_MESSAGE(r.accept_length == want.at("accept_length").get<int>(), entry.path().filename().string());
    for (int j = 0; j <= r.accept_length; ++j)
      CHECK(r.nodes()[static_cast<std::size_t>(j)] == t.retrieve(r.best_row, j));
    ++cases;
  }
  CHECK(cases == 20);
  CHECK(explicit_checked > 0);
  MESSAGE(cases << " posterior cases, " << explicit_checked << " explicit matrices checked");
}
