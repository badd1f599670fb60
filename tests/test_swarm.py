"""Integration tests: real node processes (p2pd daemons, DHT, averaging) on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .swarm import TINY, Swarm


@pytest.fixture
def swarm(tmp_path: Path, text_file: Path) -> Iterator[Swarm]:
    s = Swarm(tmp_path, text_file, TINY)
    try:
        yield s
    finally:
        s.close()


def digests_by_round(swarm: Swarm, names: list[str]) -> dict[int, dict[str, str]]:
    table: dict[int, dict[str, str]] = {}
    for name in names:
        for r in swarm.rounds(name):
            table.setdefault(r["round"], {})[name] = r["digest"]
    return table


def test_four_nodes_agree_bit_for_bit_after_every_round(swarm: Swarm) -> None:
    names = [f"n{i}" for i in range(4)]
    swarm.start("n0", rounds=5, extra=["node.min_peers=4"])
    first = swarm.join_line("n0")
    for name in names[1:]:
        swarm.start(name, rounds=5, join=first, extra=["node.min_peers=4"])
    swarm.wait(names, timeout=180)
    table = digests_by_round(swarm, names)
    assert sorted(table) == [0, 1, 2, 3, 4]
    for round_, digests in table.items():
        assert len(digests) == 4 and len(set(digests.values())) == 1, (round_, digests)
    rows = swarm.rounds("n1")
    assert all(r["group_size"] == 4 and r["outcome"] == "applied" for r in rows)
    assert all(r["bytes_sent"] > 0 and r["codec"] == "fp16" for r in rows)
    final = [r for r in swarm.metrics("n1") if r["kind"] == "final"][0]
    assert final["bpb"] < 8.0
