"""The one self-describing wire format shared by every codec, and the checks that guard decoding.

A payload is a 16-byte fixed header, the codec's parameters, then the body. All integers and floats are
little-endian::

    offset  size  field
    0       4     magic b"\\x89SWC" (a high first byte catches text-mode mangling, as PNG's does)
    4       1     format version, currently 1
    5       1     codec id (table below)
    6       2     P, the length in bytes of the codec parameters (uint16)
    8       8     numel, elements of the flattened float32 tensor (uint64)
    16      P     codec parameters: one fixed struct per codec (table below)
    16 + P  ...   body; its exact length follows from numel and the parameters

    id  codec     parameters                                          body
    0   fp32      -                                                   numel float32
    1   fp16      -                                                   numel float16
    2   bf16      -                                                   numel bfloat16
    3   int8      block u32                                           nblocks float32 absmax, numel 8-bit codes
    4   int4      block u32                                           nblocks float32 absmax, numel 4-bit codes
    5   2bit      block u32                                           nblocks float32 absmax, numel 2-bit codes
    6   topk      k u64, value u8, block u32                          k values, Elias-Fano indices
    7   powersgd  rank u16, rows u64, cols u64, value u8, scale f32   rows*rank values (P), cols*rank values (Q)
    8   dct-topk  chunk u32, k u32, value u8, block u32               nchunks*k values, nchunks*k packed indices

``value`` selects how sparse and low-rank codecs store their float values: 0 fp32, 1 fp16, 2 bf16, and blockwise
3 int8, 4 int4, 5 2-bit with ``block`` elements per float32 absmax (see ``values.py``). Bit-packed fields are
LSB-first.

A receiver knows numel from the round's schema, so ``decode`` first checks the header against it and the body's
exact length against what numel and the parameters imply, all in Python integers, before allocating anything:
a header that claims 10^12 elements costs nothing to reject.
"""

from __future__ import annotations

import struct
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from swarmtrain.errors import SwarmtrainError

if sys.byteorder != "little":  # bodies are raw tensor memory; a big-endian host would need byte swaps
    raise ImportError("swarmtrain.compression supports little-endian hosts only")

MAGIC = b"\x89SWC"
VERSION = 1
_FIXED = struct.Struct("<4sBBHQ")
FIXED_SIZE = _FIXED.size


class CodecError(SwarmtrainError):
    """A payload is malformed, truncated, from another codec or schema, or a codec spec is invalid."""


@dataclass(frozen=True, slots=True)
class Layout:
    """The name and parameter struct of one codec id."""

    name: str
    fields: tuple[str, ...]
    fmt: struct.Struct


LAYOUTS: dict[int, Layout] = {
    0: Layout("fp32", (), struct.Struct("<")),
    1: Layout("fp16", (), struct.Struct("<")),
    2: Layout("bf16", (), struct.Struct("<")),
    3: Layout("int8", ("block",), struct.Struct("<I")),
    4: Layout("int4", ("block",), struct.Struct("<I")),
    5: Layout("2bit", ("block",), struct.Struct("<I")),
    6: Layout("topk", ("k", "value", "block"), struct.Struct("<QBI")),
    7: Layout("powersgd", ("rank", "rows", "cols", "value", "scale"), struct.Struct("<HQQBf")),
    8: Layout("dct-topk", ("chunk", "k", "value", "block"), struct.Struct("<IIBI")),
}
CODEC_IDS: dict[str, int] = {layout.name: codec_id for codec_id, layout in LAYOUTS.items()}

Params = dict[str, int | float]


@dataclass(frozen=True, slots=True)
class Header:
    """Everything a payload says about itself, read without touching the body."""

    codec: str
    """Codec name, e.g. ``"int8"``."""
    codec_id: int
    """Codec id byte."""
    version: int
    """Wire format version."""
    numel: int
    """Elements the sender encoded (untrusted until compared with the schema)."""
    params: Params
    """Codec parameters by name, e.g. ``{"block": 64}``."""
    header_size: int
    """Bytes before the body."""
    body_size: int
    """Bytes after the header."""


def header_size(codec_id: int) -> int:
    """Bytes of header (fixed part plus parameters) for a codec."""
    return FIXED_SIZE + LAYOUTS[codec_id].fmt.size


def pack_header(codec_id: int, numel: int, params: Params) -> bytes:
    """The header bytes for a payload of ``codec_id`` over ``numel`` elements with ``params`` by name."""
    layout = LAYOUTS[codec_id]
    values = [params[field] for field in layout.fields]
    return _FIXED.pack(MAGIC, VERSION, codec_id, layout.fmt.size, numel) + layout.fmt.pack(*values)


def peek_header(payload: bytes | bytearray | memoryview) -> Header:
    """Parse and validate a payload's header (magic, version, codec id, parameters) without decoding the body."""
    view = memoryview(payload).cast("B")
    if len(view) < FIXED_SIZE:
        raise CodecError(f"payload is {len(view)} bytes, shorter than the {FIXED_SIZE}-byte header: truncated")
    magic, version, codec_id, params_size, numel = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"payload does not start with the codec magic {MAGIC!r} (got {bytes(magic)!r})")
    if version != VERSION:
        raise CodecError(f"payload has wire format version {version}; this node reads version {VERSION} only")
    layout = LAYOUTS.get(codec_id)
    if layout is None:
        raise CodecError(f"payload has unknown codec id {codec_id}; known ids are {sorted(LAYOUTS)}")
    if params_size != layout.fmt.size:
        raise CodecError(
            f"{layout.name} payload declares {params_size} bytes of parameters, expected {layout.fmt.size}"
        )
    size = FIXED_SIZE + params_size
    if len(view) < size:
        raise CodecError(f"{layout.name} payload is {len(view)} bytes, shorter than its {size}-byte header")
    values = layout.fmt.unpack_from(view, FIXED_SIZE)
    params: Params = dict(zip(layout.fields, values, strict=True))
    return Header(layout.name, codec_id, version, numel, params, size, len(view) - size)


def check_body(header: Header, expected: int) -> None:
    """Raise unless the body is exactly ``expected`` bytes (the size implied by numel and the parameters)."""
    if header.body_size < expected:
        raise CodecError(f"{header.codec} body is {header.body_size} bytes, expected {expected}: truncated")
    if header.body_size > expected:
        raise CodecError(f"{header.codec} body is {header.body_size} bytes, expected {expected}: trailing bytes")


def read_tensor(body: memoryview, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh tensor of ``count`` elements of ``dtype`` copied from ``body[offset:]`` (bounds already checked)."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    raw = np.frombuffer(body, dtype=np.uint8, count=count * dtype.itemsize, offset=offset).copy()
    return torch.from_numpy(raw).view(dtype)


_READ_ONLY = "The given buffer is not writable"  # torch's warning for a tensor over a read-only buffer


def view_tensor(body: memoryview, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` at ``body[offset:]`` without a copy (bounds already checked), to be read
    from only: the payload's own bytes. torch warns, once per process, that such a tensor could write to a buffer
    that is not writable; nothing here writes to it, so ``_READ_ONLY`` silences that warning."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_READ_ONLY, category=UserWarning)
        return torch.frombuffer(body, dtype=dtype, count=count, offset=offset)


def as_buffer(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, without a copy when it is already contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:  # numpy has no bfloat16; the bits are what we send
        flat = flat.view(torch.int16)
    return memoryview(flat.numpy()).cast("B")
