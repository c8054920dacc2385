// SPDX-License-Identifier: Apache-2.0
// The host emulation of the kernel context: barriers, warp operations, shared memory, and the
// errors it reports for bodies that break the rules.
#include <doctest/doctest.h>
#include <medusa/cuda/emulation.hpp>

#include <numeric>
#include <vector>

namespace mc = medusa::cuda;

namespace {
// Block sum: warp butterfly, then warp totals through shared memory.
template <class Ctx>
MEDUSA_KERNEL_FN void block_sum(Ctx& ctx, const int* in, int* out) {
  const int i = ctx.block_x() * ctx.threads() + ctx.thread();
  int v = in[i];
  for (int m = mc::warp_size / 2; m > 0; m /= 2) v += ctx.shfl_xor(v, m);
  int* partial = static_cast<int*>(ctx.shared());
  if (ctx.lane() == 0) partial[ctx.warp()] = v;
  ctx.sync();
  if (ctx.thread() == 0) {
    int total = 0;
    for (int w = 0; w < ctx.threads() / mc::warp_size; ++w) total += partial[w];
    out[ctx.block_x() + ctx.grid_x() * ctx.block_y()] = total;
  }
}
}  // namespace

TEST_CASE("emulated blocks reduce with shuffles, shared memory and barriers") {
  const int threads = 128, blocks = 3, rows = 2;
  std::vector<int> in(static_cast<std::size_t>(threads * blocks));
  std::iota(in.begin(), in.end(), 1);
  std::vector<int> out(static_cast<std::size_t>(blocks * rows), -1);
  mc::emulate({.grid_x = blocks, .grid_y = rows, .threads = threads, .shared_bytes = 4 * sizeof(int)},
              [&](auto& ctx) { block_sum(ctx, in.data(), out.data()); });
  for (int y = 0; y < rows; ++y)
    for (int b = 0; b < blocks; ++b) {
      const int first = b * threads + 1, last = (b + 1) * threads;
      CHECK(out[static_cast<std::size_t>(b + blocks * y)] == (first + last) * threads / 2);
    }
}

TEST_CASE("emulated shfl broadcasts and ballot collects predicate bits") {
  std::vector<int> got(64, -1);
  std::vector<unsigned> bits(64, 0);
  mc::emulate({.threads = 64}, [&](auto& ctx) {
    got[static_cast<std::size_t>(ctx.thread())] = ctx.shfl(ctx.thread() * 10, 3);
    bits[static_cast<std::size_t>(ctx.thread())] = ctx.ballot(ctx.lane() % 3 == 0);
  });
  for (int t = 0; t < 64; ++t) {
    CHECK(got[static_cast<std::size_t>(t)] == (t / 32 * 32 + 3) * 10);
    unsigned expect = 0;
    for (int l = 0; l < 32; l += 3) expect |= 1u << l;
    CHECK(bits[static_cast<std::size_t>(t)] == expect);
  }
}

TEST_CASE("a barrier that some threads skip is reported, not a hang") {
  auto divergent = [](auto& ctx) {
    if (ctx.thread() < 16) ctx.sync();
  };
  CHECK_THROWS_WITH_AS(mc::emulate({.threads = 32}, divergent),
                       doctest::Contains("wait at a barrier that the others never reach"),
                       mc::emulation_error);
  auto early_exit = [](auto& ctx) {
    if (ctx.lane() == 5) return;
    (void)ctx.shfl_xor(1, 1);
  };
  CHECK_THROWS_AS(mc::emulate({.threads = 32}, early_exit), mc::emulation_error);
}

TEST_CASE("shared memory starts poisoned and bad shapes are refused") {
  unsigned char first = 0;
  mc::emulate({.threads = 32, .shared_bytes = 8}, [&](auto& ctx) {
    if (ctx.thread() == 0) first = *static_cast<unsigned char*>(ctx.shared());
  });
  CHECK(first == 0xA5);
  auto nothing = [](auto&) {};
  CHECK_THROWS_AS(mc::emulate({.threads = 48}, nothing), mc::emulation_error);
  CHECK_THROWS_AS(mc::emulate({.grid_x = 0}, nothing), mc::emulation_error);
  CHECK_THROWS_AS(mc::emulate({.threads = 32, .shared_bytes = 1 << 20}, nothing), mc::emulation_error);
}

TEST_CASE("an exception thrown by a body reaches the caller") {
  auto throws = [](auto& ctx) {
    if (ctx.thread() == 7) throw std::runtime_error("body failed");
  };
  CHECK_THROWS_WITH(mc::emulate({.threads = 32}, throws), "body failed");
}
