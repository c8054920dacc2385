// SPDX-License-Identifier: Apache-2.0
//! @file medusa.hpp
//! Umbrella header: everything an engine needs for Medusa decoding on the CPU.
//!
//! @code
//! #include <medusa/medusa.hpp>
//! static_assert(medusa::version().major == MEDUSA_VERSION_MAJOR);
//! @endcode
//!
//! File formats (safetensors, head checkpoints, JSON) are in `<medusa/io.hpp>`; the compile-time
//! presets in `<medusa/tree/presets.hpp>` and `dispatch_tree`, which instantiates them, in
//! `<medusa/dispatch/tree.hpp>` (or `<medusa/dispatch.hpp>`, every dispatcher); CUDA kernels live
//! in `<medusa/cuda/...>` and need nvcc.
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
#include <medusa/draft_model.hpp>
#include <medusa/draft_sampler.hpp>
#include <medusa/draft_tree.hpp>
#include <medusa/feature_draft.hpp>
#include <medusa/decoder.hpp>
#include <medusa/decoder/calibrate.hpp>
#include <medusa/decoder/step_cost.hpp>
#include <medusa/dispatch/value.hpp>
#include <medusa/dispatch/policy.hpp>
