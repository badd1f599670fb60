"""A node's run directory: refuse to overwrite a node's run, or find and check the checkpoint to resume from.

    swarmtrain node --run-dir runs/a --resume --join /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...

A node checkpoint holds the inner trainer's state (``node.inner``), theta_g and the outer momentum as
``outer.theta`` / ``outer.momentum`` (none where ``averaging.outer_momentum`` is 0), and the round and digest of
that outer state in its metadata; the file's checksums cover every tensor (the inner trainer's included) and the
metadata. ``--resume`` walks back from the newest checkpoint to the first that passes those checks and the outer
digest, and names each one it skipped. Everything here runs before the node starts its daemons or writes to the
run directory (stale temp files of a killed write aside), so a refused start changes nothing else.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from swarmtrain.averaging import outer_digest, state_digest
from swarmtrain.config import Config
from swarmtrain.errors import CheckpointError
from swarmtrain.train import (
    Checkpoint,
    DamagedCheckpoint,
    check_compatible,
    find_resumable,
    list_checkpoints,
    no_intact_checkpoint,
    remove_stale_temps,
)

OUTER = ("theta", "momentum")  # in the digest's order; a node without an outer momentum keeps theta alone


def open_run_dir(config: Config, resume: bool) -> Checkpoint | None:
    """The checkpoint to resume from (checked), or None for a fresh start in a run directory without one."""
    run_dir = Path(config.run_dir)
    if not resume:
        if existing := list_checkpoints(run_dir):
            raise CheckpointError(
                f"checkpoint error: {run_dir} already holds a run (latest checkpoint {existing[-1].name}). Pass "
                f"--resume to continue it (`swarmtrain node --run-dir {run_dir} --resume ...`), or choose a new "
                "--run-dir to start another node."
            )
        remove_stale_temps(run_dir)
        return None
    found = find_resumable(run_dir, check=lambda checkpoint: _check(checkpoint, config))
    if found.checkpoint is None:
        raise no_intact_checkpoint(
            run_dir, found, "Drop --resume to start a new node there, or point --run-dir at the run directory of the "
            "node to continue.",
        )  # fmt: skip
    if found.skipped:
        print(found.report(), flush=True)
    remove_stale_temps(run_dir)
    return found.checkpoint


def _check(checkpoint: Checkpoint, config: Config) -> None:
    check_compatible(checkpoint, config)  # another model: the user's config, refused
    outer_state(checkpoint)  # a damaged outer state: skipped, the walk goes on


def outer_state(checkpoint: Checkpoint, momentum: bool | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """Round and tensors of the outer state in ``checkpoint``, verified against its digest; with ``momentum``
    (whether the resuming node keeps an outer momentum), fitted to that node (``_fitted``)."""
    found = {name: checkpoint.tensors[f"outer.{name}"] for name in OUTER if f"outer.{name}" in checkpoint.tensors}
    meta = checkpoint.meta
    round_, digest = meta.get("round"), meta.get("digest")
    counts_ok = all(isinstance(meta.get(k), int) for k in ("round", "step", "tokens"))
    if not counts_ok or not isinstance(digest, str) or "theta" not in found:
        raise CheckpointError(
            f"checkpoint error: {checkpoint.path} is not a swarm node's checkpoint (no outer state; `swarmtrain "
            "train` writes such files). Start the node with a new --run-dir."
        )
    # Nodes before protocol 14 wrote a digest of the whole state at once (BLAKE3; before protocol 10, SHA-256):
    # their checkpoints still resume, with the current digest.
    matches = digest in (
        outer_digest(*found.values()), state_digest(*found.values()),
        state_digest(*found.values(), hasher=hashlib.sha256),
    )  # fmt: skip
    if any(t.shape != found["theta"].shape for t in found.values()) or not matches:
        raise DamagedCheckpoint(
            f"checkpoint error: the outer state in {checkpoint.path} does not match its digest {digest[:8]} (the "
            "file is damaged)."
        )
    return round_, found if momentum is None else _fitted(found, momentum)


def _fitted(found: dict[str, torch.Tensor], momentum: bool) -> dict[str, torch.Tensor]:
    """The outer state for a node with or without a momentum buffer: a checkpoint written without one gives a buffer
    of zeros (what it was); one written with one (or by a node before protocol 12, which kept a buffer of zeros
    without a momentum) gives theta_g alone to a node without one, and says so if the buffer was not zeros."""
    if momentum and "momentum" not in found:
        return {**found, "momentum": torch.zeros_like(found["theta"])}
    if not momentum and "momentum" in found:
        if found["momentum"].any():
            print("the checkpoint's outer momentum is dropped: averaging.outer_momentum is 0 now", flush=True)
        return {"theta": found["theta"]}
    return found
