// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the JSON input of medusa-accept (examples/tools/accept_input.hpp, the code
// the tool runs), then the acceptance the tool runs on what parses (medusa::verify with the greedy
// or typical policy). Any crash, sanitizer report, broken invariant or exception other than
// medusa's typed errors and the tool's usage_error is a bug.
#include <medusa/acceptance.hpp>
#include <medusa/dispatch.hpp>

#include "accept_input.hpp"
#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto in = medusa_tools::parse_accept_input(std::string(reinterpret_cast<const char*>(data), size));
    const int n = in.tree.num_nodes();
    MEDUSA_FUZZ_CHECK(in.tokens.size() == static_cast<std::size_t>(n) && in.vocab > 0);
    MEDUSA_FUZZ_CHECK(in.logits.size() == static_cast<std::size_t>(n) * static_cast<std::size_t>(in.vocab));
    const medusa::verify_request req{.node_tokens = in.tokens, .logits = in.logits, .vocab = in.vocab};
    medusa::acceptance_workspace ws(n, in.vocab);
    const medusa::verify_result r = medusa::dispatch_policy(
        in.policy, in.options, [&](const auto& p) { return medusa::verify(in.tree, req, p, ws); },
        medusa_tools::accept_policies{});
    MEDUSA_FUZZ_CHECK(r.best_row >= 0 && r.best_row < in.tree.num_leaves());
    MEDUSA_FUZZ_CHECK(r.accept_length >= 0 && r.accept_length <= in.tree.depth());
    MEDUSA_FUZZ_CHECK(r.nodes().size() == static_cast<std::size_t>(r.accept_length) + 1);
  } catch (const medusa::error&) {
  } catch (const medusa_tools::usage_error&) {
    // Typed rejections: the expected outcome for almost every input.
  }
  return 0;
}
