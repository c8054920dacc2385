#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Convert a llama2.c checkpoint (model.bin + tokenizer.bin) to a GGUF v3 file.

The result loads in medusa's example engine (medusa-run --model out.gguf) and in llama.cpp. The
2-D matrices (token embedding, attention and FFN matrices, classifier) are written in the chosen
type, like llama.cpp's `--pure`; the RMSNorm weights stay F32. Q8_0 and Q4_0 quantize exactly as
ggml's reference quantizers (quantize_row_q8_0_ref / quantize_row_q4_0_ref) do, float32 arithmetic
included, so the blocks are bit-identical to llama.cpp's.

    scripts/convert_to_gguf.py ../shared/models/pycode-15m/model.bin pycode-15m-q8_0.gguf --type q8_0

Only the Python standard library is used.
"""

import argparse
import math
import os
import re
import struct
import sys
import time
from array import array

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32
QK = 32  # elements per Q8_0 / Q4_0 block

# gguf_metadata_value_type
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9
# ggml_type ids, bytes per block, elements per block
GGML_TYPES = {"f32": (0, 4, 1), "f16": (1, 2, 1), "q4_0": (2, 18, QK), "q8_0": (8, 34, QK), "bf16": (30, 2, 1)}
# llama_ftype written as general.file_type
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}

SPACE_MARKER = "\u2581"  # SentencePiece's "▁"
BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


class ConvertError(Exception):
    pass


# --- llama2.c input ------------------------------------------------------------------------------

def read_llama2c(path):
    """Returns (config dict, {name: (floats as array('f'), [out, in] or [n])})."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 28:
        raise ConvertError(f"{path}: {len(data)} bytes, less than the 28-byte llama2.c header")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = struct.unpack_from("<7i", data, 0)
    shared = vocab > 0
    vocab = abs(vocab)
    for name, v in (("dim", dim), ("hidden_dim", hidden), ("n_layers", n_layers), ("n_heads", n_heads),
                    ("n_kv_heads", n_kv_heads), ("vocab_size", vocab), ("seq_len", seq_len)):
        if v <= 0:
            raise ConvertError(f"{path}: header field {name} = {v} is not positive")
    if dim % n_heads or n_heads % n_kv_heads or (dim // n_heads) % 2:
        raise ConvertError(f"{path}: dim {dim}, n_heads {n_heads}, n_kv_heads {n_kv_heads} are inconsistent")
    head_dim = dim // n_heads
    kv_dim = head_dim * n_kv_heads
    cfg = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
               vocab_size=vocab, seq_len=seq_len, shared_classifier=shared, head_dim=head_dim)

    sizes = [("emb", vocab * dim), ("rms_att", n_layers * dim), ("wq", n_layers * dim * dim),
             ("wk", n_layers * kv_dim * dim), ("wv", n_layers * kv_dim * dim), ("wo", n_layers * dim * dim),
             ("rms_ffn", n_layers * dim), ("w1", n_layers * hidden * dim), ("w2", n_layers * dim * hidden),
             ("w3", n_layers * hidden * dim), ("rms_final", dim), ("rope", seq_len * head_dim)]
    if not shared:
        sizes.append(("cls", vocab * dim))
    want = 28 + 4 * sum(n for _, n in sizes)
    if len(data) != want:
        raise ConvertError(f"{path}: {len(data)} bytes, but the header (dim {dim}, hidden {hidden}, layers {n_layers}, "
                           f"vocab {vocab}, seq_len {seq_len}) announces {want}")
    view = memoryview(data)
    groups, off = {}, 28
    for name, n in sizes:
        groups[name] = (off, n)
        off += 4 * n

    def floats(group, index, count):
        start = groups[group][0] + 4 * index * count
        a = array("f")
        a.frombytes(view[start:start + 4 * count])
        if sys.byteorder != "little":
            a.byteswap()
        return a

    t = {"token_embd.weight": (floats("emb", 0, vocab * dim), [vocab, dim])}
    for i in range(n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = (floats("rms_att", i, dim), [dim])
        t[p + "attn_q.weight"] = (floats("wq", i, dim * dim), [dim, dim])
        t[p + "attn_k.weight"] = (floats("wk", i, kv_dim * dim), [kv_dim, dim])
        t[p + "attn_v.weight"] = (floats("wv", i, kv_dim * dim), [kv_dim, dim])
        t[p + "attn_output.weight"] = (floats("wo", i, dim * dim), [dim, dim])
        t[p + "ffn_norm.weight"] = (floats("rms_ffn", i, dim), [dim])
        t[p + "ffn_gate.weight"] = (floats("w1", i, hidden * dim), [hidden, dim])
        t[p + "ffn_down.weight"] = (floats("w2", i, dim * hidden), [dim, hidden])
        t[p + "ffn_up.weight"] = (floats("w3", i, hidden * dim), [hidden, dim])
    t["output_norm.weight"] = (floats("rms_final", 0, dim), [dim])
    if not shared:  # a shared classifier is the embedding: llama.cpp uses token_embd when output is absent
        t["output.weight"] = (floats("cls", 0, vocab * dim), [vocab, dim])
    return cfg, t


def read_tokenizer(path, vocab_size):
    """llama2.c tokenizer.bin: int32 max_token_length, then per token float32 score, int32 length, bytes."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise ConvertError(f"{path}: too short for a llama2.c tokenizer")
    off, pieces, scores = 4, [], []
    for i in range(vocab_size):
        if off + 8 > len(data):
            raise ConvertError(f"{path}: ends at token {i} of the {vocab_size} the model has")
        score, n = struct.unpack_from("<fi", data, off)
        off += 8
        if n < 0 or off + n > len(data):
            raise ConvertError(f"{path}: token {i} has a bad length {n}")
        pieces.append(data[off:off + n])
        scores.append(score)
        off += n
    if off != len(data):
        raise ConvertError(f"{path}: {len(data) - off} bytes follow the {vocab_size} tokens of the model")
    return pieces, scores


def gguf_vocab(pieces):
    """Token texts and types as llama.cpp's llama2.c converter writes them: ids 0/1/2 are <unk>, <s>,
    </s>; <0xXX> pieces are byte tokens; spaces become SentencePiece's ▁ again."""
    tokens, types = [], []
    for i, raw in enumerate(pieces):
        text = raw.decode("utf-8", errors="replace")
        if i == 0:
            token, ttype = "<unk>", 2  # unknown
        elif i in (1, 2):
            token, ttype = ("<s>" if i == 1 else "</s>"), 3  # control
        elif BYTE_PIECE.match(text):
            token, ttype = "<0x" + text[3:5].upper() + ">", 6  # byte
        else:
            token, ttype = text.replace(" ", SPACE_MARKER), 1  # normal
        tokens.append(token)
        types.append(ttype)
    return tokens, types


def sentencepiece_adds_dummy_prefix(path):
    """NormalizerSpec.add_dummy_prefix (ModelProto field 3, its field 3) of a SentencePiece model;
    true when absent, as protobuf's default."""
    with open(path, "rb") as f:
        data = f.read()

    def varint(buf, i):
        v, shift = 0, 0
        while True:
            if i >= len(buf) or shift > 63:
                raise ConvertError(f"{path}: malformed SentencePiece model")
            b = buf[i]
            i += 1
            v |= (b & 0x7F) << shift
            if not b & 0x80:
                return v, i
            shift += 7

    def fields(buf):
        i = 0
        while i < len(buf):
            key, i = varint(buf, i)
            wire = key & 7
            if wire == 0:
                v, i = varint(buf, i)
            elif wire == 1:
                v, i = buf[i:i + 8], i + 8
            elif wire == 2:
                n, i = varint(buf, i)
                v, i = buf[i:i + n], i + n
            elif wire == 5:
                v, i = buf[i:i + 4], i + 4
            else:
                raise ConvertError(f"{path}: unsupported protobuf wire type {wire}")
            if i > len(buf):
                raise ConvertError(f"{path}: malformed SentencePiece model")
            yield key >> 3, wire, v

    prefix = True
    for num, wire, v in fields(data):
        if num == 3 and wire == 2:
            for n2, w2, v2 in fields(v):
                if n2 == 3 and w2 == 0:
                    prefix = v2 != 0
    return prefix


# --- encodings -----------------------------------------------------------------------------------

def f32(x):
    """x rounded to float32 (round to nearest even), as a Python float."""
    return array("f", (x,))[0]


def to_f16(a):
    try:
        return struct.pack(f"<{len(a)}e", *a)
    except OverflowError:  # |x| >= 65520 becomes an infinity, as in ggml
        return b"".join(struct.pack("<e", x) if abs(x) < 65520.0 or x != x else struct.pack("<e", math.copysign(math.inf, x))
                        for x in a)


def to_bf16(a):
    u = array("I")
    u.frombytes(a.tobytes())
    out = array("H", [((x >> 16) | 64) & 0xFFFF if (x & 0x7FFFFFFF) > 0x7F800000 else ((x + 0x7FFF + ((x >> 16) & 1)) >> 16) & 0xFFFF
                      for x in u])
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def to_q8_0(a):
    """ggml quantize_row_q8_0_ref: d = amax / 127, q = roundf(x * (1/d)), d stored as fp16."""
    out = bytearray()
    pack = struct.Struct("<e32b").pack
    for b in range(0, len(a), QK):
        blk = a[b:b + QK]
        amax = max(max(blk), -min(blk))
        d = f32(amax / 127.0)
        inv = f32(1.0 / d) if d else 0.0
        scaled = array("f", [x * inv for x in blk])
        out += pack(d, *[int(v + 0.5) if v >= 0 else int(v - 0.5) for v in scaled])  # roundf: half away from 0
    return bytes(out)


def to_q4_0(a):
    """ggml quantize_row_q4_0_ref: max = the value of largest magnitude (first one on ties),
    d = max / -8, q = min(15, (int8)(x * (1/d) + 8.5)); element j and j + 16 share byte j."""
    out = bytearray()
    pack = struct.Struct("<e16B").pack
    for b in range(0, len(a), QK):
        blk = a[b:b + QK]
        hi, lo = max(blk), min(blk)
        if hi > -lo:
            mx = hi
        elif -lo > hi:
            mx = lo
        elif hi == 0.0:
            mx = 0.0  # all zero: ggml's initial max (+0), so d = -0
        else:
            mx = hi if blk.index(hi) < blk.index(lo) else lo
        d = f32(mx / -8.0)
        inv = f32(1.0 / d) if d else 0.0
        shifted = array("f", [v + 8.5 for v in array("f", [x * inv for x in blk])])
        q = [min(15, int(v)) for v in shifted]
        out += pack(d, *[q[j] | (q[j + 16] << 4) for j in range(16)])
    return bytes(out)


ENCODERS = {"f32": lambda a: a.tobytes() if sys.byteorder == "little" else _swapped(a),
            "f16": to_f16, "bf16": to_bf16, "q8_0": to_q8_0, "q4_0": to_q4_0}


def _swapped(a):
    b = array("f", a)
    b.byteswap()
    return b.tobytes()


# --- GGUF output ---------------------------------------------------------------------------------

class Metadata:
    def __init__(self):
        self.buf = bytearray()
        self.count = 0

    def _key(self, key, vtype):
        k = key.encode()
        self.buf += struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype)
        self.count += 1

    @staticmethod
    def _str(s):
        b = s.encode("utf-8")
        return struct.pack("<Q", len(b)) + b

    def string(self, key, value):
        self._key(key, T_STRING)
        self.buf += self._str(value)

    def u32(self, key, value):
        self._key(key, T_UINT32)
        self.buf += struct.pack("<I", value)

    def f32(self, key, value):
        self._key(key, T_FLOAT32)
        self.buf += struct.pack("<f", value)

    def bool(self, key, value):
        self._key(key, T_BOOL)
        self.buf += struct.pack("<B", 1 if value else 0)

    def strings(self, key, values):
        self._key(key, T_ARRAY)
        self.buf += struct.pack("<IQ", T_STRING, len(values))
        self.buf += b"".join(self._str(v) for v in values)

    def floats(self, key, values):
        self._key(key, T_ARRAY)
        self.buf += struct.pack("<IQ", T_FLOAT32, len(values)) + struct.pack(f"<{len(values)}f", *values)

    def ints(self, key, values):
        self._key(key, T_ARRAY)
        self.buf += struct.pack("<IQ", T_INT32, len(values)) + struct.pack(f"<{len(values)}i", *values)


def pad(n):
    return (ALIGNMENT - n % ALIGNMENT) % ALIGNMENT


def convert(args):
    t0 = time.monotonic()
    cfg, tensors = read_llama2c(args.model)
    tok_path = args.tokenizer or os.path.join(os.path.dirname(os.path.abspath(args.model)), "tokenizer.bin")
    pieces, scores = read_tokenizer(tok_path, cfg["vocab_size"])
    if args.add_space_prefix == "auto":
        sp_model = os.path.join(os.path.dirname(os.path.abspath(tok_path)), "tokenizer.model")
        space_prefix = sentencepiece_adds_dummy_prefix(sp_model) if os.path.exists(sp_model) else True
    else:
        space_prefix = args.add_space_prefix == "true"
    tokens, token_types = gguf_vocab(pieces)
    name = args.name or os.path.basename(os.path.dirname(os.path.abspath(args.model))) or "llama"

    # Types: 2-D matrices in the chosen type, norms in F32.
    plan = []
    for tname, (values, shape) in tensors.items():
        ttype = args.type if len(shape) == 2 else "f32"
        gid, block_bytes, block = GGML_TYPES[ttype]
        if shape[-1] % block:
            raise ConvertError(f"tensor {tname} has rows of {shape[-1]} values, not a multiple of {block} as {ttype} needs "
                               f"(convert with --type f32, f16 or bf16)")
        plan.append((tname, values, shape, ttype, gid, len(values) // block * block_bytes))

    md = Metadata()
    md.string("general.architecture", "llama")
    md.string("general.name", name)
    md.u32("general.file_type", FILE_TYPES[args.type])
    if args.type in ("q8_0", "q4_0"):
        md.u32("general.quantization_version", 2)
    md.u32("llama.vocab_size", cfg["vocab_size"])
    md.u32("llama.context_length", args.context_length or cfg["seq_len"])
    md.u32("llama.embedding_length", cfg["dim"])
    md.u32("llama.block_count", cfg["n_layers"])
    md.u32("llama.feed_forward_length", cfg["hidden_dim"])
    md.u32("llama.rope.dimension_count", cfg["head_dim"])
    md.u32("llama.attention.head_count", cfg["n_heads"])
    md.u32("llama.attention.head_count_kv", cfg["n_kv_heads"])
    md.f32("llama.attention.layer_norm_rms_epsilon", args.rms_eps)
    md.f32("llama.rope.freq_base", args.rope_theta)
    md.string("tokenizer.ggml.model", "llama")
    md.strings("tokenizer.ggml.tokens", tokens)
    md.floats("tokenizer.ggml.scores", scores)
    md.ints("tokenizer.ggml.token_type", token_types)
    md.u32("tokenizer.ggml.unknown_token_id", 0)
    md.u32("tokenizer.ggml.bos_token_id", 1)
    md.u32("tokenizer.ggml.eos_token_id", 2)
    md.bool("tokenizer.ggml.add_bos_token", True)
    md.bool("tokenizer.ggml.add_eos_token", False)
    md.bool("tokenizer.ggml.add_space_prefix", space_prefix)

    infos, offset = bytearray(), 0
    for tname, _, shape, _, gid, nbytes in plan:
        n = tname.encode()
        dims = list(reversed(shape))  # GGUF dims are innermost first
        infos += struct.pack("<Q", len(n)) + n + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, gid, offset)
        offset += nbytes + pad(nbytes)
    header = GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(plan), md.count) + md.buf + infos

    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header + bytes(pad(len(header))))
        for tname, values, _, ttype, _, nbytes in plan:
            data = ENCODERS[ttype](values)
            assert len(data) == nbytes, tname
            f.write(data + bytes(pad(nbytes)))
    os.replace(tmp, args.out)
    n_params = sum(len(v) for _, v, _, _, _, _ in plan)
    print(f"{args.out}: {len(plan)} tensors, {n_params:,} parameters, {args.type} matrices, "
          f"add_space_prefix={'true' if space_prefix else 'false'}, {os.path.getsize(args.out):,} bytes "
          f"in {time.monotonic() - t0:.1f} s")


def main(argv=None):
    p = argparse.ArgumentParser(description="Convert a llama2.c model.bin + tokenizer.bin to GGUF (llama architecture).")
    p.add_argument("model", help="llama2.c checkpoint (legacy version 0: 7 x int32 header, float32 weights)")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--tokenizer", help="llama2.c tokenizer.bin (default: tokenizer.bin beside the model)")
    p.add_argument("--type", choices=sorted(GGML_TYPES), default="f32",
                   help="type of the 2-D matrices, embedding and classifier included (norms stay f32); default f32")
    p.add_argument("--add-space-prefix", choices=["auto", "true", "false"], default="auto",
                   help="SentencePiece dummy prefix (auto: as tokenizer.model beside tokenizer.bin says, else true; "
                        "pycode-15m needs false)")
    p.add_argument("--name", help="general.name (default: the model's directory name)")
    p.add_argument("--context-length", type=int, default=0, help="llama.context_length (default: the header's seq_len)")
    p.add_argument("--rms-eps", type=float, default=1e-5, help="RMSNorm epsilon (llama2.c: 1e-5)")
    p.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base (llama2.c: 10000)")
    args = p.parse_args(argv)
    try:
        convert(args)
    except (ConvertError, OSError) as e:
        print(f"convert_to_gguf: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
