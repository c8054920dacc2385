// SPDX-License-Identifier: Apache-2.0
//! @file tree/presets.hpp
//! The preset trees of `preset_table` as compile-time `static_tree<64>` values and as tag types.
//!
//! @code
//! #include <medusa/tree/presets.hpp>
//! constexpr auto t = medusa::presets::named<"mc_sim_7b_63">;
//! static_assert(t.num_nodes() == 64 && t == medusa::presets::all[0]);
//! using tag = medusa::presets::tag_of<"vicuna_33b_stage1">;
//! static_assert(tag::tree.depth() == 3 && tag::name == "vicuna_33b_stage1");
//! @endcode
//!
//! Tags exist for `__global__` kernel templates: nvcc 13 cannot generate the host launch stub of
//! a `__global__` template whose template argument is a class-type value (such as a
//! `static_tree`), so key the kernel by a type and pass `Tag::tree` on to a `__device__`
//! template, which may take the value directly:
//! `template <auto Tree> __device__ void body(...) { ... Tree.parent(i) ... }` and
//! `template <class Tag> __global__ void k(...) { body<Tag::tree>(...); }`.
//!
//! Run-time access by name (`medusa::tree::preset("mc_sim_7b_63")`) needs only `<medusa/tree.hpp>`.
//! This header is separate because evaluating the trees costs each translation unit that uses
//! them a fraction of a second.
#pragma once

#include <medusa/config.hpp>
#include <medusa/tree/preset_table.hpp>
#include <medusa/tree/static_tree.hpp>

#include <array>
#include <cstddef>
#include <string_view>
#include <utility>

MEDUSA_NAMESPACE_BEGIN

namespace detail {
template <fixed_string Name>
constexpr std::size_t checked_preset_index() {
  constexpr std::size_t i = preset_index(Name.view());
  static_assert(i < preset_table.size(), "medusa: unknown preset name (see medusa::preset_names())");
  return i;
}
template <class Sequence, template <std::size_t> class Tag, template <class...> class List>
struct index_tags;
template <std::size_t... I, template <std::size_t> class Tag, template <class...> class List>
struct index_tags<std::index_sequence<I...>, Tag, List> {
  using type = List<Tag<I>...>;
};
}  // namespace detail

namespace presets {

//! Preset `I` of `preset_table` as a type: `tag<I>::tree` (its `static_tree<64>`), `tag<I>::name`.
template <std::size_t I>
struct tag {
  static_assert(I < preset_table.size(), "medusa: no preset with this index");

 private:
  static constexpr auto counts = medusa::detail::count_text(preset_table[I].text);
  static constexpr auto build = medusa::detail::build_from_text<medusa::detail::static_nodes(counts.paths), counts.ranks>(
      preset_table[I].text, tree_options{});

 public:
  //! Index in `preset_table`.
  static constexpr std::size_t index = I;
  //! The reference name.
  static constexpr std::string_view name = preset_table[I].name;
  //! The tree (a copy: a reference cannot be read in device code).
  static constexpr auto tree = medusa::detail::checked_static_tree<build>();
};

//! The tag of the preset called `Name`; an unknown name is a compile error.
template <fixed_string Name>
using tag_of = tag<medusa::detail::checked_preset_index<Name>()>;

//! The compile-time tree of the preset called `Name`.
template <fixed_string Name>
inline constexpr auto named = tag_of<Name>::tree;

//! A list of tag types (for `medusa::dispatch_tree`).
template <class... Tags>
struct tag_list {};

//! All preset tags, in table order.
using all_tags = medusa::detail::index_tags<std::make_index_sequence<preset_table.size()>, tag, tag_list>::type;

//! All preset trees, in table order (e.g. to map a run-time tree onto an instantiation with
//! `medusa::same_shape`).
inline constexpr auto all = []<std::size_t... I>(std::index_sequence<I...>) {
  return std::array{tag<I>::tree...};
}(std::make_index_sequence<preset_table.size()>{});

}  // namespace presets

MEDUSA_NAMESPACE_END
