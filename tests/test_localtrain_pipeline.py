"""The async pipeline with real stage processes: training, gathering, failures, Ctrl+C, and clean shutdown.

Each test starts at most two torch processes (a few seconds each on two cores) on a tiny model.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from swarmtrain.config import Config
from swarmtrain.data import load_corpus
from swarmtrain.localtrain.config import LocalTrainConfig
from swarmtrain.localtrain.control import Control
from swarmtrain.localtrain.errors import LocalTrainError, StageFailed
from swarmtrain.localtrain.pss import process_tree, tree_pss_mib
from swarmtrain.localtrain.ring import wait_until
from swarmtrain.localtrain.shm import leftover_segments
from swarmtrain.localtrain.trainer import LocalTrainer
from tests.conftest import localtrain_config

CTX = mp.get_context("spawn")
pytestmark = [pytest.mark.usefixtures("reap_children"), pytest.mark.timeout(90)]


def async_lt(method: str = "rgc-async") -> LocalTrainConfig:
    return LocalTrainConfig(method=method, stages=2, threads=2, ring_depth=2, wait_timeout=30, start_timeout=60)


def test_rgc_async_trains_gathers_and_loads(tmp_path: Path, text_file: Path, prefix: str) -> None:
    config = localtrain_config(tmp_path, text_file, steps=12)
    corpus = load_corpus(config.data)
    with LocalTrainer(config, corpus, async_lt(), prefix=prefix, horizon=6) as trainer:
        engine = trainer.engine
        assert len(leftover_segments(prefix)) >= 5  # control, 2 rings, snapshot, parameters
        losses = [trainer.train_step() for _ in range(6)]
        with pytest.raises(LocalTrainError, match="horizon"):
            trainer.train_step()
        assert all(math.isfinite(x) for x in losses)
        state = trainer.model.state_dict()  # drained at the horizon
        assert set(state) == {n for n, _ in trainer.model.named_parameters()}
        bpb = trainer.evaluate()
        assert math.isfinite(bpb)
        readout = trainer.breakdown()["readout"][0]
        assert readout["grads"] == 6 and readout["lag_max"] <= 2
        # Load a modified state, gather it back unchanged: every stage took its part.
        shifted = {k: v + 0.5 for k, v in state.items()}
        trainer.load_model_state(shifted)
        for name, value in trainer.model.state_dict().items():
            torch.testing.assert_close(value, shifted[name], msg=name)
        trainer.set_horizon(12)
        losses += [trainer.train_step() for _ in range(6)]
        assert trainer.step == 12 and trainer.tokens == 12 * 8 * 32
        stages = trainer.breakdown()["stages"]
        assert [s["stage"] for s in stages] == [0, 1] and stages[0]["lag_max"] <= 2
        procs = list(engine.procs)
    assert all(not p.is_alive() for p in procs)
    assert all(p.exitcode == 0 for p in procs)


def test_a_killed_stage_fails_the_run_quickly_and_cleanly(tmp_path: Path, text_file: Path, prefix: str) -> None:
    config = localtrain_config(tmp_path, text_file, steps=1000)
    corpus = load_corpus(config.data)
    trainer = LocalTrainer(config, corpus, async_lt("broadcast-async"), prefix=prefix)
    try:
        trainer.train_step()
        stage = trainer.engine.procs[0]
        os.kill(stage.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(StageFailed, match="stage 0"):
            for _ in range(50):
                trainer.train_step()
        assert time.monotonic() - start < 10
    finally:
        trainer.close(abort=True)
    assert not stage.is_alive()


def run_until_interrupted(config_dump: dict, prefix: str, ignore_sigint: bool = False) -> None:
    """A run process as the bench starts it: trains until Ctrl+C, then must clean up on its own. With
    ``ignore_sigint`` it starts as a background job of a script would, with SIGINT ignored. Its SIGHUP is a
    terminal's, whatever the suite inherited: under ``nohup`` it would be ignored, and rightly not taken."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = Config.model_validate(config_dump)
    with LocalTrainer(config, load_corpus(config.data), async_lt(), prefix=prefix) as trainer:
        while True:
            trainer.train_step()


@pytest.mark.parametrize(
    ("sig", "ignore_sigint"),
    [
        pytest.param(signal.SIGINT, False, id="ctrl-c"),
        pytest.param(signal.SIGINT, True, id="ctrl-c-started-ignoring-it"),
        # The same handler serves SIGTERM and SIGHUP (tests/test_signals.py checks it for every command); the
        # slow suite checks here that they release every stage and segment too.
        pytest.param(signal.SIGTERM, True, id="sigterm", marks=pytest.mark.slow),
        pytest.param(signal.SIGHUP, False, id="sighup", marks=pytest.mark.slow),
    ],
)
def test_ctrl_c_stops_every_process_and_unlinks_every_segment(
    tmp_path: Path, text_file: Path, prefix: str, sig: signal.Signals, ignore_sigint: bool
) -> None:
    config = localtrain_config(tmp_path, text_file, steps=100_000)
    run = CTX.Process(target=run_until_interrupted, args=(config.model_dump(), prefix, ignore_sigint))
    run.start()
    # Wait until both stages train (the control block says so), then interrupt.
    wait_until(lambda: len(leftover_segments(prefix)) >= 5, run_alive(run), 60)
    control = Control.attach(f"{prefix}-ctl", 2)
    try:
        wait_until(lambda: control.steps_done(0) >= 2 and control.steps_done(1) >= 2, run_alive(run), 60)
    finally:
        control.detach()
    tree = process_tree(run.pid)
    assert tree_pss_mib(run.pid) > 50
    os.kill(run.pid, sig)  # a terminal sends SIGINT to the group; stages ignore it, the parent cleans up
    run.join(timeout=30)
    assert run.exitcode is not None and run.exitcode != 0  # KeyboardInterrupt propagates after cleanup
    wait_until(lambda: not any(_alive(pid) for pid in tree), lambda: None, 10)
    assert leftover_segments(prefix) == []


def run_alive(proc: mp.process.BaseProcess):
    def check() -> None:
        if not proc.is_alive():
            raise RuntimeError(f"the run process died early (exit code {proc.exitcode})")

    return check


def _alive(pid: int) -> bool:
    from swarmtrain.localtrain.shm import pid_alive

    return pid_alive(pid)
