"""Randomized crash test: ``kill -9`` at random moments of a ``swarmtrain train`` run that checkpoints every step,
with the newest checkpoint truncated or one bit of it flipped between runs. Every ``--resume`` continues from the
newest intact checkpoint, so the step count never goes back by more than one checkpoint.

    pytest -m slow tests/test_train_crash.py     # about 4-5 minutes on two busy cores; CRASH_SEED=N runs another seed
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

KILLS = 50
SEED = int(os.environ.get("CRASH_SEED", "0"))
SETTINGS = {
    "model.depth": 1, "model.width": 32, "model.heads": 2, "model.context": 32, "train.batch_size": 4,
    "train.max_steps": 1_000_000, "train.warmup_steps": 5, "train.eval_batches": 1, "train.eval_every": 1_000_000,
    "train.threads": 1, "train.checkpoint_every": 1, "train.keep_checkpoints": 2, "train.log_every": 1_000_000,
}  # fmt: skip
RESUMED = re.compile(r"resumed from step-(\d+)\.safetensors at step (\d+)")


def checkpoints(run_dir: Path) -> dict[int, Path]:
    folder = run_dir / "checkpoints"
    found = folder.glob("step-*.safetensors") if folder.is_dir() else []
    return {int(p.name[5:13]): p for p in found}


def stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def damage(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if rng.random() < 0.5:
        cut = rng.randrange(len(data))
        with open(path, "r+b") as f:
            f.truncate(cut)
        return f"truncated to {cut} of {len(data)} bytes"
    offset, bit = rng.randrange(len(data)), rng.randrange(8)
    data[offset] ^= 1 << bit
    with open(path, "r+b") as f:
        f.write(data)
    return f"bit {bit} of byte {offset} of {len(data)} flipped"


def wait_for(condition, seconds: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:]
            raise AssertionError(
                f"waited for {what}; the run {'ended' if proc.poll() is not None else 'hung'}:\n{tail}"
            )
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_9_with_damaged_checkpoints_always_resumes_from_the_newest_intact_one(
    tmp_path: Path, text_file: Path
) -> None:
    rng = random.Random(SEED)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMTRAIN_")} | {"PYTHONUNBUFFERED": "1"}
    base = [sys.executable, "-m", "swarmtrain", "train", "--data", str(text_file), "--run-dir", str(run_dir)]
    base += ["--set", f"data.cache_dir={tmp_path / 'cache'}"]
    for key, value in SETTINGS.items():
        base += ["--set", f"{key}={value}"]
    damaged: dict[str, tuple[int, int, int]] = {}  # file -> its stamp when damaged (a rewrite changes it)
    history: list[str] = []
    for kill in range(KILLS):
        saved = checkpoints(run_dir)
        intact = [s for s, p in saved.items() if damaged.get(p.name) != stamp(p)]
        expected = max(intact, default=None)
        stale = list((run_dir / "checkpoints").glob(".*.tmp")) if saved else []
        log = tmp_path / f"run{kill}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*base, *(["--resume"] if saved else [])], stdout=out, stderr=subprocess.STDOUT, env=env
            )
        try:
            if expected is None:
                wait_for(lambda: len(checkpoints(run_dir)) >= 2, 120, "two checkpoints", proc, log)
            else:
                resume_line = lambda path=log: RESUMED.search(path.read_text(errors="replace"))  # noqa: E731
                wait_for(resume_line, 120, "the resume line", proc, log)
                match = resume_line()
                assert match is not None
                resumed = int(match.group(2))
                context = f"seed {SEED}, run {kill}: {'; '.join(history[-3:])}"
                assert resumed == expected, f"resumed at step {resumed}, newest intact is {expected} ({context})"
                assert resumed >= max(saved) - SETTINGS["train.checkpoint_every"], context
                assert not any(p.exists() for p in stale), f"stale temp files survived the start: {stale}"
            time.sleep(rng.uniform(0.0, 0.4))  # a random moment: between steps, or in a checkpoint write
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        saved = checkpoints(run_dir)
        damaged = {name: st for name, st in damaged.items() if (run_dir / "checkpoints" / name).exists()}
        damaged = {n: st for n, st in damaged.items() if stamp(run_dir / "checkpoints" / n) == st}
        newest = saved[max(saved)]
        how = damage(newest, rng)
        damaged[newest.name] = stamp(newest)
        history.append(f"killed with {sorted(saved)}, {newest.name} {how}")
    assert len(history) == KILLS
