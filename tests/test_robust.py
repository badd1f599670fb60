"""Robust aggregators (swarmtrain/averaging/robust.py): what each combines, the guards, determinism, parsing."""

from __future__ import annotations

import pytest
import torch

from swarmtrain.averaging.robust import KINDS, Aggregator, parse_aggregator, stable

M = 4096


def honest_and_hostile(honest: int = 6, hostile: int = 2, factor: float = 1000.0):
    torch.manual_seed(0)
    signal = torch.randn(M)
    rows = [signal + 0.3 * torch.randn(M) for _ in range(honest)]
    rows += [-factor * signal for _ in range(hostile)]
    return signal, rows


def combine(agg: Aggregator, rows, weights=None) -> torch.Tensor:
    out = torch.empty(M)
    agg.reduce(rows, weights or [1.0] * len(rows), out)
    return out


def test_plain_mean_is_the_token_weighted_mean() -> None:
    rows = [torch.randn(M) for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    torch.testing.assert_close(
        combine(Aggregator(), rows, weights), sum(w * r for w, r in zip(weights, rows, strict=False)) / 8
    )


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "mean"])
def test_robust_kinds_stay_near_the_honest_mean_where_the_mean_is_dragged_away(kind: str) -> None:
    signal, rows = honest_and_hostile()
    honest_mean = sum(rows[:6]) / 6
    robust = combine(parse_aggregator(kind), rows)
    mean = combine(parse_aggregator("mean"), rows)
    assert float((robust - honest_mean).norm() / honest_mean.norm()) < 0.5
    assert float((mean - honest_mean).norm() / honest_mean.norm()) > 100


def test_the_norm_clip_scales_a_huge_contribution_to_the_median_norm_times_clip() -> None:
    signal, rows = honest_and_hostile(honest=3, hostile=1)
    agg = Aggregator(kind="mean", clip=2.0)
    clipped = agg._clipped(rows)
    norms = sorted(float(r.norm()) for r in rows)
    median = (norms[1] + norms[2]) / 2
    assert float(clipped[3].norm()) == pytest.approx(2.0 * median, rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(clipped[:3], rows[:3], strict=False))  # honest ones untouched


def test_the_floor_widens_centered_clips_radius_to_the_median_claimed_step() -> None:
    """A gossip mix: three members on one state, one 10 away. Without a floor the radius is the median distance
    (0), so the mix is the three's state. With ``floor`` 2 and a median claimed step of 1 (the outlier claims
    1e9; the median ignores it), the radius is 2: one 10 away pulls 341/1024 of it (five steps of r / 4 against
    the three pulling back); one 1.5 away counts whole."""
    held = torch.zeros(M)
    direction = torch.ones(M) / M**0.5
    for distance, pulled in [(10.0, 2 * 341 / 1024), (1.5, 1.5 / 4)]:
        rows = [held, held, held, held + distance * direction]
        steps = [1.0, 1.0, 1.0, 1e9]
        out = torch.empty(M)
        Aggregator(kind="centered-clip").reduce(rows, [1.0] * 4, out, steps)
        assert torch.equal(out, held)
        Aggregator(kind="centered-clip", floor=2.0).reduce(rows, [1.0] * 4, out, steps)
        torch.testing.assert_close(out, held + pulled * direction)


def test_weights_are_capped_relative_to_the_contributors_median() -> None:
    agg = Aggregator(kind="median", cap=2.0)
    assert agg.cap_weights([0.0, 100.0, 120.0, 80.0, 1e12]) == [0.0, 100.0, 120.0, 80.0, 220.0]
    assert Aggregator().cap_weights([1.0, 1e12]) == [1.0, 1e12]  # a bare mean caps nothing


def test_trimmed_mean_drops_the_extremes_of_each_coordinate() -> None:
    rows = [torch.full((M,), v) for v in (-1000.0, 1.0, 2.0, 3.0, 1000.0)]
    out = combine(Aggregator(kind="trimmed-mean", trim=0.2), rows, [1.0, 1.0, 2.0, 1.0, 1.0])
    assert torch.allclose(out, torch.full((M,), 2.0))  # (1 + 2*2 + 3) / 4


def test_median_of_an_even_count_is_the_mean_of_the_two_middle_values() -> None:
    rows = [torch.full((M,), v) for v in (5.0, 1.0, 3.0, 100.0)]
    assert torch.equal(combine(Aggregator(kind="median"), rows), torch.full((M,), 4.0))


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_contributions_give_the_same_bytes(kind: str) -> None:
    _, rows = honest_and_hostile()
    agg = parse_aggregator(kind)
    first = combine(agg, rows, [float(i + 1) for i in range(8)])
    again = combine(agg, [r.clone() for r in rows], [float(i + 1) for i in range(8)])
    assert torch.equal(first, again)


def test_stable_rounding_removes_summation_order_noise() -> None:
    x = 1.2345678901234567
    assert stable(x) == stable(x * (1 + 1e-15)) and stable(x) == pytest.approx(x, rel=1e-6)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("krum", "unknown aggregator"),
        ("trimmed-mean:trim=0.5", "trim=0.5"),
        ("centered-clip:iters=0", "iters=0"),
        ("centered-clip:tau=0", "tau=0"),
        ("median:clip=abc", "not a number"),
        ("median:foo=1", "expected key=value"),
    ],
)
def test_bad_aggregator_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_aggregator(spec)


def test_auto_is_mean_in_a_private_swarm_and_robust_in_a_public_one() -> None:
    assert parse_aggregator("auto", private=True) == Aggregator()
    public = parse_aggregator("auto")
    assert public.kind != "mean" and public.clip > 0 and public.cap > 0


@pytest.mark.parametrize("members", [1, 2, 5, 8, 16, 17])
def test_the_sorting_network_sorts_like_torch(members: int) -> None:
    from swarmtrain.averaging.robust import _sort_columns

    stack = torch.randn(members, 999)
    stack[:, :20] = torch.randn(1, 20)  # ties
    ordered = stack.clone()
    _sort_columns(ordered)
    assert torch.equal(ordered, stack.sort(dim=0).values)


def test_the_config_names_the_key_of_a_bad_aggregator_and_refuses_per_coordinate_ones_with_top_k() -> None:
    from swarmtrain.config import Config

    with pytest.raises(ValueError, match=r"averaging\.aggregator: unknown aggregator 'krum'"):
        Config.model_validate({"averaging": {"aggregator": "krum"}})
    with pytest.raises(ValueError, match="would discard sparse"):
        Config.model_validate({"averaging": {"aggregator": "median", "codec": "topk:frac=0.01"}})
    Config.model_validate({"averaging": {"aggregator": "centered-clip:tau=2", "codec": "topk:frac=0.01"}})


def test_an_attack_is_refused_unless_marked_test_only() -> None:
    from swarmtrain.config import Config

    with pytest.raises(ValueError, match="attack.test_only = true"):
        Config.model_validate({"attack": {"kind": "sign-flip"}})
    assert Config.model_validate({"attack": {"kind": "sign-flip", "test_only": True}}).attack.kind == "sign-flip"
