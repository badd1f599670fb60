"""The processes a scenario starts: each in a session of its own, signalled by group, always reaped.

A node process group holds the node and everything it started (its p2pd daemon, localtrain stages), so
``kill`` (SIGKILL) and ``pause`` (SIGSTOP) hit the whole machine-to-be, as a crash or a laptop lid would, while a
graceful leave is SIGTERM to the node alone (it finishes its round, announces its leave and stops its daemon).
Every child also dies with the runner (PR_SET_PDEATHSIG), so a runner killed from outside leaves no node behind;
``close`` kills whatever is left of every group it started, by process group id, and nothing else: a node that
exited is not reaped before then (``exit_code`` peeks with WNOWAIT), so its pid, which names its group, cannot be
reused by another process until the group was killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _child_setup() -> None:
    os.setsid()  # a group of its own: a kill or pause reaches its daemon too, and the terminal's Ctrl+C does not
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Processes:
    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMTRAIN_")}  # the spec says it all
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_child_setup)
        self.started.append(proc)
        return proc

    @staticmethod
    def exit_code(proc: subprocess.Popen[bytes]) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs; the process is not reaped."""
        if proc.returncode is not None:
            return proc.returncode
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return proc.poll()
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    @staticmethod
    def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
        """``sig`` to every process of ``proc``'s group (its own pid: it leads a session of its own)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    def signal_leader(self, proc: subprocess.Popen[bytes], sig: int) -> None:
        if self.exit_code(proc) is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)

    def close(self, grace_s: float = 10.0) -> None:
        """Stop everything still running: SIGCONT (a paused group cannot act on SIGTERM), SIGTERM, then after
        ``grace_s`` SIGKILL to every group, which also takes a daemon a killed node left behind."""
        try:
            alive = [p for p in self.started if self.exit_code(p) is None]
            for proc in alive:
                self.signal_group(proc, signal.SIGCONT)
                self.signal_leader(proc, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while any(self.exit_code(p) is None for p in alive) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:  # also when a second Ctrl+C cuts the graceful part short
            for proc in self.started:
                self.signal_group(proc, signal.SIGKILL)
            for proc in self.started:
                proc.wait()
