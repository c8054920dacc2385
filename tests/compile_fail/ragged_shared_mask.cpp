// SPDX-License-Identifier: Apache-2.0
// Must not compile: an engine that reads the mask shared by the batch (`ragged_batch::tree_mask`,
// gone) instead of each request's own (`mask_of(b)`) would attend causally over every tree.
#include <medusa/decoder/model.hpp>

struct shared_mask_engine {
  medusa::tree_mask_view seen;
  void forward(const medusa::ragged_batch& b) {
    for (int i = 0; i < b.size(); ++i) {
#ifdef MEDUSA_COMPILE_FAIL_CONTROL
      seen = b.mask_of(i);
#else
      seen = b.tree_mask;
#endif
    }
  }
};

int main() {
  shared_mask_engine e;
  e.forward(medusa::ragged_batch{});
  return e.seen.empty() ? 0 : 1;
}
