"""Atomic, checksummed checkpoints: one safetensors file per checkpoint, JSON metadata in its header.

A checkpoint is written to a temp file, fsynced and renamed into place, so a crash (even SIGKILL mid-write)
leaves every earlier checkpoint intact and never a half-written one under a checkpoint's name. Its header holds a
SHA-256 of every tensor (dtype, shape and bytes) and of the metadata, checked on every load, so a truncated file
or a flipped bit is caught instead of trained on.

Retention counts only checkpoints that pass that check: a damaged one is renamed aside (``*.corrupt``) and
reported, never deleted and never counted, so the newest intact checkpoints always survive. Resuming walks from
the newest checkpoint back to the first that passes and says which it skipped and why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from swarmtrain.errors import CheckpointError
from swarmtrain.fsutil import atomic_write, fsync_dir

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{8,})\.safetensors$")
_TEMP = re.compile(r"^\.step-\d{8,}\.safetensors\..*\.tmp$")  # what fsutil.atomic_write leaves after a kill -9
_META_KEY = "swarmtrain"
_SUMS_KEY = "swarmtrain.sha256"  # {"meta": hex, "tensors": {name: hex}}


class DamagedCheckpoint(CheckpointError):
    """A checkpoint file is truncated, unreadable or fails its checksum: resume falls back to an earlier one."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


@dataclass
class Resumable:
    """What resuming found: the newest checkpoint that passed, and the newer ones skipped (file, reason)."""

    checkpoint: Checkpoint | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def report(self) -> str:
        """One line per skipped checkpoint, for the user."""
        return "\n".join(f"skipped {path.name}: {reason}" for path, reason in self.skipped)


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint files in ``run_dir``, oldest first (temp files and ``*.corrupt`` files are not listed)."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes."""
    flat = tensor.detach().contiguous().reshape(-1)
    h = hashlib.sha256(f"{flat.dtype}:{tuple(tensor.shape)}:".encode())
    h.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")
    return h.hexdigest()


def _sums(tensors: dict[str, torch.Tensor], meta_json: str) -> dict[str, Any]:
    return {
        "meta": hashlib.sha256(meta_json.encode()).hexdigest(),
        "tensors": {name: tensor_digest(t) for name, t in tensors.items()},
    }


# Files this process wrote or checked, with the (inode, size, mtime) they had then: retention trusts these
# without reading them again, so a save costs one write, not a read of every checkpoint it keeps.
_intact: dict[Path, tuple[int, int, int]] = {}


def _stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def save_checkpoint(run_dir: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any], keep: int) -> Path:
    """Atomically write a checkpoint for ``meta["step"]``, then keep the newest ``keep`` intact ones.

    Older intact checkpoints beyond ``keep`` are deleted; damaged ones are renamed to ``*.corrupt``.
    """
    path = checkpoint_dir(run_dir) / f"step-{int(meta['step']):08d}.safetensors"
    # safetensors refuses views and shared storage; contiguous clones are cheap next to the write itself.
    payload = {name: t.detach().contiguous().clone() for name, t in tensors.items()}
    meta_json = json.dumps(meta)
    header = {_META_KEY: meta_json, _SUMS_KEY: json.dumps(_sums(payload, meta_json))}
    atomic_write(path, lambda tmp: save_file(payload, str(tmp), metadata=header))
    _intact[path] = _stamp(path)
    _retain(path.parent, keep)
    return path


def _is_intact(path: Path) -> bool:
    try:
        if _intact.get(path) == _stamp(path):
            return True
        read_checkpoint(path)
    except DamagedCheckpoint as exc:
        quarantine(path, str(exc))
        return False
    except FileNotFoundError:
        return False
    return True


def _retain(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints that pass their checksum; set damaged ones aside as they are met."""
    kept, changed = 0, False
    for path in reversed(list_checkpoints(directory.parent)):
        if kept < keep:
            changed |= not (intact := _is_intact(path))
            kept += intact
        else:
            path.unlink(missing_ok=True)
            _intact.pop(path, None)
            changed = True
    if changed:
        fsync_dir(directory)


def quarantine(path: Path, reason: str) -> Path:
    """Rename a damaged checkpoint to ``<name>.corrupt`` (never overwriting an earlier one) and report it."""
    target = path.with_name(path.name + ".corrupt")
    for n in range(1, 1000):
        if not target.exists():
            break
        target = path.with_name(f"{path.name}.corrupt.{n}")
    os.replace(path, target)
    _intact.pop(path, None)
    log.warning("%s is damaged and was renamed to %s: %s", path.name, target.name, reason)
    return target


def remove_stale_temps(run_dir: str | Path) -> list[Path]:
    """Delete the temp files of checkpoint writes a crash interrupted; call it at start, before the first save."""
    directory = checkpoint_dir(run_dir)
    stale = [p for p in directory.iterdir() if _TEMP.match(p.name)] if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        fsync_dir(directory)
        log.info("removed %d temp file(s) of interrupted checkpoint writes in %s", len(stale), directory)
    return stale


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read one checkpoint and check every tensor and the metadata against its checksums.

    Raises ``DamagedCheckpoint`` (a ``CheckpointError``) naming what is wrong if the file is unreadable or fails.
    """
    path = Path(path)
    try:
        stamp = _stamp(path)
        tensors = load_file(str(path))
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))["__metadata__"]
        meta_json = header[_META_KEY]
        meta = json.loads(meta_json)
        sums = json.loads(header[_SUMS_KEY]) if _SUMS_KEY in header else None
    except (OSError, SafetensorError, ValueError, KeyError, TypeError) as exc:
        raise DamagedCheckpoint(f"checkpoint error: {path} cannot be read ({exc}).") from None
    if sums is None and set(header) != {_META_KEY}:  # a damaged key name, not a file from before checksums
        raise DamagedCheckpoint(f"checkpoint error: {path} fails its checksum (its header is damaged).")
    if sums is None:
        log.warning("%s was written before checkpoints had checksums; it is loaded unchecked", path.name)
    else:
        _verify(path, tensors, meta_json, sums)
    _intact[path] = stamp
    return Checkpoint(path, tensors, meta)


def _verify(path: Path, tensors: dict[str, torch.Tensor], meta_json: str, sums: Any) -> None:
    expected = sums.get("tensors") if isinstance(sums, dict) else None
    if not isinstance(expected, dict) or set(expected) != set(tensors):
        raise DamagedCheckpoint(f"checkpoint error: {path} does not list the tensors its checksums cover.")
    actual = _sums(tensors, meta_json)
    if actual["meta"] != sums.get("meta"):
        raise DamagedCheckpoint(f"checkpoint error: {path} fails its checksum (the metadata is damaged).")
    bad = sorted(name for name, digest in actual["tensors"].items() if expected[name] != digest)
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise DamagedCheckpoint(f"checkpoint error: {path} fails its checksum (tensor {shown} is damaged).")


def find_resumable(run_dir: str | Path, check: Callable[[Checkpoint], None] | None = None) -> Resumable:
    """Walk from the newest checkpoint back to the first that reads, passes its checksum and ``check``.

    ``check`` may raise ``DamagedCheckpoint`` (that file is skipped too) or any other ``CheckpointError`` (the
    walk stops: a checkpoint for another model is the user's config, not damage). Nothing is renamed here, so a
    refused start changes nothing; the next save sets damaged files aside.
    """
    found = Resumable(None)
    for path in reversed(list_checkpoints(run_dir)):
        try:
            checkpoint = read_checkpoint(path)
            if check is not None:
                check(checkpoint)
        except DamagedCheckpoint as exc:
            log.info("skipping %s: %s", path.name, exc)  # the caller prints the report to the user
            reason = str(exc).removeprefix("checkpoint error: ").replace(f"{path} ", "it ", 1).rstrip(".")
            found.skipped.append((path, reason))
            _intact.pop(path, None)
            continue
        found.checkpoint = checkpoint
        break
    return found


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The newest intact checkpoint in ``run_dir``, or ``None`` if there is none."""
    return find_resumable(run_dir).checkpoint


def no_intact_checkpoint(run_dir: str | Path, found: Resumable, fix: str) -> CheckpointError:
    """The error ``--resume`` gives when no checkpoint passes: each file skipped and why, and ``fix``."""
    directory = checkpoint_dir(run_dir)
    if not found.skipped:
        return CheckpointError(f"checkpoint error: --resume found no readable checkpoint in {directory}. {fix}")
    reasons = "; ".join(f"{path.name}: {reason}" for path, reason in found.skipped)
    return CheckpointError(
        f"checkpoint error: --resume found no readable checkpoint in {directory}: every one is damaged ({reasons}). "
        f"{fix}"
    )


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Flatten an optimizer's state into named tensors plus JSON-able param-group hyperparameters."""
    state = optimizer.state_dict()
    tensors = {
        f"optim.{index}.{key}": value if torch.is_tensor(value) else torch.tensor(value)
        for index, per_param in state["state"].items()
        for key, value in per_param.items()
    }
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in state["param_groups"]]
    return tensors, groups


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]
) -> None:
    """Inverse of ``optimizer_tensors``."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    restored = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in groups]
    optimizer.load_state_dict({"state": state, "param_groups": restored})
