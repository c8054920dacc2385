// SPDX-License-Identifier: Apache-2.0
// Run-time tree compiler: the worked example of docs/tree.md literally, a golden conformance tree,
// parsing (JSON, Python literal, files, presets), every error of docs/tree.md in its fixed order,
// the FlashInfer full-row stream, and the generic helpers.
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

namespace {

using medusa::tree;
using medusa::tree_errc;
using medusa::tree_error;
using paths_t = std::vector<std::vector<int>>;

template <class T>
std::vector<int> to_vec(std::span<const T> s) {
  return {s.begin(), s.end()};
}

// Expects `f` to throw tree_error with `code`, `path_index` and a message containing `needle`.
template <class F>
void expect_error(F&& f, tree_errc code, int path_index, const std::string& needle) {
  try {
    f();
    FAIL("no tree_error thrown; expected " << medusa::to_string(code));
  } catch (const tree_error& e) {
    CHECK_MESSAGE(e.code() == code, "got " << medusa::to_string(e.code()) << ": " << e.what());
    CHECK(e.path_index() == path_index);
    const std::string what = e.what();
    CHECK_MESSAGE(what.find(needle) != std::string::npos, what << " lacks " << needle);
    CHECK(what.rfind("medusa: ", 0) == 0);
  }
}

}  // namespace

TEST_CASE("worked example of docs/tree.md, literally") {
  const auto t = tree::from_text("[[0],[0,0],[0,1],[0,2],[1],[1,0],[1,1],[1,2]]");
  CHECK(t.num_nodes() == 9);
  CHECK(t.depth() == 2);
  CHECK(t.topk() == 10);
  CHECK(t.sorted_paths() == paths_t{{0}, {1}, {0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}, {1, 2}});
  CHECK(to_vec(t.parents()) == std::vector<int>{-1, 0, 0, 1, 1, 1, 2, 2, 2});
  CHECK(to_vec(t.node_depths()) == std::vector<int>{0, 1, 1, 2, 2, 2, 2, 2, 2});
  CHECK(to_vec(t.tree_indices()) == std::vector<int>{0, 1, 2, 11, 12, 13, 11, 12, 13});
  CHECK(to_vec(t.ranks()) == std::vector<int>{-1, 0, 1, 0, 1, 2, 0, 1, 2});
  CHECK(t.num_leaves() == 6);
  CHECK(to_vec(t.retrieve_indices()) ==
        std::vector<int>{0, 2, 8, 0, 2, 7, 0, 2, 6, 0, 1, 5, 0, 1, 4, 0, 1, 3});
  CHECK(t.words_per_row() == 1);
  const std::vector<std::uint32_t> packed{0x001, 0x003, 0x005, 0x00B, 0x013, 0x023, 0x045, 0x085, 0x105};
  CHECK(std::vector<std::uint32_t>(t.packed_mask().begin(), t.packed_mask().end()) == packed);
  const char* rows[9] = {"100000000", "110000000", "101000000", "110100000", "110010000",
                         "110001000", "101000100", "101000010", "101000001"};
  for (int i = 0; i < 9; ++i)
    for (int j = 0; j < 9; ++j) CHECK(t.mask(i, j) == (rows[i][j] == '1'));
  CHECK(to_vec(t.depth_begins()) == std::vector<int>{0, 1, 3, 9});
  CHECK(to_vec(t.max_ranks()) == std::vector<int>{-1, 1, 2});
  CHECK(to_vec(t.child_begins()) == std::vector<int>{1, 3, 6, 9, 9, 9, 9, 9, 9});
  CHECK(to_vec(t.child_counts()) == std::vector<int>{2, 3, 3, 0, 0, 0, 0, 0, 0});
  CHECK(medusa::first_child(t, 2) == 6);
  CHECK(medusa::first_child(t, 4) == -1);
  CHECK(medusa::next_sibling(t, 3) == 4);
  CHECK(medusa::next_sibling(t, 5) == -1);
  CHECK(medusa::next_sibling(t, 0) == -1);

  // full-row stream, L = 0: 81 bits
  std::vector<std::uint8_t> bytes(medusa::full_row_stream_bytes(9, 0), 0xFF);
  CHECK(bytes.size() == 11);
  CHECK(medusa::write_full_row_stream(t, 0, bytes) == 11);
  CHECK(bytes == std::vector<std::uint8_t>{0x01, 0x06, 0x14, 0x58, 0x30, 0x61, 0x44, 0x91, 0x42, 0x05, 0x01});

  std::vector<float> dense(81);
  medusa::write_dense_mask(t, std::span<float>(dense));
  CHECK(dense[3 * 9 + 1] == 1.0f);
  CHECK(dense[3 * 9 + 2] == 0.0f);
}

TEST_CASE("full-row stream with a prefix, and batched") {
  const auto t = tree::from_text("[[0],[1],[0,0],[0,0,0]]");
  const int n = t.num_nodes();
  for (int L : {1, 3, 7, 8, 33}) {
    std::vector<std::uint8_t> out(medusa::full_row_stream_bytes(n, L));
    medusa::write_full_row_stream(t, L, out);
    for (int i = 0; i < n; ++i)
      for (int c = 0; c < L + n; ++c) {
        const std::size_t e = static_cast<std::size_t>(i) * static_cast<std::size_t>(L + n) + static_cast<std::size_t>(c);
        const bool bit = (out[e / 8] >> (e % 8)) & 1;
        CHECK(bit == (c < L || t.mask(i, c - L)));
      }
  }
  const std::vector<int> lens{0, 5, 2};
  std::vector<std::int64_t> indptr(4);
  std::vector<std::uint8_t> buf(64);
  const auto total = medusa::write_full_row_stream_batch(t, lens, buf, indptr);
  CHECK(indptr[0] == 0);
  CHECK(indptr[1] == static_cast<std::int64_t>(medusa::full_row_stream_bytes(n, 0)));
  CHECK(indptr[2] - indptr[1] == static_cast<std::int64_t>(medusa::full_row_stream_bytes(n, 5)));
  CHECK(indptr[3] == static_cast<std::int64_t>(total));
  std::vector<std::uint8_t> small(2);
  CHECK_THROWS_AS(medusa::write_full_row_stream(t, 0, small), medusa::invalid_input);
  CHECK_THROWS_AS(medusa::write_full_row_stream(t, -1, buf), medusa::invalid_input);
}

TEST_CASE("golden tree custom_mixed_depth (reference output), padding -1") {
  const auto t = tree::from_paths({{0}, {1}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}, {2}, {0, 0, 0, 0}, {0, 1, 0}});
  CHECK(t.sorted_paths() == paths_t{{0}, {1}, {2}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}, {0, 1, 0}, {0, 0, 0, 0}});
  CHECK(to_vec(t.parents()) == std::vector<int>{-1, 0, 0, 0, 1, 1, 2, 4, 5, 7});
  CHECK(to_vec(t.tree_indices()) == std::vector<int>{0, 1, 2, 3, 11, 12, 11, 21, 21, 31});
  CHECK(to_vec(t.node_depths()) == std::vector<int>{0, 1, 1, 1, 2, 2, 2, 3, 3, 4});
  CHECK(to_vec(t.retrieve_indices()) ==
        std::vector<int>{0, 1, 4, 7, 9, 0, 1, 5, 8, -1, 0, 2, 6, -1, -1, 0, 3, -1, -1, -1});
  CHECK(t.retrieve(3, 4) == -1);
  CHECK(t.leaf(1) == 8);
}

TEST_CASE("topk changes tree_indices only") {
  const auto t = tree::from_text("[[0],[0,3],[0,3,4]]", {.topk = 5});
  CHECK(to_vec(t.tree_indices()) == std::vector<int>{0, 1, 9, 15});
  CHECK(t.max_rank(2) == 3);
}

TEST_CASE("parsing: JSON, Python literal, whitespace, trailing commas, files, presets") {
  const auto ref = tree::from_paths({{0}, {1}, {0, 0}});
  for (const char* text : {"[[0],[1],[0,0]]", "[(0,), (1,), (0, 0)]", " \n\t[ [ 0 ] ,\r\n [1],[0 ,0] ] \n",
                           "[[0,],[1,],[0,0,],]", "((0,), (1,), (0, 0))", "[[0],[1],[-0,0]]", "\xEF\xBB\xBF[[0],[1],[0,0]]",
                           "[[1],[0,0],[0]]"}) {
    CAPTURE(text);
    CHECK(medusa::same_shape(tree::from_text(text), ref));
  }
  CHECK(medusa::parse_tree_text("[(3,), [1, 2]]") == paths_t{{3}, {1, 2}});
  CHECK(medusa::parse_tree_text("[]").empty());
  CHECK(medusa::parse_tree_text("[[]]") == paths_t{{}});

  // preset names, through from_text too
  CHECK(medusa::same_shape(tree::from_text("  mc_sim_7b_63\n"), tree::preset("mc_sim_7b_63")));
  CHECK(medusa::preset_names().size() == 9);
  expect_error([] { (void)tree::preset("no_such_tree"); }, tree_errc::unknown_preset, -1, "'no_such_tree'");
  expect_error([] { (void)tree::from_text("vicuna"); }, tree_errc::unknown_preset, -1, "mc_sim_7b_63");

  // files
  const auto dir = std::filesystem::path(MEDUSA_TEST_TMPDIR);
  std::filesystem::create_directories(dir);
  const auto file = dir / "test_tree_choices.json";
  {
    std::ofstream(file) << "[(0,), (1,),\n (0, 0)]\n";
  }
  CHECK(medusa::same_shape(tree::from_file(file), ref));
  CHECK_THROWS_AS((void)tree::from_file(dir / "does_not_exist.json"), medusa::io_error);

  CHECK(medusa::preset_for_model("lmsys/Vicuna-7B-v1.3").name == "vicuna_7b_stage2");
  CHECK(medusa::preset_for_model("vicuna-13b").name == "vicuna_13b_stage2");
  CHECK(medusa::preset_for_model("vicuna_33b").name == "vicuna_33b_stage2");
  CHECK(medusa::preset_for_model("HuggingFaceH4/zephyr-7b-beta").name == "zephyr_stage2");
  CHECK_FALSE(medusa::preset_for_model("llama-2-7b").matched);
  CHECK(medusa::preset_for_model("llama-2-7b").name == "mc_sim_7b_63");
}

TEST_CASE("malformed text says where") {
  struct bad {
    const char* text;
    const char* needle;
  };
  const bad cases[] = {
      {"", "empty text"},
      {"   ", "empty text"},
      {"[[0],[1", "offset 7"},
      {"[[0],[1]", "not closed"},
      {"[[0],[1.5]]", "integers"},
      {"[[0],[1e3]]", "integers"},
      {"[[0],[01]]", "leading zero"},
      {"[[0],[true]]", "expected an integer rank"},
      {"[[0],[\"1\"]]", "expected an integer rank"},
      {"[[0] [1]]", "expected ',' or ']' after a path"},
      {"[[0 1]]", "expected ',' or ']' inside a path"},
      {"[(0 1)]", "expected ',' or ')' inside a path"},
      {"[(0)]", "trailing comma"},
      {"((0,))", "trailing comma"},
      {"[0,1]", "expected a path"},
      {"{\"a\":1}", "expected '['"},
      {"[[0]] x", "unexpected text after"},
      {"[[0],,[1]]", "expected a path"},
      {"[[,]]", "expected an integer rank"},
      {"[[0],[-]]", "expected an integer rank"},
      {"[[0],[99999999999]]", "32-bit"},
      {"[[0],[2147483648]]", "32-bit"},
      {"[[[0]]]", "expected an integer rank"},
      {"[[0],\n[1,]x]", "line 2, column 5"},
      {"[[0],[1\x01]]", "near '?]]'"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.text);
    expect_error([&] { (void)tree::from_text(c.text); }, tree_errc::malformed_text, -1, c.needle);
  }
  // -2147483648 parses (then fails validation as a rank)
  expect_error([] { (void)tree::from_text("[[0],[-2147483648]]"); }, tree_errc::rank_out_of_range, 1,
               "rank -2147483648 < 0");
}

TEST_CASE("validation errors name the path, in the fixed order of docs/tree.md") {
  using P = paths_t;
  expect_error([] { (void)tree::from_paths({}); }, tree_errc::empty_tree, -1, "no paths");
  expect_error([] { (void)tree::from_text("[]"); }, tree_errc::empty_tree, -1, "no paths");
  expect_error([] { (void)tree::from_paths(P{{0}, {}}); }, tree_errc::empty_path, 1, "tree path #1 []: empty path");
  expect_error([] { (void)tree::from_paths(P{{0}, {1}, {3, 10}}); }, tree_errc::rank_out_of_range, 2,
               "tree path #2 [3,10]: rank 10 >= topk 10");
  expect_error([] { (void)tree::from_paths(P{{0}, {-1}}); }, tree_errc::rank_out_of_range, 1, "rank -1 < 0");
  expect_error([] { (void)tree::from_paths(P{{0}, {0, 5}}, {.topk = 5}); }, tree_errc::rank_out_of_range, 1,
               "rank 5 >= topk 5");
  expect_error([] { (void)tree::from_paths(P{{0}, {0, 0}, {0, 0, 0}}, {.max_depth = 2}); }, tree_errc::too_deep, 2,
               "tree path #2 [0,0,0]: depth 3 > max_depth 2");
  expect_error([] { (void)tree::from_paths(P{{0}, {1}, {0, 1}, {1}, {0}}); }, tree_errc::duplicate_path, 3,
               "tree path #3 [1]: duplicate of path #1");
  expect_error([] { (void)tree::from_paths(P{{0}, {0, 1}, {0, 1}, {0, 1}}); }, tree_errc::duplicate_path, 2,
               "duplicate of path #1");
  expect_error([] { (void)tree::from_paths(P{{0}, {1, 0}}); }, tree_errc::not_prefix_closed, 1,
               "tree path #1 [1,0]: not prefix-closed: its prefix [1] is missing");
  // names the shortest missing prefix
  expect_error([] { (void)tree::from_paths(P{{0}, {1, 2, 3}}); }, tree_errc::not_prefix_closed, 1, "its prefix [1] is");
  expect_error([] { (void)tree::from_paths(P{{0}, {0, 0, 3}}); }, tree_errc::not_prefix_closed, 1,
               "its prefix [0,0] is");
  // the first sorted path with a missing prefix, whatever the input order
  expect_error([] { (void)tree::from_paths(P{{5, 5, 5}, {0}, {2, 1}}); }, tree_errc::not_prefix_closed, 2,
               "tree path #2 [2,1]");

  // order: per-path checks in input order before duplicates before prefix closure
  expect_error([] { (void)tree::from_paths(P{{1, 0}, {0}, {0}, {0, 11}}); }, tree_errc::rank_out_of_range, 3, "11");
  expect_error([] { (void)tree::from_paths(P{{1, 0}, {0}, {0}}); }, tree_errc::duplicate_path, 2, "#2");
  expect_error([] { (void)tree::from_paths(P{{0, 10}, {}}); }, tree_errc::rank_out_of_range, 0, "#0");
  expect_error([] { (void)tree::from_paths(P{{}, {0, 10}}); }, tree_errc::empty_path, 0, "#0");
  // rank before depth within one path
  expect_error([] { (void)tree::from_paths(P{std::vector<int>(20, 0), {0, 12}}); }, tree_errc::too_deep, 0,
               "depth 20 > max_depth 16");
  expect_error([] { (void)tree::from_paths(P{std::vector<int>(20, 10)}); }, tree_errc::rank_out_of_range, 0,
               "(20 ranks)");

  // node limits: run-time option, parser limit
  expect_error([] { (void)tree::from_paths(P{{0}, {1}, {2}}, {.max_nodes = 3}); }, tree_errc::too_many_nodes, -1,
               "4 nodes");
  expect_error([] { (void)tree::from_text("[[0],[1],[2]]", {.max_nodes = 3}); }, tree_errc::too_many_nodes, 2,
               "more than 2 paths");

  // options out of range are plain invalid_input, not tree_error
  for (medusa::tree_options o : {medusa::tree_options{.topk = 0}, medusa::tree_options{.max_depth = 0},
                                 medusa::tree_options{.max_nodes = 1}, medusa::tree_options{.max_nodes = 1 << 20},
                                 medusa::tree_options{.topk = -3}}) {
    CHECK_THROWS_AS((void)tree::from_paths(P{{0}}, o), medusa::invalid_input);
    try {
      (void)tree::from_text("[[0]]", o);
    } catch (const tree_error&) {
      FAIL("options must not raise tree_error");
    } catch (const medusa::invalid_input& e) {
      CHECK(std::string(e.what()).find("tree_options") != std::string::npos);
    }
  }

  // non-throwing forms
  tree_errc code = tree_errc::empty_tree;
  CHECK_FALSE(tree::try_from_text("[[0],[1,0]]", {}, &code).has_value());
  CHECK(code == tree_errc::not_prefix_closed);
  CHECK(tree::try_from_paths(P{{0}}).has_value());
  // tree_error is an invalid_input and a std::invalid_argument
  CHECK_THROWS_AS((void)tree::from_text("[[0],[10]]"), std::invalid_argument);
  CHECK_THROWS_AS((void)tree::from_text("[[0],[10]]"), medusa::error);
}

TEST_CASE("a single node and a long chain") {
  const auto one = tree::from_text("[[0]]");
  CHECK(one.num_nodes() == 2);
  CHECK(one.num_leaves() == 1);
  CHECK(to_vec(one.retrieve_indices()) == std::vector<int>{0, 1});
  std::vector<std::vector<int>> chain;
  for (int d = 1; d <= 40; ++d) chain.emplace_back(static_cast<std::size_t>(d), 0);
  const auto t = tree::from_paths(chain, {.max_depth = 64});
  CHECK(t.depth() == 40);
  CHECK(t.num_leaves() == 1);
  CHECK(t.words_per_row() == 2);
  for (int c = 0; c <= 40; ++c) CHECK(t.retrieve(0, c) == c);
  CHECK(t.packed_mask_word(40, 1) == 0x1FFu);
  CHECK(t.packed_mask_word(40, 0) == 0xFFFFFFFFu);
  CHECK(t.tree_index(40) == 1 + 10 * 39);
}

TEST_CASE("copy_packed_mask writes the tree's packed mask and refuses a short buffer") {
  const auto t = medusa::tree::preset("vicuna_7b_stage2");
  std::vector<std::uint32_t> words(t.packed_mask().size() + 3, 0xdeadbeefu);
  medusa::copy_packed_mask(t, std::span<std::uint32_t>(words));
  CHECK(std::equal(t.packed_mask().begin(), t.packed_mask().end(), words.begin()));
  CHECK(words.back() == 0xdeadbeefu);  // nothing past the mask is written
  std::vector<std::uint32_t> small(t.packed_mask().size() - 1);
  CHECK_THROWS_AS(medusa::copy_packed_mask(t, std::span<std::uint32_t>(small)), medusa::invalid_input);
}
