"""A node of a non-IID swarm: it trains on some folders of the corpus (data.include) and its final evaluation
measures the one model on each part and on all of them (data.eval_parts)."""

from __future__ import annotations

import math
from pathlib import Path

from .conftest import english_like
from .swarm import Swarm


def test_a_node_on_one_part_reports_its_final_bpb_on_each_part_and_on_all(swarm: Swarm, tmp_path: Path) -> None:
    folder = tmp_path / "parts"
    for i in range(16):
        for part in ("prose", "digits"):
            (folder / part).mkdir(parents=True, exist_ok=True)
        (folder / "prose" / f"p{i}.txt").write_bytes(english_like(4000, seed=i))
        (folder / "digits" / f"d{i}.txt").write_bytes(str(7 ** (900 + i)).encode() * 2)
    swarm.data = folder
    swarm.start("n0", 1, extra=['data.include=["prose"]', 'data.eval_parts=["prose", "digits"]'])
    swarm.wait(["n0"], timeout=90)
    (final,) = [r for r in swarm.metrics("n0") if r["kind"] == "final"]
    parts = final["bpb_parts"]
    assert list(parts) == ["prose", "digits", "all"] and all(math.isfinite(v) for v in parts.values()), parts
    # It trained on prose alone, so its own held-out split is the prose part's: the same bytes, the same windows.
    assert parts["prose"] == final["bpb"], (parts, final["bpb"])
    assert parts["digits"] != parts["prose"]
    assert f"(prose {parts['prose']:.3f}, digits {parts['digits']:.3f}, all {parts['all']:.3f})" in swarm.log("n0")
