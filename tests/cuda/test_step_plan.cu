// SPDX-License-Identifier: Apache-2.0
// The step kernels' plan on the host: the head count is a run-time field of the plan, and the plan
// refuses a head count below 1, below the tree's depth, or too large for the head rows. Nothing
// here launches a kernel, so the test runs on machines without a CUDA device.
#include <doctest/doctest.h>
#include <medusa/cuda/step.cuh>
#include <medusa/tree.hpp>
#include <medusa/tree/presets.hpp>

#include <limits>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;
using preset_tag = medusa::presets::tag_of<"mc_sim_7b_63">;  // 4 deep
using preset_kernels = mc::step_kernels<preset_tag, float>;
using runtime_kernels = mc::step_kernels<mc::runtime_tree, float>;

TEST_CASE("the plan carries the head count and sizes the head rows with it") {
  const auto four = preset_kernels::plan(3, 4, 1000, mk::verify_kind::greedy);
  CHECK(four.heads == 4);
  CHECK(four.top_k.rows == 3 * 4);
  const auto six = preset_kernels::plan(3, 6, 1000, mk::verify_kind::greedy);  // more heads than the depth
  CHECK(six.heads == 6);
  CHECK(six.top_k.rows == 3 * 6);
  CHECK(six.workspace_bytes >= four.workspace_bytes);
  const auto t = medusa::tree::preset("mc_sim_7b_63");
  const auto rt = runtime_kernels::plan(2, 5, 1000, mk::verify_kind::typical, t, 0.7f);
  CHECK(rt.heads == 5);
  CHECK(rt.top_k.rows == 2 * 5);
}

TEST_CASE("a head count below 1 is refused with launch_error") {
  for (const int heads : {0, -1, std::numeric_limits<int>::min()}) {
    CAPTURE(heads);
    CHECK_THROWS_WITH_AS((void)preset_kernels::plan(2, heads, 1000, mk::verify_kind::greedy),
                         doctest::Contains("head count must be at least 1"), mc::launch_error);
    CHECK_THROWS_WITH_AS(
        (void)runtime_kernels::plan(2, heads, 1000, mk::verify_kind::greedy, medusa::tree::preset("mc_sim_7b_63")),
        doctest::Contains("head count must be at least 1"), mc::launch_error);
  }
  try {
    (void)preset_kernels::plan(2, 0, 1000, mk::verify_kind::greedy);
  } catch (const mc::launch_error& e) {
    CHECK(e.code() == mc::launch_errc::invalid_shape);
  }
}

TEST_CASE("a tree deeper than the head count is refused with launch_error") {
  // A preset: its depth is known at compile time, the head count only at run time.
  CHECK_THROWS_WITH_AS((void)preset_kernels::plan(2, 3, 1000, mk::verify_kind::greedy),
                       doctest::Contains("a depth-4 tree needs 4 heads, the plan has 3"), mc::launch_error);
  // Every preset against one head fewer than its depth, and the run-time path with the same tree.
  for (const auto& entry : medusa::preset_table) {
    const auto t = medusa::tree::preset(entry.name);
    CAPTURE(entry.name);
    CHECK_THROWS_AS((void)runtime_kernels::plan(1, t.depth() - 1, 1000, mk::verify_kind::greedy, t),
                    mc::launch_error);
    CHECK(runtime_kernels::plan(1, t.depth(), 1000, mk::verify_kind::greedy, t).heads == t.depth());
  }
}

TEST_CASE("batch × heads head rows must fit an int") {
  CHECK_THROWS_WITH_AS((void)preset_kernels::plan(2, std::numeric_limits<int>::max(), 1000, mk::verify_kind::greedy),
                       doctest::Contains("batch × heads"), mc::launch_error);
  CHECK_THROWS_AS((void)preset_kernels::plan(0, 4, 1000, mk::verify_kind::greedy), mc::launch_error);
}
