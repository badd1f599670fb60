"""``swarmtrain demo``, what the README's first command runs: a swarm of node processes on loopback, then one node
alone for the same wall time, and a summary of both."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from swarmtrain.node.demo import read_metrics


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_demo_trains_a_swarm_whose_replicas_agree_and_says_what_its_comparison_shows(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    args = [sys.executable, "-m", "swarmtrain", "demo", "--nodes", "2", "--rounds", "2", "--run-dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMTRAIN_")} | {"COLUMNS": "200"}
    # A session of its own: if the demo outlives the wait, its nodes go with it (only what this test started).
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    metrics = [read_metrics(run_dir / f"node{i}" / "metrics.jsonl") for i in range(2)]
    rows = [[r for r in records if r.get("kind") == "round"] for records in metrics]
    # Both nodes ran both rounds together and hold the same bytes after each.
    assert [len(r) for r in rows] == [2, 2], rows
    for first, second in zip(*rows, strict=True):
        assert first["outcome"] == second["outcome"] == "applied" and first["group_size"] == 2
        assert first["digest"] == second["digest"]
    assert re.search(r"replicas identical after every round\W+yes", text), text[-3000:]
    # The comparison with one node says what it shows, so a reader does not take it for the swarm's speed.
    assert "not a speedup" in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    bpb = float(re.fullmatch(r"held-out bpb (\S+)", last).group(1))  # type: ignore[union-attr]
    # Trained: 4.06 in a run of this test; an untrained model scores about 8 bits, a byte drawn at random.
    assert math.isfinite(bpb) and 0 < bpb < 6, last
