# SPDX-License-Identifier: Apache-2.0
# Cross build for 64-bit ARM Linux (aarch64, NEON) with Debian's cross compiler
# (g++-aarch64-linux-gnu) and the arm64 -dev packages of Debian's multiarch
# (dpkg --add-architecture arm64; libhwy-dev:arm64 ... in /usr/lib/aarch64-linux-gnu and
# /usr/include; scripts/install-deps installs them). ctest runs the test programs under qemu-user
# (qemu-aarch64). Used by the preset "aarch64":
#   cmake --preset aarch64 && cmake --build --preset aarch64 && ctest --preset aarch64
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(MEDUSA_CROSS_TRIPLE aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${MEDUSA_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${MEDUSA_CROSS_TRIPLE}-g++)
# Debian's multiarch directory of the target: lib/aarch64-linux-gnu under each prefix.
set(CMAKE_LIBRARY_ARCHITECTURE ${MEDUSA_CROSS_TRIPLE})

# Look for the target's libraries, headers and packages in the cross sysroot of the compiler
# (/usr/${triple}) and in the multiarch system directories (/usr/lib/${triple}, /usr/include,
# the architecture-independent /usr/share/cmake and /usr/lib/cmake of header-only packages);
# programs (python3, the tools run at build time) come from the host.
set(CMAKE_FIND_ROOT_PATH /usr/${MEDUSA_CROSS_TRIPLE} /)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# pkg-config (FindPkgConfig): the target's .pc files only, never the host's x86_64 ones.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/${MEDUSA_CROSS_TRIPLE}/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")

# ctest (and add_test/try_run) run the target's programs under user-mode emulation. With Debian's
# multiarch libc6:arm64 installed (the arm64 -dev packages pull it in) the programs load the
# arm64 dynamic loader and libraries of / (/lib/ld-linux-aarch64.so.1, /usr/lib/aarch64-linux-gnu),
# so no -L is given: "-L /usr/${triple}" would pair the cross sysroot's ld.so with the multiarch
# libc.so.6, another build of glibc, and a program's first std::thread then never starts. Without
# libc6:arm64 the cross sysroot is the root of the loader and the C library.
find_program(MEDUSA_QEMU_AARCH64 NAMES qemu-aarch64 qemu-aarch64-static)
if(MEDUSA_QEMU_AARCH64)
  if(EXISTS /lib/ld-linux-aarch64.so.1)
    set(CMAKE_CROSSCOMPILING_EMULATOR "${MEDUSA_QEMU_AARCH64}")
  else()
    set(CMAKE_CROSSCOMPILING_EMULATOR "${MEDUSA_QEMU_AARCH64};-L;/usr/${MEDUSA_CROSS_TRIPLE}")
  endif()
else()
  message(WARNING "qemu-aarch64 not found (Debian package qemu-user): the tests cannot run on this machine")
endif()
