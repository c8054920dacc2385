// SPDX-License-Identifier: Apache-2.0
//! @file io.hpp
//! File formats: safetensors (memory-mapped reader, writer), Medusa head checkpoints (legacy,
//! Hugging Face and sharded layouts, with their `config.json`), the tree search's calibration and
//! step-cost files, and the small JSON reader they use.
//! Kept out of `<medusa/medusa.hpp>`: they bring memory mapping and more of the standard library.
//!
//! @code
//! #include <medusa/io.hpp>
//! auto loaded = medusa::load_heads("heads/");       // directory or file
//! medusa::head_stack<> heads = loaded.heads.view();
//! @endcode
#pragma once

#include <medusa/io/json.hpp>
#include <medusa/io/safetensors.hpp>
#include <medusa/io/head_checkpoint.hpp>
#include <medusa/io/tree_search_files.hpp>
