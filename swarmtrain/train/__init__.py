"""Single-node training: the inner optimiser, atomic checkpoints, and the ``swarmtrain train`` loop."""

from swarmtrain.train.checkpoint import Checkpoint, latest_checkpoint, list_checkpoints, save_checkpoint
from swarmtrain.train.loop import run_training
from swarmtrain.train.trainer import Trainer, check_compatible, configure_threads

__all__ = [
    "Checkpoint",
    "Trainer",
    "check_compatible",
    "configure_threads",
    "latest_checkpoint",
    "list_checkpoints",
    "run_training",
    "save_checkpoint",
]
