// SPDX-License-Identifier: Apache-2.0
// The unit that builds the tests' precompiled header (tests/CMakeLists.txt); it has no code of its own.
