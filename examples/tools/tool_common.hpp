// SPDX-License-Identifier: Apache-2.0
//! @file tool_common.hpp
//! What every medusa-* tool shares: one error line on stderr and a fixed exit code.
//!
//! Exit codes: 0 success, 2 invalid input (bad arguments, malformed or inconsistent data, any
//! medusa::invalid_input), 1 everything else (I/O, internal failures).
#pragma once

#include <medusa/error.hpp>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <new>
#include <stdexcept>

namespace medusa_tools {

inline constexpr int exit_ok = 0;
inline constexpr int exit_failure = 1;
inline constexpr int exit_invalid_input = 2;

//! Thrown by tools for invalid usage or data that is not a library error.
struct usage_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

//! Parses the command line with `app`, then runs `body()`; maps every failure to one line on
//! stderr ("<tool>: <message>") and the exit codes above. `--help` prints and exits 0.
template <class Body>
int run_tool(CLI::App& app, int argc, char** argv, Body&& body) {
  const std::string name = app.get_name();
  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::CallForHelp& e) {
      return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
      return app.exit(e);
    } catch (const CLI::ParseError& e) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(), e.what());
      return exit_invalid_input;
    }
    return body();
  } catch (const std::invalid_argument& e) {  // medusa::invalid_input, usage_error, ...
    std::fprintf(stderr, "%s: %s\n", name.c_str(), e.what());
    return exit_invalid_input;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: out of memory\n", name.c_str());
    return exit_failure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name.c_str(), e.what());
    return exit_failure;
  }
}

}  // namespace medusa_tools
