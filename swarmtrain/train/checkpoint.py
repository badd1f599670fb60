"""Atomic checkpoints: one safetensors file per checkpoint, JSON metadata in its header.

A checkpoint is written to a temp file, fsynced and renamed into place, so a crash (even SIGKILL mid-write)
leaves every earlier checkpoint intact and never a half-written one under a checkpoint's name. Loading walks
from the newest checkpoint back and skips any that cannot be read.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from swarmtrain.errors import CheckpointError
from swarmtrain.fsutil import atomic_write, fsync_dir

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{8,})\.safetensors$")
_META_KEY = "swarmtrain"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint files in ``run_dir``, oldest first (temp files of interrupted writes are not listed)."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(run_dir: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any], keep: int) -> Path:
    """Atomically write a checkpoint for ``meta["step"]`` and delete all but the newest ``keep``."""
    path = checkpoint_dir(run_dir) / f"step-{int(meta['step']):08d}.safetensors"
    # safetensors refuses views and shared storage; contiguous clones are cheap next to the write itself.
    payload = {name: t.detach().contiguous().clone() for name, t in tensors.items()}
    atomic_write(path, lambda tmp: save_file(payload, str(tmp), metadata={_META_KEY: json.dumps(meta)}))
    old = list_checkpoints(run_dir)[:-keep]
    for stale in old:
        stale.unlink(missing_ok=True)
    if old:
        fsync_dir(path.parent)
    return path


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read one checkpoint; raise ``CheckpointError`` if it is unreadable."""
    path = Path(path)
    try:
        tensors = load_file(str(path))
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        meta = json.loads(header["__metadata__"][_META_KEY])
    except (OSError, SafetensorError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint error: {path} cannot be read ({exc}).") from None
    return Checkpoint(path, tensors, meta)


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The newest readable checkpoint in ``run_dir``, or ``None`` if there is none."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return read_checkpoint(path)
        except CheckpointError as exc:
            log.warning("skipping unreadable checkpoint: %s", exc)
    return None


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
