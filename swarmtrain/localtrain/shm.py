"""Shared-memory segments: the parent creates and unlinks every one, children only attach.

On Python < 3.13 every ``SharedMemory`` attach registers the name with the resource tracker, and the tracker
unlinks what it thinks leaked. Spawned children share the parent's tracker, which keeps a *set* of names, so a
child that attaches and then unregisters also removes the parent's entry (the parent's own unlink then makes
the tracker print a KeyError). Children therefore attach without registering at all (``track=False`` from
3.13 on); the parent's registration stays as the safety net that unlinks the segments if the parent is
SIGKILLed, and the parent unlinks everything in ``finally`` otherwise. ``sweep`` removes whatever a killed
process tree left under a run's name prefix.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import uuid
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "swt"
_attach_lock = threading.Lock()


def new_prefix() -> str:
    """A fresh name prefix for one run's segments, e.g. ``swt3f9a1c2b``."""
    return f"{PREFIX}{uuid.uuid4().hex[:8]}"


def _no_registration(name: str, rtype: str) -> None:
    return None


def attach_segment(name: str) -> SharedMemory:
    """Attach to an existing segment without registering it with the resource tracker."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    with _attach_lock:
        register = resource_tracker.register
        resource_tracker.register = _no_registration
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def close_segment(shm: SharedMemory) -> None:
    """Unmap a segment; views still alive somewhere keep the mapping until they go (harmless)."""
    try:
        shm.close()
    except BufferError:
        log.debug("segment %s still has views; it is unmapped when they are freed", shm.name)


class Segments:
    """The segments one parent created; ``unlink_all`` runs in the parent's ``finally``."""

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix or new_prefix()
        self._owned: list[SharedMemory] = []

    def create(self, suffix: str, size: int) -> SharedMemory:
        shm = SharedMemory(name=f"{self.prefix}-{suffix}", create=True, size=max(size, 1))
        self._owned.append(shm)
        return shm

    @property
    def names(self) -> list[str]:
        return [shm.name for shm in self._owned]

    def unlink_all(self) -> None:
        """Unlink every segment (first, so nothing leaks even if unmapping fails), then unmap them."""
        for shm in self._owned:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        for shm in self._owned:
            close_segment(shm)
        self._owned.clear()


def leftover_segments(prefix: str) -> list[str]:
    """Names under ``/dev/shm`` that start with ``prefix`` (empty where there is no /dev/shm)."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


def sweep(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with ``prefix``; return the names removed."""
    removed = []
    for name in leftover_segments(prefix):
        try:
            (SHM_DIR / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a killed child stays a zombie until its parent reaps it)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state = stat.rsplit(b")", 1)[-1].split()[0]
    return state not in (b"Z", b"X", b"x")
