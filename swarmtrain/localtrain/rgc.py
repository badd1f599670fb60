"""Readout-Gradient Consensus: how the readout's owner combines its gradient with the upstream stages'.

Upstream stage ``s`` differentiates its local loss with respect to a snapshot of the readout (version ``v_s``)
and sends that gradient tagged with ``v_s``. The owner averages all ``S`` gradients with uniform weights and
steps the readout. With zero lag (every ``v_s`` equals the live version) this is exactly the readout gradient of
live deep supervision with uniform weights; with lag it is that gradient evaluated at slightly stale readouts.
A negative cosine between an upstream gradient and the owner's own is the likely way quality is lost, so the
owner keeps statistics of it (and of the lag) for every upstream stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def combine_readout_grads(own: torch.Tensor, upstream: list[torch.Tensor]) -> torch.Tensor:
    """The uniform average of the owner's readout gradient and the upstream stages' (``1 + len(upstream)`` terms)."""
    if not upstream:
        return own
    return torch.stack([own, *upstream]).mean(dim=0)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two gradients (0.0 if either is zero)."""
    denom = a.norm() * b.norm()
    return float((a.reshape(-1) @ b.reshape(-1)) / denom) if denom > 0 else 0.0


@dataclass
class UpstreamStats:
    """Running statistics of one upstream stage's readout gradients, as seen by the owner."""

    count: int = 0
    cos_sum: float = 0.0
    cos_min: float = 1.0
    cos_last: float = 0.0
    negative: int = 0
    lag_sum: int = 0
    lag_max: int = 0

    def add(self, cos: float, lag: int) -> None:
        self.count += 1
        self.cos_sum += cos
        self.cos_min = min(self.cos_min, cos)
        self.cos_last = cos
        self.negative += cos < 0
        self.lag_sum += lag
        self.lag_max = max(self.lag_max, lag)

    def summary(self) -> dict[str, float]:
        n = max(self.count, 1)
        return {
            "grads": self.count,
            "cos_mean": self.cos_sum / n,
            "cos_min": self.cos_min if self.count else 0.0,
            "cos_negative_frac": self.negative / n,
            "lag_mean": self.lag_sum / n,
            "lag_max": self.lag_max,
        }


@dataclass
class ReadoutConsensus:
    """The owner's side of RGC: combine gradients for one step and keep per-upstream statistics."""

    upstream_stages: int
    stats: list[UpstreamStats] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stats = [UpstreamStats() for _ in range(self.upstream_stages)]

    def combine(self, own: torch.Tensor, grads: list[torch.Tensor], lags: list[int]) -> torch.Tensor:
        for stats, grad, lag in zip(self.stats, grads, lags, strict=True):
            stats.add(cosine(grad, own), lag)
        return combine_readout_grads(own, grads)

    def summary(self) -> list[dict[str, float]]:
        return [s.summary() for s in self.stats]
