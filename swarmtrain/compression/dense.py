"""Dense float codecs: fp32 (lossless), fp16 and bf16 (one rounding per element).

Bytes per parameter: fp32 4, fp16 2, bf16 2, plus a 16-byte header per payload. fp16 keeps 11 significant bits
but only covers magnitudes up to 65504 (larger values saturate there; error feedback carries the rest) and
flushes values below about 6e-8 to zero; bf16 keeps 8 significant bits over fp32's whole range. Both round to
nearest even. These payloads can be summed elementwise, so they suit reduce-scatter and downlink broadcasts.

The helpers here also store the float values of the sparse and low-rank codecs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarmtrain.compression.base import BaseCodec, CodecState, Options, all_finite
from swarmtrain.compression.wire import Params, as_buffer, header_size, pack_header, read_tensor, view_tensor

FLOAT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast to ``dtype`` with out-of-range magnitudes clamped to its largest finite value, not inf."""
    if dtype == torch.float32:
        return x
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def float_size(count: int, dtype: torch.dtype) -> int:
    """Bytes that ``count`` values of ``dtype`` occupy on the wire."""
    return count * dtype.itemsize


def float_body(x: torch.Tensor, dtype: torch.dtype) -> memoryview:
    """The wire bytes of ``x`` stored as ``dtype``."""
    return as_buffer(saturate(x, dtype))


def float_read(body: memoryview, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` values of ``dtype`` at ``body[offset:]`` as float32."""
    return read_tensor(body, offset, count, dtype).to(torch.float32)


class _FloatCodec(BaseCodec):
    """Every element stored in ``dtype``; no parameters."""

    dtype: torch.dtype = torch.float32

    @property
    def spec(self) -> str:
        return self.name

    def _params(self, numel: int) -> Params:
        return {}

    def _body_size(self, params: Params, numel: int) -> int:
        return float_size(numel, self.dtype)

    def _encode(self, x: torch.Tensor, state: CodecState | None) -> tuple[Params, list[memoryview | bytes]]:
        return {}, [float_body(x, self.dtype)]

    def _decode(self, params: Params, body: memoryview, numel: int) -> torch.Tensor:
        return float_read(body, 0, numel, self.dtype)

    def _decode_into(self, params: Params, body: memoryview, out: torch.Tensor) -> None:
        out.copy_(view_tensor(body, 0, out.numel(), self.dtype))  # converts as it copies: one pass

    def encode(self, tensor: torch.Tensor, state: CodecState | None = None) -> bytes:
        direct = self._payload(tensor.detach()) if state is None and self._direct(tensor) else None
        return direct[0] if direct is not None else super().encode(tensor, state)

    def encode_feedback(self, tensor: torch.Tensor, residual: torch.Tensor, decoded: torch.Tensor) -> bytes:
        """``BaseCodec.encode_feedback`` in four passes and no temporaries: the sum, its rounding written straight
        into the payload, the residual and what a receiver decodes, both read from the payload's own values."""
        if not (tensor.shape == residual.shape == decoded.shape and self._direct(tensor)):
            return super().encode_feedback(tensor, residual, decoded)
        torch.add(tensor.detach(), residual, out=decoded)
        direct = self._payload(decoded)
        if direct is None:
            return super().encode_feedback(tensor, residual, decoded)
        payload, stored = direct
        torch.sub(decoded, stored, out=residual)  # in float32: ``stored`` widens exactly
        decoded.copy_(stored)
        return payload

    def _direct(self, x: torch.Tensor) -> bool:
        """Whether ``x`` takes the fast path: a lossy dtype, and a non-empty 1-D float32 tensor in memory."""
        lossy = self.dtype != torch.float32
        return lossy and x.dim() == 1 and x.numel() > 0 and x.dtype == torch.float32 and x.device.type == "cpu"

    def _payload(self, x: torch.Tensor) -> tuple[bytearray, torch.Tensor] | None:
        """The payload of ``x`` (``encode``'s bytes), and its values as a tensor over the payload's own body; None
        where a stored value is not finite: ``x`` held a NaN or inf, or a value beyond the dtype's range, which
        rounds to inf as it is copied in. The base codec's path then refuses or saturates it (rare: it costs the
        passes this one saves)."""
        size = header_size(self.codec_id)
        payload = bytearray(size + float_size(x.numel(), self.dtype))
        payload[:size] = pack_header(self.codec_id, x.numel(), {})
        stored = torch.frombuffer(payload, dtype=self.dtype, offset=size, count=x.numel())
        stored.copy_(x)
        return (payload, stored) if all_finite(stored) else None

    @classmethod
    def from_options(cls, options: Options) -> _FloatCodec:
        options.done()
        return cls()


@dataclass(frozen=True)
class Fp32Codec(_FloatCodec):
    """Lossless float32: 4 bytes per parameter plus a 16-byte header."""

    name = "fp32"
    codec_id = 0
    dtype = torch.float32
    lossless = True


@dataclass(frozen=True)
class Fp16Codec(_FloatCodec):
    """IEEE half: 2 bytes per parameter plus a 16-byte header; relative error <= 2**-11 for |x| in [6e-5, 65504]."""

    name = "fp16"
    codec_id = 1
    dtype = torch.float16


@dataclass(frozen=True)
class Bf16Codec(_FloatCodec):
    """bfloat16: 2 bytes per parameter plus a 16-byte header; relative error <= 2**-9 over fp32's range."""

    name = "bf16"
    codec_id = 2
    dtype = torch.bfloat16
