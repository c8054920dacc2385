// SPDX-License-Identifier: Apache-2.0
//! @file medusa.hpp
//! Umbrella header: everything an engine needs for Medusa decoding on the CPU.
//!
//! @code
//! #include <medusa/medusa.hpp>
//! static_assert(medusa::version().major == MEDUSA_VERSION_MAJOR);
//! @endcode
//!
//! File formats (safetensors, head checkpoints, JSON) are in `<medusa/io.hpp>`, and the
//! compile-time presets in `<medusa/tree/presets.hpp>`; CUDA kernels live in `<medusa/cuda/...>`
//! and need nvcc.
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>
#include <medusa/dtype.hpp>
#include <medusa/half.hpp>
#include <medusa/parallel.hpp>
#include <medusa/tree.hpp>
#include <medusa/candidates.hpp>
#include <medusa/acceptance.hpp>
#include <medusa/kv_cache.hpp>
#include <medusa/attention.hpp>
#include <medusa/gemm.hpp>
#include <medusa/heads.hpp>
#include <medusa/drafts.hpp>
#include <medusa/decoder.hpp>
#include <medusa/decoder/calibrate.hpp>
#include <medusa/decoder/step_cost.hpp>
#include <medusa/dispatch.hpp>
