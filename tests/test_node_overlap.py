"""node.overlap: the next round's inner steps run while this round's update is averaged, and the new theta_g is
merged into them between two steps (``InnerLoop.merge``), keeping ``node.overlap_keep`` of the local parameters."""

from __future__ import annotations

import statistics
import threading
from pathlib import Path

import pytest
import torch

from swarmtrain.config import load_config
from swarmtrain.data import load_corpus
from swarmtrain.errors import ConfigError
from swarmtrain.node.inner import StandardLoop

from .conftest import tiny_config
from .swarm import Swarm


class Counting(StandardLoop):
    """Each step adds 1 to every parameter and notes the parameters it starts from; step ``hold`` waits for ``go``."""

    hold = 3

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.starts: list[torch.Tensor] = []
        self.reached, self.go = threading.Event(), threading.Event()

    def _step(self) -> float:
        self.starts.append(self._vector())
        if len(self.starts) == self.hold + 1:
            self.reached.set()
            assert self.go.wait(30)
        with torch.no_grad():
            for p in self.trainer.model.parameters():
                p.add_(1.0)
        return 1.0


def test_a_merge_mixes_theta_into_a_run_in_flight_between_two_steps(tmp_path: Path, text_file: Path) -> None:
    config = tiny_config(tmp_path, text_file)
    loop = Counting(config, load_corpus(config.data), data_seed=1)
    start = loop.vector()
    theta = torch.full_like(start, 7.0)  # the round's result
    runner = threading.Thread(target=loop.run, args=(10,))
    runner.start()
    assert loop.reached.wait(30)
    loop.merge(theta, 0.25)  # during the fourth step
    loop.go.set()
    runner.join(30)
    # The fourth step started from start + 3 and ended at start + 4; the fifth started from a quarter of that and
    # three quarters of theta, and the last six steps went on from there.
    close = lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-5)  # noqa: E731 (fp32 sums in another order)
    mixed = 0.25 * (start + 4) + 0.75 * theta
    assert close(loop.starts[3], start + 3) and close(loop.starts[4], mixed)
    assert close(loop.vector(), mixed + 6)


def test_a_merge_waits_for_the_next_use_and_a_load_replaces_it(tmp_path: Path, text_file: Path) -> None:
    config = tiny_config(tmp_path, text_file)
    loop = StandardLoop(config, load_corpus(config.data), data_seed=1)
    start = loop.vector()
    loop.merge(start + 1.0, 0.0)  # no run in flight: the next read applies it (keep 0: theta_g whole)
    assert torch.equal(loop.vector(), start + 1.0)
    loop.merge(start + 5.0, 0.5)
    loop.load_vector(start - 2.0)  # theta_g loaded whole (a catch-up): the merge is void
    assert torch.equal(loop.vector(), start - 2.0)


def test_theta_is_evaluated_on_a_copy_as_the_model_would_be(tmp_path: Path, text_file: Path) -> None:
    config = tiny_config(tmp_path, text_file)
    loop = StandardLoop(config, load_corpus(config.data), data_seed=1)
    loop.run(3)
    theta = loop.vector()
    loop.run(3)  # the model moves on; theta is measured as it was
    on_copy = loop.evaluate_theta(theta)
    assert on_copy != loop.evaluate()
    loop.load_vector(theta)
    assert on_copy == loop.evaluate()


def test_overlap_needs_the_standard_trainer() -> None:
    with pytest.raises(ConfigError, match="node.overlap needs train.trainer = standard"):
        load_config(flags={"node.overlap": True, "train.trainer": "localtrain"}, environ={})


def test_overlap_keep_is_a_share_below_one() -> None:
    with pytest.raises(ConfigError, match="overlap_keep"):  # 1 would never take theta_g in
        load_config(flags={"node.overlap_keep": 1.0}, environ={})


@pytest.mark.slow  # node processes for half a minute; the in-process tests above cover the merge itself
def test_overlapped_nodes_agree_every_round_and_train_while_they_average(swarm: Swarm) -> None:
    """Three nodes whose exchange is slow (each message leaves 150 ms late) and whose inner phase is ~2 s of steps
    that sleep: with overlap, a round line follows the last after about one inner phase, not an inner phase and
    an exchange."""
    names = ["n0", "n1", "n2"]
    rounds = 4
    extra = ["node.overlap=true", "node.inner_steps=10", "node.test_step_delay_s=0.2", "node.up_delay_ms=150",
             "node.eval_every=1"]  # fmt: skip
    swarm.start_all(names, rounds=rounds, extra=extra)
    swarm.wait(names, timeout=240)
    rows = {name: swarm.rounds(name) for name in names}
    for name in names:
        assert [r["round"] for r in rows[name]] == list(range(rounds)), rows[name]
        assert all(r["group_size"] == 3 and r["outcome"] == "applied" for r in rows[name]), rows[name]
        assert all(r["bpb"] > 0 for r in rows[name])  # theta_g measured on a copy beside the steps
    for k in range(rounds):
        assert len({rows[name][k]["digest"] for name in names}) == 1, k
    # From the second round on (the first waits for the start), each round line comes about an inner phase after
    # the last, and the trainer idles for a small part of the exchange: the exchange, at least 150 ms a message,
    # hid behind the steps.
    later = [r for name in names for r in rows[name][1:]]
    wall, inner, idle, exchange = (
        statistics.median(r[key] for r in later) for key in ("wall_s", "inner_s", "idle_s", "duration_s")
    )
    assert exchange > 0.6, exchange
    assert wall < inner + exchange / 2 and idle < exchange / 2, (wall, inner, idle, exchange)
    finals = [next(r for r in swarm.metrics(name) if r.get("kind") == "final") for name in names]
    assert len({f["bpb"] for f in finals}) == 1  # every node ends on theta_g, not on steps of a round not run
