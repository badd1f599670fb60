"""Graceful stops however a process was started: SIGINT ignored at start (a background job of a script, a service
manager), SIGTERM, SIGHUP, and SIGHUP ignored on purpose (nohup)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from swarmtrain.signals import stop_on_signals
from swarmtrain.train.checkpoint import latest_checkpoint, list_checkpoints

TINY_TRAIN = [
    "--set", "model.depth=1", "--set", "model.width=32", "--set", "model.heads=2", "--set", "model.context=32",
    "--set", "train.batch_size=4", "--set", "train.threads=1", "--set", "train.eval_batches=1",
    "--set", "train.eval_every=100000", "--set", "train.checkpoint_every=20", "--max-steps", "1000000",
]  # fmt: skip


def ignoring(*signals: signal.Signals) -> Callable[[], None]:
    """A ``preexec_fn`` that starts the child with ``signals`` ignored, as a shell's background job inherits them.
    Its SIGHUP is otherwise a terminal's, whatever the suite inherited (under ``nohup`` it is ignored)."""

    def setup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)

    return setup


def start_training(tmp_path: Path, data: Path, ignored: tuple[signal.Signals, ...]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMTRAIN_")}
    args = [sys.executable, "-m", "swarmtrain", "train", "--data", str(data), "--run-dir", str(tmp_path / "run")]
    return subprocess.Popen(
        [*args, *TINY_TRAIN], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
        preexec_fn=ignoring(*ignored),
    )  # fmt: skip


def wait_for_checkpoint_after(proc: subprocess.Popen[str], run_dir: Path, step: int, timeout: float = 120) -> int:
    """Wait until the run has written a checkpoint past ``step``; return its step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [int(p.stem.split("-")[1]) for p in list_checkpoints(run_dir)]
        if steps and max(steps) > step:
            return max(steps)
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before a checkpoint past step {step}:\n"
                                 f"{proc.communicate()[0][-2000:]}")  # fmt: skip
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint past step {step} in {timeout:.0f} s; saw {list_checkpoints(run_dir)}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_train_started_with_sigint_ignored_stops_gracefully(tmp_path: Path, text_file: Path, sig) -> None:
    proc = start_training(tmp_path, text_file, ignored=(signal.SIGINT,))
    try:
        wait_for_checkpoint_after(proc, tmp_path / "run", 0)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, out[-2000:]
    assert "interrupted at step" in out and "checkpoint written" in out, out[-2000:]
    checkpoint = latest_checkpoint(tmp_path / "run")
    assert checkpoint is not None and f"interrupted at step {checkpoint.step};" in out


def test_train_under_nohup_outlives_its_terminal(tmp_path: Path, text_file: Path) -> None:
    """SIGHUP ignored at start is how nohup asks a process to survive its terminal: it keeps training."""
    proc = start_training(tmp_path, text_file, ignored=(signal.SIGINT, signal.SIGHUP))
    try:
        before = wait_for_checkpoint_after(proc, tmp_path / "run", 0)
        proc.send_signal(signal.SIGHUP)
        wait_for_checkpoint_after(proc, tmp_path / "run", before)  # still training after the hang-up
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0 and "interrupted at step" in out, out[-2000:]


def test_stop_on_signals_leaves_a_handler_it_did_not_install_and_restores_its_own() -> None:
    def custom(signum: int, frame: object) -> None:
        raise AssertionError("not called")

    previous = signal.signal(signal.SIGTERM, custom)
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN where the suite started so
    try:
        with stop_on_signals():
            assert signal.getsignal(signal.SIGTERM) is custom
            assert signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, signal.SIG_IGN)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs at the next bytecode; never reached
        assert signal.getsignal(signal.SIGINT) == before
    finally:
        signal.signal(signal.SIGTERM, previous)
