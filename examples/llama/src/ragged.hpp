// SPDX-License-Identifier: Apache-2.0
// Private: what the serving engines (the CPU `batch_engine` and the GPU `cuda_engine`) share about
// a `medusa::ragged_batch`: its validation against the engine's limits and pages, and its cut into
// passes of at most `max_tokens` rows.
#pragma once

#include <medusa_llama/model.hpp>

#include <medusa/decoder/model.hpp>
#include <medusa/tree/mask.hpp>

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace medusa_llama::detail {

//! The pages of a paged KV pool and who holds them: one block table per request id, a free list
//! handed out in a fixed scattered order (as in a pool that has served many requests), the peak.
class page_allocator {
 public:
  //! Options are checked by the engine.
  page_allocator(int num_pages, int page_size, int max_requests, int max_context);

  //! Throws `engine_error` (`bad_request`) for an id outside [0, max_requests).
  void check_request(int r) const;
  //! Maps pages to `r` until slots [0, slots) are addressable. Throws `engine_error` (`bad_request`,
  //! `bad_slot` for slots outside [0, max_context], `out_of_pages`) and then changes nothing.
  void reserve(int r, int slots);
  //! Returns r's pages wholly past slot `length` to the pool. Throws `engine_error` (`bad_request`,
  //! `bad_slot` for a negative length).
  void release(int r, int length);

  //! r's block table (logical block -> page); its storage never moves (reserved at construction).
  [[nodiscard]] const std::vector<std::int32_t>& table(int r) const { return tables_[static_cast<std::size_t>(r)]; }
  //! Slots r's pages cover.
  [[nodiscard]] int mapped_slots(int r) const { return static_cast<int>(table(r).size()) * page_size_; }
  [[nodiscard]] int num_pages() const noexcept { return num_pages_; }
  [[nodiscard]] int page_size() const noexcept { return page_size_; }
  [[nodiscard]] int in_use() const noexcept { return num_pages_ - static_cast<int>(free_.size()); }
  [[nodiscard]] int free_pages() const noexcept { return static_cast<int>(free_.size()); }
  [[nodiscard]] int peak() const noexcept { return peak_; }
  void reset_peak() noexcept { peak_ = in_use(); }

 private:
  int num_pages_, page_size_, max_requests_, max_context_;
  std::vector<std::vector<std::int32_t>> tables_;
  std::vector<std::int32_t> free_;  // handed out from the back
  int peak_ = 0;
};

//! The limits a ragged batch is checked against.
struct ragged_limits {
  int max_requests = 0;  //!< request ids are [0, max_requests)
  int max_context = 0;   //!< most slots of one request
  int max_tokens = 0;    //!< rows of one pass (a tree request must fit one)
  int page_size = 0;     //!< slots per page (for the messages)
};

//! Throws `engine_error` for any inconsistent argument of `b`, naming the request at fault:
//! sizes, qo_indptr, request ids (in range, once each), tokens and positions, slots beyond the
//! context or not mapped (`mapped_slots(request)` tells how many slots its pages cover), masks,
//! output spans. `seen` is scratch of `max_requests` entries.
void check_ragged_batch(const model_config& c, const ragged_limits& lim, const medusa::ragged_batch& b,
                        const std::function<int(int request)>& mapped_slots, std::vector<char>& seen);

//! One piece of a request in a pass: rows `[row0, row0 + rows)` of the pass, at cache slots
//! `[cache_length, cache_length + rows)`, under `mask` (empty: causal).
struct pass_piece {
  int index = 0;         //!< the request's position in the batch
  int request = 0;       //!< its id
  int row0 = 0;          //!< first row of the pass
  int rows = 0;
  int cache_length = 0;
  medusa::tree_mask_view mask{};
};

//! One pass: its pieces, its rows `[first_row, first_row + rows)` of the batch, the pass rows whose
//! outputs are wanted (`out_rows`) and the output row they start at (`first_output`).
struct pass_plan {
  std::span<const pass_piece> pieces;
  int first_row = 0;
  int rows = 0;
  std::span<const int> out_rows;
  int first_output = 0;
};

//! Cuts `b` into passes, in batch order: a causal request is cut where a pass is full (its pieces
//! see the earlier ones through the cache), a tree request starts a new pass when it does not fit
//! the current one. Calls `run(pass)` for each; a pass covers consecutive batch rows and its output
//! rows are consecutive output rows (all rows, or each request's last with `last_row_only`).
void for_each_pass(const medusa::ragged_batch& b, int max_tokens, const std::function<void(const pass_plan&)>& run);

}  // namespace medusa_llama::detail
