// SPDX-License-Identifier: Apache-2.0
// Must not compile: rank 10 of path #1 is out of range for topk 10. The compiler's message must
// name the error code, the path index and the value (medusa::invalid_static_tree<code, 1, 10>).
#include <medusa/tree.hpp>

#ifdef MEDUSA_COMPILE_FAIL_CONTROL
constexpr auto t = medusa::static_tree_from<"[[0],[9]]">;
#else
constexpr auto t = medusa::static_tree_from<"[[0],[10]]">;
#endif

int main() { return t.num_nodes() == 3 ? 0 : 1; }
