#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes a copy of a GGUF file with another `<arch>.context_length`.

llama.cpp's `llama-convert-llama2c-to-ggml` records a context of 128 whatever the llama2.c
checkpoint was trained for (pycode-15m: 512), and engines that honour the file's context stop
there. This sets it back, so that both engines decode the same number of tokens:

  bench/peer/gguf_set_context.py IN.gguf OUT.gguf 512
"""
import struct
import sys

SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar value types


def skip_value(data: bytes, at: int, kind: int) -> int:
    if kind in SIZES:
        return at + SIZES[kind]
    if kind == 8:  # string: u64 length, bytes
        return at + 8 + struct.unpack_from("<Q", data, at)[0]
    if kind == 9:  # array: u32 element type, u64 count, elements
        elem, count = struct.unpack_from("<IQ", data, at)
        at += 12
        for _ in range(count):
            at = skip_value(data, at, elem)
        return at
    raise ValueError(f"unknown GGUF value type {kind}")


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst, context = sys.argv[1], sys.argv[2], int(sys.argv[3])
    data = bytearray(open(src, "rb").read())
    if data[:4] != b"GGUF" or struct.unpack_from("<I", data, 4)[0] < 2:
        print(f"{src}: not a GGUF file of version 2 or 3", file=sys.stderr)
        return 1
    kv_count = struct.unpack_from("<Q", data, 16)[0]
    at = 24
    for _ in range(kv_count):
        n = struct.unpack_from("<Q", data, at)[0]
        key = bytes(data[at + 8:at + 8 + n]).decode()
        at += 8 + n
        kind = struct.unpack_from("<I", data, at)[0]
        at += 4
        if key.endswith(".context_length") and kind in (4, 5):
            old = struct.unpack_from("<I", data, at)[0]
            struct.pack_into("<I", data, at, context)
            open(dst, "wb").write(data)
            print(f"{dst}: {key} {old} -> {context}")
            return 0
        at = skip_value(data, at, kind)
    print(f"{src}: no <arch>.context_length key", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
