// SPDX-License-Identifier: Apache-2.0
//! @file dispatch.hpp
//! The one place where run-time values become template arguments: the three headers of
//! `dispatch/`, each at its own height in the include graph.
//!
//! | dispatcher | run-time value | what `f` receives |
//! |---|---|---|
//! | `dispatch_value<Vs...>(v, what, f)` | any value in the list `Vs` | `f.template operator()<V>()` |
//! | `dispatch_dtype(d, f)` | `dtype` | `f.template operator()<D>()`, `D` an `dtype` constant |
//! | `dispatch_head_count(n, f)` | head count | `f.template operator()<H>()`: `H` = n for 1..8, else `std::dynamic_extent` |
//! | `dispatch_policy(name, options, f)` | policy name + options | `f(policy)`: a `greedy_policy`, `typical_policy`, ... |
//! | `dispatch_tree(t, f)` | a run-time `medusa::tree` | `f(tree)`: the preset's `static_tree` when `t` has a preset's shape, else `t` |
//!
//! A value outside the supported list throws `dispatch_error` naming the value and the list.
//! Every instantiation `f` is called with must return the same type.
//!
//! @code
//! #include <medusa/dispatch.hpp>
//! auto t = medusa::tree::from_text(tree_text);
//! medusa::dispatch_policy("typical", {.temperature = 0.7f}, [&](auto policy) {
//!   medusa::dispatch_tree(t, [&](const auto& tree) {
//!     medusa::decoder dec(model, heads, tree, policy);   // instantiated per preset and policy
//!     return dec.generate(prompt);
//!   });
//! });
//! @endcode
#pragma once

#include <medusa/dispatch/policy.hpp>  // dispatch_policy, make_policy (above acceptance)
#include <medusa/dispatch/tree.hpp>    // dispatch_tree (above tree/ and the presets)
#include <medusa/dispatch/value.hpp>   // dispatch_value, dispatch_dtype, dispatch_head_count
