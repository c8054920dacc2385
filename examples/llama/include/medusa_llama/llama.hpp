// SPDX-License-Identifier: Apache-2.0
//! @file llama.hpp
//! Umbrella header of the example CPU Llama engine (`medusa_llama`).
#pragma once

#include <medusa_llama/batch_engine.hpp>
#include <medusa_llama/cpu.hpp>
#include <medusa_llama/engine.hpp>
#include <medusa_llama/errors.hpp>
#include <medusa_llama/model.hpp>
#include <medusa_llama/packed_heads.hpp>
#include <medusa_llama/thread_pool.hpp>
#include <medusa_llama/tokenizer.hpp>
