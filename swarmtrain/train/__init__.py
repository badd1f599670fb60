"""Single-node training: the inner optimiser, atomic checkpoints, and the ``swarmtrain train`` loop."""

from swarmtrain.train.checkpoint import (
    Checkpoint,
    DamagedCheckpoint,
    Resumable,
    find_resumable,
    latest_checkpoint,
    list_checkpoints,
    no_intact_checkpoint,
    read_checkpoint,
    remove_stale_temps,
    save_checkpoint,
)
from swarmtrain.train.loop import run_training
from swarmtrain.train.trainer import Trainer, check_compatible, configure_threads

__all__ = [
    "Checkpoint",
    "DamagedCheckpoint",
    "Resumable",
    "Trainer",
    "check_compatible",
    "configure_threads",
    "find_resumable",
    "latest_checkpoint",
    "list_checkpoints",
    "no_intact_checkpoint",
    "read_checkpoint",
    "remove_stale_temps",
    "run_training",
    "save_checkpoint",
]
