// SPDX-License-Identifier: Apache-2.0
//! @file acceptance.hpp
//! Acceptance (docs/acceptance.md): which drafted tree nodes to commit, and the bonus token of the
//! next step.
//!
//! A policy is a small struct passed as a template parameter. Two kinds exist:
//! - *node-test* policies (`greedy_policy`, `typical_policy`, user policies): a deterministic
//!   pass/fail test of each child token against its parent's logits, plus an optional log-score
//!   that breaks ties between equally long rows;
//! - *sampling* policies (`rejection_policy`, `speculative_policy`, `draft_sampling_policy`):
//!   lossless tree speculative sampling with a counter-based generator; the committed tokens and
//!   the bonus are distributed exactly as autoregressive sampling from the warped target
//!   distribution.
//!
//! Logits are row-major `[num_nodes][vocab]` floats, row u = the model's output after node u.
//! Node-test policies read only the rows of nodes whose whole ancestry passed (and the final
//! node's row for the bonus); only rows that are read are checked. -Inf is a legal logit: a masked
//! token, which every policy treats as probability 0 (never accepted, never drawn); NaN, +Inf
//! and rows with every token masked are errors.
//!
//! @code
//! auto t = medusa::tree::preset("mc_sim_7b_63");
//! medusa::acceptance_workspace ws(t.num_nodes(), vocab);  // once
//! medusa::verify_request req{.node_tokens = node_tokens, .logits = logits, .vocab = vocab};
//! auto r = medusa::verify(t, req, medusa::typical_policy{.temperature = 0.7f}, ws);
//! // commit r.tokens() (root + r.accept_length drafts); next step's root = r.bonus;
//! // next state = row r.next_node of the tree pass.
//! @endcode
#pragma once

#include <medusa/acceptance/policies.hpp>  // the policies and their concepts
#include <medusa/acceptance/request.hpp>   // verify_request, verify_result, acceptance_workspace
#include <medusa/acceptance/sampling.hpp>  // the sampling algorithms, sample_token, sample_candidates
#include <medusa/acceptance/verify.hpp>    // verify, verify_batch
#include <medusa/acceptance_error.hpp>     // acceptance_error
