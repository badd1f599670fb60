"""Helpers for integration tests with real node processes on loopback."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Network namespaces and the kernel's tbf (scenario links, partitions) need root and iproute2's tc. CI runs as root
# and installs iproute2 where it is missing (.ci/run); elsewhere such tests skip, saying why.
NEEDS_ROOT_AND_TC = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("tc"), reason="network namespaces and tc need root and iproute2"
)

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
    # No checks of reducers (a public swarm's default, 3 a round: about a tenth of these tests' time); the tests
    # about them set it (test_swarm.py's four nodes, test_hostile_nodes.py).
    "averaging.verify=0",
]


def slowdown(sample_s: float = 0.3) -> float:
    """How much less CPU this process gets than the wall clock passes, measured now (1 on an idle machine, about 2
    with every core shared by two busy processes). The tests' waits were set on an idle 2-core machine; they scale by
    this so that a loaded machine gets the time it needs and an idle one fails as fast as before (capped at 4x)."""
    started_wall, started_cpu = time.perf_counter(), time.process_time()
    x = 0
    while time.perf_counter() - started_wall < sample_s:
        for i in range(10_000):
            x += i
    cpu = max(time.process_time() - started_cpu, 1e-3)
    return min(4.0, max(1.0, (time.perf_counter() - started_wall) / cpu))


class Swarm:
    """Starts node processes and always reaps them (kill by PID, only the ones it started). Waits are bounded, and
    their bounds scale with ``slowdown()`` as measured when the swarm was created."""

    def __init__(self, root: Path, data: Path, settings: list[str]) -> None:
        self.root, self.data, self.settings = root, data, settings
        self.slowdown = slowdown()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.daemons: dict[int, str] = {}  # p2pd children of our nodes: reaped too if a node was killed

    def start(
        self, name: str, rounds: int, join: str | list[str] | None = None, extra: list[str] = (), flags: list[str] = ()
    ) -> subprocess.Popen[bytes]:
        run_dir = self.root / name
        run_dir.mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "swarmtrain", "node", "--run-dir", str(run_dir), "--rounds", str(rounds)]
        args += flags
        args += ["--data", str(self.data), "--set", f"data.cache_dir={self.root / 'cache'}"]
        for item in [*self.settings, *extra]:
            args += ["--set", item]
        for address in [join] if isinstance(join, str) else join or []:
            args += ["--join", address]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMTRAIN_")}
        log = open(run_dir / "node.log", "wb")  # noqa: SIM115
        # Started with SIGINT ignored (see child_setup): Ctrl+C must still leave gracefully.
        self.procs[name] = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=child_setup
        )
        return self.procs[name]

    def start_all(self, names: list[str], rounds: int, extra: list[str] = ()) -> None:
        """Start ``names[0]``, then the others joining it; every node waits for all before round 0."""
        settings = [f"node.min_peers={len(names)}", *extra]
        self.start(names[0], rounds, extra=settings)
        first = self.join_line(names[0])
        for name in names[1:]:
            self.start(name, rounds, join=first, extra=settings)
        for name in names[1:]:
            self.join_line(name)

    def join_line(self, name: str, timeout: float = 60) -> str:
        path = self.root / name / "join.txt"
        timeout *= self.slowdown
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                self._note_daemons(self.procs[name].pid)
                return path.read_text().split()[0]
            assert self.procs[name].poll() is None, self.log(name)
            time.sleep(0.1)
        raise AssertionError(f"{name} did not come up in {timeout:.0f} s:\n{self.log(name)}")

    def _note_daemons(self, pid: int) -> None:
        for children in Path(f"/proc/{pid}/task").glob("*/children"):
            for child in children.read_text().split():
                cmdline = _cmdline(int(child))
                if "p2pd" in cmdline:
                    self.daemons[int(child)] = cmdline

    def log(self, name: str) -> str:
        """The node's whole log: a check that a line is in it must not depend on how much was logged after (only
        the last 3000 characters, and a test failed when shutdown tracebacks pushed its line out)."""
        return (self.root / name / "node.log").read_text(errors="replace")

    def metrics(self, name: str) -> list[dict]:
        path = self.root / name / "metrics.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().split("\n")[:-1]  # the last piece is empty or a line still being written
        return [json.loads(line) for line in lines if line.strip()]

    def rounds(self, name: str) -> list[dict]:
        return [r for r in self.metrics(name) if r["kind"] == "round"]

    def wait(self, names: list[str], timeout: float) -> None:
        timeout *= self.slowdown
        deadline = time.monotonic() + timeout
        for name in names:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                code = self.procs[name].wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} still running after {timeout:.0f} s:\n{self.log(name)}") from None
            assert code == 0, f"{name} exited with {code}:\n{self.log(name)}"

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``condition`` until it holds; after ``timeout`` s fail with ``what`` and the nodes' log tails."""
        timeout *= self.slowdown
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {name}\n{self.log(name)[-1500:]}" for name in self.procs)
                waited = f"{timeout:.0f} s (x{self.slowdown:.1f} for load)"
                raise AssertionError(f"timed out after {waited} waiting for {what}\n{logs}")
            time.sleep(0.2)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[name].pid, sig)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=30)
        for pid, cmdline in self.daemons.items():
            if _cmdline(pid) == cmdline:  # still our daemon, not a reused pid
                os.kill(pid, signal.SIGKILL)


def child_setup() -> None:
    """``preexec_fn`` of the processes tests start: die with the test process (a test runner killed from outside
    must not leave nodes behind), and start with SIGINT ignored, as a background job of a script would be."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
