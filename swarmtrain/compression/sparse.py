"""Sparse codecs: global top-k, and DeMo-style top-k of DCT coefficients per chunk.

Both keep only the largest entries and rely on error feedback to deliver the rest in later rounds. Their payloads
cannot be summed elementwise (two peers keep different indices), so they are ``sparse``: aggregate them by
decoding, not in a reduce-scatter ring.

``topk`` keeps the k largest magnitudes of the whole tensor. Indices are Elias-Fano coded (``bits.py``), about
``2 + log2(numel / k)`` bits each. Bytes/param ``= (k / numel) * (value bytes + index bits / 8)``: at 1% with
fp16 values about 0.031 (130x smaller than fp32), with int8 values about 0.021, with 2-bit values about 0.014.

``dct-topk`` cuts the tensor into chunks, takes an orthonormal DCT-II of each chunk (one matmul with a cached
``chunk x chunk`` basis) and keeps the k largest coefficients per chunk, as DeMo does. Neighbouring parameters are
correlated in real pseudo-gradients, so a few low-frequency coefficients carry much of each chunk's energy;
every chunk is always represented, unlike global top-k. Indices cost ``ceil(log2 chunk)`` bits each.
Bytes/param ``= (k / chunk) * (value bytes + ceil(log2 chunk) / 8)``: about 0.043 at the default chunk 64, k 1,
fp16 values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarmtrain.compression.base import BaseCodec, CodecState, Options
from swarmtrain.compression.bits import (
    elias_fano_decode,
    elias_fano_encode,
    elias_fano_params,
    pack_bits,
    packed_size,
    unpack_bits,
)
from swarmtrain.compression.quant import MAX_BLOCK
from swarmtrain.compression.values import (
    VALUE_KINDS,
    check_block,
    value_code,
    value_kind,
    values_body,
    values_read,
    values_size,
)
from swarmtrain.compression.wire import CodecError, Params, as_buffer, read_tensor

MAX_CHUNK = 1024
"""Largest DCT chunk: its basis is chunk**2 float32 (4 MiB at 1024), built on the receiver from a header field."""


@dataclass(frozen=True)
class TopKCodec(BaseCodec):
    """The k largest magnitudes with Elias-Fano indices. Options: frac (default 0.01) or k, value, block."""

    name = "topk"
    codec_id = 6
    sparse = True
    frac: float | None = 0.01
    """Fraction of elements kept (at least one); ignored when ``k`` is set."""
    k: int | None = None
    """Elements kept, capped at numel."""
    value: str = "fp16"
    """How kept values are stored: fp32, fp16, bf16, int8, int4 or 2bit."""
    block: int = 64
    """Values per float32 scale when ``value`` is int8, int4 or 2bit."""

    @property
    def spec(self) -> str:
        amount = f"k={self.k}" if self.k is not None else f"frac={self.frac}"
        return f"topk:{amount},value={self.value},block={self.block}"

    def _params(self, numel: int) -> Params:
        k = self.k if self.k is not None else math.ceil((self.frac or 0.0) * numel)
        return {"k": min(numel, max(1, k)), "value": value_code(self.value), "block": self.block}

    def _body_size(self, params: Params, numel: int) -> int:
        k, block = int(params["k"]), int(params["block"])
        kind = value_kind(int(params["value"]), self.name)
        check_block(block, self.name)
        if k > numel:
            raise CodecError(f"topk payload keeps {k} elements of {numel}")
        _, low_size, high_size = elias_fano_params(numel, k)
        return values_size(k, kind, block) + low_size + high_size

    def _encode(self, x: torch.Tensor, state: CodecState | None) -> tuple[Params, list[memoryview | bytes]]:
        params = self._params(x.numel())
        kept = torch.topk(x.abs(), int(params["k"]), sorted=False).indices.sort().values
        low, high = elias_fano_encode(kept, x.numel())
        return params, [*values_body(x[kept], self.value, self.block), as_buffer(low), as_buffer(high)]

    def _decode(self, params: Params, body: memoryview, numel: int) -> torch.Tensor:
        k, block = int(params["k"]), int(params["block"])
        kind = value_kind(int(params["value"]), self.name)
        _, low_size, high_size = elias_fano_params(numel, k)
        offset = values_size(k, kind, block)
        low = read_tensor(body, offset, low_size, torch.uint8)
        high = read_tensor(body, offset + low_size, high_size, torch.uint8)
        out = torch.zeros(numel, dtype=torch.float32)
        out[elias_fano_decode(low, high, numel, k)] = values_read(body, 0, k, kind, block)
        return out

    @classmethod
    def from_options(cls, options: Options) -> TopKCodec:
        frac = options.fraction("frac")
        k = options.integer("k", 0, 1, 1 << 62) or None
        if frac is not None and k is not None:
            raise CodecError("topk takes frac or k, not both")
        value = options.choice("value", "fp16", VALUE_KINDS)
        block = options.integer("block", 64, 1, MAX_BLOCK)
        options.done()
        return cls(frac=None if k else (frac or 0.01), k=k, value=value, block=block)


@functools.lru_cache(maxsize=8)
def dct_basis(size: int) -> torch.Tensor:
    """Orthonormal DCT-II basis, one frequency per row: ``coef = x @ basis.T`` and ``x = coef @ basis``."""
    n = torch.arange(size, dtype=torch.float64)
    basis = torch.cos(math.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * size)) * math.sqrt(2 / size)
    basis[0] /= math.sqrt(2)
    return basis.to(torch.float32)


@dataclass(frozen=True)
class DctTopKCodec(BaseCodec):
    """Top-k DCT-II coefficients of each chunk (DeMo). Options: chunk (default 64), k per chunk (1), value, block."""

    name = "dct-topk"
    codec_id = 8
    sparse = True
    chunk: int = 64
    """Elements per DCT chunk (the last chunk is zero-padded)."""
    k: int = 1
    """Coefficients kept per chunk."""
    value: str = "fp16"
    """How kept coefficients are stored: fp32, fp16, bf16, int8, int4 or 2bit."""
    block: int = 64
    """Values per float32 scale when ``value`` is int8, int4 or 2bit."""

    @property
    def spec(self) -> str:
        return f"dct-topk:chunk={self.chunk},k={self.k},value={self.value},block={self.block}"

    def _params(self, numel: int) -> Params:
        return {"chunk": self.chunk, "k": self.k, "value": value_code(self.value), "block": self.block}

    @staticmethod
    def _layout(params: Params, numel: int) -> tuple[int, int, int, int]:
        """(chunk, k, chunks, index bits) of checked parameters."""
        chunk, k = int(params["chunk"]), int(params["k"])
        return chunk, k, -(-numel // chunk), (chunk - 1).bit_length()

    def _body_size(self, params: Params, numel: int) -> int:
        chunk, k, block = int(params["chunk"]), int(params["k"]), int(params["block"])
        kind = value_kind(int(params["value"]), self.name)
        check_block(block, self.name)
        if not 1 <= chunk <= MAX_CHUNK or not 1 <= k <= chunk:
            raise CodecError(f"dct-topk payload has chunk {chunk}, k {k}; need 1 <= k <= chunk <= {MAX_CHUNK}")
        _, _, chunks, width = self._layout(params, numel)
        return values_size(chunks * k, kind, block) + packed_size(chunks * k, width)

    def _encode(self, x: torch.Tensor, state: CodecState | None) -> tuple[Params, list[memoryview | bytes]]:
        params = self._params(x.numel())
        chunk, k, chunks, width = self._layout(params, x.numel())
        coef = F.pad(x, (0, chunks * chunk - x.numel())).view(chunks, chunk) @ dct_basis(chunk).T
        kept = coef.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        values = coef.gather(1, kept).reshape(-1)
        return params, [*values_body(values, self.value, self.block), as_buffer(pack_bits(kept.reshape(-1), width))]

    def _decode(self, params: Params, body: memoryview, numel: int) -> torch.Tensor:
        chunk, k, chunks, width = self._layout(params, numel)
        kind, block = value_kind(int(params["value"]), self.name), int(params["block"])
        offset = values_size(chunks * k, kind, block)
        packed = read_tensor(body, offset, packed_size(chunks * k, width), torch.uint8)
        kept = unpack_bits(packed, chunks * k, width).view(chunks, k)
        if chunks and (int(kept.max()) >= chunk or not bool((kept[:, 1:] > kept[:, :-1]).all())):
            raise CodecError(f"dct-topk indices are not strictly increasing below the chunk size {chunk}")
        values = values_read(body, 0, chunks * k, kind, block).view(chunks, k)
        coef = torch.zeros(chunks, chunk, dtype=torch.float32).scatter_(1, kept, values)
        return (coef @ dct_basis(chunk)).view(-1)[:numel]

    @classmethod
    def from_options(cls, options: Options) -> DctTopKCodec:
        chunk = options.integer("chunk", 64, 1, MAX_CHUNK)
        k = options.integer("k", 1, 1, chunk)
        value = options.choice("value", "fp16", VALUE_KINDS)
        block = options.integer("block", 64, 1, MAX_BLOCK)
        options.done()
        return cls(chunk=chunk, k=k, value=value, block=block)
