"""Robust aggregation: how a group combines its members' contributions so that a few hostile ones cannot steer it.

``averaging.aggregator`` is a spec like a codec's: a kind and optional parameters,
``centered-clip:tau=1,iters=5,clip=2,cap=1``.

- ``mean``: the token-weighted mean (exact DiLoCo; no clip and no cap unless given). One contribution can move it
  anywhere, so it is only for swarms whose members are trusted (private swarms).
- ``trimmed-mean``: per coordinate, drop the ``trim`` fraction of the smallest and of the largest values (counting
  members, not tokens), and take the token-weighted mean of the rest (values tied with the last kept one stay).
- ``median``: the per-coordinate median over members (the mean of the two middle values for an even count).
- ``centered-clip``: CenteredClip (Karimireddy, He and Jaggi 2021; hivemind and BTARD use it): start from the
  median and take ``iters`` steps ``v += sum_i w_i min(1, r / |x_i - v|) (x_i - v) / sum_i w_i``, with the radius
  ``r = tau`` times the median distance of the contributions from the start. Contributions within ``r`` count as
  in the mean; one far away pulls by at most ``r`` per step. With ``floor`` (a gossip mix of states, not a setting)
  the radius is at least ``floor`` times the median of the step sizes the contributors claim (``reduce``'s
  ``steps``): where most members hold one state, the median distance is 0, and a state one or two outer steps
  away (an honest gossip line) still counts in the mean, while one far away pulls by at most that radius.

Two guards come first, for every kind but a bare ``mean``:

- ``cap``: a member's token weight is capped at ``cap`` times the median weight of the group's contributors. The
  weights are the group's agreed ones (the leader's ``Group``), so every member caps them the same way.
- ``clip``: each contribution is scaled down to at most ``clip`` times the median norm of the contributions being
  combined.

Where the norm is measured. In the butterfly all-reduce each reducer holds one shard of every contribution, so a
contribution's full norm is not known to it. A member could publish its full norm in the exchange header, but a
hostile one would publish a small norm and send a large vector, and checking the claim needs every shard. So the
norm is measured on what is combined: the part (``averaging.part_numel`` coordinates) a reducer averages at once,
and in the all-gather path the segment (a chunk, or one weight matrix with PowerSGD) every member decodes. No claim
is trusted, no extra message is needed, and an attacker cannot concentrate its budget in one place: in every part
it gets at most ``clip`` times that part's median norm. The median of each part is honest as long as fewer than
half the contributors of that part are hostile.

Determinism. Every member that combines the same contributions must get the same bytes. In the butterfly only the
reducer combines and sends its result, so only it has to be self-consistent. In the all-gather path every member
combines, possibly on different CPUs: elementwise operations and sorting are exactly rounded everywhere, but a sum
over many coordinates (a norm) depends on the order a CPU's vector unit uses. Norms are therefore summed in float64
(the square of a float32 is exact there) and rounded to 20 significant bits before any decision uses them, so two
CPUs disagree only if a norm lies within about 1e-16 of a rounding boundary; the round's digest vote catches that
case (the minority resyncs). Sums over members are loops in member order, never a reduction whose order varies.

Cost per shard: ``benchmarks/bench_aggregators.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

KINDS = ("mean", "trimmed-mean", "centered-clip", "median")
ROBUST_DEFAULT = "centered-clip"  # the default of a public swarm (``averaging.aggregator = auto``), measured in README
_SIG_BITS = 20


def stable(x: float) -> float:
    """``x`` rounded to 20 significant bits: summation-order noise (~1e-16) disappears before a decision uses it."""
    if x == 0 or not math.isfinite(x):
        return x
    mantissa, exponent = math.frexp(x)
    return math.ldexp(round(mantissa * (1 << _SIG_BITS)) / (1 << _SIG_BITS), exponent)


def norm(x: torch.Tensor) -> float:
    """The L2 norm, accumulated in float64 and rounded by ``stable``."""
    return stable(float(torch.linalg.vector_norm(x, dtype=torch.float64)))


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    k = len(ordered)
    return (ordered[(k - 1) // 2] + ordered[k // 2]) / 2 if k else 0.0


@dataclass(frozen=True)
class Aggregator:
    """One of ``KINDS`` with its parameters; ``reduce`` combines the contributions of one part."""

    kind: str = "mean"
    trim: float = 0.25
    """trimmed-mean: the fraction of members dropped at each end, per coordinate."""
    tau: float = 1.0
    """centered-clip: the clip radius, as a multiple of the median distance from the starting point."""
    iters: int = 5
    """centered-clip: iterations."""
    clip: float = 0.0
    """The norm clip: at most this multiple of the median norm of the part's contributions (0: off)."""
    cap: float = 0.0
    """The weight cap: at most this multiple of the median token weight of the group's contributors (0: off)."""
    floor: float = 0.0
    """centered-clip: the radius is at least this multiple of the median step the contributors claim (0: off)."""

    @property
    def plain(self) -> bool:
        """The exact token-weighted mean, computed the way the protocol always has (bit for bit)."""
        return self.kind == "mean" and self.clip == 0

    @property
    def spec(self) -> str:
        params = {"clip": self.clip, "cap": self.cap}
        if self.kind == "trimmed-mean":
            params["trim"] = self.trim
        if self.kind == "centered-clip":
            params.update(tau=self.tau, iters=self.iters)
        return f"{self.kind}:" + ",".join(f"{k}={v:g}" for k, v in params.items())

    def cap_weights(self, weights: Sequence[float]) -> list[float]:
        """The group's token weights with each capped at ``cap`` times the contributors' median (observers: 0)."""
        if self.cap <= 0:
            return list(weights)
        limit = self.cap * median([w for w in weights if w > 0])
        return [min(w, limit) for w in weights]

    def reduce(
        self, rows: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor, steps: Sequence[float] = ()
    ) -> None:
        """Write the combination of ``rows`` (equal lengths, in member order) with token ``weights`` into ``out``.

        ``steps``: for ``floor``, each contributor's claim of how far its last outer step moved these coordinates
        (a norm). A claim is not checked; the median of the claims is honest while most contributors are."""
        if not rows:
            raise ValueError("nothing to aggregate")
        total = sum(weights)
        if self.plain:
            out.zero_()
            for row, w in zip(rows, weights, strict=True):
                out.add_(row, alpha=w / total)
            return
        rows = self._clipped(rows)
        if self.kind == "mean":
            _weighted_mean(rows, weights, out)
        elif self.kind == "median":
            out.copy_(_median(torch.stack(rows)))
        elif self.kind == "trimmed-mean":
            self._trimmed(rows, weights, out)
        else:
            self._centered_clip(rows, weights, out, self.floor * median(steps) if self.floor > 0 else 0.0)

    def _clipped(self, rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.clip <= 0:
            return list(rows)
        norms = [norm(r) for r in rows]
        limit = self.clip * median(norms)
        return [r * stable(limit / n) if n > limit else r for r, n in zip(rows, norms, strict=True)]

    def _trimmed(self, rows: list[torch.Tensor], weights: Sequence[float], out: torch.Tensor) -> None:
        k = len(rows)
        drop = min(int(self.trim * k), (k - 1) // 2)  # at least one value per coordinate stays
        if drop == 0:
            _weighted_mean(rows, weights, out)
            return
        ordered = torch.stack(rows)
        _sort_columns(ordered)
        low, high = ordered[drop], ordered[k - drop - 1]  # the kept range of each coordinate
        numerator, denominator = torch.zeros_like(out), torch.zeros_like(out)
        for row, w in zip(rows, weights, strict=True):
            # A value tied with a bound is kept with it: the same rule on every member, no order to break ties.
            kept = (row >= low) & (row <= high)
            numerator.add_(torch.where(kept, row, 0.0) * w)
            denominator.add_(kept * w)
        torch.div(numerator, denominator, out=out)

    def _centered_clip(
        self, rows: list[torch.Tensor], weights: Sequence[float], out: torch.Tensor, least: float
    ) -> None:
        v = _median(torch.stack(rows))
        radius = max(self.tau * median([norm(r - v) for r in rows]), least)
        total = sum(weights)
        for _ in range(self.iters if radius > 0 else 0):
            step = torch.zeros_like(v)
            for row, w in zip(rows, weights, strict=True):
                diff = row - v
                d = norm(diff)
                scale = w / total if d <= radius else stable(w / total * radius / d)
                step.add_(diff * scale)
            v.add_(step)
        out.copy_(v)


def _weighted_mean(rows: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor) -> None:
    total = sum(weights)
    out.zero_()
    for row, w in zip(rows, weights, strict=True):
        out.add_(row * (w / total))  # scale then add: no fused multiply-add, the same rounding on every CPU


def _sort_columns(stack: torch.Tensor) -> None:
    """Sort every column of ``stack`` (members x coordinates) in place, ascending.

    A group has few members, so an odd-even transposition network (``k`` passes of elementwise compare-exchange
    between neighbouring rows) beats ``torch.sort`` along the member axis by about 10x for 8 members; it is exact
    and the same on every CPU. Larger groups use ``torch.sort`` (``k^2 / 2`` exchanges grow faster than a sort).
    """
    k = stack.shape[0]
    if k > 16:
        stack.copy_(stack.sort(dim=0).values)
        return
    for p in range(k):
        for i in range(p % 2, k - 1, 2):
            a, b = stack[i], stack[i + 1]
            low = torch.minimum(a, b)
            torch.maximum(a, b, out=b)
            a.copy_(low)


def _median(stack: torch.Tensor) -> torch.Tensor:
    ordered = stack.clone()
    _sort_columns(ordered)
    k = ordered.shape[0]
    return (ordered[(k - 1) // 2] + ordered[k // 2]) / 2


def parse_aggregator(spec: str, *, private: bool = False) -> Aggregator:
    """``kind[:key=value,...]``; ``auto`` means ``mean`` in a private swarm and ``ROBUST_DEFAULT`` in a public one.

    The robust kinds default to ``clip=2,cap=1``; a bare ``mean`` has neither. ``cap=1``: no member counts more
    than the group's median member, so hostile members that claim huge token counts weigh what they are in number
    (with ``cap=2``, 3 of 8 such members held 55 % of the weight and moved centered-clip: bench_byzantine).
    """
    kind, _, rest = spec.strip().partition(":")
    if kind == "auto":
        kind = "mean" if private else ROBUST_DEFAULT
    if kind not in KINDS:
        raise ValueError(f"unknown aggregator {kind!r}: use one of auto, {', '.join(KINDS)}")
    agg = Aggregator(kind=kind) if kind == "mean" else Aggregator(kind=kind, clip=2.0, cap=1.0)
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in ("trim", "tau", "iters", "clip", "cap"):
            raise ValueError(f"aggregator parameter {item!r}: expected key=value with trim, tau, iters, clip or cap")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"aggregator parameter {key}={value!r} is not a number") from None
        if key == "iters":
            if not number.is_integer() or not 1 <= number <= 100:
                raise ValueError(f"aggregator parameter iters={value} must be a whole number in [1, 100]")
            agg = replace(agg, iters=int(number))
        elif key == "trim" and not 0 <= number < 0.5:
            raise ValueError(f"aggregator parameter trim={value} must be in [0, 0.5)")
        elif not math.isfinite(number) or number < 0 or (key == "tau" and number == 0):
            raise ValueError(f"aggregator parameter {key}={value} must be a finite number > 0 (clip, cap: 0 is off)")
        else:
            agg = replace(agg, **{key: number})
    return agg
