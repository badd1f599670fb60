"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader sees the old file or the new one, never a torn one, even if the writer is killed with SIGKILL
or the machine loses power mid-write.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_dir(directory: str | Path) -> None:
    """Persist a rename or unlink inside ``directory``."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(target: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` and atomically move the result to ``target``; the temp file never survives."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would make checkpoints private to the writer
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return target


def atomic_write_bytes(target: str | Path, data: bytes) -> Path:
    """Atomically replace ``target`` with ``data``."""
    return atomic_write(target, lambda tmp: tmp.write_bytes(data))
