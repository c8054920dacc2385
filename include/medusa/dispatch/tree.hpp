// SPDX-License-Identifier: Apache-2.0
//! @file dispatch/tree.hpp
//! A tree known at run time to its compile-time preset: `dispatch_tree(t, f)` calls `f` with the
//! preset's `static_tree` when `t` has a preset's shape, else with `t`. It includes the
//! compile-time presets (`tree/presets.hpp`), which the umbrella `medusa.hpp` leaves out.
//!
//! @code
//! #include <medusa/dispatch/tree.hpp>
//! auto t = medusa::tree::preset("mc_sim_7b_63");
//! bool compile_time = medusa::dispatch_tree(t, [](const auto& tree) {
//!   return !std::is_same_v<std::remove_cvref_t<decltype(tree)>, medusa::tree>;
//! });  // true: the preset runs on its static_tree
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/dispatch/value.hpp>
#include <medusa/tree/presets.hpp>
#include <medusa/tree/runtime_tree.hpp>

#include <cstddef>
#include <tuple>
#include <utility>

MEDUSA_NAMESPACE_BEGIN

//! Calls `f(Tag::tree)` with the compile-time tree of the first tag in `Tags` whose tree has the
//! shape of `t` (`same_shape`), else `f(t)`. By default the tags are the presets, so a preset
//! given at run time runs on its `static_tree` instantiation.
template <class Tags = presets::all_tags, class F>
decltype(auto) dispatch_tree(const tree& t, F&& f, Tags = {}) {
  return [&]<class... Tag>(presets::tag_list<Tag...>) -> decltype(auto) {
    constexpr std::size_t count = sizeof...(Tag);
    std::size_t index = count;
    std::size_t i = 0;
    ((index = index == count && same_shape(t, Tag::tree) ? i : index, ++i), ...);
    if constexpr (count == 0) {
      return f(t);
    } else {
      if (index == count) return f(t);
      return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
        return dispatch_value<I...>(index, "tree", [&]<std::size_t J>() -> decltype(auto) {
          return f(std::tuple_element_t<J, std::tuple<Tag...>>::tree);
        });
      }(std::make_index_sequence<count>{});
    }
  }(Tags{});
}

MEDUSA_NAMESPACE_END
