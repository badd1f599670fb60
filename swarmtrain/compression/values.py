"""How the sparse and low-rank codecs store their float values: fp32, fp16, bf16 or blockwise int8, int4, 2-bit.

The kept values of top-k and DCT top-k are the largest of their tensor, so they dominate its norm; fp16 halves
their cost at 2**-11 relative error, int8 (one float32 absmax per ``block`` values) nearly halves it again, and
int4 and 2-bit (SparseLoCo's choice) go further, leaning on error feedback for what the coarse levels miss.
The choice travels on the wire as one byte (``VALUE_KINDS``) plus the block size, so a receiver needs no config.
"""

from __future__ import annotations

import torch

from swarmtrain.compression.dense import FLOAT_DTYPES, float_body, float_read, float_size
from swarmtrain.compression.quant import MAX_BLOCK, dequantize, quant_size, quantize
from swarmtrain.compression.wire import CodecError

VALUE_KINDS: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8", "int4", "2bit")
"""Wire code of each value kind is its position here."""
_BITS = {"int8": 8, "int4": 4, "2bit": 2}


def value_code(kind: str) -> int:
    """The wire byte for a value kind."""
    return VALUE_KINDS.index(kind)


def value_kind(code: int, codec: str) -> str:
    """The value kind of a (possibly hostile) wire byte; ``CodecError`` if unknown."""
    if not 0 <= code < len(VALUE_KINDS):
        raise CodecError(f"{codec} payload has unknown value encoding {code}; known: {list(range(len(VALUE_KINDS)))}")
    return VALUE_KINDS[code]


def check_block(block: int, codec: str) -> None:
    """Reject a (possibly hostile) quantisation block size outside [1, MAX_BLOCK]."""
    if not 1 <= block <= MAX_BLOCK:
        raise CodecError(f"{codec} payload has value block size {block}; it must be in [1, {MAX_BLOCK}]")


def values_size(count: int, kind: str, block: int) -> int:
    """Bytes that ``count`` values of ``kind`` occupy."""
    if kind in _BITS:
        return quant_size(count, _BITS[kind], block)
    return float_size(count, FLOAT_DTYPES[kind])


def values_body(x: torch.Tensor, kind: str, block: int) -> list[memoryview]:
    """Body pieces storing 1-D float32 ``x`` as ``kind`` (integer kinds round to nearest)."""
    if kind in _BITS:
        return quantize(x, _BITS[kind], block, None)
    return [float_body(x, FLOAT_DTYPES[kind])]


def values_read(body: memoryview, offset: int, count: int, kind: str, block: int) -> torch.Tensor:
    """``count`` float32 values of ``kind`` stored at ``body[offset:]`` (length already checked)."""
    if kind in _BITS:
        return dequantize(body, offset, count, _BITS[kind], block)
    return float_read(body, offset, count, FLOAT_DTYPES[kind])
