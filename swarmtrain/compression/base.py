"""The codec interface, sender-side error-feedback state, and the checks every codec shares.

A codec is a pure function pair over 1-D float32 tensors: ``encode`` turns a flattened slice of a
pseudo-gradient into one self-describing payload (``wire.py``), ``decode`` turns a payload back into a tensor of
the length the round's schema says it must have. ``BaseCodec`` owns everything that is not codec-specific, so each
codec only writes its parameters, its body, and how long that body must be:

- input checks (1-D, finite) and error feedback: with a ``CodecState`` the encoder compresses
  ``tensor + residual`` and keeps ``tensor + residual - decoded`` for the next round, where ``decoded`` is
  exactly what a receiver will decode (the payload is decoded, not re-derived), so nothing is lost over rounds;
- decode guards: header against the schema's numel and the codec, body length against what numel and the
  parameters imply (before any allocation), and a finite result.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from swarmtrain.compression.wire import CodecError, Params, check_body, header_size, pack_header, peek_header


def all_finite(t: torch.Tensor) -> bool:
    """True if no element is NaN or inf: one allocation-free min/max pass (NaN propagates through both),
    about 20x cheaper than ``torch.isfinite(t).all()`` on the hot path of every payload."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t)
    return math.isfinite(low.item()) and math.isfinite(high.item())


@dataclass(slots=True)
class CodecState:
    """What a sender remembers about one tensor slice between rounds; never sent, never shared between slices."""

    residual: torch.Tensor | None = None
    """Error-feedback residual: what earlier payloads failed to carry, added to the next input."""
    warm_q: torch.Tensor | None = None
    """PowerSGD's right factor from the last round, the warm start for the next power iteration."""
    step: int = 0
    """Encodes so far; mixed into stochastic-rounding and PowerSGD seeds so rounds draw fresh noise."""


class Codec(Protocol):
    """What the round protocol needs from a codec."""

    name: str
    """Codec name as in specs: "fp32", "fp16", "bf16", "int8", "int4", "2bit", "topk", "powersgd", "dct-topk"."""
    sparse: bool
    """True if payloads cannot be summed elementwise in a reduce-scatter (top-k, dct-topk, low-rank)."""

    def encode(self, tensor: torch.Tensor, state: CodecState | None = None) -> bytes:
        """One payload for a 1-D float tensor; with ``state``, error feedback is applied and updated."""
        ...

    def encode_feedback(self, tensor: torch.Tensor, residual: torch.Tensor, decoded: torch.Tensor) -> bytes:
        """One payload for ``tensor + residual``, with error feedback into the caller's buffers."""
        ...

    def decode(
        self, payload: bytes, numel: int, *, out: torch.Tensor | None = None, bound: float = math.inf
    ) -> torch.Tensor:
        """The float32 1-D tensor of length ``numel`` in ``payload``; ``CodecError`` if malformed."""
        ...

    def payload_size(self, numel: int) -> int:
        """Exact payload length in bytes for ``numel`` elements (sizes receive buffers, reports bytes/param)."""
        ...


class BaseCodec(ABC):
    """Shared encode/decode scaffolding; subclasses are frozen dataclasses holding their options."""

    name: str = ""
    codec_id: int = -1
    sparse: bool = False
    lossless: bool = False  # decode(encode(x)) == x bit for bit: error feedback has nothing to keep
    data_params: tuple[str, ...] = ()  # wire parameters that depend on the data, not on the agreed options

    @property
    @abstractmethod
    def spec(self) -> str:
        """The canonical spec string that ``get_codec`` turns back into an equal codec."""

    @abstractmethod
    def _params(self, numel: int) -> Params:
        """Wire parameters for a tensor of ``numel`` elements (data-dependent ones as placeholders)."""

    @abstractmethod
    def _body_size(self, params: Params, numel: int) -> int:
        """Validate (possibly hostile) parameters against numel; return the body length they imply."""

    @abstractmethod
    def _encode(self, x: torch.Tensor, state: CodecState | None) -> tuple[Params, list[memoryview | bytes]]:
        """Wire parameters and body pieces for a finite 1-D float32 tensor."""

    @abstractmethod
    def _decode(self, params: Params, body: memoryview, numel: int) -> torch.Tensor:
        """The tensor in a body whose parameters and length ``_body_size`` has already accepted."""

    def _decode_into(self, params: Params, body: memoryview, out: torch.Tensor) -> None:
        """``_decode`` written into ``out``; codecs that can skip the temporary override it."""
        out.copy_(self._decode(params, body, out.numel()))

    def payload_size(self, numel: int) -> int:
        """Exact payload length in bytes for a tensor of ``numel`` elements; divide by numel for bytes/param."""
        return header_size(self.codec_id) + self._body_size(self._params(numel), numel)

    def encode(self, tensor: torch.Tensor, state: CodecState | None = None) -> bytes:
        """One payload for a 1-D float tensor; with ``state``, error feedback is applied and updated."""
        if tensor.dim() != 1 or not tensor.is_floating_point():
            raise ValueError(f"{self.name} encodes 1-D float tensors, got {tuple(tensor.shape)} {tensor.dtype}")
        x = tensor.detach().to(device="cpu", dtype=torch.float32)
        if state is not None and state.residual is not None:
            if state.residual.shape != x.shape:
                raise ValueError(
                    f"{self.name} residual has {state.residual.numel()} elements but the tensor has {x.numel()}: "
                    "use one CodecState per tensor slice"
                )
            x = x + state.residual
        if not all_finite(x):
            raise CodecError(f"{self.name} cannot encode non-finite values (NaN or inf): the local update diverged")
        params, body = self._encode(x, state)
        payload = b"".join([pack_header(self.codec_id, x.numel(), params), *body])
        if state is not None:
            state.residual = x - self.decode(payload, x.numel())
            state.step += 1
        return payload

    def encode_feedback(self, tensor: torch.Tensor, residual: torch.Tensor, decoded: torch.Tensor) -> bytes:
        """One payload for ``tensor + residual`` (error feedback, as ``encode`` with a ``CodecState`` whose step is 0)
        that works in the caller's buffers: ``decoded`` becomes what a receiver decodes from the payload and
        ``residual`` what it did not carry, ``tensor + residual - decoded``. Fewer passes and no temporaries of the
        tensor's size: for a lossless codec, one sum, one check, one copy into the payload."""
        if not tensor.shape == residual.shape == decoded.shape:
            raise ValueError(f"{self.name}: tensor, residual and decoded buffer must have the same shape")
        torch.add(tensor.detach(), residual, out=decoded)
        payload = self.encode(decoded)  # the payload holds a copy: ``decoded`` may change now
        if self.lossless:
            residual.zero_()
        else:
            values = self.decode(payload, decoded.numel())
            torch.sub(decoded, values, out=residual)
            decoded.copy_(values)
        return payload

    def decode(
        self,
        payload: bytes | bytearray | memoryview,
        numel: int,
        *,
        agreed: bool = True,
        out: torch.Tensor | None = None,
        bound: float = math.inf,
    ) -> torch.Tensor:
        """The float32 1-D tensor of length ``numel`` in ``payload`` (written into ``out`` if given, and returned);
        ``CodecError`` if it is malformed, decodes to non-finite values or to a magnitude beyond ``bound``, or, with
        ``agreed``, was encoded with other parameters than this codec's (the round's): a ``topk:frac=1.0``
        payload where ``frac=0.01`` was agreed is refused before decoding allocates for it. On an error, what
        ``out`` holds is undefined."""
        header = peek_header(payload)
        if header.codec_id != self.codec_id:
            raise CodecError(f"payload was encoded with {header.codec}, but this round expects {self.name}")
        if header.numel != numel:
            raise CodecError(f"{self.name} payload claims {header.numel} elements; the round's schema has {numel}")
        check_body(header, self._body_size(header.params, numel))
        if agreed:  # the parameters are sane (checked above, in integers); now they must be the round's
            for field, value in self._params(numel).items():
                if field not in self.data_params and header.params[field] != value:
                    raise CodecError(
                        f"{self.name} payload has {field}={header.params[field]}, but the round agreed on "
                        f"{self.spec} ({field}={value} for {numel} elements)"
                    )
        body = memoryview(payload).cast("B")[header.header_size :]
        if out is None:
            out = self._decode(header.params, body, numel)
        elif out.shape != (numel,) or out.dtype != torch.float32:
            raise ValueError(f"{self.name} decodes into a float32 tensor of {numel} elements, got {tuple(out.shape)}")
        else:
            self._decode_into(header.params, body, out)
        low, high = torch.aminmax(out) if numel else (torch.tensor(0.0), torch.tensor(0.0))
        low_, high_ = low.item(), high.item()
        if not (math.isfinite(low_) and math.isfinite(high_)):  # one pass: NaN and inf show in the min or max
            raise CodecError(f"{self.name} payload decodes to non-finite values (NaN or inf)")
        if max(-low_, high_) > bound:
            raise CodecError(f"{self.name} payload decodes to values beyond +-{bound:g}")
        return out


class Options:
    """Typed access to a spec's ``key=value`` options; ``done`` rejects keys no getter asked for."""

    def __init__(self, codec: str, raw: dict[str, str]) -> None:
        self.codec = codec
        self.raw = raw
        self.known: list[str] = []

    def _get(self, key: str) -> str | None:
        self.known.append(key)
        return self.raw.get(key)

    def integer(self, key: str, default: int, low: int, high: int) -> int:
        """An integer option in [low, high]."""
        text = self._get(key)
        if text is None:
            return default
        try:
            value = int(text)
        except ValueError:
            raise CodecError(f"{self.codec} option {key}={text!r} is not an integer") from None
        if not low <= value <= high:
            raise CodecError(f"{self.codec} option {key}={value} must be in [{low}, {high}]")
        return value

    def fraction(self, key: str) -> float | None:
        """A number in (0, 1], or None if absent."""
        text = self._get(key)
        if text is None:
            return None
        try:
            value = float(text)
        except ValueError:
            raise CodecError(f"{self.codec} option {key}={text!r} is not a number") from None
        if not 0.0 < value <= 1.0:
            raise CodecError(f"{self.codec} option {key}={value} must be in (0, 1]")
        return value

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        """One of ``choices``."""
        value = self._get(key) or default
        if value not in choices:
            raise CodecError(f"{self.codec} option {key}={value!r} must be one of {', '.join(choices)}")
        return value

    def text(self, key: str) -> str | None:
        """A raw string option, or None if absent."""
        return self._get(key)

    def done(self) -> None:
        """Raise on options the codec does not have, naming the ones it does."""
        unknown = sorted(set(self.raw) - set(self.known))
        if unknown:
            valid = ", ".join(self.known) or "none"
            raise CodecError(f"{self.codec} has no option {', '.join(unknown)}; its options are: {valid}")
