"""Peak process-tree PSS: the sum of proportional set sizes over a process and all its descendants.

PSS charges each shared page to the processes that map it in equal parts, so the sum over a tree counts the
torch libraries, the memory-mapped corpus and the shared-memory rings once, and every private page exactly
once: the figure to compare a one-process method with a multi-process one. Read from
``/proc/<pid>/smaps_rollup`` (Linux); a background thread samples the tree and keeps the peak.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

PROC = Path("/proc")


def _parent_map() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[-1].split()
            parents[int(entry.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant."""
    children: dict[int, list[int]] = {}
    for child, parent in _parent_map().items():
        children.setdefault(parent, []).append(child)
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def pss_kib(pid: int) -> int:
    """PSS of one process in KiB (0 if it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return 0
    return 0


def tree_pss_mib(pid: int) -> float:
    return sum(pss_kib(p) for p in process_tree(pid)) / 1024


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (``/proc/stat``; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _TICK


def _process_cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[-1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0.0


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class PssSampler:
    """Samples a process tree every ``interval`` seconds in a thread.

    ``peak_mib`` is the largest PSS sum seen (``peak_detail`` splits it by process); ``other_cores`` is the average
    number of cores that processes *outside* the tree kept busy meanwhile: on a shared machine, background load
    that slows a multi-threaded run far more than single-threaded stages, so every result carries it.
    """

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid, self.interval = pid, interval
        self.peak_mib = 0.0
        self.peak_processes = 0
        self.peak_detail: list[tuple[str, float]] = []
        self.samples = 0
        self.other_cores = 0.0
        self._cpu: dict[int, float] = {}
        self._ours = 0.0
        self._start_busy = self._start_time = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pss-{pid}", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> float:
        tree = process_tree(self.pid)
        sizes = [(p, pss_kib(p) / 1024) for p in tree]
        total = sum(size for _, size in sizes)
        if total > self.peak_mib:
            self.peak_mib, self.peak_processes = total, len(tree)
            self.peak_detail = [(f"{_name(p)}[{p}]", round(size, 1)) for p, size in sizes]
        for pid in tree:
            used = _process_cpu_seconds(pid)
            self._ours += max(0.0, used - self._cpu.get(pid, 0.0))  # every process in the tree started after us
            self._cpu[pid] = used
        self.samples += 1
        return total

    def _finish_cpu(self) -> None:
        wall = time.monotonic() - self._start_time
        if wall > 0:
            other = _busy_seconds() - self._start_busy - self._ours
            self.other_cores = max(0.0, other / wall)

    def __enter__(self) -> PssSampler:
        self._start_busy, self._start_time = _busy_seconds(), time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._finish_cpu()
