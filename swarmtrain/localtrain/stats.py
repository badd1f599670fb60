"""Paired comparisons over seeds: the relative quality gap to global backprop and its one-sided 95 % bound.

For each seed ``i`` the gap is ``100 * (bpb_method_i - bpb_bp_i) / bpb_bp_i`` (positive: the method is worse).
Over ``n`` seeds the upper bound is ``mean + t_{0.95, n-1} * sd / sqrt(n)``; a method passes a non-inferiority
margin ``m`` when that bound is below ``m`` (1 % in the issue). Throughput and memory are compared by the
geometric mean of per-seed ratios.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# one-sided 95 % quantiles of Student's t for 1..30 degrees of freedom
_T95 = (
    6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
    1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
    1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697,
)  # fmt: skip
_Z95 = 1.6448536269514722


def t95(df: int) -> float:
    """One-sided 95 % quantile of Student's t with ``df`` degrees of freedom (Cornish-Fisher beyond 30)."""
    if df < 1:
        raise ValueError("t quantile needs at least one degree of freedom")
    if df <= len(_T95):
        return _T95[df - 1]
    z = _Z95
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class PairedGap:
    n: int
    mean_pct: float
    sd_pct: float
    upper95_pct: float  # inf with a single seed
    gaps_pct: tuple[float, ...]

    def passes(self, margin_pct: float = 1.0) -> bool:
        return self.upper95_pct < margin_pct


def paired_gap(method_bpb: list[float], baseline_bpb: list[float]) -> PairedGap:
    """The relative gap (percent) of a method to the baseline over paired seeds."""
    if len(method_bpb) != len(baseline_bpb) or not method_bpb:
        raise ValueError("paired_gap needs one method and one baseline value per seed")
    gaps = [100.0 * (m - b) / b for m, b in zip(method_bpb, baseline_bpb, strict=True)]
    n = len(gaps)
    mean = sum(gaps) / n
    if n == 1:
        return PairedGap(1, mean, float("nan"), float("inf"), tuple(gaps))
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (n - 1))
    return PairedGap(n, mean, sd, mean + t95(n - 1) * sd / math.sqrt(n), tuple(gaps))


def geomean_ratio(values: list[float], baseline: list[float]) -> float:
    """Geometric mean of per-seed ratios ``values[i] / baseline[i]``."""
    ratios = [v / b for v, b in zip(values, baseline, strict=True)]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))
