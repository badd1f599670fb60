"""PowerSGD: a rank-r approximation ``P @ Q.T`` of the tensor viewed as a matrix (Vogels et al., 2019).

The flattened tensor is viewed as ``rows x cols``: the shape given in the spec, or else the closest-to-square
matrix that holds it (``rows = ceil(sqrt(numel))``, zero-padded by less than one row). One power iteration per
round, warm-started from last round's Q kept in ``CodecState``, tracks the dominant subspace across rounds at
the cost of two thin matmuls; error feedback carries what the rank-r subspace misses into the next round.

To keep fp32's whole range usable (1e30 inputs would overflow ``M @ Q``), the matrix is divided by its largest
magnitude first and that scale travels in the header. Bytes/param ``= rank * (rows + cols) * value bytes / numel``,
about ``8 * rank / sqrt(numel)`` with fp32 factors: 0.01 for rank 4 at 10M elements (400x smaller than fp32).
Payloads are ``sparse``: two peers' factors cannot be summed elementwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarmtrain.compression.base import BaseCodec, CodecState, Options
from swarmtrain.compression.quant import rounding_generator
from swarmtrain.compression.values import value_code, value_kind, values_body, values_read, values_size
from swarmtrain.compression.wire import CodecError, Params

MAX_RANK = 1024
_FACTOR_KINDS = ("fp32", "fp16", "bf16")


def square_shape(numel: int) -> tuple[int, int]:
    """The closest-to-square ``rows x cols`` holding ``numel`` elements with less than one row of padding."""
    rows = math.isqrt(numel)
    rows += rows * rows < numel
    return rows, -(-numel // rows) if rows else 0


def orthonormal(columns: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the column space (reduced QR), the Gram-Schmidt step of PowerSGD."""
    return torch.linalg.qr(columns, mode="reduced").Q


@dataclass(frozen=True)
class PowerSGDCodec(BaseCodec):
    """Rank-r factors P (rows x r) and Q (cols x r). Options: rank (default 4), shape ("RxC"), value, seed."""

    name = "powersgd"
    codec_id = 7
    sparse = True
    data_params = ("scale",)
    rank: int = 4
    """Rank of the approximation (capped at min(rows, cols))."""
    shape: tuple[int, int] | None = None
    """Matrix view of the flattened tensor; None means closest to square."""
    value: str = "fp32"
    """How the factors are stored: fp32, fp16 or bf16."""
    seed: int = 0
    """Seed of the first round's random Q, mixed with the state's step."""

    @property
    def spec(self) -> str:
        shape = f",shape={self.shape[0]}x{self.shape[1]}" if self.shape else ""
        return f"powersgd:rank={self.rank}{shape},value={self.value},seed={self.seed}"

    def _params(self, numel: int) -> Params:
        rows, cols = self.shape or square_shape(numel)
        if rows * cols != numel and self.shape:
            raise CodecError(f"powersgd shape {rows}x{cols} holds {rows * cols} elements, the tensor has {numel}")
        rank = min(self.rank, rows, cols)
        return {"rank": rank, "rows": rows, "cols": cols, "value": value_code(self.value), "scale": 1.0}

    def _body_size(self, params: Params, numel: int) -> int:
        rank, rows, cols = int(params["rank"]), int(params["rows"]), int(params["cols"])
        kind = value_kind(int(params["value"]), self.name)
        if kind not in _FACTOR_KINDS:
            raise CodecError(f"powersgd payload stores factors as {kind}; only {', '.join(_FACTOR_KINDS)} exist")
        if not math.isfinite(params["scale"]) or params["scale"] < 0:
            raise CodecError(f"powersgd payload has scale {params['scale']}; it must be finite and >= 0")
        fits = rows * cols >= numel and rows * cols - numel < max(rows, cols, 1) and max(rows, cols) <= numel
        if not fits or (numel and not 1 <= rank <= min(rows, cols)):
            raise CodecError(f"powersgd payload has shape {rows}x{cols}, rank {rank}: not a view of {numel} elements")
        return values_size(rank * (rows + cols), kind, 0)

    def _encode(self, x: torch.Tensor, state: CodecState | None) -> tuple[Params, list[memoryview | bytes]]:
        params = self._params(x.numel())
        rank, rows, cols = int(params["rank"]), int(params["rows"]), int(params["cols"])
        if not x.numel():
            return params, []
        absmax = float(x.abs().max())
        scale = absmax if absmax > 0 else 1.0
        matrix = F.pad(x / scale, (0, rows * cols - x.numel())).view(rows, cols)
        warm = state.warm_q if state is not None else None
        if warm is None or warm.shape != (cols, rank) or not bool(warm.abs().sum() > 0):
            warm = torch.randn(cols, rank, generator=rounding_generator(self.seed, state))
        p = orthonormal(matrix @ orthonormal(warm))
        q = matrix.T @ p
        if state is not None:
            state.warm_q = q
        params["scale"] = scale
        return params, [*values_body(p.reshape(-1), self.value, 0), *values_body(q.reshape(-1), self.value, 0)]

    def _decode(self, params: Params, body: memoryview, numel: int) -> torch.Tensor:
        rank, rows, cols = int(params["rank"]), int(params["rows"]), int(params["cols"])
        kind = value_kind(int(params["value"]), self.name)
        p = values_read(body, 0, rows * rank, kind, 0).view(rows, rank)
        q = values_read(body, values_size(rows * rank, kind, 0), cols * rank, kind, 0).view(cols, rank)
        return (p @ q.T).mul_(float(params["scale"])).view(-1)[:numel]

    @classmethod
    def from_options(cls, options: Options) -> PowerSGDCodec:
        rank = options.integer("rank", 4, 1, MAX_RANK)
        text = options.text("shape")
        value = options.choice("value", "fp32", _FACTOR_KINDS)
        seed = options.integer("seed", 0, 0, (1 << 63) - 1)
        options.done()
        shape = None
        if text is not None:
            rows, sep, cols = text.lower().partition("x")
            if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
                raise CodecError(f"powersgd option shape={text!r} must be ROWSxCOLS, e.g. shape=1024x4096")
            shape = (int(rows), int(cols))
        return cls(rank=rank, shape=shape, value=value, seed=seed)
