// SPDX-License-Identifier: Apache-2.0
// Private: a read-only private memory map of a whole file (llama2.c checkpoints, GGUF files).
#pragma once

#include <medusa_llama/errors.hpp>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace medusa_llama::detail {

// Read-only private mapping of a whole file; unmapped when the last owner goes away.
class mapped_file {
 public:
  explicit mapped_file(const std::filesystem::path& path) {
    const std::string p = path.string();
    fd_ = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw load_error(load_errc::open_failed, std::string("cannot open: ") + std::strerror(errno), p);
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw load_error(load_errc::open_failed, "not a regular file", p);
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {
      void* addr = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd_, 0);
      if (addr == MAP_FAILED) {
        ::close(fd_);
        throw load_error(load_errc::open_failed, std::string("cannot map: ") + std::strerror(errno), p);
      }
      data_ = static_cast<const unsigned char*>(addr);
    }
  }
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;
  ~mapped_file() {
    if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
    if (fd_ >= 0) ::close(fd_);
  }
  [[nodiscard]] const unsigned char* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  // Drops this process's pages of the whole pages inside [p, p + n) (clipped to the mapping). The
  // mapping is read-only, so none was ever written: a later read maps the page in again from the
  // file (usually still in the page cache) and sees the same bytes. Only the resident set shrinks.
  void release(const void* p, std::size_t n) const noexcept {
    if (data_ == nullptr || n == 0) return;
    static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    const auto begin = reinterpret_cast<std::uintptr_t>(data_), end = begin + size_;
    auto lo = std::max(reinterpret_cast<std::uintptr_t>(p), begin);
    auto hi = std::min(reinterpret_cast<std::uintptr_t>(p) + n, end);
    lo = (lo + page - 1) / page * page;
    hi = hi / page * page;
    if (lo < hi) (void)::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // a hint: failure changes nothing
  }

 private:
  int fd_ = -1;
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace medusa_llama::detail
