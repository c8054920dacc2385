// SPDX-License-Identifier: Apache-2.0
// Honest verdicts for the doctest mains. A case that finds its input absent (a shared model, a
// device) returns without an assertion, and doctest counts it passed; this listener names every
// such case as skipped, and `run` turns a run that checked nothing at all into exit 77 (ctest's
// SKIP_RETURN_CODE). Include it in exactly one source of an executable, the one that defines main.
#pragma once
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <vector>

namespace medusa_test {

//! Counts the assertions of each test case and of the run.
struct checked_nothing final : doctest::IReporter {
  static inline std::vector<std::string> unchecked;  // the cases that passed without an assertion
  static inline int asserts = 0;
  static inline int cases = 0;
  std::string current;

  explicit checked_nothing(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& s) override { asserts = s.numAsserts; }
  void test_case_start(const doctest::TestCaseData& tc) override { current = tc.m_name; }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& s) override {
    ++cases;
    if (s.testCaseSuccess && s.numAssertsCurrentTest == 0) unchecked.push_back(current);
  }
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

//! Runs doctest over the command line and returns the exit status: doctest's, or 77 when the run
//! passed without a single assertion; the cases that checked nothing are listed either way.
inline int run(int argc, char** argv) {
  doctest::Context ctx(argc, argv);
  const int result = ctx.run();
  if (ctx.shouldExit()) return result;  // --help, --list-test-cases and the like ran no case
  for (const std::string& name : checked_nothing::unchecked) std::printf("skipped (no check ran): %s\n", name.c_str());
  if (result == 0 && checked_nothing::asserts == 0) {
    std::printf("no check ran in %d test case(s): skipped\n", checked_nothing::cases);
    return 77;
  }
  return result;
}

}  // namespace medusa_test

DOCTEST_REGISTER_LISTENER("checked_nothing", 1, medusa_test::checked_nothing);
