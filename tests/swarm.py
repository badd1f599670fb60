"""Helpers for integration tests with real node processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TINY = [
    "model.depth=1",
    "model.width=32",
    "model.heads=2",
    "model.context=32",
    "train.batch_size=4",
    "train.threads=1",
    "train.eval_batches=1",
    "node.inner_steps=3",
    "node.heartbeat_s=0.5",
    "node.record_ttl_s=3",
    "averaging.min_gather_s=3",
    "averaging.min_deadline_s=8",
]


class Swarm:
    """Starts node processes and always reaps them (kill by PID, only the ones it started)."""

    def __init__(self, root: Path, data: Path, settings: list[str]) -> None:
        self.root, self.data, self.settings = root, data, settings
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, rounds: int, join: str | None = None, extra: list[str] = ()) -> subprocess.Popen[bytes]:
        run_dir = self.root / name
        run_dir.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "swarmtrain", "node", "--run-dir", str(run_dir), "--rounds", str(rounds)]
        args += ["--data", str(self.data), "--set", f"data.cache_dir={self.root / 'cache'}"]
        for item in [*self.settings, *extra]:
            args += ["--set", item]
        if join:
            args += ["--join", join]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMTRAIN_")}
        log = open(run_dir / "node.log", "wb")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self.procs[name]

    def join_line(self, name: str, timeout: float = 60) -> str:
        path = self.root / name / "join.txt"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return path.read_text().split()[0]
            assert self.procs[name].poll() is None, self.log(name)
            time.sleep(0.1)
        raise AssertionError(f"{name} did not come up:\n{self.log(name)}")

    def log(self, name: str) -> str:
        return (self.root / name / "node.log").read_text(errors="replace")[-3000:]

    def metrics(self, name: str) -> list[dict]:
        path = self.root / name / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def rounds(self, name: str) -> list[dict]:
        return [r for r in self.metrics(name) if r["kind"] == "round"]

    def wait(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name in names:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                code = self.procs[name].wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} still running after {timeout} s:\n{self.log(name)}") from None
            assert code == 0, f"{name} exited with {code}:\n{self.log(name)}"

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[name].pid, sig)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=30)
