"""A swarm node whose inner steps run on localtrain (``train.trainer = "localtrain"``), next to a standard node."""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from swarmtrain.data import load_corpus
from swarmtrain.localtrain.shm import leftover_segments, pid_alive
from swarmtrain.node.inner import LocalTrainLoop, StandardLoop
from tests.conftest import tiny_config
from tests.swarm import Swarm, _cmdline

# Both trainers hold the same parameters only with the same model, exits included (an exit's norm is a parameter).
MODEL = ["model.depth=2", "model.exits=[1]"]
LOCALTRAIN = ["train.trainer=localtrain", "localtrain.method=rgc-async", "localtrain.stages=2", "localtrain.threads=2"]


@pytest.mark.timeout(90)
def test_both_inner_loops_hold_the_same_parameter_vector(tmp_path: Path, text_file: Path) -> None:
    settings = {"model.depth": 2, "model.exits": [1], "train.trainer": "localtrain", "localtrain.threads": 2}
    config = tiny_config(tmp_path, text_file, **settings)
    corpus = load_corpus(config.data)
    standard = StandardLoop(config, corpus, data_seed=7)
    local = LocalTrainLoop(config, corpus, data_seed=7)
    prefix = local.trainer.segment_prefix
    assert prefix and leftover_segments(prefix)
    try:
        theta = standard.vector()
        assert torch.equal(local.vector(), theta) and local.shapes == standard.shapes
        assert set(local.state(theta)[0]) == {k for k in standard.state(theta)[0] if k.startswith("model.")}
        loss, tokens, _ = local.run(3)
        assert tokens == 3 * config.train.batch_size * config.model.context and loss == loss
        assert not torch.equal(local.vector(), theta)
        local.load_vector(theta)  # the outer step's result goes back into every stage
        assert torch.equal(local.vector(), theta)
        local.run(2)  # the next round trains on from there
        assert local.trainer.step == 5
        # Ctrl+C in the middle of a round: stop ends the round's steps early, with the pipeline not drained.
        inner = threading.Thread(target=local.run, args=(10_000,))
        inner.start()
        deadline = time.monotonic() + 30
        while local.trainer.step < 7 and time.monotonic() < deadline:
            time.sleep(0.05)
        local.stop()
        assert not inner.is_alive() and 7 <= local.trainer.step < 5 + 10_000
        assert torch.equal(local.state(theta)[0]["model.embed.weight"], standard.state(theta)[0]["model.embed.weight"])
    finally:
        local.close()
    assert leftover_segments(prefix) == []


def _children(pid: int) -> dict[int, str]:
    found = {}
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in children.read_text().split():
            found[int(child)] = _cmdline(int(child))
    return found


@pytest.mark.timeout(150)
def test_standard_and_localtrain_nodes_agree_every_round_and_ctrl_c_releases_the_stages(swarm: Swarm) -> None:
    swarm.start("std", 3, extra=["node.min_peers=2", *MODEL])
    first = swarm.join_line("std")
    node = swarm.start("lt", 0, join=first, extra=["node.min_peers=2", *MODEL, *LOCALTRAIN])  # until Ctrl+C
    swarm.join_line("lt")
    deadline = time.monotonic() + 90
    while not swarm.rounds("lt") and time.monotonic() < deadline and node.poll() is None:
        time.sleep(0.2)
    assert swarm.rounds("lt"), swarm.log("lt")
    found = re.search(r"localtrain: rgc-async in 2 stages.*shared memory /dev/shm/(\w+)-\*", swarm.log("lt"))
    assert found, swarm.log("lt")
    prefix = found.group(1)
    assert leftover_segments(prefix)  # the rings, snapshot and parameter segments of the running pipeline
    stage_procs = {p: c for p, c in _children(node.pid).items() if "multiprocessing" in c}
    assert any("spawn_main" in c for c in stage_procs.values()), _children(node.pid)

    swarm.wait(["std"], timeout=90)
    node.send_signal(signal.SIGINT)  # the localtrain node goes on alone until Ctrl+C
    assert node.wait(timeout=60) == 0, swarm.log("lt")
    assert "leaving the swarm gracefully" in swarm.log("lt")
    assert list((swarm.root / "lt" / "checkpoints").glob("step-*.safetensors"))

    digests: dict[int, set[str]] = {}
    for name in ("std", "lt"):
        for r in swarm.rounds(name):
            if r["round"] < 3:
                digests.setdefault(r["round"], set()).add(r["digest"])
    assert sorted(digests) == [0, 1, 2] and all(len(d) == 1 for d in digests.values()), digests
    rows = [r for r in swarm.rounds("lt") if r["round"] < 3]
    assert all(r["group_size"] == 2 and r["outcome"] == "applied" and r["tokens"] > 0 for r in rows), rows
    assert leftover_segments(prefix) == []
    deadline = time.monotonic() + 10  # the resource tracker leaves once its pipe from the node closes
    while any(pid_alive(p) and _cmdline(p) == c for p, c in stage_procs.items()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p, c in stage_procs.items() if pid_alive(p) and _cmdline(p) == c], stage_procs
