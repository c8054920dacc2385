// SPDX-License-Identifier: Apache-2.0
//! @file tree/presets.hpp
//! The nine reference preset trees (spec §3, Appendix A) as compile-time `static_tree<64>` values.
//!
//! @code
//! #include <medusa/tree/presets.hpp>
//! static_assert(medusa::presets::mc_sim_7b_63.num_nodes() == 64);
//! static_assert(medusa::presets::vicuna_33b_stage1.depth() == 3);
//! @endcode
//!
//! Run-time access by name (`medusa::tree::preset("mc_sim_7b_63")`) needs only `<medusa/tree.hpp>`;
//! this header is separate because evaluating the nine trees at compile time costs every
//! translation unit that includes it about 0.3 s.
#pragma once

#include <medusa/config.hpp>
#include <medusa/tree.hpp>

#include <array>
#include <string_view>

MEDUSA_NAMESPACE_BEGIN

//! The nine reference presets as compile-time trees (64 nodes each, topk 10).
namespace presets {
inline constexpr auto mc_sim_7b_63 = static_tree_from<detail::preset_text::mc_sim_7b_63>;        //!< preset
inline constexpr auto vicuna_7b_stage2 = static_tree_from<detail::preset_text::vicuna_7b_stage2>;  //!< preset
inline constexpr auto vicuna_7b_stage1_ablation =
    static_tree_from<detail::preset_text::vicuna_7b_stage1_ablation>;                                //!< preset
inline constexpr auto vicuna_7b_stage1 = static_tree_from<detail::preset_text::vicuna_7b_stage1>;  //!< preset
inline constexpr auto vicuna_13b_stage2 = static_tree_from<detail::preset_text::vicuna_13b_stage2>;  //!< preset
inline constexpr auto vicuna_13b_stage1 = static_tree_from<detail::preset_text::vicuna_13b_stage1>;  //!< preset
inline constexpr auto vicuna_33b_stage2 = static_tree_from<detail::preset_text::vicuna_33b_stage2>;  //!< preset
inline constexpr auto vicuna_33b_stage1 = static_tree_from<detail::preset_text::vicuna_33b_stage1>;  //!< preset
inline constexpr auto zephyr_stage2 = static_tree_from<detail::preset_text::zephyr_stage2>;          //!< preset

//! All nine, in the order of `medusa::preset_names()` (e.g. to map a run-time tree onto an
//! instantiation with `medusa::same_shape`).
inline constexpr std::array<static_tree<64>, 9> all{mc_sim_7b_63,      vicuna_7b_stage2,  vicuna_7b_stage1_ablation,
                                                    vicuna_7b_stage1,  vicuna_13b_stage2, vicuna_13b_stage1,
                                                    vicuna_33b_stage2, vicuna_33b_stage1, zephyr_stage2};

//! One named type per preset, for `__global__` kernel templates: nvcc 13 cannot generate the
//! host launch stub of a `__global__` template whose template argument is a class-type value
//! (such as a `static_tree`), so key the kernel by a type and pass `Tag::tree` on to a
//! `__device__` template, which may take the value directly (checked with nvcc 13, sm_80):
//! `template <auto Tree> __device__ void body(...) { ... Tree.parent(i) ... }` and
//! `template <class Tag> __global__ void k(...) { body<Tag::tree>(...); }`.
namespace tags {
//! Names the preset `mc_sim_7b_63`.
struct mc_sim_7b_63 {
  static constexpr auto tree = presets::mc_sim_7b_63;  //!< the tree (a copy: a reference cannot be read in device code)
  static constexpr std::string_view name = "mc_sim_7b_63";    //!< its reference name
};
//! Names the preset `vicuna_7b_stage2`.
struct vicuna_7b_stage2 {
  static constexpr auto tree = presets::vicuna_7b_stage2;  //!< the tree (a copy: a reference cannot be read in device code)
  static constexpr std::string_view name = "vicuna_7b_stage2";    //!< its reference name
};
//! Names the preset `vicuna_7b_stage1_ablation`.
struct vicuna_7b_stage1_ablation {
  static constexpr auto tree = presets::vicuna_7b_stage1_ablation;  //!< the tree (a copy: a reference cannot be read in device code)
  static constexpr std::string_view name = "vicuna_7b_stage1_ablation";    //!< its reference name
};
//! Names the preset `vicuna_7b_stage1`.
struct vicuna_7b_stage1 {
  static constexpr auto tree = presets::vicuna_7b_stage1;  //!< the tree (a copy: a reference cannot be read in device code)
  static constexpr std::string_view name = "vicuna_7b_stage1";    //!< its reference name
};
//! Names the preset `vicuna_13b_stage2`.
struct vicuna_13b_stage2 {
  static constexpr auto tree = presets::vicuna_13b_stage2;  //!< the tree (a copy: a reference cannot be read in device code)
  static constexpr std::string_view name = "vicuna_13b_stage2";    //!< its reference name
};
//! Names the preset `vicuna_13b_stage1`.
struct vicuna_13b_stage1 {
  static constexpr auto tree = presets::vicuna_13b_stage1;  //!< the tree (a copy: a reference cannot be read in device code)
  static constexpr std::string_view name = "vicuna_13b_stage1";    //!< its reference name
};
//! Names the preset `vicuna_33b_stage2`.
struct vicuna_33b_stage2 {
  static constexpr auto tree = presets::vicuna_33b_stage2;  //!< the tree (a copy: a reference cannot be read in device code)
  static constexpr std::string_view name = "vicuna_33b_stage2";    //!< its reference name
};
//! Names the preset `vicuna_33b_stage1`.
struct vicuna_33b_stage1 {
  static constexpr auto tree = presets::vicuna_33b_stage1;  //!< the tree (a copy: a reference cannot be read in device code)
  static constexpr std::string_view name = "vicuna_33b_stage1";    //!< its reference name
};
//! Names the preset `zephyr_stage2`.
struct zephyr_stage2 {
  static constexpr auto tree = presets::zephyr_stage2;  //!< the tree (a copy: a reference cannot be read in device code)
  static constexpr std::string_view name = "zephyr_stage2";    //!< its reference name
};
}  // namespace tags
}  // namespace presets

MEDUSA_NAMESPACE_END
