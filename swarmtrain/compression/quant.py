"""Blockwise absmax quantisation: int8, int4 and 2-bit codes with one float32 scale per block.

Each block of ``block`` consecutive elements is scaled by its largest magnitude ``a`` and mapped onto ``L`` evenly
spaced levels from ``-a`` to ``a``: 255 levels for int8, 15 for int4 (both include 0 exactly) and 4 for 2-bit
(``+-a/3, +-a``). Rounding is to nearest (error <= ``a / (L - 1)``) or stochastic (unbiased, error
< ``2a / (L - 1)``), the latter seeded from the codec's seed and the state's step so runs repeat exactly.

The float32 scale keeps fp32's whole range (1e-30 and 1e30 round-trip with the same relative error), and
costs ``4 / block`` bytes per parameter. Bytes per parameter, plus a 20-byte header:
int8 ``1 + 4/block`` (1.0625 at block 64), int4 ``0.5 + 4/block`` (0.5625), 2-bit ``0.25 + 4/block`` (0.3125).
Body: ``ceil(numel / block)`` float32 scales, then the codes bit-packed LSB-first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarmtrain.compression.base import BaseCodec, CodecState, Options
from swarmtrain.compression.bits import pack_bits, packed_size, unpack_bits
from swarmtrain.compression.wire import CodecError, Params, as_buffer, read_tensor

_LEVELS = {8: 255, 4: 15, 2: 4}
MAX_BLOCK = 1 << 20


def _blocks(count: int, block: int) -> tuple[int, int]:
    """Effective block size and block count: a block longer than the tensor is the tensor (bounds padding)."""
    size = max(1, min(block, count))
    return size, -(-count // size)


def quant_size(count: int, bits: int, block: int) -> int:
    """Body bytes for ``count`` values at ``bits`` per code with one float32 scale per ``block``."""
    return 4 * _blocks(count, block)[1] + packed_size(count, bits)


def quantize(x: torch.Tensor, bits: int, block: int, generator: torch.Generator | None) -> list[memoryview]:
    """Body pieces (scales, packed codes) for 1-D float32 ``x``; stochastic rounding when ``generator`` is set."""
    count = x.numel()
    size, nblocks = _blocks(count, block)
    half = (_LEVELS[bits] - 1) / 2
    blocks = F.pad(x, (0, nblocks * size - count)).view(nblocks, size)
    absmax = blocks.abs().amax(dim=1) if count else x.new_zeros(0)
    scale = torch.where(absmax > 0, absmax, 1.0)
    levels = (blocks / scale[:, None]).mul_(half).add_(half)
    if generator is None:
        levels.round_()
    else:
        levels.add_(torch.rand(levels.shape, generator=generator)).floor_()
    codes = levels.clamp_(0, 2 * half).to(torch.uint8).view(-1)[:count]
    return [as_buffer(absmax), as_buffer(pack_bits(codes, bits))]


def dequantize(body: memoryview, offset: int, count: int, bits: int, block: int) -> torch.Tensor:
    """The float32 values of a body written by ``quantize`` at ``body[offset:]`` (length already checked)."""
    size, nblocks = _blocks(count, block)
    half = (_LEVELS[bits] - 1) / 2
    absmax = read_tensor(body, offset, nblocks, torch.float32)
    if not bool((absmax >= 0).all()) or not bool(torch.isfinite(absmax).all()):
        raise CodecError("quantised payload has a negative or non-finite block scale")
    packed = read_tensor(body, offset + 4 * nblocks, packed_size(count, bits), torch.uint8)
    codes = unpack_bits(packed, count, bits) if bits != 8 else packed.to(torch.int64)
    if count and int(codes.max()) > 2 * half:
        raise CodecError(f"quantised payload has a code above {int(2 * half)}, the largest of {_LEVELS[bits]} levels")
    values = F.pad(codes.to(torch.float32), (0, nblocks * size - count)).view(nblocks, size)
    values.sub_(half).mul_((absmax / half)[:, None])
    return values.view(-1)[:count]


def rounding_generator(seed: int, state: CodecState | None) -> torch.Generator:
    """A generator seeded by (seed, step): reproducible runs, fresh noise every round."""
    step = state.step if state is not None else 0
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (1 << 63))


@dataclass(frozen=True)
class _BlockCodec(BaseCodec):
    """Shared body of the int8, int4 and 2-bit codecs; ``bits`` selects the code width."""

    bits = 8
    block: int = 64
    """Elements per float32 scale."""
    rounding: str = "nearest"
    """"nearest" or "stochastic" (unbiased)."""
    seed: int = 0
    """Seed of stochastic rounding, mixed with the state's step."""

    @property
    def spec(self) -> str:
        seed = f",seed={self.seed}" if self.rounding == "stochastic" else ""
        return f"{self.name}:block={self.block},rounding={self.rounding}{seed}"

    def _params(self, numel: int) -> Params:
        return {"block": self.block}

    def _body_size(self, params: Params, numel: int) -> int:
        block = int(params["block"])
        if block < 1:
            raise CodecError(f"{self.name} payload has block size {block}; it must be at least 1")
        return quant_size(numel, self.bits, block)

    def _encode(self, x: torch.Tensor, state: CodecState | None) -> tuple[Params, list[memoryview | bytes]]:
        generator = rounding_generator(self.seed, state) if self.rounding == "stochastic" else None
        return self._params(x.numel()), list(quantize(x, self.bits, self.block, generator))

    def _decode(self, params: Params, body: memoryview, numel: int) -> torch.Tensor:
        return dequantize(body, 0, numel, self.bits, int(params["block"]))

    @classmethod
    def from_options(cls, options: Options) -> _BlockCodec:
        block = options.integer("block", 64, 1, MAX_BLOCK)
        rounding = options.choice("rounding", "nearest", ("nearest", "stochastic"))
        seed = options.integer("seed", 0, 0, (1 << 63) - 1)
        options.done()
        return cls(block=block, rounding=rounding, seed=seed)


@dataclass(frozen=True)
class Int8Codec(_BlockCodec):
    """255 levels per block: 1 + 4/block bytes/param (1.0625 at block 64). Options: block, rounding, seed."""

    name = "int8"
    codec_id = 3
    bits = 8


@dataclass(frozen=True)
class Int4Codec(_BlockCodec):
    """15 levels per block: 0.5 + 4/block bytes/param (0.5625 at block 64). Options: block, rounding, seed."""

    name = "int4"
    codec_id = 4
    bits = 4


@dataclass(frozen=True)
class TwoBitCodec(_BlockCodec):
    """4 levels per block: 0.25 + 4/block bytes/param (0.3125 at block 64). Options: block, rounding, seed."""

    name = "2bit"
    codec_id = 5
    bits = 2
