"""Rounds by time (node.inner_time_s): real node processes of unlike speed share every round, weighted by tokens
(or alike, with averaging.weighting = equal)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from swarmtrain.data import load_corpus
from swarmtrain.node.inner import StandardLoop

from .conftest import tiny_config
from .swarm import Swarm


@pytest.mark.parametrize("weighting", ["tokens", pytest.param("equal", marks=pytest.mark.slow)])
def test_nodes_of_unlike_speed_share_rounds_by_time_and_weigh_by_tokens(swarm: Swarm, weighting: str) -> None:
    names = ["fast0", "fast1", "slow"]
    rounds = 3
    # The same 2 s budget on every node; "slow" sleeps 0.25 s after each step (a test-only setting), so it
    # manages far fewer steps in its budget than the others.
    settings = ["node.min_peers=3", "node.inner_time_s=2", "train.device=cpu", f"averaging.weighting={weighting}"]
    swarm.start(names[0], rounds, extra=settings)
    first = swarm.join_line(names[0])
    swarm.start(names[1], rounds, join=first, extra=settings)
    swarm.start(names[2], rounds, join=first, extra=[*settings, "node.test_step_delay_s=0.25"])
    swarm.wait(names, timeout=180)

    by_round: dict[int, dict[str, dict]] = {}
    for name in names:
        for r in swarm.rounds(name):
            by_round.setdefault(r["round"], {})[name] = r
    assert sorted(by_round) == list(range(rounds)), {n: swarm.rounds(n) for n in names}
    for round_, rows in by_round.items():
        assert sorted(rows) == sorted(names), (round_, sorted(rows))
        assert len({r["digest"] for r in rows.values()}) == 1, (round_, {n: r["digest"] for n, r in rows.items()})
        assert all(r["group_size"] == 3 and r["outcome"] == "applied" for r in rows.values()), (round_, rows)
        weights = dict(zip(rows["fast0"]["group"], rows["fast0"]["weights"], strict=True))
        for name, r in rows.items():
            # Each node's weight in the average is the tokens it trained this round (or 1 for every node that
            # trained), and its share says so.
            assert weights[r["peer_id"]] == (r["tokens"] if weighting == "tokens" else 1.0) and r["tokens"] > 0
            assert abs(r["token_share"] - weights[r["peer_id"]] / sum(weights.values())) < 1e-5, (round_, name, r)
            assert r["device"] == "cpu" and r["tokens_per_s"] > 0, (round_, name, r)
        slow, fast = rows["slow"]["tokens"], min(rows["fast0"]["tokens"], rows["fast1"]["tokens"])
        # At most 2 s / 0.25 s + 1 = 9 steps for the slow node; the others step without sleeping.
        assert slow < fast / 2, (round_, {n: r["tokens"] for n, r in rows.items()})


def test_a_slowdown_makes_each_inner_step_take_that_many_times_as_long(tmp_path: Path, text_file: Path) -> None:
    """node.slowdown: an unlike machine on this one. Each step here computes for 50 ms (a sleep, so that the test
    does not depend on the machine's load); at slowdown 3 four steps take 600 ms, not 200."""

    class Fixed(StandardLoop):
        def _step(self) -> float:
            time.sleep(0.05)
            return 1.0

    config = tiny_config(tmp_path, text_file)
    loop = Fixed(config, load_corpus(config.data), data_seed=1)
    _, _, full = loop.run(4)
    _, _, slow = loop.run(4, slowdown=3.0)
    assert full >= 0.2 and 3 * 0.2 <= slow <= 3 * full + 0.3, (full, slow)  # each step's time, twice more
