"""The zygote: stages forked from it train like spawned ones, are reaped, and leave nothing behind.

The test process has run torch ops already, so each test starts the zygote in a freshly spawned run process, as
the benchmark does; that process reports back through a pipe or files.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest

from swarmtrain.config import Config
from swarmtrain.localtrain.config import LocalTrainConfig
from swarmtrain.localtrain.control import Control
from swarmtrain.localtrain.pss import process_tree
from swarmtrain.localtrain.ring import wait_until
from swarmtrain.localtrain.shm import leftover_segments, new_prefix, pid_alive, sweep
from swarmtrain.localtrain.zygote import current_zygote
from tests.conftest import localtrain_config

CTX = mp.get_context("spawn")
pytestmark = [pytest.mark.usefixtures("reap_children"), pytest.mark.timeout(120)]


def async_lt() -> LocalTrainConfig:
    return LocalTrainConfig(method="rgc-async", stages=2, threads=2, ring_depth=2, wait_timeout=30, start_timeout=60)


def parallel_ops(threads: int, out: str) -> None:
    import torch

    from swarmtrain.localtrain.stage import setup_threads

    setup_threads(threads)
    a = torch.randn(256, 256)
    for _ in range(20):
        a = torch.tanh(a @ a)  # parallel matmul and elementwise ops: a child that inherited OpenMP hangs here
    Path(out).write_text(json.dumps({"threads": torch.get_num_threads(), "finite": bool(a.isfinite().all())}))


def zygote_children(tmp: str) -> None:
    import torch

    from swarmtrain.localtrain.zygote import start_zygote

    zygote = start_zygote()
    torch.set_num_threads(2)
    (torch.randn(512, 512) @ torch.randn(512, 512)).sum()  # this process now runs OpenMP; the zygote does not
    procs = [zygote.start(parallel_ops, (n, f"{tmp}/{n}.json"), f"child{n}") for n in (1, 2)]
    for proc in procs:
        proc.join(timeout=60)
    Path(f"{tmp}/pids.json").write_text(json.dumps([zygote.pid, *[p.pid for p in procs]]))
    alive = [p.is_alive() for p in procs]
    zygote.close()
    assert current_zygote() is None and not any(alive), alive


def test_zygote_children_run_parallel_torch_ops_after_the_parent_did(tmp_path: Path) -> None:
    run = CTX.Process(target=zygote_children, args=(str(tmp_path),))
    run.start()
    run.join(timeout=90)
    assert run.exitcode == 0
    for n in (1, 2):
        assert json.loads((tmp_path / f"{n}.json").read_text()) == {"threads": n, "finite": True}
    assert not any(pid_alive(pid) for pid in json.loads((tmp_path / "pids.json").read_text()))


def train_with_zygote(config_dump: dict, prefix: str, out: str, kill_stage: bool) -> None:
    from swarmtrain.localtrain.zygote import ForkedProcess, current_zygote, start_zygote

    zygote = start_zygote()
    from swarmtrain.data import load_corpus
    from swarmtrain.localtrain.errors import StageFailed
    from swarmtrain.localtrain.trainer import LocalTrainer

    config = Config.model_validate(config_dump)
    report: dict = {"zygote": zygote.pid, "run": os.getpid(), "subreaper": zygote.subreaper}
    try:
        with LocalTrainer(config, load_corpus(config.data), async_lt(), prefix=prefix) as trainer:
            procs = trainer.engine.procs
            report["stages"] = [p.pid for p in procs]
            report["forked"] = all(isinstance(p, ForkedProcess) for p in procs)
            report["parent"] = [
                int(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for p in procs
            ]
            report["losses"] = [trainer.train_step() for _ in range(4)]
            report["zygote_alive"] = pid_alive(zygote.pid)  # retired once the stages ran
            if kill_stage:
                os.kill(procs[0].pid, signal.SIGKILL)
                start = time.monotonic()
                try:
                    for _ in range(50):
                        trainer.train_step()
                except StageFailed as exc:
                    report["failed"] = str(exc)
                report["fail_s"] = time.monotonic() - start
        report["stage_alive"] = [p.is_alive() for p in procs]
        report["exitcodes"] = [p.exitcode for p in procs]
        report["later_pipelines_spawn"] = current_zygote() is None
    finally:
        zygote.close()
        Path(out).write_text(json.dumps(report))


@pytest.mark.parametrize("kill_stage", [False, True], ids=["clean", "killed-stage"])
def test_async_stages_fork_from_the_zygote_and_are_reaped(
    tmp_path: Path, text_file: Path, prefix: str, kill_stage: bool
) -> None:
    config = localtrain_config(tmp_path, text_file, steps=1000)
    out = tmp_path / "report.json"
    run = CTX.Process(target=train_with_zygote, args=(config.model_dump(), prefix, str(out), kill_stage))
    run.start()
    run.join(timeout=100)
    assert run.exitcode == 0
    report = json.loads(out.read_text())
    assert report["forked"] and report["later_pipelines_spawn"]
    assert len(report["losses"]) == 4 and all(x == x for x in report["losses"])
    assert report["stage_alive"] == [False]
    if report["subreaper"]:  # the zygote retired; the stage became the run's child, which reaped it
        assert report["parent"] == [report["run"]] and not report["zygote_alive"]
        assert report["exitcodes"] == ([-signal.SIGKILL] if kill_stage else [0])
    else:
        assert report["parent"] == [report["zygote"]]
    if kill_stage:
        assert "stage 0" in report["failed"] and report["fail_s"] < 10
    assert not any(pid_alive(pid) for pid in [report["zygote"], *report["stages"]])


def run_until_interrupted(config_dump: dict, prefix: str) -> None:
    from swarmtrain.localtrain.zygote import start_zygote

    with start_zygote():
        from swarmtrain.data import load_corpus
        from swarmtrain.localtrain.trainer import LocalTrainer

        config = Config.model_validate(config_dump)
        with LocalTrainer(config, load_corpus(config.data), async_lt(), prefix=prefix) as trainer:
            while True:
                trainer.train_step()


def start_training(tmp_path: Path, text_file: Path, prefix: str) -> tuple[mp.process.BaseProcess, list[int]]:
    """A run process with a zygote, once both stages train; returns it with its process tree."""
    config = localtrain_config(tmp_path, text_file, steps=100_000)
    run = CTX.Process(target=run_until_interrupted, args=(config.model_dump(), prefix))
    run.start()

    def alive() -> None:
        if not run.is_alive():
            raise RuntimeError(f"the run process died early (exit code {run.exitcode})")

    wait_until(lambda: len(leftover_segments(prefix)) >= 5, alive, 60)
    control = Control.attach(f"{prefix}-ctl", 2)
    try:
        wait_until(lambda: control.steps_done(0) >= 2 and control.steps_done(1) >= 2, alive, 60)
    finally:
        control.detach()
    tree = process_tree(run.pid)
    assert len(tree) == 2  # the run and the upstream stage (the zygote retired once the stage ran)
    return run, tree


def test_ctrl_c_stops_the_zygote_and_its_stages_and_unlinks_every_segment(
    tmp_path: Path, text_file: Path, prefix: str
) -> None:
    run, tree = start_training(tmp_path, text_file, prefix)
    for pid in tree:  # a terminal sends SIGINT to the whole group; the zygote and the stages ignore it
        os.kill(pid, signal.SIGINT)
    run.join(timeout=30)
    assert run.exitcode is not None and run.exitcode != 0
    wait_until(lambda: not any(pid_alive(pid) for pid in tree), lambda: None, 10)
    assert leftover_segments(prefix) == []


def test_a_killed_run_takes_its_zygote_and_stages_with_it(tmp_path: Path, text_file: Path) -> None:
    prefix = new_prefix()
    try:
        run, tree = start_training(tmp_path, text_file, prefix)
        os.kill(run.pid, signal.SIGKILL)
        run.join(timeout=10)
        wait_until(lambda: not any(pid_alive(pid) for pid in tree), lambda: None, 15)
    finally:
        sweep(prefix)  # a SIGKILLed parent cannot unlink; its resource tracker or the benchmark's sweep does


def test_without_a_zygote_nothing_is_forked() -> None:
    assert current_zygote() is None  # this process ran torch ops and started none: the pipeline spawns
