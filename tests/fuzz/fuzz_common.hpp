// SPDX-License-Identifier: Apache-2.0
// What the libFuzzer targets share: a private scratch directory per process (for readers that
// take a path), file writing, and the check that stops the run on a broken invariant.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>

#include <unistd.h>

namespace medusa_fuzz {

// A broken invariant of an accepted input: abort, so libFuzzer keeps the input as a crash.
#define MEDUSA_FUZZ_CHECK(cond)                                                             \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "fuzz check failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__);   \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)

// Failures of the harness itself (no temp space): abort with a message, never a silent pass.
[[noreturn]] inline void harness_failure(const std::string& what) {
  std::fprintf(stderr, "fuzz harness: %s\n", what.c_str());
  std::abort();
}

// This process's scratch directory, created on first use and removed at exit: under /dev/shm
// when there is one (every input is written to a file, and on tmpfs that costs microseconds, on
// a disk milliseconds), else under $TMPDIR. Heap-allocated and never destroyed so that the exit
// handler can still read it.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path* dir = [] {
    std::error_code ec;
    std::filesystem::path base = "/dev/shm";
    if (!std::filesystem::is_directory(base, ec) || ::access(base.c_str(), W_OK) != 0) {
      base = std::filesystem::temp_directory_path(ec);
      if (ec) base = "/tmp";
    }
    std::string tmpl = (base / "medusa-fuzz-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) harness_failure("cannot create a directory under " + base.string());
    auto* p = new std::filesystem::path(tmpl);
    std::atexit([] {
      std::error_code e;
      std::filesystem::remove_all(scratch_dir(), e);
    });
    return p;
  }();
  return *dir;
}

// Empties the scratch directory (each input starts from nothing).
inline void clear_scratch() {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(scratch_dir(), ec))
    std::filesystem::remove_all(entry.path(), ec);
}

// Writes `bytes` to `path` (replacing it).
inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.flush();
  if (!out) harness_failure("cannot write " + path.string());
}

// Writes the input to `name` in the scratch directory and returns its path.
inline std::filesystem::path input_file(const std::uint8_t* data, std::size_t size, const std::string& name) {
  const auto path = scratch_dir() / name;
  write_file(path, std::string_view(reinterpret_cast<const char*>(data), size));
  return path;
}

}  // namespace medusa_fuzz
