#!/usr/bin/env bash
# Build ggml's CPU backend out of tree (Release, native ISA, static libs) and the
# peer benchmark bench/peer/ggml_step.c against it.
#
#   GGML_SRC    ggml source tree   (default /work/peer/ggml-src; extracted from
#               GGML_MIRROR if missing)
#   GGML_BUILD  build directory    (default /work/peer/ggml-build)
#   GGML_MIRROR git dir of ggml    (default /work/.mirror/ggerganov+ggml/repo)
#
# Builds at nice 19 with -j1 (the machine is shared). The benchmark binary is
# written to $GGML_BUILD/ggml_step.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
GGML_SRC="${GGML_SRC:-/work/peer/ggml-src}"
GGML_BUILD="${GGML_BUILD:-/work/peer/ggml-build}"
GGML_MIRROR="${GGML_MIRROR:-/work/.mirror/ggerganov+ggml/repo}"

if [ ! -f "$GGML_SRC/CMakeLists.txt" ]; then
    mkdir -p "$GGML_SRC"
    git -C "$GGML_MIRROR" archive HEAD | tar -x -C "$GGML_SRC"
fi

# GGML_LLAMAFILE=ON matches llama.cpp's default (llama.cpp's top-level CMake turns
# the tinyBLAS sgemm path on; standalone ggml leaves it off). OpenMP is ggml's and
# llama.cpp's default threading.
nice -n 19 cmake -S "$GGML_SRC" -B "$GGML_BUILD" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DGGML_CPU=ON \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
    -DGGML_LLAMAFILE=ON \
    -DGGML_OPENMP=ON \
    -DGGML_CCACHE=OFF \
    -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF

nice -n 19 cmake --build "$GGML_BUILD" --config Release -j1 --target ggml

# The benchmark (C11), linked statically against the three ggml libraries.
LIBS="$(find "$GGML_BUILD" -name 'libggml.a' | head -1) \
      $(find "$GGML_BUILD" -name 'libggml-cpu.a' | head -1) \
      $(find "$GGML_BUILD" -name 'libggml-base.a' | head -1)"
nice -n 19 cc -O2 -std=c11 -march=native -fopenmp \
    -I "$GGML_SRC/include" \
    "$HERE/ggml_step.c" $LIBS \
    -lstdc++ -lm -lpthread \
    -o "$GGML_BUILD/ggml_step"
echo "built $GGML_BUILD/ggml_step"
